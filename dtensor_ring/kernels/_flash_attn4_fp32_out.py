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
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
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
            mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx]
            gLSE = cute.local_tile(mLSE_cur, (self.tile_m,), (m_block,))
            gLSE_expanded_layout = cute.append(
                gLSE.layout, cute.make_layout((self.tile_hdimv,), stride=(0,))
            )
            gLSE_expanded = cute.make_tensor(gLSE.iterator, gLSE_expanded_layout)
            taccOgLSE = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(gLSE_expanded))
            taccOcO_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cO))
            t0accOcO = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cO))
            if taccOcO_mn[0][1] == 0:
                for m in cutlass.range(cute.size(taccOgLSE.shape[1]), unroll_full=True):
                    if t0accOcO[m, 0][0] < rows_left - taccOcO_mn[0][0]:
                        taccOgLSE[m, 0] = lse[m]
        # mO: (seqlen, d, h[, b]) of the input dtype over rows of 2 d; as fp32: rows of d. The
        # parent assumes its strides 16-byte aligned; so are the fp32 ones (a multiple of 4).
        stride32 = tuple(_half_stride(s) if i != 1 else s for i, s in enumerate(mO.stride))
        mO32 = cute.make_tensor(
            cute.recast_ptr(mO.iterator, dtype=Float32), cute.make_layout(mO.shape, stride=stride32)
        )
        mO_cur = seqlen.offset_batch_Q(mO32, batch_idx, dim=3)[None, None, head_idx]
        gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
        taccOgO = thr_mma.partition_C(gO)
        if rows_left >= self.tile_m and mO.shape[1] == self.tile_hdimv:
            # a whole tile: a thread's column pairs as 8-byte stores
            cute.autovec_copy(acc_O, taccOgO)
        else:
            taccOcO = thr_mma.partition_C(cO)
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                if taccOcO[i][0] < rows_left and taccOcO[i][1] < mO.shape[1]:
                    taccOgO[i] = acc_O[i]


def _half_stride(stride):
    """A stride of the input dtype as one of fp32, its 16-byte alignment kept for the DSL."""
    if isinstance(stride, int):
        return stride // 2
    return cute.assume(stride // 2, divby=4)
