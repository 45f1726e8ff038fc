"""``dtensor_ring.hf``: the transformers integration (``attn_implementation="dtensor_ring"``),
and ring-flash-attention's adapter entry points (``substitute_hf_flash_attn``,
``update_ring_flash_attn_params``).

The code lives in :mod:`dtensor_ring.api.hf` and :mod:`dtensor_ring.api.rfa_hf_adapter` with
the other front doors; this module keeps the public import path. ``import dtensor_ring``
never imports it (nor transformers).
"""

from .api.hf import (  # noqa: F401
    ATTN_IMPLEMENTATION,
    HF_LAYOUTS,
    IGNORE_INDEX,
    ring_attention_forward,
    setup,
    shard_batch,
)
from .api.hf import __all__ as _hf_all
from .api.rfa_hf_adapter import (
    RFA_ATTN_IMPLEMENTATION,
    substitute_hf_flash_attn,
    update_ring_flash_attn_params,
)

__all__ = [
    *_hf_all,
    "RFA_ATTN_IMPLEMENTATION",
    "substitute_hf_flash_attn",
    "update_ring_flash_attn_params",
]
