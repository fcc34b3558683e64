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
# # Number formats and scaling: what each recipe costs in accuracy
#
# FP8, MXFP8/6/4, NVFP4 and INTn differ in two things: the **element grid** (which values exist)
# and the **scaling** that maps a tensor onto it (one scale per tensor, per row, per 32-block with
# a power-of-two E8M0 scale, per 16-block with an E4M3 scale plus a global FP32 scale). This
# notebook draws every grid, measures the signal-to-quantization-noise ratio (SQNR) of every
# format × scaling recipe on four kinds of activations, counts how often MX's FLOOR scale clips a
# block where RCEIL does not, compares NVFP4 with MXFP4, and checks that stochastic rounding is
# unbiased where round-to-nearest-even is not. All quantizers are `qlab.quantize`, tested bit for
# bit against torchao's reference implementations.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 20 s)
device: str = "auto"  # unused: every quantizer here runs on the CPU; kept for the notebook convention
seed: int = 0  # seeds every random draw
tokens: int = 2048  # rows of each synthetic activation tensor
hidden: int = 256  # columns; MX and NVFP4 blocks run along this axis
outlier_channels: int = 4  # channels scaled up in the outlier_channels distribution
outlier_scale: float = 100.0  # how much larger those channels are
sr_points: int = 241  # inputs in the stochastic-rounding experiment, spanning the E2M1 range
sr_draws: int = 2000  # stochastic draws averaged per input

# %%
import math

import numpy as np
import pandas as pd
import seaborn as sns
import torch

from qlab import formats, session, synthetic
from qlab import quantize as Q
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics

NAME = "00_formats_and_scaling"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    tokens, hidden, sr_points, sr_draws = 64, 128, 25, 200
use_paper_style()
generator = torch.Generator().manual_seed(seed)
print(f"tokens={tokens} hidden={hidden} sr_points={sr_points} sr_draws={sr_draws}")

# %% [markdown]
# ## 1. The element grids
#
# Each float format has a sign, e exponent bits and m mantissa bits: 2^m values per binade, the
# smallest binade continued linearly down to zero by subnormals. The table lists what the OCP FP8
# and Microscaling v1.0 specs define; the figure puts every positive value on a log₂ axis.

# %%
element_names = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8", "int4"]
rows = []
for name in element_names:
    fmt = formats.get_format(name)
    positive = fmt.values()[fmt.values() > 0]
    rows.append({"format": name, "bits": fmt.bits, "max": float(fmt.max),
                 "min_normal": getattr(fmt, "min_normal", 1.0), "min_positive": float(positive[0]),
                 "positive_values": len(positive),
                 "dynamic_range_binades": math.log2(float(fmt.max) / float(positive[0]))})
format_table = pd.DataFrame(rows)
save_csv(format_table, f"{NAME}_formats")
format_table

# %%
fig, ax = subplots(width="text", aspect=0.38)
for row, name in enumerate(element_names):
    values = formats.get_format(name).values()
    ax.eventplot(np.log2(values[values > 0].numpy()), lineoffsets=row, linelengths=0.7, linewidths=0.6)
ax.set_yticks(range(len(element_names)), element_names)
ax.invert_yaxis()
ax.set_xlabel("log₂ of each positive representable value")
ax.set_title("Element grids: precision is where the ticks crowd, range is how far they reach")
save_figure(fig, f"{NAME}_grids")

# %% [markdown]
# A quantized tensor is integer codes plus scales. Below, one row of 64 values in MXFP8 (E4M3,
# FLOOR): two blocks of 32, each with one E8M0 byte b meaning 2^(b − 127), and one uint8 code per
# element. The same row as NVFP4 has four 16-element blocks with E4M3 scales and one FP32 global
# scale. `dequantize` multiplies them back; `qdq` gives the same bits without storing codes.

# %%
row = torch.linspace(-3.0, 5.0, 64)[None, :]
q_mx = Q.quantize(row, "mxfp8")
q_nv = Q.quantize(row, "nvfp4")
print("MXFP8 scale bytes", q_mx.scale_codes.tolist(), "-> X =", q_mx.scales.tolist())
print("MXFP8 first codes", q_mx.codes[0, 0, :6].tolist())
print("NVFP4 block scales", q_nv.scales.tolist(), "global", q_nv.global_scale.item())
print("max |error|: MXFP8", (Q.dequantize(q_mx) - row).abs().max().item(),
      " NVFP4", (Q.dequantize(q_nv) - row).abs().max().item())

# %% [markdown]
# ## 2. SQNR of every format × scaling recipe
#
# Four activation shapes, all with standard deviation ≈ 1 before outliers: Gaussian, Laplace
# (exponential tails), Student-t with 3 degrees of freedom (heavy tails) and Gaussian with a few
# channels 100× larger (the per-channel outliers of LLM activations). Every recipe scales along
# the hidden axis (per row for "rowwise", blocks of 32 or 16 along the row for MX and NVFP4).
# SQNR = 10·log₁₀(Σx² / Σ(x − x̂)²); each extra mantissa bit is worth about 6 dB.

