"""FlexAttention schedules: ring plans whose blocks come from the mask.

Note [Flex schedules]
~~~~~~~~~~~~~~~~~~~~~
A FlexAttention mask is known block by block before any score is computed: the global
``BlockMask`` (or, for a bare ``mask_mod``, one built once per shape) says which tiles of the
S x S score matrix hold a visible pair. Every rank holds that same global mask, so every rank
derives the same plan from it, without communicating:

    global tiles (S = 16, W = 2,              rank 0's row of the plan (ring layout):
    4-token tiles, two documents [0, 6),      step 0: own K/V, 0:8/0:8 (init, never trimmed)
    [6, 16), causal within each):             step 1: K/V of rank 1 (keys 8..15): every
                                                       query tile before them is hidden
         k 0   4   8   12                             -> nothing, and if no rank needs a
    q  0 [ x   .   .   . ]                               step, its K/V never travel
       4 [ x   x   .   . ]                    rank 1 (queries 8..15), step 1 (keys 0..7):
       8 [ .   x   x   . ]  <- keys 4..7 hold      the visible tiles' bounding box is
      12 [ .   x   x   x ]     document 2's 6, 7  queries 8..15 x keys 4..7: 0:8/4:8 m

For every pair of a query run of rank r and a key run of rank src (a layout's runs: Note
[Sequence layouts]), the block is trimmed to the rows and columns of its tiles that hold a
visible pair (a bounding box, at tile granularity; the kernel applies the exact mask inside),
and dropped when no tile does. For a kernel that skips hidden tiles itself (PyTorch's), a step
is instead one block of the whole shards, its positions the layout's runs, or none: one large
kernel call a step, whatever the layout. The diagonal
pairs of step 0 stay whole: they initialise every query row's accumulators (a row that sees
nothing there gets ``lse = -inf`` and weight 0 in later merges). Steps in which no rank
computes are dropped from the plan (``Plan.offsets``), so their K/V are not sent, and the
direct exchange serves sparse plans as it serves windows (Note [Direct exchange]).
:func:`flex_balance` reports the work each rank is left with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..layouts import Layout
from ..layouts.builtin import TokenLayout
from ..parts import Block, GlobalRuns, Part, Span
from .plan import Plan, plan_from_blocks


@dataclass(frozen=True, eq=False)
class VisibleBlocks:
    """Which ``[q_block, kv_block]`` tiles of the global ``seq_len x seq_len`` score matrix
    hold a visible pair (for some batch row and head): ``tiles`` bool
    ``[ceil(S / q_block), ceil(S / kv_block)]`` on the host. ``key`` identifies the contents
    (a digest of the tiles), for plan caches and the ranks' comparison."""

    seq_len: int
    q_block: int
    kv_block: int
    tiles: Tensor
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        bits = self.tiles.to(torch.uint8).contiguous().numpy().tobytes()
        digest = hashlib.blake2b(bits, digest_size=16).hexdigest()
        object.__setattr__(
            self,
            "key",
            (self.seq_len, self.q_block, self.kv_block, tuple(self.tiles.shape), digest),
        )

    @classmethod
    def of_block_mask(cls, block_mask) -> VisibleBlocks:
        """The tiles of a ``torch.nn.attention.flex_attention.BlockMask`` (partial or full
        blocks, any batch row or head), for its ``seq_lengths`` (square)."""
        q_block, kv_block = block_mask.BLOCK_SIZE
        seq_len = block_mask.seq_lengths[0]
        dense = block_mask.to_dense().to("cpu") != 0  # [B, H, n_q, n_kv]
        n_q, n_kv = -(-seq_len // q_block), -(-seq_len // kv_block)
        tiles = dense.flatten(0, 1).any(0)[:n_q, :n_kv]
        return cls(seq_len, q_block, kv_block, tiles)

    def trim(self, q_run, kv_run, stride: int) -> tuple[int, int, int, int] | None:
        """The local rows ``[i0, i1)`` of ``q_run`` and columns ``[j0, j1)`` of ``kv_run``
        (runs: ``(local start, length, global start)``, tokens ``stride`` apart) whose tiles
        hold a visible pair, as a bounding box; None when none does."""
        q_tiles = _tiles_of(q_run, stride, self.q_block)
        kv_tiles = _tiles_of(kv_run, stride, self.kv_block)
        sub = self.tiles[q_tiles.unique()][:, kv_tiles.unique()]
        if not bool(sub.any()):
            return None
        rows = self.tiles[q_tiles][:, kv_tiles.unique()].any(1).nonzero().flatten()
        cols = self.tiles[q_tiles.unique()][:, kv_tiles].any(0).nonzero().flatten()
        return int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1

    def pairs(self, q_run, kv_run, stride: int) -> int:
        """Number of (query, key) pairs of the two runs that lie in visible tiles (the work
        the balance report counts)."""
        q_tiles, kv_tiles = (
            _tiles_of(run, stride, size)
            for run, size in ((q_run, self.q_block), (kv_run, self.kv_block))
        )
        q_ids, q_counts = q_tiles.unique(return_counts=True)
        kv_ids, kv_counts = kv_tiles.unique(return_counts=True)
        sub = self.tiles[q_ids][:, kv_ids].to(torch.int64)
        return int(q_counts @ sub @ kv_counts)


def _tiles_of(run, stride: int, block: int) -> Tensor:
    _, length, pos = run
    return (pos + torch.arange(length) * stride) // block


def _block(q_run, kv_run, stride: int, box, init: bool) -> Block:
    """The block of rows ``[i0, i1)`` of ``q_run`` and columns ``[j0, j1)`` of ``kv_run``."""
    (q_start, _, q_pos), (k_start, _, k_pos) = q_run, kv_run
    i0, i1, j0, j1 = box
    return Block(
        Span(q_start + i0, q_start + i1),
        Span(k_start + j0, k_start + j1),
        False,
        init=init,
        origin=(
            ((q_pos + i0 * stride, i1 - i0, stride),),
            ((k_pos + j0 * stride, j1 - j0, stride),),
        ),
    )


def _global_runs(runs, stride: int) -> GlobalRuns:
    return tuple((pos, length, stride) for _, length, pos in runs)


def _flex_blocks(
    layout: Layout, world_size: int, n: int, visible: VisibleBlocks, trim: bool, rank: int, src: int
) -> tuple[Block, ...]:
    q_runs, kv_runs = (layout.runs(n, r, world_size) for r in (rank, src))
    stride = layout.stride(world_size)
    diagonal = rank == src
    if not trim:  # one block of the whole shards, or none: the kernel skips hidden tiles
        seen = diagonal or any(visible.trim(a, b, stride) for a in q_runs for b in kv_runs)
        origin = (_global_runs(q_runs, stride), _global_runs(kv_runs, stride))
        return (Block(Part.ALL, Part.ALL, False, init=diagonal, origin=origin),) if seen else ()
    pairs = sorted(
        ((a, b) for a in range(len(q_runs)) for b in range(len(kv_runs))),
        key=lambda ab: ab[0] != ab[1] or not diagonal,  # the init blocks first
    )
    blocks = []
    for a, b in pairs:
        q_run, kv_run = q_runs[a], kv_runs[b]
        if diagonal and a == b:  # whole: it initialises these rows
            blocks.append(_block(q_run, kv_run, stride, (0, q_run[1], 0, kv_run[1]), True))
            continue
        box = visible.trim(q_run, kv_run, stride)
        if box is not None:
            blocks.append(_block(q_run, kv_run, stride, box, False))
    return tuple(blocks)


_PLANS: dict[tuple, Plan] = {}
_PLANS_SIZE = 64


def flex_plan(
    layout: Layout, world_size: int, seq_local: int, visible: VisibleBlocks, trim: bool = True
) -> Plan:
    """The ring plan of a FlexAttention call (Note [Flex schedules]): ``seq_local`` tokens a
    rank in ``layout``, the mask's visible tiles ``visible``; ``trim``: blocks cut to their
    visible tiles (else whole run pairs, or nothing). Cached by the tiles' digest."""
    key = (layout.name, world_size, seq_local, visible.key, trim)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_from_blocks(
            layout.name,
            world_size,
            False,
            lambda r, src: _flex_blocks(layout, world_size, seq_local, visible, trim, r, src),
            seq_local=seq_local,
        )
        if len(_PLANS) >= _PLANS_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


# Note [Mask-aware balance]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# On the ring every rank meets every key, so a rank's work is the visible pairs of the query
# rows it holds. A mask fixes each row's work before anything runs; the layout that balances
# it cuts the sequence into W * k equal chunks, weighs each by its rows' visible pairs (from
# the mask's tiles), and deals them out largest first, each to the least loaded rank that still
# has room for one (every rank holds k: shards stay equal):
#
#     packed documents, causal, W = 2, k = 2 (chunk work in visible tiles):
#        chunks  0   1   2   3      largest first: 3 (7) -> rank 0, 1 (3) -> rank 1,
#        work    1   3   3   7                     2 (3) -> rank 1, 0 (1) -> rank 0
#                                   rank 0: chunks 0, 3 = 8;  rank 1: chunks 1, 2 = 6
#
# zigzag is this rule's answer for a plain causal mask (chunk i's work grows with i). The
# result is a :class:`~dtensor_ring.layouts.builtin.TokenLayout` (a rank's chunks, in order,
# are its tokens), so plans, sharding and the report follow as for any layout.


def balanced_layout(visible: VisibleBlocks, world_size: int, chunks_per_rank: int) -> TokenLayout:
    """The layout of Note [Mask-aware balance] for the mask's tiles ``visible`` on
    ``world_size`` ranks, ``chunks_per_rank`` chunks a rank (the sequence length must be a
    multiple of ``world_size * chunks_per_rank``)."""
    n_chunks = world_size * chunks_per_rank
    if visible.seq_len % n_chunks:
        raise ValueError(
            f"a balanced layout of {chunks_per_rank} chunks a rank on {world_size} ranks needs a "
            f"sequence length divisible by {n_chunks}, got {visible.seq_len}"
        )
    c = visible.seq_len // n_chunks
    whole = (0, visible.seq_len, 0)
    work = [visible.pairs((0, c, i * c), whole, 1) for i in range(n_chunks)]
    load, held = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(n_chunks), key=lambda i: -work[i]):
        r = min((r for r in range(world_size) if len(held[r]) < chunks_per_rank),
                key=lambda r: load[r])  # fmt: skip
        load[r] += work[i]
        held[r].append(i)
    indices = torch.stack(
        [torch.cat([torch.arange(i * c, (i + 1) * c) for i in sorted(h)]) for h in held]
    )
    return TokenLayout(indices, prefix="mask_balanced")


