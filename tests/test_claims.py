"""qlab.claims: claims computed with qlab.stats, rendered into text, and the README's findings table
generated from the committed claims files (a drift test: edit a committed number and it fails)."""

import math
import shutil

import pandas as pd
import pytest
from scipy import stats as scipy_stats

from qlab import claims as claims_module
from qlab import paths, stats
from qlab.claims import Claims
from qlab.results import save_csv
from qlab.session import NotebookRun


def _run(changed=None, profile="cpu"):
    return NotebookRun("99_demo", {"profile": profile}, changed or {}, paths.ROOT, "cpu")


def test_paired_claims_state_their_test_and_holm_adjustment():
    claims = Claims(_run())
    resolved = [0.010, 0.012, 0.011, 0.009, 0.013]  # clearly above 0
    unresolved = [0.002, -0.003, 0.001, -0.001, 0.0005]
    claims.paired("gap.a", resolved, text="a − FP32", family="gaps", unit="nats")
    claims.paired("gap.b", unresolved, text="b − FP32", family="gaps", unit="nats")
    claims.holm("gaps")
    a, b = claims["gap.a"], claims["gap.b"]
    raw = [stats.paired_test(resolved)["p"], stats.paired_test(unresolved)["p"]]
    assert [a.p_adjusted, b.p_adjusted] == pytest.approx(stats.holm(raw), rel=1e-12)
    text = claims.render("A: {gap.a} ({gap.a:verdict}). B: {gap.b:value} ({gap.b:verdict}).")
    assert "A: +0.0110 [+0.0090, +0.0130] nats (resolved: paired t over 5 seeds, Holm-adjusted p" in text
    assert "over 2 comparisons; exact sign-flip Holm-adjusted p = " in text
    # 5 seeds: the sign-flip test cannot go below 2/2⁵ = 0.0625, so the verdict says the tests disagree
    flips = [stats.sign_flip_test(resolved)["p"], stats.sign_flip_test(unresolved)["p"]]
    assert flips[0] == 2 / 2**5 and [a.p_sign_flip, b.p_sign_flip] == flips
    assert [a.p_sign_flip_adjusted, b.p_sign_flip_adjusted] == pytest.approx(stats.holm(flips), rel=1e-12)
    assert "the two tests disagree (5 seeds cannot give a sign-flip p below 0.0625)" in text
    # the effect these 5 seeds detect at 80 % power where Holm's first step tests at α/2: scipy's
    # noncentral t gives that power
    sd = stats.paired_test(unresolved)["sd"]
    assert b.detectable == pytest.approx(stats.detectable_effect(sd, 5, alpha=0.025), rel=1e-12)
    critical, shift = scipy_stats.t.ppf(1 - 0.025 / 2, 4), b.detectable / sd * math.sqrt(5)
    power = scipy_stats.nct.sf(critical, 4, shift) + scipy_stats.nct.cdf(-critical, 4, shift)
    assert power == pytest.approx(0.8, abs=1e-9)
    assert f"these seeds detect {b.detectable:.4f} nats at 80 % power at Holm's α/2" in text
    assert "B: +0.0000 (not resolved" in text or "B: −0.0001" in text or "B: +0.0001" in text


def test_equivalence_needs_tost_within_the_margin():
    claims = Claims(_run())
    near_zero = [0.001, -0.001, 0.0005, 0.0, -0.0005, 0.001]
    claims.equivalence("same", near_zero, margin=0.01, text="x − y", unit="nats")
    claims.equivalence("wide", [0.02, -0.03, 0.025, -0.02], margin=0.01, text="x − z", unit="nats")
    assert claims["same"].p == stats.tost(near_zero, 0.01)["p"] and claims["same"].p < 0.05
    assert claims.render("{same:verdict}").startswith("equivalent within ±0.01 nats (TOST over 6 seeds")
    assert claims.render("{wide:verdict}").startswith("not shown equivalent within ±0.01 nats")
    # the few-word forms a plain answer uses, and the value with its unit
    assert claims.render("{same:outcome}; {wide:outcome}") == (
        "equivalent within ±0.01 nats; not shown equivalent within ±0.01 nats\n"
    )
    assert claims.render("{wide:amount}") == f"{claims['wide'].part('value')} nats\n"


