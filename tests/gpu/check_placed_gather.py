"""GPU check of placed documents' all-gather (Note [Gathering what placed documents need]).

Not a test (CI has no GPU; ``--smoke`` runs it on the CPU, tiny):

    python tests/gpu/check_placed_gather.py          # one GPU, about a minute (JSON to $OUT)
    python tests/gpu/check_placed_gather.py --smoke  # CPU, fp32, tiny

Packed documents of random lengths (``S`` tokens, bf16, ``H = 8, H_kv = 2, D = 128``) placed
by ``dr.document_layout`` on W = 4 and 8 simulated ranks, causal and causal with a window;
every rank of the all-gather run in turn (``dr.simulate_gather``, the real engine and
kernels) and, for comparison, the ring on the same layout (``dr.simulate_ring``). Each row:
the max error of ``out, dq, dk, dv`` against fp64 attention document by document (the math
kernel), and its ratio to the same error of the same varlen kernel run once on the whole
stream on one device (ratio ~1: as exact as the one-device kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import KernelCall, get_kernel, select_kernel  # noqa: E402
from dtensor_ring.kernels.math import MathKernel  # noqa: E402

MATH = MathKernel()
NAMES = ("out", "dq", "dk", "dv")


def _documents(total: int, n: int, unit: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total // unit - 1, generator=gen)[: n - 1] + 1
    return [0, *(torch.sort(cuts).values * unit).tolist(), total]


def _one_device(kernel, q, k, v, dout, bounds, window, scale):
    """``[out, dq, dk, dv]`` of ``kernel`` on the whole stream (causal within documents, a
    left window: ``window`` flash-attn's ``(left, 0)``)."""
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    n = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    kw = dict(causal=window is None, scale=scale, window=window)
    out, lse = kernel.forward_varlen(q, k, v, cu, cu, n, n, **kw)
    return [out, *kernel.backward_varlen(dout, q, k, v, out, lse, cu, cu, n, n, **kw)]


def _reference(q, k, v, dout, bounds, window, scale):
    """fp64 ``[out, dq, dk, dv]``, document by document (the math kernel, autograd)."""
    parts = [[] for _ in NAMES]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        x = [t[a:b].double().requires_grad_() for t in (q, k, v)]
        got = _one_device(MATH, *x, dout[a:b].double(), [0, b - a], window, scale)
        for i, t in enumerate(got):
            parts[i].append(t.detach())
    return [torch.cat(p) for p in parts]


def _errors(got, want) -> list[float]:
    return [(g.double() - w).abs().max().item() for g, w in zip(got, want, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    S, unit, H, H_kv, D = (8192, 256, 8, 2, 128) if not a.smoke else (96, 4, 4, 2, 16)
    worlds = (4, 8) if not a.smoke else (3,)
    windows = (None, (512, 0)) if not a.smoke else (None, (5, 0))
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(S, H, D, generator=gen, device=device, dtype=dtype) for _ in "qd")
    k, v = (torch.randn(S, H_kv, D, generator=gen, device=device, dtype=dtype) for _ in "kv")
    scale = D**-0.5
    call = KernelCall.of(q[None], k[None], varlen=True, window=True)
    kernels = [select_kernel(call).name]
    if device.type == "cuda":
        kernels = [
            name
            for name in ("flash_attn4", "cuda_flash")
            if get_kernel(name).unsupported_reason(call) is None
        ]
    rows, errors = [], []
    for n_docs in (5, 12):
        bounds = _documents(S, n_docs, unit, n_docs)
        for window in windows:
            want = _reference(q, k, v, dout, bounds, window, scale)
            window_size = window or (-1, -1)
            for name in kernels:
                base = _errors(
                    _one_device(get_kernel(name), q, k, v, dout, bounds, window, scale), want
                )
                for W in worlds:
                    lay = dr.document_layout(bounds, W, window_size=window_size)
                    kw = dict(layout=lay, world_size=W, cu_seqlens=bounds, backend=name)
                    kw |= dict(causal=True, window_size=window_size, scale=scale)
                    for algorithm, simulate in (
                        ("all_gather", dr.simulate_gather),
                        ("ring", dr.simulate_ring),
                    ):
                        try:
                            got = simulate(q, k, v, dout, **kw)
                        except Exception as e:  # record it with the rest
                            errors.append(f"{name} W={W} {algorithm}: {type(e).__name__}: {e}")
                            continue
                        err = _errors([got[0], *got[2:]], want)
                        rows.append(
                            dict(
                                kernel=name, world_size=W, documents=n_docs, window=window,
                                algorithm=algorithm, cut=len(lay.split),
                                **dict(zip(NAMES, err, strict=True)),
                                ratio=[e / max(b, 1e-30) for e, b in zip(err, base, strict=True)],
                            )
                        )  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    meta = dict(
        torch=torch.__version__, device=str(device) if a.smoke else torch.cuda.get_device_name()
    )
    with open(os.path.join(a.out, "placed_gather.json"), "w") as f:
        json.dump(dict(**meta, S=S, heads=(H, H_kv, D), rows=rows, errors=errors), f, indent=1)
    print(
        f"{'kernel':<12}{'W':>3}{'docs':>5}{'window':>12}{'algorithm':>12}{'cut':>4}"
        + "".join(f"{n:>9}" for n in NAMES)
        + "  ratios"
    )
    for r in rows:
        print(
            f"{r['kernel']:<12}{r['world_size']:>3}{r['documents']:>5}{str(r['window']):>12}"
            f"{r['algorithm']:>12}{r['cut']:>4}"
            + "".join(f"{r[n]:>9.2e}" for n in NAMES)
            + "  "
            + " ".join(f"{x:.2f}" for x in r["ratio"])
        )
    for e in errors:
        print("ERROR", e)


if __name__ == "__main__":
    main()
