"""The placement of packed documents on the ranks: balanced by work, whole where they fit.

Note [Balanced documents]
~~~~~~~~~~~~~~~~~~~~~~~~~
The per-document layouts (Note [Varlen layouts]) cut *every* document into W or 2W pieces:
balanced for any documents, but a packed batch of many short documents then runs as many
tiny blocks, at every ring step. A rank's work is the visible pairs of the query rows it
holds, and a document kept whole on one rank needs nothing from any other rank. So the
balanced layout keeps documents whole where that balances, and cuts only the heaviest:

    documents (tokens):  A 12   B 4   C 4   D 2   E 2     W = 2, 12 tokens a rank
    causal work (pairs): A 78   B 10  C 10  D 3   E 3

    A is cut zigzag-wise (pieces a0..a3, 3 tokens each; rank r holds a_r and a_{3-r}):
        rank 0: a0 a3 | B | D          work 6 + 33 + 10 + 3 = 52
        rank 1: a1 a2 | C | E          work 15 + 24 + 10 + 3 = 52
    B, C, D, E stay whole: no rank needs another's keys for them.

The search weighs two families of placements, documents sorted by work, heaviest first,
every rank holding exactly T/W tokens:

* zigzag cuts: for t = 0, 1, ... the t heaviest are cut into 2W pieces over every rank (rank
  r holds pieces r and 2W-1-r, as zigzag), the others are placed whole. The heaviest cut
  document (the "filler") takes the room the whole documents leave on each rank, so whole
  documents are placed by the work they add beyond the filler work they displace, and each
  rank's early/late split of the filler brings its work to the mean. Balanced, but K/V
  travel at every step once t > 0.
* contiguous cuts: a document of more work than a limit (a fraction of the mean) is cut at
  equal-work points into the fewest pieces under it, piece i on rank g + i (each rank needs
  K/V only from the few ranks before it); the others whole; each on the ranks whose load,
  with their remaining room filled at the density of what is left, stays lowest; what finds
  no room is poured into the room left, in rank order. Few ring offsets, balance approximate.

Each candidate is then evened out: while a move lowers the most loaded rank's work (by 0.1%
of the mean at least) and keeps its partner below it, the best move of two kinds.
Exchanges of whole documents of equal tokens: one or two for up to three of another rank's.
Of equal tokens one long document holds more pairs than several short ones, so long goes for
short:

    rank 0: 2048 2048          pairs 2 x 2098176 = 4196352
    rank 1: 1024 1024 1024 1024      4 x  524800 = 2099200
    exchange 2048 <-> 1024 1024:     3147776 | 3147776

Shifts of cut points (contiguous family): two ranks that share two cut documents move both
cut points by the same number of tokens, one each way, so each keeps its tokens; the rank
that takes the sparse tokens of one document and gives the dense ones of the other gets
lighter. The lengths of whole documents set the grain of the exchanges. Shifts go first to
cut points on the kernels' 64-token tiles (``TILE``: flash-attn 4's query tiles; blocks whose
queries start and end on them let the kernel sum a rank's dq, Note [A varlen dq accumulated
inside flash-attn 4], and no piece of a few tokens becomes a kernel call of its own), as do
the contiguous family's equal-work cuts; only while max/mean work stays above the tolerance,
to any token:

    rank a: A[0, 40)        B[60, 100)        a takes A[40, 40 + t), gives B[60, 60 + t)
    rank b: A[40, 100)  ... B[0, 60)          (B's tokens near 60 see more keys than A's
                                               near 40: a's work falls, b's rises)

Tokens a rank and the ranks each cut document is on stay as they were, and so, for causal or
full attention, do the ring offsets (with a window, shifted pieces may see more or fewer
ranks' keys: the offsets are counted again). ``test_evening_exchanges_and_shifts``;
``test_cut_points_on_tiles`` (64k tokens of 32 documents: every piece on the tiles, max/mean
1.027 where token-grain shifts reached 1.022 with pieces of 1 and 37 tokens elsewhere).

The pick: of the placements whose max/mean work is within the tolerance, the one whose K/V
travel the fewest ring offsets, then with the fewest documents on several ranks (none: the
most balanced). Given the attention's shape, the placement of least predicted time instead
(``schedule/policy.py``'s model: a step costs at least its host time, so for ranks with
little work, fewer steps beat balance).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .documents import (
    DocumentLayout,
    Piece,
    _held,
    _imbalance,
    _split,
    _visible_pairs,
    token_work,
)

# The grain cut points are placed on first: the kernels' query tiles (flash-attn 4's 64-row
# tiles; a varlen block's queries of a document that start and end on them let its kernel sum
# a rank's dq itself, Note [A varlen dq accumulated inside flash-attn 4])
TILE = 64


def _ring_offsets(held: dict[int, list[tuple[int, int, int]]], W: int, work_of: _Work) -> int:
    """How many ring offsets some rank needs K/V from (the plan's steps beyond the first), for
    the pieces ``held`` by document (:func:`_held`) on ``W`` ranks: :func:`pairs_by_offset`'s
    non-zero offsets, told apart without counting own pairs."""
    offsets: set[int] = set()
    for parts in held.values():
        for r, qa, qb in parts:
            for src, ka, kb in parts:
                if src != r and (r - src) % W not in offsets:
                    if _visible_pairs(qa, qb, ka, kb, work_of.causal, work_of.window):
                        offsets.add((r - src) % W)
    return len(offsets)


def balance_documents(
    bounds: Sequence[int],
    world_size: int,
    causal: bool,
    window: tuple[int, int] | None,
    tolerance: float,
    cost: Callable[[Sequence[Sequence[Piece]]], float] | None = None,
) -> DocumentLayout:
    """The layout of Note [Balanced documents] for documents ``bounds`` (global, ints) on
    ``world_size`` ranks, balanced for ``causal`` / ``window`` (normalised) within the
    documents: of the candidates whose max/mean work is within ``tolerance``, the one whose
    K/V travel the fewest ring offsets, then with the fewest documents on several ranks (none
    within: the most balanced); given ``cost`` (a placement's predicted time, from its pieces
    per rank), the cheapest of the most balanced candidate of each number of offsets."""
    best: dict[int, Candidate] = {}  # number of offsets -> its most balanced candidate
    within: Candidate | None = None
    for c in _candidates(bounds, world_size, causal, window, tolerance):
        if c.offsets not in best or c.imbalance < best[c.offsets].imbalance:
            best[c.offsets] = c
        if c.imbalance <= tolerance and (within is None or c.rank < within.rank):
            within = c
        if c.zigzag and c.imbalance <= tolerance:
            break  # more zigzag cuts only add cut documents
    if cost is not None:
        return min(best.values(), key=lambda c: cost(c.pieces)).layout(bounds)
    if within is None:
        return min(best.values(), key=lambda c: c.imbalance).layout(bounds)
    return within.layout(bounds)


@dataclass(frozen=True)
class Candidate:
    """A placement the search weighs: ``pieces`` per rank, their ``work``, and what the pick
    compares (the layout itself is built for the chosen one only)."""

    pieces: list
    work: list[int]
    offsets: int  # ring offsets whose K/V some rank needs (its mask's visible pairs, counted)
    split: int  # documents on more than one rank
    zigzag: bool  # of the zigzag family

    @property
    def imbalance(self) -> float:
        return _imbalance(self.work)

    @property
    def rank(self) -> tuple:
        return (self.offsets, self.split, self.imbalance)

    def layout(self, bounds: Sequence[int]) -> DocumentLayout:
        return DocumentLayout(bounds, self.pieces, self.work)


class _Work:
    """Visible pairs of the query positions ``[a, b)`` of document d under the mask
    ``causal`` / ``window``: ``prefix[d]`` (int64, the work before each position) and its
    total as an int (whole documents, the common case, without a tensor read); one search's
    (``sets``: what :func:`_whole_sets` found)."""

    def __init__(self, lengths: Sequence[int], causal: bool, window: tuple[int, int] | None):
        self.lengths, self.causal, self.window = lengths, causal, window
        self.prefix = [
            torch.cat([torch.zeros(1, dtype=torch.int64), token_work(L, causal, window).cumsum(0)])
            for L in lengths
        ]
        self.totals = [int(p[-1]) for p in self.prefix]
        self.sets: dict[tuple, dict] = {}  # _whole_sets of this search's rows

    def __call__(self, d: int, a: int, b: int) -> int:
        if a == 0 and b == self.lengths[d]:
            return self.totals[d]
        return int(self.prefix[d][b] - self.prefix[d][a])


def _candidate(pieces, work_of: _Work, zigzag: bool) -> Candidate:
    held, work = _held(pieces), [sum(work_of(*p) for p in row) for row in pieces]
    offsets = _ring_offsets(held, len(pieces), work_of)
    return Candidate(pieces, work, offsets, len(_split(held)), zigzag)


def documents_on_tokens(
    bounds: Sequence[int],
    indices_Wn: torch.Tensor,
    causal: bool,
    window: tuple[int, int] | None,
) -> DocumentLayout:
    """The placed layout of documents ``bounds`` (global, ints) whose tokens rank r holds
    ``indices_Wn[r]`` (int ``[W, T / W]``, each row increasing: a rank's pieces are its runs
    of consecutive tokens within one document), its work counted for ``causal`` / ``window``
    (normalised). Another layout's token placement, run by the placed plan (e.g. head-tail
    shards of packed rows)."""
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    pieces = []
    for idx in indices_Wn.to(torch.int64):
        doc = torch.searchsorted(starts, idx, right=True) - 1  # empty documents hold nothing
        new = torch.ones_like(idx, dtype=torch.bool)
        new[1:] = (idx[1:] != idx[:-1] + 1) | (doc[1:] != doc[:-1])
        first = new.nonzero().flatten().tolist()
        last = [*(i - 1 for i in first[1:]), len(idx) - 1]
        pieces.append(
            [
                (d, a - bounds[d], b + 1 - bounds[d])
                for d, a, b in zip(
                    doc[first].tolist(), idx[first].tolist(), idx[last].tolist(), strict=True
                )
            ]
        )
    return _candidate(pieces, _Work(lengths, causal, window), zigzag=False).layout(bounds)


def _candidates(
    bounds: Sequence[int],
    W: int,
    causal: bool,
    window: tuple[int, int] | None,
    tolerance: float = 1.0,
) -> Iterator[Candidate]:
    """The contiguous placements (a few limits), then the zigzag ones with t = 0, 1, ... of
    the heaviest documents cut, where they exist; evened (cut points off the tiles only while
    max/mean work is above ``tolerance``)."""
    n = bounds[-1] // W
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    work = _Work(lengths, causal, window)
    order = sorted(range(len(lengths)), key=lambda d: (-work.totals[d], d))
    total = sum(work.totals)
    for limit in (math.inf, *(total / W * f for f in (1.5, 1.0, 0.75, 0.5, 0.35, 0.25))):
        pieces = _place_runs(order, W, n, work, limit)
        yield _candidate(_evened(pieces, work, shifts=True, target=tolerance), work, zigzag=False)
    for t in _cut_counts(len(order)):
        pieces = _place_zigzag(order[:t], order[t:], W, n, work)
        if pieces is not None:
            yield _candidate(_evened(pieces, work, shifts=False), work, zigzag=True)


def _evened(
    pieces: list[list[Piece]], work_of: _Work, shifts: bool, target: float = 1.0
) -> list[list[Piece]]:
    """``pieces`` evened out (Note [Balanced documents]): while a move lowers the most loaded
    rank's work and keeps its partner's below it, the move that lowers it most, of exchanges of
    whole documents of equal tokens (one or two for up to three) and, with ``shifts``, shifts
    of two cut points that rank shares with another: first to cut points on the kernels'
    tiles (``TILE``), then, while max/mean work is above ``target``, to any token. Tokens a
    rank and the ranks each cut document is on stay (the ring offsets too, but with a
    window)."""
    rows = [list(row) for row in pieces]
    load = [sum(work_of(*p) for p in row) for row in rows]
    if not shifts:
        return _moves(rows, load, work_of, (_exchange,))
    rows = _moves(rows, load, work_of, (_exchange, functools.partial(_shift, grain=TILE)))
    if _imbalance(load) > target:
        rows = _moves(rows, load, work_of, (_exchange, functools.partial(_shift, grain=1)))
    return rows


def _moves(rows, load, work_of: _Work, kinds) -> list[list[Piece]]:
    """:func:`_evened`'s loop with the moves ``kinds``, on ``rows`` and their ``load`` (both
    updated in place)."""
    W = len(rows)
    enough = sum(load) / W * 1e-3  # a move must lower the top by this much (0.1% of the mean)
    for _ in range(4 * W * W):  # each move lowers the top of the loads; a bound to be sure
        a = max(range(W), key=lambda r: (load[r], -r))
        moves = [
            move
            for b in range(W)
            if b != a
            for move in (kind(rows, a, b, load, work_of) for kind in kinds)
            if move is not None and move[0] < load[a] - enough
        ]
        if not moves:
            break
        _, b, give, take, give_back, take_back, moved = min(moves, key=lambda m: m[0])
        rows[a] = [p for p in rows[a] if p not in give] + list(take)
        rows[b] = [p for p in rows[b] if p not in give_back] + list(take_back)
        load[a], load[b] = load[a] - moved, load[b] + moved
    return rows


def _exchange(rows, a: int, b: int, load, work_of: _Work):
    """The best exchange of whole documents of equal tokens between ranks ``a`` and ``b``:
    ``(top, b, a's out, a's in, b's out, b's in, work moved from a to b)`` or None. Of equal
    tokens one long document has more work than several short ones (causal or full): the
    heavier rank trades long documents for short ones."""
    best = None
    takes = _whole_sets(rows[b], work_of, 3)
    for tokens, give_sets in _whole_sets(rows[a], work_of, 2).items():
        for give_work, give in give_sets.items():
            for take_work, take in takes.get(tokens, {}).items():
                moved = give_work - take_work
                top = max(load[a] - moved, load[b] + moved)
                if best is None or top < best[0]:
                    best = (top, b, give, take, take, give, moved)
    return best


def _shift(rows, a: int, b: int, load, work_of: _Work, grain: int = 1):
    """The best shift of two cut points between ranks ``a`` and ``b``: rank ``a`` takes
    ``delta`` tokens of one document from ``b`` and gives ``b`` as many of another, so both
    keep their tokens (as :func:`_exchange`'s tuple, or None); both new cut points multiples
    of ``grain`` (positions within their documents):

        a: ... d1[s1, x1) | e2[x2, f2) ...        a: ... d1[s1, x1 + delta) | e2[x2 + delta, f2)
        b: d1[x1, f1) ... | ... e2[s2, x2)   ->   b: d1[x1 + delta, f1) ... | e2[s2, x2 + delta)

    (either document may be cut the other way round: ``a`` holding its later piece)."""
    theirs: dict[int, list[Piece]] = {}  # b's pieces by document (a rank holds thousands)
    for pb in rows[b]:
        theirs.setdefault(pb[0], []).append(pb)
    cuts = [
        (pa, pb, pa[2] == pb[1])
        for pa in rows[a]
        for pb in theirs.get(pa[0], ())
        if pa[2] == pb[1] or pb[2] == pa[1]
    ]
    best = None
    for (pa1, pb1, first1), (pa2, pb2, first2) in itertools.permutations(cuts, 2):
        if pa1 == pa2 or pb1 == pb2:
            continue  # one piece between two cut points: not this move
        room = min(_room(pa1, pb1, grow=True), _room(pa2, pb2, grow=False))
        if room < 1:
            continue
        delta = torch.arange(1, room + 1)
        if grain > 1:  # the new cut points: pa1 grown by delta, pa2 shrunk by it
            cut1 = pa1[2] + delta if first1 else pa1[1] - delta
            cut2 = pa2[2] - delta if first2 else pa2[1] + delta
            delta = delta[(cut1 % grain == 0) & (cut2 % grain == 0)]
            if delta.numel() == 0:
                continue
        gain = _moved_work(pa1, pb1, first1, delta, work_of, grow=True)
        loss = _moved_work(pa2, pb2, first2, delta, work_of, grow=False)
        moved = loss - gain
        top = torch.maximum(load[a] - moved, load[b] + moved)
        i = int(top.argmin())
        if best is None or int(top[i]) < best[0]:
            t = int(delta[i])
            new1, new2 = _cut_at(pa1, pb1, first1, t), _cut_at(pa2, pb2, first2, -t)
            best = (int(top[i]), b, (pa1, pa2), (new1[0], new2[0]), (pb1, pb2),
                    (new1[1], new2[1]), int(moved[i]))  # fmt: skip
    return best


def _room(pa: Piece, pb: Piece, grow: bool) -> int:
    """How many tokens ``a``'s piece ``pa`` can take from (``grow``) or give to ``pb``, both
    kept non-empty."""
    giver = pb if grow else pa
    return giver[2] - giver[1] - 1


def _moved_work(pa: Piece, pb: Piece, a_first: bool, delta, work_of: _Work, grow: bool):
    """Work of the ``delta`` tokens ``pa`` takes from (``grow``) or gives to ``pb`` at their
    cut point (int64 like ``delta``)."""
    prefix = work_of.prefix[pa[0]]
    cut = pa[2] if a_first else pa[1]
    after_cut = a_first == grow  # where the moved tokens lie
    return prefix[cut + delta] - prefix[cut] if after_cut else prefix[cut] - prefix[cut - delta]


def _cut_at(pa: Piece, pb: Piece, a_first: bool, delta: int) -> tuple[Piece, Piece]:
    """``pa``, ``pb`` with ``pa`` ``delta`` tokens longer (negative: shorter)."""
    d = pa[0]
    if a_first:
        return (d, pa[1], pa[2] + delta), (d, pb[1] + delta, pb[2])
    return (d, pa[1] - delta, pa[2]), (d, pb[1], pb[2] - delta)


def _whole_sets(row, work_of: _Work, most: int) -> dict[int, dict[int, tuple]]:
    """:func:`_whole_sets_uncached` of ``row``, remembered per row for this search (kept by
    ``work_of``: the search asks for the same rows again and again; the result is only
    read)."""
    key = (tuple(row), most)
    if key not in work_of.sets:
        work_of.sets[key] = _whole_sets_uncached(row, work_of, most)
    return work_of.sets[key]


def _whole_sets_uncached(row, work_of: _Work, most: int) -> dict[int, dict[int, tuple]]:
    """The whole documents of a rank's pieces ``row`` in sets of one to ``most``, one set per
    distinct (tokens, work): ``{tokens: {work: pieces}}`` (at most 24 distinct lengths are
    combined, the shortest: what a heavy rank takes)."""
    whole: dict[int, list[Piece]] = {}
    for p in row:
        if p[1] == 0 and p[2] == work_of.lengths[p[0]]:
            whole.setdefault(p[2], []).append(p)
    pool = [p for length in sorted(whole)[:24] for p in whole[length][:most]]
    out: dict[int, dict[int, tuple]] = {}
    for size in range(1, most + 1):
        for combo in itertools.combinations(pool, size):
            tokens = sum(p[2] for p in combo)
            work = sum(work_of.totals[p[0]] for p in combo)
            out.setdefault(tokens, {}).setdefault(work, combo)
    return out


def _place_runs(order, W: int, n: int, work_of: _Work, limit: float) -> list[list[Piece]]:
    """Pieces per rank, placing few K/V far: documents (``order``: heaviest first) of more
    work than ``limit`` cut at equal-work points into the fewest contiguous pieces under it,
    piece i on rank g + i (mod W: the ring's next rank) for the start g that keeps the most
    loaded rank lightest; the others whole on the rank with room that is then least loaded
    (a rank's room counted filled at the density of what is left); what finds no room
    poured, in order, into the room left on ranks 0, 1, ... (a document poured across a rank
    boundary is cut there)."""
    pieces: list[list[Piece]] = [[] for _ in range(W)]
    tokens, load, poured = [0] * W, [0] * W, []
    lengths, totals, prefix = work_of.lengths, work_of.totals, work_of.prefix
    left_work, left_tokens = sum(totals), sum(lengths)
    for d in order:
        # a rank's room ends up filled at about the density of what is left: compare ranks by
        # the load they would have then
        density = left_work / max(left_tokens, 1)
        work, length = totals[d], lengths[d]
        left_work, left_tokens = left_work - work, left_tokens - length
        m = min(W, max(1, math.ceil(work / limit))) if limit < math.inf else 1
        if m == 1:  # whole: the rank with room whose load would then be lowest
            room = [r for r in range(W) if tokens[r] + length <= n]
            if not room:
                poured.append(d)
                continue
            r = min(room, key=lambda r: load[r] - density * tokens[r])
            pieces[r].append((d, 0, length))
            tokens[r] += length
            load[r] += work
            continue
        targets = torch.arange(1, m, dtype=torch.int64) * work // m
        cuts = _on_tiles([0, *torch.searchsorted(prefix[d], targets).tolist(), length])
        parts = [
            (a, b, int(prefix[d][b] - prefix[d][a]))
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        best = None
        for g in range(W):
            ranks = [(g + i) % W for i in range(m)]
            if all(tokens[r] + b - a <= n for r, (a, b, _) in zip(ranks, parts, strict=True)):
                worst = max(
                    load[r] + w + density * (n - tokens[r] - b + a)
                    for r, (a, b, w) in zip(ranks, parts, strict=True)
                )
                if best is None or worst < best[0]:
                    best = (worst, ranks)
        if best is None:
            poured.append(d)
            continue
        for r, (a, b, w) in zip(best[1], parts, strict=True):
            pieces[r].append((d, a, b))
            tokens[r] += b - a
            load[r] += w
    r = 0
    for d in poured:
        a = 0
        while a < lengths[d]:
            while tokens[r] == n:
                r += 1
            b = min(lengths[d], a + n - tokens[r])
            pieces[r].append((d, a, b))
            tokens[r] += b - a
            a = b
    return pieces


def _on_tiles(cuts: list[int]) -> list[int]:
    """A document's cut points (from 0 to its length) each moved to the nearest multiple of
    ``TILE`` where the pieces stay non-empty and in order, else kept."""
    out = [cuts[0]]
    for i, c in enumerate(cuts[1:-1], 1):
        r = round(c / TILE) * TILE
        out.append(r if out[-1] < r < cuts[i + 1] else c)
    return [*out, cuts[-1]]


def _cut_counts(n_docs: int):
    """Numbers of cut documents to try: every count up to 16, then ~25% steps, then all."""
    t = 0
    while t < n_docs:
        yield t
        t = t + 1 if t < 16 else int(t * 1.25)
    yield n_docs


def _place_zigzag(cut, whole, W: int, n: int, work_of: _Work) -> list[list[Piece]] | None:
    """Pieces per rank: ``cut`` documents zigzag over every rank (the first, the filler,
    takes what room is left), ``whole`` ones placed by the work they add beyond the filler
    work they displace (below); None when a whole document finds no room."""
    lengths = work_of.lengths
    pieces: list[list[Piece]] = [[] for _ in range(W)]
    tokens = [0] * W
    for d in cut[1:]:
        for r, (a, b) in _zigzag(lengths[d], W, tokens):
            pieces[r].append((d, a, b))
            tokens[r] += b - a
    # The filler's tokens on a rank are what the whole documents leave free there, so a whole
    # document placed on a rank replaces filler work: it changes the rank's work by its own
    # minus the filler's at the filler's mean density. Balance those differences (largest
    # first, each to the rank with the smallest sum so far); without a filler, the work.
    density = work_of(cut[0], 0, lengths[cut[0]]) / lengths[cut[0]] if cut else 0.0
    change = {d: work_of(d, 0, lengths[d]) - density * lengths[d] for d in whole}
    total = [0.0] * W
    for d in sorted(whole, key=lambda d: (-abs(change[d]), d)):
        room = [r for r in range(W) if tokens[r] + lengths[d] <= n]
        if not room:
            return None
        pick = min if change[d] >= 0 else max
        r = pick(room, key=lambda r: (total[r], -r if pick is max else r))
        pieces[r].append((d, 0, lengths[d]))
        tokens[r] += lengths[d]
        total[r] += change[d]
    if cut:
        d = cut[0]
        want = [n - t for t in tokens]
        if min(want) < 0:
            return None
        for r, (early, late) in enumerate(_filler(work_of.prefix[d], want, pieces, work_of)):
            pieces[r] += [(d, *early), (d, *late)]
    return pieces


def _filler(prefix, want, pieces, work_of) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Rank r's early and late piece ``(start, stop)`` of the filler (work ``prefix``), rank r
    taking ``want[r]`` tokens: pieces in zigzag order (early pieces of ranks 0, 1, ..., then
    late pieces of ranks W-1, ..., 0), each rank's split between its two chosen so that its
    work (with what ``pieces`` already hold) comes closest to the mean."""
    W, length = len(want), len(prefix) - 1
    held = [sum(work_of(*p) for p in row) for row in pieces]
    target = (sum(held) + int(prefix[-1])) / W
    out, start, stop = [], 0, length
    for r in range(W):
        x = torch.arange(want[r] + 1)  # tokens of the early piece
        work = prefix[start + x] - prefix[start] + prefix[stop] - prefix[stop - want[r] + x]
        miss = (work.double() + held[r] - target).abs() + (x - want[r] / 2).abs() * 1e-9
        e = int(miss.argmin())
        out.append(((start, start + e), (stop - want[r] + e, stop)))
        start, stop = start + e, stop - want[r] + e
    return out


def _zigzag(length: int, W: int, tokens: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """``(rank, (start, stop))`` of a document cut into 2W pieces, rank r holding pieces r and
    2W-1-r; the ``length % 2W`` extra tokens go to the ranks holding the fewest ``tokens``."""
    base, extra = divmod(length, 2 * W)
    fewest = sorted(range(W), key=lambda r: (tokens[r], r))
    plus = [0] * W
    for i in range(extra):
        plus[fewest[i % W]] += 1
    sizes = [0] * (2 * W)
    for r in range(W):
        sizes[r] = base + (plus[r] + 1) // 2
        sizes[2 * W - 1 - r] = base + plus[r] // 2
    out, start = [], 0
    for i, size in enumerate(sizes):
        out.append((i if i < W else 2 * W - 1 - i, (start, start + size)))
        start += size
    return out
