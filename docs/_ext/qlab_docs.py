"""Pages written at build time, before Sphinx reads the sources, into ``docs/_generated/`` (ignored by git).

- ``findings/<notebook>.ipynb``: one page per notebook — the executed copy ``runs/<name>.ipynb`` when
  it exists (``qlab figures`` / ``qlab run`` at the default parameters), else the committed notebook
  without outputs. Before the notebook: the answer (``docs/answers.yaml`` filled from the committed
  ``data/<name>_claims.csv``), its key figure and "How sure" (the evidence claims' verdicts); the
  conclusions as the notebook rendered them; the other figures; all claims, collapsed (and the paper
  profile's ``data/paper/`` file beside them where one exists).
- ``api/<module>.rst``: ``automodule`` of every module of the package.
- ``results/<file stem>.md``: the table of one file of ``benchmarks/results/`` (columns as the file holds
  them, those empty in every row left out), for a page to include (```{include}
  _generated/results/bench_quantize.md```): the docs' benchmark tables are these, never typed.
- ``benchmark_results.md``: every one of them, one section per file; ``results/gpu_at_a_glance.md``:
  per GPU, the latest run of each kernel and training step.

While Sphinx writes each page, ``link_glossary_terms`` makes the first use of each glossary term in
its prose a link to the term's definition.

A file is rewritten only when its text changes, so an unchanged page is not read again. qlab's docstrings
are plain text (usage examples, markdown tables, |x|, items laid out one per line): ``docstring_rst``
turns each into reStructuredText that renders as laid out; one it cannot is shown preformatted, and a
test keeps that list empty.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import pkgutil
import re
import shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
OUT = DOCS / "_generated"


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def notebook_names() -> list[str]:
    """Every notebook of notebooks/ (its jupytext .py is the source of truth), in order."""
    return sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


# --- findings -------------------------------------------------------------------------------------


def _read_notebook(path: Path):
    import nbformat

    try:
        if path.suffix == ".py":
            import jupytext

            return jupytext.read(path)
        return nbformat.read(path, as_version=4)
    except Exception:  # a copy being written by a concurrent run, or a broken file: take the next one
        return None


def _at_the_defaults(nb, name: str) -> bool:
    """Whether an executed copy ran to its end with the notebook's default parameters (papermill's
    record of the parameters it injected, and of a failure; every code cell executed): a copy kept
    from a failed run, one still being written, or one written with other parameters is not shown as
    the defaults' run."""
    from qlab import notebooks

    record = nb.metadata.get("papermill", {})
    if not record or record.get("exception"):
        return False
    defaults = notebooks.parameter_defaults(ROOT / "notebooks" / f"{name}.ipynb")
    injected = record.get("parameters", {})
    finished = all(cell.get("execution_count") is not None for cell in nb.cells if cell.cell_type == "code")
    return finished and all(key in defaults and defaults[key] == value for key, value in injected.items())


def notebook_source(name: str):
    """(notebook, which copy) for ``name``: executed at its default parameters (``runs/<name>.ipynb``,
    the only executed copy taken), else the committed .ipynb or .py."""
    candidates = [
        (ROOT / "runs" / f"{name}.ipynb", "executed with its default parameters (`runs/`)"),
        (ROOT / "notebooks" / f"{name}.ipynb", "the committed notebook, not executed"),
        (ROOT / "notebooks" / f"{name}.py", "the committed notebook, not executed"),
    ]
    for path, which in candidates:
        if path.exists():
            nb = _read_notebook(path)
            if nb is not None and nb.cells and (path.parent.name != "runs" or _at_the_defaults(nb, name)):
                return nb, which
    raise FileNotFoundError(f"no notebook {name} under notebooks/ or runs/")


def claims_markdown(path: Path) -> str:
    """The claims file's rows as a markdown table: what each claim states, its value with its 95 %
    interval, the verdict of its test (Holm family sizes recounted as ``qlab findings`` does)."""
    from qlab import claims as qclaims
    from qlab.results import markdown_table

    rows = []
    for claim in qclaims.file_claims(path):
        rows.append(
            {
                "claim": claim.text + (" **(headline)**" if claim.headline else ""),
                qclaims.MEASURED: claim.both(),
                "test": claim.verdict(),
            }
        )
    import pandas as pd

    table = markdown_table(pd.DataFrame(rows, columns=["claim", qclaims.MEASURED, "test"]))
    return _braces(table)


