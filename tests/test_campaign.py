"""qlab.campaign: run lists finished over many invocations, each run stored as plain files.

References: the in-memory result of ``qlab.train.train`` (a stored run must read back bit for bit), a
sha256 computed here of the JSON text the key is documented to hash, and one uninterrupted notebook run
(a campaign split over three invocations with a SIGKILL must give the same bytes)."""

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pandas as pd
import pytest

from qlab import campaign, cli, notebooks, paths, run_lists, session
from qlab.train import TrainConfig, train

try:
    import ray
except ImportError:
    ray = None

TINY = TrainConfig(
    steps=4, layers=1, width=32, context=32, batch_size=8, eval_every=2, eval_batches=1, fidelity_every=2,
    warmup_steps=2, progress=False,
)  # fmt: skip
NOTEBOOK_03 = "03_backward_override_training_curves"


def _tiny_list(*configs) -> run_lists.RunList:
    return run_lists.RunList("tiny", {}, [{"seed": c.seed} for c in configs], list(configs))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One tiny nvfp4 run trained in memory and the same run written to a store and read back."""
    config = TINY.replace(recipe="nvfp4")
    fresh = train(config)
    # stored as this machine's pool workers would store it, whatever threads this test process has
    record = {
        **campaign.train_for_store(config),
        "device_kind": campaign.planned_kind(_tiny_list(config), "processes"),
    }
    store = tmp_path_factory.mktemp("store")
    folder = campaign.write_run(store, config, record)
    return config, fresh, store, folder


def test_a_stored_run_reads_back_bit_for_bit(stored):
    config, fresh, store, folder = stored
    run = campaign.read_run(folder)
    pd.testing.assert_frame_equal(run.metrics, fresh.metrics.drop(columns="time_s"), check_exact=True)
    pd.testing.assert_frame_equal(run.fidelity, fresh.fidelity, check_exact=True, check_dtype=False)
    assert run.parameters == sum(p.numel() for p in fresh.model.parameters() if p.requires_grad)
    assert campaign.config_key(run.config) == campaign.config_key(config)
    assert sorted(p.name for p in folder.iterdir()) == ["fidelity.csv", "metrics.csv", "run.json"]
    description = json.loads((folder / "run.json").read_text())
    assert (
        description["sha256"]["metrics.csv"]
        == hashlib.sha256((folder / "metrics.csv").read_bytes()).hexdigest()
    )


def test_the_key_hashes_the_documented_content(stored):
    config, _, _, folder = stored
    kind = json.loads((folder / "run.json").read_text())["device_kind"]
    fields = {k: v for k, v in vars(config).items() if k not in ("device", "progress")}
    text = json.dumps({"config": fields, "device_kind": kind, "numerics": campaign.NUMERICS_VERSION},
                      sort_keys=True, separators=(",", ":"))  # fmt: skip
    assert folder.name == hashlib.sha256(text.encode()).hexdigest()[:20]
    assert kind.endswith("torch threads")  # a CPU run: its thread count is part of its kind


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 1},
        {"lr": 0.0031},
        {"recipe": "mxfp8"},
        {"ablate": ["stochastic_rounding"]},
        {"keep_high_precision": []},
    ],
)
def test_every_keyed_field_changes_the_key_and_device_and_progress_do_not(change):
    base = TINY.replace(recipe="nvfp4")
    assert campaign.config_key(base.replace(**change)) != campaign.config_key(base)
    assert campaign.config_key(base.replace(progress=True)) == campaign.config_key(base)
    assert campaign.run_key(base, "GPU A") != campaign.run_key(base, "GPU B")


def test_another_numerics_version_retires_every_stored_run(stored, monkeypatch):
    config, _, store, _ = stored
    assert campaign.progress(_tiny_list(config), store).complete
    monkeypatch.setattr(campaign, "NUMERICS_VERSION", "0-test")
    state = campaign.progress(_tiny_list(config), store)
    assert state.done == 0 and state.retired == 1


def _edit_run_json(folder: Path, **fields) -> None:
    description = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**description, **fields}))


def _copy_store(stored, tmp_path) -> tuple[Path, Path]:
    _, _, store, folder = stored
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return copy, copy / folder.name


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "run.json").write_text("{not json"), "run.json is corrupt"),
        (lambda f: (f / "run.json").unlink(), "run.json is missing"),
        (lambda f: (f / "metrics.csv").write_text("step\n1\n"), "metrics.csv is missing or does not match"),
        (lambda f: (f / "fidelity.csv").unlink(), "fidelity.csv is missing or does not match"),
        (lambda f: f.rename(f.with_name("0" * 20)), "hashes to .*, not to its folder's name"),
        (
            lambda f: (f / "run.json").write_text(
                (f / "run.json").read_text().replace('"steps": 4', '"steps": 5')
            ),
            "hashes to .*, not to its folder's name",
        ),
        (lambda f: _edit_run_json(f, task_seconds="abc"), "run.json is corrupt.*task_seconds"),
        (lambda f: _edit_run_json(f, task_seconds=0), "run.json is corrupt.*task_seconds"),
        (lambda f: _edit_run_json(f, seconds=-5), "run.json is corrupt.*seconds"),
        (lambda f: _edit_run_json(f, device_kind=5), "run.json is corrupt.*device_kind"),
        (lambda f: _edit_run_json(f, runs_at_once=0), "run.json is corrupt.*runs_at_once"),
        (
            lambda f: (f / "run.json").write_text(
                re.sub(r'"task_seconds": [0-9.]+', '"task_seconds": NaN', (f / "run.json").read_text())
            ),
            "run.json is corrupt.*NaN is not a number JSON allows",
        ),
    ],
    ids=["garbled json", "no json", "edited csv", "missing csv", "renamed folder", "edited config",
         "text time", "zero time", "negative time", "number kind", "zero at once", "NaN time"],
)  # fmt: skip
def test_a_damaged_stored_run_is_refused_with_its_path_before_anything_runs(
    stored, tmp_path, monkeypatch, damage, message
):
    config = stored[0]
    store, folder = _copy_store(stored, tmp_path)
    damage(folder)
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(campaign.StoreError, match=message) as caught:
        campaign.results(_tiny_list(config, config.replace(seed=7)), store=store)
    assert str(tmp_path / "store") in str(caught.value)
    with pytest.raises(campaign.StoreError, match=message):
        campaign.run_campaign(_tiny_list(config), store=store, say=lambda line: None)


def test_runs_from_two_device_kinds_are_refused_unless_allowed(stored, tmp_path, monkeypatch):
    config = stored[0]
    store = tmp_path / "store"
    record = campaign.train_for_store(config)
    other = config.replace(seed=1)
    campaign.write_run(store, config, {**record, "device_kind": "GPU A"})
    campaign.write_run(store, other, {**record, "device_kind": "GPU B"})
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    both = _tiny_list(config, other)
    with pytest.raises(
        ValueError, match=r"come from 2 device kinds \(1 from GPU A; 1 from GPU B\).*allow_mixed"
    ):
        campaign.results(both, store=store)
    runs = campaign.results(both, store=store, allow_mixed_devices=True)
    assert [run.device_kind for run in runs] == ["GPU A", "GPU B"]
    campaign.write_run(store, other, {**record, "device_kind": "GPU A"})  # the same run from GPU A too
    assert [run.device_kind for run in campaign.results(both, store=store)] == ["GPU A", "GPU A"]


@pytest.mark.parametrize(
    "text, seconds", [("90s", 90), ("12m", 720), ("1.5h", 5400), ("45", 45), (" 2m ", 120), (".5m", 30),
                      ("+2s", 2), ("1e3", 1000), ("1.5e1m", 900)]
)  # fmt: skip
def test_budgets_parse_to_seconds(text, seconds):
    assert campaign.parse_budget(text) == seconds


@pytest.mark.parametrize(
    "text, error", [("0m", ValueError), ("-1m", ValueError), ("-0", ValueError), (".", ValueError),
                    ("soon", ValueError), ("", ValueError),
                    ("12 minutes", ValueError), ("1e400", ValueError), (True, TypeError), (None, TypeError),
                    (30, TypeError)]
)  # fmt: skip
def test_bad_budgets_are_refused(text, error):
    with pytest.raises(error, match="budget must be"):
        campaign.parse_budget(text)


def test_a_budget_that_one_run_does_not_fit_starts_nothing(stored, tmp_path, monkeypatch):
    config = stored[0]
    store, _ = _copy_store(stored, tmp_path)
    said = []
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    slow = json.loads((next(store.iterdir()) / "run.json").read_text())["seconds"]
    state = campaign.run_campaign(
        _tiny_list(config, config.replace(seed=3)), budget_s=slow / 2, store=store, say=said.append
    )
    assert state.done == 1 and state.missing == [1]
    assert any("no new run started" in line for line in said), said


def test_max_runs_runs_that_many_and_status_counts_them(stored, tmp_path):
    config = stored[0]
    store, _ = _copy_store(stored, tmp_path)
    listed = _tiny_list(*(config.replace(seed=s) for s in range(4)))
    state = campaign.run_campaign(listed, max_runs=2, executor="serial", store=store, say=lambda line: None)
    assert state.done == 3 and len(state.missing) == 1
    text = campaign.status(listed, store)
    assert "3 of 4 runs stored" in text and "1 runs left" in text


NB03 = "03_backward_override_training_curves"


@pytest.mark.parametrize(
    "parameters, profile, output, command, store",
    [
        ({}, "cpu", None, "qlab run 03", "data/runs"),
        ({}, "paper", None, "qlab run 03 --profile paper", "data/paper/runs"),
        ({"smoke": True}, "cpu", None, "qlab run 03 --smoke", "runs/smoke/data/runs"),
        (
            {"smoke": True, "seeds": 3, "executor": "serial"},
            "cpu",
            None,
            "qlab run 03 --smoke -p seeds 3 -p executor serial",
            f"runs/interactive/{NB03}/smoke=True__seeds=3__executor=serial/data/runs",
        ),
        (
            {"recipes": ["nvfp4", "mxfp8"]},
            "cpu",
            None,
            "qlab run 03 -p recipes '[nvfp4, mxfp8]'",
            # paths.point_slug: the characters replaced, a hash of the values follows
            f"runs/interactive/{NB03}/recipes=--nvfp4----mxfp8----f42294c1d0ba/data/runs",
        ),
        (
            {"smoke": True},
            "cpu",
            "my runs/03.ipynb",
            "qlab run 03 --smoke --output 'my runs/03.ipynb'",
            "my runs/data/runs",  # a chosen copy keeps a smoke run's results beside it
        ),
        (  # a chosen copy of a run with changed parameters: the kernel's session picks runs/interactive/
            {"seeds": 3},
            "paper",
            "x/03.ipynb",
            "qlab run 03 --profile paper -p seeds 3 --output x/03.ipynb",
            f"runs/interactive/{NB03}/seeds=3/data/paper/runs",
        ),
    ],
)
def test_a_complete_campaign_names_the_run_that_reads_its_store(
    parameters, profile, output, command, store, monkeypatch, tmp_path
):
    """The command said on completion is what `qlab run` needs to read the same store: each parameter
    that moves the store or the results folder (smoke, seeds, recipes, executor, the profile, the
    executed copy). The stores are those the results-folder rule of the running page names."""
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    listed, found = cli.campaign_list("03", parameters, profile, None if output is None else Path(output))
    root = paths.ROOT if store.startswith("data/") else tmp_path
    assert Path(found).absolute() == (root / store).absolute()
    assert campaign.render_command(listed, output) == command
    import shlex

    words = shlex.split(command)[3:]
    given = {"smoke": True} if "--smoke" in words else {}
    given.update({words[i + 1]: cli._parse_value(words[i + 2]) for i, w in enumerate(words) if w == "-p"})
    rendered_profile = words[words.index("--profile") + 1] if "--profile" in words else "cpu"
    again = cli.campaign_list("03", given, rendered_profile, None if output is None else Path(output))[1]
    assert again == found


def test_campaign_refuses_bad_input_before_any_run(monkeypatch, capsys):
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    cases = [
        (["campaign", "99", "--runs", "1"], "unknown notebook '99'"),
        (["campaign", "02", "--runs", "1"], "has no run list"),
        (["campaign", "03", "--budget", "0s"], "budget must be more than 0"),
        (["campaign", "03", "--budget", "later"], "budget must be a duration"),
        (
            ["campaign", "03", "--budget", "-5m"],
            "budget must be more than 0",
        ),  # not argparse's "expected one"
        (["campaign", "03", "--budget", "-.5"], "budget must be more than 0"),
        (["campaign", "03", "--runs", "0"], "--runs must be at least 1"),
        (
            ["campaign", "03", "--runs-per-gpu", "0", "--runs", "1"],
            "--runs-per-gpu must be an int ≥ 1, got 0",
        ),
        (["campaign", "03", "-j", "0", "--runs", "1"], "-j must be an int ≥ 1, got 0"),
        (
            ["campaign", "03", "--smoke", "-p", "smoke", "false", "--status"],
            "--smoke and -p smoke false disagree",
        ),
        (["campaign", "03", "-p", "seeds", "0", "--runs", "1"], "seeds"),
        (["campaign", "03", "-p", "colour", "red", "--status"], "colour"),
        (["campaign", "03", "--address", "auto", "--status"], "--address needs --executor ray"),
        (["campaign", "03", "-p", "executor", "serial", "--status"], "--executor serial, not -p executor"),
        (["campaign", "03", "-p", "max_workers", "3", "-j", "2", "--status"], "-j 3, not -p max_workers"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        cli.main(["campaign", "03", "--profile", "gpu"])


def test_figures_at_a_profile_renders_no_notebook_whose_campaign_is_incomplete(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    monkeypatch.setattr(
        notebooks,
        "run_notebook",
        lambda path, *a, **k: calls.append(path.stem) or types.SimpleNamespace(seconds=1),
    )
    monkeypatch.setattr(cli, "_record_seconds", lambda *row: None)
    assert cli.main(["figures", "--profile", "paper"]) == 0
    out = capsys.readouterr().out
    for name in run_lists.RUN_LISTS:
        assert name not in calls
        assert f"{name}: 0 of " in out and f"qlab campaign {name[:2]} --profile paper" in out
    assert calls and all(name not in run_lists.RUN_LISTS for name in calls)


def _outputs(folder: Path) -> dict[str, bytes]:
    """Every CSV, claims file and figure a notebook wrote, but the wall-clock ones (*_timing)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for kind in ("data", "figures")
        for p in sorted((folder / kind).glob("*"))
        if p.is_file() and not p.stem.endswith("_timing")
    }


