"""Generated bad input for qlab's public entry points: no value reaches torch's internals.

Each entry point below has one valid call (keyword arguments). Hypothesis picks an argument and
replaces its value by a bad one of the argument's kind:

- a value of the wrong kind (a string for a tensor or a number, a bool for an int, a number for a
  string, a seed for a generator, ...): the call must raise TypeError or ValueError, from a frame
  inside qlab, whose message names the argument;
- a value of the right kind that may or may not be valid (NaN, inf, zero, negative and huge numbers;
  empty, 0-d, 1-D, mismatched and ``meta`` tensors; other dtypes; unknown strings): the call either
  returns or raises as above — never a traceback from inside torch, numpy or Python;
- a non-contiguous view holding the valid tensor's values (a transposed copy seen through ``.T``, a
  stride-2 slice): the call must return what the valid call returns, bit for bit.

``make test`` runs a bounded number of examples per entry point (deterministic: derandomized, no
example database); QLAB_FUZZ_EXAMPLES=N runs N. A failure prints the minimal example hypothesis found.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import qlab  # noqa: E402
from qlab import (  # noqa: E402
    ablation,
    advisor,
    campaign,
    claims,
    crossmachine,
    formats,
    host,
    kernels,
    lab,
    notebooks,
    numerics,
    paths,
    plotting,
    probes,
    results,
    run_lists,
    scaling,
    seed_model,
    session,
    sparse,
    stats,
    sweep,
    synthetic,
)
from qlab import models as qlab_models  # noqa: E402
from qlab import nn as qnn  # noqa: E402
from qlab import plan as qlab_plan  # noqa: E402
from qlab import quantize as Q  # noqa: E402
from qlab import recipe as R  # noqa: E402
from qlab import runs as qlab_runs  # noqa: E402
from qlab.train import config as TC  # noqa: E402
from qlab.train import data as TD  # noqa: E402
from qlab.train import loop as TL  # noqa: E402
from qlab.train import models as TM  # noqa: E402

QLAB_DIR = Path(qlab.__file__).resolve().parent
EXAMPLES = int(os.environ.get("QLAB_FUZZ_EXAMPLES", "12"))


def x(*shape, seed=0):
    return torch.randn(*(shape or (4, 32)), generator=torch.Generator().manual_seed(seed))


def gen():
    return torch.Generator().manual_seed(0)


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(encoder=nn.Linear(32, 16), act=nn.ReLU(), head=nn.Linear(16, 4)))


def quantized_layer():
    torch.manual_seed(0)
    return qnn.QuantLinear(32, 8, recipe="mxfp8")


def delayed_state():
    layer = qnn.QuantLinear(32, 8, recipe="fp8_delayed")
    layer(x()).sum().backward()
    return layer.quant_state()


# --- small files for the functions that read and write them -------------------------------------------
# Inputs live in a temporary folder of this process; what qlab writes under data/ and figures/ goes to
# the test's own results folder (the fixture below), never into the repository.

_SCRATCH = tempfile.TemporaryDirectory(prefix="qlab-fuzz-")
GARBAGE = b"\x89PNG\r\n\x1a\n\x00\xff\xfe{[ unclosed: 'quote\n\x80\x81,,\t\"\n"


class Stem(str):
    """A plain file name a function writes or reads inside a folder: fuzzed with names that escape it."""


def scratch() -> Path:
    return Path(tempfile.mkdtemp(dir=_SCRATCH.name))


def file_with(name: str, content: str | bytes, folder: Path | None = None) -> Path:
    path = (folder or scratch()) / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def checkpoint_file() -> Path:
    """A file holding what a qlab training checkpoint holds (read_checkpoint's keys, plain values)."""
    state = {"step": 1, "model": {"w": torch.ones(2)}, "optimizer": {}, "scaler": {}}
    path = scratch() / "checkpoint.pt"
    torch.save({**state, "metrics": [], "fidelity": [], "config": {"task": "digits"}}, path)
    return path


def notebook_run(name="99_fuzz"):
    return session.NotebookRun(name, {"profile": "cpu"}, {}, paths.results_root(), "cpu")


def claimed(run=None):
    made = claims.Claims(run or notebook_run())
    made.paired("gap", [0.010, 0.012, 0.011], text="a − FP32", unit="nats", headline=True)
    made.value("loss", 2.0, text="a loss", n=1, test="observed")
    return made


def claims_folder() -> Path:
    folder = scratch()
    claimed().frame().to_csv(folder / "99_fuzz_claims.csv", index=False)
    return folder


def readme() -> Path:
    return file_with("README.md", f"# x\n{claims.FINDINGS_START}\nold\n{claims.FINDINGS_END}\nend\n")


def runs(shift=0.0) -> pd.DataFrame:
    losses = {"fp32": [2.0, 2.1, 2.05], "nvfp4": [2.2, 2.35, 2.3], "nvfp4/no SR": [2.3, 2.4, 2.45]}
    rows = [(c, s, v + shift) for c, vs in losses.items() for s, v in enumerate(vs)]
    return pd.DataFrame(rows, columns=["config", "seed", "val_loss"])


def runs_folder() -> Path:
    folder = scratch()
    file_with("machine.json", '{"cpu": "AMD EPYC 7B13", "threads": 2, "qlab_commit": "abc"}', folder)
    training = runs().rename(columns={"config": "variant"})
    training.to_csv(folder / "07_recipe_ablations_training.csv", index=False)
    return folder


def committed_claims() -> pd.DataFrame:
    return pd.DataFrame([
        {"key": "train.nvfp4", "test": "paired t", "value": 0.2, "low": 0.1, "high": 0.3, "low_90": math.nan,
         "high_90": math.nan, "n": 5, "p": 0.001, "p_adjusted": 0.01, "margin": math.nan},
        {"key": "train.nvfp4/no_SR.same", "test": "TOST", "value": 0.0, "low": -0.005, "high": 0.005,
         "low_90": -0.004, "high_90": 0.004, "n": 5, "p": 0.01, "p_adjusted": math.nan, "margin": 0.01},
    ])  # fmt: skip


def curves() -> pd.DataFrame:
    rows = [(r, s, t, 2.0 + 0.1 * (r == "nvfp4") + 0.01 * s - 0.1 * t) for r in ("fp32", "nvfp4")
            for s in range(3) for t in (1, 2)]  # fmt: skip
    return pd.DataFrame(rows, columns=["recipe", "seed", "step", "loss"])


def axes():
    return Figure(figsize=(2, 2), dpi=40).add_subplot()


def subplots_size(**arguments):
    fig, _ = plotting.subplots(**arguments)
    plotting.plt.close(fig)
    return tuple(fig.get_size_inches())


def environment_value(qlab_fuzz_value):
    with paths.environment(qlab_fuzz_value=qlab_fuzz_value):
        return os.environ["qlab_fuzz_value"]


# --- notebooks, tiny training runs and tiny models for the functions that read, train or wrap them ------

NOTEBOOK = "02_welford_vs_naive_variance"  # a committed notebook with a typed parameters cell


def notebook_copy(outputs: bool = False) -> Path:
    """A copy of a committed notebook in a folder of its own; ``outputs``: its code cells hold an output
    and an execution count, as an executed notebook's do."""
    content = json.loads((paths.NOTEBOOKS_DIR / f"{NOTEBOOK}.ipynb").read_text())
    for cell in content["cells"]:
        if outputs and cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["1\n"]}]
            cell["execution_count"] = 1
    return file_with(f"{NOTEBOOK}.ipynb", json.dumps(content))


def notebook_content() -> dict:
    """A notebook's JSON as JupyterLab sends a save: a parameters cell edited, UI metadata added."""
    content = json.loads(notebook_copy(outputs=True).read_text())
    cell = next(c for c in content["cells"] if "parameters" in c["metadata"].get("tags", []))
    cell["source"] = "smoke: bool = True\nseed: int = 3\n"
    cell["metadata"]["ExecuteTime"] = {"end_time": "2024-01-01T00:00:00"}
    return content


def train_config(**changes) -> TC.TrainConfig:
    """A training run of a few milliseconds: two steps of a tiny MLP on the digits."""
    fields = dict(task="digits", recipe="mxfp8", steps=2, hidden=[16], batch_size=8, warmup_steps=1,
                  eval_every=1, fidelity_every=1, progress=False)  # fmt: skip
    return TC.TrainConfig(**{**fields, **changes})


def digits_batch(seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(8, 64, generator=generator), torch.randint(10, (8,), generator=generator)


def digits_model():
    return TL.build_model(train_config())


def no_autocast():
    return contextlib.nullcontext()


def square_loss(model, batch):
    return model(batch).square().mean()


def normed():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))


def normed_forward():
    model = normed()
    return dict(model=model, forward=lambda: model(x() * 10 + 3))


def captured_step():
    model = tiny()
    return dict(model=model, forward_backward=lambda: model(x()).sum().backward(), skip=["encoder"],
                only=["encoder", "head"])  # fmt: skip


class TinyLM(nn.Module):
    """What qlab.advisor uses of a Hugging Face language model: ``input_ids`` in; ``loss`` (with
    ``labels``: next-token cross-entropy), ``logits`` and ``last_hidden_state`` out."""

    def __init__(self, vocab=16, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.lm_head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, labels=None):
        hidden = self.embed(input_ids)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits, last_hidden_state=hidden)


