"""GPU check of the ``flash_attn4`` backend (flash-attn 4, CuTe DSL) against fp64, cuDNN and
PyTorch's FlashAttention-2, at the ring's block shapes, and the ring through it.

bf16, ``B=1, H=32, H_kv=8, D=128``; K/V are views of the second half of a buffer and q of a
local shard, as the engine passes them.

* dense blocks ``S x S`` (S = 2048, 4096, 8192), causal and not: ``out, lse, dq, dk, dv`` against
  an fp64 reference (the math kernel, a few heads at a time); ``ratio`` = our max abs error /
  cuDNN's on the same inputs (1.0 = as accurate as cuDNN). Timings (median of 20 CUDA-event
  timed calls after 3 warm-ups) of one forward and one backward block for ``flash_attn4``,
  ``cudnn`` and ``cuda_flash``, also for the zigzag half blocks ``S x S/2`` and ``S/2 x S``;
  ``first_s`` is the wall time of flash_attn4's first call (its JIT compile).
* sliding windows (dense, the trimmed shapes of windowed plans) and varlen (with and without a
  window): errors against fp64, ratio against ``cuda_flash`` (cuDNN has neither).
* deterministic backward (``torch.use_deterministic_algorithms(True)``): two runs bitwise equal.
* fp32 block gradients (``unrounded=True``, Note [Unrounded block gradients from flash-attn 4]):
  rounded, bitwise the plain backward's; errors of both against fp64; the time of one backward
  and the host time to issue it, for both.
* the ring: ``simulate_ring`` (zigzag, 4 ranks, 8192 tokens, causal; and with a window) and
  the functional API on a real 1-rank NCCL group, ``backend="flash_attn4"`` (dq summed in its
  kernel, Note [dq accumulated inside flash-attn 4]; "flash_attn4 summed": fp32 block
  gradients summed by the engine; "flash_attn4 rounded": its plain backward) vs ``cudnn`` /
  ``cuda_flash``,
  against the same fp64 reference, and against single-device flash-attn 4.
* the forward launched from a recording (Note [flash-attn 4's forward, replayed]): bitwise the
  wrapper's output and lse, dense and varlen, and the host time of both.
* fp32 block outputs (``unrounded=True``, Note [fp32 block outputs from flash-attn 4]): lse
  and the output rounded bitwise the plain forward's, dense (GQA, MHA, causal or not, a
  window, 8192 and 1000 tokens) and varlen; errors of both against fp64; the time of both;
  the simulated ring (zigzag W = 4, 8192 tokens) with fp32 and with rounded block outputs
  against fp64 and single-device flash-attn 4.

``FA4_CHECK_PARTS=replay,dense`` runs those parts alone (the ring part follows the dense one).
Each part runs under ``try``; results are written to ``$OUT/flash_attn4.json`` after each part
(a run cut short keeps what it measured); the tables are printed last.

    source .fa4/install.sh && python tests/gpu/check_flash_attn4.py
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

from bench_single_gpu import (  # noqa: E402
    FP32,
    IN_KERNEL,
    INPUT_DTYPE,
    block_grads_mode,
    block_grads_modes,
)

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import BlockKernel, get_kernel  # noqa: E402
from dtensor_ring.kernels.flash_attn4 import FlashAttn4Kernel  # noqa: E402
from dtensor_ring.simulate import RankSimulator, simulate_ring  # noqa: E402

B, H, H_KV, D = 1, 32, 8, 128
DTYPE = torch.bfloat16
SCALE = D**-0.5
SEQLENS = (2048, 4096, 8192)
BACKENDS = ("flash_attn4", "cudnn", "cuda_flash")
NAMES = ("out", "lse", "dq", "dk", "dv")
WINDOWS = [  # (S_q, S_k, window): shapes and bands of windowed plans (tests/gpu/check_window.py)
    (4096, 4096, (512, 0)),
    (2048, 2048, (0, -1)),
    (3000, 2000, (40, 1000)),
    (1536, 4096, (-1, 7)),
]
VARLEN = [  # (cu_seqlens, causal, window)
    ((0, 256, 7648, 8192), False, None),
    ((0, 256, 7648, 8192), True, None),
    ((0, 256, 3000, 4096), False, (200, 0)),
]
DEADLINE_S = float(os.environ.get("FA4_CHECK_DEADLINE_S", "300"))
START = time.perf_counter()
RESULT: dict[str, object] = {}


# --- inputs, runs, reference ------------------------------------------------------------------
def make_inputs(s_q: int, s_k: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``q, k, v, dout`` in BSHD; q a view of a local shard, K/V of a double buffer's halves."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=DTYPE, generator=gen)
    q = torch.randn(B, 2 * s_q, H, D, **kw)[:, s_q:]
    k, v = torch.randn(2, B, 2 * s_k, H_KV, D, **kw)[:, :, s_k:].unbind(0)
    return q, k, v, torch.randn(B, s_q, H, D, **kw)


def run(
    kernel: BlockKernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    cu: Tensor | None = None,
) -> dict[str, Tensor]:
    """``out, lse, dq, dk, dv`` of one block (varlen if ``cu``, packed ``[T, H, D]``)."""
    kw = dict(causal=causal, scale=SCALE, window=window)
    if cu is None:
        out, lse = kernel.forward(q, k, v, **kw)
        grads = kernel.backward(dout, q, k, v, out, lse, **kw)
    else:
        n = int(cu.diff().max())
        out, lse = kernel.forward_varlen(q, k, v, cu, cu, n, n, **kw)
        grads = kernel.backward_varlen(dout, q, k, v, out, lse, cu, cu, n, n, **kw)
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def reference(q, k, v, dout, heads_per_chunk: int = 8, **kw) -> dict[str, Tensor]:
    """fp64 ``run`` of the math kernel, a group of KV heads at a time (exact: query heads only
    meet their own KV heads)."""
    group = q.shape[-2] // k.shape[-2]
    step = max(1, heads_per_chunk // group)
    parts: dict[str, list[Tensor]] = {n: [] for n in NAMES}
    for j in range(0, k.shape[-2], step):
        hq, hk = slice(j * group, (j + step) * group), slice(j, j + step)
        chunk = (t[..., h, :].double() for t, h in ((q, hq), (k, hk), (v, hk), (dout, hq)))
        for name, t in run(get_kernel("math"), *chunk, **kw).items():
            parts[name].append(t)
    return {n: torch.cat(ts, dim=ts[0].dim() - 2) for n, ts in parts.items()}


def errors(got: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, float]:
    """Max abs error of each result against the fp64 reference."""
    return {n: (got[n].double() - ref[n]).abs().max().item() for n in NAMES}


def ratios(err: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Our error / the baseline's, per result except lse (fp32 in every backend)."""
    return {n: err[n] / max(base[n], 1e-30) for n in NAMES if n != "lse"}


