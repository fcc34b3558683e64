"""The documentation: the project speaks only of itself, the landing page stays short, and the site
(``make docs``, Sphinx + myst-nb, ``docs/``) builds without a warning, documents every public name of
qlab and holds up in a browser.

The narration test greps README.md, docs/, qlab/, tests/, notebooks/*.py and benchmarks/ for phrases
that describe how the project was built instead of what it is — numbered work items, numbered or
ordinal rounds and sessions, issue and pull-request numbers, reviewers — and fails on each, with its
file and line. Words with a technical meaning stay allowed: ``qlab.session``, a forward/backward pass,
a two-pass variance, a timing round.

The site tests (marked ``docs``) build the site into docs/_build/html with warnings as errors (a fresh
environment, so no page is skipped as unchanged), then check Sphinx's inventory for an API entry of
every public function and class, and walk the site in Debian's Chromium through Playwright (marked
``browser`` as well): every page the navigation reaches is opened, every image on it must have
loaded (naturalWidth > 0) and every internal link must lead to a page that exists, with its anchor.
They form one xdist group (one build) that runs beside the rest of the suite: a findings page shows an
executed copy only when it ran at the default parameters, so no smoke run of the suite is rendered.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from qlab import paths

ROOT = paths.ROOT
SITE = ROOT / "docs" / "_build" / "html"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|\d+(?:st|nd|rd|th))"
)
NARRATION = [
    ("numbered work item", re.compile(r"\bwork[- ]items? (?:#|no\.? ?)?\d+", re.I)),
    ("numbered item", re.compile(r"\bitems? #?\d+\b(?!\s*[×x*])", re.I)),
    (
        "ordinal round",
        re.compile(rf"\b(?:{_ORDINAL}|this|previous|next|last|earlier|later) rounds?\b(?! to\b)", re.I),
    ),
    ("numbered round", re.compile(r"\bround #?[1-9]\d*\b(?! ?[×x])", re.I)),
    ("rounds of work", re.compile(r"\brounds? of (?:work|review|fixes)\b", re.I)),
    ("numbered pass", re.compile(r"\bpass #?\d+\b(?!\.\d)", re.I)),
    (
        "pass as a round of work",
        re.compile(
            r"\b(?:third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)|this|previous|"
            r"earlier|later|last) pass\b|\bpass by pass\b|\b(?:each|every) pass of work\b",
            re.I,
        ),
    ),
    (
        "session as a period of work",
        re.compile(
            rf"\b(?:{_ORDINAL}|this|that|previous|next|last|earlier|later|same|another|two|three|four|"
            r"five) sessions?\b|\b(?:in|during|from|since) (?:a|the|one|this|that) session\b",
            re.I,
        ),
    ),
    ("issue or pull-request number", re.compile(r"\b(?:issues?|PRs?|pull requests?) #?\d+\b", re.I)),
    ("reviewers", re.compile(r"\breviewers?\b|\breviewed by\b", re.I)),
    (
        "a run to come or one gone",
        re.compile(
            r"\bnext (?:GPU |CPU )?run\b|\bnot been (?:run|measured|timed) yet\b|\bold kernel\b", re.I
        ),  # fmt: skip
    ),
    (
        "a change told as history",
        re.compile(r"(?:^|[.;:] |^\s*(?:#|//|\*)\s*)(?:Before|Previously|Formerly),"),
    ),
]
SELF = Path(__file__).resolve()


def _narration_files() -> list[Path]:
    files = [ROOT / "README.md"]
    docs = ROOT / "docs"
    files += [p for p in docs.rglob("*") if p.suffix in (".md", ".py", ".rst") and "_build" not in p.parts]
    files = [p for p in files if "_generated" not in p.parts]
    files += [p for p in (ROOT / "qlab").rglob("*") if p.suffix in (".py", ".c", ".h")]
    files += sorted((ROOT / "tests").glob("*.py"))
    files += sorted((ROOT / "notebooks").glob("*.py"))
    files += [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".md", ".sh")]
    return sorted(p for p in set(files) if p.is_file() and p.resolve() != SELF)


def narration(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) for every phrase of process narration in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in NARRATION:
            if pattern.search(line):
                found.append((number, kind, line.strip()))
    return found


@pytest.mark.parametrize(
    "text",
    [
        "Fixed in the second round of the kernel work.",
        "see round 2 of the benchmarks",
        "work item 3: the advisor",
        # literals split so that the phrases the test must catch do not stand in this file themselves
        "as measured in this ses" + "sion",
        "after the third pa" + "ss the probes were faster",
        "this pa" + "ss made the C kernel faster",
        "the targets of iss" + "ue 39",
        "(iss" + "ue #12)",
        "the review" + "ers found the names unclear",
        "Probe overhead, pass by pass",
        "the next GPU r" + "un of this table measures both",
        "the paper profile has not been r" + "un yet",
        "(it fails on the old ker" + "nel)",
        "splits the integers. Bef" + "ore, torch's ops also ran the copy",
        "# Previous" + "ly, the scale was computed twice",
    ],
)
def test_the_narration_patterns_catch_process_phrases(text):
    assert narration(text), text


@pytest.mark.parametrize(
    "text",
    [
        "device = session.start(NAME, globals()).device",
        '@pytest.fixture(scope="session")',
        "one forward and backward pass per micro-batch",
        "a second pa" + "ss over the block, Σ(x − mean)²",
        "two-pa" + "ss variance; the first pa" + "ss computes the mean",
        "the median over rounds of its step / the unprobed step of the same round",
        "round 0 is a warm-up",
        "values that round to zero stay −0",
        "the kernel cuts the columns into work items about 256 to 4096 wide",
        "for item in items:",
        "    pass",
        "Before the first step, the scales are computed from the weights.",
    ],
)
def test_the_narration_patterns_leave_technical_words_alone(text):
    assert not narration(text), narration(text)


def test_the_project_speaks_only_of_itself():
    """No file names rounds of work, work items, sessions, issue numbers or reviewers."""
    found = []
    for path in _narration_files():
        for number, kind, line in narration(path.read_text(errors="replace")):
            found.append(f"{path.relative_to(ROOT)}:{number}: {kind}: {line[:120]}")
    assert not found, "process narration (say what the code is and does instead):\n" + "\n".join(found)


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for link in ("docs/_build/html/index.html", "make docs"):
        assert link in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "the README is not dated"


def test_docstrings_cite_pages_of_the_repository():
    """A "§" reference names the reference page, and each section it names exists there."""
    reference = (ROOT / "docs" / "reference.md").read_text()
    sections = set(re.findall(r"^## §(\d+)\.", reference, re.M))
    stale = []
    for path in [
        *(ROOT / "qlab").rglob("*.py"),
        *(ROOT / "tests").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
    ]:
        if path.resolve() == SELF:
            continue
        text = path.read_text()
        if "REFERENCE" in text.replace("REFERENCES", ""):
            stale.append(f"{path.relative_to(ROOT)}: cites REFERENCE, which is not in the repository")
        for section in re.findall(r"docs/reference\.md §(\d+)", text):
            if section not in sections:
                stale.append(f"{path.relative_to(ROOT)}: docs/reference.md has no §{section}")
    assert not stale, "\n".join(stale)


# --- the site --------------------------------------------------------------------------------------


def public_names() -> dict[str, list[str]]:
    """Every module of qlab and the functions and classes it defines under a public name."""
    import qlab

    names = {"qlab": []}
    for info in pkgutil.walk_packages(qlab.__path__, "qlab."):
        if info.name.endswith(".__main__"):  # runs a training launcher when imported
            continue
        module = importlib.import_module(info.name)
        names[info.name] = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == info.name
        ]
    return names


@pytest.fixture(scope="session")
def site():
    """docs/_build/html, built now with warnings as errors (``make docs``' command), once per test run:
    an xdist worker tears its session fixtures down whenever its queue runs dry, so the build leaves a
    stamp naming the run (pytest-xdist's testrunuid) and a later setup in the same run reads it."""
    from filelock import FileLock

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    stamp = SITE.parent / ".built-for-test-run"
    SITE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(SITE.parent / ".site.lock")):
        if run and stamp.is_file() and stamp.read_text() == run and (SITE / "index.html").is_file():
            return SITE
        stamp.unlink(missing_ok=True)
        _build_site()
        if run:
            stamp.write_text(run)
    return SITE


def _build_site() -> None:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("QLAB_RESULTS_DIR", None)
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-E",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        "docs",
        str(SITE),
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the docs build failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"


@pytest.mark.docs
@pytest.mark.xdist_group("docs")
def test_every_public_name_has_an_api_entry(site):
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    inventory = getattr(inventory, "data", inventory)  # an Inventory (Sphinx ≥ 8.2) or a plain dict
    documented = {
        name
        for kind in ("py:function", "py:class", "py:exception", "py:module", "py:data", "py:attribute")
        for name in inventory.get(kind, {})
    }
    missing = [
        f"{module}.{name}" if name else module
        for module, names in public_names().items()
        for name in ["", *names]
        if (f"{module}.{name}" if name else module) not in documented
    ]
    assert not missing, f"public names without an API entry: {missing}"


def in_chromium(test):
    """A test of the built site in Debian's Chromium: marked docs and browser, run beside the docs build."""
    marks = [
        pytest.mark.docs,
        pytest.mark.browser,
        pytest.mark.xdist_group("docs"),
        pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium"),
    ]
    for mark in reversed(marks):
        test = mark(test)
    return test


def _walk(site: Path):
    """Open every page the navigation reaches; yield (page, images that did not load, broken links)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        start = (site / "index.html").resolve().as_uri()
        queue, seen, results, ids = [start], set(), [], {}
        while queue:
            url = queue.pop(0)
            if url in seen:
                continue
            seen.add(url)
            response = page.goto(url, wait_until="load")
            assert response is None or response.ok, f"{url} did not open"
            page.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
            broken_images = page.evaluate(
                "() => Array.from(document.images).filter(i => i.naturalWidth === 0).map(i => i.src)"
            )
            ids[url] = set(
                page.evaluate("() => Array.from(document.querySelectorAll('[id]')).map(e => e.id)")
            )
            links = page.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
            navigation = page.evaluate(
                "() => Array.from(document.querySelectorAll('nav a[href], .bd-sidebar a[href], "
                "a.reference.internal[href]')).map(a => a.href)"
            )
            results.append((url, broken_images, links))
            for link in navigation:
                target = link.split("#")[0]
                if target.startswith("file://") and target.endswith(".html") and target not in seen:
                    queue.append(target)
        broken = []
        for url, _, links in results:
            for link in links:
                if not link.startswith("file://"):
                    continue
                target, _, anchor = link.partition("#")
                path = Path(urllib.parse.unquote(urllib.parse.urlparse(target).path))
                if not path.exists():
                    broken.append((url, link))
                elif anchor and path.suffix == ".html":
                    if target not in ids:
                        page.goto(target, wait_until="load")
                        ids[target] = set(
                            page.evaluate(
                                "() => Array.from(document.querySelectorAll('[id]')).map(e => e.id)"
                            )
                        )
                    if urllib.parse.unquote(anchor) not in ids[target]:
                        broken.append((url, link))
        browser.close()
    return results, broken


@in_chromium
def test_the_site_walks_in_chromium_every_image_loads_and_no_internal_link_is_broken(site):
    results, broken = _walk(site)
    pages = {Path(urllib.parse.urlparse(url).path).relative_to(site).as_posix() for url, _, _ in results}
    expected = {"index.html", "getting_started.html", "reference.html", "findings.html", "benchmarks.html"}
    expected |= {f"_generated/findings/{p.stem}.html" for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py")}
    assert expected <= pages, f"not reached from the navigation: {sorted(expected - pages)}"
    assert len(pages) >= 60, f"only {len(pages)} pages reached"
    images = [(url, src) for url, missing, _ in results for src in missing]
    assert not images, f"images that did not load: {images}"
    assert not broken, f"broken internal links: {broken[:20]}"
    shown = sum(1 for url, _, _ in results if "_generated/findings/" in url)
    assert shown == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.py")))


@contextlib.contextmanager
def _browser_page(site: Path, start: str = "index.html"):
    """A Chromium page at 1400 × 900 opened on ``start`` of the built site."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto((site / start).resolve().as_uri(), wait_until="load")
        try:
            yield page
        finally:
            browser.close()


def _click(page, selector: str, text: str) -> None:
    page.locator(selector).filter(has_text=re.compile(text)).first.click()
    page.wait_for_load_state("load")


@in_chromium
def test_from_home_the_gpu_table_s_time_column_is_in_view_without_scrolling(site):
    with _browser_page(site) as page:
        _click(page, ".bd-sidebar a, nav a", r"^\s*Benchmarks\s*$")
        assert page.url.endswith("benchmarks.html"), page.url
        table = page.locator("#on-the-gpu-at-a-glance table").first
        boxes = [table.locator("th").filter(has_text=re.compile(rf"^\s*{name}\s*$")).first.bounding_box()
                 for name in ("ms", "% of floor", "measured")]  # fmt: skip
        scrolled = table.evaluate("t => (t.closest('.pst-scrollable-table-container') || t).scrollLeft")
        devices = page.locator("#on-the-gpu-at-a-glance h3").all_text_contents()
    for box in boxes:  # the time, the floor and when it was measured, all in view
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 1400, boxes
    assert scrolled == 0
    assert any("H100" in d for d in devices) and any("H200" in d for d in devices), devices


@in_chromium
def test_from_home_a_findings_page_shows_its_answer_and_key_figure_in_the_first_screen(site):
    with _browser_page(site) as page:
        _click(page, ".bd-sidebar a, nav a", r"^\s*Findings\s*$")
        _click(page, "a:visible", r"Does LayerNorm need Welford")
        assert page.url.endswith("_generated/findings/02_welford_vs_naive_variance.html"), page.url
        page.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
        answer = page.locator("#the-answer p").nth(1).bounding_box()  # the question, then the answer
        figure = page.locator("#the-answer img").first.bounding_box()
        claims_open = page.locator("#claims details").first.evaluate("d => d.open")
        kappa = page.locator("#the-answer a.glossary-term").filter(has_text="κ").first.get_attribute("href")
    assert kappa is not None and kappa.endswith("glossary.html#kappa"), kappa  # a term linked at first use
    assert answer is not None and 0 <= answer["y"] < 900, answer
    assert figure is not None and 0 <= figure["y"] < 900 and figure["height"] > 100, figure
    assert claims_open is False  # the claims table is there, collapsed


@in_chromium
@pytest.mark.parametrize("page_name", ["getting_started.html", "models.html", "your_model.html"])
def test_code_blocks_wrap_instead_of_running_off_the_page(site, page_name):
    with _browser_page(site, page_name) as page:
        cut = page.evaluate(
            "() => Array.from(document.querySelectorAll('div.highlight pre'))"
            ".filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 60))"
        )
        blocks = page.locator("div.highlight pre").count()
    assert blocks > 0 and cut == [], cut


def test_every_findings_page_has_a_short_answer_filled_from_its_committed_claims():
    import yaml

    from qlab import claims

    answers = yaml.safe_load((ROOT / "docs" / "answers.yaml").read_text())
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert sorted(answers) == notebooks
    for name, entry in answers.items():
        also = sorted((ROOT / "data").glob(f"{name}_claims_*.csv"))
        path = ROOT / "data" / f"{name}_claims.csv"
        text = claims.render_committed(path, entry["answer"], also=also)  # KeyError: drift
        assert "{" not in text and entry["question"].endswith("?")
        assert len(text.split()) <= 70, f"{name}'s answer runs to {len(text.split())} words: {text}"
        assert "Holm" not in text and "TOST" not in text  # the tests' names belong under "How sure"
        assert entry["evidence"] and all(claims.render_committed(path, f"{{{key}:verdict}}", also=also)
                                         for key in entry["evidence"])  # fmt: skip
        assert (ROOT / "figures" / f"{entry['figure']}.png").exists(), entry["figure"]
        # the caption says how to read the figure; numbers come from the claims, never typed there
        # the intervals' level is a method and a notebook's number a name, not results
        method = re.sub(r"95 %|notebooks? \d\d(?: and \d\d)?", "", entry["caption"])
        assert 5 <= len(entry["caption"].split()) <= 40  # a number, not a name's digits (FP32, float64):
        assert not re.search(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)", method), entry["caption"]


# --- benchmarks as data ---------------------------------------------------------------------------

TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|ns|[GT]B/s|TFLOP/s)(?!\w)")
TIMING_COLUMN = re.compile(r"^\|.*\((?:ms|µs|ns|s|GB/s)\)", re.M)


