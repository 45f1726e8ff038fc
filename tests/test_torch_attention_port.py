"""PyTorch's own context-parallel tests (``test/distributed/tensor/test_attention.py``, the version
with ``_ContextParallel``, ``_context_parallel_shard``, ``_HeadTailLoadBalancer``,
``set_rotate_method`` and ``_cp_options``) run against dtensor_ring on CPU/gloo: the import
changed to ``dtensor_ring.compat.torch_cp``, everything else kept where CPU and this suite's
worker pool allow. Each of PyTorch's ``run_subtests`` combinations is one pytest case, at world
sizes 2 and 4.

Cases (per world size, W = 2 and W = 4)
=======================================

* ``test_ring_attention_sdpa``: PyTorch's 128 subtest combinations with CPU's two backends;
  its early returns leave 48 cases (32 ``load_balance and not is_causal``, not collected; 48
  ``compiled``, of which the slow extension collects a covering 16 at W = 2 and 8 at W = 4:
  ``COMPILED_CASES``). W = 4: 48 pass. W = 2: 40 pass, 8 are the bf16 tolerance misses below
  (xfail). Extension (compiled): W = 4: 8 pass; W = 2: 13 pass, 3 such misses.
* ``TestSharding``: 2 of its 3 methods ported, pass.
* ``CPFlexAttentionTest``: its 2 methods, 10 cases at W = 2 (3 balancers x 2 lengths for
  the causal mask, 4 balancers for the document mask) and 7 at W = 4 (64 W tokens only):
  pass (in the slow tier but the 64 W-token causal case without a balancer at W = 2).
* Not portable, listed at the end: 41 test methods.

What was changed relative to PyTorch's file
===========================================

Harness (all tests):

* ``DTensorTestBase`` / ``with_comms`` / ``run_subtests`` -> this suite's gloo worker pool
  (``dist_pool.run(fn, W, **subtest)``, ``tests/_dist.py``): PyTorch's test methods became
  module-level functions ``fn(group, **subtest)``; ``self.world_size`` -> the group's size;
  ``self.rank`` -> the group rank; ``self.assert*`` -> ``assert`` / ``torch.testing``.
* ``DeviceMesh(self.device_type, torch.arange(W))`` and ``init_device_mesh(...)`` ->
  ``DeviceMesh.from_group(group, "cpu")`` (the pool's process group is larger than W; a new
  mesh would need every pool rank to create its groups).
* ``device_type`` "cuda" -> "cpu". ``skip_if_lt_x_gpu``, ``skipIfRocm`` and the
  ``PLATFORM_SUPPORTS_*`` skips dropped (nothing here needs a GPU).
* Global state is reset after every case (``_cp_options.rotate_method = None``,
  ``_cp_options.enable_load_balance = True``, the library's defaults): the pool's workers run
  every test of the session, where PyTorch's process ends with its test class.

``RingAttentionTest.test_ring_attention_sdpa`` (the ring cases):

* Backends: PyTorch's ``backends`` holds FLASH_ATTENTION / EFFICIENT_ATTENTION /
  CUDNN_ATTENTION when the GPU supports them (on CPU it is empty). Here: ``[FLASH_ATTENTION,
  MATH]``, the two SDPA backends CPU has (FLASH_ATTENTION = the CPU flash kernel
  ``_scaled_dot_product_flash_attention_for_cpu``; EFFICIENT and CUDNN do not exist on CPU).
  The dtype rule is PyTorch's, unchanged: bf16 for FLASH/CUDNN, else fp32, so FLASH runs bf16
  and MATH fp32. ``sdpa_kernel(backend)`` picks the kernel of the single-process reference; our
  ring runs its own CPU block kernel (``cpu_flash``) whatever the backend.
* Tolerances: PyTorch's formulas, unchanged (``atol = 2e-6 if EFFICIENT else 8e-3 * W``,
  ``rtol = 1e-5 if EFFICIENT else 1e-3 * W``), so both CPU backends get the second branch (MATH
  fp32 included; its errors measured ~1e-6, within even the EFFICIENT branch).
* Sizes reduced for CPU time: ``bs = 2`` (PyTorch: 8), ``nheads = 2`` (8), ``seq_length = 64``
  tokens per rank (1024); ``dim = 32`` and ``seq_dim = 2`` unchanged. Same seed (10).
* Identical inputs on every rank: PyTorch's ``dist.broadcast(q/k/v, src=0)`` kept, given
  ``group=`` (the pool's default group has 4 ranks); the seed alone already makes them equal.
* ``CommDebugMode`` comm-count assertion: PyTorch asserts that the eager ALL_TO_ALL cases issue
  exactly ``W - 1`` (forward only) / ``3W - 2`` (forward + backward) functional
  ``all_to_all_single`` calls. Our ring moves K/V (and dK/dV) with point-to-point sends
  (``dist.batch_isend_irecv``, one call per ring step), which ``CommDebugMode`` does not see.
  Kept: the same ``CommDebugMode`` around the same calls, asserting that no all-to-all shows up
  and that the only collective it sees is the all-gather of the small fixed-size header that a
  gloo group exchanges before each attention call (``dtensor_ring/consistency.py``), i.e. no
  collective moves K/V. Added, with PyTorch's expected numbers unchanged: the count of
  ``dist.batch_isend_irecv`` calls on each rank must equal ``W - 1`` / ``3W - 2`` (our ring
  makes exactly one exchange per step where PyTorch's makes one all_to_all_single).
* ``compiled``: PyTorch's ``_test_ring_attention_sdpa`` returns early for every
  ``compiled=True`` subtest (its own context parallel cannot be traced yet), as it does for
  ``load_balance and not is_causal``; neither counts as a PyTorch case and the latter is not
  collected. The ``compiled=True`` subtests are collected here WITHOUT that early return, as an
  extension (marked ``slow``): ours claims compiled SDPA inside the module and inside
  ``context_parallel`` works. Each compile costs ~0.4 s of CPU per rank, so the extension runs
  covering subsets (``COMPILED_CASES``: every route x rotation x grad mode at both world sizes,
  every pair of factor values; the eager cases run all 48 configurations at both), checked by
  ``test_compiled_cases_cover``. One harness addition for them only: ``torch._dynamo.reset()``
  before each case (PyTorch would keep one process's compile cache for all subtests; the pool
  keeps it across the session, and ``torch.compile(F.scaled_dot_product_attention,
  fullgraph=True)`` of 48 configurations hits Dynamo's recompile limit, a hard error with
  ``fullgraph=True``).

Known tolerance misses (PyTorch's tolerances kept; marked ``xfail(strict=True)``): at W = 2 the
8 bf16 (FLASH) causal forward+backward cases (both rotations, load balance or not, module and
context form), and 3 of those among the compiled extension. Always ``v.grad`` of the first keys
of each sequence: |dv| ~ 4.41 there, where one bf16 ulp (0.03125) exceeds the allowed 8e-3*2 +
2e-3*4.41 = 0.0248; ours and the reference differ by exactly one ulp in 64 (ring, no balancer),
96 (ring, head-tail) or 128 (all-gather) of 16384 elements. Against an fp64 SDPA of the same
inputs, at those elements the reference (CPU flash SDPA in bf16, one process) is up to 0.028
off, ours up to 0.0086 (ring) / 0.023 (all-gather): ours accumulates the blocks in fp32 and is
the closer one (over the whole tensor, ours' largest error vs fp64 is 0.016-0.028, the
reference's 0.028). At W = 4 the allowed error doubles and these cases pass at the reduced
sizes. Measured once at PyTorch's full sizes (bs 8, nheads 8, 1024 tokens per rank; causal,
head-tail, ring rotation, forward+backward): W = 2 misses in dk (8) and dv (48288 of 4194304
elements; reference vs fp64 up to 0.11, ours 0.086), and W = 4 too (dk 6, dv 10880 of 8388608;
reference 0.13, ours 0.069): at full size these bf16 cases would miss at both world sizes,
always with ours the closer to fp64, i.e. the miss is PyTorch's bf16 tolerance against a bf16
CPU reference; the size reduction only hides it at W = 4.

``TestSharding`` and ``TestShardingWithLocalTensor`` (``test_context_parallel_shard``,
``..._with_positions``; the LocalTensor form in one process under ``LocalTensorMode`` over a
fake process group, as PyTorch's ``LocalDTensorTestBase``, its ``map_local_tensor_for_rank``
kept): run at W = 2 and 4
(PyTorch: W = 2 only), so the hard-coded ``mesh_shape=(2,)`` and ``seq_len // 2`` became the
group and ``seq_len // W``; ``self.assertEqual``
on tensors -> ``torch.testing.assert_close`` (exact for these integer/ones tensors).

FlexAttention (``CPFlexAttentionTest``), ``_test_cp_flex_attention`` kept line by line except:
the expected out, lse and gradients come from ``reference.reference_flex`` (fp64, the mask
evaluated by torch's ``create_mask``) instead of ``torch.compile(flex_attention)`` on one
device, which has no CPU backward; ``torch.use_deterministic_algorithms`` /
``torch.cuda.manual_seed`` dropped (CPU); its ``FlexAttentionWrapper`` is kept, and
``ContextParallel(attention_type=FLEX)`` makes its forward ``dtensor_ring.flex_attention`` (the
compiled flex it holds is never called). Reduced loops: one length, ``256 * W`` (2048 dropped:
the fp64 reference of 2048 tokens, batch 8, 8 heads does not fit the CI machine's time; and at
W = 4 only 64 W: 1024 tokens of batch 8 and 8 heads in fp64 on 4 ranks of the 2-core CI machine
took ~20 s a case), one batch size (2) for the document mask. Where PyTorch's test asserts
errors: at ``64 * W`` tokens its CP raises ``NotImplementedError`` for no balancer and head-tail
("Q_LEN ... is not divisible"); ours computes those exactly (asserted against the reference);
PTRR there raises in PyTorch's own balancer, asserted as in its test. A balancer whose
permutation differs between batch rows (document masks with different documents per row: PTRR
and the per-document balancer) has no one layout: ``_context_parallel_shard`` raises
``ValueError``, asserted (PyTorch's CP permutes each row). Any single permutation (PTRR on one
row, or rows alike) is served as a token layout (``dtensor_ring.layouts.TokenLayout``).

Not portable, not collected (PyTorch's test methods; counts per method, not per inner loop):

* ``RingAttentionTest.test_is_causal_behavior`` (1): ``_is_causal_behavior`` /
  ``_CausalBehavior`` are internals of PyTorch's ring schedule; ours has its own plan
  (``dtensor_ring/schedule``) and does not provide them.
* ``TestCPCustomOps.test_flex_cp_custom_op`` (1): opchecks PyTorch's ``flex_cp_allgather``
  custom op (FlexAttention's; no counterpart).
* ``TestSharding.test_attention_shard_without_cp`` (1): tests PyTorch's DTensor sharding-rule
  registry (``register_cp_sharding_rules``) for the CUDA fused kernels; on CPU torch's own
  DTensor already returns ``Shard(2)`` for SDPA on ``Shard(2)`` inputs without any context
  parallel (checked without dtensor_ring imported), so its assertion fails on CPU whatever the
  library.
* ``TestContextParallelStyle`` (5 ``flex_input_fn`` tests): FlexAttention, and they mock
  PyTorch's internal ``flex_cp_allgather``.
* ``TestContextParallelStyleSDPA`` (3 ``sdpa_input_fn`` tests): they call the private
  ``sdpa_input_fn`` hook and expect DTensor outputs placed ``Shard(2)``; ours has no such hook
  by design (the module sees plain local shards; DTensor inputs are accepted and unwrapped:
  ``tests/test_parallel_style.py``).
* LocalTensor classes (``create_local_tensor_test_class``) but for the sharding tests:
  ``RingAttentionTestWithLocalTensor`` (2; PyTorch skips ``test_ring_attention_sdpa``, the
  other is ``test_is_causal_behavior`` above), ``CPFlexAttentionTestWithLocalTensor`` (2, both
  skipped by PyTorch), ``TestCPCustomOpsWithLocalTensor`` (1, skipped by PyTorch),
  ``TestShardingWithLocalTensor.test_attention_shard_without_cp`` (as above). Our attention
  raises ``NotImplementedError`` inside LocalTensorMode
  (``test_attention_refuses_local_tensor_mode``).
* Varlen: ``TestCPVarlenMetadata`` (9), ``TestVarlenPTRRLoadBalancer`` (7),
  ``CPVarlenAttentionTest`` (6): ``VarlenMetadata``, ``_VarlenPTRRLoadBalancer`` and
  ``_context_parallel_shard(..., batch_and_seq=)`` are not provided (nor are they in torch
  2.13), and ``varlen_attn`` needs CUDA. Our varlen API is a different one (docs/varlen.md).

A dtensor_ring bug found by the compiled extension, fixed: ``context_parallel`` replaces
``F.scaled_dot_product_attention`` process-wide, and if the first Dynamo trace of the process
ran inside it, torch cached its list of ``__torch_function__``-overridable functions with the
replacement in place of the builtin; from then on a compiled SDPA inside a ``_ContextParallel``
module traced plain local SDPA (silently wrong: 44 of this file's compiled cases). The library
now fills that cache before replacing the attribute (``api/context_parallel.py``);
``tests/test_parallel_style.py::test_compiled_after_context_parallel`` is its regression test.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import reference_flex
from torch import Tensor
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

import dtensor_ring as dr
from dtensor_ring._compat import for_each_simulated_rank
from dtensor_ring.compat.torch_cp import (
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)

c10d_functional = torch.ops.c10d_functional
DEVICE_TYPE = "cpu"
# PyTorch: FLASH / EFFICIENT / CUDNN where the GPU has them; CPU's SDPA backends instead.
backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

rotater_enum_to_str = {
    _RotateMethod.ALL_GATHER: "allgather",
    _RotateMethod.ALL_TO_ALL: "alltoall",
}  # mapping from _RotateMethod enum to string

# PyTorch's sizes: bs 8, nheads 8, seq_length 1024 (per rank), dim 32.
BS, NHEADS, SEQ_LENGTH, DIM = 2, 2, 64, 32


class SDPAWrapper(torch.nn.Module):
    def __init__(self, compiled: bool, backend: SDPBackend) -> None:
        super().__init__()
        if compiled:
            self.sdpa = torch.compile(
                F.scaled_dot_product_attention,
                fullgraph=True,
                backend="aot_eager",
            )
        else:
            self.sdpa = F.scaled_dot_product_attention
        self.backend = backend

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        with sdpa_kernel(self.backend):
            return self.sdpa(*args, **kwargs)


@contextlib.contextmanager
def _count_ring_exchanges(counter: list[int]):
    """``counter[0]`` += 1 for every ``dist.batch_isend_irecv`` call (one per ring step)."""
    original = dist.batch_isend_irecv

    def counting(p2p_op_list):
        counter[0] += 1
        return original(p2p_op_list)

    dist.batch_isend_irecv = counting
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


# --------------------------------------------------------------------------------------------
# RingAttentionTest.test_ring_attention_sdpa
# --------------------------------------------------------------------------------------------
def _ring_attention_sdpa(
    cp_q: torch.Tensor,
    cp_k: torch.Tensor,
    cp_v: torch.Tensor,
    *,
    fn_eval: Callable,
    mesh: DeviceMesh,
    seq_dim: int,
    is_causal: bool,
    compiled: bool,
    backend: SDPBackend,
    rotater: _RotateMethod,
    test_forward_only: bool,
    load_balance: bool,
    use_context: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    world_size = mesh.size()
    if not use_context:
        cp_plan = _ContextParallel(
            seq_dim=seq_dim,
            attention_type=_ContextParallel.AttentionType.SDPA,
        )
        attention = SDPAWrapper(compiled=compiled, backend=backend)
        attention = parallelize_module(attention, mesh, cp_plan)
        if load_balance:
            seq_len = cp_q.size(seq_dim)
            load_balancer = _HeadTailLoadBalancer(seq_len, mesh.size(), cp_q.device)
        else:
            load_balancer = None
        cp_q, cp_k, cp_v = _context_parallel_shard(
            mesh, (cp_q, cp_k, cp_v), (seq_dim,) * 3, load_balancer=load_balancer
        )
        _enable_context_parallel_dispatcher()
    else:
        # Theoretically, context_parallel() should not be used to shard
        # parameters because when require_grad is True, resize_ is not
        # allowed. But requires_grad of cp_q, cp_k, and cp_v are False
        # now. So we can just use context_parallel() to shard q, k, v.
        # In reality, context_parallel() should be used to shard the input.
        # In reality, context_parallel() should only be used to shard
        # the model inputs (batch).

        _cp_options.enable_load_balance = load_balance
        cp_context = context_parallel(
            mesh, buffers=(cp_q, cp_k, cp_v), buffer_seq_dims=(seq_dim,) * 3
        )
        cp_context.__enter__()

        # NOTE: This demonstrates that monkey patching is not fully reliable.
        # If we use SDPAWrapper directly, the monkey patching dispatch mode
        # does not function correctly. To ensure proper behavior,
        # F.scaled_dot_product_attention must be referenced within the
        # context_parallel() scope.
        attention = F.scaled_dot_product_attention
        if compiled:
            attention = torch.compile(attention, fullgraph=True, backend="aot_eager")

    for target in [cp_q, cp_k, cp_v]:
        target.requires_grad = True

    check_comm_counts = not compiled and rotater == _RotateMethod.ALL_TO_ALL
    comm_mode = CommDebugMode() if check_comm_counts else contextlib.nullcontext()
    ring_exchanges = [0]  # port: our ring's K/V (and dK/dV) steps, counted
    exchange_counter = (
        _count_ring_exchanges(ring_exchanges) if check_comm_counts else contextlib.nullcontext()
    )
    with comm_mode, exchange_counter:
        with sdpa_kernel(backend):
            cp_out = fn_eval(
                attention,
                cp_q,
                cp_k,
                cp_v,
                is_causal=is_causal,
            )

        if check_comm_counts:
            expect_all2all_count = world_size - 1 if test_forward_only else world_size * 3 - 2
            # port: PyTorch asserts
            #   comm_mode.get_comm_counts() == {all_to_all_single: expect_all2all_count};
            # ours exchanges by P2P (one batch_isend_irecv per step), which CommDebugMode does
            # not see: the same count on the exchanges, and no collective moving K/V.
            assert ring_exchanges[0] == expect_all2all_count, (ring_exchanges, expect_all2all_count)
            comm_counts = comm_mode.get_comm_counts()
            assert c10d_functional.all_to_all_single not in comm_counts, comm_counts
            assert set(comm_counts) <= {torch.ops.c10d.allgather_}, comm_counts
    cp_dq, cp_dk, cp_dv = cp_q.grad, cp_k.grad, cp_v.grad
    for target in [cp_q, cp_k, cp_v]:
        target.requires_grad = False

    if not use_context:
        _disable_context_parallel_dispatcher()
    else:
        cp_context.__exit__(None, None, None)

    return cp_out, cp_dq, cp_dk, cp_dv


def _test_ring_attention_sdpa(
    group: dist.ProcessGroup,
    is_causal: bool,
    compiled: bool,
    backend: str,
    load_balance: bool,
    rotater: _RotateMethod,
    test_forward_only: bool,
    use_context: bool,
) -> None:
    world_size = dist.get_world_size(group)
    backend = getattr(SDPBackend, backend)  # port: passed by name (SDPBackend does not pickle)

    def fn_eval(fn, *args, **kwargs):
        if test_forward_only:
            with torch.no_grad():
                return fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
            out.sum().backward()
            return out

    if load_balance and not is_causal:
        return

    # port: PyTorch returns here for every compiled subtest; the extension runs them.
    if compiled:
        torch._dynamo.reset()

    try:
        set_rotate_method(rotater_enum_to_str[rotater])
        assert _cp_options.rotate_method == rotater
        device_mesh = DeviceMesh.from_group(group, DEVICE_TYPE)
        bs = BS
        seq_length = SEQ_LENGTH
        seq_dim = 2
        dim = DIM
        nheads = NHEADS
        torch.manual_seed(10)
        dtype = (
            torch.bfloat16
            if backend == SDPBackend.FLASH_ATTENTION or backend == SDPBackend.CUDNN_ATTENTION
            else torch.float32
        )

        q, k, v = [
            torch.rand(
                (bs, nheads, seq_length * world_size, dim),
                device=DEVICE_TYPE,
                dtype=dtype,
                requires_grad=True,
            )
            for _ in range(3)
        ]

        # Ensure all ranks have the same initialization data.
        with torch.no_grad():
            dist.broadcast(q, src=0, group=group)
            dist.broadcast(k, src=0, group=group)
            dist.broadcast(v, src=0, group=group)

        with sdpa_kernel(backend):
            out = fn_eval(F.scaled_dot_product_attention, q, k, v, is_causal=is_causal)

        cp_q, cp_k, cp_v = [target.detach().clone() for target in [q, k, v]]
        cp_out, cp_dq, cp_dk, cp_dv = _ring_attention_sdpa(
            cp_q,
            cp_k,
            cp_v,
            fn_eval=fn_eval,
            mesh=device_mesh,
            seq_dim=seq_dim,
            is_causal=is_causal,
            compiled=compiled,
            backend=backend,
            rotater=rotater,
            test_forward_only=test_forward_only,
            load_balance=load_balance,
            use_context=use_context,
        )

        # Due to numerical error, we need to choose different atol for different
        # attention kernels
        (cp_out,) = context_parallel_unshard(device_mesh, [cp_out], [seq_dim])
        atol = 2e-06 if backend == SDPBackend.EFFICIENT_ATTENTION else 8e-3 * world_size
        rtol = 1e-05 if backend == SDPBackend.EFFICIENT_ATTENTION else 1e-3 * world_size
        torch.testing.assert_close(out, cp_out, atol=atol, rtol=rtol)

        if test_forward_only:
            return

        cp_dq, cp_dk, cp_dv = context_parallel_unshard(
            device_mesh,
            [cp_dq, cp_dk, cp_dv],
            [seq_dim] * 3,
        )
        torch.testing.assert_close(q.grad, cp_dq, atol=atol, rtol=rtol)
        torch.testing.assert_close(k.grad, cp_dk, atol=atol, rtol=rtol)
        torch.testing.assert_close(v.grad, cp_dv, atol=atol, rtol=rtol)
    finally:
        _cp_options.rotate_method, _cp_options.enable_load_balance = None, True


SUBTESTS = {
    "is_causal": [True, False],
    "compiled": [True, False],
    "backend": backends,
    "load_balance": [True, False],
    "rotater": [_RotateMethod.ALL_TO_ALL, _RotateMethod.ALL_GATHER],
    "test_forward_only": [True, False],
    "use_context": [True, False],
}
WORLD_SIZES = (2, 4)

_BF16_ULP_MISS = (
    "PyTorch's bf16 tolerance (8e-3*W + 1e-3*W*|x|) is below one bf16 ulp at |dv| ~ 4.4 for W=2; "
    "ours and the bf16 CPU-flash reference differ by one ulp there, ours being closer to fp64 "
    "(<= 0.023 vs 0.028): see the module docstring"
)


def _subtest_id(subtest: dict) -> str:
    return "-".join(
        [
            "causal" if subtest["is_causal"] else "noncausal",
            "compiled" if subtest["compiled"] else "eager",
            subtest["backend"].name.split("_")[0].lower(),
            "lb" if subtest["load_balance"] else "nolb",
            rotater_enum_to_str[subtest["rotater"]],
            "fwd" if subtest["test_forward_only"] else "fwdbwd",
            "context" if subtest["use_context"] else "module",
        ]
    )


# The compiled extension (slow) runs covering subsets, not all 48 configurations per world
# size: each compile of the SDPA call costs ~0.4 s of CPU per rank, the ring it calls is the
# eager cases' (all 48 configurations run eagerly at both world sizes: the same custom ops,
# layouts and rotations), and what a compile can get wrong is the route (module or context),
# the rotation, the grad mode, the dtype and the mask it traces. A row: (mask, backend,
# rotater, test_forward_only, use_context); masks: "noncausal", "causal", "causal_lb" (causal
# with PyTorch's head-tail load balancer). ``test_compiled_cases_cover`` checks the claims:
# * W = 2: every route x rotation x grad mode x backend (16), and every mask with every value
#   of every other factor;
# * W = 4: every route x rotation x grad mode (8), and every pair of values of any two factors.
_A2A, _AG = _RotateMethod.ALL_TO_ALL, _RotateMethod.ALL_GATHER
_FLASH, _MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.MATH
COMPILED_CASES = {
    2: [
        ("noncausal", _FLASH, _A2A, True, True),
        ("causal", _MATH, _A2A, True, True),
        ("causal_lb", _FLASH, _A2A, False, True),
        ("causal_lb", _MATH, _A2A, False, True),
        ("noncausal", _FLASH, _AG, True, True),
        ("causal_lb", _MATH, _AG, True, True),
        ("causal", _FLASH, _AG, False, True),
        ("noncausal", _MATH, _AG, False, True),
        ("causal_lb", _FLASH, _A2A, True, False),
        ("noncausal", _MATH, _A2A, True, False),
        ("causal", _FLASH, _A2A, False, False),
        ("noncausal", _MATH, _A2A, False, False),
        ("causal", _FLASH, _AG, True, False),
        ("causal", _MATH, _AG, True, False),
        ("noncausal", _FLASH, _AG, False, False),
        ("causal_lb", _MATH, _AG, False, False),
    ],
    4: [
        ("noncausal", _FLASH, _A2A, True, True),
        ("noncausal", _FLASH, _A2A, False, True),
        ("causal", _FLASH, _AG, True, True),
        ("causal_lb", _MATH, _AG, False, True),
        ("causal_lb", _FLASH, _A2A, True, False),
        ("causal", _MATH, _A2A, False, False),
        ("noncausal", _MATH, _AG, True, False),
        ("noncausal", _FLASH, _AG, False, False),
    ],
}


def _compiled_row(subtest: dict) -> tuple:
    """``subtest``'s row of :data:`COMPILED_CASES`."""
    mask = "noncausal" if not subtest["is_causal"] else "causal"
    if subtest["load_balance"]:
        mask = "causal_lb"
    keys = ("backend", "rotater", "test_forward_only", "use_context")
    return (mask, *(subtest[key] for key in keys))


