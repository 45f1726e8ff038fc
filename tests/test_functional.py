"""Numerics of the functional API (``ring``/``zigzag``/``stripe`` ``*_flash_attn_*func``).

Every case runs on ``world_size`` ranks of the session's gloo worker pool (``dist_pool``). Each
rank builds the same seeded full-sequence tensors, computes the fp64 reference attention and its
gradients on the full sequence (``reference.py``), shards the inputs with the library's
``shard_local``, calls the API, and compares its local ``out``/``lse`` and, after backward with a
random ``dout``, the local ``dq``/``dk``/``dv`` against the reference sharded by the independent
index lists of ``reference.layout_indices``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from reference import LAYOUTS, random_qkv, reference_attention, shard

import dtensor_ring

# variant -> (layout, causal); zigzag and stripe are causal-only.
VARIANTS = {
    "ring_causal": ("ring", True),
    "ring_full": ("ring", False),
    "zigzag": ("zigzag", True),
    "stripe": ("stripe", True),
}
# heads -> (H, H_kv)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
WORLD_SIZES = (1, 2, 3, 4)
# Per dtype: (rtol, atol) for out/lse and for the gradients. Inputs and values are O(1).
TOLERANCES = {
    torch.float64: ((1e-10, 1e-10), (1e-10, 1e-10)),
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-5)),
}
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: sizes, variant, dtype, API form and options."""

    variant: str = "ring_causal"
    heads: str = "mha"
    dtype: torch.dtype = torch.float64
    # "plain", "kvpacked", "qkvpacked", or "strided": plain with non-contiguous q/k/v
    # (transposed views of [B, H, S, D] buffers)
    form: str = "plain"
    B: int = 1
    S_local: int = 6
    D: int = 16
    H: int | None = None  # overrides HEADS[heads] when given (with H_kv)
    H_kv: int | None = None
    softmax_scale: float | None = None
    backend: str | None = None  # None: not passed (the default, auto selection)
    default_group: bool = False  # pass group=None (only meaningful for the full pool)
    window_size: tuple[int, int] = (-1, -1)
    seed: int = 0

    @property
    def layout(self) -> str:
        return VARIANTS[self.variant][0]

    @property
    def causal(self) -> bool:
        return VARIANTS[self.variant][1]

    @property
    def num_heads(self) -> tuple[int, int]:
        return (self.H, self.H_kv) if self.H is not None else HEADS[self.heads]

    def func(self):
        """The API function of this case's layout and form."""
        prefix = {
            "ring": "ring_flash_attn",
            "zigzag": "zigzag_ring_flash_attn",
            "stripe": "stripe_flash_attn",
        }[self.layout]
        suffix = {
            "plain": "_func",
            "strided": "_func",
            "kvpacked": "_kvpacked_func",
            "qkvpacked": "_qkvpacked_func",
        }[self.form]
        return getattr(dtensor_ring, prefix + suffix)

    def id(self, world_size: int) -> str:
        H, H_kv = self.num_heads
        parts = [
            f"w{world_size}",
            self.variant,
            f"h{H}kv{H_kv}",
            DTYPE_NAMES[self.dtype],
            self.form,
            f"b{self.B}s{self.S_local}d{self.D}",
        ]
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale}")
        if self.backend is not None:
            parts.append(self.backend)
        if self.default_group:
            parts.append("defaultgroup")
        if self.window_size != (-1, -1):
            parts.append("window{}_{}".format(*self.window_size))
        return "-".join(parts)


def _assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    rtol, atol = tol
    torch.testing.assert_close(
        actual.to(torch.float64), expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}"
    )


