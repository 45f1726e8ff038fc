"""Remembered resolutions (Note [Remembered resolutions] in ``dtensor_ring/resolved.py``): a
call whose resolution reads the same things gets the same spec without the checks; anything
the key could miss resolves afresh, and bad input raises every time."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from reference import random_qkv

import dtensor_ring as dr
from dtensor_ring import resolve
from dtensor_ring.kernels import clear_selection_cache
from dtensor_ring.layouts import unregister_layout


def _counted(group, scenario: str) -> list:
    """Run ``scenario`` on this rank; per call, how many resolutions ran (or the error's
    type name) and the outputs (bitwise comparable)."""
    counts, original = [0], resolve._resolve

    def counting(*args, **kwargs):
        counts[0] += 1
        return original(*args, **kwargs)

    q, k, v = random_qkv(1, 8, 4, 2, 8, torch.float64, seed=0)
    seen, outs = [], []

    def call(fn=dr.ring_flash_attn_func, *args, **kwargs):
        before = counts[0]
        try:
            outs.append(fn(*args, q, k, v, group=group, **kwargs))
            seen.append(counts[0] - before)
        except (TypeError, ValueError) as err:
            seen.append(type(err).__name__)

    resolve._resolve = counting
    clear_selection_cache()  # nothing remembered from an earlier test in this worker
    try:
        if scenario == "repeat":
            for _ in range(3):
                call(causal=True)
        elif scenario == "arguments":
            call(causal=True)
            call(causal=False)
            call(softmax_scale=0.0)
            call(softmax_scale=-0.0)  # equal to 0.0, not the same scale
            call(window_size=(2, 0))
            call(window_size=[2, 0])
            call(causal=True)
        elif scenario == "deterministic":
            call(causal=True)
            torch.use_deterministic_algorithms(True)
            try:
                call(causal=True)
            finally:
                torch.use_deterministic_algorithms(False)
            call(causal=True)
        elif scenario == "errors":
            call(causal=True)
            call(causal=1)  # == True, hash(True): still a TypeError, every time
            call(causal=1)
            call(causal=True, softmax_scale=float("nan"))
            call(causal=True, softmax_scale=float("nan"))
        elif scenario == "layout_object":  # not registered: found by name in a bounded table
            lay = copy.copy(dr.get_layout("zigzag"))
            lay.name = "zigzag_passed_for_test"
            for _ in range(2):
                call(dr.ring_attention_func, lay, causal=True)
        elif scenario == "versions":
            call(causal=True)
            clear_selection_cache()
            call(causal=True)
            lay = copy.copy(dr.get_layout("ring"))
            lay.name = "ring_copy_for_test"
            dr.register_layout(lay)
            call(dr.ring_attention_func, "ring_copy_for_test", causal=True)
            call(dr.ring_attention_func, "ring_copy_for_test", causal=True)
            unregister_layout("ring_copy_for_test")
            call(dr.ring_attention_func, "ring_copy_for_test", causal=True)  # gone: raises
    finally:
        resolve._resolve = original
    return [seen, [o.tolist() for o in outs]]


EXPECTED = {
    "repeat": [1, 0, 0],
    "arguments": [1, 1, 1, 1, 1, 1, 0],
    "deterministic": [1, 1, 0],
    "errors": [1, "TypeError", "TypeError", "ValueError", "ValueError"],
    "layout_object": [1, 1],
    "versions": [1, 1, 1, 0, "ValueError"],
}


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_resolutions_remembered_exactly(dist_pool, scenario):
    """On a 1-rank group (no header): what is resolved again and what is not; a remembered
    call's output is bitwise the first's."""
    ((seen, outs),) = dist_pool.run(_counted, 1, scenario=scenario)
    assert seen == EXPECTED[scenario]
    if scenario == "repeat":
        assert outs[0] == outs[1] == outs[2]


def test_compared_calls_resolve_every_time(dist_pool):
    """A gloo group of two ranks compares every call's header: each call is resolved."""
    for seen, _ in dist_pool.run(_counted, 2, scenario="repeat"):
        assert seen == [1, 1, 1]


def _bad_after_good(group) -> dict:
    """Each bad call of ``test_validation.py`` right after good calls of the doors it uses
    (their resolutions remembered): what it raised."""
    from test_validation import BAD_CALLS, BAD_TYPES, BAD_VALUES, _qkv

    clear_selection_cache()
    out = {}
    for name, (call, _) in {**BAD_CALLS, **BAD_TYPES, **BAD_VALUES}.items():
        for causal in (False, True):
            dr.ring_flash_attn_func(*_qkv(), causal=causal, group=group)
            dr.zigzag_ring_flash_attn_func(*_qkv(), causal=True, group=group)
        try:
            call(group)
            out[name] = ("no exception", "")
        except Exception as e:  # noqa: BLE001 - reported and checked by the test
            out[name] = (type(e).__name__, str(e))
    return out


def test_bad_calls_raise_after_remembered_good_ones(dist_pool):
    """Every bad call of the validation suite still raises its error at W = 1, where good
    calls before it were remembered."""
    from test_validation import BAD_CALLS, BAD_TYPES, BAD_VALUES

    (got,) = dist_pool.run(_bad_after_good, 1, timeout_s=60)
    for name, (_, pattern) in {**BAD_CALLS, **BAD_TYPES, **BAD_VALUES}.items():
        kind, message = got[name]
        if name == "hybrid_same_group":  # on one rank: a 1 x 1 grid, which is allowed
            continue
        expected = "TypeError" if name in BAD_TYPES else "ValueError"
        assert kind == expected, (name, kind, message)
        assert re.search(pattern, message), (name, message, pattern)


