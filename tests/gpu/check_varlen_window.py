"""GPU check of sliding windows in varlen calls, the placed document layouts' above all.

Not a test (CI has no GPU): ``python tests/gpu/check_varlen_window.py``. The H100 run of
``check_flex.py`` (2026-12-05) found packed documents with a window of 256 on a placed layout
(``dr.documents_as_sharded``) 35x less exact than one-GPU attention on PyTorch's flash varlen
kernel, while the CPU route is exact; this script found where (Note [FlashAttention-2's
unbounded window sides] in ``dtensor_ring/kernels/cuda_flash.py``, docs/window.md) and checks
the fix:

1. end to end: every rank of a W = 4 ring in turn (``dr.simulate_ring``), bf16, 5, 32 and
   512 (of 8 tokens: single-token zigzag pieces) packed documents of 4096 tokens,
   ``H = 8, H_kv = 2, D = 64``; placed ring / zigzag and the per-document layout zigzag,
   window ``(255, 0)`` and plain causal; the max error of
   ``out, dq, dk, dv`` against fp64 (``tests/reference``) as a ratio to one-GPU varlen
   attention on the whole sequence (the same kernel) in the same dtype;
2. per kernel call: every varlen call the engine makes on the GPU kernel is repeated on the
   math kernel in fp64 with the same inputs (the backward with the same ``out`` / ``lse``),
   and the calls whose error is far above bf16's are printed with their ``cu_seqlens``,
   ``max_seqlen`` and mask;
3. the engine's CUDA-only parts: the same rows with the math kernel (``backend="math"``),
   with merges and indexed gradient adds in eager torch ops instead of the Triton kernels
   (and those kernels against the eager ops on random rows: bitwise), with merges on the compute
   stream instead of the side stream; and the kernel given ``max_seqlen_k`` as it is
   ("unpatched": before Note [FlashAttention-2's unbounded window sides] in
   ``dtensor_ring/kernels/cuda_flash.py``); flash-attn 4 where it is installed;
4. dense kernel calls of the shapes llama3's prefix block sends (``DENSE_CALLS``), with and
   without the adapter's varlen detour for them.

``VARIANTS=kernel,flash_attn4`` (env) runs only those. Results go to
``$OUT/check_varlen_window.json`` (or the current dir).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from reference import reference_attention_varlen  # noqa: E402

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.engine import ring as engine_ring  # noqa: E402
from dtensor_ring.kernels import KernelCall, cuda_flash, select_kernel  # noqa: E402
from dtensor_ring.kernels import merge as kernel_merge  # noqa: E402
from dtensor_ring.kernels.flash_attn4 import FlashAttn4Kernel  # noqa: E402
from dtensor_ring.kernels.math import MathKernel  # noqa: E402

H, H_KV, D, S, W = 8, 2, 64, int(os.environ.get("SEQ", 4096)), 4
DEV = torch.device(os.environ.get("DEVICE", "cuda"))
MATH = MathKernel()
FA4 = FlashAttn4Kernel()
# the math kernel's own methods (the recorder may wrap the class itself on a CPU dry run)
MATH_FWD, MATH_BWD = MathKernel._forward_varlen, MathKernel._backward_varlen


def bounds_of(n: int) -> list[int]:
    """Boundaries of ``n`` random documents of ``S`` tokens (lengths multiples of 2W); all of
    length 2W for ``n = S // 2W`` (zigzag's pieces are single tokens: varlen calls with
    ``max_seqlen_q = 1``, which FlashAttention-2 runs on another path with GQA)."""
    if n == S // (2 * W):
        return list(range(0, S + 1, 2 * W))
    gen = torch.Generator().manual_seed(n)
    cuts = torch.sort(torch.randperm(S // (2 * W) - 1, generator=gen)[: n - 1] + 1).values
    return [0, *(2 * W * cuts).tolist(), S]  # lengths a multiple of 2W, as zigzag needs


def device_name() -> str:
    return torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


class Recorder:
    """Wraps a kernel class's varlen methods: every call is checked against fp64 math."""

    def __init__(self, cls):
        self.cls, self.calls = cls, []
        self.fwd, self.bwd = cls._forward_varlen, cls._backward_varlen
        rec = self

        def fwd(kernel, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window):
            out, lse = rec.fwd(
                kernel, q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window
            )
            out64, lse64 = MATH_FWD(
                MATH, *(t.double() for t in (q, k, v)), cu_q, cu_k, max_q, max_k,
                causal=causal, scale=scale, window=window,
            )  # fmt: skip
            finite = torch.isfinite(lse64)
            rec.note("fwd", cu_q, cu_k, max_q, max_k, causal, window, {
                "out": max_err(out, out64),
                "lse": max_err(lse[finite], lse64[finite]),
                "inf_mismatch": int((lse[~finite] != lse64[~finite]).sum()),
                "empty_rows": int((~finite).sum()),
            })  # fmt: skip
            return out, lse

        def bwd(kernel, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale, window):
            grads = rec.bwd(
                kernel, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                causal=causal, scale=scale, window=window,
            )  # fmt: skip
            grads64 = MATH_BWD(
                MATH, *(t.double() for t in (do, q, k, v, out, lse)), cu_q, cu_k, max_q, max_k,
                causal=causal, scale=scale, window=window,
            )  # fmt: skip
            errs = {
                n: max_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, grads64, strict=True)
            }
            rec.note("bwd", cu_q, cu_k, max_q, max_k, causal, window, errs)
            return grads

        cls._forward_varlen, cls._backward_varlen = fwd, bwd

    def note(self, kind, cu_q, cu_k, max_q, max_k, causal, window, errs):
        self.calls.append({
            "kind": kind, "lengths_q": cu_q.diff().tolist(), "lengths_k": cu_k.diff().tolist(),
            "max_q": max_q, "max_k": max_k, "causal": causal, "window": window, "errors": errs,
        })  # fmt: skip

    def restore(self):
        self.cls._forward_varlen, self.cls._backward_varlen = self.fwd, self.bwd


