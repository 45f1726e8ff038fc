"""Ring attention on one GPU: the slowest simulated rank against the full-sequence kernel.

    python benchmarks/bench_single_gpu.py --out results/       # one H200: all of it, ~5 min
    python benchmarks/bench_single_gpu.py --smoke              # CPU, tiny, seconds (in tests)

For every block-kernel backend and layout at W ranks (default 8) and several token counts per
rank, it measures, in one run:

* block-kernel TFLOP/s at the block shapes the ring uses (diagonal and half blocks);
* efficiency vs theoretic: full-sequence single-GPU kernel time / W, divided by the time of
  the slowest rank of the plan, run by the real engine with a simulated communicator
  (``dtensor_ring.simulate``); next to it the plan's own limit (mean / max rank FLOPs);
* peak memory of that rank's forward+backward against single-device attention on the same
  local tokens;
* precision (at a smaller size): max/mean error of out, dq, dk, dv of the whole simulated ring
  against an fp64 reference, as a ratio to the error of the single-device kernel;
* predicted multi-GPU efficiency: per step, max(compute, K/V transfer at --link-gbps);
* efficiency against the fastest full-sequence kernel of any backend measured in the run
  (``eff_*_vs_best``: the theoretic of the issue, "against the fastest single-GPU kernel");
* zigzag with the rank's forward (and forward+backward) captured in one CUDA graph and
  replayed (``eff_*_graph``): the ring without any host work per call;
* per call of the zigzag rank: the GPU operations it issues (kernels, memsets, copies;
  torch.profiler), the host time to issue it (``gpu_ops_*``, ``host_*_ms``), and its block
  kernels alone, back to back (``kernels_alone_*_ms``, ``eff_*_kernels_alone``: the rank's
  efficiency if everything but its kernels were free);
* with ``--compare-rounded``, backends with more than one way to a ring's block gradients
  (flash-attn 4: dq summed in its kernel, fp32 block gradients summed by the engine, its plain
  backward) measured each way (``block_grads``); with ``--compare-launch``, flash-attn 4 also
  with every forward block through its Python wrapper, not replayed (``block_grads``:
  ``WRAPPER_FORWARD``);
* packed documents (``varlen``, torch flash's varlen kernel): the slowest rank of ring,
  zigzag and ``document_layout``'s placement (also by the all-gather of placed documents,
  ``documents_gather_*``), llama3 and llama3_zigzag, against one call on the whole stream / W;
* ``layout="auto"``'s candidates (ring, all-gather, Ulysses) measured against the cost
  model's prediction, and whether it chose the fastest (``policy``);
* the fixed cost of one call at W = 1 (``overhead``, ``--overhead-seq``): eager SDPA, the
  functional call, SDPA on DTensors (a scope a call, and one scope held open) and the DTensor
  function on a real 1-rank group (``bench_overhead.py``'s measurement; its own script adds
  the compiled variants and the host time layer by layer).

It prints a table last and writes ``bench_single_gpu.json`` (and PNG plots if matplotlib is
there) to --out. Timings: CUDA events, warm-up, median of --reps; fresh random data.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import time

import torch
from bench_overhead import host_ms  # benchmarks/ is the script's directory

from dtensor_ring import make_plan, shard_local
from dtensor_ring.engine.blocks import DenseBlocks
from dtensor_ring.kernels import BlockKernel, KernelCall, get_kernel
from dtensor_ring.kernels.math import MathKernel
from dtensor_ring.simulate import RankSimulator, simulate_ring

LAYOUTS = ("ring", "zigzag", "stripe")


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def graph_timed(fn, reps: int) -> float:
    """Median seconds of replaying ``fn`` captured in one CUDA graph (warmed up on a side
    stream first, as capture requires): what the ring costs with no host work per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, reps)


def kernels_alone(sim, reps) -> tuple[float, float]:
    """(forward, forward + backward) seconds of a rank's block kernels alone, called back to
    back on the blocks of its plan (no merges, accumulations or engine): what the rank's time
    would be if everything else were free."""
    out, lse = sim.forward()
    dout = torch.randn_like(sim.q)
    kvs = [(sim.k, sim.v), *sim.kv_deliveries]
    blocks = sim.blocks or DenseBlocks(sim.q.shape[1])  # dense plans: the engine's default
    take, take_lse = blocks.take, blocks.take_lse
    calls = [
        (blk, *(take(x, blk.q) for x in (sim.q, out, dout)), take_lse(lse, blk.q),
         *(take(x, blk.kv) for x in kvs[i]))
        for i, step in enumerate(sim.steps)
        for blk in step.blocks
    ]  # fmt: skip

    def fwd():
        for blk, q, _, _, _, k, v in calls:
            blocks.forward(sim.kernel, q, k, v, blk, sim.scale)

    def fwd_bwd():
        fwd()
        for blk, q, o, do, lse_b, k, v in calls:
            blocks.backward(sim.kernel, do, q, k, v, o, lse_b, blk, sim.scale)

    return timed(fwd, reps), timed(fwd_bwd, reps)


def attn_flops(s_q: int, s_k: int, causal: bool, heads: int, head_dim: int) -> float:
    """Forward FLOPs of one ``[s_q x s_k]`` block (fwd+bwd is 3.5x)."""
    pairs = s_q * (s_q + 1) // 2 if causal else s_q * s_k
    return 4.0 * pairs * heads * head_dim


