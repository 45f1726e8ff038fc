"""The front doors of ``dtensor_ring``, behind one calling convention, and argument memory layouts.

A :class:`Door` is one public way in (``ring_flash_attn_kvpacked_func``, llama3 varlen, SDPA on
DTensors inside ``ring_sdpa``, the transformers attention function, ...). Every door is called
the same way by the cases: :meth:`Door.call` takes this rank's ``q [B, S_local, H, D]``, ``k, v
[B, S_local, H_kv, D]`` (packed-stream doors: ``B == 1``, the stream being dim 1), flash-attn
style keyword arguments (``causal``, ``softmax_scale``, ``window_size``, ``backend``, ...;
:attr:`Door.accepts` lists those the door has a way to pass), and a memory-layout
``view`` applied to every tensor the door receives. It returns ``(out [B, S_local, H, D],
lse [B, H, S_local] or None)``. :meth:`Door.indices` says which global tokens the rank holds
(from the layout definitions in :mod:`tests.adversarial.oracle`), :meth:`Door.visible` which
keys every query sees.

:data:`VIEWS`: value-preserving memory layouts (strided, transposed, channels-last, expanded,
offset views); :func:`view_grad` undoes what a view's backward does to gradients (an expanded
batch sums its gradient into row 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor.parallel import parallelize_module

from . import oracle

# --- memory layouts of the arguments ----------------------------------------------------------


def _stride_d(x: Tensor) -> Tensor:
    """Every second element of a head dim twice as long."""
    return torch.stack([x, torch.zeros_like(x)], dim=-1).flatten(-2)[..., 0::2]


def _transposed(x: Tensor) -> Tensor:
    """Column-major: the strides of a buffer of reversed shape."""
    rev = tuple(reversed(range(x.dim())))
    return x.permute(rev).contiguous().permute(rev)


def _channels_last(x: Tensor) -> Tensor:
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}[x.dim()]
    return x.contiguous(memory_format=fmt)


def _offset(x: Tensor) -> Tensor:
    """A view starting one row into its storage."""
    return torch.cat([torch.zeros_like(x[:1]), x])[1:]


def _heads_strided(x: Tensor) -> Tensor:
    """Every second head of a tensor with twice the heads (dim -2)."""
    return torch.stack([x, torch.zeros_like(x)], dim=-2).flatten(-3, -2)[..., 0::2, :]


def _expanded(x: Tensor) -> Tensor:
    """Row 0 of the batch expanded over the batch (stride 0); the data has equal rows."""
    return x.narrow(0, 0, 1).expand_as(x)


VIEWS: dict[str, Callable[[Tensor], Tensor]] = {
    "contiguous": lambda x: x,
    "stride_d": _stride_d,
    "transposed": _transposed,
    "channels_last": _channels_last,
    "offset": _offset,
    "heads_strided": _heads_strided,
    "expanded": _expanded,
}


def view_grad(view: str, grad: Tensor | None) -> Tensor | None:
    """What a gradient is compared as under ``view``: summed over the batch for "expanded"
    (its backward puts the batch's sum in row 0), unchanged otherwise."""
    if grad is None or view != "expanded":
        return grad
    return grad.sum(0, keepdim=True)


# --- the doors ----------------------------------------------------------------------------

FLASH_KW = frozenset(
    {
        "causal",
        "softmax_scale",
        "window_size",
        "dropout_p",
        "alibi_slopes",
        "deterministic",
        "return_attn_probs",
        "group",
        "backend",
        "sinks",
    }
)
VARLEN_KW = FLASH_KW | {"cu_seqlens", "max_seqlen"}
LLAMA3_KW = FLASH_KW | {
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "heads_k_stride",
    "local_k_slice",
}
HYBRID_KW = (FLASH_KW - {"group"}) | {"ulysses_group", "ring_group"}
#: the all-gather doors also take llama3's ``heads_k_stride``
GATHER_KW = FLASH_KW | {"heads_k_stride"}
#: F.scaled_dot_product_attention on plain local shards inside ``context_parallel``
CP_KW = frozenset({"causal", "softmax_scale", "dropout_p", "attn_mask", "enable_gqa"})
SDPA_KW = frozenset(
    {"causal", "softmax_scale", "window_size", "dropout_p", "backend", "attn_mask", "enable_gqa"}
)
HF_KW = frozenset(
    {"causal", "softmax_scale", "window_size", "dropout_p", "backend", "group", "hf_kwargs"}
)

_PREFIX = {
    ("flash", "ring"): "ring_flash_attn",
    ("flash", "zigzag"): "zigzag_ring_flash_attn",
    ("flash", "stripe"): "stripe_flash_attn",
    ("varlen", "ring"): "ring_flash_attn_varlen",
    ("varlen", "zigzag"): "zigzag_ring_flash_attn_varlen",
    ("llama3", "llama3"): "llama3_flash_attn_varlen",
    ("ulysses", "ring"): "ulysses_flash_attn",
    ("ulysses", "zigzag"): "ulysses_flash_attn",
    ("ulysses", "stripe"): "ulysses_flash_attn",
    ("ulysses", "llama3_zigzag"): "ulysses_flash_attn",
    ("flash", "llama3_zigzag"): "llama3_zigzag_flash_attn",
    ("varlen", "llama3_zigzag"): "llama3_zigzag_flash_attn_varlen",
    ("ulysses", "auto"): "ulysses_flash_attn",
}

#: world size -> (Ulysses size U, ring size R) of the hybrid door
HYBRID_SPLIT = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}


