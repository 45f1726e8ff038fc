"""The ``# runnable`` Python blocks of docs/quickstart.md run as written (single process)."""

from __future__ import annotations

import os
import re

import pytest

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "quickstart.md"
)
MARK = "# runnable"


def _runnable_blocks() -> list[str]:
    with open(DOC) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
    return [b for b in blocks if b.startswith(MARK)]


def test_has_runnable_blocks():
    assert _runnable_blocks()


@pytest.mark.parametrize("block", _runnable_blocks())
def test_block_runs(block):
    exec(compile(block, DOC, "exec"), {"__name__": "__docs__"})


DESIGN = os.path.join(os.path.dirname(DOC), "design.md")
ROOT = os.path.dirname(os.path.dirname(DESIGN))
#: a row of design.md's tiers table: tier, command, "about N" tests, time
TIER_ROW = re.compile(
    r"^\| (fast|slow|all)\b[^|]*\| `([^`]+)` \| about (\d+) \| ([^|]+?) \|$", re.M
)
MINUTES = re.compile(r"^(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) min$")


def _tiers_section() -> str:
    with open(DESIGN) as f:
        text = f.read()
    start = text.index("## Testing tiers")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def _tiers() -> dict[str, tuple[str, int, str]]:
    """tier -> (command, stated test count, time) of design.md's "Testing tiers" table."""
    section = _tiers_section()
    rows = {m[1]: (m[2], int(m[3]), m[4]) for m in TIER_ROW.finditer(section)}
    assert sorted(rows) == ["all", "fast", "slow"], section
    return rows


def _close(actual: int, stated: int) -> bool:
    """What "about N" allows: 10% of N, or 10."""
    return abs(actual - stated) <= max(0.1 * stated, 10)


def _rounded(count: int) -> int:
    return round(count, -2 if count >= 1000 else -1)


@pytest.mark.slow  # collects the whole suite in a subprocess (~10 s)
def test_stated_test_counts():
    """The test counts of design.md's "Testing tiers" table (their one home: the other docs
    link there) are the suite's, rounded: one pytest collection (of the slow tier: its summary
    line counts both). For the README's install, transformers included."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", "slow"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = re.search(r"^(\d+)/(\d+) tests collected \((\d+) deselected", proc.stdout, re.M)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    slow, total, fast = map(int, found.groups())
    tiers = _tiers()
    wrong = [
        f"{tier}: about {tiers[tier][1]} stated, {n} collected (write about {_rounded(n)})"
        for tier, n in (("fast", fast), ("slow", slow), ("all", total))
        if not _close(n, tiers[tier][1])
    ]
    assert not wrong, "docs/design.md's Testing tiers table: " + "; ".join(wrong)


def test_tiers_table_is_consistent():
    """The tiers add up, the commands are the README's, and the times are dated ranges of
    minutes, the fast tier's below the whole suite's (nothing here times the suite)."""
    tiers = _tiers()
    assert tiers["fast"][0] == 'python -m pytest -q -m "not slow"'
    assert tiers["slow"][0] == "python -m pytest -q -m slow"
    assert tiers["all"][0] == "python -m pytest -q"
    assert _close(tiers["fast"][1] + tiers["slow"][1], tiers["all"][1]), tiers
    fast, full = (MINUTES.match(tiers[t][2]) for t in ("fast", "all"))
    assert fast and full, tiers
    (f_lo, f_hi), (a_lo, a_hi) = ((float(m[1]), float(m[2])) for m in (fast, full))
    assert f_lo < f_hi and a_lo < a_hi and f_lo < a_lo and f_hi < a_hi, tiers
    header = next(line for line in _tiers_section().splitlines() if line.startswith("| tier"))
    assert re.search(r"2 cores, \d{4}-\d{2}-\d{2}", header), header
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"\n{tiers['all'][0]}\n" in f.read().replace("&& ", "\n")


def test_suite_numbers_have_one_home():
    """The README, the quickstart and the index state no test counts and no times measured on
    no stated machine: the README and the quickstart link to the table instead."""
    number = re.compile(
        r"\d[\d,]* (tests?|passed|deselected)\b|about \d+(\.\d+)? ?(s|min|minutes?)\b"
        r"|\d+(\.\d+)?s \(0:"
    )
    for path in ("README.md", "docs/quickstart.md", "docs/index.md"):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert not number.search(text), (path, number.search(text))
        if path != "docs/index.md":
            assert "design.md#testing-tiers-cheapest-first" in text, path


def test_adversarial_case_count():
    """design.md's "about N cases" of the adversarial suite, and of its fast subset."""
    from tests.adversarial.run import select

    stated = re.search(r"about (\d+) cases \(the fast subset, about (\d+),", _tiers_section())
    assert stated, "design.md's Testing tiers no longer states the adversarial case counts"
    for n, cases in ((int(stated[1]), select()), (int(stated[2]), select(fast=True))):
        assert _close(len(cases), n), (
            f"design.md: about {n}, {len(cases)} cases (about {_rounded(len(cases))})"
        )


def test_checkpoint_folders_are_ignored():
    """``train_llama_cp.py --checkpoint-dir DIR`` leaves nothing untracked, for DIR = ckpt
    (docs/examples.md) or any folder in the tree: its ``step-NNNNNN`` folders are ignored."""
    import subprocess

    paths = ["ckpt/step-000004/.metadata", "runs/a/step-000012/__0_0.distcp"]
    try:
        proc = subprocess.run(
            ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if proc.returncode == 128:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    assert proc.stdout.split() == paths, proc.stdout + proc.stderr


def test_ruff_is_pinned_once():
    """The ruff release CI lints with is pinned in pyproject.toml's dev extra, which .ci/run
    installs, and nowhere else (design.md: `pip install -e ".[dev]"`)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pins = re.findall(r'"ruff==([^"]+)"', f.read())
    assert len(pins) == 1, pins
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "ruff==" not in ci and '".[dev]"' in ci, ci
