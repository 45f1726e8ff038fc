"""Variable-length (packed, document-masked) sequences: layouts, sharding, metadata, balance.

Note [Varlen layouts]
~~~~~~~~~~~~~~~~~~~~~
A packed batch is one token stream of T tokens holding N documents back to back, described
by ``cu_seqlens = [0, c_1, ..., c_N = T]`` (int32); a token attends only to tokens of its own
document (causally within it, if causal). Example: documents A (8 tokens) and B (4 tokens),
W = 2 ranks (letters: document, digits: position in the document):

    global     A0 A1 A2 A3 A4 A5 A6 A7 B0 B1 B2 B3          cu_seqlens       [0, 8, 12]

    ring       rank0: A0 A1 A2 A3 B0 B1                     local cu_seqlens [0, 4, 6]
               rank1: A4 A5 A6 A7 B2 B3                     (= global // W on every rank)
    zigzag     rank0: A0 A1 A6 A7 | B0 B3                   local cu_seqlens [0, 4, 6]
               rank1: A2 A3 A4 A5 | B1 B2
    llama3     rank0: A0 A1 A2 A3 A4 A5                     cu_seqlens_q [0, 6]
               rank1: A6 A7 B0 B1 B2 B3                     cu_seqlens_q [0, 2, 6]

* ring: every document is cut into W equal contiguous pieces; rank r holds piece r of each
  document, in document order. Each document length must be a multiple of W.
* zigzag: every document is cut into 2W pieces; rank r holds pieces r and 2W-1-r of each
  document (its "lo" and "hi" half). Causal only; lengths must be multiples of 2W.
* llama3: the packed stream is cut into W contiguous slices of T/W tokens; documents may
  straddle ranks. Only T % W == 0 is needed. K/V are all-gathered (see ``llama3.py``).

The ring and zigzag varlen forms run the *dense* schedules of Note [Ring schedules] on every
document at once: at each step, the block ``q-part/kv-part`` of the dense plan is applied to
every document, with a part meaning that part of each document's local piece (``lo`` = the
first half of each document's local piece, ``hi`` = the second half). :class:`VarlenBlocks`
does this for the engine: it holds, for every part the plan uses, the rows of the packed
tensor, the part's ``cu_seqlens`` and its ``max_seqlen``, precomputed once, so a ring step
never reads anything back from the device. Documents never meet: query piece of one document
against keys of another are never computed (the kernels' ``cu_seqlens`` keep them apart).

Host reads ("syncs"): validating ``cu_seqlens`` needs its values on the host. A CPU tensor is
read directly (no device sync). A GPU tensor is copied to the host once, the first time it is
seen; the values are cached on the tensor's identity and version counter, and everything
derived from them (row indices, per-part ``cu_seqlens``) on the values, so later calls with the
same tensor (other layers, the backward) do not sync. See docs/varlen.md.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import BlockKernel
from .merge import merge_
from .plan import (
    Block,
    Part,
    Plan,
    layout_runs,
    make_plan,
    plan_from_blocks,
    run_pair_blocks,
    window_bounds,
)
from .validation import check_layout_causal, check_qkv_tensors

VARLEN_LAYOUTS: tuple[str, ...] = ("ring", "zigzag", "llama3")


def check_varlen_layout(layout: str) -> None:
    """Raise ``ValueError`` unless ``layout`` is one of :data:`VARLEN_LAYOUTS`."""
    if layout not in VARLEN_LAYOUTS:
        raise ValueError(
            f"layout={layout!r} is not a varlen layout; choose one of {VARLEN_LAYOUTS}"
        )


# --- cu_seqlens on the host, and its checks ------------------------------------------------

_HOST_CACHE: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}
_HOST_CACHE_SIZE = 64


def host_values(cu_seqlens: Tensor) -> tuple[int, ...]:
    """The values of a 1-D integer tensor as Python ints.

    A CPU tensor is read directly. A device tensor is copied to the host (a sync) the first
    time it is seen and then served from a cache keyed by the tensor's identity and version
    counter (an in-place change invalidates it).
    """
    if cu_seqlens.device.type == "cpu":
        return tuple(cu_seqlens.tolist())
    try:
        version = cu_seqlens._version
    except RuntimeError:  # inference-mode tensors have no version counter: do not cache
        return tuple(cu_seqlens.tolist())
    hit = _HOST_CACHE.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == version:
        return hit[2]
    values = tuple(cu_seqlens.tolist())  # the one device -> host copy
    if len(_HOST_CACHE) >= _HOST_CACHE_SIZE:
        _HOST_CACHE.pop(next(iter(_HOST_CACHE)))
    _HOST_CACHE[id(cu_seqlens)] = (weakref.ref(cu_seqlens), version, values)
    return values


def check_cu_seqlens_tensor(cu_seqlens: object, name: str = "cu_seqlens") -> None:
    """Dtype/shape checks of a ``cu_seqlens`` tensor that need no host read."""
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"{name} must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"{name} must be int32 (as flash-attn's varlen API), got {cu_seqlens.dtype}; "
            f"pass {name}.to(torch.int32)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D [num_docs + 1] with at least 2 entries (0 and the total), "
            f"got shape {tuple(cu_seqlens.shape)}"
        )


def check_bounds(
    bounds: Sequence[int], total: int, name: str = "cu_seqlens", what: str = "the number of tokens"
) -> None:
    """Check document boundaries: start at 0, strictly increasing, end at ``total`` (``what``)."""
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={bounds[0]}")
    for i in range(len(bounds) - 1):
        if bounds[i + 1] <= bounds[i]:
            raise ValueError(
                f"{name} must be strictly increasing (no empty documents), but "
                f"{name}[{i}]={bounds[i]} and {name}[{i + 1}]={bounds[i + 1]}"
            )
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at {what} {total}, got {name}[-1]={bounds[-1]}")


def read_cu_seqlens(cu_seqlens: Tensor, total: int, name: str = "cu_seqlens") -> tuple[int, ...]:
    """Check ``cu_seqlens`` against ``total`` tokens and return its values (see
    :func:`host_values` for when this reads from the device)."""
    check_cu_seqlens_tensor(cu_seqlens, name)
    bounds = host_values(cu_seqlens)
    check_bounds(bounds, total, name)
    return bounds


def _multiple(layout: str, world_size: int) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def check_divisible(bounds: Sequence[int], layout: str, world_size: int) -> None:
    """Check that the *global* documents ``bounds`` can be sharded under ``layout``.

    ring needs every document length to be a multiple of W, zigzag of 2W; llama3 only needs the
    total to be a multiple of W.
    """
    check_varlen_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    total = bounds[-1]
    if total % world_size != 0:
        raise ValueError(
            f"the total length T={total} of the packed sequence is not divisible by "
            f"world_size={world_size}; pad the packed sequence to a multiple of {world_size}"
        )
    if layout == "llama3":
        return
    m = _multiple(layout, world_size)
    for i in range(len(bounds) - 1):
        n = bounds[i + 1] - bounds[i]
        if n % m != 0:
            raise ValueError(
                f"document {i} (tokens [{bounds[i]}, {bounds[i + 1]}), length {n}) is not a "
                f"multiple of {m}, as layout={layout!r} needs on {world_size} ranks (every "
                f"document is cut into {m} equal pieces); pad every document to a multiple of "
                f"{m}, or use the 'llama3' layout (llama3_flash_attn_varlen_func), which needs "
                "no divisibility of documents"
            )


def check_local_zigzag(bounds_local: Sequence[int], world_size: int) -> None:
    """Local zigzag documents must have even lengths (their lo and hi halves)."""
    for i in range(len(bounds_local) - 1):
        n = bounds_local[i + 1] - bounds_local[i]
        if n % 2 != 0:
            raise ValueError(
                f"document {i} has {n} tokens on this rank (local cu_seqlens), i.e. "
                f"{n * world_size} globally; zigzag varlen needs every document's length to "
                f"be a multiple of 2 * world_size = {2 * world_size} (two pieces per rank). "
                "Pad every document, or use llama3_flash_attn_varlen_func, which needs no "
                "divisibility of documents"
            )


def check_max_seqlen(
    name: str,
    max_seqlen: int | None,
    bounds: Sequence[int],
    hint: str = "the local maximum (global maximum // world_size)",
) -> None:
    """``max_seqlen`` (None: not given) must be at least the longest document of ``bounds``."""
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(
            f"{name}={max_seqlen} is smaller than the longest local document ({longest} "
            f"tokens); pass {hint}, or None"
        )


def check_cu_seqlens_device(cu_seqlens: Tensor, q: Tensor, name: str = "cu_seqlens") -> None:
    """``cu_seqlens`` must live on the CPU or on ``q``'s device."""
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
        raise ValueError(
            f"{name} is on {cu_seqlens.device} but q on {q.device}; put it on q's device or "
            "on the CPU"
        )


