"""Peak memory of one ring rank, phase by phase, against single-device attention (issue #28,
"memory 1.3x").

    python benchmarks/bench_memory.py --out $OUT          # one GPU, under a minute
    python benchmarks/bench_memory.py --smoke             # CPU, tiny: checks the code paths

At simulated W ranks (default 8) and T tokens a rank (default 8192), bf16, ``B = 1, H = 32,
H_kv = 8, D = 128``, causal, zigzag, for each block kernel that runs: the busiest rank of
``dtensor_ring.simulate.RankSimulator`` (the real engine; every step's K/V are pre-staged,
so they are part of the baseline, not of the rank's peaks) measured as

* ``forward peak``: the largest allocation above the baseline during the forward;
* ``kept``: what stays allocated after the forward (out, lse and what the backward reads);
* ``backward peak``: the largest allocation above the baseline during the backward;

next to the same phases of the kernel alone on the rank's own T tokens (single-device
attention of that size: the yardstick of ``bench_single_gpu.py``'s memory ratio). A real rank
also holds its receive buffers (two K/V sets in flight, one fp32 dK/dV set): listed as
``receive buffers``, computed, not measured. Prints a table and writes ``bench_memory.json``
to --out. CUDA only measures (``torch.cuda.max_memory_allocated``); the smoke run on CPU
reports zeros.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_single_gpu import IN_KERNEL, block_grads_mode, block_grads_modes  # noqa: E402

from dtensor_ring import make_plan, shard_local  # noqa: E402
from dtensor_ring.kernels import BACKENDS, KernelCall, get_kernel  # noqa: E402
from dtensor_ring.simulate import RankSimulator  # noqa: E402

MiB = 2**20


def phases(forward, backward) -> dict:
    """MiB above the allocation at the start: forward peak, kept after it, backward peak."""
    if not torch.cuda.is_available():
        forward(), backward()
        return {"forward peak": 0.0, "kept": 0.0, "backward peak": 0.0}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward()
    torch.cuda.synchronize()
    fwd_peak, kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    return {"forward peak": fwd_peak / MiB, "kept": kept / MiB, "backward peak": bwd_peak / MiB}


def measure(backend: str, W: int, T: int, dims, dtype, device) -> dict:
    heads, kv_heads, dim = dims
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, W * T, heads, dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(1, W * T, kv_heads, dim, generator=gen, device=device, dtype=dtype)
            for _ in "kv")  # fmt: skip
    dout = torch.randn_like(q)
    plan = make_plan("zigzag", W, causal=True)
    flops = plan.flops(T, heads=heads, head_dim=dim)
    rank = max(range(W), key=flops.__getitem__)
    sim = RankSimulator(q, k, v, layout="zigzag", world_size=W, rank=rank, backend=backend)
    dout_local = shard_local(dout, "zigzag", rank, W)
    ring = phases(sim.forward, lambda: sim.backward(dout_local))
    kernel, scale = get_kernel(backend), dim**-0.5
    ql, kl, vl, dl = (t[:, :T] for t in (q, k, v, dout))
    held = {}

    def single_forward():
        held["out"] = kernel.forward(ql, kl, vl, causal=True, scale=scale)

    def single_backward():
        kernel.backward(dl, ql, kl, vl, *held.pop("out"), causal=True, scale=scale)

    single = phases(single_forward, single_backward)
    kv_bytes = 2 * T * kv_heads * dim * dtype.itemsize
    return {
        "backend": backend,
        "rank": rank,
        "ring": ring,
        "single device": single,
        "receive buffers": (2 * kv_bytes + kv_bytes * 4 // dtype.itemsize) / MiB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens a rank")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: checks the code paths")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dims = (32, 8, 128) if cuda else (4, 2, 16)
    W, T = (a.world_size, a.tokens) if not a.smoke else (4, 32)
    call = KernelCall(device.type, dtype, dims[2], dims[0], dims[1])
    able = [b.name for b in BACKENDS if b.name != "math" and not b.unsupported_reason(call)]
    backends = able if cuda else ["math"]
    rows = []
    for backend in backends:
        modes = block_grads_modes(backend, compare=True)
        # as it runs; where its kernel sums dq itself, also the engine's sum (the baseline)
        for mode in modes[: 1 + (modes[0] == IN_KERNEL)]:
            name = backend if mode == modes[0] else f"{backend} ({mode})"
            try:
                with block_grads_mode(backend, mode):
                    rows.append(dict(measure(backend, W, T, dims, dtype, device), backend=name))
            except Exception as e:  # a kernel that cannot run these shapes: say why in the JSON
                rows.append({"backend": name, "error": f"{type(e).__name__}: {e}"})
    print(f"W = {W}, {T} tokens a rank, {dtype}, H/H_kv/D = {dims}; MiB above the inputs")
    print(f"{'backend':>12} {'phase':>14} {'ring':>9} {'single':>9} {'ratio':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:>12} {r['error'][:60]}")
            continue
        for phase in ("forward peak", "kept", "backward peak"):
            ring, single = r["ring"][phase], r["single device"][phase]
            ratio = f"{ring / single:6.2f}" if single else "     -"
            print(f"{r['backend']:>12} {phase:>14} {ring:9.1f} {single:9.1f} {ratio}")
        print(f"{r['backend']:>12} {'receive bufs':>14} {r['receive buffers']:9.1f}")
    meta = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        config=dict(world_size=W, tokens_per_rank=T, heads=dims[0], kv_heads=dims[1],
                    head_dim=dims[2], dtype=str(dtype), layout="zigzag", causal=True),
    )  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_memory.json"), "w") as f:
        json.dump(dict(**meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
