"""ring-flash-attention's transformers adapter: ``substitute_hf_flash_attn`` and
``update_ring_flash_attn_params``, over dtensor_ring's llama3 attention.

    from dtensor_ring.hf import substitute_hf_flash_attn, update_ring_flash_attn_params

    substitute_hf_flash_attn(group, heads_k_stride=1)          # once
    update_ring_flash_attn_params(cu_seqlens, group)           # every batch: global boundaries
    out = model(input_ids=local_ids, position_ids=local_positions)   # this rank's T/W tokens

As in ring-flash-attention, every attention layer of a model run with
``attn_implementation="flash_attention_2"`` then computes causal llama3 (all-gather) attention
over ``process_group``: each rank holds a contiguous slice of T/W tokens of one packed row
(B == 1), and the documents are the ones last given to :func:`update_ring_flash_attn_params`
(stored in :data:`DATA_PARAMS`); ``attention_mask``, ``position_ids`` and transformers'
``cu_seq_lens_*`` / ``max_length_*`` do not define them (position ids only feed RoPE).

transformers 5 looks attention functions up by name at call time, so
:func:`substitute_hf_flash_attn` registers the replacement with
``transformers.AttentionInterface`` under "flash_attention_2" (ring-flash-attention's adapter
assigns ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]`` and patches
``modeling_flash_attention_utils._flash_attention_forward``; its imports fail on
transformers 5.24). transformers loads a model with "flash_attention_2" only where the
flash-attn package works (a CUDA GPU), so the same function is also registered as
:data:`RFA_ATTN_IMPLEMENTATION`, usable anywhere (CPU included): load the model with
``attn_implementation=RFA_ATTN_IMPLEMENTATION`` or switch it with
``model.set_attn_implementation(RFA_ATTN_IMPLEMENTATION)``. Its mask function builds no
mask and rejects padding (as ``dtensor_ring.hf``'s).

Differences (each raises rather than computing something else): dropout must be 0, no
softcap / attention sinks / head masks / ``output_attentions``, no attention mask (padding)
and no KV cache of earlier tokens; an unknown keyword raises ``TypeError``. A model's
``sliding_window`` is applied as transformers' flash-attention-2 applies it (a query sees the
``sliding_window`` latest keys of its document), on every rank (ring-flash-attention passes
``(w, w)`` and only when the *local* key count exceeds it). fp32 inputs are computed in fp32
(ring-flash-attention casts them to the weights' dtype for flash-attn). There is no
``use_ring_attn`` switch: register another implementation to stop using ring attention.

``transformers`` is imported only inside :func:`substitute_hf_flash_attn`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..consistency import relay_errors
from ..integrations.transformers.keywords import check_model_keywords, summary, window_kwarg
from ..layouts.varlen import host_values
from ..resolve import group_arg
from ..schedule.llama3 import llama3_flash_attn_prepare_cu_seqlens
from .ring_flash_attn import llama3_flash_attn_varlen_func

__all__ = [
    "DATA_PARAMS",
    "RFA_ATTN_IMPLEMENTATION",
    "ring_flash_attention_forward",
    "substitute_hf_flash_attn",
    "update_ring_flash_attn_params",
]

#: The attention implementation name that works without flash-attn (CPU included).
RFA_ATTN_IMPLEMENTATION = "dtensor_ring_llama3"

#: This rank's llama3 metadata, from the last :func:`update_ring_flash_attn_params`:
#: ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice``.
DATA_PARAMS: dict[str, Tensor | int | slice] = {}

#: Keywords read (is_causal) or ignored as ring-flash-attention ignores them (the documents
#: are DATA_PARAMS's), besides attention_mask, scaling, dropout and sliding_window.
_KNOWN = frozenset({"is_causal", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"})


@dataclass(frozen=True)
class _Substitute:
    group: dist.ProcessGroup | None
    heads_k_stride: int


_substitute: _Substitute | None = None
_local_tokens = 0  # T / W of the last update_ring_flash_attn_params


def update_ring_flash_attn_params(
    cu_seqlens: Tensor, process_group: dist.ProcessGroup | None
) -> None:
    """Set the documents of the next forward (and backward): the *global* boundaries
    ``cu_seqlens [N + 1]`` (int32 or int64, empty documents allowed) of the packed row whose
    rank-th contiguous slice of T/W tokens this rank feeds the model.

    Stores ``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world_size)`` of
    ``process_group`` in :data:`DATA_PARAMS` (validated: ``ValueError`` on bad boundaries).
    """
    global _local_tokens
    group_arg(process_group, "process_group")
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(
        cu_seqlens, True, rank, world
    )
    DATA_PARAMS.update(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        local_k_slice=k_slice,
    )
    _local_tokens = host_values(cu_seqlens)[-1] // world


def substitute_hf_flash_attn(process_group: dist.ProcessGroup | None, heads_k_stride: int) -> None:
    """Make transformers' "flash_attention_2" (and :data:`RFA_ATTN_IMPLEMENTATION`) run
    causal llama3 attention over ``process_group``, all-gathering ``heads_k_stride`` KV heads
    at a time (it must divide the model's KV heads). Affects every model, also those already
    built; calling it again replaces the group and stride."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _substitute
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"heads_k_stride must be an int, got {summary(heads_k_stride)}")
    if heads_k_stride < 1:
        raise ValueError(f"heads_k_stride={heads_k_stride} must be positive")
    group_arg(process_group, "process_group")
    _substitute = _Substitute(process_group, heads_k_stride)
    for name in ("flash_attention_2", RFA_ATTN_IMPLEMENTATION):
        AttentionInterface.register(name, ring_flash_attention_forward)
    AttentionMaskInterface.register(RFA_ATTN_IMPLEMENTATION, _no_mask)


