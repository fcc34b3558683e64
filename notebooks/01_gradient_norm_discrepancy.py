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
# # Why is the gradient inside my custom backward 10⁵× larger than `param.grad`?
#
# A forum question: a transformer whose linears use a custom quantized
# `autograd.Function` probes its weight gradient inside `backward` and sees values of 100–1000,
# while `param.grad` of the same layer is ~0.00x — and yet training works. This notebook rebuilds
# that setting (`qlab.seed_model`: the seed's Function as written, and corrected), probes it with
# `qlab.probes`, and lets `GradientAudit` attribute the ratio to its causes: the GradScaler's loss
# scale, gradient accumulation, clipping, DDP averaging — and, in the seed's code, a genuine bug.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes: a quick check that every cell runs (the test suite runs each so)
profile: str = "cpu"  # "cpu" (these sizes) or "paper" (10 seeds × 3000 fp16 steps: a 16-core machine)
device: str = "auto"  # unused: everything trains on the CPU (DDP over gloo)
seed: int = 0  # seeds the model and the data
steps: int = 150  # training steps per run
init_scale: float = 65536.0  # GradScaler's initial loss scale (its default, 2**16)
growth_interval: int = 40  # GradScaler doubles the scale after this many steps without overflow
microbatches: int = 4  # micro-batches per step in the accumulation run
clip_norm: float = 0.05  # max_norm for the clipping run
ddp_steps: int = 5  # steps of the 2-process DDP run
seeds: int = 8  # seeds per (backward, optimizer) in the seed's own fp16 setting (section 5)
fp16_steps: int = 300  # training steps per run in section 5
fp16_bits: int = 6  # grid width in section 5 (section 5 counts how often 8-bit grids overflow in fp16)
margin: float = 0.05  # nats: two optimizers' final losses are called equal only if TOST shows them within ±margin
executor: str = "processes"  # how runs fan out: "serial", "processes" (one per core) or "ray" (a Ray cluster)
max_workers: int = 0  # runs at once (0: every usable core, or qlab.runs.RUNS_PER_GPU per GPU)

# %%
import inspect

import pandas as pd
import torch
from IPython.display import Markdown, display

from qlab import seed_model, session, stats
from qlab.claims import Claims
from qlab.plotting import mean_band, save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics
from qlab.runs import run_many, task

NAME = "01_gradient_norm_discrepancy"
this_run = session.start(NAME, globals())  # prints where results go; resolves "auto" -> cuda or cpu
device = this_run.device
if profile == "paper":  # the same small model (the seed's), 10× longer runs and twice the seeds
    steps, seeds, fp16_steps = 1500, max(seeds, 10), 3000
if smoke:
    steps, growth_interval, ddp_steps, seeds, fp16_steps = 8, 3, 1, 2, 6
use_paper_style()
torch.manual_seed(seed)
print(f"steps={steps} init_scale={init_scale:g} microbatches={microbatches} clip_norm={clip_norm}")

# %% [markdown]
# ## 1. The seed's Function
#
# Its forward quantizes x and W to int8 grids (q = round(v/s), s = amax/127), multiplies the grids
# and rescales by s_x·s_w. Its backward multiplies by the same scales — but it saved the *raw*
# x and W, not the grids:

# %%
print(inspect.getsource(seed_model.SeedLinearFunction.backward))

# %% [markdown]
# In "as_written" mode `x_saved` is x itself (≈ q_x·s_x), so by the algebra of the code dW is off by a
# factor of about s_x and dX by about s_w (the scales themselves are not measured here; section 4
# measures the ratios of the gradients); "corrected" saves q_x and q_w, which makes the backward the straight-
# through estimator of the quantized forward. We first look at the corrected model, where the
# whole discrepancy must be explained by the training setup.
#
# ## 2. The loss scale: a ratio the size of the scale, with healthy training
#
# With `torch.amp.GradScaler` the loss is multiplied by the scale before `backward`, so every
# gradient seen *inside* backward is ×scale; `unscale_` divides `param.grad` afterwards. The probe
# inside the Function's backward therefore reports the scaled gradient, and the ratio follows the
# loss scale exactly — doubling every `growth_interval` steps.

