# Copyright 2024 Zilin Zhu. MIT License: see LICENSE in this directory.
# From https://github.com/zhuzilin/ring-flash-attention/blob/899628238f2f/test/test_ring_flash_attn_func.py
# adapted to run on CPU against dtensor_ring (tests/test_rfa_suite.py runs it): formatted
# with ruff (layout, import order); every other change is marked "dtensor_ring:".
import sys

import torch
import torch.distributed as dist
from flash_attn import flash_attn_qkvpacked_func
from ring_flash_attn import ring_flash_attn_qkvpacked_func
from utils import log, set_seed


def main():
    dist.init_process_group("gloo")  # dtensor_ring: was "nccl"
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.float32  # dtensor_ring: CPU, fp32 (was torch.bfloat16)
    device = torch.device("cpu")  # dtensor_ring: was f"cuda:{rank}"

    batch_size = 1
    seqlen = 240  # dtensor_ring: was 3816 (CPU time); divisible by W = 2, 3, 4
    nheads = 5
    d = 128
    dropout_p = 0
    causal = True
    deterministic = False

    assert seqlen % world_size == 0
    assert d % 8 == 0

    qkv = torch.randn(
        batch_size, seqlen, 3, nheads, d, device=device, dtype=dtype, requires_grad=True
    )
    dist.broadcast(qkv, src=0)

    dout = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_qkv = qkv.chunk(world_size, dim=1)[rank].detach().clone()
    local_qkv.requires_grad = True
    local_dout = dout.chunk(world_size, dim=1)[rank].detach().clone()

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# forward:")
        print("#" * 30)

    out, lse, _ = flash_attn_qkvpacked_func(
        qkv,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    local_out = out.chunk(world_size, dim=1)[rank]
    local_lse = lse.chunk(world_size, dim=-1)[rank]

    fn = ring_flash_attn_qkvpacked_func

    ring_out, ring_lse, _ = fn(
        local_qkv,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    log("out", out, rank0_only=True)
    log("lse", lse, rank0_only=True)
    log("out diff", local_out - ring_out)
    log("lse diff", local_lse - ring_lse)

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# backward:")
        print("#" * 30)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = dqkv.chunk(world_size, dim=1)[rank]

    ring_out.backward(local_dout)
    ring_dqkv = local_qkv.grad

    log("local_dqkv", local_dqkv)
    log("dq diff", local_dqkv[:, 0] - ring_dqkv[:, 0])
    log("dk diff", local_dqkv[:, 1] - ring_dqkv[:, 1])
    log("dv diff", local_dqkv[:, 2] - ring_dqkv[:, 2])

    dist.destroy_process_group()


# dtensor_ring: not run here; tests/test_rfa_suite.py does what this block does (with
# fullgraph=True for the attention functions; the flash_attn reference stays eager)
if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compile":
        torch._dynamo.config.capture_scalar_outputs = True
        flash_attn_qkvpacked_func = torch.compile(flash_attn_qkvpacked_func)
        ring_flash_attn_qkvpacked_func = torch.compile(ring_flash_attn_qkvpacked_func)
    main()
