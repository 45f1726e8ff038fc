"""Sequence layouts: one :class:`Layout` object per way of spreading tokens over ranks.

The registry maps the ``layout=`` names of every front door to layout objects; code below the
front doors asks the object (its runs, divisibility, masks, varlen form) instead of comparing
names. Built in (Note [Sequence layouts], Note [Varlen layouts]):

    name           dense  varlen      causal only
    ring           yes    documents   no
    zigzag         yes    documents   yes
    stripe         yes    -           yes
    llama3         -      stream      no     (all-gather attention, packed sequences)
    llama3_zigzag  yes    documents   no     (zigzag's tokens, all-gather attention)
    auto           yes    documents   no     (zigzag's tokens, ring / all-gather / Ulysses
                                              chosen per call: schedule/policy.py)

A new layout is one :class:`Layout` subclass passed to :func:`register_layout`.
"""

from __future__ import annotations

from .base import Layout, Run, VarlenForm
from .registry import (
    LAYOUTS,
    VARLEN_LAYOUTS,
    Form,
    LayoutName,
    call_layout,
    find_layout,
    get_layout,
    layout_names,
    order_layout,
    register_layout,
    unregister_layout,
)
from .sharding import gather_sequence, shard_local, token_indices, unshard_local
from .varlen import (
    shard_varlen,
    unshard_varlen,
    varlen_local_cu_seqlens,
    varlen_token_indices,
)

__all__ = [
    "LAYOUTS",
    "VARLEN_LAYOUTS",
    "Form",
    "Layout",
    "LayoutName",
    "Run",
    "VarlenForm",
    "call_layout",
    "find_layout",
    "gather_sequence",
    "get_layout",
    "layout_names",
    "order_layout",
    "register_layout",
    "shard_local",
    "shard_varlen",
    "token_indices",
    "unregister_layout",
    "unshard_local",
    "unshard_varlen",
    "varlen_local_cu_seqlens",
    "varlen_token_indices",
]
