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
# # Your model under a bit budget: a report
#
# Which layers of this model survive a 4-bit format, which need 8 bits, which must stay in BF16 — and
# does the answer hold on text it was not chosen on? `qlab report --model M` runs this notebook into
# `runs/report/<model>/` (the executed notebook, an HTML copy, its CSVs, claims and figures); every
# number in the prose below is computed by this run.
#
# 1. **The model and the text**: what was loaded, and its loss on the held-out batches.
# 2. **Outliers and what each format does**: per layer, the inputs' outlier ratio (largest channel
#    amax over the median one) and, per format, the SQNR and the share flushed to zero of the inputs
#    and of the weight.
# 3. **Scores**: per layer and format, the loss change with that layer alone in that format
#    (`qlab.advisor`), with its 95 % interval over the calibration batches.
# 4. **Plans**: one per budget (mean bits per weight element, scales counted; `qlab.plan`), solved
#    exactly, the layers the data cannot decide, and each plan checked on held-out batches against the
#    float model, every layer in the fewest-bits format, and the usual rule (first and last layers
#    raised) at the same budget.
# 5. **How far the cheap estimate can be trusted**: the one-backward approximated score against the
#    measured one (causal LMs).

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite
model_name: str = "smollm2-135m"  # a packaged model, a checkpoint folder, or a hub id in the local Hugging Face cache
tokenizer: str = ""  # a folder (or cached hub id) to take the tokenizer from when the checkpoint has none
text: list[str] = []  # UTF-8 text files; none: Shakespeare (training plays calibrate, held-out plays check)
formats: list[str] = ["nvfp4", "mxfp8", "bf16"]  # the weight formats a layer may take ("bf16": not quantized)
budgets: list[float] = [4.5, 5.0, 6.0]  # effective bits per weight element (scales counted): one plan each
score: str = "measured"  # what the plans are chosen from: "measured", "approximated" or "hierarchical"
expand: int = 6  # score "hierarchical": the blocks (decoder layers) measured layer by layer
batches: int = 3  # calibration batches the scores are measured on
held_out: int = 8  # batches of other windows each plan is checked on
batch_size: int = 2  # windows per batch
tokens: int = 64  # tokens per window
seed: int = 0  # which windows are drawn
dtype: str = "float32"  # the model's dtype: "float32" or "bf16"
device: str = "auto"  # where the model runs: "auto", "cpu" or "cuda"

# %%
# %matplotlib inline
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

from qlab import advisor, models, paths, plan, session, stats
from qlab.claims import Claims
from qlab.nn import oriented_weight
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.probes import ProbeSet, what_if_stats
from qlab.recipe import get_recipe
from qlab.results import markdown_table, save_csv

NAME = "report_your_model"
this_run = session.start(NAME, globals())
if smoke:
    batches, held_out, batch_size, tokens = 2, 2, 1, 16
use_paper_style()
torch.manual_seed(seed)
model, model_tokenizer, kind = models.load_any(model_name, dtype, tokenizer=tokenizer or None)
model = model.to(this_run.device)
calibration, checked = advisor.plan_batches(model_tokenizer, text, count=batches, held_out=held_out,
                                            batch_size=batch_size, tokens=tokens, seed=seed)
calibration = [b.to(this_run.device) for b in calibration]
checked = [b.to(this_run.device) for b in checked]
if kind == models.CAUSAL_LM:
    calibration_loss = checked_loss = advisor.causal_lm_loss
else:  # an encoder: the relative error of its last hidden states against the float model's
    calibration_loss = advisor.hidden_state_error(model, calibration)
    checked_loss = advisor.hidden_state_error(model, checked)
table = advisor.layer_table(model, formats)
for budget in budgets:  # every budget checked before the first loss is computed
    plan.check_budget(table, budget)
LAYERS = list(dict.fromkeys(table.layer))
QUANTIZED = [name for name in formats if name != plan.HIGH_PRECISION]
claims = Claims(this_run, pairs="batches", committed=False)  # a report: nothing committed to differ from
with torch.no_grad():
    held_out_losses = [float(checked_loss(model, b)) for b in checked]
