"""CPU tests of the GPU block-kernel adapters' argument and layout handling, and of selection.

flash-attn is CUDA-only (and has no wheel for our torch builds), so ``flash_attn`` is replaced
by stand-in modules whose private block functions have exactly the signatures of the released
sources (PyPI sdists 2.6.0.post1, 2.6.3, 2.7.4.post1; 2.8.3 is identical to 2.7.4.post1) and
behave like them where it matters to an adapter:

* 2.6.x: plain functions; forward returns ``out, q, k, v, out_padded, lse, S_dmask, rng_state``;
  backward writes into ``dq/dk/dv`` when given, else allocates, and returns all four.
* 2.7+: ``torch.library.custom_op`` objects; forward returns ``out, lse, S_dmask, rng_state``;
  backward writes the given ``dq/dk/dv`` (a ``None`` buffer is allocated internally and lost)
  and returns only ``softmax_d``.
* Both read lse through its data pointer, so it must be contiguous fp32 ``[B, H, S]`` or
  ``[H, T]``; q/k/v/dout/out need only a unit last stride (the wrappers fix that themselves).

The stand-ins compute with the math kernel, so the adapter's ``out``, ``lse``, ``dq``, ``dk``,
``dv`` must equal the math kernel's. flash-attn 4 (``flash_attn.cute.interface`` of
``flash-attn-4`` 4.0.0b36) gets the same treatment: stand-ins of ``_flash_attn_fwd`` /
``_flash_attn_bwd`` with exactly its signatures, its argument checks and its causal/window
resolution, computing in fp64 with the math kernel; they record every call, so the tests also
check what the adapter passed. The aten-based adapters (cudnn, cuda_flash) are checked for
argument order and shapes on the meta device, whose kernels PyTorch registers for those ops.
"""

from __future__ import annotations

import functools
import importlib.machinery
import inspect
import itertools
import os
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from flash2_model import flash2_backward, flash2_forward, flash2_visible, modelled_flash2
from torch import Tensor

from dtensor_ring.kernels import (
    BACKEND_NAMES,
    KernelCall,
    clear_selection_cache,
    flash_attn4_grads,
    flash_attn4_tiles,
    select_kernel,
)
from dtensor_ring.kernels import flash_attn4 as flash_attn4_module
from dtensor_ring.kernels import flash_attn4_launch as fa4_launch
from dtensor_ring.kernels.base import in_window, window_mask
from dtensor_ring.kernels.cuda_flash import (
    TorchFlashKernel,
    flash2_dense_needs_varlen,
    flash2_max_seqlen_k,
)
from dtensor_ring.kernels.cudnn import CudnnKernel
from dtensor_ring.kernels.flash_attn4 import FlashAttn4Kernel
from dtensor_ring.kernels.flash_attn_pkg import FlashAttnKernel
from dtensor_ring.kernels.math import MathKernel
from dtensor_ring.kernels.merge import merge_, merge_eager_
from dtensor_ring.resolve import normalize_window
from dtensor_ring.simulate import simulate_ring

MATH = MathKernel()
FLASH = FlashAttnKernel()
FLASH4 = FlashAttn4Kernel()
SCALE = 0.3


# --- what the stand-ins compute, in flash-attn's layouts --------------------------------------
def _maybe_contiguous(x: Tensor | None) -> Tensor | None:
    """flash-attn's own fix-up of its inputs."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _check_options(dropout_p, softcap, alibi_slopes) -> None:
    """The options the adapters never use."""
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None


def _check_lse(lse: Tensor, shape: tuple[int, ...]) -> None:
    # The CUDA code reads lse through its data pointer with implicit contiguous strides.
    assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == shape


def _dense_forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes):
    """``(out [B, S, H, D], lse fp32 [B, H, S])``, with FlashAttention-2's window rewrite."""
    _check_options(dropout_p, softcap, alibi_slopes)
    # flash-attn aligns causal bottom-right; the math kernel top-left: equal for square blocks.
    assert not causal or q.shape[1] == k.shape[1]
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    lengths = q.shape[1], k.shape[1]
    return flash2_forward(q, k, v, None, None, *lengths, causal, softmax_scale, window)


def _varlen_forward(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    softmax_scale,
    causal,
    window,
    softcap,
    alibi_slopes,
):
    """``(out [T, H, D], lse fp32 [H, T])``, with FlashAttention-2's window rewrite."""
    _check_options(dropout_p, softcap, alibi_slopes)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int)
    assert not causal or torch.equal(cu_q, cu_k)
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    return flash2_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window)


def _write_grads(grads, dq, dk, dv, like) -> tuple[Tensor, Tensor, Tensor]:
    """Copy ``grads`` into the given buffers (allocating missing ones), as the CUDA code does."""
    given = (dq, dk, dv)
    bufs = tuple(torch.empty_like(x) if b is None else b for b, x in zip(given, like, strict=True))
    for buf, grad in zip(bufs, grads, strict=True):
        assert buf.shape == grad.shape and buf.stride(-1) == 1
        buf.copy_(grad)
    return bufs


def _dense_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window,
    softcap,
    alibi_slopes,
):
    """``(dq, dk, dv, softmax_d)``, with FlashAttention-2's window rewrite."""
    _check_options(dropout_p, softcap, alibi_slopes)
    B, S, H, _ = q.shape
    _check_lse(lse, (B, H, S))
    dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    lengths = S, k.shape[1]
    grads = flash2_backward(dout, q, k, v, out, lse, None, None, *lengths, causal, softmax_scale,
                            window)  # fmt: skip
    softmax_d = torch.empty(B, H, (S + 127) // 128 * 128)
    return (*_write_grads(grads, dq, dk, dv, (q, k, v)), softmax_d)


def _varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    softmax_scale,
    causal,
    window,
    softcap,
    alibi_slopes,
):
    """``(dq, dk, dv, softmax_d)``, with FlashAttention-2's window rewrite."""
    _check_options(dropout_p, softcap, alibi_slopes)
    T, H, _ = q.shape
    _check_lse(lse, (H, T))
    dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    cu_and_max = (cu_q, cu_k, max_q, max_k)
    grads = flash2_backward(dout, q, k, v, out, lse, *cu_and_max, causal, softmax_scale, window)
    softmax_d = torch.empty(H, T + 128 * (cu_q.numel() - 1))
    return (*_write_grads(grads, dq, dk, dv, (q, k, v)), softmax_d)


def _unused_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """``(S_dmask, rng_state)`` as returned without dropout."""
    return torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)


# --- flash-attn 2.6.x: exact signatures (2.6.0.post1 and 2.6.3) -------------------------------
def fa26_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    assert not return_softmax
    out, lse = _dense_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes
    )
    return (out, q, k, v, out, lse, *_unused_outputs(q))


def fa260_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_softmax,
    block_table,
):
    assert not return_softmax and block_table is None
    out, lse = _varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
    )
    return (out, q, k, v, out, lse, *_unused_outputs(q))


def fa263_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
):
    assert leftpad_k is None and seqused_k is None
    return fa260_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_softmax,
        block_table,
    )


def fa26_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    return _dense_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
    )


def fa26_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    return _varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
    )


# --- flash-attn 2.7.x / 2.8.x: exact signatures, as torch custom ops --------------------------
@torch.library.custom_op("dtensor_ring_fa_stub::_flash_attn_forward", mutates_args=())
def fa27_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    assert not return_softmax
    out, lse = _dense_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
    )
    return (out, lse, *_unused_outputs(q))


@torch.library.custom_op("dtensor_ring_fa_stub::_flash_attn_varlen_forward", mutates_args=())
def fa27_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
    block_table: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    assert not return_softmax and block_table is None and leftpad_k is None
    assert seqused_k is None and not zero_tensors
    out, lse = _varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
    )
    return (out, lse, *_unused_outputs(q))


@torch.library.custom_op(
    "dtensor_ring_fa_stub::_flash_attn_backward", mutates_args=("dq", "dk", "dv")
)
def fa27_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:
    *_, softmax_d = _dense_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
    )
    return softmax_d


@torch.library.custom_op(
    "dtensor_ring_fa_stub::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv")
)
def fa27_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
    zero_tensors: bool = False,
) -> Tensor:
    assert not zero_tensors
    *_, softmax_d = _varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
    )
    return softmax_d


def fa25_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
):
    """flash-attn 2.5.x (no softcap): only used to check that it is refused."""
    raise AssertionError("flash-attn < 2.6 must not be called")


STAND_INS = {  # version -> (forward, varlen forward, backward, varlen backward)
    "2.6.0": (fa26_forward, fa260_varlen_forward, fa26_backward, fa26_varlen_backward),
    "2.6.3": (fa26_forward, fa263_varlen_forward, fa26_backward, fa26_varlen_backward),
    "2.7/2.8": (fa27_forward, fa27_varlen_forward, fa27_backward, fa27_varlen_backward),
    "2.5": (fa25_forward, None, None, None),
}


def install_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Put stand-in ``flash_attn`` and ``flash_attn.flash_attn_interface`` in ``sys.modules``."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    names = (
        "_flash_attn_forward",
        "_flash_attn_varlen_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_backward",
    )
    for name, fn in zip(names, STAND_INS[version], strict=True):
        setattr(interface, name, fn)
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__ = []
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


