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
``use_bidirectional_attention``), dense and packed, in every layout; "llama3" dense batches of
any batch size (Note [llama3 with a batch]). "llama3_zigzag" (zigzag's tokens, K/V
all-gathered: Note [Balanced all-gather attention] in ``engine/llama3.py``) runs the all-gather
op for every mask, dense (a row per document) and packed (documents multiples of 2W). "auto"
(zigzag's tokens) chooses the ring, the all-gather or (dense) Ulysses per call (Note [Choosing
ring, all-gather or Ulysses] in ``schedule/policy.py``).

Padding (a 2-D ``attention_mask`` with zeros, left, right or inside rows) in causal models:
:func:`shard_batch` moves each row's padding after its real tokens, carrying positions and
labels along, and passes the mask to the attention function, which zeroes the pad rows; loss
and gradients equal the model's in one process (sdpa) with the same mask (Note [Padding]).
Outputs are in the reordered, sharded order: :func:`gather_outputs` restores the batch order.

Limits (each raises ``ValueError`` rather than computing something else): no bidirectional
sliding windows, no padding in bidirectional models, no padding between real tokens with a
sliding window, no loss term on a pad that follows a real token (its label, the next token's,
must be -100), padding only with the default positions and not in packed rows, an
``attention_mask`` with zeros only through :func:`shard_batch`, no 4-D masks, packed
sequences only with B == 1 and "stripe" not packed, position ids only as :func:`shard_batch`
builds them (positions restarting without the ``cu_seq_lens_*`` metadata are rejected), no
softcap, dropout, head mask, position bias or ``output_attentions=True``, no KV cache holding
earlier tokens (generation: :func:`dtensor_ring.hf.generate`). Sliding windows
(``sliding_window``, a positive int) and attention sinks (gpt-oss's ``s_aux``) are supported,
dense and packed. Every keyword the
attention function receives is used or rejected: an unknown one raises ``TypeError``, as does
a wrongly typed ``sliding_window``, ``dropout`` or ``is_causal``.

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
    call_layout,
    get_layout,
    layout_names,
)
from ..layouts.varlen import (
    host_values,
    unshard_varlen,
    varlen_local_cu_seqlens,
    varlen_token_indices,
)
from ..resolve import check_bool, group_arg
from ..schedule.llama3 import llama3_flash_attn_prepare_cu_seqlens
from .functional import ring_attention_func
from .varlen import llama3_attention_func, ring_varlen_attention_func

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HF_LAYOUTS",
    "PADDING_MASK",
    "setup",
    "shard_batch",
    "gather_outputs",
    "ring_attention_forward",
]

ATTN_IMPLEMENTATION = "dtensor_ring"
IGNORE_INDEX = -100
#: The keyword under which :func:`shard_batch` hands a padded batch's full ``attention_mask``
#: to the attention function (transformers forwards it untouched; Note [Padding]).
PADDING_MASK = "dtensor_ring_attention_mask"
HFLayout = Literal["ring", "zigzag", "stripe", "llama3", "llama3_zigzag", "auto"]
HF_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "llama3", "auto")


@dataclass
class _Config:
    group: dist.ProcessGroup | None
    layout: str
    backend: str | None


_config: _Config | None = None

