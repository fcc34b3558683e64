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
# # Welford vs E[X²] − E[X]²: does LayerNorm's variance algorithm matter?
#
# A OneFlow pull request (2021) found its LayerNorm disagreeing with PyTorch's on
# `x = [−1.83965693, −1.82964566]`: one printed ±0.8428, the other ±0.8454, and the gradient of
# `sum(LayerNorm(x))` came out as ±1.4·10⁻³. The thread put the blame on "Welford needing higher
# precision". This notebook measures what each variance algorithm really does, against exact
# rational arithmetic, and what that means for LayerNorm's output and gradients.
#
# Algorithms (all in `qlab.numerics`): **textbook** E[X²] − E[X]², **two-pass** (mean first),
# **Welford**'s update, **pairwise** (Chan et al.'s merge of single elements) and **shifted**
# (textbook on x − x₁). With κ = √(1 + mean²/σ²) and u the unit roundoff of the accumulation
# dtype, the classical bounds on the relative error of S = Σ(x − mean)² are n·κ²·u (textbook),
# n·u + n²κ²u² (two-pass) and n·κ·u (Welford).
#
# Every number in the text is computed from this run's results (the code cells that render it), and
# the claims are saved to `data/02_welford_vs_naive_variance_claims.csv`. The numerical experiments
# of sections 1–5 are deterministic functions of the seed: their errors are medians over the rows
# drawn, not means over seeds. Section 7 measures one CharGPT on its validation batches and each
# packaged model on one batch (a single observation per model); section 8 trains `ln_train_seeds` seeds and pairs every comparison by seed.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
device: str = "auto"  # where torch's own layer_norm runs for comparison: "auto", "cpu" or "cuda"
seed: int = 0  # seeds every random draw
n: int = 1024  # row length for the κ sweeps
trials: int = 8  # rows per κ value; medians and quartiles are plotted
kappa_max: float = 1e7  # largest target condition number
kappa_points: int = 29  # κ values, log-spaced from 1 to kappa_max
n_max_log2: int = 15  # the error-vs-length sweep ends at rows of 2**n_max_log2 elements
kappa_for_length: float = 10.0  # condition number of the rows in the error-vs-length sweep
eps: float = 1e-5  # LayerNorm epsilon (the seed's value)
chargpt_steps: int = 300  # FP32 CharGPT steps before its LayerNorm inputs are measured (section 7)
pretrained_models: list[str] = ["smollm2-135m", "minilm-l6"]  # packaged models measured in section 7
ln_train_seeds: int = 10  # training seeds per LayerNorm variant in section 8
ln_train_steps: int = 300  # steps per run in section 8
margin: float = 0.005  # nats, set before the committed runs (after pilot runs): in section 8 every pair gets a TOST at ±margin
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import math
import re

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import Markdown, display
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from qlab import models, numerics, session, stats
from qlab.claims import Claims
from qlab.plotting import delta_band, save_figure, subplots, use_paper_style
from qlab.results import markdown_table, save_csv, save_metrics
from qlab.runs import run_many

NAME = "02_welford_vs_naive_variance"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if smoke:
    n, trials, kappa_points, n_max_log2 = 64, 2, 7, 8
    chargpt_steps, pretrained_models, ln_train_seeds, ln_train_steps = 2, [], 2, 4
use_paper_style()
generator = torch.Generator().manual_seed(seed)
claims = Claims(this_run)
ALL_DIGITS_LOST = 0.5  # a median relative error of σ² from here on counts as "every digit lost"
print(f"n={n} trials={trials} kappa_points={kappa_points} n_max=2**{n_max_log2} device={device}")


def shown(key: str) -> str:
    """A claim's value with three significant digits ("—" for none): the claims' fixed decimals suit
    neither κ ≈ 10⁶ nor an error of 10⁻⁷ in one table."""
    value = claims[key].value
    return "—" if not math.isfinite(value) else f"{value:.3g}".replace("-", "−")


def key_of(label: str) -> str:
    """``label`` as part of a claim's key (letters, digits and . _ + - only)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label)


def percent(share: float) -> str:
    return f"{100 * share:.0f} %"


def count(key: str) -> str:
    """A claim that counts something, as an integer with thousands separated."""
    return f"{claims[key].value:,.0f}"


def zero_floor(*columns) -> float:
    """The bottom edge of a log axis showing ``columns``: a decade below their smallest positive value.
    Exact zeros are drawn on that edge (``log_curve``), never at a made-up small value."""
    values = np.concatenate([np.asarray(c, dtype=float).ravel() for c in columns])
    positive = values[np.isfinite(values) & (values > 0)]
    return 10.0 ** (math.floor(math.log10(positive.min())) - 1) if len(positive) else 1e-12


def log_curve(ax, x, y, floor, low=None, high=None, **style):
    """``y`` against ``x`` on log axes. An exact zero is not a small number: the line breaks there and a
    hollow triangle on the bottom edge (``floor``) marks it. A band from ``low`` to ``high``
    (quartiles) reaches the bottom edge where its lower quartile is exactly 0."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    zero = y == 0
    (line,) = ax.loglog(x, np.where(zero, np.nan, y), **style)
    if zero.any():
        ax.plot(x[zero], np.full(zero.sum(), floor), linestyle="none", marker="v", markersize=4,
                color=line.get_color(), markerfacecolor="none", clip_on=False)
    if low is not None:
        low = np.maximum(np.asarray(low, dtype=float), floor)
        ax.fill_between(x, low, np.maximum(np.asarray(high, dtype=float), floor), color=line.get_color(),
                        alpha=0.15, linewidth=0)
    ax.set_ylim(bottom=floor)
    return line


ZERO_MARKER = Line2D([], [], linestyle="none", marker="v", markersize=4, markerfacecolor="none",
                     markeredgecolor="0.3", label="exactly 0 (bottom edge)")


def first_kappa(frame: pd.DataFrame, column: str, threshold: float) -> float:
    """The smallest κ (the median κ of the rows at one target) whose median ``column`` reaches
    ``threshold``; infinity if none does."""
    reached = frame[frame[column] >= threshold]
    return float(reached["kappa"].min()) if len(reached) else math.inf


# %% [markdown]
# ## 1. The seed's example
#
# Two float32 numbers, normalised together, no affine, eps = 10⁻⁵. The exact answer below is
# computed from the float32-rounded inputs in rational arithmetic (square root in 50-digit decimal).
# LayerNorm's output always sums to zero, whatever x is, so **the exact gradient of
# `sum(LayerNorm(x))` is zero**; anything else printed is rounding error.

# %%
x_seed = torch.tensor([[-1.83965693, -1.82964566]])
exact_seed = numerics.exact_layer_norm(x_seed, 2, eps)[0]
print(f"exact output: {exact_seed[0].item():+.10f} {exact_seed[1].item():+.10f}")

