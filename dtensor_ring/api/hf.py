"""Hugging Face transformers integration: ``attn_implementation="dtensor_ring"``.

    import dtensor_ring.hf as drhf
    drhf.setup(group=cp_group, layout="zigzag")      # registers the attention implementation
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dtensor_ring")
    out = model(**drhf.shard_batch(batch, group=cp_group, layout="zigzag"))

Every rank of ``group`` holds ``S / W`` tokens of each sequence (Note [Sequence layouts] in
``layouts/base.py``); the model's attention layers call ring attention over ``group`` on them, and
everything else (embeddings, norms, MLPs, RoPE with the *global* position ids that
:func:`shard_batch` provides, the token-level loss) runs on the local tokens unchanged.

Packed sequences (one row of documents back to back, ``position_ids`` restarting at 0 at each
document, as ``DataCollatorWithFlattening`` builds them) run the varlen attention, as
flash-attention-2 does in transformers: :func:`shard_batch` derives the *global* document
boundaries from the full ``position_ids`` and returns them as ``cu_seq_lens_q`` /
``cu_seq_lens_k``, which transformers passes through to the attention function (Note
[Varlen layouts] in ``layouts/varlen.py``: "llama3" cuts the packed stream into W contiguous slices;
"ring" / "zigzag" cut every document into W / 2W pieces).

Causal and bidirectional models (``is_causal=False``, e.g. Gemma 3 with
``use_bidirectional_attention``), dense and packed, in every layout.

Limits (each raises ``ValueError`` rather than computing something else): no bidirectional
sliding windows, no attention mask (padding) or 4-D masks, packed
sequences only with B == 1, the "llama3" layout only with B == 1 and "stripe" not packed,
position ids only as :func:`shard_batch` builds them (positions restarting without the
``cu_seq_lens_*`` metadata are rejected), no attention sinks (gpt-oss's ``s_aux``), softcap,
dropout, head mask, position bias or ``output_attentions=True``, no KV cache holding earlier
tokens. Sliding windows (``sliding_window``, a positive int) are supported, dense and packed.
Every keyword the attention function receives is used or rejected: an unknown one raises
``TypeError``, as does a wrongly typed ``sliding_window``, ``dropout`` or ``is_causal``.

``transformers`` is imported only inside the functions here; ``import dtensor_ring`` never
imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..consistency import relay_errors
from ..layouts import (
    LAYOUTS,
    Layout,
    get_layout,
    layout_names,
    order_layout,
    shard_local,
    token_indices,
)
from ..layouts.varlen import host_values, varlen_local_cu_seqlens, varlen_token_indices
from ..resolve import check_bool, group_arg
from ..schedule.llama3 import llama3_flash_attn_prepare_cu_seqlens
from .functional import ring_attention_func
from .varlen import llama3_attention_func, ring_varlen_attention_func

__all__ = ["ATTN_IMPLEMENTATION", "HF_LAYOUTS", "setup", "shard_batch", "ring_attention_forward"]

ATTN_IMPLEMENTATION = "dtensor_ring"
IGNORE_INDEX = -100
HFLayout = Literal["ring", "zigzag", "stripe", "llama3"]
HF_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "llama3")


@dataclass
class _Config:
    group: dist.ProcessGroup | None
    layout: str
    backend: str | None


_config: _Config | None = None


def _varlen_layout(layout: str) -> Layout:
    """The layout of a packed batch; ``ValueError`` if ``layout`` has no varlen form."""
    lay = get_layout(layout)
    if lay.varlen is None:
        raise ValueError(
            f"dtensor_ring has no packed (varlen) form for layout={layout!r}; "
            f"use one of {layout_names('varlen')}"
        )
    return lay


def setup(
    group: dist.ProcessGroup | None = None, layout: HFLayout = "zigzag", backend: str | None = None
) -> None:
    """Register ``attn_implementation="dtensor_ring"`` with transformers, running over ``group``.

    Registers :func:`ring_attention_forward` with ``transformers.AttentionInterface`` and a mask
    function with ``AttentionMaskInterface`` (it builds no mask: causality is the ring
    attention's). Call it on every rank before the model's first forward; calling it again
    replaces the group, layout and backend.

    Args:
        group: the context-parallel process group (default: the default group).
        layout: "ring", "zigzag", "stripe" or "llama3" (packed / B == 1 only): how
            :func:`shard_batch` shards the sequence.
        backend: block-kernel backend name (``dtensor_ring.BACKEND_NAMES``), or None.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _config
    get_layout(layout)
    if group is not None:
        group_arg(group)  # a ProcessGroup this rank belongs to (TypeError / ValueError)
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


#: Keywords that transformers' model code passes to attention functions and that cannot change
#: what this one computes, whatever their value.
_HARMLESS = frozenset(
    {
        # the module fills its KV cache before calling attention (models pass use_cache=True
        # even in training); key/value hold this call's tokens only (checked: as many as queries)
        "use_cache",
        # flash-attn's kernel sizes for cu_seq_lens_q/k: the varlen path derives its own
        "max_length_q",
        "max_length_k",
        # loss and output arguments (TransformersKwargs) that the model forwards to every layer
        "num_items_in_batch",
        "shift_labels",
        "output_hidden_states",
        "output_router_logits",
    }
)

_WITHOUT = 'run the model without dtensor_ring (e.g. attn_implementation="eager")'

#: Keywords of features this function does not implement: name -> (the values besides None that
#: mean the feature is off, why another value is rejected and what to do).
_FEATURE_OFF: dict[str, tuple[tuple[object, ...], str]] = {
    "s_aux": ((), f"attention sinks (gpt-oss) are not supported yet; {_WITHOUT}"),
    "sinks": ((), f"attention sinks are not supported yet; {_WITHOUT}"),
    "softcap": (
        (0,),
        "logit softcapping (Gemma 2) is not supported; set the config's "
        f"attn_logit_softcapping=None, or {_WITHOUT}",
    ),
    "head_mask": ((), "per-head masks are not supported; drop head_mask"),
    "position_bias": ((), f"additive position biases (T5-style) are not supported; {_WITHOUT}"),
    "output_attentions": (
        (False,),
        "ring attention never forms the attention weights; pass output_attentions=False",
    ),
    "seq_idx": (
        (),
        "the packed documents come from cu_seq_lens_q/k (dtensor_ring.hf.shard_batch); "
        "drop seq_idx",
    ),
}

#: Keywords this function reads (below), besides attention_mask, scaling and dropout.
_USED = frozenset({"is_causal", "sliding_window", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"})


def _summary(value: object) -> str:
    """``value`` for a message: a tensor's shape and dtype, a short repr of anything else."""
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def ring_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: ring attention over the :func:`setup` group.

    Every keyword is used or rejected, before any communication (:func:`_check_call`).

    Args:
        module: the calling attention module; its ``is_causal`` (default True) says whether
            the model is causal, unless the ``is_causal`` keyword is given.
        query: ``[B, H, S, D]`` (S local tokens); key, value: ``[B, H_kv, S, D]``.
        attention_mask: must be None (:func:`setup`'s mask function builds none).
        scaling: softmax scale (default ``D ** -0.5``).  dropout: must be 0.
        kwargs: ``position_ids [B, S]`` must be this rank's positions as :func:`shard_batch`
            builds them; ``cu_seq_lens_q`` (and ``cu_seq_lens_k``, equal to it), the *global*
            document boundaries ``[N + 1]`` of a packed batch (B == 1), select the varlen
            attention; ``sliding_window`` (Mistral, Qwen2, Gemma ...: a query sees the
            ``sliding_window`` latest keys, itself included) becomes
            ``window_size=(sliding_window - 1, 0)`` (docs/window.md), causal models only;
            ``is_causal`` a bool or None. Accepted as harmless: ``use_cache`` (no cached
            earlier tokens), ``max_length_q/k``, the loss and output flags models forward to
            every layer.
            Accepted only with the feature off: ``s_aux`` / ``sinks``, ``softcap`` (or 0),
            ``head_mask``, ``position_bias``, ``seq_idx`` None, ``output_attentions`` False.

    Returns:
        ``(out [B, S, H, D], None)``.

    Raises:
        TypeError: an unknown keyword, or a keyword of the wrong type.
        ValueError: a keyword or value that it cannot honour, naming it and what to do.
    """
    if _config is None:
        raise RuntimeError("call dtensor_ring.hf.setup(group=..., layout=...) first")
    with relay_errors(_group_name, "hf"):
        window, causal = _check_call(module, query, key, attention_mask, dropout, kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        out = _varlen_attention(query, key, value, scaling, cu_seqlens, window, causal, kwargs)
        return out, None
    world = dist.get_world_size(_config.group)
    with relay_errors(_group_name, "hf"):
        if not get_layout(_config.layout).dense:
            raise ValueError(
                f"dtensor_ring attention with layout={_config.layout!r} needs the cu_seq_lens_q "
                "metadata that dtensor_ring.hf.shard_batch returns"
            )
        seq_local = query.shape[2]
        _check_positions(
            kwargs.get("position_ids"),
            token_indices(_config.layout, seq_local * world, dist.get_rank(_config.group), world),
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = ring_attention_func(
        order_layout(_config.layout, causal, window),  # any sharding order if non-causal
        q,
        k,
        v,
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        group=_config.group,
        backend=_config.backend,
    )
    return out, None


def _group_name() -> str:
    """The name of :func:`setup`'s group (for the consistency mode's relay)."""
    assert _config is not None
    return group_arg(_config.group)[0]


def check_model_keywords(who: str, kwargs: dict, used: frozenset[str], dropout: object) -> None:
    """The checks every transformers attention function of ours makes of what model code
    passes: a keyword neither ``used`` nor harmless (TypeError), a feature that must be off
    (:data:`_FEATURE_OFF`), dropout (a number, 0). ``who`` starts the messages."""
    unknown = sorted(set(kwargs) - used - _HARMLESS - set(_FEATURE_OFF))
    if unknown:
        given = ", ".join(f"{name}={_summary(kwargs[name])}" for name in unknown)
        raise TypeError(
            f"{who} got unknown keyword(s) {given}; it cannot tell whether ignoring them would "
            f"change the result: drop them if the model does not need them, or {_WITHOUT}"
        )
    for name, (off, why) in _FEATURE_OFF.items():
        value = kwargs.get(name)
        if value is not None and (isinstance(value, Tensor) or value not in off):
            raise ValueError(f"{who} got {name}={_summary(value)}: {why}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"{who}: dropout must be a float, got {_summary(dropout)}")
    if dropout != 0:  # transformers passes the config's attention_dropout in training mode
        raise ValueError(
            f"{who} does not support dropout={dropout}; set the model config's attention_dropout "
            "to 0"
        )


def _check_call(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None,
    dropout: object,
    kwargs: dict,
) -> tuple[int, int]:
    """Reject what :func:`ring_attention_forward` cannot honour (local checks only); return
    the ``window_size`` of ``sliding_window``."""
    check_model_keywords("dtensor_ring attention", kwargs, _USED, dropout)
    if attention_mask is not None:
        raise ValueError(
            f"dtensor_ring attention cannot honour attention_mask={_summary(attention_mask)} "
            "(4-D or custom masks); it computes causality itself: drop the mask, and pack "
            "documents with dtensor_ring.hf.shard_batch instead of masking them"
        )
    is_causal = kwargs.get("is_causal")
    causal = check_bool(
        "is_causal", getattr(module, "is_causal", True) if is_causal is None else is_causal
    )
    if not causal and kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"dtensor_ring attention got sliding_window={_summary(kwargs['sliding_window'])} "
            "with is_causal=False: bidirectional sliding windows (whose extent differs between "
            f"models) are not supported yet; {_WITHOUT}"
        )
    if query.dim() == key.dim() == 4 and key.shape[2] != query.shape[2]:
        raise ValueError(
            f"dtensor_ring attention got {key.shape[2]} keys for {query.shape[2]} queries: a KV "
            "cache holding earlier tokens (generation) is not supported; pass use_cache=False"
        )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_q and (cu_q is None or not torch.equal(cu_k, cu_q)):
        raise ValueError(
            f"dtensor_ring attention needs cu_seq_lens_k == cu_seq_lens_q, got "
            f"cu_seq_lens_q={_summary(cu_q)}, cu_seq_lens_k={_summary(cu_k)}; build them with "
            "dtensor_ring.hf.shard_batch"
        )
    return _window(kwargs.get("sliding_window")), causal


def _window(sliding_window: object) -> tuple[int, int]:
    """flash-attn's ``window_size`` of transformers' ``sliding_window`` (None: no window)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(
            "dtensor_ring attention: sliding_window must be a positive int or None, got "
            f"{_summary(sliding_window)}"
        )
    if sliding_window <= 0:
        raise ValueError(
            f"dtensor_ring attention: sliding_window={sliding_window} must be positive (the "
            "number of latest keys a query sees, itself included), or None for no window"
        )
    # transformers' masks: key j visible to query i iff i - sliding_window < j <= i
    return (sliding_window - 1, 0)


def _varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float | None,
    cu_seqlens: Tensor,
    window: tuple[int, int],
    causal: bool,
    kwargs: dict,
) -> Tensor:
    """Varlen attention of a packed row: ``query [1, H, T_local, D]``, key/value
    ``[1, H_kv, T_local, D]``, global ``cu_seqlens [N + 1]`` -> ``out [1, T_local, H, D]``;
    ``window`` within documents (llama3 only)."""
    assert _config is not None
    layout, group = _config.layout, _config.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with relay_errors(_group_name, "hf"):
        lay = _varlen_layout(layout)
        if query.shape[0] != 1:
            raise ValueError(
                f"dtensor_ring packed attention needs batch size 1, got {query.shape[0]}"
            )
        bounds = host_values(cu_seqlens)
        if bounds[-1] != query.shape[2] * world:
            raise ValueError(
                f"cu_seq_lens_q must be the global document boundaries (ending at T_local * W "
                f"= {query.shape[2] * world}), got {list(bounds)}; build it with shard_batch"
            )
        _check_positions(
            kwargs.get("position_ids"),
            _doc_positions(bounds)[varlen_token_indices(bounds, layout, rank, world)],
        )
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))  # [T_local, H(_kv), D]
    if lay.varlen == "stream":
        cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(
            cu_seqlens, causal, rank, world
        )
        out = llama3_attention_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            k.shape[1],
            k_slice,
            softmax_scale=scaling,
            causal=causal,
            window_size=window,
            group=group,
            backend=_config.backend,
            layout=layout,
        )
    else:
        out = ring_varlen_attention_func(
            order_layout(layout, causal, window),
            q,
            k,
            v,
            varlen_local_cu_seqlens(cu_seqlens, layout, rank, world),
            None,
            softmax_scale=scaling,
            causal=causal,
            window_size=window,
            group=group,
            backend=_config.backend,
        )
    return out.unsqueeze(0)


