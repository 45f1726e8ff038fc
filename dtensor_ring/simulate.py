"""Run the real ring engine of any rank of a W-rank ring on one device, without a process group.

A :class:`SimulatedExchanger` stands in for :class:`~dtensor_ring.comm.p2p.RingExchanger`: at each
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

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .engine.blocks import FlexBlocks
from .engine.placed_gather import placed_backward, placed_forward
from .engine.ring import ring_backward, ring_forward
from .engine.varlen_blocks import varlen_blocks
from .kernels import KernelCall, accumulation_dtype, select_flex_kernel, select_kernel
from .kernels.flex import FlexMods
from .layouts import Layout, get_layout, shard_local, shard_varlen, unshard_local, unshard_varlen
from .layouts.documents import DocumentLayout
from .layouts.varlen import varlen_local_cu_seqlens
from .resolve import normalize_window
from .schedule.flex import VisibleBlocks, flex_plan
from .schedule.placed_gather import placed_gather
from .schedule.plan import make_plan
from .schedule.varlen import varlen_plan


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
    engine adds to in place); ``direct`` mirrors the real exchanger of the plan
    (:func:`~dtensor_ring.comm.p2p.backward_exchangers`).
    """

    def __init__(
        self,
        deliveries: Sequence[list[Tensor]],
        record: bool = False,
        zero: bool = False,
        direct: bool = False,
    ):
        self.deliveries = deliveries
        self.direct = direct  # as DirectExchanger: dK/dV shares go back to their owner
        self.sent: list[list[Tensor] | None] | None = [] if record else None
        self._zero = zero
        self._count = 0

    def start(self, tensors: Sequence[Tensor] | None, like=None) -> _Delivered:
        """Pretend to send ``tensors`` (None: nothing, a step without blocks); the matching
        wait returns the next delivery."""
        if self.sent is not None:
            self.sent.append(None if tensors is None else [t.clone() for t in tensors])
        delivered = self.deliveries[self._count % len(self.deliveries)]
        self._count += 1
        return _Delivered(delivered, self._zero)


