"""The examples run end to end under torchrun (4 CPU ranks, gloo) and check themselves.

Each run starts 4 processes that import torch: the slow tier.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


#: What transformers and Python print as warnings (to stderr: logging and warnings do; the
#: tests set OMP_NUM_THREADS, so torchrun prints no notice of its own).
WARNING_LINE = re.compile(r"^\[transformers\]|Warning: ", flags=re.M)


def _torchrun(script: str, *args: str, quiet: bool = False) -> str:
    """Run ``script`` on 4 local ranks; fail with its output unless it exits 0 (and, if
    ``quiet``, unless its stderr is free of warnings); return its stdout."""
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
    if quiet and WARNING_LINE.search(proc.stderr):
        pytest.fail(f"{' '.join(cmd)} printed warnings:\n{proc.stderr}")
    return proc.stdout


def test_train_llama_cp_verify():
    out = _torchrun("train_llama_cp.py", "--verify", quiet=True)
    assert "verify:" in out and "OK" in out, out


@pytest.mark.parametrize("layout", ["zigzag", "llama3", "documents"])
def test_train_llama_cp_window_verify(layout):
    """A sliding window of 24 tokens (sequences of 128) against the windowed single process;
    llama3 and documents train on packed documents (llama3 varlen attention; ring varlen on
    dr.document_layout) against per-document attention with the window."""
    out = _torchrun("train_llama_cp.py", "--layout", layout, "--window", "24", "--verify")
    assert "window=24" in out and "verify:" in out and "OK" in out, out
    assert layout == "zigzag" or f"({layout})" in out, out


def test_train_llama_cp_check_resume(tmp_path):
    """Stopped after step 2 with a DCP checkpoint and resumed into a new model and optimizer
    (another seed), the run's losses of steps 3 and 4 equal the uninterrupted run's exactly."""
    args = ["--steps", "4", "--check-resume", "2", "--checkpoint-dir", str(tmp_path)]
    out = _torchrun("train_llama_cp.py", *args)
    assert re.search(r"^saved .*step-000002 ", out, flags=re.M), out
    losses = {
        m[1]: ast.literal_eval(m[2])
        for m in re.finditer(r"^check-resume: (uninterrupted|resumed) losses (\[.*\])$", out, re.M)
    }
    assert len(losses["uninterrupted"]) == 2 and losses["resumed"] == losses["uninterrupted"], out
    assert "over steps 3..4 = 0.00e+00 (OK" in out, out
    assert not any(tmp_path.iterdir()), "the check's checkpoints were not removed"


# examples/demo.py on CPU: fp32 against fp64 full attention (S=512, H=8, H_kv=2, D=64); a
# 2-core machine measures up to about 1e-6 (out) and 4e-6 (dq, dk, dv).
DEMO_ROW = re.compile(r"^(\w+ +\w+ +\w+)\s+(\S+e[-+]\d+)\s+(\S+e[-+]\d+)\s+(\d+\.\d)$")
DEMO_TOLERANCE = {"out": 1e-5, "grad": 5e-5}


def test_demo():
    """Every layout x algorithm pair's printed errors against full attention are within fp32
    tolerances."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "demo", os.path.join(REPO_ROOT, "examples", "demo.py")
    )
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # its table of pairs (H = 8 on 4 ranks: all of them run)
    # the README's run at a quarter of its length (S = 2048 took ~45 s here, 1024 ~20 s, 512
    # ~13 s: 128 tokens a rank, 64 a zigzag or stripe chunk), one timing rep
    out = _torchrun("demo.py", "--reps", "1", "--seq", "512", quiet=True)
    assert re.search(r"^4 ranks, S=512, .*torch\.float32, cpu$", out, flags=re.M), out
    rows = {" ".join(m[1].split()): m for m in map(DEMO_ROW.match, out.splitlines()) if m}
    assert sorted(rows) == sorted(f"{a} {b} {c}" for a, b, c in demo.VARIANTS), out
    for name, m in rows.items():
        out_err, grad_err, ms = float(m[2]), float(m[3]), float(m[4])
        assert out_err < DEMO_TOLERANCE["out"], (name, out_err, out)
        assert grad_err < DEMO_TOLERANCE["grad"], (name, grad_err, out)
        assert ms > 0, (name, out)


def test_generate_cp_verify():
    """Context-parallel generation (sharded KV cache) against one-process model.generate."""
    pytest.importorskip("transformers")
    args = ["--verify", "--prompt-len", "37", "--window", "8"]
    out = _torchrun("generate_cp.py", *args, quiet=True)  # no advice from transformers
    assert "verify: OK" in out, out
