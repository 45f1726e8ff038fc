"""transformers models with ``attn_implementation="dtensor_ring"`` match them without CP."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.engine_spy import engines_used, forced_algorithm  # noqa: E402
from tests.reference import reference_attention  # noqa: E402

WORLD = 2
BATCH, SEQ, VOCAB = 2, 32, 128


def _config(arch: str):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "gemma3_bidirectional": transformers.Gemma3TextConfig,
        "gpt_oss": transformers.GptOssConfig,
    }[arch]
    # mistral: every layer a sliding window of 5 tokens (the model passes sliding_window=5)
    extra = {"sliding_window": 5} if arch == "mistral" else {}
    if arch == "gpt_oss":  # attention sinks (s_aux), a sliding layer (window 5) and a full one
        extra = dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=5, head_dim=16)
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


_REFERENCE = {"gpt_oss": "eager"}  # transformers has no sdpa path with sinks


def _check_engine(layout: str, used: set[str], algorithm: str | None = None) -> None:
    """The all-gather layouts ran the all-gather op only (for every mask), the others the
    ring only; "auto" the ``algorithm`` it was forced to, or one of the three."""
    if layout == "auto":
        engines = {"ring": "ring", "all_gather": "llama3", "ulysses": "ulysses"}
        assert len(used) == 1 and used <= set(engines.values()), used
        assert algorithm is None or used == {engines[algorithm]}, (algorithm, used)
        return
    expected = {"llama3"} if layout in ("llama3", "llama3_zigzag") else {"ring"}
    assert used == expected, (layout, used)


def _model(arch: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        _config(arch), attn_implementation=attn_implementation, dtype=torch.float32
    )


def _cp_vs_full(
    group, arch: str, layout: str, extra: dict | None = None, algorithm: str | None = None
) -> tuple[float, float, float]:
    """The model with CP (given ``extra`` keywords; "auto" forced to ``algorithm``) vs
    without."""
    import dtensor_ring.hf as drhf

    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}

    ref = _model(arch, _REFERENCE.get(arch, "sdpa"))
    ref_out = ref(**batch)
    ref_out.loss.backward()

    drhf.setup(group=group, layout=layout)
    model = _model(arch, "dtensor_ring")
    inputs = drhf.shard_batch(batch, group=group, layout=layout)
    with forced_algorithm(algorithm), engines_used() as used:
        out = model(**inputs, **(extra or {}))
        out.loss.backward()
    _check_engine(layout, used, algorithm)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)  # each rank's share of the global mean
    logits = drhf.gather_outputs(out.logits.detach(), inputs, group=group, layout=layout)
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
        ("llama", "llama3"),  # B = 2, a row per document (Note [llama3 with a batch])
        ("gemma3_bidirectional", "llama3"),
        ("gpt_oss", "zigzag"),  # attention sinks (s_aux) and their gradient
        ("gpt_oss", "llama3"),
        # all-gather with zigzag's tokens: causal, sliding window, bidirectional, sinks
        ("llama", "llama3_zigzag"),
        ("mistral", "llama3_zigzag"),
        ("gemma3_bidirectional", "llama3_zigzag"),
        ("gpt_oss", "llama3_zigzag"),
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, algorithm",
    [
        ("llama", None),  # the cost model's own choice
        ("llama", "ring"),
        ("mistral", "all_gather"),  # sliding window
        ("gpt_oss", "ulysses"),  # sinks (s_aux) of the rank's heads
        ("gemma3_bidirectional", "ring"),  # no mask: the order-free ring
    ],
)
def test_auto_matches_without_cp(dist_pool, arch, algorithm):
    """layout="auto" (zigzag's tokens, the algorithm chosen per call) vs one process."""
    for errors in dist_pool.run(_cp_vs_full, WORLD, arch=arch, layout="auto", algorithm=algorithm):
        assert max(errors) < 1e-5, errors


def _packed_vs_per_document(
    group,
    layout: str,
    lengths: tuple[int, ...],
    arch: str = "llama",
    extra: dict | None = None,
    algorithm: str | None = None,
    setup_algorithm: str | None = None,
) -> tuple[float, float, float]:
    """A packed row (DataCollatorWithFlattening) with CP (given ``extra`` keywords; ``setup``'s
    ``setup_algorithm``) vs the model run on each document."""
    from transformers import DataCollatorWithFlattening

    import dtensor_ring.hf as drhf

    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    assert set(batch) == {"input_ids", "labels", "position_ids"}

    ref = _model(
        arch, _REFERENCE.get(arch, "sdpa")
    )  # flash-style varlen semantics: documents never meet
    ref_logits = torch.cat([ref(input_ids=d[None]).logits for d in docs], dim=1)
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0], shifted[0], ignore_index=-100)
    ref_loss.backward()

    drhf.setup(group=group, layout=layout, algorithm=setup_algorithm)
    model = _model(arch, "dtensor_ring")
    inputs = drhf.shard_batch(batch, group=group, layout=layout)
    with forced_algorithm(algorithm), engines_used() as used:
        out = model(**inputs, **(extra or {}))
        out.loss.backward()
    if setup_algorithm == "all_gather" and layout == "documents":
        assert used == {"placed_gather"}, used
    else:
        _check_engine(layout, used, algorithm)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = drhf.gather_outputs(out.logits.detach(), inputs, group=group, layout=layout)
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
        ("zigzag", (8, 12, 4), "gpt_oss"),
        ("llama3_zigzag", (4, 8, 4), "llama"),
        ("llama3_zigzag", (8, 12, 4), "mistral"),  # window 5 in documents of 8 and 12
        ("llama3_zigzag", (4, 8, 4), "gemma3_bidirectional"),
        ("documents", (5, 8, 3), "llama"),  # any lengths: placed by document_layout
        ("documents", (5, 9, 2), "mistral"),
        ("documents", (3, 10, 3), "gemma3_bidirectional"),
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


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_bidirectional"])
def test_documents_packed_by_the_gather(dist_pool, arch):
    """layout="documents" with algorithm="all_gather": each rank fetches only the keys its
    queries see; logits, loss and gradients against each document alone."""
    for errors in dist_pool.run(
        _packed_vs_per_document, WORLD, layout="documents", lengths=(5, 9, 2), arch=arch,
        setup_algorithm="all_gather",
    ):  # fmt: skip
        assert max(errors) < 1e-5, errors


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3_bidirectional"])
def test_documents_packed_at_three_ranks(dist_pool, arch):
    """layout="documents" at W = 3: logits, loss and gradients against each document alone."""
    for errors in dist_pool.run(
        _packed_vs_per_document, 3, layout="documents", lengths=(7, 11, 6), arch=arch
    ):
        assert max(errors) < 1e-5, errors


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "all_gather"])
def test_auto_packed_matches_per_document(dist_pool, algorithm):
    for errors in dist_pool.run(
        _packed_vs_per_document,
        WORLD,
        layout="auto",
        lengths=(8, 12, 4),
        arch="mistral",
        algorithm=algorithm,
    ):
        assert max(errors) < 1e-5, errors


