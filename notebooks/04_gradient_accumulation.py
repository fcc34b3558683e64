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
# # Gradient accumulation: autograd's `.grad`, fused FP32 `main_grad`, or BF16 `.grad`?
#
# With gradient accumulation over micro-batches, autograd computes each weight gradient into a new
# tensor and then adds it to `param.grad` (a copy and an add per micro-batch). TransformerEngine's
# fused alternative (seeds/003) writes the wgrad GEMM straight into an FP32 `param.main_grad`
# (`C += AᵀB` in one GEMM) and returns no gradient to autograd. This notebook measures, for a
# Linear layer over 1…256 micro-batches:
#
# 1. the accumulated gradient's error against a float64 reference, for autograd into FP32 `.grad`,
#    the fused FP32 `main_grad`, and autograd into BF16 `.grad` (BF16 parameters) — on i.i.d.
#    synthetic operands and on the real micro-batch operands of a trained CharGPT layer;
# 2. time and memory allocated per accumulation step (median and quartiles over repeats);
# 3. what each configuration returns to autograd (None, a dummy, or the gradient) — the table the
#    upstream reviewers found inconsistent across modules, here observed rather than asserted.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 20 s)
device: str = "auto"  # "auto", "cpu" or "cuda"
seed: int = 0  # seeds every random draw
tokens: int = 512  # tokens per micro-batch
in_features: int = 512  # layer input width
out_features: int = 512  # layer output width
max_microbatches_log2: int = 8  # accumulate up to 2**max_microbatches_log2 micro-batches
timing_steps: int = 31  # micro-batches timed per method (median and quartiles are reported)
pretrain_steps: int = 150  # FP32 CharGPT steps before its micro-batch operands are taken
micro_sequences: int = 4  # sequences of 128 characters per real micro-batch (512 tokens)
real_layer: str = "blocks.2.mlp.fc"  # the CharGPT Linear whose operands are accumulated
model_width: int = 128  # CharGPT width (5 blocks, the default CharGPT)

# %%
import time

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown
from torch.nn import functional as F

from qlab import ablation, session
from qlab.nn import QuantLinear
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import markdown_table, save_csv, save_metrics
from qlab.train import TrainConfig, train
from qlab.train.loop import Batches

NAME = "04_gradient_accumulation"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    tokens, in_features, out_features, max_microbatches_log2, timing_steps = 32, 64, 48, 4, 3
    pretrain_steps, micro_sequences, model_width = 2, 1, 32
use_paper_style()
generator = torch.Generator().manual_seed(seed)
n_max = 2 ** max_microbatches_log2
print(f"tokens={tokens} {in_features}->{out_features} micro-batches up to {n_max} device={device}")

# %% [markdown]
# ## 1. Accumulated-gradient error
#
# Every micro-batch i has inputs xᵢ and output gradients dyᵢ, drawn once and rounded to BF16 so
# that every method sees identical operands; the reference is Σᵢ dyᵢᵀ·xᵢ in float64. The methods
# differ only in where the sum is kept: FP32 `.grad` (autograd adds a fresh FP32 wgrad), FP32
# `main_grad` (one GEMM accumulating into it, with FP32 or BF16 parameters — Megatron's setup is
# the latter), BF16 `.grad` (the FP32 GEMM result is rounded to BF16, then added in BF16). The error
# is ‖G − G_ref‖_F / ‖G_ref‖_F.

# %%
METHODS = {
    "autograd, FP32 .grad": dict(dtype=torch.float32, fused=False),
    "fused, FP32 main_grad": dict(dtype=torch.float32, fused=True),
    "fused, FP32 main_grad, BF16 params": dict(dtype=torch.bfloat16, fused=True),
    "autograd, BF16 .grad": dict(dtype=torch.bfloat16, fused=False),
}


def make_layer(dtype, fused, in_width=in_features, out_width=out_features):
    layer = QuantLinear(in_width, out_width, bias=False, fuse_wgrad_accumulation=fused, device=device, dtype=dtype)
    layer.weight.requires_grad_(True)
    return layer


def accumulated(layer, fused):
    return (layer.weight.main_grad if fused else layer.weight.grad).double().cpu()