parameters = sum(p.numel() for p in model.parameters())
what = "next-token loss" if kind == models.CAUSAL_LM else "hidden-state error against itself (0)"
if kind == models.CAUSAL_LM:
    claims.mean("baseline", held_out_losses, text=f"{model_name}'s held-out loss", unit="nats/token")
print(f"{model_name}: {'an' if kind == models.ENCODER else 'a'} {kind}, {parameters / 1e6:.1f}M parameters, {len(LAYERS)} convertible layers; "
      f"{len(calibration)} calibration and {len(checked)} held-out batches of {batch_size}×{tokens} tokens "
      f"({'text: ' + ', '.join(text) if text else 'Shakespeare'}); scored by its {what}")

# %% [markdown]
# ## 2. Outliers, and what each format does to inputs and weights
#
# One forward pass per held-out batch, probed at every convertible layer: the outlier ratio of its
# input, and what each quantized format's input spec would do to it (SQNR, the share of non-zero
# elements flushed to zero, the share saturated). The weights are fixed: their numbers are exact.

# %%
INPUT_FORMATS = [name for name in QUANTIZED if get_recipe(name).input is not None]  # weight-only ones: none
probes = ProbeSet(model, modules=LAYERS, roles=("input",), stats=("outlier_ratio",),
                  what_if={name: get_recipe(name).input for name in INPUT_FORMATS})
with probes, torch.no_grad():
    for batch in session.progress(checked, desc="probed passes"):
        model(input_ids=batch)
        probes.step()
records = probes.to_frame().rename(columns={"module": "layer", "step": "batch"})
records["position"] = records.layer.map({name: index for index, name in enumerate(LAYERS)})
inputs = records[["batch", "position", "layer", "stat", "value"]].sort_values(["stat", "position", "batch"])
save_csv(inputs, f"{NAME}_inputs")
weights = pd.DataFrame([
    {"position": index, "layer": name, "format": format_name, **{
        key: value for key, value in what_if_stats(oriented_weight(model.get_submodule(name)),
                                                   get_recipe(format_name).weight).items()
        if key in ("sqnr_db", "underflow_fraction", "saturation_fraction")}}
    for index, name in enumerate(LAYERS) for format_name in QUANTIZED
])  # fmt: skip
save_csv(weights, f"{NAME}_weights")
ratios = inputs[inputs.stat == "outlier_ratio"]
ratio_summary = stats.summarize(ratios, "value", ["position", "layer"]).sort_values("position")
worst = np.log(ratios.value).groupby(ratios.layer).mean().idxmax()  # by the geometric mean the claim states
claims.geometric_mean("outliers.largest", ratios[ratios.layer == worst].value,
                      text=f"the largest input outlier ratio (geometric mean over batches), of {worst}")
for format_name in INPUT_FORMATS:
    per_batch = inputs[inputs.stat == f"{format_name}/sqnr_db"].groupby("batch").value.median()
    claims.mean(f"sqnr.{format_name}", per_batch, text=f"the median layer's input SQNR in {format_name}", unit="dB",
                digits=3)

fig, axes = subplots(1, 3, width="text", aspect=0.5)
axes[0].semilogy(ratio_summary.position, ratio_summary["mean"], marker="o", markersize=2, linewidth=0.8)
axes[0].set_ylabel("input outlier ratio\n(mean over batches)")
for index, format_name in enumerate(QUANTIZED):
    sqnr = inputs[inputs.stat == f"{format_name}/sqnr_db"].groupby("position").value.mean()
    axes[1].plot(sqnr.index, sqnr.values, color=f"C{index}", linewidth=0.8, label=f"{format_name} input")
    weight = weights[weights.format == format_name]
    axes[1].plot(weight.position, weight.sqnr_db, color=f"C{index}", linewidth=0.8, linestyle="--",
                 label=f"{format_name} weight")
    flushed = inputs[inputs.stat == f"{format_name}/underflow_fraction"].groupby("position").value.mean()
    axes[2].plot(flushed.index, flushed.values, color=f"C{index}", linewidth=0.8, label=format_name)
axes[1].set_ylabel("SQNR (dB)")
axes[2].set_yscale("symlog", linthresh=1e-5)
axes[2].set_ylabel("input share flushed\nto zero (symlog)")
for ax in axes:
    ax.set_xlabel("layer (model order)")
