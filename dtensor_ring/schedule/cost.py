"""Cost models on paper: bytes each rank sends, and the attention work of varlen layouts.

Nothing here communicates or needs a process group; :meth:`~dtensor_ring.schedule.plan.Plan.
flops` is the per-step work model of the ring schedules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor

from ..layouts import alias_algorithm, get_layout, layout_names, order_layout
from ..layouts.varlen import check_divisible, global_bounds
from .plan import make_plan


def kv_repeat(num_kv_heads: int, world_size: int) -> int:
    """How many times each K/V head is repeated before a head all-to-all over ``world_size``
    (Note [Ulysses attention]): the least ``f`` with ``f * H_kv % world_size == 0``."""
    return world_size // math.gcd(num_kv_heads, world_size)


# --- communication volume --------------------------------------------------------------


class CommVolume(NamedTuple):
    """Bytes one rank sends in the forward and in the backward of one attention call."""

    forward: int
    backward: int


def comm_volume(
    S: int,
    H: int,
    H_kv: int,
    D: int,
    world_size: int,
    mode: str,
    dtype_bytes: int = 2,
    ulysses_size: int | None = None,
) -> CommVolume:
    """Per-rank bytes sent by one attention call of batch 1 (multiply by B), per docs/ulysses.md.

    Args:
        S: global sequence length; H, H_kv: query and K/V heads; D: head dim.
        world_size: ranks in the context-parallel group (hybrid: ring size x Ulysses size).
        mode: "ring", "ulysses" or "hybrid".
        dtype_bytes: bytes per element of q/k/v (2 for bf16/fp16). Ring attention's travelling
            dK/dV accumulators use the accumulation dtype (4 bytes; 8 for fp64).
        ulysses_size: the Ulysses group size U (hybrid only; must divide world_size).

    Formulas (``n = S / world_size`` tokens per rank, ``b = dtype_bytes``, ``a`` accumulation
    bytes, ``H_kv' = H_kv * W / gcd(H_kv, W)`` for a Ulysses group of W)::

        ring     fwd (W-1) * 2 n H_kv D b            bwd fwd + W * 2 n H_kv D a
        ulysses  fwd (W-1)/W * n D (2H + 2H_kv') b   bwd the same (dout, dq, dk, dv)
        hybrid   Ulysses over U with n, then ring over R = W/U on n*U tokens, H_kv'/U heads

    The lse all-to-all of ``return_attn_probs=True`` (``n H`` accumulation-dtype values) is not
    counted.
    """
    if mode not in ("ring", "ulysses", "hybrid"):
        raise ValueError(f"mode={mode!r}; choose 'ring', 'ulysses' or 'hybrid'")
    W = world_size
    if S % W != 0:
        raise ValueError(f"S={S} is not divisible by world_size={W}")
    acc = 8 if dtype_bytes == 8 else 4
    n = S // W

    def ring(R: int, tokens: int, kv_heads: int) -> CommVolume:
        kv = 2 * tokens * kv_heads * D
        fwd = (R - 1) * kv * dtype_bytes
        return CommVolume(fwd, fwd + (R * kv * acc if R > 1 else 0))

    def ulysses(U: int) -> CommVolume:
        if H % U != 0:
            raise ValueError(f"H={H} is not divisible by the Ulysses group size {U}")
        kv_heads = H_kv * kv_repeat(H_kv, U)
        vol = (U - 1) * n * D * (2 * H + 2 * kv_heads) * dtype_bytes // U
        return CommVolume(vol, vol)

    if mode == "ring":
        return ring(W, n, H_kv)
    if mode == "ulysses":
        return ulysses(W)
    if ulysses_size is None or W % ulysses_size != 0:
        raise ValueError(f"hybrid needs ulysses_size dividing world_size={W}, got {ulysses_size}")
    U = ulysses_size
    a2a = ulysses(U)
    r = ring(W // U, n * U, H_kv * kv_repeat(H_kv, U) // U)
    return CommVolume(a2a.forward + r.forward, a2a.backward + r.backward)


def varlen_balance(
    cu_seqlens_global: Tensor | Sequence[int], world_size: int, causal: bool = True
) -> dict[str, list[float]]:
    """Per-rank attention work of each varlen layout, to choose one (no process group).

    Args:
        cu_seqlens_global: global document boundaries ``[N + 1]`` (int32 tensor or ints).
        world_size: number of context-parallel ranks W.
        causal: causal attention within documents (zigzag is causal-only).

    Returns:
        ``{layout: [work of rank 0, ..., rank W-1]}`` for every registered varlen layout
        ("ring", "zigzag", "llama3" and "llama3_zigzag" built in; an all-gather layout holding
        zigzag's tokens computes exactly zigzag's pairs), the
        work counted in score pairs (query-key pairs a rank computes; multiply by ``4 * H * D``
        for forward FLOPs, the backward is ~2.5x that). The slowest rank sets the pace, so
        compare ``max(work) / mean(work)``. A layout the documents cannot use (a document not
        a multiple of W for ring, of 2W for zigzag; zigzag when not causal) is left out.

    Raises:
        ValueError: bad ``cu_seqlens_global``, or a total length not divisible by W.
    """
    bounds = global_bounds(cu_seqlens_global)
    check_divisible(bounds, "llama3", world_size)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    report: dict[str, list[float]] = {}
    for layout in (get_layout(name) for name in layout_names("documents")):
        ring_only = alias_algorithm(layout.name) in (None, "ring")  # the others take any mask
        if (layout.causal_only and ring_only and not causal) or any(
            n % layout.divisor(world_size) for n in lengths
        ):
            continue
        work = [0.0] * world_size
        for n in lengths:  # a plan per local length (the same plan for layouts with a table)
            # without a mask every piece meets its whole document: the order-free plan
            plan = make_plan(
                order_layout(layout.name, causal, (-1, -1)),
                world_size,
                causal,
                None,
                n // world_size,
            )
            for r, row in enumerate(plan.score_pairs(n // world_size)):
                work[r] += sum(row)
        report[layout.name] = work
    stream = _stream_work(bounds, lengths, world_size, causal)
    for name in layout_names("varlen"):
        if get_layout(name).varlen == "stream":
            report[name] = list(stream)
    return report


def _stream_work(
    bounds: Sequence[int], lengths: Sequence[int], world_size: int, causal: bool
) -> list[float]:
    """Score pairs per rank when the packed stream is cut into W contiguous slices (llama3)."""
    slice_len = bounds[-1] // world_size
    work = [0.0] * world_size
    for r in range(world_size):
        lo, hi = r * slice_len, (r + 1) * slice_len
        for start, n in zip(bounds[:-1], lengths, strict=True):
            a, b = max(lo, start) - start, min(hi, start + n) - start  # query positions in doc
            if a < b:
                work[r] += (b * (b + 1) - a * (a + 1)) / 2 if causal else (b - a) * n
    return work
