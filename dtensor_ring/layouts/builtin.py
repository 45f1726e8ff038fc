"""The built-in layouts: ring, zigzag, stripe (Note [Sequence layouts]) and llama3's packed
stream; the aliases "llama3_zigzag" and "auto" (zigzag's tokens with an algorithm).

Their ``part_block`` tables are the schedules of Note [Ring schedules] in ``schedule/plan.py``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from ..parts import Block, Part
from .base import Layout, Run

A, LO, HI, TAIL, HEAD = Part.ALL, Part.LO, Part.HI, Part.TAIL, Part.HEAD


class RingLayout(Layout):
    """Contiguous chunks: rank r holds tokens ``[r n, (r + 1) n)``."""

    name = "ring"
    varlen = "documents"

    @property
    def identity_order(self) -> bool:
        return True

    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        return ((0, seq_local, rank * seq_local),)

    def part_block(self, causal: bool, world_size: int, rank: int, src: int) -> Block | None:
        if src == rank:
            return Block(A, A, causal, init=True)
        return Block(A, A, False) if not causal or src < rank else None


class ZigzagLayout(Layout):
    """Rank r holds chunks r and 2W-1-r of 2W: causal work balanced exactly."""

    name = "zigzag"
    chunks_per_rank = 2
    causal_only = True
    varlen = "documents"

    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        c = seq_local // 2
        return ((0, c, rank * c), (c, c, (2 * world_size - 1 - rank) * c))

    def part_block(self, causal: bool, world_size: int, rank: int, src: int) -> Block | None:
        if src == rank:
            return Block(A, A, causal, init=True)
        if not causal:
            return Block(A, A, False)
        return Block(A, LO, False) if src < rank else Block(HI, A, False)


class StripeLayout(Layout):
    """Round-robin tokens: local token i is global ``i W + r``."""

    name = "stripe"
    causal_only = True

    def stride(self, world_size: int) -> int:
        return world_size

    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        return ((0, seq_local, rank),)

    def part_block(self, causal: bool, world_size: int, rank: int, src: int) -> Block | None:
        if src == rank:
            return Block(A, A, causal, init=True)
        if not causal:
            return Block(A, A, False)
        return Block(A, A, True) if src < rank else Block(TAIL, HEAD, True)


class Llama3Layout(RingLayout):
    """The packed stream cut into W contiguous slices; documents may straddle ranks (K/V are
    all-gathered: Note [llama3 all-gather attention]). Packed sequences only."""

    name = "llama3"
    dense = False
    varlen = "stream"


BUILTIN_LAYOUTS: tuple[Layout, ...] = (
    RingLayout(),
    ZigzagLayout(),
    StripeLayout(),
    Llama3Layout(),
)

BUILTIN_ALIASES: dict[str, tuple[str, str]] = {
    # name: (the layout that places the tokens, the algorithm it runs by default)
    "llama3_zigzag": ("zigzag", "all_gather"),  # Llama 3's balanced all-gather attention
    "auto": ("zigzag", "auto"),  # ring, all-gather or Ulysses chosen per call
}
"""Layout names that also say how K/V move (Note [Layouts and algorithms] in
``dtensor_ring/algorithm.py``): kept as documented shorthands."""


class TokenLayout(Layout):
    """A layout given as data, for one sequence of ``S`` tokens on ``W`` ranks: rank r holds
    the global tokens ``indices[r]``, in that local order (``indices``: int64 ``[W, S / W]``,
    a permutation of ``0 .. S-1``). Its runs are the stretches of consecutive tokens. Made by
    :func:`~dtensor_ring.layouts.balancer_layout` from any load balancer's permutation and by
    the mask-aware balance (Note [Mask-aware balance] in ``schedule/flex.py``); not registered
    (it is data): pass the object as ``layout=``. Its name holds a digest of the indices, so
    equal layouts share plans."""

    def __init__(self, indices: Tensor, prefix: str = "tokens"):
        indices = torch.as_tensor(indices, dtype=torch.int64).cpu().contiguous()
        if indices.ndim != 2 or not torch.equal(
            indices.flatten().sort().values, torch.arange(indices.numel())
        ):
            raise ValueError(
                f"a token layout takes [W, S / W] indices forming a permutation of 0 .. S-1, got "
                f"shape {tuple(indices.shape)}"
            )
        self.indices = indices
        self.world_size, self.seq_local = indices.shape
        # the shape too: the same permutation on another number of ranks is another layout
        data = repr(tuple(indices.shape)).encode() + indices.numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=6).hexdigest()
        self.name = f"{prefix}_{digest}"
        self._runs = tuple(_consecutive_runs(row) for row in indices)

    def __eq__(self, other: object) -> bool:  # the same tokens on the same ranks
        return isinstance(other, TokenLayout) and torch.equal(self.indices, other.indices)

    def __hash__(self) -> int:
        return hash(self.name)

    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        self._check(seq_local * world_size, world_size)
        return self._runs[rank]

    def check_length(self, seq_len: int, world_size: int) -> None:
        self._check(seq_len, world_size)

    def check_local_length(self, seq_local: int, world_size: int, what: str = "") -> None:
        self._check(seq_local * world_size, world_size, what)

    def _check(self, seq_len: int, world_size: int, what: str = "") -> None:
        W, n = self.world_size, self.seq_local
        if (seq_len, world_size) != (W * n, W):
            raise ValueError(
                f"{what}layout {self.name!r} places {W * n} tokens on {W} ranks "
                f"({n} a rank); got {seq_len} tokens on {world_size} ranks"
            )


def _consecutive_runs(row: Tensor) -> tuple[Run, ...]:
    """``(local start, length, global start)`` of each stretch of consecutive tokens."""
    breaks = (torch.nonzero(row.diff() != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, len(row)]
    return tuple((a, b - a, int(row[a])) for a, b in zip(starts, stops, strict=True))
