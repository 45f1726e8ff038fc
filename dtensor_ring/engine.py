"""The ring engine: executes one rank's row of a :class:`~dtensor_ring.plan.Plan`.

Note [Ring forward]
~~~~~~~~~~~~~~~~~~~
    step s:   start sending K/V right, receiving the next K/V from the left
              block = plan[rank][s]: (out_b, lse_b) = kernel(q[block.q], kv[block.kv])
              merge (out_b, lse_b) into (out, lse)[block.q]     (Note [Online-softmax merge])
              wait for the next K/V

Step 0 is always the diagonal block over all local queries, so it initialises ``(out, lse)``
instead of merging into them. K/V travel in their input dtype; ``out``/``lse`` accumulate in
the accumulation dtype and ``out`` is cast once at the end.

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

dq and the travelling dK/dV accumulate in the accumulation dtype (exact sums over W blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from .kernels import BlockKernel, accumulation_dtype
from .merge import merge_
from .plan import Part, Step


class Exchanger(Protocol):
    """What the engine needs of a communicator (see :mod:`dtensor_ring.comm`)."""

    def start(self, tensors: Sequence[Tensor]): ...  # -> object with .wait() -> list[Tensor]


def _part(x: Tensor, part: Part, dim: int) -> Tensor:
    start, stop = part.bounds(x.shape[dim])
    return x.narrow(dim, start, stop - start)


def _is_empty(step: Step, seq_local: int) -> bool:
    blk = step.block
    return blk is None or min(blk.q.size(seq_local), blk.kv.size(seq_local)) == 0


def ring_forward(
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    steps: Sequence[Step],
    exchanger: Exchanger | None,
    kernel: BlockKernel,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Forward of one rank (Note [Ring forward]).

    Args:
        q_BSHD: local queries ``[B, S, H, D]``; k_BSHD, v_BSHD: local ``[B, S, H_kv, D]``.
        steps: this rank's row of the plan (``plan.steps[rank]``); ``steps[0]`` is the
            diagonal ``all/all`` block.
        exchanger: ring communicator; may be None when ``len(steps) == 1``.

    Returns:
        ``(out_BSHD, lse_BHS)``: out in the input dtype, lse in the accumulation dtype.
    """
    B, S, H, D = q_BSHD.shape
    acc = accumulation_dtype(q_BSHD.dtype)
    out_acc = torch.empty(B, S, H, D, dtype=acc, device=q_BSHD.device)
    lse_acc = torch.empty(B, H, S, dtype=acc, device=q_BSHD.device)
    kv = [k_BSHD, v_BSHD]
    for s, step in enumerate(steps):
        pending = exchanger.start(kv) if s + 1 < len(steps) else None
        if not _is_empty(step, S):
            blk = step.block
            out_b, lse_b = kernel.forward(
                _part(q_BSHD, blk.q, 1),
                _part(kv[0], blk.kv, 1),
                _part(kv[1], blk.kv, 1),
                causal=blk.causal,
                scale=scale,
            )
            if s == 0:
                out_acc.copy_(out_b)
                lse_acc.copy_(lse_b)
            else:
                merge_(_part(out_acc, blk.q, 1), _part(lse_acc, blk.q, 2), out_b, lse_b)
        if pending is not None:
            kv = pending.wait()
    return out_acc.to(q_BSHD.dtype), lse_acc


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
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one rank (Note [Ring backward]); returns ``(dq, dk, dv)`` in input dtypes.

    ``out_BSHD``/``lse_BHS`` are the forward's global results for the local queries. The two
    exchangers must use different tags (K/V and dK/dV transfers are in flight together).
    """
    S = q_BSHD.shape[1]
    acc = accumulation_dtype(q_BSHD.dtype)
    dq_acc = torch.zeros(q_BSHD.shape, dtype=acc, device=q_BSHD.device)
    kv = [k_BSHD, v_BSHD]
    pending_dkv = None
    for s, step in enumerate(steps):
        last = s + 1 == len(steps)
        pending_kv = None if last else kv_exchanger.start(kv)
        grads = None
        if not _is_empty(step, S):
            blk = step.block
            grads = kernel.backward(
                _part(dout_BSHD, blk.q, 1),
                _part(q_BSHD, blk.q, 1),
                _part(kv[0], blk.kv, 1),
                _part(kv[1], blk.kv, 1),
                _part(out_BSHD, blk.q, 1),
                _part(lse_BHS, blk.q, 2),
                causal=blk.causal,
                scale=scale,
            )
            _part(dq_acc, blk.q, 1).add_(grads[0])
        if pending_dkv is None:  # step 0: a fresh accumulator for our own K/V
            dkv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in kv]
        else:  # the accumulator of the visiting K/V, with the shares of the ranks before us
            dkv = pending_dkv.wait()
        if grads is not None:
            _part(dkv[0], blk.kv, 1).add_(grads[1])
            _part(dkv[1], blk.kv, 1).add_(grads[2])
        if len(steps) > 1:
            pending_dkv = dkv_exchanger.start(dkv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:
        dkv = pending_dkv.wait()
    return dq_acc.to(q_BSHD.dtype), dkv[0].to(k_BSHD.dtype), dkv[1].to(v_BSHD.dtype)
