"""ring-flash-attention's own test scripts, run on CPU (gloo, fp32) against dtensor_ring.

``tests/rfa_suite/`` holds ring-flash-attention's ``test/`` scripts (MIT, copyright kept),
changed only where marked ``dtensor_ring:`` (CPU, fp32, gloo, smaller sizes). Each case loads
a fresh copy of one script on ``W`` ranks of the session's worker pool, with

* ``flash_attn`` -> ``rfa_suite/flash_attn_cpu.py`` (fp64 math attention, flash-attn's
  signatures and return conventions), the single-device reference;
* ``ring_flash_attn`` -> a module of dtensor_ring's functions under ring-flash-attention's
  names, bound to the pool's group of ``W`` ranks;
* ``utils`` -> the adapted ``rfa_suite/utils.py``; ``dist`` (in the script and its utils) ->
  :class:`_GroupDist`, the few ``torch.distributed`` calls the scripts make, on that group;

put in ``sys.modules`` only while the script is imported (its ``from ... import`` bind them), then
calls its ``main()``. ``compile`` mode does what the scripts' ``__main__`` does with ``compile``
(rebind the ``ring_flash_attn`` functions to ``torch.compile``d ones, with
``capture_scalar_outputs``), with ``fullgraph=True`` (not for the host-side
``llama3_flash_attn_prepare_cu_seqlens``) and a frame counter proving the compiled code ran
(the reference stays eager). The scripts only print their differences; their
``log`` records them, and every ``... diff`` must stay below :data:`TOL`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys
import types
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import dtensor_ring

SUITE = Path(__file__).resolve().parent / "rfa_suite"

# ring-flash-attention's public functions (its ring_flash_attn/__init__.py), all in dtensor_ring
RFA_FUNCTIONS = [
    f"{prefix}_{form}func"
    for prefix, form in itertools.product(
        [
            "ring_flash_attn",
            "zigzag_ring_flash_attn",
            "stripe_flash_attn",
            "ring_flash_attn_varlen",
            "zigzag_ring_flash_attn_varlen",
            "llama3_flash_attn_varlen",
        ],
        ["", "kvpacked_", "qkvpacked_"],
    )
] + ["llama3_flash_attn_prepare_cu_seqlens"]

# max |ours - reference| the scripts' "... diff" logs may show: fp32 against the fp64
# reference shows ~1e-6 (out, lse) to ~1e-5 (gradients); bf16, the scripts' dtype, ~1e-2
TOL = 1e-4

DISTRIBUTED_SCRIPTS = [
    "test_ring_flash_attn_func",
    "test_zigzag_ring_flash_attn_func",
    "test_stripe_flash_attn_func",
    "test_ring_flash_attn_varlen_func",
    "test_zigzag_ring_flash_attn_varlen_func",
    "test_llama3_flash_attn_varlen_func",
]


class _GroupDist:
    """The ``torch.distributed`` calls the scripts make, on the pool's group of W ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def init_process_group(self, backend: str) -> None:
        assert backend == "gloo", backend  # the pool's processes are already in a group

    def destroy_process_group(self) -> None:
        pass  # the pool's group outlives the script

    def get_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)


def _bind(fn, group):
    """``fn`` with ``group=group`` (ring-flash-attention's functions take ``group`` too)."""

    def bound(*args, **kwargs):
        return fn(*args, group=group, **kwargs)

    return bound


def _ring_flash_attn_module(group: dist.ProcessGroup, sabotage: bool) -> types.ModuleType:
    """A stand-in ``ring_flash_attn`` module: dtensor_ring's functions, bound to ``group``.

    ``sabotage``: the attention functions' outputs are scaled by 1 + 1e-3 (the negative
    control: the checks must catch it).
    """
    module = types.ModuleType("ring_flash_attn")
    for name in RFA_FUNCTIONS:
        fn = getattr(dtensor_ring, name)
        if name != "llama3_flash_attn_prepare_cu_seqlens":
            fn = _bind(fn, group)
            if sabotage:
                fn = _sabotaged(fn)
        setattr(module, name, fn)
    return module


def _sabotaged(fn):
    def wrong(*args, **kwargs):
        out, *rest = fn(*args, **kwargs)
        return (out * (1 + 1e-3), *rest)

    return wrong


