"""FlexAttention on the ring, on one GPU: the slowest simulated rank against one-GPU flex / W.

    python benchmarks/bench_flex.py --out $OUT           # one H200, a few minutes
    python benchmarks/bench_flex.py --seq-len 16384 --reps 3

At W simulated ranks (default 8) and S tokens (default 65536), bf16, ``B = 1, H = 32,
H_kv = 8, D = 128``, for each mask (5 and 32 packed causal documents, 5 documents + a window
of 2048, prefix-LM with a prefix of S/4) it measures in one run:

* the baseline: one-GPU ``torch.compile(flex_attention)`` on the whole sequence with the
  global ``BlockMask``, forward and forward + backward; "ideal" is that time / W;
* for the layouts ring, zigzag and the mask-aware one (``dtensor_ring.flex_layout``, 8 chunks
  a rank), every rank run in turn by the real engine with a simulated communicator
  (``dtensor_ring.simulate.RankSimulator``, kernel flex_triton), forward and forward +
  backward; the slowest rank sets the ring's pace (communication hidden behind compute), so
  efficiency = ideal / slowest rank;
* the balance report of the plan (``flex_balance``: max/mean work, K/V transfers a rank),
  and the slowest rank's block kernels alone, back to back (forward, forward + backward):
  the rank's time minus everything outside the kernels;
* for the document masks, the library's own varlen path (zigzag varlen, ``RankSimulator``
  with ``cu_seqlens``, its default kernel) against the same ideal.

It prints a table and writes ``bench_flex.json`` to --out (default: benchmarks/results/,
``bench_flex_<device>_<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_single_gpu import timed  # noqa: E402  (median of CUDA-event timings)

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.simulate import RankSimulator  # noqa: E402


def documents(seq_len: int, n: int, device) -> tuple[torch.Tensor, list[int]]:
    """Document ids by position and the global cu_seqlens (lengths multiples of 2W*64)."""
    gen = torch.Generator().manual_seed(n)
    unit = 1024
    cuts = torch.sort(torch.randperm(seq_len // unit - 1, generator=gen)[: n - 1] + 1).values
    bounds = [0, *(cuts * unit).tolist(), seq_len]
    lengths = torch.tensor(bounds).diff()
    return torch.repeat_interleave(torch.arange(n), lengths).to(device), bounds


def masks(seq_len: int, device) -> dict:
    doc5, b5 = documents(seq_len, 5, device)
    doc32, b32 = documents(seq_len, 32, device)
    prefix, window = seq_len // 4, 2048
    return {
        "documents x5": (lambda b, h, q, kv: (doc5[q] == doc5[kv]) & (q >= kv), b5),
        "documents x32": (lambda b, h, q, kv: (doc32[q] == doc32[kv]) & (q >= kv), b32),
        "documents x5 + window": (
            lambda b, h, q, kv: (doc5[q] == doc5[kv]) & (q >= kv) & (q - kv < window),
            None,
        ),
        "prefix-LM": (lambda b, h, q, kv: (kv < prefix) | (q >= kv), None),
    }


def slowest_rank(sims, reps) -> tuple[float, float, int]:
    """(forward, forward + backward) seconds of the slowest simulated rank, and that rank."""
    fwd, fwd_bwd = [], []
    for sim in sims:
        dout = torch.randn_like(sim.q)
        fwd.append(timed(sim.forward, reps))

        def step(sim=sim, dout=dout):
            sim.forward()
            sim.backward(dout)

        fwd_bwd.append(timed(step, reps))
    return max(fwd), max(fwd_bwd), max(range(len(sims)), key=fwd_bwd.__getitem__)


def kernels_alone(sim, reps) -> tuple[float, float]:
    """(forward, forward + backward) seconds of a flex rank's block kernels alone, called
    back to back on the blocks of its plan (no merges, accumulations or engine): what the
    rank's time would be if everything else were free."""
    out, lse = sim.forward()
    dout = torch.randn_like(sim.q)
    kvs = [(sim.k, sim.v), *sim.kv_deliveries]
    take, take_lse = sim.blocks.take, sim.blocks.take_lse
    calls = [
        (blk, *(take(x, blk.q) for x in (sim.q, out, dout)), take_lse(lse, blk.q),
         *(take(x, blk.kv) for x in kvs[i]))
        for i, step in enumerate(sim.steps)
        for blk in step.blocks
    ]  # fmt: skip
    mods, kernel = sim.blocks.mods, sim.kernel

    def fwd():
        for blk, q, _, _, _, k, v in calls:
            kernel.forward(q, k, v, blk.origin, sim.scale, mods)

    def fwd_bwd():
        fwd()
        for blk, q, o, do, lse_b, k, v in calls:
            kernel.backward(do, q, k, v, o, lse_b, blk.origin, sim.scale, mods)

    return timed(fwd, reps), timed(fwd_bwd, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    dev, S, W = torch.device("cuda"), a.seq_len, a.world_size
    gen = torch.Generator(device=dev).manual_seed(0)
    shape_q, shape_kv = (1, a.heads, S, a.head_dim), (1, a.kv_heads, S, a.head_dim)
    q = torch.randn(shape_q, generator=gen, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, generator=gen, device=dev, dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    one_gpu = torch.compile(flex_attention)
    q_BSHD, k_BSHD, v_BSHD = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    rows = []
    print(f"S = {S}, W = {W} simulated, bf16, H = {a.heads}, H_kv = {a.kv_heads}, D = {a.head_dim}")
    head = f"{'fwd ms':>9}{'eff':>7}{'f+b ms':>9}{'eff':>7}{'imbal':>7}{'K/V':>5}"
    print(f"{'mask':<22}{'path':<22}{head}")
    for name, (mask_mod, bounds) in masks(S, dev).items():
        t0 = time.time()
        bm = create_block_mask(mask_mod, None, None, S, S, dev)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def full_fwd(leaves=leaves, bm=bm):
            return one_gpu(*leaves, block_mask=bm, enable_gqa=True)

        def full_fwd_bwd(full_fwd=full_fwd):
            full_fwd().backward(dout)

        ideal = (timed(full_fwd, a.reps) / W, timed(full_fwd_bwd, a.reps) / W)
        row = {"mask": name, "path": f"one GPU / {W}", "fwd_s": ideal[0], "fwd_bwd_s": ideal[1]}
        rows.append(row)
        print(f"{name:<22}{row['path']:<22}{ideal[0] * 1e3:>9.3f}{'':>7}{ideal[1] * 1e3:>9.3f}")
        paths = [("ring", "ring"), ("zigzag", "zigzag"), ("mask-aware k=8", dr.flex_layout(bm, W))]
        for label, layout in paths:
            sims = [
                RankSimulator(
                    q_BSHD,
                    k_BSHD,
                    v_BSHD,
                    layout=layout,
                    world_size=W,
                    rank=r,
                    block_mask=bm,
                    backend="flex_triton",
                )  # fmt: skip
                for r in range(W)
            ]
            fwd, fwd_bwd, slowest = slowest_rank(sims, a.reps)
            kernel_fwd, kernel_fwd_bwd = kernels_alone(sims[slowest], a.reps)
            report = dr.flex_balance(bm, W, layout)
            rows.append(
                {
                    "mask": name,
                    "path": f"flex {label}",
                    "fwd_s": fwd,
                    "fwd_bwd_s": fwd_bwd,
                    "eff_fwd": ideal[0] / fwd,
                    "eff_fwd_bwd": ideal[1] / fwd_bwd,
                    "imbalance": report.imbalance,
                    "kv_transfers": report.kv_transfers,
                    "slowest_rank": slowest,
                    "kernels_alone_fwd_s": kernel_fwd,
                    "kernels_alone_fwd_bwd_s": kernel_fwd_bwd,
                }  # fmt: skip
            )
            del sims
        if bounds is not None:  # the library's varlen path on the same documents
            q_T, k_T, v_T = (t[0] for t in (q_BSHD, k_BSHD, v_BSHD))
            sims = [
                RankSimulator(
                    q_T,
                    k_T,
                    v_T,
                    layout="zigzag",
                    world_size=W,
                    rank=r,
                    cu_seqlens=bounds,
                    causal=True,
                )  # fmt: skip
                for r in range(W)
            ]
            fwd, fwd_bwd, _ = slowest_rank(sims, a.reps)
            rows.append(
                {
                    "mask": name,
                    "path": f"varlen zigzag ({sims[0].kernel.name})",
                    "fwd_s": fwd,
                    "fwd_bwd_s": fwd_bwd,
                    "eff_fwd": ideal[0] / fwd,
                    "eff_fwd_bwd": ideal[1] / fwd_bwd,
                }  # fmt: skip
            )
            del sims
        for row in rows:
            if row["mask"] == name and "eff_fwd" in row:
                print(
                    f"{'':<22}{row['path']:<22}{row['fwd_s'] * 1e3:>9.3f}{row['eff_fwd']:>7.1%}"
                    f"{row['fwd_bwd_s'] * 1e3:>9.3f}{row['eff_fwd_bwd']:>7.1%}"
                    + (
                        f"{row['imbalance']:>7.3f}{row['kv_transfers']:>5}"
                        if "imbalance" in row
                        else ""
                    )
                    + (
                        f"  kernels alone {row['kernels_alone_fwd_s'] * 1e3:.3f} | "
                        f"{row['kernels_alone_fwd_bwd_s'] * 1e3:.3f} ms"
                        if "kernels_alone_fwd_s" in row
                        else ""
                    )
                )
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
        _write(a, rows)


def _write(a, rows) -> None:
    date = datetime.date.today().isoformat()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date,
        "seq_len": a.seq_len, "world_size": a.world_size, "heads": a.heads,
        "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": "bfloat16", "reps": a.reps,
    }  # fmt: skip
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    path = os.path.join(out, f"bench_flex_h200_{date}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