def token_ids(seed=0) -> torch.Tensor:
    return torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(seed))


def sensitivity_table() -> pd.DataFrame:
    return pd.DataFrame({"layer": ["encoder", "head", "mid"], "flops": [512, 64, 256],
                         "delta": [0.02, 0.1, -0.01]})  # fmt: skip


def plan_table() -> pd.DataFrame:
    """tiny()'s layers in two formats with scores: what qlab.plan's solver takes."""
    table = advisor.layer_table(tiny(), ["mxfp8", "bf16"]).assign(batch_0=[0.4, 0.0, 0.1, 0.0])
    return table.assign(batch_1=[0.2, 0.0, 0.3, 0.0], score=[0.3, 0.0, 0.2, 0.0])


def agreement_table() -> pd.DataFrame:
    """Three layers in two formats with scores: what qlab.plan.score_agreement ranks."""
    return pd.DataFrame({"layer": ["a", "a", "b", "b", "c", "c"], "format": ["mxfp8", "bf16"] * 3,
                         "elements": [64] * 6, "bits": [544, 1024] * 3,
                         "score": [0.3, 0.0, 0.1, 0.0, 0.2, 0.0]})  # fmt: skip


def with_underscored(fn):
    """``fn`` taking its ``_name`` keyword arguments as ``name``: such an argument is passed on, not fuzzed
    (batches that go to the caller's loss_fn, which checks them)."""

    @functools.wraps(fn)
    def call(**arguments):
        return fn(**{name.removeprefix("_"): value for name, value in arguments.items()})

    return call


def quantized_layers(**arguments) -> dict[str, str]:
    """The layers ``advisor.quantized`` swaps in for the duration, and their recipe."""
    with advisor.quantized(**arguments) as model:
        return {name: m.recipe.name for name, m in model.named_modules() if isinstance(m, qnn.QuantLinear)}


def pass_count(**arguments) -> int:
    """How many passes ``sparse.pass_seconds`` timed (the seconds themselves differ from call to call)."""
    return len(sparse.pass_seconds(**arguments))


def median_is_finite(**arguments) -> bool:
    return math.isfinite(sparse.backward_seconds(**arguments))


