"""Drop-in for PyTorch's ``context_parallel`` / ``context_parallel_unshard``
(``torch.distributed.tensor.experimental``): shard buffers in place, and run
``F.scaled_dot_product_attention`` on the plain local shards as ring attention.

Note [context_parallel: SDPA on plain shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's ``context_parallel(mesh, buffers=..., buffer_seq_dims=..., no_restore_buffers=...)``
reorders each buffer with its head-tail load balancer (chunks ``r`` and ``2W-1-r`` on rank
``r``: our "zigzag") when ``S % 2W == 0`` and keeps the order otherwise (contiguous chunks: our
"ring"), keeps this rank's shard *in place* (``resize_`` + ``copy_``: the caller's tensor
objects now hold the shard), and replaces ``F.scaled_dot_product_attention`` so that calls on
plain ``[B, H, S_local, D]`` tensors become ring attention. On exit it puts the full buffers
back, except those in ``no_restore_buffers``. Ours does the same with the library's pieces,
S = 8, W = 2, zigzag::

    enter   buffer [.., 0 1 2 3 4 5 6 7, ..]  --shard_local-->  rank 0: [0 1 6 7]
                                                                rank 1: [2 3 4 5]
    inside  F.scaled_dot_product_attention(q, k, v, is_causal=..)   (plain [B, H, S/W, D])
              |  the replacement (_attention_patched)
              v  [B, H, S/W, D] -> [B, S/W, H, D]
            ring_attention_func(layout, q, k, v, causal=.., group=mesh's group)  (autograd)
              |  [B, S/W, H, D] -> [B, H, S/W, D]
              v
            out, in the buffers' token order
    exit    buffer <- the full original data (unless in no_restore_buffers)
    unshard context_parallel_unshard: all-gather + reorder (gather_sequence) -> token order

Why a replaced module attribute, as PyTorch does, and not a ``TorchFunctionMode``: torch pops a
mode while its handler runs, and ``Tensor.backward`` is itself a torch function, so the
backward (with activation checkpointing's recompute of SDPA) would run without the mode and
recompute plain local attention. The attribute stays replaced through a backward inside the
context. As with PyTorch, code that bound ``scaled_dot_product_attention`` before entering
(``from torch.nn.functional import scaled_dot_product_attention``) is not redirected, and the
replacement is process-wide. A backward after the context is fine too (the graph holds ring
attention; an activation checkpoint's recomputation replaces SDPA again for itself: Note
[Recomputation outside the scope] in ``api/recompute.py``), provided the buffers autograd saved
(embedding indices, labels) are left sharded (``no_restore_buffers``): restoring them in place
fails autograd's version check, as in PyTorch.

torch's ``flex_attention`` (the attribute of ``torch.nn.attention.flex_attention``, bound names
again not redirected) is replaced alike, by :func:`dtensor_ring.flex_attention` on the shards
(its mask and score functions the whole sequence's), which PyTorch's context does not serve.

Non-causal attention does not depend on token order, so it runs with the "ring" schedule
whatever the layout (as PyTorch's, which computes every block in full then), except with
``layout="llama3_zigzag"`` (zigzag's tokens), which all-gathers K/V for every mask (Note
[Balanced all-gather attention] in ``engine/llama3.py``). SDPA on DTensors
goes to the original (``ring_sdpa`` handles those). What ring attention cannot do
(``attn_mask``, ``dropout_p > 0``) raises ``ValueError`` on every rank, before any
communication: the checks read only arguments that every rank passes alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.attention import flex_attention as torch_flex

from ..algorithm import Algorithm
from ..consistency import collective_entry, relay_errors
from ..layouts import Layout, balancer_layout, gather_sequence, get_layout, shard_local
from ..resolve import check_bool, check_unsupported, group_arg, placement
from .attend import dense_attention
from .dtensor.placements import SDPA_SEQ_DIM, to_op_layout
from .flex import flex_attention
from .recompute import recompute_context


def _cp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of the 1-D context-parallel ``mesh`` (``ValueError`` otherwise)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"mesh must be a 1-D DeviceMesh over the context-parallel ranks (e.g. mesh['cp']), "
            f"got {mesh!r}"
        )
    return mesh.get_group()


class RotateMethod(enum.Enum):
    """PyTorch's ``_RotateMethod``: how K/V move (``set_rotate_method``'s strings)."""

    ALL_TO_ALL = "alltoall"  # passed around the ring: algorithm "ring"
    ALL_GATHER = "allgather"  # all-gathered: algorithm "all_gather"


@dataclasses.dataclass
class ContextParallelOptions:
    """PyTorch's ``_cp_options``, read by the doors that mirror its context parallel
    (:func:`context_parallel`, ``ContextParallel``, the unshard): ``enable_load_balance``
    (default layout head-tail "zigzag" when the length divides, else "ring";
    ``context_parallel_shard`` sets it as PyTorch's does), ``rotate_method`` (None: the
    layout's algorithm, "ring"; PyTorch defaults to the all-gather)."""

    enable_load_balance: bool = True
    rotate_method: RotateMethod | None = None


cp_options = ContextParallelOptions()


def set_rotate_method(rotate_method: str) -> None:
    """PyTorch's ``set_rotate_method``: ``"alltoall"`` (K/V around the ring) or
    ``"allgather"`` (K/V all-gathered) for the context-parallel doors' ``algorithm=None``."""
    methods = {m.value: m for m in RotateMethod}
    if rotate_method not in methods:
        raise ValueError(
            f"rotate_method must be 'allgather' or 'alltoall' (PyTorch's), got {rotate_method!r}"
        )
    cp_options.rotate_method = methods[rotate_method]


def default_algorithm(algorithm: Algorithm | None) -> Algorithm | None:
    """``algorithm``, or for None the one :func:`set_rotate_method` chose (None: the
    layout's)."""
    if algorithm is not None or cp_options.rotate_method is None:
        return algorithm
    return "all_gather" if cp_options.rotate_method is RotateMethod.ALL_GATHER else "ring"


def _layout_for(layout: str | Layout | None, seq_len: int, world_size: int) -> str | Layout:
    """``layout``, or for None PyTorch's default: head-tail ("zigzag") when
    ``cp_options.enable_load_balance`` and ``seq_len % 2W == 0``, else no reordering
    ("ring")."""
    if layout is not None:
        get_layout(layout, "dense")
        return layout
    balanced = cp_options.enable_load_balance and seq_len % (2 * world_size) == 0
    return "zigzag" if balanced else "ring"


def _check_buffer_args(
    buffers: Sequence[Tensor], seq_dims: Sequence[int], no_restore: set[Tensor] | None = None
) -> None:
    """PyTorch's argument checks, as ``ValueError``."""
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"buffer_seq_dims ({len(seq_dims)} entries) must have one sequence dim per buffer "
            f"({len(buffers)} buffers)"
        )
    for buffer in no_restore or ():
        if not any(b is buffer for b in buffers):  # `in` would compare tensor values
            raise ValueError("no_restore_buffers must be a subset of buffers")
    if any(isinstance(b, torch.nn.Parameter) for b in buffers):
        raise ValueError("buffers must not contain an nn.Parameter (they are resized in place)")


