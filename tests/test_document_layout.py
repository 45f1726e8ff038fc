"""Balanced packed documents (Note [Balanced documents]): ``dtensor_ring.document_layout``.

1. The layout, one process: every rank holds T/W tokens, a permutation of the stream; whole
   documents stay whole; the reported work is the visible pairs counted token by token; the
   balance on random documents; a plan that computes every visible pair once, and nothing
   when no document is cut but step 0.
2. Numerics, single device: ``simulate_ring`` (every rank of the engine in turn) against the
   fp64 per-document reference at W = 1-4, causal, full, windows, GQA.
3. Numerics on the gloo pool (W = 1-4): ``ring_varlen_attention_func`` with the layout object,
   forward and backward against the fp64 reference; no K/V sent when no document is cut;
   bad calls raise ``ValueError`` on every rank before any communication.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import re

import pytest
import torch
import torch.distributed as dist
from flash2_model import flash2_visible, modelled_flash2
from reference import reference_attention_varlen

import dtensor_ring as dr
from dtensor_ring.api.varlen import gather_varlen_attention_func
from dtensor_ring.kernels.base import window_mask
from dtensor_ring.kernels.cuda_flash import flash2_max_seqlen_k
from dtensor_ring.layouts import TokenLayout
from dtensor_ring.layouts.document_placement import (
    _candidate,
    _candidates,
    _evened,
    _place_runs,
    _Work,
    documents_on_tokens,
)
from dtensor_ring.layouts.documents import _held, _split, pairs_by_offset
from dtensor_ring.parts import band_pairs
from dtensor_ring.schedule.varlen import varlen_plan


def random_documents(seed: int, world_size: int, max_docs: int = 9) -> list[int]:
    """Global boundaries of 1..max_docs documents of any lengths, T a multiple of W."""
    rng = random.Random(seed)
    T = world_size * rng.randint(4, 40)
    cuts = sorted(rng.sample(range(1, T), min(rng.randint(1, max_docs) - 1, T - 1)))
    return [0, *cuts, T]


def visible(p: int, j: int, causal: bool, window: tuple[int, int]) -> bool:
    """Whether query position p sees key position j of the same document."""
    left, right = window
    if causal and j > p:
        return False
    return (left < 0 or p - j <= left) and (right < 0 or j - p <= right)


def pairs_of(tokens: list[int], bounds: list[int], causal: bool, window) -> int:
    """Visible (query, key) pairs of the query tokens ``tokens`` (global indices), counted."""
    total = 0
    for t in tokens:
        d = max(i for i in range(len(bounds) - 1) if bounds[i] <= t)
        a, b = bounds[d], bounds[d + 1]
        total += sum(visible(t - a, j - a, causal, window) for j in range(a, b))
    return total


def segment_band(blk, s_q: int, s_k: int) -> tuple[int, int]:
    """A block's mask on one ``s_q x s_k`` segment as ``lo <= j - i <= hi`` (flash-attn's
    bottom-right window, written out independently)."""
    big = 1 << 40
    if blk.causal:
        return -big, 0
    left, right = blk.window or (-1, -1)
    return (-big if left < 0 else s_k - s_q - left, big if right < 0 else s_k - s_q + right)


MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 5))]


# --- 1. the layout ------------------------------------------------------------------------------


def every_candidate(seeds, world_size: int, every: int = 1):
    """``(causal, window, layout)`` for every placement the balancer weighs (Note [Balanced
    documents]), not just its pick, of random documents per seed (every ``every``-th), and
    the stream's contiguous and head-tail shards as placed documents (``documents_on_tokens``,
    torchtitan's varlen rows)."""
    for seed in seeds:
        causal, window = MASKS[seed % len(MASKS)]
        norm = None if window == (-1, -1) else window
        bounds = random_documents(seed, world_size)
        for c in list(_candidates(bounds, world_size, causal, norm))[::every]:
            yield causal, window, c.layout(bounds)
        T = bounds[-1]
        for row_layout in ("ring", "zigzag")[: 1 + (T % (2 * world_size) == 0)]:
            tokens = torch.stack([dr.token_indices(row_layout, T, r, world_size)
                                  for r in range(world_size)])  # fmt: skip
            yield causal, window, documents_on_tokens(bounds, tokens, causal, norm)


