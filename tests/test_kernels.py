"""qlab.kernels against the eager reference (qlab.quantize), bit for bit.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernel module is imported): small shapes that still exercise masking (rows not a
multiple of the 16-row tile, a partial last block), both axes and the special values of a block
(NaN, inf, all zero, float32 subnormals, values that saturate). With CUDA the same tests run on GPU.
"""

import importlib.util
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter (numpy) on NaN blocks

from qlab import kernels, numerics
from qlab import quantize as Q
from qlab.formats import get_format
from qlab.kernels import fp8_qdq, layer_norm, mx_qdq, noise, nvfp4_qdq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ELEMENTS = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bits, every NaN as the canonical 0x7FC00000 (formats define where NaN is, not its payload)."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.tensor(float("nan")), t).view(torch.int32)


def test_kernels_read_only_constexpr_globals():
    # Compiled Triton refuses a module global inside a @triton.jit function unless it is a
    # tl.constexpr instance (a `NAME: tl.constexpr = 1.0` annotation is not one); the interpreter that
    # runs these tests without a GPU accepts it, so only this check catches it before a GPU does
    import ast
    import importlib
    import inspect
    import textwrap
    import types

    import triton
    import triton.language as tl

    kernel_types = (types.ModuleType, triton.runtime.jit.KernelInterface, tl.constexpr)
    refused = []
    modules = ("fp8_triton", "mx_triton", "nvfp4_triton", "layernorm_triton", "noise_triton", "triton_math")
    for name in modules:
        module = importlib.import_module(f"qlab.kernels.{name}")
        for kernel in vars(module).values():
            # JITFunction on a GPU, InterpretedFunction under the interpreter: both keep the Python function
            defined_here = getattr(getattr(kernel, "fn", None), "__module__", None) == module.__name__
            if not (isinstance(kernel, triton.runtime.jit.KernelInterface) and defined_here):
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
            local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
            used = [n for n in ast.walk(tree) if isinstance(n, ast.Name)]
            local |= {n.id for n in used if isinstance(n.ctx, ast.Store)}
            names = {n.id for n in used} - local
            for global_name in sorted(names & set(kernel.fn.__globals__)):
                value = kernel.fn.__globals__[global_name]
                if not isinstance(value, kernel_types):
                    refused.append(f"{name}.{kernel.fn.__name__} reads {global_name} = {value!r}")
    assert not refused


def _special_blocks(rows: int = 19, cols: int = 72) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-4, 4, cols)
    x[0, :32] = float("nan")  # a NaN block: byte 0xFF, every value NaN
    x[1, 40] = float("inf")  # an inf in the second block
    x[2, 32:64] = 0.0  # an all-zero block: byte 0
    x[3, :32] = 1e-40  # float32 subnormals: the smallest scales
    x[4, :32] = torch.linspace(-3e38, 3e38, 32)  # near float32's max: the largest scales
    x[5, 64:] = 480.0  # saturates under FLOOR for E4M3 (480 → 448)
    x[6, :4] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30])  # signed zeros, and values that round to ±0
    return x


@pytest.mark.parametrize("mode", ["floor", "rceil", "ceil", "even"])
@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_kernel_matches_the_reference_bit_for_bit(element, mode):
    x = _special_blocks().to(DEVICE)
    spec = Q.MXSpec(element, mode=mode)
    values, codes = mx_qdq(x, spec, backend="triton")
    ref_values, ref_codes = mx_qdq(x.cpu(), spec, backend="reference")
    assert torch.equal(codes.cpu(), ref_codes)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mx_kernel_both_axes_and_16_bit_inputs(axis, dtype):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 33, generator=generator) * 10).to(dtype).to(DEVICE)  # 33: a partial block
    values, codes = mx_qdq(x, "mxfp8", axis=axis, backend="triton")
    ref_values, ref_codes = mx_qdq(x.cpu(), "mxfp8", axis=axis, backend="reference")
    assert values.dtype == dtype and values.shape == x.shape
    assert torch.equal(codes.cpu(), ref_codes)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize(
    "mode, value, expected",
    [
        ("floor", 480.0, 448.0),  # docs/reference.md §2: FLOOR scale 2^0, 480 saturates to E4M3's 448
        ("floor", 957.0, 896.0),  # scale 2^1: 478.5 saturates to 448, times 2
        ("rceil", 480.0, 480.0),  # RCEIL scale 2^1: 240 is on the grid, nothing saturates
    ],
)
def test_published_floor_clipping_examples(mode, value, expected):
    values, _ = mx_qdq(
        torch.full((1, 32), value, device=DEVICE), Q.MXSpec("e4m3", mode=mode), backend="triton"
    )
    assert values[0, 0].item() == expected


def test_dispatch_backends_agree_and_bad_input_is_refused():
    x = _special_blocks(8, 64)
    cpu_values, cpu_codes = mx_qdq(x, "mxfp8", backend="cpu")
    ref_values, ref_codes = mx_qdq(x, "mxfp8", backend="reference")
    assert torch.equal(cpu_codes, ref_codes) and torch.equal(_bits(cpu_values), _bits(ref_values))
    with pytest.raises(ValueError, match="unknown backend"):
        mx_qdq(x, "mxfp8", backend="gpu")
    with pytest.raises(TypeError, match="MXSpec"):
        mx_qdq(x, "fp8_e4m3", backend="reference")
    with pytest.raises(ValueError, match="1-D blocks of 32"):
        mx_qdq(x, Q.MXSpec("e4m3", block_size=16), backend="triton")
    with pytest.raises(ValueError, match="rne rounding"):
        mx_qdq(x, Q.MXSpec("e4m3", rounding="stochastic"), backend="triton")
    with pytest.raises(ValueError, match="no NaN encoding"):  # as the reference refuses it
        fp8_qdq(_fp8_inputs(), Q.TensorwiseSpec("e2m1"), backend="triton")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8_qdq(torch.zeros(4, 8, dtype=torch.float64), "fp8_e4m3", backend="triton")


