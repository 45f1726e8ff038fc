"""The ``ring_sdpa`` scope: a ``TorchFunctionMode`` plus the aten-op handlers, installed and
removed together (Note [How SDPA on DTensors reaches ring attention])."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ..._compat import dtensor as _dtensor_compat
from ..._compat import python_modes_active
from ...algorithm import Algorithm
from ...layouts import LayoutName, get_layout
from ...resolve import check_window_size, placement
from ..recompute import recompute_context
from .eager import eager_sdpa
from .function import Mode, SDPAConfig
from .handlers import FORWARD_REACHED, aten_handlers
from .placements import check_sdpa_args, sdpa_algorithm


# --------------------------------------------------------------------------------------------
# The scope.
# --------------------------------------------------------------------------------------------
@torch.compiler.assume_constant_result  # the getters are not traceable; read at trace time
def _enabled_fused_backends() -> tuple[SDPBackend, ...]:
    """The fused SDPA backends enabled now (FLASH_ATTENTION covers the CPU flash kernel).

    Keeping the user's choice (e.g. ``sdpa_kernel(CUDNN_ATTENTION)``) matters: a compiled
    recompute under activation checkpointing runs without our mode, so it must pick the same
    aten op.
    """
    flags = (
        (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()),
    )
    return tuple(backend for backend, enabled in flags if enabled)


_SDPA_FUNCS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


class _RingSDPAMode(TorchFunctionMode):
    """Checks SDPA calls on DTensors and keeps them on a fused kernel (see the Note above)."""

    def __init__(self, config: SDPAConfig):
        super().__init__()
        self.config = config

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA_FUNCS:
            return func(*args, **kwargs)
        call = _bind_sdpa(*args, **kwargs)
        if not any(isinstance(call[name], DTensor) for name in ("query", "key", "value")):
            return func(*args, **kwargs)
        cp_dim, group_name = check_sdpa_args(
            *(call[name] for name in _CHECKED), self.config.layout, self.config.algorithm
        )

        def eager() -> torch.Tensor:  # Note [Eager SDPA on DTensors]
            return eager_sdpa(
                self.config, cp_dim, group_name, call["query"], call["key"], call["value"],
                call["is_causal"], call["scale"],
            )  # fmt: skip

        if torch.compiler.is_compiling() or python_modes_active():
            out = _through_handlers(func, args, kwargs, eager)
        else:
            out = eager()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(_backward_hook, self.config))
        return out


def _through_handlers(func, args: tuple, kwargs: dict, eager):
    """SDPA itself, on a fused op (among those enabled) that our handler catches: never its
    math fallback, which would decompose into sharded matmuls. The fused ops need a unit last
    stride: copy where not.

    Where SDPA finds no fused kernel for the inputs (before reaching our handler), the call
    runs ``eager()``, the eager route: the same engine calls (Note [Eager SDPA on DTensors]),
    and so the same collectives as the ranks that took it; raising SDPA's error instead would
    leave them waiting for this rank, as the route depends on facts of its own (a Python mode,
    the backend flags). Compiled code, the same on every rank, gets SDPA's error."""
    args = tuple(
        t.contiguous() if isinstance(t, DTensor) and t.stride(-1) != 1 else t for t in args
    )
    for name in ("query", "key", "value"):
        t = kwargs.get(name)
        if isinstance(t, DTensor) and t.stride(-1) != 1:
            kwargs[name] = t.contiguous()

    def sdpa():
        with sdpa_kernel(list(_enabled_fused_backends())):
            return func(*args, **kwargs)

    if torch.compiler.is_compiling():
        return sdpa()
    reached: list = []
    token = FORWARD_REACHED.set(reached)
    try:
        return sdpa()
    except RuntimeError:
        if reached:  # raised at or below our handler: not SDPA's kernel choice
            raise
    finally:
        FORWARD_REACHED.reset(token)
    return eager()


_CHECKED = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "enable_gqa")


def _bind_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
) -> dict:
    """SDPA's arguments by name (its signature; a wrong call raises ``TypeError``)."""
    return {
        "query": query, "key": key, "value": value, "attn_mask": attn_mask,
        "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa,
    }  # fmt: skip


# How many ``ring_sdpa`` scopes of each configuration are open, in any thread: the aten
# handlers they install are process-wide, and autograd may run a backward on its own threads.
_OPEN_SCOPES: collections.Counter[SDPAConfig] = collections.Counter()


def _require_scope(config: SDPAConfig, what: str) -> None:
    """The ``what`` ("backward", "recomputation") of SDPA in a scope must run in a scope of the
    same configuration. Outside one, the fused op's backward would run without our handler:
    an error on CPU (no sharding strategy); on CUDA, where DTensor has strategies of its own
    for these ops, a computation that knows nothing of the layout (zigzag and stripe shards
    are not contiguous)."""
    if _OPEN_SCOPES[config] == 0:
        raise ValueError(
            f"the {what} of SDPA on DTensors ran outside dtensor_ring.ring_sdpa("
            f"layout={config.layout!r}, algorithm={config.algorithm!r}, ...): enter the scope "
            "around the forward *and* the backward (e.g. the whole training step; activation "
            "checkpointing recomputes the forward during the backward)"
        )


