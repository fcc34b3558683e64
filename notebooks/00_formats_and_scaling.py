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
# block where RCEIL does not, compares NVFP4 with MXFP4, and measures the bias of stochastic rounding
# and of round-to-nearest-even. All quantizers are `qlab.quantize`, tested bit for bit against
# torchao's reference implementations.
#
# Every number in the text is computed from this run's results by the code cell that renders it, and
# the claims are saved to `data/00_formats_and_scaling_claims.csv`. Each activation tensor is drawn
# `draws` times (independent draws of the same distribution): SQNR and clipping are means over the
# draws with 95 % intervals, and two recipes are compared on the same draws (paired t, Holm-corrected
# over all the comparisons).

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
device: str = "auto"  # unused: every quantizer here runs on the CPU; kept for the notebook convention
seed: int = 0  # seeds every random draw
tokens: int = 2048  # rows of each synthetic activation tensor
hidden: int = 256  # columns; MX and NVFP4 blocks run along this axis
outlier_channels: int = 4  # channels scaled up in the outlier_channels distribution
outlier_scale: float = 100.0  # how much larger those channels are
sr_points: int = 241  # inputs in the stochastic-rounding experiment, spanning the E2M1 range
sr_draws: int = 2000  # stochastic draws averaged per input
draws: int = 10  # independent draws of every activation tensor (sections 2 to 4)

# %%
import math
import re

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from IPython.display import Markdown, display

from qlab import formats, session, stats, synthetic
from qlab import quantize as Q
from qlab.claims import Claims
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics

NAME = "00_formats_and_scaling"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if smoke:
    tokens, hidden, sr_points, sr_draws, draws = 64, 128, 25, 200, 3
use_paper_style()
claims = Claims(this_run, pairs="draws")  # paired tests pair the same draws of a distribution
print(f"tokens={tokens} hidden={hidden} sr_points={sr_points} sr_draws={sr_draws} draws={draws}")


def percent(key: str) -> str:
    """A claim that is a share, as a percentage with one decimal."""
    return f"{100 * claims[key].value:.1f} %"


def dB(key: str) -> str:
    """A claim in dB with two decimals (signed for a paired difference)."""
    claim = claims[key]
    return (f"{claim.value:+.2f}" if claim.signed else f"{claim.value:.2f}").replace("-", "−") + " dB"

# %% [markdown]
# ## 1. The element grids
#
# Each float format has a sign, e exponent bits and m mantissa bits: 2^m values per binade, the
# smallest binade continued linearly down to zero by subnormals. The table lists what the OCP FP8
# and Microscaling (MX) specs define; the figure puts every positive value on a log₂ axis.

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
# (exponential tails), Student-t with 3 degrees of freedom (heavy tails) and Gaussian with
# `outlier_channels` channels `outlier_scale` times larger (the per-channel outliers of LLM
# activations), each drawn `draws` times (draw d from seed + d). Every recipe scales along the hidden axis (per row for
# "rowwise", blocks of 32 or 16 along the row for MX and NVFP4).
# SQNR = 10·log₁₀(Σx² / Σ(x − x̂)²); for a uniform quantizer each extra mantissa bit is worth
# 20·log₁₀ 2 dB. The heatmap shows the mean over the draws.

# %%
def draw_activations(draw_seed: int) -> dict:
    draw_generator = torch.Generator().manual_seed(draw_seed)
    return {kind: synthetic.activations(kind, (tokens, hidden), draw_generator, outlier_channels=outlier_channels,
                                        outlier_scale=outlier_scale) for kind in synthetic.DISTRIBUTIONS}


draw_sets = [draw_activations(seed + draw) for draw in range(draws)]  # draw d: seed + d
distributions = draw_sets[0]  # the first draw: used where one tensor is enough
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
    for draw, tensors in enumerate(draw_sets):
        for kind, x in tensors.items():
            rows.append({"recipe": label, "spec": spec_name, "element": spec.element, "scaling": type(spec).__name__,
                         "distribution": kind, "draw": draw, "sqnr_db": Q.sqnr_db(x, Q.qdq(x, spec))})
sqnr_table = pd.DataFrame(rows)
save_csv(sqnr_table, f"{NAME}_sqnr")
sqnr_wide = sqnr_table.pivot_table(index="recipe", columns="distribution", values="sqnr_db").loc[list(recipes)]
sqnr_wide[list(synthetic.DISTRIBUTIONS)].round(1)

