"""Parameter sweeps: the cartesian product of a YAML grid, one executed notebook per point.

Each point runs in ``runs/<notebook>/<point-slug>/`` (``runs/smoke/...`` for smoke sweeps) with its
own data/ and figures/ and, once it has finished, a ``metrics.json`` (parameters, seconds, and
every metric the notebook wrote through ``qlab.results.save_metrics``, into ``data/`` or its profile's
``data/<profile>/``). A point with a metrics.json for its parameters is complete and is skipped by
the next invocation; a failing point leaves ``error.txt`` instead and is retried next time. Nothing a
completed point wrote is ever deleted. ``smoke`` set by the grid or as a fixed parameter is the same
as ``smoke=True``: the points go to ``runs/smoke/<notebook>/``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from qlab import checks, paths
from qlab.notebooks import check_parameters, resolve_notebook, run_notebook
from qlab.paths import point_slug

METRICS_FILE = "metrics.json"
ERROR_FILE = "error.txt"


def load_grid(path: str | os.PathLike, argument: str = "path") -> dict[str, list]:
    """Read a grid: a YAML mapping of parameter name -> list of values (a scalar means one value).
    Errors name ``argument`` (what the caller typed: ``grid`` on the command line)."""
    path = paths.existing_file(argument, path, "grid file")
    where = f"{argument} {paths.shown(path)}"
    try:
        raw = checks.yaml_value(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"malformed YAML in {where}: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f"{where} must be a non-empty mapping of parameter name -> list of values, "
            f"got {type(raw).__name__}"
        )
    grid = {}
    for name, values in raw.items():
        if not isinstance(name, str):
            raise ValueError(f"{where}: parameter names must be strings, got {name!r}")
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ValueError(f"{where}: parameter {name!r} has an empty list of values")
        grid[name] = values
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    """The cartesian product, in the grid's key order (the last key varies fastest)."""
    if not isinstance(grid, dict) or not all(isinstance(v, (list, tuple)) for v in grid.values()):
        raise TypeError(f"grid must be a dict of name → list of values, got {checks.shown(grid)}")
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*grid.values())]


@dataclass(frozen=True)
class PointOutcome:
    slug: str
    status: str  # "ok", "skipped" (already complete) or "failed"
    detail: str = ""
    folder: str = ""  # the point's folder (a failed point's error.txt is there)


def _collected_metrics(data: Path) -> dict:
    """Every metric in the ``*.json`` files ``save_metrics`` wrote to the folder ``data`` (not the
    ``*_machine.json`` records), as one flat dict; a metric name two files give is kept from each, as
    ``<file stem>.<name>``."""
    per_file = {}
    for metrics_file in sorted(Path(data).glob("*.json")):
        if not metrics_file.name.endswith("_machine.json"):
            per_file[metrics_file.stem] = json.loads(metrics_file.read_text(encoding="utf-8"))
    names = [name for metrics in per_file.values() for name in metrics]
    collected = {}
    for stem, metrics in per_file.items():
        for name, value in metrics.items():
            collected[f"{stem}.{name}" if names.count(name) > 1 else name] = value
    return collected


def _failure_detail(message: str) -> str:
    """One line for a failed point: the message's first, and for a failed notebook cell the exception
    it raised (its ``  Name: text`` line; the cell's source lines are indented further)."""
    lines = message.splitlines() or [""]
    raised = next((line.strip() for line in lines[1:] if re.match(r"  [A-Za-z_][\w.]*: ", line)), "")
    return f"{lines[0]} {raised}".strip()


def _run_point(notebook: str, parameters: dict, directory: str, smoke: bool, timeout: int) -> PointOutcome:
    directory = Path(directory)
    start = time.perf_counter()
    profile = parameters.get("profile", "cpu")
    try:
        run_notebook(
            notebook,
            parameters,
            smoke=smoke,
            output=directory / f"{Path(notebook).stem}.ipynb",
            results_dir=directory,
            timeout=timeout,
        )
        collected = _collected_metrics(directory / "data" / ("" if profile == "cpu" else str(profile)))
    except Exception as err:  # reported at the end of the sweep; other points go on
        message = f"{type(err).__name__}: {err}"
        (directory / ERROR_FILE).write_text(message + "\n")
        return PointOutcome(directory.name, "failed", _failure_detail(message), str(directory))
    record = {
        "parameters": parameters,
        "smoke": smoke,
        "seconds": round(time.perf_counter() - start, 3),
        "metrics": collected,
    }
    with paths.written_atomically(directory / METRICS_FILE) as tmp:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    (directory / ERROR_FILE).unlink(missing_ok=True)
    return PointOutcome(directory.name, "ok", folder=str(directory))


def _check_completed(directory: Path, parameters: dict) -> None:
    """ValueError where ``directory`` holds a completed point whose parameters are not ``parameters``
    (a folder from another version's naming, or moved by hand): it is never taken for this point's."""
    record_path = directory / METRICS_FILE
    if not record_path.is_file():
        return
    try:
        stored = json.loads(record_path.read_text(encoding="utf-8"))["parameters"]
    except (ValueError, KeyError, TypeError) as err:
        where = paths.shown(record_path)
        raise ValueError(f"{where} is not a sweep point's record ({err}); move it away") from None
    expected = json.loads(json.dumps(parameters, sort_keys=True, default=str))
    if stored != expected:
        raise ValueError(
            f"{paths.shown(directory)} holds the completed point {stored}, not {expected}; move it away "
            "to run this point there"
        )


