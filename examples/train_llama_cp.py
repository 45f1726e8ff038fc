"""Train a small Llama-style model with context parallelism (ring attention) and FSDP2.

    torchrun --nproc-per-node 4 examples/train_llama_cp.py --verify        # 4 CPU ranks (gloo)
    torchrun --nproc-per-node 4 examples/train_llama_cp.py --layout llama3 --verify  # packed
    torchrun --nproc-per-node 4 examples/train_llama_cp.py --layout documents --verify  # packed
    torchrun --nproc-per-node 4 examples/train_llama_cp.py --window 24 --verify  # sliding window
    torchrun --nproc-per-node 4 examples/train_llama_cp.py --steps 6 --check-resume 3  # DCP resume
    torchrun --nproc-per-node 8 examples/train_llama_cp.py --cuda --cp 4   # 8 GPUs (NCCL)

The model is ``dtensor_ring.testing.TinyTransformer`` (RMSNorm, RoPE, GQA, SwiGLU; the same
model the FSDP tests use). Parallelism: a 2-D device mesh ``(dp, cp)`` (``dp = world // cp``).
Each dp row gets its own slice of the global batch; inside a row, the ``cp`` ranks each hold
``seq // cp`` tokens of every sequence under ``--layout`` (Note [Sequence layouts] in
``dtensor_ring/layouts.py``). Attention is ``F.scaled_dot_product_attention`` on DTensors
sharded along the sequence over the cp mesh dim (``model.set_cp_mesh``); the training step
(forward and backward) runs inside ``dr.ring_sdpa(layout=...)``, entered outside any compiled
code (docs/composability.md), so SDPA runs ring attention. Everything but attention is per
token, so it runs on the local shard unchanged; RoPE takes the *global* positions of the local
tokens (``dr.token_indices``).

``--layout llama3``: packed documents. Each row of the batch is random-length documents back to
back, positions restarting at 0 in each document, the label of each document's last token
ignored (-100). A dp row's rows form one packed stream (``[1, T]``) cut into ``cp`` contiguous
slices; attention is ``dr.llama3_flash_attn_varlen_func`` (K/V all-gathered over the cp group)
through the model's attention hook (``model.set_attention_fn``) with this rank's metadata from
``dr.llama3_flash_attn_prepare_cu_seqlens``. ``--layout documents``: the same batches placed by
``dr.document_layout`` (whole documents on one rank where that balances, docs/varlen.md),
sharded with ``dr.shard_varlen``; attention is ``dr.ring_varlen_attention_func`` on the ring.

FSDP2: ``fully_shard`` with the 2-D mesh, i.e. HSDP: parameters are sharded over the cp dim and
replicated over the dp dim. All ``dp * cp`` ranks compute gradients of the same parameters
(every rank sees different tokens), so every gradient must be *summed* over the whole mesh;
HSDP's reduce-scatter (cp) plus all-reduce (dp) *averages* it over the ``dp * cp`` ranks (a
sum needs ``set_gradient_divide_factor(1.0)``, whose pre-multiplied sum gloo lacks). Each rank
backpropagates ``world * (sum of its token losses) / (global token count)``, so the averaged
gradient is the gradient of the global mean loss, as in a single-process run.

``--window N``: sliding-window attention, each token seeing its ``N`` latest tokens (itself
included; Mistral's ``sliding_window``): ``window_size=(N - 1, 0)`` in ``dr.ring_sdpa`` or the
llama3 call (docs/window.md).

``--verify`` trains the same model (same initial weights, same batches) in one process on
rank 0 without context parallelism afterwards (packed: attending within each document), and
checks the per-step losses agree.

Checkpoints (``torch.distributed.checkpoint``): ``--checkpoint-dir DIR --save-every N`` saves
``DIR/step-NNNNNN`` after every ``N`` steps: the model and optimizer state of
``get_state_dict`` (FSDP2: each rank writes its own shards) and the step count. ``--resume``
starts from the latest complete one (``set_state_dict`` into the freshly built model and
optimizer) and trains to ``--steps``. That is the whole state of the run: the batch of step
``i`` is a function of ``i`` (``synthetic_batch``, ``packed_batch``), and nothing draws random
numbers after the initialization (no dropout). ``--check-resume K`` proves it: it trains
``--steps`` steps, then trains again stopping after step ``K`` with a checkpoint, then builds
a new model and optimizer (from another seed), resumes from that checkpoint, trains to
``--steps``, and checks that the losses of steps ``K + 1..`` equal the uninterrupted run's
bit for bit on CPU (the same fp32 operations and gloo reductions in the same order).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_ring as dr
from dtensor_ring.testing import TinyConfig, TinyTransformer

LAYOUTS = (*dr.LAYOUTS, "llama3", "documents")
PACKED = ("llama3", "documents")  # packed documents (varlen attention)
VERIFY_TOLERANCE = 1e-4
IGNORE = -100  # label of a token that predicts nothing (a document's last token)


def synthetic_batch(step: int, batch: int, seq: int, vocab: int) -> Tensor:
    """Token ids ``[batch, seq + 1]``: row ``b`` is ``(start_b + 7 t) % vocab``, ``t = 0..seq``.

    Random starts, seeded by ``step`` (identical on every rank); the next token is a fixed
    function of the current one, so the loss falls within a few steps.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, vocab, (batch, 1), generator=gen)
    return (starts + 7 * torch.arange(seq + 1)) % vocab


