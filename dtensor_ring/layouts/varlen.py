"""Packed (variable-length) sequences: document boundaries on the host, and varlen sharding.

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
    llama3_    rank0: A0 A1 A6 A7 | B0 B3                   local cu_seqlens [0, 4, 6]
     zigzag    rank1: A2 A3 A4 A5 | B1 B2                   (zigzag's tokens)

* ring: every document is cut into W equal contiguous pieces; rank r holds piece r of each
  document, in document order. Each document length must be a multiple of W.
* zigzag: every document is cut into 2W pieces; rank r holds pieces r and 2W-1-r of each
  document (its "lo" and "hi" half). Causal only; lengths must be multiples of 2W.
* llama3: the packed stream is cut into W contiguous slices of T/W tokens; documents may
  straddle ranks. Only T % W == 0 is needed. K/V are all-gathered (``engine/llama3.py``).
* llama3_zigzag: zigzag's pieces (lengths multiples of 2W), K/V all-gathered: every rank
  holds one early and one late piece of every document, so causal work is balanced exactly
  whatever the documents (Note [Balanced all-gather attention] in ``engine/llama3.py``).

The ring and zigzag varlen forms run the *dense* schedules of Note [Ring schedules] on every
document at once: at each step, the block ``q-part/kv-part`` of the dense plan is applied to
every document, with a part meaning that part of each document's local piece (``lo`` = the
first half of each document's local piece, ``hi`` = the second half). The engine's
``VarlenBlocks`` (``engine/varlen_blocks.py``) does this: it holds, for every part the plan
uses, the rows of the packed tensor, the part's ``cu_seqlens`` and its ``max_seqlen``,
precomputed once, so a ring step never reads anything back from the device. Documents never
meet: query piece of one document against keys of another are never computed (the kernels'
``cu_seqlens`` keep them apart).

Host reads ("syncs"): validating ``cu_seqlens`` needs its values on the host. A CPU tensor is
read directly (no device sync). A GPU tensor is copied to the host once, the first time it is
seen; the values are cached on the tensor's identity and version counter, and everything
derived from them (row indices, per-part ``cu_seqlens``) on the values, so later calls with the
same tensor (other layers, the backward) do not sync. See docs/varlen.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .base import Layout
from .registry import get_layout

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


def check_divisible(bounds: Sequence[int], layout: str | Layout, world_size: int) -> None:
    """Check that the *global* documents ``bounds`` can be sharded under ``layout``.

    Per-document layouts need every document length to be a multiple of the layout's divisor
    (ring: W, zigzag: 2W); the stream layout (llama3) only needs the total to be a multiple of W.
    """
    lay = get_layout(layout, "varlen")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    total = bounds[-1]
    if total % world_size != 0:
        raise ValueError(
            f"the total length T={total} of the packed sequence is not divisible by "
            f"world_size={world_size}; pad the packed sequence to a multiple of {world_size}"
        )
    if lay.varlen == "stream":
        return
    if lay.varlen == "placed":
        check_placed(lay, bounds, world_size)
        return
    m = lay.divisor(world_size)
    for i in range(len(bounds) - 1):
        n = bounds[i + 1] - bounds[i]
        if n % m != 0:
            raise ValueError(
                f"document {i} (tokens [{bounds[i]}, {bounds[i + 1]}), length {n}) is not a "
                f"multiple of {m}, as layout={lay.name!r} needs on {world_size} ranks (every "
                f"document is cut into {m} equal pieces); pad every document to a multiple of "
                f"{m}, or use a layout that needs no divisibility of documents: the 'llama3' "
                "layout (llama3_flash_attn_varlen_func) or, on the ring, "
                "dtensor_ring.document_layout(cu_seqlens, world_size)"
            )


def check_placed(layout: Layout, bounds: Sequence[int], world_size: int) -> None:
    """A placed layout (Note [Balanced documents]) serves only the documents and the world
    size it was made for."""
    if tuple(bounds) != layout.bounds or world_size != layout.world_size:
        raise ValueError(
            f"layout {layout.name!r} places {len(layout.bounds) - 1} documents "
            f"({layout.bounds[-1]} tokens) on {layout.world_size} ranks, not these "
            f"{len(bounds) - 1} documents ({bounds[-1]} tokens) on {world_size} ranks: make the "
            "layout from these documents (dtensor_ring.document_layout)"
        )


def check_placed_local(
    layout: Layout, bounds_local: Sequence[int], rank: int, world_size: int
) -> None:
    """The local ``cu_seqlens`` a rank passes with a placed layout must be the layout's for
    that rank (nothing else says which documents the rank's rows hold)."""
    if world_size != layout.world_size:
        raise ValueError(
            f"layout {layout.name!r} places documents on {layout.world_size} ranks, the group "
            f"has {world_size}"
        )
    problem = placed_locals_disagree(layout, {rank: bounds_local})
    if problem is not None:
        raise ValueError(
            f"{problem}; shard with dtensor_ring.shard_varlen(x, cu_seqlens, layout, rank, "
            "world_size), which returns them"
        )


def placed_locals_disagree(layout: Layout, per_rank: Mapping | Sequence) -> str | None:
    """The first rank whose local ``cu_seqlens`` (values, ``per_rank[r]``; a list over the
    ranks in the consistency mode) are not the placed ``layout``'s for it, or None."""
    items = per_rank.items() if isinstance(per_rank, Mapping) else enumerate(per_rank)
    for rank, bounds_local in items:
        if tuple(bounds_local) != layout.local_bounds[rank]:
            return (
                f"rank {rank} passed cu_seqlens {list(bounds_local)}, not its local documents "
                f"under layout {layout.name!r} ({list(layout.local_bounds[rank])})"
            )
    return None


def check_local_documents(bounds_local: Sequence[int], layout: Layout, world_size: int) -> None:
    """Every local document must hold the layout's chunks per rank (zigzag: even lengths)."""
    c = layout.chunks_per_rank
    for i in range(len(bounds_local) - 1):
        n = bounds_local[i + 1] - bounds_local[i]
        if n % c != 0:
            raise ValueError(
                f"document {i} has {n} tokens on this rank (local cu_seqlens), i.e. "
                f"{n * world_size} globally; {layout.name} varlen needs every document's length "
                f"to be a multiple of {c} * world_size = {c * world_size} ({c} pieces per rank). "
                "Pad every document, or use a layout that needs no divisibility of documents: "
                "llama3_flash_attn_varlen_func or, on the ring, dtensor_ring.document_layout"
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


# --- which global tokens a rank holds ------------------------------------------------------


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
    cu_seqlens: Tensor | Sequence[int], layout: str | Layout, rank: int, world_size: int
) -> Tensor:
    """Global indices (int64 ``[T // world_size]``) of the tokens ``rank`` holds, in order.

    Args:
        cu_seqlens: the *global* document boundaries ``[N + 1]`` (int32 tensor or ints).
        layout: "ring", "zigzag", "llama3" (Note [Varlen layouts]) or a placed layout
            (:func:`dtensor_ring.document_layout`, made from these documents).

    Positions within documents (for RoPE) follow as ``idx - cu_seqlens[doc]`` with
    ``doc = searchsorted(cu_seqlens, idx, right=True) - 1``.
    Raises ``ValueError`` when the documents do not divide as ``layout`` needs.
    """
    lay = get_layout(layout, "varlen")
    bounds = global_bounds(cu_seqlens)
    check_divisible(bounds, lay, world_size)
    _check_rank(rank, world_size)
    if lay.varlen == "stream":
        return lay.token_indices(bounds[-1], rank, world_size)
    if lay.varlen == "placed":
        return lay.indices[rank].clone()
    return torch.cat(
        [
            a + lay.token_indices(b - a, rank, world_size)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )


def global_bounds(cu_seqlens: Tensor | Sequence[int]) -> tuple[int, ...]:
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
    cu_seqlens: Tensor | Sequence[int], layout: str | Layout, rank: int, world_size: int
) -> Tensor:
    """Local ``cu_seqlens`` (int32 ``[N_local + 1]``) of ``rank`` under ``layout``.

    ring / zigzag: ``cu_seqlens // world_size`` (the same on every rank). llama3: the rank's
    slice's document boundaries (= ``cu_seqlens_q`` of ``llama3_flash_attn_prepare_cu_seqlens``).
    A placed layout: the documents the rank holds, whole or a document's pieces together.
    The result is on ``cu_seqlens``'s device (CPU for a list).
    """
    lay = get_layout(layout, "varlen")
    bounds = global_bounds(cu_seqlens)
    check_divisible(bounds, lay, world_size)
    _check_rank(rank, world_size)
    if lay.varlen == "stream":
        local = llama3_local_bounds(bounds, rank, world_size)
    elif lay.varlen == "placed":
        local = list(lay.local_bounds[rank])
    else:
        local = [b // world_size for b in bounds]
    device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else None
    return torch.tensor(local, dtype=torch.int32, device=device)


def shard_varlen(
    full: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    layout: str | Layout,
    rank: int,
    world_size: int,
    seq_dim: int = 0,
) -> tuple[Tensor, Tensor]:
    """The part of a packed tensor that ``rank`` holds under ``layout`` (a copy; no comm).

    Args:
        full: any tensor whose dim ``seq_dim`` is the packed stream of T tokens (e.g.
            ``q [T, H, D]``, ``qkv [T, 3, H, D]``, position ids ``[T]``).
        cu_seqlens: *global* document boundaries ``[N + 1]`` (int32, ``cu_seqlens[-1] == T``).
        layout: "ring", "zigzag", "llama3" (Note [Varlen layouts]) or a placed layout
            (:func:`dtensor_ring.document_layout`, made from these documents).
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
    bounds = global_bounds(cu_seqlens)
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
    parts: Sequence[Tensor],
    cu_seqlens: Tensor | Sequence[int],
    layout: str | Layout,
    seq_dim: int = 0,
) -> Tensor:
    """Inverse of :func:`shard_varlen`: every rank's local part, in rank order -> full tensor.

    Args:
        parts: ``world_size`` tensors, ``T // world_size`` tokens each along ``seq_dim``.
        cu_seqlens: the *global* document boundaries.
    """
    world_size = len(parts)
    bounds = global_bounds(cu_seqlens)
    order = torch.cat(
        [varlen_token_indices(bounds, layout, r, world_size) for r in range(world_size)]
    )
    if order.numel() != sum(p.shape[seq_dim] for p in parts):
        raise ValueError(
            f"the parts hold {sum(p.shape[seq_dim] for p in parts)} tokens, cu_seqlens {bounds[-1]}"
        )
    inverse = torch.argsort(order).to(parts[0].device)
    return torch.cat(list(parts), dim=seq_dim).index_select(seq_dim, inverse)


def check_token_positions(
    positions: object, layout: str | Layout, cu_seqlens_local: Sequence[int], rank: int,
    world_size: int,
) -> None:  # fmt: skip
    """``ValueError`` unless ``positions`` are the tokens the per-document ``layout`` places on
    ``rank``: what a varlen door told where its shards came from checks (nothing in q, k, v
    says how they were sharded; head-tail shards of a packed row are not per-document zigzag
    shards, and computing on them as such is silently wrong).

    Args:
        positions: int ``[T_local]``, the index of each local token in the whole packed
            sequence (e.g. sequential positions sharded alongside the inputs).
        cu_seqlens_local: the door's local boundaries (global ``// W``).
    """
    if not isinstance(positions, Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"positions must be an int32/int64 tensor of the local tokens' indices in the whole "
            f"packed sequence, got {type(positions).__name__} {getattr(positions, 'dtype', '')}"
        )
    if positions.shape != (cu_seqlens_local[-1],):
        raise ValueError(
            f"positions must be [T_local] = [{cu_seqlens_local[-1]}], got {tuple(positions.shape)}"
        )
    lay = get_layout(layout, "varlen")
    global_cu = lay.bounds if lay.varlen == "placed" else [c * world_size for c in cu_seqlens_local]
    got = positions.detach().to("cpu", torch.int64)
    if torch.equal(got, varlen_token_indices(global_cu, lay, rank, world_size)):
        return
    total, hint = global_cu[-1], ""
    for dense in ("ring", "zigzag"):
        lay = get_layout(dense, "dense")
        if total % lay.divisor(world_size) == 0 and torch.equal(
            got, lay.token_indices(total, rank, world_size)
        ):
            hint = (
                " They are contiguous chunks of the whole packed sequence: "
                "llama3_flash_attn_varlen_func (its stream layout) computes exactly on them."
                if dense == "ring"
                else " They are the whole packed sequence in head-tail order (2W chunks of the "
                "row, not of each document): pass layout=dtensor_ring.documents_as_sharded("
                "cu_seqlens, 'zigzag', W) with its local cu_seqlens, or shard each document "
                "(shard_varlen(..., 'zigzag'))."
            )
    name = getattr(layout, "name", layout)
    raise ValueError(
        f"positions: rank {rank} holds other tokens than layout={name!r} places on it (each "
        f"document split on its own): attention on them as such would be wrong.{hint}"
    )
