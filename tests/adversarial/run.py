"""Command line of the adversarial suite: run cases, print the counts, write JSON.

    python -m tests.adversarial.run [--fast] [--kinds base,args] [--match TEXT] [--jobs 2]
                                    [--json out.json] [--timeout 60] [--list]

Prints a table of counts (kind x class), then every case that did not pass (its class is not
an expected one: wrong / crash / hang / partial, or an unexpected correct / clean_error), with
a one-line reason, marked ``known`` when listed in :mod:`tests.adversarial.known`, and the
known cases that now pass. ``[nodebug]`` cases of the ``disagree`` kind are informational
(ranks disagreeing without the consistency mode): counted, listed apart, never failures.
Exit status 1 when a case outside the known list failed or a known case passed.
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
    cases: list[Case], jobs: int = 2, timeout_s: float | None = None, progress: bool = False
) -> list[Result]:
    """Run ``cases`` ``jobs`` at a time; results in the order of ``cases``."""

    def one(case: Case) -> Result:
        result = run_case(case, timeout_s)
        if progress:
            mark = {True: ".", False: "F", None: "i"}[result.passed]
            print(mark, end="", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, cases))
    if progress:
        print()
    return results


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


def report(results: list[Result], seconds: float) -> str:
    new, known, fixed = failures(results)
    info = [r for r in results if r.passed is None]
    lines = [
        f"{len(results)} cases in {seconds:.0f}s",
        counts_table(results),
        "",
        f"failed (class not expected): {len(new) + len(known)} ({len(known)} known)",
    ]
    lines += [_line(r, "known " if r.name in KNOWN_FAILING else "") for r in new + known]
    if fixed:
        lines += ["", f"known failures that now pass ({len(fixed)}): remove them from known.py"]
        lines += [f"  {r.name}" for r in fixed]
    if info:
        lines += ["", "informational ([nodebug]: ranks disagree, consistency mode off):"]
        lines += [_line(r, "") for r in info]
    return "\n".join(lines)


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
    results = run_all(cases, args.jobs, args.timeout, progress=sys.stdout.isatty())
    print(report(results, time.monotonic() - start))
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