def accumulation_errors(source, xs, dys):
    """Relative error of each method's running sum after 1, 2, 4, … micro-batches, against float64;
    sum_growth = ‖Σ₁ⁿ‖ / ‖Σ₁¹‖: √n for independent zero-mean gradients, n for identical ones."""
    reference = torch.cumsum(torch.einsum("nto,nti->noi", dys.double(), xs.double()), dim=0)
    rows = []
    for method, options in METHODS.items():
        layer = make_layer(options["dtype"], options["fused"], xs.shape[-1], dys.shape[-1])
        for i in range(len(xs)):
            x = xs[i].to(device, options["dtype"])
            layer(x, is_first_microbatch=(i == 0)).backward(dys[i].to(device, options["dtype"]))
            if i + 1 in checkpoints:
                ref = reference[i]
                error = (accumulated(layer, options["fused"]) - ref).norm() / ref.norm()
                rows.append({"operands": source, "method": method, "microbatches": i + 1,
                             "relative_error": error.item(), "sum_growth": (ref.norm() / reference[0].norm()).item()})
    return rows


checkpoints = [2 ** k for k in range(max_microbatches_log2 + 1)]
xs = torch.randn(n_max, tokens, in_features, generator=generator).bfloat16()
dys = torch.randn(n_max, tokens, out_features, generator=generator).bfloat16()
rows = accumulation_errors("i.i.d. Gaussian", xs, dys)

# %% [markdown]
# ### Real micro-batches
#
# Independent zero-mean operands flatter BF16: their sum grows like √n, so each BF16 addition rounds
# a running sum little larger than the term it adds. Micro-batch gradients of a real model share a
# direction (their mean is the full-batch gradient), so the sum grows nearly like n. Here: the
# operands (x, dy) of one Linear of CharGPT after `pretrain_steps` FP32 steps, for n_max micro-batches
# of Shakespeare at fixed weights — one accumulation window, the loss divided by n_max as gradient
# accumulation does — rounded to BF16 like the synthetic ones.

# %%
pretrain = TrainConfig(steps=pretrain_steps, batch_size=16, width=model_width, seed=seed, eval_every=max(pretrain_steps, 1),
                       progress=False, device=device)
model = train(pretrain).model
window = Batches(pretrain.replace(batch_size=n_max * micro_sequences, grad_accum=n_max))
real_xs, real_dys = [], []
for i in session.progress(range(n_max), desc="real micro-batches"):
    ids, targets = (t.to(device) for t in window.train(pretrain_steps, i, 0))

    def forward_backward():
        (F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / n_max).backward()

    x, _, dy = ablation.capture_operands(model, forward_backward, only=[real_layer])[real_layer]
    real_xs.append(x.bfloat16())
    real_dys.append(dy.bfloat16())
