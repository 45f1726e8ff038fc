"""Tier 1: the single-device ring simulator against fp64 full attention (no process group)."""

import pytest
import torch

from dtensor_ring import shard_local
from dtensor_ring.kernels.math import MathKernel
from dtensor_ring.simulate import RankSimulator, simulate_ring

CASES = [("ring", True), ("ring", False), ("zigzag", True), ("stripe", True)]


def _full(B=2, S=48, H=4, H_kv=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(B, S, H_kv, D, dtype=torch.float64, generator=gen) for _ in "kv")
    return q, k, v, torch.randn(q.shape, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("layout,causal", CASES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [None, (5, 3)])
def test_simulate_ring_matches_full_attention(layout, causal, world_size, window):
    q, k, v, dout = _full()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    if window is None:
        ref_out, ref_lse = MathKernel().forward(*full, causal=causal, scale=scale)
    else:  # causal sets right = 0, as flash-attn; the window over the whole sequence
        mask_window = (window[0], 0) if causal else window
        ref_out, ref_lse = MathKernel().forward(
            *full, causal=False, scale=scale, window=mask_window
        )
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout))
    got = simulate_ring(
        q,
        k,
        v,
        dout,
        layout=layout,
        world_size=world_size,
        causal=causal,
        window_size=window or (-1, -1),
    )
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)


def test_rank_simulator_forward_is_the_local_part():
    q, k, v, _ = _full(S=32)
    out, lse = simulate_ring(q, k, v, layout="zigzag", world_size=4)
    sim = RankSimulator(q, k, v, layout="zigzag", world_size=4, rank=2)
    out2, _ = sim.forward()
    torch.testing.assert_close(out2, shard_local(out, "zigzag", 2, 4), rtol=0, atol=0)


@pytest.mark.parametrize("layout,causal", [("ring", True), ("ring", False), ("zigzag", True)])
@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("window", [None, (5, 3)])
def test_simulate_varlen_ring_matches_per_document_attention(layout, causal, world_size, window):
    unit = 2 * world_size  # zigzag cuts every document into 2W pieces
    cu_seqlens = [0, unit, 4 * unit, 5 * unit, 8 * unit]
    gen = torch.Generator().manual_seed(1)
    T, H, H_kv, D = cu_seqlens[-1], 4, 2, 8
    q = torch.randn(T, H, D, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(T, H_kv, D, dtype=torch.float64, generator=gen) for _ in "kv")
    dout = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    n = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    mask_window = None if window is None else (window[0], 0) if causal else window
    ref_out, ref_lse = MathKernel().forward_varlen(
        *full, cu, cu, n, n, causal=causal, scale=D**-0.5, window=mask_window
    )
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout))
    got = simulate_ring(
        q,
        k,
        v,
        dout,
        layout=layout,
        world_size=world_size,
        causal=causal,
        cu_seqlens=cu_seqlens,
        window_size=window or (-1, -1),
    )
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "dtype, window, adopted",
    [(torch.float64, (-1, -1), True), (torch.bfloat16, (-1, -1), False),
     (torch.float64, (4, 0), False)],
)  # fmt: skip
def test_first_block_becomes_the_accumulator(monkeypatch, dtype, window, adopted):
    """Note [Ring forward]: step 0's block of every local query, its result already in the
    accumulation dtype (fp64 here; a kernel's unrounded outputs), is the output accumulator
    itself (no fresh ``[S, H, D]``, no copy); in bf16 (the block's result rounded), or where
    step 0 is two blocks (zigzag's halves under a window), the engine allocates its own.
    Either way the ring equals full attention."""
    import dtensor_ring.engine.ring as engine

    made = []
    original = engine._new_accumulators
    monkeypatch.setattr(engine, "_new_accumulators", lambda *a: made.append(1) or original(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 8, generator=g, dtype=torch.float64) for _ in "qkv")
    x = [t.to(dtype) for t in (q, k, v)]
    out, _ = simulate_ring(*x, layout="zigzag", world_size=4, causal=True, window_size=window)
    assert (not made) == adopted, made
    kw = dict(
        causal=window == (-1, -1), scale=8**-0.5, window=None if window == (-1, -1) else window
    )
    want = MathKernel().forward(*(t.double() for t in x), **kw)[0]
    torch.testing.assert_close(
        out.double(), want, atol=1e-12 if dtype == torch.float64 else 2e-2, rtol=0
    )