def _llama3_zigzag_rejects(group, what: str) -> str:
    """What layout="llama3_zigzag" cannot shard (documents or rows not multiples of 2W):
    ValueError (returned) on every rank, from shard_batch or, for a batch sharded otherwise,
    from the attention before any communication."""
    from transformers import DataCollatorWithFlattening

    import dtensor_ring.hf as drhf

    drhf.setup(group=group, layout="llama3_zigzag")
    docs = [list(range(1, 1 + n)) for n in (5, 8, 3)]  # 5 and 3 are not multiples of 4
    packed = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    with pytest.raises(ValueError) as info:
        if what == "dense":
            drhf.shard_batch(
                {"input_ids": torch.zeros(2, 30, dtype=torch.long)}, group, "llama3_zigzag"
            )
        elif what == "packed":
            drhf.shard_batch(packed, group=group, layout="llama3_zigzag")
        else:  # sharded as llama3 (the stream), run with llama3_zigzag
            _model("llama", "dtensor_ring")(**drhf.shard_batch(packed, group, "llama3"))
    return str(info.value)


@pytest.mark.parametrize(
    "what, text",
    [
        ("dense", "sequence length 30 is not divisible by 4"),
        ("packed", "document 0 (tokens [0, 5), length 5) is not a multiple of 4"),
        ("packed_in_model", "is not a multiple of 4"),
    ],
)
def test_llama3_zigzag_rejects(dist_pool, what, text):
    for message in dist_pool.run(_llama3_zigzag_rejects, 2, what=what):
        assert text in message and "llama3_zigzag" in message, message


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