def test_a_run_with_other_parameters_renders_under_a_banner():
    plain = Claims(_run())
    plain.value("x", 1.5, text="x", test="computed")
    assert plain.render("x is {x}.") == "x is 1.5000.\n"
    smoke = Claims(_run({"smoke": True, "seeds": 2}))
    smoke.value("x", 1.5, text="x", test="computed")
    rendered = smoke.render("x is {x}.")
    assert rendered.startswith("> **These conclusions describe this run (smoke=True, seeds=2)")
    assert (
        Claims(_run(profile="paper"))
        .render("y")
        .startswith("> **These conclusions describe this run (profile")
    )


def test_rendered_markdown_never_turns_a_wrapped_number_into_a_list():
    claims = Claims(_run())
    claims.value("n", 30, text="count", test="computed", digits=0)
    text = claims.render("The clipped blocks number\n{n}. That is all.\n\n- an item\n  continued\n- another")
    assert text.splitlines() == [
        "The clipped blocks number 30. That is all.",
        "",
        "- an item continued",
        "- another",
    ]
    assert claims.render("{n}. Blocks clipped.") == "30\\. Blocks clipped.\n"  # not a list item


def test_unknown_keys_and_parts_are_named():
    claims = Claims(_run())
    claims.value("x", 1.0, text="x")
    with pytest.raises(KeyError, match="no claim 'y'; made so far: x"):
        claims.render("{y}")
    with pytest.raises(ValueError, match="unknown part 'colour'"):
        claims.render("{x:colour}")
    with pytest.raises(ValueError, match="key must be letters"):
        claims.value("a key", 1.0, text="t")
    with pytest.raises(ValueError, match="family 'none' has no paired claims"):
        claims.holm("none")


def test_the_findings_table_follows_an_edited_claims_file(tmp_path):
    claims = Claims(_run())
    claims.paired("gap", [0.010, 0.012, 0.011], text="a − FP32", unit="nats", headline=True)
    claims.value("other", 2.0, text="not a headline")
    claims.paired("gap_b", [0.02, -0.03, 0.01], text="b − FP32", unit="nats", headline=True, margin=0.01)
    frame = claims.frame()
    frame.to_csv(tmp_path / "99_demo_claims.csv", index=False)
    table = claims_module.findings_table(tmp_path)
    assert "| 99 | a − FP32 | +0.0110 [+0.0085, +0.0135] nats | resolved: paired t over 3 seeds, p" in table
    # a difference not found shows its equivalence test beside it: not found is not shown equal
    null_row = next(line for line in table.splitlines() if "| b − FP32 |" in line)
    assert (
        "not resolved: paired t over 3 seeds" in null_row
        and "; not shown equivalent within ±0.01 nats" in (null_row)
    )
    assert "not a headline" not in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{claims_module.FINDINGS_START}\nold\n{claims_module.FINDINGS_END}\nend\n")
    assert claims_module.update_readme(readme, tmp_path) is True
    assert claims_module.update_readme(readme, tmp_path, check=True) is False
    # a value edited by hand in the data moves the generated text: the check notices
    edited = pd.read_csv(tmp_path / "99_demo_claims.csv")
    edited.loc[edited.key == "gap", "value"] = 0.0115
    edited.to_csv(tmp_path / "99_demo_claims.csv", index=False)
    assert claims_module.update_readme(readme, tmp_path, check=True) is True


def test_the_committed_readme_findings_are_what_the_committed_claims_files_generate(tmp_path):
    """The drift test: `qlab findings` regenerates the README's table from data/*_claims.csv; any
    hand edit of either side fails here."""
    copy = tmp_path / "README.md"
    shutil.copy(paths.ROOT / "README.md", copy)
    changed = claims_module.update_readme(copy, paths.ROOT / "data", check=True)
    assert not changed, "README.md's findings differ from data/*_claims.csv: run `qlab findings`"