def _check_positions(position_ids: Tensor | None, expected: Tensor) -> None:
    """Raise unless ``position_ids [B, S]`` equal ``expected [S]`` (this rank's positions)."""
    assert _config is not None
    if (
        position_ids is None
        or position_ids.shape[-1] != expected.shape[0]
        or not bool((position_ids == expected.to(position_ids.device)).all())
    ):
        raise ValueError(
            "dtensor_ring attention needs position_ids = this rank's positions under "
            f"layout={_config.layout!r} (global positions, or positions within each document "
            "of a packed batch); build the inputs with dtensor_ring.hf.shard_batch: packed "
            "sequences (positions restarting per document) need its cu_seq_lens_q/k metadata"
        )


def _doc_positions(bounds: Sequence[int]) -> Tensor:
    """Position of every token within its document (int64 ``[T]``), for ``cu_seqlens`` bounds."""
    b = torch.tensor(bounds)
    starts, lengths = b[:-1], b[1:] - b[:-1]
    return torch.arange(bounds[-1]) - starts.repeat_interleave(lengths)


def _packed_bounds(position_ids: Tensor | None, seq_len: int) -> tuple[int, ...] | None:
    """Document boundaries of a packed ``position_ids [B, S]``; None if every row is 0..S-1."""
    if position_ids is None or bool(
        (position_ids == torch.arange(seq_len, device=position_ids.device)).all()
    ):
        return None
    if position_ids.shape[0] != 1:
        raise ValueError(
            "dtensor_ring supports packed sequences (position_ids restarting per "
            f"document) only in one row (batch size 1), got {position_ids.shape[0]}"
        )
    row = position_ids[0].cpu()
    bounds = (*(row == 0).nonzero().flatten().tolist(), seq_len)
    if bounds[0] != 0 or not torch.equal(row, _doc_positions(bounds)):
        raise ValueError(
            "dtensor_ring needs position_ids 0, 1, ... within every document "
            "(restarting at 0 at each document start)"
        )
    return bounds


