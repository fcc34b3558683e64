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
# # Which parts of a low-precision recipe matter
#
# A 4-bit training recipe is a bundle: NVIDIA's NVFP4 recipe (arXiv 2509.25149) combines 16×16
# weight blocks, stochastic rounding (SR) of gradients, a random Hadamard transform (RHT) on the
# wgrad operands and a few layers kept in BF16; the MXFP4 recipe of Tseng et al. (2025) runs the
# backward GEMMs in MXFP4 with SR and an RHT on the wgrad operands. Here each ingredient is switched
# off one at a time, and all together (`qlab.ablation`), and the FP8 family is compared (blockwise
# 1×128/128×128 scaling, per-tensor scaling, MXFP8 with 1-D and 32×32 weight blocks):
#
# 1. **GEMM-output error** of fprop (y = x·Wᵀ), dgrad (dx = dy·W) and wgrad (dW = dyᵀ·x) against
#    float64, on synthetic operands and on real operands captured from a trained CharGPT and from the
#    pretrained SmolLM2-135M (`qlab.models`; its massive `down_proj` activations, notebook 06) — the place
#    the RHT is meant to act (wgrad), which element SQNR (notebook 00) cannot show;
# 2. **what SR buys**: SR is unbiased, RNE is not — one SR draw errs more, the mean of many draws less;
# 3. **training**: validation loss of CharGPT trained with each variant, as the difference to FP32
#    with the same seed, mean and 95 % interval over seeds (`qlab.stats`), with the weight-gradient
#    fidelity to FP32 measured along the way.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 60 s)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (5 blocks × 128 wide, 3000 steps, 5 seeds: a GPU)
device: str = "auto"  # "auto", "cpu" or "cuda"
seeds: int = 3  # SR seeds / synthetic-operand seeds / training seeds (intervals need ≥ 2)
tokens: int = 512  # tokens of the synthetic operands (the wgrad reduction length)
features: int = 256  # input and output features of the synthetic operands
capture_steps: int = 150  # FP32 training steps before the real operands are captured
pretrained_model: str = "smollm2-135m"  # packaged model whose layers give a third set of operands ("" skips it)
pretrained_layers: list[str] = ["model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj", "model.layers.29.mlp.down_proj"]  # its Linears captured
pretrained_tokens: int = 128  # tokens per sequence (2 held-out sequences) for the pretrained model's step
sr_draws: int = 16  # SR draws averaged in section 2
train_variants: list[str] = ["nvfp4", "nvfp4/no 2D weight", "nvfp4/no SR", "nvfp4/no RHT", "nvfp4/+BF16 last block", "nvfp4/none", "mxfp4_training", "mxfp4_training/no SR", "mxfp4_training/no RHT", "mxfp4_training/none", "fp8_blockwise"]  # trained beside FP32: preset, preset/none|no SR|no RHT|no 2D weight, or preset/+BF16 last block
train_steps: int = 150  # optimizer steps per training run
layers: int = 2  # transformer blocks of CharGPT
width: int = 64  # embedding width
context: int = 64  # characters per sequence
batch_size: int = 16  # sequences per optimizer step
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import numpy as np
import pandas as pd
import torch

from qlab import ablation, models, session, stats
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.recipe import get_recipe
from qlab.results import save_csv, save_metrics
from qlab.runs import run_many
from qlab.train import TrainConfig, train
from qlab.train.data import shakespeare

NAME = "07_recipe_ablations"
device = session.start(NAME, globals()).device
if profile == "paper":  # the 1.0M-parameter CharGPT (5 blocks × 128), 3000 steps, 5 seeds
    seeds, train_steps, capture_steps, sr_draws = max(seeds, 5), 3000, 1000, 64
    layers, width, context, batch_size = 5, 128, 128, 32
