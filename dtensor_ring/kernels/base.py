"""The block-kernel interface: one attention block, forward and backward.

Shape legend (used throughout the package):
    B: batch, S: sequence (local block), H: query heads, H_kv: key/value heads, D: head dim,
    T: packed tokens (varlen).

Every backend computes exact softmax attention of one block of queries against one block of
keys/values, ``causal`` meaning the square top-left-aligned causal mask (the engine only asks
for causal blocks with ``S_q == S_k``). Contract:

* ``forward(q_BSHD, k_BSHD, v_BSHD)`` -> ``(out_BSHD, lse_BHS)``: ``out`` in the input dtype,
  ``lse`` the natural-log log-sum-exp of the scaled scores in the accumulation dtype
  (fp32, or fp64 for fp64 inputs). With ``unrounded=True`` (the caller merges block outputs)
  a backend that has ``out`` before rounding (``unrounded_outputs``) may return it in the
  accumulation dtype instead.
* ``backward(dout, q, k, v, out, lse)`` -> ``(dq, dk, dv)`` in the input dtype, with ``out`` and
  ``lse`` the *global* (fully merged) values of these query rows: the block gradients of ring
  attention are then exact (see Note [Ring backward] in ``engine/ring.py``). With
  ``unrounded=True`` (the caller sums block gradients) a backend that has them before rounding
  (``unrounded_grads``) may return any of the three in the accumulation dtype instead.
* ``merge_forward(q, k, v, out_acc, lse_acc)`` (``merge_forward_varlen``): a kernel that
  merges a block into a ring's running ``(out, lse)`` in its own epilogue
  (``merges_outputs``; flash-attn 4 on sm90: Note [Merging in flash-attn 4's epilogue]) does
  so in place and returns True; the others return False, and the engine merges the block's
  ``unrounded`` forward itself.
* ``dq_accumulator(...)`` (``dq_accumulator_varlen(...)`` for packed documents): a kernel that
  can sum a ring's dq blocks itself returns a :class:`DqAccumulator` (flash-attn 4 on sm90:
  Note [dq accumulated inside flash-attn 4]); the others ``None``, and the engine sums their
  ``unrounded`` block gradients.
* ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA, ``H % H_kv == 0``); ``dk``/``dv`` have
  ``H_kv`` heads.
* Inputs may be any strided views and ``scale`` any finite float: the public methods hand the
  backends a unit last stride and a positive scale (Note [Kernel inputs]); outputs are fresh
  tensors.
* ``window=(left, right)`` (dense blocks, ``supports_window`` backends, never with ``causal``):
  flash-attn's sliding window, aligned bottom-right: key ``j`` is visible to query ``i`` iff
  ``-left <= j - i - (S_k - S_q) <= right``, -1 unbounded. The engine trims its blocks so that
  no row or column is fully masked (Note [Windowed schedules] in ``schedule/plan.py``).
  FlashAttention-2 rewrites a side >= ``max_seqlen_k`` and an unbounded side into
  ``max_seqlen_k``, which is not unbounded when ``S_q > S_k + 1``; its adapters keep the
  interface's mask anyway (Note [FlashAttention-2's unbounded window sides] in
  ``cuda_flash.py``). :func:`window_mask` is the mask as a tensor.

Varlen kernels (``supports_varlen``) take packed ``[T, H, D]`` tensors with int32
``cu_seqlens`` and return ``lse_HT``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from ..parts import Block


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that lse, merges and gradient sums use for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KernelCall:
    """What a backend must support for one attention call (used for backend selection)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    varlen: bool = False
    deterministic: bool = False
    window: bool = False
    small: bool = False  # blocks of little work: see SMALL_BLOCK_WORK

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        *,
        varlen: bool = False,
        deterministic: bool = False,
        window: bool = False,
    ) -> KernelCall:
        """Describe a call from ``q`` and ``k`` (``[..., S, H, D]`` layouts)."""
        return cls(
            q.device.type,
            q.dtype,
            q.shape[-1],
            q.shape[-2],
            k.shape[-2],
            varlen,
            deterministic,
            window,
            is_small(q.shape[-3], q.shape[-2], q.shape[-1]),
        )


