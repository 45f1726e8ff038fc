"""Context-parallel generation with transformers: ``dtensor_ring.hf.generate`` and the
sharded cache it fills (Note [Context-parallel inference] in ``inference/kv_cache.py``).

Note [Generation through transformers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`generate` prefills the prompt itself and lets ``model.generate`` do everything else
(logits processors, sampling, stopping, streaming), as for a cache the user passes in:

    prompt x[0 .. S-1], the same on every rank
      |  1. prefill x[0 .. P-1] (P: the longest prefix the layout divides, P <= S - 1):
      |     model(shard_local(x[:P]), global position_ids, cache)   every layer: ring attention,
      |     ShardedCache keeps each rank's K/V shard and positions   each rank its own tokens
      |  2. x[P .. S-2], one token per forward (at most divisor - 1)  decoding steps
      v  3. model.generate(x, cache=cache, **kwargs): the cache reports the global length S - 1,
            so transformers runs x[S-1] and every new token as one-token forwards, the same on
            every rank; each layer stores the token's K/V on its owner rank and runs one
            pass-Q decoding step (dtensor_ring::decode_attention)

The attention function (:func:`generation_attention_forward`, registered as
``attn_implementation="dtensor_ring_generate"`` and set on the model only for the duration of
the call) tells the two kinds of forward apart by what the cache layer just stored: a
prefill shard (ring attention, the query tokens are this rank's shard) or one replicated
token (a decoding step over the local shard). Every rank computes the same logits, so the
same tokens come out everywhere (sampling: seed every rank alike; the ranks' outputs are
compared at the end).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...api.attend import dense_attention
from ...consistency import relay_errors
from ...inference.decode import decode_attention_func
from ...inference.kv_cache import split_prompt
from ...layouts import get_layout, shard_local
from ...resolve import check_bool, group_arg
from .attention import current_setup
from .keywords import check_model_keywords, sinks_kwarg, summary, window_kwarg

__all__ = ["GENERATE_ATTN_IMPLEMENTATION", "generate", "generation_attention_forward"]

GENERATE_ATTN_IMPLEMENTATION = "dtensor_ring_generate"


@dataclass
class _Generation:
    cache: Any
    group: dist.ProcessGroup | None
    group_name: str
    layout: str
    backend: str | None


_active: _Generation | None = None

#: Keywords the generation attention function reads (besides attention_mask, scaling, dropout).
_USED = frozenset({"is_causal", "sliding_window", "position_ids", "s_aux", "sinks"})


def generation_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function of :func:`generate` (Note [Generation through
    transformers]): ring attention for a prefill shard, a pass-Q decoding step otherwise.

    Args:
        module: the attention module (its ``layer_idx`` selects the cache layer).
        query: ``[B, H, S, D]``: a prefill shard (S local tokens) or one new token (S = 1, the
            same on every rank); key, value: ``[B, H_kv, S_kv, D]``, what the cache layer
            returned (this rank's shard).
        attention_mask: must be None (no mask function is registered for this
            implementation: causality and windows are computed here).
        kwargs: ``sliding_window`` (must agree with the cache layer's), ``s_aux`` / ``sinks``
            (gpt-oss attention sinks), ``is_causal`` (True or None), ``position_ids``; the
            harmless keywords and features-off of ``dtensor_ring.hf``'s attention function.

    Returns:
        ``(out [B, S, H, D], None)``.
    """
    state = _active
    if state is None:
        raise RuntimeError(
            f'attn_implementation="{GENERATE_ATTN_IMPLEMENTATION}" runs only inside '
            "dtensor_ring.hf.generate"
        )
    layer = state.cache.layers[module.layer_idx]
    with relay_errors(state.group_name, "generate"):
        check_model_keywords("dtensor_ring generation attention", kwargs, _USED, dropout)
        sinks = sinks_kwarg(kwargs)
        if attention_mask is not None:
            raise ValueError(
                f"dtensor_ring generation attention cannot honour attention_mask="
                f"{summary(attention_mask)}; it computes causality and windows itself"
            )
        is_causal = kwargs.get("is_causal")
        causal = check_bool(
            "is_causal", getattr(module, "is_causal", True) if is_causal is None else is_causal
        )
        if not causal:
            raise ValueError("dtensor_ring generation serves causal attention only")
        window = _layer_window(kwargs.get("sliding_window"), layer)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if layer.last_update == "prefill":
        out, _ = dense_attention(
            q,
            k,
            v,
            layout=state.layout,
            algorithm=None,
            softmax_scale=scaling,
            causal=True,
            window_size=window,
            group=state.group,
            backend=state.backend,
            sinks=sinks,
            return_lse=False,
            backward=False,  # inference: the choice prices a forward
        )
        return out, None
    out = decode_attention_func(
        q,
        k,
        v,
        scaling,
        group=state.group,
        backend=state.backend,
        window_size=window,
        cache_positions=layer.positions,
        query_position=layer.last_position,
        sinks=sinks,
    )
    return out, None


