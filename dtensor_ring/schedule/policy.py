"""The short-sequence policy behind ``layout="auto"``: ring, all-gather or Ulysses per call.

Note [Choosing ring, all-gather or Ulysses]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Three algorithms compute attention over tokens placed as zigzag places them (rank r holds
chunks r and 2W-1-r of 2W) and leave the same result in the same places, so the choice can be
made per call, with no resharding:

    ring        K/V travel W-1 hops; W steps of one block kernel + merge (Note [Ring forward])
    all_gather  K/V of every rank gathered per group of ``heads_k_stride`` K/V heads, the next
                group's gather overlapping this group's kernel (Note [Balanced all-gather
                attention]); no merge
    ulysses     all-to-alls trade the sequence for heads: one kernel over the whole sequence
                with H/W heads, all-to-all back (Note [Ulysses attention]); needs H % W == 0

They cost the same FLOPs; they differ in how often the host issues work and how many bytes
move, and whether those bytes hide behind compute. The model: a call is a sequence of steps,
and a step takes as long as the slowest of what it needs,

    step = max(GPU: pairs * 4 * B * H * D / rate(n),  link: bytes / link_gbps + latency,
               host: host_step)

    rate(n) = tflops * (1 - exp(-n / saturation_rows))     (n: the block's query rows)

The kernel's rate grows with the block: the ring's and the all-gather's blocks have S_local / 2
query rows (zigzag's pieces; S_local without a mask), Ulysses' one kernel the whole sequence.
Each algorithm's rate is also scaled by its kernel's ``relative_speed`` (the all-gather needs a
varlen kernel: on a machine with only PyTorch's kernels that is torch's flash, ~0.57x cuDNN),
and a candidate no kernel can run is not priced (``resolve_algorithm``).

    ring        the slowest rank's plan row (Plan.score_pairs: fewer steps under a window); one
                K/V hop per step but the last; backward: 2.5x the FLOPs, K/V + fp32 dK/dV hops
    all_gather  H_kv / heads_k_stride steps, each 1/n of the rank's FLOPs and of the gathered
                (W - 1) K/V shards, plus the first group's gather, exposed; backward gathers
                again and reduce-scatters fp32 dK/dV
    ulysses     q, k, v in and out back by all-to-all ((W - 1) / W of each, K/V heads
                repeated to a multiple of W), exposed, around one step with all the FLOPs;
                backward moves dout, out, q, k, v in and dq, dk, dv back

    tokens per rank        ring                                all_gather / ulysses
    few (host-bound)       W steps of host work, each ~0.1-0.3 ms   one or a few steps
    many (GPU-bound)       hops hidden behind blocks: nothing      gathered bytes partly exposed

so the ring wins long sequences and loses short ones, where one host step per hop is more than
the block's kernel. :class:`Machine` holds the constants (defaults: one H200 host, measured on
2026-12-03 with ``benchmarks/bench_single_gpu.py``; set your own with :func:`set_machine`, e.g.
``link_gbps=50`` across InfiniBand). Ties go to the earlier of ``ring, all_gather, ulysses``
(the ring holds no gathered K/V), and the ring keeps calls where another is predicted less than
3% faster (``RING_MARGIN``: within the model's error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .cost import kv_repeat
from .plan import make_plan

ALGORITHMS: tuple[str, ...] = ("ring", "all_gather", "ulysses")
RING_MARGIN = 0.03  # another algorithm must be predicted this much faster than the ring


class Machine(NamedTuple):
    """The constants of the cost model (Note [Choosing ring, all-gather or Ulysses]).

    Defaults: one H200 (torch 2.11, cuDNN 9.19, bf16), measured 2026-12-03: ``tflops`` the
    cuDNN forward rate of long blocks and ``saturation_rows`` how fast shorter blocks approach
    it (:meth:`rate`; fit to cuDNN's blocks of 1024, 2048 and 4096 query rows: 355-395,
    481-529 and 610-635 TFLOP/s);
    ``host_fwd_ms`` / ``host_bwd_ms`` the host
    time of one ring step in eager mode (zigzag at 2048 tokens per rank: eager time over
    steps, where the GPU work of the same steps replayed from a CUDA graph takes half);
    ``link_gbps`` a direction of NVLink between two GPUs of one host, ``latency_ms`` of one
    transfer.
    """

    tflops: float = 650.0
    saturation_rows: int = 1300
    host_fwd_ms: float = 0.13
    host_bwd_ms: float = 0.29
    link_gbps: float = 450.0
    latency_ms: float = 0.02

    def rate(self, rows: int) -> float:
        """The kernel's TFLOP/s on blocks of ``rows`` query rows."""
        return self.tflops * -math.expm1(-rows / self.saturation_rows)


