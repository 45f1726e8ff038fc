"""``dtensor_ring.context_parallel`` / ``context_parallel_unshard``: PyTorch's context-parallel
API on ring attention.

A training step written against PyTorch's API (buffers ``ids [B, S]``, ``labels [B, S]``,
``positions [S]`` sharded in place, ``F.scaled_dot_product_attention`` on plain local tensors)
gives, after unshard, the output, loss and gradients of the same step in one process (fp64),
at 1-4 ranks, causal and not, in the default layout (PyTorch's head-tail order, or contiguous
when ``S % 2W != 0``) and the others; buffers come back on exit unless in
``no_restore_buffers``. FSDP2 over the same 1-D mesh matches a single-process run. Unsupported
SDPA arguments raise ``ValueError``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_spy import engines_used
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtensor_ring
from dtensor_ring.testing import TinyConfig, TinyTransformer

V, E, H, H_KV, D, B = 32, 16, 4, 2, 4, 2


class _Model(nn.Module):
    """Embeddings, one GQA attention through SDPA, output head: ``ids [B, S]``, ``pos [S]`` ->
    ``(logits [B, S, V], attention out [B, H, S, D])``."""

    def __init__(self, S: int, causal: bool):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(V, E)
        self.pos = nn.Embedding(S, E)
        self.wq = nn.Linear(E, H * D, bias=False)
        self.wkv = nn.Linear(E, 2 * H_KV * D, bias=False)
        self.head = nn.Linear(H * D, V, bias=False)

    def forward(self, ids: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(ids) + self.pos(pos)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, H, D).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, H_KV, D).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=0.3, enable_gqa=True
        )
        return self.head(out.transpose(1, 2).reshape(b, s, H * D)), out


def _head_tail(S: int, W: int, rank: int) -> Tensor:
    """PyTorch's head-tail load balancing: rank r holds chunks r and 2W-1-r of 2W."""
    chunks = torch.arange(S).view(2 * W, S // (2 * W))
    return torch.cat([chunks[rank], chunks[2 * W - 1 - rank]])


def _max_err(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


def _training_step(group, S, causal, layout, no_restore, backward_inside):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    ref = _Model(S, causal).double()
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    pos = torch.arange(S)
    ids_full, labels_full = ids.clone(), labels.clone()

    ref_logits, ref_out = ref(ids, pos)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref_loss.backward()

    kept = {"none": set(), "ids": {ids}, "all": {ids, labels, pos}}[no_restore]
    with dtensor_ring.context_parallel(
        mesh,
        buffers=[ids, labels, pos],
        buffer_seq_dims=[1, 1, 0],
        no_restore_buffers=kept,
        **({} if layout is None else {"layout": layout}),
    ):
        sharded = (ids.clone(), pos.clone())
        with engines_used() as used:
            logits, out = model(ids, pos)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            if backward_inside:
                loss.backward()
        (full_out,) = dtensor_ring.context_parallel_unshard(
            mesh, [out], [2], **({} if layout is None else {"layout": layout})
        )
    if not backward_inside:
        with engines_used() as used_after:
            loss.backward()
        used |= used_after
    if layout == "auto":  # one of ring, all-gather (the llama3 op), Ulysses
        assert len(used) == 1 and used <= {"ring", "llama3", "ulysses"}, used
    else:
        assert used == ({"llama3"} if layout == "llama3_zigzag" else {"ring"}), (layout, used)

    effective = layout or ("zigzag" if S % (2 * W) == 0 else "ring")
    expected_idx = (
        _head_tail(S, W, rank)  # llama3_zigzag holds zigzag's (head-tail) tokens
        if effective in ("zigzag", "llama3_zigzag", "auto")
        else dtensor_ring.token_indices(effective, S, rank, W)
    )
    errors = {
        "ids shard": _max_err(sharded[0], ids_full[:, expected_idx]),
        "pos shard": _max_err(sharded[1], expected_idx),
        "out": _max_err(full_out, ref_out),
        "ids after": _max_err(ids, ids_full[:, expected_idx] if ids in kept else ids_full),
        "labels after": _max_err(
            labels, labels_full[:, expected_idx] if labels in kept else labels_full
        ),
        "pos after": _max_err(pos, expected_idx if pos in kept else torch.arange(S)),
    }
    dist.all_reduce(loss.detach(), group=group)
    errors["loss"] = abs(loss.item() - ref_loss.item())
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        dist.all_reduce(p.grad, group=group)
        errors[f"grad {name}"] = _max_err(p.grad, ref_p.grad)
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "S,causal,layout,no_restore,backward_inside",
    [
        (24, True, None, "none", True),  # head-tail (zigzag) at every world size
        (24, False, None, "ids", True),
        # 12 % 2W != 0 at W = 4: contiguous ("ring"). Backward after the context needs the
        # buffers that autograd saved (embedding indices, labels) left sharded, as in PyTorch.
        (12, True, None, "all", False),
        (12, True, "stripe", "all", False),
        (12, False, "ring", "none", True),
        # zigzag's tokens, K/V all-gathered (the llama3 op), causal and not
        (24, True, "llama3_zigzag", "none", True),
        (24, False, "llama3_zigzag", "all", False),
        # zigzag's tokens, ring / all-gather / Ulysses chosen by the cost model
        (24, True, "auto", "none", True),
    ],
    ids=[
        "default-causal",
        "default-bidir-norestore",
        "default-S12",
        "stripe",
        "ring-bidir",
        "llama3_zigzag",
        "llama3_zigzag-bidir",
        "auto",
    ],
)
def test_training_step_matches_single_process(
    dist_pool, world_size, S, causal, layout, no_restore, backward_inside
):
    results = dist_pool.run(
        _training_step,
        world_size,
        S=S,
        causal=causal,
        layout=layout,
        no_restore=no_restore,
        backward_inside=backward_inside,
    )
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            assert err < 1e-10, (rank, name, err, errors)


def _errors(group) -> dict[str, str]:
    mesh = DeviceMesh.from_group(group, "cpu")
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    calls = {
        "attn_mask": lambda: F.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(4, 4 * 2, dtype=torch.bool)
        ),
        "dropout": lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        "gqa": lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True),
        "3-D": lambda: F.scaled_dot_product_attention(q[0], q[0], q[0], is_causal=True),
    }
    messages = {}
    with dtensor_ring.context_parallel(mesh):
        for name, call in calls.items():
            with pytest.raises(ValueError) as info:
                call()
            messages[name] = str(info.value)
    x = torch.zeros(2, 8)
    bad_contexts = {
        "seq dims": dict(buffers=[x], buffer_seq_dims=[1, 0]),
        "no_restore": dict(buffers=[x], buffer_seq_dims=[1], no_restore_buffers={x.clone()}),
        "parameter": dict(buffers=[nn.Parameter(x)], buffer_seq_dims=[1]),
        "indivisible": dict(buffers=[torch.zeros(2, 7)], buffer_seq_dims=[1]),
        "layout": dict(buffers=[x], buffer_seq_dims=[1], layout="nope"),
    }
    for name, kwargs in bad_contexts.items():
        with pytest.raises(ValueError) as info:
            with dtensor_ring.context_parallel(mesh, **kwargs):
                pass
        messages[name] = str(info.value)
    assert x.shape == (2, 8)
    mesh_2d = DeviceMesh("cpu", torch.arange(dist.get_world_size()).view(2, -1))
    with pytest.raises(ValueError) as info:
        dtensor_ring.context_parallel_unshard(mesh_2d, [x], [1])
    messages["2-D mesh"] = str(info.value)
    return messages


