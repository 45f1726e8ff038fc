"""Ulysses (all-to-all) and 2-D hybrid (Ulysses x ring) context parallelism.

Public names: :func:`ulysses_flash_attn_func` (+ ``_kvpacked_func`` / ``_qkvpacked_func``),
:func:`hybrid_flash_attn_func`, :func:`hybrid_token_indices`, :func:`hybrid_shard_local`,
:func:`comm_volume` (and its result :class:`CommVolume`). See docs/ulysses.md.

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

Note [Hybrid token assignment]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
World = R ring ranks x U Ulysses ranks. The Ulysses all-to-all concatenates the U shards of a
Ulysses group (in Ulysses-rank order) and hands each rank H/U heads; ring attention then runs
over the ring group on those concatenated shards. For ring attention to be right, the
concatenation must be exactly the ring layout's shard of ring rank ``r``. So: shard the
sequence by the ring layout over R ring ranks, then cut each ring shard into U contiguous
pieces, piece ``u`` for Ulysses rank ``u`` (:func:`hybrid_token_indices`). Zigzag, R = 2,
U = 2, S = 16 (digits are global tokens):

    ring layout over R = 2:    ring rank 0: 0 1 2 3 | 12 13 14 15
                               ring rank 1: 4 5 6 7 |  8  9 10 11
    split over U = 2:
        (ring 0, ulysses 0): 0 1 2 3       (ring 0, ulysses 1): 12 13 14 15
        (ring 1, ulysses 0): 4 5 6 7       (ring 1, ulysses 1):  8  9 10 11

    Ulysses a2a inside ring rank 0's Ulysses group -> both ranks hold 0-3,12-15 (H/2 heads
    each) = zigzag shard 0; ring attention over ring groups {(0,0),(1,0)} and {(0,1),(1,1)},
    one per head half; a2a back.

With the test's 4 ranks, Ulysses groups [0, 1], [2, 3] and ring groups [0, 2], [1, 3]: global
rank g has ``ulysses_rank = g % 2`` and ``ring_rank = g // 2``. Requirements: ``H % U == 0``,
``S % (R * U) == 0`` and the ring layout's own (``S % (2R) == 0`` for zigzag, i.e. an even
``S_local * U``). K/V heads are repeated as in Note [Ulysses attention] with ``U`` for ``W``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._compat import group_name as _group_name
from ._compat import resolve_group, select_backend_name
from .functional import _check_packed
from .kernels import KernelCall, accumulation_dtype, select_kernel
from .layouts import Layout, check_layout, local_seq_divisor, token_indices
from .ops import fake_grads, register_attention_autograd, ring_attention
from .validation import (
    check_layout_causal,
    check_qkv_tensors,
    check_unsupported,
    normalize_window,
)

__all__ = [
    "CommVolume",
    "comm_volume",
    "hybrid_flash_attn_func",
    "hybrid_shard_local",
    "hybrid_token_indices",
    "ulysses_flash_attn_func",
    "ulysses_flash_attn_kvpacked_func",
    "ulysses_flash_attn_qkvpacked_func",
]


# --- the all-to-all op ---------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _gathered_order(layout: str, seq_len: int, world_size: int) -> tuple[Tensor, Tensor]:
    """``(order, inverse)``: gathered position p holds token ``order[p]``; ``inverse`` sorts."""
    order = torch.cat([token_indices(layout, seq_len, r, world_size) for r in range(world_size)])
    return order, torch.argsort(order)


def _all_to_all_impl(
    x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> Tensor:
    """Split ``scatter_dim`` into W chunks (chunk j to rank j); concatenate the received chunks
    along ``gather_dim`` in rank order."""
    W = dist.get_world_size(group)
    n = x.shape[scatter_dim] // W
    send = x.unflatten(scatter_dim, (W, n)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i]: rank i's chunk for us, shape x.shape with scatter_dim reduced to n.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


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
    The ring layout needs no reordering; pass "ring" also when the order does not matter.
    """
    group = resolve_group(group_name)
    W = dist.get_world_size(group)
    if W == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if to_heads:
        y = _all_to_all_impl(x, group, head_dim, seq_dim)
        if layout != "ring":
            _, inverse = _gathered_order(layout, y.shape[seq_dim], W)
            y = y.index_select(seq_dim, inverse.to(y.device))
    else:
        if layout != "ring":
            order, _ = _gathered_order(layout, x.shape[seq_dim], W)
            x = x.index_select(seq_dim, order.to(x.device))
        y = _all_to_all_impl(x, group, seq_dim, head_dim)
    return y.contiguous()


