"""Which attention engine a front door ran: the ring (K/V passed around, ``engine/ring.py``),
the all-gather (``engine/llama3.py``) or Ulysses. For tests of layouts that must all-gather
("llama3", "llama3_zigzag") whichever way they are called, and of ``layout="auto"`` with the
choice forced (:func:`forced_algorithm`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def engines_used() -> Iterator[set[str]]:
    """Inside, every call of the ops' engine functions adds "ring", "llama3" or
    "placed_gather" (placed documents' all-gather) to the set
    yielded (forward and backward; the ops look the functions up when they run, so patching
    the ops modules' names catches every path: eager, compiled, DTensor handlers), and a
    ``layout="auto"`` call that chose Ulysses adds "ulysses". Restored on exit, also on an
    exception (the workers of the test pool are reused)."""
    import dtensor_ring.api.attend as attend
    import dtensor_ring.ops.ring as ring_ops
    import dtensor_ring.ops.varlen as varlen_ops

    used: set[str] = set()
    targets = [
        (ring_ops, "ring_forward", "ring"),
        (ring_ops, "ring_backward", "ring"),
        (varlen_ops, "ring_forward", "ring"),
        (varlen_ops, "ring_backward", "ring"),
        (varlen_ops, "llama3_forward", "llama3"),
        (varlen_ops, "llama3_backward", "llama3"),
        (varlen_ops, "placed_forward", "placed_gather"),
        (varlen_ops, "placed_backward", "placed_gather"),
        (attend, "ulysses_run", "ulysses"),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in targets]

    def spy(fn, engine):
        def wrapped(*args, **kwargs):
            used.add(engine)
            return fn(*args, **kwargs)

        return wrapped

    try:
        for (module, name, engine), (_, _, fn) in zip(targets, originals, strict=True):
            setattr(module, name, spy(fn, engine))
        yield used
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


@contextlib.contextmanager
def forced_algorithm(algorithm: str | None) -> Iterator[None]:
    """Inside, ``layout="auto"`` calls choose ``algorithm`` ("ring", "all_gather", "ulysses"):
    the cost model runs with that one candidate (so its layout and ``heads_k_stride`` are
    the policy's own). None: the model's own choice. Restored on exit; the remembered choices
    are forgotten on entry and exit (forced ones must not outlive the block, nor earlier ones
    answer inside it)."""
    import dtensor_ring.algorithm as resolve

    original = resolve.choose_algorithm

    def only(*args, candidates, **kwargs):
        assert algorithm in candidates, (algorithm, candidates)
        return original(*args, candidates=(algorithm,), **kwargs)

    resolve.clear_algorithm_choices()
    try:
        if algorithm is not None:
            resolve.choose_algorithm = only
        yield
    finally:
        resolve.choose_algorithm = original
        resolve.clear_algorithm_choices()
