"""ring-flash-attention's function names and arguments: change one import.

Every function here is a thin, table-driven form of a front door of :mod:`dtensor_ring.api`
with a fixed layout (and the ring algorithm, or llama3's all-gather), so its arguments are the
door's. Tensors, per rank (flash-attn convention):

    dense   q ``[B, S_local, H, D]``, k/v ``[B, S_local, H_kv, D]`` (``H % H_kv == 0``);
            kv-packed ``kv [B, S_local, 2, H_kv, D]``, qkv-packed ``qkv [B, S_local, 3, H, D]``;
            -> ``out [B, S_local, H, D]`` (``return_attn_probs``: ``(out, lse [B, H, S_local],
            None)``)
    varlen  q ``[T_local, H, D]``, k/v ``[T_local, H_kv, D]``; ``kv [T_local, 2, H_kv, D]``,
            ``qkv [T_local, 3, H, D]``; -> ``out [T_local, H, D]`` (lse ``[H, T_local]``)

    family                           layout (Note [Sequence layouts])   door
    ring_flash_attn_*                ring (contiguous)                  ring_attention_func
    zigzag_ring_flash_attn_*         zigzag (causal only)               ring_attention_func
    stripe_flash_attn_*              stripe (causal only)               ring_attention_func
    ring_flash_attn_varlen_*         ring varlen (each document / W)    ring_varlen_attention_func
    zigzag_ring_flash_attn_varlen_*  zigzag varlen (causal only)        ring_varlen_attention_func
    llama3_flash_attn_varlen_*       llama3's packed stream             llama3_attention_func

Arguments common to every function: ``dropout_p`` (must be 0.0), ``softmax_scale`` (default
``D ** -0.5``), ``causal`` (over the *global* sequence, or within each document),
``window_size`` (flash-attn's ``(left, right)`` over global positions; docs/window.md),
``alibi_slopes`` (must be None), ``deterministic``, ``return_attn_probs``, ``group`` (default:
the default group); keyword-only ``backend`` (block-kernel name, None: the fastest able) and
``sinks`` (per-head attention-sink logits ``[H]``; Note [Attention sinks]). Varlen:
``cu_seqlens`` (int32 ``[N + 1]`` *local* boundaries, global ``// W``) and ``max_seqlen``;
llama3: the metadata of :func:`dtensor_ring.llama3_flash_attn_prepare_cu_seqlens` and
``heads_k_stride``. Every argument is checked on every rank before any communication.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from ..api.functional import Result, ring_attention_func
from ..api.packed import named, packed_form
from ..api.varlen import llama3_attention_func, ring_varlen_attention_func

_DENSE_TOKENS = "q ``[B, S_local, H, D]``, k, v ``[B, S_local, H_kv, D]``"
_VARLEN_TOKENS = "q ``[T_local, H, D]``, k, v ``[T_local, H_kv, D]``"


def _door_form(
    door: Callable, name: str, doc: str, *, layout: str | None = None, hidden: str
) -> Callable:
    """``door`` under ``name``: its first argument fixed to ``layout`` (when given), without
    its keyword ``hidden`` (these functions fix what it sets: the algorithm, the layout)."""

    @functools.wraps(door)
    def fn(*args, **kwargs) -> Result:
        if hidden in kwargs:  # rejected, not ignored
            raise TypeError(f"{name}() got an unexpected keyword argument {hidden!r}")
        return door(*args, **kwargs) if layout is None else door(layout, *args, **kwargs)

    params = list(inspect.signature(door).parameters.values())[layout is not None :]
    fn.__signature__ = inspect.Signature([p for p in params if p.name != hidden])
    return named(fn, name, doc, __name__)


def _dense(layout: str, name: str, what: str) -> Callable:
    doc = f"Ring attention, {what}: {_DENSE_TOKENS} -> out."
    return _door_form(ring_attention_func, name, doc, layout=layout, hidden="algorithm")


def _varlen(layout: str, name: str, what: str) -> Callable:
    doc = f"Ring attention over packed documents, {what}: {_VARLEN_TOKENS} -> out."
    return _door_form(ring_varlen_attention_func, name, doc, layout=layout, hidden="algorithm")


ring_flash_attn_func = _dense("ring", "ring_flash_attn_func", "ring layout (contiguous)")
ring_flash_attn_kvpacked_func = packed_form(ring_flash_attn_func, 2, False)
ring_flash_attn_qkvpacked_func = packed_form(ring_flash_attn_func, 3, False)
zigzag_ring_flash_attn_func = _dense("zigzag", "zigzag_ring_flash_attn_func", "zigzag; causal")
zigzag_ring_flash_attn_kvpacked_func = packed_form(zigzag_ring_flash_attn_func, 2, False)
zigzag_ring_flash_attn_qkvpacked_func = packed_form(zigzag_ring_flash_attn_func, 3, False)
stripe_flash_attn_func = _dense("stripe", "stripe_flash_attn_func", "stripe layout; causal")
stripe_flash_attn_kvpacked_func = packed_form(stripe_flash_attn_func, 2, False)
stripe_flash_attn_qkvpacked_func = packed_form(stripe_flash_attn_func, 3, False)

ring_flash_attn_varlen_func = _varlen(
    "ring", "ring_flash_attn_varlen_func", "every document cut into W pieces"
)
ring_flash_attn_varlen_kvpacked_func = packed_form(ring_flash_attn_varlen_func, 2, True)
ring_flash_attn_varlen_qkvpacked_func = packed_form(ring_flash_attn_varlen_func, 3, True)
zigzag_ring_flash_attn_varlen_func = _varlen(
    "zigzag", "zigzag_ring_flash_attn_varlen_func", "zigzag varlen; causal"
)
zigzag_ring_flash_attn_varlen_kvpacked_func = packed_form(
    zigzag_ring_flash_attn_varlen_func, 2, True
)
zigzag_ring_flash_attn_varlen_qkvpacked_func = packed_form(
    zigzag_ring_flash_attn_varlen_func, 3, True
)

llama3_flash_attn_varlen_func = _door_form(
    llama3_attention_func,
    "llama3_flash_attn_varlen_func",
    "All-gather (llama3) attention over packed documents: the packed stream cut into W "
    f"contiguous slices, K/V all-gathered ``heads_k_stride`` KV heads at a time; {_VARLEN_TOKENS}"
    " -> out.",
    hidden="layout",
)
llama3_flash_attn_varlen_kvpacked_func = packed_form(llama3_flash_attn_varlen_func, 2, True)
llama3_flash_attn_varlen_qkvpacked_func = packed_form(llama3_flash_attn_varlen_func, 3, True)
