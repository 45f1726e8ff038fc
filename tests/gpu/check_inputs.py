"""GPU check of Note [Kernel inputs] and of the fused merge's non-finite semantics.

* every CUDA dense backend on strided views (every second element of the head dim,
  ``channels_last``, a ``[B, H, S, D]`` buffer), a stride-0 ``dout``, a ``dout`` laid out
  unlike ``out`` (``dout_transposed``: contiguous q/k/v) and scales 0 / negative,
  forward + backward in bf16 against an fp64 reference: max error <= 3x the error of the same
  backend on contiguous inputs with the positive scale, + 1e-3 (a wrong stride gives garbage);
* the Triton merge (``kernels/_triton_merge.py``) against the eager merge on fp32 rows with
  Inf outputs and -inf / +inf / NaN lse: the same NaN/Inf positions, finite values within
  1e-6;
* the Triton reorder of varlen accumulators into rows (``untile_rows``, Note [A varlen dq
  accumulated inside flash-attn 4]) against its eager path on the CPU, fp32 and bf16, head
  dims rounded up or not, one and two accumulators: equal;
* a block's dK/dV added from flash-attn 4's tiles (``TiledGrads.add_to``, Note [Block dK/dV
  added from flash-attn 4's tiles]) by its Triton launch against its CPU path (reorder, then
  add): dense into rows of longer accumulators (B = 2), varlen into a run of rows and into the
  rows of an index; within 1e-6 (the launch may fuse the multiply and the add).

    python tests/gpu/check_inputs.py     # one GPU, seconds; JSON to $OUT/check_inputs.json
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dtensor_ring.kernels import KernelCall, get_kernel  # noqa: E402
from dtensor_ring.kernels.merge import merge_eager_  # noqa: E402
from tests.reference import reference_attention  # noqa: E402

B, S, H, H_KV, D = 2, 512, 8, 2, 128


def _view(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "stride_d":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if how == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


def _errors(kernel, q, k, v, do, scale, causal, how):
    if how in ("expanded", "ones"):  # all-ones dout, stride 0 or contiguous (its baseline)
        dout = torch.ones_like(do[:1, :1, :1, :1]).expand_as(do)
        dout = dout.contiguous() if how == "ones" else dout
    else:
        dout = do
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves, causal=causal, scale=scale)
    want = [ref.detach(), *torch.autograd.grad(ref, leaves, dout.double())]
    views = [_view(x, "contiguous" if how == "dout_transposed" else how) for x in (q, k, v)]
    out, lse = kernel.forward(*views, causal=causal, scale=scale)
    dout = _view(dout, "transposed" if how == "dout_transposed" else how)
    grads = kernel.backward(dout, *views, out, lse, causal=causal, scale=scale)
    return [float((g.double() - w).abs().max()) for g, w in zip((out, *grads), want, strict=True)]


def check_kernels() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in ("cudnn", "cuda_flash", "flash_attn4"):
        kernel = get_kernel(name)
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (
            torch.randn(B, S, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2)
        )
        do = torch.randn_like(q)
        reason = kernel.unsupported_reason(KernelCall.of(q, k))
        if reason is not None:
            rows.append({"backend": name, "skipped": reason})
            continue
        for causal in (False, True):
            contiguous = _errors(kernel, q, k, v, do, D**-0.5, causal, "contiguous")
            views = ("stride_d", "channels_last", "transposed", "dout_transposed")
            cases = [(how, D**-0.5) for how in views]
            cases += [("expanded", D**-0.5), ("contiguous", 0.0), ("contiguous", -(D**-0.5))]
            ones = _errors(kernel, q, k, v, do, D**-0.5, causal, "ones")
            for how, scale in cases:
                try:
                    errs = _errors(kernel, q, k, v, do, scale, causal, how)
                    base = ones if how == "expanded" else contiguous
                    ok = all(e <= 3 * b + 1e-3 for e, b in zip(errs, base, strict=True))
                    row = dict(errors=errs, baseline=base, ok=ok)
                except Exception as e:  # record and go on
                    row = dict(error=f"{type(e).__name__}: {e}", ok=False)
                rows.append(dict(backend=name, causal=causal, view=how, scale=scale, **row))
    return rows


def check_merge() -> dict:
    from dtensor_ring.kernels._triton_merge import triton_merge_

    gen = torch.Generator(device="cuda").manual_seed(1)
    Bm, Sm, Hm, Dm = 2, 64, 8, 128
    out_acc = torch.randn(Bm, Sm, Hm, Dm, device="cuda", generator=gen)
    lse_acc = torch.randn(Bm, Hm, Sm, device="cuda", generator=gen)
    out_b = torch.randn(Bm, Sm, Hm, Dm, device="cuda", generator=gen).bfloat16()
    lse_b = torch.randn(Bm, Hm, Sm, device="cuda", generator=gen)
    out_acc[0, 1, 0, 0] = math.inf
    out_b[0, 2, 1, 3] = -math.inf
    lse_acc[0, 0, 3] = -math.inf
    lse_b[0, 0, 4] = -math.inf
    lse_acc[0, 0, 5] = lse_b[0, 0, 5] = -math.inf
    lse_b[1, 2, 6] = math.inf
    lse_acc[1, 3, 7] = math.nan
    eager_out, eager_lse = out_acc.clone(), lse_acc.clone()
    merge_eager_(eager_out, eager_lse, out_b, lse_b)
    fused_out, fused_lse = out_acc.clone(), lse_acc.clone()
    triton_merge_(fused_out, fused_lse, out_b, lse_b)
    # with rows: the block's rows are scattered rows of a 3x longer accumulator, merged in
    # place; the eager reference gathers them, merges and scatters back
    rows = torch.randperm(3 * Sm, device="cuda", generator=gen)[:Sm]
    big_out = torch.randn(Bm, 3 * Sm, Hm, Dm, device="cuda", generator=gen)
    big_lse = torch.randn(Bm, Hm, 3 * Sm, device="cuda", generator=gen)
    big_out[:, rows], big_lse[:, :, rows] = out_acc, lse_acc
    fused_big_out, fused_big_lse = big_out.clone(), big_lse.clone()
    triton_merge_(fused_big_out, fused_big_lse, out_b, lse_b, rows)
    eager_big_out, eager_big_lse = big_out.clone(), big_lse.clone()
    eager_big_out[:, rows], eager_big_lse[:, :, rows] = eager_out, eager_lse
    result = {}
    for name, got, want in (
        ("out", fused_out, eager_out),
        ("lse", fused_lse, eager_lse),
        ("out with rows", fused_big_out, eager_big_out),
        ("lse with rows", fused_big_lse, eager_big_lse),
    ):
        same = all(
            torch.equal(f(got), f(want)) for f in (torch.isnan, torch.isposinf, torch.isneginf)
        )
        fin = torch.isfinite(want) & torch.isfinite(got)
        result[name] = dict(
            same_nonfinite=same, max_finite_diff=float((got[fin] - want[fin]).abs().max())
        )
    result["ok"] = all(
        r["same_nonfinite"] and r["max_finite_diff"] <= 1e-5 for r in result.values()
    )
    return result


def check_untile_rows() -> list[dict]:
    from dtensor_ring.kernels.flash_attn4_tiles import padded_rows, padded_total, untile_rows

    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 5, 130, 131, 400, 512], dtype=torch.int32)
    total, heads, rows = 512, 4, []
    for tile, dims, dims_r, dtype in (
        (64, [128, 128], [128, 128], torch.float32),
        (64, [96, 80], [128, 96], torch.bfloat16),
        (128, [128], [128], torch.bfloat16),
    ):
        padded = padded_total(total, cu, tile)
        accums = [torch.randn(heads, padded * r, generator=gen) for r in dims_r]
        perms = [torch.randperm(tile * r, generator=gen) for r in dims_r]
        scales = [0.125, 1.0][: len(dims)]
        index = padded_rows(cu, total, tile)
        want = untile_rows([a.clone() for a in accums], perms, scales, index, tile, dims, dtype)
        got = untile_rows(
            [a.cuda() for a in accums],
            [p.cuda() for p in perms],
            scales,
            index.cuda(),
            tile,
            dims,
            dtype,
        )
        ok = all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
        rows.append(dict(tile=tile, dims=dims, dims_r=dims_r, dtype=str(dtype), ok=ok))
    return rows


def check_tiled_grads() -> list[dict]:
    from dtensor_ring.kernels.flash_attn4_tiles import TiledGrads, padded_rows, padded_total

    gen = torch.Generator().manual_seed(3)
    tile, heads, dims, dims_r, rows = 64, 2, [128, 96], [128, 128], []
    cu = torch.tensor([0, 5, 130, 131, 300], dtype=torch.int32)
    seq = 300
    for case in ("dense", "varlen run", "varlen index"):
        if case == "dense":
            padded, lead, index_rows = -(-seq // tile) * tile, (2, heads), None
            accs = [torch.zeros(2, 340, heads, d) for d in dims]
            targets = lambda a: [x[:, 20 : 20 + seq] for x in a]  # noqa: E731
            dest = None
        else:
            padded, lead = padded_total(seq, cu, tile), (heads,)
            index_rows = padded_rows(cu, seq, tile)
            accs = [torch.zeros(400, heads, d) for d in dims]
            if case == "varlen run":
                targets, dest = (lambda a: [x[50 : 50 + seq] for x in a]), None  # noqa: E731
            else:
                targets, dest = (lambda a: a), torch.randperm(400, generator=gen)[:seq]
        accs = [a.normal_(generator=gen) for a in accs]
        tiles = [torch.randn(*lead, padded * r, generator=gen) for r in dims_r]
        perms = [torch.randperm(tile * r, generator=gen) for r in dims_r]
        results = []
        for device in ("cpu", "cuda"):  # copies: the CPU path reorders the tiles in place
            mine = [a.to(device, copy=True) for a in accs]
            held = TiledGrads(
                [t.to(device, copy=True) for t in tiles],
                [p.to(device) for p in perms],
                [0.125, 1.0],
                None if index_rows is None else index_rows.to(device),
                tile,
                dims,
                seq,
            )
            held.add_to(*targets(mine), None if dest is None else dest.to(device))
            results.append([a.cpu() for a in mine])
        moved = any(torch.equal(a, b) for a, b in zip(accs, results[0], strict=True))
        ok = not moved and all(
            torch.allclose(g, w, rtol=1e-6, atol=1e-6) for g, w in zip(*results[::-1], strict=True)
        )
        rows.append(dict(tiled_grads=case, ok=ok))
    return rows


def main() -> None:
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    kernels = check_kernels()
    merge = check_merge()
    untile = check_untile_rows() + check_tiled_grads()
    for r in kernels + untile:
        print(r)
    print("merge:", merge)
    with open(os.path.join(out_dir, "check_inputs.json"), "w") as f:
        result = dict(torch=torch.__version__, kernels=kernels, merge=merge, untile_rows=untile)
        json.dump(result, f, indent=1)
    bad = [r for r in kernels + untile if r.get("ok") is False]
    bad += [merge] if not merge["ok"] else []
    print("check_inputs:", "OK" if not bad else f"{len(bad)} FAILED")


if __name__ == "__main__":
    main()
