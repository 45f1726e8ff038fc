"""The engine: executes one rank's part of a schedule (ring loops in ``ring.py``, llama3's
all-gather loop in ``llama3.py``) over the block kernels and the communicators; ``blocks.py``
turns plan data into the rows and kernel metadata the loops use."""