rows += accumulation_errors(f"CharGPT {real_layer}", torch.stack(real_xs), torch.stack(real_dys))
error_table = pd.DataFrame(rows)
save_csv(error_table, f"{NAME}_error")
error_table.pivot_table(index="microbatches", columns=["operands", "method"], values="relative_error")

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.55, sharey=True)
for ax, (source, part) in zip(axes, error_table.groupby("operands", sort=False)):
    for (method, style), marker in zip(zip(METHODS, ["-", "-", "--", "-"]), "osxo"):
        line = part[part.method == method]  # the two fused lines coincide: BF16 params round nothing here
        ax.loglog(line.microbatches, line.relative_error, linestyle=style, marker=marker, markersize=3, label=method)
    growth = part.groupby("microbatches").sum_growth.first()
    ax.axhline(2.0 ** -8, color="grey", linestyle=":", linewidth=0.8)
    ax.text(1, 2.0 ** -8 * 2.5, "BF16 unit roundoff 2⁻⁸", fontsize=6, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches accumulated")
    ax.set_title(f"{source}\n(the sum grows ×{growth.iloc[-1]:.0f} over {growth.index[-1]})", fontsize=7)
axes[0].set_ylabel("relative error of Σ wgrad")
axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
save_figure(fig, f"{NAME}_error")

# %% [markdown]
# ## 2. Time and memory per accumulation step
#
# One micro-batch's forward and backward, with the gradient already holding earlier micro-batches.
# Memory is what the step allocates (CPU: the profiler's allocation records; CUDA: the peak above
# the starting allocation). Autograd allocates a fresh wgrad every step and adds it; the fused path
# runs one GEMM into `main_grad`. In this emulation every GEMM runs in FP32, so the BF16 path also
# pays for converting its operands.


# %%
def allocated_bytes(step):
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        step()
    return sum(max(event.self_cpu_memory_usage, 0) for event in profile.events())


def timed(step):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


rows = []
for method, options in session.progress(METHODS.items(), total=len(METHODS), desc="timing"):
    layer = make_layer(options["dtype"], options["fused"])
    # x needs a gradient, as a layer inside a network does: each step computes dx as well
    x = xs[0].to(device, options["dtype"]).requires_grad_(True)
    dy = dys[0].to(device, options["dtype"])

    def step():
        x.grad = None
        layer(x).backward(dy)

    layer(x, is_first_microbatch=True).backward(dy)  # warm-up; the gradient now exists
    times = 1e3 * np.array([timed(step) for _ in range(timing_steps)])
    rows.append({"method": method, "step_ms": float(np.median(times)),
                 "step_ms_q25": float(np.quantile(times, 0.25)), "step_ms_q75": float(np.quantile(times, 0.75)),
                 "repeats": timing_steps,
                 "allocated_mib": allocated_bytes(step) / 2 ** 20,
                 "gradient_bytes_per_element": (4 if options["fused"] or options["dtype"] == torch.float32 else 2)})
cost_table = pd.DataFrame(rows)
save_csv(cost_table, f"{NAME}_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
cost_table.round(3)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.45)
colors = [f"C{i}" for i in range(len(cost_table))]
spread = [cost_table.step_ms - cost_table.step_ms_q25, cost_table.step_ms_q75 - cost_table.step_ms]
axes[0].barh(cost_table.method, cost_table.step_ms, color=colors, xerr=spread, error_kw={"linewidth": 0.8})
axes[0].set_xlabel(f"time per micro-batch (ms), median and\nquartiles of {timing_steps}")
axes[1].barh(cost_table.method, cost_table.allocated_mib, color=colors)
axes[1].set_xlabel("allocated per micro-batch (MiB)")
axes[1].set_yticks([])
for ax in axes:
    ax.invert_yaxis()
fig.suptitle(f"One accumulation step, {tokens} tokens × {in_features} → {out_features}, {device}")
save_figure(fig, f"{NAME}_timing")

# %% [markdown]
# ## 3. What goes back to autograd
#
# Every combination of fused accumulation (`fuse_wgrad_accumulation`), delayed wgrad (`delay_wgrad`:
# the GEMM runs later, at `backward_dw()`) and the Megatron attribute `grad_added_to_main_grad`
# ("flag"), observed on a real layer: after one backward,
# what `.grad` holds, whether `main_grad` was written, and what changes after `backward_dw()`.
# The disputed corner (delayed + fused + flag) returns the dummy here, as the reference Linear
# module does, so the flag alone decides None against dummy.


# %%
def observe(fused, delayed, flagged):
    layer = QuantLinear(8, 4, bias=False, fuse_wgrad_accumulation=fused, delay_wgrad=delayed)
    weight = layer.weight
    if flagged:
        weight.grad_added_to_main_grad = False
    if fused:
        weight.main_grad = torch.zeros(4, 8)
    x, dy = torch.ones(2, 8), torch.ones(2, 4)
    layer(x).backward(dy)
    grad = weight.grad

    def describe(tensor):
        if tensor is None:
            return "None"
        return "dummy (zeros)" if torch.count_nonzero(tensor) == 0 else "wgrad"

    after_backward = describe(grad)
    main_written = fused and bool(torch.count_nonzero(weight.main_grad))
    layer.backward_dw()
    return {"fused": fused, "delayed": delayed, "flag attr": flagged,
            "returned to autograd": after_backward,
            "main_grad in backward": main_written if fused else "n/a",
            "after backward_dw()": ("main_grad" if fused and torch.count_nonzero(weight.main_grad) else
                                    describe(weight.grad) + " in .grad") if delayed else "nothing deferred",
            "flag after": getattr(weight, "grad_added_to_main_grad", "n/a")}


contract = pd.DataFrame([observe(fused, delayed, flagged)
                         for fused in (False, True) for delayed in (False, True) for flagged in (False, True)
                         if fused or not flagged])
save_csv(contract, f"{NAME}_contract")
Markdown(markdown_table(contract.astype(str).replace({"True": "yes", "False": "no"})))

# %%
final = error_table[error_table.microbatches == n_max].set_index(["operands", "method"]).relative_error
synthetic, real = error_table.operands.unique()
save_metrics(NAME,
             error_fp32_grad=final[synthetic, "autograd, FP32 .grad"],
             error_fused_main_grad=final[synthetic, "fused, FP32 main_grad"],
             error_fused_main_grad_bf16_params=final[synthetic, "fused, FP32 main_grad, BF16 params"],
             error_bf16_grad=final[synthetic, "autograd, BF16 .grad"],
             real_error_fp32_grad=final[real, "autograd, FP32 .grad"],
             real_error_bf16_grad=final[real, "autograd, BF16 .grad"])
