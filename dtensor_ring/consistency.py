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
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from ._compat import resolve_group
from .comm.faults import CommSite

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


def comparing(group_names: str | Sequence[str]) -> bool:
    """Whether a call over the group(s) called ``group_names`` compares its fingerprint now:
    the consistency mode is on, or a group is a gloo group of more than one rank (the header of
    Note [Consistency header]); never under ``torch.compile``. Callers build the fingerprint
    only then."""
    if torch.compiler.is_compiling():
        return False
    return consistency_checks_enabled() or any(
        _gloo_group(n) is not None for n in _names(group_names)
    )


def check_consistent(
    group_names: str | Sequence[str],
    fingerprint: Mapping[str, object],
    local: object = None,
    check_locals: PerRankCheck | None = None,
) -> None:
    """Compare ``fingerprint`` across the ranks of the group(s) called ``group_names``; raise
    a ``ValueError`` on every rank when they differ. With the mode off, only gloo groups
    compare, by the fixed-size header (Note [Consistency header]); under ``torch.compile``
    nothing does.

    ``fingerprint`` maps field names to picklable values, most telling first (the first field
    that differs is reported); a rank that failed its own checks passes ``{"error": ...}``.
    ``local`` is per-rank data that legitimately differs between ranks (e.g. llama3 metadata);
    when the fingerprints agree, ``check_locals(all ranks' local data)`` returns what is
    inconsistent about them, or None (the mode only).

    Several groups (the hybrid's ring and Ulysses groups, a grid of ranks) are compared one
    after the other, each gather carrying what the previous ones found: a difference inside
    any row of the grid reaches every column, so every rank of the union raises.
    """
    if torch.compiler.is_compiling():
        return
    if not consistency_checks_enabled():
        _compare_headers(_names(group_names), fingerprint)
        return
    mismatch = None
    for name in _names(group_names):
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


def _names(group_names: str | Sequence[str]) -> tuple[str, ...]:
    return (group_names,) if isinstance(group_names, str) else tuple(group_names)


# --- the header -------------------------------------------------------------------------------

# Note [Consistency header]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# With the mode off, a call over a gloo group still compares one fixed-size tensor across
# the group where the mode would compare fingerprints (same places, same count per call):
#
#     header = [raised?, found before?, crc32(field 1), ..., crc32(field 13), crc32(the rest)]
#                int64[16] on every rank, whatever the call  -> dist.all_gather over the group
#
# Its size never depends on the call, so ranks that disagree on shapes meet in a collective of
# equal sizes (gloo aborts the process, with no Python error, when a ring exchange's sizes
# differ), and every rank learns the same thing: some rank raised in its own checks (it
# raises its error, the others a ConsistencyError naming it), or the first field whose
# hashes differ (named with this rank's value; the mode names every rank's). Only gloo: its
# tensors are on the host, so the header costs one small collective and no device sync
# (docs/troubleshooting.md has the measured cost); NCCL groups compare only in the mode.

HEADER_SLOTS = 16


def _gloo_group(name: str) -> dist.ProcessGroup | None:
    """The group called ``name`` if the header compares over it (gloo, more than one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = resolve_group(name)
    return group if group.size() > 1 and dist.get_backend(group) == "gloo" else None


def _header(fingerprint: Mapping[str, object], found_before: bool) -> torch.Tensor:
    hashes = [zlib.crc32(repr((f, v)).encode()) for f, v in fingerprint.items()]
    fields = HEADER_SLOTS - 3
    hashes = [*hashes[:fields], zlib.crc32(repr(hashes[fields:]).encode())]
    hashes += [0] * (HEADER_SLOTS - 2 - len(hashes))
    return torch.tensor([int("error" in fingerprint), int(found_before), *hashes])


def _compare_headers(names: Sequence[str], fingerprint: Mapping[str, object]) -> bool:
    """Compare the header of ``fingerprint`` over each gloo group of ``names`` in turn; raise a
    :class:`ConsistencyError` on every rank of them when a rank raised or a field differs
    (a rank passing an ``"error"`` raises its own after). Returns whether a header was
    compared."""
    mismatch, compared = None, False
    for name in names:
        group = _gloo_group(name)
        if group is None:
            continue
        compared = True
        ranks = dist.get_process_group_ranks(group)
        rows = [torch.empty(HEADER_SLOTS, dtype=torch.int64) for _ in range(group.size())]
        header = _header(fingerprint, mismatch is not None)
        site = f"{fingerprint.get('op')} call, consistency header (before its exchanges)"
        with CommSite(site, group):
            dist.all_gather(rows, header, group=group)
        headers = torch.stack(rows)
        raised = [ranks[i] for i in headers[:, 0].nonzero().flatten().tolist()]
        if raised:
            mismatch = mismatch or (
                f"{_ranks(raised)} of the group raised an error in its own checks of this call "
                "(its message is in its output)"
            )
        elif headers[:, 1].any() and mismatch is None:
            mismatch = "the call's arguments (found in another group of this call)"
        elif mismatch is None:
            mismatch = _first_field(headers, ranks, fingerprint)
    if mismatch is not None and "error" not in fingerprint:
        raise ConsistencyError(
            f"ranks disagree: {mismatch}; nothing was communicated ({ENV_VAR}=1 names every "
            "rank's values and raises a rank's own error on every rank)"
        )
    return compared


def _first_field(
    headers: torch.Tensor, ranks: list[int], fingerprint: Mapping[str, object]
) -> str | None:
    fields = list(fingerprint)
    for slot in range(2, HEADER_SLOTS):
        column = headers[:, slot]
        if (column != column[0]).any():
            index = slot - 2
            # a slot past this rank's own fields (another door's longer fingerprint) or
            # folding the rest
            hashed_alone = index < min(len(fields), HEADER_SLOTS - 3)
            field = fields[index] if hashed_alone else "the further fields"
            first = [ranks[i] for i in (column == column[0]).nonzero().flatten().tolist()]
            rest = [ranks[i] for i in (column != column[0]).nonzero().flatten().tolist()]
            value = fingerprint.get(field, "")
            return (
                f"{field}: {_ranks_have(first)} one value, {_ranks(rest)} another (this rank "
                f"has {value!r})"
            )
    return None


def _ranks(ranks: list[int]) -> str:
    """``"rank 1"`` / ``"ranks 0,2"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _ranks_have(ranks: list[int]) -> str:
    """``"rank 1 has"`` / ``"ranks 0,2 have"``."""
    return f"{_ranks(ranks)} {'have' if len(ranks) > 1 else 'has'}"


