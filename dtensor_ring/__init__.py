"""dtensor_ring: ring attention (context parallelism) as a first-class PyTorch op.

Public names:
    * functional API (ring-flash-attention compatible): ``ring_flash_attn_func``,
      ``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and their ``_kvpacked`` /
      ``_qkvpacked`` forms;
    * sequence layouts and sharding: ``LAYOUTS``, ``Layout``, ``get_layout``,
      ``register_layout``, ``shard_local``, ``unshard_local``, ``gather_sequence``,
      ``token_indices``;
    * schedules: ``make_plan`` (per-rank blocks and FLOPs);
    * any registered layout, ``layout="auto"`` included (ring, all-gather or Ulysses chosen
      per call by a cost model): ``ring_attention_func``, ``ring_varlen_attention_func``,
      ``choose_algorithm``, ``AlgorithmChoice``, ``Machine``, ``set_machine``,
      ``get_machine``;
    * single-device simulation: ``RankSimulator``, ``simulate_ring``, ``GatherSimulator``,
      ``simulate_gather``;
    * block kernels: ``BACKEND_NAMES``;
    * variable-length (packed documents, docs/varlen.md): ``ring_flash_attn_varlen_func``,
      ``zigzag_ring_flash_attn_varlen_func``, ``llama3_flash_attn_varlen_func`` and their
      packed forms, ``llama3_flash_attn_prepare_cu_seqlens``, ``shard_varlen``,
      ``unshard_varlen``, ``varlen_token_indices``, ``varlen_local_cu_seqlens``,
      ``varlen_balance``, ``VARLEN_LAYOUTS``, ``document_layout`` (whole documents placed by
      their work, the heaviest cut), ``documents_as_sharded`` (documents as a dense layout's
      shards hold them, e.g. head-tail over a packed row);
    * DTensor (docs/composability.md): ``ring_sdpa`` (scope: ``F.scaled_dot_product_attention``
      on sequence-sharded DTensors runs ring attention), ``scaled_dot_product_ring_attention``,
      ``shard_sequence``, ``unshard_sequence``;
    * Ulysses and 2-D (Ulysses x ring) context parallelism (docs/ulysses.md):
      ``ulysses_flash_attn_func`` (+ ``_kvpacked`` / ``_qkvpacked``), ``hybrid_flash_attn_func``,
      ``hybrid_shard_local``, ``hybrid_token_indices``, ``comm_volume``;
    * PyTorch's context-parallel API on ring attention (docs/composability.md,
      docs/migrating.md): ``context_parallel``, ``context_parallel_unshard``; its module-level
      form: ``ContextParallel`` (for ``parallelize_module``), ``context_parallel_shard``,
      ``balancer_layout``, ``cp_options``, ``set_rotate_method``,
      ``enable_context_parallel_dispatcher`` / ``disable_context_parallel_dispatcher``
      (PyTorch's spellings, import-only: ``dtensor_ring.compat.torch_cp``);
    * FlexAttention on the ring (docs/flex.md): ``flex_attention`` (any ``BlockMask`` /
      ``mask_mod`` / ``score_mod`` of global positions), ``flex_layout`` (mask-aware balance),
      ``flex_balance``, ``document_mask`` (packed documents' BlockMask from their boundaries),
      ``mask_documents`` (a BlockMask read back as documents: what runs on the varlen kernels);
    * inference over a sharded KV cache (docs/inference.md): ``decode_attention_func``,
      ``KVCacheShard``, ``prefill_attention``, ``decode_step_attention``, ``split_prompt``.
"""

