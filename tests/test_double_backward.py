"""Double backward (Note [First-order backward] in ``ops/common.py``): a backward with
``create_graph=True`` through attention raises the same ``RuntimeError`` on every rank, at
that backward, before any communication, through every front door (functional dense and
varlen ring / zigzag / stripe, llama3, llama3_zigzag, ``layout="auto"`` with each algorithm
forced, Ulysses, hybrid, SDPA on DTensors with and without the ``ring_sdpa`` scope, the
sinks' gradient alone); decoding has no gradient at all. World sizes 1-4 on the session's
gloo pool. The graph stays usable: a first-order backward after the error is exact."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_spy import forced_algorithm
from reference import random_qkv
from test_ulysses import hybrid_groups

import dtensor_ring as dr
from dtensor_ring.api.varlen import ring_varlen_attention_func
from dtensor_ring.ops.common import DOUBLE_BACKWARD

H, H_KV, D, S_LOCAL = 12, 6, 8, 4  # H divisible by every world size (Ulysses)
SINKS = torch.linspace(-2.0, 2.0, H, dtype=torch.float64)

Call = Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]  # -> (out, leaves)


@contextlib.contextmanager
def communication_entered() -> Iterator[list[str]]:
    """Inside, every call of a backward engine (ring, all-gather) or of the Ulysses
    all-to-all is appended to the list yielded: what a backward communicates through."""
    import dtensor_ring.ops.ring as ring_ops
    import dtensor_ring.ops.ulysses as ulysses_ops
    import dtensor_ring.ops.varlen as varlen_ops

    targets = [
        (ring_ops, "ring_backward"),
        (varlen_ops, "ring_backward"),
        (varlen_ops, "llama3_backward"),
        (ulysses_ops, "all_to_all"),
    ]
    originals = [getattr(module, name) for module, name in targets]
    entered: list[str] = []

    def spy(fn, name):
        def wrapped(*args, **kwargs):
            entered.append(name)
            return fn(*args, **kwargs)

        return wrapped

    try:
        for (module, name), fn in zip(targets, originals, strict=True):
            setattr(module, name, spy(fn, name))
        yield entered
    finally:
        for (module, name), fn in zip(targets, originals, strict=True):
            setattr(module, name, fn)


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _with_sinks(leaves: list[torch.Tensor], sinks: bool) -> dict:
    """``{"sinks": a new leaf}`` (also appended to ``leaves``) when ``sinks``, else ``{}``."""
    if not sinks:
        return {}
    leaves.append(SINKS.clone().requires_grad_())
    return {"sinks": leaves[-1]}


def _auto(*args, **kwargs):
    return dr.ring_attention_func("auto", *args, **kwargs)


def _llama3_zigzag(*args, **kwargs):
    return dr.ring_attention_func("llama3_zigzag", *args, **kwargs)


def _doors(group) -> dict[str, Call]:
    """Every front door of a training forward, as ``name -> call`` on this rank's tokens
    (fp64, causal; ``[sinks]``: with sinks, whose gradient is asked for too)."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(2, S_LOCAL * W, H, H_KV, D, seed=1)

    def dense(fn, tokens, sinks=False, **kw):  # tokens: the layout whose tokens it takes
        def call():
            leaves = _leaves(*(dr.shard_local(x, tokens, rank, W) for x in (q, k, v)))
            extra = _with_sinks(leaves, sinks)
            return fn(*leaves[:3], causal=True, group=group, **kw, **extra), leaves

        return call

    doors: dict[str, Call] = {
        "ring_flash_attn_func": dense(dr.ring_flash_attn_func, "ring"),
        "ring_flash_attn_func[math]": dense(dr.ring_flash_attn_func, "ring", backend="math"),
        "zigzag_ring_flash_attn_func[sinks]": dense(
            dr.zigzag_ring_flash_attn_func, "zigzag", sinks=True
        ),
        "stripe_flash_attn_func": dense(dr.stripe_flash_attn_func, "stripe"),
        "llama3_zigzag_flash_attn_func": dense(dr.llama3_zigzag_flash_attn_func, "llama3_zigzag"),
        "ring_attention_func[llama3_zigzag]": dense(_llama3_zigzag, "llama3_zigzag"),
        "ring_attention_func[auto]": dense(_auto, "auto"),
        "ulysses_flash_attn_func[ring]": dense(dr.ulysses_flash_attn_func, "ring"),
        "ulysses_flash_attn_func[zigzag,sinks]": dense(
            dr.ulysses_flash_attn_func, "zigzag", sinks=True, layout="zigzag"
        ),
    }
    for algorithm in ("ring", "all_gather", "ulysses"):
        doors[f"ring_attention_func[auto:{algorithm},sinks]"] = _forced(
            algorithm, dense(_auto, "auto", sinks=True)
        )

    def sinks_only(fn, tokens, **kw):  # q, k, v constants: the gradient of the sinks alone
        def call():
            leaves = [SINKS.clone().requires_grad_()]
            local = (dr.shard_local(x, tokens, rank, W) for x in (q, k, v))
            return fn(*local, causal=True, group=group, sinks=leaves[0], **kw), leaves

        return call

    doors["zigzag_ring_flash_attn_func[sinks only]"] = sinks_only(
        dr.zigzag_ring_flash_attn_func, "zigzag"
    )
    doors["ulysses_flash_attn_func[sinks only]"] = sinks_only(
        dr.ulysses_flash_attn_func, "zigzag", layout="zigzag"
    )
    doors.update(_varlen_doors(group))
    doors["hybrid_flash_attn_func[sinks]"] = _hybrid_door(group, q, k, v)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layout, mode in (("zigzag", "ring"), ("llama3_zigzag", "ring"), ("stripe", "ulysses")):
        doors[f"scaled_dot_product_ring_attention[{layout},{mode}]"] = _sdpa(
            mesh, q, k, v, layout, mode, scope=False
        )
        doors[f"ring_sdpa+F.sdpa[{layout},{mode}]"] = _sdpa(mesh, q, k, v, layout, mode, scope=True)
    doors["scaled_dot_product_ring_attention[auto,ring,sinks]"] = _sdpa(
        mesh, q, k, v, "auto", "ring", scope=False, sinks=True
    )
    doors["scaled_dot_product_ring_attention[zigzag,ulysses,sinks]"] = _sdpa(
        mesh, q, k, v, "zigzag", "ulysses", scope=False, sinks=True
    )
    return doors