@pytest.mark.parametrize(
    "layout,varlen", [("zigzag", False), ("ring", False), ("zigzag", True), ("documents", True)]
)
def test_kernel_merges_blocks_in_place(monkeypatch, layout, varlen):
    """Note [Ring forward]: after step 0, a block whose query rows are one run of the
    accumulators goes to the kernel's ``merge_forward`` with those rows of them (flash-attn 4
    merges it in its epilogue), a varlen block of other rows with the whole accumulators and
    its rows by document (``seqused_q``); a kernel that merges as the engine would gives the
    engine's result bit for bit, forward and backward, and both equal full attention (W = 3)."""
    import dtensor_ring as dr
    from dtensor_ring.kernels.base import BlockKernel
    from dtensor_ring.kernels.merge import merge_, merge_eager_

    g = torch.Generator().manual_seed(0)
    shape = (96, 4, 8) if varlen else (1, 96, 4, 8)
    q = torch.randn(shape, generator=g, dtype=torch.float64)
    k, v = (torch.randn(*shape[:-2], 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(shape, generator=g, dtype=torch.float64)
    bounds = [0, 48, 72, 96]
    kw = dict(world_size=3, causal=True)
    if varlen:
        kw["cu_seqlens"] = bounds
        if layout == "documents":
            layout = dr.document_layout(bounds, 3)
    want = simulate_ring(q, k, v, dout, layout=layout, **kw)
    merged = []

    def merge_forward(self, q, k, v, out_acc, lse_acc, *, causal, scale, window):
        merged.append(q.shape)
        merge_eager_(out_acc, lse_acc, *self.forward(q, k, v, causal=causal, scale=scale,
                                                      window=window, unrounded=True))  # fmt: skip
        return True

    def merge_forward_varlen(
        self, q, k, v, cu_q, cu_k, max_q, max_k, out_acc, lse_acc, seqused_q=None, **kw
    ):
        rows = None  # with seqused_q: each document's rows of the block, where they lie
        if seqused_q is not None:
            firsts, used = cu_q[:-1].tolist(), seqused_q.tolist()
            rows = torch.cat([torch.arange(a, a + n) for a, n in zip(firsts, used, strict=True)])
            q, cu_q = q[rows], torch.cat([cu_q[:1] * 0, seqused_q.cumsum(0, dtype=torch.int32)])
        merged.append(q.shape)
        out_b, lse_b = self.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, unrounded=True, **kw)
        merge_(out_acc[None], lse_acc[None], out_b[None], lse_b[None], rows)
        return True

    monkeypatch.setattr(BlockKernel, "merges_outputs", True)
    monkeypatch.setattr(BlockKernel, "merges_by_document", True)
    monkeypatch.setattr(BlockKernel, "_merge_forward", merge_forward)
    monkeypatch.setattr(BlockKernel, "_merge_forward_varlen", merge_forward_varlen)
    got = simulate_ring(q, k, v, dout, layout=layout, **kw)
    assert merged, merged
    if layout == "zigzag":  # blocks of all 32 local rows and of half of them (dense: one run;
        # varlen: every document's half, Note [Varlen blocks merged where their rows lie])
        assert {s[-3 if varlen else 1] for s in merged} == {16, 32}, merged
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    ref = simulate_ring(q, k, v, dout, layout="ring", world_size=1, causal=True,
                        cu_seqlens=bounds if varlen else None)  # fmt: skip
    for a, b in zip(got, ref, strict=True):  # out, lse, dq, dk, dv
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_side_stream_joins_only_after_updates(monkeypatch):
    """Note [Merges off the critical path]: the compute stream waits for the side stream only
    when updates were queued since the last join (under CUDA graph capture a wait on a stream
    that did nothing in the capture is an error: a replayed ring forward failed so)."""
    from dtensor_ring.engine.ring import _SideStream

    class Stream:
        def __init__(self):
            self.waits = 0

        def wait_stream(self, other):
            self.waits += 1

    import contextlib

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    side = _SideStream(torch.device("cpu"))
    side.stream, side.compute, side.switch = Stream(), Stream(), False
    side.join()
    assert side.compute.waits == 0
    ran = []
    side.run(lambda: ran.append(1))
    assert ran == [1] and side.stream.waits == 1
    side.join()
    side.join()
    assert side.compute.waits == 1
