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
"ring" / "zigzag" cut every document into W / 2W pieces; "documents", packed rows only, places
them by ``dtensor_ring.document_layout``, which every rank derives from the boundaries).

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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ...algorithm import VARLEN_ALGORITHMS, Algorithm
from ...api.attend import dense_attention, varlen_attention
from ...api.varlen import llama3_attention_func
from ...consistency import relay_errors
from ...layouts import (
    get_layout,
)
from ...layouts.varlen import (
    host_values,
    varlen_local_cu_seqlens,
    varlen_token_indices,
)
from ...resolve import ALGORITHMS, check_bool, group_arg, placement
from ...schedule.llama3 import llama3_flash_attn_prepare_cu_seqlens
from .batch import (
    DOCUMENTS,
    PADDING_MASK,
    HFLayout,
    doc_positions,
    packed_layout,
    padding_of,
)
from .keywords import RUN_WITHOUT, check_model_keywords, sinks_kwarg, summary, window_kwarg

__all__ = ["ATTN_IMPLEMENTATION", "setup", "ring_attention_forward"]

ATTN_IMPLEMENTATION = "dtensor_ring"


@dataclass
class Setup:
    """What :func:`setup` registered: the group, layout, block-kernel backend and algorithm
    every ``attn_implementation="dtensor_ring"`` call runs with."""

    group: dist.ProcessGroup | None
    layout: str
    backend: str | None
    algorithm: str | None


_config: Setup | None = None


def current_setup() -> Setup | None:
    """What :func:`setup` registered last (None before the first call)."""
    return _config


# Note [llama3 with a batch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dense batch of B rows in the "llama3" layout (what :func:`shard_batch` gives when the rows
# are not packed, padded or not) holds slice r of W contiguous slices of every row on rank r:
# the "ring" layout's tokens, row by row. So it runs the all-gather over the ring layout's
# tokens (``algorithm="all_gather"``, all KV heads gathered at once, as the stream does), every
# row one document of the packed form (``api/attend.py``: rows as documents, a view): any B.
# Packed rows stay B == 1 (transformers packs into one row).