@ulysses_all_to_all.register_fake
def _(x, group_name, seq_dim, head_dim, to_heads, layout):
    W = dist.get_world_size(resolve_group(group_name))
    return x.new_empty(_a2a_shape(x.shape, W, seq_dim, head_dim, to_heads))


def _a2a_setup_context(ctx, inputs, output):
    _, *ctx.args = inputs


def _a2a_backward(ctx, grad):
    # The all-to-all is a permutation of entries across ranks: its adjoint is its inverse.
    group_name, seq_dim, head_dim, to_heads, layout = ctx.args
    dx = ulysses_all_to_all(grad, group_name, seq_dim, head_dim, not to_heads, layout)
    return dx, None, None, None, None, None


ulysses_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup_context)


# --- local (single-rank) attention op ------------------------------------------------------


def _local_kernel(
    q: Tensor, k: Tensor, causal: bool, backend: str | None, window_left: int, window_right: int
):
    """``(kernel, causal, window)`` of a full-sequence call (the block is the whole square, so
    the kernel's bottom-right window is the window over global positions)."""
    causal, window = normalize_window((window_left, window_right), causal, q.shape[1])
    kernel = select_kernel(KernelCall.of(q, k, window=window is not None), backend)
    return kernel, causal, window


@torch.library.custom_op("dtensor_ring::ulysses_local_attention", mutates_args=())
def ulysses_local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """One block kernel on full sequences: ``q [B, S, h, D]``, ``k, v [B, S, h_kv, D]`` ->
    ``(out [B, S, h, D], lse [B, h, S])`` (lse in the accumulation dtype); an optional
    flash-attn sliding window ``window_left/right`` over the sequence."""
    kernel, causal, window = _local_kernel(q, k, causal, backend, window_left, window_right)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, window=window)
    return out.contiguous(), lse.to(accumulation_dtype(q.dtype)).contiguous()


@ulysses_local_attention.register_fake
def _(q, k, v, causal, scale, backend=None, window_left=-1, window_right=-1):
    B, S, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (B, H, S), dtype=accumulation_dtype(q.dtype)
    )


@torch.library.custom_op("dtensor_ring::ulysses_local_attention_backward", mutates_args=())
def ulysses_local_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`ulysses_local_attention`."""
    kernel, causal, window = _local_kernel(q, k, causal, backend, window_left, window_right)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window)
    return tuple(g.contiguous() for g in grads)


ulysses_local_attention_backward.register_fake(fake_grads)
register_attention_autograd(ulysses_local_attention, ulysses_local_attention_backward)


# --- shared pieces -------------------------------------------------------------------------


def _kv_repeat(num_kv_heads: int, world_size: int) -> int:
    """How many times each K/V head is repeated before a head all-to-all over ``world_size``."""
    return world_size // math.gcd(num_kv_heads, world_size)


def _check_heads(H: int, world_size: int, what: str) -> None:
    """``H % world_size == 0`` (query heads are what Ulysses shards), else ``ValueError``."""
    if H % world_size != 0:
        raise ValueError(
            f"{what} shards the {H} query heads over {world_size} ranks, which needs "
            f"H % {world_size} == 0; use a group size that divides H (or ring attention)"
        )


def _to_heads(q: Tensor, k: Tensor, v: Tensor, name: str, W: int, layout: str):
    f = _kv_repeat(k.shape[2], W)
    if f > 1:
        k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
    return tuple(ulysses_all_to_all(x, name, 1, 2, True, layout) for x in (q, k, v))


def _head_views(q: Tensor, k: Tensor, W: int) -> tuple[Tensor, Tensor]:
    """Views with the head counts one rank sees after the all-to-all (for kernel selection)."""
    H_kv = k.shape[2]
    return q[:, :, : q.shape[2] // W], k[:, :, : H_kv * _kv_repeat(H_kv, W) // W]


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _gathered_order_name(layout: str, causal: bool, window: tuple[int, int]) -> str:
    """The ``layout`` argument of the all-to-alls: attention without a causal mask or window
    ignores token order."""
    return layout if causal or tuple(window) != (-1, -1) else "ring"


# --- sequence-sharded attention ops (the DTensor path) ---------------------------------------


@torch.library.custom_op("dtensor_ring::ulysses_attention", mutates_args=())
def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    causal: bool,
    scale: float,
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
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
    _check_heads(q.shape[2], W, "Ulysses attention")
    order = _gathered_order_name(layout, causal, (window_left, window_right))
    qh, kh, vh = _to_heads(q, k, v, group_name, W, order)
    out_h, lse_h = ulysses_local_attention(
        qh, kh, vh, causal, scale, backend, window_left, window_right
    )
    return (
        ulysses_all_to_all(out_h, group_name, 1, 2, False, order),
        ulysses_all_to_all(lse_h, group_name, 2, 1, False, order),
    )


@ulysses_attention.register_fake
def _(q, k, v, group_name, layout, causal, scale, backend=None, window_left=-1, window_right=-1):
    B, S, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (B, H, S), dtype=accumulation_dtype(q.dtype)
    )


@torch.library.custom_op("dtensor_ring::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward(
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
    backend: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`ulysses_attention`, all on sequence shards.

    dout, q, k, v, out and lse go to head shards (the same all-to-alls as the forward, so
    ``out``/``lse`` come back bit-identical to what the kernel produced), one kernel backward,
    and dq, dk, dv go back; the gradients of repeated K/V heads are summed.
    """
    W = dist.get_world_size(resolve_group(group_name))
    _check_heads(q.shape[2], W, "Ulysses attention")
    order = _gathered_order_name(layout, causal, (window_left, window_right))
    H_kv = k.shape[2]
    qh, kh, vh = _to_heads(q, k, v, group_name, W, order)
    dout_h, out_h = (ulysses_all_to_all(t, group_name, 1, 2, True, order) for t in (dout, out))
    lse_h = ulysses_all_to_all(lse, group_name, 2, 1, True, order)
    grads_h = ulysses_local_attention_backward(
        dout_h, qh, kh, vh, out_h, lse_h, causal, scale, backend, window_left, window_right
    )
    dq, dk, dv = (ulysses_all_to_all(g, group_name, 1, 2, False, order) for g in grads_h)
    f = _kv_repeat(H_kv, W)
    if f > 1:  # repeat_interleave put the copies of a head next to each other
        dk, dv = (g.unflatten(2, (H_kv, f)).sum(3) for g in (dk, dv))
    return dq, dk, dv