@contextlib.contextmanager
def variant(name: str):
    """The engine as it is ("kernel"), or with one CUDA-only part replaced."""
    saved = kernel_merge._triton, engine_ring._side_stream, cuda_flash.flash2_max_seqlen_k
    if name == "eager":
        kernel_merge._triton = lambda: None
    if name == "one-stream":
        engine_ring._side_stream = lambda device: torch.cuda.current_stream(device)
    if name == "unpatched":
        cuda_flash.flash2_max_seqlen_k = lambda max_q, max_k, window: max_k
    try:
        yield
    finally:
        kernel_merge._triton, engine_ring._side_stream, cuda_flash.flash2_max_seqlen_k = saved


VARIANTS = os.environ.get("VARIANTS", "kernel,math,eager,one-stream,unpatched,flash_attn4").split(
    ","
)
BACKENDS = {"math": "math", "flash_attn4": "flash_attn4"}  # the others: the library's choice


def one_gpu(kernel, q, k, v, dout, cu, window, causal):
    """Varlen attention on the whole sequence, one kernel call (the baseline)."""
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    m = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    scale = D**-0.5
    win = None if window in ((-1, -1), (-1, 0)) else window
    out, lse = kernel.forward_varlen(
        q, k, v, cu_t, cu_t, m, m, causal=causal, scale=scale, window=win
    )
    grads = kernel.backward_varlen(
        dout, q, k, v, out, lse, cu_t, cu_t, m, m, causal=causal, scale=scale, window=win
    )
    return [out, *grads]


# Dense blocks of the shapes llama3's prefix block sends (more queries than keys + 1, a side
# unbounded or >= S_k) and one FlashAttention-2 takes as it is: (S_q, S_k, window).
DENSE_CALLS = [
    (1100, 200, (0, -1)),
    (800, 500, (300, -1)),
    (600, 300, (-1, 400)),
    (512, 512, (100, 0)),
]


