"""Ring schedules as data, and their cost model.

Note [Ring schedules]
~~~~~~~~~~~~~~~~~~~~~
At step s of W, rank r holds the keys/values of rank ``src = (r - s) mod W`` (they travel one
hop to the right per step). A schedule says, for every (rank, step), which part of the local
queries meets which part of the visiting keys/values, and whether the block is causal
(a square, top-left-aligned mask) or full. ``-`` marks a step with nothing to compute.

Parts of a local sequence of n tokens: ``all`` = [0, n), ``lo`` = [0, n/2), ``hi`` = [n/2, n),
``tail`` = [1, n), ``head`` = [0, n-1).

ring, causal (W = 4): queries of rank r see keys of ranks <= r.

    rank | step 0     step 1     step 2     step 3
       0 | all/all c  -          -          -
       1 | all/all c  all/all    -          -
       2 | all/all c  all/all    all/all    -
       3 | all/all c  all/all    all/all    all/all       <- 4x the work of rank 0

zigzag, causal: a rank holds chunks (r, 2W-1-r). Against an earlier rank's keys only the
visitor's early chunk (``lo``) is visible to all local queries; against a later rank's keys only
the local late chunk (``hi``) sees anything, but it sees all of them. Every non-diagonal step is
half a block on every rank:

    rank | step 0     step 1     step 2     step 3
       0 | all/all c  hi/all     hi/all     hi/all
       1 | all/all c  all/lo     hi/all     hi/all
       2 | all/all c  all/lo     all/lo     hi/all
       3 | all/all c  all/lo     all/lo     all/lo

stripe, causal: local token i is global i*W + r. Keys of a rank src <= r are visible iff
j <= i (causal diagonal); keys of src > r iff j < i, i.e. queries [1, n) against keys [0, n-1)
with a causal diagonal (``tail/head c``).

Non-causal attention (ring only) is ``all/all`` at every step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .validation import check_layout_causal


class Part(enum.Enum):
    """A contiguous part of a rank's local sequence of n tokens."""

    ALL = "all"  # [0, n)
    LO = "lo"  # [0, n/2)
    HI = "hi"  # [n/2, n)
    TAIL = "tail"  # [1, n)
    HEAD = "head"  # [0, n-1)

    def bounds(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of this part in a local sequence of ``n`` tokens."""
        return {
            Part.ALL: (0, n),
            Part.LO: (0, n // 2),
            Part.HI: (n // 2, n),
            Part.TAIL: (1, n),
            Part.HEAD: (0, n - 1),
        }[self]

    def size(self, n: int) -> int:
        """Number of tokens of this part in a local sequence of ``n`` tokens."""
        start, stop = self.bounds(n)
        return stop - start


@dataclass(frozen=True)
class Block:
    """Local queries ``q`` attend to visiting keys/values ``kv``; ``causal``: square causal mask."""

    q: Part
    kv: Part
    causal: bool

    def __str__(self) -> str:
        return f"{self.q.value}/{self.kv.value}{' c' if self.causal else ''}"

    def score_pairs(self, n: int) -> int:
        """Number of (query, key) pairs computed, for local sequences of ``n`` tokens."""
        s_q, s_k = self.q.size(n), self.kv.size(n)
        return s_q * (s_q + 1) // 2 if self.causal else s_q * s_k


@dataclass(frozen=True)
class Step:
    """One ring step of one rank: keys/values of rank ``src`` visit; ``block`` may be None."""

    src: int
    block: Block | None


@dataclass(frozen=True)
class Plan:
    """The schedule of a layout on ``world_size`` ranks: ``steps[rank][step]``."""

    layout: str
    world_size: int
    causal: bool
    steps: tuple[tuple[Step, ...], ...]

    def table(self) -> str:
        """The schedule as an ASCII table (one row per rank), as in Note [Ring schedules]."""
        head = "rank | " + "  ".join(f"step {s:<7}" for s in range(self.world_size))
        rows = [
            f"{r:>4} | " + "  ".join(f"{str(st.block) if st.block else '-':<12}" for st in row)
            for r, row in enumerate(self.steps)
        ]
        return "\n".join(line.rstrip() for line in [head, *rows])

    def score_pairs(self, seq_local: int) -> list[list[int]]:
        """Per rank and step, the (query, key) pairs computed for ``seq_local`` tokens a rank."""
        return [
            [st.block.score_pairs(seq_local) if st.block else 0 for st in row]
            for row in self.steps
        ]

    def flops(
        self, seq_local: int, batch: int = 1, heads: int = 1, head_dim: int = 128
    ) -> list[float]:
        """Forward attention FLOPs per rank (``4 * pairs * B * H * D``); backward is ~2.5x.

        This is the load-balance model: the slowest rank sets the pace of the ring.
        """
        return [4.0 * batch * heads * head_dim * sum(row) for row in self.score_pairs(seq_local)]

    def imbalance(self, seq_local: int) -> float:
        """max / mean of the per-rank FLOPs (1.0 = perfectly balanced)."""
        per_rank = self.flops(seq_local)
        return max(per_rank) / (sum(per_rank) / len(per_rank))


def _block(layout: str, causal: bool, rank: int, src: int) -> Block | None:
    A, LO, HI, TAIL, HEAD = Part.ALL, Part.LO, Part.HI, Part.TAIL, Part.HEAD
    if not causal:
        return Block(A, A, False)
    if src == rank:
        return Block(A, A, True)
    if layout == "ring":
        return Block(A, A, False) if src < rank else None
    if layout == "zigzag":
        return Block(A, LO, False) if src < rank else Block(HI, A, False)
    return Block(A, A, True) if src < rank else Block(TAIL, HEAD, True)  # stripe


def make_plan(layout: str, world_size: int, causal: bool) -> Plan:
    """Build the schedule of ``layout`` on ``world_size`` ranks (see Note [Ring schedules]).

    Raises ``ValueError`` for an unknown layout, a non-causal zigzag/stripe, or world_size < 1.
    """
    check_layout_causal(layout, causal)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    steps = tuple(
        tuple(
            Step(src, _block(layout, causal, r, src))
            for src in ((r - s) % world_size for s in range(world_size))
        )
        for r in range(world_size)
    )
    return Plan(layout, world_size, causal, steps)
