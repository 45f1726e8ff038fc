"""What every ``dtensor_ring::`` attention op pair shares: the window argument, fakes, autograd."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from .._compat import python_modes_active
from ..kernels import accumulation_dtype
from ..kernels.merge import add_sinks, sinks_grad


def op_window(window_left: int, window_right: int) -> tuple[int, int] | None:
    """The normalised window an op received as ``window_left, window_right`` (the last of
    ``AttentionSpec.op_args()``; -1, -1: none)."""
    return None if (window_left, window_right) == (-1, -1) else (window_left, window_right)


# Note [Autocast]
# ~~~~~~~~~~~~~~~
# Autocast reaches inside a custom op that has no autocast kernel: the aten ops our
# implementations call (the math kernel's matmuls, ...) would run in the autocast dtype while
# the op's inputs, merges and outputs stay in theirs, and only where autocast happens to be
# on: a rank under ``torch.autocast`` and one outside it computed different blocks of the same
# ring in different precisions (silently: out fp32, blocks bf16), and a compiled call differs
# from an eager one. So every implementation runs with autocast off for its tensors' device
# (:func:`attention_op`, and the eager paths of :func:`register_attention_autograd`): an op
# computes in its inputs' dtype, whatever the caller's autocast state, forward and backward.
# (Inputs an autocast region produced are already in its dtype; fp32 inputs stay fp32, as
# flash-attn's functions would see them.)


def without_autocast(impl: Callable) -> Callable:
    """``impl(x, ...)`` run with autocast off for ``x``'s device (Note [Autocast]); the
    signature (what ``torch.library`` infers the schema from) is ``impl``'s."""

    @functools.wraps(impl)
    def run(first: Tensor, *args: object, **kwargs: object) -> object:
        device_type = first.device.type
        if not torch.is_autocast_enabled(device_type):
            return impl(first, *args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return impl(first, *args, **kwargs)

    return run


def attention_op(name: str, impl: Callable) -> torch.library.CustomOpDef:
    """The custom op ``dtensor_ring::<name>`` implemented by ``impl`` (Note [Autocast])."""
    return torch.library.custom_op(f"dtensor_ring::{name}", mutates_args=())(without_autocast(impl))


def with_sinks(out_lse: tuple[Tensor, Tensor], sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """An attention op's final ``(out, lse)`` with the per-head sink logits ``sinks [H]``
    folded in (Note [Attention sinks]; None: no sinks). The last step of every forward op."""
    return out_lse if sinks is None else add_sinks(*out_lse, sinks)


def fake_out_lse(q: Tensor, lse_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Fake ``(out, lse)`` of an attention forward: ``out`` like ``q`` (contiguous), ``lse`` of
    ``lse_shape`` in the accumulation dtype."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(lse_shape, dtype=accumulation_dtype(q.dtype))


def fake_grads(dout, q, k, v, *args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """The fake of every attention backward op: ``(dq, dk, dv)`` shaped like ``(q, k, v)``."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


# Note [First-order backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Attention's backward is first-order only. Under ``create_graph=True`` autograd runs backward
# functions with grad mode on and records what they compute, so that it can differentiate the
# gradients; ours would leave a graph that is not the derivative: the buffers the collectives
# fill (the ring's K/V and dK/dV, llama3's all-gather and reduce-scatter, the all-to-alls)
# carry no history, so every cross-rank term is missing; ``lse`` is a constant (it has no
# gradient); and the block kernels are either not differentiable (aten's fused backward ops:
# an error, but only at the second backward) or plain torch ops differentiable only locally
# (the math kernel, CPU varlen): a second-order gradient silently wrong even at W = 1. Worse,
# the all-gather would gather K/V that require grad, which gloo can refuse on some ranks only
# ("a view created in no_grad mode ... modified inplace") while the others wait.
#
# So every backward function of attention starts with :func:`check_first_order`, which raises
# when grad mode is on (in a backward: ``create_graph=True``), before any communication:
#
#     register_attention_autograd   every attention op pair, eager and custom-op paths
#     ulysses_all_to_all's backward  (linear, but only ever part of attention: raising there
#                                    saves an all-to-all before the attention op raises)
#     _SinksOfRows                   the sinks of Ulysses and hybrid (ops/ulysses.py)
#     the ring_sdpa scope's SDPA backward handler (below autograd, same grad mode; called
#                                    directly, it raises only for inputs that require grad)
#
# Every rank runs the same graph, so every rank raises the same error at the same node.
# Compiled code does not run these functions at run time: AOTAutograd runs its traced backward
# without grad mode and raises its own error at the second backward (on every rank as well).

DOUBLE_BACKWARD = (
    "dtensor_ring attention does not support double backward (create_graph=True through "
    "attention): its backward communicates and is first-order only. Differentiate through "
    "attention once (create_graph=False), or keep attention out of the part of the graph that "
    "is differentiated twice"
)


def check_first_order(*inputs: object) -> None:
    """Raise ``RuntimeError`` when a backward of attention runs with grad mode on, i.e. under
    ``create_graph=True`` (Note [First-order backward]). With ``inputs`` (a backward op's
    handler, which may also be called directly, outside a backward): only when one of them is
    a tensor that requires grad, i.e. when autograd would record the call."""
    if torch.is_grad_enabled() and (
        not inputs or any(isinstance(t, Tensor) and t.requires_grad for t in inputs)
    ):
        raise RuntimeError(DOUBLE_BACKWARD)


# Note [Eager calls]
# ~~~~~~~~~~~~~~~~~~
# The ``dtensor_ring::`` custom ops are what torch.compile, DTensor, FakeTensor and Python
# dispatch modes see. In plain eager mode on plain tensors their dispatch layers (the autograd
# wrapper, the backend wrapper, schema-driven argument handling) are pure host time, and at
# small sizes more than the attention itself (benchmarks/bench_overhead.py). There,
# :func:`call_attention` runs the op's implementation through an ``autograd.Function`` with the
# op's own ``setup_context`` and backward (the backward implementation, not the backward op):
#
#     front door --call_attention(op, q, k, v, ...)--+-- eager, plain tensors, no Python mode
#                                                    |     -> EagerAttention.apply -> impl
#                                                    |        (no graph to record: impl)
#                                                    +-- otherwise -> op (custom op dispatch)
#
# The DTensor handlers (which run below autograd on local shards) call both ops this way, and
# decoding (an inference op, no autograd) its implementation. Where no graph is recorded (grad
# mode off, as in the scope's own ``autograd.Function``, or no input that requires grad) the
# forward runs its implementation without the ``autograd.Function`` (~10 us of host time).
#
# Same code, same saved tensors, same results; "otherwise" is compiling, a tensor subclass
# (DTensor, FakeTensor, functional tensors) or an active TorchDispatchMode / TorchFunctionMode
# (e.g. selective activation checkpointing, which must see the op).

_EAGER: dict[object, object] = {}  # forward op -> autograd.Function; backward op -> its impl


def register_attention_autograd(
    forward_op, backward_op, forward_impl, backward_impl, saved_inputs: int = 0
) -> None:
    """Autograd of an attention op pair of the shape every ``dtensor_ring::`` op has, for the
    op and for its eager path (Note [Eager calls]).

    ``forward_op(q, k, v, *meta, *args, sinks) -> (out, lse)`` and
    ``backward_op(dout, q, k, v, out, lse, *meta, *args) -> (dq, dk, dv)``, where ``meta`` are
    the ``saved_inputs`` tensor inputs the backward needs too (e.g. ``cu_seqlens``), ``args``
    are non-tensor inputs and ``sinks`` the optional sink logits ``[H]`` (:func:`with_sinks`);
    ``forward_impl`` / ``backward_impl`` are the functions the ops were made from. ``lse`` is
    marked non-differentiable. The backward op sees the final ``(out, lse)``, sinks included,
    which is all the rows' gradients need; the sinks' own gradient is computed here
    (Note [Attention sinks]). The backward is first-order only (Note [First-order backward]).
    """

    def setup_context(ctx, inputs, output):
        q, k, v, *rest, sinks = inputs
        meta, ctx.args = rest[:saved_inputs], rest[saved_inputs:]
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *meta)

    def backward_with(backward_fn):
        def backward(ctx, dout, _dlse):
            check_first_order()
            q, k, v, out, lse, sinks, *meta = ctx.saved_tensors
            grads = backward_fn(dout, q, k, v, out, lse, *meta, *ctx.args)
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[-1]:
                dsinks = sinks_grad(dout, out, lse, sinks)
            return (*grads, *(None,) * (saved_inputs + len(ctx.args)), dsinks)

        return backward

    forward_op.register_autograd(backward_with(backward_op), setup_context=setup_context)
    params = tuple(inspect.signature(forward_impl).parameters.values())
    forward_impl, backward_impl = without_autocast(forward_impl), without_autocast(backward_impl)

    class EagerAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        backward = staticmethod(backward_with(backward_impl))

    def apply(*inputs):  # defaults filled in, as the op's dispatcher does (sinks last)
        inputs = (*inputs, *(p.default for p in params[len(inputs) :]))
        if not _records_graph(inputs[0], inputs[1], inputs[2], inputs[-1]):
            return forward_impl(*inputs)  # no graph to record: the implementation itself
        return EagerAttention.apply(*inputs)

    _EAGER[forward_op] = apply
    _EAGER[backward_op] = backward_impl  # not differentiable: the implementation itself


def _records_graph(*inputs: object) -> bool:
    """Whether a call on ``inputs`` (q, k, v, sinks) records an autograd graph."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in inputs
    )


def register_inference_op(op, impl) -> None:
    """An op without autograd (decoding): in plain eager mode :func:`call_attention` runs
    ``impl`` itself (Note [Eager calls]); the caller runs it without gradients."""
    _EAGER[op] = without_autocast(impl)


def call_attention(op, *args):
    """``op(*args)`` for a front door or a DTensor handler: in plain eager mode on plain tensors
    a forward op through its ``autograd.Function`` and a backward op or an inference op as its
    implementation, else the custom op itself (Note [Eager calls])."""
    eager = _EAGER.get(op)
    if (
        eager is None
        or torch.compiler.is_compiling()
        or any(isinstance(a, Tensor) and type(a) is not Tensor for a in args)
        or python_modes_active()
    ):
        return op(*args)
    return eager(*args)