def check_varlen_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    *,
    layout: str,
    causal: bool,
    world_size: int,
) -> tuple[int, ...]:
    """Check one rank's ring/zigzag varlen inputs; return the local ``cu_seqlens`` as ints.

    ``q [T_local, H, D]``, ``k``/``v [T_local, H_kv, D]``, ``cu_seqlens`` int32 local document
    boundaries. Reads ``cu_seqlens`` on the host (see :func:`host_values`).

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    if layout not in ("ring", "zigzag"):
        raise ValueError(
            f"layout={layout!r} has no ring varlen form; choose 'ring' or 'zigzag' (or the "
            "llama3 functions)"
        )
    check_layout_causal(layout, causal, ring_func="ring_flash_attn_varlen_func")
    check_qkv_tensors(q, k, v, seq_dims="T_local")
    check_cu_seqlens_tensor(cu_seqlens)
    check_cu_seqlens_device(cu_seqlens, q)
    bounds = read_cu_seqlens(cu_seqlens, q.shape[0])
    if layout == "zigzag":
        check_local_zigzag(bounds, world_size)
    check_max_seqlen("max_seqlen", max_seqlen, bounds)
    return bounds


# --- which global tokens a rank holds ------------------------------------------------------


def _concat_ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised (int64)."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(
        total
    )


def llama3_local_bounds(bounds: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Local ``cu_seqlens`` of ``rank``'s contiguous slice of T/W tokens (llama3 layout)."""
    length = bounds[-1] // world_size
    lo, hi = rank * length, (rank + 1) * length
    inner = [b - lo for b in bounds if lo < b < hi]
    return [0, *inner, length]


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")


