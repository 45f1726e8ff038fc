"""Private internals of ``torch.utils.checkpoint`` through which the library follows the
recomputation of activation checkpointing (Note [Recomputation outside the scope] in
``dtensor_ring/api/recompute.py``).

Both of torch's checkpoints keep the function they run again in backward, and that is the one
place where the library hooks in:

* reentrant (``use_reentrant=True``): the autograd Function ``CheckpointFunction``, whose
  ``forward(ctx, run_function, preserve_rng_state, *args)`` stores ``ctx.run_function``;
  its ``backward`` calls it;
* non-reentrant (``use_reentrant=False``; also ``torch.distributed._composable.checkpoint``):
  ``_CheckpointFrame(recompute_fn, early_stop, unpack_error_cb, metadata_fn)``, whose
  ``recompute_fn`` the saved-tensor unpack hook calls.

Everything built on them (``checkpoint_sequential``, FSDP's ``checkpoint_wrapper``,
transformers' activation checkpointing) goes through one of the two.
:func:`wrapped_recomputations` replaces ``CheckpointFunction.forward`` and
``_CheckpointFrame.__init__`` while it is active (counted, process-wide) so that the function
kept for the recomputation is ``wrap(function)``, decided when the checkpointed forward runs;
the forward itself runs the function unchanged. The known form (those names and signatures,
torch 2.13 by ``tests/test_compat.py``) is checked on first use; without it
:func:`wrapped_recomputations` raises ``RuntimeError`` naming the API.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint as _checkpoint

Wrap = Callable[[Callable], Callable]

_FORWARD_PARAMS = ("ctx", "run_function", "preserve_rng_state", "args")
_FRAME_PARAMS = ("self", "recompute_fn")


@functools.cache
def missing_checkpoint_api() -> str | None:
    """None when this torch's checkpoint internals have the known form, else why not."""
    function = getattr(_checkpoint, "CheckpointFunction", None)
    frame = getattr(_checkpoint, "_CheckpointFrame", None)
    forward = getattr(function, "__dict__", {}).get("forward")
    init = getattr(frame, "__dict__", {}).get("__init__")
    if isinstance(forward, staticmethod) and callable(init):
        forward_params = tuple(inspect.signature(forward.__func__).parameters)
        frame_params = tuple(inspect.signature(init).parameters)[: len(_FRAME_PARAMS)]
        if forward_params == _FORWARD_PARAMS and frame_params == _FRAME_PARAMS:
            return None
    return (
        f"torch {torch.__version__} lacks torch.utils.checkpoint.CheckpointFunction.forward"
        f"{_FORWARD_PARAMS} or _CheckpointFrame.__init__{_FRAME_PARAMS}, through which "
        "dtensor_ring follows activation checkpointing; dtensor_ring/_compat/checkpoint.py "
        "must be updated for this version"
    )


_lock = threading.Lock()
_count = 0  # open wrapped_recomputations, in all threads
_originals: tuple[staticmethod, Callable] | None = None


@contextlib.contextmanager
def wrapped_recomputations(wrap: Wrap) -> Iterator[None]:
    """Inside (in any thread), every torch checkpoint keeps ``wrap(function)`` for its
    recomputation; restored when the last one closes. Every caller passes the same ``wrap``.

    Raises:
        RuntimeError: when this torch's internals lack the known form.
    """
    global _count, _originals
    missing = missing_checkpoint_api()
    if missing is not None:
        raise RuntimeError(missing)
    with _lock:
        if _count == 0:
            _originals = _install(wrap)
        _count += 1
    try:
        yield
    finally:
        with _lock:
            _count -= 1
            if _count == 0:
                forward, init = _originals
                _checkpoint.CheckpointFunction.forward = forward
                _checkpoint._CheckpointFrame.__init__ = init
                _originals = None


def _install(wrap: Wrap) -> tuple[staticmethod, Callable]:
    """Replace the two entry points by ones that keep ``wrap(function)``; the originals."""
    forward = _checkpoint.CheckpointFunction.__dict__["forward"]
    init = _checkpoint._CheckpointFrame.__dict__["__init__"]

    def checkpoint_forward(ctx, run_function, preserve_rng_state, *args):
        recompute = wrap(run_function)
        outputs = forward.__func__(ctx, run_function, preserve_rng_state, *args)
        ctx.run_function = recompute  # what backward calls
        return outputs

    def frame_init(self, recompute_fn, *args, **kwargs):
        init(self, wrap(recompute_fn), *args, **kwargs)

    _checkpoint.CheckpointFunction.forward = staticmethod(checkpoint_forward)
    _checkpoint._CheckpointFrame.__init__ = frame_init
    return forward, init
