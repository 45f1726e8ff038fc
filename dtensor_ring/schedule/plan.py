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

Note [Windowed schedules]
~~~~~~~~~~~~~~~~~~~~~~~~~
A sliding window ``(left, right)`` (flash-attn semantics over *global* positions: query p sees
keys ``[p - left, p + right]``, -1 = unbounded, ``causal`` forces ``right = 0``) keeps a band of
every (rank, src) block. A rank's tokens are one or two runs of global positions (ring: one
contiguous run; zigzag: two; stripe: one with stride W), and between a query run and a key run
the band is again a band of local indices: ``A <= j - i <= B``. Each pair of runs gives one
block, trimmed to the rows and columns that see anything, so no row of a block is fully masked
and every band maps onto flash's bottom-right ``window_size`` arguments:

    keys j ->            trimmed block (rows i0..i1, cols j0..j1)
    q  . x x . . .          x x .  .        left  = (S_k - S_q) - A'
    i  . . x x . .   -->    . x x  .        right = B' - (S_k - S_q)   (both in [0, S_k))
       . . . x x .          . . x  x
                            (A', B': the band in trimmed coordinates)

A (rank, src) pair whose band keeps every pair the unwindowed block computes uses that block
unchanged; a pair whose band keeps nothing computes nothing. Steps where no rank computes are
dropped from the plan (``Plan.offsets``): the K/V of such a step never travel, so compute and
communication grow with the window, not the sequence. E.g. ring, causal, W = 4, 8 tokens a
rank, ``window_size = (5, 0)``:

    rank | step 0           step 1
       0 | 0:8/0:8 w(5,0)   -
       1 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)     queries 0-4 see keys 3-7 of rank r-1
       2 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)     (query i' sees keys j' >= i' of the block)
       3 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)

