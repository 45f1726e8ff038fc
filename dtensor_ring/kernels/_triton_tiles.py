"""An in-place Triton kernel for Note [Unrounded block gradients from flash-attn 4] (CUDA only;
imported lazily).

One launch per block backward for its (up to three) accumulators, one program per tile: it
loads the tile in the postprocess's order, waits for every thread's loads (a barrier), and
stores it back row-major and scaled. One pass over each accumulator and no second fp32 copy of
it (the eager gather makes one: +128 MiB for dq at 8192 tokens, 32 heads of 128).
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
