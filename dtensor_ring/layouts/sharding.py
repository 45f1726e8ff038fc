"""Sharding helpers for fixed-length sequences: a rank's tokens, its shard, and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Layout
from .builtin import TokenLayout
from .registry import LayoutName, get_layout


def token_indices(layout: LayoutName | Layout, seq_len: int, rank: int, world_size: int) -> Tensor:
    """Global indices (int64, ``[seq_len // world_size]``) of the tokens ``rank`` holds, in order.

    Use it to build global position ids for RoPE. Raises ``ValueError`` if ``seq_len`` does not
    divide as the layout needs.
    """
    return get_layout(layout, "dense").token_indices(seq_len, rank, world_size)


def shard_local(
    full: Tensor, layout: LayoutName | Layout, rank: int, world_size: int, seq_dim: int = 1
) -> Tensor:
    """The part of ``full`` that ``rank`` holds under ``layout`` (a copy; no communication).

    Args:
        full: any tensor whose dim ``seq_dim`` is the whole sequence (length S).
        layout: "ring", "zigzag" or "stripe" (see Note [Sequence layouts]).
        rank, world_size: position in, and size of, the context-parallel group.
        seq_dim: the sequence dimension (1 for ``[B, S, H, D]``, 2 for ``[B, H, S, D]``).

    Returns:
        ``full`` with dim ``seq_dim`` reduced to the rank's ``S // world_size`` tokens.
    """
    idx = token_indices(layout, full.shape[seq_dim], rank, world_size).to(full.device)
    return full.index_select(seq_dim, idx)


def restore_order(
    concatenated: Tensor, layout: LayoutName | Layout, world_size: int, seq_dim: int
) -> Tensor:
    """Token order from the rank-order concatenation of every rank's shard along ``seq_dim``."""
    lay = get_layout(layout, "dense")
    if lay.identity_order:
        return concatenated
    _, inverse = lay.order(concatenated.shape[seq_dim], world_size)
    return concatenated.index_select(seq_dim, inverse.to(concatenated.device))


def unshard_local(parts: Sequence[Tensor], layout: LayoutName | Layout, seq_dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_local`: every rank's part, in rank order -> the full tensor."""
    return restore_order(torch.cat(list(parts), dim=seq_dim), layout, len(parts), seq_dim)


def gather_sequence(
    local: Tensor,
    layout: LayoutName | Layout,
    seq_dim: int = 1,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """All-gather every rank's ``local`` part and return the full tensor in global token order.

    A collective: every rank of ``group`` must call it. Not differentiable.
    """
    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard_local(parts, layout, seq_dim)


def balancer_layout(load_balancer: object, seq_len: int, world_size: int) -> str | Layout:
    """The layout of the shards a load balancer makes for ``seq_len`` tokens on
    ``world_size`` ranks: None -> "ring"; a layout name -> itself; an object with PyTorch's
    ``_generate_indices()`` (its ``_LoadBalancer`` protocol) -> by the rank-order permutation
    it gives: identity "ring", head-tail "zigzag", any other (PyTorch's PTRR and per-document
    balancers) a :class:`~dtensor_ring.layouts.builtin.TokenLayout` holding it.

    Raises:
        ValueError: a permutation that differs between batch rows (per-document balancing of a
            batch: no one layout), or a length the layout cannot split.
        TypeError: anything else.
    """
    if load_balancer is None:
        return "ring"
    if isinstance(load_balancer, str):
        get_layout(load_balancer, "dense").check_length(seq_len, world_size)
        return load_balancer
    indices = getattr(load_balancer, "_generate_indices", None)
    if indices is None:
        raise TypeError(
            f"load_balancer must be None, a layout name or a load balancer with "
            f"_generate_indices(), got {type(load_balancer).__name__}"
        )
    order = indices()
    if order is None:
        return "ring"
    order = torch.as_tensor(order).cpu()
    if order.ndim == 2 and all(torch.equal(row, order[0]) for row in order):
        order = order[0]
    if order.shape != (seq_len,) or seq_len % world_size:
        raise ValueError(
            f"load_balancer {type(load_balancer).__name__} gives a permutation of shape "
            f"{tuple(order.shape)}; one order of {seq_len} tokens for every batch row, "
            f"divisible by {world_size} ranks, is what a layout can hold (per-document "
            "balancing of rows with different documents is not one layout)"
        )
    for name in ("ring", "zigzag"):
        layout = get_layout(name, "dense")
        if seq_len % layout.divisor(world_size) == 0:
            if torch.equal(order, layout.order(seq_len, world_size)[0]):
                return name
    return TokenLayout(order.view(world_size, seq_len // world_size), prefix="balancer")
