"""Packed documents from their boundaries alone: ``document_mask``, the FlexAttention
``BlockMask`` built at tile granularity (no ``S x S`` mask is evaluated), ``document_layout``,
the varlen layout that places whole documents by their work (Note [Balanced documents] in
``layouts/documents.py``), ``documents_as_sharded``, the varlen layout of shards made by a
dense layout (head-tail over a packed row), and ``placed_rows``, the same for ``B`` rows
sharded alike (what ``attend_rows`` in ``api/varlen.py`` runs).

Note [Document tiles]
~~~~~~~~~~~~~~~~~~~~~
Documents are contiguous runs of a row, so a document that touches two different tiles of the
row covers every token between them: at most one document is shared by a query tile Qi and a
key tile Kj with i != j (the one holding the boundary between them), e.g. tiles of 4 tokens:

    tokens     0 1 2 3 | 4 5 6 7 | 8 9 . .
    documents  a a a b | b b b b | b c . .      Q2 x K0 share b: q 8, kv 3 .. 3
                                                Q2 x K1 share b: q 8, kv 4 .. 7

For that document the query run ``[qa, qb]`` and key run ``[ka, kb]`` give every difference
``q - kv`` in ``[qa - kb, qb - ka]``; the tile pair is *visible* when that interval meets the
window ``[-right, left]`` (-1: unbounded; causal is ``right = 0``) and *full* when both tiles
lie inside the document and the whole interval is within the window. A diagonal tile (i = j)
always sees its own tokens (q = kv), and is full when it holds one document and its width fits
the window. A last tile cut short by the row's end is never full (as ``create_block_mask``
marks it). Every rank builds the same mask from the same boundaries; flex's kernels and
``flex_layout`` read it like any other ``BlockMask``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ..layouts import Layout, get_layout, token_indices
from ..layouts.document_placement import balance_documents, documents_on_tokens
from ..layouts.documents import DocumentLayout, pairs_by_offset
from ..layouts.varlen import check_divisible, global_bounds
from ..resolve import check_bool, check_window_size, normalize_window
from ..schedule.policy import ring_steps_ms


def document_layout(
    cu_seqlens: Tensor | Sequence[int],
    world_size: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    tolerance: float = 1.05,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> DocumentLayout:
    """The balanced varlen layout of packed documents on ``world_size`` ranks (Note [Balanced
    documents]): documents kept whole on one rank where that balances the work, the heaviest
    cut (zigzag over every rank, or contiguous pieces on consecutive ranks); every rank holds
    ``T / world_size`` tokens.

    Args:
        cu_seqlens: the *global* document boundaries ``[N + 1]`` (int32 tensor or ints; any
            lengths, ``T`` divisible by ``world_size``).
        causal, window_size: the mask within documents the work is counted for (any mask runs
            exactly on the layout; this one is balanced).
        tolerance: stop cutting documents once max/mean work is at most this.
        heads, kv_heads, head_dim: of the attention the layout serves (all three, or none):
            choose the placement of least predicted time of the slowest rank instead
            (``dtensor_ring.get_machine``'s constants: a ring step costs at least its host
            time, so a few cut documents that make every step run can cost more than the
            imbalance they remove; ``tolerance`` is then unused).

    Returns:
        A :class:`~dtensor_ring.layouts.documents.DocumentLayout`: pass it as ``layout=`` to
        :func:`dtensor_ring.ring_varlen_attention_func` (algorithm "ring"), shard with
        ``shard_varlen(x, cu_seqlens, layout, rank, world_size)`` (which also returns the
        rank's local ``cu_seqlens``). ``.work`` (visible pairs per rank), ``.imbalance``
        (max/mean) and ``.split`` (the documents cut; none: no K/V travel) report the balance.

    Raises:
        ValueError: bad ``cu_seqlens`` (see the varlen functions), ``T`` not divisible by
            ``world_size``, a malformed window, ``tolerance < 1``.
    """
    bounds = global_bounds(cu_seqlens)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_divisible(bounds, "llama3", world_size)  # only T % W
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (tolerance >= 1)
    ):
        raise ValueError(f"tolerance must be a number >= 1 (max/mean work), got {tolerance!r}")
    causal, window = normalize_window(
        check_window_size(window_size), check_bool("causal", causal), bounds[-1]
    )
    shape = (heads, kv_heads, head_dim)
    if shape != (None, None, None) and not all(
        isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape
    ):
        raise ValueError(
            f"heads, kv_heads and head_dim are given together, as positive ints; got {shape}"
        )

    def predicted_ms(pieces) -> float:
        per_rank = pairs_by_offset(pieces, causal, window)
        offsets = sorted({0}.union(*per_rank))  # the plan's steps: every rank runs each
        return max(
            ring_steps_ms(
                [pairs.get(o, 0) for o in offsets],
                bounds[-1] // world_size,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
            )
            for pairs in per_rank
        )

    cost = None if heads is None else predicted_ms
    return balance_documents(bounds, world_size, causal, window, float(tolerance), cost)


def documents_as_sharded(
    cu_seqlens: Tensor | Sequence[int],
    layout: str | Layout,
    world_size: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> DocumentLayout:
    """The varlen layout of packed documents as shards of the whole packed sequence hold them:
    ``layout`` (a dense layout: "zigzag" is head-tail over the row, PyTorch's and torchtitan's
    default balancer; "ring" contiguous chunks; a ``TokenLayout``) placed the ``T`` tokens on
    ``world_size`` ranks, and the result runs those shards exactly through
    :func:`dtensor_ring.ring_varlen_attention_func` (algorithm "ring"), each document's
    pieces planned by document (Note [Placed documents plan]).

    Args:
        cu_seqlens: the *global* document boundaries ``[N + 1]`` (int32 tensor or ints).
        layout: how the packed sequence was sharded; each rank's tokens in increasing order.
        world_size: the ranks it was sharded on.
        causal, window_size: the mask ``.work`` / ``.imbalance`` are counted for (any mask
            runs exactly).

    Returns:
        A :class:`~dtensor_ring.layouts.documents.DocumentLayout` whose rank r holds exactly
        ``token_indices(layout, T, r, world_size)``: ``shard_varlen`` with it gives the same
        tokens, and ``varlen_local_cu_seqlens`` the rank's local boundaries.

    Raises:
        ValueError: bad ``cu_seqlens``, a layout that cannot split ``T`` tokens on
            ``world_size`` ranks, a rank whose tokens are not in increasing order (reorder
            them so, or shard with :func:`document_layout`), a malformed window.
    """
    bounds = global_bounds(cu_seqlens)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    T = bounds[-1]
    lay = get_layout(layout, "dense")
    lay.check_length(T, world_size)
    indices_Wn = torch.stack([token_indices(lay, T, r, world_size) for r in range(world_size)])
    unsorted = (indices_Wn.diff(dim=1) <= 0).any(dim=1).nonzero().flatten().tolist()
    if unsorted:
        raise ValueError(
            f"documents_as_sharded: layout {lay.name!r} holds rank {unsorted[0]}'s tokens out "
            "of increasing order; a varlen layout keeps a document's pieces on a rank "
            "together: reorder each rank's tokens increasingly, or shard with document_layout"
        )
    causal, window = normalize_window(
        check_window_size(window_size), check_bool("causal", causal), T
    )
    return documents_on_tokens(bounds, indices_Wn, causal, window)


class PlacedRows:
    """``B`` rows of ``L`` tokens sharded by a dense layout, as one rank holds them as one
    packed stream of ``B * L`` tokens (the rows one after another): the stream's varlen
    ``layout``, this rank's local boundaries ``cu_local`` (int32) and the ``order`` that sorts
    its tokens increasingly (None: they are), with its inverse ``back``."""

    def __init__(self, layout: DocumentLayout, rank: int, order: Tensor | None):
        self.layout, self.order = layout, order
        self.back = None if order is None else order.argsort()
        self.cu_local = torch.tensor(layout.local_bounds[rank], dtype=torch.int32)

    def stream(self, x_BL: Tensor) -> Tensor:
        """This rank's rows ``[B, L_local, ...]`` as its part of the stream ``[B * L_local,
        ...]``, tokens in increasing order (what ``layout`` holds)."""
        x_T = x_BL.reshape(-1, *x_BL.shape[2:])
        return x_T if self.order is None else x_T[self.order]

    def rows(self, x_T: Tensor, batch: int) -> Tensor:
        """The inverse of :meth:`stream`: ``[B * L_local, ...]`` back to ``[batch, L_local,
        ...]`` in the rows' order."""
        x_T = x_T if self.back is None else x_T[self.back]
        return x_T.reshape(batch, -1, *x_T.shape[1:])