from . import ops  # noqa: F401  (registers the dtensor_ring:: ops)
from .api.context_parallel import (
    context_parallel,
    context_parallel_unshard,
    cp_options,
    set_rotate_method,
)
from .api.documents import document_layout, document_mask, documents_as_sharded
from .api.dtensor import (
    ring_sdpa,
    scaled_dot_product_ring_attention,
    shard_sequence,
    unshard_sequence,
)
from .api.flex import flex_attention, flex_balance, flex_layout, mask_documents
from .api.functional import ring_attention_func
from .api.parallel_style import (
    ContextParallel,
    context_parallel_shard,
    disable_context_parallel_dispatcher,
    enable_context_parallel_dispatcher,
)
from .api.ulysses import (
    hybrid_flash_attn_func,
    hybrid_shard_local,
    hybrid_token_indices,
    ulysses_flash_attn_func,
    ulysses_flash_attn_kvpacked_func,
    ulysses_flash_attn_qkvpacked_func,
)
from .api.varlen import (
    llama3_zigzag_flash_attn_func,
    llama3_zigzag_flash_attn_varlen_func,
    ring_varlen_attention_func,
)
from .compat.ring_flash_attn import (
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)
from .consistency import consistency_checks_enabled, set_consistency_checks
from .inference.decode import decode_attention_func
from .inference.kv_cache import KVCacheShard, decode_step_attention, prefill_attention, split_prompt
from .kernels import BACKEND_NAMES
from .layouts import (
    LAYOUTS,
    VARLEN_LAYOUTS,
    Layout,
    balancer_layout,
    gather_sequence,
    get_layout,
    register_layout,
    shard_local,
    shard_varlen,
    token_indices,
    unshard_local,
    unshard_varlen,
    varlen_local_cu_seqlens,
    varlen_token_indices,
)
from .schedule.cost import comm_volume, varlen_balance
from .schedule.llama3 import llama3_flash_attn_prepare_cu_seqlens
from .schedule.plan import make_plan
from .schedule.policy import (
    AlgorithmChoice,
    Machine,
    choose_algorithm,
    get_machine,
    set_machine,
)
from .simulate import GatherSimulator, RankSimulator, simulate_gather, simulate_ring

__all__ = [
    "decode_attention_func",
    "KVCacheShard",
    "decode_step_attention",
    "prefill_attention",
    "split_prompt",
    "consistency_checks_enabled",
    "set_consistency_checks",
    "RankSimulator",
    "simulate_ring",
    "GatherSimulator",
    "simulate_gather",
    "BACKEND_NAMES",
    "LAYOUTS",
    "Layout",
    "gather_sequence",
    "get_layout",
    "register_layout",
    "make_plan",
    # the choice behind layout="auto" (Note [Choosing ring, all-gather or Ulysses])
    "AlgorithmChoice",
    "Machine",
    "choose_algorithm",
    "get_machine",
    "set_machine",
    "ring_attention_func",
    "flex_attention",
    "flex_balance",
    "document_mask",
    "flex_layout",
    "mask_documents",
    "ring_varlen_attention_func",
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
    # variable-length sequences
    "VARLEN_LAYOUTS",
    "document_layout",
    "documents_as_sharded",
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
    "llama3_zigzag_flash_attn_func",
    "llama3_zigzag_flash_attn_varlen_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "shard_varlen",
    "unshard_varlen",
    "varlen_balance",
    "varlen_local_cu_seqlens",
    "varlen_token_indices",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    # DTensor
    "ring_sdpa",
    "scaled_dot_product_ring_attention",
    "shard_sequence",
    "unshard_sequence",
    # Ulysses and 2-D hybrid
    "comm_volume",
    "hybrid_flash_attn_func",
    "hybrid_shard_local",
    "hybrid_token_indices",
    "ulysses_flash_attn_func",
    "ulysses_flash_attn_kvpacked_func",
    "ulysses_flash_attn_qkvpacked_func",
    # PyTorch's context_parallel API
    "context_parallel",
    "context_parallel_shard",
    "ContextParallel",
    "balancer_layout",
    "cp_options",
    "set_rotate_method",
    "enable_context_parallel_dispatcher",
    "disable_context_parallel_dispatcher",
    "context_parallel_unshard",
]
