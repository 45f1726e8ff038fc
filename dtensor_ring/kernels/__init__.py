"""Block-kernel backends and their selection.

``BACKENDS`` is the priority list (fastest first). :func:`select_kernel` returns the first
backend that supports a call (for a small call, that backend's substitute for small calls if
one can run it: ``BlockKernel.small_calls_to``, ``base.SMALL_BLOCK_WORK``), or the one named
by ``backend=``; when none fits it raises one error that lists every backend and why it was
rejected.
"""

from __future__ import annotations

import torch

from .base import (
    BlockKernel,
    BlockKVGrads,
    DqAccumulator,
    HeldKVGrads,
    KernelCall,
    accumulation_dtype,
)
from .cpu import CpuFlashKernel
from .cuda_flash import TorchFlashKernel
from .cudnn import CudnnKernel
from .flash_attn4 import FlashAttn4Kernel
from .flash_attn_pkg import FlashAttnKernel
from .flex import FlexKernel, FlexMathKernel
from .flex_triton import FlexTritonKernel
from .math import MathKernel

# flash_attn4 first where installed (an optional extra): on an H200 (2026-12-03, torch 2.11,
# cuDNN 9.19, flash-attn-4 4.0.0b36; bf16, H=32, H_kv=8, D=128) one forward + one backward block
# took 21.1 ms against cuDNN's 22.6 over the ring's 12 block shapes (2048-8192 tokens, square
# causal and not, zigzag halves): 8.5% less at 4096 tokens, 6.8% at 8192, 1.3% more at 2048,
# where its forward was host-bound (0.11-0.13 ms a call through its wrapper; forward alone
# 0.46 vs 0.37 ms); benchmarks/results/check_flash_attn4_h200_2026-12-03.json. Its forward is
# now replayed (29-37 us of host time a call, Note [flash-attn 4's forward, replayed]); a whole
# eager ring rank still pays host time at every step, and below base.SMALL_BLOCK_WORK (about
# 3072 tokens a rank at H * D = 4096) cuDNN ran as fast or faster: small calls go to it.
# cuDNN next: 570-680 TFLOP/s forward against ~350 for FlashAttention-2 (docs/performance.md);
# flash_attn then serves what cuDNN cannot (varlen, windows, fp16 with head dim beyond cuDNN's
# limits) ahead of PyTorch's vendored copy of the same kernels.
BACKENDS: tuple[BlockKernel, ...] = (
    FlashAttn4Kernel(),
    CudnnKernel(),
    FlashAttnKernel(),
    TorchFlashKernel(),
    CpuFlashKernel(),
    MathKernel(),
)
BACKEND_NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)


def get_kernel(name: str) -> BlockKernel:
    """The backend called ``name``; raises ``ValueError`` listing the valid names."""
    for b in BACKENDS:
        if b.name == name:
            return b
    raise ValueError(f"backend={name!r} is not a known backend; choose one of {BACKEND_NAMES}")


# Choices made so far: (call, backend=, torch's deterministic switches) -> kernel. What else
# decides them (installed packages, the GPU's architecture, the PyTorch and cuDNN builds) does
# not change while a process runs, and asking the backends costs ~40 us of host time per call
# (device properties, module lookups). The flash backends' deterministic backward follows
# torch.use_deterministic_algorithms, which may change at any time: part of the key.
_SELECTED: dict[tuple, BlockKernel] = {}
_SELECTION_VERSION = [0]  # moves with every clear_selection_cache


def select_kernel(call: KernelCall, backend: str | None = None) -> BlockKernel:
    """Pick the backend for ``call``: ``backend`` if given (and able), else the fastest able one
    (for a small call, one whose host time does not set the pace, where one can run it).

    The choice is remembered per ``(call, backend)`` for the process; after installing or
    removing a backend package at run time, call :func:`clear_selection_cache`.

    Raises:
        ValueError: if the named backend cannot run ``call``, or no backend can; the message
            lists each backend considered and why it was rejected (never remembered).
    """
    key = (
        call,
        backend,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    kernel = _SELECTED.get(key)
    if kernel is None:
        kernel = _SELECTED[key] = _select_kernel(call, backend)
    return kernel


@torch.compiler.assume_constant_result
def selected_backend(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    varlen: bool,
    deterministic: bool,
    window: bool,
    small: bool,
    backend: str | None,
) -> str:
    """The name :func:`select_kernel` picks for the :class:`KernelCall` of these fields; a
    Dynamo constant (the backends' availability probes are not traceable)."""
    call = KernelCall(
        device_type, dtype, head_dim, num_heads, num_kv_heads, varlen, deterministic, window, small
    )
    return select_kernel(call, backend).name


def clear_selection_cache() -> None:
    """Forget the backend choices :func:`select_kernel` remembered (and the resolutions that
    hold them: Note [Remembered resolutions] in ``dtensor_ring/resolved.py``)."""
    _SELECTED.clear()
    _SELECTION_VERSION[0] += 1


def selection_version() -> int:
    """A number that changes with every :func:`clear_selection_cache`."""
    return _SELECTION_VERSION[0]


def _select_kernel(call: KernelCall, backend: str | None) -> BlockKernel:
    candidates = BACKENDS if backend is None else (get_kernel(backend),)
    reasons = []
    able = []
    for b in candidates:
        reason = b.unsupported_reason(call)
        if reason is None:
            able.append(b)
        else:
            reasons.append(f"  {b.name}: {reason}")
    if able:  # a small call goes to the first kernel's substitute for small calls, if able
        names = able[0].small_calls_to if call.small and backend is None else ()
        return next((b for name in names for b in able if b.name == name), able[0])
    what = "no attention backend" if backend is None else f"backend={backend!r}"
    raise ValueError(
        f"{what} supports this call ({call}):\n"
        + "\n".join(reasons)
        + "\nPass a supported dtype/device/head dim, or another backend= "
        f"(one of {BACKEND_NAMES})."
    )


__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "BlockKernel",
    "BlockKVGrads",
    "DqAccumulator",
    "HeldKVGrads",
    "KernelCall",
    "accumulation_dtype",
    "clear_selection_cache",
    "get_kernel",
    "select_kernel",
    "selected_backend",
]


# FlexAttention blocks (Note [FlexAttention on the ring]): PyTorch's Triton kernels where they
# run (CUDA), else the math kernel.
FLEX_KERNELS: tuple[FlexKernel, ...] = (FlexTritonKernel(), FlexMathKernel())
FLEX_KERNEL_NAMES: tuple[str, ...] = tuple(k.name for k in FLEX_KERNELS)


def select_flex_kernel(
    device: torch.device, dtype: torch.dtype, backend: str | None = None
) -> FlexKernel:
    """The flex block kernel for ``device`` and ``dtype``: ``backend`` (a name of
    ``FLEX_KERNEL_NAMES``) if given and able, else the first able one; ``ValueError`` naming
    why otherwise."""
    if backend is not None and backend not in FLEX_KERNEL_NAMES:
        raise ValueError(
            f"backend={backend!r} is no flex kernel; choose one of {FLEX_KERNEL_NAMES}"
        )
    reasons = []
    for kernel in FLEX_KERNELS:
        if backend not in (None, kernel.name):
            continue
        reason = kernel.unavailable(device, dtype)
        if reason is None:
            return kernel
        reasons.append(f"{kernel.name}: {reason}")
    raise ValueError(f"no flex kernel can run this call: {'; '.join(reasons)}")
