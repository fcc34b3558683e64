"""Notebook conventions (DESIGN.md) and a smoke run of every notebook.

Conventions: notebooks/NN_topic.py (jupytext percent) is paired with NN_topic.ipynb, the two hold
the same cells, the .ipynb carries no outputs, the first code cell is tagged `parameters` with
typed, commented values including `smoke: bool = False`, and the kernel is `qlab`.
"""

import errno
import hashlib
import json
import os
import re
from pathlib import Path

import jupytext
import nbformat
import pandas as pd
import pytest
from run_helpers import smoke_outputs

from qlab import notebooks, paths

SOURCES = sorted(paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))
NOTEBOOKS = notebooks.list_notebooks()


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_topic.ipynb found"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_py_has_an_ipynb(source):
    assert source.with_suffix(".ipynb").exists(), f"{source.name} has no paired .ipynb: run `make sync`"


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_pair_in_sync_and_without_outputs(ipynb):
    source = ipynb.with_suffix(".py")
    assert source.exists(), f"{ipynb.name} has no paired .py"
    stored = nbformat.read(ipynb, as_version=4)
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{ipynb.name} carries outputs: run `make sync`"
            )
    from_py = jupytext.read(source)
    assert [(c.cell_type, c.source) for c in from_py.cells] == [
        (c.cell_type, c.source) for c in stored.cells
    ], f"{ipynb.name} and {source.name} differ: run `make sync`"
    assert stored.metadata["kernelspec"]["name"] == "qlab"
    assert "py:percent" in from_py.metadata["jupytext"]["formats"]


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_is_first_typed_and_commented(ipynb):
    code_cells = [c for c in nbformat.read(ipynb, as_version=4).cells if c.cell_type == "code"]
    assert "parameters" in code_cells[0].metadata.get("tags", []), (
        "the first code cell must be tagged parameters"
    )
    lines = [line for line in code_cells[0].source.splitlines() if line.strip()]
    assert "smoke: bool = False" in code_cells[0].source
    for line in lines:
        assert re.match(r"^\w+: [\w\[\], ]+ = .+  # .+", line), (
            f"parameter line not 'name: type = value  # comment': {line!r}"
        )
    declared = notebooks.notebook_parameters(ipynb)
    assert all(info["type"] for info in declared.values())
    assert "device" in declared and "smoke" in declared


@pytest.mark.notebook
@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_smoke_run_writes_its_csvs_and_figures_under_its_name(ipynb, smoke_run):
    first = smoke_outputs(ipynb, smoke_run(ipynb))
    stored = Path("data", "runs")  # qlab.campaign's store of each training run (03, 07)
    csvs = [p for p in first if p.suffix == ".csv" and not p.is_relative_to(stored)]
    assert csvs and all(str(p).startswith(f"data/{ipynb.stem}") for p in csvs)
    figures = {p.stem for p in first if p.parent.name == "figures"}
    assert figures, "the notebook saved no figure"
    for stem in figures:
        assert Path("figures", f"{stem}.pdf") in first and Path("figures", f"{stem}.png") in first


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_second_smoke_run_writes_the_same_bytes(ipynb, tmp_path, monkeypatch, smoke_run):
    monkeypatch.chdir(tmp_path)  # notebooks must not depend on the working directory
    # a notebook whose runs fan out (qlab.runs) ran them in 2 worker processes for the shared run and
    # runs them one after another here, each run on the same 1 thread: the bytes must not tell them apart
    fans_out = "executor" in notebooks.notebook_parameters(ipynb)
    first = smoke_outputs(ipynb, smoke_run(ipynb))
    # same parameters and seed on the same machine -> the same CSV and figure bytes, except outputs
    # named *_timing (wall-clock measurements, which no seed can fix); they must exist both times. The
    # rendered text (*_claims.md) is prose: it names the parameters that differ (the second run's
    # executor) and may state wall times; the claims it is filled from are compared as CSV. A stored
    # run's run.json holds its wall time; its CSVs are compared
    second = smoke_outputs(
        ipynb, tmp_path / "b", tmp_path, {"executor": "serial", "max_workers": 2} if fans_out else None
    )
    assert set(first) == set(second)
    differing = [
        str(p)
        for p in first
        if not p.stem.endswith("_timing")
        and p.suffix != ".md"
        and p.name != "run.json"
        and hashlib.sha256(first[p]).digest() != hashlib.sha256(second[p]).digest()
    ]
    assert not differing, f"outputs differ between two identical runs: {differing}\n" + "\n".join(
        _first_difference(p, first[Path(p)], second[Path(p)])
        for p in differing
        if p.endswith((".csv", ".json"))
    )


