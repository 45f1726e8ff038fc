"""Input checks shared by every front door; each runs before any communication.

Every rank runs the same checks on its own local inputs, so bad input raises the same
``ValueError`` on every rank instead of hanging a collective. (Inputs that differ *between*
ranks cannot be seen without communicating; SPMD code gives every rank the same shapes.)
"""

from __future__ import annotations

from torch import Tensor

from .layouts import check_layout


def check_unsupported(*, dropout_p: float, alibi_slopes: object) -> None:
    """Reject flash-attn arguments whose non-default values are not implemented."""
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p} is not supported by ring attention; pass dropout_p=0.0 "
            "(apply dropout outside attention if you need it)"
        )
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention; pass alibi_slopes=None")


def check_window_size(window_size: object) -> tuple[int, int]:
    """``window_size`` as a tuple of two ints >= -1 (flash-attn's ``(left, right)``)."""
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        raise ValueError(
            f"window_size={window_size!r} must be two ints (left, right), each >= 0, or -1 for "
            "unbounded (flash-attn semantics: query i sees keys [i - left, i + right])"
        )
    return int(window_size[0]), int(window_size[1])


def normalize_window(
    window_size: tuple[int, int], causal: bool, seq_len: int
) -> tuple[bool, tuple[int, int] | None]:
    """``(causal, window)`` for flash-attn style ``window_size`` on a ``seq_len``-token sequence.

    As flash-attn: ``causal`` sets ``right = 0``; a side >= ``seq_len - 1`` is unbounded (-1);
    ``(-1, 0)`` is plain causal attention. ``window`` is None when nothing is masked beyond
    ``causal``. Raises ``ValueError`` (:func:`check_window_size`) on a malformed window.
    """
    left, right = (-1 if w >= seq_len - 1 else w for w in check_window_size(window_size))
    if causal:
        right = 0
    if left == -1 and right == 0:
        return True, None
    if left == -1 and right == -1:
        return causal, None
    return causal, (left, right)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, layout: str, causal: bool) -> None:
    """Check local ``q [B, S, H, D]``, ``k``/``v [B, S, H_kv, D]`` for ``layout``.

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    check_layout_causal(layout, causal)
    check_qkv_tensors(q, k, v)
    S = q.shape[1]
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(
            f"zigzag needs an even local sequence length (two chunks per rank), got S_local={S}; "
            "pad the global sequence to a multiple of 2 * world_size"
        )


def check_layout_causal(
    layout: str, causal: bool, *, ring_func: str = "ring_flash_attn_func"
) -> None:
    """Check that ``layout`` is known and, unless it is "ring", that ``causal`` is True.

    ``ring_func`` is the function the message suggests for non-causal attention.
    """
    check_layout(layout)
    if layout != "ring" and not causal:
        raise ValueError(
            f"layout={layout!r} is for causal attention only; pass causal=True, or use the ring "
            f"layout ({ring_func}) for non-causal attention"
        )


_SEQ_DIMS_WORDS = {"B, S_local": "batch, local sequence length", "T_local": "packed length"}


def check_qkv_tensors(q: Tensor, k: Tensor, v: Tensor, *, seq_dims: str = "B, S_local") -> None:
    """Shape/dtype/device checks of ``q [*seq_dims, H, D]``, ``k``/``v [*seq_dims, H_kv, D]``.

    Args:
        seq_dims: the leading (token) dims: ``"B, S_local"`` for the dense API (4-D tensors),
            ``"T_local"`` for packed varlen tensors (3-D).

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    ndim = len(seq_dims.split(",")) + 2
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            raise ValueError(
                f"{name} must be {ndim}-D [{seq_dims}, H, D], got shape {tuple(t.shape)}"
            )
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dim must be >= 1")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (*lead_q, H, D), (*lead_kv, H_kv, D_kv) = q.shape, k.shape
    if (*lead_q, D) != (*lead_kv, D_kv):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on "
            f"{_SEQ_DIMS_WORDS.get(seq_dims, seq_dims)} and head dim "
            f"([{seq_dims}, H, D] vs [{seq_dims}, H_kv, D])"
        )
    if H % H_kv != 0:
        raise ValueError(
            f"number of query heads H={H} must be a multiple of key/value heads H_kv={H_kv}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