def packed_batch(
    step: int, batch: int, seq: int, vocab: int
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """Packed documents: ``tokens, labels, positions [batch, seq]`` and document boundaries.

    Each row is documents of random length in ``[8, seq // 2]`` (the last one cut to fit) back
    to back, each ``(start + 7 t) % vocab`` with its own random start; labels are the next
    token of the same document (``IGNORE`` at its last token), positions restart at 0. The
    boundaries (``cu_seqlens``) are those of the ``batch * seq`` stream of the rows in order.
    """
    gen = torch.Generator().manual_seed(2000 + step)
    tokens, labels, positions = (torch.empty(batch, seq, dtype=torch.long) for _ in range(3))
    bounds = [0]
    for b in range(batch):
        t = 0
        while t < seq:
            n = min(int(torch.randint(8, seq // 2 + 1, (1,), generator=gen)), seq - t)
            doc = (torch.randint(0, vocab, (1,), generator=gen) + 7 * torch.arange(n + 1)) % vocab
            tokens[b, t : t + n], labels[b, t : t + n] = doc[:-1], doc[1:]
            labels[b, t + n - 1] = IGNORE
            positions[b, t : t + n] = torch.arange(n)
            t += n
            bounds.append(b * seq + t)
    return tokens, labels, positions, bounds


def documents_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup,
    window_size: tuple[int, int],
    layout: dr.Layout,
    cu_seqlens: Tensor,
) -> Tensor:
    """``q [1, T_local, H, D]``, ``k, v [1, T_local, K, D]``: this rank's documents under
    ``dr.document_layout`` (whole where that balances), ring varlen attention over them;
    ``cu_seqlens`` the rank's local boundaries (``dr.shard_varlen``'s)."""
    return dr.ring_varlen_attention_func(
        layout, q[0], k[0], v[0], cu_seqlens, None, causal=True, window_size=window_size,
        group=group,
    )[None]  # fmt: skip


def llama3_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup,
    window_size: tuple[int, int],
    **meta,
) -> Tensor:
    """``q [1, T_local, H, D]``, ``k, v [1, T_local, K, D]``: this rank's contiguous slice of the
    packed stream; ``meta`` from ``dr.llama3_flash_attn_prepare_cu_seqlens`` (see ``main``)."""
    return dr.llama3_flash_attn_varlen_func(
        q[0],
        k[0],
        v[0],
        meta["cu_seqlens_q"],
        meta["cu_seqlens_k"],
        meta["max_seqlen_q"],
        meta["max_seqlen_k"],
        k.shape[2],
        meta["local_k_slice"],
        causal=True,
        window_size=window_size,
        group=group,
    ).unsqueeze(0)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int = 0) -> Tensor:
    """The single-process reference on ``[B, S, H, D]``: causal SDPA, each query seeing its
    ``window`` latest keys if ``window`` (a boolean band mask)."""
    mask = None
    if window:
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(q.shape[1])[None, :]
        mask = (j <= i) & (j > i - window)
    return F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    ).transpose(1, 2)