def varlen_token_indices(
    cu_seqlens: Tensor | Sequence[int], layout: str, rank: int, world_size: int
) -> Tensor:
    """Global indices (int64 ``[T // world_size]``) of the tokens ``rank`` holds, in order.

    Args:
        cu_seqlens: the *global* document boundaries ``[N + 1]`` (int32 tensor or ints).
        layout: "ring", "zigzag" or "llama3" (Note [Varlen layouts]).

    Positions within documents (for RoPE) follow as ``idx - cu_seqlens[doc]`` with
    ``doc = searchsorted(cu_seqlens, idx, right=True) - 1``.
    Raises ``ValueError`` when the documents do not divide as ``layout`` needs.
    """
    bounds = _global_bounds(cu_seqlens)
    check_divisible(bounds, layout, world_size)
    _check_rank(rank, world_size)
    b = torch.tensor(bounds, dtype=torch.int64)
    if layout == "llama3":
        n = bounds[-1] // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    starts, lengths = b[:-1], b[1:] - b[:-1]
    if layout == "ring":
        n = lengths // world_size
        return _concat_ranges(starts + rank * n, n)
    c = lengths // (2 * world_size)
    pieces = torch.stack([starts + rank * c, starts + (2 * world_size - 1 - rank) * c], dim=1)
    return _concat_ranges(pieces.flatten(), c.repeat_interleave(2))


def _global_bounds(cu_seqlens: Tensor | Sequence[int]) -> tuple[int, ...]:
    if isinstance(cu_seqlens, Tensor):
        check_cu_seqlens_tensor(cu_seqlens)
        bounds = host_values(cu_seqlens)
    else:
        bounds = tuple(int(c) for c in cu_seqlens)
        if len(bounds) < 2:
            raise ValueError(f"cu_seqlens must have at least 2 entries, got {list(bounds)}")
    check_bounds(bounds, bounds[-1])
    return bounds


