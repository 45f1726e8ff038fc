"""The engine's :class:`~dtensor_ring.engine.blocks.Blocks` for packed documents: a plan's
parts as rows of every local document and their kernel metadata, built once per plan and set
of documents (:func:`varlen_blocks`, cached).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import BlockKernel, BlockKVGrads
from ..kernels.base import VarlenQueryRows, capturing
from ..kernels.merge import add_rows_, merge_
from ..parts import Block, DocSpans, Part, concat_ranges
from ..schedule.plan import Plan
from .blocks import softmax_empty_rows

# Note [Varlen blocks merged where their rows lie]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A varlen block's queries are a Part of every local document (zigzag's halves, a span):
# rows of the local tensor that are no one run. Merged by the engine, such a block costs a
# gather of its queries, an fp32 output of its own and a merge pass reading it and the
# accumulator rows (index_select, forward, merge). A kernel that reads each document's rows
# where they lie (``VarlenQueryRows``: document d's rows start at ``q_starts[d]``,
# ``q_used[d]`` of them) takes the whole local q and the whole accumulators instead, with
# ``seqused_q``, and merges in its epilogue (flash-attn 4: Note [Merging in flash-attn 4's
# epilogue]):
#
#     local rows     | d0: lo . hi | d1: lo . hi |      the block: hi of every document
#     engine merge   gather hi rows -> kernel -> out_b (fp32) -> merge into rows[hi]
#     in place       kernel(q, cu_seqlens_q = q_starts, seqused_q = q_used) merges into
#                    out_acc / lse_acc at the same rows; the lo rows are not touched
#
# The same rows serve the backward's dq accumulator (Note [A varlen dq accumulated inside
# flash-attn 4]): built once per block, on the host, and copied to the device (never during
# a CUDA graph capture: a warm-up call builds them). A block whose queries are not so (two
# pieces of one document) is merged by the engine.


@dataclass(frozen=True)
class _Rows:
    """One Part of every document's local piece: which rows, and the kernel metadata.

    ``index`` is None when the rows are the contiguous range ``[start, start + total)``
    (e.g. ``all``, or ``lo`` of a single document), else the int64 row indices.
    """

    total: int
    start: int
    index: Tensor | None
    cu_seqlens: Tensor  # int32 [N + 1] on the tensors' device
    max_seqlen: int
    first: Tensor  # int64 [N], host: each entry's first row (entries: documents or spans)
    sizes: Tensor  # int64 [N], host: its rows

    def take(self, x: Tensor, dim: int) -> Tensor:
        if self.index is None:
            return x.narrow(dim, self.start, self.total)
        return x.index_select(dim, self.index)


class VarlenBlocks:
    """The engine's :class:`~dtensor_ring.engine.Blocks` for packed ``[T, H, D]`` tensors.

    Built by :func:`varlen_blocks` from a plan's parts: for every :class:`Part`, the rows of
    that part of each document's local piece, with its ``cu_seqlens`` and ``max_seqlen``; for
    every :class:`DocSpans` (windowed plans, llama3), the rows of its spans. ``lse`` is
    ``[H, T]``. A kernel that sums a rank's dq itself reads the local queries in place
    (:meth:`dq_accumulator`: each block's queries by local document, ``VarlenQueryRows``).
    """

    def __init__(
        self, rows: dict[Part | DocSpans, _Rows], bounds: tuple[int, ...], device: torch.device
    ):
        self.rows, self.bounds, self.device = rows, bounds, device
        self._whole: _Rows | None = None  # the local documents
        self._query_rows: dict[Block, VarlenQueryRows | None] = {}  # (_query_rows)
        self._kernel_cache: dict = {}  # the dq accumulator's, for the next backward

    def lse_shape(self, q_THD: Tensor) -> tuple[int, ...]:
        T, H, _ = q_THD.shape
        return (H, T)

    def covers(self, part: Part, q_THD: Tensor) -> bool:
        rows = self.rows[part]
        return rows.index is None and rows.start == 0 and rows.total == q_THD.shape[0]

    def is_empty(self, block: Block) -> bool:
        return min(self.rows[block.q].total, self.rows[block.kv].total) == 0

    def in_place(self, kernel: BlockKernel, part: Part) -> bool:
        return self.rows[part].index is None or kernel.merges_by_document

    def take(self, x_THD: Tensor, part: Part) -> Tensor:
        return self.rows[part].take(x_THD, 0)

    def take_lse(self, lse_HT: Tensor, part: Part) -> Tensor:
        return self.rows[part].take(lse_HT, 1)

    def add_(self, acc_THD: Tensor, part: Part, x_THD: Tensor) -> None:
        rows = self.rows[part]
        if rows.index is None:
            rows.take(acc_THD, 0).add_(x_THD)
        else:
            add_rows_(acc_THD, rows.index, x_THD)

    def add_kv_(self, dkv_THD: Sequence[Tensor], part: Part, grads: BlockKVGrads) -> None:
        rows = self.rows[part]
        if isinstance(grads, tuple):
            for acc, x in zip(dkv_THD, grads, strict=True):
                self.add_(acc, part, x)
        elif rows.index is None:
            grads.add_to(*(rows.take(acc, 0) for acc in dkv_THD))
        else:
            grads.add_to(*dkv_THD, rows.index)

    def put_(self, x_THD: Tensor, part: Part, x_b: Tensor) -> None:
        """Rows ``part`` of ``x_THD`` set to ``x_b`` (a block's final rows)."""
        rows = self.rows[part]
        if rows.index is None:
            rows.take(x_THD, 0).copy_(x_b)
        else:
            x_THD.index_copy_(0, rows.index, x_b.to(x_THD.dtype))

    def init_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        self.put_(out_acc, part, out_b)
        rows = self.rows[part]
        if rows.index is None:
            rows.take(lse_acc, 1).copy_(lse_b)
        else:
            lse_acc.index_copy_(1, rows.index, lse_b)

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        rows = self.rows[part]
        if rows.index is None:
            out_acc, lse_acc = rows.take(out_acc, 0), rows.take(lse_acc, 1)
        merge_(out_acc[None], lse_acc[None], out_b[None], lse_b[None], rows.index)

    def finish(self, out, lse, whole, dtype):
        return softmax_empty_rows(out, lse, whole, dtype)

    def _kernel_args(self, block: Block, scale: float) -> tuple[tuple, dict]:
        """``block``'s varlen metadata (cu_seqlens and max_seqlen of its query and K/V parts)
        and its mask keywords, as the kernel's varlen methods take them."""
        rq, rk = self.rows[block.q], self.rows[block.kv]
        meta = (rq.cu_seqlens, rk.cu_seqlens, rq.max_seqlen, rk.max_seqlen)
        return meta, dict(causal=block.causal, scale=scale, window=block.window)

    def forward(self, kernel: BlockKernel, q, k, v, block, scale, unrounded=False):
        meta, mask = self._kernel_args(block, scale)
        return kernel.forward_varlen(q, k, v, *meta, **mask, unrounded=unrounded)

    def merge_forward(self, kernel, q, k, v, block, scale, out_acc, lse_acc):
        rq = self.rows[block.q]
        meta, mask = self._kernel_args(block, scale)
        if rq.index is None:  # one run: views of the rows
            q_rows, out_rows, lse_rows = rq.take(q, 0), rq.take(out_acc, 0), rq.take(lse_acc, 1)
            return kernel.merge_forward_varlen(q_rows, k, v, *meta, out_rows, lse_rows, **mask)
        rows = self._rows_of_queries([block])  # Note [Varlen blocks merged where their rows lie]
        if rows is None:
            return False
        r = rows[block]
        return kernel.merge_forward_varlen(
            q, k, v, r.q_starts, r.cu_seqlens_k, r.max_seqlen_q, r.max_seqlen_k, out_acc,
            lse_acc, seqused_q=r.q_used, **mask,
        )  # fmt: skip

    def backward(self, kernel: BlockKernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        meta, mask = self._kernel_args(block, scale)
        return kernel.backward_varlen(dout, q, k, v, out, lse, *meta, **mask)

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        if not kernel.sums_varlen_dq():
            return None
        rows = self._rows_of_queries(blocks)
        if rows is None:
            return None
        whole = self._whole
        return kernel.dq_accumulator_varlen(
            dout,
            q,
            k,
            v,
            out,
            lse,
            whole.cu_seqlens,
            whole.max_seqlen,
            rows,
            scale=scale,
            cache=self._kernel_cache,
        )

    def _rows_of_queries(self, blocks: Sequence[Block]) -> dict[Block, VarlenQueryRows] | None:
        """Each block's queries as rows of the whole local tensor by document (built once per
        block), or None where a block's are not so, there are no local documents (llama3), or
        they would be built under a CUDA graph capture (they are copied to the device: a
        warm-up call builds them)."""
        if len(self.bounds) < 2:
            return None
        new = [blk for blk in blocks if blk not in self._query_rows]
        if (new or self._whole is None) and capturing(self.device):
            return None
        if self._whole is None:
            self._whole = self.rows.get(Part.ALL) or _rows(self.bounds, Part.ALL, self.device)
        for blk in new:
            rows_q, rows_kv = self.rows[blk.q], self.rows[blk.kv]
            self._query_rows[blk] = _query_rows(self.bounds, rows_q, rows_kv, self.device)
        rows = {blk: self._query_rows[blk] for blk in blocks}
        return None if None in rows.values() else rows


def _query_rows(
    bounds: tuple[int, ...], rows_q: _Rows, rows_kv: _Rows, device: torch.device
) -> VarlenQueryRows | None:
    """``VarlenQueryRows`` of a block of entries ``rows_q`` against ``rows_kv`` (entry ``i``
    of one attends to entry ``i`` of the other; K/V entries are rows of the sender's tensor,
    whose documents may lie elsewhere). Each query entry goes to its local document's slot;
    ``None`` where two entries holding queries are of one document, or out of order, or an
    entry holds queries and no keys or the other way round."""
    n, held = len(bounds) - 1, rows_q.sizes > 0
    docs = torch.searchsorted(torch.tensor(bounds[1:]), rows_q.first[held], right=True)
    if not (torch.equal(held, rows_kv.sizes > 0) and bool((docs.diff() > 0).all())):
        return None
    first, used = rows_q.first[held], rows_q.sizes[held]
    q_starts = torch.full((n + 1,), bounds[-1], dtype=torch.int32)
    q_used = torch.zeros(n, dtype=torch.int32)
    kv_sizes = torch.zeros(n, dtype=torch.int64)
    q_starts[docs], q_used[docs] = first.to(torch.int32), used.to(torch.int32)
    kv_sizes[docs] = rows_kv.sizes[held]
    cu_k = torch.zeros(n + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(kv_sizes, 0)
    start = torch.tensor(bounds[:-1])[docs]
    lengths = torch.tensor(bounds).diff()[docs]
    spans = zip(
        (first - start).tolist(), (first + used - start).tolist(), lengths.tolist(), strict=True
    )
    return VarlenQueryRows(
        q_starts=q_starts.to(device),
        q_used=q_used.to(device),
        cu_seqlens_k=cu_k.to(device),
        max_seqlen_q=rows_q.max_seqlen,
        max_seqlen_k=rows_kv.max_seqlen,
        q_spans=tuple(spans),
    )


def _rows(bounds: tuple[int, ...], part: Part | DocSpans, device: torch.device) -> _Rows:
    if isinstance(part, DocSpans):
        first = torch.tensor([a for a, _ in part.spans], dtype=torch.int64)
        sizes = torch.tensor([b - a for a, b in part.spans], dtype=torch.int64)
        return _rows_of(first, sizes, device)
    b = torch.tensor(bounds, dtype=torch.int64)
    lengths = b[1:] - b[:-1]
    first, stop = part.bounds(lengths)  # elementwise over documents
    first = torch.as_tensor(first).expand_as(lengths)
    return _rows_of(b[:-1] + first, torch.as_tensor(stop) - first, device)


def _rows_of(first: Tensor, sizes: Tensor, device: torch.device) -> _Rows:
    """Rows ``[first[i], first[i] + sizes[i])`` of every document ``i``, in order."""
    total = int(sizes.sum())
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(sizes, 0)
    index = concat_ranges(first, sizes)
    start = int(index[0]) if total else 0
    contiguous = total == 0 or bool((index == torch.arange(start, start + total)).all())
    return _Rows(
        total=total,
        start=start,
        index=None if contiguous else index.to(device),
        cu_seqlens=cu.to(device),
        max_seqlen=int(sizes.max()),
        first=first,
        sizes=sizes,
    )


_BLOCKS_CACHE: dict[tuple, tuple[object, VarlenBlocks]] = {}
_BLOCKS_CACHE_SIZE = 64


def varlen_blocks(
    plan: Plan | tuple[Block, ...], bounds_local: Sequence[int], device: torch.device
) -> VarlenBlocks:
    """The :class:`VarlenBlocks` of a varlen ``plan`` (or a tuple of blocks) on local
    documents ``bounds_local`` (the rank's local ``cu_seqlens`` as ints).

    Index and ``cu_seqlens`` tensors are built on the host and copied to ``device`` once per
    plan and set of documents: the cache is keyed on the plan's identity (plans are cached
    themselves), the documents and the device.
    """
    bounds, device = tuple(bounds_local), torch.device(device)
    key = (id(plan), bounds, device)
    hit = _BLOCKS_CACHE.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    blocks: Iterable[Block] = (
        (b for row in plan.steps for st in row for b in st.blocks)
        if isinstance(plan, Plan)
        else plan
    )
    parts = {p for b in blocks for p in (b.q, b.kv)}
    result = VarlenBlocks({p: _rows(bounds, p, device) for p in parts}, bounds, device)
    if len(_BLOCKS_CACHE) >= _BLOCKS_CACHE_SIZE:
        _BLOCKS_CACHE.pop(next(iter(_BLOCKS_CACHE)))
    _BLOCKS_CACHE[key] = (plan, result)
    return result
