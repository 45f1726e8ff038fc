"""A FlexAttention mask read back as packed documents, for the varlen kernels.

Note [Document masks on the varlen kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The fastest attention kernels (flash-attn 4, cuDNN, PyTorch's flash) take no mask function,
but they do take documents (``cu_seqlens``) with a causal mask or a sliding window, and packed
training writes exactly that as a FlexAttention ``BlockMask`` (torchtitan's
``and_masks(causal, same_document)``, with or without a window). :func:`mask_documents`
reads such a mask back as documents, exactly, or says that it is not one:

    BlockMask of the whole sequence       for every row q of every batch row b:
      full tile     -> all its keys           lo(q), hi(q): the first and last key it sees
      partial tile  -> mask_mod, pair by pair n(q): how many keys it sees
      no tile       -> none
                        |
    every row an interval around itself: n = hi - lo + 1, lo <= q <= hi
    documents: a new one at q when rows q - 1 and q share no key (lo(q) > hi(q - 1))
    window:    left = q - lo(q) on rows whose start the window, not the document, sets
               (right alike from hi); none such: unbounded
    verified:  lo(q) = max(start, q - left) and hi(q) = min(end - 1, q + right), every row
      -> documents over the B rows packed one after another; causal when right = 0

Full tiles count whole and ``mask_mod`` is evaluated in partial tiles only, as flex's
compiled kernels compute a ``BlockMask``; the partial tiles a pass of whole tile rows at a
time, so a mask that is not documents is given up at its first rows that show it. Every row's
keys are then known exactly, so a mask
read as documents is the documents' varlen attention pair for pair (one token per document
where each row sees only itself: the same attention). Not read (None: the flex kernels run it): a
``mask_mod`` that reads the head index (flex calls it per head) or does not trace, tiles that
differ between heads, a row that sees no key or keys with a gap, windows that differ between
documents.

The mask is read once per ``BlockMask`` object: again when its tile tensors or the tensors its
``mask_mod`` reads change in place (their version counters), and not for a ``mask_mod`` rebound
to other tensors afterwards (its tiles would be stale too). Every rank reads the same mask the
same way, so every rank takes the same kernels.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .._compat import function_reads, python_modes_active

MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")
_PAIRS_PER_PASS = 256  # partial tiles evaluated together (memory: pairs x tile size bools)


@dataclass(frozen=True)
class MaskDocuments:
    """A mask read as documents: ``bounds`` over the ``B`` rows packed one after another
    (``B * S`` tokens; every row boundary is a document boundary) and the flash-attn window
    ``(left, right)`` within documents (-1: unbounded; ``right = 0``: causal)."""

    bounds: tuple[int, ...]
    window_size: tuple[int, int]


def mask_documents(block_mask: BlockMask, batch: int) -> MaskDocuments | None:
    """``block_mask`` (square, of the whole sequence) over ``batch`` rows as documents, or
    None when it is not a document mask (Note [Document masks on the varlen kernels])."""
    entry = _CACHE.get(id(block_mask))
    if entry is not None and entry.ref() is block_mask and entry.state == _state(entry, batch):
        return entry.result
    reads = function_reads(block_mask.mask_mod, MASK_MOD_ARGS)
    if reads is None and python_modes_active():
        return None  # as function_reads: not remembered, a mode may have caused it
    result = None if reads is None else _read(block_mask, batch, reads[0])
    entry = _Entry(weakref.ref(block_mask), block_mask.mask_mod, () if reads is None else reads[1])
    entry.state = _state(entry, batch)
    entry.result = result
    _CACHE[id(block_mask)] = entry
    while len(_CACHE) > 16:
        _CACHE.popitem(last=False)
    return result


class _Entry:
    """A reading and what it depends on, held weakly: the cache keeps no mask, function or
    tensor alive (a mask_mod may close over a large table)."""

    def __init__(self, ref, mask_mod, constants: tuple[Tensor, ...]):
        self.ref, self.mask_mod = ref, _weak(mask_mod)
        self.constants = tuple(weakref.ref(t) for t in constants)
        self.state: tuple = ()
        self.result: MaskDocuments | None = None


def _weak(obj: object):
    """A weak reference to ``obj``, or a callable returning it where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _state(entry: _Entry, batch: int) -> tuple:
    """What a cached reading depends on: the batch, the mask's function and the versions of
    its tile tensors and of the tensors that function reads."""
    block_mask, constants = entry.ref(), [ref() for ref in entry.constants]
    stale = block_mask is None or block_mask.mask_mod is not entry.mask_mod()
    if stale or any(t is None for t in constants):
        return ("stale",)
    tiles = _tile_tensors(block_mask)
    return (batch, tuple(t._version for t in tiles), tuple(t._version for t in constants))