# entry point id → (callable, a function returning its valid keyword arguments)
ENTRY_POINTS = {
    "quantize.quantize": (Q.quantize, lambda: dict(x=x(), spec="mxfp8", axis=-1)),
    "quantize.quantize scale": (
        Q.quantize,
        lambda: dict(x=x(), spec="fp8_e4m3", scale=torch.tensor(2.0), keep_source=False),
    ),
    "quantize.qdq nvfp4": (Q.qdq, lambda: dict(x=x(), spec="nvfp4", axis=-1)),
    "quantize.qdq int8": (Q.qdq, lambda: dict(x=x(), spec="int8", axis=0, dtype=torch.float32)),
    "quantize.qdq sr": (
        Q.qdq,
        lambda: dict(x=x(), spec=Q.MXSpec("e2m1", rounding="stochastic"), generator=gen()),
    ),
    "quantize.qdq_with_mask": (Q.qdq_with_mask, lambda: dict(x=x(), spec="mxfp4", axis=-1)),
    "quantize.dequantize": (Q.dequantize, lambda: dict(q=Q.quantize(x(), "mxfp8"), dtype=torch.float32)),
    "quantize.noise_shape": (Q.noise_shape, lambda: dict(x=x(), spec="mxfp8", axis=-1, blocked=True)),
    "quantize.sqnr_db": (Q.sqnr_db, lambda: dict(x=x(), x_hat=x(seed=1))),
    "quantize.clipped_block_fraction": (Q.clipped_block_fraction, lambda: dict(x=x(), spec="mxfp8", axis=-1)),
    "quantize.get_spec": (Q.get_spec, lambda: dict(spec="mxfp8")),
    "quantize.amax": (Q.amax, lambda: dict(x=x(), spec=Q.SPECS["fp8_e4m3_rowwise"], dim=-1)),
    "quantize.to_layout": (Q.to_layout, lambda: dict(x=x(), spec=Q.SPECS["mxfp8"], axis=1)),
    "quantize.TensorwiseSpec": (
        Q.TensorwiseSpec,
        lambda: dict(element="e4m3", granularity="tensor", pow2=False, eps=0.0, rounding="rne"),
    ),
    "quantize.BlockwiseSpec": (Q.BlockwiseSpec, lambda: dict(element="e4m3", block_size=128, block_2d=False)),
    "quantize.IntSpec": (Q.IntSpec, lambda: dict(bits=8, signed=True, symmetric=True, granularity="tensor")),
    "quantize.MXSpec": (Q.MXSpec, lambda: dict(element="e2m1", block_size=32, mode="floor", pad=True)),
    "quantize.NVFP4Spec": (Q.NVFP4Spec, lambda: dict(block_2d=False, hadamard=False, hadamard_seed=0)),
    "formats.get_format": (formats.get_format, lambda: dict(name="e4m3")),
    "formats.cast": (formats.cast, lambda: dict(x=x(), fmt="e4m3", rounding="rne", saturate=True)),
    "formats.cast sr": (
        formats.cast,
        lambda: dict(x=x(), fmt="e2m1", rounding="stochastic", generator=gen()),
    ),
    "formats.reference_cast": (formats.reference_cast, lambda: dict(x=x(), fmt="e5m2", rounding="rne")),
    "formats.round_to_integer": (formats.round_to_integer, lambda: dict(x=x(), rounding="rne")),
    "formats.encode": (formats.encode, lambda: dict(values=formats.cast(x(), "e4m3"), fmt="e4m3")),
    "formats.decode": (formats.decode, lambda: dict(codes=torch.arange(64, dtype=torch.uint8), fmt="e4m3")),
    "formats.pack_fp4": (formats.pack_fp4, lambda: dict(codes=torch.arange(16, dtype=torch.uint8))),
    "formats.unpack_fp4": (formats.unpack_fp4, lambda: dict(packed=torch.arange(8, dtype=torch.uint8))),
    "formats.stochastic_noise": (formats.stochastic_noise, lambda: dict(shape=(4, 8), generator=gen())),
    "kernels.noise.stochastic_noise": (kernels.stochastic_noise, lambda: dict(shape=(4, 8), generator=gen())),
    "scaling.divide_by": (scaling.divide_by, lambda: dict(x=x(), divisor=3.0)),
    "scaling.reciprocal": (scaling.reciprocal, lambda: dict(x=x().abs() + 1)),
    "scaling.int_symmetric_scale": (scaling.int_symmetric_scale, lambda: dict(amax=x(4).abs(), qmax=127)),
    "scaling.int_affine_parameters": (
        scaling.int_affine_parameters,
        lambda: dict(lo=-x(4).abs(), hi=x(4, seed=1).abs(), qmin=0, qmax=255),
    ),
    "scaling.fp8_current_scale": (
        scaling.fp8_current_scale,
        lambda: dict(amax=x(4).abs(), fmt="e4m3", eps=0.0, pow2=False),
    ),
    "scaling.DelayedScaling": (
        scaling.DelayedScaling,
        lambda: dict(fmt="e4m3", history_len=16, algorithm="max", margin=0),
    ),
    "scaling.mx_scale_codes": (
        scaling.mx_scale_codes,
        lambda: dict(amax=x(4).abs(), element="e4m3", mode="floor"),
    ),
    "scaling.mx_scale_values": (
        scaling.mx_scale_values,
        lambda: dict(codes=torch.arange(120, 136, dtype=torch.uint8), inverse=False),
    ),
    "scaling.nvfp4_global_scale": (scaling.nvfp4_global_scale, lambda: dict(amax=torch.tensor(3.0))),
    "scaling.nvfp4_block_scales": (
        scaling.nvfp4_block_scales,
        lambda: dict(block_amax=x(4, 2).abs(), global_scale=torch.tensor(0.01)),
    ),
    "scaling.hadamard_matrix": (scaling.hadamard_matrix, lambda: dict(size=16, seed=0)),
    "scaling.hadamard_transform": (
        scaling.hadamard_transform,
        lambda: dict(x=x(), seed=0, inverse=False, dim=-1),
    ),
    "kernels.qdq": (
        kernels.qdq,
        lambda: dict(x=x(), spec="mxfp8", axis=-1, dtype=torch.float32, backend="auto"),
    ),
    "kernels.mx_qdq": (kernels.mx_qdq, lambda: dict(x=x(), spec="mxfp8", axis=-1, backend="cpu")),
    "kernels.fp8_qdq": (kernels.fp8_qdq, lambda: dict(x=x(), spec="fp8_e4m3", axis=-1, backend="cpu")),
    "kernels.nvfp4_qdq": (kernels.nvfp4_qdq, lambda: dict(x=x(), spec="nvfp4", axis=-1, seed=0, offset=0)),
    "kernels.quantize": (kernels.quantize, lambda: dict(x=x(), spec="mxfp8", axis=-1, backend="cpu")),
    "kernels.fp8_with_scale": (
        kernels.fp8_with_scale,
        lambda: dict(
            x=x(), spec="fp8_e4m3", axis=-1, scale=torch.tensor(0.37), codes=False, dtype=torch.float32
        ),
    ),
    "kernels.layer_norm": (
        kernels.layer_norm,
        lambda: dict(
            x=x(), normalized_shape=(32,), weight=x(32), bias=x(32, seed=1), eps=1e-5, stats="welford"
        ),
    ),
    "stats.mean_interval": (stats.mean_interval, lambda: dict(values=[1.0, 2.0, 4.0], method="t")),
    "stats.geometric_mean_interval": (stats.geometric_mean_interval, lambda: dict(values=[1.5, 2.0, 4.0])),
    "stats.t_cdf": (stats.t_cdf, lambda: dict(t=1.0, degrees_of_freedom=3.0)),
    "stats.t_quantile": (stats.t_quantile, lambda: dict(probability=0.9, degrees_of_freedom=3.0)),
    "stats.paired_test": (stats.paired_test, lambda: dict(differences=[0.1, 0.3, -0.1, 0.2], alpha=0.05)),
    "stats.holm": (stats.holm, lambda: dict(p_values=[0.01, 0.04, 0.3])),
    "stats.tost": (stats.tost, lambda: dict(differences=[0.1, 0.3, -0.1, 0.2], margin=0.5)),
    "stats.ratio_interval": (
        stats.ratio_interval,
        lambda: dict(numerators=[0.3, 0.4, 0.2], denominators=[0.5, 0.6, 0.45], alpha=0.05),
    ),
    "stats.sign_flip_test": (stats.sign_flip_test, lambda: dict(differences=[0.1, 0.3, -0.1, 0.2])),
    "stats.detectable_effect": (stats.detectable_effect, lambda: dict(sd=1.0, n=5, alpha=0.05, power=0.8)),
    "stats.t_test_power": (stats.t_test_power, lambda: dict(effect=1.0, n=5, alpha=0.05)),
    "stats.seeds_for_effect": (stats.seeds_for_effect, lambda: dict(sd=1.0, effect=0.5, most=100)),
    "stats.summarize": (
        stats.summarize,
        lambda: dict(
            frame=pd.DataFrame({"g": ["a", "a", "b", "b"], "v": [1.0, 2.0, 3.0, 5.0]}), value="v", by=["g"]
        ),
    ),
    "numerics.unit_roundoff": (numerics.unit_roundoff, lambda: dict(dtype=torch.bfloat16)),
    "numerics.moments": (numerics.moments, lambda: dict(x=x(), algorithm="welford", dims=1, chunk=8)),
    "numerics.variance": (numerics.variance, lambda: dict(x=x(), algorithm="textbook", dims=1, correction=0)),
    "numerics.exact_moments": (numerics.exact_moments, lambda: dict(x=x(2, 8), dims=1)),
    "numerics.condition_number": (numerics.condition_number, lambda: dict(x=x(), dims=1)),
    "numerics.rows_with_condition_number": (
        numerics.rows_with_condition_number,
        lambda: dict(kappas=[10.0, 100.0], n=16, trials=1, generator=gen()),
    ),
    "numerics.layer_norm": (
        numerics.layer_norm,
        lambda: dict(x=x(), normalized_shape=(32,), weight=x(32), bias=None, eps=1e-5, stats="two_pass"),
    ),
    "numerics.exact_layer_norm": (
        numerics.exact_layer_norm,
        lambda: dict(x=x(2, 8), normalized_shape=(8,), eps=1e-5, digits=30),
    ),
    "numerics.StatsLayerNorm": (
        numerics.StatsLayerNorm,
        lambda: dict(normalized_shape=32, eps=1e-5, stats="welford"),
    ),
    "sparse.resolve_k": (sparse.resolve_k, lambda: dict(k=0.5, features=32)),
    "sparse.topk_mask": (sparse.topk_mask, lambda: dict(grad=x(), k=0.25, mode="shared")),
    "sparse.shared_indices": (sparse.shared_indices, lambda: dict(dy=x(), count=4)),
    "sparse.TopKLinear": (sparse.TopKLinear, lambda: dict(in_features=8, out_features=4, bias=True, k=0.5)),
    "sparse.sparsify_model": (sparse.sparsify_model, lambda: dict(model=tiny(), k=0.5, mode="shared")),
    "sparse.mask_gradients": (sparse.mask_gradients, lambda: dict(model=tiny(), k=0.5, mode="row")),
    "synthetic.activations": (
        synthetic.activations,
        lambda: dict(kind="outlier_channels", shape=(4, 32), generator=gen(), outlier_channels=2),
    ),
    "probes.tensor_stats": (probes.tensor_stats, lambda: dict(tensor=x(), stats=("min", "amax", "std"))),
    "probes.log2_histogram": (probes.log2_histogram, lambda: dict(tensor=x(), low=-10, high=10)),
    "probes.what_if_stats": (probes.what_if_stats, lambda: dict(tensor=x(), spec="mxfp8", axis=-1)),
    "probes.block_stats": (probes.block_stats, lambda: dict(tensor=x(), spec="nvfp4", axis=-1, worst=3)),
    "probes.probe": (probes.probe, lambda: dict(tensor=x(), name="activations")),
    "probes.ProbeSet": (probes.ProbeSet, lambda: dict(model=tiny(), modules="head", stats=("amax",))),
    "probes.GradientAudit": (probes.GradientAudit, lambda: dict(model=tiny(), hook_parameters=True)),
    "probes.gradient_agreement": (
        probes.gradient_agreement,
        lambda: dict(gradients={"head": x(4, 16).double()}, reference={"head": x(4, 16, seed=1).double()}),
    ),
    "nn.fake_quant": (qnn.fake_quant, lambda: dict(x=x(), spec="mxfp8", axis=-1, ste="identity")),
    "nn.QuantLinear": (
        qnn.QuantLinear,
        lambda: dict(in_features=32, out_features=8, bias=True, recipe="mxfp8", seed=0, gemm="auto"),
    ),
    "nn.QuantLinear forward": (
        lambda _layer, x: _layer(x),
        lambda: dict(_layer=quantized_layer(), x=x()),
    ),
    "nn.quantize_model": (
        qnn.quantize_model,
        lambda: dict(model=tiny(), recipe="nvfp4", keep_high_precision="head"),
    ),
    "nn.unquantize_model": (qnn.unquantize_model, lambda: dict(model=tiny())),
    "nn.linear_layers": (qnn.linear_layers, lambda: dict(model=tiny())),
    "recipe.get_recipe": (R.get_recipe, lambda: dict(recipe="mxfp8")),
    "recipe.Recipe": (R.Recipe, lambda: dict(name="mine", input=Q.MXSpec("e4m3"), weight=Q.MXSpec("e2m1"))),
    "ablation.ablations": (ablation.ablations, lambda: dict(preset="nvfp4")),
    "ablation.synthetic_operands": (
        ablation.synthetic_operands,
        lambda: dict(tokens=32, features=32, out=16, seed=0),
    ),
    "ablation.gemm_errors": (
        ablation.gemm_errors,
        lambda: dict(
            recipe="mxfp8", x=x(8, 32), weight=x(16, 32, seed=1), grad_output=x(8, 16, seed=2), seed=0
        ),
    ),
    "models.q4_1_round_trip": (qlab_models.q4_1_round_trip, lambda: dict(weight=x(4, 32))),
    "models.block_levels": (qlab_models.block_levels, lambda: dict(weight=x(4, 32), block=32)),
    "results.markdown_table": (
        results.markdown_table,
        lambda: dict(df=pd.DataFrame({"a": [1.0, 2.5]}), float_format="{:.3g}"),
    ),
    "claims.Claim": (
        claims.Claim,
        lambda: dict(key="a.b", text="a claim", value=1.0, low=0.5, high=1.5, n=3, test="paired t"),
    ),
    "claims.unwrap": (claims.unwrap, lambda: dict(markdown="a line\nwrapped")),
    "sweep.grid_points": (sweep.grid_points, lambda: dict(grid={"seed": [0, 1], "steps": [5]})),
    "sweep.point_slug": (sweep.point_slug, lambda: dict(parameters={"seed": 1, "recipe": "mxfp8"})),
    "stats.t_quantile_975": (stats.t_quantile_975, lambda: dict(degrees_of_freedom=3)),
    "stats.paired_differences": (
        stats.paired_differences,
        lambda: dict(
            frame=pd.DataFrame(
                {"mode": ["a", "a", "b", "b"], "seed": [0, 1, 0, 1], "v": [1.0, 2.0, 1.5, 2.5]}
            ),
            value="v",
            baseline="a",
            by="mode",
            pair="seed",
        ),
    ),
    "sparse.check_k": (sparse.check_k, lambda: dict(k=0.5)),
    "sparse.time_ratios": (sparse.time_ratios, lambda: dict(times=[1.0, 1.2], reference=[2.0, 2.2])),
    "sparse.GradientMask": (
        sparse.GradientMask,
        lambda: dict(model=tiny(), k=0.5, mode="shared", keep="head"),
    ),
    "kernels.covers": (kernels.covers, lambda: dict(spec="mxfp8")),
    "scaling.nvfp4_encode_scale": (scaling.nvfp4_encode_scale, lambda: dict(amax=torch.tensor(3.0))),
    "scaling.nvfp4_element_inverse": (
        scaling.nvfp4_element_inverse,
        lambda: dict(block_scales=x(4, 2).abs(), decode=torch.tensor(0.5)),
    ),
    "scaling.nvfp4_dequantize_multiplier": (
        scaling.nvfp4_dequantize_multiplier,
        lambda: dict(block_scales=x(4, 2).abs(), amax=torch.tensor(3.0)),
    ),
    "numerics.reference_layer_norm": (
        numerics.reference_layer_norm,
        lambda: dict(x=x(2, 8), normalized_shape=(8,)),
    ),
    "train.TrainConfig": (
        TC.TrainConfig,
        lambda: dict(task="digits", recipe="mxfp8", steps=5, lr=1e-3, batch_size=8, seed=0),
    ),
    "train.learning_rate": (
        TL.learning_rate,
        lambda: dict(config=TC.TrainConfig(task="digits", steps=10), step=3),
    ),
    "train.data.markdown_to_text": (TD.markdown_to_text, lambda: dict(markdown="# Act I\nEnter **Hamlet**.")),
    "train.data.unigram_entropy": (
        TD.unigram_entropy,
        lambda: dict(ids=torch.tensor([1, 2, 2, 3]), vocab_size=5),
    ),
    "train.data.Vocabulary": (TD.Vocabulary, lambda: dict(characters="abc")),
    "train.models.CharGPT": (
        TM.CharGPT,
        lambda: dict(vocab_size=11, context=16, layers=1, width=32, heads=4),
    ),
    "train.models.MLP": (TM.MLP, lambda: dict(inputs=64, hidden=(16,), classes=10)),
    "train.models.parameter_count": (TM.parameter_count, lambda: dict(model=tiny())),
    "seed_model.seed_quantize": (seed_model.seed_quantize, lambda: dict(x=x(), bits=8)),
    "seed_model.fp16_matmul": (seed_model.fp16_matmul, lambda: dict(a=x(4, 8), b=x(8, 4, seed=1))),
    "seed_model.SeedLinear": (seed_model.SeedLinear, lambda: dict(in_features=8, out_features=4, bits=8)),
    "seed_model.permutation_task_batch": (
        seed_model.permutation_task_batch,
        lambda: dict(batch=2, tokens=8, vocab=16, generator=gen(), seed=0),
    ),
    "host.resolve_device": (host.resolve_device, lambda: dict(name="cpu")),
    "session.parameter_values": (session.parameter_values, lambda: dict(source="n: int = 3\nname = 'x'")),
    "ablation.variant_parts": (ablation.variant_parts, lambda: dict(variant="nvfp4/no SR")),
    "nn.QuantLinear.load_quant_state": (
        lambda _layer, state: _layer.load_quant_state(state),
        lambda: dict(_layer=qnn.QuantLinear(32, 8, recipe="fp8_delayed"), state=delayed_state()),
    ),
    "results.save_csv": (
        results.save_csv,
        lambda: dict(df=pd.DataFrame({"a": [1.0, 2.5], "b": ["x", "y"]}), name=Stem("99_fuzz_table")),
    ),
    "results.write_csv": (
        results.write_csv,
        lambda: dict(df=pd.DataFrame({"a": [1.0, 2.5]}), path=scratch() / "table.csv"),
    ),
    "results.read_csv": (
        results.read_csv,
        lambda: dict(path=file_with("t.csv", "a,b\n1,x\n"), columns=["a"]),
    ),
    "results.save_metrics": (  # the metrics themselves may be any scalar: not fuzzed
        results.save_metrics,
        lambda: dict(name=Stem("99_fuzz_metrics"), _loss=2.5, _label="fp32"),
    ),
    "plotting.save_figure": (
        plotting.save_figure,
        lambda: dict(fig=axes().figure, name=Stem("99_fuzz_figure")),
    ),
    "plotting.subplots": (subplots_size, lambda: dict(nrows=2, ncols=3, width=3.3, aspect=0.7)),
    "plotting.mean_band": (
        plotting.mean_band,
        lambda: dict(ax=axes(), frame=curves(), x="step", y="loss", by="recipe", method="t", log=True),
    ),
    "plotting.delta_band": (
        plotting.delta_band,
        lambda: dict(
            ax=axes(), frame=curves(), x="step", y="loss", baseline="fp32", by="recipe", pair="seed"
        ),
    ),
    "claims.Claims": (claims.Claims, lambda: dict(run=notebook_run())),
    "claims.Claims save": (lambda run: claimed(run).save(), lambda: dict(run=notebook_run())),
    "claims.headline_problems": (claims.headline_problems, lambda: dict(frame=claimed().frame())),
    "claims.load": (
        claims.load,
        lambda: dict(path=claims_folder() / "99_fuzz_claims.csv"),
    ),
    "claims.from_row": (claims.from_row, lambda: dict(row=claimed().frame().to_dict("records")[0])),
    "claims.findings_table": (claims.findings_table, lambda: dict(data_dir=claims_folder())),
    "claims.file_claims": (
        claims.file_claims,
        lambda: dict(path=claims_folder() / "99_fuzz_claims.csv", name="path"),
    ),
    "claims.render_committed": (
        claims.render_committed,
        lambda: dict(
            path=claims_folder() / "99_fuzz_claims.csv",
            template="{gap} ({gap:verdict}); {loss:value}",
            also=[],
        ),
    ),
    "claims.update_readme": (
        claims.update_readme,
        lambda: dict(readme=readme(), data_dir=claims_folder(), check=False),
    ),
    "sweep.load_grid": (
        sweep.load_grid,
        lambda: dict(path=file_with("grid.yaml", "seed: [0, 1]\nsteps: 5\n")),
    ),
    "train.loop.read_checkpoint": (TL.read_checkpoint, lambda: dict(path=checkpoint_file())),
    "train.load_config": (
        TC.load_config,
        lambda: dict(path=file_with("config.yaml", "task: digits\nsteps: 5\n"), overrides=["seed=1"]),
    ),
    "crossmachine.machine_record": (
        crossmachine.machine_record,
        lambda: dict(folder=runs_folder(), name=Stem("machine.json")),
    ),
    "crossmachine.final_losses": (
        crossmachine.final_losses,
        lambda: dict(notebook="07_recipe_ablations", folder=runs_folder()),
    ),
    "crossmachine.run_shifts": (crossmachine.run_shifts, lambda: dict(moved=runs(0.1), reference=runs())),
    "crossmachine.seed_spread": (crossmachine.seed_spread, lambda: dict(runs=runs())),
    "crossmachine.difference_spread": (
        crossmachine.difference_spread,
        lambda: dict(notebook="07_recipe_ablations", runs=runs()),
    ),
    "crossmachine.comparison_pairs": (
        crossmachine.comparison_pairs,
        lambda: dict(notebook="07_recipe_ablations", configs=["fp32", "nvfp4", "nvfp4/no SR"]),
    ),
    "crossmachine.comparisons": (
        crossmachine.comparisons,
        lambda: dict(
            notebook="07_recipe_ablations", first=runs(), second=runs(0.1), first_name="a", second_name="b"
        ),
    ),
    "crossmachine.survival": (
        crossmachine.survival,
        lambda: dict(
            committed=committed_claims(),
            measured=pd.DataFrame(
                {
                    "key": ["train.nvfp4", "train.nvfp4/no_SR"],
                    "shift": [-0.003, 0.001],
                    "shift_low": [-0.004, 0.0],
                    "shift_high": [-0.002, 0.002],
                }
            ),
        ),
    ),
    "paths.shown": (paths.shown, lambda: dict(path=scratch() / "x.csv")),
    "paths.environment": (environment_value, lambda: dict(qlab_fuzz_value="1")),
    "train.data.validation_plays": (
        TD.validation_plays,
        lambda: dict(names=["b", "a", "c", "d"], fraction=0.5),
    ),
    "train.data.digits": (TD.digits, lambda: dict(seed=0, val_fraction=0.2)),
    "probes.weight_gradients": (  # the batches go to the caller's loss_fn, which checks them
        lambda model, _batches, loss_fn: probes.weight_gradients(model, _batches, loss_fn),
        lambda: dict(model=tiny(), _batches=[x()], loss_fn=lambda model, batch: model(batch).square().mean()),
    ),
    # --- notebooks, the lab's saves and a session's parameters, read from a committed notebook ----------
    "notebooks.resolve_notebook": (notebooks.resolve_notebook, lambda: dict(name="02")),
    "notebooks.notebook_parameters": (notebooks.notebook_parameters, lambda: dict(notebook=notebook_copy())),
    "notebooks.check_parameters": (
        notebooks.check_parameters,
        lambda: dict(notebook=notebook_copy(), parameters={"smoke": True, "kappa_max": "1e6", "seed": 2}),
    ),
    "notebooks.strip_outputs": (notebooks.strip_outputs, lambda: dict(notebook=notebook_copy(outputs=True))),
    "session.parameters_source": (session.parameters_source, lambda: dict(name=NOTEBOOK)),
    "session.notebook_defaults": (session.notebook_defaults, lambda: dict(name=NOTEBOOK)),
    "session.notebook_annotations": (session.notebook_annotations, lambda: dict(name=NOTEBOOK)),
    "session.changed_parameters": (
        session.changed_parameters,
        lambda: dict(
            values={"smoke": True, "seed": 0, "profile": "paper"}, defaults={"smoke": False, "seed": 0}
        ),
    ),
    "session.interactive_dir": (
        session.interactive_dir,
        lambda: dict(name=NOTEBOOK, changed={"smoke": True, "seed": 3}),
    ),
    "session.saved_copy": (
        session.saved_copy,
        lambda: dict(name=NOTEBOOK, changed={"seed": 3}, profile="paper"),
    ),
    "lab.tracked_notebook": (lab.tracked_notebook, lambda: dict(path=f"notebooks/{NOTEBOOK}.py")),
    "lab.clean_for_saving": (
        lab.clean_for_saving,
        lambda: dict(content=notebook_content(), notebook_name=NOTEBOOK, keep_parameters=False),
    ),
    "lab.executed_copy": (lab.executed_copy, lambda: dict(name=NOTEBOOK, content=notebook_content())),
    "lab.lab_arguments": (lab.lab_arguments, lambda: dict(port=8888, token="secret", extra=["--no-browser"])),
    "lab.install_lab_settings": (lab.install_lab_settings, lambda: dict(prefix=scratch())),
    # --- runs: planned, keyed and run serially in this process -------------------------------------------
    "runs.plan": (
        qlab_runs.plan,
        lambda: dict(executor="serial", max_workers=2, threads_per_run=1, runs_per_gpu=1),
    ),
    "runs.describe": (qlab_runs.describe, lambda: dict(run=train_config(seed=3))),
    "runs.cache_key": (qlab_runs.cache_key, lambda: dict(run=train_config(), threads=2)),
    "runs.check_address": (qlab_runs.check_address, lambda: dict(address="local")),
    "runs.task": (qlab_runs.task, lambda: dict(function=stats.holm)),
    "runs.run_many": (
        qlab_runs.run_many,
        lambda: dict(
            runs=[train_config()],
            executor="serial",
            max_workers=1,
            threads_per_run=1,
            cache=False,
            progress=False,
            desc="runs",
        ),
    ),
    "host.machine": (host.machine, lambda: dict(device=torch.device("cpu"))),
    # --- campaigns: keys of a run, budgets, a notebook's run list -------------------------------------
    "campaign.config_fields": (campaign.config_fields, lambda: dict(config=train_config())),
    "campaign.config_key": (campaign.config_key, lambda: dict(config=train_config())),
    "campaign.run_key": (campaign.run_key, lambda: dict(config=train_config(), device_kind="GPU A")),
    "campaign.device_kind": (campaign.device_kind, lambda: dict(device="cpu")),
    "campaign.parse_budget": (campaign.parse_budget, lambda: dict(budget="12m")),
    "run_lists.run_list": (
        run_lists.run_list,
        lambda: dict(
            notebook="07_recipe_ablations",
            parameters={**session.notebook_defaults("07_recipe_ablations"), "smoke": True},
            device="cpu",
        ),
    ),
    "notebooks.parameter_defaults": (notebooks.parameter_defaults, lambda: dict(notebook=notebook_copy())),
    "host.progress": (host.progress, lambda: dict(iterable=[1, 2, 3], desc="fuzz", total=3, disable=True)),
    # --- training: a tiny MLP on the digits, the seed model, fine-tunes of tiny models ------------------
    "train.loop.train": (
        TL.train,
        lambda: dict(config=train_config(), probes=lambda model: probes.ProbeSet(model, stats=("amax",))),
    ),
    "train.loop.build_model": (
        TL.build_model,
        lambda: dict(
            config=train_config(task="shakespeare", recipe="nvfp4", layers=1, width=32, context=16),
            vocab_size=20,
            rank=1,
        ),
    ),
    "train.loop.Batches": (TL.Batches, lambda: dict(config=train_config())),
    "train.loop.evaluate": (
        TL.evaluate,
        lambda: dict(model=digits_model(), batches=[digits_batch()], autocast=no_autocast, device="cpu"),
    ),
    "train.loop.autocast_for": (
        TL.autocast_for,
        lambda: dict(config=train_config(recipe="bf16"), device=torch.device("cpu")),
    ),
    "train.loop.make_optimizer": (
        TL.make_optimizer,
        lambda: dict(config=train_config(), model=digits_model()),
    ),
    "train.loop.gradient_fidelity": (
        TL.gradient_fidelity,
        lambda: dict(
            model=digits_model(),
            inputs=digits_batch()[0],
            targets=digits_batch()[1],
            autocast=no_autocast,
            other_batch=digits_batch(seed=1),
        ),
    ),
    "sparse.train_digits": (sparse.train_digits, lambda: dict(config=train_config(), split=1)),
    "seed_model.train": (  # two steps of a one-block, width-8 SeedTransformer, loss-scaled, clipped, audited
        seed_model.train,
        lambda: dict(
            mode="corrected",
            optimizer="adam",
            steps=2,
            lr=3e-3,
            loss_scale=2.0**10,
            growth_interval=1,
            microbatches=2,
            clip_norm=1.0,
            batch=2,
            tokens=4,
            vocab=8,
            width=8,
            depth=1,
            seed=0,
            watch="blocks.0.fc1",
            precision="fp32",
            eps=1e-8,
            audit=True,
            bits=8,
        ),
    ),
    "models.fine_tune": (  # its own loss: the batches are token ids the model takes
        qlab_models.fine_tune,
        lambda: dict(
            model=TinyLM(), batches=[token_ids(), token_ids(seed=1)], steps=2, lr=1e-3, autocast="bf16"
        ),
    ),
    "models.fine_tune loss_fn": (  # the batches go to the caller's loss_fn, which checks them
        with_underscored(qlab_models.fine_tune),
        lambda: dict(model=tiny(), _batches=[x()], steps=2, lr=1e-3, autocast=None, loss_fn=square_loss),
    ),
    "sparse.pass_seconds": (
        pass_count,
        lambda: dict(
            model=tiny(),
            x=x(),
            dy=x(4, 4, seed=1),
            backward="sparse_rows",
            k=0.5,
            keep=["head"],
            repeats=1,
            timed="step",
        ),
    ),
    "sparse.backward_seconds": (
        median_is_finite,
        lambda: dict(
            model=tiny(), x=x(), dy=x(4, 4, seed=1), backward="hook_mask", k=2, keep=["head"], repeats=1
        ),
    ),
    # --- recipe ablations, LayerNorms and measurements on a tiny model ----------------------------------
    "ablation.without": (
        ablation.without,
        lambda: dict(recipe=R.get_recipe("nvfp4"), ingredients=["hadamard", "2d_weight"]),
    ),
    "ablation.with_scale_mode": (
        ablation.with_scale_mode,
        lambda: dict(recipe=R.get_recipe("mxfp4_training"), mode="rceil"),
    ),
    "ablation.uses": (ablation.uses, lambda: dict(recipe=R.get_recipe("nvfp4"), ingredient="hadamard")),
    "ablation.switched_off": (ablation.switched_off, lambda: dict(preset="nvfp4", label="no SR")),
    "ablation.gemm_outputs": (
        ablation.gemm_outputs,
        lambda: dict(
            recipe="nvfp4", x=x(8, 32), weight=x(16, 32, seed=1), grad_output=x(8, 16, seed=2), seed=0
        ),
    ),
    "ablation.capture_operands": (ablation.capture_operands, captured_step),
    "numerics.check_layer_norm_grads": (
        numerics.check_layer_norm_grads,
        lambda: dict(
            fn=numerics.layer_norm, shape=(4, 8), eps=1e-5, dtype=torch.float32, seed=0, tolerance=1e-4
        ),
    ),
    "numerics.norm_input_conditions": (numerics.norm_input_conditions, normed_forward),
    "numerics.merge_moments": (
        numerics.merge_moments,
        lambda: dict(a=numerics.moments(x(), dims=1), b=numerics.moments(x(seed=1), dims=1)),
    ),
    "numerics.layer_norm_swapped_affine_grads": (
        numerics.layer_norm_swapped_affine_grads,
        lambda: dict(
            x=x(), normalized_shape=(32,), weight=x(32), bias=x(32, seed=1), eps=1e-5, stats="two_pass"
        ),
    ),
    "numerics.use_stats_layer_norms": (
        numerics.use_stats_layer_norms,
        lambda: dict(model=normed(), stats="textbook", acc_dtype=torch.bfloat16),
    ),
    "advisor.choose": (advisor.choose, lambda: dict(table=sensitivity_table(), budget=0.5, by="flops")),
    "advisor.quantized": (quantized_layers, lambda: dict(model=tiny(), names=["encoder"], recipe="mxfp8")),
    "advisor.causal_lm_loss": (advisor.causal_lm_loss, lambda: dict(model=TinyLM(), batch=token_ids())),
    "advisor.hidden_state_error": (
        advisor.hidden_state_error,
        lambda: dict(reference=TinyLM(), batches=[token_ids(), token_ids(seed=1)]),
    ),
    "advisor.layer_sensitivity": (
        with_underscored(advisor.layer_sensitivity),
        lambda: dict(
            model=tiny(), _batches=[x()], recipe="mxfp8", loss_fn=square_loss, layers=["head"], progress=False
        ),
    ),
    "advisor.group_sensitivity": (
        with_underscored(advisor.group_sensitivity),
        lambda: dict(
            model=tiny(),
            _batches=[x()],
            recipe="nvfp4",
            groups={"all": ["encoder", "head"]},
            loss_fn=square_loss,
            progress=False,
        ),
    ),
    "advisor.advise": (
        with_underscored(advisor.advise),
        lambda: dict(
            model=tiny(), _batches=[x()], recipe="mxfp8", budget=0.5, by="layers", loss_fn=square_loss
        ),
    ),
    "paths.is_checkout": (paths.is_checkout, lambda: dict(folder=paths.ROOT)),
    "plan.plan_formats": (
        qlab_plan.plan_formats,
        lambda: dict(formats=["nvfp4", "bf16"], argument="formats"),
    ),
    "plan.weight_bits": (
        qlab_plan.weight_bits,
        lambda: dict(format_name="nvfp4", out_features=32, in_features=64),
    ),
    "plan.fewest_bits": (qlab_plan.fewest_bits, lambda: dict(formats=["nvfp4", "bf16"])),
    "advisor.layer_table": (advisor.layer_table, lambda: dict(model=tiny(), formats=["mxfp8", "bf16"])),
    "plan.cheapest_bits": (qlab_plan.cheapest_bits, lambda: dict(table=plan_table())),
    "plan.check_budget": (qlab_plan.check_budget, lambda: dict(table=plan_table(), effective_bits=12.0)),
    "plan.check_reachable": (
        qlab_plan.check_reachable,
        lambda: dict(formats=["nvfp4", "bf16"], budgets=[6.0]),
    ),
    "plan.solve": (qlab_plan.solve, lambda: dict(table=plan_table(), effective_bits=12.0)),
    "plan.ends_first": (qlab_plan.ends_first, lambda: dict(table=plan_table(), effective_bits=12.0)),
    "plan.stability": (
        qlab_plan.stability,
        lambda: dict(table=plan_table(), effective_bits=12.0, draws=5, seed=0),
    ),
    "plan.effective_bits_of": (
        qlab_plan.effective_bits_of,
        lambda: dict(table=plan_table(), assignment={"encoder": "mxfp8", "head": "bf16"}),
    ),
    "plan.make_plan": (
        qlab_plan.make_plan,
        lambda: dict(
            table=plan_table(), effective_bits=12.0, model="tiny", model_config_sha256="", text_sha256=""
        ),
    ),
    "plan.Plan": (
        qlab_plan.Plan,
        lambda: dict(
            layers={"encoder": "mxfp8", "head": "bf16"},
            model="tiny",
            formats=("mxfp8", "bf16"),
            effective_bits=12.0,
            reached_bits=8.5,
            kind="measured",
        ),  # fmt: skip
    ),
    "plan.score_agreement": (
        qlab_plan.score_agreement,
        lambda: dict(first=agreement_table(), second=agreement_table(), draws=5, seed=0),
    ),
    "advisor.score_function": (advisor.score_function, lambda: dict(kind="hierarchical", expand=2)),
    "advisor.blocks_of": (advisor.blocks_of, lambda: dict(layers=["model.layers.0.mlp", "lm_head"])),
    "advisor.hierarchical_scores": (
        with_underscored(advisor.hierarchical_scores),
        lambda: dict(
            model=tiny(),
            _batches=[x(), x(seed=1)],
            formats=["mxfp8", "bf16"],
            expand=1,
            loss_fn=square_loss,
            progress=False,
        ),
    ),  # fmt: skip
    "advisor.config_hash": (advisor.config_hash, lambda: dict(model=tiny())),
    "plan.token_hash": (qlab_plan.token_hash, lambda: dict(batches=[token_ids(), token_ids(seed=1)])),
    "plan.slug": (qlab_plan.slug, lambda: dict(model="someone/tiny-llama")),
    "advisor.held_out_check": (
        with_underscored(advisor.held_out_check),
        lambda: dict(
            model=tiny(),
            chosen=qlab_plan.Plan(layers={"encoder": "mxfp8", "head": "bf16"}, effective_bits=12.0),
            table=plan_table(),
            _batches=[x(), x(seed=1)],
            loss_fn=square_loss,
        ),
    ),  # fmt: skip
    **{
        f"advisor.{score.__name__}": (
            with_underscored(score),
            lambda: dict(
                model=tiny(),
                _batches=[x(), x(seed=1)],
                formats=["mxfp8", "bf16"],
                loss_fn=square_loss,
                layers=["head"],
                progress=False,
            ),  # fmt: skip
        )
        for score in (advisor.measured_scores, advisor.approximated_scores)
    },
    "probes.gradient_noise_floor": (
        with_underscored(probes.gradient_noise_floor),
        lambda: dict(
            model=tiny(), _batches=[x()], _other_batches=[x(seed=1)], loss_fn=square_loss, names=["head"]
        ),
    ),
}


