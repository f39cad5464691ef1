"""The registry of pruning methods (name -> function), below every method module: `methods`
registers the built-in ones, and the re-pruning methods look up "magnitude" here when they run.
How a method is called: `methods`' module docstring."""
from __future__ import annotations

from typing import Callable, Dict, List

from sparsecnn.prune.magnitude import Masks

PruneMethod = Callable[..., Masks]
_METHODS: Dict[str, PruneMethod] = {}


def register_method(name: str, fn: PruneMethod, *, replace: bool = False) -> PruneMethod:
    """Make `fn` available as method `name`; re-registering a name needs `replace=True`."""
    if not name or not isinstance(name, str):
        raise ValueError(f"method name must be a non-empty string, got {name!r}")
    if name in _METHODS and not replace:
        raise ValueError(f"pruning method {name!r} is already registered")
    _METHODS[name] = fn
    return fn


def method_names() -> List[str]:
    """Registered method names, in registration order."""
    return list(_METHODS)


def get_method(name: str) -> PruneMethod:
    if name not in _METHODS:
        raise ValueError(f"unknown pruning method {name!r}; expected one of {', '.join(_METHODS)}")
    return _METHODS[name]
