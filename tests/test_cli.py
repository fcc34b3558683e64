"""The `qlab` command: run, sweep and their errors, on a tiny throw-away notebook."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from qlab import cli, notebooks, paths, sweep
from qlab.notebooks import NotebookError

TINY_PARAMETERS = """smoke: bool = False  # tiny sizes
device: str = "auto"  # unused here
a: int = 1  # a number recorded in the results
label: str = "x"  # a string recorded in the results
fail: bool = False  # raise inside the notebook
pid_dir: str = ""  # when a is 3: write the pid of its runner here, then sleep (a test kills it)"""

TINY_BODY = """import os, pathlib, time
import pandas as pd
from qlab.results import save_csv, save_metrics
if pid_dir and a == 3:
    pathlib.Path(pid_dir, str(os.getppid())).write_text("")
    time.sleep(900)  # until killed: the other points may take minutes on a loaded machine
if fail:
    raise RuntimeError(f"boom at a={a}")
save_csv(pd.DataFrame({"a": [a], "square": [a * a]}), "tiny")
save_metrics("tiny", a=a, square=a * a, label=label, smoke=smoke)"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A two-cell notebook in tmp_path; runs/ redirected to tmp_path/runs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "qlab", "display_name": "Python (qlab)", "language": "python"}
    params = nbformat.v4.new_code_cell(TINY_PARAMETERS)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(TINY_BODY)]
    path = tmp_path / "99_tiny.ipynb"
    nbformat.write(nb, path)
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    return path


def test_run_passes_parameters_and_keeps_results_out_of_the_repo(tiny, tmp_path, capsys):
    assert cli.main(["run", str(tiny), "-p", "a", "7", "-p", "label", "hello", "--smoke"]) == 0
    folder = tmp_path / "runs" / "interactive" / "99_tiny" / "smoke=True__a=7__label=hello"  # declared order
    metrics = json.loads((folder / "data" / "tiny.json").read_text())
    assert metrics == {"a": 7, "square": 49, "label": "hello", "smoke": True}
    assert (folder / "99_tiny.ipynb").exists()
    out = capsys.readouterr().out
    where = f"CSVs and figures in {folder / 'data'} and {folder / 'figures'}\n"
    assert "ok in" in out and f"executed copy {folder / '99_tiny.ipynb'}; {where}" in out


def test_smoke_and_other_parameters_go_to_one_folder_however_they_are_given(tiny, tmp_path):
    from qlab import notebooks

    runs = tmp_path / "runs"
    by_flag = notebooks.output_folder(tiny, {"a": 2, "smoke": True})
    assert notebooks.output_folder(tiny, {"smoke": True, "a": 2}) == by_flag  # however they were given
    assert by_flag == (
        runs / "interactive/99_tiny/smoke=True__a=2/99_tiny.ipynb",
        runs / "interactive/99_tiny/smoke=True__a=2",
    )
    smoke = (runs / "smoke" / "99_tiny.ipynb", runs / "smoke")
    assert notebooks.output_folder(tiny, {"smoke": True}) == smoke
    assert notebooks.output_folder(tiny, {"smoke": True, "a": 1}) == smoke  # a = its default
    assert notebooks.output_folder(tiny, {}) == (runs / "99_tiny.ipynb", None)  # the kernel's session decides
    # another profile never writes the defaults' executed copy: runs/[smoke/]<profile>/, as qlab figures does
    assert notebooks.output_folder(tiny, {"profile": "paper"}) == (runs / "paper" / "99_tiny.ipynb", None)
    assert notebooks.output_folder(tiny, {"profile": "paper", "smoke": True}) == (
        runs / "smoke" / "paper" / "99_tiny.ipynb",
        runs / "smoke",
    )
    assert cli.main(["run", str(tiny), "-p", "smoke", "true"]) == 0
    assert cli.main(["run", str(tiny), "--smoke"]) == 0
    assert sorted(p.relative_to(runs).as_posix() for p in runs.rglob("*") if p.is_file()) == [
        "smoke/99_tiny.ipynb", "smoke/data/tiny.csv", "smoke/data/tiny.json"]  # fmt: skip


def test_failing_notebook_names_cell_and_exception_and_keeps_the_copy(tiny, tmp_path, capsys):
    assert cli.main(["run", str(tiny), "-p", "fail", "true", "-p", "a", "3"]) == 1
    err = capsys.readouterr().err
    assert "99_tiny.ipynb failed in cell" in err
    assert "RuntimeError: boom at a=3" in err
    assert "raise RuntimeError" in err  # the failing cell's source
    kept = tmp_path / "runs" / "interactive" / "99_tiny" / "a=3__fail=True" / "99_tiny.ipynb"
    assert kept.exists() and f"executed copy kept at {kept}" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "no_such_notebook"], "unknown notebook 'no_such_notebook'; available: 00_"),
        (["run", "02", "-p", "no_such_parameter", "1"], "unknown parameter(s) no_such_parameter"),
        (
            ["run", "02", "-p", "n", "many"],
            "n must be an int ≥ 1, got 'many' (str) (in the parameters cell of 02_",
        ),
        (
            ["run", "06", "-p", "sensitivity_recipe", "nvfp5"],
            "unknown sensitivity_recipe 'nvfp5'; expected one of",
        ),
        (["run", "03", "--profile", "paper", "-p", "profile", "cpu"], "--profile paper and -p profile cpu"),
        (["run", "02", "--profile", "paper"], "has no profile parameter, so --profile paper cannot apply"),
        (["run", "02", "--smoke", "-p", "smoke", "false"], "--smoke and -p smoke false disagree"),
        (["run", "08", "-p", "second", "nosuch"], "second must name a folder of runs under data/cross_cpu/"),
        (["report", "--smoke", "--tokens", "32"], "--smoke sets its own sizes (--batches 2, --held-out 2"),
        (["report", "--tokens", "1"], "--tokens must be an int ≥ 2, got 1"),
        (["run", "02", "-p", "kappa_max", "1e6", "-p", "kappa_max", "1e7"], "-p kappa_max given twice (1e6,"),
        (["sweep", "02", "grid.yaml", "-p", "n", "1", "-p", "n", "2"], "-p n given twice (1, then 2)"),
        (["campaign", "03", "-p", "seeds", "2", "-p", "seeds", "3", "--status"], "-p seeds given twice"),
        (["train", "-p", "steps", "2", "-p", "steps", "3"], "-p steps given twice (2, then 3)"),
        (["train", "-p", "nproc", "1", "--nproc", "2"], "--nproc 2 and -p nproc 1: give nproc once"),
        (["train", "-p", "lr", "0.01", "--set", "lr=0.02"], "-p lr given twice (0.01, then 0.02)"),
        (["advise", "--formats", "nvfp5"], "--formats names 'nvfp5', not a recipe preset"),
        (["advise", "--model", "nosuch"], "--model 'nosuch' is neither a packaged model"),
        # an executed copy or a smoke run's results in the committed places, a path no file can have
        (
            ["run", "02", "--smoke", "--output", ""],
            "--output must name a .ipynb file or a folder, got an empty",
        ),
        (["run", "02", "--smoke", "--output", str(paths.ROOT)], "would go to " + str(paths.ROOT)),
        (["run", "02", "--smoke", "--output", "notebooks/"], "--output must not be in notebooks/"),
        (["campaign", "03", "--smoke", "--output", "runs/../", "--status"], "the committed results"),
        (["report", "--out", "notebooks"], "--out must not be in notebooks/"),
        (["run", "a" * 300], "unknown notebook 'aaaa"),
        (["campaign", "a" * 300, "--status"], "unknown notebook 'aaaa"),
        (["run", "00", "-p", "seed", str(10**23)], "seed must be an int in [0, 9223372036854775807]"),
        (["train", "-p", "steps", "2", "-p", " steps", "3"], "-p needs a parameter name without spaces"),
        (["train", "-p", "device", "cuda:99"], "device 'cuda:99'"),
        (
            ["train", "-p", "out_dir", "README.md"],
            "out_dir must be a folder (one to make, or a run's), got the",
        ),
        (
            ["advise", "--formats", "nvfp4,bf16", "--expand", "-7"],
            "--expand does nothing with --score measured",
        ),
        (["advise", "--out", ""], "--out must name a file to write, got an empty string"),
        (["sweep", "02", "grid.yaml", "-j", "2", "--executor", "serial"], "-j 2 runs points at once and --"),
        (["report", "--out", "README.md"], "--out must name a folder for the report, got the file README.md"),
        (["report", "--out", ""], "--out must name a folder for the report, got an empty string"),
        (["report", "--out", str(paths.ROOT)], "--out must be a folder other than the repository root"),
        (["report", "--device", "tpu"], "unknown device --device='tpu'"),
        (["report", "--text", "/no/such.txt"], "--text must name an existing UTF-8 text file"),
        (["run", "02", "-p", "device", ""], "unknown device device=''"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(paths.ROOT)  # paths typed relative to the checkout, as the docs type them
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "02", "--timeout", "5", "--timeout", "6"], "--timeout given twice; give it once"),
        (
            ["advise", "--keep-fraction", "0.5", "--budget", "0.1"],
            "--budget and --keep-fraction set the same",
        ),
        (
            ["report", "--effective-bits", "5", "--budgets", "6"],
            "--budgets and --effective-bits set the same",
        ),
    ],
)
def test_an_option_given_twice_or_beside_its_older_name_is_refused(argv, message, capsys):
    """argparse keeps the last of two values silently; -p refuses a repeat, and so does every option."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_an_executed_copy_is_refused_by_run(tmp_path, capsys):
    """An executed copy keeps papermill's injected-parameters cell, which a run without -p leaves in
    place: its values (smoke, say) would run, and publish, as if they were the defaults."""
    source = nbformat.read(paths.NOTEBOOKS_DIR / "02_welford_vs_naive_variance.ipynb", as_version=4)
    injected = nbformat.v4.new_code_cell("smoke = True", metadata={"tags": ["injected-parameters"]})
    source.cells.insert(1, injected)
    nbformat.write(source, tmp_path / "02_welford_vs_naive_variance.ipynb")
    assert cli.main(["run", str(tmp_path / "02_welford_vs_naive_variance.ipynb")]) == 2
    assert "is an executed copy (it holds papermill's injected parameters)" in capsys.readouterr().err