# --- the bad values of each kind ----------------------------------------------------------------------

WRONG_KIND = "wrong kind"  # must be refused
MAYBE = "maybe valid"  # returns, or is refused clearly
SAME = "same values"  # must return what the valid call returns


def _tensor_variants(t: torch.Tensor) -> list[tuple[str, str, object]]:
    variants = [
        (WRONG_KIND, "a string", "tensor"),
        (WRONG_KIND, "a dict", {"values": 1}),
        (MAYBE, "0-d", torch.tensor(1.5)),
        (MAYBE, "empty", t[:0] if t.dim() else torch.empty(0, dtype=t.dtype)),
        (MAYBE, "meta", torch.empty(t.shape, device="meta", dtype=t.dtype)),
        (MAYBE, "extra dim", t.unsqueeze(0)),
        (MAYBE, "1-D", t.reshape(-1)),
        (MAYBE, "other size", torch.cat([t, t], dim=-1) if t.dim() else t),
        (MAYBE, "huge values", t * 1e38 if t.is_floating_point() else t),
    ]
    if t.is_floating_point():
        variants += [
            (MAYBE, "NaN", torch.full_like(t, math.nan)),
            (MAYBE, "inf", torch.full_like(t, math.inf)),
            (MAYBE, "zeros", torch.zeros_like(t)),
        ]
    for dtype in (torch.bool, torch.int32, torch.complex64, torch.float64, torch.float16, torch.bfloat16):
        if dtype != t.dtype:
            variants.append((MAYBE, f"dtype {dtype}", t.to(dtype)))
    if t.dim() == 2:
        variants.append((SAME, "transposed view", t.T.contiguous().T))
    if t.dim() >= 1 and t.shape[-1] > 0:
        wide = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)
        variants.append((SAME, "stride-2 view", wide[..., ::2]))
    return variants