def _strip_widgets(nb) -> None:
    """Widget outputs (progress bars) have no saved widget state: keep their text form only."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data and "application/vnd.jupyter.widget-view+json" in data:
                data.pop("application/vnd.jupyter.widget-view+json")
        cell["outputs"] = [o for o in cell.get("outputs", []) if "data" not in o or o["data"]]
    nb.metadata.pop("widgets", None)


def answers() -> dict:
    """docs/answers.yaml: per notebook, its question, the template of its short answer and its key
    figure."""
    import yaml

    return yaml.safe_load((ROOT / "docs" / "answers.yaml").read_text(encoding="utf-8"))


def answer_markdown(name: str, folder: Path) -> list[str]:
    """The short answer a findings page opens with: the question, the plain answer filled from the
    committed claims, the key figure (copied beside the page) with its caption, then "How sure": each
    evidence claim with its value, interval and the full verdict of its test."""
    from qlab import claims as qclaims

    entry = answers().get(name)
    if entry is None:
        raise ValueError(f"docs/answers.yaml has no answer for notebook {name}")
    claims = ROOT / "data" / f"{name}_claims.csv"
    also = sorted((ROOT / "data").glob(f"{name}_claims_*.csv"))
    text = qclaims.render_committed(claims, entry["answer"], also=also)
    evidence = "".join(f"- {{{key}:text}}: {{{key}}} — {{{key}:verdict}}\n" for key in entry["evidence"])
    evidence = qclaims.render_committed(claims, evidence, also=also)
    figure = ROOT / "figures" / f"{entry['figure']}.png"
    caption = _braces(" ".join(entry["caption"].split()))
    _write(folder / "figures" / figure.name, figure.read_bytes())
    return [
        "## The answer\n",
        f"**{entry['question']}**\n",
        _braces(text) + "\n",
        f"```{{figure}} figures/{figure.name}\n:alt: {caption}\n\n{caption}\n```\n",
        "**How sure.** The claims behind the answer, each with its 95 % interval and its test:\n",
        _braces(evidence) + "\n",
    ]


def _braces(text: str) -> str:
    """Markdown whose { and } stay text (MyST would read {name} as a role)."""
    return text.replace("{", "&#123;").replace("}", "&#125;")


def findings_page(name: str) -> None:
    import nbformat

    nb, which = notebook_source(name)
    nb = copy.deepcopy(nb)
    _strip_widgets(nb)
    folder = OUT / "findings"
    parts = answer_markdown(name, folder)
    parts.append(
        f"Every number above is filled in from the committed claims, `data/{name}_claims.csv`, which the "
        "notebook wrote at its default parameters; the figures and the claims below are the same run's.\n"
    )
    said = ROOT / "data" / f"{name}_claims.md"
    if said.exists():  # the prose the notebook filled in from these claims when it wrote them
        text = _braces(said.read_text(encoding="utf-8"))
        parts += ["## What the notebook concludes\n",
                  f"The notebook's text as it filled it in from its claims (`data/{name}_claims.md`):\n",
                  text + "\n"]  # fmt: skip
    key = answers()[name]["figure"]
    figures = [f for f in sorted((ROOT / "figures").glob(f"{name}_*.png")) if f.stem != key]
    if figures:
        parts.append("## Figures\n")
        for figure in figures:
            _write(folder / "figures" / figure.name, figure.read_bytes())
            label = figure.stem.removeprefix(name + "_").replace("_", " ")
            parts.append(f"**{label}**\n\n![{label}](figures/{figure.name})\n")
    paper_figures = sorted((ROOT / "figures" / "paper").glob(f"{name}_*.png"))
    if paper_figures:
        parts.append("### Figures, paper profile\n")
        for figure in paper_figures:
            _write(folder / "figures" / "paper" / figure.name, figure.read_bytes())
            parts.append(f"![{figure.stem}](figures/paper/{figure.name})\n")
    claims = ROOT / "data" / f"{name}_claims.csv"
    parts.append("## Claims\n")
    if claims.exists():
        count = len(claims.read_text(encoding="utf-8").splitlines()) - 1
        parts += [f"<details>\n<summary>All {count} claims: value, 95 % interval, test</summary>\n",
                  claims_markdown(claims), "</details>\n"]  # fmt: skip
    else:
        parts.append("This notebook saves no claims file; its text states what it measured.\n")
    paper = ROOT / "data" / "paper" / f"{name}_claims.csv"
    if paper.exists():
        parts += [
            "<details>\n<summary>Claims, paper profile</summary>\n",
            claims_markdown(paper),
            "</details>\n",
        ]
    parts += ["## The notebook\n", f"The notebook below is {which}.\n"]
    intro = nbformat.v4.new_markdown_cell("\n".join(parts))
    # after the title line, so the page keeps the notebook's own title and opens with the answer; the
    # rest of the first cell (the notebook's introduction) opens "The notebook"
    first = 0
    if nb.cells and nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "):
        title, _, rest = nb.cells[0].source.partition("\n")
        nb.cells[0].source = rest.strip("\n")
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(title))
        first = 1
    nb.cells.insert(first, intro)
    for cell in nb.cells:  # ids are optional for nbformat 4.4 readers and duplicate after a copy
        cell.pop("id", None)
    nb.nbformat_minor = 4
    kernel = {"name": "qlab", "display_name": "Python (qlab)", "language": "python"}
    nb.metadata.setdefault("kernelspec", kernel)
    _write(folder / f"{name}.ipynb", nbformat.writes(nb))


def findings_index() -> None:
    names = notebook_names()
    lines = [
        "# The notebooks, one page each",
        "",
        "Each page opens with the short answer to the notebook's question, filled in from its committed "
        "claims, and its key figure; then its other figures, all its claims (collapsed) and the notebook.",
        "",
        "```{toctree}",
        ":maxdepth: 1",
        "",
        *[f"findings/{n}" for n in names],
        "```",
        "",
    ]
    _write(OUT / "notebooks.md", "\n".join(lines))


def findings_pages() -> None:
    """The list of findings pages, each by its question, that the Findings page includes."""
    lines = [f"- {{doc}}`{entry['question']} </_generated/findings/{name}>` ({name[:2]})"
             for name, entry in answers().items()]  # fmt: skip
    _write(OUT / "findings_pages.md", "\n".join(lines) + "\n")


def findings_summary() -> None:
    """Every notebook's headline claims in one table, as the README's findings table is generated."""
    from qlab import claims

    _write(OUT / "findings_table.md", claims.findings_table(ROOT / "data"))


# --- API ------------------------------------------------------------------------------------------


def modules() -> list[str]:
    """Every importable module of qlab (``python -m qlab.train``'s ``__main__`` runs on import: left out)."""
    import qlab

    names = ["qlab"]
    names += [
        m.name for m in pkgutil.walk_packages(qlab.__path__, "qlab.") if not m.name.endswith(".__main__")
    ]
    return sorted(names)


def public_names(module_name: str) -> list[str]:
    """The functions and classes ``module_name`` defines whose names do not start with "_"."""
    module = importlib.import_module(module_name)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module_name
    ]


