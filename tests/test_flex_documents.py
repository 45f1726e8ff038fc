"""FlexAttention document masks on the varlen kernels (Note [Document masks on the varlen
kernels] in ``dtensor_ring/schedule/flex_documents.py``).

The reading is checked pair by pair against ``create_mask`` on random document sets, tile
sizes and windows (and refuses what is not a document mask); the routed calls against the
fp64 reference on the full sequence, forward and backward, on the session's gloo pool at
W = 1-4, with a spy that tells which kernels ran.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
import torch.distributed as dist
from reference import layout_indices, reference_flex
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask

import dtensor_ring as dr
import dtensor_ring.api.flex as flex_door
from dtensor_ring.schedule.flex_documents import MaskDocuments, mask_documents


def _doc_ids(rows: list[list[int]]) -> torch.Tensor:
    """``[B, S]`` document ids of rows of document lengths."""
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )


def _varlen_visible(documents: MaskDocuments, B: int, S: int) -> torch.Tensor:
    """bool ``[B, S, S]``: the pairs the documents' varlen attention computes."""
    pos = torch.arange(B * S)
    bounds = torch.tensor(documents.bounds)
    doc = torch.bucketize(pos, bounds, right=True)
    left, right = documents.window_size
    diff = pos[:, None] - pos[None, :]
    seen = doc[:, None] == doc[None, :]
    if left >= 0:
        seen &= diff <= left
    if right >= 0:
        seen &= -diff <= right
    return torch.stack([seen[b * S : (b + 1) * S, b * S : (b + 1) * S] for b in range(B)])


def _masks(ids: torch.Tensor, window: int) -> dict:
    def doc(b, h, q, kv):
        return ids[b, q] == ids[b, kv]

    def causal(b, h, q, kv):
        return q >= kv

    def near(b, h, q, kv):
        return q - kv <= window

    def around(b, h, q, kv):
        return (q - kv <= window) & (kv - q <= window + 1)

    return {
        "document": and_masks(causal, doc),
        "document_window": and_masks(causal, doc, near),
        "bidirectional": doc,
        "bidirectional_window": and_masks(doc, around),
        "causal": causal,
        "sliding_window": and_masks(causal, near),
    }


def test_document_masks_read_pair_for_pair():
    """Random documents (rows of their own), tile sizes (the query's and the key's apart) and
    windows: the documents read from the BlockMask compute exactly the pairs the mask shows."""
    rng = random.Random(0)
    read = 0
    for _ in range(12):
        B, S = rng.choice([1, 2]), rng.choice([16, 24, 37, 64])
        tile = (rng.choice([4, 8, 16]), rng.choice([4, 8, 16]))  # query and key tiles
        rows = []
        for _ in range(B):
            cuts = sorted(rng.sample(range(1, S), rng.randint(0, 4)))
            rows.append([b - a for a, b in zip([0, *cuts], [*cuts, S], strict=True)])
        masks = _masks(_doc_ids(rows), rng.randint(0, 6))
        for name, mask_mod in masks.items():
            bm = create_block_mask(mask_mod, B, None, S, S, device="cpu", BLOCK_SIZE=tile)
            documents = mask_documents(bm, B)
            assert documents is not None, (name, rows, tile)
            want = create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]
            assert torch.equal(_varlen_visible(documents, B, S), want), (name, rows, tile)
            read += 1
    assert read == 72


def test_other_masks_are_not_documents():
    S = 32
    ids = _doc_ids([[10, 22]])

    def prefix_lm(b, h, q, kv):
        return (kv < 5) | (q >= kv)

    def per_head(b, h, q, kv):
        return (q >= kv) | (h > 0)

    def gap(b, h, q, kv):  # a key hidden in the middle of a row's keys
        return (q >= kv) & (kv != 3)

    def empty_row(b, h, q, kv):
        return (q >= kv) & (q != 7)

    def windows_differ(b, h, q, kv):  # document 0 sees 2 back, document 1 sees 4 back
        return (ids[0, q] == ids[0, kv]) & (q >= kv) & (q - kv <= torch.where(q < 10, 2, 4))

    for mask_mod in (prefix_lm, per_head, gap, empty_row, windows_differ):
        bm = create_block_mask(mask_mod, None, 2, S, S, device="cpu", BLOCK_SIZE=8)
        assert mask_documents(bm, 1) is None, mask_mod.__name__

    def python_branch(b, h, q, kv):  # does not trace (nor vmap: flex itself cannot run it)
        return q >= kv if int(q) % 2 else q > kv

    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, "cpu", BLOCK_SIZE=8)
    bm.mask_mod = python_branch
    assert mask_documents(bm, 1) is None


