"""GPU check of the DTensor front door: the eager route and the CUDA SDPA aten-op handlers end
to end.

Not a test (CI has no GPU): run it on a CUDA machine, alone (world size 1) or under torchrun,

    python tests/gpu/check_dtensor.py
    torchrun --nproc-per-node 2 tests/gpu/check_dtensor.py

For each SDPA backend (forced with ``sdpa_kernel``: flash, efficient, cuDNN) it runs
``F.scaled_dot_product_attention`` on zigzag-sharded DTensors inside ``ring_sdpa``, forward and
backward: in plain eager code (the eager route, Note [Eager SDPA on DTensors]; fp32 with GQA
too, which no fused SDPA kernel takes), under a pass-through ``TorchDispatchMode`` (the
handlers, through their real return values), a ``torch.compile``'d step (inductor, the
handlers) and an activation-checkpointed tiny model, and prints one table on rank 0:
max error against the fp64 reference (attention) or the relative gradient error against the
same model without context parallelism.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtensor_ring  # noqa: E402
from dtensor_ring.testing import TinyConfig, TinyTransformer  # noqa: E402
from tests.modes import PassThroughMode  # noqa: E402

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def _reference(q, k, v):
    """fp64 causal attention of full ``[B, S, H, D]`` / ``[B, S, H_kv, D]`` tensors."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


def _qkv(seed, S, H, H_kv, D, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, S, h, D, generator=gen) for h in (H, H_kv, H_kv))
    return tuple(t.to(device, dtype) for t in (q, k, v))


def _attention(mesh, backend, dtype, H_kv, route="eager") -> str:
    W, device = mesh.size(), torch.device("cuda", torch.cuda.current_device())
    q, k, v = _qkv(0, 256 * W, 8, H_kv, 64, dtype, device)
    leaves = [
        dtensor_ring.shard_sequence(t.transpose(1, 2), mesh, seq_dim=2, layout="zigzag")
        .detach()
        .requires_grad_()
        for t in (q, k, v)
    ]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != 8)

    if route == "compiled":
        torch.compiler.reset()  # Dynamo does not guard SDPA's backend flags: start afresh
    fn = torch.compile(attend, fullgraph=True) if route == "compiled" else attend
    with (
        dtensor_ring.ring_sdpa(layout="zigzag"),
        sdpa_kernel([backend]),
        PassThroughMode() if route == "handlers" else contextlib.nullcontext(),
    ):
        out = fn(*leaves)
        out.float().sum().backward()
    full = dtensor_ring.unshard_sequence(out, seq_dim=2, layout="zigzag").transpose(1, 2)
    grads = all(t.grad is not None and t.grad.placements == t.placements for t in leaves)
    return f"{(full.double() - _reference(q, k, v)).abs().max().item():.2e}" + (
        "" if grads else " (grads missing)"
    )


def _tiny_model_ac(mesh, backend) -> str:
    device = torch.device("cuda", torch.cuda.current_device())
    W = mesh.size()
    torch.manual_seed(0)
    cfg = TinyConfig(dim=128, n_heads=2, n_kv_heads=2, ffn_dim=256, activation_checkpointing=True)
    ref = TinyTransformer(cfg).to(device, torch.bfloat16)
    model = copy.deepcopy(ref).set_cp_mesh(mesh)
    S = 256 * W
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    ids, pos = ids.to(device), torch.arange(S, device=device)
    with sdpa_kernel([backend]):
        (ref(ids, pos).float().square().mean() * W).backward()
        with dtensor_ring.ring_sdpa(layout="zigzag"):
            ids_l = dtensor_ring.shard_sequence(ids, mesh, 1, "zigzag").to_local()
            pos_l = dtensor_ring.shard_sequence(pos, mesh, 0, "zigzag").to_local()
            model(ids_l, pos_l).float().square().mean().backward()
    errs = []
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        g = p.grad.float()
        dist.all_reduce(g)  # sum of the cp ranks' partial gradients
        errs.append(
            (g - r.grad.float()).abs().max().item() / (r.grad.float().abs().max().item() + 1e-6)
        )
    return f"rel grad err {max(errs):.2e}"


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    rows = []

    def row(name, backend, fn, *args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - report and go on
            result = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append((name, backend.name, result))

    for backend in BACKENDS:
        for dtype, H_kv, route in (
            (torch.bfloat16, 8, "eager"),
            (torch.bfloat16, 2, "eager"),
            (torch.float32, 8, "eager"),
            (torch.float32, 2, "eager"),
            (torch.bfloat16, 8, "handlers"),
            (torch.bfloat16, 2, "handlers"),
            (torch.float32, 8, "handlers"),
            (torch.bfloat16, 2, "compiled"),
        ):
            name = f"sdpa {str(dtype)[6:]} H_kv={H_kv} {route}"
            row(name, backend, _attention, mesh, backend, dtype, H_kv, route)
        row("tiny model, eager AC", backend, _tiny_model_ac, mesh, backend)
    if dist.get_rank() == 0:
        print(
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
            f"world size {dist.get_world_size()}"
        )
        width = max(len(r[0]) for r in rows)
        for name, backend, result in rows:
            print(f"{name:<{width}} | {backend:<19} | {result}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
