"""DTensor front door: ``F.scaled_dot_product_attention`` on sequence-sharded DTensors.

Public names: :func:`ring_sdpa` (the scope), :func:`scaled_dot_product_ring_attention` (the
function SDPA calls become), :func:`shard_sequence` / :func:`unshard_sequence`.

Shape legend: B batch, H query heads, H_kv key/value heads, S sequence, D head dim. SDPA's
layout is ``[B, H, S, D]`` (sequence dim 2); the op's is ``[B, S, H, D]`` (sequence dim 1).
:func:`_swap_seq_heads` is the only conversion between them (a transpose view).

Note [DTensor global view of a permuted layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DTensor has no notion of token order: a DTensor sharded ``Shard(seq_dim)`` over the W ranks of
the context-parallel mesh dim means "the global tensor is the concatenation of the rank shards
in rank order". With the ring layout that *is* the sequence. With zigzag or stripe
(Note [Sequence layouts] in ``layouts/base.py``) each rank holds a permuted selection of tokens, so
the DTensor's global view is the **permuted** sequence, e.g. S = 8, W = 2, zigzag:

    original order          0 1 2 3 4 5 6 7
    rank 0 holds            0 1 | 6 7
    rank 1 holds            2 3 | 4 5
    DTensor global view     0 1 6 7 2 3 4 5     (what full_tensor() / redistribute() return)

Consequences:

* Elementwise and per-token ops (linear layers, norms, activations, RoPE with the right
  position ids, token-level losses and their mean) are unaffected: they commute with any
  permutation of tokens. So is ring attention, which is told the layout.
* Ops that mix positions (cumsum, convolutions or shifts along the sequence, slicing a window
  of positions, ``full_tensor()`` compared with an unpermuted tensor) see the permuted order.
  Build position ids with :func:`dtensor_ring.token_indices` (or shard them with
  :func:`shard_sequence` like the inputs) and shift labels *before* sharding.
* Only :func:`unshard_sequence` (or :func:`dtensor_ring.gather_sequence` on plain local
  tensors) restores the original order.

:func:`shard_sequence` builds such DTensors for inputs, labels and position ids alike.

Note [How SDPA on DTensors reaches ring attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``F.scaled_dot_product_attention`` is a composite: it picks a fused kernel from the inputs'
(global) metadata and calls that aten op (``_scaled_dot_product_flash_attention_for_cpu``,
``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``),
whose autograd formula later calls the matching ``..._backward`` op. On DTensors both reach
DTensor's dispatcher, which offers a table of custom op handlers (private; walled off in
``_compat/dtensor.py``). ``with ring_sdpa(layout=...)`` installs, and removes on exit:

1. Handlers for all four SDPA op families, forward and backward (:data:`ATEN_SDPA_OPS`, one
   row per family; arguments are bound by schema name, so one forward and one backward
   handler serve every row). The forward handler validates placements, transposes the local
   shards to ``[B, S, H, D]`` and calls ``dtensor_ring::ring_attention`` on them; it returns
   ``(out, lse)`` as DTensors (plus whatever else the op's schema returns); the backward
   handler gets them back from autograd and calls ``dtensor_ring::ring_attention_backward``.

2. A ``TorchFunctionMode`` (public API) that sees the SDPA call *before* kernel choice. It
   raises a clear ``ValueError`` for what ring attention does not do (attn_mask, dropout,
   bad placements), and runs SDPA under ``sdpa_kernel`` restricted to the enabled fused
   backends: never the math fallback, which would decompose into sharded matmuls that never
   reach a handler. Being a mode, it is on the stack Dynamo guards: a function compiled
   outside the scope is recompiled inside it, and the other way round. (The handler table
   alone is invisible to Dynamo's guards.)

Why the handlers do the work rather than the mode calling our op directly: the same path must
run however the call arrives. Activation checkpointing recomputes the forward inside
``backward()``, which a mode does not see (a mode is switched off while it handles
``Tensor.backward``), and Dynamo traces checkpointed regions (higher-order ops) without the
ambient mode; both then reach the aten ops, so routing everything through them keeps the saved
tensors of forward and recompute identical. (The handler table is also process-wide, while
modes are thread-local: CUDA backward runs on autograd's device threads.) It follows that the
scope must be entered outside ``torch.compile``'d code (the handlers act while AOTAutograd
traces, after Dynamo); entering it inside raises ``RuntimeError``.

:func:`scaled_dot_product_ring_attention` is the scope-free alternative: it calls our op on the
DTensors directly (its sharding rule is registered with ``register_sharding``, public), works
in eager and compiled code alike, and needs no private API.

Outside the scope nothing of this is active: SDPA on DTensors behaves as PyTorch makes it.
The sharding rules of our own ops stay registered (they concern only ``dtensor_ring::`` ops).

Note [Ulysses in the DTensor path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ring_sdpa(..., mode="ulysses")`` and ``scaled_dot_product_ring_attention(..., mode=
"ulysses")`` run Ulysses attention (Note [Ulysses attention] in ``ops/ulysses.py``) instead of ring
attention. Everything above stays as it is; only the op pair changes (:data:`_MODE_OPS`):
``dtensor_ring::ulysses_attention`` / ``_backward`` have the schemas of ``ring_attention`` /
``_backward`` (sequence shards in and out, lse ``[B, H, S_local]``), so the handlers, the
sharding rules and the autograd formula are shared. The SDPA handlers get the forward and, later,
a separate backward call with only sequence-sharded tensors, so the backward op redoes the
all-to-alls of q, k, v (and brings dout, out and lse to head shards) rather than keeping
head-sharded tensors between the calls: one more all-to-all of q, k, v per backward than
:func:`dtensor_ring.ulysses_flash_attn_func`, and nothing stateful, so activation
checkpointing's recompute and compiled graphs see the same ops. Ulysses takes every layout,
causal or not; ``H`` must be divisible by the context-parallel size (checked on global
metadata, on every rank, before communication).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from .._compat import aten_op, require_aten_op
from .._compat import dtensor as _dtensor_compat
from ..layouts import LayoutName, get_layout, shard_local
from ..layouts.sharding import restore_order
from ..ops.ring import ring_attention, ring_attention_backward
from ..ops.ulysses import ulysses_attention, ulysses_attention_backward
from ..resolve import AttentionSpec, check_heads, check_window_size, resolve_call

__all__ = [
    "ATEN_SDPA_OPS",
    "ring_sdpa",
    "scaled_dot_product_ring_attention",
    "shard_sequence",
    "unshard_sequence",
]

Mode = Literal["ring", "ulysses"]
# mode -> (forward op, backward op); the pairs share schemas (Note [Ulysses in the DTensor path])
_MODE_OPS = {
    "ring": (ring_attention, ring_attention_backward),
    "ulysses": (ulysses_attention, ulysses_attention_backward),
}

SDPA_SEQ_DIM = 2  # [B, H, S, D]
OP_SEQ_DIM = 1  # [B, S, H, D]
BATCH_DIM = 0


def _swap_seq_heads(t: Tensor) -> Tensor:
    """``[B, H, S, D] <-> [B, S, H, D]`` (a transpose view; its own inverse).

    The one place where SDPA's layout meets the op's; DTensors map ``Shard(2) <-> Shard(1)``.
    """
    return t.transpose(1, 2)


def _check_mode(mode: str) -> None:
    if mode not in _MODE_OPS:
        raise ValueError(f"mode={mode!r}; choose one of {tuple(_MODE_OPS)}")


def _to_op_layout(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SDPA's ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` -> the op's ``[B, S, H, D]`` views."""
    return _swap_seq_heads(query), _swap_seq_heads(key), _swap_seq_heads(value)