def per_document_attention(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: list[int], window: int = 0
) -> Tensor:
    """The single-process reference: :func:`causal_attention` within each document of the
    ``[1, T]`` stream."""
    return torch.cat(
        [
            causal_attention(*(t[:, a:b] for t in (q, k, v)), window=window)
            for a, b in itertools.pairwise(cu_seqlens)
        ],
        dim=1,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Tensor,
    labels: Tensor,
    positions: Tensor,
    total_tokens: int,
    grad_average_size: int = 1,
    **attn_kwargs,
) -> Tensor:
    """One optimizer step on local ``tokens, labels [B, S]``; returns the local loss sum.

    The loss backpropagated is ``grad_average_size * local sum / total_tokens`` (the global
    count of labels, ``IGNORE`` not counted): averaging the gradients over
    ``grad_average_size`` ranks gives the gradient of the global mean loss.
    """
    logits = model(tokens, positions, **attn_kwargs)
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE
    )
    (loss_sum * (grad_average_size / total_tokens)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.detach()


def reference_losses(args: argparse.Namespace, cfg: TinyConfig) -> list[float]:
    """The same training in one process on the full batch (no context parallelism)."""
    torch.manual_seed(args.seed)
    model = TinyTransformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        if args.layout in PACKED:  # the whole batch as one packed stream
            tokens, labels, positions, bounds = packed_batch(step, args.batch, args.seq, args.vocab)
            model.set_attention_fn(
                functools.partial(per_document_attention, cu_seqlens=bounds, window=args.window)
            )
            tokens, labels, positions = (t.reshape(1, -1) for t in (tokens, labels, positions))
            positions = positions[0]
        else:
            if args.window:
                model.set_attention_fn(functools.partial(causal_attention, window=args.window))
            data = synthetic_batch(step, args.batch, args.seq, args.vocab)
            tokens, labels, positions = data[:, :-1], data[:, 1:], torch.arange(args.seq)
        count = int((labels != IGNORE).sum())
        loss_sum = train_step(model, optimizer, tokens, labels, positions, count)
        losses.append(loss_sum.item() / count)
    return losses


def save_checkpoint(
    directory: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> str:
    """Save the model, the optimizer and ``step`` to ``directory/step-NNNNNN`` (collective)."""
    path = os.path.join(directory, f"step-{step:06d}")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=path)
    return path


def load_checkpoint(
    directory: str, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, str | None]:
    """Load the latest complete checkpoint in ``directory`` (collective); ``(its step, path)``,
    ``(0, None)`` if there is none."""
    names = sorted(
        name
        for name in (os.listdir(directory) if os.path.isdir(directory) else ())
        if name.startswith("step-") and os.path.exists(os.path.join(directory, name, ".metadata"))
    )
    latest = [os.path.join(directory, names[-1]) if names else None]
    dist.broadcast_object_list(latest)  # rank 0's view: every rank loads the same one
    if latest[0] is None:
        return 0, None
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=latest[0])
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state["step"], latest[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (dp = world/cp)")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="zigzag",
        help="sequence layout; llama3, documents: packed documents (varlen)",
    )
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
    parser.add_argument(
        "--checkpoint", action="store_true", help="activation checkpointing of each block"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="sliding window: each token sees its N latest tokens (0: none)",
    )
    parser.add_argument("--cuda", action="store_true", help="CUDA + NCCL (default CPU + gloo)")
    parser.add_argument(
        "--checkpoint-dir", help="where checkpoints go (torch.distributed.checkpoint)"
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="save a checkpoint after every N steps (0: never)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--verify",
        action="store_true",
        help="compare the losses with a single-process run (exit 1 if > 1e-4)",
    )
    mode.add_argument(
        "--check-resume",
        type=int,
        default=0,
        metavar="K",
        help="train, then stop after step K with a checkpoint, resume from it, and compare the "
        "losses (exit 1 unless equal); in a temporary folder (inside --checkpoint-dir if given)",
    )
    args = parser.parse_args(argv)
    if (args.save_every or args.resume) and not args.checkpoint_dir:
        parser.error("--save-every and --resume need --checkpoint-dir")
    if not 0 <= args.check_resume < args.steps:
        parser.error(f"--check-resume needs 0 < K < --steps {args.steps}")
    if args.check_resume and (args.save_every or args.resume):
        parser.error("--check-resume makes its own checkpoints: no --save-every or --resume")
    return args


