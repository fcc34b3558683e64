"""qlab.nn: QuantLinear's three GEMMs, backward overrides, wgrad delivery, fake_quant, model conversion.

References: torch.autograd.gradcheck in float64; nn.Linear / F.linear and autograd through them;
the operand table of qlab.recipe's docstring written out below per preset (each operand qdq'd
along its own GEMM's reduction axis: fprop x −1, W −1; dgrad dy −1, W 0; wgrad dy 0, x 0) and
multiplied at "highest" float32 matmul precision; torch's float8 casts for delayed scaling;
torch.fake_quantize_per_tensor_affine for the clipped straight-through estimator; the wgrad
delivery table of qlab.nn's docstring (docs/reference.md §4). Bits are compared exactly everywhere: the
references run the same float32 GEMMs on the same operands, so no tolerance is needed. The only
tolerances are in the float64 gradcheck of QuantLinear, whose GEMM runs in float32 (see there).
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from qlab import quantize as Q
from qlab.nn import QuantLinear, fake_quant, quantize_model, unquantize_model
from qlab.quantize import BlockwiseSpec, IntSpec, MXSpec, NVFP4Spec, TensorwiseSpec, qdq
from qlab.recipe import get_recipe

TOKENS, IN_FEATURES, OUT_FEATURES = 32, 64, 48  # N, K, M; M = 48 pads MX blocks of 32 along dgrad's axis


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE", raising=False)


@pytest.fixture(autouse=True)
def highest_precision():
    """The references multiply at the precision QuantLinear documents ("highest")."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


# --- references ------------------------------------------------------------------------------------

E4M3, E5M2 = TensorwiseSpec("e4m3"), TensorwiseSpec("e5m2")
MX8 = MXSpec("e4m3", mode="rceil")
INT8_AXIS = IntSpec(8, granularity="axis")
# The spec of every GEMM operand per preset (qlab.recipe's preset definitions, written out by hand
# with the backward roles' fallback to their forward role already applied).
OPERANDS = {
    "bf16": dict(
        input=None,
        weight=None,
        dgrad_grad_output=None,
        dgrad_weight=None,
        wgrad_grad_output=None,
        wgrad_input=None,
    ),
    "fp8_tensorwise": dict(
        input=E4M3,
        weight=E4M3,
        dgrad_grad_output=E5M2,
        dgrad_weight=E4M3,
        wgrad_grad_output=E5M2,
        wgrad_input=E4M3,
    ),
    "mxfp8": dict(
        input=MX8, weight=MX8, dgrad_grad_output=MX8, dgrad_weight=MX8, wgrad_grad_output=MX8, wgrad_input=MX8
    ),
    "nvfp4": dict(
        input=NVFP4Spec(),
        weight=NVFP4Spec(block_2d=True),
        dgrad_grad_output=NVFP4Spec(rounding="stochastic"),
        dgrad_weight=NVFP4Spec(block_2d=True),
        wgrad_grad_output=NVFP4Spec(hadamard=True, rounding="stochastic"),
        wgrad_input=NVFP4Spec(hadamard=True),
    ),
    "int8_per_token": dict(
        input=INT8_AXIS,
        weight=INT8_AXIS,
        dgrad_grad_output=None,
        dgrad_weight=INT8_AXIS,
        wgrad_grad_output=None,
        wgrad_input=INT8_AXIS,
    ),
    "fp8_blockwise": dict(
        input=BlockwiseSpec("e4m3"),
        weight=BlockwiseSpec("e4m3", block_2d=True),
        dgrad_grad_output=BlockwiseSpec("e4m3"),
        dgrad_weight=BlockwiseSpec("e4m3", block_2d=True),
        wgrad_grad_output=BlockwiseSpec("e4m3"),
        wgrad_input=BlockwiseSpec("e4m3"),
    ),
    "mxfp8_2d": dict(
        input=MX8,
        weight=MXSpec("e4m3", mode="rceil", block_2d=True),
        dgrad_grad_output=MX8,
        dgrad_weight=MXSpec("e4m3", mode="rceil", block_2d=True),
        wgrad_grad_output=MX8,
        wgrad_input=MX8,
    ),
    "mxfp4_training": dict(
        input=None,
        weight=None,
        dgrad_grad_output=MXSpec("e2m1", rounding="stochastic"),
        dgrad_weight=MXSpec("e2m1", rounding="stochastic"),
        wgrad_grad_output=MXSpec("e2m1", rounding="stochastic", hadamard=True),
        wgrad_input=MXSpec("e2m1", rounding="stochastic", hadamard=True),
    ),
}
QUANTIZED = [
    "fp8_tensorwise",
    "mxfp8",
    "nvfp4",
    "int8_per_token",
    "fp8_blockwise",
    "mxfp8_2d",
    "mxfp4_training",
]
OVERRIDES = [None, "high_precision", "dequantized"]


def assert_same_bits(actual, expected):
    assert actual is not None
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.detach().float().reshape(-1), expected.detach().float().reshape(-1)
    bad = a.view(torch.int32) != e.view(torch.int32)
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. {a[bad][:5].tolist()} vs {e[bad][:5].tolist()}"


def operand(t, spec, axis, generator=None):
    """t quantize→dequantized by spec with blocks/scales along axis (t itself where spec is None)."""
    if spec is None:
        return t
    return qdq(t, spec, axis, generator=generator if spec.rounding == "stochastic" else None)


