"""Decoding over a sharded KV cache: the front door of ``dtensor_ring::decode_attention``
(Note [Decoding over a sharded KV cache (pass-Q)] in ``ops/decode.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..consistency import check_consistent, comparing, relay_errors
from ..ops.common import call_attention
from ..ops.decode import decode_attention
from ..resolve import (
    check_backend_arg,
    check_bool,
    check_qkv_tensors,
    check_sinks,
    check_softmax_scale,
    check_window_size,
    group_arg,
    select_backend,
)


def decode_attention_func(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    softmax_scale: float | None = None,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    window_size: tuple[int, int] = (-1, -1),
    cache_positions: Tensor | None = None,
    query_position: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor, None]:
    """One decoding step of attention over a KV cache sharded across ``group``.

    Args:
        q: ``[B, 1, H, D]``, the new token's query, the same on every rank.
        k_cache, v_cache: ``[B, S_local, H_kv, D]``, this rank's shard of the cache (any of the
            sequence's tokens, the new one's included on the rank that stores it; ``S_local``
            may differ between ranks and be 0). Without ``cache_positions`` every cached key
            is visible to the query.
        softmax_scale: default ``D ** -0.5``.  group: the ranks sharing the cache.
        return_attn_probs: also return ``lse [B, H, 1]`` (fp32) as flash-attn does.
        backend: block-kernel backend name, or None for automatic choice.
        window_size: flash-attn's ``(left, right)`` over global positions: the query sees the
            cached keys at positions ``[query_position - left, query_position + right]`` (-1:
            unbounded; transformers' ``sliding_window = w`` is ``(w - 1, 0)``). Needs
            ``cache_positions`` and ``query_position``.
        cache_positions: ``[S_local]`` int64, the global position of each cached token of this
            rank's shard (shared by the batch rows); keep it on the CPU (read on the host).
        query_position: the new token's global position (an int).
        sinks: ``[H]``, per-head attention-sink logits (gpt-oss ``s_aux``), or None: every
            softmax denominator gets ``exp(sinks[h])`` (Note [Attention sinks]).

    Returns:
        ``out [B, 1, H, D]`` of attention over the whole cache, the same on every rank (or
        ``(out, lse, None)``; ``lse`` includes the sinks). No gradient: an inference op. A query
        that sees no key is NaN (with sinks: 0).

    Raises:
        ValueError / TypeError: on every rank before any communication in the consistency
            mode or on a gloo group (Note [Consistency header]), on the rank that sees it
            otherwise.
    """
    name, _ = group_arg(group)
    with relay_errors(name, "decode_attention"):
        check_qkv_tensors(q, k_cache, v_cache, kv_cache=True)
        if q.shape[1] != 1:
            raise ValueError(
                f"q must be [B, 1, H, D] (one new token), got shape {tuple(q.shape)}; run a "
                "longer prompt with ring attention (its queries attend causally)"
            )
        return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
        scale = check_softmax_scale(softmax_scale)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        left, right = check_window_size(window_size)
        positions, q_pos = _check_positions(k_cache, cache_positions, query_position)
        if (left, right) != (-1, -1) and positions is None:
            raise ValueError(
                f"decode_attention_func: window_size={window_size!r} needs cache_positions "
                "(the cached tokens' global positions) and query_position"
            )
        check_sinks(sinks, q)
        backend = select_backend(q, k_cache, check_backend_arg(backend))
    if comparing(name):
        fingerprint = {
            "op": "decode_attention",
            "q shape": tuple(q.shape),
            "cache heads, dim": tuple(k_cache.shape[2:]),
            "dtype": str(q.dtype),
            "scale": scale,
            "backend": backend,
            "window_size": (left, right),
            "query_position": q_pos,
            "sinks": None if sinks is None else tuple(sinks.shape),
        }
        check_consistent(name, fingerprint)
    with torch.no_grad():  # an inference op (its eager call runs the implementation itself)
        out, lse = call_attention(
            decode_attention,
            q,
            k_cache,
            v_cache,
            positions,
            q_pos,
            name,
            scale,
            backend,
            left,
            right,
            sinks,
        )
    return (out, lse, None) if return_attn_probs else out


def _check_positions(
    k_cache: Tensor, cache_positions: object, query_position: object
) -> tuple[Tensor | None, int]:
    """``(cache_positions, query_position)`` checked: both None (``(None, 0)``), or an int64
    tensor ``[S_local]`` and an int."""
    if cache_positions is None and query_position is None:
        return None, 0
    if cache_positions is None or query_position is None:
        raise ValueError(
            "decode_attention_func needs cache_positions and query_position together (or "
            "neither: every cached key visible)"
        )
    if not isinstance(cache_positions, Tensor):
        raise TypeError(
            "cache_positions must be an int64 tensor [S_local], got "
            f"{type(cache_positions).__name__}"
        )
    if cache_positions.dtype != torch.int64 or tuple(cache_positions.shape) != (k_cache.shape[1],):
        raise ValueError(
            f"cache_positions must be int64 [S_local] = [{k_cache.shape[1]}] (one global "
            f"position per cached token), got {cache_positions.dtype} "
            f"{tuple(cache_positions.shape)}"
        )
    if isinstance(query_position, bool) or not isinstance(query_position, int):
        raise TypeError(f"query_position must be an int, got {type(query_position).__name__}")
    return cache_positions, query_position
