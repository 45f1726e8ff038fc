"""Faults: a rank that dies or stops calling in the middle of a ring makes the others fail.

Three fresh gloo processes (not the session's pool, whose groups have the default 30 min
timeout), started once for the module, play the :data:`SCENARIOS` in turn, each on a new group
of ranks ``0..w-1`` (w = 2 or 3) with a :data:`TIMEOUT_S` timeout. In each, one rank leaves
(it returns, or exits the process) before the forward or before the backward; every other rank
must raise the library's ``RuntimeError`` naming the operation, the step and the peers, chained
to gloo's error, within the timeout (Note [Faults] in ``dtensor_ring/comm/faults.py``). The
harness waits at most :data:`HARD_LIMIT_S` for each scenario, so a hang fails, never blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import re
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import pytest
import torch
import torch.distributed as dist

import dtensor_ring as dr

WORLD_SIZE = 3
TIMEOUT_S = 2.0  # the timeout of each scenario's process group
FAIL_WITHIN_S = 2 * TIMEOUT_S + 2.0  # from a rank's call to its error (one or two waits)
START_LIMIT_S = 120.0  # the harness's limits: start-up (imports, on a busy machine) ...
HARD_LIMIT_S = 30.0  # ... and each scenario
STOP_GRACE_S = 10.0
_HOST = "127.0.0.1"
HINT = "has probably died or stopped calling"


# --- the calls ------------------------------------------------------------------------------


Result = tuple[torch.Tensor, tuple[torch.Tensor, ...]]  # (out, the inputs to differentiate)


def _dense() -> list[torch.Tensor]:
    """q, k, v of this rank: ``[1, 8, 2, 8]`` (8 tokens, 2 heads)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3)]


def _ring(
    group: dist.ProcessGroup,
    fn: Callable = dr.ring_flash_attn_func,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
) -> Result:
    q, k, v = (t.requires_grad_() for t in _dense())
    return fn(q, k, v, causal=causal, window_size=window, group=group), (q, k, v)


def _ulysses(group: dist.ProcessGroup) -> Result:
    q, k, v = (t.requires_grad_() for t in _dense())
    return dr.ulysses_flash_attn_func(q, k, v, causal=True, group=group), (q, k, v)


def _llama3(group: dist.ProcessGroup) -> Result:
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cu = torch.tensor([0, 3, 8 * W], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
    q, k, v = (t[0].requires_grad_() for t in _dense())  # [8, 2, 8]: 2 KV heads
    out = dr.llama3_flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True, group=group
    )
    return out, (q, k, v)


def _placed_gather(group: dist.ProcessGroup) -> Result:
    """Placed documents' all-gather (Note [Gathering what placed documents need]), documents
    cut over the ranks: every rank fetches."""
    W = dist.get_world_size(group)
    lay = dr.document_layout([0, 3, 13, 8 * W], W)
    cu = torch.tensor(lay.local_bounds[dist.get_rank(group)], dtype=torch.int32)
    q, k, v = (t[0].requires_grad_() for t in _dense())
    kw = dict(causal=True, group=group, algorithm="all_gather")
    return dr.ring_varlen_attention_func(lay, q, k, v, cu, None, **kw), (q, k, v)


