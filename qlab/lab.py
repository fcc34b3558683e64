"""JupyterLab for qlab: ``qlab lab`` (``make lab``) serves the repository root so that the notebooks,
their results and the executed copies in ``runs/`` are one click apart, and a save never touches
the committed notebooks except where the user changed their code.

``LabContentsManager`` is jupytext's contents manager (which keeps ``notebooks/NN_topic.py`` and its
``.ipynb`` in sync) with three guards for the tracked notebooks:

- the ``notebooks/`` listing shows each notebook once, as its ``.py``, which opens as a notebook
  (jupytext's "Jupytext Notebook" is made the default viewer of Python files: ``install_lab_settings``);
- a save writes the tracked ``.py``/``.ipynb`` without outputs, execution counts or the metadata a
  kernel or the browser adds (``language_info``, cell execution times, ...), and writes the copy
  *with* outputs beside that parameter set's results,
  ``runs/interactive/<name>/<changed parameters>/[<profile>/]<name>.ipynb`` (``defaults`` for the
  committed values; a profile other than "cpu" in a folder of its own), so a run with other parameters
  never overwrites another's outputs;
- an untouched notebook opens unmodified: the served notebook already holds the ``language_info``
  the kernel will report, which JupyterLab would otherwise add (and call a change) on connecting;
- the ``parameters`` cell keeps its committed values: an interactive edit (``smoke = True``) runs
  but is not saved, unless JupyterLab was started with ``QLAB_SAVE_PARAMETERS=1``
  (``make lab SAVE_PARAMETERS=1``) to change a default on purpose.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path

from qlab import checks, paths

SAVE_PARAMETERS_ENV = "QLAB_SAVE_PARAMETERS"
NOTEBOOK_NAME = re.compile(r"^\d\d_\w+$")
# cell metadata a browser or kernel adds; jupytext's own keys (tags, lines_to_next_cell, ...) stay
UI_CELL_METADATA = ("execution", "scrolled", "collapsed", "trusted", "jupyter", "ExecuteTime", "papermill")
# JupyterLab settings for this environment: .py files open as notebooks; no news feed or update check
# (qlab makes no network requests at run time)
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"python": "Jupytext Notebook"}},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def tracked_notebook(path: str) -> str | None:
    """The notebook name if ``path`` (relative to the served root) is notebooks/NN_topic.py|.ipynb."""
    if not isinstance(path, str):
        raise TypeError(f"path must be a str relative to the served root, got {checks.shown(path)}")
    relative = Path(path.strip("/"))
    if relative.parent != Path(paths.NOTEBOOKS_DIR.relative_to(paths.ROOT)):
        return None
    if relative.suffix not in (".py", ".ipynb") or not NOTEBOOK_NAME.match(relative.stem):
        return None
    return relative.stem


def kernel_language_info() -> dict:
    """The ``language_info`` the qlab kernel reports (ipykernel's, for this interpreter: the kernel
    runs in the same environment as the server)."""
    from ipykernel.ipkernel import IPythonKernel

    return copy.deepcopy(IPythonKernel.language_info)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _check_content(content) -> None:
    if not isinstance(content, dict):
        raise TypeError(f"content must be a notebook's JSON (a dict), got {checks.shown(content)}")
    cells = content.get("cells", [])
    if not isinstance(cells, list) or not all(isinstance(cell, dict) for cell in cells):
        raise ValueError(f"content['cells'] must be a list of cells (dicts), got {checks.shown(cells)}")
    for index, cell in enumerate(cells):
        metadata, source = cell.get("metadata", {}), cell.get("source", "")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("tags", []), list):
            raise ValueError(
                f"content['cells'][{index}]['metadata'] must be a dict whose tags are a list, "
                f"got {checks.shown(metadata)}"
            )
        if not isinstance(source, str) and not (
            isinstance(source, list) and all(isinstance(line, str) for line in source)
        ):
            raise ValueError(
                f"content['cells'][{index}]['source'] must be text (a str or a list of str), "
                f"got {checks.shown(source)}"
            )


def clean_for_saving(content: dict, notebook_name: str, *, keep_parameters: bool = False) -> dict:
    """A notebook's JSON as the tracked files hold it: no outputs or execution counts, the committed
    .ipynb's notebook metadata, no UI cell metadata, and (unless ``keep_parameters``) the committed
    parameters cell."""
    _check_content(content)
    paths.result_name("notebook_name", notebook_name, "notebook name")
    checks.boolean("keep_parameters", keep_parameters)
    clean = copy.deepcopy(content)
    stored = paths.NOTEBOOKS_DIR / f"{notebook_name}.ipynb"
    if stored.is_file():
        clean["metadata"] = json.loads(stored.read_text())["metadata"]
    from qlab.session import parameters_source

    committed = None if keep_parameters else parameters_source(notebook_name)
    for cell in clean.get("cells", []):
        metadata = cell.get("metadata", {})
        for key in UI_CELL_METADATA:
            metadata.pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
            if committed is not None and "parameters" in metadata.get("tags", []):
                cell["source"] = committed
    return clean


def executed_copy(name: str, content: dict) -> Path:
    """Where a save of notebook ``name`` keeps its executed copy: ``session.saved_copy`` for the
    parameters cell's values as ``content`` holds them (a cell that is not literal assignments,
    mid-edit, goes to ``unparsed-parameters``)."""
    from qlab import session

    paths.result_name("name", name, "notebook name")
    _check_content(content)
    cell = next(
        (c for c in content.get("cells", []) if "parameters" in c.get("metadata", {}).get("tags", [])), None
    )
    try:
        values = session.parameter_values(_source(cell) if cell is not None else "")
        defaults = session.notebook_defaults(name)
        changed = session.changed_parameters({k: v for k, v in values.items() if k in defaults}, defaults)
        return session.saved_copy(name, changed, values.get("profile", defaults.get("profile", "cpu")))
    except (ValueError, TypeError):  # a profile mid-edit (5, "a/b") is not a folder name either
        return paths.RUNS_DIR / session.INTERACTIVE_DIR / name / "unparsed-parameters" / f"{name}.ipynb"


def _base_manager():
    from jupytext.async_contentsmanager import AsyncTextFileContentsManager

    return AsyncTextFileContentsManager


class LabContentsManager(_base_manager()):
    """jupytext's contents manager with qlab's guards for the tracked notebooks (module docstring)."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and content and tracked_notebook(path):
            # what the kernel will report, so that its arrival does not mark an untouched notebook changed
            model["content"]["metadata"]["language_info"] = kernel_language_info()
        if model.get("type") == "directory" and content and model.get("content"):
            names = {entry["name"] for entry in model["content"]}
            model["content"] = [
                entry
                for entry in model["content"]
                if not (
                    tracked_notebook(entry["path"])
                    and entry["name"].endswith(".ipynb")
                    and entry["name"].removesuffix(".ipynb") + ".py" in names
                )
            ]
        return model

    async def save(self, model, path=""):
        name = tracked_notebook(path)
        if name is None or model.get("type") != "notebook" or "content" not in model:
            return await super().save(model, path)
        executed = executed_copy(name, model["content"])
        executed.parent.mkdir(parents=True, exist_ok=True)
        executed.write_text(json.dumps(model["content"], indent=1, ensure_ascii=False) + "\n")
        keep = os.environ.get(SAVE_PARAMETERS_ENV) == "1"
        clean = clean_for_saving(model["content"], name, keep_parameters=keep)
        self.log.info("qlab: saved %s without outputs; the executed copy is %s", path, executed)
        return await super().save({**model, "content": clean}, path)


