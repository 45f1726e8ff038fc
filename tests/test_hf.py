"""transformers models with ``attn_implementation="dtensor_ring"`` match them without CP."""

from __future__ import annotations

import re

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
        "gemma3_bidirectional": transformers.Gemma3TextConfig,
    }[arch]
    # mistral: every layer a sliding window of 5 tokens (the model passes sliding_window=5)
    extra = {"sliding_window": 5} if arch == "mistral" else {}
    if arch == "gemma3_bidirectional":  # non-causal attention (is_causal=False), no windows
        extra = dict(
            use_bidirectional_attention=True, layer_types=["full_attention"] * 2, head_dim=16
        )
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


def _cp_vs_full(
    group, arch: str, layout: str, extra: dict | None = None
) -> tuple[float, float, float]:
    """The model with CP (given ``extra`` keywords) vs without."""
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
    out = model(**drhf.shard_batch(batch, group=group, layout=layout), **(extra or {}))
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
        ("gemma3_bidirectional", "zigzag"),
        ("gemma3_bidirectional", "stripe"),
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
    group, layout: str, lengths: tuple[int, ...], arch: str = "llama", extra: dict | None = None
) -> tuple[float, float, float]:
    """A packed row (DataCollatorWithFlattening) with CP (given ``extra`` keywords) vs the
    model run on each document."""
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
    out = model(**inputs, **(extra or {}))
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
        ("llama3", (5, 8, 3), "gemma3_bidirectional"),
        ("zigzag", (4, 8, 4), "gemma3_bidirectional"),
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


@pytest.mark.parametrize(
    "run, kwargs",
    [
        (
            _cp_vs_full,
            dict(
                arch="mistral",
                layout="zigzag",
                extra=dict(
                    is_causal=True,
                    use_cache=False,
                    output_attentions=False,
                    output_hidden_states=True,
                ),
            ),
        ),
        (
            _packed_vs_per_document,
            dict(layout="llama3", lengths=(5, 8, 3), extra=dict(max_length_q=8, max_length_k=8)),
        ),
    ],
    ids=["dense", "packed"],
)
def test_accepts_harmless_keywords(dist_pool, run, kwargs):
    """Keywords that cannot change the attention (forwarded by the model to every layer) are
    accepted, and the model still matches the one without CP."""
    for errors in dist_pool.run(run, WORLD, **kwargs):
        assert max(errors) < 1e-5, errors


H, S_LOCAL, D = 4, 8, 8

#: label -> (keywords of ring_attention_forward, error type, text of its message)
REJECTED = {
    "s_aux": ({"s_aux": torch.zeros(H)}, ValueError, "s_aux=Tensor[4]"),
    "sinks": ({"sinks": torch.zeros(H)}, ValueError, "sinks=Tensor[4]"),
    "softcap": ({"softcap": 30.0}, ValueError, "softcap=30.0"),
    "bidirectional_window": (
        {"is_causal": False, "sliding_window": 4},
        ValueError,
        "sliding_window=4 with is_causal=False",
    ),
    "is_causal=str": ({"is_causal": "False"}, TypeError, "is_causal"),
    "dropout": ({"dropout": 0.1}, ValueError, "dropout=0.1"),
    "dropout=str": ({"dropout": "0"}, TypeError, "dropout"),
    "sliding_window=0": ({"sliding_window": 0}, ValueError, "sliding_window=0"),
    "sliding_window=-3": ({"sliding_window": -3}, ValueError, "sliding_window=-3"),
    "sliding_window=True": ({"sliding_window": True}, TypeError, "sliding_window"),
    "sliding_window=2.5": ({"sliding_window": 2.5}, TypeError, "sliding_window"),
    "attention_mask": (
        {"attention_mask": torch.ones(1, 1, S_LOCAL, S_LOCAL, dtype=torch.bool)},
        ValueError,
        "attention_mask=Tensor[1, 1, 8, 8]",
    ),
    "head_mask": ({"head_mask": torch.ones(H)}, ValueError, "head_mask"),
    "position_bias": ({"position_bias": torch.zeros(1, H, 8, 8)}, ValueError, "position_bias"),
    "seq_idx": ({"seq_idx": torch.zeros(1, S_LOCAL, dtype=torch.int32)}, ValueError, "seq_idx"),
    "output_attentions": ({"output_attentions": True}, ValueError, "output_attentions=True"),
    "cu_seq_lens_k_alone": (
        {"cu_seq_lens_k": torch.tensor([0, 16], dtype=torch.int32)},
        ValueError,
        "cu_seq_lens_k",
    ),
    "unknown": ({"softcap": None, "not_an_argument": 1}, TypeError, "not_an_argument=1"),
}


def _call_attention(module_is_causal: bool = True, keys: int = S_LOCAL, **kwargs):
    """``ring_attention_forward`` on one process, no process group: what it rejects must raise
    before any communication."""
    import dtensor_ring.api.hf as hf

    module = torch.nn.Module()
    module.is_causal = module_is_causal
    q, k = torch.randn(1, H, S_LOCAL, D), torch.randn(1, H // 2, keys, D)
    return hf.ring_attention_forward(module, q, k, k, kwargs.pop("attention_mask", None), **kwargs)


@pytest.fixture
def zigzag_setup(monkeypatch):
    """``setup(layout="zigzag")`` in this process, undone afterwards."""
    import dtensor_ring.api.hf as hf

    monkeypatch.setattr(hf, "_config", None)
    hf.setup(layout="zigzag")


@pytest.mark.parametrize("label", REJECTED)
def test_rejects_keyword(zigzag_setup, label):
    kwargs, error, text = REJECTED[label]
    with pytest.raises(error, match=re.escape(text)):
        _call_attention(**kwargs)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(module_is_causal=False, sliding_window=3), "with is_causal=False"),
        (dict(keys=2 * S_LOCAL, use_cache=True), "use_cache=False"),  # a KV cache's earlier keys
    ],
    ids=["module_not_causal_window", "cached_keys"],
)
def test_rejects_module_state(zigzag_setup, kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        _call_attention(**kwargs)


@pytest.mark.parametrize("arch, keyword", [("gpt_oss", "s_aux"), ("gemma2", "softcap")])
def test_model_features_raise(zigzag_setup, arch, keyword):
    """gpt-oss passes its attention sinks (s_aux), Gemma 2 its softcap: both raise, naming
    the keyword, rather than training on another attention."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
    )
    config = (
        transformers.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1)
        if arch == "gpt_oss"
        else transformers.Gemma2Config(**common)
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dtensor_ring")
    with pytest.raises(ValueError, match=keyword):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))
