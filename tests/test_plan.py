"""Tier 1: schedules and their cost model, single process, no communication."""

import itertools

import pytest
import torch
from expecttest import assert_expected_inline
from flash2_model import flash2_visible

from dtensor_ring import document_layout, make_plan, token_indices
from dtensor_ring.kernels.base import window_mask
from dtensor_ring.parts import Block, Part, band_pairs
from dtensor_ring.resolve import normalize_window
from dtensor_ring.schedule.varlen import varlen_plan


def test_ring_causal_table():
    assert_expected_inline(
        make_plan("ring", 4, causal=True).table(),
        """\
rank | step 0        step 1        step 2        step 3
   0 | all/all c     -             -             -
   1 | all/all c     all/all       -             -
   2 | all/all c     all/all       all/all       -
   3 | all/all c     all/all       all/all       all/all""",
    )


def test_zigzag_table():
    assert_expected_inline(
        make_plan("zigzag", 4, causal=True).table(),
        """\
rank | step 0        step 1        step 2        step 3
   0 | all/all c     hi/all        hi/all        hi/all
   1 | all/all c     all/lo        hi/all        hi/all
   2 | all/all c     all/lo        all/lo        hi/all
   3 | all/all c     all/lo        all/lo        all/lo""",
    )


def test_stripe_table():
    assert_expected_inline(
        make_plan("stripe", 3, causal=True).table(),
        """\
rank | step 0        step 1        step 2
   0 | all/all c     tail/head c   tail/head c
   1 | all/all c     all/all c     tail/head c
   2 | all/all c     all/all c     all/all c""",
    )


def test_ring_noncausal_table():
    assert_expected_inline(
        make_plan("ring", 3, causal=False).table(),
        """\
rank | step 0        step 1        step 2
   0 | all/all       all/all       all/all
   1 | all/all       all/all       all/all
   2 | all/all       all/all       all/all""",
    )


WINDOWS = [None, (0, 0), (1, 0), (3, 0), (4, 0), (5, 0), (9, 0), (2, 3), (0, -1), (-1, 2)]


def _visible(q_pos: int, k_pos: int, causal: bool, window) -> bool:
    left, right = window or (-1, -1)
    right = 0 if causal else right
    return (left < 0 or k_pos >= q_pos - left) and (right < 0 or k_pos <= q_pos + right)


@pytest.mark.parametrize(
    "layout,causal", [("ring", True), ("zigzag", True), ("stripe", True), ("ring", False)]
)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("window", WINDOWS)
def test_every_query_meets_every_visible_key_once(layout, causal, world_size, window):
    """Replay the plan on global token indices and compare with the (windowed) mask."""
    n = 4  # local tokens (even, for zigzag)
    S = n * world_size
    plan = make_plan(layout, world_size, causal, window, n if window else None)
    seen = set()
    for rank, row in enumerate(plan.steps):
        q_idx = token_indices(layout, S, rank, world_size).tolist()
        for step in row:
            kv_idx = token_indices(layout, S, step.src, world_size).tolist()
            for block in step.blocks:
                q0, q1 = block.q.bounds(n)
                k0, k1 = block.kv.bounds(n)
                lo, hi = block.band(n)
                if block.window is not None:  # FlashAttention-2's dense op takes it as it is
                    s_q, s_k = q1 - q0, k1 - k0
                    got = flash2_visible(s_q, s_k, s_q, s_k, False, block.window)
                    assert torch.equal(got, window_mask(s_q, s_k, block.window, "cpu")), block
                rows = set()
                for i in range(q0, q1):
                    for j in range(k0, k1):
                        if not lo <= (j - k0) - (i - q0) <= hi:
                            continue
                        pair = (q_idx[i], kv_idx[j])
                        assert pair not in seen, f"{pair} computed twice"
                        assert _visible(*pair, causal, window), f"{pair} is masked but computed"
                        seen.add(pair)
                        rows.add(i)
                assert len(rows) == q1 - q0, f"{block}: a row sees no key (kernels need one)"
    expected = {(p, k) for p in range(S) for k in range(S) if _visible(p, k, causal, window)}
    assert seen == expected


@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe"])
@pytest.mark.parametrize("window", WINDOWS)
def test_step0_init_blocks_cover_every_query_once(layout, window):
    """The engine initialises its accumulators from step 0's ``init`` blocks."""
    n = 6
    for w in range(1, 6):
        for row in make_plan(layout, w, True, window, n if window else None).steps:
            rows = [i for b in row[0].blocks if b.init for i in range(*b.q.bounds(n))]
            assert sorted(rows) == list(range(n))
            assert not any(b.init for st in row[1:] for b in st.blocks)
    if window is None:
        assert make_plan(layout, 3, True).steps[1][0].blocks == (
            Block(Part.ALL, Part.ALL, True, init=True),
        )


