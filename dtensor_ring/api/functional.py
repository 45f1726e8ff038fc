"""The dense front door of any layout and algorithm: :func:`ring_attention_func`.

Layout of every tensor (flash-attn convention), per rank: q ``[B, S_local, H, D]``, k/v
``[B, S_local, H_kv, D]`` (``H % H_kv == 0``: GQA/MQA). Returns ``out [B, S_local, H, D]``;
with ``return_attn_probs=True``, ``(out, lse, None)`` where ``lse [B, H, S_local]`` is the
natural-log log-sum-exp (fp32, or fp64 for fp64 inputs), without gradient. Which tokens a rank
holds is the layout's (Note [Sequence layouts] in ``layouts/base.py``; shard with
:func:`dtensor_ring.shard_local`); ring-flash-attention's names for fixed layouts are in
:mod:`dtensor_ring.compat.ring_flash_attn`, with the arguments described there.

Every argument is checked on every rank before any communication (Note [Call resolution]):
bad input raises ``ValueError`` naming it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..algorithm import Algorithm
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
