"""torchtitan's context-parallel functions on dtensor_ring: change the import, keep the trainer.

    # before (torchtitan 0.3)
    from torchtitan.distributed.context_parallel import (
        apply_cp_to_forward, prepare_context_parallel_input)
    # after
    from dtensor_ring.integrations.torchtitan import (
        apply_cp_to_forward, prepare_context_parallel_input)

Note [torchtitan on the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.3 applies context parallelism to its inner attention modules (``[B, L, N, H]``
q, k, v) and shards each batch:

    torchtitan                                   here
    FlexAttention: K/V all-gathered, the         dtensor_ring.flex_attention on the shards:
      BlockMask sharded by the balancer            K/V on the ring, the *global* BlockMask
                                                   (its mask_mod sees global indices); a
                                                   document mask runs on the varlen kernels
    SDPA: inputs as Shard(1) DTensors, the       ContextParallel's scoped SDPA mode: the
      dispatcher on                                module's F.scaled_dot_product_attention
                                                   runs ring attention on the local shards
    varlen: NotImplementedError                  the varlen kernels on the ring: the B rows
                                                   are one packed stream of B * L tokens (as
                                                   its kernel sees them), each rank's tokens
                                                   placed by document (the placed plan: pieces
                                                   that need no other rank's K/V wait for none)
    prepare_context_parallel_input:              the same arguments; "headtail" = zigzag,
      "headtail" | "ptrr" | None                   "ptrr" = the mask-aware layout of the batch's
                                                   BlockMask (dtensor_ring.flex_layout; one
                                                   row's document mask and a VarlenMetadata:
                                                   its documents placed whole
                                                   where that balances (document_layout; a
                                                   rank's tokens come back as [B, L / W]),
                                                   None = ring; masks are passed through whole

The layout the inputs were sharded in is the one the modules use (``context_parallel_shard``
records it; nothing recorded: PyTorch's default), unless ``apply_cp_to_forward(...,
layout=)`` fixes one. torchtitan is not imported by ``dtensor_ring``; this module imports
it when called.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from ..algorithm import VARLEN_ALGORITHMS
from ..api.context_parallel import _cp_group
from ..api.documents import PlacedRows, document_layout, document_mask, placed_rows
from ..api.flex import flex_attention, flex_layout
from ..api.parallel_style import ContextParallel, context_parallel_shard, sharded_layout
from ..api.varlen import attend_rows
from ..consistency import relay_errors
from ..layouts import Layout
from ..layouts.documents import DocumentLayout
from ..layouts.varlen import check_bounds, check_cu_seqlens_tensor, host_values
from ..resolve import group_arg, normalize_window
from ..schedule.flex_documents import mask_documents


def apply_cp_to_forward(
    attention_modules: Sequence[nn.Module],
    cp_mesh: DeviceMesh,
    *,
    layout: str | Layout | None = None,
    algorithm: str | None = None,
) -> None:
    """torchtitan's ``apply_cp_to_forward``: the inner attention modules compute over the
    sequence sharded on ``cp_mesh`` (Note [torchtitan on the ring]).

    Args:
        attention_modules: torchtitan's inner attention modules (all of one type:
            ``FlexAttention``, ``VarlenAttention`` or ``ScaledDotProductAttention``).
        cp_mesh: 1-D mesh of the context-parallel ranks.
        layout: our extension: the layout of the shards (None: the one
            :func:`prepare_context_parallel_input` sharded in).
        algorithm: our extension: how K/V move (None: the ring). "all_gather": for the
            documents of ``VarlenAttention`` and of document masks, each rank fetches only
            the keys its queries see (Note [Gathering what placed documents need]; a flex
            call that does not run as documents raises); for SDPA modules,
            ``ContextParallel``'s.

    Raises:
        NotImplementedError: another module type.
    """
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    group = _cp_group(cp_mesh)
    first = attention_modules[0]
    documents = isinstance(first, (FlexAttention, VarlenAttention))
    if documents and algorithm not in (None, *VARLEN_ALGORITHMS):
        raise ValueError(
            f"apply_cp_to_forward(algorithm={algorithm!r}): {type(first).__name__} runs on the "
            "ring (None, 'ring') or by the all-gather of placed documents ('all_gather')"
        )
    if isinstance(first, FlexAttention):
        for module in attention_modules:
            module.forward = _FlexForward(group, layout, algorithm)
    elif isinstance(first, ScaledDotProductAttention):
        style = ContextParallel(layout=layout, algorithm=algorithm)
        for module in attention_modules:
            style._apply(module, cp_mesh)
    elif isinstance(first, VarlenAttention):
        for module in attention_modules:
            module.forward = _VarlenForward(group, layout, module.window_size, algorithm)
    else:
        raise NotImplementedError(f"no context-parallel form for {type(first).__name__}")


class _FlexForward:
    """torchtitan's ``FlexAttention.forward`` (``[B, L, N, H]`` in and out) on the ring."""

    def __init__(self, group, layout: str | Layout | None, algorithm: str | None = None):
        self.group, self.layout, self.algorithm = group, layout, algorithm

    def __call__(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs: Any,
    ) -> Tensor:
        if kwargs:
            raise TypeError(f"torchtitan FlexAttention on the ring: unexpected {sorted(kwargs)}")
        # the lse only for out_transform: a call without it may run on the varlen kernels
        # (Note [Document masks on the varlen kernels]), whose lse has no gradient
        result = flex_attention(
            *(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)),
            score_mod=score_mod, block_mask=attention_masks, scale=scale, enable_gqa=enable_gqa,
            return_lse=out_transform is not None, group=self.group,
            layout=sharded_layout(self.layout), algorithm=self.algorithm,
        )  # fmt: skip
        if out_transform is None:
            return result.transpose(1, 2)
        out, lse = result
        return out_transform(out.transpose(1, 2), lse.transpose(1, 2))


