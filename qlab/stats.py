"""Means over seeds with 95 % intervals, and paired differences against a baseline.

    mean, low, high = mean_interval([0.41, 0.44, 0.40])        # Student-t, n − 1 degrees of freedom
    mean, low, high = mean_interval(values, method="bootstrap")  # percentile bootstrap of the mean
    frame = paired_differences(runs, "val_loss", baseline="fp32", by="recipe", pair="seed")
    test = paired_test(differences)                    # mean, 95 % interval, t, df, two-sided p
    flips = sign_flip_test(differences)                # exact permutation p of the same hypothesis
    adjusted = holm([0.01, 0.04, 0.03])                 # Holm's step-down adjusted p-values
    equivalent = tost(differences, margin=0.01)         # p of "|true mean| < margin" (two one-sided tests)
    mde = detectable_effect(sd=0.0056, n=5)             # smallest paired mean difference 80 % power finds
    power = t_test_power(effect=1.0, n=5)               # P(reject) at a true effect of 1 sd (noncentral t)
    share = ratio_interval(gains_a, gains_b)            # mean(a) / mean(b) with Fieller's 95 % interval

The t interval is mean ± t·s/√n with s the sample standard deviation (n − 1) and t the two-sided
95 % quantile of Student's t with n − 1 degrees of freedom, computed to full double precision (no
table, no scipy). The bootstrap interval is the 2.5 % and 97.5 % quantiles (inverted CDF: the
smallest mean whose cumulative share reaches the level) of the means of resamples with replacement —
every one of the nⁿ resamples when nⁿ ≤ 10⁶ (exact, no randomness), else ``resamples`` seeded draws.
It assumes no normality, but with few seeds it is too narrow: prefer t for ≤ 10 seeds. One value has
no interval (NaN bounds): a single observation is reported as such.

Tests (two-sided at α = 0.05 unless given): the t distribution's CDF comes from the regularized
incomplete beta function (Lentz's continued fraction, double precision), its quantiles from bisection
on that CDF to the last representable digits. The sign-flip test assumes only that each difference is
as likely positive as negative under H0 (no normality): it is exact, and its smallest p over n pairs
is 2/2ⁿ (0.0625 at n = 5, 6.1e-5 at n = 15).
"""

from __future__ import annotations

import functools
import math
import numbers
import sys

import numpy as np
import pandas as pd

from qlab import checks


def t_quantile_975(degrees_of_freedom: int) -> float:
    """t_{0.975} with the given degrees of freedom (an integer ≥ 1): the two-sided 95 % quantile."""
    checks.integer("degrees_of_freedom", degrees_of_freedom, low=1)
    return _t_quantile_cached(0.975, int(degrees_of_freedom))


@functools.lru_cache(maxsize=4096)
def _t_quantile_cached(probability: float, degrees_of_freedom: int) -> float:
    """``t_quantile`` remembered: intervals and power statements ask for the same few quantiles often."""
    return t_quantile(probability, degrees_of_freedom)


METHODS = ("t", "bootstrap")
_EXACT_BOOTSTRAP_MAX = 10**6  # resamples enumerated exactly up to this many (n = 7 gives 823,543)


