"""FlexAttention blocks: one block of queries against one block of keys/values under a
``score_mod`` and a ``mask_mod`` that see *global* token positions.

The ring computes a FlexAttention call block by block (Note [FlexAttention on the ring] in
``ops/flex.py``); a block is a run of local queries against a run of visiting keys, and the
positions of both runs in the global sequence are what the user's functions receive as
``q_idx`` / ``kv_idx``. This kernel evaluates the functions on the block with ``torch.vmap``
(as ``flex_attention``'s own eager path does) and computes exact attention with explicit
score matrices (in float64 on CPU, else the accumulation dtype: :func:`compute_dtype`), on
any device; the backward takes the *global*
``out``/``lse`` of its query rows (Note [Ring backward]) and differentiates ``score_mod``
with autograd.

Semantics are ``flex_attention``'s: ``score_mod`` receives the scaled score; a pair the
mask hides (or whose modified score is -inf) has probability 0; a row with no visible key
has ``out = 0`` and ``lse = -inf``, and gradient 0. A NaN or Inf in a token reaches only the
rows whose mask shows them that token (Note [Strict non-finite values] in ``math.py``), where
a one-device kernel leaks it into the hidden pairs of the tiles it shares with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..parts import GlobalRuns
from .base import accumulation_dtype
from .math import _visible_matmul


@dataclass(frozen=True, eq=False)
class FlexMods:
    """The user's FlexAttention functions: ``score_mod(score, b, h, q_idx, kv_idx)`` and
    ``mask_mod(b, h, q_idx, kv_idx)`` (None: the identity / every pair visible), and the
    global ``BlockMask`` they came with (None: a bare ``mask_mod``, or none)."""

    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    block_mask: object = None
    cache: dict = field(default_factory=dict)  # what kernels derive once per call


class FlexKernel:
    """A FlexAttention block kernel: ``forward(q, k, v, origin, scale, mods)`` ->
    ``(out_BSHD, lse_BHS)`` and ``backward(dout, q, k, v, out, lse, origin, scale, mods,
    dlse=None)`` -> ``(dq, dk, dv)`` with the global ``out``/``lse`` (and the gradient of the
    global lse, which flex's lse has), on ``[B, S, H(_kv), D]`` blocks whose
    queries and keys sit at the global positions ``origin = (q_runs, kv_runs)``
    (:data:`~dtensor_ring.parts.GlobalRuns`).

    ``trims``: whether plans should trim blocks to their visible tiles (Note [Flex
    schedules]); a kernel that skips hidden tiles itself takes whole shards instead. The
    engine merges its blocks (by their own rule of empty rows: ``FlexBlocks.merge_``)."""

    name: str
    trims: bool

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when the kernel runs on ``device`` in ``dtype``, else why not."""
        return None


def positions(runs: GlobalRuns, mods: FlexMods, device, side: str) -> Tensor:
    """The global positions (int64, on ``device``) of ``runs``, made once per call and
    ``side`` ("q" or "kv": a diagonal block's two tables are distinct tensors, as Dynamo's
    guards on PyTorch's kernels want them: aliased inputs made torch 2.11 crash when
    recompiling for the next block)."""
    key = ("positions", side, runs)
    if key not in mods.cache:
        ar = functools.partial(torch.arange, dtype=torch.int64, device=device)
        mods.cache[key] = torch.cat([ar(p, p + n * st, st) for p, n, st in runs])
    return mods.cache[key]


def block_positions(origin, mods: FlexMods, device) -> tuple[Tensor, Tensor]:
    """``(q_pos, kv_pos)``: the global positions of a block's queries and keys (its
    ``origin``), made once per call."""
    q_runs, kv_runs = origin
    return positions(q_runs, mods, device, "q"), positions(kv_runs, mods, device, "kv")


class FlexMathKernel(FlexKernel):
    """Explicit scores (float64 on CPU), the functions evaluated with ``torch.vmap``: any
    device, exact, strict for non-finite values; memory ``B * H * S_q * S_k``."""

    name, trims = "flex_math", True

    def forward(self, q, k, v, origin, scale, mods):
        q_pos, kv_pos = block_positions(origin, mods, q.device)
        return flex_block_forward(q, k, v, q_pos, kv_pos, scale, mods)

    def backward(self, dout, q, k, v, out, lse, origin, scale, mods, dlse=None):
        q_pos, kv_pos = block_positions(origin, mods, q.device)
        return flex_block_backward(dout, q, k, v, out, lse, q_pos, kv_pos, scale, mods, dlse)


def compute_dtype(x: Tensor) -> torch.dtype:
    """What :class:`FlexMathKernel` computes a block in: float64 on CPU (its exact path: a
    block's result then rounds once, to the input dtype), else the accumulation dtype."""
    return torch.float64 if x.device.type == "cpu" else accumulation_dtype(x.dtype)


def _vmap_bhqk(fn: Callable, with_score: bool) -> Callable:
    """``fn`` mapped over ``b [B]``, ``h [H]``, ``q_idx [S_q]``, ``kv_idx [S_k]`` (and a
    ``score [B, H, S_q, S_k]`` first when ``with_score``) -> ``[B, H, S_q, S_k]``."""
    prefix = (0,) if with_score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims)
    return torch.vmap(fn, in_dims=prefix + (0, None, None, None))


