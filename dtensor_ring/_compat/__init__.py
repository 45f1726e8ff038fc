"""The one place (with :mod:`dtensor_ring._compat.dtensor`) that touches private PyTorch APIs.

Import checks only the torch version (``>= 2.11``, :data:`MIN_TORCH`). Every private API is
resolved lazily, on first use, never at import: a torch build that lacks one loses only the
feature that needs it (with an error or a rejection reason naming the missing API and the torch
version), and ``import dtensor_ring`` keeps working.

* Process groups travel through custom ops by name (``group.group_name``); turning a name back
  into a group needs ``torch.distributed.distributed_c10d._resolve_process_group``, looked up
  by :func:`resolve_group` at each call (``RuntimeError`` when missing).
* Private aten ops (the fused attention kernels and SDPA's fused ops) are looked up by
  :func:`aten_op`, cached. The block-kernel backends report a missing op from
  ``is_available()`` (via :func:`missing_aten_ops`), so kernel selection skips them and says
  why; ``ring_sdpa`` installs handlers only for the SDPA op families this torch has.
* Whether a Python dispatch / function mode is active (``torch._C._len_torch_dispatch_stack``,
  ``torch._C._is_torch_function_mode_enabled``, torch 2.11-2.13): :func:`python_modes_active`,
  True when either is missing (the front doors then always take the custom op, Note [Eager
  calls] in ``ops/common.py``).
* DTensor's custom op handler table and ``OpOverload._schema``: :mod:`._compat.dtensor`
  (probed with ``getattr`` defaults, never raising at import; ``ring_sdpa`` raises without it).
* Where ``torch.utils.checkpoint`` keeps the function it recomputes (reentrant and not):
  :mod:`._compat.checkpoint` (checked on first use; ``context_parallel`` and ``ring_sdpa``
  raise without it, as they could not follow a recomputation: Note [Recomputation outside
  the scope]).
* Dynamo's per-code-object recompile limit (``torch._dynamo.config.recompile_limit``, torch
  2.6+; ``cache_size_limit`` before): :func:`recompile_limit` raises it for the duration of
  the flex blocks' compiled calls only (Note [Flex blocks on PyTorch's kernels]).
* Which arguments a FlexAttention ``mask_mod`` / ``score_mod`` reads, and which tensors:
  :func:`function_reads` traces it with ``make_fx`` under Dynamo's
  ``TransformGetItemToIndex`` (``torch._dynamo._trace_wrapped_higher_order_op``, torch
  2.11-2.13, the context flex's own ``create_block_mask`` evaluates masks in: ``t[b, q_idx]``
  on index tensors). Missing, or a function that does not trace: None; then a mask is not
  read as documents (Note [Document masks on the varlen kernels]) and the ranks compare the
  function's name only, not the data it reads (``api/flex.py``).
* PyTorch's LocalTensor simulation (``torch.distributed._local_tensor``, one process playing
  every rank, the rank a per-rank symbolic integer): :func:`for_each_simulated_rank` runs the
  sharding helpers once per simulated rank (without it, they run as written);
  :func:`refuse_simulated_ranks` is how the attention doors refuse to run inside it.

Every private aten op the library uses (:data:`PRIVATE_ATEN_OPS`; ``tests/test_compat.py``
asserts that each resolves, and that no module outside ``_compat/`` names one directly).
"Resolved on": ``2.13.0+cpu`` is this repository's CI build (``tests/test_compat.py``);
``2.11.0+cu130`` is the H200 on which the op ran (``tests/gpu/check_kernels.py`` for the
kernels, ``tests/gpu/check_dtensor.py`` for the SDPA handlers).

==========================================================  ====================  ============
``aten.`` op                                                used by               resolved on
==========================================================  ====================  ============
``_scaled_dot_product_flash_attention_for_cpu``             ``cpu_flash``,        2.13
                                                            ``ring_sdpa``
``_scaled_dot_product_flash_attention_for_cpu_backward``    ``cpu_flash``,        2.13
                                                            ``ring_sdpa``
``_flash_attention_forward``                                ``cuda_flash``        2.11, 2.13
``_flash_attention_backward``                               ``cuda_flash``        2.11, 2.13
``_scaled_dot_product_cudnn_attention``                     ``cudnn``,            2.11, 2.13
                                                            ``ring_sdpa``
``_scaled_dot_product_cudnn_attention_backward``            ``cudnn``,            2.11, 2.13
                                                            ``ring_sdpa``
``_scaled_dot_product_flash_attention``                     ``ring_sdpa``         2.11, 2.13
``_scaled_dot_product_flash_attention_backward``            ``ring_sdpa``         2.11, 2.13
``_scaled_dot_product_efficient_attention``                 ``ring_sdpa``         2.11, 2.13
``_scaled_dot_product_efficient_attention_backward``        ``ring_sdpa``         2.11, 2.13
==========================================================  ====================  ============
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

MIN_TORCH = (2, 11)

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    raise ImportError(
        f"dtensor_ring needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}"
    )

F = TypeVar("F", bound=Callable[..., object])

PRIVATE_ATEN_OPS: tuple[str, ...] = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
)


@functools.cache
def aten_op(name: str) -> torch._ops.OpOverloadPacket | None:
    """``torch.ops.aten.<name>``, or ``None`` when this torch lacks it (looked up once).

    Raises:
        ValueError: if ``name`` is not in :data:`PRIVATE_ATEN_OPS` (keep the table complete).
    """
    if name not in PRIVATE_ATEN_OPS:
        raise ValueError(f"aten.{name} is not listed in dtensor_ring._compat.PRIVATE_ATEN_OPS")
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def missing_aten_ops(*names: str) -> str | None:
    """``None`` when this torch has all the ops ``names``, else a reason naming the first
    missing one (what a kernel's ``is_available()`` reports)."""
    for name in names:
        if aten_op(name) is None:
            return (
                f"torch {torch.__version__} lacks aten.{name} "
                "(dtensor_ring/_compat/__init__.py lists the private ops it needs)"
            )
    return None


def require_aten_op(name: str) -> torch._ops.OpOverloadPacket:
    """``torch.ops.aten.<name>``; ``RuntimeError`` naming the op and torch version if missing."""
    op = aten_op(name)
    if op is None:
        raise RuntimeError(missing_aten_ops(name))
    return op


def group_name(group: dist.ProcessGroup | None) -> str:
    """The registered name of ``group`` (None: the default group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call dist.init_process_group() (e.g. under "
            "torchrun) before ring attention, or pass group= explicitly"
        )
    return (group if group is not None else dist.group.WORLD).group_name


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name``.

    Raises:
        RuntimeError: when this torch lacks ``_resolve_process_group`` (looked up per call).
    """
    resolve = getattr(_c10d, "_resolve_process_group", None)
    if resolve is None:
        raise RuntimeError(
            "torch.distributed.distributed_c10d._resolve_process_group is missing from torch "
            f"{torch.__version__}; dtensor_ring/_compat/__init__.py must be updated for this "
            "version (ring attention needs it to find the process group of a custom op call)"
        )
    return resolve(name)


def python_modes_active() -> bool:
    """Whether a Python ``TorchDispatchMode`` or ``TorchFunctionMode`` is active (private:
    ``torch._C._len_torch_dispatch_stack`` and ``torch._C._is_torch_function_mode_enabled``,
    torch 2.11-2.13). True when either is missing: callers then take the general path."""
    dispatch = getattr(torch._C, "_len_torch_dispatch_stack", None)
    function = getattr(torch._C, "_is_torch_function_mode_enabled", None)
    if dispatch is None or function is None:
        return True
    return dispatch() > 0 or function()


def recompile_limit(limit: int):
    """A context in which Dynamo recompiles a function up to ``limit`` times (its private
    config, patched for the context only; the attribute's name by torch version)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if not hasattr(config, name):
        raise RuntimeError(f"torch {torch.__version__} has no torch._dynamo.config.{name}")
    return config.patch(**{name: max(limit, getattr(config, name))})


def for_each_simulated_rank(fn: F) -> F:
    """``fn`` run once per rank under PyTorch's LocalTensor simulation (one process simulating
    every rank; ``torch.distributed._local_tensor.maybe_run_for_local_tensor``, torch 2.10+):
    the rank argument is then a per-rank integer and the results are combined per rank.
    Outside that mode, or on a torch without it, ``fn`` itself."""
    try:
        from torch.distributed._local_tensor import maybe_run_for_local_tensor
    except ImportError:
        return fn
    return maybe_run_for_local_tensor(fn)


@functools.cache
def _local_tensor_mode_probe() -> Callable[[], object] | None:
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return None
    return enabled_local_tensor_mode


def refuse_simulated_ranks() -> None:
    """Raise inside PyTorch's LocalTensor simulation: one process plays every rank there, but
    the ring's plans, sends and receives are per rank, and every simulated rank would compute
    as the process's own rank (silently wrong). The sharding helpers do run inside it. Traced
    code skips the check (Dynamo would trace the cached probe, and warn about its cache)."""
    if torch.compiler.is_compiling():
        return
    probe = _local_tensor_mode_probe()
    if probe is not None and probe() is not None:
        raise NotImplementedError(
            "dtensor_ring's attention does not run under PyTorch's LocalTensorMode (one process "
            "simulating every rank: the ring's point-to-point steps are per rank); run real "
            "ranks (e.g. gloo on CPU). context_parallel_shard does work inside it"
        )


_READS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def function_reads(fn: Callable, names: tuple[str, ...]) -> tuple[frozenset, tuple, str] | None:
    """``(arguments, tensors, code)``: which of its arguments (called ``names``: ``("b", "h",
    "q_idx", "kv_idx")`` for a FlexAttention ``mask_mod``, ``("score", ...)`` first for a
    ``score_mod``) the function reads, the tensors it reads (closures, globals, attributes:
    the traced graph's constants, the objects themselves) and the traced graph's code (its
    operations and Python constants, e.g. a softcap's); None when it does not trace
    (data-dependent Python control flow) or this torch lacks the tracing context. Traced once
    per function object (the tensors' contents are read by the caller); a failure inside a
    Python dispatch or function mode is not remembered (the mode may have caused it)."""
    try:
        return _READS_CACHE[fn]
    except (KeyError, TypeError):  # not traced yet, or not weakly referenceable
        pass
    reads = _trace_reads(fn, names)
    if reads is None and python_modes_active():
        return None  # perhaps the mode's doing (a FakeTensorMode): try again outside it
    try:
        _READS_CACHE[fn] = reads
    except TypeError:
        pass
    return reads


def _trace_reads(fn: Callable, names: tuple[str, ...]) -> tuple[frozenset, tuple, str] | None:
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        from torch.fx.experimental.proxy_tensor import make_fx
    except ImportError:
        return None
    args = [  # distinct tensors: make_fx would trace one object passed twice as one input
        torch.zeros((), dtype=torch.float32 if name == "score" else torch.int32) for name in names
    ]
    try:
        with TransformGetItemToIndex():
            graph = make_fx(fn)(*args)
    except Exception:  # noqa: BLE001 - any failure to trace: not readable
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    used = frozenset(name for name, n in zip(names, placeholders, strict=True) if n.users)
    constants = tuple(
        t
        for n in graph.graph.nodes
        if n.op == "get_attr" and isinstance(t := getattr(graph, n.target), torch.Tensor)
    )
    return used, constants, graph.code