class _VarlenForward:
    """torchtitan's ``VarlenAttention.forward`` (``[B, L, N, H]``, ``attention_masks`` a
    ``VarlenMetadata`` of the whole batch, ``window_size`` the module's) on the ring: the
    batch's rows are one packed stream of ``B * L`` tokens, as its kernel sees them, each
    rank's tokens placed by document (Note [torchtitan on the ring]). The varlen kernels run
    it; with ``out_transform``, whose lse needs its gradient (which they do not give),
    ``dtensor_ring.flex_attention`` with the documents' mask over the stream."""

    def __init__(self, group, layout, window_size: tuple[int, int], algorithm: str | None = None):
        self.group, self.layout, self.algorithm = group, layout, algorithm
        self.window_size = tuple(window_size)

    def __call__(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        out_transform=None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        with relay_errors(lambda: group_arg(self.group)[0], "VarlenAttention"):  # every rank's
            if kwargs:
                raise TypeError(
                    f"torchtitan VarlenAttention on the ring: unexpected {sorted(kwargs)}"
                )
            B, L_local, N = q_BLNH.shape[:3]
            if not enable_gqa and k_BLNH.shape[2] != N:
                raise ValueError(
                    f"torchtitan VarlenAttention on the ring: {N} query heads and "
                    f"{k_BLNH.shape[2]} key/value heads need enable_gqa=True"
                )
            placed = self._placed(attention_masks, B, L_local)
        if out_transform is None:
            return attend_rows(
                placed, q_BLNH, k_BLNH, v_BLNH, softmax_scale=scale,
                window_size=self.window_size, group=self.group, algorithm=self.algorithm,
            )  # fmt: skip
        q_T, k_T, v_T = (placed.stream(t) for t in (q_BLNH, k_BLNH, v_BLNH))
        out, lse = flex_attention(
            *(t.transpose(0, 1)[None] for t in (q_T, k_T, v_T)),
            block_mask=_stream_mask(placed.layout.bounds, self.window_size, q_T.device),
            scale=scale, enable_gqa=True, return_lse=True, group=self.group,
            layout=placed.layout, algorithm=self.algorithm,
        )  # fmt: skip
        out_BLNH = placed.rows(out[0].transpose(0, 1), B)
        return out_transform(out_BLNH, placed.rows(lse[0].transpose(0, 1), B))

    def _placed(self, metadata: Any, B: int, L_local: int) -> PlacedRows:
        """The batch's documents on the ranks as the shards hold them (the boundaries are read
        on every call: a buffer refilled in place is a new batch)."""
        layout = sharded_layout(self.layout)
        cu_q = varlen_bounds(metadata)
        W, rank = self.group.size(), self.group.rank()
        L = L_local * W
        if cu_q[-1] != B * L:
            raise ValueError(
                f"varlen attention on the ring: cu_seq_q must end at B * L = {B} * {L} (the "
                f"whole batch, as get_attention_masks builds it), got {list(cu_q)}"
            )
        if isinstance(layout, DocumentLayout):  # prepare_context_parallel_input's "ptrr"
            if layout.bounds != cu_q:
                raise ValueError(
                    "varlen attention on the ring: the batch was sharded for other "
                    "documents; shard each batch with prepare_context_parallel_input and "
                    "its own VarlenMetadata"
                )
            return PlacedRows(layout, rank, None)
        causal, window = normalize_window(self.window_size, False, B * L)
        return placed_rows(cu_q, B, L, layout, W, rank, causal, window)


@functools.lru_cache(maxsize=8)
def _stream_mask(
    bounds: tuple[int, ...], window_size: tuple[int, int], device: torch.device
) -> BlockMask:
    """The documents' mask over the packed stream, built once a batch (every layer asks)."""
    cu = torch.tensor(bounds, dtype=torch.int32)
    return document_mask(cu, bounds[-1], window_size, device=device)


def varlen_bounds(metadata: Any) -> tuple[int, ...]:
    """The document boundaries of torchtitan's ``VarlenMetadata`` (``cu_seq_q``: int
    ``[docs + 1]`` over the ``B`` rows packed one after another; empty documents allowed).

    Raises:
        TypeError: ``metadata`` has no ``cu_seq_q`` / ``cu_seq_k`` tensors.
        ValueError: queries and keys are packed differently, boundaries not int32 or not
            increasing from 0 (repeated ones, empty documents, are dropped).
    """
    cu_q, cu_k = (getattr(metadata, name, None) for name in ("cu_seq_q", "cu_seq_k"))
    if not isinstance(cu_q, Tensor) or not isinstance(cu_k, Tensor):
        raise TypeError(
            "torchtitan VarlenAttention on the ring: attention_masks must be torchtitan's "
            f"VarlenMetadata (cu_seq_q, cu_seq_k tensors), got {type(metadata).__name__}"
        )
    for name, cu in (("cu_seq_q", cu_q), ("cu_seq_k", cu_k)):
        check_cu_seqlens_tensor(cu, name)
    values = host_values(cu_q)
    if host_values(cu_k) != values:
        raise ValueError("varlen attention on the ring: cu_seq_q and cu_seq_k must be equal")
    # an empty document holds no tokens: the same attention without it
    bounds = tuple(b for i, b in enumerate(values) if i == 0 or b != values[i - 1])
    check_bounds(bounds, bounds[-1], "cu_seq_q")
    return bounds


def prepare_context_parallel_input(
    inputs: Tensor,
    labels: Tensor,
    extra_kwargs: dict[str, Any],
    cp_mesh: DeviceMesh,
    device: torch.device,
    load_balancer_type: str | None = "headtail",
    ptrr_mask_key: str | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """torchtitan's ``prepare_context_parallel_input``: this rank's shard of ``inputs``,
    ``labels`` and ``extra_kwargs["positions"]`` (``[B, L]``), in the layout of
    ``load_balancer_type`` ("headtail": zigzag; None: contiguous; "ptrr": the mask-aware
    layout of the batch's ``BlockMask``, ``ptrr_mask_key`` naming it in a dict of masks; for one
    row under a document mask, its documents placed whole where that balances). For
    a ``VarlenMetadata``, "ptrr" places its documents instead
    (:func:`~dtensor_ring.document_layout` over the ``B * L`` tokens as one packed stream):
    each rank's ``B * L / W`` tokens, in increasing order, come back as ``[B, L / W]``. The
    attention masks stay whole (global). ``device`` is unused (torchtitan's signature)."""
    masks = extra_kwargs.get("attention_masks")
    W = cp_mesh.size()
    buffers = [inputs, labels, extra_kwargs["positions"]]
    if load_balancer_type == "headtail":
        layout: str | Layout = "zigzag"
    elif load_balancer_type is None:
        layout = "ring"
    elif load_balancer_type == "ptrr":
        mask = masks[ptrr_mask_key] if isinstance(masks, dict) else masks
        if hasattr(mask, "cu_seq_q"):
            return _shard_documents(buffers, varlen_bounds(mask), cp_mesh, extra_kwargs)
        if not isinstance(mask, BlockMask):
            raise ValueError(
                "load_balancer_type='ptrr' balances by the batch's BlockMask or VarlenMetadata; "
                f"got {type(mask)}"
                + ("" if not isinstance(masks, dict) else f" for ptrr_mask_key={ptrr_mask_key!r}")
            )
        layout = _ptrr_layout(mask, inputs.shape[0], W)
    else:
        raise ValueError(
            f"load_balancer_type={load_balancer_type!r}: one of 'headtail', 'ptrr', None"
        )
    inputs, labels, positions = context_parallel_shard(cp_mesh, buffers, [1, 1, 1], layout=layout)
    return inputs, labels, {**extra_kwargs, "positions": positions}


def _ptrr_layout(mask: BlockMask, rows: int, world_size: int) -> Layout:
    """ "ptrr" for a ``BlockMask``: a document mask of one row (read back as documents, Note
    [Document masks on the varlen kernels]) has its documents placed whole where that
    balances (``document_layout``, as for a ``VarlenMetadata``); another mask, or several rows
    (one layout serves them all), the mask-aware chunks of ``flex_layout``, as many a rank
    (<= 8) as the length allows."""
    seq_len = mask.seq_lengths[0]
    documents = mask_documents(mask, 1) if rows == 1 and seq_len % world_size == 0 else None
    if documents is not None:
        window_size = documents.window_size
        return document_layout(
            documents.bounds, world_size, causal=window_size[1] == 0, window_size=window_size
        )
    chunks = next(k for k in (8, 4, 2, 1) if seq_len % (world_size * k) == 0)
    return flex_layout(mask, world_size, chunks)


def _shard_documents(
    buffers: list[Tensor], bounds: tuple[int, ...], cp_mesh: DeviceMesh, extra_kwargs: dict
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """ "ptrr" for a ``VarlenMetadata`` of documents ``bounds``: the ``[B, L]`` buffers as one
    packed stream, sharded in :func:`~dtensor_ring.document_layout`'s placement of them,
    each rank's tokens as ``[B, L / W]``."""
    B, L = buffers[0].shape[:2]
    W = cp_mesh.size()
    if L % W or bounds[-1] != B * L:
        raise ValueError(
            f"load_balancer_type='ptrr' with VarlenMetadata: the row length L = {L} must be "
            f"divisible by the {W} context-parallel ranks and cu_seq_q must end at B * L = "
            f"{B * L}, got {list(bounds)}"
        )
    layout = document_layout(bounds, W)
    flat = [t.expand(B, L).reshape(1, B * L) for t in buffers]
    shards = context_parallel_shard(cp_mesh, flat, [1, 1, 1], layout=layout)
    inputs, labels, positions = (t.reshape(B, L // W) for t in shards)
    return inputs, labels, {**extra_kwargs, "positions": positions}
