"""Context-parallel generation: a prompt's KV cache sharded across the ranks.

    torchrun --nproc-per-node 4 examples/generate_cp.py --verify        # CPU (gloo), ~10 s

Every rank holds the whole prompt and the same (tiny, random) Llama-style model.
``dtensor_ring.hf.generate`` prefills the prompt with zigzag ring attention, each rank keeping
its shard of every layer's K/V cache, then generates token by token: every rank computes the
new token, its K/V go to one rank (round robin), and each attention layer merges the ranks'
partial results exactly (docs/inference.md). ``--verify`` checks the tokens against
``model.generate`` in one process (greedy, then sampling with the same seed); ``--window``
gives every layer a sliding window (Mistral).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH

import dtensor_ring.hf as drhf  # noqa: E402


def build_model(window: int | None, vocab: int):
    import transformers

    config_class = transformers.MistralConfig if window else transformers.LlamaConfig
    extra = {"sliding_window": window} if window else {}
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=1024,
        **extra,
    )
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=101, help="any length (not a multiple of W)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--window", type=int, default=None, help="sliding window (Mistral)")
    p.add_argument("--verify", action="store_true", help="compare with one-process generate")
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 256
    model = build_model(a.window, vocab)
    prompt = torch.randint(
        0, vocab, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(1)
    )
    drhf.setup()  # the default group is the context-parallel group
    ok = True
    for do_sample in (False, True):
        # a full attention mask (no padding) tells transformers the batch is not padded, which
        # it would otherwise warn about for every call
        kwargs = dict(
            max_new_tokens=a.new_tokens,
            do_sample=do_sample,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=None,
        )
        torch.manual_seed(7)  # sampling: every rank alike
        tokens = drhf.generate(model, prompt, layout="zigzag", **kwargs)
        new = tokens[:, a.prompt_len :]
        if rank == 0:
            print(f"{'sampled' if do_sample else 'greedy'} on {world} ranks: {new[0].tolist()}")
        if a.verify:
            torch.manual_seed(7)
            want = model.generate(prompt, **kwargs)
            equal = torch.equal(tokens, want)
            ok &= equal
            if rank == 0:
                print(
                    f"verify ({'sampled' if do_sample else 'greedy'}): one-process generate "
                    f"{'equal' if equal else 'DIFFERS'}"
                )
    if a.verify and rank == 0:
        print("verify: OK" if ok else "verify: FAILED")
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