def _documents_rejects(group, what: str) -> str:
    """layout="documents" places packed rows: what it cannot serve raises on every rank."""
    import dtensor_ring.hf as drhf

    input_ids = torch.randint(0, VOCAB, (1, SEQ))
    with pytest.raises(ValueError) as info:
        if what == "ulysses":
            drhf.setup(group=group, layout="documents", algorithm="ulysses")
        elif what == "padding":
            mask = torch.ones_like(input_ids)
            mask[0, -3:] = 0
            batch = {"input_ids": input_ids, "attention_mask": mask}
            drhf.shard_batch(batch, group=group, layout="documents")
        else:  # a dense batch sharded otherwise, run under "documents"
            drhf.setup(group=group, layout="documents")
            inputs = drhf.shard_batch({"input_ids": input_ids}, group=group, layout="zigzag")
            _model("llama", "dtensor_ring")(**inputs)
    return str(info.value)


@pytest.mark.parametrize(
    "what, text",
    [
        ("ulysses", "'all_gather'"),
        ("padding", "cannot hold padding"),
        ("dense", "needs the cu_seq_lens_q"),
    ],
)
def test_documents_rejects(dist_pool, what, text):
    for message in dist_pool.run(_documents_rejects, WORLD, what=what):
        assert text in message, message


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
    "s_aux and sinks": (
        {"s_aux": torch.zeros(H), "sinks": torch.ones(H)},
        ValueError,
        "got both s_aux=Tensor[4]",
    ),
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
    import dtensor_ring.integrations.transformers.attention as hf

    module = torch.nn.Module()
    module.is_causal = module_is_causal
    q, k = torch.randn(1, H, S_LOCAL, D), torch.randn(1, H // 2, keys, D)
    return hf.ring_attention_forward(module, q, k, k, kwargs.pop("attention_mask", None), **kwargs)


@pytest.fixture
def zigzag_setup(monkeypatch):
    """``setup(layout="zigzag")`` in this process, undone afterwards."""
    import dtensor_ring.integrations.transformers.attention as hf

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


@pytest.mark.parametrize("arch, keyword", [("gemma2", "softcap")])
def test_model_features_raise(zigzag_setup, arch, keyword):
    """Gemma 2 passes its softcap: it raises, naming the keyword, rather than training on
    another attention."""
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


# --- padding (Note [Padding], integrations/transformers/batch.py) and llama3 with B > 1 ---

PAD_SEQ = 24  # divides as zigzag needs on 2, 3 and 4 ranks


def _padded_batch(hole: bool) -> dict:
    """Six rows of ``PAD_SEQ`` tokens: left padding, right padding, none, one real token last
    (left), one real token first (right), and padding between real tokens (``hole``) or on
    both sides. Labels as the collators make them: -100 at padding; with a hole, also at the
    real token after it (a pad after a real token must not predict anything)."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (6, PAD_SEQ), generator=gen)
    mask = torch.ones(6, PAD_SEQ, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, 17:] = 0
    mask[3, :-1] = 0
    mask[4, 1:] = 0
    if hole:
        mask[5, 8:11] = 0
    else:
        mask[5, :2] = 0
        mask[5, 20:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    if hole:
        labels[5, 11] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _padded_vs_full(
    group, arch: str, cases: list[tuple[str, int, bool]], hole: bool = True
) -> dict[str, tuple[float, float, float]]:
    """For every ``(layout, rows, padded)``: the first ``rows`` rows of :func:`_padded_batch`
    (without its attention_mask unless ``padded``) with CP vs the model (sdpa) in one process
    with the same mask. Returns case -> (max logits error at tokens one process computes the
    same way: real ones and pads before the first real one, loss error, max gradient error
    summed over the ranks)."""
    import dtensor_ring.hf as drhf

    full = _padded_batch(hole)
    refs: dict[tuple[int, bool], tuple] = {}
    results = {}
    for layout, rows, padded in cases:
        batch = {k: v[:rows] for k, v in full.items()}
        if not padded:
            del batch["attention_mask"]
            batch["labels"] = batch["input_ids"].clone()
        if (rows, padded) not in refs:
            ref = _model(arch, _REFERENCE.get(arch, "sdpa"))
            ref_out = ref(**batch)
            ref_out.loss.backward()
            refs[rows, padded] = ref, ref_out
        ref, ref_out = refs[rows, padded]
        drhf.setup(group=group, layout=layout)
        model = _model(arch, "dtensor_ring")
        inputs = drhf.shard_batch(batch, group=group, layout=layout)
        assert (drhf.PADDING_MASK in inputs) == padded and "attention_mask" not in inputs
        with engines_used() as used:
            out = model(**inputs)
            out.loss.backward()
        _check_engine(layout, used)
        assert bool(out.logits.isfinite().all())  # no NaN in pad rows
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        logits = drhf.gather_outputs(out.logits.detach(), inputs, group=group, layout=layout)
        mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        exact = mask | (mask.cumsum(1) == 0)  # real tokens, pads before the first real one
        grad_err = 0.0
        for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            grad_err = max(grad_err, (grad - p_ref.grad).abs().max().item())
        results[f"{layout} B={rows} padded={padded}"] = (
            (logits - ref_out.logits.detach())[exact].abs().max().item(),
            abs(loss.item() - ref_out.loss.item()),
            grad_err,
        )
    return results


LAYOUTS_PADDED = [
    (layout, 6, True) for layout in ("ring", "zigzag", "stripe", "llama3", "llama3_zigzag")
]


@pytest.mark.parametrize(
    "world, arch, cases, hole",
    [
        (2, "llama", [*LAYOUTS_PADDED, ("llama3", 2, False), ("llama3", 3, True)], True),
        (3, "llama", [*LAYOUTS_PADDED, ("llama3", 2, True)], True),
        pytest.param(  # W = 4 in the slow tier (docs/design.md: the fast tier's time)
            4, "llama", [*LAYOUTS_PADDED, ("llama3", 3, False)], True, marks=pytest.mark.slow
        ),
        # sliding window of 5: padding at the ends of rows only
        (
            2,
            "mistral",
            [("zigzag", 6, True), ("llama3", 6, True), ("llama3_zigzag", 6, True)],
            False,
        ),
    ],
    ids=["w2", "w3", "w4", "w2-window"],
)
def test_padding_matches_one_process(dist_pool, world, arch, cases, hole):
    """Left, right, interior padding, rows without padding and rows of one real token in one
    batch: loss, gradients and logits equal the model in one process with the same mask, in
    every layout; llama3 with B = 2, 3 and 6 (its batch folded into the heads)."""
    for results in dist_pool.run(
        _padded_vs_full, world, arch=arch, cases=cases, hole=hole, timeout_s=120
    ):
        for case, errors in results.items():
            assert max(errors) < 1e-5, (case, errors)


def _llama3_fold_vs_reference(group, batch: int) -> tuple[float, ...]:
    """The transformers attention function on a dense "llama3" batch (a row per document, Note
    [llama3 with a batch]), with attention sinks, vs causal GQA attention of each row in one
    process (fp64): max errors of out, dq, dk, dv of this rank's tokens and of the sinks'
    gradient."""
    import dtensor_ring.integrations.transformers.attention as hf

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    heads, heads_kv, seq, dim = 4, 2, 12, 8
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (
        torch.randn(batch, h, seq, dim, generator=gen, dtype=torch.float64)
        for h in (heads, heads_kv, heads_kv, heads)
    )
    sinks = torch.linspace(-2.0, 2.0, heads, dtype=torch.float64)  # per head, every row
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref, _ = reference_attention(
        *(t.transpose(1, 2) for t in ref_in[:3]), causal=True, sinks=ref_in[3]
    )  # [B, S, H, D]
    ref.backward(dout.transpose(1, 2))
    piece = slice(rank * seq // world, (rank + 1) * seq // world)  # contiguous slices
    local = [t[:, :, piece].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    hf.setup(group=group, layout="llama3")
    positions = torch.arange(seq)[piece].expand(batch, -1)
    out, _ = hf.ring_attention_forward(
        torch.nn.Module(), *local, None, position_ids=positions, s_aux=local_sinks
    )  # [B, L, H, D]
    out.backward(dout[:, :, piece].transpose(1, 2))
    dist.all_reduce(local_sinks.grad, group=group)  # each rank's rows' share
    return (
        (out - ref[:, piece]).abs().max().item(),
        *(
            (t.grad - r.grad[:, :, piece]).abs().max().item()
            for t, r in zip(local, ref_in, strict=False)
        ),
        (local_sinks.grad - ref_in[3].grad).abs().max().item(),
    )


@pytest.mark.parametrize("world, batch", [(2, 3), (3, 2)])
def test_llama3_batch_rows_as_documents(dist_pool, world, batch):
    """Every row's queries meet that row's keys only, with the model's GQA mapping, forward and
    backward."""
    for errors in dist_pool.run(_llama3_fold_vs_reference, world, batch=batch):
        assert max(errors) < 1e-12, errors


_NOT_BIDIRECTIONAL = "the model is causal in this transformers version"


def _padding_rejects(group, what: str) -> str:
    """A padded batch that ring attention cannot honour: ValueError (returned) on every rank."""
    import dtensor_ring as dr
    import dtensor_ring.hf as drhf

    layout = "llama3" if what == "window_hole" else "zigzag"
    drhf.setup(group=group, layout=layout)
    batch = {k: v[[0, 1, 5]] for k, v in _padded_batch(hole=True).items()}  # left, right, hole
    arch = {"bidirectional": "gemma3_bidirectional", "window_hole": "mistral"}.get(what, "llama")
    model = _model(arch, "dtensor_ring")
    if what == "bidirectional" and model.model.layers[0].self_attn.is_causal:
        return _NOT_BIDIRECTIONAL  # transformers < 4.57: no bidirectional Gemma 3
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with pytest.raises(ValueError) as info:
        if what == "labels":  # right padding whose pads predict the pad tokens
            batch["labels"] = batch["input_ids"].clone()
            drhf.shard_batch(batch, group=group, layout=layout)
        elif what == "packed":  # padding in a packed row
            positions = torch.cat([torch.arange(8), torch.arange(PAD_SEQ - 8)])[None]
            batch = {k: v[:1] for k, v in batch.items()}
            drhf.shard_batch({**batch, "position_ids": positions}, group=group, layout=layout)
        else:
            inputs = drhf.shard_batch(batch, group=group, layout=layout)
            if what == "mask_in_call":  # the mask passed to the model too
                inputs["attention_mask"] = batch["attention_mask"]
            elif what == "sharded_mask":  # not via shard_batch: the layout's shard of the mask
                del inputs[drhf.PADDING_MASK]
                inputs["attention_mask"] = dr.shard_local(
                    batch["attention_mask"], layout, rank, world
                )
            elif what == "positions":  # the padded batch's mask with the unpadded positions
                inputs["position_ids"] = dr.shard_local(
                    torch.arange(PAD_SEQ).expand(3, -1), layout, rank, world
                )
            model(**inputs)
    return str(info.value)


@pytest.mark.parametrize(
    "what, text",
    [
        ("labels", "labels[1, 18] = "),
        ("packed", "position_ids absent or 0..S-1"),
        ("bidirectional", "bidirectional model"),
        ("window_hole", "rows [2]"),
        ("mask_in_call", "through dtensor_ring.hf.shard_batch"),
        ("sharded_mask", "through dtensor_ring.hf.shard_batch"),
        ("positions", "needs position_ids"),
    ],
)
def test_padding_rejects(dist_pool, what, text):
    messages = dist_pool.run(_padding_rejects, 2, what=what)
    if messages[0] == _NOT_BIDIRECTIONAL:
        pytest.skip(_NOT_BIDIRECTIONAL)  # the case cannot arise there
    for message in messages:
        assert "dtensor_ring" in message or "shard_batch" in message, message
        assert text in message, message


# --- every rank passing the whole sequence (Note [Whole sequence on every rank]) ------------


def _whole_sequence(group, what: str) -> str:
    """Every rank calls the model on the whole batch instead of ``shard_batch``'s output: the
    ValueError's message (returned), raised on every rank."""
    import dtensor_ring.hf as drhf

    layout = "llama3" if what == "packed" else "zigzag"
    drhf.setup(group=group, layout=layout)
    model = _model("llama", "dtensor_ring")
    batch = {k: v[:2] for k, v in _padded_batch(hole=False).items()}
    ids = batch["input_ids"]
    if what == "padded":  # shard_batch's padding mask, next to the whole sequence
        inputs = {"input_ids": ids, drhf.PADDING_MASK: batch["attention_mask"].bool()}
    elif what == "packed":  # a packed row with its global boundaries, as flash-attention-2 takes
        bounds = torch.tensor([0, 10, PAD_SEQ], dtype=torch.int32)
        positions = torch.cat([torch.arange(10), torch.arange(PAD_SEQ - 10)])[None]
        inputs = {"input_ids": ids[:1], "position_ids": positions}
        inputs |= {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}
    else:  # dense, the model's default positions
        inputs = {"input_ids": ids}
    with pytest.raises(ValueError) as info:
        model(**inputs)
    return str(info.value)


@pytest.mark.parametrize("what", ["padded", "packed", "dense"])
def test_whole_sequence_on_every_rank_raises(dist_pool, what):
    """Where the call carries the global length (the padding mask, the packed boundaries) a
    shard as long as it raises; a dense batch fails the positions check, whose message names
    the mistake. W = 1 holds the whole sequence legitimately (tested above)."""
    for message in dist_pool.run(_whole_sequence, 2, what=what):
        assert "every rank passed the whole sequence" in message, message
        assert "shard_batch" in message, message
        if what != "dense":
            assert f"got {PAD_SEQ} tokens on this rank of 2" in message, message