def varlen_local_cu_seqlens(
    cu_seqlens: Tensor | Sequence[int], layout: str, rank: int, world_size: int
) -> Tensor:
    """Local ``cu_seqlens`` (int32 ``[N_local + 1]``) of ``rank`` under ``layout``.

    ring / zigzag: ``cu_seqlens // world_size`` (the same on every rank). llama3: the rank's
    slice's document boundaries (= ``cu_seqlens_q`` of ``llama3_flash_attn_prepare_cu_seqlens``).
    The result is on ``cu_seqlens``'s device (CPU for a list).
    """
    bounds = _global_bounds(cu_seqlens)
    check_divisible(bounds, layout, world_size)
    _check_rank(rank, world_size)
    if layout == "llama3":
        local = llama3_local_bounds(bounds, rank, world_size)
    else:
        local = [b // world_size for b in bounds]
    device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else None
    return torch.tensor(local, dtype=torch.int32, device=device)


def shard_varlen(
    full: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    layout: str,
    rank: int,
    world_size: int,
    seq_dim: int = 0,
) -> tuple[Tensor, Tensor]:
    """The part of a packed tensor that ``rank`` holds under ``layout`` (a copy; no comm).

    Args:
        full: any tensor whose dim ``seq_dim`` is the packed stream of T tokens (e.g.
            ``q [T, H, D]``, ``qkv [T, 3, H, D]``, position ids ``[T]``).
        cu_seqlens: *global* document boundaries ``[N + 1]`` (int32, ``cu_seqlens[-1] == T``).
        layout: "ring", "zigzag" or "llama3" (Note [Varlen layouts]).
        rank, world_size: position in, and size of, the context-parallel group.
        seq_dim: the packed-token dimension.

    Returns:
        ``(local, local_cu_seqlens)``: ``full`` with dim ``seq_dim`` reduced to the rank's
        ``T // world_size`` tokens, and the int32 local document boundaries to pass to the
        attention function (:func:`varlen_local_cu_seqlens`).

    Raises:
        ValueError: documents not divisible as ``layout`` needs (see :func:`check_divisible`),
            or ``cu_seqlens`` not matching ``full``.
    """
    bounds = _global_bounds(cu_seqlens)
    if bounds[-1] != full.shape[seq_dim]:
        raise ValueError(
            f"cu_seqlens ends at {bounds[-1]} but full has {full.shape[seq_dim]} tokens along "
            f"dim {seq_dim}"
        )
    idx = varlen_token_indices(bounds, layout, rank, world_size).to(full.device)
    local_cu = varlen_local_cu_seqlens(bounds, layout, rank, world_size)
    if isinstance(cu_seqlens, Tensor):
        local_cu = local_cu.to(cu_seqlens.device)
    return full.index_select(seq_dim, idx), local_cu


def unshard_varlen(
    parts: Sequence[Tensor], cu_seqlens: Tensor | Sequence[int], layout: str, seq_dim: int = 0
) -> Tensor:
    """Inverse of :func:`shard_varlen`: every rank's local part, in rank order -> full tensor.

    Args:
        parts: ``world_size`` tensors, ``T // world_size`` tokens each along ``seq_dim``.
        cu_seqlens: the *global* document boundaries.
    """
    world_size = len(parts)
    bounds = _global_bounds(cu_seqlens)
    order = torch.cat(
        [varlen_token_indices(bounds, layout, r, world_size) for r in range(world_size)]
    )
    if order.numel() != sum(p.shape[seq_dim] for p in parts):
        raise ValueError(
            f"the parts hold {sum(p.shape[seq_dim] for p in parts)} tokens, cu_seqlens {bounds[-1]}"
        )
    inverse = torch.argsort(order).to(parts[0].device)
    return torch.cat(list(parts), dim=seq_dim).index_select(seq_dim, inverse)


# --- the engine's view of varlen blocks -----------------------------------------------------


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

    def take(self, x: Tensor, dim: int) -> Tensor:
        if self.index is None:
            return x.narrow(dim, self.start, self.total)
        return x.index_select(dim, self.index)


@dataclass(frozen=True)
class DocSpans:
    """A part of a windowed varlen block: rows ``[start, stop)`` of the packed local tensor,
    one span per document the block holds (Note [Windowed varlen])."""

    spans: tuple[tuple[int, int], ...]

    @property
    def value(self) -> str:
        return ",".join(f"{a}:{b}" for a, b in self.spans)


class VarlenBlocks:
    """The engine's :class:`~dtensor_ring.engine.Blocks` for packed ``[T, H, D]`` tensors.

    Built by :func:`varlen_blocks`: for every Part that ``layout``'s plan uses, the rows of
    that part of each document's local piece, with its ``cu_seqlens`` and ``max_seqlen``
    (windowed plans: for every :class:`DocSpans`). ``lse`` is ``[H, T]``.
    """

    def __init__(self, rows: dict[Part | DocSpans, _Rows]):
        self.rows = rows

    def new_lse(self, q_THD: Tensor, dtype: torch.dtype) -> Tensor:
        T, H, _ = q_THD.shape
        return torch.empty(H, T, dtype=dtype, device=q_THD.device)

    def is_empty(self, block: Block) -> bool:
        return min(self.rows[block.q].total, self.rows[block.kv].total) == 0

    def take(self, x_THD: Tensor, part: Part) -> Tensor:
        return self.rows[part].take(x_THD, 0)

    def take_lse(self, lse_HT: Tensor, part: Part) -> Tensor:
        return self.rows[part].take(lse_HT, 1)

    def add_(self, acc_THD: Tensor, part: Part, x_THD: Tensor) -> None:
        rows = self.rows[part]
        if rows.index is None:
            rows.take(acc_THD, 0).add_(x_THD)
        else:
            acc_THD.index_add_(0, rows.index, x_THD.to(acc_THD.dtype))

    def init_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        rows = self.rows[part]
        if rows.index is None:
            rows.take(out_acc, 0).copy_(out_b)
            rows.take(lse_acc, 1).copy_(lse_b)
        else:
            out_acc.index_copy_(0, rows.index, out_b.to(out_acc.dtype))
            lse_acc.index_copy_(1, rows.index, lse_b)

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        rows = self.rows[part]
        out_rows, lse_rows = rows.take(out_acc, 0), rows.take(lse_acc, 1)
        merge_(out_rows[None], lse_rows[None], out_b[None], lse_b[None])
        if rows.index is not None:  # take made copies: write them back
            out_acc.index_copy_(0, rows.index, out_rows)
            lse_acc.index_copy_(1, rows.index, lse_rows)

    def forward(self, kernel: BlockKernel, q, k, v, block, scale):
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
        )

    def backward(self, kernel: BlockKernel, dout, q, k, v, out, lse, block, scale):
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
    index = _concat_ranges(first, sizes)
    start = int(index[0]) if total else 0
    contiguous = total == 0 or bool((index == torch.arange(start, start + total)).all())
    return _Rows(
        total=total,
        start=start,
        index=None if contiguous else index.to(device),
        cu_seqlens=cu.to(device),
        max_seqlen=int(sizes.max()),
    )


