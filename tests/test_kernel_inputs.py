"""Block kernels on what users can hand them: strided views, any finite scale, NaN and Inf.

Note [Kernel inputs] (unit last stride, positive scale) and Note [Strict non-finite values]
(a NaN/Inf reaches exactly the rows that see it) in ``dtensor_ring/kernels``; the merge of
non-finite partial results (Note [Online-softmax merge]). Each CPU backend, forward and
backward, against fp64 references on the whole block; the same cases through every front
door and world sizes 1-4 are in ``tests/adversarial``.
"""

from __future__ import annotations

import math

import pytest
import torch

from dtensor_ring.kernels import get_kernel
from dtensor_ring.kernels.merge import finish_rows, merge_eager_
from tests.adversarial.oracle import strict_attention, visible_dense
from tests.reference import reference_attention

BACKENDS = ["cpu_flash", "math"]
B, S, H, H_KV, D = 2, 8, 4, 2, 8


def _qkv(seed: int = 0, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, S, H, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, S, H_KV, D, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _grads(q, k, v, do, *, causal, scale, window=(-1, -1)):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, causal=causal, scale=scale, window_size=window)
    return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, do)


def _run(kernel, q, k, v, do, *, causal, scale, window=None):
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, window=window)
    grads = kernel.backward(do, q, k, v, out, lse, causal=causal, scale=scale, window=window)
    return out, lse, grads


def _view(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``'s values in another memory layout."""
    if how == "stride_d":  # every second element of a buffer twice as wide
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if how == "transposed":  # a [B, H, S, D] buffer seen as [B, S, H, D]
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    raise AssertionError(how)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["stride_d", "channels_last", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs(backend, how, causal):
    q, k, v, do = _qkv()
    want_out, want_lse, want = _grads(q, k, v, do, causal=causal, scale=0.3)
    views = [_view(x, how) for x in (q, k, v, do)]
    assert how == "transposed" or views[0].stride(-1) != 1
    out, lse, got = _run(get_kernel(backend), *views, causal=causal, scale=0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_dout(backend):
    """``out.sum().backward()`` hands the backward a dout of stride 0 everywhere."""
    q, k, v, _ = _qkv()
    do = torch.ones((), dtype=q.dtype).expand(B, S, H, D)
    _, _, want = _grads(q, k, v, do.contiguous(), causal=True, scale=0.3)
    _, _, got = _run(get_kernel(backend), q, k, v, do, causal=True, scale=0.3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.3, -5.0, 1e-30])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_any_finite_scale(backend, scale, window):
    q, k, v, do = _qkv()
    causal = window is None
    want_out, want_lse, want = _grads(
        q, k, v, do, causal=causal, scale=scale, window=window or (-1, -1)
    )
    out, lse, got = _run(
        get_kernel(backend), q, k, v, do, causal=causal, scale=scale, window=window
    )
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def _same_nonfinite(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """NaN where NaN, +Inf where +Inf, -Inf where -Inf; finite entries close."""
    got = got.to(torch.float64)
    for what, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        diff = (test(got) != test(want)).nonzero().tolist()
        assert not diff, f"{name}: {what} differs at {diff[:5]}"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("mask", ["causal", "window", "none"])
def test_nonfinite_reaches_exactly_the_rows_that_see_it(backend, value, tensor, mask):
    q, k, v, do = _qkv(seed=1)
    token = S // 2
    {"q": q, "k": k, "v": v}[tensor][:, token, 0, 0] = value
    causal, window = {"causal": (True, None), "window": (False, (2, 0)), "none": (False, None)}[
        mask
    ]
    visible = visible_dense(S, causal, window or (-1, -1))
    ref = strict_attention(q, k, v, visible, 0.3, do)
    out, lse, grads = _run(
        get_kernel(backend), q, k, v, do, causal=causal, scale=0.3, window=window
    )
    # a single block is the whole sequence: its rows whose scores were all -inf are NaN
    finish_rows(out, lse, out.dtype)
    _same_nonfinite(out, ref.out, "out")
    _same_nonfinite(lse, ref.lse, "lse")
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        _same_nonfinite(g, getattr(ref, name), name)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_merge_of_nonfinite_blocks_equals_whole(value, tensor):
    """Two key halves computed apart and merged give the whole block's NaN/Inf pattern."""
    q, k, v, _ = _qkv(seed=2)
    {"q": q, "k": k, "v": v}[tensor][:, 1, 0, 0] = value
    ref = strict_attention(q, k, v, visible_dense(S, False), 0.3)
    kernel = get_kernel("math")
    half = S // 2
    out_a, lse_a = kernel.forward(q, k[:, :half], v[:, :half], causal=False, scale=0.3)
    out_b, lse_b = kernel.forward(q, k[:, half:], v[:, half:], causal=False, scale=0.3)
    out_acc, lse_acc = out_a.clone(), lse_a.clone()
    merge_eager_(out_acc, lse_acc, out_b, lse_b)
    finish_rows(out_acc, lse_acc, out_acc.dtype)
    _same_nonfinite(out_acc, ref.out, "out")
    _same_nonfinite(lse_acc, ref.lse, "lse")


def test_merge_keeps_infinite_outputs():
    """``o_A + w (o_B - o_A)`` would turn an infinite ``o_A`` into NaN; the weighted sum keeps
    it infinite, and a block with ``lse = -inf`` has no weight."""
    out_acc = torch.tensor([[[[math.inf]], [[1.0]]]])  # [B=1, S=2, H=1, D=1]
    lse_acc = torch.tensor([[[0.0, float("-inf")]]])  # [B=1, H=1, S=2]
    merge_eager_(out_acc, lse_acc, torch.tensor([[[[2.0]], [[3.0]]]]), torch.tensor([[[0.0, 1.0]]]))
    assert out_acc[0, 0, 0, 0] == math.inf
    assert out_acc[0, 1, 0, 0] == 3.0
    torch.testing.assert_close(lse_acc, torch.tensor([[[math.log(2.0), 1.0]]]))
