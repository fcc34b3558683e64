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
# # Top-k sparse back-propagation: does it train, and is it faster?
#
# A forum question asks how to keep only the top-k gradient entries at each node of
# the backward pass — first to see how a model trains that way, then whether it is faster — and
# is told that masking may not be faster at all. meProp (Sun et al., "meProp: Sparsified Back
# Propagation for Accelerated Deep Learning with Reduced Overfitting", ICML 2017, PMLR 70) keeps the
# top-k entries of each Linear layer's output gradient.
#
# `qlab.sparse` implements three ways to do it: hook_mask and gathered give the same gradients (one
# index set shared by the batch), sparse_rows uses meProp's per-example sets; their costs differ:
#
# - **hook_mask** — a backward pre-hook zeroes all but the top-k entries of dy; the GEMMs keep their size;
# - **gathered** — `TopKLinear`, one index set of k output features shared by the batch: smaller dense
#   GEMMs, dx = dy[:, idx]·W[idx, :] and only rows idx of dW;
# - **sparse_rows** — `TopKLinear(mode="row")`, each row its own k entries, multiplied as a sparse tensor.
#
# This notebook measures (1) accuracy on scikit-learn's digits vs k over `seeds` seeds, for the shared
# index set and for meProp's own per-example top-k (`topk_mode="row"`), each seed with its own
# train/validation split; (2) validation loss of the Shakespeare character model vs k over
# `text_seeds` seeds; (3) backward time and whole-step time vs k for every variant, as ratios to
# dense measured in the same run; (4) what fraction of the weights actually change per step. Section 5
# states the conclusions, computed from this run's results: differences are paired with the dense
# run of the same seed (paired t), Holm-corrected over the k values of each comparison, and "no
# difference" is claimed only through an equivalence test (TOST) within `margin`.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (10 seeds, 3000 steps, a 1.0M-parameter CharGPT: a GPU)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 10  # digits runs per k and mode; seed s draws the initial weights, the batches and train/test split s
fractions: list[float] = [0.01, 0.02, 0.05, 0.1, 0.16, 0.25, 0.5]  # k as a fraction of each layer's outputs
margin: float = 1.0  # accuracy points: top-k equals dense only where TOST puts the paired difference within ±margin
hidden: int = 500  # hidden width of the digits MLP (two hidden layers; meProp's MNIST width)
digits_steps: int = 300  # optimizer steps per digits run
text_steps: int = 200  # optimizer steps per Shakespeare run
text_fractions: list[float] = [0.05, 0.16, 0.5]  # k for the Shakespeare model
text_seeds: int = 10  # Shakespeare runs per k
text_margin: float = 0.005  # nats, set before the committed runs (after pilot runs): each k's TOST margin against dense
timing_tokens: int = 512  # rows of x and dy in the timing
timing_width: int = 2048  # width of the square Linear layer timed
timing_repeats: int = 15  # passes timed per point (median and quartiles)
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import matplotlib.lines
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display
from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
    PercentFormatter,
)
from torch import nn

from qlab import session, stats
from qlab.claims import Claims
from qlab.plotting import mean_band, save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics
from qlab.runs import run_many, task
from qlab.sparse import BACKWARDS, pass_seconds, time_ratios, train_digits
from qlab.train import TrainConfig


def pct(k: float) -> str:
    """A k fraction as the text states it: 0.05 -> "5 %"."""
    return f"{100 * k:g} %"


