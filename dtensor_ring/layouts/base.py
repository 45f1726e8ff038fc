"""The :class:`Layout` interface: which global tokens each rank of a group holds.

Note [Sequence layouts]
~~~~~~~~~~~~~~~~~~~~~~~
A global sequence of S tokens is split over W ranks; every rank holds S/W tokens, in increasing
global order. Example S = 16, W = 4 (digits are global token indices):

    ring    rank0: 0  1  2  3     rank1: 4  5  6  7     rank2: 8  9 10 11   rank3: 12 13 14 15
    zigzag  rank0: 0  1 |14 15    rank1: 2  3 |12 13    rank2: 4  5 |10 11  rank3:  6  7 | 8  9
    stripe  rank0: 0  4  8 12     rank1: 1  5  9 13     rank2: 2  6 10 14   rank3:  3  7 11 15

* ring: contiguous chunks. Simple, works for causal and non-causal attention, but with a causal
  mask rank W-1 does W times the work of rank 0.
* zigzag: the sequence is cut into 2W chunks; rank r holds chunk r and chunk 2W-1-r, so every
  rank holds one "early" and one "late" chunk and causal work is perfectly balanced.
* stripe: round-robin tokens; causal work is balanced up to one diagonal per step.

zigzag and stripe exist for causal attention (non-causal attention is balanced under ring).

A layout describes a rank's tokens as **runs**: ``(local start, length, global start)``, the
tokens of a run being ``stride`` global positions apart (ring: one run; zigzag: two; stripe: one
with stride W). Everything else follows from the runs: token indices, the inverse order, and
the blocks of a schedule (Note [Windowed schedules] in ``schedule/plan.py``). A layout may also
give its blocks as :class:`~dtensor_ring.parts.Part` pairs that hold for every local
length (:meth:`Layout.part_block`): such plans are built once per world size, not per length,
and the varlen forms apply them to every document at once (Note [Varlen layouts]).

Adding a layout is one subclass and :func:`~dtensor_ring.layouts.register_layout`; the
schedules, sharding helpers, checks, DTensor path, Ulysses and the simulator ask the object.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Literal

import torch
from torch import Tensor

from ..parts import Block

Run = tuple[int, int, int]  # (local start, length, global position of its first token)
VarlenForm = Literal["documents", "stream", "placed"]


class Layout:
    """How a sequence is spread over the ranks of a group (Note [Sequence layouts]).

    Subclasses set the class attributes and implement :meth:`runs`; :meth:`part_block` is
    optional (without it, plans are derived from the runs for each local length).

    Attributes:
        name: the registry name (the ``layout=`` argument everywhere).
        chunks_per_rank: the sequence is cut into ``chunks_per_rank * W`` equal chunks; the
            global length must be a multiple of that, the local length of ``chunks_per_rank``.
        causal_only: the ring algorithm accepts this layout only with a causal mask (its
            point is to balance causal work). The all-gather and Ulysses accept any mask.
        dense: the layout shards fixed-length sequences (flash-style functions, DTensor SDPA,
            Ulysses, the simulator).
        varlen: its packed-documents form: ``"documents"`` (every document is sharded as a
            sequence of its own), ``"stream"`` (the packed stream is cut into W contiguous
            slices; documents may straddle ranks: llama3's all-gather), ``"placed"`` (each
            document whole on one rank or cut over several, as one set of documents says:
            Note [Balanced documents]), or None.
    """

    name: ClassVar[str]
    chunks_per_rank: ClassVar[int] = 1
    causal_only: ClassVar[bool] = False
    dense: ClassVar[bool] = True
    varlen: ClassVar[VarlenForm | None] = None

    def __repr__(self) -> str:
        return f"<layout {self.name!r}>"

    # --- what a subclass says ---------------------------------------------------------------
    def runs(self, seq_local: int, rank: int, world_size: int) -> tuple[Run, ...]:
        """``rank``'s ``seq_local`` tokens as runs ``(local start, length, global start)``,
        consecutive tokens of a run :meth:`stride` positions apart, in local order."""
        raise NotImplementedError

    def stride(self, world_size: int) -> int:
        """Global distance between consecutive tokens of a run."""
        return 1

    def part_block(self, causal: bool, world_size: int, rank: int, src: int) -> Block | None:
        """The unwindowed block of queries of ``rank`` against K/V of ``src`` with
        :class:`~dtensor_ring.parts.Part` parts valid for every local length (None:
        nothing to compute), or ``NotImplemented`` when the layout has no such table."""
        return NotImplemented

    # --- derived ------------------------------------------------------------------------------
    def divisor(self, world_size: int) -> int:
        """The global sequence length must be a multiple of this on ``world_size`` ranks."""
        return self.chunks_per_rank * world_size

    @property
    def identity_order(self) -> bool:
        """Whether concatenating the ranks' tokens in rank order is the sequence itself."""
        return False

    def check_mask(self, causal: bool, *, ring_func: str = "ring_flash_attn_func") -> None:
        """Raise ``ValueError`` unless ring attention supports this mask in this layout.

        ``ring_func`` is the function the message suggests for non-causal attention.
        """
        if self.causal_only and not causal:
            raise ValueError(
                f"layout={self.name!r} is for causal attention only; pass causal=True, or use "
                f"the ring layout ({ring_func}) for non-causal attention"
            )

    def check_local_length(self, seq_local: int, world_size: int, what: str = "") -> None:
        """Raise ``ValueError`` unless ``seq_local`` tokens a rank can be this layout's shard."""
        c = self.chunks_per_rank
        if seq_local % c != 0:
            raise ValueError(
                f"{what}layout={self.name!r} holds {c} chunks per rank, which needs a local "
                f"sequence length divisible by {c}, got S_local={seq_local}; pad the global "
                f"sequence to a multiple of {self.divisor(world_size)}"
            )

    def check_length(self, seq_len: int, world_size: int) -> None:
        """Raise ``ValueError`` unless a sequence of ``seq_len`` tokens divides as needed."""
        divisor = self.divisor(world_size)
        if seq_len % divisor != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {divisor}, as layout="
                f"{self.name!r} needs on {world_size} ranks; pad the sequence to a multiple of "
                f"{divisor}"
            )

    def token_indices(self, seq_len: int, rank: int, world_size: int) -> Tensor:
        """Global indices (int64 ``[seq_len // world_size]``) of the tokens ``rank`` holds."""
        self.check_length(seq_len, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        return _token_indices(self, seq_len, rank, world_size).clone()

    def order(self, seq_len: int, world_size: int) -> tuple[Tensor, Tensor]:
        """``(order, inverse)``: position p of the rank-order concatenation of all shards
        holds token ``order[p]``; ``x.index_select(dim, inverse)`` puts such a concatenation
        back in token order (cached, CPU int64)."""
        self.check_length(seq_len, world_size)
        return _order(self, seq_len, world_size)


@functools.lru_cache(maxsize=256)
def _token_indices(layout: Layout, seq_len: int, rank: int, world_size: int) -> Tensor:
    stride = layout.stride(world_size)
    runs = layout.runs(seq_len // world_size, rank, world_size)
    return torch.cat([g + stride * torch.arange(n) for _, n, g in runs])


@functools.lru_cache(maxsize=64)
def _order(layout: Layout, seq_len: int, world_size: int) -> tuple[Tensor, Tensor]:
    order = torch.cat([_token_indices(layout, seq_len, r, world_size) for r in range(world_size)])
    return order, torch.argsort(order)