def _forced(algorithm: str, call: Call) -> Call:
    """``call`` with ``layout="auto"`` made to choose ``algorithm`` (forward and backward)."""

    def forced():
        with forced_algorithm(algorithm):
            return call()

    return forced


def _varlen_doors(group) -> dict[str, Call]:
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 4 * W, 6 * W, 8 * W], dtype=torch.int32)
    q, k, v = (
        torch.randn(8 * W, h, D, generator=gen, dtype=torch.float64) for h in (H, H_KV, H_KV)
    )

    def varlen(fn, layout, sinks=False):
        def call():
            parts = [dr.shard_varlen(x, cu, layout, rank, W) for x in (q, k, v)]
            leaves = _leaves(*(x for x, _ in parts))
            extra = _with_sinks(leaves, sinks)
            out = fn(*leaves[:3], parts[0][1], None, causal=True, group=group, **extra)
            return out, leaves

        return call

    def llama3():
        meta = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
        leaves = _leaves(*(x[8 * rank : 8 * (rank + 1)] for x in (q, k, v)))
        extra = _with_sinks(leaves, True)
        out = dr.llama3_flash_attn_varlen_func(
            *leaves[:3], *meta[:4], 1, meta[4], causal=True, group=group, **extra
        )
        return out, leaves

    def auto(*args, **kwargs):
        return ring_varlen_attention_func("auto", *args, **kwargs)

    doors = {
        "ring_flash_attn_varlen_func": varlen(dr.ring_flash_attn_varlen_func, "ring"),
        "zigzag_ring_flash_attn_varlen_func[sinks]": varlen(
            dr.zigzag_ring_flash_attn_varlen_func, "zigzag", sinks=True
        ),
        "llama3_flash_attn_varlen_func[sinks]": llama3,
        "llama3_zigzag_flash_attn_varlen_func[sinks]": varlen(
            dr.llama3_zigzag_flash_attn_varlen_func, "llama3_zigzag", sinks=True
        ),
    }
    for algorithm in ("ring", "all_gather"):
        doors[f"ring_varlen_attention_func[auto:{algorithm}]"] = _forced(
            algorithm, varlen(auto, "auto")
        )
    return doors


def _hybrid_door(group, q, k, v) -> Call:
    ulysses_group, ring_group = hybrid_groups(group)
    U, R = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    u, r = dist.get_rank(ulysses_group), dist.get_rank(ring_group)

    def call():
        leaves = _leaves(*(dr.hybrid_shard_local(x, "zigzag", r, R, u, U) for x in (q, k, v)))
        extra = _with_sinks(leaves, True)
        out = dr.hybrid_flash_attn_func(
            *leaves[:3],
            causal=True,
            ulysses_group=ulysses_group,
            ring_group=ring_group,
            layout="zigzag",
            **extra,
        )
        return out, leaves

    return call


