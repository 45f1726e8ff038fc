"""The generated cases of the adversarial suite.

A case runs one front door (:mod:`tests.adversarial.doors`) on every rank of a world of 1-4
ranks and returns checks against the strict fp64 reference of attention over the whole
sequence on one device (:mod:`tests.adversarial.oracle`), or is expected to raise a clean
``ValueError`` / ``TypeError`` on every rank. Kinds:

* ``base``: every door x world size 1-4 x backend (auto, "cpu_flash", "math"), causal, with
  gradients (and ``lse`` where the door returns it);
* ``mask``: non-causal, sliding windows, MQA / MHA head counts;
* ``layout`` (a): non-contiguous arguments (:data:`doors.VIEWS`), also of packed kv / qkv;
* ``nonfinite`` (b): a NaN / +Inf / -Inf in one token's q, k or v, early, late, in the middle
  (masked for earlier queries), inside a window, inside one packed document; the expected
  NaN/Inf pattern is the strict reference's (a row is touched only by tokens it sees);
* ``scale`` (c): ``softmax_scale`` 0, negative, tiny, huge, int, 0-d tensor (correct); NaN,
  Inf, str, bool (clean error);
* ``args`` (d): malformed arguments and tensors (types, windows, groups, a rank outside its
  group, dropout, alibi, backends, dtypes, int / empty / wrong-rank tensors, head counts,
  ``cu_seqlens`` and llama3 metadata); and each of those (but the groups) passed by rank 0
  alone, through a door of every family (``rank0:``): an error on every rank, none waiting;
* ``disagree`` (e): ranks that disagree on shapes, dtypes, masks, windows, scales, layouts,
  documents, or the op itself. Each runs twice: ``[debug]`` with ``DTENSOR_RING_DEBUG=1``
  (the consistency mode: expected clean error on every rank) and ``[nodebug]`` without (the
  header of gloo groups: a clean error on every rank too, except llama3 metadata that does not
  fit together, which only the mode sees: informational);
* ``dtensor`` (f): ``distribute_tensor`` / ``shard_sequence`` DTensors through ``ring_sdpa()``
  and ``scaled_dot_product_ring_attention`` with their defaults;
* ``hf`` (g): keyword arguments the transformers attention function receives (it must use or
  reject each; a rejected one passed by rank 0 alone too: ``rank0:``), and tiny transformers
  models end to end;
* ``dtype``, ``values``, ``shapes``: fp32 / bf16 / fp16; zero, tiny and huge values; edge sizes;
* ``debug_on``: consistent calls with the consistency mode on must stay correct.

Kinds of the later front doors, each through the adversities above that apply (the generators
take a door list; :func:`_retag` names such a case ``kind/door/W<w>/<adversity>:detail``):

* ``llama3_zigzag``: the layout's own doors (``llama3_zigzag_flash_attn_func``, its varlen
  form) through every adversity, and ``ring_attention_func`` / Ulysses / SDPA on DTensors /
  transformers with ``layout="llama3_zigzag"`` through base, mask, memory layouts, debug_on;
* ``context_parallel``: ``F.scaled_dot_product_attention`` on plain shards inside
  ``dtensor_ring.context_parallel`` and inside a module parallelized with
  ``dtensor_ring.ContextParallel`` (PyTorch's default layout, "stripe", "llama3_zigzag"),
  and the buffers it shards in place and restores (:func:`cp_buffers_case`; a malformed
  argument also on rank 0 alone, ``rank0:``);
* ``decode``, ``kv_cache``: ``decode_attention_func`` over uneven / empty / scattered cache
  shards and windows by position, and ``KVCacheShard`` + ``prefill_attention`` +
  ``decode_step_attention`` (:mod:`tests.adversarial.inference`);
* ``auto``: ``layout="auto"`` (zigzag's tokens; ring, all-gather or Ulysses chosen per call)
  through the doors that choose (``ring_attention_func``, ``ring_varlen_attention_func``,
  transformers dense and packed, ``context_parallel``) with the cost model's choice and with
  the choice forced (``[auto:ring]``, ``[auto:ulysses]``: the forced engine must run), through
  base, mask, memory layouts, debug_on (the primary doors also nonfinite, disagree, shapes),
  two tiny transformers models via ``shard_batch(layout="auto")``; and the doors that must
  reject it (Ulysses, SDPA on DTensors) through base: a clean ``ValueError`` on every rank;
* ``sinks`` also covers the llama3_zigzag doors, decoding and the KV cache; each rank's
  gradient of the sinks must be its rows' share;
* ``double_backward``: a backward with ``create_graph=True`` through every door that trains,
  with sinks that require grad where the door takes them: the same ``RuntimeError`` on every
  rank (or exact second-order gradients);
* ``recompute``: activation checkpointing (torch's reentrant and non-reentrant checkpoints,
  FSDP's ``checkpoint_wrapper``, the composable one, nested ones) of a model's attention
  block through the doors that serve attention for a scope (``context_parallel``,
  ``ring_sdpa``), the backward inside the scope, after it (once, twice) or in another scope,
  and transformers' activation checkpointing: exact, or a clean ``ValueError`` on every rank
  (``ring_sdpa`` outside its scope) (:mod:`tests.adversarial.recompute`);
* ``rank_local``: one rank differs in a fact of its own process (requires_grad, grad mode,
  the deterministic flag, strides, threads, autocast) through the doors that choose and
  plain ones: the same choice (exact) or the same clean error on every rank
  (:mod:`tests.adversarial.rank_local`);
* ``shards``: packed documents sharded per document, head-tail over the row or in contiguous
  row chunks, the varlen door told their positions: exact on its own layout's tokens (and on
  head-tail rows with ``documents_as_sharded``), a clean error on every rank otherwise
  (:mod:`tests.adversarial.shards`);
* ``flex``: ``dtensor_ring.flex_attention`` and ``ContextParallel(attention_type="flex")``:
  masks on every layout, non-finite values, score mods, bad arguments, ranks that disagree,
  double backward (:mod:`tests.adversarial.flex`);
* ``documents``: the varlen door on the placed layouts (``document_layout``,
  ``documents_as_sharded``) through the base, mask, memory-layout, non-finite, argument,
  disagreement, dtype, value and shape generators;
* ``titan``: torchtitan's varlen module on the ring (:mod:`tests.adversarial.titan`);
* ``flash2``: every door that takes a window and a backend, its windowed masks at W = 2-4 on
  ``backend="flash2_model"``: ``cuda_flash``'s adapter on FlashAttention-2's ops modelled on
  the CPU (``tests/flash2_model.py``), the calls the GPU kernel gets (Note
  [FlashAttention-2's unbounded window sides]);
* ``remembered``: each malformed argument of ``args`` right after a good call of the same door,
  whose resolution was remembered (Note [Remembered resolutions]), also with the gloo header
  off (as on an NCCL group): a clean error on every rank; and SDPA on DTensors of equal meshes
  of two process groups, alternately: each call over its own group, exact
  (:mod:`tests.adversarial.remembered`).

Every case name is ``kind/door/W<world>/detail``. :func:`all_cases` returns them all (each
case's ``fast`` flag marks the CI subset).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import oracle
from .doors import (
    ALL_DOORS,
    AUTO_DOORS,
    DOCUMENTS_DOOR,
    DOCUMENTS_GATHER_DOOR,
    DOORS,
    HEAD_TAIL_DOOR,
    HF_DOCUMENTS_DOOR,
    HYBRID_SPLIT,
    NEW_DOORS,
    PLACED,
    VIEWS,
    Ctx,
    Door,
    Tokens,
    cpu_mesh,
    placed_layout_of,
    view_grad,
)
from .oracle import Check, Flag
from .runner import Case

CORRECT = frozenset({"correct"})
ERROR = frozenset({"clean_error"})
EITHER = CORRECT | ERROR
DEBUG_ENV = {"DTENSOR_RING_DEBUG": "1"}
BACKENDS = (None, "cpu_flash", "math")
WORLDS = (1, 2, 3, 4)


# --- one attention call, checked ------------------------------------------------------------


@dataclass(frozen=True)
class Sym:
    """A keyword value made on the rank: "world" (the world group)."""

    name: str


@dataclass
class Setup:
    """Everything about one attention call besides the door.

    kw: the door's keyword arguments (flash-attn names, :mod:`doors`).
    dtype, B, s_local (tokens per rank), heads ``(H, H_kv)`` (default: H = 4, or 12 on 3
        ranks; H_kv = H / 2, or H for qkv-packed doors), D, docs (packed document lengths).
    view: memory layout of every tensor argument (:data:`doors.VIEWS`).
    inject: ``(tensor, position, value)``: one element (head 0, dim 0) of one token set to a
        non-finite value; positions "early", "late", "middle", "document" (:func:`position`).
    factors: ``(tensor, factor)`` pairs multiplying q, k, v or dout (zero / huge / tiny).
    grads: also check dq, dk, dv.  lse: pass ``return_attn_probs=True`` and check lse.
    ref: the reference's ``causal`` / ``window`` / ``scale`` when they differ from ``kw``
        (what the caller meant, e.g. ``causal="False"`` means non-causal).
    mutate: a malformed-tensor edit (:data:`MUTATIONS`).  cu_edit: an edit of the local
        ``cu_seqlens`` (llama3: ``cu_seqlens_q``) (:data:`CU_EDITS`).
    expect_error: the call must raise (what is wrong); a returned result is a failure.
    rank0: overrides of these fields (and ``door``) on rank 0 alone: ranks that disagree.
    extra (decoding, the KV cache: :mod:`tests.adversarial.inference`): ``split`` (how the
        cached tokens spread over the ranks), ``positions`` (pass the cache's positions),
        ``q_pos``, ``pos_edit``, ``steps`` (decoded tokens after the prompt), ``prompt_extra``
        (prompt tokens beyond ``s_local * W``), ``cache_window`` (``sliding_window``), ...
    """

    kw: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    B: int = 2
    s_local: int = 4
    heads: tuple[int, int] | None = None
    D: int = 8
    docs: tuple[int, ...] | None = None
    view: str = "contiguous"
    inject: tuple[str, str, float] | None = None
    factors: tuple[tuple[str, float], ...] = ()
    grads: bool = True
    lse: bool = False
    ref: dict = field(default_factory=dict)
    mutate: str | None = None
    cu_edit: str | None = None
    expect_error: str | None = None
    rank0: dict = field(default_factory=dict)
    seed: int = 0
    extra: dict = field(default_factory=dict)


def default_heads(door: Door, world: int) -> tuple[int, int]:
    H = 12 if world == 3 else 4
    return H, H if door.packing == "qkv" else H // 2


@dataclass
class Data:
    """Full tensors (identical on every rank): q, k, v, dout ``[B, S, H(_kv), D]`` in the
    case's dtype; ``bounds``: global ``cu_seqlens`` of a packed stream."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    bounds: list[int] | None
    seq_len: int


def position(where: str, seq_len: int, bounds: list[int] | None) -> int:
    """Global token of an injected value: early (1), late (last), middle, document (middle of
    the second packed document)."""
    if where == "document":
        return (bounds[1] + bounds[2]) // 2
    return {"early": 1, "late": seq_len - 1, "middle": seq_len // 2}[where]


def make_data(door: Door, s: Setup, world: int) -> Data:
    H, H_kv = s.heads or default_heads(door, world)
    B, S, bounds = s.B, s.s_local * world + s.extra.get("tokens", 0), None
    if door.packed_stream:
        bounds = [0, *itertools.accumulate(s.docs or door.default_docs(world))]
        B, S = 1, bounds[-1]
    gen = torch.Generator().manual_seed(s.seed)
    shapes = {"q": (B, S, H, s.D), "k": (B, S, H_kv, s.D), "v": (B, S, H_kv, s.D)}
    shapes["dout"] = shapes["q"]
    t = {n: torch.randn(shape, generator=gen, dtype=torch.float64) for n, shape in shapes.items()}
    if s.view == "expanded":  # equal batch rows, so that an expanded view is value-preserving
        t = {n: x[:1].expand_as(x).clone() for n, x in t.items()}
    for name, factor in s.factors:
        t[name] = t[name] * factor
    if s.inject is not None:
        name, where, value = s.inject
        t[name][:, position(where, S, bounds), 0, 0] = value
    return Data(**{n: x.to(s.dtype) for n, x in t.items()}, bounds=bounds, seq_len=S)


def _extra_kv_head(x: Tensor) -> Tensor:
    return torch.cat([x, x[..., :1, :]], dim=-2)


MUTATIONS = {
    "k_float32": lambda q, k, v: (q, k.float(), v),
    "int_tensors": lambda q, k, v: tuple(x.detach().round().long() for x in (q, k, v)),
    "complex": lambda q, k, v: tuple(x.detach().to(torch.complex128) for x in (q, k, v)),
    "empty_seq": lambda q, k, v: tuple(x[:, :0] for x in (q, k, v)),
    "empty_batch": lambda q, k, v: tuple(x[:0] for x in (q, k, v)),
    "extra_dim": lambda q, k, v: tuple(x.unsqueeze(0) for x in (q, k, v)),
    "missing_dim": lambda q, k, v: tuple(x[0] for x in (q, k, v)),
    "heads_not_multiple": lambda q, k, v: (q, _extra_kv_head(k), _extra_kv_head(v)),
    "head_dim_mismatch": lambda q, k, v: (q, torch.cat([k, k], -1), torch.cat([v, v], -1)),
    "kv_heads_differ": lambda q, k, v: (q, k, v[..., :1, :]),
    "kv_len_differs": lambda q, k, v: (q, k[:, :-1], v[:, :-1]),
}
#: mutations that keep q, k, v stackable (usable with packed kv / qkv doors)
STACKABLE = ("int_tensors", "complex", "empty_seq", "extra_dim", "missing_dim")


CU_EDITS = {
    "int64": lambda cu: cu.long(),
    "list": lambda cu: cu.tolist(),
    "float": lambda cu: cu.float(),
    "short": lambda cu: cu[:-1],
    "decreasing": lambda cu: cu.flip(0),
    "2d": lambda cu: cu[None],
    "empty_doc": lambda cu: torch.cat([cu[:2], cu[1:]]),
}


def _resolve_kw(kw: dict, ctx: Ctx) -> dict:
    symbols = {"world": ctx.group}
    return {k: symbols[v.name] if isinstance(v, Sym) else v for k, v in kw.items()}


def _local_cu(door: Door, data: Data, ctx: Ctx) -> Tensor:
    if door.family == "llama3":
        import dtensor_ring as dr

        cu = torch.tensor(data.bounds, dtype=torch.int32)
        return dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, ctx.rank, ctx.world)[0]
    return oracle.local_cu_seqlens(data.bounds, ctx.world)


def rank0_overrides(ctx: Ctx, door: Door, setup: Setup) -> tuple[Door, Setup]:
    """``(door, setup)`` with ``setup.rank0`` applied on rank 0 (ranks that disagree)."""
    if ctx.rank == 0 and setup.rank0:
        overrides = dict(setup.rank0)
        door = overrides.pop("door", door)
        kw = {**setup.kw, **overrides.pop("kw", {})}
        extra = {**setup.extra, **overrides.pop("extra", {})}
        setup = replace(setup, kw=kw, extra=extra, **overrides)
    return door, setup


def attention_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """Call ``door`` on this rank's part of the case's data; checks against the reference."""
    door, setup = rank0_overrides(ctx, door, setup)
    data = make_data(door, setup, ctx.world)
    idx = door.indices(ctx.rank, ctx.world, data.seq_len, data.bounds)
    requires_grad = setup.grads or setup.extra.get("requires_grad", False)
    leaves = [x[:, idx].clone().requires_grad_(requires_grad) for x in (data.q, data.k, data.v)]
    args = MUTATIONS[setup.mutate](*leaves) if setup.mutate else leaves
    kw = _resolve_kw(setup.kw, ctx)
    if setup.cu_edit:
        name = "cu_seqlens_q" if door.family == "llama3" else "cu_seqlens"
        kw[name] = CU_EDITS[setup.cu_edit](_local_cu(door, data, ctx))
    if setup.lse:
        kw["return_attn_probs"] = True
    sinks = kw.get("sinks")
    if not (setup.grads and isinstance(sinks, Tensor) and sinks.is_floating_point()):
        sinks = None
    elif not setup.expect_error:  # a leaf: its gradient is checked too
        kw["sinks"] = sinks = sinks.detach().clone().requires_grad_()
    view = VIEWS[setup.view]
    dout = data.dout[:, idx] if setup.grads else None
    with _engine_spy(door) as used:
        out, lse = door.call(ctx, *args, kw, view, Tokens(idx, data.bounds), dout)
    if setup.expect_error:
        return {"returned": Flag(False, f"returned a result although {setup.expect_error}")}
    checks = _checks(door, setup, data, idx, out, lse, leaves, sinks)
    if door.layout == "auto":
        checks["engine"] = _engine_check(door, used)
    return checks


#: the engine (:func:`tests.engine_spy.engines_used`) of each algorithm ``layout="auto"`` runs
ENGINES = {"ring": "ring", "all_gather": "llama3", "ulysses": "ulysses"}


def _engine_check(door: Door, used: set[str]) -> Flag:
    """A ``layout="auto"`` call ran one engine: the forced one, else one its door can choose
    (no Ulysses for packed documents). SDPA on DTensors: the scope's forward and backward
    handlers choose separately, and its Ulysses runs the Ulysses op (not spied)."""
    if door.family in ("sdpa_fn", "sdpa_scope"):
        return Flag(used <= {"ring", "llama3"}, f"auto on DTensors: ran {sorted(used)}")
    if door.force:
        allowed = {ENGINES[door.force]}
    else:
        allowed = {"ring", "llama3"} if door.packed_stream else set(ENGINES.values())
    return Flag(
        len(used) == 1 and used <= allowed,
        f"{door.force or 'auto'}: ran {sorted(used)}, expected one of {sorted(allowed)}",
    )


def _engine_spy(door: Door):
    """The engines the call runs (:func:`tests.engine_spy.engines_used`) for a door of
    ``layout="auto"``; else nothing recorded."""
    if door.layout != "auto":
        return contextlib.nullcontext(set())
    from tests.engine_spy import engines_used

    return engines_used()


def reference_semantics(door: Door, setup: Setup) -> tuple[bool, tuple[int, int], float]:
    """``(causal, window, scale)`` the call means (``setup.ref`` overrides ``setup.kw``)."""
    kw = setup.kw
    causal = setup.ref.get("causal", kw.get("causal", door.family in ("hf", "hf_packed")))
    window = tuple(setup.ref.get("window", kw.get("window_size", (-1, -1))))
    scale = setup.ref.get("scale", kw.get("softmax_scale"))
    return bool(causal), window, setup.D**-0.5 if scale is None else float(scale)


def _checks(door, setup, data, idx, out, lse, leaves, sinks_leaf=None) -> dict:
    """Checks of a door's results; ``sinks_leaf``: the sinks whose gradient must be this
    rank's rows' share (docs/api.md, Attention sinks), or None."""
    causal, window, scale = reference_semantics(door, setup)
    visible = door.visible(data.seq_len, data.bounds, causal, window)
    dout = data.dout if setup.grads else None
    sinks = setup.ref.get("sinks", setup.kw.get("sinks"))
    ref = oracle.strict_attention(data.q, data.k, data.v, visible, scale, dout, sinks)
    finite = all(bool(torch.isfinite(x).all()) for x in (data.q, data.k, data.v))
    base = {}
    if setup.dtype != torch.float64 and finite and sinks is None:  # SDPA has no sinks
        base = oracle.baseline_errors(data.q, data.k, data.v, visible, scale, dout, ref)

    def check(got, want, name, dtype=setup.dtype):
        return Check(got, want, dtype, *oracle.tolerance(dtype, base.get(name)))

    checks = {"out": check(out, ref.out[:, idx], "out")}
    if setup.lse:
        lse_dtype = torch.float64 if setup.dtype == torch.float64 else torch.float32
        checks["lse"] = check(lse, ref.lse[:, :, idx], "lse", lse_dtype)
    if setup.grads:
        for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
            want = getattr(ref, name)[:, idx]
            checks[name] = check(
                view_grad(setup.view, leaf.grad), view_grad(setup.view, want), name
            )
    if sinks_leaf is not None:
        want = oracle.sinks_share(data.q, data.k, data.v, visible, scale, data.dout, sinks, idx)
        checks["dsinks"] = check(sinks_leaf.grad, want, "dsinks", sinks_leaf.dtype)
    return checks


def nonmember_case(ctx: Ctx, door: Door, setup: Setup, inner=attention_case) -> dict:
    """3 ranks; every rank calls the door with ``group = new_group([0, 1])``: ranks 0 and 1
    must get attention over their 2-rank group, rank 2 (outside it) a ValueError. ``inner``:
    the case function (attention, decoding, the KV cache)."""
    sub = dist.new_group([0, 1])
    if ctx.rank < 2:
        return inner(Ctx(ctx.rank, 2, sub), door, setup)
    try:
        inner(Ctx(1, 2, sub), door, setup)
    except ValueError:
        return {"non-member": Flag(True, "")}
    except TypeError as e:
        return {"non-member": Flag(False, f"rank 2 raised TypeError, not ValueError: {e}")}
    return {"non-member": Flag(False, "rank 2, outside the group, got a result")}


# --- double backward ------------------------------------------------------------------------


def double_backward_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """A backward with ``create_graph=True`` through ``door`` (``setup.extra["sinks"]``: with
    sinks that require grad): a ``RuntimeError`` naming double backward on every rank (Note
    [First-order backward] in ``ops/common.py``), or, should a door differentiate twice, the
    reference's second-order gradients (of ``|dq|^2 + |dk|^2 + |dv|^2`` summed over ranks)."""
    data = make_data(door, setup, ctx.world)
    idx = door.indices(ctx.rank, ctx.world, data.seq_len, data.bounds)
    leaves = [x[:, idx].clone().requires_grad_() for x in (data.q, data.k, data.v)]
    kw = dict(setup.kw)
    if setup.extra.get("sinks"):
        kw["sinks"] = _SINKS(leaves[0].shape[2]).double().requires_grad_()
    try:
        door.call(
            ctx,
            *leaves,
            kw,
            VIEWS[setup.view],
            Tokens(idx, data.bounds),
            data.dout[:, idx],
            create_graph=True,
        )
    except RuntimeError as e:
        return {"double_backward": Flag("double backward" in str(e), f"raised {e}")}
    grads = [leaf.grad for leaf in leaves]
    got = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), leaves, allow_unused=True)
    causal, window, scale = reference_semantics(door, setup)
    visible = door.visible(data.seq_len, data.bounds, causal, window)
    sinks = kw.get("sinks")
    want = oracle.second_order(data.q, data.k, data.v, visible, scale, data.dout, sinks)
    tol = oracle.tolerance(setup.dtype)
    return {
        f"d2{name}": Check(g, w[:, idx], setup.dtype, *tol)
        for name, g, w in zip("qkv", got, want, strict=True)
    }


