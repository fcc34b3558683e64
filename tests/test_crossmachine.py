"""qlab.crossmachine: run shifts, comparisons on two machines, and the survival of committed claims."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from qlab import claims, crossmachine, paths

T_975_2 = math.sqrt(
    1.805 / 0.0975
)  # Student t, 97.5 % quantile, df 2, from its closed-form CDF (tables: 4.303)


def runs(values: dict) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"config": c, "seed": s, "val_loss": v}
            for c, losses in values.items()
            for s, v in enumerate(losses)
        ]
    )


def test_run_shifts_pair_the_same_config_and_seed():
    a = runs({"fp32": [2.0, 2.1], "nvfp4": [2.5, 2.6]})
    b = runs({"fp32": [2.0, 2.1], "nvfp4": [2.25, 2.5]})
    shifts = crossmachine.run_shifts(b, a).set_index(["config", "seed"])["shift"]
    assert shifts["fp32", 0] == 0 and shifts["fp32", 1] == 0
    assert shifts["nvfp4", 0] == pytest.approx(-0.25) and shifts["nvfp4", 1] == pytest.approx(-0.1)


def test_comparisons_are_paired_t_intervals_on_each_machine_and_their_shift():
    # nvfp4 − fp32 per seed: 1, 2, 3 on the first machine (mean 2, sd 1); 2, 3, 4 on the second
    first = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [1.0, 2.0, 3.0]})
    second = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [2.0, 3.0, 4.0]})
    row = crossmachine.comparisons("07_recipe_ablations", first, second, "a", "b").iloc[0]
    half = T_975_2 * 1.0 / math.sqrt(3)
    assert row.key == "train.nvfp4" and row.n == 3
    assert row.a_mean == pytest.approx(2.0) and row.a_low == pytest.approx(2.0 - half)
    assert row.b_high == pytest.approx(3.0 + half) and row["shift"] == pytest.approx(1.0)
    assert row.verdicts_differ  # 2 ± 2.48 includes 0; 3 ± 2.48 does not


def test_the_same_verdict_on_both_machines_is_not_flagged():
    first = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [1.0, 2.0, 3.0]})  # 2 ± 2.48: includes 0
    second = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [1.1, 2.1, 2.9]})  # includes 0 too
    assert not crossmachine.comparisons("07_recipe_ablations", first, second, "a", "b").verdicts_differ.iloc[
        0
    ]


def test_survival_moves_the_committed_interval_by_the_whole_interval_of_the_shift():
    nan = math.nan
    committed = pd.DataFrame([
        {"key": "train.nvfp4", "test": "paired t", "value": 0.01, "low": 0.004, "high": 0.016, "low_90": nan,
         "high_90": nan, "n": 5, "p": 0.001, "p_adjusted": 0.001, "margin": nan},
        {"key": "train.mxfp4", "test": "paired t", "value": 0.01, "low": 0.004, "high": 0.016, "low_90": nan,
         "high_90": nan, "n": 5, "p": 0.001, "p_adjusted": 0.001, "margin": nan},
        {"key": "ablation.x.none-all.same", "test": "TOST", "value": 0.0, "low": -0.006, "high": 0.006,
         "low_90": -0.004, "high_90": 0.004, "n": 5, "p": 0.01, "p_adjusted": nan, "margin": 0.01},
        {"key": "train.bf16", "test": "paired t", "value": 0.0, "low": -0.01, "high": 0.01, "low_90": nan,
         "high_90": nan, "n": 5, "p": 0.9, "p_adjusted": 1.0, "margin": nan},  # not resolved: not a finding
    ])  # fmt: skip
    measured = pd.DataFrame({"key": ["train.nvfp4", "train.mxfp4", "ablation.x.none-all", "train.bf16"],
                             "shift": [-0.001, -0.001, 0.001, 0.0],
                             "shift_low": [-0.003, -0.005, -0.001, 0.0],
                             "shift_high": [0.001, 0.003, 0.003, 0.0]})  # fmt: skip
    result = crossmachine.survival(committed, measured).set_index("key")
    assert list(result.index) == ["train.nvfp4", "train.mxfp4", "ablation.x.none-all.same"]
    # unadjusted (p_adjusted == p): the stored intervals themselves, at 95 % and 90 %
    assert result.confidence["train.nvfp4"] == pytest.approx(0.95)
    assert result.confidence["ablation.x.none-all.same"] == pytest.approx(0.90)
    assert result.survives["train.nvfp4"]  # [0.004 − 0.003, 0.016 + 0.001] = [0.001, 0.017] excludes 0
    # the mean shift alone (−0.001) would keep [0.003, 0.015]; its interval's low end −0.005 reaches 0
    assert not result.survives["train.mxfp4"]
    assert result.moved_low["train.mxfp4"] == pytest.approx(-0.001)
    assert result.survives_mean_shift["train.mxfp4"]  # [0.003, 0.015]: the bound the other way
    # an equivalence moves its 90 % interval: [−0.004 − 0.001, 0.004 + 0.003] = [−0.005, 0.007] within ±0.01
    assert result.survives["ablation.x.none-all.same"]
    assert result.low["ablation.x.none-all.same"] == pytest.approx(-0.004)
    assert result.high["ablation.x.none-all.same"] == pytest.approx(0.004)


def test_survival_reads_a_holm_adjusted_claim_at_the_level_its_holm_step_used():
    """A claim resolved at Holm-adjusted p ≤ 0.05 was tested at level 0.05 · p / p_adjusted: its
    interval at that level (scipy's t quantiles, float64) is what must still exclude zero — the stored
    95 % interval is narrower and would overstate what survives."""
    scipy_stats = pytest.importorskip("scipy.stats")
    nan, n = math.nan, 4
    error = 0.0015  # the standard error behind the stored interval
    half_95 = float(scipy_stats.t.ppf(0.975, n - 1)) * error
    t = 0.01 / error
    p = float(2 * scipy_stats.t.sf(t, n - 1))
    committed = pd.DataFrame([
        {"key": "train.nvfp4", "test": "paired t", "value": 0.01, "low": 0.01 - half_95,
         "high": 0.01 + half_95, "low_90": nan, "high_90": nan, "n": n, "p": p, "p_adjusted": 4 * p,
         "margin": nan},
        {"key": "ablation.x.none-all.same", "test": "TOST", "value": 0.0, "low": nan, "high": nan,
         "low_90": -float(scipy_stats.t.ppf(0.95, n - 1)) * error,
         "high_90": float(scipy_stats.t.ppf(0.95, n - 1)) * error, "n": n, "p": 0.004, "p_adjusted": 0.02,
         "margin": 0.01},
    ])  # fmt: skip
    assert 4 * p <= 0.05  # resolved after Holm (a family of four, this the smallest p)
    measured = pd.DataFrame({"key": ["train.nvfp4", "ablation.x.none-all"], "shift": [0.0, 0.0],
                             "shift_low": [0.0, 0.0], "shift_high": [0.0, 0.0]})  # fmt: skip
    result = crossmachine.survival(committed, measured).set_index("key")
    level = 0.05 / 4
    half = float(scipy_stats.t.ppf(1 - level / 2, n - 1)) * error
    assert result.confidence["train.nvfp4"] == pytest.approx(1 - level)
    assert result.low["train.nvfp4"] == pytest.approx(0.01 - half, rel=1e-9)  # bisection vs scipy: 1e-9
    assert result.high["train.nvfp4"] == pytest.approx(0.01 + half, rel=1e-9)
    assert result.low["train.nvfp4"] > 0  # holds exactly when the adjusted p ≤ 0.05 ...
    assert result.survives["train.nvfp4"]  # ... and with no shift it still does
    level = 0.05 * 0.004 / 0.02
    half = float(scipy_stats.t.ppf(1 - level, n - 1)) * error
    assert result.confidence["ablation.x.none-all.same"] == pytest.approx(1 - 2 * level)
    assert result.high["ablation.x.none-all.same"] == pytest.approx(half, rel=1e-9)
    # a shift the stored 90 % interval would absorb (0.0047 + 0.005 < 0.01) leaves the Holm-level one
    assert half + 0.005 > 0.01 > float(scipy_stats.t.ppf(0.95, n - 1)) * error + 0.005
    measured.loc[1, ["shift", "shift_low", "shift_high"]] = 0.005
    moved = crossmachine.survival(committed, measured).set_index("key")
    assert not moved.survives["ablation.x.none-all.same"]


def test_difference_spread_is_the_sd_of_the_paired_differences_not_of_either_config():
    # a seed effect shared by both configs (0, 1, 2) cancels: nvfp4 − fp32 = 0.1, 0.2, 0.3 (sd 0.1)
    committed = runs({"fp32": [2.0, 3.0, 4.0], "nvfp4": [2.1, 3.2, 4.3]})
    spread = crossmachine.difference_spread("07_recipe_ablations", committed).set_index("key")
    assert spread.sd["train.nvfp4"] == pytest.approx(0.1) and spread.n["train.nvfp4"] == 3
    assert spread.error["train.nvfp4"] == pytest.approx(0.1 / math.sqrt(3))  # the mean's standard error
    assert crossmachine.seed_spread(committed).set_index("config").sd["nvfp4"] == pytest.approx(1.1)


def test_comparisons_give_the_interval_of_the_shift_over_seeds():
    # per-seed shifts of nvfp4 − fp32: +1, +1, +1 (no spread) and then +0.5, +1, +1.5 (sd 0.5)
    first = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [1.0, 2.0, 3.0]})
    row = crossmachine.comparisons(
        "07_recipe_ablations", first, runs({"fp32": [0.0] * 3, "nvfp4": [2.0, 3.0, 4.0]}), "a", "b"
    ).iloc[0]
    assert row.shift_low == pytest.approx(1.0) and row.shift_high == pytest.approx(1.0)
    row = crossmachine.comparisons(
        "07_recipe_ablations", first, runs({"fp32": [0.0] * 3, "nvfp4": [1.5, 3.0, 4.5]}), "a", "b"
    ).iloc[0]
    assert row.shift_high - 1.0 == pytest.approx(T_975_2 * 0.5 / math.sqrt(3))


def test_every_committed_comparison_claim_is_one_the_module_rebuilds():
    """The keys comparison_pairs builds from the committed runs are those notebooks 03 and 07 gave
    their val-loss comparisons, so survival finds each of them."""
    for notebook, families in (("03_backward_override_training_curves", ("gap", "modes")),
                               ("07_recipe_ablations", ("train", "ablation"))):  # fmt: skip
        committed = claims.load(paths.ROOT / "data" / f"{notebook}_claims.csv")
        stated = set(committed[(committed.test == "paired t") & committed.family.isin(families)].key)
        configs = crossmachine.final_losses(notebook, paths.ROOT / "data").config
        built = {key for key, _, _ in crossmachine.comparison_pairs(notebook, configs)}
        assert stated == built, (notebook, stated ^ built)


def test_final_losses_read_the_last_evaluation_of_each_run():
    frame = crossmachine.final_losses("03_backward_override_training_curves", paths.ROOT / "data")
    curves = pd.read_csv(paths.ROOT / "data" / "03_backward_override_training_curves_curves.csv")
    run = curves[(curves.recipe == "nvfp4") & (curves.override == "dequantized") & (curves.seed == 1)]
    expected = run.dropna(subset=["val_loss"]).sort_values("step").val_loss.iloc[-1]
    got = frame[(frame.config == "nvfp4/dequantized") & (frame.seed == 1)].val_loss.iloc[0]
    assert got == expected


def test_a_folder_without_its_machine_record_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="machine.json"):
        crossmachine.machine_record(tmp_path)
    (tmp_path / "machine.json").write_text(json.dumps({"cpu": "AMD EPYC"}))
    with pytest.raises(ValueError, match="threads"):
        crossmachine.machine_record(tmp_path)


def test_unknown_notebooks_are_refused():
    with pytest.raises(ValueError, match="notebook"):
        crossmachine.final_losses("05_topk_sparse_backprop", paths.ROOT / "data")


def seeded(values: dict) -> pd.DataFrame:
    """Runs from {config: {seed: val_loss}}: seeds need not be 0, 1, 2, ... nor the same for every config."""
    return pd.DataFrame(
        [{"config": c, "seed": s, "val_loss": v} for c, losses in values.items() for s, v in losses.items()]
    )


T_975_1 = math.tan(math.pi * 0.475)  # Student t, 97.5 % quantile, df 1 (Cauchy): tan(π(p − ½)), 12.706


def test_comparisons_pair_each_comparison_on_the_seeds_its_own_configs_ran():
    # nvfp4 lacks seed 2 on the second machine: train.nvfp4 rests on seeds 0 and 1, train.bf16 on all three
    first = seeded({"fp32": {0: 0.0, 1: 0.0, 2: 0.0}, "bf16": {0: 0.5, 1: 1.0, 2: 2.0},
                    "nvfp4": {0: 1.0, 1: 2.0, 2: 3.0}})  # fmt: skip
    second = seeded({"fp32": {0: 0.0, 1: 0.0, 2: 0.0}, "bf16": {0: 0.5, 1: 1.0, 2: 2.0},
                     "nvfp4": {0: 1.0, 1: 3.0}})  # fmt: skip
    result = crossmachine.comparisons("07_recipe_ablations", first, second, "a", "b").set_index("key")
    assert result.n["train.bf16"] == 3 and result.n["train.nvfp4"] == 2
    assert result.a_mean["train.bf16"] == pytest.approx(np.mean([0.5, 1.0, 2.0]))
    assert result.a_mean["train.nvfp4"] == pytest.approx(1.5)  # (1 + 2) / 2
    assert result.b_mean["train.nvfp4"] == pytest.approx(2.0)  # (1 + 3) / 2
    half = T_975_1 * np.std([1.0, 2.0], ddof=1) / math.sqrt(2)
    assert result.a_low["train.nvfp4"] == pytest.approx(1.5 - half)
    # per-seed shifts 0 and 1: mean 0.5, sd √½
    assert result["shift"]["train.nvfp4"] == pytest.approx(0.5)
    assert result.shift_low["train.nvfp4"] == pytest.approx(
        0.5 - T_975_1 * np.std([0.0, 1.0], ddof=1) / math.sqrt(2)
    )


def test_a_comparison_whose_configs_share_no_seed_is_refused_by_name():
    first = seeded({"fp32": {0: 0.0, 1: 0.0}, "nvfp4": {0: 1.0, 1: 2.0}})
    second = seeded({"fp32": {5: 0.0, 6: 0.0}, "nvfp4": {0: 1.0, 1: 2.0}})
    with pytest.raises(ValueError, match=r"train\.nvfp4.*got 0.*fp32 lacks seeds \[0, 1\] on machine 'b'"):
        crossmachine.comparisons("07_recipe_ablations", first, second, "a", "b")
    one = seeded({"fp32": {0: 0.0, 1: 0.0}, "nvfp4": {0: 1.0}})  # a single pair: no paired interval
    with pytest.raises(ValueError, match=r"train\.nvfp4.*at least 2 seeds.*got 1"):
        crossmachine.comparisons("07_recipe_ablations", first, one, "a", "b")


def test_a_diverged_run_is_refused_and_not_taken_for_a_missing_one():
    first = seeded({"fp32": {0: 0.0, 1: 0.0, 2: 0.0}, "nvfp4": {0: 1.0, 1: 2.0, 2: 3.0}})
    second = seeded({"fp32": {0: 0.0, 1: 0.0, 2: 0.0}, "nvfp4": {0: 1.0, 1: 2.0, 2: math.nan}})
    with pytest.raises(ValueError, match=r"second \(machine 'b'\).*train\.nvfp4.*diverged.*seed 2"):
        crossmachine.comparisons("07_recipe_ablations", first, second, "a", "b")
    with pytest.raises(ValueError, match=r"train\.nvfp4.*diverged.*seed 2"):
        crossmachine.difference_spread("07_recipe_ablations", second)


def test_difference_spread_pairs_the_seeds_both_configs_ran_and_refuses_a_pair_without_two():
    partial = seeded({"fp32": {0: 2.0, 1: 3.0, 2: 4.0}, "nvfp4": {0: 2.1, 2: 4.4}})  # nvfp4 lacks seed 1
    row = crossmachine.difference_spread("07_recipe_ablations", partial).iloc[0]
    sd = np.std([2.1 - 2.0, 4.4 - 4.0], ddof=1)
    assert row.n == 2 and row.sd == pytest.approx(sd) and row.error == pytest.approx(sd / math.sqrt(2))
    apart = seeded({"fp32": {0: 0.0}, "nvfp4": {1: 1.0}})
    with pytest.raises(ValueError, match=r"train\.nvfp4 \(nvfp4 − fp32\).*got 0"):
        crossmachine.difference_spread("07_recipe_ablations", apart)


def claim_rows() -> pd.DataFrame:
    return pd.DataFrame([
        {"key": "train.nvfp4", "test": "paired t", "value": 0.01, "low": 0.004, "high": 0.016,
         "low_90": math.nan, "high_90": math.nan, "n": 5, "p": 0.001, "p_adjusted": 0.001,
         "margin": math.nan},
    ])  # fmt: skip


def test_survival_refuses_claims_without_a_margin_and_measured_keys_twice_or_not_str():
    measured = pd.DataFrame({"key": ["train.nvfp4"], "shift": [0.0], "shift_low": [0.0], "shift_high": [0.0]})
    with pytest.raises(ValueError, match="'margin' is not a column of the committed"):
        crossmachine.survival(claim_rows().drop(columns=["margin"]), measured)
    with pytest.raises(ValueError, match="measured holds the key 'train.nvfp4' 2 times"):
        crossmachine.survival(claim_rows(), pd.concat([measured, measured], ignore_index=True))
    with pytest.raises(TypeError, match="measured key must hold comparison keys"):
        crossmachine.survival(claim_rows(), measured.assign(key=[7]))
    with pytest.raises(TypeError, match="committed key must hold comparison keys"):
        crossmachine.survival(claim_rows().assign(key=[math.nan]), measured)


def test_every_function_taking_runs_refuses_a_run_given_twice_or_text_losses():
    twice = pd.concat([runs({"fp32": [1.0, 2.0], "nvfp4": [2.0, 3.0]}), runs({"fp32": [5.0]})])
    clean = runs({"fp32": [1.0, 2.0], "nvfp4": [2.0, 3.0]})
    calls = {
        "runs": lambda frame: crossmachine.seed_spread(frame),
        "moved": lambda frame: crossmachine.run_shifts(frame, clean),
        "reference": lambda frame: crossmachine.run_shifts(clean, frame),
        "second": lambda frame: crossmachine.comparisons("07_recipe_ablations", clean, frame, "a", "b"),
    }
    for argument, call in calls.items():
        with pytest.raises(ValueError, match=f"{argument} holds config 'fp32' seed 0 2 times"):
            call(twice)
        with pytest.raises(TypeError, match=f"{argument} val_loss must hold real numbers.*'x'"):
            call(clean.assign(val_loss=["x", "y", "z", "w"]))
    with pytest.raises(ValueError, match="runs holds config 'fp32' seed 0 2 times"):
        crossmachine.difference_spread("07_recipe_ablations", twice)
    # one row per run both hold: 4, not the 6 a merge on a run given twice would make
    assert len(crossmachine.run_shifts(clean, clean)) == 4


def test_final_losses_refuse_a_run_given_twice_naming_the_file(tmp_path):
    training = runs({"fp32": [2.0, 2.1], "nvfp4": [2.5, 2.6]}).rename(columns={"config": "variant"})
    pd.concat([training, training.iloc[[3]]]).to_csv(
        tmp_path / "07_recipe_ablations_training.csv", index=False
    )
    with pytest.raises(ValueError, match=r"07_recipe_ablations_training\.csv.*'nvfp4' seed 1 2 times"):
        crossmachine.final_losses("07_recipe_ablations", tmp_path)


def test_a_machine_name_that_would_overwrite_a_result_column_is_refused():
    first = runs({"fp32": [0.0, 0.0, 0.0], "nvfp4": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="first_name 'shift' would name the columns"):
        crossmachine.comparisons("07_recipe_ablations", first, first, "shift", "b")
    with pytest.raises(ValueError, match="second_name 'shift' would name the columns"):
        crossmachine.comparisons("07_recipe_ablations", first, first, "a", "shift")
    result = crossmachine.comparisons("07_recipe_ablations", first, first, "shifted", "b")
    assert result["shift"].iloc[0] == 0 and result.shifted_mean.iloc[0] == pytest.approx(2.0)


def test_final_losses_read_names_verbatim_and_refuse_a_run_without_one(tmp_path):
    # an override written "None" is a name (pandas alone reads it as missing and drops those runs)
    rows = [(step, loss if step == 2 else "", recipe, override, seed)
            for recipe, override, base in (("fp32", "none", 2.0), ("nvfp4", "None", 2.5))
            for seed in (0, 1) for step, loss in ((1, ""), (2, base + 0.1 * seed))]  # fmt: skip
    text = "step,val_loss,recipe,override,seed\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)
    (tmp_path / "03_backward_override_training_curves_curves.csv").write_text(text)
    frame = crossmachine.final_losses("03_backward_override_training_curves", tmp_path)
    got = {(row.config, row.seed): row.val_loss for row in frame.itertuples()}
    assert got == {("fp32", 0): 2.0, ("fp32", 1): 2.1, ("nvfp4/None", 0): 2.5, ("nvfp4/None", 1): 2.6}
    # the header, four lines of fp32, then nvfp4's first: line 6
    (tmp_path / "03_backward_override_training_curves_curves.csv").write_text(text.replace(",None,", ",,", 1))
    with pytest.raises(ValueError, match="line 6 has no override"):
        crossmachine.final_losses("03_backward_override_training_curves", tmp_path)