def make_data(seed=0, tokens=TOKENS, dtype=torch.float32):
    """x (N, K), W (M, K), b (M,), dy (N, M) with a few large values so that scales matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, IN_FEATURES, generator=g) * torch.logspace(-2, 2, IN_FEATURES)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) * 0.1
    bias = torch.randn(OUT_FEATURES, generator=g)
    dy = torch.randn(tokens, OUT_FEATURES, generator=g) * 1e-3
    return x.to(dtype), weight.to(dtype), bias.to(dtype), dy.to(dtype)


def make_layer(recipe, weight, bias, **options):
    layer = QuantLinear(
        weight.shape[1], weight.shape[0], bias=bias is not None, recipe=recipe, dtype=weight.dtype, **options
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def reference_forward(name, x, weight, bias):
    specs = OPERANDS[name]
    y = operand(x, specs["input"], -1) @ operand(weight, specs["weight"], -1).T
    return y if bias is None else y + bias


def reference_gradients(name, override, x, weight, dy, need_x=True, need_w=True, seed=0):
    """(dx, dW) per docs/reference.md §3 and the recipe's operand table.

    Stochastic rounding: QuantLinear draws from torch.Generator().manual_seed(seed), dgrad's dy
    first, then wgrad's dy (the order the backward GEMMs run in).
    """
    specs = OPERANDS[name]
    generator = torch.Generator().manual_seed(seed)
    dx = dw = None
    if override == "high_precision":
        dx, dw = dy @ weight, dy.T @ x
    elif override == "dequantized":
        x_q, w_q = operand(x, specs["input"], -1), operand(weight, specs["weight"], -1)
        dx, dw = dy @ w_q, dy.T @ x_q
    else:
        if need_x:
            dx = operand(dy, specs["dgrad_grad_output"], -1, generator) @ operand(
                weight, specs["dgrad_weight"], 0, generator
            )
        if need_w:
            dw = operand(dy, specs["wgrad_grad_output"], 0, generator).T @ operand(
                x, specs["wgrad_input"], 0, generator
            )
    return (dx if need_x else None), (dw if need_w else None)


def requires_grad_cases():
    """(x, weight, bias) requires_grad flags with at least one True; bias None = a layer without bias."""
    with_bias = [c for c in itertools.product([True, False], repeat=3) if any(c)]
    without_bias = [(*c, None) for c in itertools.product([True, False], repeat=2) if any(c)]
    return with_bias + without_bias


def case_id(case):
    x, w, b = case
    return f"x{int(x)}-w{int(w)}-" + ("nobias" if b is None else f"b{int(b)}")


# --- gradcheck in float64 (no quantization) ---------------------------------------------------------------


def linear_as_function(layer):
    """(x, weight, bias) -> layer(x) with the layer's parameters swapped for the given tensors."""

    def function(x, weight, bias=None):
        parameters = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
        return functional_call(layer, parameters, (x,))

    return function


def float64_inputs(x_shape, case, seed=0):
    needs_x, needs_w, needs_b = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64).requires_grad_(needs_x)
    weight = torch.randn(5, x_shape[-1], generator=g, dtype=torch.float64).requires_grad_(needs_w)
    if needs_b is None:
        return x, weight
    return x, weight, torch.randn(5, generator=g, dtype=torch.float64).requires_grad_(needs_b)


@pytest.mark.parametrize("x_shape", [(6, 8), (2, 3, 8)], ids=["2d", "3d"])
@pytest.mark.parametrize("case", requires_grad_cases(), ids=case_id)
def test_gradcheck_bf16_every_requires_grad_combination(x_shape, case):
    layer = QuantLinear(8, 5, bias=case[2] is not None, recipe="bf16", dtype=torch.float64)
    inputs = float64_inputs(x_shape, case)
    # a float64 layer multiplies in float64, so gradcheck's defaults apply
    assert torch.autograd.gradcheck(linear_as_function(layer), inputs)


def test_gradcheck_bf16_at_float64_precision():
    layer = QuantLinear(8, 5, recipe="bf16", dtype=torch.float64)
    assert torch.autograd.gradcheck(linear_as_function(layer), float64_inputs((6, 8), (True, True, True)))


# --- quantized recipes: forward, every override, every requires_grad combination ---------------------------


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("override", OVERRIDES, ids=str)
@pytest.mark.parametrize("case", requires_grad_cases(), ids=case_id)
def test_backward_produces_exactly_the_required_gradients(name, override, case):
    needs_x, needs_w, needs_b = case
    x, weight, bias, dy = make_data()
    layer = make_layer(
        get_recipe(name, backward_override=override), weight, None if needs_b is None else bias
    )
    layer.weight.requires_grad_(needs_w)
    if needs_b is not None:
        layer.bias.requires_grad_(needs_b)
    x = x.clone().requires_grad_(needs_x)

    y = layer(x)
    assert_same_bits(y, reference_forward(name, x.detach(), weight, None if needs_b is None else bias))
    y.backward(dy)

    dx, dw = reference_gradients(name, override, x.detach(), weight, dy, needs_x, needs_w)
    assert (x.grad is None) == (not needs_x)
    assert (layer.weight.grad is None) == (not needs_w)
    if needs_x:
        assert_same_bits(x.grad, dx)
    if needs_w:
        assert_same_bits(layer.weight.grad, dw)
    if needs_b is not None:
        assert (layer.bias.grad is None) == (not needs_b)
        if needs_b:
            assert_same_bits(layer.bias.grad, dy.sum(0))


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_override_is_autograd_through_the_straight_through_estimator(name):
    """x.grad, W.grad, b.grad = autograd of
    F.linear(x + (qdq(x) − x).detach(), W + (qdq(W) − W).detach(), b)."""
    x, weight, bias, dy = make_data(seed=1)
    specs = OPERANDS[name]
    layer = make_layer(get_recipe(name, backward_override="dequantized"), weight, bias)
    x_layer = x.clone().requires_grad_()
    layer(x_layer).backward(dy)

    x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (x, weight, bias))
    x_ste = x_ref + (operand(x_ref.detach(), specs["input"], -1) - x_ref).detach()
    w_ste = w_ref + (operand(w_ref.detach(), specs["weight"], -1) - w_ref).detach()
    F.linear(x_ste, w_ste, b_ref).backward(dy)

    assert_same_bits(x_layer.grad, x_ref.grad)
    assert_same_bits(layer.weight.grad, w_ref.grad)
    assert_same_bits(layer.bias.grad, b_ref.grad)


@pytest.mark.parametrize("name", QUANTIZED)
def test_high_precision_override_uses_the_original_operands(name):
    x, weight, bias, dy = make_data(seed=2)
    layer = make_layer(get_recipe(name, backward_override="high_precision"), weight, bias)
    x_layer = x.clone().requires_grad_()
    layer(x_layer).backward(dy)
    assert_same_bits(x_layer.grad, dy @ weight)
    assert_same_bits(layer.weight.grad, dy.T @ x)
    assert_same_bits(layer.bias.grad, dy.sum(0))