def _backward_hook(config: SDPAConfig, grad: torch.Tensor) -> None:
    """Gradient hook on the output of SDPA in a scope (:func:`_require_scope`)."""
    _require_scope(config, "backward")


@contextlib.contextmanager
def _recomputation(config: SDPAConfig) -> Iterator[None]:
    """A checkpoint's recomputation of a forward in a scope (Note [Recomputation outside the
    scope]): in a scope of the same configuration, with the mode back on (the backward runs
    without it) and the scope's layout for the sharding helpers (also on autograd's threads);
    outside one, ``ValueError`` before anything runs."""
    _require_scope(config, "recomputation")
    token = _SCOPE_LAYOUT.set(config.layout)
    try:
        with _RingSDPAMode(config):
            yield
    finally:
        _SCOPE_LAYOUT.reset(token)


@contextlib.contextmanager
def ring_sdpa(
    layout: LayoutName = "ring",
    backend: str | None = None,
    mode: Mode | None = None,
    window_size: tuple[int, int] = (-1, -1),
    algorithm: Algorithm | None = None,
) -> Iterator[None]:
    """Scope in which SDPA on sequence-sharded DTensors runs ring attention.

    Inside it, ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...,
    enable_gqa=...)`` with DTensor ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]`` placed
    ``Shard(2)`` over one mesh dim (``Replicate()``/``Shard(0)`` on the others) returns
    ring attention as a ``[B, H, S, D]`` DTensor with the same placements, differentiable.
    See :func:`scaled_dot_product_ring_attention` for the accepted arguments and
    Note [How SDPA on DTensors reaches ring attention] for the mechanism. SDPA on plain
    tensors is left alone.

    Enter it around the whole training step, forward *and* backward (activation checkpointing
    recomputes attention during backward: outside the scope, ``ValueError``), outside
    ``torch.compile``'d functions. Everything installed is removed on exit, also on an
    exception. Scopes nest (the innermost wins).

    Args:
        layout: "ring", "zigzag", "stripe" or "llama3_zigzag": how the DTensors' sequence
            shards are laid out (Note [Sequence layouts]); the ring algorithm needs
            ``is_causal=True`` for zigzag and stripe. "llama3_zigzag" holds zigzag's tokens
            and all-gathers K/V (``dtensor_ring::llama3_attention``) for every mask instead of
            passing them around the ring (Note [All-gather layouts on DTensors]); with another
            ``algorithm`` it is zigzag's token order. The default,
            "ring", is the contiguous shards that ``distribute_tensor(x, mesh, [Shard(2)])``
            makes; a load-balanced order is asked for here, and :func:`shard_sequence` inside
            the scope shards in it by default. "auto" holds zigzag's tokens and chooses the
            ring, the all-gather or Ulysses per call (Note [Choosing ring, all-gather or
            Ulysses]).
        backend: block-kernel backend name, or None for automatic choice.
        mode: the older spelling of ``algorithm``: "ring" or "ulysses".
        window_size: flash-attn sliding window ``(left, right)`` over global positions for
            every SDPA call in the scope (-1: unbounded; ``is_causal`` sets ``right = 0``);
            docs/window.md. SDPA has no window argument, hence this option.
        algorithm: how K/V move (Note [Layouts and algorithms]): "ring", "all_gather",
            "ulysses" (needs ``H`` divisible by the context-parallel size, else ``ValueError``
            on every rank before any communication; Note [Ulysses in the DTensor path]) or
            "auto"; None: the layout alias's, else "ring".

    Raises:
        ValueError: on a malformed ``window_size``.
        RuntimeError: when entered inside a function being compiled by ``torch.compile``, or
            when this torch's DTensor lacks the handler table (``_compat/dtensor.py``) or its
            checkpoint internals the known form (``_compat/checkpoint.py``).
    """
    get_layout(layout, "dense")
    algorithm = sdpa_algorithm(mode, algorithm)
    placement(layout, algorithm)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "enter dtensor_ring.ring_sdpa outside the torch.compile'd function (e.g. around "
            "the training step): its SDPA handlers act while AOTAutograd traces, after Dynamo; "
            "inside compiled code call dtensor_ring.scaled_dot_product_ring_attention instead"
        )
    config = SDPAConfig(layout, backend, algorithm, check_window_size(window_size))
    token = _SCOPE_LAYOUT.set(layout)
    _OPEN_SCOPES[config] += 1
    try:
        with (
            _dtensor_compat.custom_op_handlers(aten_handlers(config)),
            _RingSDPAMode(config),
            recompute_context(functools.partial(_recomputation, config)),
        ):
            yield
    finally:
        _OPEN_SCOPES[config] -= 1
        _SCOPE_LAYOUT.reset(token)


_SCOPE_LAYOUT: contextvars.ContextVar[str] = contextvars.ContextVar("ring_sdpa_layout")


def scope_layout(layout: str | None) -> str:
    """``layout``, or for None the layout of the innermost active :func:`ring_sdpa` scope
    (``"ring"`` outside any): the sharding helpers' default, so that sharding and attention
    agree on the layout wherever the library knows both."""
    return _SCOPE_LAYOUT.get("ring") if layout is None else layout
