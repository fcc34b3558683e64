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
# fused alternative writes the wgrad GEMM straight into an FP32 `param.main_grad`
# (`C += AᵀB` in one GEMM) and returns no gradient to autograd. This notebook measures, for a
# Linear layer over 1…256 micro-batches:
#
# 1. the accumulated gradient's error against a float64 reference, for autograd into FP32 `.grad`,
#    the fused FP32 `main_grad`, and autograd into BF16 `.grad` (BF16 parameters) — on i.i.d.
#    synthetic operands and on the real micro-batch operands of a trained CharGPT layer;
# 2. time and memory allocated per accumulation step (median and quartiles over repeats);
# 3. what each configuration returns to autograd (None, a dummy, or the gradient) — the table the
#    reference system's modules disagree on, here observed rather than asserted.
#
# Every number in the text is computed from this run's results by the code cell that renders it.
# The errors are deterministic functions of one draw of operands (seed `seed`) and one CharGPT
# layer: single observations, not means over seeds; they go to
# `data/04_gradient_accumulation_claims.csv`. Times vary from run to run: their claims go to
# `data/04_gradient_accumulation_claims_timing.csv`.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
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
import math
import time

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display
from torch.nn import functional as F

from qlab import ablation, session
from qlab.claims import Claims
from qlab.nn import QuantLinear
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import markdown_table, save_csv, save_metrics
from qlab.train import TrainConfig, train
from qlab.train.loop import Batches

NAME = "04_gradient_accumulation"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if smoke:
    tokens, in_features, out_features, max_microbatches_log2, timing_steps = 32, 64, 48, 4, 3
    pretrain_steps, micro_sequences, model_width = 2, 1, 32
use_paper_style()
generator = torch.Generator().manual_seed(seed)
claims = Claims(this_run)
n_max = 2 ** max_microbatches_log2


def shown(claim_set: Claims, key: str) -> str:
    """A claim's value with three significant digits (errors span 10⁻⁷ to 10⁻², times a few ms)."""
    return f"{claim_set[key].value:.3g}".replace("-", "−")
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
# Independent zero-mean operands might flatter BF16: their sum grows like √n, so each BF16 addition
# rounds a running sum little larger than the term it adds. Micro-batch gradients of a real model
# share a direction (their mean is the full-batch gradient), so their sum can grow faster, up to n. Here: the
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
    ax.text(1, 2.0 ** -8 * 1.4, "BF16 unit roundoff 2⁻⁸", color="grey", va="bottom")
    ax.set_ylim(top=2.0 ** -8 * 20)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches accumulated")
    ax.set_title(f"{source}\n(the sum grows ×{growth.iloc[-1]:.0f} over {growth.index[-1]})", fontsize=7)
axes[0].set_ylabel("relative error of Σ wgrad")
axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
save_figure(fig, f"{NAME}_error")

# %%
SHORT = {"autograd, FP32 .grad": "fp32_grad", "fused, FP32 main_grad": "fused",
         "fused, FP32 main_grad, BF16 params": "fused_bf16_params", "autograd, BF16 .grad": "bf16_grad"}
sources = list(dict.fromkeys(error_table.operands))
SOURCE = dict(zip(sources, ("iid", "real")))
errors = error_table.set_index(["operands", "method", "microbatches"])
for source in sources:
    for method, short in SHORT.items():
        claims.value(f"error.{SOURCE[source]}.{short}", errors.loc[(source, method, n_max), "relative_error"],
                     test="observed", digits=4, headline=(SOURCE[source], short) in (("real", "bf16_grad"), ("real", "fp32_grad")),
                     text=f"{source}: relative error of the sum of {n_max} micro-batch gradients, {method}")
    claims.value(f"error.{SOURCE[source]}.bf16_grad.first", errors.loc[(source, "autograd, BF16 .grad", 1),
                                                                      "relative_error"],
                 test="observed", digits=4, text=f"{source}: relative error after one micro-batch, BF16 .grad")
    claims.value(f"growth.{SOURCE[source]}", errors.loc[(source, "autograd, FP32 .grad", n_max), "sum_growth"],
                 test="observed", digits=1, text=f"{source}: ‖sum of {n_max}‖ ÷ ‖first micro-batch gradient‖")
    fused = error_table[(error_table.operands == source) & error_table.method.str.startswith("fused")]
    wide = fused.pivot(index="microbatches", columns="method", values="relative_error")
    claims.value(f"fused_params.{SOURCE[source]}", (wide.iloc[:, 0] - wide.iloc[:, 1]).abs().max(),
                 test="computed", digits=2,
                 text=f"{source}: largest difference between the fused errors with FP32 and with BF16 parameters")
claims.value("growth.sqrt", n_max ** 0.5, test="computed", digits=1, text=f"√{n_max}: the growth of a sum of "
             "independent zero-mean terms")
