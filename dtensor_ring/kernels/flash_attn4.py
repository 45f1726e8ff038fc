"""flash-attn 4: the flash-attn project's CuTe-DSL kernels (PyPI ``flash-attn-4``).

We call the block functions of ``flash_attn.cute.interface``, ``_flash_attn_fwd`` and
``_flash_attn_bwd``, dense and varlen (``cu_seqlens_q/k``). The module is imported lazily, inside
the methods: importing ``dtensor_ring`` never imports ``flash_attn.cute`` (nor the CUTLASS DSL it
pulls in). Written against the released source of ``flash-attn-4==4.0.0b36`` and tested on CPU
against a stand-in with exactly its signatures (``tests/test_kernel_adapters.py``); checked on
an H200 on 2026-12-03 by ``tests/gpu/check_flash_attn4.py`` (dense, windowed and varlen blocks,
GQA 32:8, deterministic backward, the ring through it: as accurate as cuDNN / ``cuda_flash``
against fp64; docs/backends.md has the numbers).

What the source says (``flash_attn/cute/interface.py``):

* ``_flash_attn_fwd(q, k, v, ..., softmax_scale, causal, window_size_left/right, ...,
  return_lse)`` returns ``(out, lse, p, row_max, o_lo)``; with ``return_lse=True``, ``lse`` is
  the natural-log log-sum-exp, fp32 ``[B, H, S]`` dense and ``[H, T]`` varlen: our layouts.
* ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, ..., deterministic)``
  (note: ``out`` before ``dout``) returns fresh ``(dq, dk, dv)``; it recomputes
  ``rowsum(dout * out)`` from the ``out`` it is given, so the global ``out``/``lse`` give exact
  ring gradients. Its ``deterministic=True`` orders the dQ/dK/dV accumulation (semaphores); we
  pass ``torch.are_deterministic_algorithms_enabled()``, the switch the other flash backends
  obey.
* Both functions fix the layouts of their inputs themselves (``maybe_contiguous``: a unit last
  stride and 16-byte aligned strides; other strides are passed on), lse included.
* fp16/bf16 only (fp8 forward only, SM100); GQA native (``H % H_kv == 0``; the backward sums
  dK/dV over each group); head dim a multiple of 8, 8..256 on sm90, 8..128 or exactly 256 on
  sm100/sm110. The backward runs on sm90, sm100/sm110 and sm120 only (not sm80); sm120 has no
  deterministic backward, so we take sm90 and sm100/sm110.
* ``causal`` and the window are aligned bottom-right (``S_k - S_q`` offset, per document for
  varlen), as the interface's ``window``. A window side is ``None`` when unbounded: an integer,
  also a negative one, is taken as a bound (-1 would hide the diagonal), so we map -1 to
  ``None``. ``(None, 0)`` is the causal mask.
* In a ring's backward (``unrounded=True``) on sm90, the block gradients come in fp32 where
  flash-attn 4 has them so (dq; dk and dv with GQA): Note [Unrounded block gradients from
  flash-attn 4] in ``flash_attn4_grads.py``; and its kernel sums a ring's dq blocks itself
  where their query rows start on its tiles (:meth:`FlashAttn4Kernel.dq_accumulator`, Note [dq
  accumulated inside flash-attn 4]).
* The forward is launched without ``_flash_attn_fwd``'s host-side configuration where a call of
  the same signature went through it before (Note [flash-attn 4's forward, replayed] in
  ``flash_attn4_launch.py``): ~0.1 ms of host time a block.
* The first call of each configuration (dtype, head dim, GQA ratio, mask kind, varlen, ...)
  JIT-compiles its kernel (seconds); later calls reuse it, whatever the sequence lengths.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any, ClassVar

import torch

from . import flash_attn4_launch as launch
from .base import BlockKernel, KernelCall
from .cuda_flash import deterministic_reason, head_dim_reason
from .flash_attn4_grads import unrounded_backward, unrounded_reason
from .flash_attn4_ring_dq import RingDq, RingDqVarlen

_INTERFACE = "flash_attn.cute.interface"
_NOT_INSTALLED = "the flash-attn-4 package is not installed (pip install flash-attn-4)"
_ARCHS = {9: "sm90 (Hopper)", 10: "sm100 (Blackwell)", 11: "sm110 (Blackwell)"}


def _interface() -> ModuleType:
    """``flash_attn.cute.interface`` (imported on first use)."""
    return importlib.import_module(_INTERFACE)


@functools.cache
def _installed() -> bool:
    """Whether ``flash_attn.cute`` can be found (looked up once, without importing it)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no ``flash_attn`` package at all
        return False


