"""Inputs at the edges of qlab.scaling, qlab.synthetic, qlab.ablation and qlab.seed_model: ranges wider
than float32, one-value factors of any shape, refused amaxes, the default dtype, zero products, shared
and keyword-called layers, and the names and ids the seed model accepts.

References are exact fractions (float32 rounding written out here, with an unbounded exponent), float64
autograd, or values derived by hand in the test."""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import pytest
import torch

from qlab import ablation, scaling, seed_model, synthetic
from qlab.recipe import get_recipe


@pytest.fixture(autouse=True)
def eager_only(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")


def round32(value: Fraction) -> Fraction:
    """``value`` rounded to float32's 24-bit significand, ties to even, with an unbounded exponent
    (subnormals below 2^-126)."""
    if value == 0:
        return Fraction(0)
    sign, magnitude = (1 if value > 0 else -1), abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:  # now 2^exponent ≤ magnitude < 2^(exponent+1)
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, -126) - 23)
    return sign * round(magnitude / quantum) * quantum  # round() on a Fraction: half to even


def exact(t: torch.Tensor) -> list[Fraction]:
    return [Fraction(v) for v in t.double().reshape(-1).tolist()]


# --- scaling.int_affine_parameters --------------------------------------------------------------------


def affine_reference(lo: float, hi: float, qmin: int, qmax: int) -> tuple[Fraction, Fraction]:
    """The documented formula, every step rounded to float32 (inputs are float32 values)."""
    lo, hi = min(Fraction(lo), Fraction(0)), max(Fraction(hi), Fraction(0))
    scale = round32(round32(hi - lo) / (qmax - qmin))
    zero_point = qmin - round(round32(lo / scale))
    return scale, min(max(zero_point, qmin), qmax)


@pytest.mark.parametrize(
    "lo, hi, qmin, qmax",
    [
        (-3e38, 3e38, 0, 255),  # width 6e38 > FLT_MAX ≈ 3.4e38
        (-3e38, 2.9e38, 0, 255),
        (-2.5e38, 3.3e38, -128, 127),
        (-3.4e38, 3.4e38, 0, 15),
        (-3.0, 5.1, 0, 255),  # ordinary ranges: the same formula
        (-1e-3, 7e2, -8, 7),
    ],
)
def test_int_affine_parameters_follow_the_formula_beyond_float32s_largest_width(lo, hi, qmin, qmax):
    lo32, hi32 = torch.tensor([lo]), torch.tensor([hi])  # float32
    scale, zero_point = scaling.int_affine_parameters(lo32, hi32, qmin, qmax)
    expected_scale, expected_zero_point = affine_reference(lo32.item(), hi32.item(), qmin, qmax)
    assert scale.dtype == zero_point.dtype == torch.float32
    assert exact(scale) == [expected_scale]
    assert exact(zero_point) == [expected_zero_point]


def test_int_affine_parameters_of_minus_and_plus_3e38_over_255_levels():
    scale, zero_point = scaling.int_affine_parameters(torch.tensor([-3e38]), torch.tensor([3e38]), 0, 255)
    width = 2 * Fraction(float(torch.tensor(3e38)))  # exact: ±3e38 as float32
    assert exact(scale) == [round32(round32(width) / 255)]
    assert float(scale) == pytest.approx(6e38 / 255, rel=1e-6)
    assert exact(zero_point) == [Fraction(128)]  # −(−127.5) rounds half to even: 128


def test_int_affine_parameters_keep_the_fallback_where_no_float32_scale_exists():
    big = torch.finfo(torch.float32).max
    # one level: a scale of 2·FLT_MAX; an infinite or NaN bound: no range
    for lo, hi, qmin, qmax in ((-big, big, 0, 1), (-math.inf, 1.0, 0, 255), (-1.0, math.nan, -8, 7)):
        scale, zero_point = scaling.int_affine_parameters(torch.tensor([lo]), torch.tensor([hi]), qmin, qmax)
        assert scale.tolist() == [1.0] and zero_point.tolist() == [float(qmin)], (lo, hi)


# --- scaling: per-tensor factors of any one-value shape -----------------------------------------------

E4M3_ONE_THIRD = Fraction(11, 32)  # 1/3 = 10.67·2^-5: E4M3 (3 mantissa bits) rounds it to 11·2^-5
E4M3_TWO_THIRDS = Fraction(11, 16)
E4M3_ONE_SIXTH = Fraction(11, 64)


