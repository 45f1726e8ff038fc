"""Sliding-window ring attention on one GPU: time against window size at a fixed sequence.

    python benchmarks/bench_window.py --out results/      # one H200, ~2 min
    python benchmarks/bench_window.py --smoke             # CPU, tiny, seconds (in tests)

At W ranks (default 8) x 8192 tokens per rank, causal, for windows from a few hundred tokens
to the whole sequence, and for the ring and zigzag layouts, it measures in one run:

* the slowest rank of the windowed plan (by the plan's FLOPs), run by the real engine with a
  simulated communicator (``dtensor_ring.simulate``): forward and forward+backward time;
* the baseline, in the same run: the single-GPU kernel on the full sequence with the same
  window, divided by W ("theoretic"), and the unwindowed ring's slowest rank;
* the plan's cost model: K/V transfers per rank (``Plan.kv_transfers``) and the slowest rank's
  share of the windowed FLOPs;
* precision at a smaller size: max error of out, dq, dk, dv of the whole simulated ring
  against an fp64 reference, as a ratio to the single-device kernel's error.

It prints a table and writes ``bench_window.json`` (and ``bench_window.png`` if matplotlib is
there) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from bench_single_gpu import qkv, timed

from dtensor_ring import make_plan, shard_local
from dtensor_ring.kernels import KernelCall, select_kernel
from dtensor_ring.kernels.math import MathKernel
from dtensor_ring.resolve import normalize_window
from dtensor_ring.simulate import RankSimulator, simulate_ring


def full_kernel_times(kernel, q, k, v, dout, window, reps) -> tuple[float, float]:
    """(fwd, fwd+bwd) seconds of one causal kernel call on the whole sequence."""
    scale = q.shape[-1] ** -0.5
    causal = window is None

    def fwd():
        return kernel.forward(q, k, v, causal=causal, scale=scale, window=window)

    def fwd_bwd():
        out, lse = fwd()
        kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window)

    return timed(fwd, reps), timed(fwd_bwd, reps)


def rank_times(q, k, v, dout, layout, window_size, backend, a) -> dict:
    """Time the slowest rank of ``layout``'s plan under ``window_size``."""
    W, n = a.world_size, q.shape[1] // a.world_size
    _, window = normalize_window(window_size, True, q.shape[1])
    plan = make_plan(layout, W, True, window, n if window else None)
    flops = plan.flops(n, heads=a.heads, head_dim=a.head_dim)
    rank = max(range(W), key=flops.__getitem__)
    sim = RankSimulator(
        q, k, v, layout=layout, world_size=W, rank=rank, backend=backend, window_size=window_size
    )
    dout_local = shard_local(dout, layout, rank, W)

    def fwd_bwd():
        sim.forward()
        sim.backward(dout_local)

    return dict(
        rank=rank,
        steps=len(plan.offsets),
        kv_transfers=plan.kv_transfers(),
        rank_tflop=flops[rank] / 1e12,
        total_tflop=sum(flops) / 1e12,
        fwd_ms=timed(sim.forward, a.reps) * 1e3,
        fwd_bwd_ms=timed(fwd_bwd, a.reps) * 1e3,
    )


def bench(a, device, gen) -> list[dict]:
    W, S = a.world_size, a.world_size * a.tokens
    q, k, v, dout = qkv(S, a, a.dtype, device, gen)
    # one window-capable kernel for every measurement, the unwindowed ring included
    kernel = select_kernel(KernelCall.of(q, k, window=True), a.backend)
    rows = []
    unwindowed = {
        layout: rank_times(q, k, v, dout, layout, (-1, -1), kernel.name, a) for layout in a.layouts
    }
    for left in a.windows:
        _, window = normalize_window((left, 0), True, S)
        full_fwd, full_fwd_bwd = full_kernel_times(kernel, q, k, v, dout, window, a.reps)
        for layout in a.layouts:
            r = rank_times(q, k, v, dout, layout, (left, 0), kernel.name, a)
            rows.append(
                dict(
                    layout=layout,
                    window=left,
                    backend=kernel.name,
                    tokens_per_rank=a.tokens,
                    world_size=W,
                    **r,
                    theoretic_fwd_ms=full_fwd / W * 1e3,
                    theoretic_fwd_bwd_ms=full_fwd_bwd / W * 1e3,
                    eff_fwd=full_fwd / W * 1e3 / r["fwd_ms"],
                    eff_fwd_bwd=full_fwd_bwd / W * 1e3 / r["fwd_bwd_ms"],
                    vs_unwindowed_fwd_bwd=r["fwd_bwd_ms"] / unwindowed[layout]["fwd_bwd_ms"],
                )
            )
    return rows


