"""``layout="auto"``: ring, all-gather or Ulysses chosen per call by a cost model (Note
[Choosing ring, all-gather or Ulysses] in ``schedule/policy.py``).

1. One process: the cost model's choices where the answer is known (host-bound short
   sequences, GPU-bound long ones, constants that remove a resource), its candidates (Ulysses
   only when H % W == 0, no ring for non-causal windows), the layout each algorithm runs,
   the report (reason, log line), and ``choose_algorithm``'s argument errors.
2. Numerics on the session's gloo pool, W = 1..4, against the fp64 reference on the full
   sequence: ``ring_attention_func("auto")`` and ``ring_varlen_attention_func("auto")`` with
   each algorithm forced (``engine_spy.forced_algorithm``) and with the model's own choice;
   causal, non-causal and windowed, GQA, B = 2, sinks; out, lse, dq, dk, dv and dsinks.
3. Front doors that do not choose reject "auto" on every rank before communicating.
"""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch
import torch.distributed as dist
from engine_spy import engines_used, forced_algorithm
from reference import reference_attention, reference_attention_varlen

import dtensor_ring as dr
from dtensor_ring.algorithm import auto_choice, route
from dtensor_ring.resolve import Call

H200 = dict(heads=32, kv_heads=8, head_dim=128)

# --- one process ------------------------------------------------------------------------------


def test_auto_places_tokens_as_zigzag():
    from dtensor_ring.layouts import alias_algorithm

    assert dr.get_layout("auto").name == "auto"  # an alias: zigzag's tokens + "auto"
    assert alias_algorithm("auto") == "auto" and alias_algorithm("zigzag") is None
    for W in (1, 2, 3, 4):
        for r in range(W):
            assert torch.equal(
                dr.token_indices("auto", 8 * W, r, W), dr.token_indices("zigzag", 8 * W, r, W)
            )
        cu = torch.tensor([0, 2 * W, 8 * W], dtype=torch.int32)
        x = torch.randn(8 * W, 3)
        for r in range(W):
            got, cu_got = dr.shard_varlen(x, cu, "auto", r, W)
            want, cu_want = dr.shard_varlen(x, cu, "zigzag", r, W)
            assert torch.equal(got, want) and torch.equal(cu_got, cu_want)


@pytest.mark.parametrize("backward", [False, True])
def test_short_sequences_avoid_the_ring_long_ones_use_it(backward):
    """At the default (H200) constants: a host-bound ring (few tokens per rank on 8 ranks)
    loses to one gather; long sequences hide the ring's hops and it wins."""
    for tokens in (256, 1024, 2048):
        choice = dr.choose_algorithm(tokens * 8, 8, backward=backward, **H200)
        assert choice.algorithm != "ring", choice.reason
        assert choice.predicted_ms[choice.algorithm] < choice.predicted_ms["ring"]
    for tokens in (16384, 32768):
        choice = dr.choose_algorithm(tokens * 8, 8, backward=backward, **H200)
        assert choice.algorithm == "ring", choice.reason
        assert set(choice.predicted_ms) == {"ring", "all_gather", "ulysses"}


def test_constants_that_remove_a_cost_decide():
    """No host cost, an instant link and a kernel as fast on short blocks as on long ones:
    the ring's steps are pure GPU time, which every algorithm shares, and ties go to the
    ring; with the kernel faster on long blocks, Ulysses' one long kernel wins. A slow link at
    a GPU-bound size: the ring hides its hops, the others expose theirs; where even the
    ring's hops cannot hide, Ulysses, which moves the fewest bytes, wins."""
    free = dr.Machine(host_fwd_ms=0.0, host_bwd_ms=0.0, link_gbps=1e12, latency_ms=0.0)
    flat = free._replace(saturation_rows=1)
    infiniband, slow_link = dr.Machine(link_gbps=50.0), dr.Machine(link_gbps=5.0)
    for tokens, W in itertools.product((64, 2048, 16384), (2, 3, 8)):
        assert dr.choose_algorithm(tokens * W, W, machine=flat, **H200).algorithm == "ring"
    assert dr.choose_algorithm(2048 * 8, 8, machine=free, **H200).algorithm == "ulysses"
    assert flat.rate(64) == pytest.approx(flat.tflops) and free.rate(1300) < 0.64 * free.tflops
    choice = dr.choose_algorithm(32768 * 8, 8, machine=infiniband, **H200)
    assert choice.algorithm == "ring"
    assert min(choice.predicted_ms.values()) == choice.predicted_ms["ring"]
    assert choice.predicted_ms["ulysses"] > choice.predicted_ms["ring"] + 5.0
    assert dr.choose_algorithm(8192 * 8, 8, machine=slow_link, **H200).algorithm == "ulysses"