# %%
distributions = {kind: synthetic.activations(kind, (tokens, hidden), generator, outlier_channels=outlier_channels,
                                             outlier_scale=outlier_scale)
                 for kind in synthetic.DISTRIBUTIONS}
recipes = {
    "FP8 E4M3 tensor": "fp8_e4m3", "FP8 E5M2 tensor": "fp8_e5m2", "FP8 E4M3 rowwise": "fp8_e4m3_rowwise",
    "INT8 tensor": "int8", "INT8 rowwise": "int8_rowwise", "INT4 rowwise": "int4_rowwise",
    "MXFP8 E4M3 floor": "mxfp8", "MXFP8 E4M3 rceil": "mxfp8_rceil", "MXFP8 E5M2 floor": "mxfp8_e5m2",
    "MXFP6 E3M2 floor": "mxfp6_e3m2", "MXFP6 E2M3 floor": "mxfp6_e2m3",
    "MXFP4 floor": "mxfp4", "MXFP4 rceil": "mxfp4_rceil",
    "NVFP4 1×16": "nvfp4", "NVFP4 16×16": "nvfp4_2d", "NVFP4 1×16 + RHT": "nvfp4_rht",
}
rows = []
for label, spec_name in session.progress(recipes.items(), total=len(recipes), desc="recipes"):
    spec = Q.get_spec(spec_name)
    for kind, x in distributions.items():
        rows.append({"recipe": label, "spec": spec_name, "element": spec.element, "scaling": type(spec).__name__,
                     "distribution": kind, "sqnr_db": Q.sqnr_db(x, Q.qdq(x, spec))})
sqnr_table = pd.DataFrame(rows)
save_csv(sqnr_table, f"{NAME}_sqnr")
sqnr_wide = sqnr_table.pivot(index="recipe", columns="distribution", values="sqnr_db").loc[list(recipes)]
sqnr_wide[list(synthetic.DISTRIBUTIONS)].round(1)

# %%
fig, ax = subplots(width="text", aspect=0.62)
sns.heatmap(sqnr_wide[list(synthetic.DISTRIBUTIONS)], annot=True, fmt=".1f", cmap="viridis", ax=ax,
            cbar_kws={"label": "SQNR (dB)"}, annot_kws={"fontsize": 6})
ax.set_xlabel("activation distribution")
ax.set_ylabel("")
ax.set_title("SQNR of quantize→dequantize (higher is better)")
save_figure(fig, f"{NAME}_sqnr")

# %% [markdown]
# ## 3. How often does FLOOR clip a block?
#
# OCP's FLOOR scale is 2^(⌊log₂ amax⌋ − emax): the block's largest element lands in the element's
# top binade but can exceed its max (448 for E4M3, 6 for E2M1) and saturate; 480 becomes 448.
# RCEIL rounds amax / elem_max *up* to a power of two so nothing saturates, at the price of
# sometimes using one binade less. CEIL and EVEN are torchao's other two modes. NVFP4's E4M3 block
# scale is rounded to nearest, so about half its blocks clip by a little.

# %%
rows = []
for kind, x in session.progress(distributions.items(), total=len(distributions), desc="distributions"):
    for element in ("e4m3", "e2m1"):
        for mode in ("floor", "rceil", "ceil", "even"):
            spec = Q.MXSpec(element, mode=mode)
            rows.append({"distribution": kind, "recipe": f"MX{'FP8' if element == 'e4m3' else 'FP4'} {mode}",
                         "element": element, "mode": mode, "clipped_blocks": Q.clipped_block_fraction(x, spec),
                         "sqnr_db": Q.sqnr_db(x, Q.qdq(x, spec))})
    rows.append({"distribution": kind, "recipe": "NVFP4 1×16", "element": "e2m1", "mode": "nvfp4",
                 "clipped_blocks": Q.clipped_block_fraction(x, "nvfp4"), "sqnr_db": Q.sqnr_db(x, Q.qdq(x, "nvfp4"))})
clip_table = pd.DataFrame(rows)
save_csv(clip_table, f"{NAME}_clipping")
clip_table.pivot(index="recipe", columns="distribution", values="clipped_blocks").round(3)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.62)
for ax, column, label in zip(axes, ("clipped_blocks", "sqnr_db"), ("fraction of blocks clipped", "SQNR (dB)")):
    sns.barplot(clip_table, x="recipe", y=column, hue="distribution", ax=ax)
    ax.set_xlabel("")
    ax.set_ylabel(label)
    ax.tick_params(axis="x", rotation=60, labelsize=6)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend_.remove()
fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=6, frameon=False)
save_figure(fig, f"{NAME}_clipping")

