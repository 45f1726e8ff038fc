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
* for the document masks, also the balanced layout of whole documents
  (``dtensor_ring.document_layout``) under flex, one varlen kernel call on the whole stream
  per varlen kernel that runs here (cuda_flash, flash_attn4 when installed), and the library's
  varlen path (``RankSimulator`` with ``cu_seqlens``) in zigzag, in the balanced layout, in
  the layout of least predicted time (``document_layout(..., heads=...)``), and as the
  head-tail shards and the mask-aware layout's shards of the packed row hold the documents
  (what ``flex_attention`` runs for a document mask on those layouts; head-tail: torchtitan's
  varlen module under its default balancer), per varlen kernel; each placed layout also by
  its all-gather of the keys needed (``GatherSimulator``, Note [Gathering what placed
  documents need]; the K/V column then holds the most rows a rank fetches);
  ``--varlen-only`` skips the flex-kernel layouts of the document masks; "best"
  efficiencies are against the fastest one-GPU time of the mask (flex or varlen) / W;
  ``--graphs``: the varlen ranks also replayed from a CUDA graph (what they cost without
  host time); ``--compare-dq``: the
  flash_attn4 varlen paths also with each block's dq summed by the engine ("per-block dq"),
  the baseline of a rank's dq summed in flash-attn 4's kernel (Note [A varlen dq accumulated
  inside flash-attn 4]); ``--compare-merges``: also with the blocks whose rows are no one run
  merged by the engine ("engine merges"), the baseline of their merge where their rows lie
  (Note [Varlen blocks merged where their rows lie]), measured next to each other;
* for every mask, the host time ``dtensor_ring.flex_attention`` takes to read its
  ``BlockMask`` as documents (Note [Document masks on the varlen kernels]: a document mask,
  called without a ``score_mod`` or the lse, runs on the library's varlen path measured
  above), the first call of a mask and a cached one.

