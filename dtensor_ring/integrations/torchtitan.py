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
    varlen: NotImplementedError                  NotImplementedError (the varlen functions
                                                   take documents: docs/varlen.md)
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
            ``FlexAttention`` or ``ScaledDotProductAttention``).
        cp_mesh: 1-D mesh of the context-parallel ranks.
        layout: our extension: the layout of the shards (None: the one
            :func:`prepare_context_parallel_input` sharded in).

    Raises:
        NotImplementedError: ``VarlenAttention`` (as torchtitan's) or another module type.
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
        raise NotImplementedError(
            "torchtitan's VarlenAttention under context parallelism: shard documents with "
            "dtensor_ring.shard_varlen and call dtensor_ring's varlen functions (docs/varlen.md)"
        )
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
    ``BlockMask``, ``ptrr_mask_key`` naming it in a dict of masks; None: contiguous). The
    attention masks stay whole (global). ``device`` is unused (torchtitan's signature)."""
    masks = extra_kwargs.get("attention_masks")
    W = cp_mesh.size()
    if load_balancer_type == "headtail":
        layout: str | Layout = "zigzag"
    elif load_balancer_type is None:
        layout = "ring"
    elif load_balancer_type == "ptrr":
        mask = masks[ptrr_mask_key] if isinstance(masks, dict) else masks
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
