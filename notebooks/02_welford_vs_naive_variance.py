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

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 30 s)
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
ln_train_seeds: int = 3  # training seeds per LayerNorm variant in section 8
ln_train_steps: int = 300  # steps per run in section 8
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import Markdown

from qlab import models, numerics, session, stats
from qlab.plotting import delta_band, save_figure, subplots, use_paper_style
from qlab.results import markdown_table, save_csv, save_metrics
from qlab.runs import run_many

NAME = "02_welford_vs_naive_variance"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    n, trials, kappa_points, n_max_log2 = 64, 2, 7, 8
    chargpt_steps, pretrained_models, ln_train_seeds, ln_train_steps = 2, [], 2, 4
use_paper_style()
generator = torch.Generator().manual_seed(seed)
ERROR_FLOOR = 1e-12  # exact results are drawn here on the log axes
print(f"n={n} trials={trials} kappa_points={kappa_points} n_max=2**{n_max_log2} device={device}")

# %% [markdown]
# ## 1. The seed's example
#
# Two float32 numbers, normalised together, no affine, eps = 10⁻⁵. The exact answer below is
# computed from the float32-rounded inputs in rational arithmetic (square root in 50-digit decimal).
# LayerNorm's output always sums to zero, whatever x is, so **the exact gradient of
# `sum(LayerNorm(x))` is zero**; anything else printed is rounding error, amplified by
# 1/σ ≈ 170 here.

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

# %% [markdown]
# The textbook formula in float32 reproduces the ±0.8428 of the seed (error 2.6·10⁻³); two-pass and
# Welford are within about 1.5·10⁻⁵ of the exact value — the ≈ κ·u expected for these two nearly
# equal numbers (κ ≈ 370), some 200 float32 ulps. So the seed's ±0.8428 came from an E[X²] − E[X]²
# implementation, not from Welford. The non-zero "gradients" are the rounding error of
# mean(x̂) ≠ 0 in the analytic backward, times 1/σ; PyTorch's backward happens to cancel exactly here.

# %% [markdown]
# ## 2. Relative error of the variance vs condition number
#
# Rows of length n with prescribed κ (unit RMS, so nothing overflows in float16), rounded to
# each input dtype; the reference is the exact variance of the rounded rows, and κ on the x-axis is
# measured on them. Every operation is rounded in the accumulation dtype. Dashed guides show the
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
    for algorithm in ALGORITHMS:
        var = numerics.variance(x, algorithm, acc_dtype=acc_dtype).double()
        rel_error = ((var - exact_var).abs() / exact_var).clamp(max=1.0)  # 1 = every digit lost
        records.append(pd.DataFrame({
            "config": label, "input_dtype": str(in_dtype).removeprefix("torch."),
            "acc_dtype": str(acc_dtype).removeprefix("torch."), "algorithm": algorithm,
            "kappa_target": np.repeat(kappa_targets, trials), "trial": np.tile(np.arange(trials), kappa_points),
            "kappa": kappa.numpy(), "rel_error": rel_error.numpy(),
        }))
kappa_table = pd.concat(records, ignore_index=True)
kappa_table = kappa_table[np.isfinite(kappa_table["kappa"])]  # rows the dtype rounded to a constant
save_csv(kappa_table, f"{NAME}_kappa")

# %%
summary = (kappa_table.groupby(["config", "algorithm", "kappa_target"], sort=False)
           .agg(kappa=("kappa", "median"), rel_error=("rel_error", "median")).reset_index())
fig, axes = subplots(2, 3, width="text", aspect=0.75, sharex=True, sharey=True)
for ax, (label, _, acc_dtype) in zip(axes.flat, CONFIGS):
    u = numerics.unit_roundoff(acc_dtype)
    for algorithm in ALGORITHMS:
        part = summary[(summary["config"] == label) & (summary["algorithm"] == algorithm)]
        ax.loglog(part["kappa"], part["rel_error"].clip(lower=ERROR_FLOOR), marker="o", label=algorithm)
    k = np.logspace(0, math.log10(kappa_max), 50)
    ax.loglog(k, u * k, "k--", lw=0.7)
    ax.loglog(k, u * k * k, "k:", lw=0.7)
    ax.set_title(label)
    ax.set_ylim(ERROR_FLOOR / 2, 2)
for ax in axes[1]:
    ax.set_xlabel("condition number κ")
for ax in axes[:, 0]:
    ax.set_ylabel("relative error of σ²")
axes.flat[-1].axis("off")
handles, labels = axes.flat[0].get_legend_handles_labels()
axes.flat[-1].legend(handles + axes.flat[0].lines[-2:], labels + ["u·κ", "u·κ²"], loc="center")
save_figure(fig, f"{NAME}_kappa")