def _layer_window(sliding_window: object, layer) -> tuple[int, int]:
    """flash-attn's window of the model's ``sliding_window`` keyword, checked against what
    the cache layer keeps."""
    left, right = window_kwarg(sliding_window)
    right = 0  # causal
    kept = layer.index.sliding_window
    if kept is not None and (left < 0 or left != kept - 1):
        raise ValueError(
            f"dtensor_ring generation: the model passed sliding_window={sliding_window!r} but "
            f"the cache layer keeps the keys of sliding_window={kept} (from the model config)"
        )
    return left, right


#: generate keywords that the sharded cache cannot serve, and why.
_UNSUPPORTED = {
    "cache": "generate makes its own sharded cache",
    "past_key_values": "generate makes its own sharded cache",
    "cache_implementation": "generate makes its own sharded cache",
    "assistant_model": "assisted decoding runs several tokens per forward",
    "prompt_lookup_num_tokens": "assisted decoding runs several tokens per forward",
    "prefill_chunk_size": "the prefill is ring attention over the whole prompt",
    "inputs_embeds": "pass input_ids",
    "position_ids": "positions are 0 .. S-1 in every row",
}


def _check_generate_args(model, input_ids: object, kwargs: dict) -> None:
    """Reject, before any communication, what :func:`generate` cannot serve exactly."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer tensor [B, S], got {summary(input_ids)}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must hold at least one token, got {summary(input_ids)}")
    for name, why in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"dtensor_ring.hf.generate does not take {name}: {why}")
    config = kwargs.get("generation_config") or model.generation_config
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name, getattr(config, name, None))
        if value not in (None, 1):
            raise ValueError(
                f"dtensor_ring.hf.generate serves one sequence per prompt, got {name}={value}"
            )
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        raise ValueError("dtensor_ring.hf.generate needs use_cache=True (the cache is sharded)")
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must be [B, S] like input_ids, got {summary(mask)}")
        if not bool(mask.all()):
            raise ValueError(
                "dtensor_ring.hf.generate does not support padded batches (an attention_mask "
                "with zeros): generate prompts of different lengths in separate calls"
            )
    pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if mask is None and pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        raise ValueError(
            f"the prompt contains pad_token_id={pad}, from which transformers would infer a "
            "padding mask: dtensor_ring.hf.generate does not support padded batches; pass "
            "an all-ones attention_mask if those tokens are not padding"
        )


def generate(
    model,
    input_ids: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    **generate_kwargs,
):
    """``model.generate(input_ids, **generate_kwargs)`` with the KV cache sharded across
    ``group`` (Note [Generation through transformers]).

    Args:
        model: a transformers causal LM, the same weights on every rank (llama, mistral,
            qwen2, gpt-oss ...: full and sliding-window attention layers, sinks).
        input_ids: ``[B, S]``, the full prompts, the same on every rank, all of length S (no
            padding). Any S >= 1: the prefill takes the longest prefix of ``x[:S-1]`` that
            ``layout`` divides over the group (Note [Context-parallel inference]); a prompt
            shorter than that (e.g. shorter than the group) runs token by token.
        group: the context-parallel group (default: :func:`dtensor_ring.hf.setup`'s, else the
            default group); ``setup``'s ``backend`` is used too.
        layout: the dense layout of the prefill ("zigzag", "ring", "stripe", or "auto":
            zigzag's tokens, the prefill's algorithm chosen per call).
        generate_kwargs: ``model.generate``'s (``max_new_tokens``, ``do_sample``, ``top_k``,
            ``attention_mask`` all ones (the default: the batch has no padding),
            ``return_dict_in_generate`` ...). Sampling: seed every rank alike
            (``torch.manual_seed``).

    Returns:
        What ``model.generate`` returns, the same on every rank.

    Raises:
        ValueError: before any communication, on every rank: padded batches (an
            ``attention_mask`` with zeros, or pad tokens in the prompt), beams or several
            sequences per prompt, assisted decoding, a cache or ``cache_implementation``,
            ``inputs_embeds``, ``use_cache=False``, ``prefill_chunk_size``, a non-dense
            layout, model features the attention cannot honour (dropout, softcap, ...).
        RuntimeError: the ranks produced different tokens (e.g. sampling with different seeds).
    """
    global _active
    configured = current_setup()
    if group is None and configured is not None:
        group = configured.group
    backend = configured.backend if configured is not None else None
    name, world = group_arg(group)
    with relay_errors(name, "generate"):
        _check_generate_args(model, input_ids, generate_kwargs)
        get_layout(layout, "dense")
        if _active is not None:
            raise RuntimeError("dtensor_ring.hf.generate is already running")
    if generate_kwargs.get("attention_mask") is None:  # no padding (checked): say so, as
        # transformers asks of a batch (else it warns at every call that the mask is unset)
        generate_kwargs["attention_mask"] = torch.ones_like(input_ids)
    from .cache import ShardedCache

    _register()
    rank = dist.get_rank(group)
    B, S = input_ids.shape
    prefill_len = split_prompt(S - 1, layout, world)
    cache = ShardedCache(model.config, group)
    previous = model.config._attn_implementation
    model.set_attn_implementation(GENERATE_ATTN_IMPLEMENTATION)
    _active = _Generation(cache, group, name, layout, backend)
    try:
        forward_kwargs = {}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            forward_kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            if prefill_len:
                positions = shard_local(torch.arange(prefill_len), layout, rank, world, seq_dim=0)
                local_ids = shard_local(input_ids[:, :prefill_len], layout, rank, world, seq_dim=1)
                with cache.prefilling(positions, prefill_len):
                    model(
                        input_ids=local_ids,
                        position_ids=positions.to(input_ids.device).expand(B, -1),
                        cache=cache,
                        use_cache=True,
                        **forward_kwargs,
                    )
            for t in range(prefill_len, S - 1):  # what the layout cannot divide: token by token
                model(
                    input_ids=input_ids[:, t : t + 1],
                    position_ids=torch.full((B, 1), t, device=input_ids.device),
                    cache=cache,
                    use_cache=True,
                    **forward_kwargs,
                )
        result = model.generate(input_ids, cache=cache, **generate_kwargs)
    finally:
        _active = None
        model.set_attn_implementation(previous)
    _check_same_tokens(result, group, name)
    return result


def _check_same_tokens(result, group, name: str) -> None:
    """Raise on every rank if the ranks generated different tokens."""
    sequences = result if isinstance(result, Tensor) else result.sequences
    world = dist.get_world_size(group)
    if world == 1:
        return
    shape = torch.tensor(sequences.shape, device=sequences.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    same = all(torch.equal(s, shape) for s in shapes)
    if same:
        tokens = [torch.empty_like(sequences) for _ in range(world)]
        dist.all_gather(tokens, sequences.contiguous(), group=group)
        same = all(torch.equal(t, sequences) for t in tokens)
    if not same:
        raise RuntimeError(
            "dtensor_ring.hf.generate: the ranks generated different tokens; with sampling, "
            "seed every rank alike (torch.manual_seed) before the call"
        )


def _register() -> None:
    """Register the generation attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(GENERATE_ATTN_IMPLEMENTATION, generation_attention_forward)
