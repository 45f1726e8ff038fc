"""FlexAttention blocks on PyTorch's own Triton kernels (CUDA): ``torch.compile``d
``flex_attention`` per block, the user's functions shifted to the block's global positions.

Note [Flex blocks on PyTorch's kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Forward: ``flex_attention(q_blk, k_blk, v_blk, score_mod=shifted, block_mask=sub,
return_lse=True)``, where ``shifted(s, b, h, i, j) = score_mod(s, b, h, q_pos[i], kv_pos[j])``
(``q_pos``, ``kv_pos``: the block's global positions, captured tensors, so every block of a
shape shares one compiled kernel) and ``sub`` is the global ``BlockMask``'s tiles under the
block (gathered when the block's runs start and end on tile boundaries with stride 1, else
built from the shifted ``mask_mod``). A block is a whole step (Note [Flex schedules]): one
large call, hidden tiles skipped by the kernel itself.

Backward with the *global* ``out``/``lse`` (Note [Ring backward]) through public autograd
only: flex returns ``lse_b`` with a gradient, and for the block's softmax
``P_b = exp(S - lse_b)`` = ``P * exp(lse - lse_b)``, so with ``w = exp(lse_b - lse)`` per row

    grad_out_b = w * dO
    grad_lse_b = w * (rowsum(dO * out_b) - rowsum(dO * out))

the block's own backward (which computes ``dS_b = P_b * (dP_b - rowsum(grad_out_b * out_b))
+ P_b * grad_lse_b``) gives ``dS = P * (dP - rowsum(dO * out))``, the global block gradient,
and ``dV = P_b^T grad_out_b = P^T dO``. A gradient of the global lse (flex's lse is
differentiable: ``d lse / d S = P``) enters as ``rowsum(dO * out) - dlse``. It re-runs the
block's forward (PyTorch's flex backward needs its own saved tensors).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .._compat import recompile_limit
from .base import accumulation_dtype
from .flex import FlexKernel, FlexMods, block_positions


def _block_flex(q, k, v, score_mod, block_mask, scale, enable_gqa):
    return flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        return_lse=True,
    )  # fmt: skip


# One compiled function of our own (Dynamo counts recompilations per code object: a user's own
# torch.compile(flex_attention) keeps its count), recompiled per block shape (static, then
# dynamic), grad mode and the user's functions (their code), within RECOMPILES (a limit that
# holds during our calls only): past Dynamo's default of 8 it would fall back to flex's eager
# path, which materialises every block's scores.
RECOMPILES = 64


@functools.cache
def _compiled_flex():
    return torch.compile(_block_flex)


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)


def _run_flex(*args):
    with recompile_limit(RECOMPILES):
        return _compiled_flex()(*args)


def _dense_blocks(num: Tensor, indices: Tensor, n_kv: int) -> Tensor:
    """``[B, H, n_q, n_kv]`` bool from a BlockMask's ordered ``(num_blocks, indices)``."""
    ranks = torch.arange(indices.shape[-1], device=indices.device)
    valid = ranks < num.unsqueeze(-1)
    dense = torch.zeros(*indices.shape[:-1], n_kv + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(valid, indices.long(), n_kv), valid)
    return dense[..., :n_kv]


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks int32 [B, H, n_q], indices int32 [B, H, n_q, n_kv])`` of a dense map."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return num, indices.to(torch.int32)


def _at_positions(fn, q_pos: Tensor, kv_pos: Tensor, with_score: bool):
    """``fn`` (a mask_mod, or a score_mod ``with_score``) seeing the block's global positions
    (lookup tables captured as tensors: blocks of one shape share a compiled kernel)."""
    if with_score:
        return lambda s, b, h, i, j: fn(s, b, h, q_pos[i], kv_pos[j])
    return lambda b, h, i, j: fn(b, h, q_pos[i], kv_pos[j])


