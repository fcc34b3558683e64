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
# A forum question (seeds/004) asks how to keep only the top-k gradient entries at each node of
# the backward pass — first to see how a model trains that way, then whether it is faster — and
# is told that masking may not be faster at all. meProp (Sun et al., ICML 2017; REFERENCE §7) keeps
# the top-k entries of each Linear layer's output gradient and reports, for an MNIST MLP with 500
# hidden units and k = 80, 98.27 % accuracy against 98.20 % dense and a 5.9× faster backward on CPU.
#
# `qlab.sparse` implements three ways to do it, with the same gradients and different costs:
#
# - **hook_mask** — a backward pre-hook zeroes all but the top-k entries of dy; the GEMMs keep their size;
# - **gathered** — `TopKLinear`, one index set of k output features shared by the batch: smaller dense
#   GEMMs, dx = dy[:, idx]·W[idx, :] and only rows idx of dW;
# - **sparse_rows** — `TopKLinear(mode="row")`, each row its own k entries, multiplied as a sparse tensor.
#
# This notebook measures (1) accuracy on scikit-learn's digits vs k over several seeds, for the shared
# index set and for meProp's own per-example top-k (`topk_mode="row"`), with meProp's MNIST numbers
# beside ours as a reference point, not a claim of equality (8×8 digits are not MNIST); (2) validation
# loss of the Shakespeare character model vs k over seeds; (3) backward time and end-to-end step time
# vs k for every variant (medians and quartiles over repeats); (4) what fraction of the weights
# actually change per step. Differences are paired against the dense run of the same seed, with 95 %
# Student-t intervals (`qlab.stats`).

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 30 s)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (10 seeds, 3000 steps, a 1.0M-parameter CharGPT: a GPU)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 5  # independent digits runs per k and mode
fractions: list[float] = [0.01, 0.02, 0.05, 0.1, 0.16, 0.25, 0.5]  # k as a fraction of each layer's outputs
hidden: int = 500  # hidden width of the digits MLP (two hidden layers; meProp's MNIST width)
digits_steps: int = 300  # optimizer steps per digits run
text_steps: int = 200  # optimizer steps per Shakespeare run
text_fractions: list[float] = [0.05, 0.16, 0.5]  # k for the Shakespeare model
text_seeds: int = 3  # Shakespeare runs per k
timing_tokens: int = 512  # rows of x and dy in the timing
timing_width: int = 2048  # width of the square Linear layer timed
timing_repeats: int = 15  # passes timed per point (median and quartiles)
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import numpy as np
import pandas as pd
import torch
from matplotlib.ticker import (
    FixedLocator,
    LogLocator,
    NullFormatter,
    NullLocator,
    PercentFormatter,
    ScalarFormatter,
)
from torch import nn

from qlab import session, stats
from qlab.plotting import mean_band, save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics
from qlab.runs import run_many
from qlab.sparse import BACKWARDS, pass_seconds


