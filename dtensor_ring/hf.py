"""``dtensor_ring.hf``: the transformers integration (``attn_implementation="dtensor_ring"``),
and ring-flash-attention's adapter entry points (``substitute_hf_flash_attn``,
``update_ring_flash_attn_params``).

The code lives in :mod:`dtensor_ring.integrations.transformers` and
:mod:`dtensor_ring.compat.rfa_hf_adapter`; this module keeps the public import path.
``import dtensor_ring`` never imports it (nor transformers).
"""

from .compat.rfa_hf_adapter import (
    RFA_ATTN_IMPLEMENTATION,
    substitute_hf_flash_attn,
    update_ring_flash_attn_params,
)
from .integrations.transformers.attention import (
    ATTN_IMPLEMENTATION,
    ring_attention_forward,
    setup,
)
from .integrations.transformers.batch import (
    HF_LAYOUTS,
    IGNORE_INDEX,
    PADDING_MASK,
    gather_outputs,
    shard_batch,
)
from .integrations.transformers.generate import GENERATE_ATTN_IMPLEMENTATION, generate  # noqa: F401

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HF_LAYOUTS",
    "IGNORE_INDEX",
    "PADDING_MASK",
    "gather_outputs",
    "ring_attention_forward",
    "setup",
    "shard_batch",
    "RFA_ATTN_IMPLEMENTATION",
    "substitute_hf_flash_attn",
    "update_ring_flash_attn_params",
    "generate",
    "GENERATE_ATTN_IMPLEMENTATION",
    "ShardedCache",  # noqa: F822  (module __getattr__: imports transformers)
]


def __getattr__(name: str):
    """``ShardedCache`` (a ``transformers.cache_utils.Cache`` subclass) imports transformers:
    it is loaded on first access only."""
    if name == "ShardedCache":
        from .integrations.transformers.cache import ShardedCache

        return ShardedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
