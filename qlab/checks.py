"""Argument checks shared by every public entry point, so bad input gets one kind of answer.

Each check returns the value (normalised where that is unambiguous: a bare pattern string becomes a
one-element list) or raises: TypeError for a value of the wrong type, ValueError for a value of the
right type outside its range or closed list. Every message names the argument, says what was
expected and shows what came, e.g. ``lr must be a finite number > 0, got inf (float)``.

bool is never accepted where an int or a number is meant (``True`` is an int to Python, not to a
researcher), and a string is never accepted where a bool is meant (YAML's "no" is not False).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import numbers
import re
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # torch is imported where a check needs it: the CLI needs these checks, not torch
    import torch


def shown(value) -> str:
    """``value`` as messages show it: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool) in [low, high] (either end optional)."""
    expected = "an int" + _range_text(low, high)
    if not _is_int(value):
        raise TypeError(f"{name} must be {expected}, got {shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def _range_text(low, high, *, open_low=False, open_high=False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f" {'>' if open_low else '≥'} {low}"
    if high is not None:
        return f" {'<' if open_high else '≤'} {high}"
    return ""


def number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    open_high: bool = False,
    finite: bool = True,
) -> float:
    """A real number (int or float, not a bool, never NaN), finite unless ``finite=False``, in the
    interval from ``low`` to ``high`` (closed ends unless ``open_low``/``open_high``)."""
    expected = ("a finite number" if finite else "a number") + _range_text(
        low, high, open_low=open_low, open_high=open_high
    )
    if not _is_real(value):
        raise TypeError(f"{name} must be {expected}, got {shown(value)}")
    value = float(value)
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if math.isnan(value) or (finite and math.isinf(value)) or below or above:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def function(name: str, value, what: str = "a function"):
    """A callable (a function, a bound method, a module): what a hook or a callback argument takes."""
    if not callable(value):
        raise TypeError(f"{name} must be {what} (a callable), got {shown(value)}")
    return value


def boolean(name: str, value) -> bool:
    """A real bool (numpy's bool too); strings such as "no" and ints such as 0 are refused."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {shown(value)}")


class _YamlLoader(yaml.SafeLoader):
    """The safe loader with YAML 1.2's booleans (only true and false: True, TRUE, False, FALSE) that
    refuses a key given twice in one mapping, which PyYAML would resolve silently to the last value."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # a list or mapping as a key: PyYAML's own ConstructorError refuses it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (line {key_node.start_mark.line + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def yaml_value(text: str):
    """``text`` read as YAML the way qlab reads every file and ``-p`` value: the safe loader (no tag
    constructs an object) with YAML 1.2's booleans, so only true and false are bools and yes, no, on
    and off stay words, which a bool parameter refuses by name instead of reading "no" as False; a key
    given twice in one mapping is an error. Raises yaml.YAMLError for text that is not YAML."""
    return yaml.load(text, Loader=_YamlLoader)


def yaml_text(value) -> str:
    """``value`` as YAML writes it on one line (false, 1.0e-06, [nvfp4, mxfp8]): what ``yaml_value``
    reads back, and how a ``-p`` value is shown to the user who typed it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def given_once(pairs, option: str = "-p") -> dict:
    """``option NAME VALUE`` pairs as typed on a command line, as {name: value}; a name given twice is
    refused (argparse's list keeps both, and a dict would silently keep the last)."""
    given: dict = {}
    for name, value in pairs:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"{option} needs a parameter name without spaces around it, got {name!r}")
        if name in given:
            raise ValueError(f"{option} {name} given twice ({given[name]}, then {value}); give it once")
        given[name] = value
    return given


