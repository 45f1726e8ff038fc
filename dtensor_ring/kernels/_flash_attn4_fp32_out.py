"""flash-attn 4's sm90 forward kernel with its output written in fp32 (Note [fp32 block outputs
from flash-attn 4] in ``flash_attn4_launch.py``). Imports the CUTLASS DSL: imported lazily, on
a GPU that runs it, never by ``import dtensor_ring``.

The kernel class is flash-attn 4's own, with two changes: the epilogue stores the normalised
fp32 accumulator ``acc_O`` from registers straight to global memory (the parent rounds it to
the input dtype and stages it through shared memory for a TMA store): a whole tile as a
thread's column pairs in 8-byte stores, a partial one value by value; and the output's TMA is
off (``use_tma_O``: the store is plain). ``mO`` arrives typed as the input dtype (the wrapper
checks it so): a view of the first ``D`` of ``2 D`` values a row of an fp32 buffer, which the
epilogue reads back as that buffer.

:class:`FlashAttentionForwardSm90Fp32Merge` merges instead (Note [Merging in flash-attn 4's
epilogue] in ``flash_attn4_launch.py``): ``mO`` / ``mLSE`` hold a ring's running ``(out, lse)``
and each row becomes the merge of what they hold and the block's row.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd
from quack import layout_utils


class FlashAttentionForwardSm90Fp32Out(FlashAttentionForwardSm90):
    """:class:`FlashAttentionForwardSm90` writing ``out`` in fp32; no pack-GQA."""

    @property
    def use_tma_O(self) -> bool:  # the parent's __call__ sets it; the fp32 store is plain
        return False

    @use_tma_O.setter
    def use_tma_O(self, value: bool) -> None:
        pass

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],  # noqa: UP045 (as the parent's: the DSL reads them)
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        assert not self.pack_gqa
        thr_mma = tiled_mma.get_slice(tidx)
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        if const_expr(mLSE is not None):  # as the parent writes it
            taccOgLSE, taccOcO_mn = self._lse_tile(
                mLSE, seqlen, batch_idx, head_idx, m_block, thr_mma
            )
            t0accOcO = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cO))
            if taccOcO_mn[0][1] == 0:
                for m in cutlass.range(cute.size(taccOgLSE.shape[1]), unroll_full=True):
                    if t0accOcO[m, 0][0] < rows_left - taccOcO_mn[0][0]:
                        taccOgLSE[m, 0] = lse[m]
        taccOgO = thr_mma.partition_C(self._fp32_tile(mO, seqlen, batch_idx, head_idx, m_block))
        self._copy_rows(acc_O, taccOgO, thr_mma.partition_C(cO), rows_left, mO.shape[1])

    def _lse_tile(self, mLSE: cute.Tensor, seqlen, batch_idx, head_idx, m_block, thr_mma):
        """This thread's part of the block's ``(tile_m,)`` lse tile as the parent partitions it,
        broadcast over the columns and reshaped to (rows, columns), and the coordinates of
        this thread's accumulator values in the same shape."""
        mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx]
        gLSE = cute.local_tile(mLSE_cur, (self.tile_m,), (m_block,))
        gLSE_expanded_layout = cute.append(
            gLSE.layout, cute.make_layout((self.tile_hdimv,), stride=(0,))
        )
        gLSE_expanded = cute.make_tensor(gLSE.iterator, gLSE_expanded_layout)
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        return (
            layout_utils.reshape_acc_to_mn(thr_mma.partition_C(gLSE_expanded)),
            layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cO)),
        )

    @cute.jit
    def _copy_rows(
        self, src: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor, rows_left, cols
    ) -> None:
        """Copy a thread's values between its registers and its part of a tile of the fp32
        buffer, which holds ``rows_left`` rows of ``cols`` columns from this tile on: a whole
        tile as column pairs in 8-byte accesses, a partial one value by value (every access
        issued before any value is used: a load's values arrive together)."""
        if rows_left >= self.tile_m and cols == self.tile_hdimv:
            cute.autovec_copy(src, dst)
        else:
            for i in cutlass.range_constexpr(cute.size(src)):
                if coords[i][0] < rows_left and coords[i][1] < cols:
                    dst[i] = src[i]

    def _fp32_tile(self, mO: cute.Tensor, seqlen, batch_idx, head_idx, m_block) -> cute.Tensor:
        """The ``(tile_m, tile_hdimv)`` tile of the fp32 buffer behind ``mO``: ``mO`` (seqlen, d,
        h[, b]) of the input dtype over rows of 2 d; as fp32: rows of d. The parent assumes its
        strides 16-byte aligned; so are the fp32 ones (a multiple of 4)."""
        stride32 = tuple(_half_stride(s) if i != 1 else s for i, s in enumerate(mO.stride))
        mO32 = cute.make_tensor(
            cute.recast_ptr(mO.iterator, dtype=Float32), cute.make_layout(mO.shape, stride=stride32)
        )
        mO_cur = seqlen.offset_batch_Q(mO32, batch_idx, dim=3)[None, None, head_idx]
        return cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))


