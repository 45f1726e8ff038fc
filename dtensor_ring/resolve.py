"""Call resolution: every front door's arguments checked and normalised once, into a spec.

Note [Call resolution]
~~~~~~~~~~~~~~~~~~~~~~
Every front door (flash-style functions, varlen, llama3, Ulysses, hybrid, SDPA on DTensors, the
transformers attention function) hands its arguments to :func:`resolve_call`, the one owner
of validation and normalisation:

    front door  --(q, k, v, layout, causal, softmax_scale, window_size, group, backend, ...)-->
    resolve_call: checks every argument on this rank, before any communication; normalises
                  window/causal (flash-attn semantics) and the softmax scale; picks the kernel
        |
        v
    AttentionSpec(layout, causal, window, scale, backend, group_name, world_size)
        |  spec.op_args(): the trailing arguments of every ``dtensor_ring::`` attention op
        v
    op: trusts its spec; checks only what it alone can see when it runs (the *values* of
        ``cu_seqlens`` / llama3 metadata, read on the host: also under torch.compile)

Every rank runs the same checks on its own local inputs, so bad input raises the same
``ValueError`` on every rank instead of hanging a collective. (Inputs that differ *between*
ranks cannot be seen without communicating; SPMD code gives every rank the same shapes.)

Under ``torch.compile`` resolution runs at trace time: the spec's fields are constants of the
graph, and the kernel choice is a Dynamo constant (:func:`select_backend`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._compat import group_name as _group_name
from ._compat import refuse_simulated_ranks
from .consistency import PerRankCheck, check_consistent, comparing, relay_errors
from .kernels import selected_backend
from .kernels.base import is_small
from .layouts import Form, Layout, alias_algorithm, get_layout
from .layouts.varlen import check_cu_seqlens_device, check_cu_seqlens_tensor
from .resolved import RESOLUTIONS, resolution_key
from .schedule.cost import kv_repeat

# the values of algorithm= (Note [Layouts and algorithms] in algorithm.py)
ALGORITHMS: tuple[str, ...] = ("ring", "all_gather", "ulysses", "auto")


class AttentionSpec(NamedTuple):
    """One resolved attention call; what the ``dtensor_ring::`` ops consume.

    ``causal`` and ``window`` are normalised (:func:`normalize_window`: ``window`` None when
    nothing is masked beyond ``causal``); ``scale`` the softmax scale; ``backend`` the block
    kernel's name; ``world_size`` the size of the group ``group_name``; ``door`` the door's own
    arguments as its :attr:`Door.checks` normalised them (``(max_seqlen,)``, ...): once.
    """

    layout: str
    causal: bool
    window: tuple[int, int] | None
    scale: float
    backend: str
    group_name: str
    world_size: int
    door: tuple = ()

    def op_args(self) -> tuple[str, str, bool, float, str, int, int]:
        """``(group_name, layout, causal, scale, backend, window_left, window_right)``: the
        trailing arguments of every attention op (window -1, -1: none)."""
        left, right = (-1, -1) if self.window is None else self.window
        return self.group_name, self.layout, self.causal, self.scale, self.backend, left, right


# --- single arguments ------------------------------------------------------------------------


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool; ``TypeError`` unless it is one (``"False"`` would mean True)."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_" and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_algorithm(algorithm: object, allowed: tuple[str, ...] = ALGORITHMS) -> str | None:
    """``algorithm`` if it is None or one of ``allowed``, else ``ValueError`` / ``TypeError``."""
    if algorithm is None:
        return None
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a str or None, got {type(algorithm).__name__}")
    if algorithm not in allowed:
        raise ValueError(
            f"algorithm={algorithm!r} cannot run this call; choose one of {allowed} (packed "
            "documents: 'ring' or 'all_gather')"
        )
    return algorithm


def placement(
    layout: str | Layout, algorithm: object, *, allowed: tuple[str, ...] = ALGORITHMS
) -> tuple[Layout, str]:
    """``(the layout that places the tokens, the algorithm)`` of ``layout=`` and ``algorithm=``
    (None: an alias's, else the door's first; Note [Layouts and algorithms]); ``allowed``: the
    door's algorithms (one: a fixed algorithm, which overrides an alias's). ``ValueError`` for
    a contradiction or an algorithm the door lacks."""
    implied = alias_algorithm(layout)
    algorithm = check_algorithm(algorithm)  # an explicit one overrides the alias's
    if implied == "auto" and algorithm is None and "auto" not in allowed:
        raise ValueError(
            f"layout={layout!r} asks for the algorithm to be chosen per call, but this call "
            f"runs algorithm={allowed[0]!r} (the doors that choose: "
            "ring_attention_func, ring_varlen_attention_func, SDPA on DTensors, "
            "dtensor_ring.hf, context_parallel); pass layout='zigzag' for zigzag-placed tokens"
        )
    if algorithm is None:
        algorithm = implied if implied in allowed else allowed[0]
    return get_layout(layout), check_algorithm(algorithm, allowed)


def check_softmax_scale(softmax_scale: object) -> float | None:
    """``softmax_scale`` as a float (None: the default ``D ** -0.5``).

    Any finite real number is valid (0 gives uniform attention, a negative scale flips the
    scores); ``TypeError`` for a non-number, ``ValueError`` for NaN or an infinity.
    """
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        if not (isinstance(softmax_scale, Tensor) and softmax_scale.numel() == 1):
            raise TypeError(
                f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
            )
    value = float(softmax_scale)
    if not math.isfinite(value):
        raise ValueError(f"softmax_scale={value} must be finite (or None for D ** -0.5)")
    return value


def check_backend_arg(backend: object) -> str | None:
    """``backend`` must be a backend name (str) or None."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {backend!r}")
    return backend


