"""qlab.stats and the plot helpers built on it, against hand-computed cases, published t values, the
exact bootstrap distribution and closed-form gradients."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from qlab import plotting, stats  # noqa: E402

# exact two-sided 95 % quantiles from the closed-form CDFs: df 1 (Cauchy) tan(0.475 π); df 2 √(1.805/0.0975)
T_975_DF1 = math.tan(0.475 * math.pi)  # 12.7062047361747 (tables: 12.706)
T_975_DF2 = math.sqrt(1.805 / 0.0975)  # 4.30265272974946 (tables: 4.303)


def test_t_quantiles_agree_with_scipy_to_1e_10_over_df_1_to_1000():
    # scipy.stats.t.ppf is the independent reference; every integer df 1 … 200 and every 7th to 1000 at
    # the levels the intervals (95 %, 90 %), the power statement (80 %) and small tails use, and a few
    # fractional df
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in [*range(1, 201), *range(201, 1001, 7), 1000, 0.5, 2.5, 17.25]:
        for probability in (0.975, 0.95, 0.8, 0.6, 0.995, 0.025):
            expected = scipy_stats.t.ppf(probability, df)
            assert stats.t_quantile(probability, df) == pytest.approx(expected, rel=1e-10, abs=1e-12), (
                df,
                probability,
            )
        assert stats.t_quantile_975(df) == stats.t_quantile(0.975, df) if float(df).is_integer() else True
    # the published 3-decimal table agrees when rounded (df 1 → 12.706, 3 → 3.182, 30 → 2.042)
    for df, table in [(1, 12.706), (3, 3.182), (9, 2.262), (30, 2.042)]:
        assert round(stats.t_quantile_975(df), 3) == table


def test_t_quantile_near_the_centre_keeps_its_relative_precision():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 30):
        for probability in (0.5 + 1e-12, 0.5 + 1e-6, 0.5 - 1e-9):
            expected = scipy_stats.t.ppf(probability, df)
            assert stats.t_quantile(probability, df) == pytest.approx(expected, rel=1e-6)


def test_t_cdf_agrees_with_scipy_to_1e_12():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 7, 30, 200, 1000):
        for t in (-40.0, -3.0, -0.7, 0.0, 0.3, 1.96, 12.7):
            assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-12, abs=1e-15)


def _enumerated_sign_flip_p(values):
    """The two-sided sign-flip p by listing every sign pattern with itertools: the definition itself."""
    import itertools

    observed = abs(sum(values))
    patterns = list(itertools.product((1, -1), repeat=len(values)))
    at_least = sum(abs(sum(s * v for s, v in zip(signs, values))) >= observed - 1e-12 for signs in patterns)
    return at_least / len(patterns)


def test_sign_flip_test_is_exact_against_enumeration_for_n_up_to_12():
    rng = np.random.default_rng(1)
    for n in range(1, 13):
        for _ in range(3):
            values = rng.standard_t(3, size=n).tolist()  # heavy-tailed, as per-seed differences can be
            result = stats.sign_flip_test(values)
            assert result["exact"] and result["patterns"] == 2**n
            assert result["p"] == _enumerated_sign_flip_p(values), (n, values)
    # small integers, where ties are exact: [1, 2, 3] — |±1 ±2 ±3| ≥ 6 only for all + or all −
    assert stats.sign_flip_test([1.0, 2.0, 3.0])["p"] == 2 / 8
    assert stats.sign_flip_test([1.0, -1.0])["p"] == 1.0  # the observed sum 0 is matched by every pattern
    # the smallest p n pairs can give is 2/2ⁿ: 0.0625 at 5 seeds, 2/2¹⁵ at 15
    assert stats.sign_flip_test([0.1, 0.2, 0.3, 0.4, 0.5])["p"] == 0.0625
    assert stats.sign_flip_test(np.linspace(1, 2, 15).tolist())["p"] == 2 / 2**15


def test_sign_flip_test_agrees_with_scipy_permutation_test():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    for n in (4, 9, 12):
        x, y = rng.normal(size=n), rng.normal(0.4, 1.0, size=n)
        reference = scipy_stats.permutation_test(
            (x, y), lambda a, b: np.mean(a - b), permutation_type="samples", n_resamples=10**6
        )
        assert stats.sign_flip_test((x - y).tolist())["p"] == pytest.approx(reference.pvalue, rel=1e-12)


def test_sign_flip_test_draws_patterns_beyond_20_pairs_and_is_seeded():
    values = np.random.default_rng(3).normal(0.3, 1.0, size=24).tolist()
    first = stats.sign_flip_test(values, resamples=20_000, seed=5)
    assert not first["exact"] and first["patterns"] == 20_000
    assert first == stats.sign_flip_test(values, resamples=20_000, seed=5)
    # the drawn share estimates the exact one: standard error √(p(1 − p)/20000) < 0.004
    exact_25 = _enumerated_sign_flip_p(values[:12])  # a checkable sub-case, exact and drawn both
    assert stats.sign_flip_test(values[:12])["p"] == exact_25
    assert 0 < first["p"] < 1
    with pytest.raises(ValueError, match="differences must hold at least 1 value"):
        stats.sign_flip_test([])
    with pytest.raises(ValueError, match="finite"):
        stats.sign_flip_test([1.0, math.inf])


def test_mean_interval_of_hand_computed_samples():
    # [1, 2, 3]: mean 2, s = 1, half-width 4.303 / √3
    mean, low, high = stats.mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(T_975_DF2 / math.sqrt(3), rel=1e-12)
    assert mean - low == pytest.approx(high - mean, rel=1e-12)
    # [5, 5]: zero spread, zero width; one value: no interval
    assert stats.mean_interval([5.0, 5.0]) == (5.0, 5.0, 5.0)
    single = stats.mean_interval([0.3])
    assert single[0] == 0.3 and math.isnan(single[1]) and math.isnan(single[2])


def test_geometric_mean_interval_is_scipy_s_t_interval_of_the_logarithms():
    """scipy's gmean and its t interval on the logs, exponentiated: the interval of a ratio ≥ 1 stays
    above zero where the arithmetic t interval of [1.2, 6.2] (two batches) goes to −25."""
    from scipy import stats as scipy_stats

    for values in ([1.2, 6.2], [3.0, 3.5, 9.0, 1.1], [2.0, 2.0]):
        logs = np.log(values)
        spread = scipy_stats.sem(logs)
        low, high = scipy_stats.t.interval(0.95, len(values) - 1, loc=logs.mean(), scale=spread)
        got = stats.geometric_mean_interval(values)
        if logs.std() == 0:
            low, high = logs.mean(), logs.mean()
        assert got == pytest.approx((scipy_stats.gmean(values), math.exp(low), math.exp(high)), rel=1e-12)
        assert got[1] > 0
    assert stats.mean_interval([1.2, 6.2])[1] < -25
    single = stats.geometric_mean_interval([4.0])
    assert single[0] == pytest.approx(4.0) and math.isnan(single[1])
    with pytest.raises(ValueError, match="positive for a geometric mean, got 0.0 at position 1"):
        stats.geometric_mean_interval([1.0, 0.0])
    assert stats.geometric_mean_interval([1e-300, 1e300])[2] == math.inf  # exp past the largest float


def test_the_lower_tail_keeps_its_relative_precision_far_from_the_centre():
    # p-values read t_cdf(−|t|): 1/2 − (share up to |t|) would cancel to 0 there. scipy's t.cdf and
    # t.ppf are the references; df = 1 has the closed form tan(π(p − 1/2)) = −1/tan(πp)
    scipy_stats = pytest.importorskip("scipy.stats")
    for t, df in [(-10.0, 1000), (-8.0, 200), (-12.0, 50), (-1.5, 1000), (-0.5, 1000), (-3.0, 2)]:
        assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-11), (t, df)
    differences = np.linspace(1.0, 2.0, 200)  # t = 26: p far below 1e-100
    expected = 2 * scipy_stats.t.cdf(-abs(scipy_stats.ttest_1samp(differences, 0).statistic), 199)
    assert 0 < stats.paired_test(differences)["p"] == pytest.approx(expected, rel=1e-9)
    for p in (1e-12, 1e-6, 0.01):
        assert stats.t_quantile(p, 1) == pytest.approx(-1 / math.tan(math.pi * p), rel=1e-12)


def test_detectable_effect_has_the_noncentral_t_power_it_promises_at_every_n():
    # scipy's noncentral t: P(|T| > t_{1−α/2}) at the effect; the shortcut t_{1−α/2} + t_{0.8} falls
    # short with few pairs (2 pairs: 73 %), so 3 pairs no longer detect 3.1 sd (power 0.77)
    scipy_stats = pytest.importorskip("scipy.stats")
    for n in (2, 3, 4, 5, 8, 15, 40, 300):
        for alpha in (0.05, 0.05 / 14):
            effect = stats.detectable_effect(1.0, n, alpha=alpha)
            critical, shift = scipy_stats.t.ppf(1 - alpha / 2, n - 1), effect * math.sqrt(n)
            power = scipy_stats.nct.sf(critical, n - 1, shift) + scipy_stats.nct.sf(critical, n - 1, -shift)
            assert power == pytest.approx(0.8, abs=1e-8), (n, alpha)
            assert stats.t_test_power(effect, n, alpha) == pytest.approx(power, abs=1e-9)
    assert stats.detectable_effect(2.0, 5) == 2 * stats.detectable_effect(1.0, 5)
    assert stats.seeds_for_effect(1.0, 3.1) == 4


def test_sign_flip_ties_are_within_the_sums_rounding_only():
    # 1e-9 apart from a tie is no tie: exact enumeration of the 16 patterns gives 2/16
    values = [1000.0, 1e-9, 2e-9, 3e-9]
    assert stats.sign_flip_test(values)["p"] == _enumerated_sign_flip_p(values) == 2 / 16
    assert stats.sign_flip_test([0.1, 0.2, -0.3])["p"] == 1.0  # 0.1 + 0.2 − 0.3 ≠ 0 in floats: a tie


def test_summarize_keeps_a_group_whose_key_is_missing():
    frame = pd.DataFrame({"recipe": ["a", "a", None, None, "b", "b"], "loss": [1.0, 2, 3, 4, 5, 6]})
    table = stats.summarize(frame, "loss", ["recipe"])
    assert table.n.tolist() == [2, 2, 2] and table["mean"].tolist() == [1.5, 3.5, 5.5]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: stats.paired_test([1.0] * 10**6 + [math.nan]),
            ValueError,
            r"got nan.* at position 1000000 of 1000001",
        ),
        (lambda: stats.mean_interval([1e308, 1e308, 1e308]), ValueError, "too large to average"),
        (lambda: stats.paired_test([10**400, 1]), ValueError, "must be finite.*at position 0"),
        (lambda: stats.mean_interval(np.array(0.5)), TypeError, "values must be a sequence"),
        (lambda: stats.ratio_interval({1.0, 2.0}, [1.0, 2.0]), TypeError, "numerators must be a sequence"),
        (lambda: stats.paired_test({"a": 1.0, "b": 2.0}), TypeError, "differences must be a sequence"),
    ],
)
def test_bad_sequences_get_a_short_error_naming_the_value_and_its_position(call, error, message):
    with pytest.raises(error, match=message) as raised:
        call()
    assert len(str(raised.value)) < 300


def test_mean_interval_refuses_empty_and_non_finite():
    with pytest.raises(ValueError, match="at least one"):
        stats.mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        stats.mean_interval([1.0, math.nan])


def test_paired_differences_subtract_the_same_seed_of_the_baseline():
    frame = pd.DataFrame(
        {"recipe": ["fp32", "fp32", "a", "a"], "seed": [0, 1, 1, 0], "loss": [1.0, 2.0, 2.5, 1.25]}
    )
    out = stats.paired_differences(frame, "loss", baseline="fp32", by="recipe", pair="seed")
    assert out.to_dict("list") == {"recipe": ["a", "a"], "seed": [1, 0], "difference": [0.5, 0.25]}
    with pytest.raises(ValueError, match="no row for seed"):
        stats.paired_differences(
            frame[frame.seed == 0].iloc[:1].pipe(lambda f: pd.concat([f, frame.iloc[2:3]])),
            "loss",
            baseline="fp32",
            by="recipe",
            pair="seed",
        )
    summary = stats.summarize(out, "difference", ["recipe"])
    assert summary.loc[0, "n"] == 2 and summary.loc[0, "mean"] == 0.375


def test_exact_bootstrap_of_three_values_is_the_trinomial_distribution():
    # resample means of [0, 1, 2]: sums 0 … 6 with counts 1, 3, 6, 7, 6, 3, 1 of 27. The 2.5 % point is
    # the smallest mean whose cumulative share reaches 2.5 %: 1/27 = 3.7 % at sum 0 → 0; the 97.5 %
    # point: 26/27 = 96.3 % at sum 5 is short, so sum 6 → 2
    assert stats.mean_interval([0.0, 1.0, 2.0], "bootstrap") == (1.0, 0.0, 2.0)
    # [0, 0, 0, 4]: 256 resamples; the mean is k (number of 4s drawn, binomial(4, 1/4)) → counts
    # 81, 108, 54, 12, 1: cumulative 81/256 = 31.6 % at k = 0 → low 0; 97.5 % needs 249.6 of 256:
    # 81 + 108 + 54 = 243 at k = 2 is short, 255 at k = 3 → high 3
    assert stats.mean_interval([0.0, 0.0, 0.0, 4.0], "bootstrap") == (1.0, 0.0, 3.0)


def test_sampled_bootstrap_is_seeded_and_near_the_normal_interval_for_many_values():
    values = np.random.default_rng(7).normal(2.0, 1.0, size=200).tolist()
    first = stats.mean_interval(values, "bootstrap", resamples=4000, seed=3)
    assert first == stats.mean_interval(values, "bootstrap", resamples=4000, seed=3)
    assert first != stats.mean_interval(values, "bootstrap", resamples=4000, seed=4)
    mean, low, high = stats.mean_interval(values)  # t with 199 df ≈ normal: the bootstrap is close
    assert first[0] == mean
    # the bootstrap half-width is 1.96·s/√n·√((n−1)/n) up to resampling noise (±5 % at 4000 draws)
    assert (first[2] - first[1]) == pytest.approx(high - low, rel=0.08)


def test_summarize_and_paired_differences_pair_on_several_columns():
    frame = pd.DataFrame(
        {
            "recipe": ["fp32"] * 4 + ["q"] * 4,
            "seed": [0, 0, 1, 1] * 2,
            "step": [10, 20] * 4,
            "loss": [2.0, 1.0, 2.2, 1.2, 2.5, 1.25, 2.4, 1.5],
        }
    )
    out = stats.paired_differences(frame, "loss", baseline="fp32", by="recipe", pair=["seed", "step"])
    assert out.columns.tolist() == ["recipe", "seed", "step", "difference"]
    assert out.difference.tolist() == pytest.approx([0.5, 0.25, 0.2, 0.3], abs=1e-15)
    with pytest.raises(ValueError, match="more than one row"):
        stats.paired_differences(frame, "loss", baseline="fp32", by="recipe", pair="seed")
    summary = stats.summarize(out, "difference", ["step"])
    assert summary.step.tolist() == [10, 20] and summary["mean"].tolist() == pytest.approx([0.35, 0.275])


def test_mean_band_draws_the_mean_and_the_interval_of_each_x():
    # two seeds at x = 0 and 1: means 1.5 and 4; half-widths 12.706 · s / √2 with s = |a − b| / √2,
    # i.e. 12.706 · |a − b| / 2
    frame = pd.DataFrame({"x": [0, 0, 1, 1], "seed": [0, 1, 0, 1], "y": [1.0, 2.0, 3.0, 5.0]})
    fig, ax = plt.subplots()
    summary = plotting.mean_band(ax, frame, "x", "y")
    line = ax.get_lines()[0]
    assert line.get_ydata().tolist() == [1.5, 4.0]
    half = [T_975_DF1 * 1.0 / 2, T_975_DF1 * 2.0 / 2]
    assert summary["high"].tolist() == pytest.approx([1.5 + half[0], 4.0 + half[1]], rel=1e-12)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    for bound in (1.5 - half[0], 1.5 + half[0], 4.0 - half[1], 4.0 + half[1]):  # the band's corners
        assert min(abs(band - bound)) < 1e-12
    plt.close(fig)


def test_mean_band_on_a_log_axis_is_the_geometric_mean_and_a_multiplicative_interval():
    # log10 of 1 and 100 is 0 and 2: mean 1 (the geometric mean 10), s = √2, half-width 12.706 · √2/√2
    frame = pd.DataFrame({"x": [0, 0], "y": [1.0, 100.0]})
    fig, ax = plt.subplots()
    summary = plotting.mean_band(ax, frame, "x", "y", log=True)
    assert ax.get_yscale() == "log"
    assert ax.get_lines()[0].get_ydata().tolist() == pytest.approx([10.0], rel=1e-12)
    assert summary["low"].iloc[0] == pytest.approx(10.0 ** (1 - T_975_DF1), rel=1e-9)
    assert summary["high"].iloc[0] == pytest.approx(10.0 ** (1 + T_975_DF1), rel=1e-9)
    with pytest.raises(ValueError, match="positive 'y'"):
        plotting.mean_band(ax, pd.DataFrame({"x": [0, 0], "y": [1.0, 0.0]}), "x", "y", log=True)
    plt.close(fig)


def test_delta_band_subtracts_the_same_seed_and_step_of_the_baseline():
    frame = pd.DataFrame(
        {
            "recipe": ["fp32"] * 4 + ["a"] * 4 + ["b"] * 4,
            "seed": [0, 1] * 6,
            "step": [1, 1, 2, 2] * 3,
            "loss": [1.0, 2.0, 0.5, 1.5, 1.5, 2.5, 0.5, 1.5, 1.0, 2.0, 0.25, 1.75],
        }
    )
    fig, ax = plt.subplots()
    summary = plotting.delta_band(ax, frame, "step", "loss", baseline="fp32", by="recipe")
    assert list(ax.get_lines()[0].get_ydata()) == [0.0, 0.0]  # the zero line
    by_recipe = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()[1:]}
    assert by_recipe == {"a": [0.5, 0.0], "b": [0.0, 0.0]}
    # b at step 2: differences −0.25 and +0.25 → mean 0, s = 0.25·√2, half-width 12.706 · 0.25
    row = summary[(summary.recipe == "b") & (summary.step == 2)].iloc[0]
    assert row["high"] == pytest.approx(T_975_DF1 * 0.25, rel=1e-12)
    plt.close(fig)


def test_gradient_noise_floor_is_the_agreement_of_two_batches_closed_form_gradients():
    # loss mean((x Wᵀ − y)²): dL/dW = 2/(n·m) (x Wᵀ − y)ᵀ x, per batch set, in float64 here
    from qlab.probes import gradient_noise_floor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2, bias=False))
    weight = model[0].weight.detach().double()
    first = [(torch.randn(5, 3), torch.randn(5, 2))]
    second = [(torch.randn(5, 3), torch.randn(5, 2))]

    def closed_form(batches):
        x, y = (t.double() for t in batches[0])
        return (2 / 10 * (x @ weight.T - y).T @ x).flatten()

    floor = gradient_noise_floor(model, first, second, lambda m, b: (m(b[0]) - b[1]).square().mean())
    g1, g2 = closed_form(first), closed_form(second)
    cosine = (g1 @ g2 / (g1.norm() * g2.norm())).item()
    error = ((g2 - g1).norm() / g1.norm()).item()
    # float32 model against float64 closed form: float32 rounding, rel 1e-5
    assert floor.layer.tolist() == ["0"]
    assert floor.cosine.item() == pytest.approx(cosine, rel=1e-5)
    assert floor.relative_error.item() == pytest.approx(error, rel=1e-5)


# --- the standard statistical tests ------------------------------------------------------------------


def test_t_cdf_equals_the_closed_forms_of_one_and_two_degrees_of_freedom():
    # df = 1 is the Cauchy distribution: 1/2 + atan(t)/π; df = 2: 1/2 + t / (2 √(2 + t²))
    # (and near the centre, where 1 − x would cancel: t = ±1e-9 keeps its digits)
    for t in [-30.0, -3.0, -1.0, -0.2, -1e-9, 0.0, 1e-9, 0.5, 2.0, 7.5, 100.0]:
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    assert stats.t_cdf(math.inf, 3) == 1.0 and stats.t_cdf(-math.inf, 3) == 0.0


def test_t_quantiles_are_the_published_one_sided_table_values():
    # one-sided 80 %: df 2 → 1.061, 4 → 0.941, 9 → 0.883, 29 → 0.854 (3 decimals in the tables)
    for df, expected in [(2, 1.061), (4, 0.941), (9, 0.883), (29, 0.854)]:
        assert stats.t_quantile(0.8, df) == pytest.approx(expected, abs=5e-4)
    assert stats.t_quantile(0.025, 9) == pytest.approx(-stats.t_quantile(0.975, 9), abs=1e-10)


def test_paired_test_of_a_hand_computed_sample():
    # [1, 2, 3]: mean 2, sd 1, t = 2√3, df 2, two-sided p = 1 − t / √(2 + t²) (the df = 2 closed form)
    result = stats.paired_test([1.0, 2.0, 3.0])
    t = 2 * math.sqrt(3)
    assert result["t"] == pytest.approx(t, rel=1e-12) and result["df"] == 2 and result["n"] == 3
    assert result["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)
    assert result["high"] - result["mean"] == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert stats.paired_test([0.5, 0.5])["p"] == 0.0 and stats.paired_test([0.0, 0.0])["p"] == 1.0
    with pytest.raises(ValueError, match="at least 2 differences"):
        stats.paired_test([1.0])
    with pytest.raises(ValueError, match="differences must be finite"):
        stats.paired_test([1.0, math.nan])


def test_holm_adjusts_a_hand_computed_family():
    # sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → raised to 0.06 (monotone)
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"p_values must lie in \[0, 1\]"):
        stats.holm([0.2, 1.5])


def test_tost_against_the_two_one_sided_closed_forms():
    # [1, 2, 3], margin 5: standard error 1/√3; p_lower = 1 − F₂((2 + 5)√3), p_upper = F₂((2 − 5)√3)
    def f2(t):
        return 0.5 + t / (2 * math.sqrt(2 + t * t))

    result = stats.tost([1.0, 2.0, 3.0], margin=5.0)
    assert result["p_lower"] == pytest.approx(1 - f2(7 * math.sqrt(3)), rel=1e-9)
    assert result["p_upper"] == pytest.approx(f2(-3 * math.sqrt(3)), rel=1e-9)
    assert result["p"] == max(result["p_lower"], result["p_upper"])
    assert stats.tost([1.0, 2.0, 3.0], margin=1.0)["p"] > 0.5  # the mean lies outside the margin


def test_detectable_effect_reaches_the_normal_formula_and_the_power_it_promises():
    # many pairs: (z_0.975 + z_0.8) · sd / √n = (1.95996 + 0.84162) · sd / √n
    assert stats.detectable_effect(1.0, 4000) == pytest.approx(2.80158 / math.sqrt(4000), rel=2e-3)
    # simulated: a true mean difference of that size is found (p < 0.05) in about 80 % of samples
    n = 8
    effect = stats.detectable_effect(1.0, n)
    rng = np.random.default_rng(0)
    found = np.mean([stats.paired_test(rng.normal(effect, 1.0, n))["p"] < 0.05 for _ in range(3000)])
    assert found == pytest.approx(0.80, abs=0.03)
    assert stats.seeds_for_effect(0.0056, 0.005) == min(
        n for n in range(2, 100) if stats.detectable_effect(0.0056, n) <= 0.005
    )


def test_fieller_bounds_are_the_ratios_a_paired_t_test_just_rejects():
    """At each bound R of Fieller's interval the paired t-test of numerator − R·denominator has p = 0.05
    exactly (scipy's t distribution, float64); inside it p > 0.05, outside p < 0.05."""
    scipy_stats = pytest.importorskip("scipy.stats")
    top = np.array([0.30, 0.42, 0.25, 0.37])  # four seeds: a part of a gain ...
    bottom = np.array([0.50, 0.61, 0.44, 0.58])  # ... and the whole gain, correlated across seeds
    result = stats.ratio_interval(top, bottom)
    assert result["bounded"] and result["n"] == 4
    assert result["ratio"] == pytest.approx(top.mean() / bottom.mean(), rel=1e-15)

    def p_at(ratio):
        return float(scipy_stats.ttest_1samp(top - ratio * bottom, 0.0).pvalue)

    assert p_at(result["low"]) == pytest.approx(0.05, rel=1e-9)
    assert p_at(result["high"]) == pytest.approx(0.05, rel=1e-9)
    assert result["low"] < result["ratio"] < result["high"]
    width = result["high"] - result["low"]
    assert p_at(result["low"] + 0.01 * width) > 0.05 and p_at(result["low"] - 0.01 * width) < 0.05


def test_fieller_has_no_bounded_interval_where_the_denominator_is_not_resolved():
    # denominator 1, −0.5, 0.8: mean 0.43, t = 0.43/(0.78/√3) ≈ 0.96 < 4.30 — zero is a plausible mean
    result = stats.ratio_interval([0.5, 0.1, 0.4], [1.0, -0.5, 0.8])
    assert not result["bounded"] and math.isnan(result["low"]) and math.isnan(result["high"])
    with pytest.raises(ValueError, match="pair up"):
        stats.ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="average to zero"):
        stats.ratio_interval([1.0, 2.0], [1.0, -1.0])
