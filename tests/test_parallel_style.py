"""PyTorch's module-level context parallel on ring attention: ``dtensor_ring.ContextParallel``
with ``parallelize_module``, ``context_parallel_shard`` / ``context_parallel_unshard`` and
PyTorch's load balancers (Note [Module-level context parallel] in
``dtensor_ring/api/parallel_style.py``).

Each case writes the program PyTorch's tests write (an ``SDPAWrapper`` module whose forward
calls ``F.scaled_dot_product_attention``, parallelized; the inputs sharded by the balancer;
forward, backward; the output and gradients unsharded) and compares it with fp64 attention over
the whole sequence in one process, at 1-4 ranks: no balancer (contiguous), PyTorch's head-tail
balancer, our stripe layout, causal and not, GQA, the ring and the all-gather rotation, a
compiled (fullgraph) SDPA inside the module, DTensor inputs, activation checkpointing inside the
module's forward with the backward after it. Errors: arguments the style cannot serve, a
balancer no dense layout matches (PTRR-like), DTensor inputs placed otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from reference import random_qkv, reference_attention
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_ring as dr

B, H, H_KV, D = 2, 4, 2, 8
TOL = dict(rtol=1e-10, atol=1e-10)


class SDPAWrapper(nn.Module):
    """PyTorch's test module: its forward is SDPA (``compiled``: a fullgraph-compiled SDPA;
    ``checkpointed``: SDPA under a non-reentrant activation checkpoint)."""

    def __init__(self, compiled: bool = False, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.sdpa = F.scaled_dot_product_attention
        if compiled:
            self.sdpa = torch.compile(
                F.scaled_dot_product_attention, fullgraph=True, backend="aot_eager"
            )

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        if self.checkpointed:
            return torch_checkpoint.checkpoint(
                lambda *a: F.scaled_dot_product_attention(*a, **kwargs), *args, use_reentrant=False
            )
        return self.sdpa(*args, **kwargs)


class _FixedOrder:
    """A load balancer by its permutation alone (PyTorch's ``_LoadBalancer`` protocol)."""

    def __init__(self, order: Tensor):
        self.order = order

    def _generate_indices(self, restore: bool = False) -> Tensor:
        order = self.order if self.order.ndim == 2 else self.order[None]  # one per batch row
        return order.argsort(-1) if restore else order


def _balancer(kind: str, S: int, W: int) -> object:
    if kind == "head_tail":  # PyTorch's own class, as its tests build it
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
        )

        return _HeadTailLoadBalancer(S, W, torch.device("cpu"))
    if kind == "permuted":  # any other balancer: a TokenLayout of its permutation
        return _FixedOrder(torch.randperm(S, generator=torch.Generator().manual_seed(S)))
    return {"none": None, "stripe": "stripe"}[kind]


