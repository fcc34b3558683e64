"""Means over seeds with 95 % intervals, and paired differences against a baseline.

    mean, low, high = mean_interval([0.41, 0.44, 0.40])        # Student-t, n − 1 degrees of freedom
    mean, low, high = mean_interval(values, method="bootstrap")  # percentile bootstrap of the mean
    frame = paired_differences(runs, "val_loss", baseline="fp32", by="recipe", pair="seed")

The t interval is mean ± t·s/√n with s the sample standard deviation (n − 1) and t the two-sided
95 % quantile of Student's t with n − 1 degrees of freedom, from the standard table (no scipy). The
bootstrap interval is the 2.5 % and 97.5 % quantiles (inverted CDF: the smallest mean whose cumulative
share reaches the level) of the means of resamples with replacement — every one of the nⁿ resamples
when nⁿ ≤ 10⁶ (exact, no randomness), else ``resamples`` seeded draws. It assumes no normality, but
with few seeds it is too narrow: prefer t for ≤ 10 seeds. One value has no interval (NaN bounds): a
single observation is reported as such.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import pandas as pd

from qlab import checks

# two-sided 95 % quantiles t_{0.975, df} of Student's t (standard tables, 3 decimals), df = 1 … 30
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z_975 = 1.960  # beyond 30 degrees of freedom the normal quantile (t_{0.975, 30} = 2.042 is within 4 %)


def t_quantile_975(degrees_of_freedom: int) -> float:
    """t_{0.975} with the given degrees of freedom (≥ 1): the table above, 1.960 beyond 30."""
    checks.integer("degrees_of_freedom", degrees_of_freedom, low=1)
    return T_975[degrees_of_freedom - 1] if degrees_of_freedom <= len(T_975) else Z_975


METHODS = ("t", "bootstrap")
_EXACT_BOOTSTRAP_MAX = 10**6  # resamples enumerated exactly up to this many (n = 7 gives 823,543)


def mean_interval(
    values, method: str = "t", *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its 95 % interval by ``method`` ("t" or
    "bootstrap"); (v, nan, nan) for one value. Non-finite values are refused (a diverged run is
    reported, not averaged). ``resamples`` and ``seed`` matter only for a bootstrap of more than 7
    values (fewer are enumerated exactly)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"values must be a sequence of numbers, got {checks.shown(values)}")
    method = checks.choice("method", method, METHODS)
    checks.integer("resamples", resamples, low=100)
    checks.integer("seed", seed, low=0)
    values = list(values)
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        raise TypeError(f"values must be real numbers, got {values[:5]}")
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value, got none")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"mean_interval needs finite values, got {values}")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    if method == "bootstrap":
        low, high = _bootstrap_bounds(np.array(values), resamples, seed)
        return mean, low, high
    deviation = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * deviation / math.sqrt(n)
    return mean, mean - half, mean + half


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
    checks.frame_columns("frame", frame, [value, *by])
    rows = []
    for key, group in frame.groupby(by, sort=False):
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
    checks.frame_columns("frame", frame, [value, by, *pair])
    reference = frame[frame[by] == baseline][[*pair, value]]
    if reference.empty:
        raise ValueError(f"no baseline rows with {by} == {baseline!r}")
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