def _campaign(output: Path, *arguments: str, **popen) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "qlab.cli",
        "campaign",
        "03",
        "--smoke",
        "--output",
        str(output),
        *arguments,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


@pytest.mark.slow
@pytest.mark.notebook
def test_a_campaign_split_over_three_invocations_and_a_sigkill_renders_one_runs_bytes(tmp_path, smoke_run):
    """Notebook 03 at smoke sizes: trained in one go (the shared smoke run, its runs fanned out over
    worker processes), and campaigned over three invocations (the second SIGKILLed, every process of it,
    once it has stored a run) then rendered from the store. Its CSVs, claims and figures must be the
    uninterrupted run's bytes; the rendered text (*_claims.md) names the parameters that differ (the
    executor), so it is left out as in the notebooks' determinism test."""
    whole, split = smoke_run(NOTEBOOK_03), tmp_path / "split"
    store = split / "data" / "runs"

    first = _campaign(split / "03.ipynb", "--runs", "3", "--executor", "serial")
    assert first.wait(timeout=600) == 0, first.stdout.read()
    assert len(list(store.iterdir())) == 3
    assert not (split / "data" / f"{NOTEBOOK_03}_claims.csv").exists()  # a partial campaign: no claims

    second = _campaign(split / "03.ipynb", "--executor", "serial", start_new_session=True)
    deadline = time.monotonic() + 300
    while len([p for p in store.iterdir() if not p.name.startswith(".")]) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(timeout=60)
    stored_after_kill = len([p for p in store.iterdir() if not p.name.startswith(".")])
    assert 4 <= stored_after_kill < 12, "the kill came after the list finished: it tested nothing"

    third = _campaign(split / "03.ipynb", "--budget", "10m")
    output = third.communicate(timeout=600)[0]
    assert third.returncode == 0, output
    assert "12 of 12 runs stored" in output
    assert f"complete: `qlab run 03 --smoke --output {split / '03.ipynb'}`" in output  # the render below

    rendered = notebooks.run_notebook(NOTEBOOK_03, smoke=True, output=split / "03.ipynb")
    executed = rendered.output.read_text()
    assert "12 of 12 runs read from" in executed
    assert _outputs(whole).keys() == _outputs(split).keys()
    differing = [
        name
        for name, data in _outputs(whole).items()
        if not name.endswith("_claims.md") and _outputs(split)[name] != data
    ]
    assert not differing, differing