def build(
    args: argparse.Namespace, cfg: TinyConfig, mesh: DeviceMesh, device: torch.device, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (initialized from ``seed``, FSDP2 on ``mesh``) and its optimizer."""
    torch.manual_seed(seed)  # same initial weights on every rank (and in --verify)
    model = TinyTransformer(cfg).to(device)
    if args.layout in PACKED:
        window_size = (args.window - 1, 0) if args.window else (-1, -1)
        attend = llama3_attention if args.layout == "llama3" else documents_attention
        model.set_attention_fn(
            functools.partial(attend, group=mesh.get_group("cp"), window_size=window_size)
        )
    else:
        model.set_cp_mesh(mesh["cp"])
    for block in model.layers:
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    device: torch.device,
    steps: range,
    save_every: int = 0,
) -> list[float]:
    """Train ``steps`` (0-based step numbers); the global mean loss of each step.

    With ``save_every``, saves a checkpoint in ``--checkpoint-dir`` after every
    ``save_every`` steps.
    """
    world, rank = mesh.size(), dist.get_rank()
    dp, cp_rank = mesh.size(0), mesh.get_local_rank("cp")
    window_size = (args.window - 1, 0) if args.window else (-1, -1)
    dp_rank = mesh.get_local_rank("dp")
    rows = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)
    losses = []
    for step in steps:
        attn_kwargs = {}
        if args.layout == "documents":  # this dp row's rows as one stream; this cp rank's docs
            tokens, labels, positions, bounds = packed_batch(step, args.batch, args.seq, args.vocab)
            total_tokens = int((labels != IGNORE).sum())
            lo, hi = rows.start * args.seq, rows.stop * args.seq
            cu_seqlens = [b - lo for b in bounds if lo <= b <= hi]
            layout = dr.document_layout(cu_seqlens, args.cp, window_size=window_size)
            tokens, labels, positions = (
                dr.shard_varlen(t[rows].reshape(-1), cu_seqlens, layout, cp_rank, args.cp)[0]
                .reshape(1, -1)
                .to(device)
                for t in (tokens, labels, positions)
            )
            positions = positions[0]
            local_cu = dr.varlen_local_cu_seqlens(cu_seqlens, layout, cp_rank, args.cp)
            attn_kwargs = dict(layout=layout, cu_seqlens=local_cu.to(device))
            scope = contextlib.nullcontext()
        elif args.layout == "llama3":  # this dp row's rows as one stream; this cp rank's slice
            tokens, labels, positions, bounds = packed_batch(step, args.batch, args.seq, args.vocab)
            total_tokens = int((labels != IGNORE).sum())
            lo, hi = rows.start * args.seq, rows.stop * args.seq
            cu_seqlens = torch.tensor(
                [b - lo for b in bounds if lo <= b <= hi], dtype=torch.int32, device=device
            )
            names = (
                "cu_seqlens_q",
                "cu_seqlens_k",
                "max_seqlen_q",
                "max_seqlen_k",
                "local_k_slice",
            )
            attn_kwargs = dict(
                zip(
                    names,
                    dr.llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, cp_rank, args.cp),
                    strict=True,
                )
            )
            length = (hi - lo) // args.cp
            mine = slice(cp_rank * length, (cp_rank + 1) * length)
            tokens, labels, positions = (
                t[rows].reshape(1, -1)[:, mine].to(device) for t in (tokens, labels, positions)
            )
            positions = positions[0]
            scope = contextlib.nullcontext()
        else:
            data = synthetic_batch(step, args.batch, args.seq, args.vocab)[rows]
            tokens, labels = (
                dr.shard_local(t, args.layout, cp_rank, args.cp).to(device)
                for t in (data[:, :-1], data[:, 1:])
            )  # shift first, then shard
            positions = dr.token_indices(args.layout, args.seq, cp_rank, args.cp).to(device)
            total_tokens = args.batch * args.seq
            # around the step, outside compiled code
            scope = dr.ring_sdpa(layout=args.layout, window_size=window_size)
        start = time.perf_counter()
        with scope:
            loss_sum = train_step(
                model,
                optimizer,
                tokens,
                labels,
                positions,
                total_tokens,
                grad_average_size=world,
                **attn_kwargs,
            )
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - start
        losses.append(loss_sum.item() / total_tokens)
        if rank == 0:
            print(
                f"step {step + 1:>3}/{args.steps}  loss {losses[-1]:.4f}  "
                f"{args.batch * args.seq / elapsed:>9.0f} tokens/s",
                flush=True,
            )
        if save_every and (step + 1) % save_every == 0:
            tic = time.perf_counter()
            path = save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer)
            if rank == 0:
                print(f"saved {path} ({time.perf_counter() - tic:.2f} s)", flush=True)
    return losses


def check_resume(
    args: argparse.Namespace, cfg: TinyConfig, mesh: DeviceMesh, device: torch.device
) -> bool:
    """``--check-resume K``: the losses of steps ``K + 1..`` after a resume from step ``K``
    against those of the uninterrupted run; exact on CPU, ``VERIFY_TOLERANCE`` with CUDA (whose
    kernels, e.g. atomics in attention backward, need not repeat bit for bit)."""
    rank, k = dist.get_rank(), args.check_resume
    folder = [
        tempfile.mkdtemp(prefix="check-resume-", dir=args.checkpoint_dir) if rank == 0 else None
    ]
    dist.broadcast_object_list(folder)
    args.checkpoint_dir = folder[0]
    if rank == 0:
        print(f"check-resume: {args.steps} steps uninterrupted", flush=True)
    model, optimizer = build(args, cfg, mesh, device, args.seed)
    expected = train(args, model, optimizer, mesh, device, range(args.steps))[k:]
    if rank == 0:
        print(f"check-resume: again, stopping after step {k}", flush=True)
    model, optimizer = build(args, cfg, mesh, device, args.seed)
    train(args, model, optimizer, mesh, device, range(k), save_every=k)
    model, optimizer = build(args, cfg, mesh, device, args.seed + 1)  # only the load can match
    start, path = load_checkpoint(args.checkpoint_dir, model, optimizer)
    if start != k:
        raise RuntimeError(f"resumed at step {start} from {path}, expected step {k}")
    if rank == 0:
        print(f"check-resume: new model and optimizer, resumed from {path}", flush=True)
    resumed = train(args, model, optimizer, mesh, device, range(k, args.steps))
    diff = max(abs(a - b) for a, b in zip(resumed, expected, strict=True))
    tolerance = VERIFY_TOLERANCE if args.cuda else 0.0
    if rank == 0:
        print(f"check-resume: uninterrupted losses {expected}", flush=True)
        print(f"check-resume: resumed losses {resumed}", flush=True)
        print(
            f"check-resume: max |resumed - uninterrupted loss| over steps {k + 1}..{args.steps}"
            f" = {diff:.2e} ({'OK' if diff <= tolerance else 'FAILED'}, tolerance {tolerance:.0e})",
            flush=True,
        )
    dist.barrier()  # every rank is done with the checkpoint
    if rank == 0:
        shutil.rmtree(args.checkpoint_dir)
    return diff <= tolerance


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

    cfg = TinyConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=2 * args.dim,
        activation_checkpointing=args.checkpoint,
    )
    if rank == 0:
        print(
            f"{world} ranks: dp={dp} x cp={args.cp} ({args.layout}), batch={args.batch}, "
            f"seq={args.seq}, dim={args.dim}, layers={args.layers}, heads={args.heads}/"
            f"{args.kv_heads}, {device.type}, compile={args.compile}, "
            f"checkpoint={args.checkpoint}, window={args.window or 'none'}",
            flush=True,
        )
    status = 0
    if args.check_resume:
        status = 0 if check_resume(args, cfg, mesh, device) else 1
    else:
        model, optimizer = build(args, cfg, mesh, device, args.seed)
        start = 0
        if args.resume:
            start, path = load_checkpoint(args.checkpoint_dir, model, optimizer)
            if rank == 0:
                print(
                    f"resumed from {path} at step {start}" if path else "no checkpoint yet",
                    flush=True,
                )
        losses = train(
            args, model, optimizer, mesh, device, range(start, args.steps), args.save_every
        )
        if args.verify:
            if rank == 0:
                ref = reference_losses(args, cfg)[start:]
                diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
                ok = diff <= VERIFY_TOLERANCE
                print(
                    f"verify: max |loss - single-process loss| over {len(losses)} steps = "
                    f"{diff:.2e} ({'OK' if ok else 'FAILED'}, tolerance {VERIFY_TOLERANCE:.0e})",
                    flush=True,
                )
                status = 0 if ok else 1
            dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