def api_pages() -> None:
    names = modules()
    index = [
        "API reference",
        "=============",
        "",
        "Every module of the package, generated from its docstrings.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
        *[f"   api/{n}" for n in names],
        "",
    ]
    _write(OUT / "api.rst", "\n".join(index))
    for name in names:
        title = f"``{name}``"
        text = [title, "=" * len(title), "", f".. automodule:: {name}", ""]
        module = importlib.import_module(name)
        if getattr(module, "__all__", None) is not None and name == "qlab.train":
            text += ["   :no-members:", ""]
        _write(OUT / "api" / f"{name}.rst", "\n".join(text))


# --- benchmarks -----------------------------------------------------------------------------------


def results_frame(path: Path):
    """A file of ``benchmarks/results/`` as a frame of strings, as the file writes them; columns empty in
    every row left out (a file gathering several measurements holds columns only some of them fill)."""
    import pandas as pd

    if path.suffix == ".csv":
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    else:
        data = json.loads(path.read_text())
        frame = pd.DataFrame(data if isinstance(data, list) else [data]).astype(str)
    return frame[[column for column in frame.columns if (frame[column].str.strip() != "").any()]]


def _shown_number(text: str) -> str:
    """A cell as a results table shows it: a decimal written with more than six significant digits
    to four (0.8940199613571167 is 0.894; the file keeps every digit); anything else as written."""
    try:
        value = float(text)
    except ValueError:
        return text
    mantissa = text.lower().split("e")[0]
    if "." not in mantissa or len(re.sub(r"\D", "", mantissa).lstrip("0")) <= 6:
        return text
    if re.fullmatch(r"-?\d+\.0*", mantissa) and "e" not in text.lower():  # 135475200.0: a whole number
        return text
    digits = 4
    while digits < 17 and float(f"{value:.{digits}g}") == round(value) != value:
        digits += 1  # 0.9999999403953552 is 0.99999994, never "1", which would read as exact
    return f"{value:.{digits}g}"


