"""Exact merge of partial attention results, and the indexed add of partial gradients.

Note [Online-softmax merge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Attention of the same queries over two disjoint key sets A and B, each normalised on its own,
``(o_A, lse_A)`` and ``(o_B, lse_B)``, combines exactly into attention over A u B:

    lse = log(exp(lse_A) + exp(lse_B))
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

In the stable "sigmoid" form (no exp of a large number, no division):

    w_B = sigmoid(lse_B - lse_A)              # weight of the new block, in [0, 1]
    w_A = sigmoid(lse_A - lse_B)              # = 1 - w_B, without the rounding of 1 - w_B
    o   = w_A * o_A + w_B * o_B
    lse = logaddexp(lse_A, lse_B)             # = max + log1p(exp(-|lse_A - lse_B|))

A weighted sum rather than ``o_A + w_B * (o_B - o_A)``: an infinite ``o_A`` (a row that sees
an Inf value) stays infinite (``inf + w * (x - inf)`` would be NaN). Non-finite lse values
follow the math of the full softmax: a block with ``lse = +inf`` or NaN (a +Inf or NaN score)
makes the row NaN; a block with ``lse = -inf`` (every score -inf) has weight 0, and a row whose
blocks *all* have ``lse = -inf`` is the softmax of nothing but -inf scores, NaN
(:func:`finish_rows` after the last block; a row with no visible key at all never occurs:
every query sees itself or, windowed, its window).

The accumulators ``o_A`` and ``lse_A`` stay in the accumulation dtype (fp32, fp64 for fp64
inputs) across all ring steps; block outputs are upcast on the fly, and the result is cast to
the input dtype once, at the end.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor


def merge_(
    out_acc_BSHD: Tensor,
    lse_acc_BHS: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    rows: Tensor | None = None,
) -> None:
    """Fold one block result into the accumulators, in place (Note [Online-softmax merge]).

    Args:
        out_acc_BSHD: running output, accumulation dtype; updated in place.
        lse_acc_BHS: running log-sum-exp, accumulation dtype; updated in place.
        out_BSHD, lse_BHS: the block's output (any float dtype) and log-sum-exp, same rows.
        rows: int64 ``[S_block]``, the accumulator row (dim S) of each block row, or None
            (the same rows): a packed block's rows gathered from the whole shard.

    On CUDA with fp32 accumulators it runs one fused Triton kernel when Triton is installed
    (``_triton_merge.py``; with ``rows``, reading and writing the accumulator rows in place),
    else the eager torch ops of :func:`merge_eager_` on the gathered rows, scattered back.
    """
    fused = _triton() if out_acc_BSHD.is_cuda else None
    if (
        fused is not None
        and out_acc_BSHD.dtype == torch.float32
        and out_acc_BSHD.stride(-1) == 1
        and out_BSHD.stride(-1) == 1
    ):
        fused.triton_merge_(out_acc_BSHD, lse_acc_BHS, out_BSHD, lse_BHS, rows)
    elif rows is None:
        merge_eager_(out_acc_BSHD, lse_acc_BHS, out_BSHD, lse_BHS)
    else:
        out_rows, lse_rows = out_acc_BSHD.index_select(1, rows), lse_acc_BHS.index_select(2, rows)
        merge_eager_(out_rows, lse_rows, out_BSHD, lse_BHS)
        out_acc_BSHD.index_copy_(1, rows, out_rows)
        lse_acc_BHS.index_copy_(2, rows, lse_rows)


def add_rows_(acc: Tensor, rows: Tensor, x: Tensor) -> None:
    """``acc[rows] += x`` in place: a block's partial gradient added into the rows of an
    accumulator it covers (a packed block's rows gathered from the whole shard).

    Args:
        acc: ``[T, ...]``, the accumulation dtype.
        rows: int64 ``[t]``, distinct rows of ``acc``, on its device.
        x: ``[t, ...]``, the block's rows (any float dtype: upcast on the fly).

    On CUDA with an fp32 ``acc`` and rows of ``x`` and ``acc`` each one contiguous run it runs
    one fused Triton kernel when Triton is installed (``_triton_merge.py``), else
    ``index_add_`` of ``x`` converted to ``acc``'s dtype.
    """
    fused = _triton() if acc.is_cuda else None
    if fused is not None and acc.dtype == torch.float32 and _rows_dense(acc) and _rows_dense(x):
        fused.triton_add_rows_(acc, rows, x)
    else:
        acc.index_add_(0, rows, x.to(acc.dtype))


def _rows_dense(x: Tensor) -> bool:
    """Whether each row (dim 0) of ``x`` is one run of contiguous values."""
    return x[0].is_contiguous() if x.shape[0] else True


@functools.cache
def _triton():
    """``_triton_merge`` (the fused kernels), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from . import _triton_merge

    return _triton_merge


def merge_eager_(
    out_acc_BSHD: Tensor, lse_acc_BHS: Tensor, out_BSHD: Tensor, lse_BHS: Tensor
) -> None:
    """:func:`merge_` in eager torch ops (any device and dtype)."""
    w_new_BSH1 = torch.sigmoid(lse_BHS - lse_acc_BHS).transpose(1, 2).unsqueeze(-1)
    w_acc_BSH1 = torch.sigmoid(lse_acc_BHS - lse_BHS).transpose(1, 2).unsqueeze(-1)
    out_acc_BSHD.mul_(w_acc_BSH1).add_(w_new_BSH1 * out_BSHD.to(out_acc_BSHD.dtype))
    torch.logaddexp(lse_acc_BHS, lse_BHS.to(lse_acc_BHS.dtype), out=lse_acc_BHS)


def merge_all(outs_W: Tensor, lses_W: Tensor) -> tuple[Tensor, Tensor]:
    """Merge W partial results that are all at hand at once (a decoding step's all-gather)
    in one vectorised pass, rather than W - 1 :func:`merge_` calls (the ring's incremental
    form, for results that arrive one by one):

        lse = logsumexp_r lse_r        out = sum_r exp(lse_r - lse) * out_r

    Args:
        outs_W: ``[W, B, S, H, D]``, lses_W: ``[W, B, H, S]``, the accumulation dtype.

    Returns:
        ``(out [B, S, H, D], lse [B, H, S])``. The non-finite cases of Note [Online-softmax
        merge] hold: a part with ``lse = -inf`` has weight 0; a row whose parts all have
        ``lse = -inf`` is NaN (``exp(-inf - -inf)``), as is a row with a +inf or NaN lse. A
        deterministic function of its inputs: the same on every rank that gathered them.
    """
    lse_BHS = torch.logsumexp(lses_W, dim=0)
    weights_WBSH1 = torch.exp(lses_W - lse_BHS).transpose(-1, -2).unsqueeze(-1)
    return (outs_W * weights_WBSH1).sum(0), lse_BHS


def finish_rows(
    out: Tensor, lse: Tensor, dtype: torch.dtype, empty: float = float("nan")
) -> Tensor:
    """The final output: ``out`` (``[B, S, H, D]`` or ``[T, H, D]``) in ``dtype``, with the
    rows whose ``lse`` (``[B, H, S]`` or ``[H, T]``) is -inf set to ``empty``: NaN where every
    score of the row was -inf, the softmax of those being 0 / 0 (Note [Online-softmax merge]);
    0 for ``flex_attention``'s rows without a visible key. A new tensor when ``out`` is of
    another dtype (an accumulator), else ``out`` itself, updated in place.

    On CUDA it runs one fused Triton kernel when Triton is installed (``_triton_merge.py``:
    the cast and the fill in one pass; in place, only the empty rows are written), else
    ``out.to(dtype).masked_fill_(...)``.
    """
    fused = _triton() if out.is_cuda else None
    if fused is None or out.stride(-1) != 1 or out.numel() == 0:
        mask = (lse == float("-inf")).transpose(-1, -2).unsqueeze(-1)
        return out.to(dtype).masked_fill_(mask, empty)
    dst = out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype, device=out.device)
    if out.dim() == 3:  # varlen: one batch row
        fused.triton_finish_rows(out[None], lse[None], dst[None], empty)
    else:
        fused.triton_finish_rows(out, lse, dst, empty)
    return dst


