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

Note [dq accumulated inside flash-attn 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The main kernel does not write dq: it adds it into ``dq_accum`` (a bulk reduce-add into global
memory), which the preprocess zeroed. A ring's backward runs every block of a rank's queries
into one such accumulator (:class:`RingDq`), so the kernel itself sums the blocks, in fp32:

    per block, summed by the engine              accumulated by the kernel (RingDq)
    preprocess(out_b, dout_b): dq_b = 0          preprocess(out, dout) once: dq_acc = 0
    main kernel: dq_b += ...                     main kernel on q[a:b]: dq_acc[a:b] += ...
    reorder dq_b; dq[a:b] += dq_b (side stream)  -
    dq = round(dq)                               dq = round(scale * dq_acc[perm]) once

Rows ``[a, b)`` of the accumulator are the flat range ``[a * D_r, (a + rows_r) * D_r)`` of each
head when ``a`` starts a tile (``rows_r`` = the block's rows rounded up to tiles), and
``dpsum`` / ``lse_log2`` are the same rows of the one preprocess's (a block's rows of ``out``,
``dout`` and ``lse`` are the rows of the whole). So the accumulator serves a plan whose blocks
start their query rows on tiles (zigzag's halves and the ring's whole shards at 64-token
multiples); any other plan sums per block as above. Every block is compiled with one tile
configuration, a causal block's (``_TILES``): for head dims 97-128 flash-attn 4 picks 80-row
tiles for unmasked blocks and 64 for causal ones, whose tile orders differ; 64 rows is what it
itself runs unmasked blocks with under block sparsity. dq never leaves the rank, so this is a
rank's own choice; dK/dV, which travel, are as in the note above.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from ..parts import Block
from .flash_attn4_tiles import as_BSHD, learnt, postprocess_args, round_up, tile_order, untile_

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


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


def _block_plan(
    iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic, tiles
):
    causal, local, left, right = iface._resolve_causal_local_window(
        causal, window_size_left, window_size_right
    )
    seqlen_q, num_head, head_dim = q.shape[1:]
    seqlen_k, num_head_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
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
        round_up(head_dim, multiple),
        round_up(head_dim_v, multiple),
        key,
        orders,
    )


_PLANS: dict[tuple, _BlockPlan] = {}
_COMPILED: dict[tuple, object] = {}


def _plan(
    iface, q, k, v, dout, causal, left, right, deterministic, tiles=None
) -> _BlockPlan | None:
    """The block's :class:`_BlockPlan` with its tile orders learnt (cached), compiled with the
    tile configuration of ``tiles = (causal, local)`` (default: the block's own mask). ``None``
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
        *(0 in t.stride() and iface.get_broadcast_dims(t) for t in (q, k, v, dout)),
    )
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS[signature] = _block_plan(
            iface, q, k, v, dout, causal, left, right, deterministic, tiles
        )
    if plan.perms is None:
        if _capturing(device) and not all(learnt(h, a, device) for h, a in plan.orders):
            return None
        plan.perms = [tile_order(iface, h, a, device) for h, a in plan.orders]
    return None if None in plan.perms else plan


def _new_dkv(plan: _BlockPlan, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The main kernel's dK/dV outputs: zeroed fp32 accumulators with GQA (it adds each query
    head's share), else tensors of the input dtype (it writes them)."""
    if plan.group == 1:
        return torch.empty_like(k), torch.empty_like(v)
    batch, f32, device = k.shape[0], torch.float32, k.device
    size_k, size_v = plan.seq_k_r * plan.hd_r, plan.seq_k_r * plan.hdv_r
    dk = torch.zeros(batch, k.shape[2], size_k, dtype=f32, device=device)
    dv = torch.zeros(batch, v.shape[2], size_v, dtype=f32, device=device)
    return dk, dv