def mean_interval(
    values, method: str = "t", *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its 95 % interval by ``method`` ("t" or
    "bootstrap"); (v, nan, nan) for one value. Non-finite values are refused (a diverged run is
    reported, not averaged). ``resamples`` and ``seed`` matter only for a bootstrap of more than 7
    values (fewer are enumerated exactly)."""
    values = _real_values("values", values, "for mean_interval")
    method = checks.choice("method", method, METHODS)
    checks.integer("resamples", resamples, low=100)
    checks.integer("seed", seed, low=0)
    if not values:
        raise ValueError("values must hold at least one value for mean_interval, got none")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    if method == "bootstrap":
        low, high = _bootstrap_bounds(np.array(values), resamples, seed)
        return _within_range("values", (mean, low, high))
    deviation = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * deviation / math.sqrt(n)
    return _within_range("values", (mean, mean - half, mean + half))


def _real_values(name: str, values, purpose: str = "") -> list[float]:
    """``values`` (a list, tuple, array or Series of real numbers, not bools) as finite floats; a
    TypeError or ValueError naming ``name``, the first offending value and its position otherwise."""
    ordered = not isinstance(values, (str, bytes, set, frozenset, dict)) and hasattr(values, "__iter__")
    if not ordered or (isinstance(values, np.ndarray) and values.ndim != 1):
        raise TypeError(
            f"{name} must be a sequence of numbers (one per seed, in order), got {checks.shown(values)}"
        )
    values = list(values)
    for index, value in enumerate(values):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be real numbers, got {checks.shown(value)} at position {index}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int beyond float's range
            finite = False
        if not finite:
            raise ValueError(
                f"{name} must be finite{' ' + purpose if purpose else ''} (a diverged run is reported, not "
                f"averaged), got {checks.shown(value)} at position {index} of {len(values)}"
            )
    return [float(value) for value in values]


def _within_range(name: str, results: tuple) -> tuple:
    """``results`` where every one is finite; a ValueError where finite ``name`` overflowed on the way."""
    if not all(math.isfinite(r) for r in results):
        raise ValueError(f"{name} are too large to average in float64 (their sums overflow)")
    return results


def geometric_mean_interval(values) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive ``values``: ``mean_interval`` of their natural logarithms
    (Student-t), exponentiated. For ratios and other quantities on a scale, whose interval must stay
    positive (an outlier ratio ≥ 1 over two batches gets a t interval below zero); (v, nan, nan) for one."""
    values = _real_values("values", values, "for a geometric mean")
    for index, value in enumerate(values):
        if value <= 0:
            raise ValueError(
                f"values must be positive for a geometric mean, got {value!r} at position {index}"
            )
    mean, low, high = mean_interval([math.log(v) for v in values])
    return tuple(math.inf if v > math.log(sys.float_info.max) else math.exp(v) for v in (mean, low, high))


def _bootstrap_bounds(values: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    n = len(values)
    if n**n <= _EXACT_BOOTSTRAP_MAX:  # every resample once: index tuples as the digits 0 … nⁿ − 1 base n
        digits = np.arange(n**n)[:, None] // n ** np.arange(n)[None, :] % n
        means = np.sort(values[digits].mean(axis=1))
    else:
        draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
        means = np.sort(values[draws].mean(axis=1))
    count = len(means)
    low = means[max(math.ceil(0.025 * count) - 1, 0)]
    high = means[min(math.ceil(0.975 * count) - 1, count - 1)]
    return float(low), float(high)


def summarize(frame: pd.DataFrame, value: str, by: list[str], method: str = "t") -> pd.DataFrame:
    """One row per group of ``by``: n, mean, low and high (95 % interval over the group's rows, by
    ``method`` as in ``mean_interval``)."""
    if isinstance(by, str):
        by = [by]
    if not isinstance(by, (list, tuple)) or not by or not all(isinstance(column, str) for column in by):
        raise TypeError(f"by must be a column name or a non-empty list of them, got {checks.shown(by)}")
    if not isinstance(value, str):
        raise TypeError(f"value must be a column name, got {checks.shown(value)}")
    checks.frame_columns("frame", frame, {"value": value, "by": by})
    rows = []
    for key, group in frame.groupby(by, sort=False, dropna=False):  # a NaN key is a group, not dropped
        mean, low, high = mean_interval(group[value], method)
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key)), "n": len(group), "mean": mean, "low": low, "high": high})
    return pd.DataFrame(rows)


