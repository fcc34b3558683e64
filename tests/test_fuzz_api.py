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

import math
import os
from collections import OrderedDict
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import qlab  # noqa: E402
from qlab import formats, kernels, numerics, probes, scaling, sparse, stats, synthetic  # noqa: E402
from qlab import nn as qnn  # noqa: E402
from qlab import quantize as Q  # noqa: E402
from qlab import recipe as R  # noqa: E402

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
    "kernels.layer_norm": (
        kernels.layer_norm,
        lambda: dict(
            x=x(), normalized_shape=(32,), weight=x(32), bias=x(32, seed=1), eps=1e-5, stats="welford"
        ),
    ),
    "stats.mean_interval": (stats.mean_interval, lambda: dict(values=[1.0, 2.0, 4.0], method="t")),
    "stats.t_cdf": (stats.t_cdf, lambda: dict(t=1.0, degrees_of_freedom=3.0)),
    "stats.t_quantile": (stats.t_quantile, lambda: dict(probability=0.9, degrees_of_freedom=3.0)),
    "stats.paired_test": (stats.paired_test, lambda: dict(differences=[0.1, 0.3, -0.1, 0.2], alpha=0.05)),
    "stats.holm": (stats.holm, lambda: dict(p_values=[0.01, 0.04, 0.3])),
    "stats.tost": (stats.tost, lambda: dict(differences=[0.1, 0.3, -0.1, 0.2], margin=0.5)),
    "stats.detectable_effect": (stats.detectable_effect, lambda: dict(sd=1.0, n=5, alpha=0.05, power=0.8)),
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
    "nn.QuantLinear.load_quant_state": (
        lambda _layer, state: _layer.load_quant_state(state),
        lambda: dict(_layer=qnn.QuantLinear(32, 8, recipe="fp8_delayed"), state=delayed_state()),
    ),
    "probes.weight_gradients": (  # the batches go to the caller's loss_fn, which checks them
        lambda model, _batches, loss_fn: probes.weight_gradients(model, _batches, loss_fn),
        lambda: dict(model=tiny(), _batches=[x()], loss_fn=lambda model, batch: model(batch).square().mean()),
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


def _variants(value) -> list[tuple[str, str, object]]:
    """(category, label, bad value) for an argument whose valid value is ``value``."""
    none = [(MAYBE, "None", None)]  # None means "not given" for many arguments
    if isinstance(value, torch.Tensor):
        return _tensor_variants(value) + none
    if isinstance(value, bool):
        return [(WRONG_KIND, "a string", "no"), (WRONG_KIND, "an int", 2), *none]
    if isinstance(value, int):
        return [
            (WRONG_KIND, "a string", "3"),
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
            (WRONG_KIND, "a string", "1.0"),
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
    if isinstance(value, pd.DataFrame):
        return [(WRONG_KIND, "a dict", {"v": [1.0]}), (MAYBE, "empty frame", value.iloc[:0]), *none]
    if isinstance(value, dict):
        return [(WRONG_KIND, "a list", [1]), (MAYBE, "empty", {}), *none]
    if callable(value) and not isinstance(value, type):
        return [(WRONG_KIND, "an int", 3), (WRONG_KIND, "a string", "loss"), *none]
    if isinstance(value, (list, tuple)):
        return [
            (WRONG_KIND, "an int", 3),
            (MAYBE, "empty", type(value)()),
            (MAYBE, "None inside", type(value)([None])),
            (MAYBE, "a string inside", type(value)(["x"])),
            (MAYBE, "NaN inside", type(value)([math.nan, 1.0])),
            (MAYBE, "a bool tensor", torch.ones(2, dtype=torch.bool)),
            *none,
        ]
    return none


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
    return True  # modules and other objects: nothing to compare


def _check_refusal(err: BaseException, name: str, label: str) -> None:
    where = f"{name} = {label}"
    assert type(err) in (TypeError, ValueError), f"{where}: {type(err).__name__} {err}"
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    innermost = Path(tb.tb_frame.f_code.co_filename).resolve()
    assert QLAB_DIR in innermost.parents, f"{where}: raised from {innermost}: {err}"
    assert name in str(err), f"{where}: the message does not name {name!r}: {err}"


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
    arguments[name] = bad
    try:
        result = fn(**arguments)
    except Exception as err:  # noqa: BLE001 — every exception is examined
        _check_refusal(err, name, label)
        assert category != SAME, f"{name} = {label} holds the valid values but was refused: {err}"
        return
    assert category != WRONG_KIND, f"{name} = {label} ({bad!r}) was accepted"
    if category == SAME:
        expected = fn(**{**valid()})
        assert _same(result, expected), f"{name} = {label} gave another result than the contiguous input"