def double_backward_cases() -> list[Case]:
    """Every door that trains (not the ones that reject their layout), at two world sizes,
    with and (where the door takes them) without sinks that require grad."""
    cases = []
    doors = [d for d in ALL_DOORS.values() if d not in AUTO_REJECTING]
    for i, door in enumerate(doors):
        for j, world in enumerate((_pick(WORLDS, i), _pick(WORLDS, i + 2))):
            sinks = j == 1 and "sinks" in door.accepts
            setup = Setup(kw={"causal": True}, extra={"sinks": sinks})
            detail = "create_graph" + ",sinks" * sinks
            cases.append(
                _case("double_backward", door, world, detail, setup, fn=double_backward_case)
            )
    return cases


# --- DTensor defaults (f) -------------------------------------------------------------------


def dtensor_case(
    ctx: Ctx, placement: str, api: str, api_kw: dict, causal: bool, extra_tokens: int = 0
) -> dict:
    """SDPA on DTensors ``[B, H, S, D]`` built by ``placement`` ("distribute": contiguous
    ``distribute_tensor`` shards; "shard_sequence" / "shard_sequence:<layout>"; "replicate";
    "shard_heads"), through ``api`` ("scope": ``F.scaled_dot_product_attention`` inside
    ``ring_sdpa(**api_kw)``, forward and backward; "scope,backward_outside": the backward
    after leaving the scope; "scope,handlers": under a pass-through ``TorchDispatchMode``, so
    through the aten-op handlers rather than the eager route (Note [Eager SDPA on DTensors]);
    "scope,autocast" (also with "handlers"): fp32 DTensors under ``torch.autocast`` (CPU,
    bf16), where SDPA computes in bf16; "fn": ``scaled_dot_product_ring_attention(...,
    **api_kw)``). The full output and gradients are compared with the reference."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_ring as dr
    from tests.modes import PassThroughMode

    W = ctx.world
    H = 12 if W == 3 else 4
    B, S, D = 2, 4 * W + extra_tokens, 8
    gen = torch.Generator().manual_seed(0)
    full = [
        torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, H // 2, H // 2, H)
    ]
    parts = api.split(",")
    autocast = "autocast" in parts
    leaf_dtype = torch.float32 if autocast else torch.float64
    mesh = cpu_mesh(W)
    how, _, layout = placement.partition(":")
    layout_kw = {"layout": layout} if layout else {}
    if how == "shard_sequence":
        dts = [dr.shard_sequence(x.to(leaf_dtype), mesh, 2, **layout_kw) for x in full]

        def unshard(t):
            return dr.unshard_sequence(t, 2, **layout_kw)
    else:
        place = {"distribute": Shard(2), "replicate": Replicate(), "shard_heads": Shard(1)}[how]
        dts = [distribute_tensor(x.to(leaf_dtype), mesh, [place]) for x in full]

        def unshard(t):
            return t.full_tensor()

    q, k, v, dout = dts
    for t in (q, k, v):
        t.requires_grad_()

    if parts[0] == "scope":
        with (
            dr.ring_sdpa(**api_kw),
            PassThroughMode() if "handlers" in parts else contextlib.nullcontext(),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        ):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            if "backward_outside" not in parts:
                (out * dout).sum().backward()
        if "backward_outside" in parts:
            (out * dout).sum().backward()
    else:
        out = dr.scaled_dot_product_ring_attention(
            q, k, v, is_causal=causal, enable_gqa=True, **api_kw
        )
        (out * dout).sum().backward()
    qf, kf, vf, df = (x.transpose(1, 2) for x in full)
    visible = oracle.visible_dense(S, causal)
    ref = oracle.strict_attention(qf, kf, vf, visible, D**-0.5, df)
    base, compute = {}, torch.float64
    if autocast:  # one device: SDPA on the autocast dtype's inputs
        compute = torch.bfloat16
        bf16 = (x.to(compute) for x in (qf, kf, vf))
        base = oracle.baseline_errors(*bf16, visible, D**-0.5, df, ref)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    checks = {}
    for name, want in (("out", ref.out), ("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        g = got[name]
        g = None if g is None else unshard(g).transpose(1, 2)
        dtype = compute if name == "out" else leaf_dtype  # gradients: the leaves' dtype
        checks[name] = Check(g, want, dtype, *oracle.tolerance(compute, base.get(name)))
    return checks


# --- transformers models (g) ----------------------------------------------------------------


def _hf_config(arch: str):
    import transformers

    common = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **common,
            intermediate_size=32,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["full_attention"],
        )
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(**common, intermediate_size=64)


def hf_model_case(ctx: Ctx, arch: str, layout: str, docs: tuple[int, ...] | None = None) -> dict:
    """A tiny transformers model with ``attn_implementation="dtensor_ring"`` on this rank's
    shard vs the same model (SDPA attention, one process) on the whole batch: logits of the
    rank's tokens and the loss (summed over ranks). ``docs``: a packed row of documents."""
    from transformers import AutoModelForCausalLM

    import dtensor_ring.hf as drhf

    # gpt_oss: fp32 and eager attention (its MoE has no fp64 kernel, its sinks no SDPA path)
    dtype = torch.float32 if arch == "gpt_oss" else torch.float64
    reference = "eager" if arch == "gpt_oss" else "sdpa"
    torch.manual_seed(0)
    ref_model = AutoModelForCausalLM.from_config(
        _hf_config(arch), attn_implementation=reference, dtype=dtype
    )
    drhf.setup(group=ctx.group, layout=layout)
    model = AutoModelForCausalLM.from_config(
        _hf_config(arch), attn_implementation="dtensor_ring", dtype=dtype
    )
    model.load_state_dict(ref_model.state_dict())
    S = 8 * ctx.world
    ids = torch.randint(0, 64, (1 if docs else 2, S), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if docs:
        bounds = [0, *itertools.accumulate(docs)]
        batch["position_ids"] = oracle.doc_positions(torch.arange(S), bounds)[None]
        batch["labels"][0, bounds[:-1]] = -100  # as DataCollatorWithFlattening
    local = drhf.shard_batch(batch, group=ctx.group, layout=layout)
    out = model(**local)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=ctx.group)
    if docs:  # documents are separate sequences for the reference
        ref_logits = torch.cat(
            [ref_model(input_ids=ids[:, a:b]).logits for a, b in itertools.pairwise(bounds)], 1
        )
        idx = (
            placed_layout_of(layout, bounds, ctx.world).indices[ctx.rank]
            if layout in PLACED
            else oracle.varlen_indices(layout, bounds, ctx.rank, ctx.world)
        )
    else:
        ref_logits = ref_model(input_ids=ids).logits
        idx = oracle.dense_indices(layout, ctx.rank, ctx.world, S)
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    tol = oracle.tolerance(dtype, 1e-6 if dtype == torch.float32 else 1e-11)
    return {
        "logits": Check(out.logits.detach(), ref_logits.detach()[:, idx].double(), dtype, *tol),
        # transformers computes the loss in fp32 whatever the model's dtype
        "loss": Check(
            loss, ref_loss.detach().double(), torch.float32, *oracle.tolerance(torch.float32)
        ),
    }