# Note [Padding]
# ~~~~~~~~~~~~~~
# transformers in one process, given a 2-D ``attention_mask`` (1: real token, 0: pad) and no
# position_ids: positions are 0..S-1 in every row, pads included; a query sees the *real* keys
# at or before it (pad keys are masked for every query); a query with none (a pad before the
# row's first real token) gets an attention output of 0 (sdpa, torch >= 2.5, returns 0 for a
# fully masked row; flash-attention-2's unpadding gives every pad 0; eager gives NaN). The loss
# counts every shifted label != -100, pads' included.
#
# Ring attention takes causality from the token order and no mask. So :func:`shard_batch`
# reorders every row by a stable partition, real tokens first, then pads (each in order), and
# carries each token's original position (RoPE) and shifted label (the next token's label,
# shifted *before* reordering) with it:
#
#     row        _  _  a  b  _  c        attention_mask  0 0 1 1 0 1
#     reordered  a  b  c  _  _  _        position_ids    2 3 5 0 1 4
#
# A real query then sees, by order, exactly the real keys it saw in one process (all pads come
# after every real token), at the same positions: real tokens are exact with no mask, for left,
# right and interior padding. Pad queries would see real keys and earlier pads; the attention
# function zeroes every pad row's output instead, which is what one process computes for pads
# before the first real token (so their loss terms are exact: with left padding the last pad
# predicts the first real token, as in one process with sdpa) and keeps NaN out of pad rows.
# A pad *after* a real token sees real keys in one process (sdpa) but 0 here (as with
# flash-attention-2): :func:`shard_batch` raises ValueError unless its loss term is ignored
# (-100; collators set the labels at padding to -100, which is exactly this for right padding).
# Every pad then contributes the same to loss and gradients in both (nothing, after a real token).
#
# Sliding windows count tokens in the row (transformers: indices, pads included); reordering
# keeps the distance between real tokens when they are contiguous in the row (left and/or
# right padding); padding between real tokens with a window raises. Bidirectional models would
# see the trailing pads as keys: padding raises for them (packing the batch would need the
# documents' lengths to divide as the varlen layouts need).
#
# Transformers must not see the mask (its mask function would have to honour it): shard_batch
# returns no ``attention_mask`` but the full mask ``[B, S]``, identical on every rank, as the
# :data:`PADDING_MASK` keyword, which transformers forwards to the attention function. From it
# every rank derives the reordering, checks ``position_ids`` against it (a batch sharded in any
# other way is rejected), finds its pad rows, and knows that the batch is padded even when its
# own tokens are all real, so bidirectional models raise on every rank before communicating.
# The mask function that :func:`setup` registers raises for any ``attention_mask`` with zeros:
# a padded batch that did not go through shard_batch never runs. Outputs (logits) come out in
# the reordered, sharded order: :func:`gather_outputs` restores the batch order.
#
# Note [llama3 with a batch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The llama3 attention op is varlen (``q [T, H, D]``, no batch dim). A dense batch of B rows,
# every row one sequence cut into W contiguous slices (what :func:`shard_batch` gives for
# "llama3" when the rows are not packed, padded or not), is folded into the heads: ``query
# [B, H, L, D] -> [L, B*H, D]`` (head ``b*H + h``), key/value ``[L, B*H_kv, D]`` (head
# ``b*H_kv + j``), one document ``cu_seqlens = [0, L * W]``. flash-attn's GQA maps query head i
# to KV head ``i // G`` (G = H / H_kv), and ``(b*H + h) // G = b*H_kv + h // G``: every row's
# queries meet that row's keys only, with the model's GQA mapping. The output
# ``[L, B*H, D]`` unfolds to ``[B, L, H, D]``. Packed rows stay B == 1 (transformers packs
# into one row).


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
        layout: "ring", "zigzag", "stripe", "llama3", "llama3_zigzag" or "auto"
            (:data:`HF_LAYOUTS`): how :func:`shard_batch` shards the sequence; "llama3" and
            "llama3_zigzag" all-gather K/V, "auto" (zigzag's tokens) chooses the ring, the
            all-gather or Ulysses per call (Note [Choosing ring, all-gather or Ulysses]), the
            others pass them around a ring.
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
    """Mask function: builds none (causality is the ring attention's); an ``attention_mask``
    with zeros reaching the model raises: :func:`shard_batch` hands padding to the attention
    function under another keyword (Note [Padding]), so this one did not come from it."""
    if attention_mask is not None and not bool(attention_mask.all()):
        with relay_errors(_group_name, "hf"):
            raise ValueError(
                "dtensor_ring attention got an attention_mask with zeros (padding) in the model "
                "call, which ring attention cannot apply; pass the batch, with its "
                "attention_mask, through dtensor_ring.hf.shard_batch and call the model with "
                "exactly what it returns (it moves the padding after each row's real tokens "
                f"and passes the mask as {PADDING_MASK}), without an attention_mask"
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
_WITH_SINKS = 'attn_implementation="dtensor_ring" (dtensor_ring.hf.setup) supports them'

#: Keywords of features this function does not implement: name -> (the values besides None that
#: mean the feature is off, why another value is rejected and what to do).
_FEATURE_OFF: dict[str, tuple[tuple[object, ...], str]] = {
    "s_aux": ((), f"attention sinks (gpt-oss) are not supported here; {_WITH_SINKS}"),
    "sinks": ((), f"attention sinks are not supported here; {_WITH_SINKS}"),
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
_USED = frozenset(
    {
        "is_causal",
        "sliding_window",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        PADDING_MASK,
        "s_aux",
        "sinks",
    }
)


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
            attention; ``dtensor_ring_attention_mask`` (:data:`PADDING_MASK`), the full
            ``attention_mask [B, S * W]`` of a padded batch from :func:`shard_batch`, causal
            models only (Note [Padding]): pad rows' outputs are zero; ``sliding_window``
            (Mistral, Qwen2, Gemma ...: a query sees the ``sliding_window`` latest keys,
            itself included) becomes
            ``window_size=(sliding_window - 1, 0)`` (docs/window.md), causal models only;
            ``is_causal`` a bool or None. Accepted as harmless: ``use_cache`` (no cached
            earlier tokens), ``max_length_q/k``, the loss and output flags models forward to
            every layer.
            ``s_aux`` (gpt-oss) or ``sinks``: attention-sink logits ``[H]`` (Note [Attention
            sinks]; the gradient of each rank is its tokens' share, summed by the gradient
            reduction over the group as every other parameter's).
            Accepted only with the feature off: ``softcap`` (or 0), ``head_mask``,
            ``position_bias``, ``seq_idx`` None, ``output_attentions`` False.

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
        sinks = _sinks(kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        out = _varlen_attention(
            query, key, value, scaling, cu_seqlens, window, causal, sinks, kwargs
        )
        return out, None
    group, layout = _config.group, _config.layout
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with relay_errors(_group_name, "hf"):
        lay = get_layout(layout)
        if not lay.dense and lay.varlen != "stream":
            raise ValueError(
                f"dtensor_ring attention with layout={layout!r} needs the cu_seq_lens_q "
                "metadata that dtensor_ring.hf.shard_batch returns"
            )
        batch, seq_local = query.shape[0], query.shape[2]
        index = lay.token_indices(seq_local * world, rank, world)
        padding = _padding(kwargs.get(PADDING_MASK), batch, seq_local * world, causal, window)
        expected, real = (index, None) if padding is None else padding.local(index)
        _check_positions(kwargs.get("position_ids"), expected)
    if lay.dense:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = ring_attention_func(
            call_layout(layout, causal, window),
            q,
            k,
            v,
            softmax_scale=scaling,
            causal=causal,
            window_size=window,
            group=group,
            backend=_config.backend,
            sinks=sinks,
        )
    else:
        out = _llama3_rows(query, key, value, scaling, window, causal, sinks)
    if real is not None:  # pad rows: 0, as for pads before any real token in one process
        out = out.masked_fill(~real.to(out.device)[:, :, None, None], 0.0)
    return out, None


def _llama3_rows(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float | None,
    window: tuple[int, int],
    causal: bool,
    sinks: Tensor | None,
) -> Tensor:
    """llama3 all-gather attention of a dense batch, every row one sequence cut into W
    contiguous slices, its batch folded into the heads (Note [llama3 with a batch]): ``query
    [B, H, L, D]``, key/value ``[B, H_kv, L, D]`` -> ``out [B, L, H, D]``; ``sinks [H]``
    repeated for every row's heads."""
    assert _config is not None
    world = dist.get_world_size(_config.group)
    batch, heads, length, _ = query.shape

    def fold(t: Tensor) -> Tensor:  # [B, H, L, D] -> [L, B*H, D], head b*H + h
        return t.permute(2, 0, 1, 3).reshape(length, batch * t.shape[1], t.shape[3])

    out = _llama3_stream(
        fold(query),
        fold(key),
        fold(value),
        torch.tensor([0, length * world], dtype=torch.int32),  # one document per row
        scaling,
        window,
        causal,
        None if sinks is None else sinks.repeat(batch),  # head b*H + h: sinks[h]
        "llama3",
    )
    return out.reshape(length, batch, heads, out.shape[-1]).permute(1, 0, 2, 3)


def _llama3_stream(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    scaling: float | None,
    window: tuple[int, int],
    causal: bool,
    sinks: Tensor | None,
    layout: str,
) -> Tensor:
    """llama3 all-gather attention over :func:`setup`'s group of a stream ``layout``: local
    ``q [L, H, D]``, ``k, v [L, H_kv, D]`` of the packed stream with *global* document
    boundaries ``cu_seqlens`` -> ``out [L, H, D]`` (all KV heads gathered at once)."""
    assert _config is not None
    group = _config.group
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(
        cu_seqlens, causal, dist.get_rank(group), dist.get_world_size(group)
    )
    return llama3_attention_func(
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
        sinks=sinks,
    )


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
        value = None if name in used else kwargs.get(name)
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


def _sinks(kwargs: dict) -> Tensor | None:
    """The attention-sink logits a model passes (gpt-oss: ``s_aux``; ``sinks`` also read),
    or None; both given must be the same tensor."""
    s_aux, sinks = kwargs.get("s_aux"), kwargs.get("sinks")
    if s_aux is not None and sinks is not None and s_aux is not sinks:
        raise ValueError(
            f"dtensor_ring attention got both s_aux={_summary(s_aux)} and "
            f"sinks={_summary(sinks)}; pass the attention-sink logits once"
        )
    return sinks if s_aux is None else s_aux


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
    sinks: Tensor | None,
    kwargs: dict,
) -> Tensor:
    """Varlen attention of a packed row: ``query [1, H, T_local, D]``, key/value
    ``[1, H_kv, T_local, D]``, global ``cu_seqlens [N + 1]`` -> ``out [1, T_local, H, D]``;
    ``window`` within documents."""
    assert _config is not None
    layout, group = _config.layout, _config.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with relay_errors(_group_name, "hf"):
        lay = _varlen_layout(layout)
        if kwargs.get(PADDING_MASK) is not None:
            raise ValueError(
                f"dtensor_ring attention got both cu_seq_lens_q (packed documents) and "
                f"{PADDING_MASK} (padding); dtensor_ring.hf.shard_batch never returns both: "
                "packed rows cannot hold padding"
            )
        if query.shape[0] != 1:
            raise ValueError(
                "dtensor_ring packed attention (cu_seq_lens_q) needs batch size 1, got "
                f"{query.shape[0]}: transformers packs documents into one row "
                "(DataCollatorWithFlattening); pack the rows into one"
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
        out = _llama3_stream(q, k, v, cu_seqlens, scaling, window, causal, sinks, layout)
    else:
        out = ring_varlen_attention_func(
            call_layout(layout, causal, window),
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
            sinks=sinks,
        )
    return out.unsqueeze(0)


def _check_positions(position_ids: Tensor | None, expected: Tensor) -> None:
    """Raise unless ``position_ids [B, S]`` equal ``expected``, ``[S]`` or ``[B, S]`` (this
    rank's positions)."""
    assert _config is not None
    if (
        position_ids is None
        or position_ids.shape[-1] != expected.shape[-1]
        or (expected.dim() == 2 and tuple(position_ids.shape) != tuple(expected.shape))
        or not bool((position_ids == expected.to(position_ids.device)).all())
    ):
        raise ValueError(
            "dtensor_ring attention needs position_ids = this rank's positions under "
            f"layout={_config.layout!r} (global positions, or positions within each document "
            "of a packed batch); build the inputs with dtensor_ring.hf.shard_batch: packed "
            "sequences (positions restarting per document) need its cu_seq_lens_q/k metadata"
        )


def _padding_order(real: Tensor) -> Tensor:
    """Note [Padding]'s reordering of ``real [B, S]`` (bool, True: real token): int64 ``[B, S]``,
    row b's original token indices, real tokens first, then pads (each in order)."""
    return torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices


@dataclass(frozen=True)
class _Padding:
    """A padded batch's reordering (Note [Padding]): ``order [B, S]`` (:func:`_padding_order`;
    also every token's position) and ``real [B, S]``, whether reordered token j is real."""

    order: Tensor
    real: Tensor

    def local(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """The positions ``[B, S_local]`` and real flags ``[B, S_local]`` of the reordered
        tokens ``index [S_local]`` (this rank's, under the layout)."""
        index = index.to(self.order.device)
        return self.order[:, index], self.real[:, index]


#: the last :func:`_padding` result: (mask, (its version, batch, seq_len), _Padding); the same
#: mask reaches every layer of a forward (and the recomputation of activation checkpointing)
_PADDING_CACHE: list[tuple[Tensor, tuple[int, int, int], _Padding]] = []


def _padding(
    mask: object, batch: int, seq_len: int, causal: bool, window: tuple[int, int]
) -> _Padding | None:
    """Check :data:`PADDING_MASK` (None: not padded) against the call: ``mask [B, S]``, the full
    ``attention_mask`` of :func:`shard_batch` (identical on every rank, so every rank raises
    alike); its reordering (Note [Padding])."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"dtensor_ring attention got {PADDING_MASK}={_summary(mask)}; it must be the full "
            f"attention_mask [B, S] = [{batch}, {seq_len}] of the batch (S = local tokens * "
            "world size), as dtensor_ring.hf.shard_batch returns it"
        )
    try:
        version = mask._version
    except RuntimeError:  # inference-mode tensors have no version counter: do not cache
        version = -1
    key = (version, batch, seq_len)
    padding = next((p for m, k, p in _PADDING_CACHE if m is mask and k == key), None)
    if padding is None:
        real = mask.to(torch.bool)
        order = _padding_order(real)
        padding = _Padding(order, torch.gather(real, 1, order))
        if version >= 0:
            _PADDING_CACHE[:] = [(mask, key, padding)]
    if not causal and not bool(padding.real.all()):
        raise ValueError(
            "dtensor_ring attention cannot apply padding (an attention_mask with zeros) in a "
            "bidirectional model (is_causal=False): ring attention takes no mask, and every "
            "query would see the padding; use sequences without padding (or pack them), or "
            + _WITHOUT
        )
    if window != (-1, -1):
        count = padding.real.sum(dim=1)
        first = padding.order[:, 0]
        last = padding.order.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
        gaps = ((count > 0) & (last - first != count - 1)).nonzero().flatten().tolist()
        if gaps:
            raise ValueError(
                f"dtensor_ring attention with a sliding window cannot apply padding between "
                f"real tokens (rows {gaps} of the attention_mask have zeros between ones): the "
                "window counts the padding, which the reordering of Note [Padding] removes; "
                "pad only at the start or the end of each row"
            )
    return padding


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
            optionally ``labels [B, S]`` (unshifted, as for transformers' causal LMs),
            ``attention_mask [B, S]`` (zeros: padding, anywhere in a row; Note [Padding]) and
            ``position_ids [B, S]``: 0..S-1 in every row, or, for a packed batch (B == 1, no
            padding), restarting at 0 at each document start, as
            ``DataCollatorWithFlattening`` builds them. S must divide as the layout needs
            (dense: S % W, or 2W for zigzag and llama3_zigzag; packed: Note [Varlen layouts]).
        group: the context-parallel process group (the one given to :func:`setup`).
        layout: the layout given to :func:`setup`; "llama3" cuts every row that is not packed
            into W contiguous slices (any B: Note [llama3 with a batch]).

    Returns:
        ``input_ids`` and ``position_ids [B, S/W]`` (global positions, or positions within
        each document if packed); with labels also ``labels`` and ``shift_labels [B, S/W]``
        (shifted *before* sharding, so each local token has its own next token, -100 after
        the last) and ``num_items_in_batch`` (the non-ignored label count of the whole
        sequences). Packed: also ``cu_seq_lens_q`` = ``cu_seq_lens_k``, the *global* document
        boundaries (int32 ``[N + 1]``), which select the varlen attention. Padded (an
        ``attention_mask`` with zeros): every row reordered, real tokens first, then pads,
        each token keeping its position and shifted label, and ``dtensor_ring_attention_mask``
        (:data:`PADDING_MASK`), the full mask ``[B, S]`` (bool), instead of
        ``attention_mask`` (Note [Padding]); :func:`gather_outputs` restores the batch order
        of outputs. The model's loss is then this rank's share of the global mean: sum it over
        the ranks of ``group`` (or, equivalently, sum the gradients; e.g. all-reduce them) to
        get the single-process loss and gradients.

    Raises:
        ValueError: a loss term on a pad that follows a real token (a label that is not -100
            after it: Note [Padding]), padding with positions other than 0..S-1 or in a
            packed batch, packed rows with B > 1, a packed batch with layout "stripe",
            lengths the layout cannot divide, or keys it cannot shard.
    """
    lay = get_layout(layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    extra = set(batch) - {"input_ids", "labels", "attention_mask", "position_ids"}
    if extra:
        raise ValueError(f"shard_batch cannot shard {sorted(extra)}")
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    device = input_ids.device
    labels = batch.get("labels")
    shifted = None
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    real = _real_tokens(batch.get("attention_mask"), B, S, shifted)
    position_ids = batch.get("position_ids")
    if real is not None:
        if position_ids is not None and not bool(
            (position_ids == torch.arange(S, device=position_ids.device)).all()
        ):
            raise ValueError(
                "shard_batch supports padding (attention_mask with zeros) only with the "
                "model's default positions: position_ids absent or 0..S-1 in every row (packed "
                "rows cannot hold padding); drop position_ids or the padding"
            )
        position_ids = None
    bounds = _packed_bounds(position_ids, S)
    out: dict[str, Tensor] = {}
    shard: Callable[[Tensor], Tensor]
    if bounds is None and (lay.dense or lay.varlen == "stream"):
        index = lay.token_indices(S, rank, world).to(device)
        positions = torch.arange(S, device=device).expand(B, S)
        if real is None:
            shard = functools.partial(torch.index_select, dim=1, index=index)
        else:  # Note [Padding]: real tokens first, every token keeping its position
            order = _padding_order(real).to(device)  # positions: arange reordered = order

            def shard(t: Tensor) -> Tensor:
                return t.gather(1, order.to(t.device)).index_select(1, index.to(t.device))

            out[PADDING_MASK] = real.to(device)
    else:
        _varlen_layout(layout)
        if B != 1:
            raise ValueError(
                "shard_batch: packed sequences (position_ids restarting per document) need "
                f"batch size 1 with layout={layout!r}, got {B}: transformers packs documents "
                "into one row (DataCollatorWithFlattening)"
            )
        bounds = bounds or (0, S)
        positions = _doc_positions(bounds).to(device).expand(B, S)
        index = varlen_token_indices(bounds, layout, rank, world).to(device)
        shard = functools.partial(torch.index_select, dim=1, index=index)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(
            bounds, dtype=torch.int32, device=device
        )
    out["input_ids"] = shard(input_ids)
    out["position_ids"] = shard(positions)
    if shifted is not None:
        out["shift_labels"] = out["labels"] = shard(shifted)
        out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return out


def _real_tokens(mask: Tensor | None, B: int, S: int, shifted: Tensor | None) -> Tensor | None:
    """``attention_mask [B, S]`` as bool (None if absent or all ones); ``ValueError`` unless
    every pad after a real token has an ignored loss term (``shifted`` labels; Note [Padding])."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or tuple(mask.shape) != (B, S):
        raise ValueError(
            f"shard_batch: attention_mask must be a [B, S] = [{B}, {S}] tensor like input_ids, "
            f"got {_summary(mask)}"
        )
    if bool(mask.all()):
        return None
    real = mask.to(torch.bool)
    if shifted is not None:
        after_real = real.cumsum(dim=1) > 0
        bad = (~real & after_real & (shifted.to(real.device) != IGNORE_INDEX)).nonzero()
        if bad.numel():
            b, t = bad[0].tolist()
            raise ValueError(
                f"shard_batch: the padding token {t} of row {b} (attention_mask[{b}, {t}] == 0, "
                f"after a real token) has a loss term: labels[{b}, {t + 1}] = "
                f"{int(shifted[b, t])} is not -100 ({bad.shape[0]} such pads). The model in one "
                "process computes it from what that pad attends to, which ring attention does "
                "not reproduce (Note [Padding]), so the losses could not match; set the labels "
                "of padding to -100 (as transformers' collators do) and, for padding inside a "
                "row, the label of the real token after it"
            )
    return real


def gather_outputs(
    local: Tensor,
    inputs: dict[str, Tensor],
    group: dist.ProcessGroup | None = None,
    layout: HFLayout = "zigzag",
) -> Tensor:
    """The full ``[B, S, ...]`` of every rank's ``local [B, S/W, ...]`` model output (logits,
    hidden states) for ``inputs = shard_batch(batch, group, layout)``, in ``batch``'s token
    order: undoes the layout (dense or packed) and the reordering of padded rows
    (Note [Padding]). A collective: every rank of ``group`` calls it. Not differentiable.
    """
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    cu_seqlens = inputs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        return unshard_varlen(parts, cu_seqlens, layout, seq_dim=1)
    lay = get_layout(layout)
    seq_len = local.shape[1] * world
    order = torch.cat([lay.token_indices(seq_len, r, world) for r in range(world)])
    full = torch.cat(parts, dim=1).index_select(1, torch.argsort(order).to(local.device))
    mask = inputs.get(PADDING_MASK)
    if mask is None:
        return full
    back = torch.argsort(_padding_order(mask.to(torch.bool)), dim=1).to(local.device)
    return full.gather(1, back.view(*back.shape, *[1] * (full.dim() - 2)).expand_as(full))
