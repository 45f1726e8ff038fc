"""The vocabulary of schedules: parts of a rank's local tokens, and blocks between them.

Plans (:mod:`dtensor_ring.schedule.plan`), layouts (:mod:`dtensor_ring.layouts`) and the
engine speak it; it depends on nothing else, so every layer below the front doors can use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

GlobalRuns = tuple[tuple[int, int, int], ...]  # (global start, length, stride), local order
UNBOUNDED = 1 << 62  # a band edge that never bites (exact integer arithmetic throughout)


class Part(enum.Enum):
    """A contiguous part of a rank's local sequence of n tokens."""

    ALL = "all"  # [0, n)
    LO = "lo"  # [0, n/2)
    HI = "hi"  # [n/2, n)
    TAIL = "tail"  # [1, n)
    HEAD = "head"  # [0, n-1)

    def bounds(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of this part in a local sequence of ``n`` tokens."""
        # identity tests, not a dict of members: the engine asks several times per block, and
        # hashing enum members is Python code (~1 us a lookup)
        if self is Part.ALL:
            return 0, n
        if self is Part.LO:
            return 0, n // 2
        if self is Part.HI:
            return n // 2, n
        if self is Part.TAIL:
            return 1, n
        return 0, n - 1  # HEAD

    def size(self, n: int) -> int:
        """Number of tokens of this part in a local sequence of ``n`` tokens."""
        start, stop = self.bounds(n)
        return stop - start


@dataclass(frozen=True)
class Span:
    """Local tokens ``[start, stop)``: a part of a windowed plan (built for one local length)."""

    start: int
    stop: int

    @property
    def value(self) -> str:
        return f"{self.start}:{self.stop}"

    def bounds(self, n: int) -> tuple[int, int]:
        """``(start, stop)``; ``n`` is ignored (a Span is absolute)."""
        return self.start, self.stop

    def size(self, n: int) -> int:
        """Number of tokens of the span."""
        return self.stop - self.start


def band_pairs(s_q: int, s_k: int, lo: int, hi: int) -> int:
    """Number of (i, j) in ``[0, s_q) x [0, s_k)`` with ``lo <= j - i <= hi``."""

    def at_most(c: int) -> int:  # pairs with j - i <= c: row i has clamp(i + c + 1, 0, s_k)
        i0 = min(max(0, -c), s_q)  # first row with a visible key
        i1 = min(max(s_k - c - 1, i0), s_q)  # first row that sees all s_k keys
        return (i1 - i0) * (i0 + i1 - 1 + 2 * (c + 1)) // 2 + (s_q - i1) * s_k

    return max(0, at_most(hi) - at_most(lo - 1))


@dataclass(frozen=True)
class Block:
    """Local queries ``q`` attend to visiting keys/values ``kv``.

    ``causal``: square top-left causal mask. ``window``: flash-attn ``(left, right)`` window,
    bottom-right aligned (key j visible to query i iff ``-left <= j - i - (S_k - S_q) <= right``,
    -1 unbounded); never together with ``causal``. ``init``: the block's result initialises the
    accumulator rows of ``q`` instead of merging into them (the diagonal blocks of step 0).
    ``origin``: a FlexAttention block (Note [FlexAttention on the ring] in ``ops/flex.py``):
    the global positions of its queries and of its keys, each as runs ``(global start, length,
    stride)`` in local order (:data:`GlobalRuns`); the user's mask and score functions decide
    what it computes (``causal`` and ``window`` are then unset).
    """

    q: Part | Span
    kv: Part | Span
    causal: bool
    window: tuple[int, int] | None = None
    init: bool = False
    origin: tuple[GlobalRuns, GlobalRuns] | None = None

    def __str__(self) -> str:
        mask = (
            " c"
            if self.causal
            else f" w({self.window[0]},{self.window[1]})"
            if self.window
            else " m"
            if self.origin
            else ""
        )
        return f"{self.q.value}/{self.kv.value}{mask}"

    def band(self, n: int) -> tuple[int, int]:
        """The mask as ``lo <= j - i <= hi`` in block coordinates (local length ``n``)."""
        s_q, s_k = self.q.size(n), self.kv.size(n)
        if self.causal:
            return -UNBOUNDED, 0
        if self.window is None:
            return -UNBOUNDED, UNBOUNDED
        left, right = self.window
        return (
            -UNBOUNDED if left < 0 else s_k - s_q - left,
            UNBOUNDED if right < 0 else s_k - s_q + right,
        )

    def score_pairs(self, n: int) -> int:
        """Number of (query, key) pairs computed, for local sequences of ``n`` tokens."""
        return band_pairs(self.q.size(n), self.kv.size(n), *self.band(n))


@dataclass(frozen=True)
class DocSpans:
    """A part of a varlen block: rows ``[start, stop)`` of the packed local tensor, one span per
    document the block holds (Note [Windowed varlen] in ``schedule/varlen.py``)."""

    spans: tuple[tuple[int, int], ...]

    @property
    def value(self) -> str:
        return ",".join(f"{a}:{b}" for a, b in self.spans)


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows of spans: ``cat([arange(s, s + n) for s, n in zip(starts, lengths)])``,
    vectorised (int64)."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(
        total
    )