implementations = {
    "textbook": lambda x: numerics.layer_norm(x, 2, eps=eps, stats="textbook"),
    "two_pass": lambda x: numerics.layer_norm(x, 2, eps=eps, stats="two_pass"),
    "welford": lambda x: numerics.layer_norm(x, 2, eps=eps, stats="welford"),
    f"torch ({device})": lambda x: F.layer_norm(x, (2,), eps=eps),
}
rows = []
for dtype in (torch.float32, torch.float64):
    for label, fn in implementations.items():
        x = x_seed.to(device if label.startswith("torch") else "cpu", dtype).detach().requires_grad_(True)
        y = fn(x)
        y.sum().backward()
        y, g = y.detach().cpu().double()[0], x.grad.cpu().double()[0]
        rows.append({
            "dtype": str(dtype).removeprefix("torch."), "implementation": label,
            "y0": y[0].item(), "y1": y[1].item(), "max_abs_error": (y - exact_seed).abs().max().item(),
            "grad0": g[0].item(), "grad1": g[1].item(),
        })
seed_table = pd.DataFrame(rows)
save_csv(seed_table, f"{NAME}_seed")
seed_table.style.format({c: "{:+.6g}" for c in ["y0", "y1", "max_abs_error", "grad0", "grad1"]})

# %%
seed_fp32 = seed_table[seed_table["dtype"] == "float32"].set_index("implementation")
seed_x = x_seed.double()[0]
seed_rstd = 1 / math.sqrt(seed_x.var(unbiased=False).item() + eps)  # 1/σ of LayerNorm, eps included
claims.value("seed.exact", exact_seed[1].item(), test="computed", digits=6,
             text="exact LayerNorm output of the seed's second element (from its float32 inputs)")
for label in ("textbook", "two_pass", "welford"):
    claims.value(f"seed.{label}", seed_fp32.loc[label, "y1"], test="computed", digits=5,
                 text=f"float32 LayerNorm output of the second element, {label} statistics")
    claims.value(f"seed.error.{label}", seed_fp32.loc[label, "max_abs_error"], test="computed", digits=2,
                 text=f"largest output error against the exact value, float32 {label}")
claims.value("seed.kappa", numerics.condition_number(x_seed).item(), test="computed", digits=1,
             text="condition number κ of the seed's two inputs")
claims.value("seed.kappa_u", claims["seed.kappa"].value * numerics.unit_roundoff(torch.float32), test="computed",
             digits=2, text="κ·u in float32: the size of error a backward-stable variance leaves")
ulp = float(np.spacing(np.float32(abs(exact_seed[1].item()))))
claims.value("seed.ulps.welford", claims["seed.error.welford"].value / ulp, test="computed", digits=1,
             text="Welford's output error in float32 ulps of the output")
claims.value("seed.rstd", seed_rstd, test="computed", digits=1, text="1/√(σ² + eps) of the seed's row")
y0, y1 = seed_fp32.loc["welford", "y0"], seed_fp32.loc["welford", "y1"]
claims.value("seed.grad.welford", seed_fp32.loc["welford", "grad1"], test="computed", digits=2,
             text="gradient of sum(LayerNorm(x)) for the second element, float32 Welford, analytic backward")
claims.value("seed.grad.predicted", -y1 * (y0 + y1) / 2 * seed_rstd, test="computed", digits=2,
             text="−x̂₁·mean(x̂)/σ from the float32 outputs: what the analytic backward leaves when they do "
                  "not sum to zero")
claims.value("seed.grad.torch", abs(seed_fp32.loc[f"torch ({device})", "grad1"]), test="computed", digits=2,
             text=f"|gradient| from torch's own backward ({device})")
claims.value("seed.grad.ratio", claims["seed.grad.welford"].value / claims["seed.grad.predicted"].value,
             test="computed", digits=4, text="the analytic backward's gradient ÷ −x̂₁·mean(x̂)/σ")
SEED_PRINTED = 0.8428  # what the OneFlow PR printed for one of the two LayerNorms (four decimals)
prints = {label: round(abs(claims[f"seed.{label}"].value), 4) == SEED_PRINTED for label in ("textbook", "welford")}
verdict = ("So the seed's ±0.8428 is what an E[X²] − E[X]² implementation prints, and not what Welford prints."
           if prints["textbook"] and not prints["welford"] else "")
display(Markdown(claims.render(f"""
In float32 the textbook formula gives {{seed.textbook:value}} against the exact {{seed.exact:value}}, an
error of {{seed.error.textbook:value}}: {"the" if prints["textbook"] else "not the"} seed's ±0.8428 at four
decimals. Two-pass and Welford err {{seed.error.two_pass:value}} and {{seed.error.welford:value}} (Welford: {shown("seed.ulps.welford")} float32 ulps), the size of κ·u = {{seed.kappa_u:value}} for these two nearly
equal numbers (κ = {shown("seed.kappa")}). {verdict} The gradient of the analytic backward,
{{seed.grad.welford:value}} where the exact one is 0, is {{seed.grad.ratio:value}} times the
−x̂₁·mean(x̂)/σ = {{seed.grad.predicted:value}} that its float32 outputs leave when they do not sum to zero
(1/σ = {shown("seed.rstd")}); torch's backward ({device}) gives {shown("seed.grad.torch")}. All of these are
exact computations on one input, not statistics.
""")))

# %% [markdown]
# ## 2. Relative error of the variance vs condition number
#
# Rows of length n with prescribed κ (unit RMS, so nothing overflows in float16), rounded to
# each input dtype; the reference is the exact variance of the rounded rows, and κ on the x-axis is
# measured on them. Every operation is rounded in the accumulation dtype. Lines are medians over the
# `trials` rows of each κ, bands their quartiles; an error of 1 or more is drawn at 1 (every digit
# lost), an error of exactly 0 as a hollow triangle on the bottom edge. Dashed guides show the
# slopes u·κ and u·κ².

