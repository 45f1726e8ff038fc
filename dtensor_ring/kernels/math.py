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
    mask = None if window is None else window_mask(s_q, s_k, window, device)
    if causal:
        tril = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()
        mask = tril if mask is None else mask & tril
    return mask


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


# Note [Strict non-finite values]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A NaN or Inf in a token must reach exactly the rows that see it, as in attention computed
# row by row over the visible keys. A dense formulation leaks it into masked pairs: a masked
# probability is 0, and ``0 * inf = 0 * nan = nan`` inside ``P @ V``, ``dS @ K`` or
# ``dS^T @ Q``. This kernel therefore
#
# * fills masked scores with -inf and masked probabilities / score gradients with 0 by
#   ``masked_fill`` (which replaces a NaN, where a product would keep it), and
# * multiplies by a tensor holding non-finite values with :func:`_visible_matmul`: the finite
#   part by one matmul, the few key/query columns holding non-finite values pair by pair under
#   the mask.
#
#      p (masked = 0)         v              p @ where(finite, v, 0)
#     [ .3  0   0 ]       [ 1    2  ]        + for non-finite v[j, d], only rows i with
#     [ .5  .5  0 ]   @   [ 3    4  ]          visible(i, j) receive p[i, j] * v[j, d]
#     [ .2  .3 .5 ]       [ nan  6  ]   =>   rows 0, 1 stay finite; row 2 is NaN in dim 0
#
# The only rows whose probabilities are zeroed wholesale are a block's rows with
# ``lse == -inf`` (every score -inf): they carry no weight in a merge. In the backward, whose
# lse is the global one, such a row is NaN (softmax of only -inf scores is 0 / 0). A row with
# ``lse = +inf`` or NaN (a +Inf or NaN score) has NaN probabilities throughout, as softmax
# gives (``exp(s - inf) / sum`` with a NaN sum), never a silently finite row.


def _scores(q_BSHD: Tensor, k_BSHD: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    s = _grouped(q_BSHD, k_BSHD.shape[2]) @ _kv(k_BSHD).transpose(-1, -2) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probs(scores: Tensor, lse_BKGS: Tensor, mask: Tensor | None, empty_rows: float) -> Tensor:
    """``exp(scores - lse)``: 0 for masked pairs, ``empty_rows`` in rows with ``lse == -inf``
    and NaN in rows with ``lse == +inf`` (softmax's ``exp(inf - inf) / sum``)."""
    empty = lse_BKGS == float("-inf")
    p = torch.exp(scores - lse_BKGS.masked_fill(empty, 0).unsqueeze(-1))
    p = p.masked_fill(empty.unsqueeze(-1), empty_rows)
    p = p.masked_fill((lse_BKGS == float("inf")).unsqueeze(-1), float("nan"))
    return p if mask is None else p.masked_fill(~mask, 0)


def _visible_matmul(a: Tensor, b: Tensor, mask: Tensor | None) -> Tensor:
    """``a @ b`` over the pairs ``mask [M, N]`` (or any shape broadcasting with ``a``) makes
    visible, ``a [..., M, N]`` being 0 at masked pairs, so that non-finite rows of
    ``b [..., N, D]`` reach only the rows of the result that see them (Note [Strict non-finite
    values])."""
    if mask is None or b.is_meta:
        return a @ b
    finite = torch.isfinite(b)
    if bool(finite.all()):
        return a @ b
    out = a @ b.masked_fill(~finite, 0)
    cols = (~finite).any(-1).reshape(-1, b.shape[-2]).any(0).nonzero().flatten()
    a_c = a.index_select(-1, cols).unsqueeze(-1)  # [..., M, c, 1]
    b_c = b.masked_fill(finite, 0).index_select(-2, cols).unsqueeze(-3)  # [..., 1, c, D]
    pairs = torch.where(mask[..., cols, None], a_c * b_c, 0)
    return out + pairs.sum(-2)


def _forward(q, k, v, scale, mask):
    B, S, H, D = q.shape
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # [B, H_kv, G, S]
    out = _visible_matmul(_probs(s, lse, mask, empty_rows=0.0), _kv(v), mask)
    return _ungrouped(out).to(q.dtype), lse.reshape(B, H, S)


def _backward(dout, q, k, v, out, lse, scale, mask):
    B, S, H, D = q.shape
    H_kv = k.shape[2]
    mask_t = None if mask is None else mask.T
    s = _scores(q, k, scale, mask)
    # the global lse: -inf there means every score of the row was -inf, a NaN row
    p = _probs(s, lse.to(s.dtype).view(B, H_kv, H // H_kv, S), mask, empty_rows=float("nan"))
    do = _grouped(dout, H_kv)
    dv = _visible_matmul(p.transpose(-1, -2), do, mask_t).sum(2)  # [B, H_kv, S_k, D]
    dp = do @ _kv(v).transpose(-1, -2)
    delta = (do * _grouped(out, H_kv)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    if mask is not None:
        ds = ds.masked_fill(~mask, 0)
    dq = _visible_matmul(ds, _kv(k), mask)
    dk = _visible_matmul(ds.transpose(-1, -2), _grouped(q, H_kv), mask_t).sum(2)
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

    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        mask = _dense_mask(q_BSHD.shape[1], k_BSHD.shape[1], causal, window, q_BSHD.device)
        return _forward(q_BSHD, k_BSHD, v_BSHD, scale, mask)

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        mask = _dense_mask(q_BSHD.shape[1], k_BSHD.shape[1], causal, window, q_BSHD.device)
        return _backward(dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, scale, mask)

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
        mask = _varlen_mask(
            cu_seqlens_q, cu_seqlens_k, q_THD.shape[0], k_THD.shape[0], causal, window
        )
        out, lse = _forward(q_THD[None], k_THD[None], v_THD[None], scale, mask)
        return out[0], lse[0]

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
