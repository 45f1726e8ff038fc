"""All-gather ("llama3") context parallelism for packed, document-masked sequences.

Note [llama3 all-gather attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The packed stream of T tokens is cut into W contiguous slices of L = T/W tokens; documents
may straddle ranks (Note [Varlen layouts]). Rank r keeps its queries and all-gathers K/V, in
groups of ``heads_k_stride`` KV heads so only one group's full K/V is in memory at a time:

    gather(group 0)
    for g in groups:                       (G = H // H_kv query heads per KV head)
        causal: diagonal  q_g vs local K/V_g, square causal per local document   [no comm]
        wait gather(g); start gather(g + 1)          (overlaps the rest of group g)
        causal: prefix    first local doc's queries vs its keys on earlier ranks, full;
                          merged into the diagonal's rows (Note [Online-softmax merge])
        non-causal:       q_g vs K/V_g[local_k_slice], per document (cu_seqlens_q/k)

Only the first local document can have keys before the rank's slice (it may have started on an
earlier rank); every other local document starts on this rank. So a causal rank computes
``cu_seqlens_q`` documents as square causal blocks on its own K/V (the block kernels'
top-left-aligned causal mask is exact for square blocks) plus one full block for the
straddling document's prefix, exactly the keys flash-attn's bottom-right-aligned causal mask
would show it for ``llama3_flash_attn_prepare_cu_seqlens``'s ``cu_seqlens_k``. The diagonal
needs no communication, so it also overlaps the gather.

A sliding window (positions within a document) changes only the masks. Causal: the
diagonal's square per-document blocks take the window as is (flash's bottom-right alignment is
exact for square blocks), and the prefix block is trimmed to the queries and keys the window
keeps (Note [Windowed schedules] in ``plan.py``), or skipped when it keeps none. Non-causal:
each document's queries (a part of the document) against all its keys is one block trimmed the
same way; documents whose blocks share a mask make one varlen call (Note [Windowed varlen] in
``varlen.py``); without a window that is a single call over all documents.

Backward, per group: the diagonal's dK/dV are local; the prefix (causal) or all (non-causal)
dK/dV contributions land in a ``[W*L]``-token buffer that is reduce-scattered, asynchronously
(overlapping the next group). The buffer and the reduce-scatter are in the accumulation dtype
(fp32 for bf16/fp16): a rank's dK is a sum over up to W ranks' contributions, and summing
bf16 partials in bf16 would round at every addition (NCCL reduces in the tensor's dtype). That
doubles the reduce-scatter's bytes for bf16 inputs, on a transfer that overlaps the next
group's kernels. K/V are gathered in their input dtype (exact).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .kernels import BlockKernel, accumulation_dtype
from .merge import merge_
from .plan import UNBOUNDED, Block, run_block, window_bounds
from .validation import check_qkv_tensors
from .varlen import (
    VarlenBlocks,
    check_bounds,
    check_cu_seqlens_device,
    check_cu_seqlens_tensor,
    check_divisible,
    check_max_seqlen,
    host_values,
    merge_doc_blocks,
    span_rows,
)

# all_gather_into_tensor / reduce_scatter_tensor are deprecated in newer torch in favour of
# the *_single names (same signature); use whichever this torch has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def llama3_flash_attn_prepare_cu_seqlens(
    cu_seqlens: Tensor, causal: bool, rank: int, world_size: int
) -> tuple[Tensor, Tensor, int, int, slice]:
    """Per-rank metadata of the llama3 layout, as ring-flash-attention's function of this name.

    Args:
        cu_seqlens: *global* document boundaries ``[N + 1]``, int32, ``cu_seqlens[-1] = T``
            with ``T % world_size == 0``. Read on the host (a sync if it is on a GPU).
        causal: the attention will be causal (then ``cu_seqlens_k`` stops at the rank's slice
            end; otherwise the last local document's keys run to the document's end).
        rank, world_size: position in, and size of, the context-parallel group.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``:
        ``cu_seqlens_q`` int32 ``[n + 1]``, the rank's local documents (its slice of L = T/W
        tokens cut at document boundaries); ``cu_seqlens_k`` int32 ``[n + 1]``, each local
        document's keys within the all-gathered K/V restricted to ``local_k_slice`` (a
        ``slice`` of the T gathered tokens: from the first local document's start); the
        ``max_seqlen_*`` are Python ints. Tensors are on ``cu_seqlens``'s device.

    Raises:
        ValueError: bad ``cu_seqlens``, ``T % world_size != 0``, or a rank out of range.
    """
    check_cu_seqlens_tensor(cu_seqlens)
    bounds = host_values(cu_seqlens)
    check_bounds(bounds, bounds[-1])
    check_divisible(bounds, "llama3", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    length = bounds[-1] // world_size
    lo, hi = rank * length, (rank + 1) * length
    left = max(i for i, b in enumerate(bounds) if b <= lo)  # the document holding token lo
    right = min(i for i, b in enumerate(bounds) if b >= hi)  # first boundary at/after hi
    docs = list(bounds[left : right + 1])
    cu_q = [0, *(b - lo for b in docs[1:-1]), length]
    slice_left = docs[0]
    slice_right = hi if causal else docs[-1]
    cu_k = [b - slice_left for b in docs[:-1]] + [slice_right - slice_left]

    def tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=cu_seqlens.device)

    return (
        tensor(cu_q),
        tensor(cu_k),
        max(b - a for a, b in zip(cu_q[:-1], cu_q[1:], strict=True)),
        max(b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True)),
        slice(slice_left, slice_right),
    )


@dataclass(frozen=True)
class Llama3Meta:
    """Checked metadata of one rank's llama3 call (built by :func:`llama3_meta`).

    ``cu_q``/``cu_k`` are on the tensors' device; ``prefix`` (causal only) is the number of
    keys of the first local document before this rank's slice (0: it starts here), and
    ``first_len`` that document's local length. ``window``: the causal sliding window
    ``(left, 0)`` or None; ``prefix_block``: the first document's queries against its keys on
    earlier ranks, spans relative to the document's local queries and to its prefix keys
    (None: nothing to compute). Non-causal: ``blocks`` (:class:`DocSpans` parts: query rows,
    and key rows of the ``local_k_slice``) and their ``rows``.
    """

    causal: bool
    rank: int
    world_size: int
    local_len: int
    k_start: int
    k_stop: int
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    prefix: int
    first_len: int
    window: tuple[int, int] | None
    prefix_block: Block | None
    blocks: tuple[Block, ...]
    rows: VarlenBlocks | None


def llama3_meta(
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    k_start: int,
    k_stop: int,
    local_len: int,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None = None,
) -> Llama3Meta:
    """Check the llama3 metadata against this rank's ``local_len`` tokens; raise ValueError.

    ``window``: a normalised sliding window (``validation.normalize_window``).
    """
    check_cu_seqlens_tensor(cu_seqlens_q, "cu_seqlens_q")
    check_cu_seqlens_tensor(cu_seqlens_k, "cu_seqlens_k")
    bq = host_values(cu_seqlens_q)
    bk = host_values(cu_seqlens_k)
    check_bounds(bq, local_len, "cu_seqlens_q")
    if not 0 <= k_start < k_stop <= world_size * local_len:
        raise ValueError(
            f"local_k_slice=slice({k_start}, {k_stop}) must lie within the "
            f"{world_size * local_len} gathered tokens and be non-empty"
        )
    check_bounds(bk, k_stop - k_start, "cu_seqlens_k", "the length of local_k_slice")
    if len(bk) != len(bq):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same documents, got {len(bq)} and "
            f"{len(bk)} entries"
        )
    prefix = rank * local_len - k_start
    if causal:
        shifted = [b + prefix for b in bq[1:]]
        if prefix < 0 or list(bk[1:]) != shifted:
            raise ValueError(
                "causal llama3 attention needs cu_seqlens_k and local_k_slice as "
                "llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal=True, rank, world_size) "
                f"returns them for rank {rank}: with local_k_slice.start={k_start} the keys of "
                f"local document i must end where its queries end, i.e. cu_seqlens_k[1:] == "
                f"{shifted}, got {list(bk[1:])}"
            )
    hint = "what llama3_flash_attn_prepare_cu_seqlens returns"
    check_max_seqlen("max_seqlen_q", max_seqlen_q, bq, hint)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, bk, hint)
    return _llama3_meta_cached(
        tuple(bq),
        tuple(bk),
        k_start,
        k_stop,
        local_len,
        causal,
        rank,
        world_size,
        torch.device(device),
        window,
    )


@functools.lru_cache(maxsize=64)
def _llama3_meta_cached(
    bq: tuple[int, ...],
    bk: tuple[int, ...],
    k_start: int,
    k_stop: int,
    local_len: int,
    causal: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    window: tuple[int, int] | None,
) -> Llama3Meta:
    # Cached on the values: the cu_seqlens tensors are copied to ``device`` once per batch.
    prefix = rank * local_len - k_start if causal else 0
    prefix_block, blocks, rows = None, (), None
    if prefix:  # queries at document positions prefix + i, keys at positions 0..prefix-1
        lo = -UNBOUNDED if window is None else -window[0]
        prefix_block = run_block((0, bq[1], prefix), (0, prefix, 0), 1, lo, 0, init=False)
    if not causal:  # document i: its local queries (from position a_i) against all its keys
        bounds = window_bounds(False, window) if window else (-UNBOUNDED, UNBOUNDED)
        per_doc = [
            (
                (),
                run_block(
                    (bq[i], bq[i + 1] - bq[i], rank * local_len - k_start if i == 0 else 0),
                    (bk[i], bk[i + 1] - bk[i], 0),
                    1,
                    *bounds,
                    init=True,
                ),
                0,
            )
            for i in range(len(bq) - 1)
            if bq[i + 1] > bq[i]
        ]
        blocks = merge_doc_blocks(per_doc)
        rows = span_rows(blocks, device)
    return Llama3Meta(
        causal=causal,
        rank=rank,
        world_size=world_size,
        local_len=local_len,
        k_start=k_start,
        k_stop=k_stop,
        cu_q=torch.tensor(bq, dtype=torch.int32, device=device),
        cu_k=torch.tensor(bk, dtype=torch.int32, device=device),
        max_q=max(b - a for a, b in zip(bq[:-1], bq[1:], strict=True)),
        max_k=max(b - a for a, b in zip(bk[:-1], bk[1:], strict=True)),
        prefix=prefix,
        first_len=bq[1],
        window=window,
        prefix_block=prefix_block,
        blocks=blocks,
        rows=rows,
    )


def check_heads_k_stride(heads_k_stride: int, num_kv_heads: int) -> None:
    """``heads_k_stride`` must be a positive divisor of the number of KV heads."""
    if (
        not isinstance(heads_k_stride, int)
        or heads_k_stride < 1
        or (num_kv_heads % heads_k_stride != 0)
    ):
        raise ValueError(
            f"heads_k_stride={heads_k_stride} must be a positive divisor of the number of "
            f"key/value heads H_kv={num_kv_heads} (K/V are all-gathered heads_k_stride heads "
            "at a time)"
        )


def check_llama3_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    heads_k_stride: int,
    k_start: int,
    k_stop: int,
    *,
    causal: bool,
    rank: int,
    world_size: int,
    window: tuple[int, int] | None = None,
) -> Llama3Meta:
    """Every check of one rank's llama3 call (no communication); returns its metadata.

    ``q [L, H, D]``, ``k``/``v [L, H_kv, D]``; the rest as :func:`llama3_meta`.

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    check_qkv_tensors(q, k, v, seq_dims="T_local")
    check_heads_k_stride(heads_k_stride, k.shape[1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_seqlens_tensor(cu, name)
        check_cu_seqlens_device(cu, q, name)
    return llama3_meta(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        k_start,
        k_stop,
        q.shape[0],
        causal,
        rank,
        world_size,
        q.device,
        window,
    )


class _KVGather:
    """Asynchronous all-gather of one group of KV heads, into two alternating buffers."""

    def __init__(self, k_THD: Tensor, v_THD: Tensor, stride: int, group: dist.ProcessGroup):
        self.k, self.v, self.stride, self.group = k_THD, v_THD, stride, group
        world_size = dist.get_world_size(group)
        L, _, D = k_THD.shape
        self._buffers = [k_THD.new_empty(world_size * L, 2, stride, D) for _ in range(2)]
        self._turn = 0

    def start(self, h: int):
        """Start gathering KV heads ``[h, h + stride)``; ``.wait()`` -> ``(k, v) [W*L, s, D]``."""
        heads = slice(h, h + self.stride)
        local = torch.stack([self.k[:, heads], self.v[:, heads]], dim=1)  # [L, 2, s, D]
        out = self._buffers[self._turn]
        self._turn ^= 1
        work = _all_gather(out, local, group=self.group, async_op=True)
        return _Pending(work, (out[:, 0], out[:, 1]), local)


class _Pending:
    """An async collective; holds its input until :meth:`wait` (allocator safety)."""

    def __init__(self, work, result, keep_alive: Tensor):
        self._work, self._result, self._keep_alive = work, result, keep_alive

    def wait(self):
        self._work.wait()
        self._keep_alive = None
        return self._result


def _prefix_parts(m: Llama3Meta) -> tuple[Block, slice, slice]:
    """The prefix block, its query rows (local) and its keys (in the gathered K/V)."""
    blk = m.prefix_block
    (q0, q1), (k0, k1) = blk.q.bounds(m.first_len), blk.kv.bounds(m.prefix)
    return blk, slice(q0, q1), slice(m.k_start + k0, m.k_start + k1)


def _head_groups(H: int, H_kv: int, stride: int) -> Sequence[tuple[int, slice]]:
    """``(first KV head, query-head slice)`` of every group of ``stride`` KV heads."""
    G = H // H_kv
    return [(h, slice(h * G, (h + stride) * G)) for h in range(0, H_kv, stride)]


def llama3_forward(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    meta: Llama3Meta,
    heads_k_stride: int,
    group: dist.ProcessGroup,
    kernel: BlockKernel,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Forward of one rank (Note [llama3 all-gather attention]).

    Args:
        q_THD: local queries ``[L, H, D]``; k_THD, v_THD: local ``[L, H_kv, D]``.
        meta: from :func:`llama3_meta`; heads_k_stride: KV heads per all-gather.

    Returns:
        ``(out [L, H, D]`` in the input dtype, ``lse [H, L]`` in the accumulation dtype).
    """
    L, H, D = q_THD.shape
    acc = accumulation_dtype(q_THD.dtype)
    out = torch.empty_like(q_THD, memory_format=torch.contiguous_format)
    lse = torch.empty(H, L, dtype=acc, device=q_THD.device)
    groups = _head_groups(H, k_THD.shape[1], heads_k_stride)
    gather = _KVGather(k_THD, v_THD, heads_k_stride, group)
    pending = gather.start(groups[0][0])
    m = meta
    for i, (h, hq) in enumerate(groups):
        q_g = q_THD[:, hq]
        if m.causal:  # the diagonal needs only local K/V: it runs while the gather is in flight
            kv_heads = slice(h, h + heads_k_stride)
            out_g, lse_g = kernel.forward_varlen(
                q_g,
                k_THD[:, kv_heads],
                v_THD[:, kv_heads],
                m.cu_q,
                m.cu_q,
                m.max_q,
                m.max_q,
                causal=m.window is None,
                scale=scale,
                window=m.window,
            )
        k_full, v_full = pending.wait()
        if i + 1 < len(groups):
            pending = gather.start(groups[i + 1][0])
        if m.causal:
            lse[hq] = lse_g
            out[:, hq] = out_g
            if m.prefix_block is not None:
                blk, rows, keys = _prefix_parts(m)
                out_p, lse_p = kernel.forward(
                    q_g[None, rows],
                    k_full[None, keys],
                    v_full[None, keys],
                    causal=blk.causal,
                    scale=scale,
                    window=blk.window,
                )
                out_rows = out_g[rows].to(acc)
                lse_rows = lse[hq, rows]
                merge_(out_rows[None], lse_rows[None], out_p, lse_p)
                lse[hq, rows] = lse_rows
                out[rows, hq] = out_rows.to(out.dtype)
        else:
            keys = slice(m.k_start, m.k_stop)
            k_keys, v_keys, rows = k_full[keys], v_full[keys], m.rows
            for blk in m.blocks:  # every query row in exactly one block
                out_b, lse_b = rows.forward(
                    kernel,
                    rows.take(q_g, blk.q),
                    rows.take(k_keys, blk.kv),
                    rows.take(v_keys, blk.kv),
                    blk,
                    scale,
                )
                rows.init_(out[:, hq], lse[hq], blk.q, out_b, lse_b)
    return out, lse


def llama3_backward(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: Llama3Meta,
    heads_k_stride: int,
    group: dist.ProcessGroup,
    kernel: BlockKernel,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one rank; returns ``(dq [L, H, D], dk, dv [L, H_kv, D])`` in input dtypes.

    dK/dV contributions to other ranks' keys are reduce-scattered in the accumulation dtype
    (Note [llama3 all-gather attention]), one group behind the computation.
    """
    L, H, D = q_THD.shape
    W = meta.world_size
    acc = accumulation_dtype(q_THD.dtype)
    dq = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
    dk = torch.zeros(k_THD.shape, dtype=acc, device=q_THD.device)
    dv = torch.zeros(v_THD.shape, dtype=acc, device=q_THD.device)
    groups = _head_groups(H, k_THD.shape[1], heads_k_stride)
    gather = _KVGather(k_THD, v_THD, heads_k_stride, group)
    pending = gather.start(groups[0][0])
    reducing = None  # (work, result [L, 2, s, D], kv heads, input) of the previous group
    m = meta

    def finish(reduced) -> None:
        work, result, kv_heads, _input = reduced  # the input stays alive until the wait
        work.wait()
        dk[:, kv_heads] += result[:, 0]
        dv[:, kv_heads] += result[:, 1]

    for i, (h, hq) in enumerate(groups):
        kv_heads = slice(h, h + heads_k_stride)
        args_q = (dout_THD[:, hq], q_THD[:, hq])
        out_g, lse_g = out_THD[:, hq], lse_HT[hq]
        if m.causal:  # local diagonal, while the gather is in flight
            dq_d, dk_d, dv_d = kernel.backward_varlen(
                *args_q,
                k_THD[:, kv_heads],
                v_THD[:, kv_heads],
                out_g,
                lse_g,
                m.cu_q,
                m.cu_q,
                m.max_q,
                m.max_q,
                causal=m.window is None,
                scale=scale,
                window=m.window,
            )
            dq[:, hq] += dq_d
            dk[:, kv_heads] += dk_d
            dv[:, kv_heads] += dv_d
        k_full, v_full = pending.wait()
        if i + 1 < len(groups):
            pending = gather.start(groups[i + 1][0])
        dkv_full = torch.zeros(W * L, 2, heads_k_stride, D, dtype=acc, device=q_THD.device)
        if m.causal:
            if m.prefix_block is not None:
                blk, rows, keys = _prefix_parts(m)
                dq_p, dk_p, dv_p = kernel.backward(
                    *(x[None, rows] for x in args_q),
                    k_full[None, keys],
                    v_full[None, keys],
                    out_g[None, rows],
                    lse_g[None, :, rows],
                    causal=blk.causal,
                    scale=scale,
                    window=blk.window,
                )
                dq[rows, hq] += dq_p[0]
                dkv_full[keys, 0] = dk_p[0]
                dkv_full[keys, 1] = dv_p[0]
        else:
            keys = slice(m.k_start, m.k_stop)
            k_keys, v_keys, rows = k_full[keys], v_full[keys], m.rows
            for blk in m.blocks:
                dq_b, dk_b, dv_b = rows.backward(
                    kernel,
                    *(rows.take(x, blk.q) for x in args_q),
                    rows.take(k_keys, blk.kv),
                    rows.take(v_keys, blk.kv),
                    rows.take(out_g, blk.q),
                    rows.take_lse(lse_g, blk.q),
                    blk,
                    scale,
                )
                rows.add_(dq[:, hq], blk.q, dq_b)
                rows.add_(dkv_full[keys, 0], blk.kv, dk_b)
                rows.add_(dkv_full[keys, 1], blk.kv, dv_b)
        if reducing is not None:
            finish(reducing)
        result = dkv_full.new_empty(L, 2, heads_k_stride, D)
        work = _reduce_scatter(result, dkv_full, group=group, async_op=True)
        reducing = (work, result, kv_heads, dkv_full)
    finish(reducing)
    return dq.to(q_THD.dtype), dk.to(k_THD.dtype), dv.to(v_THD.dtype)
