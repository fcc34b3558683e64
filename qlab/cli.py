"""The ``qlab`` command.

    qlab list                                   the notebooks and their parameters
    qlab run NOTEBOOK [-p NAME VALUE ...] [--smoke] [--profile P] [--timeout S] [--output PATH]
             [--executor E] [--address A]       -p executor E (results then under runs/interactive/)
    qlab figures [--smoke] [--profile paper]    every notebook, default parameters (paper: the
                                                notebooks with a profile, at paper scale, data/paper/)
                 [--executor E] [--address A]   how their training runs fan out (qlab.runs); a
                                                changed parameter, as for qlab run
    qlab sweep NOTEBOOK GRID.yaml [-p NAME VALUE ...] [-j N] [--executor serial|processes|ray] [--smoke]
    qlab campaign NOTEBOOK [--profile paper] [--budget 9m | --runs N | --status] [-p NAME VALUE ...]
                                                a run list finished over many invocations (qlab.campaign)
    qlab findings [--check]                     README's findings table from data/*_claims.csv
    qlab sync                                   jupytext-sync notebooks/*.py <-> .ipynb, strip outputs
    qlab lab [JUPYTER LAB OPTIONS]              JupyterLab on the repository root (qlab.lab)
    qlab advise [--model M] [--text F ...] --formats nvfp4,mxfp8,bf16 [--effective-bits B]   a plan
    qlab advise [--model M] [--recipe R] [--keep-fraction F] [--by layers|flops]   layers to keep precise
    qlab train [--config F.yaml] [-p NAME VALUE ...] [--nproc N]   train a model (qlab.train)

Parameter values are parsed as YAML scalars/lists (``-p n 1024 -p dtypes '[float32, bfloat16]'``).
Exit status: 0 success, 1 a notebook or sweep point failed or training diverged, 2 bad input (one line
on stderr: bad YAML, an unsafe tag or checkpoint, an unknown key or value).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from qlab import checks, notebooks, paths, sweep
from qlab.notebooks import DEFAULT_TIMEOUT_S, NotebookError


def _parse_value(text: str):
    """A -p value as YAML reads it; an empty one stays the empty string (YAML would read null)."""
    if not text.strip():
        return text
    try:
        return checks.yaml_value(text)
    except yaml.YAMLError:
        return text


def _parameters(args) -> dict:
    """The ``-p NAME VALUE`` pairs as {name: value}, each value parsed as YAML, a name given twice refused."""
    return {name: _parse_value(value) for name, value in checks.given_once(args.parameter).items()}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with "(default: …)" after each option whose default is a value (not None, off
    or empty) and whose help does not state it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default == ""
        if "default" in text or unset or default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


# qlab advise's options that belong to one mode: argparse dest -> (flag, default). The parser's default
# is None, so an option given in the other mode is refused instead of silently ignored.
ADVISE_PLAN_OPTIONS = {
    "effective_bits": ("--effective-bits", 6.0),
    "score": ("--score", "measured"),
    "expand": ("--expand", 6),
    "held_out": ("--held-out", 0),
    "plan_out": ("--plan-out", None),
}
ADVISE_KEEP_OPTIONS = {
    "recipe": ("--recipe", "nvfp4"),
    "budget": ("--keep-fraction", 0.15),
    "by": ("--by", "layers"),
}


def _advise_mode_options(args) -> None:
    """Refuse the other mode's options (ValueError naming them); fill this mode's defaults into ``args``."""
    if args.formats is not None and not args.formats.strip(","):  # --formats "": not keep mode unasked
        raise ValueError(f"--formats must name weight formats (e.g. nvfp4,mxfp8,bf16), got {args.formats!r}")
    mode, other = (
        (ADVISE_PLAN_OPTIONS, ADVISE_KEEP_OPTIONS)
        if args.formats
        else (ADVISE_KEEP_OPTIONS, ADVISE_PLAN_OPTIONS)
    )
    stray = [flag for name, (flag, _) in other.items() if getattr(args, name) is not None]
    if stray:
        which = "plan mode (--formats given)" if args.formats else "keep mode (no --formats)"
        needs = "keep mode: leave out --formats" if args.formats else "plan mode: give --formats"
        verb, owner = ("does", "it belongs") if len(stray) == 1 else ("do", "they belong")
        raise ValueError(f"{', '.join(stray)} {verb} nothing in {which}; {owner} to {needs}")
    if args.formats and args.expand is not None and args.score != "hierarchical":
        raise ValueError(
            f"--expand does nothing with --score {args.score or ADVISE_PLAN_OPTIONS['score'][1]}; it "
            "belongs to --score hierarchical"
        )
    for name, (_, default) in mode.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _version() -> str:
    """qlab's version and the torch it runs on (read from the installed metadata: no torch import)."""
    from importlib import metadata

    import qlab

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"qlab {qlab.__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


