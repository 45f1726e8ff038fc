"""The fixed cost of one call: ring attention on a 1-rank group against plain SDPA.

    python benchmarks/bench_overhead.py --out results/     # one GPU, ~1 min

On a real 1-rank NCCL group (gloo on CPU), bf16 ``B=1, H=32, H_kv=8, D=128``, causal, for
several sequence lengths: forward and forward+backward time of

* ``sdpa``: ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` views of ``[B, S, H, D]``
  tensors (``enable_gqa=True``), the baseline measured in the same run;
* ``functional``: ``ring_flash_attn_func`` (W = 1: one block, no communication);
  ``functional:<backend>`` with that block kernel (``--contenders``);
* ``dtensor``: SDPA on ``Shard(2)`` DTensors of a 1-rank mesh inside ``ring_sdpa()``, the
  scope entered per call; ``dtensor_open``: the same calls in one scope held open (as a
  training step's layers see it: the scope's cost is per step, not per call);
* ``dtensor_fn``: ``scaled_dot_product_ring_attention`` on the same DTensors (no scope);
* ``<what>+compile``: the forward under ``torch.compile(fullgraph=True)`` (the backward
  compiled by AOTAutograd), ``<what>+cudagraphs``: ``mode="reduce-overhead"`` (CUDA graphs):
  what compiling removes of the fixed cost (CUDA only; compile time excluded by warm-up);

and ``host``: the wall time of issuing one forward (the mean of 200 calls issued back to back,
divided, without synchronising in between; at small S the GPU waits for the host). Then, at
the smallest S, the host time of the functional call layer by layer (``layers``: the block
kernel alone, the engine, its autograd.Function, the front door; :func:`host_layers`). Prints
the tables and writes ``bench_overhead.json`` to --out; ``--profile`` also writes, per contender at
the smallest S, the cProfile of 200 forward and 200 forward + backward calls
(``profile_<what>[_fwd_bwd].txt``, top 40 by own and cumulative time) and the torch.profiler
op table of forward + backward (``ops_<what>_fwd_bwd.txt``: host and device time per op), and
where each eager contender's forward and forward + backward make the host wait for the GPU
(``syncs.txt``, :func:`host_syncs`).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH

import dtensor_ring as dr  # noqa: E402


def median_ms(fn, reps: int) -> float:
    """Median time of ``fn`` in ms (CUDA events when CUDA is in use, perf_counter otherwise,
    e.g. a --smoke run on a GPU machine). Also used by bench_decode.py."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms(fn, calls: int = 200) -> float:
    """Host milliseconds to issue one ``fn()``: ``calls`` back to back after a warm-up,
    synchronised only around them (where the GPU outruns the host, the call's time). Also
    used by bench_single_gpu.py."""
    for _ in range(3):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / calls * 1e3


def _profile(fn, path: str, calls: int = 200) -> None:
    """cProfile of ``calls`` calls of ``fn`` (after warm-up): top 40 functions by own time."""
    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())