def _preprocess(iface, plan: _BlockPlan, out, dout, lse, dq_accum) -> tuple[Tensor, Tensor]:
    """flash-attn 4's preprocess: ``(dpsum, lse_log2)`` of the rows of ``out`` (the queries
    ``plan`` was made for); zeroes ``dq_accum``."""
    batch, _, num_head = out.shape[:3]
    dpsum, lse_log2 = torch.empty(
        2, batch, num_head, plan.seq_q_r, dtype=torch.float32, device=out.device
    ).unbind(0)
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
        plan.head_dim,
        plan.head_dim_v,
        plan.cfg.m_block_size,
        cu_total_m_blocks=None,
        fake_mode=False,
        hdim_multiple_of=plan.multiple,
    )
    return dpsum, lse_log2


def _main(iface, plan: _BlockPlan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, scale):
    """flash-attn 4's main backward kernel on one block: adds the block's dq into
    ``dq_accum`` (and, with GQA, its dK/dV into ``dk``/``dv``; else writes them)."""
    batch, num_head, num_head_kv = q.shape[0], q.shape[2], k.shape[2]
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
        compiled = _COMPILED[plan.key] = _compile(iface, plan, tensors, semaphores, scale)
    compiled(*_kernel_args(tensors, scale, plan, semaphores, iface.AuxData(None, None)))


