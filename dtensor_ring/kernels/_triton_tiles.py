"""Triton kernels for Note [Unrounded block gradients from flash-attn 4] (CUDA only; imported
lazily).

``triton_untile_``: one launch per block backward for its (up to three) accumulators, one
program per tile: it loads the tile in the postprocess's order, waits for every thread's loads
(a barrier), and stores it back row-major and scaled, in place. One pass over each accumulator
and no second fp32 copy of it (the eager gather makes one: +128 MiB for dq at 8192 tokens, 32
heads of 128).

``triton_untile_rows``: an accumulator's rows read straight from its tiles (a varlen one's
packed rows from its padded tiles, Note [A varlen dq accumulated inside flash-attn 4]),
scaled, cast and stored into (or added to) rows of an output: what ``untile_``, a gather of
the rows, a cast and an add do, in one launch for up to two accumulators (dK and dV; Note
[Block dK/dV added from flash-attn 4's tiles]).
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _untile_kernel(
    acc0, perm0, scale0, tile0, tiles0,
    acc1, perm1, scale1, tile1, tiles1,
    acc2, perm2, scale2, tile2,
    BLOCK: tl.constexpr,
):  # fmt: skip
    index = tl.program_id(0)
    if index < tiles0:
        acc, perm, scale, tile = acc0, perm0, scale0, tile0
    elif index < tiles0 + tiles1:
        acc, perm, scale, tile = acc1, perm1, scale1, tile1
        index -= tiles0
    else:
        acc, perm, scale, tile = acc2, perm2, scale2, tile2
        index -= tiles0 + tiles1
    offsets = tl.arange(0, BLOCK)
    inside = offsets < tile
    tile_ptr = acc + index.to(tl.int64) * tile
    source = tl.load(perm + offsets, mask=inside, other=0)
    x = tl.load(tile_ptr + source, mask=inside, other=0.0)
    tl.debug_barrier()  # every load of the tile is performed before any store (in place)
    tl.store(tile_ptr + offsets, x * scale, mask=inside)


def triton_untile_(accums: Sequence[Tensor], perms: Sequence[Tensor], scales: Sequence[float]):
    """For each (up to three) contiguous fp32 ``accum`` of whole tiles of ``perm.numel()``
    values: ``tiles = scale * tiles[..., perm]`` in place; one launch."""
    segments = [
        (a, p, float(s), p.numel(), a.numel() // p.numel())
        for a, p, s in zip(accums, perms, scales, strict=True)
    ]
    total = sum(seg[4] for seg in segments)
    block = triton.next_power_of_2(max(seg[3] for seg in segments))
    while len(segments) < 3:
        segments.append((*segments[0][:4], 0))
    (a0, p0, s0, t0, n0), (a1, p1, s1, t1, n1), (a2, p2, s2, t2, _) = segments
    _untile_kernel[(total,)](
        a0, p0, s0, t0, n0, a1, p1, s1, t1, n1, a2, p2, s2, t2, BLOCK=block, num_warps=8
    )


@triton.jit
def _untile_rows_kernel(
    rows, dest, total, heads,
    acc0, perm0, scale0, out0, hdim0, hdim_r0, head_len0, stride_b0, stride_t0, stride_h0,
    acc1, perm1, scale1, out1, hdim1, hdim_r1, head_len1, stride_b1, stride_t1, stride_h1,
    TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    PADDED: tl.constexpr, SCATTER: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    slab = tl.program_id(1).to(tl.int64)  # batch entry * heads + head: one accumulator row
    batch, head = slab // heads, slab % heads
    if tl.program_id(2) == 0:
        acc, perm, scale, out = acc0, perm0, scale0, out0
        hdim, hdim_r, head_len = hdim0, hdim_r0, head_len0
        stride_b, stride_t, stride_h = stride_b0, stride_t0, stride_h0
    else:
        acc, perm, scale, out = acc1, perm1, scale1, out1
        hdim, hdim_r, head_len = hdim1, hdim_r1, head_len1
        stride_b, stride_t, stride_h = stride_b1, stride_t1, stride_h1
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    inside = (t < total)[:, None] & (d < hdim)[None, :]
    if PADDED:  # int64: each packed row's padded row
        padded = tl.load(rows + t, mask=t < total, other=0)
    else:
        padded = t.to(tl.int64)
    tile, row = padded // TILE, padded % TILE
    source = tl.load(perm + row[:, None] * hdim_r + d[None, :], mask=inside, other=0)
    tile_start = slab * head_len + tile * (TILE * hdim_r)
    x = tl.load(acc + tile_start[:, None] + source, mask=inside, other=0.0) * scale
    if SCATTER:  # int64: each row's row of the output
        target_row = tl.load(dest + t, mask=t < total, other=0)
    else:
        target_row = t.to(tl.int64)
    target = batch * stride_b + target_row * stride_t + head * stride_h
    pointers = out + target[:, None] + d[None, :]
    if ADD:
        x += tl.load(pointers, mask=inside, other=0.0)
    tl.store(pointers, x.to(out.dtype.element_ty), mask=inside)


def triton_untile_rows(
    accums: Sequence[Tensor],
    perms: Sequence[Tensor],
    scales: Sequence[float],
    rows: Tensor | None,
    tile: int,
    outs: Sequence[Tensor],
    *,
    dest: Tensor | None = None,
    add: bool = False,
) -> None:
    """For each (up to two) contiguous fp32 accumulator ``[B, H, R * hdim_r]`` of whole tiles
    of ``tile`` rows (``perm.numel() = tile * hdim_r``): row ``rows[t]`` (int64; None: row
    ``t``) of head ``h`` of batch entry ``b``, in row-major order and scaled, into row
    ``dest[t]`` (int64; None: row ``t``) of its ``out`` ``[B, T_out, H, hdim]`` (any float
    dtype and strides, unit last; ``add``: added to it). One launch."""
    segments = [
        (a, p, float(s), o, o.shape[-1], p.numel() // tile, a.shape[-1], *_strides(o))
        for a, p, s, o in zip(accums, perms, scales, outs, strict=True)
    ]
    batch, heads = (1, *accums[0].shape[:1]) if accums[0].dim() == 2 else accums[0].shape[:2]
    total = outs[0].shape[-3] if dest is None else dest.numel()  # rows written
    block_d = triton.next_power_of_2(max(seg[4] for seg in segments))
    grid = (triton.cdiv(total, _ROWS), batch * heads, len(segments))
    if len(segments) == 1:
        segments.append(segments[0])
    pointer = perms[0]  # where rows or dest is not read
    _untile_rows_kernel[grid](
        pointer if rows is None else rows, pointer if dest is None else dest, total, heads,
        *segments[0], *segments[1], TILE=tile, ROWS=_ROWS, BLOCK_D=block_d,
        PADDED=rows is not None, SCATTER=dest is not None, ADD=add,
    )  # fmt: skip


def _strides(out: Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of ``out`` ``[B, T, H, D]`` or ``[T, H, D]`` (unit last)."""
    if out.stride(-1) != 1:
        raise ValueError("the output's last dimension must have stride 1")
    *lead, stride_t, stride_h, _ = out.stride()
    return (lead[0] if lead else 0), stride_t, stride_h


_ROWS = 16  # packed rows a program
