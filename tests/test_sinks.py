"""Attention sinks (Note [Attention sinks]): every functional front door against the fp64
reference with the sink column, forward and backward (the sinks' gradient summed over the
ranks is the whole sequence's), world sizes 1-4, layouts, windows, GQA, varlen and llama3,
Ulysses and hybrid; each rank's gradient is its rows' share, through every kind of door;
non-finite sinks; bad ``sinks`` arguments."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from engine_spy import forced_algorithm
from test_ulysses import _hybrid_groups, hybrid_groups

import dtensor_ring as dr
from tests.reference import (
    layout_indices,
    random_qkv,
    reference_attention,
    reference_attention_varlen,
)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _sinks(H: int, seed: int = 3) -> torch.Tensor:
    """Sink logits of every magnitude: one far below the scores, one dominating them."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    sinks[0], sinks[-1] = -30.0, 4.0
    return sinks


def _compare(got: dict, want: dict, tol: float) -> None:
    for name, expected in want.items():
        torch.testing.assert_close(
            got[name].double(),
            expected.detach(),
            rtol=tol,
            atol=tol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def _sum_over(group, x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def check_dense(group, door, layout, causal, window, H, H_kv, dtype, backend, B=2, D=8):
    """Dense doors: ``ring`` (the ring-flash-attention function of ``layout``), ``ulysses``."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    S = 4 * W
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=11)
    dout = random_qkv(B, S, H, H, D, seed=12)[0]
    sinks = _sinks(H)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out_ref, lse_ref = reference_attention(
        *full[:3], causal=causal, window_size=window, sinks=full[3]
    )
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    idx = layout_indices(layout, rank, W, S)
    local = [x[:, idx].to(dtype).requires_grad_() for x in (q, k, v)]
    local_sinks = sinks.to(dtype).requires_grad_()
    kwargs = dict(causal=causal, window_size=window, return_attn_probs=True, group=group)
    if door == "ring":
        fn = {
            "ring": dr.ring_flash_attn_func,
            "zigzag": dr.zigzag_ring_flash_attn_func,
            "stripe": dr.stripe_flash_attn_func,
        }[layout]
        out, lse, _ = fn(*local, **kwargs, backend=backend, sinks=local_sinks)
    else:
        out, lse, _ = dr.ulysses_flash_attn_func(
            *local, **kwargs, layout=layout, backend=backend, sinks=local_sinks
        )
    out.backward(dout[:, idx].to(dtype))
    got = {"out": out, "lse": lse, **{n: x.grad for n, x in zip("qkv", local, strict=True)}}
    got["sinks"] = _sum_over(group, local_sinks.grad)
    want = {"out": out_ref[:, idx], "lse": lse_ref[:, :, idx]}
    want.update({n: g[:, idx] for n, g in zip("qkv", grads_ref[:3], strict=True)})
    want["sinks"] = grads_ref[3]
    _compare(got, want, TOL[dtype])


DENSE = [
    # (world_size, door, layout, causal, window, H, H_kv, dtype, backend)
    (1, "ring", "ring", True, (-1, -1), 4, 2, torch.float64, "math"),
    (2, "ring", "zigzag", True, (-1, -1), 4, 2, torch.float64, "math"),
    (3, "ring", "stripe", True, (-1, -1), 3, 1, torch.float64, "cpu_flash"),
    (3, "ring", "ring", False, (-1, -1), 4, 4, torch.float64, "math"),
    (4, "ring", "zigzag", True, (5, 0), 4, 2, torch.float64, "math"),
    (4, "ring", "ring", False, (3, 2), 4, 1, torch.float32, "cpu_flash"),
    (2, "ring", "stripe", True, (-1, -1), 4, 2, torch.float32, "cpu_flash"),
    (1, "ulysses", "ring", True, (-1, -1), 4, 2, torch.float64, "math"),
    (2, "ulysses", "zigzag", True, (-1, -1), 4, 2, torch.float64, "math"),
    (3, "ulysses", "ring", False, (2, 3), 6, 3, torch.float64, "cpu_flash"),
    (4, "ulysses", "stripe", True, (-1, -1), 8, 2, torch.float32, "cpu_flash"),
]


@pytest.mark.parametrize(
    "world_size, door, layout, causal, window, H, H_kv, dtype, backend",
    DENSE,
    ids=[f"w{c[0]}-{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}-{c[4]}-{c[7]}" for c in DENSE],
)
def test_dense(dist_pool, world_size, door, layout, causal, window, H, H_kv, dtype, backend):
    dist_pool.run(
        check_dense,
        world_size,
        door=door,
        layout=layout,
        causal=causal,
        window=window,
        H=H,
        H_kv=H_kv,
        dtype=dtype,
        backend=backend,
    )


def check_varlen(group, layout, causal, window, dtype):
    """Packed documents: ring / zigzag varlen and llama3 (all-gather)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    H, H_kv, D = 4, 2, 8
    unit = 2 * W if layout == "zigzag" else W
    lengths = [3 * unit, unit, 2 * unit] if layout != "llama3" else [5, 2 * W + 1, 4 * W - 6 + W]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (
        torch.randn(T, h, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv, H)
    )
    sinks = _sinks(H)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out_ref, lse_ref = reference_attention_varlen(
        *full[:3], cu, causal=causal, window_size=window, sinks=full[3]
    )
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    idx = dr.varlen_token_indices(cu, layout, rank, W)
    local = [x[idx].to(dtype).requires_grad_() for x in (q, k, v)]
    local_sinks = sinks.to(dtype).requires_grad_()
    kwargs = dict(causal=causal, window_size=window, return_attn_probs=True, group=group)
    if layout == "llama3":
        cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal, rank, W
        )
        out, lse, _ = dr.llama3_flash_attn_varlen_func(
            *local, cu_q, cu_k, max_q, max_k, 1, k_slice, **kwargs, sinks=local_sinks
        )
    else:
        fn = {
            "ring": dr.ring_flash_attn_varlen_func,
            "zigzag": dr.zigzag_ring_flash_attn_varlen_func,
        }
        cu_local = dr.varlen_local_cu_seqlens(cu, layout, rank, W)
        out, lse, _ = fn[layout](*local, cu_local, None, **kwargs, sinks=local_sinks)
    out.backward(dout[idx].to(dtype))
    got = {"out": out, "lse": lse, **{n: x.grad for n, x in zip("qkv", local, strict=True)}}
    got["sinks"] = _sum_over(group, local_sinks.grad)
    want = {"out": out_ref[idx], "lse": lse_ref[:, idx]}
    want.update({n: g[idx] for n, g in zip("qkv", grads_ref[:3], strict=True)})
    want["sinks"] = grads_ref[3]
    _compare(got, want, TOL[dtype])


VARLEN = [
    # (world_size, layout, causal, window, dtype)
    (1, "ring", True, (-1, -1), torch.float64),
    (2, "zigzag", True, (-1, -1), torch.float64),
    (3, "ring", False, (-1, -1), torch.float32),
    (4, "zigzag", True, (3, 0), torch.float64),
    (2, "llama3", True, (-1, -1), torch.float64),
    (3, "llama3", True, (4, 0), torch.float64),
    (4, "llama3", False, (-1, -1), torch.float32),
]


@pytest.mark.parametrize("world_size, layout, causal, window, dtype", VARLEN)
def test_varlen(dist_pool, world_size, layout, causal, window, dtype):
    dist_pool.run(
        check_varlen, world_size, layout=layout, causal=causal, window=window, dtype=dtype
    )


def check_hybrid(group, layout):
    """2 x 2 grid: Ulysses groups {0, 1}, {2, 3}; ring groups {0, 2}, {1, 3}."""
    ulysses_group, ring_group = _hybrid_groups()
    u, r = dist.get_rank(ulysses_group), dist.get_rank(ring_group)
    B, H, H_kv, D, S = 1, 4, 2, 8, 16
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=21)
    dout = random_qkv(B, S, H, H, D, seed=22)[0]
    sinks = _sinks(H)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out_ref, _ = reference_attention(*full[:3], causal=True, sinks=full[3])
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    idx = layout_indices(layout, r, 2, S).view(2, -1)[u]
    local = [x[:, idx].clone().requires_grad_() for x in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    out = dr.hybrid_flash_attn_func(
        *local,
        causal=True,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        layout=layout,
        sinks=local_sinks,
    )
    out.backward(dout[:, idx])
    got = {"out": out, **{n: x.grad for n, x in zip("qkv", local, strict=True)}}
    got["sinks"] = _sum_over(group, local_sinks.grad)
    want = {"out": out_ref[:, idx]}
    want.update({n: g[:, idx] for n, g in zip("qkv", grads_ref[:3], strict=True)})
    want["sinks"] = grads_ref[3]
    _compare(got, want, TOL[torch.float64])


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_hybrid(dist_pool, layout):
    dist_pool.run(check_hybrid, 4, layout=layout)


def check_non_finite(group, backend):
    """-inf sinks are no sinks; +inf and NaN sinks make their heads' rows NaN, other heads
    untouched. (A +inf logit is a NaN row in our kernels, as in gpt-oss's eager softmax,
    ``exp(inf - inf)``; the reference's logsumexp would give 0 there, so it is not asked.)"""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, D = 1, 4 * W, 4, 8
    q, k, v = random_qkv(B, S, H, H, D, seed=1)
    idx = layout_indices("zigzag", rank, W, S)
    local = [x[:, idx] for x in (q, k, v)]
    sinks = torch.tensor([-math.inf, math.inf, math.nan, 0.5], dtype=torch.float64)
    out_ref, _ = reference_attention(q, k, v, causal=True, sinks=sinks)
    plain, _ = reference_attention(q, k, v, causal=True)
    out = dr.zigzag_ring_flash_attn_func(*local, causal=True, group=group, sinks=sinks)
    torch.testing.assert_close(out[:, :, 0], plain[:, idx, 0])
    assert out[:, :, 1:3].isnan().all()
    torch.testing.assert_close(out[:, :, 3], out_ref[:, idx, 3])


@pytest.mark.parametrize("world_size", [1, 3])
def test_non_finite_sinks(dist_pool, world_size):
    dist_pool.run(check_non_finite, world_size, backend="math")


def check_bad_sinks(group) -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    q, k, v = random_qkv(1, 4 * dist.get_world_size(group), 4, 2, 8)
    mesh = DeviceMesh.from_group(group, "cpu")
    cases = {
        "shape": torch.zeros(3, dtype=torch.float64),
        "2-D": torch.zeros(1, 4, dtype=torch.float64),
        "dtype": torch.zeros(4, dtype=torch.int64),
        "type": [0.0] * 4,
        "DTensor": distribute_tensor(torch.zeros(4, dtype=torch.float64), mesh, [Replicate()]),
    }
    messages = {}
    for name, sinks in cases.items():
        with pytest.raises((ValueError, TypeError)) as info:
            dr.ring_flash_attn_func(q, k, v, causal=True, group=group, sinks=sinks)
        messages[name] = str(info.value)
    return messages


def test_bad_sinks_raise_on_every_rank(dist_pool):
    results = dist_pool.run(check_bad_sinks, 2)
    assert results[0] == results[1]
    assert "sinks must be [H] = [4]" in results[0]["shape"]
    assert "sinks must be [H] = [4]" in results[0]["2-D"]
    assert "floating-point" in results[0]["dtype"]
    assert "sinks must be a tensor" in results[0]["type"]
    assert "sinks is a DTensor but q is a plain tensor" in results[0]["DTensor"]


def check_compile(group) -> None:
    """fullgraph compile of a call with sinks, ring and Ulysses (Note [Sinks on head shards]):
    same results as eager, gradients included."""
    W = dist.get_world_size(group)
    q, k, v = random_qkv(1, 4 * W, 4, 2, 8, dtype=torch.float32)
    sinks = _sinks(4).float()

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        out = fn(*leaves)
        out.sum().backward()
        return out, [x.grad for x in leaves]

    for fn in (dr.zigzag_ring_flash_attn_func, dr.ulysses_flash_attn_func):

        def call(q, k, v, s, fn=fn):
            return fn(q, k, v, causal=True, group=group, sinks=s)

        eager = run(call)
        compiled = run(torch.compile(call, fullgraph=True, backend="aot_eager"))
        torch.testing.assert_close(compiled[0], eager[0])
        for a, b in zip(compiled[1], eager[1], strict=True):
            torch.testing.assert_close(a, b)


def test_compile_fullgraph(dist_pool):
    dist_pool.run(check_compile, 2)


def check_dtensor(group, layout, mode, as_dtensor, mesh_2d):
    """``scaled_dot_product_ring_attention(..., sinks=)`` on sequence-sharded DTensors: a plain
    sinks tensor's gradient is the rank's share (summed over all ranks: the whole), a
    replicated DTensor's is Partial (its full tensor: the whole)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if mesh_2d:  # the pool's 4 ranks
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    else:
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    B, H, H_kv, D, S = 2, 4, 2, 8, 4 * mesh.size(mesh.ndim - 1)
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=31)
    dout = random_qkv(B, S, H, H, D, seed=32)[0]
    sinks = _sinks(H)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out_ref, _ = reference_attention(*full[:3], causal=True, sinks=full[3])
    grads_ref = torch.autograd.grad(out_ref, full, dout)

    rows = slice(mesh.get_local_rank("dp"), None, 2) if mesh_2d else slice(None)

    def dt(t):  # on the 2-D mesh each dp rank holds one batch row
        return dr.shard_sequence(
            t[rows].transpose(1, 2),
            mesh,
            seq_dim=2,
            layout=layout,
            mesh_dim="cp",
            batch_dim=0 if mesh_2d else None,
        )

    leaves = [dt(t).detach().requires_grad_() for t in (q, k, v)]
    if as_dtensor:
        sinks_in = distribute_tensor(sinks, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    else:
        sinks_in = sinks.clone().requires_grad_()
    out = dr.scaled_dot_product_ring_attention(
        *leaves, is_causal=True, enable_gqa=True, layout=layout, mode=mode, sinks=sinks_in
    )
    out.backward(dt(dout))
    unshard = lambda x: dr.unshard_sequence(x, seq_dim=2, layout=layout).transpose(1, 2)  # noqa: E731
    got = {"out": unshard(out), **{n: unshard(x.grad) for n, x in zip("qkv", leaves, strict=True)}}
    got["sinks"] = sinks_in.grad.full_tensor() if as_dtensor else _sum_over(group, sinks_in.grad)
    want = {"out": out_ref, **dict(zip("qkv", grads_ref[:3], strict=True))}
    want["sinks"] = grads_ref[3]
    _compare(got, want, TOL[torch.float64])


DTENSOR = [
    # (world_size, layout, mode, as_dtensor, mesh_2d)
    (1, "ring", "ring", False, False),
    (2, "zigzag", "ring", False, False),
    (3, "ring", "ring", True, False),
    (4, "stripe", "ulysses", False, False),
    (4, "zigzag", "ring", False, True),
    (4, "ring", "ring", True, True),
]


@pytest.mark.parametrize("world_size, layout, mode, as_dtensor, mesh_2d", DTENSOR)
def test_dtensor(dist_pool, world_size, layout, mode, as_dtensor, mesh_2d):
    dist_pool.run(
        check_dtensor,
        world_size,
        layout=layout,
        mode=mode,
        as_dtensor=as_dtensor,
        mesh_2d=mesh_2d,
    )


# --- each rank's share ----------------------------------------------------------------------


def check_rows_share(group) -> dict[str, float]:
    """Each rank's sinks gradient against the fp64 reference's gradient through that rank's
    rows alone (docs/api.md, Attention sinks), for every kind of door: ring, all-gather,
    Ulysses, ``layout="auto"`` with each algorithm forced and with its own choice, hybrid,
    SDPA on DTensors (ring, all-gather, Ulysses, auto forced), packed documents (ring,
    all-gather, auto forced, llama3's stream). Returns the max error per door."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, H, H_kv, D, S = 2, 12, 6, 8, 4 * W
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=41)
    dout = random_qkv(B, S, H, H, D, seed=42)[0]
    sinks = _sinks(H).requires_grad_()
    out_ref, _ = reference_attention(q, k, v, causal=True, sinks=sinks)
    errors = {}

    def compare(name, out, leaf, ref, dout_full, rows, out_grad=None):
        """Backward of ``out`` with its rows' ``dout`` (or ``out_grad``); the error of
        ``leaf.grad`` against the reference's sinks gradient through ``ref[rows]`` alone."""
        out.backward(dout_full[rows] if out_grad is None else out_grad)
        want = torch.autograd.grad(ref[rows], sinks, dout_full[rows], retain_graph=True)[0]
        errors[name] = float((leaf.grad - want).abs().max())

    def leaf():
        return sinks.detach().clone().requires_grad_()

    rows = (slice(None), layout_indices("zigzag", rank, W, S))
    flash = {
        "ring": dr.zigzag_ring_flash_attn_func,
        "all_gather": dr.llama3_zigzag_flash_attn_func,
        "ulysses": functools.partial(dr.ulysses_flash_attn_func, layout="zigzag"),
    }
    for algorithm in ("ring", "all_gather", "ulysses", None):
        flash[f"auto:{algorithm or 'chosen'}"] = functools.partial(_forced_auto, algorithm)
    for name, fn in flash.items():
        s = leaf()
        out = fn(*(x[rows] for x in (q, k, v)), causal=True, group=group, sinks=s)
        compare(name, out, s, out_ref, dout, rows)

    ulysses_group, ring_group = hybrid_groups(group)
    U, R = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    u, r = dist.get_rank(ulysses_group), dist.get_rank(ring_group)
    hybrid_rows = (slice(None), dr.hybrid_token_indices("zigzag", S, r, R, u, U))
    s = leaf()
    out = dr.hybrid_flash_attn_func(
        *(x[hybrid_rows] for x in (q, k, v)),
        causal=True,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        layout="zigzag",
        sinks=s,
    )
    compare("hybrid", out, s, out_ref, dout, hybrid_rows)

    mesh = DeviceMesh.from_group(group, "cpu")
    for layout, mode, algorithm in (
        ("zigzag", "ring", None),
        ("llama3_zigzag", "ring", None),
        ("zigzag", "ulysses", None),
        ("auto", "ring", "ring"),
        ("auto", "ring", "all_gather"),
        ("auto", "ring", "ulysses"),
    ):

        def dt(x, layout=layout):
            return dr.shard_sequence(x.transpose(1, 2), mesh, seq_dim=2, layout=layout)

        s = leaf()
        with forced_algorithm(algorithm):
            out = dr.scaled_dot_product_ring_attention(
                *(dt(x).requires_grad_() for x in (q, k, v)),
                is_causal=True,
                enable_gqa=True,
                layout=layout,
                mode=mode,
                sinks=s,
            )
        compare(f"sdpa[{layout}:{algorithm or mode}]", out, s, out_ref, dout, rows, dt(dout))

    cu = torch.tensor([0, 4 * W, 6 * W, 8 * W], dtype=torch.int32)
    gen = torch.Generator().manual_seed(43)
    qv, kv, vv, dout_v = (
        torch.randn(8 * W, h, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv, H)
    )
    out_v, _ = reference_attention_varlen(qv, kv, vv, cu, causal=True, sinks=sinks)
    varlen = {
        "varlen:ring": (dr.zigzag_ring_flash_attn_varlen_func, "zigzag", None),
        "varlen:all_gather": (dr.llama3_zigzag_flash_attn_varlen_func, "llama3_zigzag", None),
        "varlen:auto:ring": (_auto_varlen, "auto", "ring"),
        "varlen:auto:all_gather": (_auto_varlen, "auto", "all_gather"),
    }
    for name, (fn, layout, algorithm) in varlen.items():
        parts = [dr.shard_varlen(x, cu, layout, rank, W) for x in (qv, kv, vv)]
        s = leaf()
        with forced_algorithm(algorithm):
            out = fn(*(x for x, _ in parts), parts[0][1], None, causal=True, group=group, sinks=s)
        compare(name, out, s, out_v, dout_v, dr.varlen_token_indices(cu, layout, rank, W))
    stream = slice(8 * rank, 8 * (rank + 1))
    s = leaf()
    cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
    out = dr.llama3_flash_attn_varlen_func(
        *(x[stream] for x in (qv, kv, vv)),
        cu_q,
        cu_k,
        max_q,
        max_k,
        1,
        k_slice,
        causal=True,
        group=group,
        sinks=s,
    )
    compare("varlen:llama3", out, s, out_v, dout_v, stream)
    return errors


def _forced_auto(algorithm, *args, **kwargs):
    """``ring_attention_func("auto", ...)`` made to choose ``algorithm`` (None: its own)."""
    with forced_algorithm(algorithm):
        return dr.ring_attention_func("auto", *args, **kwargs)


def _auto_varlen(*args, **kwargs):
    return dr.ring_varlen_attention_func("auto", *args, **kwargs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_gets_its_rows_share(dist_pool, world_size):
    for rank, errors in enumerate(dist_pool.run(check_rows_share, world_size)):
        assert len(errors) == 19, sorted(errors)
        bad = {name: err for name, err in errors.items() if not err < 1e-10}
        assert not bad, (rank, bad)