def _ring_cases() -> list:
    """PyTorch's subtests (without its ``load_balance and not is_causal`` early exits) at each
    world size; the compiled ones are the extension (slow; the rows of
    :data:`COMPILED_CASES`), and so are the W = 4 ones (the fast tier's time: W = 2 there,
    both in the whole suite)."""
    cases = []
    for world_size in WORLD_SIZES:
        for values in itertools.product(*SUBTESTS.values()):
            subtest = dict(zip(SUBTESTS, values, strict=True))
            if subtest["load_balance"] and not subtest["is_causal"]:
                continue  # PyTorch's early return: not a case
            if subtest["compiled"] and _compiled_row(subtest) not in COMPILED_CASES[world_size]:
                continue  # the compiled extension's covering subset (above)
            marks = [pytest.mark.slow] if subtest["compiled"] or world_size == 4 else []
            if (
                world_size == 2
                and subtest["backend"] == SDPBackend.FLASH_ATTENTION
                and subtest["is_causal"]
                and not subtest["test_forward_only"]
            ):
                marks.append(pytest.mark.xfail(reason=_BF16_ULP_MISS, strict=True))
            case_id = f"W{world_size}-{_subtest_id(subtest)}"
            cases.append(pytest.param(world_size, subtest, marks=marks, id=case_id))
    return cases


