"""Layout objects and their registry; a new layout is one class (defined in this file alone).

The toy layout ``halves`` (rank r holds chunk r and chunk W + r of 2W chunks) is registered
here, at import, in the pytest process and in every gloo worker (which import this module to
run its functions). It has no part table, so its plans come from its runs; it then runs end to
end against the fp64 reference on the full sequence, forward and backward, on 1-4 ranks:
ring attention (causal, non-causal, windowed), ring varlen, Ulysses, SDPA on DTensors and the
single-device simulator.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import (
    layout_indices,
    random_qkv,
    reference_attention,
    reference_attention_varlen,
)
from torch.distributed.device_mesh import DeviceMesh

import dtensor_ring
from dtensor_ring.api.functional import ring_attention_func
from dtensor_ring.api.varlen import ring_varlen_attention_func
from dtensor_ring.layouts import (
    Layout,
    TokenLayout,
    get_layout,
    layout_names,
    register_layout,
    unregister_layout,
)
from dtensor_ring.schedule.plan import make_plan


class HalvesLayout(Layout):
    """Rank r holds chunk r of the first half and chunk r of the second half."""

    name = "halves"
    chunks_per_rank = 2
    varlen = "documents"

    def runs(self, seq_local: int, rank: int, world_size: int):
        c = seq_local // 2
        return ((0, c, rank * c), (c, c, (world_size + rank) * c))


register_layout(HalvesLayout())


def halves_indices(rank: int, world_size: int, seq_len: int) -> torch.Tensor:
    """The toy layout's tokens, from its definition (independent of the library)."""
    c = seq_len // (2 * world_size)
    first, second = rank, world_size + rank
    return torch.cat(
        [torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]
    )


TOL = dict(rtol=1e-10, atol=1e-10)


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_and_forms():
    assert set(dtensor_ring.LAYOUTS) <= set(layout_names("dense"))
    assert "halves" in layout_names("documents")
    assert "llama3" in layout_names("varlen") and "llama3" not in layout_names("dense")
    assert get_layout("zigzag") is get_layout(get_layout("zigzag"))
    with pytest.raises(ValueError, match=r"layout='nope' is not a layout; choose one of .*ring"):
        get_layout("nope")
    with pytest.raises(ValueError, match=r"'stripe' is not a varlen layout.*llama3"):
        get_layout("stripe", "varlen")
    with pytest.raises(ValueError, match=r"'llama3' is not a sequence layout"):
        dtensor_ring.token_indices("llama3", 8, 0, 2)
    with pytest.raises(TypeError, match="layout must be a layout name"):
        get_layout(3)


def test_register_conflicts():
    class Other(HalvesLayout):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_layout(Other())
    with pytest.raises(ValueError, match="built-in"):
        unregister_layout("ring")
    with pytest.raises(TypeError, match="Layout instance"):
        register_layout("halves")

    class Temp(HalvesLayout):
        name = "temp"

    register_layout(Temp())
    assert "temp" in layout_names()
    unregister_layout("temp")
    assert "temp" not in layout_names()