It prints a table and writes ``bench_flex.json`` to --out (default: benchmarks/results/,
``bench_flex_<device>_<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_single_gpu import (  # noqa: E402  (CUDA-event medians; flash-attn 4's modes)
    ENGINE_MERGES,
    FP32,
    IN_KERNEL,
    block_grads_mode,
    graph_timed,
    kernels_alone,
    timed,
)

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.engine.placed_gather import gather_keys  # noqa: E402
from dtensor_ring.engine.varlen_blocks import varlen_blocks  # noqa: E402
from dtensor_ring.layouts.document_placement import documents_on_tokens  # noqa: E402
from dtensor_ring.resolve import normalize_window  # noqa: E402
from dtensor_ring.schedule.flex_documents import mask_documents  # noqa: E402
from dtensor_ring.simulate import GatherSimulator, RankSimulator  # noqa: E402


def documents(seq_len: int, n: int, device) -> tuple[torch.Tensor, list[int]]:
    """Document ids by position and the global cu_seqlens (lengths multiples of 2W*64)."""
    gen = torch.Generator().manual_seed(n)
    unit = 1024
    cuts = torch.sort(torch.randperm(seq_len // unit - 1, generator=gen)[: n - 1] + 1).values
    bounds = [0, *(cuts * unit).tolist(), seq_len]
    lengths = torch.tensor(bounds).diff()
    return torch.repeat_interleave(torch.arange(n), lengths).to(device), bounds


def rows_of(layout, bounds: list[int], W: int, window: tuple[int, int]):
    """The documents as ``layout``'s shards of their packed row hold them, as placed
    documents: what ``dtensor_ring.flex_attention`` runs on the varlen kernels for a document
    mask on that layout (zigzag: torchtitan's varlen module under its default balancer)."""
    causal, norm = normalize_window(window, False, bounds[-1])
    lay = dr.get_layout(layout, "dense") if isinstance(layout, str) else layout
    rows = [lay.token_indices(bounds[-1], r, W) for r in range(W)]
    return documents_on_tokens(bounds, torch.stack(rows), causal, norm)


def masks(seq_len: int, device) -> dict:
    """name -> (mask_mod, document boundaries or None, flash-attn window within documents)."""
    doc5, b5 = documents(seq_len, 5, device)
    doc32, b32 = documents(seq_len, 32, device)
    prefix, window = seq_len // 4, 2048
    causal = (-1, 0)
    return {
        "documents x5": (lambda b, h, q, kv: (doc5[q] == doc5[kv]) & (q >= kv), b5, causal),
        "documents x32": (lambda b, h, q, kv: (doc32[q] == doc32[kv]) & (q >= kv), b32, causal),
        "documents x5 + window": (
            lambda b, h, q, kv: (doc5[q] == doc5[kv]) & (q >= kv) & (q - kv < window),
            b5,
            (window - 1, 0),
        ),
        "prefix-LM": (lambda b, h, q, kv: (kv < prefix) | (q >= kv), None, None),
    }


def varlen_kernels(device) -> list[str]:
    """The varlen block kernels that run here (``cuda_flash``, ``flash_attn4``, ...)."""
    from dtensor_ring.kernels import BACKEND_NAMES, KernelCall, get_kernel

    x = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device=device)
    call = KernelCall.of(x, x[:, :, :2], varlen=True, window=True)
    return [
        name
        for name in BACKEND_NAMES
        if name != "math" and get_kernel(name).unsupported_reason(call) is None
    ]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--masks", default=None, help="comma-separated mask names to run (default: all)"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="also replay the varlen ranks from CUDA graphs"
    )
    parser.add_argument(
        "--varlen-only",
        action="store_true",
        help="document masks: skip the flex-kernel layouts (the route runs on the varlen ones)",
    )
    parser.add_argument(
        "--compare-dq",
        action="store_true",
        help="flash_attn4 varlen paths also with each block's dq summed by the engine",
    )
    parser.add_argument(
        "--compare-merges",
        action="store_true",
        help="flash_attn4 varlen paths also with blocks whose rows are no one run merged by "
        "the engine, not where their rows lie (the default before 2026-12-06)",
    )
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
    head = (
        f"{'fwd ms':>9}{'eff':>7}{'f+b ms':>9}{'eff':>7}{'best f':>7}{'best fb':>7}{'imbal':>7}"
        f"{'K/V':>5}"
    )
    print(f"{'mask':<22}{'path':<36}{head}")
    kernels = varlen_kernels(dev)
    for name, (mask_mod, bounds, window) in masks(S, dev).items():
        if a.masks is not None and name not in a.masks.split(","):
            continue
        t0 = time.time()
        bm = create_block_mask(mask_mod, None, None, S, S, dev)
        rows.append(read_row(name, bm))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def full_fwd(leaves=leaves, bm=bm):
            return one_gpu(*leaves, block_mask=bm, enable_gqa=True)

        def full_fwd_bwd(full_fwd=full_fwd):
            full_fwd().backward(dout)

        ideal = (timed(full_fwd, a.reps) / W, timed(full_fwd_bwd, a.reps) / W)
        rows.append(ideal_row(name, f"one GPU flex / {W}", ideal))
        best = ideal
        q_T, k_T, v_T = (t[0] for t in (q_BSHD, k_BSHD, v_BSHD))
        for kernel in kernels if bounds is not None else ():  # one GPU, varlen kernels
            one = one_gpu_varlen(q_T, k_T, v_T, dout[0].transpose(0, 1), bounds, window, kernel)
            t = (timed(one[0], a.reps) / W, timed(one[1], a.reps) / W)
            rows.append(ideal_row(name, f"one GPU {kernel} / {W}", t))
            best = tuple(min(x, y) for x, y in zip(best, t, strict=True))
        paths = []  # the flex-kernel layouts (--varlen-only: not for the document masks)
        if bounds is None or not a.varlen_only:
            mask_aware = dr.flex_layout(bm, W)
            paths = [("ring", "ring"), ("zigzag", "zigzag"), ("mask-aware k=8", mask_aware)]
            if bounds is not None:
                paths.append(("documents", dr.document_layout(bounds, W, window_size=window)))
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
            report = dr.flex_balance(bm, W, layout)
            rows.append(
                path_row(name, f"flex {label}", sims, a.reps, ideal, best)
                | {"imbalance": report.imbalance, "kv_transfers": report.kv_transfers}
            )
            del sims
        for kernel in kernels if bounds is not None else ():  # the library's varlen path
            balanced = dr.document_layout(bounds, W, window_size=window)
            shape = {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}
            modelled = dr.document_layout(bounds, W, window_size=window, **shape)
            varlen_paths = [("zigzag", "zigzag"), ("documents", balanced)]
            if modelled != balanced:
                varlen_paths.append(("docs by model", modelled))
            varlen_paths.append(("head-tail row", rows_of("zigzag", bounds, W, window)))
            varlen_paths.append(
                ("mask-aware row", rows_of(dr.flex_layout(bm, W), bounds, W, window))
            )
            modes = [None]  # the baselines, in this run: per-block dq, the engine's merges
            if kernel == "flash_attn4":
                modes += [FP32] * a.compare_dq + [ENGINE_MERGES] * a.compare_merges
            for (label, layout), mode in itertools.product(varlen_paths, modes):
                if mode is not None:
                    label += ", per-block dq" if mode == FP32 else ", engine merges"
                with block_grads_mode(kernel, mode or IN_KERNEL):
                    sims = ranks(RankSimulator, (q_T, k_T, v_T), layout, W, bounds, window, kernel)
                    row = path_row(name, f"varlen {label} ({kernel})", sims, a.reps, ideal, best)
                    if a.graphs:
                        replayed(row, sims[row["slowest_rank"]], a.reps, best)
                    row["kv_transfers"] = sims[0].plan.kv_transfers()
                    if layout is not varlen_paths[0][1]:
                        row["imbalance"], row["cut_documents"] = layout.imbalance, len(layout.split)
                    rows.append(row)
                    del sims
            for label, layout in varlen_paths[1:]:  # placed documents: their all-gather too
                sims = ranks(GatherSimulator, (q_T, k_T, v_T), layout, W, bounds, window, kernel)
                row = gather_row(
                    name, f"varlen {label}, gather ({kernel})", sims, a.reps, ideal, best
                )
                if a.graphs:
                    replayed(row, sims[row["slowest_rank"]], a.reps, best)
                rows.append(
                    row | {"imbalance": layout.imbalance, "cut_documents": len(layout.split)}
                )
                del sims
        for row in rows:
            if row["mask"] == name and "eff_fwd" in row:
                print(
                    f"{'':<22}{row['path']:<36}{row['fwd_s'] * 1e3:>9.3f}{row['eff_fwd']:>7.1%}"
                    f"{row['fwd_bwd_s'] * 1e3:>9.3f}{row['eff_fwd_bwd']:>7.1%}"
                    f"{row['eff_best_fwd']:>7.1%}{row['eff_best_fwd_bwd']:>7.1%}"
                    + (
                        f"{row['imbalance']:>7.3f}{row['kv_transfers']:>5}"
                        if "imbalance" in row
                        else f"{'':>7}{row['kv_transfers']:>5}"
                    )
                    + f"  kernels alone {row['kernels_alone_fwd_s'] * 1e3:.3f} | "
                    f"{row['kernels_alone_fwd_bwd_s'] * 1e3:.3f} ms"
                )
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
        _write(a, rows)


def read_row(mask: str, block_mask) -> dict:
    """The host time to read ``block_mask`` as documents: first call, cached call (median)."""
    t0 = time.perf_counter()
    documents = mask_documents(block_mask, 1)
    if block_mask.kv_num_blocks.is_cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    cached = []
    for _ in range(50):
        t0 = time.perf_counter()
        mask_documents(block_mask, 1)
        cached.append(time.perf_counter() - t0)
    cached = sorted(cached)[len(cached) // 2]
    read = (
        "not documents"
        if documents is None
        else (f"{len(documents.bounds) - 1} documents, window {documents.window_size}")
    )
    print(f"{mask:<22}{'read as documents':<36}first {first * 1e3:.1f} ms, cached "
          f"{cached * 1e6:.0f} us: {read}")  # fmt: skip
    return {"mask": mask, "path": "read as documents", "first_s": first, "cached_s": cached,
            "read": read}  # fmt: skip


def ideal_row(mask: str, path: str, per_rank: tuple[float, float]) -> dict:
    """A one-GPU baseline divided by W, printed."""
    print(f"{mask:<22}{path:<36}{per_rank[0] * 1e3:>9.3f}{'':>7}{per_rank[1] * 1e3:>9.3f}")
    return {"mask": mask, "path": path, "fwd_s": per_rank[0], "fwd_bwd_s": per_rank[1]}


def path_row(mask, path, sims, reps, ideal, best) -> dict:
    """The slowest rank of ``sims`` against the flex ideal and the best one-GPU time / W, and
    its block kernels alone."""
    timed_rank = slowest_rank(sims, reps)
    alone = kernels_alone(sims[timed_rank[2]], reps)
    return _row(mask, path, timed_rank, ideal, best, sims[0].plan.kv_transfers(), alone)


def _row(mask, path, timed_rank, ideal, best, kv_transfers, alone) -> dict:
    """A table row: the slowest rank's ``(forward, forward + backward, rank)`` against the
    flex ideal and the best one-GPU time / W, ``kv_transfers`` and its kernels ``alone``."""
    fwd, fwd_bwd, slowest = timed_rank
    return {
        "mask": mask,
        "path": path,
        "fwd_s": fwd,
        "fwd_bwd_s": fwd_bwd,
        "eff_fwd": ideal[0] / fwd,
        "eff_fwd_bwd": ideal[1] / fwd_bwd,
        "eff_best_fwd": best[0] / fwd,
        "eff_best_fwd_bwd": best[1] / fwd_bwd,
        "kv_transfers": kv_transfers,
        "slowest_rank": slowest,
        "kernels_alone_fwd_s": alone[0],
        "kernels_alone_fwd_bwd_s": alone[1],
    }


def replayed(row: dict, sim, reps: int, best) -> None:
    """``row`` with the slowest rank ``sim`` replayed from a CUDA graph (no host time):
    ``graph_*`` times and efficiencies against the ``best`` one-GPU time / W; printed."""
    dout_rank = torch.randn_like(sim.q)

    def step():
        sim.forward()
        sim.backward(dout_rank)

    g = (graph_timed(sim.forward, reps), graph_timed(step, reps))
    row["graph_fwd_s"], row["graph_fwd_bwd_s"] = g
    row["graph_eff_best_fwd"] = best[0] / g[0]
    row["graph_eff_best_fwd_bwd"] = best[1] / g[1]
    print(
        f"{'':<22}{'  from a CUDA graph':<36}{g[0] * 1e3:>9.3f}{'':>7}"
        f"{g[1] * 1e3:>9.3f}{'':>7}{best[0] / g[0]:>7.1%}{best[1] / g[1]:>7.1%}"
    )


def ranks(simulator, qkv_T, layout, W: int, bounds, window, kernel) -> list:
    """Every rank of ``layout``'s ``W``-rank call over the packed documents ``bounds``
    (causal, flash-attn's ``window`` within them), each a ``simulator`` (``RankSimulator``,
    ``GatherSimulator``)."""
    return [
        simulator(
            *qkv_T,
            layout=layout,
            world_size=W,
            rank=r,
            cu_seqlens=bounds,
            causal=True,
            window_size=window,
            backend=kernel,
        )  # fmt: skip
        for r in range(W)
    ]


def gather_row(mask, path, sims, reps, ideal, best) -> dict:
    """:func:`path_row` of placed documents' all-gather (``GatherSimulator`` ranks): the
    slowest rank, its block kernels alone, and the most rows a rank fetches (in
    ``kv_transfers``' column: rows, not transfers)."""
    fwd, fwd_bwd, slowest = slowest_rank(sims, reps)
    sim = sims[slowest]
    out, lse = sim.forward()
    dout = torch.randn_like(sim.q)
    k_keys, v_keys = gather_keys(sim.meta, sim.k, sim.v, sim.received)
    calls = [
        (rows, blk, kv)
        for rows, blocks, kv in (
            (
                varlen_blocks(sim.meta.local_blocks, (), sim.q.device),
                sim.meta.local_blocks,
                (sim.k, sim.v),
            ),
            (
                varlen_blocks(sim.meta.remote_blocks, (), sim.q.device),
                sim.meta.remote_blocks,
                (k_keys, v_keys),
            ),
        )
        for blk in blocks
    ]

    def fwd_alone():
        for rows, blk, (k, v) in calls:
            t = rows.take
            rows.forward(sim.kernel, t(sim.q, blk.q), t(k, blk.kv), t(v, blk.kv), blk, sim.scale)

    def fwd_bwd_alone():
        fwd_alone()
        for rows, blk, (k, v) in calls:
            t = rows.take
            rows.backward(
                sim.kernel, t(dout, blk.q), t(sim.q, blk.q), t(k, blk.kv), t(v, blk.kv),
                t(out, blk.q), rows.take_lse(lse, blk.q), blk, sim.scale,
            )  # fmt: skip

    received = max(s.meta.received for s in sims)
    alone = (timed(fwd_alone, reps), timed(fwd_bwd_alone, reps))
    return _row(mask, path, (fwd, fwd_bwd, slowest), ideal, best, received, alone)


def one_gpu_varlen(q, k, v, dout, bounds, window, backend):
    """(forward, forward + backward) closures of one varlen kernel call on the whole stream."""
    from dtensor_ring.kernels import get_kernel

    kernel = get_kernel(backend)
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    n = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    scale = q.shape[-1] ** -0.5
    win = None if window[0] < 0 else window
    causal = win is None

    def fwd():
        return kernel.forward_varlen(q, k, v, cu, cu, n, n, causal=causal, scale=scale, window=win)

    def fwd_bwd():
        out, lse = fwd()
        kernel.backward_varlen(
            dout, q, k, v, out, lse, cu, cu, n, n, causal=causal, scale=scale, window=win
        )

    return fwd, fwd_bwd


def _write(a, rows) -> None:
    date = datetime.date.today().isoformat()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date,
        "seq_len": a.seq_len, "world_size": a.world_size, "heads": a.heads,
        "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": "bfloat16", "reps": a.reps,
    }  # fmt: skip
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    gpu = meta["gpu"].split()[1].lower() if meta["gpu"].startswith("NVIDIA ") else "gpu"
    path = os.path.join(out, f"bench_flex_{gpu}_{date}.json")  # e.g. bench_flex_h100_...
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