def _with_intervals(frame):
    """Each column X that has X_low and X_high beside it, as one column "X (low–high)" whose cells read
    "0.894 (0.776–1.01)", or "-0.36 (-0.47 to -0.25)" where a bound is negative (the estimate alone
    where the file has no interval for that row)."""

    def interval(low: str, high: str) -> str:
        negative = low.startswith("-") or high.startswith("-")  # not 1e-07's minus
        return f"{low} to {high}" if negative else f"{low}–{high}"

    frame = frame.copy()
    for column in list(frame.columns):
        low, high = f"{column}_low", f"{column}_high"
        if low not in frame or high not in frame:
            continue
        frame[column] = [
            f"{x} ({interval(lo, hi)})" if x and lo and hi else x
            for x, lo, hi in zip(frame[column], frame[low], frame[high])
        ]
        frame = frame.drop(columns=[low, high]).rename(columns={column: f"{column} (low–high)"})
    return frame


def results_table(path: Path) -> str:
    """The markdown a page includes for one results file: a line naming the file and the values every
    row shares (a column of one value is said once there, not repeated down the table: the table then
    fits the page's column), then the table of the columns that vary, long decimals to four significant
    digits and each estimate with its interval in one column."""
    from qlab.results import markdown_table

    frame = _with_intervals(results_frame(path).map(_shown_number))
    shared = [column for column in frame.columns if len(frame) > 1 and frame[column].nunique() == 1]
    every_row = "; ".join(f"{column} {frame[column].iloc[0]}" for column in shared)
    lines = [
        f"Generated from `benchmarks/results/{path.name}` ({len(frame)} rows; a benchmark run appends "
        "rows to it, with the machine, device, date, torch and commit it ran with)"
        + (f". Every row has {_braces(every_row)}:" if shared else ":"),
        "",
        _braces(markdown_table(frame.drop(columns=shared))),
        "",
    ]
    return "\n".join(lines)


def benchmark_results() -> None:
    """``results/<file stem>.md`` for every file of ``benchmarks/results/`` (a page shows one with
    ``{include} _generated/results/<stem>.md``), and ``benchmark_results.md`` including them all."""
    lines = [
        "# Benchmark results",
        "",
        "Generated from the files under `benchmarks/results/`: each row with the machine, date, torch "
        'version and commit it was measured with, as the file records them ("unrecorded" where the '
        "measurement did not record it).",
        "",
    ]
    paths = sorted(p for p in (ROOT / "benchmarks" / "results").glob("*") if p.suffix in (".csv", ".json"))
    for path in paths:
        _write(OUT / "results" / f"{path.stem}.md", results_table(path))
        lines += [f"## `{path.name}`", "", f"```{{include}} results/{path.stem}.md", "```", ""]
    folder = ROOT / "benchmarks" / "results"
    sentences = {
        "gpu_at_a_glance.md": gpu_at_a_glance(folder),
        "scoring_time.md": scoring_time(folder / "bench_plan.csv"),
    }
    for name, text in sentences.items():
        _write(OUT / "results" / name, text)
    stale = set((OUT / "results").glob("*.md")) - {OUT / "results" / f"{p.stem}.md" for p in paths}
    stale -= {OUT / "results" / name for name in sentences}
    for path in stale:
        path.unlink()
    _write(OUT / "benchmark_results.md", "\n".join(lines))


def _latest_run(frame, within: list[str]):
    """The rows of ``frame`` from the last (date, commit) that measured each group of ``within``, in file
    order: a later run of a part replaces the whole part, so no row of an older run stays beside it."""
    last = frame.groupby(within, sort=False)[["date", "commit"]].transform("last")
    return frame[(frame.date == last.date) & (frame.commit == last.commit)]