def test_reading_stops_at_the_first_rows_that_are_not_intervals():
    """A mask that is not documents is found out after its first row of tiles: the rows
    below are never evaluated (its mask_mod fails on them here)."""
    S, tile = 2048, 8  # 256 partial tiles a row: one pass
    rand = torch.rand(S, S, generator=torch.Generator().manual_seed(0)) < 0.5
    bm = create_block_mask(lambda b, h, q, kv: rand[q, kv], None, None, S, S, "cpu", tile)
    first_rows = rand[:tile].clone()
    bm.mask_mod = lambda b, h, q, kv: first_rows[q, kv]  # an IndexError past row 7
    assert mask_documents(bm, 1) is None


def test_the_reading_keeps_nothing_alive():
    """The cache holds masks, functions and the tensors they read weakly (a mask_mod may
    close over a large table)."""
    S = 64

    def read() -> weakref.ref:
        table = (torch.arange(S) >= 30).long()
        bm = create_block_mask(
            lambda b, h, q, kv: (table[q] == table[kv]) & (q >= kv), None, None, S, S, "cpu", 8
        )
        assert mask_documents(bm, 1) == MaskDocuments((0, 30, S), (-1, 0))
        return weakref.ref(table)

    freed = read()
    gc.collect()
    assert freed() is None


