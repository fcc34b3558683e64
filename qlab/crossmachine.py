"""The same runs on two machines: how far a change of CPU (or of thread count) moves a run's final loss,
each paired comparison built from those runs, and whether a committed finding survives that move.

A folder of runs holds the CSVs that notebooks 03 and 07 write (their per-run final validation losses)
and a ``machine.json`` saying where they were made: ``cpu``, ``threads`` (per run), ``qlab_commit``.
"""

from __future__ import annotations

import json
import math
import numbers
import re

import numpy as np
import pandas as pd

from qlab import checks, claims, paths, stats

NOTEBOOKS = ("03_backward_override_training_curves", "07_recipe_ablations")
MODE_PAIRS = (("high_precision", "none"), ("dequantized", "none"), ("dequantized", "high_precision"))
ABLATION_INGREDIENTS = ("no 2D weight", "no SR", "no RHT", "+BF16 last block", "none")
ALPHA = 0.05
RUN_COLUMNS = ("config", "seed", "val_loss")  # what final_losses returns, one row per run
# the columns comparisons always writes; a machine's name must not derive one of them (<name>_low, ...)
_COMPARISON_COLUMNS = ("notebook", "key", "a", "b", "n", "shift", "shift_low", "shift_high",
                       "verdicts_differ")  # fmt: skip
# the cells pandas reads as missing by default: the numbers of a runs CSV are read so, its names verbatim
# (an override or a variant named "None" or "NA" is a name, not a missing value)
_MISSING_TEXT = ("", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                 "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null")  # fmt: skip


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
        path, names, numbers = folder / f"{notebook}_curves.csv", ["recipe", "override"], ["seed", "step"]
    else:
        path, names, numbers = folder / f"{notebook}_training.csv", ["variant"], ["seed"]
    what = "curves CSV" if notebook.startswith("03") else "training CSV"
    frame = read_csv(path, [*names, *numbers, "val_loss"], name="folder", what=what, keep_default_na=False,
                     na_values=dict.fromkeys([*numbers, "val_loss"], _MISSING_TEXT),
                     dtype=dict.fromkeys(names, str))  # fmt: skip
    for column in names + numbers:
        absent = frame[column].isna() | (frame[column] == "") if column in names else frame[column].isna()
        if absent.any():
            raise ValueError(
                f"folder {paths.shown(path)} is not a {what}: line {absent.to_numpy().argmax() + 2} has no "
                f"{column}, which every run needs"
            )
    source = f"({paths.shown(path)})"
    if notebook.startswith("03"):
        if len(frame) and (
            not pd.api.types.is_numeric_dtype(frame.step) or pd.api.types.is_bool_dtype(frame.step)
        ):
            raise ValueError(
                f"folder {paths.shown(path)} is not a {what}: its step column holds {frame.step.dtype}"
                f" values ({checks.shown(frame.step.iloc[0])} first), not step numbers"
            )
        curves = frame.dropna(subset=["val_loss"])
        last = curves.loc[curves.groupby(["recipe", "override", "seed"]).step.idxmax()]
        baseline = last.recipe.isin(["fp32", "bf16"])
        config = last.recipe.where(baseline, last.recipe + "/" + last.override)
        runs = pd.DataFrame({"config": config, "seed": last.seed, "val_loss": last.val_loss})
        return _check_runs("folder", runs.reset_index(drop=True), source)
    return _check_runs("folder", frame.rename(columns={"variant": "config"})[list(RUN_COLUMNS)], source)


