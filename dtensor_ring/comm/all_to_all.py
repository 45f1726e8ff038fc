"""The all-to-alls: Ulysses attention's (Note [Ulysses attention] in ``ops/ulysses.py``) and
the uneven rows of placed documents' gather (Note [Gathering what placed documents need])."""

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


class RowsAllToAll:
    """Uneven rows to every rank of ``group`` (Note [Gathering what placed documents need] in
    ``engine/placed_gather.py``): ``send_splits[j]`` rows go to rank j, ``recv_splits[j]``
    arrive from it; ``op`` names its failures (Note [Faults] in ``faults.py``)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        send_splits: tuple[int, ...],
        recv_splits: tuple[int, ...],
        op: str,
    ):
        self.group, self.send_splits, self.recv_splits, self.op = (
            group,
            list(send_splits),
            list(recv_splits),
            op,
        )

    def start(self, rows: Tensor) -> _Received:
        """Start sending ``rows [S, ...]`` (destinations in rank order); ``.wait()`` gives
        the received ``[R, ...]`` (sources in rank order)."""
        rows = rows.contiguous()
        recv = rows.new_empty(sum(self.recv_splits), *rows.shape[1:])
        with CommSite(self.op, self.group):
            work = dist.all_to_all_single(
                recv, rows, self.recv_splits, self.send_splits, group=self.group, async_op=True
            )
        return _Received(work, recv, rows, CommSite(self.op, self.group))


class _Received:
    """An all-to-all in flight; holds its input until :meth:`wait` (allocator safety)."""

    def __init__(self, work, recv: Tensor, sent: Tensor, site: CommSite):
        self._work, self._recv, self._sent, self._site = work, recv, sent, site

    def wait(self) -> Tensor:
        with self._site:
            self._work.wait()
        self._sent = None
        return self._recv
