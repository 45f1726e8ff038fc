"""The core front doors: the one dispatch of every door that takes ``layout=`` /
``algorithm=`` (``attend.py``), the dense and packed doors (``functional.py``, ``varlen.py``),
Ulysses and 2-D hybrid (``ulysses.py``), SDPA on DTensors (``dtensor/``) and PyTorch's
``context_parallel`` (``context_parallel.py``). Compatibility names live in
:mod:`dtensor_ring.compat`, framework integrations in :mod:`dtensor_ring.integrations`,
inference over a sharded KV cache in :mod:`dtensor_ring.inference`."""