def group_arg(group: object, name: str = "group") -> tuple[str, int]:
    """``(group_name, world_size)`` of a process-group argument (None: the default group).

    Raises:
        TypeError: ``group`` is not a ``ProcessGroup`` (or None).
        ValueError: this rank is not a member of ``group`` (the ranks that are cannot see
            this: they will wait for it; check the group construction).
    """
    refuse_simulated_ranks()
    if group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0
    ):  # dist.new_group returns NON_GROUP_MEMBER on ranks outside the group
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of {name}; pass a "
            "process group this rank belongs to (every rank calls attention with its own group)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None (the default group), got "
            f"{type(group).__name__} {group!r}"
        )
    return _group_name(group), dist.get_world_size(group)


def check_unsupported(*, dropout_p: float, alibi_slopes: object) -> None:
    """Reject flash-attn arguments whose non-default values are not implemented."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p} is not supported by ring attention; pass dropout_p=0.0 "
            "(apply dropout outside attention if you need it)"
        )
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention; pass alibi_slopes=None")


def check_window_size(window_size: object) -> tuple[int, int]:
    """``window_size`` as a tuple of two ints >= -1 (flash-attn's ``(left, right)``)."""
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        raise ValueError(
            f"window_size={window_size!r} must be two ints (left, right), each >= 0, or -1 for "
            "unbounded (flash-attn semantics: query i sees keys [i - left, i + right])"
        )
    return int(window_size[0]), int(window_size[1])


def normalize_window(
    window_size: tuple[int, int], causal: bool, seq_len: int
) -> tuple[bool, tuple[int, int] | None]:
    """``(causal, window)`` for flash-attn style ``window_size`` on a ``seq_len``-token sequence.

    As flash-attn: ``causal`` sets ``right = 0``; a side >= ``seq_len - 1`` is unbounded (-1);
    ``(-1, 0)`` is plain causal attention. ``window`` is None when nothing is masked beyond
    ``causal``. Raises ``ValueError`` (:func:`check_window_size`) on a malformed window.
    """
    left, right = (-1 if w >= seq_len - 1 else w for w in check_window_size(window_size))
    if causal:
        right = 0
    if left == -1 and right == 0:
        return True, None
    if left == -1 and right == -1:
        return causal, None
    return causal, (left, right)


def default_scale(q: Tensor, softmax_scale: float | None) -> float:
    """The softmax scale: ``softmax_scale``, or ``D ** -0.5`` for None."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


_SEQ_DIMS_WORDS = {"B, S_local": "batch, local sequence length", "T_local": "packed length"}


def check_qkv_tensors(
    q: Tensor, k: Tensor, v: Tensor, *, seq_dims: str = "B, S_local", kv_cache: bool = False
) -> None:
    """Shape/dtype/device checks of ``q [*seq_dims, H, D]``, ``k``/``v [*seq_dims, H_kv, D]``.

    Args:
        seq_dims: the leading (token) dims: ``"B, S_local"`` for the dense API (4-D tensors),
            ``"T_local"`` for packed varlen tensors (3-D).
        kv_cache: k/v are a KV-cache shard ``[B, S_cache, H_kv, D]``: any length, 0 included,
            independent of q's.

    Raises:
        ValueError: naming the offending argument and how to fix it.
    """
    ndim = len(seq_dims.split(",")) + 2
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            raise ValueError(
                f"{name} must be {ndim}-D [{seq_dims}, H, D], got shape {tuple(t.shape)}"
            )
        sizes = [n for i, n in enumerate(t.shape) if not (kv_cache and name != "q" and i == 1)]
        if 0 in sizes:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dim must be >= 1")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (*lead_q, H, D), (*lead_kv, H_kv, D_kv) = q.shape, k.shape
    if kv_cache:  # only the batch must agree
        lead_q, lead_kv = lead_q[:1], lead_kv[:1]
    if (*lead_q, D) != (*lead_kv, D_kv):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on "
            f"{'batch' if kv_cache else _SEQ_DIMS_WORDS.get(seq_dims, seq_dims)} and head dim "
            f"([{seq_dims}, H, D] vs [{seq_dims}, H_kv, D])"
        )
    if H % H_kv != 0:
        raise ValueError(
            f"number of query heads H={H} must be a multiple of key/value heads H_kv={H_kv}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")


def check_sinks(sinks: object, q: Tensor) -> None:
    """``sinks`` must be None or the per-head sink logits ``[H]`` of ``q [..., H, D]``: a
    floating-point tensor on q's device (Note [Attention sinks]); raises TypeError/ValueError
    naming it."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a tensor [H] or None, got {type(sinks).__name__}")
    if isinstance(sinks, DTensor) and not isinstance(q, DTensor):
        raise TypeError(
            "sinks is a DTensor but q is a plain tensor: pass sinks.full_tensor() (the logits "
            "are replicated on every rank)"
        )
    H = q.shape[-2]
    if tuple(sinks.shape) != (H,):
        raise ValueError(
            f"sinks must be [H] = [{H}] (one logit per query head), got shape {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}: move sinks to q's device")