def k_axis(ax, ticks):
    """A log x axis labelled with the k fractions as percentages (no minor labels)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.xaxis.set_minor_locator(NullLocator())
from qlab.train import TrainConfig, train

NAME = "05_topk_sparse_backprop"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if profile == "paper":  # 10 digits seeds × 3000 steps; the 1.0M-parameter CharGPT, 3000 steps, 5 seeds
    seeds, digits_steps, text_steps, text_seeds = max(seeds, 10), 3000, 3000, max(text_seeds, 5)
    timing_tokens, timing_width, timing_repeats = 4096, 4096, 31
if smoke:
    seeds, fractions, hidden, digits_steps, text_steps, text_fractions = 2, [0.05, 0.5], 32, 8, 4, [0.25]
    text_seeds, timing_tokens, timing_width, timing_repeats = 1, 32, 64, 2
use_paper_style()
MEPROP = {"k": 80, "hidden": 500, "sparse_accuracy": 0.9827, "dense_accuracy": 0.9820, "backprop_speedup": 5.9}
digits = TrainConfig(task="digits", hidden=[hidden, hidden], steps=digits_steps, batch_size=64, lr=3e-3,
                     warmup_steps=min(10, digits_steps), eval_every=digits_steps, weight_decay=0.0, device=device,
                     progress=False)
print(f"digits MLP 64 → {hidden} → {hidden} → 10, k ∈ {fractions} of each hidden layer's outputs, {seeds} seeds")

# %% [markdown]
# ## 1. Accuracy vs k on digits
#
# Top-k on both hidden layers' output gradients (the 10-way output layer stays dense,
# `topk_keep=["last_layer"]`), AdamW, the same batches and initial weights per seed for every k and
# mode: "shared" (one index set per batch, gathered GEMMs) and "row" (each example its own k, as
# meProp's per-example result).

# %%
MODES = ("shared", "row")
runs = [(seed, None, "dense") for seed in range(seeds)]
runs += [(seed, k, mode) for seed in range(seeds) for mode in MODES for k in fractions]
rows = []
configs = [digits.replace(seed=seed) if k is None else digits.replace(topk=k, topk_mode=mode, seed=seed)
           for seed, k, mode in runs]
for (seed, k, mode), result in zip(runs, run_many(configs, executor=executor, max_workers=max_workers or None,
                                                  desc="digits runs")):
    last = result.metrics.iloc[-1]
    rows.append({"mode": mode, "k_fraction": 1.0 if k is None else k, "seed": seed,
                 "val_accuracy": last.val_accuracy, "val_loss": last.val_loss})
accuracy = pd.DataFrame(rows)
save_csv(accuracy, f"{NAME}_digits")
dense_mean, dense_low, dense_high = stats.mean_interval(accuracy[accuracy["mode"] == "dense"].val_accuracy)
# Δ accuracy against the dense run of the same seed, per (mode, k): mean and 95 % interval over seeds
paired = [
    stats.paired_differences(accuracy[(accuracy["mode"] == "dense") | (accuracy.k_fraction == k)], "val_accuracy",
                             baseline="dense", by="mode", pair="seed").assign(k_fraction=k)
    for k in fractions
]
gaps = stats.summarize(pd.concat(paired, ignore_index=True), "difference", ["mode", "k_fraction"])
gaps.round(4)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.45)
sparse_runs = accuracy[accuracy["mode"] != "dense"]
mean_band(axes[0], sparse_runs, "k_fraction", "val_accuracy", by="mode", marker="o", markersize=3)
axes[0].axhspan(dense_low, dense_high, color="black", alpha=0.12, linewidth=0)
axes[0].axhline(dense_mean, color="black", linewidth=0.8, label=f"dense {dense_mean:.3f}")
axes[0].plot([MEPROP["k"] / MEPROP["hidden"]], [MEPROP["sparse_accuracy"]], marker="*", color="C3",
             linestyle="none", markersize=7, label="meProp MNIST, row (published)")
axes[0].set_ylabel("validation accuracy")
axes[0].set_title(f"Digits accuracy, mean and 95 % band over {seeds} seeds", fontsize=7)
digits_deltas = pd.concat(paired, ignore_index=True).assign(accuracy_points=lambda f: 100 * f.difference)
mean_band(axes[1], digits_deltas, "k_fraction", "accuracy_points", by="mode", marker="o", markersize=3)
axes[1].axhline(0.0, color="black", linewidth=0.8)
axes[1].axhline(-1.0, color="grey", linewidth=0.8, linestyle=":")
axes[1].set_ylabel("Δ accuracy vs dense (points)")
axes[1].set_title("Paired with the dense run; dotted: one point", fontsize=7)
for ax in axes:
    k_axis(ax, fractions)
    ax.set_xlabel("k / hidden width")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, fontsize=6, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.08))
save_figure(fig, f"{NAME}_digits")

# %% [markdown]
# ## 2. The Shakespeare character model
#
# The training notebook's small CharGPT (2 blocks, width 64), top-k on every Linear except the
# head, one seed per k. Validation loss on the held-out plays against the dense run.

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
text_gaps = stats.summarize(
    pd.concat([stats.paired_differences(text_runs[(text_runs.run == "dense") | (text_runs.k_fraction == k)],
                                        "val_loss", baseline="dense", by="run", pair="seed").assign(k_fraction=k)
               for k in text_fractions], ignore_index=True),
    "difference", ["k_fraction"])
text_gaps.round(4)  # Δ validation loss vs dense (nats), mean and 95 % interval over text_seeds

# %% [markdown]
# ## 3. Backward time and step time vs k
#
# The backward pass alone (the forward is identical in every variant), and a whole training step
# (forward, backward, AdamW — whose update stays dense), of a square Linear layer and of the digits
# MLP: median and quartiles of `timing_repeats` passes after a warm-up. Hook masking still runs the
# full GEMMs and adds a top-k selection on top: it cannot be faster than dense. The gathered GEMMs
# shrink both backward GEMMs by k/M and pay one top-k over the column sums of |dy|. The sparse
# variant pays torch.sparse's overheads.

# %%
torch.manual_seed(0)
timing_models = {
    f"Linear {timing_width}×{timing_width}": (nn.Linear(timing_width, timing_width), timing_width, timing_width, []),
    f"digits MLP 64-{hidden}-{hidden}-10": (nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                                          nn.ReLU(), nn.Linear(hidden, 10)), 64, 10, ["4"]),
}
timing_rows = []
points = [(label, timed, variant, k) for label in timing_models for timed in ("backward", "step")
          for variant, k in [("dense", 1.0)] + [(v, k) for k in fractions for v in BACKWARDS[1:]]]
for label, timed, variant, k in session.progress(points, desc="timing"):
    model, inputs, outputs, keep = timing_models[label]
    model = model.to(device)
    x = torch.randn(timing_tokens, inputs, device=device, requires_grad=True)
    dy = torch.randn(timing_tokens, outputs, device=device)
    seconds = 1e3 * np.array(pass_seconds(model, x, dy, variant, k, keep=keep, repeats=timing_repeats, timed=timed))
    timing_rows.append({"model": label, "timed": timed, "backward": variant, "k_fraction": k,
                        "ms": np.median(seconds), "ms_q25": np.quantile(seconds, 0.25),
                        "ms_q75": np.quantile(seconds, 0.75), "repeats": timing_repeats})
timing = pd.DataFrame(timing_rows)
dense_ms = timing[timing.backward == "dense"].set_index(["model", "timed"]).ms
for column in ("ms", "ms_q25", "ms_q75"):  # quartiles over the dense median: the spread of the numerator
    timing[column.replace("ms", "ratio_to_dense")] = timing[column] / dense_ms.loc[
        list(zip(timing.model, timing.timed))].to_numpy()
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
                        yerr=[series.ratio_to_dense - series.ratio_to_dense_q25,
                              series.ratio_to_dense_q75 - series.ratio_to_dense],
                        marker="o", markersize=3, capsize=1.5, color=f"C{i}", label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8, label="dense")
        k_axis(ax, fractions)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5: readable
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label}: {'backward' if timed == 'backward' else 'whole step'}", fontsize=7)
        if row == 1:
            ax.set_xlabel("k / output features")
    axes[0][0].set_ylabel("backward / dense")
    axes[1][0].set_ylabel("step / dense")
axes[0][-1].legend(fontsize=5, loc="center left", bbox_to_anchor=(1.02, 0.5))
fig.suptitle(f"Time against dense: median and quartiles of {timing_repeats}, {timing_tokens} rows, {device}")
save_figure(fig, f"{NAME}_timing")

# %% [markdown]
# ## 4. How many weights actually change per step?
#
# meProp's premise is that only k rows of each W get updated. That holds for plain SGD; an
# optimizer with state (AdamW's moments) keeps moving every row it has ever seen a gradient for.
# Per step: the fraction of Linear weight entries with a non-zero gradient, and the fraction the
# optimizer step changed (`track_updates`). The output layer is dense in every run.

# %%
footprint_rows = []
for optimizer, lr in [("adamw", 3e-3), ("sgd", 0.1)]:
    for k in [None, 0.05, 0.16]:
        result = train(digits.replace(topk=k, optimizer=optimizer, lr=lr, track_updates=True))
        steps_frame = result.metrics[["step", "grad_nonzero_fraction", "updated_fraction"]]
        footprint_rows.append(steps_frame.assign(optimizer=optimizer, k_fraction=1.0 if k is None else k,
                                                 dense=k is None))
footprint = pd.concat(footprint_rows, ignore_index=True)
save_csv(footprint, f"{NAME}_updates")
late = footprint[footprint.step > digits_steps // 2]
late.groupby(["optimizer", "k_fraction"])[["grad_nonzero_fraction", "updated_fraction"]].mean().round(3)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.7, sharey=True, squeeze=False)
for ax, optimizer in zip(axes[0], ["adamw", "sgd"]):
    for i, (k, part) in enumerate(footprint[footprint.optimizer == optimizer].groupby("k_fraction")):
        ax.plot(part.step, part.updated_fraction, color=f"C{i}", label=f"moved, k={k:g}")
        ax.plot(part.step, part.grad_nonzero_fraction, color=f"C{i}", linestyle=":", label=f"non-zero grad, k={k:g}")
    ax.set_title(optimizer)
    ax.set_xlabel("step")
axes[0][0].set_ylabel("fraction of Linear weights")
axes[0][-1].legend(fontsize=5)
fig.suptitle("Weights with a gradient vs weights the optimizer moved")
save_figure(fig, f"{NAME}_updates")

# %%
# the smallest k whose whole 95 % interval of Δ accuracy lies within one point of dense, per mode
within_1pt = {mode: min(part.k_fraction[part.low >= -0.01], default=None) for mode, part in gaps.groupby("mode")}
at_meprop = gaps.set_index(["mode", "k_fraction"])
save_metrics(NAME, dense_accuracy=dense_mean, seeds=seeds,
             gap_at_meprop_k_shared=at_meprop["mean"].get(("shared", 0.16), float("nan")),
             gap_at_meprop_k_row=at_meprop["mean"].get(("row", 0.16), float("nan")),
             smallest_k_within_1pt_shared=within_1pt.get("shared"), smallest_k_within_1pt_row=within_1pt.get("row"))
