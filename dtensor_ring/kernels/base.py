"""The block-kernel interface: one attention block, forward and backward.

Shape legend (used throughout the package):
    B: batch, S: sequence (local block), H: query heads, H_kv: key/value heads, D: head dim,
    T: packed tokens (varlen).

Every backend computes exact softmax attention of one block of queries against one block of
keys/values, ``causal`` meaning the square top-left-aligned causal mask (the engine only asks
for causal blocks with ``S_q == S_k``). Contract:

* ``forward(q_BSHD, k_BSHD, v_BSHD)`` -> ``(out_BSHD, lse_BHS)``: ``out`` in the input dtype,
  ``lse`` the natural-log log-sum-exp of the scaled scores in the accumulation dtype
  (fp32, or fp64 for fp64 inputs).
* ``backward(dout, q, k, v, out, lse)`` -> ``(dq, dk, dv)`` in the input dtype, with ``out`` and
  ``lse`` the *global* (fully merged) values of these query rows: the block gradients of ring
  attention are then exact (see Note [Ring backward] in ``engine/ring.py``).
* ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA, ``H % H_kv == 0``); ``dk``/``dv`` have
  ``H_kv`` heads.
* Inputs may be non-contiguous views (e.g. halves of a buffer); outputs are fresh tensors.
* ``window=(left, right)`` (dense blocks, ``supports_window`` backends, never with ``causal``):
  flash-attn's sliding window, aligned bottom-right: key ``j`` is visible to query ``i`` iff
  ``-left <= j - i - (S_k - S_q) <= right``, -1 unbounded. The engine trims its blocks so that
  no row or column is fully masked (Note [Windowed schedules] in ``schedule/plan.py``), and
  then both sides are < ``S_k`` (a test enumerates the plans): flash kernels treat a side
  >= ``S_k`` as unbounded, which is wrong when ``S_q > S_k`` (measured:
  ``tests/gpu/check_window.py``).
  :func:`window_mask` is the mask as a tensor.

Varlen kernels (``supports_varlen``) take packed ``[T, H, D]`` tensors with int32
``cu_seqlens`` and return ``lse_HT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that lse, merges and gradient sums use for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KernelCall:
    """What a backend must support for one attention call (used for backend selection)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    varlen: bool = False
    deterministic: bool = False
    window: bool = False

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        *,
        varlen: bool = False,
        deterministic: bool = False,
        window: bool = False,
    ) -> KernelCall:
        """Describe a call from ``q`` and ``k`` (``[..., H, D]`` layouts)."""
        return cls(
            q.device.type,
            q.dtype,
            q.shape[-1],
            q.shape[-2],
            k.shape[-2],
            varlen,
            deterministic,
            window,
        )


class BlockKernel:
    """Base class of the block-kernel backends; subclasses declare what they support.

    Capability attributes are checked by :meth:`unsupported_reason`; a backend with further
    limits overrides :meth:`extra_reason`.
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    dtypes: ClassVar[tuple[torch.dtype, ...]]
    max_head_dim: ClassVar[int] = 256
    supports_gqa: ClassVar[bool] = True
    supports_varlen: ClassVar[bool] = False
    supports_window: ClassVar[bool] = False
    deterministic_backward: ClassVar[bool] = True

    def is_available(self) -> str | None:
        """``None`` when the backend can run in this process, else why not."""
        return None

    def extra_reason(self, call: KernelCall) -> str | None:
        """Backend-specific limits beyond the declared capabilities."""
        return None

    def unsupported_reason(self, call: KernelCall) -> str | None:
        """``None`` when this backend can compute ``call``, else a short reason."""
        reason = self.is_available()
        if reason is not None:
            return reason
        if call.device_type not in self.device_types:
            return f"device {call.device_type!r} not in {self.device_types}"
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} not in {[str(d) for d in self.dtypes]}"
        if call.head_dim > self.max_head_dim:
            return f"head dim {call.head_dim} > {self.max_head_dim}"
        if call.num_heads != call.num_kv_heads and not self.supports_gqa:
            return "GQA/MQA (H != H_kv) not supported"
        if call.varlen and not self.supports_varlen:
            return "varlen (cu_seqlens) not supported"
        if call.window and not self.supports_window:
            return "sliding windows (window_size) not supported"
        if call.deterministic and not self.deterministic_backward:
            return "deterministic=True not supported (its backward is not deterministic)"
        return self.extra_reason(call)

    # --- dense blocks, [B, S, H, D] -------------------------------------------------------
    def forward(
        self,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(out_BSHD, lse_BHS)`` of one block."""
        raise NotImplementedError

    def backward(
        self,
        dout_BSHD: Tensor,
        q_BSHD: Tensor,
        k_BSHD: Tensor,
        v_BSHD: Tensor,
        out_BSHD: Tensor,
        lse_BHS: Tensor,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq_BSHD, dk_BSHD, dv_BSHD)`` of one block, given the global out/lse."""
        raise NotImplementedError

    # --- varlen blocks, [T, H, D] with cu_seqlens ----------------------------------------
    def forward_varlen(
        self,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(out_THD, lse_HT)``; documents are attended to independently (``window``
        per document, bottom-right aligned as for dense blocks)."""
        raise NotImplementedError

    def backward_varlen(
        self,
        dout_THD: Tensor,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out_THD: Tensor,
        lse_HT: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq_THD, dk_THD, dv_THD)`` given the global out/lse."""
        raise NotImplementedError


def window_mask(s_q: int, s_k: int, window: tuple[int, int], device: torch.device) -> Tensor:
    """``[S_q, S_k]`` bool mask (True = visible) of a bottom-right aligned ``window``."""
    d = (
        torch.arange(s_k, device=device)[None, :]
        - torch.arange(s_q, device=device)[:, None]
        - (s_k - s_q)
    )
    return in_window(d, window)


def in_window(d: Tensor, window: tuple[int, int]) -> Tensor:
    """Where ``-left <= d <= right`` (-1: that side unbounded), ``d`` being the key's offset
    from the query's bottom-right aligned diagonal, ``j - i - (S_k - S_q)``."""
    left, right = window
    visible = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    if left >= 0:
        visible &= d >= -left
    if right >= 0:
        visible &= d <= right
    return visible