def _assert_same_qtensor(q: Q.QTensor, ref: Q.QTensor) -> None:
    assert (q.spec, q.axis, q.shape, q.dtype) == (ref.spec, ref.axis, ref.shape, ref.dtype)
    assert q.codes.dtype == ref.codes.dtype and torch.equal(q.codes.cpu(), ref.codes)
    assert torch.equal(_bits(q.scales.cpu()), _bits(ref.scales))
    if ref.scale_codes is not None:
        assert torch.equal(q.scale_codes.cpu(), ref.scale_codes)


@pytest.mark.parametrize("conversion", ["float8 cast", "from the bits"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_kernel_emits_the_codes_quantize_emits(element, mode, conversion, monkeypatch):
    """FP8 codes by the float8 conversion (GPUs from compute capability 8.9) and by encode_float (older
    GPUs, and every FP4/FP6 element) give quantize's bytes."""
    from qlab.kernels import mx_triton

    if conversion == "from the bits":
        monkeypatch.setattr(mx_triton, "fp8_cast", lambda element, device: "")
    elif get_format(element).name not in ("e4m3", "e5m2"):
        pytest.skip("FP4/FP6 codes always come from the bits")
    x = _special_blocks()  # 72 columns: the third block is partial, its padding code 0
    spec = Q.MXSpec(element, mode=mode)
    q = kernels.quantize(x.to(DEVICE), spec, backend="triton")
    _assert_same_qtensor(q, Q.quantize(x, spec))
    assert torch.equal(_bits(Q.dequantize(q).cpu()), _bits(mx_qdq(x, spec, backend="reference")[0]))


@pytest.mark.parametrize("element, float8", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_mx_kernel_float8_cast_writes_every_finite_code(element, float8):
    """Every finite E4M3/E5M2 value (subnormals and -0 included), 32 to a block with the format's max in
    each, so the scale is 1: the kernel's float8 conversion must write each value's own byte."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(float8).float()
    finite = values[torch.isfinite(values)]
    blocks = finite[: finite.numel() // 31 * 31].reshape(-1, 31)
    top = torch.full((blocks.shape[0], 1), get_format(element).max)
    x = torch.cat([blocks, top], dim=1).reshape(1, -1)
    q = kernels.quantize(x.to(DEVICE), Q.MXSpec(element), backend="triton")
    _assert_same_qtensor(q, Q.quantize(x, Q.MXSpec(element)))
    assert torch.equal(q.scale_codes.cpu(), torch.full_like(q.scale_codes.cpu(), 127))  # 2^0
    assert torch.equal(q.codes.cpu().reshape(-1), x.to(float8).view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("axis", [0, 1])
def test_mx_kernel_codes_along_either_axis(axis):
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 33, generator=generator) * 10).to(torch.bfloat16)
    q = kernels.quantize(x.to(DEVICE), "mxfp4", axis, backend="triton")
    _assert_same_qtensor(q, Q.quantize(x, "mxfp4", axis))
    assert q.packed_codes().shape == (33 if axis == 0 else 40, 2, 16)


def test_mx_codes_of_the_ocp_e2m1_table():
    # OCP MX v1.0 table: E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign. An amax of 6
    # gives the FLOOR scale 2^(2 − 2) = 1, so the values are their own elements.
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.cat([grid, -grid, grid, -grid]).reshape(1, 32)
    q = kernels.quantize(x.to(DEVICE), "mxfp4", backend="triton")
    expected = torch.cat([torch.arange(8), torch.arange(8) | 8] * 2).to(torch.uint8)
    assert torch.equal(q.codes.cpu().flatten(), expected) and q.scale_codes.item() == 127


# --- FP8 current scaling ---------------------------------------------------------------------------


def _fp8_inputs() -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 1100, generator=generator) * torch.logspace(-3, 3, 1100)  # rows > one 1024 chunk
    x[1, 2, 3] = float("nan")  # a NaN: scale 1 (per tensor, and for its row), NaN stays NaN
    x[2, 0, 7] = float("inf")  # an inf: scale 1, inf saturates to the format's max
    x[3] = 0.0  # all-zero rows: scale 1
    x[4, 2] = 1e-42  # a row of float32 subnormals: the scale overflows to float32's max
    return x


@pytest.mark.parametrize("convention", ["nvidia", "torchao"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "axis"])
@pytest.mark.parametrize("element", ELEMENTS)
def test_fp8_current_scaling_kernel_matches_the_reference(element, granularity, pow2, convention):
    x = _fp8_inputs()
    if granularity == "tensor" or element not in ("e4m3", "e5m2"):
        x = x[2:]  # without the NaN: a real per-tensor scale (NaN case below); FP6/FP4 have no NaN
    spec = Q.TensorwiseSpec(element, granularity=granularity, pow2=pow2, convention=convention)
    values, scales = fp8_qdq(x.to(DEVICE), spec, backend="triton")
    ref_values, ref_scales = fp8_qdq(x, spec, backend="reference")
    assert torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize("axis", [0, 1])
def test_fp8_per_channel_along_other_axes(axis):
    x = _fp8_inputs()[:, :, :40]
    spec = Q.TensorwiseSpec("e4m3", granularity="axis")
    values, scales = fp8_qdq(x.to(DEVICE), spec, axis, backend="triton")
    ref_values, ref_scales = fp8_qdq(x, spec, axis, backend="reference")
    assert scales.shape == ref_scales.shape and torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("axis", [-1, 0])
def test_fp8_blockwise_1x128_kernel_matches_the_reference(axis, pow2):
    # FP8 blockwise is per-tile current scaling: the row kernel runs each 1×128 tile of the padded layout
    # along the last axis 300 = 2 tiles + a padded partial one; along axis 0 the 5 rows are one partial
    # tile, so 40 columns suffice (the interpreter runs one program per row: 900 rows took 15 s)
    x = _fp8_inputs()[:, :, : 300 if axis == -1 else 40]  # NaN, inf, zero and tiny rows kept
    spec = Q.BlockwiseSpec("e4m3", pow2=pow2)
    values, scales = fp8_qdq(x.to(DEVICE), spec, axis, backend="triton")
    ref_values, ref_scales = fp8_qdq(x, spec, axis, backend="reference")
    cpu_values, cpu_scales = fp8_qdq(x, spec, axis, backend="cpu")  # the fused qdq + scales from the amaxes
    assert torch.equal(_bits(cpu_values), _bits(ref_values)) and torch.equal(
        _bits(cpu_scales), _bits(ref_scales)
    )
    assert scales.shape == ref_scales.shape and torch.equal(_bits(scales.cpu()), _bits(ref_scales))
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))
    assert torch.equal(
        _bits(kernels.qdq(x.to(DEVICE), spec, axis, backend="triton").cpu()), _bits(ref_values)
    )
    _assert_same_qtensor(
        kernels.quantize(x.to(DEVICE), spec, axis, backend="triton"), Q.quantize(x, spec, axis)
    )


def test_fp8_per_tensor_nan_gives_scale_one_and_keeps_nan():
    x = _fp8_inputs()
    values, scale = fp8_qdq(x.to(DEVICE), "fp8_e4m3", backend="triton")
    assert scale.item() == 1.0  # TE: a NaN amax leaves the scale at 1
    assert torch.isnan(values[1, 2, 3]) and torch.isnan(values).sum() == 1
    ref_values, _ = fp8_qdq(x, "fp8_e4m3", backend="reference")
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


# --- FP8 delayed scaling: a per-tensor scale fixed in advance ------------------------------------

DELAYED_SPECS = [Q.TensorwiseSpec(e, convention=c) for e in ("e4m3", "e5m2") for c in ("nvidia", "torchao")]


def _delayed_inputs(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """x of ``shape`` with NaN, ±inf, ±0, float32 subnormals, float16 subnormals and a value near float32's
    max (inf in float16) in its first row, spanning four decades along the rows."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=generator) * torch.logspace(-2, 2, shape[-1])
    x[0, :10] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, -3e-39, 3e-6, -5e-7, 3e38])
    return x.to(dtype)


def _delayed_scales(x: torch.Tensor, element: str) -> list:
    """Fixed scales as callers give them: numbers, 0-d and 1-element tensors; fmt_max / amax (the
    current-scaling scale), a tiny one (values flush to zero) and a large one (values saturate)."""
    finite = x.float()[torch.isfinite(x.float())]
    fitted = get_format(element).max / finite.abs().max()
    return [0.37, fitted.reshape(()), 2.0**-20, torch.tensor([2.0**20]), torch.tensor([[1.5]])]


def _on(scale, device):
    return scale.to(device) if isinstance(scale, torch.Tensor) else scale


@pytest.mark.parametrize("shape", [(3, 40), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", DELAYED_SPECS, ids=lambda spec: f"{spec.element}-{spec.convention}")
def test_fp8_fixed_scale_kernel_matches_the_reference(spec, dtype, shape):
    """Delayed scaling on the kernel: kernels.quantize / kernels.qdq with a fixed per-tensor scale, and
    fp8_with_scale, give the reference's codes, scales and values bit for bit, along either axis.
    bfloat16 qdq values are checked on a GPU only: under the interpreter a float32 → bfloat16 store
    truncates (a GPU rounds to nearest even, as the reference does)."""
    x = _delayed_inputs(shape, dtype)
    for scale in _delayed_scales(x, spec.element):
        device_scale = _on(scale, DEVICE)
        for axis in (0, -1):
            where = (scale, axis)
            ref = Q.quantize(x, spec, axis, scale=scale)
            q = kernels.quantize(x.to(DEVICE), spec, axis, scale=device_scale, backend="triton")
            _assert_same_qtensor(q, ref)
            assert q.scales.shape == ref.scales.shape and q.codes.shape == x.shape, where
            assert torch.equal(_bits(q.fixed_scale.cpu()), _bits(ref.fixed_scale)), where
            for out_dtype in (None, torch.float32, torch.float16, torch.bfloat16):
                if torch.bfloat16 in (out_dtype or dtype,) and DEVICE == "cpu":
                    continue  # the interpreter's bfloat16 store truncates
                want = Q.qdq(x, spec, axis, scale=scale, dtype=out_dtype)
                got = kernels.qdq(
                    x.to(DEVICE), spec, axis, scale=device_scale, dtype=out_dtype, backend="triton"
                )
                assert got.dtype == want.dtype and got.shape == want.shape, where
                assert torch.equal(_bits(got.cpu()), _bits(want)), (where, out_dtype)
            if isinstance(scale, torch.Tensor):  # fp8_with_scale takes the device tensor only
                held = scale.to(DEVICE)
                _assert_same_qtensor(kernels.fp8_with_scale(x.to(DEVICE), spec, axis, held, codes=True), ref)
                _assert_same_qtensor(
                    kernels.fp8_with_scale(x.to(DEVICE), spec, axis, held, codes=True, backend="triton"), ref
                )
                want = Q.qdq(x, spec, axis, scale=scale, dtype=torch.float32)
                for backend in ("auto", "triton", "reference"):
                    got = kernels.fp8_with_scale(
                        x.to(DEVICE), spec, axis, held, codes=False, dtype=torch.float32, backend=backend
                    )
                    assert torch.equal(_bits(got.cpu()), _bits(want)), (where, backend)


def test_fp8_fixed_scale_runs_one_launch_and_saturates_or_flushes(monkeypatch):
    """Per-tensor delayed scaling runs the scale-cast kernel alone (no amax pass); a large scale
    saturates at the format's max and a tiny one flushes to ±0, signs kept."""
    from qlab.kernels import fp8_triton

    amax_passes = []
    monkeypatch.setattr(fp8_triton, "tensor_amax", lambda flat: amax_passes.append(flat))
    x = torch.tensor([[1.0, -1.0, 3e-3, -3e-3, 0.0, -0.0, 400.0, -400.0]], device=DEVICE)
    big = kernels.quantize(x, "fp8_e4m3", scale=2.0**20, backend="triton")
    tiny = kernels.qdq(x, "fp8_e4m3", scale=torch.tensor(2.0**-20, device=DEVICE), backend="triton")
    assert not amax_passes
    top = get_format("e4m3").max
    assert (Q.dequantize(big).cpu() * 2.0**20).tolist() == [[top, -top, top, -top, 0.0, 0.0, top, -top]]
    assert torch.equal(torch.signbit(tiny.cpu()), torch.signbit(x.cpu())) and not tiny.any()


def test_fp8_fixed_scale_of_more_dimensions_than_x_is_refused_by_both_paths():
    # x · scale broadcast to the scale's dimensions, so the reference's output took a shape x does not
    # have; the kernel kept x's. Both refuse such a scale now, naming it.
    x = _delayed_inputs((3, 40), torch.float32)[1]
    scale = torch.tensor([[0.5]])
    for quantizer in (Q.quantize, Q.qdq, kernels.quantize, kernels.qdq):
        with pytest.raises(ValueError, match=r"scale must have at most x's 1 dimensions, got shape \(1, 1\)"):
            quantizer(x, "fp8_e4m3", scale=scale)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fixed_scales_the_reference_refuses_are_refused_alike(backend):
    x = _delayed_inputs((3, 40), torch.float32)
    bad_scales = [
        0.0,
        -1.0,
        math.nan,
        math.inf,
        torch.tensor(0.0),
        torch.tensor(-2.0),
        torch.tensor([math.nan]),
        torch.tensor(math.inf),
        torch.tensor([1.0, 2.0]),
        torch.ones(3, 1),
        "2.0",
        torch.tensor(True),
    ]
    for bad in bad_scales:
        with pytest.raises((TypeError, ValueError)) as reference:
            Q.quantize(x, "fp8_e4m3", scale=bad)
        for call in (kernels.quantize, kernels.qdq):
            with pytest.raises(type(reference.value)) as ours:
                call(x.to(DEVICE), "fp8_e4m3", scale=_on(bad, DEVICE), backend=backend)
            assert str(ours.value) == str(reference.value), (bad, call.__name__)


def test_fp8_with_scale_checks_shapes_dtypes_and_devices_but_not_the_value():
    x = _delayed_inputs((3, 40), torch.float32).to(DEVICE)
    scale = torch.tensor(0.5, device=DEVICE)
    refusals = [
        (dict(scale=scale.double()), TypeError, "scale must have dtype float32"),
        (dict(scale=scale.half()), TypeError, "scale must have dtype float32"),
        (dict(scale=torch.ones(2, device=DEVICE)), ValueError, "scale must hold one value"),
        (dict(scale=torch.ones(1, 1, 1, device=DEVICE)), ValueError, "at most x's 2 dimensions"),
        (dict(scale=torch.empty((), device="meta")), ValueError, "scale is a meta tensor"),
        (dict(scale=0.5), TypeError, "scale must be a torch.Tensor"),
        (dict(spec="fp8_e4m3_rowwise"), TypeError, "spec must be a TensorwiseSpec of granularity 'tensor'"),
        (dict(spec="mxfp8"), TypeError, "spec must be a TensorwiseSpec"),
        (dict(spec=Q.TensorwiseSpec(rounding="stochastic")), TypeError, "rne rounding"),
        (dict(codes=1), TypeError, "codes must be a bool"),
        (dict(codes=True, dtype=torch.float32), ValueError, "dtype is the dtype of qdq values"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating torch.dtype"),
        (dict(x=x.double()), TypeError, "x must be a float32, bfloat16 or float16 tensor"),
        (dict(axis=2), ValueError, "axis must be in"),
        (dict(backend="gpu"), ValueError, "unknown backend"),
        (dict(x=x[:0], codes=True), ValueError, "non-empty tensor x"),
    ]
    if torch.cuda.is_available():
        refusals.append((dict(scale=scale.cpu()), ValueError, "scale is on cpu but x is on cuda"))
    valid = dict(x=x, spec="fp8_e4m3", axis=-1, scale=scale, codes=False)
    for changes, error, message in refusals:
        with pytest.raises(error, match=message):
            kernels.fp8_with_scale(**{**valid, **changes})
    assert kernels.fp8_with_scale(x[:0], "fp8_e4m3", -1, scale, codes=False).shape == (0, 40)
    for unchecked in (0.0, -1.0, math.nan):  # the caller's guarantee: not read, so not refused
        value = torch.tensor(unchecked, device=DEVICE)
        for backend in ("triton", "reference"):
            assert (
                kernels.fp8_with_scale(x, "fp8_e4m3", -1, value, codes=False, backend=backend).shape
                == x.shape
            )
            assert (
                kernels.fp8_with_scale(x, "fp8_e4m3", 0, value, codes=True, backend=backend).codes.shape
                == x.shape
            )
    with pytest.raises(ValueError, match="finite and positive"):
        kernels.quantize(x, "fp8_e4m3", scale=torch.tensor(0.0, device=DEVICE))


def test_fixed_scale_coverage():
    for name in ("fp8_e4m3", "fp8_e5m2"):
        spec = Q.get_spec(name)
        assert kernels.covers(spec, fixed_scale=True) and kernels.quantize_covers(spec, fixed_scale=True)
    for spec in (
        "fp8_e4m3_rowwise",
        Q.TensorwiseSpec(rounding="stochastic"),
        "mxfp8",
        "int8",
        "fp8_blockwise",
    ):
        assert not kernels.covers(spec, fixed_scale=True)
        assert not kernels.quantize_covers(Q.get_spec(spec), fixed_scale=True)
    with pytest.raises(TypeError, match="fixed_scale must be a bool"):
        kernels.covers("fp8_e4m3", fixed_scale="yes")


# --- LayerNorm with selectable statistics -------------------------------------------------------

STATS = ["welford", "two_pass", "textbook"]


def _layer_norm_grads(fn, x, weight, bias, dy):
    x = x.detach().clone().requires_grad_(True)
    weight = None if weight is None else weight.detach().clone().requires_grad_(True)
    bias = None if bias is None else bias.detach().clone().requires_grad_(True)
    y = fn(x, weight, bias)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in (weight, bias) if p is not None]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("stats", STATS)
def test_layer_norm_kernel_matches_the_float64_reference(stats, affine):
    # Against autograd through float64 LayerNorm. Tolerance: the kernel computes in float32 and its
    # reductions sum in another order than any reference; on these well-conditioned rows (κ ≈ 2,
    # n = 50, a masked partial block of 64) every quantity is within 2e-5 relative to its norm.
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=generator) + 2.0
    weight = torch.randn(50, generator=generator) if affine else None
    bias = torch.randn(50, generator=generator) if affine else None
    dy = torch.randn(6, 50, generator=generator)
    got = _layer_norm_grads(
        lambda a, w, b: layer_norm(
            a.to(DEVICE),
            (50,),
            w if w is None else w.to(DEVICE),
            b if b is None else b.to(DEVICE),
            stats=stats,
            backend="triton",
        ),
        x,
        weight,
        bias,
        dy.to(DEVICE),
    )
    ref = _layer_norm_grads(
        lambda a, w, b: numerics.reference_layer_norm(a, (50,), w, b),
        x.double(),
        None if weight is None else weight.double(),
        None if bias is None else bias.double(),
        dy.double(),
    )
    for g, r in zip(got, ref):
        assert ((g.cpu().double() - r).norm() / r.norm()).item() < 2e-5


@pytest.mark.parametrize(
    "weight, bias, shape",
    [
        (torch.randn(16)[::2], torch.randn(8), (8,)),  # a strided weight
        (torch.full((1,), 2.0).expand(8), torch.randn(24)[::3], (8,)),  # expanded weight, strided bias
        (torch.randn(4, 2).t(), None, (2, 4)),  # a transposed weight over two dimensions
        (None, torch.randn(2, 4), (2, 4)),  # bias only, over two dimensions: db keeps its shape
    ],
    ids=["strided", "expanded", "transposed", "bias-only-2d"],
)
def test_layer_norm_kernel_takes_weights_of_any_layout(weight, bias, shape):
    # the kernel reads n contiguous values; against autograd through float64 LayerNorm (tolerance as
    # in the test above: float32 sums in another order)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, *shape, generator=generator)
    dy = torch.randn(3, *shape, generator=generator)
    got = _layer_norm_grads(
        lambda a, w, b: layer_norm(a.to(DEVICE), shape, w if w is None else w.to(DEVICE),
                                   b if b is None else b.to(DEVICE), backend="triton"),
        x, weight, bias, dy.to(DEVICE),
    )  # fmt: skip
    ref = _layer_norm_grads(
        lambda a, w, b: numerics.reference_layer_norm(a, shape, w, b),
        x.double(), None if weight is None else weight.double(), None if bias is None else bias.double(),
        dy.double(),
    )  # fmt: skip
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert ((g.cpu().double() - r).norm() / r.norm()).item() < 2e-5


def test_layer_norm_kernel_refuses_rows_wider_than_one_block():
    x = torch.zeros(1, kernels.LAYER_NORM_MAX_WIDTH + 1)
    with pytest.raises(ValueError, match=r"at most 1048576 elements, got rows of 1048577"):
        layer_norm(x, (x.shape[1],), backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_kernel_16_bit_inputs_match_qlab_numerics(dtype):
    # 16-bit in and out, float32 inside: the kernel and qlab.numerics.layer_norm round the same float32
    # results to 16 bits, so they differ by at most one 16-bit ulp where the float32 values straddle
    # a rounding boundary: |Δ| ≤ 2 ulp(|y|) with ulp = 2^-7 (bf16) or 2^-10 (fp16) relative.
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 96, generator=generator) * 3).to(dtype)
    weight, bias = (
        torch.randn(96, generator=generator).to(dtype),
        torch.randn(96, generator=generator).to(dtype),
    )
    out = layer_norm(x.to(DEVICE), (96,), weight.to(DEVICE), bias.to(DEVICE), backend="triton")
    assert out.dtype == dtype
    y, ref = out.cpu().float(), numerics.layer_norm(x, (96,), weight, bias).float()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert (y - ref).abs().le(2 * ulp * ref.abs().clamp_min(1e-3)).all()


def test_layer_norm_kernel_statistics_differ_where_the_numerics_notebook_says():
    # Rows with mean 3000 and standard deviation 1 (κ ≈ 3000, n = 256): E[x²] − E[x]² in float32
    # cancels away nearly every digit (u·κ² ≈ 0.5), Welford and two-pass keep them (u·κ ≈ 2e-4).
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=generator) + 3000.0
    exact = numerics.reference_layer_norm(x, (256,))
    errors = {
        stats: (layer_norm(x.to(DEVICE), (256,), stats=stats, backend="triton").cpu().double() - exact)
        .abs()
        .max()
        .item()
        for stats in STATS
    }
    assert errors["welford"] < 1e-2 and errors["two_pass"] < 1e-2
    assert errors["textbook"] > 30 * max(errors["welford"], errors["two_pass"])


