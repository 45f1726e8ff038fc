"""Context-parallel inference without transformers: a KV cache sharded across the ranks of a
group, the prefill that fills it (ring attention over the prompt's shards) and the decoding
steps that extend it (``dtensor_ring::decode_attention``).

Note [Context-parallel inference]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A prompt of P tokens is sharded across the W ranks by a dense layout (zigzag by default:
balanced causal work); every attention layer runs causal ring attention over the shards and
keeps its shard of K/V, with the tokens' *global* positions, as its cache. Every later token
is computed on every rank (the same query everywhere); its K/V are stored on ONE rank, the
owner of its position, ``position % W`` (round robin: shard sizes stay within one token of
each other), and its attention is one pass-Q decoding step (Note [Decoding over a sharded KV
cache (pass-Q)] in ``ops/decode.py``):

    prefill (P = 8, W = 2, zigzag)          decode: token t on every rank, K/V kept by t % W
    rank 0: positions 0 1 | 6 7   --ring-->  rank 0: 0 1 6 7 | 8    10    12 ...
    rank 1: positions 2 3 | 4 5   attention  rank 1: 2 3 4 5 |    9    11    ...
                                             q_t . K_r[visible] on every rank r, then one
                                             all-gather of (out, lse) and an exact merge

Sliding windows (flash-attn's ``(left, right)`` over global positions; transformers'
``sliding_window = w`` is ``(w - 1, 0)``): a decoding step reads only the keys its window
sees (a suffix of each shard, which is kept in position order); a rank whose shard the window
has left behind runs no kernel. A cache made with ``sliding_window=w`` also drops the keys no
later query can see (position ``<= t - w`` once token t arrives), so its memory stays bounded,
as transformers' sliding-window caches do. Sinks (gpt-oss) are folded in once, after the merge
(Note [Attention sinks]).

A prompt length that the layout cannot divide: the prefill takes the longest prefix it can
(a multiple of ``layout.divisor(W)``, possibly 0), and the rest of the prompt runs as decoding
steps, one token each (exact, and at most ``divisor - 1`` steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..api.attend import dense_attention
from ..consistency import collective_entry, relay_errors
from ..layouts import get_layout, token_indices
from ..resolve import check_qkv_tensors, check_sinks, check_window_size, group_arg
from .decode import decode_attention_func


class ShardPositions:
    """The bookkeeping of one layer's cache shard on one rank: which global positions it holds
    (CPU int64, ascending), how many tokens the whole cache has seen, who stores the next one,
    and, with a sliding window, which keys no later query can see.

    Args:
        rank, world_size: this rank in the group sharing the cache.
        sliding_window: transformers' ``w`` (a query sees itself and the ``w - 1`` keys before
            it): keys at positions ``<= t - w`` are dropped when token t arrives; None: keep all.
    """

    def __init__(self, rank: int, world_size: int, sliding_window: int | None = None):
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
        ):
            raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window={sliding_window} must be positive, or None")
        self.rank, self.world_size, self.sliding_window = rank, world_size, sliding_window
        self.positions = torch.empty(0, dtype=torch.int64)
        self.seq_length = 0  # tokens the whole cache has seen (its global length)

    def owner(self, position: int) -> int:
        """The rank that stores the K/V of a decoded token (round robin)."""
        return position % self.world_size

    def start(self, positions: Tensor, seq_length: int) -> None:
        """After a prefill of ``seq_length`` tokens of which this rank holds ``positions``."""
        if self.seq_length:
            raise ValueError("the cache already holds tokens: prefill an empty cache")
        positions = positions.detach().to("cpu", torch.int64)
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("a cache shard's positions must be ascending")
        self.positions, self.seq_length = positions, seq_length

    def next_token(self) -> tuple[int, bool, int]:
        """``(position, stored here, number of leading keys to drop)`` of the next token."""
        t = self.seq_length
        drop = 0
        if self.sliding_window is not None:
            drop = int(torch.searchsorted(self.positions, t - self.sliding_window, right=True))
        return t, self.owner(t) == self.rank, drop

    def advance(self, position: int, stored: bool, drop: int) -> None:
        """Record :meth:`next_token`'s token (after the K/V storage did the same)."""
        kept = self.positions[drop:]
        if stored:
            kept = torch.cat([kept, torch.tensor([position], dtype=torch.int64)])
        self.positions, self.seq_length = kept, position + 1