def test_claims_files_round_trip():
    claims = Claims(_run())
    claims.paired("gap", [0.01, 0.03, 0.02], text="t", family="f")
    claims.holm("f")
    claims.value("single", 3.25, text="one run", test="observed")
    for row, made in zip(claims.frame().to_dict("records"), ["gap", "single"]):
        again = claims_module.from_row(pd.Series(row))
        assert again.both() == claims[made].both()
        assert math.isnan(again.margin)


def test_a_claims_pairs_are_named_saved_and_read_back(tmp_path, monkeypatch):
    """Draws, fine-tunes, held-out batches: a verdict names what its pairs are, per claim where they
    differ from the notebook's, through the file; a file written before the pairs column reads as seeds."""
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    claims = Claims(_run(), pairs="draws")
    claims.paired("gap", [0.010, 0.012, 0.011, 0.009, 0.013], text="a − b", family="f", margin=0.05)
    claims.paired("tune", [0.010, 0.012, 0.011], text="fine-tuned a − b", family="g", over="fine-tunes")
    claims.holm("f")
    claims.holm("g")
    claims.tally("gaps", ["gap"], text="gaps resolved")
    assert claims["gap"].verdict().startswith("resolved: paired t over 5 draws")
    assert "TOST over 5 draws" in claims["gap.same"].verdict()
    assert "over 3 fine-tunes" in claims["tune"].verdict()
    assert claims["gaps"].pairs == "draws"  # a tally's pairs are its comparisons'
    path = claims.save()
    saved = claims_module.load(path)
    assert saved.set_index("key").pairs.to_dict() == {
        "gap": "draws", "gap.same": "draws", "tune": "fine-tunes", "gaps": "draws"
    }  # fmt: skip
    for row in saved.to_dict("records"):  # family sizes are recounted by findings, not saved
        again = claims_module.from_row(pd.Series(row))
        assert again.pairs == claims[row["key"]].pairs
    tune = claims_module.from_row(saved[saved.key == "tune"].iloc[0])
    assert "paired t over 3 fine-tunes" in tune.verdict()
    rendered = claims_module.render_committed(path, "{tune:verdict}")  # the docs pages render this way
    assert "paired t over 3 fine-tunes" in rendered
    older = saved.drop(columns=["pairs"])
    assert claims_module.headline_problems(older) == []  # an older file's frame is still read
    older.to_csv(tmp_path / "older_claims.csv", index=False)
    assert set(claims_module.load(tmp_path / "older_claims.csv").pairs) == {"seeds"}
    assert "over 5 seeds" in claims_module.from_row(pd.Series(older.iloc[0])).verdict()
    with pytest.raises(TypeError, match="over must be a non-empty str"):
        claims.paired("bad", [0.1, 0.2], text="x", over="")


def test_paired_family_pairs_by_seed_within_each_group_and_corrects_the_family():
    frame = pd.DataFrame({
        "recipe": ["r"] * 6 + ["s"] * 4,
        "override": ["a", "a", "a", "b", "b", "b", "a", "a", "b", "b"],
        "seed": [0, 1, 2, 0, 1, 2, 0, 1, 0, 1],
        "loss": [1.0, 2.0, 3.5, 0.5, 1.4, 3.0, 5.0, 6.0, 5.1, 6.3],
    })  # fmt: skip
    claims = Claims(_run())
    keys = claims.paired_family(
        frame, "loss", family="m", pairs=[("a", "b")], text="{group}: {a} − {b}", margin=1.0
    )
    assert keys == ["m.r.a-b", "m.s.a-b"]
    r = stats.paired_test([0.5, 0.6, 0.5])
    assert claims["m.r.a-b"].value == pytest.approx(r["mean"]) and claims["m.r.a-b"].text == "r: a − b"
    raw = [r["p"], stats.paired_test([-0.1, -0.3])["p"]]
    assert [claims[k].p_adjusted for k in keys] == pytest.approx(stats.holm(raw))
    assert claims["m.s.a-b.same"].test == "TOST" and claims["m.s.a-b.same"].margin == 1.0
    spaced = frame.assign(override=frame.override.map({"a": "no 2D weight", "b": "all"}))
    assert claims.paired_family(spaced, "loss", family="k", pairs=[("no 2D weight", "all")], text="t") == [
        "k.r.no_2D_weight-all",
        "k.s.no_2D_weight-all",
    ]