def _ring_sdpa_local(
    group: dist.ProcessGroup,
    layout: str | None,
    algorithm: str | None,
    seq_len: int | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """SDPA's arguments on plain local shards -> ring attention over ``group`` in ``layout``
    (None: PyTorch's default for the call's global length ``S_local * W``; "llama3_zigzag":
    all-gather attention).

    ``query [B, H, S_local, D]``, ``key, value [B, H_kv, S_local, D]`` -> ``[B, H, S_local, D]``.
    ``seq_len``: the buffers' whole length, if any; a query that long on several ranks is not
    a shard (ValueError).
    """
    # one rank's error reaches every rank (the others meet it in the door's comparison)
    with relay_errors((group_arg(group)[0],), "ring_attention"):
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported by F.scaled_dot_product_attention inside "
                "dtensor_ring.context_parallel (ring attention); pass attn_mask=None and "
                "is_causal=True for a causal mask"
            )
        check_unsupported(dropout_p=dropout_p, alibi_slopes=None)
        is_causal = check_bool("is_causal", is_causal)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.ndim != 4:
                raise ValueError(
                    f"{name} must be 4-D [B, H, S_local, D] inside dtensor_ring.context_parallel, "
                    f"got shape {tuple(t.shape)}"
                )
        if not check_bool("enable_gqa", enable_gqa) and key.shape[1] != query.shape[1]:
            raise ValueError(
                f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                "for grouped-query attention (as SDPA requires)"
            )
        layout = _shard_layout(group, layout, seq_len, query, "F.scaled_dot_product_attention")
    out, _ = dense_attention(
        *to_op_layout(query, key, value),
        layout=layout,
        algorithm=algorithm,
        causal=is_causal,
        softmax_scale=scale,
        window_size=(-1, -1),
        group=group,
        return_lse=False,
        order_free=True,  # without a mask, the order-free contiguous plan (the Note)
    )
    return out.transpose(1, 2)


