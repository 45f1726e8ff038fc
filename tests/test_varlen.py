"""Variable-length (packed documents) attention: ring / zigzag varlen and llama3.

Tiers, cheapest first:

1. Pure helpers, one process: sharding against independent index lists, round trips,
   ``llama3_flash_attn_prepare_cu_seqlens`` against a literal port of ring-flash-attention's
   algorithm, ``varlen_balance`` against explicit pair counts.
2. Numerics on the session's gloo pool (world sizes 1-4): every rank builds the same seeded
   packed tensors, computes the fp64 per-document reference (``reference_attention_varlen``) and
   its gradients on the full stream, shards with the library's helpers, calls the API and
   compares its local out/lse and dq/dk/dv with the reference picked by the independent index
   lists below.
3. Bad inputs: every rank makes the same bad call and must raise ``ValueError`` before any
   communication (a rank that did not would block in a collective: the pool reports a hang).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import re

import pytest
import torch
import torch.distributed as dist
from flash2_model import modelled_flash2
from reference import random_qkv, reference_attention_varlen

import dtensor_ring as dr

# --- independent layout definitions ---------------------------------------------------------


def expected_indices(lengths: list[int], api: str, rank: int, world_size: int) -> list[int]:
    """Global token indices rank ``rank`` holds, written out as in Note [Varlen layouts]."""
    W, out, start = world_size, [], 0
    if api == "llama3":
        n = sum(lengths) // W
        return list(range(rank * n, (rank + 1) * n))
    for length in lengths:
        if api == "ring":
            piece = length // W
            out += range(start + rank * piece, start + (rank + 1) * piece)
        else:  # zigzag
            c = length // (2 * W)
            out += range(start + rank * c, start + (rank + 1) * c)
            out += range(start + (2 * W - 1 - rank) * c, start + (2 * W - rank) * c)
        start += length
    return out


def cumulative(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def document_lengths(kind: str, api: str, world_size: int, seed: int = 0) -> list[int]:
    """Global document lengths for a case: valid for ``api`` on ``world_size`` ranks."""
    W = world_size
    rng = random.Random(seed * 100 + W)
    if api in ("ring", "zigzag"):
        m = W if api == "ring" else 2 * W
        units = {
            "single": [3],
            "many_short": [1] * 6,
            "random": [rng.randint(1, 3) for _ in range(4)],
        }[kind]
        return [m * u for u in units]
    # llama3: any lengths (incl. 1), total a multiple of W, documents straddling rank borders.
    lengths = {
        "single": [5 * W],
        "many_short": [1, 2, 1, 1, 3, 1, 2, 1],
        "random": [rng.randint(1, 3 * W + 2) for _ in range(5)],
        "aligned": [4] * W,
    }[kind]  # "aligned": boundaries exactly at rank borders
    while sum(lengths) % W:
        lengths.append(1)
    return lengths


# --- numerics ---------------------------------------------------------------------------------

# heads -> (H, H_kv, heads_k_stride for llama3)
HEADS = {"mha": (4, 4, 2), "gqa": (4, 2, 1), "mqa": (2, 1, 1)}
VARIANTS = {  # variant -> (api, causal)
    "ring_causal": ("ring", True),
    "ring_full": ("ring", False),
    "zigzag": ("zigzag", True),
    "llama3_causal": ("llama3", True),
    "llama3_full": ("llama3", False),
}
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str = "ring_causal"
    docs: str = "random"
    heads: str = "gqa"
    form: str = "plain"  # "plain", "kvpacked", "qkvpacked"
    dtype: torch.dtype = torch.float64
    D: int = 8
    stride: int | None = None  # llama3 heads_k_stride (default from HEADS)
    max_seqlen: str = "exact"  # "exact", "none" or "loose" (an upper bound)
    cu_dtype_device: str = "cpu"
    window_size: tuple[int, int] = (-1, -1)
    seed: int = 0
    backend: str | None = None  # "flash2_model": cuda_flash's adapter on modelled ops

    def id(self, world_size: int) -> str:
        parts = [
            f"w{world_size}",
            self.variant,
            self.docs,
            self.heads,
            self.form,
            str(self.dtype).replace("torch.", ""),
        ]
        if self.stride is not None:
            parts.append(f"stride{self.stride}")
        if self.max_seqlen != "exact":
            parts.append(f"maxseqlen_{self.max_seqlen}")
        if self.window_size != (-1, -1):
            parts.append("window{}_{}".format(*self.window_size))
        if self.backend is not None:
            parts.append(self.backend)
        return "-".join(parts)


_FUNCS = {
    "ring": "ring_flash_attn_varlen",
    "zigzag": "zigzag_ring_flash_attn_varlen",
    "llama3": "llama3_flash_attn_varlen",
}


def _call(api: str, form: str, q, k, v, meta_args: tuple, **kwargs):
    """Call the API form; returns (result, leaves) with leaves requiring grad."""
    suffix = {"plain": "_func", "kvpacked": "_kvpacked_func", "qkvpacked": "_qkvpacked_func"}
    fn = getattr(dr, _FUNCS[api] + suffix[form])
    if form == "plain":
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        return fn(*leaves, *meta_args, **kwargs), leaves
    if form == "kvpacked":
        leaves = [q.detach().clone().requires_grad_(), torch.stack([k, v], dim=1).requires_grad_()]
        return fn(*leaves, *meta_args, **kwargs), leaves
    leaves = [torch.stack([q, k, v], dim=1).requires_grad_()]
    return fn(*leaves, *meta_args, **kwargs), leaves


def check_varlen(group: dist.ProcessGroup, case: Case) -> float:
    """Worker body: run ``case`` on this rank, compare with the reference; return max error."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    api, causal = VARIANTS[case.variant]
    H, H_kv, stride = HEADS[case.heads]
    if case.form == "qkvpacked":
        H_kv = H
    stride = case.stride or stride
    lengths = document_lengths(case.docs, api, W, case.seed)
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(case.seed)
    q, k, v = (
        torch.randn(T, h, case.D, generator=gen, dtype=torch.float64) for h in (H, H_kv, H_kv)
    )
    dout = torch.randn(T, H, case.D, generator=gen, dtype=torch.float64)

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = reference_attention_varlen(
        *full, cu, causal=causal, window_size=case.window_size
    )
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    idx = torch.tensor(expected_indices(lengths, api, rank, W))

    local = [dr.shard_varlen(x.to(case.dtype), cu, api, rank, W)[0] for x in (q, k, v)]
    for got, x in zip(local, (q, k, v), strict=True):  # the helper picks the documented tokens
        assert torch.equal(got, x[idx].to(case.dtype))
    if api == "llama3":
        cu_q, cu_k, max_q, max_k, k_slice = dr.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal, rank, W
        )
        if case.max_seqlen == "none":
            max_q = max_k = None
        elif case.max_seqlen == "loose":
            max_q, max_k = max_q + 3, max_k + 3
        meta = (cu_q, cu_k, max_q, max_k, stride, k_slice)
    else:
        cu_local = dr.shard_varlen(q, cu, api, rank, W)[1]
        assert cu_local.tolist() == [c // W for c in cumulative(lengths)]
        max_seqlen = {"exact": max(lengths) // W, "none": None, "loose": max(lengths)}[
            case.max_seqlen
        ]
        meta = (cu_local, max_seqlen)
    kwargs = {} if case.window_size == (-1, -1) else {"window_size": case.window_size}
    with modelled_flash2() if case.backend == "flash2_model" else contextlib.nullcontext():
        result, leaves = _call(
            api, case.form, *local, meta, causal=causal, group=group, return_attn_probs=True,
            backend=case.backend, **kwargs,
        )  # fmt: skip
        out, lse, probs = result
        out.backward(dout[idx].to(case.dtype))
    assert probs is None
    assert out.shape == (len(idx), H, case.D) and out.dtype == case.dtype
    assert lse.shape == (H, len(idx))
    assert lse.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
    tol = TOL[case.dtype]
    errors = []

    def compare(name, actual, expected):
        torch.testing.assert_close(
            actual.double(), expected.detach(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}"
        )
        errors.append((actual.double() - expected).abs().max().item())

    compare("out", out, out_ref[idx])
    compare("lse", lse, lse_ref[:, idx])
    dq, dk, dv = (g[idx] for g in grads_ref)
    if case.form == "plain":
        expected = [dq, dk, dv]
    elif case.form == "kvpacked":
        expected = [dq, torch.stack([dk, dv], dim=1)]
    else:
        expected = [torch.stack([dq, dk, dv], dim=1)]
    for i, (leaf, exp) in enumerate(zip(leaves, expected, strict=True)):
        assert leaf.grad is not None and leaf.grad.dtype == case.dtype
        compare(f"grad {i}", leaf.grad, exp)
    return max(errors)


def _params(pairs) -> list:
    return [pytest.param(w, c, id=c.id(w)) for w, c in pairs]


def _docs_for(variant: str) -> tuple[str, ...]:
    base = ("single", "many_short", "random")
    return base + ("aligned",) if variant.startswith("llama3") else base


FP64 = _params(
    (w, Case(variant=v, docs=d, heads=h, seed=w))
    for w in (1, 2, 3, 4)
    for v in VARIANTS
    for d in _docs_for(v)
    for h in ("mha", "gqa")
)
# Sliding windows within documents: smaller than, about equal to and larger than a rank's
# piece of a document and than the documents.
WINDOWED = _params(
    (w, Case(variant=v, docs=d, heads=h, window_size=win, seed=w))
    for w in (1, 2, 3, 4)
    for v in VARIANTS
    for d in _docs_for(v)
    for h, win in (("gqa", (1, 0)), ("mha", (3, 2)), ("gqa", (6, 1)), ("mqa", (40, 40)))
    if d != "single"
)
# The same on cuda_flash's adapter with FlashAttention-2's ops modelled (tests/flash2_model.py):
# the calls the GPU kernel gets, checked on the CPU (llama3's causal prefix block is dense
# with more queries than keys); the fast tier keeps llama3 causal at W = 3, the ring layouts
# run at W = 3 only.
FLASH2_MODEL = [
    pytest.param(w, case, id=case.id(w), marks=[] if fast else [pytest.mark.slow])
    for w in (3, 4)
    for v, win in (
        ("ring_full", (3, 2)),
        ("zigzag", (6, 0)),
        ("llama3_causal", (6, 0)),
        ("llama3_causal", (1, 0)),
        ("llama3_full", (3, 2)),
    )  # fmt: skip
    for case in [Case(variant=v, window_size=win, seed=w, backend="flash2_model")]
    for fast in [(w, v, win) == (3, "llama3_causal", (6, 0))]
    if w == 3 or v[:6] == "llama3"
]
EXTRA = _params(
    [
        *[(w, Case(variant=v, heads="mqa")) for w in (2, 3) for v in VARIANTS],
        *[
            (w, Case(variant=v, form=f))
            for w in (2, 3)
            for v in VARIANTS
            for f in ("kvpacked", "qkvpacked")
        ],
        *[(w, Case(variant=v, dtype=torch.float32, seed=5)) for w in (2, 4) for v in VARIANTS],
        *[(3, Case(variant=v, max_seqlen=m)) for v in VARIANTS for m in ("none", "loose")],
        (4, Case(variant="llama3_causal", heads="mha", stride=1, docs="many_short")),
        (4, Case(variant="llama3_full", heads="mha", stride=4)),
        (3, Case(variant="llama3_causal", heads="gqa", stride=2, docs="single")),
        (4, Case(variant="zigzag", docs="many_short", heads="mha", D=4, seed=3)),
    ]
)


@pytest.mark.parametrize("world_size, case", FP64)
def test_varlen_fp64(dist_pool, world_size, case):
    dist_pool.run(check_varlen, world_size, case=case)


@pytest.mark.parametrize("world_size, case", WINDOWED)
def test_varlen_window(dist_pool, world_size, case):
    """Sliding windows within documents: ring / zigzag (Note [Windowed varlen]; non-causal for
    ring) and llama3 (causal: diagonal and trimmed prefix blocks; non-causal: trimmed blocks
    per document)."""
    dist_pool.run(check_varlen, world_size, case=case)


@pytest.mark.parametrize("world_size, case", FLASH2_MODEL)
def test_varlen_on_modelled_flash2(dist_pool, world_size, case):
    """Windowed varlen through cuda_flash's adapter on FlashAttention-2's modelled ops: exact
    where the adapter keeps the window the interface asks for (Note [FlashAttention-2's
    unbounded window sides])."""
    dist_pool.run(check_varlen, world_size, case=case)


@pytest.mark.parametrize("world_size, case", EXTRA)
def test_varlen_options(dist_pool, world_size, case):
    """MQA, packed forms, fp32, max_seqlen None/loose, heads_k_stride variants."""
    dist_pool.run(check_varlen, world_size, case=case)


def check_out_only_and_cu_on_device(group: dist.ProcessGroup) -> None:
    """``return_attn_probs=False`` returns ``out`` alone; a second call reuses the metadata."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cu = torch.tensor(cumulative([2 * W, 4 * W]), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 2, 4, dtype=torch.float64, generator=torch.Generator())
    q, cu_local = dr.shard_varlen(x, cu, "zigzag", rank, W)
    out = dr.zigzag_ring_flash_attn_varlen_func(q, q, q, cu_local, None, causal=True, group=group)
    assert isinstance(out, torch.Tensor)
    again, _, _ = dr.zigzag_ring_flash_attn_varlen_func(
        q, q, q, cu_local, None, causal=True, group=group, return_attn_probs=True
    )
    torch.testing.assert_close(out, again, rtol=0, atol=0)


def test_return_out_only(dist_pool):
    dist_pool.run(check_out_only_and_cu_on_device, 2)


# --- bad inputs -------------------------------------------------------------------------------


def _ring_inputs(lengths_local=(4, 2), H=4, H_kv=2, D=8, dtype=torch.float64):
    T = sum(lengths_local)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=gen, dtype=dtype)
    k = torch.randn(T, H_kv, D, generator=gen, dtype=dtype)
    v = torch.randn(T, H_kv, D, generator=gen, dtype=dtype)
    return q, k, v, torch.tensor(cumulative(list(lengths_local)), dtype=torch.int32)


def _ring(g, *, fn=dr.ring_flash_attn_varlen_func, cu=None, max_seqlen=None, qkv=None, **kwargs):
    q, k, v, cu_ok = _ring_inputs()
    q, k, v = qkv if qkv is not None else (q, k, v)
    return fn(
        q,
        k,
        v,
        cu_ok if cu is None else cu,
        max_seqlen,
        causal=kwargs.pop("causal", True),
        group=g,
        **kwargs,
    )


def _llama3(g, *, stride=1, cu_q=None, cu_k=None, k_slice=None, causal=True, **kwargs):
    rank, W = dist.get_rank(g), dist.get_world_size(g)
    cu = torch.tensor(cumulative([3, 2 * W - 1, 2 * W - 2]), dtype=torch.int32)
    q_cu, k_cu, mq, mk, sl = dr.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, W)
    L = int(cu[-1]) // W
    q, k, v, _ = _ring_inputs((L,))
    return dr.llama3_flash_attn_varlen_func(
        q,
        k,
        v,
        q_cu if cu_q is None else cu_q,
        k_cu if cu_k is None else cu_k,
        mq,
        mk,
        stride,
        sl if k_slice is None else k_slice,
        causal=causal,
        group=g,
        **kwargs,
    )


def _bad(*values):
    return torch.tensor(values, dtype=torch.int32)


# name -> (call(group), regex the message must match)
BAD_CALLS = {
    "cu_int64": (lambda g: _ring(g, cu=_bad(0, 4, 6).long()), r"cu_seqlens must be int32"),
    "cu_2d": (lambda g: _ring(g, cu=_bad(0, 4, 6)[None]), r"cu_seqlens must be 1-D"),
    "cu_one_entry": (lambda g: _ring(g, cu=_bad(0)), r"at least 2 entries"),
    "cu_not_increasing": (
        lambda g: _ring(g, cu=_bad(0, 4, 4, 6)),
        r"strictly increasing.*cu_seqlens\[1\]=4 and cu_seqlens\[2\]=4",
    ),
    "cu_decreasing": (lambda g: _ring(g, cu=_bad(0, 5, 3, 6)), r"strictly increasing"),
    "cu_not_from_0": (lambda g: _ring(g, cu=_bad(1, 4, 6)), r"start at 0.*cu_seqlens\[0\]=1"),
    "cu_not_to_T": (lambda g: _ring(g, cu=_bad(0, 4, 5)), r"end at the number of tokens 6"),
    "cu_other_device": (lambda g: _ring(g, cu=_bad(0, 4, 6).to("meta")), r"cu_seqlens is on meta"),
    "cu_not_tensor": (lambda g: _ring(g, cu=[0, 4, 6]), r"cu_seqlens must be an int32 tensor"),
    "zigzag_odd_document": (
        lambda g: _ring(g, fn=dr.zigzag_ring_flash_attn_varlen_func, cu=_bad(0, 3, 6)),
        r"document 0 has 3 tokens.*multiple of 2 \* world_size.*llama3",
    ),
    "zigzag_non_causal": (
        lambda g: _ring(g, fn=dr.zigzag_ring_flash_attn_varlen_func, causal=False),
        r"causal.*ring_flash_attn_varlen_func",
    ),
    "max_seqlen_too_small": (lambda g: _ring(g, max_seqlen=3), r"max_seqlen=3 is smaller.*4"),
    "max_seqlen_not_int": (lambda g: _ring(g, max_seqlen="8"), r"max_seqlen must be an int"),
    "q_4d": (
        lambda g: _ring(g, qkv=tuple(x[None] for x in _ring_inputs()[:3])),
        r"q must be 3-D \[T_local, H, D\]",
    ),
    "q_k_tokens_mismatch": (
        lambda g: _ring(g, qkv=(_ring_inputs()[0], *_ring_inputs((4, 3))[1:3])),
        r"packed length",
    ),
    "heads_not_multiple": (lambda g: _ring(g, qkv=_ring_inputs(H=4, H_kv=3)[:3]), r"H_kv=3"),
    "dtype_mismatch": (
        lambda g: _ring(g, qkv=(_ring_inputs()[0].float(), *_ring_inputs()[1:3])),
        r"dtypes differ",
    ),
    "dropout": (lambda g: _ring(g, dropout_p=0.1), r"dropout_p"),
    "window": (lambda g: _ring(g, window_size=(4, -3)), r"window_size=\(4, -3\) must be two"),
    "alibi": (lambda g: _ring(g, alibi_slopes=torch.ones(4)), r"alibi_slopes"),
    "backend_without_varlen": (lambda g: _ring(g, backend="cpu_flash"), r"varlen"),
    "kv_packed_shape": (
        lambda g: dr.ring_flash_attn_varlen_kvpacked_func(
            _ring_inputs()[0], _ring_inputs()[1], _ring_inputs()[3], None, group=g
        ),
        r"kv must be \[T_local, 2, H_kv, D\]",
    ),
    "qkv_packed_shape": (
        lambda g: dr.zigzag_ring_flash_attn_varlen_qkvpacked_func(
            _ring_inputs()[0], _ring_inputs()[3], None, causal=True, group=g
        ),
        r"qkv must be \[T_local, 3, H, D\]",
    ),
    "llama3_stride": (lambda g: _llama3(g, stride=3), r"heads_k_stride=3.*H_kv=2"),
    "llama3_stride_zero": (lambda g: _llama3(g, stride=0), r"heads_k_stride=0"),
    "llama3_cu_q_not_to_L": (lambda g: _llama3(g, cu_q=_bad(0, 1)), r"cu_seqlens_q must end"),
    "llama3_cu_q_int64": (
        lambda g: _llama3(g, cu_q=_bad(0, 1).long()),
        r"cu_seqlens_q must be int32",
    ),
    "llama3_cu_k_not_to_slice_end": (
        lambda g: _llama3(g, cu_k=_bad(0, 9999)),
        r"cu_seqlens_k must end at the length of local_k_slice",
    ),
    "llama3_slice_type": (lambda g: _llama3(g, k_slice=(0, 4)), r"local_k_slice must be a slice"),
    "llama3_slice_out_of_range": (
        lambda g: _llama3(g, k_slice=slice(0, 10_000)),
        r"local_k_slice=slice\(0, 10000\)",
    ),
    "llama3_dropout": (lambda g: _llama3(g, dropout_p=0.5), r"dropout_p"),
    "llama3_window_malformed": (lambda g: _llama3(g, window_size=(2, 0, 1)), r"window_size"),
}


def check_bad_call(group: dist.ProcessGroup, name: str) -> str:
    """Worker body: make the bad call; return the ValueError's message (or fail)."""
    call, _ = BAD_CALLS[name]
    with pytest.raises(ValueError) as info:
        call(group)
    return str(info.value)


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_on_every_rank(dist_pool, name):
    world_size = 3 if name.startswith("llama3") else 2
    messages = dist_pool.run(check_bad_call, world_size, timeout_s=60, name=name)
    assert len(messages) == world_size
    for message in messages:
        assert re.search(BAD_CALLS[name][1], message, re.S), message


@pytest.mark.parametrize(
    "layout, lengths, world_size, multiple",
    [
        ("ring", [4, 6, 10], 4, 4),
        ("zigzag", [4, 6, 8], 2, 4),
        ("zigzag", [8, 8, 12], 4, 8),
    ],
)
def test_documents_not_divisible(layout, lengths, world_size, multiple):
    """The message names the document, the multiple needed, and points to llama3."""
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
    bad = next(i for i, n in enumerate(lengths) if n % multiple)
    pattern = (
        rf"document {bad} \(tokens \[{cu[bad]}, {cu[bad + 1]}\), length "
        rf"{lengths[bad]}\) is not a multiple of {multiple}.*llama3"
    )
    x = torch.zeros(int(cu[-1]), 2)
    for call in (
        lambda: dr.shard_varlen(x, cu, layout, 0, world_size),
        lambda: dr.varlen_local_cu_seqlens(cu, layout, 0, world_size),
        lambda: dr.varlen_token_indices(cu, layout, 0, world_size),
    ):
        with pytest.raises(ValueError, match=pattern):
            call()


def test_llama3_non_causal_metadata_for_causal_call():
    """Non-causal metadata (keys to the document's end) in a causal call is caught.

    Only on ranks whose slice ends inside a document: elsewhere the two are the same, so this
    is a single-process check of the validation (in a pool the last rank would not raise).
    """
    from dtensor_ring.schedule.llama3 import llama3_meta

    W, L = 2, 4
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # document 1 straddles ranks 0 and 1
    q, k, v, _ = _ring_inputs((L,))
    meta = dr.llama3_flash_attn_prepare_cu_seqlens(cu, False, 0, W)
    with pytest.raises(
        ValueError,
        match=r"llama3_flash_attn_prepare_cu_seqlens\(cu_seqlens, "
        r"causal=True.*cu_seqlens_k\[1:\] == \[3, 4\]",
    ):
        llama3_meta(*meta[:4], meta[4].start, meta[4].stop, L, True, 0, W, q.device)
    meta = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, W)
    llama3_meta(*meta[:4], meta[4].start, meta[4].stop, L, True, 0, W, q.device)