def _path_variants(path: Path) -> list[tuple[str, str, object]]:
    """A path of the wrong type, and paths to nothing, to the other kind of entry, to garbage."""
    variants = [
        (WRONG_KIND, "an int", 7),
        (WRONG_KIND, "bytes", os.fsencode(path)),
        (WRONG_KIND, "a list", [path]),
        (SAME, "a str", str(path)),
        (MAYBE, "empty", ""),
        (MAYBE, "None", None),
    ]
    if path.is_dir():
        garbage = scratch()
        for entry in path.iterdir():
            file_with(entry.name, GARBAGE, garbage)
        return variants + [
            (MAYBE, "a missing folder", scratch() / "missing"),
            (MAYBE, "a file", file_with("file.txt", "text\n")),
            (MAYBE, "an empty folder", scratch()),
            (MAYBE, "a folder of garbage files", garbage),
        ]
    folder = scratch()
    return variants + [
        (MAYBE, "a missing file", folder / path.name),
        (MAYBE, "in a missing folder", folder / "missing" / path.name),
        (MAYBE, "a folder", folder),
        (MAYBE, "garbage", file_with(path.name, GARBAGE)),
        (MAYBE, "an empty file", file_with(path.name, "")),
        (MAYBE, "another format", file_with(path.name, "[1, 2]\n")),
    ]


