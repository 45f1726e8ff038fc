"""``algorithm=``: how K/V move, set apart from where tokens live (Note [Layouts and
algorithms] in ``dtensor_ring/algorithm.py``).

1. One process: the alias table, the pairs that run and those that raise.
2. On the pool, against the fp64 reference at W 1-4: every layout with every algorithm that
   can run it (dense and packed), through ``ring_attention_func`` /
   ``ring_varlen_attention_func`` and the ``engine`` each ran (all-gather over contiguous
   "ring" tokens is PyTorch's ALL_GATHER rotation without load balancing).
3. ``algorithm="auto"`` decides from what every rank shares: ranks that differ in every
   rank-local fact (requires_grad, grad mode, the deterministic flag, contiguity) run the same
   algorithm.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from engine_spy import engines_used
from reference import reference_attention, reference_attention_varlen

import dtensor_ring as dr
from dtensor_ring.algorithm import route
from dtensor_ring.resolve import Call, placement

ENGINE = {"ring": "ring", "all_gather": "llama3", "ulysses": "ulysses"}

# --- one process ------------------------------------------------------------------------------


def test_aliases_and_overrides():
    assert placement("llama3_zigzag", None)[1] == "all_gather"
    assert placement("auto", None)[1] == "auto"
    assert placement("zigzag", None)[1] == "ring"
    # an explicit algorithm overrides an alias's; the alias keeps its tokens and its name
    lay, algorithm = placement("llama3_zigzag", "ulysses")
    assert (lay.name, algorithm) == ("llama3_zigzag", "ulysses")
    # a door that runs one algorithm takes an alias's tokens, but not a request to choose
    assert placement("llama3_zigzag", None, allowed=("ulysses",))[1] == "ulysses"
    with pytest.raises(ValueError, match="chosen per call"):
        placement("auto", None, allowed=("ulysses",))
    with pytest.raises(ValueError, match="algorithm='tree' cannot run"):
        placement("ring", "tree")
    with pytest.raises(TypeError, match="algorithm must be a str"):
        placement("ring", 1)


@pytest.mark.parametrize(
    "layout, algorithm, varlen, text",
    [
        ("stripe", "all_gather", False, "runs of consecutive tokens"),
        ("ring", "auto", False, "zigzag-placed tokens"),
        ("stripe", "auto", False, "zigzag-placed tokens"),
        ("zigzag", "ulysses", True, "cannot run this call"),
    ],
)
def test_pairs_that_cannot_run(layout, algorithm, varlen, text):
    q = torch.randn(*((16,) if varlen else (1, 16)), 4, 8)
    allowed = ("ring", "all_gather") if varlen else ("ring", "all_gather", "ulysses")
    with pytest.raises(ValueError, match=text):
        route(Call(q, q, q, "g", 2, layout, True), algorithm, door="t", allowed=allowed)


# --- every pair against the fp64 reference ----------------------------------------------------

# (layout, algorithm, api, causal, window, (B, H, H_kv))
PAIRS = [
    ("ring", "all_gather", "dense", True, (-1, -1), (2, 4, 2)),
    ("ring", "all_gather", "dense", False, (3, 2), (1, 4, 4)),
    ("ring", "all_gather", "varlen", True, (-1, -1), (1, 4, 2)),
    ("ring", "all_gather", "varlen", False, (-1, -1), (1, 4, 1)),
    ("ring", "ulysses", "dense", True, (2, 0), (1, 12, 2)),
    ("zigzag", "all_gather", "dense", False, (-1, -1), (1, 4, 2)),
    ("zigzag", "ulysses", "dense", True, (-1, -1), (2, 12, 4)),
    ("stripe", "ulysses", "dense", False, (-1, -1), (1, 12, 6)),
    ("llama3_zigzag", "ring", "dense", True, (-1, -1), (1, 4, 2)),
    ("auto", "all_gather", "varlen", True, (3, 0), (1, 4, 2)),
    ("zigzag", "ring", "varlen", True, (-1, -1), (1, 4, 4)),
]


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        actual.double(), expected.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}"
    )


def check_pairs(group: dist.ProcessGroup) -> list[set[str]]:
    """Worker body: every :data:`PAIRS` case against the fp64 reference (out, lse, dq, dk,
    dv); returns the engines each ran."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    ran = []
    for n, (layout, algorithm, api, causal, window, (B, H, H_kv)) in enumerate(PAIRS):
        gen = torch.Generator().manual_seed(n)
        lengths = [4 * W, 2 * W] if api == "varlen" else [4 * W]
        shape = (sum(lengths),) if api == "varlen" else (B, lengths[0])
        q, k, v = (
            torch.randn(*shape, h, 8, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv)
        )
        dout = torch.randn(*shape, H, 8, generator=gen, dtype=torch.float64)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        kw = dict(causal=causal, window_size=window)
        if api == "varlen":
            out_ref, lse_ref = reference_attention_varlen(*full, cu, **kw)
        else:
            out_ref, lse_ref = reference_attention(*full, **kw)
        grads = torch.autograd.grad(out_ref, full, dout)
        args = dict(**kw, group=group, return_attn_probs=True, algorithm=algorithm)
        with engines_used() as used:
            if api == "varlen":
                local = [dr.shard_varlen(x, cu, layout, rank, W) for x in (q, k, v, dout)]
                idx = dr.varlen_token_indices(cu, layout, rank, W)
                leaves = [x.requires_grad_() for x, _ in local[:3]]
                out, lse, _ = dr.ring_varlen_attention_func(
                    layout, *leaves, local[0][1], None, **args
                )
                out.backward(local[3][0])
                _close(f"{n} out", out, out_ref[idx])
                _close(f"{n} lse", lse, lse_ref[:, idx])
            else:
                idx = dr.token_indices(layout, lengths[0], rank, W)
                leaves = [dr.shard_local(x, layout, rank, W).requires_grad_() for x in (q, k, v)]
                out, lse, _ = dr.ring_attention_func(layout, *leaves, **args)
                out.backward(dr.shard_local(dout, layout, rank, W))
                _close(f"{n} out", out, out_ref[:, idx])
                _close(f"{n} lse", lse, lse_ref[:, :, idx])
        for name, leaf, grad in zip("qkv", leaves, grads, strict=True):
            _close(f"{n} d{name}", leaf.grad, grad[idx] if api == "varlen" else grad[:, idx])
        ran.append(set(used))
    return ran


