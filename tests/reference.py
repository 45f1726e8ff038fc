"""fp64 reference implementations the tests compare the library against.

Everything here is deliberately naive and independent of ``dtensor_ring``: explicit score
matrices, a ``-inf`` mask, ``logsumexp``, computed in float64 with plain torch ops (so autograd
provides the reference gradients), and the sequence layouts written out as index lists.

Shape legend: B batch, S sequence, H query heads, H_kv key/value heads, D head dim, T packed
tokens (varlen).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

LAYOUTS = ("ring", "zigzag", "stripe")


def _check_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Validate the head counts and return the group size ``H // H_kv``."""
    assert k.shape == v.shape, (k.shape, v.shape)
    H, H_kv = q.shape[-2], k.shape[-2]
    assert H % H_kv == 0, (H, H_kv)
    assert q.shape[-1] == k.shape[-1], (q.shape, k.shape)
    return H // H_kv


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact softmax attention of full sequences, in float64.

    Args:
        q: ``[B, S, H, D]``; k, v: ``[B, S, H_kv, D]`` with ``H % H_kv == 0``: KV head ``j``
            serves query heads ``j*G .. (j+1)*G - 1`` (``G = H // H_kv``, i.e.
            ``repeat_interleave``, as in flash-attn).
        causal: query ``i`` sees keys ``j <= i``.
        scale: softmax scale, default ``D ** -0.5``.
        window_size: ``(left, right)``: query ``i`` sees keys ``i - left <= j <= i + right``
            (-1: unbounded), as flash-attn; with ``causal`` ``right`` is 0.
        sinks: ``[H]`` attention-sink logits (gpt-oss): one more score per row, of head h's
            value ``sinks[h]``, whose probability is dropped (it has no value).

    Returns:
        ``(out, lse)``: ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` (natural log), both
        float64 and differentiable with respect to the inputs.
    """
    group = _check_heads(q, k, v)
    S_q, S_k, D = q.shape[1], k.shape[1], q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=2)
    v64 = v64.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    left, right = window_size
    if causal or (left, right) != (-1, -1):
        assert S_q == S_k, "masked reference is for self-attention (S_q == S_k)"
        i = torch.arange(S_q, device=q.device)[:, None]
        j = torch.arange(S_k, device=q.device)[None, :]
        visible = torch.ones(S_q, S_k, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= i
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink column, dropped after the softmax
        sink_col = sinks.to(torch.float64).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, S_q]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v64)
    return out, lse


def reference_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-document attention of packed sequences, in float64 (``window_size`` over the
    positions within each document, and ``sinks``, as :func:`reference_attention`).

    Args:
        q: ``[T, H, D]``; k, v: ``[T, H_kv, D]``; ``cu_seqlens``: ``[N + 1]`` document
            boundaries (``0 = c_0 <= c_1 <= ... <= c_N = T``). Tokens attend only within their
            document (and causally within it if ``causal``).

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, D]`` and ``lse`` ``[H, T]``, float64, differentiable.
    """
    bounds = [int(c) for c in cu_seqlens.tolist()]
    assert bounds[0] == 0 and bounds[-1] == q.shape[0], bounds
    outs, lses = [], []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        out, lse = reference_attention(
            q[None, start:end],
            k[None, start:end],
            v[None, start:end],
            causal=causal,
            scale=scale,
            window_size=window_size,
            sinks=sinks,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=-1)


def layout_indices(layout: str, rank: int, world_size: int, seq_len: int) -> Tensor:
    """Global token positions rank ``rank`` of ``world_size`` holds, in local order.

    * ``ring``: the contiguous block ``[r*S/W, (r+1)*S/W)``;
    * ``zigzag``: the sequence cut into ``2W`` equal chunks; chunk ``r`` then chunk ``2W-1-r``;
    * ``stripe``: tokens ``r, r+W, r+2W, ...``.
    """
    W, S = world_size, seq_len
    if layout == "ring":
        assert S % W == 0, (S, W)
        n = S // W
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        assert S % (2 * W) == 0, (S, W)
        c = S // (2 * W)
        first, second = rank, 2 * W - 1 - rank
        return torch.cat(
            [torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]
        )
    if layout == "stripe":
        assert S % W == 0, (S, W)
        return torch.arange(rank, S, W)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def shard(x: Tensor, layout: str, rank: int, world_size: int, seq_dim: int = 1) -> Tensor:
    """Reference sharding: the tokens of ``x`` (along ``seq_dim``) that ``rank`` holds."""
    idx = layout_indices(layout, rank, world_size, x.shape[seq_dim]).to(x.device)
    return x.index_select(seq_dim, idx)


def random_qkv(
    B: int, S: int, H: int, H_kv: int, D: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded random ``q [B,S,H,D]``, ``k, v [B,S,H_kv,D]``, identical on every process.

    Drawn in float64 and then cast, so the values for a seed are the same for every dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, H_kv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, H_kv, D, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_mod=None,
    score_mod=None,
    scale: float | None = None,
    mask_batch_heads: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """FlexAttention of full sequences in float64, evaluating the functions by broadcasting.

    ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` (flex's layout); ``mask_mod(b, h, q_idx,
    kv_idx)`` is evaluated by torch's ``create_mask``, ``score_mod(score, b, h, q_idx,
    kv_idx)`` called once with index tensors shaped ``[B,1,1,1]``, ``[1,H,1,1]``, ``[1,1,S,1]``,
    ``[1,1,1,S]`` (so it must be written with broadcasting ops). Rows that see no key give 0
    and lse -inf, as flex_attention. ``mask_batch_heads``: evaluate the mask at this batch and
    head count (1: it ignores ``b`` / ``h``) and broadcast.
    Returns ``(out [B, H, S, D], lse [B, H, S])``.
    """
    B, H, S, D = q.shape
    G = H // k.shape[1]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))
    scale = D**-0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    ar = functools.partial(torch.arange, device=q.device)
    b, h = ar(B).view(B, 1, 1, 1), ar(H).view(1, H, 1, 1)
    qi, ki = ar(S).view(1, 1, S, 1), ar(S).view(1, 1, 1, S)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:  # torch's own evaluation (vmap over b, h, q, kv)
        from torch.nn.attention.flex_attention import create_mask

        mask_B, mask_H = (B, H) if mask_batch_heads is None else mask_batch_heads
        s = s.masked_fill(~create_mask(mask_mod, mask_B, mask_H, S, S, q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ v, lse
