"""Cases of the ``shards`` kind: packed documents sharded by someone else, and the varlen door
told where its tokens came from (``ring_varlen_attention_func(..., positions=)``, issue #26
item 4).

Three documents of 4W, 2W and 6W tokens in one packed sequence, held by each rank as the
per-document zigzag layout places them (the door's own: exact), as head-tail chunks of the
whole row (PyTorch's ``_HeadTailLoadBalancer``, torchtitan's default) or as contiguous chunks
of the row; the door is told each token's index in the sequence (``positions``) and must
compute exactly on its own layout's tokens and raise a clean ``ValueError`` on every rank for
the others (W = 1: every variant is the whole sequence, exact); the head-tail chunks with
``dr.documents_as_sharded(bounds, "zigzag", W)`` as the layout: exact. Malformed ``positions``
(int16, one short, a list) raise too. Forward and backward against the strict fp64 reference
(:mod:`tests.adversarial.oracle`).
"""

from __future__ import annotations

import itertools

import torch

from . import oracle
from .cases import CORRECT, ERROR, WORLDS
from .doors import Ctx
from .oracle import Check
from .runner import Case

H, H_KV, D = 4, 2, 8
#: variant -> (the tokens a rank holds, how positions are passed)
VARIANTS = {
    "per_document": ("per_document", "tensor"),
    "head_tail_row": ("head_tail", "tensor"),
    "contiguous_row": ("contiguous", "tensor"),
    "head_tail_row_as_sharded": ("head_tail", "as_sharded"),
    "positions=int16": ("per_document", "int16"),
    "positions_short": ("per_document", "short"),
    "positions=list": ("per_document", "list"),
}


def shards_case(ctx: Ctx, variant: str) -> dict:
    """The door on this rank's tokens of :data:`VARIANTS` ``[variant]``, told their positions."""
    import dtensor_ring as dr

    W, rank = ctx.world, ctx.rank
    bounds = [0, *itertools.accumulate((4 * W, 2 * W, 6 * W))]
    T = bounds[-1]
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, H_KV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    held, how = VARIANTS[variant]
    idx = {
        "per_document": lambda: dr.varlen_token_indices(bounds, "zigzag", rank, W),
        "head_tail": lambda: dr.token_indices("zigzag", T, rank, W),
        "contiguous": lambda: dr.token_indices("ring", T, rank, W),
    }[held]()
    positions = {
        "tensor": idx,
        "as_sharded": idx,
        "int16": idx.to(torch.int16),
        "short": idx[:-1],
        "list": idx.tolist(),
    }[how]
    leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    layout, local_cu = "zigzag", oracle.local_cu_seqlens(bounds, W)
    if how == "as_sharded":  # the documents as the head-tail shards hold them
        layout = dr.documents_as_sharded(bounds, "zigzag", W)
        local_cu = dr.varlen_local_cu_seqlens(bounds, layout, rank, W)
    out = dr.ring_varlen_attention_func(
        layout, *leaves, local_cu, None, causal=True, group=ctx.group, positions=positions
    )
    (out * dout[idx]).sum().backward()
    visible = oracle.visible_varlen(bounds, causal=True)
    ref = oracle.strict_attention(q[None], k[None], v[None], visible, D**-0.5, dout[None])
    tol = oracle.tolerance(torch.float64)
    checks = {"out": Check(out.detach(), ref.out[0, idx], torch.float64, *tol)}
    for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
        checks[name] = Check(leaf.grad, getattr(ref, name)[0, idx], torch.float64, *tol)
    return checks


def shards_cases() -> list[Case]:
    """Every variant at every world size: exact on the door's own tokens (and at W = 1),
    else a clean error on every rank."""
    cases = []
    for variant, (held, how) in VARIANTS.items():
        for world in WORLDS:
            wrong = how not in ("tensor", "as_sharded") or (
                how == "tensor" and held != "per_document" and world > 1
            )
            expect = ERROR if wrong else CORRECT
            name = f"shards/ring_varlen_attention_func[zigzag]/W{world}/{variant}"
            cases.append(Case(name, "shards", world, shards_case, {"variant": variant}, expect))
    return cases