def _shard_layout(
    group: dist.ProcessGroup, layout: str | None, seq_len: int | None, query: Tensor, fn: str
) -> str | Layout:
    """The layout of a call ``fn`` on the local ``query [B, H, S_local, D]`` inside the
    context (:func:`_layout_for` of its global length); ``ValueError`` for a query as long as
    the buffers on several ranks (not a shard)."""
    world_size = dist.get_world_size(group)
    if world_size > 1 and query.shape[SDPA_SEQ_DIM] == seq_len:
        raise ValueError(
            f"{fn} inside dtensor_ring.context_parallel got a query of {seq_len} tokens on "
            f"each of {world_size} ranks: the whole length of the buffers it sharded, not this "
            "rank's shard (S / W). Compute q, k, v from sharded tensors: pass every tensor with "
            "the sequence dim that feeds attention (input ids, positions, ...) in buffers="
        )
    return _layout_for(layout, query.shape[SDPA_SEQ_DIM] * world_size, world_size)


def _flex_on_shards(
    group: dist.ProcessGroup,
    layout: str | None,
    algorithm: str | None,
    seq_len: int | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *args: object,
    **kwargs: object,
) -> object:
    """torch's ``flex_attention`` inside the context: :func:`dtensor_ring.flex_attention` on
    the local shards ``[B, H, S_local, D]`` over ``group`` (the ``BlockMask`` / ``mask_mod``
    and ``score_mod`` the whole sequence's); DTensors: its DTensor door."""
    if any(isinstance(t, DTensor) for t in (query, key, value)):
        return flex_attention(query, key, value, *args, **kwargs)
    if isinstance(query, Tensor) and query.dim() == 4:  # else flex_attention says what is wrong
        layout = _shard_layout(group, layout, seq_len, query, "flex_attention")
    if algorithm is not None:
        kwargs["algorithm"] = algorithm
    return flex_attention(query, key, value, *args, group=group, layout=layout, **kwargs)


