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
# This notebook measures (1) accuracy on scikit-learn's digits vs k over several seeds, with
# meProp's MNIST numbers beside ours as a reference point, not a claim of equality (8×8 digits are
# not MNIST); (2) validation loss of the Shakespeare character model vs k; (3) backward time vs k
# for every variant; (4) what fraction of the weights actually change per step.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 30 s)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 3  # independent digits runs per k
fractions: list[float] = [0.01, 0.02, 0.05, 0.1, 0.16, 0.25, 0.5]  # k as a fraction of each layer's outputs
hidden: int = 500  # hidden width of the digits MLP (two hidden layers; meProp's MNIST width)
digits_steps: int = 300  # optimizer steps per digits run
text_steps: int = 200  # optimizer steps per Shakespeare run
text_fractions: list[float] = [0.05, 0.16, 0.5]  # k for the Shakespeare model
timing_tokens: int = 512  # rows of x and dy in the timing
timing_width: int = 2048  # width of the square Linear layer timed
timing_repeats: int = 5  # backward passes timed per point (median)

# %%
import pandas as pd
import torch
from torch import nn

from qlab import session
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics
from qlab.sparse import BACKWARDS, backward_seconds
from qlab.train import TrainConfig, train

NAME = "05_topk_sparse_backprop"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    seeds, fractions, hidden, digits_steps, text_steps, text_fractions = 1, [0.05, 0.5], 32, 8, 4, [0.25]
    timing_tokens, timing_width, timing_repeats = 32, 64, 2
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
# `topk_keep=["last_layer"]`), shared index set (gathered GEMMs), AdamW, the same batches and
# initial weights per seed for every k.

# %%
rows = []
for seed, k in session.progress([(seed, k) for seed in range(seeds) for k in [None] + fractions], desc="digits runs"):
    result = train(digits.replace(topk=k, seed=seed))
    last = result.metrics.iloc[-1]
    rows.append({"k_fraction": 1.0 if k is None else k, "dense": k is None, "seed": seed,
                 "val_accuracy": last.val_accuracy, "val_loss": last.val_loss})
accuracy = pd.DataFrame(rows)
save_csv(accuracy, f"{NAME}_digits")
accuracy_table = accuracy.groupby(["dense", "k_fraction"]).val_accuracy.agg(["mean", "min", "max"])
accuracy_table.round(4)

# %%
fig, ax = subplots(width="column", aspect=0.75)
sparse_rows = accuracy[~accuracy.dense].groupby("k_fraction").val_accuracy.agg(["mean", "min", "max"])
ax.errorbar(sparse_rows.index, sparse_rows["mean"], yerr=[sparse_rows["mean"] - sparse_rows["min"],
            sparse_rows["max"] - sparse_rows["mean"]], marker="o", markersize=3, capsize=2, label="top-k, digits (ours)")
dense_mean = accuracy[accuracy.dense].val_accuracy.mean()
ax.axhline(dense_mean, color="black", linewidth=0.8, label=f"dense, digits (ours) {dense_mean:.3f}")
ax.plot([MEPROP["k"] / MEPROP["hidden"]], [MEPROP["sparse_accuracy"]], marker="*", color="C3", linestyle="none",
        markersize=7, label="meProp MNIST k=80/500 (published)")
ax.axhline(MEPROP["dense_accuracy"], color="C3", linewidth=0.8, linestyle=":", label="meProp MNIST dense (published)")
ax.set_xscale("log")
ax.set_xlabel("k / hidden width")
ax.set_ylabel("validation accuracy")
ax.set_title("Accuracy vs k (min–max over seeds)")
ax.legend(fontsize=5)
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
if smoke:
    text = text.replace(layers=1, width=32, context=32, batch_size=8, eval_batches=1)
text_rows = []
for k in session.progress([None] + text_fractions, desc="Shakespeare runs"):
    result = train(text.replace(topk=k))
    text_rows.append({"k_fraction": 1.0 if k is None else k, "dense": k is None,
                      "val_loss": result.metrics.val_loss.iloc[-1]})
text_table = pd.DataFrame(text_rows)
text_table["gap_to_dense"] = text_table.val_loss - text_table.loc[text_table.dense, "val_loss"].iloc[0]
save_csv(text_table, f"{NAME}_shakespeare")
text_table.round(4)

# %% [markdown]
# ## 3. Backward time vs k
#
# The backward pass alone (the forward is identical in every variant) of a square Linear layer
# and of the digits MLP, median of `timing_repeats` after a warm-up. Hook masking still runs the
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
for label, (model, inputs, outputs, keep) in session.progress(timing_models.items(), total=len(timing_models),
                                                              desc="timing"):
    model = model.to(device)
    x = torch.randn(timing_tokens, inputs, device=device, requires_grad=True)
    dy = torch.randn(timing_tokens, outputs, device=device)
    dense_seconds = backward_seconds(model, x, dy, "dense", 1.0, repeats=timing_repeats)
    timing_rows.append({"model": label, "backward": "dense", "k_fraction": 1.0, "ms": 1e3 * dense_seconds,
                        "ratio_to_dense": 1.0})
    for k in fractions:
        for variant in BACKWARDS[1:]:
            seconds = backward_seconds(model, x, dy, variant, k, keep=keep, repeats=timing_repeats)
            timing_rows.append({"model": label, "backward": variant, "k_fraction": k, "ms": 1e3 * seconds,
                                "ratio_to_dense": seconds / dense_seconds})
timing = pd.DataFrame(timing_rows)
save_csv(timing, f"{NAME}_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
timing.pivot_table(index=["model", "k_fraction"], columns="backward", values="ratio_to_dense").round(2)

# %%
fig, axes = subplots(1, len(timing_models), width="text", aspect=0.8, squeeze=False)
for ax, label in zip(axes[0], timing_models):
    part = timing[(timing.model == label) & (timing.backward != "dense")]
    for i, variant in enumerate(BACKWARDS[1:]):
        series = part[part.backward == variant]
        ax.plot(series.k_fraction, series.ratio_to_dense, marker="o", markersize=3, color=f"C{i}", label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8, label="dense")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("k / output features")
    ax.set_title(label)
axes[0][0].set_ylabel(f"backward time / dense ({device})")
axes[0][-1].legend(fontsize=5)
fig.suptitle(f"Where top-k saves time: {timing_tokens} rows, {device}")
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
mean_sparse_accuracy = accuracy[~accuracy.dense].groupby("k_fraction").val_accuracy.mean()
within_1pct = [k for k, a in mean_sparse_accuracy.items() if a >= dense_mean - 0.01]
save_metrics(NAME, dense_accuracy=dense_mean, accuracy_at_meprop_k=mean_sparse_accuracy.get(0.16, float("nan")),
             smallest_k_within_1pct=min(within_1pct, default=None))