def unpack(
    name: str, packed: Tensor, n: int, group: object, *, varlen: bool = False
) -> tuple[Tensor, ...]:
    """The ``n`` views of a packed ``kv`` (n = 2) or ``qkv`` (n = 3): ``[B, S_local, n, H, D]``
    (``varlen``: ``[T_local, n, H, D]``); raises ``ValueError`` for another shape, on every
    rank of ``group`` in the consistency mode."""
    dim = 1 if varlen else 2
    lead = "T_local" if varlen else "B, S_local"
    heads = "H" if n == 3 else "H_kv"
    with relay_errors(lambda: group_arg(group)[0], "unpack"):
        if not isinstance(packed, Tensor) or packed.dim() != dim + 3 or packed.shape[dim] != n:
            shape = tuple(packed.shape) if isinstance(packed, Tensor) else type(packed).__name__
            raise ValueError(
                f"{name} must be [{lead}, {n}, {heads}, D] (packed), got shape {shape}"
            )
    return packed.unbind(dim)


def max_seqlen_value(value: object, name: str) -> int | None:
    """A ``max_seqlen`` argument as an int (None: not given)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value)  # a device tensor is read here (a sync): pass an int
    raise ValueError(f"{name} must be an int or None, got {value!r}")


def check_heads_k_stride(heads_k_stride: int, num_kv_heads: int) -> None:
    """``heads_k_stride`` must be a positive divisor of the number of KV heads (an int: a bool
    is rejected, as everywhere)."""
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"heads_k_stride must be an int, got {heads_k_stride!r}")
    if heads_k_stride < 1 or (num_kv_heads % heads_k_stride != 0):
        raise ValueError(
            f"heads_k_stride={heads_k_stride} must be a positive divisor of the number of "
            f"key/value heads H_kv={num_kv_heads} (K/V are all-gathered heads_k_stride heads "
            "at a time)"
        )


def local_k_slice_bounds(local_k_slice: object) -> tuple[int, int]:
    """``(start, stop)`` of llama3's ``local_k_slice`` (a ``slice`` of ints, step 1)."""
    s = local_k_slice
    if (
        not isinstance(s, slice)
        or s.step not in (None, 1)
        or not (isinstance(s.start, int) and isinstance(s.stop, int))
    ):
        raise ValueError(
            f"local_k_slice must be a slice(start, stop) of ints, as returned by "
            f"llama3_flash_attn_prepare_cu_seqlens, got {local_k_slice!r}"
        )
    return s.start, s.stop


def check_heads(num_heads: int, world_size: int, what: str) -> None:
    """``H % world_size == 0`` (query heads are what Ulysses shards), else ``ValueError``."""
    if num_heads % world_size != 0:
        raise ValueError(
            f"{what} shards the {num_heads} query heads over {world_size} ranks, which needs "
            f"H % {world_size} == 0; use a group size that divides H (or ring attention)"
        )