def choice(name: str, value, choices: Sequence):
    """One of ``choices`` (compared with ==, after a type check against the choices' types)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        listed = ", ".join(c if isinstance(c, str) else repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; expected one of: {listed}")
    return value


def generator(name: str, value, *, optional: bool = True) -> torch.Generator | None:
    """A ``torch.Generator`` (or None when ``optional``); a seed is not a generator."""
    import torch

    if value is None and optional:
        return None
    if not isinstance(value, torch.Generator):
        hint = f"; for a seed use torch.Generator().manual_seed({value!r})" if _is_int(value) else ""
        raise TypeError(
            f"{name} must be a torch.Generator{' or None' if optional else ''}, got {shown(value)}{hint}"
        )
    return value


def seed(name: str, value) -> int:
    """A seed: an int in [0, 2⁶³) (what ``torch.Generator.manual_seed`` takes without wrapping)."""
    return integer(name, value, low=0, high=2**63 - 1)


def tensor(
    name: str,
    value,
    *,
    floating: bool = False,
    real: bool = False,
    dtypes: Iterable[torch.dtype] | None = None,
) -> torch.Tensor:
    """A torch.Tensor; ``floating`` requires a real floating dtype, ``real`` any dtype but bool and
    complex, ``dtypes`` one of those dtypes."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {shown(value)}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without values); give a tensor on a real device")
    if real and (value.dtype == torch.bool or value.is_complex()):
        raise TypeError(f"{name} must hold real numbers (a floating or integer dtype), got {value.dtype}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if dtypes is not None and value.dtype not in tuple(dtypes):
        listed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {listed}, got {value.dtype}")
    return value


def same_device(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``value`` must be on ``other``'s device (a companion tensor: a scale, a weight, a gradient)."""
    if value.device != other.device:
        raise ValueError(
            f"{name} is on {value.device} but {other_name} is on {other.device}; put them on one device"
        )


def allocatable(name: str, shape: Sequence[int], element_size: int = 4) -> None:
    """Refuse, before allocating, a tensor of ``shape`` that no memory of this machine could hold (more
    bytes than its physical memory): torch would fail deep inside with an overflow or an allocator
    error that does not say which argument asked for it."""
    import os

    elements = 1
    for size in shape:
        elements *= max(int(size), 0)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 2**40
    if elements * element_size > memory:
        raise ValueError(
            f"{name} asks for a tensor of shape {tuple(shape)} ({elements * element_size / 2**30:.3g} GiB), "
            f"more than this machine's {memory / 2**30:.3g} GiB of memory"
        )


def token_ids_in_range(name: str, ids: torch.Tensor, vocab: int) -> None:
    """ValueError unless every id of ``ids`` lies in [0, ``vocab``). Read back on the CPU only: on a GPU it
    would synchronize the device every step (there the embedding's device-side assert reports a bad id),
    and while torch.compile traces it would break the graph."""
    import torch

    if ids.device.type != "cpu" or not ids.numel() or torch.compiler.is_compiling():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"{name} must lie in [0, {vocab}) (the vocabulary's ids), got ids from {low} to {high}"
        )


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of the floating tensor x is finite, read back from one min/max reduction:
    torch's min and max propagate NaN and reach ±inf, so they tell without the bool copy of x that
    ``torch.isfinite(x).all()`` writes (20× the time on a 2048×512 float32 activation). Syncs a GPU."""
    import torch

    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x.detach())
    return math.isfinite(low.item()) and math.isfinite(high.item())


def holds_nan(x: torch.Tensor) -> bool:
    """Whether the floating tensor x holds a NaN, read back from one max reduction (torch's max propagates
    NaN), without ``torch.isnan(x).any()``'s bool copy. Syncs a GPU."""
    return x.numel() > 0 and math.isnan(x.detach().amax().item())


def floating_dtype(name: str, value, *, optional: bool = True) -> torch.dtype | None:
    """A floating torch.dtype (or None when ``optional``)."""
    import torch

    if value is None and optional:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype such as torch.float32, got {shown(value)}")
    return value


def module(name: str, value) -> torch.nn.Module:
    import torch

    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {shown(value)}")
    return value


def matches(name: str, pattern: str) -> bool:
    """Whether the qualified module name ``name`` matches ``pattern``.

    A pattern is matched against the whole name with fnmatch: ``*`` matches any characters, dots
    included, so ``"model.layers.*"`` selects every layer *and* every module inside them, and
    ``"*.mlp.*"`` every module inside any ``mlp``. A pattern starting with ``re:`` is a regular
    expression matched against the whole name instead: ``"re:model\\.layers\\.\\d+"`` selects the
    layers themselves (direct children of ``model.layers``) and nothing inside them.
    """
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def patterns(name: str, value) -> list[str]:
    """Module-name patterns (see ``matches``): a bare string is one pattern (never split into
    characters), else a list or tuple of strings; None means none. ``re:`` patterns must compile."""
    if value is None:
        return []
    if isinstance(value, str):
        return patterns(name, [value])
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(p, str) for p in value):
        for pattern in value:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as err:
                    raise ValueError(
                        f"{name} pattern {pattern!r} is not a regular expression: {err}"
                    ) from None
        return list(value)
    raise TypeError(f"{name} must be a pattern string or a list of pattern strings, got {shown(value)}")


def batches(name: str, value) -> list:
    """A non-empty list or tuple of batches (whatever a loss_fn takes)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"{name} must be a non-empty list of batches, got {shown(value)}")
    return list(value)


def frame_columns(name: str, frame, columns: Sequence[str] | dict):
    """A pandas DataFrame holding every one of ``columns`` (each a str naming a column). Given as a
    dict {argument: column or list of columns}, a missing column's error names the argument it came
    from."""
    import pandas as pd

    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{name} must be a pandas DataFrame, got {shown(frame)}")
    if not isinstance(columns, dict):
        columns = {"column": list(columns)}
    for argument, chosen in columns.items():
        for column in [chosen] if isinstance(chosen, str) else chosen:
            if not isinstance(column, str) or column not in frame.columns:
                raise ValueError(
                    f"{argument} {column!r} is not a column of the {name} (columns: {list(frame.columns)})"
                )
    return frame


def names(name: str, value, allowed: Sequence[str]) -> tuple[str, ...]:
    """A subset of ``allowed``: a bare string is one name, else a list/tuple of names."""
    chosen = patterns(name, value)
    unknown = [n for n in chosen if n not in allowed]
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; expected some of: {', '.join(allowed)}")
    return tuple(chosen)


def closest(word: str, candidates: Iterable[str], count: int = 5) -> list[str]:
    """The candidates that look most like ``word`` (difflib), for 'did you mean' messages."""
    candidates = list(dict.fromkeys(candidates))
    found = difflib.get_close_matches(word, candidates, n=count, cutoff=0.4)
    return found or candidates[:count]


def patterns_match(name: str, chosen: Sequence[str], available: Sequence[str], what: str = "module") -> None:
    """Every pattern must match at least one of ``available`` names: a typo in a keep list would
    otherwise quietly quantize the layer it meant to keep."""
    for pattern in chosen:
        if not any(matches(candidate, pattern) for candidate in available):
            near = ", ".join(closest(pattern, available))
            raise ValueError(f"{name} pattern {pattern!r} matches no {what}; closest {what} names: {near}")
