"""A ring's dq accumulated by flash-attn 4's own backward kernel, dense and varlen.

Note [dq accumulated inside flash-attn 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The main kernel does not write dq: it adds it into ``dq_accum`` (a bulk reduce-add into global
memory), which the preprocess zeroed. A ring's backward runs every block of a rank's queries
into one such accumulator (:class:`RingDq`), so the kernel itself sums the blocks, in fp32:

    per block, summed by the engine              accumulated by the kernel (RingDq)
    preprocess(out_b, dout_b): dq_b = 0          preprocess(out, dout) once: dq_acc = 0
    main kernel: dq_b += ...                     main kernel on q[a:b]: dq_acc[a:b] += ...
    reorder dq_b; dq[a:b] += dq_b (side stream)  -
    dq = round(dq)                               dq = round(scale * dq_acc[perm]) once

Rows ``[a, b)`` of the accumulator are the flat range ``[a * D_r, (a + rows_r) * D_r)`` of each
head when ``a`` starts a tile (``rows_r`` = the block's rows rounded up to tiles), and
``dpsum`` / ``lse_log2`` are the same rows of the one preprocess's (a block's rows of ``out``,
``dout`` and ``lse`` are the rows of the whole). So the accumulator serves a plan whose blocks
start their query rows on tiles (zigzag's halves and the ring's whole shards at 64-token
multiples); any other plan sums per block as above. Every block is compiled with one tile
configuration, a causal block's (``_TILES``): for head dims 97-128 flash-attn 4 picks 80-row
tiles for unmasked blocks and 64 for causal ones, whose tile orders differ; 64 rows is what it
itself runs unmasked blocks with under block sparsity. dq never leaves the rank, so this is a
rank's own choice; dK/dV, which travel, are as in Note [Unrounded block gradients from
flash-attn 4] (``flash_attn4_grads.py``, whose pieces these accumulators run).

Note [A varlen dq accumulated inside flash-attn 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
flash-attn 4's varlen accumulators (dq_accum, dpsum, lse_log2; dK/dV with GQA) keep each
document ``b`` in whole tiles from a *padded* row ``(cu_seqlens[b] + b * m) // m * m``, and its
kernels read a document's rows from ``cu_seqlens[b]`` on, ``seqused[b]`` of them where given. A
ring's varlen block holds some rows of some local documents (a zigzag half, a span); run on a
copy of its rows (``_flash_attn_bwd``, what the engine does without this), each block gets its
own padded layout and its own preprocess and postprocess. :class:`RingDqVarlen` instead hands
the kernel the *whole* local queries with one batch entry per local document ``d``:

    cu_seqlens_q[d] = the row of the block's first query of d     (in the local tensor)
    seqused_q[d]    = its queries of d (0: none)                  cu_seqlens_k: its K/V rows

so document ``d``'s rows land at ``(cu_seqlens_q[d] + d * m) // m * m``, which is the whole
local tensor's padded row of that query (one preprocess of all local queries, as dense) when it
lies a whole number of tiles into its document:

    local documents     |  doc 0 (160 rows)            | doc 1 (96 rows)     |
    padded (m = 64)     | t0 | t1 | t2 (32 + 32 pad)   | t3 | t4 (32 + 32)   |
    a block's queries      [--- rows 64..160 ----]        [rows 0..64]
                           starts on t1, ends at doc end  starts on t3, ends on a tile

A block's queries of a document must start on a tile and end on one or at the document's end:
the kernel reads whole tiles and hides rows past a document only through their +inf lse_log2,
which the rows of a tile past a span that ends mid-document do not have. A rank whose blocks
are not so (or with more than ``_MAX_DOCUMENTS`` documents, where ``_flash_attn_bwd`` adds a
batch-lookup table) sums per block. The block's K/V are taken by the engine as before; with GQA
its dK/dV stay in their padded tiles until the engine adds them (``padded_rows``, Note [Block
dK/dV added from flash-attn 4's tiles]); dq is gathered once at the end. Checked on CPU
against a stand-in that reads whole tiles like the kernel (``tests/test_kernel_adapters.py``),
and on an H100 (2026-12-05, the ``ring_varlen`` part of ``tests/gpu/check_flash_attn4.py``:
zigzag and the document layout with GQA, dq as the per-block path's, dk and dv as
single-device flash-attn 4's; MHA, a window, deterministic). Its host work a block (the
padded rows kept per block, one Triton launch adding dK/dV from their tiles) is that of the
per-block path or less (docs/performance.md);
``FlashAttn4Kernel.varlen_dq_in_kernel = False`` turns it off.

Note [Block dK/dV added from flash-attn 4's tiles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With GQA the main kernel adds each query head's share of a block's dK/dV into zeroed fp32
tiles (fragment order, padded rows when varlen). The engine adds a block's dK/dV into the
ring's fp32 accumulators (the visiting K/V's, which travel on) once they have arrived. Both
accumulators hold these blocks handed back as :class:`TiledGrads` (the engine's
``HeldKVGrads``), and the engine's add is one launch from the tiles:

    reorder, then add (before)                      from the tiles (TiledGrads.add_to)
    tiles -> rows (in place, or a fresh [T, H, D])  -
    acc[rows of the block's K/V] += rows            acc[rows] += scale * tiles[perm]

one pass over the block's fp32 dK/dV fewer (read and write), and, varlen, no fresh copy of
them. The rows of the accumulator are the block's K/V part: a run (a strided view of any
row stride) or the rows of an index (varlen parts that are not one run). The tiles stay
the kernel's until the add, so the add waits for nothing new: it runs where the engine's
add ran. On CPU ``add_to`` reorders, then adds (the stand-in's order, in the ring tests of
``tests/test_kernel_adapters.py``); the Triton launch is checked against that on the GPU by
``tests/gpu/check_inputs.py`` and, in a ring against fp64, by ``tests/gpu/check_flash_attn4.py``
(parts ``ring``, ``ring_varlen``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import torch
from torch import Tensor

from ..parts import Block
from .base import BlockKVGrads, VarlenQueryRows, capturing
from .flash_attn4_grads import (
    BlockPlan,
    contiguous,
    main_kernel,
    new_dkv,
    plan_of,
    preprocess,
)
from .flash_attn4_tiles import (
    TiledGrads,
    as_BSHD,
    padded_rows,
    padded_total,
    untile_,
    untile_rows,
)


class _KernelDq:
    """What :class:`RingDq` and :class:`RingDqVarlen` share: the one preprocess of all local
    queries (``tensors``: dout, q, out, lse) into an fp32 accumulator ``accum_shape``
    (``cu_seqlens``: varlen), and each block's plan."""

    def __init__(
        self,
        iface,
        tensors,
        plan: BlockPlan,
        scale,
        window_args,
        deterministic,
        accum_shape: tuple[int, ...],
        cu_seqlens=None,
    ):
        self._iface, self._plan = iface, plan
        self._dout, self._q, self._out, lse = tensors
        self._scale, self._window_args, self._deterministic = scale, window_args, deterministic
        self._dq_accum = torch.empty(accum_shape, dtype=torch.float32, device=lse.device)
        self._dpsum, self._lse_log2 = preprocess(
            iface, plan, self._out, self._dout, lse, self._dq_accum, cu_seqlens
        )

    def _held(self, plan: BlockPlan, dkv: list[Tensor], rows: Tensor | None, seq: int):
        """A block's GQA dK/dV accumulators as the engine adds them (Note [Block dK/dV added
        from flash-attn 4's tiles]): dK scaled by the softmax scale, as the postprocess does."""
        dims = [plan.head_dim, plan.head_dim_v]
        tile = plan.cfg.n_block_size
        return TiledGrads(dkv, plan.perms[1:], [self._scale, 1.0], rows, tile, dims, seq)

    def _block_plan(self, block: Block, q, k, v, dout, seqlens=None) -> BlockPlan:
        """``block``'s plan in the accumulator's tile configuration (``_TILES``)."""
        window = self._window_args(block.window)
        left, right = window["window_size_left"], window["window_size_right"]
        mask = (block.causal, left, right, self._deterministic, _TILES, seqlens)
        plan = plan_of(self._iface, q, k, v, dout, *mask)
        if plan is None:  # of() learnt every tile order of this configuration
            raise RuntimeError("flash-attn 4's tile orders changed within a backward")
        return plan


