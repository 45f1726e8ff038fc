"""What SDPA calls on DTensors must look like: placements, meshes, even shards (checked on global
metadata, identical on every rank, so errors raise everywhere before any communication)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ...consistency import relay_errors
from ...layouts import get_layout
from ...layouts.registry import registered_name
from ...resolve import check_algorithm, check_bool, check_heads, check_unsupported, placement
from ...resolved import Remembered, scalar_key, tensor_key, versions

SDPA_SEQ_DIM = 2  # [B, H, S, D]
OP_SEQ_DIM = 1  # [B, S, H, D]
BATCH_DIM = 0


def swap_seq_heads(t: Tensor) -> Tensor:
    """``[B, H, S, D] <-> [B, S, H, D]`` (a transpose view; its own inverse).

    The one place where SDPA's layout meets the op's; DTensors map ``Shard(2) <-> Shard(1)``.
    """
    return t.transpose(1, 2)


MODES = ("ring", "ulysses")


def sdpa_algorithm(mode: object, algorithm: object) -> str | None:
    """The ``algorithm=`` of an SDPA door given its older spelling ``mode=`` (one of
    :data:`MODES`): "ulysses" is ``algorithm="ulysses"``, "ring" the layout's own algorithm
    (None: "ring", or an alias's); ``ValueError`` when the two contradict."""
    algorithm = check_algorithm(algorithm)
    if mode is None:
        return algorithm
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES} (or pass algorithm=)")
    if algorithm is not None and (algorithm == "ulysses") != (mode == "ulysses"):
        raise ValueError(f"mode={mode!r} and algorithm={algorithm!r} disagree; pass algorithm=")
    return "ulysses" if mode == "ulysses" else algorithm