# Note [Attention sinks]
# ~~~~~~~~~~~~~~~~~~~~~~
# A sink is a learnable logit per query head (gpt-oss's ``s_aux``) that joins every row's
# softmax denominator and contributes no value:
#
#     p_ij = exp(s_ij - lse'),   lse' = log(sum_j exp(s_ij) + exp(sink_h)),   o = sum_j p_ij v_j
#
# It is one more partial result with an empty value (Note [Online-softmax merge] with
# ``o_B = 0``, ``lse_B = sink_h``), folded in once, after the last block:
#
#     lse' = logaddexp(lse, sink_h)           w = exp(lse - lse') = sigmoid(lse - sink_h)
#     o'   = w * o
#
# Backward: the sink's column has ``dP = dO . 0 = 0``, so the rows' gradients are the ordinary
# attention backward with the *final* ``(o', lse')`` (what the ops save), and
#
#     dsink_h = -sum_i exp(sink_h - lse'_i) * delta_i,    delta_i = dO_i . o'_i
#
# over this rank's rows: the sink is replicated, and each rank's gradient is its rows' share
# (the sum over the group is the gradient of the whole sequence, as for every replicated
# parameter). A row with no visible key (``lse = -inf``) is softmax over the sink alone:
# ``o' = 0``, ``lse' = sink_h``. A +inf sink makes its rows NaN, as in the full softmax.