def check_module(
    group: dist.ProcessGroup,
    balancer: str,
    causal: bool,
    rotate: str | None,
    compiled: bool = False,
    checkpointed: bool = False,
    dtensor_inputs: bool = False,
) -> None:
    """The PyTorch program on this rank's shards against the fp64 reference."""
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 4 * W
    q, k, v = (t.transpose(1, 2) for t in random_qkv(B, S, H, H_KV, D, seed=3))  # [B, H, S, D]
    dout = torch.randn(B, H, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*(t.transpose(1, 2) for t in ref_leaves), causal=causal)
    expected.transpose(1, 2).backward(dout)

    lb = _balancer(balancer, S, W)
    layout = "stripe" if balancer == "stripe" else None
    options = dr.cp_options.rotate_method
    try:
        if rotate is not None:
            dr.set_rotate_method(rotate)
        attention = parallelize_module(
            SDPAWrapper(compiled, checkpointed), mesh, dr.ContextParallel(seq_dim=2, layout=layout)
        )
        shards = dr.context_parallel_shard(mesh, [*leaves, dout], [2] * 4, lb)
        cp_q, cp_k, cp_v = (t.detach().requires_grad_() for t in shards[:3])
        inputs = (cp_q, cp_k, cp_v)
        if dtensor_inputs:
            inputs = tuple(DTensor.from_local(t, mesh, [Shard(2)]) for t in inputs)
        dr.enable_context_parallel_dispatcher()  # PyTorch's switch (the module needs none)
        out = attention(*inputs, is_causal=causal, enable_gqa=True)
        assert type(out) is Tensor  # outputs are local, as PyTorch's style gives
        out.backward(shards[3])
        dr.disable_context_parallel_dispatcher()
        got = dr.context_parallel_unshard(
            mesh, [out.detach(), cp_q.grad, cp_k.grad, cp_v.grad], [2] * 4, lb
        )
    finally:
        dr.cp_options.rotate_method = options
        dr.cp_options.enable_load_balance = True
    want = [expected.detach().transpose(1, 2), *(t.grad for t in ref_leaves)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


WORLDS = (1, 2, 3, pytest.param(4, marks=pytest.mark.slow))  # W = 4 in the slow tier


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("balancer", ["none", "head_tail", "stripe", "permuted"])
@pytest.mark.parametrize("causal", [True, False])
def test_module(dist_pool, world_size, balancer, causal):
    dist_pool.run(check_module, world_size, balancer=balancer, causal=causal, rotate=None)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("balancer", ["none", "head_tail"])
def test_rotate_methods(dist_pool, world_size, rotate, balancer):
    dist_pool.run(check_module, world_size, balancer=balancer, causal=True, rotate=rotate)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", ["compiled", "checkpointed", "dtensor_inputs"], ids=lambda v: v)
def test_module_variants(dist_pool, world_size, variant):
    dist_pool.run(
        check_module,
        world_size,
        balancer="head_tail",
        causal=True,
        rotate=None,
        **{variant: True},
    )


def check_errors(group: dist.ProcessGroup) -> list[str]:
    """Every misuse raises ValueError / TypeError naming it (identically on every rank)."""
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 4 * W
    x = torch.randn(B, H, S, D)
    per_row = _FixedOrder(torch.stack([torch.arange(S), torch.arange(S).flip(0)]))
    calls = {
        "varlen": lambda: dr.ContextParallel(seq_dim=2, attention_type="varlen"),
        "flex_algorithm": lambda: dr.ContextParallel(attention_type="flex", algorithm="ulysses"),
        "seq_dim": lambda: dr.ContextParallel(seq_dim=1),
        "layout": lambda: dr.ContextParallel(layout="nope"),
        "algorithm": lambda: dr.ContextParallel(algorithm="nope"),
        "pair": lambda: dr.ContextParallel(layout="stripe", algorithm="all_gather"),
        "balancer_rows": lambda: dr.context_parallel_shard(mesh, [x], [2], per_row),
        "balancer_type": lambda: dr.context_parallel_shard(mesh, [x], [2], 3),
        "both": lambda: dr.context_parallel_shard(mesh, [x], [2], "zigzag", layout="ring"),
        "dims": lambda: dr.context_parallel_shard(mesh, [x, x], [2]),
        "dims_keys": lambda: dr.context_parallel_shard(mesh, {"a": x}, {"b": 2}),
        "replicated_input": lambda: parallelize_module(SDPAWrapper(), mesh, dr.ContextParallel())(
            *(DTensor.from_local(t, mesh, [Replicate()]) for t in (x, x, x))
        ),
        "rotate": lambda: dr.set_rotate_method("ring"),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            messages.append(f"{name}: {type(e).__name__}: {e}")
        else:
            messages.append(f"{name}: no error")
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_errors(dist_pool, world_size):
    results = dist_pool.run(check_errors, world_size)
    assert all(r == results[0] for r in results)
    for message in results[0]:
        assert "no error" not in message, message
    text = "\n".join(results[0])
    assert "varlen attention modules are not" in text and "sequence dim 2" in text
    assert "FlexAttention runs on the ring" in text and "not one layout" in text
    assert "document masks, by the all-gather" in text
    assert "placed (Replicate(),)" in text and "rotate_method" in text


def check_misplaced_on_rank0(group: dist.ProcessGroup) -> str:
    """Rank 0 alone passes replicated DTensors, the others their Shard(2) shards: every rank
    raises (rank 0 its own error, the others one naming it), none waits."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    x = torch.randn(B, H, 4 * W, D)
    module = parallelize_module(SDPAWrapper(), mesh, dr.ContextParallel())
    if rank == 0:
        inputs = [DTensor.from_local(x, mesh, [Replicate()]) for _ in "qkv"]
    else:
        inputs = [DTensor.from_local(x[:, :, :4], mesh, [Shard(2)]) for _ in "qkv"]
    with pytest.raises(ValueError) as info:
        module(*inputs, is_causal=True)
    return str(info.value)


def test_misplaced_on_rank0(dist_pool):
    messages = dist_pool.run(check_misplaced_on_rank0, 3)
    assert "placed (Replicate(),)" in messages[0], messages[0]
    for message in messages[1:]:
        assert "rank 0 of the group raised an error in its own checks" in message, message


def test_balancer_layout():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    assert dr.balancer_layout(None, 16, 2) == "ring"
    assert dr.balancer_layout(_HeadTailLoadBalancer(16, 2, "cpu"), 16, 2) == "zigzag"
    assert dr.balancer_layout(_FixedOrder(torch.arange(12)), 12, 3) == "ring"
    reverse = dr.balancer_layout(_FixedOrder(torch.arange(12).flip(0)), 12, 3)
    assert isinstance(reverse, dr.layouts.TokenLayout)
    for rank in range(3):  # rank r holds the r-th third of the reversed order
        want = torch.arange(12).flip(0)[4 * rank : 4 * rank + 4]
        assert torch.equal(reverse.token_indices(12, rank, 3), want)
    with pytest.raises(ValueError, match="not one layout"):
        per_row = torch.stack([torch.arange(12), torch.arange(12).flip(0)])
        dr.balancer_layout(_FixedOrder(per_row), 12, 3)


def check_torch_names(group: dist.ProcessGroup, load_balance: bool) -> None:
    """PyTorch's module-level program with only the import changed
    (``dtensor_ring.compat.torch_cp``), against the fp64 reference."""
    from dtensor_ring.compat.torch_cp import (
        _context_parallel_shard,
        _ContextParallel,
        _cp_options,
        _disable_context_parallel_dispatcher,
        _enable_context_parallel_dispatcher,
        _HeadTailLoadBalancer,
        _RotateMethod,
        context_parallel_unshard,
        set_rotate_method,
    )

    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 4 * W
    q, k, v = (t.transpose(1, 2) for t in random_qkv(B, S, H, H, D, seed=5))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*(t.transpose(1, 2) for t in ref), causal=True)
    expected.transpose(1, 2).sum().backward()
    set_rotate_method("alltoall")
    assert _cp_options.rotate_method == _RotateMethod.ALL_TO_ALL
    try:
        cp_plan = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
        attention = parallelize_module(SDPAWrapper(), mesh, cp_plan)
        lb = _HeadTailLoadBalancer(S, W, q.device) if load_balance else None
        cp_q, cp_k, cp_v = _context_parallel_shard(mesh, (q, k, v), (2,) * 3, load_balancer=lb)
        _enable_context_parallel_dispatcher()
        for t in (cp_q, cp_k, cp_v):
            t.requires_grad = True
        out = attention(cp_q, cp_k, cp_v, is_causal=True)
        out.sum().backward()
        _disable_context_parallel_dispatcher()
        got = context_parallel_unshard(mesh, [out, cp_q.grad, cp_k.grad, cp_v.grad], [2] * 4, lb)
    finally:
        _cp_options.rotate_method, _cp_options.enable_load_balance = None, True
    want = [expected.transpose(1, 2), *(t.grad for t in ref)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.detach(), **TOL)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("load_balance", [True, False])
def test_torch_names(dist_pool, world_size, load_balance):
    dist_pool.run(check_torch_names, world_size, load_balance=load_balance)


def check_compiled_after_context_parallel(group: dist.ProcessGroup) -> None:
    """The process's first Dynamo trace inside ``context_parallel`` (which replaces SDPA), then
    a compiled SDPA inside a ContextParallel module: still ring attention (torch caches the
    overridable functions on first use; built during the replacement it lacked the builtin)."""
    import torch._dynamo.variables.torch as dynamo_torch  # test-only: empty torch's caches

    torch._dynamo.reset()
    torch.overrides._get_overridable_functions.cache_clear()
    dynamo_torch.get_overridable_functions.cache_clear()
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    q, k, v = (t.transpose(1, 2) for t in random_qkv(1, 4 * W, 2, 2, 8, seed=6))
    buffers = [t.clone() for t in (q, k, v)]
    compiled = torch.compile(F.scaled_dot_product_attention, fullgraph=True, backend="aot_eager")
    with dr.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 3, layout="ring"):
        compiled(*buffers, is_causal=True)
    attention = parallelize_module(SDPAWrapper(compiled=True), mesh, dr.ContextParallel())
    shards = dr.context_parallel_shard(mesh, [q, k, v], [2] * 3, layout="ring")
    (out,) = dr.context_parallel_unshard(mesh, [attention(*shards, is_causal=True)], [2], "ring")
    expected, _ = reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), **TOL)


def test_compiled_after_context_parallel(dist_pool):
    dist_pool.run(check_compiled_after_context_parallel, 2)


class TitanSDPA(nn.Module):
    """torchtitan 0.3's ``ScaledDotProductAttention.forward``, reduced: ``[B, L, N, H]`` in,
    transposed for SDPA, transposed back."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, enable_gqa=False, is_causal=True):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _titan_cp_forward(forward, mesh):
    """torchtitan's ``apply_cp_to_forward`` (SDPA branch): q, k, v as ``Shard(1)`` DTensors,
    the output back to a local tensor."""

    def cp_forward(q, k, v, **kwargs):
        q, k, v = (DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in (q, k, v))
        out = forward(q, k, v, **kwargs)
        return out.to_local() if isinstance(out, DTensor) else out

    return cp_forward


def check_titan_sdpa(group: dist.ProcessGroup, balancer: str) -> None:
    """torchtitan's SDPA context parallel, wired as it does (dispatcher enabled when the model
    is built, inputs sharded per step by ``context_parallel_shard``), against the fp64
    reference: the dispatcher follows the shards' layout."""
    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 4 * W
    q, k, v = random_qkv(B, S, H, H_KV, D, seed=7)  # [B, L, N, H]
    dout = torch.randn(B, S, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*ref, causal=True)
    expected.backward(dout)
    module = TitanSDPA()
    module.forward = _titan_cp_forward(module.forward, mesh)
    dr.enable_context_parallel_dispatcher()
    try:
        lb = _balancer(balancer, S, W)
        shards = dr.context_parallel_shard(mesh, (q, k, v, dout), (1,) * 4, load_balancer=lb)
        leaves = [t.requires_grad_() for t in shards[:3]]
        out = module(*leaves, enable_gqa=True)
        out.backward(shards[3])
        got = dr.context_parallel_unshard(
            mesh, [out.detach(), *(t.grad for t in leaves)], [1] * 4, lb
        )
    finally:
        dr.disable_context_parallel_dispatcher()
        dr.cp_options.enable_load_balance = True
    for a, b in zip(got, [expected.detach(), *(t.grad for t in ref)], strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("balancer", ["head_tail", "none"])
def test_titan_sdpa_path(dist_pool, world_size, balancer):
    dist_pool.run(check_titan_sdpa, world_size, balancer=balancer)


def check_shard_structures(group: dist.ProcessGroup) -> None:
    """PyTorch's structures: a tuple of buffers with a list of dims, and a dict whose dims come
    in another key order (matched by key), shard as a list of the same buffers does."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    ids, pos = torch.arange(2 * 4 * W).view(2, 4 * W), torch.arange(4 * W)
    want = [dr.shard_local(ids, "zigzag", rank, W, 1), dr.shard_local(pos, "zigzag", rank, W, 0)]
    got = dr.context_parallel_shard(mesh, (ids, pos), [1, 0], "zigzag")
    buffers, dims = {"ids": ids, "pos": pos}, {"pos": 0, "ids": 1}
    by_key = dr.context_parallel_shard(mesh, buffers, dims, "zigzag")
    assert isinstance(got, tuple) and list(by_key) == ["ids", "pos"]
    for a, b, c in zip(got, by_key.values(), want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    dr.cp_options.enable_load_balance = True


def test_shard_structures(dist_pool):
    dist_pool.run(check_shard_structures, 3)


class FlexWrapper(nn.Module):
    """PyTorch's FLEX test module (torchtitan's FlexAttentionWrapper): flex_attention itself."""

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(*args, **kwargs)


def check_flex_module(group: dist.ProcessGroup, balancer: str, algorithm=None) -> None:
    """``ContextParallel(attention_type=FLEX)`` (PyTorch's enum; ``algorithm``) on a flex
    wrapper, inputs and the global document mask through ``context_parallel_shard``: equals
    the fp64 reference."""
    from reference import reference_flex
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.nn.attention.flex_attention import create_block_mask

    W = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 8 * W
    doc = torch.arange(S) * 3 // S  # three documents, across shard boundaries

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    q, k, v = (t.transpose(1, 2) for t in random_qkv(B, S, H, H_KV, D, seed=5))
    dout = torch.randn(B, H, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_flex(*ref_leaves, mask_mod=document)
    expected.backward(dout)
    block_mask = create_block_mask(document, None, None, S, S, "cpu", BLOCK_SIZE=4)
    lb = _balancer(balancer, S, W)
    try:
        flex = _ContextParallel.AttentionType.FLEX
        style = dr.ContextParallel(seq_dim=2, attention_type=flex, algorithm=algorithm)
        attention = parallelize_module(FlexWrapper(), mesh, style)
        *shards, cp_mask = dr.context_parallel_shard(
            mesh, [q, k, v, dout, block_mask], [2, 2, 2, 2, 0], lb
        )
        assert cp_mask is block_mask  # the global mask: flex_attention's global indices
        cp_q, cp_k, cp_v = (t.detach().requires_grad_() for t in shards[:3])
        out = attention(cp_q, cp_k, cp_v, block_mask=cp_mask, enable_gqa=True)
        out.backward(shards[3])
        got = dr.context_parallel_unshard(
            mesh, [out.detach(), cp_q.grad, cp_k.grad, cp_v.grad], [2] * 4, lb
        )
    finally:
        dr.cp_options.enable_load_balance = True
    want = [expected.detach(), *(t.grad for t in ref_leaves)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "world_size",
    [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("balancer", ["none", "head_tail"])
def test_flex_module(dist_pool, world_size, balancer):
    dist_pool.run(check_flex_module, world_size, balancer=balancer)


def test_flex_module_by_the_gather(dist_pool):
    """``algorithm="all_gather"``: the document mask by the all-gather of the keys each rank's
    queries see (docs/flex.md), exact."""
    dist_pool.run(check_flex_module, 3, balancer="head_tail", algorithm="all_gather")