def paired_differences(frame: pd.DataFrame, value: str, *, baseline: str, by: str, pair) -> pd.DataFrame:
    """``value`` minus the baseline's ``value`` with the same ``pair`` key — a column (e.g. the seed) or
    a list of columns (e.g. seed and step, for curves) — for every row whose ``by`` column is not
    ``baseline``, in the frame's order: columns by, *pair, difference."""
    if isinstance(pair, str):
        pair = [pair]
    elif not isinstance(pair, (list, tuple)) or not pair:
        raise TypeError(f"pair must be a column name or a non-empty list of them, got {checks.shown(pair)}")
    for name, column in (("value", value), ("by", by)):
        if not isinstance(column, str):
            raise TypeError(f"{name} must be one column name, got {checks.shown(column)}")
    checks.frame_columns("frame", frame, {"value": value, "by": by, "pair": pair})
    if isinstance(baseline, (list, tuple, dict, set)):
        raise TypeError(f"baseline must be one value of the {by} column, got {checks.shown(baseline)}")
    reference = frame[frame[by] == baseline][[*pair, value]]
    if reference.empty:
        raise ValueError(f"the frame has no baseline rows with {by} == {baseline!r}")
    if reference.duplicated(pair).any():
        raise ValueError(f"the baseline has more than one row for some {pair}: pair them uniquely")
    others = frame[frame[by] != baseline][[by, *pair, value]]
    joined = others.merge(reference, on=pair, how="left", suffixes=("", "_baseline"), indicator=True)
    missing = joined[joined["_merge"] == "left_only"][pair].drop_duplicates()
    if len(missing):
        shown = missing.iloc[:, 0].tolist() if len(pair) == 1 else missing.values.tolist()
        raise ValueError(f"the baseline has no row for {', '.join(pair)} {sorted(shown)}")
    joined["difference"] = joined[value] - joined[f"{value}_baseline"]
    return joined[[by, *pair, "difference"]].reset_index(drop=True)


# --- the standard tests: paired t, Holm, TOST, the detectable effect ------------------------------


