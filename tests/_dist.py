"""A persistent pool of gloo worker processes for the distributed tests.

Design
------
Starting a process that imports torch costs seconds on a small CI machine, so the test session
starts ONE pool of :data:`POOL_SIZE` worker processes (``spawn`` context) and reuses it for every
distributed test:

* The main process owns a ``TCPStore`` server on 127.0.0.1 (port picked by the OS, so no race
  for a free port); every worker connects to it and joins one gloo process group of
  :data:`POOL_SIZE` ranks. At start each worker also calls ``torch.set_num_threads(1)`` and
  creates the subgroups ``ranks = [0, .., w-1]`` for ``w = 1 .. POOL_SIZE`` (every rank creates
  every group, in the same order, as ``new_group`` requires).
* :meth:`WorkerPool.run` sends ``(fn, world_size, kwargs)`` to every worker over its ``Pipe``.
  Workers of global rank ``< world_size`` call ``fn(group, **kwargs)`` with their size-``w``
  group (their group rank equals their global rank); the others sit the call out.
  ``fn`` is pickled by reference, so it must be a module-level function of an importable module
  (a test module: the workers put the ``tests`` directory on ``sys.path``).
* A worker catches any exception of ``fn`` and sends back its formatted traceback; ``run`` then
  raises ``AssertionError`` listing every failing rank's traceback.
* Hangs fail instead of blocking CI: a call that exceeds its ``timeout_s``, or whose remaining
  ranks do not finish within :data:`STRAGGLER_S` seconds of the first rank finishing (typically:
  one rank raised, the others are blocked in a collective waiting for it), or whose worker dies,
  tears the pool down and raises. The next ``run`` starts a fresh pool.
* Tear-down asks every worker to stop and gives them :data:`STOP_GRACE_S` seconds: an idle
  worker exits at once, and a worker blocked in a collective gets an error from gloo as soon as
  its peers exit, then reads its stop message. Workers that exit normally run their
  ``multiprocessing`` finalizers (a terminated one leaks e.g. the named semaphore of the
  ``multiprocessing.RLock`` that tqdm creates during inductor compiles, which the resource tracker
  reports as "leaked semaphore objects" at exit), and then skip the interpreter's own
  teardown (seconds with torch loaded). Only workers still alive after the grace period are
  terminated.

Output: each worker points its stdout and stderr file descriptors at two files of a temporary
directory (so Python prints, warnings and C++ library output all land there). After every call
the pool reads what the workers wrote and re-emits it on the main process's ``sys.stdout`` /
``sys.stderr``, each line prefixed ``[rank N]``: pytest captures it with the test that made the
call (shown with that test's failure report; ``capsys`` sees it).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

POOL_SIZE = 4
DEFAULT_TIMEOUT_S = 180.0
STRAGGLER_S = 30.0
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
_HOST = "127.0.0.1"
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)


class PoolError(AssertionError):
    """A distributed call failed: an exception on some rank, a hang, or a dead worker."""


def _worker_main(
    rank: int, world_size: int, store_port: int, conn: Connection, out_paths: tuple[str, str]
) -> None:
    """Body of one worker process: join the process group, then serve calls until told to stop.

    ``out_paths``: the files that take this process's stdout and stderr (file descriptors 1, 2).
    """
    for fd, path in zip((1, 2), out_paths, strict=True):
        file_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    for path in (_REPO_ROOT, _TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            _HOST,
            store_port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        groups = {
            w: dist.new_group(ranks=list(range(w)), backend="gloo")
            for w in range(1, world_size + 1)
        }
    except BaseException:
        _reply(conn, pickle.dumps(("error", traceback.format_exc())))
        return
    _reply(conn, pickle.dumps(("ready", None)))

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the main process is gone
            break
        if message == b"stop":
            break
        try:
            fn, w, kwargs = pickle.loads(message)
            result = None if rank >= w else fn(groups[w], **kwargs)
            reply = pickle.dumps(("ok", result))
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()))
        _reply(conn, reply)
    dist.destroy_process_group()
    # multiprocessing runs its finalizers when this function returns, then the interpreter
    # tears itself down (seconds with torch loaded): the atexit handler registered last runs
    # first and ends the process there.
    atexit.register(os._exit, 0)


def _reply(conn: Connection, reply: bytes) -> None:
    """Flush this worker's output (the main process reads it on the reply), then reply."""
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(reply)