def test_paired_family_refuses_a_repeated_pair_and_a_comparison_missing_some_seeds():
    frame = pd.DataFrame({
        "recipe": ["r"] * 6 + ["s"] * 3,
        "override": ["a", "a", "a", "b", "b", "b", "a", "a", "a"],
        "seed": [0, 1, 2, 0, 1, 2, 0, 1, 2],
        "loss": [1.0, 2.0, 3.5, 0.5, 1.4, 3.0, 5.0, 6.0, 5.1],
    })  # fmt: skip
    claims = Claims(_run())
    # group s has no b at all: no comparison there, and no error
    assert claims.paired_family(frame, "loss", family="m", pairs=[("a", "b")], text="t") == ["m.r.a-b"]
    repeated = pd.concat([frame, frame.iloc[[0]].assign(loss=5.0)])  # averaging would give (1 + 5) / 2
    with pytest.raises(
        ValueError, match=r"2 rows that repeat a \(recipe, override, seed\), e.g. \('r', 'a', 0\)"
    ):
        claims.paired_family(repeated, "loss", family="d", pairs=[("a", "b")], text="t")
    diverged = frame.assign(loss=frame.loss.where(frame.index != 4))  # b's seed 1 is NaN
    with pytest.raises(ValueError, match=r"n: recipe 'r' has 'a' and 'b' but not both for seed \[1\]"):
        claims.paired_family(diverged, "loss", family="n", pairs=[("a", "b")], text="t")
    assert "d.r.a-b" not in claims and "n.r.a-b" not in claims


def test_a_p_value_beside_alpha_is_not_rounded_onto_it():
    # p 0.0496 is resolved and p 0.0504 is not; three decimals would print both as 0.050
    claim = claims_module.Claim("x", "x", 0.1, n=5, test="paired t", p=0.0496)
    assert claim.p_text() == "= 0.0496" and claim.verdict().startswith("resolved")
    claim = claims_module.Claim("x", "x", 0.1, n=5, test="paired t", p=0.0504)
    assert claim.p_text() == "= 0.0504" and claim.verdict().startswith("not resolved")
    assert claims_module.Claim("x", "x", 0.1, n=5, test="paired t", p=0.0512).p_text() == "= 0.051"
    assert claims_module.Claim("x", "x", 0.1, n=5, test="paired t", p=0.05).p_text() == "= 0.05"


def test_a_tally_writes_minus_signs_in_its_numbers_only():
    tally = claims_module.Claim("t", "t", 1.0, n=3, test="tally", margin=0.01, detectable=1.2e-5,
                                equivalent=1.0, undecided=1.0, unit="bits-per-char", digits=0,
                                pairs="fine-tunes")  # fmt: skip
    assert "(these fine-tunes detect up to 1.2e−05 bits-per-char at 80 % power after Holm)" in tally.verdict()


def test_a_count_is_written_out_whatever_its_size():
    count = claims_module.Claim("rows", "LayerNorm rows", 186880.0, test="computed", digits=0)
    assert count.number(count.value, False) == "186880"
    small = claims_module.Claim("ratio", "a small ratio", 0.00012, test="computed", digits=2)
    assert small.number(small.value, False) == "1.20e−04"  # the minus sign typeset (U+2212)
    # three significant digits at least: 1.49e−07 never reads as 1e−07
    tiny = claims_module.Claim("share", "a share", 1.4876e-7, test="observed", digits=1)
    assert tiny.number(tiny.value, False) == "1.49e−07"