def host_syncs(fn) -> list[str]:
    """Where one call of ``fn`` (after warm-up) makes the host wait for the GPU: CUDA's sync
    debug mode warns at every synchronising op (``.item()``, ``bool(tensor)``, a copy to the
    host); each entry is the library frames (``dtensor_ring/...:line``) above the op, innermost
    last. Empty off CUDA."""
    if not torch.cuda.is_available():
        return []
    import traceback
    import warnings

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "dtensor_ring" in f.filename]
        where = " > ".join(
            f"{f.filename.rsplit('dtensor_ring/', 1)[-1]}:{f.lineno}" for f in frames
        )
        found.append(where or f"(outside dtensor_ring) {filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def _op_profile(fn, path: str, calls: int = 20) -> None:
    """torch.profiler table of ``calls`` calls (after warm-up): every op and kernel with its
    host and device time, by total device time (what runs on the GPU per call, and what the
    host spends issuing it)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))


def _callables(name: str, q, k, v, mesh):
    """``(forward, forward + backward)`` of one contender on ``[B, S, H, D]`` leaves. A
    ``+compile`` suffix: the forward under ``torch.compile(fullgraph=True)`` (the backward
    compiled by AOTAutograd); ``+cudagraphs``: ``mode="reduce-overhead"`` (CUDA graphs)."""
    name, _, how = name.partition("+")
    if how:
        fwd, _ = _callables(name, q, k, v, mesh)
        mode = "reduce-overhead" if how == "cudagraphs" else "default"
        compiled = torch.compile(fwd, fullgraph=True, mode=mode)

        def fwd_bwd_compiled():
            out = compiled()
            out.backward(torch.ones_like(out))

        return compiled, fwd_bwd_compiled
    if name == "sdpa":

        def fwd():
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )

    elif name.startswith("functional"):  # "functional:<backend>": that block kernel
        backend = name.partition(":")[2] or None

        def fwd():
            return dr.ring_flash_attn_func(q, k, v, causal=True, backend=backend)

    elif name == "dtensor_fn":  # the scope-free DTensor function (what compiles)
        from torch.distributed.tensor import DTensor, Shard

        qd, kd, vd = (
            DTensor.from_local(x.transpose(1, 2), mesh, [Shard(2)], run_check=False)
            for x in (q, k, v)
        )

        def fwd():
            return dr.scaled_dot_product_ring_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    elif name == "dtensor_open":  # calls in a scope held open, as over a training step's layers
        from torch.distributed.tensor import DTensor, Shard

        qd, kd, vd = (
            DTensor.from_local(x.transpose(1, 2), mesh, [Shard(2)], run_check=False)
            for x in (q, k, v)
        )
        _OPEN_SCOPE.enter_context(dr.ring_sdpa())

        def fwd():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    else:
        from torch.distributed.tensor import DTensor, Shard

        qd, kd, vd = (
            DTensor.from_local(x.transpose(1, 2), mesh, [Shard(2)], run_check=False)
            for x in (q, k, v)
        )

        def fwd():
            with dr.ring_sdpa():
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

        def fwd_bwd():  # the scope must cover the backward too
            with dr.ring_sdpa():
                out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                out.backward(torch.ones_like(out))

        return fwd, fwd_bwd

    def fwd_bwd():
        out = fwd()
        out.backward(torch.ones_like(out))

    return fwd, fwd_bwd


_OPEN_SCOPE = contextlib.ExitStack()  # the open scope of "dtensor_open", closed after its rows

CONTENDERS = (
    "sdpa",
    "functional",
    "dtensor",
    "dtensor_open",
    "dtensor_fn",
    "sdpa+compile",
    "functional+compile",
    "dtensor_fn+compile",
    "sdpa+cudagraphs",
    "functional+cudagraphs",
)


@contextlib.contextmanager
def _one_rank_group(device: torch.device):
    """The default group if initialised (its backend must suit ``device``), else a 1-rank one
    made here and destroyed afterwards."""
    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        if own_group:
            dist.destroy_process_group()


def measure_overhead(
    seqs, reps: int, contenders, device, dtype, dims, host_calls: int = 200, profile_dir=None
) -> list[dict]:
    """Rows of fwd, fwd+bwd and host-per-forward ms of every contender at every S (``dims``:
    ``(H, H_kv, D)``), each with its ratio to eager SDPA at that S. Runs on a 1-rank group
    (:func:`_one_rank_group`); ``profile_dir``: write the profiles at the first S there."""
    heads, kv_heads, dim = dims
    rows = []
    with _one_rank_group(device):
        mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
        for S in seqs:
            leaves = [
                torch.randn(1, S, h, dim, device=device, dtype=dtype, requires_grad=True)
                for h in (heads, kv_heads, kv_heads)
            ]
            for name in contenders:
                fwd, fwd_bwd = _callables(name, *leaves, mesh)
                if profile_dir is not None and S == seqs[0] and "+" not in name:
                    _profile(fwd, os.path.join(profile_dir, f"profile_{name}.txt"))
                    _profile(fwd_bwd, os.path.join(profile_dir, f"profile_{name}_fwd_bwd.txt"))
                    _op_profile(fwd_bwd, os.path.join(profile_dir, f"ops_{name}_fwd_bwd.txt"))
                    with open(os.path.join(profile_dir, "syncs.txt"), "a") as f:
                        for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                            syncs = host_syncs(fn)
                            print(f"host syncs, {name} {what}: {len(syncs)}", flush=True)
                            f.writelines(f"{name} {what}: {where}\n" for where in syncs)
                with _OPEN_SCOPE:
                    rows.append(
                        dict(
                            seq=S,
                            what=name,
                            fwd_ms=median_ms(fwd, reps),
                            fwd_bwd_ms=median_ms(fwd_bwd, reps),
                            host_fwd_ms=host_ms(fwd, host_calls),
                        )
                    )
    base = {r["seq"]: r for r in rows if r["what"] == "sdpa"}  # eager SDPA: the baseline
    for r in rows:
        r["fwd_vs_sdpa"] = r["fwd_ms"] / base[r["seq"]]["fwd_ms"]
        r["fwd_bwd_vs_sdpa"] = r["fwd_bwd_ms"] / base[r["seq"]]["fwd_bwd_ms"]
    return rows


def host_layers(S: int, device, dtype, dims, host_calls: int = 200) -> list[dict]:
    """Host ms to issue one forward of the functional call at W = 1 (``[1, S, H, D]``,
    causal), layer by layer of its stack, each row including those above it: the block kernel
    alone (its adapter and aten op); the engine (``ring_attention_impl``: plan, the whole-block
    call); its ``autograd.Function`` (``call_attention``: the eager path of the op); the front
    door (``ring_flash_attn_func``: arguments, ``route``, ``resolve_call``), with the two
    checks also timed alone; eager SDPA for reference. Where the fixed cost of a call goes."""
    from dtensor_ring.algorithm import route
    from dtensor_ring.kernels import get_kernel
    from dtensor_ring.ops.common import call_attention
    from dtensor_ring.ops.ring import ring_attention, ring_attention_impl
    from dtensor_ring.resolve import Call, Door, group_arg, resolve_call

    heads, kv_heads, dim = dims
    q, k, v = (
        torch.randn(1, S, h, dim, device=device, dtype=dtype, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    with _one_rank_group(device):
        name, world = group_arg(None)
        call = Call(
            q, k, v, name, world, "ring", True, None, (-1, -1), 0.0, None, False, None, None
        )
        spec = resolve_call(call, Door("ring_attention"))
        kernel, args = get_kernel(spec.backend), spec.op_args()
        layers = {
            "sdpa": lambda: F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
            ),
            "kernel": lambda: kernel.forward(q, k, v, causal=True, scale=spec.scale),
            "engine": lambda: ring_attention_impl(q, k, v, *args),
            "autograd": lambda: call_attention(ring_attention, q, k, v, *args, None),
            "door": lambda: dr.ring_flash_attn_func(q, k, v, causal=True),
            "route (alone)": lambda: route(call, None, door="ring_attention"),
            "resolve_call (alone)": lambda: resolve_call(call, Door("ring_attention")),
        }
        return [
            dict(seq=S, layer=layer, backend=spec.backend, host_ms=host_ms(fn, host_calls))
            for layer, fn in layers.items()
        ]


def print_overhead(rows: list[dict]) -> None:
    """The overhead table (printed)."""
    print(
        f"{'S':>6} {'what':>11} {'fwd ms':>8} {'x sdpa':>7} {'f+b ms':>8} {'x sdpa':>7} {'host':>7}"
    )
    for r in rows:
        print(
            f"{r['seq']:>6} {r['what']:>11} {r['fwd_ms']:8.3f} {r['fwd_vs_sdpa']:7.2f} "
            f"{r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_vs_sdpa']:7.2f} {r['host_fwd_ms']:7.3f}"
        )


STACK = ("kernel", "engine", "autograd", "door")  # host_layers' stack, innermost first


def print_layers(rows: list[dict]) -> None:
    """The layer table (printed): each layer's host ms and, up the stack, what it adds."""
    print(f"\nhost ms of one forward at W = 1, S = {rows[0]['seq']} ({rows[0]['backend']}):")
    ms = {r["layer"]: r["host_ms"] for r in rows}
    for r in rows:
        i = STACK.index(r["layer"]) if r["layer"] in STACK else 0
        added = f" (+{r['host_ms'] - ms[STACK[i - 1]]:.3f})" if i > 0 else ""
        print(f"  {r['layer']:>22} {r['host_ms']:8.3f}{added}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--seq", default="1024,4096,8192")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: checks the code paths")
    p.add_argument("--profile", action="store_true", help="cProfile the forwards at the first S")
    p.add_argument(
        "--contenders",
        default=None,
        help="comma list (default: all); functional:<backend> names the block kernel",
    )
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = (32, 8, 128) if cuda else (4, 2, 16)
    seqs = [int(s) for s in a.seq.split(",")] if not a.smoke else [16]
    os.makedirs(a.out, exist_ok=True)
    rows = measure_overhead(
        seqs,
        a.reps,
        a.contenders.split(",") if a.contenders else CONTENDERS if cuda else CONTENDERS[:5],
        device,
        dtype,
        (heads, kv_heads, dim),
        host_calls=20 if a.smoke else 200,
        profile_dir=a.out if a.profile else None,
    )
    print_overhead(rows)
    layers = host_layers(seqs[0], device, dtype, (heads, kv_heads, dim), 20 if a.smoke else 200)
    print_layers(layers)
    meta = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        config=dict(heads=heads, kv_heads=kv_heads, head_dim=dim, dtype=str(dtype), causal=True),
    )
    with open(os.path.join(a.out, "bench_overhead.json"), "w") as f:
        json.dump(dict(**meta, rows=rows, layers=layers), f, indent=1)


if __name__ == "__main__":
    main()