def _kill_the_running_ray_task_once(store: Path, stored: int, killed: list) -> threading.Thread:
    """Once ``stored`` runs are in the store, SIGKILL the Ray worker still running a task (its process
    title is ray::_execute_reporting while it runs one)."""

    def kill():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            if store.is_dir() and len([p for p in store.iterdir() if not p.name.startswith(".")]) >= stored:
                for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                    try:
                        running = cmdline.read_bytes().startswith(b"ray::_execute_reporting")
                    except OSError:
                        continue
                    if running:
                        os.kill(int(cmdline.parent.name), signal.SIGKILL)
                        killed.append(int(cmdline.parent.name))
                        return
            time.sleep(0.05)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time on this machine
@pytest.mark.skipif(
    ray is None or not Path("/proc/self/cmdline").exists(), reason="needs ray and Linux's /proc"
)
def test_a_campaign_on_ray_stores_runs_on_the_driver_as_they_finish_and_retries_a_killed_one(tmp_path):
    pythonpath = os.pathsep.join(p for p in sys.path if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})  # fmt: skip
    try:
        quick = [TINY.replace(recipe="nvfp4", seed=s) for s in (0, 1)]
        slow = TINY.replace(steps=600, eval_every=600, fidelity_every=0, seed=2)  # about 8 s
        listed, store, said, killed = _tiny_list(*quick, slow), tmp_path / "runs", [], []
        killer = _kill_the_running_ray_task_once(store, 2, killed)  # the two quick runs are stored meanwhile
        state = campaign.run_campaign(listed, executor="ray", store=store, say=said.append)
        killer.join()
        assert killed, "no Ray worker was running the slow run"
        assert state.done == 2 and state.missing == [2]
        assert any("1 runs failed; the next invocation tries them again" in line for line in said), said
        state = campaign.run_campaign(
            listed, executor="ray", store=store, say=said.append
        )  # the next invocation
        assert state.complete and len(state.kinds) == 1
        assert said[-1].startswith(f"tiny: 3 of 3 runs stored in {store} (3 from ")
    finally:
        ray.shutdown()