def _prose(text: str) -> str:
    """A page's markdown without fenced code blocks (directives too) and inline code."""
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", text, flags=re.M | re.S)
    return re.sub(r"(`+).+?\1", "", text, flags=re.S)


def typed_timings(text: str) -> list[str]:
    """Timings typed into a page's markdown: a number with ms, µs, ns, GB/s, TB/s or TFLOP/s, or a table
    column headed "(ms)", "(s)" …, outside fenced code blocks and inline code."""
    text = _prose(text)
    return [m.group(0) for m in TIMING.finditer(text)] + [
        m.group(0)[:60] for m in TIMING_COLUMN.finditer(text)
    ]


@pytest.mark.parametrize(
    "text, found",
    [
        ("| kernel | Triton (ms) |\n|---|---:|\n| fp8 | 0.230 |", True),
        ("LayerNorm took 0.461 ms against 0.47 ms.", True),
        ("peak 3350 GB/s", True),
        ("a call on 64 elements took 2.2 µs", True),
        ("```python\nx = 5  # 3 ms\n```\n", False),
        ("`torch.add(x, 0)` and `--peak-gbps GB/s`", False),
        ("4096×4096 float32, 64 MiB, 16 × 128 tokens, ≤ 1.3 ×, 2⁻⁸ ulps, items of 16 rows", False),
    ],
)
def test_the_timing_pattern(text, found):
    assert bool(typed_timings(text)) is found, typed_timings(text)


