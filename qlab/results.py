"""Writing a notebook's results: tidy CSVs and the scalar metrics a sweep collects.

CSV bytes are deterministic for the same DataFrame (fixed float format, no index, '\n' endings).
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pandas as pd

from qlab import checks, paths


class SavedPath(type(Path())):
    """The path a result was written to. As a notebook cell's last value it shows one line,
    "saved data/<name>.csv", instead of a PosixPath repr; otherwise it is a plain Path."""

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(f"saved {paths.shown(self)}")


def save_csv(df: pd.DataFrame, name: str) -> Path:
    """Write ``df`` to ``data/<name>.csv``; return the path.

    Only the float columns are formatted: 10 significant digits, -0.0 written as 0 (pandas calls the
    two equal, so equal frames give equal bytes). A float inside an object or categorical column (a
    column mixing numbers and text) is written as Python's repr, all its digits. The index is not
    written: call ``df.reset_index()`` first to keep a named index (the groups of a
    ``groupby(...).mean()``) as columns.
    """
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {checks.shown(df)}")
    paths.result_name("name", name, "file stem")
    return SavedPath(write_csv(df, paths.data_dir() / f"{name}.csv"))


def write_csv(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write ``df`` to ``path`` in save_csv's format, atomically (a crash leaves the old file whole)."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {checks.shown(df)}")
    path = paths.writable_file("path", path, "CSV file")
    with paths.written_atomically(path) as tmp:
        _signed_zeros_cleared(df).to_csv(tmp, index=False, float_format="%.10g", lineterminator="\n")
    return path


def _signed_zeros_cleared(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with -0.0 made 0.0 in its float columns (x + 0.0 does it and changes no other value);
    ``df`` itself is left as it is. Columns are addressed by position: names may repeat."""
    floats = [i for i, dtype in enumerate(df.dtypes) if dtype.kind == "f"]
    if not floats:
        return df
    cleared = df.copy(deep=False)
    for i in floats:
        cleared.isetitem(i, df.iloc[:, i] + 0.0)
    return cleared


def read_csv(path: str | os.PathLike, columns=(), *, name: str = "path", what: str = "CSV file", **options):
    """``pd.read_csv(path, **options)`` of a file that must exist, parse as CSV and hold ``columns``;
    a missing file, a folder, garbage or missing columns are refused with errors that name ``name``."""
    if isinstance(columns, str) or not isinstance(columns, (list, tuple)):
        raise TypeError(f"columns must be a list of column names, got {checks.shown(columns)}")
    if not all(isinstance(column, str) for column in columns):
        raise TypeError(f"columns must hold column names (str), got {checks.shown(columns)}")
    path = paths.existing_file(name, path, what)
    try:
        frame = pd.read_csv(path, **options)
    except (ValueError, csv.Error) as err:  # pandas' parser and empty-data errors, undecodable bytes
        detail = " ".join(str(err).split())[:200]
        raise ValueError(f"{name} {paths.shown(path)} is not a readable {what}: {detail}") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{name} {paths.shown(path)} is not a {what}: it lacks the columns {missing}")
    return frame


def save_metrics(name: str, **metrics) -> Path:
    """Write scalar ``metrics`` to ``data/<name>.json`` (sorted keys); ``qlab sweep`` collects them.

    Values must be JSON scalars (numbers, strings, booleans, None); numpy/torch scalars are
    converted with ``.item()``. Non-finite floats are written as null.
    """
    paths.result_name("name", name, "file stem")
    clean = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            size = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)  # torch / numpy
            if size != 1:
                kind = type(value).__name__
                raise TypeError(f"metric {key!r} must be a scalar, got {size} values ({kind})")
            value = value.item()
        if not isinstance(value, (int, float, str, bool, type(None))):
            raise TypeError(f"metric {key!r} must be a scalar, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        clean[key] = value
    path = paths.data_dir() / f"{name}.json"
    with paths.written_atomically(path) as tmp:
        tmp.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    return SavedPath(path)


def markdown_table(df: pd.DataFrame, float_format: str = "{:.4g}") -> str:
    """``df`` as a GitHub-flavoured markdown table (header, then one row per row; the index is not
    written; floats through ``float_format``, a format with one replacement field such as "{:.3g}";
    ``|`` in cells escaped, line breaks made spaces), for a notebook's ``IPython.display.Markdown`` or
    the README."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {checks.shown(df)}")
    if not isinstance(float_format, str) or "{" not in float_format:
        raise TypeError(
            f"float_format must be a format string like '{{:.4g}}', got {checks.shown(float_format)}"
        )
    _check_float_format(float_format)

    def cell(value) -> str:
        text = float_format.format(value) if isinstance(value, float) else str(value)
        for ending in ("\r\n", "\r", "\n"):  # CommonMark's line endings: each would end the row
            text = text.replace(ending, " ")
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _check_float_format(float_format: str) -> None:
    """``float_format`` must format a float, and two different floats differently (a format of
    literal text only, such as "{{:.3f}}", would print the same text in every cell)."""
    expected = "a format with one replacement field for the float, such as '{:.4g}'"
    try:
        shown = [float_format.format(value) for value in (1.5, 3.5)]
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"float_format must be {expected}, got {float_format!r} ({type(error).__name__}: {error})"
        ) from None
    if shown[0] == shown[1]:
        raise ValueError(
            f"float_format must be {expected}, got {float_format!r}: it writes {shown[0]!r} for any float"
        )
