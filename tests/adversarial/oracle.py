"""What the answer must be, and how a rank's result is compared with it.

The oracle is attention over the whole sequence on one device, in float64, written
independently of ``dtensor_ring``:

* :func:`visible_dense` / :func:`visible_varlen`: which keys every query sees (causal mask,
  sliding window over global positions, documents of a packed stream), as a bool matrix;
* :func:`strict_attention`: softmax attention that, for every query row, *gathers* the keys
  that row sees and computes on them alone. A NaN or Inf in a token that a row cannot see
  therefore never reaches that row (a masked ``-inf`` score times a NaN value would give
  ``0 * NaN = NaN`` in a dense formulation): this is the strict reference for non-finite
  inputs; for finite inputs it equals ordinary attention. Gradients come from autograd through
  the gathers, so they obey the same rule;
* :func:`baseline_errors`: for bf16/fp16/fp32 inputs, the error that single-device
  ``F.scaled_dot_product_attention`` in the same dtype makes against the fp64 reference; the
  tolerance of a distributed result is derived from it (:func:`tolerance`);
* token placement (:func:`dense_indices`, :func:`varlen_indices`, :func:`hybrid_indices`):
  the global positions a rank holds, in local order, written out from the layouts' definitions
  (docs/api.md, docs/varlen.md, docs/ulysses.md).

A case returns, from every rank, a dict of :class:`Check` (a tensor against its reference
slice) and :class:`Flag` (a yes/no observation, e.g. "this rank raised ValueError"); the
runner evaluates them with :func:`evaluate`. Non-finite entries must sit exactly where the
reference has them (NaN where NaN, +Inf where +Inf, -Inf where -Inf); finite entries must
agree within ``atol * max(1, max |reference|) + rtol * |reference|`` (the absolute part scales
with the tensor's magnitude: values of 1e30 make errors of 1e14 in entries that cancel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.reference import layout_indices

# --- which tokens a rank holds ---------------------------------------------------------------


def dense_indices(layout: str, rank: int, world: int, seq_len: int) -> Tensor:
    """Global positions of rank ``rank``'s tokens under a dense layout (ring/zigzag/stripe).

    A length the layout cannot split (a case that must raise: its data is never compared)
    gets the contiguous split. "llama3_zigzag" and "auto" hold zigzag's tokens."""
    layout = "zigzag" if layout in ("llama3_zigzag", "auto") else layout
    divisor = 2 * world if layout == "zigzag" else world
    if seq_len % divisor != 0:
        layout = "ring"
    return layout_indices(layout, rank, world, seq_len)


def varlen_indices(layout: str, bounds: list[int], rank: int, world: int) -> Tensor:
    """Global positions of rank ``rank``'s tokens of a packed stream with ``bounds`` (global
    ``cu_seqlens``): ring cuts every document into W pieces, zigzag into 2W (pieces r and
    2W-1-r), llama3 cuts the stream into W contiguous slices; llama3_zigzag and auto hold
    zigzag's."""
    layout = "zigzag" if layout in ("llama3_zigzag", "auto") else layout
    if layout == "llama3":
        n = bounds[-1] // world
        return torch.arange(rank * n, (rank + 1) * n)
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        pieces = world if layout == "ring" else 2 * world
        c = (end - start) // pieces
        chosen = [rank] if layout == "ring" else [rank, 2 * world - 1 - rank]
        parts += [torch.arange(start + p * c, start + (p + 1) * c) for p in chosen]
    return torch.cat(parts)


def doc_positions(idx: Tensor, bounds: list[int]) -> Tensor:
    """Position of each token ``idx`` (global indices of a packed stream) in its document."""
    doc = torch.searchsorted(torch.tensor(bounds), idx, right=True) - 1
    return idx - torch.tensor(bounds[:-1])[doc]


