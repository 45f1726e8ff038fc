"""llama3 all-gather attention's per-rank metadata (data only): Notes [llama3 all-gather
attention] and [Balanced all-gather attention] in ``engine/llama3.py`` are the algorithm.

:func:`llama3_flash_attn_prepare_cu_seqlens` is ring-flash-attention's function of this name;
:func:`llama3_meta` checks a rank's metadata of the stream layout ("llama3") and derives its
blocks, :func:`gather_meta` those of a per-document layout ("llama3_zigzag"); both are cached
on the values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layouts import Layout, get_layout
from ..layouts.varlen import (
    check_bounds,
    check_cu_seqlens_tensor,
    check_divisible,
    check_local_documents,
    check_max_seqlen,
    host_values,
    varlen_token_indices,
)
from ..parts import UNBOUNDED, Block, Span
from .plan import run_block, window_bounds
from .varlen import merge_doc_blocks


def llama3_flash_attn_prepare_cu_seqlens(
    cu_seqlens: Tensor, causal: bool, rank: int, world_size: int
) -> tuple[Tensor, Tensor, int, int, slice]:
    """Per-rank metadata of the llama3 layout, as ring-flash-attention's function of this name.

    Args:
        cu_seqlens: *global* document boundaries ``[N + 1]``, int32 or int64 (values below
            2**31), ``cu_seqlens[-1] = T > 0`` with ``T % world_size == 0``; non-decreasing:
            a repeated boundary is an empty document. Read on the host (a sync on a GPU).
        causal: the attention will be causal (then ``cu_seqlens_k`` stops at the rank's slice
            end; otherwise the last local document's keys run to the document's end).
        rank, world_size: position in, and size of, the context-parallel group.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``:
        ``cu_seqlens_q`` int32 ``[n + 1]``, the rank's local documents (its slice of L = T/W
        tokens cut at document boundaries); ``cu_seqlens_k`` int32 ``[n + 1]``, each local
        document's keys within the all-gathered K/V restricted to ``local_k_slice`` (a
        ``slice`` of the T gathered tokens: from the first local document's start); the
        ``max_seqlen_*`` are Python ints. Tensors are on ``cu_seqlens``'s device. Empty
        documents inside the slice, or starting at its first token, are kept (repeated
        entries), as ring-flash-attention keeps them; the llama3 functions skip them.

    Raises:
        ValueError: bad ``cu_seqlens``, ``T % world_size != 0``, or a rank out of range.
    """
    bounds = _global_bounds(cu_seqlens)
    check_divisible(bounds, "llama3", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    length = bounds[-1] // world_size
    lo, hi = rank * length, (rank + 1) * length
    # ring-flash-attention's torch.searchsorted (first boundary >= lo, one back unless == lo)
    left = next(i for i, b in enumerate(bounds) if b >= lo)
    if bounds[left] != lo:
        left -= 1
    right = next(i for i, b in enumerate(bounds) if b >= hi)  # first boundary at/after hi
    docs = list(bounds[left : right + 1])
    cu_q = [0, *(b - lo for b in docs[1:-1]), length]
    slice_left = docs[0]
    slice_right = hi if causal else docs[-1]
    cu_k = [b - slice_left for b in docs[:-1]] + [slice_right - slice_left]

    def tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=cu_seqlens.device)

    return (
        tensor(cu_q),
        tensor(cu_k),
        max(b - a for a, b in zip(cu_q[:-1], cu_q[1:], strict=True)),
        max(b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True)),
        slice(slice_left, slice_right),
    )


_INT32_MAX = 2**31 - 1


def _global_bounds(cu_seqlens: object) -> tuple[int, ...]:
    """Check the global ``cu_seqlens`` of :func:`llama3_flash_attn_prepare_cu_seqlens` (int32
    or int64; empty documents allowed) and return its values."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = cu_seqlens.dtype if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor, got {got}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be 1-D [num_docs + 1] with at least 2 entries (0 and the total), "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = host_values(cu_seqlens)
    check_nondecreasing(bounds, bounds[-1])
    if not 0 < bounds[-1] <= _INT32_MAX:
        raise ValueError(
            f"cu_seqlens must end at the number of tokens T, with 0 < T < 2**31 (the int32 "
            f"range of the kernels' boundaries), got cu_seqlens[-1]={bounds[-1]}"
        )
    return bounds