def test_set_machine_is_the_default():
    before = dr.get_machine()
    slow_host = dr.Machine(host_fwd_ms=5.0, host_bwd_ms=5.0)
    try:
        dr.set_machine(slow_host)
        assert dr.get_machine() == slow_host
        assert dr.choose_algorithm(65536, 8, **H200) == dr.choose_algorithm(
            65536, 8, machine=slow_host, **H200
        )
    finally:
        dr.set_machine(before)
    with pytest.raises(TypeError, match="dtensor_ring.Machine"):
        dr.set_machine({"tflops": 1.0})


@pytest.mark.parametrize(
    "causal, window, heads, expected",
    [
        (True, None, 32, {"ring", "all_gather", "ulysses"}),
        (True, None, 12, {"ring", "all_gather"}),  # 12 % 8: no Ulysses
        (False, None, 32, {"ring", "all_gather", "ulysses"}),
        (True, (100, 0), 32, {"ring", "all_gather", "ulysses"}),
        (False, (100, 100), 32, {"all_gather", "ulysses"}),  # zigzag's ring is causal
    ],
)
def test_candidates_and_layouts(causal, window, heads, expected):
    W = 8
    for algorithm in ("ring", "all_gather", "ulysses"):
        kwargs = dict(heads=heads, kv_heads=4, head_dim=64, causal=causal, window=window)
        if algorithm not in expected:
            with pytest.raises(ValueError, match="no candidate"):
                dr.choose_algorithm(1024 * W, W, candidates=(algorithm,), **kwargs)
            continue
        choice = dr.choose_algorithm(1024 * W, W, candidates=(algorithm,), **kwargs)
        assert choice.algorithm == algorithm
        ring_layout = "zigzag" if causal or window is not None else "ring"
        assert (
            choice.layout
            == {
                "ring": ring_layout,
                "all_gather": "llama3_zigzag",
                "ulysses": "zigzag",
            }[algorithm]
        )
        assert (choice.heads_k_stride > 0) == (algorithm == "all_gather")
        assert 4 % max(choice.heads_k_stride, 1) == 0
    all_of_them = dr.choose_algorithm(1024 * W, W, **kwargs)
    assert set(all_of_them.predicted_ms) == expected
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        dr.choose_algorithm(1024 * W, W, candidates=("tree",), **kwargs)


def test_choice_is_reported(caplog):
    """Each new choice is logged once; grad mode and ``requires_grad`` (facts one rank may
    have alone) do not change it; an inference door (``backward=False``) prices a forward."""
    q = torch.randn(1, 64, 4, 8, requires_grad=True)
    k = torch.randn(1, 64, 2, 8)
    call = Call(q, k, k, "g", 4, "auto", causal=True)
    with caplog.at_level(logging.INFO, logger="dtensor_ring.policy"):
        first = route(call, None, door="t")
        again = route(call, None, door="t")
        with torch.no_grad():
            no_grad = route(call.replace(q=q.detach()), None, door="t")
        route(call, None, door="t", backward=False)
    assert first == again == no_grad
    lines = [r.getMessage() for r in caplog.records if r.name == "dtensor_ring.policy"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"algorithm='auto' chose {first.algorithm}: ")
    assert "forward+backward" in lines[0] and "forward+backward" not in lines[1]


def test_candidates_follow_the_kernels():
    """A candidate whose kernel cannot run the call is not chosen (the all-gather needs a
    varlen kernel; cpu_flash has none), and the length is checked for "auto" itself."""
    q, k = torch.randn(1, 64, 4, 8), torch.randn(1, 64, 2, 8)
    call = Call(q, k, k, "g", 4, "auto", causal=True)
    assert set(auto_choice(call).predicted_ms) == {"ring", "all_gather", "ulysses"}
    assert set(auto_choice(call.replace(backend="cpu_flash")).predicted_ms) == {
        "ring",
        "ulysses",
    }
    with pytest.raises(ValueError, match="holds 2 chunks per rank"):
        auto_choice(call.replace(q=q[:, :3], k=k[:, :3], v=k[:, :3]))
    with pytest.raises(ValueError, match="backend"):
        auto_choice(call.replace(backend="no_such_kernel"))


# --- numerics on the pool ---------------------------------------------------------------------

