"""Cases of placed documents (``dr.document_layout``) that the doors' generic families do not
build: a rank of whole documents whose every score of a document is -inf (SDPA's NaN rows),
by the ring and by the all-gather, whose one-kernel-call path must finish those rows as the
ring does (Note [Gathering what placed documents need])."""

from __future__ import annotations

import torch

from . import oracle
from .cases import CORRECT
from .doors import Ctx
from .oracle import Check
from .runner import Case


def minus_inf_rows_case(ctx: Ctx, algorithm: str) -> dict:
    """2W documents of 8 tokens (none cut: every rank holds whole ones), document 1's keys
    making each of its scores -inf; out against the strict fp64 reference (NaN there)."""
    import dtensor_ring as dr

    W, rank = ctx.world, ctx.rank
    bounds = [0, *range(8, 8 * 2 * W, 8), 16 * W]
    lay = dr.document_layout(bounds, W)
    assert not lay.split
    q = torch.ones(16 * W, 2, 4, dtype=torch.float64)
    k = torch.ones(16 * W, 1, 4, dtype=torch.float64)
    k[bounds[1] : bounds[2], :, 0] = float("-inf")
    v = torch.randn(16 * W, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (ql, cu), (kl, _), (vl, _) = (dr.shard_varlen(x, bounds, lay, rank, W) for x in (q, k, v))
    out = dr.ring_varlen_attention_func(
        lay, ql, kl, vl, cu, None, causal=True, group=ctx.group, algorithm=algorithm,
        backend="math",
    )  # fmt: skip
    ref = oracle.strict_attention(
        q[None], k[None], v[None], oracle.visible_varlen(bounds, True), 4**-0.5
    )
    want = ref.out[0, lay.indices[rank]]
    return {"out": Check(out, want, torch.float64, *oracle.tolerance(torch.float64))}


def placed_cases() -> list[Case]:
    """:func:`minus_inf_rows_case` at W = 2 and 3, the ring and the all-gather."""
    return [
        Case(
            f"documents/placed/W{world}/minus_inf_rows,{algorithm}",
            "documents",
            world,
            minus_inf_rows_case,
            {"algorithm": algorithm},
            CORRECT,
            {},
        )  # fmt: skip
        for world in (2, 3)
        for algorithm in ("ring", "all_gather")
    ]
