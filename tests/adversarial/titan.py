"""Cases of the ``titan`` kind: torchtitan's ``VarlenAttention`` forward on the ring
(``dtensor_ring.integrations.torchtitan``, Note [torchtitan on the ring]).

Two rows of 8W tokens, ``[B, L, N, H]`` as torchtitan's modules see them, three documents
packed over the rows (the second runs on from row 0 into row 1, as torchtitan's metadata does
when a row starts mid-document; what its kernel computes is the rows as one packed stream),
``VarlenMetadata`` of the whole batch. Each rank holds its ``[B, L / W]`` tokens as a row
layout shards them (head-tail, contiguous) or as ``prepare_context_parallel_input(...,
"ptrr")`` shards them (``document_layout`` over the stream). Correct: those layouts, windows,
bidirectional, ``scale``, an ``out_transform`` of the lse (its gradient flows: the flex door).
Errors on every rank: int64 boundaries, ``cu_seq_k`` unlike ``cu_seq_q``, boundaries short of
``B * L``, another batch's documents than the shards were placed for, GQA without
``enable_gqa``, a value head dim of its own, an unknown keyword, and one rank given other
boundaries than the rest (W > 1). And torchtitan's FlexAttention forward under a per-row
document mask on the shards ``prepare_context_parallel_input`` makes (head-tail, contiguous,
"ptrr" on one row: the documents placed whole), with and without an ``out_transform``.
Each error variant also passed by rank 0 alone (``rank0:``): an error on every rank.
Forward and backward against the strict fp64 reference (:mod:`tests.adversarial.oracle`).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from . import oracle
from .cases import CORRECT, ERROR, WORLDS, raises_here
from .doors import Ctx
from .oracle import Check
from .runner import Case

N, N_KV, D, B = 4, 2, 8, 2


class VarlenMetadata(NamedTuple):
    """torchtitan's ``VarlenMetadata`` (the fields its VarlenAttention reads)."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


def _metadata(lengths, dtype=torch.int32) -> VarlenMetadata:
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)
    return VarlenMetadata(cu, cu.clone(), max(lengths), max(lengths))


#: variant -> (how the shards were made, window_size, what the call changes)
VARIANTS = {
    "head_tail": ("zigzag", (-1, 0), None),
    "contiguous": ("ring", (-1, 0), None),
    "documents": ("documents", (-1, 0), None),
    "documents_window": ("documents", (3, 0), None),
    "head_tail_bidirectional": ("zigzag", (-1, -1), None),
    "out_transform_lse": ("documents", (-1, 0), "out_transform"),
    "scale=0.3": ("zigzag", (-1, 0), "scale"),
    "out_transform_scale=0.3": ("ring", (2, 1), "out_transform_scale"),
    "value_head_dim_differs": ("zigzag", (-1, 0), "mla"),
    "cu_int64": ("zigzag", (-1, 0), "int64"),
    "cu_k_differs": ("zigzag", (-1, 0), "cu_k"),
    "cu_short": ("zigzag", (-1, 0), "short"),
    "other_batch": ("documents", (-1, 0), "other_batch"),
    "gqa_without_enable_gqa": ("zigzag", (-1, 0), "no_gqa"),
    "unknown_keyword": ("zigzag", (-1, 0), "keyword"),
    "rank_disagrees": ("zigzag", (-1, 0), "disagree"),
}
ERRORS = ("int64", "cu_k", "short", "other_batch", "no_gqa", "keyword", "mla")