@pytest.mark.parametrize("name", QUANTIZED)
def test_default_backward_quantizes_each_operand_along_its_gemms_axis(name):
    """dx = qdq(dy, −1) @ qdq(W, 0); dW = qdq(dy, 0)ᵀ @ qdq(x, 0); y = qdq(x, −1) @ qdq(W, −1)ᵀ + b."""
    x, weight, bias, dy = make_data(seed=3)
    specs = OPERANDS[name]
    layer = make_layer(name, weight, bias, seed=7)
    x_layer = x.clone().requires_grad_()
    y = layer(x_layer)
    y.backward(dy)

    # stochastic rounding draws in GEMM order: dgrad's dy, dgrad's W, wgrad's dy, wgrad's x (where SR)
    generator = torch.Generator().manual_seed(7)
    dy_dgrad = operand(dy, specs["dgrad_grad_output"], -1, generator)
    w_dgrad = operand(weight, specs["dgrad_weight"], 0, generator)
    dy_wgrad = operand(dy, specs["wgrad_grad_output"], 0, generator)
    x_wgrad = operand(x, specs["wgrad_input"], 0, generator)
    assert_same_bits(y, (operand(x, specs["input"], -1) @ operand(weight, specs["weight"], -1).T) + bias)
    assert_same_bits(x_layer.grad, dy_dgrad @ w_dgrad)
    assert_same_bits(layer.weight.grad, dy_wgrad.T @ x_wgrad)
    assert_same_bits(layer.bias.grad, dy.sum(0))


def test_default_backward_differs_from_both_overrides():
    """The three backward behaviours are really different computations (guards the tests above)."""
    x, weight, bias, dy = make_data(seed=3)
    grads = {}
    for override in OVERRIDES:
        layer = make_layer(get_recipe("mxfp8", backward_override=override), weight, bias)
        x_layer = x.clone().requires_grad_()
        layer(x_layer).backward(dy)
        grads[override] = (x_layer.grad, layer.weight.grad)
    for a, b in itertools.combinations(OVERRIDES, 2):
        assert not torch.equal(grads[a][0], grads[b][0]), (a, b)
        assert not torch.equal(grads[a][1], grads[b][1]), (a, b)


def test_stochastic_rounding_draws_continue_across_steps():
    """The generator is seeded once per layer: the second backward draws the next numbers, not the
    first again."""
    x, weight, bias, dy = make_data(seed=4)
    specs = OPERANDS["nvfp4"]
    layer = make_layer("nvfp4", weight, bias, seed=3)
    generator = torch.Generator().manual_seed(3)
    step_grads = []
    for _ in range(2):
        x_layer = x.clone().requires_grad_()
        layer.weight.grad = None
        layer(x_layer).backward(dy)
        dy_dgrad = operand(dy, specs["dgrad_grad_output"], -1, generator)
        dy_wgrad = operand(dy, specs["wgrad_grad_output"], 0, generator)
        assert_same_bits(x_layer.grad, dy_dgrad @ operand(weight, specs["dgrad_weight"], 0))
        assert_same_bits(layer.weight.grad, dy_wgrad.T @ operand(x, specs["wgrad_input"], 0))
        step_grads.append(x_layer.grad)
    assert not torch.equal(step_grads[0], step_grads[1])  # same x and dy, different draws


@pytest.mark.parametrize("name", ["bf16", *QUANTIZED])
@pytest.mark.parametrize("override", OVERRIDES, ids=str)
def test_3d_input_equals_the_flattened_2d_result(name, override):
    x, weight, bias, dy = make_data(seed=5)
    recipe = get_recipe(name, backward_override=override)
    flat, batched = make_layer(recipe, weight, bias), make_layer(recipe, weight, bias)
    x2, x3 = x.clone().requires_grad_(), x.reshape(4, 8, IN_FEATURES).clone().requires_grad_()
    y2, y3 = flat(x2), batched(x3)
    assert y3.shape == (4, 8, OUT_FEATURES)
    assert_same_bits(y3.reshape(TOKENS, OUT_FEATURES), y2)
    y2.backward(dy)
    y3.backward(dy.reshape(4, 8, OUT_FEATURES))
    assert_same_bits(x3.grad.reshape(TOKENS, IN_FEATURES), x2.grad)
    assert_same_bits(batched.weight.grad, flat.weight.grad)
    assert_same_bits(batched.bias.grad, flat.bias.grad)
    assert_same_bits(y2, reference_forward(name, x, weight, bias))


# --- delayed scaling ---------------------------------------------------------------------------------


def fp8(t, element, scale):
    """TE's FP8 qdq with a given scale, by torch's own casts: cast(sat(t·scale)) · fl(1/scale)."""
    dtype, limit = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}[element]
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return (t * scale).clamp(-limit, limit).to(dtype).float() * (1.0 / scale.double()).float()


def float32_quotient(numerator, amax):
    """numerator / amax computed in float64, rounded once to float32 (correct rounding: 53 ≥ 2·24 + 2)."""
    return torch.tensor(numerator / float(amax), dtype=torch.float32)


def test_delayed_scaling_first_forward_uses_scale_one_then_the_amax_history():
    x1, weight, bias, dy = make_data(seed=6)
    x1 = x1 * 10  # some |x| > 448: with scale 1 they saturate
    x2 = make_data(seed=7)[0] * 2
    assert x1.abs().max() > 448 and x2.abs().max() < x1.abs().max()  # so history "max" ≠ "most_recent"
    layer = make_layer("fp8_delayed", weight, bias)
    assert set(layer.scalers) == {"input", "weight", "grad_output"}

    y1 = layer(x1.clone().requires_grad_())
    assert_same_bits(y1, (fp8(x1, "e4m3", 1.0) @ fp8(weight, "e4m3", 1.0).T) + bias)
    assert_same_bits(layer.scalers["input"].scale, float32_quotient(448.0, x1.abs().max()))
    assert_same_bits(layer.scalers["weight"].scale, float32_quotient(448.0, weight.abs().max()))
    assert_same_bits(layer.scalers["grad_output"].scale, torch.tensor(1.0))  # no backward yet

    y1.backward(dy)
    assert_same_bits(layer.scalers["grad_output"].scale, float32_quotient(57344.0, dy.abs().max()))

    # step 2 uses the scales from step 1's amaxes; afterwards the history max covers both steps
    scale_x, scale_w = layer.scalers["input"].scale.clone(), layer.scalers["weight"].scale.clone()
    y2 = layer(x2)
    assert_same_bits(y2, (fp8(x2, "e4m3", scale_x) @ fp8(weight, "e4m3", scale_w).T) + bias)
    assert_same_bits(
        layer.scalers["input"].scale, float32_quotient(448.0, max(x1.abs().max(), x2.abs().max()))
    )
    assert_same_bits(layer.scalers["weight"].scale, float32_quotient(448.0, weight.abs().max()))


