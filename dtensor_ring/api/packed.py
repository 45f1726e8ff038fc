"""The kv-packed and qkv-packed forms of a front door, generated from it (its signature with
``k, v`` replaced by ``kv`` / ``q, k, v`` by ``qkv``): ring-flash-attention's ``*_kvpacked_func``
/ ``*_qkvpacked_func`` and Ulysses'."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from ..resolve import unpack

Result = Tensor | tuple[Tensor, Tensor, None]  # out, or (out, lse, None)


def packed_form(base: Callable, n: int, varlen: bool) -> Callable:
    """``base``'s kv-packed (``n`` = 2: ``q, kv``) or qkv-packed (``n`` = 3: ``qkv``) form;
    the packed tensor is unpacked into views (:func:`~dtensor_ring.resolve.unpack`)."""
    params = list(inspect.signature(base).parameters.values())
    group_pos = [p.name for p in params].index("group") - 3  # among the arguments after q, k, v
    lead = "T_local" if varlen else "B, S_local"

    def group_of(args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
        return kwargs.get("group", args[group_pos] if len(args) > group_pos else None)

    if n == 2:

        def fn(q: Tensor, kv: Tensor, *args, **kwargs) -> Result:
            k, v = unpack("kv", kv, 2, group_of(args, kwargs), varlen=varlen)
            return base(q, k, v, *args, **kwargs)

        first = [params[0], params[1].replace(name="kv")]
        shapes = f"q ``[{lead}, H, D]``, kv ``[{lead}, 2, H_kv, D]``"
    else:

        def fn(qkv: Tensor, *args, **kwargs) -> Result:
            q, k, v = unpack("qkv", qkv, 3, group_of(args, kwargs), varlen=varlen)
            return base(q, k, v, *args, **kwargs)

        first = [params[0].replace(name="qkv")]
        shapes = f"qkv ``[{lead}, 3, H, D]``"
    fn.__signature__ = inspect.Signature(first + params[3:])
    name = base.__name__.replace("_func", "_kvpacked_func" if n == 2 else "_qkvpacked_func")
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = base.__module__
    fn.__doc__ = f":func:`{base.__name__}` with {shapes} (its other arguments as there)."
    return fn


def named(fn: Callable, name: str, doc: str, module: str) -> Callable:
    """``fn`` under ``name`` in ``module`` (whose docstring describes the arguments)."""
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = f"{doc} (Arguments: :mod:`{module}`.)"
    return fn
