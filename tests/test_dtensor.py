"""DTensor front door: SDPA on sequence-sharded DTensors, our op on DTensors, shard/unshard.

Tiers, cheapest first (all on the session's gloo worker pool, ``dist_pool``):

1. The private API we rely on still has the known form (``_dtensor_compat``), and
   ``ring_sdpa`` installs exactly its handlers and mode and removes them on exit.
2. Numerics against the fp64 reference (``reference.py``) for every layout on 1..4 ranks,
   forward and backward, through each way in: ``F.scaled_dot_product_attention`` inside
   ``ring_sdpa``, the fused CPU aten op called directly, ``scaled_dot_product_ring_attention``,
   and ``dtensor_ring::ring_attention`` on DTensors; 2-D meshes (batch-sharded or replicated
   second dim).
3. The CUDA aten-op handlers, called directly with CPU DTensors in each CUDA op's argument
   order (bound by schema), forward and the backward autograd would call.
4. Placement and argument errors: ``ValueError`` on every rank, before any communication.
5. ``shard_sequence`` / ``unshard_sequence`` round trips and the permuted global view.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_spy import engines_used
from modes import PassThroughMode
from reference import random_qkv, reference_attention, shard
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring
from dtensor_ring._compat import dtensor as _dtensor_compat
from dtensor_ring.api.dtensor import (
    ATEN_SDPA_OPS,
    SDPAConfig,
    aten_sdpa_backward_handler,
    aten_sdpa_forward_handler,
)

LAYOUTS = ("ring", "zigzag", "stripe", "llama3_zigzag", "auto")
#: The engine ring-mode SDPA on DTensors runs: llama3_zigzag all-gathers K/V (Note [All-gather
#: layouts on DTensors]); the others pass them around the ring.
ENGINE = {"llama3_zigzag": {"llama3"}}


def _check_engines(layout: str, mode: str, used: set[str], name: str = "") -> None:
    """The engines a call ran: ring mode the layout's (``ENGINE``), Ulysses none of the ring
    or all-gather engines; "auto" the cost model's choice, any of them (tests/test_policy.py
    forces each)."""
    if layout == "auto":
        assert used <= {"ring", "llama3"}, (name, used)
        return
    assert used == (ENGINE.get(layout, {"ring"}) if mode == "ring" else set()), (name, used)


def _token_order(layout: str) -> str:
    """The layout whose tokens ``reference.shard`` (written out independently) gives:
    llama3_zigzag and auto hold zigzag's (tests/test_llama3_balanced.py and
    tests/test_policy.py check that they agree)."""
    return "zigzag" if layout in ("llama3_zigzag", "auto") else layout


aten = torch.ops.aten
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _mesh(group) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _sdpa_inputs(
    mesh,
    layout,
    *,
    B=2,
    S_local=4,
    H=4,
    H_kv=4,
    D=8,
    dtype=torch.float64,
    seed=0,
    mesh_dim=None,
    batch_dim=None,
):
    """Full BSHD tensors, their reference (out, grads for a fixed dout) and DTensor leaves.

    DTensor leaves are ``[B, H, S, D]`` (SDPA layout), sharded with ``shard_sequence``.
    """
    cp_dim = 0 if mesh_dim is None else mesh.mesh_dim_names.index(mesh_dim)
    W = mesh.size(cp_dim)
    S = S_local * W
    q, k, v = random_qkv(B, S, H, H_kv, D, dtype=dtype, seed=seed)
    dout = random_qkv(B, S, H, H, D, dtype=dtype, seed=seed + 1)[0]
    return (
        q,
        k,
        v,
        dout,
        [
            dtensor_ring.shard_sequence(
                t.transpose(1, 2),
                mesh,
                seq_dim=2,
                layout=layout,
                mesh_dim=mesh_dim,
                batch_dim=batch_dim,
            )
            .detach()
            .requires_grad_()
            for t in (q, k, v)
        ],
        dtensor_ring.shard_sequence(
            dout.transpose(1, 2),
            mesh,
            seq_dim=2,
            layout=layout,
            mesh_dim=mesh_dim,
            batch_dim=batch_dim,
        ),
    )


def _reference(q, k, v, dout, causal, window_size=(-1, -1)):
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*leaves, causal=causal, window_size=window_size)
    out.backward(dout.to(torch.float64))
    return out, [t.grad for t in leaves]


def _local_err(dt: DTensor, full_BSHD: torch.Tensor, layout, rank, world, batch=None) -> float:
    """Max |local shard of ``dt`` - the reference's shard| (reference sharded independently)."""
    expected = shard(full_BSHD.transpose(1, 2), _token_order(layout), rank, world, seq_dim=2)
    if batch is not None:
        expected = expected[batch]
    return (dt.to_local().to(torch.float64) - expected).abs().max().item()


# --------------------------------------------------------------------------------------------
# 1. Private API and the scope
# --------------------------------------------------------------------------------------------
def _handler_table_is_used(group):
    """An installed handler for an aten op is what DTensor's dispatcher calls."""
    mesh = _mesh(group)
    x = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    seen = []

    def handler(op, args, kwargs):
        seen.append(op)
        return args[0]

    with _dtensor_compat.custom_op_handlers({aten.sin.default: handler}):
        y = torch.sin(x)
    after = torch.sin(x)
    return seen == [aten.sin.default], y is x, torch.equal(after.to_local(), torch.ones(4).sin())