@functools.cache
def _import_failure() -> str | None:
    """Why importing the installed flash-attn 4 fails, or ``None``; cached so it is tried once."""
    try:
        _interface()
    except Exception as e:  # a CUTLASS DSL for another CUDA fails with ImportError, OSError, ...
        return f"flash-attn-4 is installed but `import {_INTERFACE}` fails: {e!r}"
    return None


def _capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or ``None`` without CUDA."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def arch_reason() -> str | None:
    """``None`` if the current device is one flash-attn 4 runs both directions on (sm90,
    sm100, sm110), else why not."""
    capability = _capability()
    if capability is None:
        return "CUDA is not available"
    major, minor = capability
    if major not in _ARCHS:
        return (
            f"flash-attn 4 runs forward and backward on {', '.join(_ARCHS.values())} GPUs; "
            f"the current device is sm{major}{minor}"
        )
    return None


def _window_args(window: tuple[int, int] | None) -> dict[str, int | None]:
    """FA4's window keywords: ``None``, not -1, for an unbounded side."""
    left, right = (-1, -1) if window is None else window
    return {
        "window_size_left": None if left < 0 else left,
        "window_size_right": None if right < 0 else right,
    }


def _options(*, causal: bool, scale: float, window: tuple[int, int] | None) -> dict[str, Any]:
    """Keyword arguments shared by the forward and backward functions."""
    return dict(softmax_scale=scale, causal=causal, **_window_args(window))


def _forward_options(interface: ModuleType, unrounded: bool, **mask) -> dict[str, Any]:
    """``launch.forward``'s keywords: :func:`_options` of ``mask`` and ``fp32_out`` where
    ``unrounded`` asks for it and this flash-attn 4 on this device has it (Note [fp32 block
    outputs from flash-attn 4] in ``flash_attn4_launch.py``)."""
    fp32_out = unrounded and unrounded_reason(interface) is None
    return dict(_options(**mask), fp32_out=fp32_out)


