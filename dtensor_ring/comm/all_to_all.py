"""The all-to-all of Ulysses attention (Note [Ulysses attention] in ``ops/ulysses.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .faults import CommSite


def all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``scatter_dim`` into W chunks (chunk j to rank j); concatenate the received chunks
    along ``gather_dim`` in rank order.

    Raises:
        RuntimeError: the all-to-all failed, e.g. a rank of ``group`` died or stopped calling
            (Note [Faults] in ``faults.py``).
    """
    W = dist.get_world_size(group)
    n = x.shape[scatter_dim] // W
    send = x.unflatten(scatter_dim, (W, n)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    with CommSite("Ulysses all-to-all", group):
        dist.all_to_all_single(recv, send, group=group)
    # recv[i]: rank i's chunk for us, shape x.shape with scatter_dim reduced to n.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
