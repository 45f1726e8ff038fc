"""The ``dtensor_ring::decode_attention`` op: one decoding step over a sharded KV cache.

Note [Decoding over a sharded KV cache (pass-Q)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank holds a shard of the KV cache (any tokens, any number, possibly none); the new
token's query is the same on every rank. Every rank attends to its own shard, and the partial
results merge exactly (Note [Online-softmax merge], the ring's ``merge_``) after one all-gather
of ``(out, lse)``:

    rank 0: q . K_0 -> (o_0, lse_0) --+
    rank 1: q . K_1 -> (o_1, lse_1) --+-- all_gather --> merge_ in rank order:
    rank 2: (empty)  -> (0,  -inf)  --+                  lse = logsumexp_r lse_r
                                                         o   = sum_r exp(lse_r - lse) o_r
                                                         (the same on every rank)

Only the query's ``(out, lse)`` travels, ``B * H * (D + 1)`` fp32 values per rank and step,
never the cache. A rank with an empty shard contributes weight 0; a query whose scores are all
-inf is NaN, as in attention over the whole cache.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._compat import resolve_group
from ..kernels import accumulation_dtype, get_kernel
from ..kernels.merge import empty_rows_nan_, merge_
from .common import fake_out_lse


def decode_attention_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, group_name: str, scale: float, backend: str
) -> tuple[Tensor, Tensor]:
    """``q [B, 1, H, D]`` (the same on every rank) over this rank's cache shard
    ``k_cache, v_cache [B, S_local, H_kv, D]`` -> ``(out [B, 1, H, D], lse [B, H, 1])`` of
    attention over the whole cache (every cached key visible), the same on every rank."""
    group = resolve_group(group_name)
    B, S_q, H, D = q.shape
    acc = accumulation_dtype(q.dtype)
    if k_cache.shape[1] > 0:
        out, lse = get_kernel(backend).forward(q, k_cache, v_cache, causal=False, scale=scale)
    else:
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full((B, H, S_q), float("-inf"), dtype=acc)
    world = dist.get_world_size(group)
    local = torch.cat([out.to(acc).reshape(B, -1), lse.to(acc).reshape(B, -1)], dim=1)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    gathered = torch.stack(parts)  # [W, B, S_q * H * D + H * S_q]
    outs = gathered[:, :, : S_q * H * D].reshape(world, B, S_q, H, D)
    lses = gathered[:, :, S_q * H * D :].reshape(world, B, H, S_q)
    out_acc, lse_acc = outs[0].clone(), lses[0].clone()
    for r in range(1, world):  # in rank order on every rank: the same result everywhere
        merge_(out_acc, lse_acc, outs[r], lses[r])
    return empty_rows_nan_(out_acc.to(q.dtype), lse_acc), lse_acc


decode_attention = torch.library.custom_op("dtensor_ring::decode_attention", mutates_args=())(
    decode_attention_impl
)


@decode_attention.register_fake
def _(q, k_cache, v_cache, group_name, scale, backend):
    B, S_q, H, _ = q.shape
    return fake_out_lse(q, (B, H, S_q))