def test_a_tost_claim_shows_its_95_interval_and_its_90_interval_apart():
    claims = Claims(_run())
    differences = [0.0012, -0.0008, 0.0021, 0.0003, -0.0011, 0.0009]
    claim = claims.equivalence("same", differences, margin=0.01, text="x − y", unit="nats")
    at_95, at_90 = stats.paired_test(differences), stats.paired_test(differences, alpha=0.1)
    assert (claim.low, claim.high) == (at_95["low"], at_95["high"])
    assert (claim.low_90, claim.high_90) == (at_90["low"], at_90["high"])
    assert claim.high - claim.low > claim.high_90 - claim.low_90
    assert claims.render("{same}") == f"{claim.number(claim.value, True)} {claim.interval()} nats\n"
    assert f"90 % interval {claim.interval(90)})" in claim.verdict()


def test_a_tally_counts_resolved_equivalent_and_undecided_comparisons():
    claims = Claims(_run())
    far = [0.05, 0.052, 0.049, 0.051, 0.05, 0.048]  # resolved, not within ±0.01
    near = [0.0005, -0.0004, 0.0002, 0.0001, -0.0003, 0.0]  # equivalent, not resolved
    noisy = [0.03, -0.04, 0.02, -0.035, 0.01, 0.005]  # neither
    for key, values in (("a", far), ("b", near), ("c", noisy)):
        claims.paired(key, values, text=key, family="f", unit="nats", margin=0.01)
    claims.holm("f")
    tally = claims.tally("count", ["a", "b", "c"], text="pairs that differ", headline=True)
    assert (tally.value, tally.n, tally.equivalent, tally.undecided) == (1, 3, 1, 1)
    assert tally.detectable == claims["c"].detectable and tally.margin == 0.01
    verdict = tally.verdict()
    assert verdict.startswith(
        "1 of 3 resolved after Holm (paired t), none of them also by the sign-flip test (Holm)"
    )
    assert "; of the rest, 1 equivalent within ±0.01 nats (TOST, Holm-adjusted)" in verdict
    # the equivalence tests are a family of their own: Holm over the three TOST p-values, by hand
    raw = [claims[f"{key}.same"].p for key in "abc"]
    order = sorted(range(3), key=raw.__getitem__)
    running, by_hand = 0.0, [0.0] * 3
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * raw[index]))
        by_hand[index] = running
    assert [claims[f"{key}.same"].p_adjusted for key in "abc"] == pytest.approx(by_hand, rel=1e-12)
    assert (
        "Holm-adjusted p" in claims["b.same"].verdict()
        and "over 3 equivalence tests" in claims["b.same"].verdict()
    )
    detectable = f"{claims['c'].detectable:.3g}".replace("-", "−")
    assert f"1 undecided (these seeds detect up to {detectable} nats at 80 % power after Holm)" in verdict
    assert tally.outcome() == "1 resolved, 1 equivalent, 1 undecided"
    assert claims["a"].outcome() == "resolved over 6 seeds"
    assert claims["c"].outcome() == "not resolved over 6 seeds"
    # a direction counts the resolved ones of its sign and names the others: "a" is resolved higher
    lower = claims.tally("lower", ["a", "b", "c"], text="x", direction="lower")
    assert lower.value == 0 and lower.verdict().startswith("0 of 3 resolved lower and 1 higher after Holm")
    assert lower.outcome() == "0 lower, 1 higher, 1 equivalent, 1 undecided"
    assert claims.tally("higher", ["a", "b", "c"], text="x", direction="higher").value == 1
    # a resolved comparison inside the margin counts as resolved, not also as equivalent (disjoint classes)
    claims.paired("tiny", [0.001, 0.0011, 0.0009, 0.001, 0.00105, 0.00095], text="t", family="g", margin=0.01)
    claims.holm("g")
    both = claims.tally("both", ["tiny"], text="x")
    assert claims["tiny"].resolved() and claims["tiny.same"].resolved()
    assert (both.value, both.equivalent, both.undecided) == (1, 0, 0)
    # round trip through the claims file keeps the verdict
    row = claims.frame().set_index("key").loc["count"].to_dict() | {"key": "count"}
    assert claims_module.from_row(pd.Series(row)).verdict() == verdict
    claims.paired("d", far, text="d", family="h")
    with pytest.raises(ValueError, match="not Holm-adjusted yet"):
        claims.tally("bad", ["d"], text="x")
    claims.holm("h")
    with pytest.raises(ValueError, match="no equivalence test 'd.same'"):
        claims.tally("bad", ["d"], text="x")
    with pytest.raises(ValueError, match="not a paired t"):
        claims.tally("bad", ["a.same"], text="x")
    claims.paired("e", far, text="e", family="late")
    claims.holm("late")
    claims.equivalence("e.same", far, margin=0.01, text="e within")  # made after holm: not adjusted
    with pytest.raises(ValueError, match="'e.same' is not Holm-adjusted"):
        claims.tally("bad", ["e"], text="x")
    with pytest.raises(ValueError, match="direction"):
        claims.tally("bad", ["a"], text="x", direction="down")
    with pytest.raises(ValueError, match="test must be one of"):
        claims_module.Claim("x", "x", 1.0, test="lower")


