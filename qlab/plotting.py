"""Paper-ready figures: one style, one way to save.

``use_paper_style()`` applies ``qlab/styles/paper.mplstyle`` (column-width sizes, embedded
TrueType fonts, Okabe-Ito palette). ``save_figure(fig, name)`` writes ``figures/<name>.pdf`` and
``figures/<name>.png`` with deterministic bytes: no timestamps, no software/version strings, so
the same figure saved twice (or by a rerun on the same machine) is byte-identical.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from qlab import checks, paths

STYLE_PATH = Path(__file__).resolve().parent / "styles" / "paper.mplstyle"
COLUMN_WIDTH = 3.3  # inches, one column of a two-column paper
TEXT_WIDTH = 6.9  # inches, full text width
MAX_PANELS = 100  # rows or columns of one figure's grid of axes
_SAVE_DPI = 300  # the resolution of a saved PNG (and of anything a PDF rasterizes)
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]

_PDF_METADATA = {"Creator": None, "Producer": None, "CreationDate": None, "ModDate": None}
_PNG_METADATA = {"Software": None}


def use_paper_style() -> None:
    """Apply the qlab paper style to matplotlib's global rcParams (seaborn reads them too)."""
    plt.style.use(STYLE_PATH)


def subplots(nrows: int = 1, ncols: int = 1, *, width: str | float = "column", aspect: float = 0.7, **kwargs):
    """``plt.subplots`` sized for a paper: width "column", "text" or inches;
    height = width·aspect·nrows/ncols."""
    checks.integer("nrows", nrows, low=1, high=MAX_PANELS)
    checks.integer("ncols", ncols, low=1, high=MAX_PANELS)
    checks.number("aspect", aspect, low=0, open_low=True)
    if isinstance(width, str):
        widths = {"column": COLUMN_WIDTH, "text": TEXT_WIDTH}
        if width not in widths:
            raise ValueError(f"width must be 'column', 'text' or a number of inches, got {width!r}")
        width = widths[width]
    else:
        width = checks.number("width", width, low=0, open_low=True)
    height = width * aspect * nrows / ncols
    if not math.isfinite(height):
        raise ValueError(f"width × aspect must be a finite height, got width={width!r}, aspect={aspect!r}")
    return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


class SavedFigure(NamedTuple):
    """Where ``save_figure`` wrote a figure. A notebook cell ending in ``save_figure(...)`` shows one
    line saying where (its ``_repr_pretty_``), beside the figure itself, not a tuple of paths."""

    pdf: Path
    png: Path

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(f"saved {paths.shown(self.pdf)} and .png")


def save_figure(fig: matplotlib.figure.Figure, name: str) -> SavedFigure:
    """Write ``figures/<name>.pdf`` and ``figures/<name>.png`` at 300 dpi (whatever matplotlib's
    ``savefig.dpi`` says; the paper style sets the same); return both paths.

    Bytes are deterministic: the PDF carries no creation date or producer string, the PNG no
    software tag.
    """
    if not isinstance(fig, matplotlib.figure.Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {checks.shown(fig)}")
    paths.result_name("name", name, "figure name")
    out = paths.figures_dir()
    pdf, png = out / f"{name}.pdf", out / f"{name}.png"
    with paths.written_atomically(pdf) as pdf_tmp, paths.written_atomically(png) as png_tmp:
        fig.savefig(pdf_tmp, format="pdf", metadata=_PDF_METADATA, dpi=_SAVE_DPI)
        fig.savefig(png_tmp, format="png", metadata=_PNG_METADATA, dpi=_SAVE_DPI)
    return SavedFigure(pdf, png)


def _check_axes(ax) -> None:
    if not isinstance(ax, matplotlib.axes.Axes):
        raise TypeError(f"ax must be a matplotlib Axes, got {checks.shown(ax)}")


def _check_columns(frame, **columns) -> None:
    """Each argument of ``columns`` names one column of ``frame``, which has rows to draw; y's holds
    numbers."""
    for name, column in columns.items():
        if not isinstance(column, str):
            raise TypeError(f"{name} must be a column name (str), got {checks.shown(column)}")
    checks.frame_columns("frame", frame, columns)
    if frame.empty:
        raise ValueError("frame has no rows to draw")
    try:
        np.asarray(frame[columns["y"]], dtype=float)
    except (TypeError, ValueError):
        y = columns["y"]
        raise ValueError(f"y must name a column of numbers, got {y!r} ({frame[y].dtype})") from None


def mean_band(
    ax, frame, x: str, y: str, *, by: str | None = None, method: str = "t", log: bool = False, **line_kwargs
):
    """Draw on ``ax`` the mean of ``y`` over the rows that share an ``x`` (the seeds) as a line, and its
    95 % interval (``qlab.stats.mean_interval`` by ``method``) as a band of the line's colour: one line
    per value of ``by`` (labelled with it), or one line. Returns the summary: x, [by], n, mean, low, high
    (a single seed leaves no band: NaN bounds).

    ``log=True`` is for positive quantities that span decades (an error, a norm): the mean and interval
    are those of log10(y), drawn as 10^… on a log axis — the geometric mean and a multiplicative band
    that never reaches zero, as a band of the plain mean would. The summary stays in y's units."""
    from qlab import stats

    _check_axes(ax)
    checks.boolean("log", log)
    _check_columns(frame, x=x, y=y, **({} if by is None else {"by": by}))
    keys = [x] if by is None else [by, x]
    if log:
        if not (frame[y] > 0).all():
            raise ValueError(f"log=True needs positive {y!r} values; got {frame[y].min()!r}")
        frame = frame.assign(**{y: np.log10(frame[y].to_numpy(dtype=float))})
        ax.set_yscale("log")
    summary = stats.summarize(frame, y, keys, method).sort_values(keys, kind="stable")
    if log:
        summary[["mean", "low", "high"]] = 10.0 ** summary[["mean", "low", "high"]]
    groups = [(None, summary)] if by is None else list(summary.groupby(by, sort=False))
    for name, group in groups:
        kwargs = dict(line_kwargs)
        if name is not None:
            kwargs.setdefault("label", str(name))
        (line,) = ax.plot(group[x], group["mean"], **kwargs)
        ax.fill_between(
            group[x], group["low"], group["high"], color=line.get_color(), alpha=0.25, linewidth=0
        )
    return summary.reset_index(drop=True)


def delta_band(
    ax, frame, x: str, y: str, *, baseline: str, by: str, pair: str = "seed", method: str = "t", **line_kwargs
):
    """Draw on ``ax`` the difference in ``y`` from the ``baseline`` run of the same ``pair`` (seed) at
    the same ``x``, as ``mean_band`` lines with bands per value of ``by``, and a dashed zero line: where
    a band leaves zero the difference is resolved over the seeds. Returns the summary of the differences."""
    from qlab import stats

    _check_axes(ax)
    _check_columns(frame, x=x, y=y, by=by, pair=pair)
    differences = stats.paired_differences(frame, y, baseline=baseline, by=by, pair=[pair, x])
    ax.axhline(0.0, color="0.3", linewidth=0.8, linestyle="--")
    return mean_band(ax, differences, x, "difference", by=by, method=method, **line_kwargs)
