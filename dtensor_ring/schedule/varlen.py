"""Schedules of ring-style attention over packed documents (data only).

Without a window, a layout with a part table (ring, zigzag) runs its *dense* plan on every
document at once (Note [Varlen layouts] in ``layouts/varlen.py``): the plan does not depend on
the documents. Otherwise the plan is built per set of local documents:

Note [Windowed varlen]
~~~~~~~~~~~~~~~~~~~~~~
A window cuts each document's pieces at offsets that depend on the document's length, so
the dense plan's parts (``lo``, ``hi``, applied to every document alike) no longer fit.
Every rank holds the same local lengths (each document is cut into W or 2W equal pieces),
so every rank can build the whole plan: for each (rank, src) pair and each document, the
trimmed blocks of its runs (Note [Windowed schedules] in ``schedule/plan.py``); blocks of the same
run pair with the same mask (causal, or the same flash window) across documents become one
varlen kernel call, its parts :class:`DocSpans` (one span per document):

    doc A (long):   0:4/4:8 w(2,-1)  \\
    doc B (long):   9:13/13:17 w(2,-1) -> one block  0:4,9:13 / 4:8,13:17 w(2,-1)
    doc C (short):  20:22/20:22 c    -> its own block (another mask)

Without a window the same construction serves layouts that have no part table (their plans
are built from runs: Note [Windowed schedules] in ``schedule/plan.py``).

Note [Placed documents plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A :class:`~dtensor_ring.layouts.documents.DocumentLayout` (Note [Balanced documents]) places
each document on its own terms, so the plan is built from the layout, for every rank at
once: for (rank, src) and each document both hold, the blocks of its query runs against the
visiting key runs (step 0 without a window: one block over the rank's whole local document,
causal or full, exact because a rank's tokens are in global order). A document on one rank
only appears at step 0; when no document is cut, the plan is step 0 alone and no K/V travel.
Blocks of different documents with the same mask share a kernel call (:class:`DocSpans`);
two blocks of one document never do (their query rows may be the same). Full blocks of one
document whose query (key) spans are adjacent and whose key (query) spans are equal are joined
first, so zigzag's ``all/lo`` stays one block a document:

    cut document, rank 2 (runs a2, a5), K/V of rank 1 (runs a1, a6), causal:
        a2/a1 full, a5/a1 full  -> joined: a2 a5 / a1 full      a5/a6: nothing
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from ..layouts import Layout, get_layout
from ..layouts.documents import DocumentLayout
from ..parts import Block, DocSpans, Span
from .plan import Plan, has_part_table, make_plan, plan_from_blocks, run_pair_blocks, window_bounds


def varlen_plan(
    bounds_local: tuple[int, ...],
    layout: str | Layout,
    world_size: int,
    causal: bool,
    window: tuple[int, int] | None,
) -> Plan:
    """The plan of ring-style varlen attention on local documents ``bounds_local`` (the local
    ``cu_seqlens`` as ints, the same on every rank); ``window`` normalised over positions
    within each document (:func:`dtensor_ring.resolve.normalize_window`), or None.

    Parts are :class:`~dtensor_ring.parts.Part` (applied to every document) or
    :class:`DocSpans`. Cached. Raises ``ValueError`` as :func:`make_plan`.
    """
    lay = get_layout(layout, "documents")
    if isinstance(lay, DocumentLayout):
        return _placed_plan(lay, causal, window)
    if window is None and has_part_table(lay):
        return make_plan(lay, world_size, causal)
    lay.check_mask(causal)
    return _document_plan(tuple(bounds_local), lay, world_size, causal, window)


@functools.lru_cache(maxsize=64)
def _document_plan(
    bounds_local: tuple[int, ...],
    layout: Layout,
    world_size: int,
    causal: bool,
    window: tuple[int, int] | None,
) -> Plan:
    docs = list(zip(bounds_local[:-1], bounds_local[1:], strict=True))
    bounds = window_bounds(causal, window)
    stride = layout.stride(world_size)

    @functools.cache
    def doc_blocks(n: int, rank: int, src: int) -> list[tuple[tuple[int, int], Block]]:
        """The blocks of a document of ``n`` local tokens, spans from its first token."""
        q_runs, kv_runs = (layout.runs(n, r, world_size) for r in (rank, src))
        return run_pair_blocks(q_runs, kv_runs, stride, bounds, rank == src)

    def blocks_of(rank: int, src: int) -> tuple[Block, ...]:
        return merge_doc_blocks(
            (ab, blk, start)
            for start, stop in docs
            if stop > start
            for ab, blk in doc_blocks(stop - start, rank, src)
        )

    return plan_from_blocks(
        layout.name, world_size, causal, blocks_of, window, bounds_local[-1] - bounds_local[0]
    )


def merge_doc_blocks(per_doc: Iterable[tuple[object, Block, int]]) -> tuple[Block, ...]:
    """Merge per-document blocks ``(tag, block with Span parts, row offset)`` that share a tag
    and a mask into one block with :class:`DocSpans` parts (spans shifted by the offsets), in
    document order; ``init`` blocks first."""
    groups: dict[tuple, tuple[list, list]] = {}
    for tag, blk, off in per_doc:
        qs, kvs = groups.setdefault((not blk.init, tag, blk.causal, blk.window), ([], []))
        qs.append((blk.q.start + off, blk.q.stop + off))
        kvs.append((blk.kv.start + off, blk.kv.stop + off))
    # init blocks first, then by tag; the sort is stable, so masks keep document order
    return tuple(
        Block(DocSpans(tuple(qs)), DocSpans(tuple(kvs)), causal, window, init=not merges)
        for (merges, _, causal, window), (qs, kvs) in sorted(groups.items(), key=lambda i: i[0][:2])
    )


@functools.lru_cache(maxsize=64)
def _placed_plan(layout: DocumentLayout, causal: bool, window: tuple[int, int] | None) -> Plan:
    bounds = window_bounds(causal, window)
    docs = layout.documents

    def blocks_of(rank: int, src: int) -> tuple[Block, ...]:
        per_doc = []
        for d, mine in docs[rank].items():
            theirs = docs[src].get(d)
            if theirs is None:
                continue
            if rank == src and window is None:
                span = Span(mine.start, mine.stop)
                per_doc.append((d, Block(span, span, causal, init=True)))
                continue
            pairs = run_pair_blocks(mine.runs, theirs.runs, 1, bounds, rank == src)
            per_doc.extend((d, blk) for blk in _join_full([b for _, b in pairs]))
        return _calls(per_doc)

    return plan_from_blocks(layout.name, layout.world_size, causal, blocks_of, window)


def _join_full(blocks: list[Block]) -> list[Block]:
    """Join full blocks of one document whose query spans are adjacent and key spans equal
    (or the other way round) until none can be joined."""
    while True:
        found = next(
            (
                (i, j, joined)
                for i, a in enumerate(blocks)
                for j, b in enumerate(blocks)
                if i != j and (joined := _joined(a, b)) is not None
            ),
            None,
        )
        if found is None:
            return blocks
        i, j, joined = found
        blocks = [c for k, c in enumerate(blocks) if k not in (i, j)] + [joined]


def _joined(a: Block, b: Block) -> Block | None:
    """The full block of ``a`` followed by ``b`` (query or key spans adjacent, the others
    equal), or None."""
    if a.causal or b.causal or a.window or b.window or a.init != b.init:
        return None
    if a.kv == b.kv and a.q.stop == b.q.start:
        return Block(Span(a.q.start, b.q.stop), a.kv, False, init=a.init)
    if a.q == b.q and a.kv.stop == b.kv.start:
        return Block(a.q, Span(a.kv.start, b.kv.stop), False, init=a.init)
    return None


def _calls(per_doc: list[tuple[int, Block]]) -> tuple[Block, ...]:
    """Blocks ``(document, block with Span parts)`` grouped into kernel calls: the same mask
    and ``init``, at most one block of a document a call; ``init`` calls first."""
    calls: list[tuple[tuple, set[int], list, list]] = []
    for d, blk in sorted(per_doc, key=lambda db: (not db[1].init, db[0], db[1].q.start)):
        key = (blk.init, blk.causal, blk.window)
        call = next((c for c in calls if c[0] == key and d not in c[1]), None)
        if call is None:
            call = (key, set(), [], [])
            calls.append(call)
        call[1].add(d)
        call[2].append((blk.q.start, blk.q.stop))
        call[3].append((blk.kv.start, blk.kv.stop))
    return tuple(
        Block(DocSpans(tuple(qs)), DocSpans(tuple(kvs)), causal, window, init=init)
        for (init, causal, window), _, qs, kvs in calls
    )
