"""``dtensor_ring.flex_attention``: FlexAttention masks and score mods on the ring.

Numerics on the session's gloo pool (world sizes 1-4): every rank builds the same seeded
global q, k, v in float64, the global ``BlockMask`` (4-token tiles, so blocks are skipped at
these sizes), calls the library on its shard and compares out, lse and the gradients of its
shard with ``reference.reference_flex`` on the full sequence (masks and score mods evaluated
by broadcasting, the library's by ``torch.vmap``). The reference itself is checked against
``torch``'s own ``flex_attention`` forward (CPU, eager).
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
import torch.distributed as dist
from reference import layout_indices, reference_attention, reference_flex
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention.flex_attention import (
    AuxRequest,
    create_block_mask,
    flex_attention,
)

import dtensor_ring as dr
from dtensor_ring.layouts import get_layout
from dtensor_ring.schedule.flex import VisibleBlocks, balanced_layout, flex_balance, flex_plan

TILE = 4
S_LOCAL = 12


def _doc_ids(seq_len: int) -> torch.Tensor:
    """Documents of lengths 5, 11, 3, 9, ... (crossing every shard boundary), by position."""
    lengths, total, i = [], 0, 0
    while total < seq_len:
        n = min((5, 11, 3, 9)[i % 4], seq_len - total)
        lengths.append(n)
        total, i = total + n, i + 1
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def causal(b, h, q, kv):
    return q >= kv


def make_mask(name: str, seq_len: int):
    """The mask_mod of ``name`` over ``seq_len`` global tokens (None: no mask)."""
    doc = _doc_ids(seq_len)
    if name == "none":
        return None
    if name == "causal":
        return causal
    if name == "document":
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    if name == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= 6)
    if name == "document_window":
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv) & (q - kv <= 4)
    if name == "prefix_lm":
        return lambda b, h, q, kv: (kv < 7) | (q >= kv)
    if name == "empty_rows":  # rows 3 and 20 see nothing; the last head sees only itself
        return lambda b, h, q, kv: (q >= kv) & (q != 3) & (q != 20) & ((h < 3) | (q == kv))
    raise AssertionError(name)


def document_mask_of(name: str, seq_len: int, batch: int):
    """``dr.document_mask`` of ``_doc_ids``' documents in ``batch`` rows: the BlockMask of
    "document" / "document_window" built from boundaries alone."""
    doc = _doc_ids(seq_len)
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.long), (doc[1:] != doc[:-1]).nonzero()[:, 0] + 1]
    )
    bounds = torch.cat(
        [starts + b * seq_len for b in range(batch)] + [torch.tensor([batch * seq_len])]
    )
    window = (4, 0) if name == "document_window" else (-1, 0)
    return dr.document_mask(torch.tensor(bounds), seq_len, window, block_size=TILE)


def make_score(name: str):
    if name == "none":
        return None
    if name == "softcap":
        return lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0)
    if name == "alibi":
        return lambda s, b, h, q, kv: s - (h + 1) * 0.25 * (q - kv).abs() + 0.1 * b
    raise AssertionError(name)


CASES = [
    # (mask, score, layout, H_kv)
    ("causal", "none", "zigzag", 4),
    ("causal", "none", "stripe", 4),
    ("document", "none", "ring", 4),
    ("document", "none", "zigzag", 2),
    ("window", "none", "ring", 4),
    ("document_window", "none", "zigzag", 4),
    ("prefix_lm", "none", "ring", 1),
    ("causal", "softcap", "ring", 4),
    ("none", "alibi", "ring", 2),
    ("document", "softcap", "stripe", 2),
    ("empty_rows", "alibi", "zigzag", 4),
    ("document", "none", "balanced", 2),
    ("document_mask", "none", "balanced", 2),  # dr.document_mask: the tiles from boundaries
    ("document_window_mask", "softcap", "zigzag", 4),
    ("prefix_lm", "softcap", "balanced", 4),
]


def check_flex(group, mask, score, layout, H_kv, dtype=torch.float64, bare=False) -> dict:
    """Forward and backward of one case against the fp64 reference; returns the plan stats."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, D, S = 2, 4, 8, S_LOCAL * W
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv))
    dout = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    from_boundaries = mask.endswith("_mask")
    mask = mask.removesuffix("_mask")
    mask_mod, score_mod = make_mask(mask, S), make_score(score)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    dlse = torch.randn(B, H, S, generator=gen, dtype=torch.float64)  # flex's lse has a gradient
    ref_out, ref_lse = reference_flex(*ref_in, mask_mod=mask_mod, score_mod=score_mod)
    visible_rows = ref_lse > float("-inf")
    ((ref_out * dout).sum() + (ref_lse.where(visible_rows, 0) * dlse).sum()).backward()
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S, S, "cpu", TILE)
    if from_boundaries:
        bm = document_mask_of(mask, S, B)
    if layout == "balanced":  # the mask-aware layout, built from the mask on every rank
        layout = dr.flex_layout(bm, W, chunks_per_rank=2)
        idx = layout.token_indices(S, rank, W)
    else:
        idx = layout_indices(layout, rank, W, S)
    local = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
    kwargs = {}
    if bare:
        kwargs["mask_mod"] = mask_mod
    elif mask_mod is not None:
        kwargs["block_mask"] = bm
    out, lse = dr.flex_attention(
        *local, score_mod=score_mod, enable_gqa=H != H_kv, return_lse=True, group=group,
        layout=layout, kernel_options={}, **kwargs,
    )  # fmt: skip
    lse_term = (lse.where(visible_rows[:, :, idx], 0) * dlse[:, :, idx].to(lse.dtype)).sum()
    ((out * dout[:, :, idx].to(dtype)).sum() + lse_term).backward()
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(out.double(), ref_out[:, :, idx], **tol)
    torch.testing.assert_close(lse.double(), ref_lse[:, :, idx], **tol)
    for name, got, ref in zip("qkv", local, ref_in, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad[:, :, idx], **tol, msg=name)
    return {}


