"""Run one case in fresh processes, under a hard time limit, and classify what happened.

One case = W worker processes (W = 1..4), a gloo process group (gloo's pairs over TCP on
127.0.0.1) whose rendezvous is a ``FileStore`` in a fresh temporary directory, and a
module-level case function ``fn(ctx, **params)`` run on every rank (``ctx``:
:class:`~tests.adversarial.doors.Ctx`). The
function returns a dict of :class:`~tests.adversarial.oracle.Check` / ``Flag`` entries, or
raises. Processes come from a ``forkserver`` that has imported torch and ``dtensor_ring``
once: every case gets new processes (nothing survives from an earlier case: no process group,
no cache, no compiled plan), without paying seconds of imports per process. (The rendezvous
is a file rather than a ``TCPStore`` served by this process: with the latter, about one start
in seven had a worker's store client connect only after a 5 s retry, which multiplied the run
time of the suite; a file has no ports to race for either.)

Per rank the runner records one of: returned (the checks), raised (exception type and
message), died (exit code / signal), or no answer (still running at the limit). A rank that
has answered stays alive, idle, until every rank has answered or the limit is hit (so its
sockets stay open for peers still reading from them); then all are killed. Limits:
``timeout_s`` for the whole case, and :data:`STRAGGLER_S` for the other ranks once one rank
has answered (a rank that raised typically leaves its peers blocked in a collective).

Classification (:func:`classify`), first match wins:

* ``crash``: a rank died, or raised something other than ``ValueError`` / ``TypeError``
  (``RuntimeError`` from gloo, ``AttributeError``, ``AssertionError``, ...), or a
  ``TypeError`` of Python itself (a call with missing arguments, ``None`` subscripted, ...:
  a bug, not a check; :data:`_INTERNAL_TYPE_ERRORS`);
* ``clean_error``: every rank raised, all ``ValueError`` or all ``TypeError``;
* ``partial``: some ranks raised ``ValueError`` / ``TypeError`` and others returned or never
  answered, or ranks raised different types;
* ``hang``: the limit was hit and no rank raised;
* ``correct``: every rank returned and every check passed (:func:`oracle.evaluate`);
* ``wrong``: every rank returned and some check failed.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from . import oracle

CLASSES = ("correct", "clean_error", "wrong", "crash", "hang", "partial")
DEFAULT_TIMEOUT_S = 60.0
STRAGGLER_S = 10.0
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "dtensor_ring",
    "transformers",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "dtensor_ring.hf",
    "tests.adversarial.cases",
]


@dataclass
class Case:
    """One generated case.

    ``fn(ctx, **params)`` runs on each of ``world`` ranks. ``expect``: the classes that count
    as passing (None: informational, e.g. ranks that disagree without the consistency mode).
    ``env``: extra environment of the worker processes. ``fast``: part of the CI subset.
    """

    name: str
    kind: str
    world: int
    fn: Callable[..., dict]
    params: dict = field(default_factory=dict)
    expect: frozenset[str] | None = frozenset({"correct"})
    env: dict[str, str] = field(default_factory=dict)
    fast: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class RankOutcome:
    """What one rank did: ``status`` is returned | raised | died | no_answer."""

    status: str
    checks: dict | None = None
    exc_type: str = ""
    message: str = ""
    where: str = ""
    base: str = ""  # "ValueError" / "TypeError" when the exception is one of those


@dataclass
class Result:
    name: str
    kind: str
    world: int
    cls: str
    reason: str
    seconds: float
    expect: tuple[str, ...] | None

    @property
    def passed(self) -> bool | None:
        """Whether the class is an expected one (None: informational case)."""
        return None if self.expect is None else self.cls in self.expect


# --- worker side ------------------------------------------------------------------------------


def _worker(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable,
    params: dict,
    env: dict,
    conn: Connection,
    log_path: str,
    pg_timeout_s: float,
) -> None:
    """One rank of a case: join the group, run ``fn``, send the outcome, wait to be released."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from .doors import Ctx

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        checks = fn(Ctx(rank, world, dist.group.WORLD), **params)
        outcome = RankOutcome("returned", checks=_detached(checks))
    except BaseException as e:  # noqa: BLE001  (everything a rank can raise is classified)
        frame = traceback.extract_tb(e.__traceback__)[-1]
        outcome = RankOutcome(
            "raised",
            exc_type=type(e).__name__,
            message=" ".join(str(e).split())[:400],
            where=f"{os.path.relpath(frame.filename, _REPO_ROOT)}:{frame.lineno}",
            base=_clean_base(e),
        )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.send_bytes(pickle.dumps(outcome))
    except Exception as e:  # noqa: BLE001  (an unpicklable result is the suite's bug)
        conn.send_bytes(pickle.dumps(RankOutcome("raised", exc_type="SuiteError", message=str(e))))
    with contextlib.suppress(EOFError, OSError):
        conn.recv_bytes()  # released: every rank answered, or the case is being torn down
    os._exit(0)


