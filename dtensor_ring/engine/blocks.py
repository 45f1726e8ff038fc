"""How the engine takes parts of the local tensors and runs one block on them.

The ring loops (``engine/ring.py``) and llama3's all-gather loop are the same for dense and
packed sequences; a :class:`Blocks` object holds what differs. Plans are data (parts named by
:class:`Part` or :class:`DocSpans`); the engine turns them into row indices and kernel metadata
here, once per plan and set of documents (:func:`varlen_blocks`, cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..kernels import BlockKernel, BlockKVGrads, DqAccumulator
from ..kernels.flex import FlexMods
from ..kernels.merge import finish_rows, merge_
from ..parts import Block, Part


class Blocks(Protocol):
    """How the engine takes a :class:`Part` of the local tensors and runs one block on it.

    The ring loops (:func:`ring_forward`, :func:`ring_backward`) are the same for dense and
    variable-length sequences; only these steps differ:

    * :class:`DenseBlocks` (the default): ``[B, S, H, D]`` tensors, ``lse [B, H, S]``; a Part is
      a slice of S, the kernel's dense ``forward``/``backward`` runs on it.
    * ``VarlenBlocks`` (:mod:`dtensor_ring.varlen`): packed ``[T, H, D]`` tensors,
      ``lse [H, T]``; a Part is that part of *every document's* local piece, the kernel's
      ``forward_varlen``/``backward_varlen`` runs on it with that Part's ``cu_seqlens``.

    ``take`` may return a view or a copy, so accumulators are only updated through ``add_`` and
    ``merge_``.
    """

    def lse_shape(self, q: Tensor) -> tuple[int, ...]:
        """The shape of the lse of the local queries ``q``."""
        ...

    def covers(self, part: Part, q: Tensor) -> bool:
        """Whether ``part`` takes every row of ``q``, in order (its block's result then has
        the shape of the whole accumulator)."""
        ...

    def is_empty(self, block: Block) -> bool:
        """Whether ``block`` computes nothing (an empty query/key part)."""
        ...

    def in_place(self, kernel: BlockKernel, part: Part) -> bool:
        """Whether ``kernel`` can merge a block of query part ``part`` where its rows lie
        (:meth:`merge_forward`): they are one run of the accumulators (taking them is a view),
        or, varlen, rows of documents the kernel reads in place (Note [Varlen blocks merged
        where their rows lie])."""
        ...

    def take(self, x: Tensor, part: Part) -> Tensor:
        """The rows of ``part`` of a token-major tensor (q, k, v, out, dout and the like)."""
        ...

    def take_lse(self, lse: Tensor, part: Part) -> Tensor:
        """The rows of ``part`` of an lse tensor."""
        ...

    def add_(self, acc: Tensor, part: Part, x: Tensor) -> None:
        """``acc[part] += x`` in place."""
        ...

    def add_kv_(self, dkv: Sequence[Tensor], part: Part, grads: BlockKVGrads) -> None:
        """``dk[part] += grads' dk``, ``dv[part] += grads' dv`` in place (``dkv = [dk, dv]``;
        ``grads`` a pair of tensors or a kernel's :class:`~dtensor_ring.kernels.HeldKVGrads`)."""
        ...

    def init_(
        self, out_acc: Tensor, lse_acc: Tensor, part: Part, out_b: Tensor, lse_b: Tensor
    ) -> None:
        """Set the accumulator rows of ``part`` to a block result (its first)."""
        ...

    def merge_(
        self, out_acc: Tensor, lse_acc: Tensor, part: Part, out_b: Tensor, lse_b: Tensor
    ) -> None:
        """Fold a block result into the accumulator rows of ``part`` (online-softmax merge)."""
        ...

    def forward(
        self,
        kernel: BlockKernel,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        block: Block,
        scale: float,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of ``block`` on parts already taken with :meth:`take`;
        ``unrounded``: the caller merges it, ``out`` may come in the accumulation dtype
        (``BlockKernel.forward``)."""
        ...

    def merge_forward(
        self,
        kernel: BlockKernel,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        block: Block,
        scale: float,
        out_acc: Tensor,
        lse_acc: Tensor,
    ) -> bool:
        """``block`` (its K/V parts already taken; ``q`` the local queries, whose rows of
        the block's query part, :meth:`in_place`, it takes itself) merged by the kernel into
        its rows of the accumulators ``out_acc``, ``lse_acc`` (``BlockKernel.merge_forward``);
        False: nothing done."""
        ...

    def finish(self, out: Tensor, lse: Tensor, whole: bool, dtype: torch.dtype) -> Tensor:
        """The final ``out`` in ``dtype`` from the accumulated one (or, ``whole``, the one
        block's, in ``dtype`` already): rows with ``lse = -inf`` (no visible key) as the
        attention being computed defines them."""
        ...

    def backward(
        self,
        kernel: BlockKernel,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        block: Block,
        scale: float,
        unrounded: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of ``block`` on parts already taken with :meth:`take`;
        ``unrounded``: the caller sums them, any may come in the accumulation dtype
        (``BlockKernel.backward``)."""
        ...

    def dq_accumulator(
        self,
        kernel: BlockKernel,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        blocks: Sequence[Block],
        scale: float,
    ) -> DqAccumulator | None:
        """The kernel's own dq accumulator for ``blocks`` (``BlockKernel.dq_accumulator``; on
        the whole local tensors), or None: the engine sums the blocks' dq."""
        ...


def _part(x: Tensor, part: Part, dim: int) -> Tensor:
    if part is Part.ALL:  # the tensor itself: no view to build (host time per block)
        return x
    start, stop = part.bounds(x.shape[dim])
    return x.narrow(dim, start, stop - start)


class PartsOf:
    """The parts of one tensor that a loop over a plan's blocks takes, each taken once: the
    queries' side (q, out, dout, lse) stays put while K/V travel, and a plan's blocks use a
    few parts of it many times. ``parts_of(part)`` is ``take(x, part)``, remembered by the
    part's identity (parts live in the plan for the whole call)."""

    def __init__(self, take, x: Tensor):
        self._take, self._x, self._parts = take, x, {}

    def __call__(self, part) -> Tensor:
        taken = self._parts.get(id(part))
        if taken is None:
            taken = self._parts[id(part)] = self._take(self._x, part)
        return taken


class DenseBlocks:
    """:class:`Blocks` of dense ``[B, S, H, D]`` tensors with ``seq_local`` tokens a rank."""

    def __init__(self, seq_local: int):
        self.seq_local = seq_local

    def lse_shape(self, q_BSHD: Tensor) -> tuple[int, ...]:
        B, S, H, _ = q_BSHD.shape
        return (B, H, S)

    def covers(self, part: Part, q_BSHD: Tensor) -> bool:
        return part.size(self.seq_local) == q_BSHD.shape[1] == self.seq_local

    def is_empty(self, block: Block) -> bool:
        n = self.seq_local
        return min(block.q.size(n), block.kv.size(n)) == 0

    def in_place(self, kernel: BlockKernel, part: Part) -> bool:
        return True  # a part is a range of the sequence

    def take(self, x_BSHD: Tensor, part: Part) -> Tensor:
        return _part(x_BSHD, part, 1)

    def take_lse(self, lse_BHS: Tensor, part: Part) -> Tensor:
        return _part(lse_BHS, part, 2)

    def add_(self, acc_BSHD: Tensor, part: Part, x_BSHD: Tensor) -> None:
        _part(acc_BSHD, part, 1).add_(x_BSHD)

    def add_kv_(self, dkv_BSHD: Sequence[Tensor], part: Part, grads: BlockKVGrads) -> None:
        rows = [_part(acc, part, 1) for acc in dkv_BSHD]
        if isinstance(grads, tuple):
            for acc, x in zip(rows, grads, strict=True):
                acc.add_(x)
        else:
            grads.add_to(*rows)

    def init_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        _part(out_acc, part, 1).copy_(out_b)
        _part(lse_acc, part, 2).copy_(lse_b)

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        merge_(_part(out_acc, part, 1), _part(lse_acc, part, 2), out_b, lse_b)

    def forward(self, kernel, q, k, v, block, scale, unrounded=False):
        return kernel.forward(
            q, k, v, causal=block.causal, scale=scale, window=block.window, unrounded=unrounded
        )

    def merge_forward(self, kernel, q, k, v, block, scale, out_acc, lse_acc):
        out_rows, lse_rows = _part(out_acc, block.q, 1), _part(lse_acc, block.q, 2)
        return kernel.merge_forward(
            _part(q, block.q, 1), k, v, out_rows, lse_rows,
            causal=block.causal, scale=scale, window=block.window,
        )  # fmt: skip

    def finish(self, out, lse, whole, dtype):
        return softmax_empty_rows(out, lse, whole, dtype)

    def backward(self, kernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        return kernel.backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            causal=block.causal,
            scale=scale,
            window=block.window,
            unrounded=unrounded,
        )

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        return kernel.dq_accumulator(dout, q, k, v, out, lse, blocks, scale=scale)


def softmax_empty_rows(out: Tensor, lse: Tensor, whole: bool, dtype: torch.dtype) -> Tensor:
    """``out`` in ``dtype`` with SDPA's rows of nothing but -inf scores: NaN (the softmax of
    those is 0 / 0), set after the merges (the math kernel's blocks give 0, for merging); a
    CUDA kernel's own answer for a whole call is single-device attention's
    (docs/troubleshooting.md)."""
    return out if whole and out.is_cuda else finish_rows(out, lse, dtype)


class FlexBlocks(DenseBlocks):
    """:class:`Blocks` of a FlexAttention call: dense ``[B, S, H, D]`` tensors, blocks with an
    ``origin`` (Note [Flex schedules]) computed by the engine's ``kernel``, a
    :class:`~dtensor_ring.kernels.flex.FlexKernel`, with the user's functions ``mods`` (and, in
    the backward, the gradient ``dlse`` of the lse the call returned, flex's being
    differentiable). Rows without a visible key are 0 with ``lse = -inf``, as in
    ``flex_attention``: a block's empty rows have weight 0 in a merge, also when the
    accumulator's rows are empty."""

    def __init__(self, seq_local: int, mods: FlexMods, dlse_BHS: Tensor | None = None):
        super().__init__(seq_local)
        self.mods, self.dlse_BHS = mods, dlse_BHS

    def forward(self, kernel, q, k, v, block, scale, unrounded=False):
        return kernel.forward(q, k, v, block.origin, scale, self.mods)  # flex rounds its out

    def in_place(self, kernel: BlockKernel, part: Part) -> bool:
        return False  # never merged by the kernel: its empty rows merge by their own rule (below)

    def backward(self, kernel, dout, q, k, v, out, lse, block, scale, unrounded=False):
        dlse = None if self.dlse_BHS is None else self.take_lse(self.dlse_BHS, block.q)
        return kernel.backward(dout, q, k, v, out, lse, block.origin, scale, self.mods, dlse)

    def dq_accumulator(self, kernel, dout, q, k, v, out, lse, blocks, scale):
        return None

    def merge_(self, out_acc, lse_acc, part, out_b, lse_b) -> None:
        out_rows, lse_rows = _part(out_acc, part, 1), _part(lse_acc, part, 2)
        neither = (lse_rows == float("-inf")) & (lse_b == float("-inf"))
        lse_b = lse_b.masked_fill(neither, 0)  # weight 1 for the block's row of zeros
        merge_(out_rows, lse_rows, out_b, lse_b)
        lse_rows.masked_fill_(neither, float("-inf"))

    def finish(self, out, lse, whole, dtype):
        return finish_rows(out, lse, dtype, empty=0.0)
