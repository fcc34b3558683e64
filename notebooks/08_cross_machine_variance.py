# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python (qlab)
#     language: python
#     name: qlab
# ---

# %% [markdown]
# # A change of machine is a source of variance
#
# Notebooks 03 and 07 train the same CharGPT configurations over several seeds and state which
# differences in validation loss the seeds resolve. Their runs are deterministic on one machine, but
# not across machines: another CPU (another vector width, another BLAS kernel) or another thread
# count may sum in another order — the likely cause, not measured here — and a quantized run that
# rounds one value differently early on ends elsewhere. A finding that a change of CPU overturns is
# not a finding about the recipe. What follows rests on one second machine, on which the CPU and the
# thread count changed together, with the notebooks' seeds.
#
# This notebook measures that variance from committed runs (provenance in `data/cross_cpu/README.md`):
# the same configurations and seeds of notebooks 03 and 07, at their default parameters, on the machine
# behind the committed results (a 2-vCPU **AMD EPYC**, one torch thread per run) and on a second machine
# (a 2-vCPU **Intel Xeon** with AVX-512 and AMX, two threads per run) — what moving a study to another
# machine changes. It asks:
#
# 1. how far the change of machine moves one run's final validation loss, against the seed-to-seed
#    spread;
# 2. how far it moves each paired comparison of notebooks 03 and 07 (the same seeds on both), against
#    the committed standard error of that comparison — the scale its interval is built on;
# 3. which of the comparisons those notebooks resolve (Holm-corrected, their committed claims) survive
#    the shift measured for that same comparison: the committed interval, at the level at which it
#    agrees with the Holm-adjusted verdict, moved by the shift must still exclude zero (and an
#    equivalence shown by TOST must still hold within its margin).

# %% tags=["parameters"]
smoke: bool = False  # no effect: the notebook only reads committed runs (seconds either way)
device: str = "auto"  # no effect: nothing is computed on a device
second: str = "intel_xeon"  # folder under data/cross_cpu/ holding the second machine's runs

# %%
import pandas as pd
from IPython.display import Markdown, display

from qlab import claims as claims_module
from qlab import crossmachine, paths, session
from qlab.claims import Claims
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import markdown_table, save_csv

NAME = "08_cross_machine_variance"
this_run = session.start(NAME, globals())
use_paper_style()
source = paths.ROOT / "data"  # the committed runs are this notebook's input, wherever its results go
machines = {
    "committed": crossmachine.machine_record(source / "cross_cpu", "committed.json"),
    second: crossmachine.machine_record(source / "cross_cpu" / second),
}
for name, record in machines.items():
    print(f"{name}: {record['cpu']}, {record['threads']} torch threads per run, qlab {record['qlab_commit']}")
first_label, second_label = machines["committed"]["cpu_short"], machines[second]["cpu_short"]

# %% [markdown]
# ## 1. How far one run moves
#
# Final validation loss of each configuration and seed that both machines ran.

# %%
runs = {
    notebook: {"committed": crossmachine.final_losses(notebook, source),
               second: crossmachine.final_losses(notebook, source / "cross_cpu" / second)}
    for notebook in crossmachine.NOTEBOOKS
}  # fmt: skip
shifts = pd.concat(
    [crossmachine.run_shifts(runs[nb][second], runs[nb]["committed"]).assign(notebook=nb) for nb in runs],
    ignore_index=True,
)
save_csv(shifts, f"{NAME}_run_shifts")
spread = pd.concat([crossmachine.seed_spread(runs[nb]["committed"]).assign(notebook=nb) for nb in runs])
summary = shifts.groupby("notebook").agg(
    runs=("shift", "size"), unchanged=("shift", lambda s: int((s == 0).sum())),
    median_abs_shift=("shift", lambda s: float(s.abs().median())),
    max_abs_shift=("shift", lambda s: float(s.abs().max())),
).reset_index().merge(spread.groupby("notebook").sd.median().rename("median_seed_sd").reset_index())  # fmt: skip
display(summary)

# %%
fig, axes = subplots(1, len(runs), width="text", aspect=1.1, squeeze=False)
for ax, notebook in zip(axes[0], runs):
    part = shifts[shifts.notebook == notebook].sort_values("config")
    moved = part[part["shift"] != 0]
    configs = list(dict.fromkeys(part.config))
    ax.scatter(moved["shift"].abs(), [configs.index(c) for c in moved.config], s=8, color="C0",
               label="a run that moved (one per seed)")  # fmt: skip
    unchanged = part[part["shift"] == 0].config.value_counts()
    for config, count in unchanged.items():
        ax.annotate(f"{count} bit-identical", (1, configs.index(config)), xycoords=("axes fraction", "data"),
                    ha="right", va="center", fontsize=7, color="0.3")  # fmt: skip
    sd = spread[spread.notebook == notebook].sd.median()
    ax.axvline(sd, color="0.3", linestyle="--", linewidth=0.8, label="median seed-to-seed SD")
    ax.set_xscale("log")
    ax.set_yticks(range(len(configs)), configs, fontsize=7)
    ax.set_xlabel("|Δ final validation loss| (nats)")
    ax.set_title(f"notebook {notebook[:2]}")
