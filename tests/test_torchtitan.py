"""``dtensor_ring.integrations.torchtitan``: torchtitan 0.3's CP functions on dtensor_ring
(Note [torchtitan on the ring]).

Without torchtitan (CI): ``prepare_context_parallel_input`` shards a batch in the layout of
each balancer ("headtail" = zigzag, None = ring, "ptrr" = the mask-aware layout of the batch's
BlockMask) and passes the mask through whole, and torchtitan's FlexAttention forward on the
ring (``[B, L, N, H]``, ``attention_masks=``, ``out_transform`` with the lse) equals the fp64
reference, on the gloo pool at 1-3 ranks. With torchtitan installed (the ``torchtitan`` extra),
the slow tier trains its Llama 3 debug model with ``examples/torchtitan_cp.py`` and compares
losses and gradients with the model without CP.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from reference import reference_flex
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import create_block_mask

import dtensor_ring as dr
from dtensor_ring.api.parallel_style import _SHARDED
from dtensor_ring.integrations.torchtitan import _FlexForward, prepare_context_parallel_input

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
    out.sum().backward()
    ref_leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("--world-size", "2"),
        ("--attention", "sdpa", "--world-size", "3"),
        ("--balancer", "ptrr", "--world-size", "4"),
    ],  # fmt: skip
    ids=["flex-headtail-W2", "sdpa-W3", "flex-ptrr-W4"],
)
def test_torchtitan_example(args):
    pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cmd = [sys.executable, os.path.join(REPO_ROOT, "examples", "torchtitan_cp.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest relative gradient difference" in proc.stdout, proc.stdout
