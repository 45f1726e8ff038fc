"""The ``dtensor_ring::`` custom ops: ring attention forward and backward.

Each op is followed by its fake (shapes only, for torch.compile / meta tensors); autograd links
them with ``register_autograd``. The process group travels by name, so the ops' schemas hold
only tensors and primitives and Dynamo treats them as opaque (no graph breaks).

Outputs are fresh contiguous tensors: ``out [B, S, H, D]`` in the input dtype and
``lse [B, H, S]`` in the accumulation dtype (fp32; fp64 for fp64 inputs). ``lse`` carries no
gradient.

The ops trust their arguments: the front doors build them with
:func:`dtensor_ring.resolve.resolve_call` (Note [Call resolution]), whose
``AttentionSpec.op_args()`` are the trailing ``group_name, layout, causal, scale, backend,
window_left, window_right`` (causal and window normalised, the backend resolved).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from .._compat import resolve_group
from ..comm.p2p import backward_exchangers, forward_exchanger
from ..engine.ring import ring_backward, ring_forward
from ..kernels import get_kernel
from ..schedule.plan import Plan, make_plan
from .common import (
    attention_op,
    fake_grads,
    fake_out_lse,
    op_window,
    register_attention_autograd,
    with_sinks,
)


def _setup(
    q: Tensor, group_name: str, layout: str, causal: bool, window_left: int, window_right: int
) -> tuple[Plan, int, dist.ProcessGroup]:
    group = resolve_group(group_name)  # the front door checked that this rank is a member
    window = op_window(window_left, window_right)
    plan = make_plan(layout, group.size(), causal, window, q.shape[1])
    return plan, group.rank(), group


def ring_attention_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Ring attention of local ``q [B, S, H, D]`` and ``k, v [B, S, H_kv, D]`` -> (out, lse).

    ``window_left/right``: the normalised sliding window over global positions (-1, -1: none);
    ``sinks``: optional sink logits ``[H]`` (Note [Attention sinks]).
    """
    plan, rank, group = _setup(q, group_name, layout, causal, window_left, window_right)
    exchanger = forward_exchanger(group, plan) if plan.world_size > 1 else None
    result = ring_forward(q, k, v, plan.steps[rank], exchanger, get_kernel(backend), scale)
    return with_sinks(result, sinks)


ring_attention = attention_op("ring_attention", ring_attention_impl)


@ring_attention.register_fake
def _(
    q, k, v, group_name, layout, causal, scale, backend, window_left=-1, window_right=-1, sinks=None
):
    B, S, H, _ = q.shape
    return fake_out_lse(q, (B, H, S))


def ring_attention_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention` given ``dout`` and its outputs."""
    plan, rank, group = _setup(q, group_name, layout, causal, window_left, window_right)
    kv_exchanger = dkv_exchanger = None
    if plan.world_size > 1:
        kv_exchanger, dkv_exchanger = backward_exchangers(group, plan)
    return ring_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        plan.steps[rank],
        kv_exchanger,
        dkv_exchanger,
        get_kernel(backend),
        scale,
    )


ring_attention_backward = attention_op("ring_attention_backward", ring_attention_backward_impl)


ring_attention_backward.register_fake(fake_grads)
register_attention_autograd(
    ring_attention, ring_attention_backward, ring_attention_impl, ring_attention_backward_impl
)