# --- generators -----------------------------------------------------------------------------


def _pick(seq, i: int):
    return seq[i % len(seq)]


def _doors(*names: str) -> list[Door]:
    return [DOORS[n] for n in names]


#: one door per family and layout, plus packed forms: the doors of the sampled kinds
REPRESENTATIVE = _doors(
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "stripe_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_func",
    "ulysses_flash_attn_func[ring]",
    "ulysses_flash_attn_func[zigzag]",
    "ulysses_flash_attn_qkvpacked_func",
    "hybrid_flash_attn_func[zigzag]",
    "hybrid_flash_attn_func[ring]",
    "scaled_dot_product_ring_attention[zigzag,ring]",
    "scaled_dot_product_ring_attention[stripe,ulysses]",
    "ring_sdpa+F.sdpa[ring,ring]",
    "ring_sdpa+F.sdpa[zigzag,ulysses]",
    "hf.ring_attention_forward[zigzag]",
    "hf.ring_attention_forward[packed,llama3]",
)


def _backends(door: Door) -> tuple:
    """Backends a door can run: varlen kernels on CPU are "math" only (the all-gather layout
    runs them on dense sequences too); None only for a door without ``backend=``."""
    if "backend" not in door.accepts:
        return (None,)
    gather = door.layout == "llama3_zigzag" and door.family != "ulysses"
    if door.layout == "auto":  # the all-gather is the choice on 2+ ranks (when not forced)
        gather = door.force in ("", "all_gather")
    return (None, "math") if door.packed_stream or gather else BACKENDS


def _maybe_backends(door: Door) -> tuple:
    """Backends a door runs or rejects cleanly depending on its call: ``layout="auto"``'s
    cost model choosing the ring (correct) or the all-gather (no dense varlen kernel)."""
    if door.layout != "auto" or door.force or door.packed_stream or "backend" not in door.accepts:
        return ()
    return tuple(b for b in BACKENDS if b not in _backends(door))


