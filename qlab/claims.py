"""Findings as data: a notebook computes each claim it states, saves them, and renders its text from them.

    claims = Claims(run)                                     # run = session.start(NAME, globals())
    claims.paired("gap.nvfp4", differences, family="gaps", text="nvfp4 − FP32 validation loss", unit="nats")
    claims.holm("gaps")                                      # Holm over the family, named in every verdict
    claims.equivalence("same.mxfp8", differences, margin=0.01, text="mxfp8 − FP32", unit="nats")
    claims.value("fp32.loss", 2.41, low=2.40, high=2.42, n=3, text="FP32 validation loss", unit="nats")
    claims.save()                                            # data/<notebook>_claims.csv
    display(Markdown(claims.render("FP32 ends at {fp32.loss}; nvfp4: {gap.nvfp4} ({gap.nvfp4:verdict})")))

A placeholder ``{key}`` shows the value and its interval as the claim's digits say ("+0.0034
[−0.0012, +0.0080]"); ``{key:value}``, ``{key:interval}``, ``{key:p}`` and ``{key:n}`` show one part;
``{key:verdict}`` states what the test says: "resolved: paired t over 5 seeds, Holm-adjusted p = 0.003
(14 comparisons)", or "not resolved (Holm-adjusted p = 0.41); these 5 seeds detect 0.0093 nats at 80 %
power", or "equivalent within ±0.01 nats (TOST p = 0.002)". The text rendered from a run whose
parameters differ from the committed defaults starts with a banner naming them, so a smoke or
interactive run never reads like the committed findings. Rendered lines are joined into paragraphs
without hard wraps, so a number never begins a line and turns it into a numbered list.

The claims file holds one row per claim: key, text, value, low, high, n, test, p (raw), p_adjusted,
family, margin, detectable, unit, digits, headline — what ``qlab findings`` builds the README's table
from (headline claims only) and what the drift tests recompute from the committed data.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import pandas as pd

from qlab import checks, paths, stats

ALPHA = 0.05
COLUMNS = (
    "key", "text", "value", "low", "high", "n", "test", "p", "p_adjusted", "family", "margin", "detectable",
    "unit", "digits", "headline",
)  # fmt: skip
_KEY = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.+-]+)(?::([a-z_]+))?\}")
PARTS = ("value", "interval", "p", "n", "verdict", "text", "both")


@dataclass
class Claim:
    """One stated number: its value, 95 % interval, sample size, the test behind it and its p."""

    key: str
    text: str
    value: float
    low: float = math.nan
    high: float = math.nan
    n: int = 0
    test: str = ""  # "paired t", "TOST", "observed" (a single observation), "computed" (exact)
    p: float = math.nan
    p_adjusted: float = math.nan
    family: str = ""
    margin: float = math.nan
    detectable: float = math.nan
    unit: str = ""
    digits: int = 4
    headline: bool = False
    family_size: int = field(default=0, repr=False)

    def __post_init__(self):
        for name in ("key", "text", "test", "family", "unit"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {checks.shown(getattr(self, name))}")
        for name in ("value", "low", "high", "p", "p_adjusted", "margin", "detectable"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isnan(value)):  # NaN: not stated
                checks.number(name, value, finite=False)
        for name in ("n", "family_size"):
            checks.integer(name, getattr(self, name), low=0)
        checks.integer("digits", self.digits, low=0, high=17)
        checks.boolean("headline", self.headline)

    def number(self, x: float, signed: bool) -> str:
        if not math.isfinite(x):
            return "—"
        text = f"{x:+.{self.digits}f}" if signed else f"{x:.{self.digits}f}"
        out_of_range = abs(x) >= 10 ** (self.digits + 2) or (x != 0 and abs(x) < 10 ** (-self.digits))
        if self.digits > 0 and out_of_range:  # digits=0: a count, written out whatever its size
            text = f"{x:+.{self.digits - 1}e}" if signed else f"{x:.{self.digits - 1}e}"
        return text.replace("-", "−")

    @property
    def signed(self) -> bool:
        return self.test in ("paired t", "TOST")

    def interval(self) -> str:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return ""
        return f"[{self.number(self.low, self.signed)}, {self.number(self.high, self.signed)}]"

    def both(self) -> str:
        shown = self.number(self.value, self.signed)
        interval = self.interval()
        unit = f" {self.unit}" if self.unit else ""
        return f"{shown} {interval}{unit}" if interval else f"{shown}{unit}"

    def p_text(self) -> str:
        p = self.p_adjusted if math.isfinite(self.p_adjusted) else self.p
        if not math.isfinite(p):
            return "—"
        return "< 0.001" if p < 0.001 else f"= {p:.3f}"

    def verdict(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.test == "TOST":
            if self.p <= ALPHA:
                return (
                    f"equivalent within ±{self.margin:g}{unit} (TOST over {self.n} seeds, p {self.p_text()})"
                )
            return (
                f"not shown equivalent within ±{self.margin:g}{unit} (TOST over {self.n} seeds, p "
                f"{self.p_text()})"
            )
        if self.test == "paired t":
            adjusted = math.isfinite(self.p_adjusted)
            comparisons = "comparison" if self.family_size == 1 else "comparisons"
            which = f"p {self.p_text()}"
            if adjusted:
                which = f"Holm-adjusted p {self.p_text()} over {self.family_size} {comparisons}"
            p = self.p_adjusted if adjusted else self.p
            if p <= ALPHA:
                return f"resolved: paired t over {self.n} seeds, {which}"
            return (
                f"not resolved: paired t over {self.n} seeds, {which}; these seeds detect "
                f"{self.number(self.detectable, False)}{unit} at 80 % power"
            )
        if self.test == "observed":
            return "a single observation"
        if self.n:
            return f"mean over {self.n}, 95 % interval" if self.interval() else f"over {self.n}"
        return self.test or "computed"

    def resolved(self) -> bool:
        """A paired claim whose (adjusted) p is at most α, or an equivalence shown by TOST."""
        p = self.p_adjusted if math.isfinite(self.p_adjusted) else self.p
        return self.test in ("paired t", "TOST") and math.isfinite(p) and p <= ALPHA

    def part(self, name: str) -> str:
        return {
            "value": lambda: self.number(self.value, self.signed),
            "interval": self.interval,
            "p": self.p_text,
            "n": lambda: str(self.n),
            "verdict": self.verdict,
            "text": lambda: self.text,
            "both": self.both,
        }[name]()


class Claims:
    """The claims of one notebook run, in the order they were made."""

    def __init__(self, run):
        fields = ("name", "parameters", "changed")
        if isinstance(run, (str, dict)) or not all(hasattr(run, field) for field in fields):
            raise TypeError(f"run must be the NotebookRun session.start returns, got {checks.shown(run)}")
        if not isinstance(run.parameters, dict) or not isinstance(run.changed, dict):
            raise TypeError(f"run's parameters and changed must be dicts, got {checks.shown(run)}")
        paths.result_name("run.name", run.name, "notebook name")
        self.notebook = run.name
        self.changed = dict(run.changed)
        self.profile = run.parameters.get("profile", "cpu")
        self._claims: dict[str, Claim] = {}
        self._banner_shown = False

    def __getitem__(self, key: str) -> Claim:
        if key not in self._claims:
            raise KeyError(f"no claim {key!r}; made so far: {', '.join(self._claims) or 'none'}")
        return self._claims[key]

    def __contains__(self, key: str) -> bool:
        return key in self._claims

    def _add(self, claim: Claim) -> Claim:
        if not isinstance(claim.key, str) or not _KEY.match(claim.key):
            raise ValueError(f"key must be letters, digits and . _ + -, got {claim.key!r}")
        if not isinstance(claim.text, str) or not claim.text:
            raise TypeError(
                f"text must be a non-empty str describing the claim, got {checks.shown(claim.text)}"
            )
        self._claims[claim.key] = claim
        return claim

    def value(self, key: str, value, *, text: str, low=None, high=None, n: int = 0, test: str = "",
              unit: str = "", digits: int = 4, headline: bool = False) -> Claim:  # fmt: skip
        """A number stated as measured: a mean with its interval over ``n`` (low/high), a single
        observation (``test="observed"``) or an exact computation (``test="computed"``)."""
        checks.number("value", value, finite=False)
        return self._add(Claim(key, text, float(value), math.nan if low is None else float(low),
                               math.nan if high is None else float(high), int(n), test, unit=unit,
                               digits=digits, headline=headline))  # fmt: skip

    def mean(self, key: str, values, *, text: str, unit: str = "", digits: int = 4, headline: bool = False):
        """The mean of ``values`` with its 95 % Student-t interval (``qlab.stats.mean_interval``)."""
        values = list(values)
        mean, low, high = stats.mean_interval(values)
        return self.value(key, mean, low=low, high=high, n=len(values), text=text, unit=unit, digits=digits,
                          headline=headline)  # fmt: skip

    def paired(self, key: str, differences, *, text: str, family: str = "", unit: str = "", digits: int = 4,
               headline: bool = False) -> Claim:  # fmt: skip
        """A paired difference (one value per seed): the paired t-test, its interval and the effect
        these seeds detect at 80 % power; ``family`` groups it for ``holm``."""
        test = stats.paired_test(differences)
        detectable = stats.detectable_effect(test["sd"], test["n"])
        return self._add(Claim(key, text, test["mean"], test["low"], test["high"], test["n"], "paired t",
                               test["p"], family=family, detectable=detectable, unit=unit, digits=digits,
                               headline=headline))  # fmt: skip

    def equivalence(self, key: str, differences, *, margin: float, text: str, unit: str = "", digits: int = 4,
                    headline: bool = False) -> Claim:  # fmt: skip
        """ "No difference" as a TOST equivalence test against ``margin``, stated up front."""
        result = stats.tost(differences, margin)
        test = stats.paired_test(differences, alpha=0.1)  # the (1 − 2α) interval TOST reads
        return self._add(Claim(key, text, result["mean"], test["low"], test["high"], result["n"], "TOST",
                               result["p"], margin=margin, unit=unit, digits=digits,
                               headline=headline))  # fmt: skip

    def paired_family(self, frame: pd.DataFrame, value: str, *, family: str, pairs, text: str,
                      by: str = "recipe", between: str = "override", pair: str = "seed", unit: str = "",
                      digits: int = 4, margin: float | None = None) -> list[str]:  # fmt: skip
        """For each group of ``by`` and each (a, b) of ``pairs`` present in its ``between`` column, the
        paired claim ``<family>.<group>.<a>-<b>`` (other characters than a key's become "_") of
        value(a) − value(b) with the same ``pair`` key
        (and, given ``margin``, its TOST claim ``<family>.<group>.<a>-<b>.same``); Holm over the
        family. ``text`` is formatted with group, a and b. Returns the paired claims' keys."""
        checks.frame_columns("frame", frame, [value, by, between, pair])
        wide = frame.pivot_table(index=[by, pair], columns=between, values=value).reset_index()
        keys = []
        for group in dict.fromkeys(frame[by]):
            rows = wide[wide[by] == group].sort_values(pair)
            for a, b in pairs:
                if a not in rows or b not in rows or rows[[a, b]].isna().any().any():
                    continue
                key = key_for(family, group, f"{a}-{b}")
                label = text.format(group=group, a=a, b=b)
                self.paired(key, rows[a] - rows[b], text=label, family=family, unit=unit, digits=digits)
                if margin is not None:
                    within = f"{label}, within ±{margin:g}{' ' + unit if unit else ''}"
                    difference = rows[a] - rows[b]
                    self.equivalence(
                        f"{key}.same", difference, margin=margin, unit=unit, digits=digits, text=within
                    )
                keys.append(key)
        if keys:
            self.holm(family)
        return keys

    def holm(self, family: str) -> list[Claim]:
        """Holm-adjust the p-values of every paired claim of ``family`` (its verdicts then say so)."""
        members = [c for c in self._claims.values() if c.family == family and c.test == "paired t"]
        if not members:
            raise ValueError(f"family {family!r} has no paired claims")
        for claim, adjusted in zip(members, stats.holm([c.p for c in members])):
            claim.p_adjusted, claim.family_size = adjusted, len(members)
        return members

    def table(self, keys) -> str:
        """A markdown table of the claims ``keys``: what each compares, the value with its interval, and
        the verdict of its test."""
        from qlab.results import markdown_table

        rows = [
            {"comparison": self[k].text, "measured": self[k].both(), "test": self[k].verdict()} for k in keys
        ]
        return markdown_table(pd.DataFrame(rows, columns=["comparison", "measured", "test"]))

    def frame(self) -> pd.DataFrame:
        rows = [{name: asdict(c)[name] for name in COLUMNS} for c in self._claims.values()]
        return pd.DataFrame(rows, columns=list(COLUMNS))

    def save(self):
        """Write ``data/<notebook>_claims.csv`` (under the run's results directory)."""
        from qlab.results import save_csv

        return save_csv(self.frame(), f"{self.notebook}_claims")

    def banner(self) -> str:
        """ "" for the committed defaults; else one line naming the parameters that produced the text."""
        if not self.changed and self.profile == "cpu":
            return ""
        changed = ", ".join(f"{k}={v!r}" for k, v in self.changed.items())
        profile = "" if self.profile == "cpu" else f"profile {self.profile!r}"
        which = "; ".join(part for part in (profile, changed) if part)
        return (
            f"> **These conclusions describe this run ({which}), not the committed defaults;** every "
            "number and verdict below is computed from this run's own results.\n\n"
        )

    def render(self, template: str) -> str:
        """``template`` with each ``{key}`` / ``{key:part}`` filled from the claims, the banner before the
        first rendering of a run with other parameters.
        Lines within a paragraph are joined (no hard wraps); list items and headings stay lines."""
        if not isinstance(template, str):
            raise TypeError(f"template must be a str, got {checks.shown(template)}")

        def fill(match: re.Match) -> str:
            key, part = match.group(1), match.group(2) or "both"
            if part not in PARTS:
                raise ValueError(
                    f"unknown part {part!r} in {{{key}:{part}}}; expected one of {', '.join(PARTS)}"
                )
            return self[key].part(part)

        lines = []
        for line in unwrap(template).splitlines():
            filled = _PLACEHOLDER.sub(fill, line)
            if line.startswith("{"):  # a paragraph that opens on a number must not read as a list item
                filled = re.sub(r"^(\S*?\d)\.(\s)", r"\1\\.\2", filled)
            lines.append(filled)
        banner, self._banner_shown = ("" if self._banner_shown else self.banner()), True
        return banner + "\n".join(lines) + "\n"


def key_for(*parts) -> str:
    """A claim key from its parts joined by ".", every character a key may not hold made "_"."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", ".".join(str(p) for p in parts))


def unwrap(markdown: str) -> str:
    """Join hard-wrapped lines of each paragraph and list item into one line, so a wrapped line that
    begins with a number ("30. ...") cannot become a numbered list."""
    if not isinstance(markdown, str):
        raise TypeError(f"markdown must be a str, got {checks.shown(markdown)}")
    lines, out = markdown.strip("\n").splitlines(), []
    for line in lines:
        starts_block = not line.strip() or re.match(r"^\s*([-*+]\s|#|>|\||\d+\.\s)", line)
        if out and out[-1].strip() and not starts_block and not line.startswith("    "):
            out[-1] = out[-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def load(path) -> pd.DataFrame:
    """A claims file as written by ``Claims.save``."""
    return _load(path, "path")


def _load(path, name: str) -> pd.DataFrame:
    from qlab.results import read_csv

    return read_csv(path, COLUMNS, name=name, what="claims file", keep_default_na=False, na_values=[""])


def from_row(row) -> Claim:
    """The Claim a claims-file row describes (``family_size`` recounted by ``findings``)."""
    if not isinstance(row, (dict, pd.Series)):
        raise TypeError(f"row must be a claims-file row (a dict or pandas Series), got {checks.shown(row)}")
    missing = [name for name in COLUMNS if name not in row]
    if missing:
        raise ValueError(f"row is not a claims-file row: it lacks {missing}")
    values = {name: row[name] for name in COLUMNS}
    try:
        for name in ("text", "test", "family", "unit"):
            values[name] = "" if _missing(values[name]) else str(values[name])
        for name in ("n", "digits"):
            number = float(values[name])
            if not number.is_integer():
                raise ValueError(f"{name} must be a whole number, got {values[name]!r}")
            values[name] = int(number)
        values["headline"] = str(values["headline"]).lower() == "true"
        return Claim(**values)
    except (TypeError, ValueError, OverflowError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"row holds a value a claim cannot take: {err}") from None


def _missing(value) -> bool:
    """A claims-file cell left empty (NaN or None), not a list or other container."""
    return value is None or (isinstance(value, float) and math.isnan(value))


# --- the README's findings table, generated from the committed claims files ------------------------

FINDINGS_START = "<!-- findings: generated by `qlab findings` from data/*_claims.csv; do not edit -->"
FINDINGS_END = "<!-- end of findings -->"


def findings_table(data_dir) -> str:
    """A markdown table of every headline claim in ``data_dir``'s claims files: notebook, claim,
    value with its interval, and the verdict of its test."""
    from qlab.results import markdown_table

    folder = paths.existing_folder("data_dir", data_dir)
    rows = []
    for path in sorted(folder.glob("[0-9][0-9]_*_claims.csv")):
        frame = _load(path, "data_dir")
        notebook = path.name.removesuffix("_claims.csv")
        family_sizes = frame[frame.test == "paired t"].groupby("family").size()
        for index, row in frame.iterrows():
            try:
                claim = from_row(row)
            except (TypeError, ValueError) as err:
                raise ValueError(f"data_dir: {paths.shown(path)}, line {index + 2}: {err}") from None
            if claim.family and claim.family in family_sizes:
                claim.family_size = int(family_sizes[claim.family])
            if claim.headline:
                rows.append({"notebook": notebook[:2], "claim": claim.text, "measured": claim.both(),
                             "test": claim.verdict()})  # fmt: skip
    if not rows:
        return "No claims files in data/ yet.\n"
    return markdown_table(pd.DataFrame(rows)) + "\n"


def update_readme(readme, data_dir, *, check: bool = False) -> bool:
    """Replace the text between the findings markers of ``readme`` with ``findings_table(data_dir)``.
    Returns whether it changed; with ``check`` the file is left as it is."""
    readme = paths.existing_file("readme", readme, "markdown file")
    paths.existing_folder("data_dir", data_dir)
    checks.boolean("check", check)
    try:
        text = readme.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"readme {paths.shown(readme)} is not UTF-8 text: {err}") from None
    if FINDINGS_START not in text or FINDINGS_END not in text.split(FINDINGS_START, 1)[-1]:
        raise ValueError(
            f"readme {paths.shown(readme)} has no findings markers ({FINDINGS_START!r} … {FINDINGS_END!r})"
        )
    head, rest = text.split(FINDINGS_START, 1)
    _, tail = rest.split(FINDINGS_END, 1)
    updated = head + FINDINGS_START + "\n\n" + findings_table(data_dir) + "\n" + FINDINGS_END + tail
    if updated != text and not check:
        with paths.written_atomically(readme) as tmp:
            tmp.write_text(updated, encoding="utf-8")
    return updated != text