def test_unsupported_arguments_raise(dist_pool):
    for messages in dist_pool.run(_errors, 4):
        assert "attn_mask" in messages["attn_mask"]
        assert "dropout_p" in messages["dropout"]
        assert "enable_gqa" in messages["gqa"]
        assert "4-D" in messages["3-D"]
        assert "buffer_seq_dims" in messages["seq dims"]
        assert "subset" in messages["no_restore"]
        assert "Parameter" in messages["parameter"]
        assert "divisible" in messages["indivisible"]
        assert "nope" in messages["layout"]
        assert "1-D DeviceMesh" in messages["2-D mesh"]


def _unsharded_query(group) -> str:
    """A query computed from a tensor that is not among the buffers: as long as the buffers'
    whole sequence on every rank. The ValueError's message ("" when W = 1: then it is a
    shard)."""
    mesh = DeviceMesh.from_group(group, "cpu")
    ids = torch.arange(24).view(1, 24)
    x = torch.randn(1, 4, 24, 8, dtype=torch.float64)  # [B, H, S, D], not in buffers
    with dtensor_ring.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
        assert ids.shape[1] == 24 // dist.get_world_size(group)  # sharded in place
        try:
            F.scaled_dot_product_attention(x, x, x, is_causal=True)
        except ValueError as e:
            return str(e)
    return ""


