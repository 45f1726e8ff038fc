"""What the ``ring_sdpa`` scope costs the host, piece by piece (issue #28, "no eager tax on the
DTensor path").

    python benchmarks/bench_scope_tax.py --out $OUT      # one GPU, under a minute
    python benchmarks/bench_scope_tax.py --smoke         # CPU, tiny: checks the code paths

On a real 1-rank group (NCCL on CUDA, gloo on CPU), the host time of one call issued back to
back (``bench_overhead.host_ms``: the mean over 200 calls, the least of 5 rounds that
interleave the rows, as the host's own noise only ever adds; at these sizes the GPU waits
for the host), each next to its baseline measured in the same run:

* ``50 ops``: 50 small elementwise ops (``x + 1``, ``[64, 64]``) outside and inside an open
  ``ring_sdpa()`` scope: what the scope's ``TorchFunctionMode`` adds to every op of a model;
* ``functional``: ``ring_flash_attn_func`` (bf16 ``B = 1, H = 32, H_kv = 8, D = 128``, causal,
  ``S = --seq``) outside and inside the scope, forward and forward + backward;
* ``dtensor``: SDPA on ``Shard(2)`` DTensors of the 1-rank mesh inside the open scope (the scope
  entered once, as around a training step), forward and forward + backward: the eager route
  (Note [Eager SDPA on DTensors]);
* ``to_local x3`` / ``from_local``: DTensor's own wrappers, as the SDPA path uses them;
* ``sdpa``: plain ``F.scaled_dot_product_attention`` on the same tensors.

Prints a table and writes ``bench_scope_tax.json`` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_overhead import host_ms  # noqa: E402

import dtensor_ring as dr  # noqa: E402

ROUNDS = 5


def measure(seq: int, device: torch.device, dtype: torch.dtype, dims, calls: int) -> list[dict]:
    """``[{what, where, ms}]``: every row of the module docstring."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    heads, kv_heads, dim = dims
    mesh = DeviceMesh(device.type, [0])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, seq, h, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )  # [B, S, H, D]
    qd, kd, vd = (
        DTensor.from_local(
            x.detach().transpose(1, 2), mesh, [Shard(2)], run_check=False
        ).requires_grad_()
        for x in (q, k, v)
    )  # [B, H, S, D] DTensors
    small = torch.randn(64, 64, device=device)

    def ops50():
        y = small
        for _ in range(50):
            y = y + 1
        return y

    def functional():
        return dr.ring_flash_attn_func(q, k, v, causal=True)

    def dtensor():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    def sdpa():
        return F.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
        )

    def fwd_bwd(fn):
        def run():  # gradients set, not accumulated (zero_grad(set_to_none=True) per step)
            for x in (q, k, v, qd, kd, vd):
                x.grad = None
            out = fn()
            out.backward(torch.ones_like(out))

        return run

    local = qd.to_local()
    pieces = {
        "to_local x3": lambda: (qd.to_local(), kd.to_local(), vd.to_local()),
        "from_local": lambda: DTensor.from_local(local, mesh, [Shard(2)], run_check=False),
    }
    both = [
        ("50 ops", ops50),
        ("functional fwd", functional),
        ("functional fwd+bwd", fwd_bwd(functional)),
    ]
    cases = {
        "outside": [*both, ("sdpa fwd", sdpa), ("sdpa fwd+bwd", fwd_bwd(sdpa)), *pieces.items()],
        "inside": [*both, ("dtensor fwd", dtensor), ("dtensor fwd+bwd", fwd_bwd(dtensor))],
    }
    best: dict[tuple[str, str], float] = {}
    for _ in range(ROUNDS):  # rounds interleave the rows: a slow spell of the host hits all
        for where, rows in cases.items():
            with dr.ring_sdpa() if where == "inside" else contextlib.nullcontext():
                for what, fn in rows:
                    ms = host_ms(fn, calls)
                    best[what, where] = min(best.get((what, where), ms), ms)
    rows = [dict(what=what, where=where, ms=ms) for (what, where), ms in best.items()]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'what':>20} {'where':>8} {'host ms':>9}")
    for r in rows:
        print(f"{r['what']:>20} {r['where']:>8} {r['ms']:9.4f}")
    by = {(r["what"], r["where"]): r["ms"] for r in rows}
    tax = (by[("50 ops", "inside")] - by[("50 ops", "outside")]) / 50 * 1e3
    print(f"the scope's mode adds {tax:.2f} us to every op")
    for phase in ("fwd", "fwd+bwd"):
        extra = by[(f"dtensor {phase}", "inside")] - by[(f"functional {phase}", "outside")]
        print(f"DTensor SDPA {phase} over the functional call: {extra:+.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: checks the code paths")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dims = (32, 8, 128) if cuda else (4, 2, 16)
    rows = measure(
        a.seq if not a.smoke else 16,
        device,
        torch.bfloat16 if cuda else torch.float32,
        dims,
        a.calls if not a.smoke else 10,
    )
    print_table(rows)
    meta = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        config=dict(seq=a.seq, heads=dims[0], kv_heads=dims[1], head_dim=dims[2], causal=True),
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_scope_tax.json"), "w") as f:
        json.dump(dict(**meta, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