CALLS: dict[str, Callable[[dist.ProcessGroup], Result]] = {
    "ring": _ring,
    "zigzag_causal": lambda g: _ring(g, dr.zigzag_ring_flash_attn_func, causal=True),
    "ring_window": lambda g: _ring(g, causal=True, window=(2, 0)),  # sparse plan: direct
    "ulysses": _ulysses,
    "llama3": _llama3,
    "placed_gather": _placed_gather,
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Rank ``faulty`` leaves (``fault``: "stops" returns, "dies" exits) before ``phase``;
    every other rank's message must match ``expected`` (``{rank}`` is filled in)."""

    name: str
    world_size: int
    call: str
    faulty: int
    fault: str
    phase: str
    expected: str


_RING_STEP = r"ring attention {} exchange of K/V \(step {} of {}\) failed on rank {{rank}} "
# a rank that stops before a forward on gloo: the others fail in the call's first collective,
# the consistency header (Note [Consistency header])
_HEADER = r"{} call, consistency header \(before its exchanges\) failed on rank {{rank}} "
SCENARIOS = [
    Scenario(
        "ring_forward_stops",
        world_size=2,
        call="ring",
        faulty=1,
        fault="stops",
        phase="forward",
        expected=_HEADER.format("ring_attention") + r"\(with ranks 0, 1\)",
    ),
    Scenario(
        "llama3_backward_stops",
        world_size=2,
        call="llama3",
        faulty=1,
        fault="stops",
        phase="backward",
        expected=r"llama3 attention backward, all-gather of K/V \(step 1 of 2\) failed on "
        r"rank 0 \(with ranks 0, 1\)",
    ),
    Scenario(
        "ulysses_forward_stops",
        world_size=2,
        call="ulysses",
        faulty=1,
        fault="stops",
        phase="forward",
        expected=_HEADER.format("ulysses") + r"\(with ranks 0, 1\)",
    ),
    Scenario(
        "zigzag_backward_stops",
        world_size=3,
        call="zigzag_causal",
        faulty=2,
        fault="stops",
        phase="backward",
        expected=_RING_STEP.format("backward, ring", 2, 3) + r"\(sending to rank \d, receiving",
    ),
    Scenario(
        "direct_forward_stops",
        world_size=3,
        call="ring_window",
        faulty=1,
        fault="stops",
        phase="forward",
        expected=_HEADER.format("ring_attention") + r"\(with ranks 0, 1, 2\)",
    ),
    Scenario(
        "placed_gather_backward_stops",
        world_size=2,
        call="placed_gather",
        faulty=1,
        fault="stops",
        phase="backward",
        expected=r"placed documents all-gather, all-to-all of K/V failed on rank 0 "
        r"\(with ranks 0, 1\)",
    ),
    Scenario(  # last: the others cannot go on without the dead rank
        "ring_backward_dies",
        world_size=3,
        call="ring",
        faulty=1,
        fault="dies",
        phase="backward",
        expected=_RING_STEP.format("backward, ring", 2, 3) + r"\(sending to rank \d, receiving",
    ),
]


def _play(scenario: Scenario, group: dist.ProcessGroup) -> tuple[str, str, str, float]:
    """This rank's part of ``scenario`` -> ``(kind, message, cause type, seconds)``."""
    leaves = dist.get_rank() == scenario.faulty
    start = time.monotonic()
    try:
        if leaves and scenario.phase == "forward":
            return _leave(scenario.fault)
        out, inputs = CALLS[scenario.call](group)
        if leaves:
            return _leave(scenario.fault)
        start = time.monotonic()
        torch.autograd.grad(out.sum(), inputs)
        return "ok", "", "", time.monotonic() - start
    except Exception as err:
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else ""
        return "error", f"{type(err).__name__}: {err}", cause, time.monotonic() - start


def _leave(fault: str) -> tuple[str, str, str, float]:
    if fault == "dies":
        os._exit(3)
    return "left", "", "", 0.0


# --- the processes ----------------------------------------------------------------------------


def _worker(rank: int, port: int, conn: Connection) -> None:
    """Join the gloo group, warm every call up, then play one scenario per go-ahead."""
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, WORLD_SIZE, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
        sizes = {w: dist.new_group(ranks=list(range(w))) for w in (2, 3)}
        for name, w in dict.fromkeys((s.call, s.world_size) for s in SCENARIOS):  # untimed
            if rank < w:
                out, inputs = CALLS[name](sizes[w])
                torch.autograd.grad(out.sum(), inputs)
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), "", 0.0)))
        return
    conn.send_bytes(pickle.dumps(("ready", "", "", 0.0)))
    scenarios = iter(SCENARIOS)
    with contextlib.suppress(EOFError, OSError):  # the main process is gone: exit
        while conn.recv_bytes() == b"go":
            scenario = next(scenarios)
            timeout = datetime.timedelta(seconds=TIMEOUT_S)
            group = dist.new_group(ranks=list(range(scenario.world_size)), timeout=timeout)
            reply = _play(scenario, group) if rank < scenario.world_size else ("idle", "", "", 0.0)
            conn.send_bytes(pickle.dumps(reply))
    dist.destroy_process_group()


@contextlib.contextmanager
def _processes():
    """Start the workers; yield their connections; stop them all on exit."""
    store = dist.TCPStore(_HOST, 0, WORLD_SIZE + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for rank in range(WORLD_SIZE):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, store.port, child), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        yield conns
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"exit")
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()
        for conn in conns:
            conn.close()


def _collect(conns: dict[int, Connection], what: str, limit_s: float) -> dict[int, tuple]:
    """One reply per rank of ``conns`` (a closed connection: the rank exited: ``"exited"``)."""
    pending, replies = dict(conns), {}
    deadline = time.monotonic() + limit_s
    while pending:
        ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            pytest.fail(f"{what}: ranks {sorted(pending)} hung for {limit_s:.0f}s")
        for rank, conn in list(pending.items()):
            if conn in ready:
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    replies[rank] = ("exited", "", "", 0.0)
                del pending[rank]
    return replies


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[int, tuple]]:
    """Every scenario, played in turn by one set of processes: name -> rank -> reply."""
    results = {}
    with _processes() as conns:
        live = dict(enumerate(conns))
        started = _collect(live, "start-up", START_LIMIT_S)
        failed = {r: body for r, (kind, body, *_) in started.items() if kind != "ready"}
        assert not failed, f"start-up failed: {failed}"
        for scenario in SCENARIOS:
            for conn in live.values():
                conn.send_bytes(b"go")
            results[scenario.name] = replies = _collect(live, scenario.name, HARD_LIMIT_S)
            live = {r: c for r, c in live.items() if replies[r][0] != "exited"}
    return results


@pytest.mark.slow  # waits out six 2 s timeouts after starting 3 processes
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_others_fail_naming_the_step(outcomes, scenario):
    replies = outcomes[scenario.name]
    assert replies[scenario.faulty][0] == ("exited" if scenario.fault == "dies" else "left")
    others = [r for r in range(scenario.world_size) if r != scenario.faulty]
    for rank in others:
        kind, message, cause, seconds = replies[rank]
        assert kind == "error", (rank, replies[rank])
        assert re.search(scenario.expected.format(rank=rank), message), (rank, message)
        assert message.startswith("RuntimeError: ") and HINT in message, message
        assert "timeout= of init_process_group / new_group" in message, message
        assert cause in ("RuntimeError", "DistBackendError"), (rank, cause)
        assert seconds < FAIL_WITHIN_S, (rank, seconds, message)
