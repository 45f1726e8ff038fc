"""The all-gather of placed documents (Note [Gathering what placed documents need]): exact
against fp64 at W 1-4, what moves, and what it refuses."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from test_document_layout import CASES, check_ring, random_documents, visible

import dtensor_ring as dr
from dtensor_ring.schedule.placed_gather import placed_gather


@pytest.mark.parametrize(
    "world_size, case",
    [
        pytest.param(w, c, marks=[pytest.mark.slow] if w == 4 or i > 2 else [])
        for w, (i, c) in itertools.product([1, 2, 3, 4], enumerate(CASES))
    ],
)
def test_gather_matches_reference(dist_pool, world_size, case):
    """Forward and backward equal fp64 attention on the whole sequence: causal, full, windows
    (causal and two-sided), GQA and MHA, fp32; every KV head at once (the default)."""
    seed, causal, window, H, H_kv, dtype = case
    dist_pool.run(
        check_ring, world_size, seed=seed, causal=causal, window=window, H=H, H_kv=H_kv,
        dtype=dtype, algorithm="all_gather",
    )  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, None), (True, (3, 0)), (False, (2, 5))]
)
def test_only_the_keys_seen_move(world_size, causal, window):
    """A rank receives exactly the distinct keys of other ranks its queries see, each once;
    what one rank sends another is what that one receives from it; blocks hold every local
    query once."""
    for seed in range(4):
        bounds = random_documents(40 + seed, world_size)
        lay = dr.document_layout(bounds, world_size, causal=causal, window_size=window or (-1, -1))
        metas = [placed_gather(lay, causal, window, r, "cpu") for r in range(world_size)]
        for r, m in enumerate(metas):
            mine = set(lay.indices[r].tolist())
            seen = {
                j
                for t in mine
                for d in [max(i for i in range(len(bounds) - 1) if bounds[i] <= t)]
                for j in range(bounds[d], bounds[d + 1])
                if visible(t, j, causal, window or (-1, -1))
            }
            assert m.received == len(seen - mine), (r, m.received, len(seen - mine))
            for s in range(world_size):
                assert metas[s].send_splits[r] == m.recv_splits[s]
            rows = sorted(
                i
                for blk in m.local_blocks + m.remote_blocks
                for a, b in blk.q.spans
                for i in range(a, b)
            )
            assert rows == list(range(len(mine)))
        assert any(m.exchanges for m in metas) == bool(lay.split)


def check_stride(group: dist.ProcessGroup, stride: int) -> None:
    check_ring(group, seed=0, causal=True, window=(-1, -1), H=4, H_kv=2, dtype=torch.float64,
               stride=stride)  # fmt: skip


@pytest.mark.parametrize("stride", [1, 2])
def test_heads_k_stride_groups(dist_pool, stride):
    """The all-gather door's ``heads_k_stride`` on placed documents (``ring_varlen_attention_func``
    fetches every KV head at once): each group of KV heads fetched and computed in turn, exact."""
    dist_pool.run(check_stride, 3, stride=stride)


def check_nothing_moves(group: dist.ProcessGroup) -> None:
    """No document cut: no all-to-all at all, forward or backward, and each rank's one kernel
    call is the answer (its result not copied into an output of the engine's)."""
    from dtensor_ring.engine.varlen_blocks import VarlenBlocks

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, *range(8, 8 * 2 * W, 8), 16 * W]
    lay = dr.document_layout(bounds, W)
    assert lay.split == ()
    x = torch.randn(16 * W, 2, 4, dtype=torch.float64, generator=torch.Generator())
    q, cu_local = dr.shard_varlen(x, bounds, lay, rank, W)

    def refuse(*args, **kwargs):
        raise AssertionError("an all-to-all although no document is cut")

    original, dist.all_to_all_single = dist.all_to_all_single, refuse

    def copy(*args, **kwargs):
        raise AssertionError("a block's result copied although the rank's documents are whole")

    copied, VarlenBlocks.init_ = VarlenBlocks.init_, copy
    try:
        q.requires_grad_()
        kw = dict(causal=True, group=group, algorithm="all_gather")
        dr.ring_varlen_attention_func(lay, q, q, q, cu_local, None, **kw).sum().backward()
    finally:
        dist.all_to_all_single, VarlenBlocks.init_ = original, copied
    assert q.grad is not None


def test_no_cut_document_moves_nothing(dist_pool):
    dist_pool.run(check_nothing_moves, 3)


