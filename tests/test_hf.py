"""transformers models with ``attn_implementation="dtensor_ring"`` match them without CP."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD = 2
BATCH, SEQ, VOCAB = 2, 32, 128


def _config(arch: str):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    # mistral: every layer a sliding window of 5 tokens (the model passes sliding_window=5)
    extra = {"sliding_window": 5} if arch == "mistral" else {}
    return cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **extra,
    )


def _model(arch: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        _config(arch), attn_implementation=attn_implementation, dtype=torch.float32
    )


def _cp_vs_full(group, arch: str, layout: str) -> tuple[float, float, float]:
    import dtensor_ring as dr
    import dtensor_ring.hf as drhf

    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}

    ref = _model(arch, "sdpa")
    ref_out = ref(**batch)
    ref_out.loss.backward()

    drhf.setup(group=group, layout=layout)
    model = _model(arch, "dtensor_ring")
    out = model(**drhf.shard_batch(batch, group=group, layout=layout))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)  # each rank's share of the global mean
    logits = dr.gather_sequence(out.logits.detach().contiguous(), layout, group=group)
    grad_err = 0.0
    for (name, p), (ref_name, p_ref) in zip(
        model.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert name == ref_name
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, (grad - p_ref.grad).abs().max().item())
    return (
        (logits - ref_out.logits.detach()).abs().max().item(),
        abs(loss.item() - ref_out.loss.item()),
        grad_err,
    )


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", "zigzag"),
        ("llama", "stripe"),
        ("qwen2", "ring"),
        ("mistral", "zigzag"),
        ("mistral", "stripe"),
    ],
)
def test_matches_without_cp(dist_pool, arch, layout):
    for logits_err, loss_err, grad_err in dist_pool.run(
        _cp_vs_full, WORLD, arch=arch, layout=layout
    ):
        assert logits_err < 1e-5 and loss_err < 1e-5 and grad_err < 1e-5, (
            logits_err,
            loss_err,
            grad_err,
        )


def _packed_vs_per_document(
    group, layout: str, lengths: tuple[int, ...], arch: str = "llama"
) -> tuple[float, float, float]:
    """A packed row (DataCollatorWithFlattening) with CP vs the model run on each document."""
    from transformers import DataCollatorWithFlattening

    import dtensor_ring as dr
    import dtensor_ring.hf as drhf

    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    assert set(batch) == {"input_ids", "labels", "position_ids"}

    ref = _model(arch, "sdpa")  # flash-style varlen semantics: documents never meet
    ref_logits = torch.cat([ref(input_ids=d[None]).logits for d in docs], dim=1)
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0], shifted[0], ignore_index=-100)
    ref_loss.backward()

    drhf.setup(group=group, layout=layout)
    model = _model(arch, "dtensor_ring")
    inputs = drhf.shard_batch(batch, group=group, layout=layout)
    out = model(**inputs)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    parts = [torch.empty_like(out.logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.logits.detach().contiguous(), group=group)
    logits = dr.unshard_varlen(parts, inputs["cu_seq_lens_q"], layout, seq_dim=1)
    grad_err = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, (grad - p_ref.grad).abs().max().item())
    return (
        (logits - ref_logits.detach()).abs().max().item(),
        abs(loss.item() - ref_loss.item()),
        grad_err,
    )


@pytest.mark.parametrize(
    "layout, lengths, arch",
    [
        ("llama3", (5, 8, 3), "llama"),
        ("zigzag", (4, 8, 4), "llama"),
        ("ring", (6, 8, 2), "llama"),
        ("llama3", (5, 9, 2), "mistral"),  # sliding window 5 inside documents of 9 tokens
        ("zigzag", (8, 12, 4), "mistral"),
    ],
)
def test_packed_matches_per_document(dist_pool, layout, lengths, arch):
    """Packed documents (straddling the rank border for llama3) vs each document alone."""
    for logits_err, loss_err, grad_err in dist_pool.run(
        _packed_vs_per_document, WORLD, layout=layout, lengths=lengths, arch=arch
    ):
        assert logits_err < 1e-5 and loss_err < 1e-5 and grad_err < 1e-5, (
            logits_err,
            loss_err,
            grad_err,
        )


def _rejects(group, what: str) -> str:
    import dtensor_ring as dr
    import dtensor_ring.hf as drhf

    drhf.setup(group=group, layout="zigzag")
    model = _model("llama", "dtensor_ring")
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    inputs = drhf.shard_batch({"input_ids": input_ids}, group=group, layout="zigzag")
    if what == "packed_no_metadata":  # shard_batch's packed output without cu_seq_lens_q/k
        positions = torch.cat([torch.arange(4), torch.arange(SEQ - 4)])[None]
        inputs = drhf.shard_batch(
            {"input_ids": input_ids[:1], "position_ids": positions}, group=group, layout="zigzag"
        )
        del inputs["cu_seq_lens_q"], inputs["cu_seq_lens_k"]
    elif what == "packed_batch":  # packed rows need B == 1
        positions = torch.cat([torch.arange(4), torch.arange(SEQ - 4)]).expand(BATCH, SEQ)
        with pytest.raises(ValueError) as info:
            drhf.shard_batch(
                {"input_ids": input_ids, "position_ids": positions}, group=group, layout="zigzag"
            )
        return str(info.value)
    elif what == "packed":  # two documents: positions restart
        s = SEQ // 2
        inputs["position_ids"] = dr.shard_local(
            torch.cat([torch.arange(s), torch.arange(s)]).expand(BATCH, SEQ),
            "zigzag",
            dist.get_rank(group),
            dist.get_world_size(group),
        )
    elif what == "no_positions":
        del inputs["position_ids"]
    else:  # padding
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, -1] = 0
        inputs["attention_mask"] = mask
    with pytest.raises(ValueError) as info:
        model(**inputs)
    return str(info.value)


@pytest.mark.parametrize(
    "what", ["packed", "packed_no_metadata", "packed_batch", "no_positions", "padding"]
)
def test_rejects_what_it_cannot_honour(dist_pool, what):
    for message in dist_pool.run(_rejects, WORLD, what=what):
        assert "dtensor_ring" in message
