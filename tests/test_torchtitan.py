"""``dtensor_ring.integrations.torchtitan``: torchtitan 0.3's CP functions on dtensor_ring
(Note [torchtitan on the ring]).

Without torchtitan (CI): ``prepare_context_parallel_input`` shards a batch in the layout of
each balancer ("headtail" = zigzag, None = ring, "ptrr" = the mask-aware layout of the batch's
BlockMask) and passes the mask through whole, and torchtitan's FlexAttention forward on the
ring (``[B, L, N, H]``, ``attention_masks=``, ``out_transform`` with the lse) equals the fp64
reference, on the gloo pool at 1-3 ranks; so does its VarlenAttention forward (a stand-in for
its ``VarlenMetadata``: rows of different documents, causal, windowed and bidirectional), and
metadata no per-row mask expresses raises. With torchtitan installed (the ``torchtitan`` extra),
the slow tier trains its Llama 3 debug model with ``examples/torchtitan_cp.py`` and compares
losses and gradients with the model without CP.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from reference import reference_flex
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import create_block_mask

import dtensor_ring as dr
from dtensor_ring.api.parallel_style import _SHARDED
from dtensor_ring.integrations.torchtitan import (
    _FlexForward,
    _VarlenForward,
    prepare_context_parallel_input,
    varlen_block_mask,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = 48


def _document_mask(L: int):
    doc = torch.arange(L) * 3 // L

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return document


def check_prepare_and_flex(group: dist.ProcessGroup, balancer: str | None) -> None:
    """The check below, leaving the process-wide CP state (``cp_options``, the recorded
    layout) as it found it: later tests on the pool's other ranks must see the same."""
    load_balance, sharded = dr.cp_options.enable_load_balance, _SHARDED[0]
    try:
        _check_prepare_and_flex(group, balancer)
    finally:
        dr.cp_options.enable_load_balance, _SHARDED[0] = load_balance, sharded