def check_nondecreasing(
    bounds: Sequence[int], total: int, name: str = "cu_seqlens", what: str = "the number of tokens"
) -> None:
    """Check document boundaries that may hold empty documents: start at 0, non-decreasing,
    end at ``total`` (``what``)."""
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={bounds[0]}")
    for i in range(len(bounds) - 1):
        if bounds[i + 1] < bounds[i]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}]={bounds[i]} and "
                f"{name}[{i + 1}]={bounds[i + 1]}"
            )
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at {what} {total}, got {name}[-1]={bounds[-1]}")


def _without_empty(bounds: Sequence[int]) -> tuple[int, ...]:
    """Non-decreasing boundaries with the empty documents (repeated entries) dropped."""
    return tuple(b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1])


def llama3_locals_disagree(per_rank: list[tuple], causal: bool) -> str | None:
    """Whether every rank's llama3 metadata comes from the same global documents (for the
    consistency mode): ``per_rank[r] = (cu_seqlens_q values, cu_seqlens_k values,
    (k_start, k_stop), L)``. The documents are rebuilt from all ranks (inner query boundaries
    and each rank's first document start) and each rank's metadata, without its empty
    documents, is compared with what :func:`llama3_flash_attn_prepare_cu_seqlens` gives for
    them; returns the first difference, or None."""
    W, L = len(per_rank), per_rank[0][3]
    starts = {r * L + b for r, (bq, *_) in enumerate(per_rank) for b in bq[1:-1]}
    starts |= {k_slice[0] for _, _, k_slice, _ in per_rank} | {0, W * L}
    bounds = torch.tensor(sorted(starts), dtype=torch.int32)
    for r, (bq, bk, k_slice, _) in enumerate(per_rank):
        cu_q, cu_k, _, _, sl = llama3_flash_attn_prepare_cu_seqlens(bounds, causal, r, W)
        expected = (tuple(cu_q.tolist()), tuple(cu_k.tolist()), (sl.start, sl.stop))
        # empty documents are not rebuilt (and change nothing): compare without them
        if (_without_empty(bq), _without_empty(bk), tuple(k_slice)) != expected:
            return (
                f"llama3 metadata: rank {r} has cu_seqlens_q={list(bq)}, cu_seqlens_k="
                f"{list(bk)}, local_k_slice={k_slice}, but the documents {bounds.tolist()} "
                f"of all ranks (causal={causal}) give {[list(e) for e in expected[:2]]}, "
                f"{expected[2]}"
            )
    return None


@dataclass(frozen=True)
class Llama3Meta:
    """Checked metadata of one rank's all-gather call (built by :func:`llama3_meta` for the
    stream layout, :func:`gather_meta` for a per-document layout).

    ``cu_q``/``cu_k`` (empty documents dropped) are on the tensors' device. ``diagonal``
    (causal stream layout): the engine computes each local document's square causal block on
    the rank's own K/V, plus ``prefix_block``. ``prefix`` (causal only) is the number of keys
    of the first local document before this rank's slice (0: it starts here), and
    ``first_len`` that document's local length. ``window``: the sliding window (causal:
    ``(left, 0)``) or None; ``prefix_block``: the first document's queries against its keys
    on earlier ranks, spans relative to the document's local queries and to its prefix keys
    (None: nothing to compute). Otherwise ``blocks`` (:class:`DocSpans` parts: query rows,
    and rows of the keys ``[k_start, k_stop)`` of the gathered K/V in global order), every
    local query in exactly one. ``to_global`` (int64 ``[W L]`` on the device, None when the
    gathered K/V are already in global order): gathered row ``to_global[i]`` holds global
    token ``i``; ``to_gathered`` is its inverse.
    """

    causal: bool
    rank: int
    world_size: int
    local_len: int
    k_start: int
    k_stop: int
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    prefix: int
    first_len: int
    window: tuple[int, int] | None
    prefix_block: Block | None
    blocks: tuple[Block, ...]
    diagonal: bool = False
    to_global: Tensor | None = None
    to_gathered: Tensor | None = None