def _incomplete_beta(a: float, b: float, x: float, complement: float | None = None) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz),
    to about 1e-14 relative. ``complement``: 1 − x where the caller has it exactly (1.0 − x rounds)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _incomplete_beta(b, a, 1.0 - x if complement is None else complement, x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def t_cdf(t: float, degrees_of_freedom: float) -> float:
    """P(T ≤ t) for Student's t with the given degrees of freedom (> 0)."""
    t = checks.number("t", t, finite=False)
    checks.number("degrees_of_freedom", degrees_of_freedom, low=0, open_low=True)
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    nu, square = degrees_of_freedom, t * t
    if square < nu:  # near the centre: 1/2 plus or minus the share between 0 and |t|
        centre = 0.5 * _incomplete_beta(0.5, nu / 2, square / (nu + square), nu / (nu + square))
        if t > 0 or centre <= 0.25:  # at most one bit lost to 1/2 − centre
            return 0.5 + centre if t > 0 else 0.5 - centre
    # the tail beyond |t| itself: far below the centre, 1/2 − centre would cancel (p-values read this side)
    tail = 0.5 * _incomplete_beta(nu / 2, 0.5, nu / (nu + square), square / (nu + square))
    return 1.0 - tail if t > 0 else tail


def t_quantile(probability: float, degrees_of_freedom: float) -> float:
    """The t with P(T ≤ t) = ``probability`` (in (0, 1)), by bisection on ``t_cdf`` until the bracket
    holds no other double (relative error about 1e-15 where ``t_cdf`` is that exact)."""
    checks.number("probability", probability, low=0, high=1, open_low=True, open_high=True)
    checks.number("degrees_of_freedom", degrees_of_freedom, low=0, open_low=True)
    if probability == 0.5:
        return 0.0
    # bisect on the side the probability is on (1 − p would round away a small p's digits)
    side = 1.0 if probability > 0.5 else -1.0
    low, high = 0.0, side
    while (t_cdf(high, degrees_of_freedom) < probability) == (side > 0):
        low, high = high, high * 2
    for _ in range(2000):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if (t_cdf(middle, degrees_of_freedom) < probability) == (side > 0):
            low = middle
        else:
            high = middle
    return high


def _finite_values(name: str, values) -> np.ndarray:
    return np.asarray(_real_values(name, values), dtype=np.float64)


def paired_test(differences, alpha: float = 0.05) -> dict:
    """The paired t-test of H0 "the mean difference is 0" on per-seed ``differences`` (≥ 2): n, mean,
    its (1 − alpha) interval (low, high), sd, t, df and the two-sided p. Zero spread gives p = 0 for a
    non-zero mean and 1 for a zero one."""
    values = _finite_values("differences", differences)
    checks.number("alpha", alpha, low=0, high=1, open_low=True, open_high=True)
    n = len(values)
    if n < 2:
        raise ValueError(f"a paired test needs at least 2 differences (seeds), got {n}")
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    half = _t_quantile_cached(1 - alpha / 2, n - 1) * sd / math.sqrt(n)
    if sd == 0:
        t, p = (math.copysign(math.inf, mean), 0.0) if mean != 0 else (0.0, 1.0)
    else:
        t = mean / (sd / math.sqrt(n))
        p = 2 * t_cdf(-abs(t), n - 1)
    return {
        "n": n,
        "mean": mean,
        "low": mean - half,
        "high": mean + half,
        "sd": sd,
        "t": t,
        "df": n - 1,
        "p": p,
    }


EXACT_SIGN_FLIPS_MAX = 20  # up to 2**20 sign patterns enumerated exactly; more pairs draw seeded patterns


def sign_flip_test(differences, *, resamples: int = 100_000, seed: int = 0) -> dict:
    """The paired permutation test of H0 "each difference is as likely positive as negative": the share
    of the 2ⁿ sign patterns whose |mean| is at least the observed |mean| (two-sided; sums within their
    rounding, 4·n·eps·Σ|d|, of the observed one count as ties, and ties as at least). Exact for n ≤ 20
    pairs; beyond, the share over ``resamples`` seeded patterns with the observed one counted
    ((k + 1) / (resamples + 1)). Returns n, mean, p, patterns (how many were counted) and exact."""
    values = _finite_values("differences", differences)
    checks.integer("resamples", resamples, low=100, high=10**7)
    checks.integer("seed", seed, low=0)
    n = len(values)
    if n < 1:
        raise ValueError(
            "differences must hold at least 1 value (one per seed) for a sign-flip test, got none"
        )
    observed = abs(float(values.sum()))
    # a pattern's sum and the observed one each carry at most n·eps·Σ|d| of rounding: ties within that
    tolerance = 4 * n * np.finfo(np.float64).eps * float(np.abs(values).sum())
    if n <= EXACT_SIGN_FLIPS_MAX:
        sums = np.zeros(1)
        for value in values:  # every pattern's sum, one difference at a time: 2, 4, … 2ⁿ sums
            sums = np.concatenate([sums + value, sums - value])
        at_least = int(np.count_nonzero(np.abs(sums) >= observed - tolerance))
        return {"n": n, "mean": float(values.mean()), "p": at_least / len(sums), "patterns": len(sums),
                "exact": True}  # fmt: skip
    generator, at_least = np.random.default_rng(seed), 0
    for start in range(0, resamples, 10_000):  # in chunks: a pattern matrix of resamples × n could be GBs
        signs = generator.integers(0, 2, size=(min(10_000, resamples - start), n)) * 2 - 1
        at_least += int(np.count_nonzero(np.abs(signs @ values) >= observed - tolerance))
    return {"n": n, "mean": float(values.mean()), "p": (at_least + 1) / (resamples + 1),
            "patterns": resamples, "exact": False}  # fmt: skip


def holm(p_values) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the k-th smallest p times (m − k + 1),
    made non-decreasing, capped at 1. A family's claim holds at α where its adjusted p ≤ α."""
    values = _finite_values("p_values", p_values)
    if ((values < 0) | (values > 1)).any():
        raise ValueError(f"p_values must lie in [0, 1], got {values.tolist()}")
    m = len(values)
    order = np.argsort(values, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * values[index]))
        adjusted[index] = running
    return adjusted.tolist()


