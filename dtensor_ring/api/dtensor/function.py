"""``scaled_dot_product_ring_attention``: ring (or Ulysses) attention on DTensors with SDPA's
signature, without a scope or private API (Note [How SDPA on DTensors reaches ring attention])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from ...algorithm import Algorithm, Route, route
from ...layouts import LayoutName
from ...ops.ring import ring_attention, ring_attention_backward
from ...ops.ulysses import ulysses_attention, ulysses_attention_backward
from ...resolve import AttentionSpec, Call, Door, placement, resolve_call
from .gather import gather_sdpa
from .placements import check_sdpa_args, sdpa_algorithm, swap_seq_heads, to_op_layout

Mode = Literal["ring", "ulysses"]  # the older spelling of algorithm= on the SDPA doors
# algorithm -> (forward op, backward op); the pairs share schemas (Note [Ulysses in the DTensor
# path]); the all-gather runs on the local shards (Note [All-gather layouts on DTensors])
ALGORITHM_OPS = {
    "ring": (ring_attention, ring_attention_backward),
    "ulysses": (ulysses_attention, ulysses_attention_backward),
}


@dataclass(frozen=True)
class SDPAConfig:
    """The options of a ``ring_sdpa`` scope (or of one scope-free call); ``algorithm`` None:
    the layout alias's, else "ring" (Note [Layouts and algorithms])."""

    layout: str
    backend: str | None
    algorithm: str | None = None
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
    mode: Mode | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Tensor | None = None,
    algorithm: Algorithm | None = None,
) -> DTensor:
    """Ring attention with ``F.scaled_dot_product_attention``'s signature, on DTensors.

    Computes what SDPA computes inside :func:`ring_sdpa`, without a scope or private API: it
    calls ``dtensor_ring::ring_attention`` (or the Ulysses op) on the DTensors (sharding rule
    registered with ``register_sharding``); the all-gather calls
    ``dtensor_ring::llama3_attention`` on the local shards instead (Note [All-gather layouts
    on DTensors]). Works in eager and compiled code (also inside a ``torch.compile``'d
    function), with activation checkpointing.

    Args:
        query: ``[B, H, S, D]``; key, value: ``[B, H_kv, S, D]`` (``H_kv < H`` needs
            ``enable_gqa=True``). DTensors on one mesh, placed ``Shard(2)`` (sequence) on one
            mesh dim (the context-parallel dim, holding tokens as ``layout`` says) and
            ``Replicate()`` or ``Shard(0)`` on the others; S divisible by the layout's divisor.
        attn_mask: must be None.  dropout_p: must be 0.0.
        is_causal: causal mask over the original (unpermuted) sequence; the ring algorithm
            needs it for zigzag and stripe.
        scale: softmax scale, default ``D ** -0.5``.
        layout: how the sequence is sharded (Note [Sequence layouts]): "ring", "zigzag",
            "stripe", or the aliases "llama3_zigzag" (zigzag + all-gather) and "auto" (zigzag
            + the algorithm chosen per call).
        backend: block-kernel backend name, or None for automatic choice.
        mode: the older spelling of ``algorithm``: "ring" or "ulysses".
        window_size: flash-attn sliding window ``(left, right)`` over global positions (query
            p sees keys ``[p - left, p + right]``, -1 unbounded, ``is_causal`` sets
            ``right = 0``); docs/window.md.
        sinks: per-head attention-sink logits ``[H]`` (Note [Attention sinks]), or None: a
            plain tensor (the same on every rank; its gradient on each rank is this rank's
            rows' share, as in the functional API) or a DTensor replicated on the mesh (its
            gradient is a ``Partial`` DTensor: the sum over ranks is the whole gradient).
        algorithm: how K/V move (Note [Layouts and algorithms]): "ring", "all_gather",
            "ulysses" (needs ``H`` divisible by the context-parallel size; any layout, causal
            or not: Note [Ulysses in the DTensor path]) or "auto"; None: the layout alias's,
            else "ring".

    Returns:
        ``[B, H, S, D]`` DTensor with ``query``'s placements.

    Raises:
        ValueError: on unsupported placements or arguments, on every rank, before any
            communication.
    """
    algorithm = sdpa_algorithm(mode, algorithm)
    cp_dim, group_name = check_sdpa_args(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, layout, algorithm
    )
    world = query.device_mesh.size(cp_dim)
    config = SDPAConfig(layout, backend, algorithm, window_size)

    def local() -> tuple[Tensor, Tensor, Tensor]:
        return to_op_layout(query.to_local(), key.to_local(), value.to_local())

    r = sdpa_route(config, local, is_causal, group_name, world)
    if r.algorithm == "all_gather":  # Note [All-gather layouts on DTensors]
        return gather_sdpa(config, r, query, key, value, is_causal, scale, cp_dim, sinks)
    q, k, v = to_op_layout(query, key, value)
    spec = resolve_sdpa(
        config, r, q, k, v, is_causal, scale, group_name, world, global_len=q.shape[1],
        sinks=sinks,
    )  # fmt: skip
    out, _ = ALGORITHM_OPS[r.algorithm][0](q, k, v, *spec.op_args(), replicated(sinks, query))
    return swap_seq_heads(out)


def sdpa_route(
    config: SDPAConfig,
    local: Callable[[], tuple[Tensor, Tensor, Tensor]],
    is_causal: bool,
    group_name: str,
    world_size: int,
) -> Route:
    """:func:`~dtensor_ring.algorithm.route` of an SDPA call of ``config``; ``local()``: the
    local shards ``[B, S_local, H(_kv), D]``, taken only where "auto" prices the call (they
    cost host time). The forward and backward (an SDPA handler runs below autograd) route
    alike: the choice prices both, whatever this rank's grad mode."""
    choosing = placement(config.layout, config.algorithm)[1] == "auto"
    q, k, v = local() if choosing else (None, None, None)
    call = Call(
        q, k, v, group_name, world_size, config.layout, is_causal,
        window_size=config.window_size, backend=config.backend,
    )  # fmt: skip
    return route(call, config.algorithm, door="sdpa")


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
    r: Route,
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
    """The call resolution of an SDPA call in op layout ``[B, S, H, D]`` routed ``r`` (ring or
    Ulysses; Note [Call resolution]); Ulysses runs the kernel on ``H / W`` query heads."""
    ulysses = r.algorithm == "ulysses"
    return resolve_call(
        Call(
            q,
            k,
            v,
            group_name=group_name,
            world_size=world_size,
            layout=r.layout,
            causal=is_causal,
            softmax_scale=scale,
            window_size=config.window_size,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            backend=config.backend,
            sinks=sinks,
        ),
        Door(
            op=f"sdpa[{r.algorithm}]",
            algorithm=r.algorithm,
            ring_func="ring_sdpa(layout='ring')",
            head_split=world_size if ulysses else 1,
            global_len=global_len,
        ),
    )