def _sdpa(mesh, q, k, v, layout, mode, *, scope, sinks=False) -> Call:
    """SDPA on sequence-sharded DTensors ``[B, H, S, D]``: ``scaled_dot_product_ring_attention``
    or ``F.scaled_dot_product_attention`` inside ``ring_sdpa``, left open (on :data:`_SCOPE`)
    until the backward has run."""

    def call():
        leaves = [
            dr.shard_sequence(x.transpose(1, 2), mesh, seq_dim=2, layout=layout)
            .detach()
            .requires_grad_()
            for x in (q, k, v)
        ]
        if scope:
            _SCOPE.enter_context(dr.ring_sdpa(layout=layout, mode=mode))
            return F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True), leaves
        extra = _with_sinks(leaves, sinks)
        out = dr.scaled_dot_product_ring_attention(
            *leaves[:3], is_causal=True, enable_gqa=True, layout=layout, mode=mode, **extra
        )
        return out, leaves

    return call


_SCOPE = contextlib.ExitStack()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _double_backward(call: Call) -> tuple[str, list[str], float]:
    """Run ``call``; a first-order backward (graph retained), then ``torch.autograd.grad(out,
    leaves, dout, create_graph=True)``, then a first-order backward again: ``(the error of
    the second or "no error", the communication it entered, max difference of the third
    from the first)``."""
    with _SCOPE:
        out, leaves = call()
        dout = out.detach().cos()
        before = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        with communication_entered() as entered:
            try:
                torch.autograd.grad(out, leaves, dout, create_graph=True)
                message = "no error"
            except RuntimeError as e:
                message = str(e)
        after = torch.autograd.grad(out, leaves, dout)
    diffs = [(_local(a) - _local(b)).abs().max() for a, b in zip(after, before, strict=True)]
    return message, entered, float(max(diffs))


def check_every_door(group) -> dict[str, tuple[str, list[str], float]]:
    """Worker body: :func:`_double_backward` of every door of :func:`_doors`."""
    return {name: _double_backward(call) for name, call in _doors(group).items()}


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_door_raises_on_every_rank(dist_pool, world_size):
    results = dist_pool.run(check_every_door, world_size)
    for rank, doors in enumerate(results):
        assert len(doors) == 29, sorted(doors)
        for name, (message, entered, diff) in doors.items():
            assert DOUBLE_BACKWARD in message, (rank, name, message)
            assert not entered, (rank, name, entered)  # raised before any communication
            assert diff == 0.0, (rank, name, diff)  # the graph is intact


def check_decode(group) -> str:
    """Decoding is an inference op: its output has no gradient, so even a first backward
    raises (torch's error), on every rank."""
    W = dist.get_world_size(group)
    q = torch.randn(1, 1, H, D, dtype=torch.float64, requires_grad=True)
    k, v = random_qkv(1, 3 * W, H_KV, H_KV, D, seed=4)[:2]
    out = dr.decode_attention_func(q, k[:, :3], v[:, :3], group=group, sinks=SINKS)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(out, q, torch.ones_like(out), create_graph=True)
    return str(info.value)


@pytest.mark.parametrize("world_size", [1, 3])
def test_decode_has_no_gradient(dist_pool, world_size):
    for message in dist_pool.run(check_decode, world_size):
        assert "does not require grad" in message, message


def check_compiled(group) -> list[str]:
    """Compiled (aot_eager): AOTAutograd runs the backward ops itself, without grad mode, so
    the ``create_graph=True`` backward runs (first-order gradients) and the second backward
    raises torch's own error, on every rank (as for any compiled function; ``autograd.grad``
    with ``allow_unused=True`` would prune the raising node: None). Ring and all-gather."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(1, S_LOCAL * W, 4, 2, D, seed=5)
    messages = []
    for fn, layout in (
        (dr.zigzag_ring_flash_attn_func, "zigzag"),
        (dr.llama3_zigzag_flash_attn_func, "llama3_zigzag"),
    ):

        def attend(q, k, v, fn=fn):
            return fn(q, k, v, causal=True, group=group)

        leaves = _leaves(*(dr.shard_local(x, layout, rank, W) for x in (q, k, v)))
        out = torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
        grads = torch.autograd.grad(out, leaves, out.detach().cos(), create_graph=True)
        with pytest.raises(RuntimeError) as info:
            sum(g.pow(2).sum() for g in grads).backward()
        messages.append(str(info.value))
    return messages


def test_compiled_second_backward_raises_on_every_rank(dist_pool):
    for messages in dist_pool.run(check_compiled, 2):
        for message in messages:
            assert "does not currently support double backward" in message, message