# (algorithm (None: the model's own), api, causal, window, (B, H, H_kv), sinks, dtype)
CASES = [
    ("ring", "dense", True, (-1, -1), (2, 4, 2), False, torch.float64),
    ("ring", "dense", False, (-1, -1), (1, 4, 4), True, torch.float64),
    ("ring", "dense", True, (3, 0), (1, 4, 2), False, torch.float32),
    ("all_gather", "dense", True, (-1, -1), (2, 4, 2), True, torch.float64),
    ("all_gather", "dense", False, (2, 5), (1, 4, 2), False, torch.float64),
    ("ulysses", "dense", True, (-1, -1), (2, 12, 6), True, torch.float64),
    ("ulysses", "dense", False, (3, 2), (1, 12, 4), False, torch.float32),
    (None, "dense", True, (-1, -1), (1, 12, 4), False, torch.float64),
    ("ring", "varlen", True, (-1, -1), (1, 4, 2), False, torch.float64),
    ("ring", "varlen", False, (-1, -1), (1, 4, 2), True, torch.float64),
    ("all_gather", "varlen", True, (2, 0), (1, 4, 2), True, torch.float64),
    (None, "varlen", True, (-1, -1), (1, 4, 4), False, torch.float64),
]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
ENGINE = {"ring": "ring", "all_gather": "llama3", "ulysses": "ulysses"}


def _zigzag(lengths: list[int], rank: int, W: int) -> list[int]:
    out, start = [], 0
    for n in lengths:
        c = n // (2 * W)
        out += [*range(start + rank * c, start + (rank + 1) * c)]
        out += [*range(start + (2 * W - 1 - rank) * c, start + (2 * W - rank) * c)]
        start += n
    return out


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(
        actual.double(), expected.detach(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}"
    )


def check_cases(group: dist.ProcessGroup) -> list[str]:
    """Worker body: every case of :data:`CASES` against the fp64 reference; returns the
    engine each case ran."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    ran = []
    for n, (algorithm, api, causal, window, (B, H, H_kv), with_sinks, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(n)
        tol = TOL[dtype]
        lengths = [4 * W, 2 * W] if api == "varlen" else [6 * W]
        shape = (sum(lengths),) if api == "varlen" else (B, lengths[0])
        q, k, v = (
            torch.randn(*shape, h, 8, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv)
        )
        dout = torch.randn(*shape, H, 8, generator=gen, dtype=torch.float64)
        sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        full_sinks = None if sinks is None else sinks.clone().requires_grad_()
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        if api == "varlen":
            out_ref, lse_ref = reference_attention_varlen(
                *full, cu, causal=causal, window_size=window, sinks=full_sinks
            )
        else:
            out_ref, lse_ref = reference_attention(
                *full, causal=causal, window_size=window, sinks=full_sinks
            )
        inputs = [*full] + ([] if full_sinks is None else [full_sinks])
        grads = torch.autograd.grad(out_ref, inputs, dout)
        idx = torch.tensor(_zigzag(lengths, rank, W))
        local_sinks = None if sinks is None else sinks.to(dtype).requires_grad_()
        args = dict(
            causal=causal,
            window_size=window,
            group=group,
            return_attn_probs=True,
            sinks=local_sinks,
        )
        with forced_algorithm(algorithm), engines_used() as used:
            if api == "varlen":
                local = [dr.shard_varlen(x.to(dtype), cu, "auto", rank, W) for x in (q, k, v)]
                leaves = [x.requires_grad_() for x, _ in local]
                out, lse, _ = dr.ring_varlen_attention_func(
                    "auto", *leaves, local[0][1], None, **args
                )
                out_want, lse_want, at = out_ref[idx], lse_ref[:, idx], (idx,)
            else:
                leaves = [
                    dr.shard_local(x.to(dtype), "auto", rank, W).requires_grad_() for x in (q, k, v)
                ]
                out, lse, _ = dr.ring_attention_func("auto", *leaves, **args)
                out_want, lse_want, at = out_ref[:, idx], lse_ref[:, :, idx], (slice(None), idx)
            out.backward(dout[at].to(dtype))
        _close(f"case {n} out", out, out_want, tol)
        _close(f"case {n} lse", lse, lse_want, tol)
        for name, leaf, g in zip("qkv", leaves, grads, strict=False):
            _close(f"case {n} d{name}", leaf.grad, g[at], tol)
        if sinks is not None:  # each rank's share; the sum over the group is the gradient
            dsinks = local_sinks.grad.double()
            dist.all_reduce(dsinks, group=group)
            _close(f"case {n} dsinks", dsinks, grads[3], tol)
        assert len(used) == 1, used
        if algorithm is not None:
            assert used == {ENGINE[algorithm]}, (n, algorithm, used)
        ran.append(used.pop())
    return ran


@pytest.mark.parametrize(
    "world_size", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))]
)
def test_against_reference(dist_pool, world_size):
    results = dist_pool.run(check_cases, world_size)
    assert all(r == results[0] for r in results)  # every rank ran the same algorithms


# --- doors that do not choose -----------------------------------------------------------------


def _rejects(group: dist.ProcessGroup, door: str) -> str:
    x = torch.randn(1, 8, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        if door == "ulysses":
            dr.ulysses_flash_attn_func(x, x, x, causal=True, group=group, layout="auto")
        else:
            dr.api.varlen.llama3_attention_func(
                *(torch.randn(4, 2, 8),) * 3,
                *(torch.tensor([0, 4], dtype=torch.int32),) * 2,
                None,
                None,
                1,
                slice(0, 4),
                group=group,
                layout="auto",
            )
    return str(info.value)


@pytest.mark.parametrize("door", ["ulysses", "llama3_stream"])
def test_doors_that_do_not_choose_reject_auto(dist_pool, door):
    for message in dist_pool.run(_rejects, 2, timeout_s=60, door=door):
        assert re.search(r"layout='auto'|'auto'", message), message


# --- torch.compile ----------------------------------------------------------------------------


def _compiled(group: dist.ProcessGroup) -> list[float]:
    """``ring_attention_func("auto")`` under ``torch.compile(fullgraph=True)`` (aot_eager) with
    each algorithm forced: the choice is a trace-time constant (no graph break), and forward
    and gradients equal eager's."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    errors = []
    for algorithm in ("ring", "all_gather", "ulysses"):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8 * W, h, 8, generator=gen) for h in (4, 2, 2))
        local = [dr.shard_local(x, "auto", rank, W) for x in (q, k, v)]

        def attend(q, k, v):
            return dr.ring_attention_func("auto", q, k, v, causal=True, group=group)

        with forced_algorithm(algorithm), engines_used() as used:
            eager_in = [x.clone().requires_grad_() for x in local]
            eager = attend(*eager_in)
            eager.sum().backward()
            compiled_in = [x.clone().requires_grad_() for x in local]
            out = torch.compile(attend, fullgraph=True, backend="aot_eager")(*compiled_in)
            out.sum().backward()
        assert used == {ENGINE[algorithm]}, (algorithm, used)
        diffs = [(out - eager).abs().max()]
        diffs += [(a.grad - b.grad).abs().max() for a, b in zip(compiled_in, eager_in, strict=True)]
        errors.append(max(d.item() for d in diffs))
    return errors


