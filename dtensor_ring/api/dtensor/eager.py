"""SDPA on DTensors in an eager ``ring_sdpa`` scope: one autograd node on the local shards,
without DTensor's dispatch (Note [Eager SDPA on DTensors]).

Note [Eager SDPA on DTensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The handler path (Note [How SDPA on DTensors reaches ring attention]) pays for generality on
every call: SDPA's kernel choice on the DTensors, DTensor's dispatch of the fused aten op, an
autograd node of that op holding DTensors, ``to_local`` / ``from_local`` nodes, and the
arguments checked twice (scope and handler); on the H200 0.4-0.6 ms of host time a forward
over the functional call (benchmarks/bench_scope_tax.py). In plain eager code none of that is
needed, so the scope's mode, having checked the call, runs it as one ``autograd.Function``:

    F.sdpa(q_dt, k_dt, v_dt) --mode: checked--+-- eager, no other Python mode
                                              |     -> ScopeSDPA: local shards -> engine
                                              |        -> out DTensor (spec made once)
                                              +-- compiling, or a mode active (selective
                                                  checkpointing, FakeTensor, ...)
                                                    -> SDPA -> fused aten op -> handler
                                                    (eager, SDPA without a fused kernel for
                                                     the inputs: the eager route instead)

Both routes run the same resolution (in the forward and again in the backward, as the
stateless backward handler must) and the same engine calls (``handlers.local_forward`` /
``local_backward``), so results and communication are the same bit for bit, whichever route a
rank takes: the route depends on a rank-local fact (a Python mode), and ranks on different
routes must still meet in the same collectives (the adversarial ``rank_local`` kind's
``python_mode`` cases; the first version resolved only in the forward, and ranks on different
routes crashed gloo or hung). For the same reason a call sent to the handlers for which SDPA
finds no fused kernel (its error comes before our handler) runs the eager route rather than
raise on this rank alone; compiled code, the same on every rank, still gets SDPA's error.
The route starts before the dispatcher, so it applies what the dispatcher's autocast layer
would to SDPA's inputs (its lower-precision policy; the first version computed in fp32 under
``torch.autocast``, where SDPA computes in the autocast dtype).
The route is the same for a checkpoint's forward and its recomputation (an eager
recomputation re-enters the mode, Note [Recomputation outside the scope]; a selective
checkpoint's mode is active in both), so their saved tensors match. The backward is ours and
needs no handler; the scope's contract holds on both routes (the mode hooks the output:
``ValueError`` for a backward outside a scope of the same configuration), and it is first-order
only (Note [First-order backward]).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..._compat import dtensor as _dtensor_compat
from ...ops.common import check_first_order
from .function import SDPAConfig
from .handlers import local_backward, local_forward, resolve_local
from .placements import swap_seq_heads, to_op_layout


class ScopeSDPA(torch.autograd.Function):
    """Checked SDPA on DTensors ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` (Shard(2) on mesh
    dim ``cp_dim``) -> ``out [B, H, S, D]`` with ``q``'s placements."""

    @staticmethod
    def forward(
        ctx,
        config: SDPAConfig,
        cp_dim: int,
        group_name: str,
        is_causal: bool,
        scale: float | None,
        query: DTensor,
        key: DTensor,
        value: DTensor,
    ) -> DTensor:
        q, k, v = to_op_layout(query.to_local(), key.to_local(), value.to_local())
        ctx.resolution = (config, is_causal, scale, group_name, query.device_mesh.size(cp_dim))
        out, lse = local_forward(q, k, v, *resolve_local(q, k, v, *ctx.resolution))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.placements = query.device_mesh, query.placements
        return _dtensor_compat.wrap_local(swap_seq_heads(out), ctx.mesh, ctx.placements)

    @staticmethod
    def backward(ctx, dout: DTensor) -> tuple[DTensor | None, ...]:
        check_first_order()
        q, k, v, out, lse = ctx.saved_tensors
        mesh, placements = ctx.mesh, ctx.placements
        if dout.placements != placements:
            dout = dout.redistribute(mesh, placements)
        dout_l = swap_seq_heads(dout.to_local())
        # resolved again, as the backward handler does: the same collectives (the header,
        # "auto"'s agreement) on every rank, whichever route each took
        spec, r = resolve_local(q, k, v, *ctx.resolution)
        grads = local_backward(dout_l, q, k, v, out, lse, spec, r)
        wrapped = tuple(
            _dtensor_compat.wrap_local(
                _strided_like(swap_seq_heads(g), swap_seq_heads(x)), mesh, placements
            )
            if needed
            else None
            for g, x, needed in zip(grads, (q, k, v), ctx.needs_input_grad[-3:], strict=True)
        )
        return (None,) * 5 + wrapped


def _strided_like(grad: Tensor, local: Tensor) -> Tensor:
    """``grad`` in the strides of the input's local shard ``local``: what autograd's gradient
    layout contract asks of a leaf's gradient, made here on the local tensor (a leaf DTensor's
    AccumulateGrad would otherwise restride it through DTensor's dispatch: a ``new_empty_strided``
    and a ``copy_``, ~70 us a gradient on CPU)."""
    if grad.stride() == local.stride():
        return grad
    return torch.empty_like(local).copy_(grad)


def eager_sdpa(
    config: SDPAConfig,
    cp_dim: int,
    group_name: str,
    query: DTensor,
    key: DTensor,
    value: DTensor,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """SDPA on DTensors already checked by the scope (Note [Eager SDPA on DTensors])."""
    query, key, value = _autocast(query, key, value)
    return ScopeSDPA.apply(config, cp_dim, group_name, is_causal, scale, query, key, value)


def _autocast(*inputs: DTensor) -> tuple[DTensor, ...]:
    """The inputs as autocast would hand them to SDPA (its lower-precision policy: floating
    inputs other than fp64 in the autocast dtype). The route starts before the dispatcher,
    whose autocast layer the handler route passes through; without this the route computed
    in fp32 where SDPA (one device, or the handlers) computes in the autocast dtype."""
    device_type = inputs[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return inputs
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x for x in inputs
    )
