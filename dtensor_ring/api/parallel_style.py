"""PyTorch's module-level context parallel on ring attention: :class:`ContextParallel` (a
``ParallelStyle`` for ``parallelize_module``), :func:`context_parallel_shard` for its inputs,
and the dispatcher switches of PyTorch's DTensor path.

Note [Module-level context parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's module form applies context parallelism to an attention module rather than to a
scope: ``parallelize_module(attn, mesh, _ContextParallel(seq_dim=2, attention_type=SDPA))``
hooks the module (tensor inputs -> DTensors ``Shard(seq_dim)``, outputs -> local tensors),
``_enable_context_parallel_dispatcher()`` makes DTensor's SDPA run ring attention, and
``_context_parallel_shard(mesh, buffers, seq_dims, load_balancer)`` reorders (head-tail) and
shards the inputs. Ours keeps the shape of that program and needs no DTensor::

    shards = context_parallel_shard(mesh, [ids, pos, labels], [1, 1, 1], load_balancer)
               | load_balancer -> layout: None = "ring" (contiguous), head-tail = "zigzag"
               | (PyTorch's: sets cp_options.enable_load_balance, the default below)
    parallelize_module(attn, mesh, ContextParallel(seq_dim=2))
               | attn.forward wrapped:
    attn(q, k, v)      DTensor inputs (Shard(seq_dim)) -> their local shards
                       with the SDPA mode (this call only, this thread only):
                           original forward: F.scaled_dot_product_attention(q, k, v, ..)
                             -> ring attention over mesh, in the layout (as context_parallel)
                       outputs: local tensors
    context_parallel_unshard(mesh, [out], [2])        all-gather, back in token order

Why a ``TorchFunctionMode`` entered around the forward call, where ``context_parallel``
replaces the module attribute (Note [context_parallel: SDPA on plain shards]): the mode covers
exactly this module's forward, on this thread, and ``torch.compile(fullgraph=True)`` traces
it (the attribute swap is process-wide); a backward needs no mode (the graph holds ring
attention), and a checkpoint's recomputation runs the forward again, or, checkpointed inside
the forward, enters the mode again through Note [Recomputation outside the scope].
``attention_type="flex"`` (PyTorch's FLEX): PyTorch's style requires the module's forward to
have ``flex_attention``'s signature (it swaps in all-gathered K/V and keeps the forward); ours
makes that forward :func:`dtensor_ring.flex_attention` on the shards, with K/V on the ring and
the global ``BlockMask``, which :func:`context_parallel_shard` passes through whole (the
user's functions see global indices: Note [FlexAttention on the ring]).
The module form needs no dispatcher; :func:`enable_context_parallel_dispatcher` is PyTorch's
other path (torchtitan's): SDPA on ``Shard``-ed DTensors anywhere, through a ``ring_sdpa``
scope held open until :func:`disable_context_parallel_dispatcher`.

Shards made by someone else's balancer: a balancer is mapped by the permutation it makes
(``_generate_indices()``), not by its class: identity = "ring", head-tail = "zigzag", any
other single permutation (PyTorch's PTRR and per-document balancers) a ``TokenLayout``
holding it, whose runs the ring schedules like any layout's; a permutation that differs
between batch rows raises ``ValueError``. The modules use the layout the inputs were last
sharded in (or the one they were told).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.attention.flex_attention import BlockMask
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._compat import for_each_simulated_rank
from ..algorithm import VARLEN_ALGORITHMS, Algorithm, check_pair
from ..consistency import relay_errors
from ..layouts import Layout, balancer_layout, get_layout, token_indices
from ..resolve import check_algorithm, group_arg, placement
from .context_parallel import (
    _check_buffer_args,
    _cp_group,
    _ring_sdpa_local,
    cp_options,
    default_algorithm,
)
from .dtensor import ring_sdpa
from .dtensor.placements import SDPA_SEQ_DIM
from .flex import flex_attention
from .recompute import recompute_context

ATTENTION_TYPES = ("sdpa", "flex")


def _attention_type(attention_type: object) -> str:
    """``"sdpa"`` / ``"flex"`` from our string or PyTorch's ``_ContextParallel.AttentionType``
    (by value); ``ValueError`` for varlen (not served by this style yet)."""
    value = attention_type.value if isinstance(attention_type, enum.Enum) else attention_type
    name = {"scaled_dot_product_attention": "sdpa", "flex_attention": "flex"}.get(value, value)
    if name not in ATTENTION_TYPES:
        raise ValueError(
            f"ContextParallel(attention_type={attention_type!r}): 'sdpa' "
            "(F.scaled_dot_product_attention) and 'flex' (a flex_attention module) are served; "
            "varlen attention modules are not (use the varlen functions, docs/varlen.md)"
        )
    return name


class ContextParallel(ParallelStyle):
    """PyTorch's ``_ContextParallel`` on ring attention: ``parallelize_module(attn, mesh,
    ContextParallel(seq_dim=2))`` makes every ``F.scaled_dot_product_attention`` that ``attn``'s
    forward calls on ``[B, H, S_local, D]`` shards ring attention over ``mesh`` (Note
    [Module-level context parallel]).

    Args:
        seq_dim: the sequence dim of the module's q, k, v (SDPA's: 2).
        attention_type: ``"sdpa"`` (or PyTorch's ``_ContextParallel.AttentionType.SDPA``).
        layout: our extension: the layout of the shards. None: PyTorch's default, head-tail
            ("zigzag") when ``S % 2W == 0`` and ``cp_options.enable_load_balance`` (which
            :func:`context_parallel_shard` sets: True with a balancer), else "ring".
        algorithm: our extension (Note [Layouts and algorithms]); None: the one
            :func:`set_rotate_method` chose ("allgather": "all_gather"), else the layout's.

    Inputs may be local shards or DTensors placed ``Shard(seq_dim)`` on the mesh; outputs are
    local. The module's forward must call ``F.scaled_dot_product_attention`` (by attribute).

    Raises:
        ValueError / TypeError: a ``seq_dim`` other than SDPA's 2, another attention type, an
            unknown layout or algorithm or a pair that cannot run (stripe + all_gather), a
            DTensor input placed otherwise; in the forward, what ``context_parallel``'s SDPA
            raises.
    """

    def __init__(
        self,
        seq_dim: int = SDPA_SEQ_DIM,
        attention_type: object = "sdpa",
        *,
        layout: str | Layout | None = None,
        algorithm: Algorithm | None = None,
    ) -> None:
        super().__init__()
        self.attention_type = _attention_type(attention_type)
        if seq_dim != SDPA_SEQ_DIM:
            raise ValueError(
                f"ContextParallel(seq_dim={seq_dim!r}): F.scaled_dot_product_attention's q, k, v "
                f"are [B, H, S, D], sequence dim {SDPA_SEQ_DIM}"
            )
        check_algorithm(algorithm)
        if self.attention_type == "flex" and algorithm not in (None, *VARLEN_ALGORITHMS):
            raise ValueError(
                f"ContextParallel(attention_type='flex', algorithm={algorithm!r}): FlexAttention "
                "runs on the ring (algorithm='ring' or None) or, for document masks, by the "
                "all-gather of the keys needed (algorithm='all_gather')"
            )
        if layout is not None:
            get_layout(layout, "dense")
            lay, chosen = placement(layout, algorithm)
            if chosen != "auto":  # a pair that cannot run raises here, not at the first call
                check_pair(lay, chosen)
        self.seq_dim, self.layout, self.algorithm = seq_dim, layout, algorithm

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _cp_group(device_mesh)
        if self.attention_type == "flex":
            module.forward = functools.partial(_flex_forward, self, group, device_mesh)
            return module
        forward = module.forward

        @functools.wraps(forward)
        def context_parallel_forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _local_inputs((args, kwargs), device_mesh, self.seq_dim, group)
            mode = functools.partial(_SDPAMode, group, self.layout, self.algorithm)
            with mode(), recompute_context(mode):
                return forward(*args, **kwargs)

        module.forward = context_parallel_forward
        return module


def _flex_forward(
    style: ContextParallel, group: dist.ProcessGroup, mesh: DeviceMesh, *args: Any, **kwargs: Any
) -> Any:
    """A FlexAttention module's forward under :class:`ContextParallel`: the module is a
    ``flex_attention`` wrapper (its forward has ``flex_attention``'s signature, as PyTorch's
    FLEX style requires), so the call is :func:`dtensor_ring.flex_attention` on the shards,
    with the global ``BlockMask`` that :func:`context_parallel_shard` passed through."""
    args, kwargs = _local_inputs((args, kwargs), mesh, style.seq_dim, group)
    layout = sharded_layout(style.layout)
    return flex_attention(*args, group=group, layout=layout, algorithm=style.algorithm, **kwargs)


def sharded_layout(layout: str | Layout | None = None) -> str | Layout:
    """``layout``, else the one :func:`context_parallel_shard` last sharded in, else
    PyTorch's default by ``cp_options.enable_load_balance`` ("zigzag" / "ring")."""
    if layout is not None:
        return layout
    return _SHARDED[0] or ("zigzag" if cp_options.enable_load_balance else "ring")


def _local_inputs(inputs: Any, mesh: DeviceMesh, seq_dim: int, group: dist.ProcessGroup) -> Any:
    """``inputs`` with every DTensor replaced by its local shard (``ValueError`` unless it is
    placed ``Shard(seq_dim)`` on ``mesh``, relayed to every rank of ``group``: the others are
    about to compare their attention call)."""
    flat, spec = tree_flatten(inputs)
    with relay_errors(lambda: group_arg(group)[0], "ContextParallel"):
        for x in flat:
            if isinstance(x, DTensor) and (
                x.device_mesh != mesh or tuple(x.placements) != (Shard(seq_dim),)
            ):
                raise ValueError(
                    f"ContextParallel: a DTensor input placed {tuple(x.placements)} on "
                    f"{x.device_mesh}; expected (Shard({seq_dim}),) on {mesh}"
                )
    flat = [x.to_local() if isinstance(x, DTensor) else x for x in flat]
    return tree_unflatten(flat, spec)


class _SDPAMode(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on plain shards -> ring attention over ``group``
    (:func:`_ring_sdpa_local` with the shards' layout); every other function unchanged."""

    def __init__(self, group: dist.ProcessGroup, layout: str | None, algorithm: str | None):
        super().__init__()
        self.group, self.layout, self.algorithm = group, layout, algorithm

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: Mapping | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        algorithm = default_algorithm(self.algorithm)  # set_rotate_method's, read per call
        layout = self.layout if self.layout is not None else _SHARDED[0]  # the shards' own
        # SDPA's own signature from here on (an unknown keyword is a TypeError)
        return _ring_sdpa_local(self.group, layout, algorithm, None, *args, **kwargs)


def context_parallel_shard(
    mesh: DeviceMesh,
    buffers: Sequence[Tensor] | Mapping[str, Tensor],
    seq_dims: Sequence[int] | Mapping[str, int],
    load_balancer: object = None,
    *,
    layout: str | None = None,
) -> Any:
    """PyTorch's ``_context_parallel_shard``: this rank's shard of every buffer (copies; the
    buffers are left as they are), in the layout ``load_balancer`` makes.

    Args:
        mesh: 1-D DeviceMesh over the context-parallel ranks.
        buffers: tensors with a sequence dim (input ids, positions, labels, q/k/v), a list or
            a dict (the result has the same structure).
        seq_dims: each buffer's sequence dim, in the same structure.
        load_balancer: None (contiguous shards: "ring"), PyTorch's head-tail balancer (or any
            object whose ``_generate_indices()`` gives head-tail's permutation: "zigzag"), or
            a layout name. Sets ``cp_options.enable_load_balance`` as PyTorch's does (True
            unless the shards are contiguous): :class:`ContextParallel` and
            :func:`context_parallel_unshard` then default to "zigzag" or "ring" alike.
        layout: our extension, instead of ``load_balancer``: a layout name (pass the same
            ``layout=`` to :class:`ContextParallel` and :func:`context_parallel_unshard`).

    Raises:
        ValueError: mismatched ``seq_dims``, a length the layout cannot split, a balancer
            whose permutation differs between batch rows.
    """
    _cp_group(mesh)
    flat, spec = tree_flatten(buffers)
    if isinstance(buffers, Mapping) and isinstance(seq_dims, Mapping):
        if set(buffers) != set(seq_dims):
            raise ValueError(
                f"seq_dims has keys {sorted(seq_dims)}, buffers {sorted(buffers)}: one "
                "sequence dim per buffer"
            )
        seq_dims = {key: seq_dims[key] for key in buffers}  # in the buffers' order
    flat_dims, _ = tree_flatten(seq_dims)  # as PyTorch's: the flattened counts must agree
    _check_buffer_args(flat, flat_dims)
    for b in flat:
        if not isinstance(b, (Tensor, BlockMask)):
            raise TypeError(
                f"context_parallel_shard shards tensors and BlockMasks; got {type(b).__name__}"
            )
    tensors = [(i, b) for i, b in enumerate(flat) if isinstance(b, Tensor)]
    if not tensors:
        return tree_unflatten(flat, spec)
    world_size, rank = mesh.size(), mesh.get_local_rank()
    seq_len = tensors[0][1].shape[flat_dims[tensors[0][0]]]
    if layout is not None and load_balancer is not None:
        raise ValueError("pass load_balancer= or layout=, not both")
    layout = layout if layout is not None else balancer_layout(load_balancer, seq_len, world_size)
    # shard_local's index_select, the indices computed rank by rank under PyTorch's
    # LocalTensorMode (there the rank is a per-rank symbolic int; the shards LocalTensors)
    indices = for_each_simulated_rank(token_indices)
    shards = [  # a BlockMask stays whole: flex_attention takes the global mask
        b.index_select(d, indices(layout, b.shape[d], rank, world_size).to(b.device))
        if isinstance(b, Tensor)
        else b
        for b, d in zip(flat, flat_dims, strict=True)
    ]
    cp_options.enable_load_balance = layout != "ring"  # PyTorch's: the default layout from now
    _SHARDED[0] = layout
    if _DISPATCHER and _DISPATCHER[-1][1] != layout:  # the dispatcher follows the shards
        enable_context_parallel_dispatcher(layout=layout, algorithm=_DISPATCHER[-1][2])
    return tree_unflatten(shards, spec)


def enable_context_parallel_dispatcher(
    *, layout: str | None = None, algorithm: Algorithm | None = None
) -> None:
    """PyTorch's ``_enable_context_parallel_dispatcher``: from now until
    :func:`disable_context_parallel_dispatcher`, SDPA on sequence-sharded DTensors
    (``Shard(2)`` of ``[B, H, S, D]``, e.g. torchtitan's ``Shard(1)`` inputs transposed) runs
    ring attention: a :func:`~dtensor_ring.ring_sdpa` scope held open, in ``layout`` (None:
    the one :func:`context_parallel_shard` last sharded in, else "zigzag" when
    ``cp_options.enable_load_balance``, else "ring") with ``algorithm`` (None:
    :func:`set_rotate_method`'s). A shard in another layout while it is on moves it to that
    layout, as PyTorch's reads its options per call. :class:`ContextParallel` modules need
    none of it (Note [Module-level context parallel]). Call both on the same thread; enable
    again replaces the scope."""
    disable_context_parallel_dispatcher()
    layout = sharded_layout(layout)
    scope = contextlib.ExitStack()
    scope.enter_context(ring_sdpa(layout=layout, algorithm=default_algorithm(algorithm)))
    _DISPATCHER.append((scope, layout, algorithm))


def disable_context_parallel_dispatcher() -> None:
    """PyTorch's ``_disable_context_parallel_dispatcher``: closes the scope of
    :func:`enable_context_parallel_dispatcher` (nothing if it is off)."""
    while _DISPATCHER:
        _DISPATCHER.pop()[0].close()


_DISPATCHER: list[tuple[contextlib.ExitStack, str, Algorithm | None]] = []
_SHARDED: list[str | Layout | None] = [None]  # the layout context_parallel_shard last used
