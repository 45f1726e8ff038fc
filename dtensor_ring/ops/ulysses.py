"""The Ulysses ``dtensor_ring::`` custom ops: the all-to-all, full-sequence attention on head
shards, and Ulysses attention with ring attention's signature (the DTensor path).

Note [Ulysses attention]
~~~~~~~~~~~~~~~~~~~~~~~~
W ranks each hold S/W tokens of every head. One all-to-all per tensor trades the sequence shard
for a head shard: afterwards every rank holds ALL S tokens of H/W heads, runs ordinary
(non-distributed) attention on them with one block kernel, and a second all-to-all trades back.
W = 2, H = 4 heads (h0..h3), S = 8 tokens, ring layout:

    before (seq-sharded)          all-to-all          after (head-sharded)
    rank0: t0-t3 x h0 h1 h2 h3    ---------->         rank0: t0-t7 x h0 h1
    rank1: t4-t7 x h0 h1 h2 h3    <---------->        rank1: t0-t7 x h2 h3
                                   (rank r sends head chunk j of its tokens to rank j)

    forward:  q, k, v --a2a--> attention(S, H/W) --a2a--> out    (lse: one more small a2a)
    backward: dout --a2a--> attention backward --a2a--> dq, dk, dv

The all-to-all concatenates the ranks' shards in rank order, so the gathered sequence is in
the *layout's* order, not in token order. For zigzag, W = 2, S = 8: rank0 holds 0 1 6 7 and
rank1 holds 2 3 4 5, so the gathered sequence is ``0 1 6 7 2 3 4 5``. Non-causal attention does
not care (permuting queries permutes the output rows; permuting keys together with values
changes nothing), but a causal mask does: for causal attention the gathered sequence is
put back in token order with ``index_select(argsort(order))`` right after the all-to-all, and
the output is permuted back into layout order right before the return all-to-all
(``order = cat(token_indices(layout, S, r, W) for r in range(W))``; the ring layout is the
identity and costs nothing).

GQA/MQA (H_kv < H): each rank needs the K/V heads its H/W query heads use. Query head ``h``
uses K/V head ``h // (H / H_kv)`` (as in flash-attn), so the H/W query heads of rank r use a
contiguous run of K/V heads. K/V heads are repeated ``f = W / gcd(H_kv, W)`` times
(``repeat_interleave``, each head next to its copies) before the all-to-all, which makes
``f * H_kv`` a multiple of W and keeps the query/K/V head correspondence of every rank:

* ``H_kv % W == 0``: ``f = 1``, K/V heads are sharded like query heads, nothing is repeated;
* ``H_kv < W`` with ``W % H_kv == 0`` (e.g. H_kv = 2, W = 4): ``f = W / H_kv``, every rank
  receives exactly the one K/V head its query heads use;
* otherwise (e.g. H_kv = 6, W = 4: ``f = 2``): each rank receives ``f * H_kv / W`` heads.

``H % W == 0`` is required (the query heads are what is sharded); it is checked on every rank
before any communication. The gradients of the repeated heads are summed back by autograd.

"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._compat import resolve_group
from ..comm.all_to_all import all_to_all
from ..kernels import accumulation_dtype, get_kernel
from ..kernels.merge import finish_rows, sinks_grad_rows
from ..layouts import get_layout, order_layout
from ..schedule.cost import kv_repeat
from .common import (
    attention_op,
    call_attention,
    check_first_order,
    fake_grads,
    fake_out_lse,
    op_window,
    register_attention_autograd,
    with_sinks,
)

# --- the all-to-all op ---------------------------------------------------------------------


def _a2a_shape(shape, W: int, seq_dim: int, head_dim: int, to_heads: bool) -> list[int]:
    shape = list(shape)
    grow, shrink = (seq_dim, head_dim) if to_heads else (head_dim, seq_dim)
    shape[grow] *= W
    shape[shrink] //= W
    return shape


@torch.library.custom_op("dtensor_ring::ulysses_all_to_all", mutates_args=())
def ulysses_all_to_all(
    x: Tensor, group_name: str, seq_dim: int, head_dim: int, to_heads: bool, layout: str
) -> Tensor:
    """Ulysses all-to-all between sequence and head sharding (Note [Ulysses attention]).

    ``to_heads=True``: ``x`` holds ``S/W`` tokens (of layout ``layout``) of all H heads ->
    all ``S`` tokens in global token order of ``H/W`` heads. ``to_heads=False`` is the inverse.
    ``seq_dim``/``head_dim`` name the dims (1, 2 for ``[B, S, H, D]``; 2, 1 for ``[B, H, S]``).
    A layout whose shards concatenate to the sequence (ring) needs no reordering; pass "ring"
    also when the order does not matter.
    """
    group = resolve_group(group_name)
    W = dist.get_world_size(group)
    if W == 1:
        return x.clone(memory_format=torch.contiguous_format)
    lay = get_layout(layout, "dense")
    if to_heads:
        y = all_to_all(x, group, head_dim, seq_dim)
        if not lay.identity_order:
            _, inverse = lay.order(y.shape[seq_dim], W)
            y = y.index_select(seq_dim, inverse.to(y.device))
    else:
        if not lay.identity_order:
            order, _ = lay.order(x.shape[seq_dim], W)
            x = x.index_select(seq_dim, order.to(x.device))
        y = all_to_all(x, group, seq_dim, head_dim)
    return y.contiguous()


@ulysses_all_to_all.register_fake
def _(x, group_name, seq_dim, head_dim, to_heads, layout):
    W = dist.get_world_size(resolve_group(group_name))
    return x.new_empty(_a2a_shape(x.shape, W, seq_dim, head_dim, to_heads))


def _a2a_setup_context(ctx, inputs, output):
    _, *ctx.args = inputs


def _a2a_backward(ctx, grad):
    # The all-to-all is a permutation of entries across ranks: its adjoint is its inverse.
    check_first_order()  # Note [First-order backward]
    group_name, seq_dim, head_dim, to_heads, layout = ctx.args
    dx = ulysses_all_to_all(grad, group_name, seq_dim, head_dim, not to_heads, layout)
    return dx, None, None, None, None, None


ulysses_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup_context)


# --- local (single-rank) attention op ------------------------------------------------------


def ulysses_local_attention_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One block kernel on full sequences: ``q [B, S, h, D]``, ``k, v [B, S, h_kv, D]`` ->
    ``(out [B, S, h, D], lse [B, h, S])`` (lse in the accumulation dtype); the normalised
    sliding window ``window_left/right`` over the sequence (-1, -1: none); ``sinks``: the sink
    logits ``[h]`` of these heads (Note [Attention sinks])."""
    kernel, window = get_kernel(backend), op_window(window_left, window_right)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, window=window)
    out = finish_rows(out.contiguous(), lse, out.dtype)
    return with_sinks((out, lse.to(accumulation_dtype(q.dtype)).contiguous()), sinks)


