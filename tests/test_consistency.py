"""The consistency mode (Note [Consistency mode] in ``dtensor_ring/consistency.py``), directly.

With the mode on, every call first compares a fingerprint of its metadata across its group
(one ``all_gather_object``). These tests run on 2, 3 and 4 ranks of the worker pool
(``_dist.py``); in each disagreement one rank (:data:`ODD`, rank 1) passes a different value of
one field, and EVERY rank must raise the same ``ValueError``, whose text names the field and
the ranks holding each value (asserted on each rank's exception text). A rank that does not
raise would wait in the ring for peers that already returned: the pool reports that as a hang,
so a missed disagreement fails the test instead of blocking it.

Also: the environment variable and the Python switch both turn it on, the variable is read at
every call, the mode off adds only the header on gloo (Note [Consistency header]: with it
every rank raises too, naming the field), one rank's own error reaches every rank, and
``DTensor.from_local(..., run_check=False)`` with uneven local shapes is caught.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import random_qkv
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import dtensor_ring as dr
from dtensor_ring import consistency
from dtensor_ring.consistency import ConsistencyError

ENV = consistency.ENV_VAR
SUFFIX = f" ({ENV}=1 consistency check)"
ODD = 1  # the rank that disagrees
WORLDS = (2, 3, pytest.param(4, marks=pytest.mark.slow))  # W = 4 in the slow tier
B, S, H, H_KV, D = 1, 4, 12, 6, 8  # H divisible by 2, 3 and 4 (Ulysses shards the heads)
SHAPES = [(B, S, H, D), (B, S, H_KV, D), (B, S, H_KV, D)]


def _qkv(s_local: int = S, dtype: torch.dtype = torch.float64, varlen: bool = False):
    q, k, v = random_qkv(B, s_local, H, H_KV, D, dtype, seed=0)
    return (q[0], k[0], v[0]) if varlen else (q, k, v)


@contextlib.contextmanager
def _mode(how: str | None) -> Iterator[None]:
    """The consistency mode on through ``how`` ("python": ``set_consistency_checks(True)``;
    "env": ``DTENSOR_RING_DEBUG=1``) or off (None); the worker's state restored after (the
    pool's workers serve every test of the session)."""
    old = os.environ.pop(ENV, None)
    try:
        if how == "env":
            os.environ[ENV] = "1"
        consistency.set_consistency_checks(True if how == "python" else None)
        yield
    finally:
        consistency.set_consistency_checks(None)
        os.environ.pop(ENV, None)
        if old is not None:
            os.environ[ENV] = old


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    """``(exception type, message)`` of ``call()``, or ``("no exception", "")``; a
    disagreement (``ConsistencyError``) counts as the ``ValueError`` it subclasses."""
    try:
        call()
    except ConsistencyError as e:
        return "ValueError", str(e)
    except Exception as e:  # noqa: BLE001 - reported to the main process and checked there
        return type(e).__name__, str(e)
    return "no exception", ""


