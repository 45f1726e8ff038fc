"""FSDP2 + context parallelism on a 2 x 2 (dp, cp) mesh matches a single-process run.

Each case runs on the session's gloo worker pool (4 ranks): the tiny transformer of
``dtensor_ring.testing`` (2 layers, causal, GQA, RoPE with global positions from the layout),
with

* ``fully_shard`` over all 4 ranks (the flattened dp x cp dims: gradients must be reduced
  over cp as well as dp, since each cp rank holds only its tokens' share of every gradient;
  docs/composability.md), per block and then the root; or HSDP (replicate over cp, shard
  over dp);
* per-block ``torch.compile(fullgraph=True)`` applied before ``fully_shard`` (or eager),
  optionally with activation checkpointing inside the blocks;
* inputs, labels and positions sharded with ``shard_sequence`` (zigzag), attention through
  ``F.scaled_dot_product_attention`` on DTensors inside ``ring_sdpa``, each case in both modes:
  ``mode="ring"`` and ``mode="ulysses"`` (the model's 4 query heads are divisible by cp = 2).

Every rank also runs the same model unsharded on the whole batch (the reference). Two SGD
steps: the loss of each step and the parameter gradients of the first must match to fp32
precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_ring
from dtensor_ring.testing import TinyConfig, TinyTransformer

DP, CP, B_LOCAL, S, STEPS, LR = 2, 2, 2, 16, 2, 0.5


def _fsdp_parity(group, layout, mode, compile_backend, activation_checkpointing, fsdp):
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    if fsdp == "flat":  # shard over the flattened (dp, cp) dims
        fsdp_mesh = init_device_mesh("cpu", (DP * CP,))
    else:  # HSDP: replicate over cp, shard over dp (FSDP2's 2-D mesh: (replicate, shard))
        fsdp_mesh = DeviceMesh(
            "cpu", torch.arange(DP * CP).view(DP, CP).T, mesh_dim_names=("cp_replicate", "dp_shard")
        )
    cfg = TinyConfig(activation_checkpointing=activation_checkpointing)
    torch.manual_seed(0)
    reference = TinyTransformer(cfg)
    model = copy.deepcopy(reference).set_cp_mesh(mesh["cp"])
    for block in model.layers:
        if compile_backend is not None:
            block.compile(backend=compile_backend, fullgraph=True)
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    gen = torch.Generator().manual_seed(1)
    dp_rank = mesh.get_local_rank("dp")
    mine = slice(dp_rank * B_LOCAL, (dp_rank + 1) * B_LOCAL)
    positions = dtensor_ring.shard_sequence(
        torch.arange(S), mesh["cp"], seq_dim=0, layout=layout
    ).to_local()
    losses, grad_errors = [], {}
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (DP * B_LOCAL, S + 1), generator=gen)
        ids, labels = tokens[:, :-1], tokens[:, 1:]  # shift before sharding

        ref_logits = reference(ids, torch.arange(S))
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()

        ids_l, labels_l = (
            dtensor_ring.shard_sequence(
                t[mine], mesh, seq_dim=1, layout=layout, mesh_dim="cp", batch_dim=0
            ).to_local()
            for t in (ids, labels)
        )
        with dtensor_ring.ring_sdpa(layout=layout, mode=mode):
            logits = model(ids_l, positions)
            # mean over this rank's tokens; FSDP averages gradients over the 4 ranks, which
            # hold equally many tokens: the gradient of the global mean
            loss = F.cross_entropy(logits.flatten(0, 1), labels_l.flatten())
            loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append((global_loss.item() / (DP * CP), ref_loss.item()))
        if step == 0:
            for (name, p), ref_p in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                grad_errors[name] = (
                    (p.grad.full_tensor() - ref_p.grad).abs().max().item(),
                    ref_p.grad.abs().max().item(),
                )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return losses, grad_errors


def _fsdp_case(compile_backend, activation_checkpointing, fsdp, mode):
    return pytest.param(
        compile_backend,
        activation_checkpointing,
        fsdp,
        mode,
        marks=[] if compile_backend is None else [pytest.mark.slow],
        id=f"{'eager' if compile_backend is None else 'compiled'}"
        f"{'-ac' if activation_checkpointing else ''}{'-hsdp' if fsdp == 'hsdp' else ''}-{mode}",
    )


# the fast tier keeps each mode's eager run with checkpointing; compiled FSDP2: the slow tier
@pytest.mark.parametrize(
    "compile_backend,activation_checkpointing,fsdp,mode",
    [
        case
        for mode in ("ring", "ulysses")
        for case in (
            _fsdp_case(None, True, "flat", mode),
            _fsdp_case("aot_eager", False, "flat", mode),
            _fsdp_case("aot_eager", True, "flat", mode),
            _fsdp_case("aot_eager", False, "hsdp", mode),
        )
    ],
)
def test_fsdp2_cp_matches_single_process(
    dist_pool, compile_backend, activation_checkpointing, fsdp, mode
):
    results = dist_pool.run(
        _fsdp_parity,
        4,
        timeout_s=400,
        layout="zigzag",
        mode=mode,
        compile_backend=compile_backend,
        activation_checkpointing=activation_checkpointing,
        fsdp=fsdp,
    )
    for rank, (losses, grad_errors) in enumerate(results):
        for step, (loss, ref_loss) in enumerate(losses):
            assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (rank, step, losses)
        assert len(grad_errors) == len(dict(TinyTransformer(TinyConfig()).named_parameters()))
        for name, (err, scale) in grad_errors.items():
            assert err < 1e-5 * max(1.0, scale), (rank, name, err, scale)