_CACHE: collections.OrderedDict[int, _Entry] = collections.OrderedDict()


def _tile_tensors(block_mask: BlockMask) -> tuple[Tensor, ...]:
    return tuple(
        t
        for t in (
            block_mask.kv_num_blocks,
            block_mask.kv_indices,
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
        )
        if t is not None
    )


def _read(block_mask: BlockMask, batch: int, reads: frozenset) -> MaskDocuments | None:
    seq_len, kv_len = block_mask.seq_lengths
    if seq_len != kv_len or "h" in reads:
        return None
    tiles = _tile_tensors(block_mask)
    mask_batch, mask_heads = tiles[0].shape[:2]
    if mask_heads > 1 and not all(torch.equal(t, t[:, :1].expand_as(t)) for t in tiles):
        return None  # tiles of their own per head
    per_row = "b" in reads or mask_batch > 1
    rows = [
        _row_keys(block_mask, b, b if mask_batch > 1 else 0) for b in range(batch if per_row else 1)
    ]
    if any(r is None for r in rows):
        return None
    if not per_row:
        rows *= batch
    offsets = [b * seq_len for b in range(batch)]
    lo = torch.cat([r[0] + o for r, o in zip(rows, offsets, strict=True)])
    hi = torch.cat([r[1] + o for r, o in zip(rows, offsets, strict=True)])
    count = torch.cat([r[2] for r in rows])
    return _documents(lo, hi, count)