def _contiguous(iface, *tensors: Tensor) -> list[Tensor]:
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
    :func:`_plan` finds none."""
    iface = interface
    q, k, v, out, dout, lse = _contiguous(
        iface, q_BSHD, k_BSHD, v_BSHD, out_BSHD, dout_BSHD, lse_BHS
    )
    plan = _plan(iface, q, k, v, dout, causal, window_size_left, window_size_right, deterministic)
    if plan is None:
        return None
    batch, seqlen_q, num_head, head_dim = q.shape
    dq_accum = torch.empty(
        batch, num_head, plan.seq_q_r * plan.hd_r, dtype=torch.float32, device=q.device
    )
    dpsum, lse_log2 = _preprocess(iface, plan, out, dout, lse, dq_accum)
    dk, dv = _new_dkv(plan, k, v)
    _main(iface, plan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, scale)
    accums, scales = [dq_accum, dk, dv][: len(plan.perms)], [scale, scale, 1.0]
    untile_(accums, plan.perms, scales[: len(accums)])
    dq = as_BSHD(dq_accum, plan.hd_r, seqlen_q, head_dim)
    return (dq, *_dkv_BSHD(plan, k, dk, dv))


def _dkv_BSHD(plan: _BlockPlan, k: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
    """``(dk, dv)`` as ``[B, S, H_kv, D]``: views of untiled fp32 accumulators (GQA)."""
    if plan.group == 1:
        return dk, dv
    seqlen_k = k.shape[1]
    return (
        as_BSHD(dk, plan.hd_r, seqlen_k, plan.head_dim),
        as_BSHD(dv, plan.hdv_r, seqlen_k, plan.head_dim_v),
    )


class RingDq:
    """The dq of a ring's backward, accumulated by flash-attn 4's own kernel (Note [dq
    accumulated inside flash-attn 4]): a :class:`~dtensor_ring.kernels.DqAccumulator`. Build
    with :meth:`of`."""

    def __init__(self, iface, tensors, plan: _BlockPlan, scale, window_args, deterministic):
        self._iface, self._plan = iface, plan
        self._dout, self._q, self._out, lse = tensors
        self._scale, self._window_args, self._deterministic = scale, window_args, deterministic
        batch, _, num_head, _ = self._q.shape
        self._dq_accum = torch.empty(
            batch, num_head, plan.seq_q_r * plan.hd_r, dtype=torch.float32, device=lse.device
        )
        self._dpsum, self._lse_log2 = _preprocess(
            iface, plan, self._out, self._dout, lse, self._dq_accum
        )

    @classmethod
    def of(
        cls,
        interface: ModuleType,
        dout_BSHD: Tensor,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_BSHD: Tensor,
        lse_BHS: Tensor,
        blocks: Sequence[Block],
        *,
        scale: float,
        window_args: Callable[[tuple[int, int] | None], dict],
        deterministic: bool,
    ) -> RingDq | None:
        """The accumulator for ``blocks`` of the local queries ``q`` against K/V shaped as the
        local ``k``/``v``, with a positive ``scale``; ``window_args(window)``: flash-attn 4's
        window keywords. ``None`` (nothing launched) where a block's query rows do not start
        on a tile of the kernel's configuration, or :func:`_plan` finds none."""
        iface = interface
        tensors = _contiguous(iface, dout_BSHD, q_BSHD, out_BSHD, lse_BHS)
        dout, q = tensors[:2]
        k, v = _contiguous(iface, k_BSHD, v_BSHD)
        plan = _plan(iface, q, k, v, dout, True, None, 0, deterministic, _TILES)
        if plan is None:
            return None
        m, seqlen_q = plan.cfg.m_block_size, q.shape[1]
        for blk in blocks:
            a, b = blk.q.bounds(seqlen_q)
            if a % m or (b % m and b != seqlen_q):
                return None
        return cls(iface, tensors, plan, scale, window_args, deterministic)

    def backward(self, block: Block, k_BSHD: Tensor, v_BSHD: Tensor) -> tuple[Tensor, Tensor]:
        """Add ``block``'s dq into the accumulator (its query rows of the local queries, against
        ``k``/``v``); return its ``(dk, dv)`` as :func:`unrounded_backward` does."""
        iface = self._iface
        a, b = block.q.bounds(self._q.shape[1])
        q, dout = self._q[:, a:b], self._dout[:, a:b]
        k, v = _contiguous(iface, k_BSHD, v_BSHD)
        window = self._window_args(block.window)
        left, right = window["window_size_left"], window["window_size_right"]
        plan = _plan(iface, q, k, v, dout, block.causal, left, right, self._deterministic, _TILES)
        if plan is None:  # of() learnt every tile order of this configuration
            raise RuntimeError("flash-attn 4's tile orders changed within a backward")
        hd_r, rows = self._plan.hd_r, slice(a, a + plan.seq_q_r)
        dq_accum = self._dq_accum[:, :, rows.start * hd_r : rows.stop * hd_r]
        dpsum, lse_log2 = self._dpsum[:, :, rows], self._lse_log2[:, :, rows]
        dk, dv = _new_dkv(plan, k, v)
        _main(iface, plan, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, self._scale)
        if plan.group > 1:
            untile_([dk, dv], plan.perms[1:], [self._scale, 1.0])
        return _dkv_BSHD(plan, k, dk, dv)

    def result(self) -> Tensor:
        """dq ``[B, S, H, D]`` in the input dtype: the accumulator scaled and rounded once."""
        plan, q = self._plan, self._q
        untile_([self._dq_accum], plan.perms[:1], [self._scale])
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return dq.copy_(as_BSHD(self._dq_accum, plan.hd_r, q.shape[1], q.shape[3]))


# The tile configuration (causal, local) every block of a RingDq is compiled with: one tile
# order for the whole accumulator (Note [dq accumulated inside flash-attn 4]).
_TILES = (True, False)


def _kernel_args(tensors, scale: float, plan: _BlockPlan, semaphores, aux) -> list:
    """The main kernel's 22 arguments, as ``_flash_attn_bwd`` passes them to it and to its
    compilation: the 9 tensors, the scale, no varlen, the window, the semaphores, ``aux`` (no
    score_mod tensors), no block sparsity."""
    return [*tensors, scale, None, None, None, None, plan.left, plan.right, *semaphores, aux,
            None, None]  # fmt: skip


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
    cute_tensors = [iface.to_cute_tensor(t) for t in tensors]
    return cute.compile(
        kernel,
        *_kernel_args(cute_tensors, scale, plan, cute_semaphores, iface.AuxData(None, None)),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
