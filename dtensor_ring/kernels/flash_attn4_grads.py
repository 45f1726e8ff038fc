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
learn it from the postprocess itself (:func:`_tile_order`): run it on one tile whose values
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
``flash-attn-4==4.0.0b36`` (dense, sm90, no sinks, score_mod, block sparsity or dlse): private
functions, so :func:`unrounded_reason` accepts only that version and sm90, and every other
case runs the plain ``_flash_attn_bwd``. Checked on an H200 against fp64
(``tests/gpu/check_flash_attn4.py``); on CPU against a stand-in of those pieces with a known
tile order (``tests/test_kernel_adapters.py``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

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


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@functools.cache
def _config(interface: ModuleType, head_dim: int, head_dim_v: int, causal: bool, local: bool):
    """flash-attn 4's sm90 backward configuration (``_tile_size_bwd_sm90``) and the head-dim
    rounding of its accumulators."""
    cfg = interface._tile_size_bwd_sm90(head_dim, head_dim_v, causal, local)
    return cfg, (64 if cfg.dKV_swapAB else 32)


def _postprocess_args(interface, cfg, hdim_multiple_of: int, which: str, dtype) -> dict:
    """The arguments ``_flash_attn_bwd`` gives its postprocess for ``which`` ("dq" or "dkv"),
    and the output ``dtype`` (the inputs')."""
    if which == "dq":
        block, threads = cfg.m_block_size, 128 if cfg.dQ_single_wg else cfg.num_wg * 128
        atom, swap = cfg.AtomLayoutMdQ, cfg.dQ_swapAB
    else:
        block, threads = cfg.n_block_size, cfg.num_wg * 128
        atom, swap = cfg.AtomLayoutNdKV, cfg.dKV_swapAB
    return dict(
        arch=interface._get_device_arch(),
        block_size=block,
        num_threads=threads,
        atom_layout=atom,
        swap_ab=swap,
        hdim_multiple_of=hdim_multiple_of,
        dtype=dtype,
    )


def _convert(interface, accum: Tensor, output: Tensor, hdim: int, args: dict) -> None:
    """flash-attn 4's postprocess: ``output = round(accum)`` (scale 1)."""
    interface._bwd_postprocess_convert(
        accum,
        output,
        1.0,
        None,
        None,
        args["arch"],
        interface.torch2cute_dtype_map[output.dtype],
        hdim,
        args["block_size"],
        args["num_threads"],
        args["atom_layout"],
        args["swap_ab"],
        use_2cta_instrs=False,
        cluster_size=1,
        accum_order=None,
        cu_total_m_blocks=None,
        fake_mode=False,
        hdim_multiple_of=args["hdim_multiple_of"],
    )


_TILE_ORDERS: dict[tuple, Tensor | None] = {}


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _order_key(hdim: int, args: dict, device: torch.device) -> tuple:
    return (hdim, tuple(sorted(args.items())), device)


def _tile_order(interface, hdim: int, args: dict, device: torch.device) -> Tensor | None:
    """``perm`` with ``tile.flatten()[perm]`` the ``[rows, hdim_rounded]`` row-major tile of a
    flat accumulator tile, learnt from the postprocess (Note [Unrounded block gradients from
    flash-attn 4]); columns past ``hdim`` are not read and map to 0. Checked once on a tile of
    random integers (exact in bf16 and fp16): None if the postprocess is not that reorder (then the
    plain backward runs)."""
    key = _order_key(hdim, args, device)
    if key in _TILE_ORDERS:
        return _TILE_ORDERS[key]
    rows, hdim_r = args["block_size"], _round_up(hdim, args["hdim_multiple_of"])
    size = rows * hdim_r
    flat = torch.arange(size, device=device)
    index = torch.zeros(rows, hdim, dtype=torch.int64, device=device)
    out = torch.empty(1, rows, 1, hdim, dtype=args["dtype"], device=device)
    for bit in range(max(1, math.ceil(math.log2(size)))):
        accum = ((flat >> bit) & 1).to(torch.float32).view(1, 1, size)
        _convert(interface, accum, out, hdim, args)
        index |= out[0, :, 0, :].to(torch.int64) << bit
    perm = torch.zeros(rows, hdim_r, dtype=torch.int64, device=device)
    perm[:, :hdim] = index
    perm = perm.flatten()
    values = torch.randint(-128, 128, (size,), generator=torch.Generator().manual_seed(size))
    values = values.to(device=device, dtype=torch.float32)
    _convert(interface, values.view(1, 1, size), out, hdim, args)
    ok = bool(index.lt(size).all()) and torch.equal(
        out[0, :, 0, :].float(), values[perm].view(rows, hdim_r)[:, :hdim]
    )
    _TILE_ORDERS[key] = perm if ok else None
    return _TILE_ORDERS[key]


def _untile_(accums: list[Tensor], perms: list[Tensor], scales: list[float]) -> None:
    """Each ``accum`` (``[B, H, n_tiles * tile]``) scaled and in row-major tile order, in place:
    one Triton launch on CUDA (Note [Unrounded block gradients from flash-attn 4])."""
    untile = _triton_untile() if accums[0].is_cuda else None
    if untile is not None:
        untile(accums, perms, scales)
        return
    for accum, perm, scale in zip(accums, perms, scales, strict=True):
        tiles = accum.view(-1, perm.numel())
        tiles.copy_(tiles.index_select(-1, perm).mul_(scale))


def _as_BSHD(accum: Tensor, hdim_r: int, seq: int, hdim: int) -> Tensor:
    """The ``[B, S, H, D]`` view of an accumulator in row-major tile order: row ``s`` of head
    ``h`` starts at ``h * n + s * hdim_r`` (one op: host time)."""
    B, H, n = accum.shape
    return accum.as_strided((B, seq, H, hdim), (H * n, hdim_r, n, 1))


@functools.cache
def _triton_untile():
    if importlib.util.find_spec("triton") is None:
        return None
    from ._triton_tiles import triton_untile_

    return triton_untile_


@dataclass
class _BlockPlan:
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


def _block_plan(iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic):
    causal, local, left, right = iface._resolve_causal_local_window(
        causal, window_size_left, window_size_right
    )
    seqlen_q, num_head, head_dim = q.shape[1:]
    seqlen_k, num_head_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = num_head // num_head_kv
    cfg, multiple = _config(iface, head_dim, head_dim_v, causal, local)
    m, n = cfg.m_block_size, cfg.n_block_size
    seq_q_r, seq_k_r = _round_up(seqlen_q, m), _round_up(seqlen_k, n)
    orders = [(head_dim, _postprocess_args(iface, cfg, multiple, "dq", q.dtype))]
    if group > 1:
        dkv_args = _postprocess_args(iface, cfg, multiple, "dkv", q.dtype)
        orders += [(head_dim, dkv_args), (head_dim_v, dkv_args)]
    cute_dtype = iface.torch2cute_dtype_map[q.dtype]
    key = (
        cute_dtype,
        head_dim,
        head_dim_v,
        group,
        causal,
        local,
        left is not None,
        right is not None,
        deterministic,
        *(iface.get_broadcast_dims(t) for t in (q, k, v, dout)),
        seq_q_r == m,  # _flash_attn_bwd's guard against TVM stride poisoning
        seq_k_r == n,
    )
    return _BlockPlan(
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
        _round_up(head_dim, multiple),
        _round_up(head_dim_v, multiple),
        key,
        orders,
    )


_PLANS: dict[tuple, _BlockPlan] = {}
_COMPILED: dict[tuple, object] = {}


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

    ``None`` (before launching anything; the caller then runs the plain backward) where the
    postprocess of this configuration failed the check of :func:`_tile_order`, and while a
    CUDA graph is being captured if its tile orders are not learnt yet: learning them
    synchronises, which capture forbids (a warm-up call outside the capture learns them)."""
    iface = interface
    q, k, v, out, dout, lse = (
        iface.maybe_contiguous(t) for t in (q_BSHD, k_BSHD, v_BSHD, out_BSHD, dout_BSHD, lse_BHS)
    )
    device = q.device
    signature = (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        device,
        causal,
        window_size_left,
        window_size_right,
        deterministic,
        *(0 in t.stride() and iface.get_broadcast_dims(t) for t in (q, k, v, dout)),
    )
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS[signature] = _block_plan(
            iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic
        )
    if plan.perms is None:
        if _capturing(device) and any(
            _order_key(h, a, device) not in _TILE_ORDERS for h, a in plan.orders
        ):
            return None
        plan.perms = [_tile_order(iface, h, a, device) for h, a in plan.orders]
    if None in plan.perms:  # a postprocess that is not a reorder (_tile_order)
        return None
    batch, seqlen_q, num_head, head_dim = q.shape
    seqlen_k, num_head_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    gqa = num_head > num_head_kv
    m, n = plan.cfg.m_block_size, plan.cfg.n_block_size
    seq_q_r, seq_k_r, f32 = plan.seq_q_r, plan.seq_k_r, torch.float32
    dq_accum = torch.empty(batch, num_head, seq_q_r * plan.hd_r, dtype=f32, device=device)
    dpsum = torch.empty(batch, num_head, seq_q_r, dtype=f32, device=device)
    lse_log2 = torch.empty(batch, num_head, seq_q_r, dtype=f32, device=device)
    if gqa:
        dk = torch.zeros(batch, num_head_kv, seq_k_r * plan.hd_r, dtype=f32, device=device)
        dv = torch.zeros(batch, num_head_kv, seq_k_r * plan.hdv_r, dtype=f32, device=device)
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    semaphores = (None, None, None)
    if deterministic:
        shapes = [(batch, num_head, seq_q_r // m, 1)] + [(batch, num_head_kv, seq_k_r // n, 2)] * 2
        semaphores = tuple(
            torch.zeros(shape, dtype=torch.int32, device=device) if i == 0 or gqa else None
            for i, shape in enumerate(shapes)
        )
    iface._bwd_preprocess(
        out,
        dout,
        dpsum,
        lse,
        lse_log2,
        dq_accum,
        None,
        None,
        None,
        plan.cute_dtype,
        head_dim,
        head_dim_v,
        m,
        cu_total_m_blocks=None,
        fake_mode=False,
        hdim_multiple_of=plan.multiple,
    )
    tensors = [q.detach(), k.detach(), v.detach(), dout, lse_log2, dpsum, dq_accum, dk, dv]
    compiled = _COMPILED.get(plan.key)
    if compiled is None:
        compiled = _COMPILED[plan.key] = _compile(iface, plan, tensors, semaphores, scale)
    left, right = plan.left, plan.right
    null = iface.AuxData(None, None)
    compiled(*tensors, scale, None, None, None, None, left, right, *semaphores, null, None, None)
    accums, scales = [dq_accum, dk, dv][: len(plan.perms)], [scale, scale, 1.0]
    _untile_(accums, plan.perms, scales[: len(accums)])
    dq = _as_BSHD(dq_accum, plan.hd_r, seqlen_q, head_dim)
    if gqa:
        dk = _as_BSHD(dk, plan.hd_r, seqlen_k, head_dim)
        dv = _as_BSHD(dv, plan.hdv_r, seqlen_k, head_dim_v)
    return dq, dk, dv


def _compile(iface, plan: _BlockPlan, tensors, semaphores, scale):
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
    return cute.compile(
        kernel,
        *(iface.to_cute_tensor(t) for t in tensors),
        scale,
        None,
        None,
        None,
        None,
        plan.left,
        plan.right,
        *cute_semaphores,
        iface.AuxData(None, None),
        None,
        None,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
