"""The one module that knows where things live.

The repository root is found from this file (qlab is installed editable), so notebooks and
scripts behave the same from any working directory. Results (data/ and figures/) go under the
repository root unless ``QLAB_RESULTS_DIR`` points elsewhere: smoke runs, tests and sweep points
set it so they never overwrite the committed results.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from qlab import checks

RESULTS_ENV = "QLAB_RESULTS_DIR"
HEADLESS_ENV = "QLAB_HEADLESS"  # set by qlab.notebooks.run_notebook for the kernel: progress as text
PROFILE_ENV = "QLAB_PROFILE"  # "paper": results go to data/paper/ and figures/paper/


def _find_root() -> Path:
    override = os.environ.get("QLAB_ROOT")
    if override:
        return Path(override).resolve()
    package_parent = Path(__file__).resolve().parent.parent
    if (package_parent / "pyproject.toml").exists() and (package_parent / "notebooks").is_dir():
        return package_parent
    return Path.cwd().resolve()


ROOT = _find_root()
NOTEBOOKS_DIR = ROOT / "notebooks"
RUNS_DIR = ROOT / "runs"
KERNEL_CACHE_DIR = RUNS_DIR / "kernel_cache"  # qlab.kernels.cpu_qdq's shared library, built per machine


def results_root() -> Path:
    """Directory holding data/ and figures/: ``$QLAB_RESULTS_DIR`` if set, else the repo root."""
    override = os.environ.get(RESULTS_ENV)
    return Path(override).resolve() if override else ROOT


def _results_subdir(kind: str) -> Path:
    path = results_root() / kind
    profile = os.environ.get(PROFILE_ENV, "cpu")
    if profile != "cpu":  # a paper-scale run never mixes with the default (cpu) results
        path = path / profile
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """Where tidy CSV results go (created on demand): data/, or data/paper/ under the paper profile."""
    return _results_subdir("data")


def figures_dir() -> Path:
    """Where exported figures (PDF + PNG) go (created on demand): figures/, or figures/paper/."""
    return _results_subdir("figures")


def shown(path: Path) -> str:
    """``path`` as messages show it: relative to the repository root when inside it."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables for the duration (inherited by any process started meanwhile, such
    as papermill's kernel), then restore each to its previous value or absence."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def point_slug(parameters: dict) -> str:
    """A readable, filesystem-safe, deterministic directory name for a set of notebook parameters:
    ``a=1__b=x`` (a sweep point's folder, an interactive run's results folder)."""
    if not isinstance(parameters, dict):
        raise TypeError(f"parameters must be a dict of name -> value, got {checks.shown(parameters)}")
    text = "__".join(f"{name}={value}" for name, value in parameters.items())
    slug = re.sub(r"[^A-Za-z0-9._=+-]", "-", text)
    if len(slug) > 120:
        slug = slug[:100] + "--" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return slug
