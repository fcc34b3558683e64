"""Running the parameterized notebooks headless with papermill (used by the CLI and the tests).

Conventions (docs/adding_a_notebook.md): ``notebooks/NN_topic.py`` (jupytext percent) is the source of truth,
paired with ``NN_topic.ipynb`` stored without outputs; the first code cell is tagged
``parameters`` and holds typed values, ``smoke: bool = False`` among them. Executed copies go to
``runs/``. A smoke run writes its CSVs and figures under ``runs/smoke/`` so it never overwrites
the committed results in ``data/`` and ``figures/``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import errno
import functools
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qlab import checks, paths

if TYPE_CHECKING:
    import nbformat

KERNEL_NAME = "qlab"
REPORT_NOTEBOOK = "report_your_model"  # qlab report's template, beside the numbered notebooks
DEFAULT_TIMEOUT_S = 1800  # per cell
PATH_PARAMETERS = ("model_name", "tokenizer", "text")  # parameters that may name a file or folder


class NotebookError(RuntimeError):
    """A notebook failed to execute; the message names the notebook, the cell and the exception."""


@dataclass(frozen=True)
class RunResult:
    notebook: Path
    output: Path
    seconds: float
    parameters: dict = field(default_factory=dict)
    results: Path | None = None  # the folder holding the run's data/ and figures/ (None: its kernel chose)


def list_notebooks() -> list[Path]:
    """The paired notebooks, ``notebooks/NN_topic.ipynb``, in order."""
    return sorted(p for p in paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


_KERNEL_GROUPS: set[int] = set()  # process groups of the kernels this process has running


def kill_kernels() -> None:
    """SIGKILL every kernel this process started and is still running, with its whole process group
    (jupyter_client starts each kernel as a process-group leader, so a notebook's pool workers are in it).
    For an interrupted ``qlab run``: papermill's own shutdown would leave the kernel printing tracebacks
    of its closed sockets, and an ended qlab would leave the group running."""
    import signal

    for group in list(_KERNEL_GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
        _KERNEL_GROUPS.discard(group)


@functools.cache  # one class per process: papermill instantiates it for each run
def _local_kernel_manager():
    """jupyter_client's kernel manager talking to the kernel over local (IPC) sockets instead of TCP:
    nothing listens on the network, and the kernel has no unencrypted-TCP warning to print."""
    import tempfile

    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum, default

    class LocalKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

        @default("ip")
        def _socket_prefix(self) -> str:  # a folder of its own: kernels started side by side never collide
            return os.path.join(tempfile.mkdtemp(prefix="qlab-kernel-"), "ipc")

        async def _async_launch_kernel(self, kernel_cmd, **kw) -> None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            group = getattr(self.provisioner, "pgid", None)
            if group:
                self._qlab_group = group
                _KERNEL_GROUPS.add(group)

        def cleanup_ipc_files(self) -> None:
            _KERNEL_GROUPS.discard(getattr(self, "_qlab_group", None))
            super().cleanup_ipc_files()
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.ip))

    return LocalKernelManager


def resolve_notebook(name: str | os.PathLike) -> Path:
    """Find a notebook by path (.ipynb or its paired .py), by stem, or by its number ("02")."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a notebook's name, number string or path, got {checks.shown(name)}")
    candidate = Path(name)
    if len(os.fsencode(candidate.name)) > 255:  # longer than any file name: exists() would raise
        raise ValueError(f"unknown notebook {str(name)[:60]!r}… ({len(str(name))} characters): no such file")
    if candidate.suffix in (".ipynb", ".py") and candidate.exists():
        ipynb = candidate.with_suffix(".ipynb").resolve()
        if ipynb.exists():
            return ipynb
    if candidate.suffix in (".ipynb", ".py") and len(candidate.parts) > 1 and not candidate.exists():
        raise ValueError(f"notebook {str(name)!r}: no such file")
    available = list_notebooks()
    stem = candidate.name.removesuffix(".ipynb").removesuffix(".py")
    number = stem.zfill(2) if stem.isdigit() else stem  # "2" is notebook 02
    matches = [p for p in available if p.stem == stem or p.stem.split("_", 1)[0] == number]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(p.stem for p in available) or "(none)"
    words: dict[str, list[str]] = {}  # "welfrod" ~ "welford"; "gradient" is in two names
    for p in available:
        for word in p.stem.split("_")[1:]:
            words.setdefault(word, []).append(p.stem)
    single_word = "_" not in stem  # "04_gradient" or "gradient_norm" is closest to one whole name
    prefix = stem.split("_", 1)[0]
    numbered = [p.stem for p in available if not single_word and p.stem.split("_", 1)[0] == prefix.zfill(2)]
    near = (
        numbered  # "03_backward": the number names it
        or [
            hit
            for word in difflib.get_close_matches(stem, list(words), n=1, cutoff=0.7)
            for hit in words[word]
        ]
        * single_word
        or difflib.get_close_matches(stem, [p.stem for p in available], n=1, cutoff=0.5)
        or _title_matches(stem, available)  # "layernorm": a word of 02's title, not of its name
    )
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise ValueError(
        f"unknown notebook {str(name)!r}; {hint}available: {names} (name: one of these, its number or its "
        "path)"
    )