ulysses_attention_backward.register_fake(fake_grads)
register_attention_autograd(ulysses_attention, ulysses_attention_backward)


# --- Ulysses front door --------------------------------------------------------------------


def _ulysses(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    group,
    layout,
    backend,
):
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    check_layout(layout)
    check_qkv_tensors(q, k, v)
    name = _group_name(group)
    W = dist.get_world_size(group)
    _check_heads(q.shape[2], W, "Ulysses attention")
    _, window = normalize_window(window_size, causal, q.shape[1] * W)
    order = _gathered_order_name(layout, causal, window_size)
    if order != "ring" and (q.shape[1] * W) % local_seq_divisor(layout, W) != 0:
        raise ValueError(
            f"layout={layout!r} on {W} ranks needs a global sequence length divisible by "
            f"{local_seq_divisor(layout, W)}, got S_local={q.shape[1]} x {W}"
        )
    backend = select_backend_name(
        *_head_views(q, k, W), backend, deterministic=deterministic, window=window is not None
    )
    scale = _scale(q, softmax_scale)
    if W == 1:
        out, lse = ulysses_local_attention(q, k, v, causal, scale, backend, *window_size)
        return (out, lse, None) if return_attn_probs else out
    qh, kh, vh = _to_heads(q, k, v, name, W, order)
    out_h, lse_h = ulysses_local_attention(qh, kh, vh, causal, scale, backend, *window_size)
    out = ulysses_all_to_all(out_h, name, 1, 2, False, order)
    if not return_attn_probs:
        return out
    return out, ulysses_all_to_all(lse_h, name, 2, 1, False, order), None


def ulysses_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: Layout = "ring",
    backend: str | None = None,
):
    """Ulysses (all-to-all) attention; see Note [Ulysses attention].

    Args:
        q: ``[B, S_local, H, D]``; k, v: ``[B, S_local, H_kv, D]``, the tokens of this rank
            under ``layout`` (shard with :func:`dtensor_ring.shard_local`). ``H`` must be a
            multiple of the group size W; K/V heads are repeated ``W / gcd(H_kv, W)`` times
            when ``H_kv % W != 0``.
        dropout_p: must be 0.0.  softmax_scale: defaults to ``D ** -0.5``.
        causal: causal mask over the *global* sequence.
        window_size: flash-attn sliding window ``(left, right)`` over global positions
            (-1: unbounded).  alibi_slopes: must be None.
        deterministic: require a block kernel with a deterministic backward.
        return_attn_probs: also return ``lse [B, H, S_local]`` (as ``(out, lse, None)``).
        group: the context-parallel process group (default: the default group).
        layout: "ring", "zigzag" or "stripe": which tokens each rank holds. Any layout works
            (causal or not); the all-to-all undoes the layout's permutation for causal masks.
        backend: block-kernel backend name, or None for automatic choice.

    Returns:
        ``out [B, S_local, H, D]`` (or ``(out, lse, None)``).
    """
    return _ulysses(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        group,
        layout,
        backend,
    )


