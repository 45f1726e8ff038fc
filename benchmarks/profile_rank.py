"""Where a simulated rank's time goes outside the block kernels (torch.profiler).

    python benchmarks/profile_rank.py --out results/     # one GPU, ~1 min

Profiles the slowest rank of a plan (default: zigzag, W = 8, 8192 tokens per rank, the seed
configuration) run by the real engine with a simulated communicator, forward and
forward+backward (``--documents N``: N packed causal documents, as bench_flex.py's, through the
varlen path; ``--layout documents``: :func:`dtensor_ring.document_layout`'s), and prints:
the GPU time per kernel family (attention kernels, merges, dq/dK/dV adds, copies, fills), the
compute stream's idle time between kernels (the time the GPU waited for the host), and the
host time per op. Chrome traces go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

import torch
from bench_flex import documents
from bench_single_gpu import qkv
from torch.profiler import ProfilerActivity, profile

from dtensor_ring import (
    document_layout,
    make_plan,
    shard_local,
    shard_varlen,
    varlen_balance,
)
from dtensor_ring.kernels import get_kernel
from dtensor_ring.simulate import RankSimulator

FAMILIES = [  # (family, regex on the kernel name), first match wins
    ("attention", r"flash|fmha|cudnn|sm90|sm100|attn"),
    ("merge (triton)", r"triton|_merge"),
    ("elementwise add/copy/cast", r"elementwise|vectorized|copy|Copy|unrolled"),
    ("fill (zeros)", r"fill|Fill|memset"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def summarize(prof, label: str) -> dict:
    """GPU time by kernel family, idle gaps of the busiest stream, host time by op."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_family: dict[str, float] = defaultdict(float)
    by_stream: dict[int, list] = defaultdict(list)
    for e in kernels:
        by_family[family(e.name)] += e.device_time / 1e3
        by_stream[getattr(e, "device_resource_id", 0)].append(e)
    stream = max(by_stream.values(), key=lambda es: sum(e.device_time for e in es))
    spans = sorted((e.time_range.start, e.time_range.end) for e in stream)
    idle = sum(max(0, b[0] - a[1]) for a, b in zip(spans[:-1], spans[1:], strict=True)) / 1e3
    wall = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    host = sorted(
        ((e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()),
        key=lambda r: -r[1],
    )[:15]
    top_kernels = sorted(
        (
            (e.key, e.device_time_total / 1e3, e.count)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ),
        key=lambda r: -r[1],
    )[:15]
    return dict(
        label=label,
        wall_ms=wall,
        compute_stream_idle_ms=idle,
        gpu_ms_by_family=dict(by_family),
        host_ms_top=host,
        kernels_top=top_kernels,
    )


def python_profile(fn, path: str, calls: int = 20) -> None:
    """cProfile of ``calls`` calls of ``fn`` (after a warm-up), host side only: what Python
    spends per call, by function (cumulative), printed and written to ``path``."""
    import cProfile
    import io
    import pstats

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"== host, {calls} calls (cProfile, cumulative):\n{text.getvalue()[:6000]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--backend", default="cudnn")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--documents", type=int, default=0)
    p.add_argument(
        "--python",
        action="store_true",
        help="also cProfile the host side of 20 forwards and 20 forwards + backwards",
    )
    p.add_argument(
        "--varlen-dq-per-block",
        action="store_true",
        help="flash_attn4: a varlen rank's dq summed by the engine, not in its kernel",
    )
    p.add_argument(
        "--engine-merges-documents",
        action="store_true",
        help="flash_attn4: varlen blocks whose rows are no one run merged by the engine, not "
        "where their rows lie (the default before 2026-12-06)",
    )
    a = p.parse_args()
    if a.varlen_dq_per_block:
        get_kernel("flash_attn4").varlen_dq_in_kernel = False
    if a.engine_merges_documents:
        get_kernel("flash_attn4").merges_by_document = False
    device = torch.device("cuda")
    a.dtype = torch.bfloat16
    W = a.world_size
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = qkv(W * a.tokens, a, a.dtype, device, gen)
    if a.documents:
        q, k, v, dout = (t[0] for t in (q, k, v, dout))  # packed [T, H, D]
        bounds = documents(W * a.tokens, a.documents, device)[1]
        layout = document_layout(bounds, W) if a.layout == "documents" else a.layout
        work = varlen_balance(bounds, W)[a.layout] if isinstance(layout, str) else layout.work
        rank = max(range(W), key=work.__getitem__)
        sim = RankSimulator(
            q, k, v, layout=layout, world_size=W, rank=rank, backend=a.backend, cu_seqlens=bounds
        )
        dout_local = shard_varlen(dout, bounds, layout, rank, W)[0]
    else:
        plan = make_plan(a.layout, W, True)
        rank = max(range(W), key=plan.flops(a.tokens).__getitem__)
        sim = RankSimulator(q, k, v, layout=a.layout, world_size=W, rank=rank, backend=a.backend)
        dout_local = shard_local(dout, a.layout, rank, W)

    def fwd_bwd():
        sim.forward()
        sim.backward(dout_local)

    os.makedirs(a.out, exist_ok=True)
    if a.python:
        python_profile(sim.forward, os.path.join(a.out, "python_forward.txt"))
        python_profile(fwd_bwd, os.path.join(a.out, "python_forward_backward.txt"))
    results = []
    for label, fn in (("forward", sim.forward), ("forward+backward", fwd_bwd)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(a.out, f"trace_{label.replace('+', '_')}.json"))
        results.append(summarize(prof, label))
    with open(os.path.join(a.out, "profile_rank.json"), "w") as f:
        json.dump(
            dict(
                config=vars(a) | {"dtype": str(a.dtype)},
                rank=rank,
                torch=torch.__version__,
                device=torch.cuda.get_device_name(),
                results=results,
            ),
            f,
            indent=1,
        )
    for r in results:
        print(
            f"\n== {r['label']}: wall {r['wall_ms']:.2f} ms, compute stream idle "
            f"{r['compute_stream_idle_ms']:.2f} ms"
        )
        for fam, ms in sorted(r["gpu_ms_by_family"].items(), key=lambda x: -x[1]):
            print(f"   gpu {fam:<28}{ms:9.3f} ms")
        print("   top kernels (ms, count):")
        for name, ms, n in r["kernels_top"]:
            print(f"      {ms:8.3f} {n:4d}  {name[:90]}")
        print("   top host ops (self ms, count):")
        for name, ms, n in r["host_ms_top"]:
            print(f"      {ms:8.3f} {n:4d}  {name[:90]}")


if __name__ == "__main__":
    main()