def test_runs_of_another_device_kind_are_refused_before_any_run_starts(stored, tmp_path, monkeypatch):
    config = stored[0]
    store = tmp_path / "store"
    campaign.write_run(store, config, {**campaign.train_for_store(config), "device_kind": "GPU A"})
    listed = _tiny_list(config, config.replace(seed=5))
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    for call in (campaign.results, lambda *a, **k: campaign.run_campaign(*a, say=lambda line: None, **k)):
        with pytest.raises(
            ValueError, match=r"another device kind \(1 from GPU A\).*1 missing runs would run"
        ):
            call(listed, store=store)


def test_a_budget_runs_one_round_at_a_time_timed_by_this_machine_s_kind_only(stored, tmp_path, monkeypatch):
    # stored times of another kind (a GPU's 0.001 s) say nothing of this machine's: the first wave is
    # one run per worker, and every budgeted wave after it one round, checked against its own time
    config = stored[0]
    store = tmp_path / "store"
    record = campaign.train_for_store(config)
    campaign.write_run(
        store, config, {**record, "device_kind": "GPU A", "seconds": 0.001, "task_seconds": 0.001}
    )
    waves = []
    monkeypatch.setattr(campaign, "_train", lambda run_list, indices, *a, **k: waves.append(list(indices)))
    monkeypatch.setattr(campaign, "progress", _progress_after(campaign.progress, waves))
    listed = _tiny_list(*(config.replace(seed=s) for s in range(9)))
    said = []
    campaign.run_campaign(listed, budget_s=3600, executor="processes", max_workers=2, store=store,
                          allow_mixed_devices=True, say=said.append)  # fmt: skip
    assert [len(wave) for wave in waves] == [2, 2, 2, 2]  # 8 missing, 2 workers
    assert "no run of this list timed yet: starting 2 (one per worker)" in said[1]


