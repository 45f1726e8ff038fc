"""Ulysses (all-to-all) and 2-D hybrid (Ulysses x ring) front doors.

Public names: :func:`ulysses_flash_attn_func` (+ ``_kvpacked_func`` / ``_qkvpacked_func``),
:func:`hybrid_flash_attn_func`, :func:`hybrid_token_indices`, :func:`hybrid_shard_local`.
See docs/ulysses.md and Note [Ulysses attention] in ``ops/ulysses.py``.

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

import torch.distributed as dist
from torch import Tensor

from ..consistency import relay_errors
from ..layouts import Layout, LayoutName, get_layout, order_layout, token_indices
from ..ops.common import call_attention
from ..ops.ring import ring_attention
from ..ops.ulysses import (
    attention_on_heads,
    to_heads,
    ulysses_all_to_all,
    ulysses_local_attention,
)
from ..resolve import AttentionSpec, Call, Door, group_arg, resolve_call
from .packed import packed_form

Result = Tensor | tuple[Tensor, Tensor, None]  # out, or (out, lse, None)


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
    layout: LayoutName = "ring",
    backend: str | None = None,
    sinks: Tensor | None = None,
) -> Result:
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
        sinks: per-head attention-sink logits ``[H]``, or None (Note [Attention sinks]); the
            kernel applies those of the rank's heads, and each rank's gradient is its rows'
            share, as in every front door (Note [Sinks on head shards]).

    Returns:
        ``out [B, S_local, H, D]`` (or ``(out, lse, None)``).
    """
    name, W = group_arg(group)
    spec = resolve_call(
        Call(
            q,
            k,
            v,
            group_name=name,
            world_size=W,
            layout=layout,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            dropout_p=dropout_p,
            alibi_slopes=alibi_slopes,
            deterministic=deterministic,
            backend=backend,
            sinks=sinks,
        ),
        Door(op="ulysses", algorithm="ulysses", head_split=W, lse=return_attn_probs),
    )
    out, lse = ulysses_run(q, k, v, spec, sinks, group, return_attn_probs)
    return (out, lse, None) if return_attn_probs else out


def ulysses_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttentionSpec,
    sinks: Tensor | None,
    group: dist.ProcessGroup | None,
    return_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Ulysses attention of a resolved call (``spec`` with ``head_split=W``):
    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``(out [B, S_local, H, D],
    lse [B, H, S_local])``; lse None unless ``return_lse`` (its all-to-all skipped)."""
    name, _, causal, scale, backend, *window = spec.op_args()
    W = spec.world_size
    if W == 1:
        return call_attention(
            ulysses_local_attention, q, k, v, causal, scale, backend, *window, sinks
        )
    order = order_layout(spec.layout, causal, window)
    qh, kh, vh = to_heads(q, k, v, name, W, order)
    out_h, lse_h = attention_on_heads(
        ulysses_local_attention,
        qh,
        kh,
        vh,
        causal,
        scale,
        backend,
        *window,
        sinks=sinks,
        rank=dist.get_rank(group),
        group_name=name,
        layout=order,
    )
    out = ulysses_all_to_all(out_h, name, 1, 2, False, order)
    return out, ulysses_all_to_all(lse_h, name, 2, 1, False, order) if return_lse else None


ulysses_flash_attn_kvpacked_func = packed_form(ulysses_flash_attn_func, 2, False)
ulysses_flash_attn_qkvpacked_func = packed_form(ulysses_flash_attn_func, 3, False)


# --- 2-D hybrid ----------------------------------------------------------------------------


def hybrid_token_indices(
    layout: LayoutName | Layout,
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
        divisor = get_layout(layout, "dense").divisor(ring_size)
        raise ValueError(
            f"a ring shard of {n} tokens (sequence length {seq_len} over {ring_size} ring "
            f"ranks) does not split over {ulysses_size} Ulysses ranks; pad the sequence to a "
            f"multiple of {divisor * ulysses_size}"
        )
    if not 0 <= ulysses_rank < ulysses_size:
        raise ValueError(f"ulysses_rank={ulysses_rank} is outside [0, {ulysses_size})")
    return ring_idx.view(ulysses_size, n // ulysses_size)[ulysses_rank].clone()


def hybrid_shard_local(
    full: Tensor,
    layout: LayoutName | Layout,
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
    layout: LayoutName = "zigzag",
    backend: str | None = None,
    sinks: Tensor | None = None,
) -> Result:
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
    u_name, U = group_arg(ulysses_group, "ulysses_group")
    r_name, R = group_arg(ring_group, "ring_group")
    with relay_errors((r_name, u_name), "hybrid"):
        if u_name == r_name and U * R > 1:
            raise ValueError(
                "ulysses_group and ring_group are the same process group; hybrid attention "
                "needs two orthogonal groups (e.g. the GPUs of a node, and one rank per node)"
            )
    spec = resolve_call(
        Call(
            q,
            k,
            v,
            group_name=r_name,
            world_size=U * R,
            layout=layout,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            dropout_p=dropout_p,
            alibi_slopes=alibi_slopes,
            deterministic=deterministic,
            backend=backend,
            sinks=sinks,
        ),
        Door(
            op="hybrid",
            ring_func='hybrid_flash_attn_func(layout="ring")',
            layout_world=R,
            head_split=U,
            groups=(u_name,),
            lse=return_attn_probs,
        ),
    )
    qh, kh, vh = to_heads(q, k, v, u_name, U, "ring")  # plain concatenation: no reordering
    out_h, lse_h = attention_on_heads(
        ring_attention,
        qh,
        kh,
        vh,
        *spec.op_args(),
        sinks=sinks,
        rank=dist.get_rank(ulysses_group),
        group_name=u_name,
        layout="ring",
    )
    out = ulysses_all_to_all(out_h, u_name, 1, 2, False, "ring")
    if not return_attn_probs:
        return out
    return out, ulysses_all_to_all(lse_h, u_name, 2, 1, False, "ring"), None
