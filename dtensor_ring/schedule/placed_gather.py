"""One rank's gather of the keys its queries see, for documents placed by a
:class:`~dtensor_ring.layouts.documents.DocumentLayout` (data only): Note [Gathering what
placed documents need] in ``engine/placed_gather.py`` is the algorithm.

Everything here follows from the layout, the mask and the rank, so every rank derives every
other rank's needs itself (what it must send) without communicating; cached on the values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layouts.documents import DocumentLayout
from ..parts import Block, Span, concat_ranges
from .varlen import merge_doc_blocks

Segment = tuple[int, int, int]  # (rank, first local row, stop): keys held there, in order


@dataclass(frozen=True)
class PlacedGather:
    """What one rank of a placed layout computes and moves (Note [Gathering what placed
    documents need]).

    ``local_blocks``: query spans whose keys are one run of the rank's own rows (``kv``: local
    rows); ``remote_blocks``: the others (``kv``: rows of the key buffer, ``keys`` rows, filled
    from local rows ``from_local = (buffer rows, local rows)`` and received rows
    ``from_received = (buffer rows, received rows)``, int64 on the device). Every local query
    row is in exactly one block. ``send_rows`` (int64, on the device): the local rows sent,
    destinations in rank order, ``send_splits`` of them to each rank; ``recv_splits`` rows
    arrive from each rank (in the sender's row order). ``exchanges``: some rank of the layout
    sends something (every rank then joins the all-to-all).
    """

    local_blocks: tuple[Block, ...]
    remote_blocks: tuple[Block, ...]
    keys: int
    from_local: tuple[Tensor, Tensor]
    from_received: tuple[Tensor, Tensor]
    send_rows: Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    exchanges: bool

    @property
    def received(self) -> int:
        """Rows that arrive from other ranks."""
        return sum(self.recv_splits)


def placed_gather(
    layout: DocumentLayout,
    causal: bool,
    window: tuple[int, int] | None,
    rank: int,
    device: torch.device,
) -> PlacedGather:
    """The :class:`PlacedGather` of ``rank`` for ``layout`` under ``causal`` / a normalised
    ``window`` within documents (``resolve.normalize_window``)."""
    return _placed_gather(layout, causal, window, rank, torch.device(device))


@functools.lru_cache(maxsize=64)
def _placed_gather(layout, causal, window, rank, device) -> PlacedGather:
    W = layout.world_size
    local, remote, segments = _needs(layout, causal, window, rank)
    src, first, stop = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3).unbind(1)
    lengths = stop - first
    at = torch.cumsum(lengths, 0) - lengths  # each segment's first row of the key buffer
    mine = src == rank
    needed = [_rows_from(segments, s) if s != rank else _NONE for s in range(W)]
    # a received row's place: its (source, row) among every source's sorted rows, in order
    received_keys = torch.cat([s * _ROWS + rows for s, rows in enumerate(needed)])
    theirs = ~mine
    asked = concat_ranges(first[theirs], lengths[theirs])
    asked += src[theirs].repeat_interleave(lengths[theirs]) * _ROWS
    sends = [_rows_from(_needs(layout, causal, window, t)[2], rank) for t in range(W)]
    sends[rank] = _NONE
    return PlacedGather(
        local_blocks=merge_doc_blocks(local),
        remote_blocks=merge_doc_blocks(remote),
        keys=int(lengths.sum()),
        from_local=(
            concat_ranges(at[mine], lengths[mine]).to(device),
            concat_ranges(first[mine], lengths[mine]).to(device),
        ),
        from_received=(
            concat_ranges(at[theirs], lengths[theirs]).to(device),
            torch.searchsorted(received_keys, asked).to(device),
        ),
        send_rows=torch.cat(sends).to(device),
        send_splits=tuple(len(rows) for rows in sends),
        recv_splits=tuple(len(rows) for rows in needed),
        exchanges=any(s != t for t in range(W) for s, _, _ in _needs(layout, causal, window, t)[2]),
    )


_NONE = torch.zeros(0, dtype=torch.int64)
_ROWS = 2**40  # above any rank's rows: (source, row) as one sortable int64


def _rows_from(segments: tuple[Segment, ...], src: int) -> torch.Tensor:
    """The distinct local rows of rank ``src`` among ``segments``, increasing (int64)."""
    spans = torch.tensor([(a, b - a) for s, a, b in segments if s == src], dtype=torch.int64)
    if spans.numel() == 0:
        return _NONE
    return torch.unique(concat_ranges(spans[:, 0], spans[:, 1]))


@functools.lru_cache(maxsize=256)
def _needs(layout: DocumentLayout, causal: bool, window, rank: int):
    """``(local, remote, segments)`` of ``rank``: per-document blocks for
    :func:`merge_doc_blocks` whose keys are a run of local rows (``kv``: those rows) or not
    (``kv``: rows of the key buffer), and the key buffer's rows as segments of the ranks
    holding them, in buffer order."""
    bounds, W = layout.bounds, layout.world_size
    held: dict[int, list[tuple[int, int, int, int]]] = {}  # d -> (rank, row, length, position)
    for s in range(W):
        for d, doc in layout.documents[s].items():
            for row, n, g in doc.runs:
                held.setdefault(d, []).append((s, row, n, g - bounds[d]))
    left, right = (-1, -1) if window is None else window
    local, remote, segments, at = [], [], [], 0
    for d, doc in layout.documents[rank].items():
        length = bounds[d + 1] - bounds[d]
        if not causal and window is None:  # every query of the document sees all of it
            queries = [(doc.start, doc.stop, 0, length, None)]
        else:
            queries = []
            for row, n, g in doc.runs:
                p = g - bounds[d]  # the run's first position in its document
                k0 = 0 if left < 0 else max(0, p - left)
                k1 = p + n if causal else length if right < 0 else min(length, p + n + right)
                e = k1 - (p + n)  # keys after the run's last query
                mask = (
                    -1 if left < 0 else left + e,
                    0 if causal else -1 if right < 0 else right - e,
                )
                queries.append((row, row + n, k0, k1, mask))
        for q0, q1, k0, k1, mask in queries:
            segs = tuple(
                (s, row + max(k0, p) - p, row + min(k1, p + n) - p)
                for s, row, n, p in sorted(held[d], key=lambda h: h[3])
                if max(k0, p) < min(k1, p + n)
            )
            one_run = all(s == rank for s, _, _ in segs) and all(
                x[2] == y[1] for x, y in zip(segs, segs[1:], strict=False)
            )
            if one_run:
                kv = Span(segs[0][1], segs[-1][2])
                local.append(((), Block(Span(q0, q1), kv, False, mask, init=True), 0))
            else:
                kv = Span(at, at + k1 - k0)
                remote.append(((), Block(Span(q0, q1), kv, False, mask, init=True), 0))
                segments.extend(segs)
                at += k1 - k0
    return tuple(local), tuple(remote), tuple(segments)