class _StoreOnce(argparse._StoreAction):
    """argparse's store, refusing an option given twice, or given beside another spelling of it (an
    earlier name kept as an alias): argparse would keep the last value and drop the first silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_options_given", {})
        if option_string is not None and self.dest in seen:
            earlier = seen[self.dest]
            twice = "given twice" if earlier == option_string else f"and {earlier} set the same value"
            parser.error(f"{option_string} {twice}; give it once")
        seen[self.dest] = option_string
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser (and subcommand parsers) whose plain options may be given once (``_StoreOnce``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qlab", description="qlab: low-precision training numerics lab bench")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="list the notebooks and their parameters")

    run = sub.add_parser("run", help="execute one notebook headless with papermill")
    run.add_argument("notebook", help="path, name (02_welford_vs_naive_variance) or number (02)")
    run.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="set one notebook parameter (VALUE parsed as YAML: 3, 0.5, true, [a, b]); repeatable",
    )  # fmt: skip
    run.add_argument(
        "--smoke", action="store_true", help="the same as -p smoke true: tiny sizes, for a quick check"
    )
    run.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one cell may take (default {DEFAULT_TIMEOUT_S})",
    )
    run.add_argument(
        "--output",
        help="where the executed copy goes (default runs/NAME.ipynb, runs/paper/NAME.ipynb for --profile "
        "paper; with --smoke runs/smoke/, with other -p parameters runs/interactive/NAME/...)",
    )
    run.add_argument(
        "--profile",
        choices=("cpu", "paper"),
        help="the same as -p profile PROFILE, for the notebooks with a profile parameter (paper: a GPU)",
    )
    run.add_argument(
        "--executor",
        choices=("serial", "processes", "ray"),
        help="the same as -p executor EXECUTOR: how the notebook's training runs fan out (a changed "
        "parameter: results go under runs/interactive/)",
    )
    run.add_argument("--address", help="with --executor ray: a running cluster's address, e.g. auto")

    figures = sub.add_parser("figures", help="run every notebook with default parameters")
    figures.add_argument(
        "--smoke", action="store_true", help="every notebook at tiny sizes, into runs/smoke/"
    )
    figures.add_argument(
        "--profile",
        choices=("cpu", "paper"),
        default="cpu",
        help="paper: only the notebooks with a profile parameter, at paper scale (a GPU), into data/paper/",
    )
    figures.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one cell may take (default {DEFAULT_TIMEOUT_S})",
    )
    figures.add_argument(
        "--executor",
        choices=("serial", "processes", "ray"),
        help="how the runs of a notebook with an executor parameter fan out (default: the notebook's)",
    )
    figures.add_argument("--address", help="with --executor ray: a running cluster's address, e.g. auto")

    sw = sub.add_parser("sweep", help="run a notebook over the cartesian product of a YAML grid")
    sw.add_argument("notebook", help="path, name or number of the notebook")
    sw.add_argument("grid", help="a YAML file mapping each parameter to its list of values")
    sw.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="set one notebook parameter for every point, as qlab run does (a name the grid also sets is "
        "refused); repeatable",
    )  # fmt: skip
    sw.add_argument(
        "-j", "--jobs", "--max-workers", type=int,
        help="points at once (default 1; --executor processes|ray: a worker per core / the cluster's)",
    )  # fmt: skip
    sw.add_argument(
        "--executor",
        choices=("serial", "processes", "ray"),
        help="how points fan out (qlab.runs); default: serial, or processes with -j N > 1",
    )
    sw.add_argument("--address", help="with --executor ray: a running cluster's address, e.g. auto")
    sw.add_argument("--smoke", action="store_true", help="every point at tiny sizes")
    sw.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one cell may take (default {DEFAULT_TIMEOUT_S})",
    )

    camp = sub.add_parser(
        "campaign",
        help="run the missing runs of a notebook's run list (03, 07) into data/[PROFILE/]runs/, as many "
        "as fit a budget (without --budget, --runs or --status: every missing run)",
        description="A campaign finishes a notebook's run list (03, 07) over many invocations: each run is "
        "written to data/runs/ (data/paper/runs/ for --profile paper) as it finishes, so a stopped "
        "campaign loses only the runs in flight. --smoke and -p parameters that change the runs keep them "
        "where `qlab run` with the same options writes its results (runs/smoke/, runs/interactive/, or "
        "beside a smoke run's --output); --executor, -j and --runs-per-gpu (how runs fan out) and -p "
        "allow_mixed_devices share the committed store. When the list is complete, the campaign names "
        "the `qlab run` command that renders the notebook from the stored runs.",
    )
    camp.add_argument("notebook", help="name or number of a notebook with a run list (03, 07)")
    camp.add_argument("--profile", choices=("cpu", "paper"), default="cpu", help="the notebook's profile")
    camp.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="set one notebook parameter, as qlab run does (the runs, and so the store, follow it)",
    )  # fmt: skip
    camp.add_argument("--smoke", action="store_true", help="the same as -p smoke true")
    camp.add_argument(
        "--output",
        help="the executed copy `qlab run --output` would write: the store follows it (as results do)",
    )
    what = camp.add_mutually_exclusive_group()
    what.add_argument(
        "--budget",
        help="wall time to spend, e.g. 9m, 90s, 1.5h (a bare number is seconds): no run starts "
        "that would not fit",
    )
    what.add_argument("--runs", type=int, help="run at most this many missing runs")
    what.add_argument("--status", action="store_true", help="say what is done and what is left; run nothing")
    camp.add_argument(
        "--allow-mixed-devices", action="store_true",
        help="add runs of this machine's device kind to a list stored from another (the notebook then needs "
        "-p allow_mixed_devices true)",
    )  # fmt: skip
    camp.add_argument(
        "--executor", choices=("serial", "processes", "ray"), default="processes", help="how runs fan out"
    )
    camp.add_argument("--address", help="with --executor ray: a running cluster's address, e.g. auto")
    camp.add_argument(
        "-j", "--max-workers", type=int, help="runs at once (default: cores, or runs-per-GPU × GPUs)"
    )
    from qlab.runs import RUNS_PER_GPU

    camp.add_argument(
        "--runs-per-gpu",
        type=int,
        default=RUNS_PER_GPU,
        help="runs packed on one GPU (qlab.runs.RUNS_PER_GPU)",
    )

    found = sub.add_parser("findings", help="regenerate README.md's findings table from data/*_claims.csv")
    found.add_argument(
        "--check", action="store_true", help="exit 1 if README.md is not up to date; change nothing"
    )

    sub.add_parser("sync", help="jupytext-sync notebooks/*.py with their .ipynb and strip outputs")

    report = sub.add_parser(
        "report",
        help="a report on your model (outliers, scores, plans under bit budgets checked on held-out text): "
        "the executed notebook, an HTML copy, CSVs, claims and figures in runs/report/<model>/",
    )
    report.add_argument(
        "--model", default="smollm2-135m",
        help="a packaged model, a checkpoint folder, or a hub id in the local Hugging Face cache",
    )  # fmt: skip
    report.add_argument(
        "--tokenizer", default="", help="a folder or cached hub id to take the tokenizer from"
    )
    report.add_argument(
        "--text", nargs="+", action="extend", default=[], help="UTF-8 text files (default: Shakespeare)"
    )
    report.add_argument("--formats", default="nvfp4,mxfp8,bf16", help="comma-separated weight formats")
    report.add_argument(
        "--effective-bits", dest="budgets", default="4.5,5,6", metavar="BITS",
        help="comma-separated mean bits per weight element, scales counted: a plan each",
    )  # fmt: skip
    report.add_argument("--budgets", dest="budgets", help=argparse.SUPPRESS)  # its earlier name
    report.add_argument(
        "--score", choices=_ScoreKinds(), default="measured", metavar="KIND",
        help="what the plans are chosen from: %(choices)s",
    )  # fmt: skip
    report.add_argument(
        "--expand", type=int, default=6, help="--score hierarchical: blocks measured by layer"
    )
    for option, default, words in REPORT_SIZES:  # None: not given (--smoke sets its own sizes)
        report.add_argument(option, type=int, default=None, help=f"{words} (default: {default})")
    report.add_argument("--seed", type=int, default=0, help="which windows are drawn")
    report.add_argument("--dtype", choices=("float32", "bf16"), default="float32", help="the model's dtype")
    report.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    report.add_argument("--out", help="the report's folder (default runs/report/<model>/)")
    report.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (" + ", ".join(f"{o} {v}" for o, v in REPORT_SMOKE_SIZES.items()) + "): a check "
        "that the report runs",
    )
    report.add_argument(
        "--timeout", type=int, default=notebooks.DEFAULT_TIMEOUT_S, help="seconds one notebook cell may take"
    )

    # plain arguments: building the parser imports no torch (qlab.models / get_recipe check the names)
    advise = sub.add_parser(
        "advise",
        help="a format per layer under a bit budget, or the layers to keep in high precision (qlab.plan, "
        "qlab.advisor)",
    )
    advise.add_argument(
        "--model",
        default="smollm2-135m",
        help="a packaged model (smollm2-135m, minilm-l6), a checkpoint folder, or a hub id in the local "
        "Hugging Face cache (never downloaded)",
    )
    advise.add_argument("--tokenizer", help="a folder or cached hub id to take the tokenizer from")
    advise.add_argument(
        "--text", nargs="+", action="extend", help="UTF-8 text files to calibrate on (default: Shakespeare)"
    )
    advise.add_argument(
        "--formats", help="plan mode: comma-separated weight formats, e.g. nvfp4,mxfp8,bf16 (qlab.plan)"
    )
    plan_default = {name: default for name, (_, default) in ADVISE_PLAN_OPTIONS.items()}
    keep_default = {name: default for name, (_, default) in ADVISE_KEEP_OPTIONS.items()}
    advise.add_argument(
        "--effective-bits", type=float,
        help="plan mode: mean bits per weight element, scales counted "
        f"(default: {plan_default['effective_bits']:g})",
    )  # fmt: skip
    advise.add_argument(
        "--score", choices=_ScoreKinds(), metavar="KIND",
        help="plan mode, one of %(choices)s: measured loss changes; the one-backward Fisher-weighted "
        "estimate; or hierarchical (blocks measured whole, then the --expand most sensitive ones layer by "
        f"layer) (default: {plan_default['score']})",
    )  # fmt: skip
    advise.add_argument(
        "--expand", type=int,
        help="plan mode, --score hierarchical: blocks (decoder layers) measured layer by layer "
        f"(default: {plan_default['expand']})",
    )  # fmt: skip
    advise.add_argument(
        "--recipe", help=f"keep mode: a qlab.recipe preset (default: {keep_default['recipe']})"
    )
    advise.add_argument(
        "--keep-fraction", dest="budget", type=float, metavar="F",
        help="keep mode: fraction of the layers (or FLOPs) to keep in high precision "
        f"(default: {keep_default['budget']:g})",
    )  # fmt: skip
    advise.add_argument("--budget", dest="budget", type=float, help=argparse.SUPPRESS)  # its earlier name
    advise.add_argument(
        "--by", choices=("layers", "flops"),
        help=f"keep mode: what --keep-fraction counts (default: {keep_default['by']})",
    )  # fmt: skip
    advise.add_argument("--batches", type=int, default=2, help="calibration batches")
    advise.add_argument(
        "--held-out", type=int,
        help="plan mode: batches of other windows (--text) or the held-out plays to check the plan on "
        f"(default: {plan_default['held_out']})",
    )  # fmt: skip
    advise.add_argument("--batch-size", type=int, default=2, help="windows per batch")
    advise.add_argument("--tokens", type=int, default=64, help="tokens per window")
    advise.add_argument("--seed", type=int, default=0, help="which windows are drawn")
    advise.add_argument("--dtype", choices=("float32", "bf16"), default="float32", help="the model's dtype")
    advise.add_argument(
        "--device",
        default="auto",
        help="where the model runs: auto (CUDA when there is one), cpu, cuda or cuda:N",
    )
    advise.add_argument("--top", type=int, default=15, help="rows of the table to print")
    advise.add_argument("--out", help="write the whole table to this CSV file")
    advise.add_argument("--plan-out", help="plan mode: where the plan goes (default runs/plans/<model>.json)")

    sub.add_parser(
        "lab",
        help="JupyterLab on the repository root (qlab.lab); further options go to jupyter lab",
        description="JupyterLab on the repository root, with qlab's kernel and settings. qlab lab has no "
        "options of its own: every other option goes to `jupyter lab` unchanged (e.g. qlab lab --port 8890 "
        "--no-browser; `jupyter lab --help` lists them).",
    )

    from qlab.train import launch

    launch.add_arguments(
        sub.add_parser("train", help="train a model (qlab.train); --nproc N runs DDP via torchrun")
    )
    parser.formatter_class = _HelpFormatter
    for command in sub.choices.values():
        command.formatter_class = _HelpFormatter
    return parser


def _cmd_list(args) -> int:
    for path in notebooks.list_notebooks():
        print(path.stem)
        for name, info in notebooks.notebook_parameters(path).items():
            comment = f"  # {info['help']}" if info["help"] else ""
            print(f"    {name}: {info['type'] or '?'} = {info['default']}{comment}")
    print(f"{notebooks.REPORT_NOTEBOOK}: the report on your own model, run by `qlab report` (see its --help)")
    return 0


def _stored_runs(notebook, parameters: dict, smoke: bool, output) -> int:
    """How many of the notebook's training runs its store holds before it runs (0 without a run list)."""
    from qlab import campaign, run_lists

    path = notebooks.resolve_notebook(notebook)
    if path.stem not in run_lists.RUN_LISTS:
        return 0
    parameters = {**parameters, "smoke": True} if smoke else parameters
    profile = parameters.get("profile", "cpu")
    run_list, store = campaign_list(path.stem, parameters, profile, None if output is None else Path(output))
    return campaign.progress(run_list, store).done


