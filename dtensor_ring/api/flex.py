"""``dtensor_ring.flex_attention``: PyTorch's FlexAttention over a sequence sharded on a ring.

Same signature and layout as ``torch.nn.attention.flex_attention.flex_attention``, on this
rank's shard ``[B, H, S_local, D]``, plus the process group and the layout that placed the
tokens. The ``BlockMask`` (or bare ``mask_mod``) and ``score_mod`` are the ones written for the
whole sequence on one device: they see global token indices (Note [FlexAttention on the ring]).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, create_block_mask

from .._compat import function_reads, resolve_group
from ..algorithm import VARLEN_ALGORITHMS
from ..consistency import relay_errors
from ..kernels import accumulation_dtype, select_flex_kernel
from ..kernels.flex import FlexKernel, FlexMods
from ..layouts import Layout, get_layout
from ..ops.flex import RingFlex
from ..resolve import (
    AttentionSpec,
    Call,
    Door,
    check_bool,
    group_arg,
    normalize_window,
    resolve_call,
)
from ..schedule.flex import FlexBalance, VisibleBlocks, balanced_layout, flex_plan
from ..schedule.flex import flex_balance as _plan_balance
from ..schedule.flex_documents import MASK_MOD_ARGS, MaskDocuments
from ..schedule.flex_documents import mask_documents as _mask_documents
from .documents import placed_rows
from .dtensor.placements import sequence_group_name
from .varlen import attend_rows

DEFAULT_TILE = 128  # the tile of a bare mask_mod's block sparsity (flex's default BLOCK_SIZE)


@torch.compiler.disable
def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str | Layout = "ring",
    mask_mod: Callable | None = None,
    algorithm: str | None = None,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, AuxOutput]:
    """FlexAttention of this rank's queries over the whole sharded sequence.

    Args:
        query: ``[B, H, S_local, D]``; key, value: ``[B, H_kv, S_local, D]`` (this rank's
            tokens, placed by ``layout``: "ring" = contiguous chunks, "zigzag", "stripe", or
            any registered dense layout).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` with global ``q_idx``/``kv_idx``;
            it must not close over tensors that require grad.
        block_mask: a ``BlockMask`` built for the **global** sequence (``seq_lengths ==
            (W * S_local, W * S_local)``, any ``BLOCK_SIZE``): its ``mask_mod`` decides
            visibility, its tiles which blocks are computed and which ring steps run.
        scale: the score scale (default ``1 / sqrt(D)``).
        enable_gqa: allow ``H_kv < H`` (``H % H_kv == 0``), as in ``flex_attention``.
        return_lse, return_aux: also return the log-sum-exp ``[B, H, S_local]`` (fp32; fp64
            for fp64 inputs): ``(out, lse)``, or ``(out, AuxOutput(lse=...))`` for
            ``return_aux=AuxRequest(lse=True)``.
        kernel_options: None or ``{}`` (PyTorch's Triton kernel options do not apply).
        group: the context-parallel process group (None: the default group).
        layout: the layout that placed the tokens (``dtensor_ring.shard_sequence``).
        mask_mod: instead of ``block_mask``, a bare ``mask_mod(b, h, q_idx, kv_idx)``; its tiles
            (128 x 128) are evaluated on every call.
        algorithm: "ring" (or None), or "all_gather" for a mask that runs as documents
            (Note [Document masks on the varlen kernels]: a document mask, with or without a
            window, no ``score_mod``, lse or ``backend``): each rank fetches only the keys
            its queries see (Note [Gathering what placed documents need]); any other mask
            raises ``ValueError``.
        backend: the block kernel: "flex_triton" (PyTorch's compiled flex kernels; CUDA,
            bf16 / fp16 / fp32) or "flex_math" (any device and dtype); None: the first that
            runs (docs/flex.md).

    Returns:
        ``out [B, H, S_local, D]`` in the input dtype (rows that see no key are 0), with the
        lse as requested.

    DTensors: ``query``, ``key``, ``value`` may instead be ``[B, H, S, D]`` DTensors placed
    ``Shard(2)`` on one mesh dim (the group) and ``Replicate()`` on any other, with
    ``group=None``: the call runs on their local shards (``layout`` as above: "ring" is what
    ``distribute_tensor`` makes) and returns DTensors placed as ``query`` (the lse too).

    Raises:
        ValueError / TypeError: on every rank, before any communication, for anything not
            supported (see docs/flex.md).
    """
    if any(isinstance(t, DTensor) for t in (query, key, value)):
        given = group  # a rank's error reaches the ranks of the group it names, or of its mesh
        with relay_errors(
            lambda: group_arg(given)[0] if given is not None else sequence_group_name(query),
            "flex_attention",
        ):
            mesh, placements, group = _sequence_sharded(query, key, value, group)
        result = flex_attention(
            *(t.to_local() for t in (query, key, value)), score_mod, block_mask, scale,
            enable_gqa, return_lse, kernel_options, return_aux=return_aux, group=group,
            layout=layout, mask_mod=mask_mod, algorithm=algorithm, backend=backend,
        )  # fmt: skip

        def wrap(t: Tensor) -> DTensor:  # out [B, H, S, D] and lse [B, H, S]: Shard(2) alike
            return DTensor.from_local(t, mesh, placements, run_check=False)

        if isinstance(result, Tensor):
            return wrap(result)
        out, aux = result
        return wrap(out), (
            AuxOutput(lse=wrap(aux.lse)) if isinstance(aux, AuxOutput) else wrap(aux)
        )
    group_name, world_size = group_arg(group)
    with relay_errors((group_name,), "flex_attention"):  # one rank's error: every rank's
        if algorithm not in (None, *VARLEN_ALGORITHMS):
            raise ValueError(
                "dtensor_ring.flex_attention runs algorithm='ring' or 'all_gather' (document "
                f"masks), got algorithm={algorithm!r}"
            )
        want_lse = _wanted_lse(return_lse, return_aux)
        q_BSHD, k_BSHD, v_BSHD = (t.transpose(1, 2) for t in _tensors(query, key, value))

    found: dict = {}

    def checks() -> tuple[VisibleBlocks, FlexMods, FlexKernel]:
        found["tiles"], mods, found["block_mask"] = _check_flex(
            q_BSHD, k_BSHD, score_mod, block_mask, mask_mod, enable_gqa, kernel_options,
            world_size,
        )  # fmt: skip
        found["kernel"] = select_flex_kernel(q_BSHD.device, q_BSHD.dtype, backend)
        found["documents"] = _as_documents(
            found["block_mask"], score_mod, backend, want_lse, q_BSHD
        )
        if algorithm == "all_gather" and found["documents"] is None:
            raise ValueError(
                "flex_attention(algorithm='all_gather') runs masks that are packed documents "
                "(within documents causal, full or windowed: e.g. dr.document_mask), without "
                "a score_mod, the lse or backend=; this mask is not one: use algorithm='ring'"
            )
        return found["tiles"], mods, found["kernel"]

    door = Door(
        op="flex_attention",
        any_mask=True,
        lse=want_lse,
        checks=checks,
        metadata=lambda: {
            "mask tiles": found["tiles"].key,
            "flex kernel": found["kernel"].name,
            # with the mask and the lse, it picks the kernels (the varlen ones or flex's),
            # which communicate differently
            "backend argument": backend,
            "algorithm": algorithm or "ring",
            **_names(score_mod, block_mask, mask_mod),
        },
    )
    call = Call(q_BSHD, k_BSHD, v_BSHD, group_name, world_size, layout, softmax_scale=scale)
    spec = resolve_call(call, door)
    visible, mods, kernel = spec.door
    documents = found["documents"]
    if documents is not None:  # Note [Document masks on the varlen kernels]
        return _on_documents(
            documents, q_BSHD, k_BSHD, v_BSHD, layout, group, world_size, spec, algorithm
        )
    lay = get_layout(layout, "dense")
    plan = flex_plan(lay, world_size, q_BSHD.shape[1], visible, trim=kernel.trims)
    out_BSHD, lse_BHS = RingFlex.apply(
        q_BSHD, k_BSHD, v_BSHD, group_name, plan, mods, spec.scale, kernel
    )
    out = out_BSHD.transpose(1, 2)
    if not want_lse:
        return out
    return (out, AuxOutput(lse=lse_BHS)) if return_aux is not None else (out, lse_BHS)


def _as_documents(tiles_mask, score_mod, backend, want_lse, q_BSHD: Tensor):
    """The documents a call runs on the varlen kernels (Note [Document masks on the varlen
    kernels]): its mask read as documents, where there is no ``score_mod``, ``backend=`` or
    lse asked for and the kernels run here; else None (PyTorch's flex kernels per block)."""
    if tiles_mask is None or score_mod is not None or backend is not None or want_lse:
        return None
    return _mask_documents(tiles_mask, q_BSHD.shape[0]) if _documents_run(q_BSHD) else None


def _documents_run(q_BSHD: Tensor) -> bool:
    """Whether a document mask runs on the varlen kernels here: on the CPU (whose flex kernel
    is explicit math too) and in bf16 / fp16 on CUDA (the fused kernels' dtypes; fp32 stays on
    PyTorch's flex kernels). Facts every rank shares, as the two paths communicate
    differently."""
    device = q_BSHD.device.type
    return device == "cpu" or (device == "cuda" and q_BSHD.dtype in (torch.float16, torch.bfloat16))


def _on_documents(
    documents: MaskDocuments,
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    v_BSHD: Tensor,
    layout: str | Layout,
    group: dist.ProcessGroup | None,
    world_size: int,
    spec: AttentionSpec,
    algorithm: str | None,
) -> Tensor:
    """``out [B, H, S_local, D]`` of a mask read as ``documents``: the rows' documents, as
    ``layout`` placed their tokens, by the varlen kernels on the ring (or by ``algorithm``)."""
    B, S_local = q_BSHD.shape[:2]
    row_len = S_local * world_size
    causal, window = normalize_window(documents.window_size, False, B * row_len)
    rank = resolve_group(spec.group_name).rank()
    placed = placed_rows(documents.bounds, B, row_len, layout, world_size, rank, causal, window)
    out_BSHD = attend_rows(
        placed, q_BSHD, k_BSHD, v_BSHD, softmax_scale=spec.scale,
        window_size=documents.window_size, group=group, algorithm=algorithm,
    )  # fmt: skip
    return out_BSHD.transpose(1, 2)


def _sequence_sharded(
    query: object, key: object, value: object, group: object
) -> tuple[DeviceMesh, tuple, dist.ProcessGroup]:
    """``(mesh, placements, group)`` of DTensor inputs placed ``Shard(2)`` (the sequence of
    ``[B, H, S, D]``) on one mesh dim and ``Replicate()`` on the others."""
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            raise TypeError(f"{name} is a {type(t).__name__}, the others DTensors: pass all three")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got {tuple(t.shape)}")
        if (t.device_mesh, t.placements) != (query.device_mesh, query.placements):
            raise ValueError(
                f"query and {name} are placed differently: {tuple(query.placements)} on "
                f"{query.device_mesh} vs {tuple(t.placements)} on {t.device_mesh}"
            )
    if group is not None:
        raise ValueError("group= is the DTensors' mesh dim: pass group=None with DTensor inputs")
    seq = [i for i, p in enumerate(query.placements) if p.is_shard() and p.dim % 4 == 2]
    others = [p for i, p in enumerate(query.placements) if i not in seq]
    if len(seq) != 1 or any(not p.is_replicate() for p in others):
        raise ValueError(
            f"DTensor inputs must be placed Shard(2) (the sequence of [B, H, S, D]) on one mesh "
            f"dim and Replicate() on the others, got {tuple(query.placements)}"
        )
    mesh = query.device_mesh
    W = mesh.size(seq[0])
    for name, t in tensors.items():  # global shapes: every rank sees the same
        if t.shape[2] % W:
            raise ValueError(
                f"{name} has {t.shape[2]} tokens, which {W} ranks cannot hold evenly: every "
                "rank's shard must be the same length"
            )
    return mesh, query.placements, mesh.get_group(seq[0])


def _tensors(*tensors: object) -> tuple[Tensor, ...]:
    for name, t in zip(("query", "key", "value"), tensors, strict=True):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor [B, H, S_local, D], got {type(t).__name__}")
        if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
            raise TypeError(
                f"{name} is a {type(t).__name__}; dtensor_ring.flex_attention takes this rank's "
                "local shards (plain tensors)"
            )
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S_local, D], got {tuple(t.shape)}")
    return tensors


def _wanted_lse(return_lse: object, return_aux: object) -> bool:
    check_bool("return_lse", return_lse)
    if return_aux is None:
        return return_lse
    if not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {return_aux!r}")
    if return_lse:
        raise ValueError("pass return_lse or return_aux, not both")
    if return_aux.max_scores:
        raise ValueError("return_aux=AuxRequest(max_scores=True) is not supported")
    return return_aux.lse


def _names(score_mod, block_mask, mask_mod) -> dict[str, str | None]:
    """What the ranks compare of the user's functions: their qualified names and what they
    compute (a digest of their traced code and the tensors they read: the same function over
    other document ids, another bias table or another softcap is another mask or score)."""
    mask_fn = block_mask.mask_mod if block_mask is not None else mask_mod
    return {
        "score_mod": _qualname(score_mod),
        "mask_mod": _qualname(mask_fn),
        "score_mod's code and data": _data_digest(score_mod, ("score", *MASK_MOD_ARGS)),
        "mask_mod's code and data": _data_digest(mask_fn, MASK_MOD_ARGS),
    }


def _data_digest(fn: Callable | None, names: tuple[str, ...]) -> str | None:
    """A digest of what ``fn`` computes: its traced code (operations, Python constants) and
    the tensors it reads (None: no function; "untraced": one that does not trace, whose data
    is not compared)."""
    if fn is None:
        return None
    reads = function_reads(fn, names)
    if reads is None:
        return "untraced"
    digest = hashlib.blake2b(reads[2].encode(), digest_size=16)
    for t in reads[1]:
        digest.update(repr((t.dtype, tuple(t.shape), t.layout)).encode())
        if t.layout == torch.strided:  # (a sparse tensor: its shape only)
            flat = t.detach().cpu().flatten().contiguous()
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _qualname(fn: object) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_flex(
    q_BSHD: Tensor,
    k_BSHD: Tensor,
    score_mod: object,
    block_mask: object,
    mask_mod: object,
    enable_gqa: object,
    kernel_options: object,
    world_size: int,
) -> tuple[VisibleBlocks, FlexMods, BlockMask | None]:
    """The flex-specific checks (after the shapes'): ``(visible tiles, mods, the BlockMask
    given or built for a bare mask_mod (None: no mask))``."""
    B, S, H, _ = q_BSHD.shape
    H_kv = k_BSHD.shape[2]
    seq_len = S * world_size
    if kernel_options is not None and kernel_options != {}:  # {}: no options (torchtitan's)
        raise ValueError(
            "kernel_options are options of PyTorch's Triton flex kernel; dtensor_ring's blocks do "
            f"not take them: pass kernel_options=None or {{}} (got {kernel_options!r})"
        )
    if not check_bool("enable_gqa", enable_gqa) and H != H_kv:
        raise ValueError(
            f"query has {H} heads and key/value {H_kv}: pass enable_gqa=True for grouped-query "
            "attention (as flex_attention requires)"
        )
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask or None, got "
            f"{type(block_mask).__name__}"
        )
    if block_mask is not None and mask_mod is not None:
        raise ValueError("pass block_mask or mask_mod, not both (a BlockMask has its mask_mod)")
    if block_mask is not None:
        visible = _block_mask_tiles(block_mask, B, H, seq_len, world_size)
        mask_mod = block_mask.mask_mod
        tiles_mask = block_mask
    elif mask_mod is not None:
        tiles_mask = create_block_mask(
            mask_mod, B, H, seq_len, seq_len, q_BSHD.device, DEFAULT_TILE
        )
        visible = VisibleBlocks.of_block_mask(tiles_mask)
    else:
        tiles_mask = None
        visible = VisibleBlocks(seq_len, seq_len, seq_len, torch.ones(1, 1, dtype=torch.bool))
    if score_mod is not None:
        _check_score_mod(score_mod, q_BSHD)
    return visible, FlexMods(score_mod, mask_mod, block_mask), tiles_mask


def _block_mask_tiles(
    block_mask: BlockMask, B: int, H: int, seq_len: int, world_size: int
) -> VisibleBlocks:
    if tuple(block_mask.seq_lengths) != (seq_len, seq_len):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}; "
            f"dtensor_ring.flex_attention takes the mask of the whole sequence: "
            f"create_block_mask(mask_mod, B, H, {seq_len}, {seq_len}) (W = {world_size} ranks x "
            f"{seq_len // world_size} local tokens), with global q_idx / kv_idx"
        )
    mask_B, mask_H = block_mask.shape[:2]
    if mask_B not in (1, B) or mask_H not in (1, H):
        raise ValueError(
            f"block_mask has batch {mask_B} and heads {mask_H}; the call has B = {B}, H = {H} "
            "(a mask's batch and heads must be 1 or the call's)"
        )
    return VisibleBlocks.of_block_mask(block_mask)


def _check_score_mod(score_mod: Callable, q_BSHD: Tensor) -> None:
    """A ``score_mod`` closing over tensors that require grad would need their gradient too:
    refuse it when gradients are being recorded."""
    if not torch.is_grad_enabled():
        return
    index = torch.zeros((), dtype=torch.int64, device=q_BSHD.device)
    score = torch.zeros((), dtype=accumulation_dtype(q_BSHD.dtype), device=q_BSHD.device)
    if score_mod(score, index, index, index, index).requires_grad:
        raise ValueError(
            "score_mod uses a tensor that requires grad (a learned bias?); "
            "dtensor_ring.flex_attention cannot give gradients to a score_mod's captured tensors: "
            "detach them, or compute that term outside attention"
        )


def mask_documents(block_mask: BlockMask, batch: int = 1) -> MaskDocuments | None:
    """What :func:`flex_attention` reads ``block_mask`` (of the whole sequence) as, over
    ``batch`` rows: the documents (``.bounds`` over the rows packed one after another,
    ``.window_size`` flash-attn's ``(left, right)`` within them) whose varlen attention it
    equals pair for pair, which a call without ``score_mod`` and lse runs on the varlen
    kernels; or None, the flex kernels' (Note [Document masks on the varlen kernels]).
    Cached per mask object, as the calls read it."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"mask_documents takes a BlockMask, got {type(block_mask).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    mask_batch = block_mask.kv_num_blocks.shape[0]
    if mask_batch not in (1, batch):
        raise ValueError(f"block_mask has batch {mask_batch}; batch must be 1 or that")
    return _mask_documents(block_mask, batch)


def flex_layout(block_mask: BlockMask, world_size: int, chunks_per_rank: int = 8) -> Layout:
    """The mask-aware layout for ``block_mask`` (global) on ``world_size`` ranks (Note
    [Mask-aware balance]): ``W * chunks_per_rank`` equal chunks dealt out so that every rank's
    visible pairs are close to the mean. Every rank computes the same layout from the same
    mask; shard with ``dtensor_ring.shard_local(x, layout, ...)`` / ``layout.token_indices``
    and pass it as ``layout=`` to :func:`flex_attention`."""
    visible = _global_tiles(block_mask, "flex_layout")
    return balanced_layout(visible, world_size, chunks_per_rank)


def flex_balance(
    block_mask: BlockMask, world_size: int, layout: str | Layout = "ring"
) -> FlexBalance:
    """Per-rank work, blocks computed and skipped, and K/V transfers of
    :func:`flex_attention` with ``block_mask`` (global) on ``world_size`` ranks in ``layout``
    (no process group): the slowest rank sets the pace, compare ``imbalance``."""
    visible = _global_tiles(block_mask, "flex_balance")
    lay = get_layout(layout, "dense")
    lay.check_length(visible.seq_len, world_size)
    return _plan_balance(lay, world_size, visible.seq_len // world_size, visible)


def _global_tiles(block_mask: object, fn: str) -> VisibleBlocks:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{fn} takes a BlockMask, got {type(block_mask).__name__}")
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise ValueError(f"{fn} takes a square (self-attention) BlockMask, got {(q_len, kv_len)}")
    return VisibleBlocks.of_block_mask(block_mask)