@pytest.mark.parametrize(
    "world_size", [1, 2, 3, *(pytest.param(w, marks=pytest.mark.slow) for w in (4, 8))]
)
def test_layout_places_every_token_once(world_size):
    for causal, window, lay in every_candidate(range(20), world_size):
        bounds = list(lay.bounds)
        T, n = bounds[-1], bounds[-1] // world_size
        assert lay.indices.shape == (world_size, n)
        assert sorted(lay.indices.flatten().tolist()) == list(range(T))
        cut = set(lay.split)
        for r in range(world_size):
            tokens = lay.indices[r].tolist()
            assert tokens == sorted(tokens)  # global order: a document's pieces are adjacent
            assert dr.varlen_token_indices(bounds, lay, r, world_size).tolist() == tokens
            docs = [max(i for i in range(len(bounds) - 1) if bounds[i] <= t) for t in tokens]
            local = [0] + [i + 1 for i in range(n - 1) if docs[i] != docs[i + 1]] + [n]
            assert list(lay.local_bounds[r]) == local
            assert dr.varlen_local_cu_seqlens(bounds, lay, r, world_size).tolist() == local
            assert lay.work[r] == pairs_of(tokens, bounds, causal, window)
        for d in range(len(bounds) - 1):  # a document not cut lies on one rank, whole
            holders = {r for r in range(world_size) for t in lay.indices[r].tolist()
                       if bounds[d] <= t < bounds[d + 1]}  # fmt: skip
            assert len(holders) == 1 or d in cut
        assert lay.imbalance == pytest.approx(max(lay.work) / (sum(lay.work) / world_size))


def test_note_example():
    """Note [Balanced documents]: A is cut, B..E stay whole, 52 pairs a rank."""
    lay = dr.document_layout([0, 12, 16, 20, 22, 24], 2)
    assert lay.split == (0,)
    assert lay.work == (52, 52)
    assert lay.indices.tolist() == [
        [0, 1, 2, 9, 10, 11, 12, 13, 14, 15, 20, 21],
        [3, 4, 5, 6, 7, 8, 16, 17, 18, 19, 22, 23],
    ]


@pytest.mark.parametrize("world_size", [4, 8])
def test_balance_of_many_documents(world_size):
    """Random packed batches of 8-100 documents: within the tolerance; with many more
    documents than ranks, most stay whole."""
    rng = random.Random(world_size)
    for n_docs in (8, 32, 100):
        T = 4096 * world_size
        bounds = [0, *sorted(rng.sample(range(1, T), n_docs - 1)), T]
        lay = dr.document_layout(bounds, world_size)
        assert lay.imbalance <= 1.05, (n_docs, lay)
        assert n_docs < 4 * world_size or len(lay.split) <= n_docs // 4, (n_docs, lay)