#: TypeError messages of Python itself (a bug in the code, not a check of an argument)
_INTERNAL_TYPE_ERRORS = (
    "required positional argument",
    "required keyword-only argument",
    "positional arguments but",
    "object is not subscriptable",
    "object is not callable",
    "object is not iterable",
    "cannot unpack non-iterable",
    "unsupported operand type",
    "'NoneType' object",
)


def _clean_base(e: BaseException) -> str:
    """ "ValueError" / "TypeError" when ``e`` is a clean error of that kind, else ""."""
    if isinstance(e, TypeError) and any(m in str(e) for m in _INTERNAL_TYPE_ERRORS):
        return ""
    for base in (ValueError, TypeError):
        if isinstance(e, base):
            return base.__name__
    return ""


def _detached(checks: Any) -> Any:
    """``checks`` with every tensor detached (pickled by value, without autograd history)."""
    import torch

    if isinstance(checks, dict):
        return {k: _detached(v) for k, v in checks.items()}
    if isinstance(checks, oracle.Check):
        got = checks.got.detach().clone() if isinstance(checks.got, torch.Tensor) else checks.got
        return oracle.Check(
            got, checks.want.detach().clone(), checks.dtype, checks.atol, checks.rtol
        )
    return checks


# --- parent side --------------------------------------------------------------------------

_CONTEXT = None


def _context():
    """The forkserver context (started on first use with torch and dtensor_ring imported)."""
    global _CONTEXT
    if _CONTEXT is None:
        if _REPO_ROOT not in sys.path:
            sys.path.insert(0, _REPO_ROOT)
        _CONTEXT = mp.get_context("forkserver")
        # workers re-run the main script as __mp_main__: have its imports ready (pytest)
        extra = ["pytest"] if "pytest" in sys.modules else []
        _CONTEXT.set_forkserver_preload(_PRELOAD + extra)
    return _CONTEXT


def run_case(case: Case, timeout_s: float | None = None) -> Result:
    """Run ``case`` in ``case.world`` fresh processes and classify it."""
    limit = case.timeout_s if timeout_s is None else timeout_s
    ctx = _context()
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="adversarial-")
    store, log = os.path.join(tmp, "store"), os.path.join(tmp, "log")
    open(log, "w").close()
    procs, conns = [], []
    try:
        for rank in range(case.world):
            parent, child = ctx.Pipe()
            args = (rank, case.world, store, case.fn, case.params, case.env, child, log)
            proc = ctx.Process(
                target=_worker, args=args, kwargs={"pg_timeout_s": limit + 120}, daemon=True
            )
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        outcomes = _collect(procs, conns, start + limit)
    finally:
        _tear_down(procs, conns)
        with open(log, errors="replace") as f:
            log_tail = f.read()[-2000:]
        shutil.rmtree(tmp, ignore_errors=True)
    cls, reason = classify(outcomes)
    if cls == "crash" and "died" in reason and log_tail.strip():
        reason += " | log: " + " ".join(log_tail.split())[-300:]
    expect = None if case.expect is None else tuple(sorted(case.expect))
    return Result(case.name, case.kind, case.world, cls, reason, time.monotonic() - start, expect)


