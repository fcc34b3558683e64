"""The one module that knows where things live.

The repository root is the qlab checkout you stand in: the nearest folder at or above the current
directory whose ``pyproject.toml`` names qlab and which holds ``notebooks/``. Outside any checkout it is
the checkout qlab is installed from (editable), and the ``qlab`` command says so in one line;
``QLAB_ROOT`` wins over both. Two clones sharing one environment each write into their own.
Results (data/ and figures/) go under the repository root unless ``QLAB_RESULTS_DIR`` points
elsewhere: smoke runs, tests and sweep points set it so they never overwrite the committed results.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from qlab import checks

RESULTS_ENV = "QLAB_RESULTS_DIR"
LAB_ENV = "QLAB_LAB"  # set by qlab lab for the server and its kernels: a save keeps an executed copy
HEADLESS_ENV = "QLAB_HEADLESS"  # set by qlab.notebooks.run_notebook for the kernel: progress as text
PROFILE_ENV = "QLAB_PROFILE"  # "paper": results go to data/paper/ and figures/paper/


def _path(name: str, value) -> Path:
    """``value`` (a str or os.PathLike naming a path, not bytes) as a Path; errors name ``name``."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {checks.shown(value)}")
    if not text:
        raise ValueError(f"{name} must be a path, got an empty string")
    if "\x00" in text:
        raise ValueError(f"{name} must be a path without NUL characters, got {text!r}")
    return Path(text)


ROOT_ENV = "QLAB_ROOT"
_PROJECT_NAME = re.compile(r'^name\s*=\s*"qlab"\s*$', re.MULTILINE)


def is_checkout(folder: Path) -> bool:
    """Whether ``folder`` is a qlab checkout: a pyproject.toml naming the qlab project, and notebooks/."""
    folder = _path("folder", folder)
    pyproject = folder / "pyproject.toml"
    if not (pyproject.is_file() and (folder / "notebooks").is_dir()):
        return False
    try:
        return _PROJECT_NAME.search(pyproject.read_text(errors="replace")) is not None
    except OSError:
        return False


def _find_root() -> tuple[Path, str]:
    """(root, how it was found): $QLAB_ROOT, the checkout around the current directory, or the
    checkout qlab is installed from."""
    override = os.environ.get(ROOT_ENV)
    if override:
        return Path(override).resolve(), ROOT_ENV
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if is_checkout(folder):
            return folder, "current directory"
    package_parent = Path(__file__).resolve().parent.parent
    if is_checkout(package_parent):
        return package_parent, "installed"
    return here, "current directory"


ROOT, ROOT_FOUND_BY = _find_root()
NOTEBOOKS_DIR = ROOT / "notebooks"
RUNS_DIR = ROOT / "runs"
KERNEL_CACHE_DIR = RUNS_DIR / "kernel_cache"  # qlab.kernels.cpu_qdq's shared library, built per machine
# a headless run at the default parameters writes its data/ and figures/ into runs/staging/<notebook>.<pid>/,
# which qlab.notebooks moves into place once every cell has run: a failed run leaves the committed ones whole
STAGING_DIR = RUNS_DIR / "staging"
PARTIAL = ".partial"  # likewise a report's files, in <report folder>/.partial/ until its run finishes


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


def shown(path: str | os.PathLike) -> str:
    """``path`` as messages show it: relative to the repository root when inside it; a staged result
    (under ``STAGING_DIR/<run>/`` or a ``.partial/`` folder) as the place it moves to when its run
    finishes."""
    path = _path("path", path)
    if path.is_relative_to(STAGING_DIR) and len(path.relative_to(STAGING_DIR).parts) > 1:
        path = ROOT.joinpath(*path.relative_to(STAGING_DIR).parts[1:])
    if PARTIAL in path.parts[:-1]:
        path = Path(*[part for part in path.parts if part != PARTIAL])
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def existing_file(name: str, value, what: str = "file") -> Path:
    """``value`` as the Path of an existing file (not a folder): a TypeError for what is not a path, a
    ValueError for a folder, a FileNotFoundError for nothing there, each naming ``name``."""
    return _existing(name, value, what, folder=False)


def existing_folder(name: str, value, what: str = "folder") -> Path:
    """``value`` as the Path of an existing folder, refused as ``existing_file`` refuses."""
    return _existing(name, value, what, folder=True)


def _existing(name: str, value, what: str, folder: bool) -> Path:
    path = _path(name, value)
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{name} must be a {what}, got the {'file' if folder else 'folder'} {shown(path)}")
    if not (path.is_dir() if folder else path.is_file()):
        raise FileNotFoundError(f"{name} must name an existing {what}; {shown(path)} does not exist")
    return path


def writable_file(name: str, value, what: str = "file") -> Path:
    """``value`` as the Path of a file to (over)write: not a folder, in a folder that exists."""
    path = _path(name, value)
    if path.is_dir():
        raise ValueError(f"{name} must be a {what} to write, got the folder {shown(path)}")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{name}: the folder {shown(path.parent)} to write the {what} {path.name!r} in does not exist"
        )
    return path


_RESULT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def result_name(name: str, value, what: str = "file name") -> str:
    """``value`` as a plain name of a file inside a results folder: letters, digits and ``_ . + = -``,
    not starting with "." or "-", at most 200 characters, so it can neither leave the folder
    ("/", "..") nor hide in it."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a plain {what} (a str) like '02_topic_what', got {checks.shown(value)}"
        )
    if not _RESULT_NAME.fullmatch(value):
        raise ValueError(
            f"{name} must be a plain {what} like '02_topic_what' (letters, digits and _ . + = -, not "
            f"starting with '.' or '-', at most 200 characters), got {value!r}"
        )
    return value


@contextlib.contextmanager
def written_atomically(path: str | os.PathLike):
    """Yield a temporary path beside ``path`` to write to; once the block finishes, the file replaces
    ``path`` in one step, so a reader never sees a half-written file. A block that fails removes the
    temporary file and leaves ``path`` as it was."""
    path = writable_file("path", path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables for the duration (inherited by any process started meanwhile, such
    as papermill's kernel), then restore each to its previous value or absence."""
    for name, value in values.items():
        if not isinstance(value, str):
            raise TypeError(
                f"{name} must be a str (an environment variable's value), got {checks.shown(value)}"
            )
        if "\x00" in value:
            raise ValueError(f"{name} must be a str without NUL characters, got {value!r}")
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
    ``a=1__b=x`` (a sweep point's folder, an interactive run's results folder), at most 120 characters.
    Characters other than letters, digits and ``._=+-`` become ``-``; where they did, or where the name
    was shortened, a hash of the full text follows, so ``b=x y`` and ``b=x-y`` never share a folder."""
    if not isinstance(parameters, dict):
        raise TypeError(f"parameters must be a dict of name -> value, got {checks.shown(parameters)}")
    text = "__".join(f"{name}={value}" for name, value in parameters.items())
    slug = re.sub(r"[^A-Za-z0-9._=+-]", "-", text)
    if slug != text or len(slug) > 120:
        slug = slug[:100] + "--" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return slug