def _case(kind, door, world, detail, setup, expect=CORRECT, fn=attention_case, **extra) -> Case:
    """A case of ``fn(door, setup)``, named ``kind/door/W<world>/detail[,backend=...]``."""
    if "backend" in setup.kw and "backend=" not in detail:
        detail += f",backend={setup.kw['backend']}"
    params = {"door": door, "setup": setup}
    return Case(f"{kind}/{door.name}/W{world}/{detail}", kind, world, fn, params, expect, **extra)


def _backend_kw(backend: str | None) -> dict:
    return {} if backend is None else {"backend": backend}


def _retag(cases: list[Case], kind: str) -> list[Case]:
    """``cases`` of another generator as cases of ``kind``: ``kind/door/W<w>/<their kind>:detail``
    (the kinds of the later front doors reuse the generators of the adversities)."""
    for c in cases:
        own, door, world, detail = c.name.split("/", 3)
        c.name, c.kind = f"{kind}/{door}/{world}/{own}:{detail}", kind
    return cases


def base_cases(doors=None) -> list[Case]:
    cases = []
    for door in doors or DOORS.values():
        backends = BACKENDS if "backend" in door.accepts else (None,)
        for world, backend in itertools.product(WORLDS, backends):
            ok = backend in _backends(door)
            maybe = backend in _maybe_backends(door)
            setup = Setup(
                kw={"causal": True, **_backend_kw(backend)},
                lse=door.has_lse and backend == "math",
                expect_error=None if ok or maybe else f"backend={backend} has no varlen kernel",
            )
            expect = CORRECT if ok else EITHER if maybe else ERROR
            cases.append(_case("base", door, world, f"backend={backend}", setup, expect))
    return cases


def debug_on_cases(doors=None) -> list[Case]:
    """Consistent calls with the consistency mode on: still correct."""
    return [
        _case(
            "debug_on",
            door,
            _pick((2, 3, 4), i),
            "causal",
            Setup(kw={"causal": True}, lse=door.has_lse),
            env=DEBUG_ENV,
        )
        for i, door in enumerate(doors or DOORS.values())
    ]


def _mask_variants(door: Door, world: int):
    """(detail, kw, heads) of the mask kind for ``door``."""
    H = default_heads(door, world)[0]
    windows = "window_size" in door.accepts
    variants = [
        ("window=(2,0)", {"causal": True, "window_size": (2, 0)}, None),
        ("window=(0,0)", {"causal": True, "window_size": (0, 0)}, None),
        ("window=(100,0)", {"causal": True, "window_size": (100, 0)}, None),
    ] * windows
    if not door.causal_only:
        variants.append(("noncausal", {"causal": False}, None))
        # zigzag's ring is causal or maskless: "auto" forced to the ring has no algorithm left
        windows = windows and door.force != "ring"
        variants += [
            ("noncausal,window=(1,2)", {"causal": False, "window_size": (1, 2)}, None),
            ("noncausal,window=(0,0)", {"causal": False, "window_size": (0, 0)}, None),
        ] * windows
    if door.packing != "qkv":
        variants.append(("mqa", {"causal": True}, (H, 1)))
    variants.append(("mha", {"causal": True}, (H, H)))
    return variants


def mask_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or DOORS.values()):
        for j in range(len(_mask_variants(door, 1))):
            world = _pick(WORLDS, i + j)
            detail, kw, heads = _mask_variants(door, world)[j]
            kw = {**kw, **_backend_kw(_pick(_backends(door), i + j))}
            cases.append(_case("mask", door, world, detail, Setup(kw=kw, heads=heads)))
    return cases


def layout_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or DOORS.values()):
        for j, view in enumerate(v for v in VIEWS if v != "contiguous"):
            if door.packed_stream and view in ("channels_last", "expanded"):
                continue
            world = _pick(WORLDS, i + j)
            kw = {"causal": True, **_backend_kw(_pick(_backends(door), i + 2 * j))}
            cases.append(_case("layout", door, world, f"view={view}", Setup(kw=kw, view=view)))
    return cases


def nonfinite_cases(doors=None) -> list[Case]:
    values = (math.nan, math.inf, -math.inf)
    cases = []
    for i, door in enumerate(doors or REPRESENTATIVE):
        positions = ["early", "late", "middle"] + ["window"] * ("window_size" in door.accepts)
        positions += ["document"] * door.packed_stream
        for j, (tensor, where) in enumerate(itertools.product("qkv", positions)):
            value = _pick(values, i + j)
            kw = {"causal": True, **_backend_kw(_pick(_backends(door), j))}
            if where == "window":
                kw["window_size"] = (2, 0)
            inject = (tensor, "middle" if where == "window" else where, value)
            setup = Setup(kw=kw, inject=inject)
            detail = f"{value}@{tensor}:{where}"
            cases.append(_case("nonfinite", door, _pick(WORLDS, i + j), detail, setup))
    return cases


SCALES = (
    ("0", 0.0, CORRECT),
    ("negative", -0.7, CORRECT),
    ("tiny", 1e-30, CORRECT),
    ("huge", 1e4, CORRECT),
    ("int", 1, CORRECT),
    ("tensor", torch.tensor(0.3, dtype=torch.float64), EITHER),
    ("nan", math.nan, ERROR),
    ("inf", math.inf, ERROR),
    ("-inf", -math.inf, ERROR),
    ("str", "0.5", ERROR),
    ("bool", True, ERROR),
)


def _SINKS(H: int) -> Tensor:  # noqa: N802  (a constant's maker)
    """Attention-sink logits ``[H]`` of every size relative to the scores (fp32)."""
    return torch.linspace(-3.0, 3.0, H)


SINKS = [
    # label, sinks(H) -> value, expect
    ("linspace", _SINKS, CORRECT),
    ("fp64", lambda H: _SINKS(H).double(), CORRECT),
    ("wrong_length", lambda H: _SINKS(H + 1), ERROR),
    ("2-D", lambda H: _SINKS(H)[None], ERROR),
    ("int", lambda H: torch.arange(H), ERROR),
    ("list", lambda H: _SINKS(H).tolist(), ERROR),
]


def sinks_cases(doors=None) -> list[Case]:
    """``sinks=`` (attention sinks) through every door that takes it: exact or a clean error
    (also the later doors: the llama3_zigzag doors, ``layout="auto"`` choosing Ulysses,
    decoding and the KV cache)."""
    cases = []
    if doors is None:
        from .inference import decode_sinks_cases, kv_cache_sinks_cases

        auto_ulysses = AUTO_DOORS["ring_attention_func[auto:ulysses]"]
        return (
            sinks_cases([*REPRESENTATIVE, *LLAMA3_ZIGZAG_PRIMARY, auto_ulysses])
            + decode_sinks_cases()
            + kv_cache_sinks_cases()
        )
    for i, door in enumerate(doors):
        if "sinks" not in door.accepts:
            continue
        for j, (label, make, expect) in enumerate(SINKS):
            world = _pick(WORLDS, i + j)
            H = default_heads(door, world)[0]
            error = None if "correct" in expect else f"sinks={label}"
            setup = Setup(
                kw={"causal": True, "sinks": make(H)}, expect_error=error, grads=error is None
            )
            cases.append(_case("sinks", door, world, f"sinks={label}", setup, expect))
    return cases


def scale_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or REPRESENTATIVE):
        for j, (label, value, expect) in enumerate(SCALES):
            ref = {}
            if label == "bool" and door.family == "sdpa_scope":  # torch's SDPA reads True as 1.0
                expect, ref = EITHER, {"scale": 1.0}
            error = None if "correct" in expect else f"softmax_scale={value!r}"
            kw = {"causal": True, "softmax_scale": value}
            setup = Setup(kw=kw, ref=ref, expect_error=error, grads=error is None)
            world = _pick(WORLDS, i + j)
            cases.append(_case("scale", door, world, f"softmax_scale={label}", setup, expect))
    return cases


@dataclass(frozen=True)
class ArgCase:
    """A malformed (or odd but valid) argument: ``kw`` merged into ``causal=True``, or a
    ``setup`` edit; ``expect``; ``ref``: what it means when valid; ``applies(door)``."""

    label: str
    kw: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    expect: frozenset = ERROR
    ref: dict = field(default_factory=dict)
    families: tuple[str, ...] = ()
    needs: str = ""  # the door must accept this keyword
    noncausal: bool = False  # the door must support non-causal attention
    unpacked: bool = False  # the door takes separate q, k, v (shape-changing mutations)
    worlds: tuple[int, ...] = WORLDS
    exclude: tuple[str, ...] = ()  # families left out

    def applies(self, door: Door) -> bool:
        if self.families and door.family not in self.families:
            return False
        if door.family in self.exclude:
            return False
        if self.needs and self.needs not in door.accepts:
            return False
        if self.noncausal and door.causal_only:
            return False
        return not (self.unpacked and door.packing)


