"""Names that moved: still reachable at their old place, with a DeprecationWarning naming the new one.

A module whose names moved keeps a ``MOVED`` table {name: new module} and one line,
``def __getattr__(name): return compat.moved(__name__, name, MOVED)``; Python calls it only for
names the module no longer has."""

from __future__ import annotations

import importlib
import warnings


def moved(module: str, name: str, table: dict[str, str]):
    """``name`` from its new module (``table[name]``), with a DeprecationWarning; AttributeError for a
    name that never moved."""
    if name not in table:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {table[name]}.{name}", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(table[name]), name)
