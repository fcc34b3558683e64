"""FP8 GEMMs through torch._scaled_mm (qlab.kernels.fp8_gemm) and QuantLinear's gemm= option.

References: the exact product of the FP8 operands in float64 (torch's own float8 → float64
conversion of the codes, divided by the scales), and QuantLinear's emulated GEMM. Neither path is
exact, so the tests bound the difference by the classical error bound of a float32 dot product
(Higham, Accuracy and Stability of Numerical Algorithms, §3.1): |fl(Σ aᵢbᵢ) − Σ aᵢbᵢ| ≤ γ_K Σ|aᵢbᵢ|
with γ_K = K·u/(1 − K·u) ≈ K·u, u = 2⁻²⁴ for a float32 accumulator, plus a few u for scaling each
product or the sum by the reciprocal scales. PyTorch's CPU _scaled_mm accumulates in float32. On a
GPU, Hopper's FP8 tensor cores add runs of products keeping about 14 bits (DeepSeek-V3 technical
report, §3.3.2) before the float32 accumulator takes the partial sum, which adds an error relative to
Σ|aᵢbᵢ| that does not grow with K. Measured on an H200 (benchmarks/measure_fp8_gemm_error.py, torch
2.11.0+cu130, 2026-11-26; e4m3 × e4m3, 256 × 256 outputs, K from 64 to 16384, Gaussian and all-positive
operands): at most 1.25e-3·Σ|aᵢbᵢ| (2⁻⁹·⁶, K = 256, all positive), 0.65e-3 at K = 16384. The tests allow
TENSOR_CORE_ERROR = 2⁻⁸·Σ|aᵢbᵢ| on CUDA on top of the float32 bound: about 3× the largest measured. They
apply it to e5m2 operands, per-row scales and K of 32 and 48 too, which the script's second table covers
but no GPU has run yet.
"""

import pytest
import torch

from qlab import quantize as Q
from qlab.kernels import fp8_gemm
from qlab.kernels.fp8_gemm import fp8_matmul, unsupported_reason
from qlab.nn import QuantLinear, check_gemm
from qlab.recipe import Recipe, get_recipe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = 2.0**-24  # float32's
TENSOR_CORE_ERROR = 2.0**-8 if DEVICE == "cuda" else 0.0  # measured, see the module docstring
TORCH_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _exact_operand(q: Q.QTensor) -> torch.Tensor:
    """float64 (rows, K) with the reduction axis last: torch's float8 decoding of the codes divided by
    the scales, put back in the operand's logical shape (per-row codes are stored with the axis last)."""
    values = q.codes.cpu().view(TORCH_FLOAT8[q.spec.element]).double() / q.scales.cpu().double()
    if q.spec.granularity == "axis":
        values = values.movedim(-1, q.axis)  # the logical (as quantized) shape
    assert values.shape == q.shape
    return values.movedim(q.axis, -1)


def _bound(a: torch.Tensor, b: torch.Tensor, slack: int = 3) -> torch.Tensor:
    """((K + slack)·u + TENSOR_CORE_ERROR)·Σ|a||b| elementwise for a (M, K)·(N, K)ᵀ product."""
    k = a.shape[1]
    return ((k + slack) * UNIT_ROUNDOFF + TENSOR_CORE_ERROR) * (a.abs() @ b.abs().T)


