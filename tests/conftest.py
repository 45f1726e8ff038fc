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

from _dist import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool(request: pytest.FixtureRequest):
    """The session's pool of gloo workers: ``dist_pool.run(fn, world_size, **kwargs)``.

    Workers start on first use, with pytest's output capturing suspended so that what they
    print reaches the terminal; they are shut down at the end of the session.
    """
    capman = request.config.pluginmanager.getplugin("capturemanager")
    pool = WorkerPool(start_context=capman.global_and_fixture_disabled if capman else None)
    yield pool
    pool.shutdown()
