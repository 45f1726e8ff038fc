"""Point-to-point exchange of K/V and dK/dV between the ranks of a ring.

The engine only ever asks "send these tensors on and give me what arrives for the next step",
so the communicator is small, and the simulator (``simulate.py``) can stand in for it on one
device. Receive buffers are allocated once per exchanger and reused (double buffering: the
buffers being sent are never the ones being received into).

On CUDA with NCCL, ``batch_isend_irecv`` runs the transfers on NCCL's own stream, so they overlap
the block kernels the engine launches on the compute stream between ``start`` and ``wait``.

Note [Direct exchange]
~~~~~~~~~~~~~~~~~~~~~~
A windowed plan may skip steps (Note [Windowed schedules] in ``schedule/plan.py``): zigzag
under a small window needs only offsets {0, 1, W-1}. K/V passed hop by hop would still have
to visit every rank in between, so a sparse plan sends them straight to where they are needed,
and the gradients straight back:

    step with offset o, rank r:   K/V:   own K/V  -> r + o        K/V of r - o   <- r - o
                                  dK/dV: grads for r - o -> r - o  own share <- r + o

Each step moves one K/V chunk per rank, as a ring hop does (the volume is the same; the peers
are farther apart). The owner sums the dK/dV shares it receives; full plans keep the ring and
its travelling accumulators (Note [Ring backward] in ``engine/ring.py``).

A step some ranks need and others do not (a window's edge: under a causal window rank 0 needs
nothing of rank W - 1, whose K/V come after its queries) moves nothing between the pairs that
do not need it: rank r receives K/V at step i only if its plan row has blocks there, sends its
own to r + o only if that rank's row has, and the dK/dV go back only where blocks ran. Every
rank reads this from the plan, which every rank holds whole, so sender and receiver agree
without a word:

    offsets (0, 1), causal window, W = 4:   step 1   rank 0 <- 3: no blocks: no transfer
                                                     rank 1 <- 0, 2 <- 1, 3 <- 2: K/V, dK/dV

Every launch and wait runs inside a :class:`~dtensor_ring.comm.faults.CommSite` (Note [Faults]
in ``faults.py``): a rank that died or stopped calling makes the others raise an error naming
the exchange, its step and the peers. Step ``k of n`` counts the plan's steps from 1 and names
the step the data belongs to: the K/V used in step k, the dK/dV computed in step k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from ..schedule.plan import Plan
from .faults import CommSite


class PendingExchange:
    """Transfers in flight; :meth:`wait` returns the received tensors (None: nothing is
    received at this step, Note [Direct exchange])."""

    def __init__(
        self, works: list, sent: list[Tensor], received: list[Tensor] | None, site: CommSite
    ):
        self._works = works
        self._sent = sent  # keeps contiguous copies alive until the sends complete
        self._received = received
        self._site = site

    def wait(self) -> list[Tensor] | None:
        """Block until the transfers are done; return the received tensors.

        Raises:
            RuntimeError: a transfer failed, e.g. a peer died or stopped calling and the process
                group's timeout ran out (Note [Faults]).
        """
        with self._site:
            for w in self._works:
                w.wait()
        return self._received


class _PeerExchanger:
    """Transfers to/from peers of ``group`` with reused, double-buffered receive buffers.

    Receive buffers are used in turn, so a tensor received at one step can be sent at the next
    while a new one arrives. The exchanger owns two sets of them shaped like the tensors it
    sends; with ``recycle_first=True`` it allocates one and takes the tensors of the first
    ``start`` as the second (the caller gives them up: e.g. the step-0 dK/dV accumulator,
    free once sent; never the caller's K/V, which autograd keeps).

    ``op`` names the exchange in errors, ``steps`` is the plan's number of steps and
    ``first_step`` the step (from 0) whose data the first ``start`` moves.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        tag: int,
        op: str,
        steps: int,
        *,
        first_step: int = 1,
        recycle_first: bool = False,
    ):
        self.group = group
        self.tag = tag
        self.op, self.steps, self.first_step = op, steps, first_step
        self.recycle_first = recycle_first
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._buffers: list[list[Tensor]] = []
        self._turn = 0
        self._count = 0  # starts so far

    def _global(self, hops: int) -> int:
        """Global rank of the group rank ``hops`` to the right of this one."""
        return dist.get_global_rank(self.group, (self.rank + hops) % self.world_size)

    def _receive_buffers(self, sent: list[Tensor]) -> list[Tensor]:
        if not self._buffers:
            fresh = [t.new_empty(t.shape) for t in sent]
            second = sent if self.recycle_first else [t.new_empty(t.shape) for t in sent]
            self._buffers = [second, fresh]  # the first receive goes into `fresh`
        self._turn ^= 1
        return self._buffers[self._turn]

    def _transfer(
        self, tensors: Sequence[Tensor], send_to: int | None, recv_from: int | None, like=None
    ):
        """Send ``tensors`` to global rank ``send_to``, receive their like (shaped as ``like``
        where nothing is sent) from ``recv_from``; None: no send, no receive.

        Non-contiguous tensors (e.g. the k/v views of a packed kv) are sent as contiguous
        copies; the received tensors are always contiguous.
        """
        tensors = [] if send_to is None else [t.contiguous() for t in tensors]
        received = None if recv_from is None else self._receive_buffers(tensors or like)
        ops = [dist.P2POp(dist.isend, t, send_to, self.group, self.tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, recv_from, self.group, self.tag) for t in received or ()]
        step = (self.first_step + self._count + 1, self.steps)
        site = CommSite(self.op, self.group, step, (send_to, recv_from))
        self._count += 1
        with site:  # gloo raises here at once when a peer's connection is closed
            works = dist.batch_isend_irecv(ops) if ops else []
        return PendingExchange(works, tensors, received, site)


