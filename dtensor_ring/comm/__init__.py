"""Communication: point-to-point K/V exchange of the ring (``p2p.py``), the all-to-all of
Ulysses (``all_to_all.py``) and whole-group collectives (``collectives.py``: llama3's
all-gather and reduce-scatter, decoding's all-gather). The engine sees only the small
``Exchanger`` protocol. A failed wait raises an error naming the operation, step and peers
(``faults.py``, Note [Faults])."""
