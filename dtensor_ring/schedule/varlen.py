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
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from ..layouts import Layout, get_layout
from ..parts import Block, DocSpans
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