# --------------------------------------------------------------------------------------------
# Validation (global metadata only: identical on every rank, so errors raise everywhere,
# before any communication).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sharded:
    """What the checks need of a DTensor or a DTensorSpec."""

    name: str
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    ndim: int


def _mesh_dim_label(mesh: DeviceMesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return f"mesh dim {i}" + (f" ({names[i]!r})" if names else "")


def _cp_mesh_dim(xs: Sequence[_Sharded], *, seq_dim: int, layout_names: str) -> tuple[int, int]:
    """Check the placements of q/k/v-like tensors for ring attention.

    Accepted: one mesh; identical placements; ``Shard(seq_dim)`` on exactly one mesh dim (the
    context-parallel dim); ``Replicate()`` or ``Shard(0)`` (batch) on the others. Sizes are
    checked by :func:`_check_even_shards` (apart, as they may be symbolic under compile).

    Returns:
        ``(cp_dim, batch_ways)``: the context-parallel mesh dim, and over how many ranks the
        batch is sharded.
    """
    first = xs[0]
    for x in xs:
        if x.ndim != 4:
            raise ValueError(f"{x.name} must be a 4-D {layout_names} DTensor, got {x.ndim}-D")
    for x in xs[1:]:
        if x.mesh is not first.mesh and x.mesh != first.mesh:
            raise ValueError(
                f"{first.name} and {x.name} are on different device meshes ({first.mesh} vs "
                f"{x.mesh}); ring attention needs q, k and v on one mesh"
            )
        if x.placements != first.placements:
            raise ValueError(
                f"{first.name} and {x.name} have different placements ({first.placements} vs "
                f"{x.placements}); shard q, k and v the same way (e.g. with shard_sequence)"
            )
    mesh, cp_dim = first.mesh, None
    batch_ways = 1
    for i, p in enumerate(first.placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"{first.name} has placement {p!r} on {_mesh_dim_label(mesh, i)}: ring attention "
                "needs the values, not partial sums; redistribute to Replicate() or Shard first"
            )
        # type() check: _StridedShard (a Shard subclass) is not an even split of one dim.
        if type(p) is Shard and p.dim % 4 == seq_dim:
            if cp_dim is not None:
                raise ValueError(
                    f"{first.name} is sharded on the sequence dim {seq_dim} over two mesh dims "
                    f"({cp_dim} and {i}); shard the sequence over one (context-parallel) mesh dim"
                )
            cp_dim = i
        elif type(p) is Shard and p.dim % 4 == BATCH_DIM:
            batch_ways *= mesh.size(i)
        else:
            raise ValueError(
                f"{first.name} has placement {p!r} on {_mesh_dim_label(mesh, i)}; ring attention "
                f"accepts Shard({seq_dim}) (sequence, {layout_names}) on one mesh dim and "
                f"Replicate() or Shard({BATCH_DIM}) (batch) on the others"
            )
    if cp_dim is None:
        raise ValueError(
            f"{first.name} (placements {first.placements}) is not sharded on the sequence dim "
            f"{seq_dim} of {layout_names}; shard it Shard({seq_dim}) over the context-parallel "
            "mesh dim (e.g. with dtensor_ring.shard_sequence)"
        )
    return cp_dim, batch_ways


def _check_even_shards(
    shapes: Sequence[tuple[str, Sequence[int]]],
    *,
    seq_dim: int,
    layout: str,
    world: int,
    batch_ways: int,
) -> None:
    """``(name, shape)`` pairs split evenly: sequence by the layout's divisor, batch by
    ``batch_ways``. Plain comparisons, so symbolic sizes (dynamic shapes) only add guards."""
    divisor = get_layout(layout, "dense").divisor(world)
    for name, shape in shapes:
        S, B = shape[seq_dim], shape[BATCH_DIM]
        if S % divisor != 0:
            raise ValueError(
                f"{name}: sequence length {S} is not divisible by {divisor}, as layout="
                f"{layout!r} needs on {world} ranks (uneven shards); pad the sequence to a "
                f"multiple of {divisor}"
            )
        if B % batch_ways != 0:
            raise ValueError(
                f"{name}: batch {B} is not divisible by the {batch_ways} ranks it is "
                "sharded over (uneven shards)"
            )


def _check_sdpa_args(
    query: DTensor,
    key: DTensor,
    value: DTensor,
    attn_mask: object,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    layout: str,
    mode: str = "ring",
) -> tuple[int, str]:
    """Validate an SDPA call on DTensors ``[B, H, S, D]``.

    Returns:
        ``(cp_dim, group_name)``: the context-parallel mesh dim and its process group's name.
    """

    def describe(t):
        if not isinstance(t, DTensor):
            return type(t).__name__
        return t.device_mesh, tuple(t.placements), t.dim()

    cp_dim, group_name, world, batch_ways = _check_sdpa_metadata(
        tuple(describe(t) for t in (query, key, value)),
        attn_mask is not None,
        float(dropout_p),
        bool(is_causal),
        layout,
        mode,
    )
    _check_sdpa_shapes(
        query.shape, key.shape, value.shape, bool(enable_gqa), layout, mode, world, batch_ways
    )
    return cp_dim, group_name


@torch.compiler.assume_constant_result
def _check_sdpa_metadata(
    metadata: tuple,
    has_mask: bool,
    dropout_p: float,
    is_causal: bool,
    layout: str,
    mode: str = "ring",
) -> tuple[int, str, int, int]:
    """The checks of :func:`_check_sdpa_args` that need no sizes.

    A Dynamo constant: under ``torch.compile`` it runs as plain Python at trace time (its
    result is baked into the graph), so it may use anything (``type()``, process groups) that
    Dynamo versions trace differently or not at all. It takes no sizes: those may be symbolic
    (dynamic shapes), which a constant function cannot take; :func:`_check_sdpa_shapes` checks
    them. ``metadata``: per q, k, v either ``(mesh, placements, ndim)`` or the type name of a
    non-DTensor.

    Returns:
        ``(cp_dim, group_name, world, batch_ways)``.
    """
    get_layout(layout, "dense")
    _check_mode(mode)
    if has_mask:
        raise ValueError(
            "attn_mask is not supported by ring attention (SDPA on sequence-sharded DTensors); "
            "pass attn_mask=None and is_causal=True for a causal mask"
        )
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p} is not supported by ring attention; pass dropout_p=0.0"
        )
    names = ("query", "key", "value")
    for name, meta in zip(names, metadata, strict=True):
        if isinstance(meta, str):
            raise TypeError(
                f"{name} is a {meta}, not a DTensor, while other SDPA inputs are DTensors; "
                "make q, k and v DTensors on one mesh (DTensor.from_local for local shards)"
            )
    if mode == "ring":
        get_layout(layout).check_mask(is_causal, ring_func="ring_sdpa(layout='ring')")
    xs = [_Sharded(n, *meta) for n, meta in zip(names, metadata, strict=True)]
    cp_dim, batch_ways = _cp_mesh_dim(xs, seq_dim=SDPA_SEQ_DIM, layout_names="[B, H, S, D]")
    mesh = xs[0].mesh
    return cp_dim, mesh.get_group(cp_dim).group_name, mesh.size(cp_dim), batch_ways


