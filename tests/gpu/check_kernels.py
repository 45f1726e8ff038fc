"""GPU check of the CUDA block kernels: numerics against fp64, and speed.

For each available CUDA backend (flash_attn, cudnn, cuda_flash), bf16 and fp16, ``B=1, H=32,
H_kv in (32, 8), D=128``, square blocks ``S in (1024, 8192, 32768)`` causal and not, a
non-causal ``8192 x 4096`` block whose K/V are the second half of a buffer (a zigzag
half-block, as the engine sends it), and varlen ``cu_seqlens = [0, 256, 7648, 8192]`` for the
varlen backends:

* errors: max abs error of ``out, lse, dq, dk, dv`` against an fp64 reference (the math kernel,
  one group of KV heads at a time; only up to ``S = 8192``: at 32k the fp64 scores alone would
  take 275 GB), divided by the error of ``F.scaled_dot_product_attention`` run in the same
  dtype (SDPA per document for varlen). SDPA returns no lse; lse (fp32) is judged on its own.
* speed: median of 10 timed repetitions (CUDA events, after warm-up) of forward and of
  forward+backward, in TFLOP/s with ``4*B*H*S_q*S_k*D`` FLOPs per forward (half if causal)
  and 3.5x that for forward+backward.

Each case runs under ``try``: an error is recorded in its row instead of stopping the run.
Results go to ``$OUT/kernels.json`` (``OUT`` defaults to ``./out``); the table is printed last.

Usage::

    python tests/gpu/check_kernels.py            # one GPU, a few minutes at most
    python tests/gpu/check_kernels.py --smoke    # CPU, tiny sizes, cpu_flash/math backends
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dtensor_ring.kernels import BlockKernel, KernelCall, get_kernel  # noqa: E402
from dtensor_ring.kernels.math import MathKernel  # noqa: E402

MATH = MathKernel()
GRAD_NAMES = ("dq", "dk", "dv")
CHECKED = ("out", *GRAD_NAMES)  # compared with SDPA's error; lse is judged alone
LSE_TOL = 1e-3  # max abs lse error (fp32 lse, natural log) accepted
RATIO_TOL = 3.0  # error may be this many times SDPA's ...
ABS_TOL = 1e-4  # ... plus this


@dataclass(frozen=True)
class Config:
    """What to run: the GPU check or its CPU smoke version."""

    device: str
    backends: tuple[str, ...]  # dense-block backends to check, if available
    varlen_backends: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    batch: int
    heads: int
    kv_heads: tuple[int, ...]
    head_dim: int
    seqlens: tuple[int, ...]  # square blocks
    ref_max_seqlen: int  # larger blocks are only timed
    nonsquare: tuple[int, int]  # (S_q, S_k), non-causal
    cu_seqlens: tuple[int, ...]
    ref_heads: int  # query heads per fp64 reference chunk
    warmup: int
    reps: int


GPU = Config(
    device="cuda",
    backends=("flash_attn", "cudnn", "cuda_flash"),
    varlen_backends=("flash_attn", "cuda_flash"),
    dtypes=(torch.bfloat16, torch.float16),
    batch=1,
    heads=32,
    kv_heads=(32, 8),
    head_dim=128,
    seqlens=(1024, 8192, 32768),
    ref_max_seqlen=8192,
    nonsquare=(8192, 4096),
    cu_seqlens=(0, 256, 7648, 8192),
    ref_heads=8,
    warmup=3,
    reps=10,
)
SMOKE = Config(
    device="cpu",
    backends=("cpu_flash", "math"),
    varlen_backends=("math",),
    dtypes=(torch.bfloat16, torch.float16),
    batch=1,
    heads=4,
    kv_heads=(4, 2),
    head_dim=16,
    seqlens=(64, 128, 256),
    ref_max_seqlen=128,
    nonsquare=(128, 64),
    cu_seqlens=(0, 8, 100, 128),
    ref_heads=2,
    warmup=1,
    reps=2,
)


@dataclass(frozen=True)
class Case:
    """One block shape: dense ``[B, S_q, H, D] x [B, S_k, H_kv, D]``, or varlen."""

    dtype: torch.dtype
    kv_heads: int
    s_q: int
    s_k: int
    causal: bool
    varlen: bool = False

    def label(self) -> str:
        """E.g. ``bfloat16 hkv=8 8192x4096 causal``."""
        shape = f"varlen T={self.s_q}" if self.varlen else f"{self.s_q}x{self.s_k}"
        mask = " causal" if self.causal else ""
        return f"{str(self.dtype).removeprefix('torch.')} hkv={self.kv_heads} {shape}{mask}"


@dataclass
class Row:
    """The result of one backend on one case (what goes to the JSON file and the table)."""

    backend: str
    case: str
    status: str = "ok"
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwd_bwd_tflops: float | None = None
    errors: dict[str, float] = field(default_factory=dict)  # max abs error vs fp64
    sdpa_errors: dict[str, float] = field(default_factory=dict)  # SDPA's, same dtype
    ratios: dict[str, float] = field(default_factory=dict)


# --- inputs, reference, baseline --------------------------------------------------------------
@dataclass
class Inputs:
    """Tensors of one case; dense ``[B, S, H, D]`` or varlen ``[T, H, D]`` (+ cu_seqlens)."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    scale: float
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0


