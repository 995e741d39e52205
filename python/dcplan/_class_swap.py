"""One way to give a single module instance behaviour its class lacks: swap its class for a
subclass that adds attributes (a __getattr__ fallback, properties), made once per class and
purpose. The subclass keeps the class's name, module and qualname, so reprs, isinstance checks
and state-dict keys see the original."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from torch import nn

_subclasses: Dict[Tuple[type, str, Tuple[str, ...]], type] = {}


def swapped(module: nn.Module) -> Tuple[str, ...]:
    """The purposes module's class was swapped for (empty for an original class)."""
    return getattr(type(module), "_dcplan_swaps", ())


def swap_class(module: nn.Module, purpose: str, body: Callable[[type], Dict[str, Any]],
               key: Tuple[str, ...] = ()) -> None:
    """Makes module an instance of a subclass of its class with body(base)'s attributes, one
    subclass per (class, purpose, key)."""
    base = type(module)
    sub = _subclasses.get((base, purpose, key))
    if sub is None:
        attrs = dict(body(base))
        attrs.update({"__module__": base.__module__, "__qualname__": base.__qualname__,
                      "_dcplan_swaps": swapped(module) + (purpose,)})
        sub = type(base.__name__, (base,), attrs)
        _subclasses[(base, purpose, key)] = sub
    module.__class__ = sub