def _check_sdpa_shapes(
    q_shape, k_shape, v_shape, enable_gqa: bool, layout: str, mode: str, world: int, batch_ways: int
) -> None:
    """The size checks of :func:`_check_sdpa_args` (plain Python: sizes may be symbolic)."""
    _check_even_shards(
        [("query", q_shape), ("key", k_shape), ("value", v_shape)],
        seq_dim=SDPA_SEQ_DIM,
        layout=layout,
        world=world,
        batch_ways=batch_ways,
    )
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    (B, H, S, D), (Bk, H_kv, Sk, Dk) = q_shape, k_shape
    if k_shape != v_shape:
        raise ValueError(f"key and value shapes differ: {k_shape} vs {v_shape}")
    if (B, S, D) != (Bk, Sk, Dk):
        raise ValueError(
            f"query {q_shape} and key/value {k_shape} must agree on batch, sequence length "
            "and head dim (ring attention is self-attention over one sequence)"
        )
    if H != H_kv and not enable_gqa:
        raise ValueError(
            f"query has {H} heads and key/value {H_kv}; pass enable_gqa=True for grouped-query "
            "attention"
        )
    if H % H_kv != 0:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads H_kv={H_kv}")
    if mode == "ulysses":
        check_heads(H, world, "ring_sdpa(mode='ulysses')")


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
) -> DTensor:
    """Ring attention with ``F.scaled_dot_product_attention``'s signature, on DTensors.

    Computes what SDPA computes inside :func:`ring_sdpa`, without a scope or private API: it
    calls ``dtensor_ring::ring_attention`` on the DTensors (sharding rule registered with
    ``register_sharding``). Works in eager and compiled code (also inside a ``torch.compile``'d
    function), with activation checkpointing.

    Args:
        query: ``[B, H, S, D]``; key, value: ``[B, H_kv, S, D]`` (``H_kv < H`` needs
            ``enable_gqa=True``). DTensors on one mesh, placed ``Shard(2)`` (sequence) on one
            mesh dim (the context-parallel dim, holding tokens as ``layout`` says) and
            ``Replicate()`` or ``Shard(0)`` on the others; S divisible by the layout's divisor.
        attn_mask: must be None.  dropout_p: must be 0.0.
        is_causal: causal mask over the original (unpermuted) sequence; required for zigzag
            and stripe.
        scale: softmax scale, default ``D ** -0.5``.
        layout: how the sequence is sharded (Note [Sequence layouts]).
        backend: block-kernel backend name, or None for automatic choice.
        mode: "ring" (ring attention) or "ulysses" (Ulysses all-to-all attention,
            ``dtensor_ring::ulysses_attention``; needs ``H`` divisible by the context-parallel
            size, takes every layout causal or not). Note [Ulysses in the DTensor path].
        window_size: flash-attn sliding window ``(left, right)`` over global positions (query
            p sees keys ``[p - left, p + right]``, -1 unbounded, ``is_causal`` sets
            ``right = 0``); docs/window.md.

    Returns:
        ``[B, H, S, D]`` DTensor with ``query``'s placements.

    Raises:
        ValueError: on unsupported placements or arguments, on every rank, before any
            communication.
    """
    cp_dim, group_name = _check_sdpa_args(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, layout, mode
    )
    q, k, v = _to_op_layout(query, key, value)
    config = _Config(layout, backend, mode, window_size)
    world = query.device_mesh.size(cp_dim)
    spec = _resolve(config, q, k, v, is_causal, scale, group_name, world, global_len=q.shape[1])
    out, _ = _MODE_OPS[mode][0](q, k, v, *spec.op_args())
    return _swap_seq_heads(out)