def test_delayed_scaling_backward_uses_the_forwards_scales():
    x, weight, bias, dy = make_data(seed=6)
    layer = make_layer("fp8_delayed", weight, bias)
    x_layer = x.clone().requires_grad_()
    layer(x_layer).backward(dy)
    # step 1: every scale is still the initial 1 (x, W as in the forward; dy's first use)
    assert_same_bits(layer.weight.grad, fp8(dy, "e5m2", 1.0).T @ fp8(x, "e4m3", 1.0))
    assert_same_bits(x_layer.grad, fp8(dy, "e5m2", 1.0) @ fp8(weight, "e4m3", 1.0))


# --- wgrad delivery (qlab.nn's table, docs/reference.md §4) ---------------------------------------------

# fuse_wgrad_accumulation, delay_wgrad, weight has grad_added_to_main_grad → what backward returns to autograd
DELIVERY = [
    (False, False, False, "wgrad"),
    (False, False, True, "wgrad"),
    (False, True, False, None),
    (False, True, True, None),
    (True, False, False, None),
    (True, False, True, "dummy"),
    (True, True, False, None),
    (True, True, True, "dummy"),  # the corner where the reference system's modules disagreed
]
GARBAGE = 123.0  # a stale main_grad the first micro-batch must overwrite


def delivery_id(row):
    fuse, delay, flag, returned = row
    return f"fuse{int(fuse)}-delay{int(delay)}-flag{int(flag)}-returns_{returned}"


def reference_wgrad(name, x, dy):
    specs = OPERANDS[name]
    return operand(dy, specs["wgrad_grad_output"], 0).T @ operand(x, specs["wgrad_input"], 0)


def assert_grad_returned(weight, returned, wgrad_sum):
    if returned == "wgrad":
        assert_same_bits(weight.grad, wgrad_sum)
    elif returned == "dummy":
        assert_same_bits(weight.grad, torch.zeros_like(weight))
    else:
        assert weight.grad is None


@pytest.mark.parametrize("name", ["bf16", "fp8_tensorwise"])
@pytest.mark.parametrize("row", DELIVERY, ids=delivery_id)
def test_wgrad_delivery_table(name, row):
    fuse, delay, flag, returned = row
    _, weight, bias, _ = make_data(seed=8)
    batches = [make_data(seed=9)[::3], make_data(seed=10)[::3]]  # (x, dy) per micro-batch
    wgrads = [reference_wgrad(name, x, dy) for x, dy in batches]
    layer = make_layer(name, weight, bias, fuse_wgrad_accumulation=fuse, delay_wgrad=delay)
    layer.weight.main_grad = torch.full(weight.shape, GARBAGE)
    if flag:
        layer.weight.grad_added_to_main_grad = False
    written_now = fuse and not delay

    wgrad_so_far = [wgrads[0], wgrads[0] + wgrads[1]]
    bias_grad_so_far = [batches[0][1].sum(0), batches[0][1].sum(0) + batches[1][1].sum(0)]
    for i, (x, dy) in enumerate(batches):
        layer(x, is_first_microbatch=(i == 0)).backward(dy)
        assert_grad_returned(layer.weight, returned, wgrad_so_far[i])
        expected_main = wgrad_so_far[i] if written_now else torch.full(weight.shape, GARBAGE)
        assert_same_bits(layer.weight.main_grad, expected_main)
        if flag:
            assert layer.weight.grad_added_to_main_grad is written_now
        assert_same_bits(layer.bias.grad, bias_grad_so_far[i])  # bias gradients are plain autograd

    grad_before = None if layer.weight.grad is None else layer.weight.grad.clone()
    layer.backward_dw()
    wgrad_sum = wgrads[0] + wgrads[1]
    assert layer.weight.main_grad.dtype == torch.float32
    if fuse:
        assert_same_bits(layer.weight.main_grad, wgrad_sum)  # overwritten by micro-batch 1, then accumulated
        if grad_before is None:
            assert layer.weight.grad is None
        else:
            assert_same_bits(layer.weight.grad, grad_before)
    elif delay:
        assert_same_bits(layer.weight.grad, wgrad_sum)  # backward_dw sets, then accumulates into .grad
        assert_same_bits(layer.weight.main_grad, torch.full(weight.shape, GARBAGE))
    else:  # nothing was deferred: backward_dw changes nothing
        assert_same_bits(layer.weight.grad, wgrad_sum)
        assert_same_bits(layer.weight.main_grad, torch.full(weight.shape, GARBAGE))
    if flag:
        assert layer.weight.grad_added_to_main_grad is fuse


@pytest.mark.parametrize("delay", [False, True])
def test_fused_wgrad_accumulates_into_existing_main_grad_without_first_microbatch(delay):
    x, weight, bias, dy = make_data(seed=11)
    layer = make_layer("fp8_tensorwise", weight, bias, fuse_wgrad_accumulation=True, delay_wgrad=delay)
    layer.weight.main_grad = torch.full(weight.shape, GARBAGE)
    layer(x).backward(dy)
    layer.backward_dw()
    expected = torch.full(weight.shape, GARBAGE) + reference_wgrad("fp8_tensorwise", x, dy)
    assert_same_bits(layer.weight.main_grad, expected)


def test_fused_wgrad_of_a_weight_used_twice_in_the_first_micro_batch_is_its_whole_gradient():
    # is_first_microbatch=True resets main_grad once per step: a module called twice, or two layers
    # sharing one weight, each deliver their part (the second used to overwrite the first's)
    x, weight, bias, dy = make_data(seed=13)
    square, inputs = weight[:, : weight.shape[0]], x[:, : weight.shape[0]]
    plain = make_layer("bf16", square, bias)
    fused = make_layer("bf16", square, bias, fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.full(square.shape, GARBAGE)

    def twice(first, second, **flag):
        return second(torch.tanh(first(inputs, **flag)), **flag)

    (twice(plain, plain) * dy).sum().backward()
    (twice(fused, fused, is_first_microbatch=True) * dy).sum().backward()
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad, rtol=1e-6, atol=0)
    shared = make_layer("bf16", square, bias, fuse_wgrad_accumulation=True)
    shared.weight = fused.weight  # tied: one Parameter, two layers
    fused.weight.main_grad.fill_(GARBAGE)
    (twice(fused, shared, is_first_microbatch=True) * dy).sum().backward()
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("delay", [False, True])
def test_an_empty_first_micro_batch_resets_main_grad_and_leaves_grad_alone(delay):
    # an MoE expert that gets no tokens: its micro-batch sum is zero, and the step starts there
    x, weight, bias, dy = make_data(seed=14)
    layer = make_layer("fp8_tensorwise", weight, bias, fuse_wgrad_accumulation=True, delay_wgrad=delay)
    layer.weight.main_grad = torch.full(weight.shape, GARBAGE)
    layer(x[:0], is_first_microbatch=True).sum().backward()
    layer(x, is_first_microbatch=False).backward(dy)
    layer.backward_dw()
    assert_same_bits(layer.weight.main_grad, reference_wgrad("fp8_tensorwise", x, dy))
    assert layer.weight.grad is None


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_delayed_scaling_layer_used_twice_in_a_checkpointed_segment_refuses_to_guess(reentrant):
    from torch.utils.checkpoint import checkpoint

    x, weight, bias, _ = make_data(seed=15)
    layer = make_layer("fp8_delayed", weight[:, : weight.shape[0]], bias)  # square: used twice in a row
    once = x[:, : weight.shape[0]].clone().requires_grad_(True)
    checkpoint(layer, once, use_reentrant=reentrant).sum().backward()  # one use per segment: fine
    layer.zero_grad()
    twice = (x[:, : weight.shape[0]] * 100).requires_grad_(True)  # a larger amax: the scale rolls after use 1
    with pytest.raises(RuntimeError, match="ran 2 training forwards with 2 different scales"):
        checkpoint(lambda t: layer(torch.tanh(layer(t))), twice, use_reentrant=reentrant).sum().backward()