@pytest.mark.parametrize("granularity", ["tensor", "axis"])
@pytest.mark.parametrize("elements", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")])
@pytest.mark.parametrize("axes", [(1, 1), (0, 1), (1, 0), (0, 0)])
def test_fp8_matmul_is_the_exact_product_within_a_float32_dot_product_bound(elements, granularity, axes):
    spec_a = Q.TensorwiseSpec(elements[0], granularity=granularity)
    spec_b = Q.TensorwiseSpec(elements[1], granularity=granularity)
    if unsupported_reason(spec_a, spec_b, 64, 48, torch.device(DEVICE)):
        pytest.skip(unsupported_reason(spec_a, spec_b, 64, 48, torch.device(DEVICE)))
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=generator) * torch.logspace(-2, 2, 64)  # (M, K), K along axis 1
    b = torch.randn(48, 64, generator=generator) * 30  # (N, K)
    a, b = (a if axes[0] == 1 else a.T.contiguous()), (b if axes[1] == 1 else b.T.contiguous())
    qa, qb = Q.quantize(a.to(DEVICE), spec_a, axes[0]), Q.quantize(b.to(DEVICE), spec_b, axes[1])
    out = fp8_matmul(qa, qb)
    assert out.shape == (32, 48) and out.dtype == torch.float32
    exact_a, exact_b = _exact_operand(qa), _exact_operand(qb)
    error = (out.cpu().double() - exact_a @ exact_b.T).abs()
    assert bool((error <= _bound(exact_a, exact_b)).all()), float((error / _bound(exact_a, exact_b)).max())


def test_fp8_matmul_takes_any_output_dtype_and_refuses_bad_operands():
    x = torch.randn(16, 32)
    q = Q.quantize(x, "fp8_e4m3")
    assert fp8_matmul(q, q, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="QTensors"):
        fp8_matmul(x, q)
    with pytest.raises(TypeError, match="E4M3/E5M2 TensorwiseSpec"):
        fp8_matmul(Q.quantize(x, "mxfp8"), q)
    with pytest.raises(ValueError, match="2-D"):
        fp8_matmul(Q.quantize(x.reshape(2, 8, 32), "fp8_e4m3"), q)
    with pytest.raises(ValueError, match="reduction lengths differ"):
        fp8_matmul(Q.quantize(torch.randn(16, 48), "fp8_e4m3"), q)


E4M3, E5M2 = Q.TensorwiseSpec("e4m3"), Q.TensorwiseSpec("e5m2")
E4M3_ROW, E5M2_ROW = (
    Q.TensorwiseSpec("e4m3", granularity="axis"),
    Q.TensorwiseSpec("e5m2", granularity="axis"),
)


@pytest.mark.parametrize(
    "spec_a, spec_b, k, n, capability, cuda, out_dtype, reason",
    [
        (E4M3, E4M3, 64, 48, (9, 0), "12.4", torch.float32, None),
        (E5M2, E4M3, 64, 48, (8, 9), "12.4", torch.float32, None),  # Ada has FP8 tensor cores
        (E4M3, E4M3, 64, 48, (8, 0), "12.4", torch.float32, "compute capability 8.9"),  # Ampere has none
        (E4M3, E4M3, 40, 48, (9, 0), "12.4", torch.float32, "multiples of 16"),
        (E4M3, E4M3, 64, 40, (9, 0), "12.4", torch.float32, "multiples of 16"),
        (E5M2, E5M2, 64, 48, (9, 0), "12.4", torch.float32, "E5M2 × E5M2"),
        (E5M2_ROW, E4M3_ROW, 64, 48, (9, 0), "12.9", torch.float32, None),  # cuBLAS's row-wise path
        (
            E5M2_ROW,
            E4M3_ROW,
            64,
            48,
            (9, 0),
            "12.4",
            torch.float32,
            "float32 result",
        ),  # CUTLASS: bf16/fp16 only
        (E5M2_ROW, E4M3_ROW, 64, 48, (10, 0), "12.9", torch.float32, "float32 result"),
        (E5M2_ROW, E4M3_ROW, 64, 48, (8, 9), "12.4", torch.bfloat16, None),
        (E4M3_ROW, E5M2_ROW, 64, 48, (9, 0), "12.9", torch.float32, "operand B in E4M3"),
        (Q.SPECS["mxfp8"], E4M3, 64, 48, (9, 0), "12.4", torch.float32, "not an E4M3/E5M2 TensorwiseSpec"),
        (
            Q.TensorwiseSpec("e3m2"),
            E4M3,
            64,
            48,
            (9, 0),
            "12.4",
            torch.float32,
            "not an E4M3/E5M2 TensorwiseSpec",
        ),
    ],
)
def test_the_cuda_constraints_table(monkeypatch, spec_a, spec_b, k, n, capability, cuda, out_dtype, reason):
    # PyTorch's constraints (aten/src/ATen/native/cuda/ScaledBlas.cpp, RowwiseScaledMM.cu), checked here
    # without a GPU: a regression in unsupported_reason would send a GEMM to a kernel that refuses it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    got = unsupported_reason(spec_a, spec_b, k, n, torch.device("cuda"), out_dtype)
    assert got is None if reason is None else reason in got