same_fused = all(claims[f"fused_params.{SOURCE[s]}"].value == 0 for s in sources)
display(Markdown(claims.render(f"""
After {n_max} micro-batches the summed gradient kept in BF16 `.grad` is off by {shown(claims, "error.iid.bf16_grad")} (i.i.d. operands) and {shown(claims, "error.real.bf16_grad")}
(the CharGPT layer's); after one micro-batch already by {shown(claims, "error.iid.bf16_grad.first")} and {shown(claims, "error.real.bf16_grad.first")}, the BF16 rounding of the wgrad itself. Kept in FP32 it is
off by {shown(claims, "error.iid.fp32_grad")} / {shown(claims, "error.real.fp32_grad")} when autograd adds
FP32 wgrads into `.grad` and {shown(claims, "error.iid.fused")} / {shown(claims, "error.real.fused")} when
one GEMM accumulates into FP32 `main_grad`{" (identical with BF16 parameters)" if same_fused else ""}.
The real micro-batch gradients' sum grows ×{shown(claims, "growth.real")} over the window where the i.i.d.
one grows ×{shown(claims, "growth.iid")} (√{n_max} = {shown(claims, "growth.sqrt")}). One draw of operands
and one layer: single observations.
""")))

# %% [markdown]
# ## 2. Time and memory per accumulation step
#
# One micro-batch's forward and backward, with the gradient already holding earlier micro-batches,
# timed `timing_steps` times per method; the methods are interleaved (each repeat times every method,
# in a rotating order), so a comparison of two methods is paired by repeat.
# Memory is what the step allocates (CPU: the profiler's allocation records; CUDA: the peak above
# the starting allocation). Autograd allocates a fresh wgrad every step and adds it; the fused path
# runs one GEMM into `main_grad`. In this emulation every GEMM runs in FP32, so the BF16 path also
# converts its operands (whether that is what its time pays for is not measured).


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


def make_step(options):
    """One accumulation step of a fresh layer for ``options``, warmed up (its gradient already exists)."""
    layer = make_layer(options["dtype"], options["fused"])
    # x needs a gradient, as a layer inside a network does: each step computes dx as well
    x = xs[0].to(device, options["dtype"]).requires_grad_(True)
    dy = dys[0].to(device, options["dtype"])

    def step():
        x.grad = None
        layer(x).backward(dy)

    layer(x, is_first_microbatch=True).backward(dy)
    return step


steps = {method: make_step(options) for method, options in METHODS.items()}
order = list(METHODS)
repeat_rows = []
for repeat in session.progress(range(timing_steps), desc="timing"):
    shift = repeat % len(order)  # the methods take turns in every position, so a drift hits all alike
    for method in order[shift:] + order[:shift]:
        repeat_rows.append({"method": method, "repeat": repeat, "step_ms": 1e3 * timed(steps[method])})
repeats = pd.DataFrame(repeat_rows)
save_csv(repeats, f"{NAME}_repeats_timing")  # "_timing" outputs vary run to run; every other output is byte-stable
rows = []
for method, options in METHODS.items():
    times = repeats[repeats.method == method].step_ms
    rows.append({"method": method, "step_ms": float(np.median(times)),
                 "step_ms_q25": float(np.quantile(times, 0.25)), "step_ms_q75": float(np.quantile(times, 0.75)),
                 "repeats": timing_steps,
                 "allocated_mib": allocated_bytes(steps[method]) / 2 ** 20,
                 "gradient_bytes_per_element": (4 if options["fused"] or options["dtype"] == torch.float32 else 2)})
cost_table = pd.DataFrame(rows)
save_csv(cost_table, f"{NAME}_timing")
cost_table.round(3)

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.45)
colors = [f"C{i}" for i in range(len(cost_table))]
spread = [cost_table.step_ms - cost_table.step_ms_q25, cost_table.step_ms_q75 - cost_table.step_ms]
axes[0].barh(cost_table.method, cost_table.step_ms, color=colors, xerr=spread, error_kw={"linewidth": 0.8})
axes[0].set_xlabel(f"time per micro-batch (ms), median and\nquartiles of {timing_steps}")
axes[1].barh(cost_table.method, cost_table.allocated_mib, color=colors)
axes[1].set_xlabel("allocated per micro-batch (MiB)" + ("\nBF16 rows: as the CPU runs bf16 (its kernels' own\n"
                   "buffers), not a GPU's footprint" if device == "cpu" else ""))
axes[1].set_yticks([])
for ax in axes:
    ax.invert_yaxis()
fig.suptitle(f"One accumulation step, {tokens} tokens × {in_features} → {out_features}, {device}")
save_figure(fig, f"{NAME}_timing")

# %%
timing = Claims(this_run, pairs="repeats")  # saved apart: times are not reproducible to the byte
per_repeat = repeats.pivot(index="repeat", columns="method", values="step_ms")
TIME_PAIRS = [("fused, FP32 main_grad", "autograd, FP32 .grad"), ("autograd, BF16 .grad", "autograd, FP32 .grad"),
              ("fused, FP32 main_grad, BF16 params", "fused, FP32 main_grad")]
for a, b in TIME_PAIRS:  # log ratios: a repeat slowed by the machine's other work weighs no more than others
    timing.paired(f"time.{SHORT[a]}-{SHORT[b]}", np.log(per_repeat[a] / per_repeat[b]), family="time",
                  unit="(natural log of the time ratio)", digits=3,
                  text=f"log of time per step, {a} ÷ {b} (paired by repeat)")
