"""Sharding rules of our ops on DTensors (``[B, S, H, D]``, sequence dim 1), registered with
the public ``register_sharding``: DTensor runs the ops on the local shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from ... import ops  # noqa: F401  (the ops must exist to register rules for them)
from .placements import (
    BATCH_DIM,
    OP_SEQ_DIM,
    Sharded,
    check_even_shards,
    cp_mesh_dim,
    mesh_dim_label,
)


# --------------------------------------------------------------------------------------------
# Sharding rules of our ops on DTensors ([B, S, H, D], sequence dim 1).
# --------------------------------------------------------------------------------------------
def _single_dim_strategies(
    placements: Sequence[Placement], outputs: Sequence[str], inputs: Sequence[str]
) -> list[tuple[list, list]]:
    """``register_sharding`` strategies for each kind of placement in ``placements``.

    ``outputs``/``inputs`` hold one code per op return/argument: ``"t"`` a [B, S, H, D]
    tensor, ``"l"`` an lse [B, H, S], ``"r"`` a tensor replicated everywhere (the sinks
    ``[H]``), ``"-"`` a non-tensor argument (or None). Only the kinds present in
    the (validated) inputs are offered, so DTensor's choice is exactly the inputs' placements.
    """

    def one(kind: str) -> tuple[list, list]:
        def place(code: str):
            if code == "-":
                return None
            if kind == "replicate" or code == "r":
                return Replicate()
            if kind == "batch":
                return Shard(BATCH_DIM)
            return Shard(OP_SEQ_DIM if code == "t" else 2)

        return [place(c) for c in outputs], [place(c) for c in inputs]

    kinds = []
    for p in placements:
        kind = (
            "replicate"
            if isinstance(p, Replicate)
            else "seq"
            if p.dim % 4 == OP_SEQ_DIM
            else "batch"
        )
        if kind not in kinds:
            kinds.append(kind)
    return [one(kind) for kind in kinds]


def _check_op_group(q, k, v, group_name: str, layout: str) -> int:
    named = (("q", q), ("k", k), ("v", v))
    xs = [Sharded(n, s.mesh, tuple(s.placements), len(s.shape)) for n, s in named]
    cp_dim, batch_ways = cp_mesh_dim(xs, seq_dim=OP_SEQ_DIM, layout_names="[B, S, H, D]")
    check_even_shards(
        [(n, s.shape) for n, s in named],
        seq_dim=OP_SEQ_DIM,
        layout=layout,
        world=q.mesh.size(cp_dim),
        batch_ways=batch_ways,
    )
    expected = q.mesh.get_group(cp_dim).group_name
    if group_name != expected:
        raise ValueError(
            f"group_name={group_name!r} is not the process group of the context-parallel "
            f"{mesh_dim_label(q.mesh, cp_dim)} ({expected!r}) along which q/k/v are sharded"
        )
    return cp_dim


@register_sharding(
    [
        torch.ops.dtensor_ring.ring_attention.default,
        torch.ops.dtensor_ring.ulysses_attention.default,
    ]
)
def _ring_attention_sharding(
    q,
    k,
    v,
    group_name,
    layout,
    causal,
    scale,
    backend=None,
    window_left=-1,
    window_right=-1,
    sinks=None,
):
    _check_op_group(q, k, v, group_name, layout)
    return _single_dim_strategies(
        q.placements, "tl", "ttt-------" + ("-" if sinks is None else "r")
    )


@register_sharding(
    [
        torch.ops.dtensor_ring.ring_attention_backward.default,
        torch.ops.dtensor_ring.ulysses_attention_backward.default,
    ]
)
def _ring_attention_backward_sharding(
    dout,
    q,
    k,
    v,
    out,
    lse,
    group_name,
    layout,
    causal,
    scale,
    backend=None,
    window_left=-1,
    window_right=-1,
):
    _check_op_group(q, k, v, group_name, layout)
    # dout may arrive placed otherwise (e.g. Partial): DTensor redistributes it to match.
    return _single_dim_strategies(q.placements, "ttt", "tttttl-------")
