"""The same runs on two machines: how far a change of CPU (or of thread count) moves a run's final loss,
each paired comparison built from those runs, and whether a committed finding survives that move.

A folder of runs holds the CSVs that notebooks 03 and 07 write (their per-run final validation losses)
and a ``machine.json`` saying where they were made: ``cpu``, ``threads`` (per run), ``qlab_commit``.
"""

from __future__ import annotations

import json
import math
import re

import pandas as pd

from qlab import checks, claims, paths, stats

NOTEBOOKS = ("03_backward_override_training_curves", "07_recipe_ablations")
MODE_PAIRS = (("high_precision", "none"), ("dequantized", "none"), ("dequantized", "high_precision"))
ABLATION_INGREDIENTS = ("no 2D weight", "no SR", "no RHT", "+BF16 last block", "none")
ALPHA = 0.05
RUN_COLUMNS = ("config", "seed", "val_loss")  # what final_losses returns, one row per run


def machine_record(folder, name: str = "machine.json") -> dict:
    """``folder/name`` (JSON: cpu, threads, qlab_commit, ...) with ``cpu_short`` added (the CPU's maker
    and family, e.g. "AMD EPYC")."""
    folder = paths.existing_folder("folder", folder, "folder of runs")
    path = folder / paths.result_name("name", name, "file name")
    where = f"{name!r} in folder {paths.shown(folder)}"
    if not path.is_file():
        raise FileNotFoundError(f"{where} is missing: a folder of runs says where they were made")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # not JSON, or not UTF-8
        raise ValueError(f"{where} is not JSON: {err}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} must hold a JSON object, got {record!r:.80}")
    missing = [k for k in ("cpu", "threads", "qlab_commit") if k not in record]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    if not isinstance(record["cpu"], str):
        raise ValueError(f"{where}: cpu must be a str, got {record['cpu']!r}")
    record["cpu_short"] = " ".join(re.sub(r"\(.*?\)", "", record["cpu"]).replace("Processor", "").split()[:3])
    return record


def final_losses(notebook: str, folder) -> pd.DataFrame:
    """One row per run of ``notebook`` in ``folder``: config (03: "fp32", "bf16" or "recipe/override";
    07: the variant), seed, val_loss (the last evaluation)."""
    from qlab.results import read_csv

    checks.choice("notebook", notebook, NOTEBOOKS)
    folder = paths.existing_folder("folder", folder, "folder of runs")
    if notebook.startswith("03"):
        columns = ["recipe", "override", "seed", "step", "val_loss"]
        curves = read_csv(folder / f"{notebook}_curves.csv", columns, name="folder", what="curves CSV")
        curves = curves.dropna(subset=["val_loss"])
        last = curves.loc[curves.groupby(["recipe", "override", "seed"]).step.idxmax()]
        baseline = last.recipe.isin(["fp32", "bf16"])
        config = last.recipe.where(baseline, last.recipe + "/" + last.override)
        return pd.DataFrame({"config": config, "seed": last.seed, "val_loss": last.val_loss}).reset_index(
            drop=True
        )
    columns = ["variant", "seed", "val_loss"]
    training = read_csv(folder / f"{notebook}_training.csv", columns, name="folder", what="training CSV")
    return training.rename(columns={"variant": "config"})[["config", "seed", "val_loss"]]


