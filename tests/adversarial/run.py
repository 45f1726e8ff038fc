"""Command line of the adversarial suite: run cases, print the counts, write JSON.

    python -m tests.adversarial.run [--fast] [--kinds base,args] [--match TEXT] [--jobs 2]
                                    [--json out.json] [--timeout 60] [--list] [--verbose]

Prints progress (a mark per case on a terminal, a line every 50 cases in a log), a table of
counts (kind x class), a one-line summary of the informational ``[nodebug]`` cases of the
``disagree`` kind (ranks disagreeing without the consistency mode: never failures; listed with
``--verbose``), every case that did not pass (its class is not an expected one: wrong / crash /
hang / partial, or an unexpected correct / clean_error) with a one-line reason, marked
``known`` when listed in :mod:`tests.adversarial.known`, the known cases that now pass, and
the verdict last. Exit status 1 when a case outside the known list failed or a known case
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.adversarial.cases import KINDS, all_cases  # noqa: E402
from tests.adversarial.known import KNOWN_FAILING  # noqa: E402
from tests.adversarial.runner import CLASSES, Case, Result, run_case  # noqa: E402


def select(fast: bool = False, kinds: list[str] | None = None, match: str = "") -> list[Case]:
    """The cases of ``kinds`` (all by default), only the fast ones if ``fast``, only those
    whose name contains ``match``."""
    cases = all_cases(kinds)
    return [c for c in cases if (c.fast or not fast) and match in c.name]


def run_all(
    cases: list[Case],
    jobs: int = 2,
    timeout_s: float | None = None,
    progress: str | None = None,
    every: int = 50,
) -> list[Result]:
    """Run ``cases`` ``jobs`` at a time; results in the order of ``cases``. ``progress``:
    "dots" (a terminal: one mark per case), "lines" (a log: :func:`progress_line` every
    ``every`` cases and at the end), or None."""
    start, done, failed = time.monotonic(), [0], [0]

    def one(case: Case) -> Result:
        result = run_case(case, timeout_s)
        done[0] += 1
        failed[0] += result.passed is False
        if progress == "dots":
            print({True: ".", False: "F", None: "i"}[result.passed], end="", flush=True)
        elif progress == "lines" and (done[0] % every == 0 or done[0] == len(cases)):
            print(progress_line(done[0], len(cases), failed[0], time.monotonic() - start))
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, cases))
    if progress == "dots":
        print()
    return results


def progress_line(done: int, total: int, failed: int, seconds: float) -> str:
    """One line of progress for a log: cases done, not-passed so far, elapsed time."""
    return f"[{done}/{total}] {failed} failed so far, {seconds:.0f}s"


def counts_table(results: list[Result]) -> str:
    """Counts by kind (rows) and class (columns)."""
    kinds = list(dict.fromkeys(r.kind for r in results))
    width = max(len(k) for k in [*kinds, "total"]) + 2
    lines = [f"{'kind':<{width}}" + "".join(f"{c:>13}" for c in CLASSES) + f"{'total':>8}"]
    for kind in [*kinds, "total"]:
        rows = [r for r in results if kind in ("total", r.kind)]
        cells = "".join(f"{sum(r.cls == c for r in rows):>13}" for c in CLASSES)
        lines.append(f"{kind:<{width}}{cells}{len(rows):>8}")
    return "\n".join(lines)


def failures(results: list[Result]) -> tuple[list[Result], list[Result], list[Result]]:
    """``(new failures, known failures, known cases that now pass)``."""
    failed = [r for r in results if r.passed is False]
    new = [r for r in failed if r.name not in KNOWN_FAILING]
    known = [r for r in failed if r.name in KNOWN_FAILING]
    fixed = [r for r in results if r.passed and r.name in KNOWN_FAILING]
    return new, known, fixed


def report(results: list[Result], seconds: float, verbose: bool = False) -> str:
    """The counts, the informational cases (summarised; each one with ``verbose``), the cases
    that did not pass, and the verdict last."""
    new, known, fixed = failures(results)
    info = [r for r in results if r.passed is None]
    lines = [f"{len(results)} cases in {seconds:.0f}s", counts_table(results)]
    if info:
        lines += ["", info_summary(info)]
        if verbose:
            lines += [_line(r, "") for r in info]
    if new or known:
        lines += ["", "not passed (class not expected):"]
        lines += [_line(r, "known " if r.name in KNOWN_FAILING else "") for r in new + known]
    if fixed:
        lines += ["", f"known failures that now pass ({len(fixed)}): remove them from known.py"]
        lines += [f"  {r.name}" for r in fixed]
    verdict = "FAILED" if new or fixed else "OK"
    lines += [
        "",
        f"{verdict}: {len(new)} unexpected failures, {len(known)} known, {len(fixed)} known "
        "now passing",
    ]
    return "\n".join(lines)


def info_summary(info: list[Result]) -> str:
    """The informational cases in a few lines: how many of each class (ranks that disagree
    with the consistency mode off are not failures: the mode turns each into one error)."""
    by_class: dict[str, int] = {}
    for r in info:
        by_class[r.cls] = by_class.get(r.cls, 0) + 1
    counts = ", ".join(f"{n} {cls}" for cls, n in sorted(by_class.items()))
    return (
        f"informational: {len(info)} [nodebug] cases (ranks that disagree, consistency mode "
        f"off; each has a debug twin that must raise on every rank): {counts}; --verbose lists "
        "them"
    )


def _line(r: Result, tag: str) -> str:
    expected = "/".join(r.expect) if r.expect else "-"
    return f"  {tag}{r.cls:<11} (expected {expected}) {r.name}: {r.reason}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="only the CI subset")
    parser.add_argument("--kinds", default="", help=f"comma-separated, of {','.join(KINDS)}")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at the same time")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per case")
    parser.add_argument("--json", default="", help="write every result here")
    parser.add_argument("--list", action="store_true", help="list the cases, run nothing")
    parser.add_argument("--verbose", action="store_true", help="list every informational case")
    parser.add_argument(
        "--update-known",
        action="store_true",
        help="rewrite known.py: the failing cases among those run (others listed are kept)",
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k] or None
    cases = select(args.fast, kinds, args.match)
    if args.list:
        print("\n".join(f"{c.name}  expect={sorted(c.expect or [])}" for c in cases))
        return 0
    start = time.monotonic()
    progress = "dots" if sys.stdout.isatty() else "lines"
    results = run_all(cases, args.jobs, args.timeout, progress=progress)
    print(report(results, time.monotonic() - start, args.verbose))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(r) for r in results], f, indent=1)
    if args.update_known:
        write_known(results)
        return 0
    new, _, fixed = failures(results)
    return 1 if new or fixed else 0


KNOWN_HEADER = '''\
"""Cases that fail today (their class is not an expected one): the suite's xfail list.