@pytest.mark.parametrize(("world_size", "subtest"), _ring_cases())
def test_ring_attention_sdpa(dist_pool, world_size, subtest):
    subtest = {**subtest, "backend": subtest["backend"].name}
    dist_pool.run(_test_ring_attention_sdpa, world_size, **subtest)


def test_compiled_cases_cover():
    """The compiled extension's rows (:data:`COMPILED_CASES`) are configurations PyTorch's
    subtests give, each once, and cover what the comment above them claims."""
    factors = {
        "mask": ["noncausal", "causal", "causal_lb"],
        "backend": backends,
        "rotater": SUBTESTS["rotater"],
        "test_forward_only": [True, False],
        "use_context": [True, False],
    }
    names = list(factors)
    valid = set()
    for values in itertools.product(*SUBTESTS.values()):
        subtest = dict(zip(SUBTESTS, values, strict=True))
        if subtest["compiled"] and not (subtest["load_balance"] and not subtest["is_causal"]):
            valid.add(_compiled_row(subtest))
    assert len(valid) == 48, len(valid)

    def covered(rows, chosen):
        """Whether ``rows`` hold every combination of the values of the factors ``chosen``."""
        index = [names.index(name) for name in chosen]
        want = set(itertools.product(*(factors[name] for name in chosen)))
        return {tuple(row[i] for i in index) for row in rows} == want

    routes = ["rotater", "test_forward_only", "use_context"]
    for world_size, rows in COMPILED_CASES.items():
        assert len(set(rows)) == len(rows) and set(rows) <= valid, world_size
        assert covered(rows, routes), world_size
        if world_size == 2:
            assert covered(rows, [*routes, "backend"])
            assert all(covered(rows, ["mask", name]) for name in names[1:])
        else:
            assert all(covered(rows, pair) for pair in itertools.combinations(names, 2))
    collected = {
        (p.values[0], _compiled_row(p.values[1])) for p in _ring_cases() if p.values[1]["compiled"]
    }
    assert collected == {(w, row) for w, rows in COMPILED_CASES.items() for row in rows}


