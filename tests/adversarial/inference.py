"""Cases of the inference front doors: decoding over a sharded KV cache and the cache itself.

* ``decode`` (:func:`decode_case`): ``dtensor_ring.decode_attention_func`` -- one query (the
  token at ``q_pos``) over a cache of ``S = s_local * W`` tokens spread over the ranks by a
  :data:`SPLITS` entry (even, uneven, empty shards, one rank holding all, scattered positions,
  an empty cache), with or without ``cache_positions`` / ``query_position`` (windows over
  global positions). Reference: the strict fp64 attention of that one query over every cached
  key it sees (:func:`oracle.strict_attention`); a query that sees no key is NaN (with sinks:
  0), as the op documents and as attention over a fully masked row is.
* ``kv_cache`` (:func:`kv_cache_case`): ``KVCacheShard`` + ``prefill_attention`` over a prompt
  sharded in the door's layout, then ``decode_step_attention`` token by token; every output
  against fp64 causal attention over the whole sequence, and the cache's keys, positions and
  length against the tokens it must hold (a ``sliding_window`` cache drops the keys no later
  query sees).

Each malformed argument of either kind is also passed by rank 0 alone (``rank0:``, the
others valid): an error on every rank, none waiting (not a group, nor a second prefill: a
call the others never make). Both reuse :class:`~tests.adversarial.cases.Setup` (its
``extra`` fields), ``make_data``, the mutations, views, scales, sinks and values of
:mod:`tests.adversarial.cases`, and the oracle.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from . import oracle
from .cases import (
    _SINKS,
    CORRECT,
    DEBUG_ENV,
    DISAGREE_TIMEOUT_S,
    EITHER,
    ERROR,
    MUTATIONS,
    SCALES,
    SINKS,
    VALUES,
    WORLDS,
    Setup,
    _case,
    _pick,
    _resolve_kw,
    default_heads,
    make_data,
    nonmember_case,
    one_rank_case,
    rank0_overrides,
)
from .doors import VIEWS, Ctx, Door, _split_result
from .oracle import Check, Flag
from .runner import Case

DECODE = Door("decode_attention_func", "decode", "")
KV_DOORS = {
    layout: Door(f"KVCacheShard+prefill+decode_step[{layout}]", "kv_cache", layout)
    for layout in ("zigzag", "ring", "stripe", "llama3_zigzag")
}
BACKENDS = (None, "cpu_flash", "math")

# --- decoding over a sharded cache ----------------------------------------------------------


def split_positions(split: str, rank: int, world: int, S: int) -> Tensor:
    """Global positions of the cached tokens rank ``rank`` holds (its local order)."""
    if split == "contiguous":
        n = S // world
        return torch.arange(rank * n, (rank + 1) * n)
    if split == "round_robin":  # KVCacheShard's decoded tokens
        return torch.arange(rank, S, world)
    if split == "uneven":  # sizes 1, 3, 5, ..., the last rank the rest
        sizes = [2 * r + 1 for r in range(world - 1)]
        sizes.append(S - sum(sizes))
        start = sum(sizes[:rank])
        return torch.arange(start, start + sizes[rank])
    if split == "empty_rank0":  # rank 0 holds nothing
        if rank == 0:
            return torch.arange(0)
        n = S // max(world - 1, 1)
        stop = S if rank == world - 1 else rank * n
        return torch.arange((rank - 1) * n, stop)
    if split == "one_rank":  # the last rank holds everything
        return torch.arange(S) if rank == world - 1 else torch.arange(0)
    if split == "scattered":  # a permutation: positions not ascending within a shard
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(1))
        n = S // world
        return perm[rank * n : (rank + 1) * n]
    if split == "empty":
        return torch.arange(0)
    raise ValueError(split)


SPLITS = ("contiguous", "round_robin", "uneven", "empty_rank0", "one_rank", "scattered", "empty")


def _q_mutations(q: Tensor, k: Tensor, v: Tensor):
    return {
        "q_two_tokens": lambda: (torch.cat([q, q], 1), k, v),
        "q_batch_differs": lambda: (q[:1], k, v),
        "empty_cache_batch": lambda: (q, k[:0], v[:0]),
        "v_longer": lambda: (q, k, torch.cat([v, v[:, :1]], 1)),
    }


POS_EDITS = {
    "int32": lambda kw: {**kw, "cache_positions": kw["cache_positions"].int()},
    "list": lambda kw: {**kw, "cache_positions": kw["cache_positions"].tolist()},
    "2d": lambda kw: {**kw, "cache_positions": kw["cache_positions"][None]},
    "one_extra": lambda kw: {**kw, "cache_positions": torch.cat([kw["cache_positions"]] * 2)},
    "float": lambda kw: {**kw, "cache_positions": kw["cache_positions"].double()},
    "no_query_position": lambda kw: {k: v for k, v in kw.items() if k != "query_position"},
    "no_cache_positions": lambda kw: {k: v for k, v in kw.items() if k != "cache_positions"},
    "query_position=float": lambda kw: {**kw, "query_position": float(kw["query_position"])},
    "query_position=bool": lambda kw: {**kw, "query_position": True},
    "query_position=tensor": lambda kw: {
        **kw,
        "query_position": torch.tensor(kw["query_position"]),
    },
}


def decode_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """``decode_attention_func`` on this rank's shard of the cache (``setup.extra``: split,
    positions, q_pos, pos_offset, pos_edit); checks of ``out`` (and ``lse``)."""
    import dtensor_ring as dr

    door, setup = rank0_overrides(ctx, door, setup)
    ex = setup.extra
    data = make_data(door, setup, ctx.world)
    S = data.seq_len
    keep = split_positions(ex.get("split", "contiguous"), ctx.rank, ctx.world, S)
    q_pos = ex.get("q_pos", S - 1)
    q_row = min(q_pos, S - 1)  # a query beyond the cache: any query values
    q = data.q[:, q_row : q_row + 1]
    k, v = data.k[:, keep], data.v[:, keep]
    mutate = setup.mutate
    if mutate in MUTATIONS:
        q, k, v = MUTATIONS[mutate](q, k, v)
    elif mutate is not None:
        q, k, v = _q_mutations(q, k, v)[mutate]()
    kw = _resolve_kw(setup.kw, ctx)
    kw.setdefault("group", ctx.group)
    offset = ex.get("pos_offset", 0)
    if ex.get("positions"):
        kw["cache_positions"] = keep + offset
        kw["query_position"] = q_pos + offset
    if ex.get("pos_edit"):
        kw = POS_EDITS[ex["pos_edit"]](kw)
    if setup.lse:
        kw["return_attn_probs"] = True
    view = VIEWS[setup.view]
    out, lse = _split_result(dr.decode_attention_func(view(q), view(k), view(v), **kw))
    if setup.expect_error:
        return {"returned": Flag(False, f"returned a result although {setup.expect_error}")}
    window = tuple(setup.ref.get("window", setup.kw.get("window_size", (-1, -1))))
    pos = torch.arange(S)
    visible = torch.zeros(S, dtype=torch.bool)  # cached on some rank ...
    for r in range(ctx.world):
        visible[split_positions(ex.get("split", "contiguous"), r, ctx.world, S)] = True
    if ex.get("positions"):  # ... and in the window
        left, right = window
        if left >= 0:
            visible &= pos >= q_pos - left
        if right >= 0:
            visible &= pos <= q_pos + right
    scale = setup.ref.get("scale", setup.kw.get("softmax_scale"))
    scale = setup.D**-0.5 if scale is None else float(scale)
    sinks = setup.ref.get("sinks", setup.kw.get("sinks"))
    qf = data.q[:, q_row : q_row + 1]
    ref = oracle.strict_attention(qf, data.k, data.v, visible[None], scale, None, sinks)
    want_out = ref.out
    if not visible.any() and sinks is None:  # no key: NaN, as attention over a masked row
        want_out = torch.full_like(ref.out, math.nan)
    finite = all(bool(torch.isfinite(x).all()) for x in (data.q, data.k, data.v))
    base = {}
    if setup.dtype != torch.float64 and finite and sinks is None and visible.any():
        base = oracle.baseline_errors(qf, data.k, data.v, visible[None], scale, None, ref)
    checks = {
        "out": Check(out, want_out, setup.dtype, *oracle.tolerance(setup.dtype, base.get("out")))
    }
    if setup.lse:
        lse_dtype = torch.float64 if setup.dtype == torch.float64 else torch.float32
        checks["lse"] = Check(
            lse, ref.lse, lse_dtype, *oracle.tolerance(lse_dtype, base.get("out"))
        )
    return checks


def _decode_setup(expect=CORRECT, label="", **fields) -> Setup:
    error = None if "correct" in expect else label
    return Setup(grads=False, expect_error=error, **fields)


def _decode_variants(world: int) -> list[tuple[str, dict, frozenset]]:
    """(detail, Setup fields, expect) of the decode kind (besides base, sinks, disagree)."""
    S = 4 * world
    H = default_heads(DECODE, world)[0]
    pos = {"positions": True}
    v: list[tuple[str, dict, frozenset]] = []
    # how the cache is spread, with and without a window over positions
    for split in SPLITS:
        v.append((f"split={split}", {"extra": {"split": split}, "lse": True}, CORRECT))
        v.append(
            (
                f"split={split},window=(2,0)",
                {"extra": {"split": split, **pos}, "kw": {"window_size": (2, 0)}, "lse": True},
                CORRECT,
            )
        )
    # windows by position
    mid = S // 2
    for label, window, extra in (
        ("window=(0,0)", (0, 0), {"split": "round_robin"}),
        ("window=(100,0)", (100, 0), {"split": "scattered"}),
        ("window=(-1,0),q_pos=middle", (-1, 0), {"split": "uneven", "q_pos": mid}),
        ("window=(1,2),q_pos=middle", (1, 2), {"split": "scattered", "q_pos": mid}),
        ("window=(3,-1),q_pos=middle", (3, -1), {"split": "contiguous", "q_pos": mid}),
        ("window=(2,0),q_pos=beyond", (2, 0), {"split": "contiguous", "q_pos": S + 5}),
        ("window=(0,0),q_pos=first", (0, 0), {"split": "empty_rank0", "q_pos": 0}),
        ("window=(2,0),offset=1000", (2, 0), {"split": "round_robin", "pos_offset": 1000}),
        ("window=(-1,-1),positions", (-1, -1), {"split": "scattered", "q_pos": mid}),
        ("window=[2,0]", [2, 0], {"split": "uneven"}),
        ("window=(2.0,0.0)", (2.0, 0.0), {"split": "uneven"}),
    ):
        expect = EITHER if label == "window=(2.0,0.0)" else CORRECT
        fields = {"kw": {"window_size": window}, "extra": {**extra, **pos}, "lse": True}
        if label.startswith("window=[") or label.startswith("window=(2.0"):
            fields["ref"] = {"window": (2, 0)}
        v.append((label, fields, expect))
    # malformed positions and windows
    for edit in POS_EDITS:
        expect = EITHER if edit == "query_position=tensor" else ERROR
        v.append((f"positions:{edit}", {"extra": {**pos, "pos_edit": edit}}, expect))
    v.append(("window_without_positions", {"kw": {"window_size": (2, 0)}}, ERROR))
    for label, window in (
        ("window='(2,0)'", "(2, 0)"),
        ("window=(2,)", (2,)),
        ("window=(2,0,0)", (2, 0, 0)),
        ("window=(-2,0)", (-2, 0)),
        ("window=(True,False)", (True, False)),
        ("window=None", None),
    ):
        v.append((label, {"kw": {"window_size": window}, "extra": pos}, ERROR))
    # argument types and values
    for label, kw, expect in (
        ("return_attn_probs=1", {"return_attn_probs": 1}, EITHER),
        ("return_attn_probs='yes'", {"return_attn_probs": "yes"}, ERROR),
        ("group=0", {"group": 0}, ERROR),
        ("group='world'", {"group": "world"}, ERROR),
        ("backend='nope'", {"backend": "nope"}, ERROR),
        ("backend=1", {"backend": 1}, ERROR),
        ("backend='cudnn'", {"backend": "cudnn"}, ERROR),
        ("backend='flash_attn'", {"backend": "flash_attn"}, ERROR),
    ):
        v.append((label, {"kw": kw}, expect))
    for label, value, expect in SCALES:
        ref = {}
        v.append((f"softmax_scale={label}", {"kw": {"softmax_scale": value}, "ref": ref}, expect))
    # malformed tensors
    for m in (*MUTATIONS, "q_two_tokens", "q_batch_differs", "empty_cache_batch", "v_longer"):
        if m == "kv_len_differs":  # a shorter cache is a valid cache: v_longer instead
            continue
        v.append((f"mutate={m}", {"mutate": m}, ERROR))
    # memory layouts, one per split
    for j, view in enumerate(x for x in VIEWS if x != "contiguous"):
        split = _pick(("contiguous", "scattered", "uneven", "empty_rank0"), j)
        v.append((f"view={view},split={split}", {"view": view, "extra": {"split": split}}, CORRECT))
    # non-finite values: in the query, a visible key/value, a key/value the window hides
    for j, (tensor, where) in enumerate(
        (t, w) for t in "qkv" for w in ("visible", "hidden") if not (t == "q" and w == "hidden")
    ):
        value = _pick((math.nan, math.inf, -math.inf), j)
        position = "late" if where == "visible" else "early"
        fields = {
            "inject": (tensor, position, value),
            "kw": {"window_size": (2, 0)},
            "extra": {"split": _pick(("round_robin", "scattered"), j), **pos},
            "lse": True,
        }
        v.append((f"{value}@{tensor}:{where}", fields, CORRECT))
    # dtypes, values, shapes
    for j, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        kw = {} if j == 0 else {"backend": _pick(("cpu_flash", "math"), j)}
        name = str(dtype).removeprefix("torch.")
        v.append(
            (f"dtype={name}", {"dtype": dtype, "kw": kw, "extra": {"split": "uneven"}}, CORRECT)
        )
    for label, factors, dtype in VALUES:
        if "dout" not in label:
            v.append((f"values:{label}", {"factors": factors, "dtype": dtype}, CORRECT))
    for label, fields in (
        ("D=1", {"D": 1}),
        ("D=3", {"D": 3}),
        ("D=64", {"D": 64}),
        ("H=1", {"heads": (1, 1)}),
        ("mqa", {"heads": (H, 1)}),
        ("mha", {"heads": (H, H)}),
        ("B=1", {"B": 1}),
        ("B=3", {"B": 3}),
        ("s_local=1", {"s_local": 1}),
        ("s_local=16", {"s_local": 16, "extra": {"split": "uneven"}}),
    ):
        v.append((f"shape:{label}", fields, CORRECT))
    return v


def _decode_disagreements(world: int) -> list[tuple[str, dict]]:
    H = default_heads(DECODE, world)[0]
    return [
        ("dtype", {"dtype": torch.float32}),
        ("head_dim", {"D": 16}),
        ("heads", {"heads": (2 * H, H)}),
        ("batch", {"B": 1}),
        ("scale", {"kw": {"softmax_scale": 0.5}}),
        ("window", {"kw": {"window_size": (1, 0)}}),
        ("query_position", {"extra": {"q_pos": 2}}),
        ("sinks", {"kw": {"sinks": torch.linspace(-3.0, 3.0, H)}}),
        ("backend", {"kw": {"backend": "math"}}),
    ]


def decode_cases() -> list[Case]:
    cases = []
    for world, backend in ((w, b) for w in WORLDS for b in BACKENDS):
        kw = {} if backend is None else {"backend": backend}
        setup = _decode_setup(kw=kw, lse=backend == "math")
        cases.append(
            _case("decode", DECODE, world, f"base:backend={backend}", setup, fn=decode_case)
        )
    variants = _decode_variants(1)
    for j in range(len(variants)):
        world = _pick(WORLDS, j)
        label, fields, expect = _decode_variants(world)[j]
        setup = _decode_setup(expect, label, **fields)
        cases.append(_case("decode", DECODE, world, label, setup, expect, fn=decode_case))
    cases.append(
        _nonmember("decode", DECODE, _decode_setup(extra={"split": "uneven"}), decode_case)
    )
    for j in (j for j, (label, _, e) in enumerate(variants) if e == ERROR and "group" not in label):
        world = _pick((2, 3), j)
        label, fields, _ = _decode_variants(world)[j]
        valid = _decode_setup()
        cases.append(_one_rank("decode", DECODE, world, label, valid, fields, decode_case))
    for j in range(len(_decode_disagreements(2))):
        world = _pick((2, 3, 4), j)
        name, rank0 = _decode_disagreements(world)[j]
        neutral = name == "backend"
        base_kw = {"window_size": (2, 0)} if name == "window" else {}
        extra = {"split": "uneven", "positions": True}
        setup = _decode_setup(
            EITHER if neutral else ERROR,
            f"the ranks disagree on {name}",
            kw=base_kw,
            extra=extra,
            rank0=rank0,
        )
        for variant, env, expect in (
            ("debug", DEBUG_ENV, EITHER if neutral else ERROR),
            ("nodebug", {}, EITHER if neutral else ERROR),  # the header (gloo)
        ):
            cases.append(
                _case(
                    "decode",
                    DECODE,
                    world,
                    f"disagree:{name}[{variant}]",
                    setup,
                    expect,
                    fn=decode_case,
                    env=env,
                    timeout_s=DISAGREE_TIMEOUT_S,
                )
            )
    for j, split in enumerate(("uneven", "empty_rank0", "scattered")):
        setup = _decode_setup(
            extra={"split": split, "positions": True}, kw={"window_size": (2, 0)}, lse=True
        )
        world = _pick((2, 3, 4), j)
        cases.append(
            _case(
                "decode",
                DECODE,
                world,
                f"debug_on:split={split}",
                setup,
                fn=decode_case,
                env=DEBUG_ENV,
            )
        )
    return cases


def decode_sinks_cases() -> list[Case]:
    """``sinks=`` of ``decode_attention_func`` (kind "sinks"); also a query that sees no key
    (its output is 0 with sinks)."""
    cases = []
    for j, (label, make, expect) in enumerate(SINKS):
        world = _pick(WORLDS, j + 1)
        H = default_heads(DECODE, world)[0]
        extra = {"split": _pick(("uneven", "empty_rank0", "scattered"), j), "positions": True}
        kw = {"sinks": make(H), "window_size": (2, 0)}
        setup = _decode_setup(expect, f"sinks={label}", kw=kw, extra=extra, lse="correct" in expect)
        cases.append(_case("sinks", DECODE, world, f"sinks={label}", setup, expect, fn=decode_case))
    for world in (1, 3):
        H = default_heads(DECODE, world)[0]
        extra = {"split": "contiguous", "positions": True, "q_pos": 4 * world + 5}
        setup = _decode_setup(kw={"sinks": _SINKS(H), "window_size": (2, 0)}, extra=extra, lse=True)
        cases.append(_case("sinks", DECODE, world, "sinks,no_visible_key", setup, fn=decode_case))
    return cases


def _one_rank(kind: str, door: Door, world: int, label: str, valid: Setup, rank0: dict, inner):
    """Rank 0 alone makes ``inner``'s call malformed by ``rank0`` (Setup fields), the others
    make it ``valid``: an error on every rank (:func:`~tests.adversarial.cases.one_rank_case`)."""
    params = {"door": door, "setup": replace(valid, rank0=rank0), "inner": inner}
    return Case(f"{kind}/{door.name}/W{world}/rank0:{label}", kind, world, one_rank_case, params)


def _nonmember(kind: str, door: Door, setup: Setup, inner) -> Case:
    """3 ranks, ``group = new_group([0, 1])``: rank 2 must raise (:func:`nonmember_case`)."""
    name = f"{kind}/{door.name}/W3/rank_outside_group"
    params = {"door": door, "setup": setup, "inner": inner}
    return Case(name, kind, 3, nonmember_case, params, CORRECT)


# --- the KV cache: prefill, then decoding steps ------------------------------------------------


def kv_cache_case(ctx: Ctx, door: Door, setup: Setup) -> dict:
    """``KVCacheShard`` + ``prefill_attention`` over this rank's shard of the prompt (in the
    door's layout; ``split_prompt`` when the prompt does not divide), then
    ``decode_step_attention`` for every later token; outputs and the cache's contents against
    the fp64 causal reference. ``setup.extra``: steps, prompt_extra, cache_window,
    prefill_twice, step_mutate."""
    import dtensor_ring as dr

    door, setup = rank0_overrides(ctx, door, setup)
    ex = setup.extra
    W, rank = ctx.world, ctx.rank
    data = make_data(door, setup, W)
    S = data.seq_len
    prompt = setup.s_local * W + ex.get("prompt_extra", 0)
    P = dr.split_prompt(prompt, door.layout, W) if ex.get("prompt_extra") else prompt
    kw = _resolve_kw(setup.kw, ctx)
    group = kw.pop("group", ctx.group)
    cache = dr.KVCacheShard(group, sliding_window=ex.get("cache_window"))
    view = VIEWS[setup.view]
    idx = door.indices(rank, W, P, None) if P else torch.arange(0)
    q, k, v = (x[:, idx] for x in (data.q, data.k, data.v))
    if setup.mutate:
        q, k, v = MUTATIONS[setup.mutate](q, k, v)
    outs = {}
    if P:
        outs["prefill"] = dr.prefill_attention(view(q), view(k), view(v), cache, door.layout, **kw)
        if ex.get("prefill_twice"):
            dr.prefill_attention(view(q), view(k), view(v), cache, door.layout, **kw)
    steps = []
    for t in range(P, S):
        qt, kt, vt = (x[:, t : t + 1] for x in (data.q, data.k, data.v))
        if ex.get("step_mutate") and t == S - 1:
            qt, kt, vt = _step_mutations(qt, kt, vt)[ex["step_mutate"]]()
        steps.append(dr.decode_step_attention(view(qt), view(kt), view(vt), cache, **kw))
    if setup.expect_error:
        return {"returned": Flag(False, f"returned a result although {setup.expect_error}")}
    window = tuple(setup.ref.get("window", setup.kw.get("window_size", (-1, -1))))
    scale = setup.ref.get("scale", setup.kw.get("softmax_scale"))
    scale = setup.D**-0.5 if scale is None else float(scale)
    sinks = setup.kw.get("sinks")
    visible = oracle.visible_dense(S, True, window)
    ref = oracle.strict_attention(data.q, data.k, data.v, visible, scale, None, sinks)
    finite = all(bool(torch.isfinite(x).all()) for x in (data.q, data.k, data.v))
    base = {}
    if setup.dtype != torch.float64 and finite and sinks is None:
        base = oracle.baseline_errors(data.q, data.k, data.v, visible, scale, None, ref)
    tol = oracle.tolerance(setup.dtype, base.get("out"))
    checks = {}
    if P:
        checks["prefill"] = Check(outs["prefill"], ref.out[:, idx], setup.dtype, *tol)
    if steps:
        checks["steps"] = Check(torch.cat(steps, 1), ref.out[:, P:], setup.dtype, *tol)
    held = cache.positions
    checks["seq_length"] = Flag(cache.seq_length == S, f"seq_length {cache.seq_length} != {S}")
    if cache.keys is not None:
        exact = oracle.tolerance(torch.float64)
        checks["cache_keys"] = Check(cache.keys, data.k[:, held].double(), setup.dtype, *exact)
        checks["cache_values"] = Check(cache.values, data.v[:, held].double(), setup.dtype, *exact)
    w = ex.get("cache_window")
    if w is not None and steps:  # keys no later query can see are dropped
        ok = held.numel() == 0 or int(held.min()) > S - 1 - w
        checks["evicted"] = Flag(ok, f"cache holds positions {held.tolist()} with window {w}")
    return checks


def _step_mutations(q: Tensor, k: Tensor, v: Tensor):
    return {
        "q_two_tokens": lambda: (torch.cat([q, q], 1), k, v),
        "k_two_tokens": lambda: (q, torch.cat([k, k], 1), torch.cat([v, v], 1)),
        "k_float32": lambda: (q, k.float(), v),
        "kv_heads_differ": lambda: (q, k[..., :1, :], v[..., :1, :]),
        "batch_differs": lambda: (q[:1], k[:1], v[:1]),
        "head_dim_differs": lambda: (q, torch.cat([k, k], -1), torch.cat([v, v], -1)),
    }


STEP_MUTATIONS = tuple(_step_mutations(*[torch.zeros(2, 1, 2, 2)] * 3))


def _kv_setup(expect=CORRECT, label="", steps=3, **fields) -> Setup:
    error = None if "correct" in expect else label
    extra = {"steps": steps, **fields.pop("extra", {})}
    extra["tokens"] = steps + extra.get("prompt_extra", 0)
    return Setup(grads=False, expect_error=error, extra=extra, **fields)


def _kv_variants(door: Door, world: int) -> list[tuple[str, dict, frozenset]]:
    """(detail, _kv_setup arguments, expect) of the kv_cache kind for ``door``."""
    H = default_heads(door, world)[0]
    v: list[tuple[str, dict, frozenset]] = []
    for window, cache_window, expect in (
        ((2, 0), None, CORRECT),
        ((0, 0), None, CORRECT),
        ((100, 0), None, CORRECT),
        ((2, 1), None, CORRECT),
        ((2, 0), 3, CORRECT),
        ((0, 0), 1, CORRECT),
        ((1, 0), 5, CORRECT),
        ((-1, -1), 3, ERROR),
        ((5, 0), 3, ERROR),
    ):
        label = f"window={window}".replace(" ", "")
        if cache_window is not None:
            label += f",sliding_window={cache_window}"
        args = {"kw": {"window_size": window}, "extra": {"cache_window": cache_window}}
        args["steps"] = 6  # enough steps for the eviction
        v.append((label, args, expect))
    for value in (0, True, 2.5, -1):
        v.append((f"sliding_window={value}", {"extra": {"cache_window": value}}, ERROR))
    v += [
        ("no_prefill", {"s_local": 0, "steps": 6}, CORRECT),
        ("prefill_only", {"steps": 0}, CORRECT),
        ("split_prompt", {"extra": {"prompt_extra": 3}}, CORRECT),
        ("prefill_twice", {"extra": {"prefill_twice": True}}, ERROR),
        ("group=0", {"kw": {"group": 0}}, ERROR),
        ("backend='nope'", {"kw": {"backend": "nope"}}, ERROR),
        ("window=(2,)", {"kw": {"window_size": (2,)}}, ERROR),
        ("window=None", {"kw": {"window_size": None}}, ERROR),
    ]
    for label, value, expect in SCALES:
        v.append((f"softmax_scale={label}", {"kw": {"softmax_scale": value}}, expect))
    for m in ("k_float32", "int_tensors", "heads_not_multiple", "kv_len_differs", "empty_seq"):
        v.append((f"prefill:mutate={m}", {"mutate": m}, ERROR))
    for m in STEP_MUTATIONS:
        v.append((f"step:mutate={m}", {"extra": {"step_mutate": m}}, ERROR))
    for view in (x for x in VIEWS if x != "contiguous"):
        v.append((f"view={view}", {"view": view}, CORRECT))
    for j, (tensor, where, window) in enumerate(
        (
            ("k", "early", (-1, -1)),
            ("v", "late", (-1, -1)),
            ("k", "early", (2, 0)),
            ("q", "middle", (-1, -1)),
            ("v", "early", (2, 0)),
        )
    ):
        value = _pick((math.nan, math.inf, -math.inf), j)
        args = {"inject": (tensor, where, value), "kw": {"window_size": window}}
        v.append((f"{value}@{tensor}:{where},window={window}".replace(" ", ""), args, CORRECT))
    for j, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        kw = {} if j == 0 else {"backend": _pick(("cpu_flash", "math"), j)}
        if door.layout == "llama3_zigzag":
            kw = {} if j == 0 else {"backend": "math"}
        v.append(
            (f"dtype={str(dtype).removeprefix('torch.')}", {"dtype": dtype, "kw": kw}, CORRECT)
        )
    for label, factors, dtype in VALUES:
        if "dout" not in label:
            v.append((f"values:{label}", {"factors": factors, "dtype": dtype}, CORRECT))
    odd_ok = door.layout not in ("zigzag", "llama3_zigzag")
    for label, fields, expect in (
        ("D=1", {"D": 1}, CORRECT),
        ("D=64", {"D": 64}, CORRECT),
        ("mqa", {"heads": (H, 1)}, CORRECT),
        ("mha", {"heads": (H, H)}, CORRECT),
        ("B=1", {"B": 1}, CORRECT),
        ("s_local=1", {"s_local": 1}, CORRECT if odd_ok else ERROR),
        ("s_local=16", {"s_local": 16}, CORRECT),
    ):
        v.append((f"shape:{label}", fields, expect))
    return v


def _kv_disagreements(world: int) -> list[tuple[str, dict, bool]]:
    """(field, rank-0 overrides, neutral)."""
    return [
        ("dtype", {"dtype": torch.float32}, False),
        ("scale", {"kw": {"softmax_scale": 0.5}}, False),
        ("window", {"kw": {"window_size": (1, 0)}}, False),
        ("batch", {"B": 1}, False),
        ("sliding_window", {"extra": {"cache_window": 3}}, True),
    ]


# Not passed by rank 0 alone: a group argument (no group to tell the others) and a second
# prefill (a call the others never make, so none of theirs can hear of its error).
_SEQUENCE = ("group=0", "prefill_twice")


def kv_cache_cases() -> list[Case]:
    cases = []
    doors = list(KV_DOORS.values())
    primary = KV_DOORS["zigzag"]
    for i, door in enumerate(doors):
        backends = BACKENDS if door.layout != "llama3_zigzag" else (None, "math")
        for world in WORLDS:  # every backend for zigzag, one per world for the others
            for b in backends if door is primary else (_pick(backends, i + world),):
                setup = _kv_setup(kw={} if b is None else {"backend": b})
                detail = f"base:backend={b}"
                cases.append(_case("kv_cache", door, world, detail, setup, fn=kv_cache_case))
    for i, door in enumerate(doors):
        variants = _kv_variants(door, 1)
        for j in range(len(variants)):
            world = _pick(WORLDS, i + j)
            label, args, expect = _kv_variants(door, world)[j]
            if door is not primary and not label.startswith(("window", "no_prefill", "split")):
                continue
            setup = _kv_setup(expect, label, **args)
            cases.append(_case("kv_cache", door, world, label, setup, expect, fn=kv_cache_case))
    cases.append(_nonmember("kv_cache", primary, _kv_setup(), kv_cache_case))
    variants = _kv_variants(primary, 1)
    bad_args = (j for j, (label, _, e) in enumerate(variants) if e == ERROR)
    for j in (j for j in bad_args if variants[j][0] not in _SEQUENCE):
        world = _pick((2, 3), j)
        label, args, _ = _kv_variants(primary, world)[j]
        valid = _kv_setup(steps=args.get("steps", 3))
        bad = _kv_setup(ERROR, label, **args)
        rank0 = {f: getattr(bad, f) for f in ("kw", "extra", "mutate", "s_local")}
        cases.append(_one_rank("kv_cache", primary, world, label, valid, rank0, kv_cache_case))
    for j, (name, rank0, neutral) in enumerate(_kv_disagreements(2)):
        world = _pick((2, 3, 4), j)
        kw = {"window_size": (2, 0)}
        setup = _kv_setup(
            EITHER if neutral else ERROR, f"the ranks disagree on {name}", kw=kw, rank0=rank0
        )
        for variant, env, expect in (
            ("debug", DEBUG_ENV, EITHER if neutral else ERROR),
            ("nodebug", {}, EITHER if neutral else ERROR),  # the header (gloo)
        ):
            cases.append(
                _case(
                    "kv_cache",
                    primary,
                    world,
                    f"disagree:{name}[{variant}]",
                    setup,
                    expect,
                    fn=kv_cache_case,
                    env=env,
                    timeout_s=DISAGREE_TIMEOUT_S,
                )
            )
    for j, door in enumerate(doors):
        setup = _kv_setup(kw={"window_size": (2, 0)}, extra={"cache_window": 3}, steps=5)
        world = _pick((2, 3, 4), j)
        cases.append(
            _case("kv_cache", door, world, "debug_on", setup, fn=kv_cache_case, env=DEBUG_ENV)
        )
    return cases


def kv_cache_sinks_cases() -> list[Case]:
    """``sinks=`` of ``prefill_attention`` / ``decode_step_attention`` (kind "sinks")."""
    cases = []
    for j, (label, make, expect) in enumerate(SINKS):
        door = _pick(list(KV_DOORS.values()), j)
        world = _pick(WORLDS, j + 2)
        H = default_heads(door, world)[0]
        kw = {"sinks": make(H)}
        if j % 2:
            kw["window_size"] = (2, 0)
        setup = _kv_setup(expect, f"sinks={label}", kw=kw)
        cases.append(_case("sinks", door, world, f"sinks={label}", setup, expect, fn=kv_cache_case))
    return cases