def test_load_quant_state_replaces_the_generators_a_state_saved_before_any_draw_lacks():
    # rolled back to a state saved before the first stochastic-rounding draw, the layer replays its
    # first step
    x, weight, bias, dy = make_data(seed=16)
    layer = make_layer("nvfp4", weight, bias)
    saved = layer.quant_state()
    layer(x).backward(dy)
    first = layer.weight.grad.clone()
    layer.zero_grad()
    layer.load_quant_state(saved)
    layer(x).backward(dy)
    assert_same_bits(layer.weight.grad, first)


def test_assigning_a_recipe_configures_the_layer_as_a_new_one():
    x, weight, bias, dy = make_data(seed=17)
    changed, fresh = make_layer("bf16", weight, bias), make_layer("fp8_delayed", weight, bias)
    changed.recipe = get_recipe("fp8_delayed")
    assert sorted(changed.scalers) == ["grad_output", "input", "weight"]
    for layer in (changed, fresh):
        layer(x).backward(dy)
    assert_same_bits(changed.weight.grad, fresh.weight.grad)
    with pytest.raises(ValueError, match="unknown recipe"):
        changed.recipe = "fp9"
    assert changed.recipe.name == "fp8_delayed"


def test_fused_wgrad_creates_a_float32_main_grad_for_bf16_weights():
    """main_grad holds the float32 GEMM result, not one rounded to the weight's bf16."""
    x, weight, bias, dy = make_data(seed=12, dtype=torch.bfloat16)
    layer = make_layer("bf16", weight, bias, fuse_wgrad_accumulation=True)
    assert getattr(layer.weight, "main_grad", None) is None
    layer(x).backward(dy)
    expected = dy.float().T @ x.float()
    assert_same_bits(layer.weight.main_grad, expected)
    assert not torch.equal(expected.bfloat16().float(), expected)  # rounding to bf16 would be visible
    assert layer.weight.grad is None


def test_delayed_wgrad_before_backward_dw_writes_nothing():
    x, weight, bias, dy = make_data(seed=13)
    layer = make_layer("fp8_tensorwise", weight, bias, delay_wgrad=True)
    x_layer = x.clone().requires_grad_()
    layer(x_layer).backward(dy)
    assert layer.weight.grad is None
    assert getattr(layer.weight, "main_grad", None) is None
    dx, _ = reference_gradients("fp8_tensorwise", None, x, weight, dy)
    assert_same_bits(x_layer.grad, dx)  # dgrad is not delayed
    layer.backward_dw()
    assert_same_bits(layer.weight.grad, reference_wgrad("fp8_tensorwise", x, dy))
    layer.backward_dw()  # the deferred list was consumed: a second call adds nothing
    assert_same_bits(layer.weight.grad, reference_wgrad("fp8_tensorwise", x, dy))


def test_delayed_wgrad_accumulates_into_an_existing_grad():
    x, weight, bias, dy = make_data(seed=14)
    layer = make_layer("bf16", weight, bias, delay_wgrad=True)
    previous = torch.randn(weight.shape)
    layer.weight.grad = previous.clone()
    layer(x).backward(dy)
    assert_same_bits(layer.weight.grad, previous)
    layer.backward_dw()
    assert_same_bits(layer.weight.grad, previous + dy.T @ x)


# --- fake_quant ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        E4M3,
        IntSpec(8),
        IntSpec(4, signed=False, symmetric=False),
        INT8_AXIS,
        MXSpec("e4m3"),
        MXSpec("e2m1"),
        NVFP4Spec(),
        NVFP4Spec(hadamard=True),
    ],
    ids=repr,
)
@pytest.mark.parametrize("axis", [-1, 0])
def test_fake_quant_identity_ste_passes_the_gradient_unchanged(spec, axis):
    x, _, _, _ = make_data(seed=15)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(16))
    x = x.requires_grad_()
    y = fake_quant(x, spec, axis)
    assert_same_bits(y, qdq(x.detach(), spec, axis))
    y.backward(upstream)
    assert_same_bits(x.grad, upstream)


def clipped_int_case():
    """uint8 asymmetric values in [−1.5, 253.5]: scale (253.5 + 1.5)/255 = 1, zero point 0 − round(−1.5) = 2,
    and 253.5 rounds (half to even) to 254, + 2 = 256 > 255: clipped. Everything else is in range."""
    g = torch.Generator().manual_seed(17)
    x = torch.rand(4, 32, generator=g) * 255.0 - 1.5
    x[0, 0], x[1, 5], x[3, 31] = -1.5, 253.5, 253.5
    x[2, 7], x[2, 8] = 252.5, 0.5  # ties that stay in range (252 + 2, 0 + 2)
    return x, IntSpec(8, signed=False, symmetric=False), x != 253.5


def in_range_int_case():
    """int8 symmetric with amax 127/8: scale 1/8 exactly, so x/scale and x·(1/scale) agree; nothing clips."""
    g = torch.Generator().manual_seed(18)
    x = torch.randn(4, 32, generator=g)
    x = x / x.abs().max() * (127 / 8)
    x[0, 0] = -127 / 8
    return x, IntSpec(8), torch.ones_like(x, dtype=torch.bool)


