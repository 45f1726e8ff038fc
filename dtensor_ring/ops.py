"""The ``dtensor_ring::`` custom ops: ring attention forward and backward.

Each op is followed by its fake (shapes only, for torch.compile / meta tensors); autograd links
them with ``register_autograd``. The process group travels by name, so the ops' schemas hold
only tensors and primitives and Dynamo treats them as opaque (no graph breaks).

Outputs are fresh contiguous tensors: ``out [B, S, H, D]`` in the input dtype and
``lse [B, H, S]`` in the accumulation dtype (fp32; fp64 for fp64 inputs). ``lse`` carries no
gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ._compat import resolve_group
from .comm import backward_exchangers, forward_exchanger
from .engine import ring_backward, ring_forward
from .kernels import KernelCall, accumulation_dtype, select_kernel
from .plan import Plan, make_plan
from .validation import check_qkv, normalize_window

make_plan_cached = functools.lru_cache(maxsize=None)(make_plan)


def _setup(
    q, k, v, group_name, layout, causal, window_left, window_right
) -> tuple[Plan, int, dist.ProcessGroup, bool]:
    check_qkv(q, k, v, layout=layout, causal=causal)
    group = resolve_group(group_name)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    seq_local = q.shape[1]
    causal, window = normalize_window((window_left, window_right), causal, seq_local * world_size)
    plan = make_plan_cached(layout, world_size, causal, window, seq_local if window else None)
    return plan, rank, group, window is not None


@torch.library.custom_op("dtensor_ring::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """Ring attention of local ``q [B, S, H, D]`` and ``k, v [B, S, H_kv, D]`` -> (out, lse).

    ``window_left/right``: flash-attn sliding window over global positions (-1: unbounded).
    """
    plan, rank, group, windowed = _setup(
        q, k, v, group_name, layout, causal, window_left, window_right
    )
    kernel = select_kernel(KernelCall.of(q, k, window=windowed), backend)
    exchanger = forward_exchanger(group, plan) if plan.world_size > 1 else None
    return ring_forward(q, k, v, plan.steps[rank], exchanger, kernel, scale)


@ring_attention.register_fake
def _(q, k, v, group_name, layout, causal, scale, backend=None, window_left=-1, window_right=-1):
    B, S, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (B, H, S), dtype=accumulation_dtype(q.dtype)
    )


@torch.library.custom_op("dtensor_ring::ring_attention_backward", mutates_args=())
def ring_attention_backward(
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
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention` given ``dout`` and its outputs."""
    plan, rank, group, windowed = _setup(
        q, k, v, group_name, layout, causal, window_left, window_right
    )
    kernel = select_kernel(KernelCall.of(q, k, window=windowed), backend)
    kv_exchanger = dkv_exchanger = None
    if plan.world_size > 1:
        kv_exchanger, dkv_exchanger = backward_exchangers(group, plan)
    return ring_backward(
        dout, q, k, v, out, lse, plan.steps[rank], kv_exchanger, dkv_exchanger, kernel, scale
    )


def fake_grads(dout, q, k, v, *args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """The fake of every attention backward op: ``(dq, dk, dv)`` shaped like ``(q, k, v)``."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def register_attention_autograd(forward_op, backward_op, saved_inputs: int = 0) -> None:
    """Autograd of an attention op pair of the shape every ``dtensor_ring::`` op has.

    ``forward_op(q, k, v, *meta, *args) -> (out, lse)`` and
    ``backward_op(dout, q, k, v, out, lse, *meta, *args) -> (dq, dk, dv)``, where ``meta`` are
    the ``saved_inputs`` tensor inputs the backward needs too (e.g. ``cu_seqlens``) and ``args``
    are non-tensor inputs. ``lse`` is marked non-differentiable.
    """

    def setup_context(ctx, inputs, output):
        q, k, v, *rest = inputs
        meta, ctx.args = rest[:saved_inputs], rest[saved_inputs:]
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, *meta)

    def backward(ctx, dout, _dlse):
        grads = backward_op(dout, *ctx.saved_tensors, *ctx.args)
        return (*grads, *(None,) * (saved_inputs + len(ctx.args)))

    forward_op.register_autograd(backward, setup_context=setup_context)


ring_attention_backward.register_fake(fake_grads)
register_attention_autograd(ring_attention, ring_attention_backward)
