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
# A forum question (seeds/000): a transformer whose linears use a custom quantized
# `autograd.Function` probes its weight gradient inside `backward` and sees values of 100–1000,
# while `param.grad` of the same layer is ~0.00x — and yet training works. This notebook rebuilds
# that setting (`qlab.seed_model`: the seed's Function as written, and corrected), probes it with
# `qlab.probes`, and lets `GradientAudit` attribute the ratio to its causes: the GradScaler's loss
# scale, gradient accumulation, clipping, DDP averaging — and, in the seed's code, a genuine bug.

# %% tags=["parameters"]
smoke: bool = False  # tiny sizes, for the test suite (< 30 s)
device: str = "auto"  # unused: everything trains on the CPU (DDP over gloo)
seed: int = 0  # seeds the model and the data
steps: int = 150  # training steps per run
init_scale: float = 65536.0  # GradScaler's initial loss scale (its default, 2**16)
growth_interval: int = 40  # GradScaler doubles the scale after this many steps without overflow
microbatches: int = 4  # micro-batches per step in the accumulation run
clip_norm: float = 0.05  # max_norm for the clipping run
ddp_steps: int = 5  # steps of the 2-process DDP run

# %%
import inspect

import pandas as pd
import torch

from qlab import seed_model, session
from qlab.plotting import save_figure, subplots, use_paper_style
from qlab.results import save_csv, save_metrics

NAME = "01_gradient_norm_discrepancy"
device = session.start(NAME, globals()).device  # prints where results go; "auto" -> cuda or cpu
if smoke:
    steps, growth_interval, ddp_steps = 8, 3, 1
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
# In "as_written" mode `x_saved` is x itself (≈ q_x·s_x), so dW comes out ≈ s_x times too small and
# dX ≈ s_w times too small; "corrected" saves q_x and q_w, which makes the backward the straight-
# through estimator of the quantized forward. We first look at the corrected model, where the
# whole discrepancy must be explained by the training setup.
#
# ## 2. The loss scale: a ratio of 65536 with healthy training
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
fig, axes = subplots(1, 2, width="text", aspect=0.42)
axes[0].semilogy(scaled.step, scaled.ratio, label="‖probe inside backward‖ / ‖param.grad‖")
axes[0].semilogy(scaled.step, scaled.loss_scale, linestyle="--", label="GradScaler scale")
axes[0].set_xlabel("step")
axes[0].set_ylabel("ratio")
axes[0].legend(fontsize=6)
axes[0].set_title("blocks.0.fc1.weight")
axes[1].plot(scaled.step, scaled.ratio / scaled.loss_scale)
axes[1].set_ylim(0.99, 1.01)
axes[1].set_xlabel("step")
axes[1].set_ylabel("ratio ÷ loss scale")
axes[1].set_title(f"audit: unexplained ≤ {scaled.audit_unexplained.max():.1g}")
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
for label, options in session.progress(settings.items(), total=len(settings), desc="settings"):
    runs[label] = seed_model.train("corrected", "adam", steps, seed=seed, **options)
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
ax.set_title("Every ratio explained by the audit")
ax.legend(fontsize=6)
save_figure(fig, f"{NAME}_settings")

# %% [markdown]
# ## 4. The seed's code as written: a genuine scale bug
#
# On one batch, the as-written gradients against the corrected ones (the straight-through
# estimator, i.e. autograd of the fake-quantized forward). dW of each layer is off by ≈ s_x of its
# input; dX by s_w, and that error compounds through the layers below. The inner
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
# ## 5. Why the seed's model still trained: Adam against SGD
#
# Adam divides each update by the running RMS of that tensor's gradient, so a constant per-tensor
# factor cancels (up to its ε); SGD's step is proportional to the gradient, so a factor of
# s_x ≈ 0.03 (and products of s_w further down) is a 30×+ smaller learning rate. Here the factors
# are not constant — s_x changes with every batch and the dX errors compound — so Adam is not fully
# immune either, but it keeps training where SGD stalls.

# %%
curves = []
for optimizer, mode in session.progress([(o, m) for o in ("adam", "sgd") for m in seed_model.MODES], desc="runs"):
    run = seed_model.train(mode, optimizer, steps, seed=seed)
    curves.append(run.assign(optimizer=optimizer, mode=mode)[["optimizer", "mode", "step", "loss"]])
curves = pd.concat(curves, ignore_index=True)
save_csv(curves, f"{NAME}_optimizers")
curves.groupby(["optimizer", "mode"]).loss.last().unstack()

# %%
fig, axes = subplots(1, 2, width="text", aspect=0.42)
for ax, optimizer in zip(axes, ("adam", "sgd")):
    for mode, style in zip(seed_model.MODES, ("-", "--")):
        part = curves[(curves["optimizer"] == optimizer) & (curves["mode"] == mode)]
        ax.plot(part.step, part.loss, linestyle=style, label=mode.replace("_", " "))
    ax.set_title(f"{optimizer.upper()}: the same backward bug")
    ax.set_xlabel("step")
axes[0].set_ylabel("training loss")
axes[0].legend(fontsize=6)
save_figure(fig, f"{NAME}_optimizers")

# %%
final = curves.groupby(["optimizer", "mode"]).loss.last()
save_metrics(NAME,
             median_ratio_loss_scale=scaled.ratio.median(), max_unexplained=audit_table.max_unexplained.max(),
             inner_backward_calls=seed_model.SeedQuantizerFunction.backward_calls,
             final_loss_adam_as_written=final["adam", "as_written"], final_loss_adam_corrected=final["adam", "corrected"],
             final_loss_sgd_as_written=final["sgd", "as_written"], final_loss_sgd_corrected=final["sgd", "corrected"])