def test_evening_exchanges_and_shifts():
    """Note [Balanced documents]'s evening: the heaviest rank gives a long whole document for
    short ones of equal tokens (2048 for two 1024: causal pairs 2098176 against 2 x 524800,
    two ranks then equal); or, sharing two cut documents with another rank, takes tokens of
    one and gives as many of the other (the dense end of a long document against the sparse
    start of another). Random placements: never heavier; tokens a rank, the ranks each cut
    document is on, the ring offsets stay."""
    work = _Work([2048, 2048, 1024, 1024, 1024, 1024], True, None)
    pieces = [[(0, 0, 2048), (1, 0, 2048)], [(d, 0, 1024) for d in range(2, 6)]]
    rows = _evened(pieces, work, shifts=True)
    assert [sum(work(*p) for p in row) for row in rows] == [2098176 + 1049600] * 2
    # rank 0: the sparse start of A and the dense end of B; rank 1 the other halves
    work = _Work([64, 64], True, None)
    pieces = [[(0, 0, 32), (1, 32, 64)], [(0, 32, 64), (1, 0, 32)]]
    loads = [sum(work(*p) for p in row) for row in _evened(pieces, work, shifts=True)]
    assert loads[0] == loads[1] == sum(work.totals) // 2, loads
    rng = random.Random(0)
    for _ in range(20):
        T, W = 4096 * 4, 4
        bounds = [0, *sorted(rng.sample(range(1, T), rng.randrange(4, 40) - 1)), T]
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        work = _Work(lengths, True, None)
        order = sorted(range(len(lengths)), key=lambda d: -work.totals[d])
        for limit in (math.inf, sum(work.totals) / W * 0.5):
            placed = _place_runs(order, W, T // W, work, limit)
            rows = _evened(placed, work, shifts=True)
            before, after = (_candidate(x, work, zigzag=False) for x in (placed, rows))
            assert max(after.work) <= max(before.work)
            assert (after.offsets, after.split) == (before.offsets, before.split)
            assert [sum(b - a for _, a, b in row) for row in rows] == [T // W] * W
            assert sum(after.work) == sum(before.work)
            split = set(_split(_held(placed)))
            cut = [
                {(p[0], r) for r, row in enumerate(x) for p in row if p[0] in split}
                for x in (placed, rows)
            ]
            assert cut[0] == cut[1]  # a cut document stays on its ranks


def test_predicted_time_prefers_fewer_steps_for_small_work():
    """With the attention's shape, a packed batch whose ranks hold little work keeps its
    documents on few ranks (a ring step costs at least its host time); the balance-only pick
    cuts documents over every rank. Both are candidates of the same search."""
    bounds = [0, *range(1024, 65536, 1024), 65536]  # 64 documents of 1024 tokens on 8 ranks
    bounds[1:3] = [6144, 12288]  # two heavy ones
    bounds = sorted(set(bounds))
    balanced = dr.document_layout(bounds, 8)
    timed = dr.document_layout(bounds, 8, heads=32, kv_heads=8, head_dim=128)
    transfers = [
        varlen_plan(lay.local_bounds[0], lay, 8, True, None).kv_transfers()
        for lay in (balanced, timed)
    ]
    assert transfers[1] < transfers[0], transfers
    with pytest.raises(ValueError, match="heads, kv_heads and head_dim are given together"):
        dr.document_layout(bounds, 8, heads=32)


def test_tolerance_trades_cuts_for_balance():
    bounds = [0, *range(1024, 65536, 2048), 65536]  # 32 documents, 1024 then 2048 tokens
    loose, tight = (dr.document_layout(bounds, 8, tolerance=t) for t in (2.0, 1.0))
    assert loose.split == () and tight.imbalance <= loose.imbalance
    assert len(tight.split) >= len(loose.split)


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_computes_every_visible_pair_once(world_size):
    """Each rank's blocks cover exactly its visible pairs (counted token by token), every
    local row is initialised by exactly one step-0 block, a kernel call never holds one query
    row twice, each step computes what the cost model counts for it without a plan
    (``pairs_by_offset``), and FlashAttention-2 computes every windowed call as asked (Note
    [FlashAttention-2's unbounded window sides]: these plans send documents with more queries
    than keys)."""
    for causal, window, lay in every_candidate(range(100, 112), world_size):
        bounds = list(lay.bounds)
        norm = None if window == (-1, -1) else window
        plan = varlen_plan(lay.local_bounds[0], lay, world_size, causal, norm)
        counted = pairs_by_offset(lay.pieces, causal, norm)
        assert set(plan.offsets) == {0}.union(*counted)
        for r, row in enumerate(plan.steps):
            got, init_rows = 0, []
            for offset, step in zip(plan.offsets, row, strict=True):
                in_step = 0
                for blk in step.blocks:
                    rows = [i for a, b in blk.q.spans for i in range(a, b)]
                    assert len(rows) == len(set(rows))
                    init_rows += rows if blk.init else []
                    if blk.window is not None:
                        _check_flash2_call(blk)
                    for (qa, qb), (ka, kb) in zip(blk.q.spans, blk.kv.spans, strict=True):
                        in_step += band_pairs(
                            qb - qa, kb - ka, *segment_band(blk, qb - qa, kb - ka)
                        )
                assert in_step == counted[r].get(offset, 0), (r, offset)
                got += in_step
            assert sorted(init_rows) == list(range(bounds[-1] // world_size))
            assert got == pairs_of(lay.indices[r].tolist(), bounds, causal, window)


def _check_flash2_call(blk) -> None:
    """The varlen call of ``blk`` as the FlashAttention-2 adapters make it computes the
    interface's window in every document (``flash2_model.flash2_visible``)."""
    sizes_q, sizes_k = ([b - a for a, b in part.spans] for part in (blk.q, blk.kv))
    max_q, max_k = max(sizes_q), max(sizes_k)
    passed = flash2_max_seqlen_k(max_q, max_k, blk.window)
    for s_q, s_k in zip(sizes_q, sizes_k, strict=True):
        got = flash2_visible(s_q, s_k, max_q, passed, False, blk.window)
        assert torch.equal(got, window_mask(s_q, s_k, blk.window, "cpu")), (blk, s_q, s_k)


@pytest.mark.parametrize("world_size", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_candidates_count_the_plans_steps(world_size):
    """The offsets a candidate is ranked by are its plan's steps beyond the first, for every
    mask: a window that keeps two pieces of a document apart needs no step for them."""
    for seed in range(300, 306):
        bounds = random_documents(seed, world_size)
        for causal, window in MASKS + [(True, (1, 0)), (False, (0, 0))]:
            norm = None if window == (-1, -1) else window
            for c in _candidates(bounds, world_size, causal, norm):
                lay = c.layout(bounds)
                plan = varlen_plan(lay.local_bounds[0], lay, world_size, causal, norm)
                assert len(plan.offsets) - 1 == c.offsets, (seed, causal, window)


def test_no_cut_document_no_step_but_the_first():
    bounds = [0, *range(64, 1024, 64), 1024]  # 16 equal documents on 4 ranks
    lay = dr.document_layout(bounds, 4)
    assert lay.split == () and lay.imbalance == 1.0
    for causal, window in MASKS:
        norm = None if window == (-1, -1) else window
        assert varlen_plan(lay.local_bounds[0], lay, 4, causal, norm).offsets == (0,)


def test_layout_refuses_other_documents():
    lay = dr.document_layout([0, 8, 16], 2)
    x = torch.arange(16)
    with pytest.raises(ValueError, match="not these 2 documents .* on 4 ranks"):
        dr.shard_varlen(x, [0, 8, 16], lay, 0, 4)
    with pytest.raises(ValueError, match="not these 3 documents"):
        dr.shard_varlen(x, [0, 4, 8, 16], lay, 0, 2)
    local = [dr.shard_varlen(x, [0, 8, 16], lay, r, 2)[0] for r in range(2)]
    assert torch.equal(dr.unshard_varlen(local, [0, 8, 16], lay), x)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"tolerance": 0.5}, ValueError, "tolerance must be a number >= 1"),
        ({"tolerance": float("nan")}, ValueError, "tolerance must be a number >= 1"),
        ({"window_size": (2, 0, 1)}, ValueError, "window_size"),
        ({"causal": "yes"}, TypeError, "causal must be a bool"),
    ],
)
def test_bad_layout_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        dr.document_layout([0, 8, 16], 2, **kwargs)


def test_bad_layout_documents():
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        dr.document_layout([0, 8, 16], 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        dr.document_layout([0, 8, 8, 16], 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        dr.document_layout([0, 8, 16], 0)


# --- 2. numerics, single device ------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, backend",
    [(1, None), (2, None), (3, None), pytest.param(4, None, marks=pytest.mark.slow),
     (2, "flash2_model"),
     pytest.param(3, "flash2_model", marks=pytest.mark.slow)],
)  # fmt: skip
def test_simulated_ring_matches_reference(world_size, backend):
    """Every candidate placement, exact; ``flash2_model``: through cuda_flash's adapter on
    FlashAttention-2's modelled ops (the calls the GPU gets: these plans send documents with
    more queries than keys under a window)."""
    seeds, every = (range(100, 112), 1) if backend else (range(200, 206), 3)
    for i, (causal, window, lay) in enumerate(every_candidate(seeds, world_size, every)):
        if backend and window == (-1, -1):
            continue  # the model differs from the math kernel only in windows
        bounds = list(lay.bounds)
        gen = torch.Generator().manual_seed(i)
        T = bounds[-1]
        q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        dout = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
        with modelled_flash2() if backend else contextlib.nullcontext():
            out, lse, dq, dk, dv = dr.simulate_ring(
                q, k, v, dout, layout=lay, world_size=world_size, causal=causal,
                cu_seqlens=bounds, window_size=window, backend=backend,
            )  # fmt: skip
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        out_ref, lse_ref = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
        grads = torch.autograd.grad(out_ref, full, dout)
        for got, want in zip((out, lse, dq, dk, dv), (out_ref, lse_ref, *grads), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world_size", [2, 3])
def test_flex_on_the_layout_matches_reference(world_size):
    """The layout places a dense call's tokens too: FlexAttention with the documents' mask on
    it (simulated, flex_math) is exact, and sends K/V only for the cut documents."""
    bounds = [0, 40, 56, 64, 100, 128, 160, 96 * world_size]
    cu = torch.tensor(bounds, dtype=torch.int32)
    lay = dr.document_layout(bounds, world_size)
    T = bounds[-1]
    gen = torch.Generator().manual_seed(world_size)
    q, k, v, dout = (torch.randn(1, T, 2, 8, generator=gen, dtype=torch.float64) for _ in "qkvd")
    block_mask = dr.document_mask(cu, T, block_size=16)
    out, lse, dq, dk, dv = dr.simulate_ring(
        q, k, v, dout, layout=lay, world_size=world_size, block_mask=block_mask
    )
    full = [x[0].clone().requires_grad_() for x in (q, k, v)]
    out_ref, _ = reference_attention_varlen(*full, cu, causal=True)
    grads = torch.autograd.grad(out_ref, full, dout[0])
    for got, want in zip((out, dq, dk, dv), (out_ref, *grads), strict=True):
        torch.testing.assert_close(got[0], want.detach(), rtol=1e-10, atol=1e-10)


# --- 3. on the gloo pool -------------------------------------------------------------------------

CASES = [  # (seed, causal, window, H, H_kv, dtype)
    (0, True, (-1, -1), 4, 2, torch.float64),
    (1, False, (-1, -1), 4, 4, torch.float64),
    (2, True, (3, 0), 4, 1, torch.float64),
    (3, False, (2, 5), 2, 2, torch.float64),
    (4, True, (-1, -1), 4, 2, torch.float32),
]


def check_ring(group, seed, causal, window, H, H_kv, dtype, algorithm=None, stride=None):
    """One call of ``algorithm`` (``stride``: the all-gather's KV heads a step) against fp64."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = random_documents(300 + seed + 10 * W, W)
    cu = torch.tensor(bounds, dtype=torch.int32)
    lay = dr.document_layout(cu, W, causal=causal, window_size=window)
    gen = torch.Generator().manual_seed(seed)
    T = bounds[-1]
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv))
    dout = torch.randn(T, H, 8, generator=gen, dtype=torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
    grads = torch.autograd.grad(out_ref, full, dout)
    idx = lay.indices[rank]
    local = []
    for x in (q, k, v):
        shard, cu_local = dr.shard_varlen(x.to(dtype), cu, lay, rank, W)
        local.append(shard.requires_grad_())
    kw = dict(causal=causal, window_size=window, group=group, return_attn_probs=True)
    if stride is None:
        out, lse, _ = dr.ring_varlen_attention_func(
            lay, *local, cu_local, None, **kw, algorithm=algorithm
        )
    else:
        out, lse, _ = gather_varlen_attention_func(lay, *local, cu_local, None, stride, **kw)
    out.backward(dout[idx].to(dtype))
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, got, want in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (out, lse, *(x.grad for x in local)),
        (out_ref[idx], lse_ref[:, idx], *(g[idx] for g in grads)),
        strict=True,
    ):
        torch.testing.assert_close(
            got.double(), want.detach(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "world_size, case",
    [  # W = 4 in the slow tier (the fast tier stays under 2 minutes)
        pytest.param(w, c, marks=[pytest.mark.slow] if w == 4 else [])
        for w, c in itertools.product([1, 2, 3, 4], CASES)
    ],
)
def test_ring_matches_reference(dist_pool, world_size, case):
    seed, causal, window, H, H_kv, dtype = case
    dist_pool.run(
        check_ring, world_size, seed=seed, causal=causal, window=window, H=H, H_kv=H_kv,
        dtype=dtype,
    )  # fmt: skip


def check_nothing_sent(group: dist.ProcessGroup) -> None:
    """No document cut: the call computes its documents locally, sending nothing."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, *range(8, 8 * 2 * W, 8), 16 * W]  # 2W documents of 8 tokens
    lay = dr.document_layout(bounds, W)
    assert lay.split == ()
    x = torch.randn(16 * W, 2, 4, dtype=torch.float64, generator=torch.Generator())
    q, cu_local = dr.shard_varlen(x, bounds, lay, rank, W)

    def refuse(*args, **kwargs):
        raise AssertionError("K/V sent although no document is cut")

    originals = dist.batch_isend_irecv, dist.isend, dist.irecv
    dist.batch_isend_irecv = dist.isend = dist.irecv = refuse
    try:
        q.requires_grad_()
        out = dr.ring_varlen_attention_func(lay, q, q, q, cu_local, None, causal=True, group=group)
        out.sum().backward()
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = originals
    assert q.grad is not None


def test_no_cut_document_sends_nothing(dist_pool):
    dist_pool.run(check_nothing_sent, 3)


def _bad_call(group, what: str, algorithm: str | None = None):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, 6, 10, 12, 18, 24]
    lay = dr.document_layout(bounds, W)
    x = torch.randn(24, 2, 4, dtype=torch.float64, generator=torch.Generator())
    q, cu_local = dr.shard_varlen(x, bounds, lay, rank, W)
    if what == "other_rank_cu":
        cu_local = dr.shard_varlen(x, bounds, lay, (rank + 1) % W, W)[1]
        if torch.equal(cu_local, dr.shard_varlen(x, bounds, lay, rank, W)[1]):
            cu_local = torch.tensor([0, len(q)], dtype=torch.int32)
    if what.startswith("dense"):  # placed tokens of a dense call: only the ring runs them
        x = q[None].expand(2, -1, -1, -1)
        return dr.ring_attention_func(lay, x, x, x, causal=True, group=group, algorithm=algorithm)
    if what == "other_world":
        lay = dr.document_layout([0, 8, 16, 24], W + 1 if 24 % (W + 1) == 0 else 1)
    return dr.ring_varlen_attention_func(
        lay, q, q, q, cu_local, None, causal=True, group=group, algorithm=algorithm
    )


BAD = {
    "other_rank_cu": r"not its local documents under layout .*shard_varlen",
    "other_world": r"places documents on \d ranks, the group has 2",
    "dense": r"runs algorithm='ring' in a dense call, got 'all_gather'",
}


def check_bad(group: dist.ProcessGroup, what: str, algorithm: str | None) -> str:
    with pytest.raises(ValueError) as info:
        _bad_call(group, what, algorithm)
    return str(info.value)


@pytest.mark.parametrize(
    "what, algorithm",
    [("other_rank_cu", None), ("other_rank_cu", "all_gather"), ("other_world", None),
     ("other_world", "all_gather"), ("dense", "all_gather")],
)  # fmt: skip
def test_bad_call_raises_on_every_rank(dist_pool, what, algorithm):
    """Wrong local documents, a layout of another world size (ring or all-gather), and the
    all-gather of placed tokens in a dense call."""
    for message in dist_pool.run(check_bad, 2, timeout_s=60, what=what, algorithm=algorithm):
        assert re.search(BAD[what], message, re.S), message


def check_one_rank_disagrees(group: dist.ProcessGroup) -> str:
    """In the consistency mode a rank passing another rank's local documents makes every rank
    raise (without it, that rank raises alone, before communicating)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, 6, 10, 12, 18, 24]
    lay = dr.document_layout(bounds, W)
    x = torch.randn(24, 2, 4, dtype=torch.float64, generator=torch.Generator())
    q, cu_local = dr.shard_varlen(x, bounds, lay, rank, W)
    if rank == 1:
        cu_local = torch.tensor([0, len(q)], dtype=torch.int32)
    dr.set_consistency_checks(True)
    try:
        with pytest.raises(ValueError) as info:
            dr.ring_varlen_attention_func(lay, q, q, q, cu_local, None, causal=True, group=group)
    finally:
        dr.set_consistency_checks(None)
    return str(info.value)


def test_rank_disagreement_raises_everywhere(dist_pool):
    for message in dist_pool.run(check_one_rank_disagrees, 2, timeout_s=60):
        assert re.search(r"rank 1 passed cu_seqlens \[0, 12\], not its local", message), message


# --- 3. documents as shards made elsewhere hold them ----------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_documents_as_sharded_holds_the_shards(world_size):
    """Each rank holds exactly what the dense layout placed on it; sharding and local
    boundaries follow (every placement property: the documents_on_tokens candidates above)."""
    for seed in range(5):
        bounds = random_documents(400 + seed, world_size)
        T = bounds[-1]
        names = ["ring", "zigzag"] if T % (2 * world_size) == 0 else ["ring"]
        for name in names:
            lay = dr.documents_as_sharded(bounds, name, world_size)
            x = torch.arange(T)
            for r in range(world_size):
                tokens = dr.token_indices(name, T, r, world_size)
                assert torch.equal(lay.indices[r], tokens)
                shard, cu_local = dr.shard_varlen(x, bounds, lay, r, world_size)
                assert torch.equal(shard, tokens)
                assert cu_local.tolist() == list(lay.local_bounds[r])


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 5, 16], "zigzag", 3), "not divisible by 6"),  # zigzag needs 2W | T
        (([0, 5, 16], "ring", 0), "world_size must be a positive int"),
        (([0, 5, 5, 16], "ring", 2), "strictly increasing"),
        (([0, 5, 16], "nonsense", 2), "nonsense"),
        (([0, 5, 16], TokenLayout(torch.arange(16).flip(0).reshape(2, 8)), 2), "increasing"),
    ],
    ids=["indivisible", "world", "empty-document", "unknown-layout", "unsorted"],
)
def test_documents_as_sharded_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        dr.documents_as_sharded(*args)


def check_head_tail_rows(group: dist.ProcessGroup, causal, window) -> None:
    """A packed row sharded head-tail (PyTorch's and torchtitan's default), told its positions:
    exact on ``documents_as_sharded``'s layout, forward and backward."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, 5 * W, 9 * W, 12 * W - 1, 16 * W]
    cu = torch.tensor(bounds, dtype=torch.int32)
    lay = dr.documents_as_sharded(cu, "zigzag", W, causal=causal, window_size=window)
    gen = torch.Generator().manual_seed(W)
    T = bounds[-1]
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, _ = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
    grads = torch.autograd.grad(out_ref, full, dout)
    idx = dr.token_indices("zigzag", T, rank, W)  # the head-tail shard of the row
    local = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    cu_local = dr.varlen_local_cu_seqlens(cu, lay, rank, W)
    out = dr.ring_varlen_attention_func(
        lay, *local, cu_local, None, causal=causal, window_size=window, group=group,
        positions=idx,
    )  # fmt: skip
    out.backward(dout[idx])
    for got, want in zip((out, *(x.grad for x in local)), (out_ref, *grads), strict=True):
        torch.testing.assert_close(got, want[idx].detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "world_size, causal, window",
    [
        (2, True, (4, 0)),
        *(pytest.param(w, c, win, marks=pytest.mark.slow) for w, c, win in (
            (1, True, (-1, -1)), (2, True, (-1, -1)), (2, False, (2, 3)),
            (3, True, (-1, -1)), (3, True, (4, 0)), (3, False, (2, 3)),
        )),
    ],
)  # fmt: skip
def test_head_tail_rows_exact(dist_pool, world_size, causal, window):
    dist_pool.run(check_head_tail_rows, world_size, causal=causal, window=window)


def test_cut_points_on_tiles():
    """Cut points go to the kernels' 64-token tiles first (Note [Balanced documents]): the
    32 documents of ``bench_flex.py`` (65536 tokens, multiples of 1024) on 8 ranks and three
    documents of 128W-multiples under a window at W = 4 (which token-grain shifts cut into
    pieces of 1 and 37 tokens) are placed with every piece on the tiles, within the
    tolerance; documents shorter than a tile still even out by the token."""
    from dtensor_ring.layouts.document_placement import TILE

    gen = torch.Generator().manual_seed(32)
    cuts = torch.sort(torch.randperm(63, generator=gen)[:31] + 1).values * 1024
    cases = [([0, *cuts.tolist(), 65536], 8, (-1, 0)), ([0, 1024, 1536, 3072], 4, (128, 0))]
    for bounds, W, window in cases:
        lay = dr.document_layout(bounds, W, window_size=window)
        assert lay.imbalance <= 1.05 and lay.split, (lay.imbalance, lay.split)
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        for row in lay.pieces:
            for d, a, b in row:
                assert a % TILE == 0 and (b % TILE == 0 or b == lengths[d]), (d, a, b)
    work = _Work([48, 48], True, None)  # shorter than a tile: token-grain shifts
    pieces = [[(0, 0, 24), (1, 24, 48)], [(0, 24, 48), (1, 0, 24)]]
    loads = [sum(work(*p) for p in row) for row in _evened(pieces, work, shifts=True)]
    assert loads[0] == loads[1], loads