@pytest.fixture(params=["2.6.0", "2.6.3", "2.7/2.8"])
def flash_attn_version(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each supported flash-attn generation, installed as a stand-in."""
    install_flash_attn(monkeypatch, request.param)
    return request.param


def _assert_fresh_and_equal(got: tuple[Tensor, ...], want: tuple[Tensor, ...], inputs) -> None:
    used = {x.untyped_storage().data_ptr() for x in inputs}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert g.untyped_storage().data_ptr() not in used, "outputs must be fresh tensors"


# --- flash-attn adapter -----------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_flash_attn_dense_matches_math(flash_attn_version, causal, num_kv_heads):
    B, S, H, D = 2, 12, 4, 8
    g = torch.Generator().manual_seed(0)
    # q and dout are halves of bigger buffers: views that are not contiguous.
    q = torch.randn(B, 2 * S, H, D, generator=g)[:, S:]
    k, v = torch.randn(2, B, S, num_kv_heads, D, generator=g).unbind(0)
    dout = torch.randn(B, S, 2 * H, D, generator=g)[:, :, :H]

    out, lse = FLASH.forward(q, k, v, causal=causal, scale=SCALE)
    want_out, want_lse = MATH.forward(q, k, v, causal=causal, scale=SCALE)
    _assert_fresh_and_equal((out, lse), (want_out, want_lse), (q, k, v))
    assert out.shape == (B, S, H, D) and lse.shape == (B, H, S)

    lse_view = torch.randn(B, H, 2 * S, generator=g)[..., :S].copy_(want_lse)  # non-contiguous
    grads = FLASH.backward(dout, q, k, v, want_out, lse_view, causal=causal, scale=SCALE)
    want = MATH.backward(dout, q, k, v, want_out, want_lse, causal=causal, scale=SCALE)
    _assert_fresh_and_equal(grads, want, (q, k, v, dout, want_out))
    assert grads[1].shape == (B, S, num_kv_heads, D)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_flash_attn_varlen_matches_math(flash_attn_version, causal, num_kv_heads):
    H, D = 4, 8
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    T, max_seqlen = 20, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, H, 2 * D, generator=g)[..., ::2]  # last-dim stride 2
    k, v = torch.randn(2, T, num_kv_heads, D, generator=g).unbind(0)
    dout = torch.randn(T, H, D, generator=g)
    args = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)

    out, lse = FLASH.forward_varlen(q, k, v, *args, causal=causal, scale=SCALE)
    want_out, want_lse = MATH.forward_varlen(q, k, v, *args, causal=causal, scale=SCALE)
    _assert_fresh_and_equal((out, lse), (want_out, want_lse), (q, k, v))
    assert lse.shape == (H, T)

    lse_t = want_lse.t().contiguous().t()  # [H, T] with transposed strides
    grads = FLASH.backward_varlen(dout, q, k, v, want_out, lse_t, *args, causal=causal, scale=SCALE)
    want = MATH.backward_varlen(
        dout, q, k, v, want_out, want_lse, *args, causal=causal, scale=SCALE
    )
    _assert_fresh_and_equal(grads, want, (q, k, v, dout, want_out))


# Documents with more queries than keys (document 0: 9 > max_seqlen_k + 1) and fewer, as the
# placed document plans send them, under windows with an unbounded side
# (Note [FlashAttention-2's unbounded window sides] in dtensor_ring/kernels/cuda_flash.py).
VARLEN_WINDOWS = [(0, -1), (1, -1), (-1, 2), (2, 3), (3, 0), (-1, -1)]


def _check_varlen_windows(kernel, window) -> None:
    H, H_kv, D = 4, 2, 8
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 9, 11, 20], [0, 3, 8, 12]))
    args = (cu_q, cu_k, 9, 5)
    g = torch.Generator().manual_seed(3)
    q, dout = torch.randn(2, 20, H, D, generator=g).unbind(0)
    k, v = torch.randn(2, 12, H_kv, D, generator=g).unbind(0)
    kw = dict(causal=False, scale=SCALE, window=window)
    out, lse = kernel.forward_varlen(q, k, v, *args, **kw)
    want_out, want_lse = MATH.forward_varlen(q, k, v, *args, **kw)
    _assert_fresh_and_equal((out, lse), (want_out, want_lse), (q, k, v))
    grads = kernel.backward_varlen(dout, q, k, v, want_out, want_lse, *args, **kw)
    want = MATH.backward_varlen(dout, q, k, v, want_out, want_lse, *args, **kw)
    _assert_fresh_and_equal(grads, want, (q, k, v, dout, want_out))


@pytest.mark.parametrize("window", VARLEN_WINDOWS)
def test_flash_attn_varlen_windows_are_the_interfaces(flash_attn_version, window):
    _check_varlen_windows(FLASH, window)


@pytest.fixture
def modelled_cuda_flash() -> Iterator[TorchFlashKernel]:
    """``cuda_flash``'s adapter on the CPU, its aten ops modelled (``flash2_model``)."""
    with modelled_flash2() as model:
        yield model


@pytest.mark.parametrize("window", VARLEN_WINDOWS)
def test_cuda_flash_varlen_windows_are_the_interfaces(modelled_cuda_flash, window):
    _check_varlen_windows(modelled_cuda_flash, window)


# Dense blocks with a window that FlashAttention-2's dense op would compute otherwise (more
# queries than keys + 1, an unbounded side: llama3's prefix block) and blocks it computes as
# asked: (S_q, S_k, window).
DENSE_WINDOWS = [
    (11, 2, (0, -1)),
    (8, 5, (3, -1)),
    (6, 3, (-1, 4)),
    (12, 16, (3, 0)),
    (7, 7, (2, 3)),
]


def _check_dense_windows(kernel, s_q, s_k, window) -> None:
    B, H, H_kv, D = 2, 4, 2, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, 2 * s_q, H, D, generator=g)[:, s_q:]  # a view, as the engine's parts
    k, v = torch.randn(2, B, s_k, H_kv, D, generator=g).unbind(0)
    dout = torch.randn(B, s_q, H, D, generator=g)
    kw = dict(causal=False, scale=SCALE, window=window)
    out, lse = kernel.forward(q, k, v, **kw)
    want_out, want_lse = MATH.forward(q, k, v, **kw)
    _assert_fresh_and_equal((out, lse), (want_out, want_lse), (q, k, v))
    assert out.shape == q.shape and lse.shape == (B, H, s_q)
    grads = kernel.backward(dout, q, k, v, want_out, want_lse, **kw)
    want = MATH.backward(dout, q, k, v, want_out, want_lse, **kw)
    _assert_fresh_and_equal(grads, want, (q, k, v, dout, want_out))


@pytest.mark.parametrize("s_q,s_k,window", DENSE_WINDOWS)
def test_cuda_flash_dense_windows_are_the_interfaces(modelled_cuda_flash, s_q, s_k, window):
    _check_dense_windows(modelled_cuda_flash, s_q, s_k, window)


@pytest.mark.parametrize("s_q,s_k,window", DENSE_WINDOWS)
def test_flash_attn_dense_windows_are_the_interfaces(flash_attn_version, s_q, s_k, window):
    _check_dense_windows(FLASH, s_q, s_k, window)


def test_flash2_max_seqlen_k_makes_every_window_the_interfaces():
    """Every document shape and window (sides -1..7), checked on the model of
    FlashAttention-2's window rewrite: varlen calls with the adapters' ``max_seqlen_k``, and
    the dense blocks the adapters leave on the dense op; the arguments as they are lose keys
    (the note's case)."""
    for s_q, s_k in itertools.product(range(1, 7), repeat=2):
        for window in itertools.product(range(-1, 8), repeat=2):
            want = window_mask(s_q, s_k, window, "cpu")
            for max_q, max_k in itertools.product((s_q, s_q + 2), (s_k, s_k + 2)):
                max_k_passed = flash2_max_seqlen_k(max_q, max_k, window)
                got = flash2_visible(s_q, s_k, max_q, max_k_passed, False, window)
                assert torch.equal(got, want), (s_q, s_k, max_q, max_k, window)
            if not flash2_dense_needs_varlen(s_q, s_k, window):
                got = flash2_visible(s_q, s_k, s_q, s_k, False, window)
                assert torch.equal(got, want), (s_q, s_k, window)
    as_is = flash2_visible(6, 3, 6, 3, False, (0, -1))
    assert not torch.equal(as_is, window_mask(6, 3, (0, -1), "cpu"))


def test_flash_attn_availability(monkeypatch):
    assert "not installed" in FLASH.is_available()  # no flash-attn in this environment
    install_flash_attn(monkeypatch, "2.5")
    assert "older than 2.6" in FLASH.is_available()
    install_flash_attn(monkeypatch, "2.7/2.8")
    assert FLASH.is_available() is None


def test_flash_attn_selected_first_and_its_limits(monkeypatch):
    install_flash_attn(monkeypatch, "2.7/2.8")
    call = KernelCall("cuda", torch.bfloat16, 128, 32, 8)  # pure data: no GPU needed
    assert select_kernel(call).name == "flash_attn"
    odd_head_dim = KernelCall("cuda", torch.bfloat16, 100, 32, 8)
    assert "multiple of 8" in FLASH.unsupported_reason(odd_head_dim)
    deterministic = KernelCall("cuda", torch.bfloat16, 128, 32, 8, deterministic=True)
    assert "use_deterministic_algorithms" in FLASH.unsupported_reason(deterministic)
    assert "device 'cpu'" in FLASH.unsupported_reason(KernelCall("cpu", torch.bfloat16, 8, 4, 4))


