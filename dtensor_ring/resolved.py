"""Resolutions remembered: a call's spec kept per what its resolution reads.

Note [Remembered resolutions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`~dtensor_ring.resolve.resolve_call` checks and normalises every argument of every call
(Note [Call resolution]): ~25 us of host time a call on a CPU, twice for SDPA on DTensors
(forward and backward), while a training step makes the same calls layer after layer. The
resolution of a call that passes is a function of what it reads: the tensors' shapes, dtypes
and devices (never their values), the scalar arguments, the door, torch's deterministic
switches, the registered layouts and the kernel choices. So a passing resolution is kept under
exactly that key, and a call with the same key gets the same spec without the checks:

    key = (group, W, layout name, q/k/v/sinks (type, shape, dtype, device),
           (type, value) of causal, scale, dropout_p, deterministic, backend, window,
           door, deterministic switches, layout registry version, kernel selection version)

A call is resolved afresh (and not kept) whenever the key could miss something:

* the consistency mode or a gloo header compares it (its collectives run on every call);
* a layout passed as an object, or a name the registry does not hold itself (the custom ops
  find passed layouts by name in a bounded table that resolving refreshes);
* a door with its own checks (``Door.checks``, ``metadata``, ...: they read values, such as
  ``cu_seqlens``);
* tensors of a subclass other than DTensor (FakeTensor, ...; a DTensor is keyed by its mesh,
  its mesh dims' process groups and its placements too), ``alibi_slopes``, or a scalar
  argument not of a plain type (bool, int, float, str, None; floats keyed with their sign, so
  ``-0.0`` is not ``0.0``);
* under ``torch.compile`` (resolution is traced once, its results are constants).

A failing resolution is never kept: bad input raises every time, on every rank. Registering or
removing a layout, and :func:`~dtensor_ring.kernels.clear_selection_cache`, move the versions
in the key. The table is bounded (cleared when full). The checks of SDPA on DTensors
(``check_sdpa_args``: placements, meshes, shapes) are remembered the same way, in a table of
their own, and so are their route and resolution on the local shards (``resolve_local`` in
``api/dtensor/handlers.py``: one key for both, also read by the call's backward), except for
"auto" (priced per call) and compared calls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .kernels import selection_version
from .layouts.registry import registered_name, registry_version

_PLAIN = (bool, int, float, str, type(None))


class Remembered:
    """A bounded table of passing checks' results (cleared when full)."""

    def __init__(self, size: int = 1024):
        self.size, self.table = size, {}

    def get(self, key: tuple | None) -> object | None:
        """The result kept under ``key``, if any (None: never kept)."""
        return None if key is None else self.table.get(key)

    def put(self, key: tuple | None, value: object) -> None:
        """Keep ``value`` under ``key`` (None: not kept)."""
        if key is None:
            return
        if len(self.table) >= self.size:
            self.table.clear()
        self.table[key] = value


RESOLUTIONS = Remembered()


def resolution_key(call, door) -> tuple | None:
    """The key of ``call`` (a :class:`~dtensor_ring.resolve.Call`) at ``door`` (a
    :class:`~dtensor_ring.resolve.Door`, no collectives on this call), or None when it must be
    resolved afresh (Note [Remembered resolutions])."""
    if torch.compiler.is_compiling() or not registered_name(call.layout):
        return None
    if door.checks or door.metadata or door.local or door.check_locals:
        return None
    if call.alibi_slopes is not None:
        return None
    tensors = [tensor_key(t) for t in (call.q, call.k, call.v)]
    sinks = () if call.sinks is None else tensor_key(call.sinks)
    window = call.window_size
    window_items = tuple(window) if type(window) in (tuple, list) else (window,)
    scalars = (call.causal, call.softmax_scale, call.dropout_p, call.deterministic, call.backend)
    values = [scalar_key(x) for x in (*scalars, *window_items)]
    if None in tensors or sinks is None or None in values:
        return None
    return (
        call.group_name,
        call.world_size,
        call.layout,
        *tensors,
        sinks,
        type(window),
        *values,
        door,
        *versions(),
    )


def versions() -> tuple:
    """What a check may read besides its arguments: torch's deterministic switches, the
    layout registry's and the kernel choices' versions."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        registry_version(),
        selection_version(),
    )


def tensor_key(t: object) -> tuple | None:
    """A plain tensor's shape, dtype and device; a DTensor's shape, dtype, mesh, placements and
    its mesh dims' process groups (meshes of different groups over the same ranks compare
    equal); None for anything else (not remembered)."""
    if type(t) is Tensor:
        return (t.shape, t.dtype, t.device)
    if type(t) is DTensor:
        mesh = t.device_mesh
        groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
        return (DTensor, t.shape, t.dtype, t.device, mesh, groups, t.placements)
    return None


def scalar_key(x: object) -> tuple | None:
    """``(type, value)`` of a plain scalar (a float with its sign: ``-0.0`` is not ``0.0``);
    None for anything else (not remembered)."""
    if type(x) not in _PLAIN:
        return None
    if type(x) is float:
        return (float, x, math.copysign(1.0, x))
    return (type(x), x)
