"""GPU check of FlexAttention on the ring (docs/flex.md), on one GPU with the simulator.

Not a test (CI has no GPU): ``python tests/gpu/check_flex.py``. Every rank of a W = 4 ring
runs in turn (``dtensor_ring.simulate_ring``, the real engine and kernels), bf16,
``B = 1, H = 8, H_kv = 2, D = 64, S = 4096``; masks: causal, 5 packed causal documents,
documents + window 256, prefix-LM 1024, documents with a softcap ``score_mod``, and the
documents (with and without the window) as ``dr.document_mask`` builds them from their
boundaries; layouts ring,
zigzag and the mask-aware one (``flex_layout``, 4 chunks a rank); kernels flex_triton
(PyTorch's compiled flex kernels per block, Note [Flex blocks on PyTorch's kernels]) and, on
one mask, flex_math (fp32). The masks that are packed documents (no ``score_mod``) also run as
``dr.flex_attention`` runs them without the lse (Note [Document masks on the varlen kernels]):
read back as documents (``mask_documents``), on the varlen kernels in ring and zigzag shards
(``dr.documents_as_sharded``), kernel "documents:<the varlen kernel chosen>".

Each row: the max error of ``out, dq, dk, dv`` against an fp64 reference on the whole
sequence (``tests/reference.reference_flex`` on the GPU), divided by the same error of
one-GPU ``torch.compile(flex_attention)`` on the whole sequence in the same dtype (ratio ~1:
as exact as the one-GPU kernel). Results go to ``$OUT/check_flex.json`` (or the current dir).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from reference import reference_flex  # noqa: E402

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import KernelCall, select_kernel  # noqa: E402
from dtensor_ring.schedule.flex_documents import mask_documents  # noqa: E402

B, H, H_KV, D, S, W = 1, 8, 2, 64, 4096, 4
DEV = torch.device("cuda")


def documents(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    cuts = torch.sort(torch.randperm(S - 1, generator=gen)[: n - 1] + 1).values
    lengths = torch.cat([cuts, torch.tensor([S])]).diff(prepend=torch.tensor([0]))
    return torch.repeat_interleave(torch.arange(n), lengths).to(DEV)


def masks() -> dict:
    doc = documents(5)
    return {
        "causal": (lambda b, h, q, kv: q >= kv, None),
        "documents": (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), None),
        "documents+window": (
            lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv) & (q - kv < 256),
            None,
        ),
        "prefix_lm": (lambda b, h, q, kv: (kv < 1024) | (q >= kv), None),
        "documents+softcap": (
            lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
            lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0),
        ),
        "document_mask": (boundaries(doc, (-1, 0)), None),
        "document_mask+window": (boundaries(doc, (255, 0)), None),
    }


def boundaries(doc: torch.Tensor, window: tuple[int, int]):
    """``dr.document_mask`` of the documents ``doc`` (a BlockMask, built from boundaries)."""
    starts = torch.cat(
        [torch.zeros(1, device=DEV, dtype=torch.long), (doc.diff() != 0).nonzero()[:, 0] + 1]
    )
    cu = torch.cat([starts, torch.tensor([S], device=DEV)]).to(torch.int32)
    return dr.document_mask(cu, S, window, device=DEV)


def varlen_kernel(q: torch.Tensor) -> str:
    """The varlen block kernel the library picks for bf16 packed documents here."""
    x = q.to(torch.bfloat16)[0].transpose(0, 1)
    return select_kernel(KernelCall.of(x, x[:, :H_KV], varlen=True, window=True)).name


def report(row: dict) -> None:
    ratios = " ".join(
        f"{n}={r:.2f}" for n, r in zip(("out", "dq", "dk", "dv"), row["ratios"], strict=True)
    )
    print(
        f"{row['mask']:<18} {row['kernel']:<22} {row['layout']:<10} {ratios}  ({row['seconds']} s)",
        flush=True,
    )


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, H_KV, S, D, generator=gen) for _ in range(2))
    q, k, v, dout = (t.to(DEV) for t in (q, k, v, dout))
    one_gpu = torch.compile(flex_attention)
    rows = []
    for mask_name, (mask_mod, score_mod) in masks().items():
        if isinstance(mask_mod, BlockMask):  # built by dr.document_mask
            bm, mask_mod = mask_mod, mask_mod.mask_mod
        else:
            bm = create_block_mask(mask_mod, None, None, S, S, DEV)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference_flex(*leaves, mask_mod=mask_mod, score_mod=score_mod)
        ref_out.backward(dout.double())
        ref = [ref_out.detach(), *(t.grad for t in leaves)]
        del ref_out, leaves
        for dtype in (torch.bfloat16,):
            one = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out1 = one_gpu(*one, score_mod=score_mod, block_mask=bm, enable_gqa=True)
            out1.backward(dout.to(dtype))
            base = [max_err(a, b) for a, b in zip([out1, *(t.grad for t in one)], ref, strict=True)]
            kernels = ["flex_triton"] + (["flex_math"] if mask_name == "documents" else [])
            for kernel in kernels:
                kdtype = torch.float32 if kernel == "flex_math" else dtype
                for layout_name in ("ring", "zigzag", "mask-aware"):
                    layout = (
                        dr.flex_layout(bm, W, 4) if layout_name == "mask-aware" else layout_name
                    )
                    t0 = time.time()
                    got = dr.simulate_ring(
                        *(t.to(kdtype).transpose(1, 2) for t in (q, k, v, dout)),
                        layout=layout, world_size=W, block_mask=bm, score_mod=score_mod,
                        backend=kernel,
                    )  # fmt: skip
                    got = [got[0], *got[2:]]
                    errs = [max_err(a.transpose(1, 2), b) for a, b in zip(got, ref, strict=True)]
                    ratios = [e / max(b, 1e-30) for e, b in zip(errs, base, strict=True)]
                    row = {
                        "mask": mask_name, "kernel": kernel, "dtype": str(kdtype),
                        "layout": layout_name, "errors": errs, "one_gpu_errors": base,
                        "ratios": ratios, "seconds": round(time.time() - t0, 1),
                    }  # fmt: skip
                    rows.append(row)
                    report(row)
            documents = mask_documents(bm, B) if score_mod is None else None
            for layout_name in ("ring", "zigzag") if documents is not None else ():
                t0 = time.time()
                placed = dr.documents_as_sharded(
                    documents.bounds, layout_name, W, causal=documents.window_size[1] == 0,
                    window_size=documents.window_size,
                )  # fmt: skip
                packed = [t.to(dtype)[0].transpose(0, 1) for t in (q, k, v, dout)]  # [S, H, D]
                got = dr.simulate_ring(
                    *packed, layout=placed, world_size=W, causal=False,
                    cu_seqlens=documents.bounds, window_size=documents.window_size,
                )  # fmt: skip
                got = [got[0], *got[2:]]
                errs = [max_err(a.transpose(0, 1)[None], b) for a, b in zip(got, ref, strict=True)]
                row = {
                    "mask": mask_name, "kernel": f"documents:{varlen_kernel(q)}",
                    "dtype": str(dtype), "layout": layout_name, "errors": errs,
                    "one_gpu_errors": base,
                    "ratios": [e / max(b, 1e-30) for e, b in zip(errs, base, strict=True)],
                    "seconds": round(time.time() - t0, 1),
                }  # fmt: skip
                rows.append(row)
                report(row)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": {"B": B, "H": H, "H_kv": H_KV, "D": D, "S": S, "W": W},
    }
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "check_flex.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for kind in ("flex_triton", "documents:"):
        worst = max(max(r["ratios"]) for r in rows if r["kernel"].startswith(kind))
        print(f"worst {kind.rstrip(':')} error ratio vs one-GPU flex: {worst:.2f}")


if __name__ == "__main__":
    main()