axes[1].legend(fontsize=6)
save_figure(fig, f"{NAME}_formats")

# %% [markdown]
# ## 3. Scores: each layer alone in each format
#
# The score of a (layer, format) is the loss change with that layer alone in that format, paired with
# the float model on the same calibration batch (`measured`); or its second-order estimate from one
# backward pass (`approximated`); or, for many layers, each block measured whole and only the most
# sensitive blocks layer by layer (`hierarchical`). Positive: quantizing hurts.

# %%
advisor.check_score(kind, score)  # session.start refused it already, unless score was changed since
scores = advisor.score_function(score, expand=expand)(model, calibration, formats, loss_fn=calibration_loss,
                                                      progress=True)
save_csv(scores.drop(columns=[c for c in scores.columns if c.startswith("batch_")]), f"{NAME}_scores")
shown = scores[scores.format != plan.HIGH_PRECISION].sort_values("score", ascending=False)
display(Markdown(markdown_table(shown.head(10)[["layer", "format", "score", "low", "high", "bits"]])))

fig, ax = subplots(1, 1, width="text", aspect=0.35)
for index, format_name in enumerate(QUANTIZED):
    part = scores[scores.format == format_name]
    position = part.layer.map({name: i for i, name in enumerate(LAYERS)}) + (index - 0.5) * 0.2
    ax.errorbar(position, part.score, yerr=[part.score - part.low.fillna(part.score), part.high.fillna(part.score) - part.score],
                fmt="o", markersize=2, elinewidth=0.6, color=f"C{index}", label=format_name)
ax.axhline(0, color="k", linewidth=0.5)
ax.set_yscale("symlog", linthresh=1e-3)
ax.set_xlabel("layer (model order)")
ax.set_ylabel(f"{score} score (symlog)")
ax.legend(fontsize=6)
ax.set_title(f"mean and 95 % interval over {len(calibration)} calibration batches", fontsize=7)
save_figure(fig, f"{NAME}_scores")

# %% [markdown]
# ## 4. Plans, and how they do on held-out text
#
# For each budget, the assignment with the smallest summed score whose mean bits per weight element
# stay within it (exact, `plan.solve`); the calibration batches resampled to find the layers whose
# format the data cannot decide; and the plan's loss on the held-out batches minus three others, paired
# by batch (Holm over the three comparisons of a budget).

# %%
config_sha256 = advisor.config_hash(model)
rows, checks_ = [], []
for budget in session.progress(budgets, desc="plans"):
    chosen = plan.make_plan(scores, effective_bits=budget, model=model_name, model_config_sha256=config_sha256,
                            text_sha256=plan.token_hash(calibration))
    chosen.save(paths.data_dir() / f"{NAME}_plan_{budget:g}bits.json")
    undecided = (plan.stability(scores, effective_bits=budget, draws=advisor.STABILITY_DRAWS, seed=seed).undecided.sum()
                 if len(calibration) > 1 else np.nan)
    counts = {f"layers_{name}": sum(v == name for v in chosen.layers.values()) for name in formats}
    rows.append({"effective_bits": budget, "reached_bits": chosen.reached_bits, **counts, "undecided": undecided})
    check = advisor.held_out_check(model, chosen, scores, checked, loss_fn=checked_loss)
    checks_.append(check.assign(effective_bits=budget))
    family = f"held_out.{budget:g}"
    for row, short in zip(check.itertuples(), ("float", "cheapest", "rule")):
        differences = [getattr(row, f"batch_{i}") for i in range(int(row.n))]
        claims.paired(f"{family}.{short}", differences, family=family, text=f"at {budget:g} bits, {row.comparison}")
    claims.holm(family)
plans = pd.DataFrame(rows)
save_csv(plans, f"{NAME}_plans")
held = pd.concat(checks_, ignore_index=True)
save_csv(held.drop(columns=[c for c in held.columns if c.startswith("batch_")]), f"{NAME}_held_out")
display(Markdown(markdown_table(plans)))