def _load(path: Path, name: str, modules: dict[str, types.ModuleType]) -> types.ModuleType:
    """Import ``path`` as a fresh module ``name``, with ``modules`` in ``sys.modules`` meanwhile."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = {key: sys.modules.get(key) for key in modules}
    sys.modules.update(modules)
    try:
        spec.loader.exec_module(module)
    finally:  # a stand-in flash_attn must not stay visible (dtensor_ring looks for flash-attn)
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module


def _compile(script: types.ModuleType, rfa: types.ModuleType, backend: str) -> list:
    """What the scripts' ``__main__`` does for ``compile``, with ``fullgraph=True``: rebind
    the ``ring_flash_attn`` functions they imported to compiled ones; their frame counters."""
    counters = []
    for name in RFA_FUNCTIONS:
        if getattr(script, name, None) is getattr(rfa, name):
            counter = CompileCounterWithBackend(backend)
            # llama3_flash_attn_prepare_cu_seqlens branches on the values of cu_seqlens (host
            # metadata, in ring-flash-attention too): it compiles with graph breaks only, so
            # without fullgraph, as the scripts compile it
            fullgraph = name != "llama3_flash_attn_prepare_cu_seqlens"
            compiled = torch.compile(getattr(rfa, name), backend=counter, fullgraph=fullgraph)
            setattr(script, name, compiled)
            counters.append((name, counter))
    return counters


@contextlib.contextmanager
def _mode(script: types.ModuleType, rfa: types.ModuleType, mode: str):
    """``eager``, or the script's ``ring_flash_attn`` functions compiled with backend ``mode``
    (``capture_scalar_outputs`` as the scripts set it); checks that each was compiled."""
    if mode == "eager":
        yield
        return
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            counters = _compile(script, rfa, backend=mode)
            assert counters, "nothing to compile"
            yield
        for name, counter in counters:
            assert counter.frame_count >= 1, f"{name} was not compiled"
    finally:
        torch._dynamo.reset()


def run_script(group, script, mode, sabotage=False):
    """Run ``rfa_suite/<script>.py``'s ``main()`` on this rank; return its logged maxima."""
    gdist = _GroupDist(group)
    utils = _load(SUITE / "utils.py", "rfa_suite_utils", {})
    utils.dist = gdist
    rfa = _ring_flash_attn_module(group, sabotage)
    modules = {
        "flash_attn": _load(SUITE / "flash_attn_cpu.py", "rfa_suite_flash_attn_cpu", {}),
        "ring_flash_attn": rfa,
        "utils": utils,
    }
    module = _load(SUITE / f"{script}.py", f"rfa_suite_{script}", modules)
    module.dist = gdist
    with _mode(module, rfa, mode):
        module.main()
    diffs = [(msg, value) for msg, value in utils.RECORDED if "diff" in msg]
    assert diffs, "the script logged no difference"
    bad = [(msg, value) for msg, value in diffs if not value <= TOL]
    assert not bad, f"differences above {TOL}: {bad}"
    return diffs


MODES = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


#: the one world size each script runs compiled by inductor at: every script once, every world
#: size twice (a dense and a varlen script each); inductor compiles only the glue around
#: dtensor_ring's custom ops, which the eager and aot_eager runs exercise at every world size
INDUCTOR_WORLD_SIZE = {script: (2, 3, 4)[i % 3] for i, script in enumerate(DISTRIBUTED_SCRIPTS)}


def _cases():
    """(script, world_size, mode): eager and aot_eager at W = 3 in the fast tier (the
    library's own tests cover every world size there), eager and aot_eager at W = 2 and 4 and
    inductor (the scripts' default) at :data:`INDUCTOR_WORLD_SIZE` in the slow tier."""
    for script in DISTRIBUTED_SCRIPTS:
        for world_size, mode in itertools.product([2, 3, 4], ["eager", "aot_eager", "inductor"]):
            if mode == "inductor" and world_size != INDUCTOR_WORLD_SIZE[script]:
                continue
            slow = mode == "inductor" or world_size != 3
            marks = [pytest.mark.slow] if slow else []
            case_id = f"{script}-{world_size}-{mode}"
            yield pytest.param(script, world_size, mode, marks=marks, id=case_id)


@pytest.mark.parametrize("script, world_size, mode", list(_cases()))
def test_rfa_script(dist_pool, script, world_size, mode):
    """One of their distributed scripts on ``world_size`` ranks (see the module docstring)."""
    results = dist_pool.run(run_script, world_size, timeout_s=400, script=script, mode=mode)
    for diffs in results:
        print(diffs)


def run_prepare_script(group, mode):
    """``test_llama3_prepare_cu_seqlens.py`` (one process, its own loop over 8 ranks); every
    result also checked against the port of ring-flash-attention's function."""
    from test_varlen import _prepare_port

    rfa = _ring_flash_attn_module(group, sabotage=False)
    module = _load(
        SUITE / "test_llama3_prepare_cu_seqlens.py",
        "rfa_suite_test_llama3_prepare_cu_seqlens",
        {"ring_flash_attn": rfa},
    )
    with _mode(module, rfa, mode):
        prepare, calls = module.llama3_flash_attn_prepare_cu_seqlens, []

        def recording(cu_seqlens, causal, rank, world_size):
            result = prepare(cu_seqlens, causal=causal, rank=rank, world_size=world_size)
            calls.append(((cu_seqlens, causal, rank, world_size), result))
            return result

        module.llama3_flash_attn_prepare_cu_seqlens = recording
        module.main()
    assert len(calls) == 8, len(calls)
    for args, got in calls:
        want = _prepare_port(*args)
        assert [t.tolist() for t in got[:2]] == [t.tolist() for t in want[:2]], (args, got)
        assert got[2:] == want[2:], (args, got, want)


@pytest.mark.parametrize("mode", MODES)
def test_rfa_prepare_cu_seqlens_script(dist_pool, mode):
    """Their single-process ``llama3_flash_attn_prepare_cu_seqlens`` script."""
    dist_pool.run(run_prepare_script, 1, timeout_s=400, mode=mode)


def test_checks_catch_a_wrong_result(dist_pool):
    """The negative control: outputs off by 1e-3 (relative) fail the checks."""
    with pytest.raises(AssertionError, match="differences above"):
        dist_pool.run(
            run_script, 2, script="test_ring_flash_attn_func", mode="eager", sabotage=True
        )