RESULT = re.compile(r"(?<![\w.±])[−-]?\d+(?:\.\d+)?\s?(?:dB|nats(?:/char)?|bits/char)(?![\w/])")


def typed_results(text: str) -> list[str]:
    """Measured results typed into a page's markdown: a number in dB, nats or nats/char outside code
    (a declared margin, written ±x, is a parameter, not a result)."""
    return [m.group(0) for m in RESULT.finditer(_prose(text))]


@pytest.mark.parametrize(
    "text, found",
    [
        ("a tensor can read 38 dB while a tenth flushes", True),
        ("unigram entropy 3.311 nats/char", True),
        ("NVIDIA's keeps 18–20 dB", True),
        ("equivalence within ±0.005 nats (TOST)", False),
        ("SQNR in dB, losses in nats", False),
        ("```\nloss 2.41 nats\n```\n", False),
    ],
)
def test_the_result_pattern(text, found):
    assert bool(typed_results(text)) is found, typed_results(text)


def test_no_page_types_a_result():
    """Results reach the pages from data/ (findings tables, claims); no page types one."""
    found = [
        f"{path.relative_to(ROOT)}: {number}"
        for path in sorted((ROOT / "docs").glob("*.md"))
        for number in typed_results(path.read_text())
    ]
    assert not found, "typed results (generate them from data/ instead):\n" + "\n".join(found)


