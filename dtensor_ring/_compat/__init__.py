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
