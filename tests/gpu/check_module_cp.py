"""GPU check of PyTorch's module-level context parallel on ring attention, and of autocast.

Not a test (CI has no GPU): run it on a CUDA machine, alone (world size 1, NCCL) or under
torchrun,

    python tests/gpu/check_module_cp.py
    torchrun --nproc-per-node 2 tests/gpu/check_module_cp.py

Cases, bf16, ``B = 2, H = 8, H_kv = 2, D = 64, S = 1024 W``, causal, forward and backward:

* ``module``: ``parallelize_module(SDPAWrapper, mesh, ContextParallel(seq_dim=2))`` on
  head-tail shards (``context_parallel_shard`` with PyTorch's ``_HeadTailLoadBalancer``),
  eager and with ``torch.compile(F.scaled_dot_product_attention, fullgraph=True)`` inside the
  module (inductor);
* ``dispatcher``: torchtitan 0.3's SDPA wiring: ``enable_context_parallel_dispatcher()``,
  q, k, v as ``Shard(1)`` DTensors of ``[B, L, N, H]`` transposed for SDPA;
* ``autocast``: fp32 inputs under ``torch.autocast("cuda", torch.bfloat16)``: the op computes
  in fp32 (Note [Autocast]): equal to the same call without autocast.

Each row: the max error of ``out, dq, dk, dv`` against an fp64 reference, divided by the same
error of single-device SDPA in the same dtype on the whole sequence (ratio ~1: as exact as the
one-GPU kernel); ``autocast``: the largest difference to the call without autocast (0 expected).
Results go to ``$OUT/module_cp.json``; the table is printed on rank 0.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.compat.torch_cp import _HeadTailLoadBalancer  # noqa: E402

B, H, H_KV, D, S_LOCAL = 2, 8, 2, 64, 1024


class SDPAWrapper(torch.nn.Module):
    def __init__(self, compiled: bool):
        super().__init__()
        self.sdpa = F.scaled_dot_product_attention
        if compiled:
            self.sdpa = torch.compile(F.scaled_dot_product_attention, fullgraph=True)

    def forward(self, *args, **kwargs):
        return self.sdpa(*args, **kwargs)


def _full(seq_len: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, H, seq_len, D), (B, H_KV, seq_len, D), (B, H_KV, seq_len, D), (B, H, seq_len, D)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _errors(got, ref):
    return [(a.double() - b).abs().max().item() for a, b in zip(got, ref, strict=True)]


def run_module(mesh, compiled: bool, full, ref, base) -> dict:
    W = mesh.size()
    lb = _HeadTailLoadBalancer(full[0].shape[2], W, full[0].device)
    shards = dr.context_parallel_shard(mesh, full, [2] * 4, lb)
    attention = parallelize_module(SDPAWrapper(compiled), mesh, dr.ContextParallel(seq_dim=2))
    got = _grads(lambda *t: attention(*t, is_causal=True, enable_gqa=True), *shards)
    got = dr.context_parallel_unshard(mesh, got, [2] * 4, lb)
    return _row(f"module{'[compiled]' if compiled else ''}", got, ref, base)


def run_dispatcher(mesh, full, ref, base) -> dict:
    W = mesh.size()
    lb = _HeadTailLoadBalancer(full[0].shape[2], W, full[0].device)
    dr.enable_context_parallel_dispatcher()
    try:
        blnh = [t.transpose(1, 2).contiguous() for t in full]  # torchtitan's [B, L, N, H]
        shards = dr.context_parallel_shard(mesh, blnh, [1] * 4, lb)

        def forward(q, k, v):
            q, k, v = (DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in (q, k, v))
            out = _sdpa(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            return out.to_local()

        got = _grads(forward, *shards)
        got = dr.context_parallel_unshard(mesh, got, [1] * 4, lb)
    finally:
        dr.disable_context_parallel_dispatcher()
    return _row("dispatcher", [t.transpose(1, 2) for t in got], ref, base)


def run_autocast(mesh, full) -> dict:
    group = mesh.get_group()
    rank, W = mesh.get_local_rank(), mesh.size()
    q, k, v, dout = (dr.shard_local(t.float(), "zigzag", rank, W, 2).transpose(1, 2) for t in full)

    def call(*t):
        return dr.ring_attention_func("zigzag", *t, causal=True, group=group)

    plain = _grads(call, q, k, v, dout)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast = _grads(call, q, k, v, dout)
    diff = max((a - b).abs().max().item() for a, b in zip(plain, cast, strict=True))
    return {"case": "autocast", "max_diff_vs_no_autocast": diff, "dtype": str(cast[0].dtype)}


def _row(case, got, ref, base) -> dict:
    errors = _errors(got, ref)
    ratios = [e / max(b, 1e-30) for e, b in zip(errors, base, strict=True)]
    return {"case": case, "errors": errors, "sdpa_errors": base, "ratios": ratios}


def main() -> None:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl")
    mesh = DeviceMesh("cuda", list(range(dist.get_world_size())))
    device = torch.device("cuda", torch.cuda.current_device())
    full = _full(S_LOCAL * mesh.size(), torch.bfloat16, device)
    ref = _grads(_sdpa, *(t.double() for t in full[:3]), full[3].double())
    base = _errors(_grads(_sdpa, *full), ref)
    rows = []
    for run in (
        lambda: run_module(mesh, False, full, ref, base),
        lambda: run_module(mesh, True, full, ref, base),
        lambda: run_dispatcher(mesh, full, ref, base),
        lambda: run_autocast(mesh, full),
    ):
        try:
            rows.append(run())
        except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
            rows.append({"case": "error", "error": f"{type(e).__name__}: {e}"[:500]})
    if rank == 0:
        for r in rows:
            print(json.dumps(r))
        out = os.environ.get("OUT", "./out")
        os.makedirs(out, exist_ok=True)
        meta = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "W": mesh.size(),
        }
        with open(os.path.join(out, "module_cp.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
