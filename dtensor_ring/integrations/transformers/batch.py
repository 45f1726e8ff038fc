"""Batches for the transformers integration: :func:`shard_batch` shards a batch (dense, padded
or packed documents) for the context-parallel group, :func:`gather_outputs` puts the model's
outputs back in the batch's order (Note [Padding]).

``transformers`` is not imported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ...api.documents import document_layout
from ...layouts import (
    LAYOUTS,
    Layout,
    get_layout,
    layout_names,
)
from ...layouts.varlen import (
    host_values,
    unshard_varlen,
    varlen_token_indices,
)
from .keywords import RUN_WITHOUT, summary

__all__ = ["HF_LAYOUTS", "IGNORE_INDEX", "PADDING_MASK", "shard_batch", "gather_outputs"]

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


IGNORE_INDEX = -100
#: The keyword under which :func:`shard_batch` hands a padded batch's full ``attention_mask``
#: to the attention function (transformers forwards it untouched; Note [Padding]).
PADDING_MASK = "dtensor_ring_attention_mask"
HFLayout = Literal["ring", "zigzag", "stripe", "llama3", "llama3_zigzag", "auto", "documents"]
#: "documents": packed rows only, each batch's documents placed by
#: :func:`dtensor_ring.document_layout` (any lengths; the ring)
DOCUMENTS = "documents"
HF_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "llama3", "auto", DOCUMENTS)


def packed_layout(layout: str, bounds: Sequence[int], world: int) -> str | Layout:
    """The layout a packed batch of documents ``bounds`` (global) runs in on ``world`` ranks:
    ``layout``, or for "documents" :func:`dtensor_ring.document_layout`'s placement of these
    documents (the same on every rank; the last few cached). ``ValueError`` if ``layout`` has
    no varlen form."""
    if layout == DOCUMENTS:
        return _document_layout(tuple(bounds), world)
    if get_layout(layout).varlen is None:
        raise ValueError(
            f"dtensor_ring has no packed (varlen) form for layout={layout!r}; "
            f"use one of {layout_names('varlen')} or {DOCUMENTS!r}"
        )
    return layout


@functools.lru_cache(maxsize=8)
def _document_layout(bounds: tuple[int, ...], world: int) -> Layout:
    return document_layout(bounds, world)


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


#: the last :func:`padding_of` result: (mask, (its version, batch, seq_len), _Padding); the same
#: mask reaches every layer of a forward (and the recomputation of activation checkpointing)
_PADDING_CACHE: list[tuple[Tensor, tuple[int, int, int], _Padding]] = []


def padding_of(
    mask: object, batch: int, seq_len: int, causal: bool, window: tuple[int, int]
) -> _Padding | None:
    """Check :data:`PADDING_MASK` (None: not padded) against the call: ``mask [B, S]``, the full
    ``attention_mask`` of :func:`shard_batch` (identical on every rank, so every rank raises
    alike); its reordering (Note [Padding])."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"dtensor_ring attention got {PADDING_MASK}={summary(mask)}; it must be the full "
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
            + RUN_WITHOUT
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


def doc_positions(bounds: Sequence[int]) -> Tensor:
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
    if bounds[0] != 0 or not torch.equal(row, doc_positions(bounds)):
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
    documents = layout == DOCUMENTS  # packed rows only: no dense form
    lay = None if documents else get_layout(layout)
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
        if documents:
            raise ValueError(
                "shard_batch: layout='documents' places the documents of packed rows, which "
                "cannot hold padding; pack the batch (DataCollatorWithFlattening) or drop the "
                "padding"
            )
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
    if bounds is None and not documents and (lay.dense or lay.varlen == "stream"):
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
        if B != 1:
            raise ValueError(
                "shard_batch: packed sequences (position_ids restarting per document) need "
                f"batch size 1 with layout={layout!r}, got {B}: transformers packs documents "
                "into one row (DataCollatorWithFlattening)"
            )
        bounds = bounds or (0, S)
        positions = doc_positions(bounds).to(device).expand(B, S)
        placed = packed_layout(layout, bounds, world)
        index = varlen_token_indices(bounds, placed, rank, world).to(device)
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
            f"got {summary(mask)}"
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
        placed = packed_layout(layout, host_values(cu_seqlens), world)
        return unshard_varlen(parts, cu_seqlens, placed, seq_dim=1)
    lay = get_layout(layout)
    seq_len = local.shape[1] * world
    order = torch.cat([lay.token_indices(seq_len, r, world) for r in range(world)])
    full = torch.cat(parts, dim=1).index_select(1, torch.argsort(order).to(local.device))
    mask = inputs.get(PADDING_MASK)
    if mask is None:
        return full
    back = torch.argsort(_padding_order(mask.to(torch.bool)), dim=1).to(local.device)
    return full.gather(1, back.view(*back.shape, *[1] * (full.dim() - 2)).expand_as(full))
