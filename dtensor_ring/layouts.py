"""Sequence layouts: which global tokens each rank holds, and helpers to shard and gather.

Note [Sequence layouts]
~~~~~~~~~~~~~~~~~~~~~~~
A global sequence of S tokens is split over W ranks; every rank holds S/W tokens, in increasing
global order. Example S = 16, W = 4 (digits are global token indices):

    ring    rank0: 0  1  2  3     rank1: 4  5  6  7     rank2: 8  9 10 11   rank3: 12 13 14 15
    zigzag  rank0: 0  1 |14 15    rank1: 2  3 |12 13    rank2: 4  5 |10 11  rank3:  6  7 | 8  9
    stripe  rank0: 0  4  8 12     rank1: 1  5  9 13     rank2: 2  6 10 14   rank3:  3  7 11 15

* ring: contiguous chunks. Simple, works for causal and non-causal attention, but with a causal
  mask rank W-1 does W times the work of rank 0.
* zigzag: the sequence is cut into 2W chunks; rank r holds chunk r and chunk 2W-1-r, so every
  rank holds one "early" and one "late" chunk and causal work is perfectly balanced.
* stripe: round-robin tokens; causal work is balanced up to one diagonal per step.

zigzag and stripe exist for causal attention (non-causal attention is balanced under ring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

Layout = Literal["ring", "zigzag", "stripe"]
LAYOUTS: tuple[str, ...] = ("ring", "zigzag", "stripe")


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a sequence layout; choose one of {LAYOUTS}")


def local_seq_divisor(layout: str, world_size: int) -> int:
    """The global sequence length must be a multiple of this for ``layout`` on ``world_size``."""
    check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def token_indices(layout: str, seq_len: int, rank: int, world_size: int) -> Tensor:
    """Global indices (int64, ``[seq_len // world_size]``) of the tokens ``rank`` holds, in order.

    Use it to build global position ids for RoPE. Raises ``ValueError`` if ``seq_len`` does not
    divide as the layout needs.
    """
    divisor = local_seq_divisor(layout, world_size)
    if seq_len % divisor != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {divisor}, as layout={layout!r} "
            f"needs on {world_size} ranks; pad the sequence to a multiple of {divisor}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if layout == "ring":
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = seq_len // (2 * world_size)
        return torch.cat(
            [
                torch.arange(rank * c, (rank + 1) * c),
                torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c),
            ]
        )
    return torch.arange(rank, seq_len, world_size)


def shard_local(
    full: Tensor, layout: Layout, rank: int, world_size: int, seq_dim: int = 1
) -> Tensor:
    """The part of ``full`` that ``rank`` holds under ``layout`` (a copy; no communication).

    Args:
        full: any tensor whose dim ``seq_dim`` is the whole sequence (length S).
        layout: "ring", "zigzag" or "stripe" (see Note [Sequence layouts]).
        rank, world_size: position in, and size of, the context-parallel group.
        seq_dim: the sequence dimension (1 for ``[B, S, H, D]``, 2 for ``[B, H, S, D]``).

    Returns:
        ``full`` with dim ``seq_dim`` reduced to the rank's ``S // world_size`` tokens.
    """
    idx = token_indices(layout, full.shape[seq_dim], rank, world_size).to(full.device)
    return full.index_select(seq_dim, idx)


def unshard_local(parts: Sequence[Tensor], layout: Layout, seq_dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_local`: every rank's part, in rank order -> the full tensor."""
    world_size = len(parts)
    seq_len = sum(p.shape[seq_dim] for p in parts)
    order = torch.cat([token_indices(layout, seq_len, r, world_size) for r in range(world_size)])
    inverse = torch.argsort(order).to(parts[0].device)
    return torch.cat(list(parts), dim=seq_dim).index_select(seq_dim, inverse)


def gather_sequence(
    local: Tensor, layout: Layout, seq_dim: int = 1, group: dist.ProcessGroup | None = None
) -> Tensor:
    """All-gather every rank's ``local`` part and return the full tensor in global token order.

    A collective: every rank of ``group`` must call it. Not differentiable.
    """
    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard_local(parts, layout, seq_dim)