def _gpu_rows(path: Path, needed: list[str], optional: list[str]):
    """The rows of a GPU results file with a device, as strings (None: no file, or none to show);
    ``optional`` columns and date/commit are "" where the file has none."""
    if not path.exists():
        return None
    frame = results_frame(path)
    if not set(needed) <= set(frame.columns):
        return None
    frame = frame[frame.device.str.strip() != ""].copy()
    for column in [*optional, "date", "commit"]:
        if column not in frame:
            frame[column] = ""
    return frame if len(frame) else None


def _measured(rows) -> list[str]:
    return [f"{date} · {commit}" for date, commit in zip(rows.date, rows.commit)]


def scoring_time(path: Path) -> str:
    """One sentence from ``bench_plan.csv``: how long each score kind took in its latest run on the
    largest packaged model, with the machine, the layers and the calibration batches it was timed on."""
    import pandas as pd

    if not path.exists():
        return "`benchmarks/results/bench_plan.csv` holds no timed run yet.\n"
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame = frame[frame.layers.astype(int) == frame.layers.astype(int).max()]
    last = frame[(frame.date == frame.date.iloc[-1]) & (frame.commit == frame.commit.iloc[-1])]
    last = last.drop_duplicates("score")
    row = last.iloc[0]
    times = ", ".join(f"{r.score} {float(r.seconds):.0f} s" for r in last.itertuples())
    return _braces(
        f"Scoring is the slow part, and it grows with layers × formats × batches. `benchmarks/bench_plan.py`"
        f" scored {row.model}'s {row.layers} layers on {row.calibration_batches} calibration batches of "
        f"{row.tokens} tokens in these times per score kind: {times} ({row.machine}, {row.date}, "
        f"`bench_plan.csv`).\n"
    )


def gpu_at_a_glance(folder: Path) -> str:
    """Per GPU, one small table of the kernels (``bench_kernels_gpu.csv``) and one of the training step
    (``bench_train_gpu.csv``): the latest run of each part, and of a kernel tried at several launch
    settings ("…, rows per tile 4, 8 warps") only the fastest. Columns a reader needs first: time, GB/s,
    % of the floor (a copy of the same bytes timed in the same run), speed over the row's baseline, and
    when and at which commit it was measured."""
    import pandas as pd

    from qlab.results import markdown_table

    tables: dict[str, list[str]] = {}
    kernels = folder / "bench_kernels_gpu.csv"
    frame = _gpu_rows(kernels, ["device", "part", "kernel", "ms"], ["shape"])
    if frame is not None:
        frame = _latest_run(frame, ["device", "part"])
        frame = frame.drop_duplicates(["device", "part", "kernel", "shape"], keep="last").copy()
        frame["family"] = frame.kernel.str.split(", rows per tile").str[0]
        frame["order"] = range(len(frame))
        frame["seconds"] = pd.to_numeric(frame.ms, errors="coerce")
        frame = frame.sort_values("seconds").drop_duplicates(["device", "part", "family", "shape"])
        for device, rows in frame.sort_values("order").groupby("device", sort=False):
            table = pd.DataFrame(
                {"operation": rows.part + ": " + rows.kernel, "shape": rows["shape"], "ms": rows.ms}
            )
            ratios = (("gbps", "GB/s"), ("percent_of_clone", "% of floor"), ("speedup", "× baseline"))
            for column, name in ratios:
                if column in rows and (rows[column].str.strip() != "").any():
                    table[name] = rows[column].values
            table["measured"] = _measured(rows)
            intro = f"Kernels and layers (`{kernels.name}`):\n\n"
            tables.setdefault(device, []).append(intro + markdown_table(table))
    train = folder / "bench_train_gpu.csv"
    frame = _gpu_rows(train, ["device", "model", "recipe", "ratio"], ["mode", "compile_mode"])
    if frame is not None:
        frame = _latest_run(frame, ["device", "model", "mode", "compile_mode"])
        frame = frame.drop_duplicates(["device", "model", "mode", "compile_mode", "recipe"], keep="last")
        for device, rows in frame.groupby("device", sort=False):
            table = pd.DataFrame({"model": rows.model, "compiled": rows["mode"] + ", " + rows.compile_mode,
                                  "recipe": rows.recipe, "step ÷ FP32 step": rows.ratio,
                                  "measured": _measured(rows)})  # fmt: skip
            intro = f"Training step (`{train.name}`):\n\n"
            tables.setdefault(device, []).append(intro + markdown_table(table))
    lines = []
    for device, parts in tables.items():
        lines += [f"### {device}", ""] + [_braces(part) + "\n" for part in parts]
    return "\n".join(lines) or "`benchmarks/results/` holds no GPU rows.\n"