@pytest.mark.parametrize("factor_shape", [(), (1,), (1, 1), (1, 1, 1)])
def test_one_value_factors_of_any_shape_keep_the_shape_of_the_blocks(factor_shape):
    def factor(value):
        return torch.tensor(value).reshape(factor_shape)

    amax = torch.tensor([1.0, 2.0])
    # amax / 6 / 0.5 = 1/3, 2/3
    scales = scaling.nvfp4_block_scales(amax, factor(0.5))
    assert scales.shape == (2,) and exact(scales) == [E4M3_ONE_THIRD, E4M3_TWO_THIRDS]
    # amax · fl(1 · fl(1/6)) = 1/6, 1/3 (to float32 first)
    nvidia = scaling.nvfp4_block_scales_nvidia(amax, factor(1.0))
    assert nvidia.shape == (2,) and exact(nvidia) == [E4M3_ONE_SIXTH, E4M3_ONE_THIRD]
    # 1 / (s · 0.25): exact powers of two
    inverse = scaling.nvfp4_element_inverse(torch.tensor([0.5, 2.0]), factor(0.25))
    assert inverse.shape == (2,) and inverse.tolist() == [8.0, 2.0]
    # fl(fl(s · amax) · fl(1/2688))
    blocks = torch.tensor([1.0, 2.0])
    multiplier = scaling.nvfp4_dequantize_multiplier(blocks, factor(2688.0))
    rcp = round32(Fraction(1, 2688))
    assert multiplier.shape == (2,)
    assert exact(multiplier) == [round32(round32(s * 2688) * rcp) for s in (Fraction(1), Fraction(2))]
    # a single block keeps its own shape too
    assert scaling.nvfp4_block_scales(torch.tensor(1.0), factor(0.5)).shape == ()


def test_one_value_factors_still_refuse_several_values():
    with pytest.raises(ValueError, match="global_scale must hold one value"):
        scaling.nvfp4_block_scales(torch.ones(4), torch.ones(1, 2))


# --- scaling.DelayedScaling.observe -------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, error, words",
    [
        (torch.tensor(True), TypeError, "amax must hold real numbers"),
        (torch.tensor(3.0 + 1.0j), TypeError, "amax must hold real numbers"),
        (torch.tensor(-2.0), ValueError, "amax must be ≥ 0"),
        (torch.tensor([-0.5]), ValueError, "amax must be ≥ 0"),
        (torch.tensor(-3, dtype=torch.int32), ValueError, "amax must be ≥ 0"),
        (torch.empty((), dtype=torch.bool, device="meta"), TypeError, "amax must hold real numbers"),
        ([1.0], TypeError, "amax"),
    ],
)
def test_delayed_scaling_refuses_amaxes_that_are_not_real_magnitudes(amax, error, words):
    ds = scaling.DelayedScaling("e4m3", history_len=2)
    with pytest.raises(error, match=words):
        ds.observe(amax)
    assert ds.step().item() == 1.0 and ds.history.tolist() == [0.0, 0.0]  # nothing entered the history


def test_delayed_scaling_takes_integer_and_overflowed_amaxes():
    ds = scaling.DelayedScaling("e4m3", history_len=1)
    ds.observe(torch.tensor(4, dtype=torch.int64))
    assert ds.step().item() == 448 / 4
    for overflowed in (math.nan, math.inf):  # what a step that overflowed measures: the scale stays
        ds.observe(torch.tensor(overflowed))
        assert ds.step().item() == 448 / 4


# --- the default dtype ------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def test_float32_results_whatever_the_default_dtype():
    draws = {
        kind: synthetic.activations(kind, (6, 16), torch.Generator().manual_seed(3), outlier_channels=3)
        for kind in synthetic.DISTRIBUTIONS
    }
    operands = ablation.synthetic_operands(8, 16, 4, seed=2)
    with default_dtype(torch.float64):
        for kind, expected in draws.items():
            got = synthetic.activations(kind, (6, 16), torch.Generator().manual_seed(3), outlier_channels=3)
            assert got.dtype == torch.float32, kind
            assert torch.equal(got, expected), kind  # the same seed, the same bytes
        for got, expected in zip(ablation.synthetic_operands(8, 16, 4, seed=2), operands):
            assert got.dtype == torch.float32 and torch.equal(got, expected)
        ds = scaling.DelayedScaling()
        assert ds.scale.dtype == torch.float32
        ds.observe(2.0)
        assert ds.step().dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_student_t3_is_the_standard_t_with_3_degrees_of_freedom():
    """Unit scale, not unit deviation: the median of |t₃| is its 75th percentile, found here from t₃'s
    closed-form CDF F(t) = 1/2 + (t/(√3(1 + t²/3)) + atan(t/√3))/π by bisection (≈ 0.7649; a unit-
    variance t₃, t/√3, would give 0.4416)."""

    def cdf(t):
        return 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi

    low, high = 0.0, 2.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < 0.75 else (low, middle)
    draws = synthetic.activations("student_t3", (200_000,), torch.Generator().manual_seed(0))
    # the sample median's standard error here is about 0.002
    assert draws.abs().median().item() == pytest.approx(low, abs=0.01)


