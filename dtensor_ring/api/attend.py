"""The one dispatch of every front door that takes ``layout=`` / ``algorithm=``: route the
call (Note [Layouts and algorithms] in ``algorithm.py``), resolve it for the chosen algorithm,
run that algorithm's op. Dense and packed (varlen) calls; nothing here climbs back to a door.

    dense_attention / varlen_attention
        route()          -> Route(algorithm, layout, heads_k_stride)
        resolve_call()   -> AttentionSpec (every argument checked on every rank)
        ring             dtensor_ring::ring_attention / ring_attention_varlen
        all_gather       dtensor_ring::llama3_attention (dense rows folded: one document each)
        ulysses          the all-to-alls around dtensor_ring::ulysses_local_attention
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from .._compat import resolve_group
from ..algorithm import DENSE_ALGORITHMS, VARLEN_ALGORITHMS, route
from ..consistency import comparing, relay_errors
from ..layouts import Layout, get_layout
from ..layouts.varlen import (
    check_placed_local,
    check_token_positions,
    host_values,
    placed_locals_disagree,
    read_cu_seqlens,
)
from ..ops.common import call_attention
from ..ops.ring import ring_attention
from ..ops.varlen import llama3_attention, ring_attention_varlen
from ..resolve import (
    Call,
    Door,
    check_cu_seqlens_arg,
    check_heads_k_stride,
    check_qkv_tensors,
    group_arg,
    max_seqlen_value,
    resolve_call,
)
from .ulysses import ulysses_run


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layout: str,
    algorithm: str | None,
    causal: bool,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    dropout_p: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    sinks: Tensor | None = None,
    heads_k_stride: int = 1,
    allowed: tuple[str, ...] = DENSE_ALGORITHMS,
    return_lse: bool = True,
    backward: bool = True,
    order_free: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of local ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` ->
    ``(out [B, S_local, H, D], lse [B, H, S_local])`` by the routed algorithm (``allowed``:
    the door's; ``backward``/``order_free``: :func:`~dtensor_ring.algorithm.route`'s). lse is
    None when not ``return_lse`` and the algorithm would spend communication on it."""
    name, world_size = group_arg(group)
    call = Call(
        q, k, v, name, world_size, layout, causal, softmax_scale, window_size, dropout_p,
        alibi_slopes, deterministic, backend, sinks,
    )  # fmt: skip
    r = route(
        call,
        algorithm,
        door="ring_attention",
        allowed=allowed,
        backward=backward,
        order_free=order_free,
        heads_k_stride=heads_k_stride,
    )
    if r.layout != layout:
        call = call.replace(layout=r.layout)
    if r.algorithm == "all_gather":
        with relay_errors((name,), "llama3_attention"):  # one rank's error: every rank's
            check_qkv_tensors(q, k, v)
            B, S, H, D = q.shape
            get_layout(r.layout, "dense").check_local_length(S, world_size)
        rows = call.replace(q=rows_as_documents(q), k=rows_as_documents(k), v=rows_as_documents(v))
        out, lse = _gather(rows, rows_cu_seqlens(B, S), S, r.heads_k_stride)
        return out.view(B, S, H, D), rows_lse(lse, B, S).contiguous() if return_lse else None
    if r.algorithm == "ulysses":
        door = Door("ulysses", "ulysses", head_split=world_size, lse=return_lse)
        spec = resolve_call(call, door)
        return ulysses_run(q, k, v, spec, sinks, group, return_lse)
    spec = resolve_call(call, Door("ring_attention"))
    return call_attention(ring_attention, q, k, v, *spec.op_args(), sinks)


