"""Front doors: the flash-attn style functions (``functional.py``, ``varlen.py``), Ulysses and
2-D hybrid (``ulysses.py``), SDPA on DTensors (``dtensor.py``) and the transformers
integration (``hf.py``, imported only on demand). Each resolves its call once
(``dtensor_ring.resolve``) and calls an op."""