def _progress_after(progress, waves):
    """``campaign.progress`` that counts the runs of ``waves`` (recorded by a stand-in _train) as stored."""

    def counted(run_list, store=None):
        state = progress(run_list, store)
        done = {i for wave in waves for i in wave}
        chosen = [
            folder if folder is not None or i not in done else Path("x")
            for i, folder in enumerate(state.chosen)
        ]
        return dataclasses.replace(state, chosen=chosen)

    return counted


def test_a_second_campaign_on_a_store_is_refused_and_a_killed_writer_s_temporaries_go(stored, tmp_path):
    config = stored[0]
    store, copy = _copy_store(stored, tmp_path)
    stale = store / f".{copy.name}.999999999.tmp"  # no such pid
    stale.mkdir()
    (store / "old_runs").mkdir()  # not a run folder: not the store's business
    listed = _tiny_list(config, config.replace(seed=2))
    with campaign._store_lock(store):
        with pytest.raises(ValueError, match="another campaign is running on .*store"):
            campaign.run_campaign(listed, store=store, say=lambda line: None)
        assert not stale.exists()
    state = campaign.run_campaign(listed, executor="serial", store=store, say=lambda line: None)
    assert state.complete
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(".")) == []  # the lock went too


def test_an_unwritable_store_is_refused_before_any_run(stored, tmp_path, monkeypatch):
    config = stored[0]
    store = tmp_path / "file"
    store.write_text("")
    monkeypatch.setattr(campaign, "_train", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ValueError, match="cannot be written"):
        campaign.run_campaign(_tiny_list(config), store=store / "runs", say=lambda line: None)


