"""Input checks shared by every front door; each runs before any communication.

Every rank runs the same checks on its own local inputs, so bad input raises the same
``ValueError`` on every rank instead of hanging a collective. (Inputs that differ *between*
ranks cannot be seen without communicating; SPMD code gives every rank the same shapes.)
"""

from __future__ import annotations

from torch import Tensor

from .layouts import check_layout


def check_unsupported(
    *, dropout_p: float, window_size: tuple[int, int], alibi_slopes: object
) -> None:
    """Reject flash-attn arguments whose non-default values are not implemented yet."""
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p} is not supported by ring attention; pass dropout_p=0.0 "
            "(apply dropout outside attention if you need it)"
        )
    if tuple(window_size) != (-1, -1):
        raise ValueError(
            f"window_size={tuple(window_size)} is not supported yet; pass window_size=(-1, -1)"
        )
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention; pass alibi_slopes=None")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, layout: str, causal: bool) -> None:
    """Check local ``q [B, S, H, D]``, ``k``/``v [B, S, H_kv, D]`` for ``layout``.

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    check_layout(layout)
    if layout != "ring" and not causal:
        raise ValueError(
            f"layout={layout!r} is for causal attention only; pass causal=True, or use the ring "
            "layout (ring_flash_attn_func) for non-causal attention"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [B, S_local, H, D], got shape {tuple(t.shape)}"
            )
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dim must be >= 1")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (B, S, H, D), (B_kv, S_kv, H_kv, D_kv) = q.shape, k.shape
    if (B, S, D) != (B_kv, S_kv, D_kv):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, local sequence "
            "length and head dim ([B, S_local, H, D] vs [B, S_local, H_kv, D])"
        )
    if H % H_kv != 0:
        raise ValueError(
            f"number of query heads H={H} must be a multiple of key/value heads H_kv={H_kv}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(
            f"zigzag needs an even local sequence length (two chunks per rank), got S_local={S}; "
            "pad the global sequence to a multiple of 2 * world_size"
        )