def _collect(procs, conns, deadline: float) -> dict[int, RankOutcome]:
    """Wait for every rank's outcome, until ``deadline`` (earlier for stragglers)."""
    outcomes: dict[int, RankOutcome] = {}
    pending = set(range(len(procs)))
    while pending:
        if outcomes:  # the others get STRAGGLER_S more
            deadline = min(deadline, time.monotonic() + STRAGGLER_S)
        by_conn = {conns[r]: r for r in pending}
        by_sentinel = {procs[r].sentinel: r for r in pending}
        ready = wait([*by_conn, *by_sentinel], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for obj in ready:
            rank = by_conn.get(obj)
            if rank is not None and rank in pending:
                with contextlib.suppress(EOFError, OSError):
                    outcomes[rank] = pickle.loads(obj.recv_bytes())
                    pending.discard(rank)
        for obj in ready:
            rank = by_sentinel.get(obj)
            if rank is not None and rank in pending:
                procs[rank].join(timeout=1)
                outcomes[rank] = RankOutcome("died", message=_exit_text(procs[rank].exitcode))
                pending.discard(rank)
    for rank in pending:
        outcomes[rank] = RankOutcome("no_answer")
    return outcomes


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tear_down(procs, conns) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(b"release")
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


def classify(outcomes: dict[int, RankOutcome]) -> tuple[str, str]:
    """``(class, one-line reason)`` of a case from its ranks' outcomes (module docstring)."""
    by_status: dict[str, list[int]] = {}
    for rank in sorted(outcomes):
        by_status.setdefault(outcomes[rank].status, []).append(rank)
    raised = by_status.get("raised", [])
    clean = [r for r in raised if outcomes[r].base]
    unclean = [r for r in raised if r not in clean]
    if "died" in by_status:
        r = by_status["died"][0]
        return "crash", f"rank {r} died ({outcomes[r].message}){_others(outcomes, r)}"
    if unclean:
        return "crash", f"{_raised_text(outcomes, unclean[0])}{_others(outcomes, unclean[0])}"
    if clean:
        types = {outcomes[r].base for r in clean}
        if len(clean) == len(outcomes) and len(types) == 1:
            return "clean_error", _raised_text(outcomes, clean[0])
        return "partial", f"{_raised_text(outcomes, clean[0])}{_others(outcomes, clean[0])}"
    if "no_answer" in by_status:
        return "hang", f"ranks {by_status['no_answer']} never answered" + (
            f" (ranks {by_status['returned']} returned)" if "returned" in by_status else ""
        )
    first, failing = "", {}
    for rank in sorted(outcomes):
        for name, check in (outcomes[rank].checks or {}).items():
            problem = oracle.evaluate(check)
            if problem is not None:
                first = first or f"rank {rank} {name}: {problem}"
                failing.setdefault(name, []).append(rank)
    if failing:
        where = ", ".join(f"{name}@{ranks}" for name, ranks in failing.items())
        return "wrong", f"{first} | failing: {where}"
    return "correct", ""


def _raised_text(outcomes: dict[int, RankOutcome], rank: int) -> str:
    o = outcomes[rank]
    same = [r for r, x in outcomes.items() if x.status == "raised" and x.exc_type == o.exc_type]
    who = "all ranks" if len(same) == len(outcomes) else f"ranks {same}"
    return f"{who} raised {o.exc_type} at {o.where}: {o.message[:240]}"


def _others(outcomes: dict[int, RankOutcome], rank: int) -> str:
    """What the ranks other than ``rank`` (and those like it) did."""
    me = outcomes[rank]
    parts = {}
    for r, o in sorted(outcomes.items()):
        if (o.status, o.exc_type) == (me.status, me.exc_type):
            continue
        what = {"raised": f"raised {o.exc_type}", "no_answer": "hung"}.get(o.status, o.status)
        parts.setdefault(what, []).append(r)
    return "".join(f"; ranks {rs} {what}" for what, rs in parts.items())