def check_cu_seqlens_arg(cu_seqlens: object, q: Tensor, name: str = "cu_seqlens") -> None:
    """Type/dtype/shape/device checks of a ``cu_seqlens`` argument (no host read: its values
    are checked by the op when it runs)."""
    check_cu_seqlens_tensor(cu_seqlens, name)
    check_cu_seqlens_device(cu_seqlens, q, name)


# --- kernel choice ------------------------------------------------------------------------


def select_backend(
    q: Tensor,
    k: Tensor,
    backend: str | None,
    *,
    varlen: bool = False,
    deterministic: bool = False,
    window: bool = False,
    head_split: int = 1,
) -> str:
    """Name of the block kernel for ``q [..., H, D]`` and ``k [..., H_kv, D]`` (see
    :func:`~dtensor_ring.kernels.select_kernel`); ``head_split``: the kernel sees ``H /
    head_split`` query heads and the K/V heads one rank gets after a head all-to-all over
    that many ranks (Ulysses).

    Under ``torch.compile`` the choice is made once at trace time and baked into the graph as
    a constant (``torch.compiler.assume_constant_result``): backends' availability probes
    (``torch.backends.cudnn.is_available()``, imports) are not traceable by Dynamo.
    """
    # operator.index, not int: under torch.compile with dynamic shapes it specialises a
    # symbolic size to the constant the choice needs (Dynamo guards on it); int() stays
    # symbolic and the constant-result call fails
    H, H_kv = operator.index(q.shape[-2]), operator.index(k.shape[-2])
    if head_split > 1:
        H, H_kv = H // head_split, H_kv * kv_repeat(H_kv, head_split) // head_split
    D = operator.index(q.shape[-1])
    # the sequence the kernel sees (Ulysses: every rank's). Compiled graphs keep the choice
    # for large calls: a length (symbolic with dynamic shapes) must not enter a constant
    small = not torch.compiler.is_compiling() and is_small(q.shape[-3] * head_split, H, D)
    return selected_backend(
        q.device.type,
        q.dtype,
        D,
        H,
        H_kv,
        bool(varlen),
        bool(deterministic),
        bool(window),
        small,
        backend,
    )