class FlashAttentionForwardSm90Fp32Merge(FlashAttentionForwardSm90Fp32Out):
    """:class:`FlashAttentionForwardSm90Fp32Out` merging its rows into ``mO`` (fp32) and
    ``mLSE``, which hold a running ``(out, lse)``, by the formulas of the engine's merge
    (Note [Online-softmax merge] in ``merge.py``, as ``_triton_merge.py`` computes them):

        out = sigmoid(lse_old - lse_b) out_old + sigmoid(lse_b - lse_old) out_b
        lse = logaddexp(lse_old, lse_b)        (an infinite maximum: the maximum itself)

    Every thread
    reads its rows' old lse before any writes the new one (a barrier of the epilogue threads:
    a row's lse is read by its four threads and written by one), and all its old output values
    before it writes one (a partial tile too: Note [Merging in flash-attn 4's epilogue])."""

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],  # noqa: UP045
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        assert not self.pack_gqa
        assert mLSE is not None
        thr_mma = tiled_mma.get_slice(tidx)
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        taccOgLSE, taccOcO_mn = self._lse_tile(mLSE, seqlen, batch_idx, head_idx, m_block, thr_mma)
        w_old = cute.make_fragment_like(lse, Float32)
        w_new = cute.make_fragment_like(lse, Float32)
        lse_out = cute.make_fragment_like(lse, Float32)
        for m in cutlass.range(cute.size(lse), unroll_full=True):
            old = Float32(-Float32.inf)
            if taccOcO_mn[m, 0][0] < rows_left:
                old = taccOgLSE[m, 0]
            new = lse[m]
            w_old[m] = 1.0 / (1.0 + cute.math.exp(new - old))  # sigmoid(old - new)
            w_new[m] = 1.0 / (1.0 + cute.math.exp(old - new))
            top = cute.arch.fmax(old, new)
            infinite = top == Float32.inf or top == -Float32.inf
            lse_out[m] = (
                top
                if infinite
                else top + cute.math.log(cute.math.exp(old - top) + cute.math.exp(new - top))
            )
        taccOgO = thr_mma.partition_C(self._fp32_tile(mO, seqlen, batch_idx, head_idx, m_block))
        taccOcO = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        old_O = cute.make_fragment_like(acc_O, Float32)
        self._copy_rows(taccOgO, old_O, taccOcO, rows_left, mO.shape[1])
        # rows past the tile's end merge values never loaded; they are not stored
        acc_mn = layout_utils.reshape_acc_to_mn(acc_O)
        old_mn = layout_utils.reshape_acc_to_mn(old_O)
        for m in cutlass.range(cute.size(lse), unroll_full=True):
            acc_mn[m, None].store(
                old_mn[m, None].load() * w_old[m] + acc_mn[m, None].load() * w_new[m]
            )
        self._copy_rows(acc_O, taccOgO, taccOcO, rows_left, mO.shape[1])
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads
        )
        if taccOcO_mn[0, 0][1] == 0:  # the thread of column 0 writes its rows' lse
            for m in cutlass.range(cute.size(lse), unroll_full=True):
                if taccOcO_mn[m, 0][0] < rows_left:
                    taccOgLSE[m, 0] = lse_out[m]


def _half_stride(stride):
    """A stride of the input dtype as one of fp32, its 16-byte alignment kept for the DSL."""
    if isinstance(stride, int):
        return stride // 2
    return cute.assume(stride // 2, divby=4)