class _Sequence:
    """How full tensors split into rank parts and back: dense ``[B, S, ...]`` or packed varlen
    ``[T, ...]`` with global ``cu_seqlens``."""

    def __init__(self, layout: str | Layout, world_size: int, cu_seqlens: Sequence[int] | None):
        self.layout, self.world_size, self.cu_seqlens = layout, world_size, cu_seqlens
        self.seq_dim = 1 if cu_seqlens is None else 0  # of q/k/v/out
        self.lse_seq_dim = 2 if cu_seqlens is None else 1  # lse [B, H, S] or [H, T]

    def shard(self, full: Tensor, rank: int) -> Tensor:
        if self.cu_seqlens is None:
            return shard_local(full, self.layout, rank, self.world_size)
        return shard_varlen(full, self.cu_seqlens, self.layout, rank, self.world_size)[0]

    def unshard(self, parts: Sequence[Tensor], seq_dim: int) -> Tensor:
        if self.cu_seqlens is None:
            return unshard_local(parts, self.layout, seq_dim)
        return unshard_varlen(parts, self.cu_seqlens, self.layout, seq_dim)

    def plan_and_blocks(
        self,
        causal: bool,
        window: tuple[int, int] | None,
        tokens: int,
        device: torch.device,
        rank: int,
    ):
        """The plan and ``rank``'s :class:`~dtensor_ring.engine.blocks.Blocks` (None: dense
        default) for ``tokens`` tokens in all; ``window`` normalised."""
        W = self.world_size
        if self.cu_seqlens is None:
            return make_plan(self.layout, W, causal, window, tokens // W), None
        local = tuple(varlen_local_cu_seqlens(self.cu_seqlens, self.layout, rank, W).tolist())
        plan = varlen_plan(local, self.layout, W, causal, window)
        return plan, varlen_blocks(plan, local, device)


def _flex_plan_and_blocks(layout, world_size, tokens, block_mask, score_mod, kernel):
    """The plan and :class:`~dtensor_ring.engine.blocks.FlexBlocks` of a FlexAttention call."""
    if block_mask is None:
        visible = VisibleBlocks(tokens, tokens, tokens, torch.ones(1, 1, dtype=torch.bool))
        mods = FlexMods(score_mod)
    else:
        visible = VisibleBlocks.of_block_mask(block_mask)
        mods = FlexMods(score_mod, block_mask.mask_mod, block_mask)
    n = tokens // world_size
    plan = flex_plan(layout, world_size, n, visible, trim=kernel.trims)
    return plan, FlexBlocks(n, mods)


class RankSimulator:
    """Rank ``rank`` of a ``world_size``-rank ring, on the device of the given full tensors.

    Args:
        q, k, v: FULL sequences, ``[B, S, H, D]`` / ``[B, S, H_kv, D]`` (S divisible as the
            layout needs); with ``cu_seqlens``, packed ``[T, H, D]`` / ``[T, H_kv, D]``.
        layout, world_size, rank, causal: the ring to simulate.
        backend: block kernel (None: automatic), scale: default ``D ** -0.5``.
        cu_seqlens: global document boundaries of packed inputs (ring / zigzag varlen,
            docs/varlen.md); None for dense inputs.
        window_size: flash-attn sliding window ``(left, right)`` (varlen: within documents).
        block_mask, score_mod: a FlexAttention call instead (docs/flex.md): the global
            ``BlockMask`` and ``score_mod`` of :func:`dtensor_ring.flex_attention` (``causal``
            and ``window_size`` then unused; ``layout`` may be a layout object, e.g.
            :func:`dtensor_ring.flex_layout`'s; ``backend`` a flex kernel name).

    ``forward()`` and ``backward(dout_local)`` run the engine exactly as a real rank would;
    the dK/dV that arrive from the "previous rank" are zeros, so ``backward`` returns this
    rank's dq and its contributions to its own dK/dV only.
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        layout: str | Layout,
        world_size: int,
        rank: int,
        causal: bool = True,
        backend: str | None = None,
        scale: float | None = None,
        cu_seqlens: Sequence[int] | None = None,
        window_size: tuple[int, int] = (-1, -1),
        block_mask: BlockMask | None = None,
        score_mod: Callable | None = None,
    ):
        self.rank, self.world_size = rank, world_size
        self.sequence = _Sequence(layout, world_size, cu_seqlens)
        tokens = q.shape[self.sequence.seq_dim]
        if block_mask is not None or score_mod is not None:
            self.kernel = select_flex_kernel(q.device, q.dtype, backend)
            self.plan, self.blocks = _flex_plan_and_blocks(
                get_layout(layout, "dense"), world_size, tokens, block_mask, score_mod,
                self.kernel,
            )  # fmt: skip
        else:
            causal, window = normalize_window(window_size, causal, tokens)
            self.plan, self.blocks = self.sequence.plan_and_blocks(
                causal, window, tokens, q.device, rank
            )
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        local = [[self.sequence.shard(t, r) for t in (k, v)] for r in range(world_size)]
        self.q = self.sequence.shard(q, rank)
        self.k, self.v = local[rank]
        if block_mask is None and score_mod is None:  # chosen on the shards, as a rank does
            call = KernelCall.of(
                self.q, self.k, varlen=cu_seqlens is not None, window=window is not None
            )
            self.kernel = select_kernel(call, backend)
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
            self.q,
            self.k,
            self.v,
            self.steps,
            SimulatedExchanger(self.kv_deliveries),
            self.kernel,
            self.scale,
            self.blocks,
        )
        return self.out, self.lse

    def backward(self, dout: Tensor, record: bool = False):
        """Run the backward of this rank (after :meth:`forward`).

        Returns ``(dq, dk_own, dv_own, sent)`` where ``sent`` lists the recorded dK/dV sends
        (``record=True``), i.e. this rank's contributions to the K/V visiting at each step
        (a sparse plan sends none at step 0: that share stays in ``dk_own, dv_own``, then in
        the accumulation dtype, to be summed with the other ranks' shares and rounded once, as
        the owner does).
        """
        dkv_exchanger = SimulatedExchanger(
            [self.dkv_buffers], record=record, zero=True, direct=not self.plan.full_ring
        )
        dq, dk, dv = ring_backward(
            dout,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            self.steps,
            SimulatedExchanger(self.kv_deliveries),
            dkv_exchanger,
            self.kernel,
            self.scale,
            self.blocks,
            round_dkv=not record,
        )
        return dq, dk, dv, dkv_exchanger.sent


class _Rows:
    """A :class:`~dtensor_ring.engine.placed_gather.RowExchange` on one device: hands out
    ``delivered`` (an int ``n``: ``n`` rows of zeros shaped as what was sent, for the other
    ranks' dK/dV shares), keeps what was sent last."""

    def __init__(self, delivered: Tensor | int):
        self.delivered, self.sent = delivered, None

    def start(self, rows: Tensor) -> _Rows:
        self.sent = rows
        return self

    def wait(self) -> Tensor:
        if isinstance(self.delivered, int):
            return self.sent.new_zeros(self.delivered, *self.sent.shape[1:])
        return self.delivered


class GatherSimulator:
    """Rank ``rank`` of placed documents' all-gather (Note [Gathering what placed documents
    need]) on the device of the given full packed tensors ``q [T, H, D]``, ``k, v [T, H_kv,
    D]``: ``layout`` a :class:`~dtensor_ring.layouts.documents.DocumentLayout` of the global
    ``cu_seqlens``, the others as :class:`RankSimulator`'s. Every KV head at once (the
    default of ``ring_varlen_attention_func``); the other ranks' dK/dV shares arrive as
    zeros."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        layout: DocumentLayout,
        world_size: int,
        rank: int,
        cu_seqlens: Sequence[int],
        causal: bool = True,
        backend: str | None = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
    ):
        causal, window = normalize_window(window_size, causal, q.shape[0])
        shards = [  # every rank's K/V: what each sends this one
            [shard_varlen(t, cu_seqlens, layout, r, world_size)[0] for t in (k, v)]
            for r in range(world_size)
        ]
        self.q = shard_varlen(q, cu_seqlens, layout, rank, world_size)[0]
        self.k, self.v = shards[rank]
        metas = [placed_gather(layout, causal, window, r, q.device) for r in range(world_size)]
        self.meta = metas[rank]
        received = []
        for src, m in enumerate(metas):  # what each rank sends this one
            first = sum(m.send_splits[:rank])
            rows = m.send_rows[first : first + m.send_splits[rank]]
            k_src, v_src = shards[src]
            received.append(torch.stack([k_src[rows], v_src[rows]], 1))
        self.received = torch.cat(received)
        self.kernel = select_kernel(
            KernelCall.of(self.q, self.k, varlen=True, window=window is not None), backend
        )
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def forward(self) -> tuple[Tensor, Tensor]:
        """``(out [T_local, H, D], lse [H, T_local])`` of this rank's queries."""
        exchange = _Rows(self.received)
        self.out, self.lse = placed_forward(
            self.q, self.k, self.v, self.meta, self.k.shape[1], exchange, self.kernel, self.scale
        )
        return self.out, self.lse

    def backward(self, dout: Tensor, round_dkv: bool = True):
        """``(dq, dk, dv, shares)`` of this rank (after :meth:`forward`): dK/dV without other
        ranks' shares (``round_dkv=False``: in the accumulation dtype), and this rank's shares
        of the rows it fetched (``[R, 2, H_kv, D]`` in the accumulation dtype, sources in rank
        order as ``meta.recv_splits``; None when no rank fetches)."""
        back = _Rows(len(self.meta.send_rows))
        dq, dk, dv = placed_backward(
            dout, self.q, self.k, self.v, self.out, self.lse, self.meta, self.k.shape[1],
            _Rows(self.received), back, self.kernel, self.scale, round_dkv=round_dkv,
        )  # fmt: skip
        return dq, dk, dv, back.sent


def simulate_gather(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor | None = None,
    *,
    layout: DocumentLayout,
    world_size: int,
    cu_seqlens: Sequence[int],
    causal: bool = True,
    backend: str | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
):
    """Every rank of placed documents' all-gather (:class:`GatherSimulator`) in turn on one
    device; full packed results in token order: ``(out [T, H, D], lse [H, T])``, with ``dout``
    also ``(dq, dk, dv)``, each rank's dK/dV summed with the shares the others return to it in
    the accumulation dtype and rounded once, as the owner does."""
    sims = [
        GatherSimulator(
            q,
            k,
            v,
            layout=layout,
            world_size=world_size,
            rank=r,
            cu_seqlens=cu_seqlens,
            causal=causal,
            backend=backend,
            scale=scale,
            window_size=window_size,
        )  # fmt: skip
        for r in range(world_size)
    ]
    seq = _Sequence(layout, world_size, cu_seqlens)
    results = [sim.forward() for sim in sims]
    out = seq.unshard([o for o, _ in results], 0)
    lse = seq.unshard([lse for _, lse in results], 1)
    if dout is None:
        return out, lse
    grads = [sim.backward(seq.shard(dout, r), round_dkv=False) for r, sim in enumerate(sims)]
    dkv = [
        [g[1].to(accumulation_dtype(q.dtype)), g[2].to(accumulation_dtype(q.dtype))] for g in grads
    ]
    for r, sim in enumerate(sims):  # the shares of rank r's fetched rows, to their owners
        first = 0
        for src, n in enumerate(sim.meta.recv_splits if grads[r][3] is not None else ()):
            owner = sims[src].meta
            start = sum(owner.send_splits[:r])
            rows = owner.send_rows[start : start + n]
            for i in range(2):
                dkv[src][i].index_add_(0, rows, grads[r][3][first : first + n, i])
            first += n
    dq = seq.unshard([g[0] for g in grads], 0)
    dk = seq.unshard([d[0].to(k.dtype) for d in dkv], 0)
    dv = seq.unshard([d[1].to(v.dtype) for d in dkv], 0)
    return out, lse, dq, dk, dv


def simulate_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor | None = None,
    *,
    layout: str | Layout,
    world_size: int,
    causal: bool = True,
    backend: str | None = None,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    window_size: tuple[int, int] = (-1, -1),
    block_mask: BlockMask | None = None,
    score_mod: Callable | None = None,
):
    """Every rank of the ring in turn on one device; full-sequence results in token order.

    Args:
        q, k, v, dout: full ``[B, S, H(_kv), D]`` tensors (``dout`` optional); with
            ``cu_seqlens`` (global document boundaries), packed ``[T, H(_kv), D]``.
        the others: as :class:`RankSimulator`'s (``block_mask`` / ``score_mod``: a
            FlexAttention call).

    Returns:
        ``(out, lse)`` if ``dout`` is None, else ``(out, lse, dq, dk, dv)``; ``lse`` is
        ``[B, H, S]`` (varlen: ``[H, T]``).
    """
    sims = [
        RankSimulator(
            q,
            k,
            v,
            layout=layout,
            world_size=world_size,
            rank=r,
            causal=causal,
            backend=backend,
            scale=scale,
            cu_seqlens=cu_seqlens,
            window_size=window_size,
            block_mask=block_mask,
            score_mod=score_mod,
        )
        for r in range(world_size)
    ]
    seq = sims[0].sequence
    results = [sim.forward() for sim in sims]
    out = seq.unshard([o for o, _ in results], seq.seq_dim)
    lse = seq.unshard([lse for _, lse in results], seq.lse_seq_dim)
    if dout is None:
        return out, lse
    acc = accumulation_dtype(q.dtype)
    dk_parts = [torch.zeros(sim.k.shape, dtype=acc, device=q.device) for sim in sims]
    dv_parts = [torch.zeros(sim.v.shape, dtype=acc, device=q.device) for sim in sims]
    dq_parts = []
    for r, sim in enumerate(sims):
        dq, dk, dv, sent = sim.backward(seq.shard(dout, r), record=True)
        dq_parts.append(dq)
        dk_parts[r] += dk  # zeros when the own accumulator travelled the whole ring
        dv_parts[r] += dv
        sent_steps = sim.steps[len(sim.steps) - len(sent) :]  # all, or all but step 0 (direct)
        for step, share in zip(sent_steps, sent, strict=True):
            if share is not None:  # None: the rank ran no blocks there (Note [Direct exchange])
                dk_parts[step.src] += share[0]
                dv_parts[step.src] += share[1]
    dq = seq.unshard(dq_parts, seq.seq_dim)
    dk = seq.unshard([d.to(k.dtype) for d in dk_parts], seq.seq_dim)
    dv = seq.unshard([d.to(v.dtype) for d in dv_parts], seq.seq_dim)
    return out, lse, dq, dk, dv
