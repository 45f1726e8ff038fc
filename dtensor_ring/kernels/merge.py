"""Exact merge of partial attention results.

Note [Online-softmax merge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Attention of the same queries over two disjoint key sets A and B, each normalised on its own,
``(o_A, lse_A)`` and ``(o_B, lse_B)``, combines exactly into attention over A u B:

    lse = log(exp(lse_A) + exp(lse_B))
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

In the stable "sigmoid" form (no exp of a large number, no division):

    w   = sigmoid(lse_B - lse_A)              # weight of the new block, in [0, 1]
    o   = o_A + w * (o_B - o_A)               # = (1 - w) o_A + w o_B
    lse = lse_A - logsigmoid(lse_A - lse_B)   # = lse_A + log(1 + exp(lse_B - lse_A))

The accumulators ``o_A`` and ``lse_A`` stay in the accumulation dtype (fp32, fp64 for fp64
inputs) across all ring steps; block outputs are upcast on the fly, and the result is cast to
the input dtype once, at the end.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor


def merge_(out_acc_BSHD: Tensor, lse_acc_BHS: Tensor, out_BSHD: Tensor, lse_BHS: Tensor) -> None:
    """Fold one block result into the accumulators, in place (Note [Online-softmax merge]).

    Args:
        out_acc_BSHD: running output, accumulation dtype; updated in place.
        lse_acc_BHS: running log-sum-exp, accumulation dtype; updated in place.
        out_BSHD, lse_BHS: the block's output (any float dtype) and log-sum-exp, same rows.

    On CUDA with fp32 accumulators it runs one fused Triton kernel when Triton is installed
    (``_triton_merge.py``), else the eager torch ops of :func:`merge_eager_`.
    """
    fused = _fused_merge() if out_acc_BSHD.is_cuda else None
    if (
        fused is not None
        and out_acc_BSHD.dtype == torch.float32
        and out_acc_BSHD.stride(-1) == 1
        and out_BSHD.stride(-1) == 1
    ):
        fused(out_acc_BSHD, lse_acc_BHS, out_BSHD, lse_BHS)
    else:
        merge_eager_(out_acc_BSHD, lse_acc_BHS, out_BSHD, lse_BHS)


@functools.cache
def _fused_merge():
    if importlib.util.find_spec("triton") is None:
        return None
    from ._triton_merge import triton_merge_

    return triton_merge_


def merge_eager_(
    out_acc_BSHD: Tensor, lse_acc_BHS: Tensor, out_BSHD: Tensor, lse_BHS: Tensor
) -> None:
    """:func:`merge_` in eager torch ops (any device and dtype)."""
    weight_BSH1 = torch.sigmoid(lse_BHS - lse_acc_BHS).transpose(1, 2).unsqueeze(-1)
    out_acc_BSHD.add_(weight_BSH1 * (out_BSHD.to(out_acc_BSHD.dtype) - out_acc_BSHD))
    lse_acc_BHS.sub_(F.logsigmoid(lse_acc_BHS - lse_BHS))