def _check_prepare_and_flex(group: dist.ProcessGroup, balancer: str | None) -> None:
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    mask_mod = _document_mask(L)
    bm = create_block_mask(mask_mod, None, None, L, L, "cpu", 4)
    tokens = torch.arange(L)[None] * 10
    extra = {"positions": torch.arange(L)[None], "attention_masks": bm}
    inputs, labels, out_extra = prepare_context_parallel_input(
        tokens, tokens + 1, extra, mesh, torch.device("cpu"), balancer
    )
    layout = {"headtail": "zigzag", None: "ring"}.get(balancer)
    if layout is None:  # ptrr: the mask-aware layout, the most chunks a rank the length allows
        layout = dr.flex_layout(bm, W, next(k for k in (8, 4, 2, 1) if L % (W * k) == 0))
    idx = dr.token_indices(layout, L, rank, W)
    assert torch.equal(inputs[0], tokens[0, idx]) and torch.equal(labels[0], tokens[0, idx] + 1)
    assert torch.equal(out_extra["positions"][0], idx)
    assert out_extra["attention_masks"] is bm  # whole: the modules take the global mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, L, 4, 8, generator=gen, dtype=torch.float64)  # [B, L, N, H]
    k, v = (torch.randn(2, L, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    leaves = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    forward = _FlexForward(group, None)  # the layout prepare_context_parallel_input used
    out = forward(
        *leaves,
        attention_masks=bm,
        enable_gqa=True,
        out_transform=lambda o, lse: o * lse.exp()[..., None],
    )
    assert_lse_weighted_matches(out, leaves, (q, k, v), mask_mod, idx)


def assert_lse_weighted_matches(out, leaves, qkv_BLNH, mask_mod, idx) -> None:
    """``out`` (``out * exp(lse)`` of this rank's tokens ``idx``, ``[B, L_local, N, H]``)
    and its leaves' gradients (of ``out.sum()``) against the fp64 reference on the whole
    sequence ``qkv_BLNH``."""
    out.sum().backward()
    ref_leaves = [t.transpose(1, 2).clone().requires_grad_() for t in qkv_BLNH]
    ref_out, ref_lse = reference_flex(*ref_leaves, mask_mod=mask_mod)
    ref = (ref_out * ref_lse.exp()[..., None]).transpose(1, 2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref[:, idx].detach(), atol=1e-10, rtol=1e-10)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(
            got.grad, want.grad.transpose(1, 2)[:, idx], atol=1e-10, rtol=1e-10
        )


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("balancer", ["headtail", "ptrr", None])
def test_prepare_and_flex_forward(dist_pool, world_size, balancer):
    dist_pool.run(check_prepare_and_flex, world_size, balancer=balancer)


class VarlenMetadata(NamedTuple):
    """torchtitan's ``VarlenMetadata`` (the fields its VarlenAttention reads)."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


def _varlen_metadata(rows: list[list[int]]) -> VarlenMetadata:
    """The packed boundaries of ``rows`` (document lengths per row), as torchtitan's
    ``create_varlen_metadata_for_document`` builds them."""
    lengths = [n for row in rows for n in row]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return VarlenMetadata(cu, cu.clone(), max(lengths), max(lengths))


ROWS = [[20, 17, 11], [5, 30, 0, 13]]  # rows of L = 48 tokens (documents cross the shards; an
# empty one, which varlen attention allows)


def _window_mask(rows: list[list[int]], window_size: tuple[int, int]):
    doc = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )
    left, right = window_size

    def varlen_window(b, h, q, kv):
        keep = doc[b, q] == doc[b, kv]
        if left >= 0:
            keep = keep & (kv >= q - left)
        if right >= 0:
            keep = keep & (kv <= q + right)
        return keep

    return varlen_window


def check_varlen_forward(group: dist.ProcessGroup, layout: str) -> None:
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    idx = dr.token_indices(layout, L, rank, W)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, L, 4, 8, generator=gen, dtype=torch.float64)  # [B, L, N, H]
    k, v = (torch.randn(2, L, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    metadata = _varlen_metadata(ROWS)
    for window_size in [(-1, 0), (5, 0), (-1, -1), (3, 2)]:
        leaves = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
        forward = _VarlenForward(group, layout, window_size)
        out = forward(
            *leaves,
            attention_masks=metadata,
            enable_gqa=True,
            out_transform=lambda o, lse: o * lse.exp()[..., None],
        )
        assert forward(*leaves, attention_masks=metadata, enable_gqa=True) is not None
        built = forward._last[1]
        assert forward(*leaves, attention_masks=metadata, enable_gqa=True) is not None
        assert forward._last[1] is built  # the batch's mask, built once
        assert_lse_weighted_matches(out, leaves, (q, k, v), _window_mask(ROWS, window_size), idx)

    # boundaries refilled in place (the same tensors, another batch): the mask follows
    rows = [[10, 10, 28], [16, 16, 16, 0]]
    forward = _VarlenForward(group, layout, (-1, 0))
    local = [t[:, idx] for t in (q, k, v)]
    forward(*local, attention_masks=metadata, enable_gqa=True)
    for t in metadata[:2]:
        t.copy_(_varlen_metadata(rows).cu_seq_q)
    out = forward(*local, attention_masks=metadata, enable_gqa=True)
    ref_out, _ = reference_flex(
        *(t.transpose(1, 2) for t in (q, k, v)), mask_mod=_window_mask(rows, (-1, 0))
    )
    torch.testing.assert_close(out, ref_out.transpose(1, 2)[:, idx], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["zigzag", "ring"])
def test_varlen_forward(dist_pool, world_size, layout):
    dist_pool.run(check_varlen_forward, world_size, layout=layout)


@pytest.mark.parametrize(
    "metadata, message",
    [
        (None, "VarlenMetadata"),
        (VarlenMetadata(torch.tensor([0, 48]), torch.tensor([0, 48]), 48, 48), "B \\* L"),
        (_varlen_metadata([[30, 30, 36]]), "crosses into row 1"),
        (VarlenMetadata(torch.tensor([0, 48, 96]), torch.tensor([0, 40, 96]), 56, 56), "equal"),
        (
            VarlenMetadata(torch.tensor([0, 60, 48, 96]), torch.tensor([0, 60, 48, 96]), 60, 60),
            "not fall",
        ),
    ],  # fmt: skip
    ids=["not-metadata", "short", "crosses-rows", "q-k-differ", "falling"],
)
def test_varlen_metadata_refused(metadata, message):
    with pytest.raises((ValueError, TypeError), match=message):
        varlen_block_mask(metadata, 2, L, (-1, 0), torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("--world-size", "2"),
        ("--attention", "sdpa", "--world-size", "3"),
        ("--balancer", "ptrr", "--world-size", "3"),
        ("--attention", "varlen", "--world-size", "3"),
    ],  # fmt: skip
    ids=["flex-headtail-W2", "sdpa-W3", "flex-ptrr-W3", "varlen-W3"],
)
def test_torchtitan_example(args):
    pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cmd = [sys.executable, os.path.join(REPO_ROOT, "examples", "torchtitan_cp.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest relative gradient difference" in proc.stdout, proc.stdout
