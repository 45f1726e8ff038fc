"""Private DTensor internals that the DTensor front door needs, walled off in one place.

One private API is used: DTensor's table of custom op handlers,
``DTensor._op_dispatcher._custom_op_handlers`` (a ``dict`` from ``OpOverload`` to
``handler(op, args, kwargs)``; DTensor's dispatcher, in Python up to torch 2.9 and in C++
from 2.10, calls a listed handler instead of sharding propagation). PyTorch's own
context parallelism (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``)
and loss parallelism (``torch/distributed/tensor/parallel/loss.py``) install their handlers
the same way. :mod:`dtensor_ring.api.dtensor` uses it to route the fused SDPA aten ops (and
their backward ops) on DTensors to ring attention (Note [How SDPA on DTensors reaches ring
attention]).

:data:`HAS_OP_HANDLER_TABLE` says whether this torch has the table in the known form (checked
at import, for torch ``>= 2.11``); ``tests/test_dtensor.py`` asserts it and that DTensor's
dispatcher really calls an installed handler, so a PyTorch change fails loudly there. Without
it, :func:`custom_op_handlers` raises ``RuntimeError`` (``ring_sdpa`` cannot work);
``scaled_dot_product_ring_attention`` needs no private API and keeps working.

``bind_args`` and ``return_names`` read ``OpOverload._schema`` (long-standing, but private).

:func:`wrap_local` builds a DTensor from a local shard the way DTensor's own dispatcher wraps
an op's outputs (``DTensor(local, spec, requires_grad=False)`` with a ``DTensorSpec``, both
marked internal), for code below autograd; without them (or before torch 2.11) it is
``DTensor.from_local``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor

_KNOWN_FROM = (2, 11)
_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

Handler = Callable[[torch._ops.OpOverload, tuple, dict], object]


def _handler_table() -> dict | None:
    """DTensor's handler dict, or None when this torch does not have it in the known form."""
    if _TORCH_VERSION < _KNOWN_FROM:
        return None
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    table = getattr(dispatcher, "_custom_op_handlers", None)
    return table if isinstance(table, dict) else None


HAS_OP_HANDLER_TABLE: bool = _handler_table() is not None


def current_handlers() -> dict:
    """A copy of DTensor's handler table (``{}`` when unavailable); for tests and debugging."""
    table = _handler_table()
    return dict(table) if table is not None else {}


@contextlib.contextmanager
def custom_op_handlers(handlers: Mapping[torch._ops.OpOverload, Handler]) -> Iterator[None]:
    """Install ``handlers`` in DTensor's handler table for the scope; restore it on exit.

    The table is updated in place (the dispatcher may hold a reference to it) and exactly the
    previous entries of the affected ops are restored, also when the body raises.

    Raises:
        RuntimeError: when this torch does not have the table in the known form.
    """
    table = _handler_table()
    if table is None:
        raise RuntimeError(
            f"torch {torch.__version__}: DTensor._op_dispatcher._custom_op_handlers is missing "
            "or changed, so dtensor_ring.ring_sdpa cannot route SDPA on DTensors to ring "
            "attention; dtensor_ring/_compat/dtensor.py needs an update for this version. "
            "dtensor_ring.scaled_dot_product_ring_attention (no private API) still works."
        )
    missing = object()
    saved = {op: table.get(op, missing) for op in handlers}
    table.update(handlers)
    try:
        yield
    finally:
        for op, previous in saved.items():
            if previous is missing:
                table.pop(op, None)
            else:
                table[op] = previous


def bind_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, object]:
    """``{argument name: value}`` of a call of ``op``, defaults filled in, from its schema."""
    bound: dict[str, object] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def return_names(op: torch._ops.OpOverload) -> list[str]:
    """Names of ``op``'s returns, from its schema (``""`` for unnamed ones)."""
    return [ret.name for ret in op._schema.returns]


def _spec_types() -> tuple | None:
    """``(DTensorSpec, TensorMeta, compute_global_tensor_info)``, or None when this torch lacks
    them or predates the known form."""
    if _TORCH_VERSION < _KNOWN_FROM:
        return None
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
    except ImportError:
        return None
    return DTensorSpec, TensorMeta, compute_global_tensor_info


_SPEC_TYPES = _spec_types()


@functools.lru_cache(maxsize=256)
def _global_spec(mesh, placements: tuple, shape: torch.Size, stride: tuple, dtype: torch.dtype):
    """The spec of a DTensor whose local shard has ``shape``, ``stride``, ``dtype`` (even
    shards, as ``from_local`` without ``shape=`` assumes); made once per such shard."""
    spec_cls, meta_cls, global_info = _SPEC_TYPES
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    global_shape, global_stride = global_info(meta, mesh, placements)
    tensor_meta = meta_cls(torch.Size(global_shape), tuple(global_stride), dtype)
    return spec_cls(mesh, placements, tensor_meta=tensor_meta)


def wrap_local(local: torch.Tensor, mesh, placements) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False)`` for code that runs
    below autograd (an ``autograd.Function``'s forward or backward): no autograd node of its
    own, and the spec made once per shard shape (``from_local`` spends ~25 us a call building
    both)."""
    if _SPEC_TYPES is None:
        return DTensor.from_local(local, mesh, placements, run_check=False)
    spec = _global_spec(mesh, tuple(placements), local.shape, local.stride(), local.dtype)
    return DTensor(local, spec, requires_grad=False)