def test_private_handler_table_has_known_form(dist_pool):
    # If this fails, PyTorch changed DTensor._op_dispatcher._custom_op_handlers: update
    # dtensor_ring/_compat/dtensor.py (ring_sdpa cannot work without it).
    assert _dtensor_compat.HAS_OP_HANDLER_TABLE, torch.__version__
    schema_names = {
        a.name
        for f in ATEN_SDPA_OPS
        for op in (f.forward_op, f.backward_op)
        for a in op._schema.arguments
    }
    assert {"query", "key", "value", "is_causal", "scale", "logsumexp"} <= schema_names
    assert dist_pool.run(_handler_table_is_used, 1) == [(True, True, True)]


def _mode_stack_len() -> int:
    return torch._C._len_torch_function_stack()


def _scope_state():
    return dict(_dtensor_compat.current_handlers()), _mode_stack_len()


def _sdpa_outside_scope(q):
    """What PyTorch does with SDPA on a sequence-sharded DTensor on CPU (no ring attention)."""
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except Exception as e:  # noqa: BLE001 - we compare the behaviour, whatever it is
        return type(e).__name__
    return "ok"


def _scope_install_and_remove(group):
    mesh = _mesh(group)
    q = distribute_tensor(torch.randn(1, 2, 8, 4), mesh, [Shard(2)])
    before, before_outside = _scope_state(), _sdpa_outside_scope(q)
    fwd_ops = {f.forward_op for f in ATEN_SDPA_OPS} | {f.backward_op for f in ATEN_SDPA_OPS}
    checks = {}
    with dtensor_ring.ring_sdpa(layout="zigzag"):
        handlers, depth = _scope_state()
        checks["handlers installed"] = fwd_ops <= set(handlers) and not fwd_ops & set(before[0])
        checks["mode pushed"] = depth == before[1] + 1
        checks["inside works"] = isinstance(
            F.scaled_dot_product_attention(q, q, q, is_causal=True), DTensor
        )
        with dtensor_ring.ring_sdpa(layout="ring", mode="ulysses"):
            checks["nested"] = _mode_stack_len() == before[1] + 2
            checks["nested ulysses works"] = isinstance(
                F.scaled_dot_product_attention(q, q, q, is_causal=True), DTensor
            )
        checks["nested restored"] = _scope_state() == (handlers, depth)
    checks["removed"] = _scope_state() == before
    try:
        with dtensor_ring.ring_sdpa(layout="stripe"):
            raise KeyError("body failed")
    except KeyError:
        pass
    checks["removed after raise"] = _scope_state() == before
    checks["PyTorch behaviour untouched"] = _sdpa_outside_scope(q) == before_outside
    return checks


def test_ring_sdpa_scope_is_removed_on_exit(dist_pool):
    checks = dist_pool.run(_scope_install_and_remove, 2)
    for rank_checks in checks:
        assert all(rank_checks.values()), rank_checks


def _backward_outside_scope(group) -> dict[str, str]:
    """The backward of SDPA run in a scope: inside one of the same configuration it works;
    after leaving it, or inside a scope of another layout, it raises ValueError."""
    mesh = _mesh(group)
    results = {}
    for where in ("inside", "outside", "other scope"):
        q = distribute_tensor(torch.randn(1, 2, 8, 4), mesh, [Shard(2)]).requires_grad_()
        with dtensor_ring.ring_sdpa(layout="zigzag"):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            if where == "inside":
                out.sum().backward()
        try:
            if where == "outside":
                out.sum().backward()
            elif where == "other scope":
                with dtensor_ring.ring_sdpa(layout="ring"):
                    out.sum().backward()
            results[where] = "ok"
        except ValueError as e:
            results[where] = str(e)
    return results


def test_backward_outside_the_scope_raises(dist_pool):
    for results in dist_pool.run(_backward_outside_scope, 2):
        assert results["inside"] == "ok"
        for where in ("outside", "other scope"):
            assert results[where].startswith("the backward of SDPA on DTensors ran outside")
            assert "layout='zigzag'" in results[where]