def local_cu_seqlens(bounds: list[int], world: int) -> Tensor:
    """Local ``cu_seqlens`` of ring/zigzag varlen: the global boundaries // W (int32)."""
    return torch.tensor([b // world for b in bounds], dtype=torch.int32)


def hybrid_indices(layout: str, seq_len: int, ring_rank: int, R: int, u_rank: int, U: int):
    """Positions held by (ring rank, Ulysses rank): the ring layout's shard over R ring ranks,
    cut into U contiguous pieces, piece ``u_rank`` (Note [Hybrid token assignment])."""
    ring = dense_indices(layout, ring_rank, R, seq_len)
    n = ring.numel() // U
    return ring[u_rank * n : (u_rank + 1) * n]


# --- which keys a query sees ----------------------------------------------------------------


def _window_mask(pos: Tensor, causal: bool, window: tuple[int, int]) -> Tensor:
    """``[S, S]``: key j visible to query i by causality and the flash-attn window
    ``(left, right)`` (-1 unbounded) over the positions ``pos``."""
    i, j = pos[:, None], pos[None, :]
    left, right = window
    visible = torch.ones(len(pos), len(pos), dtype=torch.bool)
    if causal:
        visible &= j <= i
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def visible_dense(seq_len: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> Tensor:
    """``[S, S]`` bool: query i sees key j (global positions)."""
    return _window_mask(torch.arange(seq_len), causal, window)


def visible_varlen(bounds: list[int], causal: bool, window: tuple[int, int] = (-1, -1)) -> Tensor:
    """``[T, T]`` bool for a packed stream: same document, and causal / window over the
    positions within the document."""
    T = bounds[-1]
    doc = torch.zeros(T, dtype=torch.long)
    pos = torch.zeros(T, dtype=torch.long)
    for d, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        doc[start:end] = d
        pos[start:end] = torch.arange(end - start)
    same_doc = doc[:, None] == doc[None, :]
    return same_doc & _window_mask(pos, causal, window)


# --- the strict reference -------------------------------------------------------------------


@dataclass
class Reference:
    """fp64 results over the whole sequence: ``out [B, S, H, D]``, ``lse [B, H, S]`` and, when
    ``dout`` was given, ``dq, dk, dv`` (shapes of q, k, v)."""

    out: Tensor
    lse: Tensor
    dq: Tensor | None = None
    dk: Tensor | None = None
    dv: Tensor | None = None


def strict_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    scale: float,
    dout: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Reference:
    """Attention of ``q [B, S, H, D]`` over ``k, v [B, S, H_kv, D]`` (KV head j serves query
    heads ``j*G .. (j+1)*G-1``), row by row on the keys ``visible [S, S]`` lets it see.

    Computed in float64 on the given values; a query row never touches a key it cannot see.
    With ``dout`` also the gradients (autograd through the per-row gathers). ``sinks [H]``:
    one more score per row and head, whose probability is dropped (attention sinks).
    """
    q, k, v = (x.detach().to(torch.float64).requires_grad_(dout is not None) for x in (q, k, v))
    out, lse = _strict(q, k, v, visible, scale, sinks)
    if dout is None:
        return Reference(out.detach(), lse.detach())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(torch.float64))
    return Reference(out.detach(), lse.detach(), dq, dk, dv)


def _strict(q, k, v, visible, scale, sinks) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`strict_attention`, differentiable (float64 inputs)."""
    group = q.shape[2] // k.shape[2]
    k_e, v_e = (x.repeat_interleave(group, dim=2) for x in (k, v))
    outs, lses = [], []
    for i in range(q.shape[1]):
        idx = visible[i].nonzero().flatten()
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k_e[:, idx]) * scale
        if sinks is not None:
            sink = sinks.to(torch.float64).view(1, -1, 1).expand(scores.shape[0], -1, 1)
            scores = torch.cat([scores, sink], dim=-1)
        lses.append(torch.logsumexp(scores, dim=-1))
        probs = torch.softmax(scores, dim=-1)[..., : len(idx)]
        outs.append(torch.einsum("bhj,bjhd->bhd", probs, v_e[:, idx]))
    return torch.stack(outs, dim=1), torch.stack(lses, dim=-1)


def sinks_share(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    scale: float,
    dout: Tensor,
    sinks: Tensor,
    rows: Tensor,
) -> Tensor:
    """The gradient of ``sinks [H]`` through the rows ``rows`` (one rank's tokens, dim 1)
    alone: what that rank's gradient must be (docs/api.md, Attention sinks), in float64."""
    sinks = sinks.detach().to(torch.float64).requires_grad_()
    q, k, v = (x.detach().to(torch.float64) for x in (q, k, v))
    out, _ = _strict(q, k, v, visible, scale, sinks)
    return torch.autograd.grad(out[:, rows], sinks, dout[:, rows].to(torch.float64))[0]


def second_order(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    scale: float,
    dout: Tensor,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. q, k, v of ``|dq|^2 + |dk|^2 + |dv|^2``, where ``dq, dk, dv`` are
    :func:`strict_attention`'s gradients for ``dout`` (a double backward), in float64."""
    q, k, v = (x.detach().to(torch.float64).requires_grad_() for x in (q, k, v))
    out, _ = _strict(q, k, v, visible, scale, sinks)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(torch.float64), create_graph=True)
    return torch.autograd.grad(sum(g.pow(2).sum() for g in grads), (q, k, v))


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Differentiable causal attention of ``q [B, H, S, D]`` over ``k, v [B, H_kv, S, D]`` (KV
    head j serves query heads ``j*G .. (j+1)*G-1``) in q's dtype: the attention of a model's
    reference step in one process (the ``recompute`` kind), written out."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    seq = torch.arange(q.shape[2])
    scores = scores.masked_fill(seq[None, :] > seq[:, None], float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(scores, dim=-1), v)


def baseline_errors(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, dout: Tensor | None, ref
) -> dict[str, float]:
    """Max abs error of single-device ``F.scaled_dot_product_attention`` in q's dtype against
    the fp64 reference ``ref``, per field (``out`` and, with ``dout``, ``dq``, ``dk``, ``dv``)."""
    leaves = [x.detach().clone().requires_grad_(dout is not None) for x in (q, k, v)]
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=qt.shape[1] != kt.shape[1]
    ).transpose(1, 2)
    errs = {"out": _max_err(out, ref.out)}
    if dout is not None:
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
            errs[name] = _max_err(g, getattr(ref, name))
    return errs


def _max_err(got: Tensor, want: Tensor) -> float:
    diff = (got.to(torch.float64) - want).abs()
    finite = torch.isfinite(diff)
    return float(diff[finite].max()) if finite.any() else 0.0


_FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-3,
    torch.float16: 5e-4,
}


def tolerance(dtype: torch.dtype, baseline_err: float | None = None) -> tuple[float, float]:
    """``(atol, rtol)`` for a result in ``dtype``: a floor per dtype (fp64 1e-10, fp32 1e-5),
    plus 4x the same-dtype single-device baseline error when there is one."""
    floor = _FLOOR.get(dtype, 1e-3)
    return floor + 4 * (baseline_err or 0.0), floor


# --- checks -----------------------------------------------------------------------------------


@dataclass
class Check:
    """A rank's tensor ``got`` against the reference slice ``want`` (fp64), in ``dtype``."""

    got: Tensor | None
    want: Tensor
    dtype: torch.dtype
    atol: float
    rtol: float


@dataclass
class Flag:
    """A yes/no observation made on a rank (``ok``), with what was observed."""

    ok: bool
    what: str


def evaluate(check: Check | Flag) -> str | None:
    """None when ``check`` passes, else a one-line description of the difference."""
    if isinstance(check, Flag):
        return None if check.ok else check.what
    got, want = check.got, check.want
    if not isinstance(got, Tensor):
        return f"no tensor returned (got {type(got).__name__})"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != check.dtype:
        return f"dtype {got.dtype}, expected {check.dtype}"
    got = got.detach().to(torch.float64)
    for what, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        g, w = test(got), test(want)
        if not torch.equal(g, w):
            return (
                f"{what} at {int((g & ~w).sum())} entries where the reference has none, "
                f"missing at {int((w & ~g).sum())} (reference has {int(w.sum())})"
            )
    finite = torch.isfinite(want)
    magnitude = float(want[finite].abs().max()) if finite.any() else 0.0
    err = (got - want).abs()[finite]
    bound = (check.atol * max(1.0, magnitude) + check.rtol * want.abs())[finite]
    if err.numel() and bool((err > bound).any()):
        worst = int((err - bound).argmax())
        return (
            f"max abs err {float(err.max()):.3g} (worst entry {float(err[worst]):.3g} > "
            f"tol {float(bound[worst]):.3g}; {int((err > bound).sum())}/{err.numel()} entries)"
        )
    return None
