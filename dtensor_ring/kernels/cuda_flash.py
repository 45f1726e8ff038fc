"""PyTorch's vendored FlashAttention-2: ``aten._flash_attention_forward`` / ``_backward``.

These ops take the flash-attn layouts directly: ``[B, S, H, D]`` for dense blocks and packed
``[T, H, D]`` with int32 ``cum_seq_q/k`` for varlen, so no transposes are needed. What they
require and return (read in ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``
and ``torch/_meta_registrations.py``, torch 2.11-2.13; checked against fp64 on an H200 with
torch 2.11.0+cu130 by ``tests/gpu/check_kernels.py``, dense and varlen, GQA 32:8):

* CUDA sm80+, fp16/bf16, head dim a multiple of 8 and at most 256, ``H % H_kv == 0`` (GQA is
  native: the backward sums the expanded dK/dV over each group itself).
* Inputs need only a unit stride in the last dim (Note [Kernel inputs] in ``base.py``); other
  strides are passed to the kernel.
* ``lse`` is fp32 ``[B, H, S]`` for dense and ``[H, T]`` (unpadded, "unpadded_lse") for
  varlen: exactly our ``lse_BHS`` / ``lse_HT``. The backward reads ``lse`` through its data
  pointer with implicit contiguous strides, so we pass it ``.contiguous()``.
* Backward makes ``grad_out`` and ``out`` contiguous itself. It takes the forward's
  ``rng_state``/``unused`` tensors but reads them only when ``dropout_p > 0``; we never use
  dropout, so we pass empty tensors (as ``torch/nn/attention/varlen.py`` does).
* The backward is deterministic only under ``torch.use_deterministic_algorithms(True)``, which
  the op reads; a ``deterministic=True`` call is refused otherwise.
* ``causal`` is aligned bottom-right when ``S_q != S_k`` (per document for varlen): key ``j``
  is visible to query ``i`` iff ``j <= i + S_k - S_q``. For the square causal blocks the engine
  sends this is the top-left mask of the interface.
* ``window_size_left/right`` (keyword, ``None`` = -1 = unbounded) are flash-attn's sliding
  window, aligned bottom-right like ``causal``: the interface's ``window`` as the adapter
  passes it (Note [FlashAttention-2's unbounded window sides]: a larger ``max_seqlen_k`` for
  varlen calls, a varlen call for some dense blocks).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .._compat import missing_aten_ops, require_aten_op
from .base import BlockKernel, KernelCall

_FORWARD = "_flash_attention_forward"
_BACKWARD = "_flash_attention_backward"


def _window_args(window: tuple[int, int] | None) -> dict[str, int]:
    """The ops' window keywords for the interface's ``window`` (none for no window)."""
    if window is None:
        return {}
    return {"window_size_left": window[0], "window_size_right": window[1]}


# Note [FlashAttention-2's unbounded window sides]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FlashAttention-2's host code (``flash_api.cpp``: the forwards and backwards, PyTorch's copy
# and the flash-attn package alike) rewrites a window before its kernel sees it:
#
#     a side >= max_seqlen_k           -> -1
#     left < 0 <= right (not causal)   -> left = max_seqlen_k
#     right < 0 <= left                -> right = max_seqlen_k
#
# and the kernel shows query i of a document of S_q queries and S_k keys the keys
# ``i + S_k - S_q - left <= j < i + 1 + S_k - S_q + right``. A left side of max_seqlen_k
# (>= S_k) always reaches key 0; a right side of max_seqlen_k reaches the last key from the
# first query only if max_seqlen_k >= S_q - 1. A document with more queries than that loses
# keys in its first rows. S_q = 6, S_k = 3, window (0, -1) (max_seqlen_k = 3):
#
#          asked      FlashAttention-2 (right = 3)
#     q0   x x x      x . .
#     q1   x x x      x x .
#     q2   x x x      x x x
#     q3   x x x      x x x
#     q4   . x x      . x x
#     q5   . . x      . . x
#
# The placed document plans send such blocks (a rank's run of a document against a shorter
# earlier run of it: found wrong on an H100 by ``tests/gpu/check_flex.py`` on 2026-12-05), and
# so does llama3's prefix block (a document's local queries against its few keys on earlier
# ranks, dense). The varlen calls pass ``max(max_seqlen_q, max_seqlen_k)`` with a window
# (:func:`flash2_max_seqlen_k`): the kernel reads only an upper bound of the key lengths from
# it (its loops run over each document's own), and every rewritten side is then unbounded
# for every document. The dense op takes ``max_seqlen_k = S_k`` and cannot be told
# otherwise: a windowed dense block with ``S_q > S_k + 1`` runs as a varlen call, a document
# per batch row (:func:`flash2_dense_needs_varlen`; the ring plans never send one). Both
# rules live in :class:`Flash2Kernel`, the base of the two FlashAttention-2 adapters. The
# tests check both rules on a model of the rewrite (``tests/flash2_model.py``) for
# every shape and window, and replay the plans through it.


def flash2_max_seqlen_k(
    max_seqlen_q: int, max_seqlen_k: int, window: tuple[int, int] | None
) -> int:
    """The ``max_seqlen_k`` a FlashAttention-2 varlen call passes for the interface's
    ``window`` (Note [FlashAttention-2's unbounded window sides])."""
    return max_seqlen_k if window is None else max(max_seqlen_k, max_seqlen_q)


def flash2_dense_needs_varlen(s_q: int, s_k: int, window: tuple[int, int] | None) -> bool:
    """Whether FlashAttention-2's dense op could compute ``window`` on an ``s_q x s_k`` block
    other than asked (Note [FlashAttention-2's unbounded window sides]: it takes
    ``max_seqlen_k = s_k``): then the block runs as a varlen call, a document per batch row."""
    return window is not None and s_q > s_k + 1


class Flash2Kernel(BlockKernel):
    """What the FlashAttention-2 adapters share: the interface's window kept whatever the ops'
    host code does with it (Note [FlashAttention-2's unbounded window sides]). A subclass
    implements ``_op_forward`` / ``_op_backward`` / ``_op_forward_varlen`` /
    ``_op_backward_varlen``: the ops as they are, with the arguments of ``_forward`` & co."""

    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        if not flash2_dense_needs_varlen(q_BSHD.shape[1], k_BSHD.shape[1], window):
            return self._op_forward(
                q_BSHD, k_BSHD, v_BSHD, causal=causal, scale=scale, window=window
            )
        (B, S_q, H, D), S_k, H_kv = q_BSHD.shape, k_BSHD.shape[1], k_BSHD.shape[2]
        cu_q, cu_k = _row_bounds(B, S_q, S_k, q_BSHD.device)  # a document per batch row
        out_THD, lse_HT = self._forward_varlen(
            q_BSHD.reshape(B * S_q, H, D),
            k_BSHD.reshape(B * S_k, H_kv, D),
            v_BSHD.reshape(B * S_k, H_kv, D),
            cu_q, cu_k, S_q, S_k, causal=causal, scale=scale, window=window,
        )  # fmt: skip
        return out_THD.view(B, S_q, H, D), lse_HT.view(H, B, S_q).transpose(0, 1).contiguous()

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        if not flash2_dense_needs_varlen(q_BSHD.shape[1], k_BSHD.shape[1], window):
            return self._op_backward(
                dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS,
                causal=causal, scale=scale, window=window,
            )  # fmt: skip
        (B, S_q, H, D), S_k, H_kv = q_BSHD.shape, k_BSHD.shape[1], k_BSHD.shape[2]
        cu_q, cu_k = _row_bounds(B, S_q, S_k, q_BSHD.device)  # as in _forward
        rows_q = [x.reshape(B * S_q, H, D) for x in (dout_BSHD, q_BSHD)]
        rows_kv = [x.reshape(B * S_k, H_kv, D) for x in (k_BSHD, v_BSHD)]
        dq, dk, dv = self._backward_varlen(
            *rows_q, *rows_kv, out_BSHD.reshape(B * S_q, H, D),
            lse_BHS.transpose(0, 1).reshape(H, B * S_q), cu_q, cu_k, S_q, S_k,
            causal=causal, scale=scale, window=window,
        )  # fmt: skip
        return dq.view(B, S_q, H, D), dk.view(B, S_k, H_kv, D), dv.view(B, S_k, H_kv, D)

    def _forward_varlen(
        self, q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, *, causal, scale, window
    ):
        max_k = flash2_max_seqlen_k(max_q, max_k, window)
        return self._op_forward_varlen(
            q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
            window=window,
        )  # fmt: skip

    def _backward_varlen(
        self, dout_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, *,
        causal, scale, window,
    ):  # fmt: skip
        max_k = flash2_max_seqlen_k(max_q, max_k, window)
        return self._op_backward_varlen(
            dout_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k,
            causal=causal, scale=scale, window=window,
        )  # fmt: skip

    def _op_forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        raise NotImplementedError

    def _op_backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        raise NotImplementedError

    def _op_forward_varlen(
        self, q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, *, causal, scale, window
    ):
        raise NotImplementedError

    def _op_backward_varlen(
        self, dout_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, *,
        causal, scale, window,
    ):  # fmt: skip
        raise NotImplementedError


def _row_bounds(B: int, S_q: int, S_k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """int32 ``cu_seqlens`` of ``B`` rows of ``S_q`` queries and of ``S_k`` keys."""
    rows = torch.arange(B + 1, dtype=torch.int32)
    return (rows * S_q).to(device), (rows * S_k).to(device)


def _no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """The ``(rng_state, unused)`` pair the backward takes; unread without dropout."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def head_dim_reason(call: KernelCall) -> str | None:
    """Why ``call``'s head dim is refused by kernels that need a multiple of 8."""
    if call.head_dim % 8:
        return f"head dim {call.head_dim} is not a multiple of 8 (pad it, or use another backend)"
    return None


def deterministic_reason(call: KernelCall) -> str | None:
    """Why a flash backward cannot honour ``call.deterministic``: it is deterministic only
    under ``torch.use_deterministic_algorithms(True)`` (not ``warn_only``)."""
    strict = torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )
    if call.deterministic and not strict:
        return (
            "deterministic=True: its backward is deterministic only under "
            "torch.use_deterministic_algorithms(True)"
        )
    return None


def cuda_sm80_reason() -> str | None:
    """``None`` if CUDA is usable and the current device is sm80 (Ampere) or newer."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"needs an sm80+ GPU (Ampere or newer), the current device is sm{major}{minor}"
    return None


class TorchFlashKernel(Flash2Kernel):
    """FlashAttention-2 as vendored in PyTorch (dense and varlen, GQA native)."""

    name: ClassVar[str] = "cuda_flash"
    relative_speed: ClassVar[float] = 0.57  # 8192-token blocks, 359 vs 630 TFLOP/s forward
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    max_head_dim: ClassVar[int] = 256
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True

    def is_available(self) -> str | None:
        missing = missing_aten_ops(_FORWARD, _BACKWARD)
        if missing is not None:
            return missing
        if not torch.backends.cuda.is_flash_attention_available():
            return "this PyTorch build has no flash attention kernels"
        return cuda_sm80_reason()

    def extra_reason(self, call: KernelCall) -> str | None:
        return head_dim_reason(call) or deterministic_reason(call)

    def _op_forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        out_BSHD, lse_BHS, *_ = require_aten_op(_FORWARD)(
            q_BSHD,
            k_BSHD,
            v_BSHD,
            None,
            None,
            q_BSHD.shape[1],
            k_BSHD.shape[1],
            0.0,
            causal,
            False,
            scale=scale,
            **_window_args(window),
        )
        return out_BSHD, lse_BHS

    def _op_backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        rng_state, unused = _no_dropout_rng(q_BSHD.device)
        dq, dk, dv = require_aten_op(_BACKWARD)(
            dout_BSHD,
            q_BSHD,
            k_BSHD,
            v_BSHD,
            out_BSHD,
            lse_BHS.contiguous(),
            None,
            None,
            q_BSHD.shape[1],
            k_BSHD.shape[1],
            0.0,
            causal,
            rng_state,
            unused,
            scale=scale,
            **_window_args(window),
        )
        return dq, dk, dv

    def _op_forward_varlen(
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
        out_THD, lse_HT, *_ = require_aten_op(_FORWARD)(
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            0.0,
            causal,
            False,
            scale=scale,
            **_window_args(window),
        )
        return out_THD, lse_HT

    def _op_backward_varlen(
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
        rng_state, unused = _no_dropout_rng(q_THD.device)
        dq, dk, dv = require_aten_op(_BACKWARD)(
            dout_THD,
            q_THD,
            k_THD,
            v_THD,
            out_THD,
            lse_HT.contiguous(),
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            0.0,
            causal,
            rng_state,
            unused,
            scale=scale,
            **_window_args(window),
        )
        return dq, dk, dv