def test_a_run_stored_by_another_process_in_between_is_kept(stored, tmp_path, monkeypatch):
    # two writers of one run: the second rename meets the first's folder (ENOTEMPTY) and keeps it
    config, _, _, folder = stored
    store, copy = _copy_store(stored, tmp_path)
    record = {**campaign.train_for_store(config), "device_kind": campaign.read_run(copy).device_kind}
    rename = os.rename

    def racing(source, target):
        if str(target).endswith(".old"):
            return None  # the other writer's folder appears at once: nothing moved aside
        if Path(target) == copy and Path(source).name.endswith(".tmp"):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(target))
        return rename(source, target)

    monkeypatch.setattr(campaign.os, "rename", racing)
    assert campaign.write_run(store, config, record) == copy
    assert sorted(p.name for p in store.iterdir()) == [copy.name]


def test_status_divides_by_the_runs_at_once_the_stored_runs_ran_beside(stored, tmp_path):
    config = stored[0]
    store = tmp_path / "store"
    record = {**campaign.train_for_store(config), "device_kind": "GPU A", "task_seconds": 600.0}
    campaign.write_run(store, config, {**record, "runs_at_once": 8})
    listed = _tiny_list(*(config.replace(seed=s) for s in range(17)))
    text = campaign.status(listed, store, workers=2)  # asked from a 2-worker machine
    assert "16 runs left: 2.67 run-hours at the measured rate ÷ 8 at once as stored = 0.33 h" in text


def test_serial_and_processes_store_the_same_device_kind(tmp_path):
    listed = _tiny_list(TINY.replace(seed=0), TINY.replace(seed=1))
    campaign.run_campaign(listed, max_runs=1, executor="serial", store=tmp_path, say=lambda line: None)
    state = campaign.run_campaign(
        listed, executor="processes", max_workers=2, store=tmp_path, say=lambda line: None
    )
    assert state.complete and list(state.kinds) == [campaign.planned_kind(listed, "processes", 2)]


def test_a_stored_run_written_again_is_replaced_whole(stored, tmp_path):
    config, _, _, folder = stored
    store, copy = _copy_store(stored, tmp_path)
    record = {**campaign.train_for_store(config), "device_kind": campaign.read_run(copy).device_kind}
    assert campaign.write_run(store, config, record) == copy
    assert campaign.read_run(copy).metrics.equals(campaign.read_run(folder).metrics)
    assert sorted(p.name for p in store.iterdir()) == [copy.name]  # nothing left aside


def test_the_store_is_shared_by_parameters_that_change_no_run(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    defaults = {**session.notebook_defaults(NOTEBOOK_03)}
    committed = campaign.store_dir(run_lists.run_list(NOTEBOOK_03, defaults, "cpu"))
    assert committed == paths.ROOT / "data" / "runs"
    neutral = {**defaults, "executor": "serial", "max_workers": 2, "allow_mixed_devices": True}
    assert campaign.store_dir(run_lists.run_list(NOTEBOOK_03, neutral, "cpu")) == committed
    paper = {**defaults, "profile": "paper", "executor": "ray"}
    assert (
        campaign.store_dir(run_lists.run_list(NOTEBOOK_03, paper, "cpu"))
        == paths.ROOT / "data" / "paper" / "runs"
    )
    other = {**defaults, "seeds": 3}  # other runs: the results folder's own store
    assert (
        campaign.store_dir(run_lists.run_list(NOTEBOOK_03, other, "cpu"))
        == tmp_path.resolve() / "data" / "runs"
    )


def test_the_paper_profile_refuses_a_size_it_sets_itself():
    values = {**session.notebook_defaults(NOTEBOOK_03), "profile": "paper", "steps": 500}
    with pytest.raises(ValueError, match="profile 'paper' sets steps itself"):
        run_lists.run_list(NOTEBOOK_03, values, "cpu")
    assert cli.main(["campaign", "03", "-p", "profile", "paper", "--status"]) == 2