def _resolve(
    config: _Config,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float | None,
    group_name: str,
    world_size: int,
    global_len: int | None = None,
) -> AttentionSpec:
    """The call resolution of an SDPA call in op layout ``[B, S, H, D]`` (Note [Call
    resolution]); Ulysses runs the kernel on ``H / W`` query heads."""
    ulysses = config.mode == "ulysses"
    return resolve_call(
        q,
        k,
        v,
        layout=config.layout,
        causal=bool(is_causal),
        softmax_scale=scale,
        window_size=config.window_size,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        backend=config.backend,
        group_name=group_name,
        world_size=world_size,
        ring_func=None if ulysses else "ring_sdpa(layout='ring')",
        head_split=world_size if ulysses else 1,
        global_len=global_len,
    )


# --------------------------------------------------------------------------------------------
# Sharding rules of our ops on DTensors ([B, S, H, D], sequence dim 1).
# --------------------------------------------------------------------------------------------
def _single_dim_strategies(
    placements: Sequence[Placement], outputs: Sequence[str], inputs: Sequence[str]
) -> list[tuple[list, list]]:
    """``register_sharding`` strategies for each kind of placement in ``placements``.

    ``outputs``/``inputs`` hold one code per op return/argument: ``"t"`` a [B, S, H, D]
    tensor, ``"l"`` an lse [B, H, S], ``"-"`` a non-tensor argument. Only the kinds present in
    the (validated) inputs are offered, so DTensor's choice is exactly the inputs' placements.
    """

    def one(kind: str) -> tuple[list, list]:
        def place(code: str):
            if code == "-":
                return None
            if kind == "replicate":
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
    xs = [_Sharded(n, s.mesh, tuple(s.placements), len(s.shape)) for n, s in named]
    cp_dim, batch_ways = _cp_mesh_dim(xs, seq_dim=OP_SEQ_DIM, layout_names="[B, S, H, D]")
    _check_even_shards(
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
            f"{_mesh_dim_label(q.mesh, cp_dim)} ({expected!r}) along which q/k/v are sharded"
        )
    return cp_dim