def llama3_meta(
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    k_start: int,
    k_stop: int,
    local_len: int,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None = None,
) -> Llama3Meta:
    """Check the llama3 metadata against this rank's ``local_len`` tokens; raise ValueError.

    Empty documents (repeated boundaries, empty in both ``cu_seqlens_q`` and ``_k``) are
    accepted and dropped: the kernels never see a zero-length document.

    ``window``: a normalised sliding window (``resolve.normalize_window``).
    """
    check_cu_seqlens_tensor(cu_seqlens_q, "cu_seqlens_q")
    check_cu_seqlens_tensor(cu_seqlens_k, "cu_seqlens_k")
    bq = host_values(cu_seqlens_q)
    bk = host_values(cu_seqlens_k)
    check_llama3_metadata(
        bq, bk, max_seqlen_q, max_seqlen_k, k_start, k_stop, local_len, causal, rank, world_size
    )
    return _llama3_meta_cached(
        _without_empty(bq),
        _without_empty(bk),
        k_start,
        k_stop,
        local_len,
        causal,
        rank,
        world_size,
        torch.device(device),
        window,
    )


def check_llama3_metadata(
    bq: Sequence[int],
    bk: Sequence[int],
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    k_start: int,
    k_stop: int,
    local_len: int,
    causal: bool,
    rank: int,
    world_size: int,
) -> None:
    """The checks of one rank's llama3 metadata (``cu_seqlens_q/k`` values ``bq``, ``bk``)
    against its ``local_len`` tokens that need no other rank's; raise ValueError. The front
    door runs them before the call compares across ranks (so that one rank's error reaches
    every rank), the op again when it runs."""
    check_nondecreasing(bq, local_len, "cu_seqlens_q")
    if not 0 <= k_start < k_stop <= world_size * local_len:
        raise ValueError(
            f"local_k_slice=slice({k_start}, {k_stop}) must lie within the "
            f"{world_size * local_len} gathered tokens and be non-empty"
        )
    check_nondecreasing(bk, k_stop - k_start, "cu_seqlens_k", "the length of local_k_slice")
    if len(bk) != len(bq):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same documents, got {len(bq)} and "
            f"{len(bk)} entries"
        )
    for i in range(len(bq) - 1):  # an empty document (no queries) is skipped: it has no keys
        if bq[i + 1] == bq[i] and bk[i + 1] != bk[i]:
            raise ValueError(
                f"document {i} is empty in cu_seqlens_q ({bq[i]} twice) but has "
                f"{bk[i + 1] - bk[i]} keys in cu_seqlens_k; llama3_flash_attn_prepare_cu_seqlens "
                "gives an empty document no keys"
            )
    prefix = rank * local_len - k_start
    if causal:
        shifted = [b + prefix for b in bq[1:]]
        if prefix < 0 or list(bk[1:]) != shifted:
            raise ValueError(
                "causal llama3 attention needs cu_seqlens_k and local_k_slice as "
                "llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal=True, rank, world_size) "
                f"returns them for rank {rank}: with local_k_slice.start={k_start} the keys of "
                f"local document i must end where its queries end, i.e. cu_seqlens_k[1:] == "
                f"{shifted}, got {list(bk[1:])}"
            )
    hint = "what llama3_flash_attn_prepare_cu_seqlens returns"
    check_max_seqlen("max_seqlen_q", max_seqlen_q, bq, hint)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, bk, hint)