# ``varlen_attention``'s all-gather stride when the door takes none: 1 KV head a step, every
# KV head for placed documents (they fetch only the keys their queries see)
_DOOR_STRIDE = object()


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    *,
    layout: str,
    algorithm: str | None,
    causal: bool,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    dropout_p: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    sinks: Tensor | None = None,
    heads_k_stride: object = _DOOR_STRIDE,
    allowed: tuple[str, ...] = VARLEN_ALGORITHMS,
    order_free: bool = False,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of packed documents in a per-document layout: local ``q [T_local, H, D]``,
    ``k, v [T_local, H_kv, D]``, ``cu_seqlens`` the local boundaries (global ``// W``) ->
    ``(out [T_local, H, D], lse [H, T_local])`` by the routed algorithm (ring or all-gather;
    ``heads_k_stride``: the all-gather's, by default 1, placed documents every KV head).
    ``positions``: the local tokens' indices in the packed sequence, checked against the
    layout's (:func:`~dtensor_ring.layouts.varlen.check_token_positions`)."""
    name, world_size = group_arg(group)
    call = Call(
        q, k, v, name, world_size, layout, causal, softmax_scale, window_size, dropout_p,
        alibi_slopes, deterministic, backend, sinks,
    )  # fmt: skip
    r = route(
        call,
        algorithm,
        door="ring_attention_varlen",
        varlen=True,
        allowed=allowed,
        order_free=order_free,
        heads_k_stride=heads_k_stride,
    )
    call = call.replace(layout=r.layout)
    if r.algorithm == "all_gather":
        stride = r.heads_k_stride
        if stride is _DOOR_STRIDE:  # placed documents fetch few keys: every KV head at once
            placed = get_layout(r.layout, "documents").varlen == "placed"
            stride = k.shape[1] if placed and isinstance(k, Tensor) and k.dim() == 3 else 1
        return _gather(call, cu_seqlens, max_seqlen, stride, positions)

    lay = get_layout(r.layout, "documents")

    def checks() -> tuple[int | None]:
        check_cu_seqlens_arg(cu_seqlens, q)
        _check_positions(positions, call, cu_seqlens)
        _check_placed_local(lay, call, cu_seqlens)
        return (max_seqlen_value(max_seqlen, "max_seqlen"),)

    door = Door(
        "ring_attention_varlen",
        form="documents",
        ring_func="ring_flash_attn_varlen_func",
        checks=checks,
        **_documents_metadata(lay, cu_seqlens, max_seqlen),
    )
    spec = resolve_call(call, door)
    return call_attention(
        ring_attention_varlen, q, k, v, cu_seqlens, *spec.door, *spec.op_args(), sinks
    )


def _gather(
    call: Call,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    heads_k_stride: int,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """All-gather attention (Note [Balanced all-gather attention]) of the packed documents of
    ``call`` (``q [T_local, H, D]``, ``k, v [T_local, H_kv, D]``) in a per-document layout ->
    ``(out [T_local, H, D], lse [H, T_local])``."""
    q, k, v = call.q, call.k, call.v
    lay = get_layout(call.layout, "documents")

    def checks() -> tuple[int | None]:
        check_heads_k_stride(heads_k_stride, k.shape[1])
        check_cu_seqlens_arg(cu_seqlens, q)
        _check_positions(positions, call, cu_seqlens)
        _check_placed_local(lay, call, cu_seqlens)
        return (max_seqlen_value(max_seqlen, "max_seqlen"),)

    door = Door(
        "llama3_attention",
        "all_gather",
        form="documents",
        checks=checks,
        **_documents_metadata(lay, cu_seqlens, max_seqlen, heads_k_stride=heads_k_stride),
    )
    spec = resolve_call(call, door)
    (max_seqlen,) = spec.door
    return call_attention(
        llama3_attention,
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        heads_k_stride,
        0,
        0,
        *spec.op_args(),
        call.sinks,
    )


def _check_placed_local(lay: Layout, call: Call, cu_seqlens: Tensor) -> None:
    """Placed documents' local boundaries differ by rank, so the consistency mode compares
    the layout's instead (:func:`_documents_metadata`): this rank's are checked here too, in
    that mode (the op checks them again)."""
    if lay.varlen == "placed" and comparing((call.group_name,)):
        group = resolve_group(call.group_name)
        bounds = read_cu_seqlens(cu_seqlens, call.q.shape[0])
        check_placed_local(lay, bounds, dist.get_rank(group), call.world_size)


def _documents_metadata(
    lay: Layout, cu_seqlens: Tensor, max_seqlen: int | None, **more: object
) -> dict:
    """A varlen door's ``metadata`` (what every rank compares in the consistency mode) and,
    for placed documents, its rank-local values and their check."""
    if lay.varlen != "placed":
        return dict(
            metadata=lambda: {
                "cu_seqlens": host_values(cu_seqlens), "max_seqlen": max_seqlen, **more
            }
        )  # fmt: skip
    return dict(
        metadata=lambda: {"cu_seqlens": lay.bounds, "max_seqlen": None, **more},
        local=lambda: host_values(cu_seqlens),
        check_locals=functools.partial(placed_locals_disagree, lay),
    )


def _check_positions(positions: Tensor | None, call: Call, cu_seqlens: Tensor) -> None:
    """A varlen door told its tokens' positions checks them against its layout's."""
    if positions is None:
        return
    rank = dist.get_rank(resolve_group(call.group_name)) if call.world_size > 1 else 0
    layout = getattr(call.layout, "name", call.layout)
    check_token_positions(positions, layout, host_values(cu_seqlens), rank, call.world_size)


def rows_as_documents(t: Tensor) -> Tensor:
    """A dense ``[B, S_local, H, D]`` as the packed ``[B * S_local, H, D]`` of B documents,
    one a row (a view where possible): the form the all-gather's varlen op takes."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def rows_cu_seqlens(batch: int, seq_local: int) -> Tensor:
    """The local ``cu_seqlens`` (int32 ``[B + 1]``, CPU) of :func:`rows_as_documents`."""
    return torch.arange(0, (batch + 1) * seq_local, seq_local, dtype=torch.int32)


def rows_lse(lse_HT: Tensor, batch: int, seq_local: int) -> Tensor:
    """The packed lse ``[H, B * S_local]`` of :func:`rows_as_documents` back as the dense
    ``[B, H, S_local]`` (a view)."""
    return lse_HT.view(lse_HT.shape[0], batch, seq_local).transpose(0, 1)