# --------------------------------------------------------------------------------------------
# 2. Numerics
# --------------------------------------------------------------------------------------------
def _sdpa_numerics(group, layout):
    """Every way into ring attention on DTensors, against the fp64 reference.

    Each ``call(q, k, v, dout, causal, scale)`` runs forward and backward and returns ``out``.
    """
    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    errors = {}

    def run(name, call, *, causal=True, H_kv=4, dtype=torch.float64, scale=None):
        q, k, v, dout, leaves, dout_dt = _sdpa_inputs(mesh, layout, H_kv=H_kv, dtype=dtype)
        # reference with the scale folded into q: softmax((s q) k^T) at the default scale
        factor = 1.0 if scale is None else scale * q.shape[-1] ** 0.5
        ref, (dq, dk, dv) = _reference(q * factor, k, v, dout, causal)
        with engines_used() as used:
            out = call(*leaves, dout_dt, causal, scale)
        if call is op:  # the ring op itself, whatever the layout
            assert used == {"ring"}, (name, used)
        else:
            _check_engines(layout, "ring", used, name)
        assert isinstance(out, DTensor) and out.placements == leaves[0].placements, out
        errs = [_local_err(out, ref, layout, rank, W)]
        errs += [
            _local_err(t.grad, g, layout, rank, W)
            for t, g in zip(leaves, (dq * factor, dk, dv), strict=True)
        ]
        errors[name] = (max(errs), TOL[dtype])

    def sdpa(q, k, v, dout, causal, scale):
        with dtensor_ring.ring_sdpa(layout=layout):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
            out.backward(dout)
        return out

    def sdpa_keywords(q, k, v, dout, causal, scale):
        with dtensor_ring.ring_sdpa(layout=layout):
            out = F.scaled_dot_product_attention(
                query=q, key=k, value=v, is_causal=causal, scale=scale
            )
            out.backward(dout)
        return out

    def sdpa_handlers(q, k, v, dout, causal, scale):
        """The handler route (Note [Eager SDPA on DTensors]): a Python mode is active."""
        with PassThroughMode():
            return sdpa(q, k, v, dout, causal, scale)

    def aten_cpu(q, k, v, dout, causal, scale):
        with dtensor_ring.ring_sdpa(layout=layout):
            out = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale
            )[0]
            out.backward(dout)
        return out

    def direct(q, k, v, dout, causal, scale):
        out = dtensor_ring.scaled_dot_product_ring_attention(
            q,
            k,
            v,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            layout=layout,
        )
        out.backward(dout)
        return out

    def op(q, k, v, dout, causal, scale):
        group_name = q.device_mesh.get_group(0).group_name
        out, lse = torch.ops.dtensor_ring.ring_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            group_name,
            layout,
            causal,
            q.shape[-1] ** -0.5 if scale is None else scale,
            "cpu_flash",
        )
        B, H, S, _ = q.shape
        assert lse.placements == (Shard(2),) and lse.shape == (B, H, S), lse
        out = out.transpose(1, 2)
        out.backward(dout)
        return out

    run("sdpa", sdpa)
    run("sdpa_gqa", sdpa, H_kv=2)
    run("sdpa_mqa_fp32", sdpa, H_kv=1, dtype=torch.float32)
    run("sdpa_scale", sdpa, scale=0.3)
    run("sdpa_keywords", sdpa_keywords)
    run("sdpa_handlers", sdpa_handlers, H_kv=2)
    run("aten_cpu", aten_cpu, H_kv=2)
    run("direct", direct, H_kv=2)
    run("op_on_dtensors", op, H_kv=2)
    if layout in ("ring", "llama3_zigzag"):
        run("sdpa_noncausal", sdpa, causal=False)
        run("direct_noncausal", direct, causal=False, H_kv=1)
    if layout == "ring":
        run("op_noncausal", op, causal=False)
    return errors


def _three_routes(group, layout, algorithm, autocast=False):
    """SDPA on DTensors in a scope by each route (Note [Eager SDPA on DTensors]): the eager
    route; the handler route (a Python mode is active); and a call sent to the handlers for
    which SDPA finds no fused kernel (only MATH enabled), which runs the eager route; all
    under ``torch.autocast`` (CPU, bf16) if ``autocast``. Whether the other two routes' out
    and gradients equal the eager route's, how often the eager route ran, and out's dtypes."""
    from dtensor_ring.api.dtensor import scope

    mesh = _mesh(group)
    results, eager_calls = [], []
    eager_sdpa = scope.eager_sdpa
    scope.eager_sdpa = lambda *a: eager_calls.append(1) or eager_sdpa(*a)
    for mode, backends in (
        (contextlib.nullcontext, None),
        (PassThroughMode, None),
        (PassThroughMode, [SDPBackend.MATH]),
    ):
        _, _, _, _, leaves, dout_dt = _sdpa_inputs(mesh, layout, H_kv=2, dtype=torch.float32)
        with (
            dtensor_ring.ring_sdpa(layout=layout, algorithm=algorithm),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            mode(),
            sdpa_kernel(backends) if backends else contextlib.nullcontext(),
        ):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(dout_dt.to(out.dtype))
        dts = (out, *(x.grad for x in leaves))
        meta = [(t.shape, t.stride(), t.placements) for t in dts]  # _compat.wrap_local's
        results.append(([t.to_local() for t in dts], meta))
    scope.eager_sdpa = eager_sdpa
    (eager, eager_meta), *others = results
    same = [
        meta == eager_meta and all(torch.equal(a, b) for a, b in zip(eager, got, strict=True))
        for got, meta in others
    ]
    return same, len(eager_calls), [got[0].dtype for got, _ in results]


@pytest.mark.parametrize("world_size", [1, 2])
def test_eager_route_under_autocast(dist_pool, world_size):
    """The eager route starts before the dispatcher's autocast layer, so it applies SDPA's
    autocast policy itself (the first version computed in fp32 there)."""
    for result in dist_pool.run(
        _three_routes, world_size, layout="zigzag", algorithm=None, autocast=True
    ):
        assert result == ([True, True], 2, [torch.bfloat16] * 3), result