def test_windowed_ring_table():
    assert_expected_inline(
        make_plan("ring", 4, True, (5, 0), 8).table(),
        """\
rank | step 0           step 1
   0 | 0:8/0:8 w(5,0)   -
   1 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)
   2 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)
   3 | 0:8/0:8 w(5,0)   0:5/3:8 w(0,-1)""",
    )


def test_windowed_zigzag_table():
    """A small window under zigzag needs offsets 0, 1 and W - 1 (see Note [Direct exchange])."""
    assert_expected_inline(
        make_plan("zigzag", 4, True, (3, 0), 8).table(),
        """\
rank | step 0                               step 1                               step 3
   0 | 0:4/0:4 c+4:8/4:8 c                  -                                    4:7/5:8 w(0,-1)
   1 | 0:4/0:4 c+4:8/4:8 c                  0:3/1:4 w(0,-1)                      4:7/5:8 w(0,-1)
   2 | 0:4/0:4 c+4:8/4:8 c                  0:3/1:4 w(0,-1)                      4:7/5:8 w(0,-1)
   3 | 0:4/0:4 c+4:8/4:8 c+4:7/1:4 w(0,-1)  0:3/1:4 w(0,-1)                      -""",
    )


def test_window_cost_grows_with_the_window_not_the_sequence():
    """Ring, causal, W = 8, 1024 tokens a rank: transfers and FLOPs track the window."""
    n, W = 1024, 8
    full = make_plan("ring", W, True)
    rows = []
    for left in (0, 512, 1024, 2048, 4096, 8191):
        plan = make_plan("ring", W, True, (left, 0), n)
        rows.append((plan.kv_transfers(), max(plan.flops(n))))
    transfers, flops = zip(*rows, strict=True)
    assert transfers == (0, 1, 1, 2, 4, 7)
    assert list(flops) == sorted(flops) and flops[-1] == max(full.flops(n))
    assert full.kv_transfers() == W - 1 and full.full_ring
    assert not make_plan("ring", W, True, (512, 0), n).full_ring


def test_band_pairs_matches_brute_force():
    for s_q, s_k in [(1, 1), (3, 5), (5, 3), (4, 4)]:
        for lo in range(-7, 7):
            for hi in range(lo - 1, 8):
                brute = sum(lo <= j - i <= hi for i in range(s_q) for j in range(s_k))
                assert band_pairs(s_q, s_k, lo, hi) == brute, (s_q, s_k, lo, hi)


def test_normalize_window():
    assert normalize_window((-1, -1), True, 100) == (True, None)
    assert normalize_window((-1, 0), False, 100) == (True, None)  # flash-attn: (-1, 0) is causal
    assert normalize_window((10, 5), True, 100) == (True, (10, 0))  # causal sets right = 0
    assert normalize_window((99, 99), False, 100) == (False, None)  # covers the sequence
    assert normalize_window((3, -1), False, 100) == (False, (3, -1))
    for bad in [(-2, 0), (1.5, 0), (1,), "ab", (True, 0)]:
        with pytest.raises(ValueError, match="window_size"):
            normalize_window(bad, True, 100)


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
    with pytest.raises(ValueError, match="seq_local"):
        make_plan("ring", 2, True, (3, 0))


@pytest.mark.parametrize("n_docs", [3, 9])
@pytest.mark.parametrize("window", [None, (40, 0)])
def test_equal_parts_of_a_plan_are_one_object(n_docs, window):
    """The engine takes the queries' side of a part once a call, by the part's identity:
    a plan's equal parts (placed documents, whose query spans recur step after step; windowed
    plans) are one object, so equal parts are taken once."""
    W, n = 4, 64
    lengths = [n * W // n_docs] * (n_docs - 1)
    bounds = [0, *itertools.accumulate(lengths), n * W]
    plans = [varlen_plan((), document_layout(bounds, W), W, True, window)]
    plans.append(make_plan("zigzag", W, True, window or (40, 0), n))
    for plan in plans:
        parts = [p for row in plan.steps for st in row for b in st.blocks for p in (b.q, b.kv)]
        by_value: dict = {}
        for p in parts:
            assert by_value.setdefault(p, p) is p, p
        assert len(by_value) < len(parts)  # some recur: the test sees what it checks