def _check_runs(argument: str, frame, source: str = "") -> pd.DataFrame:
    """``frame`` as a frame of runs: the columns RUN_COLUMNS, a config and a seed on every row, one row per
    (config, seed) (pandas would average a run given twice, or pair it twice) and numeric val_loss (NaN
    for a diverged run). ``source`` says where the rows were read from, for the messages."""
    checks.frame_columns(argument, frame, RUN_COLUMNS)
    where = f"{argument} {source}" if source else argument
    losses = frame.val_loss
    numeric = pd.api.types.is_numeric_dtype(losses) or not len(losses)  # an empty column has no dtype to read
    if not numeric or pd.api.types.is_bool_dtype(losses) or pd.api.types.is_complex_dtype(losses):
        odd = [v for v in losses if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_))]
        raise TypeError(
            f"{where} val_loss must hold real numbers (a final validation loss per run, NaN for a diverged "
            f"one), got dtype {losses.dtype}{', holding ' + checks.shown(odd[0]) if odd else ''}"
        )
    keyless = frame.config.isna() | frame.seed.isna()
    if keyless.any():
        row = frame[keyless].iloc[0]
        raise ValueError(
            f"{where} holds a run without a config or a seed (config {_plain(row.config)!r}, seed "
            f"{_plain(row.seed)!r}); every run needs both"
        )
    repeated = frame.duplicated(["config", "seed"], keep=False)
    if repeated.any():
        row = frame[repeated].iloc[0]
        count = int(((frame.config == row.config) & (frame.seed == row.seed)).sum())
        raise ValueError(
            f"{where} holds config {_plain(row.config)!r} seed {_plain(row.seed)!r} {count} times: one row "
            "per run expected"
        )
    return frame


def _plain(value):
    """A numpy scalar as the Python number it holds, for messages (2.5, not np.float64(2.5))."""
    return value.item() if isinstance(value, np.generic) else value


def _by_config(runs: pd.DataFrame) -> dict:
    """{config: its val_loss per seed} of a checked frame of runs."""
    return {config: group.set_index("seed").val_loss for config, group in runs.groupby("config", sort=False)}


def _differences(where: str, losses: dict, key: str, a: str, b: str, seeds: list) -> pd.Series:
    """a − b on each of ``seeds`` (which both ran), from ``_by_config``'s {config: val_loss per seed}; a
    non-finite one (a diverged run) is refused."""
    differences = losses[a].loc[seeds] - losses[b].loc[seeds]
    finite = np.isfinite(differences.to_numpy(dtype=np.float64, na_value=np.nan))
    if not finite.all():
        seed = seeds[int(np.argmin(finite))]
        got = f"{a} {_plain(losses[a][seed])!r} and {b} {_plain(losses[b][seed])!r} on seed {_plain(seed)!r}"
        raise ValueError(
            f"{where}: comparison {key} ({a} − {b}) must be finite on every seed (a diverged run is "
            f"reported, not averaged), got {got}"
        )
    return differences


def _too_few_seeds(where: str, key: str, a: str, b: str, losses: dict, seeds: list) -> ValueError:
    """The error for a comparison whose configs share fewer than 2 seeds, saying which runs are missing;
    ``losses`` is {machine: ``_by_config``'s dict}."""
    ran = {(machine, c): set(by[c].index) for machine, by in losses.items() for c in (a, b)}
    every = set().union(*ran.values())
    missing = "; ".join(
        f"{c} lacks seeds {sorted(every - held)}{f' on machine {machine!r}' if len(losses) > 1 else ''}"
        for (machine, c), held in ran.items()
        if every - held
    )
    return ValueError(
        f"{where}: comparison {key} ({a} − {b}) needs at least 2 seeds on which both configs ran"
        f"{' on both machines' if len(losses) > 1 else ''}, got {len(seeds)} {sorted(seeds)} ({missing})"
    )