def test_no_page_types_a_benchmark_timing():
    """Benchmark numbers live in benchmarks/results/ and reach the pages as the tables the docs build
    generates from those files (``{include} _generated/results/<stem>.md``); no page types one."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for timing in typed_timings(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}: {timing}")
    assert not found, (
        "typed timings (record them in benchmarks/results/ and include the table):\n" + "\n".join(found)
    )


@pytest.mark.docs
@pytest.mark.xdist_group("docs")
def test_each_page_links_a_glossary_term_where_it_first_uses_it(site):
    link = re.compile(
        r'<a class="[^"]*glossary-term[^"]*" href="[^"]*glossary.html#([a-z0-9-]+)"[^>]*>([^<]+)</a>'
    )
    linked = {}
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        labels = [label for label, _ in link.findall(html)]
        assert len(labels) == len(set(labels)), f"{page.name} links a term twice: {labels}"
        # never inside code, a heading or another link
        inside = r"<(code|pre|h[1-6])\b[^>]*>(?:(?!</\1>).)*glossary-term"
        assert not re.search(inside, html, flags=re.S), page
        linked[page.relative_to(site).as_posix()] = set(labels)
    assert "glossary.html" not in linked or linked["glossary.html"] == set()
    assert {"sqnr", "e8m0", "amax"} <= linked["formats_and_scaling.html"]
    assert {"ste", "amax"} <= linked["probes.html"] | linked["recipes.html"]
    assert {"holm", "tost", "paired-test"} <= linked["findings.html"]
    assert "seed-bug" in linked["_generated/findings/01_gradient_norm_discrepancy.html"]


def _words_between_headings(text: str) -> list[int]:
    """Words of prose (fenced blocks left out, tables counted) between one heading and the next."""
    counts, words, fence = [], 0, None
    for line in text.splitlines():
        opening = re.match(r"^(`{3,}|~{3,})", line)
        if fence:
            fence = None if line.startswith(fence) and not line.strip(fence[0]).strip() else fence
            continue
        if opening:
            fence = opening.group(1)
        elif re.match(r"^#{1,6} ", line):
            counts, words = counts + [words], 0
        else:
            words += len(line.split())
    return counts + [words]


@pytest.mark.parametrize(
    "page", sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "glossary.md")
)
def test_no_page_runs_on_for_more_than_500_words_without_a_heading(page):
    """A reader scans a page by its headings (and the site's table of contents); the glossary is a
    list of definitions, each its own target."""
    longest = max(_words_between_headings((ROOT / "docs" / page).read_text(encoding="utf-8")))
    assert longest <= 500, f"docs/{page} has {longest} words between two headings"


def test_every_glossary_term_is_linked_from_a_page_that_uses_it():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    labels = re.findall(r"^\(([a-z0-9-]+)\)=$", glossary, flags=re.MULTILINE)
    assert len(labels) >= 10, labels
    pages = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md") if p.name != "glossary.md"}
    unlinked = [label for label in labels if not any(f"<{label}>`" in text for text in pages.values())]
    assert unlinked == [], f"glossary terms no page links to: {unlinked}"
    assert "glossary" in (ROOT / "docs" / "index.md").read_text()


def test_a_docstring_s_usage_example_becomes_a_literal_block_and_prose_stays_prose():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qlab_docs", ROOT / "docs" / "_ext" / "qlab_docs.py")
    qlab_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qlab_docs)
    lines = ["What it does.", "", "    y = f(x)            # a call", "    z = g(y)", "", "Then prose."]
    assert qlab_docs.literal_examples(lines) == ["What it does.", "", "::", "", *lines[2:]]
    quoted = ["A list:", "", "    the first meaning, in words", "", "More."]
    assert qlab_docs.literal_examples(quoted) == quoted
    already = ["Example::", "", "    y = f(x)"]
    assert qlab_docs.literal_examples(already) == already


def _qlab_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qlab_docs", ROOT / "docs" / "_ext" / "qlab_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE_AB_12 = [  # the markdown table | a | b | over | 1 | 2 | as reStructuredText
    ".. list-table::", "   :header-rows: 1", "", "   * - a", "     - b", "   * - 1", "     - 2", ""
]  # fmt: skip


@pytest.mark.parametrize(
    "docstring, expected",
    [  # plain text as qlab writes it → the reStructuredText the API pages get
        ("Counts of |x| per binade.", ["Counts of \\|x\\| per binade."]),
        ("Every notebooks/*.py, *really*.", ["Every notebooks/\\*.py, *really*."]),
        ("notebooks/*.py and tests/*.py", ["notebooks/\\*.py and tests/\\*.py"]),
        ("As clip_grad_norm_ applied it; ``x_`` kept.", ["As clip_grad_norm\\_ applied it; ``x_`` kept."]),
        (
            "Specs:\n\n| a | b |\n|---|---|\n| 1 | 2 |",
            ["Specs:", "", *TABLE_AB_12],
        ),
        (
            "Attributes:\n  size: a count;\n  rows: the rows, laid\n    over two lines.",
            ["| Attributes:", "|   size: a count;", "|   rows: the rows, laid", "|     over two lines."],
        ),
        ("Valid already:\n\n- an item\n  continued\n- another", None),
        (
            "Modules:\n    paths     where things live\n    kernels   the fast path,\n              compiled",
            [
                "Modules:",
                "",
                ".. code-block:: text",
                "",
                "    paths     where things live",
                "    kernels   the fast path,",
                "              compiled",
            ],
        ),
        ("* a starred item\n* another", None),
        (  # a "|" inside ``…`` or escaped stays in its cell; a short row gets empty cells
            "T:\n\n| k | rule |\n|---|---|\n| ``|x|`` | a \\| b |\n| all |",
            [
                "T:",
                "",
                ".. list-table::",
                "   :header-rows: 1",
                "",
                "   * - k",
                "     - rule",
                "   * - ``|x|``",
                "     - a \\| b",
                "   * - all",
                "     - ..",
                "",
            ],
        ),
        (  # a table in a docstring that needs line blocks elsewhere stays a table
            "T:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            "Items:\n  size: a count;\n  rows: the rows, laid\n    over two.",
            [
                "T:",
                "",
                *TABLE_AB_12,
                "",
                "| Items:",
                "|   size: a count;",
                "|   rows: the rows, laid",
                "|     over two.",
            ],
        ),
        (
            "A doctest:\n\n>>> f(|x|)\n1\n\nAfter |x|.",
            ["A doctest:", "", ">>> f(|x|)", "1", "", "After \\|x\\|."],
        ),
        ("Run it:\n\n    qlab run 02 --smoke", ["Run it:", "", "::", "", "    qlab run 02 --smoke"]),
    ],
)
def test_a_plain_text_docstring_becomes_restructuredtext_that_renders_as_laid_out(docstring, expected):
    qlab_docs = _qlab_docs()
    lines = docstring.splitlines()
    out = qlab_docs.docstring_rst(lines)
    assert out == (lines if expected is None else expected)
    assert qlab_docs._valid_rst("\n".join(out))


def test_the_gpu_glance_keeps_each_part_s_latest_run_and_a_kernel_s_fastest_setting(tmp_path):
    qlab_docs = _qlab_docs()
    head = "machine,device,date,commit,part,shape,kernel,ms,gbps,percent_of_clone,speedup\n"
    rows = [
        "m,GPU A,2026-01-01,aaa,linear,4×4,fp8_delayed (gemm unrecorded),27.5,,,",  # an older run of the part
        'm,GPU A,2026-01-02,bbb,linear,4×4,"fp8_delayed, gemm=scaled_mm",27.2,,,0.08',
        'm,GPU A,2026-01-02,bbb,ln,8×8,"forward, rows per tile 1, 4 warps",0.3,,,1.1',
        'm,GPU A,2026-01-02,bbb,ln,8×8,"forward, rows per tile 4, 8 warps",0.1,900,87,1.2',  # the fastest
    ]
    (tmp_path / "bench_kernels_gpu.csv").write_text(head + "\n".join(rows) + "\n")
    (tmp_path / "bench_train_gpu.csv").write_text(
        "machine,device,date,commit,model,mode,compile_mode,recipe,ratio\n"
        "m,GPU B,2026-01-03,ccc,CharGPT,compiled,default,fp32,1.00\n"
        "m,GPU B,2026-01-03,ccc,CharGPT,compiled,default,mxfp8,1.52 (1.48–1.55)\n"
    )
    text = qlab_docs.gpu_at_a_glance(tmp_path)
    assert "gemm unrecorded" not in text and "2026-01-01" not in text
    assert "| linear: fp8_delayed, gemm=scaled_mm | 4×4 | 27.2 |" in text
    assert "rows per tile 4, 8 warps | 8×8 | 0.1 | 900 | 87 | 1.2 | 2026-01-02 · bbb |" in text
    assert "rows per tile 1" not in text
    assert "| ms | GB/s | % of floor | × baseline | measured |" in text
    gpu_b = text[text.index("### GPU B") :]
    assert "| CharGPT | compiled, default | mxfp8 | 1.52 (1.48–1.55) | 2026-01-03 · ccc |" in gpu_b
    assert text.index("### GPU A") < text.index("### GPU B")
    # a file with a header and no rows, or without the columns a table needs, shows nothing
    (tmp_path / "bench_kernels_gpu.csv").write_text(head)
    (tmp_path / "bench_train_gpu.csv").write_text("machine,device,date\nm,GPU B,2026-01-03\n")
    assert qlab_docs.gpu_at_a_glance(tmp_path) == "`benchmarks/results/` holds no GPU rows.\n"


def test_the_scoring_time_sentence_is_the_latest_run_on_the_largest_model(tmp_path):
    qlab_docs = _qlab_docs()
    path = tmp_path / "bench_plan.csv"
    path.write_text(
        "machine,date,commit,model,score,layers,calibration_batches,tokens,seconds\n"
        "VM A,2026-01-01,aaa,big,measured,200,3,64,790.5\n"  # an older run: left out
        "VM A,2026-01-02,bbb,big,measured,200,3,64,1756.81\n"
        "VM A,2026-01-02,bbb,big,measured,200,3,64,1756.81\n"  # one row per budget: said once
        "VM A,2026-01-02,bbb,big,approximated,200,3,64,27.65\n"
        "VM A,2026-01-02,bbb,small,measured,37,3,64,31.92\n"  # a smaller model: left out
    )
    text = qlab_docs.scoring_time(path)
    assert "big's 200 layers on 3 calibration batches of 64 tokens" in text
    assert "measured 1757 s, approximated 28 s (VM A, 2026-01-02" in text
    assert "790" not in text and "small" not in text
    assert "no timed run" in qlab_docs.scoring_time(tmp_path / "absent.csv")


def test_a_results_table_says_the_values_every_row_shares_once(tmp_path):
    """A column of one value is said above the table, not repeated down it; a file of one row, or
    columns that vary, stay in the table."""
    qlab_docs = _qlab_docs()
    path = tmp_path / "bench_x.csv"
    path.write_text(
        "machine,device,date,recipe,ratio,note\n"
        "VM A,cpu,2026-01-01,mxfp8,1.5,\n"
        "VM A,cpu,2026-01-01,nvfp4,2.5,\n"
    )
    text = qlab_docs.results_table(path)
    assert "(2 rows;" in text and "Every row has machine VM A; device cpu; date 2026-01-01:" in text
    assert "| recipe | ratio |" in text and "| nvfp4 | 2.5 |" in text and "note" not in text
    path.write_text("machine,device,ratio\nVM A,cpu,1.5\n")
    one_row = qlab_docs.results_table(path)
    assert "Every row" not in one_row and "| machine | device | ratio |" in one_row


@pytest.mark.parametrize(
    "written, shown",
    [
        ("0.8940199613571167", "0.894"),  # float32 printed in full: four significant digits
        ("1.230481665654576e-06", "1.23e-06"),
        ("-0.36040782928466797", "-0.3604"),
        ("4.4991", "4.4991"),  # six or fewer significant digits: as written
        ("790.5", "790.5"),
        ("0.000123456", "0.000123456"),  # leading zeros are not significant
        ("12345678", "12345678"),  # an integer is never rounded
        ("135475200.0", "135475200.0"),  # nor one pandas wrote as a float (an int column with gaps)
        ("nan", "nan"),
        ("0.9999999403953552", "0.9999999"),  # float32's value below 1: never "1", which reads as exact
        ("-1.0000001192092896", "-1.0000001"),
        ("2.00001234567", "2.00001"),  # digits are added only until the value no longer reads whole
        ("1.11 (1.08–1.15)", "1.11 (1.08–1.15)"),  # text stays text
        ("", ""),
    ],
)
def test_a_results_table_shortens_only_long_decimals(written, shown):
    assert _qlab_docs()._shown_number(written) == shown


def test_a_results_table_puts_an_estimate_and_its_interval_in_one_column(tmp_path):
    path = tmp_path / "bench_y.csv"
    path.write_text(
        "machine,score,spearman,spearman_low,spearman_high,seconds\n"
        "VM A,measured,0.2150001234,0.102,0.322,790.5\n"
        "VM A,fisher,,,,11.98\n"
        "VM A,other,-0.36040782928466797,-0.47,-0.25,1.0\n"
        "VM A,tiny,1e-06,1e-07,2,3.0\n"
    )
    text = _qlab_docs().results_table(path)
    assert "| score | spearman (low–high) | seconds |" in text
    assert "| measured | 0.215 (0.102–0.322) | 790.5 |" in text and "| fisher |  | 11.98 |" in text
    assert "| other | -0.3604 (-0.47 to -0.25) | 1.0 |" in text and "spearman_low" not in text
    assert "| tiny | 1e-06 (1e-07–2) | 3.0 |" in text  # an exponent's minus is no negative bound


def test_no_public_docstring_falls_back_to_preformatted_text():
    import qlab

    qlab_docs = _qlab_docs()
    preformatted = []
    for module_name in qlab_docs.modules():
        module = importlib.import_module(module_name)
        objects = [(module_name, module)]
        for name in qlab_docs.public_names(module_name):
            obj = getattr(module, name)
            objects.append((f"{module_name}.{name}", obj))
            if inspect.isclass(obj):
                members = [(attr, value) for attr, value in vars(obj).items() if not attr.startswith("_")]
                objects += [(f"{module_name}.{name}.{attr}", value) for attr, value in members
                            if inspect.isfunction(value) or isinstance(value, property)]  # fmt: skip
        for name, obj in objects:
            doc = inspect.getdoc(obj)
            shown = qlab_docs.docstring_rst(doc.splitlines()) if doc else []
            if shown[:2] == ["::", ""] and not doc.startswith("::"):
                preformatted.append(name)
    assert qlab is not None and preformatted == []


def test_only_a_finished_copy_at_the_default_parameters_is_shown_as_executed():
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("qlab_docs", ROOT / "docs" / "_ext" / "qlab_docs.py")
    qlab_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qlab_docs)
    name = "02_welford_vs_naive_variance"

    def copy(parameters, exception=None, executed=True):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("x = 1", execution_count=1 if executed else None)]
        nb.metadata["papermill"] = {"parameters": parameters, "exception": exception}
        return nb

    assert qlab_docs._at_the_defaults(copy({}), name)
    assert qlab_docs._at_the_defaults(copy({"smoke": False}), name)  # a default given explicitly
    assert not qlab_docs._at_the_defaults(copy({"smoke": True}), name)
    assert not qlab_docs._at_the_defaults(copy({"profile": "paper"}), name)  # 02 has no profile
    assert not qlab_docs._at_the_defaults(copy({}, exception=True), name)  # a copy kept from a failure
    assert not qlab_docs._at_the_defaults(copy({}, executed=False), name)  # a copy still being written
    assert not qlab_docs._at_the_defaults(nbformat.v4.new_notebook(), name)  # not written by papermill