class RingDq(_KernelDq):
    """The dq of a ring's backward, accumulated by flash-attn 4's own kernel (Note [dq
    accumulated inside flash-attn 4]): a :class:`~dtensor_ring.kernels.DqAccumulator`. Build
    with :meth:`of`."""

    def __init__(self, iface, tensors, plan: BlockPlan, scale, window_args, deterministic):
        batch, _, num_head, _ = tensors[1].shape
        shape = (batch, num_head, plan.seq_q_r * plan.hd_r)
        super().__init__(iface, tensors, plan, scale, window_args, deterministic, shape)

    @classmethod
    def of(
        cls,
        interface: ModuleType,
        dout_BSHD: Tensor,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_BSHD: Tensor,
        lse_BHS: Tensor,
        blocks: Sequence[Block],
        *,
        scale: float,
        window_args: Callable[[tuple[int, int] | None], dict],
        deterministic: bool,
    ) -> RingDq | None:
        """The accumulator for ``blocks`` of the local queries ``q`` against K/V shaped as the
        local ``k``/``v``, with a positive ``scale``; ``window_args(window)``: flash-attn 4's
        window keywords. ``None`` (nothing launched) where a block's query rows do not start
        on a tile of the kernel's configuration, or where ``plan_of`` finds none."""
        iface = interface
        tensors = contiguous(iface, dout_BSHD, q_BSHD, out_BSHD, lse_BHS)
        dout, q = tensors[:2]
        k, v = contiguous(iface, k_BSHD, v_BSHD)
        plan = plan_of(iface, q, k, v, dout, True, None, 0, deterministic, _TILES)
        if plan is None:
            return None
        m, seqlen_q = plan.cfg.m_block_size, q.shape[1]
        for blk in blocks:
            a, b = blk.q.bounds(seqlen_q)
            if a % m or (b % m and b != seqlen_q):
                return None
        return cls(iface, tensors, plan, scale, window_args, deterministic)

    def backward(self, block: Block, k_BSHD: Tensor, v_BSHD: Tensor) -> BlockKVGrads:
        """Add ``block``'s dq into the accumulator (its query rows of the local queries, against
        ``k``/``v``); return its ``(dk, dv)``: in the input dtype (``H == H_kv``), else held
        in the kernel's tiles (:class:`TiledGrads`)."""
        iface = self._iface
        a, b = block.q.bounds(self._q.shape[1])
        q, dout = self._q[:, a:b], self._dout[:, a:b]
        k, v = contiguous(iface, k_BSHD, v_BSHD)
        plan = self._block_plan(block, q, k, v, dout)
        hd_r, rows = self._plan.hd_r, slice(a, a + plan.seq_q_r)
        dq_accum = self._dq_accum[:, :, rows.start * hd_r : rows.stop * hd_r]
        dpsum, lse_log2 = self._dpsum[:, :, rows], self._lse_log2[:, :, rows]
        dk, dv = new_dkv(plan, k, v)
        main_kernel(iface, plan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, self._scale)
        if plan.group == 1:
            return dk, dv
        return self._held(plan, [dk, dv], None, k.shape[1])

    def result(self) -> Tensor:
        """dq ``[B, S, H, D]`` in the input dtype: the accumulator scaled and rounded once."""
        plan, q = self._plan, self._q
        untile_([self._dq_accum], plan.perms[:1], [self._scale])
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return dq.copy_(as_BSHD(self._dq_accum, plan.hd_r, q.shape[1], q.shape[3]))