def setup(
    group: dist.ProcessGroup | None = None,
    layout: HFLayout = "zigzag",
    backend: str | None = None,
    algorithm: Algorithm | None = None,
) -> None:
    """Register ``attn_implementation="dtensor_ring"`` with transformers, running over ``group``.

    Registers :func:`ring_attention_forward` with ``transformers.AttentionInterface`` and a mask
    function with ``AttentionMaskInterface`` (it builds no mask: causality is the ring
    attention's). Call it on every rank before the model's first forward; calling it again
    replaces the group, layout and backend.

    Args:
        group: the context-parallel process group (default: the default group).
        layout: "ring", "zigzag", "stripe", "llama3", "llama3_zigzag", "auto" or
            "documents" (:data:`HF_LAYOUTS`): how :func:`shard_batch` shards the sequence;
            "llama3" and "llama3_zigzag" all-gather K/V, "auto" (zigzag's tokens) chooses the
            ring, the all-gather or Ulysses per call (Note [Choosing ring, all-gather or
            Ulysses]), the others pass them around a ring. "documents": packed rows only, each
            batch's documents (any lengths) placed by :func:`dtensor_ring.document_layout`,
            on the ring or (``algorithm="all_gather"``) by the all-gather of placed documents
            (Note [Gathering what placed documents need]).
        backend: block-kernel backend name (``dtensor_ring.BACKEND_NAMES``), or None.
        algorithm: how K/V move (Note [Layouts and algorithms]): "ring", "all_gather",
            "ulysses" (dense batches) or "auto"; None: the layout alias's, else "ring"
            ("llama3": the all-gather).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _config
    if layout == DOCUMENTS:  # a layout per batch, from its documents
        if algorithm not in (None, *VARLEN_ALGORITHMS):
            raise ValueError(
                "layout='documents' places each packed batch's documents: pass algorithm="
                "'ring' (or None) or 'all_gather' (each rank fetches only the keys its "
                f"queries see), got {algorithm!r}"
            )
    else:
        lay = get_layout(layout)
        placement(layout, algorithm, allowed=ALGORITHMS if lay.dense else ("all_gather",))
    if group is not None:
        group_arg(group)  # a ProcessGroup this rank belongs to (TypeError / ValueError)
    _config = Setup(group, layout, backend, algorithm)
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
        sinks = sinks_kwarg(kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        out = _varlen_attention(
            query, key, value, scaling, cu_seqlens, window, causal, sinks, kwargs
        )
        return out, None
    group, layout = _config.group, _config.layout
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with relay_errors(_group_name, "hf"):
        lay = None if layout == DOCUMENTS else get_layout(layout)  # "documents": packed only
        if lay is None or (not lay.dense and lay.varlen != "stream"):
            raise ValueError(
                f"dtensor_ring attention with layout={layout!r} needs the cu_seq_lens_q "
                "metadata that dtensor_ring.hf.shard_batch returns"
            )
        batch, seq_local = query.shape[0], query.shape[2]
        mask = kwargs.get(PADDING_MASK)
        if isinstance(mask, Tensor) and mask.dim() == 2:  # the full mask: the global length
            _check_shard_length(seq_local, mask.shape[1], world, f"{PADDING_MASK}'s")
        index = lay.token_indices(seq_local * world, rank, world)
        padding = padding_of(kwargs.get(PADDING_MASK), batch, seq_local * world, causal, window)
        expected, real = (index, None) if padding is None else padding.local(index)
        _check_positions(kwargs.get("position_ids"), expected)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if lay.dense:
        out, _ = dense_attention(
            q,
            k,
            v,
            layout=layout,
            algorithm=_config.algorithm,
            causal=causal,
            softmax_scale=scaling,
            window_size=window,
            group=group,
            backend=_config.backend,
            sinks=sinks,
            return_lse=False,
            order_free=True,  # a bidirectional model on zigzag shards: the order-free plan
        )
    else:  # the packed stream's dense rows: Note [llama3 with a batch]
        out, _ = dense_attention(
            q,
            k,
            v,
            layout="ring",
            algorithm="all_gather",
            causal=causal,
            softmax_scale=scaling,
            window_size=window,
            group=group,
            backend=_config.backend,
            sinks=sinks,
            heads_k_stride=k.shape[2],
            return_lse=False,
        )
    if real is not None:  # pad rows: 0, as for pads before any real token in one process
        out = out.masked_fill(~real.to(out.device)[:, :, None, None], 0.0)
    return out, None


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
            f"dtensor_ring attention cannot honour attention_mask={summary(attention_mask)} "
            "(4-D or custom masks); it computes causality itself: drop the mask, and pack "
            "documents with dtensor_ring.hf.shard_batch instead of masking them"
        )
    is_causal = kwargs.get("is_causal")
    causal = check_bool(
        "is_causal", getattr(module, "is_causal", True) if is_causal is None else is_causal
    )
    if not causal and kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"dtensor_ring attention got sliding_window={summary(kwargs['sliding_window'])} "
            "with is_causal=False: bidirectional sliding windows (whose extent differs between "
            f"models) are not supported yet; {RUN_WITHOUT}"
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
            f"cu_seq_lens_q={summary(cu_q)}, cu_seq_lens_k={summary(cu_k)}; build them with "
            "dtensor_ring.hf.shard_batch"
        )
    return window_kwarg(kwargs.get("sliding_window")), causal


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
        _check_shard_length(query.shape[2], bounds[-1], world, "cu_seq_lens_q's")
        if bounds[-1] != query.shape[2] * world:
            raise ValueError(
                f"cu_seq_lens_q must be the global document boundaries (ending at T_local * W "
                f"= {query.shape[2] * world}), got {list(bounds)}; build it with shard_batch"
            )
        placed = packed_layout(layout, bounds, world)
        _check_positions(
            kwargs.get("position_ids"),
            doc_positions(bounds)[varlen_token_indices(bounds, placed, rank, world)],
        )
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))  # [T_local, H(_kv), D]
    if get_layout(placed).varlen == "stream":
        out = _llama3_stream(q, k, v, cu_seqlens, scaling, window, causal, sinks, layout)
    else:
        out, _ = varlen_attention(
            q,
            k,
            v,
            varlen_local_cu_seqlens(cu_seqlens, placed, rank, world),
            None,
            layout=placed,
            algorithm=_config.algorithm,
            causal=causal,
            softmax_scale=scaling,
            window_size=window,
            group=group,
            backend=_config.backend,
            sinks=sinks,
            order_free=True,
        )
    return out.unsqueeze(0)


#: The mistake of every rank passing the whole sequence (Note [Whole sequence on every rank]).
_WHOLE_SEQUENCE = (
    "every rank passed the whole sequence instead of its shard; call the model with what "
    "dtensor_ring.hf.shard_batch returns (this rank's S / W tokens, their global positions)"
)

# Note [Whole sequence on every rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every rank calling the model on the whole batch (not shard_batch's output) has the shapes of
# a valid call over W times the sequence. Where the call also carries the global length, a
# rank whose token count equals it cannot hold a shard (W > 1), and every rank raises alike:
# a padded batch's full mask (PADDING_MASK, [B, S]) and a packed batch's global boundaries
# (cu_seq_lens_q ends at T). A dense batch without either carries no global length; there the
# positions check catches it (the model's default positions 0..S-1 are not a shard's, except
# rank 0's under "ring", which then waits for its peers: DTENSOR_RING_DEBUG=1 raises on every
# rank), and its message names the mistake.


def _check_shard_length(seq_local: int, seq_len: int, world: int, hint: str) -> None:
    """ValueError when this rank's ``seq_local`` tokens are the whole ``seq_len`` (read from
    ``hint``) on a group of several ranks (Note [Whole sequence on every rank])."""
    if world > 1 and seq_local == seq_len:
        raise ValueError(
            f"dtensor_ring attention got {seq_local} tokens on this rank of {world}, "
            f"{hint} whole length: {_WHOLE_SEQUENCE}"
        )


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
        default = position_ids is not None and bool(
            (position_ids == torch.arange(position_ids.shape[-1], device=position_ids.device)).all()
        )
        hint = (
            f" (these are 0..{position_ids.shape[-1] - 1}, the model's default for a whole "
            f"sequence: if {_WHOLE_SEQUENCE})"
            if default and dist.get_world_size(_config.group) > 1
            else ""
        )
        raise ValueError(
            "dtensor_ring attention needs position_ids = this rank's positions under "
            f"layout={_config.layout!r} (global positions, or positions within each document "
            f"of a packed batch){hint}; build the inputs with dtensor_ring.hf.shard_batch: "
            "packed sequences (positions restarting per document) need its cu_seq_lens_q/k "
            "metadata"
        )