def test_the_cpu_build_takes_every_fp8_combination():
    assert unsupported_reason(E5M2, E5M2, 40, 40, torch.device("cpu")) is None
    assert "CUDA or the CPU" in unsupported_reason(E4M3, E4M3, 64, 48, torch.device("meta"))


# --- QuantLinear(gemm="scaled_mm") against the emulated GEMMs -----------------------------------------

ROWWISE = Recipe(name="fp8_rowwise", input=E4M3_ROW, weight=E4M3_ROW, grad_output=E5M2_ROW)


def _twin_layers(recipe, **options):
    torch.manual_seed(0)
    emulated = QuantLinear(64, 48, recipe=recipe, gemm="emulated", **options).to(DEVICE)
    tensor_cores = QuantLinear(64, 48, recipe=recipe, gemm="scaled_mm", **options).to(DEVICE)
    tensor_cores.load_state_dict(emulated.state_dict())
    return emulated, tensor_cores


def _run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(step: int):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(32, 64, generator=generator) * torch.logspace(-1, 1, 64)
    dy = torch.randn(32, 48, generator=generator) * 1e-3
    return x.to(DEVICE), dy.to(DEVICE)


@pytest.mark.parametrize(
    "recipe",
    [
        "fp8_tensorwise",
        "fp8_delayed",
        ROWWISE,
        get_recipe("fp8_tensorwise").replace(input=Q.TensorwiseSpec("e4m3", pow2=True)),
    ],
)
def test_quantlinear_on_tensor_cores_agrees_with_emulation(recipe):
    recipe = get_recipe(recipe)
    for role_a, role_b, k, n in (
        ("input", "weight", 64, 48),
        ("dgrad_grad_output", "dgrad_weight", 48, 64),
        ("wgrad_grad_output", "wgrad_input", 32, 64),
    ):  # 32 tokens, 64 → 48 features
        reason = unsupported_reason(recipe.spec(role_a), recipe.spec(role_b), k, n, torch.device(DEVICE))
        if reason:  # e.g. row-wise float32 results on a GPU without cuBLAS's row-wise path
            pytest.skip(reason)
    emulated, tensor_cores = _twin_layers(recipe)
    for step in range(3):  # delayed scaling: both histories roll alike, so later steps use the same scales
        x, dy = _inputs(step)
        emulated.weight.grad = tensor_cores.weight.grad = None
        emulated.bias.grad = tensor_cores.bias.grad = None
        y_e, dx_e, dw_e, db_e = _run(emulated, x, dy)
        y_t, dx_t, dw_t, db_t = _run(tensor_cores, x, dy)
        # |qdq(v)| ≤ 2|v| (RNE onto a grid holding 0), so Σ|q(a)||q(b)| ≤ 4·Σ|a||b| on the high-precision
        # operands; the two GEMMs each stay within the dot-product bound of the exact one, hence 2·4·bound
        w = emulated.weight.detach()
        for got, want, a, b in (
            (y_t - emulated.bias, y_e - emulated.bias, x, w),
            (dx_t, dx_e, dy, w.T),
            (dw_t, dw_e, dy.T, x.T),
        ):
            limit = (
                8 * _bound(a.double().cpu(), b.double().cpu()) + 2 * UNIT_ROUNDOFF * want.abs().double().cpu()
            )
            assert bool(((got - want).abs().double().cpu() <= limit).all())
        assert torch.equal(db_t, db_e)  # the bias gradient is Σ dy either way
    if emulated.recipe.delayed:
        assert torch.equal(emulated.scalers["input"].history, tensor_cores.scalers["input"].history)


