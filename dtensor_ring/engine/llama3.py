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

Note [Balanced all-gather attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The stream layout gives the last rank the most causal work (rank W-1 of one document does
~2x the average). Llama 3 trains with zigzag's tokens instead (layout "llama3_zigzag",
Note [Varlen layouts]): every document (a dense row is one document) is cut into 2W
pieces and rank r holds pieces r and 2W-1-r, one early and one late, so every rank computes
the same number of causal pairs of every document. K/V are all-gathered as above (rank-major:
rank s's local tokens at rows ``[s L, (s + 1) L)``) and put back in global order with one
``index_select`` per head group (``to_global``), so that the keys a query piece may see are
one contiguous range of its document. Example W = 4, one document of 8 pieces p0..p7, rank 1:

    gathered (rank-major)   p0 p7 | p1 p6 | p2 p5 | p3 p4        (ranks 0 | 1 | 2 | 3)
    global order            p0 p1 p2 p3 p4 p5 p6 p7
    rank 1, causal:   p1 (queries)  ->  keys p0 p1              w(-1, 0)
                      p6 (queries)  ->  keys p0 p1 p2 p3 p4 p5 p6  w(-1, 0)

Each query piece meets the keys ``[k0, k1)`` of its document: causal ``[0, end of the piece)``
(``k0`` trimmed to the window's left edge), non-causal the whole document (trimmed to the
window on both sides), with flash-attn's bottom-right-aligned mask ``window=(left, right)``
(causal: ``(-1, 0)``), which is exact because the keys end ``e`` positions after the piece
(``e = 0`` causal): ``(left + e, right - e)``. Pieces of every document whose masks agree
form ONE varlen kernel call (``cu_seqlens_q`` over the pieces, ``cu_seqlens_k`` over their
key ranges, taken from the reordered K/V), so a causal or unwindowed call is one kernel call
per head group, with no merge: the pieces' keys are complete. A window whose edges are clipped
by documents' ends differently gives a few calls (one per distinct mask; each query row still
in exactly one, so the backward writes each block's dq as its rows' own). Key ranges overlap
(a rank's two pieces of a document share their prefix), so the backward adds their dK/dV
with ``index_add_`` into a global-order buffer, which is put back in rank-major order
(``to_gathered``) for the reduce-scatter.

    per head group g:   wait gather(g); start gather(g + 1)
                        kv = gathered[to_global]                     (one copy, O(T))
                        one varlen call per mask: q rows of the pieces vs kv rows of their keys

Cost against the stream layout: the first group's gather has no local work to hide behind
(every call needs remote keys), and each group copies its gathered K/V twice (the reorder and
the key ranges; O(T) against O(T^2 / W) attention). Balance: exact per document for causal
attention, whatever the documents (``varlen_balance``, ``Plan.flops``), where the stream
layout reaches 53% at W = 8 on one document. Documents must be multiples of 2W.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_gather_single, reduce_scatter_single
from ..comm.faults import CommSite
from ..kernels import BlockKernel, accumulation_dtype
from ..kernels.merge import finish_rows, merge_
from ..parts import Block
from ..schedule.llama3 import Llama3Meta
from .varlen_blocks import varlen_blocks

# What failing waits name (Note [Faults] in comm/faults.py); step k of n: KV head group k.
_GATHER_FORWARD = "llama3 attention forward, all-gather of K/V"
_GATHER_BACKWARD = "llama3 attention backward, all-gather of K/V"
_REDUCE_SCATTER = "llama3 attention backward, reduce-scatter of dK/dV"


class _KVGather:
    """Asynchronous all-gather of one group of KV heads, into two alternating buffers."""

    def __init__(self, k_THD: Tensor, v_THD: Tensor, stride: int, group: dist.ProcessGroup):
        self.k, self.v, self.stride, self.group = k_THD, v_THD, stride, group
        world_size = dist.get_world_size(group)
        L, _, D = k_THD.shape
        self._buffers = [k_THD.new_empty(world_size * L, 2, stride, D) for _ in range(2)]
        self._turn = 0

    def start(self, h: int):
        """Start gathering KV heads ``[h, h + stride)``; ``.wait()`` -> K and V stacked,
        ``[W*L, 2, s, D]`` (rank r's tokens at rows ``[r L, (r + 1) L)``)."""
        heads = slice(h, h + self.stride)
        local = torch.stack([self.k[:, heads], self.v[:, heads]], dim=1)  # [L, 2, s, D]
        out = self._buffers[self._turn]
        self._turn ^= 1
        work = all_gather_single(out, local, group=self.group, async_op=True)
        return _Pending(work, out, local)


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


def _keys(m: Llama3Meta, kv_full: Tensor) -> Tensor:
    """The keys ``[k_start, k_stop)`` in global order of gathered K/V ``[W*L, 2, s, D]``: a
    view (stream layout) or one reordering copy (Note [Balanced all-gather attention])."""
    if m.to_global is None:
        return kv_full[m.k_start : m.k_stop]
    return kv_full.index_select(0, m.to_global)


def head_groups(H: int, H_kv: int, stride: int) -> Sequence[tuple[int, slice]]:
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
    groups = head_groups(H, k_THD.shape[1], heads_k_stride)
    gather = _KVGather(k_THD, v_THD, heads_k_stride, group)
    pending = gather.start(groups[0][0])
    m = meta
    for i, (h, hq) in enumerate(groups):
        q_g = q_THD[:, hq]
        if m.diagonal:  # needs only local K/V: it runs while the gather is in flight
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
        with CommSite(_GATHER_FORWARD, group, (i + 1, len(groups))):
            kv_full = pending.wait()
        if i + 1 < len(groups):
            pending = gather.start(groups[i + 1][0])
        if m.diagonal:
            lse[hq] = lse_g
            out[:, hq] = out_g
            if m.prefix_block is not None:
                blk, rows, keys = _prefix_parts(m)
                out_p, lse_p = kernel.forward(
                    q_g[None, rows],
                    kv_full[None, keys, 0],
                    kv_full[None, keys, 1],
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
            kv_keys = _keys(m, kv_full)
            k_keys, v_keys = kv_keys[:, 0], kv_keys[:, 1]
            rows = varlen_blocks(m.blocks, (), q_THD.device)
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
    return finish_rows(out, lse, out.dtype), lse


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
    if meta.diagonal:  # a straddling document's rows: the diagonal's dq plus the prefix's
        dq = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
    else:  # every query row in exactly one block: its dq is final
        dq = torch.empty_like(q_THD, memory_format=torch.contiguous_format)
    dk = torch.zeros(k_THD.shape, dtype=acc, device=q_THD.device)
    dv = torch.zeros(v_THD.shape, dtype=acc, device=q_THD.device)
    groups = head_groups(H, k_THD.shape[1], heads_k_stride)
    gather = _KVGather(k_THD, v_THD, heads_k_stride, group)
    pending = gather.start(groups[0][0])
    reducing = None  # (work, result [L, 2, s, D], kv heads, input, step) of the previous group
    m = meta

    def finish(reduced) -> None:
        work, result, kv_heads, _input, step = reduced  # the input stays alive until the wait
        with CommSite(_REDUCE_SCATTER, group, (step, len(groups))):
            work.wait()
        dk[:, kv_heads] += result[:, 0]
        dv[:, kv_heads] += result[:, 1]

    for i, (h, hq) in enumerate(groups):
        kv_heads = slice(h, h + heads_k_stride)
        args_q = (dout_THD[:, hq], q_THD[:, hq])
        out_g, lse_g = out_THD[:, hq], lse_HT[hq]
        if m.diagonal:  # local diagonal, while the gather is in flight
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
        with CommSite(_GATHER_BACKWARD, group, (i + 1, len(groups))):
            kv_full = pending.wait()
        if i + 1 < len(groups):
            pending = gather.start(groups[i + 1][0])
        # dK/dV of the gathered keys, in global order (a reordered copy goes to the reduce-
        # scatter when the gathered K/V were not: Note [Balanced all-gather attention])
        dkv_full = torch.zeros(W * L, 2, heads_k_stride, D, dtype=acc, device=q_THD.device)
        if m.diagonal:
            if m.prefix_block is not None:
                blk, rows, keys = _prefix_parts(m)
                dq_p, dk_p, dv_p = kernel.backward(
                    *(x[None, rows] for x in args_q),
                    kv_full[None, keys, 0],
                    kv_full[None, keys, 1],
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
            kv_keys = _keys(m, kv_full)
            k_keys, v_keys = kv_keys[:, 0], kv_keys[:, 1]
            dkv_keys = dkv_full[m.k_start : m.k_stop]
            rows = varlen_blocks(m.blocks, (), q_THD.device)
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
                rows.put_(dq[:, hq], blk.q, dq_b)
                rows.add_(dkv_keys[:, 0], blk.kv, dk_b)
                rows.add_(dkv_keys[:, 1], blk.kv, dv_b)
            if m.to_gathered is not None:
                dkv_full = dkv_full.index_select(0, m.to_gathered)
        if reducing is not None:
            finish(reducing)
        result = dkv_full.new_empty(L, 2, heads_k_stride, D)
        work = reduce_scatter_single(result, dkv_full, group=group, async_op=True)
        reducing = (work, result, kv_heads, dkv_full, i + 1)
    finish(reducing)
    return dq.to(q_THD.dtype), dk.to(k_THD.dtype), dv.to(v_THD.dtype)