@functools.lru_cache(maxsize=64)
def _varlen_blocks_cached(
    bounds: tuple[int, ...], layout: str, world_size: int, causal: bool, device: torch.device
) -> VarlenBlocks:
    plan = make_plan(layout, world_size, causal)
    parts = {p for row in plan.steps for st in row for b in st.blocks for p in (b.q, b.kv)}
    return VarlenBlocks({p: _rows(bounds, p, device) for p in parts | {Part.ALL}})


def varlen_blocks(
    bounds_local: Sequence[int], layout: str, world_size: int, causal: bool, device: torch.device
) -> VarlenBlocks:
    """The (cached) :class:`VarlenBlocks` of local documents ``bounds_local`` for ``layout``.

    ``bounds_local``: the rank's local ``cu_seqlens`` as ints. Index and ``cu_seqlens`` tensors
    are built on the host and copied to ``device`` once per distinct set of documents.
    """
    return _varlen_blocks_cached(
        tuple(bounds_local), layout, world_size, causal, torch.device(device)
    )


@functools.lru_cache(maxsize=64)
def windowed_varlen_plan(
    bounds_local: tuple[int, ...],
    layout: str,
    world_size: int,
    causal: bool,
    window: tuple[int, int],
    device: torch.device,
) -> tuple[Plan, VarlenBlocks]:
    """The windowed plan of ring / zigzag varlen and its :class:`VarlenBlocks` (cached).

    Note [Windowed varlen]
    ~~~~~~~~~~~~~~~~~~~~~~
    A window cuts each document's pieces at offsets that depend on the document's length, so
    the dense plan's parts (``lo``, ``hi``, applied to every document alike) no longer fit.
    Every rank holds the same local lengths (each document is cut into W or 2W equal pieces),
    so every rank can build the whole plan: for each (rank, src) pair and each document, the
    trimmed blocks of its runs (Note [Windowed schedules] in ``plan.py``); blocks of the same
    run pair with the same mask (causal, or the same flash window) across documents become one
    varlen kernel call, its parts :class:`DocSpans` (one span per document):

        doc A (long):   0:4/4:8 w(2,-1)  \
        doc B (long):   9:13/13:17 w(2,-1) -> one block  0:4,9:13 / 4:8,13:17 w(2,-1)
        doc C (short):  20:22/20:22 c    -> its own block (another mask)

    ``window`` is normalised (``validation.normalize_window``) over positions within each
    document. Raises ``ValueError`` as :func:`~dtensor_ring.plan.make_plan`.
    """
    check_layout_causal(layout, causal)
    docs = list(zip(bounds_local[:-1], bounds_local[1:], strict=True))
    bounds = window_bounds(causal, window)

    @functools.cache
    def doc_blocks(n: int, rank: int, src: int) -> list[tuple[tuple[int, int], Block]]:
        """The blocks of a document of ``n`` local tokens, spans from its first token."""
        q_runs, kv_runs = (layout_runs(layout, world_size, r, n) for r in (rank, src))
        return run_pair_blocks(q_runs, kv_runs, 1, bounds, rank == src)

    def blocks_of(rank: int, src: int) -> tuple[Block, ...]:
        return merge_doc_blocks(
            (ab, blk, start)
            for start, stop in docs
            if stop > start
            for ab, blk in doc_blocks(stop - start, rank, src)
        )

    plan = plan_from_blocks(
        layout, world_size, causal, blocks_of, window, bounds_local[-1] - bounds_local[0]
    )
    return plan, span_rows((b for row in plan.steps for st in row for b in st.blocks), device)


