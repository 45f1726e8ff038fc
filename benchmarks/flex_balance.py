"""Load balance of FlexAttention masks on the ring, per layout (a schedule metric: no GPU, no
process group).

    python benchmarks/flex_balance.py                 # S = 16384, W = 8, ~10 s on CPU
    python benchmarks/flex_balance.py --seq-len 4096 --world-size 4

For packed causal documents (5 and 32 documents, random lengths, seeded), documents + a sliding
window, and prefix-LM, it builds the global ``BlockMask`` (128-token tiles) and reports, for
the fixed layouts (ring, zigzag) and the mask-aware layout (``dtensor_ring.flex_layout``,
Note [Mask-aware balance]) at several chunks per rank: max/mean per-rank work (visible tile
pairs, ``dtensor_ring.flex_balance``), K/V transfers per rank and blocks computed per rank.
The baseline is the ring layout of the same run. ``create_block_mask`` materialises the whole
S x S mask on CPU, which bounds ``--seq-len`` (16384: ~1 GiB). Prints a table and writes JSON
(default: ``benchmarks/results/flex_balance_cpu_<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from torch.nn.attention.flex_attention import create_block_mask

import dtensor_ring as dr


def _documents(seq_len: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(seq_len - 1, generator=gen)[: n - 1] + 1).values
    lengths = torch.cat([cuts, torch.tensor([seq_len])]).diff(prepend=torch.tensor([0]))
    return torch.repeat_interleave(torch.arange(n), lengths)


def masks(seq_len: int) -> dict:
    doc5, doc32 = _documents(seq_len, 5), _documents(seq_len, 32)
    window, prefix = seq_len // 16, seq_len // 4
    return {
        "documents x5": lambda b, h, q, kv: (doc5[q] == doc5[kv]) & (q >= kv),
        "documents x32": lambda b, h, q, kv: (doc32[q] == doc32[kv]) & (q >= kv),
        "documents x5 + window": lambda b, h, q, kv: (
            (doc5[q] == doc5[kv]) & (q >= kv) & (q - kv <= window)
        ),
        "prefix-LM": lambda b, h, q, kv: (kv < prefix) | (q >= kv),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    S, W = args.seq_len, args.world_size
    rows = []
    for name, mask_mod in masks(S).items():
        bm = create_block_mask(mask_mod, None, None, S, S, "cpu", 128)
        layouts = [("ring", "ring"), ("zigzag", "zigzag")]
        layouts += [(f"mask-aware k={k}", dr.flex_layout(bm, W, k)) for k in args.chunks]
        for label, layout in layouts:
            report = dr.flex_balance(bm, W, layout)
            rows.append(
                {
                    "mask": name,
                    "layout": label,
                    "imbalance": round(report.imbalance, 4),
                    "kv_transfers": report.kv_transfers,
                    "blocks_per_rank": round(sum(report.blocks) / W, 1),
                    "work": report.work,
                }
            )
    print(f"S = {S}, W = {W}, 128-token tiles; max/mean work (1.0 = balanced)")
    print(f"{'mask':<24}{'layout':<18}{'max/mean':>9}{'K/V sends':>10}{'blocks':>8}")
    for r in rows:
        print(
            f"{r['mask']:<24}{r['layout']:<18}{r['imbalance']:>9.3f}{r['kv_transfers']:>10}"
            f"{r['blocks_per_rank']:>8}"
        )
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"flex_balance_cpu_{date}.json"
    )
    meta = {"seq_len": S, "world_size": W, "tile": 128, "torch": torch.__version__, "date": date}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
