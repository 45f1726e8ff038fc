"""Cost of the consistency checks per attention call, CPU + gloo: the mode
(``DTENSOR_RING_DEBUG=1``) and, with it off, the fixed-size header.

    python benchmarks/bench_consistency.py                  # 2 and 4 ranks, ~2-4 min on CPU
    python benchmarks/bench_consistency.py --smoke          # tiny, seconds

The mode adds one ``all_gather_object`` of a small fingerprint to every call (Note
[Consistency mode] in ``dtensor_ring/consistency.py``): pickling, then two collectives (sizes,
then the pickled bytes). For each world size (processes started with ``mp.spawn``, gloo, one
thread per rank) and each shape, it measures in the same processes three settings interleaved
call by call (so drift and other load on the machine hit all alike): ``none`` (no check: the
header switched off by a patch, what an NCCL group does), ``header`` (the mode off, what a
gloo group does by default: one ``all_gather`` of a 16-element int64 tensor, Note [Consistency
header]) and ``mode`` (the mode on):

* ``ring_flash_attn_func`` forward, and forward + backward (causal, fp32, ring layout);
* the call resolution alone (``dtensor_ring.resolve.resolve_call`` with the same arguments:
  the checks of every call, plus the header's or the mode's collective), which isolates their
  cost from the attention's own run-to-run noise;
* a bare ``dist.all_gather_object`` of the same fingerprint, its pickling alone, and a
  1-element ``all_reduce`` (this machine's latency of one collective).

Every sample starts after a barrier and is the slowest rank's time; reported: the median over
``--reps`` samples after ``--warmup`` calls, in ms (the JSON also has the quartiles), and
what the header and the mode add to ``none``. Ranks beyond the machine's cores share them:
the collectives then wait for the OS to schedule every rank, which inflates the checks' cost
(the device string has the core count).
It prints a table and writes JSON (default:
``benchmarks/results/bench_consistency_cpu_<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dtensor_ring as dr
from dtensor_ring import consistency
from dtensor_ring._compat import group_name as _group_name
from dtensor_ring.resolve import Call, Door, resolve_call

SHAPES = {  # name -> (B, S_local, H, D)
    "small": (1, 256, 4, 64),
    "medium": (1, 1024, 8, 64),
}
SMOKE_SHAPES = {"tiny": (1, 16, 2, 8)}


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (what the step waits for)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _interleaved(
    fns: dict[str, object], reps: int, warmup: int
) -> dict[str, tuple[float, float, float]]:
    """``(median, 25th, 75th percentile)`` of the (slowest rank's) seconds of each of ``fns``,
    called in turn ``reps`` times."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        names = list(fns) if i % 2 == 0 else list(reversed(fns))  # ABBA: no order bias
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(_slowest(time.perf_counter() - t0))
    return {name: _quartiles(s) for name, s in samples.items()}


def _quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4)
    return q2, q1, q3


SETTINGS = ("none", "header", "mode")


def _with(setting: str, fn):
    """``fn`` under one of :data:`SETTINGS`."""

    def run():
        consistency.set_consistency_checks(setting == "mode")
        gloo_group = consistency._gloo_group
        if setting == "none":
            consistency._gloo_group = lambda name: None
        try:
            return fn()
        finally:
            consistency._gloo_group = gloo_group
            consistency.set_consistency_checks(None)

    return run


