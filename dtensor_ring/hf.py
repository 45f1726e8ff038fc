"""``dtensor_ring.hf``: the transformers integration (``attn_implementation="dtensor_ring"``).

The code lives in :mod:`dtensor_ring.api.hf` with the other front doors; this module keeps
the public import path. ``import dtensor_ring`` never imports it (nor transformers).
"""

from .api.hf import (  # noqa: F401
    ATTN_IMPLEMENTATION,
    HF_LAYOUTS,
    IGNORE_INDEX,
    __all__,  # noqa: F401
    ring_attention_forward,
    setup,
    shard_batch,
)