@pytest.mark.parametrize("world_size", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "layout, algorithm", [("zigzag", "ring"), ("zigzag", "all_gather"), ("ring", "ulysses")]
)
def test_sdpa_routes_agree_bit_for_bit(dist_pool, layout, algorithm, world_size):
    """Note [Eager SDPA on DTensors]: every route runs the same engine calls."""
    if algorithm == "ulysses" and world_size == 3:
        world_size = 2  # H = 4 heads: Ulysses needs W | H
    for same, eager_calls, dtypes in dist_pool.run(
        _three_routes, world_size, layout=layout, algorithm=algorithm
    ):
        assert same == [True, True] and eager_calls == 2, (same, eager_calls)
        assert dtypes == [torch.float32] * 3, dtypes


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_numerics(dist_pool, layout, world_size):
    for rank, errors in enumerate(dist_pool.run(_sdpa_numerics, world_size, layout=layout)):
        for name, (err, tol) in errors.items():
            assert err < tol, f"rank {rank} {name}: max error {err:.3g} >= {tol}"


def _sdpa_ulysses_numerics(group, layout):
    """``mode="ulysses"``: SDPA in the scope, the aten op, and the scope-free function."""
    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    errors = {}

    def run(name, call, *, causal=True, H_kv=4, dtype=torch.float64):
        q, k, v, dout, leaves, dout_dt = _sdpa_inputs(mesh, layout, H_kv=H_kv, dtype=dtype)
        ref, grads = _reference(q, k, v, dout, causal)
        out = call(*leaves, dout_dt, causal)
        assert isinstance(out, DTensor) and out.placements == leaves[0].placements, out
        errs = [_local_err(out, ref, layout, rank, W)]
        errs += [_local_err(t.grad, g, layout, rank, W) for t, g in zip(leaves, grads, strict=True)]
        errors[name] = (max(errs), TOL[dtype])

    def sdpa(q, k, v, dout, causal):
        with dtensor_ring.ring_sdpa(layout=layout, mode="ulysses"):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
            )
            out.backward(dout)
        return out

    def aten_cpu(q, k, v, dout, causal):
        with dtensor_ring.ring_sdpa(layout=layout, mode="ulysses"):
            out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[0]
            out.backward(dout)
        return out

    def direct(q, k, v, dout, causal):
        out = dtensor_ring.scaled_dot_product_ring_attention(
            q,
            k,
            v,
            is_causal=causal,
            enable_gqa=q.shape[1] != k.shape[1],
            layout=layout,
            mode="ulysses",
        )
        out.backward(dout)
        return out

    run("sdpa", sdpa, causal=layout != "ring")
    run("sdpa_gqa", sdpa, causal=layout != "ring", H_kv=2)
    run("sdpa_mqa_fp32", sdpa, H_kv=1, dtype=torch.float32)
    run("sdpa_noncausal", sdpa, causal=False, H_kv=2)
    run("aten_cpu", aten_cpu, H_kv=2)
    run("direct", direct, causal=layout != "ring", H_kv=2)
    return errors


def _sdpa_window_numerics(group, layout, mode):
    """Sliding windows on DTensors: ``ring_sdpa(window_size=...)`` around F.sdpa, and the
    scope-free function's ``window_size``, against the fp64 reference."""
    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    errors = {}
    causal_only = dtensor_ring.get_layout(layout).causal_only
    windows = [((1, 0), True), ((6, 0), True), ((3, 2), causal_only and mode == "ring")]
    for window, causal in windows:
        q, k, v, dout, leaves, dout_dt = _sdpa_inputs(mesh, layout, H_kv=2)
        ref, grads = _reference(q, k, v, dout, causal, window)
        with engines_used() as used:
            if window == (1, 0):
                out = dtensor_ring.scaled_dot_product_ring_attention(
                    *leaves,
                    is_causal=causal,
                    enable_gqa=True,
                    layout=layout,
                    mode=mode,
                    window_size=window,
                )
                out.backward(dout_dt)
            else:
                with dtensor_ring.ring_sdpa(layout=layout, mode=mode, window_size=window):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
                    out.backward(dout_dt)
        _check_engines(layout, mode, used)
        errs = [_local_err(out, ref, layout, rank, W)]
        errs += [_local_err(t.grad, g, layout, rank, W) for t, g in zip(leaves, grads, strict=True)]
        errors[f"{window} causal={causal}"] = max(errs)
    with pytest.raises(ValueError, match="window_size"):
        with dtensor_ring.ring_sdpa(layout=layout, window_size=(1, -2)):
            pass
    return errors


# Ulysses shards the 4 heads: world sizes dividing 4
@pytest.mark.parametrize(
    "mode, world_size", [("ring", w) for w in (1, 2, 3, 4)] + [("ulysses", w) for w in (1, 2, 4)]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_window_numerics(dist_pool, layout, world_size, mode):
    for rank, errors in enumerate(
        dist_pool.run(_sdpa_window_numerics, world_size, layout=layout, mode=mode)
    ):
        for name, err in errors.items():
            assert err < TOL[torch.float64], f"rank {rank} {name}: max error {err:.3g}"


def _sdpa_checkpointed(group, layout, mode):
    """SDPA in ``ring_sdpa(layout, mode)`` under activation checkpointing: the recompute runs
    in backward()."""
    from torch.utils.checkpoint import checkpoint

    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout, leaves, dout_dt = _sdpa_inputs(mesh, layout, H_kv=2)
    ref, grads = _reference(q, k, v, dout, causal=True)

    def block(q, k, v):
        return F.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True, enable_gqa=True)

    with dtensor_ring.ring_sdpa(layout=layout, mode=mode), engines_used() as used:
        out = checkpoint(block, *leaves, use_reentrant=False)
        out.backward(dout_dt)
    _check_engines(layout, mode, used)
    errs = [_local_err(out, ref, layout, rank, W)]
    errs += [_local_err(t.grad, g, layout, rank, W) for t, g in zip(leaves, grads, strict=True)]
    return max(errs)


