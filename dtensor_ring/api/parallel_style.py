"""PyTorch's module-level context parallel on ring attention: :class:`ContextParallel`, a
``ParallelStyle`` for ``parallelize_module`` (its inputs' shards: ``context_parallel_shard`` in
``context_parallel.py``).

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
``_enable_context_parallel_dispatcher`` / ``_disable_...`` are no-ops here
(:func:`enable_context_parallel_dispatcher`): nothing is installed process-wide.

Shards made by someone else's balancer: a balancer is mapped by the permutation it makes
(``_generate_indices()``), not by its class: identity = "ring", head-tail = "zigzag"; any
other permutation (PyTorch's PTRR and per-document balancers) raises ``ValueError``: dense
ring attention needs a layout it can schedule. A module told a layout other than the one its
inputs were sharded in by :func:`context_parallel_shard` raises before any communication.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..algorithm import Algorithm
from ..layouts import get_layout
from .context_parallel import _cp_group, _layout_for, _ring_sdpa_local, default_algorithm
from .dtensor.placements import SDPA_SEQ_DIM
from .recompute import recompute_context

ATTENTION_TYPES = ("sdpa",)


def _attention_type(attention_type: object) -> str:
    """``"sdpa"`` from our string or PyTorch's ``_ContextParallel.AttentionType`` (by value);
    ``ValueError`` for FlexAttention and varlen (not served by this style yet)."""
    value = attention_type.value if isinstance(attention_type, enum.Enum) else attention_type
    name = {"scaled_dot_product_attention": "sdpa", "flex_attention": "flex"}.get(value, value)
    if name not in ATTENTION_TYPES:
        raise ValueError(
            f"ContextParallel(attention_type={attention_type!r}): only 'sdpa' "
            "(F.scaled_dot_product_attention) is served; FlexAttention and varlen attention "
            "modules are not (use the varlen functions, docs/varlen.md)"
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
        ValueError: a ``seq_dim`` other than SDPA's 2, another attention type, a DTensor input
            placed otherwise; in the forward, what ``context_parallel``'s SDPA raises.
    """

    def __init__(
        self,
        seq_dim: int = SDPA_SEQ_DIM,
        attention_type: object = "sdpa",
        *,
        layout: str | None = None,
        algorithm: Algorithm | None = None,
    ) -> None:
        super().__init__()
        self.attention_type = _attention_type(attention_type)
        if seq_dim != SDPA_SEQ_DIM:
            raise ValueError(
                f"ContextParallel(seq_dim={seq_dim!r}): F.scaled_dot_product_attention's q, k, v "
                f"are [B, H, S, D], sequence dim {SDPA_SEQ_DIM}"
            )
        if layout is not None:
            get_layout(layout, "dense")
        self.seq_dim, self.layout, self.algorithm = seq_dim, layout, algorithm

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _cp_group(device_mesh)
        forward = module.forward

        @functools.wraps(forward)
        def context_parallel_forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _local_inputs((args, kwargs), device_mesh, self.seq_dim)
            mode = functools.partial(_SDPAMode, group, self.layout, self.algorithm)
            with mode(), recompute_context(mode):
                return forward(*args, **kwargs)

        module.forward = context_parallel_forward
        return module


def _local_inputs(inputs: Any, mesh: DeviceMesh, seq_dim: int) -> Any:
    """``inputs`` with every DTensor replaced by its local shard (``ValueError`` unless it is
    placed ``Shard(seq_dim)`` on ``mesh``)."""
    flat, spec = tree_flatten(inputs)
    for i, x in enumerate(flat):
        if isinstance(x, DTensor):
            if x.device_mesh != mesh or tuple(x.placements) != (Shard(seq_dim),):
                raise ValueError(
                    f"ContextParallel: a DTensor input placed {tuple(x.placements)} on "
                    f"{x.device_mesh}; expected (Shard({seq_dim}),) on {mesh}"
                )
            flat[i] = x.to_local()
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
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        sdpa = _sdpa_arguments(*args, **kwargs)
        query = sdpa[0]
        world_size = dist.get_world_size(self.group)
        seq_len = query.shape[SDPA_SEQ_DIM] * world_size
        layout = _layout_for(self.layout, seq_len, world_size)
        algorithm = default_algorithm(self.algorithm)
        return _ring_sdpa_local(self.group, layout, algorithm, *sdpa)


def _sdpa_arguments(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple:
    """SDPA's arguments, positional (its signature: an unknown keyword is a ``TypeError``)."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def enable_context_parallel_dispatcher() -> None:
    """PyTorch's ``_enable_context_parallel_dispatcher``: nothing to switch here (Note
    [Module-level context parallel]); kept so that PyTorch's programs run unchanged."""


def disable_context_parallel_dispatcher() -> None:
    """PyTorch's ``_disable_context_parallel_dispatcher``: nothing to switch here."""
