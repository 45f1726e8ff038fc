"""cuDNN fused attention: ``aten._scaled_dot_product_cudnn_attention`` and its backward.

The op works in the SDPA layout ``[B, H, S, D]``; we hand it ``transpose(1, 2)`` views of our
``[B, S, H, D]`` tensors (no copies). cuDNN takes arbitrary strides (they are baked into its
cached execution graph), and this BSHD-backed layout is what SDPA itself passes for a model that
keeps BSHD activations; the output is allocated with the query's layout, so ``out`` comes back
as a plain BSHD tensor.

What we found in the PyTorch sources (``aten/src/ATen/native/cudnn/MHA.cpp`` and
``transformers/cuda/sdp_utils.cpp``) and checked on an H200 with torch 2.11.0+cu130 and
cuDNN 9.19 (``tests/gpu/check_kernels.py``: out/lse/dq/dk/dv against fp64, bf16 and fp16,
``H_kv`` 32 and 8, causal and not, 1k-8k blocks and an 8192x4096 block with K/V views):

* ``lse`` comes back as fp32 ``[B, H, S, 1]`` (contiguous); we return a ``[B, H, S]`` view of
  it and give the backward ``lse_BHS.unsqueeze(-1)``, the shape the forward returned (torch
  2.11 also accepts ``[B, H, S]`` there).
* GQA is native: the graph takes K/V with their own head count, and SDPA's cuDNN gate accepts
  ``H != H_kv`` (``check_batch_size_and_num_heads_dense<enable_gqa=true>``); dK/dV come back
  with ``H_kv`` heads.
* Head dim: a multiple of 8, at most 128, or 256 on sm90 (H100/H200) with cuDNN >= 9.10.
  ``S_k == 1`` is not supported (not checked here: the engine never sends such blocks).
* The backward graph is cached (PyTorch's ``MHAParams`` key) without the strides of ``out``
  and ``dout``: a graph built for one layout of them is reused for another, and the
  gradients come out wrong by 100-1000x one bf16 step, with no error (H200, torch 2.11,
  cuDNN 9.19: PyTorch's own SDPA on cuDNN after ours, or ours after its, whichever came
  second; and ours alone with a ``dout`` laid out unlike ``out``: ``tests/gpu/check_inputs.py``
  and ``check_module_cp.py``). So ``out`` and ``dout`` always go in the query's layout, the
  one PyTorch's calls use (its forward allocates ``out`` like the query, its backward gives
  ``dout`` ``out``'s strides); a copy when they differ.
* The backward is not deterministic (PyTorch warns so under deterministic mode).
* ``causal`` is the top-left mask, as in the interface. The op has no sliding-window
  arguments, so windowed calls go to another backend. Dropout is never used, so the philox
  seed/offset the backward takes are unread placeholders.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .._compat import missing_aten_ops, require_aten_op
from .base import BlockKernel, KernelCall
from .cuda_flash import cuda_sm80_reason, head_dim_reason

_MIN_CUDNN = 90000  # cuDNN 9.0: the first version PyTorch's SDPA uses for attention
_HOPPER_D256_CUDNN = 91000  # cuDNN 9.10: head dims up to 256 on sm90
_FORWARD = "_scaled_dot_product_cudnn_attention"
_BACKWARD = "_scaled_dot_product_cudnn_attention_backward"


def _query_layout(q_BSHD, out_BSHD, dout_BSHD):
    """``(q, out, dout)`` with ``out`` and ``dout`` in ``q``'s layout (``q`` made contiguous
    first unless it is BSHD- or BHSD-dense): what PyTorch's own calls pass (cuDNN allocates
    ``out`` like the query; its backward gives ``dout`` ``out``'s strides), and what a backward
    graph cached for this query layout assumes (the list above)."""
    if not (q_BSHD.is_contiguous() or q_BSHD.transpose(1, 2).is_contiguous()):
        q_BSHD = q_BSHD.contiguous()

    def like_q(t):
        return t if t.stride() == q_BSHD.stride() else torch.empty_like(q_BSHD).copy_(t)

    return q_BSHD, like_q(out_BSHD), like_q(dout_BSHD)


def _no_window(window: tuple[int, int] | None) -> None:
    if window is not None:  # selection never routes a windowed call here (supports_window)
        raise ValueError("the cudnn backend has no sliding-window mask; use backend='cuda_flash'")


class CudnnKernel(BlockKernel):
    """cuDNN's fused flash attention, through PyTorch's SDPA op (dense blocks, GQA native)."""

    name: ClassVar[str] = "cudnn"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    max_head_dim: ClassVar[int] = 256  # 128 off sm90, see extra_reason
    deterministic_backward: ClassVar[bool] = False

    def is_available(self) -> str | None:
        missing = missing_aten_ops(_FORWARD, _BACKWARD)
        if missing is not None:
            return missing
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this PyTorch build"
        version = torch.backends.cudnn.version()
        if version is None or version < _MIN_CUDNN:
            return f"cuDNN {version} is older than 9.0, the first with SDPA attention"
        return cuda_sm80_reason()

    def extra_reason(self, call: KernelCall) -> str | None:
        reason = head_dim_reason(call)
        if reason is not None:
            return reason
        hopper = torch.cuda.get_device_capability() == (9, 0)
        limit = 256 if hopper and torch.backends.cudnn.version() >= _HOPPER_D256_CUDNN else 128
        if call.head_dim > limit:
            return f"head dim {call.head_dim} > {limit} on this GPU and cuDNN version"
        return None

    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        _no_window(window)
        B, S_q, H, _ = q_BSHD.shape
        out_BHSD, lse_BHS1, *_ = require_aten_op(_FORWARD)(
            q_BSHD.transpose(1, 2),
            k_BSHD.transpose(1, 2),
            v_BSHD.transpose(1, 2),
            None,
            True,
            0.0,
            causal,
            False,
            scale=scale,
        )
        return out_BHSD.transpose(1, 2), lse_BHS1.view(B, H, S_q)

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        _no_window(window)
        q_BSHD, out_BSHD, dout_BSHD = _query_layout(q_BSHD, out_BSHD, dout_BSHD)
        philox = torch.empty((), dtype=torch.long, device=q_BSHD.device)
        dq, dk, dv = require_aten_op(_BACKWARD)(
            dout_BSHD.transpose(1, 2),
            q_BSHD.transpose(1, 2),
            k_BSHD.transpose(1, 2),
            v_BSHD.transpose(1, 2),
            out_BSHD.transpose(1, 2),
            lse_BHS.contiguous().unsqueeze(-1),
            philox,
            philox,
            None,
            None,
            None,
            q_BSHD.shape[1],
            k_BSHD.shape[1],
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
