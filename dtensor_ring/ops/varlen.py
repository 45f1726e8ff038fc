"""The varlen ``dtensor_ring::`` custom ops: ring/zigzag varlen and llama3 all-gather attention.

Built like ``ops/ring.py``: each op is followed by its fake (shapes only) and autograd links
forward and backward with ``register_autograd``; the process group travels by name, so Dynamo
treats the ops as opaque. Outputs are fresh contiguous tensors: ``out [T_local, H, D]`` in the
input dtype and ``lse [H, T_local]`` in the accumulation dtype, without gradient.

The front doors resolved everything but the *values* of the ``cu_seqlens`` tensors (Note [Call
resolution]); the ops check those themselves when they run (every rank, before any
communication), which keeps data-dependent reads out of traced graphs under ``torch.compile``.
A CPU tensor is read directly; a GPU tensor is copied once (a sync) and then cached on its
identity and version (``layouts.varlen.host_values``), so the backward and later layers reuse
it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from .._compat import resolve_group
from ..comm.all_to_all import RowsAllToAll
from ..comm.p2p import backward_exchangers, forward_exchanger
from ..engine.llama3 import llama3_backward, llama3_forward
from ..engine.placed_gather import placed_backward, placed_forward
from ..engine.ring import ring_backward, ring_forward
from ..engine.varlen_blocks import VarlenBlocks, varlen_blocks
from ..kernels import get_kernel
from ..layouts import get_layout
from ..layouts.varlen import (
    check_local_documents,
    check_max_seqlen,
    check_placed_local,
    read_cu_seqlens,
)
from ..schedule.llama3 import Llama3Meta, gather_meta, llama3_meta
from ..schedule.placed_gather import PlacedGather, placed_gather
from ..schedule.plan import Plan
from ..schedule.varlen import varlen_plan
from .common import (
    attention_op,
    fake_grads,
    fake_out_lse,
    op_window,
    register_attention_autograd,
    with_sinks,
)


def _setup_ring(
    q: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    group_name: str,
    layout: str,
    causal: bool,
    window: tuple[int, int] | None,
) -> tuple[Plan, int, VarlenBlocks, dist.ProcessGroup]:
    """Check the local documents; the plan, this rank, the engine's blocks and the group."""
    group = resolve_group(group_name)
    world_size = dist.get_world_size(group)
    rank, lay = dist.get_rank(group), get_layout(layout, "documents")
    bounds = _local_documents(q, cu_seqlens, max_seqlen, lay, rank, world_size)
    plan = varlen_plan(bounds, lay, world_size, causal, window)
    return plan, rank, varlen_blocks(plan, bounds, q.device), group


def _local_documents(q, cu_seqlens, max_seqlen, lay, rank: int, world_size: int) -> list[int]:
    """This rank's local document boundaries, checked against ``lay`` (a placed layout's own,
    or a per-document layout's share) and ``max_seqlen``."""
    bounds = read_cu_seqlens(cu_seqlens, q.shape[0])
    if lay.varlen == "placed":
        check_placed_local(lay, bounds, rank, world_size)
    else:
        check_local_documents(bounds, lay, world_size)
    check_max_seqlen("max_seqlen", max_seqlen, bounds)
    return bounds


def ring_attention_varlen_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Ring/zigzag varlen attention of local ``q [T, H, D]``, ``k, v [T, H_kv, D]``.

    ``cu_seqlens``: int32 local document boundaries (Note [Varlen layouts]); ``window_left/
    right``: the normalised window within documents (Note [Windowed varlen]). -> (out, lse).
    """
    window = op_window(window_left, window_right)
    plan, rank, blocks, group = _setup_ring(
        q, cu_seqlens, max_seqlen, group_name, layout, causal, window
    )
    exchanger = forward_exchanger(group, plan) if plan.world_size > 1 else None
    kernel = get_kernel(backend)
    k, v = k.contiguous(), v.contiguous()
    result = ring_forward(q, k, v, plan.steps[rank], exchanger, kernel, scale, blocks)
    return with_sinks(result, sinks)


ring_attention_varlen = attention_op("ring_attention_varlen", ring_attention_varlen_impl)


@ring_attention_varlen.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    group_name,
    layout,
    causal,
    scale,
    backend,
    window_left=-1,
    window_right=-1,
    sinks=None,
):
    T, H, _ = q.shape
    return fake_out_lse(q, (H, T))


def ring_attention_varlen_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention_varlen`."""
    window = op_window(window_left, window_right)
    plan, rank, blocks, group = _setup_ring(
        q, cu_seqlens, max_seqlen, group_name, layout, causal, window
    )
    kv_exchanger = dkv_exchanger = None
    if plan.world_size > 1:
        kv_exchanger, dkv_exchanger = backward_exchangers(group, plan)
    k, v = k.contiguous(), v.contiguous()
    steps, kernel = plan.steps[rank], get_kernel(backend)
    return ring_backward(
        dout, q, k, v, out, lse, steps, kv_exchanger, dkv_exchanger, kernel, scale, blocks
    )


ring_attention_varlen_backward = attention_op(
    "ring_attention_varlen_backward", ring_attention_varlen_backward_impl
)