def _cut_documents(group: dist.ProcessGroup, seed: int):
    """``(layout, q, cu_local)``: this rank's share of random fp64 queries ``[24, 4, 8]`` of
    four documents placed on the group's ranks, one of them cut (the all-to-alls run)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, 3, 17, 20, 24]
    lay = dr.document_layout(bounds, W)
    assert lay.split
    x = torch.randn(24, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return lay, *dr.shard_varlen(x, bounds, lay, rank, W)


def check_compile(group: dist.ProcessGroup) -> None:
    """The all-gather of placed documents traces with ``fullgraph=True`` and matches eager,
    forward and backward (a cut document: the all-to-alls run)."""
    lay, q, cu_local = _cut_documents(group, seed=0)
    k = q[:, :2].clone()

    def fn(q, k):
        kw = dict(causal=True, group=group, algorithm="all_gather")
        return dr.ring_varlen_attention_func(lay, q, k, k, cu_local, None, **kw).sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        loss = f(*leaves)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_compile_fullgraph(dist_pool):
    dist_pool.run(check_compile, 2)


def check_checkpoint(group: dist.ProcessGroup) -> None:
    """Under activation checkpointing (reentrant and not) the all-gather of placed documents
    recomputes exactly: loss and gradients equal the plain call's, and the recomputation ran
    the all-to-alls again (one forward more)."""
    import torch.utils.checkpoint as torch_checkpoint

    lay, q, cu_local = _cut_documents(group, seed=1)
    k = (q[:, :2] * 0.5).clone()
    calls = []

    def attention(q, k, v):
        calls.append(1)
        kw = dict(causal=True, group=group, algorithm="all_gather")
        return dr.ring_varlen_attention_func(lay, q, k, v, cu_local, None, **kw)

    def step(checkpoint):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        y = leaves[0] * 1.5
        out = (
            checkpoint(attention, y, leaves[1], leaves[1] * 2)
            if checkpoint
            else attention(y, leaves[1], leaves[1] * 2)
        )
        loss = (out.sin() * y).sum()
        loss.backward()
        return [loss.detach(), *(t.grad for t in leaves)]

    want = step(None)
    for reentrant in (True, False):
        calls.clear()
        got = step(lambda f, *a, r=reentrant: torch_checkpoint.checkpoint(f, *a, use_reentrant=r))
        assert len(calls) == 2, calls  # the forward and its recomputation
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_activation_checkpointing(dist_pool):
    dist_pool.run(check_checkpoint, 3)


@pytest.mark.parametrize(
    "causal, window, seed", [(True, (-1, -1), 7), (False, (2, 5), 7), (True, (-1, -1), None)]
)
def test_simulated_ranks_match_reference(causal, window, seed):
    """``simulate_gather`` runs every rank's engine on one device (what the benchmarks and GPU
    checks use): out, lse, dq and dK/dV (each rank's with the shares the others return) exact
    against fp64; also with no document cut."""
    from reference import reference_attention_varlen

    from dtensor_ring.simulate import simulate_gather

    W = 3
    bounds = random_documents(seed, W, max_docs=6) if seed else [0, 4, 8, 12, 16, 20, 24]
    lay = dr.document_layout(bounds, W, causal=causal, window_size=window)
    assert bool(lay.split) == bool(seed)  # (no document cut: nothing fetched)
    gen = torch.Generator().manual_seed(3)
    T = bounds[-1]
    q, k, v, dout = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    out_ref, lse_ref = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
    want = [out_ref, lse_ref, *torch.autograd.grad(out_ref, full, dout)]
    kw = dict(layout=lay, world_size=W, cu_seqlens=bounds, causal=causal, window_size=window)
    got = simulate_gather(q, k, v, dout, **kw)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y.detach(), rtol=1e-10, atol=1e-10)


def check_sinks(group: dist.ProcessGroup) -> None:
    """Attention sinks (Note [Attention sinks]): the all-gather's out and gradients, the sinks'
    included, equal the ring's on the same placed documents."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, 5, 17, 20, 30]
    lay = dr.document_layout(bounds, W)
    assert lay.split
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(30, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    results = []
    for algorithm in ("ring", "all_gather"):
        (ql, cu), (kl, _) = (dr.shard_varlen(x, bounds, lay, rank, W) for x in (q, k))
        leaves = [ql.requires_grad_(), kl.requires_grad_(), sinks.clone().requires_grad_()]
        out = dr.ring_varlen_attention_func(
            lay, ql, kl, kl, cu, None, causal=True, sinks=leaves[2], group=group,
            algorithm=algorithm,
        )  # fmt: skip
        out.sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_sinks_as_the_ring(dist_pool):
    dist_pool.run(check_sinks, 3)


def check_rows_of_minus_inf_scores(group: dist.ProcessGroup) -> None:
    """A row whose every visible score is -inf is NaN (SDPA's 0 / 0), as the ring gives it,
    also on a rank of whole documents (one kernel call: the math kernel's 0 for such a row,
    for merging, is not the answer)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bounds = [0, *range(8, 8 * 2 * W, 8), 16 * W]  # no document cut
    lay = dr.document_layout(bounds, W)
    q = torch.ones(16 * W, 2, 4, dtype=torch.float64)
    k = torch.ones(16 * W, 1, 4, dtype=torch.float64)
    k[bounds[1] : bounds[2], :, 0] = float("-inf")  # document 1's keys: every score -inf
    results = []
    for algorithm in ("ring", "all_gather"):
        (ql, cu), (kl, _) = (dr.shard_varlen(x, bounds, lay, rank, W) for x in (q, k))
        kw = dict(causal=True, group=group, algorithm=algorithm, backend="math")
        results.append(dr.ring_varlen_attention_func(lay, ql, kl, kl, cu, None, **kw))
    torch.testing.assert_close(results[1], results[0], equal_nan=True, rtol=0, atol=0)
    assert results[0].isnan().any() == (rank == [r for r, row in enumerate(lay.pieces)
                                                 if any(d == 1 for d, _, _ in row)][0])  # fmt: skip


def test_rows_of_minus_inf_scores(dist_pool):
    dist_pool.run(check_rows_of_minus_inf_scores, 2)