def test_the_dequantized_override_gives_the_emulated_backward_bit_for_bit():
    # the forward runs on tensor cores; the backward takes the dequantized operands, identical bits
    emulated, tensor_cores = _twin_layers(get_recipe("fp8_tensorwise", backward_override="dequantized"))
    x, dy = _inputs(0)
    _, dx_e, dw_e, _ = _run(emulated, x, dy)
    _, dx_t, dw_t, _ = _run(tensor_cores, x, dy)
    assert torch.equal(dx_t, dx_e) and torch.equal(dw_t, dw_e)


def test_delayed_scaling_with_stochastic_rounding_draws_from_the_layer_generator():
    recipe = Recipe(
        name="fp8_delayed_sr",
        input=E4M3,
        weight=E4M3,
        delayed=True,
        grad_output=Q.TensorwiseSpec("e5m2", rounding="stochastic"),
    )
    gradients = []
    for global_seed in (1, 2):
        torch.manual_seed(0)
        layer = QuantLinear(64, 48, recipe=recipe, gemm="scaled_mm", seed=7).to(DEVICE)
        torch.manual_seed(global_seed)  # the global RNG must not matter: the layer's generator draws
        gradients.append(_run(layer, *_inputs(0))[1:3])
    assert all(torch.equal(a, b) for a, b in zip(*gradients))


def test_main_grad_fusion_and_delayed_wgrad_on_tensor_cores():
    emulated, tensor_cores = _twin_layers("fp8_tensorwise", fuse_wgrad_accumulation=True, delay_wgrad=True)
    for layer in (emulated, tensor_cores):
        for step, first in ((0, True), (1, False)):  # two micro-batches: overwrite, then accumulate
            x, dy = _inputs(step)
            layer(x.requires_grad_(True), is_first_microbatch=first).backward(dy)
        assert layer.weight.grad is None  # nothing delivered before backward_dw
        layer.backward_dw()
    x0, dy0 = _inputs(0)
    x1, dy1 = _inputs(1)
    magnitude = (dy0.abs().T @ x0.abs() + dy1.abs().T @ x1.abs()).double().cpu()
    limit = (
        8 * ((32 + 3) * UNIT_ROUNDOFF + TENSOR_CORE_ERROR) * magnitude
        + 2 * UNIT_ROUNDOFF * emulated.weight.main_grad.abs().double().cpu()
    )
    assert bool(
        ((tensor_cores.weight.main_grad - emulated.weight.main_grad).abs().double().cpu() <= limit).all()
    )


def test_auto_on_a_cpu_is_the_emulated_gemm_bit_for_bit():
    torch.manual_seed(0)
    auto = QuantLinear(64, 48, recipe="fp8_tensorwise")
    emulated = QuantLinear(64, 48, recipe="fp8_tensorwise", gemm="emulated")
    emulated.load_state_dict(auto.state_dict())
    x, dy = _inputs(0)
    if DEVICE == "cuda":
        pytest.skip("on CUDA auto takes the tensor cores")
    for got, want in zip(_run(auto, x, dy), _run(emulated, x, dy)):
        assert torch.equal(got, want)