# %%
def first_kappa_losing_all_digits(config: str, algorithm: str, threshold: float = 0.5) -> float:
    part = summary[(summary["config"] == config) & (summary["algorithm"] == algorithm)]
    lost = part[part["rel_error"] >= threshold]
    return float(lost["kappa"].min()) if len(lost) else float("nan")


for label, _, acc_dtype in CONFIGS:
    print(f"{label:>16}: textbook loses every digit from κ ≈ {first_kappa_losing_all_digits(label, 'textbook'):.3g}"
          f" (rule of thumb u^-1/2 = {numerics.unit_roundoff(acc_dtype) ** -0.5:.3g}); "
          f"Welford from κ ≈ {first_kappa_losing_all_digits(label, 'welford'):.3g}")

# %% [markdown]
# Textbook's error follows the u·κ² slope and reaches 100 % a little before the rule of thumb
# κ ≈ u^(−1/2) (4096 in float32, 45 in float16, 16 in bfloat16) — earlier for longer rows, the n of
# n·κ²·u (printed above). In float32 and float16 (and in every float32-accumulation panel)
# two-pass, Welford and pairwise follow u·κ and stay usable until the data itself can no longer
# resolve σ; shifting by the first element removes most of the mean, so the shifted textbook
# formula does as well. bfloat16 *accumulation* is different: its sequential sums stagnate at
# n = 1024 (section 3), so two-pass loses every digit from κ ≈ 3, sequential Welford and the
# shifted formula sit near 20 % error, and only the pairwise merge stays at a few per cent (up to
# κ ≈ 100).
# Accumulating half-precision inputs in float32 is the real fix for the 16-bit formats:
# the float32-accumulation panels look like the float32 one. Where the input dtype can barely
# resolve σ (the right end of each curve), the rounded rows take only a few distinct values near
# the mean and the two-pass and shifted sums become exact: that drop to the floor is a property of
# such coarse data, not a virtue of the algorithm.
#
# ## 3. Error vs row length: sequential vs pairwise
#
# Sequential accumulation adds error at every step (~n·u in the worst case, √n·u typically);
# a pairwise tree only log₂ n. PyTorch's CPU LayerNorm runs Welford inside chunks and merges the
# chunks pairwise ("welford, chunk 16" below). In 16-bit accumulation a running sum stops growing
# once the increments fall below half an ulp (at 2048 for float16, 256 for bfloat16), and
# Welford's running mean stops moving once δ/k does: sequential Welford degrades with n too,
# while the chunked and pairwise merges stay flat.

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

fig, axes = subplots(1, len(LENGTH_CONFIGS), width="text", aspect=0.9)
length_summary = length_table.groupby(["config", "variant", "n"], sort=False)["rel_error"].median().reset_index()
for ax, (label, _, acc_dtype) in zip(axes, LENGTH_CONFIGS):
    for variant in LENGTH_VARIANTS:
        part = length_summary[(length_summary["config"] == label) & (length_summary["variant"] == variant)]
        ax.loglog(part["n"], part["rel_error"].clip(lower=ERROR_FLOOR), marker="o", label=variant)
    ax.loglog(lengths, [min(numerics.unit_roundoff(acc_dtype) * m, 1.0) for m in lengths], "k--", lw=0.7, label="u·n")
    ax.set_title(f"{label} (κ = {kappa_for_length:g})")
    ax.set_xlabel("row length n")
    ax.set_ylim(top=2)
axes[0].set_ylabel("relative error of σ²")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center")
save_figure(fig, f"{NAME}_length")

# %% [markdown]
# ## 4. The practical consequence: LayerNorm output and gradient error vs κ
#
# float32 rows with σ = 1 and growing mean (so eps is negligible), normalised by `qlab.numerics.layer_norm`
# with each statistics algorithm and by `torch.nn.functional.layer_norm` on this machine. Reference:
# the same float32 inputs through a float64 two-pass LayerNorm (its own error, ≲ n·2⁻⁵³ + n²κ²2⁻¹⁰⁶,
# is below 10⁻¹⁰ here, far under every float32 error plotted). Output error is the largest absolute
# error (outputs are O(1)); gradient error is the normwise relative error of dL/dx for a fixed
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
fig, axes = subplots(1, 2, width="text", aspect=0.65)
for label in ln_implementations:
    chosen = ln_summary["implementation"] == label
    part = ln_summary[chosen]
    style = {"ls": "--", "marker": "x"} if label.startswith("torch") else {"marker": "o"}
    for ax, column in zip(axes, ("output_abs_error", "grad_rel_error")):
        (line,) = ax.loglog(part["kappa"], part[column].clip(lower=ERROR_FLOOR), label=label, markersize=3, **style)
        ax.fill_between(part["kappa"], ln_low[chosen][column].clip(lower=ERROR_FLOOR),
                        ln_high[chosen][column].clip(lower=ERROR_FLOOR), color=line.get_color(), alpha=0.2,
                        linewidth=0)
