"""Schedules as data: which local queries meet which keys/values at every step (``plan.py``,
``varlen.py``, ``llama3.py``), their vocabulary (``blocks.py``) and cost models (``cost.py``).
Nothing here communicates or touches a device."""