timing.holm("time")
mib = 2 ** 20
for row in cost_table.itertuples():
    timing.value(f"time.{SHORT[row.method]}", row.step_ms, n=timing_steps, unit="ms", digits=2,
                 text=f"{row.method}: median time per step over {timing_steps} repeats")
    timing.value(f"alloc.{SHORT[row.method]}", row.allocated_mib, test="observed", unit="MiB", digits=2,
                 text=f"{row.method}: memory allocated by one step")
timing.value("alloc.expected.fused", 4 * tokens * (in_features + out_features) / mib, test="computed", unit="MiB",
             digits=2, text="FP32 y and dx of one step")
timing.value("alloc.expected.autograd", 4 * (tokens * (in_features + out_features) + in_features * out_features) / mib,
             test="computed", unit="MiB", digits=2, text="FP32 y, dx and a fresh wgrad of one step")
save_csv(timing.frame(), f"{NAME}_claims_timing")


def time_comparison(key: str) -> str:
    """A timing comparison as a ratio of times (the exponential of the mean log ratio, the geometric mean) with
    its 95 % interval and test (the claims' own verdict would call the repeats seeds)."""
    claim = timing[key]
    ratio = f"×{math.exp(claim.value):.3f} [{math.exp(claim.low):.3f}, {math.exp(claim.high):.3f}]"
    test = (f"paired t on the log ratios over {claim.n} interleaved repeats, Holm-adjusted p {claim.p_text()} over "
            f"{claim.family_size} comparisons; {claim.sign_flip_text()}")
    if claim.resolved():
        return f"{ratio} (resolved: {test})"
    return f"{ratio} (not resolved: {test}; these repeats detect a ratio of ×{math.exp(claim.detectable):.3f} at 80 % power{claim.power_level()})"


display(Markdown(claims.render(f"""
Per step (x requires a gradient, as inside a network) the fused path allocates {timing["alloc.fused"].both()}
where autograd allocates {timing["alloc.fp32_grad"].both()} into FP32 `.grad`: y and dx take {timing["alloc.expected.fused"].both()}, a fresh FP32 wgrad brings them to {timing["alloc.expected.autograd"].both()}. The BF16 variants allocate {timing["alloc.bf16_grad"].both()}
(BF16 `.grad`) and {timing["alloc.fused_bf16_params"].both()} (fused, BF16 parameters): this emulation
converts their operands to FP32 for the GEMM. Median times per step are {timing["time.fp32_grad"].both()}
(autograd, FP32 `.grad`), {timing["time.fused"].both()} (fused), {timing["time.bf16_grad"].both()} (BF16
`.grad`) and {timing["time.fused_bf16_params"].both()} (fused, BF16 parameters), on {device}. Paired by
repeat, the time ratio of fused ÷ autograd is {time_comparison("time.fused-fp32_grad")}; BF16 `.grad` ÷ FP32 `.grad` {time_comparison("time.bf16_grad-fp32_grad")}; fused with BF16 ÷ with FP32 parameters {time_comparison("time.fused_bf16_params-fused")}. Times come from one run on one machine that other work may share: the intervals cover the spread within this run, not between runs.
""")))

# %% [markdown]
# ## 3. What goes back to autograd
#
# Every combination of fused accumulation (`fuse_wgrad_accumulation`), delayed wgrad (`delay_wgrad`:
# the GEMM runs later, at `backward_dw()`) and the Megatron attribute `grad_added_to_main_grad`
# ("flag"), observed on a real layer: after one backward,
# what `.grad` holds, whether `main_grad` was written, and what changes after `backward_dw()`.
# The disputed corner is delayed + fused + flag; what it returns here is stated below the table.


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
display(Markdown(markdown_table(contract.astype(str).replace({"True": "yes", "False": "no"}))))
corner = contract[contract.fused & contract.delayed & contract["flag attr"]].iloc[0]
without_flag = contract[contract.fused & contract.delayed & ~contract["flag attr"]].iloc[0]
display(Markdown(claims.render(f"""
Observed: with delayed wgrad, fused accumulation and the flag attribute, autograd receives
"{corner["returned to autograd"]}"; without the attribute, "{without_flag["returned to autograd"]}".
""")))

# %%
claims.save()
final = error_table[error_table.microbatches == n_max].set_index(["operands", "method"]).relative_error
synthetic, real = error_table.operands.unique()
save_metrics(NAME,
             error_fp32_grad=final[synthetic, "autograd, FP32 .grad"],
             error_fused_main_grad=final[synthetic, "fused, FP32 main_grad"],
             error_fused_main_grad_bf16_params=final[synthetic, "fused, FP32 main_grad, BF16 params"],
             error_bf16_grad=final[synthetic, "autograd, BF16 .grad"],
             real_error_fp32_grad=final[real, "autograd, FP32 .grad"],
             real_error_bf16_grad=final[real, "autograd, BF16 .grad"])