# --- docstrings -----------------------------------------------------------------------------------


def _valid_rst(text: str) -> bool:
    """Whether docutils parses ``text`` without a warning (Sphinx's own roles count as valid)."""
    import docutils.core
    import docutils.nodes
    import docutils.utils

    text = re.sub(r":[a-z]+(:[a-z]+)?:`", "`", text)  # Sphinx's roles (:func:`x`) are not docutils'
    try:
        doctree = docutils.core.publish_doctree(
            text,
            settings_overrides={"report_level": 2, "halt_level": 5, "warning_stream": False},
        )
    except Exception:
        return False
    if any(True for _ in doctree.findall(docutils.nodes.problematic)):
        return False
    for message in doctree.findall(docutils.nodes.system_message):
        if message["level"] >= 2 and "Unknown interpreted text role" not in message.astext():
            return False
    return True


_CODE = re.compile(r"\w\(|\s=\s|^>>> |^qlab\s")  # a call, an assignment, a doctest, a command line


def literal_examples(lines: list[str]) -> list[str]:
    """``lines`` with every indented block of code that follows a blank line (a usage example, as
    module docstrings open with) made a literal block: an "::" paragraph before it, unless the
    paragraph before already ends in "::". Indented prose (no call, no assignment) is left alone."""
    out, index = [], 0
    while index < len(lines):
        line = lines[index]
        starts_block = line.startswith("    ") and (index == 0 or not lines[index - 1].strip())
        before = next((previous for previous in reversed(out) if previous.strip()), "")
        if starts_block and not before.startswith(" ") and not before.rstrip().endswith("::"):
            end = index
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            block = lines[index:end]
            if any(_CODE.search(item.strip()) for item in block):
                out += ["::", ""] + block
                index = end
                continue
        out.append(line)
        index += 1
    return out


def _blocks(lines: list[str]):
    """``lines`` cut into (kind, lines) runs: "blank", "literal" (the indented block after a paragraph
    ending in "::", or a doctest), "table" (markdown pipe rows) and "text" (a paragraph)."""
    index, literal_after = 0, False
    while index < len(lines):
        line = lines[index]
        if not line.strip():
            end = index
            while end < len(lines) and not lines[end].strip():
                end += 1
            yield "blank", lines[index:end]
            index = end
            continue
        indent = len(line) - len(line.lstrip())
        if literal_after and indent > 0 or line.lstrip().startswith(">>> "):
            end = index + 1  # a literal block runs on while indented (or blank); a doctest while not blank
            indented = literal_after and indent > 0
            more = (lambda item: not item.strip() or item.startswith(" ")) if indented else str.strip
            while end < len(lines) and more(lines[end]):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            yield "literal", lines[index:end]
            index, literal_after = end, False
            continue
        end = index
        while end < len(lines) and lines[end].strip():
            end += 1
        paragraph = lines[index:end]
        if all(item.lstrip().startswith("|") for item in paragraph):
            yield "table", paragraph
            literal_after = False
        elif paragraph[0].startswith(".. "):  # a directive qlab_docs wrote (a list-table): as it is
            yield "directive", paragraph
            literal_after = False
        else:
            yield "text", paragraph
            literal_after = paragraph[-1].rstrip().endswith("::")
        index = end


def _cells(row: str) -> list[str]:
    """A markdown table row's cells: split at each "|" that is neither escaped nor inside ``…``."""
    parts = _INLINE_LITERAL.split(row.strip().removeprefix("|").removesuffix("|"))
    cells = [""]
    for number, part in enumerate(parts):
        pieces = re.split(r"(?<!\\)\|", part) if number % 2 == 0 else [part]
        cells[-1] += pieces[0]
        cells += pieces[1:]
    return [cell.strip() for cell in cells]