Generated by ``python -m tests.adversarial.run --update-known`` (a full run rewrites it; a
partial run replaces only the cases it ran); ``#kind:count`` lines are headings.
``tests/test_adversarial.py`` fails when a fast case outside this list fails, and when a case
in it passes: then remove it from here (or regenerate).
"""

_NAMES = """
'''
KNOWN_FOOTER = '''"""

KNOWN_FAILING = frozenset(n for n in _NAMES.split() if not n.startswith("#"))
'''


def write_known(results: list[Result]) -> None:
    """Rewrite ``known.py``: the failing cases among ``results`` plus the listed cases that
    were not run."""
    ran = {r.name for r in results}
    names = {n for n in KNOWN_FAILING if n not in ran}
    names |= {r.name for r in results if r.passed is False}
    by_kind: dict[str, list[str]] = {}
    for name in sorted(names):
        by_kind.setdefault(name.split("/")[0], []).append(name)
    body = "".join(
        f"#{kind}:{len(group)}\n" + "".join(f"{n}\n" for n in group)
        for kind, group in by_kind.items()
    )
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "known.py")
    with open(path, "w") as f:
        f.write(KNOWN_HEADER + body + KNOWN_FOOTER)
    print(f"wrote {len(names)} names to {path}")


if __name__ == "__main__":
    sys.exit(main())