# Below this much work a call, S_local^2 * H * D, a rank's eager ring is host-bound where a
# kernel's host time is long. flash-attn 4's forward through its wrapper cost 0.11-0.13 ms of
# host time a call, and cuDNN won up to 4096 tokens a rank (H200, 2026-12-04: zigzag on 8
# simulated ranks, bf16, H = 32, H_kv = 8, D = 128). With its forward replayed (29-37 us a
# call, Note [flash-attn 4's forward, replayed]) two H100 runs (2026-12-05, each with cuDNN
# in the same run; docs/performance.md) put the crossover lower: at 4096 tokens a rank
# flash-attn 4 won both runs, forward and forward + backward (zigzag 1.98 / 7.79 and 2.30 /
# 8.36 ms against cuDNN's 2.17 / 8.96 and 2.67 / 9.65; W = 1: 0.43 / 1.35 and 0.40 / 1.56 ms
# against 0.49 / 1.56 and 0.45 / 1.61); at 2048 cuDNN won forward + backward in one run by a
# quarter and tied in the other (its backward's host time is the shorter). The threshold sits
# between the two.
SMALL_BLOCK_WORK = 3072 * 3072 * 32 * 128


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (what must not
    synchronise, copy from the host or be kept past the capture)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def is_small(tokens: int, heads: int, head_dim: int) -> bool:
    """Whether a call of ``tokens`` local tokens (the sequence a kernel sees), ``heads`` query
    heads of ``head_dim`` is a small one (:data:`SMALL_BLOCK_WORK`)."""
    return tokens * tokens * heads * head_dim < SMALL_BLOCK_WORK


class HeldKVGrads(Protocol):
    """A block's ``(dk, dv)`` that a kernel still holds in its own layout (flash-attn 4's fp32
    tiles with GQA: Note [Block dK/dV added from flash-attn 4's tiles]), added by the kernel
    into the engine's accumulators when they are at hand."""

    def add_to(self, dk: Tensor, dv: Tensor, index: Tensor | None = None) -> None:
        """``dk``, ``dv`` (the accumulation dtype, the block's K/V rows of the ring's
        accumulators: ``[B, S, H_kv, D]`` or ``[T, H_kv, D]``, any row stride) ``+=`` the
        block's gradients, row ``i`` into row ``i`` or into row ``index[i]`` (int64,
        distinct rows). Called once."""
        ...


BlockKVGrads = tuple[Tensor, Tensor] | HeldKVGrads


class DqAccumulator(Protocol):
    """A rank's dq over the blocks of a ring's backward, summed inside the kernel."""

    def backward(self, block: Block, k_BSHD: Tensor, v_BSHD: Tensor) -> BlockKVGrads:
        """Add ``block``'s dq (its query part of the local queries against ``k``/``v``, taken
        by the engine) into the accumulator; return the block's ``(dk, dv)``, which may be in
        the accumulation dtype (as ``BlockKernel.backward(..., unrounded=True)``), or held by
        the kernel until the engine adds them (:class:`HeldKVGrads`)."""
        ...

    def result(self) -> Tensor:
        """dq ``[B, S, H, D]`` in the input dtype, once every block has run."""
        ...


@dataclass(frozen=True)
class VarlenQueryRows:
    """A varlen block's queries as rows of the *whole* local ``[T, H, D]`` tensor, by local
    document, and its K/V as taken: what a kernel that reads the local queries in place needs
    (:meth:`BlockKernel.dq_accumulator_varlen`). ``N`` local documents.

    Document ``d``'s queries of the block are rows ``[q_starts[d], q_starts[d] + q_used[d])``
    of the local tensor (``q_used[d] == 0``: it has none), its keys rows
    ``[cu_seqlens_k[d], cu_seqlens_k[d + 1])`` of the block's K/V; ``q_spans`` holds, on the
    host, ``(start, stop, length)`` of each document's query rows relative to the document
    (documents with queries only).
    """

    q_starts: Tensor  # int32 [N + 1] (the last entry: T)
    q_used: Tensor  # int32 [N]
    cu_seqlens_k: Tensor  # int32 [N + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    q_spans: tuple[tuple[int, int, int], ...]