@pytest.mark.parametrize("make_case", [clipped_int_case, in_range_int_case])
def test_fake_quant_clipped_ste_matches_torch_fake_quantize(make_case):
    x, spec, expected_inside = make_case()
    q = Q.quantize(x, spec)
    scale = float(q.scales)
    zero_point = 0 if q.zero_point is None else int(q.zero_point)
    if spec.signed:
        fmt_min, fmt_max = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    else:
        fmt_min, fmt_max = 0, 2**spec.bits - 1
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(19))

    x_torch = x.clone().requires_grad_()
    y_torch = torch.fake_quantize_per_tensor_affine(x_torch, scale, zero_point, fmt_min, fmt_max)
    y_torch.backward(upstream)
    x_qlab = x.clone().requires_grad_()
    y_qlab = fake_quant(x_qlab, spec, ste="clipped")
    y_qlab.backward(upstream)

    assert_same_bits(y_qlab, y_torch)
    assert_same_bits(x_qlab.grad, x_torch.grad)
    assert_same_bits(x_qlab.grad, upstream * expected_inside)  # the hand-derived mask agrees with torch's


def test_fake_quant_clipped_ste_zeroes_the_gradient_where_mx_floor_saturates():
    """MX FLOOR, E4M3 (emax 8): a block with amax 480 gets scale 2^0, so 480 > 448 clips; a block with
    amax 957 gets scale 2^1, so 957/2 = 478.5 and −900/2 = 450 clip, 896/2 = 448 does not."""
    g = torch.Generator().manual_seed(20)
    x = (torch.rand(2, 64, generator=g) - 0.5) * 400.0  # |x| < 200 everywhere: never clipped
    x[0, 3] = 480.0  # block (0, 0)
    x[0, 40], x[0, 41], x[0, 42] = 957.0, -900.0, 896.0  # block (0, 1)
    x[1, 10] = 448.0  # block (1, 0): exactly the max, in range
    inside = torch.ones_like(x, dtype=torch.bool)
    inside[0, 3] = inside[0, 40] = inside[0, 41] = False
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(21))

    x = x.requires_grad_()
    y = fake_quant(x, MXSpec("e4m3", mode="floor"), ste="clipped")
    y.backward(upstream)
    assert y[0, 3].item() == 448.0 and y[0, 40].item() == 896.0 and y[0, 41].item() == -896.0
    assert y[0, 42].item() == 896.0 and y[1, 10].item() == 448.0
    assert_same_bits(y, qdq(x.detach(), MXSpec("e4m3", mode="floor")))
    assert_same_bits(x.grad, upstream * inside)


def test_fake_quant_refuses_unknown_ste():
    with pytest.raises(ValueError, match="unknown ste 'straight'; expected one of: identity, clipped"):
        fake_quant(torch.randn(4, 32), MXSpec(), ste="straight")


def test_fake_quant_refuses_clipped_ste_with_hadamard():
    with pytest.raises(ValueError, match="not defined for hadamard=True"):
        fake_quant(torch.randn(4, 32), NVFP4Spec(hadamard=True), ste="clipped")


# --- quantize_model / unquantize_model ------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(IN_FEATURES, IN_FEATURES)
        self.mlp = nn.Sequential(
            nn.Linear(IN_FEATURES, 96), nn.GELU(), nn.Linear(96, IN_FEATURES, bias=False)
        )

    def forward(self, x):
        return x + self.mlp(self.attn(x))


def make_model():
    torch.manual_seed(22)
    return nn.Sequential(
        OrderedDict(
            layers=nn.Sequential(Block(), Block()),
            norm=nn.LayerNorm(IN_FEATURES),
            lm_head=nn.Linear(IN_FEATURES, OUT_FEATURES),
        )
    )


LINEAR_NAMES = [
    "layers.0.attn",
    "layers.0.mlp.0",
    "layers.0.mlp.2",
    "layers.1.attn",
    "layers.1.mlp.0",
    "layers.1.mlp.2",
    "lm_head",
]
LINEAR_SHAPES = [(64, 64), (64, 96), (96, 64), (64, 64), (64, 96), (96, 64), (64, 48)]


def test_a_keep_pattern_naming_a_container_is_refused_not_ignored():
    # patterns match whole qualified names: "layers.1" names the block, which is no Linear, so it
    # would keep nothing; a pattern that keeps nothing is an error naming the closest Linear layers
    with pytest.raises(ValueError, match=r"'layers.1' matches no Linear layer; closest .*layers.1.attn"):
        quantize_model(make_model(), "fp8_tensorwise", keep_high_precision=["layers.1"])


@pytest.mark.parametrize(
    "keep,kept",
    [
        ((), set()),
        (["lm_head"], {"lm_head"}),
        (["lm_head", "layers.1.*"], {"lm_head", "layers.1.attn", "layers.1.mlp.0", "layers.1.mlp.2"}),
        ("*.mlp.?", {"layers.0.mlp.0", "layers.0.mlp.2", "layers.1.mlp.0", "layers.1.mlp.2"}),
    ],
)
def test_quantize_model_swaps_linears_and_keeps_parameters(keep, kept):
    model = make_model()
    parameters = dict(model.named_parameters())
    report = quantize_model(model, "fp8_tensorwise", keep_high_precision=keep)

    assert report == [
        {
            "name": name,
            "class": "Linear",
            "action": "kept" if name in kept else "quantized",
            "reason": "matches a keep pattern" if name in kept else "",
            "recipe": "fp8_tensorwise",
            "in_features": k,
            "out_features": m,
        }
        for name, (k, m) in zip(LINEAR_NAMES, LINEAR_SHAPES)
    ]
    for name in LINEAR_NAMES:
        module = model.get_submodule(name)
        assert type(module) is (nn.Linear if name in kept else QuantLinear), name
        assert module.weight is parameters[f"{name}.weight"]
        if module.bias is not None:
            assert module.bias is parameters[f"{name}.bias"]
        if name not in kept:
            assert module.recipe == get_recipe("fp8_tensorwise")
    assert dict(model.named_parameters()).keys() == parameters.keys()
    assert all(p is parameters[n] for n, p in model.named_parameters())


def test_quantize_model_passes_options_to_quantlinear():
    model = make_model()
    quantize_model(model, "mxfp8", fuse_wgrad_accumulation=True, delay_wgrad=True, seed=5)
    layer = model.get_submodule("layers.0.attn")
    assert (layer.fuse_wgrad_accumulation, layer.delay_wgrad, layer.seed) == (True, True, 5)
    with pytest.raises(TypeError, match="unexpected QuantLinear options"):
        quantize_model(make_model(), "mxfp8", fuse_wgrad=True)


