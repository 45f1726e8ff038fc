"""Shared pytest fixtures: the session-wide distributed worker pool (see ``_dist.py``)."""

from __future__ import annotations

import os
import sys

import pytest

# Make ``dtensor_ring`` (repo root) and the test helpers (this directory) importable without
# installing anything; spawned workers inherit this ``sys.path``.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_TESTS_DIR), _TESTS_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from _dist import WorkerPool  # noqa: E402


def _warm_up_vectorized_math() -> None:
    """Call the vectorized math ops once on throwaway tensors.

    With PyTorch 2.13's CPU build and more than one thread, the first fp64 ``torch.exp`` of a
    process is sometimes ~1e-11 relative off (measured: 4 of 25 fresh processes; never with one
    thread, never after a first call), enough to fail the fp64 tests' 1e-12 tolerances in the
    math kernel and the reference. The workers of ``_dist.py`` run single-threaded.
    """
    for dtype in (torch.float64, torch.float32):
        x = torch.randn(4, 48, 48, dtype=dtype)
        torch.exp(x), torch.log(x.abs()), torch.logsumexp(x, -1), torch.softmax(x, -1)


_warm_up_vectorized_math()


@pytest.fixture(scope="session")
def dist_pool():
    """The session's pool of gloo workers: ``dist_pool.run(fn, world_size, **kwargs)``.

    Workers start on first use and are shut down at the end of the session. What they print
    during a call is re-emitted on ``sys.stdout``/``sys.stderr`` after it, so pytest captures it
    with the calling test.
    """
    pool = WorkerPool()
    yield pool
    pool.shutdown()


@pytest.fixture(autouse=True)
def _fresh_backend_choices():
    """Tests install stand-in backends and patch availability (monkeypatch): each test starts
    and ends with no remembered backend choice (``kernels.select_kernel`` caches them), nor
    remembered ``layout="auto"`` choice (``resolve.resolve_algorithm`` caches them)."""
    from dtensor_ring.algorithm import clear_algorithm_choices
    from dtensor_ring.kernels import clear_selection_cache

    clear_selection_cache()
    clear_algorithm_choices()
    yield
    clear_selection_cache()
    clear_algorithm_choices()