class RingExchanger(_PeerExchanger):
    """Sends to rank ``(r + 1) % W`` and receives from rank ``(r - 1) % W`` of ``group``."""

    direct = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        tag: int,
        op: str,
        steps: int,
        *,
        first_step: int = 1,
        recycle_first: bool = False,
    ):
        super().__init__(group, tag, op, steps, first_step=first_step, recycle_first=recycle_first)
        self._next, self._prev = self._global(1), self._global(-1)

    def start(self, tensors: Sequence[Tensor]) -> PendingExchange:
        """Start sending ``tensors`` right and receiving their like from the left."""
        return self._transfer(tensors, self._next, self._prev)


class DirectExchanger(_PeerExchanger):
    """Exchanges with the rank each step of a plan needs (Note [Direct exchange]).

    K/V (``to_source=False``): the i-th ``start`` sends the tensors of the *first* ``start``
    (this rank's own K/V) to rank ``r + offsets[i + 1]`` and receives those of rank
    ``r - offsets[i + 1]``. dK/dV (``to_source=True``): the i-th ``start`` sends the given
    tensors (the gradient for the K/V of step i + 1) back to their owner ``r - offsets[i + 1]``
    and receives this rank's share from rank ``r + offsets[i + 1]``. Only where the receiving
    side's row of ``plan`` has blocks at that step (K/V), or the sending side's (dK/dV): the
    others send or receive nothing (the received tensors are then None), and dK/dV ``start``
    may be given None where this rank's row has none.
    """

    direct = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        plan: Plan,
        tag: int,
        op: str,
        *,
        to_source: bool = False,
    ):
        super().__init__(group, tag, op, len(plan.offsets))
        r, W = self.rank, self.world_size

        def runs(rank: int, i: int) -> bool:  # rank's row of the plan has blocks at step i
            return bool(plan.steps[rank % W][i].blocks)

        self._peers = []
        for i, o in enumerate(plan.offsets[1:], start=1):
            ours, theirs = runs(r, i), runs(r + o, i)  # we use r - o's K/V; r + o uses ours
            if to_source:  # our share back to r - o; r + o's share of our K/V to us
                peers = (-o if ours else None, o if theirs else None)
            else:  # our K/V to r + o; r - o's K/V to us
                peers = (o if theirs else None, -o if ours else None)
            self._peers.append(tuple(None if h is None else self._global(h) for h in peers))
        self._to_source = to_source
        self._own: list[Tensor] | None = None

    def start(
        self, tensors: Sequence[Tensor] | None, like: Sequence[Tensor] | None = None
    ) -> PendingExchange:
        """Start the exchange of the next step (see the class doc); ``like`` shapes what is
        received where ``tensors`` is None (dK/dV)."""
        if not self._to_source:
            if self._own is None:
                self._own = [t.contiguous() for t in tensors]
            tensors = like = self._own
        send_to, recv_from = self._peers[self._count]
        if send_to is not None and tensors is None:
            raise RuntimeError(f"{self.op}: no tensors to send at a step the plan runs")
        return self._transfer(tensors, send_to, recv_from, like=like or tensors)


KV_TAG, DKV_TAG = 0, 1  # K/V and dK/dV transfers are in flight together in the backward


def forward_exchanger(group: dist.ProcessGroup, plan: Plan) -> RingExchanger | DirectExchanger:
    """The forward's K/V exchanger for ``plan`` (ring hops, or direct for a sparse plan)."""
    if plan.full_ring:
        return RingExchanger(group, KV_TAG, _op("forward", "ring", "K/V"), len(plan.offsets))
    return DirectExchanger(group, plan, KV_TAG, _op("forward", "direct", "K/V"))


def backward_exchangers(group: dist.ProcessGroup, plan: Plan):
    """The backward's K/V exchanger and its dK/dV exchanger for ``plan``.

    Full ring: the dK/dV accumulators travel with their K/V, and the step-0 accumulator is
    recycled as a receive buffer (Note [Ring backward] in ``engine/ring.py``). Sparse plan: each
    step's dK/dV go straight back to their owner (Note [Direct exchange]).
    """
    if plan.full_ring:
        n = len(plan.offsets)
        return (
            RingExchanger(group, KV_TAG, _op("backward", "ring", "K/V"), n),
            # the i-th start sends the accumulator of step i (Note [Ring backward])
            RingExchanger(
                group,
                DKV_TAG,
                _op("backward", "ring", "dK/dV"),
                n,
                first_step=0,
                recycle_first=True,
            ),
        )
    return (
        DirectExchanger(group, plan, KV_TAG, _op("backward", "direct", "K/V")),
        DirectExchanger(group, plan, DKV_TAG, _op("backward", "direct", "dK/dV"), to_source=True),
    )


def _op(direction: str, kind: str, what: str) -> str:
    return f"ring attention {direction}, {kind} exchange of {what}"