def test_a_failed_trace_inside_a_mode_is_not_remembered():
    """A function that does not trace inside a Python mode (a FakeTensorMode here) is traced
    again outside it: a mode active on one rank must not fix that rank's reading."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtensor_ring._compat import function_reads

    ids = _doc_ids([[5, 11]])

    def document(b, h, q, kv):
        return ids[b, q] == ids[b, kv]

    with FakeTensorMode():
        assert function_reads(document, ("b", "h", "q_idx", "kv_idx")) is None
    reads = function_reads(document, ("b", "h", "q_idx", "kv_idx"))
    assert reads is not None and reads[0] == {"b", "q_idx", "kv_idx"}
    # nor the mask's reading that depends on it
    S = 16
    bm = create_block_mask(_masks(_doc_ids([[5, 11]]), 0)["document"], 1, None, S, S, "cpu", 4)
    with FakeTensorMode():
        assert mask_documents(bm, 1) is None
    assert mask_documents(bm, 1) == MaskDocuments((0, 5, S), (-1, 0))


def test_public_reading_and_its_refusals():
    S = 24
    ids = _doc_ids([[10, 14], [4, 20]])
    bm = create_block_mask(_masks(ids, 3)["document_window"], 2, None, S, S, "cpu", 8)
    assert dr.mask_documents(bm, 2) == MaskDocuments((0, 10, S, S + 4, 2 * S), (3, 0))
    for bad, error in (
        ((object(),), TypeError),
        ((bm, 0), ValueError),
        ((bm, True), ValueError),
        ((bm, 3), ValueError),  # a mask of 2 rows for 3
    ):
        with pytest.raises(error):
            dr.mask_documents(*bad)


def test_tiles_per_head_are_not_documents():
    S = 16
    heads = torch.tensor([4, 8])  # head 0 documents of 4 tokens, head 1 of 8

    def by_head(b, h, q, kv):  # reads h: refused before its tiles are looked at
        return (q >= kv) & (q // heads[h] == kv // heads[h])

    bm = create_block_mask(by_head, None, 2, S, S, device="cpu", BLOCK_SIZE=4)
    assert mask_documents(bm, 1) is None
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, 2, S, S, "cpu", 4)
    assert mask_documents(causal, 1) == MaskDocuments((0, S), (-1, 0))
    causal.kv_num_blocks[0, 1, 0] = 0  # head 1 now lists no tile for its first rows
    assert mask_documents(causal, 1) is None


def test_reading_follows_the_masks_tensors():
    """Read once per BlockMask, again when a tensor its mask_mod reads changes in place."""
    S = 24
    ids = _doc_ids([[10, 14]])
    bm = create_block_mask(_masks(ids, 0)["document"], None, None, S, S, "cpu", BLOCK_SIZE=8)
    first = mask_documents(bm, 1)
    assert first == MaskDocuments((0, 10, S), (-1, 0))
    assert mask_documents(bm, 1) is first  # cached
    # a new batch written into the same buffer, its boundary in the same tile: the same
    # BlockMask object is still this batch's mask (its tiles are), and is read again
    ids.copy_(_doc_ids([[12, 12]]))
    fresh = create_block_mask(_masks(ids, 0)["document"], None, None, S, S, "cpu", BLOCK_SIZE=8)
    assert torch.equal(fresh.to_dense(), bm.to_dense())
    assert mask_documents(bm, 1) == MaskDocuments((0, 12, S), (-1, 0))
    ids.copy_(_doc_ids([[6, 18]]))  # another batch, its mask built anew
    bm = create_block_mask(_masks(ids, 0)["document"], None, None, S, S, "cpu", BLOCK_SIZE=8)
    assert mask_documents(bm, 1) == MaskDocuments((0, 6, S), (-1, 0))

    def every_row(b, h, q, kv):  # reads no batch index: the same documents in every row
        return (ids[0, q] == ids[0, kv]) & (q >= kv)

    bm = create_block_mask(every_row, None, None, S, S, "cpu", BLOCK_SIZE=8)
    assert mask_documents(bm, 2) == MaskDocuments((0, 6, S, S + 6, 2 * S), (-1, 0))


# --- the routed calls, on the gloo pool ------------------------------------------------------

S_LOCAL = 12
ROWS = [[5, 11, 3, 9, 20], [17, 1, 30]]  # per batch row; documents cross shard boundaries


class _Spy:
    """Counts the calls that ran on the varlen kernels."""

    def __enter__(self):
        self.calls, self.original = 0, flex_door.attend_rows

        def attend(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        flex_door.attend_rows = attend
        return self

    def __exit__(self, *exc):
        flex_door.attend_rows = self.original


def check_documents_route(group, mask: str, layout: str, H_kv: int, algorithm=None) -> None:
    """One document mask through ``dr.flex_attention`` on the ranks' shards: on the varlen
    kernels (by ``algorithm``), forward and gradients equal the fp64 reference over the whole
    sequence."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, D, S = 2, 4, 8, S_LOCAL * W
    rows = [[n * W * S_LOCAL // 60 for n in r] for r in ROWS]
    for r in rows:
        r[-1] += S - sum(r)
    mask_mod = _masks(_doc_ids(rows), 4)[mask]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv))
    dout = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_flex(*ref_in, mask_mod=mask_mod)
    (ref_out * dout).sum().backward()
    bm = create_block_mask(mask_mod, B, None, S, S, "cpu", BLOCK_SIZE=4)
    if layout == "balanced":
        layout = dr.flex_layout(bm, W, chunks_per_rank=2)
        idx = layout.token_indices(S, rank, W)
    else:
        idx = layout_indices(layout, rank, W, S)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    with _Spy() as spy:
        out = dr.flex_attention(
            *local, block_mask=bm, enable_gqa=H != H_kv, group=group, layout=layout,
            algorithm=algorithm,
        )  # fmt: skip
    assert spy.calls == 1
    (out * dout[:, :, idx]).sum().backward()
    tol = {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(out, ref_out[:, :, idx], **tol)
    for name, got, ref in zip("qkv", local, ref_in, strict=True):
        torch.testing.assert_close(got.grad, ref.grad[:, :, idx], **tol, msg=name)


ROUTE_CASES = [
    ("document", "ring", 2),
    ("document", "zigzag", 4),
    ("document_window", "stripe", 2),
    ("bidirectional", "zigzag", 4),
    ("bidirectional_window", "ring", 1),
    ("causal", "zigzag", 2),
    ("sliding_window", "balanced", 4),
    ("document", "balanced", 2),
]
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "world_size", [1, 2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)]
)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_document_masks_run_as_documents(dist_pool, world_size, case):
    mask, layout, H_kv = case
    dist_pool.run(check_documents_route, world_size, mask=mask, layout=layout, H_kv=H_kv)


