"""Bad inputs raise ``ValueError`` on every rank, before any communication.

Each case runs on several ranks of the worker pool; every rank makes the same bad call and
reports what it raised. A rank that did not raise would enter the ring exchange and wait for
peers that already returned: the pool reports that as a hang (the call's ``timeout_s``), so a
missing check fails the test instead of hanging it. The message must name the offending argument
(loose regexes: the wording is the library's).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from reference import random_qkv

import dtensor_ring as dr


def _qkv(B=1, S=4, H=4, H_kv=2, D=8, dtype=torch.float64):
    return random_qkv(B, S, H, H_kv, D, dtype, seed=0)


def _kv_packed():
    q, k, v = _qkv()
    return q, torch.stack([k, v], dim=2)


def _qkv_packed():
    q, k, v = _qkv(H_kv=4)
    return torch.stack([q, k, v], dim=2)


# name -> (call(group), regex the message must contain)
BAD_CALLS = {
    "q_3d": (lambda g: dr.ring_flash_attn_func(_qkv()[0][0], *_qkv()[1:], group=g), r"\bq\b"),
    "k_v_5d": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], _qkv()[1][None], _qkv()[2][None], group=g),
        r"\bk\b",
    ),
    "head_dim_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], _qkv(D=4)[1], _qkv(D=4)[2], group=g),
        r"head dim|\bD\b",
    ),
    "H_not_multiple_of_H_kv": (
        lambda g: dr.ring_flash_attn_func(*_qkv(H=4, H_kv=3), causal=True, group=g),
        r"H_kv|heads",
    ),
    "k_v_shape_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], _qkv()[1], _qkv(H_kv=1)[2], group=g),
        r"\bv\b",
    ),
    "q_k_seq_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], *_qkv(S=2)[1:], group=g),
        r"sequence|S_local|\bS\b",
    ),
    "q_k_batch_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], *_qkv(B=2)[1:], group=g),
        r"batch|\bB\b",
    ),
    "zigzag_odd_S_local": (
        lambda g: dr.zigzag_ring_flash_attn_func(*_qkv(S=3), causal=True, group=g),
        r"S_local|sequence|even",
    ),
    "dtype_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], *_qkv(dtype=torch.float32)[1:], group=g),
        r"dtype",
    ),
    "integer_dtype": (
        lambda g: dr.ring_flash_attn_func(*(x.long() for x in _qkv()), group=g),
        r"dtype|float",
    ),
    "device_mismatch": (
        lambda g: dr.ring_flash_attn_func(_qkv()[0], *(x.to("meta") for x in _qkv()[1:]), group=g),
        r"device",
    ),
    "zigzag_non_causal": (
        lambda g: dr.zigzag_ring_flash_attn_func(*_qkv(), causal=False, group=g),
        r"causal",
    ),
    "stripe_non_causal": (
        lambda g: dr.stripe_flash_attn_qkvpacked_func(_qkv_packed(), group=g),
        r"causal",
    ),
    "empty_sequence": (
        lambda g: dr.ring_flash_attn_func(*(x[:, :0] for x in _qkv()), group=g),
        r"empty|zero|numel",
    ),
    "empty_batch": (
        lambda g: dr.stripe_flash_attn_func(*(x[:0] for x in _qkv()), causal=True, group=g),
        r"empty|zero|numel",
    ),
    "dropout_p": (lambda g: dr.ring_flash_attn_func(*_qkv(), dropout_p=0.1, group=g), r"dropout_p"),
    "alibi_slopes": (
        lambda g: dr.zigzag_ring_flash_attn_func(
            *_qkv(), causal=True, alibi_slopes=torch.ones(4), group=g
        ),
        r"alibi_slopes",
    ),
    "window_size": (
        lambda g: dr.ring_flash_attn_kvpacked_func(
            *_kv_packed(), causal=True, window_size=(-2, 0), group=g
        ),
        r"window_size=\(-2, 0\)",
    ),
    "unknown_backend": (
        lambda g: dr.ring_flash_attn_func(*_qkv(), group=g, backend="no_such_kernel"),
        r"backend",
    ),
    "kv_not_packed_in_2": (
        lambda g: dr.ring_flash_attn_kvpacked_func(
            _qkv()[0], torch.stack(_qkv()[1:] * 2, dim=2)[:, :, :3], group=g
        ),
        r"\bkv\b",
    ),
    "qkv_not_packed_in_3": (
        lambda g: dr.zigzag_ring_flash_attn_qkvpacked_func(
            _qkv_packed()[:, :, :2], causal=True, group=g
        ),
        r"\bqkv\b",
    ),
}


# name -> (call(group), regex): arguments of the wrong type raise TypeError naming them
BAD_TYPES = {
    "causal_string": (
        lambda g: dr.ring_flash_attn_func(*_qkv(), causal="False", group=g),
        "causal",
    ),
    "causal_int": (lambda g: dr.zigzag_ring_flash_attn_func(*_qkv(), causal=1, group=g), "causal"),
    "deterministic_string": (
        lambda g: dr.ring_flash_attn_func(*_qkv(), deterministic="yes", group=g),
        "deterministic",
    ),
    "scale_string": (
        lambda g: dr.ring_flash_attn_func(*_qkv(), softmax_scale="0.5", group=g),
        "softmax_scale",
    ),
    "group_int": (lambda g: dr.ring_flash_attn_func(*_qkv(), group=0), r"\bgroup\b"),
    "group_string": (lambda g: dr.stripe_flash_attn_func(*_qkv(), True, group="cp"), r"group"),
    "ulysses_group_int": (
        lambda g: dr.hybrid_flash_attn_func(*_qkv(), ulysses_group=1, ring_group=g),
        "ulysses_group",
    ),
    "backend_int": (lambda g: dr.ring_flash_attn_func(*_qkv(), group=g, backend=3), "backend"),
}
# name -> (call(group), regex): values that are never valid raise ValueError
BAD_VALUES = {
    "scale_nan": (
        lambda g: dr.ring_flash_attn_func(*_qkv(), softmax_scale=float("nan"), group=g),
        "softmax_scale=nan must be finite",
    ),
    "scale_inf": (
        lambda g: dr.zigzag_ring_flash_attn_func(
            *_qkv(), softmax_scale=float("-inf"), causal=True, group=g
        ),
        "softmax_scale=-inf must be finite",
    ),
    "hybrid_same_group": (
        lambda g: dr.hybrid_flash_attn_func(*_qkv(), ulysses_group=g, ring_group=g, causal=True),
        "same process group",
    ),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "name, expected",
    [(n, "TypeError") for n in BAD_TYPES] + [(n, "ValueError") for n in BAD_VALUES],
)
def test_bad_type_or_value_raises_on_every_rank(dist_pool, name, expected, world_size):
    results = dist_pool.run(try_bad_call, world_size, timeout_s=30, name=name)
    pattern = {**BAD_TYPES, **BAD_VALUES}[name][1]
    for rank, (kind, message) in enumerate(results):
        assert kind == expected, f"rank {rank}: {kind}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message!r} !~ {pattern!r}"


def check_non_member(group: dist.ProcessGroup) -> tuple[str, str]:
    """Worker body: ranks 0 and 1 form a group; ranks 2 and 3 (not members) pass it too.

    Runs on the whole pool: ``new_group`` is a collective of every rank of the default group.
    """
    pair = dist.new_group([0, 1])
    if dist.get_rank() >= 2:
        try:
            dr.ring_flash_attn_func(*_qkv(), group=pair)
        except Exception as e:  # noqa: BLE001 - reported and checked by the test
            return type(e).__name__, str(e)
        return "no exception", ""
    return "member", ""


def test_non_member_rank_raises(dist_pool):
    results = dist_pool.run(check_non_member, 4, timeout_s=30)
    for kind, message in results[2:]:
        assert kind == "ValueError" and "not a member of group" in message, (kind, message)


def try_bad_call(group: dist.ProcessGroup, name: str) -> tuple[str, str]:
    """Worker body: make the bad call; report ``(exception type, message)``."""
    call, _ = {**BAD_CALLS, **BAD_TYPES, **BAD_VALUES}[name]
    try:
        result = call(group)
    except Exception as e:  # noqa: BLE001 - reported to the main process and checked there
        return type(e).__name__, str(e)
    return "no exception", f"returned {type(result).__name__}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_on_every_rank(dist_pool, name, world_size):
    results = dist_pool.run(try_bad_call, world_size, timeout_s=30, name=name)
    pattern = BAD_CALLS[name][1]
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message!r} !~ {pattern!r}"


@pytest.mark.parametrize(
    "layout, seq_len, world_size, pattern",
    [
        ("zigzag", 9, 3, r"divisible|multiple"),
        ("ring", 10, 3, r"divisible|multiple"),
        ("stripe", 7, 2, r"divisible|multiple"),
        ("diagonal", 8, 2, r"layout"),
    ],
)
def test_shard_local_rejects_bad_layout_or_length(layout, seq_len, world_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        dr.shard_local(torch.zeros(1, seq_len, 2, 4), layout, 0, world_size)