def ulysses_flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: Layout = "ring",
    backend: str | None = None,
):
    """:func:`ulysses_flash_attn_func` with ``kv [B, S_local, 2, H_kv, D]``."""
    _check_packed("kv", kv, 2)
    return _ulysses(
        q,
        kv[:, :, 0],
        kv[:, :, 1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        group,
        layout,
        backend,
    )


def ulysses_flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: Layout = "ring",
    backend: str | None = None,
):
    """:func:`ulysses_flash_attn_func` with ``qkv [B, S_local, 3, H, D]``."""
    _check_packed("qkv", qkv, 3)
    return _ulysses(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        group,
        layout,
        backend,
    )


# --- 2-D hybrid ----------------------------------------------------------------------------


def hybrid_token_indices(
    layout: str,
    seq_len: int,
    ring_rank: int,
    ring_size: int,
    ulysses_rank: int,
    ulysses_size: int,
) -> Tensor:
    """Global token indices (int64, ``[seq_len // (ring_size * ulysses_size)]``) held by the
    rank at ``(ring_rank, ulysses_rank)``: piece ``ulysses_rank`` of ``ulysses_size`` contiguous
    pieces of the ring layout's shard of ``ring_rank`` (Note [Hybrid token assignment]).

    Raises ``ValueError`` if the sequence does not divide as the layout needs.
    """
    ring_idx = token_indices(layout, seq_len, ring_rank, ring_size)
    n = ring_idx.numel()
    if n % ulysses_size != 0:
        raise ValueError(
            f"a ring shard of {n} tokens (sequence length {seq_len} over {ring_size} ring "
            f"ranks) does not split over {ulysses_size} Ulysses ranks; pad the sequence to a "
            f"multiple of {local_seq_divisor(layout, ring_size) * ulysses_size}"
        )
    if not 0 <= ulysses_rank < ulysses_size:
        raise ValueError(f"ulysses_rank={ulysses_rank} is outside [0, {ulysses_size})")
    return ring_idx.view(ulysses_size, n // ulysses_size)[ulysses_rank].clone()


def hybrid_shard_local(
    full: Tensor,
    layout: Layout,
    ring_rank: int,
    ring_size: int,
    ulysses_rank: int,
    ulysses_size: int,
    seq_dim: int = 1,
) -> Tensor:
    """The part of ``full`` (whole sequence along ``seq_dim``) that the rank at
    ``(ring_rank, ulysses_rank)`` holds for :func:`hybrid_flash_attn_func` (a copy).

    Returns ``full`` with dim ``seq_dim`` reduced to ``S // (ring_size * ulysses_size)`` tokens.
    """
    idx = hybrid_token_indices(
        layout, full.shape[seq_dim], ring_rank, ring_size, ulysses_rank, ulysses_size
    )
    return full.index_select(seq_dim, idx.to(full.device))


def hybrid_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    layout: Layout = "zigzag",
    backend: str | None = None,
):
    """2-D context parallelism: Ulysses over ``ulysses_group``, ring over ``ring_group``.

    See Note [Hybrid token assignment]: shard the inputs with :func:`hybrid_shard_local`.

    Args:
        q: ``[B, S_local, H, D]``; k, v: ``[B, S_local, H_kv, D]`` with
            ``S_local = S / (R * U)`` (R, U: ring and Ulysses group sizes); ``H % U == 0``.
        causal: causal mask over the global sequence; layouts other than "ring" need it.
        ulysses_group: the Ulysses group (e.g. the GPUs of a node).
        ring_group: the ring group (the ranks with the same Ulysses rank across nodes).
        layout: ring layout over ``ring_group`` ("zigzag" balances causal attention).
        Other arguments as in :func:`ulysses_flash_attn_func`.

    Returns:
        ``out [B, S_local, H, D]`` (or ``(out, lse [B, H, S_local], None)``).

    Algorithm::

        [B, S_local, H, D] --a2a(U)--> [B, S_local*U, H/U, D] --ring(R)--> same --a2a(U)--> back
    """
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    check_layout_causal(layout, causal, ring_func='hybrid_flash_attn_func(layout="ring")')
    check_qkv_tensors(q, k, v)
    u_name, r_name = _group_name(ulysses_group), _group_name(ring_group)
    U = dist.get_world_size(ulysses_group)
    seq_len = q.shape[1] * U * dist.get_world_size(ring_group)
    _, window = normalize_window(window_size, causal, seq_len)
    _check_heads(q.shape[2], U, "hybrid attention (Ulysses dim)")
    if layout == "zigzag" and (q.shape[1] * U) % 2 != 0:
        raise ValueError(
            f"zigzag needs an even ring-shard length S_local * U, got {q.shape[1]} * {U}; pad "
            "the global sequence to a multiple of 2 * ring_size * ulysses_size"
        )
    backend = select_backend_name(
        *_head_views(q, k, U), backend, deterministic=deterministic, window=window is not None
    )
    scale = _scale(q, softmax_scale)
    qh, kh, vh = _to_heads(q, k, v, u_name, U, "ring")  # plain concatenation: no reordering
    out_h, lse_h = ring_attention(qh, kh, vh, r_name, layout, causal, scale, backend, *window_size)
    out = ulysses_all_to_all(out_h, u_name, 1, 2, False, "ring")
    if not return_attn_probs:
        return out
    return out, ulysses_all_to_all(lse_h, u_name, 2, 1, False, "ring"), None