# --- ablation.gemm_errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["bf16", "fp8_tensorwise", "nvfp4"])
def test_gemm_errors_of_zero_products_are_zero(preset):
    generator = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*shape, generator=generator) for shape in ((16, 32), (16, 32), (16, 16)))
    zero_x = ablation.gemm_errors(preset, torch.zeros_like(x), w, dy)
    assert zero_x["fprop"] == 0.0 and zero_x["wgrad"] == 0.0
    assert 0 <= zero_x["dgrad"] < 0.5  # a product that is not zero: its ordinary relative error
    zero_dy = ablation.gemm_errors(preset, x, w, torch.zeros_like(dy))
    assert zero_dy["dgrad"] == 0.0 and zero_dy["wgrad"] == 0.0


def test_gemm_errors_of_a_zero_product_that_quantization_breaks_are_infinite():
    """x·wᵀ = 1 + 2^-10 − (1 + 2^-10) = 0 exactly; E4M3 with scale 448/amax puts 1·scale ≈ 447.6 at 448,
    and 2^-10·scale ≈ 0.437 at 0.4375 (7·2^-4): the quantized product is not zero."""
    x = torch.tensor([[1.0, 2.0**-10, 1.0 + 2.0**-10]])
    w = torch.tensor([[1.0, 1.0, -1.0]])
    dy = torch.tensor([[1.0]])
    errors = ablation.gemm_errors("fp8_tensorwise", x, w, dy)
    assert errors["fprop"] == math.inf
    assert math.isfinite(errors["dgrad"]) and math.isfinite(errors["wgrad"])


def test_gemm_errors_take_presets_without_the_environments_backward_override(monkeypatch):
    x, w, dy = ablation.synthetic_operands(32, 32, 16, seed=1)
    plain = ablation.gemm_outputs(get_recipe("nvfp4", backward_override=None), x, w, dy)
    overridden = ablation.gemm_outputs(get_recipe("nvfp4", backward_override="high_precision"), x, w, dy)
    assert not torch.equal(plain["dgrad"], overridden["dgrad"])  # the override would show
    monkeypatch.setenv("QLAB_BACKWARD_OVERRIDE", "high_precision")
    by_name = ablation.gemm_outputs("nvfp4", x, w, dy)
    for gemm in ablation.GEMMS:
        assert torch.equal(by_name[gemm], plain[gemm]), gemm
    errors = ablation.gemm_errors("nvfp4", x, w, dy)
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE")
    assert errors == ablation.gemm_errors("nvfp4", x, w, dy)


# --- ablation.capture_operands ----------------------------------------------------------------------


