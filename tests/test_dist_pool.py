"""Tests of the distributed worker pool itself (``_dist.py``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _rank_info(group, offset):
    """Each rank reports its group rank/size and the all-reduced sum of the ranks."""
    rank = dist.get_rank(group)
    print(f"worker output: rank {rank} of {dist.get_world_size(group)}")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    return rank + offset, dist.get_world_size(group), total.item(), torch.get_num_threads()


def _print_to_stderr(group):
    """Each rank writes a line to its stderr file descriptor (as C++ code would)."""
    os.write(2, f"warning from rank {dist.get_rank(group)}\n".encode())


def _fail_on_rank_1(group):
    """Rank 1 raises (before any collective); the other ranks succeed."""
    if dist.get_rank(group) == 1:
        raise RuntimeError(f"deliberate failure in pid {os.getpid()}")
    return "fine"


def _rank_1_skips_collective(group):
    """Rank 1 returns at once; the others block in a collective it never joins."""
    if dist.get_rank(group) != 1:
        dist.all_reduce(torch.ones(1), group=group)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_result_per_rank(dist_pool, world_size, capsys):
    results = dist_pool.run(_rank_info, world_size, offset=100)
    expected_sum = float(sum(range(world_size)))
    assert results == [(100 + r, world_size, expected_sum, 1) for r in range(world_size)]
    # What the workers printed comes back through this test's captured stdout, rank by rank.
    out = capsys.readouterr().out
    expected = [f"[rank {r}] worker output: rank {r} of {world_size}" for r in range(world_size)]
    assert [line for line in out.splitlines() if "worker output" in line] == expected, out


def test_worker_stderr_is_captured(dist_pool, capfd):
    dist_pool.run(_print_to_stderr, 2)
    captured = capfd.readouterr()
    assert "[rank 1] warning from rank 1" in captured.err, captured
    assert "warning from" not in captured.out, captured


def test_exception_reports_rank_traceback(dist_pool):
    with pytest.raises(AssertionError) as info:
        dist_pool.run(_fail_on_rank_1, 3)
    message = str(info.value)
    assert "----- rank 1 -----" in message
    assert "----- rank 0 -----" not in message and "----- rank 2 -----" not in message
    assert "Traceback" in message and "_fail_on_rank_1" in message
    assert "RuntimeError: deliberate failure" in message
    # The pool survives a plain exception.
    assert dist_pool.run(_rank_info, 2, offset=0)[1][0] == 1


@pytest.mark.slow  # waits out a 3 s timeout, then restarts the pool
def test_hang_fails_and_pool_restarts(dist_pool):
    with pytest.raises(AssertionError, match="did not finish"):
        dist_pool.run(_rank_1_skips_collective, 2, timeout_s=3)
    assert not dist_pool.started  # torn down ...
    assert dist_pool.run(_rank_info, 4, offset=0)[3][:3] == (3, 4, 6.0)  # ... and restarted
