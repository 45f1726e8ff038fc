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
                                                   (its mask_mod sees global indices)
    SDPA: inputs as Shard(1) DTensors, the       ContextParallel's scoped SDPA mode: the
      dispatcher on                                module's F.scaled_dot_product_attention
                                                   runs ring attention on the local shards
    varlen: NotImplementedError                  dtensor_ring.flex_attention with the
                                                   documents of its VarlenMetadata (and its
                                                   window_size) as the mask: the same rows,
                                                   any balancer, in the inputs' dtype
    prepare_context_parallel_input:              the same arguments; "headtail" = zigzag,
      "headtail" | "ptrr" | None                   "ptrr" = the mask-aware layout of the batch's
                                                   BlockMask (dtensor_ring.flex_layout), None =
                                                   ring; masks are passed through whole

The layout the inputs were sharded in is the one the modules use (``context_parallel_shard``
records it; nothing recorded: PyTorch's default), unless ``apply_cp_to_forward(...,
layout=)`` fixes one. torchtitan is not imported by ``dtensor_ring``; this module imports
it when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from ..api.context_parallel import _cp_group
from ..api.documents import document_mask
from ..api.flex import flex_attention, flex_layout
from ..api.parallel_style import ContextParallel, context_parallel_shard, sharded_layout
from ..layouts import Layout


def apply_cp_to_forward(
    attention_modules: Sequence[nn.Module],
    cp_mesh: DeviceMesh,
    *,
    layout: str | Layout | None = None,
) -> None:
    """torchtitan's ``apply_cp_to_forward``: the inner attention modules compute over the
    sequence sharded on ``cp_mesh`` (Note [torchtitan on the ring]).

    Args:
        attention_modules: torchtitan's inner attention modules (all of one type:
            ``FlexAttention``, ``VarlenAttention`` or ``ScaledDotProductAttention``).
        cp_mesh: 1-D mesh of the context-parallel ranks.
        layout: our extension: the layout of the shards (None: the one
            :func:`prepare_context_parallel_input` sharded in).

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
    if isinstance(first, FlexAttention):
        for module in attention_modules:
            module.forward = _FlexForward(group, layout)
    elif isinstance(first, ScaledDotProductAttention):
        style = ContextParallel(layout=layout)
        for module in attention_modules:
            style._apply(module, cp_mesh)
    elif isinstance(first, VarlenAttention):
        for module in attention_modules:
            module.forward = _VarlenForward(group, layout, module.window_size)
    else:
        raise NotImplementedError(f"no context-parallel form for {type(first).__name__}")


class _FlexForward:
    """torchtitan's ``FlexAttention.forward`` (``[B, L, N, H]`` in and out) on the ring."""

    def __init__(self, group, layout: str | Layout | None):
        self.group, self.layout = group, layout

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
        out, lse = flex_attention(
            *(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)),
            score_mod=score_mod, block_mask=attention_masks, scale=scale, enable_gqa=enable_gqa,
            return_lse=True, group=self.group, layout=sharded_layout(self.layout),
        )  # fmt: skip
        out_BLNH = out.transpose(1, 2)
        return out_BLNH if out_transform is None else out_transform(out_BLNH, lse.transpose(1, 2))


class _VarlenForward(_FlexForward):
    """torchtitan's ``VarlenAttention.forward`` (``[B, L, N, H]``, ``attention_masks`` a
    ``VarlenMetadata`` of the whole batch) on the ring: its documents and ``window_size`` become
    a flex mask over the rows, built once a batch (the last metadata's mask is kept), and the
    call is the FlexAttention module's."""

    def __init__(self, group, layout: str | Layout | None, window_size: tuple[int, int]):
        super().__init__(group, layout)
        self.window_size = tuple(window_size)
        self._last: tuple[tuple, BlockMask] | None = None

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
        if kwargs:
            raise TypeError(f"torchtitan VarlenAttention on the ring: unexpected {sorted(kwargs)}")
        B, L_local = q_BLNH.shape[:2]
        block_mask = self._block_mask(attention_masks, B, L_local * self.group.size(), q_BLNH)
        return super().__call__(
            q_BLNH, k_BLNH, v_BLNH, attention_masks=block_mask, scale=scale,
            enable_gqa=enable_gqa, out_transform=out_transform,
        )  # fmt: skip

    def _block_mask(self, metadata: Any, B: int, L: int, q_BLNH: Tensor) -> BlockMask:
        """The batch's mask, rebuilt when the boundaries' values change (compared by value:
        a buffer refilled in place is a new batch)."""
        key = (
            *(tuple(t.tolist()) if isinstance(t, Tensor) else t
              for t in (getattr(metadata, "cu_seq_q", None), getattr(metadata, "cu_seq_k", None))),
            B, L, q_BLNH.device,
        )  # fmt: skip
        if self._last is None or self._last[0] != key:
            block_mask = varlen_block_mask(metadata, B, L, self.window_size, q_BLNH.device)
            self._last = (key, block_mask)
        return self._last[1]


