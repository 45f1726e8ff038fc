"""A CPU stand-in for the four ``flash_attn`` functions ring-flash-attention's tests import.

fp64 math attention with flash-attn 2's signatures and return conventions: ``[B, S, H, D]``
(dense) or ``[T, H, D]`` (varlen) tensors, GQA/MQA, ``causal`` and ``window_size`` aligned to
the bottom right (flash-attn's rule when ``seqlen_q != seqlen_k``), ``softmax_scale`` (default
``D ** -0.5``), and with ``return_attn_probs=True`` the triple ``(out, softmax_lse, None)``:
``softmax_lse`` fp32 without gradient, ``[B, H, S]`` dense and ``[H, T]`` varlen; a query row
that sees no key gets ``out = 0`` and ``lse = +inf``, as in flash-attn. ``out`` has the dtype
of ``q``; gradients flow through the fp64 math. ``dropout_p > 0``, ``alibi_slopes`` and
``softcap`` raise (``deterministic`` changes nothing here).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
]


def _check(dropout_p: float, softcap: float, alibi_slopes: Tensor | None) -> None:
    if dropout_p != 0:
        raise ValueError(f"this CPU reference has no dropout: dropout_p={dropout_p} must be 0")
    if softcap != 0 or alibi_slopes is not None:
        raise NotImplementedError("this CPU reference supports neither softcap nor alibi_slopes")


def _attention(q, k, v, softmax_scale, causal, window_size) -> tuple[Tensor, Tensor]:
    """One sequence: ``q`` ``[Sq, H, D]``, ``k``/``v`` ``[Sk, Hk, D]`` -> out, lse ``[H, Sq]``."""
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    if h % hk:
        raise ValueError(f"query heads {h} not a multiple of key/value heads {hk}")
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))  # [H, S, D]
    kd, vd = (t.repeat_interleave(h // hk, dim=0) for t in (kd, vd))
    scores = torch.matmul(qd, kd.transpose(1, 2)) * scale  # [H, Sq, Sk]
    i = torch.arange(sq).unsqueeze(1) + (sk - sq)  # the query's position among the keys
    j = torch.arange(sk).unsqueeze(0)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    empty = ~allowed.any(dim=-1, keepdim=True)  # [Sq, 1]: rows that see no key
    # empty rows keep finite scores (no NaN in the gradient) and are zeroed after the softmax
    scores = scores.masked_fill(~allowed & ~empty, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [H, Sq, 1]
    probs = torch.exp(scores - lse).masked_fill(empty, 0)
    out = torch.matmul(probs, vd).transpose(0, 1)  # [Sq, H, D]
    lse = lse.squeeze(-1).detach().masked_fill(empty.squeeze(-1), float("inf")).float()
    return out.to(q.dtype), lse


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_func`` on CPU: ``[B, S, H, D]``; lse ``[B, H, S]``."""
    _check(dropout_p, softcap, alibi_slopes)
    results = [
        _attention(q[b], k[b], v[b], softmax_scale, causal, window_size) for b in range(q.shape[0])
    ]
    out = torch.stack([o for o, _ in results])
    lse = torch.stack([s for _, s in results])
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_qkvpacked_func`` on CPU: ``qkv`` ``[B, S, 3, H, D]``."""
    return flash_attn_func(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``flash_attn.flash_attn_varlen_func`` on CPU: ``[T, H, D]``; lse ``[H, T]``."""
    _check(dropout_p, softcap, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError("this CPU reference has no paged KV cache (block_table)")
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bq) != len(bk):
        raise ValueError("cu_seqlens_q and cu_seqlens_k hold different numbers of sequences")
    if max(b - a for a, b in zip(bq, bq[1:], strict=False)) > max_seqlen_q:
        raise ValueError(f"a query sequence is longer than max_seqlen_q={max_seqlen_q}")
    if max(b - a for a, b in zip(bk, bk[1:], strict=False)) > max_seqlen_k:
        raise ValueError(f"a key sequence is longer than max_seqlen_k={max_seqlen_k}")
    results = [
        _attention(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal, window_size)
        for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:], strict=False)
    ]
    out = torch.cat([o for o, _ in results])
    lse = torch.cat([s for _, s in results], dim=1)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_varlen_qkvpacked_func`` on CPU: ``qkv`` ``[T, 3, H, D]``."""
    return flash_attn_varlen_func(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