def test_unsharded_query_raises(dist_pool):
    """Every rank passing the whole sequence (a tensor left out of buffers=) is caught: the
    buffers give the global length."""
    for messages, world in ((dist_pool.run(_unsharded_query, w), w) for w in (1, 2, 3)):
        for message in messages:
            if world == 1:
                assert message == "", message
            else:
                assert "query of 24 tokens on each of" in message and "buffers=" in message


def _dtensor_sdpa_untouched(group) -> bool:
    """SDPA on DTensors inside the context goes to torch's (here: ``ring_sdpa``'s) path."""
    mesh = DeviceMesh.from_group(group, "cpu")
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with dtensor_ring.context_parallel(mesh), dtensor_ring.ring_sdpa(layout="zigzag"):
        qd = dtensor_ring.shard_sequence(q, mesh, seq_dim=2)
        out = F.scaled_dot_product_attention(qd, qd, qd, is_causal=True)
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return (
        isinstance(out, DTensor)
        and _max_err(dtensor_ring.unshard_sequence(out, seq_dim=2, layout="zigzag"), ref) < 1e-10
    )


def test_sdpa_on_dtensors_passes_through(dist_pool):
    assert dist_pool.run(_dtensor_sdpa_untouched, 2) == [True, True]


STEPS, LR = 2, 0.5


def _fsdp_step(group, activation_checkpointing):
    """A torchtitan-like loop: FSDP2 and context parallelism on one 1-D mesh."""
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 8 * W
    torch.manual_seed(0)
    reference = TinyTransformer(TinyConfig(activation_checkpointing=activation_checkpointing))
    model = copy.deepcopy(reference)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses, grad_errors = [], {}
    for step in range(STEPS):
        tokens = torch.randint(0, reference.cfg.vocab_size, (B, S + 1), generator=gen)
        ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        positions = torch.arange(S)

        ref_logits = reference(ids, positions)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()

        with dtensor_ring.context_parallel(
            mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 0]
        ):
            logits = model(ids, positions)
            # mean over this rank's tokens; FSDP averages over the ranks: the global mean
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=group)
        losses.append((global_loss.item() / W, ref_loss.item()))
        if step == 0:
            for (name, p), ref_p in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                grad_errors[name] = (
                    _max_err(p.grad.full_tensor(), ref_p.grad),
                    ref_p.grad.abs().max().item(),
                )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return losses, grad_errors


@pytest.mark.parametrize("world_size,activation_checkpointing", [(2, True), (3, False), (4, False)])
def test_fsdp2_with_context_parallel(dist_pool, world_size, activation_checkpointing):
    results = dist_pool.run(
        _fsdp_step, world_size, timeout_s=300, activation_checkpointing=activation_checkpointing
    )
    for rank, (losses, grad_errors) in enumerate(results):
        for step, (loss, ref_loss) in enumerate(losses):
            assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (rank, step, losses)
        for name, (err, scale) in grad_errors.items():
            assert err < 1e-5 * max(1.0, scale), (rank, name, err, scale)