# %% [markdown]
# ## 4. NVFP4 against MXFP4
#
# Both store E2M1 elements. MXFP4 shares a power-of-two scale per 32 elements; NVFP4 an E4M3 scale
# (3 mantissa bits) per 16 elements, plus an FP32 per-tensor scale that keeps the block scales in
# E4M3's range. With the default parameters the finer, more precise scale is worth 1.6 dB on
# Gaussian data, 4 dB on Student-t and 10 dB when a few channels are outliers (an outlier then
# spoils 16 elements instead of 32, under a scale with three mantissa bits). The 16×16 variant
# (for weights, so that W and Wᵀ share one quantization) pays for its coarser tiles. The random
# Hadamard transform is not meant to raise SQNR: NVIDIA applies it to the weight-gradient operands
# along the token axis, where it spreads outliers before a GEMM whose result it leaves unchanged;
# here it costs ~4 dB on outlier channels because it smears each outlier over its 16-element chunk.

# %%
fp4_recipes = ["MXFP4 floor", "MXFP4 rceil", "NVFP4 1×16", "NVFP4 16×16", "NVFP4 1×16 + RHT"]
fp4_table = sqnr_table[sqnr_table.recipe.isin(fp4_recipes)].reset_index(drop=True)
fig, ax = subplots(width="column", aspect=0.8)
sns.barplot(fp4_table, x="distribution", y="sqnr_db", hue="recipe", hue_order=fp4_recipes, ax=ax)
ax.set_xlabel("")
ax.set_ylabel("SQNR (dB)")
ax.tick_params(axis="x", rotation=30, labelsize=6)
ax.legend(fontsize=5, title="")
ax.set_title("FP4 recipes")
save_figure(fig, f"{NAME}_nvfp4_vs_mxfp4")
fp4_table.pivot(index="recipe", columns="distribution", values="sqnr_db").loc[fp4_recipes].round(2)

# %% [markdown]
# ## 5. Stochastic rounding is unbiased; round-to-nearest is not
#
# For inputs spread over E2M1's range, the mean of `sr_draws` stochastic roundings should approach
# the input, within about 3 standard errors q/(2√N) (q the grid step there); RNE's error is
# deterministic, a sawtooth that reaches half a step. This is why NVFP4 training rounds
# gradients stochastically: summed over many steps, RNE's bias does not average out.

# %%
inputs = torch.linspace(0.0, 6.0, sr_points)
sr_generator = torch.Generator().manual_seed(seed + 1)
draws = formats.cast(inputs.expand(sr_draws, sr_points).contiguous(), "e2m1", rounding="stochastic",
                     generator=sr_generator)
grid = formats.get_format("e2m1").values().float()
step = grid[torch.searchsorted(grid, inputs, right=True).clamp(max=len(grid) - 1)] - \
    grid[(torch.searchsorted(grid, inputs, right=True) - 1).clamp(min=0)]
sr_table = pd.DataFrame({
    "x": inputs.numpy(),
    "rne_error": (formats.cast(inputs, "e2m1") - inputs).numpy(),
    "sr_mean_error": (draws.double().mean(0) - inputs.double()).numpy(),
    "sr_standard_error": (draws.double().std(0) / math.sqrt(sr_draws)).numpy(),
    "grid_step": step.numpy(),
})
save_csv(sr_table, f"{NAME}_stochastic_rounding")
within = (sr_table.sr_mean_error.abs() <= 3 * sr_table.sr_standard_error + 1e-12).mean()
print(f"largest |RNE error| {sr_table.rne_error.abs().max():.3f}; largest |SR mean error| "
      f"{sr_table.sr_mean_error.abs().max():.4f}; inputs within 3 standard errors: {within:.1%}")

# %%
fig, ax = subplots(width="column", aspect=0.7)
ax.plot(sr_table.x, sr_table.rne_error, label="RNE: round(x) − x")
ax.plot(sr_table.x, sr_table.sr_mean_error, label=f"SR: mean of {sr_draws} draws − x")
ax.fill_between(sr_table.x, -3 * sr_table.sr_standard_error, 3 * sr_table.sr_standard_error, alpha=0.3,
                color="C1", linewidth=0, label="±3 standard errors")
ax.axhline(0, color="black", linewidth=0.5)
ax.set_xlabel("x")
ax.set_ylabel("bias")
ax.set_title("E2M1 rounding bias")
ax.legend(fontsize=6)
save_figure(fig, f"{NAME}_stochastic_rounding")

# %%
pick = sqnr_table.set_index(["spec", "distribution"]).sqnr_db
mx = clip_table.set_index(["recipe", "distribution"]).clipped_blocks
save_metrics(NAME,
             sqnr_mxfp8_gaussian_db=pick["mxfp8", "gaussian"], sqnr_mxfp4_gaussian_db=pick["mxfp4", "gaussian"],
             sqnr_nvfp4_gaussian_db=pick["nvfp4", "gaussian"],
             sqnr_nvfp4_outliers_db=pick["nvfp4", "outlier_channels"],
             sqnr_mxfp4_outliers_db=pick["mxfp4", "outlier_channels"],
             mxfp4_floor_clipped_gaussian=mx["MXFP4 floor", "gaussian"],
             mxfp8_floor_clipped_gaussian=mx["MXFP8 floor", "gaussian"],
             sr_max_abs_mean_error=sr_table.sr_mean_error.abs().max(),
             rne_max_abs_error=sr_table.rne_error.abs().max())
