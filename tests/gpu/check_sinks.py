"""GPU check of attention sinks (Note [Attention sinks]) with the CUDA kernels.

On a 1-rank NCCL group, bf16, every CUDA dense backend (and the varlen path where one serves
it): ``zigzag_ring_flash_attn_func(..., sinks=)`` forward and backward against the fp64
reference with the sink column, next to the same call without sinks against its own
reference. Sinks must not make the error worse: max error with sinks <= 1.5x the error
without + 1e-3, for out, dq, dk, dv; the sinks' gradient within 2e-2 relative.

    python tests/gpu/check_sinks.py     # one GPU, seconds; JSON to $OUT/check_sinks.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import BACKENDS, KernelCall  # noqa: E402
from tests.reference import reference_attention  # noqa: E402

B, S, H, H_KV, D = 2, 2048, 16, 4, 128


def _errors(backend: str, with_sinks: bool, causal: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(B, S, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        for h in (H, H_KV, H_KV, H)
    )
    sinks = torch.randn(H, generator=gen, device="cuda", dtype=torch.float32) * 2
    sinks[0] = 6.0  # a sink that dominates some rows
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    ref, _ = reference_attention(
        *leaves[:3], causal=causal, sinks=leaves[3] if with_sinks else None
    )
    want = [ref.detach(), *torch.autograd.grad(ref, leaves[: 3 + with_sinks], dout.double())]
    inputs = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    out = dr.ring_flash_attn_func(
        *inputs[:3],
        causal=causal,
        backend=backend,
        sinks=inputs[3] if with_sinks else None,
    )
    out.backward(dout)
    got = [out, *(x.grad for x in inputs[: 3 + with_sinks])]
    names = ["out", "dq", "dk", "dv", "dsinks"]
    errors = {}
    for name, g, w in zip(names, got, want, strict=False):
        err = float((g.double() - w).abs().max())
        errors[name] = err / float(w.abs().max()) if name == "dsinks" else err
    return errors


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    call = KernelCall("cuda", torch.bfloat16, D, H, H_KV, False, False, False)
    backends = [b.name for b in BACKENDS if b.unsupported_reason(call) is None]
    rows, ok = [], True
    for backend in backends:
        for causal in (True, False):
            base = _errors(backend, False, causal)
            sunk = _errors(backend, True, causal)
            passed = all(sunk[n] <= 1.5 * base[n] + 1e-3 for n in base) and sunk["dsinks"] < 2e-2
            ok &= passed
            rows.append(
                {
                    "backend": backend,
                    "causal": causal,
                    "without": base,
                    "with": sunk,
                    "passed": passed,
                }
            )
            print(
                f"{backend:10s} causal={causal!s:5s} without {base}\n{'':23s}with    {sunk}"
                f"  {'ok' if passed else 'FAIL'}"
            )
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "check_sinks.json"), "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(),
                "rows": rows,
                "passed": ok,
            },
            f,
            indent=1,
        )
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
