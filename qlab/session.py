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

The ``profile`` parameter of notebooks 01, 03, 05, 06 and 07 ("cpu", the default, or "paper":
paper-scale sizes for a GPU) adds a ``paper/`` level under data/ and figures/ (``data/paper/`` with
default parameters otherwise), and a ``<notebook>_machine.json`` there naming the device the results
came from.

The defaults are read from the notebook's paired ``notebooks/<name>.py`` (the source of truth), not
from the cell as edited in the browser.
"""

from __future__ import annotations

import ast
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qlab import checks, paths
from qlab.host import headless, machine, progress, resolve_device  # noqa: F401  (the notebooks' names)

PROFILES = ("cpu", "paper")
INTERACTIVE_DIR = "interactive"


def parameters_source(name: str) -> str | None:
    """The source of the cell tagged ``parameters`` in ``notebooks/<name>.py`` (the committed
    defaults), as jupytext reads it; None if there is no such file or cell."""
    paths.result_name("name", name, "notebook name")
    source = paths.NOTEBOOKS_DIR / f"{name}.py"
    if not source.is_file():
        return None
    try:
        import jupytext
    except ImportError:  # a bare GPU image: the percent format's cell, read line by line
        lines = source.read_text().splitlines()
        if '# %% tags=["parameters"]' not in lines:
            return None
        start = lines.index('# %% tags=["parameters"]') + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("# %%")), len(lines))
        return "\n".join(lines[start:end]).strip()
    return next(
        (c.source for c in jupytext.read(source).cells if "parameters" in c.metadata.get("tags", [])), None
    )


def _parameters_cell(name: str) -> list[ast.stmt]:
    cell = parameters_source(name)
    if cell is None:
        raise ValueError(f"name must be a notebook under notebooks/ with a parameters cell, got {name!r}")
    return ast.parse(cell).body


def parameter_values(source: str) -> dict:
    """A parameters cell's source as {name: value}: each statement must assign a literal to one name
    (``smoke: bool = True``); ValueError naming ``source`` otherwise."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a parameters cell's text (str), got {checks.shown(source)}")
    try:
        statements = ast.parse(source).body
    except SyntaxError as error:
        raise ValueError(f"source is not Python: {error.msg} (line {error.lineno})") from None
    values = {}
    for statement in statements:
        target = None
        if isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target = statement.target
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        if not isinstance(target, ast.Name):
            raise ValueError(f"source must assign literals to names, got {ast.unparse(statement)!r}")
        try:
            values[target.id] = ast.literal_eval(statement.value)
        except (ValueError, TypeError, RecursionError):  # TypeError: an unhashable key, {[1]: 2}
            raise ValueError(
                f"source must assign literals to names, got {ast.unparse(statement)!r}"
            ) from None
    return values


def notebook_defaults(name: str) -> dict:
    """The parameters cell of ``notebooks/<name>.py`` as {name: default value} (literals only)."""
    return parameter_values(ast.unparse(ast.Module(body=_parameters_cell(name), type_ignores=[])))


def notebook_annotations(name: str) -> dict[str, str]:
    """The parameters cell's annotations as {parameter: "int" | "list[str]" | ...} (annotated ones)."""
    return {
        statement.target.id: ast.unparse(statement.annotation)
        for statement in _parameters_cell(name)
        if isinstance(statement, ast.AnnAssign)
    }


# Parameters a notebook may leave at 0 (every other int parameter counts something and must be ≥ 1)
ZERO_ALLOWED = {
    "seed",
    "max_workers",  # 0: one run per usable core
    "fidelity_every",  # 0: no fidelity measurements
    "outlier_channels",
    "warmup_steps",
    "pretrain_steps",  # 0: an untrained model's operands
    "chargpt_steps",
    "capture_steps",
    "expand",  # 0: every block scored by its share, none measured layer by layer
}


def _recipe_name(name, value):
    from qlab.recipe import PRESETS

    checks.choice(name, value, PRESETS)


def _packaged_model(name, value):
    from qlab.models import PACKAGED

    checks.choice(name, value, tuple(PACKAGED))


def _second_machine(name, value):
    """A folder of runs under data/cross_cpu/ (one holding a machine.json), as notebook 08 reads it."""
    folder = paths.ROOT / "data" / "cross_cpu"
    found = sorted(p.parent.name for p in folder.glob("*/machine.json"))
    if value not in found:
        raise ValueError(
            f"{name} must name a folder of runs under {paths.shown(folder)}/ ({', '.join(found) or 'none'}), "
            f"got {value!r}"
        )


def _tokenizer(name, value):
    """A folder (or hub id in the local cache) holding a tokenizer; it need not hold weights."""
    from qlab.models import tokenizer_source

    try:
        tokenizer_source(value)
    except (TypeError, ValueError) as error:
        detail = str(error).removeprefix("tokenizer ")
        raise type(error)(f"{name}: {detail}") from None