@contextlib.contextmanager
def relay_errors(
    group_names: str | Sequence[str] | Callable[[], str | Sequence[str]], op: str
) -> Iterator[None]:
    """Around a front door's checks: a ``TypeError``/``ValueError`` raised inside joins the
    call's comparison (the consistency mode's gather, or the header of a gloo group) with
    this rank's error as its fingerprint (the other ranks are in :func:`check_consistent`
    too), so that every rank raises. A callable ``group_names`` is evaluated only then; if it
    raises itself (e.g. this rank is not in the group), the error stays on this rank; a
    :class:`ConsistencyError` is every rank's already."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if isinstance(err, ConsistencyError) or torch.compiler.is_compiling():
            raise
        try:
            names = _names(group_names() if callable(group_names) else group_names)
        except (TypeError, ValueError):
            raise err from None
        except Exception:  # the error being raised is what matters
            names = ()
        error = {"op": op, "error": f"{type(err).__name__}: {err}"}
        if consistency_checks_enabled():
            check_consistent(names, error)
            raise
        try:
            compared = _compare_headers(names, error)
        except Exception:  # e.g. a group name nobody registered: the error raised matters
            compared = False
        _add_hint(err, HEADER_HINT if compared else DEBUG_HINT if _group_size(names) > 1 else "")
        raise


@contextlib.contextmanager
def collective_entry(group_name: str, op: str) -> Iterator[None]:
    """Around the argument checks of an entry every rank of the group makes together (a
    ``KVCacheShard``'s construction, entering ``context_parallel``): a rank's error is relayed
    as a call's is (:func:`relay_errors`), and where calls compare (:func:`comparing`) the
    entry compares too, so one rank's bad argument raises on every rank here, not in the
    others' next collective, whatever that is."""
    with relay_errors(group_name, op):
        yield
    if comparing(group_name):
        check_consistent(group_name, {"op": op})


DEBUG_HINT = (
    f" [raised on this rank before any communication; if other ranks did not raise, they wait "
    f"for this one: {ENV_VAR}=1 raises the same error on every rank]"
)
HEADER_HINT = (
    f" [raised on this rank before any communication; the other ranks of the group raise a "
    f"ConsistencyError naming this rank; {ENV_VAR}=1 raises this error on every rank]"
)


def _group_size(names: Sequence[str]) -> int:
    """The largest size of the groups ``names`` (the default group's when they cannot be told,
    e.g. this rank is not in the group); 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        return max(dist.get_world_size(resolve_group(name)) for name in names)
    except Exception:  # the error being raised is what matters
        return dist.get_world_size()


def _add_hint(err: Exception, hint: str) -> None:
    """Append ``hint`` to ``err``'s message (once)."""
    message = err.args[0] if len(err.args) == 1 and isinstance(err.args[0], str) else None
    if hint and message is not None and hint not in message:
        err.args = (message + hint,)


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
            parts = [f"{_ranks_have(ranks)} {value}" for value, ranks in groups.items()]
            return f"{field}: " + "; ".join(parts)
    return None