def _address_needs_ray(executor) -> None:
    """--address is for the ray executor: a ValueError saying which executor was given, if any."""
    if executor != "ray":
        given = f"got --executor {executor}" if executor else "and no executor was given"
        raise ValueError(f"--address needs --executor ray, {given}")


def _cmd_run(args) -> int:
    params = _parameters(args)
    if args.output is not None:
        notebooks.check_output(args.output, "--output")
    if args.smoke and params.get("smoke", True) is not True:
        raise ValueError(
            f"--smoke and -p smoke {checks.yaml_text(params['smoke'])} disagree; give smoke once"
        )
    for name in ("profile", "executor"):  # --profile P is -p profile P, --executor E -p executor E
        given = getattr(args, name)
        if given is None:
            continue
        path = notebooks.resolve_notebook(args.notebook)
        if name not in notebooks.notebook_parameters(path):
            raise ValueError(
                f"notebook {path.stem} has no {name} parameter, so --{name} {given} cannot apply"
            )
        if params.get(name, given) != given:
            raise ValueError(f"--{name} {given} and -p {name} {params[name]} disagree; give the {name} once")
        params[name] = given
    if args.address is not None:
        from qlab.runs import check_address

        _address_needs_ray(params.get("executor"))
        os.environ["RAY_ADDRESS"] = check_address(args.address)  # read by the notebook's run_many
    stored = _stored_runs(args.notebook, params, args.smoke, args.output)
    result = notebooks.run_notebook(
        args.notebook, params, smoke=args.smoke, timeout=args.timeout, output=args.output
    )
    profile = params.get("profile", "cpu")
    level = "" if profile == "cpu" else f"/{profile}"
    folder = result.results
    if folder is None:  # the kernel chose, as the results folder rule says
        folder = notebooks.results_folder(
            result.notebook, {**params, **({"smoke": True} if args.smoke else {})}, args.output
        )
    base = paths.ROOT if folder is None else Path(folder)
    where = f"{paths.shown(base / 'data')}{level} and {paths.shown(base / 'figures')}{level}"
    if not args.smoke and set(params) <= {"profile"} and result.notebook.parent == paths.NOTEBOOKS_DIR:
        if stored:
            print(f"qlab: {stored} training runs were read from the store: this wall time is not recorded")
        else:
            _record_seconds(result.notebook.stem, params.get("profile", "cpu"), result.seconds)
    print(f"{result.notebook.stem}: ok in {result.seconds:.1f} s")
    print(f"  executed copy {paths.shown(result.output)}; CSVs and figures in {where}")  # the last line
    return 0