def precision(a, device, gen) -> list[dict]:
    """Errors of the whole simulated ring vs fp64, as a ratio to the single-device kernel's."""
    W, S = a.world_size, a.world_size * a.precision_tokens
    q, k, v, dout = qkv(S, a, a.dtype, device, gen)
    kernel = select_kernel(KernelCall.of(q, k, window=True), a.backend)
    scale = a.head_dim**-0.5
    rows = []
    for left in a.precision_windows:
        window = (left, 0)
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = MathKernel().forward(*ref, causal=False, scale=scale, window=window)
        ref_grads = torch.autograd.grad(ref_out, ref, dout.double())
        single_out, lse = kernel.forward(q, k, v, causal=False, scale=scale, window=window)
        single = [
            single_out,
            *kernel.backward(
                dout, q, k, v, single_out, lse, causal=False, scale=scale, window=window
            ),
        ]
        expected = [ref_out, *ref_grads]
        single_err = [
            (s.double() - e).abs().max().item() for s, e in zip(single, expected, strict=True)
        ]
        for layout in a.layouts:
            out, _, *grads = simulate_ring(
                q, k, v, dout, layout=layout, world_size=W, backend=kernel.name, window_size=window
            )
            err = [
                (x.double() - e).abs().max().item()
                for x, e in zip([out, *grads], expected, strict=True)
            ]
            rows.append(
                dict(
                    layout=layout,
                    window=left,
                    tokens=S,
                    max_err=max(err),
                    single_max_err=max(single_err),
                    ratio_max=max(e / max(s, 1e-30) for e, s in zip(err, single_err, strict=True)),
                )
            )
    return rows


def plot(results: dict, out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in {r["layout"] for r in results["rows"]}:
        rows = sorted(
            (r for r in results["rows"] if r["layout"] == layout),
            key=lambda r: r["window"] if r["window"] >= 0 else 1 << 30,
        )
        xs = [r["window"] if r["window"] >= 0 else rows[-2]["window"] * 2 for r in rows]
        ax.plot(xs, [r["fwd_bwd_ms"] for r in rows], "o-", label=f"{layout} (slowest rank)")
        if layout == "ring":
            ax.plot(
                xs,
                [r["theoretic_fwd_bwd_ms"] for r in rows],
                "k--",
                label="full-sequence kernel / W",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window (tokens left; rightmost point: no window)")
    ax.set_ylabel("fwd+bwd ms")
    ax.set_title(
        f"{results['device']}, W={results['config']['world_size']}, "
        f"{results['config']['tokens']} tokens/rank",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_window.png"), dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the code paths)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--backend", default=None, help="block kernel (default: fastest with windows)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--windows", default="512,2048,8192,16384,32768,-1", help="left sizes")
    p.add_argument("--layouts", default="ring,zigzag")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--precision-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    if a.smoke:
        a.world_size, a.tokens, a.windows, a.reps = 3, 8, "2,9,-1", 1
        a.heads, a.kv_heads, a.head_dim, a.precision_tokens = 4, 2, 16, 8
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    a.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.windows = [int(w) for w in a.windows.split(",")]
    a.precision_windows = [w for w in (1, 100, 700) if not a.smoke] or [1, 5]
    a.layouts = a.layouts.split(",")
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    results = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        config=dict(
            world_size=a.world_size,
            tokens=a.tokens,
            heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            dtype=str(a.dtype),
            causal=True,
        ),
    )
    if device.type == "cuda":  # one discarded pass: kernels loaded, clocks up
        bench(argparse.Namespace(**{**vars(a), "windows": a.windows[:1], "reps": 1}), device, gen)
    results["rows"] = bench(a, device, gen)
    results["precision"] = precision(a, device, gen)
    with open(os.path.join(a.out, "bench_window.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, a.out)
    print(
        f"\n{results['device']}, torch {results['torch']}, CUDA {results['cuda']}, "
        f"{results['date']}, {results['config']}"
    )
    print(
        f"\n{'layout':<8}{'window':>7}{'steps':>6}{'rank TF':>9}{'fwd ms':>9}{'f+b ms':>9}"
        f"{'theo f+b':>10}{'eff fwd':>9}{'eff f+b':>9}{'vs full':>9}"
    )
    for r in results["rows"]:
        print(
            f"{r['layout']:<8}{r['window']:>7}{r['steps']:>6}{r['rank_tflop']:>9.3f}"
            f"{r['fwd_ms']:>9.2f}{r['fwd_bwd_ms']:>9.2f}{r['theoretic_fwd_bwd_ms']:>10.2f}"
            f"{r['eff_fwd']:>9.1%}{r['eff_fwd_bwd']:>9.1%}{r['vs_unwindowed_fwd_bwd']:>9.1%}"
        )
    print(f"\n{'layout':<8}{'window':>7}{'tokens':>7}{'max err':>10}{'single':>10}{'ratio':>7}")
    for r in results["precision"]:
        print(
            f"{r['layout']:<8}{r['window']:>7}{r['tokens']:>7}{r['max_err']:>10.2e}"
            f"{r['single_max_err']:>10.2e}{r['ratio_max']:>7.2f}"
        )


if __name__ == "__main__":
    main()