# %%
CONFIGS = [  # label, input dtype, accumulation dtype
    ("fp32", torch.float32, torch.float32),
    ("fp16", torch.float16, torch.float16),
    ("fp16, fp32 acc.", torch.float16, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("bf16, fp32 acc.", torch.bfloat16, torch.float32),
]
ALGORITHMS = list(numerics.ALGORITHMS)
kappa_targets = np.logspace(0, math.log10(kappa_max), kappa_points)
base_rows = numerics.rows_with_condition_number(kappa_targets, n, trials, dtype=torch.float64, generator=generator)

records = []
for label, in_dtype, acc_dtype in session.progress(CONFIGS, desc="κ sweep"):
    x = base_rows.to(in_dtype)
    _, exact_var = numerics.exact_moments(x)
    kappa = numerics.condition_number(x)
    distinct = (x.sort(dim=1).values.diff(dim=1) != 0).sum(dim=1) + 1  # distinct values in each rounded row
    for algorithm in ALGORITHMS:
        var = numerics.variance(x, algorithm, acc_dtype=acc_dtype).double()
        rel_error = ((var - exact_var).abs() / exact_var).clamp(max=1.0)  # 1 = every digit lost
        records.append(pd.DataFrame({
            "config": label, "input_dtype": str(in_dtype).removeprefix("torch."),
            "acc_dtype": str(acc_dtype).removeprefix("torch."), "algorithm": algorithm,
            "kappa_target": np.repeat(kappa_targets, trials), "trial": np.tile(np.arange(trials), kappa_points),
            "kappa": kappa.numpy(), "distinct_values": distinct.numpy(), "rel_error": rel_error.numpy(),
        }))
kappa_table = pd.concat(records, ignore_index=True)
kappa_table = kappa_table[np.isfinite(kappa_table["kappa"])]  # rows the dtype rounded to a constant
save_csv(kappa_table, f"{NAME}_kappa")


# %%
def quartile(q):
    return lambda s: s.quantile(q)


summary = (kappa_table.groupby(["config", "algorithm", "kappa_target"], sort=False)
           .agg(kappa=("kappa", "median"), rel_error=("rel_error", "median"),
                low=("rel_error", quartile(0.25)), high=("rel_error", quartile(0.75))).reset_index())
floor = zero_floor(summary["rel_error"], summary["low"])
fig, axes = subplots(2, 3, width="text", aspect=0.75, sharex=True, sharey=True)
for ax, (label, _, acc_dtype) in zip(axes.flat, CONFIGS):
    u = numerics.unit_roundoff(acc_dtype)
    for algorithm in ALGORITHMS:
        part = summary[(summary["config"] == label) & (summary["algorithm"] == algorithm)]
        log_curve(ax, part["kappa"], part["rel_error"], floor, part["low"], part["high"], marker="o",
                  markersize=2.5, label=algorithm)
    k = np.logspace(0, math.log10(kappa_max), 50)
    ax.loglog(k, u * k, "k--", lw=0.7, label="u·κ")
    ax.loglog(k, u * k * k, "k:", lw=0.7, label="u·κ²")
    ax.set_title(label)
    ax.set_ylim(floor, 2)
for ax in axes[1]:
    ax.set_xlabel("condition number κ")
for ax in axes[:, 0]:
    ax.set_ylabel("relative error of σ²")
axes.flat[-1].axis("off")
handles, labels = axes.flat[0].get_legend_handles_labels()
axes.flat[-1].legend(handles + [ZERO_MARKER], labels + [ZERO_MARKER.get_label()], loc="center",
                     title="median and quartiles of the rows;\nan error ≥ 1 is drawn at 1")
save_figure(fig, f"{NAME}_kappa")

# %%
KAPPA_LOW = 100.0  # the errors quoted for bf16 accumulation are over κ up to this
SLOPE_BELOW = 0.1  # textbook's slope is fitted where its median error is below this (before it saturates)
ACC32 = [label for label, _, acc_dtype in CONFIGS if acc_dtype == torch.float32]
rule_rows = []
for label, _, acc_dtype in CONFIGS:
    claims.value(f"rule.{key_of(label)}", numerics.unit_roundoff(acc_dtype) ** -0.5, test="computed", digits=1,
                 text=f"{label}: the rule of thumb u^(−1/2) for the κ at which textbook fails")
    row = {"configuration": label, "u^(−1/2)": shown(f"rule.{key_of(label)}")}
    for algorithm in ALGORITHMS:
        part = summary[(summary["config"] == label) & (summary["algorithm"] == algorithm)]
        claims.value(f"k50.{key_of(label)}.{algorithm}", first_kappa(part, "rel_error", ALL_DIGITS_LOST), n=trials,
                     test="estimate", digits=2, text=f"{label}, {algorithm}: smallest κ whose median relative error of σ² "
                                    f"reaches {percent(ALL_DIGITS_LOST)} (none: inf)")
        row[algorithm] = shown(f"k50.{key_of(label)}.{algorithm}")
    rule_rows.append(row)
textbook_first = [label for label, _, _ in CONFIGS
                  if claims[f"k50.{key_of(label)}.textbook"].value < claims[f"rule.{key_of(label)}"].value]
claims.value("k50.textbook_before_rule", len(textbook_first), test="computed", digits=0,
             text=f"configurations (of {len(CONFIGS)}) in which textbook fails before u^(−1/2)")
others_fail = [(label, a) for label in ACC32 for a in ALGORITHMS[1:]
               if math.isfinite(claims[f"k50.{key_of(label)}.{a}"].value)]
claims.value("k50.acc32_others", len(others_fail), test="computed", digits=0,
             text=f"(configuration, algorithm) pairs (of {len(ACC32) * (len(ALGORITHMS) - 1)}) other than textbook "
                  f"with float32 accumulation whose median error reaches {percent(ALL_DIGITS_LOST)}")
textbook32 = summary[(summary["config"] == "fp32") & (summary["algorithm"] == "textbook")
                     & (summary["kappa"] >= 2) & (summary["rel_error"] > 0) & (summary["rel_error"] < SLOPE_BELOW)]
if len(textbook32) >= 2:
    slope = np.polyfit(np.log10(textbook32["kappa"]), np.log10(textbook32["rel_error"]), 1)[0]
    claims.value("slope.fp32.textbook", slope, n=len(textbook32), test="estimate", digits=2,
                 text=f"fp32 textbook: least-squares slope of log median error against log κ (errors below {SLOPE_BELOW:g})")

acc32 = summary[summary["config"].isin(ACC32) & (summary["algorithm"] != "textbook")]
worst = acc32.loc[acc32["rel_error"].idxmax()]
worst_where = f"{worst['config']}, {worst['algorithm']}, κ ≈ {worst['kappa']:.3g}"
claims.value("worst.acc32", worst["rel_error"], n=trials, test="estimate", digits=2,
             text=f"largest median error of two-pass, Welford, pairwise or shifted with float32 accumulation "
                  f"({worst_where})")
low_kappa = summary[(summary["config"] == "bf16") & (summary["kappa"] <= KAPPA_LOW)]
for algorithm in ("welford", "shifted", "pairwise"):
    part = low_kappa[low_kappa["algorithm"] == algorithm]["rel_error"]
    for end, value in (("min", part.min()), ("max", part.max())):
        claims.value(f"bf16.{algorithm}.{end}", value, n=trials, test="estimate", digits=2,
                     text=f"bf16 accumulation, {algorithm}: {end}imum median error over κ ≤ {KAPPA_LOW:g}")

zero = kappa_table["rel_error"] == 0
zero_configs = kappa_table[kappa_table["config"].isin(kappa_table[zero]["config"].unique())]
claims.value("zeros.rows", int(zero.sum()), test="computed", digits=1,
             text=f"rows (of {len(kappa_table)} config × algorithm × row results) whose variance is exact")
if zero.any():
    claims.value("zeros.distinct", kappa_table[zero]["distinct_values"].median(), test="computed", digits=1,
                 text="median number of distinct values in those rows")
    claims.value("nonzero.distinct", zero_configs[zero_configs["rel_error"] > 0]["distinct_values"].median(),
                 test="computed", digits=1,
                 text="median number of distinct values in the other rows of the same configurations")

text = f"""
**Textbook**'s median error reaches {percent(ALL_DIGITS_LOST)} at κ ≈ {shown("k50.fp32.textbook")} in float32;
in {{k50.textbook_before_rule:value}} of the {len(CONFIGS)} configurations it gets there before the rule of
thumb κ ≈ u^(−1/2).
"""
if "slope.fp32.textbook" in claims:
    text += f"""
In float32, below an error of {SLOPE_BELOW:g}, its median error grows as κ to the power {{slope.fp32.textbook:value}}
(least-squares slope over {{slope.fp32.textbook:n}} κ values; the bound n·κ²·u has slope 2).
"""
text += f"""
The κ at which each algorithm's median error first reaches {percent(ALL_DIGITS_LOST)} (— : not within
κ ≤ {kappa_max:.3g}), medians over {trials} rows per κ:
"""
display(Markdown(claims.render(text) + "\n" + markdown_table(pd.DataFrame(rule_rows)) + "\n\n" + claims.render(f"""
With **float32 accumulation** (the fp32 panel and both 16-bit-input panels with fp32 acc.),
{{k50.acc32_others:value}} of the two-pass, Welford, pairwise and shifted curves reach {percent(ALL_DIGITS_LOST)}; the largest median error any of them shows is {shown("worst.acc32")} ({worst_where}).
**bfloat16 accumulation** is different: its sequential sums stagnate (section 3), so over κ ≤ {KAPPA_LOW:g}
sequential Welford's median error lies between {shown("bf16.welford.min")} and {shown("bf16.welford.max")},
the shifted formula's between {shown("bf16.shifted.min")} and {shown("bf16.shifted.max")}, and the
pairwise merge's between {shown("bf16.pairwise.min")} and {shown("bf16.pairwise.max")}.
""")))
if zero.any():
    display(Markdown(claims.render(f"""
Where the input dtype can barely resolve σ (the right end of the curves), some variances come out
exact: {count("zeros.rows")} row results, drawn as triangles. Those rows hold a median of {shown("zeros.distinct")} distinct values, against {shown("nonzero.distinct")} in the other rows of the
same configurations; which algorithms return them exactly differs (the figure marks each).
""")))

# %% [markdown]
# ## 3. Error vs row length: sequential vs pairwise
#
# Sequential accumulation adds error at every step (~n·u in the worst case, √n·u typically);
# a pairwise tree only log₂ n. PyTorch's CPU LayerNorm runs Welford inside chunks and merges the
# chunks pairwise ("welford, chunk 16" below). In 16-bit accumulation a running sum stops growing
# once the increments fall below half an ulp, and Welford's running mean stops moving once δ/k
# does. Lines are medians over the `trials` rows of each length, bands their quartiles.

# %%
LENGTH_CONFIGS = [c for c in CONFIGS if c[0] in ("fp32", "fp16", "bf16")]
LENGTH_VARIANTS = {  # label -> (algorithm, chunk)
    "textbook": ("textbook", None), "welford": ("welford", None),
    "welford, chunk 16": ("welford", 16), "pairwise": ("pairwise", None),
}
lengths = [2 ** k for k in range(4, n_max_log2 + 1)]
length_rows = numerics.rows_with_condition_number([kappa_for_length], lengths[-1], trials,
                                                  dtype=torch.float64, generator=generator)
records = []
for label, in_dtype, acc_dtype in session.progress(LENGTH_CONFIGS, desc="length sweep"):
    for length in lengths:
        x = length_rows[:, :length].to(in_dtype)
        _, exact_var = numerics.exact_moments(x)
        for variant, (algorithm, chunk) in LENGTH_VARIANTS.items():
            var = numerics.variance(x, algorithm, acc_dtype=acc_dtype, chunk=chunk).double()
            rel_error = ((var - exact_var).abs() / exact_var).clamp(max=1.0)
            records.append(pd.DataFrame({"config": label, "variant": variant, "n": length,
                                         "trial": np.arange(trials), "rel_error": rel_error.numpy()}))
length_table = pd.concat(records, ignore_index=True)
save_csv(length_table, f"{NAME}_length")

length_summary = (length_table.groupby(["config", "variant", "n"], sort=False)["rel_error"]
                  .agg(median="median", low=quartile(0.25), high=quartile(0.75)).reset_index())
floor = zero_floor(length_summary["median"], length_summary["low"])
fig, axes = subplots(1, len(LENGTH_CONFIGS), width="text", aspect=0.9)
for ax, (label, _, acc_dtype) in zip(axes, LENGTH_CONFIGS):
    for variant in LENGTH_VARIANTS:
        part = length_summary[(length_summary["config"] == label) & (length_summary["variant"] == variant)]
        log_curve(ax, part["n"], part["median"], floor, part["low"], part["high"], marker="o", markersize=2.5,
                  label=variant)
    ax.loglog(lengths, [min(numerics.unit_roundoff(acc_dtype) * m, 1.0) for m in lengths], "k--", lw=0.7, label="u·n")
    ax.set_title(f"{label} (κ = {kappa_for_length:g})")
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    shown_lengths = lengths[:: max(1, len(lengths) // 6)]
    ax.set_xticks(shown_lengths, [f"$2^{{{int(math.log2(m))}}}$" for m in shown_lengths])
    ax.set_xlabel("row length n")
    ax.set_ylim(floor, 2)
axes[0].set_ylabel("relative error of σ² (capped at 1)")
handles, labels = axes[0].get_legend_handles_labels()
if (length_summary["median"] == 0).any():
    handles, labels = handles + [ZERO_MARKER], labels + [ZERO_MARKER.get_label()]
fig.legend(handles, labels, loc="outside right center")
save_figure(fig, f"{NAME}_length")

# %%
for label, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    total, one = torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)
    while total + one != total:
        total = total + one
    claims.value(f"stall.{label}", total.item(), test="computed", digits=1,
                 text=f"where a {label} running sum of ones stops growing")
length_cells = []
for label, _, _ in LENGTH_CONFIGS:
    cells = {"configuration": label}
    for variant in LENGTH_VARIANTS:
        part = length_summary[(length_summary["config"] == label) & (length_summary["variant"] == variant)]
        key = f"length.{label}.{key_of(variant)}"
        for end, row in (("first", part.iloc[0]), ("last", part.iloc[-1])):
            claims.value(f"{key}.{end}", row["median"], n=trials, test="estimate", digits=2,
                         text=f"{label}, {variant}: median relative error of σ² at n = {row['n']}")
        first, last = part.iloc[0]["median"], part.iloc[-1]["median"]
        claims.value(f"{key}.growth", last / first if first > 0 else math.inf, n=trials, test="estimate", digits=2,
                     text=f"{label}, {variant}: median error at n = {lengths[-1]} ÷ at n = {lengths[0]}")
        cells[variant] = f"{shown(f'{key}.first')} → {shown(f'{key}.last')} (×{shown(f'{key}.growth')})"
    length_cells.append(cells)


def growth(label: str, variant: str) -> str:
    return shown(f"length.{label}.{key_of(variant)}.growth")


display(Markdown(claims.render(f"""
A float16 running sum of ones stops growing at {count("stall.fp16")}, a bfloat16 one at {count("stall.bf16")}. Median relative error of σ² at n = {lengths[0]} → n = {lengths[-1]} and its growth
(κ = {kappa_for_length:g}, {trials} rows):
""") + "\n" + markdown_table(pd.DataFrame(length_cells)) + "\n\n" + claims.render(f"""
From n = {lengths[0]} to n = {lengths[-1]}, sequential Welford's median error grows ×{growth("fp16", "welford")}
in float16 and ×{growth("bf16", "welford")} in bfloat16; Welford in chunks of 16 ×{growth("fp16", "welford, chunk 16")}
and ×{growth("bf16", "welford, chunk 16")}, the pairwise merge ×{growth("fp16", "pairwise")} and
×{growth("bf16", "pairwise")}.
""")))

# %% [markdown]
# ## 4. The practical consequence: LayerNorm output and gradient error vs κ
#
# float32 rows with σ = 1 and growing mean (so eps is negligible), normalised by `qlab.numerics.layer_norm`
# with each statistics algorithm and by `torch.nn.functional.layer_norm` on this machine. Reference:
# the same float32 inputs through a float64 two-pass LayerNorm (its own error, ≲ n·2⁻⁵³ + n²κ²2⁻¹⁰⁶,
# is far under every float32 error plotted). Output error is the largest absolute
# error over the row (outputs are O(1)); gradient error is the max-norm relative error of dL/dx for a
# random upstream gradient. Lines are medians over the `trials` rows of each κ, bands their quartiles.

# %%
ln_x = numerics.rows_with_condition_number(kappa_targets, n, trials, std=1.0, dtype=torch.float32,
                                           generator=generator)
ln_kappa = numerics.condition_number(ln_x)
upstream = torch.randn(ln_x.shape, generator=generator)
ref_x = ln_x.double().requires_grad_(True)
ref_y = numerics.reference_layer_norm(ref_x, n, eps=eps)
(ref_grad,) = torch.autograd.grad(ref_y, ref_x, upstream.double())
ref_y = ref_y.detach()

ln_implementations = {
    "textbook": lambda x: numerics.layer_norm(x, n, eps=eps, stats="textbook"),
    "two_pass": lambda x: numerics.layer_norm(x, n, eps=eps, stats="two_pass"),
    "welford": lambda x: numerics.layer_norm(x, n, eps=eps, stats="welford"),
    f"torch ({device})": lambda x: F.layer_norm(x, (n,), eps=eps),
}
records = []
for label, fn in session.progress(ln_implementations.items(), total=len(ln_implementations), desc="LayerNorms"):
    x = ln_x.to(device if label.startswith("torch") else "cpu").detach().requires_grad_(True)
    y = fn(x)
    (grad,) = torch.autograd.grad(y, x, upstream.to(x.device))
    out_error = (y.detach().cpu().double() - ref_y).abs().amax(dim=1)
    grad_error = (grad.cpu().double() - ref_grad).abs().amax(dim=1) / ref_grad.abs().amax(dim=1)
    records.append(pd.DataFrame({"implementation": label, "kappa_target": np.repeat(kappa_targets, trials),
                                 "trial": np.tile(np.arange(trials), kappa_points), "kappa": ln_kappa.numpy(),
                                 "output_abs_error": out_error.numpy(), "grad_rel_error": grad_error.numpy()}))
ln_table = pd.concat(records, ignore_index=True)
save_csv(ln_table, f"{NAME}_layernorm")

grouped = ln_table.groupby(["implementation", "kappa_target"], sort=False)
ln_summary = grouped.median(numeric_only=True).reset_index()
ln_low = grouped.quantile(0.25, numeric_only=True).reset_index()
ln_high = grouped.quantile(0.75, numeric_only=True).reset_index()
COLUMNS = ("output_abs_error", "grad_rel_error")
floors = {c: zero_floor(ln_summary[c], ln_low[c]) for c in COLUMNS}
fig, axes = subplots(1, 2, width="text", aspect=0.65)
for label in ln_implementations:
    chosen = ln_summary["implementation"] == label
    part = ln_summary[chosen]
    style = {"ls": "--", "marker": "x"} if label.startswith("torch") else {"marker": "o"}
    for ax, column in zip(axes, COLUMNS):
        log_curve(ax, part["kappa"], part[column], floors[column], ln_low[chosen][column], ln_high[chosen][column],
                  label=label, markersize=3, **style)
axes[0].set_ylabel("max |y − y_ref| (median, quartiles)")
axes[1].set_ylabel("rel. error of dL/dx (median, quartiles)")
for ax in axes:
    ax.set_xlabel("condition number κ (float32 input)")
handles, labels = axes[0].get_legend_handles_labels()
if any((ln_summary[c] == 0).any() for c in COLUMNS):
    handles, labels = handles + [ZERO_MARKER], labels + [ZERO_MARKER.get_label()]
fig.legend(handles, labels, loc="outside right center")
save_figure(fig, f"{NAME}_layernorm")

# %%
OUTPUT_WRONG, GRADIENT_WRONG = 0.1, 0.5  # an output off by a tenth of σ; a gradient off by half its size
u32 = numerics.unit_roundoff(torch.float32)
for label in ln_implementations:
    part = ln_summary[ln_summary["implementation"] == label]
    key = label.split(" ")[0]
    claims.value(f"ln.{key}.output", first_kappa(part, "output_abs_error", OUTPUT_WRONG), n=trials, test="estimate", digits=2,
                 text=f"{label}: smallest κ whose median output error reaches {OUTPUT_WRONG:g} (none: inf)")
    claims.value(f"ln.{key}.gradient", first_kappa(part, "grad_rel_error", GRADIENT_WRONG), n=trials, test="estimate", digits=2,
                 text=f"{label}: smallest κ whose median gradient error reaches {percent(GRADIENT_WRONG)} (none: inf)")
    claims.value(f"ln.{key}.per_u_kappa", (part["output_abs_error"] / (u32 * part["kappa"])).max(), n=trials, test="estimate",
                 digits=1, text=f"{label}: largest median output error ÷ (u·κ) over the sweep")
display(Markdown(claims.render(f"""
With the textbook statistics, the median output error reaches {OUTPUT_WRONG:g} at κ ≈ {shown("ln.textbook.output")} and the median gradient error {percent(GRADIENT_WRONG)} at κ ≈ {shown("ln.textbook.gradient")}. For two-pass and Welford those κ are {shown("ln.two_pass.output")} / {shown("ln.two_pass.gradient")} and {shown("ln.welford.output")} / {shown("ln.welford.gradient")}
(— : not reached up to κ = {kappa_max:.3g}), and torch's LayerNorm on {device} {shown("ln.torch.output")} / {shown("ln.torch.gradient")}. Measured against float32's u·κ, the largest median output error is {shown("ln.two_pass.per_u_kappa")} × u·κ for two-pass, {shown("ln.welford.per_u_kappa")} × u·κ for
Welford and {shown("ln.torch.per_u_kappa")} × u·κ for torch, against {shown("ln.textbook.per_u_kappa")}
× u·κ for textbook. The choice matters for rows with a large common offset (large κ); §7 measures
whether the inputs real models feed their LayerNorms have one.
""")))

# %% [markdown]
# ## 5. Catching the seed's other bug: swapped γ/β gradients
#
# The OneFlow PR also fixed an argument-order mistake that handed the weight's gradient to the
# bias and vice versa. The forward is untouched, so no output comparison can see it;
# `numerics.check_layer_norm_grads` compares every gradient with autograd through an independent
# float64 LayerNorm and names what is wrong.

# %%
checked = {
    "torch.nn.functional.layer_norm": F.layer_norm,
    "qlab layer_norm (welford)": numerics.layer_norm,
    "qlab layer_norm (textbook)": lambda *a: numerics.layer_norm(*a, stats="textbook"),
    "swapped γ/β gradients (seed bug)": numerics.layer_norm_swapped_affine_grads,
}
check_tables, diagnoses = [], {}
for label, fn in checked.items():
    result = numerics.check_layer_norm_grads(fn, seed=seed)
    diagnoses[label] = result.diagnosis
    print(f"{label:>34}: {result.diagnosis}")
    check_tables.append(result.table.assign(implementation=label))
check_table = pd.concat(check_tables, ignore_index=True)[["implementation", "quantity", "error", "tolerance", "ok"]]
save_csv(check_table, f"{NAME}_gradcheck")

fig, ax = subplots(width="text", aspect=0.4)
quantities = list(check_table["quantity"].unique())
width = 0.8 / len(checked)
for i, label in enumerate(checked):
    part = check_table[check_table["implementation"] == label]
    ax.bar(np.arange(len(quantities)) + (i - (len(checked) - 1) / 2) * width, part["error"], width, label=label)
ax.axhline(check_table["tolerance"].iloc[0], color="k", ls="--", lw=0.7, label="tolerance")
ax.set_yscale("log")  # every error here is positive: a bar that is missing would be an error of 0
ax.set_xticks(np.arange(len(quantities)), quantities)
ax.set_ylabel("normwise rel. error vs float64")
ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
save_figure(fig, f"{NAME}_gradcheck")

# %%
SWAPPED = "swapped γ/β gradients (seed bug)"
correct = check_table[check_table["implementation"] != SWAPPED]
swapped = check_table[(check_table["implementation"] == SWAPPED) & check_table["quantity"].isin(["d_weight", "d_bias"])]
claims.value("gradcheck.correct_max", correct["error"].max(), test="computed", digits=2,
             text="largest error of the three correct LayerNorms, any output or gradient")
claims.value("gradcheck.tolerance", check_table["tolerance"].iloc[0], test="computed", digits=2,
             text="the check's tolerance in float32")
claims.value("gradcheck.swapped_min", swapped["error"].min(), test="computed", digits=2,
             text="smaller of the swapped version's d_weight and d_bias errors")
display(Markdown(claims.render(f"""
The three correct implementations stay within {{gradcheck.correct_max:value}} of float64 everywhere
(tolerance {{gradcheck.tolerance:value}}); the swapped version's d_weight and d_bias err at least
{{gradcheck.swapped_min:value}} while its output and d_input pass, and the check says:
"{diagnoses[SWAPPED]}".
""")))

# %% [markdown]
# ## 6. On a GPU: the Triton LayerNorm kernel's three statistics
#
# Runs only when CUDA is present. The same rows and reference as section 4, through
# `qlab.kernels.layer_norm(..., backend="triton")` with each statistics mode: float32 accumulation,
# Welford as a Chan-merge tree (what CUDA LayerNorms do across a warp), two-pass, and the textbook
# E[X²]−E[X]² clamped at zero. Writes `data/02_welford_vs_naive_variance_gpu.csv` and its figure
# (medians over the rows of each κ; no claims are made from it).

# %%
if torch.cuda.is_available():
    from qlab.kernels import layer_norm as kernel_layer_norm

    gpu_records = []
    for statistics in ("textbook", "two_pass", "welford"):
        x = ln_x.to("cuda").requires_grad_(True)
        y = kernel_layer_norm(x, (n,), eps=eps, stats=statistics, backend="triton")
        (grad,) = torch.autograd.grad(y, x, upstream.to("cuda"))
        out_error = (y.detach().cpu().double() - ref_y).abs().amax(dim=1)
        grad_error = (grad.cpu().double() - ref_grad).abs().amax(dim=1) / ref_grad.abs().amax(dim=1)
        gpu_records.append(pd.DataFrame({"stats": statistics, "kappa_target": np.repeat(kappa_targets, trials),
                                         "kappa": ln_kappa.numpy(), "output_abs_error": out_error.numpy(),
                                         "grad_rel_error": grad_error.numpy()}))
    gpu_table = pd.concat(gpu_records, ignore_index=True)
    save_csv(gpu_table, f"{NAME}_gpu")
    gpu_summary = gpu_table.groupby(["stats", "kappa_target"], sort=False).median(numeric_only=True).reset_index()
    fig, axes = subplots(1, 2, width="text", aspect=0.65)
    for statistics in ("textbook", "two_pass", "welford"):
        part = gpu_summary[gpu_summary["stats"] == statistics]
        for ax, column in zip(axes, COLUMNS):
            log_curve(ax, part["kappa"], part[column], zero_floor(gpu_summary[column]), marker="o", label=statistics)
    axes[0].set_ylabel("max |y − y_ref| (median)")
    axes[1].set_ylabel("rel. error of dL/dx (median)")
    for ax in axes:
        ax.set_xlabel("condition number κ (float32 input)")
    handles, labels = axes[0].get_legend_handles_labels()
    if any((gpu_summary[c] == 0).any() for c in COLUMNS):
        handles, labels = handles + [ZERO_MARKER], labels + [ZERO_MARKER.get_label()]
    fig.legend(handles, labels, loc="outside right center")
    fig.suptitle(f"Triton LayerNorm on {torch.cuda.get_device_name()}")
    save_figure(fig, f"{NAME}_gpu")
else:
    print("no CUDA device: the GPU section is skipped (it needs the Triton kernels on a GPU)")

# %% [markdown]
# ## 7. Does it matter in practice? κ of the rows real models normalise
#
# Here: κ of every row each normalisation layer receives, in a CharGPT trained `chargpt_steps` FP32
# steps (on 8 validation batches) and in the packaged pretrained models on held-out Shakespeare
# (`numerics.norm_input_conditions`, float64 two-pass moments; it counts the rows at κ ≥ 2 and
# κ ≥ 10³). Only a **LayerNorm** subtracts the mean, so only its rows can show the E[X²] − E[X]²
# cancellation and only they are counted below. SmolLM2 (Llama) normalises with RMSNorm, which
# subtracts no mean: its rows are drawn for reference (the κ a LayerNorm in its place would face)
# and counted nowhere.

# %%
from qlab.train import TrainConfig, train  # noqa: E402
from qlab.train.loop import Batches  # noqa: E402

config = TrainConfig(steps=chargpt_steps, batch_size=16, seed=seed, progress=False, eval_every=max(chargpt_steps, 1))
if smoke:
    config = config.replace(layers=1, width=32, context=32, batch_size=4, eval_batches=1)
chargpt = train(config).model.eval()
validation = Batches(config).validation()
frames = [numerics.norm_input_conditions(
    chargpt, lambda: [chargpt(ids) for ids, _ in validation]).assign(model=f"CharGPT ({chargpt_steps} steps)")]
for name in pretrained_models:
    pretrained, tokenizer = models.load(name)
    batch = models.shakespeare_batches(tokenizer, 4, 128, 1, seed=seed)[0]
    frames.append(numerics.norm_input_conditions(pretrained, lambda: pretrained(input_ids=batch)).assign(model=name))
norm_kappa = pd.concat(frames, ignore_index=True)
save_csv(norm_kappa, f"{NAME}_model_kappa")
norm_kappa.groupby(["model", "kind"]).agg(layers=("layer", "nunique"), rows=("rows", "sum"),
                                         kappa_median=("kappa_median", "median"),
                                         kappa_p99_max=("kappa_p99", "max"), kappa_max=("kappa_max", "max"),
                                         bf16_risk=("bf16_textbook_fraction", "mean"),
                                         fp32_risk=("fp32_textbook_fraction", "mean")).round(3)

# %%
per_layer = norm_kappa.groupby(["model", "kind", "layer"], sort=False).agg(
    kappa_median=("kappa_median", "median"), kappa_max=("kappa_max", "max")).reset_index()
floor = zero_floor(per_layer["kappa_median"] - 1)
fig, ax = subplots(width="text", aspect=0.45)
for i, ((label, kind), part) in enumerate(per_layer.groupby(["model", "kind"], sort=False)):
    positions = np.arange(len(part))
    note = " (RMSNorm: reference only)" if kind == "RMSNorm" else ""
    log_curve(ax, positions, part.kappa_median - 1, floor, linestyle="none", marker="o", color=f"C{i}",
              label=f"{label}{note}: median row")
    log_curve(ax, positions, part.kappa_max - 1, floor, linestyle="none", marker="^", color=f"C{i}",
              markerfacecolor="none", label=f"{label}{note}: worst row")
ax.set_xscale("linear")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.axhline(1, color="grey", linestyle=":", linewidth=0.8)
ax.text(0, 1.4, "κ = 2 (counted)", color="grey")
ax.axhline(999, color="grey", linestyle="--", linewidth=0.8)
ax.text(0, 1400, "κ = 10³ (counted)", color="grey")
ax.set_ylim(floor, 1e4)
ax.set_xlabel("normalisation layer (model order)")
ax.set_ylabel("κ − 1 of its input rows")
handles, labels = ax.get_legend_handles_labels()
if ((per_layer[["kappa_median", "kappa_max"]] - 1) == 0).any().any():
    handles, labels = handles + [ZERO_MARKER], labels + [ZERO_MARKER.get_label()]
ax.legend(handles, labels, loc="center left", bbox_to_anchor=(1.02, 0.5))
save_figure(fig, f"{NAME}_model_kappa")

# %%
layer_norm_rows = norm_kappa[norm_kappa["kind"] == "LayerNorm"]
rms_rows = norm_kappa[norm_kappa["kind"] == "RMSNorm"]
ln_models = list(dict.fromkeys(layer_norm_rows["model"]))
SEEN = f"CharGPT on its {len(validation)} validation batches, each packaged model on one batch"
claims.value("model.rows", layer_norm_rows["rows"].sum(), test="computed", digits=1,
             text=f"LayerNorm input rows measured ({', '.join(ln_models)})")
claims.value("model.layers", len(layer_norm_rows), test="computed", digits=1,
             text="LayerNorm calls measured (layer × batch)")
claims.value("model.rows_ge_2", float((layer_norm_rows["bf16_textbook_fraction"] * layer_norm_rows["rows"]).sum()),
             test="observed", digits=0, headline=True,
             text=f"LayerNorm input rows with κ ≥ 2, of {layer_norm_rows['rows'].sum()} ({SEEN})")
claims.value("model.rows_ge_1000", float((layer_norm_rows["fp32_textbook_fraction"] * layer_norm_rows["rows"]).sum()),
             test="observed", digits=0, text="LayerNorm input rows with κ ≥ 10³")
claims.value("model.kappa_max", layer_norm_rows["kappa_max"].max(), test="observed", digits=3, headline=True,
             text=f"largest κ of any LayerNorm input row ({SEEN})")
claims.value("model.kappa_median", layer_norm_rows["kappa_median"].max(), test="observed", digits=4,
             text="largest per-layer median κ of the LayerNorm input rows")
if len(rms_rows):
    claims.value("model.rms_kappa_max", rms_rows["kappa_max"].max(), test="observed", digits=3,
                 text="largest κ of any RMSNorm input row, were it mean-centred (SmolLM2)")
textbook_fp32 = summary[(summary["config"] == "fp32") & (summary["algorithm"] == "textbook")]
bracket = textbook_fp32[textbook_fp32["kappa_target"] >= claims["model.kappa_max"].value]["kappa_target"]
if len(bracket):
    near = textbook_fp32[textbook_fp32["kappa_target"] <= bracket.min()]
    claims.value("model.textbook_fp32_error", near["rel_error"].max(), n=trials, test="estimate", digits=2,
                 text=f"section 2: largest median error of float32 textbook σ² at κ ≤ {bracket.min():.3g}")
below = claims["model.kappa_max"].value < min(claims["k50.bf16.textbook"].value, claims["k50.fp32.textbook"].value)
text = f"""
Over {count("model.rows")} LayerNorm input rows ({count("model.layers")} layer calls of {" and ".join(ln_models)}), {count("model.rows_ge_2")} rows reach κ = 2 and {count("model.rows_ge_1000")}
reach κ = 10³; the largest κ of any row is {{model.kappa_max:value}} and the largest per-layer median
{{model.kappa_median:value}}. {SEEN}, one seed: a single observation per model. Section 2's
textbook median error reaches {percent(ALL_DIGITS_LOST)} at κ ≈ {shown("k50.bf16.textbook")} in bfloat16
accumulation and κ ≈ {shown("k50.fp32.textbook")} in float32: {"both above every one of these rows" if below
else "some of these rows reach that"}.
"""
if "model.textbook_fp32_error" in claims:
    text += """
On section 2's synthetic rows of κ up to the first target above that largest κ, float32 textbook σ²
erred at most {model.textbook_fp32_error:value} (median).
"""
if below:
    text += f"""
Welford's advantage is robustness to inputs with a large common offset, which the rows measured here
do not have: a small CharGPT after its FP32 training on its {len(validation)} validation batches and
one batch of each packaged model above, not a large LayerNorm LLM in training, whose activations this
does not measure.
"""
if "model.rms_kappa_max" in claims:
    text += """
SmolLM2's RMSNorm inputs (not counted: RMSNorm subtracts no mean) have κ up to {model.rms_kappa_max:value}, the κ a LayerNorm in their place would face.
"""
display(Markdown(claims.render(text)))

# %% [markdown]
# ## 8. Does it matter in training? bf16 statistics, textbook against Welford
#
# κ predicts no difference for these activations. To measure it, the same small CharGPT (2 blocks,
# width 64, as in notebook 03) is trained with every LayerNorm's statistics accumulated in **bf16**
# (every step rounded, 16-element chunks merged pairwise: `numerics.StatsLayerNorm`), by the
# textbook formula and by Welford's, beside torch's own LayerNorm (float32 statistics). The rest of
# the model stays in float32, so the statistics are the only low-precision arithmetic. Each seed trains all three from the same weights on the same batches;
# the table gives the validation loss and the difference from torch's LayerNorm of the same seed,
# with 95 % intervals over seeds.

# %%
ln_config = TrainConfig(steps=ln_train_steps, layers=2, width=64, context=64, batch_size=16, lr=3e-3, eval_batches=8,
                        warmup_steps=min(30, ln_train_steps), eval_every=max(1, ln_train_steps // 6), progress=False)
if smoke:
    ln_config = ln_config.replace(layers=1, width=32, context=32, batch_size=4, eval_batches=1)
TORCH_LN, WELFORD_LN, TEXTBOOK_LN = "torch (fp32 statistics)", "welford (bf16 statistics)", "textbook (bf16 statistics)"
LN_VARIANTS = {TORCH_LN: ("torch", "fp32"), WELFORD_LN: ("welford", "bf16"), TEXTBOOK_LN: ("textbook", "bf16")}
ln_runs = [(s, v) for s in range(ln_train_seeds) for v in LN_VARIANTS]
ln_curves = []
ln_results = run_many([ln_config.replace(seed=s, layer_norm=LN_VARIANTS[v][0], layer_norm_acc=LN_VARIANTS[v][1])
                       for s, v in ln_runs], executor=executor, max_workers=max_workers or None,
                      desc="LayerNorm training runs")
for (ln_seed, variant), result in zip(ln_runs, ln_results):
    metrics = result.metrics
    ln_curves.append(metrics.dropna(subset=["val_loss"])[["step", "val_loss"]].assign(variant=variant, seed=ln_seed))
ln_curves = pd.concat(ln_curves, ignore_index=True)
save_csv(ln_curves, f"{NAME}_ln_training")
ln_final = ln_curves[ln_curves.step == ln_curves.step.max()]
ln_losses = stats.summarize(ln_final, "val_loss", ["variant"])
vs_torch = stats.paired_differences(ln_final, "val_loss", baseline=TORCH_LN, by="variant", pair="seed")
ln_gaps = stats.summarize(vs_torch, "difference", ["variant"])
ln_table = ln_losses.merge(ln_gaps.drop(columns="n"), on="variant", how="left", suffixes=("", "_vs_torch"))
save_csv(ln_table, f"{NAME}_ln_training_summary")
Markdown(markdown_table(ln_table, "{:.5f}"))

# %%
fig, ax = subplots(width="column", aspect=0.7)
delta_band(ax, ln_curves, "step", "val_loss", baseline=TORCH_LN, by="variant", linewidth=0.9)
for bound in (-margin, margin):  # the equivalence margin declared in the parameters
    ax.axhline(bound, color="0.5", linestyle=":", linewidth=0.7, label="±margin (TOST)" if bound > 0 else None)
ax.set_xlabel("step")
ax.set_ylabel("Δ val. loss vs torch LayerNorm (nats/char)")
ax.set_title(f"bf16 LayerNorm statistics: mean and\n95 % interval over {ln_train_seeds} seeds")
ax.legend(loc="lower right")
save_figure(fig, f"{NAME}_ln_training")

# %%
final_loss = ln_final.pivot(index="seed", columns="variant", values="val_loss").sort_index()
SHORT = {TORCH_LN: "torch", WELFORD_LN: "welford", TEXTBOOK_LN: "textbook"}
for variant, short in SHORT.items():
    claims.mean(f"ln.loss.{short}", final_loss[variant], unit="nats/char",
                text=f"{variant}: validation loss after {ln_config.steps} steps")
PAIRS = [(WELFORD_LN, TORCH_LN), (TEXTBOOK_LN, TORCH_LN), (TEXTBOOK_LN, WELFORD_LN)]
pair_keys = []
for a, b in PAIRS:
    key = f"ln.{SHORT[a]}-{SHORT[b]}"
    difference = final_loss[a] - final_loss[b]
    claims.paired(key, difference, family="ln_training", unit="nats",
                  text=f"{a} − {b}, validation loss (paired by seed)")
    claims.equivalence(f"{key}.same", difference, margin=margin, unit="nats", headline=(a, b) == (TEXTBOOK_LN, WELFORD_LN),
                       text=f"{a} − {b}, within ±{margin:g} nats")
    pair_keys += [key, f"{key}.same"]
claims.holm("ln_training")
display(Markdown(claims.render(f"""
torch's LayerNorm ends at {{ln.loss.torch}} (mean and 95 % interval over {{ln.loss.torch:n}} seeds). Each pair below is paired by
seed (Holm over the three comparisons) and tested for equivalence within ±{margin:g} nats (TOST): a
difference that is not resolved is reported with the effect these seeds could have detected, and "no
difference" is stated only where TOST shows it. Textbook − Welford with bf16 statistics:
{{ln.textbook-welford}} ({{ln.textbook-welford:verdict}}; {{ln.textbook-welford.same:verdict}}).
""") + "\n" + claims.table(pair_keys)))

# %% [markdown]
# ## Headline numbers
#
# The claims go to `data/02_welford_vs_naive_variance_claims.csv` (its headline claims to the README's
# findings table); a few numbers also go to `data/02_welford_vs_naive_variance.json` (what `qlab sweep`
# collects).

# %%
claims.save()
metrics = {
    "seed_exact_y1": exact_seed[1].item(),
    "seed_textbook_fp32_y1": seed_fp32.loc["textbook", "y1"],
    "seed_welford_fp32_y1": seed_fp32.loc["welford", "y1"],
    "seed_welford_fp32_grad1": seed_fp32.loc["welford", "grad1"],
    "fp32_textbook_kappa_all_digits_lost": claims["k50.fp32.textbook"].value,
    "fp32_welford_kappa_all_digits_lost": claims["k50.fp32.welford"].value,
    "layer_norm_rows_kappa_ge_2": claims["model.rows_ge_2"].value,
    "layer_norm_rows_kappa_ge_1000": claims["model.rows_ge_1000"].value,
    "ln_training_textbook_minus_welford": claims["ln.textbook-welford"].value,
    "swapped_grads_detected": "swapped" in diagnoses[SWAPPED],
}
save_metrics(NAME, **metrics)
pd.Series(metrics)
