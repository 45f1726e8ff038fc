"""Drop-in functional API with ring-flash-attention's names and arguments.

Layout of every tensor (flash-attn convention), per rank:
    q ``[B, S_local, H, D]``, k/v ``[B, S_local, H_kv, D]`` (``H % H_kv == 0``: GQA/MQA),
    kv (kv-packed) ``[B, S_local, 2, H_kv, D]``, qkv (qkv-packed) ``[B, S_local, 3, H, D]``.
    Returns ``out [B, S_local, H, D]``; with ``return_attn_probs=True``,
    ``(out, lse, None)`` where ``lse [B, H, S_local]`` is the natural-log log-sum-exp (fp32, or
    fp64 for fp64 inputs), without gradient.

Which tokens a rank holds depends on the function's layout (Note [Sequence layouts] in
``layouts.py``): ``ring_*`` contiguous, ``zigzag_ring_*`` zigzag, ``stripe_*`` stripe; shard with
:func:`dtensor_ring.shard_local`. ``window_size=(left, right)`` is flash-attn's sliding window over
*global* positions (Note [Windowed schedules]; docs/window.md). Non-default ``dropout_p`` and
``alibi_slopes`` raise ``ValueError``; ``deterministic=True`` restricts the choice of block kernel
to those with a deterministic backward. ``backend`` (keyword only) names a block kernel; None
picks the fastest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from ._compat import group_name, select_backend_name
from .ops import ring_attention
from .validation import check_qkv, check_unsupported, normalize_window


def _attention(
    layout: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    check_qkv(q, k, v, layout=layout, causal=causal)
    name = group_name(group)
    seq_len = q.shape[1] * dist.get_world_size(group)
    _, window = normalize_window(window_size, causal, seq_len)
    # Resolve the kernel here too, so that an unsupported call fails before any communication.
    backend = select_backend_name(
        q, k, backend, deterministic=deterministic, window=window is not None
    )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = ring_attention(q, k, v, name, layout, causal, scale, backend, *window_size)
    return (out, lse, None) if return_attn_probs else out


_DOC = """Ring attention ({layout} layout; see Note [Sequence layouts]).

Args:
    {tensors}
    dropout_p: must be 0.0.  softmax_scale: defaults to ``D ** -0.5``.
    causal: causal mask over the *global* sequence{causal_note}.
    window_size: ``(left, right)``: query at global position p sees keys in
        ``[p - left, p + right]`` (-1: unbounded; ``causal`` sets ``right = 0``), as flash-attn.
    alibi_slopes: must be None.
    deterministic: require a block kernel with a deterministic backward.
    return_attn_probs: also return ``lse [B, H, S_local]`` (as ``(out, lse, None)``).
    group: the context-parallel process group (default: the default group).
    backend: block-kernel backend name, or None for automatic choice.

Returns:
    ``out [B, S_local, H, D]`` (or ``(out, lse, None)``).
"""
_TENSORS = {  # function-name suffix -> its tensor arguments
    "func": "q: ``[B, S_local, H, D]``; k, v: ``[B, S_local, H_kv, D]``.",
    "kvpacked_func": "q: ``[B, S_local, H, D]``; kv: ``[B, S_local, 2, H_kv, D]``.",
    "qkvpacked_func": "qkv: ``[B, S_local, 3, H, D]``.",
}


def _make_api(prefix: str, layout: str) -> tuple[Callable, Callable, Callable]:
    """Build ``{prefix}_func``, ``_kvpacked_func`` and ``_qkvpacked_func`` for ``layout``."""

    def func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        group=None,
        *,
        backend=None,
    ):
        return _attention(
            layout,
            q,
            k,
            v,
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
        q,
        kv,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        group=None,
        *,
        backend=None,
    ):
        _check_packed("kv", kv, 2)
        return _attention(
            layout,
            q,
            kv[:, :, 0],
            kv[:, :, 1],
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
        qkv,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        group=None,
        *,
        backend=None,
    ):
        _check_packed("qkv", qkv, 3)
        return _attention(
            layout,
            qkv[:, :, 0],
            qkv[:, :, 1],
            qkv[:, :, 2],
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

    causal_note = "" if layout == "ring" else "; must be True for this layout"
    fns = (func, kvpacked_func, qkvpacked_func)
    for fn, kind in zip(fns, _TENSORS, strict=True):
        fn.__name__ = fn.__qualname__ = f"{prefix}_{kind}"
        fn.__module__ = __name__
        fn.__doc__ = _DOC.format(layout=layout, tensors=_TENSORS[kind], causal_note=causal_note)
    return fns


def _check_packed(name: str, t: Tensor, n: int) -> None:
    if t.dim() != 5 or t.shape[2] != n:
        raise ValueError(
            f"{name} must be [B, S_local, {n}, H, D] (packed), got shape {tuple(t.shape)}"
        )


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = _make_api(
    "ring_flash_attn", "ring"
)
(
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
) = _make_api("zigzag_ring_flash_attn", "zigzag")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = (
    _make_api("stripe_flash_attn", "stripe")
)
