"""The built-in layouts: ring, zigzag, stripe (Note [Sequence layouts]) and llama3's packed
stream; the aliases "llama3_zigzag" and "auto" (zigzag's tokens with an algorithm).

Their ``part_block`` tables are the schedules of Note [Ring schedules] in ``schedule/plan.py``.
"""

from __future__ import annotations

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