class BlockKernel:
    """Base class of the block-kernel backends; subclasses declare what they support.

    Capability attributes are checked by :meth:`unsupported_reason`; a backend with further
    limits overrides :meth:`extra_reason`; ``small_calls_to``: a preference, not a limit
    (:func:`~dtensor_ring.kernels.select_kernel`). ``relative_speed``: its rate on long blocks
    relative to cuDNN's, measured on an H200 (1.0 where not measured: the CPU kernels, the
    flash-attn package), for the cost model of ``layout="auto"``
    (Note [Choosing ring, all-gather or Ulysses]).
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    dtypes: ClassVar[tuple[torch.dtype, ...]]
    max_head_dim: ClassVar[int] = 256
    supports_gqa: ClassVar[bool] = True
    supports_varlen: ClassVar[bool] = False
    supports_window: ClassVar[bool] = False
    deterministic_backward: ClassVar[bool] = True
    unrounded_grads: ClassVar[bool] = False
    # its _forward / _forward_varlen take ``unrounded=True``: out in the accumulation dtype
    unrounded_outputs: ClassVar[bool] = False
    # its _merge_forward / _merge_forward_varlen may merge a block into running accumulators
    merges_outputs: ClassVar[bool] = False
    # merge_forward_varlen takes seqused_q: a block's rows read and merged where they lie
    merges_by_document: ClassVar[bool] = False
    relative_speed: ClassVar[float] = 1.0
    # for small calls (KernelCall.small) the automatic choice takes the first of these that
    # can run the call instead: measured faster there, where this one's host time sets the pace
    small_calls_to: ClassVar[tuple[str, ...]] = ()

    def is_available(self) -> str | None:
        """``None`` when the backend can run in this process, else why not."""
        return None

    def extra_reason(self, call: KernelCall) -> str | None:
        """Backend-specific limits beyond the declared capabilities."""
        return None

    def unsupported_reason(self, call: KernelCall) -> str | None:
        """``None`` when this backend can compute ``call``, else a short reason."""
        reason = self.is_available()
        if reason is not None:
            return reason
        if call.device_type not in self.device_types:
            return f"device {call.device_type!r} not in {self.device_types}"
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} not in {[str(d) for d in self.dtypes]}"
        if call.head_dim > self.max_head_dim:
            return f"head dim {call.head_dim} > {self.max_head_dim}"
        if call.num_heads != call.num_kv_heads and not self.supports_gqa:
            return "GQA/MQA (H != H_kv) not supported"
        if call.varlen and not self.supports_varlen:
            return "varlen (cu_seqlens) not supported"
        if call.window and not self.supports_window:
            return "sliding windows (window_size) not supported"
        if call.deterministic and not self.deterministic_backward:
            return "deterministic=True not supported (its backward is not deterministic)"
        return self.extra_reason(call)

    # --- dense blocks, [B, S, H, D] -------------------------------------------------------
    # The public methods prepare the inputs (Note [Kernel inputs]) and call the backend's
    # ``_forward`` / ``_backward`` / ``_forward_varlen`` / ``_backward_varlen``, which receive
    # tensors with a unit last stride and a positive scale.
    def forward(
        self,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(out_BSHD, lse_BHS)`` of one block (``unrounded``: see the module
        docstring)."""
        q_BSHD, (k_BSHD, v_BSHD), scale, _ = kernel_inputs(q_BSHD, k_BSHD, v_BSHD, scale=scale)
        options = self._forward_options(causal, scale, window, unrounded)
        return self._forward(q_BSHD, k_BSHD, v_BSHD, **options)

    def backward(
        self,
        dout_BSHD: Tensor,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_BSHD: Tensor,
        lse_BHS: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq_BSHD, dk_BSHD, dv_BSHD)`` of one block, given the global out/lse
        (``unrounded``: see the module docstring)."""
        q_BSHD, (dout_BSHD, k_BSHD, v_BSHD), scale, sign = kernel_inputs(
            q_BSHD, dout_BSHD, k_BSHD, v_BSHD, scale=scale
        )
        backward = (
            self._backward_unrounded if unrounded and self.unrounded_grads else self._backward
        )
        dq, dk, dv = backward(
            dout_BSHD,
            q_BSHD,
            k_BSHD,
            v_BSHD,
            out_BSHD,
            lse_BHS,
            causal=causal,
            scale=scale,
            window=window,
        )
        return unfold_scale_sign(dq, sign), dk, dv

    def dq_accumulator(
        self,
        dout_BSHD: Tensor,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_BSHD: Tensor,
        lse_BHS: Tensor,
        blocks: Sequence[Block],
        *,
        scale: float,
    ) -> DqAccumulator | None:
        """An accumulator that runs ``blocks`` (dense, of the local queries ``q`` against K/V
        shaped as the local ``k``/``v``, given the global out/lse) and sums their dq inside the
        kernel, or ``None`` (the default): the engine then sums the blocks' dq itself."""
        return None

    def sums_varlen_dq(self) -> bool:
        """Whether :meth:`dq_accumulator_varlen` may return an accumulator (the engine builds
        the rows it takes only then)."""
        return False

    def dq_accumulator_varlen(
        self,
        dout_THD: Tensor,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out_THD: Tensor,
        lse_HT: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        rows: Mapping[Block, VarlenQueryRows],
        *,
        scale: float,
        cache: dict,
    ) -> DqAccumulator | None:
        """:meth:`dq_accumulator` for varlen blocks: the local documents are ``cu_seqlens``
        (int32 ``[N + 1]``), ``rows[block]`` where each block's queries and K/V lie. ``dk``/``dv``
        of ``DqAccumulator.backward`` are ``[T_k, H_kv, D]`` rows of the K/V it is given.
        ``cache``: kept by the engine with these documents and rows, for what a kernel derives
        from them once (filled only outside a CUDA graph capture: the capture's memory is the
        graph's)."""
        return None

    # --- varlen blocks, [T, H, D] with cu_seqlens ----------------------------------------
    def forward_varlen(
        self,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(out_THD, lse_HT)``; documents are attended to independently (``window``
        per document, bottom-right aligned as for dense blocks; ``unrounded`` as for
        :meth:`forward`)."""
        q_THD, (k_THD, v_THD), scale, _ = kernel_inputs(q_THD, k_THD, v_THD, scale=scale)
        return self._forward_varlen(
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            **self._forward_options(causal, scale, window, unrounded),
        )

    def merge_forward(
        self,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_acc_BSHD: Tensor,
        lse_acc_BHS: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> bool:
        """Merge one block into the running ``out_acc`` (accumulation dtype, shaped as
        :meth:`forward`'s out, a unit last stride: the block's rows of the ring's
        accumulator) and ``lse_acc`` (shaped as its lse, a unit last stride) in place, as the
        engine's merge of :meth:`forward`'s ``unrounded`` result would (Note [Online-softmax
        merge]); False where this backend does not for this call: nothing done, the caller
        merges."""
        if not self.merges_outputs:
            return False
        q_BSHD, (k_BSHD, v_BSHD), scale, _ = kernel_inputs(q_BSHD, k_BSHD, v_BSHD, scale=scale)
        return self._merge_forward(
            q_BSHD, k_BSHD, v_BSHD, out_acc_BSHD, lse_acc_BHS,
            causal=causal, scale=scale, window=window,
        )  # fmt: skip

    def merge_forward_varlen(
        self,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        out_acc_THD: Tensor,
        lse_acc_HT: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        seqused_q: Tensor | None = None,
    ) -> bool:
        """:meth:`merge_forward` of a varlen block (:meth:`forward_varlen`'s arguments). With
        ``seqused_q`` (int32 ``[N]``), ``q``, ``out_acc`` and ``lse_acc`` are a rank's whole
        local tensors and the block's queries of document ``d`` are rows
        ``[cu_seqlens_q[d], cu_seqlens_q[d] + seqused_q[d])`` of them (``VarlenQueryRows``;
        Note [Varlen blocks merged where their rows lie]): the other rows stay as they are."""
        if not self.merges_outputs or (seqused_q is not None and not self.merges_by_document):
            return False
        q_THD, (k_THD, v_THD), scale, _ = kernel_inputs(q_THD, k_THD, v_THD, scale=scale)
        return self._merge_forward_varlen(
            q_THD, k_THD, v_THD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            out_acc_THD, lse_acc_HT, causal=causal, scale=scale, window=window,
            seqused_q=seqused_q,
        )  # fmt: skip

    def _merge_forward(self, q_BSHD, k_BSHD, v_BSHD, out_acc, lse_acc, *, causal, scale, window):
        return False

    def _merge_forward_varlen(
        self, q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, out_acc, lse_acc, *,
        causal, scale, window, seqused_q=None,
    ):  # fmt: skip
        return False

    def _forward_options(self, causal, scale, window, unrounded) -> dict:
        """The keywords of ``_forward`` / ``_forward_varlen``: ``unrounded`` only for a
        backend with ``unrounded_outputs``."""
        options = dict(causal=causal, scale=scale, window=window)
        return dict(options, unrounded=True) if unrounded and self.unrounded_outputs else options

    def backward_varlen(
        self,
        dout_THD: Tensor,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out_THD: Tensor,
        lse_HT: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq_THD, dk_THD, dv_THD)`` given the global out/lse."""
        q_THD, (dout_THD, k_THD, v_THD), scale, sign = kernel_inputs(
            q_THD, dout_THD, k_THD, v_THD, scale=scale
        )
        dq, dk, dv = self._backward_varlen(
            dout_THD,
            q_THD,
            k_THD,
            v_THD,
            out_THD,
            lse_HT,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            scale=scale,
            window=window,
        )
        return unfold_scale_sign(dq, sign), dk, dv

    # --- what a backend implements (same arguments, prepared inputs) ----------------------
    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        raise NotImplementedError

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        raise NotImplementedError

    def _backward_unrounded(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        """``_backward`` with gradients not rounded to the input dtype (``unrounded_grads``)."""
        raise NotImplementedError

    def _forward_varlen(
        self,
        q_THD,
        k_THD,
        v_THD,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal,
        scale,
        window,
    ):
        raise NotImplementedError

    def _backward_varlen(
        self,
        dout_THD,
        q_THD,
        k_THD,
        v_THD,
        out_THD,
        lse_HT,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal,
        scale,
        window,
    ):
        raise NotImplementedError


# Note [Kernel inputs]
# ~~~~~~~~~~~~~~~~~~~~
# What every backend receives, whatever the user passed (``BlockKernel.forward`` & co. prepare
# it once, in one place):
#
# * a unit stride in the last (head) dim. Fused kernels read each head vector as one run of
#   memory; a view such as ``x[..., ::2]``, a ``channels_last`` tensor or the expanded
#   ``dout`` of ``out.sum().backward()`` (stride 0) is copied; every other stride pattern
#   (transposes, expanded batch/head dims, halves of a buffer) is passed as it is.
# * a positive scale. Flash kernels take the row maximum of the *unscaled* scores and scale
#   afterwards, which picks the minimum for a negative scale (overflow, NaN), and a zero scale
#   breaks their ``log2`` rescaling. With ``sign = -1`` (scale < 0) or ``0`` (scale == 0):
#
#       q' = sign * q,  scale' = |scale| (1 for 0)   =>   scale' * q'.k == scale * q.k
#       dq = sign * dq'                              (dk, dv are unchanged)
#
#   ``0 * q`` keeps NaN/Inf in ``q`` visible (0 * inf = NaN, as in ``0 * (q . k)``).


def kernel_inputs(
    q: Tensor, *others: Tensor, scale: float
) -> tuple[Tensor, list[Tensor], float, float]:
    """``(q', others', scale', sign)`` as the backends receive them (Note [Kernel inputs]):
    each tensor itself if its last dim has stride 1, else a contiguous copy; ``q' = sign * q``
    with ``scale' > 0`` and ``scale' * q' == scale * q``."""
    q, *others = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, *others))
    if scale > 0:
        return q, others, scale, 1.0
    sign = -1.0 if scale < 0 else 0.0
    return q * sign, others, -scale if scale < 0 else 1.0, sign


def unfold_scale_sign(dq: Tensor, sign: float) -> Tensor:
    """The gradient of the caller's ``q`` from that of ``q' = sign * q``."""
    return dq if sign == 1.0 else dq * sign


def window_mask(s_q: int, s_k: int, window: tuple[int, int], device: torch.device) -> Tensor:
    """``[S_q, S_k]`` bool mask (True = visible) of a bottom-right aligned ``window``."""
    d = (
        torch.arange(s_k, device=device)[None, :]
        - torch.arange(s_q, device=device)[:, None]
        - (s_k - s_q)
    )
    return in_window(d, window)


def in_window(d: Tensor, window: tuple[int, int]) -> Tensor:
    """Where ``-left <= d <= right`` (-1: that side unbounded), ``d`` being the key's offset
    from the query's bottom-right aligned diagonal, ``j - i - (S_k - S_q)``."""
    left, right = window
    visible = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    if left >= 0:
        visible &= d >= -left
    if right >= 0:
        visible &= d <= right
    return visible
