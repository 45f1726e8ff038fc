"""Consistency mode: every call first checks that all ranks of its group make the same call.

Note [Consistency mode]
~~~~~~~~~~~~~~~~~~~~~~~
Every rank validates its own arguments (Note [Call resolution]), which catches every mistake
one rank can see. What no rank can see alone is ranks *disagreeing*: different shapes, dtypes,
masks, layouts, windows, scales, documents, or different calls altogether. In SPMD code that
is a bug, and without a check it hangs a collective, aborts inside the backend, or returns a
wrong result. With the consistency mode on, :func:`dtensor_ring.resolve.resolve_call` ends
with one small collective before any communication of the call:

    rank r:  fingerprint = {op, layout, causal, window, scale, backend, shapes, dtype, ...,
                            cu_seqlens / llama3 metadata, or the error this rank raised}
             all_gather_object(fingerprints, group)
             the first field whose values differ -> ValueError on every rank, naming the field,
                                                     the values and the ranks holding each

A rank whose own checks failed still joins the collective (with its error as the fingerprint),
so its error reaches every rank instead of leaving the others waiting in the ring: checks
inside ``resolve_call`` and those a front door makes before it (:func:`relay_errors`: packed
``kv``/``qkv``, SDPA on DTensors, the transformers function). A call over two groups (hybrid:
ring group, then Ulysses group) gathers over each in turn, carrying what the first found:

    ring groups (rows)      u0: [r0 r1]   -> a difference inside a row is found there
    Ulysses groups (cols)   [u0 u1] per r -> every column has one rank of every row,
                                             so every rank of the grid learns it

Switch: the environment variable ``DTENSOR_RING_DEBUG=1`` (read at every call), or
:func:`set_consistency_checks` (True/False override the variable; None follows it again).
Off by default: the collective costs one small ``all_gather_object`` per attention call
(docs/troubleshooting.md has the measured cost). Eager only: under ``torch.compile`` the check
is skipped (a Python collective cannot run inside a traced graph); run the first steps eagerly
with the mode on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from ._compat import resolve_group

ENV_VAR = "DTENSOR_RING_DEBUG"
_override: bool | None = None


def set_consistency_checks(enabled: bool | None) -> None:
    """Turn the consistency mode on (True) or off (False), or back to ``DTENSOR_RING_DEBUG``
    (None)."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__}")
    _override = enabled


def consistency_checks_enabled() -> bool:
    """Whether calls compare their fingerprints across their group now (Note [Consistency
    mode])."""
    if _override is not None:
        return _override
    return os.environ.get(ENV_VAR, "0").strip().lower() not in ("", "0", "false", "no", "off")


PerRankCheck = Callable[[list], "str | None"]


class ConsistencyError(ValueError):
    """Ranks disagree (raised on every rank of the compared group(s) alike)."""


def check_consistent(
    group_names: str | Sequence[str],
    fingerprint: Mapping[str, object],
    local: object = None,
    check_locals: PerRankCheck | None = None,
) -> None:
    """Compare ``fingerprint`` across the ranks of the group(s) called ``group_names``; raise
    a ``ValueError`` on every rank when they differ. A no-op unless the mode is on (and under
    ``torch.compile``).

    ``fingerprint`` maps field names to picklable values, most telling first (the first field
    that differs is reported); a rank that failed its own checks passes ``{"error": ...}``.
    ``local`` is per-rank data that legitimately differs between ranks (e.g. llama3 metadata);
    when the fingerprints agree, ``check_locals(all ranks' local data)`` returns what is
    inconsistent about them, or None.

    Several groups (the hybrid's ring and Ulysses groups, a grid of ranks) are compared one
    after the other, each gather carrying what the previous ones found: a difference inside
    any row of the grid reaches every column, so every rank of the union raises.
    """
    if torch.compiler.is_compiling() or not consistency_checks_enabled():
        return
    mismatch = None
    for name in (group_names,) if isinstance(group_names, str) else group_names:
        group = resolve_group(name)
        world_size = dist.get_world_size(group)
        if world_size == 1:
            continue
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (dict(fingerprint), local, mismatch), group=group)
        found = [m for _, _, m in gathered if m is not None]
        mismatch = found[0] if found else first_difference([fp for fp, _, _ in gathered])
        if mismatch is None and check_locals is not None:
            mismatch = check_locals([data for _, data, _ in gathered])
    if mismatch is not None:
        raise ConsistencyError(f"ranks disagree on {mismatch} ({ENV_VAR}=1 consistency check)")


@contextlib.contextmanager
def relay_errors(
    group_names: str | Sequence[str] | Callable[[], str | Sequence[str]], op: str
) -> Iterator[None]:
    """Around a front door's checks: with the mode on, a ``TypeError``/``ValueError`` raised
    inside joins the consistency collective with this rank's error as its fingerprint (the
    other ranks are in :func:`check_consistent` too), so that every rank raises. A callable
    ``group_names`` is evaluated only then; if it raises itself (e.g. this rank is not in the
    group), the error stays on this rank; a :class:`ConsistencyError` is every rank's already."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if isinstance(err, ConsistencyError) or torch.compiler.is_compiling():
            raise
        if not consistency_checks_enabled():
            _add_debug_hint(err, group_names)
            raise
        try:
            names = group_names() if callable(group_names) else group_names
        except (TypeError, ValueError):
            raise err from None
        check_consistent(names, {"op": op, "error": f"{type(err).__name__}: {err}"})
        raise


DEBUG_HINT = (
    f" [raised on this rank before any communication; if other ranks did not raise, they wait "
    f"for this one: {ENV_VAR}=1 raises the same error on every rank]"
)


def _add_debug_hint(
    err: Exception, group_names: str | Sequence[str] | Callable[[], str | Sequence[str]]
) -> None:
    """Append :data:`DEBUG_HINT` to ``err``'s message (once) when other ranks may be waiting:
    the call's group(s) have more than one rank (the default group's size when they cannot be
    told, e.g. this rank is not in the group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        names = group_names() if callable(group_names) else group_names
        names = (names,) if isinstance(names, str) else names
        size = max(dist.get_world_size(resolve_group(name)) for name in names)
    except Exception:  # the error being raised is what matters
        size = dist.get_world_size()
    message = err.args[0] if len(err.args) == 1 and isinstance(err.args[0], str) else None
    if size > 1 and message is not None and DEBUG_HINT not in message:
        err.args = (message + DEBUG_HINT,)


def first_difference(fingerprints: list[Mapping[str, object]]) -> str | None:
    """``"<field>: rank(s) a has X; rank(s) b has Y"`` for the first field whose values differ
    between the ranks' fingerprints (in rank order), or None when they agree."""
    fields: list[str] = []
    for fp in fingerprints:
        fields += [f for f in fp if f not in fields]
    if any("error" in fp for fp in fingerprints):  # a rank's own error explains the rest
        fields = ["error", *(f for f in fields if f != "error")]
    for field in fields:
        values = [fp.get(field, "<missing>") for fp in fingerprints]
        if any(v != values[0] for v in values[1:]):
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value), []).append(rank)
            parts = [
                f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} "
                f"{'have' if len(ranks) > 1 else 'has'} {value}"
                for value, ranks in groups.items()
            ]
            return f"{field}: " + "; ".join(parts)
    return None
