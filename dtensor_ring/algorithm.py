"""Which algorithm moves K/V for a call: the one place it is decided.

Note [Layouts and algorithms]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two settings, as PyTorch keeps a load balancer apart from a rotate method:

    layout=     where the tokens live    ring | zigzag | stripe | llama3 (packed stream) | yours
    algorithm=  how K/V reach them       "ring" (point-to-point) | "all_gather" | "ulysses"
                                         | "auto" (one of those, per call, by a cost model)

Every pair that can run, runs; the others raise ``ValueError`` before any communication:

                ring               all_gather                      ulysses
    ring        any mask           any mask (dense, documents)     any mask (dense)
    zigzag      causal             any mask (dense, documents)     any mask (dense)
    stripe      causal             -- (runs of stride W)           any mask (dense)
    llama3      --                 the packed stream               --
    placed      any mask           the keys needed (documents)     --
                (document_layout: the ring, or Note [Gathering what placed documents need])

    "auto": zigzag's tokens only (the policy prices zigzag's plans; Note [Choosing ring,
    all-gather or Ulysses] in ``schedule/policy.py``); the door's candidates.

Two layout names are aliases of a layout and an algorithm, kept as documented shorthands:
"llama3_zigzag" = zigzag + "all_gather", "auto" = zigzag + "auto". An explicit algorithm (the
``algorithm=`` argument, or a door that runs one algorithm, such as Ulysses') overrides an
alias's: the alias then names zigzag's tokens; but a door that runs one algorithm rejects
"auto" without ``algorithm=`` (a choice was asked for where none is made).

    front door --(layout, algorithm)--> route(): alias -> (layout, algorithm); "auto" -> the
        |                                        policy's pick; the pair checked
        v
    Route(algorithm, layout, heads_k_stride) --> resolve_call (the spec) --> that algorithm's op

"auto" decides from what every rank shares by construction (the global shape, dtype, device
type, mask, ``backend=``, the group's size, the door): not from ``requires_grad``, grad mode
or the deterministic flag, which one rank may set alone. It prices a forward and a backward
unless the door serves inference (prefill), where none runs. Under ``torch.compile`` the
choice is a trace-time constant.
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

import torch

from .consistency import relay_errors
from .kernels import get_kernel
from .layouts import Layout, alias_algorithm, get_layout, home_layout, order_layout
from .resolve import (
    Call,
    check_backend_arg,
    check_bool,
    check_qkv_tensors,
    check_window_size,
    normalize_window,
    placement,
    select_backend,
)
from .schedule.policy import AlgorithmChoice, choose_algorithm, get_machine

Algorithm = Literal["ring", "all_gather", "ulysses", "auto"]  # ALGORITHMS
DENSE_ALGORITHMS: tuple[str, ...] = ("ring", "all_gather", "ulysses")
VARLEN_ALGORITHMS: tuple[str, ...] = ("ring", "all_gather")


class Route(NamedTuple):
    """How one call runs: ``algorithm`` ("ring", "all_gather" or "ulysses"; never "auto"),
    the registered ``layout`` whose plan or order it runs (never an alias; "ring" for a
    maskless call the door may run in any order), and ``heads_k_stride`` (K/V heads per
    all-gather step; 0 for the other algorithms)."""

    algorithm: str
    layout: str
    heads_k_stride: int


def check_pair(lay: Layout, algorithm: str, varlen: bool = False) -> None:
    """``ValueError`` unless ``algorithm`` can run tokens placed by ``lay`` (the table of Note
    [Layouts and algorithms]) in a ``varlen`` call or a dense one; the mask is checked by the
    call resolution."""
    if lay.varlen == "placed":
        algorithms = VARLEN_ALGORITHMS if varlen else ("ring",)
        if algorithm not in algorithms:
            raise ValueError(
                f"layout {lay.name!r} (documents placed by dtensor_ring.document_layout) runs "
                f"algorithm={' or '.join(map(repr, algorithms))} in "
                f"{'a varlen' if varlen else 'a dense'} call, got {algorithm!r}"
            )
        return
    if algorithm == "all_gather":
        if lay.stride(2) != 1 or lay.varlen is None:
            raise ValueError(
                f"algorithm='all_gather' needs a layout whose ranks hold runs of consecutive "
                f"tokens (ring, zigzag); layout={lay.name!r} does not: use algorithm='ring' "
                "or 'ulysses'"
            )
    elif lay.varlen == "stream":
        raise ValueError(
            f"layout={lay.name!r} (the packed stream) runs only algorithm='all_gather' "
            "(llama3_flash_attn_varlen_func)"
        )
    elif algorithm == "auto" and home_layout(lay) != "zigzag":
        raise ValueError(
            f"algorithm='auto' chooses for zigzag-placed tokens (the cost model prices zigzag's "
            f"plans); with layout={lay.name!r} pass algorithm='ring', 'all_gather' or 'ulysses'"
        )


def route(
    call: Call,
    algorithm: str | None,
    *,
    door: str,
    varlen: bool = False,
    allowed: tuple[str, ...] = DENSE_ALGORITHMS,
    backward: bool = True,
    order_free: bool = False,
    heads_k_stride: object = 1,
) -> Route:
    """The algorithm and layout ``call`` runs (Note [Layouts and algorithms]); every door
    that takes ``layout=`` calls it once, before :func:`~dtensor_ring.resolve.resolve_call`.

    Args:
        call: the call (its layout, mask, group and ``backend``; q, k, v ``[B, S_local,
            H(_kv), D]``, or packed for ``varlen``, are read only for "auto", which prices
            packed documents as one row of ``T_local * W`` tokens).
        algorithm: the caller's ``algorithm=`` (None: the layout alias's, else "ring").
        door: the front door's name (errors in the consistency mode).
        allowed: the algorithms the door can run ("auto" is allowed where more than one is).
        backward: "auto" counts a backward (False: an inference door).
        order_free: the door runs maskless calls in any order (transformers,
            ``context_parallel``: a bidirectional model on zigzag shards): the ring then runs
            the order-free contiguous plan.
        heads_k_stride: the all-gather's K/V heads per step, as the caller gave it (checked by
            the all-gather's resolution; "auto" takes the policy's).
    """
    choosing = allowed + ("auto",) if len(allowed) > 1 else allowed
    with relay_errors((call.group_name,), door):
        lay, algorithm = placement(call.layout, algorithm, allowed=choosing)
        check_pair(lay, algorithm, varlen)
        stride = 0
        if algorithm == "auto":
            choice = auto_choice(
                call.replace(layout=lay),
                varlen=varlen,
                candidates=allowed,
                backward=backward,
            )
            algorithm, stride = choice.algorithm, choice.heads_k_stride
            name = "ring" if choice.layout == "ring" else home_layout(lay)
            return Route(algorithm, name, stride)
        if algorithm == "all_gather":
            stride = heads_k_stride
        # an alias names the caller's tokens in messages; "auto" with an algorithm is zigzag's
        name = home_layout(lay) if alias_algorithm(lay.name) == "auto" else lay.name
        # (placed documents: a rank's local boundaries are its own, the order-free plan's
        # are every document's share; they keep their own plan)
        if algorithm == "ring" and order_free and not (varlen and lay.varlen == "placed"):
            causal, window = check_bool("causal", call.causal), call.window_size
            name = order_layout(name, causal, check_window_size(window))
    return Route(algorithm, name, stride)


def auto_choice(
    call: Call,
    *,
    varlen: bool = False,
    candidates: tuple[str, ...] = DENSE_ALGORITHMS,
    backward: bool = True,
) -> AlgorithmChoice:
    """The policy's pick (Note [Choosing ring, all-gather or Ulysses]) for this call among
    ``candidates`` whose kernel can run it (the all-gather needs a varlen kernel), remembered
    per shape and machine and logged once (``dtensor_ring.policy``, INFO); the arguments it
    reads checked as the call resolution checks them (which runs next, on the chosen
    algorithm). ``call`` as :func:`route`'s; ``backward``: price a backward too."""
    q, k, v, world_size = call.q, call.k, call.v, call.world_size
    lay = get_layout(call.layout)
    check_qkv_tensors(q, k, v, seq_dims="T_local" if varlen else "B, S_local")
    tokens = q.shape[0] if varlen else q.shape[1]
    if not varlen:  # the divisibility error names the caller's layout, not the chosen one
        lay.check_local_length(tokens, world_size)
    causal, window = normalize_window(
        check_window_size(call.window_size), check_bool("causal", call.causal), tokens * world_size
    )
    backend = check_backend_arg(call.backend)
    kernels, unable = {}, None
    for name in candidates:  # the kernel each would run (deterministic or not: a rank-local
        try:  # flag must not change the choice); those with none are dropped
            kernels[name] = select_backend(
                q,
                k,
                backend,
                varlen=varlen or name == "all_gather",
                window=window is not None,
                head_split=world_size if name == "ulysses" else 1,
            )
        except ValueError as e:
            unable = e
    if not kernels:  # what the chosen door would say
        raise unable
    return _choose_algorithm(
        tokens * world_size,
        world_size,
        heads=q.shape[-2],
        kv_heads=k.shape[-2],
        head_dim=q.shape[-1],
        batch=1 if varlen else q.shape[0],
        itemsize=q.element_size(),
        causal=causal,
        window=window,
        backward=backward,
        candidates=tuple(kernels),
        speeds={name: get_kernel(b).relative_speed for name, b in kernels.items()},
    )


# Choices made so far: choose_algorithm's arguments and the machine -> choice (pricing a call
# walks the plan's blocks: ~0.2 ms of host time, as much as the rest of a small call).
_CHOICES: dict[tuple, AlgorithmChoice] = {}


@torch.compiler.assume_constant_result  # a trace-time constant, as the backend choice
def _choose_algorithm(seq_len: int, world_size: int, **kwargs) -> AlgorithmChoice:
    """:func:`choose_algorithm`, remembered per arguments and machine; each new choice is
    logged once (``logging.getLogger("dtensor_ring.policy")``, INFO)."""
    speeds = tuple(sorted(kwargs.pop("speeds").items()))
    key = (seq_len, world_size, speeds, tuple(sorted(kwargs.items())), get_machine())
    choice = _CHOICES.get(key)
    if choice is None:
        choice = choose_algorithm(seq_len, world_size, speeds=dict(speeds), **kwargs)
        _CHOICES[key] = choice
        logging.getLogger("dtensor_ring.policy").info("algorithm='auto' chose %s", choice.reason)
    return choice


def clear_algorithm_choices() -> None:
    """Forget the choices of ``algorithm="auto"`` remembered so far."""
    _CHOICES.clear()
