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
power", or "equivalent within ±0.01 nats (TOST p = 0.002)"; ``{key:outcome}`` says it in a few words for
a plain answer ("resolved over 5 seeds", "equivalent within ±0.01 nats", "2 resolved, 5 equivalent,
4 undecided"), and ``{key:amount}`` is the value with its unit, no interval. The text rendered from a
run whose parameters differ from the committed defaults starts with a banner naming them, so a smoke or
interactive run never reads like the committed findings. Rendered lines are joined into paragraphs
without hard wraps, so a number never begins a line and turns it into a numbered list.

The claims file holds one row per claim: key, text, value, low, high, n, test, p (raw), p_adjusted,
family, margin, detectable, unit, digits, headline and pairs (what a paired test's pairs are: seeds,
draws, held-out batches; "seeds" where a file written before this column lacks it) — what ``qlab
findings`` builds the README's table from (headline claims only) and what the drift tests recompute from
the committed data.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import pandas as pd

from qlab import checks, paths, stats

ALPHA = 0.05
COLUMNS = (
    "key", "text", "value", "low", "high", "n", "test", "p", "p_adjusted", "p_sign_flip",
    "p_sign_flip_adjusted", "family", "margin", "low_90", "high_90", "detectable", "equivalent", "undecided",
    "sign_flip_resolved", "unit", "digits", "headline", "pairs",
)  # fmt: skip
SAVED_BEFORE_PAIRS = COLUMNS[:-1]  # a claims file written before the pairs were named: its pairs are seeds
TESTS = (
    "paired t",
    "TOST",
    "tally",
    "observed",
    "estimate",
    "bootstrap",
    "computed",
    "Fieller",
    "geometric",
    "",
)  # "" with n > 0: a mean over n, 95 % interval
DIRECTIONS = ("lower", "higher")
_KEY = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.+-]+)(?::([a-z_]+))?\}")
MEASURED = "measured [95 % interval]"  # the column every claims table shows value and interval in
PARTS = ("value", "amount", "interval", "interval90", "p", "n", "verdict", "outcome", "text", "both")