@functools.lru_cache(maxsize=64)
def _llama3_meta_cached(
    bq: tuple[int, ...],
    bk: tuple[int, ...],
    k_start: int,
    k_stop: int,
    local_len: int,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None,
) -> Llama3Meta:
    # Cached on the values: the cu_seqlens tensors are copied to ``device`` once per batch.
    prefix = rank * local_len - k_start if causal else 0
    prefix_block, blocks = None, ()
    if prefix:  # queries at document positions prefix + i, keys at positions 0..prefix-1
        lo = -UNBOUNDED if window is None else -window[0]
        prefix_block = run_block((0, bq[1], prefix), (0, prefix, 0), 1, lo, 0, init=False)
    if not causal:  # document i: its local queries (from position a_i) against all its keys
        bounds = window_bounds(False, window) if window else (-UNBOUNDED, UNBOUNDED)
        per_doc = [
            (
                (),
                run_block(
                    (bq[i], bq[i + 1] - bq[i], rank * local_len - k_start if i == 0 else 0),
                    (bk[i], bk[i + 1] - bk[i], 0),
                    1,
                    *bounds,
                    init=True,
                ),
                0,
            )
            for i in range(len(bq) - 1)
            if bq[i + 1] > bq[i]
        ]
        blocks = merge_doc_blocks(per_doc)
    return Llama3Meta(
        causal=causal,
        rank=rank,
        world_size=world_size,
        local_len=local_len,
        k_start=k_start,
        k_stop=k_stop,
        cu_q=torch.tensor(bq, dtype=torch.int32, device=device),
        cu_k=torch.tensor(bk, dtype=torch.int32, device=device),
        max_q=max(b - a for a, b in zip(bq[:-1], bq[1:], strict=True)),
        max_k=max(b - a for a, b in zip(bk[:-1], bk[1:], strict=True)),
        prefix=prefix,
        first_len=bq[1],
        window=window,
        prefix_block=prefix_block,
        blocks=blocks,
        diagonal=causal,
    )


# --- per-document layouts (llama3_zigzag) ---------------------------------------------------


def gather_meta(
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    local_len: int,
    layout: str | Layout,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None = None,
) -> Llama3Meta:
    """Check the *local* ``cu_seqlens`` (global ``// W``, as ring/zigzag varlen) of an
    all-gather call in a per-document ``layout`` against this rank's ``local_len`` tokens and
    derive its blocks (Note [Balanced all-gather attention]); raise ValueError.

    ``window``: a normalised sliding window within documents (``resolve.normalize_window``).
    """
    lay = get_layout(layout, "documents")
    check_cu_seqlens_tensor(cu_seqlens)
    bounds = host_values(cu_seqlens)
    check_bounds(bounds, local_len)
    check_local_documents(bounds, lay, world_size)
    check_max_seqlen("max_seqlen", max_seqlen, bounds)
    return _gather_meta_cached(
        tuple(bounds), lay, causal, rank, world_size, torch.device(device), window
    )


@functools.lru_cache(maxsize=64)
def _gather_meta_cached(
    bounds: tuple[int, ...],
    layout: Layout,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None,
) -> Llama3Meta:
    W, L = world_size, bounds[-1]
    if layout.stride(W) != 1:
        raise ValueError(
            f"all-gather attention needs layout runs of consecutive tokens; layout="
            f"{layout.name!r} has stride {layout.stride(W)}"
        )
    global_bounds = tuple(b * W for b in bounds)
    left, right = (-1, -1) if window is None else window
    per_doc = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        n, g_doc = (b - a) * W, a * W  # the document's global length and first position
        if not causal and window is None:  # every local query sees the whole document
            per_doc.append(((), Block(Span(a, b), Span(g_doc, g_doc + n), False, init=True), 0))
            continue
        for start, size, g in layout.runs(b - a, rank, W):
            k0 = 0 if left < 0 else max(0, g - left)
            k1 = g + size if causal else n if right < 0 else min(n, g + size + right)
            e = k1 - (g + size)  # keys after the run's last query
            mask = (-1 if left < 0 else left + e, 0 if causal else -1 if right < 0 else right - e)
            q, kv = Span(a + start, a + start + size), Span(g_doc + k0, g_doc + k1)
            per_doc.append(((), Block(q, kv, False, mask, init=True), 0))
    order = torch.cat([varlen_token_indices(global_bounds, layout, r, W) for r in range(W)])
    return Llama3Meta(
        causal=causal,
        rank=rank,
        world_size=W,
        local_len=L,
        k_start=0,
        k_stop=W * L,
        cu_q=torch.tensor(bounds, dtype=torch.int32, device=device),
        cu_k=torch.tensor(global_bounds, dtype=torch.int32, device=device),
        max_q=max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)),
        max_k=max(b - a for a, b in zip(global_bounds[:-1], global_bounds[1:], strict=True)),
        prefix=0,
        first_len=bounds[1],
        window=window,
        prefix_block=None,
        blocks=merge_doc_blocks(per_doc),
        to_global=torch.argsort(order).to(device),
        to_gathered=order.to(device),
    )
