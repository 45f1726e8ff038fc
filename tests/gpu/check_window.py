"""GPU check of the sliding-window block kernels against fp64 (dense and varlen).

The engine sends windowed blocks trimmed so that no row or column is fully masked, often
non-square and with one side of the window open (Note [Windowed schedules]). For every
window-capable CUDA backend this runs such blocks (bf16, ``H=32, H_kv=8, D=128``) and a
windowed varlen call, and compares ``out, lse, dq, dk, dv`` with the math kernel in fp64 under
the same mask. Baseline: the same comparison for ``F.scaled_dot_product_attention`` with the
mask as a boolean ``attn_mask`` in bf16 (what a user without windowed kernels would run); the
reported ratio is our error / SDPA's error (lse: our error alone).

    python tests/gpu/check_window.py             # one GPU, seconds; JSON to $OUT/window.json
    python tests/gpu/check_window.py --smoke     # CPU, tiny (cpu_flash dense, math varlen)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dtensor_ring.kernels import BACKENDS, KernelCall  # noqa: E402
from dtensor_ring.kernels.base import window_mask  # noqa: E402
from dtensor_ring.kernels.math import MathKernel, _varlen_mask  # noqa: E402

MATH = MathKernel()
NAMES = ("out", "dq", "dk", "dv")
# (S_q, S_k, window): shapes and bands like those the windowed plans produce (trimmed: no row
# or column fully masked, both sides < S_k: flash kernels take a side >= S_k as unbounded)
DENSE = [
    (4096, 4096, (512, 0)),
    (2048, 2048, (0, -1)),
    (3000, 2000, (40, 1000)),
    (1536, 4096, (-1, 7)),
    (4096, 3500, (600, 2000)),
]


def _inputs(s_q, s_k, a, gen):
    q = torch.randn(1, s_q, a.heads, a.head_dim, generator=gen, device=a.device, dtype=a.dtype)
    k, v = (
        torch.randn(1, s_k, a.kv_heads, a.head_dim, generator=gen, device=a.device, dtype=a.dtype)
        for _ in "kv"
    )
    return q, k, v, torch.randn_like(q)


def _grads(kernel, q, k, v, dout, scale, **kw):
    out, lse = kernel.forward(q, k, v, causal=False, scale=scale, **kw)
    return [out, *kernel.backward(dout, q, k, v, out, lse, causal=False, scale=scale, **kw)], lse


def _sdpa(q, k, v, dout, scale, mask):
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    return [out.transpose(1, 2), *(t.grad.transpose(1, 2) for t in leaves)]


def _errors(got, want):
    return [(g.double() - w).abs().max().item() for g, w in zip(got, want, strict=True)]


def check_dense(backend, a, gen) -> list[dict]:
    rows = []
    for s_q, s_k, window in DENSE:
        q, k, v, dout = _inputs(s_q, s_k, a, gen)
        scale = a.head_dim**-0.5
        want, lse_ref = _grads(MATH, *(t.double() for t in (q, k, v, dout)), scale, window=window)
        got, lse = _grads(backend, q, k, v, dout, scale, window=window)
        base = _sdpa(q, k, v, dout, scale, window_mask(s_q, s_k, window, q.device))
        err, base_err = _errors(got, want), _errors(base, want)
        rows.append(
            dict(
                backend=backend.name,
                case=f"{s_q}x{s_k} w{window}",
                lse_err=(lse.double() - lse_ref).abs().max().item(),
                **{n: e for n, e in zip(NAMES, err, strict=True)},
                ratio=max(e / max(b, 1e-30) for e, b in zip(err, base_err, strict=True)),
            )
        )
    return rows


def check_varlen(backend, a, gen) -> list[dict]:
    bounds = [0, 256, 3000, 4096] if not a.smoke else [0, 5, 17, 24]
    cu = torch.tensor(bounds, dtype=torch.int32, device=a.device)
    T, n_max = bounds[-1], max(b - c for c, b in zip(bounds[:-1], bounds[1:], strict=True))
    q, k, v, dout = (t[0] for t in _inputs(T, T, a, gen))
    scale, window = a.head_dim**-0.5, (200, 0) if not a.smoke else (3, 0)

    def run(kernel, q, k, v, dout):
        out, lse = kernel.forward_varlen(
            q, k, v, cu, cu, n_max, n_max, causal=False, scale=scale, window=window
        )
        grads = kernel.backward_varlen(
            dout, q, k, v, out, lse, cu, cu, n_max, n_max, causal=False, scale=scale, window=window
        )
        return [out, *grads], lse

    want, lse_ref = run(MATH, *(t.double() for t in (q, k, v, dout)))
    got, lse = run(backend, q, k, v, dout)
    mask = _varlen_mask(cu, cu, T, T, False, window)
    base = [t[0] for t in _sdpa(q[None], k[None], v[None], dout[None], scale, mask)]
    err, base_err = _errors(got, want), _errors(base, want)
    return [
        dict(
            backend=backend.name,
            case=f"varlen {bounds} w{window}",
            lse_err=(lse.double() - lse_ref).abs().max().item(),
            **{n: e for n, e in zip(NAMES, err, strict=True)},
            ratio=max(e / max(b, 1e-30) for e, b in zip(err, base_err, strict=True)),
        )
    ]


def check_rings(a, gen) -> list[dict]:
    """Whole windowed rings against fp64: dense and varlen (ring, zigzag) simulated at W = 4,
    and llama3 (causal and not) through its op on a one-rank process group."""
    import torch.distributed as dist

    import dtensor_ring as dr
    from dtensor_ring.simulate import simulate_ring

    W, scale, rows = 4, a.head_dim**-0.5, []
    unit = 2 * W * (64 if not a.smoke else 1)
    bounds = [0, 3 * unit, 4 * unit, 9 * unit]
    T = bounds[-1]
    cu = torch.tensor(bounds, dtype=torch.int32, device=a.device)
    q, k, v, dout = (t[0] for t in _inputs(T, T, a, gen))
    n_max = max(b - c for c, b in zip(bounds[:-1], bounds[1:], strict=True))

    def reference(causal, window):
        x = [t.double().requires_grad_() for t in (q, k, v)]
        win = (window[0], 0) if causal else window
        out, _ = MATH.forward_varlen(
            *x, cu, cu, n_max, n_max, causal=False, scale=scale, window=win
        )
        return [out, *torch.autograd.grad(out, x, dout.double())]

    for layout, causal, window in (
        ("ring", True, (100, 0)),
        ("ring", False, (70, 30)),
        ("zigzag", True, (300, 0)),
    ):
        got = simulate_ring(
            q,
            k,
            v,
            dout,
            layout=layout,
            world_size=W,
            causal=causal,
            cu_seqlens=bounds,
            window_size=window,
        )
        err = _errors([got[0], *got[2:]], reference(causal, window))
        rows.append(
            dict(
                backend="simulated",
                case=f"{layout} varlen W={W} w{window}",
                lse_err=float("nan"),
                **dict(zip(NAMES, err, strict=True)),
                ratio=float("nan"),
            )
        )
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if a.device.type == "cuda" else "gloo", rank=0, world_size=1)
    for causal, window in ((True, (100, 0)), (False, (70, 30))):
        cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal, 0, 1
        )
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dr.llama3_flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal, window_size=window
        )
        out.backward(dout)
        err = _errors([out, *(t.grad for t in leaves)], reference(causal, window))
        rows.append(
            dict(
                backend="llama3 op",
                case=f"W=1 causal={causal} w{window}",
                lse_err=float("nan"),
                **dict(zip(NAMES, err, strict=True)),
                ratio=float("nan"),
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args()
    a.device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    a.dtype = torch.bfloat16 if a.device.type == "cuda" else torch.float32
    a.heads, a.kv_heads, a.head_dim = (32, 8, 128) if not a.smoke else (4, 2, 16)
    if a.smoke:
        DENSE[:] = [(12, 12, (3, 0)), (8, 12, (-1, 2)), (12, 8, (9, 6))]
    gen = torch.Generator(device=a.device).manual_seed(0)
    probe = torch.empty(1, 1, a.heads, a.head_dim, dtype=a.dtype, device=a.device)
    probe_kv = probe[:, :, : a.kv_heads]
    rows, errors = [], []
    for backend in BACKENDS:
        if backend.name == "math":
            continue
        for varlen, check in ((False, check_dense), (True, check_varlen)):
            call = KernelCall.of(probe, probe_kv, varlen=varlen, window=True)
            if backend.unsupported_reason(call) is None:
                try:
                    rows += check(backend, a, gen)
                except Exception as e:  # record and go on with the other backends
                    errors.append(f"{backend.name} varlen={varlen}: {type(e).__name__}: {e}")
    try:
        rows += check_rings(a, gen)
    except Exception as e:  # record it with the rest
        errors.append(f"rings: {type(e).__name__}: {e}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "window.json"), "w") as f:
        json.dump(
            dict(
                torch=torch.__version__,
                device=str(a.device) if a.smoke else torch.cuda.get_device_name(),
                rows=rows,
                errors=errors,
            ),
            f,
            indent=1,
        )
    print(
        f"{'backend':<11}{'case':<34}{'lse err':>9}"
        + "".join(f"{n:>9}" for n in NAMES)
        + f"{'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['backend']:<11}{r['case']:<34}{r['lse_err']:>9.1e}"
            + "".join(f"{r[n]:>9.1e}" for n in NAMES)
            + f"{r['ratio']:>7.2f}"
        )
    if errors or not rows:
        raise SystemExit("\n".join(errors) or "no window-capable backend")


if __name__ == "__main__":
    main()