def _title_matches(word: str, available: list[Path]) -> list[str]:
    """The notebooks whose title (the paired .py's first heading) has a word close to ``word``."""
    found = []
    for ipynb in available:
        source = ipynb.with_suffix(".py")
        lines = source.read_text(encoding="utf-8").splitlines() if source.exists() else []
        title = next((line[4:] for line in lines if line.startswith("# # ")), "")
        title_words = [w.lower() for w in re.findall(r"[^\W_]+", title)]
        if difflib.get_close_matches(word.lower(), title_words, n=1, cutoff=0.8):
            found.append(ipynb.stem)
    return found


def _read(notebook) -> tuple[Path, nbformat.NotebookNode]:
    """The path and contents of the .ipynb file ``notebook``; errors name the argument ``notebook``."""
    import nbformat  # here, not at the top: it takes seconds to import, and `qlab --help` needs none of it

    path = paths.existing_file("notebook", notebook, "notebook (.ipynb file)")
    try:
        return path, nbformat.read(path, as_version=4)
    except Exception as err:  # not JSON, not a notebook, another nbformat, undecodable: many kinds
        detail = " ".join(str(err).split())[:200]
        raise ValueError(f"notebook {paths.shown(path)} is not a Jupyter notebook: {detail}") from None


def notebook_parameters(notebook: Path) -> dict[str, dict]:
    """The parameters cell's names -> {"default": source text, "type": annotation or None, "help": the
    line's comment or ""}."""
    from papermill.translators import PythonTranslator

    notebook, content = _read(notebook)
    tagged = [c for c in content.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not tagged:
        raise ValueError(f"notebook {notebook.name} has no cell tagged 'parameters'")
    # papermill's inspect_notebook needs a kernelspec in the file; every notebook runs in the qlab
    # (Python) kernel, so its parameters cell is read as Python whatever the file says
    found = PythonTranslator.inspect(tagged[0])
    return {
        info.name: {"default": info.default, "type": info.inferred_type_name, "help": info.help or ""}
        for info in found
    }


def _as_float(value):
    """A float parameter may be written 1e6 (YAML 1.1 reads that as a string) or as an int."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def check_parameters(notebook: Path, parameters: dict) -> dict:
    """Return the parameters with float-declared values as floats ("1e6" and 3 become 1e6 and 3.0).

    Raises ValueError for a name the notebook does not declare, and TypeError/ValueError for a value
    its parameters cell does not allow (``qlab.session.check_values``: the declared type, then what a
    parameter of that name may hold — a known recipe, a count ≥ 1, ...), before any kernel starts.
    """
    from qlab import session  # not at the top: it imports torch, which the CLI's parser never needs

    if not isinstance(parameters, dict):
        raise TypeError(f"parameters must be a dict of name -> value, got {checks.shown(parameters)}")
    notebook = paths.existing_file("notebook", notebook, "notebook (.ipynb file)")
    declared = notebook_parameters(notebook)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        near = {name: difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6) for name in unknown}
        hints = "".join(f"did you mean {found[0]} for {name}? " for name, found in near.items() if found)
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for {notebook.stem}; {hints}"
            f"it declares: {', '.join(declared)}"
        )
    checked = {
        name: _as_float(value) if declared[name]["type"] == "float" else value
        for name, value in parameters.items()
    }
    annotations = {name: info["type"] for name, info in declared.items() if info["type"]}
    session.check_values(notebook.stem, checked, annotations)
    pair = {"budgets", "formats"}  # the rule that reads two parameters: one given, the other's default
    if pair & set(checked) and pair <= set(declared) and not pair <= set(checked):
        defaults = parameter_defaults(notebook)
        both = {name: checked[name] if name in checked else defaults[name] for name in sorted(pair)}
        session.check_values(notebook.stem, both, annotations)
    return checked


def _require_kernel() -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        raise NotebookError(
            f"the Jupyter kernel {KERNEL_NAME!r} is not installed: run `make kernel` "
            f"(or `python -m ipykernel install --sys-prefix --name {KERNEL_NAME}`)"
        ) from None


def run_notebook(
    notebook: str | os.PathLike,
    parameters: dict | None = None,
    *,
    smoke: bool = False,
    output: Path | None = None,
    results_dir: Path | None = None,
    timeout: int = DEFAULT_TIMEOUT_S,
) -> RunResult:
    """Execute a notebook with papermill and the ``qlab`` kernel; return where the copy went.

    ``smoke=True`` sets the notebook's ``smoke`` parameter and, unless ``results_dir`` is given,
    sends data/ and figures/ to ``runs/smoke/``. The executed copy goes to ``output`` (default
    ``runs/[smoke/]<name>.ipynb``) and is kept when a cell fails; the failure raises NotebookError
    naming the notebook, the cell and the exception. A run whose results are the committed ones
    writes them under ``runs/staging/`` and moves them into data/ and figures/ only once every cell
    has run, so a failed or interrupted run leaves the committed results as they were.
    """
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    path = resolve_notebook(notebook)
    if parameters is not None and not isinstance(parameters, dict):
        raise TypeError(f"parameters must be a dict of name -> value, got {checks.shown(parameters)}")
    checks.boolean("smoke", smoke)
    checks.integer("timeout", timeout, low=1)
    params = dict(parameters or {})
    if smoke:
        params["smoke"] = True
    params = _absolute_paths(check_parameters(path, params))
    _refuse_executed_copy(path)
    _require_kernel()
    output, results_dir = output_folder(path, params, output, results_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = None
    if results_dir is None and results_folder(path, params, output) is None:  # the committed results
        paths.STAGING_DIR.mkdir(parents=True, exist_ok=True)
        staging = results_dir = Path(tempfile.mkdtemp(prefix=f"{path.stem}.", dir=paths.STAGING_DIR))
    start = time.perf_counter()

    def kept() -> str:
        """What a failed run leaves, for its error: the executed copy, and the committed results whole."""
        text = f"\n  executed copy kept at {output}"
        if staging is not None:
            wrote = any(p.is_file() for p in staging.rglob("*"))
            if not wrote:
                shutil.rmtree(staging, ignore_errors=True)  # an empty staging folder is no result to keep
            where = f"what this run wrote is in {paths.shown(staging)}" if wrote else "it wrote none"
            text += (
                "\n  the committed CSVs and figures are as they were (training runs stored as they "
                f"finished stay); {where}"
            )
        return text

    try:
        # text progress bars; where results go only when chosen here (smoke, a sweep point, the staging
        # of a run at the defaults): otherwise qlab.session.start decides from the parameters, so a run
        # with other values than the defaults writes under runs/interactive/, never over the committed data/
        kernel = {paths.HEADLESS_ENV: "1", paths.ROOT_ENV: str(paths.ROOT)}  # the kernel's cwd is output's
        if results_dir is not None:
            kernel[paths.RESULTS_ENV] = str(results_dir)
        with paths.environment(**kernel), _honour_raises_exception():
            executed = papermill.execute_notebook(
                str(path),
                str(output),
                parameters=params,
                kernel_name=KERNEL_NAME,
                language="python",  # what the qlab kernel speaks, whatever the file's metadata says
                cwd=str(output.parent),
                execution_timeout=timeout,
                progress_bar=False,
                log_output=False,
                kernel_manager_class=_local_kernel_manager(),
            )
    except (
        CellTimeoutError,
        DeadKernelError,
    ) as err:  # a cell past --timeout, a kernel killed: this one fails
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise NotebookError(f"notebook {path.name} stopped: {type(err).__name__}: {first}{kept()}") from None
    except PapermillExecutionError as err:
        source = "\n".join("    " + line for line in (err.source or "").splitlines()[:12])
        raise NotebookError(
            f"notebook {path.name} failed in cell In [{err.exec_count}]:\n{source}\n"
            f"  {err.ename}: {err.evalue}{kept()}"
        ) from None
    for index, cell in enumerate(executed.cells):
        if _expects_error(cell) and not any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            raise NotebookError(
                f"notebook {path.name}: cell {index} is tagged raises-exception but raised nothing{kept()}"
            )
    if staging is not None:
        publish(staging)
        results_dir = None
    return RunResult(path, output, time.perf_counter() - start, params, results_dir)


def publish(staging: Path, root: Path | None = None) -> list[Path]:
    """Move every file under ``staging`` to the same place under ``root`` (default: the repository
    root), each replacing its target in one step, then remove ``staging``; the moved files' new paths.
    A missing ``staging`` (the run wrote nothing there) moves nothing. A file on another filesystem is
    copied beside its target first, so the target is still replaced in one step."""
    root = paths.ROOT if root is None else paths.existing_folder("root", root)
    if isinstance(staging, (str, os.PathLike)) and os.fspath(staging) and not Path(staging).exists():
        return []
    staging = paths.existing_folder("staging", staging)
    moved = []
    for source in sorted(p for p in staging.rglob("*") if p.is_file()):
        target = root / source.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(source, target)
        except OSError as error:
            if error.errno != errno.EXDEV:
                raise
            with paths.written_atomically(target) as tmp:  # runs/ on another disk than data/
                shutil.copy2(source, tmp)
            source.unlink()
        moved.append(target)
    shutil.rmtree(staging)
    return moved


def _refuse_executed_copy(path: Path) -> None:
    """An executed copy still holds papermill's injected-parameters cell, which a run without -p leaves
    in place: its values would run under the parameters cell's (the defaults') name."""
    for cell in _read(path)[1].cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            raise ValueError(
                f"notebook {paths.shown(path)} is an executed copy (it holds papermill's injected "
                "parameters): run the notebook it was made from, with -p for the parameters to change"
            )


def check_output(output, argument: str = "output") -> Path | None:
    """``output`` as the Path of an executed copy (a .ipynb file), or None where it names a folder
    (one that exists, or a path ending in a slash), which holds the copy under the notebook's name;
    anything else is refused, naming ``argument``."""
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path (str or os.PathLike), got {checks.shown(output)}")
    if not os.fspath(output):
        raise ValueError(f"{argument} must name a .ipynb file or a folder, got an empty string")
    target = Path(output).resolve()
    if target == paths.NOTEBOOKS_DIR or target.is_relative_to(paths.NOTEBOOKS_DIR):
        raise ValueError(
            f"{argument} must not be in {paths.shown(paths.NOTEBOOKS_DIR)}/, where the tracked notebooks are "
            f"(an executed copy would replace one), got {str(output)!r}"
        )
    if Path(output).is_dir() or str(output).endswith(("/", os.sep)):
        return None
    if Path(output).suffix != ".ipynb":
        raise ValueError(f"{argument} must name a .ipynb file or a folder, got {str(output)!r}")
    return Path(output)


def output_folder(path: Path, parameters: dict, output=None, results_dir=None) -> tuple[Path, Path | None]:
    """(executed copy, folder of data/ and figures/) for a run of the notebook at ``path`` with these
    parameters, unless the caller chose them. One rule, however the parameters were given (``smoke=True``
    is ``-p smoke true``): at the defaults, ``runs/<name>.ipynb`` and the committed data/ and figures/
    (None: the kernel's session decides, as for a run opened in JupyterLab); with only ``smoke`` changed,
    ``runs/smoke/``; with any other change, ``runs/interactive/<name>/<every changed parameter>/``. A
    profile other than "cpu" puts the executed copy under ``runs/[smoke/]<profile>/`` (its results go to
    data/<profile>/ and figures/<profile>/, where the session puts them)."""
    from qlab import session

    if output is not None:  # a folder holds the copy under the notebook's name
        if check_output(output) is None:
            output = Path(output) / f"{path.stem}.ipynb"
    defaults = parameter_defaults(path)
    changed = session.changed_parameters(parameters, defaults)
    changed = {name: changed[name] for name in defaults if name in changed}  # the kernel's session's order
    if changed == {} or (output is not None and not changed.keys() <= {"smoke"}):
        folder = None
    elif changed == {"smoke": True}:
        folder = paths.RUNS_DIR / "smoke"
    else:
        folder = session.interactive_dir(path.stem, changed)
    profile = parameters.get("profile", "cpu")
    if output is None:
        base = folder or paths.RUNS_DIR
        if profile != "cpu" and (folder is None or changed == {"smoke": True}):
            base = base / str(profile)  # runs/<profile>/, as qlab figures --profile: never the defaults' copy
        output = base / f"{path.stem}.ipynb"
    elif folder is not None and changed == {"smoke": True}:
        folder = Path(output).parent.absolute()  # a chosen copy keeps a smoke run's results beside it
    folder = results_dir if results_dir is not None else folder
    if folder is not None:
        folder = Path(folder).absolute()  # the kernel runs in the executed copy's folder
        refuse_committed_results(folder, "--output (output=)")
    return Path(output), folder


def refuse_committed_results(folder: Path, argument: str) -> None:
    """ValueError where ``folder`` (a run's chosen results folder) is the repository root, whose data/
    and figures/ are the committed results: a run with other values than the defaults (smoke among them)
    never writes there. Links and ``..`` are resolved first."""
    if Path(folder).resolve() == paths.ROOT:
        raise ValueError(
            f"this run's results would go to {paths.ROOT}/data and figures, the committed results; a run at "
            f"other parameters than the defaults (smoke among them) needs another folder: give {argument} "
            "a folder other than the repository root"
        )


def _absolute_paths(params: dict) -> dict:
    """``params`` with each relative path that exists from here, in ``PATH_PARAMETERS``, made absolute:
    the kernel runs in the executed copy's folder, where "corpus.txt" or "./my-checkpoint" is not."""

    def absolute(value):
        if isinstance(value, list):
            return [absolute(item) for item in value]
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
            return str(Path(value).absolute())
        return value

    return {name: absolute(value) if name in PATH_PARAMETERS else value for name, value in params.items()}


def results_folder(path: Path, parameters: dict, output=None) -> Path | None:
    """The folder whose data/ and figures/ a run of ``path`` with these parameters writes (None: the
    committed ones), as ``output_folder`` chooses it or, where that leaves it to the kernel,
    as ``qlab.session.start`` will: ``$QLAB_RESULTS_DIR`` if set, else runs/interactive/ for changed
    parameters (a chosen executed copy with changed parameters)."""
    from qlab import session

    folder = output_folder(path, parameters, output)[1]
    if folder is not None:
        return folder
    if os.environ.get(paths.RESULTS_ENV):
        return Path(os.environ[paths.RESULTS_ENV])
    changed = session.changed_parameters(parameters, parameter_defaults(path))
    changed = {name: changed[name] for name in parameter_defaults(path) if name in changed}
    return session.interactive_dir(path.stem, changed) if changed else None


def parameter_defaults(notebook: Path) -> dict:
    """The parameters cell's defaults as values (a default that is no literal stays its source text)."""
    import ast

    defaults = {}
    for name, info in notebook_parameters(notebook).items():
        try:
            defaults[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            defaults[name] = info["default"]
    return defaults


def _expects_error(cell) -> bool:
    return "raises-exception" in cell.get("metadata", {}).get("tags", [])


@contextlib.contextmanager
def _honour_raises_exception():
    """nbclient runs on past a cell tagged ``raises-exception``, but papermill's final error check
    still fails the notebook on that cell's error; check a copy without those cells' outputs instead."""
    import papermill.execute as execute

    original = execute.raise_for_execution_errors

    def check(nb, output_path):
        view = copy.deepcopy(nb)
        for cell in view.cells:
            if _expects_error(cell):
                cell["outputs"] = []
                cell.get("metadata", {}).get("papermill", {}).pop("exception", None)
        original(view, output_path)

    execute.raise_for_execution_errors = check
    try:
        yield
    finally:
        execute.raise_for_execution_errors = original


def strip_outputs(notebook: Path) -> bool:
    """Remove outputs and execution counts from an .ipynb in place; return True if it changed."""
    notebook, nb = _read(notebook)
    changed = False
    for cell in nb.cells:
        if cell.get("cell_type") == "code" and (
            cell.get("outputs") or cell.get("execution_count") is not None
        ):
            cell.outputs, cell.execution_count = [], None
            changed = True
    if changed:
        with paths.written_atomically(notebook) as tmp:
            import nbformat

            nbformat.write(nb, tmp)
    return changed


def run_report(parameters: dict, folder: Path, *, smoke: bool = False,
               timeout: int = DEFAULT_TIMEOUT_S) -> tuple[RunResult, Path]:  # fmt: skip
    """``qlab report``: the report notebook run with ``parameters`` into ``folder`` (its executed copy,
    data/ and figures/), then exported to HTML beside the copy. Returns (the run, the HTML's path).

    The run writes into ``folder/.partial/``; only once every cell has run and the HTML is written do its
    files replace the report's files in ``folder`` (those named after the report: a previous run's plan
    for another budget goes too, anything else in the folder stays). A failed cell raises NotebookError
    naming the partial executed copy and leaves the last complete report as it was."""
    notebook = paths.NOTEBOOKS_DIR / f"{REPORT_NOTEBOOK}.ipynb"
    folder = Path(folder)
    partial = folder / ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        result = run_notebook(
            notebook, parameters, smoke=smoke, output=partial / f"{REPORT_NOTEBOOK}.ipynb",
            results_dir=partial, timeout=timeout,
        )  # fmt: skip
    except NotebookError as error:
        raise NotebookError(f"{error}\n  the report in {paths.shown(folder)} is as it was") from None
    html = export_html(result.output)
    for old in [*folder.glob(f"{REPORT_NOTEBOOK}.*"), *folder.glob(f"*/{REPORT_NOTEBOOK}_*")]:
        if old.is_file():
            old.unlink()
    publish(partial, folder)
    moved = dataclasses.replace(result, output=folder / result.output.name, results=folder)
    return moved, folder / html.name


def export_html(notebook: Path) -> Path:
    """An executed notebook as one self-contained HTML file beside it (nbconvert; figures embedded)."""
    from nbconvert import HTMLExporter

    notebook, nb = _read(notebook)
    body, _ = HTMLExporter().from_notebook_node(nb)
    target = notebook.with_suffix(".html")
    with paths.written_atomically(target) as tmp:
        Path(tmp).write_text(body, encoding="utf-8")
    return target


def sync_notebooks() -> list[Path]:
    """jupytext --sync every notebooks/*.py (the numbered ones and the report) with its .ipynb (the newer
    side wins), then strip outputs."""
    from jupytext.cli import jupytext as jupytext_cli

    synced = []
    sources = [*paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"), paths.NOTEBOOKS_DIR / f"{REPORT_NOTEBOOK}.py"]
    for source in sorted(sources):
        ipynb = source.with_suffix(".ipynb")
        if ipynb.exists():
            jupytext_cli(["--quiet", "--sync", str(source)])
        else:
            jupytext_cli(["--quiet", "--set-formats", "ipynb,py:percent", str(source)])
        strip_outputs(ipynb)
        synced.append(ipynb)
    return synced