def qkv(S: int, a, dtype, device, gen):
    """Random q ``[1, S, H, D]``, k, v ``[1, S, H_kv, D]`` and dout."""
    q = torch.randn(1, S, a.heads, a.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (
        torch.randn(1, S, a.kv_heads, a.head_dim, generator=gen, device=device, dtype=dtype)
        for _ in "kv"
    )
    return q, k, v, torch.randn_like(q)


def kernel_times(kernel, q, k, v, dout, causal: bool, reps: int) -> tuple[float, float]:
    """(forward, forward+backward) seconds of one kernel call on these tensors."""
    scale = q.shape[-1] ** -0.5

    def fwd():
        return kernel.forward(q, k, v, causal=causal, scale=scale)

    def fwd_bwd():
        out, lse = fwd()
        kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    return timed(fwd, reps), timed(fwd_bwd, reps)


def gpu_ops(fn) -> int | None:
    """GPU operations (kernels, memsets, copies) one ``fn()`` issues, counted by torch.profiler
    after a warm-up call; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.count for e in prof.key_averages() if e.device_type == cuda)


def peak_bytes(fn) -> int:
    """Peak CUDA memory allocated during ``fn()`` above what was allocated before (0 on CPU)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_config(backend: str, tokens: int, a, device, gen) -> list[dict]:
    """All layouts at one (backend, tokens per rank): speed, plan limit, memory, prediction."""
    W, dtype = a.world_size, a.dtype
    kernel = get_kernel(backend)
    q, k, v, dout = qkv(W * tokens, a, dtype, device, gen)
    full_fwd, full_fwd_bwd = kernel_times(kernel, q, k, v, dout, True, a.reps)
    theo_fwd, theo_fwd_bwd = full_fwd / W, full_fwd_bwd / W
    # single-device attention on the same local token count (memory yardstick)
    ql, kl, vl, dl = (t[:, :tokens] for t in (q, k, v, dout))

    def local_fwd_bwd():
        out, lse = kernel.forward(ql, kl, vl, causal=True, scale=a.head_dim**-0.5)
        kernel.backward(dl, ql, kl, vl, out, lse, causal=True, scale=a.head_dim**-0.5)

    local_peak = peak_bytes(local_fwd_bwd)
    kv_bytes = 2 * tokens * a.kv_heads * a.head_dim * dtype.itemsize
    rows = []
    for layout in LAYOUTS:
        plan = make_plan(layout, W, causal=True)
        flops = plan.flops(tokens, heads=a.heads, head_dim=a.head_dim)
        rank = max(range(W), key=flops.__getitem__)
        sim = RankSimulator(q, k, v, layout=layout, world_size=W, rank=rank, backend=backend)
        dout_local = shard_local(dout, layout, rank, W)

        def sim_fwd_bwd(sim=sim, dout_local=dout_local):
            sim.forward()
            sim.backward(dout_local)

        t_fwd, t_fwd_bwd = timed(sim.forward, a.reps), timed(sim_fwd_bwd, a.reps)
        graphs, host = {}, {}
        if layout == "zigzag":  # issue #28 item 4: what the host does per call
            alone_fwd, alone_fwd_bwd = kernels_alone(sim, a.reps)
            host = dict(
                kernels_alone_fwd_ms=alone_fwd * 1e3,
                kernels_alone_fwd_bwd_ms=alone_fwd_bwd * 1e3,
                eff_fwd_kernels_alone=theo_fwd / alone_fwd,
                eff_fwd_bwd_kernels_alone=theo_fwd_bwd / alone_fwd_bwd,
                gpu_ops_fwd=gpu_ops(sim.forward),
                gpu_ops_fwd_bwd=gpu_ops(sim_fwd_bwd),
                host_fwd_ms=host_ms(sim.forward, calls=20),
                host_fwd_bwd_ms=host_ms(sim_fwd_bwd, calls=20),
            )
        if device.type == "cuda" and layout == "zigzag":
            try:
                g_fwd = graph_timed(sim.forward, a.reps)
                g_fwd_bwd = graph_timed(sim_fwd_bwd, a.reps)
                graphs = dict(
                    fwd_ms_graph=g_fwd * 1e3,
                    fwd_bwd_ms_graph=g_fwd_bwd * 1e3,
                    eff_fwd_graph=theo_fwd / g_fwd,
                    eff_fwd_bwd_graph=theo_fwd_bwd / g_fwd_bwd,
                )
            except Exception as e:  # not capturable with this backend: say why in the JSON
                graphs = dict(graph_error=f"{type(e).__name__}: {e}")
        # what the real exchangers add to the simulated rank (comm/p2p.py): two K/V receive sets,
        # and one fp32 dK/dV receive set (the step-0 accumulator, measured, is the other)
        exchanger_bytes = 2 * kv_bytes + kv_bytes * 4 // dtype.itemsize
        rank_peak = peak_bytes(sim_fwd_bwd) + exchanger_bytes
        rows.append(
            dict(
                backend=backend,
                layout=layout,
                tokens_per_rank=tokens,
                world_size=W,
                rank=rank,
                fwd_ms=t_fwd * 1e3,
                fwd_bwd_ms=t_fwd_bwd * 1e3,
                theoretic_fwd_ms=theo_fwd * 1e3,
                theoretic_fwd_bwd_ms=theo_fwd_bwd * 1e3,
                eff_fwd=theo_fwd / t_fwd,
                eff_fwd_bwd=theo_fwd_bwd / t_fwd_bwd,
                plan_limit=1.0 / plan.imbalance(tokens),
                predicted_eff_fwd=theo_fwd
                / predicted_time(plan, rank, tokens, t_fwd, kv_bytes, a.link_gbps),
                predicted_eff_fwd_bwd=theo_fwd_bwd
                / predicted_time(plan, rank, tokens, t_fwd_bwd, 3 * kv_bytes, a.link_gbps),
                peak_mem_ratio=rank_peak / local_peak if local_peak else None,
                peak_mem_mb=rank_peak / 2**20,
                local_peak_mem_mb=local_peak / 2**20,
                **graphs,
                **host,
            )
        )
    return rows


def predicted_time(plan, rank, tokens, measured_s, bytes_per_step, link_gbps) -> float:
    """Sum over steps of max(compute share of the measured time, one hop of transfers)."""
    pairs = plan.score_pairs(tokens)[rank]
    comm_s = bytes_per_step / (link_gbps * 1e9)
    return sum(
        max(measured_s * p / sum(pairs), comm_s if s + 1 < len(pairs) else 0.0)
        for s, p in enumerate(pairs)
    )


def block_throughput(backend: str, tokens: int, a, device, gen) -> list[dict]:
    """TFLOP/s of the ring's block shapes: causal diagonal, full, and half blocks."""
    kernel = get_kernel(backend)
    q, k, v, dout = qkv(tokens, a, a.dtype, device, gen)
    h = tokens // 2
    shapes = [
        ("diag causal", q, k, v, dout, True),
        ("full", q, k, v, dout, False),
        ("q x kv/2", q, k[:, :h], v[:, :h], dout, False),
        ("q/2 x kv", q[:, h:], k, v, dout[:, h:], False),
    ]
    rows = []
    for name, qq, kk, vv, dd, causal in shapes:
        fwd, fwd_bwd = kernel_times(kernel, qq, kk, vv, dd, causal, a.reps)
        fl = attn_flops(qq.shape[1], kk.shape[1], causal, a.heads, a.head_dim)
        rows.append(
            dict(
                backend=backend,
                block=name,
                tokens=tokens,
                fwd_tflops=fl / fwd / 1e12,
                fwd_bwd_tflops=3.5 * fl / fwd_bwd / 1e12,
            )
        )
    return rows


# How a ring's backward gets its block gradients (Note [Ring backward]), for backends that have
# more than the plain way: dq summed inside the kernel (BlockKernel.dq_accumulator), fp32 block
# gradients summed by the engine, or the kernel's plain backward (the input dtype).
IN_KERNEL, FP32, INPUT_DTYPE = "fp32, dq summed in the kernel", "fp32", "input dtype"
# flash-attn 4 as IN_KERNEL, each forward block through its Python wrapper (no replay)
WRAPPER_FORWARD = "fp32, dq summed in the kernel; forward by the wrapper"
# flash-attn 4 as IN_KERNEL, a varlen block whose rows are no one run merged by the engine
# (not where its rows lie: Note [Varlen blocks merged where their rows lie])
ENGINE_MERGES = "fp32, dq summed in the kernel; engine merges"


@contextlib.contextmanager
def block_grads_mode(backend: str, mode: str):
    """The backend's block gradients (and flash-attn 4's forward launch) as ``mode`` for the
    duration (instance attributes over the class's): the baselines of the fp32 and in-kernel
    sums and of the replayed forward (Note [flash-attn 4's forward, replayed]), in one run.
    In ``IN_KERNEL`` flash-attn 4 sums a varlen rank's dq in its kernel too (Note [A varlen
    dq accumulated inside flash-attn 4])."""
    from dtensor_ring.kernels import flash_attn4_launch

    kernel = get_kernel(backend)
    if mode in (FP32, INPUT_DTYPE):
        kernel.dq_accumulator = lambda *args, **kwargs: None
        kernel.dq_accumulator_varlen = lambda *args, **kwargs: None
    if mode == INPUT_DTYPE:
        kernel.unrounded_grads = False
    if mode == ENGINE_MERGES:
        kernel.merges_by_document = False
    flash_attn4_launch.REPLAY = mode != WRAPPER_FORWARD
    try:
        yield
    finally:
        for name in (
            "unrounded_grads",
            "dq_accumulator",
            "dq_accumulator_varlen",
            "merges_by_document",
        ):
            kernel.__dict__.pop(name, None)
        flash_attn4_launch.REPLAY = True


def block_grads_modes(
    backend: str, compare: bool, rounded_first: bool = False, launch: bool = False
) -> list[str]:
    """The modes to measure: the backend's own first (or last, ``rounded_first``); with
    ``compare`` every other block-gradient mode it has; with ``launch`` flash-attn 4's forward
    through its wrapper too."""
    kernel = get_kernel(backend)
    modes = [INPUT_DTYPE]
    if kernel.unrounded_grads:
        modes.insert(0, FP32)
    if type(kernel).dq_accumulator is not BlockKernel.dq_accumulator:
        modes.insert(0, IN_KERNEL)
    modes = (modes[::-1] if rounded_first else modes) if compare else modes[:1]
    return modes + [WRAPPER_FORWARD] * (launch and backend == "flash_attn4")


def precision(backend: str, mode: str, a, device, gen) -> list[dict]:
    """Errors of the whole simulated ring vs fp64, relative to the single-device kernel."""
    W, S = a.world_size, a.world_size * a.precision_tokens
    q, k, v, dout = qkv(S, a, a.dtype, device, gen)
    math64 = MathKernel()
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = math64.forward(*full, causal=True, scale=a.head_dim**-0.5)
    ref = (ref_out, *torch.autograd.grad(ref_out, full, dout.double()))
    kernel = get_kernel(backend)
    base_out, base_lse = kernel.forward(q, k, v, causal=True, scale=a.head_dim**-0.5)
    base = (
        base_out,
        *kernel.backward(dout, q, k, v, base_out, base_lse, causal=True, scale=a.head_dim**-0.5),
    )
    rows = []
    for layout in LAYOUTS:
        out, _, dq, dk, dv = simulate_ring(
            q, k, v, dout, layout=layout, world_size=W, backend=backend
        )
        for name, got, b, r in zip(
            ("out", "dq", "dk", "dv"), (out, dq, dk, dv), base, ref, strict=True
        ):
            err, base_err = (got.double() - r).abs(), (b.double() - r).abs()
            rows.append(
                dict(
                    backend=backend,
                    block_grads=mode,
                    layout=layout,
                    tensor=name,
                    max_err=err.max().item(),
                    mean_err=err.mean().item(),
                    ratio_max=err.max().item() / base_err.max().item(),
                    ratio_mean=err.mean().item() / base_err.mean().item(),
                )
            )
    return rows


def merge_bench(tokens: int, a, device, gen) -> list[dict]:
    """The merge alone: the default (fused on CUDA) against eager torch ops, time and agreement."""
    from dtensor_ring.kernels.merge import merge_, merge_eager_

    shape = (1, tokens, a.heads, a.head_dim)
    acc = torch.randn(shape, generator=gen, device=device)
    lse = torch.randn(1, a.heads, tokens, generator=gen, device=device)
    blk = torch.randn(shape, generator=gen, device=device).to(a.dtype)
    blk_lse = torch.randn(1, a.heads, tokens, generator=gen, device=device)
    rows, results = [], {}
    for name, fn in (("default", merge_), ("eager", merge_eager_)):
        out, out_lse = acc.clone(), lse.clone()
        fn(out, out_lse, blk, blk_lse)
        results[name] = (out.clone(), out_lse.clone())
        t = timed(lambda fn=fn, o=out, lo=out_lse: fn(o, lo, blk, blk_lse), a.reps)
        moved = acc.numel() * 8 + blk.numel() * blk.element_size() + lse.numel() * 12
        rows.append(dict(merge=name, tokens=tokens, ms=t * 1e3, gbps=moved / t / 1e9))
    (o1, l1), (o2, l2) = results["default"], results["eager"]
    for r in rows:
        r["max_diff_vs_eager"] = max((o1 - o2).abs().max().item(), (l1 - l2).abs().max().item())
    return rows


def eager_merge_rings(backend: str, tokens: int, a, device, gen) -> list[dict]:
    """The zigzag ring with the eager merge, to show what the fused merge buys."""
    import dtensor_ring.engine.blocks as engine
    from dtensor_ring.kernels.merge import merge_eager_

    default, engine.merge_ = engine.merge_, merge_eager_
    try:
        rows = [r for r in bench_config(backend, tokens, a, device, gen) if r["layout"] == "zigzag"]
    finally:
        engine.merge_ = default
    return [dict(r, layout="zigzag (eager merge)") for r in rows]


VARLEN_LOCAL_CU_SEQLENS = (  # the seed benchmark's local document boundaries (8192 tokens)
    (0, 8192),
    (0, 256, 7648, 8192),
    (0, 4096, 8192),
    (0, 3104, 6304, 7904, 8064, 8192),
)


class _LocalGather:
    """Stands in for llama3's all-gather on one device: the gathered K/V (every rank's local
    tokens in rank order) are already here; ``wait`` returns them stacked ``[W*L, 2, s, D]``."""

    def __init__(self, k_gathered, v_gathered, stride: int):
        self.kv, self.stride = torch.stack([k_gathered, v_gathered], dim=1), stride

    def start(self, h: int):
        return self

    def wait(self):
        return self.kv[:, :, : self.stride]  # every group times the same; no copy


class _LocalReduceScatter:
    """Stands in for llama3's reduce-scatter of dK/dV: keeps this rank's rows (``[W*L, ...]``
    -> ``[L, ...]``) as the others' zero contributions would; a copy of the same size."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, result, full, group=None, async_op=False):
        result.copy_(full.view(-1, *result.shape)[self.rank])
        return self

    def wait(self):
        return None


def _llama3_run(ql, kl, vl, k_gathered, v_gathered, meta, kernel, scale, a, rank, dout=None):
    """One rank's llama3 forward (any layout's metadata), and with ``dout`` forward+backward,
    with the collectives stood in for: ``(fwd seconds, fwd+bwd seconds or None, out)``."""
    import dtensor_ring.engine.llama3 as llama3

    defaults = llama3._KVGather, llama3.reduce_scatter_single
    gathered = _LocalGather(k_gathered, v_gathered, a.kv_heads)
    llama3._KVGather = lambda k_, v_, stride, group: gathered
    llama3.reduce_scatter_single = _LocalReduceScatter(rank)
    try:

        def fwd():
            return llama3.llama3_forward(ql, kl, vl, meta, a.kv_heads, None, kernel, scale)

        def fwd_bwd():
            out, lse = fwd()
            llama3.llama3_backward(
                dout, ql, kl, vl, out, lse, meta, a.kv_heads, None, kernel, scale
            )

        t_fwd_bwd = None if dout is None else timed(fwd_bwd, a.reps)
        return timed(fwd, a.reps), t_fwd_bwd, fwd()[0]
    finally:
        llama3._KVGather, llama3.reduce_scatter_single = defaults


def varlen_rings(local_bounds, a, device, gen) -> list[dict]:
    """ring / zigzag / balanced-documents varlen (simulated slowest rank; the documents also by
    their all-gather) and llama3 / llama3_zigzag (forward of the slowest rank) vs one full
    call."""
    from dtensor_ring import (
        GatherSimulator,
        document_layout,
        llama3_flash_attn_prepare_cu_seqlens,
        shard_varlen,
        varlen_balance,
    )
    from dtensor_ring.schedule.llama3 import gather_meta, llama3_meta

    W, backend = a.world_size, "cuda_flash" if device.type == "cuda" else "math"
    kernel = get_kernel(backend)
    bounds = [b * W for b in local_bounds]
    scale = a.head_dim**-0.5
    q, k, v, dout = (t[0] for t in qkv(bounds[-1], a, a.dtype, device, gen))  # [T, H, D]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    n = max(b - a_ for a_, b in zip(bounds[:-1], bounds[1:], strict=True))

    def full_fwd():
        return kernel.forward_varlen(q, k, v, cu, cu, n, n, causal=True, scale=scale)

    def full_fwd_bwd():
        out, lse = full_fwd()
        kernel.backward_varlen(dout, q, k, v, out, lse, cu, cu, n, n, causal=True, scale=scale)

    theo_fwd, theo_fwd_bwd = timed(full_fwd, a.reps) / W, timed(full_fwd_bwd, a.reps) / W
    balance = varlen_balance(bounds, W, causal=True)
    row = dict(
        local_cu_seqlens=list(local_bounds),
        world_size=W,
        backend=backend,
        theoretic_fwd_ms=theo_fwd * 1e3,
        theoretic_fwd_bwd_ms=theo_fwd_bwd * 1e3,
    )
    balanced = document_layout(bounds, W)  # whole documents where they fit
    balance["documents"] = list(balanced.work)
    row["documents_cut"] = len(balanced.split)
    for name, layout in (("ring", "ring"), ("zigzag", "zigzag"), ("documents", balanced)):
        rank = max(range(W), key=balance[name].__getitem__)
        sim = RankSimulator(
            q, k, v, layout=layout, world_size=W, rank=rank, backend=backend, cu_seqlens=bounds
        )
        dl = dout[: sim.q.shape[0]]  # any values of the local shape time the same

        def fwd_bwd(sim=sim, dl=dl):
            sim.forward()
            sim.backward(dl)

        t_fwd, t_fwd_bwd = timed(sim.forward, a.reps), timed(fwd_bwd, a.reps)
        row[f"{name}_eff_fwd"] = theo_fwd / t_fwd
        row[f"{name}_eff_fwd_bwd"] = theo_fwd_bwd / t_fwd_bwd
        row[f"{name}_limit"] = sum(balance[name]) / W / max(balance[name])
    # the same placed documents by their all-gather (Note [Gathering what placed documents need])
    rank = max(range(W), key=balance["documents"].__getitem__)
    sim = GatherSimulator(
        q, k, v, layout=balanced, world_size=W, rank=rank, backend=backend, cu_seqlens=bounds
    )
    dl = dout[: sim.q.shape[0]]

    def gather_fwd_bwd(sim=sim, dl=dl):
        sim.forward()
        sim.backward(dl)

    row["documents_gather_eff_fwd"] = theo_fwd / timed(sim.forward, a.reps)
    row["documents_gather_eff_fwd_bwd"] = theo_fwd_bwd / timed(gather_fwd_bwd, a.reps)
    rank = max(range(W), key=balance["llama3"].__getitem__)
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
    L = bounds[-1] // W
    meta = llama3_meta(
        cu_q, cu_k, max_q, max_k, k_slice.start, k_slice.stop, L, True, rank, W, device
    )
    ql, kl, vl = (t[rank * L : (rank + 1) * L] for t in (q, k, v))
    t_fwd, _, _ = _llama3_run(ql, kl, vl, k, v, meta, kernel, scale, a, rank)
    row["llama3_eff_fwd"] = theo_fwd / t_fwd
    row["llama3_limit"] = sum(balance["llama3"]) / W / max(balance["llama3"])
    # balanced all-gather: zigzag's tokens (documents must be multiples of 2W)
    if "llama3_zigzag" in balance:
        rank = max(range(W), key=balance["llama3_zigzag"].__getitem__)
        shards = [[shard_varlen(t, cu, "llama3_zigzag", r, W)[0] for r in range(W)] for t in (k, v)]
        ql = shard_varlen(q, cu, "llama3_zigzag", rank, W)[0]
        cu_local = torch.tensor(local_bounds, dtype=torch.int32, device=device)
        meta = gather_meta(cu_local, None, L, "llama3_zigzag", True, rank, W, device)
        k_g, v_g = (torch.cat(parts) for parts in shards)  # the all-gather's result
        t_fwd, t_fwd_bwd, out = _llama3_run(
            ql,
            shards[0][rank],
            shards[1][rank],
            k_g,
            v_g,
            meta,
            kernel,
            scale,
            a,
            rank,
            dout[: ql.shape[0]],
        )
        row["llama3_zigzag_eff_fwd"] = theo_fwd / t_fwd
        row["llama3_zigzag_eff_fwd_bwd"] = theo_fwd_bwd / t_fwd_bwd
        # the rank's rows against the full call's (same kernel): kernel rounding only
        full_out = shard_varlen(full_fwd()[0], cu, "llama3_zigzag", rank, W)[0]
        row["llama3_zigzag_max_diff_vs_full"] = float((out.float() - full_out.float()).abs().max())
        row["llama3_zigzag_limit"] = (
            sum(balance["llama3_zigzag"]) / W / max(balance["llama3_zigzag"])
        )
    return [row]


def policy_rows(backend: str, tokens: int, a, device, gen) -> list[dict]:
    """The algorithms ``layout="auto"`` chooses from, each as its slowest rank with the
    collectives stood in for (as the rings: no communication), against the cost model's
    prediction with an instant link (Note [Choosing ring, all-gather or Ulysses]): does the
    model pick the fastest? ``ring``: zigzag; ``all_gather``: llama3_zigzag with one head group;
    ``ulysses``: the one kernel over the whole sequence with the rank's heads (its all-to-alls'
    reshuffling copies are not timed)."""
    from dtensor_ring import Machine, choose_algorithm, shard_varlen
    from dtensor_ring.schedule.cost import kv_repeat
    from dtensor_ring.schedule.llama3 import gather_meta

    W, scale = a.world_size, a.head_dim**-0.5
    kernel = get_kernel(backend)
    q, k, v, dout = qkv(W * tokens, a, a.dtype, device, gen)
    plan = make_plan("zigzag", W, causal=True)
    flops = plan.flops(tokens, heads=a.heads, head_dim=a.head_dim)
    rank = max(range(W), key=flops.__getitem__)
    sim = RankSimulator(q, k, v, layout="zigzag", world_size=W, rank=rank, backend=backend)
    dout_local = shard_local(dout, "zigzag", rank, W)

    def ring_fwd_bwd():
        sim.forward()
        sim.backward(dout_local)

    measured = {"ring": (timed(sim.forward, a.reps), timed(ring_fwd_bwd, a.reps))}
    q1, k1, v1, d1 = (t[0] for t in (q, k, v, dout))  # one row: one document
    cu = torch.tensor([0, W * tokens], dtype=torch.int32, device=device)
    shards = [[shard_varlen(t, cu, "llama3_zigzag", r, W)[0] for r in range(W)] for t in (k1, v1)]
    ql = shard_varlen(q1, cu, "llama3_zigzag", 0, W)[0]
    cu_local = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    meta = gather_meta(cu_local, None, tokens, "llama3_zigzag", True, 0, W, device)
    t_fwd, t_fwd_bwd, _ = _llama3_run(
        ql,
        shards[0][0],
        shards[1][0],
        *(torch.cat(s) for s in shards),
        meta,
        kernel,
        scale,
        a,
        0,
        d1[:tokens],
    )
    measured["all_gather"] = (t_fwd, t_fwd_bwd)
    if a.heads % W == 0:
        h, h_kv = a.heads // W, a.kv_heads * kv_repeat(a.kv_heads, W) // W
        measured["ulysses"] = kernel_times(
            kernel, q[:, :, :h], k[:, :, :h_kv], v[:, :, :h_kv], dout[:, :, :h], True, a.reps
        )
    instant = Machine(link_gbps=1e12, latency_ms=0.0)
    rows = []
    for i, what in enumerate(("fwd", "fwd_bwd")):
        choice = choose_algorithm(
            W * tokens,
            W,
            heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            itemsize=a.dtype.itemsize,
            backward=what == "fwd_bwd",
            speeds=dict.fromkeys(measured, kernel.relative_speed),  # one kernel for all here
            machine=instant,
        )
        times = {name: t[i] * 1e3 for name, t in measured.items()}
        fastest = min(times, key=times.__getitem__)
        rows.append(
            dict(
                backend=backend,
                tokens_per_rank=tokens,
                world_size=W,
                what=what,
                measured_ms=times,
                predicted_ms=choice.predicted_ms,
                chosen=choice.algorithm,
                fastest=fastest,
                chosen_vs_fastest=times[choice.algorithm] / times[fastest],
            )
        )
    return rows


def plots(results: dict, out_dir: str) -> None:
    """Efficiency vs tokens per rank (per layout and backend) and memory bars, as PNGs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["rings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key in zip(axes, ("eff_fwd", "eff_fwd_bwd"), strict=True):
        for backend in sorted({r["backend"] for r in rows}):
            for layout in LAYOUTS:
                pts = [
                    (r["tokens_per_rank"], r[key])
                    for r in rows
                    if r["backend"] == backend and r["layout"] == layout
                ]
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{backend} {layout}")
        ax.set(xscale="log", xlabel="tokens per rank", title=key, ylim=(0, 1.1))
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0].set_ylabel("fraction of theoretic (full-sequence kernel / W)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "efficiency.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    mem = [r for r in rows if r["peak_mem_ratio"]]
    ax.bar(
        [f"{r['backend'][:5]} {r['layout']}\n{r['tokens_per_rank']}" for r in mem],
        [r["peak_mem_ratio"] for r in mem],
    )
    ax.axhline(1.3, color="red", lw=0.8, label="target 1.3x")
    ax.set(ylabel="peak memory / single-device", title="one rank, fwd+bwd")
    ax.tick_params(axis="x", labelsize=5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory.png"), dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the code paths)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--backends", default=None, help="comma list (default: all able ones)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens", default="2048,4096,8192,16384", help="tokens per rank")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--precision-tokens", type=int, default=512)
    p.add_argument(
        "--compare-rounded",
        action="store_true",
        help="also measure backends with fp32 block gradients with their plain backward",
    )
    p.add_argument("--rounded-first", action="store_true", help="that one first")
    p.add_argument(
        "--compare-launch",
        action="store_true",
        help="also measure flash-attn 4's rings with every forward block through its wrapper",
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--link-gbps", type=float, default=450.0, help="GB/s per direction")
    p.add_argument("--overhead-seq", default="1024,8192", help="W = 1 fixed cost at these S")
    p.add_argument("--only", choices=("varlen",), default=None, help="run that part alone")
    a = p.parse_args()
    if a.smoke:
        a.world_size, a.tokens, a.heads, a.kv_heads, a.head_dim = 3, "8,16", 4, 2, 16
        a.precision_tokens, a.reps = 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    a.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.makedirs(a.out, exist_ok=True)
    probe = torch.empty(1, 1, a.heads, a.head_dim, dtype=a.dtype, device=device)
    probe_kv = torch.empty(1, 1, a.kv_heads, a.head_dim, dtype=a.dtype, device=device)
    from dtensor_ring.kernels import BACKENDS

    call = KernelCall.of(probe, probe_kv)
    backends = (
        a.backends.split(",")
        if a.backends
        else [b.name for b in BACKENDS if b.name != "math" and not b.unsupported_reason(call)]
    )
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = [int(t) for t in a.tokens.split(",")]
    results = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        config=dict(
            world_size=a.world_size,
            heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            dtype=str(a.dtype),
            tokens=tokens,
        ),
        blocks=[],
        rings=[],
        precision=[],
        merges=[],
        varlen=[],
        policy=[],
        overhead=[],
        errors=[],
    )
    # a run stopped by SIGTERM (e.g. `timeout`) still writes what it measured, marked partial
    signal.signal(signal.SIGTERM, _stop)
    try:
        for bounds in VARLEN_LOCAL_CU_SEQLENS if not a.smoke else ((0, 4, 12, 16),):
            try:
                results["varlen"] += varlen_rings(bounds, a, device, gen)
            except Exception as e:
                results["errors"].append(f"varlen {bounds}: {type(e).__name__}: {e}")
        if a.only is None:
            run_the_rest(results, a, device, gen, backends, tokens)
    except _Stopped:
        results["partial"] = True
    with open(os.path.join(a.out, "bench_single_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    if results.get("partial"):
        raise SystemExit("stopped: partial results written")
    plots(results, a.out)
    print_tables(results)
    if a.smoke and results["errors"]:
        raise SystemExit("\n".join(results["errors"]))


class _Stopped(BaseException):
    """SIGTERM arrived (not an Exception: the per-part handlers must not swallow it)."""


def _stop(signum, frame) -> None:
    raise _Stopped


def run_the_rest(results: dict, a, device, gen, backends, tokens) -> None:
    """Every part but the varlen rows, into ``results``."""
    try:
        results["merges"] = merge_bench(tokens[-1] if a.smoke else 8192, a, device, gen)
        if device.type == "cuda":
            results["rings"] += eager_merge_rings(backends[0], 8192, a, device, gen)
    except Exception as e:
        results["errors"].append(f"merge: {type(e).__name__}: {e}")
    if device.type == "cuda":  # one discarded pass: cuDNN plans, Triton JIT, clocks up
        bench_config(backends[0], tokens[0], a, device, gen)
    for backend in backends:
        for t in tokens:
            try:
                results["blocks"] += block_throughput(backend, t, a, device, gen)
            except Exception as e:  # record and go on: one failing backend keeps the rest
                results["errors"].append(f"{backend} {t} blocks: {type(e).__name__}: {e}")
            modes = block_grads_modes(backend, a.compare_rounded, a.rounded_first, a.compare_launch)
            for mode in modes:
                try:
                    with block_grads_mode(backend, mode):
                        rows = bench_config(backend, t, a, device, gen)
                        results["rings"] += [dict(r, block_grads=mode) for r in rows]
                except Exception as e:
                    results["errors"].append(f"{backend} {t} rings: {type(e).__name__}: {e}")
        for mode in block_grads_modes(backend, a.compare_rounded, a.rounded_first):
            try:
                with block_grads_mode(backend, mode):
                    results["precision"] += precision(backend, mode, a, device, gen)
            except Exception as e:
                results["errors"].append(f"{backend} precision: {type(e).__name__}: {e}")
    # the all-gather needs a varlen kernel (the smoke run: the math kernel)
    varlen_able = [b for b in backends if get_kernel(b).supports_varlen] + ["math"] * a.smoke
    for t in tokens if varlen_able else ():
        try:
            results["policy"] += policy_rows(varlen_able[0], t, a, device, gen)
        except Exception as e:
            results["errors"].append(f"{varlen_able[0]} {t} policy: {type(e).__name__}: {e}")
    against_fastest_kernel(results["rings"])
    try:
        from bench_overhead import CONTENDERS, measure_overhead

        seqs = [int(s) for s in a.overhead_seq.split(",")] if not a.smoke else [16]
        results["overhead"] = measure_overhead(
            seqs,
            a.reps,
            [c for c in CONTENDERS if "+" not in c],  # eager contenders
            device,
            a.dtype,
            (a.heads, a.kv_heads, a.head_dim),
            host_calls=20 if a.smoke else 200,
        )
    except Exception as e:
        results["errors"].append(f"overhead: {type(e).__name__}: {e}")


def against_fastest_kernel(rings: list[dict]) -> None:
    """Add ``eff_fwd_vs_best`` / ``eff_fwd_bwd_vs_best`` to every ring row: theoretic from the
    fastest full-sequence kernel of any backend at the same size (``best_fwd_backend``,
    ``best_fwd_bwd_backend``), not the row's own backend."""
    for what in ("fwd", "fwd_bwd"):
        best: dict[int, dict] = {}
        for r in rings:
            t = r["tokens_per_rank"]
            if t not in best or r[f"theoretic_{what}_ms"] < best[t][f"theoretic_{what}_ms"]:
                best[t] = r
        for r in rings:
            b = best[r["tokens_per_rank"]]
            r[f"eff_{what}_vs_best"] = b[f"theoretic_{what}_ms"] / r[f"{what}_ms"]
            r[f"best_{what}_backend"] = b["backend"]


def print_tables(results: dict) -> None:
    """The short tables: blocks, rings, precision (printed last)."""
    print(
        f"\n{results['device']}, torch {results['torch']}, CUDA {results['cuda']}, "
        f"{results['date']}, {results['config']}"
    )
    print(f"\n{'backend':<11}{'block':<13}{'tokens':>7}{'fwd TF/s':>10}{'f+b TF/s':>10}")
    for r in results["blocks"]:
        print(
            f"{r['backend']:<11}{r['block']:<13}{r['tokens']:>7}{r['fwd_tflops']:>10.1f}"
            f"{r['fwd_bwd_tflops']:>10.1f}"
        )
    print(
        f"\n{'backend':<11}{'layout':<21}{'tok/rank':>8}{'fwd ms':>8}{'eff fwd':>8}"
        f"{'f+b ms':>8}{'eff f+b':>8}{'limit':>7}{'pred f':>7}{'pred fb':>8}{'mem x':>6}"
        f"{'vs best f/fb':>14}{'graph f/fb':>13}  block grads"
    )
    for r in results["rings"]:
        mem = f"{r['peak_mem_ratio']:.2f}" if r["peak_mem_ratio"] else "-"
        print(
            f"{r['backend']:<11}{r['layout']:<21}{r['tokens_per_rank']:>8}{r['fwd_ms']:>8.2f}"
            f"{r['eff_fwd']:>8.1%}{r['fwd_bwd_ms']:>8.2f}{r['eff_fwd_bwd']:>8.1%}"
            f"{r['plan_limit']:>7.1%}{r['predicted_eff_fwd']:>7.1%}"
            f"{r['predicted_eff_fwd_bwd']:>8.1%}{mem:>6}"
            f"{r['eff_fwd_vs_best']:>8.1%}/{r['eff_fwd_bwd_vs_best']:<5.0%}"
            + (
                f"{r['eff_fwd_graph']:>7.1%}/{r['eff_fwd_bwd_graph']:.0%}"
                if "eff_fwd_graph" in r
                else ("  " + r["graph_error"][:30] if "graph_error" in r else "")
            )
            + f"  {r.get('block_grads', '')}"
        )
    print(
        f"\n{'zigzag, per call':<44}{'tok/rank':>8}{'GPU ops f/fb':>14}{'host ms f/fb':>16}"
        f"{'kernels alone ms f/fb':>24}{'eff':>14}"
    )
    for r in results["rings"]:
        if "host_fwd_ms" in r:
            ops = f"{r['gpu_ops_fwd']}/{r['gpu_ops_fwd_bwd']}" if r["gpu_ops_fwd"] else "-"
            print(
                f"{r['backend'] + ' ' + r.get('block_grads', ''):<44}{r['tokens_per_rank']:>8}"
                f"{ops:>14}{r['host_fwd_ms']:>8.2f}/{r['host_fwd_bwd_ms']:<7.2f}"
                f"{r['kernels_alone_fwd_ms']:>16.2f}/{r['kernels_alone_fwd_bwd_ms']:<7.2f}"
                f"{r['eff_fwd_kernels_alone']:>7.1%}/{r['eff_fwd_bwd_kernels_alone']:.1%}"
            )
    print(
        f"\n{'backend':<11}{'layout':<8}{'tensor':<7}{'max err':>10}{'ratio max':>10}"
        f"{'ratio mean':>11}  block grads"
    )
    for r in results["precision"]:
        print(
            f"{r['backend']:<11}{r['layout']:<8}{r['tensor']:<7}{r['max_err']:>10.2e}"
            f"{r['ratio_max']:>10.2f}{r['ratio_mean']:>11.2f}  {r['block_grads']}"
        )
    print(
        f"\n{'local cu_seqlens':<36}{'ring f':>8}{'ring fb':>8}{'zz f':>8}{'zz fb':>8}"
        f"{'docs f':>8}{'docs fb':>8}{'gath f':>8}{'gath fb':>8}{'llama3 f':>9}{'l3zz f':>8}"
        f"{'l3zz fb':>8}"
        f"{'limits r/zz/l3/l3zz':>22}"
    )
    for r in results["varlen"]:
        l3zz = r.get("llama3_zigzag_limit")  # absent: documents not multiples of 2W
        limits = f"{r['ring_limit']:.0%}/{r['zigzag_limit']:.0%}/{r['llama3_limit']:.0%}/" + (
            "-" if l3zz is None else f"{l3zz:.0%}"
        )
        l3zz_eff = r.get("llama3_zigzag_eff_fwd")
        l3zz_fb = r.get("llama3_zigzag_eff_fwd_bwd")
        print(
            f"{str(r['local_cu_seqlens']):<36}{r['ring_eff_fwd']:>8.1%}"
            f"{r['ring_eff_fwd_bwd']:>8.1%}{r['zigzag_eff_fwd']:>8.1%}"
            f"{r['zigzag_eff_fwd_bwd']:>8.1%}{r['documents_eff_fwd']:>8.1%}"
            f"{r['documents_eff_fwd_bwd']:>8.1%}{r['documents_gather_eff_fwd']:>8.1%}"
            f"{r['documents_gather_eff_fwd_bwd']:>8.1%}{r['llama3_eff_fwd']:>9.1%}"
            + ("       -" if l3zz_eff is None else f"{l3zz_eff:>8.1%}")
            + ("       -" if l3zz_fb is None else f"{l3zz_fb:>8.1%}")
            + f"{limits:>22}"
        )
    print(
        f"\n{'layout=auto':<12}{'tok/rank':>8} {'what':<8}{'measured ms (ring/ag/uly)':>27}"
        f"{'predicted':>22}  chosen / fastest"
    )
    for r in results["policy"]:
        m, p = r["measured_ms"], r["predicted_ms"]
        print(
            f"{r['backend']:<11}{r['tokens_per_rank']:>8} {r['what']:<8}"
            f"{'/'.join(f'{m[x]:.2f}' for x in m):>27}{'/'.join(f'{p[x]:.2f}' for x in p):>22}"
            f"  {r['chosen']} / {r['fastest']} ({r['chosen_vs_fastest']:.2f}x)"
        )
    if results["overhead"]:
        from bench_overhead import print_overhead

        print()
        print_overhead(results["overhead"])
    for r in results["merges"]:
        print(
            f"merge {r['merge']:<8} {r['tokens']} rows: {r['ms']:.3f} ms, {r['gbps']:.0f} GB/s, "
            f"max diff vs eager {r['max_diff_vs_eager']:.1e}"
        )
    for e in results["errors"]:
        print("ERROR", e)


if __name__ == "__main__":
    main()
