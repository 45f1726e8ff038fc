"""Varlen functional API with ring-flash-attention's names and arguments.

Layout of every tensor (flash-attn varlen convention), per rank:
    q ``[T_local, H, D]``, k/v ``[T_local, H_kv, D]`` (``H % H_kv == 0``: GQA/MQA),
    kv (kv-packed) ``[T_local, 2, H_kv, D]``, qkv (qkv-packed) ``[T_local, 3, H, D]``;
    ``cu_seqlens`` int32 ``[N + 1]`` local document boundaries.
    Returns ``out [T_local, H, D]``; with ``return_attn_probs=True``, ``(out, lse, None)``
    where ``lse [H, T_local]`` is the natural-log log-sum-exp (fp32, or fp64 for fp64 inputs),
    without gradient.

Which tokens a rank holds (Note [Varlen layouts] in ``varlen.py``; shard with
:func:`dtensor_ring.shard_varlen`):

* ``ring_flash_attn_varlen_*``: every document cut into W pieces, piece r on rank r;
  ``cu_seqlens`` = global ``cu_seqlens // W``. Causal or not.
* ``zigzag_ring_flash_attn_varlen_*``: every document cut into 2W pieces, pieces r and 2W-1-r
  on rank r; ``cu_seqlens`` = global ``cu_seqlens // W``. Causal only.
* ``llama3_flash_attn_varlen_*``: the packed stream cut into W contiguous slices; the metadata
  comes from :func:`dtensor_ring.llama3_flash_attn_prepare_cu_seqlens`.

Non-default ``dropout_p`` and ``alibi_slopes`` raise ``ValueError``; ``window_size`` is a sliding
window within each document (docs/window.md);
``deterministic=True`` restricts the block kernel to those with a deterministic backward;
``backend`` (keyword only) names a block kernel that supports varlen (on CPU: "math").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ._compat import group_name
from .kernels import KernelCall, select_kernel
from .llama3 import check_heads_k_stride, check_llama3_call
from .ops_varlen import llama3_attention, ring_attention_varlen
from .validation import (
    check_layout_causal,
    check_qkv_tensors,
    check_unsupported,
    normalize_window,
)
from .varlen import check_varlen_qkv


@torch.compiler.assume_constant_result
def _select_varlen_backend(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    deterministic: bool,
    backend: str | None,
    window: bool = False,
) -> str:
    call = KernelCall(
        device_type,
        dtype,
        head_dim,
        num_heads,
        num_kv_heads,
        varlen=True,
        deterministic=deterministic,
        window=window,
    )
    return select_kernel(call, backend).name


def _backend_name(
    q: Tensor, k: Tensor, backend: str | None, deterministic: bool, window: bool = False
) -> str:
    """The varlen block kernel's name; a constant under torch.compile (as the dense API's
    ``_compat.select_backend_name``: backend availability probes are not traceable)."""
    return _select_varlen_backend(
        q.device.type,
        q.dtype,
        int(q.shape[-1]),
        int(q.shape[-2]),
        int(k.shape[-2]),
        bool(deterministic),
        backend,
        bool(window),
    )


Result = Tensor | tuple[Tensor, Tensor, None]  # out, or (out, lse, None)


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _max_seqlen(value, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value)  # a device tensor is read here (a sync): pass an int
    raise ValueError(f"{name} must be an int or None, got {value!r}")


def _ring_varlen(
    layout: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    alibi_slopes: Tensor | None,
    deterministic: bool,
    return_attn_probs: bool,
    group: dist.ProcessGroup | None,
    backend: str | None,
):
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    name = group_name(group)
    _, window = normalize_window(window_size, causal, q.shape[0] * dist.get_world_size(group))
    max_seqlen = _max_seqlen(max_seqlen, "max_seqlen")
    if torch.compiler.is_compiling():  # the op checks the cu_seqlens values when it runs
        check_layout_causal(layout, causal, ring_func="ring_flash_attn_varlen_func")
        check_qkv_tensors(q, k, v, seq_dims="T_local")
    else:
        check_varlen_qkv(
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen,
            layout=layout,
            causal=causal,
            world_size=dist.get_world_size(group),
        )
    # Resolve the kernel here too, so that an unsupported call fails before any communication.
    backend = _backend_name(q, k, backend, deterministic, window=window is not None)
    out, lse = ring_attention_varlen(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        name,
        layout,
        causal,
        _scale(q, softmax_scale),
        backend,
        *window_size,
    )
    return (out, lse, None) if return_attn_probs else out


def _check_packed(name: str, t: Tensor, n: int) -> None:
    heads = "H" if n == 3 else "H_kv"
    if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[1] != n:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [T_local, {n}, {heads}, D] (packed), got {shape}")


_DOC = """{what}.

