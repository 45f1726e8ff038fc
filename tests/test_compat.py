"""``dtensor_ring._compat``: every private PyTorch API, resolved lazily (single process, fast).

1. Every private aten op in ``PRIVATE_ATEN_OPS`` (and the module docstring's table) resolves on
   this torch, and every user of one (block kernels, ``ring_sdpa``'s op families) is listed.
2. A torch lacking one of them still imports ``dtensor_ring``; the backend that needs it is
   skipped by kernel selection, with the missing op as the reason (run in a subprocess that
   hides the op from ``torch.ops.aten`` before the import).
3. ``_resolve_process_group`` is looked up at call time, with a clear error when missing.
4. ``torch.utils.checkpoint``'s internals have the form ``_compat/checkpoint.py`` knows: the
   recomputation (reentrant and not) runs the wrapped function, the first pass the original;
   everything is restored on exit; a torch without them gets a ``RuntimeError`` naming them.
5. No module outside ``dtensor_ring/_compat/`` names a private PyTorch API directly.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed import distributed_c10d

import dtensor_ring._compat as compat
from dtensor_ring._compat import checkpoint as compat_checkpoint
from dtensor_ring.api.dtensor import ATEN_SDPA_OPS
from dtensor_ring.kernels import BACKENDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dtensor_ring"


def test_every_private_aten_op_resolves():
    for name in compat.PRIVATE_ATEN_OPS:
        op = compat.aten_op(name)
        assert isinstance(op, torch._ops.OpOverloadPacket), (name, torch.__version__)
        assert op is getattr(torch.ops.aten, name)
        assert compat.require_aten_op(name) is op
    assert compat.missing_aten_ops(*compat.PRIVATE_ATEN_OPS) is None


def test_docstring_table_lists_exactly_the_ops():
    rows = re.findall(r"^``(_\w+)``\s", compat.__doc__, flags=re.MULTILINE)
    assert sorted(rows) == sorted(compat.PRIVATE_ATEN_OPS)
    assert len(set(compat.PRIVATE_ATEN_OPS)) == len(compat.PRIVATE_ATEN_OPS)


def test_users_of_private_ops_are_listed():
    # aten_op raises ValueError for an op missing from PRIVATE_ATEN_OPS.
    for backend in BACKENDS:
        backend.is_available()  # a reason or None, never an exception
    for family in ATEN_SDPA_OPS:
        assert family.available, family
        assert family.forward_op is compat.aten_op(family.forward).default
        assert family.backward_op is compat.aten_op(family.backward).default
    with pytest.raises(ValueError, match="PRIVATE_ATEN_OPS"):
        compat.aten_op("_softmax")


def test_missing_op_reason_names_op_and_version(monkeypatch):
    name = "_flash_attention_forward"
    monkeypatch.setattr(compat, "aten_op", lambda n: None if n == name else torch.ops.aten.add)
    reason = compat.missing_aten_ops("_flash_attention_backward", name)
    assert reason is not None
    assert f"torch {torch.__version__} lacks aten.{name}" in reason
    with pytest.raises(RuntimeError, match=f"lacks aten.{name}"):
        compat.require_aten_op(name)


_HIDE_AND_IMPORT = textwrap.dedent(
    """
    import sys

    sys.path.insert(0, {root!r})
    import torch
    import torch.distributed as dist

    # torch's own modules resolve SDPA ops when imported (DTensor's sharding rules): let them,
    # then hide the op from every later lookup, as a torch build without it would.
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.experimental  # noqa: F401
    import torch.nn.attention  # noqa: F401

    HIDDEN = {hidden!r}
    namespace = torch.ops.aten
    vars(namespace).pop(HIDDEN, None)  # resolved packets are cached as attributes
    real_getattr = type(namespace).__getattr__

    def hiding_getattr(self, name):
        if self is namespace and name == HIDDEN:
            raise AttributeError(f"'_OpNamespace' 'aten' object has no attribute {{name!r}}")
        return real_getattr(self, name)

    type(namespace).__getattr__ = hiding_getattr
    assert not hasattr(torch.ops.aten, HIDDEN)
    assert "dtensor_ring" not in sys.modules

    import dtensor_ring
    from dtensor_ring.api.dtensor import ATEN_SDPA_OPS, SDPAConfig
    from dtensor_ring.api.dtensor.handlers import aten_handlers
    from dtensor_ring.kernels import KernelCall, select_kernel

    call = KernelCall("cpu", torch.float64, 16, 2, 2)
    assert select_kernel(call).name == "math", select_kernel(call).name
    try:
        select_kernel(call, backend="cpu_flash")
    except ValueError as e:
        print("REASON:", str(e).splitlines()[1])
    else:
        raise AssertionError("cpu_flash was selected without its op")

    # ring_sdpa leaves the family without ops to SDPA and keeps the others.
    handlers = aten_handlers(SDPAConfig("zigzag", None))
    kept = {{f.forward for f in ATEN_SDPA_OPS if f.available}}
    assert HIDDEN not in kept and len(kept) == len(ATEN_SDPA_OPS) - 1, kept
    assert len(handlers) == 2 * len(kept), len(handlers)

    # Ring attention still runs (on the math kernel), here on one gloo rank.
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64) for _ in range(3))
    out = dtensor_ring.zigzag_ring_flash_attn_func(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert (out - ref).abs().max().item() < 1e-10
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.slow  # a fresh interpreter
def test_import_survives_a_missing_private_op():
    hidden = "_scaled_dot_product_flash_attention_for_cpu"
    script = _HIDE_AND_IMPORT.format(root=str(ROOT), hidden=hidden)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK", proc.stdout
    reason = next(line for line in lines if line.startswith("REASON:"))
    assert f"cpu_flash: torch {torch.__version__} lacks aten.{hidden}" in reason, reason


def test_resolve_group_is_looked_up_lazily(monkeypatch):
    monkeypatch.delattr(distributed_c10d, "_resolve_process_group")
    with pytest.raises(RuntimeError, match=r"_resolve_process_group is missing from torch"):
        compat.resolve_group("0")


def _checkpoint_internals() -> tuple:
    ckpt = torch.utils.checkpoint
    return ckpt.CheckpointFunction.__dict__["forward"], ckpt._CheckpointFrame.__dict__["__init__"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_runs_the_wrapped_function(reentrant):
    assert compat_checkpoint.missing_checkpoint_api() is None
    originals = _checkpoint_internals()
    runs = []

    def wrap(function):
        def recompute(*args):
            runs.append("recompute")
            return function(*args)

        return recompute

    def block(x):
        runs.append("block")
        return x.sin() * 2

    x = torch.randn(3, requires_grad=True)
    with compat_checkpoint.wrapped_recomputations(wrap):
        with compat_checkpoint.wrapped_recomputations(wrap):  # nests
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        assert _checkpoint_internals() != originals
    assert _checkpoint_internals() == originals  # restored: the backward runs after
    y.sum().backward()
    assert runs == ["block", "recompute", "block"], runs
    torch.testing.assert_close(x.grad, 2 * x.cos())
    with pytest.raises(KeyError), compat_checkpoint.wrapped_recomputations(wrap):
        raise KeyError
    assert _checkpoint_internals() == originals


def test_missing_checkpoint_internals_raise(monkeypatch):
    monkeypatch.delattr(torch.utils.checkpoint, "_CheckpointFrame")
    compat_checkpoint.missing_checkpoint_api.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"lacks torch\.utils\.checkpoint\.Checkpoint"):
            with compat_checkpoint.wrapped_recomputations(lambda f: f):
                pass
    finally:
        monkeypatch.undo()
        compat_checkpoint.missing_checkpoint_api.cache_clear()
    assert compat_checkpoint.missing_checkpoint_api() is None


_PRIVATE = (
    "torch.ops.aten._",
    "getattr(torch.ops.aten",
    "torch._dynamo",
    "_resolve_process_group",
    "CheckpointFunction",
    "_CheckpointFrame",
)


def test_private_apis_only_in_compat():
    compat_dir = PACKAGE / "_compat"
    offenders = [
        f"{path.relative_to(ROOT)}: {needle}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if compat_dir not in path.parents
        for needle in _PRIVATE
        if needle in path.read_text()
    ]
    assert not offenders, offenders
