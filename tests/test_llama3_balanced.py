"""Balanced all-gather attention: the "llama3_zigzag" layout (Note [Balanced all-gather
attention] in ``engine/llama3.py``).

Every rank holds pieces r and 2W-1-r of every document (a dense row is one document) and
all-gathers K/V. Tiers:

1. One process: the layout in the registry and the sharding helpers (against zigzag's token
   lists), the blocks of a rank (one kernel call per head group when the masks agree, every
   query row once), the planned balance.
2. Numerics on the session's gloo pool, W = 1..4, against the fp64 reference on the full
   sequence (out, lse, dq, dk, dv): varlen and dense, causal / non-causal / windowed, MHA and
   GQA, ``heads_k_stride`` 1 and > 1, fp64 and fp32. One pool call per world size runs all
   its cases.
3. Bad inputs raise ``ValueError`` on every rank before any communication.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention, reference_attention_varlen

import dtensor_ring as dr
from dtensor_ring.api.functional import ring_attention_func
from dtensor_ring.api.varlen import ring_varlen_attention_func
from dtensor_ring.schedule.llama3 import gather_meta
from dtensor_ring.schedule.plan import make_plan

LAYOUT = "llama3_zigzag"
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def zigzag_indices(lengths: list[int], rank: int, world_size: int) -> list[int]:
    """Global tokens of ``rank``: pieces r and 2W-1-r of every document, written out."""
    W, out, start = world_size, [], 0
    for n in lengths:
        c = n // (2 * W)
        out += range(start + rank * c, start + (rank + 1) * c)
        out += range(start + (2 * W - 1 - rank) * c, start + (2 * W - rank) * c)
        start += n
    return out


def cumulative(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


# --- one process ------------------------------------------------------------------------------


def test_registered_everywhere():
    from dtensor_ring.layouts import alias_algorithm, home_layout

    lay = dr.get_layout(LAYOUT)  # an alias: zigzag's tokens + the all-gather
    assert alias_algorithm(LAYOUT) == "all_gather" and home_layout(lay) == "zigzag"
    assert lay.dense and lay.varlen == "documents"
    assert LAYOUT in dr.LAYOUTS and LAYOUT in dr.VARLEN_LAYOUTS
    for W in (1, 2, 3, 4):
        S = 4 * W
        parts = [dr.token_indices(LAYOUT, S, r, W) for r in range(W)]
        for r, idx in enumerate(parts):
            assert idx.tolist() == zigzag_indices([S], r, W)
        full = torch.randn(2, S, 3)
        shards = [dr.shard_local(full, LAYOUT, r, W) for r in range(W)]
        assert torch.equal(dr.unshard_local(shards, LAYOUT), full)
        lengths = [2 * W, 6 * W, 4 * W]
        cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
        x = torch.randn(int(cu[-1]), 2)
        local = [dr.shard_varlen(x, cu, LAYOUT, r, W) for r in range(W)]
        for r, (part, cu_local) in enumerate(local):
            assert torch.equal(part, x[zigzag_indices(lengths, r, W)])
            assert cu_local.tolist() == [c // W for c in cumulative(lengths)]
        assert torch.equal(dr.unshard_varlen([p for p, _ in local], cu, LAYOUT), x)


@pytest.mark.parametrize(
    "causal, window, calls",
    [(True, None, 1), (False, None, 1), (True, (3, 0), 1), (False, (2, 5), None)],
)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_blocks_cover_each_query_once(world_size, causal, window, calls):
    """A rank's blocks: every local query in exactly one block, each seeing exactly the keys
    its mask allows (checked pair by pair against global positions); causal and unwindowed
    calls are one kernel call (one block) per head group."""
    W = world_size
    lengths = [2 * W, 6 * W, 4 * W]
    bounds = cumulative(lengths)
    local = [b // W for b in bounds]
    cu = torch.tensor(local, dtype=torch.int32)
    doc_start = {t: s for s, e in zip(bounds[:-1], bounds[1:], strict=True) for t in range(s, e)}
    for rank in range(W):
        m = gather_meta(cu, None, local[-1], LAYOUT, causal, rank, W, torch.device("cpu"), window)
        if calls is not None:
            assert len(m.blocks) == calls
        q_global = zigzag_indices(lengths, rank, W)
        seen = torch.zeros(local[-1], bounds[-1], dtype=torch.int64)
        covered = torch.zeros(local[-1], dtype=torch.int64)
        for blk in m.blocks:
            assert blk.init and not blk.causal
            left, right = blk.window if blk.window else (-1, -1)
            for (q0, q1), (k0, k1) in zip(blk.q.spans, blk.kv.spans, strict=True):
                covered[q0:q1] += 1
                i = torch.arange(q1 - q0)[:, None]
                j = torch.arange(k1 - k0)[None, :]
                d = j - i - ((k1 - k0) - (q1 - q0))  # bottom-right aligned
                keep = torch.ones_like(d, dtype=torch.bool)
                if left >= 0:
                    keep &= d >= -left
                if right >= 0:
                    keep &= d <= right
                seen[q0:q1, k0:k1] += keep.long()
        assert torch.equal(covered, torch.ones_like(covered))
        qg = torch.tensor(q_global)[:, None]
        kg = torch.arange(bounds[-1])[None, :]
        same = torch.tensor([doc_start[t] for t in q_global])[:, None] == torch.tensor(
            [doc_start[t] for t in range(bounds[-1])]
        )
        visible = same.clone()
        if causal:
            visible &= kg <= qg
        if window is not None:
            visible &= kg >= qg - window[0]
            if not causal:
                visible &= kg <= qg + window[1]
        assert torch.equal(seen, visible.long()), rank


def test_planned_balance():
    """Causal work per rank is the same on every rank: dense (the plan's FLOPs) and for any
    documents divisible by 2W (``varlen_balance``), where the stream layout is not."""
    W = 8
    plan = make_plan(LAYOUT, W, True)
    assert plan.imbalance(8192) == 1.0
    assert make_plan("ring", W, True).imbalance(8192) > 1.87  # the stream layout's dense rows
    report = dr.varlen_balance([0, 3104 * W, 6304 * W, 7904 * W, 8064 * W, 8192 * W], W)
    assert report[LAYOUT] == report["zigzag"]
    assert max(report[LAYOUT]) == min(report[LAYOUT])
    assert max(report["llama3"]) / (sum(report["llama3"]) / W) > 1.5
    full = dr.varlen_balance([0, 16, 48], 4, causal=False)
    assert LAYOUT in full and "zigzag" not in full  # any mask


# --- numerics on the pool ---------------------------------------------------------------------

# (api, causal, window, (H, H_kv, heads_k_stride), dtype, document lengths in units of 2W)
CASES = [
    ("varlen", True, (-1, -1), (4, 2, 1), torch.float64, [3, 1, 2]),
    ("varlen", False, (-1, -1), (4, 4, 2), torch.float64, [1, 4]),
    ("varlen", True, (3, 0), (4, 2, 2), torch.float64, [2, 1, 3]),
    ("varlen", False, (2, 5), (4, 2, 1), torch.float64, [3, 2]),
    ("varlen", True, (-1, -1), (2, 1, 1), torch.float32, [1, 1, 1, 2]),
    ("varlen_generic", True, (-1, -1), (4, 4, 4), torch.float64, [2, 2]),
    ("dense", True, (-1, -1), (4, 2, 2), torch.float64, [2, 2]),
    ("dense", False, (-1, -1), (4, 4, 1), torch.float64, [1, 1]),
    ("dense", True, (2, 0), (4, 2, 1), torch.float64, [3, 3]),
    ("dense_generic", True, (-1, -1), (4, 2, 1), torch.float32, [2, 2]),
    ("dense_generic", False, (3, 1), (2, 1, 1), torch.float64, [2, 2]),
]


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(
        actual.double(), expected.detach(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}"
    )


def check_cases(group: dist.ProcessGroup) -> int:
    """Worker body: every case of :data:`CASES` on this rank against the fp64 reference."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    for n_case, (api, causal, window, (H, H_kv, stride), dtype, units) in enumerate(CASES):
        gen = torch.Generator().manual_seed(n_case)
        tol = TOL[dtype]
        if api.startswith("dense"):  # B rows of S tokens; the reference per row
            B, S = len(units), units[0] * 2 * W
            q, k, v = (
                torch.randn(B, S, h, 8, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv)
            )
            dout = torch.randn(B, S, H, 8, generator=gen, dtype=torch.float64)
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            out_ref, lse_ref = reference_attention(*full, causal=causal, window_size=window)
            grads = torch.autograd.grad(out_ref, full, dout)
            idx = torch.tensor(zigzag_indices([S], rank, W))
            leaves = [
                dr.shard_local(x.to(dtype), LAYOUT, rank, W).requires_grad_() for x in (q, k, v)
            ]
            args = dict(causal=causal, window_size=window, group=group, return_attn_probs=True)
            if api == "dense":
                out, lse, _ = dr.llama3_zigzag_flash_attn_func(*leaves, stride, **args)
            else:
                out, lse, _ = ring_attention_func(LAYOUT, *leaves, **args)
            assert out.shape == (B, len(idx), H, 8) and lse.shape == (B, H, len(idx))
            _compare(f"{api} out", out, out_ref[:, idx], tol)
            _compare(f"{api} lse", lse, lse_ref[:, :, idx], tol)
            out.backward(dout[:, idx].to(dtype))
            for leaf, g in zip(leaves, grads, strict=True):
                assert leaf.grad.dtype == dtype
                _compare(f"{api} grad", leaf.grad, g[:, idx], tol)
            continue
        lengths = [u * 2 * W for u in units]
        cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
        T = int(cu[-1])
        q, k, v = (
            torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv)
        )
        dout = torch.randn(T, H, 8, generator=gen, dtype=torch.float64)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out_ref, lse_ref = reference_attention_varlen(*full, cu, causal=causal, window_size=window)
        grads = torch.autograd.grad(out_ref, full, dout)
        idx = torch.tensor(zigzag_indices(lengths, rank, W))
        local = [dr.shard_varlen(x.to(dtype), cu, LAYOUT, rank, W) for x in (q, k, v)]
        leaves = [x.requires_grad_() for x, _ in local]
        cu_local = local[0][1]
        args = dict(causal=causal, window_size=window, group=group, return_attn_probs=True)
        if api == "varlen":
            out, lse, _ = dr.llama3_zigzag_flash_attn_varlen_func(
                *leaves, cu_local, max(lengths) // W, stride, **args
            )
        else:
            out, lse, _ = ring_varlen_attention_func(LAYOUT, *leaves, cu_local, None, **args)
        _compare(f"{api} out", out, out_ref[idx], tol)
        _compare(f"{api} lse", lse, lse_ref[:, idx], tol)
        out.backward(dout[idx].to(dtype))
        for leaf, g in zip(leaves, grads, strict=True):
            _compare(f"{api} grad", leaf.grad, g[idx], tol)
    return len(CASES)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_against_reference(dist_pool, world_size):
    assert dist_pool.run(check_cases, world_size) == [len(CASES)] * world_size


