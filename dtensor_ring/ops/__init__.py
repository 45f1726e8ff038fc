"""The ``dtensor_ring::`` custom ops, each next to its fake, with their autograd: ring
(``ring.py``), varlen and llama3 (``varlen.py``), Ulysses (``ulysses.py``), and decoding over a
sharded KV cache (``decode.py``, inference only). Importing this package registers them all."""

from . import decode, ring, ulysses, varlen  # noqa: F401  (registers the ops)