def _list_table(rows: list[str]) -> list[str]:
    """A markdown pipe table as a reStructuredText list-table (its first row the header)."""
    rows = [_cells(row) for row in rows]
    rows = [rows[0]] + [row for row in rows[1:] if not all(re.fullmatch(r":?-+:?", cell) for cell in row)]
    width = max(len(row) for row in rows)  # a short row (a cell spanning the rest) gets empty cells
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in rows:
        for number, cell in enumerate(row + [""] * (width - len(row))):
            out.append(f"   {'*' if number == 0 else ' '} - {_escaped(cell) or '..'}")
    return out + [""]


_INLINE_LITERAL = re.compile(r"(``.+?``)")
_STRAY = re.compile(r"(?<!\\)([|*]|(?<=\w)_(?!\w))")  # |x|, notebooks/*.py, torch's random_
_EMPHASIS = re.compile(r"(?<![\w*\\/])(\*\*?)[^\s*][^*]*?(?<!\s)\1(?![\w*])")  # not a glob's /*


def _escaped(text: str) -> str:
    """``text`` with each "|", each "*" that opens no emphasis and each name's trailing "_" escaped,
    outside inline literals: plain-text docstrings mean |x|, notebooks/*.py and random_ literally."""
    bullet = re.match(r"\s*\* ", text)  # a "* " list item keeps its marker
    lead, text = (bullet.group(0), text[bullet.end() :]) if bullet else ("", text)
    parts = _INLINE_LITERAL.split(text)
    for number in range(0, len(parts), 2):  # the even parts lie outside ``…``
        plain, out, last = parts[number], [], 0
        for match in _EMPHASIS.finditer(plain):
            out += [_STRAY.sub(r"\\\1", plain[last : match.start()]), match.group(0)]
            last = match.end()
        parts[number] = "".join(out) + _STRAY.sub(r"\\\1", plain[last:])
    return lead + "".join(parts)


_COLUMNS = re.compile(r"\S {2,}\S")  # text aligned in columns: "paths     where data/ … live"


def _line_block(paragraph: list[str]) -> list[str]:
    """A paragraph laid out by hand (hanging indents, one item per line) as a line block: its line
    breaks and indents kept, its inline markup still rendered."""
    base = min(len(line) - len(line.lstrip()) for line in paragraph)
    return ["| " + line[base:] for line in paragraph]


def docstring_rst(lines: list[str]) -> list[str]:
    """A plain-text docstring as reStructuredText that renders as its author laid it out: usage
    examples and "::" blocks as code, markdown tables as tables, stray "|", "*" and trailing "_"
    escaped, and, where the text is still not valid, paragraphs with hanging indents as line blocks (or,
    under a heading line ending in ":", items aligned in columns as a literal block)."""
    out = []
    for kind, block in _blocks(literal_examples(lines)):
        if kind == "table":
            block = _list_table(block)
        elif kind == "text":
            block = [_escaped(line) for line in block]
        out += block
    if _valid_rst("\n".join(out)):
        return out
    laid_out = []
    for kind, block in _blocks(out):
        indents = sorted({len(line) - len(line.lstrip()) for line in block})
        bullet = re.match(r"\s*[-*] ", block[0]) is not None and indents == [indents[0], indents[0] + 2]
        if kind != "text" or len(indents) == 1 or bullet:
            laid_out += block
        elif sum(bool(_COLUMNS.search(line)) for line in block) >= 2 and block[0].rstrip().endswith(":"):
            laid_out += [block[0], "", ".. code-block:: text", ""] + block[1:]  # columns: kept as laid out
        else:
            laid_out += _line_block(block)
    if _valid_rst("\n".join(laid_out)):
        return laid_out
    return ["::", ""] + [("    " + line) if line.strip() else "" for line in lines] + [""]


def process_docstring(app, what, name, obj, options, lines) -> None:
    lines[:] = docstring_rst(lines)


# --- glossary terms linked where a page first uses them -------------------------------------------

