"""Cases of the ``rank_local`` kind: one rank differs from the others in a fact only it sees.

Every choice that decides communication (``layout="auto"``'s algorithm, the kernel, the plan)
must depend only on what all ranks share, or be agreed on collectively (issue #25 item 3):
a rank that differs in a fact of its own process must get the same choice as the others (the
exact result everywhere), or every rank a clean error. Never a hang, which is what a choice
made from a rank-local fact gives (ranks in different collectives). Rank 0 differs in one of
:data:`FACTS`:

* ``requires_grad``: rank 0's q, k, v require grad, the others' do not (forward only: a
  backward on some ranks alone is a hang by construction, as in any SPMD program);
* ``grad_mode``: every rank's q, k, v require grad; rank 0 runs under ``torch.no_grad()``;
* ``deterministic``: ``torch.use_deterministic_algorithms(True)`` on rank 0 alone;
* ``contiguity``: rank 0's tensors are transposed views (other strides);
* ``threads``: rank 0 runs with another number of intra-op threads;
* ``autocast``: rank 0 runs under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fp32 data;
  SDPA on DTensors autocasts, the custom ops do not): exact, or a clean error on every rank
  (a dtype disagreement, caught by the header of Note [Consistency header]);
* ``python_mode``: rank 0 runs under a pass-through ``TorchDispatchMode``, which sends its
  calls down the custom ops' dispatch (Note [Eager calls]) and its SDPA on DTensors through
  the aten-op handlers (Note [Eager SDPA on DTensors]) while the others take the eager paths;
* ``python_mode_math``: the same with only SDPA's math backend enabled, so SDPA finds no fused
  kernel for rank 0's handler route, which then runs the eager route.

Through the doors that choose (``layout="auto"``: the functional, varlen, transformers,
``context_parallel`` and DTensor doors) and plain ring / zigzag / Ulysses doors, forward and
backward where the fact allows, against the fp64 reference (:mod:`tests.adversarial.oracle`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cases import AUTO_CHOOSING, CORRECT, EITHER, Setup, _case, _doors, _pick, attention_case
from .doors import Ctx, Door
from .runner import Case

FACTS = (
    "requires_grad",
    "grad_mode",
    "deterministic",
    "contiguity",
    "threads",
    "autocast",
    "python_mode",
    "python_mode_math",
)


@contextlib.contextmanager
def _differing(fact: str, differs: bool) -> Iterator[None]:
    """The process state of ``fact`` on the rank that differs (nothing on the others)."""
    from tests.modes import PassThroughMode

    if not differs:
        yield
    elif fact == "grad_mode":
        with torch.no_grad():
            yield
    elif fact == "deterministic":
        old = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(old)
    elif fact == "threads":
        old = torch.get_num_threads()
        torch.set_num_threads(1 if old > 1 else 2)
        try:
            yield
        finally:
            torch.set_num_threads(old)
    elif fact == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif fact == "python_mode":
        with PassThroughMode():
            yield
    elif fact == "python_mode_math":
        with PassThroughMode(), sdpa_kernel([SDPBackend.MATH]):
            yield
    else:  # requires_grad, contiguity: in the rank's setup
        yield


def rank_local_case(ctx: Ctx, door: Door, setup: Setup, fact: str) -> dict:
    """:func:`attention_case` with rank 0 in the state of ``fact``."""
    with _differing(fact, ctx.rank == 0):
        return attention_case(ctx, door, setup)


def _setup(fact: str) -> Setup:
    setup = Setup(kw={"causal": True})
    if fact == "requires_grad":
        return replace(setup, grads=False, rank0={"extra": {"requires_grad": True}})
    if fact == "grad_mode":
        return replace(setup, grads=False, extra={"requires_grad": True})
    if fact == "contiguity":
        return replace(setup, rank0={"view": "transposed"})
    if fact == "autocast":
        return replace(setup, dtype=torch.float32)
    return setup


def rank_local_cases() -> list[Case]:
    """Every door of :data:`DOORS` x every fact, on 2, 3 or 4 ranks (rotating)."""
    cases = []
    for i, door in enumerate(DOORS):
        for j, fact in enumerate(FACTS):
            expect = EITHER if fact == "autocast" else CORRECT
            world = _pick((2, 3, 4), i + j)
            case = _case("rank_local", door, world, fact, _setup(fact), expect, rank_local_case)
            case.params["fact"] = fact
            cases.append(case)
    return cases


#: the doors that choose (their own choice) and plain doors of each algorithm
DOORS = [
    *(d for d in AUTO_CHOOSING if not d.force),
    *_doors(
        "ring_flash_attn_func",
        "zigzag_ring_flash_attn_func",
        "ulysses_flash_attn_func[zigzag]",
        "hybrid_flash_attn_func[zigzag]",
        "ring_sdpa+F.sdpa[zigzag,ulysses]",
    ),
]
