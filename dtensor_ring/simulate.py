"""Run the real ring engine of any rank of a W-rank ring on one device, without a process group.

A :class:`SimulatedExchanger` stands in for :class:`~dtensor_ring.comm.RingExchanger`: at each
step it hands the engine what the ring would deliver (built from the full tensors), and it can
record what the engine sends. Two uses:

* :class:`RankSimulator` times one rank at real sizes on one GPU (the slowest rank of a plan
  bounds the ring's speed when communication hides behind compute) -- see
  ``benchmarks/bench_single_gpu.py``;
* :func:`simulate_ring` runs every rank in turn and returns the full results, to check a
  schedule at real sizes on one device. Backward: each rank runs with an incoming dK/dV
  accumulator of zeros and the recorded sends are its own contributions to the visiting K/V;
  summing them per source rank gives dK/dV exactly (in another summation order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .engine import ring_backward, ring_forward
from .kernels import KernelCall, accumulation_dtype, select_kernel
from .layouts import shard_local, unshard_local
from .plan import make_plan


class _Delivered:
    def __init__(self, tensors: list[Tensor], zero: bool):
        self._tensors, self._zero = tensors, zero

    def wait(self) -> list[Tensor]:
        if self._zero:  # a fresh (zero) accumulator, as written by a receive
            for t in self._tensors:
                t.zero_()
        return self._tensors


class SimulatedExchanger:
    """Hands out ``deliveries[i]`` at the i-th exchange; optionally records clones of sends.

    ``zero=True`` zeroes a delivery when it is waited for (for dK/dV accumulators, which the
    engine adds to in place).
    """

    def __init__(self, deliveries: Sequence[list[Tensor]], record: bool = False,
                 zero: bool = False):
        self.deliveries = deliveries
        self.sent: list[list[Tensor]] | None = [] if record else None
        self._zero = zero
        self._count = 0

    def start(self, tensors: Sequence[Tensor]) -> _Delivered:
        """Pretend to send ``tensors``; the matching wait returns the next delivery."""
        if self.sent is not None:
            self.sent.append([t.clone() for t in tensors])
        delivered = self.deliveries[self._count % len(self.deliveries)]
        self._count += 1
        return _Delivered(delivered, self._zero)


class RankSimulator:
    """Rank ``rank`` of a ``world_size``-rank ring, on the device of the given full tensors.

    Args:
        q, k, v: FULL sequences, ``[B, S, H, D]`` / ``[B, S, H_kv, D]`` (S divisible as the
            layout needs).
        layout, world_size, rank, causal: the ring to simulate.
        backend: block kernel (None: automatic), scale: default ``D ** -0.5``.

    ``forward()`` and ``backward(dout_local)`` run the engine exactly as a real rank would;
    the dK/dV that arrive from the "previous rank" are zeros, so ``backward`` returns this
    rank's dq and its contributions to its own dK/dV only.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, *, layout: str, world_size: int,
                 rank: int, causal: bool = True, backend: str | None = None,
                 scale: float | None = None):
        self.plan = make_plan(layout, world_size, causal)
        self.rank, self.world_size = rank, world_size
        self.kernel = select_kernel(KernelCall.of(q, k), backend)
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        local = [[shard_local(t, layout, r, world_size) for t in (k, v)] for r in range(world_size)]
        self.q = shard_local(q, layout, rank, world_size)
        self.k, self.v = local[rank]
        steps = self.plan.steps[rank]
        # the K/V that arrive at the end of step s are those of step s + 1's source rank
        self.kv_deliveries = [local[st.src] for st in steps[1:]] or [local[rank]]
        acc = accumulation_dtype(q.dtype)
        self.dkv_buffers = [
            torch.zeros(t.shape, dtype=acc, device=t.device) for t in (self.k, self.v)
        ]
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    @property
    def steps(self):
        """This rank's row of the plan."""
        return self.plan.steps[self.rank]

    def forward(self) -> tuple[Tensor, Tensor]:
        """``(out_BSHD, lse_BHS)`` of this rank's local queries."""
        self.out, self.lse = ring_forward(
            self.q, self.k, self.v, self.steps, SimulatedExchanger(self.kv_deliveries),
            self.kernel, self.scale,
        )
        return self.out, self.lse

    def backward(self, dout: Tensor, record: bool = False):
        """Run the backward of this rank (after :meth:`forward`).

        Returns ``(dq, dk_own, dv_own, sent)`` where ``sent`` lists the recorded dK/dV sends
        (``record=True``), i.e. this rank's contributions to the K/V visiting at each step.
        """
        dkv_exchanger = SimulatedExchanger([self.dkv_buffers], record=record, zero=True)
        dq, dk, dv = ring_backward(
            dout, self.q, self.k, self.v, self.out, self.lse, self.steps,
            SimulatedExchanger(self.kv_deliveries), dkv_exchanger, self.kernel, self.scale,
        )
        return dq, dk, dv, dkv_exchanger.sent


def simulate_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor | None = None, *,
                  layout: str, world_size: int, causal: bool = True,
                  backend: str | None = None, scale: float | None = None):
    """Every rank of the ring in turn on one device; full-sequence results in token order.

    Args:
        q, k, v, dout: full ``[B, S, H(_kv), D]`` tensors (``dout`` optional).

    Returns:
        ``(out, lse)`` if ``dout`` is None, else ``(out, lse, dq, dk, dv)``; ``lse`` is
        ``[B, H, S]``.
    """
    sims = [RankSimulator(q, k, v, layout=layout, world_size=world_size, rank=r, causal=causal,
                          backend=backend, scale=scale) for r in range(world_size)]
    results = [sim.forward() for sim in sims]
    out = unshard_local([o for o, _ in results], layout, seq_dim=1)
    lse = unshard_local([lse for _, lse in results], layout, seq_dim=2)
    if dout is None:
        return out, lse
    acc = accumulation_dtype(q.dtype)
    dk_parts = [torch.zeros(sim.k.shape, dtype=acc, device=q.device) for sim in sims]
    dv_parts = [torch.zeros(sim.v.shape, dtype=acc, device=q.device) for sim in sims]
    dq_parts = []
    for r, sim in enumerate(sims):
        dq, dk, dv, sent = sim.backward(shard_local(dout, layout, r, world_size), record=True)
        dq_parts.append(dq)
        if world_size == 1:
            dk_parts[0] += dk
            dv_parts[0] += dv
            continue
        for step, (dk_s, dv_s) in zip(sim.steps, sent, strict=True):
            dk_parts[step.src] += dk_s
            dv_parts[step.src] += dv_s
    dq = unshard_local(dq_parts, layout, seq_dim=1)
    dk = unshard_local([d.to(k.dtype) for d in dk_parts], layout, seq_dim=1)
    dv = unshard_local([d.to(v.dtype) for d in dv_parts], layout, seq_dim=1)
    return out, lse, dq, dk, dv
