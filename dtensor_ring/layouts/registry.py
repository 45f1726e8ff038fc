"""The registry of layouts: names -> :class:`~dtensor_ring.layouts.base.Layout` objects."""

from __future__ import annotations

import copy
from typing import Literal

from .base import Layout
from .builtin import BUILTIN_ALIASES, BUILTIN_LAYOUTS

LayoutName = Literal["ring", "zigzag", "stripe", "llama3_zigzag", "auto"]
# the built-in dense layouts
LAYOUTS: tuple[str, ...] = ("ring", "zigzag", "stripe", "llama3_zigzag")
# the built-in varlen layouts
VARLEN_LAYOUTS: tuple[str, ...] = ("ring", "zigzag", "llama3", "llama3_zigzag")

_REGISTRY: dict[str, Layout] = {}
_VERSION = [0]  # moves with every registration and removal (Note [Remembered resolutions])
# alias name -> (registered layout name, algorithm): Note [Layouts and algorithms]
_ALIASES: dict[str, tuple[str, str]] = dict(BUILTIN_ALIASES)
_ALIAS_LAYOUTS: dict[str, Layout] = {}  # alias name -> its layout's copy under that name

Form = Literal["any", "dense", "varlen", "documents"]
_FORM_WORDS = {
    "any": "layout",
    "dense": "sequence layout",
    "varlen": "varlen layout",
    "documents": "varlen layout with per-document shards",
}


def register_layout(layout: Layout) -> Layout:
    """Make ``layout`` available under ``layout.name`` to every front door; returns it.

    Raises ``ValueError`` if the name is taken by another layout.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"register_layout needs a Layout instance, got {type(layout).__name__}")
    known = _REGISTRY.get(layout.name)
    if layout.name in _ALIASES:
        raise ValueError(f"{layout.name!r} is a built-in alias of a layout and an algorithm")
    if known is not None and known is not layout:
        raise ValueError(f"a layout named {layout.name!r} is already registered ({known!r})")
    _REGISTRY[layout.name] = layout
    _VERSION[0] += 1
    return layout


def unregister_layout(name: str) -> None:
    """Remove a layout registered with :func:`register_layout` (built-ins stay)."""
    if name in (b.name for b in BUILTIN_LAYOUTS):
        raise ValueError(f"the built-in layout {name!r} cannot be unregistered")
    _REGISTRY.pop(name, None)
    _VERSION[0] += 1


def registry_version() -> int:
    """A number that changes whenever a layout is registered or removed."""
    return _VERSION[0]


def registered_name(layout: object) -> bool:
    """Whether ``layout`` is the name of a registered layout or an alias (not an object, not a
    passed layout's name)."""
    return isinstance(layout, str) and (layout in _REGISTRY or layout in _ALIASES)


def _has_form(layout: Layout, form: Form) -> bool:
    if form == "dense":
        return layout.dense
    if form == "varlen":
        return layout.varlen is not None
    if form == "documents":
        return layout.varlen in ("documents", "placed")
    return True


def layout_names(form: Form = "any") -> tuple[str, ...]:
    """Names accepted as ``layout=`` whose layout has ``form`` ("dense", "varlen",
    "documents"): the registered layouts, then the aliases."""
    names = (*_REGISTRY, *_ALIASES)
    return tuple(name for name in names if _has_form(find_layout(name), form))


def find_layout(name: object) -> Layout | None:
    """The layout registered as ``name``, or None (any object: no error). An alias gives a copy
    of the layout it places tokens with, under the alias's name (so messages name what the
    caller passed)."""
    if not isinstance(name, str):
        return None
    return _ALIAS_LAYOUTS.get(name) or _REGISTRY.get(name) or _PASSED.get(name)


def home_layout(layout: Layout) -> str:
    """The registered layout name whose tokens ``layout`` places (an alias's target)."""
    alias = _ALIASES.get(layout.name)
    return layout.name if alias is None else alias[0]


def alias_algorithm(layout: object) -> str | None:
    """The algorithm an alias name ("llama3_zigzag", "auto") stands for, None for any other
    value (Note [Layouts and algorithms] in ``dtensor_ring/algorithm.py``)."""
    alias = _ALIASES.get(layout) if isinstance(layout, str) else None
    return None if alias is None else alias[1]


def get_layout(layout: str | Layout, form: Form = "any") -> Layout:
    """The registered layout called ``layout`` (a :class:`Layout` is returned as is; an alias
    gives the layout that places its tokens).

    Raises:
        TypeError: ``layout`` is neither a string nor a Layout.
        ValueError: no registered layout of that name has ``form``; the message lists those
            that do.
    """
    if isinstance(layout, Layout):
        found = layout
        _remember(layout)
    elif isinstance(layout, str):
        found = find_layout(layout)
    else:
        raise TypeError(f"layout must be a layout name (str), got {type(layout).__name__}")
    if found is None or not _has_form(found, form):
        raise ValueError(
            f"layout={layout!r} is not a {_FORM_WORDS[form]}; choose one of {layout_names(form)}"
        )
    return found


# Layout objects passed to a door without being registered (a TokenLayout of a balancer's
# permutation or of the mask-aware balance, a user's own): the custom ops carry layouts by
# name, so the last _PASSED_SIZE such names resolve to their objects.
_PASSED: dict[str, Layout] = {}
_PASSED_SIZE = 256


def _remember(layout: Layout) -> None:
    if _REGISTRY.get(layout.name) is layout or _ALIAS_LAYOUTS.get(layout.name) is layout:
        return
    if layout.name in _REGISTRY or layout.name in _ALIASES:
        raise ValueError(
            f"a layout object named {layout.name!r} is not the registered layout of that name"
        )
    known = _PASSED.pop(layout.name, None)
    if known is not None and known is not layout and known != layout:
        raise ValueError(f"two different layout objects are named {layout.name!r}")
    _PASSED[layout.name] = layout  # most recent last
    if len(_PASSED) > _PASSED_SIZE:
        _PASSED.pop(next(iter(_PASSED)))


for _layout in BUILTIN_LAYOUTS:
    register_layout(_layout)
for _name, (_target, _) in _ALIASES.items():
    _ALIAS_LAYOUTS[_name] = copy.copy(_REGISTRY[_target])
    _ALIAS_LAYOUTS[_name].name = _name


def order_layout(layout: str, causal: bool, window: tuple[int, int]) -> str:
    """The layout whose token order a call with this mask depends on: ``layout``, or, for
    attention over every key (no causal mask, no window), "ring", the identity order. Such
    attention does not depend on the order in which the ranks hold the tokens (as long as each
    rank's queries and keys share one order), so the contiguous plan serves shards in any
    layout, and the Ulysses all-to-alls need not reorder them."""
    return layout if causal or tuple(window) != (-1, -1) else "ring"
