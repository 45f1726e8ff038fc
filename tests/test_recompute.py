"""Activation checkpointing recomputes exactly, or raises on every rank (Note [Recomputation
outside the scope] in ``dtensor_ring/api/recompute.py``).

A training step (embedding, a checkpointed attention block, a summed cross-entropy loss) at 1-4
ranks against the same model in one process (fp64), through each door that serves attention
for a scope, checkpointed by ``torch.utils.checkpoint`` (reentrant, not, and selective:
``create_selective_checkpoint_contexts`` keeping attention's outputs, whose dispatch mode sends
SDPA on DTensors through the aten-op handlers, Note [Eager SDPA on DTensors]), FSDP's
``checkpoint_wrapper`` (both implementations) and the composable ``checkpoint``, with the
backward inside the scope and after it:

* ``context_parallel``: exact everywhere (PyTorch's default layout, "auto", "llama3_zigzag");
  also a second backward through the graph (``retain_graph``), the graphs of two scopes of
  different layouts backwarded together after both exited, and a ``torch.compile``'d
  checkpointed block (its graph recomputes the ring op itself);
* ``ring_sdpa``: exact inside (also with the backward on another thread, where the
  recomputation sees the scope's layout); after the scope, the ``ValueError`` of a backward
  outside it on every rank, before any attention (or communication) ran;
* the transformers attention function (no scope): exact with transformers' activation
  checkpointing, reentrant and not; a ``setup`` of another layout between the forward and the
  backward raises on every rank.

Every checkpointed step is checked to rerun its attention call (selective checkpointing then
hands back the saved outputs); nothing stays installed after the scopes (SDPA and torch's
checkpoint internals are the originals again).
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from engine_spy import engines_used
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import dtensor_ring as dr

V, E, H, H_KV, D, B = 32, 16, 4, 2, 4, 2
CHECKPOINTERS = (
    "reentrant",
    "non_reentrant",
    "selective",
    "wrapper_reentrant",
    "wrapper_non_reentrant",
    "composable",
)
TOL = 1e-10
HF_TOL = 1e-5


class _Block(nn.Module):
    """``x + wo(attention(q, k, v))``, q/k/v ``[B, H(_kv), S, D]`` projected from ``x``."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.wq = nn.Linear(E, H * D, bias=False)
        self.wkv = nn.Linear(E, 2 * H_KV * D, bias=False)
        self.wo = nn.Linear(H * D, E, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, H, D).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, H_KV, D).permute(2, 0, 3, 1, 4)
        out = self.attention(q, k, v)
        return x + self.wo(out.transpose(1, 2).reshape(b, s, H * D))


class _Model(nn.Module):
    """Embedding, one attention block checkpointed by ``checkpointer`` (or not: None), head."""

    def __init__(self, checkpointer: str | None, attention):
        super().__init__()
        self.checkpointer = checkpointer
        self.embed = nn.Embedding(V, E)
        self.block = _Block(attention)
        self.head = nn.Linear(E, V, bias=False)
        if checkpointer is not None and checkpointer.startswith("wrapper"):
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
        if self.checkpointer in ("reentrant", "non_reentrant"):
            reentrant = self.checkpointer == "reentrant"
            x = torch_checkpoint.checkpoint(self.block, x, use_reentrant=reentrant)
        elif self.checkpointer == "selective":  # attention's outputs saved, the rest recomputed
            context = functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, _save_attention
            )
            x = torch_checkpoint.checkpoint(self.block, x, use_reentrant=False, context_fn=context)
        else:
            x = self.block(x)
        return self.head(x)


