"""FlashAttention-2 on the CPU, modelled: what its ops compute for the arguments they get.

The model (:func:`flash2_visible`: its host rewrite of the window, its kernel's bounds)
stands in for the aten ops ``_flash_attention_forward`` / ``_backward`` that ``cuda_flash``
calls, so the library's own adapter and engine run on the CI machine exactly as they call
the GPU kernel (Note [FlashAttention-2's unbounded window sides] in
``dtensor_ring/kernels/cuda_flash.py``: the class of bug this catches). The scores are the
math kernel's, so a result equals the math kernel's wherever the adapter keeps the mask the
interface asks for.

* :func:`flash2_visible`: one document's mask; :func:`flash2_forward`,
  :func:`flash2_backward`: a call's results (the flash-attn package stand-ins use them too);
* :func:`aten_forward`, :func:`aten_backward`: the two ops (dense when ``cu_seqlens_q`` is
  None);
* :func:`modelled_flash2`: a context in which ``backend="flash2_model"`` runs ``cuda_flash``'s
  adapter on these ops, on the CPU in fp32/fp64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from dtensor_ring import kernels
from dtensor_ring.kernels import cuda_flash
from dtensor_ring.kernels import math as math_kernel


def flash2_visible(
    s_q: int, s_k: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool, window
) -> Tensor:
    """``[s_q, s_k]`` bool: the keys FlashAttention-2 shows each query of one document (one
    dense block, or one document of a varlen call) given these arguments, modelled from its
    ``flash_api.cpp`` (the host rewrite of the window) and its kernel's bounds (Note
    [FlashAttention-2's unbounded window sides] in ``dtensor_ring/kernels/cuda_flash.py``).
    ``window``: ``(left, right)``, -1 unbounded, or None."""
    left, right = (-1, -1) if window is None else window
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    if max_seqlen_q == 1:  # "causal=true is the same as causal=false in this case"
        causal = False
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    if left < 0 <= right:
        left = max_seqlen_k
    if right < 0 <= left:
        right = max_seqlen_k
    i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    shift = s_k - s_q  # bottom-right alignment
    if is_causal:
        return j <= i + shift
    if left < 0 and right < 0:
        return torch.ones(s_q, s_k, dtype=torch.bool)
    return (j >= i + shift - left) & (j < i + 1 + shift + right)


def _mask(q, k, cu_q, cu_k, max_q, max_k, causal, window) -> Tensor:
    """``[S_q, S_k]`` (dense: ``cu_q`` None, ``max_*`` the lengths) or ``[T_q, T_k]``
    (varlen: document by document) bool: what FlashAttention-2 computes."""
    window = tuple(window)
    if cu_q is None:
        assert (max_q, max_k) == (q.shape[1], k.shape[1])
        return flash2_visible(max_q, max_k, max_q, max_k, causal, window)
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    bounds = zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist(), strict=False)
    for q0, q1, k0, k1 in bounds:
        mask[q0:q1, k0:k1] = flash2_visible(q1 - q0, k1 - k0, max_q, max_k, causal, window)
    return mask.to(q.device)


def flash2_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
    """``(out, lse)`` as FlashAttention-2 computes them: dense ``[B, S, H, D]`` inputs when
    ``cu_q`` is None (``max_*`` the lengths), else packed ``[T, H, D]`` with ``cu_seqlens``."""
    mask = _mask(q, k, cu_q, cu_k, max_q, max_k, causal, window)
    if cu_q is None:
        return math_kernel._forward(q, k, v, scale, mask)
    return tuple(x[0] for x in math_kernel._forward(q[None], k[None], v[None], scale, mask))


def flash2_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window):
    """``(dq, dk, dv)`` as FlashAttention-2 computes them (as :func:`flash2_forward`)."""
    mask = _mask(q, k, cu_q, cu_k, max_q, max_k, causal, window)
    if cu_q is None:
        return math_kernel._backward(dout, q, k, v, out, lse, scale, mask)
    tensors = (x[None] for x in (dout, q, k, v, out, lse))
    return tuple(g[0] for g in math_kernel._backward(*tensors, scale, mask))


def aten_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, **win):
    """``aten._flash_attention_forward``: ``(out, lse, rng_state, unused, debug_mask)``."""
    assert dropout_p == 0.0 and not debug
    window = (win.pop("window_size_left", -1), win.pop("window_size_right", -1))
    assert not win, win
    out, lse = flash2_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)
    return out, lse, torch.empty(2, dtype=torch.int64), torch.empty(0), None


def aten_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng,
                  unused, *, scale, **win):  # fmt: skip
    """``aten._flash_attention_backward``: ``(dq, dk, dv)``."""
    assert dropout_p == 0.0 and lse.is_contiguous()  # the op reads lse by its data pointer
    window = (win.pop("window_size_left", -1), win.pop("window_size_right", -1))
    assert not win, win
    return flash2_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window)


_OPS = {"_flash_attention_forward": aten_forward, "_flash_attention_backward": aten_backward}


class Flash2Model(cuda_flash.TorchFlashKernel):
    """``cuda_flash``'s adapter on the modelled ops, on the CPU."""

    name = "flash2_model"
    device_types = ("cpu",)
    dtypes = (torch.float32, torch.float64)

    def is_available(self) -> str | None:
        return None

    def extra_reason(self, call) -> str | None:
        return None


@contextlib.contextmanager
def modelled_flash2() -> Iterator[Flash2Model]:
    """``backend="flash2_model"`` selectable inside (and ``cuda_flash``'s ops modelled)."""
    saved = cuda_flash.require_aten_op, kernels.BACKENDS
    cuda_flash.require_aten_op = _OPS.__getitem__
    model = Flash2Model()
    kernels.BACKENDS = (*saved[1], model)
    kernels.clear_selection_cache()
    try:
        yield model
    finally:
        cuda_flash.require_aten_op, kernels.BACKENDS = saved
        kernels.clear_selection_cache()
