"""The examples run end to end under torchrun (4 CPU ranks, gloo) and check themselves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def _torchrun(script: str, *args: str) -> str:
    """Run ``script`` on 4 local ranks; fail with its output unless it exits 0."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--standalone",
        os.path.join(REPO_ROOT, "examples", script),
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def test_train_llama_cp_verify():
    out = _torchrun("train_llama_cp.py", "--verify")
    assert "verify:" in out and "OK" in out, out


def test_train_llama_cp_llama3_verify():
    """Packed documents (llama3 varlen attention) against per-document attention."""
    out = _torchrun("train_llama_cp.py", "--layout", "llama3", "--verify")
    assert "(llama3)" in out and "verify:" in out and "OK" in out, out


@pytest.mark.parametrize("layout", ["zigzag", "llama3"])
def test_train_llama_cp_window_verify(layout):
    """A sliding window of 24 tokens (sequences of 128) against the windowed single process."""
    out = _torchrun("train_llama_cp.py", "--layout", layout, "--window", "24", "--verify")
    assert "window=24" in out and "verify:" in out and "OK" in out, out


def test_demo():
    out = _torchrun("demo.py")
    assert "zigzag" in out and "stripe" in out, out