# %%
fig, ax = subplots(width="text", aspect=0.62)
sns.heatmap(sqnr_wide[list(synthetic.DISTRIBUTIONS)], annot=True, fmt=".1f", cmap="viridis", ax=ax,
            cbar_kws={"label": f"SQNR (dB), mean of {draws} draws"}, annot_kws={"fontsize": 7})
ax.set_xlabel("activation distribution")
ax.set_ylabel("")
ax.set_title("SQNR of quantize→dequantize (higher is better)")
ax.grid(False)
save_figure(fig, f"{NAME}_sqnr")


# %%
def key_of(text: str) -> str:
    """``text`` as part of a claim's key (what ``Claims.paired_family`` does to its groups and pairs)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


COMPARISONS = [  # recipe a − recipe b, on the same draws
    ("MXFP8 E4M3 rceil", "MXFP8 E4M3 floor"), ("MXFP4 rceil", "MXFP4 floor"), ("NVFP4 1×16", "MXFP4 floor"),
    ("NVFP4 16×16", "NVFP4 1×16"), ("NVFP4 1×16 + RHT", "NVFP4 1×16"),
]
sqnr_keys = claims.paired_family(sqnr_table, "sqnr_db", family="sqnr", pairs=COMPARISONS, by="distribution",
                                 between="recipe", pair="draw", unit="dB", digits=2,
                                 text="{group}: SQNR of {a} − {b}")


def gap(distribution: str, a: str, b: str) -> str:
    return f"sqnr.{key_of(distribution)}.{key_of(a)}-{key_of(b)}"


for label in ("MXFP8 E4M3 floor", "MXFP8 E4M3 rceil"):
    part = sqnr_table[(sqnr_table.recipe == label) & (sqnr_table.distribution == "gaussian")].sort_values("draw")
    claims.mean(f"sqnr.gaussian.{key_of(label)}", part.sqnr_db, unit="dB", digits=2,
                text=f"SQNR of {label} on Gaussian activations")
display(Markdown(claims.render(f"""
On Gaussian activations MXFP8 (E4M3) reaches {{sqnr.gaussian.MXFP8_E4M3_floor}} with FLOOR scales and
{{sqnr.gaussian.MXFP8_E4M3_rceil}} with RCEIL (means over {draws} draws, 95 % intervals); paired by draw,
RCEIL − FLOOR is {{{gap("gaussian", "MXFP8 E4M3 rceil", "MXFP8 E4M3 floor")}}}
({{{gap("gaussian", "MXFP8 E4M3 rceil", "MXFP8 E4M3 floor")}:verdict}}). Every paired comparison of
this notebook (Holm over all of them):
""") + "\n" + claims.table(sqnr_keys)))

# %% [markdown]
# ## 3. How often does FLOOR clip a block?
#
# OCP's FLOOR scale is 2^(⌊log₂ amax⌋ − emax): the block's largest element lands in the element's
# top binade but can exceed its max (448 for E4M3, 6 for E2M1) and saturate; 480 becomes 448.
# RCEIL rounds amax / elem_max *up* to a power of two so nothing saturates, at the price of
# sometimes using one binade less. CEIL and EVEN are torchao's other two modes. NVFP4's E4M3 block
# scale is rounded to nearest, so it can round down and clip too. A block counts as clipped when an
# element lands past the largest value: one within half a step of it would have rounded to that value
# anyway and loses nothing more, one further out loses more than rounding. Bars are means over the
# draws with 95 % intervals; a fraction of exactly 0 is marked "0".

# %%
rows, ceil_differs = [], 0
for draw, tensors in enumerate(session.progress(draw_sets, desc="draws")):
    for kind, x in tensors.items():
        ceil_differs += int((Q.qdq(x, Q.MXSpec("e4m3", mode="ceil")) != Q.qdq(x, Q.MXSpec("e4m3", mode="rceil"))).sum())
        for element in ("e4m3", "e2m1"):
            for mode in ("floor", "rceil", "ceil", "even"):
                spec = Q.MXSpec(element, mode=mode)
                rows.append({"distribution": kind, "draw": draw,
                             "recipe": f"MX{'FP8' if element == 'e4m3' else 'FP4'} {mode}", "element": element,
                             "mode": mode, "clipped_blocks": Q.clipped_block_fraction(x, spec),
                             "sqnr_db": Q.sqnr_db(x, Q.qdq(x, spec))})
        rows.append({"distribution": kind, "draw": draw, "recipe": "NVFP4 1×16", "element": "e2m1", "mode": "nvfp4",
                     "clipped_blocks": Q.clipped_block_fraction(x, "nvfp4"), "sqnr_db": Q.sqnr_db(x, Q.qdq(x, "nvfp4"))})
clip_table = pd.DataFrame(rows)
save_csv(clip_table, f"{NAME}_clipping")
clip_table.pivot_table(index="recipe", columns="distribution", values="clipped_blocks", sort=False).round(3)

# %%
clip_recipes = list(dict.fromkeys(clip_table.recipe))
clip_summary = stats.summarize(clip_table, "clipped_blocks", ["recipe", "distribution"]).merge(
    stats.summarize(clip_table, "sqnr_db", ["recipe", "distribution"]), on=["recipe", "distribution", "n"],
    suffixes=("_clip", "_sqnr"))
fig, axes = subplots(1, 2, width="text", aspect=0.62)
width = 0.8 / len(synthetic.DISTRIBUTIONS)
positions = np.arange(len(clip_recipes))
for ax, column, label in zip(axes, ("clip", "sqnr"), ("fraction of blocks clipped", "SQNR (dB)")):
    for i, kind in enumerate(synthetic.DISTRIBUTIONS):
        part = clip_summary[clip_summary.distribution == kind].set_index("recipe").loc[clip_recipes]
        where = positions + (i - (len(synthetic.DISTRIBUTIONS) - 1) / 2) * width
        ax.bar(where, part[f"mean_{column}"], width, color=f"C{i}", label=kind,
               yerr=[part[f"mean_{column}"] - part[f"low_{column}"], part[f"high_{column}"] - part[f"mean_{column}"]],
               error_kw={"linewidth": 0.6})
        if column == "clip":
            for x_at, value in zip(where, part["mean_clip"]):
                if value == 0:
                    ax.text(x_at, 0.005, "0", ha="center", va="bottom", fontsize=7, color=f"C{i}")
    ax.set_xticks(positions, clip_recipes, rotation=60, ha="right")
    ax.set_ylabel(label)
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="outside upper center", ncol=4)
save_figure(fig, f"{NAME}_clipping")

# %%
clip_keys = []
for label in ("MXFP8 floor", "MXFP4 floor", "NVFP4 1×16"):
    for kind in synthetic.DISTRIBUTIONS:
        part = clip_table[(clip_table.recipe == label) & (clip_table.distribution == kind)].sort_values("draw")
        key = f"clip.{key_of(label)}.{kind}"
        claims.mean(key, part.clipped_blocks, digits=3, headline=(label, kind) == ("MXFP4 floor", "gaussian"),
                    text=f"{kind}: fraction of blocks {label} clips (an element past the largest value)")
        clip_keys.append(key)
never = clip_table[clip_table["mode"].isin(["rceil", "ceil"])]
claims.value("clip.rceil_ceil_max", never.clipped_blocks.max(), test="computed", digits=3,
             text=f"largest fraction of blocks clipped by RCEIL or CEIL (any element, distribution and draw, of "
                  f"{len(never)})")


def clip_range(label: str) -> str:
    values = [claims[f"clip.{key_of(label)}.{kind}"].value for kind in synthetic.DISTRIBUTIONS]
    return f"{100 * min(values):.1f}–{100 * max(values):.1f} %"


fp8 = clip_table[clip_table.element == "e4m3"].pivot_table(index=["distribution", "draw"], columns="mode",
                                                         values="sqnr_db")
elements = draws * len(synthetic.DISTRIBUTIONS) * tokens * hidden
claims.value("fp8.ceil_differs", ceil_differs / elements, test="computed", digits=2,
             text=f"share of the {elements} elements (every draw and distribution) that MXFP8 E4M3 CEIL and RCEIL "
                  "dequantize differently")
claims.value("fp8.ceil_sqnr_gap", (fp8["ceil"] - fp8["rceil"]).abs().max(), test="computed", digits=2,
             text="largest |SQNR of CEIL − SQNR of RCEIL| for E4M3 elements, any tensor")
never_text = ("no block of any tensor" if claims["clip.rceil_ceil_max"].value == 0
              else "at most a fraction {clip.rceil_ceil_max:value} of a tensor's blocks")
display(Markdown(claims.render(f"""
FLOOR clips {clip_range("MXFP8 floor")} of MXFP8 blocks and {clip_range("MXFP4 floor")} of MXFP4 blocks
(the range over the four distributions of the means over {draws} draws); RCEIL and CEIL clip {never_text}. NVFP4 clips {clip_range("NVFP4 1×16")}.
For E4M3 elements CEIL and RCEIL dequantize a share {{fp8.ceil_differs:value}} of the elements differently, and their SQNR differ by at most {{fp8.ceil_sqnr_gap:value}} dB. Each mean with its 95 % interval over the draws:
""") + "\n" + claims.table(clip_keys)))

# %% [markdown]
# ## 4. NVFP4 against MXFP4
#
# Both store E2M1 elements. MXFP4 shares a power-of-two scale per 32 elements; NVFP4 an E4M3 scale
# (3 mantissa bits) per 16 elements, plus an FP32 per-tensor scale that keeps the block scales in
# E4M3's range. The 16×16 variant (for weights, so that W and Wᵀ share one quantization) uses coarser
# tiles. The random Hadamard transform is not meant to raise SQNR: NVIDIA applies it to the
# weight-gradient operands along the token axis, where it spreads outliers before a GEMM whose result
# it leaves unchanged; here it is applied along the hidden axis of activations, where it mixes each
# outlier into its 16-element chunk. Bars are means over the draws with 95 % intervals.

# %%
fp4_recipes = ["MXFP4 floor", "MXFP4 rceil", "NVFP4 1×16", "NVFP4 16×16", "NVFP4 1×16 + RHT"]
fp4_table = sqnr_table[sqnr_table.recipe.isin(fp4_recipes)].reset_index(drop=True)
fp4_summary = stats.summarize(fp4_table, "sqnr_db", ["recipe", "distribution"])
fig, ax = subplots(width="column", aspect=0.9)
width = 0.8 / len(fp4_recipes)
positions = np.arange(len(synthetic.DISTRIBUTIONS))
for i, label in enumerate(fp4_recipes):
    part = fp4_summary[fp4_summary.recipe == label].set_index("distribution").loc[list(synthetic.DISTRIBUTIONS)]
    ax.bar(positions + (i - (len(fp4_recipes) - 1) / 2) * width, part["mean"], width, color=f"C{i}", label=label,
           yerr=[part["mean"] - part["low"], part["high"] - part["mean"]], error_kw={"linewidth": 0.6})
ax.set_xticks(positions, list(synthetic.DISTRIBUTIONS), rotation=30, ha="right")
ax.set_ylabel(f"SQNR (dB), mean of {draws} draws")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
ax.set_title("FP4 recipes")
save_figure(fig, f"{NAME}_nvfp4_vs_mxfp4")
fp4_table.pivot_table(index="recipe", columns="distribution", values="sqnr_db").loc[fp4_recipes].round(2)

# %%
claims["sqnr.gaussian.NVFP4_1_16-MXFP4_floor"].headline = True
claims["sqnr.outlier_channels.NVFP4_1_16-MXFP4_floor"].headline = True


def gaps(a: str, b: str) -> str:
    return ", ".join(f"{dB(gap(kind, a, b))} ({kind})" for kind in synthetic.DISTRIBUTIONS)


resolved = [k for k in sqnr_keys if claims[k].resolved()]
unresolved = [k for k in sqnr_keys if not claims[k].resolved()]
undecided = "; ".join(f"{{{k}:text}}, {{{k}}}" for k in unresolved)
undecided = (f" Not resolved, and not tested for equivalence either (a gap not found is not a gap shown to be "
             f"zero): {undecided}." if unresolved else "")
display(Markdown(claims.render(f"""
Paired by draw, NVFP4 (1×16) − MXFP4 (FLOOR) is {gaps("NVFP4 1×16", "MXFP4 floor")}. How much of that
is FLOOR's clipping: MXFP4 with RCEIL scales, which never clip, − with FLOOR is
{gaps("MXFP4 rceil", "MXFP4 floor")}. The 16×16 tiles
against 1×16: {gaps("NVFP4 16×16", "NVFP4 1×16")}; the Hadamard transform along the hidden axis against
none: {gaps("NVFP4 1×16 + RHT", "NVFP4 1×16")}. {len(resolved)} of the {len(sqnr_keys)} comparisons are
resolved after Holm's correction; each with its interval and test is in section 2's table.{undecided}
""")))

# %% [markdown]
# ## 5. The bias of stochastic rounding and of round-to-nearest
#
# For inputs spread over E2M1's range, the mean of `sr_draws` stochastic roundings of an input should
# approach it if stochastic rounding is unbiased: within 3 standard errors at about the share of a
# normal distribution within ±3σ. RNE's error is deterministic, a sawtooth. Summed over many steps,
# a bias does not average out; NVIDIA's NVFP4 training recipe rounds gradients stochastically for that
# reason (arXiv 2509.25149).

# %%
inputs = torch.linspace(0.0, 6.0, sr_points)
sr_generator = torch.Generator().manual_seed(seed + 1)
sr_samples = formats.cast(inputs.expand(sr_draws, sr_points).contiguous(), "e2m1", rounding="stochastic",
                          generator=sr_generator)
grid = formats.get_format("e2m1").values().float()
step = grid[torch.searchsorted(grid, inputs, right=True).clamp(max=len(grid) - 1)] - \
    grid[(torch.searchsorted(grid, inputs, right=True) - 1).clamp(min=0)]
sr_table = pd.DataFrame({
    "x": inputs.numpy(),
    "rne_error": (formats.cast(inputs, "e2m1") - inputs).numpy(),
    "sr_mean_error": (sr_samples.double().mean(0) - inputs.double()).numpy(),
    "sr_standard_error": (sr_samples.double().std(0) / math.sqrt(sr_draws)).numpy(),
    "grid_step": step.numpy(),
})
save_csv(sr_table, f"{NAME}_stochastic_rounding")

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
ax.legend()
save_figure(fig, f"{NAME}_stochastic_rounding")

# %%
varies = sr_table[sr_table.sr_standard_error > 0]  # inputs on the grid are rounded exactly, every draw
within = (varies.sr_mean_error.abs() <= 3 * varies.sr_standard_error).mean()
claims.value("sr.within_3se", within, test="computed", digits=3,
             text=f"inputs off the grid (of {len(varies)}) whose mean of {sr_draws} SR draws lies within 3 standard "
                  "errors of x")
claims.value("sr.normal_3se", math.erf(3 / math.sqrt(2)), test="computed", digits=4,
             text="share of a normal distribution within ±3 standard deviations")
claims.value("sr.largest_z", (varies.sr_mean_error.abs() / varies.sr_standard_error).max(), test="computed",
             digits=2, text="largest |mean error| ÷ standard error over those inputs")
claims.value("sr.mean_error", sr_table.sr_mean_error.mean(), test="computed", digits=4,
             text=f"SR: mean error over the {sr_points} evenly spaced inputs (each the mean of {sr_draws} draws)")
claims.value("rne.largest", sr_table.rne_error.abs().max(), test="computed", digits=2,
             text="RNE: largest |round(x) − x| over the inputs")
claims.value("rne.at", sr_table.x[sr_table.rne_error.abs().idxmax()], test="computed", digits=2,
             text="the input x where RNE errs most")
worst = sr_table.loc[sr_table.rne_error.abs().idxmax()]
tie = ", a tie rounded to the even neighbour" if abs(worst.rne_error) == worst.grid_step / 2 else ""
claims.value("rne.mean_error", sr_table.rne_error.mean(), test="computed", digits=4,
             text=f"RNE: mean error over the {sr_points} evenly spaced inputs")
display(Markdown(claims.render(f"""
The mean of {sr_draws} stochastic roundings lies within 3 standard errors of x for {percent("sr.within_3se")}
of the inputs off the grid, where a normal distribution puts {percent("sr.normal_3se")}; the largest
deviation is {{sr.largest_z:value}} standard errors. Averaged over all {sr_points} inputs, SR's error is
{{sr.mean_error:value}}: an average over a fixed, evenly spaced set of inputs (not a random sample, so
no interval; the per-input z-scores above are the test). RNE errs by up to {{rne.largest:value}}
(at x = {{rne.at:value}}{tie}) and by {{rne.mean_error:value}} on average
over the same evenly spaced inputs. These are computed on one set of draws (seed {seed + 1}).
""")))

# %%
claims.save()
pick = sqnr_table[sqnr_table.draw == 0].set_index(["spec", "distribution"]).sqnr_db
mx = clip_table[clip_table.draw == 0].set_index(["recipe", "distribution"]).clipped_blocks
save_metrics(NAME,
             sqnr_mxfp8_gaussian_db=pick["mxfp8", "gaussian"], sqnr_mxfp4_gaussian_db=pick["mxfp4", "gaussian"],
             sqnr_nvfp4_gaussian_db=pick["nvfp4", "gaussian"],
             sqnr_nvfp4_outliers_db=pick["nvfp4", "outlier_channels"],
             sqnr_mxfp4_outliers_db=pick["mxfp4", "outlier_channels"],
             mxfp4_floor_clipped_gaussian=mx["MXFP4 floor", "gaussian"],
             mxfp8_floor_clipped_gaussian=mx["MXFP8 floor", "gaussian"],
             sr_max_abs_mean_error=sr_table.sr_mean_error.abs().max(),
             rne_max_abs_error=sr_table.rne_error.abs().max())
