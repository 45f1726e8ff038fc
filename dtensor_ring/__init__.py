"""dtensor_ring: ring attention (context parallelism) as a first-class PyTorch op.

Public names:
    * functional API (ring-flash-attention compatible): ``ring_flash_attn_func``,
      ``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and their ``_kvpacked`` /
      ``_qkvpacked`` forms;
    * sequence sharding: ``shard_local``, ``unshard_local``, ``gather_sequence``,
      ``token_indices``;
    * schedules: ``make_plan`` (per-rank blocks and FLOPs);
    * block kernels: ``BACKEND_NAMES``.
"""

from .functional import (
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
)
from .kernels import BACKEND_NAMES
from .layouts import LAYOUTS, gather_sequence, shard_local, token_indices, unshard_local
from .plan import make_plan

__all__ = [
    "BACKEND_NAMES",
    "LAYOUTS",
    "gather_sequence",
    "make_plan",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "shard_local",
    "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "token_indices",
    "unshard_local",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
]