ulysses_local_attention = attention_op("ulysses_local_attention", ulysses_local_attention_impl)


@ulysses_local_attention.register_fake
def _(q, k, v, causal, scale, backend, window_left=-1, window_right=-1, sinks=None):
    B, S, H, _ = q.shape
    return fake_out_lse(q, (B, H, S))


def ulysses_local_attention_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`ulysses_local_attention`."""
    kernel, window = get_kernel(backend), op_window(window_left, window_right)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window)
    return tuple(g.contiguous() for g in grads)


ulysses_local_attention_backward = attention_op(
    "ulysses_local_attention_backward", ulysses_local_attention_backward_impl
)


ulysses_local_attention_backward.register_fake(fake_grads)
register_attention_autograd(
    ulysses_local_attention,
    ulysses_local_attention_backward,
    ulysses_local_attention_impl,
    ulysses_local_attention_backward_impl,
)


# --- sequence <-> head shards ------------------------------------------------------------


def to_heads(q: Tensor, k: Tensor, v: Tensor, name: str, W: int, layout: str):
    f = kv_repeat(k.shape[2], W)
    if f > 1:
        k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
    return tuple(ulysses_all_to_all(x, name, 1, 2, True, layout) for x in (q, k, v))


# Note [Sinks on head shards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each rank's gradient of the sinks is its own rows' (tokens') share, for all H heads (Note
# [Attention sinks]). After the all-to-all a rank holds all S tokens of H/W heads, so the
# attention op's own sinks gradient would be its heads' share over the whole sequence: the same
# sum over the ranks, other values on each. So the op gets this rank's sinks as constants (they
# shape its rows), and the backward sends each (head, row) term of the gradient to the row's
# owner with the all-to-all that brings lse back (W = 2, H = 4, rank 0):
#
#     head shard:  terms [B, h0 h1, t0..t7] --a2a--> [B, h0..h3, t0..t3] --sum over B, tokens-->
#                  dsinks [H] of rank 0's tokens
#
# one more all-to-all in the backward, of B * H * S_local values (1/D of dout's). The DTensor
# path's Ulysses op folds the sinks in on sequence shards (after its return all-to-all), so its
# autograd (Note [First-order backward]'s register_attention_autograd) already gives the rows.


class _SinksOfRows(torch.autograd.Function):
    """``out_h`` unchanged; backward: the sinks' gradient of this rank's rows (Note [Sinks on
    head shards])."""

    @staticmethod
    def forward(ctx, out_h, lse_h, sinks_h, sinks, group_name, layout):
        ctx.save_for_backward(out_h, lse_h, sinks_h)
        ctx.args = group_name, layout
        return out_h.view_as(out_h)

    @staticmethod
    def backward(ctx, dout_h):
        check_first_order()
        out_h, lse_h, sinks_h = ctx.saved_tensors
        group_name, layout = ctx.args
        terms_h = sinks_grad_rows(dout_h, out_h, lse_h, sinks_h)  # [B, h, S]
        terms = ulysses_all_to_all(terms_h, group_name, 2, 1, False, layout)  # [B, H, S_local]
        return dout_h, None, None, terms.sum((0, 2)).to(sinks_h.dtype), None, None


def attention_on_heads(op, qh, kh, vh, *args, sinks, rank, group_name, layout):
    """``call_attention(op, qh, kh, vh, *args, sinks of this rank's heads)`` on the head shards
    ``qh [B, S, h, D]`` of :func:`to_heads` over ``group_name`` (``rank``: this rank in it;
    ``layout``: the token order it used) -> ``(out_h, lse_h)``; the gradient of ``sinks [H]``
    is this rank's rows' share (Note [Sinks on head shards])."""
    if sinks is None:
        return call_attention(op, qh, kh, vh, *args, None)
    sinks_h = sinks.detach().view(-1, qh.shape[2])[rank]
    out_h, lse_h = call_attention(op, qh, kh, vh, *args, sinks_h)
    return _SinksOfRows.apply(out_h, lse_h, sinks_h, sinks, group_name, layout), lse_h


# --- sequence-sharded attention ops (the DTensor path) ---------------------------------------


def ulysses_attention_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Ulysses attention with ``dtensor_ring::ring_attention``'s signature and results.

    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` (this rank's tokens under
    ``layout``) -> ``(out [B, S_local, H, D], lse [B, H, S_local])``. With its backward op
    :func:`ulysses_attention_backward` it serves callers that get a forward call and a separate
    backward call (the SDPA aten-op handlers of ``ring_sdpa(mode="ulysses")``), so both take
    sequence shards: the backward redoes the all-to-alls of q, k, v (and brings ``out``, ``lse``
    and ``dout`` to head shards) instead of keeping head-sharded tensors between the calls.
    :func:`ulysses_flash_attn_func` keeps them (autograd through the pieces) and does not.
    """
    W = dist.get_world_size(resolve_group(group_name))
    order = order_layout(layout, causal, (window_left, window_right))
    qh, kh, vh = to_heads(q, k, v, group_name, W, order)
    out_h, lse_h = ulysses_local_attention(
        qh, kh, vh, causal, scale, backend, window_left, window_right
    )
    result = (
        ulysses_all_to_all(out_h, group_name, 1, 2, False, order),
        ulysses_all_to_all(lse_h, group_name, 2, 1, False, order),
    )
    return with_sinks(result, sinks)


ulysses_attention = attention_op("ulysses_attention", ulysses_attention_impl)


@ulysses_attention.register_fake
def _(
    q, k, v, group_name, layout, causal, scale, backend, window_left=-1, window_right=-1, sinks=None
):
    B, S, H, _ = q.shape
    return fake_out_lse(q, (B, H, S))


def ulysses_attention_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`ulysses_attention`, all on sequence shards.

    dout, q, k, v, out and lse go to head shards (the same all-to-alls as the forward, so
    ``out``/``lse`` come back bit-identical to what the kernel produced), one kernel backward,
    and dq, dk, dv go back; the gradients of repeated K/V heads are summed.
    """
    W = dist.get_world_size(resolve_group(group_name))
    order = order_layout(layout, causal, (window_left, window_right))
    H_kv = k.shape[2]
    qh, kh, vh = to_heads(q, k, v, group_name, W, order)
    dout_h, out_h = (ulysses_all_to_all(t, group_name, 1, 2, True, order) for t in (dout, out))
    lse_h = ulysses_all_to_all(lse, group_name, 2, 1, True, order)
    grads_h = ulysses_local_attention_backward(
        dout_h, qh, kh, vh, out_h, lse_h, causal, scale, backend, window_left, window_right
    )
    dq, dk, dv = (ulysses_all_to_all(g, group_name, 1, 2, False, order) for g in grads_h)
    f = kv_repeat(H_kv, W)
    if f > 1:  # repeat_interleave put the copies of a head next to each other
        dk, dv = (g.unflatten(2, (H_kv, f)).sum(3) for g in (dk, dv))
    return dq, dk, dv


ulysses_attention_backward = attention_op(
    "ulysses_attention_backward", ulysses_attention_backward_impl
)


ulysses_attention_backward.register_fake(fake_grads)
register_attention_autograd(
    ulysses_attention,
    ulysses_attention_backward,
    ulysses_attention_impl,
    ulysses_attention_backward_impl,
)