_FLASHY = ("flash", "ring_fn", "varlen", "llama3", "ulysses", "hybrid")
_PACKED = ("varlen", "llama3")
_HF = ("hf", "hf_packed")  # their window is transformers' sliding_window (kind hf)
ARG_CASES = (
    ArgCase(
        "causal='False'",
        {"causal": "False"},
        ref={"causal": False},
        families=_FLASHY + ("sdpa_fn", "sdpa_scope", "cp"),
    ),
    ArgCase("causal=1", {"causal": 1}, expect=EITHER, families=_FLASHY),
    ArgCase(
        "causal=0",
        {"causal": 0},
        expect=EITHER,
        ref={"causal": False},
        families=_FLASHY,
        noncausal=True,
    ),
    ArgCase("causal=None", {"causal": None}, families=_FLASHY + ("sdpa_fn",)),
    ArgCase("window='(2,0)'", {"window_size": "(2, 0)"}, needs="window_size", exclude=_HF),
    ArgCase("window=(2,)", {"window_size": (2,)}, needs="window_size", exclude=_HF),
    ArgCase("window=(2,0,0)", {"window_size": (2, 0, 0)}, needs="window_size", exclude=_HF),
    ArgCase(
        "window=(2.0,0.0)",
        {"window_size": (2.0, 0.0)},
        expect=EITHER,
        ref={"window": (2, 0)},
        needs="window_size",
        exclude=_HF,
    ),
    ArgCase("window=(-2,0)", {"window_size": (-2, 0)}, needs="window_size", exclude=_HF),
    ArgCase(
        "window=[2,0]",
        {"window_size": [2, 0]},
        expect=CORRECT,
        ref={"window": (2, 0)},
        needs="window_size",
        exclude=_HF,
    ),
    ArgCase(
        "window=(True,False)", {"window_size": (True, False)}, needs="window_size", exclude=_HF
    ),
    ArgCase("window=None", {"window_size": None}, needs="window_size", exclude=_HF),
    ArgCase("group=0", {"group": 0}, needs="group"),
    ArgCase("group='world'", {"group": "world"}, needs="group"),
    ArgCase(
        "same_ulysses_and_ring_group",
        {"ulysses_group": Sym("world"), "ring_group": Sym("world")},
        families=("hybrid",),
        worlds=(2, 3, 4),
    ),
    ArgCase("ring_group=0", {"ring_group": 0}, families=("hybrid",)),
    ArgCase("dropout_p=0.1", {"dropout_p": 0.1}, needs="dropout_p"),
    ArgCase("dropout_p='0'", {"dropout_p": "0"}, needs="dropout_p"),
    ArgCase("dropout_p=0", {"dropout_p": 0}, expect=CORRECT, needs="dropout_p"),
    ArgCase(
        "alibi_slopes", {"alibi_slopes": torch.ones(4)}, needs="alibi_slopes", worlds=(1, 2, 4)
    ),
    ArgCase("backend='nope'", {"backend": "nope"}, needs="backend"),
    ArgCase("backend=1", {"backend": 1}, needs="backend"),
    ArgCase("backend='cudnn'", {"backend": "cudnn"}, needs="backend"),
    ArgCase("backend='flash_attn'", {"backend": "flash_attn"}, needs="backend"),
    ArgCase("deterministic='yes'", {"deterministic": "yes"}, needs="deterministic"),
    ArgCase("deterministic=True", {"deterministic": True}, expect=EITHER, needs="deterministic"),
    ArgCase(
        "return_attn_probs=1", {"return_attn_probs": 1}, expect=EITHER, needs="return_attn_probs"
    ),
    ArgCase(
        "attn_mask",
        {"attn_mask": torch.ones(8, 8, dtype=torch.bool)},
        needs="attn_mask",
        worlds=(2,),
    ),
    ArgCase("enable_gqa=False", {"enable_gqa": False}, needs="enable_gqa"),
    *(ArgCase(m, setup={"mutate": m}) for m in STACKABLE),
    *(ArgCase(m, setup={"mutate": m}, unpacked=True) for m in MUTATIONS if m not in STACKABLE),
    ArgCase(
        "ulysses_heads_not_divisible", setup={"heads": (4, 2)}, families=("ulysses",), worlds=(3,)
    ),
    ArgCase("zigzag_odd_s_local", setup={"s_local": 3}, families=("flash", "ring_fn")),
    ArgCase("max_seqlen='8'", {"max_seqlen": "8"}, families=("varlen",)),
    ArgCase("max_seqlen=1", {"max_seqlen": 1}, expect=EITHER, families=("varlen",)),
    ArgCase("max_seqlen_q='x'", {"max_seqlen_q": "x"}, families=("llama3",)),
    ArgCase("heads_k_stride=0", {"heads_k_stride": 0}, needs="heads_k_stride"),
    ArgCase("heads_k_stride=5", {"heads_k_stride": 5}, needs="heads_k_stride"),
    ArgCase("local_k_slice=(0,4)", {"local_k_slice": (0, 4)}, families=("llama3",)),
    ArgCase("local_k_slice=step2", {"local_k_slice": slice(0, 8, 2)}, families=("llama3",)),
    *(
        ArgCase(
            f"cu_seqlens={e}",
            setup={"cu_edit": e},
            expect=EITHER if e in ("int64", "list", "empty_doc") else ERROR,
            families=_PACKED,
        )
        for e in CU_EDITS
    ),
)


def _arg_setup(door: Door, arg: ArgCase) -> Setup:
    edits = dict(arg.setup)
    if arg.label == "ulysses_heads_not_divisible" and door.packing == "qkv":
        edits["heads"] = (4, 4)
    error = None if "correct" in arg.expect else arg.label
    grads = "correct" in arg.expect
    return Setup(
        kw={"causal": True, **arg.kw}, ref=arg.ref, expect_error=error, grads=grads, **edits
    )


def _arg_doors(arg: ArgCase, doors: list[Door]) -> list[Door]:
    """The doors of ``doors`` that ``arg`` is a case of."""
    doors = [d for d in doors if arg.applies(d)]
    if arg.setup.get("mutate") == "empty_batch":
        doors = [d for d in doors if not d.packed_stream]
    if arg.setup.get("mutate") in ("extra_dim", "missing_dim"):
        doors = [d for d in doors if d.family not in ("sdpa_fn", "sdpa_scope", "hf", "hf_packed")]
    if arg.label == "zigzag_odd_s_local":
        doors = [d for d in doors if d.layout in ("zigzag", "llama3_zigzag")]
    return doors


#: arguments that F.scaled_dot_product_attention's own argument parser rejects (by type) before
#: the ring_sdpa scope sees the call; the scope's own arguments (window_size) are checked when
#: it is entered, where no group is known: neither can reach the other ranks
_SDPA_PARSED = ("causal='False'", "dropout_p='0'")


def args_cases(doors=None, extra: tuple[ArgCase, ...] = ()) -> list[Case]:
    cases = []
    all_doors = list(doors or DOORS.values())
    for i, arg in enumerate(ARG_CASES + extra):
        for j, door in enumerate(_arg_doors(arg, all_doors)):
            world = _pick(arg.worlds, i + j)
            cases.append(_case("args", door, world, arg.label, _arg_setup(door, arg), arg.expect))
    for door in all_doors:
        if "group" in door.accepts:
            setup = Setup(kw={"causal": True})
            cases.append(_case("args", door, 3, "rank_outside_group", setup, fn=nonmember_case))
    for i, arg in enumerate(ARG_CASES + extra):  # rank 0 alone passes it
        if arg.expect != ERROR or "group" in arg.label:  # a group: no group to tell the others
            continue
        families = {}  # a door of each family, taken in turn
        for d in _arg_doors(arg, all_doors):
            if d.family == "sdpa_scope" and (arg.label in _SDPA_PARSED or "window_size" in arg.kw):
                continue  # raised before any door sees the call (docs/troubleshooting.md)
            families.setdefault(d.family, []).append(d)
        for j, doors in enumerate(families.values()):
            door = doors[i % len(doors)]
            setup = _arg_setup(door, arg)
            valid = _on_rank0(setup, arg.kw, **{f: getattr(setup, f) for f in arg.setup})
            cases.append(
                _case("args", door, 3 - (i + j) % 2, f"rank0:{arg.label}", valid, fn=one_rank_case)
            )
    return cases


def raises_here(call: Callable[[], object]) -> dict:
    """The check of a call in which rank 0 alone passes a malformed argument: its error
    reaches every rank (Note [Consistency header]), so ``call()`` raises ``ValueError`` /
    ``TypeError`` here (rank 0 its own, the others the relayed one) rather than return; a
    rank that waits for rank 0 is the runner's hang."""
    try:
        call()
    except (ValueError, TypeError) as e:
        return {"raised": Flag(True, f"{type(e).__name__}: {e}")}
    return {"raised": Flag(False, "returned a result although rank 0's argument is malformed")}


def one_rank_case(ctx: Ctx, door: Door, setup: Setup, inner=attention_case) -> dict:
    """``inner`` (:func:`attention_case`; decoding, the KV cache) with ``setup.rank0``
    malformed (:func:`raises_here`)."""
    return raises_here(lambda: inner(ctx, door, setup))


def _on_rank0(setup: Setup, kw: dict, **fields: object) -> Setup:
    """``setup`` valid on every rank but rank 0, which passes ``kw`` and ``fields`` (the
    malformed argument of a :func:`one_rank_case`)."""
    defaults = {f: getattr(Setup(), f) for f in fields}
    return replace(setup, kw={"causal": True}, expect_error=None, grads=False, **defaults,
                   rank0={"kw": kw, **fields})  # fmt: skip


_SDPA_FN = "scaled_dot_product_ring_attention"


def _other_door(door: Door, field_name: str) -> Door | None:
    """The door rank 0 uses when ranks disagree on the layout or the op."""
    swaps = {
        "layout": {
            "ring_flash_attn_func": "zigzag_ring_flash_attn_func",
            "zigzag_ring_flash_attn_func": "stripe_flash_attn_func",
            "ring_flash_attn_varlen_func": "zigzag_ring_flash_attn_varlen_func",
            "ulysses_flash_attn_func[ring]": "ulysses_flash_attn_func[zigzag]",
            "hybrid_flash_attn_func[zigzag]": "hybrid_flash_attn_func[ring]",
            f"{_SDPA_FN}[zigzag,ring]": f"{_SDPA_FN}[ring,ring]",
            # the same tokens, K/V passed around the ring instead of all-gathered
            "llama3_zigzag_flash_attn_func": "zigzag_ring_flash_attn_func",
            "llama3_zigzag_flash_attn_varlen_func": "zigzag_ring_flash_attn_varlen_func",
            # "auto" chooses the all-gather on 2+ ranks: rank 0 runs the ring instead
            "ring_attention_func[auto]": "zigzag_ring_flash_attn_func",
            "ring_varlen_attention_func[auto]": "zigzag_ring_flash_attn_varlen_func",
        },
        "op": {
            "ring_flash_attn_func": "ulysses_flash_attn_func[ring]",
            "zigzag_ring_flash_attn_func": "ulysses_flash_attn_func[zigzag]",
            "ring_flash_attn_varlen_func": "llama3_flash_attn_varlen_func",
            f"{_SDPA_FN}[zigzag,ring]": f"{_SDPA_FN}[zigzag,ulysses]",
            "ring_attention_func[auto]": "ulysses_flash_attn_func[zigzag]",
            # placed documents: rank 0 runs the ring, the others fetch what they need
            "ring_varlen_attention_func[documents,all_gather]": (
                "ring_varlen_attention_func[documents]"
            ),
        },
    }
    name = swaps.get(field_name, {}).get(door.name)
    return None if name is None else ALL_DOORS[name]


DISAGREE_DOORS = _doors(
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_func",
    "ulysses_flash_attn_func[ring]",
    "hybrid_flash_attn_func[zigzag]",
    "scaled_dot_product_ring_attention[zigzag,ring]",
    "ring_sdpa+F.sdpa[ring,ring]",
    "hf.ring_attention_forward[zigzag]",
)
#: disagreements that do not change the result (either answer is fine)
NEUTRAL = ("backend", "deterministic")
#: time limit of a disagreement case: a consistent call takes about a second, and many of
#: these hang until the limit when the consistency mode is off
DISAGREE_TIMEOUT_S = 15.0