def check_attention(group: dist.ProcessGroup, case: Case) -> dict[str, float]:
    """Worker body: run ``case`` on this rank and compare with the reference.

    Returns the max abs error of each compared tensor (for debugging).
    """
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    H, H_kv = case.num_heads
    S = case.S_local * W
    dtype, layout = case.dtype, case.layout
    q, k, v = random_qkv(case.B, S, H, H_kv, case.D, dtype, seed=case.seed)
    dout = random_qkv(case.B, S, H, H, case.D, dtype, seed=case.seed + 1)[0]

    # fp64 reference on the full sequence, and its gradients.
    full = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = reference_attention(
        *full, causal=case.causal, scale=case.softmax_scale, window_size=case.window_size
    )
    grads_ref = torch.autograd.grad(out_ref, full, dout.to(torch.float64))

    def local(x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        return shard(x.detach(), layout, rank, W, seq_dim)

    # Inputs sharded by the library; leaves built per API form.
    ql, kl, vl = (dtensor_ring.shard_local(x, layout, rank, W) for x in (q, k, v))
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, return_attn_probs=True)
    if not case.default_group:
        kwargs["group"] = group
    if case.backend is not None:
        kwargs["backend"] = case.backend
    if case.window_size != (-1, -1):
        kwargs["window_size"] = case.window_size
    if case.form == "plain":
        leaves = [x.detach().clone().requires_grad_() for x in (ql, kl, vl)]
        result = case.func()(*leaves, **kwargs)
        expected_grads = [local(g) for g in grads_ref]
    elif case.form == "strided":
        leaves = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (ql, kl, vl)]
        result = case.func()(*(x.transpose(1, 2) for x in leaves), **kwargs)
        expected_grads = [local(g).transpose(1, 2) for g in grads_ref]
    elif case.form == "kvpacked":
        leaves = [
            ql.detach().clone().requires_grad_(),
            torch.stack([kl, vl], dim=2).requires_grad_(),
        ]
        result = case.func()(*leaves, **kwargs)
        expected_grads = [
            local(grads_ref[0]),
            torch.stack([local(grads_ref[1]), local(grads_ref[2])], dim=2),
        ]
    else:
        leaves = [torch.stack([ql, kl, vl], dim=2).requires_grad_()]
        result = case.func()(*leaves, **kwargs)
        expected_grads = [torch.stack([local(g) for g in grads_ref], dim=2)]

    assert isinstance(result, tuple) and len(result) == 3, type(result)
    out, lse, probs = result
    assert probs is None, type(probs)
    assert out.dtype == dtype, f"out dtype {out.dtype}, inputs {dtype}"
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == lse_dtype, f"lse dtype {lse.dtype}, expected {lse_dtype}"
    tol_out, tol_grad = TOLERANCES[dtype]
    _assert_close("out", out, local(out_ref), tol_out)
    _assert_close("lse", lse, local(lse_ref, seq_dim=2), tol_out)

    out.backward(local(dout))
    names = {
        "plain": ["dq", "dk", "dv"],
        "strided": ["dq", "dk", "dv"],
        "kvpacked": ["dq", "dkv"],
        "qkvpacked": ["dqkv"],
    }
    errors = {"out": (out.double() - local(out_ref)).abs().max().item()}
    for name, leaf, expected in zip(names[case.form], leaves, expected_grads, strict=True):
        assert leaf.grad is not None, f"{name}: no gradient"
        assert leaf.grad.dtype == dtype, f"{name}: dtype {leaf.grad.dtype}"
        _assert_close(name, leaf.grad, expected, tol_grad)
        errors[name] = (leaf.grad.double() - expected).abs().max().item()
    return errors


def _params(*pairs) -> list:
    """``pytest.param`` s of ``(world_size, case)`` pairs, with readable ids."""
    return [pytest.param(w, case, id=case.id(w)) for w, case in pairs]


def _cases(world_sizes, variants, heads, **fields) -> list:
    """The product of world sizes, variants and head configurations, other fields fixed."""
    return _params(
        *[
            (w, Case(variant=v, heads=h, **fields))
            for w, v, h in itertools.product(world_sizes, variants, heads)
        ]
    )


