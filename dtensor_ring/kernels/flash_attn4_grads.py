"""flash-attn 4's backward on sm90, taken apart so that a ring gets its block gradients in fp32.

Note [Unrounded block gradients from flash-attn 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ring's dq, dk and dv are sums of W block gradients (Note [Ring backward]). A kernel that
rounds each block's gradient to bf16 before the sum adds W roundings where one device has one.
flash-attn 4's backward holds dq, and for GQA dk and dv, in fp32 accumulators until its last
kernel, the *postprocess*, scales them and rounds them to the input dtype. Here we run its
three kernels ourselves and replace the postprocess by a reorder in fp32:

    _flash_attn_bwd (flash-attn 4)            unrounded_backward (here)
    preprocess: dpsum, lse_log2, dq_acc = 0   the same kernel
    main kernel: dq_acc += ..., dK/dV         the same kernel; dK/dV into fp32 accumulators
                 (GQA: dk_acc += ...)         zeroed by us (GQA) or bf16 (H == H_kv)
    postprocess: bf16(scale * dq_acc)         scale * dq_acc[perm], in place (fp32)

The accumulators are flat fp32 tiles, each ``rows x head_dim_rounded`` values in the order of
the MMA fragments that wrote them, not row-major. That order is the postprocess's to know; we
learn it from the postprocess itself (:func:`tile_order`): run it on one tile whose values
are the bits of their own flat index (0 or 1, exact in bf16 and fp16), once per bit, and read
each output element's index back; then check the order once on a tile of random integers
(a configuration that fails runs the plain backward). Cached per configuration and dtype; the
postprocess is then never run.

    accumulator  [B, H, n_tiles * rows * D_r]   (tile t: rows * D_r values, fragment order)
        -> [B, H, n_tiles, rows * D_r][..., perm]  ->  [B, H, S_r, D_r][:, :, :S, :D]
        -> transpose to [B, S, H, D] (a view: the engine adds it into its accumulator)

On CUDA the reorder is one Triton kernel, in place (``_triton_tiles.py``): no second fp32 copy
of the accumulator. What a block's backward hands back is then the fp32 accumulator where
flash-attn 4 hands back a bf16 copy of it (+64 MiB for dq at 8192 tokens, 32 heads of 128).

Whether a block takes this path (the installed version, the GPU, a graph capture) is a fact of
one rank; it changes what the rank adds, never what it sends: the ring's dK/dV accumulators are
fp32 either way.

Which pieces we call, with which arguments, is copied from ``_flash_attn_bwd`` of
``flash-attn-4==4.0.0b36`` (sm90, dense and varlen; no sinks, score_mod, block sparsity or
dlse): private functions, so :func:`unrounded_reason` accepts only that version and sm90, and
every other case runs the plain ``_flash_attn_bwd``. Checked against fp64 by
``tests/gpu/check_flash_attn4.py`` (dense on an H200; varlen on an H100, Note [A varlen dq
accumulated inside flash-attn 4]); on CPU against a stand-in of those pieces with a known tile
order (``tests/test_kernel_adapters.py``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from .base import capturing
from .flash_attn4_tiles import (
    as_BSHD,
    learnt,
    padded_total,
    postprocess_args,
    round_up,
    tile_order,
    untile_,
)

CHECKED_VERSION = "4.0.0b36"


@functools.cache
def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def unrounded_reason(interface: ModuleType) -> str | None:
    """``None`` when :func:`unrounded_backward` can run with this flash-attn 4 on this device,
    else why not (the plain backward runs then)."""
    version = _installed_version()
    if version != CHECKED_VERSION:
        return f"flash-attn-4 {version} is not {CHECKED_VERSION}, whose internals this uses"
    if interface._get_device_arch() // 10 != 9:
        return "fp32 block gradients are implemented for sm90 only"
    return None


@functools.cache
def _config(interface: ModuleType, head_dim: int, head_dim_v: int, causal: bool, local: bool):
    """flash-attn 4's sm90 backward configuration (``_tile_size_bwd_sm90``) and the head-dim
    rounding of its accumulators."""
    cfg = interface._tile_size_bwd_sm90(head_dim, head_dim_v, causal, local)
    return cfg, (64 if cfg.dKV_swapAB else 32)


@dataclass
class BlockPlan:
    """What a block's shapes and options fix, worked out once per signature (host time)."""

    cfg: object
    multiple: int
    cute_dtype: object
    head_dim: int
    head_dim_v: int
    group: int  # query heads per K/V head
    causal: bool  # as _resolve_causal_local_window resolves the mask
    local: bool
    left: int | None
    right: int | None
    deterministic: bool
    seq_q_r: int
    seq_k_r: int
    hd_r: int
    hdv_r: int
    key: tuple  # of the compiled main kernel
    orders: list[tuple[int, dict]]  # (head dim, postprocess arguments) of dq (dk, dv)
    perms: list[Tensor] | None = None  # their tile orders, once learnt


