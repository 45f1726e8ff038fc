"""torchtitan's Llama 3 (its debug flavour) trained with context parallelism through
dtensor_ring, against the same model without CP.

    pip install torchtitan==0.3.0 spmd_types==0.2.3 triton   # torchtitan's own imports
    python examples/torchtitan_cp.py                          # 2 CPU ranks (gloo), flex
    python examples/torchtitan_cp.py --attention sdpa --world-size 3
    python examples/torchtitan_cp.py --attention varlen --world-size 3
    python examples/torchtitan_cp.py --balancer ptrr          # the mask-aware layout
    python examples/torchtitan_cp.py --attention varlen --balancer ptrr   # document_layout
    python examples/torchtitan_cp.py --balancer ptrr --algorithm all_gather   # fetch what is needed
    python examples/torchtitan_cp.py --device cuda --world-size 1   # one GPU a rank (nccl)

The lines a torchtitan user changes (Note [torchtitan on the ring] in
``dtensor_ring/integrations/torchtitan.py``) are the import of torchtitan's two CP functions:

    from dtensor_ring.integrations.torchtitan import (
        apply_cp_to_forward, prepare_context_parallel_input)

then, as torchtitan's trainer does: ``apply_cp_to_forward(inner_attention_modules, cp_mesh)``
once, and every step ``prepare_context_parallel_input(inputs, labels, {"positions": ...,
"attention_masks": model.get_attention_masks(positions)}, cp_mesh, device, balancer)`` before
the forward. The attention masks are built from the whole batch, as torchtitan builds them.

Each rank runs ``--steps`` AdamW steps on its shard of one packed batch of three documents
(per-document positions and torchtitan's document mask for "flex", its ``VarlenMetadata`` for
"varlen"; causal over the row for "sdpa"); the
gradients are summed over the CP ranks (what torchtitan's FSDP does over its dp_shard_cp
mesh). Rank 0 prints each step's loss next to the no-CP model's, and the largest relative
gradient difference; the run fails unless both are <= 1e-5 (fp32). On CPU the no-CP model's
FlexAttention and varlen attention run as explicit-mask SDPA (torchtitan's compiled flex has no
CPU backward, its varlen attention needs CUDA); on CUDA they are torchtitan's own modules
unless ``--explicit-reference`` (its varlen attention computes in bf16: compare it with
``--tolerance`` of bf16's order, or use the explicit reference).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import create_mask

from dtensor_ring.integrations.torchtitan import (
    apply_cp_to_forward,
    prepare_context_parallel_input,
)

DOCUMENTS = (96, 60, 84)  # one packed row of 240 tokens (zigzag: divisible by 2W up to W = 6)


def build_model(attention: str) -> torch.nn.Module:
    """torchtitan's Llama 3 debug model; "sdpa": its ScaledDotProductAttention modules swapped
    in (torchtitan 0.3 builds language models with flex or varlen only)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    backend = "varlen" if attention == "varlen" else "flex"
    model = model_registry("debugmodel", attn_backend=backend).model.build()
    if attention == "sdpa":
        for layer in model.layers.values():
            layer.attention.inner_attention = ScaledDotProductAttention(
                ScaledDotProductAttention.Config()
            )
    return model


def inner_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.attention.inner_attention for layer in model.layers.values()]


def explicit_mask_flex(q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False):
    """torchtitan's FlexAttention forward as SDPA with the mask evaluated (the CPU no-CP run)."""
    B, L = q_BLNH.shape[:2]
    mask = create_mask(attention_masks.mask_mod, B, 1, L, L, q_BLNH.device)
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)