def sweep_folder(notebook: str | os.PathLike, smoke: bool = False) -> Path:
    """The folder holding a sweep's points: ``runs/<notebook>/``, or ``runs/smoke/<notebook>/`` for
    a smoke sweep; each point in a subfolder named by its parameters."""
    path = resolve_notebook(notebook)
    return (paths.RUNS_DIR / "smoke" if smoke else paths.RUNS_DIR) / path.stem


def run_sweep(
    notebook: str,
    grid_file: str | os.PathLike,
    *,
    parameters: dict | None = None,
    jobs: int | None = None,
    executor: str | None = None,
    address: str | None = None,
    smoke: bool = False,
    timeout: int = 1800,
    progress: bool = True,
) -> list[PointOutcome]:
    """Run every point of the grid not yet complete; return one outcome per point, in grid order.

    ``executor`` (``qlab.runs``): "serial", "processes" or "ray" (``address``: a running cluster's;
    its nodes must share this file system). None: serial unless ``jobs`` > 1, then ``jobs`` processes.
    ``jobs``: points at once; None: one for serial, else ``qlab.runs``' default (a worker per core, or
    the cluster's). ``parameters``: set at every point beside the grid's (a name in both is refused),
    and so named in every point's folder. Every parameter is checked against the notebook, and a
    folder holding another point's results is refused, before anything runs.
    """
    from qlab.runs import EXECUTORS, RunsFailed, check_address, run_many, task

    if jobs is not None:
        checks.integer("jobs", jobs, low=1)
    checks.integer("timeout", timeout, low=1)
    checks.boolean("smoke", smoke)
    checks.boolean("progress", progress)
    if executor is None:
        executor = "serial" if jobs in (None, 1) else "processes"
    checks.choice("executor", executor, EXECUTORS)
    if executor == "serial" and jobs is not None and jobs > 1:
        raise ValueError(
            f"jobs {jobs} runs points at once and executor 'serial' one at a time; give one of them"
        )
    if executor == "ray":
        address = check_address(address)
    elif address is not None:  # refused before any point's folder is made
        raise ValueError(
            f"address is for the ray executor, got executor {executor!r} and address {address!r}"
        )
    path = resolve_notebook(notebook)
    grid = load_grid(grid_file, argument="grid_file")
    fixed = {} if parameters is None else parameters
    if not isinstance(fixed, dict) or not all(isinstance(name, str) for name in fixed):
        raise TypeError(
            f"parameters must be a dict of parameter names to values, got {checks.shown(parameters)}"
        )
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ValueError(
            f"{', '.join(both)} set both by the grid {grid_file} and as a fixed parameter; set each once"
        )
    points = [check_parameters(path, {**params, **fixed}) for params in grid_points(grid)]
    slugs = [point_slug(p) for p in points]
    if len(set(slugs)) != len(slugs):
        repeated = sorted({s for s in slugs if slugs.count(s) > 1})
        raise ValueError(f"grid {grid_file} lists the same point more than once: {', '.join(repeated)}")
    if smoke and any(point.get("smoke", True) is not True for point in points):
        raise ValueError("smoke=True and a point's smoke false disagree; give smoke once")
    smoke_given = [point.get("smoke") is True for point in points]
    if any(smoke_given) and not all(smoke_given):
        raise ValueError(
            f"grid {grid_file} runs some points with smoke true and others without; a smoke sweep and a "
            "full one keep their points apart: run them as two sweeps"
        )
    if all(smoke_given):  # smoke given as a parameter is --smoke: the same folders, the same runs
        smoke = True
        points = [{name: value for name, value in point.items() if name != "smoke"} for point in points]
    root = sweep_folder(path, smoke)
    directories = [root / point_slug(params) for params in points]
    for params, directory in zip(points, directories):
        _check_completed(directory, params)
    outcomes, pending = [], []
    for params, directory in zip(points, directories):
        if (directory / METRICS_FILE).exists():
            outcomes.append(PointOutcome(directory.name, "skipped", folder=str(directory)))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            pending.append(task(_run_point, str(path), params, str(directory), smoke, timeout))
    try:  # metrics.json is a point's record of completion: no run cache besides it
        done = run_many(pending, executor=executor, max_workers=jobs, address=address, cache=False,
                        progress=progress, desc=f"sweep {path.stem}")  # fmt: skip
    except RunsFailed as failed:  # a worker died: its point failed, every finished one is kept
        reasons = {index: error.strip().splitlines()[-1] for index, _, error in failed.failures}
        done = [
            result
            or PointOutcome(Path(pending[i].args[2]).name, "failed", reasons.get(i, ""), pending[i].args[2])
            for i, result in enumerate(failed.results)
        ]
    outcomes += done
    order = {point_slug(p): i for i, p in enumerate(points)}
    return sorted(outcomes, key=lambda o: order[o.slug])