ring_attention_varlen_backward.register_fake(fake_grads)
register_attention_autograd(
    ring_attention_varlen,
    ring_attention_varlen_backward,
    ring_attention_varlen_impl,
    ring_attention_varlen_backward_impl,
    saved_inputs=1,
)


# --- llama3 ---------------------------------------------------------------------------------


def _setup_llama3(
    q: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    k_start: int,
    k_stop: int,
    group_name: str,
    layout: str,
    causal: bool,
    window: tuple[int, int] | None,
) -> tuple[Llama3Meta | PlacedGather, dist.ProcessGroup]:
    """The checked metadata of this rank: the stream layout's (:func:`llama3_meta`), for a
    per-document layout from the local ``cu_seqlens_q`` alone (:func:`gather_meta`), for
    placed documents what this rank fetches and sends (:func:`placed_gather`)."""
    group = resolve_group(group_name)
    lay = get_layout(layout, "varlen")
    if lay.varlen == "placed":
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        _local_documents(q, cu_seqlens_q, max_seqlen_q, lay, rank, world_size)
        return placed_gather(lay, causal, window, rank, q.device), group
    if lay.varlen == "documents":
        meta = gather_meta(
            cu_seqlens_q,
            max_seqlen_q,
            q.shape[0],
            layout,
            causal,
            dist.get_rank(group),
            dist.get_world_size(group),
            q.device,
            window,
        )
        return meta, group
    meta = llama3_meta(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        k_start,
        k_stop,
        q.shape[0],
        causal,
        dist.get_rank(group),
        dist.get_world_size(group),
        q.device,
        window,
    )
    return meta, group


def llama3_attention_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    heads_k_stride: int,
    k_start: int,
    k_stop: int,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """All-gather attention of local ``q [L, H, D]``, ``k, v [L, H_kv, D]`` -> (out, lse).

    ``layout`` "llama3" (the stream): ``cu_seqlens_q/k``, ``max_seqlen_q/k`` and
    ``local_k_slice = slice(k_start, k_stop)`` as returned by
    ``llama3_flash_attn_prepare_cu_seqlens`` (Note [llama3 all-gather attention]). A
    per-document layout ("llama3_zigzag", Note [Balanced all-gather attention]):
    ``cu_seqlens_q`` / ``max_seqlen_q`` are the local ``cu_seqlens`` / ``max_seqlen`` of ring
    varlen, ``cu_seqlens_k`` / ``max_seqlen_k`` / ``k_start`` / ``k_stop`` are ignored (the
    front door passes the same values). Placed documents (a ``document_layout``; Note
    [Gathering what placed documents need]): the same arguments as a per-document layout, the
    local ``cu_seqlens`` the rank's own; each rank fetches only the keys its queries see.
    ``window_left/right``: the normalised window within documents.
    """
    meta, group = _setup_llama3(
        q,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        k_start,
        k_stop,
        group_name,
        layout,
        causal,
        op_window(window_left, window_right),
    )
    kernel = get_kernel(backend)
    if isinstance(meta, PlacedGather):
        exchange = _exchanges(meta, group)[0]
        result = placed_forward(q, k, v, meta, heads_k_stride, exchange, kernel, scale)
    else:
        result = llama3_forward(q, k, v, meta, heads_k_stride, group, kernel, scale)
    return with_sinks(result, sinks)


llama3_attention = attention_op("llama3_attention", llama3_attention_impl)


@llama3_attention.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    heads_k_stride,
    k_start,
    k_stop,
    group_name,
    layout,
    causal,
    scale,
    backend,
    window_left=-1,
    window_right=-1,
    sinks=None,
):
    T, H, _ = q.shape
    return fake_out_lse(q, (H, T))


def llama3_attention_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    heads_k_stride: int,
    k_start: int,
    k_stop: int,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`llama3_attention`."""
    meta, group = _setup_llama3(
        q,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        k_start,
        k_stop,
        group_name,
        layout,
        causal,
        op_window(window_left, window_right),
    )
    kernel = get_kernel(backend)
    if isinstance(meta, PlacedGather):
        args = (meta, heads_k_stride, *_exchanges(meta, group), kernel, scale)
        return placed_backward(dout, q, k, v, out, lse, *args)
    return llama3_backward(dout, q, k, v, out, lse, meta, heads_k_stride, group, kernel, scale)


def _exchanges(meta: PlacedGather, group: dist.ProcessGroup) -> tuple[RowsAllToAll, RowsAllToAll]:
    """The fetch of K/V rows and the return of their dK/dV (Note [Gathering what placed
    documents need])."""
    sizes = (meta.send_splits, meta.recv_splits)
    return (
        RowsAllToAll(group, *sizes, "placed documents all-gather, all-to-all of K/V"),
        RowsAllToAll(group, *reversed(sizes), "placed documents all-gather, return of dK/dV"),
    )


llama3_attention_backward = attention_op(
    "llama3_attention_backward", llama3_attention_backward_impl
)


llama3_attention_backward.register_fake(fake_grads)
register_attention_autograd(
    llama3_attention,
    llama3_attention_backward,
    llama3_attention_impl,
    llama3_attention_backward_impl,
    saved_inputs=2,
)
