"""The fast subset of the adversarial suite (``tests/adversarial``), in one call.

Each case runs in fresh processes (``tests/adversarial/runner.py``), so the subset runs as one
test rather than one test per case. It fails when a case whose class is not an expected one
(wrong / crash / hang / partial, or a clean error where a result is due, or the reverse) is
missing from ``tests/adversarial/known.py``, and when a case listed there now passes (then
remove it from the list). The whole suite: ``python -m tests.adversarial.run``.
"""

from __future__ import annotations

import time

from tests.adversarial.run import failures, report, run_all, select


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