handles, labels = axes[0][0].get_legend_handles_labels()
fig.legend(handles, labels, loc="outside lower center", ncols=2)
fig.suptitle(f"One run on the {second_label} minus the same run on the {first_label}")
save_figure(fig, f"{NAME}_run_shifts")

# %% [markdown]
# ## 2. How far each comparison moves
#
# Every paired comparison of the two notebooks (a configuration against FP32, a backward mode against
# another, an ablation against its full recipe), estimated from the same seeds on both machines. The
# shift of a comparison is the difference of the two estimates. Its yardstick is the committed standard
# error of that comparison: the seed-to-seed SD of its paired difference on the committed machine (what
# a seed does to both sides cancels in it) over √n, for all n committed seeds — the scale of the
# committed interval the shift moves.

# %%
comparisons = pd.concat([
    crossmachine.comparisons(nb, runs[nb]["committed"], runs[nb][second], "first", "second") for nb in runs
], ignore_index=True)  # fmt: skip
spread = pd.concat(
    [crossmachine.difference_spread(nb, runs[nb]["committed"]).assign(notebook=nb) for nb in runs],
    ignore_index=True,
).rename(columns={"n": "committed_n", "sd": "difference_sd", "error": "committed_error"})
comparisons = comparisons.merge(spread, on=["notebook", "key"], how="left")
comparisons["shift_in_errors"] = comparisons["shift"] / comparisons.committed_error
save_csv(comparisons, f"{NAME}_comparisons")
comparison_summary = comparisons.groupby("notebook").agg(
    comparisons=("shift", "size"), median_abs_shift=("shift", lambda s: float(s.abs().median())),
    median_errors=("shift_in_errors", lambda s: float(s.abs().median())),
    max_errors=("shift_in_errors", lambda s: float(s.abs().max())),
    largest=("shift_in_errors", lambda s: comparisons.key[s.abs().idxmax()]),
).reset_index()  # fmt: skip
display(comparison_summary)
fig, axes = subplots(1, len(runs), width="text", aspect=1.4, squeeze=False)
for ax, notebook in zip(axes[0], runs):
    part = comparisons[comparisons.notebook == notebook]
    ax.errorbar(part["first_mean"], part["second_mean"], fmt="o", markersize=3, linewidth=0.6,
                xerr=[part["first_mean"] - part["first_low"], part["first_high"] - part["first_mean"]],
                yerr=[part["second_mean"] - part["second_low"], part["second_high"] - part["second_mean"]])  # fmt: skip
    low = min(part[["first_low", "second_low"]].min())
    high = max(part[["first_high", "second_high"]].max())
    ax.plot([low, high], [low, high], color="0.3", linestyle="--", linewidth=0.8)
    ax.axhline(0, color="0.6", linewidth=0.5)
    ax.axvline(0, color="0.6", linewidth=0.5)
    ax.set_xlabel(f"{first_label} (nats)")
    ax.set_title(f"notebook {notebook[:2]}: {len(part)} comparisons")
axes[0][0].set_ylabel(f"{second_label} (nats)")
both_ran = sorted(comparisons.n.unique())
fig.suptitle("Each paired comparison on both machines: mean and 95 % interval over the "
             f"{' or '.join(map(str, both_ran))} seeds both ran")
save_figure(fig, f"{NAME}_comparisons")

# %% [markdown]
# ## 3. Which committed findings survive the change of machine
#
# For every comparison that notebooks 03 and 07 resolve in their committed claims (paired t,
# Holm-corrected) or show equivalent (TOST within their margin), the committed interval is moved by the
# shift measured for that comparison in section 2; the finding survives when the moved interval still
# excludes zero (or still lies within the margin). The interval is the one at the level at which it
# agrees with the claim's adjusted p (α · p / p_adjusted: Holm's step level, or smaller where Holm's
# running maximum binds; column `confidence`), so that before any move it holds exactly when the
# committed verdict does: the stored 95 % interval of a claim in a family is narrower than the test
# that resolved it. After the move it is a strict check, not a test at a stated level.

# %%
survival = pd.concat([
    crossmachine.survival(claims_module.load(source / f"{nb}_claims.csv"), comparisons[comparisons.notebook == nb])
    .assign(notebook=nb) for nb in runs
], ignore_index=True)  # fmt: skip
save_csv(survival, f"{NAME}_survival")

# %% [markdown]
# ## 4. Conclusions
#
# Computed in the next cell from the committed runs and claims, saved to
# `data/08_cross_machine_variance_claims.csv`.