def titan_case(ctx: Ctx, variant: str, rank0: bool = False) -> dict:
    """torchtitan's VarlenAttention forward on this rank's tokens of :data:`VARIANTS`
    ``[variant]``, and the backward of ``(out * dout).sum()``; ``rank0``: the variant's
    change on rank 0 alone (the others' call unchanged)."""
    import dtensor_ring as dr
    from dtensor_ring.integrations.torchtitan import _VarlenForward, varlen_bounds

    W, rank = ctx.world, ctx.rank
    L = 8 * W
    lengths = (5 * W, 8 * W, 3 * W)  # the second document crosses from row 0 into row 1
    metadata = _metadata(lengths)
    held, window, change = VARIANTS[variant]
    if rank0 and rank != 0:
        change = None
    if held == "documents":
        layout = dr.document_layout(varlen_bounds(metadata), W)
        flat = dr.token_indices(layout, B * L, rank, W)
    else:
        layout = held
        flat = (torch.arange(B)[:, None] * L + dr.token_indices(held, L, rank, W)).flatten()
    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(B * L, N, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B * L, N_KV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [t[flat].reshape(B, L // W, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v)]
    kw: dict = {"attention_masks": metadata, "enable_gqa": True}
    if change == "int64":
        kw["attention_masks"] = _metadata(lengths, torch.int64)
    elif change == "cu_k":
        kw["attention_masks"] = metadata._replace(cu_seq_k=_metadata((8 * W, 5 * W, 3 * W))[0])
    elif change == "short":
        kw["attention_masks"] = _metadata((5 * W, 8 * W))
    elif change == "other_batch":
        kw["attention_masks"] = _metadata((8 * W, 5 * W, 3 * W))
    elif change == "no_gqa":
        kw["enable_gqa"] = False
    elif change == "keyword":
        kw["dropout_p"] = 0.0
    elif change == "disagree" and W > 1 and rank == W - 1:
        kw["attention_masks"] = _metadata((8 * W, 5 * W, 3 * W))
    elif change == "mla":  # a value head dim of its own (MLA): no kernel here takes it
        leaves[2] = leaves[2][..., : D // 2].detach().requires_grad_()
    if change in ("out_transform", "out_transform_scale"):
        kw["out_transform"] = lambda o, lse: o * lse.exp()[..., None]
    scale = 0.3 if change in ("scale", "out_transform_scale") else D**-0.5
    if scale != D**-0.5:
        kw["scale"] = scale
    out = _VarlenForward(ctx.group, layout, window)(*leaves, **kw)
    out_T = out.reshape(B * L // W, N, D)
    (out_T * dout[flat]).sum().backward()
    visible = oracle.visible_varlen([0, *itertools.accumulate(lengths)], False, window)
    weighted = "out_transform" in kw
    return _stream_checks(out_T, leaves, (q, k, v, dout), visible, scale, flat, weighted)


def titan_one_rank_case(ctx: Ctx, variant: str) -> dict:
    """:func:`titan_case` malformed on rank 0 alone: every rank raises (:func:`raises_here`)."""
    return raises_here(lambda: titan_case(ctx, variant, rank0=True))


def _stream_checks(out_T, leaves, qkv_dout, visible, scale, flat, weighted: bool) -> dict:
    """This rank's ``out_T`` (its tokens ``flat`` of the stream) and its leaves' gradients
    against the strict fp64 reference of the whole stream under ``visible`` (``weighted``:
    of ``out * exp(lse)``, its lse differentiated)."""
    q, k, v, dout = qkv_dout
    if weighted:
        ref_out, ref_grads = _lse_weighted_reference(q, k, v, visible, scale, dout)
    else:
        ref = oracle.strict_attention(q[None], k[None], v[None], visible, scale, dout[None])
        ref_out, ref_grads = ref.out[0], (ref.dq[0], ref.dk[0], ref.dv[0])
    tol = oracle.tolerance(torch.float64)
    checks = {"out": Check(out_T.detach(), ref_out[flat], torch.float64, *tol)}
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, ref_grads, strict=True):
        checks[name] = Check(
            leaf.grad.reshape(-1, *want.shape[1:]), want[flat], torch.float64, *tol
        )
    return checks


#: FlexAttention modules: name -> (balancer, rows, window within documents, out_transform)
FLEX_VARIANTS = {
    "flex_head_tail": ("headtail", 2, None, False),
    "flex_contiguous_window": (None, 2, 3, False),
    "flex_ptrr_one_row": ("ptrr", 1, None, False),
    "flex_ptrr_one_row_window_out_transform": ("ptrr", 1, 2, True),
    "flex_head_tail_out_transform": ("headtail", 2, None, True),
}


def titan_flex_case(ctx: Ctx, variant: str) -> dict:
    """torchtitan's FlexAttention forward on this rank's tokens, sharded by
    ``prepare_context_parallel_input`` with the balancer of :data:`FLEX_VARIANTS`
    ``[variant]``, under a per-row document mask (a document mask without ``out_transform``
    runs on the varlen kernels; "ptrr" on one row places the documents whole)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention.flex_attention import create_block_mask

    from dtensor_ring.integrations.torchtitan import _FlexForward, prepare_context_parallel_input

    W = ctx.world
    balancer, rows, window, weighted = FLEX_VARIANTS[variant]
    L = 8 * W
    ids = torch.zeros(rows, L, dtype=torch.int64)
    for b, cuts in enumerate(([3 * W, 4 * W + 1], [W, 5 * W])[:rows]):
        for c in cuts:
            ids[b, c:] += 1

    def document(b, h, q_idx, kv_idx):
        seen = (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
        return seen if window is None else seen & (q_idx - kv_idx <= window)

    bm = create_block_mask(document, rows, None, L, L, "cpu", 4)
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    tokens = torch.arange(rows * L).reshape(rows, L)
    _, _, extra = prepare_context_parallel_input(
        tokens, tokens, {"positions": tokens, "attention_masks": bm}, mesh, None, balancer
    )
    flat = extra["positions"].flatten()  # this rank's tokens of the rows' stream
    gen = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(rows * L, N, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(rows * L, N_KV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [
        t[flat].reshape(rows, L // W, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v)
    ]
    kw: dict = {"attention_masks": bm, "enable_gqa": True}
    if weighted:
        kw["out_transform"] = lambda o, lse: o * lse.exp()[..., None]
    out = _FlexForward(ctx.group, None)(*leaves, **kw)
    out_T = out.reshape(rows * L // W, N, D)
    (out_T * dout[flat]).sum().backward()
    i = torch.arange(L)
    visible = torch.block_diag(*(document(b, 0, i[:, None], i[None, :]) for b in range(rows)))
    return _stream_checks(out_T, leaves, (q, k, v, dout), visible, D**-0.5, flat, weighted)


def _lse_weighted_reference(q, k, v, visible, scale, dout):
    """``out * exp(lse)`` over the whole stream (``[T, N, D]``) in fp64 and the gradients of
    ``(that * dout).sum()`` by autograd through the softmax and the lse."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    q_, k_, v_ = (t.transpose(0, 1) for t in leaves)  # [N, T, D]
    k_, v_ = (t.repeat_interleave(N // N_KV, dim=0) for t in (k_, v_))
    s = (q_ @ k_.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = s.logsumexp(-1)
    out = (s - lse[..., None]).exp() @ v_ * lse.exp()[..., None]
    out_T = out.transpose(0, 1)
    (out_T * dout).sum().backward()
    return out_T.detach(), tuple(t.grad for t in leaves)


def titan_cases() -> list[Case]:
    """Every variant at every world size: exact, or a clean error on every rank (a rank given
    other boundaries: only where there is another rank)."""
    cases = []
    for variant, (_, _, change) in VARIANTS.items():
        for world in WORLDS:
            wrong = change in ERRORS or (change == "disagree" and world > 1)
            name = f"titan/VarlenAttention/W{world}/{variant}"
            expect = ERROR if wrong else CORRECT
            cases.append(Case(name, "titan", world, titan_case, {"variant": variant}, expect))
        if change in ERRORS:  # rank 0 alone passes it
            world = 2 + len(cases) % 2
            name = f"titan/VarlenAttention/W{world}/rank0:{variant}"
            params = {"variant": variant}
            cases.append(Case(name, "titan", world, titan_one_rank_case, params, CORRECT))
    for variant in FLEX_VARIANTS:
        for world in WORLDS:
            name = f"titan/FlexAttention/W{world}/{variant}"
            params = {"variant": variant}
            cases.append(Case(name, "titan", world, titan_flex_case, params, CORRECT))
    return cases