def varlen_block_mask(
    metadata: Any, B: int, L: int, window_size: tuple[int, int], device: torch.device
) -> BlockMask:
    """The ``BlockMask`` (``[B, 1, L, L]``, global indices) of torchtitan's varlen attention:
    ``metadata.cu_seq_q`` (int ``[docs + 1]``) packs the ``B`` rows of ``L`` tokens; a query
    sees the keys of its own document within ``window_size = (left, right)`` (-1: unlimited).

    Raises:
        TypeError: ``metadata`` has no ``cu_seq_q`` / ``cu_seq_k`` tensors.
        ValueError: queries and keys are packed differently, the boundaries do not cover
            ``B * L`` tokens, or (:func:`~dtensor_ring.document_mask`) fall or let a document
            cross a row boundary (varlen attention would attend across rows there, which no
            per-row mask expresses).
    """
    cu_q, cu_k = (getattr(metadata, name, None) for name in ("cu_seq_q", "cu_seq_k"))
    if not isinstance(cu_q, Tensor) or not isinstance(cu_k, Tensor):
        raise TypeError(
            "torchtitan VarlenAttention on the ring: attention_masks must be torchtitan's "
            f"VarlenMetadata (cu_seq_q, cu_seq_k tensors), got {type(metadata).__name__}"
        )
    if not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError("varlen attention on the ring: cu_seq_q and cu_seq_k must be equal")
    if int(cu_q[-1]) != B * L:
        raise ValueError(
            f"varlen attention on the ring: cu_seq_q must end at B * L = {B} * {L} (the whole "
            f"batch, as get_attention_masks builds it), got {cu_q.tolist()}"
        )
    return document_mask(cu_q, L, window_size, device=device)


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
    ``load_balancer_type`` ("headtail": zigzag; "ptrr": the mask-aware layout of the batch's
    ``BlockMask`` or ``VarlenMetadata``'s causal documents, ``ptrr_mask_key`` naming it in a
    dict of masks; None: contiguous). The
    attention masks stay whole (global). ``device`` is unused (torchtitan's signature)."""
    masks = extra_kwargs.get("attention_masks")
    W = cp_mesh.size()
    if load_balancer_type == "headtail":
        layout: str | Layout = "zigzag"
    elif load_balancer_type is None:
        layout = "ring"
    elif load_balancer_type == "ptrr":
        mask = masks[ptrr_mask_key] if isinstance(masks, dict) else masks
        if hasattr(mask, "cu_seq_q"):  # VarlenMetadata: balance its causal documents
            mask = varlen_block_mask(mask, *inputs.shape[:2], (-1, 0), inputs.device)
        if not isinstance(mask, BlockMask):
            raise ValueError(
                f"load_balancer_type='ptrr' balances by the batch's BlockMask; got {type(mask)}"
                + ("" if not isinstance(masks, dict) else f" for ptrr_mask_key={ptrr_mask_key!r}")
            )
        seq_len = mask.seq_lengths[0]  # the most chunks a rank (<= 8) the length allows
        layout = flex_layout(mask, W, next(k for k in (8, 4, 2, 1) if seq_len % (W * k) == 0))
    else:
        raise ValueError(
            f"load_balancer_type={load_balancer_type!r}: one of 'headtail', 'ptrr', None"
        )
    inputs, labels, positions = context_parallel_shard(
        cp_mesh, [inputs, labels, extra_kwargs["positions"]], [1, 1, 1], layout=layout
    )
    return inputs, labels, {**extra_kwargs, "positions": positions}
