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


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    B, H, H_kv, D = 1, 32, 8, 128
    rows, results = [], {}
    for S in (1024, 8192):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in "kv")
        dout = torch.randn_like(q)

        def plain(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        ref = plain()
        dts = [dr.shard_sequence(t, mesh, seq_dim=2, layout="zigzag") for t in (q, k, v)]

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def functional(q, k, v):  # [B, H, S, D] -> flash layout and back
            out = dr.zigzag_ring_flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            return out.transpose(1, 2)

        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        compiled_sdpa = torch.compile(sdpa, fullgraph=True)
        compiled_functional = torch.compile(functional, fullgraph=True)
        paths = {
            "plain sdpa": lambda: plain(),
            "dtensor sdpa eager": lambda: sdpa(*dts).to_local(),
            "dtensor sdpa compiled": lambda: compiled_sdpa(*dts).to_local(),
            "functional eager": lambda: functional(q, k, v),
            "functional compiled": lambda: compiled_functional(q, k, v),
        }
        with dr.ring_sdpa(layout="zigzag"):
            for name, fn in paths.items():
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    fwd = timed(fn)
                    leaves = [t.detach().requires_grad_() for t in (dts if "dtensor" in name
                                                                    else (q, k, v))]

                    def fwd_bwd(name=name, leaves=leaves):
                        f = {"plain sdpa": plain, "dtensor sdpa eager": sdpa,
                             "dtensor sdpa compiled": compiled_sdpa,
                             "functional eager": functional,
                             "functional compiled": compiled_functional}[name]
                        out = f(*leaves)
                        out.backward(dr.shard_sequence(dout, mesh, seq_dim=2, layout="zigzag")
                                     if "dtensor" in name else dout)

                    rows.append(dict(S=S, path=name, max_err_vs_sdpa=err, fwd_ms=fwd,
                                     fwd_bwd_ms=timed(fwd_bwd)))
                except Exception as e:  # record and go on
                    rows.append(dict(S=S, path=name, error=f"{type(e).__name__}: {e}"[:300]))
        results[f"graph_breaks_S{S}"] = sum(counters["graph_break"].values())
    results["rows"] = rows
    results.update(torch=torch.__version__, device=torch.cuda.get_device_name())
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dtensor_compile.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}; graph breaks: "
          f"{ {k: v for k, v in results.items() if k.startswith('graph')} }")
    print(f"{'S':>6} {'path':<24}{'max err':>10}{'fwd ms':>9}{'f+b ms':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['S']:>6} {r['path']:<24} ERROR {r['error']}")
        else:
            print(f"{r['S']:>6} {r['path']:<24}{r['max_err_vs_sdpa']:>10.2e}{r['fwd_ms']:>9.3f}"
                  f"{r['fwd_bwd_ms']:>9.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
