"""Parameter sweeps: the cartesian product of a YAML grid, one executed notebook per point.

Each point runs in ``runs/<notebook>/<point-slug>/`` (``runs/smoke/...`` for smoke sweeps) with its
own data/ and figures/ and, once it has finished, a ``metrics.json`` (parameters, seconds, and
every ``data/*.json`` the notebook wrote through ``qlab.results.save_metrics``). A point with a
metrics.json is complete and is skipped by the next invocation; a failing point leaves
``error.txt`` instead and is retried next time. Nothing a completed point wrote is ever deleted.
"""

from __future__ import annotations

import itertools
import json
import os
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


def _run_point(notebook: str, parameters: dict, directory: str, smoke: bool, timeout: int) -> PointOutcome:
    directory = Path(directory)
    start = time.perf_counter()
    try:
        run_notebook(
            notebook,
            parameters,
            smoke=smoke,
            output=directory / f"{Path(notebook).stem}.ipynb",
            results_dir=directory,
            timeout=timeout,
        )
        collected = {}
        for metrics_file in sorted((directory / "data").glob("*.json")):
            collected.update(json.loads(metrics_file.read_text()))
    except Exception as err:  # reported at the end of the sweep; other points go on
        message = f"{type(err).__name__}: {err}"
        (directory / ERROR_FILE).write_text(message + "\n")
        return PointOutcome(directory.name, "failed", message.splitlines()[0])
    record = {
        "parameters": parameters,
        "smoke": smoke,
        "seconds": round(time.perf_counter() - start, 3),
        "metrics": collected,
    }
    with paths.written_atomically(directory / METRICS_FILE) as tmp:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    (directory / ERROR_FILE).unlink(missing_ok=True)
    return PointOutcome(directory.name, "ok")


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
    jobs: int = 1,
    executor: str | None = None,
    address: str | None = None,
    smoke: bool = False,
    timeout: int = 1800,
    progress: bool = True,
) -> list[PointOutcome]:
    """Run every point of the grid not yet complete; return one outcome per point, in grid order.

    ``executor`` (``qlab.runs``): "serial", "processes" or "ray" (``address``: a running cluster's;
    its nodes must share this file system). None: serial for ``jobs == 1``, else ``jobs`` processes.
    ``parameters``: set at every point beside the grid's (a name in both is refused), and so named in
    every point's folder. Every parameter name is checked against the notebook before anything runs.
    """
    from qlab.runs import EXECUTORS, RunsFailed, check_address, run_many, task

    checks.integer("jobs", jobs, low=1)
    checks.integer("timeout", timeout, low=1)
    if executor is None:
        executor = "serial" if jobs == 1 else "processes"
    checks.choice("executor", executor, EXECUTORS)
    if executor == "serial" and jobs > 1:
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
    root = sweep_folder(path, smoke)
    outcomes, pending = [], []
    for params in points:
        directory = root / point_slug(params)
        if (directory / METRICS_FILE).exists():
            outcomes.append(PointOutcome(directory.name, "skipped"))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            pending.append(task(_run_point, str(path), params, str(directory), smoke, timeout))
    workers = None if jobs == 1 and executor != "serial" else jobs
    try:
        done = run_many(pending, executor=executor, max_workers=workers, address=address,
                        progress=progress, desc=f"sweep {path.stem}")  # fmt: skip
    except RunsFailed as failed:  # a worker died: its point failed, every finished one is kept
        reasons = {index: error.strip().splitlines()[-1] for index, _, error in failed.failures}
        done = [
            result or PointOutcome(Path(pending[i].args[2]).name, "failed", reasons.get(i, ""))
            for i, result in enumerate(failed.results)
        ]
    outcomes += done
    order = {point_slug(p): i for i, p in enumerate(points)}
    return sorted(outcomes, key=lambda o: order[o.slug])
