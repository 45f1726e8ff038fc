"""Fused Triton kernels for the accumulators of ``merge.py`` (CUDA only; imported lazily).

* the merge (Note [Online-softmax merge]): one pass over the rows of a block, reading the fp32
  accumulators and the block's output and lse, writing the accumulators. Eager torch needs ~6
  kernels and several temporaries for the same update; this touches each byte once (fp32 out
  read + write, block out read, lse).
* the indexed add (:func:`~dtensor_ring.kernels.merge.add_rows_`): ``acc[rows] += x``, ``x``
  upcast on the fly, each row read and written once. Eager torch converts ``x`` to fp32 first
  (a copy) and ``index_add_`` adds with atomics.
* the final output (:func:`~dtensor_ring.kernels.merge.finish_rows`): the accumulator cast to
  the input dtype with the rows of ``lse = -inf`` filled, in one pass; in place (no cast) it
  reads only ``lse`` and writes only those rows.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_kernel(
    out_ptr,
    lse_ptr,
    blk_out_ptr,
    blk_lse_ptr,
    rows_ptr,
    S,
    H,
    D,
    o_sb,
    o_ss,
    o_sh,
    l_sb,
    l_sh,
    l_ss,
    bo_sb,
    bo_ss,
    bo_sh,
    bl_sb,
    bl_sh,
    bl_ss,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    row = tl.program_id(0)  # one (b, s) row of the block
    b = row // S
    s = row % S
    acc_s = tl.load(rows_ptr + s) if HAS_ROWS else s  # its row of the accumulators
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    hd_ok = h_ok[:, None] & (d[None, :] < D)

    lse_ptrs = lse_ptr + b * l_sb + h * l_sh + acc_s * l_ss
    lse = tl.load(lse_ptrs, mask=h_ok, other=0.0)
    blk_lse = tl.load(blk_lse_ptr + b * bl_sb + h * bl_sh + s * bl_ss, mask=h_ok, other=0.0)
    blk_lse = blk_lse.to(tl.float32)
    w_new = tl.sigmoid(blk_lse - lse)
    w_acc = tl.sigmoid(lse - blk_lse)
    top = tl.maximum(lse, blk_lse)
    # logaddexp; an infinite maximum is the result itself (no inf - inf)
    new_lse = tl.where(
        tl.abs(top) == float("inf"), top, top + tl.log(tl.exp(lse - top) + tl.exp(blk_lse - top))
    )

    o_ptrs = out_ptr + b * o_sb + acc_s * o_ss + h[:, None] * o_sh + d[None, :]
    o = tl.load(o_ptrs, mask=hd_ok, other=0.0)
    bo_ptrs = blk_out_ptr + b * bo_sb + s * bo_ss + h[:, None] * bo_sh + d[None, :]
    blk_o = tl.load(bo_ptrs, mask=hd_ok, other=0.0).to(tl.float32)
    tl.store(o_ptrs, w_acc[:, None] * o + w_new[:, None] * blk_o, mask=hd_ok)
    tl.store(lse_ptrs, new_lse, mask=h_ok)


def triton_merge_(
    out_acc_BSHD: Tensor,
    lse_acc_BHS: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    rows: Tensor | None = None,
) -> None:
    """Same contract as :func:`dtensor_ring.merge.merge_`; fp32 accumulators, unit D stride;
    ``rows``: the accumulator row of each block row (read and written in place), or None."""
    B, S, H, D = out_BSHD.shape
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 2048 // block_d))
    grid = (B * S, triton.cdiv(H, block_h))
    _merge_kernel[grid](
        out_acc_BSHD,
        lse_acc_BHS,
        out_BSHD,
        lse_BHS,
        out_BSHD if rows is None else rows,  # unread without rows
        S,
        H,
        D,
        out_acc_BSHD.stride(0),
        out_acc_BSHD.stride(1),
        out_acc_BSHD.stride(2),
        *lse_acc_BHS.stride(),
        out_BSHD.stride(0),
        out_BSHD.stride(1),
        out_BSHD.stride(2),
        *lse_BHS.stride(),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        HAS_ROWS=rows is not None,
    )


@triton.jit
def _add_rows_kernel(acc_ptr, x_ptr, rows_ptr, N, a_st, x_st, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # one row of x
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    row = tl.load(rows_ptr + i).to(tl.int64)
    x = tl.load(x_ptr + i.to(tl.int64) * x_st + cols, mask=ok, other=0.0).to(tl.float32)
    acc_ptrs = acc_ptr + row * a_st + cols
    tl.store(acc_ptrs, tl.load(acc_ptrs, mask=ok, other=0.0) + x, mask=ok)


def triton_add_rows_(acc: Tensor, rows: Tensor, x: Tensor) -> None:
    """``acc[rows] += x`` in place for an fp32 ``acc`` and ``x`` whose rows (dim 0) are each
    one run of ``N`` contiguous values; ``rows`` distinct (int64, on the device)."""
    n = x[0].numel() if x.shape[0] else 0
    if n == 0:
        return
    block = min(triton.next_power_of_2(n), 1024)
    grid = (x.shape[0], triton.cdiv(n, block))
    _add_rows_kernel[grid](acc, x, rows, n, acc.stride(0), x.stride(0), BLOCK=block)


@triton.jit
def _finish_kernel(
    src_ptr, lse_ptr, dst_ptr, S, H, D, empty,
    s_sb, s_ss, s_sh, l_sb, l_sh, l_ss, d_sb, d_ss, d_sh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COPY: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # one (b, s) row
    b = row // S
    s = row % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    hd_ok = h_ok[:, None] & (d[None, :] < D)
    lse = tl.load(lse_ptr + b * l_sb + h * l_sh + s * l_ss, mask=h_ok, other=0.0)
    is_empty = (lse == float("-inf"))[:, None]
    dst_ptrs = dst_ptr + b * d_sb + s * d_ss + h[:, None] * d_sh + d[None, :]
    fill = tl.full((BLOCK_H, BLOCK_D), empty, tl.float32)
    if COPY:
        x = tl.load(src_ptr + b * s_sb + s * s_ss + h[:, None] * s_sh + d[None, :], mask=hd_ok)
        x = tl.where(is_empty, fill, x.to(tl.float32))
        tl.store(dst_ptrs, x.to(dst_ptr.dtype.element_ty), mask=hd_ok)
    else:
        tl.store(dst_ptrs, fill.to(dst_ptr.dtype.element_ty), mask=hd_ok & is_empty)


def triton_finish_rows(src_BSHD: Tensor, lse_BHS: Tensor, dst_BSHD: Tensor, empty: float) -> None:
    """``dst = src`` (cast) with the rows of ``lse = -inf`` set to ``empty``; ``dst`` may be
    ``src`` (then only those rows are written). Unit D strides."""
    B, S, H, D = src_BSHD.shape
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 2048 // block_d))
    _finish_kernel[(B * S, triton.cdiv(H, block_h))](
        src_BSHD, lse_BHS, dst_BSHD, S, H, D, float(empty),
        src_BSHD.stride(0), src_BSHD.stride(1), src_BSHD.stride(2),
        *lse_BHS.stride(),
        dst_BSHD.stride(0), dst_BSHD.stride(1), dst_BSHD.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d, COPY=dst_BSHD is not src_BSHD,
    )  # fmt: skip