def test_document_masks_at_three_ranks(dist_pool):
    """W = 3 in the fast tier: a document cut over three ranks."""
    dist_pool.run(check_documents_route, 3, mask="document", layout="zigzag", H_kv=2)


@pytest.mark.parametrize(
    "world_size, case",
    [(2, ("document", "balanced", 2)), (3, ("document_window", "zigzag", 4)),
     pytest.param(4, ("bidirectional", "balanced", 2), marks=SLOW)],
)  # fmt: skip
def test_document_masks_by_the_gather(dist_pool, world_size, case):
    """``algorithm="all_gather"``: the mask's documents, as the layout placed them, by the
    all-gather of the keys each rank's queries see (Note [Gathering what placed documents
    need]), exact."""
    mask, layout, H_kv = case
    kw = dict(mask=mask, layout=layout, H_kv=H_kv, algorithm="all_gather")
    dist_pool.run(check_documents_route, world_size, **kw)


def check_gather_refuses(group) -> list[str]:
    """``algorithm="all_gather"`` where the call would not run as documents: a clean error on
    every rank."""
    S = S_LOCAL * dist.get_world_size(group)
    q = torch.randn(1, 2, S_LOCAL, 8, dtype=torch.float64)
    document = _masks(_doc_ids([[5, S - 5]]), 0)["document"]
    bm = create_block_mask(document, None, None, S, S, "cpu", BLOCK_SIZE=4)
    prefix = create_block_mask(lambda b, h, i, j: (j < 3) | (i >= j), None, None, S, S, "cpu", 4)
    messages = []
    for kwargs in ({"block_mask": prefix}, {"block_mask": bm, "return_lse": True}, {}):
        with pytest.raises(ValueError, match="all_gather") as info:
            dr.flex_attention(q, q, q, group=group, algorithm="all_gather", **kwargs)
        messages.append(str(info.value))
    return messages


def test_gather_refuses_other_masks(dist_pool):
    for messages in dist_pool.run(check_gather_refuses, 2):
        assert all("packed documents" in m for m in messages), messages


def check_flex_kernels_where_asked(group) -> None:
    """The same document mask stays on the flex kernels when the call needs them: a
    ``score_mod``, the lse (flex's has a gradient), ``backend=``; and for what is not a
    document mask."""
    W = dist.get_world_size(group)
    S = S_LOCAL * W
    ids = _doc_ids([[5, S - 5]])
    document = _masks(ids, 0)["document"]
    q = torch.randn(1, 2, S_LOCAL, 8, dtype=torch.float64)
    bm = create_block_mask(document, None, None, S, S, "cpu", BLOCK_SIZE=4)
    prefix = create_block_mask(lambda b, h, i, j: (j < 3) | (i >= j), None, None, S, S, "cpu", 4)
    for kwargs in (
        {"block_mask": bm, "score_mod": lambda s, b, h, i, j: s * 0.5},
        {"block_mask": bm, "return_lse": True},
        {"block_mask": bm, "backend": "flex_math"},
        {"block_mask": prefix},
    ):
        with _Spy() as spy:
            dr.flex_attention(q, q, q, group=group, **kwargs)
        assert spy.calls == 0, kwargs
    with _Spy() as spy:
        dr.flex_attention(q, q, q, group=group, mask_mod=document)  # a bare mask_mod too
        out = dr.flex_attention(q, q, q, group=group)  # no mask: every pair, flex kernels
    assert spy.calls == 1
    full = dr.ring_attention_func("ring", *(t.transpose(1, 2) for t in (q, q, q)), group=group)
    torch.testing.assert_close(out, full.transpose(1, 2), atol=1e-12, rtol=1e-12)


def test_flex_kernels_where_asked(dist_pool):
    dist_pool.run(check_flex_kernels_where_asked, 2)
