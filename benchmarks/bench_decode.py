"""Decoding-step latency over a sharded KV cache against attention over the whole cache.

    python benchmarks/bench_decode.py --out results/     # one GPU, ~1 min
    python benchmarks/bench_decode.py --smoke --out /tmp  # CPU, tiny: checks the code paths

One decoding step of one attention layer (bf16 ``B=1, H=32, H_kv=8, D=128``; the query is one
token) at cache lengths L (default 32k, 64k, 128k), with W ranks simulated on one device:

* ``full``: the baseline, ``F.scaled_dot_product_attention`` of the query over the whole
  cache (``enable_gqa=True``), on one device;
* ``shard``: what one rank runs, ``decode_attention_func`` over its ``L / W`` tokens on a real
  1-rank NCCL group (gloo on CPU): the kernel, the all-gather (of one rank) and the merge code;
* ``merge``: the merge of the W ranks' partial ``(out, lse)`` that every rank does after the
  all-gather (``merge_all`` of ``[W, B, 1, H, D]``);
* ``step``: ``shard + merge``, the simulated step time, and ``full / step``.

Not simulated: the all-gather of W ranks' ``B * H * (D + 1)`` fp32 values (a few KB; one
NCCL latency, ~10-20 us within a node). Prints a table and writes ``bench_decode.json`` to
--out (the conventions of bench_overhead.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH

from bench_overhead import median_ms  # noqa: E402  (this directory: run as a script)

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import accumulation_dtype  # noqa: E402
from dtensor_ring.kernels.merge import merge_all  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--cache", default="32768,65536,131072", help="cache lengths L")
    p.add_argument("--worlds", default="2,4,8", help="simulated world sizes W")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: checks the code paths")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = (32, 8, 128) if cuda else (4, 2, 16)
    lengths = [int(s) for s in a.cache.split(",")] if not a.smoke else [256, 512]
    worlds = [int(w) for w in a.worlds.split(",")] if not a.smoke else [2, 4]
    reps = a.reps if not a.smoke else 3
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    if cuda:
        torch.cuda.init()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    acc = accumulation_dtype(dtype)
    rows = []
    with torch.no_grad():
        for L in lengths:
            q = torch.randn(1, 1, heads, dim, device=device, dtype=dtype)
            k, v = (torch.randn(1, L, kv_heads, dim, device=device, dtype=dtype) for _ in "kv")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            full = median_ms(
                lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(
                    qt, kt, vt, enable_gqa=True
                ),
                reps,
            )
            for W in worlds:
                n = L // W
                ks, vs = k[:, :n].contiguous(), v[:, :n].contiguous()
                shard = median_ms(
                    lambda q=q, ks=ks, vs=vs: dr.decode_attention_func(q, ks, vs), reps
                )
                outs = torch.randn(W, 1, 1, heads, dim, device=device, dtype=acc)
                lses = torch.randn(W, 1, heads, 1, device=device, dtype=acc)

                def merge(outs=outs, lses=lses):
                    merge_all(outs, lses)

                merged = median_ms(merge, reps)
                step = shard + merged
                rows.append(
                    dict(
                        cache=L,
                        world=W,
                        full_ms=full,
                        shard_ms=shard,
                        merge_ms=merged,
                        step_ms=step,
                        speedup=full / step,
                    )
                )
    print(
        f"{'L':>7} {'W':>3} {'full ms':>8} {'shard ms':>9} {'merge ms':>9} {'step ms':>8} {'x':>6}"
    )
    for r in rows:
        print(
            f"{r['cache']:>7} {r['world']:>3} {r['full_ms']:8.3f} {r['shard_ms']:9.3f} "
            f"{r['merge_ms']:9.3f} {r['step_ms']:8.3f} {r['speedup']:6.2f}"
        )
    meta = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        config=dict(heads=heads, kv_heads=kv_heads, head_dim=dim, dtype=str(dtype), batch=1),
        note="W simulated on one device: one rank's shard + the W-way merge; the W-rank "
        "all-gather is not included",
    )
    with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
        json.dump(dict(**meta, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