def _disagreements(door: Door, world: int) -> list[tuple[str, dict]]:
    """(field, rank-0 overrides) for ``door``."""
    H = default_heads(door, world)[0]
    out = [
        ("dtype", {"dtype": torch.float32}),
        ("head_dim", {"D": 16}),
        ("heads", {"heads": (2 * H, H)}),
        ("causal", {"kw": {"causal": False}}),
        ("scale", {"kw": {"softmax_scale": 0.5}}),
    ]
    if "window_size" in door.accepts:
        out.append(("window", {"kw": {"window_size": (2, 0)}}))
    if door.family in ("ulysses", "hybrid"):  # the lse's all-to-all on rank 0 alone
        out.append(("lse_returned", {"kw": {"return_attn_probs": True}}))
    if door.packed_stream:
        docs = (
            (5, 8 * world - 7, 2) if door.layout == "llama3" else (2 * world, 4 * world, 2 * world)
        )
        out.append(("documents", {"docs": docs}))
    else:
        out += [("seq_len", {"s_local": 6}), ("batch", {"B": 1})]
    if "heads_k_stride" in door.accepts:
        # the llama3 door passes H_kv, the llama3_zigzag doors default to 1
        stride = 1 if door.family == "llama3" else 2
        out.append(("heads_k_stride", {"kw": {"heads_k_stride": stride}}))
    for name in ("layout", "op"):
        other = _other_door(door, name)
        if other is not None:
            out.append((name, {"door": other}))
    if (
        "backend" in door.accepts
        and door.family not in ("hf", "hf_packed")
        and not (door.packed_stream or door.layout in ("llama3_zigzag", "auto"))
    ):
        out.append(("backend", {"kw": {"backend": "math"}}))
    if "deterministic" in door.accepts:
        out.append(("deterministic", {"kw": {"deterministic": True}}))
    return out


def _nodebug_expect(door: Door, field: str) -> frozenset | None:
    """What a disagreement gives with the consistency mode off: on gloo the header (Note
    [Consistency header]) raises on every rank for every field it hashes; per-rank llama3
    metadata that does not fit together is beyond a fixed-size header (None: informational);
    a neutral field may also be tolerated."""
    if field in NEUTRAL:
        return EITHER
    if field == "documents" and door.family == "llama3":
        return None
    return ERROR


def disagree_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or DISAGREE_DOORS):
        for j in range(len(_disagreements(door, 2))):
            world = _pick((2, 3, 4), i + j)
            name, rank0 = _disagreements(door, world)[j]
            kw = {"causal": True}
            if name == "backend":
                kw["backend"] = "cpu_flash"
            neutral = name in NEUTRAL
            error = None if neutral else f"the ranks disagree on {name}"
            setup = Setup(kw=kw, rank0=rank0, expect_error=error, grads=neutral)
            for variant, env, expect in (
                ("debug", DEBUG_ENV, EITHER if neutral else ERROR),
                ("nodebug", {}, _nodebug_expect(door, name)),
            ):
                detail = f"{name}[{variant}]"
                cases.append(
                    _case(
                        "disagree",
                        door,
                        world,
                        detail,
                        setup,
                        expect,
                        env=env,
                        timeout_s=DISAGREE_TIMEOUT_S,
                    )
                )
    return cases


DTENSOR_VARIANTS = (
    ("distribute+ring_sdpa()", "distribute", "scope", {}, True, 0, CORRECT),
    ("distribute+ring_sdpa(),noncausal", "distribute", "scope", {}, False, 0, EITHER),
    (
        "distribute+ring_sdpa(mode=ulysses)",
        "distribute",
        "scope",
        {"mode": "ulysses"},
        True,
        0,
        EITHER,
    ),
    (
        "distribute+ring_sdpa(layout=ring)",
        "distribute",
        "scope",
        {"layout": "ring"},
        True,
        0,
        CORRECT,
    ),
    ("distribute+sdpa_ring_attention()", "distribute", "fn", {}, True, 0, CORRECT),
    ("shard_sequence()+ring_sdpa()", "shard_sequence", "scope", {}, True, 0, CORRECT),
    (
        "shard_sequence()+ring_sdpa(),handlers",
        "shard_sequence",
        "scope,handlers",
        {},
        True,
        0,
        CORRECT,
    ),
    (
        "shard_sequence(zigzag)+ring_sdpa(zigzag),handlers",
        "shard_sequence:zigzag",
        "scope,handlers",
        {"layout": "zigzag"},
        True,
        0,
        CORRECT,
    ),
    (
        "shard_sequence(zigzag)+ring_sdpa(zigzag),autocast",
        "shard_sequence:zigzag",
        "scope,autocast",
        {"layout": "zigzag"},
        True,
        0,
        CORRECT,
    ),
    (
        "shard_sequence(zigzag)+ring_sdpa(zigzag),handlers,autocast",
        "shard_sequence:zigzag",
        "scope,handlers,autocast",
        {"layout": "zigzag"},
        True,
        0,
        CORRECT,
    ),
    (
        "distribute_uneven+ring_sdpa(layout=ring),handlers",
        "distribute",
        "scope,handlers",
        {"layout": "ring"},
        True,
        1,
        EITHER,
    ),
    (
        "shard_sequence(stripe)+ring_sdpa(stripe)",
        "shard_sequence:stripe",
        "scope",
        {"layout": "stripe"},
        True,
        0,
        CORRECT,
    ),
    (
        "distribute_uneven+ring_sdpa(layout=ring)",
        "distribute",
        "scope",
        {"layout": "ring"},
        True,
        1,
        EITHER,
    ),
    ("replicate+ring_sdpa()", "replicate", "scope", {}, True, 0, EITHER),
    ("shard_heads+ring_sdpa()", "shard_heads", "scope", {}, True, 0, EITHER),
    (
        "distribute+ring_sdpa(),backward_outside",
        "distribute",
        "scope,backward_outside",
        {},
        True,
        0,
        EITHER,
    ),
)


def dtensor_cases() -> list[Case]:
    cases = []
    for label, placement, api, api_kw, causal, extra, expect in DTENSOR_VARIANTS:
        for world in WORLDS:
            params = dict(
                placement=placement, api=api, api_kw=api_kw, causal=causal, extra_tokens=extra
            )
            name = f"dtensor/{label}/W{world}"
            cases.append(Case(name, "dtensor", world, dtensor_case, params, expect))
    return cases


def _hf_kwarg_variants(door: Door, world: int) -> list[tuple[str, dict, dict, frozenset]]:
    """(label, kw, ref, expect) of the transformers keyword cases."""
    H = default_heads(door, world)[0]
    variants = [
        ("s_aux", {"hf_kwargs": {"s_aux": _SINKS(H)}}, {"sinks": _SINKS(H)}, CORRECT),
        ("s_aux+sinks", {"hf_kwargs": {"s_aux": _SINKS(H), "sinks": _SINKS(H)}}, {}, ERROR),
        ("softcap=None", {"hf_kwargs": {"softcap": None}}, {}, CORRECT),
        ("softcap=30", {"hf_kwargs": {"softcap": 30.0}}, {}, ERROR),
        ("is_causal=False", {"hf_kwargs": {"is_causal": False}}, {"causal": False}, EITHER),
        ("is_causal=True", {"hf_kwargs": {"is_causal": True}}, {}, CORRECT),
        ("sliding_window=3", {"window_size": (2, 0)}, {}, CORRECT),
        ("sliding_window=0", {"hf_kwargs": {"sliding_window": 0}}, {}, ERROR),
        ("sliding_window=True", {"hf_kwargs": {"sliding_window": True}}, {}, ERROR),
        ("sliding_window=2.5", {"hf_kwargs": {"sliding_window": 2.5}}, {}, ERROR),
        (
            "position_ids=local_arange",
            {"hf_kwargs": {"position_ids": torch.arange(8 if door.packed_stream else 4)[None]}},
            {},
            CORRECT if world == 1 and not door.packed_stream else ERROR,  # W = 1: local = global
        ),
        ("position_ids=None", {"hf_kwargs": {"position_ids": None}}, {}, ERROR),
        (
            "attention_mask=4d",
            {"hf_kwargs": {"attention_mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}},
            {},
            ERROR,
        ),
        ("dropout=0.1", {"dropout_p": 0.1}, {}, ERROR),
        ("use_cache=False", {"hf_kwargs": {"use_cache": False}}, {}, CORRECT),
        ("output_attentions=True", {"hf_kwargs": {"output_attentions": True}}, {}, EITHER),
        ("unknown_kwarg", {"hf_kwargs": {"not_an_argument": 1}}, {}, ERROR),
    ]
    if door.packed_stream:
        bounds = [0, *itertools.accumulate(door.default_docs(world))]
        other = torch.tensor([0, bounds[1] + world, *bounds[2:]], dtype=torch.int32)
        variants += [
            ("cu_seq_lens_k_differs", {"hf_kwargs": {"cu_seq_lens_k": other}}, {}, ERROR),
            ("max_length_q=1", {"hf_kwargs": {"max_length_q": 1, "max_length_k": 1}}, {}, CORRECT),
        ]
    return variants


HF_MODELS = (
    ("llama", "zigzag", None, 2, CORRECT),
    ("llama", "ring", None, 3, CORRECT),
    ("qwen2", "stripe", None, 4, CORRECT),
    ("llama", "llama3", (5, 6, 5), 2, CORRECT),
    ("llama", "zigzag", (8, 4, 4), 2, CORRECT),
    ("gpt_oss", "zigzag", None, 2, EITHER),
    ("llama", "documents", (5, 9, 2), 2, CORRECT),  # any lengths, placed by document_layout
    ("llama", "documents", (7, 11, 6), 3, CORRECT),
    ("qwen2", "documents", (3, 20, 9), 4, CORRECT),  # one document over three ranks
    ("llama", "documents", None, 2, ERROR),  # a dense batch: packed rows only
)


def hf_cases() -> list[Case]:
    cases = []
    hf_doors = [d for d in DOORS.values() if d.family in ("hf", "hf_packed")]
    hf_doors.append(HF_DOCUMENTS_DOOR)  # placed documents: bidirectional keeps their own plan
    for i, door in enumerate(hf_doors):
        for j in range(len(_hf_kwarg_variants(door, 1))):
            world = _pick(WORLDS, i + j)
            label, kw, ref, expect = _hf_kwarg_variants(door, world)[j]
            error = None if "correct" in expect else label
            setup = Setup(
                kw={"causal": True, **kw}, ref=ref, expect_error=error, grads=error is None
            )
            cases.append(_case("hf", door, world, label, setup, expect))
            # rank 0 alone: its error reaches every rank (a local arange is rank 0's own
            # positions on the ring layout: not an error there)
            if expect == ERROR and world > 1 and not label.startswith("position_ids=local"):
                valid = _on_rank0(setup, kw)
                cases.append(_case("hf", door, world, f"rank0:{label}", valid, fn=one_rank_case))
    for world in (2, 3):  # bidirectional on placed documents: their own plan, not the ring's
        kw = {"causal": True, "hf_kwargs": {"is_causal": False}}
        setup = Setup(kw=kw, ref={"causal": False}, grads=True)
        cases.append(_case("hf", HF_DOCUMENTS_DOOR, world, "bidirectional", setup, CORRECT))
    for arch, layout, docs, world, expect in HF_MODELS:
        params = dict(arch=arch, layout=layout, docs=docs)
        name = f"hf/model:{arch}/W{world}/{layout}{',packed' if docs else ''}"
        cases.append(Case(name, "hf", world, hf_model_case, params, expect))
    return cases


def dtype_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or REPRESENTATIVE):
        for j, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
            backend = _pick(_backends(door), i + j)
            setup = Setup(
                kw={"causal": True, **_backend_kw(backend)}, dtype=dtype, lse=door.has_lse
            )
            detail = f"{str(dtype).removeprefix('torch.')},backend={backend}"
            cases.append(_case("dtype", door, _pick(WORLDS, i + j), detail, setup))
    return cases


VALUES = (
    ("q=0", (("q", 0.0),), torch.float64),
    ("qkv=0", (("q", 0.0), ("k", 0.0), ("v", 0.0)), torch.float64),
    ("q*1e3", (("q", 1e3),), torch.float64),
    ("k*30,fp32", (("k", 30.0),), torch.float32),
    ("v*1e30", (("v", 1e30),), torch.float64),
    ("qkv*1e-30", (("q", 1e-30), ("k", 1e-30), ("v", 1e-30)), torch.float64),
    ("dout=0", (("dout", 0.0),), torch.float64),
)


def values_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or REPRESENTATIVE):
        for j, (label, factors, dtype) in enumerate(VALUES):
            setup = Setup(kw={"causal": True}, factors=factors, dtype=dtype)
            cases.append(_case("values", door, _pick(WORLDS, i + j), label, setup))
    return cases


