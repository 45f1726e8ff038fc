"""Communication: point-to-point K/V exchange of the ring (``p2p.py``) and the all-to-all of
Ulysses (``all_to_all.py``). The engine sees only the small ``Exchanger`` protocol."""
