"""The keyword policy of our transformers attention functions: every keyword model code passes
is used or rejected (:func:`check_model_keywords`), and the readers of the ones they share
(``sliding_window``, attention sinks). Used by :mod:`.attention`, :mod:`.generate` and
ring-flash-attention's adapter (:mod:`dtensor_ring.compat.rfa_hf_adapter`)."""

from __future__ import annotations

from torch import Tensor

#: Keywords that transformers' model code passes to attention functions and that cannot change
#: what this one computes, whatever their value.
HARMLESS = frozenset(
    {
        # the module fills its KV cache before calling attention (models pass use_cache=True
        # even in training); key/value hold this call's tokens only (checked: as many as queries)
        "use_cache",
        # flash-attn's kernel sizes for cu_seq_lens_q/k: the varlen path derives its own
        "max_length_q",
        "max_length_k",
        # loss and output arguments (TransformersKwargs) that the model forwards to every layer
        "num_items_in_batch",
        "shift_labels",
        "output_hidden_states",
        "output_router_logits",
    }
)

RUN_WITHOUT = 'run the model without dtensor_ring (e.g. attn_implementation="eager")'
_WITH_SINKS = 'attn_implementation="dtensor_ring" (dtensor_ring.hf.setup) supports them'

#: Keywords of features this function does not implement: name -> (the values besides None that
#: mean the feature is off, why another value is rejected and what to do).
FEATURE_OFF: dict[str, tuple[tuple[object, ...], str]] = {
    "s_aux": ((), f"attention sinks (gpt-oss) are not supported here; {_WITH_SINKS}"),
    "sinks": ((), f"attention sinks are not supported here; {_WITH_SINKS}"),
    "softcap": (
        (0,),
        "logit softcapping (Gemma 2) is not supported; set the config's "
        f"attn_logit_softcapping=None, or {RUN_WITHOUT}",
    ),
    "head_mask": ((), "per-head masks are not supported; drop head_mask"),
    "position_bias": ((), f"additive position biases (T5-style) are not supported; {RUN_WITHOUT}"),
    "output_attentions": (
        (False,),
        "ring attention never forms the attention weights; pass output_attentions=False",
    ),
    "seq_idx": (
        (),
        "the packed documents come from cu_seq_lens_q/k (dtensor_ring.hf.shard_batch); "
        "drop seq_idx",
    ),
}


def summary(value: object) -> str:
    """``value`` for a message: a tensor's shape and dtype, a short repr of anything else."""
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model_keywords(who: str, kwargs: dict, used: frozenset[str], dropout: object) -> None:
    """The checks every transformers attention function of ours makes of what model code
    passes: a keyword neither ``used`` nor harmless (TypeError), a feature that must be off
    (:data:`FEATURE_OFF`), dropout (a number, 0). ``who`` starts the messages."""
    unknown = sorted(set(kwargs) - used - HARMLESS - set(FEATURE_OFF))
    if unknown:
        given = ", ".join(f"{name}={summary(kwargs[name])}" for name in unknown)
        raise TypeError(
            f"{who} got unknown keyword(s) {given}; it cannot tell whether ignoring them would "
            f"change the result: drop them if the model does not need them, or {RUN_WITHOUT}"
        )
    for name, (off, why) in FEATURE_OFF.items():
        value = None if name in used else kwargs.get(name)
        if value is not None and (isinstance(value, Tensor) or value not in off):
            raise ValueError(f"{who} got {name}={summary(value)}: {why}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"{who}: dropout must be a float, got {summary(dropout)}")
    if dropout != 0:  # transformers passes the config's attention_dropout in training mode
        raise ValueError(
            f"{who} does not support dropout={dropout}; set the model config's attention_dropout "
            "to 0"
        )


def sinks_kwarg(kwargs: dict) -> Tensor | None:
    """The attention-sink logits a model passes (gpt-oss: ``s_aux``; ``sinks`` also read),
    or None; both given must be the same tensor."""
    s_aux, sinks = kwargs.get("s_aux"), kwargs.get("sinks")
    if s_aux is not None and sinks is not None and s_aux is not sinks:
        raise ValueError(
            f"dtensor_ring attention got both s_aux={summary(s_aux)} and "
            f"sinks={summary(sinks)}; pass the attention-sink logits once"
        )
    return sinks if s_aux is None else s_aux


def window_kwarg(sliding_window: object) -> tuple[int, int]:
    """flash-attn's ``window_size`` of transformers' ``sliding_window`` (None: no window)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(
            "dtensor_ring attention: sliding_window must be a positive int or None, got "
            f"{summary(sliding_window)}"
        )
    if sliding_window <= 0:
        raise ValueError(
            f"dtensor_ring attention: sliding_window={sliding_window} must be positive (the "
            "number of latest keys a query sees, itself included), or None for no window"
        )
    # transformers' masks: key j visible to query i iff i - sliding_window < j <= i
    return (sliding_window - 1, 0)