if smoke:
    seeds, tokens, features, capture_steps, sr_draws, train_steps = 2, 64, 32, 2, 3, 2
    pretrained_layers, pretrained_tokens = pretrained_layers[:1], 16
    train_variants, layers, width, context, batch_size = ["nvfp4", "nvfp4/none"], 1, 32, 32, 8
use_paper_style()
torch.manual_seed(0)

FAMILIES = {
    "nvfp4": ablation.ablations("nvfp4"),
    "mxfp4_training": ablation.ablations("mxfp4_training"),
    "fp8": {name: get_recipe(name, backward_override=None)
            for name in ("fp8_tensorwise", "fp8_blockwise", "mxfp8", "mxfp8_2d")},
}
for family, variants in FAMILIES.items():
    print(f"{family}: {', '.join(variants)}")

# %% [markdown]
# ## 1. GEMM-output error
#
# One QuantLinear forward and backward per variant; each GEMM's output against the float64 product
# of the unquantized operands (relative Frobenius error). Synthetic operands (`seeds` draws): 4
# outlier activation channels (×20), weights of scale 1/√in, output gradients whose per-token size
# spreads over two decades. Real operands: every Linear of a CharGPT trained `capture_steps` steps in
# FP32, on one training batch (the tied head excluded), and `pretrained_layers` of the pretrained model
# on one held-out batch (the language-model loss). Each (variant, seed) runs with its own SR seed.

