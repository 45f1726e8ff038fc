"""Ulysses (all-to-all) and 2-D hybrid (Ulysses x ring) attention, against the fp64 reference.

Each rank builds the same seeded full-sequence tensors, computes the fp64 reference and its
gradients on the full sequence, takes its shard (the layout's tokens for Ulysses; for the hybrid
the ring shard of the layout, cut contiguously over the Ulysses ranks, written out here
independently of ``hybrid_token_indices``), runs the API and compares out/lse and, after
backward with a random ``dout``, dq/dk/dv.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import layout_indices, random_qkv, reference_attention

import dtensor_ring
from dtensor_ring.api.ulysses import (
    hybrid_flash_attn_func,
    hybrid_shard_local,
    hybrid_token_indices,
    ulysses_flash_attn_func,
    ulysses_flash_attn_kvpacked_func,
    ulysses_flash_attn_qkvpacked_func,
)
from dtensor_ring.schedule.cost import CommVolume, comm_volume

TOL = dict(rtol=1e-10, atol=1e-10)


def _close(name, actual, expected):
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    torch.testing.assert_close(actual.double(), expected, **TOL, msg=lambda m: f"{name}: {m}")


def _run_and_check(call, idx, q, k, v, dout, causal, form="plain", window_size=(-1, -1)):
    """Shard by ``idx``, run ``call`` and compare out/lse/grads with the fp64 reference."""
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = reference_attention(*full, causal=causal, window_size=window_size)
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    loc = [x.index_select(1, idx) for x in (q, k, v)]
    exp_grads = [g.index_select(1, idx) for g in grads_ref]
    if form == "plain":
        leaves = [x.requires_grad_() for x in loc]
        args = leaves
    elif form == "kvpacked":
        leaves = [loc[0].requires_grad_(), torch.stack(loc[1:], dim=2).requires_grad_()]
        args, exp_grads = leaves, [exp_grads[0], torch.stack(exp_grads[1:], dim=2)]
    else:
        leaves = [torch.stack(loc, dim=2).requires_grad_()]
        args, exp_grads = leaves, [torch.stack(exp_grads, dim=2)]
    out, lse, probs = call(*args)
    assert probs is None
    _close("out", out, out_ref.index_select(1, idx))
    _close("lse", lse, lse_ref.index_select(2, idx))
    out.backward(dout.index_select(1, idx))
    for i, (leaf, expected) in enumerate(zip(leaves, exp_grads, strict=True)):
        _close(f"grad{i}", leaf.grad, expected)


def check_ulysses(
    group, layout, causal, H, H_kv, form="plain", S_local=4, B=2, D=8, window_size=(-1, -1)
):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    S = S_local * W
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=W)
    dout = random_qkv(B, S, H, H, D, seed=W + 1)[0]
    fn = {
        "plain": ulysses_flash_attn_func,
        "kvpacked": ulysses_flash_attn_kvpacked_func,
        "qkvpacked": ulysses_flash_attn_qkvpacked_func,
    }[form]

    def call(*args):
        return fn(
            *args,
            causal=causal,
            return_attn_probs=True,
            group=group,
            layout=layout,
            window_size=window_size,
        )

    idx = layout_indices(layout, rank, W, S)
    _run_and_check(call, idx, q, k, v, dout, causal, form, window_size)
    # return_attn_probs=False: out alone, same values
    loc = [dtensor_ring.shard_local(x, layout, rank, W) for x in (q, k, v)]
    out = ulysses_flash_attn_func(*loc, causal=causal, group=group, layout=layout)
    assert isinstance(out, torch.Tensor)


ULYSSES = [
    # (world_size, layout, causal, H, H_kv)
    *[(w, "ring", c, 4, h_kv) for w in (1, 2, 4) for c in (True, False) for h_kv in (4, 2)],
    *[(w, lay, True, 4, h_kv) for w in (2, 4) for lay in ("zigzag", "stripe") for h_kv in (4, 2)],
    (4, "zigzag", False, 4, 2),  # non-causal ignores the layout's order
    (4, "stripe", True, 4, 1),  # MQA: the one K/V head repeated 4 times
    (4, "zigzag", True, 12, 6),  # H_kv = 6 on 4 ranks: repeated twice, 3 K/V heads a rank
]


@pytest.mark.parametrize(
    "world_size, layout, causal, H, H_kv",
    ULYSSES,
    ids=[f"w{w}-{lay}-{'causal' if c else 'full'}-h{h}kv{hk}" for w, lay, c, h, hk in ULYSSES],
)
def test_ulysses(dist_pool, world_size, layout, causal, H, H_kv):
    dist_pool.run(check_ulysses, world_size, layout=layout, causal=causal, H=H, H_kv=H_kv)


ULYSSES_WINDOWS = [
    # (world_size, layout, causal, window_size, H, H_kv)
    (1, "ring", True, (2, 0), 4, 2),
    (2, "zigzag", True, (1, 0), 4, 2),
    (3, "zigzag", True, (4, 0), 6, 3),
    (3, "ring", False, (2, 3), 6, 3),
    (4, "stripe", True, (5, 0), 4, 2),
    (4, "zigzag", False, (3, 1), 4, 2),  # a non-causal window needs token order too
    (2, "ring", False, (-1, 2), 4, 2),
]


@pytest.mark.parametrize("world_size, layout, causal, window_size, H, H_kv", ULYSSES_WINDOWS)
def test_ulysses_window(dist_pool, world_size, layout, causal, window_size, H, H_kv):
    dist_pool.run(
        check_ulysses,
        world_size,
        layout=layout,
        causal=causal,
        H=H,
        H_kv=H_kv,
        window_size=window_size,
    )


@pytest.mark.parametrize("form", ["kvpacked", "qkvpacked"])
def test_ulysses_packed(dist_pool, form):
    dist_pool.run(
        check_ulysses,
        2,
        layout="zigzag",
        causal=True,
        H=4,
        H_kv=4 if form == "qkvpacked" else 2,
        form=form,
    )


def check_heads_error(group):
    q, k, v = random_qkv(1, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="H % 3 == 0"):
        ulysses_flash_attn_func(q, k, v, causal=True, group=group)


def test_ulysses_heads_not_divisible(dist_pool):
    """W=3, H=4: ValueError on every rank, before any communication (no hang)."""
    dist_pool.run(check_heads_error, 3)


# --- hybrid ---------------------------------------------------------------------------------

_GROUPS: dict = {}  # per worker: the 2 x 2 grid, this rank's group of one


def _hybrid_groups():
    """Ulysses groups [0, 1], [2, 3] and ring groups [0, 2], [1, 3] (created once per worker,
    by all 4 ranks in the same order)."""
    if "2x2" not in _GROUPS:
        groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
        g = dist.get_rank()
        _GROUPS["2x2"] = (groups[g // 2], groups[2 + g % 2])
    return _GROUPS["2x2"]


def hybrid_groups(group) -> tuple:
    """(Ulysses group, ring group) for hybrid attention over ``group`` (W ranks): the 2 x 2
    grid on 4 ranks; else Ulysses over ``group`` and a ring of one (this rank alone, a group
    created by this rank only), or ``group`` twice for W = 1."""
    W = dist.get_world_size(group)
    if W == 4:
        return _hybrid_groups()
    if W == 1:
        return group, group
    rank = dist.get_rank()
    if rank not in _GROUPS:
        _GROUPS[rank] = dist.new_group([rank], use_local_synchronization=True)
    return group, _GROUPS[rank]


def check_hybrid(group, layout, causal, H, H_kv, S_local=4, B=1, D=8, window_size=(-1, -1)):
    ulysses_group, ring_group = _hybrid_groups()
    u, U = dist.get_rank(ulysses_group), dist.get_world_size(ulysses_group)
    r, R = dist.get_rank(ring_group), dist.get_world_size(ring_group)
    assert (u, r) == (dist.get_rank() % 2, dist.get_rank() // 2)
    S = S_local * U * R
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=7)
    dout = random_qkv(B, S, H, H, D, seed=8)[0]
    idx = layout_indices(layout, r, R, S).view(U, -1)[u]  # independent of the library
    assert hybrid_token_indices(layout, S, r, R, u, U).tolist() == idx.tolist()
    torch.testing.assert_close(hybrid_shard_local(q, layout, r, R, u, U), q[:, idx])

    def call(*args):
        return hybrid_flash_attn_func(
            *args,
            causal=causal,
            return_attn_probs=True,
            ulysses_group=ulysses_group,
            ring_group=ring_group,
            layout=layout,
            window_size=window_size,
        )

    _run_and_check(call, idx, q, k, v, dout, causal, window_size=window_size)


HYBRID = [
    ("zigzag", True, 4, 4),
    ("zigzag", True, 4, 2),
    ("zigzag", True, 4, 1),
    ("ring", False, 4, 2),
    ("stripe", True, 2, 2),
]


@pytest.mark.parametrize(
    "layout, causal, H, H_kv",
    HYBRID,
    ids=[f"{lay}-{'causal' if c else 'full'}-h{h}kv{hk}" for lay, c, h, hk in HYBRID],
)
def test_hybrid_2x2(dist_pool, layout, causal, H, H_kv):
    dist_pool.run(check_hybrid, 4, layout=layout, causal=causal, H=H, H_kv=H_kv)


@pytest.mark.parametrize(
    "layout, causal, window_size", [("zigzag", True, (3, 0)), ("ring", False, (2, 5))]
)
def test_hybrid_2x2_window(dist_pool, layout, causal, window_size):
    dist_pool.run(
        check_hybrid, 4, layout=layout, causal=causal, H=4, H_kv=2, window_size=window_size
    )


def check_hybrid_errors(group):
    ulysses_group, ring_group = _hybrid_groups()
    groups = dict(ulysses_group=ulysses_group, ring_group=ring_group)
    q, k, v = random_qkv(1, 4, 3, 3, 8)
    with pytest.raises(ValueError, match="H % 2 == 0"):
        hybrid_flash_attn_func(q, k, v, causal=True, **groups)
    q, k, v = random_qkv(1, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="causal"):
        hybrid_flash_attn_func(q, k, v, causal=False, **groups)


def test_hybrid_errors(dist_pool):
    """H % U != 0 and non-causal zigzag raise on every rank before any communication."""
    dist_pool.run(check_hybrid_errors, 4)


def test_hybrid_token_indices_partition():
    for layout in ("ring", "zigzag", "stripe"):
        idx = [hybrid_token_indices(layout, 32, r, 2, u, 4) for r in range(2) for u in range(4)]
        assert sorted(torch.cat(idx).tolist()) == list(range(32))
        assert all(i.numel() == 4 for i in idx)
    with pytest.raises(ValueError, match="does not split"):
        hybrid_token_indices("zigzag", 8, 0, 2, 0, 3)


# --- cost model -----------------------------------------------------------------------------


def test_comm_volume():
    S, H, H_kv, D, b = 1024, 8, 2, 16, 2
    n = S // 4
    ring = comm_volume(S, H, H_kv, D, 4, "ring")
    assert ring == CommVolume(
        3 * 2 * n * H_kv * D * b, 3 * 2 * n * H_kv * D * b + 4 * 2 * n * H_kv * D * 4
    )
    # Ulysses on 4 ranks: K/V heads repeated to 4; 3/4 of q, k, v, out leave the rank.
    uly = comm_volume(S, H, H_kv, D, 4, "ulysses")
    assert uly.forward == uly.backward == 3 * n * D * (2 * H + 2 * 4) * b // 4
    # hybrid degenerates to ring (U = 1) and to Ulysses (U = W)
    assert comm_volume(S, H, H_kv, D, 4, "hybrid", ulysses_size=1) == ring
    assert comm_volume(S, H, H_kv, D, 4, "hybrid", ulysses_size=4) == uly
    assert comm_volume(S, H, H_kv, D, 1, "ulysses") == (0, 0)
    assert comm_volume(S, H, H_kv, D, 1, "ring") == (0, 0)
    # Ulysses volume per rank falls as 1/W; ring's does not
    assert (
        comm_volume(S, H, 8, D, 8, "ulysses").forward
        < comm_volume(S, H, 8, D, 4, "ulysses").forward
    )
    with pytest.raises(ValueError, match="not divisible"):
        comm_volume(S, 4, 4, D, 8, "ulysses")
    with pytest.raises(ValueError, match="mode"):
        comm_volume(S, H, H_kv, D, 4, "tree")


# --- torch.compile ----------------------------------------------------------------------------


def check_compile(group):
    """opcheck of the all-to-all and local-attention ops; fullgraph compile of the front door."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (
        dtensor_ring.shard_local(t, "zigzag", rank, W)
        for t in random_qkv(1, 4 * W, 4, 1, 8, dtype=torch.float32, seed=2)
    )
    ops = torch.ops.dtensor_ring
    for args in [(q.clone().requires_grad_(), group.group_name, 1, 2, True, "zigzag")]:
        result = torch.library.opcheck(ops.ulysses_all_to_all.default, args)
        assert all(r == "SUCCESS" for r in result.values()), result
    qh, kh, vh = (t.clone().requires_grad_() for t in (q, k, v))
    result = torch.library.opcheck(
        ops.ulysses_local_attention.default, (qh, kh, vh, True, 0.3, "cpu_flash")
    )
    assert all(r == "SUCCESS" for r in result.values()), result

    torch._dynamo.reset()

    def f(q, k, v):
        o = ulysses_flash_attn_func(q, k, v, causal=True, group=group, layout="zigzag")
        return ulysses_flash_attn_func(o * 2, k, v, causal=True, group=group, layout="zigzag")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    assert counter.frame_count == 1
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile(dist_pool):
    dist_pool.run(check_compile, 2)
