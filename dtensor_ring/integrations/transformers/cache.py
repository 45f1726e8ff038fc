"""The transformers cache of context-parallel generation: :class:`ShardedCache`, a
``transformers.cache_utils.Cache`` whose layers keep this rank's shard of the KV cache (Note
[Context-parallel inference] in ``inference/kv_cache.py``, Note [Generation through transformers]
in ``integrations/transformers/generate.py``).

This module imports transformers: only ``dtensor_ring.hf.ShardedCache`` and
``dtensor_ring.hf.generate`` import it, on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from ...inference.kv_cache import ShardPositions
from ...resolve import group_arg
from .keywords import summary

#: Layer types of a transformers config that the sharded cache serves.
LAYER_TYPES = ("full_attention", "sliding_attention")


class ShardedLayer(DynamicLayer):
    """One decoder layer's cache shard: ``DynamicLayer``'s storage (``keys, values
    [B, H_kv, S_local, D]``; batch reordering, offloading and reset are its own) plus the
    positions bookkeeping of :class:`~dtensor_ring.inference.kv_cache.ShardPositions`.

    ``update`` stores a prefill shard (when :meth:`ShardedCache.prefilling`) or one new token,
    the latter only on its owner rank, and returns this rank's shard; ``last_update`` says
    which ("prefill" / "decode"), ``last_position`` the decoded token's position.
    ``get_seq_length()`` is the GLOBAL length.

    Args:
        rank, world_size: this rank in the group sharing the cache.
        sliding_window: a "sliding_attention" layer's window (keys it has passed are dropped).
    """

    is_croppable = False

    def __init__(self, rank: int, world_size: int, sliding_window: int | None = None):
        super().__init__()
        self.index = ShardPositions(rank, world_size, sliding_window)
        self.is_sliding = sliding_window is not None
        self.pending_prefill: tuple[Tensor, int] | None = None
        self.last_update: str | None = None
        self.last_position = -1

    @property
    def positions(self) -> Tensor:
        """Global positions (CPU int64 ``[S_local]``, ascending) of this rank's keys."""
        return self.index.positions

    def update(
        self, key_states: Tensor, value_states: Tensor, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Store ``key_states, value_states [B, H_kv, S, D]``; return this rank's shard."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        if self.pending_prefill is not None:
            positions, seq_length = self.pending_prefill
            self.pending_prefill = None
            self.index.start(positions, seq_length)
            self.keys, self.values = key_states, value_states
            self.last_update = "prefill"
            return self.keys, self.values
        if key_states.shape[-2] != 1:
            raise ValueError(
                f"the dtensor_ring sharded cache got {key_states.shape[-2]} new tokens in one "
                "forward; after the prefill it takes one token per forward, the same on every "
                "rank (dtensor_ring.hf.generate; no assisted decoding, no prefill_chunk_size)"
            )
        position, stored, drop = self.index.next_token()
        keys, values = self.keys[:, :, drop:], self.values[:, :, drop:]
        if stored:
            keys = torch.cat([keys, key_states], dim=-2)
            values = torch.cat([values, value_states], dim=-2)
        self.keys, self.values = keys, values
        self.index.advance(position, stored, drop)
        self.last_update, self.last_position = "decode", position
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.index.seq_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.index.seq_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.index = ShardPositions(
            self.index.rank, self.index.world_size, self.index.sliding_window
        )
        self.last_update, self.pending_prefill, self.last_position = None, None, -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError("the dtensor_ring sharded cache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]


class ShardedCache(Cache):
    """A transformers ``Cache`` of one :class:`ShardedLayer` per decoder layer, sharded across
    ``group``; made and filled by :func:`dtensor_ring.hf.generate`.

    Args:
        config: the model's config (its ``layer_types`` / ``sliding_window`` give each layer's
            window, as for ``DynamicCache(config=...)``).
        group: the ranks sharing the cache (default: the default group).

    Raises:
        ValueError: a model with layers other than full or sliding-window attention.
    """

    def __init__(self, config, group: dist.ProcessGroup | None = None):
        self.group = group
        self.group_name, world = group_arg(group)
        rank = dist.get_rank(group)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        unsupported = sorted(set(layer_types) - set(LAYER_TYPES))
        if unsupported:
            raise ValueError(
                f"the dtensor_ring sharded cache serves attention layers of types "
                f"{list(LAYER_TYPES)}, this model has {unsupported}"
            )
        layers = [
            ShardedLayer(
                rank, world, kw.get("sliding_window") if t == "sliding_attention" else None
            )
            for t, kw in zip(layer_types, layer_kwargs, strict=True)
        ]
        super().__init__(layers=layers)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        layer = self.layers[layer_idx]
        if layer_idx == 0 and layer.pending_prefill is None:
            _check_decode_positions((kwargs.get("kwargs") or {}).get("position_ids"), layer)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @contextlib.contextmanager
    def prefilling(self, positions: Tensor, seq_length: int) -> Iterator[None]:
        """Within: the next forward is a prefill of ``seq_length`` tokens of which this rank
        holds those at ``positions`` (int64 ``[S_local]``, ascending)."""
        for layer in self.layers:
            layer.pending_prefill = (positions, seq_length)
        try:
            yield
        finally:
            missed = [layer.pending_prefill is not None for layer in self.layers]
            for layer in self.layers:
                layer.pending_prefill = None
        if any(missed):
            raise RuntimeError("the prefill forward did not reach every cache layer")


def _check_decode_positions(position_ids: Tensor | None, layer: ShardedLayer) -> None:
    """A decoding step's ``position_ids`` must be the cache's global length (the next token)."""
    expected = layer.index.seq_length
    if position_ids is not None and not bool((position_ids[..., -1:] == expected).all()):
        raise ValueError(
            f"the dtensor_ring sharded cache expected position_ids {expected} (its global "
            f"length) for the next token, got {summary(position_ids)} ending "
            f"{position_ids[..., -1:].flatten().tolist()}: padded batches are not supported"
        )
