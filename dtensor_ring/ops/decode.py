"""The ``dtensor_ring::decode_attention`` op: one decoding step over a sharded KV cache.

Note [Decoding over a sharded KV cache (pass-Q)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank holds a shard of the KV cache (any tokens, any number, possibly none); the new
token's query is the same on every rank. Every rank attends to the keys of its own shard that
the query sees, and the partial results merge exactly (Note [Online-softmax merge], all at
once: ``merge_all``) after one all-gather of ``(out, lse)``:

    rank 0: q . K_0[visible] -> (o_0, lse_0) --+
    rank 1: q . K_1[visible] -> (o_1, lse_1) --+-- all_gather --> merge_all:
    rank 2: nothing visible  -> (0,  -inf)   --+                  lse = logsumexp_r lse_r
                                                                  o   = sum_r exp(lse_r - lse) o_r
                                                  [sinks: fold exp(sink_h) into lse, once]
                                                  (the same on every rank)

Only the query's ``(out, lse)`` travels, ``B * H * (D + 1)`` values per rank and step, never
the cache.

Which keys are visible: with the cached keys' global positions ``k_positions [S_local]``
(shared by the batch rows) and the query's ``q_position``, flash-attn's window: key ``j`` is
visible iff ``q_position - left <= j <= q_position + right`` (-1: unbounded); transformers'
``sliding_window = w`` is ``(w - 1, 0)``. Without positions every cached key is visible. The
visible keys of a shard are taken as a slice when they are consecutive in it (a shard kept in
position order: the window's keys are a suffix), else gathered. A rank with no visible key
(an empty shard, or one the window has left behind) runs no kernel and contributes weight 0
(``lse = -inf``); a query that sees no key at all is NaN, as in attention over the whole
cache, or, with sinks, softmax over the sink alone: ``out = 0`` (Note [Attention sinks]).

Positions are read on the host; keep them in a CPU tensor (as the caches of
``inference/kv_cache.py`` do) so that a CUDA decode step does not wait for the device to read
them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._compat import resolve_group
from ..comm.collectives import all_gather_single
from ..comm.faults import CommSite
from ..kernels import accumulation_dtype, get_kernel
from ..kernels.merge import add_sinks, merge_all
from .common import attention_op, fake_out_lse, register_inference_op


def visible_keys(
    k_positions: Tensor | None, q_position: int, window_left: int, window_right: int
) -> slice | Tensor:
    """Which of a shard's keys the query at ``q_position`` sees: a ``slice`` (all, none, or a
    consecutive run) or the int64 indices ``[n]`` of a scattered subset (host values)."""
    if k_positions is None or (window_left < 0 and window_right < 0):
        return slice(None)
    pos = k_positions.cpu()
    visible = torch.ones_like(pos, dtype=torch.bool)
    if window_left >= 0:
        visible &= pos >= q_position - window_left
    if window_right >= 0:
        visible &= pos <= q_position + window_right
    n = int(visible.sum())
    if n == pos.numel():
        return slice(None)
    if n == 0:
        return slice(0, 0)
    index = visible.nonzero().squeeze(1)
    first = int(index[0])
    if int(index[-1]) - first + 1 == n:
        return slice(first, first + n)
    return index


def decode_attention_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_positions: Tensor | None,
    q_position: int,
    group_name: str,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``q [B, 1, H, D]`` (the same on every rank) over this rank's cache shard
    ``k_cache, v_cache [B, S_local, H_kv, D]`` -> ``(out [B, 1, H, D], lse [B, H, 1])`` of
    attention over the keys of the whole cache that the query sees, the same on every rank.

    ``k_positions [S_local]`` (int64, or None: every key visible), ``q_position`` and the
    window ``(window_left, window_right)`` select the visible keys (:func:`visible_keys`);
    ``sinks [H]`` (or None) are folded in after the merge (``lse`` includes them)."""
    group = resolve_group(group_name)
    B, S_q, H, D = q.shape
    acc = accumulation_dtype(q.dtype)
    keep = visible_keys(k_positions, q_position, window_left, window_right)
    if isinstance(keep, Tensor):
        keep = keep.to(k_cache.device)
        k_vis, v_vis = k_cache.index_select(1, keep), v_cache.index_select(1, keep)
    else:
        k_vis, v_vis = k_cache[:, keep], v_cache[:, keep]
    if k_vis.shape[1] > 0:
        out, lse = get_kernel(backend).forward(q, k_vis, v_vis, causal=False, scale=scale)
    else:  # nothing visible here: weight 0, and no kernel call
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full((B, H, S_q), float("-inf"), dtype=acc)
    world = group.size()
    local = torch.cat([out.to(acc).reshape(B, -1), lse.to(acc).reshape(B, -1)], dim=1)
    gathered = local.new_empty(world * B, local.shape[1])
    with CommSite("decode attention, all-gather of (out, lse)", group):
        all_gather_single(gathered, local, group=group)
    gathered = gathered.view(world, B, -1)  # [W, B, S_q * H * D + H * S_q]
    outs = gathered[:, :, : S_q * H * D].reshape(world, B, S_q, H, D)
    lses = gathered[:, :, S_q * H * D :].reshape(world, B, H, S_q)
    out_acc, lse_acc = merge_all(outs, lses)  # the same on every rank: the same inputs
    if sinks is not None:
        out_acc, lse_acc = add_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


decode_attention = attention_op("decode_attention", decode_attention_impl)
register_inference_op(decode_attention, decode_attention_impl)


@decode_attention.register_fake
def _(
    q,
    k_cache,
    v_cache,
    k_positions,
    q_position,
    group_name,
    scale,
    backend,
    window_left=-1,
    window_right=-1,
    sinks=None,
):
    B, S_q, H, _ = q.shape
    return fake_out_lse(q, (B, H, S_q))
