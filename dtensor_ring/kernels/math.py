"""Plain-torch reference kernel: any device, any float dtype, dense and varlen.

Computes in the accumulation dtype (fp32, or fp64 for fp64 inputs) with explicit score
matrices, so it is slow and memory-hungry; it is the fallback when no fused kernel fits and the
yardstick the fused kernels are tested against. GQA is handled by viewing the query heads as
``[H_kv, G]`` groups, never by repeating K/V.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import BlockKernel, accumulation_dtype, in_window, window_mask


def _grouped(x_BSHD: Tensor, num_kv_heads: int) -> Tensor:
    """``[B, S, H, D]`` -> ``[B, H_kv, G, S, D]`` in the accumulation dtype."""
    B, S, H, D = x_BSHD.shape
    x = x_BSHD.to(accumulation_dtype(x_BSHD.dtype))
    return x.view(B, S, num_kv_heads, H // num_kv_heads, D).permute(0, 2, 3, 1, 4)


def _ungrouped(x_BKGSD: Tensor) -> Tensor:
    """Inverse of :func:`_grouped` (without the dtype cast): ``[B, S, H, D]``."""
    B, K, G, S, D = x_BKGSD.shape
    return x_BKGSD.permute(0, 3, 1, 2, 4).reshape(B, S, K * G, D)


def _kv(x_BSHD: Tensor) -> Tensor:
    """``[B, S, H_kv, D]`` -> ``[B, H_kv, 1, S, D]`` in the accumulation dtype."""
    return x_BSHD.to(accumulation_dtype(x_BSHD.dtype)).permute(0, 2, 1, 3).unsqueeze(2)


def _dense_mask(
    s_q: int, s_k: int, causal: bool, window: tuple[int, int] | None, device: torch.device
) -> Tensor | None:
    """The visible-pairs mask of a dense block (None: everything visible)."""
    if causal:
        return torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()
    return None if window is None else window_mask(s_q, s_k, window, device)


def _varlen_mask(
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    t_q: int,
    t_k: int,
    causal: bool,
    window: tuple[int, int] | None = None,
) -> Tensor:
    """``[T_q, T_k]`` mask: same document, and key position <= query position if causal; a
    ``window`` per document, aligned bottom-right (key ``j`` of a document of ``n_k`` keys
    visible to its query ``i`` of ``n_q`` iff ``-left <= j - i - (n_k - n_q) <= right``)."""
    device = cu_seqlens_q.device
    doc_q = torch.searchsorted(cu_seqlens_q[1:], torch.arange(t_q, device=device), right=True)
    doc_k = torch.searchsorted(cu_seqlens_k[1:], torch.arange(t_k, device=device), right=True)
    mask = doc_q[:, None] == doc_k[None, :]
    pos_q = torch.arange(t_q, device=device) - cu_seqlens_q[doc_q]
    pos_k = torch.arange(t_k, device=device) - cu_seqlens_k[doc_k]
    if causal:
        mask &= pos_k[None, :] <= pos_q[:, None]
    if window is not None:
        lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        mask &= in_window(
            pos_k[None, :] - pos_q[:, None] - (lengths_k - lengths_q)[doc_q][:, None], window
        )
    return mask


def _scores(q_BSHD: Tensor, k_BSHD: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    s = _grouped(q_BSHD, k_BSHD.shape[2]) @ _kv(k_BSHD).transpose(-1, -2) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probs(scores: Tensor, lse_BKGS: Tensor) -> Tensor:
    # Rows with no visible key have lse = -inf; their probabilities are 0, not NaN.
    finite = torch.isfinite(lse_BKGS)
    return torch.exp(scores - torch.where(finite, lse_BKGS, 0).unsqueeze(-1)).masked_fill(
        ~finite.unsqueeze(-1), 0
    )


def _forward(q, k, v, scale, mask):
    B, S, H, D = q.shape
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # [B, H_kv, G, S]
    out = _probs(s, lse) @ _kv(v)
    return _ungrouped(out).to(q.dtype), lse.reshape(B, H, S)


def _backward(dout, q, k, v, out, lse, scale, mask):
    B, S, H, D = q.shape
    H_kv = k.shape[2]
    s = _scores(q, k, scale, mask)
    p = _probs(s, lse.to(s.dtype).view(B, H_kv, H // H_kv, S))
    do = _grouped(dout, H_kv)
    dv = (p.transpose(-1, -2) @ do).sum(2)  # [B, H_kv, S_k, D]
    dp = do @ _kv(v).transpose(-1, -2)
    delta = (do * _grouped(out, H_kv)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = ds @ _kv(k)
    dk = (ds.transpose(-1, -2) @ _grouped(q, H_kv)).sum(2)
    return (
        _ungrouped(dq).to(q.dtype),
        dk.transpose(1, 2).to(k.dtype),
        dv.transpose(1, 2).to(v.dtype),
    )


class MathKernel(BlockKernel):
    """Explicit-scores attention in plain torch (reference and fallback)."""

    name: ClassVar[str] = "math"
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "meta")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    max_head_dim: ClassVar[int] = 1 << 30
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True

    def forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window=None):
        mask = _dense_mask(q_BSHD.shape[1], k_BSHD.shape[1], causal, window, q_BSHD.device)
        return _forward(q_BSHD, k_BSHD, v_BSHD, scale, mask)

    def backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window=None
    ):
        mask = _dense_mask(q_BSHD.shape[1], k_BSHD.shape[1], causal, window, q_BSHD.device)
        return _backward(dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, scale, mask)

    def forward_varlen(
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
        window=None,
    ):
        mask = _varlen_mask(
            cu_seqlens_q, cu_seqlens_k, q_THD.shape[0], k_THD.shape[0], causal, window
        )
        out, lse = _forward(q_THD[None], k_THD[None], v_THD[None], scale, mask)
        return out[0], lse[0]

    def backward_varlen(
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
        window=None,
    ):
        mask = _varlen_mask(
            cu_seqlens_q, cu_seqlens_k, q_THD.shape[0], k_THD.shape[0], causal, window
        )
        grads = _backward(
            dout_THD[None],
            q_THD[None],
            k_THD[None],
            v_THD[None],
            out_THD[None],
            lse_HT[None],
            scale,
            mask,
        )
        return tuple(g[0] for g in grads)