@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe", "halves"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_token_indices_partition_and_order(layout, world_size):
    """Every rank's tokens (as the reference defines them), together every token once, and
    ``order``'s inverse restores token order."""
    lay = get_layout(layout)
    S = 2 * world_size * 3
    expected = halves_indices if layout == "halves" else None
    parts = []
    for r in range(world_size):
        idx = lay.token_indices(S, r, world_size)
        want = expected(r, world_size, S) if expected else layout_indices(layout, r, world_size, S)
        assert torch.equal(idx, want), (layout, r, idx, want)
        parts.append(idx)
    order, inverse = lay.order(S, world_size)
    assert torch.equal(torch.cat(parts), order)
    assert torch.equal(order[inverse], torch.arange(S))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 5)])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_toy_plan_covers_the_mask(causal, window, world_size):
    """The toy layout's plan (derived from its runs) computes exactly the visible pairs: every
    query once at step 0 (``init``) and every visible (query, key) pair once overall."""
    if causal and window is not None:
        window = (window[0], 0)
    n = 6
    S = n * world_size
    plan = make_plan("halves", world_size, causal, window, n)
    lay = get_layout("halves")
    seen = torch.zeros(S, S, dtype=torch.int64)
    for r, row in enumerate(plan.steps):
        q_idx = lay.token_indices(S, r, world_size)
        covered = torch.zeros(n, dtype=torch.int64)
        for s, step in enumerate(row):
            k_idx = lay.token_indices(S, step.src, world_size)
            for blk in step.blocks:
                (q0, q1), (k0, k1) = blk.q.bounds(n), blk.kv.bounds(n)
                lo, hi = blk.band(n)
                i = torch.arange(q1 - q0)[:, None]
                j = torch.arange(k1 - k0)[None, :]
                keep = (j - i >= lo) & (j - i <= hi)
                qs, ks = q_idx[q0:q1], k_idx[k0:k1]
                seen[qs[:, None].expand_as(keep)[keep], ks[None, :].expand_as(keep)[keep]] += 1
                if s == 0 and blk.init:
                    covered[q0:q1] += 1
        assert torch.equal(covered, torch.ones(n, dtype=torch.int64)), (r, covered)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = torch.ones(S, S, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    assert torch.equal(seen, visible.long())


def test_toy_simulator_matches_reference():
    W, S = 3, 18
    q, k, v = random_qkv(2, S, 4, 2, 8, seed=3)
    dout = random_qkv(2, S, 4, 4, 8, seed=4)[0]
    for causal in (True, False):
        out, lse, dq, dk, dv = dtensor_ring.simulate_ring(
            q, k, v, dout, layout="halves", world_size=W, causal=causal
        )
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out_ref, lse_ref = reference_attention(*full, causal=causal)
        grads = torch.autograd.grad(out_ref, full, dout)
        torch.testing.assert_close(out, out_ref, **TOL)
        torch.testing.assert_close(lse, lse_ref, **TOL)
        for got, want in zip((dq, dk, dv), grads, strict=True):
            torch.testing.assert_close(got, want, **TOL)


# --- end to end on gloo -------------------------------------------------------------------


def _local(x: torch.Tensor, rank: int, W: int, seq_dim: int = 1) -> torch.Tensor:
    return x.index_select(seq_dim, halves_indices(rank, W, x.shape[seq_dim]))


def check_toy_end_to_end(group: dist.ProcessGroup) -> None:
    """Worker body: ring (causal, non-causal, windowed), Ulysses and SDPA on DTensors with the
    toy layout against the fp64 reference, forward and backward."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    S = 4 * W
    q, k, v = random_qkv(1, S, 12, 6, 8, seed=5)  # 12 heads: Ulysses on 1-4 ranks
    dout = random_qkv(1, S, 12, 12, 8, seed=6)[0]
    cases = [
        ("ring", True, (-1, -1)),
        ("ring", False, (-1, -1)),
        ("ring", True, (2, 0)),
        ("ring", False, (1, 3)),
        ("ulysses", True, (-1, -1)),
        ("ulysses", False, (2, 2)),
        ("dtensor", True, (-1, -1)),
    ]
    for kind, causal, window in cases:
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out_ref, _ = reference_attention(*full, causal=causal, window_size=window)
        grads_ref = torch.autograd.grad(out_ref, full, dout)
        leaves = [
            dtensor_ring.shard_local(x, "halves", rank, W).requires_grad_() for x in (q, k, v)
        ]
        if kind == "ring":
            out = ring_attention_func(
                "halves", *leaves, causal=causal, window_size=window, group=group
            )
        elif kind == "ulysses":
            out = dtensor_ring.ulysses_flash_attn_func(
                *leaves, causal=causal, window_size=window, group=group, layout="halves"
            )
        else:
            mesh = DeviceMesh.from_group(group, "cpu")
            dts = [
                dtensor_ring.shard_sequence(x.transpose(1, 2), mesh, 2, "halves") for x in (q, k, v)
            ]
            dts = [t.detach().requires_grad_() for t in dts]
            out_dt = dtensor_ring.scaled_dot_product_ring_attention(
                *dts, is_causal=causal, enable_gqa=True, layout="halves"
            )
            out_dt.backward(dtensor_ring.shard_sequence(dout.transpose(1, 2), mesh, 2, "halves"))
            out = out_dt.to_local().transpose(1, 2)
            leaves = [t.grad.to_local().transpose(1, 2) for t in dts]
            torch.testing.assert_close(out, _local(out_ref, rank, W), **TOL)
            for got, want in zip(leaves, grads_ref, strict=True):
                torch.testing.assert_close(got, _local(want, rank, W), **TOL)
            continue
        torch.testing.assert_close(out, _local(out_ref, rank, W), **TOL, msg=kind)
        out.backward(_local(dout, rank, W))
        for leaf, want in zip(leaves, grads_ref, strict=True):
            torch.testing.assert_close(leaf.grad, _local(want, rank, W), **TOL, msg=kind)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_toy_layout_end_to_end(dist_pool, world_size):
    dist_pool.run(check_toy_end_to_end, world_size)


def check_toy_varlen(group: dist.ProcessGroup, causal: bool, window: tuple[int, int]) -> None:
    """Worker body: ring varlen in the toy layout (every document cut like a sequence)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    lengths = [2 * W, 6 * W, 4 * W]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = (x[0] for x in random_qkv(1, bounds[-1], 4, 2, 8, seed=7))
    dout = random_qkv(1, bounds[-1], 4, 4, 8, seed=8)[0][0]
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, _ = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    idx = torch.cat(
        [a + halves_indices(rank, W, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    local = [dtensor_ring.shard_varlen(x, cu, "halves", rank, W) for x in (q, k, v)]
    leaves = [x.requires_grad_() for x, _ in local]
    cu_local = local[0][1]
    out = ring_varlen_attention_func(
        "halves", *leaves, cu_local, None, causal=causal, window_size=window, group=group
    )
    torch.testing.assert_close(out, out_ref[idx], **TOL)
    out.backward(dout[idx])
    for leaf, want in zip(leaves, grads_ref, strict=True):
        torch.testing.assert_close(leaf.grad, want[idx], **TOL)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0))])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_toy_layout_varlen(dist_pool, world_size, causal, window):
    dist_pool.run(check_toy_varlen, world_size, causal=causal, window=window)


def test_toy_layout_in_varlen_balance():
    """Registered layouts join the load-balance report; every causal pair counted once."""
    lengths, W = [8, 16, 24], 4
    bounds = [0, 8, 24, 48]
    report = dtensor_ring.varlen_balance(bounds, W, causal=True)
    assert sum(report["halves"]) == sum(n * (n + 1) // 2 for n in lengths)


def test_token_layouts_of_other_world_sizes_are_other_layouts():
    """The same flattened permutation on 1 and 2 ranks: two layouts, two names (a name shared
    by both made the second one's use raise: two layout objects of one name)."""
    one, two = TokenLayout(torch.arange(8)[None]), TokenLayout(torch.arange(8).view(2, 4))
    assert one.name != two.name and one != two
    for layout, world in ((one, 1), (two, 2)):
        assert get_layout(layout) is layout
        shard = dtensor_ring.shard_local(torch.arange(8)[None], layout, 0, world)
        assert shard.shape == (1, 8 // world)
