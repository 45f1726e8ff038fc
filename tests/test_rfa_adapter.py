"""ring-flash-attention's transformers adapter (``substitute_hf_flash_attn``,
``update_ring_flash_attn_params``) and the leniency of ``llama3_flash_attn_prepare_cu_seqlens``
(int64 ``cu_seqlens``, empty documents).

1. ``llama3_flash_attn_prepare_cu_seqlens`` against the literal port of ring-flash-attention's
   function (``test_varlen._prepare_port``) on boundaries with empty documents, int32 and int64.
2. The llama3 attention with that metadata vs the fp64 per-document reference (out and grads).
3. A tiny Llama / Mistral patched by the adapter, fed packed documents cut the llama3 way, vs
   the same model in one process, one document at a time: loss and gradients match.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention_varlen
from test_varlen import _prepare_port, cumulative

import dtensor_ring as dr

VOCAB = 128

# global document lengths (0: an empty document), total a multiple of 2 and 3
EMPTY_DOCS = {
    "inner": [5, 0, 7, 0, 0, 6],
    "at_rank_border": [4, 0, 4, 0, 4],  # W = 3: empty documents exactly at the borders
    "first_and_last": [0, 9, 3, 0],
    "border_2": [6, 0, 6],  # W = 2: an empty document at the border
}


def _empty_doc_cases() -> list[list[int]]:
    rng = random.Random(5)
    cases = list(EMPTY_DOCS.values())
    for _ in range(20):
        lengths = [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(rng.randint(1, 8))]
        lengths.append(12 - sum(lengths) % 12)
        cases.append(lengths)
    return cases


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [True, False])
def test_prepare_matches_ring_flash_attention_with_empty_documents(causal, dtype):
    for lengths in _empty_doc_cases():
        cu = torch.tensor(cumulative(lengths), dtype=dtype)
        for world_size in (1, 2, 3, 4):
            if int(cu[-1]) % world_size:
                continue
            for rank in range(world_size):
                got = dr.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world_size)
                want = _prepare_port(cu, causal, rank, world_size)
                assert got[0].dtype == got[1].dtype == torch.int32
                assert got[0].tolist() == want[0].tolist(), (lengths, world_size, rank)
                assert got[1].tolist() == want[1].tolist(), (lengths, world_size, rank)
                assert got[2:] == want[2:], (got[2:], want[2:])


@pytest.mark.parametrize(
    "cu, match",
    [
        ([0, 5, 3, 8], r"non-decreasing.*cu_seqlens\[1\]=5 and cu_seqlens\[2\]=3"),
        ([1, 4, 8], r"must start at 0"),
        ([0, 0], r"0 < T < 2\*\*31"),
        ([0, 2**31], r"0 < T < 2\*\*31"),
        ([0, 3, 7], r"T=7 .* not divisible by world_size=2"),
    ],
)
def test_prepare_still_rejects_malformed(cu, match):
    with pytest.raises(ValueError, match=match):
        dr.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(cu), True, 0, 2)


def test_prepare_rejects_other_dtypes_and_shapes():
    with pytest.raises(ValueError, match="int32 or int64 tensor, got torch.float32"):
        dr.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0.0, 4.0]), True, 0, 2)
    with pytest.raises(ValueError, match="int32 or int64 tensor, got list"):
        dr.llama3_flash_attn_prepare_cu_seqlens([0, 4], True, 0, 2)
    with pytest.raises(ValueError, match="1-D"):
        dr.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([[0, 4]]), True, 0, 2)


def test_meta_rejects_keys_of_empty_documents():
    """An empty query document must have no keys (prepare never gives it any)."""
    from dtensor_ring.schedule.llama3 import llama3_meta

    cu_q = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"document 1 is empty in cu_seqlens_q"):
        llama3_meta(cu_q, cu_k, None, None, 0, 5, 4, False, 0, 2, torch.device("cpu"))


def _llama3_vs_reference(group, lengths: list[int], causal: bool) -> float:
    """llama3 attention (int64 cu_seqlens with empty documents, through prepare; consistency
    mode on: the ranks' metadata with empty documents agree) vs the fp64 per-document
    reference: the largest error of out, dq, dk, dv."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cu = torch.tensor(cumulative(lengths), dtype=torch.int64)
    T, H, H_kv, D = int(cu[-1]), 4, 2, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(T, h, D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv))
    dout = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention_varlen(*full, cu, causal=causal)
    ref.backward(dout)
    L = T // W
    rows = slice(rank * L, (rank + 1) * L)
    local = [t[rows].clone().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, W)
    dr.set_consistency_checks(True)
    try:
        out = dr.llama3_flash_attn_varlen_func(
            *local, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal, group=group
        )
        out.backward(dout[rows])
    finally:
        dr.set_consistency_checks(None)
    errs = [(out - ref[rows]).abs().max()]
    errs += [(t.grad - f.grad[rows]).abs().max() for t, f in zip(local, full, strict=True)]
    return max(e.item() for e in errs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("docs", sorted(EMPTY_DOCS))
def test_llama3_with_empty_documents_matches_reference(dist_pool, docs, world_size, causal):
    lengths = EMPTY_DOCS[docs]
    if sum(lengths) % world_size:
        pytest.skip(f"T={sum(lengths)} not a multiple of {world_size}")
    for err in dist_pool.run(_llama3_vs_reference, world_size, lengths=lengths, causal=causal):
        assert err < 1e-10, err


# --- the transformers adapter -----------------------------------------------------------------


def _model(arch: str, attn_implementation: str):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[arch]
    extra = {"sliding_window": 5} if arch == "mistral" else {}
    config = cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )


