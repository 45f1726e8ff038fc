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


@pytest.mark.slow  # collects the whole suite in a subprocess (~10 s)
def test_stated_test_counts():
    """The test counts of design.md's "Testing tiers" table (their one home: the other docs
    link there) are the suite's: pytest's collection of the fast tier and of the whole."""
    import subprocess
    import sys

    root = os.path.dirname(DESIGN).removesuffix("docs")
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", "not slow"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.splitlines()[-1]
    fast, total, slow = map(
        int, re.match(r"(\d+)/(\d+) tests collected \((\d+) deselected", collected).groups()
    )
    with open(DESIGN) as f:
        table = f.read().split("## Testing tiers", 1)[1]
    stated = {
        tier: int(n)
        for tier, n in re.findall(r"^\| (fast|slow|all) [^|]*\| [^|]*\| (\d+) \|", table, re.M)
    }
    assert stated == {"fast": fast, "slow": slow, "all": total}, (stated, collected)