@pytest.mark.parametrize("layout, mode", [("zigzag", "ulysses"), ("llama3_zigzag", "ring")])
def test_sdpa_activation_checkpointing(dist_pool, layout, mode):
    for err in dist_pool.run(_sdpa_checkpointed, 2, layout=layout, mode=mode):
        assert err < 1e-10, err


def _ulysses_ops_opcheck_and_compile(group):
    """opcheck of the Ulysses op pair; ``mode="ulysses"`` in a fullgraph-compiled function."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (
        dtensor_ring.shard_local(t, "zigzag", rank, W).requires_grad_()
        for t in random_qkv(1, 4 * W, 4, 2, 8, dtype=torch.float32, seed=2)
    )
    ops = torch.ops.dtensor_ring
    results = {}
    for op in (ops.ulysses_attention.default,):
        results[str(op)] = torch.library.opcheck(
            op, (q, k, v, group.group_name, "zigzag", True, 0.3, "cpu_flash")
        )
    mesh = _mesh(group)
    qf, kf, vf, dout, leaves, dout_dt = _sdpa_inputs(mesh, "zigzag", H_kv=2)
    ref, grads = _reference(qf, kf, vf, dout, causal=True)
    torch._dynamo.reset()

    def f(q, k, v):
        return dtensor_ring.scaled_dot_product_ring_attention(
            q, k, v, is_causal=True, enable_gqa=True, layout="zigzag", mode="ulysses"
        )

    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, backend=counter, fullgraph=True)(*leaves)
    out.backward(dout_dt)
    errs = [_local_err(out, ref, "zigzag", rank, W)]
    errs += [_local_err(t.grad, g, "zigzag", rank, W) for t, g in zip(leaves, grads, strict=True)]
    return (
        {name: all(r == "SUCCESS" for r in res.values()) for name, res in results.items()},
        counter.frame_count,
        max(errs),
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_ulysses_ops_opcheck_and_compile(dist_pool, world_size):
    for opchecks, frames, err in dist_pool.run(_ulysses_ops_opcheck_and_compile, world_size):
        assert all(opchecks.values()) and opchecks, opchecks
        assert frames == 1 and err < 1e-10, (frames, err)


def _llama3_zigzag_compiled(group):
    """``scaled_dot_product_ring_attention(layout="llama3_zigzag")`` in a fullgraph-compiled
    function: one frame, the all-gather op, exact forward and backward."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout, leaves, dout_dt = _sdpa_inputs(_mesh(group), "llama3_zigzag", H_kv=2)
    ref, grads = _reference(q, k, v, dout, causal=True)
    torch._dynamo.reset()

    def f(q, k, v):
        return dtensor_ring.scaled_dot_product_ring_attention(
            q, k, v, is_causal=True, enable_gqa=True, layout="llama3_zigzag"
        )

    counter = CompileCounterWithBackend("aot_eager")
    with engines_used() as used:
        out = torch.compile(f, backend=counter, fullgraph=True)(*leaves)
        out.backward(dout_dt)
    errs = [_local_err(out, ref, "llama3_zigzag", rank, W)]
    errs += [
        _local_err(t.grad, g, "llama3_zigzag", rank, W) for t, g in zip(leaves, grads, strict=True)
    ]
    return counter.frame_count, used, max(errs)


def test_llama3_zigzag_compiled(dist_pool):
    for frames, used, err in dist_pool.run(_llama3_zigzag_compiled, 2):
        assert frames == 1 and used == {"llama3"} and err < 1e-10, (frames, used, err)


@pytest.mark.parametrize(
    "world_size, as_dtensor, mesh_2d", [(2, False, False), (3, True, False), (4, True, True)]
)
def test_llama3_zigzag_sinks(dist_pool, world_size, as_dtensor, mesh_2d):
    """Attention sinks through the all-gather path (``to_local`` / ``from_local``): out and
    every gradient, the sinks' as a rank's share (plain tensor) or Partial (DTensor)."""
    from test_sinks import check_dtensor  # here, not at the top: pytest would collect it

    dist_pool.run(
        check_dtensor,
        world_size,
        layout="llama3_zigzag",
        mode="ring",
        as_dtensor=as_dtensor,
        mesh_2d=mesh_2d,
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["ring", "zigzag", "llama3_zigzag"])
def test_sdpa_ulysses_numerics(dist_pool, layout, world_size):
    for rank, errors in enumerate(dist_pool.run(_sdpa_ulysses_numerics, world_size, layout=layout)):
        for name, (err, tol) in errors.items():
            assert err < tol, f"rank {rank} {name}: max error {err:.3g} >= {tol}"


