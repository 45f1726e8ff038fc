"""The fast subset of the adversarial suite (``tests/adversarial``), in one call.

Each case runs in fresh processes (``tests/adversarial/runner.py``), so the subset runs as one
test rather than one test per case. It fails when a case whose class is not an expected one
(wrong / crash / hang / partial, or a clean error where a result is due, or the reverse) is
missing from ``tests/adversarial/known.py``, and when a case listed there now passes (then
remove it from the list). The whole suite: ``python -m tests.adversarial.run``.
"""

from __future__ import annotations

import time

from tests.adversarial.run import failures, progress_line, report, run_all, select
from tests.adversarial.runner import Result


def test_adversarial_fast_subset():
    cases = select(fast=True)
    start = time.monotonic()
    results = run_all(cases, jobs=2)
    print(report(results, time.monotonic() - start))
    new, _, fixed = failures(results)
    problems = [f"{r.name}: {r.cls} (expected {'/'.join(r.expect)}): {r.reason}" for r in new]
    problems += [
        f"{r.name} now passes ({r.cls}): remove it from tests/adversarial/known.py" for r in fixed
    ]
    assert not problems, "\n".join(problems)


def _result(name: str, cls: str, expect: tuple[str, ...] | None) -> Result:
    return Result(name, name.split("/")[0], 2, cls, "why", 0.1, expect)


def test_report_format():
    """The runner's report: informational cases summarised in one line (listed only when
    verbose), cases that did not pass listed, and the verdict the last line."""
    results = [
        _result("base/a/W2/x", "correct", ("correct",)),
        _result("disagree/a/W2/y[nodebug]", "crash", None),
        _result("disagree/a/W3/y[nodebug]", "hang", None),
        _result("base/a/W2/z", "wrong", ("correct",)),
    ]
    text = report(results, 3.0)
    lines = text.splitlines()
    assert lines[-1] == "FAILED: 1 unexpected failures, 0 known, 0 known now passing", text
    summary = [line for line in lines if line.startswith("informational: 2 [nodebug]")]
    assert summary and "1 crash, 1 hang" in summary[0], text
    assert "disagree/a/W2/y[nodebug]" not in text  # summarised, not listed
    assert "disagree/a/W2/y[nodebug]" in report(results, 3.0, verbose=True)
    assert "base/a/W2/z" in text
    assert report(results[:3], 1.0).splitlines()[-1].startswith("OK: 0 unexpected")


def test_progress_line():
    assert progress_line(50, 200, 1, 12.4) == "[50/200] 1 failed so far, 12s"