def _name_variants(name: Stem) -> list[tuple[str, str, object]]:
    """Names of the wrong type, and names that leave the folder, hide in it or hold odd characters."""
    odd = ["", "..", f"../{name}", f"../../{name}", f"sub/{name}", f"{scratch()}/{name}", f".{name}",
           f"-{name}", f"a\x00{name}", f"line\nbreak{name}", f"two words{name}", f"back\\slash{name}",
           f"~{name}", f"star*?{name}", f"名前{name}", "n" * 300]  # fmt: skip
    return [
        (WRONG_KIND, "an int", 7),
        (WRONG_KIND, "bytes", name.encode()),
        (WRONG_KIND, "a list", [str(name)]),
        (SAME, "a plain str", str(name)),
        *[(MAYBE, f"{bad!r:.40}", bad) for bad in odd],
        (MAYBE, "None", None),
    ]


def _variants(value) -> list[tuple[str, str, object]]:
    """(category, label, bad value) for an argument whose valid value is ``value``."""
    none = [(MAYBE, "None", None)]  # None means "not given" for many arguments
    if isinstance(value, torch.Tensor):
        return _tensor_variants(value) + none
    if isinstance(value, Path):
        return _path_variants(value)
    if isinstance(value, Stem):
        return _name_variants(value)
    if isinstance(value, session.NotebookRun):
        return [
            (WRONG_KIND, "a string", value.name),
            (WRONG_KIND, "a dict", {"name": value.name}),
            (MAYBE, "a name leaving data/", notebook_run("../escape")),
            (MAYBE, "an empty name", notebook_run("")),
            *none,
        ]
    if isinstance(value, Figure):
        return [(WRONG_KIND, "a string", "figure"), (WRONG_KIND, "its axes", value.axes[0]), *none]
    if isinstance(value, plotting.matplotlib.axes.Axes):
        return [(WRONG_KIND, "a string", "ax"), (WRONG_KIND, "its figure", value.figure), *none]
    if isinstance(value, bool):
        return [(WRONG_KIND, "a string", "no"), (WRONG_KIND, "an int", 2), *none]
    if isinstance(value, int):
        return [
            (WRONG_KIND, "a word", "three"),
            (WRONG_KIND, "a bool", True),
            (WRONG_KIND, "a fraction", 2.5),
            (MAYBE, "zero", 0),
            (MAYBE, "negative", -1),
            (MAYBE, "huge", 2**62),
            (MAYBE, "huge negative", -(2**62)),
            *none,
        ]
    if isinstance(value, float):
        return [
            (WRONG_KIND, "a word", "one"),
            (WRONG_KIND, "a bool", True),
            (WRONG_KIND, "a list", [1.0]),
            (MAYBE, "NaN", math.nan),
            (MAYBE, "inf", math.inf),
            (MAYBE, "-inf", -math.inf),
            (MAYBE, "zero", 0.0),
            (MAYBE, "negative", -1.0),
            (MAYBE, "huge", 1e300),
            *none,
        ]
    if isinstance(value, str):
        return [
            (WRONG_KIND, "an int", 7),
            (WRONG_KIND, "bytes", b"e4m3"),
            (MAYBE, "empty", ""),
            (MAYBE, "unknown", "no such thing"),
            (MAYBE, "a list of it", [value]),
            *none,
        ]
    if isinstance(value, torch.Generator):
        return [(WRONG_KIND, "a seed", 0), (WRONG_KIND, "a string", "generator"), *none]
    if isinstance(value, torch.dtype):
        return [
            (WRONG_KIND, "a string", "float32"),
            (WRONG_KIND, "an int", 3),
            (MAYBE, "int32", torch.int32),
            (MAYBE, "bool", torch.bool),
            *none,
        ]
    if isinstance(value, nn.Module):
        return [(WRONG_KIND, "a string", "model"), (WRONG_KIND, "a tensor", torch.ones(2)), *none]
    if isinstance(value, Q.QuantSpec):
        return [(WRONG_KIND, "an int", 3), (WRONG_KIND, "a recipe", R.get_recipe("mxfp8")), *none]
    if isinstance(value, Q.QTensor):
        return [(WRONG_KIND, "a tensor", torch.ones(4, 32)), (WRONG_KIND, "a string", "q"), *none]
    if isinstance(value, R.Recipe):
        return [
            (WRONG_KIND, "an int", 3),
            (WRONG_KIND, "a spec", Q.SPECS["mxfp8"]),
            (MAYBE, "its preset's name", value.name),
            (MAYBE, "an unknown name", "no such recipe"),
            *none,
        ]
    if isinstance(value, torch.device):
        return [
            (WRONG_KIND, "a list", [str(value)]),
            (WRONG_KIND, "a float", 0.5),
            (SAME, "its name", str(value)),
            (MAYBE, "an unknown name", "no such device"),
            *none,
        ]
    if isinstance(value, pd.DataFrame):
        return [(WRONG_KIND, "a dict", {"v": [1.0]}), (MAYBE, "empty frame", value.iloc[:0]), *none]
    if isinstance(value, dict):
        return [(WRONG_KIND, "a list", [1]), (MAYBE, "empty", {}), *none]
    if callable(value) and not isinstance(value, type):
        return [(WRONG_KIND, "an int", 3), (WRONG_KIND, "a string", "loss"), *none]
    if isinstance(value, (list, tuple)):
        huge = [
            (MAYBE, f"2**{bits} inside", type(value)([2**bits] * max(1, len(value)))) for bits in (40, 62)
        ]
        return [
            (WRONG_KIND, "an int", 3),
            *(huge if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) else []),
            (MAYBE, "empty", type(value)()),
            (MAYBE, "None inside", type(value)([None])),
            (MAYBE, "a string inside", type(value)(["x"])),
            (MAYBE, "NaN inside", type(value)([math.nan, 1.0])),
            (MAYBE, "a bool tensor", torch.ones(2, dtype=torch.bool)),
            *none,
        ]
    if value is None or isinstance(value, type):
        return none
    # any other object (a TrainConfig, Moments, ...): values of other kinds
    return [(WRONG_KIND, "a string", type(value).__name__), (WRONG_KIND, "a dict", {"value": 1}), *none]


