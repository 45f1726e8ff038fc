"""``dtensor_ring.integrations.torchtitan``: torchtitan 0.3's CP functions on dtensor_ring
(Note [torchtitan on the ring]).

Without torchtitan (CI): ``prepare_context_parallel_input`` shards a batch in the layout of
each balancer ("headtail" = zigzag, None = ring, "ptrr" = the mask-aware layout of the batch's
BlockMask) and passes the mask through whole, and torchtitan's FlexAttention forward on the
ring (``[B, L, N, H]``, ``attention_masks=``, ``out_transform`` with the lse) equals the fp64
reference, on the gloo pool at 1-3 ranks; so does its VarlenAttention forward (a stand-in for
its ``VarlenMetadata``: rows of documents, one crossing into the next row, causal, windowed and
bidirectional; the varlen kernels, and flex where ``out_transform`` needs the lse's gradient)
against the rows as one packed stream, on row layouts, a layout of unsorted tokens and "ptrr"'s
``document_layout`` shards; bad metadata raises. With torchtitan installed (the ``torchtitan``
extra), the slow tier trains its Llama 3 debug model with ``examples/torchtitan_cp.py`` and compares
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
    varlen_bounds,
)
from dtensor_ring.layouts import TokenLayout
from dtensor_ring.layouts.documents import DocumentLayout

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
    if layout is None:  # ptrr on one row's document mask: its documents placed whole
        doc = torch.arange(L) * 3 // L
        bounds = [0, *((doc[1:] != doc[:-1]).nonzero()[:, 0] + 1).tolist(), L]
        layout = dr.document_layout(bounds, W)
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
    if balancer == "ptrr":  # two rows: one layout for both, the mask-aware chunks
        rows = torch.arange(2 * L).reshape(2, L)
        two, _, _ = prepare_context_parallel_input(
            rows, rows, {"positions": rows, "attention_masks": bm}, mesh, None, "ptrr"
        )
        chunks = dr.flex_layout(bm, W, next(k for k in (8, 4, 2, 1) if L % (W * k) == 0))
        assert torch.equal(two, rows[:, dr.token_indices(chunks, L, rank, W)])


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


def _stream_mask(rows: list[list[int]], window_size: tuple[int, int]):
    """What torchtitan's varlen kernel computes, as a mask over the rows packed into one stream
    of ``B * L`` tokens: a query sees the keys of its own document within ``window_size``."""
    lengths = torch.tensor([n for row in rows for n in row])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    left, right = window_size

    def varlen_window(b, h, q, kv):
        keep = doc[q] == doc[kv]
        if left >= 0:
            keep = keep & (kv >= q - left)
        if right >= 0:
            keep = keep & (kv <= q + right)
        return keep

    return varlen_window


def _stream_indices(layout, B: int, rank: int, W: int) -> torch.Tensor:
    """The stream positions of a rank's ``[B, L / W]`` tokens (row-major): a layout of each
    row, or a layout of the whole stream."""
    if isinstance(layout, DocumentLayout):
        return dr.token_indices(layout, B * L, rank, W)
    return (torch.arange(B)[:, None] * L + dr.token_indices(layout, L, rank, W)).flatten()


def assert_stream_matches(out, leaves, qkv_BLNH, mask_mod, flat, weighted: bool) -> None:
    """``out`` (``weighted``: ``out * exp(lse)``) of this rank's ``[B, L / W]`` tokens, whose
    stream positions are ``flat``, and its leaves' gradients (of ``out.sum()``) against the
    fp64 reference on the rows packed into one stream ``qkv_BLNH``."""
    B = qkv_BLNH[0].shape[0]
    out.sum().backward()
    ref_leaves = [t.reshape(1, B * L, *t.shape[2:]).clone().requires_grad_() for t in qkv_BLNH]
    ref_out, ref_lse = reference_flex(*(t.transpose(1, 2) for t in ref_leaves), mask_mod=mask_mod)
    ref = (ref_out * ref_lse.exp()[..., None] if weighted else ref_out).transpose(1, 2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref[0, flat].reshape(out.shape).detach(), atol=1e-10, rtol=0)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(
            got.grad, want.grad[0, flat].reshape(got.shape), atol=1e-10, rtol=0
        )


def check_varlen_forward(group: dist.ProcessGroup, layout: str) -> None:
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    metadata = _varlen_metadata(ROWS)
    if layout == "documents":  # "ptrr": the documents placed over the stream
        layout = dr.document_layout(varlen_bounds(metadata), W)
    elif layout == "reversed":  # a layout whose tokens are not in increasing order
        layout = TokenLayout(torch.arange(L).flip(0).reshape(W, L // W))
    flat = _stream_indices(layout, 2, rank, W)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, L, 4, 8, generator=gen, dtype=torch.float64)  # [B, L, N, H]
    k, v = (torch.randn(2, L, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")

    def local(t):
        return t.reshape(2 * L, *t.shape[2:])[flat].reshape(2, L // W, *t.shape[2:])

    for window_size in [(-1, 0), (5, 0), (-1, -1), (3, 2)]:
        forward = _VarlenForward(group, layout, window_size)
        mask = _stream_mask(ROWS, window_size)
        for weighted in (False, True):  # the varlen kernels; flex (the lse's gradient)
            leaves = [local(t).clone().requires_grad_() for t in (q, k, v)]
            out = forward(
                *leaves,
                attention_masks=metadata,
                enable_gqa=True,
                out_transform=(lambda o, lse: o * lse.exp()[..., None]) if weighted else None,
            )
            assert_stream_matches(out, leaves, (q, k, v), mask, flat, weighted)
        if not isinstance(layout, DocumentLayout):  # the batch's placement, built once
            assert forward._placed(metadata, 2, L // W) is forward._placed(metadata, 2, L // W)

    # boundaries refilled in place (the same tensors, another batch; a document now crossing
    # from row 0 into row 1, as in one packed stream): the placement follows
    rows = [[10, 10, 40, 12, 16, 4, 4]]  # 96 tokens: the third document ends in row 1
    forward = _VarlenForward(group, layout, (-1, 0))
    forward(*map(local, (q, k, v)), attention_masks=metadata, enable_gqa=True)
    for t in metadata[:2]:
        t.copy_(_varlen_metadata(rows).cu_seq_q)
    if isinstance(layout, DocumentLayout):  # sharded for the old documents
        with pytest.raises(ValueError, match="sharded for other documents"):
            forward(*map(local, (q, k, v)), attention_masks=metadata, enable_gqa=True)
        return
    leaves = [local(t).clone().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves, attention_masks=metadata, enable_gqa=True)
    assert_stream_matches(out, leaves, (q, k, v), _stream_mask(rows, (-1, 0)), flat, False)


def check_varlen_forward_gather(group: dist.ProcessGroup) -> str:
    """``algorithm="all_gather"`` (``apply_cp_to_forward``'s extension) on "ptrr"'s placed
    documents: each rank fetches only the keys its queries see, exact; with ``out_transform``
    (flex with the lse's gradient) it raises ``ValueError``."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    metadata = _varlen_metadata(ROWS)
    layout = dr.document_layout(varlen_bounds(metadata), W)
    flat = _stream_indices(layout, 2, rank, W)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, L, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, L, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")

    def local(t):
        return t.reshape(2 * L, *t.shape[2:])[flat].reshape(2, L // W, *t.shape[2:])

    for window_size in [(-1, 0), (5, 0), (-1, -1)]:
        forward = _VarlenForward(group, layout, window_size, algorithm="all_gather")
        leaves = [local(t).clone().requires_grad_() for t in (q, k, v)]
        out = forward(*leaves, attention_masks=metadata, enable_gqa=True)
        assert_stream_matches(out, leaves, (q, k, v), _stream_mask(ROWS, window_size), flat, False)
    with pytest.raises(ValueError, match="all_gather") as info:
        forward(
            *map(local, (q, k, v)), attention_masks=metadata, enable_gqa=True,
            out_transform=lambda o, lse: o * lse.exp()[..., None],
        )  # fmt: skip
    return str(info.value)


def test_varlen_forward_by_the_gather(dist_pool):
    dist_pool.run(check_varlen_forward_gather, 3)


@pytest.mark.parametrize(
    "world_size, layout",
    [
        *((w, layout) for w in (1, 2) for layout in ("documents", "reversed")),
        *(pytest.param(w, layout, marks=pytest.mark.slow) for w, layout in (
            (1, "zigzag"), (1, "ring"), (2, "zigzag"), (2, "ring"),
            (3, "zigzag"), (3, "ring"), (3, "documents"), (3, "reversed"),
        )),
    ],
)  # fmt: skip
def test_varlen_forward(dist_pool, world_size, layout):
    dist_pool.run(check_varlen_forward, world_size, layout=layout)


def check_prepare_documents(group: dist.ProcessGroup) -> None:
    """ "ptrr" with a VarlenMetadata: document_layout over the stream, [B, L / W] shards."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    metadata = _varlen_metadata(ROWS)
    tokens = torch.arange(2 * L).reshape(2, L) * 10
    positions = torch.cat([torch.arange(n) for row in ROWS for n in row]).reshape(2, L)
    extra = {"positions": positions, "attention_masks": {"varlen": metadata}}
    sharded = _SHARDED[0]
    try:
        inputs, labels, out_extra = prepare_context_parallel_input(
            tokens, tokens + 1, extra, mesh, torch.device("cpu"), "ptrr", "varlen"
        )
        layout = _SHARDED[0]
    finally:
        _SHARDED[0] = sharded
    assert layout == dr.document_layout(varlen_bounds(metadata), W)
    flat = _stream_indices(layout, 2, rank, W)
    assert inputs.shape == (2, L // W) and torch.equal(inputs.flatten(), tokens.flatten()[flat])
    assert torch.equal(labels, inputs + 1)
    assert torch.equal(out_extra["positions"].flatten(), positions.flatten()[flat])
    assert out_extra["attention_masks"]["varlen"] is metadata
    if W > 1:  # rows of a length the ranks cannot split evenly
        n = 16 * W + 1
        rows = torch.zeros(2, n, dtype=torch.int64)
        extra = {"positions": rows, "attention_masks": _varlen_metadata([[n, n]])}
        with pytest.raises(ValueError, match="divisible"):
            prepare_context_parallel_input(rows, rows, extra, mesh, torch.device("cpu"), "ptrr")


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_prepare_documents(dist_pool, world_size):
    dist_pool.run(check_prepare_documents, world_size)


def _metadata(cu_q: list[int], cu_k: list[int], dtype=torch.int32) -> VarlenMetadata:
    return VarlenMetadata(torch.tensor(cu_q, dtype=dtype), torch.tensor(cu_k, dtype=dtype), 0, 0)


def check_varlen_refused(group: dist.ProcessGroup) -> None:
    q = torch.zeros(2, L, 4, 8, dtype=torch.float64)
    k = torch.zeros(2, L, 2, 8, dtype=torch.float64)
    forward = _VarlenForward(group, "ring", (-1, 0))
    cases = [
        (None, TypeError, "VarlenMetadata"),
        (_metadata([0, 48], [0, 48]), ValueError, "B \\* L"),
        (_metadata([0, 48, 96], [0, 40, 96]), ValueError, "equal"),
        (_metadata([0, 60, 48, 96], [0, 60, 48, 96]), ValueError, "strictly increasing"),
        (_metadata([0, 96], [0, 96], torch.int64), ValueError, "int32"),
    ]  # fmt: skip
    for metadata, error, message in cases:
        with pytest.raises(error, match=message):
            forward(q, k, k, attention_masks=metadata, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        forward(q, k, k, attention_masks=_varlen_metadata(ROWS))
    with pytest.raises(TypeError, match="unexpected"):
        forward(q, k, k, attention_masks=_varlen_metadata(ROWS), enable_gqa=True, dropout=0.1)


def test_varlen_refused(dist_pool):
    dist_pool.run(check_varlen_refused, 1)


def check_varlen_refused_on_rank0(group: dist.ProcessGroup, bad: str) -> str:
    """Rank 0 alone passes ``bad`` (int64 boundaries / an unknown keyword), the others a
    valid call: every rank raises (rank 0 its own error, the others one naming it)."""
    W = dist.get_world_size(group)
    q = torch.zeros(2, L // W, 4, 8, dtype=torch.float64)
    k = torch.zeros(2, L // W, 2, 8, dtype=torch.float64)
    kw = {"attention_masks": _metadata([0, 2 * L], [0, 2 * L]), "enable_gqa": True}
    if dist.get_rank(group) == 0:
        if bad == "int64":
            kw["attention_masks"] = _metadata([0, 2 * L], [0, 2 * L], torch.int64)
        else:
            kw["dropout"] = 0.1
    with pytest.raises((ValueError, TypeError)) as info:
        _VarlenForward(group, "ring", (-1, 0))(q, k, k, **kw)
    return str(info.value)


@pytest.mark.parametrize("bad", ["int64", "keyword"])
def test_varlen_refused_on_rank0(dist_pool, bad):
    messages = dist_pool.run(check_varlen_refused_on_rank0, 3, bad=bad)
    assert ("int32" if bad == "int64" else "unexpected") in messages[0], messages[0]
    for message in messages[1:]:
        assert "rank 0 of the group raised an error in its own checks" in message, message


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("--world-size", "2"),
        ("--attention", "sdpa", "--world-size", "3"),
        ("--balancer", "ptrr", "--world-size", "3"),
        ("--attention", "varlen", "--world-size", "3"),
        ("--attention", "varlen", "--balancer", "ptrr", "--world-size", "2"),
        ("--balancer", "ptrr", "--algorithm", "all_gather", "--world-size", "3"),
    ],  # fmt: skip
    ids=[
        "flex-headtail-W2",
        "sdpa-W3",
        "flex-ptrr-W3",
        "varlen-W3",
        "varlen-ptrr-W2",
        "flex-ptrr-gather-W3",
    ],  # fmt: skip
)
def test_torchtitan_example(args):
    pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cmd = [sys.executable, os.path.join(REPO_ROOT, "examples", "torchtitan_cp.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest relative gradient difference" in proc.stdout, proc.stdout