@pytest.mark.slow  # a fresh interpreter
def test_import_does_not_import_flash_attn():
    code = (
        "import dtensor_ring, sys; "
        "assert not [m for m in sys.modules if m.startswith(('flash_attn', 'cutlass'))]"
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


# --- flash-attn 4 (flash_attn.cute.interface, flash-attn-4 4.0.0b36): exact signatures ---------
# The stand-ins check what the real functions assert, fix layouts as ``maybe_contiguous`` does,
# resolve causal/window exactly as ``_resolve_causal_local_window`` does, and compute in fp64
# with the math kernel (out and grads in the input dtype, lse fp32). Every call's arguments are
# recorded in ``FA4_CALLS``; every option the adapter must leave alone is checked to be at its
# default.
FA4_CALLS: list[dict] = []


def _fa4_unused_at_defaults(fn, args: dict, used: set[str]) -> None:
    """Every parameter of ``fn`` outside ``used`` was left at its default."""
    for name, param in inspect.signature(fn).parameters.items():
        if name not in used:
            assert args[name] is param.default or args[name] == param.default, name


def _fa4_maybe_contiguous(x: Tensor | None) -> Tensor | None:
    """A copy unless the last stride is 1 and the pointer 16-byte aligned (as FA4's)."""
    if x is None or (x.stride(-1) == 1 and x.data_ptr() % 16 == 0):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _fa4_resolve_window(causal, window_size_left, window_size_right):
    """FA4's ``_resolve_causal_local_window`` (verbatim logic): ``(causal, local, left, right)``."""
    if (
        window_size_left is not None
        and window_size_right is not None
        and window_size_left < 0
        and window_size_right < 0
    ):
        window_size_left = window_size_right = None
    if causal:
        window_size_right = 0
    if window_size_left is not None or window_size_right is not None:
        if window_size_left is None and window_size_right == 0:
            causal, local, window_size_right = True, False, None
        else:
            causal, local = False, True
    else:
        local = False
    return causal, local, window_size_left, window_size_right


def _fa4_window(causal, window_size_left, window_size_right) -> tuple[int, int] | None:
    """The mask FA4 applies, as our bottom-right ``window`` (-1 unbounded), or None for none."""
    causal, local, left, right = _fa4_resolve_window(causal, window_size_left, window_size_right)
    if causal:  # bottom-right aligned, like the window (-1, 0)
        return (-1, 0)
    if not local:
        return None
    for side in (left, right):  # FA4 takes any integer as a bound: -1 would hide the diagonal
        assert side is None or side >= 0, (left, right)
    return (-1 if left is None else left, -1 if right is None else right)


def _fa4_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
    assert q.shape[-2] % k.shape[-2] == 0 and k.shape == v.shape
    if cu_seqlens_q is None:
        assert cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None
        assert q.dim() == 4 and k.shape[0] == q.shape[0]
        return
    assert q.dim() == 3
    for cu, total in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.stride(0) == 1 and cu[-1] == total
    assert cu_seqlens_q.shape == cu_seqlens_k.shape
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    assert max_seqlen_q == cu_seqlens_q.diff().max() and max_seqlen_k == cu_seqlens_k.diff().max()


def _fa4_math(fn: str, cu_seqlens_q, cu_seqlens_k, *tensors: Tensor, **kw):
    """The math kernel's ``fn`` (``forward``/``backward``, their varlen form with cu_seqlens)
    on fp64 copies of ``tensors``."""
    tensors = tuple(t.double() for t in tensors)
    if cu_seqlens_q is None:
        return getattr(MATH, fn)(*tensors, **kw)
    return getattr(MATH, f"{fn}_varlen")(*tensors, cu_seqlens_q, cu_seqlens_k, 0, 0, **kw)


def fa4_flash_attn_fwd(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    softcap=None,
    window_size_left=None,
    window_size_right=None,
    learnable_sink=None,
    tile_mn=None,
    mma_pv_is_rs=None,
    intra_wg_overlap=None,
    num_threads=384,
    num_splits=1,
    pack_gqa=None,
    _arch=None,
    score_mod=None,
    mask_mod=None,
    block_sparse_tensors=None,
    return_lse=False,
    out=None,
    lse=None,
    aux_tensors=None,
    aux_scalars=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    gather_kv_indices=None,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False,
):
    """``(out, lse, p, row_max, o_lo)``; lse fp32 ``[B, H, S]`` or ``[H, T]`` if return_lse.
    As the real one, it works out a compile key from the shapes and options, then calls the
    compiled kernel of its ``compile_cache`` with sm90's argument list, which writes ``out`` and
    ``lse`` (given or allocated here)."""
    args = dict(locals())
    FA4_CALLS.append(args)
    used = {"q", "k", "v", "softmax_scale", "causal", "window_size_left", "window_size_right"}
    used |= {"return_lse", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    used |= {"out", "lse", "pack_gqa", "seqused_q"}
    _fa4_unused_at_defaults(fa4_flash_attn_fwd, args, used)
    # the sm90 forward class it would compile now: the ring's fp32 one only with pack-GQA off
    kernel_class = sys.modules["flash_attn.cute.interface"].FlashAttentionForwardSm90
    mode = {FA4Fp32Out: "fp32_out", FA4Fp32Merge: "merge"}.get(kernel_class, "plain")
    assert pack_gqa is (None if mode == "plain" else False)
    q, k, v = (_fa4_maybe_contiguous(x) for x in (q, k, v))
    if seqused_q is None:
        _fa4_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:  # document d's queries: seqused_q[d] rows from cu_seqlens_q[d], in any order
        used = seqused_q.long()
        assert seqused_q.dtype == cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q[-1] == len(q)
        assert bool((cu_seqlens_q[:-1].long() + used <= len(q)).all())
        assert max_seqlen_q == int(used.max()) and seqused_q.shape == cu_seqlens_k[1:].shape
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    varlen = cu_seqlens_q is not None
    lse_shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if lse is None:
        lse = torch.empty(lse_shape) if return_lse else None
    assert lse is None or (lse.shape == lse_shape and lse.dtype == torch.float32)
    causal, local, left, right = _fa4_resolve_window(causal, window_size_left, window_size_right)
    key = (q.dtype, q.shape[-1], causal, local, varlen, lse is None)
    cache = fa4_flash_attn_fwd.compile_cache
    if key not in cache:
        cache[key] = functools.partial(_fa4_compiled_fwd, causal, mode)
    aux = (None, None)  # AuxData(None, None)
    cache[key](
        q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, None, None, left,
        right, None, None, aux, None, None,
    )  # fmt: skip
    return out, lse, None, None, None


def _fa4_compiled_fwd(
    causal, mode, q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k, page_table, left, right, sink, sparse, aux, cu_total_m_blocks,
    cu_total_splits_m_blocks,
):  # fmt: skip
    """The stand-in's compiled forward: writes ``out`` and ``lse`` (the mask: FA4's own causal
    flag and window sides, resolved); compiled from the ring's fp32 class (``mode``), ``out``
    in fp32 into the buffer whose rows' first ``D`` values of the input dtype ``out`` views,
    as its epilogue does (Note [fp32 block outputs from flash-attn 4]); from its merging class,
    merged into that buffer and ``lse`` in fp32 (Note [Merging in flash-attn 4's epilogue])."""
    kw = dict(causal=False, scale=scale, window=_fa4_window(causal, left, right))
    rows = None  # every row of q; with seqused_q, those of its documents (in place)
    if seqused_q is not None:
        docs = _fa4_documents(cu_seqlens_q, seqused_q)
        rows = torch.cat([torch.arange(a, a + n) for a, n in docs])
        cu_seqlens_q = torch.zeros_like(cu_seqlens_q)
        cu_seqlens_q[1:] = seqused_q.cumsum(0)
    o, lse_ = _fa4_math(
        "forward", cu_seqlens_q, cu_seqlens_k, q if rows is None else q[rows], k, v, **kw
    )
    if mode != "plain":
        assert out.dtype in (torch.bfloat16, torch.float16)
        strides = [s // 2 for s in out.stride()[:-1]] + [1]
        out = torch.empty(0).set_(
            out.untyped_storage(), out.storage_offset() // 2, out.shape, strides
        )
    if mode == "merge":
        varlen = cu_seqlens_q is not None
        acc = (out[None], lse[None]) if varlen else (out, lse)
        block = (o.float(), lse_.float())
        merge_(*acc, *((block[0][None], block[1][None]) if varlen else block), rows)
        return
    assert rows is None  # the ring reads queries in place only to merge them
    out.copy_(o)
    if lse is not None:
        lse.copy_(lse_)


fa4_flash_attn_fwd.compile_cache = {}


def fa4_flash_attn_bwd(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale=None,
    causal=False,
    softcap=0.0,
    window_size_left=None,
    window_size_right=None,
    m_block_size=64,
    n_block_size=128,
    num_threads=256,
    pack_gqa=False,
    num_stages_Q=2,
    num_stages_dO=2,
    SdP_swapAB=False,
    dKV_swapAB=False,
    dQ_swapAB=False,
    AtomLayoutMSdP=2,
    AtomLayoutNdKV=2,
    AtomLayoutMdQ=2,
    V_in_regs=False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=False,
    dq=None,
    dk=None,
    dv=None,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    dlse=None,
    learnable_sink=None,
):
    """``(dq, dk, dv)``, fresh tensors in the input dtype."""
    args = dict(locals())
    FA4_CALLS.append(args)
    used = {"q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "deterministic"}
    used |= {"window_size_left", "window_size_right", "cu_seqlens_q", "cu_seqlens_k"}
    used |= {"max_seqlen_q", "max_seqlen_k"}
    _fa4_unused_at_defaults(fa4_flash_attn_bwd, args, used)
    q, k, v, out, dout, lse = (_fa4_maybe_contiguous(x) for x in (q, k, v, out, dout, lse))
    _fa4_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
    H = q.shape[-2]
    lse_shape = (q.shape[0], H, q.shape[1]) if cu_seqlens_q is None else (H, q.shape[0])
    assert lse.dtype == torch.float32 and lse.shape == lse_shape
    assert isinstance(deterministic, bool)
    window = _fa4_window(causal, window_size_left, window_size_right)
    kw = dict(causal=False, scale=softmax_scale, window=window)
    grads = _fa4_math("backward", cu_seqlens_q, cu_seqlens_k, dout, q, k, v, out, lse, **kw)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))


class FA4ForwardSm90:
    """Stands in for flash-attn 4's sm90 forward class (what the interface compiles)."""


class FA4Fp32Out(FA4ForwardSm90):
    """Stands in for ``_flash_attn4_fp32_out``'s class: the forward writes ``out`` in fp32."""


class FA4Fp32Merge(FA4ForwardSm90):
    """Stands in for ``_flash_attn4_fp32_out``'s merging class: the forward merges into
    ``out`` (fp32) and ``lse``."""


@pytest.fixture
def flash_attn4(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Stand-in ``flash_attn.cute.interface`` on an sm90 device; returns the recorded calls."""
    packages = {}
    for name in ("flash_attn", "flash_attn.cute"):
        packages[name] = types.ModuleType(name)
        packages[name].__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        packages[name].__path__ = []
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = fa4_flash_attn_fwd
    interface._flash_attn_bwd = fa4_flash_attn_bwd
    interface.FlashAttentionForwardSm90 = FA4ForwardSm90
    fp32_out = types.ModuleType("dtensor_ring.kernels._flash_attn4_fp32_out")
    fp32_out.FlashAttentionForwardSm90Fp32Out = FA4Fp32Out
    fp32_out.FlashAttentionForwardSm90Fp32Merge = FA4Fp32Merge
    monkeypatch.setitem(sys.modules, fp32_out.__name__, fp32_out)
    packages["flash_attn"].cute = packages["flash_attn.cute"]
    packages["flash_attn.cute"].interface = interface
    for name, module in (*packages.items(), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flash_attn4_module, "_capability", lambda: (9, 0))
    monkeypatch.setattr(fa4_launch, "_LAUNCHES", {})  # each test records its own launches
    monkeypatch.setattr(fa4_launch, "_CACHES", {"fp32_out": {}, "merge": {}})
    monkeypatch.setattr(fa4_flash_attn_fwd, "compile_cache", {})
    FA4_CALLS.clear()
    return FA4_CALLS


def _assert_same(got: tuple[Tensor, ...], want: tuple[Tensor, ...], inputs) -> None:
    """Bitwise equal (same fp64 math, same casts) and fresh."""
    _assert_fresh_and_equal(got, want, inputs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


WINDOWS = [  # (S_q, S_k, causal, window, the (left, right) FA4 must receive)
    (12, 12, False, None, (None, None)),
    (12, 12, True, None, (None, None)),
    (12, 16, False, (3, 0), (3, 0)),
    (16, 12, False, (-1, 2), (None, 2)),
    (12, 16, False, (0, -1), (0, None)),
    (12, 12, False, (2, 5), (2, 5)),
]


@pytest.mark.parametrize("s_q,s_k,causal,window,fa4_window", WINDOWS)
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_flash_attn4_dense_matches_reference(
    flash_attn4, s_q, s_k, causal, window, fa4_window, num_kv_heads
):
    B, H, D = 2, 4, 8
    g = torch.Generator().manual_seed(2)
    bf16 = dict(dtype=torch.bfloat16)
    q = torch.randn(B, 2 * s_q, H, D, generator=g).to(**bf16)[:, s_q:]  # views, as the ring
    k, v = torch.randn(2, B, s_k, num_kv_heads, D, generator=g).to(**bf16).unbind(0)
    dout = torch.randn(B, s_q, 2 * H, D, generator=g).to(**bf16)[:, :, :H]
    kw = dict(causal=causal, scale=SCALE, window=window)

    out, lse = FLASH4.forward(q, k, v, **kw)
    want_out, want_lse = MATH.forward(q.double(), k.double(), v.double(), **kw)
    _assert_same((out, lse), (want_out.to(q.dtype), want_lse.float()), (q, k, v))
    assert out.shape == (B, s_q, H, D) and lse.shape == (B, H, s_q)

    lse_view = torch.randn(B, H, 2 * s_q, generator=g)[..., :s_q].copy_(lse)  # global lse slice
    grads = FLASH4.backward(dout, q, k, v, out, lse_view, **kw)
    want = MATH.backward(*(t.double() for t in (dout, q, k, v, out, lse)), **kw)
    _assert_same(grads, tuple(w.to(q.dtype) for w in want), (q, k, v, dout, out))
    assert grads[1].shape == (B, s_k, num_kv_heads, D)

    fwd, bwd = flash_attn4
    for call in (fwd, bwd):
        assert call["softmax_scale"] == SCALE and call["causal"] is causal
        assert (call["window_size_left"], call["window_size_right"]) == fa4_window
    assert fwd["return_lse"] is True and fwd["cu_seqlens_q"] is None
    assert bwd["out"] is out and bwd["dout"] is dout and bwd["lse"] is lse_view
    assert bwd["deterministic"] is False


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 0))])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_flash_attn4_varlen_matches_reference(flash_attn4, causal, window, num_kv_heads):
    H, D = 4, 8
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    T, max_seqlen = 20, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, 2 * D, generator=g).to(torch.float16)[..., ::2]  # last-dim stride 2
    k, v = torch.randn(2, T, num_kv_heads, D, generator=g).to(torch.float16).unbind(0)
    dout = torch.randn(T, H, D, generator=g).to(torch.float16)
    args = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    kw = dict(causal=causal, scale=SCALE, window=window)

    out, lse = FLASH4.forward_varlen(q, k, v, *args, **kw)
    want_out, want_lse = MATH.forward_varlen(q.double(), k.double(), v.double(), *args, **kw)
    _assert_same((out, lse), (want_out.to(q.dtype), want_lse.float()), (q, k, v))
    assert out.shape == (T, H, D) and lse.shape == (H, T)

    lse_t = lse.t().contiguous().t()  # [H, T] with transposed strides
    grads = FLASH4.backward_varlen(dout, q, k, v, out, lse_t, *args, **kw)
    want = MATH.backward_varlen(*(t.double() for t in (dout, q, k, v, out, lse)), *args, **kw)
    _assert_same(grads, tuple(w.to(q.dtype) for w in want), (q, k, v, dout, out))

    for call in flash_attn4:
        assert call["cu_seqlens_q"] is cu_seqlens and call["cu_seqlens_k"] is cu_seqlens
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == max_seqlen


def test_flash_attn4_forward_replayed(flash_attn4, monkeypatch):
    """A forward of a signature seen before launches the kernel the wrapper launched for it,
    without the wrapper (Note [flash-attn 4's forward, replayed]): bitwise the same results,
    dense and varlen (``cu_seqlens_q is cu_seqlens_k``), each mask its own signature; a call
    whose input the wrapper copies goes through the wrapper every time; inputs on one pointer
    (``q is k is v``) are a signature of their own; ``REPLAY = False`` turns it off."""
    g = torch.Generator().manual_seed(4)
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)

    def inputs(varlen: bool, misaligned: bool = False):  # fresh values, the same signature
        shape = (20, 4, 16) if varlen else (2, 24, 4, 16)
        q = torch.randn(shape, generator=g).to(torch.bfloat16)
        q = q.flatten()[1:].as_strided(q[..., :8].shape, q.stride()) if misaligned else q
        q = q[..., :8]  # a view, as the ring's blocks
        k, v = torch.randn(2, *q.shape[:-2], 2, 8, generator=g).to(torch.bfloat16).unbind(0)
        return q, k, v

    def check(varlen: bool, q, k, v, window, wrapper_calls: int) -> None:
        calls = len(flash_attn4)
        kw = dict(causal=window is None, scale=SCALE, window=window)
        if varlen:
            args = (cu_seqlens, cu_seqlens, 8, 8)
            got = FLASH4.forward_varlen(q, k, v, *args, **kw)
            want = MATH.forward_varlen(*(t.double() for t in (q, k, v)), *args, **kw)
        else:
            got = FLASH4.forward(q, k, v, **kw)
            want = MATH.forward(*(t.double() for t in (q, k, v)), **kw)
        _assert_same(got, (want[0].to(q.dtype), want[1].float()), (q, k, v))
        assert len(flash_attn4) - calls == wrapper_calls

    for varlen in (False, True):
        for window in (None, (3, 0), (2, 5)):
            check(varlen, *inputs(varlen), window, wrapper_calls=1)  # recorded
            for _ in range(2):
                check(varlen, *inputs(varlen), window, wrapper_calls=0)  # replayed
        for _ in range(2):  # the wrapper copies a misaligned q: its call, every time
            check(varlen, *inputs(varlen, misaligned=True), None, wrapper_calls=1)

    def heads4():  # q, k or v of a new signature
        return torch.randn(2, 2, 24, 4, 8, generator=g).to(torch.bfloat16)[:, 0]

    q = heads4()
    check(False, q, q, q, (1, 1), wrapper_calls=1)
    check(False, heads4(), heads4(), heads4(), (1, 1), wrapper_calls=1)  # not one pointer
    check(False, heads4(), heads4(), heads4(), (1, 1), wrapper_calls=0)
    q = heads4()
    check(False, q, q, q, (1, 1), wrapper_calls=0)
    monkeypatch.setattr(fa4_launch, "REPLAY", False)
    check(False, q, q, q, (1, 1), wrapper_calls=1)


def _own_cache(interface) -> bool:
    """Whether the wrapper's compile cache is its own (none of the swapped classes')."""
    cache = interface._flash_attn_fwd.compile_cache
    return all(cache is not c for c in fa4_launch._CACHES.values())


def test_flash_attn4_merges_in_its_epilogue(flash_attn4_pieces, monkeypatch):
    """``merge_forward`` (Note [Merging in flash-attn 4's epilogue]): the block merged into its
    rows of the running fp32 ``(out, lse)`` (strided views of longer accumulators) in place
    as the engine's merge of its fp32 result, the other rows untouched, dense and varlen;
    compiled from the merging class with pack-GQA off on a signature's first call, replayed
    after, the wrapper's own class and cache back in place; a signature the wrapper must run
    every time (a misaligned q) and ``REPLAY = False`` merge nothing (False)."""
    calls, interface = FA4_CALLS, flash_attn4_pieces
    g, cu = torch.Generator().manual_seed(7), torch.tensor([0, 5, 12, 20], dtype=torch.int32)

    def check(varlen: bool, misaligned: bool, merged: bool, wrapper_calls: int) -> None:
        shape = (20, 4, 16) if varlen else (2, 20, 4, 16)
        q = torch.randn(shape, generator=g).to(torch.bfloat16)
        q = q.flatten()[1:].as_strided(q[..., :8].shape, q.stride()) if misaligned else q
        q = q[..., :8]
        k, v = torch.randn(2, *q.shape[:-2], 2, 8, generator=g).to(torch.bfloat16).unbind(0)
        args = (cu, cu, 8, 8) if varlen else ()
        lse_shape = (4, 20) if varlen else (2, 4, 20)
        # the block's rows of a longer accumulator (rows 10-29 of 40): strided views
        out_all = torch.randn(*q.shape[:-3], 40, *q.shape[-2:], generator=g)
        lse_all = torch.randn(*lse_shape[:-1], 40, generator=g)
        out_acc, lse_acc = out_all.narrow(-3, 10, 20), lse_all.narrow(-1, 10, 20)
        want_all = (out_all.clone(), lse_all.clone())
        want = (want_all[0].narrow(-3, 10, 20), want_all[1].narrow(-1, 10, 20))
        before = len(calls)
        merge = FLASH4.merge_forward_varlen if varlen else FLASH4.merge_forward
        assert merge(q, k, v, *args, out_acc, lse_acc, causal=True, scale=SCALE) is merged
        if merged:
            o, lse = getattr(MATH, "forward_varlen" if varlen else "forward")(
                *(t.double() for t in (q, k, v)), *args, causal=True, scale=SCALE
            )
            block = (o.float(), lse.float())
            acc = (want[0][None], want[1][None]) if varlen else want
            merge_eager_(*acc, *((block[0][None], block[1][None]) if varlen else block))
        assert torch.equal(out_all, want_all[0]) and torch.equal(lse_all, want_all[1])
        assert len(calls) - before == wrapper_calls
        if wrapper_calls:
            assert calls[-1]["pack_gqa"] is False
        assert interface.FlashAttentionForwardSm90 is FA4ForwardSm90
        assert all(
            interface._flash_attn_fwd.compile_cache is not c for c in fa4_launch._CACHES.values()
        )

    for varlen in (False, True):
        check(varlen, False, True, wrapper_calls=1)  # recorded with the merging class
        check(varlen, False, True, wrapper_calls=0)  # replayed
        check(varlen, True, True, wrapper_calls=1)  # recorded: not replayable
        check(varlen, True, False, wrapper_calls=0)  # the engine merges
    monkeypatch.setattr(fa4_launch, "REPLAY", False)
    check(False, False, False, wrapper_calls=0)


def test_flash_attn4_merges_rows_where_they_lie(flash_attn4_pieces, monkeypatch):
    """``merge_forward_varlen(..., seqused_q=)`` (Note [Varlen blocks merged where their rows
    lie]): the whole local queries and accumulators, each document's rows of the block from
    ``cu_seqlens_q[d]`` (``seqused_q[d]`` of them, a document with none at the end), merged
    as the engine merges the gathered rows, the other rows untouched; recorded on the first
    call, replayed after (``seqused_q`` one of the call's tensors); a kernel without
    ``merges_by_document`` merges nothing (False, no call)."""
    calls = FA4_CALLS
    g = torch.Generator().manual_seed(8)
    q = torch.randn(24, 4, 8, generator=g).to(torch.bfloat16)  # documents of 10, 6, 8 rows
    starts = torch.tensor([6, 24, 18, 24], dtype=torch.int32)  # the block: rows 6-9 and 18-23
    used = torch.tensor([4, 0, 6], dtype=torch.int32)
    rows = torch.cat([torch.arange(6, 10), torch.arange(18, 24)])
    cu_k = torch.tensor([0, 4, 4, 10], dtype=torch.int32)  # its K/V by document (causal: as many)
    k, v = torch.randn(2, 10, 2, 8, generator=g).to(torch.bfloat16).unbind(0)
    kw = dict(causal=True, scale=SCALE, seqused_q=used)
    for by_document, wrapper_calls in ((True, 1), (True, 0), (False, 0)):
        monkeypatch.setattr(FlashAttn4Kernel, "merges_by_document", by_document)
        out_acc, lse_acc = torch.randn(24, 4, 8, generator=g), torch.randn(4, 24, generator=g)
        want = (out_acc.clone(), lse_acc.clone())
        before = len(calls)
        done = FLASH4.merge_forward_varlen(q, k, v, starts, cu_k, 6, 6, out_acc, lse_acc, **kw)
        assert done is by_document and len(calls) - before == wrapper_calls
        if by_document:
            cu_q = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
            o, lse = MATH.forward_varlen(
                *(t.double() for t in (q[rows], k, v)), cu_q, cu_k, 6, 6, causal=True, scale=SCALE
            )
            merge_(want[0][None], want[1][None], o.float()[None], lse.float()[None], rows)
        assert torch.equal(out_acc, want[0]) and torch.equal(lse_acc, want[1])


def test_flash_attn4_fp32_outputs(flash_attn4_pieces, monkeypatch):
    """``unrounded=True`` (Note [fp32 block outputs from flash-attn 4]): out in fp32, the fp64
    result rounded to fp32 only, dense and varlen; compiled from the fp32 class with pack-GQA
    off on a signature's first call, replayed after, the wrapper's own class and cache back
    in place; a signature the wrapper must run every time (a misaligned q) after its first
    call, and ``REPLAY = False``, give the plain forward's rounded out in fp32."""
    monkeypatch.setattr(FlashAttn4Kernel, "unrounded_outputs", True)
    calls, interface = FA4_CALLS, flash_attn4_pieces
    g, cu = torch.Generator().manual_seed(6), torch.tensor([0, 5, 12, 20], dtype=torch.int32)

    def check(varlen: bool, misaligned: bool, fp32: bool, wrapper_calls: int) -> None:
        shape = (20, 4, 16) if varlen else (2, 20, 4, 16)
        q = torch.randn(shape, generator=g).to(torch.bfloat16)
        q = q.flatten()[1:].as_strided(q[..., :8].shape, q.stride()) if misaligned else q
        q = q[..., :8]
        k, v = torch.randn(2, *q.shape[:-2], 2, 8, generator=g).to(torch.bfloat16).unbind(0)
        kw, before = dict(causal=True, scale=SCALE), len(calls)
        args = (cu, cu, 8, 8) if varlen else ()
        forward = FLASH4.forward_varlen if varlen else FLASH4.forward
        out, lse = forward(q, k, v, *args, **kw, unrounded=True)
        want = getattr(MATH, "forward_varlen" if varlen else "forward")(
            *(t.double() for t in (q, k, v)), *args, **kw
        )
        assert out.dtype == torch.float32 and torch.equal(lse, want[1].float())
        rounded = want[0].float() if fp32 else want[0].to(q.dtype).float()
        assert torch.equal(out, rounded)
        assert len(calls) - before == wrapper_calls
        if wrapper_calls:
            assert calls[-1]["pack_gqa"] is (False if fp32 else None)
        assert interface.FlashAttentionForwardSm90 is FA4ForwardSm90
        assert all(
            interface._flash_attn_fwd.compile_cache is not c for c in fa4_launch._CACHES.values()
        )

    for varlen in (False, True):
        check(varlen, False, True, wrapper_calls=1)  # recorded with the fp32 class
        check(varlen, False, True, wrapper_calls=0)  # replayed
        check(varlen, True, True, wrapper_calls=1)  # recorded: not replayable
        for _ in range(2):
            check(varlen, True, False, wrapper_calls=1)
    monkeypatch.setattr(fa4_launch, "REPLAY", False)
    check(False, False, False, wrapper_calls=1)


def test_flash_attn4_deterministic_follows_torch(flash_attn4, monkeypatch):
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    q = torch.randn(1, 8, 2, 8).to(torch.bfloat16)
    out, lse = FLASH4.forward(q, q, q, causal=True, scale=SCALE)
    FLASH4.backward(q, q, q, q, out, lse, causal=True, scale=SCALE)
    assert flash_attn4[-1]["deterministic"] is True


def test_selection_follows_the_deterministic_switch(flash_attn4):
    """The remembered backend choice (kernels.select_kernel) follows
    torch.use_deterministic_algorithms: flash-attn 4's backward is deterministic only under it."""
    call = KernelCall("cuda", torch.bfloat16, 128, 32, 8, deterministic=True)
    assert select_kernel(call).name != "flash_attn4"
    try:
        torch.use_deterministic_algorithms(True)
        assert select_kernel(call).name == "flash_attn4"
    finally:
        torch.use_deterministic_algorithms(False)
    assert select_kernel(call).name != "flash_attn4"


def test_flash_attn4_availability(monkeypatch):
    flash_attn4_module._installed.cache_clear()  # looked up afresh, whatever ran before
    assert (
        FLASH4.is_available()
        == "the flash-attn-4 package is not installed (pip install flash-attn-4)"
    )
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", types.ModuleType("stand-in"))
    for capability, reason in [
        (None, "CUDA is not available"),
        ((8, 0), "the current device is sm80"),
        ((12, 0), "the current device is sm120"),
        ((9, 0), None),
        ((10, 0), None),
    ]:
        monkeypatch.setattr(flash_attn4_module, "_capability", lambda c=capability: c)
        got = FLASH4.is_available()
        assert got is None if reason is None else reason in got, (capability, got)


def test_flash_attn4_selection_and_limits(flash_attn4, monkeypatch):
    call = KernelCall("cuda", torch.bfloat16, 128, 32, 8)  # pure data: no GPU needed
    assert select_kernel(call).name == "flash_attn4"  # first in BACKENDS
    for extra in (dict(varlen=True), dict(window=True)):
        assert (
            FLASH4.unsupported_reason(KernelCall("cuda", torch.float16, 64, 8, 2, **extra)) is None
        )
    assert FLASH4.unsupported_reason(KernelCall("cuda", torch.bfloat16, 192, 8, 8)) is None
    assert "dtype" in FLASH4.unsupported_reason(KernelCall("cuda", torch.float32, 64, 8, 8))
    assert "multiple of 8" in FLASH4.unsupported_reason(
        KernelCall("cuda", torch.bfloat16, 100, 8, 8)
    )
    assert "> 256" in FLASH4.unsupported_reason(KernelCall("cuda", torch.bfloat16, 512, 8, 8))
    deterministic = KernelCall("cuda", torch.bfloat16, 128, 32, 8, deterministic=True)
    assert "use_deterministic_algorithms" in FLASH4.unsupported_reason(deterministic)
    monkeypatch.setattr(flash_attn4_module, "_capability", lambda: (10, 0))
    assert "<= 128 or 256 on sm100" in FLASH4.unsupported_reason(
        KernelCall("cuda", torch.bfloat16, 192, 8, 8)
    )
    assert FLASH4.unsupported_reason(KernelCall("cuda", torch.bfloat16, 256, 8, 8)) is None
    assert "device 'cpu'" in FLASH4.unsupported_reason(KernelCall("cpu", torch.bfloat16, 8, 4, 4))


# --- aten-based adapters: argument order and shapes on the meta device ------------------------
@pytest.mark.parametrize("kernel", [CudnnKernel(), TorchFlashKernel()], ids=lambda k: k.name)
def test_aten_adapters_on_meta(kernel):
    B, S, H, H_kv, D = 2, 16, 8, 2, 64
    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(B, 2 * S, H, D, **meta)[:, :S]
    k, v = torch.empty(2, B, S, H_kv, D, **meta).unbind(0)
    out, lse = kernel.forward(q, k, v, causal=True, scale=SCALE)
    assert out.shape == (B, S, H, D) and lse.shape == (B, H, S) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal=True, scale=SCALE)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_cuda_flash_varlen_on_meta():
    T, H, H_kv, D = 40, 8, 2, 64
    meta = dict(dtype=torch.bfloat16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    q, k, v = torch.empty(T, H, D, **meta), *torch.empty(2, T, H_kv, D, **meta).unbind(0)
    kernel = TorchFlashKernel()
    out, lse = kernel.forward_varlen(q, k, v, cu, cu, 30, 30, causal=True, scale=SCALE)
    assert out.shape == (T, H, D) and lse.shape == (H, T)
    grads = kernel.backward_varlen(out, q, k, v, out, lse, cu, cu, 30, 30, causal=True, scale=SCALE)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# --- selection --------------------------------------------------------------------------------
def test_select_kernel_on_cpu():
    q = torch.randn(1, 8, 4, 16)
    assert select_kernel(KernelCall.of(q, q)).name == "cpu_flash"


def test_select_named_backend_that_cannot_run():
    call = KernelCall.of(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16))
    reason = CudnnKernel().unsupported_reason(call)
    with pytest.raises(ValueError, match="cudnn") as info:
        select_kernel(call, "cudnn")
    assert reason in str(info.value)


def test_select_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="no_such_kernel") as info:
        select_kernel(KernelCall("cpu", torch.float32, 16, 4, 4), "no_such_kernel")
    assert all(name in str(info.value) for name in BACKEND_NAMES)


def test_cudnn_backward_gets_out_and_dout_in_the_query_layout():
    """cuDNN's cached backward graph ignores the strides of out and dout (kernels/cudnn.py):
    the adapter hands both in the query's layout, copying only when they differ, and makes a
    query contiguous first unless it is BSHD- or BHSD-dense (values unchanged throughout)."""
    from dtensor_ring.kernels.cudnn import _query_layout

    x = torch.randn(2, 8, 4, 16)
    bhsd_backed = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] view
    strided = torch.randn(2, 8, 4, 32)[..., ::2]
    for q in (x, bhsd_backed, strided):
        for out in (x.clone(), bhsd_backed.clone()):
            dout = bhsd_backed.clone() if out.is_contiguous() else x.clone()
            q2, out2, dout2 = _query_layout(q, out, dout)
            assert q2.stride() == out2.stride() == dout2.stride()
            assert torch.equal(q2, q) and torch.equal(out2, out) and torch.equal(dout2, dout)
            if q is x and out.is_contiguous():
                assert out2 is out  # no copy when the layouts already agree


# --- flash-attn 4's backward pieces (kernels/flash_attn4_grads.py) ---------------------------
# Stand-ins of the private functions ``unrounded_backward`` calls, with the argument positions
# of flash-attn-4 4.0.0b36's ``_flash_attn_bwd`` (dense, sm90). The main "kernel" adds its fp32
# gradients (dq and dk before the softmax scale, as flash-attn 4's) into the flat accumulators
# in an order per tile configuration that only the postprocess stand-in knows (a random
# permutation), so the adapter must learn it from the postprocess.
FA4_LOG2E = 1.4426950408889634


def _fa4_round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _fa4_tile_perm(rows: int, hdim_r: int, atom_layout: int, swap_ab: bool) -> Tensor:
    """Where row-major element ``i`` of a ``rows x hdim_r`` tile is stored in the flat tile."""
    seed = ((rows * 1000 + hdim_r) * 10 + atom_layout) * 2 + int(swap_ab)
    return torch.randperm(rows * hdim_r, generator=torch.Generator().manual_seed(seed))


def fa4_tile_size_bwd_sm90(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
    """``_tile_size_bwd_sm90``'s values for head dims <= 128."""
    m = 64 if causal or local else 80
    return types.SimpleNamespace(
        m_block_size=m,
        n_block_size=128,
        num_stages_Q=2,
        num_stages_dO=2,
        num_stages_PdS=2,
        SdP_swapAB=True,
        dKV_swapAB=False,
        dQ_swapAB=m % 64 != 0,
        AtomLayoutMSdP=1,
        AtomLayoutNdKV=2,
        AtomLayoutMdQ=1,
        num_wg=2,
        dQ_single_wg=False,
    )


def _fa4_to_tiles(x_BSHD: Tensor, rows: int, hdim_r: int, perm: Tensor) -> Tensor:
    """``[B, S, H, D]`` -> a flat fp32 accumulator ``[B, H, S_r * hdim_r]`` in ``perm``'s order."""
    B, S, H, D = x_BSHD.shape
    s_r = _fa4_round_up(S, rows)
    padded = torch.zeros(B, H, s_r, hdim_r, dtype=torch.float64)
    padded[:, :, :S, :D] = x_BSHD.transpose(1, 2)
    tiles = padded.reshape(B, H, s_r // rows, rows * hdim_r)
    flat = torch.empty_like(tiles)
    flat[..., perm] = tiles
    return flat.reshape(B, H, -1).float()


def fa4_bwd_preprocess(
    out, dout, dpsum, lse, lse_log2, dq_accum, cu_seqlens_q, seqused_q, dlse, dtype,
    head_dim, head_dim_v, m_block_size, *, cu_total_m_blocks, fake_mode, hdim_multiple_of,
):  # fmt: skip
    """``_bwd_preprocess``: dpsum = rowsum(out * dout), lse_log2 = lse * log2(e), dq_accum = 0.
    Varlen (``cu_seqlens_q``): each document's rows from its padded offset on, whole tiles
    (rows past its end: lse_log2 +inf, dpsum 0); every other row of the buffers NaN."""
    assert seqused_q is dlse is cu_total_m_blocks is None and not fake_mode
    if cu_seqlens_q is not None:
        m, hd_r = m_block_size, _fa4_round_up(head_dim, hdim_multiple_of)
        H, R = dpsum.shape
        assert lse_log2.shape == (H, R) and dq_accum.shape == (H, R * hd_r)
        assert R == (out.shape[0] + cu_seqlens_q.numel() * m - 1) // m * m
        for t in (dpsum, lse_log2, dq_accum):
            t.fill_(float("nan"))
        tiles = dq_accum.view(H, R, hd_r)
        for b, (start, length) in enumerate(_fa4_documents(cu_seqlens_q, None)):
            pad, rows = (start + b * m) // m * m, _fa4_round_up(length, m)
            dpsum[:, pad : pad + rows] = 0
            lse_log2[:, pad : pad + rows] = float("inf")
            tiles[:, pad : pad + rows] = 0
            sl = slice(start, start + length)
            dpsum[:, pad : pad + length] = (out[sl].float() * dout[sl].float()).sum(-1).T
            lse_log2[:, pad : pad + length] = lse[:, sl] * FA4_LOG2E
        return
    B, S, H, _ = out.shape
    assert dpsum.shape == lse_log2.shape == (B, H, _fa4_round_up(S, m_block_size))
    hd_r = _fa4_round_up(head_dim, hdim_multiple_of)
    assert dq_accum.shape == (B, H, dpsum.shape[-1] * hd_r) and dq_accum.dtype == torch.float32
    dpsum[..., :S] = (out.float() * dout.float()).sum(-1).transpose(1, 2)
    lse_log2[..., :S] = lse * FA4_LOG2E
    dq_accum.zero_()


def _fa4_documents(cu_seqlens: Tensor, seqused: Tensor | None) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each document: ``cu_seqlens[b]`` and ``seqused[b]`` if given,
    else up to ``cu_seqlens[b + 1]``."""
    cu = cu_seqlens.tolist()
    used = [b - a for a, b in itertools.pairwise(cu)] if seqused is None else seqused.tolist()
    return list(zip(cu[:-1], used, strict=True))


def _fa4_block_grads(q64, k64, v64, do64, lse_log2, dpsum, scale, visible, group):
    """The main kernel's math on ``[B, S, H, D]`` fp64 inputs, ``lse_log2``/``dpsum`` ``[B, H,
    S_q]`` and ``visible`` ``[S_q, S_k]``: dq and dk before the scale, dv."""
    k64, v64 = (t.repeat_interleave(group, 2) for t in (k64, v64))
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.exp(scores - lse_log2[..., None].double() / FA4_LOG2E)
    p = p.masked_fill(scores == float("-inf"), 0)  # rows without a visible key: 0
    dp = torch.einsum("bqhd,bkhd->bhqk", do64, v64)
    ds = p * (dp - dpsum[..., None].double())
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k64)
    dk, dv = (
        torch.einsum("bhqk,bqhd->bkhd", w, x).unflatten(2, (-1, group)).sum(3)
        for w, x in ((ds, q64), (p, do64))
    )
    return dq, dk, dv


class FA4BackwardSm90:
    """``FlashAttentionBackwardSm90``: its configuration; ``fa4_compile`` makes it callable."""

    def __init__(self, dtype, head_dim, head_dim_v, qhead_per_kvhead, causal, **kw):
        self.causal, self.local, self.group, self.kw = causal, kw["is_local"], qhead_per_kvhead, kw
        # its own mask's tile configuration, or a causal block's (what block sparsity runs)
        tiles = {
            (c.m_block_size, c.n_block_size, c.dQ_swapAB)
            for c in (
                fa4_tile_size_bwd_sm90(head_dim, head_dim_v, causal, self.local),
                fa4_tile_size_bwd_sm90(head_dim, head_dim_v, True, False),
            )
        }
        assert (kw["tile_m"], kw["tile_n"], kw["dQ_swapAB"]) in tiles

    def __call__(
        self, q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale, *rest
    ):  # the 22 arguments of the compiled kernel
        cu_q, cu_k, su_q, su_k, left, right, sem_q, sem_k, sem_v, aux, sparse, cu_blocks = rest
        assert su_k is sparse is cu_blocks is None and (cu_q is None) == (cu_k is None)
        assert aux == ("aux", None, None) and (sem_q is None) == (not self.kw["deterministic"])
        window = (-1, 0) if self.causal else None
        if self.local:
            window = (-1 if left is None else left, -1 if right is None else right)
        if cu_q is not None:
            return self._varlen(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale,
                                window, cu_q, cu_k, su_q, (sem_q, sem_k, sem_v))  # fmt: skip
        assert su_q is None
        if self.kw["deterministic"]:  # zeroed int32 semaphores, separate for dK and dV
            B, H, H_kv = q.shape[0], q.shape[2], k.shape[2]
            n_blocks = _fa4_round_up(k.shape[1], self.kw["tile_n"]) // self.kw["tile_n"]
            assert sem_q.shape == (B, H, lse_log2.shape[-1] // self.kw["tile_m"], 1)
            if self.group == 1:
                assert sem_k is None and sem_v is None
            else:
                assert sem_k is not sem_v and sem_k.shape == sem_v.shape == (B, H_kv, n_blocks, 2)
            assert all(
                t.dtype == torch.int32 and not t.any()
                for t in (sem_q, sem_k, sem_v)
                if t is not None
            )
        q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
        S_q, S_k, D = q.shape[1], k.shape[1], q.shape[-1]
        visible = torch.ones(S_q, S_k, dtype=torch.bool)
        if window is not None:
            visible = window_mask(S_q, S_k, window, q.device)
        rows = (lse_log2[..., :S_q], dpsum[..., :S_q])
        dq, dk, dv = _fa4_block_grads(q64, k64, v64, do64, *rows, scale, visible, self.group)
        kw, hd_r = self.kw, _fa4_round_up(D, 32)
        m, n = kw["tile_m"], kw["tile_n"]
        s_q_r = _fa4_round_up(S_q, m)  # the rows it reads and adds to: whole tiles
        assert lse_log2.shape[-1] == dpsum.shape[-1] == s_q_r
        assert dq_accum.shape == (q.shape[0], q.shape[2], s_q_r * hd_r)
        perm_q = _fa4_tile_perm(m, hd_r, kw["AtomLayoutMdQ"], kw["dQ_swapAB"])
        dq_accum.add_(_fa4_to_tiles(dq, m, hd_r, perm_q))
        if self.group == 1:  # written in the input dtype, scaled
            dk_out.copy_(dk * scale)
            dv_out.copy_(dv)
            return
        perm_kv = _fa4_tile_perm(n, hd_r, kw["AtomLayoutNdKV"], kw["dKV_swapAB"])
        dk_out.add_(_fa4_to_tiles(dk, n, hd_r, perm_kv))
        dv_out.add_(_fa4_to_tiles(dv, n, hd_r, perm_kv))

    def _varlen(self, q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale, window,
                cu_q, cu_k, su_q, semaphores):  # fmt: skip
        """Each document ``b`` as the real kernel runs it: whole tiles of ``m`` query rows from
        row ``cu_q[b]`` (rows past its ``seqused_q`` read too: the tensor's next rows, zero past
        its end), lse_log2 and dpsum from its padded offset ``(cu_q[b] + b * m) // m * m`` (rows
        past the document are masked by nothing but their +inf lse_log2); dq added into
        ``dq_accum``'s tiles there; dK/dV of its keys ``cu_k[b]:cu_k[b + 1]``."""
        kw, group = self.kw, self.group
        m, n, D, H = kw["tile_m"], kw["tile_n"], q.shape[-1], q.shape[1]
        hd_r = _fa4_round_up(D, 32)
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
        assert (su_q is None or su_q.shape[0] == cu_q.shape[0] - 1) and dpsum.dim() == 2
        if kw["deterministic"]:
            assert semaphores[0].shape[:2] == (cu_q.shape[0] - 1, H)
        perm_q = _fa4_tile_perm(m, hd_r, kw["AtomLayoutMdQ"], kw["dQ_swapAB"])
        perm_kv = _fa4_tile_perm(n, hd_r, kw["AtomLayoutNdKV"], kw["dKV_swapAB"])
        q_docs, kv_docs = _fa4_documents(cu_q, su_q), _fa4_documents(cu_k, None)
        for b, ((q0, s_q), (k0, s_k)) in enumerate(zip(q_docs, kv_docs, strict=True)):
            if s_q == 0 or s_k == 0:
                continue
            rows = _fa4_round_up(s_q, m)
            q_tile = torch.zeros(rows, *q.shape[1:], dtype=torch.float64)
            do_tile = torch.zeros(rows, *dout.shape[1:], dtype=torch.float64)
            got = q[q0 : q0 + rows].shape[0]
            q_tile[:got], do_tile[:got] = q[q0 : q0 + rows], dout[q0 : q0 + rows]
            pad = (q0 + b * m) // m * m
            i = torch.arange(rows)[:, None]
            j = torch.arange(s_k)[None, :]
            visible = torch.ones(rows, s_k, dtype=torch.bool)
            if window is not None:
                visible = in_window(j - i - (s_k - s_q), window)
            dq, dk, dv = _fa4_block_grads(
                q_tile[None], k[k0 : k0 + s_k].double()[None], v[k0 : k0 + s_k].double()[None],
                do_tile[None], lse_log2[None, :, pad : pad + rows],
                dpsum[None, :, pad : pad + rows], scale, visible, group,
            )  # fmt: skip
            tiles = dq_accum.view(H, -1, m * hd_r)
            tiles[:, pad // m : (pad + rows) // m] += _fa4_to_tiles(dq, m, hd_r, perm_q).view(
                H, -1, m * hd_r
            )
            if group == 1:
                dk_out[k0 : k0 + s_k] = (dk[0] * scale).to(dk_out.dtype)
                dv_out[k0 : k0 + s_k] = dv[0].to(dv_out.dtype)
                continue
            pad_k = (k0 + b * n) // n * n
            for acc, x in ((dk_out, dk), (dv_out, dv)):
                kv_tiles = _fa4_to_tiles(x, n, hd_r, perm_kv).view(x.shape[2], -1, n * hd_r)
                acc.view(x.shape[2], -1, n * hd_r)[:, pad_k // n :][:, : kv_tiles.shape[1]] += (
                    kv_tiles
                )


def fa4_compile(kernel, *args, options):
    """``cute.compile``: the 22 arguments of the call, then the stream."""
    assert isinstance(kernel, FA4BackwardSm90) and len(args) == 23 and args[-1] == "stream"
    assert options == "--enable-tvm-ffi"

    def compiled(*call_args):
        assert len(call_args) == 22
        kernel(*call_args)

    return compiled


def fa4_bwd_postprocess_convert(
    accum, output, scale, cu_seqlens, seqused, arch, dtype, hdim, block_size, num_threads,
    atom_layout, swap_ab, use_2cta_instrs=False, cluster_size=1, cu_total_m_blocks=None,
    sink_tensors=None, hdim_multiple_of=32, accum_order=None, *, fake_mode,
):  # fmt: skip
    """``_bwd_postprocess_convert``: ``output = round(scale * accum)``, read in tile order."""
    assert cu_seqlens is seqused is cu_total_m_blocks is sink_tensors is accum_order is None
    assert arch == 90 and not use_2cta_instrs and cluster_size == 1 and not fake_mode
    assert num_threads == 256 and dtype == str(output.dtype)
    B, S, H, D = output.shape
    hd_r = _fa4_round_up(hdim, hdim_multiple_of)
    assert D == hdim and accum.shape == (B, H, _fa4_round_up(S, block_size) * hd_r)
    perm = _fa4_tile_perm(block_size, hd_r, atom_layout, swap_ab)
    rows = accum.view(B, H, -1, block_size * hd_r)[..., perm].view(B, H, -1, hd_r)
    output.copy_((rows[:, :, :S, :hdim] * scale).transpose(1, 2))


@pytest.fixture
def flash_attn4_pieces(flash_attn4, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``flash_attn4``'s stand-in interface with the backward's pieces, as version 4.0.0b36."""
    interface = sys.modules["flash_attn.cute.interface"]
    pieces = dict(
        _get_device_arch=lambda: 90,
        _resolve_causal_local_window=_fa4_resolve_window,
        _tile_size_bwd_sm90=fa4_tile_size_bwd_sm90,
        maybe_contiguous=_fa4_maybe_contiguous,
        torch2cute_dtype_map={t: str(t) for t in (torch.bfloat16, torch.float16)},
        _bwd_preprocess=fa4_bwd_preprocess,
        _bwd_postprocess_convert=fa4_bwd_postprocess_convert,
        get_broadcast_dims=lambda t: tuple(s == 0 for s in t.stride()),
        FlashAttentionBackwardSm90=FA4BackwardSm90,
        to_cute_tensor=lambda t, **kw: ("cute", tuple(t.shape)),
        AuxData=lambda tensors, scalars: ("aux", tensors, scalars),
        utils=types.SimpleNamespace(convert_from_dlpack_leading_static=lambda t, **kw: "sem"),
        cute=types.SimpleNamespace(
            compile=fa4_compile,
            runtime=types.SimpleNamespace(make_fake_stream=lambda **kw: "stream"),
        ),
    )
    for name, value in pieces.items():
        monkeypatch.setattr(interface, name, value, raising=False)
    version = flash_attn4_grads.CHECKED_VERSION
    monkeypatch.setattr(flash_attn4_grads, "_installed_version", lambda: version)
    monkeypatch.setattr(flash_attn4_grads, "_COMPILED", {})
    monkeypatch.setattr(flash_attn4_grads, "_PLANS", {})
    monkeypatch.setattr(flash_attn4_tiles, "_TILE_ORDERS", {})
    return interface


@pytest.mark.parametrize("s_q,s_k,causal,window,fa4_window", WINDOWS)
@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn4_unrounded_grads(
    flash_attn4_pieces, monkeypatch, s_q, s_k, causal, window, fa4_window, num_kv_heads, dtype
):
    """``unrounded=True``: dq in fp32, dk and dv too with GQA (else in the input dtype), each
    the fp64 gradient to fp32 precision (else rounded once). On the H200, rounded, they are bitwise
    the plain backward's (tests/gpu/check_flash_attn4.py)."""
    B, H, D = 2, 4, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, s_q, H, D, generator=g).to(dtype)
    k, v = torch.randn(2, B, s_k, num_kv_heads, D, generator=g).to(dtype).unbind(0)
    dout = torch.randn(B, s_q, H, D, generator=g).to(dtype)
    cases = [(SCALE, False), (-SCALE, False), (SCALE, True)]  # -SCALE folds into q
    for scale, deterministic in cases:
        monkeypatch.setattr(
            torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d
        )
        kw = dict(causal=causal, scale=scale, window=window)
        out, lse = FLASH4.forward(q, k, v, **kw)
        got = FLASH4.backward(dout, q, k, v, out, lse, **kw, unrounded=True)
        plain = FLASH4.backward(dout, q, k, v, out, lse, **kw)
        want = MATH.backward(*(t.double() for t in (dout, q, k, v, out, lse)), **kw)
        for name, x, p, w in zip(("dq", "dk", "dv"), got, plain, want, strict=True):
            fp32 = name == "dq" or num_kv_heads < H
            assert x.dtype == (torch.float32 if fp32 else dtype), name
            assert x.shape == p.shape, name
            if fp32:
                assert (x.double() - w).abs().max() <= 1e-6 * w.abs().max(), name
            assert _rounded_once(x.to(p.dtype), w), name


def test_flash_attn4_unrounded_grads_under_graph_capture(flash_attn4_pieces, monkeypatch):
    """While a CUDA graph is captured, a configuration whose tile orders are not learnt yet
    runs the plain backward (learning them synchronises); once learnt, the fp32 one."""
    q = torch.randn(1, 40, 4, 8).to(torch.bfloat16)
    k = torch.randn(1, 40, 2, 8).to(torch.bfloat16)
    out, lse = FLASH4.forward(q, k, k, causal=True, scale=SCALE)
    kw = dict(causal=True, scale=SCALE, unrounded=True)
    monkeypatch.setattr(flash_attn4_grads, "capturing", lambda device: True)
    assert [g.dtype for g in FLASH4.backward(q, q, k, k, out, lse, **kw)] == [torch.bfloat16] * 3
    monkeypatch.setattr(flash_attn4_grads, "capturing", lambda device: False)
    FLASH4.backward(q, q, k, k, out, lse, **kw)  # a warm-up call outside the capture
    monkeypatch.setattr(flash_attn4_grads, "capturing", lambda device: True)
    assert [g.dtype for g in FLASH4.backward(q, q, k, k, out, lse, **kw)] == [torch.float32] * 3


def test_tiled_grads_add_into_rows_once():
    """Note [Block dK/dV added from flash-attn 4's tiles]: a block's dK/dV tiles (a known tile
    order) are added, scaled and in rows, into a run of an accumulator's rows (dense, B = 2)
    or into the rows of an index (varlen, padded tiles); adding them twice raises (the CPU
    path reorders the tiles in place)."""
    from dtensor_ring.kernels.flash_attn4_tiles import TiledGrads, padded_rows, padded_total

    g = torch.Generator().manual_seed(4)
    tile, hdim, hdim_r, heads = 4, 3, 4, 2
    perm = torch.randperm(tile * hdim_r, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())

    def tiled(rows_BHSD: Tensor) -> Tensor:  # row-major [.., R, hdim_r] -> the kernel's tiles
        flat = rows_BHSD.reshape(*rows_BHSD.shape[:-2], -1, tile * hdim_r)
        return flat[..., inverse].flatten(-2)

    seq = 6  # dense: rows 0..5 of 8 (two tiles), into rows 3..8 of a longer accumulator
    rows = [torch.randn(2, heads, 8, hdim_r, generator=g) for _ in "kv"]
    held = TiledGrads([tiled(r) for r in rows], [perm, perm], [0.5, 1.0], None, tile,
                      [hdim] * 2, seq)  # fmt: skip
    accs = [torch.randn(2, 10, heads, hdim, generator=g) for _ in "kv"]
    want = [a.clone() for a in accs]
    for w, r, scale in zip(want, rows, (0.5, 1.0), strict=True):
        w[:, 3:9] += scale * r[:, :, :seq, :hdim].transpose(1, 2)
    held.add_to(*(a[:, 3:9] for a in accs))
    assert all(torch.equal(a, w) for a, w in zip(accs, want, strict=True))
    with pytest.raises(RuntimeError, match="added twice"):
        held.add_to(*(a[:, 3:9] for a in accs))

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # varlen: 8 rows in padded tiles
    padded, index_rows = padded_total(8, cu, tile), padded_rows(cu, 8, tile)
    rows = [torch.randn(heads, padded, hdim_r, generator=g) for _ in "kv"]
    held = TiledGrads([tiled(r) for r in rows], [perm, perm], [0.5, 1.0], index_rows, tile,
                      [hdim] * 2, 8)  # fmt: skip
    dest = torch.randperm(12, generator=g)[:8]
    accs = [torch.randn(12, heads, hdim, generator=g) for _ in "kv"]
    want = [a.clone() for a in accs]
    for w, r, scale in zip(want, rows, (0.5, 1.0), strict=True):
        w.index_add_(0, dest, scale * r[:, index_rows, :hdim].transpose(0, 1))
    held.add_to(*accs, dest)
    assert all(torch.allclose(a, w, rtol=0, atol=1e-6) for a, w in zip(accs, want, strict=True))


def test_flash_attn4_unrounded_grads_checks_the_postprocess(flash_attn4_pieces, monkeypatch):
    """A postprocess that is not a pure reorder of its tile (here: it also adds 1 to one
    element) fails the check of the learnt order: the plain backward runs, every time."""

    def not_a_reorder(accum, output, *args, **kw):
        fa4_bwd_postprocess_convert(accum, output, *args, **kw)
        output[0, 0, 0, 0] += 1

    monkeypatch.setattr(flash_attn4_pieces, "_bwd_postprocess_convert", not_a_reorder)
    q = torch.randn(1, 40, 4, 8).to(torch.bfloat16)
    k = torch.randn(1, 40, 2, 8).to(torch.bfloat16)
    out, lse = FLASH4.forward(q, k, k, causal=True, scale=SCALE)
    plain = FLASH4.backward(q, q, k, k, out, lse, causal=True, scale=SCALE)
    for _ in range(2):
        got = FLASH4.backward(q, q, k, k, out, lse, causal=True, scale=SCALE, unrounded=True)
        assert [g.dtype for g in got] == [p.dtype for p in plain]
        assert all(torch.equal(g, p) for g, p in zip(got, plain, strict=True))


def _rounded_once(x: Tensor, ref: Tensor) -> bool:
    """Whether ``x`` (bf16 or fp16) is within half a unit in its last place of fp64 ``ref``,
    with slack for fp32 sums on the way (1e-6 of the largest value: cancellation in a sum of
    blocks leaves fp32's absolute error on a small result; a bf16 block gradient leaves
    hundreds of times more)."""
    eps = torch.full_like(ref, torch.finfo(x.dtype).eps)  # the unit in the last place at 1
    half_ulp = torch.ldexp(eps, torch.frexp(ref).exponent - 2)
    return bool(((x.double() - ref).abs() <= half_ulp + 1e-6 * ref.abs().max()).all())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_sums_unrounded_block_grads(flash_attn4_pieces, monkeypatch, world_size):
    """The ring through flash-attn 4's pieces: out and each gradient are the fp64 ones rounded
    once to bf16 (block outputs merged and block gradients summed in fp32); with bf16 block
    outputs or gradients they are not (W >= 2)."""
    monkeypatch.setattr(FlashAttn4Kernel, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(FlashAttn4Kernel, "unrounded_outputs", True)
    B, H, H_kv, D, S = 1, 4, 2, 8, 24 * world_size
    g = torch.Generator().manual_seed(5)
    q, dout = torch.randn(2, B, S, H, D, generator=g).to(torch.bfloat16).unbind(0)
    k, v = torch.randn(2, B, S, H_kv, D, generator=g).to(torch.bfloat16).unbind(0)
    kw = dict(layout="zigzag", world_size=world_size, backend="flash_attn4", scale=SCALE)
    try:
        clear_selection_cache()
        out, lse, *grads = simulate_ring(q, k, v, dout, **kw)
        want_out = MATH.forward(*(t.double() for t in (q, k, v)), causal=True, scale=SCALE)[0]
        assert _rounded_once(out, want_out)
        # one device's gradients, given the same (bf16) out: only the sum's rounding differs
        want = MATH.backward(
            *(t.double() for t in (dout, q, k, v, out, lse)), causal=True, scale=SCALE
        )
        assert all(_rounded_once(x, w) for x, w in zip(grads, want, strict=True))
        monkeypatch.setattr(FlashAttn4Kernel, "unrounded_outputs", False)
        monkeypatch.setattr(FlashAttn4Kernel, "unrounded_grads", False)
        out, lse, *rounded = simulate_ring(q, k, v, dout, **kw)
        want = MATH.backward(
            *(t.double() for t in (dout, q, k, v, out, lse)), causal=True, scale=SCALE
        )
        pairs = zip([out, *rounded], [want_out, *want], strict=True)
        once = [_rounded_once(x, w) for x, w in pairs]
        assert all(once) if world_size == 1 else not any(once), once
    finally:
        clear_selection_cache()


def _counting_preprocess(pieces, monkeypatch) -> list[int]:
    """The rows (dense: its sequence length; varlen: its packed tokens) of every later call of
    flash-attn 4's preprocess, as a list filled in place."""
    preprocess, calls = pieces._bwd_preprocess, []

    def counted(out, *args, **kwargs):
        calls.append(out.shape[0 if args[5] is not None else 1])  # args[5]: cu_seqlens_q
        return preprocess(out, *args, **kwargs)

    monkeypatch.setattr(pieces, "_bwd_preprocess", counted)
    return calls


def _ring_in_modes(pieces, monkeypatch, accumulator: str, tensors, kw: dict):
    """``simulate_ring(*tensors, **kw)`` through flash-attn 4's pieces, nondeterministic and
    deterministic with the kernel's ``accumulator`` method, then without it: yields
    ``(accumulator on, the preprocess calls' rows, simulate_ring's results)``."""
    calls = _counting_preprocess(pieces, monkeypatch)
    for deterministic, on in [(False, True), (True, True), (False, False)]:
        monkeypatch.setattr(
            torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d
        )
        if not on:
            monkeypatch.setattr(FlashAttn4Kernel, accumulator, lambda *a, **kw: None)
        calls.clear()
        try:
            clear_selection_cache()
            results = simulate_ring(*tensors, **kw)
        finally:
            clear_selection_cache()
        yield on, list(calls), results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "layout,num_kv_heads,window",
    [("zigzag", 2, None), ("zigzag", 4, None), ("ring", 2, None), ("zigzag", 2, (64, 0))],
)
@pytest.mark.parametrize("tokens", [128, 96])
def test_ring_dq_accumulated_by_the_kernel(
    flash_attn4_pieces, monkeypatch, world_size, layout, num_kv_heads, window, tokens
):
    """With every block's query rows on the kernel's 64-row tiles (128 tokens a rank: zigzag's
    halves of 64), flash-attn 4's kernel sums a rank's dq blocks itself, its causal and
    unmasked blocks in one tile order: one preprocess a rank, and dq (with GQA dk and dv too)
    the fp64 gradient rounded once, deterministic or not. With 96 tokens (halves of 48) zigzag
    sums per block, as does a kernel without the accumulator: one preprocess a block, the same
    precision (the ring layout's blocks take each rank's queries whole: any length). A window
    of 64 keeps zigzag's windowed blocks on the tiles at 128 tokens a rank (local blocks)."""
    monkeypatch.setattr(FlashAttn4Kernel, "device_types", ("cuda", "cpu"))
    B, H, D, S = 1, 4, 8, tokens * world_size
    g = torch.Generator().manual_seed(6)
    q, dout = torch.randn(2, B, S, H, D, generator=g).to(torch.bfloat16).unbind(0)
    k, v = torch.randn(2, B, S, num_kv_heads, D, generator=g).to(torch.bfloat16).unbind(0)
    kw = dict(layout=layout, world_size=world_size, backend="flash_attn4", scale=SCALE)
    kw["window_size"] = window or (-1, -1)
    causal, mask_window = normalize_window(kw["window_size"], True, S)
    accumulates = tokens % 128 == 0 or layout == "ring"  # ring: each rank's queries whole
    runs = _ring_in_modes(flash_attn4_pieces, monkeypatch, "dq_accumulator", (q, k, v, dout), kw)
    for accumulator, calls, (out, lse, *grads) in runs:
        want = MATH.backward(
            *(t.double() for t in (dout, q, k, v, out, lse)),
            causal=causal,
            scale=SCALE,
            window=mask_window,
        )
        once = [_rounded_once(x, w) for x, w in zip(grads, want, strict=True)]
        assert once[0] and (num_kv_heads == H or all(once)), once  # MHA: dk, dv come in bf16
        if world_size == 1 and window is None:  # one block: flash-attn 4's own backward
            assert calls == [], calls
        elif accumulator and accumulates:  # every rank's one preprocess, of all its queries
            assert calls == [tokens] * world_size, calls
        else:
            assert len(calls) > world_size, calls  # a preprocess a block


def _varlen_dq_cases():
    """(world size, layout, K/V heads, window, aligned): GQA zigzag on the tiles at W 2-3 in
    the fast tier; W 1 and 4, MHA, documents off the tiles (a rank sums per block) and the
    document layout in the whole suite."""
    window = (128, 0)
    fast = [(w, "zigzag", 1, None, True) for w in (2, 3)]
    slow = [(3, "documents", 1, window, True)]
    slow += [(w, "zigzag", 1, None, True) for w in (1, 4)]
    slow += [(w, "zigzag", 2, None, True) for w in (2, 3)]
    slow += [(w, "zigzag", 1, None, False) for w in (2, 3, 4)]
    slow += [(w, "documents", 1, None, True) for w in (2, 4)]
    slow.append((4, "documents", 1, window, True))
    return fast + [pytest.param(*case, marks=pytest.mark.slow) for case in slow]


@pytest.mark.parametrize("world_size,layout,num_kv_heads,window,aligned", _varlen_dq_cases())
def test_ring_varlen_dq_accumulated_by_the_kernel(
    flash_attn4_pieces, monkeypatch, world_size, layout, num_kv_heads, window, aligned
):
    """Packed documents: flash-attn 4's kernel sums a rank's dq blocks itself where every
    block's queries of a document start on its 64-row tiles and end on one or at the
    document's end (zigzag's halves of documents of 128 * W tokens; the document layout's
    spans): one preprocess a rank, reading the local queries in place, and dq (with GQA dk
    and dv too) the fp64 gradient rounded once, deterministic or not. With documents of other
    lengths (``aligned=False``) the ranks with such blocks run flash-attn 4's varlen backward
    a block (no preprocess of ours), as does a kernel without the accumulator. With fp32 block
    outputs, out is the fp64 result rounded once in every mode."""
    import dtensor_ring as dr

    monkeypatch.setattr(FlashAttn4Kernel, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(FlashAttn4Kernel, "varlen_dq_in_kernel", True)
    monkeypatch.setattr(FlashAttn4Kernel, "unrounded_outputs", True)
    monkeypatch.setattr(FlashAttn4Kernel, "merges_by_document", True)
    unit = 128 * world_size
    lengths = [2 * unit, unit, 3 * unit]  # the document layout cuts these on the tiles
    if layout == "zigzag":
        lengths = [unit, 2 * unit] if aligned else [unit + 24, 2 * unit - 24]
    bounds = [0, *itertools.accumulate(lengths)]
    H, D, T = 2, 8, bounds[-1]
    g = torch.Generator().manual_seed(7)
    q, dout = torch.randn(2, T, H, D, generator=g).to(torch.bfloat16).unbind(0)
    k, v = torch.randn(2, T, num_kv_heads, D, generator=g).to(torch.bfloat16).unbind(0)
    window_size = window or (-1, 0)
    whole = world_size == 1 and layout == "zigzag"  # one block: flash-attn 4's own backward
    if layout == "documents":
        layout = dr.document_layout(bounds, world_size, window_size=window_size)
        # its cut points on the tiles (Note [Balanced documents]): every rank accumulates
        assert all(
            a % 64 == 0 and (b % 64 == 0 or b == lengths[d])
            for row in layout.pieces
            for d, a, b in row
        ), layout.pieces
    kw = dict(layout=layout, world_size=world_size, backend="flash_attn4", scale=SCALE)
    kw |= dict(cu_seqlens=bounds, window_size=window_size)
    causal, mask_window = normalize_window(window_size, True, T)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(lengths)
    name = "dq_accumulator_varlen"
    want_out = MATH.forward_varlen(
        *(t.double() for t in (q, k, v)), cu, cu, longest, longest,
        causal=causal, scale=SCALE, window=mask_window,
    )[0]  # fmt: skip
    runs = _ring_in_modes(flash_attn4_pieces, monkeypatch, name, (q, k, v, dout), kw)
    for accumulator, calls, (out, lse, *grads) in runs:
        assert _rounded_once(out, want_out)
        if layout == "zigzag" and world_size > 1:  # halves of documents merged where they lie
            assert any(c.get("seqused_q") is not None for c in FA4_CALLS), "no by-document merge"
        want = MATH.backward_varlen(
            *(t.double() for t in (dout, q, k, v, out, lse)), cu, cu, longest, longest,
            causal=causal, scale=SCALE, window=mask_window,
        )  # fmt: skip
        once = [_rounded_once(x, w) for x, w in zip(grads, want, strict=True)]
        if accumulator and aligned and not whole:  # every rank's one preprocess, of all its queries
            assert calls == [T // world_size] * world_size, calls
            assert once[0] and (num_kv_heads == H or all(once)), once
        else:  # a rank whose queries are all of its documents whole may accumulate (zigzag's last)
            assert calls == [] if not accumulator or whole else len(calls) <= world_size, calls
            if layout == "zigzag" and world_size > 1:  # rank 0's halves are off the tiles
                assert len(calls) < world_size, calls
            errors = [(x.double() - w).abs().max() for x, w in zip(grads, want, strict=True)]
            assert max(errors) < 0.05, errors


@pytest.mark.slow  # the fast tier's time: a capture path of one backend
def test_ring_varlen_dq_accumulator_under_graph_capture(flash_attn4_pieces, monkeypatch):
    """The per-block rows a varlen accumulator reads are built (copied to the device) at a
    rank's first backward; while a CUDA graph is captured before that, the rank sums per block
    (no preprocess of ours), and after a warm-up call outside the capture it accumulates."""
    from dtensor_ring.engine import varlen_blocks as engine_blocks

    monkeypatch.setattr(FlashAttn4Kernel, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(FlashAttn4Kernel, "varlen_dq_in_kernel", True)
    monkeypatch.setattr(engine_blocks, "_BLOCKS_CACHE", {})  # no rows built by other tests
    bounds, W = [0, 256, 768], 2
    q = torch.randn(768, 2, 8).to(torch.bfloat16)
    kv = torch.randn(768, 1, 8).to(torch.bfloat16)
    calls = _counting_preprocess(flash_attn4_pieces, monkeypatch)
    kw = dict(layout="zigzag", world_size=W, backend="flash_attn4", cu_seqlens=bounds)
    try:
        clear_selection_cache()
        monkeypatch.setattr(engine_blocks, "capturing", lambda device: True)
        simulate_ring(q, kv, kv, q, **kw)
        assert calls == [], calls
        monkeypatch.setattr(engine_blocks, "capturing", lambda device: False)
        simulate_ring(q, kv, kv, q, **kw)  # the warm-up
        monkeypatch.setattr(engine_blocks, "capturing", lambda device: True)
        calls.clear()
        simulate_ring(q, kv, kv, q, **kw)
        assert calls == [768 // W] * W, calls
    finally:
        clear_selection_cache()


@pytest.mark.slow  # the fast tier's time
def test_varlen_rows_built_only_for_a_kernel_that_reads_queries_in_place(
    flash_attn4_pieces, monkeypatch
):
    """The per-block rows of the local queries by document (host work, copies to the device)
    are built only for a kernel that reads them in place: flash-attn 4 where it sums a rank's
    dq or merges zigzag's blocks of half of every document where their rows lie (Note [Varlen
    blocks merged where their rows lie]), not with both switches off, never for the math
    kernel."""
    from dtensor_ring.engine import varlen_blocks as engine_blocks

    monkeypatch.setattr(FlashAttn4Kernel, "device_types", ("cuda", "cpu"))
    bounds, q = [0, 256, 768], torch.randn(768, 2, 8).to(torch.bfloat16)
    cases = [("math", True, True), ("flash_attn4", False, False)]
    cases += [("flash_attn4", True, False), ("flash_attn4", False, True)]
    for backend, on, by_document in cases:
        monkeypatch.setattr(FlashAttn4Kernel, "varlen_dq_in_kernel", on)
        monkeypatch.setattr(FlashAttn4Kernel, "merges_by_document", by_document)
        monkeypatch.setattr(engine_blocks, "_BLOCKS_CACHE", {})
        kw = dict(layout="zigzag", world_size=2, backend=backend, cu_seqlens=bounds)
        try:
            clear_selection_cache()
            simulate_ring(q, q[:, :1], q[:, :1], q, **kw)
        finally:
            clear_selection_cache()
        built = [bool(b._query_rows) for _, b in engine_blocks._BLOCKS_CACHE.values()]
        want = backend == "flash_attn4" and (on or by_document)
        assert built and built == [want] * len(built), (backend, on, by_document, built)


def test_small_calls_prefer_a_kernel_of_little_host_time(flash_attn4, monkeypatch):
    """The automatic choice passes over flash-attn 4 for small calls (its host time sets their
    pace: kernels/base.py SMALL_BLOCK_WORK) when cuDNN can run them; large calls, what cuDNN
    cannot run (varlen) and an explicit backend= keep flash-attn 4. The threshold follows the
    work S^2 * H * D: the same tokens with more heads are a large call."""
    from dtensor_ring.kernels.base import SMALL_BLOCK_WORK, is_small

    monkeypatch.setattr(CudnnKernel, "is_available", lambda self: None)
    monkeypatch.setattr(CudnnKernel, "extra_reason", lambda self, call: None)
    small = KernelCall("cuda", torch.bfloat16, 128, 32, 8, small=True)
    assert select_kernel(small).name == "cudnn"
    assert select_kernel(KernelCall("cuda", torch.bfloat16, 128, 32, 8)).name == "flash_attn4"
    assert select_kernel(small, "flash_attn4").name == "flash_attn4"
    varlen = KernelCall("cuda", torch.bfloat16, 128, 32, 8, varlen=True, small=True)
    assert select_kernel(varlen).name == "flash_attn4"
    # the measured crossover (H = 32, D = 128): 2048 tokens small, 4096 not
    assert is_small(2048, 32, 128) and not is_small(4096, 32, 128)
    assert not is_small(2048, 32 * 4, 128) and 3072**2 * 32 * 128 == SMALL_BLOCK_WORK
    q_small, q_large = (torch.empty(1, s, 32, 128, device="meta") for s in (2048, 4096))
    assert KernelCall.of(q_small, q_small).small and not KernelCall.of(q_large, q_large).small


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_cpu_kernel_finds_every_non_finite_value(dtype):
    """The CPU kernel's check (which sends blocks holding NaN / Inf to the strict kernel) finds
    one NaN or infinity anywhere in any of its inputs, through views, and passes finite ones."""
    from dtensor_ring.kernels.cpu import _all_finite

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 33, 3, 8, generator=gen).to(dtype) for _ in range(3)]
    assert _all_finite(*xs) and _all_finite(xs[0].transpose(1, 2)) and _all_finite()
    assert _all_finite(torch.empty(0, dtype=dtype), xs[1])
    for value in (float("nan"), float("inf"), -float("inf")):
        for which, index in ((0, (0, 0, 0, 0)), (2, (1, 32, 2, 7)), (1, (1, 17, 0, 3))):
            poisoned = [x.clone() for x in xs]
            poisoned[which][index] = value
            assert not _all_finite(*poisoned), (value, which, index)
            assert not _all_finite(*(x.transpose(1, 2) for x in poisoned))
