"""The ``remembered`` kind: a malformed call right after a good call of the same door.

The good call's resolution (and, for SDPA on DTensors, its argument checks) is remembered
(Note [Remembered resolutions] in ``dtensor_ring/resolved.py``); the malformed call differs in
one argument or tensor and must still raise a clean error on every rank: at the world sizes of
its ``args`` case, every other one with the gloo header off (``,no_header``: as on an NCCL
group, where nothing is compared and every call may take the remembered path). One door per
malformed argument, in turn.
"""

from __future__ import annotations

from dtensor_ring import consistency

from .cases import (
    ARG_CASES,
    ERROR,
    Setup,
    _arg_doors,
    _arg_setup,
    _case,
    _pick,
    attention_case,
)
from .doors import DOORS
from .oracle import Flag, evaluate


def remembered_case(ctx, door, setup: Setup, header: bool = True) -> dict:
    """A good causal call of ``door``, then ``setup``'s call; ``header``: False turns the gloo
    header off in this (fresh) process."""
    if not header:
        consistency._gloo_group = lambda name: None
    try:
        good = attention_case(ctx, door, Setup(kw={"causal": True}))
    except Exception as e:  # noqa: BLE001 - a failing good call must fail the case
        return {"good call": Flag(False, f"the good call raised {type(e).__name__}: {e}")}
    failed = {name: check for name, check in good.items() if evaluate(check) is not None}
    if failed:
        return failed  # returned, where an error is expected: the case fails
    return attention_case(ctx, door, setup)


def remembered_cases(doors=None) -> list:
    cases = []
    all_doors = list(doors or DOORS.values())
    malformed = [a for a in ARG_CASES if a.expect == ERROR and "group" not in a.label]
    for i, arg in enumerate(malformed):
        arg_doors = _arg_doors(arg, all_doors)
        if not arg_doors:
            continue
        door, world, header = arg_doors[i % len(arg_doors)], _pick(arg.worlds, i), i % 2 == 0
        detail = arg.label + ("" if header or world == 1 else ",no_header")
        case = _case("remembered", door, world, detail, _arg_setup(door, arg), arg.expect,
                     fn=remembered_case)  # fmt: skip
        case.params["header"] = header
        cases.append(case)
    return cases
