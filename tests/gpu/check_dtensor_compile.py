"""GPU check of the DTensor + torch.compile path on one GPU (a world-size-1 mesh).

    python tests/gpu/check_dtensor_compile.py            # writes $OUT/dtensor_compile.json

On a 1-rank CUDA mesh, ``F.scaled_dot_product_attention`` on sequence-sharded DTensors inside
``ring_sdpa`` (eager and ``torch.compile(fullgraph=True)``), the functional API compiled, and
plain SDPA: results must agree with plain SDPA (same kernel family, bf16), the compiled runs must
have no graph break, and the table shows each path's time against plain SDPA (the dispatch
overhead). Prints a table last.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` with CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def sdpa(q, k, v):
    """Causal GQA SDPA in ``[B, H, S, D]`` (plain tensors or DTensors)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def functional(q, k, v):
    """The functional API on ``[B, H, S, D]`` tensors (flash layout inside)."""
    out = dr.zigzag_ring_flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
    )
    return out.transpose(1, 2)


def check_size(S: int, mesh) -> list[dict]:
    """Every path at sequence length ``S``: error vs plain SDPA, fwd and fwd+bwd times."""
    B, H, H_kv, D = 1, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv"
    )
    dout = torch.randn_like(q)
    ref = sdpa(q, k, v)

    def as_dtensor(t):
        return dr.shard_sequence(t, mesh, seq_dim=2, layout="zigzag")

    plain_inputs, dtensor_inputs = (q, k, v, dout), tuple(map(as_dtensor, (q, k, v, dout)))
    paths = {  # name -> (function, inputs)
        "plain sdpa": (sdpa, plain_inputs),
        "dtensor sdpa eager": (sdpa, dtensor_inputs),
        "dtensor sdpa compiled": (torch.compile(sdpa, fullgraph=True), dtensor_inputs),
        "functional eager": (functional, plain_inputs),
        "functional compiled": (torch.compile(functional, fullgraph=True), plain_inputs),
    }
    rows = []
    for name, (fn, (qi, ki, vi, di)) in paths.items():
        leaves = [t.detach().requires_grad_() for t in (qi, ki, vi)]

        def fwd(fn=fn, qi=qi, ki=ki, vi=vi):
            return fn(qi, ki, vi)

        def fwd_bwd(fn=fn, leaves=leaves, di=di):
            fn(*leaves).backward(di)

        try:
            out = fwd()
            out = out.to_local() if hasattr(out, "to_local") else out
            rows.append(
                dict(
                    S=S,
                    path=name,
                    max_err_vs_sdpa=(out - ref).abs().max().item(),
                    fwd_ms=timed(fwd),
                    fwd_bwd_ms=timed(fwd_bwd),
                )
            )
        except Exception as e:  # record and go on
            rows.append(dict(S=S, path=name, error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    from torch._dynamo.utils import counters

    rows, results = [], {}
    with dr.ring_sdpa(layout="zigzag"):
        for S in (1024, 8192):
            torch._dynamo.reset()
            counters.clear()
            rows += check_size(S, mesh)
            results[f"graph_breaks_S{S}"] = sum(counters["graph_break"].values())
    results["rows"] = rows
    results.update(torch=torch.__version__, device=torch.cuda.get_device_name())
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dtensor_compile.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(
        f"\n{results['device']}, torch {results['torch']}; graph breaks: "
        f"{ {k: v for k, v in results.items() if k.startswith('graph')} }"
    )
    print(f"{'S':>6} {'path':<24}{'max err':>10}{'fwd ms':>9}{'f+b ms':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['S']:>6} {r['path']:<24} ERROR {r['error']}")
        else:
            print(
                f"{r['S']:>6} {r['path']:<24}{r['max_err_vs_sdpa']:>10.2e}{r['fwd_ms']:>9.3f}"
                f"{r['fwd_bwd_ms']:>9.3f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