@functools.lru_cache(maxsize=32)
def placed_rows(
    bounds: tuple[int, ...],
    rows: int,
    row_len: int,
    layout: str | Layout,
    world_size: int,
    rank: int,
    causal: bool,
    window: tuple[int, int] | None,
) -> PlacedRows:
    """Documents ``bounds`` over ``rows`` rows of ``row_len`` tokens (every row boundary a
    document boundary), each row sharded by ``layout`` on ``world_size`` ranks, as ``rank``
    holds them (:class:`PlacedRows`; ``causal``/``window`` normalised, for the plan). Cached:
    a training step asks once a layer."""
    rows_WL = torch.stack(
        [token_indices(layout, row_len, r, world_size) for r in range(world_size)]
    )
    flat = (torch.arange(rows)[None, :, None] * row_len + rows_WL[:, None]).flatten(1)
    increasing, order = flat.sort(dim=1)
    placed = documents_on_tokens(bounds, increasing, causal, window)
    return PlacedRows(placed, rank, None if torch.equal(increasing, flat) else order[rank])


def document_mask(
    cu_seqlens: Tensor,
    seq_len: int,
    window_size: tuple[int, int] = (-1, 0),
    *,
    block_size: int = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """The global ``BlockMask`` (``[B, 1, seq_len, seq_len]``) of packed documents: query p
    sees the keys of its own document within ``window_size = (left, right)`` (-1: unbounded;
    the default is causal), as flash-attn's varlen functions compute.

    Args:
        cu_seqlens: int ``[docs + 1]`` boundaries of the documents over the ``B`` rows packed
            one after another (``B * seq_len`` tokens; every row starts a document), as
            ``cu_seqlens`` of the varlen functions or torchtitan's ``VarlenMetadata``.
            Empty documents are allowed.
        seq_len: the length of one row (the mask's ``Q_LEN = KV_LEN``).
        window_size: ``(left, right)``.
        block_size: the tile (flex's ``BLOCK_SIZE``).
        device: of the mask's tensors (default: ``cu_seqlens``').

    Returns:
        A ``BlockMask`` whose ``mask_mod`` is exact and whose tiles skip what no document
        sees (Note [Document tiles]); pass it to :func:`dtensor_ring.flex_attention`,
        :func:`dtensor_ring.flex_layout` or PyTorch's ``flex_attention``.

    Raises:
        TypeError: ``cu_seqlens`` is not an integer tensor.
        ValueError: the boundaries fall, do not cover whole rows, or a document crosses a row;
            ``seq_len`` / ``block_size`` not positive ints; a malformed ``window_size``.
    """
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype.is_floating_point:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens!r}")
    for name, n in (("seq_len", seq_len), ("block_size", block_size)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        raise ValueError(f"window_size must be two ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got {window_size}")
    device = cu_seqlens.device if device is None else torch.device(device)
    bounds = [int(x) for x in cu_seqlens.cpu()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] % seq_len or bounds[-1] == 0:
        raise ValueError(
            f"cu_seqlens must run from 0 to B * seq_len (B rows of {seq_len} tokens), got {bounds}"
        )
    if any(lo > hi for lo, hi in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seqlens must not fall, got {bounds}")
    B = bounds[-1] // seq_len
    missing = sorted(set(range(0, B * seq_len, seq_len)) - set(bounds))
    if missing:
        raise ValueError(
            f"a document crosses into row {missing[0] // seq_len} (no boundary at packed token "
            f"{missing[0]}): every row must start a document"
        )
    starts = torch.tensor(bounds[:-1])  # of the documents, in the packed stream
    lengths = torch.tensor(bounds[1:]) - starts
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).view(B, seq_len)
    start = starts[doc] - torch.arange(B)[:, None] * seq_len  # [B, L]
    end = start + lengths[doc]  # the token's document: [start, end) within its row
    partial, full = _document_tiles(doc, start, end, seq_len, block_size, left, right)
    doc_BL = doc.to(device)

    def document(b, h, q_idx, kv_idx):
        visible = doc_BL[b, q_idx] == doc_BL[b, kv_idx]
        if left >= 0:
            visible = visible & (q_idx - kv_idx <= left)
        if right >= 0:
            visible = visible & (kv_idx - q_idx <= right)
        return visible

    def blocks(tiles: Tensor) -> tuple[Tensor, Tensor]:  # [B, nq, nk] -> counts, indices
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True)
        count = tiles.sum(-1, dtype=torch.int32)
        return count[:, None].to(device), order[:, None].to(torch.int32).to(device)

    return BlockMask.from_kv_blocks(
        *blocks(partial & ~full), *blocks(full), block_size, document, (seq_len, seq_len)
    )


