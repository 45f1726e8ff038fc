"""An in-place Triton kernel for Note [Unrounded block gradients from flash-attn 4] (CUDA only;
imported lazily).

One program per accumulator tile: it loads the tile in the postprocess's order, waits for every
thread's loads (a barrier), and stores it back row-major and scaled. One pass over the
accumulator and no second fp32 copy of it (the eager gather makes one: +128 MiB for dq at 8192
tokens, 32 heads of 128).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _untile_kernel(acc_ptr, perm_ptr, scale, TILE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    inside = offsets < TILE
    tile_ptr = acc_ptr + tl.program_id(0).to(tl.int64) * TILE
    source = tl.load(perm_ptr + offsets, mask=inside, other=0)
    x = tl.load(tile_ptr + source, mask=inside, other=0.0)
    tl.debug_barrier()  # every load of the tile is performed before any store (in place)
    tl.store(tile_ptr + offsets, x * scale, mask=inside)


def triton_untile_(accum: Tensor, perm: Tensor, scale: float) -> None:
    """``tiles = scale * tiles[..., perm]`` in place, for a contiguous fp32 ``accum`` of whole
    tiles of ``perm.numel()`` values."""
    tile = perm.numel()
    _untile_kernel[(accum.numel() // tile,)](
        accum, perm, scale, TILE=tile, BLOCK=triton.next_power_of_2(tile), num_warps=8
    )
