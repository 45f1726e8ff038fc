"""All-gather layouts ("llama3_zigzag") in the DTensor path: SDPA on sequence-sharded DTensors
runs the all-gather op, not the ring (Note [All-gather layouts on DTensors]).

Note [All-gather layouts on DTensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The all-gather (``algorithm="all_gather"``, or the alias "llama3_zigzag": zigzag's tokens)
shards DTensors exactly as its layout does (:func:`shard_sequence`, the permuted global view
of Note [DTensor global view of a permuted layout]), but its attention all-gathers K/V
(``dtensor_ring::llama3_attention``, Note [Balanced all-gather attention] in
``engine/llama3.py``) instead of passing them around a ring, for every mask (causal,
non-causal, windowed). That op is varlen: ``[T, H, D]``, no batch dim. As the dense front
door (``llama3_zigzag_flash_attn_func``), every row of the local ``[B, S_local, H, D]`` is one
document of a packed stream: ``[B * S_local, H, D]`` with local ``cu_seqlens = [0, S_local,
2 S_local, ..., B S_local]`` (rank r holds pieces r and 2W-1-r of every row, exactly the
per-document layout's pieces). The fold mixes the batch dim with the sharded sequence dim,
which no DTensor placement describes, so the op runs on the local shards, not on DTensors
through a sharding rule:

* ``ring_sdpa`` scope: the aten handlers (``handlers.py``) call :func:`gather_forward` /
  :func:`gather_backward` on the local shards, as they call the ring op (lse comes back to
  SDPA's ``[B, H, S_local]``);
* :func:`scaled_dot_product_ring_attention`: :func:`gather_sdpa`, i.e. ``to_local`` ->
  ``llama3_zigzag_flash_attn_func`` (its own autograd) -> ``from_local``; gradients flow
  through both (dK/dV come back reduce-scattered: each rank's are its own tokens' whole
  gradients, as ``Shard`` says).

``algorithm="ulysses"`` (all-to-alls) keeps the Ulysses op and treats "llama3_zigzag" as
zigzag's token order.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

from ...algorithm import Route
from ...ops.common import call_attention
from ...ops.varlen import llama3_attention, llama3_attention_backward
from ...resolve import AttentionSpec, Call, Door, resolve_call
from ..attend import rows_as_documents, rows_cu_seqlens, rows_lse
from ..varlen import llama3_zigzag_flash_attn_func
from .placements import swap_seq_heads, to_op_layout


def resolve_gather(
    config,
    r: Route,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float | None,
    group_name: str,
    world_size: int,
) -> AttentionSpec:
    """The call resolution (Note [Call resolution]) of an all-gather SDPA call on the local
    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]``: the folded packed form (a varlen
    kernel)."""
    return resolve_call(
        Call(
            rows_as_documents(q),
            rows_as_documents(k),
            rows_as_documents(v),
            group_name=group_name,
            world_size=world_size,
            layout=r.layout,
            causal=is_causal,
            softmax_scale=scale,
            window_size=config.window_size,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            backend=config.backend,
        ),
        Door(op="sdpa[all_gather]", algorithm="all_gather", form="documents"),
    )


def gather_forward(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    """The all-gather op on local ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]``
    (zigzag's tokens) -> ``(out [B, S_local, H, D], lse [B, H, S_local])``."""
    B, S, H, D = q.shape
    cu = rows_cu_seqlens(B, S)
    out, lse = call_attention(
        llama3_attention,
        rows_as_documents(q),
        rows_as_documents(k),
        rows_as_documents(v),
        cu,
        cu,
        S,
        S,
        1,
        0,
        0,
        *spec.op_args(),
        None,
    )
    return out.view(B, S, H, D), rows_lse(lse, B, S)


def gather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttentionSpec
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`gather_forward`: ``dout, q, out [B, S_local, H, D]``, ``k, v
    [B, S_local, H_kv, D]``, ``lse [B, H, S_local]`` -> ``dq, dk, dv`` shaped like q, k, v."""
    B, S, H, _ = q.shape
    cu = rows_cu_seqlens(B, S)
    with torch.no_grad():  # as under autograd's backward, also when called directly
        grads = call_attention(
            llama3_attention_backward,
            rows_as_documents(dout),
            rows_as_documents(q),
            rows_as_documents(k),
            rows_as_documents(v),
            rows_as_documents(out),
            lse.transpose(0, 1).reshape(H, B * S),
            cu,
            cu,
            S,
            S,
            1,
            0,
            0,
            *spec.op_args(),
        )
    return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v), strict=True))


def gather_sdpa(
    config,
    r: Route,
    query: DTensor,
    key: DTensor,
    value: DTensor,
    is_causal: bool,
    scale: float | None,
    cp_dim: int,
    sinks: Tensor | None,
) -> DTensor:
    """:func:`scaled_dot_product_ring_attention` of an all-gather layout (checked by the
    caller): ``query [B, H, S, D]``, ``key, value [B, H_kv, S, D]`` DTensors -> ``[B, H, S, D]``
    with ``query``'s placements; ``sinks [H]`` a plain tensor (gradient: this rank's share) or a
    DTensor on the mesh (gradient ``Partial``)."""
    mesh = query.device_mesh
    if isinstance(sinks, DTensor):
        sinks = sinks.full_tensor(grad_placements=[Partial()] * sinks.device_mesh.ndim)
    q, k, v = to_op_layout(query.to_local(), key.to_local(), value.to_local())
    out = llama3_zigzag_flash_attn_func(
        q,
        k,
        v,
        r.heads_k_stride,
        softmax_scale=scale,
        causal=is_causal,
        window_size=config.window_size,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        group=mesh.get_group(cp_dim),
        backend=config.backend,
        sinks=sinks,
        layout=r.layout,
    )
    return DTensor.from_local(swap_seq_heads(out), mesh, query.placements, run_check=False)