def _dense(num_blocks: Tensor, indices: Tensor, n_kv: int) -> Tensor:
    """bool ``[n_q, n_kv]``: the tiles a BlockMask lists (``num_blocks [n_q]`` first entries
    of each row of ``indices [n_q, m]``)."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[:, None]
    cols = torch.where(valid, indices.long(), n_kv)  # n_kv: a column for the unlisted entries
    dense = torch.zeros(indices.shape[0], n_kv + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(1, cols, True)[:, :n_kv]


def _row_keys(block_mask: BlockMask, b: int, mask_b: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(lo, hi, count)`` int64 ``[S]`` on the host: each query's first and last visible key
    and how many it sees, in batch row ``b`` (the mask's row ``mask_b``), head 0; None as soon
    as a row's keys are not an interval around it."""
    S = block_mask.seq_lengths[0]
    QB, KB = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-S // QB), -(-S // KB)
    device = block_mask.kv_num_blocks.device
    partial = _dense(
        block_mask.kv_num_blocks[mask_b, 0, :n_q], block_mask.kv_indices[mask_b, 0, :n_q], n_kv
    )
    full = torch.zeros_like(partial)
    if block_mask.full_kv_num_blocks is not None:
        full = _dense(
            block_mask.full_kv_num_blocks[mask_b, 0, :n_q],
            block_mask.full_kv_indices[mask_b, 0, :n_q],
            n_kv,
        )
    big = torch.iinfo(torch.int64).max
    # full tiles: every key of the tile, for each row of the query tile
    starts = torch.arange(n_kv, device=device) * KB
    ends = torch.clamp(starts + KB, max=S)
    lo_tile = torch.where(full, starts, big).amin(1)
    hi_tile = torch.where(full, ends - 1, -1).amax(1)
    count_tile = (full.long() * (ends - starts)).sum(1)
    rows = torch.arange(S, device=device)
    lo, hi, count = lo_tile[rows // QB], hi_tile[rows // QB], count_tile[rows // QB]
    # partial tiles: the mask_mod on every pair, a pass of tiles at a time
    pairs = (partial & ~full).nonzero()
    b_index = torch.tensor(b, dtype=torch.int32, device=device)
    h_index = torch.zeros((), dtype=torch.int32, device=device)

    def pair(q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return block_mask.mask_mod(b_index, h_index, q_idx, kv_idx)

    tile = torch.vmap(torch.vmap(torch.vmap(pair, (None, 0)), (0, None)), (0, 0))
    for chunk in _passes(pairs):
        q_pos = chunk[:, :1] * QB + torch.arange(QB, device=device)  # [P, QB]
        kv_pos = chunk[:, 1:] * KB + torch.arange(KB, device=device)  # [P, KB]
        seen = tile(q_pos.clamp(max=S - 1), kv_pos.clamp(max=S - 1)).to(torch.bool)
        seen &= (kv_pos < S)[:, None, :]
        as_bytes = seen.view(torch.uint8)  # keys in increasing order: argmax finds the first
        first = chunk[:, 1:] * KB + as_bytes.argmax(-1)
        last = chunk[:, 1:] * KB + (KB - 1) - as_bytes.flip(-1).argmax(-1)
        any_key = seen.any(-1)
        keep = (q_pos < S).flatten()  # rows past the sequence's end (a last tile cut short)
        q_rows = q_pos.flatten()[keep]
        lo = lo.scatter_reduce(0, q_rows, torch.where(any_key, first, big).flatten()[keep], "amin")
        hi = hi.scatter_reduce(0, q_rows, torch.where(any_key, last, -1).flatten()[keep], "amax")
        count = count.index_add(0, q_rows, seen.sum(-1).flatten()[keep])
        done = min((int(chunk[-1, 0]) + 1) * QB, S)  # rows whose every tile is counted
        if not _intervals(lo[:done], hi[:done], count[:done], rows[:done]):
            return None  # not documents: stop before evaluating the rest
    return lo.cpu(), hi.cpu(), count.cpu()


def _passes(pairs: Tensor) -> list[Tensor]:
    """The partial tiles ``pairs [P, 2]`` (row-major) in passes of whole query-tile rows, at
    least :data:`_PAIRS_PER_PASS` tiles each where rows allow: after a pass its rows are
    complete, and a mask that is not documents is found out early (a dense random mask after
    its first row of tiles, not after all of them)."""
    new_row = (pairs[1:, 0] != pairs[:-1, 0]).nonzero()[:, 0] + 1
    cuts, start = [], 0
    for end in [*new_row.tolist(), pairs.shape[0]]:
        if end - start >= _PAIRS_PER_PASS or end == pairs.shape[0]:
            cuts.append(end - start)
            start = end
    return [p for p in pairs.split(cuts) if p.numel()]


def _intervals(lo: Tensor, hi: Tensor, count: Tensor, q: Tensor) -> bool:
    """Whether every row ``q`` sees a non-empty interval of keys around itself."""
    return not bool(((count == 0) | (count != hi - lo + 1) | (lo > q) | (hi < q)).any())


def _documents(lo: Tensor, hi: Tensor, count: Tensor) -> MaskDocuments | None:
    """The documents and window whose varlen mask gives exactly these rows (Note [Document
    masks on the varlen kernels]), or None."""
    q = torch.arange(lo.numel())
    if not _intervals(lo, hi, count, q):
        return None
    new = torch.ones_like(q, dtype=torch.bool)
    new[1:] = lo[1:] > hi[:-1]
    starts = q[new]
    bounds = (*starts.tolist(), lo.numel())
    doc = new.long().cumsum(0) - 1
    start, end = starts[doc], torch.tensor(bounds[1:])[doc]
    left = _window_side(q - lo, lo > start)
    right = _window_side(hi - q, hi < end - 1)
    want_lo = start if left < 0 else torch.maximum(start, q - left)
    want_hi = end - 1 if right < 0 else torch.minimum(end - 1, q + right)
    if not (torch.equal(lo, want_lo) and torch.equal(hi, want_hi)):
        return None
    return MaskDocuments(bounds, (left, right))


def _window_side(reach: Tensor, bound: Tensor) -> int:
    """The window's reach on one side: where the window, not the document, ends a row's keys,
    the (single) distance it reaches; -1 where it never does."""
    return int(reach[bound].max()) if bool(bound.any()) else -1
