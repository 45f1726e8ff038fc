"""The varlen ``dtensor_ring::`` custom ops: ring/zigzag varlen and llama3 all-gather attention.

Built like ``ops.py``: each op is followed by its fake (shapes only) and autograd links forward
and backward with ``register_autograd``; the process group travels by name, so Dynamo treats
the ops as opaque. Outputs are fresh contiguous tensors: ``out [T_local, H, D]`` in the input
dtype and ``lse [H, T_local]`` in the accumulation dtype, without gradient.

The ops check their inputs themselves (every rank, before any communication), including the
*values* of the ``cu_seqlens`` tensors, which needs them on the host: a CPU tensor is read
directly; a GPU tensor is copied once (a sync) and then cached on its identity and version
(``varlen.host_values``), so the backward and later layers reuse it. Running the checks inside
the op keeps data-dependent reads out of the traced graph under ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._compat import resolve_group
from .comm import backward_exchangers, forward_exchanger
from .engine import ring_backward, ring_forward
from .kernels import BlockKernel, KernelCall, accumulation_dtype, select_kernel
from .llama3 import Llama3Meta, check_llama3_call, llama3_backward, llama3_forward
from .ops import fake_grads, make_plan_cached, register_attention_autograd
from .validation import normalize_window
from .varlen import VarlenBlocks, check_varlen_qkv, varlen_blocks, windowed_varlen_plan


def _setup_ring(
    q, k, v, cu_seqlens, max_seqlen, group_name, layout, causal, backend, window_left, window_right
):
    group = resolve_group(group_name)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    bounds = check_varlen_qkv(
        q, k, v, cu_seqlens, max_seqlen, layout=layout, causal=causal, world_size=world_size
    )
    # positions within documents: a side covering the whole stream is unbounded in every one
    causal, window = normalize_window((window_left, window_right), causal, q.shape[0] * world_size)
    kernel = select_kernel(KernelCall.of(q, k, varlen=True, window=window is not None), backend)
    if window is None:
        blocks: VarlenBlocks = varlen_blocks(bounds, layout, world_size, causal, q.device)
        plan = make_plan_cached(layout, world_size, causal)
    else:
        plan, blocks = windowed_varlen_plan(
            tuple(bounds), layout, world_size, causal, window, q.device
        )
    return plan, plan.steps[rank], blocks, kernel, group


@torch.library.custom_op("dtensor_ring::ring_attention_varlen", mutates_args=())
def ring_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """Ring/zigzag varlen attention of local ``q [T, H, D]``, ``k, v [T, H_kv, D]``.

    ``cu_seqlens``: int32 local document boundaries (Note [Varlen layouts]); ``window_left/
    right``: a sliding window within documents (Note [Windowed varlen]). -> (out, lse).
    """
    plan, steps, blocks, kernel, group = _setup_ring(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        group_name,
        layout,
        causal,
        backend,
        window_left,
        window_right,
    )
    exchanger = forward_exchanger(group, plan) if plan.world_size > 1 else None
    return ring_forward(q, k.contiguous(), v.contiguous(), steps, exchanger, kernel, scale, blocks)


def _fake_out_lse(q: Tensor) -> tuple[Tensor, Tensor]:
    """Fake ``(out [T, H, D], lse [H, T])`` of a varlen forward for ``q [T, H, D]``."""
    T, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (H, T), dtype=accumulation_dtype(q.dtype)
    )


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
    backend=None,
    window_left=-1,
    window_right=-1,
):
    return _fake_out_lse(q)


@torch.library.custom_op("dtensor_ring::ring_attention_varlen_backward", mutates_args=())
def ring_attention_varlen_backward(
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
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention_varlen`."""
    plan, steps, blocks, kernel, group = _setup_ring(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        group_name,
        layout,
        causal,
        backend,
        window_left,
        window_right,
    )
    kv_exchanger = dkv_exchanger = None
    if plan.world_size > 1:
        kv_exchanger, dkv_exchanger = backward_exchangers(group, plan)
    return ring_backward(
        dout,
        q,
        k.contiguous(),
        v.contiguous(),
        out,
        lse,
        steps,
        kv_exchanger,
        dkv_exchanger,
        kernel,
        scale,
        blocks,
    )


ring_attention_varlen_backward.register_fake(fake_grads)
register_attention_autograd(ring_attention_varlen, ring_attention_varlen_backward, saved_inputs=1)


# --- llama3 ---------------------------------------------------------------------------------


def _setup_llama3(
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
    causal,
    backend,
    window_left,
    window_right,
) -> tuple[Llama3Meta, BlockKernel, dist.ProcessGroup]:
    group = resolve_group(group_name)
    world_size = dist.get_world_size(group)
    causal, window = normalize_window((window_left, window_right), causal, q.shape[0] * world_size)
    meta = check_llama3_call(
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
        causal=causal,
        rank=dist.get_rank(group),
        world_size=world_size,
        window=window,
    )
    kernel = select_kernel(KernelCall.of(q, k, varlen=True, window=window is not None), backend)
    return meta, kernel, group


@torch.library.custom_op("dtensor_ring::llama3_attention", mutates_args=())
def llama3_attention(
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
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """llama3 all-gather attention of local ``q [L, H, D]``, ``k, v [L, H_kv, D]`` -> (out, lse).

    ``cu_seqlens_q/k``, ``max_seqlen_q/k`` and ``local_k_slice = slice(k_start, k_stop)`` as
    returned by ``llama3_flash_attn_prepare_cu_seqlens`` (Note [llama3 all-gather attention]);
    ``window_left/right``: a sliding window within documents.
    """
    meta, kernel, group = _setup_llama3(
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
        causal,
        backend,
        window_left,
        window_right,
    )
    return llama3_forward(q, k, v, meta, heads_k_stride, group, kernel, scale)


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
    causal,
    scale,
    backend=None,
    window_left=-1,
    window_right=-1,
):
    return _fake_out_lse(q)


@torch.library.custom_op("dtensor_ring::llama3_attention_backward", mutates_args=())
def llama3_attention_backward(
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
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`llama3_attention`."""
    meta, kernel, group = _setup_llama3(
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
        causal,
        backend,
        window_left,
        window_right,
    )
    return llama3_backward(dout, q, k, v, out, lse, meta, heads_k_stride, group, kernel, scale)


llama3_attention_backward.register_fake(fake_grads)
register_attention_autograd(llama3_attention, llama3_attention_backward, saved_inputs=2)