def make_inputs(cfg: Config, case: Case) -> Inputs:
    """Random inputs; K/V of a non-square block are the second half of a buffer (views)."""
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    kw = dict(device=cfg.device, dtype=case.dtype, generator=gen)
    H, H_kv, D = cfg.heads, case.kv_heads, cfg.head_dim
    scale = D**-0.5
    if case.varlen:
        T = cfg.cu_seqlens[-1]
        cu = torch.tensor(cfg.cu_seqlens, dtype=torch.int32, device=cfg.device)
        lengths = [b - a for a, b in zip(cfg.cu_seqlens, cfg.cu_seqlens[1:], strict=False)]
        q, dout = torch.randn(T, H, D, **kw), torch.randn(T, H, D, **kw)
        k, v = torch.randn(T, H_kv, D, **kw), torch.randn(T, H_kv, D, **kw)
        return Inputs(q, k, v, dout, scale, cu, max(lengths))
    B = cfg.batch
    q, dout = torch.randn(B, case.s_q, H, D, **kw), torch.randn(B, case.s_q, H, D, **kw)
    kv_buf = torch.randn(2, B, 2 * case.s_k, H_kv, D, **kw)
    k, v = kv_buf[:, :, case.s_k :].unbind(0)
    return Inputs(q, k, v, dout, scale)


def _run(kernel: BlockKernel, x: Inputs, causal: bool, backward: bool) -> dict[str, Tensor]:
    """``kernel``'s ``out, lse`` (and ``dq, dk, dv`` if ``backward``) on ``x``."""
    if x.cu_seqlens is None:
        out, lse = kernel.forward(x.q, x.k, x.v, causal=causal, scale=x.scale)
        res = {"out": out, "lse": lse}
        if backward:
            grads = kernel.backward(x.dout, x.q, x.k, x.v, out, lse, causal=causal, scale=x.scale)
            res |= dict(zip(GRAD_NAMES, grads, strict=True))
        return res
    seq = (x.cu_seqlens, x.cu_seqlens, x.max_seqlen, x.max_seqlen)
    out, lse = kernel.forward_varlen(x.q, x.k, x.v, *seq, causal=causal, scale=x.scale)
    res = {"out": out, "lse": lse}
    if backward:
        grads = kernel.backward_varlen(
            x.dout, x.q, x.k, x.v, out, lse, *seq, causal=causal, scale=x.scale
        )
        res |= dict(zip(GRAD_NAMES, grads, strict=True))
    return res