def test_quantized_model_with_bf16_recipe_equals_the_original_exactly():
    model = make_model()
    x = torch.randn(2, 8, IN_FEATURES, generator=torch.Generator().manual_seed(23))
    dy = torch.randn(2, 8, OUT_FEATURES, generator=torch.Generator().manual_seed(24))
    x_original = x.clone().requires_grad_()
    y_original = model(x_original)
    y_original.backward(dy)
    original_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    quantize_model(model, "bf16")
    assert all(type(model.get_submodule(n)) is QuantLinear for n in LINEAR_NAMES)
    x_quantized = x.clone().requires_grad_()
    y_quantized = model(x_quantized)
    y_quantized.backward(dy)
    assert_same_bits(y_quantized, y_original)
    assert_same_bits(x_quantized.grad, x_original.grad)
    for name, parameter in model.named_parameters():
        assert_same_bits(parameter.grad, original_grads[name])


def test_unquantize_model_restores_linears_with_the_same_parameters():
    model = make_model()
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(25))
    y_before = model(x)
    parameters = dict(model.named_parameters())
    quantize_model(model, "nvfp4", keep_high_precision=["lm_head"])
    assert not torch.equal(model(x), y_before)  # nvfp4 really changed the numbers
    names = unquantize_model(model)
    assert names == LINEAR_NAMES[:-1]
    for name in LINEAR_NAMES:
        module = model.get_submodule(name)
        assert type(module) is nn.Linear
        assert module.weight is parameters[f"{name}.weight"]
        assert module.bias is parameters.get(f"{name}.bias")
    assert_same_bits(model(x), y_before)


def test_quantize_model_again_replaces_the_recipe_and_says_so():
    """A quantized model quantized with another recipe computes what the float model quantized once
    with that recipe computes, on the same Parameters; the report names the recipe each layer had, and
    a layer a keep pattern now matches goes back to high precision."""
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(26))
    once = make_model()
    quantize_model(once, "nvfp4", keep_high_precision=["lm_head"])
    twice = make_model()
    parameters = dict(twice.named_parameters())
    quantize_model(twice, "mxfp8")
    report = quantize_model(twice, "nvfp4", keep_high_precision=["lm_head"])
    assert_same_bits(twice(x), once(x))
    assert dict(twice.named_parameters()) == parameters  # the same Parameter objects, not copies
    actions = {row["name"]: (row["action"], row["reason"]) for row in report}
    assert actions["lm_head"] == ("kept", "matches a keep pattern; its mxfp8 quantization removed")
    assert type(twice.get_submodule("lm_head")) is nn.Linear
    for name in LINEAR_NAMES[:-1]:
        assert actions[name] == ("requantized", "was quantized with mxfp8")
        assert twice.get_submodule(name).recipe.name == "nvfp4"


def test_quantize_model_swaps_a_shared_linear_everywhere():
    shared = nn.Linear(IN_FEATURES, IN_FEATURES)
    model = nn.Sequential(OrderedDict(first=shared, act=nn.ReLU(), second=shared))
    quantize_model(model, "fp8_tensorwise")
    assert type(model.first) is QuantLinear
    assert type(model.second) is QuantLinear


def test_quantize_model_refuses_a_bare_linear():
    with pytest.raises(ValueError, match="model is itself a Linear"):
        quantize_model(nn.Linear(4, 4), "fp8_tensorwise")


def test_quantize_model_refuses_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe"):
        quantize_model(make_model(), "fp9")


# --- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(TOKENS, IN_FEATURES - 1), (2, 8, IN_FEATURES + 1), ()])
def test_wrong_input_shape_is_refused(shape):
    layer = QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="fp8_tensorwise")
    with pytest.raises(
        ValueError,
        match=rf"input x must have shape \(\.\.\., {IN_FEATURES}\) like nn.Linear's, "
        rf"got " + re.escape(str(tuple(shape))),
    ):
        layer(torch.randn(shape))


@pytest.mark.parametrize("shape", [(IN_FEATURES,), (2, 2, 4, IN_FEATURES)])
def test_1d_and_4d_inputs_equal_the_flattened_2d_result(shape):
    layer = QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="mxfp8")
    x = torch.randn(shape)
    assert torch.equal(layer(x), layer(x.reshape(-1, IN_FEATURES)).reshape(*shape[:-1], OUT_FEATURES))


@pytest.mark.parametrize(
    "x_dtype,layer_dtype",
    [(torch.float16, torch.float32), (torch.float32, torch.bfloat16), (torch.float64, torch.float32)],
)
def test_dtype_mismatch_is_refused(x_dtype, layer_dtype):
    layer = QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="mxfp8", dtype=layer_dtype)
    with pytest.raises(TypeError, match="does not match the weight's"):
        layer(torch.randn(TOKENS, IN_FEATURES, dtype=x_dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_input_is_refused(dtype):
    layer = QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="fp8_tensorwise")
    with pytest.raises(TypeError, match="input x must be a (floating-point tensor|torch.Tensor)"):
        layer(torch.zeros(TOKENS, IN_FEATURES, dtype=dtype))


def test_non_tensor_input_is_refused():
    with pytest.raises(TypeError, match="input x must be a (floating-point tensor|torch.Tensor)"):
        QuantLinear(4, 4)([[1.0] * 4])


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="fp8")