def _head_split(door: Door, world: int) -> int:
    """Over how many ranks the door shards the heads (Ulysses)."""
    if door.family == "hybrid":
        return HYBRID_SPLIT[world][0]
    if door.family == "ulysses" or (door.family.startswith("sdpa") and door.mode == "ulysses"):
        return world
    if door.force == "ulysses":
        return world
    return 1


def _dense_len_ok(door: Door, world: int, s_local: int) -> bool:
    """Whether ``s_local`` tokens per rank fit the door's layout (zigzag: 2W chunks)."""
    if door.family == "cp" and door.mode == "default":  # PyTorch's default: ring when odd
        return True
    if door.layout not in ("zigzag", "llama3_zigzag", "auto"):
        return True
    if door.family != "hybrid":
        return s_local % 2 == 0
    U, R = HYBRID_SPLIT[world]
    S = s_local * world
    return S % (2 * R) == 0 and (S // R) % U == 0


def _shape_variants(door: Door, world: int) -> list[tuple[str, dict, frozenset]]:
    """(detail, setup edits, expect); impossible shapes must be clean errors."""
    variants = [
        ("D=1", {"D": 1}, CORRECT),
        ("D=3", {"D": 3}, CORRECT),
        ("D=64", {"D": 64}, CORRECT),
        ("H=1", {"heads": (1, 1)}, ERROR if _head_split(door, world) > 1 else CORRECT),
    ]
    if door.packed_stream:
        return [*variants, ("one_document", {"docs": (8 * world,)}, CORRECT)]
    variants.append(("B=3", {"B": 3}, CORRECT))
    for s_local in (1, 2, 16):
        ok = _dense_len_ok(door, world, s_local)
        variants.append((f"s_local={s_local}", {"s_local": s_local}, CORRECT if ok else ERROR))
    return variants


def shapes_cases(doors=None) -> list[Case]:
    cases = []
    for i, door in enumerate(doors or REPRESENTATIVE):
        for j in range(len(_shape_variants(door, 1))):
            world = _pick(WORLDS, i + j)
            detail, edits, expect = _shape_variants(door, world)[j]
            error = None if "correct" in expect else detail
            setup = Setup(kw={"causal": True}, expect_error=error, grads=error is None, **edits)
            cases.append(_case("shapes", door, world, detail, setup, expect))
    return cases


# --- the later front doors ------------------------------------------------------------------

LLAMA3_ZIGZAG_DOORS = [
    d for d in NEW_DOORS.values() if d.layout == "llama3_zigzag" and d.family != "cp"
]
#: its own front doors: every adversity; the doors that take it as a ``layout``: the cheap ones
LLAMA3_ZIGZAG_PRIMARY = [
    NEW_DOORS["llama3_zigzag_flash_attn_func"],
    NEW_DOORS["llama3_zigzag_flash_attn_varlen_func"],
]
GATHER_ARG_CASES = (
    ArgCase("heads_k_stride=1", {"heads_k_stride": 1}, expect=CORRECT, needs="heads_k_stride"),
    ArgCase("heads_k_stride='1'", {"heads_k_stride": "1"}, needs="heads_k_stride"),
    # True is the int 1 to isinstance (the stride of 1 is valid): either answer is fine
    ArgCase("heads_k_stride=True", {"heads_k_stride": True}, needs="heads_k_stride"),
    ArgCase("heads_k_stride=None", {"heads_k_stride": None}, needs="heads_k_stride"),
)


def documents_cases() -> list[Case]:
    """``ring_varlen_attention_func`` on the placed layouts: ``dr.document_layout`` (documents
    of any lengths placed whole or cut by their work; the ring and the all-gather) and
    ``dr.documents_as_sharded`` (as head-tail shards of the packed row hold them), each
    rank's local ``cu_seqlens`` its own: base, masks, memory layouts, non-finite values,
    arguments, ranks that disagree, dtypes, values, shapes and the consistency mode."""
    doors = [DOCUMENTS_DOOR, HEAD_TAIL_DOOR, DOCUMENTS_GATHER_DOOR]
    cases = base_cases(doors) + mask_cases(doors) + layout_cases(doors) + debug_on_cases(doors)
    cases += nonfinite_cases(doors) + scale_cases(doors) + args_cases(doors)
    cases += disagree_cases(doors) + dtype_cases(doors) + values_cases(doors)
    cases += shapes_cases(doors)
    from .placed import placed_cases  # (it imports this module)

    return _retag(cases, "documents") + placed_cases()


def flash2_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """:func:`attention_case` with ``backend="flash2_model"`` selectable (modelled ops)."""
    from tests.flash2_model import modelled_flash2

    with modelled_flash2():
        return attention_case(ctx, door, setup)


def flash2_cases() -> list[Case]:
    """The windowed masks of every door with a window and a backend, at W = 2-4, on
    FlashAttention-2's modelled ops (the placed layouts', llama3_zigzag's and ``auto``'s
    doors too)."""
    doors = [
        d
        for d in (*DOORS.values(), DOCUMENTS_DOOR, HEAD_TAIL_DOOR, *LLAMA3_ZIGZAG_PRIMARY)
        if {"window_size", "backend"} <= d.accepts
    ]
    cases = []
    for i, door in enumerate(doors):
        variants = [(d, kw, 4) for d, kw, _ in _mask_variants(door, 2) if "window_size" in kw]
        variants += [  # windows shorter than a rank's 16 tokens: runs of unequal lengths
            (f"window={w},s_local=16".replace(" ", ""), {"causal": c, "window_size": w}, 16)
            for c, w in ((True, (5, 0)), (True, (1, 0)), (False, (3, 2)))
            if c or not door.causal_only
        ]
        for j, (detail, kw, s_local) in enumerate(variants):
            world = _pick((2, 3, 4), i + j)
            setup = Setup(kw={**kw, "backend": "flash2_model"}, s_local=s_local)
            cases.append(_case("flash2", door, world, detail, setup, fn=flash2_case))
            if door.packed_stream and door.layout == "llama3" and s_local == 16:
                # a document starting 2 tokens before rank 1's slice: llama3's prefix block
                # is then many queries against 2 keys
                docs = replace(setup, docs=(6, 8 * world - 6))
                detail += ",docs=(6,rest)"
                cases.append(_case("flash2", door, world, detail, docs, fn=flash2_case))
    return cases


def llama3_zigzag_cases() -> list[Case]:
    """The "llama3_zigzag" layout (zigzag's tokens, K/V all-gathered): its flash and varlen
    front doors through every adversity, and the doors that take a layout (``ring_attention_func``,
    Ulysses, SDPA on DTensors, transformers) through base, mask, memory layouts and the
    consistency mode."""
    doors, primary = LLAMA3_ZIGZAG_DOORS, LLAMA3_ZIGZAG_PRIMARY
    cases = base_cases(doors) + mask_cases(doors) + layout_cases(doors) + debug_on_cases(doors)
    cases += nonfinite_cases(primary) + scale_cases(primary) + args_cases(primary, GATHER_ARG_CASES)
    cases += disagree_cases(primary) + dtype_cases(primary) + values_cases(primary)
    cases += shapes_cases(primary)
    return _retag(cases, "llama3_zigzag")


AUTO_CHOOSING = [
    d
    for d in AUTO_DOORS.values()
    if d.family in ("ring_fn", "varlen", "hf", "hf_packed", "cp", "sdpa_fn", "sdpa_scope")
]
AUTO_REJECTING = [d for d in AUTO_DOORS.values() if d not in AUTO_CHOOSING]
#: the doors that choose, with the cost model's own choice: every adversity of the kind
AUTO_PRIMARY = [
    AUTO_DOORS["ring_attention_func[auto]"],
    AUTO_DOORS["ring_varlen_attention_func[auto]"],
]
AUTO_REJECTED = "layout='auto' is only for the front doors that choose the algorithm"
#: (arch, docs, world) of the transformers models run with ``layout="auto"``
AUTO_HF_MODELS = (("llama", None, 2), ("llama", (16, 8, 8), 4))


def rejected_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """:func:`attention_case` of a door that must reject ``layout="auto"``: its ``ValueError``
    must name the layout (another one, e.g. of a check that happens to fail first, is a
    failed check rather than the clean error expected)."""
    try:
        return attention_case(ctx, door, setup)
    except ValueError as e:
        if "'auto'" not in str(e):
            return {"names_auto": Flag(False, f"ValueError not naming layout 'auto': {e}")}
        raise


def auto_cases() -> list[Case]:
    """``layout="auto"`` (zigzag's tokens; ring, all-gather or Ulysses chosen per call): the
    doors that choose through base, mask, memory layouts and the consistency mode (the forced
    choices: base, mask, debug_on), the primary ones also through non-finite values, ranks
    that disagree and edge shapes; tiny transformers models sharded by ``shard_batch``; and
    the doors that must reject it (base: a clean error on every rank)."""
    doors, primary = AUTO_CHOOSING, AUTO_PRIMARY
    unforced = [d for d in doors if not d.force]
    cases = base_cases(doors) + mask_cases(doors) + layout_cases(unforced)
    cases += debug_on_cases(doors)
    cases += nonfinite_cases(primary) + disagree_cases(primary) + shapes_cases(primary)
    rejected = base_cases(AUTO_REJECTING)
    for c in rejected:
        c.params["setup"] = replace(c.params["setup"], expect_error=AUTO_REJECTED, grads=False)
        c.fn, c.expect = rejected_case, ERROR
    cases = _retag(cases + rejected, "auto")
    for arch, docs, world in AUTO_HF_MODELS:
        params = dict(arch=arch, layout="auto", docs=docs)
        name = f"auto/hf.model:{arch}/W{world}/auto{',packed' if docs else ''}"
        cases.append(Case(name, "auto", world, hf_model_case, params, CORRECT))
    return cases


CP_DOORS = [d for d in NEW_DOORS.values() if d.family == "cp"]
CP_PRIMARY = [NEW_DOORS["context_parallel+F.sdpa[default]"]]
CP_ARG_CASES = (
    ArgCase("causal=None", {"causal": None}, families=("cp",)),
    ArgCase("causal=1", {"causal": 1}, expect=EITHER, families=("cp",)),
    ArgCase(
        "enable_gqa=True,mha",
        {"enable_gqa": True},
        setup={"heads": (4, 4)},
        expect=CORRECT,
        families=("cp",),
    ),
    ArgCase("softmax_scale=None", {"softmax_scale": None}, expect=CORRECT, families=("cp",)),
)


def cp_buffers_one_rank_case(ctx: Ctx, variant: str) -> dict:
    """:func:`cp_buffers_case` with ``variant``'s malformed argument on rank 0 alone (the
    others' call valid): every rank raises (:func:`raises_here`)."""
    return raises_here(lambda: cp_buffers_case(ctx, variant if ctx.rank == 0 else "zigzag_default"))


def cp_buffers_case(ctx: Ctx, variant: str) -> dict:
    """``context_parallel(mesh, buffers=[ids, positions, labels], buffer_seq_dims=[1, 0, 1],
    no_restore_buffers={labels})``: inside, the buffers hold this rank's shard in place (zigzag
    when ``S % 2W == 0``, else ring; or ``layout=``), q/k/v are looked up by the sharded
    positions and ``F.scaled_dot_product_attention`` runs causal ring attention (forward,
    backward inside or after); on exit the buffers are restored (labels left sharded) and SDPA
    is the original again; ``context_parallel_unshard`` gives the output in token order.
    Variants with a malformed argument must raise on every rank (:data:`CP_BUFFER_VARIANTS`)."""
    import dtensor_ring as dr
    from tests.reference import layout_indices

    W, rank = ctx.world, ctx.rank
    S = {"ring_default": 5 * W, "indivisible": 4 * W + 1}.get(variant, 4 * W)
    B, H, D = 2, 4, 8
    gen = torch.Generator().manual_seed(0)
    tables = [
        torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (H, H // 2, H // 2, H)
    ]
    ids = torch.randint(0, 100, (B, S), generator=gen)
    pos = torch.arange(S)
    labels = ids.clone()
    full_ids = ids.clone()
    mesh = cpu_mesh(W)
    buffers, dims, no_restore = [ids, pos, labels], [1, 0, 1], {labels}
    cp_kw: dict = {}
    if variant == "stripe":
        cp_kw["layout"] = "stripe"
    elif variant == "layout=nope":
        cp_kw["layout"] = "nope"
    elif variant == "seq_dims_short":
        dims = [1, 0]
    elif variant == "no_restore_not_subset":
        no_restore = {labels.clone()}
    elif variant == "parameter_buffer":
        buffers.append(torch.nn.Parameter(torch.zeros(S)))
        dims.append(0)
    elif variant == "mesh_2d":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, W // 2))
    elif variant == "mesh=None":
        mesh = None
    elif variant == "backward_outside":
        no_restore = {labels, pos}  # autograd saved the positions: leave them sharded
    original_sdpa = F.scaled_dot_product_attention
    leaves = [t.clone().requires_grad_() for t in tables[:3]]
    layout = cp_kw.get("layout", "zigzag" if S % (2 * W) == 0 else "ring")
    checks: dict = {}
    try:
        with dr.context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=no_restore, **cp_kw
        ):
            idx = layout_indices(layout, rank, W, S)  # (a length it cannot split raised)
            checks["sharded_in_place"] = Flag(
                torch.equal(ids, full_ids[:, idx]) and torch.equal(pos, idx),
                f"rank {rank} holds positions {pos.tolist()}, expected {idx.tolist()}",
            )
            q, k, v = (t[:, pos].transpose(1, 2) for t in leaves)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ).transpose(1, 2)
            dout = tables[3][:, pos]
            if variant != "backward_outside":
                (out * dout).sum().backward()
            if variant == "exception_inside":
                raise KeyError("raised inside the context")
        if variant == "backward_outside":
            (out * dout).sum().backward()
    except KeyError:
        pass
    if variant == "exception_inside":
        checks = {}
    checks["sdpa_restored"] = Flag(
        F.scaled_dot_product_attention is original_sdpa, "SDPA still patched"
    )
    checks["restored"] = Flag(torch.equal(ids, full_ids), "ids not restored on exit")
    if variant == "exception_inside":
        return checks
    checks["labels_sharded"] = Flag(
        torch.equal(labels, full_ids[:, idx]), "labels not left sharded"
    )
    visible = oracle.visible_dense(S, True)
    ref = oracle.strict_attention(*tables[:3], visible, D**-0.5, tables[3])
    tol = oracle.tolerance(torch.float64)
    checks["out"] = Check(out.detach(), ref.out[:, idx], torch.float64, *tol)
    for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
        want = getattr(ref, name)
        others = torch.ones(S, dtype=torch.bool)
        others[idx] = False
        got = leaf.grad
        checks[name] = Check(
            None if got is None else got[:, idx], want[:, idx], torch.float64, *tol
        )
        if got is not None:
            checks[name + "_elsewhere"] = Flag(
                bool((got[:, others] == 0).all()), f"{name} outside the shard"
            )
    full = dr.context_parallel_unshard(
        mesh, [out.detach()], [1], **({"layout": layout} if "layout" in cp_kw else {})
    )[0]
    checks["unshard"] = Check(full, ref.out, torch.float64, *tol)
    return checks