def reference(x: Inputs, causal: bool, ref_heads: int) -> dict[str, Tensor]:
    """fp64 ``out, lse, dq, dk, dv`` by the math kernel, a group of KV heads at a time (exact:
    each group of query heads only meets its own KV heads)."""
    H, H_kv = x.q.shape[-2], x.k.shape[-2]
    group = H // H_kv
    kv_step = max(1, ref_heads // group)
    parts: dict[str, list[Tensor]] = {}
    for j in range(0, H_kv, kv_step):
        hq, hk = slice(j * group, (j + kv_step) * group), slice(j, j + kv_step)
        chunk = Inputs(
            *(t[..., h, :].double() for t, h in ((x.q, hq), (x.k, hk), (x.v, hk), (x.dout, hq))),
            x.scale,
            x.cu_seqlens,
            x.max_seqlen,
        )
        for name, t in _run(MATH, chunk, causal, backward=True).items():
            parts.setdefault(name, []).append(t)
        del chunk
    return {
        name: torch.cat(ts, dim=ts[0].dim() - 2 if name == "lse" else -2)
        for name, ts in parts.items()
    }


def _sdpa_dense(q, k, v, dout, causal: bool, scale: float) -> dict[str, Tensor]:
    """``out, dq, dk, dv`` of ``F.scaled_dot_product_attention`` on ``[B, S, H, D]`` tensors."""
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(dout.transpose(1, 2))
    results = (out, q.grad, k.grad, v.grad)
    return {n: t.transpose(1, 2) for n, t in zip(CHECKED, results, strict=True)}


def sdpa_baseline(x: Inputs, causal: bool) -> dict[str, Tensor]:
    """SDPA in the inputs' dtype (one document at a time for varlen)."""
    if x.cu_seqlens is None:
        return _sdpa_dense(x.q, x.k, x.v, x.dout, causal, x.scale)
    bounds = x.cu_seqlens.tolist()
    docs = [
        _sdpa_dense(*(t[None, a:b] for t in (x.q, x.k, x.v, x.dout)), causal, x.scale)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return {n: torch.cat([d[n][0] for d in docs]) for n in CHECKED}


def max_abs_error(got: Tensor, want: Tensor) -> float:
    """``max |got - want|`` in fp64."""
    return (got.double() - want).abs().max().item()


# --- timing -----------------------------------------------------------------------------------
def median_ms(fn: Callable[[], object], cfg: Config) -> float:
    """Median wall time of ``fn`` in ms over ``cfg.reps`` runs after ``cfg.warmup`` runs."""
    for _ in range(cfg.warmup):
        fn()
    if cfg.device != "cuda":
        times = []
        for _ in range(cfg.reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    events = []
    for _ in range(cfg.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def forward_flops(cfg: Config, case: Case) -> float:
    """FLOPs of one forward: ``4*B*H*S_q*S_k*D`` per document, half if causal."""
    if case.varlen:
        bounds = cfg.cu_seqlens
        pairs = sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:], strict=False))
    else:
        pairs = cfg.batch * case.s_q * case.s_k
    return 4 * cfg.heads * pairs * cfg.head_dim * (0.5 if case.causal else 1.0)


# --- one case ---------------------------------------------------------------------------------
def check_backend(
    cfg: Config, name: str, case: Case, x: Inputs, ref: dict | None, base: dict | None
) -> Row:
    """Run backend ``name`` on ``case``: errors (if ``ref``), then timings."""
    row = Row(name, case.label())
    kernel = get_kernel(name)
    call = KernelCall(cfg.device, case.dtype, cfg.head_dim, cfg.heads, case.kv_heads, case.varlen)
    reason = kernel.unsupported_reason(call)
    if reason is not None:
        row.status = f"skip: {reason}"
        return row
    try:
        if ref is not None:
            got = _run(kernel, x, case.causal, backward=True)
            row.errors = {n: max_abs_error(got[n], ref[n]) for n in ("lse", *CHECKED)}
            row.sdpa_errors = {n: max_abs_error(base[n], ref[n]) for n in CHECKED}
            row.ratios = {n: row.errors[n] / max(row.sdpa_errors[n], 1e-12) for n in CHECKED}
            tols = {n: RATIO_TOL * row.sdpa_errors[n] + ABS_TOL for n in CHECKED}
            tols["lse"] = LSE_TOL
            bad = [n for n, tol in tols.items() if not row.errors[n] <= tol]  # NaN is bad too
            row.status = "ok" if not bad else "CHECK " + ",".join(bad)
            del got
        else:
            row.status = "timed only"
        flops = forward_flops(cfg, case)
        row.fwd_ms = median_ms(lambda: _run(kernel, x, case.causal, backward=False), cfg)
        row.fwd_bwd_ms = median_ms(lambda: _run(kernel, x, case.causal, backward=True), cfg)
        row.fwd_tflops = flops / row.fwd_ms / 1e9
        row.fwd_bwd_tflops = 3.5 * flops / row.fwd_bwd_ms / 1e9
    except Exception as e:  # record and go on: one broken case must not hide the others
        row.status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        traceback.print_exc()
    return row


def cases(cfg: Config) -> list[Case]:
    """Square blocks (causal and not), the non-square block, then varlen, per dtype and H_kv."""
    out = []
    for dtype in cfg.dtypes:
        for kv in cfg.kv_heads:
            for s in cfg.seqlens:
                out += [Case(dtype, kv, s, s, causal) for causal in (False, True)]
            out.append(Case(dtype, kv, *cfg.nonsquare, causal=False))
            n = cfg.cu_seqlens[-1]
            out += [Case(dtype, kv, n, n, causal, varlen=True) for causal in (False, True)]
    return out


def run_case(cfg: Config, case: Case, backends: list[str]) -> list[Row]:
    """All backends on one case, sharing its inputs, fp64 reference and SDPA baseline."""
    names = [b for b in backends if not case.varlen or b in cfg.varlen_backends]
    if not names:
        return []
    try:
        x = make_inputs(cfg, case)
        ref = base = None
        if max(case.s_q, case.s_k) <= cfg.ref_max_seqlen:
            ref = reference(x, case.causal, cfg.ref_heads)
            base = sdpa_baseline(x, case.causal)
    except Exception as e:
        traceback.print_exc()
        error = f"error (reference): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return [Row(name, case.label(), status=error) for name in names]
    rows = [check_backend(cfg, name, case, x, ref, base) for name in names]
    del x, ref, base
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
    return rows


# --- report -----------------------------------------------------------------------------------
def op_layouts() -> dict[str, str]:
    """Shapes and strides of the lse the raw aten ops return (what the adapters convert)."""
    found = {}
    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16)  # [B, S, H, D]
    kv = q[:, :, :2]  # GQA: 2 KV heads
    probes = {
        "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2),
            kv.transpose(1, 2),
            kv.transpose(1, 2),
            None,
            True,
            0.0,
            True,
            False,
            scale=0.125,
        )[1],
        "cuda_flash_varlen": lambda: torch.ops.aten._flash_attention_forward(
            q[0],
            kv[0],
            kv[0],
            *[torch.tensor([0, 20, 64], device="cuda", dtype=torch.int32)] * 2,
            44,
            44,
            0.0,
            True,
            False,
            scale=0.125,
        )[1],
    }
    for name, probe in probes.items():
        try:
            lse = probe()
            found[name] = f"lse {tuple(lse.shape)} strides {lse.stride()} {lse.dtype}"
        except Exception as e:
            found[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return found


def environment(cfg: Config) -> dict[str, object]:
    """Versions, device and raw op layouts, for the JSON file."""
    env: dict[str, object] = {"torch": torch.__version__, "device": cfg.device}
    if cfg.device == "cuda":
        env |= {
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name(),
            "capability": torch.cuda.get_device_capability(),
            "op_layouts": op_layouts(),
        }
    return env


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec`` (which starts with the width), or a right-aligned dash."""
    if x is None:
        return "-".rjust(int(spec.split(".")[0]))
    return format(x, spec)


def table(rows: list[Row]) -> str:
    """The human-readable summary: one line per backend and case."""
    head = (
        f"{'backend':<11} {'case':<34} {'fwd TF/s':>8} {'f+b TF/s':>8} "
        f"{'out':>5} {'dq':>5} {'dk':>5} {'dv':>5} {'lse err':>8}  status"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratios = " ".join(_fmt(r.ratios.get(n), "5.2f") for n in CHECKED)
        lines.append(
            f"{r.backend:<11} {r.case:<34} {_fmt(r.fwd_tflops, '8.1f')} "
            f"{_fmt(r.fwd_bwd_tflops, '8.1f')} {ratios} {_fmt(r.errors.get('lse'), '8.1e')}  "
            f"{r.status}"
        )
    lines.append(
        "out/dq/dk/dv: max abs error vs fp64 divided by SDPA's in the same dtype "
        f"(ok: <= {RATIO_TOL} x SDPA + {ABS_TOL}); lse err: max abs (ok: <= {LSE_TOL})."
    )
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, run every case, write ``$OUT/kernels.json``, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every code path")
    parser.add_argument("--backends", nargs="*", help="only these backends (default: all)")
    args = parser.parse_args()
    cfg = SMOKE if args.smoke else GPU
    if cfg.device == "cuda" and not torch.cuda.is_available():
        sys.exit("CUDA is not available: run on a GPU machine, or pass --smoke for a CPU run.")

    rows: list[Row] = []
    backends = []
    for name in args.backends or cfg.backends:
        try:
            reason = get_kernel(name).is_available()
        except Exception as e:
            reason = f"is_available() raised {type(e).__name__}: {e}"
        if reason is None:
            backends.append(name)
        else:
            rows.append(Row(name, "(all)", status=f"unavailable: {reason}"))
    start = time.perf_counter()
    for case in cases(cfg):
        rows += run_case(cfg, case, backends)
        print(f"[{time.perf_counter() - start:6.1f}s] {case.label()}", flush=True)

    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "kernels.json")
    result = {
        "environment": environment(cfg),
        "config": _jsonable(asdict(cfg)),
        "rows": [asdict(r) for r in rows],
        "seconds": time.perf_counter() - start,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    print(json.dumps(result["environment"], indent=1), "\n")
    print(table(rows))


def _jsonable(d: dict[str, object]) -> dict[str, object]:
    """``d`` with its dtypes as strings."""
    return {k: [str(x) for x in v] if k == "dtypes" else v for k, v in d.items()}


if __name__ == "__main__":
    main()