def test_total_not_divisible():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    for call in (
        lambda: dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 2),
        lambda: dr.shard_varlen(torch.zeros(7), cu, "llama3", 0, 2),
        lambda: dr.varlen_balance(cu, 2),
    ):
        with pytest.raises(ValueError, match=r"T=7 .* not divisible by world_size=2"):
            call()


def test_helpers_reject_bad_cu_seqlens():
    with pytest.raises(ValueError, match="int32 or int64"):
        dr.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0.0, 4.0]), True, 0, 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        dr.varlen_balance([0, 4, 4, 8], 2)
    with pytest.raises(ValueError, match="rank=2"):
        dr.shard_varlen(torch.zeros(8), [0, 8], "ring", 2, 2)
    with pytest.raises(ValueError, match="not a varlen layout"):
        dr.shard_varlen(torch.zeros(8), [0, 8], "stripe", 0, 2)


# --- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("api", ["ring", "zigzag", "llama3"])
def test_shard_unshard_roundtrip(api, world_size):
    for kind in ("single", "many_short", "random"):
        lengths = document_lengths(kind, api, world_size, seed=7)
        cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
        full = torch.randn(3, int(cu[-1]), 2)  # seq_dim = 1
        parts = []
        for rank in range(world_size):
            local, cu_local = dr.shard_varlen(full, cu, api, rank, world_size, seq_dim=1)
            idx = expected_indices(lengths, api, rank, world_size)
            assert torch.equal(local, full[:, idx])
            assert cu_local.dtype == torch.int32 and int(cu_local[-1]) == len(idx)
            parts.append(local)
        assert torch.equal(dr.unshard_varlen(parts, cu, api, seq_dim=1), full)


