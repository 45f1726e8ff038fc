"""Point-to-point ring exchange: send tensors to the next rank, receive from the previous one.

The engine only ever asks "send these tensors one hop right and give me what arrives from the
left", so the communicator is small, and :mod:`dtensor_ring.simulate` can stand in for it on one
device. Receive buffers are allocated once per exchanger and reused (double buffering: the
buffers being sent are never the ones being received into).

On CUDA with NCCL, ``batch_isend_irecv`` runs the transfers on NCCL's own stream, so they overlap
the block kernels the engine launches on the compute stream between ``start`` and ``wait``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor


class PendingExchange:
    """Transfers in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, works: list, sent: list[Tensor], received: list[Tensor]):
        self._works = works
        self._sent = sent  # keeps contiguous copies alive until the sends complete
        self._received = received

    def wait(self) -> list[Tensor]:
        """Block until the transfers are done; return the received tensors."""
        for w in self._works:
            w.wait()
        return self._received


class RingExchanger:
    """Sends to rank ``(r + 1) % W`` and receives from rank ``(r - 1) % W`` of ``group``.

    Receive buffers are used in turn, so a tensor received at one step can be sent at the next
    while a new one arrives. The exchanger owns two sets of them shaped like the tensors it
    sends; with ``recycle_first=True`` it allocates one and takes the tensors of the first
    ``start`` as the second (the caller gives them up: e.g. the step-0 dK/dV accumulator,
    free once sent; never the caller's K/V, which autograd keeps).
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0, recycle_first: bool = False):
        self.group = group
        self.tag = tag
        self.recycle_first = recycle_first
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (rank + 1) % world)
        self._prev = dist.get_global_rank(group, (rank - 1) % world)
        self._buffers: list[list[Tensor]] = []
        self._turn = 0

    def _receive_buffers(self, sent: list[Tensor]) -> list[Tensor]:
        if not self._buffers:
            fresh = [t.new_empty(t.shape) for t in sent]
            second = sent if self.recycle_first else [t.new_empty(t.shape) for t in sent]
            self._buffers = [second, fresh]  # the first receive goes into `fresh`
        self._turn ^= 1
        return self._buffers[self._turn]

    def start(self, tensors: Sequence[Tensor]) -> PendingExchange:
        """Start sending ``tensors`` right and receiving their like from the left.

        Non-contiguous tensors (e.g. the k/v views of a packed kv) are sent as contiguous
        copies; the received tensors are always contiguous.
        """
        tensors = [t.contiguous() for t in tensors]
        received = self._receive_buffers(tensors)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, self.tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, self.tag) for t in received]
        return PendingExchange(dist.batch_isend_irecv(ops), tensors, received)


KV_TAG, DKV_TAG = 0, 1  # K/V and dK/dV transfers are in flight together in the backward


def backward_exchangers(group: dist.ProcessGroup) -> tuple[RingExchanger, RingExchanger]:
    """The backward's K/V exchanger and its dK/dV exchanger (which recycles the step-0
    accumulator as a receive buffer; Note [Ring backward] in ``engine.py``)."""
    return RingExchanger(group, KV_TAG), RingExchanger(group, DKV_TAG, recycle_first=True)
