"""Paper-ready figures: one style, one way to save.

``use_paper_style()`` applies ``qlab/styles/paper.mplstyle`` (column-width sizes, embedded
TrueType fonts, Okabe-Ito palette). ``save_figure(fig, name)`` writes ``figures/<name>.pdf`` and
``figures/<name>.png`` with deterministic bytes: no timestamps, no software/version strings, so
the same figure saved twice (or by a rerun on the same machine) is byte-identical.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from qlab import paths

STYLE_PATH = Path(__file__).resolve().parent / "styles" / "paper.mplstyle"
COLUMN_WIDTH = 3.3  # inches, one column of a two-column paper
TEXT_WIDTH = 6.9  # inches, full text width
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]

_PDF_METADATA = {"Creator": None, "Producer": None, "CreationDate": None, "ModDate": None}
_PNG_METADATA = {"Software": None}


def use_paper_style() -> None:
    """Apply the qlab paper style to matplotlib's global rcParams (seaborn reads them too)."""
    plt.style.use(STYLE_PATH)


def subplots(nrows: int = 1, ncols: int = 1, *, width: str | float = "column", aspect: float = 0.7, **kwargs):
    """``plt.subplots`` sized for a paper: width "column", "text" or inches;
    height = width·aspect·nrows/ncols."""
    if isinstance(width, str):
        widths = {"column": COLUMN_WIDTH, "text": TEXT_WIDTH}
        if width not in widths:
            raise ValueError(f"width must be 'column', 'text' or a number of inches, got {width!r}")
        width = widths[width]
    height = width * aspect * nrows / ncols
    return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


def save_figure(fig: matplotlib.figure.Figure, name: str) -> tuple[Path, Path]:
    """Write ``figures/<name>.pdf`` and ``figures/<name>.png`` (300 dpi); return both paths.

    Bytes are deterministic: the PDF carries no creation date or producer string, the PNG no
    software tag.
    """
    if not isinstance(fig, matplotlib.figure.Figure):
        raise TypeError(f"expected a matplotlib Figure, got {type(fig).__name__}")
    if not isinstance(name, str) or not name or "/" in name or "\\" in name:
        raise ValueError(f"expected a plain figure name like '02_topic_what', got {name!r}")
    out = paths.figures_dir()
    pdf, png = out / f"{name}.pdf", out / f"{name}.png"
    fig.savefig(pdf, format="pdf", metadata=_PDF_METADATA)
    fig.savefig(png, format="png", metadata=_PNG_METADATA)
    return pdf, png
