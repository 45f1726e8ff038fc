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

import importlib.machinery
import inspect
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import Tensor

from dtensor_ring.kernels import BACKEND_NAMES, KernelCall, select_kernel
from dtensor_ring.kernels import flash_attn4 as flash_attn4_module
from dtensor_ring.kernels.cuda_flash import TorchFlashKernel
from dtensor_ring.kernels.cudnn import CudnnKernel
from dtensor_ring.kernels.flash_attn4 import FlashAttn4Kernel
from dtensor_ring.kernels.flash_attn_pkg import FlashAttnKernel
from dtensor_ring.kernels.math import MathKernel

MATH = MathKernel()
FLASH = FlashAttnKernel()
FLASH4 = FlashAttn4Kernel()
SCALE = 0.3


# --- what the stand-ins compute, in flash-attn's layouts --------------------------------------
def _maybe_contiguous(x: Tensor | None) -> Tensor | None:
    """flash-attn's own fix-up of its inputs."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _check_options(dropout_p, softcap, alibi_slopes, window: tuple[int, int]) -> None:
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    assert tuple(window) == (-1, -1), window


def _check_lse(lse: Tensor, shape: tuple[int, ...]) -> None:
    # The CUDA code reads lse through its data pointer with implicit contiguous strides.
    assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == shape


def _dense_forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes):
    """``(out [B, S, H, D], lse fp32 [B, H, S])``."""
    _check_options(dropout_p, softcap, alibi_slopes, window)
    # flash-attn aligns causal bottom-right; the math kernel top-left: equal for square blocks.
    assert not causal or q.shape[1] == k.shape[1]
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    return MATH.forward(q, k, v, causal=causal, scale=softmax_scale)


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
    """``(out [T, H, D], lse fp32 [H, T])``."""
    _check_options(dropout_p, softcap, alibi_slopes, window)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int)
    assert not causal or torch.equal(cu_q, cu_k)
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    return MATH.forward_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=softmax_scale
    )


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
    """``(dq, dk, dv, softmax_d)``."""
    _check_options(dropout_p, softcap, alibi_slopes, window)
    B, S, H, _ = q.shape
    _check_lse(lse, (B, H, S))
    dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    grads = MATH.backward(dout, q, k, v, out, lse, causal=causal, scale=softmax_scale)
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
    """``(dq, dk, dv, softmax_d)``."""
    _check_options(dropout_p, softcap, alibi_slopes, window)
    T, H, _ = q.shape
    _check_lse(lse, (H, T))
    dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    grads = MATH.backward_varlen(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, scale=softmax_scale
    )
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
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


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
    """``(out, lse, p, row_max, o_lo)``; lse fp32 ``[B, H, S]`` or ``[H, T]`` if return_lse."""
    args = dict(locals())
    FA4_CALLS.append(args)
    used = {"q", "k", "v", "softmax_scale", "causal", "window_size_left", "window_size_right"}
    used |= {"return_lse", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    _fa4_unused_at_defaults(fa4_flash_attn_fwd, args, used)
    q, k, v = (_fa4_maybe_contiguous(x) for x in (q, k, v))
    _fa4_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    window = _fa4_window(causal, window_size_left, window_size_right)
    kw = dict(causal=False, scale=softmax_scale, window=window)
    o, lse_ = _fa4_math("forward", cu_seqlens_q, cu_seqlens_k, q, k, v, **kw)
    return o.to(q.dtype), lse_.float() if return_lse else None, None, None, None


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
    packages["flash_attn"].cute = packages["flash_attn.cute"]
    packages["flash_attn.cute"].interface = interface
    for name, module in (*packages.items(), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flash_attn4_module, "_capability", lambda: (9, 0))
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
