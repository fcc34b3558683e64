"""qlab.session (where an interactive run writes, device="auto", progress) and qlab.lab's save guard,
without a browser (tests/test_jupyterlab.py drives the real thing).

References: papermill's own inspection of the parameters cell (for the defaults session reads with
ast), the committed notebook files' bytes (a guarded save must leave them unchanged), nbformat for
the executed copy, and jupytext for the parameters cell a save writes.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
import types

import nbformat
import pytest
import torch

from qlab import lab, notebooks, paths, session

NAME = "02_welford_vs_naive_variance"


@pytest.fixture
def interactive(monkeypatch, tmp_path):
    """A kernel started by JupyterLab: no results directory inherited; runs/ redirected to tmp_path."""
    monkeypatch.setattr(session, "_INHERITED_RESULTS", None)
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    yield tmp_path
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)


def test_defaults_are_what_papermill_reads_from_the_parameters_cell():
    for notebook in notebooks.list_notebooks():
        declared = notebooks.notebook_parameters(notebook)
        expected = {name: ast.literal_eval(info["default"]) for name, info in declared.items()}
        assert session.notebook_defaults(notebook.stem) == expected


def test_default_parameters_write_the_committed_results(interactive, capsys):
    namespace = dict(session.notebook_defaults(NAME), kappa_max=10_000_000)  # 1e7 written as an int
    run = session.start(NAME, namespace)
    assert run.results_dir == paths.ROOT and run.changed == {}
    assert paths.RESULTS_ENV not in os.environ and paths.results_root() == paths.ROOT
    assert "results go to data/ and figures/ (default parameters" in capsys.readouterr().out


def test_other_parameters_write_under_runs_interactive_and_say_so(interactive, capsys):
    namespace = dict(session.notebook_defaults(NAME), smoke=True, n=256)
    run = session.start(NAME, namespace)
    expected = interactive / "runs" / "interactive" / NAME / "smoke=True__n=256"
    assert run.changed == {"smoke": True, "n": 256} and run.results_dir == expected
    assert paths.results_root() == expected.resolve()
    assert paths.data_dir() == expected.resolve() / "data"
    assert "parameters differ from the defaults" in capsys.readouterr().out
    # editing the cell back to the defaults and running again writes the committed results again
    assert session.start(NAME, session.notebook_defaults(NAME)).results_dir == paths.ROOT
    assert paths.results_root() == paths.ROOT


def test_in_qlab_lab_the_notebook_says_where_a_save_keeps_its_outputs(interactive, capsys, monkeypatch):
    from qlab import lab

    monkeypatch.setenv(paths.LAB_ENV, "1")
    namespace = dict(session.notebook_defaults(NAME), smoke=True)
    session.start(NAME, namespace)
    printed = capsys.readouterr().out
    source = session.parameters_source(NAME).replace("smoke: bool = False", "smoke: bool = True")
    content = {"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": source}]}
    saved = paths.shown(lab.executed_copy(NAME, content))  # where LabContentsManager.save writes it
    assert f"a save keeps this notebook with its outputs at {saved}" in printed
    monkeypatch.delenv(paths.LAB_ENV)
    session.start(NAME, namespace)
    assert "a save keeps" not in capsys.readouterr().out  # papermill, a plain kernel: no such copy


def test_a_bool_is_not_the_int_one(interactive):
    refused = r"smoke must be a bool .*got 0 \(int\) \(in the parameters cell of 02_"
    with pytest.raises(TypeError, match=refused):
        session.start(NAME, dict(session.notebook_defaults(NAME), smoke=0))
    assert not session._same(0, False) and not session._same(True, 1) and session._same(1e7, 10_000_000)


def test_a_runner_chooses_for_itself(interactive, monkeypatch, tmp_path):
    monkeypatch.setattr(session, "_INHERITED_RESULTS", str(tmp_path / "sweep_point"))
    run = session.start(NAME, dict(session.notebook_defaults(NAME), smoke=True))
    assert run.results_dir == tmp_path / "sweep_point"


def test_a_staged_run_at_the_defaults_says_the_committed_results_and_writes_the_staging(
    interactive, monkeypatch, capsys
):
    staging = paths.STAGING_DIR / f"{NAME}.1"  # as run_notebook chooses for a run at the defaults
    monkeypatch.setattr(session, "_INHERITED_RESULTS", str(staging))
    monkeypatch.setenv(paths.RESULTS_ENV, str(staging))
    run = session.start(NAME, session.notebook_defaults(NAME))
    assert run.results_dir == paths.ROOT and paths.results_root() == staging.resolve()
    assert "results go to data/ and figures/ (default parameters" in capsys.readouterr().out
    assert paths.shown(staging / "data" / "x.csv") == "data/x.csv" and paths.shown(staging) != "."
    # values other than the defaults (an executed copy's injected smoke = True) never reach data/
    run = session.start(NAME, dict(session.notebook_defaults(NAME), smoke=True))
    assert run.results_dir == interactive / "runs" / "interactive" / NAME / "smoke=True"
    assert paths.results_root() == run.results_dir.resolve()
    session.start(NAME, session.notebook_defaults(NAME))  # edited back: the staging again
    assert paths.results_root() == staging.resolve()


TRAINING = "03_backward_override_training_curves"


def test_paper_profile_writes_under_data_paper_and_names_the_machine(
    interactive, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(session, "_INHERITED_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path / "results"))  # as run_notebook sets it for the kernel
    monkeypatch.delenv(paths.PROFILE_ENV, raising=False)
    run = session.start(TRAINING, dict(session.notebook_defaults(TRAINING), profile="paper"))
    try:
        assert run.changed == {}  # the profile is where results go, not a changed parameter
        assert paths.data_dir() == (tmp_path / "results" / "data" / "paper").resolve()
        assert paths.figures_dir() == (tmp_path / "results" / "figures" / "paper").resolve()
        record = json.loads((paths.data_dir() / f"{TRAINING}_machine.json").read_text())
        assert record["profile"] == "paper" and record["machine"] == session.machine(torch.device("cpu"))
        assert "data/paper" in capsys.readouterr().out
        # back to the cpu profile: data/ itself again
        session.start(TRAINING, session.notebook_defaults(TRAINING))
        assert paths.data_dir() == (tmp_path / "results" / "data").resolve()
    finally:
        monkeypatch.delenv(paths.PROFILE_ENV, raising=False)


def test_an_unknown_profile_is_refused(interactive):
    with pytest.raises(ValueError, match="profile 'gpu'; expected one of: cpu, paper"):
        session.start(TRAINING, dict(session.notebook_defaults(TRAINING), profile="gpu"))


def test_figures_paper_profile_runs_only_the_training_notebooks(monkeypatch, tmp_path):
    from qlab import cli

    monkeypatch.setattr(cli, "_campaign_complete", lambda *a: True)  # as if every campaign had finished

    calls, recorded = [], []
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path)

    def run_notebook(path, parameters, **options):
        calls.append((path.stem, parameters, options["output"]))
        return types.SimpleNamespace(notebook=path, seconds=1.5)

    monkeypatch.setattr(notebooks, "run_notebook", run_notebook)
    monkeypatch.setattr(cli, "_record_seconds", lambda *row: recorded.append(row))  # not into the repo
    assert cli.main(["figures", "--profile", "paper"]) == 0
    assert recorded == [(stem, "paper", 1.5) for stem, _, _ in calls]
    stems = [stem for stem, _, _ in calls]
    assert stems == [
        p.stem for p in notebooks.list_notebooks() if "profile" in notebooks.notebook_parameters(p)
    ]
    assert {"01", "03", "05", "06", "07"} <= {stem[:2] for stem in stems}
    assert all(parameters == {"profile": "paper"} for _, parameters, _ in calls)
    assert all(output == tmp_path / "paper" / f"{stem}.ipynb" for stem, _, output in calls)


def test_resolve_device():
    assert session.resolve_device("cpu") == torch.device("cpu")
    assert session.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            session.resolve_device("cuda")


def test_progress_is_text_outside_jupyter_and_headless(monkeypatch):
    from tqdm import tqdm
    from tqdm.notebook import tqdm as notebook_tqdm

    bar = session.progress(range(3), disable=True)
    assert isinstance(bar, tqdm) and not isinstance(bar, notebook_tqdm)
    monkeypatch.setenv(paths.HEADLESS_ENV, "1")
    assert session.headless() and not isinstance(session.progress(range(3), disable=True), notebook_tqdm)


# --- qlab.lab: the save guard and the listing -------------------------------------------------------


@pytest.fixture
def repository(monkeypatch, tmp_path):
    """A copy of notebook 02's pair in a throw-away root, with qlab.paths pointed at it."""
    root = tmp_path / "repo"
    (root / "notebooks").mkdir(parents=True)
    for suffix in (".py", ".ipynb"):
        shutil.copy(paths.NOTEBOOKS_DIR / f"{NAME}{suffix}", root / "notebooks")
    monkeypatch.setattr(paths, "ROOT", root)
    monkeypatch.setattr(paths, "NOTEBOOKS_DIR", root / "notebooks")
    monkeypatch.setattr(paths, "RUNS_DIR", root / "runs")
    return root