Zigzag under a small window needs offsets {0, 1, W-1} (a rank's late chunk borders the late
chunk of rank r+1): a plan whose offsets are not all of 0..W-1 exchanges K/V *directly* with
the rank ``offset`` hops away instead of passing them along the ring (Note [Direct exchange]
in ``comm/p2p.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..layouts import Layout, get_layout
from ..parts import UNBOUNDED, Block, Span


@dataclass(frozen=True)
class Step:
    """One ring step of one rank: keys/values of rank ``src`` visit; ``blocks`` may be empty."""

    src: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Plan:
    """The schedule of a layout on ``world_size`` ranks: ``steps[rank][i]``.

    At step i every rank r holds the K/V of rank ``(r - offsets[i]) % world_size``;
    ``offsets`` is ``0..W-1`` unless a window lets steps be dropped (Note [Windowed schedules]).
    ``window`` is set for windowed plans; ``seq_local`` for plans built for one local length
    (windowed, or of a layout without a part table: their blocks depend on it).
    """

    layout: str
    world_size: int
    causal: bool
    steps: tuple[tuple[Step, ...], ...]
    offsets: tuple[int, ...]
    window: tuple[int, int] | None = None
    seq_local: int | None = None

    @property
    def full_ring(self) -> bool:
        """Whether every step runs, so K/V can travel one hop at a time around the ring."""
        return self.offsets == tuple(range(self.world_size))

    def table(self) -> str:
        """The schedule as an ASCII table (one row per rank), as in Note [Ring schedules]."""
        cells = [["+".join(map(str, st.blocks)) or "-" for st in row] for row in self.steps]
        width = max(12, *(len(c) for row in cells for c in row))
        head = "rank | " + "  ".join(f"{f'step {s}':<{width}}" for s in self.offsets)
        rows = [
            f"{r:>4} | " + "  ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(cells)
        ]
        return "\n".join(line.rstrip() for line in [head, *rows])

    def score_pairs(self, seq_local: int) -> list[list[int]]:
        """Per rank and step, the (query, key) pairs computed for ``seq_local`` tokens a rank."""
        return [
            [sum(b.score_pairs(seq_local) for b in st.blocks) for st in row] for row in self.steps
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

    def kv_transfers(self) -> int:
        """K/V chunks each rank receives in a forward (the backward moves as many K/V chunks
        and as many dK/dV chunks): ``len(offsets) - 1``."""
        return len(self.offsets) - 1


def window_bounds(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """The global mask ``lo <= key - query <= hi`` of ``causal`` and a window (or None)."""
    left, right = (-1, -1) if window is None else window
    lo = -UNBOUNDED if left < 0 else -left
    hi = 0 if causal else UNBOUNDED if right < 0 else right
    return lo, hi


def run_block(q_run, kv_run, stride: int, lo: int, hi: int, init: bool) -> Block | None:
    """The trimmed block of a query run against a key run under ``lo <= key - query <= hi``
    (global positions; ``-UNBOUNDED``/``UNBOUNDED`` for an open side), or None if empty.

    A run is ``(local start, length, global position of its first token)``; consecutive
    tokens of both runs are ``stride`` positions apart. The block's spans are local indices.
    """
    (q_start, s_q, q_pos), (k_start, s_k, k_pos) = q_run, kv_run
    d = k_pos - q_pos  # global key - query position at i = j = 0
    band_lo, band_hi = -((d - lo) // stride), (hi - d) // stride  # ceil / floor
    if band_lo > band_hi:  # no multiple of the stride in the window (stripe)
        return None
    i0, i1 = max(0, -band_hi), min(s_q, s_k - band_lo)  # rows that see a key
    if i0 >= i1:
        return None
    j0, j1 = max(0, band_lo + i0), min(s_k, i1 + band_hi)  # keys seen by those rows
    if j0 >= j1:
        return None
    s_q, s_k = i1 - i0, j1 - j0
    band_lo, band_hi = band_lo - (j0 - i0), band_hi - (j0 - i0)
    lower_open, upper_open = band_lo <= 1 - s_q, band_hi >= s_k - 1
    q, kv = Span(q_start + i0, q_start + i1), Span(k_start + j0, k_start + j1)
    if lower_open and upper_open:
        return Block(q, kv, False, init=init)
    if lower_open and band_hi == 0 and s_q == s_k:
        return Block(q, kv, True, init=init)
    window = (
        -1 if lower_open else s_k - s_q - band_lo,
        -1 if upper_open else band_hi - (s_k - s_q),
    )
    return Block(q, kv, False, window, init=init)


def run_pair_blocks(
    q_runs, kv_runs, stride: int, bounds: tuple[int, int], diagonal: bool
) -> list[tuple[tuple[int, int], Block]]:
    """``((a, b), block)`` for every pair of query run ``a`` and key run ``b`` that sees
    anything under the global mask ``bounds = (lo, hi)``; ``diagonal``: the runs are the same
    tokens (step 0). Diagonal pairs come first: at step 0 they cover every query row (a token
    sees itself), so they initialise the accumulators and the other blocks merge into them."""
    pairs = sorted(
        ((a, b) for a in range(len(q_runs)) for b in range(len(kv_runs))),
        key=lambda ab: ab[0] != ab[1] or not diagonal,
    )
    blocks = [
        ((a, b), run_block(q_runs[a], kv_runs[b], stride, *bounds, diagonal and a == b))
        for a, b in pairs
    ]
    return [(ab, blk) for ab, blk in blocks if blk is not None]


def _run_blocks(
    layout: Layout,
    world_size: int,
    causal: bool,
    window: tuple[int, int] | None,
    n: int,
    rank: int,
    src: int,
) -> tuple[Block, ...]:
    """The trimmed blocks of every pair of runs of ``rank`` and ``src`` (``n`` tokens a rank);
    the layout's part block instead when the mask keeps all of it."""
    plain = layout.part_block(causal, world_size, rank, src)
    q_runs, kv_runs = (layout.runs(n, r, world_size) for r in (rank, src))
    bounds = window_bounds(causal, window)
    pairs = run_pair_blocks(q_runs, kv_runs, layout.stride(world_size), bounds, src == rank)
    blocks = tuple(b for _, b in pairs)
    if plain is None or plain is NotImplemented:
        return blocks
    if sum(b.score_pairs(n) for b in blocks) == plain.score_pairs(n):
        return (plain,)  # the window keeps the whole block
    return blocks


def has_part_table(layout: Layout) -> bool:
    """Whether ``layout`` gives length-free :class:`Part` blocks (``Layout.part_block``)."""
    return layout.part_block(True, 1, 0, 0) is not NotImplemented


def make_plan(
    layout: str | Layout,
    world_size: int,
    causal: bool,
    window: tuple[int, int] | None = None,
    seq_local: int | None = None,
) -> Plan:
    """Build the schedule of ``layout`` on ``world_size`` ranks (see Note [Ring schedules]).

    Args:
        window: a normalised sliding window ``(left, right)``
            (:func:`dtensor_ring.resolve.normalize_window`), or None.
        seq_local: tokens per rank. Needed by windowed plans (they drop the steps no rank
            needs: Note [Windowed schedules]) and by layouts without a part table; ignored
            otherwise, so one plan serves every length.

    Plans are cached. Raises ``ValueError`` for an unknown layout, a mask the layout does not
    support, ``world_size < 1``, or a length-dependent plan without ``seq_local``.
    """
    lay = get_layout(layout, "dense")
    lay.check_mask(causal)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if window is None and has_part_table(lay):
        return _part_plan(lay, world_size, causal)
    if seq_local is None:
        raise ValueError(
            f"the plan of layout={lay.name!r} with window={window} depends on the local "
            "length: pass seq_local"
        )
    return _run_plan(lay, world_size, causal, window, seq_local)


@functools.lru_cache(maxsize=256)
def _part_plan(layout: Layout, world_size: int, causal: bool) -> Plan:
    return plan_from_blocks(
        layout.name,
        world_size,
        causal,
        lambda r, src: (layout.part_block(causal, world_size, r, src),),
    )


@functools.lru_cache(maxsize=256)
def _run_plan(
    layout: Layout, world_size: int, causal: bool, window: tuple[int, int] | None, n: int
) -> Plan:
    return plan_from_blocks(
        layout.name,
        world_size,
        causal,
        lambda r, src: _run_blocks(layout, world_size, causal, window, n, r, src),
        window,
        n,
    )


def plan_from_blocks(
    layout: str,
    world_size: int,
    causal: bool,
    blocks_of,
    window: tuple[int, int] | None = None,
    seq_local: int | None = None,
) -> Plan:
    """The plan whose rank ``r`` computes ``blocks_of(r, src)`` (None entries: nothing) with
    the K/V of rank ``src``; steps in which no rank computes are dropped. Equal parts are made
    one object: the engine takes a part's rows of the queries' side once a call, by identity
    (``engine/blocks.py``'s ``PartsOf``)."""
    parts: dict = {}

    def one(b: Block) -> Block:
        q, kv = parts.setdefault(b.q, b.q), parts.setdefault(b.kv, b.kv)
        return b if q is b.q and kv is b.kv else replace(b, q=q, kv=kv)

    table = [
        [
            tuple(one(b) for b in blocks_of(r, (r - s) % world_size) if b is not None)
            for s in range(world_size)
        ]
        for r in range(world_size)
    ]
    offsets = tuple(s for s in range(world_size) if s == 0 or any(row[s] for row in table))
    steps = tuple(
        tuple(Step((r - s) % world_size, row[s]) for s in offsets) for r, row in enumerate(table)
    )
    return Plan(layout, world_size, causal, steps, offsets, window, seq_local)
