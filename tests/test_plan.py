"""Tier 1: schedules and their cost model, single process, no communication."""

import pytest
from expecttest import assert_expected_inline

from dtensor_ring import make_plan, token_indices
from dtensor_ring.plan import Block, Part


def test_ring_causal_table():
    assert_expected_inline(make_plan("ring", 4, causal=True).table(), """\
rank | step 0        step 1        step 2        step 3
   0 | all/all c     -             -             -
   1 | all/all c     all/all       -             -
   2 | all/all c     all/all       all/all       -
   3 | all/all c     all/all       all/all       all/all""")


def test_zigzag_table():
    assert_expected_inline(make_plan("zigzag", 4, causal=True).table(), """\
rank | step 0        step 1        step 2        step 3
   0 | all/all c     hi/all        hi/all        hi/all
   1 | all/all c     all/lo        hi/all        hi/all
   2 | all/all c     all/lo        all/lo        hi/all
   3 | all/all c     all/lo        all/lo        all/lo""")


def test_stripe_table():
    assert_expected_inline(make_plan("stripe", 3, causal=True).table(), """\
rank | step 0        step 1        step 2
   0 | all/all c     tail/head c   tail/head c
   1 | all/all c     all/all c     tail/head c
   2 | all/all c     all/all c     all/all c""")


def test_ring_noncausal_table():
    assert_expected_inline(make_plan("ring", 3, causal=False).table(), """\
rank | step 0        step 1        step 2
   0 | all/all       all/all       all/all
   1 | all/all       all/all       all/all
   2 | all/all       all/all       all/all""")


@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_query_meets_every_visible_key_once(layout, world_size):
    """Replay the plan on global token indices and compare with the causal mask."""
    n = 4  # local tokens (even, for zigzag)
    S = n * world_size
    plan = make_plan(layout, world_size, causal=True)
    seen = set()
    for rank, row in enumerate(plan.steps):
        q_idx = token_indices(layout, S, rank, world_size).tolist()
        for step in row:
            if step.block is None:
                continue
            kv_idx = token_indices(layout, S, step.src, world_size).tolist()
            q0, q1 = step.block.q.bounds(n)
            k0, k1 = step.block.kv.bounds(n)
            for i in range(q0, q1):
                for j in range(k0, k1):
                    if step.block.causal and j - k0 > i - q0:
                        continue
                    pair = (q_idx[i], kv_idx[j])
                    assert pair not in seen, f"{pair} computed twice"
                    assert pair[1] <= pair[0], f"{pair} is masked but computed"
                    seen.add(pair)
    assert len(seen) == S * (S + 1) // 2  # every visible pair exactly once


@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe"])
def test_step0_is_the_full_diagonal(layout):
    """The engine initialises its accumulators from step 0, so it must cover every query."""
    for w in range(1, 6):
        for row in make_plan(layout, w, causal=True).steps:
            assert row[0].block == Block(Part.ALL, Part.ALL, True)


def test_zigzag_is_balanced_and_ring_is_not():
    zigzag = make_plan("zigzag", 8, causal=True)
    ring = make_plan("ring", 8, causal=True)
    per_rank = zigzag.flops(seq_local=8192)
    assert max(per_rank) == min(per_rank)
    assert zigzag.imbalance(8192) == 1.0
    assert ring.imbalance(8192) > 1.7  # last rank: 7.5 blocks vs a mean of 4
    assert ring.flops(8192)[-1] > 7 * ring.flops(8192)[0]


def test_stripe_is_nearly_balanced():
    assert 1.0 < make_plan("stripe", 8, causal=True).imbalance(8192) < 1.001


def test_plan_errors():
    with pytest.raises(ValueError, match="causal attention only"):
        make_plan("zigzag", 2, causal=False)
    with pytest.raises(ValueError, match="layout="):
        make_plan("spiral", 2, causal=True)
    with pytest.raises(ValueError, match="world_size"):
        make_plan("ring", 0, causal=True)
