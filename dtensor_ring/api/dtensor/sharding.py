"""Sequence sharding of DTensors: ``shard_sequence`` / ``unshard_sequence`` (Note [DTensor
global view of a permuted layout])."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ...layouts import LayoutName, get_layout, shard_local
from ...layouts.sharding import restore_order
from .scope import scope_layout


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
    layout: LayoutName | None = None,
    mesh_dim: int | str | None = None,
    *,
    batch_dim: int | None = None,
) -> DTensor:
    """This rank's shard of ``tensor``'s sequence under ``layout``, as a DTensor (no communication).

    Works for inputs, labels and position ids alike (any dtype, any rank of tensor). The
    DTensor's global view is the *permuted* sequence for zigzag/stripe/llama3_zigzag
    (Note [DTensor global view of a permuted layout]); :func:`unshard_sequence` inverts this.

    Args:
        tensor: the full sequence along ``seq_dim`` (length S, divisible by the layout's
            divisor), e.g. ids ``[B, S]``, hidden states ``[B, S, E]``, q ``[B, H, S, D]``.
            Identical on every rank of the context-parallel mesh dim.
        mesh: device mesh; ``mesh_dim`` (index or name) is the context-parallel dim, optional
            for a 1-D mesh.
        seq_dim: the sequence dim of ``tensor`` (1 for ``[B, S, ...]``, 2 for SDPA's
            ``[B, H, S, D]``).
        layout: "ring", "zigzag", "stripe" or "llama3_zigzag" (zigzag's tokens; Note
            [Sequence layouts]); None: the layout of the active :func:`ring_sdpa` scope,
            "ring" outside any.
        batch_dim: for meshes with other dims: None means ``tensor`` is the same on those
            ranks (placed ``Replicate()``); an int means each rank holds its own batch there
            (data parallel; placed ``Shard(batch_dim)``, the global batch being the
            concatenation).

    Returns:
        DTensor placed ``Shard(seq_dim)`` on ``mesh_dim``; its local tensor is
        :func:`dtensor_ring.shard_local` of ``tensor`` for this rank (``S // W`` tokens).
    """
    layout = scope_layout(layout)
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


def unshard_sequence(
    dtensor: DTensor, seq_dim: int = 1, layout: LayoutName | None = None
) -> Tensor:
    """The full tensor of a sequence-sharded DTensor, in the original token order.

    Inverse of :func:`shard_sequence`: ``DTensor.full_tensor()`` (gathering every sharded
    mesh dim) followed by the inverse of the layout's permutation along ``seq_dim``.
    A collective on every rank of the mesh; differentiable.

    Args:
        dtensor: placed ``Shard(seq_dim)`` on exactly one mesh dim (the context-parallel dim);
            its sequence laid out as ``layout`` says.
        seq_dim: the sequence dim (1 for ``[B, S, ...]``, 2 for ``[B, H, S, D]``).
        layout: "ring", "zigzag", "stripe" or "llama3_zigzag"; None: the layout of the
            active :func:`ring_sdpa` scope, "ring" outside any.

    Returns:
        Plain tensor of ``dtensor``'s global shape with the sequence in original order.
    """
    layout = scope_layout(layout)
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