def test_gemm_option_is_checked():
    assert "gemm=auto" in repr(QuantLinear(16, 16, recipe="fp8_tensorwise"))
    assert check_gemm("scaled_mm", get_recipe("fp8_delayed")) == "scaled_mm"
    with pytest.raises(ValueError, match="unknown gemm"):
        QuantLinear(16, 16, recipe="fp8_tensorwise", gemm="tensor_cores")
    with pytest.raises(ValueError, match="has none"):
        QuantLinear(16, 16, recipe="mxfp8", gemm="scaled_mm")
    with pytest.raises(ValueError, match="has none"):
        QuantLinear(16, 16, recipe="bf16", gemm="scaled_mm")


def test_forced_scaled_mm_names_the_gemm_it_cannot_run(monkeypatch):
    monkeypatch.setattr(
        fp8_gemm, "unsupported_reason", lambda *args: "the reduction length K=40 is not a multiple of 16"
    )
    layer = QuantLinear(40, 16, recipe="fp8_tensorwise", gemm="scaled_mm")
    with pytest.raises(ValueError, match="fprop GEMM: the reduction length K=40"):
        layer(torch.randn(16, 40))


@pytest.mark.parametrize("recipe, kept", [("fp8_tensorwise", True), ("fp8_delayed", False)])
def test_backward_keeps_the_forwards_codes_with_the_bits_of_quantizing_again(recipe, kept, monkeypatch):
    """Per-tensor RNE codes do not depend on the axis, so on tensor cores the backward takes the
    forward's codes of x and W and dgrad's codes of dy (TE's FP8 tensor and its transpose) instead of
    quantizing them again: y, dx, dW and db keep their bits over three steps, with three quantize calls
    a step instead of six. Delayed scaling quantizes again (a recomputed forward would take the latest
    forward's scales)."""
    import qlab.nn as qnn

    calls = []

    def counting(function):
        def counted(*args, **kwargs):
            calls.append(1)
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(qnn.kernels, "quantize", counting(qnn.kernels.quantize))
    monkeypatch.setattr(qnn.kernels, "fp8_with_scale", counting(qnn.kernels.fp8_with_scale))
    _, keeping = _twin_layers(get_recipe(recipe))
    _, again = _twin_layers(get_recipe(recipe))
    again.keeps_forward_codes = lambda *args, **kwargs: False
    for step in range(3):
        x, dy = _inputs(step)
        for layer in (keeping, again):
            layer.weight.grad = layer.bias.grad = None
        calls.clear()
        from_kept = _run(keeping, x, dy)
        assert len(calls) == (3 if kept else 6)  # kept: x and W in the forward, dy once in the backward
        calls.clear()
        quantized_again = _run(again, x, dy)
        assert len(calls) == 6
        for a, b in zip(from_kept, quantized_again):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_backward_quantizes_again_where_codes_depend_on_the_axis():
    """Row-wise scales differ along the two axes: nothing is kept, and neither is anything for the
    backward overrides or for emulated GEMMs."""
    x, _ = _inputs(0)
    layer = QuantLinear(64, 48, recipe=ROWWISE, gemm="scaled_mm").to(DEVICE)
    y = torch.empty(32, 48, device=DEVICE)
    if unsupported_reason(E4M3_ROW, E4M3_ROW, 64, 48, torch.device(DEVICE)) is None:
        assert not layer.keeps_forward_codes(x, layer.weight, y)
    for recipe, gemm in (
        ("fp8_tensorwise", "emulated"),
        (get_recipe("fp8_tensorwise", backward_override="dequantized"), "scaled_mm"),
    ):
        layer = QuantLinear(64, 48, recipe=recipe, gemm=gemm).to(DEVICE)
        assert not layer.keeps_forward_codes(x, layer.weight, y)
    assert QuantLinear(64, 48, recipe="fp8_tensorwise", gemm="scaled_mm").keeps_forward_codes(
        x.cpu(), torch.ones(48, 64), y.cpu()
    )