# %%
claims = Claims(this_run)
for row in summary.itertuples():
    nb = row.notebook[:2]
    claims.value(f"shift.{nb}.median", row.median_abs_shift, test="estimate", n=row.runs, digits=5, unit="nats", headline=nb == "03",
                 text=f"notebook {nb}: median |Δ final loss| of a run moved to the second machine")  # fmt: skip
    claims.value(f"shift.{nb}.max", row.max_abs_shift, test="estimate", n=row.runs, digits=5, unit="nats",
                 text=f"notebook {nb}: largest |Δ final loss| of a run moved to the second machine")  # fmt: skip
    claims.value(f"shift.{nb}.unchanged", row.unchanged, test="computed", digits=0,
                 text=f"notebook {nb}: runs (of {row.runs}) bit-identical on both machines")  # fmt: skip
    claims.value(f"seed_sd.{nb}", row.median_seed_sd, test="estimate", digits=5, unit="nats",
                 text=f"notebook {nb}: median seed-to-seed SD of a configuration's final loss")  # fmt: skip
for row in comparison_summary.itertuples():
    nb = row.notebook[:2]
    claims.value(f"comparison_shift.{nb}.median", row.median_abs_shift, test="estimate", n=row.comparisons,
                 digits=5, unit="nats",
                 text=f"notebook {nb}: median |shift| of a paired comparison moved to the second machine")  # fmt: skip
    claims.value(f"comparison_shift.{nb}.errors", row.median_errors, test="estimate", n=row.comparisons, digits=2,
                 text=f"notebook {nb}: median |shift| of a paired comparison, in its committed standard errors")  # fmt: skip
    claims.value(f"comparison_shift.{nb}.errors_max", row.max_errors, test="estimate", n=row.comparisons, digits=1,
                 text=f"notebook {nb}: largest |shift| of a paired comparison ({row.largest}), in committed standard errors")  # fmt: skip
resolved = survival[survival.kind == "resolved"]
equivalent = survival[survival.kind == "equivalent"]
claims.value("survive.resolved", int(resolved.survives.sum()), test="computed", digits=0,
             text=f"resolved comparisons of notebooks 03 and 07 (of {len(resolved)}) that survive the change of machine")  # fmt: skip
claims.value("survive.equivalent", int(equivalent.survives.sum()), test="computed", digits=0,
             text=f"equivalences of notebooks 03 and 07 (of {len(equivalent)}) that survive the change of machine")  # fmt: skip
claims.value("survive.resolved_mean_shift", int(resolved.survives_mean_shift.sum()), test="computed", digits=0,
             text=f"resolved comparisons (of {len(resolved)}) still resolved when moved by the mean shift alone")  # fmt: skip
claims.value("survive.equivalent_mean_shift", int(equivalent.survives_mean_shift.sum()), test="computed", digits=0,
             text=f"equivalences (of {len(equivalent)}) still within the margin when moved by the mean shift alone")  # fmt: skip
flipped = comparisons[comparisons.verdicts_differ]
claims.value("flipped", len(flipped), test="computed", digits=0,
             text=f"comparisons (of {len(comparisons)}) whose interval excludes zero on one machine and not on the other, same seeds")  # fmt: skip
claims.value("flipped.total", len(comparisons), test="computed", digits=0,
             text="paired comparisons of notebooks 03 and 07 measured on both machines")
claims.save()

conclusions = """
**One run.** Moving a run to the second machine moves its final validation loss by a median of
{shift.03.median:value} nats in notebook 03 (largest {shift.03.max:value}) and {shift.07.median:value} in
notebook 07 (largest {shift.07.max:value}), against a median seed-to-seed SD of {seed_sd.03:value} and
{seed_sd.07:value}. Bit-identical on both machines: {shift.03.unchanged:value} runs of notebook 03,
{shift.07.unchanged:value} of notebook 07.

**Comparisons.** A paired comparison moves by a median of {comparison_shift.03.median:value} nats in
notebook 03 and {comparison_shift.07.median:value} in notebook 07: {comparison_shift.03.errors:value}
and {comparison_shift.07.errors:value} of its committed standard error (the scale of its committed
interval), and at most {comparison_shift.03.errors_max:value} (`{largest.03}`) and
{comparison_shift.07.errors_max:value} (`{largest.07}`). With the same {n_both} seeds on each machine, {flipped:value} of the
{flipped.total:value} comparisons exclude zero on one machine and not on the other; intervals over so
few seeds are wide, and a comparison near the edge of one flips with little movement.

**The committed findings.** Each committed interval, at the level at which it agrees with its
Holm-adjusted verdict, moved by
the whole 95 % interval of its comparison's shift over the seeds both machines ran (so the shift's
spread widens it, not only its mean): {survive.resolved:value} of the resolved comparisons and
{survive.equivalent:value} of the equivalences still hold after that move. Moved by the mean shift alone, {survive.resolved_mean_shift:value}
and {survive.equivalent_mean_shift:value} hold. The second machine ran {n_both} seeds of each
configuration, so the shift's interval is wide: the first count is of a strict check, the second of a
lenient one, and neither bounds how many findings truly survive. These are counts of two checks, not
tests:
"""
largest = dict(zip(comparison_summary.notebook.str[:2], comparison_summary.largest))  # keys, not numbers
conclusions = (conclusions.replace("{n_both}", " or ".join(map(str, both_ran)))
               .replace("{largest.03}", largest["03"]).replace("{largest.07}", largest["07"]))
display(Markdown(claims.render(conclusions) + "\n" + markdown_table(survival.drop(columns=["notebook"]), "{:+.4f}")))