def _as_a_browser_saves_it(root):
    """The notebook as JupyterLab sends it after Run All with smoke = True: outputs, execution
    counts, the kernel's language_info, cell execution metadata."""
    notebook = nbformat.read(root / "notebooks" / f"{NAME}.ipynb", as_version=4)
    notebook.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    for count, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code":
            continue
        cell.execution_count = count
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {count}\n")]
        cell.metadata["execution"] = {"iopub.status.idle": "2026-11-23T23:00:00Z"}
        if "parameters" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace("smoke: bool = False", "smoke: bool = True")
    content = json.loads(nbformat.writes(notebook))  # the file's JSON splits text into lines;
    for cell in content["cells"]:  # the browser sends whole strings
        cell["source"] = "".join(cell["source"])
        for output in cell.get("outputs", []):
            output["text"] = "".join(output.get("text", ""))
    return {"type": "notebook", "format": "json", "content": content}


def _save(root, model, path):
    manager = lab.LabContentsManager(root_dir=str(root))
    return asyncio.run(manager.save(model, path))


@pytest.mark.parametrize("opened_as", [".py", ".ipynb"])
def test_a_save_leaves_the_tracked_files_as_committed_and_keeps_the_executed_copy(repository, opened_as):
    before = {p.name: p.read_bytes() for p in (repository / "notebooks").iterdir()}
    _save(repository, _as_a_browser_saves_it(repository), f"notebooks/{NAME}{opened_as}")
    after = {p.name: p.read_bytes() for p in (repository / "notebooks").iterdir() if p.is_file()}
    assert after == before
    executed_path = repository / "runs" / "interactive" / NAME / "smoke=True" / f"{NAME}.ipynb"
    executed = nbformat.read(executed_path, as_version=4)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code) and "smoke: bool = True" in code[0].source