def _same(a, b) -> bool:
    """Equal results: tensors bit for bit (NaN equal to NaN), containers item by item."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    if isinstance(a, Q.QTensor) and isinstance(b, Q.QTensor):
        return _same(a.codes, b.codes) and _same(a.scales, b.scales)
    if isinstance(a, pd.DataFrame) and isinstance(b, pd.DataFrame):
        return a.equals(b)
    return True  # modules and other objects: nothing to compare


def _check_refusal(err: BaseException, name: str, label: str, path: bool) -> None:
    where = f"{name} = {label}"
    refusals = (TypeError, ValueError, FileNotFoundError) if path else (TypeError, ValueError)
    assert type(err) in refusals, f"{where}: {type(err).__name__} {err}"
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    innermost = Path(tb.tb_frame.f_code.co_filename).resolve()
    assert QLAB_DIR in innermost.parents, f"{where}: raised from {innermost}: {err}"
    assert name in str(err), f"{where}: the message does not name {name!r}: {err}"


@pytest.fixture(autouse=True)
def _results_in_a_temporary_folder(tmp_path, monkeypatch):
    """data/ and figures/ under the test's own folder: nothing is written into the repository."""
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path / "results"))
    monkeypatch.delenv(paths.PROFILE_ENV, raising=False)


def _files(arguments: dict) -> dict[Path, bytes]:
    """Every file under the results folder, and in the folders the arguments name or lie in."""
    root = paths.results_root()
    found = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    for value in arguments.values():
        if isinstance(value, Path):
            for folder in (value, value.parent):
                if folder.is_dir():
                    found += [p for p in folder.iterdir() if p.is_file()]
    return {p: p.read_bytes() for p in found}


def _check_files(before: dict, after: dict, refused: bool, where: str) -> None:
    """A refusal writes nothing; a call writes under data/ or figures/ of the results folder, or to the
    file it was given; no temporary file is left behind."""
    changed = sorted(str(p) for p in after if before.get(p) != after[p])
    assert not [p for p in after if p.name.endswith(".tmp")], f"{where}: temporary files left: {changed}"
    if refused:
        assert not changed, f"{where}: refused, yet wrote {changed}"
    root = paths.results_root()
    for path in changed:
        if Path(path).is_relative_to(root):
            assert Path(path).relative_to(root).parts[0] in ("data", "figures"), f"{where}: wrote {path}"


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_valid_calls_run(entry):
    fn, valid = ENTRY_POINTS[entry]
    fn(**valid())


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_bad_input_is_refused_clearly_or_computed_right(entry, data):
    fn, valid = ENTRY_POINTS[entry]
    arguments = valid()
    name = data.draw(st.sampled_from(sorted(a for a in arguments if not a.startswith("_"))), label="argument")
    variants = _variants(arguments[name])
    if not variants:
        return
    category, label, bad = data.draw(st.sampled_from(variants), label="bad value")
    watched = {**arguments, "_bad": bad}
    before = _files(watched)
    arguments[name] = bad
    try:
        result = fn(**arguments)
    except Exception as err:  # noqa: BLE001 — every exception is examined
        _check_files(before, _files(watched), True, f"{name} = {label}")
        _check_refusal(err, name, label, isinstance(watched[name], Path))
        assert category != SAME, f"{name} = {label} holds the valid values but was refused: {err}"
        return
    _check_files(before, _files(watched), False, f"{name} = {label}")
    assert category != WRONG_KIND, f"{name} = {label} ({bad!r}) was accepted"
    if category == SAME:
        expected = fn(**{**valid()})
        assert _same(result, expected), f"{name} = {label} gave another result than the contiguous input"


OVERFLOWING = (2**40, 2**48, 2**62)  # sizes whose storage overflows, or cannot be allocated


def _size_like(value) -> bool:
    """An int argument, or a list/tuple of ints (a shape): what a size can be."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(_size_like(v) for v in value)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_size_like_argument_that_overflows_is_refused_clearly(entry):
    """Each int (or shape) argument set to 2⁴⁰, 2⁴⁸ and 2⁶² in turn: the call returns or is refused with a
    TypeError/ValueError naming the argument, raised in qlab — never torch's "Storage size calculation
    overflowed" or an allocator's error. A call may take at most 60 s (no loop over 2⁴⁰ items)."""
    import signal

    fn, valid = ENTRY_POINTS[entry]

    def too_long(signum, frame):
        raise TimeoutError("still running after 60 s")

    problems = []
    for name, value in valid().items():
        if name.startswith("_") or not _size_like(value):
            continue
        for size in OVERFLOWING:
            arguments = valid()
            arguments[name] = type(value)([size] * len(value)) if isinstance(value, (list, tuple)) else size
            previous = signal.signal(signal.SIGALRM, too_long)
            signal.alarm(60)
            try:
                fn(**arguments)
            except TimeoutError:
                problems.append(f"{name} = {size} ran for more than 60 s")
            except Exception as err:  # noqa: BLE001 — every exception is examined
                try:
                    _check_refusal(err, name, f"{size}", False)
                except AssertionError as problem:
                    problems.append(str(problem).splitlines()[0][:300])
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
    assert not problems, "\n".join(problems)


