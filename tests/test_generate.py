"""``dtensor_ring.hf.generate``: context-parallel generation (prefill by ring attention into a
sharded cache, pass-Q decoding steps) returns the tokens of one-process ``model.generate``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

VOCAB = 64


def _model(arch: str, attn_implementation: str = "eager"):
    """A tiny random model; llama and mistral (sliding_window=4, shorter than the prompts) in
    fp64, gpt-oss (sinks, sliding and full layers; its MoE needs fp32) in fp32."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=4)
    else:
        config = transformers.GptOssConfig(
            **common, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4
        )
    torch.manual_seed(0)
    dtype = torch.float32 if arch == "gpt_oss" else torch.float64
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    return model.eval()


def _generate_vs_one_process(
    group, arch: str, lengths: tuple[int, ...], layout: str = "zigzag"
) -> list[tuple]:
    """For each prompt length, greedy and sampled: ``(length, do_sample, tokens equal, ring
    attention calls, decoding steps)`` of ``dtensor_ring.hf.generate`` (prefill in
    ``layout``) vs ``model.generate``."""
    import dtensor_ring.hf as drhf
    import dtensor_ring.integrations.transformers.generate as gen_api

    calls = {"ring": 0, "decode": 0}
    ring, decode = gen_api.dense_attention, gen_api.decode_attention_func

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    gen_api.dense_attention = count("ring", ring)
    gen_api.decode_attention_func = count("decode", decode)
    drhf.setup(group=group)
    model = _model(arch)
    results = []
    try:
        for S in lengths:
            ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(S))
            for do_sample in (False, True):
                kwargs = dict(max_new_tokens=8, do_sample=do_sample, pad_token_id=None)
                torch.manual_seed(5)
                want = model.generate(ids, **kwargs)
                calls.update(ring=0, decode=0)
                torch.manual_seed(5)
                got = drhf.generate(model, ids, layout=layout, **kwargs)
                assert model.config._attn_implementation == "eager"  # restored
                results.append(
                    (S, do_sample, torch.equal(got, want), calls["ring"], calls["decode"])
                )
    finally:
        gen_api.dense_attention, gen_api.decode_attention_func = ring, decode
    return results


@pytest.mark.parametrize(
    "arch, world_size, lengths",
    [
        pytest.param(  # prompt lengths not multiples of W (mistral covers W = 3 fast)
            "llama", 3, (7, 13), marks=pytest.mark.slow
        ),
        pytest.param(  # 3 < W: no prefill, token by token; 11: 8 prefilled + 2 steps
            "llama", 4, (3, 11), marks=pytest.mark.slow
        ),
        ("mistral", 3, (13,)),  # sliding_window=4 < prompt: whole shards left behind
        ("gpt_oss", 2, (9,)),  # sinks, alternating sliding / full layers
    ],
)
def test_generate_matches_one_process(dist_pool, arch, world_size, lengths):
    layers = 2
    for per_rank in dist_pool.run(_generate_vs_one_process, world_size, arch=arch, lengths=lengths):
        for S, do_sample, equal, ring_calls, decode_calls in per_rank:
            assert equal, (arch, world_size, S, do_sample)
            prefill = S - 1 - (S - 1) % (2 * world_size)  # zigzag divides by 2W
            assert ring_calls == (layers if prefill else 0), (S, ring_calls)
            # the rest of the prompt, then 8 new tokens (the last one needs no forward)
            assert decode_calls == layers * (S - prefill + 7), (S, decode_calls)


@pytest.mark.slow
def test_generate_auto_layout(dist_pool):
    """Prefill with layout="auto" (zigzag's tokens; the cost model picks the prefill's
    algorithm): the tokens of one-process generation, sliding window included."""
    for per_rank in dist_pool.run(
        _generate_vs_one_process, 3, arch="mistral", lengths=(13,), layout="auto"
    ):
        for S, do_sample, equal, ring_calls, _ in per_rank:
            assert equal and ring_calls == 2, (S, do_sample, equal, ring_calls)


def _generate_warnings(group) -> list[str]:
    """What transformers logs at warning level during ``dtensor_ring.hf.generate`` of a batch
    without an ``attention_mask`` (as a user calls it)."""
    import logging

    import dtensor_ring.hf as drhf

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        drhf.setup(group=group)
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
        drhf.generate(_model("llama"), ids, max_new_tokens=2)
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]


def test_generate_is_quiet(dist_pool):
    """No advice from transformers to pass an attention mask: generate passes the all-ones
    mask of its unpadded batch (examples/generate_cp.py printed about 20 such lines)."""
    for messages in dist_pool.run(_generate_warnings, 2):
        assert messages == [], messages


def _rejects(group, what: str) -> str:
    import dtensor_ring.hf as drhf

    drhf.setup(group=group)
    model = _model("llama")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    kwargs: dict = dict(max_new_tokens=2)
    if what == "padded":
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        kwargs["attention_mask"] = mask
    elif what == "pad_token_in_prompt":
        kwargs.update(pad_token_id=int(ids[0, 4]), eos_token_id=VOCAB - 1)
    elif what == "beams":
        kwargs["num_beams"] = 2
    elif what == "cache":
        from transformers import DynamicCache

        kwargs["cache"] = DynamicCache()
    elif what == "no_cache":
        kwargs["use_cache"] = False
    elif what == "layout":
        kwargs["layout"] = "llama3"
    try:
        drhf.generate(model, ids, **kwargs)
    except ValueError as e:
        assert model.config._attn_implementation == "eager"
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "what, text",
    [
        ("padded", "does not support padded batches"),
        ("pad_token_in_prompt", "contains pad_token_id"),
        ("beams", "num_beams=2"),
        ("cache", "does not take cache"),
        ("no_cache", "use_cache=True"),
        ("layout", "llama3"),
    ],
)
def test_generate_rejects_what_it_cannot_serve(dist_pool, what, text):
    for message in dist_pool.run(_rejects, 2, what=what):
        assert text in message, message


def test_generation_attention_outside_generate():
    from dtensor_ring.integrations.transformers.generate import generation_attention_forward

    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="only inside dtensor_ring.hf.generate"):
        generation_attention_forward(torch.nn.Module(), q, q, q, None)