class WorkerPool:
    """``POOL_SIZE`` gloo worker processes, started lazily, restarted after a failure."""

    def __init__(self) -> None:
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._outputs: list[tuple[Any, Any]] = []  # per rank: (stdout, stderr) file, read side
        self._out_dir: str | None = None
        self._store = None

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        """Start the workers and wait until all of them joined the process group."""
        if self.started:
            return
        import torch.distributed as dist

        self._store = dist.TCPStore(_HOST, 0, POOL_SIZE + 1, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._out_dir = tempfile.mkdtemp(prefix="dist-pool-")
        for rank in range(POOL_SIZE):
            paths = tuple(os.path.join(self._out_dir, f"rank{rank}.{s}") for s in ("out", "err"))
            for path in paths:
                open(path, "wb").close()
            self._outputs.append(tuple(open(path, "rb") for path in paths))
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                name=f"dist-worker-{rank}",
                daemon=True,
                args=(rank, POOL_SIZE, self._store.port, child, paths),
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        failed = _errors(
            self._collect(
                range(POOL_SIZE), START_TIMEOUT_S, "pool start-up", straggler_s=START_TIMEOUT_S
            )
        )
        if failed:
            self.shutdown()
            raise PoolError(_format_failures("pool start-up failed", failed))

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        /,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(group, **kwargs)`` on ranks ``0 .. world_size-1``; return their results.

        Ranks ``>= world_size`` take no part (their result would be ``None``). ``timeout_s`` is
        the wall-clock limit of the whole call (so ``fn`` cannot take a ``timeout_s`` kwarg).

        Raises:
            PoolError (an ``AssertionError``): ``fn`` raised on some rank (the message holds each
                failing rank's traceback), or the call hung or a worker died (the pool is then
                torn down; the next call restarts it).
        """
        __tracebackhide__ = True  # pytest: the rank tracebacks in the message are what matter
        if not 1 <= world_size <= POOL_SIZE:
            raise ValueError(f"world_size={world_size} not in [1, {POOL_SIZE}]")
        self.start()
        payload = pickle.dumps((fn, world_size, kwargs))
        for conn in self._conns[:world_size]:
            conn.send_bytes(payload)
        what = f"{fn.__module__}.{fn.__qualname__} (world_size={world_size})"
        try:
            replies = self._collect(range(world_size), timeout_s, what)
        finally:
            self.relay_output()
        failed = _errors(replies)
        if failed:
            raise PoolError(_format_failures(f"{what} raised", failed))
        return [replies[r][1] for r in range(world_size)]

    def _collect(
        self, ranks, timeout_s: float, what: str, straggler_s: float = STRAGGLER_S
    ) -> dict[int, tuple[str, Any]]:
        """Receive one ``(kind, body)`` reply per rank.

        On a timeout, a straggler or a dead worker: tear the pool down and raise PoolError.
        """
        pending = set(ranks)
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            if replies:  # someone finished: the rest only has straggler_s more
                deadline = min(deadline, time.monotonic() + straggler_s)
            conns = {self._conns[r]: r for r in pending}
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait([*conns, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.shutdown()
                reason = (
                    f"ranks {sorted(pending)} did not finish (limits: {timeout_s:.0f}s "
                    f"in all, {straggler_s:.0f}s after the first rank finished; finished: "
                    f"ranks {sorted(replies)})"
                )
                hung = {r: "no answer (hung, e.g. blocked in a collective)" for r in pending}
                raise PoolError(
                    _format_failures(
                        f"{what}: {reason}; pool torn down", {**_errors(replies), **hung}
                    )
                )
            for obj in ready:
                if obj in conns:
                    try:
                        replies[conns[obj]] = pickle.loads(obj.recv_bytes())
                        pending.discard(conns[obj])
                    except (EOFError, OSError):
                        pass  # the worker died: its sentinel reports it
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is not None and rank in pending:
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    self.shutdown()
                    raise PoolError(
                        _format_failures(
                            f"{what}: worker {rank} died (exit code {code}); pool torn down",
                            {**_errors(replies), rank: f"died with exit code {code}"},
                        )
                    )
        return replies

    def relay_output(self) -> None:
        """Re-emit what the workers wrote since the last call on ``sys.stdout``/``sys.stderr``."""
        for rank, files in enumerate(self._outputs):
            for file, stream in zip(files, (sys.stdout, sys.stderr), strict=True):
                text = file.read().decode(errors="replace")
                if text:
                    stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
                    stream.flush()

    def shutdown(self) -> None:
        """Stop the workers: ask each to stop, terminate those still alive after a grace period.

        A worker blocked in a collective leaves it (gloo raises) once its peers have exited.
        """
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"stop")
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.close()
        self.relay_output()
        for files in self._outputs:
            for file in files:
                file.close()
        if self._out_dir is not None:
            shutil.rmtree(self._out_dir, ignore_errors=True)
        self._procs, self._conns, self._outputs, self._out_dir, self._store = [], [], [], None, None


def _errors(replies: dict[int, tuple[str, Any]]) -> dict[int, str]:
    """The error tracebacks among ``replies`` (rank -> traceback)."""
    return {r: body for r, (kind, body) in replies.items() if kind not in ("ok", "ready")}


def _format_failures(title: str, failures: dict[int, str]) -> str:
    parts = [title]
    for rank in sorted(failures):
        parts.append(f"\n----- rank {rank} -----\n{str(failures[rank]).rstrip()}")
    return "\n".join(parts)
