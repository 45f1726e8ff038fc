"""Activation checkpointing recomputes in its forward's scope (the doors that swap in
behaviour for a scope: ``context_parallel``, ``ring_sdpa``).

Note [Recomputation outside the scope]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``context_parallel`` replaces ``F.scaled_dot_product_attention`` and ``ring_sdpa`` installs
SDPA handlers and a torch-function mode, each for its scope. Activation checkpointing runs the
checkpointed function a second time, in backward, to recompute what it did not save, and a
backward can run after the scope has exited. Left alone, the recomputation meets torch's own
SDPA there::

    forward, inside the scope                 backward, after the scope
    checkpoint(block, x)                      recompute block(x)
      block(x): F.sdpa -> ring attention        block(x): F.sdpa -> torch's: each rank's
                                                          plain local attention on its shard

With ``context_parallel`` that is a silent error with reentrant checkpointing (the loss
exact, since the forward was ring attention; the gradients of everything at or before
attention 50-97 % off), a ``CheckpointError`` with non-reentrant checkpointing (its check of
the recomputed tensors' metadata; silent again when the check is turned off); with
``ring_sdpa``, DTensor's ``NotImplementedError`` on CPU.

So the recomputation carries its scope in the graph. While a scope is open, every torch
checkpoint that starts in it keeps, for its recomputation, its function wrapped by
:func:`_wrap` (``_compat/checkpoint.py`` has where torch keeps it, reentrant and not; the
first pass runs the function unchanged). The wrapper enters the recomputation contexts of the
scopes that were open, so the recomputed calls run the forward's algorithm on the forward's
group, however late::

    forward, in scope S                       backward: in S, after S, in another scope
    checkpoint(block, x)
      keeps recompute = in_S(block) --------> in_S(block)(x): enter S's recomputation context
      runs block(x) (S is active)                 block(x): F.sdpa -> S's ring attention
                                                leave it

The graph holds the wrapper, so it lives exactly as long as the graph that needs it (backward
inside or after the scope, again with ``retain_graph``, on autograd's threads); nothing stays
installed when the last scope closes. Every rank decides alike: by which scopes were open
when the checkpointed forward ran, the same program point on every rank. A recomputation
follows checkpoints nested in it too. Each door's context (:func:`recompute_context`):

* ``context_parallel``: ``F.scaled_dot_product_attention`` replaced again by the same ring
  attention (group, layout), for the recomputation only: exact (the ops' backward needs no
  scope);
* ``ring_sdpa``: the backward of SDPA on DTensors needs the scope's handlers anyway (Note [How
  SDPA on DTensors reaches ring attention]), so the recomputation requires an open scope of
  the same configuration and raises the ``ValueError`` of a backward outside it otherwise, on
  every rank, before any communication; inside, it re-enters the mode (off while
  ``Tensor.backward`` runs) and sets the scope's layout (``shard_sequence``'s default; both are
  thread-local, absent on autograd's threads), so the recomputation runs as the forward did;
* the transformers attention function (``dtensor_ring.hf``) has no scope: it reads
  ``setup``'s configuration whenever it runs, first pass and recomputation alike.

Not followed: activation checkpointing implemented outside ``torch.utils.checkpoint`` (an
autograd Function of its own: keep its backward inside the scope). ``torch.compile``'d
checkpoints recompute inside the compiled graph, which holds the ring ops themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from .._compat.checkpoint import wrapped_recomputations

Context = Callable[[], AbstractContextManager[None]]

# The recomputation contexts of the scopes open in this thread (innermost last).
_CONTEXTS: contextvars.ContextVar[tuple[Context, ...]] = contextvars.ContextVar(
    "dtensor_ring_recompute", default=()
)


@contextlib.contextmanager
def recompute_context(context: Context) -> Iterator[None]:
    """For the body: every torch checkpoint started in it recomputes inside ``context()``
    (after the contexts of enclosing scopes), whenever its recomputation runs."""
    with _following(_CONTEXTS.get() + (context,)):
        yield


@contextlib.contextmanager
def _following(contexts: tuple[Context, ...]) -> Iterator[None]:
    """``contexts`` are this thread's, and torch's checkpoints are wrapped, for the body."""
    token = _CONTEXTS.set(contexts)
    try:
        with wrapped_recomputations(_wrap):
            yield
    finally:
        _CONTEXTS.reset(token)


def _wrap(function: Callable) -> Callable:
    """``function`` as a checkpoint keeps it for recomputation: inside the contexts of the
    scopes open now (unchanged when none is)."""
    contexts = _CONTEXTS.get()
    if not contexts:
        return function

    @functools.wraps(function)
    def recompute(*args, **kwargs):
        with _following(contexts), contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return function(*args, **kwargs)

    return recompute