def explicit_mask_varlen(q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, **kwargs):
    """torchtitan's causal VarlenAttention forward as SDPA with the documents' mask (the CPU
    no-CP run: its varlen attention needs CUDA)."""
    B, L = q_BLNH.shape[:2]
    bounds = attention_masks.cu_seq_q.long()
    tokens = torch.arange(B * L, device=bounds.device)
    doc = torch.searchsorted(bounds, tokens, right=True).view(B, 1, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=bounds.device).tril()
    mask = (doc[..., :, None] == doc[..., None, :]) & causal
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=kwargs.get("enable_gqa", False),
    )
    return out.transpose(1, 2)


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (1, sum(DOCUMENTS) + 1), generator=gen)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device), positions.to(device)


def step_inputs(model, attention, inputs, labels, positions):
    """torchtitan's per-step inputs: flex / varlen, per-document positions and its document
    mask / VarlenMetadata; sdpa (causal over the whole row), sequential positions and no mask."""
    if attention == "sdpa":
        positions = torch.arange(positions.shape[1], device=positions.device)[None]
        return inputs, labels, {"positions": positions, "attention_masks": None}
    masks = model.get_attention_masks(positions)
    return inputs, labels, {"positions": positions, "attention_masks": masks}


def loss_sum(model, inputs, labels, extra) -> torch.Tensor:
    logits = model(inputs, positions=extra["positions"], attention_masks=extra["attention_masks"])
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def run(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    mesh = DeviceMesh(device.type, list(range(world_size)))
    reference = build_model(args.attention).to(device)
    model = copy.deepcopy(reference)
    if (device.type == "cpu" or args.explicit_reference) and args.attention != "sdpa":
        for module in inner_attention_modules(reference):
            module.forward = {"flex": explicit_mask_flex, "varlen": explicit_mask_varlen}[
                args.attention
            ]
    apply_cp_to_forward(inner_attention_modules(model), mesh, algorithm=args.algorithm)  # <- CP
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    inputs, labels, positions = batch(device)
    n_tokens = labels.numel()
    worst_grad = 0.0
    for step in range(args.steps):
        ref_loss = loss_sum(reference, *step_inputs(reference, args.attention, inputs, labels,
                                                    positions)) / n_tokens  # fmt: skip
        ref_loss.backward()
        cp_in, cp_labels, extra = prepare_context_parallel_input(
            *step_inputs(model, args.attention, inputs, labels, positions),
            mesh, device, args.balancer,
        )  # fmt: skip
        cp_loss = loss_sum(model, cp_in, cp_labels, extra) / n_tokens
        cp_loss.backward()
        dist.all_reduce(cp_loss_total := cp_loss.detach().clone())
        for p in model.parameters():
            dist.all_reduce(p.grad)
        for p_ref, p_cp in zip(reference.parameters(), model.parameters(), strict=True):
            diff = (p_cp.grad - p_ref.grad).norm() / p_ref.grad.norm().clamp_min(1e-30)
            worst_grad = max(worst_grad, float(diff))
        ref_loss = ref_loss.item()
        rel = abs(cp_loss_total.item() - ref_loss) / abs(ref_loss)
        if rank == 0:
            print(
                f"step {step}: loss {ref_loss:.6f} (no CP) {cp_loss_total.item():.6f} "
                f"(CP, W = {world_size}); relative difference {rel:.1e}",
                flush=True,
            )
        assert rel <= args.tolerance, rel
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if rank == 0:
        print(f"largest relative gradient difference: {worst_grad:.1e}")
    assert worst_grad <= args.tolerance, worst_grad
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("flex", "sdpa", "varlen"), default="flex")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="a GPU a rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--balancer", choices=("headtail", "ptrr", "none"), default="headtail")
    parser.add_argument(
        "--algorithm",
        choices=("ring", "all_gather"),
        default="ring",
        help="all_gather: the documents by the all-gather of the keys each rank needs",
    )
    parser.add_argument(
        "--explicit-reference",
        action="store_true",
        help="the no-CP model's flex / varlen as explicit-mask SDPA (always on CPU)",
    )
    parser.add_argument("--tolerance", type=float, default=1e-5, help="relative, loss and grads")
    args = parser.parse_args()
    args.balancer = None if args.balancer == "none" else args.balancer
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.world_size, args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