def add_sinks(out: Tensor, lse: Tensor, sinks_H: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-head sink logits into a final attention result (Note [Attention sinks]).

    Args:
        out: ``[B, S, H, D]`` or ``[T, H, D]`` (any float dtype; returned in it).
        lse: ``[B, H, S]`` or ``[H, T]``, the accumulation dtype.
        sinks_H: ``[H]``, one logit per query head (any float dtype).

    Returns:
        ``(out', lse')`` of the softmax whose denominator includes ``exp(sinks_H[h])``.
    """
    sink_H1 = sinks_H.to(lse.dtype).unsqueeze(-1)
    lse_sunk = torch.logaddexp(lse, sink_H1)
    weight = torch.exp(lse - lse_sunk).masked_fill_(lse_sunk == float("inf"), float("nan"))
    only_sink = (lse == float("-inf")) & lse_sunk.isfinite()  # rows with no visible key
    out_sunk = out.to(lse.dtype) * _per_row(weight)
    out_sunk.masked_fill_(_per_row(only_sink), 0.0)
    return out_sunk.to(out.dtype), lse_sunk


def _per_row(x_HS: Tensor) -> Tensor:
    """``[.., H, S]`` (lse's layout) -> ``[.., S, H, 1]`` (broadcasts against out)."""
    return x_HS.transpose(-1, -2).unsqueeze(-1)


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks_H: Tensor) -> Tensor:
    """This rank's gradient of the sink logits (Note [Attention sinks]) from the *final*
    ``out`` / ``lse`` (sinks folded in; layouts as in :func:`add_sinks`) and ``dout`` like
    ``out``. Returns ``dsinks [H]`` in ``sinks_H``'s dtype. Plain torch ops, so on DTensors
    (the DTensor path's autograd) the sums over sharded rows give a ``Partial`` gradient."""
    rows = [d for d in range(lse.dim()) if d != lse.dim() - 2]  # every dim but the heads
    return sinks_grad_rows(dout, out, lse, sinks_H).sum(rows).to(sinks_H.dtype)


def sinks_grad_rows(dout: Tensor, out: Tensor, lse: Tensor, sinks_H: Tensor) -> Tensor:
    """The terms of :func:`sinks_grad`, one per row and head, like ``lse`` (its dtype):
    ``-exp(sink_h - lse') * (dout . out')``."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(-1, -2)  # like lse
    return -torch.exp(sinks_H.to(lse.dtype).unsqueeze(-1) - lse) * delta