def _ranks(ranks: list[int]) -> str:
    """How ``first_difference`` names a set of ranks: ``rank 1 has`` / ``ranks 0,2 have``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {','.join(map(str, ranks))} have"


def _expected(field: str, base: object, odd: object, world: int) -> str:
    """The message of a disagreement in which rank :data:`ODD` alone holds ``odd``."""
    others = [r for r in range(world) if r != ODD]
    return f"ranks disagree on {field}: {_ranks(others)} {base!r}; {_ranks([ODD])} {odd!r}{SUFFIX}"


def _assert_same_error_everywhere(results: list[tuple[str, str]]) -> str:
    """Every rank raised ValueError with the same message; returns it."""
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert message == results[0][1], f"rank {rank} differs:\n{message}\n{results[0][1]}"
    return results[0][1]


# --- disagreements: one field differs on rank ODD ------------------------------------------


def _mesh(group) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _sdpa_dtensors(group, s_local: int = S) -> tuple[DTensor, DTensor, DTensor]:
    """``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` DTensors from this rank's local shards."""
    mesh = _mesh(group)
    return tuple(
        DTensor.from_local(t.transpose(1, 2), mesh, [Shard(2)], run_check=False)
        for t in _qkv(s_local)
    )


def _ring(group, **kw) -> None:
    """``ring_flash_attn_func`` on this rank's ``_qkv()`` (or ``qkv=``), causal, math kernel."""
    kw = {"causal": True, "backend": "math", **kw}
    dr.ring_flash_attn_func(*kw.pop("qkv", _qkv()), group=group, **kw)


def _varlen(group, odd: bool) -> None:
    local_docs = (0, 2, 2 * S) if odd else (0, S, 2 * S)  # global cu_seqlens // W
    cu = torch.tensor(local_docs, dtype=torch.int32)
    dr.ring_flash_attn_varlen_func(*_qkv(2 * S, varlen=True), cu, None, causal=True, group=group)


def _llama3(group, odd: bool) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_len = 2 * S
    docs = torch.tensor([0, 5 if odd else 3, local_len * world], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(
        docs, True, rank, world
    )
    q, k, v = _qkv(local_len, varlen=True)
    dr.llama3_flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True, group=group
    )


def _sdpa_mode(group, odd: bool) -> None:
    q, k, v = _sdpa_dtensors(group)
    mode = "ulysses" if odd else "ring"
    dr.scaled_dot_product_ring_attention(q, k, v, is_causal=True, enable_gqa=True, mode=mode)


def _scope_layout(group, odd: bool) -> None:
    q, k, v = _sdpa_dtensors(group)
    with dr.ring_sdpa(layout="zigzag" if odd else "ring"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@dataclass(frozen=True)
class Disagreement:
    """``call(group, odd)`` makes the call (``odd``: this rank disagrees); ``field`` is what the
    message names; ``values(W)`` the value of the other ranks and of rank ODD."""

    field: str
    call: Callable[..., None]
    values: Callable[[int], tuple[object, object]]


def _shapes(s_local: int) -> list[tuple[int, ...]]:
    return [(b, s_local, h, d) for b, _, h, d in SHAPES]


DISAGREEMENTS = {
    "shape": Disagreement(
        "shapes",
        lambda g, odd: _ring(g, qkv=_qkv(6 if odd else S)),
        lambda w: (SHAPES, _shapes(6)),
    ),
    "dtype": Disagreement(
        "dtype",
        lambda g, odd: _ring(g, qkv=_qkv(dtype=torch.float32 if odd else torch.float64)),
        lambda w: ("torch.float64", "torch.float32"),
    ),
    "causal": Disagreement(
        "causal", lambda g, odd: _ring(g, causal=not odd), lambda w: (True, False)
    ),
    "layout": Disagreement(
        "layout",
        lambda g, odd: (dr.zigzag_ring_flash_attn_func if odd else dr.ring_flash_attn_func)(
            *_qkv(), causal=True, group=g, backend="math"
        ),
        lambda w: ("ring", "zigzag"),
    ),
    "window": Disagreement(
        "window",
        lambda g, odd: _ring(g, window_size=(2, 0) if odd else (-1, -1)),
        lambda w: (None, (2, 0)),
    ),
    "softmax_scale": Disagreement(
        "scale",  # the resolved scale: None is D ** -0.5
        lambda g, odd: _ring(g, softmax_scale=0.5 if odd else None),
        lambda w: (D**-0.5, 0.5),
    ),
    "backend": Disagreement(
        "backend",
        lambda g, odd: _ring(g, backend="cpu_flash" if odd else "math"),
        lambda w: ("math", "cpu_flash"),
    ),
    "op": Disagreement(
        "op",
        lambda g, odd: (dr.ulysses_flash_attn_func if odd else dr.ring_flash_attn_func)(
            *_qkv(), causal=True, group=g, backend="math"
        ),
        lambda w: ("ring_attention", "ulysses"),
    ),
    "ulysses_lse": Disagreement(  # rank ODD alone would run the lse's all-to-all
        "lse returned",
        lambda g, odd: dr.ulysses_flash_attn_func(
            *_qkv(), causal=True, group=g, backend="math", return_attn_probs=odd
        ),
        lambda w: (False, True),
    ),
    "cu_seqlens": Disagreement("cu_seqlens", _varlen, lambda w: ((0, S, 2 * S), (0, 2, 2 * S))),
    "sdpa_mode": Disagreement("op", _sdpa_mode, lambda w: ("sdpa[ring]", "sdpa[ulysses]")),
    "ring_sdpa_layout": Disagreement("layout", _scope_layout, lambda w: ("ring", "zigzag")),
    "from_local_uneven": Disagreement(  # DTensor.from_local(run_check=False), uneven shards
        "shapes",
        lambda g, odd: dr.scaled_dot_product_ring_attention(
            *_sdpa_dtensors(g, 6 if odd else S), is_causal=True, enable_gqa=True
        ),
        # the DTensors' global shapes: each rank takes its own local length times W
        lambda w: (_shapes(S * w), _shapes(6 * w)),
    ),
    "from_local_uneven_scope": Disagreement(
        "shapes",
        lambda g, odd: _scope_call(_sdpa_dtensors(g, 6 if odd else S)),
        lambda w: (SHAPES, _shapes(6)),  # the scope's handler resolves the local shards
    ),
}


def _scope_call(qkv) -> None:
    with dr.ring_sdpa():
        F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)


def run_disagreement(group, name: str, how: str | None = "python") -> tuple[str, str]:
    """Worker body: the call of ``DISAGREEMENTS[name]`` with the mode on through ``how``
    (None: off, the header of Note [Consistency header])."""
    odd = dist.get_rank(group) == ODD
    with _mode(how):
        return _outcome(lambda: DISAGREEMENTS[name].call(group, odd))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", list(DISAGREEMENTS))
def test_disagreement_raises_on_every_rank(dist_pool, name, world_size):
    results = dist_pool.run(run_disagreement, world_size, timeout_s=30, name=name)
    case = DISAGREEMENTS[name]
    message = _assert_same_error_everywhere(results)
    assert message == _expected(case.field, *case.values(world_size), world_size)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", list(DISAGREEMENTS))
def test_disagreement_off_raises_on_every_rank(dist_pool, name, world_size):
    """Mode off, gloo: the fixed-size header (Note [Consistency header]) makes every rank
    raise, naming the field and which ranks differ (values: this rank's own; no abort)."""
    results = dist_pool.run(run_disagreement, world_size, timeout_s=30, name=name, how=None)
    field = DISAGREEMENTS[name].field
    others = [r for r in range(world_size) if r != ODD]
    expected = (
        f"ranks disagree: {field}: {_ranks(others)} one value, rank {ODD} another (this rank has "
    )
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", (rank, kind, message)
        assert message.startswith(expected), (rank, message)
        assert f"nothing was communicated ({ENV}=1 names every rank's values" in message


def run_one_rank_raises_off(group, name: str) -> tuple[str, str]:
    """Worker body: rank ODD alone passes an argument its own checks reject (``name``: of
    :data:`OWN_ERRORS`, or a dropout); mode off."""
    bad = dist.get_rank(group) == ODD
    with _mode(None):
        if name == "dropout":
            return _outcome(lambda: _ring(group, dropout_p=0.5 if bad else 0))
        return _outcome(lambda: OWN_ERRORS[name][0](group, bad))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(
    "name",
    [
        "dropout",
        "llama3_cu_seqlens_q",
        "placed_cu_seqlens",
        "llama3_zigzag_odd_length",
        "kv_cache_sliding_window",
        "context_parallel_layout",
    ],
)
def test_one_rank_raises_off(dist_pool, world_size, name):
    """Mode off, gloo: the rank whose checks fail raises its own error, the others a
    ConsistencyError naming it; nobody waits (llama3's metadata values, which the ranks do
    not compare, are checked before the header too)."""
    results = dist_pool.run(run_one_rank_raises_off, world_size, timeout_s=30, name=name)
    own = "dropout_p" if name == "dropout" else OWN_ERRORS[name][1].split(": ", 1)[1]
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", (rank, kind, message)
        if rank == ODD:
            assert re.match(own, message) and consistency.HEADER_HINT in message, message
        else:
            assert message.startswith(
                f"ranks disagree: rank {ODD} of the group raised an error in its own checks"
            ), message


def test_header_names_a_field_past_this_ranks_own():
    """Two fingerprints of different lengths that agree on the shorter one's fields: the rank
    with the shorter one names "the further fields" (no IndexError)."""
    short, long = {"op": "x", "a": 1}, {"op": "x", "a": 1, "b": 2}
    headers = torch.stack([consistency._header(short, False), consistency._header(long, False)])
    assert consistency._first_field(headers, [0, 1], short).startswith(
        "the further fields: rank 0 has one value, rank 1 another"
    )
    assert consistency._first_field(headers, [0, 1], long).startswith("b: rank 0 has")


def test_header_is_fixed_size():
    """The header's size never depends on the call (ranks meet in equal-size collectives)."""
    few = consistency._header({"op": "x"}, False)
    many = consistency._header({f"f{i}": i for i in range(40)}, True)
    error = consistency._header({"op": "x", "error": "ValueError: bad"}, False)
    assert few.shape == many.shape == error.shape == (consistency.HEADER_SLOTS,)
    assert few.dtype == torch.int64
    assert (error[0], few[0], many[1]) == (1, 0, 1)
    # a change in any field, also past the 13 hashed one by one, changes the header
    changed = consistency._header({**{f"f{i}": i for i in range(40)}, "f39": -1}, True)
    assert not torch.equal(many, changed)


@pytest.mark.parametrize("world_size", WORLDS)
def test_llama3_metadata_disagreement(dist_pool, world_size):
    """Rank ODD prepares its llama3 metadata from other documents: the fingerprints agree (the
    metadata legitimately differs per rank), the check of all ranks' metadata does not."""
    results = dist_pool.run(run_llama3, world_size, timeout_s=30)
    message = _assert_same_error_everywhere(results)
    assert re.fullmatch(
        rf"ranks disagree on llama3 metadata: rank \d has cu_seqlens_q=\[.*\], cu_seqlens_k="
        rf"\[.*\], local_k_slice=\(\d+, \d+\), but the documents \[.*\] of all ranks "
        rf"\(causal=True\) give .*{re.escape(SUFFIX)}",
        message,
    ), message


def run_llama3(group) -> tuple[str, str]:
    odd = dist.get_rank(group) == ODD
    with _mode("python"):
        return _outcome(lambda: _llama3(group, odd))


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def run_hybrid_group_size(group) -> tuple[str, str]:
    """Worker body on 4 ranks: hybrid attention over ring groups {0, 2} and {1, 3}; ranks 0 and
    1 pass a Ulysses group of 1 rank, ranks 2 and 3 the Ulysses group {2, 3}: the ranks of each
    ring group disagree on the size of the whole call (U * R)."""
    if not _GROUPS:  # new_group is a collective of the default group: every rank, same order
        for ranks in ((0,), (1,), (2, 3), (0, 2), (1, 3)):
            _GROUPS[ranks] = dist.new_group(list(ranks))
    rank = dist.get_rank()
    ulysses = _GROUPS[(rank,) if rank < 2 else (2, 3)]
    ring = _GROUPS[(0, 2) if rank % 2 == 0 else (1, 3)]
    with _mode("python"):
        return _outcome(
            lambda: dr.hybrid_flash_attn_func(
                *_qkv(), causal=True, ulysses_group=ulysses, ring_group=ring, backend="math"
            )
        )


def run_hybrid_disagreement(group) -> tuple[str, str]:
    """Worker body on 4 ranks: hybrid attention over Ulysses groups {0, 1}, {2, 3} and ring
    groups {0, 2}, {1, 3}; rank 3 alone passes causal=False. Its ring group finds the
    difference, and the Ulysses groups carry it to ranks 0 and 2."""
    if not _GROUPS:  # new_group is a collective of the default group: every rank, same order
        for ranks in ((0,), (1,), (2, 3), (0, 2), (1, 3), (0, 1)):
            _GROUPS[ranks] = dist.new_group(list(ranks))
    rank = dist.get_rank()
    ulysses = _GROUPS[(0, 1) if rank < 2 else (2, 3)]
    ring = _GROUPS[(0, 2) if rank % 2 == 0 else (1, 3)]
    with _mode("python"):
        return _outcome(
            lambda: dr.hybrid_flash_attn_func(
                *_qkv(),
                causal=rank != 3,
                ulysses_group=ulysses,
                ring_group=ring,
                layout="ring",
                backend="math",
            )
        )


def test_hybrid_disagreement_reaches_both_groups(dist_pool):
    results = dist_pool.run(run_hybrid_disagreement, 4, timeout_s=30)
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert message.startswith("ranks disagree on causal: rank 0 has True; rank 1 has False")


def test_group_size_disagreement(dist_pool):
    results = dist_pool.run(run_hybrid_group_size, 4, timeout_s=30)
    message = _assert_same_error_everywhere(results)
    # The ranks are those of the group the check runs over (the ring group): in {0, 2}, global
    # rank 2 is rank 1.
    assert message == f"ranks disagree on world_size: rank 0 has 2; rank 1 has 4{SUFFIX}"


@pytest.mark.parametrize("name", ["causal", "layout", "from_local_uneven"])
def test_env_var_turns_it_on(dist_pool, name):
    results = dist_pool.run(run_disagreement, 3, timeout_s=30, name=name, how="env")
    case = DISAGREEMENTS[name]
    assert _assert_same_error_everywhere(results) == _expected(case.field, *case.values(3), 3)


# --- one rank's own error reaches every rank -----------------------------------------------

# name -> (call(group, bad), regex of the bad rank's own error, as the message quotes it)
OWN_ERRORS = {
    "window": (
        lambda g, bad: _ring(g, window_size=(-2, 0) if bad else (-1, -1)),
        r"ValueError: window_size=\(-2, 0\) must be two ints",
    ),
    "causal_type": (
        lambda g, bad: _ring(g, causal="False" if bad else True),
        r"TypeError: causal must be a bool, got str 'False'",
    ),
    "scale_nan": (
        lambda g, bad: _ring(g, softmax_scale=math.nan if bad else None),
        r"ValueError: softmax_scale=nan must be finite",
    ),
    "zigzag_odd_length": (
        lambda g, bad: dr.zigzag_ring_flash_attn_func(*_qkv(3 if bad else S), causal=True, group=g),
        r"ValueError: .*S_local=3",
    ),
    "cu_seqlens_dtype": (  # a front door's own further checks (resolve_call(checks=...))
        lambda g, bad: dr.ring_flash_attn_varlen_func(
            *_qkv(2 * S, varlen=True),
            torch.tensor([0, S, 2 * S], dtype=torch.int64 if bad else torch.int32),
            None,
            causal=True,
            group=g,
        ),
        r"ValueError: cu_seqlens must be int32",
    ),
    "llama3_cu_seqlens_q": (  # metadata values, which the ranks do not compare
        lambda g, bad: _llama3_short(g, bad),
        r"ValueError: cu_seqlens_q must end at the number of tokens",
    ),
    "placed_cu_seqlens": (  # a placed layout's local boundaries are the rank's own
        lambda g, bad: _placed_short(g, bad),
        r"ValueError: cu_seqlens must end at",
    ),
    # checks a front door runs before resolve_call, relayed by consistency.relay_errors
    "llama3_zigzag_odd_length": (  # the all-gather's own checks of the tensors
        lambda g, bad: dr.llama3_zigzag_flash_attn_func(
            *_qkv(3 if bad else S), causal=True, group=g
        ),
        r"ValueError: .*S_local=3",
    ),
    "kv_cache_sliding_window": (  # a constructor's check: the others' next call hears it
        lambda g, bad: _kv_cache_prefill(g, sliding_window=0 if bad else None),
        r"ValueError: sliding_window=0 must be positive, or None",
    ),
    "context_parallel_layout": (  # checked on entering the context, compared there
        lambda g, bad: _cp_sdpa(g, layout="nope" if bad else None),
        r"ValueError: layout='nope' is not a sequence layout",
    ),
    "kv_packed_shape": (
        lambda g, bad: dr.ring_flash_attn_kvpacked_func(
            _qkv()[0], _packed_kv(extra=bad), causal=True, group=g, backend="math"
        ),
        r"ValueError: kv must be \[B, S_local, 2, H_kv, D\] \(packed\)",
    ),
    "sdpa_is_causal_type": (
        lambda g, bad: dr.scaled_dot_product_ring_attention(
            *_sdpa_dtensors(g), is_causal="yes" if bad else True, enable_gqa=True
        ),
        r"TypeError: is_causal must be a bool, got str 'yes'",
    ),
    "sdpa_zigzag_noncausal": (
        lambda g, bad: dr.scaled_dot_product_ring_attention(
            *_sdpa_dtensors(g), is_causal=not bad, enable_gqa=True, layout="zigzag"
        ),
        r"ValueError: layout='zigzag' is for causal attention only",
    ),
}


def _llama3_short(group, bad: bool) -> None:
    """llama3 attention with this rank's cu_seqlens_q short of its tokens when ``bad``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    docs = torch.tensor([0, 3, 2 * S * world], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(
        docs, True, rank, world
    )
    cu_q = cu_q.clone()
    cu_q[-1] -= int(bad)
    q, k, v = _qkv(2 * S, varlen=True)
    dr.llama3_flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True, group=group
    )


def _placed_short(group, bad: bool) -> None:
    """Ring varlen attention in ``document_layout``'s placement, this rank's local
    cu_seqlens short of its tokens when ``bad``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = dr.document_layout([0, 3, 2 * S * world], world)
    cu = torch.tensor(layout.local_bounds[rank], dtype=torch.int32)
    cu[-1] -= int(bad)
    dr.ring_varlen_attention_func(
        layout, *_qkv(2 * S, varlen=True), cu, None, causal=True, group=group
    )


def _kv_cache_prefill(group, sliding_window: int | None) -> None:
    """A ``KVCacheShard`` made with ``sliding_window``, filled by ``prefill_attention``."""
    cache = dr.KVCacheShard(group, sliding_window=sliding_window)
    dr.prefill_attention(*_qkv(), cache, backend="math")


def _cp_sdpa(group, layout: str | None) -> None:
    """SDPA on the shards of ``context_parallel(..., layout=layout)``."""
    W = dist.get_world_size(group)
    positions = torch.arange(S * W)
    with dr.context_parallel(
        DeviceMesh.from_group(group, "cpu"), buffers=[positions], buffer_seq_dims=[0], layout=layout
    ):
        q, k, v = (t.transpose(1, 2) for t in _qkv())
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _packed_kv(extra: bool) -> torch.Tensor:
    """``kv [B, S, 2, H_kv, D]`` of ``_qkv()``, or a malformed ``[B, S, 3, H_kv, D]``."""
    _, k, v = _qkv()
    return torch.stack([k, v, v] if extra else [k, v], dim=2)


def run_own_error(group, name: str, bad_ranks: tuple[int, ...] = (ODD,)) -> tuple[str, str]:
    bad = dist.get_rank(group) in bad_ranks
    with _mode("python"):
        return _outcome(lambda: OWN_ERRORS[name][0](group, bad))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", list(OWN_ERRORS))
def test_one_rank_error_reaches_every_rank(dist_pool, name, world_size):
    results = dist_pool.run(run_own_error, world_size, timeout_s=30, name=name)
    message = _assert_same_error_everywhere(results)  # the bad rank raises it too
    others = [r for r in range(world_size) if r != ODD]
    prefix = f"ranks disagree on error: {_ranks(others)} '<missing>'; {_ranks([ODD])} "
    assert message.startswith(prefix) and message.endswith(SUFFIX), message
    assert re.match(rf"['\"]{OWN_ERRORS[name][1]}", message[len(prefix) :]), message


@pytest.mark.parametrize("world_size", [3, 4])
def test_two_ranks_with_different_errors(dist_pool, world_size):
    results = dist_pool.run(run_two_errors, world_size, timeout_s=30)
    message = _assert_same_error_everywhere(results)
    parts = message.removesuffix(SUFFIX).split("; ")
    assert parts[0] == f"ranks disagree on error: {_ranks([0])} '<missing>'", message
    window_ranks = _ranks([1] if world_size == 3 else [1, 3])
    assert parts[1].startswith(f"{window_ranks} 'ValueError: window_size=(-2, 0)"), message
    assert parts[2].startswith("rank 2 has 'ValueError: softmax_scale=nan"), message


def run_two_errors(group) -> tuple[str, str]:
    rank = dist.get_rank(group)
    with _mode("python"):
        if rank == 2:
            return _outcome(lambda: _ring(group, softmax_scale=math.nan))
        return _outcome(lambda: _ring(group, window_size=(-2, 0) if rank else (-1, -1)))


def run_same_error(group) -> tuple[str, str]:
    with _mode("python"):
        return _outcome(lambda: _ring(group, window_size=(-2, 0)))


def test_same_error_on_every_rank_is_the_error_itself(dist_pool):
    """When every rank fails alike, the fingerprints agree: each rank raises its own error."""
    results = dist_pool.run(run_same_error, 3, timeout_s=30)
    message = _assert_same_error_everywhere(results)
    assert message.startswith("window_size=(-2, 0) must be two ints"), message


# --- cost: the mode off communicates nothing extra ----------------------------------------


def _counting_gathers() -> tuple[list[int], Callable[[], None]]:
    """Count ``dist.all_gather_object`` calls (the mode's one collective) in ``count[0]`` and
    ``dist.all_gather`` calls (the header's, Note [Consistency header]) in ``count[1]``;
    returns the counter and the function that undoes the patch."""
    count = [0, 0]
    originals = dist.all_gather_object, dist.all_gather

    def counting(index: int, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            count[index] += 1
            return original(*args, **kwargs)

        return counted

    dist.all_gather_object, dist.all_gather = (counting(i, f) for i, f in enumerate(originals))

    def undo() -> None:
        dist.all_gather_object, dist.all_gather = originals

    return count, undo


def run_counted(group, how: str | None) -> tuple[tuple[int, int], list[torch.Tensor]]:
    """Worker body: one consistent forward + backward; the numbers of all_gather_object and
    all_gather calls and the results (out, dq, dk, dv)."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    count, undo = _counting_gathers()
    try:
        with _mode(how):
            out = dr.ring_flash_attn_func(q, k, v, causal=True, group=group)
            out.sum().backward()
    finally:
        undo()
    return tuple(count), [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("world_size", [1, *WORLDS])
def test_mode_off_adds_one_header(dist_pool, world_size):
    off = dist_pool.run(run_counted, world_size, timeout_s=30, how=None)
    on = dist_pool.run(run_counted, world_size, timeout_s=30, how="python")
    # Off (gloo): one header gather per call; on: one all_gather_object per call instead (none
    # in the backward; none on a group of 1 rank).
    assert [n for n, _ in off] == [(0, int(world_size > 1))] * world_size
    assert [n for n, _ in on] == [(int(world_size > 1), 0)] * world_size
    for (_, a), (_, b) in zip(off, on, strict=True):  # a consistent call is unchanged
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run_switches(group) -> dict[str, int]:
    """Worker body: gathers per call under each setting, changed between calls in one process
    (the environment variable is read at every call, not at import)."""
    settings = {
        "unset": (None, None),
        "env=1": ("1", None),
        "env=0": ("0", None),
        "env=true": ("true", None),
        "env=off": ("off", None),
        "env=1, switch False": ("1", False),
        "unset, switch True": (None, True),
        "env=1, switch None": ("1", None),
    }
    counts = {}
    old = os.environ.pop(ENV, None)
    count, undo = _counting_gathers()
    try:
        for label, (env, switch) in settings.items():
            os.environ.pop(ENV, None)
            if env is not None:
                os.environ[ENV] = env
            consistency.set_consistency_checks(switch)
            before = count[0]
            _ring(group)
            counts[label] = count[0] - before
    finally:
        undo()
        consistency.set_consistency_checks(None)
        os.environ.pop(ENV, None)
        if old is not None:
            os.environ[ENV] = old
    return counts


def test_env_var_read_at_call_time_and_switch_overrides_it(dist_pool):
    expected = {
        "unset": 0,
        "env=1": 1,
        "env=0": 0,
        "env=true": 1,
        "env=off": 0,
        "env=1, switch False": 0,
        "unset, switch True": 1,
        "env=1, switch None": 1,
    }
    assert dist_pool.run(run_switches, 2, timeout_s=30) == [expected, expected]


# --- the pieces, in one process -------------------------------------------------------------


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("yes", True), (" 1 ", True), ("2", True)]
    + [("0", False), ("", False), ("false", False), ("No", False), ("OFF", False)],
)
def test_env_values(monkeypatch, value, on):
    monkeypatch.setenv(ENV, value)
    assert consistency.consistency_checks_enabled() is on


def test_switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    try:
        assert not consistency.consistency_checks_enabled()
        consistency.set_consistency_checks(True)
        assert consistency.consistency_checks_enabled()
        monkeypatch.setenv(ENV, "1")
        consistency.set_consistency_checks(False)
        assert not consistency.consistency_checks_enabled()
        consistency.set_consistency_checks(None)
        assert consistency.consistency_checks_enabled()
        with pytest.raises(TypeError, match="enabled must be a bool or None"):
            consistency.set_consistency_checks(1)
    finally:
        consistency.set_consistency_checks(None)


def test_first_difference():
    fd = consistency.first_difference
    assert fd([{"op": "a", "causal": True}] * 3) is None
    assert (
        fd([{"op": "a", "causal": True}, {"op": "a", "causal": False}, {"op": "a", "causal": True}])
        == "causal: ranks 0,2 have True; rank 1 has False"
    )
    # the first differing field in the fingerprints' order; values as repr
    assert fd([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]) == "a: rank 0 has 1; rank 1 has 2"
    assert fd([{"a": 1, "b": "x"}, {"a": 1, "b": "y"}]) == "b: rank 0 has 'x'; rank 1 has 'y'"
    # a field one rank lacks; an error explains the rest and comes first
    assert fd([{"a": 1}, {"a": 1, "b": 2}]) == "b: rank 0 has '<missing>'; rank 1 has 2"
    assert (
        fd([{"op": "x", "a": 1}, {"op": "x", "error": "ValueError: bad"}])
        == "error: rank 0 has '<missing>'; rank 1 has 'ValueError: bad'"
    )


def test_mode_off_without_gloo_is_a_no_op(monkeypatch):
    """Mode off, no gloo group (NCCL, or one rank: see above): no collective at all."""

    def fail(*args, **kwargs):
        raise AssertionError("the mode is off and the group is not gloo: no collective")

    monkeypatch.setattr(consistency, "_gloo_group", lambda name: None)
    monkeypatch.setattr(dist, "all_gather", fail)
    monkeypatch.setattr(dist, "all_gather_object", fail)
    monkeypatch.delenv(ENV, raising=False)
    assert not consistency.comparing("no-such-group")
    consistency.check_consistent("no-such-group", {"op": "x"})


# --- the mode off: errors name the mode ----------------------------------------------------


def _hint_off(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    """With the mode off, every rank makes the same bad calls (rejected before any
    communication); their messages."""
    q, k, v = _qkv()
    with _mode(None):
        return [
            _outcome(lambda: dr.ring_flash_attn_func(q, k, v, dropout_p=0.5, group=group)),
            _outcome(lambda: dr.ring_attention_func("zigzag", q, k, v, group=group)),
            _outcome(
                lambda: dr.ring_attention_func(
                    "stripe", q, k, v, group=group, algorithm="all_gather"
                )
            ),
        ]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_errors_name_the_mode(dist_pool, world_size):
    """Every error raised before communication on a group of more than one rank names
    DTENSOR_RING_DEBUG=1 (other ranks may be waiting); on one rank it does not."""
    for outcomes in dist_pool.run(_hint_off, world_size):
        for kind, message in outcomes:
            assert kind == "ValueError", (kind, message)
            # gloo: the header made every rank raise (Note [Consistency header])
            assert (consistency.HEADER_HINT in message) == (world_size > 1), message
            assert message.count(f"{ENV}=1") <= 1, message  # once