def _first_difference(name: str, first: bytes, second: bytes) -> str:
    """Where two text outputs part: the first differing line of each (what a flaky run needs to show)."""
    for number, (a, b) in enumerate(zip(first.decode().splitlines(), second.decode().splitlines()), 1):
        if a != b:
            return f"{name}, line {number}:\n  first:  {a[:300]}\n  second: {b[:300]}"
    return f"{name}: one run wrote more lines than the other"


@pytest.mark.notebook
def test_welford_notebook_reproduces_the_seed(smoke_run):
    """The smoke run's seed table against the numbers printed in the OneFlow pull request:
    the E[X²]−E[X]² LayerNorm gave ±0.8428, the careful ones ±0.8454; Paddle's gradient of
    sum(LayerNorm(x)) was [-0.00143835, 0.00143831]."""
    results = smoke_run(notebooks.resolve_notebook("02"))
    table = pd.read_csv(results / "data" / "02_welford_vs_naive_variance_seed.csv")
    fp32 = table[table["dtype"] == "float32"].set_index("implementation")
    assert fp32.loc["textbook", "y1"] == pytest.approx(0.8428, abs=5e-5)
    assert fp32.loc["welford", "y1"] == pytest.approx(0.8454, abs=5e-5)
    assert fp32.loc["two_pass", "grad1"] == pytest.approx(0.00143831, rel=1e-3)
    metrics = json.loads((results / "data" / "02_welford_vs_naive_variance.json").read_text())
    assert metrics["swapped_grads_detected"] is True


def _tagged_notebook(path, tagged_source):
    cells = [
        nbformat.v4.new_code_cell("smoke: bool = False  # unused", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(tagged_source, metadata={"tags": ["raises-exception"]}),
        nbformat.v4.new_code_cell("ran_after = True\nprint('after the tagged cell')"),
    ]
    notebook = nbformat.v4.new_notebook(
        cells=cells, metadata={"kernelspec": {"name": "qlab", "display_name": "qlab", "language": "python"}}
    )
    nbformat.write(notebook, path)
    return path


def test_a_cell_tagged_raises_exception_may_raise_and_the_rest_still_runs(tmp_path):
    # papermill's own final check fails on any error output, tagged or not; run_notebook must not
    source = _tagged_notebook(tmp_path / "tagged.ipynb", "raise ValueError('expected refusal')")
    result = notebooks.run_notebook(source, output=tmp_path / "out.ipynb", results_dir=tmp_path)
    executed = nbformat.read(result.output, as_version=4)
    tagged = [c for c in executed.cells if "raises-exception" in c.metadata.get("tags", [])][0]
    assert [o.ename for o in tagged.outputs if o.output_type == "error"] == ["ValueError"]
    assert "after the tagged cell" in executed.cells[-1].outputs[0].text


def test_a_cell_tagged_raises_exception_that_does_not_raise_fails_the_run(tmp_path):
    source = _tagged_notebook(tmp_path / "tagged.ipynb", "x = 1  # no refusal")
    with pytest.raises(notebooks.NotebookError, match="tagged raises-exception but raised nothing"):
        notebooks.run_notebook(source, output=tmp_path / "out.ipynb", results_dir=tmp_path)


def test_an_untagged_error_after_a_tagged_one_still_fails_the_run(tmp_path):
    source = _tagged_notebook(tmp_path / "tagged.ipynb", "raise ValueError('expected refusal')")
    notebook = nbformat.read(source, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("raise KeyError('a real failure')"))
    nbformat.write(notebook, source)
    with pytest.raises(notebooks.NotebookError, match="KeyError"):
        notebooks.run_notebook(source, output=tmp_path / "out.ipynb", results_dir=tmp_path)


def _saving_notebook(path, *later_cells):
    """A notebook at its defaults that saves data/table.csv and figures/plot.png, then runs
    ``later_cells``."""
    save = (
        "import matplotlib.pyplot as plt, pandas as pd\n"
        "from qlab import plotting, results\n"
        "plotting.save_figure(plt.figure(), 'plot')\n"
        "results.save_csv(pd.DataFrame({'x': [1, 2]}), 'table')"
    )
    cells = [
        nbformat.v4.new_code_cell("smoke: bool = False  # unused", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(save),
        *[nbformat.v4.new_code_cell(source) for source in later_cells],
    ]
    metadata = {"kernelspec": {"name": "qlab", "display_name": "qlab", "language": "python"}}
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=metadata), path)
    return path


