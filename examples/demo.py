"""Run every layout with every algorithm that can run it on the ranks of a process group, and
check it.

    torchrun --nproc-per-node 4 examples/demo.py            # 4 CPU ranks (gloo)
    torchrun --nproc-per-node 8 examples/demo.py --cuda     # 8 GPUs (NCCL)

Per pair (layout: where the tokens live; algorithm: how K/V move; Note [Layouts and
algorithms]): the max error of out and of dq/dk/dv against full (single-device, fp64)
attention on the whole sequence, and the median time of forward+backward. Ulysses needs the
heads divisible by the number of ranks (it is skipped otherwise).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import dtensor_ring as dr

VARIANTS = [  # (layout, algorithm, causal): every pair that runs (docs/api.md's table)
    ("ring", "ring", False),
    ("ring", "ring", True),
    ("ring", "all_gather", True),
    ("ring", "ulysses", True),
    ("zigzag", "ring", True),
    ("zigzag", "all_gather", True),
    ("zigzag", "all_gather", False),
    ("zigzag", "ulysses", True),
    ("zigzag", "auto", True),
    ("stripe", "ring", True),
    ("stripe", "ulysses", True),
]


def full_attention(q, k, v, causal):
    """fp64 single-device attention on ``[B, S, H, D]`` (GQA through ``enable_gqa``)."""
    o = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=True
    )
    return o.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cuda", action="store_true", help="NCCL + bf16 on GPUs")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.cuda else torch.float32

    gen = torch.Generator().manual_seed(0)  # same full tensors on every rank
    shape = (1, args.seq)
    q = torch.randn(*shape, args.heads, args.head_dim, generator=gen)
    k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, generator=gen) for _ in "kv")
    dout = torch.randn(q.shape, generator=gen)
    if rank == 0:
        print(
            f"{world} ranks, S={args.seq}, H={args.heads}, H_kv={args.kv_heads}, "
            f"D={args.head_dim}, {dtype}, {device}"
        )
        print(
            f"{'layout':<7} {'algorithm':<11} {'causal':<7} {'max|out err|':>13} "
            f"{'max|grad err|':>14} {'fwd+bwd ms':>11}"
        )
    for layout, algorithm, causal in VARIANTS:
        if algorithm == "ulysses" and args.heads % world:
            continue
        full = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out = full_attention(*full, causal)
        ref_grads = torch.autograd.grad(ref_out, full, dout.double())

        def local(t, layout=layout):
            return dr.shard_local(t, layout, rank, world).to(device, dtype)

        ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
        times = []
        for _ in range(args.reps):
            ql.grad = kl.grad = vl.grad = None
            start = time.perf_counter()
            out = dr.ring_attention_func(layout, ql, kl, vl, causal=causal, algorithm=algorithm)
            out.backward(local(dout))
            if args.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out_err = (out.double() - local(ref_out).double()).abs().max()
        grad_err = max(
            (t.grad.double() - local(g).double()).abs().max()
            for t, g in zip((ql, kl, vl), ref_grads, strict=True)
        )
        errs = torch.stack([out_err, grad_err]).to(device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if rank == 0:
            ms = sorted(times)[len(times) // 2] * 1e3
            print(
                f"{layout:<7} {algorithm:<11} {causal!s:<7} {errs[0]:>13.2e} {errs[1]:>14.2e} "
                f"{ms:>11.1f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