def _sdpa_2d_mesh(group, layout, cp_first, batch_sharded):
    """SDPA on a (dp, cp) mesh: Shard(2) on cp; Shard(0) or Replicate() on dp."""
    names = ("cp", "dp") if cp_first else ("dp", "cp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    cp_rank, dp_rank = mesh.get_local_rank("cp"), mesh.get_local_rank("dp")
    B, S, H, H_kv, D = 2, 8, 4, 2, 8
    q, k, v = random_qkv(B, S, H, H_kv, D, seed=3)
    dout = random_qkv(B, S, H, H, D, seed=4)[0]
    ref, grads = _reference(q, k, v, dout, causal=True)
    rows = slice(dp_rank, dp_rank + 1) if batch_sharded else slice(None)

    def dt(t):
        return dtensor_ring.shard_sequence(
            t[rows].transpose(1, 2),
            mesh,
            seq_dim=2,
            layout=layout,
            mesh_dim="cp",
            batch_dim=0 if batch_sharded else None,
        )

    leaves = [dt(t).detach().requires_grad_() for t in (q, k, v)]
    with dtensor_ring.ring_sdpa(layout=layout):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(dt(dout))
    expected_placements = [Shard(0) if batch_sharded else Replicate()] * 2
    expected_placements[names.index("cp")] = Shard(2)
    errs = [_local_err(out, ref, layout, cp_rank, 2, rows)]
    errs += [
        _local_err(t.grad, g, layout, cp_rank, 2, rows) for t, g in zip(leaves, grads, strict=True)
    ]
    # the global view: batch of every dp rank (or the replicated one), original token order
    full = dtensor_ring.unshard_sequence(out, seq_dim=2, layout=layout).transpose(1, 2)
    errs.append((full - ref).abs().max().item())
    return tuple(out.placements) == tuple(expected_placements), max(errs)


@pytest.mark.parametrize(
    "layout,cp_first,batch_sharded",
    [
        ("zigzag", False, True),
        ("zigzag", True, False),
        ("llama3_zigzag", False, True),  # each dp rank's rows folded into its own documents
        ("llama3_zigzag", True, False),
    ],
)
def test_sdpa_2d_mesh(dist_pool, layout, cp_first, batch_sharded):
    for placements_ok, err in dist_pool.run(
        _sdpa_2d_mesh, 4, layout=layout, cp_first=cp_first, batch_sharded=batch_sharded
    ):
        assert placements_ok and err < 1e-10, err


def _sdpa_without_autograd(group):
    """Inference: under inference_mode SDPA itself reaches DTensor (and is decomposed there)."""
    mesh = _mesh(group)
    q, k, v = random_qkv(1, 8 * mesh.size(), 4, 2, 8, seed=5)
    ref, _ = reference_attention(q, k, v, causal=True)
    dts = [
        dtensor_ring.shard_sequence(t.transpose(1, 2), mesh, seq_dim=2, layout="zigzag")
        for t in (q, k, v)
    ]
    errors = {}
    for name, context in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        with context(), dtensor_ring.ring_sdpa(layout="zigzag"):
            out = F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=True)
        full = dtensor_ring.unshard_sequence(out, seq_dim=2, layout="zigzag").transpose(1, 2)
        errors[name] = (full - ref).abs().max().item()
    return errors


def test_sdpa_without_autograd(dist_pool):
    for errors in dist_pool.run(_sdpa_without_autograd, 2):
        assert set(errors) == {"inference_mode", "no_grad"}
        assert max(errors.values()) < 1e-10, errors


# --------------------------------------------------------------------------------------------
# 3. CUDA aten-op handlers, called directly with CPU DTensors
# --------------------------------------------------------------------------------------------
def _call_with_schema(handler, op, values: dict, layout: str = "zigzag"):
    """Call ``handler`` as DTensor would for ``op``: positional args in schema order."""
    args, kwargs = [], {}
    for arg in op._schema.arguments:
        if arg.name not in values:
            assert arg.has_default_value(), (op, arg.name)
            continue
        (
            kwargs.__setitem__(arg.name, values[arg.name])
            if arg.kwarg_only
            else args.append(values[arg.name])
        )
    return handler(SDPAConfig(layout, None), op, tuple(args), kwargs)


def _cuda_handlers(group, layout):
    """Forward then backward handler of each CUDA family, as autograd would chain them."""
    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout, (qd, kd, vd), dout_dt = _sdpa_inputs(mesh, layout, H_kv=2)
    ref, grads = _reference(q, k, v, dout, causal=True)
    B, H, S, D = qd.shape
    results = {}
    for family in ATEN_SDPA_OPS[1:]:  # the CPU row runs end to end in _sdpa_numerics
        fwd_values = {
            "query": qd,
            "key": kd,
            "value": vd,
            "attn_bias": None,
            "compute_log_sumexp": True,
            "dropout_p": 0.0,
            "is_causal": True,
            "return_debug_mask": False,
            "scale": None,
        }
        outs = _call_with_schema(aten_sdpa_forward_handler, family.forward_op, fwd_values, layout)
        names = [r.name for r in family.forward_op._schema.returns]
        assert len(outs) == len(names), (family, len(outs))
        returned = dict(zip(names, outs, strict=True))
        out, lse = outs[0], outs[1]
        lse_shape = (B, H, S, 1) if family.lse_trailing_one else (B, H, S)
        assert tuple(lse.shape) == lse_shape and lse.dtype == torch.float64, lse  # fp64 in
        bwd_values = {
            "grad_out": dout_dt,
            "grad_out_": dout_dt,
            "query": qd,
            "key": kd,
            "value": vd,
            "out": out,
            "logsumexp": lse,
            "attn_bias": None,
            "dropout_p": 0.0,
            "is_causal": True,
            "scale": None,
            "grad_input_mask": [True, True, True, False],
            "cum_seq_q": returned.get("cum_seq_q"),
            "cum_seq_k": returned.get("cum_seq_k"),
            "max_q": returned.get("max_q"),
            "max_k": returned.get("max_k"),
            "philox_seed": returned.get("philox_seed", returned.get("rng_state")),
            "philox_offset": returned.get("philox_offset", returned.get("unused")),
        }
        with torch.no_grad():  # as autograd runs a backward (Note [First-order backward])
            gs = _call_with_schema(
                aten_sdpa_backward_handler, family.backward_op, bwd_values, layout
            )
        assert len(gs) == len(family.backward_op._schema.returns), (family, len(gs))
        errs = [_local_err(out, ref, layout, rank, W)]
        errs += [_local_err(g, r, layout, rank, W) for g, r in zip(gs[:3], grads, strict=True)]
        results[family.forward] = max(errs)
    return results