@contextlib.contextmanager
def _attention_patched(
    group: dist.ProcessGroup,
    layout: str | None,
    algorithm: str | None,
    seq_len: int | None = None,
) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` replaced by :func:`_ring_sdpa_local` for plain
    tensors (DTensors go to the original) and torch's ``flex_attention`` by
    :func:`_flex_on_shards`, both restored on exit; ``seq_len``: the buffers' whole length
    (None: no buffers)."""
    original = F.scaled_dot_product_attention
    original_flex = torch_flex.flex_attention

    @functools.wraps(original)
    def scaled_dot_product_attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if any(isinstance(t, DTensor) for t in (query, key, value)):
            return original(*args[:6], scale=scale, enable_gqa=enable_gqa)
        return _ring_sdpa_local(group, layout, algorithm, seq_len, *args)

    # torch caches the functions __torch_function__ can override on first use, Dynamo's first
    # trace included: built while the attribute is replaced, the cache would hold ours, not
    # the builtin, and from then on no compiled builtin SDPA would reach a TorchFunctionMode
    # (ContextParallel's: plain local attention, silently). Fill it with the builtin first.
    torch.overrides.get_overridable_functions()
    F.scaled_dot_product_attention = scaled_dot_product_attention
    torch_flex.flex_attention = functools.wraps(original_flex)(
        functools.partial(_flex_on_shards, group, layout, algorithm, seq_len)
    )
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        torch_flex.flex_attention = original_flex


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: list[Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[Tensor] | None = None,
    layout: str | None = None,
    algorithm: Algorithm | None = None,
) -> Iterator[None]:
    """PyTorch's ``context_parallel`` on ring attention, on CPU and CUDA.

    Shards every buffer in place along its sequence dim (this rank's ``S // W`` tokens in
    ``layout``'s order); inside, ``F.scaled_dot_product_attention(q, k, v, is_causal=...,
    scale=..., enable_gqa=...)`` on plain ``q [B, H, S_local, D]``, ``k, v [B, H_kv, S_local,
    D]`` runs ring attention over ``mesh`` (differentiable; backward may run inside or after,
    also with activation checkpointing: Note [Recomputation outside the scope]);
    on exit the buffers get their full data back (except ``no_restore_buffers``). Note
    [context_parallel: SDPA on plain shards].

    Args:
        mesh: 1-D DeviceMesh over the context-parallel ranks.
        buffers: tensors to shard in place (input ids, labels, positions, ...); no Parameters.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers (a subset of ``buffers``) left sharded on exit.
        layout: our extension: "ring", "zigzag", "stripe", "llama3_zigzag" (zigzag's
            tokens, K/V all-gathered instead of passed around a ring) or "auto" (zigzag's
            tokens; ring, all-gather or Ulysses chosen per call: Note [Choosing ring,
            all-gather or Ulysses]). None (PyTorch's behaviour):
            "zigzag" (its head-tail load balancing) when ``S % 2W == 0`` and
            ``cp_options.enable_load_balance``, else "ring", with
            ``S`` the first buffer's length (without buffers: each SDPA call's ``S_local * W``).
        algorithm: our extension: how K/V move (Note [Layouts and algorithms]): "ring",
            "all_gather", "ulysses" or "auto"; None: :func:`set_rotate_method`'s choice, else
            the layout alias's, else "ring".

    Raises:
        ValueError: on a malformed argument, a sequence length the layout cannot split (on
            every rank of the mesh where one rank's call compares: a gloo group or the
            consistency mode, docs/troubleshooting.md), and
            inside, on SDPA with ``attn_mask`` or ``dropout_p > 0``, or (W > 1) with a query
            as long as the first buffer: not a shard (computed from an unsharded tensor).
        RuntimeError: when this torch's checkpoint internals lack the known form
            (``_compat/checkpoint.py``: activation checkpointing could not be followed).
    """
    group = _cp_group(mesh)
    group_name = group_arg(group)[0]
    buffers = [] if buffers is None else buffers
    buffer_seq_dims = [] if buffer_seq_dims is None else buffer_seq_dims
    no_restore = set() if no_restore_buffers is None else no_restore_buffers
    world_size, rank = mesh.size(), mesh.get_local_rank()
    with collective_entry(group_name, "context_parallel"):  # entered by every rank together
        _check_buffer_args(buffers, buffer_seq_dims, no_restore)
        seq_len = buffers[0].shape[buffer_seq_dims[0]] if buffers else None
        if seq_len is not None:
            layout = _layout_for(layout, seq_len, world_size)
        elif layout is not None:
            get_layout(layout, "dense")
        algorithm = default_algorithm(algorithm)
        if layout is not None:
            placement(layout, algorithm)
        with torch.no_grad():  # (raises for a length the layout cannot split)
            shards = [
                shard_local(b, layout, rank, world_size, d)
                for b, d in zip(buffers, buffer_seq_dims, strict=True)
            ]
    with torch.no_grad():
        originals = [None if b in no_restore else b.clone() for b in buffers]
        for buffer, shard in zip(buffers, shards, strict=True):
            buffer.resize_(shard.shape)
            buffer.copy_(shard)
    try:
        # a checkpoint's recomputation replaces SDPA again: Note [Recomputation outside the scope]
        patched = functools.partial(_attention_patched, group, layout, algorithm, seq_len)
        with patched(), recompute_context(patched):
            yield
    finally:
        with torch.no_grad():
            for buffer, original in zip(buffers, originals, strict=True):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh,
    buffers: list[Tensor],
    seq_dims: list[int],
    load_balancer: object = None,
    *,
    layout: str | None = None,
) -> list[Tensor]:
    """PyTorch's ``context_parallel_unshard``: every rank's shard of each buffer, all-gathered
    and put back in token order (a collective; not differentiable).

    Args:
        mesh: the 1-D DeviceMesh of :func:`context_parallel`.
        buffers: this rank's shards (e.g. the output, ``S_local`` long on its seq dim).
        seq_dims: the sequence dim of each buffer.
        load_balancer: PyTorch's: the balancer the shards were made with (its layout:
            :func:`~dtensor_ring.layouts.balancer_layout`), or None.
        layout: our extension; the layout the shards are in. None (and no balancer):
            PyTorch's default for the global length ``S_local * W`` of the first buffer, as
            :func:`context_parallel`.

    Returns:
        The full tensors, ``S`` long on their sequence dims.
    """
    group = _cp_group(mesh)
    _check_buffer_args(buffers, seq_dims)
    if not buffers:
        return []
    world_size = mesh.size()
    seq_len = buffers[0].shape[seq_dims[0]] * world_size
    if load_balancer is not None:
        if layout is not None:
            raise ValueError("pass load_balancer= or layout=, not both")
        layout = balancer_layout(load_balancer, seq_len, world_size)
    layout = _layout_for(layout, seq_len, world_size)
    return [gather_sequence(b, layout, d, group) for b, d in zip(buffers, seq_dims, strict=True)]
