"""``backend="autotune"``: per block shape, the backend measured fastest on it.

Note [Autotuned blocks]
~~~~~~~~~~~~~~~~~~~~~~~
The fixed priority of ``BACKENDS`` is right for long blocks, where the kernels' GPU time
decides; on short blocks a backend's host time per call can exceed its kernel (flash-attn 4:
~0.12 ms a call, more than its 2048-token forward block), and another backend is faster. With
``backend="autotune"`` every block call looks up its shape:

    key = (dense | varlen, q / k shapes (varlen: max_seqlen_q/k, documents), dtype, device,
           causal, window)
    first time: for every able candidate, a forward + backward on the block's own tensors,
                once to warm up (JIT, plans), then timed three times back to back, host and
                GPU together (wall time after a synchronize): the fastest is remembered
    later:      the remembered backend's forward / backward

Forward and backward of a block use the same backend (one key). Mixing backends between
blocks is exact: every backward takes the global ``out`` and ``lse`` (Note [Ring backward]).
While a CUDA graph is being captured nothing can be timed: the first able candidate runs, and
nothing is remembered. ``deterministic=True`` is not supported (the candidates differ).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from .base import BlockKernel, KernelCall


class AutotuneKernel(BlockKernel):
    """The fastest of ``candidates`` per block shape, measured on first use (Note
    [Autotuned blocks]); capabilities are the candidates' and ``fallback``'s union.
    ``fallback`` (the math kernel) runs the blocks no candidate supports, unmeasured."""

    name: ClassVar[str] = "autotune"
    deterministic_backward: ClassVar[bool] = False
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True

    def __init__(self, candidates: Sequence[BlockKernel], fallback: BlockKernel | None = None):
        self.candidates = tuple(candidates)
        every = (*self.candidates, *([fallback] if fallback is not None else []))
        self.fallback = fallback
        self.device_types = tuple({t for c in every for t in c.device_types})
        self.dtypes = tuple({d for c in every for d in c.dtypes})
        self.max_head_dim = max(c.max_head_dim for c in every)
        self.chosen: dict[tuple, BlockKernel] = {}

    def extra_reason(self, call: KernelCall) -> str | None:
        return None if self._able(call) else "no candidate backend supports it"

    def clear(self) -> None:
        """Forget the measured choices."""
        self.chosen.clear()

    def _able(self, call: KernelCall) -> list[BlockKernel]:
        able = [c for c in self.candidates if c.unsupported_reason(call) is None]
        if not able and self.fallback is not None and not self.fallback.unsupported_reason(call):
            able = [self.fallback]
        return able

    def _pick(self, key: tuple, call: KernelCall, run) -> BlockKernel:
        """The remembered backend of ``key``, else the fastest of ``run(kernel)`` (a forward
        + backward) over the able candidates."""
        kernel = self.chosen.get(key)
        if kernel is not None:
            return kernel
        able = self._able(call)
        if not able:
            raise ValueError(f"backend='autotune': no candidate supports this block ({call})")
        if len(able) == 1:  # nothing to choose
            self.chosen[key] = able[0]
            return able[0]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return able[0]  # nothing can be timed now
        timings = {}
        for kernel in able:
            run(kernel)  # warm-up: JIT compiles, execution plans, allocations
            _sync(call.device_type)
            t0 = time.perf_counter()
            for _ in range(3):
                run(kernel)
            _sync(call.device_type)
            timings[kernel.name] = time.perf_counter() - t0
        best = min(able, key=lambda k: timings[k.name])
        self.chosen[key] = best
        return best

    # --- dense blocks ---------------------------------------------------------------------
    def _dense(self, q: Tensor, k: Tensor, causal: bool, window) -> BlockKernel:
        key = ("dense", tuple(q.shape), tuple(k.shape), q.dtype, q.device, causal, window)
        call = KernelCall.of(q, k, window=window is not None)

        def run(kernel: BlockKernel) -> None:
            out, lse = kernel.forward(q, k, k, causal=causal, scale=1.0, window=window)
            kernel.backward(out, q, k, k, out, lse, causal=causal, scale=1.0, window=window)

        return self._pick(key, call, run)

    def forward(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, window=None):
        kernel = self._dense(q_BSHD, k_BSHD, causal, window)
        return kernel.forward(q_BSHD, k_BSHD, v_BSHD, causal=causal, scale=scale, window=window)

    def backward(
        self, dout_BSHD, q_BSHD, k_BSHD, v_BSHD, out_BSHD, lse_BHS, *, causal, scale, window=None
    ):
        kernel = self._dense(q_BSHD, k_BSHD, causal, window)
        return kernel.backward(
            dout_BSHD,
            q_BSHD,
            k_BSHD,
            v_BSHD,
            out_BSHD,
            lse_BHS,
            causal=causal,
            scale=scale,
            window=window,
        )

    # --- varlen blocks --------------------------------------------------------------------
    def _varlen(self, q, k, cu_q, cu_k, max_q, max_k, causal, window) -> BlockKernel:
        key = (
            "varlen",
            tuple(q.shape),
            tuple(k.shape),
            max_q,
            max_k,
            cu_q.numel(),
            q.dtype,
            q.device,
            causal,
            window,
        )
        call = KernelCall.of(q, k, varlen=True, window=window is not None)

        def run(kernel: BlockKernel) -> None:
            args = (cu_q, cu_k, max_q, max_k)
            out, lse = kernel.forward_varlen(
                q, k, k, *args, causal=causal, scale=1.0, window=window
            )
            kernel.backward_varlen(
                out, q, k, k, out, lse, *args, causal=causal, scale=1.0, window=window
            )

        return self._pick(key, call, run)

    def forward_varlen(
        self, q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, *, causal, scale, window=None
    ):
        kernel = self._varlen(q_THD, k_THD, cu_q, cu_k, max_q, max_k, causal, window)
        return kernel.forward_varlen(
            q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window
        )

    def backward_varlen(
        self,
        dout_THD,
        q_THD,
        k_THD,
        v_THD,
        out_THD,
        lse_HT,
        cu_q,
        cu_k,
        max_q,
        max_k,
        *,
        causal,
        scale,
        window=None,
    ):
        kernel = self._varlen(q_THD, k_THD, cu_q, cu_k, max_q, max_k, causal, window)
        return kernel.backward_varlen(
            dout_THD,
            q_THD,
            k_THD,
            v_THD,
            out_THD,
            lse_HT,
            cu_q,
            cu_k,
            max_q,
            max_k,
            causal=causal,
            scale=scale,
            window=window,
        )


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()