# --- communication cost model --------------------------------------------------------------


class CommVolume(NamedTuple):
    """Bytes one rank sends in the forward and in the backward of one attention call."""

    forward: int
    backward: int


def comm_volume(
    S: int,
    H: int,
    H_kv: int,
    D: int,
    world_size: int,
    mode: str,
    dtype_bytes: int = 2,
    ulysses_size: int | None = None,
) -> CommVolume:
    """Per-rank bytes sent by one attention call of batch 1 (multiply by B), per docs/ulysses.md.

    Args:
        S: global sequence length; H, H_kv: query and K/V heads; D: head dim.
        world_size: ranks in the context-parallel group (hybrid: ring size x Ulysses size).
        mode: "ring", "ulysses" or "hybrid".
        dtype_bytes: bytes per element of q/k/v (2 for bf16/fp16). Ring attention's travelling
            dK/dV accumulators use the accumulation dtype (4 bytes; 8 for fp64).
        ulysses_size: the Ulysses group size U (hybrid only; must divide world_size).

    Formulas (``n = S / world_size`` tokens per rank, ``b = dtype_bytes``, ``a`` accumulation
    bytes, ``H_kv' = H_kv * W / gcd(H_kv, W)`` for a Ulysses group of W)::

        ring     fwd (W-1) * 2 n H_kv D b            bwd fwd + W * 2 n H_kv D a
        ulysses  fwd (W-1)/W * n D (2H + 2H_kv') b   bwd the same (dout, dq, dk, dv)
        hybrid   Ulysses over U with n, then ring over R = W/U on n*U tokens, H_kv'/U heads

    The lse all-to-all of ``return_attn_probs=True`` (``n H`` accumulation-dtype values) is not
    counted.
    """
    if mode not in ("ring", "ulysses", "hybrid"):
        raise ValueError(f"mode={mode!r}; choose 'ring', 'ulysses' or 'hybrid'")
    W = world_size
    if S % W != 0:
        raise ValueError(f"S={S} is not divisible by world_size={W}")
    acc = 8 if dtype_bytes == 8 else 4
    n = S // W

    def ring(R: int, tokens: int, kv_heads: int) -> CommVolume:
        kv = 2 * tokens * kv_heads * D
        fwd = (R - 1) * kv * dtype_bytes
        return CommVolume(fwd, fwd + (R * kv * acc if R > 1 else 0))

    def ulysses(U: int) -> CommVolume:
        if H % U != 0:
            raise ValueError(f"H={H} is not divisible by the Ulysses group size {U}")
        kv_heads = H_kv * _kv_repeat(H_kv, U)
        vol = (U - 1) * n * D * (2 * H + 2 * kv_heads) * dtype_bytes // U
        return CommVolume(vol, vol)

    if mode == "ring":
        return ring(W, n, H_kv)
    if mode == "ulysses":
        return ulysses(W)
    if ulysses_size is None or W % ulysses_size != 0:
        raise ValueError(f"hybrid needs ulysses_size dividing world_size={W}, got {ulysses_size}")
    U = ulysses_size
    a2a = ulysses(U)
    r = ring(W // U, n * U, H_kv * _kv_repeat(H_kv, U) // U)
    return CommVolume(a2a.forward + r.forward, a2a.backward + r.backward)