def _save_attention(ctx, op, *args, **kwargs) -> torch_checkpoint.CheckpointPolicy:
    """Selective checkpointing's policy as torchtitan writes it: keep attention's outputs
    (SDPA's fused ops, which the DTensor handlers serve, and ours), recompute the rest."""
    if "scaled_dot_product" in str(op) or str(op).startswith("dtensor_ring."):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _sdpa(calls: list, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    calls.append(1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)


def _sdpa_on_dtensors(mesh: DeviceMesh, calls: list, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA on the local shards wrapped as ``Shard(2)`` DTensors, as ``TinyTransformer`` does."""
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    return _sdpa(calls, q, k, v).to_local()


def _batch(S: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, V, (B, S), generator=gen) for _ in range(2))


def _loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum")


def _reference(S: int) -> tuple[_Model, float]:
    """The model in one process (fp64, not checkpointed) after its step: (model, loss)."""
    torch.manual_seed(0)
    ref = _Model(None, functools.partial(_sdpa, [])).double()
    loss = _loss(ref, *_batch(S))
    loss.backward()
    return ref, loss.item()


def _copy(ref: _Model, checkpointer: str, attention) -> _Model:
    model = _Model(checkpointer, attention).double()
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        p.data.copy_(p_ref.data)
    return model


def _errors(group, loss: Tensor, model: nn.Module, ref: nn.Module, ref_loss: float) -> float:
    """The largest error of the summed loss and of every all-reduced gradient (relative)."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst = abs(total.item() - ref_loss) / abs(ref_loss)
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()).item())
    return worst


#: what the scopes replace, as this process imported it (before any scope)
_ORIGINALS = (
    F.scaled_dot_product_attention,
    torch_checkpoint.CheckpointFunction.__dict__["forward"],
    torch_checkpoint._CheckpointFrame.__dict__["__init__"],
)


def _untouched() -> bool:
    """SDPA and torch's checkpoint internals are the originals (nothing left installed)."""
    now = (
        F.scaled_dot_product_attention,
        torch_checkpoint.CheckpointFunction.__dict__["forward"],
        torch_checkpoint._CheckpointFrame.__dict__["__init__"],
    )
    return all(a is b for a, b in zip(now, _ORIGINALS, strict=True))


# --- context_parallel --------------------------------------------------------------------------


def _cp_step(group, layout, checkpointer, where, ref, ref_loss) -> float:
    """One step in ``context_parallel``, its backward ``where`` ("inside", "after"; "twice":
    after, twice, the first with ``retain_graph``); the error against one process."""
    mesh = DeviceMesh.from_group(group, "cpu")
    calls: list = []
    model = _copy(ref, checkpointer, functools.partial(_sdpa, calls))
    ids, labels = _batch(8 * dist.get_world_size(group))
    kw = {} if layout is None else {"layout": layout}
    with dr.context_parallel(
        mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}, **kw
    ):
        loss = _loss(model, ids, labels)
        if where == "inside":
            loss.backward()
    if where == "twice":
        loss.backward(retain_graph=True)
        for p in model.parameters():
            p.grad = None
    if where != "inside":
        loss.backward()
    assert len(calls) == 1 + (2 if where == "twice" else 1), (checkpointer, where, calls)
    return _errors(group, loss, model, ref, ref_loss)


def _cp_two_scopes(group, ref, ref_loss) -> float:
    """Two micro-batches (the same one twice) in two scopes of different layouts, both
    backwarded after both exited: each recomputes with its own scope's layout."""
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _copy(ref, "reentrant", functools.partial(_sdpa, []))
    losses = []
    for layout in ("ring", "zigzag"):
        ids, labels = _batch(8 * dist.get_world_size(group))
        with dr.context_parallel(
            mesh,
            buffers=[ids, labels],
            buffer_seq_dims=[1, 1],
            no_restore_buffers={ids, labels},
            layout=layout,
        ):
            losses.append(_loss(model, ids, labels))
    (losses[0] + losses[1]).backward()
    for p in model.parameters():
        p.grad /= 2
    return _errors(group, losses[0], model, ref, ref_loss)