def _block_plan(
    iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic, tiles, seqlens
):
    causal, local, left, right = iface._resolve_causal_local_window(
        causal, window_size_left, window_size_right
    )
    num_head, head_dim = q.shape[-2:]
    num_head_kv, head_dim_v = k.shape[-2], v.shape[-1]
    seqlen_q, seqlen_k = (q.shape[1], k.shape[1]) if seqlens is None else seqlens
    group = num_head // num_head_kv
    tiles = (causal, local) if tiles is None else tiles
    cfg, multiple = _config(iface, head_dim, head_dim_v, *tiles)
    m, n = cfg.m_block_size, cfg.n_block_size
    seq_q_r, seq_k_r = round_up(seqlen_q, m), round_up(seqlen_k, n)
    orders = [(head_dim, postprocess_args(iface, cfg, multiple, "dq", q.dtype))]
    if group > 1:
        dkv_args = postprocess_args(iface, cfg, multiple, "dkv", q.dtype)
        orders += [(head_dim, dkv_args), (head_dim_v, dkv_args)]
    cute_dtype = iface.torch2cute_dtype_map[q.dtype]
    key = (
        cute_dtype,
        head_dim,
        head_dim_v,
        group,
        causal,
        local,
        tiles,  # the mask whose tile configuration the kernel is compiled with
        left is not None,
        right is not None,
        deterministic,
        *(iface.get_broadcast_dims(t) for t in (q, k, v, dout)),
        seq_q_r == m,  # _flash_attn_bwd's guard against TVM stride poisoning
        seq_k_r == n,
        seqlens is not None,  # varlen: cu_seqlens_q, cu_seqlens_k and seqused_q given
    )
    return BlockPlan(
        cfg,
        multiple,
        cute_dtype,
        head_dim,
        head_dim_v,
        group,
        causal,
        local,
        left,
        right,
        deterministic,
        seq_q_r,
        seq_k_r,
        round_up(head_dim, multiple),
        round_up(head_dim_v, multiple),
        key,
        orders,
    )


_PLANS: dict[tuple, BlockPlan] = {}
_COMPILED: dict[tuple, object] = {}


def plan_of(
    iface, q, k, v, dout, causal, left, right, deterministic, tiles=None, seqlens=None
) -> BlockPlan | None:
    """The block's :class:`BlockPlan` with its tile orders learnt (cached), compiled with the
    tile configuration of ``tiles = (causal, local)`` (default: the block's own mask);
    ``seqlens``: ``(max_seqlen_q, max_seqlen_k)`` of a varlen block (``[T, H, D]``). ``None``
    where a postprocess is not a reorder (:func:`tile_order`), or while a CUDA graph is
    being captured if the orders are not learnt yet (learning synchronises, which capture
    forbids; a warm-up call outside the capture learns them)."""
    device = q.device
    signature = (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        device,
        causal,
        left,
        right,
        deterministic,
        tiles,
        seqlens,
        *(0 in t.stride() and iface.get_broadcast_dims(t) for t in (q, k, v, dout)),
    )
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS[signature] = _block_plan(
            iface, q, k, v, dout, causal, left, right, deterministic, tiles, seqlens
        )
    if plan.perms is None:
        if capturing(device) and not all(learnt(h, a, device) for h, a in plan.orders):
            return None
        plan.perms = [tile_order(iface, h, a, device) for h, a in plan.orders]
    # (not ``None in plan.perms``: that compares None with each tensor, ~30 us a block)
    return None if any(p is None for p in plan.perms) else plan