SLOW = pytest.mark.slow
FLEX_WORLDS = [1, 2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)]  # 3, 4: slow tier


@pytest.mark.parametrize("world_size", FLEX_WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_flex_fp64(dist_pool, world_size, case):
    mask, score, layout, H_kv = case
    dist_pool.run(check_flex, world_size, mask=mask, score=score, layout=layout, H_kv=H_kv)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=SLOW)])
def test_flex_bare_mask_mod_fp32(dist_pool, world_size):
    dist_pool.run(
        check_flex, world_size, mask="document", score="softcap", layout="zigzag", H_kv=2,
        dtype=torch.float32, bare=True,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_reference_matches_torch_flex_forward():
    """The broadcasting reference is torch's flex_attention (eager, CPU, fp64) forward."""
    S = 24
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for mask, score in [("document_window", "alibi"), ("empty_rows", "softcap")]:
        mask_mod, score_mod = make_mask(mask, S), make_score(score)
        bm = create_block_mask(mask_mod, 2, 4, S, S, "cpu", TILE)
        out, aux = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=bm, return_aux=AuxRequest(lse=True)
        )
        ref_out, ref_lse = reference_flex(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(aux.lse, ref_lse, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
def test_hidden_blocks_are_skipped(world_size):
    """Causal on the ring layout: rank r needs the K/V of ranks <= r only, and a document
    mask with documents inside shards needs no exchange at all."""
    S = S_LOCAL * world_size
    ring = get_layout("ring")

    def tiles(mask_mod):
        return VisibleBlocks.of_block_mask(
            create_block_mask(mask_mod, None, None, S, S, "cpu", TILE)
        )

    plan = flex_plan(ring, world_size, S_LOCAL, tiles(causal))
    for rank, row in enumerate(plan.steps):
        computed = [st.src for st in row if st.blocks]
        assert computed == [(rank - s) % world_size for s in range(rank + 1)], plan.table()
    report = flex_balance(ring, world_size, S_LOCAL, tiles(causal))
    assert report.skipped == [world_size - 1 - r for r in range(world_size)]
    n = S_LOCAL // TILE  # work is counted in whole visible tiles
    assert report.work == [(n * (n + 1) // 2 + r * n * n) * TILE**2 for r in range(world_size)]

    def per_shard(b, h, q, kv):
        return q // S_LOCAL == kv // S_LOCAL

    plan = flex_plan(ring, world_size, S_LOCAL, tiles(per_shard))
    assert plan.offsets == (0,) and plan.kv_transfers() == 0


def test_balanced_layout_deals_largest_first():
    """Note [Mask-aware balance]'s rule on a hand-made tile table (one tile a chunk): chunk
    work 1, 3, 3, 4 tiles on 2 ranks -> rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    tiles = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    visible = VisibleBlocks(16, 4, 4, tiles)
    work = [visible.pairs((0, 4, 4 * i), (0, 16, 0), 1) // 16 for i in range(4)]
    layout = balanced_layout(visible, 2, 2)
    order = sorted(range(4), key=lambda i: -work[i])
    load, held = [0, 0], [[], []]
    for i in order:  # the rule, written out
        r = min((r for r in (0, 1) if len(held[r]) < 2), key=lambda r: load[r])
        load[r] += work[i]
        held[r].append(i)
    assert work == [1, 3, 3, 4]
    assert [sorted(h) for h in held] == [[0, 3], [1, 2]]
    for rank in (0, 1):  # a rank's chunks, in order, are its tokens
        want = torch.cat([torch.arange(4 * c, 4 * c + 4) for c in sorted(held[rank])])
        assert torch.equal(layout.token_indices(16, rank, 2), want)


@pytest.mark.parametrize("ndocs", [3, 7])
def test_balanced_layout_beats_fixed_layouts(ndocs):
    """Packed causal documents on 4 ranks: the mask-aware layout's max/mean work is <= 1.05
    and below ring's and zigzag's."""
    W, S = 4, 512
    gen = torch.Generator().manual_seed(ndocs)
    cuts = torch.sort(torch.randperm(S - 1, generator=gen)[: ndocs - 1] + 1).values
    doc = torch.repeat_interleave(
        torch.arange(ndocs), torch.cat([cuts, torch.tensor([S])]).diff(prepend=torch.tensor([0]))
    )

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    bm = create_block_mask(document, None, None, S, S, "cpu", 8)
    balanced = dr.flex_balance(bm, W, dr.flex_layout(bm, W)).imbalance
    assert balanced <= 1.05
    assert balanced < min(dr.flex_balance(bm, W, name).imbalance for name in ("ring", "zigzag"))


def check_skipped_steps_not_sent(group) -> None:
    """A plan that needs only step 0 sends nothing: with every send/receive patched to fail,
    the call still runs (per-shard documents)."""
    W = dist.get_world_size(group)
    S = S_LOCAL * W
    q = torch.randn(1, 2, S_LOCAL, 8, dtype=torch.float64, requires_grad=True)

    def per_shard(b, h, qi, kv):
        return qi // S_LOCAL == kv // S_LOCAL

    bm = create_block_mask(per_shard, None, None, S, S, "cpu", TILE)
    originals = dist.batch_isend_irecv, dist.isend, dist.irecv

    def refuse(*args, **kwargs):
        raise AssertionError("a skipped step communicated")

    dist.batch_isend_irecv = dist.isend = dist.irecv = refuse
    try:
        out = dr.flex_attention(q, q, q, block_mask=bm, group=group)
        out.sum().backward()
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = originals
    ref, _ = reference_flex(q.detach(), q.detach(), q.detach(), mask_mod=lambda b, h, i, j: i >= 0)
    torch.testing.assert_close(out.detach(), ref)


def test_skipped_steps_not_sent(dist_pool):
    dist_pool.run(check_skipped_steps_not_sent, 3)


def check_ranks_disagree_on_mask(group) -> None:
    """Rank 0 passes a causal mask, the others a document mask: every rank raises before
    communicating (the tiles' digest is compared)."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    S = S_LOCAL * W
    mask_mod = causal if rank == 0 else make_mask("document", S)
    bm = create_block_mask(mask_mod, None, None, S, S, "cpu", TILE)
    q = torch.randn(1, 2, S_LOCAL, 8)
    with pytest.raises(ValueError, match="mask tiles"):
        dr.flex_attention(q, q, q, block_mask=bm, group=group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_disagree_on_mask(dist_pool, world_size):
    dist_pool.run(check_ranks_disagree_on_mask, world_size, timeout_s=60)


def check_ranks_disagree_on_data(group, score: bool) -> None:
    """The same functions and tiles, other data: rank 0's document boundary moved within its
    tile (``score``: with a softcap, on the flex kernels; without, read as documents), a
    score table with one other value, a softcap closing over another float: every rank
    raises before communicating."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    S = S_LOCAL * W
    doc = (torch.arange(S) >= (6 if rank == 0 else 7)).long()

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    bm = create_block_mask(document, None, None, S, S, "cpu", TILE)
    q = torch.randn(1, 2, S_LOCAL, 8)
    score_mod = make_score("softcap") if score else None
    with pytest.raises(ValueError, match="ranks disagree"):
        dr.flex_attention(q, q, q, block_mask=bm, score_mod=score_mod, group=group)
    table = torch.zeros(S)
    table[3] = float(rank == 0)
    with pytest.raises(ValueError, match="ranks disagree"):
        dr.flex_attention(q, q, q, score_mod=functools.partial(_biased, table), group=group)
    cap = 5.0 if rank == 0 else 4.0  # the same function, another Python constant

    def softcap(s, b, h, q_idx, kv_idx):
        return cap * torch.tanh(s / cap)

    with pytest.raises(ValueError, match="ranks disagree"):
        dr.flex_attention(q, q, q, score_mod=softcap, group=group)


@pytest.mark.parametrize("score", [False, True])
def test_ranks_disagree_on_data(dist_pool, score):
    dist_pool.run(check_ranks_disagree_on_data, 2, score=score, timeout_s=60)


BAD = {
    "local_block_mask": (
        ValueError,
        "takes the mask of the whole sequence",
        lambda S, W: {"block_mask": create_block_mask(causal, None, None, S // W, S // W, "cpu")},
    ),
    "both_masks": (
        ValueError,
        "not both",
        lambda S, W: {
            "block_mask": create_block_mask(causal, None, None, S, S, "cpu"),
            "mask_mod": causal,
        },
    ),
    "kernel_options": (ValueError, "kernel_options", lambda S, W: {"kernel_options": {"x": 1}}),
    "gqa_without_flag": (ValueError, "enable_gqa=True", lambda S, W: {"kv_heads": 1}),
    "grad_capturing_score_mod": (
        ValueError,
        "requires grad",
        lambda S, W: {"score_mod": functools.partial(_biased, torch.ones(S, requires_grad=True))},
    ),
    "max_scores": (
        ValueError,
        "max_scores",
        lambda S, W: {"return_aux": AuxRequest(lse=True, max_scores=True)},
    ),
    "block_mask_type": (TypeError, "BlockMask", lambda S, W: {"block_mask": causal}),
    "algorithm": (ValueError, "algorithm='ring'", lambda S, W: {"algorithm": "ulysses"}),
}


def _biased(bias, s, b, h, q, kv):
    return s + bias[kv]


def check_ranks_disagree_on_route(group, mode: bool) -> list[str]:
    """A document mask runs on the varlen kernels or on flex's by the lse asked for and the
    kernel named (Note [Document masks on the varlen kernels]); the two communicate
    differently. Rank 0 alone asks for the lse, names the kernel None chooses, or passes an
    argument the others do not (its own check): every rank raises before communicating, with
    the consistency mode on (``mode``) or off."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    S = S_LOCAL * W
    bm = create_block_mask(make_mask("document", S), None, None, S, S, "cpu", TILE)
    q = torch.randn(1, 2, S_LOCAL, 8)
    first = rank == 0
    messages = []
    dr.set_consistency_checks(mode)
    try:
        for kwargs in (
            {"return_lse": first},
            {"return_aux": AuxRequest(lse=True) if first else None},
            {"backend": "flex_math" if first else None},
            {"return_aux": AuxRequest(max_scores=True) if first else None},
            {"algorithm": "ulysses" if first else None},
        ):
            with pytest.raises(ValueError) as info:
                dr.flex_attention(q, q, q, block_mask=bm, group=group, **kwargs)
            messages.append(str(info.value))
        mesh = DeviceMesh.from_group(group, "cpu")  # rank 0: DTensors, with group= besides
        x = DTensor.from_local(q, mesh, [Shard(2)]) if first else q
        with pytest.raises(ValueError) as info:
            dr.flex_attention(x, x, x, block_mask=bm, group=group)
        messages.append(str(info.value))
    finally:
        dr.set_consistency_checks(None)
    return messages


@pytest.mark.parametrize("mode", [False, True], ids=["mode_off", "mode_on"])
def test_ranks_disagree_on_route(dist_pool, mode):
    results = dist_pool.run(check_ranks_disagree_on_route, 3, timeout_s=60, mode=mode)
    for rank, (lse, aux, backend, max_scores, algorithm, dtensor) in enumerate(results):
        fields = [(lse, "lse returned"), (aux, "lse returned"), (backend, "backend argument")]
        for message, field in fields:
            assert message.startswith("ranks disagree"), (rank, message)
            # the header names the fields it hashes alone; the mode names every one
            assert field in message or not mode and "further fields" in message, (rank, message)
        for message, own in (
            (max_scores, "max_scores"),
            (algorithm, "algorithm='ring'"),
            (dtensor, "group= is the DTensors' mesh dim"),
        ):
            # rank 0's own error; with the mode off the others name the rank that raised it
            relayed = not mode and rank > 0 and "rank 0 of the group raised" in message
            assert own in message or relayed, (rank, message)


def check_bad_flex(group, name: str) -> str:
    W = dist.get_world_size(group)
    S = S_LOCAL * W
    error, match, make = BAD[name]
    kwargs = make(S, W)
    H_kv = kwargs.pop("kv_heads", 2)
    q = torch.randn(1, 2, S_LOCAL, 8, requires_grad=True)
    kv = torch.randn(1, H_kv, S_LOCAL, 8)
    with pytest.raises(error, match=match) as info:
        dr.flex_attention(q, kv, kv, group=group, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_flex_call_raises_on_every_rank(dist_pool, name):
    dist_pool.run(check_bad_flex, 2, timeout_s=60, name=name)


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_simulate_ring_flex(layout):
    """The single-device simulator runs FlexAttention plans (every rank in turn) exactly."""
    W, S = 3, 3 * S_LOCAL
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    mask_mod, score_mod = make_mask("document", S), make_score("softcap")
    bm = create_block_mask(mask_mod, None, None, S, S, "cpu", TILE)
    lay = dr.flex_layout(bm, W, chunks_per_rank=2) if layout == "balanced" else layout
    out, lse, dq, dk, dv = dr.simulate_ring(
        q, k, v, dout, layout=lay, world_size=W, block_mask=bm, score_mod=score_mod
    )
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_flex(*leaves, mask_mod=mask_mod, score_mod=score_mod)
    ref_out.backward(dout.transpose(1, 2))
    for got, want in zip(
        (out, dq, dk, dv), (ref_out.detach(), *(t.grad for t in leaves)), strict=True
    ):
        torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def _stand_in_flex(q, k, v, score_mod, block_mask, scale, enable_gqa):
    """An exact, differentiable flex_attention forward (explicit scores) standing in for
    PyTorch's compiled kernel; it also asserts that the block's BlockMask hides no visible
    pair (the tiles it skips must be hidden ones)."""
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv, create_mask

    B, H, S_q, _ = q.shape
    S_k = k.shape[2]
    G = H // k.shape[1]
    k, v = (t.repeat_interleave(G, 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    idx = [torch.arange(n) for n in (B, H, S_q, S_k)]
    if score_mod is not None:
        s = _vmap_for_bhqkv(score_mod, prefix=(0,))(s, *idx)
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, H, S_q, S_k, "cpu")
        q_blk, kv_blk = block_mask.BLOCK_SIZE
        tiles = block_mask.to_dense().repeat_interleave(q_blk, -2).repeat_interleave(kv_blk, -1)
        assert not (mask & (tiles[..., :S_q, :S_k] == 0)).any(), "a skipped tile is visible"
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ v, lse


@pytest.mark.parametrize(
    "layout", ["ring", "zigzag", pytest.param("stripe", marks=pytest.mark.slow), "balanced"]
)
def test_flex_triton_host_logic(monkeypatch, layout):
    """flex_triton's own code on CPU, PyTorch's compiled kernel replaced by an exact stand-in:
    positions, gathered and rebuilt block masks (stripe: not tile-aligned), shifted functions
    and the backward through the block's lse (Note [Flex blocks on PyTorch's kernels]) give
    attention over the whole sequence in fp64."""
    import dtensor_ring.kernels.flex_triton as flex_triton

    monkeypatch.setattr(flex_triton, "_compiled_flex", lambda: _stand_in_flex)
    monkeypatch.setattr(flex_triton.FlexTritonKernel, "unavailable", lambda self, d, t: None)
    W, S = 4, 4 * 16
    gen = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask_mod, score_mod = make_mask("document_window", S), make_score("alibi")
    bm = create_block_mask(mask_mod, None, None, S, S, "cpu", 8)
    lay = dr.flex_layout(bm, W, chunks_per_rank=2) if layout == "balanced" else layout
    out, lse, dq, dk, dv = dr.simulate_ring(
        q, k, v, dout, layout=lay, world_size=W, block_mask=bm, score_mod=score_mod,
        backend="flex_triton",
    )  # fmt: skip
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_flex(*leaves, mask_mod=mask_mod, score_mod=score_mod)
    ref_out.backward(dout.transpose(1, 2))
    want = (ref_out.detach(), *(t.grad for t in leaves))
    for got, ref in zip((out, dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_balance_report_counts_each_ranks_own_runs():
    """``skipped`` is, per rank, the (query run, key run) pairs its mask hides, counted over
    every source rank's own runs: on the mask-aware layout ranks hold different numbers of
    runs (a count from rank 0's runs was wrong there)."""
    W, S = 4, 64
    bm = create_block_mask(make_mask("document", S), None, None, S, S, "cpu", TILE)
    visible = VisibleBlocks.of_block_mask(bm)
    layout = dr.flex_layout(bm, W, chunks_per_rank=4)
    runs = [layout.runs(S // W, r, W) for r in range(W)]
    assert len({len(r) for r in runs}) > 1  # the case the report must get right
    report = flex_balance(layout, W, S // W, visible)
    for rank in range(W):
        hidden = sum(
            visible.trim(q_run, kv_run, 1) is None and not (src == rank and a == b)
            for src in range(W)
            for a, q_run in enumerate(runs[rank])
            for b, kv_run in enumerate(runs[src])
        )
        assert report.skipped[rank] == hidden


def test_document_mask_matches_create_block_mask():
    """``dr.document_mask``'s tiles (Note [Document tiles]) equal ``create_block_mask`` of its
    own mask_mod: partial and full blocks, for random documents (empty ones too), windows,
    rows and lengths that are not a multiple of the tile."""
    rng = random.Random(0)
    for _ in range(120):
        T, L, B = rng.choice([2, 4, 8]), rng.choice([8, 13, 16, 24, 30]), rng.choice([1, 2])
        bounds = []
        for b in range(B):
            cuts = sorted(rng.sample(range(1, L), rng.randint(0, min(5, L - 1))))
            if cuts and rng.random() < 0.2:
                cuts.append(cuts[-1])  # an empty document
            bounds += [b * L + c for c in [0, *cuts]]
        cu = torch.tensor([*bounds, B * L], dtype=torch.int32)
        window = rng.choice([(-1, 0), (-1, -1), (3, 0), (0, 0), (2, 3), (-1, 2), (5, -1)])
        ours = dr.document_mask(cu, L, window, block_size=T)
        ref = create_block_mask(ours.mask_mod, B, 1, L, L, "cpu", T)
        for kind in ("", "full_"):
            counts = getattr(ours, f"{kind}kv_num_blocks")
            assert torch.equal(counts, getattr(ref, f"{kind}kv_num_blocks")), (cu, L, T, window)
            for b, i in itertools.product(range(B), range(counts.shape[-1])):
                n = int(counts[b, 0, i])
                got = getattr(ours, f"{kind}kv_indices")[b, 0, i, :n].sort().values
                want = getattr(ref, f"{kind}kv_indices")[b, 0, i, :n].sort().values
                assert torch.equal(got, want), (cu, L, T, window, kind, b, i)


@pytest.mark.parametrize(
    "cu, window, message",
    [
        ([0.0, 8.0], (-1, 0), "integer tensor"),
        ([0, 5, 3, 8], (-1, 0), "must not fall"),
        ([0, 5, 12, 16], (-1, 0), "crosses into row 1"),
        ([0, 6], (-1, 0), "B \\* seq_len"),
        ([0, 8], (-2, 0), "window_size"),
        ([0, 8], (1.5, 0), "window_size"),
        ([0, 8], (3,), "window_size"),
        ([0, 8], {"seq_len": 0}, "seq_len"),
        ([0, 8], {"block_size": 0}, "block_size"),
        ([0, 8], {"seq_len": 8.0}, "seq_len"),
    ],
)
def test_document_mask_errors(cu, window, message):
    kwargs = window if isinstance(window, dict) else {"window_size": window}
    with pytest.raises((TypeError, ValueError), match=message):
        dr.document_mask(torch.tensor(cu), kwargs.pop("seq_len", 8), **kwargs)


def _document_case(W: int, seed: int):
    """fp64 ``q [2, 4, S, 8]``, ``k, v [2, 2, S, 8]`` (S = S_LOCAL * W), the document mask's
    BlockMask, and the reference: ``((q, k, v), block_mask, ref leaves, ref out, ref lse)``,
    the reference's gradients those of ``out.sum()``."""
    S = S_LOCAL * W
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(2, h, S, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
    mask_mod = make_mask("document", S)
    bm = create_block_mask(mask_mod, None, None, S, S, "cpu", TILE)
    ref_in = [t.clone().requires_grad_() for t in qkv]
    ref_out, ref_lse = reference_flex(*ref_in, mask_mod=mask_mod)
    ref_out.sum().backward()
    return qkv, bm, ref_in, ref_out, ref_lse


def check_dtensor_inputs(group) -> None:
    """``dr.flex_attention`` on ``Shard(2)`` DTensors: the global view in and out, the
    BlockMask of the whole sequence, ``group=None``; contiguous (``distribute_tensor``) and
    zigzag shards (with ``layout="zigzag"``); out, lse and gradients against fp64."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    (q, k, v), bm, ref_in, ref_out, ref_lse = _document_case(W, seed=3)
    B, H, S, D = q.shape
    for layout in ("ring", "zigzag"):
        idx = layout_indices(layout, rank, W, S)
        if layout == "ring":
            leaves = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
        else:
            leaves = [
                DTensor.from_local(t[:, :, idx], mesh, [Shard(2)]).requires_grad_()
                for t in (q, k, v)
            ]
        out, lse = dr.flex_attention(
            *leaves, block_mask=bm, enable_gqa=True, return_lse=True, layout=layout
        )
        assert isinstance(out, DTensor) and tuple(out.placements) == (Shard(2),)
        assert isinstance(lse, DTensor) and tuple(lse.shape) == (B, H, S)
        out.sum().backward()
        tol = {"atol": 1e-10, "rtol": 1e-10}
        torch.testing.assert_close(out.to_local(), ref_out[:, :, idx].detach(), **tol)
        torch.testing.assert_close(lse.to_local(), ref_lse[:, :, idx], **tol)
        for got, want in zip(leaves, ref_in, strict=True):
            torch.testing.assert_close(got.grad.to_local(), want.grad[:, :, idx], **tol)
    local = [t[:, :, :S_LOCAL] for t in (q, k, v)]
    placed = [DTensor.from_local(t, mesh, [Shard(2)]) for t in local]
    wrong = {
        "the others DTensors": (placed[0], local[1], local[2], {}),
        "group=None": (*placed, {"group": group}),
        "Shard\\(2\\)": (
            *(DTensor.from_local(t, mesh, [Replicate()]) for t in local),
            {},
        ),
    }
    if W > 1:  # one token short of W equal shards: refused from the global shape
        uneven = torch.randn(B, H, S_LOCAL * W - 1, D, dtype=torch.float64)
        wrong["evenly"] = (*(distribute_tensor(uneven, mesh, [Shard(2)]) for _ in "qkv"), {})
    for message, (qq, kk, vv, kw) in wrong.items():
        with pytest.raises((TypeError, ValueError), match=message):
            dr.flex_attention(qq, kk, vv, block_mask=bm, enable_gqa=True, **kw)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=SLOW)])
def test_dtensor_inputs(dist_pool, world_size):
    dist_pool.run(check_dtensor_inputs, world_size)


def check_sinks_through_lse(group, layout: str) -> None:
    """Attention sinks (gpt-oss) where flex expresses them: through the lse, as torchtitan's
    gpt-oss does (``out * sigmoid(lse - sinks[h])``); out and the gradients of q, k, v and the
    sinks equal the fp64 sink reference (causal, GQA)."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, H_kv, D, S = 2, 4, 2, 8, S_LOCAL * W
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, _ = reference_attention(*ref_in[:3], causal=True, sinks=ref_in[3])  # [B, S, H, D]
    ref_out.sum().backward()
    idx = layout_indices(layout, rank, W, S)
    bm = create_block_mask(causal, None, None, S, S, "cpu", TILE)
    local = [t[:, idx].transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    out, lse = dr.flex_attention(
        *local, block_mask=bm, enable_gqa=True, return_lse=True, group=group, layout=layout
    )
    out = out * torch.sigmoid(lse - local_sinks[:, None])[..., None]  # [B, H, S_local, D]
    out.sum().backward()
    dist.all_reduce(local_sinks.grad, group=group)  # each rank holds its rows' share
    tol = {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(out.transpose(1, 2), ref_out[:, idx].detach(), **tol)
    for got, want in zip(local, ref_in[:3], strict=True):
        torch.testing.assert_close(got.grad.transpose(1, 2), want.grad[:, idx], **tol)
    torch.testing.assert_close(local_sinks.grad, ref_in[3].grad, **tol)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=SLOW)])
@pytest.mark.parametrize("layout", ["zigzag", "ring"])
def test_sinks_through_lse(dist_pool, world_size, layout):
    dist_pool.run(check_sinks_through_lse, world_size, layout=layout)


def check_torch_flex_in_context_parallel(group, layout) -> None:
    """Inside ``dr.context_parallel``, torch's ``flex_attention`` (looked up on its module at
    call time) runs ``dr.flex_attention`` on the shards in the context's layout (None:
    PyTorch's default); forward and backward inside equal the fp64 reference; a whole-length
    query raises; the attribute is torch's again after the context."""
    from torch.nn.attention import flex_attention as torch_flex

    original = torch_flex.flex_attention
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    (q, k, v), bm, ref_in, ref_out, _ = _document_case(W, seed=9)
    S = q.shape[2]
    buffers = [t.clone() for t in (q, k, v)]
    if layout is None:  # PyTorch's default: head-tail when load balancing is on
        shards_layout = "zigzag" if dr.cp_options.enable_load_balance else "ring"
    else:
        shards_layout = layout
    idx = layout_indices(shards_layout, rank, W, S)
    with dr.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], layout=layout):
        local = [b.detach().requires_grad_() for b in buffers]
        out = torch_flex.flex_attention(*local, block_mask=bm, enable_gqa=True)
        out.sum().backward()
        if W > 1:
            with pytest.raises(ValueError, match="not\\s+this rank's shard|this rank's shard"):
                torch_flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert torch_flex.flex_attention is original
    tol = {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(out, ref_out[:, :, idx].detach(), **tol)
    for got, want in zip(local, ref_in, strict=True):
        torch.testing.assert_close(got.grad, want.grad[:, :, idx], **tol)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=SLOW)])
@pytest.mark.parametrize("layout", [None, "ring"])
def test_torch_flex_in_context_parallel(dist_pool, world_size, layout):
    dist_pool.run(check_torch_flex_in_context_parallel, world_size, layout=layout)
