"""Decoding over a sharded KV cache: the front door of ``dtensor_ring::decode_attention``
(Note [Decoding over a sharded KV cache (pass-Q)] in ``ops/decode.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..consistency import check_consistent, consistency_checks_enabled, relay_errors
from ..ops.decode import decode_attention
from ..resolve import (
    check_backend_arg,
    check_bool,
    check_qkv_tensors,
    check_softmax_scale,
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
) -> Tensor | tuple[Tensor, Tensor, None]:
    """One decoding step of attention over a KV cache sharded across ``group``.

    Args:
        q: ``[B, 1, H, D]``, the new token's query, the same on every rank.
        k_cache, v_cache: ``[B, S_local, H_kv, D]``, this rank's shard of the cache (any of the
            sequence's tokens, the new one's included on the rank that stores it; ``S_local``
            may differ between ranks and be 0). Every cached key is visible to the query.
        softmax_scale: default ``D ** -0.5``.  group: the ranks sharing the cache.
        return_attn_probs: also return ``lse [B, H, 1]`` (fp32) as flash-attn does.
        backend: block-kernel backend name, or None for automatic choice.

    Returns:
        ``out [B, 1, H, D]`` of attention over the whole cache, the same on every rank (or
        ``(out, lse, None)``). No gradient: an inference op.

    Raises:
        ValueError / TypeError: on every rank before any communication in the consistency
            mode, on the rank that sees it otherwise.
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
        backend = select_backend(q, k_cache, check_backend_arg(backend))
    if not torch.compiler.is_compiling() and consistency_checks_enabled():
        fingerprint = {
            "op": "decode_attention",
            "q shape": tuple(q.shape),
            "cache heads, dim": tuple(k_cache.shape[2:]),
            "dtype": str(q.dtype),
            "scale": scale,
            "backend": backend,
        }
        check_consistent(name, fingerprint)
    out, lse = decode_attention(q, k_cache, v_cache, name, scale, backend)
    return (out, lse, None) if return_attn_probs else out
