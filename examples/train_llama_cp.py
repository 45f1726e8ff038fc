"""Train a small Llama-style model with context parallelism (ring attention) and FSDP2.

    torchrun --nproc-per-node 4 examples/train_llama_cp.py --verify        # 4 CPU ranks (gloo)
    torchrun --nproc-per-node 8 examples/train_llama_cp.py --cuda --cp 4   # 8 GPUs (NCCL)

Parallelism: a 2-D device mesh ``(dp, cp)`` (``dp = world // cp``). Each dp row gets its own
slice of the global batch; inside a row, the ``cp`` ranks each hold ``seq // cp`` tokens of
every sequence under ``--layout`` (Note [Sequence layouts] in ``dtensor_ring/layouts.py``), and
attention is ring attention over the cp process group (the functional API on local tensors).
Everything but attention is per token, so it runs on the local shard unchanged; RoPE takes the
*global* positions of the local tokens (``dr.token_indices``).

FSDP2: ``fully_shard`` with the 2-D mesh, i.e. HSDP: parameters are sharded over the cp dim and
replicated over the dp dim. All ``dp * cp`` ranks compute gradients of the same parameters
(every rank sees different tokens), so every gradient must be *summed* over the whole mesh;
HSDP's reduce-scatter (cp) plus all-reduce (dp) *averages* it over the ``dp * cp`` ranks (a
sum needs ``set_gradient_divide_factor(1.0)``, whose pre-multiplied sum gloo lacks). Each rank
backpropagates ``world * (sum of its token losses) / (global token count)``, so the averaged
gradient is the gradient of the global mean loss, as in a single-process run.

``--verify`` trains the same model (same initial weights, same batches) in one process on
rank 0 without context parallelism afterwards, and checks the per-step losses agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import dtensor_ring as dr

RING_ATTENTION = {
    "ring": dr.ring_flash_attn_func,
    "zigzag": dr.zigzag_ring_flash_attn_func,
    "stripe": dr.stripe_flash_attn_func,
}
VERIFY_TOLERANCE = 1e-4


@dataclass
class ModelArgs:
    """Sizes: vocabulary V, model dim E, query heads H, key/value heads K (GQA), MLP dim F."""

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """``x [..., E] -> x / rms(x) * weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """``positions [S]`` (global token indices) -> ``cos, sin [S, D/2]``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, S, H, D]`` by the angles of ``cos, sin [S, D/2]`` (half-split pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal GQA self-attention; ring attention over ``cp_group`` when one is given."""

    def __init__(self, args: ModelArgs, layout: str, cp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.layout, self.cp_group = layout, cp_group

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [B, S, E]`` (S local tokens) -> ``[B, S, E]``."""
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, S, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        if self.cp_group is None:  # the whole sequence is here: plain SDPA on [B, H, S, D]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            ).transpose(1, 2)
        else:
            o = RING_ATTENTION[self.layout](q, k, v, causal=True, group=self.cp_group)
        return self.wo(o.reshape(B, S, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention and SwiGLU MLP, each with a residual."""

    def __init__(self, args: ModelArgs, layout: str, cp_group: dist.ProcessGroup | None,
                 activation_checkpointing: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layout, cp_group)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.activation_checkpointing = activation_checkpointing

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        m = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [B, S, E] -> [B, S, E]``; recomputed in backward with activation checkpointing."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """Llama-style causal LM: embedding, blocks, final norm, untied output head."""

    def __init__(self, args: ModelArgs, layout: str = "zigzag",
                 cp_group: dist.ProcessGroup | None = None,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(
            Block(args, layout, cp_group, activation_checkpointing) for _ in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``tokens [B, S]``, global ``positions [S]`` -> logits ``[B, S, V]``."""
        cos, sin = rope_tables(positions, self.args.dim // self.args.n_heads,
                               self.args.rope_theta)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.output(self.norm(h))


def synthetic_batch(step: int, batch: int, seq: int, vocab: int) -> Tensor:
    """Token ids ``[batch, seq + 1]``: row ``b`` is ``(start_b + 7 t) % vocab``, ``t = 0..seq``.

    Random starts, seeded by ``step`` (identical on every rank); the next token is a fixed
    function of the current one, so the loss falls within a few steps.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, vocab, (batch, 1), generator=gen)
    return (starts + 7 * torch.arange(seq + 1)) % vocab


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor,
               labels: Tensor, positions: Tensor, total_tokens: int,
               grad_average_size: int = 1) -> Tensor:
    """One optimizer step on local ``tokens, labels [B, S]``; returns the local loss sum.

    The loss backpropagated is ``grad_average_size * local sum / total_tokens`` (the global
    token count): averaging the gradients over ``grad_average_size`` ranks gives the gradient
    of the global mean loss.
    """
    logits = model(tokens, positions)
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    (loss_sum * (grad_average_size / total_tokens)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.detach()


def reference_losses(args: argparse.Namespace, margs: ModelArgs) -> list[float]:
    """The same training in one process on the full batch (no context parallelism)."""
    torch.manual_seed(args.seed)
    model = Transformer(margs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positions = torch.arange(args.seq)
    losses = []
    for step in range(args.steps):
        data = synthetic_batch(step, args.batch, args.seq, margs.vocab_size)
        loss_sum = train_step(model, optimizer, data[:, :-1], data[:, 1:], positions,
                              data[:, 1:].numel())
        losses.append(loss_sum.item() / data[:, 1:].numel())
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (dp = world/cp)")
    parser.add_argument("--layout", choices=dr.LAYOUTS, default="zigzag")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128, help="global sequence length")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--checkpoint", action="store_true",
                        help="activation checkpointing of each block")
    parser.add_argument("--cuda", action="store_true", help="CUDA + NCCL (default CPU + gloo)")
    parser.add_argument("--verify", action="store_true",
                        help="compare the losses with a single-process run (exit 1 if > 1e-4)")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("nccl" if args.cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.cp != 0:
        raise SystemExit(f"world size {world} is not a multiple of --cp {args.cp}")
    dp = world // args.cp
    if args.batch % dp != 0:
        raise SystemExit(f"--batch {args.batch} is not a multiple of dp = {dp}")
    mesh = init_device_mesh(device.type, (dp, args.cp), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")

    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=2 * args.dim)
    torch.manual_seed(args.seed)  # same initial weights on every rank (and in --verify)
    model = Transformer(margs, args.layout, mesh.get_group("cp"), args.checkpoint).to(device)
    for block in model.blocks:
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    positions = dr.token_indices(args.layout, args.seq, cp_rank, args.cp).to(device)
    rows = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)
    total_tokens = args.batch * args.seq
    if rank == 0:
        print(f"{world} ranks: dp={dp} x cp={args.cp} ({args.layout}), batch={args.batch}, "
              f"seq={args.seq}, dim={args.dim}, layers={args.layers}, heads={args.heads}/"
              f"{args.kv_heads}, {device.type}, compile={args.compile}, "
              f"checkpoint={args.checkpoint}", flush=True)
    losses = []
    for step in range(args.steps):
        data = synthetic_batch(step, args.batch, args.seq, args.vocab)[rows]
        tokens, labels = (dr.shard_local(t, args.layout, cp_rank, args.cp).to(device)
                          for t in (data[:, :-1], data[:, 1:]))  # shift first, then shard
        start = time.perf_counter()
        loss_sum = train_step(model, optimizer, tokens, labels, positions, total_tokens,
                              grad_average_size=world)
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - start
        losses.append(loss_sum.item() / total_tokens)
        if rank == 0:
            print(f"step {step + 1:>3}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"{total_tokens / elapsed:>9.0f} tokens/s", flush=True)

    status = 0
    if args.verify:
        if rank == 0:
            ref = reference_losses(args, margs)
            diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
            ok = diff <= VERIFY_TOLERANCE
            print(f"verify: max |loss - single-process loss| over {args.steps} steps = "
                  f"{diff:.2e} ({'OK' if ok else 'FAILED'}, tolerance {VERIFY_TOLERANCE:.0e})",
                  flush=True)
            status = 0 if ok else 1
        dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