def _dtensor_errors_after_good(group) -> dict:
    """SDPA on DTensors: good calls through the scope and the function first (their checks
    remembered), then every bad call of ``test_dtensor.py``'s error table."""
    import torch.nn.functional as F
    from test_dtensor import _errors, _mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    clear_selection_cache()
    q = distribute_tensor(torch.randn(1, 4, 8, 8), _mesh(group), [Shard(2)])
    for layout in ("zigzag", "llama3_zigzag"):
        with dr.ring_sdpa(layout=layout):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        dr.scaled_dot_product_ring_attention(q, q, q, is_causal=True, layout=layout)
    return _errors(group)


def test_dtensor_errors_after_remembered_checks(dist_pool):
    """Every error of the DTensor SDPA table is still raised, on both ranks, after good calls
    whose checks were remembered (not compared on their own: the table serves W = 2 too)."""
    from test_dtensor import EXPECTED_ERRORS, LLAMA3_ZIGZAG_ERRORS

    for messages in dist_pool.run(_dtensor_errors_after_good, 2):
        gather = {f"llama3_zigzag {n}": EXPECTED_ERRORS[n] for n in LLAMA3_ZIGZAG_ERRORS}
        for name, expected in {**EXPECTED_ERRORS, **gather}.items():
            for way in ("scope", "direct"):
                message = messages[f"{name}/{way}"]
                assert expected in message and "Error" in message, (name, way, message)


def _groups_of_equal_meshes(group) -> list:
    """SDPA on DTensors of two meshes over the same ranks but different process groups (the
    meshes compare equal): each call's checks name its own mesh's group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from dtensor_ring.api.dtensor.placements import check_sdpa_args

    clear_selection_cache()
    other = dist.new_group(dist.get_process_group_ranks(group))
    meshes = [DeviceMesh.from_group(g, "cpu") for g in (group, other)]
    assert meshes[0] == meshes[1]
    names = []
    for mesh in (*meshes, meshes[0]):
        q = DTensor.from_local(torch.randn(1, 2, 4, 8), mesh, [Shard(2)], run_check=False)
        names.append(check_sdpa_args(q, q, q, None, 0.0, True, False, "ring")[1])
    return [names, [group.group_name, other.group_name, group.group_name]]


def test_equal_meshes_of_other_groups_are_not_confused(dist_pool):
    """(On the whole pool: ``new_group`` is a collective of every rank of the default
    group.)"""
    for names, expected in dist_pool.run(_groups_of_equal_meshes, 4):
        assert names == expected


def _sdpa_routes(group) -> list:
    """SDPA on DTensors in a held-open scope (its eager route resolves the local call in the
    forward and again in the backward): how many routes each call ran."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from dtensor_ring.api.dtensor import handlers

    clear_selection_cache()
    mesh = DeviceMesh.from_group(group, "cpu")
    W = mesh.size()
    routes, original = [0], handlers.sdpa_route

    def counting(*args, **kwargs):
        routes[0] += 1
        return original(*args, **kwargs)

    def leaves(seed: int = 0):
        q, k, v = random_qkv(1, 8 * W, 4, 2, 8, torch.float64, seed=seed)
        return [
            DTensor.from_local(x.transpose(1, 2).contiguous(), mesh, [Shard(2)], run_check=False)
            .detach()
            .requires_grad_()
            for x in (q, k, v)
        ]

    seen, outs = [], []

    def call(layout="zigzag", is_causal=True, seed=0):
        before = routes[0]
        q, k, v = leaves(seed)
        with dr.ring_sdpa(layout=layout):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
            out.sum().backward()
        outs.append([out.to_local().tolist(), q.grad.to_local().tolist()])
        seen.append(routes[0] - before)

    handlers.sdpa_route = counting
    try:
        call()
        call()  # the same call: remembered, forward and backward
        call(seed=1)  # other values, the same key
        call(layout="ring", is_causal=False)
        torch.use_deterministic_algorithms(True)
        try:
            call()
        finally:
            torch.use_deterministic_algorithms(False)
        call(layout="auto")  # priced per call
        call(layout="auto")
        dr.set_consistency_checks(True)
        try:
            call()  # compared across the group: resolved every time
            call()
        finally:
            dr.set_consistency_checks(None)
    finally:
        handlers.sdpa_route = original
    return [seen, outs[0] == outs[1]]


def test_sdpa_on_dtensors_resolves_once_per_key(dist_pool):
    """SDPA on DTensors' local resolution (``resolve_local``) is remembered per key at W = 1:
    a call's backward routes no more than its forward, a repeated call not at all, with
    bitwise the first call's results; another mask or deterministic switch resolves afresh;
    "auto" and a compared call (the consistency mode; at W = 2 the gloo header) every time,
    forward and backward."""
    ((seen, same),) = dist_pool.run(_sdpa_routes, 1)
    assert seen == [1, 0, 0, 1, 1, 2, 2, 2, 2] and same, seen  # a backward: its forward's
    for seen, _ in dist_pool.run(_sdpa_routes, 2):
        assert seen == [2] * 9, seen