def no_hooks_left(module):
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def test_capture_operands_of_a_layer_called_three_times():
    """h = L(x₁), y = L(tanh h) + 3·L(x₂), loss = Σ y²: three calls of one Linear, in float64. Each call's
    rows come in call order with their own output gradient, so dyᵀx is autograd's weight gradient."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 6, bias=False).double()
    x1, x2 = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)

    def step():
        hidden = torch.tanh(layer(x1))
        y = torch.cat([layer(hidden).reshape(-1, 6), 3 * layer(x2)])
        y.square().sum().backward()

    captured = ablation.capture_operands(layer, step)
    assert no_hooks_left(layer)
    x, weight, dy = captured[""]
    assert x.shape == (6 + 6 + 5, 6) and dy.shape == (17, 6) and x.dtype == dy.dtype == torch.float32
    # the inputs, recomputed here
    w = layer.weight.detach()
    h = x1.reshape(6, 6) @ w.T
    assert torch.allclose(x.double(), torch.cat([x1.reshape(6, 6), torch.tanh(h), x2]), rtol=1e-6, atol=0)
    # the output gradients by hand: y₂ = L(tanh h), y₃ = 3·L(x₂), loss = Σ y²
    dy2 = 2 * (torch.tanh(h) @ w.T)
    dy3 = 3 * 2 * (3 * x2 @ w.T)
    dy1 = (dy2 @ w) * (1 - torch.tanh(h) ** 2)
    assert torch.allclose(dy.double(), torch.cat([dy1, dy2, dy3]), rtol=1e-6, atol=1e-12)
    # dW = dyᵀ·x over the calls: autograd's float64 gradient, up to the copies' float32 rounding
    assert torch.allclose(dy.double().T @ x.double(), layer.weight.grad, rtol=1e-5, atol=1e-9)
    assert torch.equal(weight, w.float())


def test_capture_operands_of_a_layer_called_with_a_keyword_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False))
    x = torch.randn(5, 4)

    def step():
        model[0](input=x).sum().backward()

    x_got, _, dy_got = ablation.capture_operands(model, step)["0"]
    assert torch.equal(x_got, x) and torch.equal(dy_got, torch.ones(5, 3))
    assert no_hooks_left(model[0])


def test_capture_operands_leave_out_calls_no_gradient_reached():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2, bias=False)
    used, unused = torch.randn(3, 4), torch.randn(7, 4)

    def step():
        with torch.no_grad():
            layer(unused)
        layer(unused * 2)  # computed, never part of the loss
        layer(used).sum().backward()

    x, _, dy = ablation.capture_operands(layer, step)[""]
    assert torch.equal(x, used) and torch.equal(dy, torch.ones(3, 2))
    assert ablation.capture_operands(layer, lambda: layer(used)) == {}  # no backward: no operands


def test_capture_operands_name_a_layer_called_without_a_tensor_input():
    class PairLinear(torch.nn.Linear):
        def forward(self, pair):
            return super().forward(pair[0])

    model = torch.nn.Sequential(PairLinear(4, 2))
    with pytest.raises(ValueError, match="'0'"):
        ablation.capture_operands(model, lambda: model((torch.ones(1, 4), None)))
    assert no_hooks_left(model[0])


# --- seed_model -------------------------------------------------------------------------------------

SMALL = dict(steps=1, batch=2, tokens=8, vocab=8, width=16, depth=1)


@pytest.mark.parametrize("watch, audit", [("head", True), ("blocks.0", False), ("embed", True), ("", False)])
def test_train_watches_only_seed_linear_layers(watch, audit):
    with pytest.raises(ValueError, match="watch must name a SeedLinear layer") as raised:
        seed_model.train(watch=watch, audit=audit, **SMALL)
    for name in ("blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2"):
        assert name in str(raised.value)


def test_train_watches_any_seed_linear_layer():
    frame = seed_model.train(watch="blocks.0.fc2", **SMALL)
    assert len(frame) == 1 and frame.final_norm.iloc[0] > 0 and math.isfinite(frame.inside_norm.iloc[0])


def tiny_transformer():
    return seed_model.SeedTransformer(vocab=8, width=16, depth=1, tokens=6, mode="corrected")


@pytest.mark.parametrize(
    "ids, error, words",
    [
        (torch.zeros(2, 7, dtype=torch.long), ValueError, "at most 6 tokens"),
        (torch.full((2, 3), 8), ValueError, r"\[0, 8\).*from 8 to 8"),
        (torch.tensor([[0, -1, 2]]), ValueError, r"\[0, 8\).*from -1 to 2"),
        (torch.zeros(6, dtype=torch.long), ValueError, "shape"),
        (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "shape"),
        (torch.zeros(2, 3), TypeError, "ids"),
        (torch.zeros(2, 3, dtype=torch.bool), TypeError, "ids"),
        ([[0, 1]], TypeError, "ids"),
    ],
)
def test_seed_transformer_refuses_ids_it_cannot_embed(ids, error, words):
    with pytest.raises(error, match=words):
        tiny_transformer()(ids)


def test_seed_transformer_takes_int32_and_int64_ids_up_to_its_length():
    model = tiny_transformer()
    ids = torch.tensor([[0, 7, 3, 1, 5, 2], [7, 7, 0, 0, 4, 6]])
    logits = model(ids)
    assert logits.shape == (2, 6, 8)
    assert torch.equal(model(ids.int()), logits)
    assert model(ids[:, :3]).shape == (2, 3, 8)
