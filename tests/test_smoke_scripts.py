"""The benchmark and GPU-check scripts run in their tiny CPU ``--smoke`` mode, so they never
rot.

Each script is a process that imports torch and runs a few tiny computations, so the module
runs them :data:`CONCURRENT` at a time with one thread each (``OMP_NUM_THREADS=1``, as
``test_examples.py`` runs the examples; two 2-thread processes on 2 cores took as long as
one after the other), all started by the module's first test (only those of the selected
tests); each test waits for its own script and checks its output. ``PYTHONPATH`` holds the
repository, as for the examples.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each script starts a process that imports torch (~2 s)

ROOT = Path(__file__).resolve().parents[1]
CONCURRENT = 2  # the CI machine's cores
TIMEOUT_S = 300

#: test name -> (script, its arguments but ``--out``, the JSON result file it writes there)
SCRIPTS = {
    "test_bench_single_gpu_smoke": ("benchmarks/bench_single_gpu.py", [], "bench_single_gpu.json"),
    "test_bench_window_smoke": ("benchmarks/bench_window.py", [], "bench_window.json"),
    "test_check_window_smoke": ("tests/gpu/check_window.py", [], "window.json"),
    "test_check_placed_gather_smoke": (
        "tests/gpu/check_placed_gather.py",
        [],
        "placed_gather.json",
    ),
    "test_bench_overhead_smoke": (
        "benchmarks/bench_overhead.py",
        ["--profile"],
        "bench_overhead.json",
    ),
    "test_bench_scope_tax_smoke": ("benchmarks/bench_scope_tax.py", [], "bench_scope_tax.json"),
    "test_bench_memory_smoke": ("benchmarks/bench_memory.py", [], "bench_memory.json"),
    "test_bench_decode_smoke": ("benchmarks/bench_decode.py", [], "bench_decode.json"),
}
FLEX_BALANCE_ARGS = ["--seq-len", "1024", "--world-size", "4", "--chunks", "4"]


def _command(name: str, out: Path) -> list[str]:
    if name == "test_flex_balance_smoke":  # no --smoke mode: a small size, --out a file
        script = ROOT / "benchmarks/flex_balance.py"
        return [
            sys.executable,
            str(script),
            *FLEX_BALANCE_ARGS,
            "--out",
            str(out / "flex_balance.json"),
        ]
    script, args, _ = SCRIPTS[name]
    return [sys.executable, str(ROOT / script), "--smoke", *args, "--out", str(out)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """test name -> (its output folder, the future of its script's run), for the selected
    tests of this module, started in the module's order, :data:`CONCURRENT` at a time."""
    names = [item.name for item in request.session.items if item.module is request.module]
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        started = {}
        for name in names:
            out = tmp_path_factory.mktemp(name)
            started[name] = (out, pool.submit(_run, _command(name, out)))
        yield started
        for _, future in started.values():
            future.cancel()


def smoke(runs, name: str) -> dict:
    """The JSON result of test ``name``'s script (``SCRIPTS``), once it exited 0."""
    out, future = runs[name]
    proc = future.result()
    if proc.returncode != 0:
        cmd = " ".join(proc.args)
        pytest.fail(f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    result = "flex_balance.json" if name == "test_flex_balance_smoke" else SCRIPTS[name][2]
    return json.loads((out / result).read_text())


def test_bench_single_gpu_smoke(runs):
    results = smoke(runs, "test_bench_single_gpu_smoke")
    assert not results["errors"]
    assert {r["layout"] for r in results["rings"]} == {"ring", "zigzag", "stripe"}
    zigzag = [r for r in results["rings"] if r["layout"] == "zigzag"]
    assert all(r["host_fwd_ms"] > 0 and r["gpu_ops_fwd"] is None for r in zigzag)  # CPU run
    assert results["varlen"] and all(r["documents_eff_fwd_bwd"] > 0 for r in results["varlen"])
    assert all(r["documents_gather_eff_fwd_bwd"] > 0 for r in results["varlen"])
    # the simulated ring is as precise as the single-device kernel (fp32 on CPU)
    assert all(r["ratio_max"] < 4 for r in results["precision"])


def test_bench_window_smoke(runs):
    results = smoke(runs, "test_bench_window_smoke")
    rows = {(r["layout"], r["window"]): r for r in results["rows"]}
    # the cost model: a 2-token window needs one K/V transfer on the ring, the full plan two
    assert rows["ring", 2]["kv_transfers"] == 1 and rows["ring", -1]["kv_transfers"] == 2
    assert rows["ring", 2]["rank_tflop"] < rows["ring", -1]["rank_tflop"]
    assert all(r["ratio_max"] < 4 for r in results["precision"])


def test_check_window_smoke(runs):
    """tests/gpu/check_window.py on CPU: windowed kernels, simulated rings, llama3 op."""
    results = smoke(runs, "test_check_window_smoke")
    assert not results["errors"] and len(results["rows"]) >= 8
    assert all(max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-5 for r in results["rows"])


def test_check_placed_gather_smoke(runs):
    """tests/gpu/check_placed_gather.py on CPU: placed documents' all-gather and the ring on
    the same layouts, with and without cut documents, as exact as one kernel call."""
    results = smoke(runs, "test_check_placed_gather_smoke")
    assert not results["errors"] and {r["algorithm"] for r in results["rows"]} == {
        "all_gather",
        "ring",
    }
    assert {r["cut"] > 0 for r in results["rows"]} == {True, False}
    assert all(max(r["ratio"]) < 4 for r in results["rows"])


def test_bench_overhead_smoke(runs):
    """benchmarks/bench_overhead.py on CPU: SDPA, the functional call, DTensor SDPA (a scope a
    call, and one scope held open) and the scope-free DTensor function on a 1-rank gloo group
    (the compiled variants are CUDA only), the host time layer by layer, and the profiles."""
    results = smoke(runs, "test_bench_overhead_smoke")
    rows = results["rows"]
    assert {r["what"] for r in rows} == {
        "sdpa", "functional", "dtensor", "dtensor_open", "dtensor_fn"
    }  # fmt: skip
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    layers = {r["layer"]: r["host_ms"] for r in results["layers"]}
    assert {"sdpa", "kernel", "engine", "autograd", "door"} <= set(layers)
    assert all(ms > 0 for ms in layers.values())
    assert (runs["test_bench_overhead_smoke"][0] / "profile_functional.txt").read_text().count(
        "ring_attention_impl"
    ) > 0


def test_bench_scope_tax_smoke(runs):
    """benchmarks/bench_scope_tax.py on CPU: every row measured, inside and outside the scope."""
    rows = smoke(runs, "test_bench_scope_tax_smoke")["rows"]
    where = {(r["what"], r["where"]) for r in rows}
    assert {("50 ops", "outside"), ("50 ops", "inside"), ("dtensor fwd+bwd", "inside")} <= where
    assert all(r["ms"] > 0 for r in rows)


def test_bench_memory_smoke(runs):
    """benchmarks/bench_memory.py on CPU: the phases of a simulated rank and of one device."""
    (row,) = smoke(runs, "test_bench_memory_smoke")["rows"]
    assert set(row["ring"]) == set(row["single device"]) == {"forward peak", "kept",
                                                             "backward peak"}  # fmt: skip


def test_bench_decode_smoke(runs):
    """benchmarks/bench_decode.py on CPU: the full-cache baseline, one rank's decoding step on
    a 1-rank gloo group and the W-way merge."""
    rows = smoke(runs, "test_bench_decode_smoke")["rows"]
    assert {(r["cache"], r["world"]) for r in rows} == {(256, 2), (256, 4), (512, 2), (512, 4)}
    assert all(r["full_ms"] > 0 and r["step_ms"] > 0 for r in rows)


def test_flex_balance_smoke(runs):
    """benchmarks/flex_balance.py at a small size: every mask's rows, and the mask-aware layout
    at least as balanced as ring and zigzag."""
    rows = smoke(runs, "test_flex_balance_smoke")["rows"]
    for mask in {r["mask"] for r in rows}:
        by_layout = {r["layout"]: r["imbalance"] for r in rows if r["mask"] == mask}
        assert by_layout["mask-aware k=4"] <= min(by_layout["ring"], by_layout["zigzag"]) + 1e-9
