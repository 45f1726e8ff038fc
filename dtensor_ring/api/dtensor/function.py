"""``scaled_dot_product_ring_attention``: ring (or Ulysses) attention on DTensors with SDPA's
signature, without a scope or private API (Note [How SDPA on DTensors reaches ring attention])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from ...layouts import LayoutName, get_layout
from ...ops.ring import ring_attention, ring_attention_backward
from ...ops.ulysses import ulysses_attention, ulysses_attention_backward
from ...resolve import AttentionSpec, resolve_algorithm, resolve_call
from .gather import gather_sdpa, is_gather
from .placements import check_sdpa_args, swap_seq_heads, to_op_layout

Mode = Literal["ring", "ulysses"]
# mode -> (forward op, backward op); the pairs share schemas (Note [Ulysses in the DTensor path])
MODE_OPS = {
    "ring": (ring_attention, ring_attention_backward),
    "ulysses": (ulysses_attention, ulysses_attention_backward),
}


@dataclass(frozen=True)
class SDPAConfig:
    """The options of a ``ring_sdpa`` scope (or of one scope-free call)."""

    layout: str
    backend: str | None
    mode: str = "ring"
    window_size: tuple[int, int] = (-1, -1)


# --------------------------------------------------------------------------------------------
# The DTensor path of SDPA.
# --------------------------------------------------------------------------------------------
def scaled_dot_product_ring_attention(
    query: DTensor,
    key: DTensor,
    value: DTensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: LayoutName = "ring",
    backend: str | None = None,
    mode: Mode = "ring",
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
) -> DTensor:
    """Ring attention with ``F.scaled_dot_product_attention``'s signature, on DTensors.

    Computes what SDPA computes inside :func:`ring_sdpa`, without a scope or private API: it
    calls ``dtensor_ring::ring_attention`` on the DTensors (sharding rule registered with
    ``register_sharding``); an all-gather layout ("llama3_zigzag") calls
    ``dtensor_ring::llama3_attention`` on the local shards instead (Note [All-gather layouts
    on DTensors]). Works in eager and compiled code (also inside a ``torch.compile``'d
    function), with activation checkpointing.

    Args:
        query: ``[B, H, S, D]``; key, value: ``[B, H_kv, S, D]`` (``H_kv < H`` needs
            ``enable_gqa=True``). DTensors on one mesh, placed ``Shard(2)`` (sequence) on one
            mesh dim (the context-parallel dim, holding tokens as ``layout`` says) and
            ``Replicate()`` or ``Shard(0)`` on the others; S divisible by the layout's divisor.
        attn_mask: must be None.  dropout_p: must be 0.0.
        is_causal: causal mask over the original (unpermuted) sequence; required for zigzag
            and stripe (not for llama3_zigzag).
        scale: softmax scale, default ``D ** -0.5``.
        layout: how the sequence is sharded (Note [Sequence layouts]): "ring", "zigzag",
            "stripe", "llama3_zigzag" (zigzag's tokens, K/V all-gathered; with
            ``mode="ulysses"``, zigzag's order), or "auto" (zigzag's tokens; ring, all-gather
            or Ulysses chosen per call: Note [Choosing ring, all-gather or Ulysses]).
        backend: block-kernel backend name, or None for automatic choice.
        mode: "ring" (ring attention) or "ulysses" (Ulysses all-to-all attention,
            ``dtensor_ring::ulysses_attention``; needs ``H`` divisible by the context-parallel
            size, takes every layout causal or not). Note [Ulysses in the DTensor path].
        window_size: flash-attn sliding window ``(left, right)`` over global positions (query
            p sees keys ``[p - left, p + right]``, -1 unbounded, ``is_causal`` sets
            ``right = 0``); docs/window.md.
        sinks: per-head attention-sink logits ``[H]`` (Note [Attention sinks]), or None: a
            plain tensor (the same on every rank; its gradient on each rank is this rank's
            rows' share, as in the functional API) or a DTensor replicated on the mesh (its
            gradient is a ``Partial`` DTensor: the sum over ranks is the whole gradient).

    Returns:
        ``[B, H, S, D]`` DTensor with ``query``'s placements.

    Raises:
        ValueError: on unsupported placements or arguments, on every rank, before any
            communication.
    """
    cp_dim, group_name = check_sdpa_args(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, layout, mode
    )
    world = query.device_mesh.size(cp_dim)
    config = SDPAConfig(layout, backend, mode, window_size)
    if get_layout(layout).chooses:
        local = to_op_layout(query.to_local(), key.to_local(), value.to_local())
        config = chosen_config(config, *local, is_causal, group_name, world)
    if is_gather(config):  # Note [All-gather layouts on DTensors]
        return gather_sdpa(config, query, key, value, is_causal, scale, cp_dim, sinks)
    q, k, v = to_op_layout(query, key, value)
    spec = resolve_sdpa(
        config, q, k, v, is_causal, scale, group_name, world, global_len=q.shape[1], sinks=sinks
    )
    out, _ = MODE_OPS[config.mode][0](q, k, v, *spec.op_args(), replicated(sinks, query))
    return swap_seq_heads(out)


def chosen_config(
    config: SDPAConfig,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    group_name: str,
    world_size: int,
    backward: bool | None = None,
) -> SDPAConfig:
    """For ``config`` of a choosing layout ("auto"), the configuration of the algorithm the
    cost model picks for this call (Note [Choosing ring, all-gather or Ulysses]): the ring
    ("zigzag" or the maskless "ring"), the all-gather ("llama3_zigzag") or ``mode="ulysses"``
    over zigzag's tokens. ``q, k, v``: the local shards ``[B, S_local, H(_kv), D]``;
    ``backward``: whether a backward is counted (None: whether ``q, k, v`` need gradients).
    Forward and backward may choose differently (an SDPA handler runs below autograd): every
    algorithm's backward is exact given the global ``out`` and ``lse``. Callers call it only
    for a choosing layout (the local shards and ``backward`` cost host time)."""
    if config.mode == "ulysses":  # Ulysses asked for: zigzag's tokens
        return dataclasses.replace(config, layout="zigzag")
    choice = resolve_algorithm(
        q,
        k,
        v,
        causal=is_causal,
        window_size=config.window_size,
        group_name=group_name,
        world_size=world_size,
        op="sdpa[auto]",
        layout=config.layout,
        backend=config.backend,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        backward=backward,
    )
    mode = "ulysses" if choice.algorithm == "ulysses" else "ring"
    return dataclasses.replace(config, layout=choice.layout, mode=mode)


def replicated(sinks: Tensor | None, like: DTensor) -> DTensor | None:
    """``sinks`` as a DTensor replicated on ``like``'s mesh; a plain tensor's gradient stays
    this rank's share (``grad_placements`` Partial: ``from_local``'s backward returns the local
    part of the op's Partial gradient)."""
    if sinks is None or isinstance(sinks, DTensor):
        return sinks
    mesh = like.device_mesh
    return DTensor.from_local(
        sinks,
        mesh,
        [Replicate()] * mesh.ndim,
        run_check=False,
        grad_placements=[Partial()] * mesh.ndim,
    )


def resolve_sdpa(
    config: SDPAConfig,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float | None,
    group_name: str,
    world_size: int,
    global_len: int | None = None,
    sinks: Tensor | None = None,
) -> AttentionSpec:
    """The call resolution of an SDPA call in op layout ``[B, S, H, D]`` (Note [Call
    resolution]); Ulysses runs the kernel on ``H / W`` query heads."""
    ulysses = config.mode == "ulysses"
    return resolve_call(
        q,
        k,
        v,
        op=f"sdpa[{config.mode}]",
        layout=config.layout,
        causal=is_causal,
        softmax_scale=scale,
        window_size=config.window_size,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        backend=config.backend,
        group_name=group_name,
        world_size=world_size,
        ring_func=None if ulysses else "ring_sdpa(layout='ring')",
        head_split=world_size if ulysses else 1,
        global_len=global_len,
        sinks=sinks,
    )