# %%
corpus = shakespeare()
base = TrainConfig(steps=capture_steps, layers=layers, width=width, heads=4, context=context, batch_size=batch_size,
                   lr=0.003, warmup_steps=max(1, capture_steps // 10), eval_every=max(1, capture_steps),
                   eval_batches=2, keep_high_precision=["head"], device="cpu", progress=False)
fp32_model = train(base).model
windows = torch.randint(0, len(corpus.train) - context - 1, (batch_size,), generator=torch.Generator().manual_seed(1))
ids = torch.stack([corpus.train[i : i + context] for i in windows.tolist()])
targets = torch.stack([corpus.train[i + 1 : i + context + 1] for i in windows.tolist()])


def one_step():
    logits = fp32_model(ids)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()


real = ablation.capture_operands(fp32_model, one_step, skip=("head",))
sources = {"CharGPT": real}
if pretrained_model:
    llm, tokenizer = models.load(pretrained_model)
    llm_batch = models.shakespeare_batches(tokenizer, 2, pretrained_tokens, 1, seed=0)[0]
    sources[pretrained_model] = ablation.capture_operands(
        llm, lambda: llm(input_ids=llm_batch, labels=llm_batch).loss.backward(), only=pretrained_layers)
    del llm
for source, layers_captured in sources.items():
    print(f"{source}: captured {len(layers_captured)} layers: {', '.join(layers_captured)}")

rows = []
for family, variants in FAMILIES.items():
    for variant, recipe in session.progress(list(variants.items()), desc=family):
        for seed in range(seeds):
            x, w, dy = ablation.synthetic_operands(tokens, features, features, seed=seed)
            errors = ablation.gemm_errors(recipe, x, w, dy, seed=seed)
            rows += [dict(family=family, variant=variant, operands="synthetic", layer="synthetic", seed=seed,
                          gemm=gemm, rel_error=value) for gemm, value in errors.items()]
            for source, layers_captured in sources.items():
                for layer, (x, w, dy) in layers_captured.items():
                    errors = ablation.gemm_errors(recipe, x, w, dy, seed=seed)
                    rows += [dict(family=family, variant=variant, operands=source, layer=layer, seed=seed,
                                  gemm=gemm, rel_error=value) for gemm, value in errors.items()]
gemm_errors = pd.DataFrame(rows)
save_csv(gemm_errors, f"{NAME}_gemm_errors")
per_seed = gemm_errors.groupby(["family", "variant", "operands", "gemm", "seed"], sort=False).rel_error.mean().reset_index()
gemm_summary = stats.summarize(per_seed, "rel_error", ["family", "variant", "operands", "gemm"])
save_csv(gemm_summary, f"{NAME}_gemm_summary")
gemm_summary.pivot_table(index=["family", "variant"], columns=["operands", "gemm"], values="mean", sort=False).round(4)

# %% [markdown]
# The figure: one row per family, one column per GEMM; bars are the mean over seeds (real operands:
# averaged over the captured layers first), whiskers the 95 % interval.

# %%
OPERAND_COLORS = {source: f"C{i}" for i, source in enumerate(["synthetic", *sources])}
fig, axes = subplots(len(FAMILIES), 3, width="text", aspect=1.0, squeeze=False, sharex="col")
for row, family in enumerate(FAMILIES):
    names = list(FAMILIES[family])
    for col, gemm in enumerate(ablation.GEMMS):
        ax = axes[row][col]
        for k, (operands, color) in enumerate(OPERAND_COLORS.items()):
            part = gemm_summary[(gemm_summary.family == family) & (gemm_summary.gemm == gemm)
                                & (gemm_summary.operands == operands)].set_index("variant").loc[names]
            height = 0.8 / len(OPERAND_COLORS)
            positions = np.arange(len(names)) + (k - (len(OPERAND_COLORS) - 1) / 2) * height
            error = np.vstack([part["mean"] - part["low"], part["high"] - part["mean"]])
            ax.barh(positions, part["mean"], height=height * 0.95, color=color, label=operands,
                    xerr=np.nan_to_num(error), error_kw=dict(linewidth=0.6, capsize=1.5))
        ax.set_yticks(np.arange(len(names)), names if col == 0 else [""] * len(names))
        ax.invert_yaxis()
        if row == 0:
            ax.set_title(gemm)
        if row == len(FAMILIES) - 1:
            ax.set_xlabel("relative error vs float64")
axes[0][-1].legend(fontsize=5, loc="lower right")
fig.suptitle(f"GEMM-output error per recipe variant (mean, 95 % interval over {seeds} seeds)")
save_figure(fig, f"{NAME}_gemm_error")

# %% [markdown]
# ## 2. What stochastic rounding buys: bias, not single-draw error
#
# One SR draw has a larger error than RNE (section 1: "no SR" errs less per GEMM). SR's point is
# that it is unbiased: the mean of `sr_draws` independent SR draws of the wgrad GEMM approaches the
# exact product, while RNE's error is the same every time. Real operands of the first captured
# layer; MXFP4 backward with RHT, SR on vs off.

# %%
layer_name = next(iter(real))
x, w, dy = real[layer_name]
sr_rows = []
for variant in ("mxfp4_training", "no SR"):
    recipe = FAMILIES["mxfp4_training"][variant]
    exact = dy.double().T @ x.double()
    total = torch.zeros_like(exact)
    for draw in range(sr_draws):
        total += ablation.gemm_outputs(recipe, x, w, dy, seed=1000 + draw)["wgrad"].double()
        mean_error = float(((total / (draw + 1)) - exact).norm() / exact.norm())
        sr_rows.append(dict(variant=variant, draws=draw + 1, wgrad_rel_error_of_mean=mean_error))
sr_bias = pd.DataFrame(sr_rows)
save_csv(sr_bias, f"{NAME}_sr_bias")
fig, ax = subplots()
for variant, part in sr_bias.groupby("variant", sort=False):
    ax.plot(part.draws, part.wgrad_rel_error_of_mean, marker="o", markersize=2, label=variant)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("draws averaged")
ax.set_ylabel("wgrad relative error of the mean")
ax.set_title(f"SR is unbiased: {layer_name}")
ax.legend(fontsize=6)
save_figure(fig, f"{NAME}_sr_bias")
sr_bias.groupby("variant").wgrad_rel_error_of_mean.agg(["first", "last"]).round(4)

# %% [markdown]
# ## 3. Training: validation loss relative to FP32
#
# CharGPT (the model of notebook 03) trained `train_steps` steps with each variant in
# `train_variants` ("preset/none" switches off every ingredient of `qlab.ablation.ablations(preset)`;
# "preset/+BF16 last block" keeps the last transformer block in high precision too, as NVIDIA's recipe
# keeps its last layers), the head always kept in high precision, and FP32 with the same seeds: same
# initial weights and batches per seed. Reported: the final validation loss minus FP32's with the same seed, mean and 95 % interval
# over seeds; and the weight-gradient fidelity (relative error of each quantized layer's dW against
# the FP32 gradient at the same weights and batch) averaged over the run.

# %%
def training_config(variant: str, seed: int) -> TrainConfig:
    preset, _, label = variant.partition("/")
    keep_last_block = label == "+BF16 last block"  # a model-level choice, not a recipe ingredient
    off = [] if keep_last_block or preset == "fp32" else ablation.switched_off(preset, label)
    keep = ["head", "last_block"] if keep_last_block else ["head"]
    return base.replace(recipe=preset, ablate=off, keep_high_precision=keep, steps=train_steps, seed=seed,
                        device=device, warmup_steps=max(1, train_steps // 10), eval_every=train_steps,
                        fidelity_every=0 if preset == "fp32" else max(1, train_steps // 3))


finals, fidelity = [], []
runs = [(variant, seed) for seed in range(seeds) for variant in ["fp32", *train_variants]]
results = run_many([training_config(variant, seed) for variant, seed in runs], executor=executor,
                   max_workers=max_workers or None, desc="training runs")
for (variant, seed), result in zip(runs, results):
    finals.append(dict(variant=variant, seed=seed, val_loss=result.metrics.val_loss.dropna().iloc[-1]))
    if variant != "fp32":
        fidelity.append(result.fidelity.assign(variant=variant, seed=seed))
finals = pd.DataFrame(finals)
fidelity = pd.concat(fidelity, ignore_index=True)
save_csv(finals, f"{NAME}_training")
differences = stats.paired_differences(finals, "val_loss", baseline="fp32", by="variant", pair="seed")
training_summary = stats.summarize(differences, "difference", ["variant"])
quantized = fidelity[fidelity.quantized].groupby(["variant", "seed"]).relative_error.mean().reset_index()
training_summary = training_summary.merge(
    stats.summarize(quantized, "relative_error", ["variant"])[["variant", "mean"]].rename(
        columns={"mean": "wgrad_rel_error"}), on="variant")
save_csv(training_summary, f"{NAME}_training_summary")
training_summary.round(4)

# %%
fig, ax = subplots()
positions = np.arange(len(training_summary))
error = np.vstack([training_summary["mean"] - training_summary["low"], training_summary["high"] - training_summary["mean"]])
ax.errorbar(training_summary["mean"], positions, xerr=np.nan_to_num(error), fmt="o", markersize=3, capsize=2)
for seed, part in differences.groupby("seed"):
    ax.plot(part.difference, [list(training_summary.variant).index(v) for v in part.variant], "x",
            color="grey", markersize=3, label="one seed" if seed == 0 else None)
ax.axvline(0, color="black", linewidth=0.6)
ax.set_yticks(positions, training_summary.variant)
ax.invert_yaxis()
ax.set_xlabel("val loss − FP32 val loss (nats/char, same seed)")
ax.set_title(f"{train_steps} steps, mean and 95 % interval over {seeds} seeds")
ax.legend(fontsize=6)
save_figure(fig, f"{NAME}_training")

# %%
metrics = {"seeds": seeds, "train_steps": train_steps}
for row in gemm_summary[gemm_summary.operands != "synthetic"].itertuples():
    metrics[f"{row.operands}_{row.variant}_{row.gemm}_error"] = row.mean
for row in training_summary.itertuples():
    metrics[f"{row.variant}_val_loss_delta"] = row.mean
save_metrics(NAME, **metrics)