fig, ax = subplots(1, 1, width="column", aspect=0.7)
for index, comparison in enumerate(dict.fromkeys(held.comparison)):
    part = held[held.comparison == comparison]
    x = np.arange(len(part)) + (index - 1) * 0.2
    ax.errorbar(x, part["mean"], yerr=[part["mean"] - part.low, part.high - part["mean"]], fmt="o", markersize=3,
                elinewidth=0.8, capsize=1.5, color=f"C{index}", label=comparison)
ax.axhline(0, color="k", linewidth=0.5)
ax.set_xticks(np.arange(len(budgets)), [f"{b:g}" for b in budgets])
ax.set_xlabel("budget (bits per weight element)")
ax.set_ylabel("Δ held-out loss")
fig.legend(loc="outside lower center", ncols=1, fontsize=6)  # below the axes: the plot keeps the width
ax.set_title(f"mean and 95 % interval over {len(checked)} held-out batches", fontsize=7)
save_figure(fig, f"{NAME}_held_out")

# %% [markdown]
# ## 5. The approximated score against the measured one
#
# The approximated score costs one forward and backward pass per batch; the measured one a loss per
# layer, format and batch. Spearman's ρ between the two over the (layer, format) pairs, with a
# bootstrap interval over layers, says how far the cheap one ranks layers as the measured one does.

# %%
agreement = None
if kind == models.CAUSAL_LM and len(LAYERS) >= 3:
    measured = scores if score == "measured" else advisor.measured_scores(model, calibration, formats, progress=True)
    approximated = scores if score == "approximated" else advisor.approximated_scores(model, calibration, formats)
    rho, low, high = plan.score_agreement(measured, approximated, draws=2000, seed=seed)
    agreement = claims.value("agreement", rho, low=low, high=high, n=len(LAYERS), test="bootstrap", digits=3,
                             text="Spearman's ρ, approximated against measured scores, over the layers")
    pairs = pd.DataFrame({"layer": measured.layer, "format": measured.format, "measured": measured.score,
                          "approximated": approximated.score})
    pairs = pairs[pairs.format != plan.HIGH_PRECISION]
    save_csv(pairs, f"{NAME}_agreement")
    fig, ax = subplots(1, 1, width="column", aspect=0.8)
    for index, format_name in enumerate(QUANTIZED):
        part = pairs[pairs.format == format_name]
        ax.scatter(part.measured, part.approximated, s=4, color=f"C{index}", label=format_name)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_xlabel("measured score (symlog)")
    ax.set_ylabel("approximated score (symlog)")
    ax.legend(fontsize=6)
    save_figure(fig, f"{NAME}_agreement")
else:
    print("an encoder's approximated score is zero for every layer (no gradient at the float model): not compared")

# %% [markdown]
# ## Conclusions

# %%
claims.save()
lines = []
if kind == models.CAUSAL_LM:
    lines.append(f"{model_name}'s held-out loss is {{baseline}} ({{baseline:verdict}}).")
lines.append(f"The largest input outlier ratio is {{outliers.largest}}, at `{worst}`; the median layer's input SQNR "
             + ", ".join(f"in {name} is {{sqnr.{name}}}" for name in INPUT_FORMATS) + ".")
for row in plans.itertuples():
    budget = row.effective_bits
    family = f"held_out.{budget:g}"
    per_format = ", ".join(f"{getattr(row, 'layers_' + name)} in {name}" for name in formats)
    undecided = "" if pd.isna(row.undecided) else f"; the data cannot decide {int(row.undecided)} of {len(LAYERS)} layers' formats"
    lines.append(
        f"\n\nAt {budget:g} bits per weight element the plan ({row.reached_bits:.4f} reached) puts {per_format}{undecided}. "
        f"On held-out text, its loss minus the float model's is {{{family}.float}} ({{{family}.float:verdict}}); "
        f"minus every layer in the fewest-bits format, {{{family}.cheapest}} ({{{family}.cheapest:verdict}}); "
        f"minus the first-and-last-layers rule at the same budget, {{{family}.rule}} ({{{family}.rule:verdict}}).")
if agreement is not None:
    lines.append("\n\nThe approximated score ranks the (layer, format) pairs as the measured one does with Spearman's "
                 "ρ {agreement} ({agreement:verdict}).")
display(Markdown(claims.render(" ".join(lines))))