@contextlib.contextmanager
def _substituted(group, heads_k_stride: int) -> Iterator[None]:
    """``substitute_hf_flash_attn`` for a block; then "flash_attention_2" is restored (the pool's
    workers serve other tests)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import dtensor_ring.hf as drhf

    original = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    try:
        drhf.substitute_hf_flash_attn(group, heads_k_stride)
        yield
    finally:
        AttentionInterface.register("flash_attention_2", original)


def _adapter_vs_one_process(
    group, arch: str, lengths: list[int], heads_k_stride: int, cu_dtype: torch.dtype
) -> tuple[float, float, bool]:
    """The adapter-patched model on this rank's contiguous slice vs the model run on each
    document in one process: (loss error, gradient error, flash_attention_2 replaced)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import dtensor_ring.hf as drhf
    from dtensor_ring.compat.rfa_hf_adapter import ring_flash_attention_forward

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    input_ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    # next token within each document; -100 at every document's last token
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs if len(d)])[None]
    count = int((labels != -100).sum())

    ref = _model(arch, "sdpa")
    ref_loss = sum(
        torch.nn.functional.cross_entropy(
            ref(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum"
        )
        for d in docs
        if len(d) > 1
    )
    (ref_loss / count).backward()

    with _substituted(group, heads_k_stride):
        replaced = ALL_ATTENTION_FUNCTIONS["flash_attention_2"] is ring_flash_attention_forward
        cu_seqlens = torch.tensor(cumulative(lengths), dtype=cu_dtype)
        drhf.update_ring_flash_attn_params(cu_seqlens, group)
        model = _model(arch, drhf.RFA_ATTN_IMPLEMENTATION)
        L = input_ids.shape[1] // W
        rows = slice(rank * L, (rank + 1) * L)
        logits = model(input_ids=input_ids[:, rows], position_ids=positions[:, rows]).logits
    loss = torch.nn.functional.cross_entropy(
        logits[0], labels[0, rows], ignore_index=-100, reduction="sum"
    )
    (loss / count).backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grad_err = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, (grad - p_ref.grad).abs().max().item())
    return abs(total.item() - ref_loss.item()) / count, grad_err, replaced


@pytest.mark.parametrize(
    "arch, lengths, heads_k_stride, cu_dtype",
    [
        ("llama", [5, 8, 5], 1, torch.int32),  # documents straddling the rank borders
        ("llama", [7, 0, 6, 5], 2, torch.int64),  # an empty document; int64 cu_seqlens
        ("mistral", [5, 9, 4], 1, torch.int32),  # sliding window 5 inside a 9-token document
    ],
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_adapter_matches_one_process(
    dist_pool, world_size, arch, lengths, heads_k_stride, cu_dtype
):
    pytest.importorskip("transformers")
    for loss_err, grad_err, replaced in dist_pool.run(
        _adapter_vs_one_process,
        world_size,
        arch=arch,
        lengths=lengths,
        heads_k_stride=heads_k_stride,
        cu_dtype=cu_dtype,
    ):
        assert replaced
        assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)


def _adapter_rejects(group, what: str) -> str:
    import dtensor_ring.hf as drhf

    W = dist.get_world_size(group)
    ids = torch.randint(0, VOCAB, (1, 4 * W))
    with _substituted(group, 1), pytest.raises((ValueError, TypeError)) as info:
        drhf.update_ring_flash_attn_params(torch.tensor([0, 4 * W], dtype=torch.int32), group)
        model = _model("llama", drhf.RFA_ATTN_IMPLEMENTATION)
        if what == "full_row":  # the whole packed row instead of the rank's slice
            model(input_ids=ids)
        elif what == "batch":
            model(input_ids=ids[:, :4].expand(2, 4))
        elif what == "padding":
            model(input_ids=ids[:, :4], attention_mask=torch.tensor([[1, 1, 1, 0]]))
        elif what == "stride":
            drhf.substitute_hf_flash_attn(group, 3)
            model(input_ids=ids[:, :4])
    return str(info.value)


@pytest.mark.parametrize(
    "what, match",
    [
        ("full_row", r"got 8 queries and 8 keys, but update_ring_flash_attn_params gave .* 4"),
        ("batch", r"batch size 1"),
        ("padding", r"does not support padding"),
        ("stride", r"heads_k_stride=3 must be a positive divisor"),
    ],
)
def test_adapter_rejects(dist_pool, what, match):
    pytest.importorskip("transformers")
    for message in dist_pool.run(_adapter_rejects, 2, what=what):
        assert re.search(match, message), message


def test_substitute_checks_arguments():
    pytest.importorskip("transformers")
    import dtensor_ring.hf as drhf

    with pytest.raises(TypeError, match="heads_k_stride must be an int"):
        drhf.substitute_hf_flash_attn(None, 1.0)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed"):
        drhf.substitute_hf_flash_attn("group", 1)