def test_layer_norm_dispatch_refuses_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="stats"):
        layer_norm(x, (8,), stats="shifted", backend="triton")
    with pytest.raises(ValueError, match="normalized_shape|shape"):
        layer_norm(x, (7,), backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        layer_norm(x, (8,), backend="gpu")


# --- NVFP4 ------------------------------------------------------------------------------------------


def _nvfp4_inputs(special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(20, 72, generator=generator) * torch.logspace(-3, 3, 72)  # 20 rows, 72 = 4½ blocks
    if special:
        x[2, :16] = 0.0  # an all-zero block: the smallest block scale 2^-6
        x[3, 20] = float("nan")  # a NaN block: NaN scale, NaN values; global scale 1
    return x


@pytest.mark.parametrize("convention", ["nvidia", "torchao"])
@pytest.mark.parametrize("special", [False, True, "tiny"])
@pytest.mark.parametrize("block_2d", [False, True])
def test_nvfp4_kernel_matches_the_reference_bit_for_bit(block_2d, special, convention):
    # logspace(-3, 3) across the columns: blocks far below the tensor amax, where NVIDIA's block scales are
    # E4M3 subnormals or 0 and torchao's are floored at 2^-6; "tiny": amax ~1e-37, S_enc clamped to FLT_MAX
    x = _nvfp4_inputs(special is True) * (1e-40 if special == "tiny" else 1.0)
    spec = Q.NVFP4Spec(block_2d=block_2d, convention=convention)
    values, scales, global_scale = nvfp4_qdq(x.to(DEVICE), spec, backend="triton")
    ref_values, ref_scales, ref_global = nvfp4_qdq(x, spec, backend="reference")
    assert torch.equal(_bits(global_scale.cpu()), _bits(ref_global))
    assert torch.equal(_bits(scales.cpu()), _bits(ref_scales))
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


def test_nvfp4_stochastic_rounding_is_reproducible_and_unbiased():
    spec = Q.NVFP4Spec(rounding="stochastic")
    generator = torch.Generator().manual_seed(7)
    block = torch.rand(1, 16, generator=generator) * 5.0 + 0.3
    x = block.repeat(1024, 1)  # every row the same block: same scales, independent draws per element
    first, _, _ = nvfp4_qdq(x.to(DEVICE), spec, seed=11, offset=0, backend="triton")
    again, _, _ = nvfp4_qdq(x.to(DEVICE), spec, seed=11, offset=0, backend="triton")
    shifted, _, _ = nvfp4_qdq(x.to(DEVICE), spec, seed=11, offset=1 << 20, backend="triton")
    assert torch.equal(first, again) and not torch.equal(first, shifted)
    # each value is the RNE grid's neighbour below or above x (scales from the RNE reference)
    q = Q.quantize(block, Q.NVFP4Spec())
    multiplier = spec.block_multipliers(
        {"scales": q.scales, "global_scale": q.global_scale, "global_amax": q.global_amax}
    )  # what each E2M1 value is multiplied by: NVIDIA's fl(fl(s_block · amax) · fl(1/2688))
    first = first.cpu()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) * multiplier[0, 0]
    below = grid[(grid[None, :] <= block[0, :, None]).sum(-1) - 1]
    above = grid[torch.clamp((grid[None, :] < block[0, :, None]).sum(-1), max=7)]
    assert ((first == below) | (first == above)).all()
    # unbiased: the mean of 1024 draws per element is x within 5 standard errors, plus the 2^-15 bias
    # bound of 15 random bits, plus 1e-6 relative for the block amax (on the grid, but x·s⁻¹·s ≠ x exactly)
    gap = above - below
    standard_error = gap / 2 / 1024**0.5
    assert ((first.mean(0) - block[0]).abs() <= 5 * standard_error + gap * 2.0**-15 + 1e-6 * block[0]).all()


@pytest.mark.parametrize("count", [0, 1, 2, 3, 1023, 1024, 1025, 2047, 2049, 5001])
def test_noise_kernel_gives_the_draws_of_torch_stochastic_noise(count):
    """One launch against the five torch ops that define the draws (formats.torch_stochastic_noise):
    the same float32 bits from the same integers, across block edges and odd counts (the halves meet
    inside a block), and the generator left in the same state."""
    from qlab import formats
    from qlab.kernels.noise_triton import noise_from_bits

    ours = torch.Generator(device=DEVICE).manual_seed(123)
    theirs = torch.Generator(device=DEVICE).manual_seed(123)
    bits = torch.empty((count + 1) // 2, dtype=torch.int32, device=DEVICE).random_(generator=ours)
    drawn = noise_from_bits(bits, count)
    assert torch.equal(drawn, formats.torch_stochastic_noise((count,), theirs, DEVICE))
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_stochastic_noise_takes_the_kernel_where_it_runs(monkeypatch):
    """``kernels.noise.stochastic_noise`` routes a CUDA device's draws through the kernel (forced here for
    the test's device) and gives torch's numbers in the asked shape; bits of the wrong kind are refused."""
    from qlab import formats
    from qlab.kernels import noise_triton
    from qlab.kernels.noise_triton import noise_from_bits

    calls = []
    monkeypatch.setattr(noise, "_noise_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(noise_triton, "noise_from_bits", lambda *a: calls.append(a) or noise_from_bits(*a))
    drawn = kernels.stochastic_noise((3, 5), torch.Generator(device=DEVICE).manual_seed(4), DEVICE)
    expected = formats.torch_stochastic_noise((3, 5), torch.Generator(device=DEVICE).manual_seed(4), DEVICE)
    assert drawn.shape == (3, 5) and torch.equal(drawn, expected)
    assert len(calls) == 1  # the kernel made them
    monkeypatch.undo()
    assert noise._noise_kernel_runs_on("cuda") == (importlib.util.find_spec("triton") is not None)
    assert not noise._noise_kernel_runs_on("cpu")
    for bits in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="ceil.count/2. = 2"):
            noise_from_bits(bits.to(DEVICE), 4)


@pytest.mark.parametrize("granularity", ["tensor", "axis"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_fp8_kernel_codes_are_torch_float8_bytes(element, granularity):
    # independent reference: torch's own float8 cast of the saturated x · scale
    x = _fp8_inputs()[2:]  # inf → the format's max; all-zero and subnormal rows
    spec = Q.TensorwiseSpec(element, granularity=granularity)
    q = kernels.quantize(x.to(DEVICE), spec, backend="triton")
    _assert_same_qtensor(q, Q.quantize(x, spec))
    torch_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[element]
    limit = torch.finfo(torch_dtype).max
    expected = (x * q.scales.cpu()).clamp(-limit, limit).to(torch_dtype).view(torch.uint8)
    assert torch.equal(q.codes.cpu(), expected)


@pytest.mark.parametrize("element", ELEMENTS)
def test_fp8_kernel_codes_for_every_element_and_nan(element):
    x = _fp8_inputs()[:, :, :40]  # short rows: the interpreter runs one program per row
    if element not in ("e4m3", "e5m2"):
        x = x[2:]  # FP6/FP4 have no NaN encoding (refused, as tested above)
    for spec in (Q.TensorwiseSpec(element), Q.TensorwiseSpec(element, granularity="axis", pow2=True)):
        for axis in (-1, 0):
            _assert_same_qtensor(
                kernels.quantize(x.to(DEVICE), spec, axis, backend="triton"), Q.quantize(x, spec, axis)
            )


def test_quantize_runs_the_reference_for_what_no_kernel_covers_and_triton_refuses_it():
    """kernels.quantize is the entry point for every spec: what no kernel covers (NVFP4, stochastic
    rounding, MX blocks of 16, a fixed per-row scale) gives the reference's QTensor; forcing the
    Triton backend on such a call is refused, naming the backend."""
    x = torch.randn(4, 32)
    generator = torch.Generator().manual_seed(3)
    for spec, kwargs in (
        ("nvfp4", {}),
        (Q.TensorwiseSpec("e4m3", rounding="stochastic"), {"generator": generator}),
        (Q.MXSpec("e4m3", block_size=16), {}),
        ("fp8_e4m3_rowwise", {"scale": 2.0}),
    ):
        generator.manual_seed(3)
        ours = kernels.quantize(x, spec, **kwargs)
        generator.manual_seed(3)
        _assert_same_qtensor(ours, Q.quantize(x, spec, **kwargs))
        with pytest.raises(ValueError, match="backend 'triton'"):
            kernels.quantize(x, spec, backend="triton", **kwargs)
    _assert_same_qtensor(kernels.quantize(x, "mxfp8", backend="cpu"), Q.quantize(x, "mxfp8"))


# --- QuantLinear through the kernels -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "mxfp8", "mxfp4", "nvfp4"])
def test_quantlinear_with_kernel_qdq_is_bit_identical(monkeypatch, recipe, dtype):
    # on CUDA QuantLinear's qdq runs in the kernels (kernels.qdq); here "auto" is pointed at Triton's
    # interpreter. Operands the kernels do not cover (SR gradients, NVFP4's Hadamard) stay in qlab.quantize.
    from qlab.nn import QuantLinear

    torch.manual_seed(0)
    reference = QuantLinear(64, 48, recipe=recipe, gemm="emulated", dtype=dtype).to(DEVICE)
    through_kernels = QuantLinear(64, 48, recipe=recipe, gemm="emulated", dtype=dtype).to(DEVICE)
    through_kernels.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=generator).to(dtype).to(DEVICE)
    dy = torch.randn(32, 48, generator=generator).to(dtype).to(DEVICE)
    launched = []

    def auto_backend(t):
        launched.append(t.shape)
        return "triton"

    results = []
    for layer, patch in ((reference, False), (through_kernels, True)):
        with monkeypatch.context() as context:
            if patch:
                context.setattr(kernels, "_auto_backend", auto_backend)
            else:
                context.setattr(kernels, "_auto_backend", lambda t: "cpu")
            leaf = x.clone().requires_grad_(True)
            y = layer(leaf)
            y.backward(dy)
        results.append((y, leaf.grad, layer.weight.grad))
    assert len(launched) >= 3  # x and W in the forward, and at least one backward operand
    for got, want in zip(results[1], results[0]):
        assert torch.equal(_bits(got.cpu()), _bits(want.cpu()))


@pytest.mark.parametrize("spec", ["mxfp8", "fp8_e4m3_rowwise", Q.NVFP4Spec(block_2d=True), "nvfp4"])
def test_kernel_qdq_along_axis_0_matches_the_torch_layout(spec):
    # a GEMM's algorithm (and so its last bits on CUDA) can depend on its operands' strides: kernels.qdq
    # must hand QuantLinear what qlab.quantize.qdq would, bits and strides
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(5))
    want = Q.qdq(x, spec, 0)
    got = kernels.qdq(x.to(DEVICE), spec, 0, backend="triton")
    assert got.stride() == want.stride() == (48, 1)
    assert torch.equal(_bits(got.cpu()), _bits(want))


def test_kernel_qdq_covers_and_falls_back():
    assert (
        kernels.covers("mxfp8")
        and kernels.covers("fp8_e4m3_rowwise")
        and kernels.covers(Q.NVFP4Spec(block_2d=True))
    )
    assert not kernels.covers(Q.NVFP4Spec(hadamard=True)) and not kernels.covers(
        Q.MXSpec("e2m1", rounding="stochastic")
    )
    assert not kernels.covers("int8") and not kernels.covers(Q.MXSpec("e4m3", block_size=16))
    x = torch.randn(
        3, 16, 32
    )  # NVFP4's 16×16 tiles on a 3-D tensor: the kernel wants 2-D, qlab.quantize takes it
    spec = Q.NVFP4Spec(block_2d=True)
    assert torch.equal(kernels.qdq(x, spec, backend="triton"), Q.qdq(x, spec))
    assert kernels.qdq(torch.empty(0, 32), "mxfp8", backend="triton").shape == (0, 32)


# --- Every tile gives the same bits ----------------------------------------------------------------


def _tuned_kernels():
    from qlab.kernels import fp8_triton, mx_triton, nvfp4_triton

    return {
        "amax": fp8_triton._amax_tuned,
        "fp8 per tensor": fp8_triton._scale_cast_tuned,
        "fp8 per row": fp8_triton._row_tuned,
        "mx": mx_triton._mx_tuned,
        "nvfp4": nvfp4_triton._nvfp4_tuned,
    }


def _tuned_cases():
    return [(name, index) for name, tuned in _tuned_kernels().items() for index in range(len(tuned.configs))]


@pytest.mark.parametrize("name,index", _tuned_cases())
def test_every_autotuned_tile_gives_the_reference_bits(monkeypatch, name, index):
    """On a GPU the tile of each kernel is chosen by timing; run each candidate here (the interpreter runs
    the one it is given) on inputs spanning several tiles, partial ones included, with special blocks."""
    tuned = _tuned_kernels()[name]
    monkeypatch.setattr(tuned, "first", tuned.configs[index])
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(37, 300, generator=generator) * torch.logspace(-3, 3, 300)  # 11,100 values: > 8192
    x[5, :40] = 0.0
    x[9, 64:96] = 1e-40
    if name in ("amax", "fp8 per tensor"):
        x[30, 250] = -7.5e3  # the amax, far from the first chunk
        specs = [Q.TensorwiseSpec("e4m3"), Q.TensorwiseSpec("e5m2", convention="torchao")]
    elif name == "fp8 per row":
        specs = [Q.TensorwiseSpec("e4m3", granularity="axis")]
    elif name == "mx":
        x[11, 32:64] = float("nan")
        specs = [Q.MXSpec("e4m3"), Q.MXSpec("e2m1", mode="rceil")]
    else:
        x[3, 20] = float("nan")
        specs = [Q.NVFP4Spec(), Q.NVFP4Spec(block_2d=True, convention="torchao")]
    for spec in specs:
        if isinstance(spec, Q.NVFP4Spec):
            got = nvfp4_qdq(x.to(DEVICE), spec, backend="triton")
            want = nvfp4_qdq(x, spec, backend="reference")
        elif isinstance(spec, Q.MXSpec):
            got = mx_qdq(x.to(DEVICE), spec, backend="triton")
            want = mx_qdq(x, spec, backend="reference")
            codes = kernels.quantize(x.to(DEVICE), spec, backend="triton")
            assert torch.equal(codes.codes.cpu(), Q.quantize(x, spec).codes)
        else:
            got = fp8_qdq(x.to(DEVICE), spec, backend="triton")
            want = fp8_qdq(x, spec, backend="reference")
            if name == "fp8 per tensor":  # delayed scaling: the same kernel, the scale given
                fixed = kernels.qdq(x.to(DEVICE), spec, scale=0.37, backend="triton")
                assert torch.equal(_bits(fixed.cpu()), _bits(Q.qdq(x, spec, scale=0.37))), spec
        for got_part, want_part in zip(got, want):
            assert torch.equal(_bits(got_part.cpu()), _bits(want_part)), (spec, got_part.shape)