def test_a_failed_run_at_the_defaults_leaves_the_committed_results_whole(tmp_path, monkeypatch):
    """A run whose results are the committed ones writes them in runs/staging/ and moves them into data/
    and figures/ only when every cell has run: a cell failing after the first results were written
    leaves the committed files as they were, and names where the partial results are."""
    root = tmp_path / "checkout"
    monkeypatch.setattr(paths, "ROOT", root)
    monkeypatch.setattr(paths, "STAGING_DIR", root / "runs" / "staging")
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    (root / "data").mkdir(parents=True)
    (root / "data" / "table.csv").write_text("x\nthe committed result\n")
    failing = _saving_notebook(tmp_path / "saves.ipynb", "raise RuntimeError('a late failure')")
    with pytest.raises(notebooks.NotebookError, match="a late failure") as failure:
        notebooks.run_notebook(failing, output=tmp_path / "failed.ipynb")
    assert (root / "data" / "table.csv").read_text() == "x\nthe committed result\n"
    assert not (root / "figures").exists()
    (staged,) = (root / "runs" / "staging").iterdir()
    assert f"what this run wrote is in runs/staging/{staged.name}" in str(failure.value)
    assert (staged / "data" / "table.csv").read_text() == "x\n1\n2\n"
    executed = nbformat.read(tmp_path / "failed.ipynb", as_version=4)
    (saving,) = [cell for cell in executed.cells if "save_csv" in cell.source]
    assert saving.outputs[0].data["text/plain"] == "saved data/table.csv"  # where it goes, not staging

    result = notebooks.run_notebook(_saving_notebook(tmp_path / "saves.ipynb"), output=tmp_path / "ok.ipynb")
    assert result.results is None
    assert (root / "data" / "table.csv").read_text() == "x\n1\n2\n"
    assert (root / "figures" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((root / "runs" / "staging").iterdir()) == [staged]  # this one moved, the failed one kept


def test_publish_moves_every_staged_file_into_place(tmp_path, monkeypatch):
    staging, root = tmp_path / "staging" / "05.123", tmp_path / "root"
    for name in ("data/a.csv", "data/paper/b.csv", "figures/c.png"):
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_text(f"new {name}")
    (root / "data").mkdir(parents=True)
    (root / "data" / "a.csv").write_text("old")
    (root / "data" / "untouched.csv").write_text("kept")
    real_replace = os.replace

    def across_disks(source, target):  # runs/ on another filesystem than data/: a rename cannot move it
        if Path(source).is_relative_to(staging):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", across_disks)
    moved = notebooks.publish(staging, root)
    expected = ["data/a.csv", "data/paper/b.csv", "figures/c.png"]
    assert [p.relative_to(root).as_posix() for p in moved] == expected
    assert all(p.read_text() == f"new {p.relative_to(root).as_posix()}" for p in moved)
    assert (root / "data" / "untouched.csv").read_text() == "kept" and not staging.exists()
    assert notebooks.publish(tmp_path / "never_made", root) == []  # a run that wrote nothing


def test_a_link_or_dotdot_to_the_checkout_is_still_the_checkout(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(paths.ROOT)
    with pytest.raises(ValueError, match="must not be in notebooks/"):
        notebooks.check_output(link / "notebooks" / "02_welford_vs_naive_variance.ipynb")
    notebook = notebooks.resolve_notebook("02")
    for beside in (link, paths.ROOT / "runs" / ".."):
        with pytest.raises(ValueError, match="would go to .*the committed results"):
            notebooks.output_folder(notebook, {"smoke": True}, f"{beside}/")


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_an_expected_error_says_so_above_it(ipynb):
    """A cell tagged raises-exception opens with a comment saying the error is expected, and the
    markdown cell before it says so too: a reader in JupyterLab sees a red traceback and must not
    take it for a failure."""
    cells = nbformat.read(ipynb, as_version=4).cells
    for index, cell in enumerate(cells):
        if "raises-exception" in cell.metadata.get("tags", []):
            assert cell.source.startswith("# Expected:"), cell.source[:80]
            previous = cells[index - 1]
            assert previous.cell_type == "markdown" and "on purpose" in previous.source


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_notebook_starts_a_session(source):
    """session.start decides where results go (data/ only for the committed defaults) and resolves
    device="auto"; no notebook repeats that logic."""
    text = source.read_text()
    assert f'NAME = "{source.stem}"' in text and "session.start(NAME, globals())" in text
    assert 'device == "auto"' not in text


# Notebooks whose conclusions are rendered from their claims files (qlab.claims): their markdown cells
# state no result number. Allowed: list numbering, confidence and power levels, and the parameter
# descriptions named here.
RENDERED_CONCLUSIONS = {
    "00_formats_and_scaling": [r"\d+×\d+", r"arXiv \d+\.\d+"],  # block shapes (16×16, 1×16); a source
    "01_gradient_norm_discrepancy": [r"~0\.00x"],  # the forum question's own words, quoted
    # the OneFlow pull request's own numbers, quoted with that source in the introduction
    "02_welford_vs_naive_variance": [r"−1\.83965693, −1\.82964566", r"±0\.84(28|54)", r"±1\.4·10⁻³"],
    "03_backward_override_training_curves": [r"1\.0M-parameter", r"clipping at 1\.0"],
    "04_gradient_accumulation": [],
    # meProp's published MNIST numbers, quoted with their source
    "05_topk_sparse_backprop": [r"98\.27 % test accuracy", r"98\.20 % dense", r"5\.9× faster backward"],
    # block shapes and the synthetic operands' outlier factor are parameters; arXiv numbers are sources
    "06_real_model_numerics": [],
    "07_recipe_ablations": [r"\d+×\d+", r"arXiv \d+\.\d+", r"\(×20\)"],
    "08_cross_machine_variance": [],
}
RESULT_NUMBER = re.compile(r"\d+\.\d+|\d+ ?%|\d+ ?×|×\s?\d")
ALWAYS_ALLOWED = [r"^\s*\d+\.\s", r"\b(95|80) %"]


@pytest.mark.parametrize("stem", sorted(RENDERED_CONCLUSIONS))
def test_markdown_cells_state_no_result_number(stem):
    allowed = [re.compile(p) for p in ALWAYS_ALLOWED + RENDERED_CONCLUSIONS[stem]]
    found = []
    for cell in jupytext.read(paths.NOTEBOOKS_DIR / f"{stem}.py").cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            for pattern in allowed:
                line = pattern.sub("", line)
            if RESULT_NUMBER.search(line):
                found.append(line)
    assert not found, f"{stem}: numbers typed into markdown (render them from the claims): {found}"


def test_the_number_check_catches_a_typed_result():
    assert RESULT_NUMBER.search("the gap is +0.0034 nats") and RESULT_NUMBER.search("clips 17 % of blocks")
    assert not RESULT_NUMBER.search("with 95 % intervals".replace("95 %", ""))


def test_a_headless_run_with_other_parameters_leaves_the_choice_of_results_to_the_session(
    monkeypatch, tmp_path
):
    """`qlab run NN -p name value --output X` passes no results directory to the kernel, so session.start
    sends a run with other values than the defaults to runs/interactive/ instead of over the committed data/;
    smoke, however it is asked for, keeps its results beside a chosen copy or in runs/smoke/;
    smoke runs (and sweep points) still get theirs."""
    import papermill

    seen = []

    def execute(path, output, **kwargs):
        seen.append(os.environ.get(paths.RESULTS_ENV))
        nbformat.write(nbformat.v4.new_notebook(), output)
        return nbformat.v4.new_notebook()

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    notebooks.run_notebook("04", {"seed": 3}, output=tmp_path / "other.ipynb")
    notebooks.run_notebook("04", {"smoke": True}, output=tmp_path / "flag.ipynb")
    notebooks.run_notebook("04", smoke=True, output=tmp_path / "smoke.ipynb")
    notebooks.run_notebook("04", smoke=True)
    monkeypatch.chdir(tmp_path)  # a relative folder: the kernel, which runs in it, gets it absolute
    notebooks.run_notebook("04", smoke=True, output="relative/")
    assert seen == [
        None,
        str(tmp_path),
        str(tmp_path),
        str(paths.RUNS_DIR / "smoke"),
        str(tmp_path / "relative"),
    ]