#: variant, worlds, expect
CP_BUFFER_VARIANTS = (
    ("zigzag_default", WORLDS, CORRECT),
    ("ring_default", WORLDS, CORRECT),
    ("stripe", (2, 3), CORRECT),
    ("backward_outside", (2, 4), CORRECT),
    ("exception_inside", (1, 3), CORRECT),
    ("seq_dims_short", (2,), ERROR),
    ("no_restore_not_subset", (3,), ERROR),
    ("parameter_buffer", (2,), ERROR),
    ("mesh_2d", (4,), ERROR),
    ("mesh=None", (2,), ERROR),
    ("layout=nope", (3,), ERROR),
    ("indivisible", (2, 3), ERROR),
)


def context_parallel_cases() -> list[Case]:
    """``dtensor_ring.context_parallel``: ``F.scaled_dot_product_attention`` on plain local
    shards (PyTorch's default layout: every adversity; ``layout="stripe"`` /
    ``"llama3_zigzag"``: base, mask, memory layouts, shapes, consistency mode), and the buffers
    it shards and restores (:func:`cp_buffers_case`)."""
    doors, primary = CP_DOORS, CP_PRIMARY
    cases = base_cases(doors) + mask_cases(doors) + layout_cases(doors) + debug_on_cases(doors)
    cases += shapes_cases(doors)
    cases += nonfinite_cases(primary) + scale_cases(primary) + args_cases(primary, CP_ARG_CASES)
    cases += disagree_cases(primary) + dtype_cases(primary) + values_cases(primary)
    cases = _retag(cases, "context_parallel")
    for variant, worlds, expect in CP_BUFFER_VARIANTS:
        for world in worlds:
            name = f"context_parallel/buffers/W{world}/{variant}"
            cases.append(
                Case(name, "context_parallel", world, cp_buffers_case, {"variant": variant}, expect)
            )
        if expect == ERROR and not variant.startswith("mesh"):  # rank 0 alone passes it
            world = 2 + len(cases) % 2
            name = f"context_parallel/buffers/W{world}/rank0:{variant}"
            params = {"variant": variant}
            cases.append(Case(name, "context_parallel", world, cp_buffers_one_rank_case, params))
    return cases


from .flex import flex_cases  # noqa: E402  (it imports this module)
from .inference import decode_cases, kv_cache_cases  # noqa: E402  (it imports this module)
from .rank_local import rank_local_cases  # noqa: E402  (it imports this module)
from .recompute import recompute_cases  # noqa: E402  (it imports this module)
from .remembered import remembered_cases  # noqa: E402  (it imports this module)
from .shards import shards_cases  # noqa: E402  (it imports this module)
from .titan import titan_cases  # noqa: E402  (it imports this module)

KINDS = {
    "base": base_cases,
    "mask": mask_cases,
    "layout": layout_cases,
    "nonfinite": nonfinite_cases,
    "scale": scale_cases,
    "sinks": sinks_cases,
    "args": args_cases,
    "disagree": disagree_cases,
    "dtensor": dtensor_cases,
    "hf": hf_cases,
    "dtype": dtype_cases,
    "values": values_cases,
    "shapes": shapes_cases,
    "debug_on": debug_on_cases,
    "llama3_zigzag": llama3_zigzag_cases,
    "context_parallel": context_parallel_cases,
    "auto": auto_cases,
    "decode": decode_cases,
    "kv_cache": kv_cache_cases,
    "recompute": recompute_cases,
    "double_backward": double_backward_cases,
    "rank_local": rank_local_cases,
    "shards": shards_cases,
    "flex": flex_cases,
    "documents": documents_cases,
    "titan": titan_cases,
    "flash2": flash2_cases,
    "remembered": remembered_cases,
}
FAST_PER_KIND = 2  # the fast tier's subset: 2 per kind (its time: docs/design.md)


def _mark_fast(cases: list[Case], n: int) -> None:
    """Flag ``n`` evenly spaced cases (deterministic; [nodebug] variants are informational
    and left out)."""
    pool = [c for c in cases if c.expect is not None]
    for c in pool[:: max(1, len(pool) // n)][:n]:
        c.fast = True


def all_cases(kinds: list[str] | None = None) -> list[Case]:
    """Every case of ``kinds`` (default: all), in a stable order; ``fast`` flags set."""
    cases = []
    for kind in kinds or list(KINDS):
        generated = KINDS[kind]()
        _mark_fast(generated, FAST_PER_KIND)
        cases += generated
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"suite bug: duplicate case names {sorted(dupes)[:5]}"
    spaced = [n for n in names if len(n.split()) != 1]  # known.py lists names one per line
    assert not spaced, f"suite bug: case names with spaces {spaced[:5]}"
    return cases