def run_shifts(moved: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """moved − reference final loss for every (config, seed) both hold: config, seed, shift."""
    _check_runs("moved", moved)
    _check_runs("reference", reference)
    both = moved.merge(reference, on=["config", "seed"], suffixes=("", "_reference"))
    return both.assign(shift=both.val_loss - both.val_loss_reference)[["config", "seed", "shift"]]


def seed_spread(runs: pd.DataFrame) -> pd.DataFrame:
    """The seed-to-seed standard deviation of each config's final loss: config, n, sd."""
    _check_runs("runs", runs)
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
    scale its paired interval is built on, and the one a shift of that mean is read against. A pair
    sharing fewer than 2 seeds, or holding a diverged run (NaN), is refused, as ``comparisons`` does."""
    checks.choice("notebook", notebook, NOTEBOOKS)
    _check_runs("runs", runs)
    losses = _by_config(runs)
    rows = []
    for key, a, b in comparison_pairs(notebook, list(dict.fromkeys(runs.config))):
        seeds = sorted(set(losses[a].index) & set(losses[b].index))
        if len(seeds) < 2:
            raise _too_few_seeds("runs", key, a, b, {"runs": losses}, seeds)
        differences = _differences("runs", losses, key, a, b, seeds)
        sd = float(differences.std(ddof=1))
        rows.append({"key": key, "n": len(differences), "sd": sd, "error": sd / math.sqrt(len(differences))})
    return pd.DataFrame(rows, columns=["key", "n", "sd", "error"])


def comparisons(notebook: str, first: pd.DataFrame, second: pd.DataFrame, first_name: str, second_name: str):
    """Each comparison a − b of ``notebook`` estimated on both machines from the seeds on which a and b
    both ran on both machines (at least 2; a diverged run, NaN, is refused): key, a, b, n (those seeds),
    <machine>_mean/_low/_high (paired t, 95 %), shift (second − first), shift_low/shift_high (the 95 %
    interval of the shift over the seeds, paired t on each seed's shift) and verdicts_differ (the interval
    excludes zero on one machine and not on the other). A machine's name must not make one of the fixed
    columns (``"shift"`` would: shift_low)."""
    checks.choice("notebook", notebook, NOTEBOOKS)
    _check_runs("first", first)
    _check_runs("second", second)
    for name, value in (("first_name", first_name), ("second_name", second_name)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str naming a machine, got {checks.shown(value)}")
        if not value:
            raise ValueError(f"{name} must name a machine, got an empty string")
        derived = [f"{value}_{end}" for end in ("mean", "low", "high")]
        clash = [column for column in derived if column in _COMPARISON_COLUMNS]
        if clash:
            raise ValueError(
                f"{name} {value!r} would name the columns {derived}, and {clash} already name the result's "
                f"own columns ({', '.join(_COMPARISON_COLUMNS)}); give the machine another name"
            )
    if first_name == second_name:
        raise ValueError(f"first_name and second_name must differ, got {first_name!r} twice")
    losses = {first_name: _by_config(first), second_name: _by_config(second)}
    where = {first_name: f"first (machine {first_name!r})", second_name: f"second (machine {second_name!r})"}
    rows = []
    both = set(second.config)
    for key, a, b in comparison_pairs(notebook, [c for c in dict.fromkeys(first.config) if c in both]):
        seeds = sorted(set.intersection(*(set(by[c].index) for by in losses.values() for c in (a, b))))
        if len(seeds) < 2:
            raise _too_few_seeds("first and second", key, a, b, losses, seeds)
        row = {"notebook": notebook, "key": key, "a": a, "b": b, "n": len(seeds)}
        excludes, per_seed = [], []
        for name in (first_name, second_name):
            differences = _differences(where[name], losses[name], key, a, b, seeds)
            test = stats.paired_test(differences)
            row.update(
                {f"{name}_mean": test["mean"], f"{name}_low": test["low"], f"{name}_high": test["high"]}
            )
            excludes.append(test["low"] > 0 or test["high"] < 0)
            per_seed.append(differences)
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
                                                  "n", "p", "p_adjusted", "margin"])  # fmt: skip
    checks.frame_columns("measured", measured, ["key", "shift", "shift_low", "shift_high"])
    for name, frame in (("committed", committed), ("measured", measured)):
        keys = [key for key in frame.key if not isinstance(key, str)]
        if keys:
            raise TypeError(f"{name} key must hold comparison keys (str), got {checks.shown(keys[0])}")
    repeated = measured.key[measured.key.duplicated()]
    if len(repeated):
        count = int((measured.key == repeated.iloc[0]).sum())
        raise ValueError(
            f"measured holds the key {repeated.iloc[0]!r} {count} times: one row per comparison expected"
        )
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