def median_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn`` in ms over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rank_ms(sim) -> float:
    """:func:`median_ms` of a simulated rank's forward + backward (``RankSimulator``)."""
    grad = torch.randn_like(sim.q)

    def step():
        sim.forward()
        sim.backward(grad)

    return median_ms(step)


def host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host microseconds to issue one call: ``calls`` back to back, no synchronisation."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def first_call_s(fn: Callable[[], object]) -> float:
    """Wall time of one call of ``fn`` (the JIT compile for a new flash_attn4 configuration)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def error_text(e: Exception) -> str:
    traceback.print_exc()
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def save() -> None:
    """Write what was measured so far to ``$OUT/flash_attn4.json``."""
    RESULT["seconds"] = round(time.perf_counter() - START, 1)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "flash_attn4.json"), "w") as f:
        json.dump(RESULT, f, indent=1)


def late(part: str) -> bool:
    """Whether the deadline has passed (then ``part`` is recorded as skipped)."""
    if time.perf_counter() - START < DEADLINE_S:
        return False
    RESULT.setdefault("skipped", []).append(part)
    return True


# --- parts ------------------------------------------------------------------------------------
def environment() -> dict[str, object]:
    try:
        fa4 = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        fa4 = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
        "flash_attn_4": fa4,
        "available": {n: get_kernel(n).is_available() for n in BACKENDS},
        "date": time.strftime("%Y-%m-%d"),
    }


def dense_case(S: int, causal: bool) -> tuple[list[dict], tuple, dict]:
    """One square block: every backend's errors (ratios vs cuDNN) and timings; also returns
    the inputs and the fp64 reference."""
    x = make_inputs(S, S)
    ref = reference(*x, causal=causal)
    rows, errs = [], {}
    for name in BACKENDS:
        row: dict[str, object] = dict(backend=name, s_q=S, s_k=S, causal=causal)
        kernel = get_kernel(name)
        try:
            if name == "flash_attn4":
                row["first_s"] = first_call_s(functools.partial(run, kernel, *x, causal=causal))
            errs[name] = errors(run(kernel, *x, causal=causal), ref)
            row["errors"] = errs[name]
            row |= block_times(kernel, *x, causal=causal)
        except Exception as e:
            row["status"] = error_text(e)
        rows.append(row)
    for row in rows:
        if row["backend"] in errs and "cudnn" in errs:
            row["ratio_vs_cudnn"] = ratios(errs[row["backend"]], errs["cudnn"])
    return rows, x, ref


def dense_part() -> dict[str, object]:
    """Square blocks vs fp64 and block timings (also of the zigzag half blocks); returns the
    S=8192 causal inputs and reference for the ring part."""
    rows, keep = [], {}
    for S in SEQLENS:
        for causal in (False, True):
            if late(f"dense {S} causal={causal}"):
                continue
            case_rows, x, ref = dense_case(S, causal)
            rows += case_rows
            if S == 8192 and causal:
                keep = {"inputs": x, "ref": ref}
            del x, ref
            torch.cuda.empty_cache()
        for s_q, s_k in ((S, S // 2), (S // 2, S)):
            q, k, v, dout = make_inputs(s_q, s_k)
            for name in BACKENDS:
                row: dict[str, object] = dict(backend=name, s_q=s_q, s_k=s_k, causal=False)
                try:
                    row |= block_times(get_kernel(name), q, k, v, dout, causal=False)
                except Exception as e:
                    row["status"] = error_text(e)
                rows.append(row)
        RESULT["dense"] = rows
        save()
    RESULT["summary"] = summary(rows)
    save()
    return keep


def block_times(kernel: BlockKernel, q, k, v, dout, *, causal: bool, window=None) -> dict:
    """ms of one forward and one backward block, and TFLOP/s for unwindowed blocks
    (``4*B*H*S_q*S_k*D`` forward FLOPs, half if causal; backward 2.5x)."""
    kw = dict(causal=causal, scale=SCALE, window=window)
    out, lse = kernel.forward(q, k, v, **kw)
    times = dict(
        fwd_ms=median_ms(lambda: kernel.forward(q, k, v, **kw)),
        bwd_ms=median_ms(lambda: kernel.backward(dout, q, k, v, out, lse, **kw)),
    )
    if window is None:
        flops = 4 * B * H * q.shape[1] * k.shape[1] * D * (0.5 if causal else 1.0)
        times["fwd_tflops"] = flops / times["fwd_ms"] / 1e9
        times["bwd_tflops"] = 2.5 * flops / times["bwd_ms"] / 1e9
    return times


def summary(rows: list[dict]) -> dict[str, object]:
    """Total ms of forward and backward over every timed block shape, per backend."""
    shapes = {(r["s_q"], r["s_k"], r["causal"]) for r in rows}
    timed = {(r["backend"], r["s_q"], r["s_k"], r["causal"]): r for r in rows if "fwd_ms" in r}
    common = [s for s in shapes if all((b, *s) in timed for b in BACKENDS)]
    out: dict[str, object] = {"shapes": len(common)}
    for b in BACKENDS:
        fwd = sum(timed[(b, *s)]["fwd_ms"] for s in common)
        bwd = sum(timed[(b, *s)]["bwd_ms"] for s in common)
        out[b] = dict(fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=fwd + bwd)
    return out


def window_part() -> None:
    rows = []
    for s_q, s_k, window in WINDOWS:
        if late(f"window {s_q}x{s_k} {window}"):
            continue
        x = make_inputs(s_q, s_k, seed=1)
        ref = reference(*x, causal=False, window=window)
        errs = {}
        for name in ("flash_attn4", "cuda_flash"):
            row: dict[str, object] = dict(backend=name, s_q=s_q, s_k=s_k, window=window)
            try:
                errs[name] = errors(run(get_kernel(name), *x, causal=False, window=window), ref)
                row["errors"] = errs[name]
                row |= block_times(get_kernel(name), *x, causal=False, window=window)
            except Exception as e:
                row["status"] = error_text(e)
            rows.append(row)
        if len(errs) == 2:
            rows[-2]["ratio_vs_cuda_flash"] = ratios(errs["flash_attn4"], errs["cuda_flash"])
        RESULT["window"] = rows
        save()


def varlen_part() -> None:
    rows = []
    for bounds, causal, window in VARLEN:
        if late(f"varlen {bounds}"):
            continue
        T = bounds[-1]
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        q, k, v, dout = (t[0] for t in make_inputs(T, T, seed=2))
        kw = dict(causal=causal, window=window, cu=cu)
        ref = reference(q, k, v, dout, **kw)
        errs = {}
        for name in ("flash_attn4", "cuda_flash"):
            row: dict[str, object] = dict(backend=name, cu_seqlens=bounds, causal=causal)
            row["window"] = window
            try:
                errs[name] = errors(run(get_kernel(name), q, k, v, dout, **kw), ref)
                row["errors"] = errs[name]
            except Exception as e:
                row["status"] = error_text(e)
            rows.append(row)
        if len(errs) == 2:
            rows[-2]["ratio_vs_cuda_flash"] = ratios(errs["flash_attn4"], errs["cuda_flash"])
        RESULT["varlen"] = rows
        save()


def deterministic_part() -> None:
    if late("deterministic"):
        return
    x = make_inputs(2048, 2048, seed=3)
    kernel = get_kernel("flash_attn4")
    try:
        torch.use_deterministic_algorithms(True)
        first, second = (run(kernel, *x, causal=True) for _ in range(2))
        same = {n: torch.equal(first[n], second[n]) for n in ("dq", "dk", "dv")}
        ref = reference(*x, causal=True)
        RESULT["deterministic"] = dict(bitwise_equal=same, errors=errors(first, ref))
    except Exception as e:
        RESULT["deterministic"] = dict(status=error_text(e))
    finally:
        torch.use_deterministic_algorithms(False)
    save()


UNROUNDED = [  # (S_q, S_k, H_kv, causal, window): ring blocks (zigzag halves), MHA, windows
    (4096, 4096, H_KV, True, None),
    (4096, 2048, H_KV, False, None),
    (2048, 4096, H_KV, False, None),
    (2000, 3000, H_KV, False, None),
    (2048, 2048, H, True, None),
    (3000, 2000, H_KV, False, (40, 1000)),
]


def unrounded_part() -> None:
    """Note [Unrounded block gradients from flash-attn 4]: the fp32 block gradients, rounded,
    are bitwise flash-attn 4's own (both deterministic: same kernels, the postprocess only
    rounds), and closer to fp64."""
    if late("unrounded"):
        return
    kernel, rows = get_kernel("flash_attn4"), []
    try:
        torch.use_deterministic_algorithms(True)
        for s_q, s_k, h_kv, causal, window in UNROUNDED:
            row: dict[str, object] = dict(s_q=s_q, s_k=s_k, h_kv=h_kv, causal=causal)
            row["window"] = window
            try:
                q, k, v, dout = make_inputs(s_q, s_k, seed=4)
                if h_kv > H_KV:  # MHA: the 8 K/V heads tiled to H
                    k, v = (t.repeat(1, 1, h_kv // H_KV, 1) for t in (k, v))
                kw = dict(causal=causal, scale=SCALE, window=window)
                out, lse = kernel.forward(q, k, v, **kw)
                plain = kernel.backward(dout, q, k, v, out, lse, **kw)
                fp32 = kernel.backward(dout, q, k, v, out, lse, **kw, unrounded=True)
                ref = reference(q, k, v, dout, causal=causal, window=window)
                args = (dout, q, k, v, out, lse)
                for what, grads in (("plain", False), ("fp32", True)):
                    call = functools.partial(kernel.backward, *args, **kw, unrounded=grads)
                    row[f"ms_{what}"] = median_ms(call)
                    row[f"host_us_{what}"] = host_us(call)
                for name, p, u in zip(("dq", "dk", "dv"), plain, fp32, strict=True):
                    row[name] = dict(
                        dtype=str(u.dtype),
                        bitwise_rounded=torch.equal(u.to(p.dtype), p),
                        err_plain=(p.double() - ref[name]).abs().max().item(),
                        err_fp32=(u.double() - ref[name]).abs().max().item(),
                    )
            except Exception as e:
                row["status"] = error_text(e)
            rows.append(row)
            RESULT["unrounded"] = rows
            save()
    finally:
        torch.use_deterministic_algorithms(False)


REPLAYS = [  # (S_q, S_k, H_kv, causal, window) dense; (cu_q, cu_k, causal, window) varlen
    (4096, 4096, H_KV, True, None),
    (4096, 2048, H_KV, False, None),
    (2000, 3000, H_KV, False, None),
    (2048, 2048, H, True, None),
    (3000, 2000, H_KV, False, (40, 1000)),
    ((0, 256, 3000, 4096), None, True, None),  # cu_seqlens_k is cu_seqlens_q
    ((0, 256, 3000, 4096), (0, 512, 1000, 4096), False, (200, 0)),
    (tuple(range(0, 4097, 8)), None, True, None),  # 512 documents: flash-attn 4's scheduler
]


def replay_part() -> None:
    """Note [flash-attn 4's forward, replayed]: a forward launched from the recording is
    bitwise the wrapper's (same inputs, REPLAY off), and its host time."""
    if late("replay"):
        return
    from dtensor_ring.kernels import flash_attn4_launch as launch

    kernel, rows = get_kernel("flash_attn4"), []
    for case in REPLAYS:
        row: dict[str, object] = dict(case=str(case)[:80])
        try:
            if isinstance(case[0], int):
                s_q, s_k, h_kv, causal, window = case
                q, k, v, _ = make_inputs(s_q, s_k, seed=5)
                if h_kv > H_KV:
                    k, v = (t.repeat(1, 1, h_kv // H_KV, 1) for t in (k, v))
                kw = dict(causal=causal, scale=SCALE, window=window)
                call = functools.partial(kernel.forward, q, k, v, **kw)
            else:
                bounds_q, bounds_k, causal, window = case
                cu_q = torch.tensor(bounds_q, dtype=torch.int32, device="cuda")
                cu_k = cu_q if bounds_k is None else torch.tensor(bounds_k, dtype=torch.int32)
                cu_k = cu_k.cuda()
                q, k, v = (t[0] for t in make_inputs(bounds_q[-1], bounds_q[-1], seed=5)[:3])
                n_q, n_k = int(cu_q.diff().max()), int(cu_k.diff().max())
                kw = dict(causal=causal, scale=SCALE, window=window)
                call = functools.partial(kernel.forward_varlen, q, k, v, cu_q, cu_k, n_q, n_k, **kw)
            launch.REPLAY = False
            want = call()
            row["host_us_wrapper"] = host_us(call)
            launch.REPLAY = True
            first, again = call(), call()
            row["replayed"] = any(isinstance(x, launch._Launch) for x in launch._LAUNCHES.values())
            row["bitwise"] = all(
                torch.equal(g, w) for got in (first, again) for g, w in zip(got, want, strict=True)
            )
            row["host_us_replayed"] = host_us(call)
            row["ms"] = median_ms(call)
        except Exception as e:
            row["status"] = error_text(e)
        finally:
            launch.REPLAY = True
            launch._LAUNCHES.clear()  # each case tells whether it replayed
        rows.append(row)
        RESULT["replay"] = rows
        save()


FP32_OUT = [  # (S_q, S_k, H_kv, causal, window, cu_seqlens)
    (8192, 8192, H_KV, True, None, None),
    (4096, 8192, H_KV, False, None, None),
    (8192, 8192, H, True, None, None),
    (1000, 1000, H_KV, True, None, None),
    (4096, 4096, H_KV, False, (512, 0), None),
    (8192, 8192, H_KV, True, None, (0, 256, 3000, 8192)),
]


def fp32_out_part() -> None:
    """fp32 block outputs (Note [fp32 block outputs from flash-attn 4]) against the plain
    forward and fp64, then the simulated ring with and without them (on for this part)."""
    kernel, rows, default = get_kernel("flash_attn4"), [], FlashAttn4Kernel.unrounded_outputs
    FlashAttn4Kernel.unrounded_outputs = True
    try:
        _fp32_out_rows(kernel, rows)
    finally:
        FlashAttn4Kernel.unrounded_outputs = default


def _fp32_out_rows(kernel: BlockKernel, rows: list[dict]) -> None:
    for s_q, s_k, h_kv, causal, window, bounds in FP32_OUT:
        if late(f"fp32 out {s_q} {s_k}"):
            continue
        row: dict[str, object] = dict(S_q=s_q, S_k=s_k, H_kv=h_kv, causal=causal)
        row |= dict(window=window, cu_seqlens=bounds)
        try:
            q, k, v, _ = make_inputs(s_q, s_k, seed=7)
            if h_kv > H_KV:
                k, v = (t.repeat_interleave(h_kv // H_KV, 2) for t in (k, v))
            kw = dict(causal=causal, scale=SCALE, window=window)
            if bounds is None:
                call = functools.partial(kernel.forward, q, k, v, **kw)
            else:
                q, k, v = (t[0] for t in (q, k, v))
                cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
                n = int(cu.diff().max())
                call = functools.partial(kernel.forward_varlen, q, k, v, cu, cu, n, n, **kw)
            plain, fp32 = call(), call(unrounded=True)
            row["out_dtype"] = str(fp32[0].dtype)
            row["lse_bitwise"] = torch.equal(plain[1], fp32[1])
            row["rounded_bitwise"] = torch.equal(plain[0], fp32[0].to(plain[0].dtype))
            mask = dict(causal=causal, window=window, cu=None if bounds is None else cu)
            dout = torch.zeros_like(q)
            ref = reference(q, k, v, dout, **mask)
            row["err_plain"] = float((plain[0].double() - ref["out"]).abs().max())
            row["err_fp32"] = float((fp32[0].double() - ref["out"]).abs().max())
            row["ms_plain"], row["ms_fp32"] = (
                median_ms(call),
                median_ms(functools.partial(call, unrounded=True)),
            )
            row["ok"] = row["lse_bitwise"] and row["rounded_bitwise"]
        except Exception as e:
            row["status"] = error_text(e)
        rows.append(row)
        RESULT["fp32_out"] = rows
        save()
    if late("fp32 out ring"):
        return
    q, k, v, dout = make_inputs(8192, 8192)
    ref = reference(q, k, v, dout, causal=True)
    single = errors(run(kernel, q, k, v, dout, causal=True), ref)
    ring = []
    for on in (True, False):
        FlashAttn4Kernel.unrounded_outputs = on
        try:
            got = simulate_ring(q, k, v, dout, layout="zigzag", world_size=4, causal=True,
                                backend="flash_attn4")  # fmt: skip
            errs = errors(dict(zip(NAMES, got, strict=True)), ref)
            mean = float((got[0].double() - ref["out"]).abs().mean())
            ring.append(dict(fp32_block_outputs=on, errors=errs, out_mean_err=mean,
                             ratio_vs_single_flash_attn4=ratios(errs, single)))  # fmt: skip
        except Exception as e:
            ring.append(dict(fp32_block_outputs=on, status=error_text(e)))
        finally:
            FlashAttn4Kernel.unrounded_outputs = True
        RESULT["fp32_out_ring"] = ring
        save()
    out_single = run(kernel, q, k, v, dout, causal=True)["out"]
    RESULT["fp32_out_single_mean_err"] = float((out_single.double() - ref["out"]).abs().mean())
    save()
    if late("fp32 out ring time"):
        return
    times = {}  # rank 0 of zigzag W = 8, 8192 tokens a rank: forward, and forward + backward
    for tokens in (8192, 4096):
        q, k, v, _ = make_inputs(8 * tokens, 8 * tokens, seed=9)
        for on in (True, False):
            FlashAttn4Kernel.unrounded_outputs = on
            try:
                sim = RankSimulator(q, k, v, rank=0, layout="zigzag", world_size=8, causal=True,
                                    backend="flash_attn4")  # fmt: skip
                times[f"{tokens} fp32 outputs {on}"] = (median_ms(sim.forward), rank_ms(sim))
            finally:
                FlashAttn4Kernel.unrounded_outputs = True
            RESULT["fp32_out_rank_ms"] = times
            save()


def merge_part() -> None:
    """Blocks merged in the epilogue (Note [Merging in flash-attn 4's epilogue]) against the
    engine's merge of fp32 block outputs: the simulated ring's out and lse against fp64 with
    the kernel merging (on) and not (off), dense zigzag and packed documents at W = 4 (the
    document layout, and zigzag, whose halves of documents the kernel merges where their rows
    lie); how many blocks the kernel merged; then one rank's forward time, on and off: zigzag
    W = 8 at 8192 and 4096 tokens a rank, and 5 long documents in 65536 tokens placed on 8
    ranks."""
    from dtensor_ring.kernels import flash_attn4_launch as launch

    merged, by_document, original = [], [], launch.merge_forward

    def counted(*args, **kwargs):
        done = original(*args, **kwargs)
        merged.append(done)
        by_document.append(done and kwargs.get("seqused_q") is not None)
        return done

    launch.merge_forward = counted
    default, by_document_default = (
        FlashAttn4Kernel.merges_outputs,
        FlashAttn4Kernel.merges_by_document,
    )
    FlashAttn4Kernel.merges_by_document = True  # what this part checks
    rows, times = [], {}
    try:
        bounds = [0, 2048, 3072, 8192]
        q, k, v, dout = make_inputs(8192, 8192, seed=11)
        cases = [("zigzag", "zigzag", None), ("documents", dr.document_layout(bounds, 4), bounds)]
        cases.append(("varlen zigzag", "zigzag", bounds))  # halves merged by document
        # halves of 257 and 639 rows: partial tiles (Note [Merging in flash-attn 4's epilogue])
        cases.append(("varlen zigzag, partial tiles", "zigzag", [0, 2056, 3080, 8192]))
        for label, layout, cu_seqlens in cases:
            if late(f"merge {label}"):
                continue
            tensors = (q, k, v, dout)
            tensors = tensors if cu_seqlens is None else tuple(t[0] for t in tensors)
            cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32).cuda()
            ref = reference(*tensors, causal=True, cu=cu)
            for on in (True, False):
                FlashAttn4Kernel.merges_outputs = on
                merged.clear()
                by_document.clear()
                row: dict[str, object] = dict(path=f"simulate {label} W=4", kernel_merges=on)
                try:
                    got = simulate_ring(*tensors, layout=layout, world_size=4, causal=True,
                                        cu_seqlens=cu_seqlens, backend="flash_attn4")  # fmt: skip
                    row["errors"] = errors(dict(zip(NAMES, got, strict=True)), ref)
                    row["out_mean_err"] = float((got[0].double() - ref["out"]).abs().mean())
                    row["blocks_merged_by_kernel"] = sum(merged)
                    row["blocks_not_replayable"] = merged.count(False)
                    row["blocks_merged_by_document"] = sum(by_document)
                except Exception as e:
                    row["status"] = error_text(e)
                rows.append(row)
                RESULT["merge"] = rows
                save()
        timed = [(f"zigzag W=8 {n}", n) for n in (8192, 4096)] + [("documents x5 W=8", None)]
        for label, tokens in timed:
            if late(f"merge time {label}"):
                continue
            if tokens is None:  # bench_flex's 5 documents, the balanced placement, rank 7
                import bench_flex

                bounds5 = bench_flex.documents(65536, 5, "cuda")[1]
                x = tuple(t[0] for t in make_inputs(65536, 65536, seed=12)[:3])
                kw = dict(layout=dr.document_layout(bounds5, 8), cu_seqlens=bounds5, rank=7)
            else:
                x, kw = (
                    make_inputs(8 * tokens, 8 * tokens, seed=9)[:3],
                    dict(layout="zigzag", rank=0),
                )
            for on in (True, False):
                FlashAttn4Kernel.merges_outputs = on
                sim = RankSimulator(*x, world_size=8, causal=True, backend="flash_attn4", **kw)
                times[f"{label} kernel merges {on}"] = median_ms(sim.forward)
                RESULT["merge_rank_fwd_ms"] = times
                save()
    finally:
        launch.merge_forward = original
        FlashAttn4Kernel.merges_outputs = default
        FlashAttn4Kernel.merges_by_document = by_document_default


def ring_part(keep: dict) -> None:
    """zigzag W=4 on one device (simulated), and the functional API on a real 1-rank group."""
    rows = []
    q, k, v, dout = keep["inputs"]
    cases = [(None, keep["ref"], ("flash_attn4", "cudnn"))]
    if not late("ring window"):
        window = (1024, 0)
        ref = reference(q, k, v, dout, causal=False, window=window)  # square: causal is implied
        cases.append((window, ref, ("flash_attn4", "cuda_flash")))  # cudnn: no window
    single = errors(run(get_kernel("flash_attn4"), q, k, v, dout, causal=True), keep["ref"])
    for window, ref, names in cases:
        errs = {}
        for name in (*names, "flash_attn4 summed", "flash_attn4 rounded"):
            backend, _, how = name.partition(" ")
            row: dict[str, object] = dict(path="simulate zigzag W=4", backend=name, S=8192)
            row["window"] = window
            # summed: fp32 block gradients, dq summed by the engine; rounded: the plain backward
            own = block_grads_modes(backend, compare=False)[0]
            mode = {"summed": FP32, "rounded": INPUT_DTYPE}.get(how, own)
            try:
                with block_grads_mode(backend, mode):
                    got = simulate_ring(
                        q,
                        k,
                        v,
                        dout,
                        layout="zigzag",
                        world_size=4,
                        causal=True,
                        backend=backend,
                        window_size=window or (-1, -1),
                    )
                errs[name] = errors(dict(zip(NAMES, got, strict=True)), ref)
                row["errors"] = errs[name]
                if window is None:  # the issue's row: against the single-device kernel
                    row["ratio_vs_single_flash_attn4"] = ratios(errs[name], single)
            except Exception as e:
                row["status"] = error_text(e)
            rows.append(row)
        base = "cudnn" if window is None else "cuda_flash"
        if "flash_attn4" in errs and base in errs:
            rows[-len(names) - 2][f"ratio_vs_{base}"] = ratios(errs["flash_attn4"], errs[base])
        RESULT["ring"] = rows
        save()
    if late("functional"):
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        for name in ("flash_attn4", "cudnn"):
            rows.append(functional_row(name, q, k, v, dout, keep["ref"]))
            RESULT["ring"] = rows
            save()
    finally:
        dist.destroy_process_group()


def ring_varlen_part() -> None:
    """Packed documents on the simulated ring (W = 4, 8192 tokens): flash-attn 4 with a rank's
    dq summed in its kernel (Note [A varlen dq accumulated inside flash-attn 4]) against its
    per-block varlen backward and single-device flash-attn 4, errors against fp64; how many
    ranks accumulated; one rank's fwd+bwd time in both modes (the first two cases). Cases:
    zigzag and the document layout (GQA 32:8), zigzag with MHA, with a window of 512, and
    deterministic."""
    from dtensor_ring.kernels import flash_attn4_ring_dq

    W, bounds = 4, (0, 2048, 3072, 8192)  # zigzag halves of 256, 128 and 640 tokens
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    gqa = tuple(t[0] for t in make_inputs(bounds[-1], bounds[-1], seed=3))
    q, k, v, dout = gqa
    mha = (q, k.repeat_interleave(H // H_KV, 1), v.repeat_interleave(H // H_KV, 1), dout)
    cases = [  # (label, layout, tensors, window, deterministic, timed)
        ("zigzag", "zigzag", gqa, None, False, True),
        ("documents", dr.document_layout(list(bounds), W), gqa, None, False, True),
        ("zigzag MHA", "zigzag", mha, None, False, False),
        ("zigzag window 512", "zigzag", gqa, (512, 0), False, False),
        ("zigzag deterministic", "zigzag", gqa, None, True, False),
    ]
    cls = flash_attn4_ring_dq.RingDqVarlen
    built, original = [], cls.__dict__["of"]  # the classmethod itself, restored below

    def counted(*args, **kwargs):
        acc = original.__get__(None, cls)(*args, **kwargs)
        built.append(acc is not None)
        return acc

    cls.of = staticmethod(counted)
    rows = []
    try:
        for label, layout, tensors, window, deterministic, timed in cases:
            if late(f"ring varlen {label}"):
                continue
            mask = dict(causal=window is None, window=window, cu=cu)  # a window: causal in it
            ref = reference(*tensors, **mask)
            single = errors(run(get_kernel("flash_attn4"), *tensors, **mask), ref)
            kw = dict(layout=layout, world_size=W, causal=True, backend="flash_attn4")
            kw |= dict(cu_seqlens=list(bounds), window_size=window or (-1, -1))
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            for mode in (IN_KERNEL, FP32):
                row: dict[str, object] = dict(path=f"simulate varlen {label} W={W}", mode=mode)
                built.clear()
                with block_grads_mode("flash_attn4", mode):
                    got = simulate_ring(*tensors, **kw)
                    if timed:
                        sim = RankSimulator(*tensors[:3], rank=0, **kw)
                        row["rank0_fwd_bwd_ms"] = rank_ms(sim)
                row["errors"] = errors(dict(zip(NAMES, got, strict=True)), ref)
                row["ratio_vs_single_flash_attn4"] = ratios(row["errors"], single)
                row["ranks_accumulating"] = sum(built[:W])
                rows.append(row)
                RESULT["ring_varlen"] = rows
                save()
    finally:
        cls.of = original
        torch.use_deterministic_algorithms(False)


def functional_row(name: str, q, k, v, dout, ref) -> dict[str, object]:
    """``zigzag_ring_flash_attn_func`` on the 1-rank group: errors and fwd / fwd+bwd ms."""
    row: dict[str, object] = dict(path="functional zigzag W=1 (NCCL)", backend=name, S=8192)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        return dr.zigzag_ring_flash_attn_func(*leaves, causal=True, backend=name)

    def fwd_bwd():
        fwd().backward(dout)

    try:
        out = fwd()
        out.backward(dout)
        got = dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        row["errors"] = {n: (t.double() - ref[n]).abs().max().item() for n, t in got.items()}
        row["fwd_ms"] = median_ms(fwd)
        row["fwd_bwd_ms"] = median_ms(fwd_bwd)
    except Exception as e:
        row["status"] = error_text(e)
    return row


# --- report -----------------------------------------------------------------------------------
def _f(x: float | None, spec: str = "8.3f") -> str:
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def print_tables() -> None:
    print(json.dumps(RESULT.get("environment"), indent=1))
    print(
        f"\n{'backend':<12}{'block':>12}{'causal':>7}{'fwd ms':>9}{'bwd ms':>9}"
        f"{'fwd TF':>8}{'bwd TF':>8}  ratio vs cudnn out/dq/dk/dv, first call s, status"
    )
    for r in RESULT.get("dense", []):
        rat = r.get("ratio_vs_cudnn", {})
        print(
            f"{r['backend']:<12}{str(r['s_q']) + 'x' + str(r['s_k']):>12}{r['causal']!s:>7}"
            f"{_f(r.get('fwd_ms'), '9.3f')}{_f(r.get('bwd_ms'), '9.3f')}"
            f"{_f(r.get('fwd_tflops'), '8.0f')}{_f(r.get('bwd_tflops'), '8.0f')}  "
            f"{' '.join(_f(rat.get(n), '5.2f') for n in ('out', 'dq', 'dk', 'dv'))} "
            f"{_f(r.get('first_s'), '6.1f')} {r.get('status', '')}"
        )
    print("\nsummary (ms over all timed block shapes):", json.dumps(RESULT.get("summary")))
    for part in ("window", "varlen", "unrounded", "ring"):
        print(f"\n{part}:")
        for r in RESULT.get(part, []):
            print(" ", json.dumps(r))
    print("\ndeterministic:", json.dumps(RESULT.get("deterministic")))
    for row in RESULT.get("replay", []):
        print("replay:", json.dumps(row))
    print("skipped:", RESULT.get("skipped"), f"; {RESULT.get('seconds')} s")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("CUDA is not available: run on a GPU machine.")
    RESULT["environment"] = environment()
    save()
    keep = {}
    only = os.environ.get("FA4_CHECK_PARTS")  # e.g. "replay,dense": those parts alone
    for part in (
        replay_part,
        dense_part,
        window_part,
        varlen_part,
        deterministic_part,
        unrounded_part,
        fp32_out_part,
        merge_part,
        ring_varlen_part,
    ):
        if only and part.__name__.removesuffix("_part") not in only.split(","):
            continue
        try:
            keep = part() or keep
        except Exception as e:
            RESULT[f"{part.__name__}_error"] = error_text(e)
        print(f"[{time.perf_counter() - START:6.1f}s] {part.__name__}", flush=True)
    if keep:  # the dense part's inputs and reference
        try:
            ring_part(keep)
        except Exception as e:
            RESULT["ring_part_error"] = error_text(e)
    save()
    print_tables()


if __name__ == "__main__":
    main()
