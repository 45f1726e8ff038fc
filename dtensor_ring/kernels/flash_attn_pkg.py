"""The optional ``flash-attn`` package (FlashAttention-2), through its private block functions.

``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_backward`` and their ``_varlen_``
forms take our layouts as they are (``[B, S, H, D]``, or ``[T, H, D]`` with int32 cu_seqlens),
handle GQA natively and return lse fp32 ``[B, H, S]`` (dense) or ``[H, T]`` (varlen, unpadded
since 2.6.0). The module is imported lazily, inside the methods: importing ``dtensor_ring``
never imports ``flash_attn``.

Targets flash-attn 2.6.x, 2.7.x and 2.8.x. Written against the signatures in the released
sources (``flash_attn/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp`` of the
PyPI sdists 2.6.0.post1, 2.6.3, 2.7.4.post1, 2.8.3) and tested on CPU against stand-ins with
exactly those signatures (``tests/test_kernel_adapters.py``). Not run on a GPU here: there
is no flash-attn wheel for our torch builds.

The signatures changed at 2.7; we tell the generations apart by the function's parameters,
never by version strings:

===================  ===========================================  =============================
                     2.6.x                                        2.7.x, 2.8.x
===================  ===========================================  =============================
window               ``window_size=(left, right)``                ``window_size_left/right=``
forward returns      ``out, q, k, v, out_padded, lse, S, rng``    ``out_padded, lse, S, rng``
backward             writes given ``dq/dk/dv`` (else allocates),  custom op: writes the given
                     returns ``dq, dk, dv, softmax_d``            ``dq/dk/dv``, returns
                                                                  ``softmax_d`` only
varlen forward       2.6.0: ``block_table`` has no default        all options have defaults
===================  ===========================================  =============================

Since 2.7 the four functions are ``torch.library.custom_op`` objects whose ``inspect``
signature is ``(*args, **kwargs)``; the decorated function is read from their ``_init_fn``.
We always pass preallocated ``dq/dk/dv``, so the backward works the same in both generations,
and ``deterministic=torch.are_deterministic_algorithms_enabled()``, the switch ``cuda_flash``
obeys too.

Head dim must be a multiple of 8 (2.6 would pad it, 2.7+ refuses). The window is rewritten by
the same host code as ``cuda_flash``'s (Note [FlashAttention-2's unbounded window sides] in
``cuda_flash.py``): both adapters keep the interface's window through ``Flash2Kernel``.
``causal`` is aligned bottom-right when ``S_q != S_k``, as in ``cuda_flash``; the engine only
sends square causal blocks.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import KernelCall
from .cuda_flash import Flash2Kernel, deterministic_reason, head_dim_reason

_INTERFACE = "flash_attn.flash_attn_interface"


def _interface() -> ModuleType:
    """``flash_attn.flash_attn_interface`` (imported on first use)."""
    return importlib.import_module(_INTERFACE)


@functools.cache
def _installed() -> bool:
    """Whether a ``flash_attn`` package is installed (looked up once: it costs ~0.1 ms)."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _import_failure() -> str | None:
    """Why importing the installed flash-attn fails, or ``None``; cached so it is tried once."""
    try:
        _interface()
    except Exception as e:  # a build for another torch/CUDA fails with ImportError, OSError, ...
        return f"flash-attn is installed but `import {_INTERFACE}` fails: {e!r}"
    return None


@functools.cache
def _param_names(fn: Callable[..., Any]) -> frozenset[str]:
    """Parameter names of ``fn``, looking through a ``torch.library.custom_op`` wrapper."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _is_2_6(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has the flash-attn 2.6 signature (``window_size`` as one tuple)."""
    return "window_size" in _param_names(fn)


def _options(
    fn: Callable[..., Any], *, causal: bool, scale: float, window: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Keyword arguments for the options of ``fn`` (no dropout, softcap or alibi)."""
    left, right = (-1, -1) if window is None else window
    if _is_2_6(fn):
        window_args: dict[str, Any] = {"window_size": (left, right)}
    else:
        window_args = {"window_size_left": left, "window_size_right": right}
    return dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        **window_args,
    )


def _out_and_lse(fn: Callable[..., Any], result: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` from what forward ``fn`` returned (see the table in the module doc)."""
    return result[0], result[5 if _is_2_6(fn) else 1]


def _grad_buffers(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh contiguous ``dq, dk, dv`` for the backward to write into."""
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


class FlashAttnKernel(Flash2Kernel):
    """FlashAttention-2 from the ``flash-attn`` package (dense and varlen, GQA native)."""

    name: ClassVar[str] = "flash_attn"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    max_head_dim: ClassVar[int] = 256
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True

    def is_available(self) -> str | None:
        fa = sys.modules.get(_INTERFACE)
        if fa is None:
            if not _installed():
                return "the flash-attn package is not installed (pip install 'flash-attn>=2.6')"
            reason = _import_failure()
            if reason is not None:
                return reason
            fa = _interface()
        if "softcap" not in _param_names(fa._flash_attn_forward):
            return "flash-attn older than 2.6 (no softcap argument); pip install 'flash-attn>=2.6'"
        return None

    def extra_reason(self, call: KernelCall) -> str | None:
        return head_dim_reason(call) or deterministic_reason(call)

    def _op_forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window):
        fn = _interface()._flash_attn_forward
        result = fn(
            q_BSHD,
            k_BSHD,
            v_BSHD,
            return_softmax=False,
            **_options(fn, causal=causal, scale=scale, window=window),
        )
        return _out_and_lse(fn, result)

    def _op_backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window
    ):
        fn = _interface()._flash_attn_backward
        dq, dk, dv = _grad_buffers(q_BSHD, k_BSHD, v_BSHD)
        fn(
            dout_BSHD,
            q_BSHD,
            k_BSHD,
            v_BSHD,
            out_BSHD,
            softmax_lse=lse_BHS.contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            **_options(fn, causal=causal, scale=scale, window=window),
        )
        return dq, dk, dv

    def _op_forward_varlen(
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
    ):
        fn = _interface()._flash_attn_varlen_forward
        result = fn(
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            return_softmax=False,
            block_table=None,
            **_options(fn, causal=causal, scale=scale, window=window),
        )
        return _out_and_lse(fn, result)

    def _op_backward_varlen(
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
        fn = _interface()._flash_attn_varlen_backward
        dq, dk, dv = _grad_buffers(q_THD, k_THD, v_THD)
        fn(
            dout_THD,
            q_THD,
            k_THD,
            v_THD,
            out_THD,
            softmax_lse=lse_HT.contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            **_options(fn, causal=causal, scale=scale, window=window),
        )
        return dq, dk, dv