def test_headline_problems_catch_untested_counts_and_nulls_without_tost():
    claims = Claims(_run())
    claims.value("count", 3, text="things that differ", test="computed", digits=0, headline=True)
    claims.paired("gap", [0.002, -0.003, 0.001, -0.001], text="gap", unit="nats", headline=True)
    claims.paired(
        "gap2", [0.002, -0.003, 0.001, -0.001], text="gap2", unit="nats", headline=True, margin=0.01
    )
    claims.value("rows", 186880, text="rows measured", test="observed", digits=0, headline=True)
    claims.value("median", 4, text="median runs to a crossing", test="estimate", n=5, digits=0, headline=True)
    problems = claims_module.headline_problems(claims.frame())
    assert len(problems) == 3
    assert problems[0].startswith("count: a count headline") and problems[1].startswith("gap: an unresolved")
    assert problems[2] == (
        "median: a count headline whose verdict is 'an estimate over 5 samples, no interval', with no test"
    )


def test_an_estimate_says_it_has_no_interval():
    claims = Claims(_run())
    ratio = claims.value("ratio", 6.25, text="floor ÷ error", test="estimate", n=15, digits=3)
    assert ratio.verdict() == "an estimate over 15 samples, no interval"
    lowest = claims.value("lowest", 0.5, text="lowest cosine", test="estimate")
    assert lowest.verdict() == "an estimate, no interval"


def test_a_ratio_of_means_carries_fiellers_interval_or_says_why_it_has_none():
    claims = Claims(_run())
    share = claims.ratio("share", [0.30, 0.42, 0.25, 0.37], [0.50, 0.61, 0.44, 0.58], text="a gain's share")
    assert share.value == pytest.approx(1.34 / 2.13, rel=1e-12)  # (0.30+0.42+0.25+0.37) / (0.50+…+0.58)
    assert share.low < share.value < share.high
    assert share.verdict() == "a ratio of means over 4 seeds, 95 % Fieller interval"
    unresolved = claims.ratio("loose", [0.5, 0.1, 0.4], [1.0, -0.5, 0.8], text="a share of no resolved gain")
    assert unresolved.interval() == "" and "denominator not resolved" in unresolved.verdict()