def _document_tiles(
    doc: Tensor, start: Tensor, end: Tensor, L: int, T: int, left: int, right: int
) -> tuple[Tensor, Tensor]:
    """``(visible, full)`` bool ``[B, n, n]`` tiles of Note [Document tiles]; ``doc``,
    ``start``, ``end`` ``[B, L]``: each token's document and its run ``[start, end)``."""
    n = -(-L // T)
    first = torch.arange(n) * T  # each tile's first and last token
    last = torch.clamp(first + T, max=L) - 1
    inf = 2 * L  # an unbounded window side
    lo = -(right if right >= 0 else inf)  # q - kv must lie in [lo, hi]
    hi = left if left >= 0 else inf
    i, j = first[:, None], first[None, :]  # query tile rows, key tile columns
    i_last, j_last = last[:, None], last[None, :]
    # the shared document: the one holding the later tile's first token and the earlier's last
    later_first = torch.where(i >= j, i, j).expand(n, n)
    earlier_last = torch.where(i >= j, j_last, i_last).expand(n, n)
    shared = doc[:, later_first] == doc[:, earlier_last]  # [B, n, n]
    d_start, d_end = start[:, later_first], end[:, later_first]
    qa, qb = torch.maximum(i, d_start), torch.minimum(i_last, d_end - 1)
    ka, kb = torch.maximum(j, d_start), torch.minimum(j_last, d_end - 1)
    visible = shared & (qa - kb <= hi) & (qb - ka >= lo)
    inside = (d_start <= torch.minimum(i, j)) & (torch.maximum(i_last, j_last) < d_end)
    full = shared & inside & (i_last - j <= hi) & (i - j_last >= lo)
    diagonal = torch.eye(n, dtype=torch.bool)
    one_doc = start[:, first] == start[:, last]  # the diagonal tile holds one document
    width = last - first
    full_diagonal = one_doc & (width <= hi) & (-width >= lo)
    visible = visible | diagonal
    full = torch.where(diagonal, torch.diag_embed(full_diagonal), full)
    complete = width == T - 1  # a last tile cut short by L is never full (as flex marks it)
    return visible, full & complete[:, None] & complete[None, :]