def to_op_layout(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SDPA's ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` -> the op's ``[B, S, H, D]`` views."""
    return swap_seq_heads(query), swap_seq_heads(key), swap_seq_heads(value)


# --------------------------------------------------------------------------------------------
# Validation (global metadata only: identical on every rank, so errors raise everywhere,
# before any communication).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sharded:
    """What the checks need of a DTensor or a DTensorSpec."""

    name: str
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    ndim: int


def mesh_dim_label(mesh: DeviceMesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return f"mesh dim {i}" + (f" ({names[i]!r})" if names else "")


def cp_mesh_dim(xs: Sequence[Sharded], *, seq_dim: int, layout_names: str) -> tuple[int, int]:
    """Check the placements of q/k/v-like tensors for ring attention.

    Accepted: one mesh; identical placements; ``Shard(seq_dim)`` on exactly one mesh dim (the
    context-parallel dim); ``Replicate()`` or ``Shard(0)`` (batch) on the others. Sizes are
    checked by :func:`check_even_shards` (apart, as they may be symbolic under compile).

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
                f"{first.name} has placement {p!r} on {mesh_dim_label(mesh, i)}: ring attention "
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
                f"{first.name} has placement {p!r} on {mesh_dim_label(mesh, i)}; ring attention "
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


def check_even_shards(
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


SDPA_CHECKS = Remembered()  # check_sdpa_args' results (Note [Remembered resolutions])


def check_sdpa_args(
    query: DTensor,
    key: DTensor,
    value: DTensor,
    attn_mask: object,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    layout: str,
    algorithm: str | None = None,
) -> tuple[int, str]:
    """Validate an SDPA call on DTensors ``[B, H, S, D]`` (errors reach every rank of the
    sequence dim's group in the consistency mode).

    Returns:
        ``(cp_dim, group_name)``: the context-parallel mesh dim and its process group's name.
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, layout, algorithm)
    if torch.compiler.is_compiling():
        return _check_sdpa_args(*args)
    remembered_key = _checked_key(*args)  # Note [Remembered resolutions]
    checked = SDPA_CHECKS.get(remembered_key)
    if checked is None:
        with relay_errors(lambda: sequence_group_name(query), "sdpa"):
            checked = _check_sdpa_args(*args)
        SDPA_CHECKS.put(remembered_key, checked)
    return checked


def _checked_key(query, key, value, attn_mask, *scalars) -> tuple | None:
    """What :func:`_check_sdpa_args` reads, or None where it must check afresh."""
    if attn_mask is not None or not registered_name(scalars[-2]):
        return None
    parts = [tensor_key(t) for t in (query, key, value)] + [scalar_key(x) for x in scalars]
    return None if None in parts else (*parts, *versions())


def sequence_group_name(query: object) -> str:
    """The name of the process group of ``query``'s sequence-sharded mesh dim (ValueError when
    there is not exactly one)."""
    if not isinstance(query, DTensor):
        raise ValueError("query is not a DTensor")
    dims = [
        i
        for i, p in enumerate(query.placements)
        if isinstance(p, Shard) and p.dim % query.dim() == SDPA_SEQ_DIM
    ]
    if len(dims) != 1:
        raise ValueError("query has no single sequence-sharded mesh dim")
    return query.device_mesh.get_group(dims[0]).group_name


def _check_sdpa_args(
    query: DTensor,
    key: DTensor,
    value: DTensor,
    attn_mask: object,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    layout: str,
    algorithm: str | None,
) -> tuple[int, str]:

    is_causal = check_bool("is_causal", is_causal)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    check_unsupported(dropout_p=dropout_p, alibi_slopes=None)
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:  # before SDPA picks a kernel, which would fail less clearly
        if isinstance(t, Tensor) and (t.numel() == 0 or not t.is_floating_point()):
            raise ValueError(
                f"{name} must be a non-empty floating-point tensor, got {t.dtype} of shape "
                f"{tuple(t.shape)}"
            )
    dtypes = [t.dtype for _, t in tensors if isinstance(t, Tensor)]
    if len(set(dtypes)) > 1:
        raise ValueError(f"query, key, value dtypes differ: {dtypes}; cast them")

    def describe(t):
        if not isinstance(t, DTensor):
            return type(t).__name__
        return t.device_mesh, tuple(t.placements), t.dim()

    cp_dim, group_name, world, batch_ways = _check_sdpa_metadata(
        tuple(describe(t) for t in (query, key, value)),
        attn_mask is not None,
        bool(is_causal),
        layout,
        algorithm,
    )
    _check_sdpa_shapes(
        query.shape, key.shape, value.shape, bool(enable_gqa), layout, algorithm, world, batch_ways
    )
    return cp_dim, group_name


@torch.compiler.assume_constant_result
def _check_sdpa_metadata(
    metadata: tuple,
    has_mask: bool,
    is_causal: bool,
    layout: str,
    algorithm: str | None = None,
) -> tuple[int, str, int, int]:
    """The checks of :func:`check_sdpa_args` that need no sizes.

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
    lay, algorithm = placement(layout, algorithm)
    if has_mask:
        raise ValueError(
            "attn_mask is not supported by ring attention (SDPA on sequence-sharded DTensors); "
            "pass attn_mask=None and is_causal=True for a causal mask"
        )
    names = ("query", "key", "value")
    for name, meta in zip(names, metadata, strict=True):
        if isinstance(meta, str):
            raise TypeError(
                f"{name} is a {meta}, not a DTensor, while other SDPA inputs are DTensors; "
                "make q, k and v DTensors on one mesh (DTensor.from_local for local shards)"
            )
    if algorithm == "ring":
        lay.check_mask(is_causal, ring_func="ring_sdpa(layout='ring')")
    xs = [Sharded(n, *meta) for n, meta in zip(names, metadata, strict=True)]
    cp_dim, batch_ways = cp_mesh_dim(xs, seq_dim=SDPA_SEQ_DIM, layout_names="[B, H, S, D]")
    mesh = xs[0].mesh
    return cp_dim, mesh.get_group(cp_dim).group_name, mesh.size(cp_dim), batch_ways


def _check_sdpa_shapes(
    q_shape,
    k_shape,
    v_shape,
    enable_gqa: bool,
    layout: str,
    algorithm: str | None,
    world: int,
    batch_ways: int,
) -> None:
    """The size checks of :func:`check_sdpa_args` (plain Python: sizes may be symbolic)."""
    check_even_shards(
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
    if placement(layout, algorithm)[1] == "ulysses":
        check_heads(H, world, "ring_sdpa(algorithm='ulysses')")