def test_a_geometric_mean_keeps_its_interval_positive_and_survives_a_save(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    claims = Claims(_run())
    ratio = claims.geometric_mean("ratio", [2.0, 8.0], text="an outlier ratio")
    assert ratio.value == pytest.approx(4.0, rel=1e-12) and 0 < ratio.low < 4.0 < ratio.high  # √(2·8)
    assert ratio.verdict() == "geometric mean over 2, 95 % interval from the logarithms"
    claims.save()
    (loaded,) = claims_module.load(paths.data_dir() / f"{_run().name}_claims.csv").to_dict("records")
    assert loaded["test"] == "geometric" and loaded["value"] == pytest.approx(ratio.value, rel=1e-9)
    assert claims_module.from_row(loaded).verdict() == ratio.verdict()


def test_every_committed_headline_states_its_test():
    # the committed findings: no count headline without a test, no null headline without its TOST
    problems = [
        f"{path.name}: {problem}"
        for path in sorted((paths.ROOT / "data").glob("[0-9][0-9]_*_claims.csv"))
        for problem in claims_module.headline_problems(claims_module.load(path))
    ]
    assert problems == []


def test_a_report_names_its_pairs_and_has_no_banner_to_show():
    claims = Claims(_run(changed={"model_name": "mine"}), pairs="batches", committed=False)
    claims.paired("gap", [0.002, -0.003, 0.001, -0.001], text="plan − float", unit="nats")
    claims.equivalence("same", [0.0001, -0.0002, 0.0001, 0.0], margin=0.01, text="plan − float")
    text = claims.render("{gap} ({gap:verdict}); {same:verdict}")
    assert text.startswith("+") or text.startswith("−")  # no banner: nothing committed to differ from
    assert "not resolved: paired t over 4 batches" in text and "these batches detect" in text
    assert "TOST over 4 batches" in text
    assert "seeds" not in text
    assert Claims(_run(changed={"model_name": "mine"})).render("x").startswith("> **These conclusions")
    with pytest.raises(TypeError, match="pairs must be a non-empty str"):
        Claims(_run(), pairs="")


def test_a_saved_run_keeps_the_text_it_rendered_beside_its_claims(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    claims = Claims(_run())
    claims.paired("gap", [0.010, 0.012, 0.011], text="a − FP32", unit="nats")
    first = claims.render("A: {gap}.")
    assert not (tmp_path / "data" / "99_demo_claims.md").exists()  # nothing is written before save
    claims.save()
    written = tmp_path / "data" / "99_demo_claims.md"
    assert written.read_text() == first
    second = claims.render("Verdict: {gap:verdict}.")
    assert written.read_text() == first + "\n" + second  # every later rendering joins it
    assert claims_module.render_committed(tmp_path / "data" / "99_demo_claims.csv", "A: {gap}.") == first
    # a second claims file of the same notebook (its timings) fills the same template
    timing = Claims(_run())
    timing.value("time.x", 0.25, text="x time ÷ dense", test="observed", digits=2)
    save_csv(timing.frame(), "99_demo_claims_timing")
    both = claims_module.render_committed(
        tmp_path / "data" / "99_demo_claims.csv", "{gap:amount}, {time.x:value}",
        also=[tmp_path / "data" / "99_demo_claims_timing.csv"],
    )  # fmt: skip
    assert both == f"{claims['gap'].part('value')} nats, 0.25\n"
    with pytest.raises(TypeError, match="also must be a list of claims files"):
        claims_module.render_committed(tmp_path / "data" / "99_demo_claims.csv", "A", also="x.csv")


def test_a_tally_says_when_the_sign_flip_test_resolves_fewer_than_the_t_test():
    # 4 seeds: the exact sign-flip p cannot fall below 2/2⁴ = 0.125, while a steady gap gives t's p ≪ 0.05
    claims = Claims(_run())
    claims.paired("steady", [0.050, 0.052, 0.049, 0.051], text="s", family="f", margin=0.01)
    claims.paired("noisy", [0.03, -0.04, 0.02, -0.035], text="n", family="f", margin=0.01)
    claims.holm("f")
    tally = claims.tally("count", ["steady", "noisy"], text="pairs that differ")
    assert claims["steady"].p_adjusted < 0.05 and claims["steady"].p_sign_flip_adjusted >= 0.125
    assert (tally.value, tally.sign_flip_resolved) == (1, 0)
    assert "1 of 2 resolved after Holm (paired t), none of them also by the sign-flip test (Holm)" in (
        tally.verdict()
    )
    row = claims.frame().set_index("key").loc["count"].to_dict() | {"key": "count"}
    assert claims_module.from_row(pd.Series(row)).verdict() == tally.verdict()
    # where they agree, nothing is added: 6 seeds of one sign reach 2/2⁶ ≈ 0.031
    agree = Claims(_run())
    agree.paired("steady", [0.050, 0.052, 0.049, 0.051, 0.05, 0.048], text="s", family="g", margin=0.01)
    agree.holm("g")
    assert "sign-flip" not in agree.tally("count", ["steady"], text="x").verdict()
