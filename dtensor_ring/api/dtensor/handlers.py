"""SDPA aten-op handlers, installed by ``ring_sdpa`` in DTensor's (private) handler table
(Note [How SDPA on DTensors reaches ring attention])."""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..._compat import aten_op, require_aten_op
from ..._compat import dtensor as _dtensor_compat
from ...algorithm import Route
from ...consistency import comparing
from ...ops.common import call_attention, check_first_order
from ...resolve import AttentionSpec, placement
from ...resolved import Remembered, scalar_key, tensor_key, versions
from .function import ALGORITHM_OPS, SDPAConfig, resolve_sdpa, sdpa_route
from .gather import gather_backward, gather_forward, resolve_gather
from .placements import check_sdpa_args, swap_seq_heads, to_op_layout


# --------------------------------------------------------------------------------------------
# SDPA aten-op handlers, installed by ring_sdpa in DTensor's (private) handler table.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AtenSDPAOps:
    """One family of fused SDPA aten ops (forward and backward) and its lse shape.

    Arguments are bound by schema name, so every family shares one forward and one backward
    handler: ``query, key, value``, ``attn_mask``/``attn_bias``, ``dropout_p``, ``is_causal``,
    ``scale``; backward also ``grad_out``/``grad_out_``, ``out``, ``logsumexp``. Returns beyond
    ``(output, logsumexp)`` / ``(grad_query, grad_key, grad_value)`` are filled per schema type.
    """

    forward: str
    backward: str
    lse_trailing_one: bool = False  # cuDNN's lse is [B, H, S, 1]

    @property
    def available(self) -> bool:
        """Whether this torch has both ops (resolved lazily, ``_compat.aten_op``)."""
        return aten_op(self.forward) is not None and aten_op(self.backward) is not None

    @property
    def forward_op(self) -> torch._ops.OpOverload:
        return require_aten_op(self.forward).default

    @property
    def backward_op(self) -> torch._ops.OpOverload:
        return require_aten_op(self.backward).default