def _tile_rows(runs, block: int) -> Tensor | None:
    """The global tile index of each ``block`` tokens of ``runs``, in local order, when every
    run has stride 1 and starts and ends on tile boundaries; else None."""
    if any(st != 1 or p % block or n % block for p, n, st in runs):
        return None
    return torch.cat([torch.arange(p // block, (p + n) // block) for p, n, _ in runs])


def _sub_block_mask(mods: FlexMods, origin, B: int, H: int, device) -> BlockMask | None:
    """The block's ``BlockMask`` (Note [Flex blocks on PyTorch's kernels]), made once per
    call and block (``mods.cache``: the forward's serves the backward)."""
    if mods.mask_mod is None:
        return None
    key = ("block mask", origin)
    if key not in mods.cache:
        mods.cache[key] = _make_sub_block_mask(mods, origin, B, H, device)
    return mods.cache[key]


def _make_sub_block_mask(mods: FlexMods, origin, B: int, H: int, device) -> BlockMask:
    bm = mods.block_mask
    q_pos, kv_pos = block_positions(origin, mods, device)
    s_q, s_k = len(q_pos), len(kv_pos)
    shifted = _at_positions(mods.mask_mod, q_pos, kv_pos, with_score=False)
    if bm is not None:
        rows, cols = (
            _tile_rows(runs, size) for runs, size in zip(origin, bm.BLOCK_SIZE, strict=True)
        )
        if rows is not None and cols is not None:  # the global tiles, gathered
            rows, cols = rows.to(device), cols.to(device)
            partial, full = _dense_tiles(mods, device)

            full = None if full is None else _ordered(_gathered(full, rows, cols))
            return BlockMask.from_kv_blocks(
                *_ordered(_gathered(partial, rows, cols)),
                *(full or (None, None)),
                BLOCK_SIZE=bm.BLOCK_SIZE,
                mask_mod=shifted,
                seq_lengths=(s_q, s_k),
            )
        B, H = bm.shape[:2]  # the mask's own batch and heads (1: it ignores b / h)
    with recompile_limit(RECOMPILES):
        return _compiled_create_block_mask()(shifted, B, H, s_q, s_k, device)


def _gathered(tiles: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    return tiles.index_select(-2, rows).index_select(-1, cols)


def _dense_tiles(mods: FlexMods, device) -> tuple[Tensor, Tensor | None]:
    """The global mask's partial and full tiles as dense bool maps, once per call."""
    if "dense tiles" not in mods.cache:
        bm = mods.block_mask
        n_kv = -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
        partial = _dense_blocks(bm.kv_num_blocks.to(device), bm.kv_indices.to(device), n_kv)
        full = None
        if bm.full_kv_num_blocks is not None:
            full = _dense_blocks(
                bm.full_kv_num_blocks.to(device), bm.full_kv_indices.to(device), n_kv
            )
        mods.cache["dense tiles"] = (partial, full)
    return mods.cache["dense tiles"]


class FlexTritonKernel(FlexKernel):
    """PyTorch's compiled flex kernels per block (CUDA, Triton); bf16 / fp16 / fp32
    (Note [Flex blocks on PyTorch's kernels])."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    name, trims = "flex_triton", False

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"PyTorch's flex kernels run on CUDA here, not {device.type}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} (it takes {', '.join(map(str, self.dtypes))})"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None

    def _call(self, q, k, v, origin, scale, mods):
        score_mod = None
        if mods.score_mod is not None:  # once per call and block, as the block mask
            key = ("score_mod", origin)
            if key not in mods.cache:
                q_pos, kv_pos = block_positions(origin, mods, q.device)
                mods.cache[key] = _at_positions(mods.score_mod, q_pos, kv_pos, with_score=True)
            score_mod = mods.cache[key]
        return _run_flex(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            score_mod,
            _sub_block_mask(mods, origin, q.shape[0], q.shape[2], q.device),
            scale,
            q.shape[2] != k.shape[2],
        )

    def forward(self, q, k, v, origin, scale, mods):
        out, lse = self._call(q, k, v, origin, scale, mods)
        return out.transpose(1, 2), lse.to(accumulation_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, origin, scale, mods, dlse=None):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            out_b, lse_b = self._call(*leaves, origin, scale, mods)
        acc = accumulation_dtype(q.dtype)
        lse_b = lse_b.to(acc)
        empty = lse == float("-inf")  # rows that see nothing: no gradient
        w = torch.exp(lse_b.detach() - lse.masked_fill(empty, 0)).masked_fill(empty, 0)
        do = dout.transpose(1, 2).to(acc)
        delta_b = (do * out_b.detach().to(acc)).sum(-1)
        delta = (do * out.transpose(1, 2).to(acc)).sum(-1)
        if dlse is not None:  # the global lse's own gradient: d lse / d s = P
            delta = delta - dlse.to(acc)
        grads = torch.autograd.grad(
            (out_b, lse_b),
            leaves,
            ((w.unsqueeze(-1) * do).to(out_b.dtype), (w * (delta_b - delta)).to(lse_b.dtype)),
        )
        return tuple(g.contiguous() for g in grads)