def _with_parameters(model, old, new):
    for cell in model["content"]["cells"]:
        if "parameters" in cell["metadata"].get("tags", []):
            assert old in cell["source"]
            cell["source"] = cell["source"].replace(old, new)
    return model


def test_each_parameter_set_keeps_its_own_executed_copy(repository):
    """A later run with other parameters (or one still being edited) never overwrites a run's outputs."""
    smoke = _as_a_browser_saves_it(repository)
    _save(repository, smoke, f"notebooks/{NAME}.py")
    failed = _with_parameters(_as_a_browser_saves_it(repository), "n: int = 1024", "n: int = 0")
    failed["content"]["cells"][-1]["outputs"] = [
        nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])
    ]
    _save(repository, failed, f"notebooks/{NAME}.py")
    defaults = _with_parameters(
        _as_a_browser_saves_it(repository), "smoke: bool = True", "smoke: bool = False"
    )
    _save(repository, defaults, f"notebooks/{NAME}.py")
    editing = _with_parameters(_as_a_browser_saves_it(repository), "seed: int = 0", "seed: int = ")
    _save(repository, editing, f"notebooks/{NAME}.py")
    runs = repository / "runs" / "interactive" / NAME
    copies = sorted(str(path.relative_to(runs)) for path in runs.rglob("*.ipynb"))
    expected = ["defaults", "smoke=True", "smoke=True__n=0", "unparsed-parameters"]
    assert copies == [f"{folder}/{NAME}.ipynb" for folder in expected]
    first = json.loads((runs / "smoke=True" / f"{NAME}.ipynb").read_text())
    assert first["cells"] == smoke["content"]["cells"]  # the good run's outputs, untouched by the later ones


def test_an_untouched_notebook_is_served_with_the_kernels_language_info(repository):
    """JupyterLab marks a notebook changed when the kernel's language_info differs from the served
    one; the served one must be what the qlab kernel itself reports (asked over the kernel protocol)."""
    from jupyter_client.manager import start_new_kernel

    manager = lab.LabContentsManager(root_dir=str(repository))
    served = asyncio.run(manager.get(f"notebooks/{NAME}.py"))["content"]["metadata"]
    kernel_manager, client = start_new_kernel(kernel_name=served["kernelspec"]["name"])  # "qlab"
    try:
        reported = client.kernel_info(reply=True)["content"]["language_info"]
    finally:
        client.stop_channels()
        kernel_manager.shutdown_kernel(now=True)
    assert served["language_info"] == reported
    scratch = repository / "scratch.ipynb"  # files outside notebooks/ are served as they are
    scratch.write_text((repository / "notebooks" / f"{NAME}.ipynb").read_text())
    assert "language_info" not in asyncio.run(manager.get("scratch.ipynb"))["content"]["metadata"]


