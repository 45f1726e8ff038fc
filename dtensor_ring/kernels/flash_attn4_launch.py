"""flash-attn 4's forward launched without its Python wrapper, after one call through it.

Note [flash-attn 4's forward, replayed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``_flash_attn_fwd`` spends ~0.1 ms of host time a call (an H100's host) working out, from the
shapes and options alone, which compiled kernel runs with which arguments: ~600 lines of
configuration, then one call ``compile_cache[key](*args)``. A ring calls it once per block,
W or more times a forward, so at a few thousand tokens a rank the forward waits on the host.
For a call whose *signature* (every input's shape, strides, dtype, device and pointer
alignment; the options; varlen's ``max_seqlen``) was seen before, we launch that kernel
ourselves with the arguments it got then, the tensors swapped for this call's:

    first call of a signature                       later calls
    _flash_attn_fwd(q, k, v, out=, lse=, ...)       out, lse = empty
      configuration (host, ~0.1 ms)                 args = recorded, with this call's
      compile_cache[key](q, k, v, out, lse,             q, k, v, out, lse, cu_seqlens
                         scale, ..., window)        compiled(*args)
        ^ recorded: the compiled function and
          its arguments, each tensor by which
          input it is (its pointer, shape, strides)

The recording is kept only when it is certainly the whole call: exactly one compiled function
ran, each of its tensor arguments is one of the call's own tensors (q, k, v, ``out``, ``lse``,
``cu_seqlens`` and ``seqused_q``, which we allocate or pass; none copied) and every other
argument is a constant (None, a number, a tuple of them). Which inputs share a pointer
(``cu_seqlens_q is cu_seqlens_k``, ``q is k``) is part of the signature, so a tensor argument
names one input whichever of them it was. Anything the wrapper made for the call (a contiguous
copy, split-KV partials, a scheduler's tensors for many documents) is a tensor we do not know:
that signature then always runs the wrapper. What the wrapper computes on the host depends on
the signature only (it reads no tensor values), so a replay launches what the wrapper would
launch; the launch takes the current stream, as the wrapper's does. (The environment switches
it reads on every call, its log level and scheduler defaults, are taken as they were at the
recording: they choose among correct kernels.) ``REPLAY = False`` runs the wrapper every time
(benchmarks compare the two).

Note [fp32 block outputs from flash-attn 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ring merges W or more block outputs per query row. Rounded to bf16 before the merge, each
carries its own rounding error into the result, whose error is then ~1.15-1.2x a single
kernel's on the mean (docs/performance.md); merged in fp32 and rounded once, it is the single
kernel's. flash-attn 4 has ``acc_O`` in fp32 registers until its epilogue; on sm90 it has no
split-KV path that would keep fp32 partials (``_flash_attn_fwd`` asserts so), so the ring asks
for its own epilogue (``_flash_attn4_fp32_out.py``): ``acc_O`` stored from registers, no
rounding, no shared-memory staging, no TMA; a whole tile as 8-byte stores (a thread's column
pairs), a tile cut by the sequence's end or a smaller head dim one value at a time. The
wrapper still works out everything else (tile sizes, scheduler, compile key) and is handed,
as ``out``, a view of the input dtype onto an fp32 buffer, the first ``D`` of each row's
``2 D`` values, which passes its checks and which the epilogue reads back as the buffer:

    fp32 buffer   row r:  | o_0 | o_1 | ... | o_{D-1} |            (D x 4 bytes)
    bf16 view     row r:  |o_0lo|o_0hi| ... (first D of 2 D)        (strides x 2 of bf16)
    wrapper     : checks shape, dtype, strides of the view; compiles with the fp32 class
    epilogue    : mO's strides / 2 over a recast pointer = the buffer

While it runs, the wrapper's sm90 forward class is the fp32 one and its compile cache one of
fp32 kernels (its key does not tell the classes apart). That happens once per signature, to
record it: later calls replay the recording, and a signature that cannot be replayed runs the
plain forward (its ``out`` rounded, as before) instead. Every wrapper call of ours holds the
recording's lock, so none of our own sees the swapped class (another library's call of the
wrapper from another thread at that moment would: flash-attn 4 has no hook for a kernel class
of its caller's). pack-GQA is off (the epilogue stores rows of one head). Used for ring blocks
that are merged (``BlockKernel.forward(..., unrounded=True)``), never for a whole call's one
block, whose output is the answer.

Note [Merging in flash-attn 4's epilogue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After step 0 a ring's forward merges each block into running fp32 ``(out, lse)``: a pass that
reads the block's fp32 ``out``, reads and writes the accumulator (three ``[S, H, D]`` fp32
tensors of traffic a block; at 8192 tokens of 32 heads of 128, ~0.13 ms on an H100, a quarter
of a long-document rank's forward). Where a block's rows are one run of the accumulators (a
view of them: dense parts, a varlen block of consecutive rows), the kernel can merge
itself: a third class (``FlashAttentionForwardSm90Fp32Merge``) whose epilogue, with the
block's row in registers, reads the accumulator's row and its lse, and writes the merge by
the engine's formulas (Note [Online-softmax merge]), through the fp32 view above (``out``:
those rows of the accumulator; ``lse``: of the running lse, a strided view):

    plain merge:   kernel -> out_b (fp32, HBM) ; merge reads out_b, out, lse -> writes out, lse
    in epilogue:   kernel (acc_O in registers) reads out, lse -> writes out, lse

A row's lse is read by the four threads holding the row and written by one, after a barrier of
the epilogue threads. One path for every tile: load a thread's old values, merge them as
vectors, store; a whole tile loads and stores 8-byte pairs, a partial one (a document's last
rows) value by value under a bounds test, every load issued before any value is used. Read,
merged and written value after value, a partial tile made a varlen block of short documents
3.4x slower than the fp32 class (H100: 32 documents, 350 against 102 us; loads first with a
merge per value 170 us, one vector merge 134 us).
Recorded and replayed like the fp32 class, with its own compile cache; a signature that
cannot be replayed is not merged by the kernel (the engine merges). A varlen block of rows that
are no one run is merged where its rows lie: the whole local queries and accumulators, each
document's rows from ``cu_seqlens_q[d]``, ``seqused_q[d]`` of them (Note [Varlen blocks merged
where their rows lie] in ``engine/varlen_blocks.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
from torch import Tensor

REPLAY = True  # False: every forward through _flash_attn_fwd (Note [flash-attn 4's ...])

_NOT_REPLAYED = object()  # a signature whose call the wrapper makes every time
_LAUNCHES: dict[tuple, object] = {}  # (wrapper, signature) -> _Launch or _NOT_REPLAYED
_MAX_LAUNCHES = 1024  # signatures of a run are few; past this the table starts afresh
_RECORDING = threading.Lock()  # held while the wrapper's cache (or class) is swapped


class _Launch:
    """A recorded kernel call: ``compiled(*args)`` with ``args[i] = tensors[j]`` for each
    ``(i, j)`` of ``fill`` (``tensors``: the call's own, in :func:`forward`'s order)."""

    __slots__ = ("compiled", "args", "fill")

    def __init__(self, compiled: Callable, args: list, fill: list[tuple[int, int]]) -> None:
        self.compiled, self.args, self.fill = compiled, args, fill

    def __call__(self, tensors: Sequence[Tensor | None]) -> None:
        args = list(self.args)
        for i, j in self.fill:
            args[i] = tensors[j]
        self.compiled(*args)


class _Recorder:
    """Stands in for the wrapper's ``compile_cache`` during one call: hands out the compiled
    functions wrapped so that their calls are recorded."""

    def __init__(self, cache: object) -> None:
        self.cache, self.calls = cache, []

    def __contains__(self, key: object) -> bool:
        return key in self.cache

    def __setitem__(self, key: object, compiled: object) -> None:
        self.cache[key] = compiled

    def __getitem__(self, key: object) -> Callable:
        compiled = self.cache[key]

        def record(*args: object) -> object:
            self.calls.append((compiled, args))
            return compiled(*args)

        return record

    def __getattr__(self, name: str) -> object:
        return getattr(self.cache, name)


def _signature(tensors: Sequence[Tensor | None], options: tuple) -> tuple:
    """What fixes the wrapper's host-side work for ``tensors``: their shapes, strides, dtypes,
    devices, pointer alignment and which share a pointer (the first of them, by index)."""
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    return (
        options,
        *(
            None if t is None else (t.shape, t.stride(), t.dtype, t.device, p % 16, ptrs.index(p))
            for t, p in zip(tensors, ptrs, strict=True)
        ),
    )


def _launch_of(calls: list, tensors: Sequence[Tensor | None]) -> object:
    """The recorded call as a :class:`_Launch`, or ``_NOT_REPLAYED`` where it is not certainly
    the whole call (Note [flash-attn 4's forward, replayed])."""
    if len(calls) != 1:
        return _NOT_REPLAYED
    compiled, args = calls[0]
    where = {}  # pointer -> the first of the call's tensors there (the signature has the rest)
    for j, t in enumerate(tensors):
        if t is not None:
            where.setdefault(t.data_ptr(), j)
    fill = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            j = where.get(a.data_ptr())
            t = None if j is None else tensors[j]
            if t is None or (a.shape, a.stride(), a.dtype) != (t.shape, t.stride(), t.dtype):
                return _NOT_REPLAYED
            fill.append((i, j))
        elif not _plain(a):  # something made for the call: not ours to replay
            return _NOT_REPLAYED
    return _Launch(compiled, [None if isinstance(a, Tensor) else a for a in args], fill)


def _plain(a: object) -> bool:
    """Whether ``a`` is made of None, numbers, strings and tuples of them (a constant)."""
    if isinstance(a, (tuple, list)):
        return all(_plain(x) for x in a)
    return a is None or isinstance(a, (bool, int, float, str))


def forward(
    interface: ModuleType,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    fp32_out: bool = False,
    **options: object,
) -> tuple[Tensor, Tensor]:
    """``_flash_attn_fwd(q, k, v, ..., return_lse=True, **options)``'s ``(out, lse)``:
    ``q [B, S, H, D]``, ``k, v [B, S_k, H_kv, D]`` (varlen ``[T, H, D]``, ``[T_k, H_kv, D]``)
    -> ``out`` contiguous like ``q``, ``lse`` fp32 ``[B, H, S]`` (``[H, T]``); replayed where
    the signature was seen (Note [flash-attn 4's forward, replayed]). ``fp32_out``: ``out`` in
    fp32, unrounded (Note [fp32 block outputs from flash-attn 4]; sm90 only)."""
    shape = (*q.shape[:-1], v.shape[-1])
    if fp32_out and _empty(q, k):
        fp32_out = False  # the wrapper writes zeros and -inf itself, launching nothing
    if fp32_out:  # the wrapper is handed the first D of 2 D values of each fp32 row
        out_fp32 = torch.empty(shape, dtype=torch.float32, device=q.device)
        out = out_fp32.view(q.dtype)[..., : shape[-1]]
    else:
        out = out_fp32 = torch.empty(shape, dtype=q.dtype, device=q.device)
    varlen = cu_seqlens_q is not None
    lse_shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    tensors = (q.detach(), k.detach(), v.detach(), out, lse, cu_seqlens_q, cu_seqlens_k, None)
    kind = _FP32_OUT if fp32_out else _PLAIN
    if not _run(interface, kind, tensors, max_seqlen_q, max_seqlen_k, options):
        out, lse = forward(interface, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, **options)  # fmt: skip
        return out.float(), lse
    return out_fp32, lse


def merge_forward(
    interface: ModuleType,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out_acc: Tensor,
    lse_acc: Tensor,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: Tensor | None = None,
    **options: object,
) -> bool:
    """The block :func:`forward` would compute, merged by its epilogue into a running
    ``out_acc`` (fp32, shaped as ``forward``'s ``out``, a unit last stride: rows of the ring's
    accumulator) and ``lse_acc`` (fp32, as its ``lse``, a unit last stride), in place (Note
    [Merging in flash-attn 4's epilogue]; sm90 only); ``seqused_q``: document ``d``'s queries
    are ``seqused_q[d]`` rows from ``cu_seqlens_q[d]`` (Note [Varlen blocks merged where their
    rows lie]). False where this signature runs only through the wrapper: nothing done, the
    caller merges."""
    if _empty(q, k):
        return True  # no query, or no key: nothing to merge
    out = out_acc.view(q.dtype)[..., : v.shape[-1]]
    tensors = (q.detach(), k.detach(), v.detach(), out, lse_acc, cu_seqlens_q, cu_seqlens_k,
               seqused_q)  # fmt: skip
    return _run(interface, _MERGE, tensors, max_seqlen_q, max_seqlen_k, options)


def _empty(q: Tensor, k: Tensor) -> bool:
    return min(q.shape[:-2].numel(), k.shape[:-2].numel()) == 0


_PLAIN, _FP32_OUT, _MERGE = "plain", "fp32_out", "merge"  # the kernel classes (_kernel_class)


def _run(interface: ModuleType, kind: str, tensors, max_seqlen_q, max_seqlen_k, options) -> bool:
    """The wrapper's call on ``tensors`` (``q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
    seqused_q``) with the kernel class ``kind``, replayed where its signature was recorded;
    False (nothing run) for a signature another class than the plain one cannot replay."""
    kernel_options = options if kind == _PLAIN else dict(options, pack_gqa=False)
    wrapper = interface._flash_attn_fwd
    signature = _signature(tensors, (max_seqlen_q, max_seqlen_k, *sorted(kernel_options.items())))
    launch = _LAUNCHES.get((wrapper, signature, kind)) if REPLAY else _NOT_REPLAYED
    if isinstance(launch, _Launch):
        launch(tensors)
        return True
    if kind != _PLAIN and launch is _NOT_REPLAYED:  # its class is swapped in only to record
        return False
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q = tensors
    call = functools.partial(
        wrapper,
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        out=out,
        lse=lse,
        return_lse=True,
        **kernel_options,
    )
    with _RECORDING, _kernel_class(interface, kind) as cache:
        if launch is None:  # a new signature
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            _LAUNCHES[wrapper, signature, kind] = _record(wrapper, cache, call, tensors)
        else:  # a signature the wrapper runs every time; never with another class
            call()
    return True


_CACHES: dict[str, dict] = {_FP32_OUT: {}, _MERGE: {}}  # the wrapper's compile cache per class


@contextlib.contextmanager
def _kernel_class(interface: ModuleType, kind: str) -> Iterator[object]:
    """The wrapper's compile cache, to record from; for a ``kind`` other than the plain one,
    while the wrapper runs, its sm90 forward class is that kind's and its compile cache one of
    that class's kernels (the wrapper's cache key does not tell the classes apart). Hold
    ``_RECORDING``."""
    wrapper = interface._flash_attn_fwd
    if kind == _PLAIN:
        yield getattr(wrapper, "compile_cache", None)
        return
    from . import _flash_attn4_fp32_out as classes

    swapped = {
        _FP32_OUT: classes.FlashAttentionForwardSm90Fp32Out,
        _MERGE: classes.FlashAttentionForwardSm90Fp32Merge,
    }[kind]
    kernel_class, cache = interface.FlashAttentionForwardSm90, wrapper.compile_cache
    interface.FlashAttentionForwardSm90 = swapped
    wrapper.compile_cache = _CACHES[kind]
    try:
        yield _CACHES[kind]
    finally:
        interface.FlashAttentionForwardSm90, wrapper.compile_cache = kernel_class, cache


def _record(wrapper: Callable, cache: object, call: Callable[[], object], tensors) -> object:
    """Run ``call`` (the wrapper's) with its compile cache ``cache`` recorded: what
    :func:`_launch_of` makes of it."""
    if cache is None:
        call()
        return _NOT_REPLAYED
    recorder = _Recorder(cache)
    wrapper.compile_cache = recorder
    try:
        call()
    finally:
        wrapper.compile_cache = cache
    return _launch_of(recorder.calls, tensors)
