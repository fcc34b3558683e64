"""What a notebook calls first: where its results go, which device it runs on, how it shows progress.

    run = session.start("02_welford_vs_naive_variance", globals())   # after the parameters cell
    device = run.device                                                # "auto" resolved: "cuda" or "cpu"
    for point in session.progress(points, desc="κ sweep"): ...

Where results go (``start`` prints it):

- run by ``qlab run``/``qlab figures``/a sweep/the tests: wherever the runner said
  (``QLAB_RESULTS_DIR``, which ``qlab.notebooks.run_notebook`` always sets for the kernel);
- run interactively (JupyterLab) with the parameters cell's committed defaults: ``data/`` and
  ``figures/``, the committed results, which the same parameters reproduce byte for byte;
- run interactively with any other value (``smoke = True`` included):
  ``runs/interactive/<notebook>/<changed parameters>/data|figures``, so an experiment never
  overwrites the committed results.

A training notebook's ``profile`` parameter ("cpu", the default, or "paper": paper-scale sizes for
a GPU) adds a ``paper/`` level under data/ and figures/ (``data/paper/`` with default parameters
otherwise), and a ``<notebook>_machine.json`` there naming the device the results came from.

The defaults are read from the notebook's paired ``notebooks/<name>.py`` (the source of truth), not
from the cell as edited in the browser.
"""

from __future__ import annotations

import ast
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from qlab import checks, paths

PROFILES = ("cpu", "paper")
HEADLESS_ENV = paths.HEADLESS_ENV  # set by qlab.notebooks.run_notebook for the kernel: progress as text
INTERACTIVE_DIR = "interactive"


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when torch sees a GPU, else the CPU; otherwise the named device, checked."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise TypeError(f"name must be a device: 'auto', 'cpu', 'cuda' or 'cuda:N', got {checks.shown(name)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"unknown device name={name!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA device")
    return device


def parameters_source(name: str) -> str | None:
    """The source of the cell tagged ``parameters`` in ``notebooks/<name>.py`` (the committed
    defaults), as jupytext reads it; None if there is no such file or cell."""
    import jupytext

    source = paths.NOTEBOOKS_DIR / f"{name}.py"
    if not source.is_file():
        return None
    return next(
        (c.source for c in jupytext.read(source).cells if "parameters" in c.metadata.get("tags", [])), None
    )


def notebook_defaults(name: str) -> dict:
    """The parameters cell of ``notebooks/<name>.py`` as {name: default value} (literals only)."""
    cell = parameters_source(name)
    if cell is None:
        raise ValueError(f"name must be a notebook under notebooks/ with a parameters cell, got {name!r}")
    defaults = {}
    for statement in ast.parse(cell).body:
        target = statement.target if isinstance(statement, ast.AnnAssign) else statement.targets[0]
        defaults[target.id] = ast.literal_eval(statement.value)
    return defaults


def _same(value, default) -> bool:
    """Equal as parameter values: 1e7 equals 10000000, True does not equal 1, NaN equals NaN."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default or (math.isnan(value) and math.isnan(default))
    return value == default


@dataclass(frozen=True)
class NotebookRun:
    """What ``start`` decided: the notebook, its parameter values, those that differ from the
    committed defaults, where results go, and the resolved device name."""

    name: str
    parameters: dict
    changed: dict
    results_dir: Path
    device: str


_INHERITED_RESULTS = os.environ.get(paths.RESULTS_ENV)  # what the runner set when it started the kernel


def start(name: str, namespace: dict) -> NotebookRun:
    """Decide (and print) where this run of notebook ``name`` writes its results; resolve its device.

    ``namespace`` is the notebook's ``globals()``, holding the parameters cell's values (papermill's
    injected ones included). Sets ``QLAB_RESULTS_DIR`` for this process, which ``save_csv``,
    ``save_metrics`` and ``save_figure`` read; calling it again after editing a parameter re-decides.
    """
    if not isinstance(namespace, dict):
        raise TypeError(f"namespace must be the notebook's globals(), got {checks.shown(namespace)}")
    defaults = notebook_defaults(name)
    current = {key: namespace[key] for key in defaults if key in namespace}
    profile = checks.choice("profile", current.get("profile", "cpu"), PROFILES)
    changed = {
        key: value for key, value in current.items() if key != "profile" and not _same(value, defaults[key])
    }
    if _INHERITED_RESULTS is not None:
        results_dir, why = Path(_INHERITED_RESULTS), "chosen by the runner"
    elif not changed:
        results_dir, why = paths.ROOT, "default parameters: the committed results"
        os.environ.pop(paths.RESULTS_ENV, None)
    else:
        results_dir = paths.RUNS_DIR / INTERACTIVE_DIR / name / paths.point_slug(changed)
        os.environ[paths.RESULTS_ENV] = str(results_dir)
        why = "parameters differ from the defaults; data/ and figures/ stay untouched"
    if profile == "cpu":
        os.environ.pop(paths.PROFILE_ENV, None)
    else:
        os.environ[paths.PROFILE_ENV] = profile
    device = str(resolve_device(current.get("device", "auto")))
    shown = results_dir.relative_to(paths.ROOT) if results_dir.is_relative_to(paths.ROOT) else results_dir
    where = "data/ and figures/" if results_dir == paths.ROOT else f"{shown}/data and {shown}/figures"
    if profile != "cpu":
        where = where.replace("data", f"data/{profile}").replace("figures", f"figures/{profile}")
        record = {"notebook": name, "profile": profile, "machine": machine(torch.device(device))}
        record["torch"], record["cuda"] = torch.__version__, torch.version.cuda
        text = json.dumps(record, indent=1, sort_keys=True) + "\n"
        (paths.data_dir() / f"{name}_machine.json").write_text(text)
    print(f"{name}: results go to {where} ({why}); device {device}")
    return NotebookRun(name, current, changed, results_dir, device)


def machine(device: torch.device | None = None) -> str:
    """One line naming the machine results come from: the GPU's name, or the CPU, its cores and threads."""
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (
        f"{_cpu_name()} ({os.cpu_count()} cores), "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def headless() -> bool:
    """Whether a runner without a browser (papermill through qlab) executes this process."""
    return os.environ.get(HEADLESS_ENV) == "1"


def progress(iterable=None, **options):
    """A tqdm progress bar: a widget in JupyterLab, text under papermill and in a terminal
    (``options`` go to tqdm: desc, total, leave, disable, ...)."""
    if not headless():
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
                import ipywidgets  # noqa: F401  (tqdm.notebook needs it)
                from tqdm.notebook import tqdm

                return tqdm(iterable, **options)
        except ImportError:
            pass
    from tqdm import tqdm

    options.setdefault("mininterval", 5.0 if headless() else 0.1)
    return tqdm(iterable, **options)
