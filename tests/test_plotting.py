"""save_figure writes deterministic PDF and PNG bytes with embedded TrueType fonts."""

import subprocess
import sys

import matplotlib
import matplotlib.pyplot as plt
import pytest

from qlab import plotting

SCRIPT = """
import os, sys
import numpy as np
from qlab import plotting
plotting.use_paper_style()
fig, ax = plotting.subplots()
x = np.linspace(0, 1, 50)
ax.plot(x, x ** 2, label="x²"); ax.plot(x, np.sqrt(x), label="√x")
ax.set_xlabel("κ"); ax.set_ylabel("relative error"); ax.legend(); ax.set_title("determinism")
plotting.save_figure(fig, "probe")
"""


def _render(directory, hash_seed):
    env = {
        "QLAB_RESULTS_DIR": str(directory),
        "PYTHONHASHSEED": hash_seed,
        "MPLBACKEND": "Agg",
        "PATH": "/usr/bin:/bin",
    }
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True)
    return {ext: (directory / "figures" / f"probe.{ext}").read_bytes() for ext in ("pdf", "png")}


def test_same_figure_twice_gives_identical_bytes(tmp_path):
    # two separate processes with different hash seeds: nothing random or time-dependent may leak in
    first, second = _render(tmp_path / "a", "1"), _render(tmp_path / "b", "2")
    assert first["pdf"] == second["pdf"]
    assert first["png"] == second["png"]


def test_pdf_embeds_truetype_fonts_and_no_timestamp(tmp_path):
    pdf = _render(tmp_path, "0")["pdf"]
    assert b"/FontFile2" in pdf  # an embedded TrueType font program
    assert b"/Subtype /Type3" not in pdf
    assert b"/CreationDate" not in pdf


def test_paper_style_sizes_and_palette():
    with matplotlib.rc_context():
        plotting.use_paper_style()
        assert matplotlib.rcParams["pdf.fonttype"] == 42
        assert tuple(matplotlib.rcParams["figure.figsize"]) == (plotting.COLUMN_WIDTH, 2.3)
        # Okabe & Ito (2008) colour-blind-safe palette, in order
        cycle = [c.upper().lstrip("#") for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]]
        assert cycle[:3] == ["0072B2", "D55E00", "009E73"]


def test_subplots_width_and_bad_input():
    fig, _ = plotting.subplots(1, 2, width="text", aspect=0.5)
    assert fig.get_size_inches()[0] == pytest.approx(plotting.TEXT_WIDTH)
    assert fig.get_size_inches()[1] == pytest.approx(plotting.TEXT_WIDTH * 0.25)
    plt.close(fig)
    with pytest.raises(ValueError, match="width"):
        plotting.subplots(width="page")
    with pytest.raises(TypeError, match="Figure"):
        plotting.save_figure("not a figure", "x")
    fig = plt.figure()
    with pytest.raises(ValueError, match="figure name"):
        plotting.save_figure(fig, "../escape")
    plt.close(fig)