def test_a_write_that_fails_midway_leaves_the_old_file_whole(monkeypatch):
    """Writers write a temporary file and rename it: a failure leaves no half-written file behind."""
    target = file_with("table.csv", "old\n")
    with pytest.raises(RuntimeError), paths.written_atomically(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old\n" and [p.name for p in target.parent.iterdir()] == ["table.csv"]
    fig, savefig = axes().figure, Figure.savefig

    def failing_png(path, format, **options):
        savefig(fig, path, format=format, **options)
        if format == "png":
            raise OSError("disk full")

    monkeypatch.setattr(fig, "savefig", failing_png)
    with pytest.raises(OSError, match="disk full"):
        plotting.save_figure(fig, "99_half")
    assert not list(paths.figures_dir().iterdir())  # neither the PDF nor the PNG


# --- which public names are generated against, and why the others are not -----------------------------

NOT_GENERATED = {
    "the argument checks themselves: their refusals are what every row above exercises": """
        checks.shown checks.integer checks.number checks.function checks.boolean checks.choice
        checks.generator checks.seed checks.tensor checks.same_device checks.allocatable
        checks.all_finite checks.holds_nan checks.floating_dtype checks.module checks.matches
        checks.patterns checks.batches checks.frame_columns checks.names checks.closest
        checks.patterns_match checks.token_ids_in_range checks.yaml_value checks.yaml_text checks.given_once
        session.check_values
        session.check_parameters
        paths.existing_file paths.existing_folder paths.writable_file paths.result_name
        models.check_token_ids""",
    "kernel launchers and fast paths behind qlab.kernels' checked entry points (tests/test_kernels.py)": """
        kernels.triton_available kernels.cpu_qdq.available kernels.cpu_qdq.covers kernels.cpu_qdq.qdq
        kernels.cpu_qdq.stochastic_noise kernels.cpu_qdq.draws_like_torch kernels.cpu_qdq.tensor_stats
        kernels.cpu_qdq.tensor_stats_function kernels.fp8_gemm.is_fp8_spec
        kernels.fp8_gemm.unsupported_reason kernels.fp8_gemm.fp8_matmul kernels.fp8_triton.tensor_amax
        kernels.fp8_triton.fp8_current_scaling kernels.fp8_triton.fp8_fixed_scale
        kernels.layernorm_triton.forward kernels.layernorm_triton.backward kernels.mx_triton.mx_qdq_last_axis
        kernels.mx_triton.mx_quantize_last_axis kernels.mx_triton.fp8_cast
        kernels.noise_triton.noise_from_bits
        kernels.nvfp4_triton.nvfp4_qdq_last_axis kernels.triton_math.encode_constants
        kernels.triton_math.Tuned formats.cast_unchecked formats.encode_float formats.decode_unchecked
        formats.torch_stochastic_noise kernels.noise.register_noise_source kernels.noise.drawn_noise
        formats.check_noise_arguments formats.random_bits kernels.compiled.compilable
        kernels.compiled.compiled_qdq kernels.compiled.give_up kernels.compiled.compile_enabled
        kernels.quantize_covers quantize.check_qdq_arguments quantize.qdq_unchecked
        quantize.quantize_unchecked compat.moved
        scaling.nvfp4_block_scales_nvidia quantize.block_scales quantize.check_input
        quantize.from_layout quantize.draws_float32_noise ops.define
        formats.cast_rne_float32 formats.check_codes formats.fast_path_applies
        numerics.check_layer_norm_args scaling.float_format scaling.hadamard_signs scaling.mx_block_scales
        scaling.mx_scale_values_unchecked""",
    "QuantLinear's and the converters' building blocks, reached through quantize_model above": """
        nn.highest_matmul_precision nn.check_linear_arguments nn.check_gemm nn.is_conv1d
        nn.oriented_weight nn.why_not_converted nn.linear_sharing_parameters nn.rebuild_source
        nn.replace_linears nn.conversion_report nn.plain_linears nn.set_submodule nn.QlabLinear""",
    "command lines: argv parsed (add_arguments fills the parser), then training, torchrun or a server "
    "(tests/test_cli.py)": """
        cli.main lab.main train.launch.add_arguments train.launch.run train.launch.main cli.campaign_list
        cli.Terminated""",
    "they run notebooks in a Jupyter kernel or rewrite the repository's notebooks (tests/test_cli.py)": """
        notebooks.run_notebook notebooks.sync_notebooks sweep.run_sweep notebooks.output_folder
        notebooks.results_folder notebooks.check_output sweep.sweep_folder
        notebooks.run_report notebooks.export_html notebooks.kill_kernels notebooks.publish
        notebooks.refuse_committed_results""",
    "processes and compilers: DDP workers, torch.compile (seconds per call; tests/test_seed_model.py, "
    "tests/test_compile.py)": """
        seed_model.ddp_audit train.loop.compiled_step_model""",
    "it sets this process's QLAB_RESULTS_DIR and QLAB_PROFILE, so that what the calls after it write goes "
    "to the repository (tests/test_session_and_lab.py)": """
        session.start""",
    "pretrained models: load reads a 135M model, and so does advisor.main (`qlab advise`); model_path and "
    "cache_dir locate its files for load, which checks the name; shakespeare_batches needs its tokenizer "
    "(tests/test_models.py)": """
        models.load models.model_path models.cache_dir models.shakespeare_batches advisor.main""",
    "checkpoints and text read from files: built, saved and read in tests/test_your_model.py (folders, a "
    "hub cache, no network, non-UTF-8 and short text)": """
        models.load_any models.checkpoint_folder models.tokenizer_source models.model_kind
        models.text_batches models.read_text advisor.plan_batches models.check_source models.max_tokens
        advisor.check_score""",
    "the advisor's argument checks, reached through layer_sensitivity, group_sensitivity and the plan's "
    "score functions above": """
        advisor.check_measurement advisor.check_layers""",
    "training checkpoints and out_dirs, written and read by train.loop.train's runs (tests/test_train.py, "
    "tests/test_train_failures.py)": """
        train.loop.save_checkpoint train.loop.load_checkpoint train.loop.check_out_dir""",
    "no arguments to generate: where results go, the plotting style, the notebooks and cores there are, "
    "whether a runner without a browser drives this process, the kernel's language, quiet model loading": """
        paths.results_root paths.data_dir paths.figures_dir plotting.use_paper_style notebooks.list_notebooks
        runs.usable_cores host.headless lab.kernel_language_info models.quiet_loading runs.close_pools
        host.cpu_name campaign.store_dir""",
    "they train runs, read and write a store of them, or name the device kind a run list gets here "
    "(tests/test_campaign.py: damaged stores, budgets, mixed devices, bad input to qlab campaign)": """
        campaign.planned_kind campaign.write_run campaign.read_run campaign.progress campaign.results
        campaign.run_campaign
        campaign.status campaign.train_for_store campaign.render_command""",
    "any values make a claim key (each written with str()); the atomic writer is reached through the "
    "writers above": """
        claims.key_for paths.written_atomically""",
    "result and error types the functions above construct": """
        quantize.QuantSpec quantize.Spec quantize.QTensor formats.FloatFormat formats.IntFormat
        formats.E8M0Format numerics.Moments numerics.GradCheckResult advisor.Advice models.PackagedModel
        notebooks.NotebookError notebooks.RunResult results.SavedPath plotting.SavedFigure runs.Task
        runs.RunsFailed sweep.PointOutcome session.NotebookRun train.data.TextCorpus train.data.ImageSet
        train.loop.TrainResult train.loop.TrainingDiverged train.loop.Divergence
        train.models.CausalSelfAttention train.models.FeedForward train.models.Block
        seed_model.SeedQuantizerFunction seed_model.SeedLinearFunction seed_model.Block lab.LabContentsManager
        seed_model.SeedTransformer campaign.Progress campaign.StoreError campaign.StoredRun
        run_lists.RunList""",
}


def _public_names() -> set[str]:
    import importlib
    import inspect
    import pkgutil

    names = set()
    for info in pkgutil.walk_packages(qlab.__path__, "qlab."):
        if info.name.endswith("__main__"):  # `python -m` entry points run on import
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            public = not name.startswith("_") and getattr(value, "__module__", "") == module.__name__
            if public and (inspect.isfunction(value) or inspect.isclass(value)):
                names.add(f"{module.__name__.removeprefix('qlab.')}.{name}")
    return names


def _generated_names() -> set[str]:
    names = set()
    for fn, _ in ENTRY_POINTS.values():
        module, qualname = getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")
        if module.startswith("qlab.") and "<lambda>" not in qualname:
            names.add(f"{module.removeprefix('qlab.')}.{qualname}")
    names |= {"nn.QuantLinear", "probes.weight_gradients"}  # called through a lambda above
    names |= {"plotting.subplots", "paths.environment", "advisor.quantized", "sparse.pass_seconds",
              "sparse.backward_seconds"}  # called through a helper above  # fmt: skip
    return names


def test_every_public_name_is_generated_against_or_says_why_not():
    """A public function or class added to qlab must join ENTRY_POINTS or NOT_GENERATED with a reason."""
    exempt = {name for names in NOT_GENERATED.values() for name in names.split()}
    public, generated = _public_names(), _generated_names()
    assert not (generated & exempt), sorted(generated & exempt)
    assert not (exempt - public), f"no such public names: {sorted(exempt - public)}"
    assert not (public - generated - exempt), (
        f"neither generated nor exempt: {sorted(public - generated - exempt)}"
    )