def _prepare_port(cu_seqlens, causal, rank, world_size):
    """ring-flash-attention's llama3_flash_attn_prepare_cu_seqlens, line by line."""
    total_length = cu_seqlens[-1].item()
    length_per_rank = total_length // world_size
    left = torch.searchsorted(cu_seqlens, rank * length_per_rank)
    right = torch.searchsorted(cu_seqlens, (rank + 1) * length_per_rank)
    if cu_seqlens[left] != rank * length_per_rank:
        left -= 1
    left, right = left.item(), right.item()
    cu_seqlens_q = cu_seqlens[left : right + 1].clone()
    cu_seqlens_q -= rank * length_per_rank
    cu_seqlens_q[0] = 0
    cu_seqlens_q[-1] = length_per_rank
    cu_seqlens_k = cu_seqlens[left : right + 1].clone()
    if causal:
        slice_right = (rank + 1) * length_per_rank
        cu_seqlens_k[-1] = slice_right
    else:
        slice_right = cu_seqlens[right].item()
    slice_left = cu_seqlens[left].item()
    cu_seqlens_k -= slice_left
    max_seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()
    max_seqlen_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slice(slice_left, slice_right)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_llama3_prepare_matches_ring_flash_attention(world_size, causal):
    for kind in ("single", "many_short", "random", "aligned"):
        cu = torch.tensor(
            cumulative(document_lengths(kind, "llama3", world_size, seed=3)), dtype=torch.int32
        )
        for rank in range(world_size):
            got = dr.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world_size)
            want = _prepare_port(cu, causal, rank, world_size)
            assert got[0].dtype == got[1].dtype == torch.int32
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
            assert got[2:] == want[2:], (got[2:], want[2:])


