# Copyright 2024 Zilin Zhu. MIT License: see LICENSE in this directory.
# From https://github.com/zhuzilin/ring-flash-attention/blob/899628238f2f/test/test_zigzag_ring_flash_attn_varlen_func.py
# adapted to run on CPU against dtensor_ring (tests/test_rfa_suite.py runs it): formatted
# with ruff (layout, import order); every other change is marked "dtensor_ring:".
import sys

import torch
import torch.distributed as dist
from flash_attn import flash_attn_varlen_qkvpacked_func
from ring_flash_attn import zigzag_ring_flash_attn_varlen_qkvpacked_func
from utils import log, set_seed


def extract_local(value, cu_seqlens, rank, world_size):
    local_values = []
    for i in range(len(cu_seqlens) - 1):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        local_value = value[start:end].chunk(2 * world_size, dim=0)
        local_values.extend(
            [
                local_value[rank].detach().clone(),
                local_value[2 * world_size - 1 - rank].detach().clone(),
            ]
        )
    return torch.cat(local_values, dim=0).contiguous()


def extract_lse(lse, cu_seqlens):
    values = []
    if lse.dim() == 2:
        for i in range(len(cu_seqlens) - 1):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            value = lse[:, start:end]
            values.append(value)
    else:
        assert lse.dim() == 3
        for i in range(len(cu_seqlens) - 1):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            value = lse[i, :, : end - start]
            values.append(value)
    return values


def main():
    dist.init_process_group("gloo")  # dtensor_ring: was "nccl"
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.float32  # dtensor_ring: CPU, fp32 (was torch.bfloat16)
    device = torch.device("cpu")  # dtensor_ring: was f"cuda:{rank}"

    nheads = 5
    d = 128
    dropout_p = 0
    causal = True
    deterministic = False

    # dtensor_ring: was [0, 128, 1248, 4240] (CPU time); divisible by 2 * W for W = 2, 3, 4
    cu_seqlens = [0, 24, 96, 264]
    cu_seqlens_tensor = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    max_seqlen = (cu_seqlens_tensor[1:] - cu_seqlens_tensor[:-1]).max().item()
    total_length = cu_seqlens[-1]

    assert torch.all(cu_seqlens_tensor % (2 * world_size) == 0)
    assert d % 8 == 0

    qkv = torch.randn(total_length, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dist.broadcast(qkv, src=0)

    dout = torch.randn(total_length, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_cu_seqlens_tensor = cu_seqlens_tensor // world_size
    local_max_seqlen = max_seqlen // world_size

    local_qkv = extract_local(qkv, cu_seqlens, rank, world_size)
    local_qkv.requires_grad = True
    local_dout = extract_local(dout, cu_seqlens, rank, world_size)

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# forward:")
        print("#" * 30)

    out, lse, _ = flash_attn_varlen_qkvpacked_func(
        qkv,
        cu_seqlens_tensor,
        max_seqlen,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    local_out = extract_local(out, cu_seqlens, rank, world_size)
    lse_list = extract_lse(lse, cu_seqlens)

    ring_out, ring_lse, _ = zigzag_ring_flash_attn_varlen_qkvpacked_func(
        local_qkv,
        local_cu_seqlens_tensor,
        local_max_seqlen,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    ring_lse_list = extract_lse(ring_lse, local_cu_seqlens_tensor.tolist())

    log("out", out, rank0_only=True)
    log("out diff", local_out - ring_out)

    for i, (lse, ring_lse) in enumerate(
        zip(lse_list, ring_lse_list, strict=True)
    ):  # dtensor_ring: strict
        local_lse = lse.chunk(2 * world_size, dim=-1)
        local_lse = torch.cat([local_lse[rank], local_lse[2 * world_size - 1 - rank]], dim=-1)
        log(f"lse {i}", lse, rank0_only=True)
        log(f"lse diff {i}", local_lse - ring_lse)

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# backward:")
        print("#" * 30)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = extract_local(dqkv, cu_seqlens, rank, world_size)

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
        flash_attn_varlen_qkvpacked_func = torch.compile(flash_attn_varlen_qkvpacked_func)
        zigzag_ring_flash_attn_varlen_qkvpacked_func = torch.compile(
            zigzag_ring_flash_attn_varlen_qkvpacked_func
        )
    main()