axes[0].set_ylabel("max |y − y_ref|")
axes[1].set_ylabel("rel. error of dL/dx")
for ax in axes:
    ax.set_xlabel("condition number κ (float32 input)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center")
save_figure(fig, f"{NAME}_layernorm")

# %% [markdown]
# With the textbook statistics, LayerNorm's output is already visibly wrong at κ ~ 10², and
# at κ ≳ 4·10³ (|mean| ≈ 4000·σ) the output and gradient are garbage; Welford and two-pass stay at
# float32 accuracy × κ. Activations with a large common offset — the situation LayerNorm exists for —
# are exactly where the choice matters.
#
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
check_tables = []
for label, fn in checked.items():
    result = numerics.check_layer_norm_grads(fn, seed=seed)
    print(f"{label:>34}: {result.diagnosis}")
    check_tables.append(result.table.assign(implementation=label))
check_table = pd.concat(check_tables, ignore_index=True)[["implementation", "quantity", "error", "tolerance", "ok"]]
save_csv(check_table, f"{NAME}_gradcheck")

fig, ax = subplots(width="column", aspect=0.75)
quantities = list(check_table["quantity"].unique())
width = 0.8 / len(checked)
for i, label in enumerate(checked):
    part = check_table[check_table["implementation"] == label]
    ax.bar(np.arange(len(quantities)) + (i - (len(checked) - 1) / 2) * width,
           part["error"].clip(lower=ERROR_FLOOR), width, label=label)
ax.axhline(check_table["tolerance"].iloc[0], color="k", ls="--", lw=0.7, label="tolerance")
ax.set_yscale("log")
ax.set_xticks(np.arange(len(quantities)), quantities)
ax.set_ylabel("normwise rel. error vs float64")
ax.legend(fontsize=5, loc="upper left")
save_figure(fig, f"{NAME}_gradcheck")

# %% [markdown]
# ## 6. On a GPU: the Triton LayerNorm kernel's three statistics
#
# Runs only when CUDA is present. The same rows and reference as section 4, through
# `qlab.kernels.layer_norm(..., backend="triton")` with each statistics mode: float32 accumulation,
# Welford as a Chan-merge tree (what CUDA LayerNorms do across a warp), two-pass, and the textbook
# E[X²]−E[X]² clamped at zero. Writes `data/02_welford_vs_naive_variance_gpu.csv` and its figure.

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
        axes[0].loglog(part["kappa"], part["output_abs_error"].clip(lower=ERROR_FLOOR), marker="o", label=statistics)
        axes[1].loglog(part["kappa"], part["grad_rel_error"].clip(lower=ERROR_FLOOR), marker="o", label=statistics)
    axes[0].set_ylabel("max |y − y_ref|")
    axes[1].set_ylabel("rel. error of dL/dx")
    for ax in axes:
        ax.set_xlabel("condition number κ (float32 input)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center")
    fig.suptitle(f"Triton LayerNorm on {torch.cuda.get_device_name()}")
    save_figure(fig, f"{NAME}_gpu")
else:
    print("no CUDA device: the GPU section is skipped (it needs the Triton kernels on a GPU)")

# %% [markdown]
# ## 7. Does it matter in practice? κ of the rows real models normalise
#
# Sections 2–4 put the danger at κ ≳ 10³ for float32 accumulation and κ ≳ 2 for bf16 accumulation.
# Here: κ of every row each normalisation layer receives, in a CharGPT trained `chargpt_steps` FP32
# steps (on 8 validation batches) and in the packaged pretrained models on held-out Shakespeare
# (`numerics.norm_input_conditions`, float64 two-pass moments). SmolLM2 (Llama) normalises with
# RMSNorm, which subtracts no mean — its κ says what a LayerNorm in its place would face.

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
norm_kappa.groupby(["model", "kind"]).agg(layers=("layer", "nunique"), kappa_median=("kappa_median", "median"),
                                         kappa_p99_max=("kappa_p99", "max"), kappa_max=("kappa_max", "max"),
                                         bf16_risk=("bf16_textbook_fraction", "mean"),
                                         fp32_risk=("fp32_textbook_fraction", "mean")).round(3)

# %%
per_layer = norm_kappa.groupby(["model", "layer"], sort=False).agg(
    kappa_median=("kappa_median", "median"), kappa_max=("kappa_max", "max")).reset_index()