class RingDqVarlen(_KernelDq):
    """:class:`RingDq` for varlen blocks (Note [A varlen dq accumulated inside flash-attn 4]).
    Build with :meth:`of`."""

    def __init__(
        self,
        iface,
        tensors,
        plan: BlockPlan,
        cu_seqlens,
        rows,
        cache,
        scale,
        window_args,
        deterministic,
    ):
        self._cu_seqlens, self._rows, self._cache = cu_seqlens, rows, cache
        total, num_head = tensors[1].shape[:2]
        shape = (num_head, padded_total(total, cu_seqlens, plan.cfg.m_block_size) * plan.hd_r)
        super().__init__(iface, tensors, plan, scale, window_args, deterministic, shape, cu_seqlens)

    @classmethod
    def of(
        cls,
        interface: ModuleType,
        dout_THD: Tensor,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out_THD: Tensor,
        lse_HT: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        rows: Mapping[Block, VarlenQueryRows],
        *,
        scale: float,
        cache: dict,
        window_args: Callable[[tuple[int, int] | None], dict],
        deterministic: bool,
    ) -> RingDqVarlen | None:
        """The accumulator for the blocks of ``rows`` of the local documents ``cu_seqlens``,
        with a positive ``scale``; ``cache``: kept with these documents and rows for the next
        backward (the padded rows of dq, dK and dV); ``window_args`` as for
        :meth:`RingDq.of`. ``None`` (nothing launched) where a block's query rows in a
        document do not start on a tile of the kernel and end on one or at the document's end,
        past ``_MAX_DOCUMENTS`` documents, or where ``plan_of`` finds none."""
        iface = interface
        if cu_seqlens.shape[0] - 1 > _MAX_DOCUMENTS:
            return None
        tensors = contiguous(iface, dout_THD, q_THD, out_THD, lse_HT)
        dout, q = tensors[:2]
        k, v = contiguous(iface, k_THD, v_THD)
        seqlens = (max_seqlen, max_seqlen)
        plan = plan_of(iface, q, k, v, dout, True, None, 0, deterministic, _TILES, seqlens)
        if plan is None:
            return None
        m = plan.cfg.m_block_size
        for r in rows.values():
            if any(a % m or (b % m and b != n) for a, b, n in r.q_spans):
                return None
        args = (cu_seqlens, rows, cache, scale, window_args, deterministic)
        return cls(iface, tensors, plan, *args)

    def backward(self, block: Block, k_THD: Tensor, v_THD: Tensor) -> BlockKVGrads:
        """Add ``block``'s dq into the accumulator (its rows of the local queries, read in
        place, against ``k``/``v``, the block's K/V as taken); return its ``(dk, dv)``
        ``[T_k, H_kv, D]`` as :meth:`RingDq.backward` does."""
        iface, q, dout = self._iface, self._q, self._dout
        r, k, v = self._rows[block], *contiguous(iface, k_THD, v_THD)
        plan = self._block_plan(block, q, k, v, dout, (r.max_seqlen_q, r.max_seqlen_k))
        dk, dv = new_dkv(plan, k, v, r.cu_seqlens_k)
        varlen = (r.q_starts, r.cu_seqlens_k, r.q_used)
        accums = (self._lse_log2, self._dpsum, self._dq_accum)
        main_kernel(iface, plan, q, k, v, dout, *accums, dk, dv, self._scale, varlen)
        if plan.group == 1:
            return dk, dv
        rows = self._padded_rows(block, r.cu_seqlens_k, k.shape[0], plan.cfg.n_block_size)
        return self._held(plan, [dk, dv], rows, k.shape[0])

    def result(self) -> Tensor:
        """dq ``[T, H, D]`` in the input dtype: the accumulator scaled and rounded once."""
        plan, q, tile = self._plan, self._q, self._plan.cfg.m_block_size
        rows = self._padded_rows(None, self._cu_seqlens, q.shape[0], tile)
        scale, dims = [self._scale], [q.shape[2]]
        return untile_rows([self._dq_accum], plan.perms[:1], scale, rows, tile, dims, q.dtype)[0]

    def _padded_rows(self, block: Block | None, cu_seqlens: Tensor, total: int, tile: int):
        """:func:`padded_rows` of ``block``'s K/V (None: of the local queries), kept in the
        cache for the next backward (about ten small ops: host time)."""
        key = ("padded rows", block, total, tile)
        index = self._cache.get(key)
        if index is None:
            index = padded_rows(cu_seqlens, total, tile)
            if not capturing(index.device):
                self._cache[key] = index
        return index


# The tile configuration (causal, local) every block of a RingDq is compiled with: one tile
# order for the whole accumulator (Note [dq accumulated inside flash-attn 4]).
_TILES = (True, False)

# Documents above which _flash_attn_bwd hands its varlen kernels a batch-lookup table
# (BIN_BATCH_SEARCH_THRESH): RingDqVarlen leaves such calls to the plain backward.
_MAX_DOCUMENTS = 256