@register_sharding(
    [
        torch.ops.dtensor_ring.ring_attention.default,
        torch.ops.dtensor_ring.ulysses_attention.default,
    ]
)
def _ring_attention_sharding(
    q, k, v, group_name, layout, causal, scale, backend=None, window_left=-1, window_right=-1
):
    _check_op_group(q, k, v, group_name, layout)
    return _single_dim_strategies(q.placements, "tl", "ttt-------")


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


# --------------------------------------------------------------------------------------------
# SDPA aten-op handlers, installed by ring_sdpa in DTensor's (private) handler table.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AtenSDPAOps:
    """One family of fused SDPA aten ops (forward and backward) and its lse shape.

    Arguments are bound by schema name, so every family shares one forward and one backward
    handler: ``query, key, value``, ``attn_mask``/``attn_bias``, ``dropout_p``, ``is_causal``,
    ``scale``; backward also ``grad_out``/``grad_out_``, ``out``, ``logsumexp``. Returns beyond
    ``(output, logsumexp)`` / ``(grad_query, grad_key, grad_value)`` are filled per schema type.
    """

    forward: str
    backward: str
    lse_trailing_one: bool = False  # cuDNN's lse is [B, H, S, 1]

    @property
    def available(self) -> bool:
        """Whether this torch has both ops (resolved lazily, ``_compat.aten_op``)."""
        return aten_op(self.forward) is not None and aten_op(self.backward) is not None

    @property
    def forward_op(self) -> torch._ops.OpOverload:
        return require_aten_op(self.forward).default

    @property
    def backward_op(self) -> torch._ops.OpOverload:
        return require_aten_op(self.backward).default