def _cp_steps(group) -> dict[str, float]:
    ref, ref_loss = _reference(8 * dist.get_world_size(group))
    errors = {}
    for layout in (None, "auto", "llama3_zigzag"):
        for checkpointer in CHECKPOINTERS:
            for where in ("inside", "after"):
                name = f"{layout} {checkpointer} {where}"
                errors[name] = _cp_step(group, layout, checkpointer, where, ref, ref_loss)
    errors["retain_graph"] = _cp_step(group, None, "reentrant", "twice", ref, ref_loss)
    errors["two scopes"] = _cp_two_scopes(group, ref, ref_loss)
    errors["restored"] = 0.0 if _untouched() else 1.0
    return errors


@pytest.mark.parametrize(
    "world_size", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))]
)
def test_context_parallel_recomputes_exactly(dist_pool, world_size):
    for rank, errors in enumerate(dist_pool.run(_cp_steps, world_size, timeout_s=300)):
        for name, err in errors.items():
            assert err < TOL, (rank, name, err)


def _plain_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)


def _cp_compiled(group, reentrant: bool) -> float:
    """The checkpointed block compiled (``aot_eager``, fullgraph), backward after the scope:
    the compiled graph recomputes the ring op it holds."""
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    ref, ref_loss = _reference(8 * W)
    model = _copy(ref, None, _plain_sdpa)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def block(x: Tensor) -> Tensor:
        return torch_checkpoint.checkpoint(model.block, x, use_reentrant=reentrant)

    ids, labels = _batch(8 * W)
    with dr.context_parallel(
        mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}
    ):
        logits = model.head(block(model.embed(ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return _errors(group, loss, model, ref, ref_loss)


@pytest.mark.parametrize("reentrant", [True, False])
def test_context_parallel_compiled_checkpoint_recomputes_exactly(dist_pool, reentrant):
    for rank, err in enumerate(dist_pool.run(_cp_compiled, 2, reentrant=reentrant)):
        assert err < TOL, (rank, err)


# --- ring_sdpa -----------------------------------------------------------------------------------


def _dt_steps(group) -> dict[str, object]:
    """Steps with SDPA on DTensors in ``ring_sdpa``: the error of each with the backward inside;
    with the backward after, what it raised and which attention engines ran meanwhile."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    ref, ref_loss = _reference(8 * W)
    results: dict[str, object] = {}
    for layout in ("ring", "zigzag", "llama3_zigzag", "auto"):
        for checkpointer in CHECKPOINTERS:
            for where in ("inside", "after"):
                calls: list = []
                model = _copy(ref, checkpointer, functools.partial(_sdpa_on_dtensors, mesh, calls))
                ids, labels = (dr.shard_local(t, layout, rank, W, 1) for t in _batch(8 * W))
                with dr.ring_sdpa(layout=layout):
                    loss = _loss(model, ids, labels)
                    if where == "inside":
                        loss.backward()
                name = f"{layout} {checkpointer} {where}"
                if where == "inside":
                    assert len(calls) == 2, (name, calls)
                    results[name] = _errors(group, loss, model, ref, ref_loss)
                    continue
                raised = None
                with engines_used() as used:
                    try:
                        loss.backward()
                    except ValueError as e:
                        raised = str(e)
                results[name] = (raised, sorted(used), len(calls))
    results["restored"] = _untouched()
    return results


@pytest.mark.parametrize(
    "world_size", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))]
)
def test_ring_sdpa_recomputes_exactly_inside_and_refuses_after(dist_pool, world_size):
    for rank, results in enumerate(dist_pool.run(_dt_steps, world_size, timeout_s=300)):
        assert results.pop("restored") is True, rank
        for name, result in results.items():
            if name.endswith("inside"):
                assert result < TOL, (rank, name, result)
                continue
            raised, used, calls = result
            layout = name.split()[0]
            assert isinstance(raised, str) and raised.startswith(
                f"the recomputation of SDPA on DTensors ran outside dtensor_ring.ring_sdpa("
                f"layout={layout!r}"
            ), (rank, name, raised)
            assert used == [] and calls == 1, (rank, name, used, calls)  # nothing ran


def _dt_backward_on_a_thread(group) -> tuple[list[str], float]:
    """The backward inside the scope but on another thread (as CUDA's autograd threads run
    it, without the scope's thread-local state): the recomputation sees the scope's layout
    (``shard_sequence``'s default) there too."""
    from dtensor_ring.api.dtensor.scope import scope_layout

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    ref, ref_loss = _reference(8 * W)
    layouts: list[str] = []

    def attention(q, k, v):
        layouts.append(scope_layout(None))
        return _sdpa_on_dtensors(mesh, [], q, k, v)

    model = _copy(ref, "reentrant", attention)
    ids, labels = (dr.shard_local(t, "zigzag", rank, W, 1) for t in _batch(8 * W))
    errors: list[BaseException] = []

    def backward():
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001  (re-raised on the test's thread)
            errors.append(e)

    with dr.ring_sdpa(layout="zigzag"):
        loss = _loss(model, ids, labels)
        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
    if errors:
        raise errors[0]
    return layouts, _errors(group, loss, model, ref, ref_loss)


def test_ring_sdpa_recomputation_on_another_thread(dist_pool):
    for rank, (layouts, err) in enumerate(dist_pool.run(_dt_backward_on_a_thread, 2)):
        assert layouts == ["zigzag", "zigzag"], (rank, layouts)
        assert err < TOL, (rank, err)


# --- transformers ------------------------------------------------------------------------------


def _hf_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
    )


def _counted(calls: list, *args, **kwargs):
    """The transformers attention function of ``dtensor_ring``, its calls counted."""
    import dtensor_ring.hf as drhf

    calls.append(1)
    return drhf.ring_attention_forward(*args, **kwargs)


def _hf_steps(group) -> dict[str, object]:
    """transformers' activation checkpointing with ``attn_implementation="dtensor_ring"``:
    the error of each step against the model in one process; and what a ``setup`` of
    another layout between forward and backward raised."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    import dtensor_ring.hf as drhf

    W = dist.get_world_size(group)
    ids = _batch(8 * W)[0]
    batch = {"input_ids": ids, "labels": ids.clone()}
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_hf_config(), attn_implementation="sdpa")
    ref = ref.double().train()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    results: dict[str, object] = {}
    for layout in ("zigzag", "llama3", "auto"):
        for reentrant in (True, False, "setup between"):
            drhf.setup(group=group, layout=layout)
            calls: list = []
            counted = functools.partial(_counted, calls)
            AttentionInterface.register(drhf.ATTN_IMPLEMENTATION, counted)
            model = AutoModelForCausalLM.from_config(
                _hf_config(), attn_implementation=drhf.ATTN_IMPLEMENTATION
            )
            model = model.double().train()
            model.load_state_dict(ref.state_dict())
            enable = getattr(model, "activation_checkpointing_enable", None)
            kwargs = {"use_reentrant": reentrant is not False}
            if enable is None:  # transformers < 5.25
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                enable(activation_checkpointing_kwargs=kwargs)
            loss = model(**drhf.shard_batch(batch, group=group, layout=layout)).loss
            name = f"{layout} reentrant={reentrant}"
            if reentrant == "setup between":
                # other tokens than the forward's at W > 1 (one rank: the same tokens)
                drhf.setup(group=group, layout="stripe" if layout == "llama3" else "ring")
                try:
                    loss.backward()
                except ValueError as e:
                    results[name] = str(e)
                    continue
            else:
                loss.backward()  # setup above registered the function again: not counted
                assert len(calls) == 4, (name, calls)  # two layers, each recomputed
            results[name] = _errors(group, loss, model, ref, ref_loss.item())
    return results


@pytest.mark.parametrize(
    "world_size", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))]
)
def test_transformers_activation_checkpointing_recomputes_exactly(dist_pool, world_size):
    pytest.importorskip("transformers")
    for rank, results in enumerate(dist_pool.run(_hf_steps, world_size, timeout_s=300)):
        for name, result in results.items():
            if name.endswith("setup between") and world_size > 1:
                assert isinstance(result, str) and "position_ids" in result, (rank, name)
            else:  # transformers computes the loss in fp32 whatever the model's dtype
                assert result < HF_TOL, (rank, name, result)
