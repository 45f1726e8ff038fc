"""``backend="autotune"``: per block shape, the backend measured fastest (Note [Autotuned
blocks] in ``kernels/autotune.py``).

1. One process, stand-in kernels of known speed: the faster one is chosen per shape and
   remembered (measured once), results are the chosen kernel's, dense and varlen; the
   fallback serves what no candidate supports; ``deterministic=True`` is refused.
2. On the session's gloo pool, W = 1..4 (3 and 4 in the slow tier): the functional and varlen
   front doors with ``backend="autotune"`` against the fp64 reference, forward and backward.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention, reference_attention_varlen

import dtensor_ring as dr
from dtensor_ring.kernels import KernelCall, get_kernel, select_kernel
from dtensor_ring.kernels.autotune import AutotuneKernel
from dtensor_ring.kernels.cpu import CpuFlashKernel
from dtensor_ring.kernels.math import MathKernel


class _Timed(MathKernel):
    """The math kernel, ``delay`` seconds slower per call, counting its calls."""

    def __init__(self, name: str, delay: float, varlen: bool = True):
        self.name, self.delay, self.calls = name, delay, 0
        self.supports_varlen = varlen

    def _forward(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return super()._forward(*args, **kwargs)

    def _forward_varlen(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return super()._forward_varlen(*args, **kwargs)


def test_fastest_per_shape_is_measured_once_and_used():
    slow, fast = _Timed("slow", 0.01), _Timed("fast", 0.0)
    tune = AutotuneKernel([slow, fast])
    q, k = (
        torch.randn(1, 8, 2, 4, dtype=torch.float64),
        torch.randn(1, 8, 1, 4, dtype=torch.float64),
    )
    out, lse = tune.forward(q, k, k, causal=True, scale=0.5)
    assert tune.chosen[next(iter(tune.chosen))] is fast
    measured = slow.calls, fast.calls
    assert measured[0] == 4  # warm-up + three timed forwards; the backward is not counted
    ref_out, ref_lse = fast.forward(q, k, k, causal=True, scale=0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for _ in range(3):
        tune.forward(q, k, k, causal=True, scale=0.5)
        tune.backward(out, q, k, k, out, lse, causal=True, scale=0.5)
    assert slow.calls == measured[0]  # remembered: no more measuring
    tune.forward(q[:, :4], k[:, :4], k[:, :4], causal=False, scale=0.5)  # a new shape
    assert len(tune.chosen) == 2 and slow.calls == measured[0] + 4
    tune.clear()
    assert not tune.chosen


def test_varlen_and_fallback():
    fast, dense_only = _Timed("fast", 0.0), _Timed("dense_only", 0.0, varlen=False)
    q = torch.randn(12, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    tune = AutotuneKernel([dense_only, fast])
    out, _ = tune.forward_varlen(q, q, q, cu, cu, 8, 8, causal=True, scale=1.0)
    assert list(tune.chosen.values()) == [fast]  # the only able one: not measured
    assert fast.calls == 1
    ref, _ = fast.forward_varlen(q, q, q, cu, cu, 8, 8, causal=True, scale=1.0)
    assert torch.equal(out, ref)
    only_dense = AutotuneKernel([dense_only], fallback=MathKernel())
    varlen_call = KernelCall.of(q, q, varlen=True)
    assert only_dense.unsupported_reason(varlen_call) is None  # the fallback runs it
    assert AutotuneKernel([dense_only]).unsupported_reason(varlen_call) is not None


def test_registered_and_refuses_deterministic():
    assert "autotune" in dr.BACKEND_NAMES and get_kernel("autotune").name == "autotune"
    x = torch.empty(1, 1, 2, 8)
    call = KernelCall.of(x, x)
    assert select_kernel(call).name != "autotune"  # never chosen automatically
    assert select_kernel(call, "autotune").name == "autotune"
    with pytest.raises(ValueError, match="deterministic"):
        select_kernel(KernelCall.of(x, x, deterministic=True), "autotune")
    assert isinstance(get_kernel("autotune").candidates[-1], CpuFlashKernel)


# --- numerics on the pool ---------------------------------------------------------------------


def _against_reference(group: dist.ProcessGroup) -> float:
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(0)
    errors = []
    # dense zigzag: cpu_flash (the only able candidate on CPU for fp32)
    q, k, v = (torch.randn(2, 4 * W, h, 8, generator=gen) for h in (4, 2, 2))
    dout = torch.randn(q.shape, generator=gen)
    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*full, causal=True)
    grads = torch.autograd.grad(ref, full, dout.double())
    leaves = [dr.shard_local(x, "zigzag", rank, W).requires_grad_() for x in (q, k, v)]
    out = dr.zigzag_ring_flash_attn_func(*leaves, causal=True, group=group, backend="autotune")
    out.backward(dr.shard_local(dout, "zigzag", rank, W))
    for got, want in zip((out, *(t.grad for t in leaves)), (ref, *grads), strict=True):
        errors.append((got.double() - dr.shard_local(want, "zigzag", rank, W)).abs().max().item())
    # packed documents: no CPU candidate has varlen, the math fallback runs them
    cu = torch.tensor([0, 4 * W, 8 * W], dtype=torch.int32)
    q, k, v = (torch.randn(8 * W, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention_varlen(*full, cu, causal=True)
    grads = torch.autograd.grad(ref, full, torch.ones_like(ref))
    local = [dr.shard_varlen(x, cu, "zigzag", rank, W) for x in (q, k, v)]
    leaves = [x.requires_grad_() for x, _ in local]
    out = dr.zigzag_ring_flash_attn_varlen_func(
        *leaves, local[0][1], 4, causal=True, group=group, backend="autotune"
    )
    out.sum().backward()
    for got, want in zip((out, *(t.grad for t in leaves)), (ref, *grads), strict=True):
        errors.append((got - dr.shard_varlen(want, cu, "zigzag", rank, W)[0]).abs().max().item())
    return errors


@pytest.mark.parametrize(
    "world_size", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))]
)
def test_against_reference(dist_pool, world_size):
    for err in dist_pool.run(_against_reference, world_size):
        assert max(err) < 1e-5, err
