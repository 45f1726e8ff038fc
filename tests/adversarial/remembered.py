"""The ``remembered`` kind: a malformed call right after a good call of the same door.

The good call's resolution (and, for SDPA on DTensors, its argument checks) is remembered
(Note [Remembered resolutions] in ``dtensor_ring/resolved.py``); the malformed call differs in
one argument or tensor and must still raise a clean error on every rank: at the world sizes of
its ``args`` case, every other one with the gloo header off (``,no_header``: as on an NCCL
group, where nothing is compared and every call may take the remembered path). One door per
malformed argument, in turn. And SDPA on DTensors of two meshes over the same ranks but
different process groups (the meshes compare equal), alternately: each call must run over its
own mesh's group (a remembered check once answered with the first mesh's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import dtensor_ring as dr
from dtensor_ring import consistency
from dtensor_ring.api.dtensor import eager

from .cases import (
    ARG_CASES,
    CORRECT,
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
from .runner import Case


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
    for world in (2, 3):
        name = f"remembered/sdpa_scope/W{world}/equal_meshes_of_two_groups"
        cases.append(Case(name, "remembered", world, equal_meshes_case, {}, CORRECT))
    return cases


def equal_meshes_case(ctx) -> dict:
    """SDPA on DTensors in one ``ring_sdpa`` scope over a mesh of the case's group, one of
    another group of the same ranks (an equal mesh), then the first again: the groups each
    call ran over, and its output against SDPA on the full sequence."""
    other = dist.new_group(dist.get_process_group_ranks(ctx.group))
    meshes = [DeviceMesh.from_group(g, "cpu") for g in (ctx.group, other)]
    ran, inner = [], eager.local_forward

    def spy(q, k, v, spec, r):
        ran.append(spec.group_name)
        return inner(q, k, v, spec, r)

    eager.local_forward = spy  # a fresh process per case
    x = torch.randn(1, 2, 4 * ctx.world, 8, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    want_out = F.scaled_dot_product_attention(x, x, x, is_causal=True).chunk(ctx.world, 2)
    checks = {}
    with dr.ring_sdpa():
        for i, mesh in enumerate((*meshes, meshes[0])):
            q = DTensor.from_local(x.chunk(ctx.world, 2)[ctx.rank], mesh, [Shard(2)],
                                   run_check=False)  # fmt: skip
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True).to_local()
            err = float((out - want_out[ctx.rank]).abs().max())
            checks[f"out {i}"] = Flag(err < 1e-12, f"max error {err:.2e}")
    want = [ctx.group.group_name, other.group_name, ctx.group.group_name]
    checks["groups"] = Flag(ran == want, f"ran over groups {ran}, expected {want}")
    return checks