_machine = Machine()


def set_machine(machine: Machine) -> None:
    """Use ``machine``'s constants for every later choice (``layout="auto"``)."""
    global _machine
    if not isinstance(machine, Machine):
        raise TypeError(f"set_machine needs a dtensor_ring.Machine, got {type(machine).__name__}")
    _machine = machine


def get_machine() -> Machine:
    """The constants :func:`choose_algorithm` uses by default."""
    return _machine


class AlgorithmChoice(NamedTuple):
    """What :func:`choose_algorithm` picked and why.

    ``algorithm``: "ring", "all_gather" or "ulysses"; ``layout``: the layout it runs for
    zigzag-placed tokens ("zigzag"; "ring" for a ring without a mask, whose contiguous plan is
    order-free; "llama3_zigzag" for all_gather); ``heads_k_stride``: K/V heads per all-gather
    step (all_gather only, else 0); ``predicted_ms``: the model's time of every candidate (of
    its best ``heads_k_stride`` for all_gather); ``reason``: one line.
    """

    algorithm: str
    layout: str
    heads_k_stride: int
    predicted_ms: dict[str, float]
    reason: str


def _step_ms(gpu_ms: float, link_bytes: float, host_ms: float, m: Machine) -> float:
    link = link_bytes / (m.link_gbps * 1e6) + m.latency_ms if link_bytes else 0.0
    return max(gpu_ms, link, host_ms)


def _ring_ms(pairs, per_pair, rate, kv_bytes, m: Machine, bwd: bool) -> float:
    last = len(pairs) - 1
    fwd = sum(
        _step_ms(p * per_pair / rate, kv_bytes * (s < last), m.host_fwd_ms, m)
        for s, p in enumerate(pairs)
    )
    if not bwd:
        return fwd
    # backward hops: K/V and the fp32 dK/dV accumulator (twice the bytes of bf16 K/V)
    return fwd + sum(
        _step_ms(2.5 * p * per_pair / rate, 3 * kv_bytes * (s < last), m.host_bwd_ms, m)
        for s, p in enumerate(pairs)
    )