# --------------------------------------------------------------------------------------------
# TestSharding
# --------------------------------------------------------------------------------------------
@for_each_simulated_rank
def map_local_tensor_for_rank(tensor, rank, func):
    """PyTorch's test helper: ``func(tensor, rank)``, once per rank under LocalTensorMode."""
    return func(tensor, rank)


def _test_context_parallel_shard(device_mesh: DeviceMesh, rank, world_size: int) -> None:
    try:
        B = 4
        seq_len = 32

        freqs_cis = torch.arange(0, seq_len, device=DEVICE_TYPE)
        q = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)
        k = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)
        v = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)

        load_balancer = _HeadTailLoadBalancer(seq_len, world_size, torch.device(DEVICE_TYPE))
        freqs_cis_shard, q_shard, k_shard, v_shard = _context_parallel_shard(
            device_mesh, [freqs_cis, q, k, v], [0, 1, 1, 1], load_balancer=load_balancer
        )
        assert freqs_cis_shard.size() == (seq_len // world_size,)
        chunks = freqs_cis.chunk(world_size * 2)
        expected = map_local_tensor_for_rank(
            chunks,
            rank,
            lambda chunks, rank: torch.cat(
                [chunks[rank], chunks[world_size * 2 - rank - 1]],
                dim=0,
            ),
        )
        torch.testing.assert_close(freqs_cis_shard, expected)
    finally:
        _cp_options.enable_load_balance = True


def _test_context_parallel_shard_with_positions(
    device_mesh: DeviceMesh, rank, world_size: int
) -> None:
    """Test context parallel sharding with expanded batch dimensions.

    This test validates the fix for buffer sharding when the batch dimension
    is created through expand() or view() operations. Before the fix, the
    loop-based torch.index_select approach failed on expanded tensors.
    """
    try:
        B = 4
        seq_len = 32

        # Create positions tensor and expand to add batch dimension
        positions = torch.arange(0, seq_len, device=DEVICE_TYPE)
        positions = positions.expand(B, seq_len)

        q = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)
        k = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)
        v = torch.ones(B * seq_len, device=DEVICE_TYPE).reshape(B, seq_len)

        load_balancer = _HeadTailLoadBalancer(seq_len, world_size, torch.device(DEVICE_TYPE))

        # positions has seq_dim=1 (same as q, k, v) after expansion
        positions_shard, q_shard, k_shard, v_shard = _context_parallel_shard(
            device_mesh, [positions, q, k, v], [1, 1, 1, 1], load_balancer=load_balancer
        )

        # Verify the sharded positions tensor has correct shape
        assert positions_shard.size() == (B, seq_len // world_size)

        # Verify the sharded values match expected chunked and concatenated results
        # For each batch, the positions should be chunked and rearranged
        chunks = positions.chunk(world_size * 2, dim=1)
        expected_positions = map_local_tensor_for_rank(
            chunks,
            rank,
            lambda chunks, rank: torch.cat(
                [chunks[rank], chunks[world_size * 2 - rank - 1]],
                dim=1,
            ),
        )
        torch.testing.assert_close(positions_shard, expected_positions)
    finally:
        _cp_options.enable_load_balance = True


SHARDING_TESTS = pytest.mark.parametrize(
    "fn",
    [_test_context_parallel_shard, _test_context_parallel_shard_with_positions],
    ids=["test_context_parallel_shard", "test_context_parallel_shard_with_positions"],
)


def _on_group(group: dist.ProcessGroup, fn) -> None:
    fn(DeviceMesh.from_group(group, DEVICE_TYPE), dist.get_rank(group), dist.get_world_size(group))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@SHARDING_TESTS
def test_sharding(dist_pool, world_size, fn):
    dist_pool.run(_on_group, world_size, fn=fn)


@contextlib.contextmanager
def simulated_ranks(world_size: int):
    """PyTorch's ``LocalDTensorTestBase``: one process simulates every rank (LocalTensorMode
    over a fake process group); yields ``(mesh, rank)``, the rank a per-rank symbolic int."""
    from torch.distributed._local_tensor import LocalIntNode, LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        device_mesh = DeviceMesh(DEVICE_TYPE, list(range(world_size)))
        with LocalTensorMode(frozenset(range(world_size))):
            yield device_mesh, torch.SymInt(LocalIntNode({r: r for r in range(world_size)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@SHARDING_TESTS
def test_sharding_with_local_tensor(world_size, fn):
    """``TestShardingWithLocalTensor``: the same tests, every shard a LocalTensor holding each
    simulated rank's part."""
    with simulated_ranks(world_size) as (device_mesh, rank):
        fn(device_mesh, rank, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unshard_with_local_tensor(world_size):
    """Not PyTorch's: ``context_parallel_unshard`` of LocalTensor shards gives every simulated
    rank the whole buffer back, in order (head-tail and contiguous)."""
    with simulated_ranks(world_size) as (device_mesh, _):
        x = torch.arange(4.0 * world_size).reshape(1, -1)
        for load_balancer in (_HeadTailLoadBalancer(x.shape[1], world_size, "cpu"), None):
            (shard,) = _context_parallel_shard(device_mesh, [x], [1], load_balancer)
            (whole,) = context_parallel_unshard(device_mesh, [shard], [1], load_balancer)
            torch.testing.assert_close(whole, x)


SDPA_TYPE = _ContextParallel.AttentionType.SDPA


def test_attention_refuses_local_tensor_mode():
    """Not PyTorch's (it skips its CP attention under LocalTensor): our attention inside the
    simulation would run every simulated rank as the process's rank 0, so every door raises."""
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in "qkv")  # [B, H, S, D]
    calls = {
        "functional": lambda mesh: dr.zigzag_ring_flash_attn_func(
            *(t.transpose(1, 2) for t in (q, k, v)), causal=True
        ),
        "flex": lambda mesh: dr.flex_attention(q, k, v),
        "module": lambda mesh: parallelize_module(
            SDPAWrapper(False, SDPBackend.MATH), mesh, _ContextParallel(2, SDPA_TYPE)
        )(q, k, v, is_causal=True),
        "context_parallel": lambda mesh: context_parallel(mesh, buffers=[], buffer_seq_dims=[]),
    }
    for name, call in calls.items():
        with simulated_ranks(2) as (mesh, _):
            with pytest.raises(NotImplementedError, match="LocalTensorMode"):
                with contextlib.ExitStack() as stack:
                    result = call(mesh)
                    if name == "context_parallel":
                        stack.enter_context(result)
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --------------------------------------------------------------------------------------------
# CPFlexAttentionTest: PyTorch's FlexAttention tests (the header lists what changed).
# --------------------------------------------------------------------------------------------
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# copied from https://github.com/meta-pytorch/attention-gym/blob/main/attn_gym/masks/document_mask.py
def generate_random_lengths(total_length, num_documents) -> list[int]:
    # Initialize all lengths to 1 to ensure each document has at least one token
    lengths = [1] * num_documents
    remaining_length = total_length - num_documents

    # Randomly distribute the remaining length
    for _ in range(remaining_length):
        index = random.randint(0, num_documents - 1)
        lengths[index] += 1

    return lengths


def generate_random_lengths_in_chunks(total_length, num_documents, chunk_size) -> list[int]:
    # Generate a list of random document lengths so that each document contains
    # some number of chunks of size `chunk_size`. This means each document's length
    # must be a multiple of `chunk_size`. Besides, the lengths of all the documents
    # sum up to `total_length`.
    num_chunks = total_length // chunk_size
    if not (total_length % chunk_size == 0 and num_chunks >= num_documents):
        raise AssertionError(
            f"total_length % chunk_size == {total_length % chunk_size} (expected 0), "
            f"num_chunks={num_chunks} vs num_documents={num_documents}"
        )

    num_chunks_per_document = [1] * num_documents
    remaining_chunks = num_chunks - num_documents
    # Randomly distribute the remaining chunks
    for _ in range(remaining_chunks):
        index = random.randint(0, num_documents - 1)  # document_id
        num_chunks_per_document[index] += 1

    return [num_chunks * chunk_size for num_chunks in num_chunks_per_document]


def length_to_offsets(lengths: list[list[int]], device: str | torch.device) -> Tensor:
    """Converts a list of lengths to a list of offsets."""
    offsets = [[0] + lengths_in_batch for lengths_in_batch in lengths]
    offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
    offsets = torch.cumsum(offsets, dim=-1)
    return offsets


def _offsets_to_doc_ids_tensor(offsets):
    doc_ids = []
    device = offsets.device
    for batch_idx in range(offsets.size(0)):
        counts = offsets[batch_idx][1:] - offsets[batch_idx][:-1]
        doc_id = torch.repeat_interleave(
            torch.arange(len(counts), device=device, dtype=torch.int32), counts
        )
        doc_ids.append(doc_id)

    return torch.stack(doc_ids)


def generate_doc_mask_mod(mask_mod, offsets: Tensor):
    """Generates mask mods that apply to inputs to flex attention in the sequence stacked
    format."""
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[b][q_idx] == document_id[b][kv_idx]
        q_logical = q_idx - offsets[b, document_id[b, q_idx]]
        kv_logical = kv_idx - offsets[b, document_id[b, kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


def _get_load_balancer(lb_type, world_size, seq_length, document_lengths, block_mask):
    """PyTorch's ``_get_load_balancer``, with its own (torch's) balancer classes."""
    from torch.distributed.tensor.experimental._attention import (
        _PerDocumentHeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    if lb_type == "None":
        return None
    if lb_type == "_HeadTailLoadBalancer":
        return _HeadTailLoadBalancer(seq_length, world_size, torch.device(DEVICE_TYPE))
    if lb_type == "_PerDocumentHeadTailLoadBalancer":
        return _PerDocumentHeadTailLoadBalancer(
            document_lengths, world_size, torch.device(DEVICE_TYPE)
        )
    if lb_type == "_PTRRLoadBalancer":
        return _PTRRLoadBalancer(block_mask, world_size)
    raise ValueError(f"load_balancer type {lb_type} is not supported!")


class FlexAttentionWrapper(torch.nn.Module):
    _flex_attn = torch.compile(flex_attention)

    def forward(self, *args: object, **kwargs: object):
        return FlexAttentionWrapper._flex_attn(*args, **kwargs)


def _test_cp_flex_attention(
    group: dist.ProcessGroup,
    *,
    qkv_size: int,
    B: int = 1,
    mask: str,
    lb_type: str,
    document_lengths: list[list[int]] | None = None,
) -> None:
    """PyTorch's ``CPFlexAttentionTest._test_cp_flex_attention`` (header: what changed)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    world_size = dist.get_world_size(group)
    device_mesh = DeviceMesh.from_group(group, DEVICE_TYPE)
    torch.manual_seed(1234)
    mask_mod = causal_mask
    if mask == "document":
        mask_mod = generate_doc_mask_mod(causal_mask, length_to_offsets(document_lengths, "cpu"))
    block_mask = create_block_mask(
        mask_mod, B=B, H=1, Q_LEN=qkv_size, KV_LEN=qkv_size, device=DEVICE_TYPE
    )

    dtype = torch.float32
    dim = 32
    nheads = 8
    seq_dim = 2
    bs = B if B > 1 else 8
    lb = _get_load_balancer(lb_type, world_size, qkv_size, document_lengths, block_mask)
    order = None if lb is None else lb._generate_indices()
    if order is not None and any(not torch.equal(row, order[0]) for row in order):
        # a permutation per batch row (rows with different documents): no one layout
        with pytest.raises(ValueError, match="not one layout"):
            _context_parallel_shard(device_mesh, [torch.rand(bs, 8, qkv_size, 32)], [2], lb)
        return

    qkv = [
        torch.rand((bs, nheads, qkv_size, dim), device=DEVICE_TYPE, dtype=dtype, requires_grad=True)
        for _ in range(3)
    ]
    expect_out, expect_lse = reference_flex(  # fp64, see the header
        *qkv, mask_mod=mask_mod, mask_batch_heads=(B, 1)
    )
    expect_out.sum().backward()

    flex_attention_wrapper_module = FlexAttentionWrapper()
    cp_plan = _ContextParallel(seq_dim=seq_dim, attention_type=_ContextParallel.AttentionType.FLEX)
    parallelize_module(flex_attention_wrapper_module, device_mesh, cp_plan)

    *cp_qkv, cp_block_mask = _context_parallel_shard(
        device_mesh,
        [t.detach().clone() for t in qkv] + [block_mask],
        [seq_dim] * 4,
        load_balancer=lb,
    )
    for t in cp_qkv:
        t.requires_grad = True

    cp_out, cp_aux = flex_attention_wrapper_module(
        *cp_qkv,
        block_mask=cp_block_mask,
        return_aux=AuxRequest(lse=True),
    )

    # backward run
    cp_out.sum().backward()

    atol = 2e-06
    rtol = 1e-05
    # unshard the output
    cp_out, cp_lse = context_parallel_unshard(
        device_mesh,
        buffers=[cp_out, cp_aux.lse],
        seq_dims=[seq_dim] * 2,
        load_balancer=lb,
    )
    torch.testing.assert_close(cp_out, expect_out.to(dtype), atol=atol, rtol=rtol)
    torch.testing.assert_close(cp_lse, expect_lse.to(dtype), atol=atol, rtol=rtol)

    # unshard the gradient
    cp_qkv_grad = context_parallel_unshard(
        device_mesh,
        buffers=[t.grad for t in cp_qkv],
        seq_dims=[seq_dim] * 3,
        load_balancer=lb,
    )

    qkv_grad = [t.grad for t in qkv]
    for grad, cp_grad in zip(qkv_grad, cp_qkv_grad, strict=True):
        torch.testing.assert_close(grad, cp_grad, atol=atol, rtol=rtol)


def _cp_flex_attention_document_mask(group, batch_size: int, max_seq_len: int, lb_type: str):
    """PyTorch's ``test_cp_flex_attention_document_mask`` body for one combination."""
    world_size = dist.get_world_size(group)
    random.seed(10)
    doc_count = 28
    lengths = [
        (
            generate_random_lengths_in_chunks(max_seq_len, doc_count, chunk_size=2 * world_size)
            if lb_type == "_PerDocumentHeadTailLoadBalancer"
            else generate_random_lengths(max_seq_len, doc_count)
        )
        for _ in range(batch_size)
    ]
    kwargs = dict(qkv_size=max_seq_len, B=batch_size, mask="document", document_lengths=lengths)
    _test_cp_flex_attention(group, lb_type=lb_type, **kwargs)


CAUSAL_LB_TYPES = ["None", "_HeadTailLoadBalancer", "_PTRRLoadBalancer"]
DOCUMENT_LB_TYPES = [*CAUSAL_LB_TYPES[:2], "_PerDocumentHeadTailLoadBalancer", CAUSAL_LB_TYPES[2]]


FLEX_WORLD_SIZES = (2, pytest.param(4, marks=pytest.mark.slow))


@pytest.mark.parametrize(
    "world_size, qkv_size",  # 256 W at W = 2 only: the reduced loop of the header
    [
        pytest.param(2, "256W", marks=pytest.mark.slow),
        (2, "64W"),
        pytest.param(4, "64W", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(  # the balancers at W = 2, 64 W: the slow tier but for None
    "lb_type",
    [CAUSAL_LB_TYPES[0], *(pytest.param(t, marks=pytest.mark.slow) for t in CAUSAL_LB_TYPES[1:])],
)
def test_cp_flex_attention_causal_mask(dist_pool, world_size, lb_type, qkv_size):
    size = {"256W": 256, "64W": 64}[qkv_size] * world_size
    dist_pool.run(_cp_flex_attention_causal_mask, world_size, qkv_size=size, lb_type=lb_type)


def _cp_flex_attention_causal_mask(group, qkv_size: int, lb_type: str) -> None:
    """One combination of PyTorch's ``test_cp_flex_attention_causal_mask``. At 64 W tokens
    its PTRR balancer itself raises (as PyTorch's test asserts); the others, which PyTorch's
    CP refuses there ("Q_LEN ... is not divisible"), are computed exactly."""
    if qkv_size == 64 * dist.get_world_size(group) and lb_type == "_PTRRLoadBalancer":
        with pytest.raises(NotImplementedError, match="must be divisible by group_size"):
            _test_cp_flex_attention(group, qkv_size=qkv_size, mask="causal", lb_type=lb_type)
        return
    _test_cp_flex_attention(group, qkv_size=qkv_size, mask="causal", lb_type=lb_type)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", FLEX_WORLD_SIZES)
@pytest.mark.parametrize("lb_type", DOCUMENT_LB_TYPES)
def test_cp_flex_attention_document_mask(dist_pool, world_size, lb_type):
    dist_pool.run(
        _cp_flex_attention_document_mask,
        world_size,
        batch_size=2,
        max_seq_len=256 * world_size,
        lb_type=lb_type,
    )