def test_float64_layer_with_a_quantized_recipe_is_refused():
    """qlab.quantize takes float32/bf16/fp16 only, so quantized recipes cannot run (or be
    gradchecked) in float64."""
    layer = QuantLinear(IN_FEATURES, OUT_FEATURES, recipe="fp8_tensorwise", dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer(torch.randn(TOKENS, IN_FEATURES, dtype=torch.float64))


def test_converted_layers_keep_the_training_mode():
    model = nn.Sequential(nn.Linear(IN_FEATURES, 4)).eval()
    quantize_model(model, "fp8_tensorwise")
    assert not model[0].training
    unquantize_model(model)
    assert type(model[0]) is nn.Linear and not model[0].training


# --- fixes from review -----------------------------------------------------------------------------


def test_bf16_layers_dequantize_straight_to_float32():
    # a bf16 layer's dequantized operands are not rounded back to bf16 before the float32 GEMM
    torch.manual_seed(0)
    layer = QuantLinear(64, 32, bias=False, recipe="fp8_tensorwise", dtype=torch.bfloat16)
    x = torch.randn(16, 64).bfloat16()
    x_q = qdq(x, TensorwiseSpec("e4m3"), dtype=torch.float32)
    w_q = qdq(layer.weight.detach(), TensorwiseSpec("e4m3"), dtype=torch.float32)
    torch.set_float32_matmul_precision("highest")
    assert torch.equal(layer(x), (x_q @ w_q.T).bfloat16())


def test_zero_tokens_pass_through():
    layer = QuantLinear(64, 32, recipe="mxfp8")
    x = torch.empty(0, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert (
        y.shape == (0, 32) and x.grad.shape == (0, 64) and torch.equal(layer.weight.grad, torch.zeros(32, 64))
    )


def test_dummy_wgrad_follows_the_weights_dtype_and_device():
    layer = QuantLinear(8, 4, bias=False, fuse_wgrad_accumulation=True)
    layer.weight.grad_added_to_main_grad = False
    layer(torch.ones(2, 8)).sum().backward()
    layer.weight.grad = None
    layer.double()
    layer.weight.grad_added_to_main_grad = False
    layer(torch.ones(2, 8, dtype=torch.float64)).sum().backward()  # a float32 dummy would be refused here
    assert layer.weight.grad.dtype == torch.float64 and torch.count_nonzero(layer.weight.grad) == 0


def test_quantized_model_runs_under_autocast_like_nn_linear():
    model = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, 4))
    quantize_model(model, "fp8_tensorwise", keep_high_precision=["0"])
    with torch.autocast("cpu", torch.bfloat16):
        y = model(torch.randn(3, IN_FEATURES))
    assert y.dtype == torch.bfloat16


def test_each_converted_layer_gets_its_own_rounding_seed():
    model = nn.Sequential(nn.Linear(IN_FEATURES, IN_FEATURES), nn.Linear(IN_FEATURES, IN_FEATURES))
    quantize_model(model, "nvfp4", seed=10)
    assert [model[0].seed, model[1].seed] == [10, 11]


# --- delayed scaling under torch.distributed: reduce_amax ------------------------------------------------

_RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from qlab.nn import QuantLinear
from qlab.recipe import get_recipe
rank, reduce_amax, out, init = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4]
if init != "local":
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
torch.manual_seed(0)  # the same weights on both ranks, as DDP has them
layer = QuantLinear(32, 16, recipe=get_recipe("fp8_delayed").replace(reduce_amax=reduce_amax))
generator = torch.Generator().manual_seed(rank)
for step in range(2):  # the larger amaxes come from rank 1 at step 0 and from rank 0 at step 1
    x = torch.randn(8, 32, generator=generator) * (1 + 3 * (rank ^ step))
    layer(x).backward(torch.randn(8, 16, generator=generator) * (1 + (rank ^ step)))
torch.save({role: scaler.history[:3] for role, scaler in layer.scalers.items()}, out)
"""


def _rank_histories(tmp_path, reduce_amax: bool, distributed: bool) -> list[dict]:
    import subprocess
    import sys

    init = f"file://{tmp_path / f'rendezvous_{reduce_amax}'}" if distributed else "local"
    outputs = [tmp_path / f"rank{rank}_{reduce_amax}_{distributed}.pt" for rank in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(rank), str(int(reduce_amax)), str(outputs[rank]), init],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        errors = [process.communicate(timeout=300)[1] for process in processes]
    finally:
        for process in processes:  # never leave a rank waiting on its peer
            process.kill()
    assert all(process.returncode == 0 for process in processes), errors
    return [torch.load(path) for path in outputs]


@pytest.mark.slow
def test_reduce_amax_gives_every_rank_the_max_of_the_ranks_amaxes(tmp_path):
    # reference: each rank's amax history computed alone (no process group), then their elementwise max
    alone = _rank_histories(tmp_path, reduce_amax=True, distributed=False)
    reduced = _rank_histories(tmp_path, reduce_amax=True, distributed=True)
    independent = _rank_histories(tmp_path, reduce_amax=False, distributed=True)
    for role in ("input", "weight", "grad_output"):
        expected = torch.maximum(alone[0][role], alone[1][role])
        assert torch.equal(reduced[0][role], expected) and torch.equal(reduced[1][role], expected), role
        assert torch.equal(independent[0][role], alone[0][role]) and torch.equal(
            independent[1][role], alone[1][role]
        )
    for role in ("input", "grad_output"):  # the ranks did see different amaxes, each rank winning once
        assert bool((alone[0][role][:2] > alone[1][role][:2]).any()) and bool(
            (alone[1][role][:2] > alone[0][role][:2]).any()
        )


# What backward keeps, by hand for an input of 16×64 tokens × 64 features and a 64 → 256 layer:
# x has 1024·64 elements, W 256·64; E8M0 / E4M3 scales one byte, float32 scales four.
SAVED_OPERAND_CASES = [
    ("mxfp8", "high_precision", (1024 + 256) * 64 * 2),  # bf16 originals
    ("mxfp8", "dequantized", (1024 * 64 + 1024 * 2) + (256 * 64 + 256 * 2)),  # 2 blocks of 32 per row
    ("mxfp8", None, (1024 * 64 + 32 * 64) + (256 * 64 + 8 * 64)),  # blocks of 32 down the columns
    ("nvfp4", "dequantized", (1024 * 32 + 1024 * 4 + 4) + (256 * 32 + 16 * 4 + 4)),  # W in 16×16 tiles
    ("fp8_tensorwise", "dequantized", (1024 * 64 + 4) + (256 * 64 + 4)),
    ("fp8_delayed", None, (1024 * 64 + 4) + (256 * 64 + 4)),
]


@pytest.mark.parametrize(("recipe", "mode", "expected"), SAVED_OPERAND_CASES)
def test_saved_operand_bytes_by_hand(recipe, mode, expected):
    layer = QuantLinear(64, 256, recipe=recipe)
    assert layer.saved_operand_bytes((16, 64, 64), mode) == expected
    if mode is None:  # "none", as a Recipe and the notebooks' overrides spell it
        assert layer.saved_operand_bytes((16, 64, 64), "none") == expected


def test_saved_operand_bytes_refuses_a_wrong_shape_or_mode():
    layer = QuantLinear(64, 256, recipe="mxfp8")
    with pytest.raises(ValueError, match="in_features=64"):
        layer.saved_operand_bytes((16, 32), None)
    with pytest.raises(ValueError, match="backward_mode"):
        layer.saved_operand_bytes((16, 64), "dequantised")