# %%
scaled = seed_model.train("corrected", "adam", steps, loss_scale=init_scale, growth_interval=growth_interval, seed=seed)
save_csv(scaled, f"{NAME}_loss_scale")
scaled[["step", "loss", "loss_scale", "ratio", "audit_unexplained"]].iloc[:: max(1, steps // 8)]

# %%
fig, ax = subplots(width="column", aspect=0.75)
ax.semilogy(scaled.step, scaled.ratio, label="‖probe inside backward‖ / ‖param.grad‖")
ax.semilogy(scaled.step, scaled.loss_scale, linestyle="--", label="GradScaler scale")
ax.set_xlabel("step")
ax.set_ylabel("ratio (blocks.0.fc1.weight)")
ax.legend(fontsize=6, loc="upper left")
unexplained = scaled.audit_unexplained.max()
ax.set_title("The ratio is the loss scale" + (": the audit explains all of it" if unexplained == 0 else
                                                f" up to {unexplained:.1g}"), fontsize=7)
save_figure(fig, f"{NAME}_loss_scale")

# %% [markdown]
# ## 3. Accumulation, clipping and DDP
#
# Each mechanism changes the ratio in its own way, and the audit predicts `param.grad` from the
# gradients seen inside backward: clip · Σ_ranks Σ_micro-batches inside / (scale · world size).
# With 4 micro-batches (loss ÷ 4) the first micro-batch's gradient is about ¼–½ of the sum;
# clipping shrinks `param.grad` by the clip coefficient; under DDP each rank's backward sees its
# local gradient while `param.grad` holds the average over the ranks (2 gloo processes on the CPU).

# %%
settings = {
    f"{microbatches} micro-batches": dict(microbatches=microbatches),
    f"clip to {clip_norm:g}": dict(clip_norm=clip_norm),
    "all three": dict(loss_scale=init_scale, growth_interval=growth_interval, microbatches=microbatches,
                      clip_norm=clip_norm),
}
runs = {"loss scale": scaled}
setting_runs = run_many([task(seed_model.train, "corrected", "adam", steps, seed=seed, **options)
                         for options in settings.values()], executor=executor, max_workers=max_workers or None,
                        desc="settings")
runs.update(zip(settings, setting_runs))
ddp = seed_model.ddp_audit(world_size=2, steps=ddp_steps, seed=seed)
save_csv(ddp, f"{NAME}_ddp")
rows = [{"setting": label, "median_ratio": run.ratio.median(), "median_clip_coefficient": run.clip_coefficient.median(),
         "max_unexplained": run.audit_unexplained.max()} for label, run in runs.items()]
rows.append({"setting": "DDP, 2 ranks", "median_ratio": ddp.ratio.median(), "median_clip_coefficient": 1.0,
             "max_unexplained": ddp.audit_unexplained.max()})
audit_table = pd.DataFrame(rows)
save_csv(audit_table, f"{NAME}_audit")
audit_table

# %%
fig, ax = subplots(width="column", aspect=0.8)
for label, run in runs.items():
    ax.semilogy(run.step, run.ratio, label=label)
ax.set_xlabel("step")
ax.set_ylabel("‖inside backward‖ / ‖param.grad‖")
ax.set_title("Inside backward against param.grad, per setting")
ax.legend(fontsize=6)
save_figure(fig, f"{NAME}_settings")

# %% [markdown]
# ## 4. The seed's code as written: a genuine scale bug
#
# On one batch, the as-written gradients against the corrected ones (the straight-through
# estimator, i.e. autograd of the fake-quantized forward). From the code, dW of each layer should be
# off by about s_x of its input and dX by s_w; the ratios measured here, on one batch, are in the
# table and the conclusions. The inner
# `QuantizerFunction`'s backward never runs: it was called inside another Function's forward,
# where autograd records nothing.

# %%
seed_model.SeedQuantizerFunction.backward_calls = 0
batch = seed_model.permutation_task_batch(16, 32, 32, torch.Generator().manual_seed(seed + 7), seed)
grads = {}
for mode in seed_model.MODES:
    model = seed_model.SeedTransformer(mode=mode, seed=seed)
    torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten()).backward()
    grads[mode] = {name: p.grad.clone() for name, p in model.named_parameters()}
rows = []
for name, reference in grads["corrected"].items():
    if name.endswith(".weight") and name.startswith("blocks"):
        written = grads["as_written"][name]
        rows.append({"parameter": name, "norm_ratio_written_to_corrected": (written.norm() / reference.norm()).item(),
                     "relative_error": ((written - reference).norm() / reference.norm()).item()})
bug_table = pd.DataFrame(rows)
save_csv(bug_table, f"{NAME}_as_written")
print("inner QuantizerFunction.backward calls:", seed_model.SeedQuantizerFunction.backward_calls)
bug_table

# %%
fig, ax = subplots(width="column", aspect=0.8)
ax.barh(bug_table.parameter, bug_table.norm_ratio_written_to_corrected)
ax.set_xscale("log")
ax.axvline(1, color="black", linewidth=0.5)
ax.set_xlabel("‖dW as written‖ / ‖dW corrected‖")
ax.invert_yaxis()
ax.set_title("The seed's backward: off by its scales")
save_figure(fig, f"{NAME}_as_written")

# %% [markdown]
# ## 5. Did the seed's model "train fine"? Its own setting, over seeds
#
# The seed trained under mixed precision with a GradScaler, its backward computing in fp16. Here:
# every SeedLinear GEMM in fp16 (`seed_model.fp16_matmul`: fp16 operands and result, fp32
# accumulation, as a GPU computes it), GradScaler from 2¹⁶, `fp16_steps` steps, the backward as
# written and corrected × Adam with ε ∈ {1e-8, 1e-12, 1e-16} and SGD, `seeds` seeds each. The grids
# are `fp16_bits` wide (the seed does not state its width): with the 8-bit grids of sections 1–4,
# fc2's 256-term dot products of grid values up to 127 can exceed fp16's largest value; a short 8-bit
# run below counts how many of its steps overflow.
#
# Adam divides each update by the running RMS of that tensor's gradient, so a constant per-tensor
# factor cancels (up to ε) where SGD's step shrinks with it. If Adam's ε were what hid the tiny
# lower-layer gradients, the three ε would differ.

# %%
OPTIMIZERS = {"Adam ε=1e-8": ("adam", 1e-8), "Adam ε=1e-12": ("adam", 1e-12), "Adam ε=1e-16": ("adam", 1e-16),
              "SGD": ("sgd", 1e-8)}
grid = [(label, mode, s) for label in OPTIMIZERS for mode in seed_model.MODES for s in range(seeds)]
fp16_runs = run_many([task(seed_model.train, mode, OPTIMIZERS[label][0], fp16_steps, loss_scale=init_scale,
                           growth_interval=growth_interval, precision="fp16", eps=OPTIMIZERS[label][1], bits=fp16_bits,
                           audit=False, seed=run_seed) for label, mode, run_seed in grid],
                     executor=executor, max_workers=max_workers or None, desc="fp16 runs")
curves = []
for (label, mode, run_seed), run in zip(grid, fp16_runs):
    curves.append(run.assign(optimizer=label, mode=mode, seed=run_seed)[
        ["optimizer", "mode", "seed", "step", "loss", "loss_scale", "zero_grad_fraction"]])
curves = pd.concat(curves, ignore_index=True)
save_csv(curves, f"{NAME}_optimizers")
final_loss = curves[curves.step == curves.step.max()]
final_table = stats.summarize(final_loss, "loss", ["optimizer", "mode"])
written_over_corrected = (final_loss.pivot_table(index=["optimizer", "seed"], columns="mode", values="loss")
                          .eval("as_written / corrected").rename("ratio").reset_index())
ratio_table = stats.summarize(written_over_corrected, "ratio", ["optimizer"])
save_csv(final_table, f"{NAME}_final_loss")
final_table.round(3)

# %%
ratio_table.round(2)  # final loss, as written ÷ corrected with the same seed: mean and 95 % interval

# %%
fig, axes = subplots(2, 2, width="text", aspect=0.6, sharex=True, sharey=True)
axes = axes.flatten()
for ax, label in zip(axes, OPTIMIZERS):
    part = curves[curves.optimizer == label].assign(mode=lambda f: f["mode"].str.replace("_", " "))
    mean_band(ax, part, "step", "loss", by="mode")
    ax.set_yscale("log")
    ax.set_title(f"{label}: mean, 95 % band over {seeds} seeds", fontsize=7)
for ax in axes[2:]:
    ax.set_xlabel("step")
for ax in axes[::2]:
    ax.set_ylabel("training loss (nats)")
axes[1].legend(fontsize=6, loc="upper right")
save_figure(fig, f"{NAME}_optimizers")

# %%
final = final_table.set_index(["optimizer", "mode"])["mean"]
save_metrics(NAME,
             median_ratio_loss_scale=scaled.ratio.median(), max_unexplained=audit_table.max_unexplained.max(),
             inner_backward_calls=seed_model.SeedQuantizerFunction.backward_calls, seeds=seeds,
             final_loss_adam_as_written=final["Adam ε=1e-8", "as_written"],
             final_loss_adam_corrected=final["Adam ε=1e-8", "corrected"],
             final_loss_sgd_as_written=final["SGD", "as_written"], final_loss_sgd_corrected=final["SGD", "corrected"])

# %% [markdown]
# ## 6. Conclusions
#
# Computed in the next cell from this run's results and saved to
# `data/01_gradient_norm_discrepancy_claims.csv`. Sections 2–4 are single runs (one seed); section
# 5's comparisons are paired by seed, Holm-corrected within their family, and "the same" needs TOST
# within `margin`.

# %%
EIGHT_BIT_STEPS = 20
eight_bit = seed_model.train("corrected", "adam", EIGHT_BIT_STEPS, loss_scale=init_scale, growth_interval=growth_interval,
                             precision="fp16", bits=8, audit=False, seed=seed)
overflowed = int((eight_bit.loss_scale.diff() < 0).sum())  # GradScaler halves its scale after an overflow

claims = Claims(this_run)
claims.value("scale.ratio_error", float((scaled.ratio / scaled.loss_scale - 1).abs().max()), test="observed",
             digits=2, text="largest relative difference between the probed ratio and the GradScaler's scale")
claims.value("audit.unexplained", float(audit_table.max_unexplained.max()), test="observed", digits=1,
             text="largest share of param.grad the audit leaves unexplained, over every setting", headline=True)
by_setting = audit_table.set_index("setting")
claims.value("accumulation.ratio", by_setting.median_ratio.iloc[1], test="observed", digits=3,
             text=f"median ratio with {microbatches} micro-batches")
claims.value("clip.ratio", by_setting.median_ratio.iloc[2], test="observed", digits=1,
             text=f"median ratio when clipping to {clip_norm:g}")
claims.value("ddp.ratio", by_setting.median_ratio["DDP, 2 ranks"], test="observed", digits=2,
             text="median ratio of one rank's local to the averaged gradient, 2-rank DDP")
claims.value("bug.inner_calls", seed_model.SeedQuantizerFunction.backward_calls, test="observed", digits=0,
             text="calls of the inner QuantizerFunction's backward")
weights = bug_table.set_index("parameter").norm_ratio_written_to_corrected
claims.value("bug.dw_low", weights.min(), test="observed", digits=2, text="smallest ‖dW as written‖ / ‖dW corrected‖")
claims.value("bug.dw_high", weights.max(), test="observed", digits=2, text="largest ‖dW as written‖ / ‖dW corrected‖")

losses = final_loss.pivot_table(index=["optimizer", "seed"], columns="mode", values="loss").reset_index()
bug_keys = []
for label in OPTIMIZERS:
    rows = losses[losses.optimizer == label].sort_values("seed")
    key = f"bug.{label.replace('Adam ε=', 'adam_eps').lower()}"
    claims.paired(key, rows.as_written - rows.corrected, family="bug", unit="nats", headline=label == "Adam ε=1e-8",
                  text=f"{label}: final loss, as written − corrected")
    bug_keys.append(key)
claims.holm("bug")
for label in OPTIMIZERS:
    rows = written_over_corrected[written_over_corrected.optimizer == label]
    claims.mean(f"bug.ratio.{label.replace('Adam ε=', 'adam_eps').lower()}", rows.ratio, digits=1,
                text=f"{label}: final loss as written ÷ corrected, same seed")
adam_curves = curves[curves.optimizer == "Adam ε=1e-8"].pivot_table(index=["step", "seed"], columns="mode",
                                                                     values="loss").reset_index()
gap_p = {step: stats.paired_test(part.as_written - part.corrected)["p"] for step, part in adam_curves.groupby("step")}
parted = next((step for step in sorted(gap_p) if all(gap_p[s] < 0.05 for s in gap_p if s >= step)), None)
if parted is not None:
    claims.value("bug.parting_step", parted, test="computed", digits=0,
                 text="first step from which every later step's paired gap (Adam ε=1e-8) has p < 0.05 (unadjusted)")
eps_keys = []
written = losses.set_index(["optimizer", "seed"]).as_written
for label in ("Adam ε=1e-12", "Adam ε=1e-16"):
    key = f"eps.{label.split('=')[1]}"
    claims.paired(key, (written[label] - written["Adam ε=1e-8"]).values, margin=margin, unit="nats", family="eps",
                  text=f"as written: final loss with {label} − with ε=1e-8")
    eps_keys += [key, f"{key}.same"]
claims.holm("eps")
for mode in seed_model.MODES:
    backed_off = curves[curves["mode"] == mode].groupby(["optimizer", "seed"]).loss_scale.apply(
        lambda scale: int((scale.diff() < 0).sum()))
    claims.value(f"backoffs.{mode}", int(backed_off.sum()), test="computed", digits=0,
                 text=f"GradScaler back-offs over the {len(backed_off)} fp16 runs {mode.replace('_', ' ')}")
claims.value("zero_grads", float(curves[curves["mode"] == "as_written"].zero_grad_fraction.max()), test="computed",
             digits=4, text="largest fraction of exact-zero weight gradients in a step as written")
claims.value("eight_bit.overflows", overflowed, test="observed", digits=0,
             text=f"overflowing steps after the first, of {EIGHT_BIT_STEPS - 1}, in an fp16 run with 8-bit grids")
claims.value("eight_bit.steps", EIGHT_BIT_STEPS - 1, test="computed", digits=0, text="steps after the first")
claims.save()



display(Markdown(claims.render("""
**The ratio is the training setup.** The probed ratio follows the GradScaler's scale to within
{scale.ratio_error:value} (relative), and across every setting the audit leaves at most
{audit.unexplained:value} of `param.grad` unexplained. Median ratios: {accumulation.ratio:value} with
accumulation, {clip.ratio:value} with clipping, {ddp.ratio:value} under 2-rank DDP (one seed each).

**The seed's backward as written is a bug:** its dW is {bug.dw_low:value}–{bug.dw_high:value} times the
corrected one across the blocks' weights, and the inner QuantizerFunction's backward ran
{bug.inner_calls:value} times.

**Did it "train fine"?** In the seed's own fp16 setting, final losses as written − corrected, paired by
seed:
""") + "\n" + claims.table(bug_keys)))
display(Markdown(claims.render("""
With Adam (ε=1e-8) the loss as written ends {bug.adam_eps1e-8} above the corrected one
({bug.adam_eps1e-8:verdict}); as a ratio of the two final losses, {bug.ratio.adam_eps1e-8}
({bug.ratio.adam_eps1e-8:verdict}).
""") + ("" if parted is None else claims.render("The paired gap has p < 0.05 at every logged step "
                                                 "from step {bug.parting_step:value} on (each step's p unadjusted "
                                                 "for the many steps: a description of the curves, not a "
                                                 "test).")) + "\n\n" + claims.render("""
**Adam's ε.** The final loss as written with a smaller ε against ε=1e-8, paired by seed, tested for a
difference (Holm over the two) and for equivalence within the margin set in the parameters (TOST):
""") + "\n" + claims.table(eps_keys) + "\n\n" + claims.render("""
**What fp16 does here:** the GradScaler backed off {backoffs.as_written:value} times in the runs as
written and {backoffs.corrected:value} times in the corrected ones; at most {zero_grads:value} of a
step's weight gradients as written are exact zeros. With 8-bit grids, {eight_bit.overflows:value} of
the first {eight_bit.steps:value} steps' scales were cut after an overflow, which is why section 5 uses
`fp16_bits`.
""")))