Args:
    {tensors}
    {meta}
    dropout_p: must be 0.0.  softmax_scale: defaults to ``D ** -0.5``.
    causal: causal mask within each document{causal_note}.
    window_size: {window_note}  alibi_slopes: must be None.
    deterministic: require a block kernel with a deterministic backward.
    return_attn_probs: also return ``lse [H, T_local]`` (as ``(out, lse, None)``).
    group: the context-parallel process group (default: the default group).
    backend: block-kernel backend name (must support varlen), or None for automatic choice.

Returns:
    ``out [T_local, H, D]`` (or ``(out, lse, None)``).

Raises:
    ValueError: on every rank, before any communication, for bad shapes/dtypes, bad
        ``cu_seqlens``{raises}, or an unsupported option (see docs/varlen.md).
"""
_TENSORS = {  # function-name suffix -> its tensor arguments
    "func": "q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]``.",
    "kvpacked_func": "q: ``[T_local, H, D]``; kv: ``[T_local, 2, H_kv, D]``.",
    "qkvpacked_func": "qkv: ``[T_local, 3, H, D]``.",
}
_RING_META = (
    "cu_seqlens: int32 ``[N + 1]`` *local* document boundaries (global ``cu_seqlens // W``), "
    "on the CPU or q's device.\n"
    "    max_seqlen: longest local document (an upper bound is fine), or None."
)


def _name(fns: tuple[Callable, ...], prefix: str, doc: dict[str, str]) -> None:
    for fn, kind in zip(fns, _TENSORS, strict=True):
        fn.__name__ = fn.__qualname__ = f"{prefix}_{kind}"
        fn.__module__ = __name__
        fn.__doc__ = _DOC.format(tensors=_TENSORS[kind], **doc)


def _make_varlen_api(prefix: str, layout: str) -> tuple[Callable, Callable, Callable]:
    """Build ring/zigzag ``{prefix}_func``, ``_kvpacked_func`` and ``_qkvpacked_func``."""

    def func(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int | None,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        return _ring_varlen(
            layout,
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    def kvpacked_func(
        q: Tensor,
        kv: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int | None,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        _check_packed("kv", kv, 2)
        return _ring_varlen(
            layout,
            q,
            kv[:, 0],
            kv[:, 1],
            cu_seqlens,
            max_seqlen,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    def qkvpacked_func(
        qkv: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int | None,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        _check_packed("qkv", qkv, 3)
        return _ring_varlen(
            layout,
            qkv[:, 0],
            qkv[:, 1],
            qkv[:, 2],
            cu_seqlens,
            max_seqlen,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    fns = (func, kvpacked_func, qkvpacked_func)
    pieces = "W" if layout == "ring" else "2W"
    _name(
        fns,
        prefix,
        dict(
            what=f"Ring attention over packed documents ({layout} varlen layout: every document "
            f"cut into {pieces} pieces; see Note [Varlen layouts])",
            meta=_RING_META,
            causal_note="" if layout == "ring" else "; must be True for this layout",
            window_note="flash-attn sliding window ``(left, right)`` within each document, over\n"
            "        its global positions (Note [Windowed varlen]).",
            raises="" if layout == "ring" else ", a local document of odd length",
        ),
    )
    return fns


def _llama3(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    heads_k_stride,
    local_k_slice,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    group,
    backend,
):
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    name = group_name(group)
    world_size = dist.get_world_size(group)
    causal, window = normalize_window(window_size, causal, q.shape[0] * world_size)
    if (
        not isinstance(local_k_slice, slice)
        or local_k_slice.step not in (None, 1)
        or not (isinstance(local_k_slice.start, int) and isinstance(local_k_slice.stop, int))
    ):
        raise ValueError(
            f"local_k_slice must be a slice(start, stop) of ints, as returned by "
            f"llama3_flash_attn_prepare_cu_seqlens, got {local_k_slice!r}"
        )
    max_q, max_k = (
        _max_seqlen(max_seqlen_q, "max_seqlen_q"),
        _max_seqlen(max_seqlen_k, "max_seqlen_k"),
    )
    k_start, k_stop = local_k_slice.start, local_k_slice.stop
    if torch.compiler.is_compiling():  # the op checks the cu_seqlens values when it runs
        check_qkv_tensors(q, k, v, seq_dims="T_local")
        check_heads_k_stride(heads_k_stride, k.shape[1])
    else:
        check_llama3_call(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_q,
            max_k,
            heads_k_stride,
            k_start,
            k_stop,
            causal=causal,
            rank=dist.get_rank(group),
            world_size=world_size,
            window=window,
        )
    backend = _backend_name(q, k, backend, deterministic, window=window is not None)
    out, lse = llama3_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_q,
        max_k,
        heads_k_stride,
        k_start,
        k_stop,
        name,
        causal,
        _scale(q, softmax_scale),
        backend,
        *window_size,
    )
    return (out, lse, None) if return_attn_probs else out


_LLAMA3_META = (
    "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice: this rank's "
    "metadata from ``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, W)`` "
    "(int32 tensors, ints, a slice).\n"
    "    heads_k_stride: KV heads all-gathered at a time (must divide H_kv); smaller saves "
    "memory, larger means fewer collectives."
)


def _make_llama3_api() -> tuple[Callable, Callable, Callable]:
    """Build ``llama3_flash_attn_varlen_func`` and its packed forms."""

    def func(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        heads_k_stride: int,
        local_k_slice: slice,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        return _llama3(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            heads_k_stride,
            local_k_slice,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    def kvpacked_func(
        q: Tensor,
        kv: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        heads_k_stride: int,
        local_k_slice: slice,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        _check_packed("kv", kv, 2)
        return _llama3(
            q,
            kv[:, 0],
            kv[:, 1],
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            heads_k_stride,
            local_k_slice,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    def qkvpacked_func(
        qkv: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        heads_k_stride: int,
        local_k_slice: slice,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
    ) -> Result:
        _check_packed("qkv", qkv, 3)
        return _llama3(
            qkv[:, 0],
            qkv[:, 1],
            qkv[:, 2],
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            heads_k_stride,
            local_k_slice,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            backend,
        )

    fns = (func, kvpacked_func, qkvpacked_func)
    _name(
        fns,
        "llama3_flash_attn_varlen",
        dict(
            what="All-gather (llama3) attention over packed documents: the packed stream cut "
            "into W contiguous slices, K/V all-gathered per group of heads_k_stride KV heads (Note "
            "[llama3 all-gather attention])",
            meta=_LLAMA3_META,
            causal_note="",
            window_note="flash-attn sliding window ``(left, right)`` within each document, over\n"
            "        its global positions.",
            raises=", metadata not from llama3_flash_attn_prepare_cu_seqlens (causal), a "
            "heads_k_stride that does not divide H_kv",
        ),
    )
    return fns


(
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
) = _make_varlen_api("ring_flash_attn_varlen", "ring")
(
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
) = _make_varlen_api("zigzag_ring_flash_attn_varlen", "zigzag")
(
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
) = _make_llama3_api()