def shard_batch(
    batch: dict[str, Tensor], group: dist.ProcessGroup | None = None, layout: HFLayout = "zigzag"
) -> dict[str, Tensor]:
    """This rank's part of a causal-LM batch, ready for ``model(**...)`` (no communication).

    Args:
        batch: full sequences, identical on every rank of ``group``: ``input_ids [B, S]`` and
            optionally ``labels [B, S]`` (unshifted, as for transformers' causal LMs), an
            all-ones ``attention_mask`` and ``position_ids [B, S]``: 0..S-1 in every row, or,
            for a packed batch (B == 1), restarting at 0 at each document start, as
            ``DataCollatorWithFlattening`` builds them. S must divide as the layout needs
            (dense: S % W, or 2W for zigzag; packed: Note [Varlen layouts]).
        group: the context-parallel process group (the one given to :func:`setup`).
        layout: the layout given to :func:`setup`; "llama3" treats a B == 1 batch that is not
            packed as one document.

    Returns:
        ``input_ids`` and ``position_ids [B, S/W]`` (global positions, or positions within
        each document if packed); with labels also ``labels`` and ``shift_labels [B, S/W]``
        (shifted *before* sharding, so each local token has its own next token, -100 after
        the last) and ``num_items_in_batch`` (the non-ignored label count of the whole
        sequences). Packed (or "llama3"): also ``cu_seq_lens_q`` = ``cu_seq_lens_k``, the
        *global* document boundaries (int32 ``[N + 1]``), which select the varlen attention.
        The model's loss is then this rank's share of the global mean: sum it over the ranks
        of ``group`` (or, equivalently, sum the gradients; e.g. all-reduce them) to get the
        single-process loss and gradients.

    Raises:
        ValueError: for an ``attention_mask`` with padding, packed rows with B > 1, a packed
            batch with layout "stripe", lengths the layout cannot divide, or keys it cannot
            shard.
    """
    lay = get_layout(layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    extra = set(batch) - {"input_ids", "labels", "attention_mask", "position_ids"}
    if extra:
        raise ValueError(f"shard_batch cannot shard {sorted(extra)}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("dtensor_ring does not support padding (attention_mask with zeros)")
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    bounds = _packed_bounds(batch.get("position_ids"), S)
    out: dict[str, Tensor] = {}
    shard: Callable[[Tensor], Tensor]
    if bounds is None and lay.dense:
        positions = torch.arange(S)
        shard = functools.partial(shard_local, layout=layout, rank=rank, world_size=world)
    else:
        _varlen_layout(layout)
        if B != 1:
            raise ValueError(f"dtensor_ring layout={layout!r} needs batch size 1, got {B}")
        bounds = bounds or (0, S)
        positions = _doc_positions(bounds)
        index = varlen_token_indices(bounds, layout, rank, world).to(input_ids.device)
        shard = functools.partial(torch.index_select, dim=1, index=index)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(
            bounds, dtype=torch.int32, device=input_ids.device
        )
    out["input_ids"] = shard(input_ids)
    out["position_ids"] = shard(positions.to(input_ids.device).expand(B, S))
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        out["shift_labels"] = out["labels"] = shard(shifted)
        out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return out