def new_dkv(
    plan: BlockPlan, k: Tensor, v: Tensor, cu_seqlens_k: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The main kernel's dK/dV outputs: zeroed fp32 accumulators with GQA (it adds each query
    head's share; varlen: in padded rows, ``flash_attn4_tiles.padded_rows``), else tensors of
    the input dtype (it writes them)."""
    if plan.group == 1:
        return torch.empty_like(k), torch.empty_like(v)
    if cu_seqlens_k is None:
        lead, rows = (k.shape[0], k.shape[2]), plan.seq_k_r
    else:
        lead, rows = (k.shape[1],), padded_total(k.shape[0], cu_seqlens_k, plan.cfg.n_block_size)
    f32, device = torch.float32, k.device
    if plan.hd_r == plan.hdv_r:  # one launch
        return torch.zeros(2, *lead, rows * plan.hd_r, dtype=f32, device=device).unbind(0)
    dk = torch.zeros(*lead, rows * plan.hd_r, dtype=f32, device=device)
    dv = torch.zeros(*lead, rows * plan.hdv_r, dtype=f32, device=device)
    return dk, dv


def preprocess(
    iface, plan: BlockPlan, out, dout, lse, dq_accum, cu_seqlens_q=None
) -> tuple[Tensor, Tensor]:
    """flash-attn 4's preprocess: ``(dpsum, lse_log2)`` of the rows of ``out`` (the queries
    ``plan`` was made for; varlen: documents ``cu_seqlens_q``); zeroes ``dq_accum``."""
    shape = (*dq_accum.shape[:-1], dq_accum.shape[-1] // plan.hd_r)
    dpsum, lse_log2 = torch.empty(2, *shape, dtype=torch.float32, device=out.device).unbind(0)
    iface._bwd_preprocess(
        out,
        dout,
        dpsum,
        lse,
        lse_log2,
        dq_accum,
        cu_seqlens_q,
        None,
        None,
        plan.cute_dtype,
        plan.head_dim,
        plan.head_dim_v,
        plan.cfg.m_block_size,
        cu_total_m_blocks=None,
        fake_mode=False,
        hdim_multiple_of=plan.multiple,
    )
    return dpsum, lse_log2


def main_kernel(
    iface, plan: BlockPlan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, scale, varlen=None
):
    """flash-attn 4's main backward kernel on one block: adds the block's dq into
    ``dq_accum`` (and, with GQA, its dK/dV into ``dk``/``dv``; else writes them). ``varlen``:
    ``(cu_seqlens_q, cu_seqlens_k, seqused_q)`` of a varlen block."""
    varlen = (None, None, None) if varlen is None else varlen
    num_head, num_head_kv = q.shape[-2], k.shape[-2]
    batch = q.shape[0] if varlen[1] is None else varlen[1].shape[0] - 1
    m, n = plan.cfg.m_block_size, plan.cfg.n_block_size
    semaphores = (None, None, None)
    if plan.deterministic:
        shapes = [(batch, num_head, plan.seq_q_r // m, 1)]
        shapes += [(batch, num_head_kv, plan.seq_k_r // n, 2)] * 2
        semaphores = tuple(
            torch.zeros(shape, dtype=torch.int32, device=q.device)
            if i == 0 or plan.group > 1
            else None
            for i, shape in enumerate(shapes)
        )
    tensors = [q.detach(), k.detach(), v.detach(), dout, lse_log2, dpsum, dq_accum, dk, dv]
    compiled = _COMPILED.get(plan.key)
    if compiled is None:
        compiled = _COMPILED[plan.key] = _compile(iface, plan, tensors, semaphores, scale, varlen)
    compiled(*_kernel_args(tensors, scale, plan, semaphores, iface.AuxData(None, None), varlen))


def contiguous(iface, *tensors: Tensor) -> list[Tensor]:
    return [iface.maybe_contiguous(t) for t in tensors]


def unrounded_backward(
    interface: ModuleType,
    dout_BSHD: Tensor,
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    *,
    scale: float,
    causal: bool,
    window_size_left: int | None,
    window_size_right: int | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``_flash_attn_bwd``'s ``(dq, dk, dv)`` of one dense block, before rounding: dq in fp32,
    and dk, dv in fp32 for GQA (``H > H_kv``; with ``H == H_kv`` the kernel writes them in the
    input dtype itself). fp32 results are ``[B, S, H, D]`` views (Note [Unrounded block
    gradients from flash-attn 4]). Call only where :func:`unrounded_reason` is None.

    ``None`` (before launching anything; the caller then runs the plain backward) where
    :func:`plan_of` finds none."""
    iface = interface
    q, k, v, out, dout, lse = contiguous(
        iface, q_BSHD, k_BSHD, v_BSHD, out_BSHD, dout_BSHD, lse_BHS
    )
    plan = plan_of(iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic)
    if plan is None:
        return None
    batch, seqlen_q, num_head, head_dim = q.shape
    dq_accum = torch.empty(
        batch, num_head, plan.seq_q_r * plan.hd_r, dtype=torch.float32, device=q.device
    )
    dpsum, lse_log2 = preprocess(iface, plan, out, dout, lse, dq_accum)
    dk, dv = new_dkv(plan, k, v)
    main_kernel(iface, plan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, scale)
    accums, scales = [dq_accum, dk, dv][: len(plan.perms)], [scale, scale, 1.0]
    untile_(accums, plan.perms, scales[: len(accums)])
    dq = as_BSHD(dq_accum, plan.hd_r, seqlen_q, head_dim)
    return (dq, *dkv_BSHD(plan, k, dk, dv))