@pytest.mark.parametrize("layout", ["zigzag", "llama3_zigzag"])
def test_cuda_aten_handlers_argument_handling(dist_pool, layout):
    for errors in dist_pool.run(_cuda_handlers, 2, layout=layout):
        assert set(errors) == {f.forward for f in ATEN_SDPA_OPS[1:]}
        for name, err in errors.items():
            assert err < 1e-10, (name, err)


# --------------------------------------------------------------------------------------------
# 4. Errors: ValueError on every rank, before any communication
# --------------------------------------------------------------------------------------------
def _errors(group):
    mesh = _mesh(group)
    other_mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("other",))
    full = torch.randn(1, 4, 8, 8)

    def dt(placements, t=full, m=mesh):
        return distribute_tensor(t, m, placements)

    q = dt([Shard(2)])
    sdpa_cases = {
        "heads": ((dt([Shard(1)]),) * 3, {}),
        "head_dim": ((dt([Shard(3)]),) * 3, {}),
        "replicate": ((dt([Replicate()]),) * 3, {}),
        "partial": ((DTensor.from_local(full, mesh, [Partial()]),) * 3, {}),
        "uneven": ((dt([Shard(2)], torch.randn(1, 4, 10, 8)),) * 3, {}),
        "meshes": ((q, dt([Shard(2)], m=other_mesh), q), {}),
        "placements": ((q, dt([Shard(1)]), q), {}),
        "attn_mask": ((q, q, q), {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}),
        "dropout": ((q, q, q), {"dropout_p": 0.1}),
        "noncausal_zigzag": ((q, q, q), {"is_causal": False}),
        "gqa_flag": (
            (q, dt([Shard(2)], torch.randn(1, 2, 8, 8)), dt([Shard(2)], torch.randn(1, 2, 8, 8))),
            {},
        ),
        "mixed_types": ((q, full, full), {}),
    }
    messages = {}
    # the all-gather layout (Note [All-gather layouts on DTensors]) checks alike, non-causal too
    gather_cases = {f"llama3_zigzag {n}": sdpa_cases[n] for n in LLAMA3_ZIGZAG_ERRORS}
    for name, (args, kwargs) in {**sdpa_cases, **gather_cases}.items():
        layout = "llama3_zigzag" if name in gather_cases else "zigzag"
        kwargs = {"is_causal": layout == "zigzag", **kwargs}
        for way in ("scope", "direct"):
            try:
                if way == "scope":
                    with dtensor_ring.ring_sdpa(layout=layout):
                        F.scaled_dot_product_attention(*args, **kwargs)
                else:
                    dtensor_ring.scaled_dot_product_ring_attention(*args, **kwargs, layout=layout)
                messages[f"{name}/{way}"] = "no error"
            except (ValueError, TypeError) as e:
                messages[f"{name}/{way}"] = f"{type(e).__name__}: {e}"
    # Ulysses shards the heads: H = 3 on 2 ranks; and an unknown mode
    q3 = dt([Shard(2)], torch.randn(1, 3, 8, 8))
    for name, mode in (("ulysses_heads", "ulysses"), ("mode", "spiral")):
        for way in ("scope", "direct"):
            try:
                if way == "scope":
                    with dtensor_ring.ring_sdpa(layout="zigzag", mode=mode):
                        F.scaled_dot_product_attention(q3, q3, q3, is_causal=True)
                else:
                    dtensor_ring.scaled_dot_product_ring_attention(
                        q3, q3, q3, is_causal=True, layout="zigzag", mode=mode
                    )
                messages[f"{name}/{way}"] = "no error"
            except ValueError as e:
                messages[f"{name}/{way}"] = f"ValueError: {e}"
    # our op on DTensors with a group that is not the sharded mesh dim's
    bshd = dt([Shard(1)], full.transpose(1, 2).contiguous())
    try:
        torch.ops.dtensor_ring.ring_attention(
            bshd, bshd, bshd, "no-such-group", "zigzag", True, 0.3, "cpu_flash"
        )
        messages["op/group"] = "no error"
    except Exception as e:  # noqa: BLE001 - DTensor wraps sharding-rule errors
        messages["op/group"] = f"{type(e).__name__}: {e}"
    return messages


