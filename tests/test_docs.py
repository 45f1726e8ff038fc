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