FP64_PLAIN = _cases(WORLD_SIZES, VARIANTS, HEADS)
FP32 = _cases(WORLD_SIZES, VARIANTS, ("mha", "gqa"), dtype=torch.float32) + _cases(
    (3,), VARIANTS, ("mqa",), dtype=torch.float32
)
PACKED = (
    _cases((2,), VARIANTS, HEADS, form="kvpacked")
    + _cases((3,), VARIANTS, ("gqa",), form="kvpacked", dtype=torch.float32)
    + _cases((1, 2, 3, 4), VARIANTS, ("mha",), form="qkvpacked")
    + _cases((4,), VARIANTS, ("mha",), form="qkvpacked", dtype=torch.float32)
    + _cases((3,), VARIANTS, ("gqa",), form="strided")
)
ODD_SIZES = _params(
    *[
        (w, Case(variant=v, S_local=1))
        for w in (2, 4)
        for v in ("ring_causal", "ring_full", "stripe")
    ],
    *[(w, Case(variant="zigzag", S_local=2)) for w in (2, 4)],
    *[(3, Case(variant=v, heads="gqa", D=8)) for v in VARIANTS],
    *[(3, Case(variant=v, H=1, H_kv=1)) for v in VARIANTS],
    *[(2, Case(variant=v, B=2, heads="mqa")) for v in VARIANTS],
    *[(4, Case(variant=v, B=3, S_local=10, heads="gqa", D=8)) for v in VARIANTS],
    (4, Case(variant="zigzag", S_local=16, heads="gqa", dtype=torch.float32)),
    (3, Case(variant="ring_full", S_local=5, dtype=torch.float32, form="kvpacked")),
)
OPTIONS = _params(
    *[(w, Case(variant=v, heads="gqa", backend="math")) for w in (2, 3) for v in VARIANTS],
    (4, Case(variant="zigzag", heads="mqa", backend="math", dtype=torch.float32)),
    (2, Case(variant="stripe", form="qkvpacked", backend="math")),
    (2, Case(variant="ring_causal", heads="gqa", backend="cpu_flash")),
    *[(w, Case(variant=v, heads="gqa", softmax_scale=0.37)) for w in (1, 3) for v in VARIANTS],
    *[(4, Case(variant=v, heads="gqa", default_group=True)) for v in VARIANTS],
)
# Sliding windows (S_local = 6: a zigzag chunk is 3 tokens): smaller than a chunk, equal to a
# zigzag chunk, equal to a rank's tokens, larger, and one-sided (left unbounded: non-causal).
WINDOWS = ((1, 1), (3, 3), (6, 6), (9, 2), (-1, 4))
WINDOWED = (
    _params(
        *[
            (w, Case(variant=v, heads="gqa", window_size=win))
            for w, v, win in itertools.product(WORLD_SIZES, VARIANTS, WINDOWS)
        ]
    )
    + _cases((3,), VARIANTS, ("mqa",), window_size=(4, 0), dtype=torch.float32)
    + _cases((4,), VARIANTS, ("mha",), window_size=(2, 5), backend="math")
    + _cases((2,), VARIANTS, ("mha",), window_size=(5, 1), form="qkvpacked")
    + _cases((3,), VARIANTS, ("gqa",), window_size=(2, 2), form="kvpacked")
    + _params(
        (4, Case(variant="zigzag", S_local=16, window_size=(11, 0), B=2)),
        (3, Case(variant="stripe", S_local=1, window_size=(1, 0))),
    )
)


@pytest.mark.parametrize("world_size, case", FP64_PLAIN)
def test_attention_fp64(dist_pool, world_size, case):
    dist_pool.run(check_attention, world_size, case=case)


@pytest.mark.parametrize("world_size, case", FP32)
def test_attention_fp32(dist_pool, world_size, case):
    dist_pool.run(check_attention, world_size, case=case)


@pytest.mark.parametrize("world_size, case", PACKED)
def test_attention_packed(dist_pool, world_size, case):
    """kv-packed and qkv-packed forms, and non-contiguous q/k/v."""
    dist_pool.run(check_attention, world_size, case=case)


