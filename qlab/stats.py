"""Means over seeds with 95 % intervals, and paired differences against a baseline.

    mean, low, high = mean_interval([0.41, 0.44, 0.40])        # Student-t, n − 1 degrees of freedom
    frame = paired_differences(runs, "val_loss", baseline="fp32", by="recipe", pair="seed")

The interval is mean ± t·s/√n with s the sample standard deviation (n − 1) and t the two-sided 95 %
quantile of Student's t with n − 1 degrees of freedom, from the standard table (no scipy). One
value has no interval (NaN bounds): a single observation is reported as such.
"""

from __future__ import annotations

import math
import numbers

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


def mean_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its 95 % Student-t interval; (v, nan, nan) for one
    value. Non-finite values are refused (a diverged run is reported, not averaged)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"values must be a sequence of numbers, got {checks.shown(values)}")
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
    deviation = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * deviation / math.sqrt(n)
    return mean, mean - half, mean + half


def summarize(frame: pd.DataFrame, value: str, by: list[str]) -> pd.DataFrame:
    """One row per group of ``by``: n, mean, low and high (95 % interval over the group's rows)."""
    for column in (value, *by):
        if column not in frame.columns:
            raise ValueError(f"column {column!r} is not in the frame (columns: {list(frame.columns)})")
    rows = []
    for key, group in frame.groupby(by, sort=False):
        mean, low, high = mean_interval(group[value])
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key)), "n": len(group), "mean": mean, "low": low, "high": high})
    return pd.DataFrame(rows)


def paired_differences(frame: pd.DataFrame, value: str, *, baseline: str, by: str, pair: str) -> pd.DataFrame:
    """``value`` minus the baseline's ``value`` with the same ``pair`` key (e.g. the same seed), for every
    row whose ``by`` column is not ``baseline``: columns by, pair, difference."""
    for column in (value, by, pair):
        if column not in frame.columns:
            raise ValueError(f"column {column!r} is not in the frame (columns: {list(frame.columns)})")
    reference = frame[frame[by] == baseline].set_index(pair)[value]
    if reference.empty:
        raise ValueError(f"no baseline rows with {by} == {baseline!r}")
    others = frame[frame[by] != baseline]
    missing = set(others[pair]) - set(reference.index)
    if missing:
        raise ValueError(f"the baseline has no row for {pair} {sorted(missing)}")
    return others.assign(difference=others[value].to_numpy() - reference.loc[others[pair]].to_numpy())[
        [by, pair, "difference"]
    ].reset_index(drop=True)