def k_axis(ax, ticks):
    """A log x axis labelled with the k fractions as percentages (no minor labels)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.xaxis.set_minor_locator(NullLocator())


NAME = "05_topk_sparse_backprop"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if profile == "paper":  # 10 digits seeds × 3000 steps; the 1.0M-parameter CharGPT, 3000 steps, 5 seeds
    seeds, digits_steps, text_steps, text_seeds = max(seeds, 10), 3000, 3000, max(text_seeds, 5)
    timing_tokens, timing_width, timing_repeats = 4096, 4096, 31
if smoke:
    seeds, fractions, hidden, digits_steps, text_steps, text_fractions = 2, [0.05, 0.5], 32, 8, 4, [0.25]
    text_seeds, timing_tokens, timing_width, timing_repeats = 2, 32, 64, 2
use_paper_style()
digits = TrainConfig(task="digits", hidden=[hidden, hidden], steps=digits_steps, batch_size=64, lr=3e-3,
                     warmup_steps=min(10, digits_steps), eval_every=digits_steps, weight_decay=0.0, device=device,
                     progress=False)
print(f"digits MLP 64 → {hidden} → {hidden} → 10, k ∈ {fractions} of each hidden layer's outputs, {seeds} seeds "
      "(seed s: initial weights, batches and train/validation split s)")

# %% [markdown]
# ## 1. Accuracy vs k on digits
#
# Top-k on both hidden layers' output gradients (the 10-way output layer stays dense,
# `topk_keep=["last_layer"]`), AdamW, in two modes: "shared" (one index set per batch, gathered
# GEMMs) and "row" (each example its own k, meProp's per-example setting). Seed s fixes the
# initial weights, the batches and the train/validation split (`qlab.sparse.train_digits`: a
# permutation seeded with s holds out a fifth of the images), the same for every k and mode, so
# each top-k run is paired with the dense run of its seed. Accuracies are in percent of the
# held-out images, differences in percentage points.
#
# For reference, not reproduced here: meProp's MNIST MLP (500 hidden units, Adam, top-80) reaches
# 98.27 % test accuracy against 98.20 % dense, with a 5.9× faster backward on CPU (the results table
# in the authors' repository, github.com/lancopku/meProp, for Sun et al., ICML 2017). MNIST trained
# for epochs is not scikit-learn's 8-by-8 digits trained for `digits_steps` steps, so the losses
# measured below do not contradict that report: the setting differs (data set, epochs, optimizer
# schedule), and which of these differences accounts for the gap is not tested here.

# %%
MODES = ("shared", "row")
runs = [(seed, None, "dense") for seed in range(seeds)]
runs += [(seed, k, mode) for seed in range(seeds) for mode in MODES for k in fractions]
configs = [digits.replace(seed=seed) if k is None else digits.replace(topk=k, topk_mode=mode, seed=seed)
           for seed, k, mode in runs]
results = run_many([task(train_digits, config, config.seed) for config in configs], executor=executor,
                   max_workers=max_workers or None, desc="digits runs")
rows = []
for (seed, k, mode), result in zip(runs, results):
    last = result.metrics.iloc[-1]
    rows.append({"mode": mode, "k_fraction": 1.0 if k is None else k, "seed": seed, "split": seed,
                 "val_accuracy_percent": 100 * last.val_accuracy, "val_loss": last.val_loss})
accuracy = pd.DataFrame(rows)
save_csv(accuracy, f"{NAME}_digits")
# Δ accuracy (points) against the dense run of the same seed, per (mode, k): mean and 95 % interval over seeds
digits_deltas = pd.concat(
    [stats.paired_differences(accuracy[(accuracy["mode"] == "dense") | (accuracy.k_fraction == k)],
                              "val_accuracy_percent", baseline="dense", by="mode", pair="seed").assign(k_fraction=k)
     for k in fractions], ignore_index=True).rename(columns={"difference": "points"})
gaps = stats.summarize(digits_deltas, "points", ["mode", "k_fraction"])
gaps.round(2)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.5)
dense_runs = accuracy[accuracy["mode"] == "dense"]
dense_mean, dense_low, dense_high = stats.mean_interval(dense_runs.val_accuracy_percent)
mean_band(axes[0], accuracy[accuracy["mode"] != "dense"], "k_fraction", "val_accuracy_percent", by="mode",
          marker="o", markersize=3)
axes[0].axhspan(dense_low, dense_high, color="black", alpha=0.12, linewidth=0)
axes[0].axhline(dense_mean, color="black", linewidth=0.8, label="dense (band: 95 %)")
axes[0].set_ylabel("validation accuracy (%)")
axes[0].set_title(f"Digits accuracy: mean and 95 % band over {seeds} seeds", fontsize=7)
mean_band(axes[1], digits_deltas, "k_fraction", "points", by="mode", marker="o", markersize=3)
axes[1].axhline(0.0, color="black", linewidth=0.8)
for sign in (-1, 1):
    axes[1].axhline(sign * margin, color="grey", linewidth=0.8, linestyle=":",
                    label=f"TOST margin ±{margin:g} points" if sign < 0 else None)
axes[1].set_ylabel("Δ accuracy (points)")
axes[1].set_title("Top-k − dense, paired by seed: mean and 95 % band", fontsize=7)
for ax in axes:
    k_axis(ax, fractions)
    ax.set_xlabel("k / hidden width")
handles, labels = axes[0].get_legend_handles_labels()
more_handles, more_labels = axes[1].get_legend_handles_labels()
handles += [h for h, label in zip(more_handles, more_labels) if label.startswith("TOST")]
labels += [label for label in more_labels if label.startswith("TOST")]
fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.09))
save_figure(fig, f"{NAME}_digits")

# %% [markdown]
# ## 2. The Shakespeare character model
#
# The training notebook's small CharGPT (2 blocks, width 64), top-k on every Linear except the
# head, `text_seeds` seeds per k. Validation loss on the held-out plays against the dense run of
# the same seed.

# %%
text = TrainConfig(steps=text_steps, layers=2, width=64, context=64, batch_size=16, lr=3e-3,
                   warmup_steps=min(30, text_steps), eval_every=text_steps, eval_batches=8, device=device,
                   progress=False)
if profile == "paper":
    text = text.replace(layers=5, width=128, context=128, batch_size=32, lr=1e-3, warmup_steps=100, eval_batches=16)
if smoke:
    text = text.replace(layers=1, width=32, context=32, batch_size=8, eval_batches=1)
text_rows = []
text_points = [(s, k) for s in range(text_seeds) for k in [None] + text_fractions]
text_results = run_many([text.replace(topk=k, seed=seed) for seed, k in text_points], executor=executor,
                        max_workers=max_workers or None, desc="Shakespeare runs")
for (seed, k), result in zip(text_points, text_results):
    text_rows.append({"run": "dense" if k is None else "top-k", "k_fraction": 1.0 if k is None else k, "seed": seed,
                      "val_loss": result.metrics.val_loss.iloc[-1]})
text_runs = pd.DataFrame(text_rows)
save_csv(text_runs, f"{NAME}_shakespeare")
text_deltas = pd.concat([stats.paired_differences(text_runs[(text_runs.run == "dense") | (text_runs.k_fraction == k)],
                                                  "val_loss", baseline="dense", by="run", pair="seed").assign(k_fraction=k)
                         for k in text_fractions], ignore_index=True)
stats.summarize(text_deltas, "difference", ["k_fraction"]).round(4)  # Δ validation loss vs dense (nats)

# %% [markdown]
# ## 3. Backward time and step time vs k
#
# The backward pass alone (the forward is identical in every variant), and a whole training step
# (forward, backward, AdamW — whose update stays dense), of a square Linear layer and of the digits
# MLP, each timed `timing_repeats` times, in rounds of a few passes that take dense and every
# variant in turn (each round after a warm-up pass; a first, untimed round warms the process up). A
# variant's time is stated as a ratio to dense's, measured in the same run: the median of the ratios
# over every pair of repeats (variant repeat ÷ dense repeat), with their quartiles, so the spread of
# both shows (`qlab.sparse.time_ratios`). By construction hook masking still runs the full GEMMs and
# adds a top-k selection on top; the gathered GEMMs shrink both backward GEMMs to k of the M output
# features and add one top-k over the column sums of |dy|; the sparse variant multiplies through
# torch.sparse.

# %%
torch.manual_seed(0)
timing_models = {
    f"Linear {timing_width}×{timing_width}": (nn.Linear(timing_width, timing_width), timing_width, timing_width, []),
    f"digits MLP 64-{hidden}-{hidden}-10": (nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                                          nn.ReLU(), nn.Linear(hidden, 10)), 64, 10, ["4"]),
}
ROUND = 3  # passes per call: each point is timed in rounds, every round times dense and every variant in turn,
# so a slow spell of a shared machine falls on the variants and on dense alike
rounds = [min(ROUND, timing_repeats - start) for start in range(0, timing_repeats, ROUND)]
variants = [("dense", 1.0)] + [(v, k) for k in fractions for v in BACKWARDS[1:]]
passes = {}
for label, timed, size in session.progress([(label, timed, size) for label in timing_models
                                            for timed in ("backward", "step") for size in [0] + rounds], desc="timing"):
    model, inputs, outputs, keep = timing_models[label]
    model = model.to(device)
    for variant, k in variants:
        x = torch.randn(timing_tokens, inputs, device=device, requires_grad=True)
        dy = torch.randn(timing_tokens, outputs, device=device)
        seconds = pass_seconds(model, x, dy, variant, k, keep=keep, repeats=max(size, 1), timed=timed)
        if size:  # round 0 is a warm-up, discarded: a process's first passes can be slower by orders of magnitude
            passes.setdefault((label, timed, variant, k), []).extend(seconds)
timing_rows = []
for (label, timed, variant, k), seconds in passes.items():
    ms = 1e3 * np.array(seconds)
    ratio = time_ratios(seconds, passes[label, timed, "dense", 1.0])
    timing_rows.append({"model": label, "timed": timed, "backward": variant, "k_fraction": k,
                        "ms": np.median(ms), "ms_q25": np.quantile(ms, 0.25), "ms_q75": np.quantile(ms, 0.75),
                        "repeats": len(seconds), "ratio_to_dense": ratio["ratio"], "ratio_q25": ratio["q25"],
                        "ratio_q75": ratio["q75"]})
timing = pd.DataFrame(timing_rows)
save_csv(timing, f"{NAME}_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
timing.pivot_table(index=["model", "timed", "k_fraction"], columns="backward", values="ratio_to_dense").round(2)

# %%
fig, axes = subplots(2, len(timing_models), width="text", aspect=0.6, squeeze=False, sharex=True)
for column, label in enumerate(timing_models):
    for row, timed in enumerate(("backward", "step")):
        ax = axes[row][column]
        part = timing[(timing.model == label) & (timing.timed == timed) & (timing.backward != "dense")]
        for i, variant in enumerate(BACKWARDS[1:]):
            series = part[part.backward == variant]
            ax.errorbar(series.k_fraction, series.ratio_to_dense,
                        yerr=[series.ratio_to_dense - series.ratio_q25, series.ratio_q75 - series.ratio_to_dense],
                        marker="o", markersize=3, capsize=1.5, color=f"C{i}", label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8, label="dense")
        k_axis(ax, fractions)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5: readable
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.05, 0.5, 20: no padding
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label}: {'backward' if timed == 'backward' else 'whole step'}", fontsize=7)
        if row == 1:
            ax.set_xlabel("k / output features")
    axes[0][0].set_ylabel("backward / dense")
    axes[1][0].set_ylabel("step / dense")
handles, labels = axes[0][0].get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.06))
fig.suptitle(f"Time ÷ dense: median and quartiles of the ratios of {timing_repeats} × {timing_repeats} pairs "
             f"of repeats, {timing_tokens} rows, {device}", fontsize=8)
save_figure(fig, f"{NAME}_timing")

# %% [markdown]
# ## 4. How many weights actually change per step?
#
# meProp's premise is that only k rows of each W get updated. That holds for plain SGD without
# weight decay; an optimizer with state (AdamW's moments) moves every weight whose moments are
# non-zero, whatever this step's gradient. Per step: the fraction of Linear weight entries with a
# non-zero gradient, and the fraction the optimizer step changed (`track_updates`). The output layer
# is dense in every run. One run per optimizer and k (seed 0, split 0): single observations.

# %%
FOOTPRINT_K = [0.05, 0.16]  # top-k runs of this section (and dense)
footprint_points = [(optimizer, lr, k) for optimizer, lr in [("adamw", 3e-3), ("sgd", 0.1)] for k in [None] + FOOTPRINT_K]
footprint_results = run_many([digits.replace(topk=k, optimizer=optimizer, lr=lr, track_updates=True)
                              for optimizer, lr, k in footprint_points], executor=executor,
                             max_workers=max_workers or None, desc="update-footprint runs")
footprint_rows = []
for (optimizer, _, k), result in zip(footprint_points, footprint_results):
    steps_frame = result.metrics[["step", "grad_nonzero_fraction", "updated_fraction"]]
    footprint_rows.append(steps_frame.assign(optimizer=optimizer, k_fraction=1.0 if k is None else k, dense=k is None))
footprint = pd.concat(footprint_rows, ignore_index=True)
save_csv(footprint, f"{NAME}_updates")
late = footprint[footprint.step > digits_steps // 2]
late_means = late.groupby(["optimizer", "k_fraction"])[["grad_nonzero_fraction", "updated_fraction"]].mean()
late_means.round(3)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.7, sharey=True, squeeze=False)
for ax, optimizer in zip(axes[0], ["adamw", "sgd"]):
    for i, (_k, part) in enumerate(footprint[footprint.optimizer == optimizer].groupby("k_fraction")):
        ax.plot(part.step, part.updated_fraction, color=f"C{i}")
        ax.plot(part.step, part.grad_nonzero_fraction, color=f"C{i}", linestyle=":")
    ax.set_title(optimizer)
    ax.set_xlabel("step")
axes[0][0].set_ylabel("fraction of Linear weights")
ks = sorted(footprint.k_fraction.unique())
legend = [matplotlib.lines.Line2D([], [], color=f"C{i}", label="dense" if k == 1.0 else f"k = {pct(k)}")
          for i, k in enumerate(ks)]
legend += [matplotlib.lines.Line2D([], [], color="black", label="moved by the step"),
           matplotlib.lines.Line2D([], [], color="black", linestyle=":", label="non-zero gradient")]
fig.legend(handles=legend, loc="lower center", ncol=len(legend), bbox_to_anchor=(0.5, -0.08))
fig.suptitle("Weights with a gradient vs weights the optimizer moved (solid over dotted where they agree)")
save_figure(fig, f"{NAME}_updates")

# %% [markdown]
# ## 5. Conclusions
#
# Every number and verdict below is computed in the next cells from this run's results. Accuracy and
# loss claims are saved to `data/05_topk_sparse_backprop_claims.csv` (the README's findings table
# is generated from that file); the timing observations, which change from run to run, to
# `data/05_topk_sparse_backprop_claims_timing.csv`. A top-k run is paired with the dense run of the
# same seed (paired t over the seeds); Holm's correction runs over the k values of each mode; "no
# difference" is claimed only through TOST within `margin`; a difference that is not resolved is
# reported with the effect these seeds could have detected.

# %%
claims = Claims(this_run)
claims.mean("digits.dense", dense_runs.sort_values("seed").val_accuracy_percent, unit="%", digits=2,
            text=f"dense digits validation accuracy (seed s on split s, {seeds} seeds)")
digits_keys = {}
for mode in MODES:
    digits_keys[mode] = []
    for k in fractions:
        differences = digits_deltas[(digits_deltas["mode"] == mode) & (digits_deltas.k_fraction == k)].sort_values("seed")
        key = f"digits.{mode}.{k:g}"
        claims.paired(key, differences.points, text=f"{mode}, k = {pct(k)}: accuracy − dense", family=f"digits.{mode}",
                      unit="points", digits=2, margin=margin)
        digits_keys[mode] += [key, f"{key}.same"]
    claims.holm(f"digits.{mode}")
    paired_keys = digits_keys[mode][::2]
    claims.tally(f"digits.{mode}.lower", paired_keys, direction="lower", headline=True,
                 text=f"k values (of {len(fractions)}) at which the {mode} index set lowers digits accuracy")
    claims.tally(f"digits.{mode}.higher", paired_keys, direction="higher",
                 text=f"k values (of {len(fractions)}) at which the {mode} index set raises digits accuracy")

claims.mean("text.dense", text_runs[text_runs.run == "dense"].sort_values("seed").val_loss, unit="nats/char",
            digits=3, text=f"dense CharGPT validation loss after {text_steps} steps ({text_seeds} seeds)")
text_keys = []
for k in text_fractions:
    differences = text_deltas[text_deltas.k_fraction == k].sort_values("seed").difference
    claims.paired(f"text.{k:g}", differences, text=f"CharGPT, k = {pct(k)}: validation loss − dense", family="text",
                  unit="nats", digits=3, margin=text_margin)
    text_keys.append(f"text.{k:g}")
claims.holm("text")
claims.tally("text.higher", text_keys, direction="higher", headline=True,
             text=f"k values (of {len(text_fractions)}) at which top-k raises the CharGPT's validation loss")

for (optimizer, k), row in late_means.iterrows():
    if k == 1.0:
        continue
    for column, what in (("grad_nonzero_fraction", "with a non-zero gradient"), ("updated_fraction", "moved")):
        claims.value(f"updates.{optimizer}.{k:g}.{'grad' if column.startswith('grad') else 'moved'}", 100 * row[column],
                     test="observed", digits=1, unit="%",
                     text=f"{optimizer}, k = {pct(k)}: Linear weights {what} per step, mean of the second half")
sgd_sparse = footprint[(footprint.optimizer == "sgd") & ~footprint.dense]
claims.value("updates.sgd.gap", 100 * (sgd_sparse.updated_fraction - sgd_sparse.grad_nonzero_fraction).abs().max(),
             test="observed", digits=3, unit="points",
             text="SGD: largest per-step difference between weights moved and weights with a gradient, top-k runs")
claims.save()

# the timing ratios change from run to run: their own file (named *_timing), never the claims file above
timing_claims = Claims(this_run)
MODEL_KEYS = dict(zip(timing_models, ("linear", "mlp")))
k_low, k_high = min(fractions), max(fractions)
for label, model_key in MODEL_KEYS.items():
    for timed in ("backward", "step"):
        part = timing[(timing.model == label) & (timing.timed == timed)].set_index(["backward", "k_fraction"])
        prefix = f"time.{model_key}.{timed}"
        for k in (k_low, k_high):
            row = part.loc[("gathered", k)]
            for suffix, column, what in (("", "ratio_to_dense", "median"), (".q25", "ratio_q25", "lower quartile"),
                                         (".q75", "ratio_q75", "upper quartile")):
                timing_claims.value(f"{prefix}.gathered.{k:g}{suffix}", row[column], test="observed", digits=2,
                                    text=f"{label}, {timed}, gathered at k = {pct(k)}: time ÷ dense ({what} of "
                                         "the ratios over pairs of repeats)")
        hook = part.loc["hook_mask"].ratio_to_dense
        timing_claims.value(f"{prefix}.hook.low", hook.min(), test="observed", digits=2,
                            text=f"{label}, {timed}, hook_mask: lowest median time ÷ dense over k")
        timing_claims.value(f"{prefix}.hook.high", hook.max(), test="observed", digits=2,
                            text=f"{label}, {timed}, hook_mask: highest median time ÷ dense over k")
        faster = part.loc["sparse_rows"].ratio_to_dense < 1
        timing_claims.value(f"{prefix}.sparse.faster", int(faster.sum()), test="observed", digits=0,
                            text=f"{label}, {timed}: k values (of {len(fractions)}) at which sparse_rows' median "
                                 "time ÷ dense is below one")
save_csv(timing_claims.frame(), f"{NAME}_claims_timing")

save_metrics(NAME, seeds=seeds, dense_accuracy_percent=claims["digits.dense"].value,
             **{f"{mode}_k_lower": int(claims[f"digits.{mode}.lower"].value) for mode in MODES},
             **{f"{mode}_k_equivalent": int(claims[f"digits.{mode}.lower"].equivalent) for mode in MODES},
             text_k_higher=int(claims["text.higher"].value))

# %%
display(Markdown(claims.render(f"""
**Digits accuracy.** Dense reaches {{digits.dense}} ({{digits.dense:verdict}}; seed s trains and
validates on split s). Against the dense run of the same seed:

- the **shared** index set (one set of k features per batch, gathered GEMMs) lowers accuracy at
  {{digits.shared.lower:value}} and raises it at {{digits.shared.higher:value}} of the {len(fractions)} k values
  ({{digits.shared.lower:verdict}});
- **per-example** index sets (`topk_mode="row"`, meProp's own setting) lower it at
  {{digits.row.lower:value}} and raise it at {{digits.row.higher:value}} ({{digits.row.lower:verdict}}).

A k value that is neither lower nor shown within the margin is not settled by these seeds: its row
below gives the effect they could have detected. Each k, paired t and TOST:
""") + "\n" + claims.table(digits_keys["shared"]) + "\n\n" + claims.table(digits_keys["row"])))

# %%
display(Markdown(claims.render(f"""
**The character model.** Dense ends at {{text.dense}} ({{text.dense:verdict}}). Top-k raises the
validation loss at {{text.higher:value}} of the {len(text_fractions)} k values ({{text.higher:verdict}}):
""") + "\n" + claims.table(text_keys)))

# %%
sgd_grad, sgd_moved = (f"{{updates.sgd.{FOOTPRINT_K[0]:g}.{what}:value}}" for what in ("grad", "moved"))
adamw = {k: [f"{{updates.adamw.{k:g}.{what}:value}}" for what in ("grad", "moved")] for k in FOOTPRINT_K}
adamw_moves_more = all(claims[f"updates.adamw.{k:g}.moved"].value > claims[f"updates.adamw.{k:g}.grad"].value
                       for k in FOOTPRINT_K)
display(Markdown(claims.render(f"""
**Which weights move.** Per step, averaged over the second half of one run per optimizer and k (a
single observation each): with plain SGD and no weight decay, {sgd_grad} % of the Linear weights have
a non-zero gradient at k = {pct(FOOTPRINT_K[0])} and {sgd_moved} % move; over every step of both
top-k runs the two fractions differ by at most {{updates.sgd.gap:value}} points. With AdamW,
{adamw[FOOTPRINT_K[0]][0]} % have a gradient and {adamw[FOOTPRINT_K[0]][1]} % move at k = {pct(FOOTPRINT_K[0])};
{adamw[FOOTPRINT_K[-1]][0]} % and {adamw[FOOTPRINT_K[-1]][1]} % at k = {pct(FOOTPRINT_K[-1])}.
""" + ("""AdamW moves more weights than have a gradient (its update is built from its moments, which
can carry earlier steps' gradients; the moments themselves are not measured here), so meProp's "only
k rows are updated" describes SGD here, not AdamW.""" if adamw_moves_more else ""))))