def test_keeping_codes_asks_only_about_the_gemms_that_will_run(monkeypatch):
    """Without a backward nothing is kept, and a backward GEMM that will not run (no weight gradient)
    is not asked about: with gemm="scaled_mm" a forward under no_grad or with a frozen weight runs
    where the wgrad GEMM could not (here K = 10 tokens, refused as on a GPU)."""

    def gpu_rule(spec_a, spec_b, k, n, device, out_dtype=torch.float32):
        return None if k % 16 == 0 and n % 16 == 0 else f"K={k} and N={n} must be multiples of 16"

    monkeypatch.setattr(fp8_gemm, "unsupported_reason", gpu_rule)
    layer = QuantLinear(64, 48, recipe="fp8_tensorwise", gemm="scaled_mm")
    x = torch.randn(10, 64)
    y = torch.empty(10, 48)
    assert not layer.keeps_forward_codes(x, layer.weight, y, need_x=False, need_w=False)
    assert not layer.keeps_forward_codes(x, layer.weight, y)  # wgrad over 10 tokens: quantize again
    assert layer.keeps_forward_codes(x, layer.weight, y, need_x=True, need_w=False)
    with torch.no_grad():
        layer(x)
    layer.weight.requires_grad_(False)
    x.requires_grad_(True)
    layer(x).backward(torch.randn(10, 48))
    assert x.grad is not None and layer.weight.grad is None


def test_kept_codes_compile_with_dynamic_shapes():
    """The decision is made when the layer is built: Dynamo tracing with dynamic shapes never compares
    specs; the compiled layer gives the eager bits."""
    torch.manual_seed(0)
    layer = QuantLinear(64, 48, recipe="fp8_tensorwise", gemm="scaled_mm")
    compiled = torch.compile(layer, dynamic=True, backend="aot_eager")
    for tokens in (32, 48):
        x, dy = torch.randn(tokens, 64), torch.randn(tokens, 48)
        eager = _run(layer, x, dy)
        layer.weight.grad = layer.bias.grad = None
        traced = _run(compiled, x, dy)
        layer.weight.grad = layer.bias.grad = None
        for a, b in zip(eager, traced):
            assert torch.equal(a, b)


def test_a_quant_state_is_a_cpu_copy_and_loads_as_float32():
    """Checkpoints hold CPU copies of the delayed-scaling state (the live tensors stay on the layer's
    device); a float64 state loads as the float32 the scaler keeps, with the same values."""
    layer = QuantLinear(64, 48, recipe="fp8_delayed").to(DEVICE)
    x, dy = _inputs(0)
    _run(layer, x, dy)
    state = layer.quant_state()
    for role, saved in state["scalers"].items():
        assert saved["history"].device.type == saved["scale"].device.type == "cpu"
        assert saved["scale"].data_ptr() != layer.scalers[role].scale.data_ptr()
    wide = {
        "scalers": {
            role: {key: value.double() for key, value in saved.items()}
            for role, saved in state["scalers"].items()
        }
    }
    fresh = QuantLinear(64, 48, recipe="fp8_delayed").to(DEVICE)
    fresh.load_state_dict(layer.state_dict())
    fresh.load_quant_state(wide)
    for role, scaler in fresh.scalers.items():
        assert scaler.scale.dtype == scaler.history.dtype == torch.float32
        assert torch.equal(scaler.scale.cpu(), state["scalers"][role]["scale"])
    assert torch.equal(_run(fresh, x, dy)[0], _run(layer, x, dy)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisations exist on CUDA only")
@pytest.mark.parametrize("gemm", ["scaled_mm", "emulated"])
def test_delayed_scaling_steps_read_nothing_back_from_the_gpu(gemm):
    """After the first step (whose scale of 1 starts on the CPU), forward and backward of an fp8_delayed
    layer make no host synchronisation: its amax history and scale stay on the GPU and the kernel takes
    the scale unread."""
    layer = QuantLinear(64, 48, recipe="fp8_delayed", gemm=gemm).to("cuda")
    x, dy = _inputs(0)
    for _ in range(2):
        _run(layer, x, dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x.requires_grad_(True))
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
