"""Compatibility names: ring-flash-attention's functions (:mod:`.ring_flash_attn`) and its
transformers adapter (:mod:`.rfa_hf_adapter`). Thin forms of the front doors in
:mod:`dtensor_ring.api`; nothing below imports this package."""