GLOSSARY_TERMS = {  # glossary.md's label → the words that name the term in prose
    "amax": r"\bamax\b",
    "detectable-effect": r"\bdetectable effects?\b|\bat 80 % power\b",
    "device-kind": r"\bdevice kinds?\b",
    "e8m0": r"\bE8M0\b",
    "effective-bits": r"\beffective bits\b",
    "holm": r"\bHolm\b",
    "kappa": r"κ",
    "paired-test": r"\bpaired (?:t-tests?|tests?|t)\b",
    "rht": r"\bRHT\b|\bHadamard transform\b",
    "rne-sr": r"\bRNE\b|\bstochastic rounding\b|\bSR\b",
    "seed-bug": r"\b[Tt]he seed['’]s (?:bug|backward)\b",
    "the-seed": r"\b[Tt]he seed['’]s\b",  # the seed's code (possessive): "seeds" are random seeds
    "sign-flip": r"\bsign-flip test\b",
    "sqnr": r"\bSQNR\b",
    "ste": r"\bSTE\b|\bstraight-through estimator\b",
    "tost": r"\bTOST\b",
    "wave": r"\bwaves?\b",
}


def glossary_definitions() -> dict[str, str]:
    """glossary.md's label → its definition's first sentence, as plain text (a link's tooltip)."""
    text = (DOCS / "glossary.md").read_text(encoding="utf-8")
    found = {}
    for label, body in re.findall(r"^\(([a-z0-9-]+)\)=\n(.*?)(?=\n\n|\Z)", text, flags=re.M | re.S):
        link = r"\[([^]]+)\]\([^)]+\)|\{ref\}`([^<`]+)[^`]*`"  # [text](page) or {ref}`text <label>`
        plain = re.sub(link, lambda m: m.group(1) or m.group(2), body)
        plain = re.sub(r"[*`]", "", " ".join(plain.split()))
        first = re.split(r"(?<=[a-z)])\. ", plain)[0]
        found[label] = first if len(first) <= 200 else first[: first.rindex(" ", 0, 200)] + " …"
    return found


def link_glossary_terms(app, doctree, docname: str) -> None:
    """Each glossary term's first use in a page's prose (not in code, titles, links or the
    glossary itself) made a link to its definition, with the definition as the link's tooltip."""
    from docutils import nodes
    from sphinx import addnodes

    if docname in ("glossary", "genindex", "search") or app.builder.format != "html":
        return
    skip = (nodes.literal, nodes.literal_block, nodes.reference, nodes.title, nodes.raw, nodes.math,
            nodes.math_block, nodes.rubric, nodes.target, nodes.FixedTextElement,
            addnodes.desc_signature)  # fmt: skip
    definitions = glossary_definitions()
    patterns = {label: re.compile(words) for label, words in GLOSSARY_TERMS.items()}
    glossary = app.builder.get_relative_uri(docname, "glossary")

    def in_prose(node) -> bool:
        parent = node.parent
        while parent is not None:
            if isinstance(parent, skip) or "cell_output" in parent.get("classes", []):
                return False
            parent = parent.parent
        return True

    for text in [t for t in doctree.findall(nodes.Text) if in_prose(t)]:
        while patterns:
            found = [(m.start(), label, m) for label, p in patterns.items() if (m := p.search(str(text)))]
            if not found:
                break
            _, label, match = min(found)
            del patterns[label]
            value = str(text)
            link = nodes.reference(
                "", match.group(0), refuri=f"{glossary}#{label}", internal=True,
                reftitle=definitions.get(label, ""), classes=["glossary-term"],
            )  # fmt: skip
            after = nodes.Text(value[match.end() :])
            text.parent.replace(text, [nodes.Text(value[: match.start()]), link, after])
            text = after


def generate(app) -> None:
    OUT.mkdir(exist_ok=True)
    for name in notebook_names():
        findings_page(name)
    findings_index()
    findings_summary()
    findings_pages()
    api_pages()
    benchmark_results()
    stale = {p for p in (OUT / "findings").glob("*.ipynb")} - {
        OUT / "findings" / f"{n}.ipynb" for n in notebook_names()
    }
    for path in stale:
        path.unlink()
    if not (OUT / "findings" / "figures").exists():
        shutil.rmtree(OUT / "findings" / "figures", ignore_errors=True)


def setup(app):
    app.connect("builder-inited", generate)
    app.connect("autodoc-process-docstring", process_docstring)
    app.connect("doctree-resolved", link_glossary_terms)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