def tost(differences, margin: float) -> dict:
    """Two one-sided t-tests of equivalence: H0 "|mean difference| ≥ margin" against H1 "within ±margin".
    Returns n, mean, sd, margin, the two one-sided p (p_lower for mean ≤ −margin, p_upper for mean ≥
    margin) and p = their maximum; equivalence is shown at α where p ≤ α (the (1 − 2α) interval lies
    inside ±margin)."""
    values = _finite_values("differences", differences)
    checks.number("margin", margin, low=0, open_low=True)
    n = len(values)
    if n < 2:
        raise ValueError(f"an equivalence test needs at least 2 differences (seeds), got {n}")
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    error = sd / math.sqrt(n)
    if error == 0:
        p_lower = 0.0 if mean > -margin else 1.0
        p_upper = 0.0 if mean < margin else 1.0
    else:
        p_lower = t_cdf(-(mean + margin) / error, n - 1)  # P(T ≥ z) by symmetry, not 1 − P(T ≤ z)
        p_upper = t_cdf((mean - margin) / error, n - 1)
    return {"n": n, "mean": mean, "sd": sd, "margin": margin, "p_lower": p_lower, "p_upper": p_upper,
            "p": max(p_lower, p_upper)}  # fmt: skip


def ratio_interval(numerators, denominators, alpha: float = 0.05) -> dict:
    """A ratio of two paired means, mean(numerators) / mean(denominators) (one pair per seed, ≥ 2),
    with Fieller's (1 − alpha) interval: the ratios R that the paired t-test of numerator − R ·
    denominator does not reject at alpha. Exact under normal per-seed pairs, which the delta method
    is not with few seeds. Returns n, ratio, low, high and bounded: the interval is finite only where
    the denominator's mean is itself resolved from zero at alpha; otherwise low and high are NaN."""
    top = _finite_values("numerators", numerators)
    bottom = _finite_values("denominators", denominators)
    checks.number("alpha", alpha, low=0, high=1, open_low=True, open_high=True)
    if len(top) != len(bottom):
        raise ValueError(f"numerators and denominators must pair up, got {len(top)} and {len(bottom)} values")
    n = len(top)
    if n < 2:
        raise ValueError(f"a ratio interval needs at least 2 pairs (seeds), got {n}")
    mean_top, mean_bottom = float(top.mean()), float(bottom.mean())
    if mean_bottom == 0:
        raise ValueError("denominators must not average to zero: the ratio is undefined")
    covariance = np.cov(np.stack([top, bottom]), ddof=1)
    q = _t_quantile_cached(1 - alpha / 2, n - 1) ** 2 / n
    # (mean_top − R·mean_bottom)² ≤ q · var(top − R·bottom): a·R² − 2·b·R + c ≤ 0
    a = mean_bottom**2 - q * covariance[1, 1]
    b = mean_top * mean_bottom - q * covariance[0, 1]
    c = mean_top**2 - q * covariance[0, 0]
    ratio = mean_top / mean_bottom
    if a <= 0:
        return {"n": n, "ratio": ratio, "low": math.nan, "high": math.nan, "bounded": False}
    root = math.sqrt(max(b * b - a * c, 0.0))
    return {"n": n, "ratio": ratio, "low": (b - root) / a, "high": (b + root) / a, "bounded": True}


def detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t-test at ``alpha`` detects with probability
    ``power`` from ``n`` pairs of standard deviation ``sd``: the exact noncentral-t power solved for the
    effect (``t_test_power``; the shortcut (t_{1−α/2} + t_{power}) · sd / √n promises 80 % where
    2 pairs give 73 %)."""
    checks.number("sd", sd, low=0)
    checks.integer("n", n, low=2)
    checks.number("alpha", alpha, low=0, high=1, open_low=True, open_high=True)
    checks.number("power", power, low=alpha, high=1, open_low=True, open_high=True)
    return _detectable_in_sds(n, alpha, power) * sd


@functools.lru_cache(maxsize=1024)
def _detectable_in_sds(n: int, alpha: float, power: float) -> float:
    """``detectable_effect`` for sd = 1, by bisection on ``t_test_power`` (it rises with the effect)."""
    low, high = 0.0, 1.0
    while t_test_power(high, n, alpha) < power:
        low, high = high, high * 2
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high) or high - low < 1e-12 * high:
            break
        if t_test_power(middle, n, alpha) < power:
            low = middle
        else:
            high = middle
    return high


_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(32)


def t_test_power(effect: float, n: int, alpha: float = 0.05) -> float:
    """The probability that a two-sided one-sample (paired) t-test at ``alpha`` rejects from ``n``
    pairs when the true mean is ``effect`` standard deviations: P(|T| > t_{1−α/2, n−1}) for T
    noncentral t with n − 1 degrees of freedom and noncentrality effect · √n. Integrated over
    S = √(χ²_ν/ν): E[Φ(λ − c·S) + Φ(−λ − c·S)], Gauss-Legendre on 64 panels and 16 more where
    Φ(λ − c·S) turns (about 1e-10)."""
    checks.number("effect", effect, low=0)
    checks.integer("n", n, low=2)
    checks.number("alpha", alpha, low=0, high=1, open_low=True, open_high=True)
    nu = n - 1
    critical = _t_quantile_cached(1 - alpha / 2, nu)
    shift = effect * math.sqrt(n)
    spread = 1 / math.sqrt(2 * nu)  # S's standard deviation, about
    start, stop = max(0.0, 1 - 40 * spread), 1 + 40 * spread + 10 / nu
    # Φ(λ − c·S) turns from 1 to 0 within a few 1/c of S = λ/c: panels there too, for a large c
    turn = shift / critical + np.arange(-8, 9) / critical
    edges = np.unique(np.concatenate([np.linspace(start, stop, 65), turn[(turn > start) & (turn < stop)]]))
    half = np.diff(edges)[:, None] / 2
    s = (edges[:-1, None] + half) + half * _NODES[None, :]
    log_density = (
        math.log(2)
        + (nu / 2) * math.log(nu / 2)
        - math.lgamma(nu / 2)
        + (nu - 1) * np.log(s)
        - nu * s * s / 2
    )
    normal_cdf = np.vectorize(lambda z: 0.5 * math.erfc(-z / math.sqrt(2)))
    rejects = normal_cdf(shift - critical * s) + normal_cdf(-shift - critical * s)
    return float(min(1.0, (rejects * np.exp(log_density) * half * _WEIGHTS[None, :]).sum()))


def seeds_for_effect(
    sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, most: int = 1000
) -> int:
    """The fewest pairs (seeds, ≥ 2) whose ``detectable_effect`` is at most ``effect``; ValueError
    beyond ``most``."""
    checks.number("sd", sd, low=0)
    checks.number("effect", effect, low=0, open_low=True)
    most = checks.integer("most", most, low=2, high=10**6)  # a search, not an allocation: keep it short
    if detectable_effect(sd, most, alpha, power) > effect:
        raise ValueError(f"effect {effect} needs more than {most} seeds at sd {sd}")
    low, high = 1, most  # the effect detectable falls as pairs are added: bisect on n
    while high - low > 1:
        middle = (low + high) // 2
        if detectable_effect(sd, middle, alpha, power) <= effect:
            high = middle
        else:
            low = middle
    return high
