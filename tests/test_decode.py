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


# --- the functional core: prefill into a sharded cache, then decoding steps ---------------

#: (label, layout, prompt tokens, total tokens, attention window w or None, cache keeps only
#: the window, sinks): the prompt's longest prefix the layout divides is prefilled, the rest of
#: the prompt and the later tokens are decoding steps.
CORE_CASES = [
    ("zigzag", "zigzag", 13, 18, None, False, False),
    ("zigzag_window_evict_sinks", "zigzag", 13, 18, 4, True, True),
    ("ring_window_sinks", "ring", 9, 14, 3, False, True),
    ("short_prompt", "zigzag", 2, 7, 3, True, False),  # no prefill at all from W = 2
]


def run_core(group) -> dict[str, tuple[float, int]]:
    """Every CORE_CASES case: ``(max error vs the fp64 reference over all the tokens, how
    often this rank had no visible key, an empty shard, in a decoding step)``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    results = {}
    for label, layout, prompt, total, w, evict, with_sinks in CORE_CASES:
        gen = torch.Generator().manual_seed(len(label))
        q = torch.randn(B, total, H, D, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(B, total, H_KV, D, generator=gen, dtype=torch.float64) for _ in "kv")
        sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
        window = (-1, -1) if w is None else (w - 1, 0)
        want, _ = reference_attention(q, k, v, causal=True, window_size=window, sinks=sinks)
        cache = dr.KVCacheShard(group, sliding_window=w if evict else None)
        P = dr.split_prompt(prompt, layout, world)
        err, empty = 0.0, 0
        if P:
            part = [dr.shard_local(t[:, :P], layout, rank, world) for t in (q, k, v)]
            out = dr.prefill_attention(*part, cache, layout, window_size=window, sinks=sinks)
            ref = dr.shard_local(want[:, :P], layout, rank, world)
            err = float((out - ref).abs().max())
        for t in range(P, total):
            out = dr.decode_step_attention(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                cache,
                window_size=window,
                sinks=sinks,
                backend="math",
            )
            err = max(err, float((out - want[:, t : t + 1]).abs().max()))
            assert cache.seq_length == t + 1
            assert bool((cache.positions % world == rank)[cache.positions >= P].all())
            empty += int(cache.positions.numel() == 0)
            if evict:  # only the window's keys are kept
                assert bool((cache.positions > t - w).all())
        results[label] = (err, empty)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_prefill_then_decode_matches_attention_over_the_sequence(dist_pool, world_size):
    """Prefill (zigzag / ring ring attention) + decoding steps (K/V kept round robin) vs fp64
    causal attention over all the tokens: windows (with and without dropping the keys the
    window has passed), sinks, GQA, prompts the layout does not divide, empty shards."""
    results = dist_pool.run(run_core, world_size)
    for per_rank in results:
        for label, (err, _) in per_rank.items():
            assert err < 1e-12, (label, err)
    if world_size >= 2:  # the window leaves whole shards behind: some rank runs no kernel
        assert any(r["zigzag_window_evict_sinks"][1] > 0 for r in results)


def run_core_errors(group) -> dict[str, str]:
    q, k, v = _data()
    pos = torch.arange(S)
    calls = {
        "window without positions": lambda: dr.decode_attention_func(
            q, k, v, group=group, window_size=(3, 0)
        ),
        "positions without query position": lambda: dr.decode_attention_func(
            q, k, v, group=group, cache_positions=pos
        ),
        "positions shape": lambda: dr.decode_attention_func(
            q, k, v, group=group, cache_positions=pos[:3], query_position=S
        ),
        "sinks shape": lambda: dr.decode_attention_func(q, k, v, group=group, sinks=q[0, 0, 0]),
        "wider window than the cache keeps": lambda: dr.decode_step_attention(
            q, k[:, :1], v[:, :1], dr.KVCacheShard(group, sliding_window=2), window_size=(4, 0)
        ),
        "two new tokens": lambda: dr.decode_step_attention(
            q, k[:, :2], v[:, :2], dr.KVCacheShard(group)
        ),
    }
    results = {}
    for name, call in calls.items():
        try:
            call()
            results[name] = "no error"
        except (ValueError, TypeError) as e:
            results[name] = str(e)
    return results


def test_core_rejects_bad_inputs(dist_pool):
    for results in dist_pool.run(run_core_errors, 2):
        assert "needs cache_positions" in results["window without positions"]
        assert "together" in results["positions without query position"]
        assert "cache_positions must be int64 [S_local]" in results["positions shape"]
        assert "sinks must be [H]" in results["sinks shape"]
        assert "sees further back" in results["wider window than the cache keeps"]
        assert "[B, 1, H_kv, D]" in results["two new tokens"]


def run_compiled_window_sinks(group) -> float:
    """The decode op with positions, a window and sinks under torch.compile(fullgraph=True);
    positions and query position change between calls."""
    q, k, v = _data()
    sinks = torch.linspace(-1.0, 1.0, H, dtype=torch.float64)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = _shard_bounds(world)[rank : rank + 2]

    def step(q, k, v, positions, query_position):
        return dr.decode_attention_func(
            q,
            k,
            v,
            group=group,
            backend="math",
            window_size=(4, 0),
            cache_positions=positions,
            query_position=query_position,
            sinks=sinks,
        )

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    err = 0.0
    for shift in (0, 3):
        args = (q, k[:, lo:hi], v[:, lo:hi], torch.arange(lo, hi) + shift, S - 1 + shift)
        err = max(err, float((compiled(*args) - step(*args)).abs().max()))
    return err


def test_decode_window_sinks_compiles_fullgraph(dist_pool):
    assert all(err == 0.0 for err in dist_pool.run(run_compiled_window_sinks, 2))