def ring_steps_ms(
    step_pairs: Sequence[int],
    seq_local: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    batch: int = 1,
    itemsize: int = 2,
    backward: bool = True,
    machine: Machine | None = None,
) -> float:
    """The model's time of one rank's ring steps that compute ``step_pairs`` (query-key pairs
    per step) on ``seq_local`` tokens a rank: each step costs the most of its kernels, its K/V
    transfer and the host time of a step (Note [Choosing ring, all-gather or Ulysses])."""
    m = get_machine() if machine is None else machine
    rate = m.rate(max(seq_local // 2, 1)) * 1e9
    kv_bytes = 2.0 * batch * seq_local * kv_heads * head_dim * itemsize
    return _ring_ms(step_pairs, 4.0 * batch * heads * head_dim, rate, kv_bytes, m, backward)


def _all_gather_ms(flops, rate, kv_bytes, W, groups, m: Machine, bwd: bool) -> float:
    gathered = (W - 1) * kv_bytes / groups  # one group's share of the others' K/V
    first = _step_ms(0.0, gathered, 0.0, m)
    gpu = flops / groups / rate
    fwd = first + groups * _step_ms(gpu, gathered, m.host_fwd_ms, m)
    if not bwd:
        return fwd
    # gather K/V again and reduce-scatter fp32 dK/dV: three times the bytes
    return fwd + first + groups * _step_ms(2.5 * gpu, 3 * gathered, m.host_bwd_ms, m)


def _ulysses_ms(flops, rate, q_bytes, kv_bytes, W, m: Machine, bwd: bool) -> float:
    moved, gpu = (W - 1) / W, flops / rate
    fwd = (
        _step_ms(0.0, moved * (q_bytes + kv_bytes), 0.0, m)  # q, k, v in
        + _step_ms(gpu, 0.0, m.host_fwd_ms, m)
        + _step_ms(0.0, moved * q_bytes, 0.0, m)  # out back
    )
    if not bwd:
        return fwd
    return (
        fwd
        + _step_ms(0.0, moved * (3 * q_bytes + kv_bytes), 0.0, m)  # dout, out, q, k, v in
        + _step_ms(2.5 * gpu, 0.0, m.host_bwd_ms, m)
        + _step_ms(0.0, moved * (q_bytes + kv_bytes), 0.0, m)  # dq, dk, dv back
    )


def choose_algorithm(
    seq_len: int,
    world_size: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    batch: int = 1,
    itemsize: int = 2,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    backward: bool = True,
    candidates: Sequence[str] = ALGORITHMS,
    speeds: Mapping[str, float] | None = None,
    machine: Machine | None = None,
) -> AlgorithmChoice:
    """The algorithm of least predicted time for attention over ``seq_len`` zigzag-placed
    tokens on ``world_size`` ranks (Note [Choosing ring, all-gather or Ulysses]).

    Args:
        seq_len: global tokens per row (``S_local * world_size``, divisible by
            ``2 * world_size``); heads, kv_heads, head_dim, batch: of q ``[B, S, H, D]`` and
            k, v ``[B, S, H_kv, D]``; itemsize: bytes per element (2 for bf16).
        causal, window: the mask (``window`` normalised as ``normalize_window`` returns it,
            None for none).
        backward: the call's backward will run too (training), else forward only.
        candidates: the algorithms the caller can run; "ulysses" is skipped unless
            ``heads % world_size == 0``, "ring" for a non-causal window (zigzag's ring is
            causal or maskless).
        speeds: per algorithm, its kernel's speed relative to the machine's (the block
            kernels' ``relative_speed``: the all-gather runs a varlen kernel, which may be
            another backend than the dense one); 1.0 for those not given.
        machine: the constants (default :func:`get_machine`).

    Returns:
        An :class:`AlgorithmChoice`. The same arguments give the same choice on every rank.
    """
    m = get_machine() if machine is None else machine
    W, seq_local = world_size, seq_len // world_size
    # the ring's plan; without a causal mask only the maskless "ring" plan (order-free) runs
    # zigzag-placed tokens, and its pairs price the other algorithms under a window too
    ring_layout = "zigzag" if causal else "ring"
    rows = max(seq_local // 2 if causal else seq_local, 1)  # the blocks' query rows
    plan = make_plan(ring_layout, W, causal, window, seq_local)
    pairs_per_rank = plan.score_pairs(seq_local)
    pairs = max(pairs_per_rank, key=sum)
    per_pair = 4.0 * batch * heads * head_dim
    flops = max(sum(row) for row in pairs_per_rank) * per_pair
    kv_bytes = 2.0 * batch * seq_local * kv_heads * head_dim * itemsize  # k and v of a rank
    q_bytes = batch * seq_local * heads * head_dim * itemsize
    predicted: dict[str, float] = {}
    stride = 0
    speeds = speeds or {}

    def rate(name: str, rows: int) -> float:  # FLOPs per ms
        return m.rate(rows) * speeds.get(name, 1.0) * 1e9

    for name in candidates:
        if name == "ring":
            if not causal and window is not None:  # zigzag's ring is causal (or maskless)
                continue
            predicted[name] = _ring_ms(pairs, per_pair, rate(name, rows), kv_bytes, m, backward)
        elif name == "all_gather":
            options = {
                s: _all_gather_ms(flops, rate(name, rows), kv_bytes, W, kv_heads // s, m, backward)
                for s in range(1, kv_heads + 1)
                if kv_heads % s == 0
            }
            stride = min(options, key=lambda s: (options[s], -s))
            predicted[name] = options[stride]
        elif name == "ulysses":
            if heads % W == 0:
                ulysses_kv = kv_bytes * kv_repeat(kv_heads, W)
                predicted[name] = _ulysses_ms(
                    flops, rate(name, seq_len), q_bytes, ulysses_kv, W, m, backward
                )
        else:
            raise ValueError(f"unknown algorithm {name!r}; choose from {ALGORITHMS}")
    if not predicted:
        raise ValueError(f"no candidate algorithm can run this call (candidates={candidates})")
    best = min(predicted, key=lambda a: (predicted[a], ALGORITHMS.index(a)))
    if predicted.get("ring", math.inf) <= (1 + RING_MARGIN) * predicted[best]:
        best = "ring"  # within the model's error: the layout's own algorithm
    others = ", ".join(f"{a} {t:.3g}" for a, t in predicted.items() if a != best)
    reason = (
        f"{best}: {predicted[best]:.3g} ms predicted ({others or 'no other candidate'}) for "
        f"{seq_local} tokens/rank on {W} ranks, H={heads}, H_kv={kv_heads}, D={head_dim}, "
        f"B={batch}, {'forward+backward' if backward else 'forward'}"
    )
    layout = {"ring": ring_layout, "all_gather": "llama3_zigzag", "ulysses": "zigzag"}[best]
    return AlgorithmChoice(best, layout, stride if best == "all_gather" else 0, predicted, reason)
