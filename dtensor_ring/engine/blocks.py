"""How the engine takes parts of the local tensors and runs one block on them.

The ring loops (``engine/ring.py``) and llama3's all-gather loop are the same for dense and
packed sequences; a :class:`Blocks` object holds what differs. Plans are data (parts named by
:class:`Part` or :class:`DocSpans`); the engine turns them into row indices and kernel metadata
here, once per plan and set of documents (:func:`varlen_blocks`, cached).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..kernels import BlockKernel, BlockKVGrads, DqAccumulator
from ..kernels.base import VarlenQueryRows, capturing
from ..kernels.flex import FlexMods
from ..kernels.merge import add_rows_, finish_rows, merge_
from ..parts import Block, DocSpans, Part, concat_ranges
from ..schedule.plan import Plan


class Blocks(Protocol):
    """How the engine takes a :class:`Part` of the local tensors and runs one block on it.

    The ring loops (:func:`ring_forward`, :func:`ring_backward`) are the same for dense and
    variable-length sequences; only these steps differ:

    * :class:`DenseBlocks` (the default): ``[B, S, H, D]`` tensors, ``lse [B, H, S]``; a Part is
      a slice of S, the kernel's dense ``forward``/``backward`` runs on it.
    * ``VarlenBlocks`` (:mod:`dtensor_ring.varlen`): packed ``[T, H, D]`` tensors,
      ``lse [H, T]``; a Part is that part of *every document's* local piece, the kernel's
      ``forward_varlen``/``backward_varlen`` runs on it with that Part's ``cu_seqlens``.

    ``take`` may return a view or a copy, so accumulators are only updated through ``add_`` and
    ``merge_``.
    """

    def lse_shape(self, q: Tensor) -> tuple[int, ...]:
        """The shape of the lse of the local queries ``q``."""
        ...

    def covers(self, part: Part, q: Tensor) -> bool:
        """Whether ``part`` takes every row of ``q``, in order (its block's result then has
        the shape of the whole accumulator)."""
        ...

    def is_empty(self, block: Block) -> bool:
        """Whether ``block`` computes nothing (an empty query/key part)."""
        ...

    def in_place(self, part: Part) -> bool:
        """Whether ``part``'s rows are one run of the accumulators (taking them is a view)."""
        ...

    def take(self, x: Tensor, part: Part) -> Tensor:
        """The rows of ``part`` of a token-major tensor (q, k, v, out, dout and the like)."""
        ...

    def take_lse(self, lse: Tensor, part: Part) -> Tensor:
        """The rows of ``part`` of an lse tensor."""
        ...

    def add_(self, acc: Tensor, part: Part, x: Tensor) -> None:
        """``acc[part] += x`` in place."""
        ...

    def add_kv_(self, dkv: Sequence[Tensor], part: Part, grads: BlockKVGrads) -> None:
        """``dk[part] += grads' dk``, ``dv[part] += grads' dv`` in place (``dkv = [dk, dv]``;
        ``grads`` a pair of tensors or a kernel's :class:`~dtensor_ring.kernels.HeldKVGrads`)."""
        ...

    def init_(
        self, out_acc: Tensor, lse_acc: Tensor, part: Part, out_b: Tensor, lse_b: Tensor
    ) -> None:
        """Set the accumulator rows of ``part`` to a block result (its first)."""
        ...

    def merge_(
        self, out_acc: Tensor, lse_acc: Tensor, part: Part, out_b: Tensor, lse_b: Tensor
    ) -> None:
        """Fold a block result into the accumulator rows of ``part`` (online-softmax merge)."""
        ...

    def forward(
        self,
        kernel: BlockKernel,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        block: Block,
        scale: float,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of ``block`` on parts already taken with :meth:`take`;
        ``unrounded``: the caller merges it, ``out`` may come in the accumulation dtype
        (``BlockKernel.forward``)."""
        ...

    def merge_forward(
        self,
        kernel: BlockKernel,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        block: Block,
        scale: float,
        out_acc: Tensor,
        lse_acc: Tensor,
    ) -> bool:
        """``block`` (parts already taken; its query part :meth:`in_place`) merged by the
        kernel itself into its rows of the accumulators ``out_acc``, ``lse_acc``
        (``BlockKernel.merge_forward``); False: nothing done."""
        ...

    def finish(self, out: Tensor, lse: Tensor, whole: bool, dtype: torch.dtype) -> Tensor:
        """The final ``out`` in ``dtype`` from the accumulated one (or, ``whole``, the one
        block's, in ``dtype`` already): rows with ``lse = -inf`` (no visible key) as the
        attention being computed defines them."""
        ...

    def backward(
        self,
        kernel: BlockKernel,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        block: Block,
        scale: float,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of ``block`` on parts already taken with :meth:`take`;
        ``unrounded``: the caller sums them, any may come in the accumulation dtype
        (``BlockKernel.backward``)."""
        ...

    def dq_accumulator(
        self,
        kernel: BlockKernel,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        blocks: Sequence[Block],
        scale: float,
    ) -> DqAccumulator | None:
        """The kernel's own dq accumulator for ``blocks`` (``BlockKernel.dq_accumulator``; on
        the whole local tensors), or None: the engine sums the blocks' dq."""
        ...


def _part(x: Tensor, part: Part, dim: int) -> Tensor:
    if part is Part.ALL:  # the tensor itself: no view to build (host time per block)
        return x
    start, stop = part.bounds(x.shape[dim])
    return x.narrow(dim, start, stop - start)


class PartsOf:
    """The parts of one tensor that a loop over a plan's blocks takes, each taken once: the
    queries' side (q, out, dout, lse) stays put while K/V travel, and a plan's blocks use a
    few parts of it many times. ``parts_of(part)`` is ``take(x, part)``, remembered by the
    part's identity (parts live in the plan for the whole call)."""

    def __init__(self, take, x: Tensor):
        self._take, self._x, self._parts = take, x, {}

    def __call__(self, part) -> Tensor:
        taken = self._parts.get(id(part))
        if taken is None:
            taken = self._parts[id(part)] = self._take(self._x, part)
        return taken


class DenseBlocks:
    """:class:`Blocks` of dense ``[B, S, H, D]`` tensors with ``seq_local`` tokens a rank."""

    def __init__(self, seq_local: int):
        self.seq_local = seq_local

    def lse_shape(self, q_BSHD: Tensor) -> tuple[int, ...]:
        B, S, H, _ = q_BSHD.shape
        return (B, H, S)

    def covers(self, part: Part, q_BSHD: Tensor) -> bool:
        return part.size(self.seq_local) == q_BSHD.shape[1] == self.seq_local

    def is_empty(self, block: Block) -> bool:
        n = self.seq_local
        return min(block.q.size(n), block.kv.size(n)) == 0

    def in_place(self, part: Part) -> bool:
        return True  # a part is a range of the sequence

    def take(self, x_BSHD: Tensor, part: Part) -> Tensor:
        return _part(x_BSHD, part, 1)

    def take_lse(self, lse_BHS: Tensor, part: Part) -> Tensor:
        return _part(lse_BHS, part, 2)

    def add_(self, acc_BSHD: Tensor, part: Part, x_BSHD: Tensor) -> None:
        _part(acc_BSHD, part, 1).add_(x_BSHD)

    def add_kv_(self, dkv_BSHD: Sequence[Tensor], part: Part, grads: BlockKVGrads) -> None:
        rows = [_part(acc, part, 1) for acc in dkv_BSHD]
        if isinstance(grads, tuple):
            for acc, x in zip(rows, grads, strict=True):
                acc.add_(x)
        else:
            grads.add_to(*rows)

    def init_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        _part(out_acc, part, 1).copy_(out_b)
        _part(lse_acc, part, 2).copy_(lse_b)

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        merge_(_part(out_acc, part, 1), _part(lse_acc, part, 2), out_b, lse_b)

    def forward(self, kernel, q, k, v, block, scale, unrounded=False):
        return kernel.forward(
            q, k, v, causal=block.causal, scale=scale, window=block.window, unrounded=unrounded
        )

    def merge_forward(self, kernel, q, k, v, block, scale, out_acc, lse_acc):
        out_rows, lse_rows = _part(out_acc, block.q, 1), _part(lse_acc, block.q, 2)
        return kernel.merge_forward(
            q, k, v, out_rows, lse_rows, causal=block.causal, scale=scale, window=block.window
        )

    def finish(self, out, lse, whole, dtype):
        return softmax_empty_rows(out, lse, whole, dtype)

    def backward(self, kernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        return kernel.backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            causal=block.causal,
            scale=scale,
            window=block.window,
            unrounded=unrounded,
        )

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        return kernel.dq_accumulator(dout, q, k, v, out, lse, blocks, scale=scale)


def softmax_empty_rows(out: Tensor, lse: Tensor, whole: bool, dtype: torch.dtype) -> Tensor:
    """``out`` in ``dtype`` with SDPA's rows of nothing but -inf scores: NaN (the softmax of
    those is 0 / 0), set after the merges (the math kernel's blocks give 0, for merging); a
    CUDA kernel's own answer for a whole call is single-device attention's
    (docs/troubleshooting.md)."""
    return out if whole and out.is_cuda else finish_rows(out, lse, dtype)


class FlexBlocks(DenseBlocks):
    """:class:`Blocks` of a FlexAttention call: dense ``[B, S, H, D]`` tensors, blocks with an
    ``origin`` (Note [Flex schedules]) computed by the engine's ``kernel``, a
    :class:`~dtensor_ring.kernels.flex.FlexKernel`, with the user's functions ``mods`` (and, in
    the backward, the gradient ``dlse`` of the lse the call returned, flex's being
    differentiable). Rows without a visible key are 0 with ``lse = -inf``, as in
    ``flex_attention``: a block's empty rows have weight 0 in a merge, also when the
    accumulator's rows are empty."""

    def __init__(self, seq_local: int, mods: FlexMods, dlse_BHS: Tensor | None = None):
        super().__init__(seq_local)
        self.mods, self.dlse_BHS = mods, dlse_BHS

    def forward(self, kernel, q, k, v, block, scale, unrounded=False):
        return kernel.forward(q, k, v, block.origin, scale, self.mods)  # flex rounds its out

    def in_place(self, part: Part) -> bool:
        return False  # never merged by the kernel: its empty rows merge by their own rule (below)

    def backward(self, kernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        dlse = None if self.dlse_BHS is None else self.take_lse(self.dlse_BHS, block.q)
        return kernel.backward(dout, q, k, v, out, lse, block.origin, scale, self.mods, dlse)

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        return None

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        out_rows, lse_rows = _part(out_acc, part, 1), _part(lse_acc, part, 2)
        neither = (lse_rows == float("-inf")) & (lse_b == float("-inf"))
        lse_b = lse_b.masked_fill(neither, 0)  # weight 1 for the block's row of zeros
        merge_(out_rows, lse_rows, out_b, lse_b)
        lse_rows.masked_fill_(neither, float("-inf"))

    def finish(self, out, lse, whole, dtype):
        return finish_rows(out, lse, dtype, empty=0.0)


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

    def in_place(self, part: Part) -> bool:
        return self.rows[part].index is None

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

    def forward(self, kernel: BlockKernel, q, k, v, block, scale, unrounded=False):
        rq, rk = self.rows[block.q], self.rows[block.kv]
        return kernel.forward_varlen(
            q,
            k,
            v,
            rq.cu_seqlens,
            rk.cu_seqlens,
            rq.max_seqlen,
            rk.max_seqlen,
            causal=block.causal,
            scale=scale,
            window=block.window,
            unrounded=unrounded,
        )

    def merge_forward(self, kernel, q, k, v, block, scale, out_acc, lse_acc):
        rq, rk = self.rows[block.q], self.rows[block.kv]
        out_rows, lse_rows = rq.take(out_acc, 0), rq.take(lse_acc, 1)
        return kernel.merge_forward_varlen(
            q, k, v, rq.cu_seqlens, rk.cu_seqlens, rq.max_seqlen, rk.max_seqlen, out_rows,
            lse_rows, causal=block.causal, scale=scale, window=block.window,
        )  # fmt: skip

    def backward(self, kernel: BlockKernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        rq, rk = self.rows[block.q], self.rows[block.kv]
        return kernel.backward_varlen(
            dout,
            q,
            k,
            v,
            out,
            lse,
            rq.cu_seqlens,
            rk.cu_seqlens,
            rq.max_seqlen,
            rk.max_seqlen,
            causal=block.causal,
            scale=scale,
            window=block.window,
        )

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        if len(self.bounds) < 2 or not kernel.sums_varlen_dq():  # llama3: no local documents
            return None
        new = [blk for blk in blocks if blk not in self._query_rows]
        if (new or self._whole is None) and capturing(self.device):
            return None  # building them copies to the device; a warm-up call builds them
        if self._whole is None:
            self._whole = self.rows.get(Part.ALL) or _rows(self.bounds, Part.ALL, self.device)
        for blk in new:
            rows_q, rows_kv = self.rows[blk.q], self.rows[blk.kv]
            self._query_rows[blk] = _query_rows(self.bounds, rows_q, rows_kv, self.device)
        rows = {blk: self._query_rows[blk] for blk in blocks}
        if None in rows.values():
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