class KVCacheShard:
    """This rank's shard of one attention layer's KV cache (no transformers needed).

    ``keys``, ``values``: ``[B, S_local, H_kv, D]`` (None before the first write);
    ``positions``: their global positions (CPU int64 ``[S_local]``, ascending);
    ``seq_length``: the length of the whole cached sequence. Fill it with
    :func:`prefill_attention`, extend it with :func:`decode_step_attention` (Note
    [Context-parallel inference]).

    Args:
        group: the ranks sharing the cache (default: the default group).
        sliding_window: drop keys no later query can see (:class:`ShardPositions`); the
            attention calls' window must not see further back.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, sliding_window: int | None = None):
        self.group = group
        self.group_name, world = group_arg(group)
        with collective_entry(self.group_name, "KVCacheShard"):  # made by every rank together
            self.index = ShardPositions(dist.get_rank(group), world, sliding_window)
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    @property
    def positions(self) -> Tensor:
        return self.index.positions

    @property
    def seq_length(self) -> int:
        return self.index.seq_length

    def _write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, seq_length: int) -> None:
        self.index.start(positions, seq_length)
        self.keys, self.values = k, v

    def _append(self, k: Tensor, v: Tensor) -> int:
        """Store the next token's ``k, v [B, 1, H_kv, D]`` if this rank owns it; its position."""
        position, stored, drop = self.index.next_token()
        if self.keys is None:
            self.keys, self.values = k[:, :0], v[:, :0]
        keys, values = self.keys[:, drop:], self.values[:, drop:]
        if stored:
            keys, values = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
        self.keys, self.values = keys, values
        self.index.advance(position, stored, drop)
        return position


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCacheShard,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """Causal ring attention over a prompt sharded across ``cache.group``, keeping this rank's
    K/V (and their global positions) in ``cache``.

    Args:
        q: ``[B, S_local, H, D]``, k, v: ``[B, S_local, H_kv, D]``: this rank's shard of the
            prompt in ``layout`` (:func:`dtensor_ring.shard_local`); the prompt has
            ``S_local * W`` tokens (a multiple of ``get_layout(layout).divisor(W)``).
        cache: an empty :class:`KVCacheShard`.
        layout: a dense layout ("zigzag", "ring", "stripe", or "auto": zigzag's tokens, the
            algorithm chosen per call).
        softmax_scale, window_size, backend: as in :func:`dtensor_ring.zigzag_ring_flash_attn_func`.
        sinks: ``[H]`` attention-sink logits, or None.

    Returns:
        ``out [B, S_local, H, D]``. No gradient (an inference path).
    """
    world = dist.get_world_size(cache.group)
    with relay_errors(cache.group_name, "prefill_attention"):
        if cache.seq_length:
            raise ValueError("prefill_attention needs an empty cache")
        check_sinks(sinks, q)
        _check_eviction(cache, check_window_size(window_size))
    out, _ = dense_attention(
        q,
        k,
        v,
        layout=layout,
        algorithm=None,
        softmax_scale=softmax_scale,
        causal=True,
        window_size=window_size,
        group=cache.group,
        backend=backend,
        sinks=sinks,
        return_lse=False,
        backward=False,  # inference: the choice prices a forward
    )
    seq_len = q.shape[1] * world
    positions = token_indices(layout, seq_len, dist.get_rank(cache.group), world)
    cache._write_prefill(k, v, positions, seq_len)
    return out


def decode_step_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCacheShard,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """One decoding step: the new token's ``q [B, 1, H, D]``, ``k, v [B, 1, H_kv, D]`` (the
    same on every rank of ``cache.group``) at position ``cache.seq_length``; its K/V are stored
    on their owner rank, and the query attends causally (within ``window_size``, with
    ``sinks``) to the whole cached sequence, itself included.

    Returns:
        ``out [B, 1, H, D]``, the same on every rank.
    """
    with relay_errors(cache.group_name, "decode_step_attention"):
        check_qkv_tensors(q, k, v, kv_cache=True)
        if q.shape[1] != 1:
            raise ValueError(f"q must be [B, 1, H, D] (one new token), got {tuple(q.shape)}")
        if k.dim() != 4 or k.shape[1] != 1 or k.shape != v.shape:
            raise ValueError(
                f"k and v must be [B, 1, H_kv, D] (the new token), got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        if cache.keys is not None and (
            cache.keys.shape[0] != k.shape[0] or cache.keys.shape[2:] != k.shape[2:]
        ):
            raise ValueError(
                f"the new token's k {tuple(k.shape)} does not match the cache's "
                f"{tuple(cache.keys.shape)} on batch, heads and head dim"
            )
        left, right = check_window_size(window_size)
        _check_eviction(cache, (left, right))
    position = cache._append(k, v)
    assert cache.keys is not None and cache.values is not None
    return decode_attention_func(
        q,
        cache.keys,
        cache.values,
        softmax_scale,
        group=cache.group,
        backend=backend,
        window_size=(left, 0 if right == -1 else right),  # causal: later keys do not exist
        cache_positions=cache.positions,
        query_position=position,
        sinks=sinks,
    )


def _check_eviction(cache: KVCacheShard, window: tuple[int, int]) -> None:
    """A cache that drops keys outside its ``sliding_window`` cannot serve a wider window."""
    w = cache.index.sliding_window
    if w is not None and (window[0] < 0 or window[0] > w - 1):
        raise ValueError(
            f"the cache keeps only the keys of sliding_window={w} (window_size=({w - 1}, 0)), "
            f"but the attention call's window_size={window} sees further back"
        )


def split_prompt(seq_len: int, layout: str, world_size: int) -> int:
    """How many of a prompt's ``seq_len`` tokens the prefill takes: the longest prefix that
    ``layout`` divides over ``world_size`` ranks (possibly 0); the rest run as decoding steps
    (Note [Context-parallel inference])."""
    divisor = get_layout(layout, "dense").divisor(world_size)
    return seq_len - seq_len % divisor
