"""Drop-in functional API with ring-flash-attention's names and arguments.

Layout of every tensor (flash-attn convention), per rank:
    q ``[B, S_local, H, D]``, k/v ``[B, S_local, H_kv, D]`` (``H % H_kv == 0``: GQA/MQA),
    kv (kv-packed) ``[B, S_local, 2, H_kv, D]``, qkv (qkv-packed) ``[B, S_local, 3, H, D]``.
    Returns ``out [B, S_local, H, D]``; with ``return_attn_probs=True``,
    ``(out, lse, None)`` where ``lse [B, H, S_local]`` is the natural-log log-sum-exp (fp32, or
    fp64 for fp64 inputs), without gradient.

Which tokens a rank holds depends on the function's layout (Note [Sequence layouts] in
``layouts/base.py``): ``ring_*`` contiguous, ``zigzag_ring_*`` zigzag, ``stripe_*`` stripe;
shard with :func:`dtensor_ring.shard_local`.

Arguments common to every function here:
    dropout_p: must be 0.0.  alibi_slopes: must be None.
    softmax_scale: defaults to ``D ** -0.5``.
    causal: causal mask over the *global* sequence (zigzag and stripe: must be True).
    window_size: ``(left, right)``: query at global position p sees keys in
        ``[p - left, p + right]`` (-1: unbounded; ``causal`` sets ``right = 0``), as flash-attn
        (Note [Windowed schedules]; docs/window.md).
    deterministic: require a block kernel with a deterministic backward.
    return_attn_probs: also return ``lse [B, H, S_local]`` (as ``(out, lse, None)``).
    group: the context-parallel process group (default: the default group).
    backend (keyword only): block-kernel backend name, or None for the fastest able one.
    sinks (keyword only): per-head attention-sink logits ``[H]`` (gpt-oss ``s_aux``), or None:
        each row's softmax denominator gets ``exp(sinks[h])`` (Note [Attention sinks]); its
        gradient on each rank is that rank's rows' share (sum over the group: the whole
        sequence's).

Every argument is checked on every rank before any communication (Note [Call resolution]):
bad input raises ``ValueError`` naming it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..algorithm import Algorithm
from ..resolve import unpack
from .attend import dense_attention

Result = Tensor | tuple[Tensor, Tensor, None]  # out, or (out, lse, None)


def ring_attention_func(
    layout: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    sinks: Tensor | None = None,
    algorithm: Algorithm | None = None,
) -> Result:
    """Context-parallel attention of tokens placed by any registered dense ``layout`` (the
    functions below fix it): ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` ->
    ``out [B, S_local, H, D]``. ``algorithm`` moves K/V (Note [Layouts and algorithms]):
    "ring" (the default), "all_gather" (``heads_k_stride=1``), "ulysses" (needs
    ``H % W == 0``) or "auto" (zigzag's tokens; whichever the cost model predicts fastest:
    Note [Choosing ring, all-gather or Ulysses]); None: the layout alias's ("llama3_zigzag":
    all_gather, "auto": auto), else "ring"."""
    out, lse = dense_attention(
        q,
        k,
        v,
        layout=layout,
        algorithm=algorithm,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dropout_p=dropout_p,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        group=group,
        backend=backend,
        sinks=sinks,
        return_lse=return_attn_probs,
    )
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, ring layout (contiguous shards).

    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    return ring_attention_func(
        "ring",
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
        backend=backend,
        sinks=sinks,
    )


def ring_flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, ring layout (contiguous shards).

    ``q [B, S_local, H, D]``, ``kv [B, S_local, 2, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    k, v = unpack("kv", kv, 2, group)
    return ring_attention_func(
        "ring",
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
        backend=backend,
        sinks=sinks,
    )


def ring_flash_attn_qkvpacked_func(
    qkv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, ring layout (contiguous shards).

    ``qkv [B, S_local, 3, H, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    q, k, v = unpack("qkv", qkv, 3, group)
    return ring_attention_func(
        "ring",
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
        backend=backend,
        sinks=sinks,
    )


def zigzag_ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, zigzag layout; causal only.

    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    return ring_attention_func(
        "zigzag",
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
        backend=backend,
        sinks=sinks,
    )


def zigzag_ring_flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, zigzag layout; causal only.

    ``q [B, S_local, H, D]``, ``kv [B, S_local, 2, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    k, v = unpack("kv", kv, 2, group)
    return ring_attention_func(
        "zigzag",
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
        backend=backend,
        sinks=sinks,
    )


def zigzag_ring_flash_attn_qkvpacked_func(
    qkv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, zigzag layout; causal only.

    ``qkv [B, S_local, 3, H, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    q, k, v = unpack("qkv", qkv, 3, group)
    return ring_attention_func(
        "zigzag",
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
        backend=backend,
        sinks=sinks,
    )


def stripe_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, stripe layout; causal only.

    ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    return ring_attention_func(
        "stripe",
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
        backend=backend,
        sinks=sinks,
    )


def stripe_flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, stripe layout; causal only.

    ``q [B, S_local, H, D]``, ``kv [B, S_local, 2, H_kv, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    k, v = unpack("kv", kv, 2, group)
    return ring_attention_func(
        "stripe",
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
        backend=backend,
        sinks=sinks,
    )


def stripe_flash_attn_qkvpacked_func(
    qkv: Tensor,
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
    sinks: Tensor | None = None,
) -> Result:
    """Ring attention, stripe layout; causal only.

    ``qkv [B, S_local, 3, H, D]`` -> ``out [B, S_local, H, D]``
    (other arguments: module docstring).
    """
    q, k, v = unpack("qkv", qkv, 3, group)
    return ring_attention_func(
        "stripe",
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
        backend=backend,
        sinks=sinks,
    )
