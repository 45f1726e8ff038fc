"""Integrations with frameworks (imported only on use: ``import dtensor_ring`` imports none of
them): :mod:`.transformers` (public path ``dtensor_ring.hf``)."""