def dense_calls(kernels: list) -> list[dict]:
    """Each dense block of ``DENSE_CALLS`` on each kernel, forward and backward, against fp64
    math; "as it is": without the adapters' varlen detour (``flash2_dense_needs_varlen``)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for (s_q, s_k, window), kernel in [(c, k) for c in DENSE_CALLS for k in kernels]:
        q, dout = (torch.randn(1, s_q, H, D, generator=gen).to(DEV, torch.bfloat16) for _ in "ab")
        k, v = (torch.randn(1, s_k, H_KV, D, generator=gen).to(DEV, torch.bfloat16) for _ in "ab")
        kw = dict(causal=False, scale=D**-0.5, window=window)
        out64, lse64 = MATH.forward(q.double(), k.double(), v.double(), **kw)
        want = MATH.backward(*(t.double() for t in (dout, q, k, v, out64, lse64)), **kw)
        saved = cuda_flash.flash2_dense_needs_varlen
        for how in ("adapter", "as it is") if kernel.name == "cuda_flash" else ("adapter",):
            if how == "as it is":
                cuda_flash.flash2_dense_needs_varlen = lambda s_q, s_k, window: False
            try:
                out, lse = kernel.forward(q, k, v, **kw)
                grads = kernel.backward(dout, q, k, v, out64.to(q.dtype), lse64.float(), **kw)
            finally:
                cuda_flash.flash2_dense_needs_varlen = saved
            errs = [max_err(a, b) for a, b in zip((out, *grads), (out64, *want), strict=True)]
            row = {"s_q": s_q, "s_k": s_k, "window": window, "kernel": kernel.name, "how": how,
                   "errors": errs, "lse_error": max_err(lse, lse64)}  # fmt: skip
            rows.append(row)
            print(f"dense {s_q}x{s_k} {window!s:<10} {kernel.name:<12} {how:<9} out/dq/dk/dv "
                  + " ".join(f"{e:.2e}" for e in errs), flush=True)  # fmt: skip
    return rows


def fused_against_eager() -> dict[str, bool]:
    """The Triton kernels against the eager ops on the same inputs, bitwise: the indexed add
    (``add_rows_``; an fp32 accumulator, bf16 rows, distinct rows in a shuffled order: one fp32
    add per element either way) and the final output (``finish_rows``: the cast and the fill
    of rows with lse = -inf, NaN and 0, from fp32 and in place)."""
    gen = torch.Generator().manual_seed(1)
    acc = torch.randn(S, H, D, generator=gen).to(DEV)
    rows = torch.randperm(S, generator=gen)[: S // 3].to(DEV)
    x = torch.randn(S // 3, H, D, generator=gen).to(DEV, torch.bfloat16)
    fused, eager = acc.clone(), acc.clone()
    kernel_merge.add_rows_(fused, rows, x)
    with variant("eager"):
        kernel_merge.add_rows_(eager, rows, x)
    result = {"add_rows": torch.equal(fused, eager) and not torch.equal(fused, acc)}
    lse = torch.randn(H, S, generator=gen).to(DEV)
    lse[:, rows[:50]] = float("-inf")  # empty rows, some heads of them finite again below
    lse[: H // 2, rows[:10]] = 0.0
    for empty in (float("nan"), 0.0):  # the cast of an accumulator, and in place
        for src in (acc, acc.to(torch.bfloat16)):
            got = kernel_merge.finish_rows(src.clone(), lse, torch.bfloat16, empty)
            with variant("eager"):
                want = kernel_merge.finish_rows(src.clone(), lse, torch.bfloat16, empty)
            same = torch.equal(got.isnan(), want.isnan()) and torch.equal(
                got.nan_to_num(), want.nan_to_num()
            )
            result[f"finish_rows {src.dtype} empty={empty}"] = same
    return result


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(S, H, D, generator=gen).to(DEV) for _ in range(2))
    k, v = (torch.randn(S, H_KV, D, generator=gen).to(DEV) for _ in range(2))
    x = q.to(torch.bfloat16)
    kernel = select_kernel(KernelCall.of(x[None], x[None, :, :H_KV], varlen=True, window=True))
    print(f"{device_name()} torch {torch.__version__} kernel {kernel.name}")
    rows, bad_calls = [], []
    dense = dense_calls([kernel] + ([FA4] if FA4.is_available() is None else []))
    for n_docs in (5, 32, S // (2 * W)):
        cu = bounds_of(n_docs)
        for window in ((255, 0), (-1, 0)):
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            cu_t = torch.tensor(cu, device=DEV)
            ref_out, _ = reference_attention_varlen(*leaves, cu_t, causal=True, window_size=window)
            ref_out.backward(dout.double())
            ref = [ref_out.detach(), *(t.grad for t in leaves)]
            del ref_out, leaves
            low = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
            base = [
                max_err(a, b)
                for a, b in zip(one_gpu(kernel, *low, cu, window, True), ref, strict=True)
            ]
            for layout_name, name in [
                (lay, name)
                for lay in ("placed-ring", "placed-zigzag", "zigzag")
                for name in VARIANTS
                if name != "flash_attn4" or FA4.is_available() is None
            ]:
                if layout_name.startswith("placed-"):
                    layout = dr.documents_as_sharded(
                        cu, layout_name[7:], W, causal=True, window_size=window
                    )
                else:
                    layout = layout_name
                rec = Recorder(FlashAttn4Kernel if name == "flash_attn4" else type(kernel))
                t0 = time.time()
                try:
                    with variant(name):
                        got = dr.simulate_ring(
                            *low, layout=layout, world_size=W, causal=True, cu_seqlens=cu,
                            window_size=window, backend=BACKENDS.get(name),
                        )  # fmt: skip
                finally:
                    rec.restore()
                got = [got[0], *got[2:]]
                errs = [max_err(a, b) for a, b in zip(got, ref, strict=True)]
                row = {
                    "docs": n_docs, "window": window, "layout": layout_name, "variant": name,
                    "errors": errs,
                    "one_gpu_errors": base,
                    "ratios": [e / max(b, 1e-30) for e, b in zip(errs, base, strict=True)],
                    "calls": len(rec.calls), "seconds": round(time.time() - t0, 1),
                }  # fmt: skip
                rows.append(row)
                ratios = " ".join(f"{r:.2f}" for r in row["ratios"])
                print(
                    f"docs={n_docs:<3} window={window!s:<10} {layout_name:<14} {name:<12} {ratios}",
                    flush=True,
                )
                worst = max(base)
                for call in rec.calls:
                    e = call["errors"]
                    if max(v for n, v in e.items() if n != "empty_rows") > 4 * worst:
                        bad_calls.append(
                            {"row": layout_name, "variant": name, "docs": n_docs, **call}
                        )
                        print("   BAD", call, flush=True)
    fused = fused_against_eager()
    print("fused kernels bitwise the eager ops:", fused, flush=True)
    out_dir = os.environ.get("OUT", ".")
    meta = {"gpu": device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "kernel": kernel.name,
            "shape": {"H": H, "H_kv": H_KV, "D": D, "S": S, "W": W}}  # fmt: skip
    with open(os.path.join(out_dir, "check_varlen_window.json"), "w") as f:
        json.dump(
            {"meta": meta, "rows": rows, "bad_calls": bad_calls, "dense": dense, "fused": fused},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
