"""FlexAttention over a sequence sharded on a ring: the autograd function behind
:func:`dtensor_ring.flex_attention`.

Note [FlexAttention on the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A FlexAttention call is attention whose score matrix is edited by two user functions of
*global* token indices: ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
kv_idx)``. Both are pointwise, so they can be evaluated block by block wherever the block's
global positions are known, and the ring's merge (Note [Online-softmax merge]) and exact
block gradients (Note [Ring backward]) hold for any such scores:

    rank r, step s: K/V of src visit
        for each block of plan[r][s]          (query run x key run, trimmed: Note [Flex schedules])
            q_idx = block.origin[0] + stride * arange(S_q)      <- global positions, from
            kv_idx = block.origin[1] + stride * arange(S_k)        the layout's runs
            s = score_mod(q k^T * scale, b, h, q_idx, kv_idx), hidden where not mask_mod(...)
            (out_b, lse_b) -> merge;  backward: P = exp(s - lse_global), dS through score_mod

So a mask written for one device works unchanged, whatever layout holds the tokens. The plan
is derived from the global mask's tiles on every rank alike (the ranks compare the tiles'
digest before communicating: Note [Consistency header]). Rows that see no key are 0 with
``lse = -inf``, as ``flex_attention`` defines them, and get no gradient.

The functions are Python callables, which a ``torch.library`` op cannot take: this is an
``autograd.Function`` run eagerly (``torch.compile`` runs it outside the graph: the front door
is ``torch.compiler.disable``-d). Its backward is first-order only (Note [First-order
backward]); ``score_mod`` is differentiated by autograd, block by block, and must not close
over tensors that require grad (the front door checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._compat import resolve_group
from ..comm.p2p import backward_exchangers, forward_exchanger
from ..engine.blocks import FlexBlocks
from ..engine.ring import ring_backward, ring_forward
from ..kernels.flex import FlexKernel, FlexMods
from ..schedule.plan import Plan
from .common import check_first_order, without_autocast


@without_autocast
def ring_flex_forward(
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    group_name: str,
    plan: Plan,
    mods: FlexMods,
    scale: float,
    kernel: FlexKernel,
) -> tuple[Tensor, Tensor]:
    """``(out_BSHD, lse_BHS)`` of local ``q [B, S, H, D]``, ``k, v [B, S, H_kv, D]``."""
    group = resolve_group(group_name)
    exchanger = forward_exchanger(group, plan) if plan.world_size > 1 else None
    blocks = FlexBlocks(q_BSHD.shape[1], mods)
    steps = plan.steps[group.rank()]
    return ring_forward(q_BSHD, k_BSHD, v_BSHD, steps, exchanger, kernel, scale, blocks)


@without_autocast
def ring_flex_backward(
    dout_BSHD: Tensor,
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    dlse_BHS: Tensor | None,
    group_name: str,
    plan: Plan,
    mods: FlexMods,
    scale: float,
    kernel: FlexKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`ring_flex_forward` given ``dout``, the gradient of its lse
    (None: 0) and its outputs."""
    group = resolve_group(group_name)
    kv_exchanger = dkv_exchanger = None
    if plan.world_size > 1:
        kv_exchanger, dkv_exchanger = backward_exchangers(group, plan)
    blocks = FlexBlocks(q_BSHD.shape[1], mods, dlse_BHS)
    steps = plan.steps[group.rank()]
    return ring_backward(
        dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, steps, kv_exchanger,
        dkv_exchanger, kernel, scale, blocks,
    )  # fmt: skip


class RingFlex(torch.autograd.Function):
    """``RingFlex.apply(q_BSHD, k_BSHD, v_BSHD, group_name, plan, mods, scale, kernel)`` ->
    ``(out_BSHD, lse_BHS)`` (Note [FlexAttention on the ring]); both differentiable, as
    ``flex_attention``'s out and lse are."""

    @staticmethod
    def forward(ctx, q, k, v, group_name, plan, mods, scale, kernel):
        out, lse = ring_flex_forward(q, k, v, group_name, plan, mods, scale, kernel)
        ctx.set_materialize_grads(False)  # an unused lse (or out) gets no gradient: None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group_name, plan, mods, scale, kernel)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        check_first_order()
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = ring_flex_backward(dout, q, k, v, out, lse, dlse, *ctx.args)
        return (*grads, None, None, None, None, None)