def measure(shape: tuple[int, int, int, int], reps: int, warmup: int) -> dict:
    """All the timings of one shape on this process group (every rank calls it)."""
    B, S, H, D = shape
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(B, S, H, D, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(B, S, H, D, generator=gen)
    name, world = _group_name(None), dist.get_world_size()

    def fwd():
        with torch.no_grad():
            dr.ring_flash_attn_func(q, k, v, causal=True)

    def fwd_bwd():
        out = dr.ring_flash_attn_func(q, k, v, causal=True)
        out.backward(dout)

    call, door = Call(q, k, v, name, world, "ring", causal=True), Door("ring_attention")

    def resolve():
        resolve_call(call, door)

    spec = resolve_call(call, door)
    fingerprint = {  # what resolve_call gathers for this call
        "op": "ring_attention",
        **spec._asdict(),
        "shapes": [tuple(t.shape) for t in (q, k, v)],
        "dtype": str(q.dtype),
        "device type": q.device.type,
    }

    def gather():
        gathered = [None] * world
        dist.all_gather_object(gathered, (fingerprint, None))

    results = {}
    for label, fn, n in (
        ("fwd", fwd, reps),
        ("fwd_bwd", fwd_bwd, max(1, reps // 2)),
        ("resolve", resolve, reps * 4),
    ):
        t = _interleaved({s: _with(s, fn) for s in SETTINGS}, n, warmup=warmup)
        none = t["none"][0]
        results[label] = {
            **{f"{s}_ms": t[s][0] * 1e3 for s in SETTINGS},
            **{f"{s}_iqr_ms": [x * 1e3 for x in t[s][1:]] for s in SETTINGS},
            **{f"{s}_added_ms": (t[s][0] - none) * 1e3 for s in SETTINGS[1:]},
            **{f"{s}_added_pct": 100 * (t[s][0] - none) / none for s in SETTINGS[1:]},
            "reps": n,
        }
    one = torch.zeros(1)
    bare = _interleaved(
        {"gather": gather, "all_reduce": lambda: dist.all_reduce(one)}, reps * 4, warmup
    )
    results["all_gather_object_ms"] = bare["gather"][0] * 1e3
    results["all_reduce_1_elem_ms"] = bare["all_reduce"][0] * 1e3
    t0 = time.perf_counter()
    for _ in range(1000):
        pickle.loads(pickle.dumps((fingerprint, None)))
    results["pickle_roundtrip_us"] = (time.perf_counter() - t0) * 1e3  # per call: / 1000 * 1e6
    results["fingerprint_bytes"] = len(pickle.dumps((fingerprint, None)))
    results["backend"] = spec.backend
    return results


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    os.environ.pop(consistency.ENV_VAR, None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        shapes = SMOKE_SHAPES if args.smoke else SHAPES
        rows = []
        for shape_name, shape in shapes.items():
            r = measure(shape, args.reps, args.warmup)
            rows.append({"world_size": world, "shape": shape_name, "B_S_H_D": shape, **r})
        if rank == 0:
            queue.put(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), args, queue), nprocs=world, join=True)
    return queue.get()


def table(rows: list[dict]) -> str:
    head = (
        f"{'W':>2} {'shape':<7} {'what':<8} {'none ms':>9} {'header ms':>10} {'mode ms':>9} "
        f"{'header +ms':>11} {'mode +ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for what in ("fwd", "fwd_bwd", "resolve"):
            m = r[what]
            lines.append(
                f"{r['world_size']:>2} {r['shape']:<7} {what:<8} {m['none_ms']:>9.3f} "
                f"{m['header_ms']:>10.3f} {m['mode_ms']:>9.3f} {m['header_added_ms']:>+11.3f} "
                f"{m['mode_added_ms']:>+9.3f}"
            )
        lines.append(
            f"{r['world_size']:>2} {r['shape']:<7} {'gather':<8} "
            f"{'':>9} {r['all_gather_object_ms']:>9.3f}   (bare all_gather_object of "
            f"{r['fingerprint_bytes']} B; pickling: {r['pickle_roundtrip_us']:.0f} us; "
            f"one 1-element all_reduce: {r['all_reduce_1_elem_ms']:.3f} ms)"
        )
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few reps")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--reps", type=int, default=40, help="samples per mode (fwd_bwd: half)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    today = datetime.date.today().isoformat()
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            "results",
            f"bench_consistency_cpu_{today}.json",
        ),
    )
    a = p.parse_args()
    if a.smoke:
        a.reps, a.warmup = min(a.reps, 4), 1
    load_at_start = os.getloadavg()[0]
    rows = []
    for w in (int(x) for x in a.worlds.split(",")):
        rows += run_world(w, a)
    print(table(rows))
    results = {
        "date": today,
        "torch": torch.__version__,
        "device": f"cpu ({_cpu_model()}, {len(os.sched_getaffinity(0))} cores)",
        "load_avg_1min": {"start": load_at_start, "end": os.getloadavg()[0]},
        "config": {
            "backend": "gloo",
            "threads_per_rank": a.threads,
            "reps": a.reps,
            "warmup": a.warmup,
            "dtype": "float32",
            "causal": True,
            "layout": "ring",
            "shapes": SMOKE_SHAPES if a.smoke else SHAPES,
            "sample": "slowest rank after a barrier; median; settings interleaved (ABBA)",
        },
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
