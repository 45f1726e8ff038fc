"""CPU fused kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

The op works in the SDPA layout ``[B, H, S, D]``; we hand it transposed views of our
``[B, S, H, D]`` tensors (no copies) and transpose its outputs back. It handles GQA natively.
Two behaviours to know (neither reaches it from the engine, which only asks for square causal
blocks without fully masked rows): it aligns the causal mask top-left when ``S_q != S_k``, and
it returns ``lse = 0`` for a fully masked row. A sliding window is passed as an additive mask
(``-inf`` outside the window) in the query's dtype, the only mask dtype the op accepts besides
none.

Non-finite values: the op multiplies masked probabilities (0) with the values of masked keys,
so a NaN/Inf key or value reaches rows that cannot see it (``0 * inf = nan``), and its
vectorised max can drop a NaN score. A block whose inputs hold a NaN or Inf is therefore
computed by the math kernel, which is strict (Note [Strict non-finite values] in ``math.py``).
On CPU the check is one pass over the block's inputs, small next to the attention itself.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .._compat import missing_aten_ops, require_aten_op
from .base import BlockKernel, accumulation_dtype, window_mask
from .math import MathKernel

_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _window_bias(q_BSHD: Tensor, k_BSHD: Tensor, window: tuple[int, int] | None) -> Tensor | None:
    """Additive ``[S_q, S_k]`` mask of ``window`` in the query's dtype (None: no window)."""
    if window is None:
        return None
    visible = window_mask(q_BSHD.shape[1], k_BSHD.shape[1], window, q_BSHD.device)
    bias = torch.zeros(visible.shape, dtype=q_BSHD.dtype, device=q_BSHD.device)
    return bias.masked_fill_(~visible, float("-inf"))


def _all_finite(*xs: Tensor) -> bool:
    """Whether every element of ``xs`` is finite: each tensor's min and max (both NaN where it
    holds a NaN, infinite where it holds an infinity), one reduction pass and one host read
    for all of them (``isfinite(x).all()`` per tensor wrote a boolean copy of each: 35x the
    time on a 4096-token block, 2-core CPU, torch 2.13)."""
    ends = [end for x in xs if x.numel() for end in torch.aminmax(x)]
    return not ends or bool(torch.stack(ends).isfinite().all())


class CpuFlashKernel(BlockKernel):
    """PyTorch's fused flash-attention kernel for CPU."""

    name: ClassVar[str] = "cpu_flash"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    supports_window: ClassVar[bool] = True

    def is_available(self) -> str | None:
        return missing_aten_ops(_FORWARD, _BACKWARD)

    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        if not _all_finite(q_BSHD, k_BSHD, v_BSHD):
            return _STRICT._forward(
                q_BSHD, k_BSHD, v_BSHD, causal=causal, scale=scale, window=window
            )
        out_BHSD, lse_BHS = require_aten_op(_FORWARD)(
            q_BSHD.transpose(1, 2),
            k_BSHD.transpose(1, 2),
            v_BSHD.transpose(1, 2),
            0.0,
            causal,
            attn_mask=_window_bias(q_BSHD, k_BSHD, window),
            scale=scale,
        )
        return out_BHSD.transpose(1, 2), lse_BHS.to(accumulation_dtype(q_BSHD.dtype))

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        if not _all_finite(dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS):
            return _STRICT._backward(
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
        dq, dk, dv = require_aten_op(_BACKWARD)(
            dout_BSHD.transpose(1, 2),
            q_BSHD.transpose(1, 2),
            k_BSHD.transpose(1, 2),
            v_BSHD.transpose(1, 2),
            out_BSHD.transpose(1, 2),
            lse_BHS.to(accumulation_dtype(q_BSHD.dtype)),
            0.0,
            causal,
            attn_mask=_window_bias(q_BSHD, k_BSHD, window),
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_STRICT = MathKernel()