NOTEBOOK_SECONDS = "benchmarks/results/notebook_seconds.csv"


def _record_seconds(notebook: str, profile: str, seconds: float) -> None:
    """Append a default-parameter run's wall time, with its machine, date, torch and commit, to
    benchmarks/results/notebook_seconds.csv (where the docs read each notebook's run time) — unless
    $QLAB_RUN_CACHE=1 let training runs come from the cache, when the wall time is no run time."""
    import csv
    import datetime
    import subprocess

    import torch

    from qlab.host import machine
    from qlab.runs import CACHE_ENV

    if os.environ.get(CACHE_ENV, "0") == "1":
        print(f"qlab: {CACHE_ENV}=1 (runs may come from the cache): this wall time is not recorded")
        return

    path = paths.ROOT / NOTEBOOK_SECONDS
    path.parent.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=paths.ROOT
    )
    today = datetime.date.today().isoformat()
    row = [notebook, profile, round(seconds, 1), machine(), today, torch.__version__, git.stdout.strip()]
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        if new:
            writer.writerow(["notebook", "profile", "seconds", "machine", "date", "torch", "commit"])
        writer.writerow(row)


def _cmd_figures(args) -> int:
    from tqdm.auto import tqdm

    failures = []
    chosen, parameters = notebooks.list_notebooks(), {}
    if args.profile != "cpu":
        chosen = [path for path in chosen if "profile" in notebooks.notebook_parameters(path)]
        parameters = {"profile": args.profile}

    def notebook_parameters(path: Path) -> dict:
        """The profile, and the executor where the notebook takes one."""
        if args.executor is not None and "executor" in notebooks.notebook_parameters(path):
            return {**parameters, "executor": args.executor}
        return dict(parameters)

    def executed_copy(path: Path) -> Path | None:
        """Where ``qlab run`` with the same parameters puts the executed copy (None: the defaults' own
        place). An executor is a changed parameter (a serial run's threads per run differ from a pool's,
        and so may its last bits): its copy and results go under runs/interactive/, never over data/."""
        chosen_parameters = notebook_parameters(path)
        if set(chosen_parameters) <= {"profile"} and args.profile == "cpu":
            return None
        smoke = {"smoke": True} if args.smoke else {}
        return notebooks.output_folder(path, {**chosen_parameters, **smoke})[0]

    if args.address is not None:
        from qlab.runs import check_address

        _address_needs_ray(args.executor)
        os.environ["RAY_ADDRESS"] = check_address(args.address)  # read by the notebooks' run_many
    if args.profile != "cpu":  # a notebook whose run list is incomplete renders nothing (qlab campaign)
        chosen = [path for path in chosen if _campaign_complete(path, args, executed_copy(path))]
    bar = tqdm(chosen, desc="notebooks", unit="nb")
    for path in bar:
        bar.set_postfix_str(path.stem)
        output = executed_copy(path)
        chosen_parameters = notebook_parameters(path)
        try:
            stored = _stored_runs(path, chosen_parameters, args.smoke, output)
            result = notebooks.run_notebook(
                path, chosen_parameters, smoke=args.smoke, timeout=args.timeout, output=output
            )
            if not args.smoke and args.executor is None and not stored:  # stored runs: no run time
                _record_seconds(path.stem, args.profile, result.seconds)
        except NotebookError as err:
            failures.append(str(err))
    for failure in failures:
        print(f"qlab: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _campaign_complete(path: Path, args, output: Path) -> bool:
    """Whether ``path`` may render at ``args.profile``: it has no run list, or every run is stored."""
    from qlab import campaign, run_lists

    if path.stem not in run_lists.RUN_LISTS:
        return True
    parameters = {"smoke": True} if args.smoke else {}
    run_list, store = campaign_list(path.stem, parameters, args.profile, output)
    state = campaign.progress(run_list, store)
    if not state.complete:
        smoke = " --smoke" if args.smoke else ""
        print(
            f"{path.stem}: {state.done} of {len(run_list)} runs stored in {paths.shown(store)}; not rendered "
            f"(`qlab campaign {path.stem[:2]} --profile {args.profile}{smoke}` continues it)"
        )
    return state.complete


def _cmd_sweep(args) -> int:
    from qlab import checks

    if args.jobs is not None:
        checks.integer("-j", args.jobs, low=1)
    if args.executor == "serial" and args.jobs is not None and args.jobs > 1:
        raise ValueError(f"-j {args.jobs} runs points at once and --executor serial one at a time; give one")
    parameters = _parameters(args)
    sweep.load_grid(args.grid, argument="grid")  # its errors name the argument typed, not run_sweep's
    outcomes = sweep.run_sweep(
        args.notebook,
        args.grid,
        parameters=parameters,
        jobs=args.jobs,
        executor=args.executor,
        address=args.address,
        smoke=args.smoke,
        timeout=args.timeout,
    )
    counts = {status: sum(o.status == status for o in outcomes) for status in ("ok", "skipped", "failed")}
    root = Path(outcomes[0].folder).parent if outcomes else sweep.sweep_folder(args.notebook, args.smoke)
    print(f"sweep: {counts['ok']} ran, {counts['skipped']} already complete, {counts['failed']} failed; "
          f"each point in {paths.shown(root)}/<its parameters>/")  # fmt: skip
    for outcome in outcomes:
        if outcome.status == "failed":
            error_file = Path(outcome.folder) / sweep.ERROR_FILE
            where = f" (in full: {paths.shown(error_file)})" if error_file.is_file() else ""
            print(f"  FAILED {outcome.slug}: {outcome.detail}{where}", file=sys.stderr)
    return 1 if counts["failed"] else 0


def campaign_list(notebook: str, parameters: dict, profile: str, output: str | Path | None = None):
    """(run list, store folder) of ``notebook`` at ``profile`` with these parameters, where ``qlab run``
    with the same parameters (and executed copy ``output``) reads them; checked before anything runs."""
    from qlab import campaign, run_lists, session
    from qlab.host import resolve_device

    path = notebooks.resolve_notebook(notebook)
    if path.stem not in run_lists.RUN_LISTS:
        raise ValueError(
            f"notebook {path.stem} has no run list; campaigns run the notebooks with one: "
            f"{', '.join(sorted(run_lists.RUN_LISTS))}"
        )
    params = notebooks.check_parameters(path, {**parameters, "profile": profile})
    values = {**notebooks.parameter_defaults(path), **params}
    session.check_parameters(path.stem, values)  # the rules the notebook's session.start applies
    results_dir = notebooks.results_folder(path, params, output)
    settings = {} if results_dir is None else {paths.RESULTS_ENV: str(results_dir)}
    if profile != "cpu":
        settings[paths.PROFILE_ENV] = profile
    saved = os.environ.pop(paths.PROFILE_ENV, None)
    try:
        with paths.environment(**settings):
            device = str(resolve_device(values["device"], argument="device"))
            listed = run_lists.run_list(path.stem, values, device)
            return listed, campaign.store_dir(listed)
    finally:
        if saved is not None:
            os.environ[paths.PROFILE_ENV] = saved


def _cmd_campaign(args) -> int:
    from qlab import campaign
    from qlab.runs import check_address, plan

    params = _parameters(args)
    if "profile" in params:
        raise ValueError("qlab campaign takes the profile as --profile PROFILE, not -p profile")
    fan_out = (("executor", "--executor"), ("max_workers", "-j"), ("runs_per_gpu", "--runs-per-gpu"))
    for name, option in fan_out:
        if name in params:  # the notebook's own fan-out: the campaign runs the list itself, with its options
            raise ValueError(
                f"qlab campaign runs the list itself: give {option} {checks.yaml_text(params[name])}, "
                f"not -p {name}"
            )
    if args.smoke:
        if params.get("smoke", True) is not True:
            raise ValueError(
                f"--smoke and -p smoke {checks.yaml_text(params['smoke'])} disagree; give smoke once"
            )
        params["smoke"] = True
    if args.output is not None:
        notebooks.check_output(args.output, "--output")
    try:
        budget = None if args.budget is None else campaign.parse_budget(args.budget)
    except ValueError as error:
        raise ValueError(f"--{error}") from None  # "--budget must be ...", the option as typed
    if args.runs is not None and args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    checks.integer("--runs-per-gpu", args.runs_per_gpu, low=1)
    if args.max_workers is not None:
        checks.integer("-j", args.max_workers, low=1)
    if args.address is not None:
        _address_needs_ray(args.executor)
        check_address(args.address)
    workers = plan(args.executor, args.max_workers, None, args.runs_per_gpu)[0]
    output = args.output  # as typed: a trailing "/" names a folder to make
    run_list, store = campaign_list(args.notebook, params, args.profile, output)
    if args.status:
        print(campaign.status(run_list, store, workers=workers, output=output))
        return 0
    if args.profile == "paper" and args.executor != "ray" and not _has_cuda():
        print("qlab: warning: the paper profile is sized for a GPU and this machine has none; a run takes "
              "far longer here (--status gives the rate once one has finished)", file=sys.stderr)  # fmt: skip
    state = campaign.run_campaign(
        run_list, budget_s=budget, max_runs=args.runs, executor=args.executor, max_workers=args.max_workers,
        runs_per_gpu=args.runs_per_gpu, address=args.address, store=store,
        allow_mixed_devices=args.allow_mixed_devices,
    )  # fmt: skip
    if state.complete:
        print(f"complete: `{campaign.render_command(run_list, output)}` renders it from the stored runs")
    return 0


def _cmd_findings(args) -> int:
    from qlab.claims import update_readme

    changed = update_readme(paths.ROOT / "README.md", paths.ROOT / "data", check=args.check)
    if args.check:
        print("README.md findings: " + ("out of date (run `qlab findings`)" if changed else "up to date"))
        return 1 if changed else 0
    print("README.md findings: " + ("regenerated" if changed else "already up to date"))
    return 0


def _cmd_sync(args) -> int:
    for path in notebooks.sync_notebooks():
        print(f"synced {path.name}")
    return 0


class _ScoreKinds(Sequence):
    """``qlab.plan.SCORE_KINDS``, imported only when a command's options are checked or its help shown
    (the options give a metavar, so argparse does not list the choices while building the parser):
    qlab.plan imports torch, which ``qlab --help`` does not need."""

    def _kinds(self) -> tuple[str, ...]:
        from qlab.plan import SCORE_KINDS

        return SCORE_KINDS

    def __getitem__(self, index):
        return self._kinds()[index]

    def __len__(self) -> int:
        return len(self._kinds())


REPORT_SIZES = (  # the report's size options: option, default, help
    ("--batches", 3, "calibration batches"),
    ("--held-out", 8, "held-out batches each plan is checked on"),
    ("--batch-size", 2, "windows per batch"),
    ("--tokens", 64, "tokens per window"),
)
REPORT_SMOKE_SIZES = {"--batches": 2, "--held-out": 2, "--batch-size": 1, "--tokens": 16}  # the notebook's


def _report_sizes(args) -> None:
    """Fill the report's size options: their defaults, or --smoke's tiny sizes, which the notebook sets
    and which a size given beside --smoke would silently lose; --tokens needs a next token to predict."""
    given = [o for o, _, _ in REPORT_SIZES if getattr(args, o[2:].replace("-", "_")) is not None]
    if args.smoke and given:
        raise ValueError(
            f"--smoke sets its own sizes ({', '.join(f'{o} {v}' for o, v in REPORT_SMOKE_SIZES.items())}); "
            f"give {' '.join(given)} or --smoke, not both"
        )
    for option, default, _ in REPORT_SIZES:
        name = option[2:].replace("-", "_")
        value = getattr(args, name)
        setattr(args, name, default if value is None else value)
    checks.integer("--tokens", args.tokens, low=2)  # a window of one token has nothing to predict


def _check_report_folder(out) -> None:
    """``--out``: a folder to make or one to write the report's files into; neither a file nor the
    repository root (whose data/ and figures/ are the committed results)."""
    if not out:
        raise ValueError("--out must name a folder for the report, got an empty string")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out must name a folder for the report, got the file {out}")
    if folder.resolve() == paths.ROOT:
        raise ValueError(
            f"--out must be a folder other than the repository root ({paths.ROOT}), whose data/ and "
            "figures/ are the committed results"
        )
    if folder.resolve().is_relative_to(paths.NOTEBOOKS_DIR):
        raise ValueError(f"--out must not be in notebooks/, where the tracked notebooks are, got {out}")


def _cmd_report(args) -> int:
    from qlab.plan import slug

    _report_sizes(args)

    def numbers(text: str, option: str) -> list[float]:
        try:
            return [float(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"{option} must be comma-separated numbers, got {text!r}") from None

    from qlab.host import resolve_device

    resolve_device(args.device, argument="--device")
    for text in args.text:
        paths.existing_file("--text", text, "UTF-8 text file")
    if args.out is not None:
        _check_report_folder(args.out)
    parameters = dict(
        model_name=args.model, tokenizer=args.tokenizer, text=list(args.text),
        formats=args.formats.split(","), budgets=numbers(args.budgets, "--effective-bits"), score=args.score,
        expand=args.expand, batches=args.batches, held_out=args.held_out, batch_size=args.batch_size,
        tokens=args.tokens, seed=args.seed, dtype=args.dtype, device=args.device,
    )  # fmt: skip
    report = paths.NOTEBOOKS_DIR / f"{notebooks.REPORT_NOTEBOOK}.ipynb"
    try:
        notebooks.check_parameters(report, parameters)
    except (TypeError, ValueError) as error:  # name the option typed, not the notebook's parameter
        options = {"model_name": "--model", "budgets": "--effective-bits", "formats": "--formats"}
        name = re.match(r"\w+", str(error))
        if name and name[0] in parameters:
            shown = options.get(name[0], "--" + name[0].replace("_", "-"))
            raise type(error)(shown + str(error)[len(name[0]) :]) from None
        raise
    folder = Path(args.out) if args.out else paths.RUNS_DIR / "report" / slug(args.model, args.dtype)
    result, html = notebooks.run_report(parameters, folder, smoke=args.smoke, timeout=args.timeout)
    print(f"report on {args.model}: ok in {result.seconds:.1f} s")
    print(f"  {paths.shown(html)} (HTML), {paths.shown(result.output)}; CSVs, claims and figures in "
          f"{paths.shown(folder / 'data')} and {paths.shown(folder / 'figures')}")  # fmt: skip
    return 0


def _cmd_advise(args) -> int:
    _advise_mode_options(args)
    from qlab import advisor

    return advisor.main(args)


def _cmd_lab(args) -> int:
    from qlab import lab

    lab.main(args.jupyter_options)  # replaces this process with JupyterLab
    return 0


def _cmd_train(args) -> int:
    from qlab.train import launch

    return launch.run(args)


def _checkout_of(notebook) -> Path | None:
    """The qlab checkout a notebook given by its path lies in (None: a name or number, or no checkout)."""
    try:
        if not isinstance(notebook, str) or not Path(notebook).is_file():
            return None
    except OSError:  # a name too long to be a path: resolve_notebook says it names no notebook
        return None
    folder = Path(notebook).resolve().parent
    return next((f for f in (folder, *folder.parents) if paths.is_checkout(f)), None)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that qlab stops as after Ctrl-C: Python's default
    SIGTERM would end qlab at once and leave a notebook's kernel and its pool workers running."""


def _stop(signum, frame):
    """SIGINT and SIGTERM: end the running notebooks' kernels with their process groups (quietly, and
    their pool workers with them), then unwind as an interrupt."""
    import signal

    notebooks.kill_kernels()
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    handle = threading.current_thread() is threading.main_thread()
    previous = {}
    if handle:
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, _stop)
    try:
        return _main(argv)
    except KeyboardInterrupt as err:
        how = "stopped by SIGTERM" if isinstance(err, Terminated) else "interrupted"
        if (sys.argv[1:] if argv is None else argv)[:1] == ["train"]:
            kept = "a run with an out_dir keeps its last checkpoint: add -p resume true to continue it"
        else:
            kept = ("what finished is kept (a campaign's stored runs, a sweep's complete points): run the "
                    "same command again to continue")  # fmt: skip
        print(f"qlab: {how}; {kept}", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a pipe of something else broke: a real error
        # `qlab list | head`: the reader of our output stopped reading, which is no error of qlab's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a captured stdout)
        return False


def _joined_negative_values(argv: list[str], options=("--budget",)) -> list[str]:
    """``--budget -5m`` as ``--budget=-5m``: argparse reads a value that starts with "-" and is not a
    plain number as an option and says only "expected one argument"; joined, the option's own check says
    what is wrong with the value."""
    joined, index = [], 0
    while index < len(argv):
        if argv[index] in options and index + 1 < len(argv) and re.match(r"-\.?\d", argv[index + 1]):
            joined.append(f"{argv[index]}={argv[index + 1]}")
            index += 2
        else:
            joined.append(argv[index])
            index += 1
    return joined


def _main(argv: list[str] | None) -> int:
    parser = _build_parser()
    argv = _joined_negative_values(sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "lab":  # the subcommand's usage, not the list of every subcommand
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.jupyter_options = unknown
    if paths.ROOT_FOUND_BY == paths.ROOT_ENV and not paths.is_checkout(paths.ROOT):
        print(
            f"qlab: error: {paths.ROOT_ENV}={paths.ROOT} is not a qlab checkout (a folder whose "
            "pyproject.toml names qlab and which holds notebooks/)",
            file=sys.stderr,
        )
        return 2
    owner = _checkout_of(getattr(args, "notebook", None))
    if owner is not None and owner != paths.ROOT and paths.ROOT_FOUND_BY != paths.ROOT_ENV:
        standing_in_one = paths.ROOT_FOUND_BY == "current directory" and paths.is_checkout(paths.ROOT)
        if standing_in_one:  # standing in one checkout, a notebook of another: which one is meant?
            print(f"qlab: error: {args.notebook} belongs to the checkout at {owner}, but this command writes "
                  f"into {paths.ROOT} (the {paths.ROOT_FOUND_BY}); run it from {owner} or set "
                  f"{paths.ROOT_ENV}={owner}", file=sys.stderr)  # fmt: skip
            return 2
        print(f"qlab: not inside a qlab checkout; using {owner}, the checkout {args.notebook} belongs to",
              file=sys.stderr)  # fmt: skip
        command = [sys.executable, "-m", "qlab.cli", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.call(command, env={**os.environ, paths.ROOT_ENV: str(owner)})
    if paths.ROOT_FOUND_BY == "installed":
        print(f"qlab: not inside a qlab checkout; using the installed one at {paths.ROOT}", file=sys.stderr)
    command = {
        "list": _cmd_list,
        "run": _cmd_run,
        "figures": _cmd_figures,
        "sweep": _cmd_sweep,
        "findings": _cmd_findings,
        "campaign": _cmd_campaign,
        "sync": _cmd_sync,
        "lab": _cmd_lab,
        "advise": _cmd_advise,
        "report": _cmd_report,
        "train": _cmd_train,
    }[args.command]
    try:
        if getattr(args, "timeout", None) is not None:  # run, figures, sweep, report: before any notebook
            checks.integer("--timeout", args.timeout, low=1)
        return command(args)
    except (NotebookError, FloatingPointError) as err:  # a notebook failed; training diverged
        print(f"qlab: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # main decides: a reader that stopped early, or a real error
    except (ValueError, TypeError, OSError, ModuleNotFoundError) as err:  # OSError: e.g. a path not makeable
        print(f"qlab: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