def test_varlen_balance_worked_example():
    """The example of docs/varlen.md: one long and three short documents, causal, W = 4."""
    lengths = [256, 64, 64, 128]
    report = dr.varlen_balance(cumulative(lengths), world_size=4, causal=True)
    report = {name: report[name] for name in dr.VARLEN_LAYOUTS}  # the built-in layouts
    total = sum(n * (n + 1) // 2 for n in lengths)
    for layout, work in report.items():
        assert sum(work) == total, layout  # every layout computes each causal pair once
    assert report == {
        "ring": [2880.0, 8512.0, 14144.0, 19776.0],
        "zigzag": [11328.0, 11328.0, 11328.0, 11328.0],
        "llama3": [8256.0, 24640.0, 4160.0, 8256.0],
        "llama3_zigzag": [11328.0, 11328.0, 11328.0, 11328.0],  # zigzag's tokens, all-gathered
    }

    def imbalance(work):
        return max(work) / (sum(work) / len(work))

    assert imbalance(report["zigzag"]) == 1.0
    assert imbalance(report["zigzag"]) < imbalance(report["ring"]) < imbalance(report["llama3"])


def test_varlen_balance_counts():
    # llama3 counts per rank by brute force; ring/zigzag left out when not applicable.
    lengths, W = [5, 1, 7, 3], 4
    cu = cumulative(lengths)
    report = dr.varlen_balance(cu, W, causal=True)
    assert set(report) & set(dr.VARLEN_LAYOUTS) == {"llama3"}  # documents not multiples of W
    doc_start = {t: s for s, e in zip(cu[:-1], cu[1:], strict=True) for t in range(s, e)}
    L = cu[-1] // W
    assert report["llama3"] == [
        float(sum(t - doc_start[t] + 1 for t in range(r * L, r * L + L))) for r in range(W)
    ]
    full = dr.varlen_balance([0, 8, 16], 2, causal=False)
    # zigzag is causal-only; llama3_zigzag (all-gathered) takes any mask
    assert set(full) & set(dr.VARLEN_LAYOUTS) == {"ring", "llama3", "llama3_zigzag"}
    assert full["ring"] == full["llama3"] == full["llama3_zigzag"] == [64.0, 64.0]


# --- custom ops -------------------------------------------------------------------------------


def check_opcheck(group: dist.ProcessGroup, op_name: str) -> None:
    """``torch.library.opcheck`` (schema, fake, autograd registration, AOT dispatch)."""

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    name = group.group_name
    if op_name == "ring_attention_varlen":
        lengths = [2 * W, 4 * W]
        cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
        x = torch.randn(int(cu[-1]), 4, 8, dtype=torch.float64, generator=torch.Generator())
        q, cu_local = dr.shard_varlen(x, cu, "zigzag", rank, W)
        k = q[:, :2].clone()
        args = (
            q.requires_grad_(),
            k.requires_grad_(),
            k.clone().requires_grad_(),
            cu_local,
            None,
            name,
            "zigzag",
            True,
            0.5,
            "math",
        )
        op = torch.ops.dtensor_ring.ring_attention_varlen.default
    else:
        cu = torch.tensor(cumulative([3, 2 * W - 1, 2 * W - 2]), dtype=torch.int32)
        cu_q, cu_k, mq, mk, sl = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
        x = torch.randn(int(cu[-1]) // W, 4, 8, dtype=torch.float64, generator=torch.Generator())
        k = x[:, :2].clone()
        args = (
            x.requires_grad_(),
            k.requires_grad_(),
            k.clone().requires_grad_(),
            cu_q,
            cu_k,
            mq,
            mk,
            1,
            sl.start,
            sl.stop,
            name,
            "llama3",
            True,
            0.5,
            "math",
        )
        op = torch.ops.dtensor_ring.llama3_attention.default
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("op_name", ["ring_attention_varlen", "llama3_attention"])
def test_opcheck(dist_pool, op_name):
    dist_pool.run(check_opcheck, 2, op_name=op_name)


def check_compile(group: dist.ProcessGroup) -> None:
    """The front doors trace with ``fullgraph=True`` (no graph break) and match eager."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cu = torch.tensor(cumulative([2 * W, 4 * W]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(cu[-1]), 4, 8, dtype=torch.float64, generator=gen)
    q, cu_local = dr.shard_varlen(x, cu, "zigzag", rank, W)
    k = q[:, :2].clone()
    meta = dr.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, W)
    ql = x[rank * (x.shape[0] // W) : (rank + 1) * (x.shape[0] // W)]
    kl = ql[:, :2].clone()

    def fn(q, k, ql, kl):
        a = dr.zigzag_ring_flash_attn_varlen_func(q, k, k, cu_local, None, causal=True, group=group)
        b = dr.llama3_flash_attn_varlen_func(
            ql, kl, kl, *meta[:4], 1, meta[4], causal=True, group=group
        )
        return a.sum() + b.sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, ql, kl)]
        loss = f(*leaves)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_compile_fullgraph(dist_pool):
    dist_pool.run(check_compile, 2)


# --- shards made elsewhere: positions tell the door which tokens it holds ----------------------


def check_told_positions(group: dist.ProcessGroup) -> list[str]:
    """Packed documents sharded per document (zigzag): with their positions, exact against the
    fp64 reference. The same row sharded head-tail (2W chunks of the row, torchtitan's
    default): told its positions, the zigzag varlen door raises instead of computing on the
    wrong tokens; contiguous chunks of the row: it names the llama3 stream door."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    docs = [4 * W, 2 * W, 6 * W]
    global_cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
    T = int(global_cu[-1])
    q, k, v = (t[0] for t in random_qkv(1, T, 4, 2, 8, seed=11))
    ref, _ = reference_attention_varlen(q, k, v, global_cu, causal=True)
    local_cu = global_cu // W
    idx = dr.varlen_token_indices(global_cu, "zigzag", rank, W)
    out = dr.ring_varlen_attention_func(
        "zigzag", q[idx], k[idx], v[idx], local_cu, None, causal=True, group=group, positions=idx
    )
    torch.testing.assert_close(out, ref[idx], rtol=1e-10, atol=1e-10)
    messages = []
    for dense in ("zigzag", "ring"):
        held = dr.token_indices(dense, T, rank, W)
        with pytest.raises(ValueError, match="positions: rank") as info:
            dr.ring_varlen_attention_func(
                "zigzag", q[held], k[held], v[held], local_cu, None, causal=True, group=group,
                positions=held,
            )  # fmt: skip
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_positions_refuse_head_tail_rows(dist_pool, world_size):
    for head_tail, contiguous in dist_pool.run(check_told_positions, world_size):
        assert "head-tail order" in head_tail and "shard_varlen" in head_tail, head_tail
        assert "documents_as_sharded" in head_tail, head_tail
        assert "llama3_flash_attn_varlen_func" in contiguous, contiguous