@dataclass
class Ctx:
    """What a case function gets on every rank: its rank and world size in ``group``."""

    rank: int
    world: int
    group: Any


@dataclass
class Tokens:
    """This rank's tokens: ``idx`` their global positions (local order), ``bounds`` the global
    ``cu_seqlens`` of a packed stream (None: dense)."""

    idx: Tensor
    bounds: list[int] | None = None


@dataclass(frozen=True)
class Door:
    """One front door. ``family``: flash | ring_fn (``ring_attention_func(layout, ...)``) |
    varlen | llama3 | ulysses | hybrid | sdpa_fn | sdpa_scope | hf | hf_packed | cp
    (``F.scaled_dot_product_attention`` on plain shards inside ``context_parallel``);
    ``packing``: "", "kv" or "qkv"; ``mode``: the DTensor mode (cp: "default" passes
    ``layout=None``, PyTorch's choice: zigzag when ``S % 2W == 0``, else ring); ``module``
    (cp): the module-level form (``parallelize_module(attn, mesh, ContextParallel(...))``)
    instead of the ``context_parallel`` scope; ``force``
    (``layout="auto"``): the algorithm the call is made to choose ("ring", "all_gather",
    "ulysses": ``tests.engine_spy.forced_algorithm``), "" for the cost model's own choice;
    ``algorithm``: the ``algorithm=`` a varlen door passes (""; none)."""

    name: str
    family: str
    layout: str
    packing: str = ""
    mode: str = "ring"
    force: str = ""
    module: bool = False
    algorithm: str = ""

    @property
    def packed_stream(self) -> bool:
        """Tensors are packed documents (``[T_local, H, D]``; one stream, B == 1)."""
        return self.family in ("varlen", "llama3", "hf_packed")

    @property
    def generic_varlen(self) -> bool:
        """``ring_varlen_attention_func(layout, ...)`` rather than a layout's own varlen door."""
        return self.family == "varlen" and self.name.startswith("ring_varlen_attention_func[")

    @property
    def causal_only(self) -> bool:
        if self.family in ("hf", "hf_packed"):
            return True
        if self.family == "cp":  # non-causal SDPA runs the ring schedule whatever the layout
            return False
        if self.family == "ulysses" or (self.family.startswith("sdpa") and self.mode == "ulysses"):
            return False
        return self.layout in ("zigzag", "stripe")

    @property
    def has_lse(self) -> bool:
        return self.family in ("flash", "ring_fn", "varlen", "llama3", "ulysses", "hybrid")

    @property
    def accepts(self) -> frozenset[str]:
        if self.layout == "llama3_zigzag" and self.family in ("flash", "ring_fn"):
            return GATHER_KW - {"heads_k_stride"} if self.family == "ring_fn" else GATHER_KW
        if self.layout == "llama3_zigzag" and self.family == "varlen":
            return VARLEN_KW | {"heads_k_stride"}
        return {
            "varlen": VARLEN_KW,
            "llama3": LLAMA3_KW,
            "hybrid": HYBRID_KW,
            "sdpa_fn": SDPA_KW,
            "sdpa_scope": SDPA_KW,
            "hf": HF_KW,
            "hf_packed": HF_KW,
            "cp": CP_KW,
        }.get(self.family, FLASH_KW)

    def default_docs(self, world: int) -> tuple[int, ...]:
        """Document lengths of the packed stream (8 tokens per rank): multiples of 2W for
        ring/zigzag varlen, uneven (straddling the rank slices) for llama3 and the balanced
        documents (``dr.document_layout``, any lengths)."""
        if self.layout in ("llama3", *PLACED):
            return (3, 8 * world - 5, 2)
        return (4 * world, 2 * world, 2 * world)

    def indices(self, rank: int, world: int, seq_len: int, bounds: list[int] | None) -> Tensor:
        """Global positions of this rank's tokens, in local order."""
        if self.layout in PLACED:  # the placement (checked by its own tests)
            return placed_layout_of(self.layout, bounds, world).indices[rank]
        if self.packed_stream:
            return oracle.varlen_indices(self.layout, bounds, rank, world)
        if self.family == "hybrid":
            U, R = HYBRID_SPLIT[world]
            return oracle.hybrid_indices(self.layout, seq_len, rank // U, R, rank % U, U)
        return oracle.dense_indices(self.layout, rank, world, seq_len)

    def visible(self, seq_len: int, bounds, causal: bool, window: tuple[int, int]) -> Tensor:
        if self.packed_stream:
            return oracle.visible_varlen(bounds, causal, window)
        return oracle.visible_dense(seq_len, causal, window)

    def call(
        self,
        ctx: Ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kw: dict,
        view: Callable[[Tensor], Tensor],
        tokens: Tokens,
        dout: Tensor | None = None,
        create_graph: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Run this door on this rank's tensors; ``(out [B, S, H, D], lse [B, H, S] | None)``.
        With ``dout`` (``[B, S, H, D]``) also run the backward of ``(out * dout).sum()``
        (inside the door's scope, where it has one), with ``create_graph``."""
        from tests.engine_spy import forced_algorithm

        unknown = set(kw) - self.accepts
        assert not unknown, f"suite bug: {self.name} cannot pass {sorted(unknown)}"
        caller = _CALLERS[self.family]
        with forced_algorithm(self.force or None):
            if self.family in ("sdpa_scope", "cp"):
                return caller(self, ctx, q, k, v, dict(kw), view, tokens, dout, create_graph)
            out, lse = caller(self, ctx, q, k, v, dict(kw), view, tokens)
            if dout is not None:
                backward(out, dout, view, create_graph)
        return out, lse


def backward(
    out: Tensor, dout: Tensor, view: Callable[[Tensor], Tensor], create_graph: bool = False
) -> None:
    """Backward of ``(out * dout).sum()``: ``dout`` flows into ``out`` (in ``view``'s layout)."""
    (out * view(dout)).sum().backward(create_graph=create_graph)


def _split_result(result) -> tuple[Tensor, Tensor | None]:
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, None


def _packed_args(door: Door, q: Tensor, k: Tensor, v: Tensor, view) -> list[Tensor]:
    """The tensor arguments of a flash-style door: (q, k, v), (q, kv) or (qkv,), viewed."""
    if door.packing == "kv":
        args = [q, torch.stack([k, v], dim=-3)]
    elif door.packing == "qkv":
        args = [torch.stack([q, k, v], dim=-3)]
    else:
        args = [q, k, v]
    return [view(t) for t in args]


def _func(door: Door):
    import dtensor_ring as dr

    suffix = f"_{door.packing}packed_func" if door.packing else "_func"
    return getattr(dr, _PREFIX[(door.family, door.layout)] + suffix)


def _call_flash(door, ctx, q, k, v, kw, view, tokens):
    kw.setdefault("group", ctx.group)
    if door.family == "ring_fn":
        from dtensor_ring.api.functional import ring_attention_func

        return _split_result(ring_attention_func(door.layout, view(q), view(k), view(v), **kw))
    if door.family == "ulysses":
        kw["layout"] = door.layout
    return _split_result(_func(door)(*_packed_args(door, q, k, v, view), **kw))


def _call_varlen(door, ctx, q, k, v, kw, view, tokens):
    kw.setdefault("group", ctx.group)
    args = _packed_args(door, q[0], k[0], v[0], view)
    layout = door.layout
    if layout in PLACED:
        layout = placed_layout_of(layout, tokens.bounds, ctx.world)
        local = torch.tensor(layout.local_bounds[ctx.rank], dtype=torch.int32)
        cu = kw.pop("cu_seqlens", local)
    else:
        cu = kw.pop("cu_seqlens", oracle.local_cu_seqlens(tokens.bounds, ctx.world))
    max_seqlen = kw.pop("max_seqlen", None)
    if door.algorithm:
        kw.setdefault("algorithm", door.algorithm)
    if door.generic_varlen:
        from dtensor_ring.api.varlen import ring_varlen_attention_func

        result = ring_varlen_attention_func(layout, *args, cu, max_seqlen, **kw)
    else:
        result = _func(door)(*args, cu, max_seqlen, **kw)
    out, lse = _split_result(result)
    return out.unsqueeze(0), None if lse is None else lse.unsqueeze(0)


#: the doors' placed layouts: ``dr.document_layout``'s balance, and the documents as head-tail
#: shards of the packed row hold them (``dr.documents_as_sharded``)
PLACED = ("documents", "documents_head_tail")


def placed_layout_of(name: str, bounds: list[int], world: int):
    """The placed layout ``name`` of the stream's documents (every rank builds the same)."""
    import dtensor_ring as dr

    if name == "documents":
        return dr.document_layout(bounds, world)
    return dr.documents_as_sharded(bounds, "zigzag", world)


def _call_llama3(door, ctx, q, k, v, kw, view, tokens):
    import dtensor_ring as dr

    kw.setdefault("group", ctx.group)
    args = _packed_args(door, q[0], k[0], v[0], view)
    causal = kw.get("causal") is True
    cu = torch.tensor(tokens.bounds, dtype=torch.int32)
    meta = dict(
        zip(
            ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice"),
            dr.llama3_flash_attn_prepare_cu_seqlens(cu, causal, ctx.rank, ctx.world),
            strict=True,
        )
    )
    meta["heads_k_stride"] = k.shape[-2]
    meta.update({name: kw.pop(name) for name in list(kw) if name in meta})
    out, lse = _split_result(
        _func(door)(
            *args,
            meta["cu_seqlens_q"],
            meta["cu_seqlens_k"],
            meta["max_seqlen_q"],
            meta["max_seqlen_k"],
            meta["heads_k_stride"],
            meta["local_k_slice"],
            **kw,
        )
    )
    return out.unsqueeze(0), None if lse is None else lse.unsqueeze(0)


def hybrid_groups(world: int) -> tuple[Any, Any]:
    """This rank's (Ulysses group, ring group) of :data:`HYBRID_SPLIT` (rank g: Ulysses rank
    ``g % U``, ring rank ``g // U``). Collective: every rank creates every group."""
    U, R = HYBRID_SPLIT[world]
    rank = dist.get_rank()
    mine = {}
    for r in range(R):
        ranks = [r * U + u for u in range(U)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ulysses_group"] = group
    for u in range(U):
        ranks = [r * U + u for r in range(R)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ring_group"] = group
    return mine["ulysses_group"], mine["ring_group"]


def _call_hybrid(door, ctx, q, k, v, kw, view, tokens):
    import dtensor_ring as dr

    ulysses_group, ring_group = hybrid_groups(ctx.world)
    kw.setdefault("ulysses_group", ulysses_group)
    kw.setdefault("ring_group", ring_group)
    return _split_result(
        dr.hybrid_flash_attn_func(view(q), view(k), view(v), layout=door.layout, **kw)
    )


def cpu_mesh(world: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(world)))


def _sdpa_inputs(door, ctx, q, k, v, kw, view):
    """DTensors ``[B, H, S, D]`` placed Shard(2) on a 1-D mesh, and SDPA's keyword arguments."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = cpu_mesh(ctx.world)
    q, k, v = (DTensor.from_local(view(t).transpose(1, 2), mesh, [Shard(2)]) for t in (q, k, v))
    sdpa_kw = {"enable_gqa": q.shape[1] != k.shape[1]}
    for ours, theirs in (("causal", "is_causal"), ("softmax_scale", "scale")):
        if ours in kw:
            sdpa_kw[theirs] = kw.pop(ours)
    for name in ("dropout_p", "attn_mask", "enable_gqa"):
        if name in kw:
            sdpa_kw[name] = kw.pop(name)
    return q, k, v, sdpa_kw


def _call_sdpa_fn(door, ctx, q, k, v, kw, view, tokens):
    import dtensor_ring as dr

    q, k, v, sdpa_kw = _sdpa_inputs(door, ctx, q, k, v, kw, view)
    out = dr.scaled_dot_product_ring_attention(
        q, k, v, layout=door.layout, mode=door.mode, **sdpa_kw, **kw
    )
    return out.to_local().transpose(1, 2), None


def _call_sdpa_scope(door, ctx, q, k, v, kw, view, tokens, dout=None, create_graph=False):
    """SDPA inside ``ring_sdpa``, forward and (with ``dout``) backward in the scope."""
    import dtensor_ring as dr

    q, k, v, sdpa_kw = _sdpa_inputs(door, ctx, q, k, v, kw, view)
    with dr.ring_sdpa(layout=door.layout, mode=door.mode, **kw):
        out = F.scaled_dot_product_attention(q, k, v, **sdpa_kw).to_local().transpose(1, 2)
        if dout is not None:
            backward(out, dout, view, create_graph)
    return out, None


def _call_cp(door, ctx, q, k, v, kw, view, tokens, dout=None, create_graph=False):
    """``F.scaled_dot_product_attention`` on plain ``[B, H, S_local, D]`` shards inside
    ``context_parallel(mesh)`` (no buffers), forward and (with ``dout``) backward inside."""
    import dtensor_ring as dr

    sdpa_kw = {"enable_gqa": q.shape[-2] != k.shape[-2]}
    for ours, theirs in (("causal", "is_causal"), ("softmax_scale", "scale")):
        if ours in kw:
            sdpa_kw[theirs] = kw.pop(ours)
    sdpa_kw.update(kw)
    layout = None if door.mode == "default" else door.layout
    if door.module:
        style = dr.ContextParallel(seq_dim=2, layout=layout)
        attention = parallelize_module(_SDPAModule(), cpu_mesh(ctx.world), style)
        args = (view(t).transpose(1, 2) for t in (q, k, v))
        out = attention(*args, **sdpa_kw).transpose(1, 2)
        if dout is not None:
            backward(out, dout, view, create_graph)
        return out, None
    with dr.context_parallel(cpu_mesh(ctx.world), layout=layout):
        args = (view(t).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(*args, **sdpa_kw).transpose(1, 2)
        if dout is not None:
            backward(out, dout, view, create_graph)
    return out, None


class _SDPAModule(torch.nn.Module):
    """PyTorch's tests' attention module: its forward is ``F.scaled_dot_product_attention``."""

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return F.scaled_dot_product_attention(*args, **kwargs)


class _AttentionModule(torch.nn.Module):
    """Stands for a transformers attention layer (only ``is_causal`` is read)."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def hf_positions(door: Door, idx: Tensor, bounds: list[int] | None) -> Tensor:
    """position_ids of this rank's tokens: global positions, or within-document positions."""
    return oracle.doc_positions(idx, bounds) if door.packed_stream else idx


def _call_hf(door, ctx, q, k, v, kw, view, tokens):
    import dtensor_ring.hf as drhf

    drhf.setup(
        group=kw.pop("group", ctx.group), layout=door.layout, backend=kw.pop("backend", None)
    )
    causal = kw.pop("causal", True)
    extra = dict(kw.pop("hf_kwargs", {}))
    left, right = kw.pop("window_size", (-1, -1))
    if left >= 0:
        assert right == 0, "suite bug: transformers windows are (left, 0)"
        extra["sliding_window"] = left + 1
    positions = hf_positions(door, tokens.idx, tokens.bounds)
    extra.setdefault("position_ids", positions.expand(max(q.shape[0], 1), -1))
    if door.packed_stream:
        extra.setdefault("cu_seq_lens_q", torch.tensor(tokens.bounds, dtype=torch.int32))
        extra.setdefault("cu_seq_lens_k", torch.tensor(tokens.bounds, dtype=torch.int32))
    out, _ = drhf.ring_attention_forward(
        _AttentionModule(causal),
        *(view(t).transpose(1, 2) for t in (q, k, v)),
        extra.pop("attention_mask", None),
        scaling=kw.pop("softmax_scale", None),
        dropout=kw.pop("dropout_p", 0.0),
        **extra,
    )
    assert not kw, kw
    return out, None


_CALLERS = {
    "flash": _call_flash,
    "ring_fn": _call_flash,
    "ulysses": _call_flash,
    "varlen": _call_varlen,
    "llama3": _call_llama3,
    "hybrid": _call_hybrid,
    "sdpa_fn": _call_sdpa_fn,
    "sdpa_scope": _call_sdpa_scope,
    "hf": _call_hf,
    "hf_packed": _call_hf,
    "cp": _call_cp,
}


def _all_doors() -> dict[str, Door]:
    doors = []
    for family, layouts in (
        ("flash", ("ring", "zigzag", "stripe")),
        ("varlen", ("ring", "zigzag")),
        ("llama3", ("llama3",)),
    ):
        for layout in layouts:
            for packing in ("", "kv", "qkv"):
                name = f"{_PREFIX[family, layout]}_{packing + 'packed_' if packing else ''}func"
                doors.append(Door(name, family, layout, packing))
    for layout in ("ring", "zigzag", "stripe"):
        doors.append(Door(f"ulysses_flash_attn_func[{layout}]", "ulysses", layout))
    for packing in ("kv", "qkv"):
        doors.append(Door(f"ulysses_flash_attn_{packing}packed_func", "ulysses", "ring", packing))
    for layout in ("zigzag", "ring", "stripe"):
        doors.append(Door(f"hybrid_flash_attn_func[{layout}]", "hybrid", layout))
    for mode in ("ring", "ulysses"):
        for layout in ("ring", "zigzag", "stripe"):
            doors.append(
                Door(
                    f"scaled_dot_product_ring_attention[{layout},{mode}]",
                    "sdpa_fn",
                    layout,
                    "",
                    mode,
                )
            )
            doors.append(Door(f"ring_sdpa+F.sdpa[{layout},{mode}]", "sdpa_scope", layout, "", mode))
    for layout in ("zigzag", "ring", "stripe"):
        doors.append(Door(f"hf.ring_attention_forward[{layout}]", "hf", layout))
    for layout in ("zigzag", "ring", "llama3"):
        doors.append(Door(f"hf.ring_attention_forward[packed,{layout}]", "hf_packed", layout))
    return {d.name: d for d in doors}


DOORS: dict[str, Door] = _all_doors()


def _new_doors() -> dict[str, Door]:
    """The doors of the front doors added later, each tested by a kind of its own (cases.py):
    the "llama3_zigzag" layout through every door that takes a layout, and
    ``F.scaled_dot_product_attention`` inside ``context_parallel``."""
    doors = [
        Door("llama3_zigzag_flash_attn_func", "flash", "llama3_zigzag"),
        Door("llama3_zigzag_flash_attn_varlen_func", "varlen", "llama3_zigzag"),
        Door("ring_attention_func[llama3_zigzag]", "ring_fn", "llama3_zigzag"),
        Door("ulysses_flash_attn_func[llama3_zigzag]", "ulysses", "llama3_zigzag"),
        Door("scaled_dot_product_ring_attention[llama3_zigzag,ring]", "sdpa_fn", "llama3_zigzag"),
        Door("ring_sdpa+F.sdpa[llama3_zigzag,ring]", "sdpa_scope", "llama3_zigzag"),
        Door("hf.ring_attention_forward[llama3_zigzag]", "hf", "llama3_zigzag"),
        Door("hf.ring_attention_forward[packed,llama3_zigzag]", "hf_packed", "llama3_zigzag"),
        # PyTorch's default layout: zigzag, or ring when S % 2W != 0 (dense_indices falls back)
        Door("context_parallel+F.sdpa[default]", "cp", "zigzag", "", "default"),
        Door("context_parallel+F.sdpa[stripe]", "cp", "stripe", "", "explicit"),
        Door("context_parallel+F.sdpa[llama3_zigzag]", "cp", "llama3_zigzag", "", "explicit"),
        # the module-level form: parallelize_module(attn, mesh, ContextParallel(layout=...))
        Door("ContextParallel+F.sdpa[default]", "cp", "zigzag", "", "default", module=True),
        Door("ContextParallel+F.sdpa[stripe]", "cp", "stripe", "", "explicit", module=True),
        Door(
            "ContextParallel+F.sdpa[llama3_zigzag]",
            "cp",
            "llama3_zigzag",
            "",
            "explicit",
            module=True,
        ),
    ]
    return {d.name: d for d in doors}


NEW_DOORS: dict[str, Door] = _new_doors()


def _auto_doors() -> dict[str, Door]:
    """The doors of ``layout="auto"`` (zigzag's tokens; ring, all-gather or Ulysses chosen
    per call): those that choose (``ring_attention_func``, ``ring_varlen_attention_func``,
    transformers, ``context_parallel``, SDPA on DTensors), ``[auto:<algorithm>]`` with the
    choice forced (on the tiny shapes of the cases the cost model picks the all-gather on 2+
    ranks, the ring on one), and the one that must reject the layout (Ulysses)."""
    doors = [
        Door("ring_attention_func[auto]", "ring_fn", "auto"),
        Door("ring_attention_func[auto:ring]", "ring_fn", "auto", force="ring"),
        Door("ring_attention_func[auto:ulysses]", "ring_fn", "auto", force="ulysses"),
        Door("ring_varlen_attention_func[auto]", "varlen", "auto"),
        Door("ring_varlen_attention_func[auto:ring]", "varlen", "auto", force="ring"),
        Door("hf.ring_attention_forward[auto]", "hf", "auto"),
        Door("hf.ring_attention_forward[packed,auto]", "hf_packed", "auto"),
        Door("context_parallel+F.sdpa[auto]", "cp", "auto", "", "explicit"),
        Door("scaled_dot_product_ring_attention[auto,ring]", "sdpa_fn", "auto"),
        Door("ring_sdpa+F.sdpa[auto,ring]", "sdpa_scope", "auto"),
        # the door whose algorithm is fixed: a clean ValueError on every rank
        Door("ulysses_flash_attn_func[auto]", "ulysses", "auto"),
    ]
    return {d.name: d for d in doors}


AUTO_DOORS: dict[str, Door] = _auto_doors()
#: ``ring_varlen_attention_func`` on ``dr.document_layout``'s placement of the documents
DOCUMENTS_DOOR = Door("ring_varlen_attention_func[documents]", "varlen", "documents")
#: ... by the all-gather of the keys each rank's queries see (Note [Gathering what placed
#: documents need])
DOCUMENTS_GATHER_DOOR = Door(
    "ring_varlen_attention_func[documents,all_gather]", "varlen", "documents",
    algorithm="all_gather",
)  # fmt: skip
#: transformers' attention function on packed rows under ``layout="documents"``
HF_DOCUMENTS_DOOR = Door("hf.ring_attention_forward[packed,documents]", "hf_packed", "documents")
#: ... on ``dr.documents_as_sharded``: the documents as head-tail shards of the row hold them
HEAD_TAIL_DOOR = Door(
    "ring_varlen_attention_func[documents_as_sharded]", "varlen", "documents_head_tail"
)
ALL_DOORS: dict[str, Door] = {
    **DOORS,
    **NEW_DOORS,
    **AUTO_DOORS,
    DOCUMENTS_DOOR.name: DOCUMENTS_DOOR,
    DOCUMENTS_GATHER_DOOR.name: DOCUMENTS_GATHER_DOOR,
}


# --- the doors of the recompute kind ------------------------------------------------------------

#: the doors that serve attention for a scope (``context_parallel``, ``ring_sdpa``) and the
#: transformers attention function (no scope), as the ``recompute`` kind runs them: models
#: whose attention is checkpointed, the backward inside the scope or after it
RECOMPUTE_DOORS: dict[str, Door] = {
    name: ALL_DOORS[name]
    for name in (
        "context_parallel+F.sdpa[default]",
        "context_parallel+F.sdpa[stripe]",
        "context_parallel+F.sdpa[llama3_zigzag]",
        "context_parallel+F.sdpa[auto]",
        "ring_sdpa+F.sdpa[ring,ring]",
        "ring_sdpa+F.sdpa[zigzag,ring]",
        "ring_sdpa+F.sdpa[llama3_zigzag,ring]",
        "ring_sdpa+F.sdpa[auto,ring]",
        "ring_sdpa+F.sdpa[zigzag,ulysses]",
        "hf.ring_attention_forward[zigzag]",
        "hf.ring_attention_forward[llama3_zigzag]",
        "hf.ring_attention_forward[auto]",
    )
}


def scope_attention(door: Door, ctx: Ctx, scale: float):
    """The causal attention a model calls inside ``door``'s scope: plain local ``q [B, H,
    S_local, D]``, ``k, v [B, H_kv, S_local, D]`` -> out, through
    ``F.scaled_dot_product_attention`` (SDPA on DTensors: the shards wrapped ``Shard(2)``)."""

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    if door.family == "cp":
        return sdpa
    from torch.distributed.tensor import DTensor, Shard

    mesh = cpu_mesh(ctx.world)

    def on_dtensors(q, k, v):
        q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        return sdpa(q, k, v).to_local()

    return on_dtensors


def open_scope(door: Door, ctx: Ctx, buffers: list[Tensor], layout: str | None = None):
    """``door``'s scope (``layout`` instead of its own if given): ``context_parallel`` sharding
    ``buffers`` (``[B, S]`` each) in place and leaving them sharded, or ``ring_sdpa`` (the
    buffers already hold this rank's tokens: :func:`dense_indices`)."""
    import dtensor_ring as dr

    if door.family == "cp":
        own = None if door.mode == "default" else door.layout
        return dr.context_parallel(
            cpu_mesh(ctx.world),
            buffers=buffers,
            buffer_seq_dims=[1] * len(buffers),
            no_restore_buffers=set(buffers),
            layout=layout or own,
        )
    return dr.ring_sdpa(layout=layout or door.layout, mode=door.mode)