@dataclass
class Claim:
    """One stated number: its value, 95 % interval (low, high), sample size, the test behind it and its p.

    test is "paired t" (with the exact sign-flip test beside it), "TOST" (equivalence within ±margin;
    low/high stay the 95 % interval, low_90/high_90 hold the 90 % interval the test reads), "tally" (a
    count over a family of n paired comparisons, each with its TOST, in disjoint classes: value resolved
    (Holm), equivalent the unresolved ones TOST shows within the margin (Holm over the family's TOSTs),
    undecided the rest, detectable the largest effect an undecided one could have found; "tally lower" or
    "tally higher" counts in value only the resolved ones of that sign, the n − value − equivalent −
    undecided others resolved the other way), "observed" (a single observation), "estimate" (a statistic
    of n samples — a ratio, an extreme, a median — stated without an interval), "bootstrap" (a statistic
    of n resampled units with its 95 % percentile bootstrap interval), "Fieller" (a ratio of two paired
    means over n pairs with Fieller's 95 % interval, none where the denominator is not resolved),
    "geometric" (the geometric mean of n positive values, its 95 % interval the Student-t one of their
    logarithms, exponentiated) or "computed" (exact arithmetic, no sampling)."""

    key: str
    text: str
    value: float
    low: float = math.nan
    high: float = math.nan
    n: int = 0
    test: str = ""
    p: float = math.nan
    p_adjusted: float = math.nan
    p_sign_flip: float = math.nan
    p_sign_flip_adjusted: float = math.nan
    family: str = ""
    margin: float = math.nan
    low_90: float = math.nan
    high_90: float = math.nan
    detectable: float = math.nan
    equivalent: float = math.nan
    undecided: float = math.nan
    sign_flip_resolved: float = math.nan  # a tally: how many of its counted ones the sign-flip test resolves
    unit: str = ""
    digits: int = 4
    headline: bool = False
    family_size: int = field(default=0, repr=False)
    pairs: str = field(default="seeds", repr=False)  # what a verdict calls the pairs: seeds, draws, ...

    def __post_init__(self):
        for name in ("key", "text", "test", "family", "unit", "pairs"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {checks.shown(getattr(self, name))}")
        if not self.pairs:
            raise ValueError("pairs must name what the pairs are (seeds, draws, ...), got an empty string")
        for name in (
            "value",
            "low",
            "high",
            "p",
            "p_adjusted",
            "p_sign_flip",
            "p_sign_flip_adjusted",
            "margin",
            "low_90",
            "high_90",
            "detectable",
            "equivalent",
            "undecided",
            "sign_flip_resolved",
        ):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isnan(value)):  # NaN: not stated
                checks.number(name, value, finite=False)
        for name in ("n", "family_size"):
            checks.integer(name, getattr(self, name), low=0)
        checks.integer("digits", self.digits, low=0, high=17)
        checks.boolean("headline", self.headline)
        if self.test not in TESTS and not (self.test.startswith("tally ") and self.test[6:] in DIRECTIONS):
            raise ValueError(
                f"test must be one of {', '.join(map(repr, TESTS))} or 'tally lower'/'tally higher', got "
                f"{self.test!r}"
            )

    def number(self, x: float, signed: bool) -> str:
        if not math.isfinite(x):
            return "—"
        text = f"{x:+.{self.digits}f}" if signed else f"{x:.{self.digits}f}"
        out_of_range = abs(x) >= 10 ** (self.digits + 2) or (x != 0 and abs(x) < 10 ** (-self.digits))
        if self.digits > 0 and out_of_range:  # digits=0: a count, written out whatever its size
            significant = max(self.digits - 1, 2)  # 1.49e-07, never 1e-07: as many digits as it carries
            text = f"{x:+.{significant}e}" if signed else f"{x:.{significant}e}"
        return text.replace("-", "−")

    @property
    def signed(self) -> bool:
        return self.test in ("paired t", "TOST")

    def interval(self, level: int = 95) -> str:
        low, high = (self.low, self.high) if level == 95 else (self.low_90, self.high_90)
        if not (math.isfinite(low) and math.isfinite(high)):
            return ""
        return f"[{self.number(low, self.signed)}, {self.number(high, self.signed)}]"

    def both(self) -> str:
        shown = self.number(self.value, self.signed)
        interval = self.interval()
        unit = f" {self.unit}" if self.unit and not self.test.startswith("tally") else ""
        return f"{shown} {interval}{unit}" if interval else f"{shown}{unit}"

    def p_text(self, p: float | None = None) -> str:
        if p is None:
            p = self.p_adjusted if math.isfinite(self.p_adjusted) else self.p
        if not math.isfinite(p):
            return "—"
        if p < 0.001:
            return "< 0.001"
        shown = f"{p:.3f}"
        if float(shown) == ALPHA or (float(shown) <= ALPHA) != (p <= ALPHA):  # 0.0496 is not "0.050"
            shown = f"{p:.4g}"
        return f"= {shown}"

    def sign_flip_text(self) -> str:
        """The exact sign-flip test beside the t-test, and whether the two disagree at α."""
        adjusted = math.isfinite(self.p_sign_flip_adjusted)
        p = self.p_sign_flip_adjusted if adjusted else self.p_sign_flip
        if not math.isfinite(p):
            return ""
        t_p = self.p_adjusted if math.isfinite(self.p_adjusted) else self.p
        which = "Holm-adjusted " if adjusted else ""
        exact = self.n <= stats.EXACT_SIGN_FLIPS_MAX  # beyond, the p is a share of seeded drawn patterns
        text = f"{'exact sign-flip' if exact else 'sign-flip (drawn patterns)'} {which}p {self.p_text(p)}"
        if (p <= ALPHA) != (t_p <= ALPHA):
            floor = 2.0 / 2**self.n if self.n else math.nan
            text += " — the two tests disagree" + (
                f" ({self.n} {self.pairs} cannot give a sign-flip p below {floor:.3g})"
                if floor > ALPHA
                else ""
            )
        return text

    def verdict(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.test == "TOST":
            shown = "equivalent" if self.resolved() else "not shown equivalent"
            interval = self.interval(90)
            interval = f"; 90 % interval {interval}" if interval else ""
            which = f"p {self.p_text()}"
            if math.isfinite(self.p_adjusted):
                which = f"Holm-adjusted p {self.p_text()} over {self.family_size} equivalence tests"
            tested = f"TOST over {self.n} {self.pairs}, {which}{interval}"
            return f"{shown} within ±{self.margin:g}{unit} ({tested})"
        if self.test.startswith("tally"):
            return self.tally_text()
        if self.test == "paired t":
            adjusted = math.isfinite(self.p_adjusted)
            comparisons = "comparison" if self.family_size == 1 else "comparisons"
            which = f"p {self.p_text()}"
            if adjusted:
                which = f"Holm-adjusted p {self.p_text()} over {self.family_size} {comparisons}"
            p = self.p_adjusted if adjusted else self.p
            flips = self.sign_flip_text()
            flips = f"; {flips}" if flips else ""
            if p <= ALPHA:
                return f"resolved: paired t over {self.n} {self.pairs}, {which}{flips}"
            return (
                f"not resolved: paired t over {self.n} {self.pairs}, {which}{flips}; these {self.pairs} "
                f"detect {self.number(self.detectable, False)}{unit} at 80 % power{self.power_level()}"
            )
        if self.test == "observed":
            return "a single observation"
        if self.test == "estimate":
            over = f" over {self.n} samples" if self.n else ""
            return f"an estimate{over}, no interval"
        if self.test == "bootstrap":
            return f"over {self.n} units, 95 % percentile bootstrap interval"
        if self.test == "Fieller":
            if self.interval():
                return f"a ratio of means over {self.n} {self.pairs}, 95 % Fieller interval"
            return f"a ratio of means over {self.n} {self.pairs}, denominator not resolved: no interval"
        if self.test == "geometric":
            interval = ", 95 % interval from the logarithms" if self.interval() else ""
            return f"geometric mean over {self.n}{interval}"
        if self.n:
            return f"mean over {self.n}, 95 % interval" if self.interval() else f"over {self.n}"
        return self.test or "computed"

    def power_level(self) -> str:
        """The level ``detectable`` is at: after Holm, α over the family's size (its strictest step)."""
        return f" at Holm's α/{self.family_size}" if self.family_size > 1 else ""

    def outcome(self) -> str:
        """The verdict in a few words, for a plain-language answer; ``verdict`` says how it was tested."""
        unit = f" {self.unit}" if self.unit else ""
        if self.test == "TOST":
            shown = "equivalent" if self.resolved() else "not shown equivalent"
            return f"{shown} within ±{self.margin:g}{unit}"
        if self.test == "paired t":
            return f"{'resolved' if self.resolved() else 'not resolved'} over {self.n} {self.pairs}"
        if self.test.startswith("tally"):
            direction = self.test.removeprefix("tally").strip()
            text = f"{self.value:.0f} resolved, {self.equivalent:.0f} equivalent"
            if direction:  # "8 higher, 1 lower, 2 equivalent": the counted direction first
                other, opposite = self._tally_opposite(direction)
                text = f"{self.value:.0f} {direction}, {opposite:.0f} {other}"
                text += f", {self.equivalent:.0f} equivalent"
            return text + (f", {self.undecided:.0f} undecided" if self.undecided > 0 else "")
        return self.verdict()

    def _tally_opposite(self, direction: str) -> tuple[str, float]:
        """A directional tally's other direction and how many comparisons resolved that way: those
        neither counted, equivalent nor undecided."""
        other = {"lower": "higher", "higher": "lower"}[direction]
        return other, self.n - self.value - self.equivalent - self.undecided

    def tally_text(self) -> str:
        """What a tally's tests found, in disjoint classes of its n comparisons."""
        unit = f" {self.unit}" if self.unit else ""
        direction = self.test.removeprefix("tally").strip()
        count = self.number(self.value, False)
        if direction:
            other, opposite = self._tally_opposite(direction)
            text = (
                f"{count} of {self.n} resolved {direction} and {opposite:.0f} {other} after Holm (paired t)"
            )
        else:
            text = f"{count} of {self.n} resolved after Holm (paired t)"
        if math.isfinite(self.sign_flip_resolved) and self.sign_flip_resolved != self.value:
            which = "none" if self.sign_flip_resolved == 0 else f"only {self.sign_flip_resolved:.0f}"
            text += f", {which} of them also by the sign-flip test (Holm) — the two tests disagree"
        text += (
            f"; of the rest, {self.equivalent:.0f} equivalent within ±{self.margin:g}{unit} (TOST, "
            "Holm-adjusted)"
        )
        if self.undecided > 0:
            detectable = f"{self.detectable:.3g}".replace("-", "−")
            text += (
                f" and {self.undecided:.0f} undecided (these {self.pairs} detect up to {detectable}{unit} at "
                "80 % power after Holm)"
            )
        return text

    def resolved(self) -> bool:
        """A paired claim whose (adjusted) p is at most α, or an equivalence shown by TOST."""
        p = self.p_adjusted if math.isfinite(self.p_adjusted) else self.p
        return self.test in ("paired t", "TOST") and math.isfinite(p) and p <= ALPHA

    def part(self, name: str) -> str:
        return {
            "value": lambda: self.number(self.value, self.signed),
            "interval": self.interval,
            "interval90": lambda: self.interval(90),
            "p": self.p_text,
            "n": lambda: str(self.n),
            "amount": lambda: (
                self.number(self.value, self.signed)
                + (f" {self.unit}" if self.unit and not self.test.startswith("tally") else "")
            ),
            "verdict": self.verdict,
            "outcome": self.outcome,
            "text": lambda: self.text,
            "both": self.both,
        }[name]()


class Claims:
    """The claims of one notebook run, in the order they were made."""

    def __init__(self, run, *, pairs: str = "seeds", committed: bool = True):
        """``pairs``: what the verdicts call a paired test's pairs ("seeds", "batches"). ``committed``
        False: a notebook with no committed results (a report), whose text needs no banner."""
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
        self._rendered: list[str] = []  # every text render returned, in order
        self._saved = False
        if not isinstance(pairs, str) or not pairs:
            raise TypeError(f"pairs must be a non-empty str naming the pairs, got {checks.shown(pairs)}")
        self.pairs = pairs
        self.committed = checks.boolean("committed", committed)

    def __getitem__(self, key: str) -> Claim:
        if key not in self._claims:
            raise KeyError(f"no claim {key!r}; made so far: {', '.join(self._claims) or 'none'}")
        return self._claims[key]

    def __contains__(self, key: str) -> bool:
        return key in self._claims

    def _add(self, claim: Claim, over: str | None = None) -> Claim:
        if over is not None and (not isinstance(over, str) or not over):
            raise TypeError(f"over must be a non-empty str naming the pairs, got {checks.shown(over)}")
        claim.pairs = over or self.pairs
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
        observation (``test="observed"``), a statistic of n samples with no interval
        (``test="estimate"``, over ``n``), one with a percentile bootstrap interval over n resampled
        units (``test="bootstrap"``) or an exact computation (``test="computed"``)."""
        checks.number("value", value, finite=False)
        return self._add(Claim(key, text, float(value), math.nan if low is None else float(low),
                               math.nan if high is None else float(high), int(n), test, unit=unit,
                               digits=digits, headline=headline))  # fmt: skip

    def ratio(self, key: str, numerators, denominators, *, text: str, unit: str = "", digits: int = 4,
              headline: bool = False, over: str | None = None) -> Claim:  # fmt: skip
        """mean(numerators) / mean(denominators), paired per seed (``over``: what the pairs are, when
        not the Claims' pairs), with Fieller's 95 % interval (``qlab.stats.ratio_interval``; none where
        the denominator's mean is not resolved from zero)."""
        result = stats.ratio_interval(list(numerators), list(denominators))
        return self._add(Claim(key, text, result["ratio"], result["low"], result["high"], result["n"],
                               "Fieller", unit=unit, digits=digits, headline=headline), over)  # fmt: skip

    def mean(self, key: str, values, *, text: str, unit: str = "", digits: int = 4, headline: bool = False):
        """The mean of ``values`` with its 95 % Student-t interval (``qlab.stats.mean_interval``)."""
        values = list(values)
        mean, low, high = stats.mean_interval(values)
        return self.value(key, mean, low=low, high=high, n=len(values), text=text, unit=unit, digits=digits,
                          headline=headline)  # fmt: skip

    def geometric_mean(self, key: str, values, *, text: str, unit: str = "", digits: int = 4,
                       headline: bool = False) -> Claim:  # fmt: skip
        """The geometric mean of positive ``values`` (ratios) with its 95 % interval, Student-t on their
        logarithms (``qlab.stats.geometric_mean_interval``): it stays positive."""
        values = list(values)
        mean, low, high = stats.geometric_mean_interval(values)
        return self._add(Claim(key, text, mean, low, high, len(values), "geometric", unit=unit, digits=digits,
                               headline=headline))  # fmt: skip

    def paired(self, key: str, differences, *, text: str, family: str = "", unit: str = "", digits: int = 4,
               headline: bool = False, margin: float | None = None,
               over: str | None = None) -> Claim:  # fmt: skip
        """A paired difference (one value per seed): the paired t-test, its 95 % interval, the exact
        sign-flip test beside it and the effect these seeds detect at 80 % power; ``family`` groups it
        for ``holm``. Given ``margin`` (a notebook parameter, fixed before the committed runs), also
        the TOST claim ``<key>.same``. ``over`` names the pairs ("draws", "fine-tunes") where they are
        not the Claims' own."""
        differences = list(differences)
        test = stats.paired_test(differences)
        flips = stats.sign_flip_test(differences)
        detectable = stats.detectable_effect(test["sd"], test["n"])
        claim = self._add(Claim(key, text, test["mean"], test["low"], test["high"], test["n"], "paired t",
                                test["p"], p_sign_flip=flips["p"], family=family, detectable=detectable,
                                unit=unit, digits=digits, headline=headline), over)  # fmt: skip
        if margin is not None:
            within = f"{text}, within ±{margin:g}{' ' + unit if unit else ''}"
            self.equivalence(f"{key}.same", differences, margin=margin, unit=unit, digits=digits, text=within,
                             over=over)  # fmt: skip
        return claim

    def equivalence(self, key: str, differences, *, margin: float, text: str, unit: str = "", digits: int = 4,
                    headline: bool = False, over: str | None = None) -> Claim:  # fmt: skip
        """ "No difference" as a TOST equivalence test against ``margin``, stated up front: low/high hold
        the 95 % interval, low_90/high_90 the 90 % interval the test reads."""
        differences = list(differences)
        result = stats.tost(differences, margin)
        interval_95 = stats.paired_test(differences)
        interval_90 = stats.paired_test(differences, alpha=0.1)  # the (1 − 2α) interval TOST reads
        return self._add(Claim(key, text, result["mean"], interval_95["low"], interval_95["high"],
                               result["n"], "TOST", result["p"], margin=margin, low_90=interval_90["low"],
                               high_90=interval_90["high"], unit=unit, digits=digits,
                               headline=headline), over)  # fmt: skip

    def tally(
        self, key: str, keys, *, text: str, direction: str | None = None, headline: bool = False
    ) -> Claim:
        """A count a headline can state: of the paired claims ``keys`` (each Holm-adjusted, each with its
        ``<key>.same`` TOST at one margin), how many are resolved (of ``direction``'s sign, "lower" or
        "higher", when given), how many equivalent within the margin and how many neither (undecided,
        with the largest effect those seeds could have detected)."""
        keys = list(keys)
        if not keys:
            raise ValueError(f"tally {key!r} needs at least one paired claim, got none")
        if direction is not None:
            checks.choice("direction", direction, DIRECTIONS)
        members, same = [self[k] for k in keys], []
        for member in members:
            if member.test != "paired t":
                raise ValueError(
                    f"tally {key!r}: {member.key!r} is a {member.test or 'plain'} claim, not a paired t"
                )
            if not math.isfinite(member.p_adjusted):
                raise ValueError(
                    f"tally {key!r}: {member.key!r} is not Holm-adjusted yet; call holm on its family"
                )
            if f"{member.key}.same" not in self:
                raise ValueError(
                    f"tally {key!r}: {member.key!r} has no equivalence test {member.key + '.same'!r}; give "
                    "the comparison a margin (a notebook parameter, fixed before the runs)"
                )
            same.append(self[f"{member.key}.same"])
            if not math.isfinite(same[-1].p_adjusted):
                raise ValueError(
                    f"tally {key!r}: {member.key + '.same'!r} is not Holm-adjusted; call holm on "
                    f"{member.family!r} after its TOSTs are made"
                )
        margins = {claim.margin for claim in same}
        if len(margins) != 1:
            raise ValueError(f"tally {key!r}: its comparisons' margins differ ({sorted(margins)}); use one")
        sign = {None: 0, "lower": -1, "higher": 1}[direction]
        resolved = [m for m in members if m.resolved() and (sign == 0 or math.copysign(1, m.value) == sign)]
        equivalent = [s for m, s in zip(members, same) if not m.resolved() and s.resolved()]
        undecided = [m for m, s in zip(members, same) if not m.resolved() and not s.resolved()]
        detectable = max((m.detectable for m in undecided), default=math.nan)
        flips = [m.p_sign_flip_adjusted for m in resolved]
        by_flips = float(sum(p <= ALPHA for p in flips)) if all(map(math.isfinite, flips)) else math.nan
        unit = members[0].unit
        return self._add(Claim(key, text, float(len(resolved)), n=len(members),
                               test="tally" if direction is None else f"tally {direction}",
                               margin=margins.pop(), detectable=detectable, equivalent=float(len(equivalent)),
                               undecided=float(len(undecided)), sign_flip_resolved=by_flips, unit=unit,
                               digits=0, headline=headline), members[0].pairs)  # fmt: skip

    def paired_family(self, frame: pd.DataFrame, value: str, *, family: str, pairs, text: str,
                      by: str = "recipe", between: str = "override", pair: str = "seed", unit: str = "",
                      digits: int = 4, margin: float | None = None,
                      over: str | None = None) -> list[str]:  # fmt: skip
        """For each group of ``by`` and each (a, b) of ``pairs`` present in its ``between`` column, the
        paired claim ``<family>.<group>.<a>-<b>`` (other characters than a key's become "_") of
        value(a) − value(b) with the same ``pair`` key
        (and, given ``margin``, its TOST claim ``<family>.<group>.<a>-<b>.same``); Holm over the
        family. ``text`` is formatted with group, a and b. Returns the paired claims' keys."""
        checks.frame_columns("frame", frame, [value, by, between, pair])
        repeated = frame[frame.duplicated([by, between, pair], keep=False)]
        if len(repeated):
            first = tuple(getattr(v, "item", lambda v=v: v)() for v in repeated.iloc[0][[by, between, pair]])
            raise ValueError(
                f"frame holds {len(repeated)} rows that repeat a ({by}, {between}, {pair}), e.g. {first}: "
                "one value per pair, not averaged"
            )
        wide = frame.pivot(index=[by, pair], columns=between, values=value).reset_index()
        keys = []
        for group in dict.fromkeys(frame[by]):
            rows = wide[wide[by] == group].sort_values(pair)
            for a, b in pairs:
                if a not in rows or b not in rows or rows[[a, b]].isna().all().any():
                    continue  # an arm this group does not have
                missing = rows[rows[[a, b]].isna().any(axis=1)][pair].tolist()
                if missing:
                    raise ValueError(
                        f"{family}: {by} {group!r} has {a!r} and {b!r} but not both for {pair} {missing}: a "
                        f"comparison over the other {pair}s would drop a diverged run, not report it"
                    )
                key = key_for(family, group, f"{a}-{b}")
                label = text.format(group=group, a=a, b=b)
                self.paired(key, rows[a] - rows[b], text=label, family=family, unit=unit, digits=digits,
                            margin=margin, over=over)  # fmt: skip
                keys.append(key)
        if keys:
            self.holm(family)
        return keys

    def holm(self, family: str) -> list[Claim]:
        """Holm-adjust the p-values of every paired claim of ``family``, and apart from them those of
        the members' TOST claims ``<key>.same`` (each verdict then says over how many)."""
        members = [c for c in self._claims.values() if c.family == family and c.test == "paired t"]
        if not members:
            raise ValueError(f"family {family!r} has no paired claims")
        for claim, adjusted in zip(members, stats.holm([c.p for c in members])):
            claim.p_adjusted, claim.family_size = adjusted, len(members)
            if claim.n >= 2 and math.isfinite(claim.high - claim.low):  # 80 % power at Holm's first step
                sd = (claim.high - claim.low) / 2 * math.sqrt(claim.n) / stats.t_quantile_975(claim.n - 1)
                claim.detectable = stats.detectable_effect(sd, claim.n, alpha=ALPHA / len(members))
        if all(math.isfinite(c.p_sign_flip) for c in members):
            for claim, adjusted in zip(members, stats.holm([c.p_sign_flip for c in members])):
                claim.p_sign_flip_adjusted = adjusted
        # the members' equivalence tests form a family of their own: "k of N equivalent" is N TOSTs
        same = [self._claims[f"{c.key}.same"] for c in members if f"{c.key}.same" in self._claims]
        for claim, adjusted in zip(same, stats.holm([c.p for c in same]) if same else []):
            claim.family, claim.p_adjusted, claim.family_size = family, adjusted, len(same)
        return members

    def table(self, keys) -> str:
        """A markdown table of the claims ``keys``: what each compares, the value with its interval, and
        the verdict of its test."""
        from qlab.results import markdown_table

        rows = [
            {"comparison": self[k].text, MEASURED: self[k].both(), "test": self[k].verdict()} for k in keys
        ]
        return markdown_table(pd.DataFrame(rows, columns=["comparison", MEASURED, "test"]))

    def frame(self) -> pd.DataFrame:
        rows = [{name: asdict(c)[name] for name in COLUMNS} for c in self._claims.values()]
        return pd.DataFrame(rows, columns=list(COLUMNS))

    def save(self):
        """Write ``data/<notebook>_claims.csv`` (under the run's results directory), and beside it
        ``<notebook>_claims.md``: every text ``render`` has filled in so far and fills in from now on
        (the notebook's prose as its claims state it, which the docs show without running it)."""
        from qlab.results import save_csv

        path = save_csv(self.frame(), f"{self.notebook}_claims")
        self._saved = True
        self._write_rendered()
        return path

    def _write_rendered(self) -> None:
        if not self._rendered:
            return
        with paths.written_atomically(paths.data_dir() / f"{self.notebook}_claims.md") as tmp:
            tmp.write_text("\n".join(self._rendered), encoding="utf-8")

    def banner(self) -> str:
        """ "" for the committed defaults; else one line naming the parameters that produced the text."""
        if not self.committed or (not self.changed and self.profile == "cpu"):
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
        text = banner + "\n".join(lines) + "\n"
        self._rendered.append(text)
        if self._saved:
            self._write_rendered()
        return text


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

    frame = read_csv(
        path, SAVED_BEFORE_PAIRS, name=name, what="claims file", keep_default_na=False, na_values=[""]
    )
    if "pairs" not in frame:
        frame["pairs"] = "seeds"
    return frame


def from_row(row) -> Claim:
    """The Claim a claims-file row describes (``family_size`` recounted by ``findings``)."""
    if not isinstance(row, (dict, pd.Series)):
        raise TypeError(f"row must be a claims-file row (a dict or pandas Series), got {checks.shown(row)}")
    missing = [name for name in SAVED_BEFORE_PAIRS if name not in row]
    if missing:
        raise ValueError(f"row is not a claims-file row: it lacks {missing}")
    values = {name: row[name] for name in SAVED_BEFORE_PAIRS}
    pairs = row["pairs"] if "pairs" in row else "seeds"
    values["pairs"] = "seeds" if _missing(pairs) or pairs == "" else str(pairs)
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


def headline_problems(frame: pd.DataFrame) -> list[str]:
    """The headlines of a claims file that do not state their test, one line each: a count (digits 0)
    with no test behind it ("computed", "estimate" or no test — a count headline is a tally of tested
    comparisons), a paired difference that is not resolved and has no TOST beside it (a null
    stated without an equivalence test), a tally without a margin. [] when every headline states its test."""
    checks.frame_columns("frame", frame, list(SAVED_BEFORE_PAIRS))
    problems, keys = [], set(frame.key)
    for row in frame.itertuples():
        if str(row.headline).lower() != "true":
            continue
        claim = from_row(pd.Series(row._asdict()))
        if claim.digits == 0 and claim.test in ("computed", "estimate", ""):
            problems.append(
                f"{claim.key}: a count headline whose verdict is {claim.verdict()!r}, with no test"
            )
        if claim.test == "paired t" and not claim.resolved():
            same = frame[(frame.key == f"{claim.key}.same") & (frame.test == "TOST")]
            if f"{claim.key}.same" not in keys or same.empty:
                problems.append(
                    f"{claim.key}: an unresolved difference headline with no TOST {claim.key + '.same'!r}"
                )
        if claim.test.startswith("tally") and not math.isfinite(claim.margin):
            problems.append(f"{claim.key}: a tally with no equivalence margin")
    return problems


# --- the README's findings table, generated from the committed claims files ------------------------

FINDINGS_START = "<!-- findings: generated by `qlab findings` from data/*_claims.csv; do not edit -->"
FINDINGS_END = "<!-- end of findings -->"


def file_claims(path, name: str = "path") -> list[Claim]:
    """The claims of a claims file, each with its Holm family's size recounted from the file (what a
    verdict states); a bad row is a ValueError naming the file and line (and ``name``, the argument
    the file came from)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str naming the argument, got {checks.shown(name)}")
    frame = _load(path, name)
    family_sizes = frame.groupby(["family", "test"]).size()  # paired t and TOST rows: two families
    found = []
    for index, row in frame.iterrows():
        try:
            claim = from_row(row)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {paths.shown(path)}, line {index + 2}: {err}") from None
        if claim.family and (claim.family, claim.test) in family_sizes:
            claim.family_size = int(family_sizes[(claim.family, claim.test)])
        found.append(claim)
    return found


def render_committed(path, template: str, also=()) -> str:
    """``template`` filled from a committed claims file (``{key}``, ``{key:verdict}``, … as
    ``Claims.render``), with no banner: the text a notebook's committed results state, without running it.
    ``also``: more claims files of the same notebook (its machine-dependent ``_claims_timing.csv``)."""
    from types import SimpleNamespace

    path = paths.existing_file("path", path, "claims file")
    notebook = path.name.removesuffix("_claims.csv")
    claims = Claims(SimpleNamespace(name=notebook, parameters={}, changed={}), committed=False)
    if isinstance(also, (str, bytes)) or not hasattr(also, "__iter__"):
        raise TypeError(f"also must be a list of claims files, got {checks.shown(also)}")
    for each in [path, *also]:
        for claim in file_claims(paths.existing_file("also", each, "claims file")):
            claims._add(claim, claim.pairs)  # the pairs the file names, not the Claims' default
    return claims.render(template)


def findings_table(data_dir) -> str:
    """A markdown table of every headline claim in ``data_dir``'s claims files: notebook, claim,
    value with its interval, and the verdict of its test."""
    from qlab.results import markdown_table

    folder = paths.existing_folder("data_dir", data_dir)
    rows = []
    for path in sorted(folder.glob("[0-9][0-9]_*_claims.csv")):
        notebook = path.name.removesuffix("_claims.csv")
        claims = {claim.key: claim for claim in file_claims(path, "data_dir's claims file")}
        for claim in claims.values():
            if claim.headline:
                verdict = claim.verdict()
                same = claims.get(f"{claim.key}.same")
                if claim.test == "paired t" and not claim.resolved() and same is not None:
                    verdict += f"; {same.verdict()}"  # a difference not found is not an equivalence shown
                rows.append({"notebook": notebook[:2], "claim": claim.text, MEASURED: claim.both(),
                             "test": verdict})  # fmt: skip
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
