"""All-gather attention over documents placed by their work: each rank fetches only the keys
its queries see.

Note [Gathering what placed documents need]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The balanced placement (Note [Balanced documents]) keeps most documents whole on one rank and
cuts a few. The ring then runs a step per ring offset some cut document needs, each a kernel
call merged into fp32 accumulators over every local row; the all-gather of llama3 moves every
rank's K/V. Here a rank fetches, before it computes, exactly the keys of other ranks that its
queries see (one all-to-all of those rows), and meets each of its query runs with all its keys
in one block:

    rank 1 holds  A[40, 100)  B  C         (A[0, 40) on rank 0)
    all-to-all    rank 0 sends A[0, 40) to rank 1; nothing else moves
    local         B, C against their own rows               (while the all-to-all is in flight)
    remote        A[40, 100) against the key buffer  A[0, 40) | A[40, 100)
                                                  (received rows, then local rows: index copies)

Each block's keys are the document's keys ``[k0, k1)`` that its run may see (causal: up to the
run's end; a window trims them) with flash-attn's bottom-right-aligned mask, as in Note
[Balanced all-gather attention]; blocks that share a mask make one varlen kernel call. Every
query row is in exactly one block, so the kernels' results are the answer: no merges, no fp32
output accumulator, and a rank of whole documents runs one kernel call on its own K/V (its
result returned as the kernel gives it). Every rank derives every rank's needs from the layout
(``schedule/placed_gather.py``), so the all-to-all's sizes need no exchange, and ranks skip it
together when no rank needs another's keys.

Backward: the same fetch; each block's dq is its rows' final dq (written, not summed); the
local blocks' dK/dV add into the rank's own (fp32), the remote blocks' land in an fp32 key
buffer whose local rows add into the rank's own and whose received rows go
back to their owners (the reverse all-to-all, fp32), who add them. K/V move in their input
dtype (exact). With ``heads_k_stride`` below the KV heads, each group of KV heads is fetched
and computed in turn (the memory of one group's key buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..kernels import BlockKernel, accumulation_dtype
from ..kernels.merge import finish_rows
from ..parts import Block
from ..schedule.placed_gather import PlacedGather
from .llama3 import head_groups
from .varlen_blocks import VarlenBlocks, varlen_blocks


class RowExchange(Protocol):
    """Rows to every rank, by the sizes of a :class:`PlacedGather` (``comm.all_to_all``'s
    :class:`~dtensor_ring.comm.all_to_all.RowsAllToAll`, or a simulator's)."""

    def start(self, rows: Tensor):
        """Send ``rows`` ``[S, ...]`` (destinations in rank order); ``.wait()`` gives the
        received ``[R, ...]`` (sources in rank order)."""


def _whole_block(meta: PlacedGather, groups: Sequence, local: VarlenBlocks, q) -> Block | None:
    """The block when one local block of every local row against its own rows (the rank's
    whole documents, each against itself) is the whole call, one KV head group: its kernel's
    result is the answer."""
    if len(groups) != 1 or meta.remote_blocks or len(meta.local_blocks) != 1:
        return None
    blk = meta.local_blocks[0]
    return blk if blk.kv == blk.q and local.covers(blk.q, q) else None


def _sent(meta: PlacedGather, k_g: Tensor, v_g: Tensor) -> Tensor:
    """The rows this rank sends, K and V stacked: ``[S, 2, s, D]``."""
    return torch.stack(
        [k_g.index_select(0, meta.send_rows), v_g.index_select(0, meta.send_rows)], 1
    )


def gather_keys(meta: PlacedGather, k_g: Tensor, v_g: Tensor, received: Tensor | None):
    """The key buffer's K and V ``[keys, s, D]``: local rows and received ones."""
    (buf_l, rows_l), (buf_r, rows_r) = meta.from_local, meta.from_received
    out = []
    for i, x in enumerate((k_g, v_g)):
        keys = x.new_empty(meta.keys, *x.shape[1:])
        keys.index_copy_(0, buf_l, x.index_select(0, rows_l))
        if received is not None and rows_r.numel():
            keys.index_copy_(0, buf_r, received[:, i].index_select(0, rows_r))
        out.append(keys)
    return out


def _span_blocks(blocks: tuple[Block, ...], device: torch.device) -> VarlenBlocks:
    return varlen_blocks(blocks, (), device)


def placed_forward(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    meta: PlacedGather,
    heads_k_stride: int,
    exchange: RowExchange | None,
    kernel: BlockKernel,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Forward of one rank (Note [Gathering what placed documents need]): local
    ``q [T, H, D]``, ``k, v [T, H_kv, D]`` -> ``(out [T, H, D]`` in the input dtype,
    ``lse [H, T]`` in the accumulation dtype). ``exchange``: None when no rank sends."""
    T, H, _ = q_THD.shape
    groups = head_groups(H, k_THD.shape[1], heads_k_stride)
    local = _span_blocks(meta.local_blocks, q_THD.device)
    whole = _whole_block(meta, groups, local, q_THD)
    if whole is not None:  # (other ranks may still fetch our rows)
        pending = exchange.start(_sent(meta, k_THD, v_THD)) if meta.exchanges else None
        out, lse = local.forward(kernel, q_THD, k_THD, v_THD, whole, scale)
        if pending is not None:
            pending.wait()
        lse, out = lse.contiguous(), out.contiguous()  # as the ring's one block (ring.py)
        return local.finish(out, lse, True, out.dtype), lse
    remote = _span_blocks(meta.remote_blocks, q_THD.device)
    out = torch.empty_like(q_THD, memory_format=torch.contiguous_format)
    lse = torch.empty(H, T, dtype=accumulation_dtype(q_THD.dtype), device=q_THD.device)
    for h, hq in groups:
        k_g, v_g = k_THD[:, h : h + heads_k_stride], v_THD[:, h : h + heads_k_stride]
        pending = exchange.start(_sent(meta, k_g, v_g)) if meta.exchanges else None
        results = (q_THD[:, hq], out[:, hq], lse[hq])
        _forward_blocks(local, meta.local_blocks, kernel, scale, (k_g, v_g), *results)
        received = pending.wait() if pending is not None else None
        if meta.remote_blocks:
            keys = gather_keys(meta, k_g, v_g, received)
            _forward_blocks(remote, meta.remote_blocks, kernel, scale, keys, *results)
    return finish_rows(out, lse, out.dtype), lse


def placed_backward(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: PlacedGather,
    heads_k_stride: int,
    exchange: RowExchange | None,
    back_exchange: RowExchange | None,
    kernel: BlockKernel,
    scale: float,
    *,
    round_dkv: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one rank; ``(dq [T, H, D], dk, dv [T, H_kv, D])`` in the input dtypes
    (``round_dkv=False``: dk, dv in the accumulation dtype, for a caller that adds more to
    them, as the simulator adds the shares other ranks return). ``back_exchange`` returns the
    remote blocks' dK/dV of received rows to their owners (the reverse sizes of
    ``exchange``), in the accumulation dtype."""
    T, H, _ = q_THD.shape
    acc = accumulation_dtype(q_THD.dtype)
    groups = head_groups(H, k_THD.shape[1], heads_k_stride)
    local = _span_blocks(meta.local_blocks, q_THD.device)
    whole = _whole_block(meta, groups, local, q_THD)
    if whole is not None and not any(meta.send_splits):  # no other rank adds to our dK/dV
        if meta.exchanges:  # the others' collectives, with nothing of ours
            exchange.start(_sent(meta, k_THD, v_THD)).wait()
            back_exchange.start(k_THD.new_empty(0, 2, *k_THD.shape[1:], dtype=acc)).wait()
        grads = local.backward(kernel, dout_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, whole, scale)
        return tuple(g.contiguous() for g in grads)
    remote = _span_blocks(meta.remote_blocks, q_THD.device)
    dq = torch.empty_like(q_THD, memory_format=torch.contiguous_format)  # each row: one block
    dk = torch.zeros(k_THD.shape, dtype=acc, device=q_THD.device)
    dv = torch.zeros(v_THD.shape, dtype=acc, device=q_THD.device)
    (buf_l, rows_l), (buf_r, rows_r) = meta.from_local, meta.from_received
    for h, hq in groups:
        kvh = slice(h, h + heads_k_stride)
        k_g, v_g = k_THD[:, kvh], v_THD[:, kvh]
        pending = exchange.start(_sent(meta, k_g, v_g)) if meta.exchanges else None
        q_side = (dout_THD[:, hq], q_THD[:, hq], out_THD[:, hq], lse_HT[hq])
        _backward_blocks(local, meta.local_blocks, kernel, scale, q_side, (k_g, v_g),
                         dq[:, hq], (dk[:, kvh], dv[:, kvh]))  # fmt: skip
        received = pending.wait() if pending is not None else None
        back = None
        if meta.exchanges:
            back = torch.zeros(meta.received, 2, *k_g.shape[1:], dtype=acc, device=q_THD.device)
        if meta.remote_blocks:
            keys = gather_keys(meta, k_g, v_g, received)
            dkv_keys = torch.zeros(meta.keys, 2, *k_g.shape[1:], dtype=acc, device=q_THD.device)
            _backward_blocks(remote, meta.remote_blocks, kernel, scale, q_side, keys,
                             dq[:, hq], (dkv_keys[:, 0], dkv_keys[:, 1]))  # fmt: skip
            for i, d in enumerate((dk[:, kvh], dv[:, kvh])):
                d.index_add_(0, rows_l, dkv_keys[:, i].index_select(0, buf_l))
            if back is not None and rows_r.numel():
                back.index_add_(0, rows_r, dkv_keys.index_select(0, buf_r))
        if back is not None:
            shares = back_exchange.start(back).wait()  # [S, 2, s, D]: ours, from the ranks
            dk[:, kvh].index_add_(0, meta.send_rows, shares[:, 0])
            dv[:, kvh].index_add_(0, meta.send_rows, shares[:, 1])
    if not round_dkv:
        return dq, dk, dv
    return dq, dk.to(k_THD.dtype), dv.to(v_THD.dtype)


def _forward_blocks(rows, blocks, kernel, scale, kv, q, out, lse) -> None:
    """Every block's result written into its query rows of ``out`` and ``lse``."""
    for blk in blocks:
        out_b, lse_b = rows.forward(
            kernel, rows.take(q, blk.q), rows.take(kv[0], blk.kv), rows.take(kv[1], blk.kv),
            blk, scale,
        )  # fmt: skip
        rows.init_(out, lse, blk.q, out_b, lse_b)


def _backward_blocks(rows, blocks, kernel, scale, q_side, kv, dq, dkv_acc) -> None:
    """Every block's gradients: its dq written into its query rows of ``dq`` (each query row
    is in one block), its dK/dV added into its key rows of ``dkv_acc``."""
    dout, q, out, lse = q_side
    for blk in blocks:
        dq_b, dk_b, dv_b = rows.backward(
            kernel,
            rows.take(dout, blk.q),
            rows.take(q, blk.q),
            rows.take(kv[0], blk.kv),
            rows.take(kv[1], blk.kv),
            rows.take(out, blk.q),
            rows.take_lse(lse, blk.q),
            blk,
            scale,
        )
        rows.put_(dq, blk.q, dq_b)
        rows.add_(dkv_acc[0], blk.kv, dk_b)
        rows.add_(dkv_acc[1], blk.kv, dv_b)
