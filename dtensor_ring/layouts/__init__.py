"""Sequence layouts: one :class:`Layout` object per way of spreading tokens over ranks.

The registry maps the ``layout=`` names of every front door to layout objects; code below the
front doors asks the object (its runs, divisibility, masks, varlen form) instead of comparing
names. Built in (Note [Sequence layouts], Note [Varlen layouts]):

    name           dense  varlen      causal only (ring algorithm)
    ring           yes    documents   no
    zigzag         yes    documents   yes
    stripe         yes    -           yes
    llama3         -      stream      -      (the all-gather algorithm only)

Layouts as data, passed as ``layout=`` objects (not registered): :class:`TokenLayout` (any
permutation: a balancer's, the mask-aware one of FlexAttention) and :class:`DocumentLayout`
(varlen form "placed": packed documents placed by their work, Note [Balanced documents]).

Aliases name a layout and an algorithm (Note [Layouts and algorithms] in
``dtensor_ring/algorithm.py``): "llama3_zigzag" (zigzag + all-gather), "auto" (zigzag + the
algorithm chosen per call).

A new layout is one :class:`Layout` subclass passed to :func:`register_layout`.
"""

from __future__ import annotations

from .base import Layout, Run, VarlenForm
from .builtin import TokenLayout
from .documents import DocumentLayout
from .registry import (
    LAYOUTS,
    VARLEN_LAYOUTS,
    Form,
    LayoutName,
    alias_algorithm,
    find_layout,
    get_layout,
    home_layout,
    layout_names,
    order_layout,
    register_layout,
    unregister_layout,
)
from .sharding import (
    balancer_layout,
    gather_sequence,
    shard_local,
    token_indices,
    unshard_local,
)
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
    "TokenLayout",
    "DocumentLayout",
    "VarlenForm",
    "alias_algorithm",
    "find_layout",
    "balancer_layout",
    "gather_sequence",
    "get_layout",
    "home_layout",
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