# --- the resolution -----------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One attention call as its front door received it: this rank's ``q [B, S_local, H, D]``,
    ``k, v [B, S_local, H_kv, D]`` (packed forms: ``[T_local, H(_kv), D]``), the process group
    it runs over (its name and size W), and flash-attn's arguments. Doors build it once and
    :meth:`replace` what an algorithm changes (the layout it runs, folded tensors)."""

    q: Tensor
    k: Tensor
    v: Tensor
    group_name: str
    world_size: int
    layout: str | Layout = "ring"
    causal: bool = False
    softmax_scale: float | None = None
    window_size: tuple[int, int] = (-1, -1)
    dropout_p: float = 0.0
    alibi_slopes: object = None
    deterministic: bool = False
    backend: str | None = None
    sinks: object = None

    def replace(self, **changes: object) -> Call:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Door:
    """What the front door (or algorithm) resolving a :class:`Call` adds to its checks.

    Attributes:
        op: its name (errors, the consistency mode's fingerprint).
        algorithm: the algorithm the call runs ("ring", "all_gather", "ulysses":
            :func:`dtensor_ring.algorithm.route`'s); a layout alias gives its tokens' layout,
            and "auto" raises (it is resolved by ``route``).
        form: what the door needs of the layout ("dense", "varlen", "documents") and of the
            tensors (packed for "varlen" / "documents").
        ring_func: the function a ring call's mask error suggests for non-causal attention.
        any_mask: the door computes a mask of its own (FlexAttention): the layout's mask
            support (``causal_only``) does not apply.
        layout_world, head_split: the layout's ring has ``layout_world`` ranks (default W;
            hybrid: the ring group) and the kernel sees the heads of a ``head_split``-way head
            all-to-all (Ulysses, hybrid).
        global_len: q, k, v are DTensors of ``global_len`` tokens (the scope-free DTensor
            function: their shards were checked by the caller) rather than local tensors.
        groups: further groups the call spans, compared after the call's (hybrid: Ulysses').
        checks: the door's own further checks (e.g. of ``cu_seqlens``), run after these, so
            that the consistency mode reports their errors on every rank too; what it returns
            (the door's arguments normalised, a tuple) becomes the spec's ``door``.
        lse: the call returns the lse, where that changes the communication (Ulysses' own
            all-to-all, FlexAttention's kernels): compared; None: it does not.
        metadata, local, check_locals: for comparing the ranks' calls (Note [Consistency
            mode]): the door's further fields every rank must agree on (e.g. ``cu_seqlens``
            values), and per-rank data with its cross-rank check (the mode's alone).
    """

    op: str
    algorithm: str = "ring"
    form: Form = "dense"
    ring_func: str = "ring_flash_attn_func"
    any_mask: bool = False
    layout_world: int | None = None
    head_split: int = 1
    global_len: int | None = None
    groups: tuple[str, ...] = ()
    checks: Callable[[], tuple] | None = None
    lse: bool | None = None
    metadata: Callable[[], Mapping[str, object]] | None = None
    local: Callable[[], object] | None = None
    check_locals: PerRankCheck | None = None


def resolve_call(call: Call, door: Door) -> AttentionSpec:
    """Check and normalise one attention ``call`` for ``door`` (Note [Call resolution]).

    Raises:
        ValueError / TypeError: naming the argument and how to fix it, on every rank, before
            any communication.
    """
    refuse_simulated_ranks()
    groups = (call.group_name, *door.groups)
    compare = comparing(groups)
    key = None if compare else resolution_key(call, door)  # Note [Remembered resolutions]
    spec = RESOLUTIONS.get(key)
    if spec is not None:
        return spec
    with relay_errors(groups, door.op):
        spec = _resolve(call, door)
        if door.checks is not None:
            spec = spec._replace(door=door.checks())
    RESOLUTIONS.put(key, spec)
    if compare:
        q, k, v, sinks = call.q, call.k, call.v, call.sinks
        fingerprint = {
            "op": door.op,
            # the group's own name is not compared: ranks that meet in its gather passed it,
            # and the hybrid's Ulysses gather joins ranks of different ring groups; the door's
            # own values may be per rank (its metadata() says what must agree)
            **{f: v for f, v in spec._asdict().items() if f not in ("group_name", "door")},
            "shapes": [tuple(t.shape) for t in (q, k, v)],
            "dtype": str(q.dtype),
            "device type": q.device.type,
            "sinks": _sinks_fingerprint(sinks),
            **({} if door.lse is None else {"lse returned": door.lse}),
            **(door.metadata() if door.metadata else {}),
        }
        check_consistent(
            groups, fingerprint, door.local() if door.local else None, door.check_locals
        )
    return spec


def _sinks_fingerprint(sinks: object) -> object:
    """What the ranks compare of ``sinks``: the values (a DTensor: its shape and placements,
    whose local values may differ by design)."""
    if sinks is None:
        return None
    if isinstance(sinks, DTensor):
        return (tuple(sinks.shape), tuple(map(str, sinks.placements)))
    return sinks.detach().double().cpu().tolist()


def _resolve(call: Call, door: Door) -> AttentionSpec:
    q, k, v = call.q, call.k, call.v
    layout, form, algorithm, world_size = call.layout, door.form, door.algorithm, call.world_size
    ring_func, layout_world, head_split = door.ring_func, door.layout_world, door.head_split
    check_unsupported(dropout_p=call.dropout_p, alibi_slopes=call.alibi_slopes)
    causal = check_bool("causal", call.causal)
    deterministic = check_bool("deterministic", call.deterministic)
    softmax_scale = check_softmax_scale(call.softmax_scale)
    backend = check_backend_arg(call.backend)
    lay = get_layout(layout, form)
    placement(layout, None, allowed=(algorithm,))  # "auto" where the algorithm is fixed: raise
    varlen = form in ("varlen", "documents")
    if algorithm == "ring" and not door.any_mask:
        lay.check_mask(causal, ring_func=ring_func)
    check_qkv_tensors(q, k, v, seq_dims="T_local" if varlen else "B, S_local")
    check_sinks(call.sinks, q)
    tokens = q.shape[0] if varlen else q.shape[1]
    if door.global_len is not None:
        tokens = door.global_len // world_size
    if head_split > 1:
        check_heads(
            q.shape[-2],
            head_split,
            "Ulysses attention" if layout_world is None else "hybrid attention (Ulysses dim)",
        )
    if not varlen:
        ring_world = world_size if layout_world is None else layout_world
        if algorithm == "ring":
            lay.check_local_length(tokens * (world_size // ring_world), ring_world)
        elif not lay.identity_order:
            lay.check_length(tokens * world_size, world_size)
    causal, window = normalize_window(call.window_size, causal, tokens * world_size)
    backend = select_backend(
        q,
        k,
        backend,
        varlen=varlen,
        deterministic=deterministic,
        window=window is not None,
        head_split=head_split,
    )
    scale = default_scale(q, softmax_scale)
    return AttentionSpec(lay.name, causal, window, scale, backend, call.group_name, world_size)