def test_a_campaign_s_output_folder_to_make_keeps_its_trailing_slash(tmp_path, capsys):
    assert cli.main(["campaign", "03", "--smoke", "--output", f"{tmp_path}/new/", "--status"]) == 0
    assert f"runs stored in {tmp_path}/new/data/runs" in capsys.readouterr().out


def test_sweep_is_resumable_and_never_deletes_completed_points(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(
        "QLAB_RUN_CACHE", "1"
    )  # a notebook's training runs may come from the cache; points never
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1, 2, 3]\nfail: [false, true]\nlabel: sweep\n")
    assert cli.main(["sweep", str(tiny), str(grid), "-j", "2"]) == 1
    out = capsys.readouterr()
    assert "3 ran, 0 already complete, 3 failed" in out.out
    root = tmp_path / "runs" / "99_tiny"
    failed = root / "a=2__fail=True__label=sweep"
    assert (  # the cell's exception, and where the whole message is
        f"FAILED a=2__fail=True__label=sweep: NotebookError: notebook 99_tiny.ipynb failed in cell In [3]: "
        f"RuntimeError: boom at a=2 (in full: {failed / sweep.ERROR_FILE})" in out.err
    )
    done = root / "a=2__fail=False__label=sweep"
    record = json.loads((done / sweep.METRICS_FILE).read_text())
    assert record["parameters"] == {"a": 2, "fail": False, "label": "sweep"}
    assert record["metrics"]["square"] == 4
    assert (done / "data" / "tiny.csv").read_text() == "a,square\n2,4\n"
    assert "boom at a=3" in (root / "a=3__fail=True__label=sweep" / sweep.ERROR_FILE).read_text()
    before = (done / sweep.METRICS_FILE).stat().st_mtime_ns

    (failed / sweep.ERROR_FILE).unlink()
    assert cli.main(["sweep", str(tiny), str(grid)]) == 1  # failing points are retried, the rest skipped
    assert "0 ran, 3 already complete, 3 failed" in capsys.readouterr().out
    assert (done / sweep.METRICS_FILE).stat().st_mtime_ns == before
    assert "boom at a=2" in (failed / sweep.ERROR_FILE).read_text()  # run again, not an outcome kept


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: [1, 2\n", "malformed YAML"),
        ("- 1\n- 2\n", "must be a non-empty mapping"),
        ("a: []\n", "empty list of values"),
        ("b: [1]\n", "unknown parameter(s) b"),
        ("a: [1]\na: [2]\n", "the key 'a' is given twice (line 2)"),  # never the last one silently
        ("? [1, 2]\n: [3]\n", "found unhashable key"),
    ],
)
def test_sweep_rejects_bad_grids_before_running_anything(tiny, tmp_path, text, message, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    assert cli.main(["sweep", str(tiny), str(grid)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_sweep_names_its_grid_argument_when_the_file_is_missing_or_unreadable(tiny, tmp_path, capsys):
    assert cli.main(["sweep", str(tiny), str(tmp_path / "absent.yaml")]) == 2
    assert "grid must name an existing grid file" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("label: [\xe9]\n".encode("latin-1"))
    assert cli.main(["sweep", str(tiny), str(latin1)]) == 2
    assert f"grid {latin1} is not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_grid_points_product_and_slugs():
    import hashlib

    points = sweep.grid_points({"a": [1, 2], "b": ["x", "y z"]})
    assert points == [{"a": 1, "b": "x"}, {"a": 1, "b": "y z"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y z"}]
    assert sweep.point_slug(points[0]) == "a=1__b=x"  # nothing replaced: the text itself
    # a replaced character: the text's hash follows, so "y z", "y/z" and "y-z" keep three folders
    assert sweep.point_slug(points[1]) == "a=1__b=y-z--" + hashlib.sha1(b"a=1__b=y z").hexdigest()[:12]
    slugs = {sweep.point_slug({"a": 1, "b": b}) for b in ("y z", "y/z", "y-z")}
    assert len(slugs) == 3 and "a=1__b=y-z" in slugs
    long = sweep.point_slug({"name": "v" * 300})
    assert len(long) <= 120 and long != sweep.point_slug({"name": "v" * 301})


def test_sweep_refuses_a_folder_holding_another_points_results(tiny, tmp_path, monkeypatch):
    """A completed point is skipped only where its record names this point's parameters."""
    monkeypatch.setattr(sweep, "run_notebook", lambda *a, **k: pytest.fail("a notebook started"))
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1, 2]\n")
    other = tmp_path / "runs" / "99_tiny" / "a=2"
    other.mkdir(parents=True)
    (other / sweep.METRICS_FILE).write_text(json.dumps({"parameters": {"a": 7}, "metrics": {}}))
    with pytest.raises(
        ValueError, match=r"runs/99_tiny/a=2 holds the completed point \{'a': 7\}, not \{'a': 2\}"
    ):
        sweep.run_sweep(str(tiny), grid, progress=False)
    assert not (tmp_path / "runs" / "99_tiny" / "a=1").exists()  # refused before any folder is made


def test_sweep_collects_the_metrics_of_its_profile_and_keeps_both_of_a_name_given_twice(
    tmp_path, monkeypatch
):
    from qlab import results

    def notebook(notebook, parameters, *, smoke, output, results_dir, timeout):  # what the kernel does
        profile = parameters.get("profile", "cpu")
        with paths.environment(QLAB_RESULTS_DIR=str(results_dir), QLAB_PROFILE=profile):
            results.save_metrics("train", loss=2.31, steps=100)
            results.save_metrics("val", loss=2.57)
            (paths.data_dir() / "nb_machine.json").write_text('{"cpu": "x"}')

    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(sweep, "run_notebook", notebook)
    grid = tmp_path / "grid.yaml"
    grid.write_text("profile: [cpu, paper]\n")
    outcomes = sweep.run_sweep("07", grid, progress=False)
    assert [o.status for o in outcomes] == ["ok", "ok"]
    for outcome in outcomes:
        record = json.loads((Path(outcome.folder) / sweep.METRICS_FILE).read_text())
        assert record["metrics"] == {"train.loss": 2.31, "steps": 100, "val.loss": 2.57}, outcome.slug


def test_smoke_given_as_a_parameter_is_a_smoke_sweep(tiny, tmp_path, capsys):
    """-p smoke true, a grid's smoke: [true] and --smoke are one sweep: the same folders, run once."""
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [5]\n")
    assert cli.main(["sweep", str(tiny), str(grid), "--smoke"]) == 0
    assert cli.main(["sweep", str(tiny), str(grid), "-p", "smoke", "true"]) == 0
    assert "0 ran, 1 already complete, 0 failed" in capsys.readouterr().out
    grid.write_text("a: [5]\nsmoke: [true]\n")
    assert sweep.run_sweep(str(tiny), grid, progress=False)[0].status == "skipped"
    record = json.loads((tmp_path / "runs" / "smoke" / "99_tiny" / "a=5" / sweep.METRICS_FILE).read_text())
    assert record["smoke"] is True and record["parameters"] == {"a": 5}
    assert not (tmp_path / "runs" / "99_tiny").exists()
    grid.write_text("a: [5]\nsmoke: [true, false]\n")
    with pytest.raises(ValueError, match="some points with smoke true and others without"):
        sweep.run_sweep(str(tiny), grid, progress=False)


def test_sweep_checks_its_flags_and_passes_the_workers_asked_for(tiny, tmp_path, monkeypatch):
    from qlab import runs

    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1]\n")
    for name in ("smoke", "progress"):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            sweep.run_sweep(str(tiny), grid, **{name: "yes"})
    assert not (tmp_path / "runs").exists()
    asked = []
    monkeypatch.setattr(runs, "run_many", lambda tasks, **options: asked.append(options) or [])
    for jobs, executor in ((1, "processes"), (None, "processes"), (None, None), (3, None)):
        sweep.run_sweep(str(tiny), grid, jobs=jobs, executor=executor, progress=False)
    assert [(o["executor"], o["max_workers"], o["cache"]) for o in asked] == [
        ("processes", 1, False),  # -j 1 is one worker, whatever the executor
        ("processes", None, False),  # qlab.runs' default: a worker per core
        ("serial", None, False),
        ("processes", 3, False),
    ]


def test_float_parameters_accept_exponent_notation_and_ints(tiny):
    """YAML 1.1 reads `1e6` as a string; a float parameter must still take it."""
    params = notebooks.check_parameters(
        notebooks.resolve_notebook("02"), {"kappa_max": "1e6", "eps": 1, "n": 8}
    )
    assert params == {"kappa_max": 1e6, "eps": 1.0, "n": 8}
    assert type(params["eps"]) is float
    for bad in ("big", "nan", "inf"):
        with pytest.raises(TypeError, match="kappa_max must be a finite number > 0"):
            notebooks.check_parameters(notebooks.resolve_notebook("02"), {"kappa_max": bad})


def test_sweep_refuses_a_grid_with_repeated_points(tiny, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1, 2, 1]\n")
    assert cli.main(["sweep", str(tiny), str(grid)]) == 2
    assert "the same point more than once: a=1" in capsys.readouterr().err


def test_smoke_sweeps_never_share_directories_with_full_ones(tiny, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [5]\n")
    assert cli.main(["sweep", str(tiny), str(grid), "--smoke"]) == 0
    assert (
        f"each point in {tmp_path / 'runs' / 'smoke' / '99_tiny'}/<its parameters>/"
        in capsys.readouterr().out
    )
    for argv in (["-p", "smoke", "false"], ["-j", "2", "--executor", "serial"]):  # options that disagree
        assert cli.main(["sweep", str(tiny), str(grid), "--smoke", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert "smoke=True and a point's smoke false disagree" in err and "--executor serial one at a time" in err
    record = json.loads((tmp_path / "runs" / "smoke" / "99_tiny" / "a=5" / sweep.METRICS_FILE).read_text())
    assert record["metrics"]["smoke"] is True
    assert not (tmp_path / "runs" / "99_tiny").exists()


def test_sweep_takes_fixed_parameters_as_qlab_run_does(tiny, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [2, 3]\n")
    assert cli.main(["sweep", str(tiny), str(grid), "-p", "label", "fixed"]) == 0
    for a in (2, 3):  # every point gets the fixed parameter, and its folder names it
        point = tmp_path / "runs" / "99_tiny" / f"a={a}__label=fixed"
        record = json.loads((point / sweep.METRICS_FILE).read_text())
        assert record["parameters"] == {"a": a, "label": "fixed"} and record["metrics"]["label"] == "fixed"
    capsys.readouterr()
    assert cli.main(["sweep", str(tiny), str(grid), "-p", "a", "4"]) == 2  # set twice: refused
    assert "a set both by the grid" in capsys.readouterr().err
    assert cli.main(["sweep", str(tiny), str(grid), "-p", "nope", "1"]) == 2
    assert "nope" in capsys.readouterr().err


def test_yaml_loader_is_safe(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ValueError, match="malformed YAML"):
        sweep.load_grid(grid)


@pytest.mark.parametrize(
    "text, value",
    [  # YAML 1.2's booleans: only true and false; YAML 1.1's yes, no, on and off stay the words typed
        ("true", True),
        ("False", False),
        ("no", "no"),
        ("yes", "yes"),
        ("off", "off"),
        ("[on, true, 1e6, 3]", ["on", True, "1e6", 3]),
        ("'no'", "no"),
    ],
)
def test_p_values_are_yaml_with_only_true_and_false_for_booleans(text, value):
    parsed = cli._parse_value(text)
    assert parsed == value and [type(v) for v in [parsed]] == [type(value)]


def test_a_bool_parameter_refuses_no_by_name_and_a_str_parameter_keeps_it(tiny, tmp_path, capsys):
    assert cli.main(["run", str(tiny), "-p", "fail", "no", "--smoke"]) == 2
    assert "fail must be a bool (True or False), got 'no' (str)" in capsys.readouterr().err
    grid = tmp_path / "grid.yaml"
    grid.write_text("label: [no, off]\n")  # words, not two Falses (which a str parameter would refuse)
    assert cli.main(["sweep", str(tiny), str(grid), "--smoke"]) == 0
    for word in ("no", "off"):
        record = json.loads(
            (tmp_path / "runs" / "smoke" / "99_tiny" / f"label={word}" / "metrics.json").read_text()
        )
        assert record["metrics"]["label"] == word


@pytest.mark.parametrize(
    "argv", [["run", "02"], ["figures", "--smoke"], ["sweep", "02", "grid.yaml"], ["report"]]
)
def test_timeout_is_refused_by_its_option_name_before_any_notebook(argv, monkeypatch, capsys):
    monkeypatch.setattr(notebooks, "run_notebook", lambda *a, **k: pytest.fail("a notebook started"))
    assert cli.main([*argv, "--timeout", "0"]) == 2
    assert capsys.readouterr().err == "qlab: error: --timeout must be an int ≥ 1, got 0\n"


def test_list_and_resolve(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "02_welford_vs_naive_variance" in out and "smoke: bool = False" in out
    assert out.splitlines()[-1].startswith("report_your_model: the report on your own model, run by")
    assert notebooks.resolve_notebook("02").name == "02_welford_vs_naive_variance.ipynb"
    assert (
        notebooks.resolve_notebook(paths.NOTEBOOKS_DIR / "02_welford_vs_naive_variance.py").suffix == ".ipynb"
    )


def test_advise_prints_the_ranked_layers_and_the_patterns(tmp_path, capsys):
    out = tmp_path / "advice.csv"
    argv = ["advise", "--model", "minilm-l6", "--recipe", "nvfp4", "--batches", "1", "--batch-size", "1"]
    assert cli.main(argv + ["--tokens", "16", "--top", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "keep_high_precision = [" in printed and "the most sensitive layers" in printed
    import pandas as pd

    table = pd.read_csv(out)
    assert len(table) == 37 and sorted(table["rank"]) == list(range(1, 38))  # MiniLM: 6 × 6 + pooler
    assert table.sort_values("rank").delta.is_monotonic_decreasing


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--formats", "nvfp4,bf16", "--budget", "5"], "--keep-fraction does nothing in plan mode"),
        (
            ["--formats", "nvfp4,bf16", "--recipe", "mxfp8", "--by", "flops"],
            "--recipe, --by do nothing in plan",
        ),
        (["--effective-bits", "5"], "--effective-bits does nothing in keep mode (no --formats)"),
        (["--score", "approximated", "--plan-out", "p.json"], "--score, --plan-out do nothing in keep mode"),
        (["--keep-fraction", "1.5"], "--keep-fraction must be a finite number in [0, 1], got 1.5"),
        (["--recipe", "nosuch"], "unknown --recipe 'nosuch'"),
        (["--formats", "mxfp8", "--effective-bits", "0"], "--effective-bits must be a finite number > 0"),
        # MXFP8's cheapest layer: 8-bit codes and one 8-bit E8M0 scale per 32 of them
        (["--formats", "mxfp8,bf16", "--effective-bits", "8.2"], "below the 8.25 bits per weight element"),
        (["--top", "0"], "--top must be an int ≥ 1, got 0"),
        (["--batches", "0"], "--batches must be an int ≥ 1, got 0"),
        (["--formats", "nvfp4", "--tokens", "1"], "--tokens must be an int ≥ 2, got 1"),
        (["--out", "nowhere-qlab/t.csv"], "--out nowhere-qlab/t.csv: its folder nowhere-qlab does not exist"),
        (
            ["--formats", "nvfp4", "--plan-out", "."],
            "--plan-out must name a file to write, got the folder .",
        ),
        (
            ["--formats", "nvfp4", "--plan-out", "pyproject.toml/p.json"],
            "pyproject.toml is a file, so no folder",
        ),
        (["--text", "qlab"], "--text must be a UTF-8 text file, got the folder qlab"),
        (["--seed", "-1"], "--seed must be an int in [0, "),
        (
            ["--tokenizer", "x"],
            "--tokenizer is for a checkpoint folder or hub id, and the packaged model smollm2-135m",
        ),
    ],
)
def test_advise_refuses_the_other_modes_options_before_loading_a_model(argv, message, monkeypatch, capsys):
    from qlab import models

    monkeypatch.setattr(models, "load_any", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["advise", *argv]) == 2
    assert message in capsys.readouterr().err


def test_only_the_campaign_says_budget_and_the_older_option_names_still_parse():
    """--budget is a campaign's wall time; advise's fraction of layers is --keep-fraction and report's
    bits per element --effective-bits, as advise's plan mode names them (--budget and --budgets, their
    earlier names, parse to the same values)."""
    parser = cli._build_parser()
    for flag in ("--keep-fraction", "--budget"):
        assert parser.parse_args(["advise", flag, "0.25"]).budget == 0.25
    for flag in ("--effective-bits", "--budgets"):
        assert parser.parse_args(["report", flag, "5,6"]).budgets == "5,6"
    shown = {
        name: parser._subparsers._group_actions[0].choices[name].format_help()
        for name in ("advise", "report")
    }
    assert "--keep-fraction" in shown["advise"] and "--effective-bits" in shown["report"]
    assert "--budget" not in shown["advise"] and "--budgets" not in shown["report"]


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time on this machine
def test_sweep_on_a_ray_cluster_keeps_every_point_a_killed_worker_did_not_touch(tiny, tmp_path, capsys):
    pytest.importorskip("ray", reason="the ray package is not installed: pip install 'qlab[ray]'")
    import os
    import signal
    import threading
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"a: [1, 2, 3]\npid_dir: {pids}\n")
    root = tmp_path / "runs" / "99_tiny"
    finished = [root / sweep.point_slug({"a": a, "pid_dir": str(pids)}) / sweep.METRICS_FILE for a in (1, 2)]

    def kill_the_third_point_once_the_others_finished():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if all(path.exists() for path in finished) and any(pids.iterdir()):
                os.kill(int(next(pids.iterdir()).name), signal.SIGKILL)  # the Ray worker running a=3
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_third_point_once_the_others_finished, daemon=True)
    killer.start()
    assert cli.main(["sweep", str(tiny), str(grid), "--executor", "ray"]) == 1
    killer.join()
    out = capsys.readouterr()
    assert "2 ran, 0 already complete, 1 failed" in out.out
    assert "FAILED a=3__" in out.err and "Ray worker running it died" in out.err
    for path in finished:
        assert json.loads(path.read_text())["metrics"]["square"] in (1, 4)


def test_sweep_refuses_an_unreachable_ray_address_before_running_anything(tiny, tmp_path, capsys):
    pytest.importorskip("ray", reason="the ray package is not installed: pip install 'qlab[ray]'")
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1]\n")
    assert cli.main(["sweep", str(tiny), str(grid), "--executor", "ray", "--address", "127.0.0.1:9"]) == 2
    assert "no Ray cluster answers there" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--held-out", "0"], "--held-out must be an int ≥ 1, got 0"),
        (["--model", "./nope"], "--model: model './nope' is neither a packaged model"),
        (["--effective-bits", "0.15"], "--effective-bits 0.15 is below"),
    ],
)
def test_report_names_the_option_typed_before_a_kernel_starts(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(notebooks, "run_report", lambda *a, **k: pytest.fail("the report ran"))
    assert cli.main(["report", *argv]) == 2
    assert message in capsys.readouterr().err


def test_sweep_refuses_an_address_without_the_ray_executor_and_makes_no_folder(tiny, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("a: [1]\n")
    assert cli.main(["sweep", str(tiny), str(grid), "--address", "auto"]) == 2
    assert "address is for the ray executor, got executor 'serial'" in capsys.readouterr().err
    assert cli.main(["sweep", str(tiny), str(grid), "-j", "0"]) == 2
    assert "-j must be an int ≥ 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_figures_refuses_an_address_without_the_ray_executor(capsys):
    assert cli.main(["figures", "--address", "auto"]) == 2
    assert "--address needs --executor ray, and no executor was given" in capsys.readouterr().err


@pytest.mark.parametrize("profile", ["cpu", "paper"])
def test_figures_with_an_executor_keeps_those_notebooks_results_out_of_data(profile, tmp_path, monkeypatch):
    """A chosen executor is a changed parameter, as with qlab run -p executor (a serial run's threads per
    run differ from a pool's): the executed copy and the results go under runs/interactive/, together."""
    import types

    calls = {}

    def run_notebook(path, parameters, *, output=None, **options):
        calls[path.stem] = (parameters, output)
        return types.SimpleNamespace(seconds=1.0)

    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(notebooks, "run_notebook", run_notebook)
    monkeypatch.setattr(cli, "_record_seconds", lambda *row: pytest.fail("a wall time was recorded"))
    monkeypatch.setattr(cli, "_campaign_complete", lambda *a: True)
    monkeypatch.setattr(cli, "_stored_runs", lambda *a: 0)
    assert cli.main(["figures", "--profile", profile, "--executor", "serial"]) == 0
    assert calls
    for stem, (parameters, output) in calls.items():
        takes_one = "executor" in notebooks.notebook_parameters(notebooks.resolve_notebook(stem))
        profile_part = {} if profile == "cpu" else {"profile": profile}
        assert parameters == {**profile_part, **({"executor": "serial"} if takes_one else {})}, stem
        if takes_one:
            folder = tmp_path / "runs" / "interactive" / stem / "executor=serial"
            assert output == folder / f"{stem}.ipynb", stem
            from qlab import session

            assert session.interactive_dir(stem, {"executor": "serial"}) == folder  # where the kernel writes
        elif profile == "cpu":
            assert output is None, stem


def test_run_executor_is_the_executor_parameter_and_bad_combinations_are_refused(monkeypatch, capsys):
    import types

    calls = []

    def run_notebook(path, parameters, **options):
        calls.append(parameters)
        path = notebooks.resolve_notebook(path)
        return types.SimpleNamespace(notebook=path, output=path, results=None, seconds=1.0)

    monkeypatch.setattr(notebooks, "run_notebook", run_notebook)
    monkeypatch.setattr(cli, "_record_seconds", lambda *row: pytest.fail("a wall time was recorded"))
    assert cli.main(["run", "02", "--executor", "serial"]) == 0
    assert calls == [{"executor": "serial"}]
    cases = [
        (["06", "--executor", "serial"], "06_real_model_numerics has no executor parameter"),
        (["02", "--executor", "serial", "-p", "executor", "ray"], "disagree; give the executor once"),
        (["02", "--address", "auto"], "--address needs --executor ray, and no executor was given"),
        (["02", "--executor", "ray", "--address", "nowhere"], "address must be 'auto', 'host:port'"),
    ]
    for argv, message in cases:
        assert cli.main(["run", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert len(calls) == 1


def test_findings_check_reports_a_stale_readme(tmp_path, monkeypatch, capsys):
    from qlab import claims

    readme = tmp_path / "README.md"
    readme.write_text(f"{claims.FINDINGS_START}\nstale\n{claims.FINDINGS_END}\n")
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(paths, "ROOT", tmp_path)
    assert cli.main(["findings", "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert cli.main(["findings"]) == 0 and cli.main(["findings", "--check"]) == 0


def test_every_option_of_every_command_says_what_it_does(capsys):
    # read from each command's --help: every option and positional is followed by its help text
    import argparse

    parser = cli._build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = []
    for name, command in commands.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help:
                bare.append(f"qlab {name} {'/'.join(action.option_strings) or action.dest}")
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        shown = capsys.readouterr().out
        for action in command._actions:
            if action.help == argparse.SUPPRESS:  # hidden on purpose (train's deprecated --set)
                assert "/".join(action.option_strings) not in shown, (name, action.option_strings)
                continue
            assert not action.help or action.help.split("%")[0].split()[0] in shown, (name, action.help)
    assert bare == []
    with pytest.raises(SystemExit):
        cli.main(["lab", "--help"])
    assert "every other option goes to `jupyter lab`" in " ".join(capsys.readouterr().out.split())


def test_a_misspelt_notebook_or_parameter_gets_a_did_you_mean(capsys):
    assert cli.main(["run", "02_welford_vs_naive_varianse"]) == 2
    assert "did you mean 02_welford_vs_naive_variance?" in capsys.readouterr().err
    assert cli.main(["run", "02", "-p", "smok", "true"]) == 2
    assert "did you mean smoke for smok?" in capsys.readouterr().err
    assert cli.main(["run", "welfrod"]) == 2  # one word of a notebook's topic, misspelt
    assert "did you mean 02_welford_vs_naive_variance?" in capsys.readouterr().err
    assert cli.main(["run", "LayerNorm"]) == 2  # a word of the title alone ("…does LayerNorm's variance…")
    assert "did you mean 02_welford_vs_naive_variance?" in capsys.readouterr().err
    assert cli.main(["run", "gradient"]) == 2  # a word two notebooks' names share: both named
    assert "did you mean 01_gradient_norm_discrepancy or 04_gradient_accumulation?" in capsys.readouterr().err
    for typed, meant in [
        ("04_gradient", "04_gradient_accumulation"),  # the number names one
        ("3_backwrd", "03_backward_override_training_curves"),
        ("gradient_norm", "01_gradient_norm_discrepancy"),  # two words: the closest whole name
    ]:
        assert cli.main(["run", typed]) == 2
        assert f"did you mean {meant}? " in capsys.readouterr().err, typed
    assert cli.main(["run", "zzzz"]) == 2  # no word near it: no suggestion, the list alone
    assert "did you mean" not in capsys.readouterr().err
    assert notebooks.resolve_notebook("2") == notebooks.resolve_notebook("02")  # a number without its 0


def test_a_cell_past_its_timeout_is_a_notebook_error_which_qlab_figures_collects_and_goes_on(
    tiny, tmp_path, monkeypatch, capsys
):
    import papermill
    from nbclient.exceptions import CellTimeoutError

    from qlab import notebooks

    def too_slow(*args, **kwargs):
        raise CellTimeoutError("A cell timed out while it was being executed, after 5 seconds.")

    monkeypatch.setattr(papermill, "execute_notebook", too_slow)
    with pytest.raises(notebooks.NotebookError, match="stopped: CellTimeoutError: A cell timed out"):
        notebooks.run_notebook(tiny, smoke=True)


def test_a_wall_time_is_recorded_only_when_no_run_came_from_the_cache(tmp_path, monkeypatch, capsys):
    from qlab.runs import CACHE_ENV

    monkeypatch.setattr(paths, "ROOT", tmp_path)
    monkeypatch.setenv(CACHE_ENV, "1")
    cli._record_seconds("03_backward_override_training_curves", "cpu", 12.5)
    assert not (tmp_path / cli.NOTEBOOK_SECONDS).exists()
    assert "not recorded" in capsys.readouterr().out
    monkeypatch.setenv(CACHE_ENV, "0")
    cli._record_seconds("03_backward_override_training_curves", "cpu", 12.5)
    assert ",cpu,12.5," in (tmp_path / cli.NOTEBOOK_SECONDS).read_text()


def test_run_takes_the_profile_as_a_flag_or_as_a_parameter(monkeypatch):
    given = []

    def record(notebook, parameters, **kwargs):
        given.append(parameters)
        raise NotebookError("recorded")  # stop before anything runs

    monkeypatch.setattr(cli.notebooks, "run_notebook", record)
    monkeypatch.setattr(cli, "_stored_runs", lambda *args: 0)
    assert cli.main(["run", "05", "--profile", "paper"]) == 1
    assert cli.main(["run", "05", "-p", "profile", "paper"]) == 1
    assert cli.main(["run", "05", "--profile", "paper", "-p", "profile", "paper"]) == 1
    assert given == [{"profile": "paper"}] * 3


def test_a_run_talks_to_its_kernel_over_local_sockets_and_prints_no_network_warning(tiny, capfd):
    assert cli.main(["run", str(tiny), "--smoke"]) == 0
    err = capfd.readouterr().err
    # the kernel's warnings (a TCP port "without encryption"); fd 2 may also carry the late words of an
    # earlier test's kernel in this worker, interrupted at a cell's timeout ("KeyboardInterrupt caught")
    warnings = [line for line in err.splitlines() if "without encryption" in line or "] WARNING" in line]
    assert not warnings, err
    assert notebooks._local_kernel_manager()().transport == "ipc"


def test_qlab_help_imports_neither_torch_nor_nbformat():
    """``qlab --help`` answers at once: the parser is built without importing what commands need
    (torch takes seconds; nbformat's schema validator too)."""
    code = (
        "import sys\nfrom qlab import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'nbformat', 'qlab.plan') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_reader_that_stops_early_gets_no_traceback():
    """``qlab list | head -1``: the pipe closes after one line; qlab stops quietly."""
    command = f"{sys.executable} -m qlab.cli list | head -1"
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "00_formats_and_scaling"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_a_broken_pipe_that_is_not_stdout_s_is_an_error(monkeypatch):
    def broken(args):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(cli, "_cmd_list", broken)
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        cli.main(["list"])


def test_output_is_a_notebook_or_a_folder_and_a_missing_path_is_no_such_file(tmp_path, capsys):
    path = notebooks.resolve_notebook("02")
    assert notebooks.output_folder(path, {"smoke": True}, tmp_path) == (
        tmp_path / f"{path.stem}.ipynb",
        tmp_path,
    )
    assert notebooks.output_folder(path, {}, f"{tmp_path}/new/")[0] == tmp_path / "new" / f"{path.stem}.ipynb"
    assert cli.main(["run", "02", "--smoke", "--output", str(tmp_path / "out.txt")]) == 2
    assert "--output must name a .ipynb file or a folder, got" in capsys.readouterr().err
    assert cli.main(["campaign", "03", "--status", "--output", str(tmp_path / "out.txt")]) == 2
    assert "--output must name a .ipynb file or a folder, got" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^output must name a .ipynb file"):  # Python names its argument
        notebooks.output_folder(path, {}, tmp_path / "out.txt")
    assert cli.main(["run", str(tmp_path / "x.ipynb")]) == 2
    assert f"notebook '{tmp_path / 'x.ipynb'}': no such file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_interrupt_is_one_line_saying_what_is_kept(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["campaign", "03"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted; what finished is kept" in err
    assert cli.main(["train", "-p", "out_dir", "x"]) == 130  # the same command again would be refused
    assert "add -p resume true to continue it" in capsys.readouterr().err


def test_a_paper_campaign_on_a_machine_without_a_gpu_says_so(monkeypatch, capsys):
    import types

    from qlab import campaign

    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: types.SimpleNamespace(complete=False))
    assert cli.main(["campaign", "03", "--profile", "paper", "--runs", "1"]) == 0
    assert "the paper profile is sized for a GPU and this machine has none" in capsys.readouterr().err
    assert cli.main(["campaign", "03", "--runs", "1"]) == 0
    assert "sized for a GPU" not in capsys.readouterr().err


def test_a_path_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    argv = ["train", "-p", "task", "digits", "-p", "steps", "1", "-p", "out_dir", str(blocker / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qlab: error: ") and "Not a directory" in err and "Traceback" not in err


def test_advise_refuses_empty_formats_and_run_says_no_executor_was_given(capsys):
    assert cli.main(["advise", "--formats", ""]) == 2
    assert "--formats must name weight formats (e.g. nvfp4,mxfp8,bf16), got ''" in capsys.readouterr().err
    assert cli.main(["run", "02", "--address", "auto"]) == 2
    assert "--address needs --executor ray, and no executor was given" in capsys.readouterr().err


def test_an_extra_argument_gets_its_subcommand_s_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["list", "extra"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: qlab list") and "qlab list: error: unrecognized arguments: extra" in err


POOL_BODY = """import concurrent.futures, multiprocessing, os, pathlib, time
pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
futures = [pool.submit(time.sleep, 600) for _ in range(2)]
while len(multiprocessing.active_children()) < 2:
    time.sleep(0.05)
for process in [*multiprocessing.active_children(), multiprocessing.current_process()]:
    pathlib.Path(pid_dir, str(process.pid)).write_text("")
time.sleep(600)"""


def _pool_notebook(folder) -> Path:
    """A notebook whose kernel starts a pool of two sleeping workers and writes the kernel's and the
    workers' pids into its pid_dir parameter's folder."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "qlab", "display_name": "Python (qlab)", "language": "python"}
    params = nbformat.v4.new_code_cell(
        'pid_dir: str = ""  # where the kernel and its workers write pids\npoint: int = 0  # a sweep sets it'
    )
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(POOL_BODY)]
    nbformat.write(nb, folder / "99_pool.ipynb")
    return folder / "99_pool.ipynb"


def _stop_when_started(argv, pids: Path, count: int, stop: str) -> tuple[subprocess.Popen, str, list[int]]:
    """Start ``argv``; once ``count`` pids are in ``pids``, send ``stop``; (process, stderr, pids)."""
    import signal
    import time

    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while len(list(pids.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == count, f"{len(started)} of {count} processes started"
    process.send_signal(getattr(signal, stop))
    _, stderr = process.communicate(timeout=60)
    return process, stderr, started


def test_a_stopped_sweep_ends_the_kernels_its_workers_started(tmp_path):
    """``qlab sweep -j 2`` runs each point's notebook from a pool worker, whose kernel is not the main
    process's: SIGTERM must still end both points' kernels and their pools."""
    import shutil

    import run_helpers

    notebook = _pool_notebook(tmp_path)
    (tmp_path / "grid.yaml").write_text("point: [1, 2]\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [sys.executable, "-m", "qlab.cli", "sweep", str(notebook), str(tmp_path / "grid.yaml"), "-j", "2",
            "-p", "pid_dir", str(pids)]  # fmt: skip
    try:
        qlab, stderr, started = _stop_when_started(argv, pids, 6, "SIGTERM")
        assert qlab.returncode == 143, stderr
        assert not run_helpers.outliving(started)
    finally:
        shutil.rmtree(sweep.sweep_folder(notebook), ignore_errors=True)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_stopped_run_ends_its_kernel_and_the_kernels_pool_workers_in_one_line(tmp_path, stop):
    """``qlab run`` sent SIGTERM (a job scheduler, ``kill``) or SIGINT (Ctrl-C) while the notebook's
    pool works: it exits 143 / 130 with one line, and neither the kernel nor its workers outlive it
    (Python's default SIGTERM left both running; the kernel's shutdown printed socket tracebacks)."""
    import run_helpers

    notebook = _pool_notebook(tmp_path)
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [sys.executable, "-m", "qlab.cli", "run", str(notebook), "-p", "pid_dir", str(pids), "--output",
            str(tmp_path / "out.ipynb")]  # fmt: skip
    qlab, stderr, started = _stop_when_started(argv, pids, 3, stop)
    assert qlab.returncode == {"SIGTERM": 143, "SIGINT": 130}[stop]
    assert stderr.strip().startswith("qlab: ") and "\n" not in stderr.strip(), stderr  # no kernel tracebacks
    assert not run_helpers.outliving(started)


def test_a_notebook_without_a_kernelspec_runs_in_the_qlab_kernel(tiny, tmp_path, capsys):
    """A .ipynb made by ``jupytext --to ipynb`` has no kernelspec: papermill's own inspection refused it
    ("No kernel name found in notebook"); every notebook runs in the qlab kernel anyway."""
    nb = nbformat.read(tiny, as_version=4)
    del nb.metadata["kernelspec"]
    nbformat.write(nb, tiny)
    assert cli.main(["run", str(tiny), "-p", "a", "4"]) == 0
    assert "ok in" in capsys.readouterr().out
    folder = tmp_path / "runs" / "interactive" / "99_tiny" / "a=4"
    assert json.loads((folder / "data" / "tiny.json").read_text())["square"] == 16


def test_the_reports_smoke_sizes_are_the_notebooks():
    """``qlab report --smoke`` names the sizes the report notebook sets under smoke: the same numbers."""
    import re

    source = (paths.NOTEBOOKS_DIR / "report_your_model.py").read_text()
    names, values = re.search(r"if smoke:\n    ([\w, ]+) = ([\d, ]+)\n", source).groups()
    from_notebook = dict(zip(names.split(", "), map(int, values.split(", "))))
    assert from_notebook == {o[2:].replace("-", "_"): v for o, v in cli.REPORT_SMOKE_SIZES.items()}


def test_version_names_qlab_and_the_torch_it_runs_on(capsys):
    import importlib.metadata

    import qlab

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"qlab {qlab.__version__} (torch {importlib.metadata.version('torch')}, Python 3.")