def _any_model(name, value):
    """A packaged name, a checkpoint folder or a hub id in the local Hugging Face cache (never fetched)."""
    from qlab.models import PACKAGED, checkpoint_folder

    if value not in PACKAGED:
        try:
            checkpoint_folder(value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{name}: {error}") from None


def _plan_format(name, value):
    from qlab.plan import plan_formats

    plan_formats([value], argument=name)


def _text_file(name, value):
    from qlab.models import read_text

    paths.existing_file(name, value, "UTF-8 text file")
    try:
        read_text(value)  # before a kernel starts: a file that is not UTF-8, or holds no text
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def _fraction(name, value):
    checks.number(name, value, low=0, high=1, open_low=True)


def _executor(name, value):
    from qlab.runs import EXECUTORS  # runs imports qlab.host, never this module

    checks.choice(name, value, EXECUTORS)


def _gemm(name, value):
    from qlab.nn import GEMMS

    checks.choice(name, value, GEMMS)


def _training_variant(name, value):
    from qlab.ablation import variant_parts

    variant_parts(value, argument=name)


# What a parameter may hold beyond its annotated type: one meaning per name across the notebooks.
# A rule checks one value; a list parameter's rule checks each element.
PARAMETER_RULES = {
    "seed": checks.seed,  # what torch.Generator.manual_seed takes
    "device": lambda name, value: resolve_device(value, argument=name),
    "profile": lambda name, value: checks.choice(name, value, PROFILES),
    "executor": _executor,
    "gemm": _gemm,
    "recipes": _recipe_name,
    "recipe_backward_only": _recipe_name,
    "sensitivity_recipe": _recipe_name,
    "keep_recipes": _recipe_name,
    "fidelity_recipes": _recipe_name,
    "finetune_recipes": _recipe_name,
    "overrides": lambda name, value: checks.choice(name, value, ("none", "high_precision", "dequantized")),
    "model_name": _any_model,
    "tokenizer": lambda name, value: value == "" or _tokenizer(name, value),
    "text": _text_file,
    "formats": _plan_format,
    "score": lambda name, value: checks.choice(name, value, ("measured", "approximated", "hierarchical")),
    "dtype": lambda name, value: checks.choice(name, value, ("float32", "bf16")),
    "held_out": lambda name, value: checks.integer(name, value, low=2),
    "pretrained_models": _packaged_model,
    "pretrained_model": lambda name, value: value == "" or _packaged_model(name, value),
    "train_variants": _training_variant,
    "fractions": _fraction,
    "text_fractions": _fraction,
    "keep_fraction": lambda name, value: checks.number(name, value, low=0, high=1),
    "second": _second_machine,
}


def _check_type(name: str, value, annotation: str):
    """``value`` against a parameters cell's annotation (bool, int, float, str, list[...])."""
    if annotation.startswith("list[") and annotation.endswith("]"):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a {annotation}, got {checks.shown(value)}")
        for index, element in enumerate(value):
            _check_type(f"{name}[{index}]", element, annotation[5:-1])
        return
    if annotation == "bool":
        checks.boolean(name, value)
    elif annotation == "int":
        checks.integer(name, value, low=0 if name.split("[")[0] in ZERO_ALLOWED else 1)
    elif annotation == "float":
        checks.number(name, value, low=0, open_low=True)
    elif annotation == "str" and not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {checks.shown(value)}")


def check_values(where: str, values: dict, annotations: dict[str, str]) -> None:
    """Check parameter values against their annotations (bool, int, float, str, list[...]: ints count
    and are ≥ 1 unless in ``ZERO_ALLOWED``, floats are finite and > 0), then ``PARAMETER_RULES``
    (recipes, models, devices, ...). Raises TypeError/ValueError naming the parameter and ``where``."""
    for parameter, value in values.items():
        try:
            if parameter in annotations:
                _check_type(parameter, value, annotations[parameter])
            rule = PARAMETER_RULES.get(parameter)
            if rule is not None:
                elements = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
                for index, element in elements:
                    rule(parameter if index is None else f"{parameter}[{index}]", element)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{error} (in the parameters cell of {where})") from None
    try:  # the rules that read two parameters
        if "budgets" in values and "formats" in values:
            from qlab.plan import check_reachable

            check_reachable(values["formats"], values["budgets"], argument="budgets")
        source = {"model_name", "tokenizer", "score"}
        if "tokenizer" in annotations and source & set(values):  # the report's: what loading checks first
            from qlab import advisor, models

            given = {**{k: v for k, v in notebook_defaults(where).items() if k in source}, **values}
            kind = models.check_source(given["model_name"], given["tokenizer"] or None)
            advisor.check_score(kind, given["score"])
    except ValueError as error:
        raise ValueError(f"{error} (in the parameters cell of {where})") from None


def check_parameters(name: str, values: dict) -> None:
    """``check_values`` for notebook ``name``'s parameters cell: ``start`` calls it before the
    notebook computes anything, ``qlab run``/``qlab sweep`` before a kernel starts."""
    check_values(name, values, notebook_annotations(name))


def _same(value, default) -> bool:
    """Equal as parameter values: 1e7 equals 10000000, True does not equal 1, NaN equals NaN."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default or (math.isnan(value) and math.isnan(default))
    return value == default


def changed_parameters(values: dict, defaults: dict) -> dict:
    """The values that differ from the defaults (``profile`` aside: it has a level of its own)."""
    for argument, given in (("values", values), ("defaults", defaults)):
        if not isinstance(given, dict):
            raise TypeError(f"{argument} must be a dict of parameter -> value, got {checks.shown(given)}")
    undeclared = sorted(str(key) for key in values if key != "profile" and key not in defaults)
    if undeclared:
        raise ValueError(f"values holds parameters that defaults does not: {', '.join(undeclared)}")
    return {
        key: value for key, value in values.items() if key != "profile" and not _same(value, defaults[key])
    }


def saved_copy(name: str, changed: dict, profile: str = "cpu") -> Path:
    """Where a save in ``qlab lab`` keeps notebook ``name``'s executed copy for these changed parameters:
    ``interactive_dir(name, changed)/<name>.ipynb``, under a folder of the profile's own when it is not
    "cpu" (a paper-profile run's outputs never replace the cpu run's)."""
    folder = interactive_dir(name, changed)
    if profile != "cpu":
        folder = folder / paths.result_name("profile", profile, "profile name")
    return folder / f"{name}.ipynb"


def interactive_dir(name: str, changed: dict) -> Path:
    """Where an interactive run of notebook ``name`` with these changed parameters keeps what it
    writes: ``runs/interactive/<name>/<changed parameters>`` (``defaults`` when none changed)."""
    paths.result_name("name", name, "notebook name")
    if not isinstance(changed, dict):
        raise TypeError(f"changed must be a dict of parameter -> value, got {checks.shown(changed)}")
    return paths.RUNS_DIR / INTERACTIVE_DIR / name / (paths.point_slug(changed) if changed else "defaults")


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
    check_parameters(name, current)
    profile = current.get("profile", "cpu")
    changed = changed_parameters(current, defaults)
    staged = _INHERITED_RESULTS is not None and Path(_INHERITED_RESULTS).is_relative_to(paths.STAGING_DIR)
    if staged and not changed:
        why = "default parameters: the committed results, replaced once every cell has run"
        results_dir = paths.ROOT
        os.environ[paths.RESULTS_ENV] = _INHERITED_RESULTS  # again, after a call with other values
    elif _INHERITED_RESULTS is not None and not staged:
        results_dir, why = Path(_INHERITED_RESULTS), "chosen by the runner"
    elif not changed:
        results_dir, why = paths.ROOT, "default parameters: the committed results"
        os.environ.pop(paths.RESULTS_ENV, None)
    else:
        results_dir = interactive_dir(name, changed)
        os.environ[paths.RESULTS_ENV] = str(results_dir)
        why = "parameters differ from the defaults; data/ and figures/ stay untouched"
    if profile == "cpu":
        os.environ.pop(paths.PROFILE_ENV, None)
    else:
        os.environ[paths.PROFILE_ENV] = profile
    device = str(resolve_device(current.get("device", "auto"), argument="device"))
    shown = paths.shown(results_dir / "data").removesuffix("data")  # a staged run: where it moves to
    where = "data/ and figures/" if results_dir == paths.ROOT else f"{shown}data and {shown}figures"
    if profile != "cpu":
        where = where.replace("data", f"data/{profile}").replace("figures", f"figures/{profile}")
        record = {"notebook": name, "profile": profile, "machine": machine(torch.device(device))}
        record["torch"], record["cuda"] = torch.__version__, torch.version.cuda
        text = json.dumps(record, indent=1, sort_keys=True) + "\n"
        (paths.data_dir() / f"{name}_machine.json").write_text(text)
    print(f"{name}: results go to {where} ({why}); device {device}")
    if os.environ.get(paths.LAB_ENV) == "1":  # JupyterLab through qlab lab: a save writes an executed copy
        saved = paths.shown(saved_copy(name, changed, profile))
        print(f"{name}: a save keeps this notebook with its outputs at {saved} (the tracked file, without)")
    return NotebookRun(name, current, changed, results_dir, device)