EXPECTED_ERRORS = {
    "heads": "placement Shard(dim=1)",
    "head_dim": "placement Shard(dim=3)",
    "replicate": "not sharded on the sequence dim 2",
    "partial": "partial sums",
    "uneven": "uneven shards",
    "meshes": "different device meshes",
    "placements": "different placements",
    "attn_mask": "attn_mask is not supported",
    "dropout": "dropout_p=0.1 is not supported",
    "noncausal_zigzag": "causal attention only",
    "gqa_flag": "enable_gqa=True",
    "mixed_types": "not a DTensor",
    "ulysses_heads": "shards the 3 query heads over 2 ranks",
    "mode": "mode='spiral'",
}
LLAMA3_ZIGZAG_ERRORS = ("uneven", "placements", "attn_mask", "dropout", "gqa_flag", "mixed_types")


def test_placement_and_argument_errors(dist_pool):
    for rank, messages in enumerate(dist_pool.run(_errors, 2)):
        gather = {f"llama3_zigzag {n}": EXPECTED_ERRORS[n] for n in LLAMA3_ZIGZAG_ERRORS}
        for name, expected in {**EXPECTED_ERRORS, **gather}.items():
            for way in ("scope", "direct"):
                message = messages[f"{name}/{way}"]
                kind = "TypeError" if name.endswith("mixed_types") else "ValueError"
                assert message.startswith(kind) and expected in message, (rank, name, way, message)
        assert "group_name='no-such-group' is not the process group" in messages["op/group"]


# --------------------------------------------------------------------------------------------
# 5. shard_sequence / unshard_sequence
# --------------------------------------------------------------------------------------------
def _shard_unshard(group, layout):
    mesh = _mesh(group)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    S = 4 * W
    ids = torch.randint(0, 100, (2, S), generator=torch.Generator().manual_seed(0))
    order = torch.cat([dtensor_ring.token_indices(layout, S, r, W) for r in range(W)])
    checks = {}
    ids_dt = dtensor_ring.shard_sequence(ids, mesh, seq_dim=1, layout=layout)
    checks["placements"] = tuple(ids_dt.placements) == (Shard(1),) and ids_dt.shape == ids.shape
    checks["local"] = torch.equal(
        ids_dt.to_local(), shard(ids, _token_order(layout), rank, W, seq_dim=1)
    )
    checks["global view is permuted"] = torch.equal(ids_dt.full_tensor(), ids[:, order])
    checks["unshard"] = torch.equal(dtensor_ring.unshard_sequence(ids_dt, 1, layout), ids)
    pos = dtensor_ring.shard_sequence(torch.arange(S), mesh, seq_dim=0, layout=layout)
    checks["positions"] = torch.equal(
        pos.to_local(), dtensor_ring.token_indices(layout, S, rank, W)
    )
    # differentiable both ways: each rank's gradient covers exactly its own tokens
    x = torch.randn(
        1,
        2,
        S,
        3,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(1),
        requires_grad=True,
    )
    x_dt = dtensor_ring.shard_sequence(x, mesh, seq_dim=-2, layout=layout)
    back = dtensor_ring.unshard_sequence(x_dt, seq_dim=2, layout=layout)
    checks["round trip"] = torch.equal(back, x)
    back.sum().backward()
    mine = torch.zeros(S, dtype=torch.float64)
    mine[dtensor_ring.token_indices(layout, S, rank, W)] = 1
    checks["gradient"] = torch.equal(x.grad, mine[None, None, :, None].expand_as(x))
    return checks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_sequence(dist_pool, layout):
    for checks in dist_pool.run(_shard_unshard, 3, layout=layout):
        assert all(checks.values()), checks


def _shard_errors(group):
    mesh = _mesh(group)
    x = torch.randn(2, 8)
    messages = {}
    cases = {
        "layout": lambda: dtensor_ring.shard_sequence(x, mesh, layout="spiral"),
        "mesh_dim": lambda: dtensor_ring.shard_sequence(x, mesh, mesh_dim="cp"),
        "batch_dim": lambda: dtensor_ring.shard_sequence(x, mesh, seq_dim=1, batch_dim=1),
        "divisible": lambda: dtensor_ring.shard_sequence(torch.randn(2, 5), mesh),
        "unshard_replicated": lambda: dtensor_ring.unshard_sequence(
            distribute_tensor(x, mesh, [Replicate()])
        ),
        "unshard_plain": lambda: dtensor_ring.unshard_sequence(x),
    }
    for name, fn in cases.items():
        try:
            fn()
            messages[name] = "no error"
        except (ValueError, TypeError) as e:
            messages[name] = type(e).__name__
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    try:
        dtensor_ring.shard_sequence(x, mesh_2d)
        messages["2d_no_mesh_dim"] = "no error"
    except ValueError:
        messages["2d_no_mesh_dim"] = "ValueError"
    return messages


def test_shard_sequence_errors(dist_pool):
    for messages in dist_pool.run(_shard_errors, 4):
        assert messages == {
            "layout": "ValueError",
            "mesh_dim": "ValueError",
            "batch_dim": "ValueError",
            "divisible": "ValueError",
            "unshard_replicated": "ValueError",
            "unshard_plain": "TypeError",
            "2d_no_mesh_dim": "ValueError",
        }, messages