@pytest.mark.parametrize("world_size, case", ODD_SIZES)
def test_attention_odd_sizes(dist_pool, world_size, case):
    dist_pool.run(check_attention, world_size, case=case)


@pytest.mark.parametrize("world_size, case", OPTIONS)
def test_attention_options(dist_pool, world_size, case):
    """The ``math`` backend, an explicit ``cpu_flash``, ``softmax_scale`` and ``group=None``."""
    dist_pool.run(check_attention, world_size, case=case)


@pytest.mark.parametrize("world_size, case", WINDOWED)
def test_attention_window(dist_pool, world_size, case):
    """Sliding windows over global positions (Note [Windowed schedules])."""
    dist_pool.run(check_attention, world_size, case=case)


def check_return_out_only(group: dist.ProcessGroup, layout: str) -> None:
    """``return_attn_probs=False`` (the default) returns ``out`` alone, same values."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    func = {
        "ring": dtensor_ring.ring_flash_attn_func,
        "zigzag": dtensor_ring.zigzag_ring_flash_attn_func,
        "stripe": dtensor_ring.stripe_flash_attn_func,
    }[layout]
    q, k, v = (
        dtensor_ring.shard_local(x, layout, rank, W)
        for x in random_qkv(1, 4 * W, 4, 2, 8, torch.float64, seed=3)
    )
    out = func(q, k, v, causal=True, group=group)
    assert isinstance(out, torch.Tensor), type(out)
    out_full, _, _ = func(q, k, v, causal=True, group=group, return_attn_probs=True)
    torch.testing.assert_close(out, out_full, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_return_out_only(dist_pool, layout):
    dist_pool.run(check_return_out_only, 2, layout=layout)


def check_sum_backward(group: dist.ProcessGroup, layout: str) -> None:
    """``out.sum().backward()`` (an expanded, stride-0 ``dout``) gives the reference grads."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(2, 4 * W, 4, 2, 8, torch.float64, seed=5)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    reference_attention(*full, causal=True)[0].sum().backward()
    leaves = [dtensor_ring.shard_local(x, layout, rank, W).requires_grad_() for x in (q, k, v)]
    func = {
        "ring": dtensor_ring.ring_flash_attn_func,
        "zigzag": dtensor_ring.zigzag_ring_flash_attn_func,
        "stripe": dtensor_ring.stripe_flash_attn_func,
    }[layout]
    func(*leaves, causal=True, group=group).sum().backward()
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, full, strict=True):
        expected = shard(ref.grad, layout, rank, W)
        _assert_close(name, leaf.grad, expected, TOLERANCES[torch.float64][1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sum_backward(dist_pool, layout):
    dist_pool.run(check_sum_backward, 3, layout=layout)


# --- layouts: shard_local and gather_sequence ----------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_local_matches_layout(layout, seq_dim, world_size):
    """``shard_local`` picks exactly the documented tokens, in the documented order."""
    x = torch.randn(2, 24, 24, 3, dtype=torch.float64)
    for rank in range(world_size):
        got = dtensor_ring.shard_local(x, layout, rank, world_size, seq_dim=seq_dim)
        torch.testing.assert_close(got, shard(x, layout, rank, world_size, seq_dim), rtol=0, atol=0)


def test_layout_indices_examples():
    """The reference layouts themselves, spelled out for W=2, S=8."""
    from reference import layout_indices

    table = {
        "ring": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "zigzag": [[0, 1, 6, 7], [2, 3, 4, 5]],
        "stripe": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }
    for layout, per_rank in table.items():
        for rank, expected in enumerate(per_rank):
            assert layout_indices(layout, rank, 2, 8).tolist() == expected, (layout, rank)


def check_gather_roundtrip(
    group: dist.ProcessGroup, layout: str, seq_dim: int, default_group: bool
) -> None:
    """``gather_sequence(shard_local(x))`` restores ``x`` (original token order) on each rank."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x = torch.randn(2, 4 * W, 4 * W, 3, generator=torch.Generator().manual_seed(W))
    local = dtensor_ring.shard_local(x, layout, rank, W, seq_dim=seq_dim)
    kwargs = {} if default_group else {"group": group}
    full = dtensor_ring.gather_sequence(local, layout, seq_dim=seq_dim, **kwargs)
    torch.testing.assert_close(full, x, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_sequence_roundtrip(dist_pool, layout, seq_dim, world_size):
    dist_pool.run(
        check_gather_roundtrip, world_size, layout=layout, seq_dim=seq_dim, default_group=False
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_sequence_default_group(dist_pool, layout):
    dist_pool.run(check_gather_roundtrip, 4, layout=layout, seq_dim=1, default_group=True)


# --- autocast (Note [Autocast] in ops/common.py) ---------------------------------------------


def check_autocast(group: dist.ProcessGroup, where: str) -> None:
    """fp32 inputs under CPU bf16 autocast ("all" ranks, or rank 0 "alone"): the op computes in
    fp32 all the same, so out and the gradients equal the call without autocast bitwise (a
    kernel's matmuls in bf16 would be ~1e-2 off)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (t.float() for t in random_qkv(1, 8, 4, 2, 16, torch.float64, seed=rank))
    dout = torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(rank))
    results = []
    for autocast in (False, where == "all" or rank == 0):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = dtensor_ring.ring_attention_func("zigzag", *leaves, causal=True, group=group)
            out.backward(dout)
        results.append([out, *(t.grad for t in leaves)])
    for plain, cast in zip(*results, strict=True):
        assert cast.dtype == torch.float32 and torch.equal(plain, cast), (rank, W)


@pytest.mark.parametrize("where", ["all", "alone"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_autocast_leaves_the_op_in_its_dtype(dist_pool, world_size, where):
    dist_pool.run(check_autocast, world_size, where=where)


# --- Note [Direct exchange]: only the pairs a sparse plan's rows need communicate -------------


def check_direct_exchange_skips_unneeded_pairs(group: dist.ProcessGroup) -> None:
    """Ring layout, causal window of 2 tokens (offsets 0, 1): rank 0 needs nothing of rank W-1
    (its K/V come after rank 0's queries), so neither the K/V nor their dK/dV move between
    them, forward or backward; every other neighbour pair does exchange. Out and gradients
    equal the fp64 full-sequence reference."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    S = 6 * W
    q, k, v = random_qkv(1, S, 4, 2, 8, torch.float64, seed=3)
    dout = torch.randn(1, S, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*full, causal=True, window_size=(2, 0))
    ref.backward(dout)
    leaves = [shard(t, "ring", rank, W).requires_grad_() for t in (q, k, v)]
    peers, original = [], dist.batch_isend_irecv

    def recording(ops):
        peers.extend((op.op.__name__, op.peer) for op in ops)
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        out = dtensor_ring.ring_flash_attn_func(
            *leaves, causal=True, window_size=(2, 0), group=group
        )
        out.backward(shard(dout, "ring", rank, W))
    finally:
        dist.batch_isend_irecv = original
    left, right = (rank - 1) % W, (rank + 1) % W
    sends, receives = (
        {p for op, p in peers if op == "isend"},
        {p for op, p in peers if op == "irecv"},
    )
    # K/V to the right, dK/dV shares back to the left; none across the pair (W - 1, 0)
    needed = ({right} if rank < W - 1 else set()) | ({left} if rank > 0 else set())
    assert sends == needed and receives == needed, (rank, sends, receives)
    for got, want in zip(
        (out, *(t.grad for t in leaves)), (ref, *(t.grad for t in full)), strict=True
    ):
        torch.testing.assert_close(got, shard(want.detach(), "ring", rank, W))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_direct_exchange_skips_unneeded_pairs(dist_pool, world_size):
    dist_pool.run(check_direct_exchange_skips_unneeded_pairs, world_size)