@pytest.mark.slow
def test_compiles_fullgraph(dist_pool):
    for errors in dist_pool.run(_compiled, 2, timeout_s=300):
        assert max(errors) < 1e-6, errors


# --- DTensors ---------------------------------------------------------------------------------


def _dtensor_forced(group: dist.ProcessGroup) -> dict[str, float]:
    """SDPA on zigzag-sharded DTensors with ``layout="auto"``, in the ``ring_sdpa`` scope and
    through ``scaled_dot_product_ring_attention``, with each algorithm forced: out, dq, dk, dv
    against the fp64 reference (the scope's forward and backward handlers choose separately:
    every algorithm's backward is exact given the global out and lse)."""
    import torch.nn.functional as F
    from test_dtensor import _local_err, _mesh, _reference, _sdpa_inputs

    mesh, rank, W = _mesh(group), dist.get_rank(group), dist.get_world_size(group)
    errors = {}
    for algorithm in ("ring", "all_gather", "ulysses"):
        for door in ("scope", "function"):
            q, k, v, dout, leaves, dout_dt = _sdpa_inputs(mesh, "auto", H=6, H_kv=3)
            ref, grads = _reference(q, k, v, dout, causal=True)
            with forced_algorithm(algorithm), engines_used() as used:
                if door == "scope":
                    with dr.ring_sdpa(layout="auto"):
                        out = F.scaled_dot_product_attention(
                            *leaves, is_causal=True, enable_gqa=True
                        )
                        out.backward(dout_dt)
                else:
                    out = dr.scaled_dot_product_ring_attention(
                        *leaves, is_causal=True, enable_gqa=True, layout="auto"
                    )
                    out.backward(dout_dt)
            assert (
                used == {"ring": {"ring"}, "all_gather": {"llama3"}, "ulysses": set()}[algorithm]
            ), (algorithm, door, used)
            errs = [_local_err(out, ref, "auto", rank, W)]
            errs += [
                _local_err(t.grad, g, "auto", rank, W) for t, g in zip(leaves, grads, strict=True)
            ]
            errors[f"{algorithm} {door}"] = max(errs)
    return errors


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dtensor_sdpa_forced(dist_pool, world_size):
    for errors in dist_pool.run(_dtensor_forced, world_size):
        for name, err in errors.items():
            assert err < 1e-10, (name, err)