def run_shifts(moved: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """moved − reference final loss for every (config, seed) both hold: config, seed, shift."""
    checks.frame_columns("moved", moved, RUN_COLUMNS)
    checks.frame_columns("reference", reference, RUN_COLUMNS)
    both = moved.merge(reference, on=["config", "seed"], suffixes=("", "_reference"))
    return both.assign(shift=both.val_loss - both.val_loss_reference)[["config", "seed", "shift"]]


def seed_spread(runs: pd.DataFrame) -> pd.DataFrame:
    """The seed-to-seed standard deviation of each config's final loss: config, n, sd."""
    checks.frame_columns("runs", runs, RUN_COLUMNS)
    grouped = runs.groupby("config", sort=False).val_loss
    return pd.DataFrame({"n": grouped.size(), "sd": grouped.std(ddof=1)}).reset_index()


def comparison_pairs(notebook: str, configs) -> list[tuple[str, str, str]]:
    """(key, a, b) of every paired comparison a − b that ``notebook`` states, keyed as its claims are."""
    checks.choice("notebook", notebook, NOTEBOOKS)
    if not isinstance(configs, (list, tuple, pd.Series, pd.Index)):
        raise TypeError(f"configs must be a list of config names, got {checks.shown(configs)}")
    configs = list(dict.fromkeys(configs))
    if not all(isinstance(config, str) for config in configs):
        raise TypeError(f"configs must hold config names (str), got {checks.shown(configs)}")
    pairs = []
    if notebook.startswith("03"):
        for config in configs:
            if config == "fp32":
                continue
            pairs.append(("gap." + config.replace("/", "."), config, "fp32"))
        for recipe in dict.fromkeys(c.split("/")[0] for c in configs if "/" in c):
            for a, b in MODE_PAIRS:
                if f"{recipe}/{a}" in configs and f"{recipe}/{b}" in configs:
                    pairs.append(
                        (claims.key_for("modes", recipe, f"{a}-{b}"), f"{recipe}/{a}", f"{recipe}/{b}")
                    )
        return pairs
    for config in configs:
        if config != "fp32":
            name = config.replace("/", ".").replace(" ", "_").replace("+", "plus_")
            pairs.append((f"train.{name}", config, "fp32"))
    for recipe in ("nvfp4", "mxfp4_training"):
        for ingredient in ABLATION_INGREDIENTS:
            if f"{recipe}/{ingredient}" in configs and recipe in configs:
                pairs.append(
                    (
                        claims.key_for("ablation", recipe, f"{ingredient}-all"),
                        f"{recipe}/{ingredient}",
                        recipe,
                    )
                )
    return pairs


def difference_spread(notebook: str, runs: pd.DataFrame) -> pd.DataFrame:
    """Each paired comparison a − b that ``notebook`` states, over the seeds that ran both: key, n, sd
    (the seed-to-seed standard deviation of a − b; seed effects common to a and b cancel in it, so it
    is usually far below ``seed_spread``'s) and error = sd/√n, the standard error of its mean — the
    scale its paired interval is built on, and the one a shift of that mean is read against."""
    checks.choice("notebook", notebook, NOTEBOOKS)
    checks.frame_columns("runs", runs, RUN_COLUMNS)
    wide = runs.pivot_table(index="seed", columns="config", values="val_loss")
    rows = []
    for key, a, b in comparison_pairs(notebook, list(dict.fromkeys(runs.config))):
        differences = (wide[a] - wide[b]).dropna()
        sd = float(differences.std(ddof=1))
        rows.append({"key": key, "n": len(differences), "sd": sd, "error": sd / math.sqrt(len(differences))})
    return pd.DataFrame(rows, columns=["key", "n", "sd", "error"])


def comparisons(notebook: str, first: pd.DataFrame, second: pd.DataFrame, first_name: str, second_name: str):
    """Each comparison of ``notebook`` estimated on both machines from the seeds both ran: key, a, b,
    n, <machine>_mean/_low/_high (paired t, 95 %), shift (second − first), shift_low/shift_high (the 95 %
    interval of the shift over the seeds, paired t on each seed's shift) and verdicts_differ (the interval
    excludes zero on one machine and not on the other)."""
    checks.choice("notebook", notebook, NOTEBOOKS)
    checks.frame_columns("first", first, RUN_COLUMNS)
    checks.frame_columns("second", second, RUN_COLUMNS)
    for name, value in (("first_name", first_name), ("second_name", second_name)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str naming a machine, got {checks.shown(value)}")
        if not value:
            raise ValueError(f"{name} must name a machine, got an empty string")
    if first_name == second_name:
        raise ValueError(f"first_name and second_name must differ, got {first_name!r} twice")
    seeds = sorted(set(first.seed) & set(second.seed))
    rows = []
    both = set(second.config)
    for key, a, b in comparison_pairs(notebook, [c for c in dict.fromkeys(first.config) if c in both]):
        row = {"notebook": notebook, "key": key, "a": a, "b": b, "n": len(seeds)}
        excludes, per_seed = [], []
        for name, runs in ((first_name, first), (second_name, second)):
            wide = runs[runs.seed.isin(seeds)].pivot_table(index="seed", columns="config", values="val_loss")
            test = stats.paired_test(wide[a] - wide[b])
            row.update(
                {f"{name}_mean": test["mean"], f"{name}_low": test["low"], f"{name}_high": test["high"]}
            )
            excludes.append(test["low"] > 0 or test["high"] < 0)
            per_seed.append((wide[a] - wide[b]).sort_index())
        row["shift"] = row[f"{second_name}_mean"] - row[f"{first_name}_mean"]
        shift = stats.paired_test(per_seed[1] - per_seed[0])
        row["shift_low"], row["shift_high"] = shift["low"], shift["high"]
        row["verdicts_differ"] = excludes[0] != excludes[1]
        rows.append(row)
    return pd.DataFrame(rows)


def _holm_level_interval(claim, alpha: float = ALPHA) -> tuple[float, float, float]:
    """(confidence, low, high): the interval of a committed claim at the level at which it agrees with
    the claim's adjusted p — it excludes zero (a paired t) or lies within ±margin (a TOST) exactly when
    the adjusted p is at most ``alpha``. That level is alpha · p / p_adjusted: Holm's step level
    alpha/(m − k + 1), or smaller where Holm's running maximum binds (alpha itself when unadjusted). The
    standard error is read back from the stored 95 % interval (90 % for a TOST) and n seeds."""
    p_adjusted = claim.p_adjusted
    adjusted = isinstance(p_adjusted, float) and math.isfinite(p_adjusted) and p_adjusted > 0
    level = alpha * claim.p / p_adjusted if adjusted else alpha
    equivalence = claim.test == "TOST"
    low, high = (claim.low_90, claim.high_90) if equivalence else (claim.low, claim.high)
    stored = stats.t_quantile(1 - alpha if equivalence else 1 - alpha / 2, claim.n - 1)
    error = (high - low) / 2 / stored
    if error == 0 or level <= 0:
        return (1 - 2 * level if equivalence else 1 - level), low, high
    half = stats.t_quantile(1 - level if equivalence else 1 - level / 2, claim.n - 1) * error
    return (1 - 2 * level if equivalence else 1 - level), claim.value - half, claim.value + half


def survival(committed: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """For each committed claim that resolves a comparison (paired t, adjusted p ≤ 0.05) or shows it
    equivalent (TOST, p ≤ 0.05) and whose comparison ``measured`` holds: its interval at the level at
    which it agrees with the adjusted p (``_holm_level_interval``: wider than the stored 95 % one in a
    family, so that it holds exactly when the committed verdict does) moved by the whole 95 % interval of
    the comparison's shift — low + shift_low, high + shift_high, so the shift's spread over seeds widens
    it — and whether the moved interval still excludes zero (resolved) or still lies within ±margin
    (equivalent): a strict check, not a test at a stated level. Columns: key, kind, value, confidence,
    low, high, shift, shift_low, shift_high, moved_low, moved_high, survives, and survives_mean_shift:
    whether the interval moved by the mean shift alone (low + shift, high + shift) still holds — the
    lenient check; a few seeds on the second machine make the two far apart."""
    checks.frame_columns("committed", committed, ["key", "test", "value", "low", "high", "low_90", "high_90",
                                                  "n", "p", "p_adjusted"])  # fmt: skip
    checks.frame_columns("measured", measured, ["key", "shift", "shift_low", "shift_high"])
    shifts = measured.set_index("key")[["shift", "shift_low", "shift_high"]]
    rows = []
    for claim in committed.itertuples():
        p = (
            claim.p_adjusted
            if isinstance(claim.p_adjusted, float) and math.isfinite(claim.p_adjusted)
            else claim.p
        )
        if not (isinstance(p, float) and math.isfinite(p) and p <= ALPHA):
            continue
        if claim.test == "paired t" and claim.key in shifts.index:
            kind, shift = "resolved", shifts.loc[claim.key]
        elif claim.test == "TOST" and claim.key.removesuffix(".same") in shifts.index:
            kind, shift = "equivalent", shifts.loc[claim.key.removesuffix(".same")]
        else:
            continue
        confidence, low, high = _holm_level_interval(claim)

        def holds(low: float, high: float, kind=kind, margin=claim.margin) -> bool:
            """Whether an interval still excludes zero (resolved) or lies within ±margin (equivalent)."""
            return (low > 0 or high < 0) if kind == "resolved" else (-margin < low and high < margin)

        interval = (low, high)
        low, high = low + shift["shift_low"], high + shift["shift_high"]
        survives = holds(low, high)
        survives_point = holds(interval[0] + shift["shift"], interval[1] + shift["shift"])
        rows.append({"key": claim.key, "kind": kind, "value": claim.value, "confidence": confidence,
                     "low": interval[0], "high": interval[1], "shift": shift["shift"],
                     "shift_low": shift["shift_low"], "shift_high": shift["shift_high"], "moved_low": low,
                     "moved_high": high, "survives": bool(survives),
                     "survives_mean_shift": bool(survives_point)})  # fmt: skip
    columns = [
        "key",
        "kind",
        "value",
        "confidence",
        "low",
        "high",
        "shift",
        "shift_low",
        "shift_high",
        "moved_low",
        "moved_high",
        "survives",
        "survives_mean_shift",
    ]
    return pd.DataFrame(rows, columns=columns)