class FlashAttn4Kernel(BlockKernel):
    """flash-attn 4 (CuTe DSL) from the ``flash-attn-4`` package (dense and varlen, GQA native)."""

    name: ClassVar[str] = "flash_attn4"
    small_calls_to: ClassVar[tuple[str, ...]] = ("cudnn",)  # its wrappers' host time: base.py
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    max_head_dim: ClassVar[int] = 256  # 128 or exactly 256 on sm100/sm110, see extra_reason
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True
    unrounded_grads: ClassVar[bool] = True  # dense, sm90 (Note [Unrounded block gradients ...])
    # Note [A varlen dq accumulated inside flash-attn 4] (exact on an H100; docs/performance.md)
    varlen_dq_in_kernel: ClassVar[bool] = True
    # Note [fp32 block outputs from flash-attn 4] (flash_attn4_launch.py; sm90, the checked
    # release): exact on an H100, a ring rank's forward no slower (docs/backends.md)
    unrounded_outputs: ClassVar[bool] = True
    # Note [Merging in flash-attn 4's epilogue] (flash_attn4_launch.py; sm90, the checked release)
    merges_outputs: ClassVar[bool] = True
    # Note [Varlen blocks merged where their rows lie] (engine/varlen_blocks.py): exact on an
    # H100 (tests/gpu/check_flash_attn4.py, part merge), faster on zigzag and the document
    # layout (docs/backends.md)
    merges_by_document: ClassVar[bool] = True

    def is_available(self) -> str | None:
        if _INTERFACE not in sys.modules:
            if not _installed():
                return _NOT_INSTALLED
            reason = arch_reason()  # before the import: it loads the CUTLASS DSL (seconds)
            if reason is not None:
                return reason
            return _import_failure()
        return arch_reason()

    def extra_reason(self, call: KernelCall) -> str | None:
        reason = head_dim_reason(call) or deterministic_reason(call)
        if reason is not None:
            return reason
        major, minor = _capability()  # not None: is_available() passed
        if major != 9 and 128 < call.head_dim < 256:
            return f"head dim {call.head_dim}: flash-attn 4 takes <= 128 or 256 on sm{major}{minor}"
        return None

    def _forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window, unrounded=False):
        interface = _interface()
        options = _forward_options(interface, unrounded, causal=causal, scale=scale, window=window)
        return launch.forward(interface, q_BSHD, k_BSHD, v_BSHD, **options)

    def _merge_forward(self, q_BSHD, k_BSHD, v_BSHD, out_acc, lse_acc, *, causal, scale, window):
        no_documents = (None,) * 4  # cu_seqlens and max_seqlen: a dense block
        return self._merge_forward_varlen(
            q_BSHD, k_BSHD, v_BSHD, *no_documents, out_acc, lse_acc,
            causal=causal, scale=scale, window=window,
        )  # fmt: skip

    def _merge_forward_varlen(
        self, q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, out_acc, lse_acc, *,
        causal, scale, window, seqused_q=None,
    ):  # fmt: skip
        interface = _interface()
        if unrounded_reason(interface) is not None:
            return False
        options = _options(causal=causal, scale=scale, window=window)
        return launch.merge_forward(
            interface, q_THD, k_THD, v_THD, out_acc, lse_acc, cu_q, cu_k, max_q, max_k,
            seqused_q=seqused_q, **options,
        )  # fmt: skip

    def _backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        dq, dk, dv = _interface()._flash_attn_bwd(
            q_BSHD,
            k_BSHD,
            v_BSHD,
            out_BSHD,
            dout_BSHD,
            lse_BHS,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            **_options(causal=causal, scale=scale, window=window),
        )
        return dq, dk, dv

    def _backward_unrounded(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        interface = _interface()
        tensors = (dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS)
        grads = None
        if unrounded_reason(interface) is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
            grads = unrounded_backward(
                interface,
                *tensors,
                scale=scale,
                causal=causal,
                deterministic=deterministic,
                **_window_args(window),
            )
        if grads is None:  # see unrounded_reason and unrounded_backward
            grads = self._backward(*tensors, causal=causal, scale=scale, window=window)
        return grads

    def dq_accumulator(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, blocks, *, scale
    ) -> RingDq | None:
        tensors = (dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS)
        interface = self._accumulating_interface(tensors, scale)
        if interface is None:
            return None
        return RingDq.of(
            interface,
            *tensors,
            blocks,
            scale=scale,
            window_args=_window_args,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )

    def sums_varlen_dq(self) -> bool:
        return self.varlen_dq_in_kernel and self.unrounded_grads

    def dq_accumulator_varlen(
        self,
        dout_THD,
        q_THD,
        k_THD,
        v_THD,
        out_THD,
        lse_HT,
        cu_seqlens,
        max_seqlen,
        rows,
        *,
        scale,
        cache,
    ) -> RingDqVarlen | None:
        tensors = (dout_THD, q_THD, k_THD, v_THD, out_THD, lse_HT)
        interface = self._accumulating_interface(tensors, scale)
        if interface is None or not self.sums_varlen_dq():
            return None
        return RingDqVarlen.of(
            interface,
            *tensors,
            cu_seqlens,
            max_seqlen,
            rows,
            scale=scale,
            cache=cache,
            window_args=_window_args,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )

    def _accumulating_interface(self, tensors, scale: float) -> ModuleType | None:
        """flash-attn 4's interface where its kernel can sum a ring's dq (fp32 block gradients
        on, a positive scale, unit last strides: Note [Kernel inputs]), else ``None``."""
        if not self.unrounded_grads or not scale > 0 or any(t.stride(-1) != 1 for t in tensors):
            return None
        interface = _interface()
        return interface if unrounded_reason(interface) is None else None

    def _forward_varlen(
        self,
        q_THD,
        k_THD,
        v_THD,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal,
        scale,
        window,
        unrounded=False,
    ):
        interface = _interface()
        return launch.forward(
            interface,
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            **_forward_options(interface, unrounded, causal=causal, scale=scale, window=window),
        )

    def _backward_varlen(
        self,
        dout_THD,
        q_THD,
        k_THD,
        v_THD,
        out_THD,
        lse_HT,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal,
        scale,
        window,
    ):
        dq, dk, dv = _interface()._flash_attn_bwd(
            q_THD,
            k_THD,
            v_THD,
            out_THD,
            dout_THD,
            lse_HT,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            **_options(causal=causal, scale=scale, window=window),
        )
        return dq, dk, dv
