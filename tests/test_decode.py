"""``decode_attention_func``: one decoding step over a KV cache sharded across the ranks
(Note [Decoding over a sharded KV cache (pass-Q)]) against fp64 attention over the whole
cache, world sizes 1-4, uneven and empty shards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dtensor_ring as dr
from tests.reference import reference_attention

B, H, H_KV, D, S = 2, 4, 2, 8, 11


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, S, H_KV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _shard_bounds(world: int) -> list[int]:
    """Uneven contiguous shards of the S cached tokens; the last rank's is empty from W = 3."""
    return {1: [0, S], 2: [0, 5, S], 3: [0, 5, S, S], 4: [0, 5, 8, S, S]}[world]


def run_decode(group, backend: str, dtype: torch.dtype, scale: float | None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = _data()
    lo, hi = _shard_bounds(world)[rank : rank + 2]
    k_loc, v_loc = k[:, lo:hi], v[:, lo:hi]
    out, lse, _ = dr.decode_attention_func(
        q.to(dtype),
        k_loc.to(dtype),
        v_loc.to(dtype),
        softmax_scale=scale,
        return_attn_probs=True,
        group=group,
        backend=backend,
    )
    return out.double(), lse.double(), hi - lo


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "backend, dtype, scale",
    [
        ("math", torch.float64, None),
        ("cpu_flash", torch.float64, 0.5),
        ("cpu_flash", torch.float32, -0.2),
    ],
)
def test_decode_matches_attention_over_the_whole_cache(
    dist_pool, world_size, backend, dtype, scale
):
    q, k, v = _data()
    want_out, want_lse = reference_attention(q, k, v, causal=False, scale=scale)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    results = dist_pool.run(run_decode, world_size, backend=backend, dtype=dtype, scale=scale)
    if world_size >= 3:
        assert results[-1][2] == 0  # an empty shard takes part with weight 0
    for out, lse, _ in results:
        torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


def run_errors(group) -> dict[str, str]:
    q, k, v = _data()
    cases = {
        "two queries": lambda: dr.decode_attention_func(q.expand(B, 2, H, D), k, v, group=group),
        "heads": lambda: dr.decode_attention_func(q[:, :, :3], k, v, group=group),
        "batch": lambda: dr.decode_attention_func(q[:1], k, v, group=group),
        "scale": lambda: dr.decode_attention_func(q, k, v, softmax_scale=math.nan, group=group),
        "k/v": lambda: dr.decode_attention_func(q, k, v[:, :3], group=group),
    }
    results = {}
    for name, call in cases.items():
        try:
            call()
            results[name] = "no error"
        except ValueError as e:
            results[name] = str(e)
    return results


def test_decode_rejects_bad_inputs(dist_pool):
    for results in dist_pool.run(run_errors, 2):
        assert results["two queries"].startswith("q must be [B, 1, H, D]")
        assert "multiple of key/value heads" in results["heads"]
        assert "must agree on batch and head dim" in results["batch"]
        assert "softmax_scale=nan must be finite" in results["scale"]
        assert results["k/v"].startswith("k and v shapes differ")


def run_disagreement(group) -> str:
    """Ranks pass different query shapes: with the consistency mode on, every rank raises."""
    from dtensor_ring import set_consistency_checks

    q, k, v = _data()
    if dist.get_rank(group) == 1:
        q = q[:, :, :2]
    set_consistency_checks(True)
    try:
        dr.decode_attention_func(q, k, v, group=group, backend="math")
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        set_consistency_checks(None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_decode_disagreement_raises_on_every_rank(dist_pool, world_size):
    for message in dist_pool.run(run_disagreement, world_size):
        assert message.startswith("ranks disagree on q shape"), message


def run_compiled(group) -> float:
    q, k, v = _data()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = _shard_bounds(world)[rank : rank + 2]

    def step(q, k, v):
        return dr.decode_attention_func(q, k, v, group=group, backend="math") * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, k[:, lo:hi], v[:, lo:hi])
    return float((got - step(q, k[:, lo:hi], v[:, lo:hi])).abs().max())


def test_decode_compiles_fullgraph(dist_pool):
    assert all(err == 0.0 for err in dist_pool.run(run_compiled, 2))
