"""The ring engine: executes one rank's row of a :class:`~dtensor_ring.plan.Plan`.

Note [Ring forward]
~~~~~~~~~~~~~~~~~~~
    step s:   start sending K/V right, receiving the next K/V from the left
              block = plan[rank][s]: (out_b, lse_b) = kernel(q[block.q], kv[block.kv])
              merge (out_b, lse_b) into (out, lse)[block.q]     (Note [Online-softmax merge])
              wait for the next K/V

Step 0 is always the diagonal block over all local queries, so it initialises ``(out, lse)``
instead of merging into them; where that block's result is already in the accumulation dtype
(a kernel's unrounded outputs, fp32 inputs) and shaped as the accumulator, it becomes it (no
copy, and no second ``[S, H, D]`` fp32 tensor alive). A later block whose query rows are one
run of the accumulators is merged by the kernel itself where it can
(``BlockKernel.merge_forward``; flash-attn 4: Note [Merging in flash-attn 4's epilogue]): its
epilogue reads the accumulators' rows and writes the merge, with no block output in memory
and no merge pass. K/V travel in their input dtype;
``out``/``lse`` accumulate in the accumulation dtype and ``out`` is cast once at the end. A
plan of one block of all queries against all keys (W = 1) is one kernel call, forward and
backward: no accumulator at all.

Note [Ring backward]
~~~~~~~~~~~~~~~~~~~~
With the *global* ``out`` and ``lse`` of a query row, the softmax of any key block is known
exactly (``P = exp(S - lse)``), so each block's gradient is exact on its own and
dq, dk, dv are plain sums over blocks. K/V rotate as in the forward; the dK/dV accumulator of
the visiting K/V travels with them, one step behind:

    rank r, step s (K/V of src = r - s visit):
        block grads (dq_b, dk_b, dv_b) of plan[rank][s]; dq += dq_b
        dkv = zeros                              if s == 0
              wait(dkv of src from rank r - 1)   otherwise   (it added its step s-1 share)
        dkv[block.kv] += (dk_b, dv_b); send dkv right
    after the last step the accumulator of rank r's own K/V arrives from rank r - 1, complete.

dq and the travelling dK/dV accumulate in the accumulation dtype (exact sums over W blocks),
and the engine asks the kernel for its block gradients unrounded: a kernel that has them in
fp32 (flash-attn 4, Note [Unrounded block gradients from flash-attn 4]) then adds no bf16
rounding per block to the sum. dq stays on the rank, so a kernel that can sum it itself does
(``BlockKernel.dq_accumulator``; flash-attn 4: Note [dq accumulated inside flash-attn 4]): no
block dq, no add; else the engine adds each block's (``_SummedDq``).

Note [Merges off the critical path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Block kernels are compute-bound; the merges (forward) and dq accumulations (backward) after
them are memory-bound and depend on nothing but their block's result. On CUDA they run on a
second stream, so the next block kernel starts at once and the update overlaps it:

    compute stream:  | kernel s | kernel s+1 | kernel s+2 | ...            | wait side | cast
    side stream:                | merge s |  | merge s+1 |  ...

The side stream waits for the compute stream before each update (so it sees block s), the
block results are marked as used on it (``record_stream``: the allocator must not hand their
memory to kernel s+1 early), and the compute stream waits for the side stream before the
accumulators are read: at the end, and before a kernel merges into them itself (Note [Ring
forward]); only while updates are queued on it (a CUDA graph capture rejects a wait on a
stream that has done nothing in it). dK/dV updates stay on the compute stream: they are needed
at once, for the send.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..kernels import BlockKernel, accumulation_dtype
from ..parts import Block, Part
from ..schedule.plan import Step
from .blocks import Blocks, DenseBlocks, PartsOf


class Exchanger(Protocol):
    """What the engine needs of a communicator (see :mod:`dtensor_ring.comm`).

    ``direct``: the exchanger returns each step's dK/dV to its owner (Note [Direct exchange])
    rather than passing an accumulator along the ring; it then sends and receives only where
    the plan's rows have blocks (``wait()`` gives None where nothing arrives; ``tensors`` may be
    None where this rank's row has none, ``like`` then shapes what it receives).
    """

    direct: bool

    def start(self, tensors: Sequence[Tensor] | None, like: Sequence[Tensor] | None = None):
        """Start sending ``tensors``; returns an object whose ``wait()`` gives the received
        tensors (a list, or None)."""


class _SideStream:
    """Runs updates on a second CUDA stream (Note [Merges off the critical path]); inline
    elsewhere."""

    def __init__(self, device: torch.device):
        self.stream = _side_stream(device) if device.type == "cuda" else None
        self.queued = False  # updates since the last join (a capture forbids an idle join)
        if self.stream is not None:
            # the caller's stream, read once. On the current device, switching by set_stream
            # costs a fraction of the stream context manager's host time (paid per block);
            # set_stream also makes the stream's device current, so elsewhere the manager
            self.compute = torch.cuda.current_stream(device)
            self.switch = self.stream.device_index == torch.cuda.current_device()

    def run(self, update, *results: Tensor) -> None:
        """``update()`` after everything queued so far; ``results`` are the tensors it reads."""
        if self.stream is None:
            update()
            return
        self.queued = True
        self.stream.wait_stream(self.compute)
        if self.switch:
            torch.cuda.set_stream(self.stream)
            try:
                update()
            finally:
                torch.cuda.set_stream(self.compute)
        else:
            with torch.cuda.stream(self.stream):
                update()
        for t in results:
            t.record_stream(self.stream)

    def join(self) -> None:
        """Make the compute stream wait for every update (none queued: nothing to wait for;
        under CUDA graph capture, waiting on the idle side stream would be an error)."""
        if self.queued:
            self.compute.wait_stream(self.stream)
            self.queued = False


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def ring_forward(
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    steps: Sequence[Step],
    exchanger: Exchanger | None,
    kernel: BlockKernel,
    scale: float,
    blocks: Blocks | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward of one rank (Note [Ring forward]).

    Args:
        q_BSHD: local queries ``[B, S, H, D]``; k_BSHD, v_BSHD: local ``[B, S, H_kv, D]``.
            (With varlen ``blocks``: packed ``[T, H, D]`` and ``[T, H_kv, D]``.)
        steps: this rank's row of the plan (``plan.steps[rank]``); the ``init`` blocks of
            ``steps[0]`` cover every local query.
        exchanger: K/V communicator for the plan (:func:`~dtensor_ring.comm.forward_exchanger`);
            may be None when ``len(steps) == 1``.
        blocks: how parts are taken and blocks computed (:class:`Blocks`); default
            :class:`DenseBlocks`.

    Returns:
        ``(out_BSHD, lse_BHS)``: out in the input dtype, lse in the accumulation dtype
        (varlen: ``(out_THD, lse_HT)``).
    """
    blocks = DenseBlocks(q_BSHD.shape[1]) if blocks is None else blocks
    whole = _whole_block(steps)
    if whole is not None:  # one block is the whole call: the kernel's result is the answer
        out, lse = blocks.forward(kernel, q_BSHD, k_BSHD, v_BSHD, whole, scale)
        lse, out = lse.contiguous(), out.contiguous()  # the layouts of the fakes (ops/common.py)
        return blocks.finish(out, lse, True, out.dtype), lse
    acc = accumulation_dtype(q_BSHD.dtype)
    out_acc = lse_acc = None  # the first block's result itself where it can be (below)
    side = _SideStream(q_BSHD.device)
    q_part = PartsOf(blocks.take, q_BSHD)
    kv = [k_BSHD, v_BSHD]
    for s, step in enumerate(steps):
        pending = exchanger.start(kv) if s + 1 < len(steps) else None
        for blk in step.blocks:
            if blocks.is_empty(blk):
                continue
            k_b, v_b = blocks.take(kv[0], blk.kv), blocks.take(kv[1], blk.kv)
            if _merged_by_kernel(kernel, blocks, blk, out_acc):
                side.join()  # the kernel merges into the accumulators: after the queued merges
                if blocks.merge_forward(kernel, q_BSHD, k_b, v_b, blk, scale, out_acc, lse_acc):
                    continue
            q_b = q_part(blk.q)
            out_b, lse_b = blocks.forward(kernel, q_b, k_b, v_b, blk, scale, unrounded=True)
            if out_acc is None:
                if blk.init and _adoptable(blocks, blk, q_BSHD, out_b, lse_b, acc):
                    out_acc, lse_acc = out_b, lse_b.to(acc).contiguous()
                    continue
                out_acc, lse_acc = _new_accumulators(blocks, q_BSHD, acc)
            if blk.init:
                blocks.init_(out_acc, lse_acc, blk.q, out_b, lse_b)
            else:
                side.run(
                    functools.partial(blocks.merge_, out_acc, lse_acc, blk.q, out_b, lse_b),
                    out_b,
                    lse_b,
                )
        if pending is not None:
            kv = pending.wait()
    side.join()
    if out_acc is None:  # no block ran
        out_acc, lse_acc = _new_accumulators(blocks, q_BSHD, acc)
    return blocks.finish(out_acc, lse_acc, False, q_BSHD.dtype), lse_acc


