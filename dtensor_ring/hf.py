"""Hugging Face transformers integration: ``attn_implementation="dtensor_ring"``.

    import dtensor_ring.hf as drhf
    drhf.setup(group=cp_group, layout="zigzag")      # registers the attention implementation
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dtensor_ring")
    out = model(**drhf.shard_batch(batch, group=cp_group, layout="zigzag"))

Every rank of ``group`` holds ``S / W`` tokens of each sequence (Note [Sequence layouts] in
``layouts.py``); the model's attention layers call ring attention over ``group`` on them, and
everything else (embeddings, norms, MLPs, RoPE with the *global* position ids that
:func:`shard_batch` provides, the token-level loss) runs on the local tokens unchanged.

Limits (each raises ``ValueError`` rather than computing something else): causal attention
only, no attention mask (padding) or 4-D masks, no packed sequences (position ids must be the
global positions of the layout, which :func:`shard_batch` builds), no sliding window, no
softcap, no dropout, no KV cache.

``transformers`` is imported only inside the functions here; ``import dtensor_ring`` never
imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import ring_flash_attn_func, stripe_flash_attn_func, zigzag_ring_flash_attn_func
from .layouts import Layout, check_layout, shard_local, token_indices

__all__ = ["ATTN_IMPLEMENTATION", "setup", "shard_batch", "ring_attention_forward"]

ATTN_IMPLEMENTATION = "dtensor_ring"
IGNORE_INDEX = -100
_FUNCS = {"ring": ring_flash_attn_func, "zigzag": zigzag_ring_flash_attn_func,
          "stripe": stripe_flash_attn_func}


@dataclass
class _Config:
    group: dist.ProcessGroup | None
    layout: str
    backend: str | None


_config: _Config | None = None


def setup(group: dist.ProcessGroup | None = None, layout: Layout = "zigzag",
          backend: str | None = None) -> None:
    """Register ``attn_implementation="dtensor_ring"`` with transformers, running over ``group``.

    Registers :func:`ring_attention_forward` with ``transformers.AttentionInterface`` and a mask
    function with ``AttentionMaskInterface`` (it builds no mask: causality is the ring
    attention's). Call it on every rank before the model's first forward; calling it again
    replaces the group, layout and backend.

    Args:
        group: the context-parallel process group (default: the default group).
        layout: "ring", "zigzag" or "stripe": how :func:`shard_batch` shards the sequence.
        backend: block-kernel backend name (``dtensor_ring.BACKEND_NAMES``), or None.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _config
    check_layout(layout)
    _config = _Config(group, layout, backend)
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _no_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> None:
    """Mask function: none is needed; a 2-D padding mask with padding cannot be honoured."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "dtensor_ring attention does not support padding (an attention_mask with zeros); "
            "use sequences without padding, or drop attention_mask"
        )


def ring_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: causal ring attention over the :func:`setup` group.

    Args:
        module: the calling attention module (must have ``is_causal`` unset or True).
        query: ``[B, H, S, D]`` (S local tokens); key, value: ``[B, H_kv, S, D]``.
        attention_mask: must be None (:func:`setup`'s mask function builds none).
        scaling: softmax scale (default ``D ** -0.5``).  dropout: must be 0.
        kwargs: ``position_ids [B, S]`` must be the layout's global positions; a
            ``sliding_window`` or ``softcap`` other than None is rejected.

    Returns:
        ``(out [B, S, H, D], None)``.
    """
    if _config is None:
        raise RuntimeError("call dtensor_ring.hf.setup(group=..., layout=...) first")
    if attention_mask is not None:
        raise ValueError("dtensor_ring attention cannot honour an attention mask (4-D or custom)")
    if not getattr(module, "is_causal", True):
        raise ValueError("dtensor_ring attention supports causal attention only")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"dtensor_ring attention does not support {name}={kwargs[name]}")
    if dropout != 0.0:
        raise ValueError(f"dtensor_ring attention does not support dropout={dropout}")
    _check_positions(kwargs.get("position_ids"), query.shape[2])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = _FUNCS[_config.layout](q, k, v, softmax_scale=scaling, causal=True,
                                 group=_config.group, backend=_config.backend)
    return out, None


def _check_positions(position_ids: Tensor | None, seq_local: int) -> None:
    """Raise unless ``position_ids [B, S]`` are this rank's global positions under the layout."""
    assert _config is not None
    world = dist.get_world_size(_config.group)
    expected = token_indices(_config.layout, seq_local * world, dist.get_rank(_config.group),
                             world)
    if position_ids is None or position_ids.shape[-1] != seq_local or not bool(
        (position_ids == expected.to(position_ids.device)).all()
    ):
        raise ValueError(
            "dtensor_ring attention needs position_ids = the global positions of this rank's "
            f"tokens under layout={_config.layout!r} (build the inputs with "
            "dtensor_ring.hf.shard_batch); packed sequences (positions restarting per document) "
            "are not supported"
        )


def shard_batch(batch: dict[str, Tensor], group: dist.ProcessGroup | None = None,
                layout: Layout = "zigzag") -> dict[str, Tensor]:
    """This rank's part of a causal-LM batch, ready for ``model(**...)`` (no communication).

    Args:
        batch: full sequences, identical on every rank of ``group``: ``input_ids [B, S]`` and
            optionally ``labels [B, S]`` (unshifted, as for transformers' causal LMs) and an
            all-ones ``attention_mask``; S divisible by the layout's divisor.
        group: the context-parallel process group (the one given to :func:`setup`).
        layout: the layout given to :func:`setup`.

    Returns:
        ``input_ids`` and ``position_ids [B, S/W]`` (global positions); with labels also
        ``labels`` and ``shift_labels [B, S/W]`` (shifted *before* sharding, so each local
        token has its own next token, -100 after the last) and ``num_items_in_batch`` (the
        non-ignored label count of the whole sequences). The model's loss is then this rank's
        share of the global mean: sum it over the ranks of ``group`` (or, equivalently, sum
        the gradients; e.g. all-reduce them) to get the single-process loss and gradients.

    Raises:
        ValueError: for an ``attention_mask`` with padding, or other keys it cannot shard.
    """
    check_layout(layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    extra = set(batch) - {"input_ids", "labels", "attention_mask"}
    if extra:
        raise ValueError(f"shard_batch cannot shard {sorted(extra)}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("dtensor_ring does not support padding (attention_mask with zeros)")
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    positions = torch.arange(S, device=input_ids.device).expand(B, S)
    out = {name: shard_local(t, layout, rank, world)
           for name, t in (("input_ids", input_ids), ("position_ids", positions))}
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        out["shift_labels"] = out["labels"] = shard_local(shifted, layout, rank, world)
        out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return out
