"""torch.compile: the ops' registrations, and both front doors compiled without graph breaks.

Tiers, cheapest first (all on the session's gloo worker pool, ``dist_pool``; every worker
compiles, so the compiled cases are few and tiny: CPU inductor compiles are slow):

1. ``torch.library.opcheck`` on ``dtensor_ring::ring_attention`` and its backward op
   (schema, fake tensor, autograd registration, AOT dispatch) on 1 and 2 ranks.
2. ``fullgraph=True`` (a graph break fails the compile) with a counting backend: one frame,
   the op once per attention call, and the same forward and gradients as eager, for
   * the functional API on plain tensors (``zigzag_ring_flash_attn_func``),
   * ``F.scaled_dot_product_attention`` on DTensors with ``ring_sdpa`` entered outside the
     compiled function (aot_eager and inductor; ``mode="ring"`` and ``mode="ulysses"``), also
     checked against an fp64 reference, with no graph break recorded,
   * ``scaled_dot_product_ring_attention`` called inside a compiled, activation-checkpointed
     function (both modes).
3. Scope and compile interplay: entering ``ring_sdpa`` inside a compiled function raises;
   a function compiled inside the scope is recompiled (not reused) outside it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from reference import random_qkv, reference_attention
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import dtensor_ring

OPS = (
    torch.ops.dtensor_ring.ring_attention.default,
    torch.ops.dtensor_ring.ring_attention_backward.default,
)
# ring_sdpa's mode -> the (forward, backward) op pair its SDPA handlers call
MODE_OPS = {
    "ring": OPS,
    "ulysses": (
        torch.ops.dtensor_ring.ulysses_attention.default,
        torch.ops.dtensor_ring.ulysses_attention_backward.default,
    ),
}


def _count(graphs, op) -> int:
    return sum(node.target is op for gm in graphs for node in gm.graph.nodes)


def _max_diff(xs, ys) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------------------------
# 1. opcheck
# --------------------------------------------------------------------------------------------
def _opcheck(group, layout):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(1, 4 * W, 2, 1, 8, dtype=torch.float32, seed=0)
    q, k, v = (dtensor_ring.shard_local(t, layout, rank, W).requires_grad_() for t in (q, k, v))
    name = group.group_name
    fwd_args = (q, k, v, name, layout, True, 0.35, "cpu_flash")
    results = {"forward": torch.library.opcheck(OPS[0], fwd_args)}
    out, lse = OPS[0](*[a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    bwd_args = (
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out,
        lse,
        name,
        layout,
        True,
        0.35,
        "cpu_flash",
    )
    results["backward"] = torch.library.opcheck(OPS[1], bwd_args)
    return results


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_opcheck(dist_pool, world_size):
    for results in dist_pool.run(_opcheck, world_size, layout="zigzag"):
        for which, result in results.items():
            assert all(v == "SUCCESS" for v in result.values()), (which, result)


# --------------------------------------------------------------------------------------------
# 2. fullgraph compiles
# --------------------------------------------------------------------------------------------
def _functional(group, backend):
    torch._dynamo.reset()
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(1, 8 * W, 4, 2, 8, dtype=torch.float32, seed=2)
    q, k, v = (dtensor_ring.shard_local(t, "zigzag", rank, W) for t in (q, k, v))

    def f(q, k, v):
        o = dtensor_ring.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
        return dtensor_ring.zigzag_ring_flash_attn_func(o * 2, k, v, causal=True, group=group)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    results = []
    torch._dynamo.utils.warn_once_cache.clear()  # Dynamo warns once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (f, compiled):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.sum().backward()
            results.append([out, *(t.grad for t in leaves)])
    return {
        "frames": counter.frame_count,
        "ops": _count(counter.graphs, OPS[0]),
        "diff": _max_diff(*results),
        # e.g. Dynamo's warning about tracing through a functools.cache of ours
        "our warnings": [str(w.message) for w in caught if "dtensor_ring" in str(w.message)],
    }


def _two_attentions(attend, q, k, v):
    o = attend(q, k, v)
    o = attend(o.sin(), k, v)
    return o * 2


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _reference_sdpa(q, k, v):
    """fp64 ``reference_attention`` on ``[B, H, S, D]`` tensors."""
    out, _ = reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    return out.transpose(1, 2)


def _dtensor_sdpa(group, backend, mode):
    """F.sdpa on DTensors, ``ring_sdpa(mode=mode)`` entered outside the compiled function."""
    torch._dynamo.reset()
    counters.clear()
    mesh = DeviceMesh.from_group(group, "cpu")
    W = mesh.size()
    full = [
        t.transpose(1, 2) for t in random_qkv(1, 8 * W, 4, 2, 8, dtype=torch.float32, seed=3)
    ]  # H = 4: divisible by W for Ulysses
    q, k, v = (dtensor_ring.shard_sequence(t, mesh, seq_dim=2, layout="zigzag") for t in full)

    def f(q, k, v):
        return _two_attentions(_sdpa, q, k, v)

    graphs = {"forward": [], "backward": []}

    def keep(which):
        def compiler(gm, example_inputs):
            graphs[which].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    if backend == "aot_eager":  # aot_eager, keeping AOTAutograd's graphs to count our ops
        backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    results = []
    with dtensor_ring.ring_sdpa(layout="zigzag", mode=mode):
        for fn in (f, compiled):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.sum().backward()
            results.append(
                [
                    dtensor_ring.unshard_sequence(t, seq_dim=2, layout="zigzag")
                    for t in (out, *(t.grad for t in leaves))
                ]
            )
    leaves = [t.detach().double().requires_grad_() for t in full]
    out = _two_attentions(_reference_sdpa, *leaves)
    out.sum().backward()
    reference = [out, *(t.grad for t in leaves)]
    fwd_op, bwd_op = MODE_OPS[mode]
    return {
        "frames": counter.frame_count,
        "diff": _max_diff(*results),
        "reference_diff": _max_diff(results[1], reference),
        "graph_breaks": sum(counters["graph_break"].values()),
        "forward_ops": _count(graphs["forward"], fwd_op),
        "backward_ops": _count(graphs["backward"], bwd_op),
    }


def _direct_checkpointed(group, backend, mode):
    """``scaled_dot_product_ring_attention`` in a compiled, checkpointed function."""
    torch._dynamo.reset()
    mesh = DeviceMesh.from_group(group, "cpu")
    W = mesh.size()
    q, k, v = random_qkv(1, 8 * W, 4, 4, 8, dtype=torch.float32, seed=4)
    q, k, v = (
        dtensor_ring.shard_sequence(t.transpose(1, 2), mesh, seq_dim=2, layout="stripe")
        for t in (q, k, v)
    )

    def block(q, k, v):
        o = dtensor_ring.scaled_dot_product_ring_attention(
            q.cos(), k, v, is_causal=True, layout="stripe", mode=mode
        )
        return o.sin()

    def f(q, k, v):
        return checkpoint(block, q, k, v, use_reentrant=False) * 2

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    results = []
    for fn in (f, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.sum().backward()
        results.append([_full(t) for t in (out, *(t.grad for t in leaves))])
    return {"frames": counter.frame_count, "diff": _max_diff(*results)}


# CPU inductor compiles take seconds: the slow tier.
INDUCTOR = pytest.param("inductor", marks=pytest.mark.slow)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_functional_api_compiles_fullgraph(dist_pool, backend):
    for r in dist_pool.run(_functional, 2, timeout_s=400, backend=backend):
        assert r["frames"] == 1 and r["ops"] == 2, r
        assert r["diff"] < 1e-5, r
        assert not r["our warnings"], r


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_dtensor_sdpa_compiles_fullgraph(dist_pool, backend, mode):
    for r in dist_pool.run(_dtensor_sdpa, 2, timeout_s=400, backend=backend, mode=mode):
        assert r["frames"] == 1 and r["graph_breaks"] == 0, r
        assert r["diff"] < 1e-5 and r["reference_diff"] < 1e-5, r
        if backend == "aot_eager":  # the op once per attention call, forward and backward
            assert r["forward_ops"] == 2 and r["backward_ops"] == 2, r


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_direct_call_compiles_with_activation_checkpointing(dist_pool, mode):
    for r in dist_pool.run(_direct_checkpointed, 2, backend="aot_eager", mode=mode):
        assert r["frames"] == 1 and r["diff"] < 1e-5, r


def _dynamic_sequence_length(group, direct):
    """Two sequence lengths through one ``fullgraph`` function: the second call recompiles
    with a symbolic sequence length (Dynamo's automatic dynamic shapes)."""
    torch._dynamo.reset()
    counters.clear()
    mesh = DeviceMesh.from_group(group, "cpu")
    W = mesh.size()

    def attend(q, k, v):
        if direct:
            return dtensor_ring.scaled_dot_product_ring_attention(
                q, k, v, is_causal=True, enable_gqa=True, layout="zigzag", window_size=(5, 0)
            )
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(
        lambda q, k, v: attend(q, k, v).sin(), backend="aot_eager", fullgraph=True
    )
    diffs = []
    for S in (8 * W, 16 * W):
        full = [t.transpose(1, 2) for t in random_qkv(1, S, 4, 2, 8, dtype=torch.float64, seed=S)]
        leaves = [
            dtensor_ring.shard_sequence(t, mesh, seq_dim=2, layout="zigzag")
            .detach()
            .requires_grad_()
            for t in full
        ]
        with dtensor_ring.ring_sdpa(layout="zigzag", window_size=(5, 0)):
            out = compiled(*leaves)
            out.sum().backward()
        got = [
            dtensor_ring.unshard_sequence(t, seq_dim=2, layout="zigzag")
            for t in (out, *(t.grad for t in leaves))
        ]
        ref_leaves = [t.detach().requires_grad_() for t in full]
        ref, _ = reference_attention(
            *(t.transpose(1, 2) for t in ref_leaves), causal=True, window_size=(5, 0)
        )
        ref = ref.transpose(1, 2).sin()
        ref.sum().backward()
        diffs.append(_max_diff(got, [ref, *(t.grad for t in ref_leaves)]))
    return {
        "diff": max(diffs),
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


@pytest.mark.parametrize(
    "direct",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["sdpa_in_scope", "direct_call"],
)
def test_dynamic_sequence_length(dist_pool, direct):
    """A new sequence length recompiles with symbolic sizes, still one graph, no break."""
    for r in dist_pool.run(_dynamic_sequence_length, 2, direct=direct):
        assert r["graph_breaks"] == 0 and r["diff"] < 1e-10, r


def _dynamic_heads(group):
    """Heads and head dim changing between calls of one ``fullgraph`` function: Dynamo makes
    them symbolic after the first recompile, and the kernel choice must still see constants
    (it specialises them: one more recompile per new value, never a graph break)."""
    torch._dynamo.reset()
    counters.clear()
    W = dist.get_world_size(group)

    def attend(q, k, v):
        return dtensor_ring.ring_attention_func("zigzag", q, k, v, causal=True, group=group)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    diffs = []
    for H, H_kv, D in ((4, 2, 8), (6, 3, 16), (2, 1, 4)):
        full = random_qkv(1, 4 * W, H, H_kv, D, dtype=torch.float64, seed=H)
        rank = dist.get_rank(group)
        leaves = [dtensor_ring.shard_local(t, "zigzag", rank, W).requires_grad_() for t in full]
        out = compiled(*leaves)
        out.sum().backward()
        ref_leaves = [t.detach().requires_grad_() for t in full]
        ref, _ = reference_attention(*ref_leaves, causal=True)
        ref.sum().backward()
        want = [
            dtensor_ring.shard_local(t, "zigzag", rank, W)
            for t in (ref, *(t.grad for t in ref_leaves))
        ]
        diffs.append(_max_diff([out, *(t.grad for t in leaves)], want))
    return {"diff": max(diffs), "graph_breaks": sum(counters["graph_break"].values())}


def test_dynamic_heads_and_head_dim(dist_pool):
    for r in dist_pool.run(_dynamic_heads, 2):
        assert r["graph_breaks"] == 0 and r["diff"] < 1e-10, r


# --------------------------------------------------------------------------------------------
# 3. Scope and compile
# --------------------------------------------------------------------------------------------
def _scope_and_compile(group):
    torch._dynamo.reset()
    mesh = DeviceMesh.from_group(group, "cpu")
    q = dtensor_ring.shard_sequence(torch.randn(1, 2, 8, 4), mesh, seq_dim=2, layout="ring")
    found = {}

    def inside(q):
        with dtensor_ring.ring_sdpa(layout="ring"):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    try:
        torch.compile(inside, backend="aot_eager", fullgraph=True)(q)
        found["inside"] = "no error"
    except Exception as e:  # noqa: BLE001 - Dynamo may wrap the RuntimeError
        found["inside"] = "enter dtensor_ring.ring_sdpa outside" in str(e)

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter)
    with dtensor_ring.ring_sdpa(layout="ring"):
        compiled(q)
    try:  # outside the scope, SDPA on DTensors is PyTorch's again (on CPU: no strategy)
        compiled(q)
        found["outside"] = "reused"
    except Exception as e:  # noqa: BLE001 - whatever PyTorch raises while recompiling
        found["outside"] = "recompiled" if "sharding strategy" in str(e) else str(e)
    found["frames"] = counter.frame_count  # the recompile outside failed: still 1
    return found


def test_scope_inside_compile_raises_and_scope_is_guarded(dist_pool):
    for found in dist_pool.run(_scope_and_compile, 2):
        assert found == {"inside": True, "outside": "recompiled", "frames": 1}, found
