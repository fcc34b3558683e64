"""Pages written at build time, before Sphinx reads the sources, into ``docs/_generated/`` (ignored by git).

- ``findings/<notebook>.ipynb``: one page per notebook — the executed copy ``runs/<name>.ipynb`` when
  it exists (``qlab figures`` / ``qlab run`` at the default parameters), else the committed notebook
  without outputs; a first section holds the
  notebook's committed claims (``data/<name>_claims.csv`` through ``qlab.claims``, and the paper
  profile's ``data/paper/`` file beside it where one exists) and its committed figures (``figures/``).
- ``api/<module>.rst``: ``automodule`` of every module of the package.
- ``results/<file stem>.md``: the table of one file of ``benchmarks/results/`` (columns as the file holds
  them, those empty in every row left out), for a page to include (```{include}
  _generated/results/bench_quantize.md```): the docs' benchmark tables are these, never typed.
- ``benchmark_results.md``: every one of them, one section per file.

A file is rewritten only when its text changes, so an unchanged page is not read again. Docstrings that
are not valid reStructuredText (qlab writes them as plain text with markdown tables) are shown as
preformatted text instead of failing the ``-W`` build.
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
    return table.replace("{", "&#123;").replace("}", "&#125;")


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
    """The short answer a findings page opens with: the question, the answer filled from the committed
    claims, the key figure (copied beside the page)."""
    from qlab import claims as qclaims

    entry = answers().get(name)
    if entry is None:
        raise ValueError(f"docs/answers.yaml has no answer for notebook {name}")
    text = qclaims.render_committed(ROOT / "data" / f"{name}_claims.csv", entry["answer"])
    figure = ROOT / "figures" / f"{entry['figure']}.png"
    _write(folder / "figures" / figure.name, figure.read_bytes())
    return [
        "## The answer\n",
        f"**{entry['question']}**\n",
        text.replace("{", "&#123;").replace("}", "&#125;") + "\n",
        f"![{entry['figure']}](figures/{figure.name})\n",
    ]


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
        text = said.read_text(encoding="utf-8").replace("{", "&#123;").replace("}", "&#125;")
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


def results_table(path: Path) -> str:
    """The markdown a page includes for one results file: a line naming the file, then its table."""
    from qlab.results import markdown_table

    frame = results_frame(path)
    lines = [
        f"Generated from `benchmarks/results/{path.name}` ({len(frame)} rows; a benchmark run appends "
        "rows to it, with the machine, device, date, torch and commit it ran with):",
        "",
        markdown_table(frame).replace("{", "&#123;").replace("}", "&#125;"),
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
    gpu = ROOT / "benchmarks" / "results" / "bench_kernels_gpu.csv"
    if gpu.exists():
        _write(OUT / "results" / "gpu_at_a_glance.md", gpu_at_a_glance(gpu))
    stale = set((OUT / "results").glob("*.md")) - {OUT / "results" / f"{p.stem}.md" for p in paths}
    stale -= {OUT / "results" / "gpu_at_a_glance.md"}
    for path in stale:
        path.unlink()
    _write(OUT / "benchmark_results.md", "\n".join(lines))


GPU_AT_A_GLANCE = ("part", "kernel", "shape", "ms", "gbps", "percent_of_clone", "speedup", "date", "commit")


def gpu_at_a_glance(path: Path) -> str:
    """One small table per GPU of ``bench_kernels_gpu.csv``: the latest row of each (part, kernel, shape)
    — a later run of a row replaces it — and of a kernel tried at several launch settings ("…, rows per
    tile 4, 8 warps") only the fastest, with the columns a reader needs first (time, GB/s, % of a
    same-run copy, speedup over the row's baseline, date, commit)."""
    import pandas as pd

    from qlab.results import markdown_table

    frame = results_frame(path)
    latest = frame.drop_duplicates(["device", "part", "kernel", "shape"], keep="last").copy()
    latest["family"] = latest.kernel.str.split(", rows per tile").str[0]
    latest["order"] = range(len(latest))
    latest["seconds"] = pd.to_numeric(latest.ms, errors="coerce")
    fastest = latest.sort_values("seconds").drop_duplicates(["device", "part", "family", "shape"])
    fastest = fastest.sort_values("order")
    names = {"gbps": "GB/s", "percent_of_clone": "% of copy", "speedup": "× baseline"}
    lines = []
    for device, rows in fastest.groupby("device", sort=False):
        columns = [c for c in GPU_AT_A_GLANCE if c in rows and (rows[c].str.strip() != "").any()]
        table = markdown_table(rows[columns].rename(columns=names))
        lines += [f"**{device}** (`benchmarks/results/{path.name}`, the latest run of each row)", "",
                  table.replace("{", "&#123;").replace("}", "&#125;"), ""]  # fmt: skip
    return "\n".join(lines) or f"`benchmarks/results/{path.name}` holds no GPU rows.\n"


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


_CODE = re.compile(r"\w\(|\s=\s|^>>> ")


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


def process_docstring(app, what, name, obj, options, lines) -> None:
    lines[:] = literal_examples(lines)
    text = "\n".join(lines)
    if not text.strip() or _valid_rst(text) and "\n|" not in "\n" + text:
        return
    lines[:] = ["::", ""] + [("    " + line) if line.strip() else "" for line in text.splitlines()] + [""]


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
    return {"parallel_read_safe": True, "parallel_write_safe": True}
