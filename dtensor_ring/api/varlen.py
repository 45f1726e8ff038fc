"""Varlen front doors: packed documents in any per-document layout and algorithm
(:func:`ring_varlen_attention_func`), the all-gather (llama3_zigzag's, and llama3's packed
stream). ring-flash-attention's names are in :mod:`dtensor_ring.compat.ring_flash_attn`.

Layout of every tensor (flash-attn varlen convention), per rank:
    q ``[T_local, H, D]``, k/v ``[T_local, H_kv, D]`` (``H % H_kv == 0``: GQA/MQA),
    kv (kv-packed) ``[T_local, 2, H_kv, D]``, qkv (qkv-packed) ``[T_local, 3, H, D]``.
    Returns ``out [T_local, H, D]``; with ``return_attn_probs=True``, ``(out, lse, None)``
    where ``lse [H, T_local]`` is the natural-log log-sum-exp (fp32, or fp64 for fp64 inputs),
    without gradient.

Which tokens a rank holds (Note [Varlen layouts] in ``layouts/varlen.py``; shard with
:func:`dtensor_ring.shard_varlen`):

* ``ring`` (``ring_flash_attn_varlen_*``): every document cut into W pieces, piece r on
  rank r; ``cu_seqlens`` = global ``cu_seqlens // W``. Causal or not.
* ``zigzag`` (``zigzag_ring_flash_attn_varlen_*``): every document cut into 2W pieces, pieces
  r and 2W-1-r on rank r; ``cu_seqlens`` = global ``cu_seqlens // W``. The ring: causal only.
* ``llama3`` (:func:`llama3_attention_func`, ``llama3_flash_attn_varlen_*``): the packed
  stream cut into W contiguous slices; the metadata comes from
  :func:`dtensor_ring.llama3_flash_attn_prepare_cu_seqlens`.
* ``llama3_zigzag_flash_attn_varlen_func``: zigzag's tokens (pieces r and 2W-1-r of every
  document), K/V all-gathered (balanced all-gather attention); ``cu_seqlens`` = global
  ``cu_seqlens // W``. Causal or not. ``llama3_zigzag_flash_attn_func`` is its dense form.

Arguments common to every function here (and to its compatibility names):
    cu_seqlens (ring, zigzag): int32 ``[N + 1]`` *local* document boundaries (global
        ``cu_seqlens // W``), on the CPU or q's device.
    max_seqlen (ring, zigzag): longest local document (an upper bound is fine), or None.
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice (llama3): this rank's
        metadata from ``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, W)``
        (int32 tensors, ints, a slice).
    heads_k_stride (llama3, llama3_zigzag): KV heads all-gathered at a time (must divide
        H_kv); smaller saves memory and hides more of the gathers behind compute, larger means
        fewer collectives.
    dropout_p: must be 0.0.  alibi_slopes: must be None.
    softmax_scale: defaults to ``D ** -0.5``.
    causal: causal mask within each document (zigzag: must be True).
    window_size: flash-attn sliding window ``(left, right)`` within each document, over its
        global positions (Note [Windowed varlen]; docs/window.md).
    deterministic: require a block kernel with a deterministic backward.
    return_attn_probs: also return ``lse [H, T_local]`` (as ``(out, lse, None)``).
    group: the context-parallel process group (default: the default group).
    backend (keyword only): block-kernel backend name (must support varlen; on CPU: "math"),
        or None for automatic choice.
    sinks (keyword only): per-head attention-sink logits ``[H]``, or None (Note [Attention
        sinks]; as in :mod:`dtensor_ring.api.functional`).

Every argument is checked on every rank before any communication (Note [Call resolution]);
the ops check the values of the ``cu_seqlens`` tensors when they run, also before any
communication. Bad input raises ``ValueError`` naming it (see docs/varlen.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor

from ..algorithm import Algorithm
from ..consistency import comparing
from ..layouts import get_layout
from ..layouts.varlen import host_values
from ..ops.common import call_attention
from ..ops.varlen import llama3_attention
from ..resolve import (
    Call,
    Door,
    check_cu_seqlens_arg,
    check_heads_k_stride,
    group_arg,
    local_k_slice_bounds,
    max_seqlen_value,
    normalize_window,
    resolve_call,
)
from ..schedule.llama3 import check_llama3_metadata, llama3_locals_disagree
from .attend import dense_attention, varlen_attention

if TYPE_CHECKING:
    from .documents import PlacedRows

Result = Tensor | tuple[Tensor, Tensor, None]  # out, or (out, lse, None)


def ring_varlen_attention_func(
    layout: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    sinks: Tensor | None = None,
    algorithm: Algorithm | None = None,
    positions: Tensor | None = None,
) -> Result:
    """Context-parallel attention over packed documents in any registered per-document varlen
    ``layout`` (the functions below fix it): ``q [T_local, H, D]``, ``k, v [T_local, H_kv,
    D]`` -> ``out [T_local, H, D]``. ``algorithm`` (Note [Layouts and algorithms]): "ring"
    (the default), "all_gather" (``heads_k_stride=1``) or "auto" (zigzag's tokens; ring or
    all-gather, whichever the cost model predicts faster); None: the layout alias's.
    ``positions`` (int ``[T_local]``, optional): each local token's index in the whole packed
    sequence, as sharded by whoever made the shards; checked against ``layout``'s tokens
    (``ValueError`` naming the door that fits, e.g. head-tail shards of a packed row; one host
    copy of ``positions`` per call)."""
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        layout=layout,
        algorithm=algorithm,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dropout_p=dropout_p,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        group=group,
        backend=backend,
        sinks=sinks,
        positions=positions,
    )
    return (out, lse, None) if return_attn_probs else out


def gather_varlen_attention_func(
    layout: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    heads_k_stride: int = 1,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    sinks: Tensor | None = None,
) -> Result:
    """All-gather attention over packed documents in a per-document ``layout`` (Note
    [Balanced all-gather attention]): ``q [T_local, H, D]``, ``k, v [T_local, H_kv, D]`` ->
    ``out [T_local, H, D]``; ``cu_seqlens`` the local boundaries (global ``// W``), as ring
    varlen."""
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        layout=layout,
        algorithm=None,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dropout_p=dropout_p,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        group=group,
        backend=backend,
        sinks=sinks,
        heads_k_stride=heads_k_stride,
        allowed=("all_gather",),
    )
    return (out, lse, None) if return_attn_probs else out


def llama3_zigzag_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    heads_k_stride: int = 1,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    sinks: Tensor | None = None,
) -> Result:
    """Balanced all-gather (llama3) attention over packed documents: every document cut into
    2W pieces, pieces r and 2W-1-r on rank r (shard with ``shard_varlen(..., "llama3_zigzag",
    ...)``), K/V all-gathered per group of ``heads_k_stride`` KV heads.

    ``q [T_local, H, D]``, ``k, v [T_local, H_kv, D]``, ``cu_seqlens`` the local boundaries
    (global ``// W``) -> ``out [T_local, H, D]`` (other arguments: module docstring).
    """
    return gather_varlen_attention_func(
        "llama3_zigzag",
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        heads_k_stride,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        group,
        backend=backend,
        sinks=sinks,
    )


def llama3_zigzag_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    heads_k_stride: int = 1,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    sinks: Tensor | None = None,
    layout: str = "llama3_zigzag",
) -> Result:
    """Balanced all-gather attention of dense sequences in ``layout`` (zigzag's tokens by
    default, ``shard_local(x, "llama3_zigzag", rank, W)``; any layout of consecutive runs):
    every row is one document of the packed form (a view, no copy), so ``q [B, S_local, H,
    D]``, ``k, v [B, S_local, H_kv, D]`` -> ``out [B, S_local, H, D]``; with
    ``return_attn_probs``, ``lse [B, H, S_local]`` (other arguments:
    :mod:`dtensor_ring.api.functional`'s docstring)."""
    out, lse = dense_attention(
        q,
        k,
        v,
        layout=layout,
        algorithm=None,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dropout_p=dropout_p,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        group=group,
        backend=backend,
        sinks=sinks,
        heads_k_stride=heads_k_stride,
        allowed=("all_gather",),
        return_lse=return_attn_probs,
    )
    return (out, lse, None) if return_attn_probs else out


def llama3_attention_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    heads_k_stride: int,
    local_k_slice: slice,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str | None = None,
    sinks: Tensor | None = None,
    layout: str = "llama3",
) -> Result:
    """All-gather attention over packed documents in a stream ``layout``: ``q [L, H, D]``,
    ``k, v [L, H_kv, D]`` -> ``out [L, H, D]`` (Note [llama3 all-gather attention])."""
    name, world_size = group_arg(group)

    def checks() -> tuple[int | None, int | None, int, int]:
        if get_layout(layout).varlen != "stream":  # its metadata would be misread
            raise ValueError(
                f"layout={layout!r} shards every document; llama3_attention_func takes the "
                "stream layout's metadata (llama3_flash_attn_prepare_cu_seqlens); call "
                "gather_varlen_attention_func (llama3_zigzag_flash_attn_varlen_func) with the "
                "local cu_seqlens instead"
            )
        check_heads_k_stride(heads_k_stride, k.shape[1])
        k_bounds = local_k_slice_bounds(local_k_slice)
        check_cu_seqlens_arg(cu_seqlens_q, q, "cu_seqlens_q")
        check_cu_seqlens_arg(cu_seqlens_k, q, "cu_seqlens_k")
        max_q = max_seqlen_value(max_seqlen_q, "max_seqlen_q")
        max_k = max_seqlen_value(max_seqlen_k, "max_seqlen_k")
        if comparing((name,)):  # the values too, so that one rank's error reaches every rank
            T = q.shape[0]  # (the op checks them again: a call that compares nothing)
            check_llama3_metadata(
                host_values(cu_seqlens_q), host_values(cu_seqlens_k), max_q, max_k, *k_bounds,
                T, normalize_window(window_size, causal, T * world_size)[0],
                dist.get_rank(group), world_size,
            )  # fmt: skip
        return max_q, max_k, *k_bounds

    def local() -> tuple:
        bq, bk = host_values(cu_seqlens_q), host_values(cu_seqlens_k)
        return bq, bk, (local_k_slice.start, local_k_slice.stop), q.shape[0]

    spec = resolve_call(
        Call(
            q,
            k,
            v,
            group_name=name,
            world_size=world_size,
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
            op="llama3_attention",
            algorithm="all_gather",
            form="varlen",
            checks=checks,
            metadata=lambda: {"heads_k_stride": heads_k_stride},
            local=local,
            check_locals=functools.partial(llama3_locals_disagree, causal=bool(causal)),
        ),
    )
    max_q, max_k, k_start, k_stop = spec.door
    out, lse = call_attention(
        llama3_attention,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_q,
        max_k,
        heads_k_stride,
        k_start,
        k_stop,
        *spec.op_args(),
        sinks,
    )
    return (out, lse, None) if return_attn_probs else out


def attend_rows(
    placed: PlacedRows,
    q_BLHD: Tensor,
    k_BLHD: Tensor,
    v_BLHD: Tensor,
    *,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    group: dist.ProcessGroup | None,
    algorithm: str | None = None,
) -> Tensor:
    """Attention of this rank's rows ``q [B, L_local, H, D]``, ``k, v [B, L_local, H_kv, D]``
    over the documents ``placed`` holds (:func:`placed_rows`), by the varlen kernels on the
    ring (or ``algorithm="all_gather"``: Note [Gathering what placed documents need]), with
    flash-attn's ``window_size`` within documents: ``out [B, L_local, H, D]``."""
    q_T, k_T, v_T = (placed.stream(t) for t in (q_BLHD, k_BLHD, v_BLHD))
    out_T = ring_varlen_attention_func(
        placed.layout, q_T, k_T, v_T, placed.cu_local, None, softmax_scale=softmax_scale,
        window_size=window_size, group=group, algorithm=algorithm,
    )  # fmt: skip
    return placed.rows(out_T, q_BLHD.shape[0])