def test_a_save_with_qlab_save_parameters_changes_the_default_on_purpose(repository, monkeypatch):
    import jupytext

    monkeypatch.setenv(lab.SAVE_PARAMETERS_ENV, "1")
    _save(repository, _as_a_browser_saves_it(repository), f"notebooks/{NAME}.py")
    saved = jupytext.read(repository / "notebooks" / f"{NAME}.py")
    parameters = next(cell for cell in saved.cells if "parameters" in cell.metadata.get("tags", []))
    assert "smoke: bool = True" in parameters.source
    stored = nbformat.read(repository / "notebooks" / f"{NAME}.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in stored.cells)  # outputs still never stored


def test_files_outside_notebooks_are_saved_as_they_are(repository):
    model = _as_a_browser_saves_it(repository)
    _save(repository, model, "scratch.ipynb")
    saved = nbformat.read(repository / "scratch.ipynb", as_version=4)
    assert any(cell.get("outputs") for cell in saved.cells) and "language_info" in saved.metadata


def test_the_notebooks_listing_shows_each_pair_once(repository):
    manager = lab.LabContentsManager(root_dir=str(repository))
    (repository / "notebooks" / "scratch.ipynb").write_text(
        (repository / "notebooks" / f"{NAME}.ipynb").read_text()
    )
    names = {entry["name"] for entry in asyncio.run(manager.get("notebooks"))["content"]}
    assert names == {f"{NAME}.py", "scratch.ipynb"}  # an unpaired .ipynb stays visible


def test_lab_settings_merge_into_overrides(tmp_path):
    target = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    lab.install_lab_settings(tmp_path)
    settings = json.loads(target.read_text())
    assert settings["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert (
        settings["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["python"] == "Jupytext Notebook"
    )
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


NOTEBOOK_NAMES = sorted(path.stem for path in paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("notebook", NOTEBOOK_NAMES)
def test_every_notebooks_defaults_pass_its_own_checks(notebook):
    session.check_parameters(notebook, session.notebook_defaults(notebook))
    annotations = session.notebook_annotations(notebook)
    assert set(annotations) == set(session.notebook_defaults(notebook))  # every parameter has a type


# (notebook, parameter, value, error, what the message must say): one row per kind of rule
BAD_PARAMETERS = [
    (
        "06_real_model_numerics",
        "sensitivity_recipe",
        "nvfp5",
        ValueError,
        "unknown sensitivity_recipe 'nvfp5'",
    ),
    ("06_real_model_numerics", "keep_recipes", ["mxfp8", "mxfp9"], ValueError, "keep_recipes\\[1\\] 'mxfp9'"),
    (
        "06_real_model_numerics",
        "model_name",
        "gpt2",
        ValueError,
        "model_name: model 'gpt2' is neither a packaged",
    ),
    ("report_your_model", "formats", ["nvfp4", "mxfp9"], ValueError, "formats\\[1\\] names 'mxfp9'"),
    ("report_your_model", "score", "guessed", ValueError, "score"),
    ("report_your_model", "held_out", 1, ValueError, "held_out"),
    ("06_real_model_numerics", "keep_fraction", 1.5, ValueError, "keep_fraction must be a finite number in"),
    (
        "03_backward_override_training_curves",
        "overrides",
        ["none", "hp"],
        ValueError,
        "overrides\\[1\\] 'hp'",
    ),
    (
        "03_backward_override_training_curves",
        "recipes",
        "mxfp8",
        TypeError,
        "recipes must be a list\\[str\\]",
    ),
    ("03_backward_override_training_curves", "gemm", "fast", ValueError, "unknown gemm 'fast'"),
    ("03_backward_override_training_curves", "executor", "threads", ValueError, "unknown executor 'threads'"),
    ("03_backward_override_training_curves", "seeds", 0, ValueError, "seeds must be an int ≥ 1, got 0"),
    ("03_backward_override_training_curves", "steps", 3.0, TypeError, "steps must be an int"),
    ("03_backward_override_training_curves", "profile", "gpu", ValueError, "unknown profile 'gpu'"),
    ("03_backward_override_training_curves", "compiled", "no", TypeError, "compiled must be a bool"),
    ("03_backward_override_training_curves", "max_workers", -1, ValueError, "max_workers must be an int ≥ 0"),
    (
        "03_backward_override_training_curves",
        "lr",
        float("nan"),
        ValueError,
        "lr must be a finite number > 0",
    ),
    ("03_backward_override_training_curves", "device", "tpu", ValueError, "unknown device device='tpu'"),
    (
        "05_topk_sparse_backprop",
        "fractions",
        [0.1, 0.0],
        ValueError,
        "fractions\\[1\\] must be a finite number",
    ),
    ("07_recipe_ablations", "train_variants", ["nvfp4/no SRR"], ValueError, "nvfp4 has no variant 'no SRR'"),
    (
        "07_recipe_ablations",
        "train_variants",
        ["nvfp5/none"],
        ValueError,
        "unknown train_variants\\[0\\] 'nvfp5'",
    ),
    ("07_recipe_ablations", "pretrained_model", "bert", ValueError, "unknown pretrained_model 'bert'"),
    ("02_welford_vs_naive_variance", "pretrained_models", ["minilm"], ValueError, "pretrained_models\\[0\\]"),
    ("08_cross_machine_variance", "second", 3, TypeError, "second must be a str"),
]


@pytest.mark.parametrize("notebook, parameter, value, error, message", BAD_PARAMETERS)
def test_start_refuses_a_bad_parameter_before_anything_runs_and_names_it(
    interactive, notebook, parameter, value, error, message
):
    namespace = dict(session.notebook_defaults(notebook), **{parameter: value})
    with pytest.raises(error, match=f"{message}.*in the parameters cell of {notebook}"):
        session.start(notebook, namespace)
    assert not (interactive / "runs").exists() and os.environ.get(paths.RESULTS_ENV) is None


def test_training_variants_parse_into_preset_ingredients_and_the_last_block():
    from qlab import ablation

    assert ablation.variant_parts("nvfp4") == ("nvfp4", [], False)
    assert ablation.variant_parts("nvfp4/no SR") == ("nvfp4", ["stochastic_rounding"], False)
    assert ablation.variant_parts("nvfp4/+BF16 last block") == ("nvfp4", [], True)
    assert sorted(ablation.variant_parts("mxfp4_training/none")[1]) == ["hadamard", "stochastic_rounding"]
    assert ablation.variant_parts("fp32") == ("fp32", [], False)


def test_the_parameters_cell_reads_the_same_without_jupytext(monkeypatch):
    """A bare GPU image may lack jupytext: the line-by-line reading gives the values jupytext's does."""
    import run_helpers

    names = [path.stem for path in notebooks.list_notebooks()]
    with_jupytext = {name: session.parameter_values(session.parameters_source(name)) for name in names}
    run_helpers.hide_module(monkeypatch, "jupytext")
    for name in names:
        assert session.parameter_values(session.parameters_source(name)) == with_jupytext[name], name


def test_a_paper_profile_save_keeps_its_copy_apart_from_the_cpu_runs_copy():
    """The executed copy of a save follows the profile as ``qlab run`` does: a paper-profile save never
    replaces the outputs of the cpu run with the same other parameters."""
    name = "07_recipe_ablations"
    source = session.parameters_source(name)
    assert 'profile: str = "cpu"' in source

    def content(text):
        return {"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": text}]}

    cpu = lab.executed_copy(name, content(source))
    paper = lab.executed_copy(name, content(source.replace('profile: str = "cpu"', 'profile: str = "paper"')))
    folder = paths.RUNS_DIR / session.INTERACTIVE_DIR / name / "defaults"
    assert (cpu, paper) == (folder / f"{name}.ipynb", folder / "paper" / f"{name}.ipynb")
    assert paper == session.saved_copy(name, {}, "paper")


@pytest.mark.parametrize("extra", ["extra = {[1]: 2}", "extra = {1, []}", "profile = 5"])
def test_a_save_mid_edit_of_any_literal_keeps_its_copy_as_unparsed(extra):
    """An unhashable literal (TypeError from ast.literal_eval) is a cell mid-edit like any other."""
    name = "07_recipe_ablations"
    cell = {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": f"{extra}\n"}
    copy = lab.executed_copy(name, {"cells": [cell]})
    assert copy == paths.RUNS_DIR / session.INTERACTIVE_DIR / name / "unparsed-parameters" / f"{name}.ipynb"


@pytest.mark.parametrize(
    "cell, message",
    [
        ({"metadata": None, "source": ""}, r"content\['cells'\]\[0\]\['metadata'\] must be a dict"),
        ({"metadata": {"tags": None}, "source": ""}, "whose tags are a list"),
        ({"metadata": {}, "source": [1]}, r"\['source'\] must be text"),
    ],
)
def test_a_malformed_cell_is_refused_by_its_place_in_the_content(cell, message):
    with pytest.raises(ValueError, match=message):
        lab.executed_copy("07_recipe_ablations", {"cells": [cell]})
