"""Cases of the ``recompute`` kind: activation checkpointing recomputes exactly, or raises on
every rank (Note [Recomputation outside the scope] in ``dtensor_ring/api/recompute.py``).

* :func:`recompute_case`: a training step (embedding, an attention block checkpointed by a
  :data:`CHECKPOINTERS` entry, a summed cross-entropy loss) through a scope door of
  :data:`doors.RECOMPUTE_DOORS` (``context_parallel``, ``ring_sdpa``), its backward where
  :data:`WHERE` says; the loss and every gradient (summed over the ranks) against the same
  model in one process with the oracle's attention (:func:`oracle.causal_attention`), and that
  attention was recomputed. ``context_parallel`` must be exact everywhere; ``ring_sdpa`` inside
  its scope, and a clean ``ValueError`` on every rank outside it.
* :func:`hf_recompute_case`: a tiny transformers model with ``attn_implementation=
  "dtensor_ring"`` and transformers' activation checkpointing (reentrant or not): the loss and
  every gradient against the model in one process (SDPA).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

from . import oracle
from .cases import CORRECT, ERROR, WORLDS, _hf_config, _pick
from .doors import RECOMPUTE_DOORS, Ctx, Door, open_scope, scope_attention
from .oracle import Check, Flag
from .runner import Case

V, E, H, H_KV, D, B, SCALE = 32, 16, 4, 2, 4, 2, 0.3

#: how the block is checkpointed: torch's checkpoint (reentrant, not, not without its metadata
#: check), FSDP's checkpoint_wrapper (both), the composable checkpoint, two nested checkpoints
CHECKPOINTERS = (
    "reentrant",
    "non_reentrant",
    "non_reentrant_nocheck",
    "wrapper_reentrant",
    "wrapper_non_reentrant",
    "composable",
    "nested",
)
#: where the backward runs: in the scope; after it; after it, twice (``retain_graph``); in
#: another scope of the same door (``context_parallel``: ring layout; ``ring_sdpa``: another
#: layout)
WHERE = ("inside", "after", "after_twice", "other_scope")


class _Block(nn.Module):
    """``x + wo(attention(q, k, v))``, q/k/v ``[B, H(_kv), S, D]`` projected from ``x``."""

    def __init__(self, attention, calls: list):
        super().__init__()
        self.attention, self.calls = attention, calls
        self.wq = nn.Linear(E, H * D, bias=False)
        self.wkv = nn.Linear(E, 2 * H_KV * D, bias=False)
        self.wo = nn.Linear(H * D, E, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append(1)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, H, D).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, H_KV, D).permute(2, 0, 3, 1, 4)
        out = self.attention(q, k, v)
        return x + self.wo(out.transpose(1, 2).reshape(b, s, H * D))


class _Model(nn.Module):
    """Embedding, the block checkpointed by ``checkpointer`` (None: not), output head."""

    def __init__(self, attention, checkpointer: str | None = None):
        super().__init__()
        self.calls: list = []
        self.checkpointer = checkpointer
        self.embed = nn.Embedding(V, E)
        self.block = _Block(attention, self.calls)
        self.head = nn.Linear(E, V, bias=False)
        if checkpointer in ("wrapper_reentrant", "wrapper_non_reentrant"):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl,
                checkpoint_wrapper,
            )

            impl = CheckpointImpl.REENTRANT
            if checkpointer == "wrapper_non_reentrant":
                impl = CheckpointImpl.NO_REENTRANT
            self.block = checkpoint_wrapper(self.block, checkpoint_impl=impl)
        elif checkpointer == "composable":
            from torch.distributed._composable import checkpoint

            checkpoint(self.block)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        run = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
        if self.checkpointer == "reentrant":
            x = torch_checkpoint.checkpoint(self.block, x, use_reentrant=True)
        elif self.checkpointer == "non_reentrant":
            x = run(self.block, x)
        elif self.checkpointer == "non_reentrant_nocheck":
            x = run(self.block, x, determinism_check="none")
        elif self.checkpointer == "nested":
            x = run(lambda y: run(self.block, y), x)
        else:
            x = self.block(x)
        return self.head(x)

    def loss(self, ids: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(ids).flatten(0, 1), labels.flatten(), reduction="sum")


def _batch(S: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)


def _other_layout(door: Door) -> str:
    """The layout of the other scope of ``where="other_scope"``."""
    return "ring" if door.family == "cp" or door.layout != "ring" else "zigzag"


def recompute_case(ctx: Ctx, door: Door, checkpointer: str, where: str) -> dict:
    """One training step through ``door``'s scope, the block checkpointed by
    ``checkpointer``, the backward ``where`` (:data:`WHERE`); checks against one process."""
    S = 8 * ctx.world
    torch.manual_seed(0)
    ref = _Model(functools.partial(oracle.causal_attention, scale=SCALE)).double()
    ids, labels = _batch(S)
    ref_loss = ref.loss(ids, labels)
    ref_loss.backward()
    model = _Model(scope_attention(door, ctx, SCALE), checkpointer).double()
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        p.data.copy_(p_ref.data)
    if door.family != "cp":  # ring_sdpa takes this rank's tokens (context_parallel shards)
        idx = oracle.dense_indices(door.layout, ctx.rank, ctx.world, S)
        ids, labels = ids[:, idx], labels[:, idx]
    with open_scope(door, ctx, [ids, labels]):
        loss = model.loss(ids, labels)
        if where == "inside":
            loss.backward()
    if where == "other_scope":
        with open_scope(door, ctx, [], layout=_other_layout(door)):
            loss.backward()
    elif where == "after_twice":
        loss.backward(retain_graph=True)
        model.zero_grad()
    if where in ("after", "after_twice"):
        loss.backward()
    recomputed = 2 if where == "after_twice" else 1  # at least (nested: more)
    tol = oracle.tolerance(torch.float64)
    total = loss.detach().clone()
    dist.all_reduce(total, group=ctx.group)
    checks: dict = {
        "recomputed": Flag(
            len(model.calls) >= 1 + recomputed,
            f"the block ran {len(model.calls)} times, expected 1 + {recomputed} recomputed",
        ),
        "loss": Check(total, ref_loss.detach(), torch.float64, *tol),
    }
    named = zip(model.named_parameters(), ref.parameters(), strict=True)
    for (name, p), p_ref in named:
        grad = p.grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        checks[name.replace("_checkpoint_wrapped_module.", "")] = Check(
            grad, p_ref.grad, torch.float64, *tol
        )
    return checks


def hf_recompute_case(ctx: Ctx, door: Door, reentrant: bool) -> dict:
    """A tiny transformers model through ``door`` (``attn_implementation="dtensor_ring"``)
    with transformers' activation checkpointing: the loss and the gradients (summed over the
    ranks) against the model in one process (SDPA); fp32 tolerances (transformers computes
    the loss in fp32)."""
    from transformers import AutoModelForCausalLM

    import dtensor_ring.hf as drhf

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_hf_config("llama"), attn_implementation="sdpa")
    ref = ref.double().train()
    drhf.setup(group=ctx.group, layout=door.layout)
    model = AutoModelForCausalLM.from_config(
        _hf_config("llama"), attn_implementation=drhf.ATTN_IMPLEMENTATION
    )
    model = model.double().train()
    model.load_state_dict(ref.state_dict())
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:  # transformers < 5.25
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        enable(activation_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, 64, (2, 8 * ctx.world), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    loss = model(**drhf.shard_batch(batch, group=ctx.group, layout=door.layout)).loss
    loss.backward()
    tol = oracle.tolerance(torch.float32)
    total = loss.detach().clone()
    dist.all_reduce(total, group=ctx.group)
    checks = {"loss": Check(total, ref_loss.detach().double(), torch.float32, *tol)}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        checks[name] = Check(grad, p_ref.grad, torch.float64, *tol)
    return checks


def _expect(door: Door, where: str) -> frozenset[str]:
    """``context_parallel`` recomputes exactly wherever; ``ring_sdpa`` only in its scope."""
    return CORRECT if door.family == "cp" or where == "inside" else ERROR


def recompute_cases() -> list[Case]:
    """Every checkpointer x backward place, each door of a family and the world size in turn;
    every door at every world size with the reentrant checkpoint and the backward after the
    scope (the case that was silently wrong); transformers, reentrant and not."""
    cases: list[Case] = []
    seen: set[str] = set()

    def add(door: Door, world: int, checkpointer: str, where: str) -> None:
        name = f"recompute/{door.name}/W{world}/{checkpointer},{where}"
        if name not in seen:
            seen.add(name)
            params = {"door": door, "checkpointer": checkpointer, "where": where}
            expect = _expect(door, where)
            cases.append(Case(name, "recompute", world, recompute_case, params, expect))

    for family in ("cp", "sdpa_scope"):
        doors = [d for d in RECOMPUTE_DOORS.values() if d.family == family]
        for i, (checkpointer, where) in enumerate(itertools.product(CHECKPOINTERS, WHERE)):
            if (checkpointer, where) == ("composable", "after_twice"):
                continue  # torch 2.13's composable checkpoint cannot recompute twice (its own
                # recompute context is a used generator context manager: AttributeError)
            door = _pick(doors, i)
            add(door, _pick(_worlds(door), i), checkpointer, where)
        for door in doors:
            for world in _worlds(door):
                add(door, world, "reentrant", "after")
    hf = [d for d in RECOMPUTE_DOORS.values() if d.family == "hf"]
    for i, (door, reentrant) in enumerate(itertools.product(hf, (True, False))):
        world = _pick(WORLDS, i)
        name = f"recompute/{door.name}/W{world}/reentrant={reentrant}"
        params = {"door": door, "reentrant": reentrant}
        cases.append(Case(name, "recompute", world, hf_recompute_case, params, CORRECT))
    return cases


def _worlds(door: Door) -> tuple[int, ...]:
    """Ulysses shards the H = 4 heads: world sizes dividing 4."""
    return (1, 2, 4) if door.mode == "ulysses" else WORLDS
