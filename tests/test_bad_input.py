"""Every public entry point refuses bad input clearly: one table, grouped by module.

Each row is (id, call, exception type, text the message must contain). The text is the argument's
name (or, where the argument is positional data, what it holds), so a user reads which argument was
wrong. Each refusal must also come from qlab's own code — the innermost frame of the traceback is
a file of the qlab package — never from deep inside torch, numpy or the standard library.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import torch
from torch import nn

import qlab
from qlab import (
    ablation,
    advisor,
    checks,
    formats,
    kernels,
    numerics,
    plotting,
    probes,
    results,
    scaling,
    seed_model,
    session,
    sparse,
    stats,
    synthetic,
)
from qlab import models as qlab_models
from qlab import nn as qnn
from qlab import quantize as Q
from qlab import recipe as R
from qlab.kernels import fp8_gemm
from qlab.notebooks import check_parameters, resolve_notebook, run_notebook
from qlab.sweep import point_slug, run_sweep
from qlab.train import config as C
from qlab.train import data as D
from qlab.train import loop as L
from qlab.train import models as M

matplotlib.use("Agg")

INF, NAN = math.inf, math.nan
QLAB_DIR = Path(qlab.__file__).resolve().parent


class _UnregisteredSpec(Q.QuantSpec):
    """A QuantSpec subclass that is not in qlab.quantize.SPEC_CLASSES: refused, never guessed at."""

    element = "e4m3"


def x32(*shape):
    return torch.randn(*(shape or (4, 32)), generator=torch.Generator().manual_seed(0))


def gen():
    return torch.Generator().manual_seed(0)


SR_MX = Q.MXSpec("e2m1", rounding="stochastic")


def tiny():
    """A model whose Linear layers are named encoder and head."""
    return nn.Sequential(OrderedDict(encoder=nn.Linear(8, 8), act=nn.ReLU(), head=nn.Linear(8, 4)))


def audit(**report):
    return probes.GradientAudit(tiny()).report(**report)


def fig():
    return plotting.subplots()[0]


def axes():
    return plotting.subplots()[1]


NOTEBOOK = "02"


CASES = [
    # --- qlab.formats -----------------------------------------------------------------------------
    ("get_format unknown name", lambda: formats.get_format("e9m9"), ValueError, "e9m9"),
    ("get_format not a name", lambda: formats.get_format(7), TypeError, "element format"),
    ("cast of a list", lambda: formats.cast([1.0], "e4m3"), TypeError, "x must be a torch.Tensor"),
    ("cast of ints", lambda: formats.cast(torch.tensor([1]), "e4m3"), TypeError, "x must be a floating"),
    ("cast to e8m0", lambda: formats.cast(x32(), "e8m0"), ValueError, "fmt e8m0"),
    ("reference_cast to e8m0", lambda: formats.reference_cast(x32(), "e8m0"), ValueError, "fmt e8m0"),
    ("cast rounding unknown", lambda: formats.cast(x32(), "e4m3", rounding="bogus"), ValueError, "rounding"),
    ("cast rounding not str", lambda: formats.cast(x32(), "e4m3", rounding=1), ValueError, "rounding"),
    ("cast rounding up", lambda: formats.cast(x32(), "int8", rounding="up"), ValueError, "rounding"),
    (
        "cast generator is a seed",
        lambda: formats.cast(x32(), "e4m3", rounding="stochastic", generator=42),
        TypeError,
        "generator",
    ),
    (
        "cast generator with rne",
        lambda: formats.cast(x32(), "e4m3", generator=gen()),
        ValueError,
        "generator",
    ),
    ("cast saturate string", lambda: formats.cast(x32(), "e4m3", saturate="yes"), TypeError, "saturate"),
    ("cast saturate int", lambda: formats.cast(x32(), "e4m3", saturate=1), TypeError, "saturate"),
    ("cast NaN to e2m1", lambda: formats.cast(torch.tensor([NAN]), "e2m1"), ValueError, "x holds NaN"),
    (
        "reference_cast rounding",
        lambda: formats.reference_cast(x32(), "e4m3", rounding="nearest"),
        ValueError,
        "rounding",
    ),
    (
        "reference_cast saturate",
        lambda: formats.reference_cast(x32(), "e5m2", saturate=None),
        TypeError,
        "saturate",
    ),
    ("round_to_integer bogus", lambda: formats.round_to_integer(x32(), "bogus"), ValueError, "rounding"),
    ("round_to_integer of a list", lambda: formats.round_to_integer([1.5]), TypeError, "x must be"),
    ("round_to_integer of ints", lambda: formats.round_to_integer(torch.tensor([1])), TypeError, "x must be"),
    (
        "round_to_integer generator with rne",
        lambda: formats.round_to_integer(x32(), "rne", gen()),
        ValueError,
        "generator",
    ),
    (
        "round_to_integer generator is a seed",
        lambda: formats.round_to_integer(x32(), "stochastic", 3),
        TypeError,
        "generator",
    ),
    ("stochastic_noise generator int", lambda: formats.stochastic_noise((4,), 42), TypeError, "generator"),
    ("stochastic_noise negative shape", lambda: formats.stochastic_noise((-1,), None), TypeError, "shape"),
    ("stochastic_noise shape string", lambda: formats.stochastic_noise("abc", None), TypeError, "shape"),
    ("encode of a list", lambda: formats.encode([1.0], "e4m3"), TypeError, "values"),
    ("encode of ints", lambda: formats.encode(torch.tensor([1]), "e4m3"), TypeError, "values"),
    ("encode off the grid", lambda: formats.encode(torch.tensor([0.3]), "e4m3"), ValueError, "values"),
    ("encode beyond max", lambda: formats.encode(torch.tensor([1000.0]), "e4m3"), ValueError, "values"),
    (
        "encode non power of two e8m0",
        lambda: formats.encode(torch.tensor([3.0]), "e8m0"),
        ValueError,
        "values",
    ),
    ("encode NaN to int8", lambda: formats.encode(torch.tensor([NAN]), "int8"), ValueError, "values"),
    ("decode negative code", lambda: formats.decode(torch.tensor([-200]), "e4m3"), ValueError, "codes"),
    ("decode code 300", lambda: formats.decode(torch.tensor([300]), "e4m3"), ValueError, "codes"),
    ("decode e2m1 code 16", lambda: formats.decode(torch.tensor([16]), "e2m1"), ValueError, "codes"),
    ("decode e8m0 code 256", lambda: formats.decode(torch.tensor([256]), "e8m0"), ValueError, "codes"),
    ("decode int8 code 128", lambda: formats.decode(torch.tensor([128]), "int8"), ValueError, "codes"),
    ("decode uint4 code -1", lambda: formats.decode(torch.tensor([-1]), "uint4"), ValueError, "codes"),
    ("decode bf16 code 70000", lambda: formats.decode(torch.tensor([70000]), "bf16"), ValueError, "codes"),
    ("decode floats", lambda: formats.decode(torch.tensor([1.0]), "e4m3"), TypeError, "codes"),
    ("decode bools", lambda: formats.decode(torch.tensor([True]), "e4m3"), TypeError, "codes"),
    ("decode a list", lambda: formats.decode([1], "e4m3"), TypeError, "codes"),
    (
        "pack_fp4 code above 15",
        lambda: formats.pack_fp4(torch.tensor([16, 1], dtype=torch.uint8)),
        ValueError,
        "codes",
    ),
    ("pack_fp4 int32 codes", lambda: formats.pack_fp4(torch.zeros(4, dtype=torch.int32)), TypeError, "codes"),
    ("pack_fp4 odd length", lambda: formats.pack_fp4(torch.zeros(3, dtype=torch.uint8)), ValueError, "codes"),
    ("pack_fp4 a list", lambda: formats.pack_fp4([1, 2]), TypeError, "codes"),
    ("unpack_fp4 int8", lambda: formats.unpack_fp4(torch.zeros(4, dtype=torch.int8)), TypeError, "packed"),
    ("unpack_fp4 a list", lambda: formats.unpack_fp4([1]), TypeError, "packed"),
    # --- qlab.scaling -----------------------------------------------------------------------------
    ("int_symmetric_scale list", lambda: scaling.int_symmetric_scale([1.0], 127), TypeError, "amax"),
    ("int_symmetric_scale qmax 0", lambda: scaling.int_symmetric_scale(torch.ones(1), 0), ValueError, "qmax"),
    (
        "int_symmetric_scale qmax float",
        lambda: scaling.int_symmetric_scale(torch.ones(1), 1.5),
        TypeError,
        "qmax",
    ),
    (
        "int_affine_parameters qmax ≤ qmin",
        lambda: scaling.int_affine_parameters(torch.zeros(1), torch.ones(1), 5, 1),
        ValueError,
        "qmax",
    ),
    (
        "fp8_current_scale eps < 0",
        lambda: scaling.fp8_current_scale(torch.ones(1), eps=-1.0),
        ValueError,
        "eps",
    ),
    (
        "fp8_current_scale eps str",
        lambda: scaling.fp8_current_scale(torch.ones(1), eps="x"),
        TypeError,
        "eps",
    ),
    (
        "fp8_current_scale eps inf",
        lambda: scaling.fp8_current_scale(torch.ones(1), eps=INF),
        ValueError,
        "eps",
    ),
    (
        "fp8_current_scale pow2 str",
        lambda: scaling.fp8_current_scale(torch.ones(1), pow2="no"),
        TypeError,
        "pow2",
    ),
    (
        "fp8_current_scale int fmt",
        lambda: scaling.fp8_current_scale(torch.ones(1), "int8"),
        ValueError,
        "fmt",
    ),
    ("fp8_current_scale float amax", lambda: scaling.fp8_current_scale(3.0), TypeError, "amax"),
    ("DelayedScaling margin str", lambda: scaling.DelayedScaling(margin="2"), TypeError, "margin"),
    ("DelayedScaling margin < 0", lambda: scaling.DelayedScaling(margin=-1), ValueError, "margin"),
    ("DelayedScaling margin 128", lambda: scaling.DelayedScaling(margin=128), ValueError, "margin"),
    ("DelayedScaling history 0", lambda: scaling.DelayedScaling(history_len=0), ValueError, "history_len"),
    (
        "DelayedScaling history bool",
        lambda: scaling.DelayedScaling(history_len=True),
        TypeError,
        "history_len",
    ),
    ("DelayedScaling algorithm", lambda: scaling.DelayedScaling(algorithm="mean"), ValueError, "algorithm"),
    ("DelayedScaling fmt", lambda: scaling.DelayedScaling("e9m9"), ValueError, "e9m9"),
    ("DelayedScaling observe str", lambda: scaling.DelayedScaling().observe("x"), TypeError, "amax"),
    (
        "DelayedScaling observe a per-channel amax",
        lambda: scaling.DelayedScaling().observe(torch.ones(4)),
        ValueError,
        "got shape (4,)",
    ),
    (
        "mx_scale_codes mode",
        lambda: scaling.mx_scale_codes(torch.ones(1), "e4m3", "nearest"),
        ValueError,
        "mode",
    ),
    ("mx_scale_codes list", lambda: scaling.mx_scale_codes([1.0], "e4m3"), TypeError, "amax"),
    (
        "mx_scale_codes int element",
        lambda: scaling.mx_scale_codes(torch.ones(1), "int8"),
        ValueError,
        "element",
    ),
    ("mx_scale_values floats", lambda: scaling.mx_scale_values(torch.ones(1)), TypeError, "codes"),
    ("mx_scale_values 300", lambda: scaling.mx_scale_values(torch.tensor([300])), ValueError, "codes"),
    (
        "mx_scale_values inverse str",
        lambda: scaling.mx_scale_values(torch.tensor([1]), inverse="yes"),
        TypeError,
        "inverse",
    ),
    ("nvfp4_global_scale float", lambda: scaling.nvfp4_global_scale(3.0), TypeError, "amax"),
    ("nvfp4_global_scale bool", lambda: scaling.nvfp4_global_scale(torch.tensor([True])), TypeError, "amax"),
    ("nvfp4_block_scales list", lambda: scaling.nvfp4_block_scales([1.0], None), TypeError, "block_amax"),
    (
        "nvfp4_block_scales float global",
        lambda: scaling.nvfp4_block_scales(torch.ones(1), 2.0),
        TypeError,
        "global_scale",
    ),
    ("hadamard_matrix size 12", lambda: scaling.hadamard_matrix(12), ValueError, "size"),
    ("hadamard_matrix size float", lambda: scaling.hadamard_matrix(16.0), TypeError, "size"),
    ("hadamard_matrix seed str", lambda: scaling.hadamard_matrix(16, seed="x"), TypeError, "seed"),
    ("hadamard_matrix seed < 0", lambda: scaling.hadamard_matrix(16, seed=-1), ValueError, "seed"),
    ("hadamard_transform dim", lambda: scaling.hadamard_transform(x32(), dim=5), ValueError, "dim"),
    ("hadamard_transform length 24", lambda: scaling.hadamard_transform(torch.ones(24)), ValueError, "dim"),
    ("hadamard_transform list", lambda: scaling.hadamard_transform([1.0]), TypeError, "x"),
    ("hadamard_transform seed str", lambda: scaling.hadamard_transform(x32(), seed="x"), TypeError, "seed"),
    (
        "hadamard_transform inverse int",
        lambda: scaling.hadamard_transform(x32(), inverse=1),
        TypeError,
        "inverse",
    ),
    # --- qlab.quantize: specs ---------------------------------------------------------------------
    ("TensorwiseSpec int element", lambda: Q.TensorwiseSpec("int8"), ValueError, "element"),
    ("TensorwiseSpec unknown element", lambda: Q.TensorwiseSpec("e9m9"), ValueError, "e9m9"),
    ("TensorwiseSpec eps str", lambda: Q.TensorwiseSpec(eps="x"), TypeError, "eps"),
    ("TensorwiseSpec eps < 0", lambda: Q.TensorwiseSpec(eps=-1.0), ValueError, "eps"),
    ("TensorwiseSpec eps inf", lambda: Q.TensorwiseSpec(eps=INF), ValueError, "eps"),
    ("TensorwiseSpec eps NaN", lambda: Q.TensorwiseSpec(eps=NAN), ValueError, "eps"),
    ("TensorwiseSpec pow2 str", lambda: Q.TensorwiseSpec(pow2="no"), TypeError, "pow2"),
    ("TensorwiseSpec granularity", lambda: Q.TensorwiseSpec(granularity="row"), ValueError, "granularity"),
    ("TensorwiseSpec rounding", lambda: Q.TensorwiseSpec(rounding="nearest"), ValueError, "rounding"),
    ("IntSpec bits 1", lambda: Q.IntSpec(bits=1), ValueError, "bits"),
    ("IntSpec bits 17", lambda: Q.IntSpec(bits=17), ValueError, "bits"),
    ("IntSpec bits float", lambda: Q.IntSpec(bits=8.0), TypeError, "bits"),
    ("IntSpec bits bool", lambda: Q.IntSpec(bits=True), TypeError, "bits"),
    ("IntSpec signed str", lambda: Q.IntSpec(signed="yes"), TypeError, "signed"),
    ("IntSpec symmetric int", lambda: Q.IntSpec(symmetric=1), TypeError, "symmetric"),
    ("IntSpec unsigned symmetric", lambda: Q.IntSpec(signed=False, symmetric=True), ValueError, "symmetric"),
    ("IntSpec granularity", lambda: Q.IntSpec(granularity="channel"), ValueError, "granularity"),
    ("MXSpec block_size bool", lambda: Q.MXSpec(block_size=True), TypeError, "block_size"),
    ("MXSpec block_size 0", lambda: Q.MXSpec(block_size=0), ValueError, "block_size"),
    (
        "MXSpec block_size 2**40",
        lambda: Q.MXSpec(block_size=2**40),
        ValueError,
        "block_size must be an int in",
    ),
    ("MXSpec block_size float", lambda: Q.MXSpec(block_size=32.0), TypeError, "block_size"),
    ("MXSpec int element", lambda: Q.MXSpec("int8"), ValueError, "element"),
    ("MXSpec mode", lambda: Q.MXSpec(mode="round"), ValueError, "mode"),
    ("MXSpec pad str", lambda: Q.MXSpec(pad="yes"), TypeError, "pad"),
    ("MXSpec rounding", lambda: Q.MXSpec(rounding="bogus"), ValueError, "rounding"),
    ("NVFP4Spec block_2d str", lambda: Q.NVFP4Spec(block_2d="yes"), TypeError, "block_2d"),
    ("NVFP4Spec hadamard int", lambda: Q.NVFP4Spec(hadamard=1), TypeError, "hadamard"),
    ("NVFP4Spec hadamard_seed str", lambda: Q.NVFP4Spec(hadamard_seed="x"), TypeError, "hadamard_seed"),
    ("NVFP4Spec hadamard_seed < 0", lambda: Q.NVFP4Spec(hadamard_seed=-3), ValueError, "hadamard_seed"),
    ("NVFP4Spec global_scale str", lambda: Q.NVFP4Spec(global_scale="no"), TypeError, "global_scale"),
    ("NVFP4Spec pad None", lambda: Q.NVFP4Spec(pad=None), TypeError, "pad"),
    ("NVFP4Spec rounding", lambda: Q.NVFP4Spec(rounding="up"), ValueError, "rounding"),
    ("get_spec unknown", lambda: Q.get_spec("mxfp9"), ValueError, "mxfp9"),
    ("get_spec int", lambda: Q.get_spec(42), TypeError, "spec"),
    ("get_spec unregistered subclass", lambda: Q.get_spec(_UnregisteredSpec()), TypeError, "BlockwiseSpec"),
    ("quantize unregistered subclass", lambda: Q.quantize(x32(), _UnregisteredSpec()), TypeError, "spec"),
    ("NVFP4Spec convention", lambda: Q.NVFP4Spec(convention="te"), ValueError, "convention"),
    ("TensorwiseSpec convention", lambda: Q.TensorwiseSpec(convention=None), ValueError, "convention"),
    ("BlockwiseSpec block_size 0", lambda: Q.BlockwiseSpec(block_size=0), ValueError, "block_size"),
    (
        "BlockwiseSpec block_size 2**62",
        lambda: Q.BlockwiseSpec(block_size=2**62),
        ValueError,
        "block_size must",
    ),
    ("BlockwiseSpec element int8", lambda: Q.BlockwiseSpec("int8"), ValueError, "element"),
    ("BlockwiseSpec element e2m1", lambda: Q.BlockwiseSpec("e2m1"), ValueError, "e4m3, e5m2"),
    ("BlockwiseSpec pow2 str", lambda: Q.BlockwiseSpec(pow2="yes"), TypeError, "pow2"),
    ("BlockwiseSpec eps < 0", lambda: Q.BlockwiseSpec(eps=-1.0), ValueError, "eps"),
    (
        "BlockwiseSpec fixed scale",
        lambda: Q.qdq(x32(), "fp8_blockwise", scale=2.0),
        ValueError,
        "fixed scale",
    ),
    (
        "BlockwiseSpec 2-D on 1-D x",
        lambda: Q.qdq(torch.ones(128), "fp8_blockwise_2d"),
        ValueError,
        "2 dimensions",
    ),
    ("MXSpec block_2d str", lambda: Q.MXSpec(block_2d="yes"), TypeError, "block_2d"),
    (
        "MXSpec hadamard block 24",
        lambda: Q.MXSpec(block_size=24, hadamard=True),
        ValueError,
        "multiple of 16",
    ),
    ("MXSpec 2-D on 1-D x", lambda: Q.qdq(torch.ones(64), "mxfp8_2d"), ValueError, "2 dimensions"),
    # --- qlab.stats and qlab.ablation ------------------------------------------------------------------
    ("mean_interval str", lambda: stats.mean_interval("abc"), TypeError, "sequence of numbers"),
    ("mean_interval None", lambda: stats.mean_interval(None), TypeError, "sequence of numbers"),
    ("mean_interval strings", lambda: stats.mean_interval(["1", "2"]), TypeError, "real numbers"),
    (
        "summarize missing column",
        lambda: stats.summarize(pd.DataFrame({"a": [1]}), "b", ["a"]),
        ValueError,
        "'b'",
    ),
    (
        "paired_differences missing column",
        lambda: stats.paired_differences(pd.DataFrame({"a": [1]}), "b", baseline="x", by="a", pair="a"),
        ValueError,
        "'b'",
    ),
    ("mean_interval method", lambda: stats.mean_interval([1.0, 2.0], "normal"), ValueError, "method"),
    ("paired_test str", lambda: stats.paired_test("abc"), TypeError, "differences must be a sequence"),
    ("paired_test one", lambda: stats.paired_test([0.1]), ValueError, "at least 2 differences"),
    ("paired_test alpha 0", lambda: stats.paired_test([0.1, 0.2], alpha=0), ValueError, "alpha"),
    ("holm above 1", lambda: stats.holm([0.1, 1.2]), ValueError, "p_values must lie in"),
    ("holm nan", lambda: stats.holm([0.1, float("nan")]), ValueError, "p_values must be finite"),
    ("tost margin 0", lambda: stats.tost([0.1, 0.2], margin=0), ValueError, "margin"),
    ("tost margin str", lambda: stats.tost([0.1, 0.2], margin="0.01"), TypeError, "margin"),
    ("detectable_effect n 1", lambda: stats.detectable_effect(0.1, 1), ValueError, "n must be an int ≥ 2"),
    ("detectable_effect power 1", lambda: stats.detectable_effect(0.1, 5, power=1.0), ValueError, "power"),
    ("t_cdf df 0", lambda: stats.t_cdf(1.0, 0), ValueError, "degrees_of_freedom"),
    ("t_quantile p 1", lambda: stats.t_quantile(1.0, 3), ValueError, "probability"),
    ("seeds_for_effect effect 0", lambda: stats.seeds_for_effect(0.1, 0.0), ValueError, "effect"),
    (
        "mean_interval resamples 5",
        lambda: stats.mean_interval([1.0, 2.0], "bootstrap", resamples=5),
        ValueError,
        "resamples",
    ),
    (
        "paired_differences baseline repeats a seed",
        lambda: stats.paired_differences(
            pd.DataFrame({"r": ["b", "b", "q"], "s": [0, 0, 0], "v": [1.0, 2.0, 3.0]}),
            "v",
            baseline="b",
            by="r",
            pair="s",
        ),
        ValueError,
        "pair",
    ),
    (
        "mean_band missing column",
        lambda: plotting.mean_band(axes(), pd.DataFrame({"x": [1], "y": [2.0]}), "x", "loss"),
        ValueError,
        "'loss'",
    ),
    (
        "delta_band unknown baseline",
        lambda: plotting.delta_band(
            axes(),
            pd.DataFrame({"r": ["a"], "seed": [0], "x": [1], "y": [2.0]}),
            "x",
            "y",
            baseline="fp32",
            by="r",
        ),
        ValueError,
        "fp32",
    ),
    (
        "mean_band ax None",
        lambda: plotting.mean_band(None, pd.DataFrame({"x": [1], "y": [2.0]}), "x", "y"),
        TypeError,
        "ax",
    ),
    ("summarize frame list", lambda: stats.summarize([1, 2], "y", ["x"]), TypeError, "frame"),
    (
        "paired_differences pair empty",
        lambda: stats.paired_differences(
            pd.DataFrame({"r": ["a"], "v": [1.0]}), "v", baseline="a", by="r", pair=[]
        ),
        TypeError,
        "pair",
    ),
    (
        "paired_differences pair int",
        lambda: stats.paired_differences(
            pd.DataFrame({"r": ["a"], "v": [1.0]}), "v", baseline="a", by="r", pair=5
        ),
        TypeError,
        "pair",
    ),
    (
        "weight_gradients names typo",
        lambda: probes.weight_gradients(
            torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], lambda m, b: 0, names=["zz"]
        ),
        ValueError,
        "names",
    ),
    (
        "gradient_noise_floor batches not a list",
        lambda: probes.gradient_noise_floor(torch.nn.Linear(2, 2), [1], 3, lambda m, b: 0),
        TypeError,
        "other_batches",
    ),
    (
        "gemm_errors int64 x",
        lambda: ablation.gemm_errors(
            "nvfp4", torch.ones(4, 16, dtype=torch.long), torch.ones(2, 16), torch.ones(4, 2)
        ),
        TypeError,
        "x",
    ),
    (
        "gemm_errors unknown recipe",
        lambda: ablation.gemm_errors("nvfp5", x32(), x32(2, 32), x32(4, 2)),
        ValueError,
        "nvfp5",
    ),
    ("without unknown ingredient", lambda: ablation.without(R.get_recipe("nvfp4"), ["sr"]), ValueError, "sr"),
    ("ablations of fp8", lambda: ablation.ablations("mxfp8"), ValueError, "preset"),
    ("switched_off unknown label", lambda: ablation.switched_off("nvfp4", "no FP4"), ValueError, "no FP4"),
    (
        "capture_operands int",
        lambda: ablation.capture_operands(torch.nn.Linear(2, 2), 3),
        TypeError,
        "callable",
    ),
    # --- qlab.quantize: quantize, qdq, dequantize, measurements -----------------------------------
    ("quantize a list", lambda: Q.quantize([1.0], "mxfp8"), TypeError, "x must be"),
    (
        "quantize float64",
        lambda: Q.quantize(x32().double(), "mxfp8"),
        TypeError,
        "float32, bfloat16 or float16",
    ),
    ("quantize ints", lambda: Q.quantize(torch.ones(32, dtype=torch.int32), "mxfp8"), TypeError, "x must be"),
    ("qdq float64", lambda: Q.qdq(torch.ones(32, dtype=torch.float64), "int8"), TypeError, "x must be"),
    ("quantize axis 2", lambda: Q.quantize(x32(), "mxfp8", axis=2), ValueError, "axis"),
    ("quantize axis float", lambda: Q.quantize(x32(), "mxfp8", axis=1.0), TypeError, "axis"),
    ("quantize 0-d", lambda: Q.quantize(torch.tensor(1.0), "int8"), ValueError, "x must have"),
    ("quantize empty", lambda: Q.quantize(torch.ones(0, 32), "mxfp8"), ValueError, "non-empty"),
    ("quantize 2D NVFP4 on 1-D", lambda: Q.quantize(torch.ones(32), "nvfp4_2d"), ValueError, "x must have"),
    (
        "quantize generator with rne",
        lambda: Q.quantize(x32(), "mxfp8", generator=gen()),
        ValueError,
        "generator",
    ),
    (
        "quantize generator is a seed",
        lambda: Q.quantize(x32(), Q.MXSpec(rounding="stochastic"), generator=42),
        TypeError,
        "generator",
    ),
    ("quantize scale < 0", lambda: Q.quantize(x32(), "fp8_e4m3", scale=-1.0), ValueError, "scale"),
    ("qdq scale 0", lambda: Q.qdq(torch.ones(32), "fp8_e4m3", scale=0.0), ValueError, "scale"),
    ("quantize scale str", lambda: Q.quantize(x32(), "fp8_e4m3", scale="2"), TypeError, "scale"),
    ("quantize scale for MX", lambda: Q.quantize(x32(), "mxfp8", scale=2.0), ValueError, "scale"),
    ("qdq scale for NVFP4", lambda: Q.qdq(torch.ones(32), "nvfp4", scale=2.0), ValueError, "scale"),
    (
        "qdq scale, asymmetric",
        lambda: Q.qdq(torch.ones(32), "uint8_asymmetric", scale=1.0),
        ValueError,
        "scale",
    ),
    (
        "quantize keep_source str",
        lambda: Q.quantize(x32(), "fp8_e4m3", keep_source="yes"),
        TypeError,
        "keep_source",
    ),
    ("quantize NaN to int8", lambda: Q.quantize(torch.tensor([1.0, NAN]), "int8"), ValueError, "x holds"),
    (
        "qdq inf to int8",
        lambda: Q.qdq(torch.tensor([0.3, -0.2, 0.45, INF]), "int8"),
        ValueError,
        "x holds inf",
    ),
    (
        "qdq -inf to int4 rows",
        lambda: Q.qdq(torch.tensor([[1.0, -INF]]), "int4_rowwise"),
        ValueError,
        "x holds",
    ),
    ("qdq dtype int32", lambda: Q.qdq(x32(), "mxfp8", dtype=torch.int32), TypeError, "dtype"),
    ("qdq dtype string", lambda: Q.qdq(x32(), "mxfp8", dtype="float32"), TypeError, "dtype"),
    ("qdq fast str", lambda: Q.qdq(x32(), "mxfp8", fast="yes"), TypeError, "fast"),
    ("qdq noise not a tensor", lambda: Q.qdq(x32(), SR_MX, noise=0.5), TypeError, "noise"),
    ("qdq noise float64", lambda: Q.qdq(x32(), SR_MX, noise=torch.zeros(1, 32).double()), TypeError, "noise"),
    ("qdq noise shape", lambda: Q.qdq(x32(), SR_MX, noise=torch.zeros(32)), ValueError, "noise"),
    ("qdq noise for RNE", lambda: Q.qdq(x32(), "mxfp8", noise=torch.zeros(1, 1, 32)), ValueError, "noise"),
    (
        "qdq noise and generator",
        lambda: Q.qdq(x32(), SR_MX, noise=torch.zeros(4, 1, 32), generator=torch.Generator()),
        ValueError,
        "noise",
    ),
    ("quantize noise shape", lambda: Q.quantize(x32(), SR_MX, noise=torch.zeros(3)), ValueError, "noise"),
    ("qdq MX pad=False", lambda: Q.quantize(torch.ones(2, 40), Q.MXSpec(pad=False)), ValueError, "pad=True"),
    ("qdq NVFP4 pad=False", lambda: Q.qdq(torch.ones(2, 24), Q.NVFP4Spec(pad=False)), ValueError, "pad=True"),
    (
        "qdq NVFP4 2D rows pad=False",
        lambda: Q.qdq(torch.ones(20, 32), Q.NVFP4Spec(block_2d=True, pad=False)),
        ValueError,
        "pad=True",
    ),
    ("dequantize a tensor", lambda: Q.dequantize(torch.ones(3)), TypeError, "q must be a QTensor"),
    (
        "dequantize dtype int",
        lambda: Q.dequantize(Q.quantize(x32(), "mxfp8"), dtype=torch.int32),
        TypeError,
        "dtype",
    ),
    (
        "QTensor.along without source",
        lambda: Q.quantize(x32(), "mxfp8", keep_source=False).along(0),
        ValueError,
        "keep_source",
    ),
    ("QTensor.packed_codes not FP4", lambda: Q.quantize(x32(), "mxfp8").packed_codes(), ValueError, "e2m1"),
    ("sqnr_db broadcasting", lambda: Q.sqnr_db(torch.randn(4, 4), torch.randn(4)), ValueError, "x_hat"),
    ("sqnr_db a list", lambda: Q.sqnr_db([1.0], torch.ones(1)), TypeError, "x must be"),
    (
        "sqnr_db complex",
        lambda: Q.sqnr_db(torch.ones(2, dtype=torch.complex64), torch.ones(2)),
        TypeError,
        "x must",
    ),
    (
        "clipped_block_fraction tensorwise",
        lambda: Q.clipped_block_fraction(x32(), "fp8_e4m3"),
        ValueError,
        "spec",
    ),
    ("qdq_with_mask hadamard", lambda: Q.qdq_with_mask(x32(), "nvfp4_rht"), ValueError, "hadamard"),
    # --- qlab.synthetic ---------------------------------------------------------------------------
    ("activations kind", lambda: synthetic.activations("cauchy", (4, 4), gen()), ValueError, "kind"),
    (
        "activations negative shape",
        lambda: synthetic.activations("gaussian", (4, -1), gen()),
        ValueError,
        "shape",
    ),
    ("activations shape str", lambda: synthetic.activations("gaussian", "4x4", gen()), TypeError, "shape"),
    (
        "activations shape float",
        lambda: synthetic.activations("gaussian", (4, 4.0), gen()),
        TypeError,
        "shape",
    ),
    (
        "activations generator int",
        lambda: synthetic.activations("gaussian", (4, 4), 42),
        TypeError,
        "generator",
    ),
    (
        "activations generator None",
        lambda: synthetic.activations("gaussian", (4, 4), None),
        TypeError,
        "generator",
    ),
    (
        "activations too many outliers",
        lambda: synthetic.activations("outlier_channels", (4, 8), gen(), outlier_channels=9),
        ValueError,
        "outlier_channels",
    ),
    (
        "activations outliers float",
        lambda: synthetic.activations("outlier_channels", (4, 8), gen(), outlier_channels=2.0),
        TypeError,
        "outlier_channels",
    ),
    (
        "activations outlier_scale NaN",
        lambda: synthetic.activations("outlier_channels", (4, 8), gen(), outlier_scale=NAN),
        ValueError,
        "outlier_scale",
    ),
    # --- qlab.recipe ------------------------------------------------------------------------------
    ("Recipe delayed 'no'", lambda: R.Recipe(input="fp8_e4m3", delayed="no"), TypeError, "delayed"),
    ("Recipe delayed 1", lambda: R.Recipe(delayed=1), TypeError, "delayed"),
    ("Recipe history 0", lambda: R.Recipe(amax_history_len=0), ValueError, "amax_history_len"),
    ("Recipe history float", lambda: R.Recipe(amax_history_len=2.0), TypeError, "amax_history_len"),
    ("Recipe amax_algorithm", lambda: R.Recipe(amax_algorithm="mean"), ValueError, "amax_algorithm"),
    ("Recipe margin str", lambda: R.Recipe(margin="1"), TypeError, "margin"),
    ("Recipe margin < 0", lambda: R.Recipe(margin=-1), ValueError, "margin"),
    ("Recipe margin 128", lambda: R.Recipe(margin=128), ValueError, "margin"),
    ("Recipe reduce_amax str", lambda: R.Recipe(reduce_amax="yes"), TypeError, "reduce_amax"),
    ("Recipe override", lambda: R.Recipe(backward_override="hp"), ValueError, "backward_override"),
    ("Recipe unknown input spec", lambda: R.Recipe(input="mxfp9"), ValueError, "input"),
    ("Recipe input int", lambda: R.Recipe(input=3), TypeError, "input"),
    ("Recipe name int", lambda: R.Recipe(name=3), TypeError, "name"),
    ("Recipe delayed MX", lambda: R.Recipe(input=Q.MXSpec(), delayed=True), ValueError, "delayed"),
    (
        "Recipe delayed with override",
        lambda: R.Recipe(input="fp8_e4m3", delayed=True, backward_override="dequantized"),
        ValueError,
        "backward_override",
    ),
    ("get_recipe unknown", lambda: R.get_recipe("fp4"), ValueError, "recipe"),
    ("get_recipe int", lambda: R.get_recipe(42), TypeError, "recipe"),
    (
        "get_recipe override",
        lambda: R.get_recipe("mxfp8", backward_override="x"),
        ValueError,
        "backward_override",
    ),
    ("from_dict list", lambda: R.Recipe.from_dict([]), TypeError, "data"),
    ("from_dict unknown field", lambda: R.Recipe.from_dict({"inputs": None}), ValueError, "inputs"),
    ("from_dict unknown kind", lambda: R.Recipe.from_dict({"input": {"kind": "Foo"}}), ValueError, "kind"),
    (
        "from_dict unknown spec field",
        lambda: R.Recipe.from_dict({"input": {"kind": "MXSpec", "block": 32}}),
        ValueError,
        "block",
    ),
    ("Recipe.spec role", lambda: R.get_recipe("mxfp8").spec("bias"), ValueError, "role"),
    # --- qlab.nn ----------------------------------------------------------------------------------
    ("QuantLinear recipe", lambda: qnn.QuantLinear(4, 4, recipe="fp3"), ValueError, "recipe"),
    ("QuantLinear in_features float", lambda: qnn.QuantLinear(4.0, 4), TypeError, "in_features"),
    ("QuantLinear out_features 0", lambda: qnn.QuantLinear(4, 0), ValueError, "out_features"),
    ("QuantLinear bias str", lambda: qnn.QuantLinear(4, 4, bias="yes"), TypeError, "bias"),
    (
        "QuantLinear fuse str",
        lambda: qnn.QuantLinear(4, 4, fuse_wgrad_accumulation="yes"),
        TypeError,
        "fuse_wgrad_accumulation",
    ),
    ("QuantLinear delay int", lambda: qnn.QuantLinear(4, 4, delay_wgrad=1), TypeError, "delay_wgrad"),
    ("QuantLinear seed str", lambda: qnn.QuantLinear(4, 4, seed="abc"), TypeError, "seed"),
    ("QuantLinear seed < 0", lambda: qnn.QuantLinear(4, 4, seed=-1), ValueError, "seed"),
    ("QuantLinear gemm", lambda: qnn.QuantLinear(4, 4, gemm="tensorcore"), ValueError, "gemm"),
    (
        "QuantLinear scaled_mm for MX",
        lambda: qnn.QuantLinear(4, 4, recipe="mxfp8", gemm="scaled_mm"),
        ValueError,
        "gemm",
    ),
    ("QuantLinear dtype int", lambda: qnn.QuantLinear(4, 4, dtype=torch.int8), TypeError, "dtype"),
    ("QuantLinear input shape", lambda: qnn.QuantLinear(4, 4)(torch.randn(2, 5)), ValueError, "input x"),
    (
        "QuantLinear input ints",
        lambda: qnn.QuantLinear(4, 4)(torch.ones(2, 4, dtype=torch.long)),
        TypeError,
        "input x",
    ),
    ("QuantLinear input list", lambda: qnn.QuantLinear(4, 4)([1.0] * 4), TypeError, "input x"),
    (
        "QuantLinear input float64",
        lambda: qnn.QuantLinear(4, 4)(torch.randn(2, 4).double()),
        TypeError,
        "input dtype",
    ),
    (
        "QuantLinear is_first_microbatch str",
        lambda: qnn.QuantLinear(4, 4)(torch.randn(2, 4), is_first_microbatch="yes"),
        TypeError,
        "is_first_microbatch",
    ),
    ("from_linear of a Conv1d", lambda: qnn.QuantLinear.from_linear(nn.Conv1d(2, 2, 1)), TypeError, "linear"),
    (
        "from_linear unknown option",
        lambda: qnn.QuantLinear.from_linear(nn.Linear(4, 4), foo=1),
        TypeError,
        "foo",
    ),
    (
        "load_quant_state foreign scalers",
        lambda: qnn.QuantLinear(4, 4, recipe="mxfp8").load_quant_state({"scalers": {"input": {}}}),
        ValueError,
        "input",
    ),
    ("load_quant_state str", lambda: qnn.QuantLinear(4, 4).load_quant_state("x"), TypeError, "state"),
    ("fake_quant ste", lambda: qnn.fake_quant(x32(), "mxfp8", ste="straight"), ValueError, "ste"),
    ("fake_quant list", lambda: qnn.fake_quant([1.0], "mxfp8"), TypeError, "x must be"),
    ("quantize_model of a str", lambda: qnn.quantize_model("model", "mxfp8"), TypeError, "model"),
    (
        "quantize_model keep typo",
        lambda: qnn.quantize_model(tiny(), "mxfp8", keep_high_precision=["haed"]),
        ValueError,
        "keep_high_precision pattern 'haed'",
    ),
    (
        "quantize_model keep typo names the closest",
        lambda: qnn.quantize_model(tiny(), "mxfp8", keep_high_precision="haed"),
        ValueError,
        "closest Linear layer names: head",
    ),
    (
        "quantize_model keep a non-Linear",
        lambda: qnn.quantize_model(tiny(), "mxfp8", keep_high_precision=["act"]),
        ValueError,
        "keep_high_precision",
    ),
    (
        "quantize_model keep int",
        lambda: qnn.quantize_model(tiny(), "mxfp8", keep_high_precision=42),
        TypeError,
        "keep_high_precision",
    ),
    ("quantize_model seed str", lambda: qnn.quantize_model(tiny(), "mxfp8", seed="x"), TypeError, "seed"),
    (
        "quantize_model unknown option",
        lambda: qnn.quantize_model(tiny(), "mxfp8", bogus=1),
        TypeError,
        "bogus",
    ),
    ("quantize_model of a Linear", lambda: qnn.quantize_model(nn.Linear(4, 4), "mxfp8"), ValueError, "model"),
    ("unquantize_model of an int", lambda: qnn.unquantize_model(42), TypeError, "model"),
    ("check_gemm", lambda: qnn.check_gemm("fast", R.get_recipe("mxfp8")), ValueError, "gemm"),
    # --- qlab.probes ------------------------------------------------------------------------------
    ("tensor_stats list", lambda: probes.tensor_stats([1.0]), TypeError, "tensor"),
    ("tensor_stats bool", lambda: probes.tensor_stats(torch.tensor([True])), TypeError, "tensor"),
    (
        "tensor_stats complex",
        lambda: probes.tensor_stats(torch.ones(2, dtype=torch.complex64)),
        TypeError,
        "tensor",
    ),
    ("tensor_stats unknown", lambda: probes.tensor_stats(x32(), stats="median"), ValueError, "stats"),
    (
        "tensor_stats unknown in list",
        lambda: probes.tensor_stats(x32(), stats=["min", "p99"]),
        ValueError,
        "p99",
    ),
    ("tensor_stats stats int", lambda: probes.tensor_stats(x32(), stats=5), TypeError, "stats"),
    ("log2_histogram low > high", lambda: probes.log2_histogram(x32(), low=10, high=0), ValueError, "high"),
    ("log2_histogram low float", lambda: probes.log2_histogram(x32(), low=1.5), TypeError, "low"),
    ("log2_histogram list", lambda: probes.log2_histogram([1.0]), TypeError, "tensor"),
    (
        "log2_histogram complex",
        lambda: probes.log2_histogram(torch.ones(2, dtype=torch.complex64)),
        TypeError,
        "tensor",
    ),
    ("what_if_stats spec", lambda: probes.what_if_stats(x32(), "mxfp9"), ValueError, "mxfp9"),
    ("what_if_stats list", lambda: probes.what_if_stats([1.0], "mxfp8"), TypeError, "tensor"),
    ("what_if_stats axis", lambda: probes.what_if_stats(x32(), "mxfp8", axis=3), ValueError, "axis"),
    ("block_stats per-tensor spec", lambda: probes.block_stats(x32(), "fp8_e4m3"), ValueError, "spec"),
    ("block_stats worst < 0", lambda: probes.block_stats(x32(), "mxfp8", worst=-1), ValueError, "worst"),
    (
        "block_stats bool tensor",
        lambda: probes.block_stats(torch.ones(32, dtype=torch.bool), "mxfp8"),
        TypeError,
        "tensor",
    ),
    (
        "ProbeSet block_stats str",
        lambda: probes.ProbeSet(tiny(), block_stats="yes"),
        TypeError,
        "block_stats",
    ),
    (
        "ProbeSet what_if patterns int",
        lambda: probes.ProbeSet(tiny(), what_if={"a": ("mxfp8", 3)}),
        TypeError,
        "what_if",
    ),
    ("probe a list", lambda: probes.probe([1.0], "x"), TypeError, "tensor"),
    ("probe name int", lambda: probes.probe(torch.ones(1), 3), TypeError, "name"),
    ("ProbeSet stats", lambda: probes.ProbeSet(tiny(), stats="median"), ValueError, "stats"),
    ("ProbeSet stats tuple", lambda: probes.ProbeSet(tiny(), stats=("median",)), ValueError, "median"),
    ("ProbeSet roles", lambda: probes.ProbeSet(tiny(), roles="inputs"), ValueError, "roles"),
    ("ProbeSet roles tuple", lambda: probes.ProbeSet(tiny(), roles=("activations",)), ValueError, "roles"),
    (
        "ProbeSet modules typo",
        lambda: probes.ProbeSet(tiny(), modules="haed"),
        ValueError,
        "closest module names: head",
    ),
    (
        "ProbeSet modules no match",
        lambda: probes.ProbeSet(tiny(), modules=["encoder.*"]),
        ValueError,
        "modules",
    ),
    ("ProbeSet modules int", lambda: probes.ProbeSet(tiny(), modules=3), TypeError, "modules"),
    (
        "ProbeSet modules class absent",
        lambda: probes.ProbeSet(tiny(), modules=nn.Conv1d),
        ValueError,
        "modules",
    ),
    ("ProbeSet model str", lambda: probes.ProbeSet("model"), TypeError, "model"),
    ("ProbeSet every 0", lambda: probes.ProbeSet(tiny(), every=0), ValueError, "every"),
    ("ProbeSet every float", lambda: probes.ProbeSet(tiny(), every=1.0), TypeError, "every"),
    ("ProbeSet start < 0", lambda: probes.ProbeSet(tiny(), start=-1), ValueError, "start"),
    ("ProbeSet end ≤ start", lambda: probes.ProbeSet(tiny(), start=5, end=2), ValueError, "end"),
    ("ProbeSet end str", lambda: probes.ProbeSet(tiny(), end="10"), TypeError, "end"),
    ("ProbeSet ranks int", lambda: probes.ProbeSet(tiny(), ranks=0), TypeError, "ranks"),
    ("ProbeSet ranks < 0", lambda: probes.ProbeSet(tiny(), ranks=[-1]), ValueError, "ranks"),
    ("ProbeSet histograms str", lambda: probes.ProbeSet(tiny(), histograms="yes"), TypeError, "histograms"),
    ("ProbeSet what_if str", lambda: probes.ProbeSet(tiny(), what_if="mxfp8"), TypeError, "what_if"),
    ("ProbeSet what_if spec", lambda: probes.ProbeSet(tiny(), what_if={"a": "mxfp9"}), ValueError, "what_if"),
    (
        "ProbeSet what_if_axis str",
        lambda: probes.ProbeSet(tiny(), what_if_axis="x"),
        TypeError,
        "what_if_axis",
    ),
    ("GradientAudit of a str", lambda: probes.GradientAudit("m"), TypeError, "model"),
    (
        "GradientAudit hook str",
        lambda: probes.GradientAudit(tiny(), hook_parameters="yes"),
        TypeError,
        "hook_parameters",
    ),
    ("audit loss_scale 0", lambda: audit(loss_scale=0), ValueError, "loss_scale"),
    ("audit loss_scale NaN", lambda: audit(loss_scale=NAN), ValueError, "loss_scale"),
    ("audit loss_scale inf", lambda: audit(loss_scale=INF), ValueError, "loss_scale"),
    ("audit loss_scale str", lambda: audit(loss_scale="1"), TypeError, "loss_scale"),
    ("audit world_size 0", lambda: audit(world_size=0), ValueError, "world_size"),
    ("audit world_size float", lambda: audit(world_size=1.5), TypeError, "world_size"),
    ("audit clip 0", lambda: audit(clip_coefficient=0), ValueError, "clip_coefficient"),
    ("audit clip 2", lambda: audit(clip_coefficient=2), ValueError, "clip_coefficient"),
    ("audit tolerance < 0", lambda: audit(tolerance=-1), ValueError, "tolerance"),
    (
        "audit observe name int",
        lambda: probes.GradientAudit(tiny()).observe(3, torch.ones(1)),
        TypeError,
        "name",
    ),
    ("audit observe list", lambda: probes.GradientAudit(tiny()).observe("w", [1.0]), TypeError, "grad"),
    # --- qlab.numerics ----------------------------------------------------------------------------
    ("layer_norm eps inf", lambda: numerics.layer_norm(x32(4, 8), 8, eps=INF), ValueError, "eps"),
    ("layer_norm eps NaN", lambda: numerics.layer_norm(x32(4, 8), 8, eps=NAN), ValueError, "eps"),
    ("layer_norm eps str", lambda: numerics.layer_norm(x32(4, 8), 8, eps="1e-5"), TypeError, "eps"),
    ("layer_norm eps < 0", lambda: numerics.layer_norm(x32(4, 8), 8, eps=-1.0), ValueError, "eps"),
    ("layer_norm shape", lambda: numerics.layer_norm(x32(4, 8), 7), ValueError, "normalized_shape"),
    ("layer_norm shape str", lambda: numerics.layer_norm(x32(4, 8), "8"), TypeError, "normalized_shape"),
    ("layer_norm stats", lambda: numerics.layer_norm(x32(4, 8), 8, stats="naive"), ValueError, "stats"),
    (
        "layer_norm weight shape",
        lambda: numerics.layer_norm(x32(4, 8), 8, torch.ones(7)),
        ValueError,
        "weight",
    ),
    (
        "layer_norm acc fp8",
        lambda: numerics.layer_norm(x32(4, 8), 8, acc_dtype=torch.float8_e4m3fn),
        ValueError,
        "acc_dtype",
    ),
    (
        "layer_norm acc str",
        lambda: numerics.layer_norm(x32(4, 8), 8, acc_dtype="float32"),
        TypeError,
        "acc_dtype",
    ),
    ("layer_norm ints", lambda: numerics.layer_norm(torch.ones(4, 8, dtype=torch.long), 8), TypeError, "x"),
    ("moments algorithm", lambda: numerics.moments(x32(), "kahan"), ValueError, "algorithm"),
    ("moments dims 0", lambda: numerics.moments(x32(), dims=0), ValueError, "dims"),
    ("moments chunk 0", lambda: numerics.moments(x32(), chunk=0), ValueError, "chunk"),
    ("moments acc str", lambda: numerics.moments(x32(), acc_dtype="float32"), TypeError, "acc_dtype"),
    ("variance correction ≥ n", lambda: numerics.variance(x32(2, 8), correction=8), ValueError, "correction"),
    (
        "variance correction float",
        lambda: numerics.variance(x32(2, 8), correction=0.5),
        TypeError,
        "correction",
    ),
    ("exact_moments inf", lambda: numerics.exact_moments(torch.tensor([[1.0, INF]])), ValueError, "inf"),
    ("rows κ < 1", lambda: numerics.rows_with_condition_number([0.5], 8), ValueError, "kappas"),
    ("rows n 1", lambda: numerics.rows_with_condition_number([2.0], 1), ValueError, "n must"),
    (
        "rows generator int",
        lambda: numerics.rows_with_condition_number([2.0], 8, generator=1),
        TypeError,
        "generator",
    ),
    ("rows std < 0", lambda: numerics.rows_with_condition_number([2.0], 8, std=-1.0), ValueError, "std"),
    (
        "rows dtype int",
        lambda: numerics.rows_with_condition_number([2.0], 8, dtype=torch.int32),
        TypeError,
        "dtype",
    ),
    (
        "exact_layer_norm eps < 0",
        lambda: numerics.exact_layer_norm(x32(2, 8), 8, eps=-1.0),
        ValueError,
        "eps",
    ),
    (
        "exact_layer_norm digits 0",
        lambda: numerics.exact_layer_norm(x32(2, 8), 8, digits=0),
        ValueError,
        "digits",
    ),
    ("check_layer_norm_grads str", lambda: numerics.check_layer_norm_grads("fn"), TypeError, "fn"),
    (
        "check_layer_norm_grads dtype",
        lambda: numerics.check_layer_norm_grads(numerics.layer_norm, dtype=torch.int8),
        ValueError,
        "dtype",
    ),
    (
        "check_layer_norm_grads seed",
        lambda: numerics.check_layer_norm_grads(numerics.layer_norm, seed="x"),
        TypeError,
        "seed",
    ),
    ("unit_roundoff int dtype", lambda: numerics.unit_roundoff(torch.int32), TypeError, "dtype"),
    ("merge_moments str", lambda: numerics.merge_moments(numerics.moments(x32()), "x"), TypeError, "b must"),
    # --- qlab.sparse ------------------------------------------------------------------------------
    ("check_k bool", lambda: sparse.check_k(True), TypeError, "k"),
    ("check_k 0", lambda: sparse.check_k(0), ValueError, "k"),
    ("check_k 1.5", lambda: sparse.check_k(1.5), ValueError, "k"),
    ("check_k NaN", lambda: sparse.check_k(NAN), ValueError, "k"),
    ("resolve_k too large", lambda: sparse.resolve_k(10, 4), ValueError, "k"),
    ("topk_mask mode", lambda: sparse.topk_mask(x32(), 2, mode="col"), ValueError, "mode"),
    ("topk_mask list", lambda: sparse.topk_mask([1.0], 2), TypeError, "grad"),
    ("TopKLinear k 0", lambda: sparse.TopKLinear(4, 4, k=0), ValueError, "k"),
    ("TopKLinear mode", lambda: sparse.TopKLinear(4, 4, mode="x"), ValueError, "mode"),
    ("TopKLinear variant", lambda: sparse.TopKLinear(4, 4, variant="x"), ValueError, "variant"),
    ("TopKLinear in_features str", lambda: sparse.TopKLinear("4", 4), TypeError, "in_features"),
    (
        "sparsify_model keep typo",
        lambda: sparse.sparsify_model(tiny(), 0.5, keep=["haed"]),
        ValueError,
        "keep",
    ),
    (
        "mask_gradients keep typo",
        lambda: sparse.mask_gradients(tiny(), 2, keep=["nothing"]),
        ValueError,
        "keep",
    ),
    ("mask_gradients of a str", lambda: sparse.mask_gradients("m", 2), TypeError, "model"),
    (
        "backward_seconds variant",
        lambda: sparse.backward_seconds(tiny(), x32(2, 8), torch.ones(2, 4), "fast", 2),
        ValueError,
        "backward",
    ),
    (
        "backward_seconds repeats 0",
        lambda: sparse.backward_seconds(tiny(), x32(2, 8), torch.ones(2, 4), "dense", 2, repeats=0),
        ValueError,
        "repeats",
    ),
    (
        "pass_seconds timed",
        lambda: sparse.pass_seconds(tiny(), x32(2, 8), torch.ones(2, 4), "dense", 2, timed="forward"),
        ValueError,
        "timed",
    ),
    # --- qlab.kernels -----------------------------------------------------------------------------
    ("kernels.qdq backend", lambda: kernels.qdq(x32(), "mxfp8", backend="gpu"), ValueError, "backend"),
    ("kernels.qdq dtype", lambda: kernels.qdq(x32(), "mxfp8", dtype=torch.int8), TypeError, "dtype"),
    ("kernels.mx_qdq FP8 spec", lambda: kernels.mx_qdq(x32(), "fp8_e4m3"), TypeError, "spec"),
    ("kernels.mx_qdq block 16", lambda: kernels.mx_qdq(x32(), Q.MXSpec(block_size=16)), ValueError, "spec"),
    ("kernels.fp8_qdq MX spec", lambda: kernels.fp8_qdq(x32(), "mxfp8"), TypeError, "spec"),
    ("kernels.fp8_qdq dtype", lambda: kernels.fp8_qdq(x32(), "fp8_e4m3", dtype="bf16"), TypeError, "dtype"),
    ("kernels.nvfp4_qdq MX spec", lambda: kernels.nvfp4_qdq(x32(), "mxfp8"), TypeError, "spec"),
    ("kernels.nvfp4_qdq hadamard", lambda: kernels.nvfp4_qdq(x32(), "nvfp4_rht"), ValueError, "spec"),
    ("kernels.nvfp4_qdq seed", lambda: kernels.nvfp4_qdq(x32(), seed="x"), TypeError, "seed"),
    ("kernels.nvfp4_qdq offset", lambda: kernels.nvfp4_qdq(x32(), offset=-1), ValueError, "offset"),
    ("kernels.layer_norm stats", lambda: kernels.layer_norm(x32(4, 8), 8, stats="x"), ValueError, "stats"),
    ("kernels.layer_norm eps", lambda: kernels.layer_norm(x32(4, 8), 8, eps=INF), ValueError, "eps"),
    (
        "kernels.quantize NVFP4 on Triton",
        lambda: kernels.quantize(x32(), "nvfp4", backend="triton"),
        ValueError,
        "backend",
    ),
    (
        "fp8_matmul tensors",
        lambda: fp8_gemm.fp8_matmul(torch.ones(2, 2), torch.ones(2, 2)),
        TypeError,
        "operand A",
    ),
    (
        "fp8_matmul MX operands",
        lambda: fp8_gemm.fp8_matmul(Q.quantize(x32(), "mxfp8"), Q.quantize(x32(), "mxfp8")),
        TypeError,
        "operand A",
    ),
    # --- qlab.advisor ---------------------------------------------------------------------------------
    ("advise batches empty", lambda: advisor.advise(tiny(), [], "mxfp8"), TypeError, "batches"),
    (
        "advise loss_fn str",
        lambda: advisor.layer_sensitivity(tiny(), [x32(2, 8)], "mxfp8", loss_fn="mse"),
        TypeError,
        "loss_fn",
    ),
    (
        "advise budget 1.5",
        lambda: advisor.advise(tiny(), [x32(2, 8)], "mxfp8", budget=1.5),
        ValueError,
        "budget",
    ),
    ("advise by params", lambda: advisor.advise(tiny(), [x32(2, 8)], "mxfp8", by="params"), ValueError, "by"),
    ("advise recipe", lambda: advisor.advise(tiny(), [x32(2, 8)], "fp4"), ValueError, "recipe"),
    ("advise model str", lambda: advisor.layer_sensitivity("m", [x32(2, 8)], "mxfp8"), TypeError, "model"),
    ("models.load unknown", lambda: qlab_models.load("gpt5"), ValueError, "name"),
    (
        "fine_tune steps over the bound",
        lambda: qlab_models.fine_tune(
            tiny(), [x32(2, 8)], qlab_models.MAX_FINE_TUNE_STEPS + 1, loss_fn=lambda m, b: m(b).sum()
        ),
        ValueError,
        "steps",
    ),
    (
        "fine_tune lr 1e300",
        lambda: qlab_models.fine_tune(tiny(), [x32(2, 8)], 1, lr=1e300, loss_fn=lambda m, b: m(b).sum()),
        ValueError,
        "lr",
    ),
    (
        "fine_tune float batches without a loss_fn",
        lambda: qlab_models.fine_tune(tiny(), [x32(2, 8)], 1),
        TypeError,
        "loss_fn is None",
    ),
    (
        "shakespeare_batches tokens 1",
        lambda: qlab_models.shakespeare_batches(None, tokens=1),
        ValueError,
        "tokens",
    ),
    # --- qlab.results, qlab.plotting --------------------------------------------------------------
    ("save_csv not a frame", lambda: results.save_csv("df", "x"), TypeError, "df"),
    ("save_csv name with a slash", lambda: results.save_csv(pd.DataFrame(), "a/b"), ValueError, "name"),
    ("save_csv name int", lambda: results.save_csv(pd.DataFrame(), 3), TypeError, "name"),
    ("write_csv path int", lambda: results.write_csv(pd.DataFrame(), 3), TypeError, "path"),
    ("save_metrics list", lambda: results.save_metrics("x", a=[1]), TypeError, "'a'"),
    ("save_metrics hidden name", lambda: results.save_metrics(".x", a=1), ValueError, "name"),
    ("save_figure not a figure", lambda: plotting.save_figure("fig", "x"), TypeError, "fig"),
    ("save_figure name with a slash", lambda: plotting.save_figure(fig(), "a/b"), ValueError, "name"),
    ("save_figure name int", lambda: plotting.save_figure(fig(), 3), TypeError, "name"),
    ("subplots width", lambda: plotting.subplots(width="page"), ValueError, "width"),
    ("subplots width negative", lambda: plotting.subplots(width=-3.0), ValueError, "width"),
    ("subplots nrows 0", lambda: plotting.subplots(nrows=0), ValueError, "nrows"),
    ("subplots aspect < 0", lambda: plotting.subplots(aspect=-1), ValueError, "aspect"),
    # --- qlab.seed_model --------------------------------------------------------------------------
    ("seed train mode", lambda: seed_model.train(mode="wrong", steps=1), ValueError, "mode"),
    ("seed train optimizer", lambda: seed_model.train(optimizer="lamb", steps=1), ValueError, "optimizer"),
    ("seed train steps 0", lambda: seed_model.train(steps=0), ValueError, "steps"),
    ("seed train precision", lambda: seed_model.train(steps=1, precision="bf16"), ValueError, "precision"),
    ("seed train eps 0", lambda: seed_model.train(steps=1, eps=0.0), ValueError, "eps"),
    ("seed train bits 1", lambda: seed_model.train(steps=1, bits=1), ValueError, "bits"),
    ("SeedLinear fp16 str", lambda: seed_model.SeedLinear(4, 4, fp16="yes"), TypeError, "fp16"),
    ("seed train lr < 0", lambda: seed_model.train(steps=1, lr=-1.0), ValueError, "lr"),
    ("seed train loss_scale 0", lambda: seed_model.train(steps=1, loss_scale=0), ValueError, "loss_scale"),
    (
        "seed train microbatches 0",
        lambda: seed_model.train(steps=1, microbatches=0),
        ValueError,
        "microbatches",
    ),
    ("seed train watch typo", lambda: seed_model.train(steps=1, watch="blocks.0.fc3"), ValueError, "watch"),
    (
        "seed train steps over the bound",
        lambda: seed_model.train(steps=seed_model.MAX_STEPS + 1),
        ValueError,
        "steps",
    ),
    (
        "seed train microbatches over the bound",
        lambda: seed_model.train(steps=1, microbatches=seed_model.MAX_MICROBATCHES + 1),
        ValueError,
        "microbatches",
    ),
    (
        "seed train depth over the bound",
        lambda: seed_model.train(steps=1, depth=seed_model.MAX_DEPTH + 1),
        ValueError,
        "depth",
    ),
    ("seed train width 2**62", lambda: seed_model.train(steps=1, width=2**62), ValueError, "width"),
    ("seed train vocab 2**62", lambda: seed_model.train(steps=1, vocab=2**62), ValueError, "vocab"),
    ("seed train tokens 2**62", lambda: seed_model.train(steps=1, tokens=2**62), ValueError, "tokens"),
    ("seed train batch 2**62", lambda: seed_model.train(steps=1, batch=2**62), ValueError, "batch"),
    ("seed train lr 1e300", lambda: seed_model.train(steps=1, lr=1e300), ValueError, "lr"),
    (
        "seed train loss_scale 1e300",
        lambda: seed_model.train(steps=1, loss_scale=1e300),
        ValueError,
        "loss_scale",
    ),
    ("seed train seed < 0", lambda: seed_model.train(steps=1, seed=-1), ValueError, "seed"),
    ("SeedTransformer width 2**62", lambda: seed_model.SeedTransformer(width=2**62), ValueError, "width"),
    ("SeedTransformer depth 2**62", lambda: seed_model.SeedTransformer(depth=2**62), ValueError, "depth"),
    ("seed_quantize bits 1", lambda: seed_model.seed_quantize(x32(), bits=1), ValueError, "bits"),
    ("SeedLinear mode", lambda: seed_model.SeedLinear(4, 4, mode="x"), ValueError, "mode"),
    ("SeedTransformer heads", lambda: seed_model.SeedTransformer(width=30, heads=4), ValueError, "heads"),
    ("permutation batch 0", lambda: seed_model.permutation_task_batch(0, 4, 8, gen()), ValueError, "batch"),
    (
        "permutation generator int",
        lambda: seed_model.permutation_task_batch(2, 4, 8, 7),
        TypeError,
        "generator",
    ),
    ("ddp_audit world_size 1", lambda: seed_model.ddp_audit(world_size=1), ValueError, "world_size"),
    (
        "ddp_audit steps over the bound",
        lambda: seed_model.ddp_audit(steps=seed_model.MAX_STEPS + 1),
        ValueError,
        "steps",
    ),
    # --- qlab.train: config -----------------------------------------------------------------------
    ("config task", lambda: C.TrainConfig(task="mnist"), ValueError, "task"),
    ("config recipe", lambda: C.TrainConfig(recipe="fp4"), ValueError, "recipe"),
    ("config compile str", lambda: C.TrainConfig(compile="yes"), TypeError, "compile"),
    (
        "config compile_mode",
        lambda: C.TrainConfig(compile=True, compile_mode="max-autotune"),
        ValueError,
        "expected one of: default, reduce-overhead",
    ),
    (
        "config compile_mode under DDP",
        lambda: C.TrainConfig(compile=True, compile_mode="reduce-overhead", nproc=2, batch_size=4),
        ValueError,
        "nproc=2",
    ),
    (
        "config compile_mode without compile",
        lambda: C.TrainConfig(compile_mode="reduce-overhead"),
        ValueError,
        "compile=True",
    ),
    ("config ablate unknown", lambda: C.TrainConfig(recipe="nvfp4", ablate=["sr"]), ValueError, "ablate"),
    ("config ablate on fp32", lambda: C.TrainConfig(ablate=["hadamard"]), ValueError, "ablate"),
    (
        "config ablate what the recipe lacks",
        lambda: C.TrainConfig(recipe="mxfp4_training", ablate=["2d_weight"]),
        ValueError,
        "does not use",
    ),
    ("config lr inf", lambda: C.TrainConfig(task="digits", lr=INF), ValueError, "lr"),
    ("config lr NaN", lambda: C.TrainConfig(task="digits", lr=NAN), ValueError, "lr"),
    ("config lr 0", lambda: C.TrainConfig(task="digits", lr=0), ValueError, "lr"),
    ("config lr str", lambda: C.TrainConfig(task="digits", lr="fast"), TypeError, "lr"),
    (
        "config weight_decay NaN",
        lambda: C.TrainConfig(task="digits", weight_decay=NAN),
        ValueError,
        "weight_decay",
    ),
    ("config weight_decay < 0", lambda: C.TrainConfig(weight_decay=-0.1), ValueError, "weight_decay"),
    ("config beta1 1.5", lambda: C.TrainConfig(beta1=1.5), ValueError, "beta1"),
    ("config beta2 1", lambda: C.TrainConfig(beta2=1.0), ValueError, "beta2"),
    ("config beta1 < 0", lambda: C.TrainConfig(beta1=-0.1), ValueError, "beta1"),
    ("config min_lr_ratio 2", lambda: C.TrainConfig(min_lr_ratio=2), ValueError, "min_lr_ratio"),
    ("config grad_clip 0", lambda: C.TrainConfig(grad_clip=0), ValueError, "grad_clip"),
    ("config grad_clip inf", lambda: C.TrainConfig(grad_clip=INF), ValueError, "grad_clip"),
    ("config steps 0", lambda: C.TrainConfig(steps=0), ValueError, "steps"),
    ("config steps float", lambda: C.TrainConfig(steps=1.5), TypeError, "steps"),
    (
        "config batch not divisible",
        lambda: C.TrainConfig(batch_size=10, grad_accum=3),
        ValueError,
        "batch_size",
    ),
    ("config heads", lambda: C.TrainConfig(heads=3, width=128), ValueError, "heads"),
    ("config seed str", lambda: C.TrainConfig(seed="abc"), TypeError, "seed"),
    ("config seed < 0", lambda: C.TrainConfig(seed=-1), ValueError, "seed"),
    ("config device", lambda: C.TrainConfig(device="tpu"), ValueError, "device"),
    ("config optimizer", lambda: C.TrainConfig(optimizer="lion"), ValueError, "optimizer"),
    ("config autocast", lambda: C.TrainConfig(autocast="fp8"), ValueError, "autocast"),
    (
        "config keep int value",
        lambda: C.TrainConfig(keep_high_precision={"mxfp8": 3}),
        TypeError,
        "keep_high_precision",
    ),
    (
        "config keep unknown recipe",
        lambda: C.TrainConfig(keep_high_precision={"mxfp9": "head"}),
        ValueError,
        "mxfp9",
    ),
    ("config keep int", lambda: C.TrainConfig(keep_high_precision=3), TypeError, "keep_high_precision"),
    ("config topk 0", lambda: C.TrainConfig(task="digits", topk=0), ValueError, "k"),
    ("config topk_keep int", lambda: C.TrainConfig(topk_keep=3), TypeError, "topk_keep"),
    ("config hidden 0", lambda: C.TrainConfig(hidden=[0]), ValueError, "hidden"),
    ("config resume without out_dir", lambda: C.TrainConfig(resume=True), ValueError, "resume"),
    ("config tied_head str", lambda: C.TrainConfig(tied_head="yes"), TypeError, "tied_head"),
    ("config warmup < 0", lambda: C.TrainConfig(warmup_steps=-1), ValueError, "warmup_steps"),
    ("config eval_every 0", lambda: C.TrainConfig(eval_every=0), ValueError, "eval_every"),
    (
        "config from_dict unknown key",
        lambda: C.TrainConfig.from_dict({"learning_rate": 1}),
        ValueError,
        "learning_rate",
    ),
    ("config from_dict list", lambda: C.TrainConfig.from_dict([]), TypeError, "config"),
    ("load_config override without =", lambda: C.load_config(overrides=["lr"]), ValueError, "key=value"),
    ("load_config bad YAML override", lambda: C.load_config(overrides=["lr=[1"]), ValueError, "-p lr"),
    (
        "load_config missing file",
        lambda: C.load_config("/nonexistent/qlab.yaml"),
        FileNotFoundError,
        "qlab.yaml",
    ),
    ("load_config overrides str", lambda: C.load_config(overrides="lr=1"), TypeError, "overrides"),
    (
        "build_model keep typo",
        lambda: L.build_model(C.TrainConfig(task="digits", recipe="mxfp8", keep_high_precision=["haed"])),
        ValueError,
        "haed",
    ),
    (
        "build_model first_block on the MLP",
        lambda: L.build_model(
            C.TrainConfig(task="digits", recipe="mxfp8", keep_high_precision="first_block")
        ),
        ValueError,
        "first_block",
    ),
    ("train of a dict", lambda: L.train({"task": "digits"}), TypeError, "TrainConfig"),
    ("resolve_device", lambda: session.resolve_device("tpu"), ValueError, "device"),
    ("resolve_device int", lambda: session.resolve_device(0), TypeError, "device"),
    ("session.start unknown notebook", lambda: session.start("99_nothing", {}), ValueError, "name"),
    (
        "session.start namespace list",
        lambda: session.start("02_welford_vs_naive_variance", []),
        TypeError,
        "namespace",
    ),
    (
        "read_checkpoint missing",
        lambda: L.read_checkpoint("/nonexistent/checkpoint.pt"),
        FileNotFoundError,
        "checkpoint",
    ),
    # --- qlab.train: data and models --------------------------------------------------------------
    ("Vocabulary of a list", lambda: D.Vocabulary(["a"]), TypeError, "characters"),
    ("Vocabulary encode unknown", lambda: D.Vocabulary("ab").encode("abz"), ValueError, "text"),
    ("Vocabulary encode bytes", lambda: D.Vocabulary("ab").encode(b"ab"), TypeError, "text"),
    ("digits val_fraction 1.5", lambda: D.digits(val_fraction=1.5), ValueError, "val_fraction"),
    ("digits seed list", lambda: D.digits(seed=[0]), TypeError, "seed"),
    ("unigram_entropy vocab 0", lambda: D.unigram_entropy(torch.tensor([0]), 0), ValueError, "vocab_size"),
    ("unigram_entropy id too large", lambda: D.unigram_entropy(torch.tensor([5]), 3), ValueError, "ids"),
    ("unigram_entropy floats", lambda: D.unigram_entropy(torch.ones(3), 3), TypeError, "ids"),
    ("CharGPT vocab 0", lambda: M.CharGPT(0), ValueError, "vocab_size"),
    ("CharGPT heads", lambda: M.CharGPT(10, width=30, heads=4), ValueError, "heads"),
    ("CharGPT tied_head str", lambda: M.CharGPT(10, tied_head="no"), TypeError, "tied_head"),
    ("MLP hidden empty", lambda: M.MLP(hidden=[]), TypeError, "hidden"),
    ("MLP hidden 0", lambda: M.MLP(hidden=[0]), ValueError, "hidden"),
    # --- qlab.notebooks, qlab.sweep ---------------------------------------------------------------
    ("resolve_notebook unknown", lambda: resolve_notebook("99"), ValueError, "notebook"),
    ("resolve_notebook int", lambda: resolve_notebook(2), TypeError, "notebook"),
    (
        "check_parameters unknown",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), {"bogus": 1}),
        ValueError,
        "bogus",
    ),
    (
        "check_parameters wrong type",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), {"n": "x"}),
        TypeError,
        "n",
    ),
    (
        "check_parameters NaN",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), {"kappa_max": NAN}),
        ValueError,
        "kappa_max",
    ),
    (
        "check_parameters inf",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), {"eps": INF}),
        ValueError,
        "eps",
    ),
    (
        "check_parameters bool as str",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), {"smoke": "yes"}),
        TypeError,
        "smoke",
    ),
    (
        "check_parameters list",
        lambda: check_parameters(resolve_notebook(NOTEBOOK), [1]),
        TypeError,
        "parameters",
    ),
    ("run_notebook timeout 0", lambda: run_notebook(NOTEBOOK, timeout=0), ValueError, "timeout"),
    ("run_notebook parameters list", lambda: run_notebook(NOTEBOOK, [1]), TypeError, "parameters"),
    ("run_notebook smoke str", lambda: run_notebook(NOTEBOOK, smoke="yes"), TypeError, "smoke"),
    ("point_slug str", lambda: point_slug("x"), TypeError, "parameters"),
    ("run_sweep jobs 0", lambda: run_sweep(NOTEBOOK, "grid.yaml", jobs=0), ValueError, "jobs"),
    # companions, loaded states, callbacks and sizes (categories the generated inputs of test_fuzz_api cover)
    (
        "load_quant_state history as a list",
        lambda: _delayed_layer().load_quant_state(
            {"scalers": {"input": {"history": [0.0] * 16, "scale": torch.ones(())}}}
        ),
        TypeError,
        "history",
    ),
    (
        "load_quant_state history of another length",
        lambda: _delayed_layer().load_quant_state(
            {"scalers": {"input": {"history": torch.zeros(3), "scale": torch.ones(())}}}
        ),
        ValueError,
        "history",
    ),
    *[
        (
            f"load_quant_state scale {bad}",
            lambda bad=bad: _delayed_layer().load_quant_state(
                {"scalers": {"input": {"history": torch.zeros(1024), "scale": torch.tensor(bad)}}}
            ),
            ValueError,
            "finite and positive",
        )
        for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-40)
    ],
    (
        "load_quant_state generator bytes",
        lambda: _delayed_layer().load_quant_state({"generators": {"cpu": torch.zeros(3)}}),
        TypeError,
        "generators",
    ),
    ("save_metrics vector", lambda: results.save_metrics("m", loss=torch.ones(3)), TypeError, "loss"),
    (
        "weight_gradients loss_fn not callable",
        lambda: probes.weight_gradients(tiny(), [x32(2, 8)], "mse"),
        TypeError,
        "loss_fn",
    ),
    (
        "mask_gradients class that matches nothing",
        lambda: sparse.mask_gradients(tiny(), 0.5, modules=[nn.Conv1d]),
        ValueError,
        "Conv1d",
    ),
    (
        "qdq fixed scale of another row count",
        lambda: Q.qdq(x32(4, 32), "fp8_e4m3_rowwise", scale=torch.ones(3)),
        ValueError,
        "scale",
    ),
    (
        "qdq fixed scale on meta",
        lambda: Q.qdq(x32(4, 32), "fp8_e4m3", scale=torch.ones((), device="meta")),
        ValueError,
        "scale",
    ),
    (
        "nvfp4_block_scales global of several values",
        lambda: scaling.nvfp4_block_scales(torch.ones(4, 2), torch.ones(2)),
        ValueError,
        "global_scale",
    ),
    ("hadamard_matrix beyond memory", lambda: scaling.hadamard_matrix(2**40), ValueError, "size"),
    ("QuantLinear beyond memory", lambda: qnn.QuantLinear(2**31, 2**31), ValueError, "in_features"),
    (
        "layer_norm weight on meta",
        lambda: numerics.layer_norm(x32(2, 8), (8,), torch.ones(8, device="meta")),
        ValueError,
        "weight",
    ),
]


def _delayed_layer():
    return qnn.QuantLinear(8, 8, recipe="fp8_delayed")


def test_the_table_is_large_and_its_ids_unique():
    ids = [row[0] for row in CASES]
    assert len(ids) >= 200, len(ids)
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})


@pytest.mark.parametrize("call, error, argument", [row[1:] for row in CASES], ids=[row[0] for row in CASES])
def test_bad_input_is_refused_clearly(call, error, argument):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert argument in message, f"the message does not name {argument!r}: {message}"
    assert type(info.value) in (TypeError, ValueError, FileNotFoundError), type(info.value)
    innermost = Path(info.traceback[-1].path).resolve()
    assert QLAB_DIR in innermost.parents, f"raised from {innermost}, not from qlab's own checks"


# --- values that were silently wrong and are now right ---------------------------------------------------


def test_a_bare_string_is_one_pattern_everywhere():
    config = C.TrainConfig(task="digits", recipe="mxfp8", keep_high_precision={"mxfp8": "head"})
    assert config.keep_patterns() == ["head"]  # not the patterns h, e, a, d
    assert C.TrainConfig(keep_high_precision="head").keep_high_precision == ["head"]
    assert C.TrainConfig(topk_keep="head").topk_keep == ["head"]
    report = qnn.quantize_model(tiny(), "mxfp8", keep_high_precision="head")
    assert {row["name"]: row["action"] for row in report} == {"encoder": "quantized", "head": "kept"}
    assert probes.tensor_stats(torch.tensor([-2.0, 3.0]), stats="min") == {"min": -2.0}
    assert probes.ProbeSet(tiny(), stats="amax").stats == ("amax",)
    assert list(probes.ProbeSet(tiny(), modules="head").selected) == ["head"]


def test_the_default_keep_list_names_the_output_layer_of_either_model():
    for task, head in (("digits", "layers.2"), ("shakespeare", "head")):
        config = C.TrainConfig(task=task, recipe="mxfp8", layers=1, width=32, context=16)
        model = L.build_model(config, vocab_size=11 if task == "shakespeare" else None)
        kept = [name for name, module in model.named_modules() if type(module) is nn.Linear]
        assert kept == [head]


def test_a_seed_may_be_a_numpy_integer():
    numpy = pytest.importorskip("numpy")
    assert qnn.QuantLinear(4, 4, seed=numpy.int64(3)).seed == 3


# --- the value checks: one reduction instead of an elementwise bool copy ----------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_and_nan_checks_agree_with_torchs_elementwise_tests(dtype, threads, monkeypatch):
    """checks.all_finite / holds_nan (min/max reductions) against torch.isfinite(x).all() and
    torch.isnan(x).any() with one special value at the start, the middle, the end and inside a vector
    tail, for lengths around the vector widths and beyond a thread's share; also on a strided view."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in [*range(1, 70), 4095, 4097, 65553]:
            for position in sorted({0, n // 2, n - 1, max(0, n - 17)}):
                for special in (NAN, INF, -INF, None):
                    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
                    if special is not None:
                        x[position] = special
                    assert checks.all_finite(x) == bool(torch.isfinite(x).all()), (n, position, special)
                    assert checks.holds_nan(x) == bool(torch.isnan(x).any()), (n, position, special)
    finally:
        torch.set_num_threads(previous)
    view = torch.randn(64, 33, dtype=dtype)[:, 1:]
    assert checks.all_finite(view) and not checks.holds_nan(view)
    view[5, 7] = NAN
    assert not checks.all_finite(view) and checks.holds_nan(view)
    empty = torch.empty(0, 3, dtype=dtype)
    assert checks.all_finite(empty) and not checks.holds_nan(empty)


def test_int8_qdq_refuses_an_inf_at_the_end_of_a_large_tensor():
    x = torch.randn(2048, 512)
    x[-1, -1] = INF
    for spec in ("int8", Q.IntSpec(granularity="axis")):
        with pytest.raises(ValueError, match="no inf or NaN encoding"):
            Q.qdq(x, spec)
