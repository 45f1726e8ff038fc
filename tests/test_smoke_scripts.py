"""The benchmark and GPU-check scripts run in their tiny CPU ``--smoke`` mode, so they never
rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each script starts a process that imports torch (~2 s)

ROOT = Path(__file__).resolve().parents[1]


def smoke(script: str, tmp_path: Path, result: str, *args: str) -> dict:
    """Run ``script`` (relative to the repository) with ``--smoke --out tmp_path`` and
    ``args``; its JSON ``result`` file, read."""
    cmd = [sys.executable, str(ROOT / script), "--smoke", *args, "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    return json.loads((tmp_path / result).read_text())


def test_bench_single_gpu_smoke(tmp_path):
    results = smoke("benchmarks/bench_single_gpu.py", tmp_path, "bench_single_gpu.json")
    assert not results["errors"]
    assert {r["layout"] for r in results["rings"]} == {"ring", "zigzag", "stripe"}
    # the simulated ring is as precise as the single-device kernel (fp32 on CPU)
    assert all(r["ratio_max"] < 4 for r in results["precision"])


def test_bench_window_smoke(tmp_path):
    results = smoke("benchmarks/bench_window.py", tmp_path, "bench_window.json")
    rows = {(r["layout"], r["window"]): r for r in results["rows"]}
    # the cost model: a 2-token window needs one K/V transfer on the ring, the full plan two
    assert rows["ring", 2]["kv_transfers"] == 1 and rows["ring", -1]["kv_transfers"] == 2
    assert rows["ring", 2]["rank_tflop"] < rows["ring", -1]["rank_tflop"]
    assert all(r["ratio_max"] < 4 for r in results["precision"])


def test_check_window_smoke(tmp_path):
    """tests/gpu/check_window.py on CPU: windowed kernels, simulated rings, llama3 op."""
    results = smoke("tests/gpu/check_window.py", tmp_path, "window.json")
    assert not results["errors"] and len(results["rows"]) >= 8
    assert all(max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-5 for r in results["rows"])


def test_bench_overhead_smoke(tmp_path):
    """benchmarks/bench_overhead.py on CPU: SDPA, the functional call, DTensor SDPA and the
    scope-free DTensor function on a 1-rank gloo group (the compiled variants are CUDA only),
    and the profiles."""
    results = smoke("benchmarks/bench_overhead.py", tmp_path, "bench_overhead.json", "--profile")
    rows = results["rows"]
    assert {r["what"] for r in rows} == {"sdpa", "functional", "dtensor", "dtensor_fn"}
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    assert (tmp_path / "profile_functional.txt").read_text().count("ring_attention_impl") > 0


def test_bench_scope_tax_smoke(tmp_path):
    """benchmarks/bench_scope_tax.py on CPU: every row measured, inside and outside the scope."""
    rows = smoke("benchmarks/bench_scope_tax.py", tmp_path, "bench_scope_tax.json")["rows"]
    where = {(r["what"], r["where"]) for r in rows}
    assert {("50 ops", "outside"), ("50 ops", "inside"), ("dtensor fwd+bwd", "inside")} <= where
    assert all(r["ms"] > 0 for r in rows)


def test_bench_memory_smoke(tmp_path):
    """benchmarks/bench_memory.py on CPU: the phases of a simulated rank and of one device."""
    (row,) = smoke("benchmarks/bench_memory.py", tmp_path, "bench_memory.json")["rows"]
    assert set(row["ring"]) == set(row["single device"]) == {"forward peak", "kept",
                                                             "backward peak"}  # fmt: skip


def test_bench_decode_smoke(tmp_path):
    """benchmarks/bench_decode.py on CPU: the full-cache baseline, one rank's decoding step on
    a 1-rank gloo group and the W-way merge."""
    rows = smoke("benchmarks/bench_decode.py", tmp_path, "bench_decode.json")["rows"]
    assert {(r["cache"], r["world"]) for r in rows} == {(256, 2), (256, 4), (512, 2), (512, 4)}
    assert all(r["full_ms"] > 0 and r["step_ms"] > 0 for r in rows)


def test_flex_balance_smoke(tmp_path):
    """benchmarks/flex_balance.py at a small size: every mask's rows, and the mask-aware layout
    at least as balanced as ring and zigzag."""
    out = tmp_path / "flex_balance.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/flex_balance.py"),
            "--seq-len",
            "1024",
            "--world-size",
            "4",
            "--chunks",
            "4",
            "--out",
            str(out),
        ],  # fmt: skip
        check=True,
        timeout=300,
        capture_output=True,
    )
    rows = json.loads(out.read_text())["rows"]
    for mask in {r["mask"] for r in rows}:
        by_layout = {r["layout"]: r["imbalance"] for r in rows if r["mask"] == mask}
        assert by_layout["mask-aware k=4"] <= min(by_layout["ring"], by_layout["zigzag"]) + 1e-9
