"""Collectives over a whole group: the all-gather of K/V (llama3 attention) and of decoding's
partial results, the reduce-scatter of dK/dV.

``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated in newer torch in favour
of the ``*_single`` names (same signatures); these are whichever this torch has.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
