"""Inference over a sharded KV cache (docs/inference.md): the cache shard, the ring prefill and
the decoding steps (:mod:`.kv_cache`, Note [Context-parallel inference]), and decoding
attention over the shards (:mod:`.decode`, pass-Q). transformers' generation is in
:mod:`dtensor_ring.integrations.transformers.generate`."""