fig, ax = subplots(width="column", aspect=0.8)
for i, (label, part) in enumerate(per_layer.groupby("model", sort=False)):
    positions = np.arange(len(part))
    ax.scatter(positions, part.kappa_median - 1, s=6, color=f"C{i}", label=f"{label}: median row")
    ax.scatter(positions, part.kappa_max - 1, s=8, color=f"C{i}", marker="^", alpha=0.6, label=f"{label}: worst row")
ax.axhline(1, color="grey", linestyle=":", linewidth=0.8)
ax.text(0, 1.4, "κ = 2: bf16-accumulated textbook fails", fontsize=5, color="grey")
ax.axhline(999, color="grey", linestyle="--", linewidth=0.8)
ax.text(0, 1400, "κ = 10³: float32 textbook loses every digit", fontsize=5, color="grey")
ax.set_yscale("log")
ax.set_xlabel("normalisation layer (model order)")
ax.set_ylabel("κ − 1 of its input rows")
ax.legend(fontsize=5, loc="center left", bbox_to_anchor=(1.02, 0.5))
save_figure(fig, f"{NAME}_model_kappa")

# %% [markdown]
# ## 8. Does it matter in training? bf16 statistics, textbook against Welford
#
# κ predicts no difference for these activations. To measure it, the same small CharGPT (2 blocks,
# width 64, as in notebook 03) is trained with every LayerNorm's statistics accumulated in **bf16**
# (every step rounded, 16-element chunks merged pairwise: `numerics.StatsLayerNorm`), by the
# textbook formula and by Welford's, beside torch's own LayerNorm (float32 statistics). The rest of
# the model stays in float32, so the statistics are the only low-precision arithmetic (and bf16
# GEMMs are slow on this CPU). Each seed trains all three from the same weights on the same batches;
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
bf16_only = ln_final[ln_final.variant != TORCH_LN]
vs_welford = stats.paired_differences(bf16_only, "val_loss", baseline=WELFORD_LN, by="variant", pair="seed")
textbook_minus_welford = stats.summarize(vs_welford, "difference", ["variant"])
ln_table = ln_losses.merge(ln_gaps.drop(columns="n"), on="variant", how="left", suffixes=("", "_vs_torch"))
save_csv(ln_table, f"{NAME}_ln_training_summary")
print(f"textbook − Welford (bf16 statistics), paired by seed over {ln_train_seeds} seeds: "
      f"{textbook_minus_welford['mean'].iloc[0]:+.5f} nats "
      f"[{textbook_minus_welford['low'].iloc[0]:+.5f}, {textbook_minus_welford['high'].iloc[0]:+.5f}]")
Markdown(markdown_table(ln_table, "{:.5f}"))

# %%
fig, ax = subplots(width="column", aspect=0.7)
delta_band(ax, ln_curves, "step", "val_loss", baseline="torch (fp32 statistics)", by="variant", linewidth=0.9)
ax.set_xlabel("step")
ax.set_ylabel("Δ val. loss vs torch LayerNorm")
ax.set_title(f"bf16 LayerNorm statistics: mean and 95 % interval, {ln_train_seeds} seeds", fontsize=6)
ax.legend(fontsize=5, loc="lower right")
save_figure(fig, f"{NAME}_ln_training")

# %% [markdown]
# ## Headline numbers
#
# Saved to `data/02_welford_vs_naive_variance.json` (what `qlab sweep` collects).

# %%
seed_fp32 = seed_table[seed_table["dtype"] == "float32"].set_index("implementation")
metrics = {
    "seed_exact_y1": exact_seed[1].item(),
    "seed_textbook_fp32_y1": seed_fp32.loc["textbook", "y1"],
    "seed_welford_fp32_y1": seed_fp32.loc["welford", "y1"],
    "seed_welford_fp32_grad1": seed_fp32.loc["welford", "grad1"],
    "fp32_textbook_kappa_all_digits_lost": first_kappa_losing_all_digits("fp32", "textbook"),
    "fp32_welford_kappa_all_digits_lost": first_kappa_losing_all_digits("fp32", "welford"),
    "model_rows_kappa_ge_2": float(np.average(norm_kappa.bf16_textbook_fraction, weights=norm_kappa.rows)),
    "model_rows_kappa_ge_1000": float(np.average(norm_kappa.fp32_textbook_fraction, weights=norm_kappa.rows)),
    "ln_training_textbook_minus_welford": textbook_minus_welford["mean"].iloc[0],
    "swapped_grads_detected": "swapped" in numerics.check_layer_norm_grads(
        numerics.layer_norm_swapped_affine_grads, seed=seed).diagnosis,
}
save_metrics(NAME, **metrics)
pd.Series(metrics)