def _no_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> None:
    """Mask function: builds none (the documents come from update_ring_flash_attn_params);
    an ``attention_mask`` with zeros (padding) raises."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "ring flash attention adapter does not support padding (an attention_mask with "
            "zeros): pack the documents without padding and pass their boundaries to "
            "update_ring_flash_attn_params (or use dtensor_ring.hf.shard_batch, which handles "
            'padding, with attn_implementation="dtensor_ring")'
        )


def ring_flash_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: causal llama3 attention of this rank's slice.

    Args:
        module: the calling attention module (``is_causal`` unset or True, unless the
            ``is_causal`` keyword says True).
        query: ``[1, H, L, D]`` (L = T/W local tokens); key, value: ``[1, H_kv, L, D]``.
        attention_mask: must be None.  scaling: softmax scale (default ``D ** -0.5``).
        dropout: must be 0.  sliding_window: a query sees this many latest keys, or None.
        kwargs: ``position_ids``, ``cu_seq_lens_q/k`` are ignored (the documents are
            :data:`DATA_PARAMS`'s); as ``dtensor_ring.hf.ring_attention_forward`` otherwise.

    Returns:
        ``(out [1, L, H, D], None)``.
    """
    if _substitute is None:
        raise RuntimeError("call substitute_hf_flash_attn(process_group, heads_k_stride) first")
    if not DATA_PARAMS:
        raise RuntimeError(
            "call update_ring_flash_attn_params(cu_seqlens, process_group) before the forward"
        )
    group = _substitute.group
    with relay_errors(lambda: group_arg(group)[0], "rfa_hf_adapter"):
        window = _check_call(module, query, key, attention_mask, dropout, sliding_window, kwargs)
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))  # [L, H(_kv), D]
    out = llama3_flash_attn_varlen_func(
        q,
        k,
        v,
        DATA_PARAMS["cu_seqlens_q"],
        DATA_PARAMS["cu_seqlens_k"],
        DATA_PARAMS["max_seqlen_q"],
        DATA_PARAMS["max_seqlen_k"],
        _substitute.heads_k_stride,
        DATA_PARAMS["local_k_slice"],
        softmax_scale=scaling,
        causal=True,
        window_size=window,
        group=group,
    )
    return out.unsqueeze(0), None


def _check_call(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None,
    dropout: object,
    sliding_window: object,
    kwargs: dict,
) -> tuple[int, int]:
    """Reject what :func:`ring_flash_attention_forward` cannot honour; return its window."""
    check_model_keywords("ring flash attention adapter", kwargs, _KNOWN, dropout)
    if attention_mask is not None:
        raise ValueError(
            f"ring flash attention adapter cannot honour attention_mask="
            f"{summary(attention_mask)} (padding): pack the documents without padding and "
            "pass their boundaries to update_ring_flash_attn_params"
        )
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise ValueError("ring flash attention adapter supports causal attention only")
    if query.shape[0] != 1:
        raise ValueError(
            f"ring flash attention adapter needs batch size 1 (one packed row), got "
            f"{query.shape[0]}"
        )
    local = _local_tokens
    if query.shape[2] != local or key.shape[2] != local:
        raise ValueError(
            f"ring flash attention adapter got {query.shape[2]} queries and {key.shape[2]} keys, "
            f"but update_ring_flash_attn_params gave this rank {local} tokens (T / world_size); "
            "feed the rank's contiguous slice of the packed row, without a KV cache"
        )
    return window_kwarg(sliding_window)
