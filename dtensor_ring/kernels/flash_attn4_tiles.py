"""The tile order of flash-attn 4's fp32 backward accumulators, learnt from its postprocess,
and the reorder into rows (Note [Unrounded block gradients from flash-attn 4] in
``flash_attn4_grads.py``, whose pieces these are)."""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass

import torch
from torch import Tensor


def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (a tile's rows or head dims)."""
    return (x + multiple - 1) // multiple * multiple


def postprocess_args(interface, cfg, hdim_multiple_of: int, which: str, dtype) -> dict:
    """The arguments ``_flash_attn_bwd`` gives its postprocess for ``which`` ("dq" or "dkv"),
    and the output ``dtype`` (the inputs')."""
    if which == "dq":
        block, threads = cfg.m_block_size, 128 if cfg.dQ_single_wg else cfg.num_wg * 128
        atom, swap = cfg.AtomLayoutMdQ, cfg.dQ_swapAB
    else:
        block, threads = cfg.n_block_size, cfg.num_wg * 128
        atom, swap = cfg.AtomLayoutNdKV, cfg.dKV_swapAB
    return dict(
        arch=interface._get_device_arch(),
        block_size=block,
        num_threads=threads,
        atom_layout=atom,
        swap_ab=swap,
        hdim_multiple_of=hdim_multiple_of,
        dtype=dtype,
    )


def _convert(interface, accum: Tensor, output: Tensor, hdim: int, args: dict) -> None:
    """flash-attn 4's postprocess: ``output = round(accum)`` (scale 1)."""
    interface._bwd_postprocess_convert(
        accum,
        output,
        1.0,
        None,
        None,
        args["arch"],
        interface.torch2cute_dtype_map[output.dtype],
        hdim,
        args["block_size"],
        args["num_threads"],
        args["atom_layout"],
        args["swap_ab"],
        use_2cta_instrs=False,
        cluster_size=1,
        accum_order=None,
        cu_total_m_blocks=None,
        fake_mode=False,
        hdim_multiple_of=args["hdim_multiple_of"],
    )


_TILE_ORDERS: dict[tuple, Tensor | None] = {}


def _order_key(hdim: int, args: dict, device: torch.device) -> tuple:
    return (hdim, tuple(sorted(args.items())), device)


def learnt(hdim: int, args: dict, device: torch.device) -> bool:
    """Whether :func:`tile_order` has this order already (it returns it without launching)."""
    return _order_key(hdim, args, device) in _TILE_ORDERS


def tile_order(interface, hdim: int, args: dict, device: torch.device) -> Tensor | None:
    """``perm`` with ``tile.flatten()[perm]`` the ``[rows, hdim_rounded]`` row-major tile of a
    flat accumulator tile, learnt from the postprocess (Note [Unrounded block gradients from
    flash-attn 4]); columns past ``hdim`` are not read and map to 0. Checked once on a tile of
    random integers (exact in bf16 and fp16): None if the postprocess is not that reorder (then the
    plain backward runs)."""
    key = _order_key(hdim, args, device)
    if key in _TILE_ORDERS:
        return _TILE_ORDERS[key]
    rows, hdim_r = args["block_size"], round_up(hdim, args["hdim_multiple_of"])
    size = rows * hdim_r
    flat = torch.arange(size, device=device)
    index = torch.zeros(rows, hdim, dtype=torch.int64, device=device)
    out = torch.empty(1, rows, 1, hdim, dtype=args["dtype"], device=device)
    for bit in range(max(1, math.ceil(math.log2(size)))):
        accum = ((flat >> bit) & 1).to(torch.float32).view(1, 1, size)
        _convert(interface, accum, out, hdim, args)
        index |= out[0, :, 0, :].to(torch.int64) << bit
    perm = torch.zeros(rows, hdim_r, dtype=torch.int64, device=device)
    perm[:, :hdim] = index
    perm = perm.flatten()
    values = torch.randint(-128, 128, (size,), generator=torch.Generator().manual_seed(size))
    values = values.to(device=device, dtype=torch.float32)
    _convert(interface, values.view(1, 1, size), out, hdim, args)
    ok = bool(index.lt(size).all()) and torch.equal(
        out[0, :, 0, :].float(), values[perm].view(rows, hdim_r)[:, :hdim]
    )
    _TILE_ORDERS[key] = perm if ok else None
    return _TILE_ORDERS[key]


def untile_(accums: list[Tensor], perms: list[Tensor], scales: list[float]) -> None:
    """Each ``accum`` (``[B, H, n_tiles * tile]``) scaled and in row-major tile order, in place:
    one Triton launch on CUDA (Note [Unrounded block gradients from flash-attn 4])."""
    untile = _triton("triton_untile_") if accums[0].is_cuda else None
    if untile is not None:
        untile(accums, perms, scales)
        return
    for accum, perm, scale in zip(accums, perms, scales, strict=True):
        tiles = accum.view(-1, perm.numel())
        tiles.copy_(tiles.index_select(-1, perm).mul_(scale))


def as_BSHD(accum: Tensor, hdim_r: int, seq: int, hdim: int) -> Tensor:
    """The ``[B, S, H, D]`` view of an accumulator in row-major tile order: row ``s`` of head
    ``h`` starts at ``h * n + s * hdim_r`` (one op: host time)."""
    B, H, n = accum.shape
    return accum.as_strided((B, seq, H, hdim), (H * n, hdim_r, n, 1))


def padded_total(total: int, cu_seqlens: Tensor, tile: int) -> int:
    """Rows of flash-attn 4's varlen accumulators of ``total`` packed rows in documents
    ``cu_seqlens`` (``_flash_attn_bwd``'s ``total_*_rounded_padded``)."""
    return (total + cu_seqlens.shape[0] * tile - 1) // tile * tile


def padded_rows(cu_seqlens: Tensor, total: int, tile: int) -> Tensor:
    """The row of each of ``total`` packed rows in flash-attn 4's varlen accumulators, whose
    document ``b`` starts at row ``(cu_seqlens[b] + b * tile) // tile * tile``: int64 ``[total]``
    (device ops only: no synchronisation, graph capture allowed)."""
    cu = cu_seqlens.long()
    rows = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], rows, right=True)
    starts = (cu[:-1] + torch.arange(cu.numel() - 1, device=cu.device) * tile) // tile * tile
    return rows + (starts - cu[:-1])[doc]