ATEN_SDPA_OPS: tuple[AtenSDPAOps, ...] = (
    AtenSDPAOps(
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    AtenSDPAOps(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"
    ),
    AtenSDPAOps(
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    ),
    AtenSDPAOps(
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        lse_trailing_one=True,
    ),
)


@dataclass(frozen=True)
class _Config:
    layout: str
    backend: str | None
    mode: str = "ring"
    window_size: tuple[int, int] = (-1, -1)


def _first(bound: dict, *names: str):
    """The value of the first of ``names`` that the op has (None if it has none of them)."""
    for n in names:
        if n in bound:
            return bound[n]
    return None


def _replicated_like(like: DTensor, local: Tensor) -> DTensor:
    return DTensor.from_local(
        local, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False
    )


def _bind_sdpa_call(
    config: _Config, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple[dict, tuple[Tensor, Tensor, Tensor], AttentionSpec]:
    """Bind an SDPA aten op's arguments by name, check them, and resolve the call: the bound
    arguments, the local shards in the op layout ``[B, S, H, D]``, and the spec."""
    a = _dtensor_compat.bind_args(op, args, kwargs)
    query, key, value = a["query"], a["key"], a["value"]
    is_causal = bool(a.get("is_causal", False))
    cp_dim, group_name = _check_sdpa_args(
        query,
        key,
        value,
        _first(a, "attn_mask", "attn_bias"),
        float(a.get("dropout_p", 0.0)),
        is_causal,
        True,
        config.layout,
        config.mode,
    )
    q, k, v = _to_op_layout(query.to_local(), key.to_local(), value.to_local())
    world = query.device_mesh.size(cp_dim)
    spec = _resolve(config, q, k, v, is_causal, a.get("scale"), group_name, world)
    return a, (q, k, v), spec


def aten_sdpa_forward_handler(
    config: _Config, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple:
    """DTensor handler of a fused SDPA forward op (any row of :data:`ATEN_SDPA_OPS`)."""
    family = _family_of()[op]
    a, (q, k, v), spec = _bind_sdpa_call(config, op, args, kwargs)
    query, mesh = a["query"], a["query"].device_mesh
    out, lse = _MODE_OPS[config.mode][0](q, k, v, *spec.op_args())
    if family.lse_trailing_one:
        lse = lse.unsqueeze(-1)
    out_dt = DTensor.from_local(_swap_seq_heads(out), mesh, query.placements, run_check=False)
    lse_dt = DTensor.from_local(lse, mesh, query.placements, run_check=False)  # [B, H, S(, 1)]
    results: list[object] = [out_dt, lse_dt]
    S_local = q.shape[1]
    for name in _dtensor_compat.return_names(op)[2:]:
        if name.startswith("max_"):  # SymInt max_q / max_k
            results.append(S_local)
        elif name.startswith("cum_seq"):  # undefined for dense inputs, as natively
            results.append(None)
        else:  # philox seed/offset, rng_state, unused, debug mask: ignored by our backward
            results.append(_replicated_like(query, q.new_empty(0, dtype=torch.int64)))
    return tuple(results)


def aten_sdpa_backward_handler(
    config: _Config, op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple:
    """DTensor handler of a fused SDPA backward op (any row of :data:`ATEN_SDPA_OPS`)."""
    family = _family_of()[op]
    a, (q, k, v), spec = _bind_sdpa_call(config, op, args, kwargs)
    mesh, placements = a["query"].device_mesh, a["query"].placements
    dout, out, lse = _first(a, "grad_out", "grad_out_"), a["out"], a["logsumexp"]
    dout, out, lse = (
        t if t.placements == placements else t.redistribute(mesh, placements)
        for t in (dout, out, lse)
    )
    dout_l, out_l = _swap_seq_heads(dout.to_local()), _swap_seq_heads(out.to_local())
    lse_l = lse.to_local()
    if family.lse_trailing_one:
        lse_l = lse_l.squeeze(-1)
    lse_l = lse_l[..., : q.shape[1]]  # efficient attention pads lse to a multiple of 32
    dq, dk, dv = _MODE_OPS[config.mode][1](
        dout_l.contiguous(),
        q,
        k,
        v,
        out_l,
        lse_l.contiguous(),
        *spec.op_args(),
    )
    grads = [
        DTensor.from_local(_swap_seq_heads(g), mesh, placements, run_check=False)
        for g in (dq, dk, dv)
    ]
    # efficient attention also returns grad_bias: None, as attn_bias is None
    return tuple(grads + [None] * (len(_dtensor_compat.return_names(op)) - 3))


@functools.cache
def _family_of() -> dict[torch._ops.OpOverload, AtenSDPAOps]:
    """``{op: family}`` of the families this torch has (built on first use, not at import)."""
    return {
        op: family
        for family in ATEN_SDPA_OPS
        if family.available
        for op in (family.forward_op, family.backward_op)
    }


def _aten_handlers(config: _Config) -> dict:
    """Handlers for the families this torch has; a family whose ops it lacks is left to SDPA."""
    handlers = {}
    for family in ATEN_SDPA_OPS:
        if not family.available:
            continue
        handlers[family.forward_op] = functools.partial(aten_sdpa_forward_handler, config)
        handlers[family.backward_op] = functools.partial(aten_sdpa_backward_handler, config)
    return handlers


# --------------------------------------------------------------------------------------------
# The scope.
# --------------------------------------------------------------------------------------------
@torch.compiler.assume_constant_result  # the getters are not traceable; read at trace time
def _enabled_fused_backends() -> tuple[SDPBackend, ...]:
    """The fused SDPA backends enabled now (FLASH_ATTENTION covers the CPU flash kernel).

    Keeping the user's choice (e.g. ``sdpa_kernel(CUDNN_ATTENTION)``) matters: a recompute
    under activation checkpointing runs without our mode, so it must pick the same aten op.
    """
    flags = (
        (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()),
    )
    return tuple(backend for backend, enabled in flags if enabled)


_SDPA_FUNCS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


class _RingSDPAMode(TorchFunctionMode):
    """Checks SDPA calls on DTensors and keeps them on a fused kernel (see the Note above)."""

    def __init__(self, config: _Config):
        super().__init__()
        self.config = config

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA_FUNCS and _check_dtensor_sdpa_call(self.config, *args, **kwargs):
            # Never SDPA's math fallback (which would decompose into sharded matmuls): a
            # fused op (among those enabled), caught by our handler, or SDPA's own "no kernel
            # available" error.
            with sdpa_kernel(list(_enabled_fused_backends())):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _check_dtensor_sdpa_call(
    config,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
) -> bool:
    """False for SDPA on plain tensors; True for a valid call on DTensors; else raises."""
    if not any(isinstance(t, DTensor) for t in (query, key, value)):
        return False
    _check_sdpa_args(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, config.layout, config.mode
    )
    return True


@contextlib.contextmanager
def ring_sdpa(
    layout: LayoutName = "zigzag",
    backend: str | None = None,
    mode: Mode = "ring",
    window_size: tuple[int, int] = (-1, -1),
) -> Iterator[None]:
    """Scope in which SDPA on sequence-sharded DTensors runs ring attention.

    Inside it, ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...,
    enable_gqa=...)`` with DTensor ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` placed
    ``Shard(2)`` over one mesh dim (``Replicate()``/``Shard(0)`` on the others) returns
    ring attention as a ``[B, H, S, D]`` DTensor with the same placements, differentiable.
    See :func:`scaled_dot_product_ring_attention` for the accepted arguments and
    Note [How SDPA on DTensors reaches ring attention] for the mechanism. SDPA on plain
    tensors is left alone.

    Enter it around the whole training step, forward *and* backward (activation checkpointing
    recomputes attention during backward), outside ``torch.compile``'d functions. Everything
    installed is removed on exit, also on an exception. Scopes nest (the innermost wins).

    Args:
        layout: "ring", "zigzag" or "stripe": how the DTensors' sequence shards are laid out
            (Note [Sequence layouts]); zigzag and stripe need ``is_causal=True`` (except
            with ``mode="ulysses"``).
        backend: block-kernel backend name, or None for automatic choice.
        mode: "ring" (ring attention) or "ulysses" (all-to-all attention; needs ``H``
            divisible by the context-parallel size, else ``ValueError`` on every rank before
            any communication). Note [Ulysses in the DTensor path].
        window_size: flash-attn sliding window ``(left, right)`` over global positions for
            every SDPA call in the scope (-1: unbounded; ``is_causal`` sets ``right = 0``);
            docs/window.md. SDPA has no window argument, hence this option.

    Raises:
        ValueError: on a malformed ``window_size``.
        RuntimeError: when entered inside a function being compiled by ``torch.compile``, or
            when this torch's DTensor lacks the handler table (``_dtensor_compat.py``).
    """
    get_layout(layout, "dense")
    _check_mode(mode)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "enter dtensor_ring.ring_sdpa outside the torch.compile'd function (e.g. around "
            "the training step): its SDPA handlers act while AOTAutograd traces, after Dynamo; "
            "inside compiled code call dtensor_ring.scaled_dot_product_ring_attention instead"
        )
    config = _Config(layout, backend, mode, check_window_size(window_size))
    with _dtensor_compat.custom_op_handlers(_aten_handlers(config)), _RingSDPAMode(config):
        yield


# --------------------------------------------------------------------------------------------
# Sequence sharding of DTensors.
# --------------------------------------------------------------------------------------------
def _resolve_mesh_dim(mesh: DeviceMesh, mesh_dim: int | str | None) -> int:
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names or ''}; pass mesh_dim= (index "
                "or name of the context-parallel dim)"
            )
        return 0
    if isinstance(mesh_dim, str):
        names = mesh.mesh_dim_names or ()
        if mesh_dim not in names:
            raise ValueError(f"mesh_dim={mesh_dim!r} is not a dim name of the mesh {names}")
        return names.index(mesh_dim)
    if not -mesh.ndim <= mesh_dim < mesh.ndim:
        raise ValueError(f"mesh_dim={mesh_dim} is out of range for a {mesh.ndim}-D mesh")
    return mesh_dim % mesh.ndim


def shard_sequence(
    tensor: Tensor,
    mesh: DeviceMesh,
    seq_dim: int = 1,
    layout: LayoutName = "zigzag",
    mesh_dim: int | str | None = None,
    *,
    batch_dim: int | None = None,
) -> DTensor:
    """This rank's shard of ``tensor``'s sequence under ``layout``, as a DTensor (no communication).

    Works for inputs, labels and position ids alike (any dtype, any rank of tensor). The
    DTensor's global view is the *permuted* sequence for zigzag/stripe
    (Note [DTensor global view of a permuted layout]); :func:`unshard_sequence` inverts this.

    Args:
        tensor: the full sequence along ``seq_dim`` (length S, divisible by the layout's
            divisor), e.g. ids ``[B, S]``, hidden states ``[B, S, E]``, q ``[B, H, S, D]``.
            Identical on every rank of the context-parallel mesh dim.
        mesh: device mesh; ``mesh_dim`` (index or name) is the context-parallel dim, optional
            for a 1-D mesh.
        seq_dim: the sequence dim of ``tensor`` (1 for ``[B, S, ...]``, 2 for SDPA's
            ``[B, H, S, D]``).
        layout: "ring", "zigzag" or "stripe" (Note [Sequence layouts]).
        batch_dim: for meshes with other dims: None means ``tensor`` is the same on those
            ranks (placed ``Replicate()``); an int means each rank holds its own batch there
            (data parallel; placed ``Shard(batch_dim)``, the global batch being the
            concatenation).

    Returns:
        DTensor placed ``Shard(seq_dim)`` on ``mesh_dim``; its local tensor is
        :func:`dtensor_ring.shard_local` of ``tensor`` for this rank (``S // W`` tokens).
    """
    get_layout(layout, "dense")
    cp_dim = _resolve_mesh_dim(mesh, mesh_dim)
    seq_dim = seq_dim % tensor.dim()
    if batch_dim is not None:
        batch_dim %= tensor.dim()
        if batch_dim == seq_dim:
            raise ValueError(f"batch_dim={batch_dim} must differ from seq_dim={seq_dim}")
    other: Placement = Replicate() if batch_dim is None else Shard(batch_dim)
    placements = [other] * mesh.ndim
    placements[cp_dim] = Shard(seq_dim)
    local = shard_local(tensor, layout, mesh.get_local_rank(cp_dim), mesh.size(cp_dim), seq_dim)
    return DTensor.from_local(local, mesh, placements, run_check=False)


def unshard_sequence(dtensor: DTensor, seq_dim: int = 1, layout: LayoutName = "zigzag") -> Tensor:
    """The full tensor of a sequence-sharded DTensor, in the original token order.

    Inverse of :func:`shard_sequence`: ``DTensor.full_tensor()`` (gathering every sharded
    mesh dim) followed by the inverse of the layout's permutation along ``seq_dim``.
    A collective on every rank of the mesh; differentiable.

    Args:
        dtensor: placed ``Shard(seq_dim)`` on exactly one mesh dim (the context-parallel dim);
            its sequence laid out as ``layout`` says.
        seq_dim: the sequence dim (1 for ``[B, S, ...]``, 2 for ``[B, H, S, D]``).
        layout: "ring", "zigzag" or "stripe".

    Returns:
        Plain tensor of ``dtensor``'s global shape with the sequence in original order.
    """
    get_layout(layout, "dense")
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"unshard_sequence needs a DTensor, got {type(dtensor).__name__}")
    seq_dim = seq_dim % dtensor.dim()
    cp_dims = [
        i
        for i, p in enumerate(dtensor.placements)
        if type(p) is Shard and p.dim % dtensor.dim() == seq_dim
    ]
    if len(cp_dims) != 1:
        raise ValueError(
            f"dtensor (placements {tuple(dtensor.placements)}) must be sharded Shard({seq_dim}) "
            "on exactly one mesh dim (the context-parallel dim)"
        )
    world = dtensor.device_mesh.size(cp_dims[0])
    return restore_order(dtensor.full_tensor(), layout, world, seq_dim)
