"""What every ``dtensor_ring::`` attention op pair shares: the window argument, fakes, autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import accumulation_dtype


def op_window(window_left: int, window_right: int) -> tuple[int, int] | None:
    """The normalised window an op received as ``window_left, window_right`` (the last of
    ``AttentionSpec.op_args()``; -1, -1: none)."""
    return None if (window_left, window_right) == (-1, -1) else (window_left, window_right)


def fake_out_lse(q: Tensor, lse_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Fake ``(out, lse)`` of an attention forward: ``out`` like ``q`` (contiguous), ``lse`` of
    ``lse_shape`` in the accumulation dtype."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(lse_shape, dtype=accumulation_dtype(q.dtype))


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
