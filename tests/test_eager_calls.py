"""Note [Eager calls] (``ops/common.py``): in eager mode on plain tensors a front door runs the
op's implementation through an ``autograd.Function`` (with no graph to record, the
implementation alone); everywhere else the custom op itself.
Both give bitwise the same results (world sizes 1-4); the fp64 numerics of every front door
are in the other test modules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtensor_ring as dr
from dtensor_ring.ops.common import call_attention
from dtensor_ring.ops.ring import ring_attention
from tests.modes import PassThroughMode
from tests.reference import random_qkv


def _grads(fn, q, k, v):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    out.backward(torch.ones_like(out))
    return out.grad_fn, [out.detach(), lse, *(t.grad for t in leaves)]


def run_eager_vs_op(group, layout: str) -> list[str]:
    """Worker body: the op and the eager path on this rank's shard; returns the grad_fn names
    (eager, op, under a dispatch mode) after checking the results are bitwise equal."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (
        dr.shard_local(t, layout, rank, W)
        for t in random_qkv(2, 4 * W, 4, 2, 8, dtype=torch.float64, seed=3)
    )
    args = (group.group_name, layout, True, 0.3, "cpu_flash", -1, -1)
    eager_fn, eager = _grads(lambda *t: call_attention(ring_attention, *t, *args), q, k, v)
    op_fn, op = _grads(lambda *t: ring_attention(*t, *args), q, k, v)
    with PassThroughMode():
        mode_fn, _ = _grads(lambda *t: call_attention(ring_attention, *t, *args), q, k, v)
    for a, b in zip(eager, op, strict=True):
        assert torch.equal(a, b)
    # no graph to record (grad mode off; no input requiring grad): the implementation itself,
    # without the autograd.Function, the same results
    applied, apply = [], torch.autograd.Function.apply.__func__
    torch.autograd.Function.apply = classmethod(
        lambda cls, *a: applied.append(cls) or apply(cls, *a)
    )
    try:
        with torch.no_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            no_grad = call_attention(ring_attention, *leaves, *args)
        plain = call_attention(ring_attention, q, k, v, *args)
    finally:
        torch.autograd.Function.apply = classmethod(apply)
    assert not applied, applied
    for result in (no_grad, plain):
        assert all(torch.equal(a, b) for a, b in zip(result, eager[:2], strict=True))
        assert result[0].grad_fn is None
    return [type(f).__name__ for f in (eager_fn, op_fn, mode_fn)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eager_path_equals_the_op(dist_pool, world_size):
    layout = "zigzag" if world_size != 3 else "stripe"
    for names in dist_pool.run(run_eager_vs_op, world_size, layout=layout):
        eager, op, under_mode = names
        assert eager == "EagerAttentionBackward"
        assert op != eager and under_mode != eager, names