def _merged_by_kernel(kernel: BlockKernel, blocks: Blocks, blk: Block, out_acc) -> bool:
    """Whether ``blk`` asks ``kernel`` to merge it into the accumulators itself (Note [Ring
    forward]): a kernel that may, a block after the first whose query rows it can merge
    where they lie (``Blocks.in_place``)."""
    if out_acc is None or blk.init or not blocks.in_place(kernel, blk.q):
        return False  # (flex blocks never are: FlexBlocks.in_place)
    return kernel.merges_outputs


def _new_accumulators(blocks: Blocks, q: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    return out, torch.empty(blocks.lse_shape(q), dtype=acc, device=q.device)


def _adoptable(blocks: Blocks, blk: Block, q: Tensor, out_b: Tensor, lse_b: Tensor, acc) -> bool:
    """Whether the first block's ``out_b`` can be the output accumulator itself (Note [Ring
    forward]): an init block of every local query, in the accumulation dtype (a kernel's
    unrounded outputs, or fp32 / fp64 inputs), contiguous, shaped as the accumulator (its
    ``lse_b``, small, is then made contiguous in the accumulation dtype where it is not)."""
    return (
        out_b.dtype == acc
        and blocks.covers(blk.q, q)
        and out_b.shape == q.shape
        and tuple(lse_b.shape) == tuple(blocks.lse_shape(q))
        and out_b.is_contiguous()
    )


def _whole_block(steps: Sequence[Step]) -> Block | None:
    """The block when ``steps`` are one block of all local queries against all local keys
    (one rank, or a plan that needs nothing else), else None. Its kernel call is then the
    whole forward / backward: no accumulators, merges or casts (the result is bitwise the
    same: one block's result converted to fp32 and back)."""
    if len(steps) != 1 or len(steps[0].blocks) != 1:
        return None
    blk = steps[0].blocks[0]
    return blk if blk.q is Part.ALL and blk.kv is Part.ALL else None


def _zeros_like(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    return [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in tensors]


def ring_backward(
    dout_BSHD: Tensor,
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    steps: Sequence[Step],
    kv_exchanger: Exchanger | None,
    dkv_exchanger: Exchanger | None,
    kernel: BlockKernel,
    scale: float,
    blocks: Blocks | None = None,
    *,
    round_dkv: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one rank (Note [Ring backward]); returns ``(dq, dk, dv)`` in input dtypes
    (``round_dkv=False``: dk, dv in the accumulation dtype, for a caller that adds more to them,
    as the simulator adds the shares of other ranks).

    ``out_BSHD``/``lse_BHS`` are the forward's global results for the local queries. The two
    exchangers (:func:`~dtensor_ring.comm.backward_exchangers`) must use different tags (K/V
    and dK/dV transfers are in flight together); with ``dkv_exchanger.direct`` each step's
    dK/dV go back to their owner instead of travelling on (Note [Direct exchange] in
    ``comm/p2p.py``). ``blocks`` as in :func:`ring_forward`.
    """
    blocks = DenseBlocks(q_BSHD.shape[1]) if blocks is None else blocks
    whole = _whole_block(steps)
    if whole is not None:
        grads = blocks.backward(
            kernel, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, whole, scale
        )
        return tuple(g.contiguous() for g in grads)
    acc = accumulation_dtype(q_BSHD.dtype)
    direct = dkv_exchanger is not None and dkv_exchanger.direct
    side = _SideStream(q_BSHD.device)
    live = [[blk for blk in step.blocks if not blocks.is_empty(blk)] for step in steps]
    local = (dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS)
    every = [blk for step_blocks in live for blk in step_blocks]
    dq = blocks.dq_accumulator(kernel, *local, every, scale) or _SummedDq(
        blocks, kernel, dout_BSHD, q_BSHD, out_BSHD, lse_BHS, scale, side
    )
    kv = [k_BSHD, v_BSHD]
    dkv_own = _zeros_like(kv, acc)  # step 0's accumulator: our own K/V
    pending_dkv = None
    for s, step_blocks in enumerate(live):
        last = s + 1 == len(steps)
        pending_kv = None if last else kv_exchanger.start(kv)
        grads = []
        for blk in step_blocks:
            k_b, v_b = blocks.take(kv[0], blk.kv), blocks.take(kv[1], blk.kv)
            grads.append((blk.kv, dq.backward(blk, k_b, v_b)))
        if s == 0:
            dkv = dkv_own
        elif direct:  # a fresh share for the visiting K/V, where the plan's row runs blocks
            dkv = _zeros_like(dkv_own, acc) if steps[s].blocks else None
        else:  # the accumulator of the visiting K/V, with the shares of the ranks before us
            dkv = pending_dkv.wait()
        for part, dkv_b in grads:
            blocks.add_kv_(dkv, part, dkv_b)
        if direct and s > 0:  # ours may have arrived meanwhile
            if pending_dkv is not None:
                _add_all_(dkv_own, pending_dkv.wait())
            pending_dkv = dkv_exchanger.start(dkv, like=dkv_own)
        elif not direct and len(steps) > 1:
            pending_dkv = dkv_exchanger.start(dkv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:  # ring: our complete accumulator; direct: the last share
        received = pending_dkv.wait()
        dkv_own = _add_all_(dkv_own, received) if direct else received
    side.join()
    if not round_dkv:
        return dq.result(), *dkv_own
    return dq.result(), dkv_own[0].to(k_BSHD.dtype), dkv_own[1].to(v_BSHD.dtype)


class _SummedDq:
    """A :class:`~dtensor_ring.kernels.DqAccumulator` for any kernel: each block's dq, in the
    accumulation dtype where the kernel has it so (``unrounded``), added into an accumulator on
    the side stream (Note [Merges off the critical path])."""

    def __init__(self, blocks, kernel, dout_BSHD, q_BSHD, out_BSHD, lse_BHS, scale, side):
        self.blocks, self.kernel, self.scale, self.side = blocks, kernel, scale, side
        self.dtype = q_BSHD.dtype
        self.acc = torch.zeros(
            q_BSHD.shape, dtype=accumulation_dtype(self.dtype), device=q_BSHD.device
        )
        self.dout, self.q, self.out = (
            PartsOf(blocks.take, x) for x in (dout_BSHD, q_BSHD, out_BSHD)
        )
        self.lse = PartsOf(blocks.take_lse, lse_BHS)

    def backward(self, blk: Block, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        dq_b, dk_b, dv_b = self.blocks.backward(
            self.kernel,
            self.dout(blk.q),
            self.q(blk.q),
            k,
            v,
            self.out(blk.q),
            self.lse(blk.q),
            blk,
            self.scale,
            unrounded=True,
        )
        self.side.run(functools.partial(self.blocks.add_, self.acc, blk.q, dq_b), dq_b)
        return dk_b, dv_b

    def result(self) -> Tensor:
        """dq in the input dtype (after the side stream's updates: ``side.join()``)."""
        return self.acc.to(self.dtype)


def _add_all_(acc: list[Tensor], shares: Sequence[Tensor] | None) -> list[Tensor]:
    """``acc += shares`` elementwise, in place (None: nothing arrived, Note [Direct
    exchange])."""
    for a, x in zip(acc, shares or (), strict=shares is not None):
        a.add_(x)
    return acc
