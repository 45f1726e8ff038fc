"""The Hugging Face transformers integration (public path :mod:`dtensor_ring.hf`): the
attention implementation, its keyword policy and batch sharding (:mod:`.attention`), generation
over a sharded KV cache (:mod:`.generate`) and its ``Cache`` class (:mod:`.cache`, which
imports transformers)."""