# --- bad inputs -------------------------------------------------------------------------------


def _varlen(g, lengths_local=(4, 2), stride=1, max_seqlen=None, **kwargs):
    T = sum(lengths_local)
    x = torch.randn(T, 4, 8, dtype=torch.float64)
    kv = x[:, :2]
    cu = torch.tensor(cumulative(list(lengths_local)), dtype=torch.int32)
    return dr.llama3_zigzag_flash_attn_varlen_func(
        x, kv, kv, cu, max_seqlen, stride, group=g, **kwargs
    )


def _dense(g, S_local=4, **kwargs):
    x = torch.randn(2, S_local, 4, 8, dtype=torch.float64)
    return ring_attention_func(LAYOUT, x, x, x, group=g, **kwargs)


BAD_CALLS = {
    "odd_document": (
        lambda g: _varlen(g, (4, 3), causal=True),
        r"document 1 has 3 tokens.*multiple of 2 \* world_size",
    ),
    "odd_dense_length": (
        lambda g: _dense(g, 3, causal=True),
        r"layout='llama3_zigzag' holds 2 chunks per rank.*S_local=3",
    ),
    "stride": (lambda g: _varlen(g, stride=3), r"heads_k_stride=3.*H_kv=2"),
    "max_seqlen": (lambda g: _varlen(g, max_seqlen=2), r"max_seqlen=2 is smaller.*4"),
    "cu_not_to_T": (
        lambda g: dr.llama3_zigzag_flash_attn_varlen_func(
            *(torch.randn(6, 2, 8),) * 3, torch.tensor([0, 4], dtype=torch.int32), None, group=g
        ),
        r"cu_seqlens must end at the number of tokens 6",
    ),
    "stream_front_door": (
        lambda g: dr.api.varlen.llama3_attention_func(
            *(torch.randn(4, 2, 8),) * 3,
            *(torch.tensor([0, 4], dtype=torch.int32),) * 2,
            None,
            None,
            1,
            slice(0, 4),
            group=g,
            layout=LAYOUT,
        ),
        r"layout='llama3_zigzag' shards every document",
    ),
    "dense_3d": (
        lambda g: dr.llama3_zigzag_flash_attn_func(*(torch.randn(4, 2, 8),) * 3, group=g),
        r"q must be 4-D",
    ),
}


def check_bad_call(group: dist.ProcessGroup, name: str) -> str:
    with pytest.raises(ValueError) as info:
        BAD_CALLS[name][0](group)
    return str(info.value)


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_on_every_rank(dist_pool, name):
    messages = dist_pool.run(check_bad_call, 2, timeout_s=60, name=name)
    for message in messages:
        assert re.search(BAD_CALLS[name][1], message, re.S), message
