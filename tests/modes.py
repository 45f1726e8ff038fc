"""Python modes that tests put around calls."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class PassThroughMode(TorchDispatchMode):
    """A Python dispatch mode that sees every op and changes nothing: any active Python mode
    sends calls down the custom ops' dispatch (Note [Eager calls]) and SDPA on DTensors in a
    ``ring_sdpa`` scope through the aten-op handlers (Note [Eager SDPA on DTensors])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