def merge_doc_blocks(per_doc: Iterable[tuple[object, Block, int]]) -> tuple[Block, ...]:
    """Merge per-document blocks ``(tag, block with Span parts, row offset)`` that share a tag
    and a mask into one block with :class:`DocSpans` parts (spans shifted by the offsets), in
    document order; ``init`` blocks first."""
    groups: dict[tuple, tuple[list, list]] = {}
    for tag, blk, off in per_doc:
        qs, kvs = groups.setdefault((not blk.init, tag, blk.causal, blk.window), ([], []))
        qs.append((blk.q.start + off, blk.q.stop + off))
        kvs.append((blk.kv.start + off, blk.kv.stop + off))
    # init blocks first, then by tag; the sort is stable, so masks keep document order
    return tuple(
        Block(DocSpans(tuple(qs)), DocSpans(tuple(kvs)), causal, window, init=not merges)
        for (merges, _, causal, window), (qs, kvs) in sorted(groups.items(), key=lambda i: i[0][:2])
    )


def span_rows(blocks: Iterable[Block], device: torch.device) -> VarlenBlocks:
    """The :class:`VarlenBlocks` of blocks with :class:`DocSpans` parts."""
    parts = {p for b in blocks for p in (b.q, b.kv)}
    return VarlenBlocks({p: _rows((), p, device) for p in parts})


# --- load balance -------------------------------------------------------------------------


def varlen_balance(
    cu_seqlens_global: Tensor | Sequence[int], world_size: int, causal: bool = True
) -> dict[str, list[float]]:
    """Per-rank attention work of each varlen layout, to choose one (no process group).

    Args:
        cu_seqlens_global: global document boundaries ``[N + 1]`` (int32 tensor or ints).
        world_size: number of context-parallel ranks W.
        causal: causal attention within documents (zigzag is causal-only).

    Returns:
        ``{layout: [work of rank 0, ..., rank W-1]}`` for "ring", "zigzag" and "llama3", the
        work counted in score pairs (query-key pairs a rank computes; multiply by ``4 * H * D``
        for forward FLOPs, the backward is ~2.5x that). The slowest rank sets the pace, so
        compare ``max(work) / mean(work)``. A layout the documents cannot use (a document not
        a multiple of W for ring, of 2W for zigzag; zigzag when not causal) is left out.

    Raises:
        ValueError: bad ``cu_seqlens_global``, or a total length not divisible by W.
    """
    bounds = _global_bounds(cu_seqlens_global)
    check_divisible(bounds, "llama3", world_size)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    report: dict[str, list[float]] = {}
    for layout in ("ring", "zigzag"):
        if (layout == "zigzag" and not causal) or any(
            n % _multiple(layout, world_size) for n in lengths
        ):
            continue
        plan = make_plan(layout, world_size, causal)
        work = [0.0] * world_size
        for n in lengths:
            for r, row in enumerate(plan.score_pairs(n // world_size)):
                work[r] += sum(row)
        report[layout] = work
    slice_len = bounds[-1] // world_size
    work = [0.0] * world_size
    for r in range(world_size):
        lo, hi = r * slice_len, (r + 1) * slice_len
        for start, n in zip(bounds[:-1], lengths, strict=True):
            a, b = max(lo, start) - start, min(hi, start + n) - start  # query positions in doc
            if a < b:
                work[r] += (b * (b + 1) - a * (a + 1)) / 2 if causal else (b - a) * n
    report["llama3"] = work
    return report
