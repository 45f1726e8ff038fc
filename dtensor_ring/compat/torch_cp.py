"""PyTorch's context-parallel names on dtensor_ring: change the import, keep the program.

    # before
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard, _ContextParallel, _cp_options, _enable_context_parallel_dispatcher,
        _HeadTailLoadBalancer, context_parallel, context_parallel_unshard, set_rotate_method)
    # after
    from dtensor_ring.compat.torch_cp import (... the same names ...)

Every name is the public dtensor_ring one under PyTorch's spelling (docs/migrating.md):
``_ContextParallel`` is :class:`dtensor_ring.ContextParallel` with PyTorch's
``AttentionType`` enum, ``_context_parallel_shard`` is :func:`dtensor_ring.context_parallel_shard`,
``_HeadTailLoadBalancer`` gives PyTorch's head-tail permutation (our "zigzag"),
``_cp_options`` / ``set_rotate_method`` / ``_RotateMethod`` are the options the CP doors read,
and the dispatcher switches hold a ``ring_sdpa`` scope open (SDPA on sequence-sharded
DTensors, torchtitan's path). PyTorch's PTRR and per-document balancers are served by the
permutation they make (a ``TokenLayout``).
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from ..api.context_parallel import RotateMethod as _RotateMethod
from ..api.context_parallel import context_parallel, context_parallel_unshard, set_rotate_method
from ..api.context_parallel import cp_options as _cp_options
from ..api.parallel_style import ContextParallel
from ..api.parallel_style import context_parallel_shard as _context_parallel_shard
from ..api.parallel_style import disable_context_parallel_dispatcher as _disable
from ..api.parallel_style import enable_context_parallel_dispatcher as _enable
from ..layouts import get_layout

_enable_context_parallel_dispatcher = _enable
_disable_context_parallel_dispatcher = _disable


class _ContextParallel(ContextParallel):
    """PyTorch's ``_ContextParallel(seq_dim, attention_type)``: :class:`ContextParallel`."""

    class AttentionType(enum.Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"


class _HeadTailLoadBalancer:
    """PyTorch's head-tail balancer (rank r holds chunks r and 2W-1-r of 2W): ``zigzag``."""

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device):
        self.seq_length, self.world_size, self.device = seq_length, world_size, device

    def _generate_indices(self, restore: bool = False) -> Tensor:
        """``[1, seq_length]``: the rank-order permutation (``restore``: its inverse)."""
        order, inverse = get_layout("zigzag", "dense").order(self.seq_length, self.world_size)
        return (inverse if restore else order)[None].to(self.device)


__all__ = [
    "_ContextParallel",
    "_HeadTailLoadBalancer",
    "_RotateMethod",
    "_context_parallel_shard",
    "_cp_options",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
]