ATEN_SDPA_OPS: tuple[AtenSDPAOps, ...] = (
    AtenSDPAOps(
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    AtenSDPAOps(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"
    ),
    AtenSDPAOps(
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    ),
    AtenSDPAOps(
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        lse_trailing_one=True,
    ),
)


def _first(bound: dict, *names: str):
    """The value of the first of ``names`` that the op has (None if it has none of them)."""
    for n in names:
        if n in bound:
            return bound[n]
    return None


@functools.lru_cache(maxsize=64)
def _unused_output(mesh: DeviceMesh, device: torch.device, position: int) -> DTensor:
    """The replicated empty int64 DTensor returned as output ``position`` of a fused op when
    our backward never reads it (philox seed / offset, debug mask): made once per mesh, device
    and position (outputs stay distinct objects), never written (``DTensor.from_local`` costs
    ~0.1 ms a call)."""
    local = torch.empty(0, dtype=torch.int64, device=device)
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _bind_sdpa_call(
    config: SDPAConfig, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple[dict, tuple[Tensor, Tensor, Tensor], AttentionSpec, Route]:
    """Bind an SDPA aten op's arguments by name, check them, and resolve the call: the bound
    arguments, the local shards in the op layout ``[B, S, H, D]``, the spec, and the route
    (Note [Layouts and algorithms])."""
    a = _dtensor_compat.bind_args(op, args, kwargs)
    query, key, value = a["query"], a["key"], a["value"]
    is_causal = bool(a.get("is_causal", False))
    cp_dim, group_name = check_sdpa_args(
        query,
        key,
        value,
        _first(a, "attn_mask", "attn_bias"),
        float(a.get("dropout_p", 0.0)),
        is_causal,
        True,
        config.layout,
        config.algorithm,
    )
    q, k, v = to_op_layout(query.to_local(), key.to_local(), value.to_local())
    world = query.device_mesh.size(cp_dim)
    spec, r = resolve_local(q, k, v, config, is_causal, a.get("scale"), group_name, world)
    return a, (q, k, v), spec, r


def resolve_local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SDPAConfig,
    is_causal: bool,
    scale: float | None,
    group_name: str,
    world_size: int,
) -> tuple[AttentionSpec, Route]:
    """The route and the call resolution of a checked SDPA call on its local shards in the op
    layout ``[B, S, H, D]``; remembered where nothing in them communicates (below)."""
    key = _local_key(q, k, v, config, is_causal, scale, group_name, world_size)
    resolved = LOCAL_RESOLUTIONS.get(key)
    if resolved is None:
        r = sdpa_route(config, lambda: (q, k, v), is_causal, group_name, world_size)
        resolve = resolve_gather if r.algorithm == "all_gather" else resolve_sdpa
        resolved = resolve(config, r, q, k, v, is_causal, scale, group_name, world_size), r
        if placement(config.layout, config.algorithm)[1] != "auto":  # priced per call
            LOCAL_RESOLUTIONS.put(key, resolved)
    return resolved


# The route and resolution of SDPA calls on local shards (Note [Remembered resolutions]): the
# route's and the resolution's own remembered tables, read through one key of what both read.
LOCAL_RESOLUTIONS = Remembered()


def _local_key(
    q, k, v, config: SDPAConfig, is_causal, scale, group_name: str, world_size: int
) -> tuple | None:
    """What :func:`resolve_local` reads, or None where it must run afresh: compiling, or a call
    whose resolution compares across the group (the consistency mode, a gloo header:
    collectives every call, on every rank)."""
    if torch.compiler.is_compiling() or comparing((group_name,)):
        return None
    scalars = (is_causal, scale, group_name, world_size)
    parts = [tensor_key(t) for t in (q, k, v)] + [scalar_key(x) for x in scalars]
    return None if None in parts else (*parts, config, *versions())


def local_forward(
    q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, r: Route
) -> tuple[Tensor, Tensor]:
    """The routed attention on the local shards ``q [B, S, H, D]``, ``k, v [B, S, H_kv, D]``
    -> ``(out [B, S, H, D], lse [B, H, S])``."""
    if r.algorithm == "all_gather":  # Note [All-gather layouts on DTensors]
        return gather_forward(q, k, v, spec)
    return call_attention(ALGORITHM_OPS[r.algorithm][0], q, k, v, *spec.op_args())


def local_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spec: AttentionSpec,
    r: Route,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`local_forward` (``dout``, ``out`` ``[B, S, H, D]``) -> ``(dq,
    dk, dv)`` shaped like ``(q, k, v)``."""
    if r.algorithm == "all_gather":
        return gather_backward(dout, q, k, v, out, lse, spec)
    op = ALGORITHM_OPS[r.algorithm][1]
    return call_attention(op, dout.contiguous(), q, k, v, out, lse.contiguous(), *spec.op_args())


# Set by the scope around an SDPA call it sends to the handlers: the forward handler marks it
# reached, which tells an error of SDPA's own kernel choice (raised before) from ours.
FORWARD_REACHED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "sdpa_forward_reached", default=None
)


def aten_sdpa_forward_handler(
    config: SDPAConfig, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple:
    """DTensor handler of a fused SDPA forward op (any row of :data:`ATEN_SDPA_OPS`)."""
    reached = FORWARD_REACHED.get()
    if reached is not None:
        reached.append(op)
    family = _family_of()[op]
    a, (q, k, v), spec, r = _bind_sdpa_call(config, op, args, kwargs)
    query, mesh = a["query"], a["query"].device_mesh
    out, lse = local_forward(q, k, v, spec, r)
    if family.lse_trailing_one:
        lse = lse.unsqueeze(-1)
    out_dt = DTensor.from_local(swap_seq_heads(out), mesh, query.placements, run_check=False)
    lse_dt = DTensor.from_local(lse, mesh, query.placements, run_check=False)  # [B, H, S(, 1)]
    results: list[object] = [out_dt, lse_dt]
    S_local = q.shape[1]
    for position, name in enumerate(_dtensor_compat.return_names(op)[2:], start=2):
        if name.startswith("max_"):  # SymInt max_q / max_k
            results.append(S_local)
        elif name.startswith("cum_seq"):  # undefined for dense inputs, as natively
            results.append(None)
        else:  # philox seed/offset, rng_state, unused, debug mask: ignored by our backward
            results.append(_unused_output(mesh, q.device, position))
    return tuple(results)


def aten_sdpa_backward_handler(
    config: SDPAConfig, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple:
    """DTensor handler of a fused SDPA backward op (any row of :data:`ATEN_SDPA_OPS`)."""
    check_first_order(*args, *kwargs.values())  # Note [First-order backward]
    family = _family_of()[op]
    a, (q, k, v), spec, r = _bind_sdpa_call(config, op, args, kwargs)
    mesh, placements = a["query"].device_mesh, a["query"].placements
    dout, out, lse = _first(a, "grad_out", "grad_out_"), a["out"], a["logsumexp"]
    dout, out, lse = (
        t if t.placements == placements else t.redistribute(mesh, placements)
        for t in (dout, out, lse)
    )
    dout_l, out_l = swap_seq_heads(dout.to_local()), swap_seq_heads(out.to_local())
    lse_l = lse.to_local()
    if family.lse_trailing_one:
        lse_l = lse_l.squeeze(-1)
    lse_l = lse_l[..., : q.shape[1]]  # efficient attention pads lse to a multiple of 32
    dq, dk, dv = local_backward(dout_l, q, k, v, out_l, lse_l, spec, r)
    grads = [
        DTensor.from_local(swap_seq_heads(g), mesh, placements, run_check=False)
        for g in (dq, dk, dv)
    ]
    # efficient attention also returns grad_bias: None, as attn_bias is None
    return tuple(grads + [None] * (len(_dtensor_compat.return_names(op)) - 3))


@functools.cache
def _family_of() -> dict[torch._ops.OpOverload, AtenSDPAOps]:
    """``{op: family}`` of the families this torch has (built on first use, not at import)."""
    return {
        op: family
        for family in ATEN_SDPA_OPS
        if family.available
        for op in (family.forward_op, family.backward_op)
    }


@functools.lru_cache(maxsize=64)  # one table per scope configuration: a scope entered per call
def aten_handlers(config: SDPAConfig) -> dict:
    """Handlers for the families this torch has; a family whose ops it lacks is left to SDPA
    (only read: installed into DTensor's table, entry by entry)."""
    handlers = {}
    for family in ATEN_SDPA_OPS:
        if not family.available:
            continue
        handlers[family.forward_op] = functools.partial(aten_sdpa_forward_handler, config)
        handlers[family.backward_op] = functools.partial(aten_sdpa_backward_handler, config)
    return handlers