def untile_rows(
    accums: list[Tensor],
    perms: list[Tensor],
    scales: list[float],
    rows: Tensor,
    tile: int,
    hdims: list[int],
    dtype: torch.dtype,
) -> list[Tensor]:
    """Each varlen ``accum`` ``[H, R * hdim_r]`` (tiles of ``tile`` rows in ``perm``'s
    order) as ``[T, H, hdim]`` of ``dtype``: its rows ``rows`` (:func:`padded_rows`), scaled.
    One Triton launch on CUDA for up to two; else :func:`untile_` (in place), a gather and a
    cast."""
    T = rows.numel()
    outs = [
        torch.empty(T, a.shape[0], h, dtype=dtype, device=a.device)
        for a, h in zip(accums, hdims, strict=True)
    ]
    untile = _triton("triton_untile_rows") if accums[0].is_cuda else None
    if untile is not None:
        untile(accums, perms, scales, rows, tile, outs)
        return outs
    untile_(accums, perms, scales)
    for accum, perm, out in zip(accums, perms, outs, strict=True):
        by_row = accum.view(accum.shape[0], -1, perm.numel() // tile).transpose(0, 1)
        out.copy_(by_row.index_select(0, rows)[..., : out.shape[2]])
    return outs


@dataclass
class TiledGrads:
    """A block's dK and dV as flash-attn 4's main kernel leaves them with GQA: fp32 tiles in the
    order of its MMA fragments, not yet scaled (Note [Block dK/dV added from flash-attn 4's
    tiles] in ``flash_attn4_ring_dq.py``). The engine adds them into its accumulators with
    :meth:`add_to`, once."""

    accums: list[Tensor]  # dK, dV: [B, H_kv, R * hdim_r] (dense) or [H_kv, R * hdim_r] (varlen)
    perms: list[Tensor]  # their tile orders (``tile_order``)
    scales: list[float]
    rows: Tensor | None  # varlen: each packed K/V row's padded row (padded_rows); dense: None
    tile: int  # rows a tile
    hdims: list[int]
    seq: int  # the block's K/V rows

    def add_to(self, dk: Tensor, dv: Tensor, index: Tensor | None = None) -> None:
        """``dk``, ``dv`` (fp32 ``[B, S, H_kv, D]`` or ``[T, H_kv, D]``, any row stride) ``+=``
        the block's scaled dK and dV: row ``i`` into row ``i``, or into row ``index[i]``
        (int64, distinct). One Triton launch on CUDA reading the tiles; else the reorder
        (in place), then the adds."""
        if not self.accums:  # the CPU path below reorders the tiles in place
            raise RuntimeError("a block's tiled dK/dV were added twice")
        untile = _triton("triton_untile_rows") if dk.is_cuda else None
        if untile is not None:
            untile(self.accums, self.perms, self.scales, self.rows, self.tile, [dk, dv],
                   dest=index, add=True)  # fmt: skip
            self.accums = []
            return
        if self.rows is None:
            untile_(self.accums, self.perms, self.scales)
            pairs = zip(self.accums, self.perms, self.hdims, strict=True)
            grads = [as_BSHD(a, p.numel() // self.tile, self.seq, h) for a, p, h in pairs]
        else:
            args = (self.accums, self.perms, self.scales, self.rows, self.tile, self.hdims)
            grads = untile_rows(*args, torch.float32)
        self.accums = []
        for acc, grad in zip((dk, dv), grads, strict=True):
            if index is None:
                acc.add_(grad)
            else:
                acc.index_add_(0, index, grad)


@functools.cache
def _triton(name: str):
    """``_triton_tiles``'s ``name`` (imported on first use), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from . import _triton_tiles

    return getattr(_triton_tiles, name)