@pytest.mark.parametrize(
    "world_size", [2, *(pytest.param(w, marks=pytest.mark.slow) for w in (1, 3, 4))]
)
def test_every_pair_against_reference(dist_pool, world_size):
    for per_rank in dist_pool.run(check_pairs, world_size):
        for (_, algorithm, *_), used in zip(PAIRS, per_rank, strict=True):
            if world_size > 1 or algorithm != "ulysses":  # W = 1 Ulysses: one local kernel
                assert used == {ENGINE[algorithm]}, (algorithm, used)


# --- "auto" decides from shared facts only ----------------------------------------------------


def _rank_local_facts(group: dist.ProcessGroup) -> list[str]:
    """Rank r differs from the others in requires_grad, grad mode, the deterministic flag and
    contiguity; every rank reports the algorithm "auto" ran. The machine's constants make the
    choice differ between pricing a backward and not (all-gather vs ring), so a choice that
    read a rank's requires_grad or grad mode would differ between ranks."""
    rank = dist.get_rank(group)
    W = dist.get_world_size(group)
    ran = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    machine = dr.get_machine()
    try:
        dr.set_machine(dr.Machine(host_fwd_ms=0.01, host_bwd_ms=1.0, latency_ms=0.01))
        torch.use_deterministic_algorithms(rank % 2 == 1, warn_only=True)
        for seq_local in (32, 256):
            x = torch.randn(1, seq_local, 4 * W, 8)
            k = x[..., : 2 * W, :]
            if rank == 0:
                k = k.transpose(1, 2).contiguous().transpose(1, 2)  # other strides
            q = x.clone().requires_grad_(rank == 0)
            with torch.set_grad_enabled(rank != 1), engines_used() as used:
                dr.ring_attention_func("auto", q, k, k, causal=True, group=group)
            ran.append(",".join(sorted(used)))
    finally:
        torch.use_deterministic_algorithms(deterministic)
        dr.set_machine(machine)
    return ran


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_auto_ignores_rank_local_facts(dist_pool, world_size):
    results = dist_pool.run(_rank_local_facts, world_size, timeout_s=120)
    assert all(r == results[0] for r in results), results


def _bad_stride(group: dist.ProcessGroup) -> list[str]:
    """heads_k_stride=None (not a stride) through the all-gather doors, dense and packed."""
    W = dist.get_world_size(group)
    q = torch.randn(1, 4, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    calls = [
        lambda: dr.llama3_zigzag_flash_attn_func(q, q, q, None, causal=True, group=group),
        lambda: dr.llama3_zigzag_flash_attn_varlen_func(
            q[0], q[0], q[0], cu, 4, None, causal=True, group=group
        ),
    ]
    messages = []
    for call in calls:
        with pytest.raises(TypeError, match="heads_k_stride") as info:
            call()
        messages.append(str(info.value))
    assert W >= 1
    return messages


@pytest.mark.parametrize("world_size", [1, 2])
def test_heads_k_stride_is_checked(dist_pool, world_size):
    """A stride that is not an int raises on every rank (the adversarial suite's args kind
    caught None accepted as the default once the algorithm was routed)."""
    dist_pool.run(_bad_stride, world_size)