def _mergeable(settings) -> bool:
    """Whether ``LAB_SETTINGS`` merge into ``settings``: a dict holding a dict wherever LAB_SETTINGS does."""
    if not isinstance(settings, dict):
        return False
    for plugin, values in LAB_SETTINGS.items():
        current = settings.get(plugin, {})
        if not isinstance(current, dict):
            return False
        if any(
            isinstance(value, dict) and not isinstance(current.get(key, {}), dict)
            for key, value in values.items()
        ):
            return False
    return True


def install_lab_settings(prefix: str | os.PathLike = sys.prefix) -> Path:
    """Write ``LAB_SETTINGS`` into this environment's JupyterLab defaults
    (``<prefix>/share/jupyter/lab/settings/overrides.json``, merged with what is there)."""
    prefix = paths.existing_folder("prefix", prefix, "environment prefix")
    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    try:
        settings = json.loads(path.read_text()) if path.exists() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"prefix {paths.shown(prefix)}: cannot read or create {path.name} there: {err}"
        ) from None
    if not _mergeable(settings):
        raise ValueError(f"prefix {paths.shown(prefix)}: {path.name} there holds no JupyterLab settings")
    for plugin, values in LAB_SETTINGS.items():
        current = settings.setdefault(plugin, {})
        for key, value in values.items():
            if isinstance(value, dict):
                current.setdefault(key, {}).update(value)
            else:
                current[key] = value
    with paths.written_atomically(path) as tmp:
        tmp.write_text(json.dumps(settings, indent=2) + "\n")
    return path


def lab_arguments(port: int | None = None, token: str | None = None, extra=()) -> list[str]:
    """``jupyter lab`` arguments for qlab: the repository root, LabContentsManager, runs/ visible."""
    if port is not None:
        checks.integer("port", port, low=1, high=65535)
    if token is not None and not isinstance(token, str):
        raise TypeError(f"token must be a str or None, got {checks.shown(token)}")
    options = isinstance(extra, (list, tuple)) and all(isinstance(option, str) for option in extra)
    if not options:
        raise TypeError(f"extra must be a list of jupyter lab options (strs), got {checks.shown(extra)}")
    arguments = [
        f"--ServerApp.root_dir={paths.ROOT}",
        "--ServerApp.contents_manager_class=qlab.lab.LabContentsManager",
    ]
    if port is not None:
        arguments.append(f"--ServerApp.port={port}")
    if token is not None:
        arguments.append(f"--IdentityProvider.token={token}")
    return arguments + list(extra)


def main(extra=()) -> None:
    """Start JupyterLab (``qlab lab [jupyter lab options]``) in place of this process, so its process
    id is the server's. Matplotlib's backend is left to the kernel (``make``'s MPLBACKEND=Agg would
    turn inline figures off)."""
    install_lab_settings()
    (paths.RUNS_DIR / "interactive").mkdir(parents=True, exist_ok=True)
    os.environ.pop("MPLBACKEND", None)
    os.environ[paths.LAB_ENV] = "1"  # the kernels say where a save keeps the copy with outputs
    extra = list(extra)
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        print("qlab lab: running as root (a container?): passing --allow-root to JupyterLab")
        extra.append("--allow-root")
    command = [sys.executable, "-m", "jupyterlab", *lab_arguments(extra=extra)]
    sys.stdout.flush()
    os.execv(sys.executable, command)
