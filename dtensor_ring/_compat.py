"""The one place that touches private PyTorch APIs, each behind a version check.

Process groups travel through custom ops by name (``group.group_name``); turning a name back
into a group needs ``torch.distributed.distributed_c10d._resolve_process_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

MIN_TORCH = (2, 11)

if tuple(int(x) for x in torch.__version__.split(".")[:2]) < MIN_TORCH:
    raise ImportError(
        f"dtensor_ring needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}"
    )
if not hasattr(_c10d, "_resolve_process_group"):
    raise ImportError(
        "torch.distributed.distributed_c10d._resolve_process_group is missing from torch "
        f"{torch.__version__}; dtensor_ring/_compat.py must be updated for this version"
    )


def group_name(group: dist.ProcessGroup | None) -> str:
    """The registered name of ``group`` (None: the default group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call dist.init_process_group() (e.g. under "
            "torchrun) before ring attention, or pass group= explicitly"
        )
    return (group if group is not None else dist.group.WORLD).group_name


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name``."""
    return _c10d._resolve_process_group(name)


@torch.compiler.assume_constant_result
def _select_backend_name(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    deterministic: bool,
    backend: str | None,
    window: bool = False,
) -> str:
    from .kernels import KernelCall, select_kernel

    call = KernelCall(
        device_type,
        dtype,
        head_dim,
        num_heads,
        num_kv_heads,
        deterministic=deterministic,
        window=window,
    )
    return select_kernel(call, backend).name


def select_backend_name(
    q: torch.Tensor,
    k: torch.Tensor,
    backend: str | None,
    *,
    deterministic: bool = False,
    window: bool = False,
) -> str:
    """Name of the block kernel for ``q [..., H, D]`` and ``k [..., H_kv, D]`` (see select_kernel).

    Front doors resolve the kernel before calling the op, so that an unsupported call raises
    on every rank before any communication. Under ``torch.compile`` the choice is made once at
    trace time and baked into the graph as a constant (``torch.compiler.
    assume_constant_result``): backends' availability probes (``torch.backends.cudnn.
    is_available()``, imports) are not traceable by Dynamo and would break the graph.
    """
    return _select_backend_name(
        q.device.type,
        q.dtype,
        int(q.shape[-1]),
        int(q.shape[-2]),
        int(k.shape[-2]),
        bool(deterministic),
        backend,
        bool(window),
    )