def _indices(B: int, H: int, device: torch.device) -> tuple[Tensor, Tensor]:
    return torch.arange(B, device=device), torch.arange(H, device=device)


def visible(mods: FlexMods, B: int, H: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor | None:
    """``mask_mod`` on the block: bool ``[B, H, S_q, S_k]`` (None without a mask_mod), at
    every batch row and head, as flex's kernels call it (a ``BlockMask`` built without batch
    or heads still has its ``mask_mod`` called with each ``b`` and ``h``)."""
    if mods.mask_mod is None:
        return None
    b, h = _indices(B, H, q_pos.device)
    return _vmap_bhqk(mods.mask_mod, with_score=False)(b, h, q_pos, kv_pos).to(torch.bool)


def _scores(q_BSHD: Tensor, k_BSHD: Tensor, scale: float) -> Tensor:
    """``q k^T * scale`` as ``[B, H, S_q, S_k]`` in :func:`compute_dtype` (GQA: query head
    ``h`` meets key head ``h // (H / H_kv)``)."""
    B, S_q, H, D = q_BSHD.shape
    H_kv = k_BSHD.shape[2]
    acc = compute_dtype(q_BSHD)
    q = q_BSHD.to(acc).view(B, S_q, H_kv, H // H_kv, D).permute(0, 2, 3, 1, 4)
    k = k_BSHD.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    return (q @ k.transpose(-1, -2) * scale).reshape(B, H, S_q, k_BSHD.shape[1])


def _modified(s_BHQK: Tensor, mods: FlexMods, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    if mods.score_mod is None:
        return s_BHQK
    B, H = s_BHQK.shape[:2]
    b, h = _indices(B, H, s_BHQK.device)
    return _vmap_bhqk(mods.score_mod, with_score=True)(s_BHQK, b, h, q_pos, kv_pos)


def _probs(s_BHQK: Tensor, lse_BHQ: Tensor, mask: Tensor | None) -> Tensor:
    """``exp(s - lse)``, 0 at hidden pairs and in rows with ``lse = -inf`` (no visible key)."""
    empty = lse_BHQ == float("-inf")
    p = torch.exp(s_BHQK - lse_BHQ.masked_fill(empty, 0).unsqueeze(-1))
    p = p.masked_fill(empty.unsqueeze(-1), 0)
    return p if mask is None else p.masked_fill(~mask, 0)  # also in rows with a NaN lse


def _by_kv_head(x_BHSD: Tensor, H_kv: int) -> Tensor:
    """``[B, H, S, D]`` summed over each key head's query heads: ``[B, S, H_kv, D]``."""
    B, H, S, D = x_BHSD.shape
    return x_BHSD.view(B, H_kv, H // H_kv, S, D).sum(2).transpose(1, 2)


def _repeat_kv(x_BSHD: Tensor, H: int) -> Tensor:
    """``[B, S, H_kv, D]`` -> ``[B, H, S, D]`` in :func:`compute_dtype` (query head order)."""
    x = x_BSHD.to(compute_dtype(x_BSHD)).transpose(1, 2)
    return x.repeat_interleave(H // x.shape[1], dim=1)


def flex_block_forward(
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    q_pos: Tensor,
    kv_pos: Tensor,
    scale: float,
    mods: FlexMods,
) -> tuple[Tensor, Tensor]:
    """``(out_BSHD, lse_BHS)`` of one block; ``q_pos [S_q]`` / ``kv_pos [S_k]`` are the
    global positions (int64, on the tensors' device) of its queries and keys."""
    B, _, H, _ = q_BSHD.shape
    s = _modified(_scores(q_BSHD, k_BSHD, scale), mods, q_pos, kv_pos)
    mask = visible(mods, B, H, q_pos, kv_pos)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = _visible_matmul(_probs(s, lse, None), _repeat_kv(v_BSHD, H), mask)
    return out.transpose(1, 2).to(q_BSHD.dtype), lse.to(accumulation_dtype(q_BSHD.dtype))


def flex_block_backward(
    dout_BSHD: Tensor,
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    out_BSHD: Tensor,
    lse_BHS: Tensor,
    q_pos: Tensor,
    kv_pos: Tensor,
    scale: float,
    mods: FlexMods,
    dlse_BHS: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block, given the global ``out``/``lse`` of its query rows and
    the gradient ``dlse`` of the global lse (None: 0)."""
    B, _, H, _ = q_BSHD.shape
    H_kv = k_BSHD.shape[2]
    acc = compute_dtype(q_BSHD)
    raw = _scores(q_BSHD, k_BSHD, scale)
    with torch.enable_grad():
        raw.requires_grad_(mods.score_mod is not None)
        s = _modified(raw, mods, q_pos, kv_pos)
    mask = visible(mods, B, H, q_pos, kv_pos)
    p = _probs(s.detach(), lse_BHS.to(acc), mask)
    mask_t = None if mask is None else mask.transpose(-1, -2)
    do = dout_BSHD.to(acc).transpose(1, 2)  # [B, H, S_q, D]
    dv = _by_kv_head(_visible_matmul(p.transpose(-1, -2), do, mask_t), H_kv)
    dp = do @ _repeat_kv(v_BSHD, H).transpose(-1, -2)
    delta = (do * out_BSHD.to(acc).transpose(1, 2)).sum(-1, keepdim=True)
    if dlse_BHS is not None:  # d lse_i / d s_ij = p_ij: one more term of every row's dS
        delta = delta - dlse_BHS.to(acc).unsqueeze(-1)
    ds = p * (dp - delta)  # the gradient of the modified scores
    if mask is not None:  # 0 at hidden pairs, also where a hidden value made dp NaN
        ds = ds.masked_fill(~mask, 0)
    if mods.score_mod is not None:
        (ds,) = torch.autograd.grad(s, raw, ds)
        if mask is not None:  # a hidden pair's score_mod derivative may be anything
            ds = ds.masked_fill(~mask, 0)
    ds = ds * scale
    dq = _visible_matmul(ds, _repeat_kv(k_BSHD, H), mask)
    q_BHSD = q_BSHD.to(acc).transpose(1, 2)
    dk = _by_kv_head(_visible_matmul(ds.transpose(-1, -2), q_BHSD, mask_t), H_kv)
    return dq.transpose(1, 2).to(q_BSHD.dtype), dk.to(k_BSHD.dtype), dv.to(v_BSHD.dtype)