# %%
lines = []
for label, m in MODEL_KEYS.items():
    parts = []
    for timed, what in (("backward", "backward"), ("step", "whole step")):
        g = f"time.{m}.{timed}.gathered"
        parts.append(
            f"{what}: hook masking {{time.{m}.{timed}.hook.low:value}}–{{time.{m}.{timed}.hook.high:value}} × "
            f"dense over the k values; gathered {{{g}.{k_low:g}:value}} ({{{g}.{k_low:g}.q25:value}}–"
            f"{{{g}.{k_low:g}.q75:value}}) at k = {pct(k_low)} and {{{g}.{k_high:g}:value}} "
            f"({{{g}.{k_high:g}.q25:value}}–{{{g}.{k_high:g}.q75:value}}) at k = {pct(k_high)}; sparse rows below "
            f"dense at {{time.{m}.{timed}.sparse.faster:value}} of the {len(fractions)} k values")
    lines.append(f"- **{label}** — " + "; ".join(parts) + ".")
display(Markdown(timing_claims.render(
    f"""
**Time**, as a ratio to dense measured in this run ({timing_tokens} rows, {device}; median of the
ratios over every pair of the {timing_repeats} repeats, quartiles in brackets). These are single
observations of one run on one machine: the quartiles show the spread within the run, not how much
another run would differ.

""" + "\n".join(lines))))