def dkv_BSHD(plan: BlockPlan, k: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
    """``(dk, dv)`` as ``[B, S, H_kv, D]``: views of untiled fp32 accumulators (GQA)."""
    if plan.group == 1:
        return dk, dv
    seqlen_k = k.shape[1]
    return (
        as_BSHD(dk, plan.hd_r, seqlen_k, plan.head_dim),
        as_BSHD(dv, plan.hdv_r, seqlen_k, plan.head_dim_v),
    )


def _kernel_args(tensors, scale: float, plan: BlockPlan, semaphores, aux, varlen) -> list:
    """The main kernel's 22 arguments, as ``_flash_attn_bwd`` passes them to it and to its
    compilation: the 9 tensors, the scale, ``varlen`` (cu_seqlens_q, cu_seqlens_k, seqused_q;
    never seqused_k), the window, the semaphores, ``aux`` (no score_mod tensors), no block
    sparsity."""
    return [*tensors, scale, *varlen, None, plan.left, plan.right, *semaphores, aux,
            None, None]  # fmt: skip


def _compile(iface, plan: BlockPlan, tensors, semaphores, scale, varlen):
    """The sm90 main backward kernel, compiled as ``_flash_attn_bwd`` compiles it."""
    cfg, cute = plan.cfg, iface.cute
    kernel = iface.FlashAttentionBackwardSm90(
        plan.cute_dtype,
        plan.head_dim,
        plan.head_dim_v,
        plan.group,
        plan.causal,
        is_local=plan.local,
        deterministic=plan.deterministic,
        tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size,
        Q_stage=cfg.num_stages_Q,
        dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS,
        SdP_swapAB=cfg.SdP_swapAB,
        dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB,
        AtomLayoutMSdP=cfg.AtomLayoutMSdP,
        AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128,
        V_in_regs=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        has_aux_tensors=False,
        q_subtile_factor=2,
        dQ_single_wg=cfg.dQ_single_wg,
    )
    cute_semaphores = [
        None
        if t is None
        else iface.utils.convert_from_dlpack_leading_static(
            t.detach(), leading_dim=3, alignment=4, stride_order=t.dim_order()
        )
        for t in semaphores
    ]
    cute_tensors = [iface.to_cute_tensor(t) for t in tensors]
    cute_varlen = [None if t is None else iface.to_cute_tensor(t, assumed_align=4) for t in varlen]
    aux = iface.AuxData(None, None)
    return cute.compile(
        kernel,
        *_kernel_args(cute_tensors, scale, plan, cute_semaphores, aux, cute_varlen),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
