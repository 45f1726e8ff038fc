"""The built-in layouts: ring, zigzag, stripe (Note [Sequence layouts]) and llama3's packed
stream; the aliases "llama3_zigzag" and "auto" (zigzag's tokens with an algorithm).

Their ``part_block`` tables are the schedules of Note [Ring schedules] in ``schedule/plan.py``.
"""

from __future__ import annotations

import zlib

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


class ChunkLayout(Layout):
    """A layout given as a table: the sequence is cut into ``W * k`` equal chunks and rank r
    holds chunks ``chunks[r]`` (``k`` of them, in increasing order). Built for one world size;
    not registered (it is data: e.g. the mask-aware layout of Note [Mask-aware balance] in
    ``schedule/flex.py``): pass the object as ``layout=``. Its name holds a digest of the
    table, so equal tables share plans."""

    causal_only = False

    def __init__(self, chunks: tuple[tuple[int, ...], ...], prefix: str = "chunks"):
        k = len(chunks[0])
        flat = sorted(c for row in chunks for c in row)
        if any(len(row) != k or list(row) != sorted(row) for row in chunks) or flat != list(
            range(k * len(chunks))
        ):
            raise ValueError(
                f"chunks must give every rank k sorted chunk ids of 0..W*k-1: {chunks}"
            )
        self.chunks, self.chunks_per_rank = chunks, k
        self.name = f"{prefix}_{zlib.crc32(repr(chunks).encode()):08x}"

    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        if world_size != len(self.chunks):
            raise ValueError(
                f"layout {self.name!r} was built for {len(self.chunks)} ranks, not {world_size}"
            )
        c = seq_local // self.chunks_per_rank
        runs: list[list[int]] = []  # [local start, length, global start], adjacent merged
        for i, chunk in enumerate(self.chunks[rank]):
            if runs and runs[-1][2] + runs[-1][1] == chunk * c:
                runs[-1][1] += c
            else:
                runs.append([i * c, c, chunk * c])
        return tuple(tuple(r) for r in runs)
