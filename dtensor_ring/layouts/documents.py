"""Packed documents placed by their work, as a layout: :class:`DocumentLayout`, the pieces a
rank holds and the visible pairs between them. The placement itself is searched in
``document_placement.py`` (Note [Balanced documents]).

A rank's tokens are in increasing global order, so a document's pieces on a rank are adjacent
locally: its local ``cu_seqlens`` has one entry per document it holds, and a causal (or full)
call over those local documents is exact at step 0, as zigzag's ``all/all c``. The plan of the
other steps pairs, document by document, the query runs of a rank with the key runs of the
visiting rank (Note [Windowed schedules]); ``schedule/varlen.py`` builds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..parts import UNBOUNDED, band_pairs
from .base import Run
from .builtin import TokenLayout

Piece = tuple[int, int, int]  # (document, start, stop): positions within the document


@dataclass(frozen=True)
class DocumentRuns:
    """One rank's tokens of one document: its local rows ``[start, stop)`` and the runs
    ``(local start, length, global start)`` of consecutive global tokens among them."""

    start: int
    stop: int
    runs: tuple[Run, ...]


class DocumentLayout(TokenLayout):
    """Packed documents ``bounds`` on ``world_size`` ranks, each rank holding the pieces
    ``pieces[r]`` (Note [Balanced documents]); made by :func:`dtensor_ring.document_layout`.

    A varlen layout of its own documents only: pass it as ``layout=`` to the ring varlen
    functions with the local ``cu_seqlens`` it gives (:attr:`local_bounds`,
    :func:`dtensor_ring.shard_varlen`). As a :class:`TokenLayout` it also places the tokens of
    dense calls (e.g. :func:`dtensor_ring.flex_attention` with these documents'
    :func:`dtensor_ring.document_mask`). ``work`` is the visible pairs per rank under the mask
    it was balanced for, ``imbalance`` their max/mean, ``split`` the documents on more than
    one rank.
    """

    varlen = "placed"

    def __init__(
        self,
        bounds: Sequence[int],
        pieces: Sequence[Sequence[Piece]],
        work: Sequence[int],
    ):
        self.bounds = tuple(int(b) for b in bounds)
        self.pieces = tuple(_joined(row) for row in pieces)
        indices = torch.stack(
            [
                torch.cat([torch.arange(self.bounds[d] + a, self.bounds[d] + b) for d, a, b in row])
                for row in self.pieces
            ]
        )
        super().__init__(indices, prefix="documents")
        digest = hashlib.blake2b(repr(self.bounds).encode(), digest_size=4).hexdigest()
        self.name = f"{self.name}_{digest}"
        self.work = tuple(work)
        self.imbalance = _imbalance(self.work)
        self.documents = tuple(_document_runs(self.bounds, row) for row in self.pieces)
        self.local_bounds = tuple(
            (0, *(doc.stop for doc in row.values())) for row in self.documents
        )
        self.split = _split(_held(self.pieces))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocumentLayout) and (self.bounds, self.pieces) == (
            other.bounds,
            other.pieces,
        )

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return (
            f"<layout {self.name!r}: {len(self.bounds) - 1} documents on {self.world_size} "
            f"ranks, {len(self.split)} cut, imbalance {self.imbalance:.3f}>"
        )


def _joined(row: Sequence[Piece]) -> tuple[Piece, ...]:
    """A rank's pieces in global order, empty ones dropped, adjacent ones of a document joined
    (so that equal tokens give equal pieces)."""
    out: list[Piece] = []
    for d, a, b in sorted(p for p in row if p[2] > p[1]):
        if out and out[-1][0] == d and out[-1][2] == a:
            out[-1] = (d, out[-1][1], b)
        else:
            out.append((d, a, b))
    return tuple(out)


def _held(pieces: Sequence[Sequence[Piece]]) -> dict[int, list[tuple[int, int, int]]]:
    """Per document, its non-empty pieces ``(rank, start, stop)``, in rank order."""
    held: dict[int, list[tuple[int, int, int]]] = {}
    for r, row in enumerate(pieces):
        for d, a, b in row:
            if b > a:
                held.setdefault(d, []).append((r, a, b))
    return held


def _imbalance(work: Sequence[int]) -> float:
    """max / mean of the per-rank work (1.0: balanced)."""
    return max(work) / max(sum(work) / len(work), 1)


def _document_runs(bounds: tuple[int, ...], row: Sequence[Piece]) -> dict[int, DocumentRuns]:
    """Per document a rank holds, its local rows and runs: one run a piece (joined pieces
    are never consecutive globally)."""
    out: dict[int, list[Run]] = {}
    local = 0
    for d, a, b in row:
        out.setdefault(d, []).append((local, b - a, bounds[d] + a))
        local += b - a
    return {
        d: DocumentRuns(runs[0][0], runs[-1][0] + runs[-1][1], tuple(runs))
        for d, runs in out.items()
    }


def pairs_by_offset(
    pieces: Sequence[Sequence[Piece]], causal: bool, window: tuple[int, int] | None
) -> list[dict[int, int]]:
    """Per rank, the visible (query, key) pairs it computes with the K/V of the rank each ring
    offset ``(r - src) % W`` away (0: its own), for the placement ``pieces`` (a layout's, or a
    candidate's), counted piece by piece: what its plan's steps compute (Note [Placed
    documents plan]), without building the plan."""
    W = len(pieces)
    out: list[dict[int, int]] = [{} for _ in range(W)]
    for parts in _held(pieces).values():
        for r, qa, qb in parts:
            for src, ka, kb in parts:
                pairs = _visible_pairs(qa, qb, ka, kb, causal, window)
                if pairs:
                    offset = (r - src) % W
                    out[r][offset] = out[r].get(offset, 0) + pairs
    return out


def _visible_pairs(
    qa: int, qb: int, ka: int, kb: int, causal: bool, window: tuple[int, int] | None
) -> int:
    """Visible pairs of a document's queries ``[qa, qb)`` and keys ``[ka, kb)``."""
    left, right = (-1, -1) if window is None else window
    d = qa - ka  # key j - query p = jj - i - d in piece coordinates
    lo = -UNBOUNDED if left < 0 else d - left
    hi = d if causal else UNBOUNDED if right < 0 else d + right
    return band_pairs(qb - qa, kb - ka, lo, hi)


def token_work(length: int, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """Visible keys of each query position of a document of ``length`` tokens (int64
    ``[length]``) under ``causal`` and a normalised ``window`` (flash-attn's, within it)."""
    p = torch.arange(length)
    left, right = (-1, -1) if window is None else window
    lo = torch.zeros_like(p) if left < 0 else (p - left).clamp(min=0)
    if causal:
        hi = p
    else:
        hi = torch.full_like(p, length - 1) if right < 0 else (p + right).clamp(max=length - 1)
    return hi - lo + 1


def _split(held: dict[int, list[tuple[int, int, int]]]) -> tuple[int, ...]:
    """The documents of ``held`` (:func:`_held`) on more than one rank."""
    return tuple(sorted(d for d, parts in held.items() if len({r for r, _, _ in parts}) > 1))