@dataclass(frozen=True)
class FlexBalance:
    """What a FlexAttention plan computes and sends (:func:`flex_balance`).

    Attributes:
        work: per rank, the (query, key) pairs in visible tiles of the blocks it computes
            (multiply by ``4 * B * H * D`` for forward FLOPs); the slowest rank sets the pace.
        imbalance: ``max(work) / mean(work)`` (1.0 = balanced).
        blocks: per rank, the blocks computed; ``skipped``: per rank, the (query run, key
            run) pairs of the whole ring that the mask hides entirely.
        kv_transfers: K/V chunks each rank receives in a forward (``W - 1`` without skipping).
    """

    work: list[int]
    imbalance: float
    blocks: list[int]
    skipped: list[int]
    kv_transfers: int


def flex_balance(
    layout: Layout, world_size: int, seq_local: int, visible: VisibleBlocks
) -> FlexBalance:
    """The work and traffic of :func:`flex_plan`'s (trimmed) plan, rank by rank."""
    plan = flex_plan(layout, world_size, seq_local, visible)
    runs = [layout.runs(seq_local, r, world_size) for r in range(world_size)]
    stride = layout.stride(world_size)
    work, blocks, skipped = [], [], []
    for rank, row in enumerate(plan.steps):
        computed = sum(len(st.blocks) for st in row)
        pairs = sum(
            visible.pairs((0, q_len, q_pos), (0, kv_len, kv_pos), stride)
            for st in row
            for blk in st.blocks
            for q_pos, q_len, _ in blk.origin[0]
            for kv_pos, kv_len, _ in blk.origin[1]
        )
        work.append(pairs)
        blocks.append(computed)
        run_pairs = len(runs[rank]) * sum(len(src_runs) for src_runs in runs)
        skipped.append(run_pairs - computed)
    mean = sum(work) / len(work)
    return FlexBalance(
        work, max(work) / mean if mean else 1.0, blocks, skipped, plan.kv_transfers()
    )
