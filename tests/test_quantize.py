"""qlab.quantize and qlab.scaling: every recipe against an independent reference.

References: torchao 0.18's MX and NVFP4 reference quantizers (``to_mx``/``to_dtype``,
``nvfp4_quantize``/``NVFP4Tensor``) and float8 tensorwise scaling, torch's native float8 casts,
float64 / ``fractions.Fraction`` / ``math.frexp`` arithmetic written here, and the figures of
docs/reference.md (OCP MX v1.0, TE). Where torchao 0.18 is wrong (tiny blocks, Inf blocks,
RCEIL just above a power of two) the tests pin qlab's documented behaviour and say why.

Bits are compared exactly wherever they are defined (codes, scale bytes, dequantized values that
are products of exact numbers). Everything runs eagerly (QLAB_COMPILE=0) except the one test marked
``compiled path``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qlab import formats, kernels, scaling
from qlab import quantize as Q
from qlab.kernels import compiled, cpu_qdq
from qlab.quantize import (
    IntSpec,
    MXSpec,
    NVFP4Spec,
    QTensor,
    TensorwiseSpec,
    dequantize,
    qdq,
    quantize,
    sqnr_db,
)


@pytest.fixture(autouse=True)
def eager_only(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")  # torch.compile costs seconds per spec; one test below opts in


# --- helpers ---------------------------------------------------------------------------------------


def assert_same_bits(actual, expected):
    """Same dtype, same bits (any NaN matches any NaN); -0 and +0 differ."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.float().reshape(-1), expected.float().reshape(-1)
    same = (a.view(torch.int32) == e.view(torch.int32)) | (torch.isnan(a) & torch.isnan(e))
    bad = ~same
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. {a[bad][:5].tolist()} vs {e[bad][:5].tolist()}"


def mixed_magnitudes(shape, block, low, high, seed, dtype=torch.float32):
    """randn, each block of ``block`` along the last axis scaled by 10^k with k uniform in [low, high]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randint(low, high + 1, (*shape[:-1], shape[-1] // block, 1), generator=g).double()
    return (x.reshape(*shape[:-1], -1, block) * 10.0**k).reshape(shape).to(dtype)


def torchao_mx():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    constants = pytest.importorskip("torchao.prototype.mx_formats.constants")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    dtypes = {
        "e4m3": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
        "e3m2": constants.DTYPE_FP6_E3M2,
        "e2m3": constants.DTYPE_FP6_E2M3,
        "e2m1": torch.float4_e2m1fn_x2,
    }
    return mx, config.ScaleCalculationMode, dtypes, kernels


def torchao_mx_reference(x, element, mode):
    """torchao's (scale bytes, element codes, dequantized) for MX blocks of 32 along the last axis."""
    mx, mode_enum, dtypes, kernels = torchao_mx()
    scale, data = mx.to_mx(x.contiguous(), dtypes[element], 32, mode_enum(mode))
    if element in ("e4m3", "e5m2"):
        codes = data.view(torch.uint8)
    elif element == "e2m1":
        codes = kernels.unpack_uint4(data)  # two codes per byte, first in the low nibble
    else:
        codes = data  # fp6: one unpacked code per byte
    return scale.view(torch.uint8), codes, mx.to_dtype(data, scale, dtypes[element], 32, x.dtype)


def torchao_nvfp4():
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    return nv, kernels


def mx_block(values, element="e4m3", mode="floor", n=32):
    """A 1×n float32 tensor starting with ``values``, the rest zeros, and its MX QTensor."""
    x = torch.zeros(1, n)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x, quantize(x, MXSpec(element, mode=mode))


def frexp_floor_log2(v: float) -> int:
    """floor(log2 v) for a positive float, exactly (frexp reads the exponent; no float log2)."""
    return math.frexp(v)[1] - 1


def frexp_ceil_log2(v: float) -> int:
    """ceil(log2 v) for a positive float, exactly."""
    mantissa, exponent = math.frexp(v)
    return exponent - 1 if mantissa == 0.5 else exponent


def f32(v: float) -> float:
    """v rounded to float32 (numpy's IEEE conversion; overflow gives inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def divide_f32(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator correctly rounded to float32: the quotient in float64, then rounded once.

    Double rounding through binary64 is innocuous for a quotient of floats (Figueroa: 53 >= 2·24 + 2).
    Not ``numerator / tensor``: torch's CPU scalar-by-tensor division multiplies by a rounded reciprocal.
    """
    return (numerator / denominator.double()).float()


MX_ELEMENTS = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]
MX_MODES = ["floor", "rceil", "ceil", "even"]
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# =================================================================================================
# MX against torchao's to_mx / to_dtype
# =================================================================================================


@pytest.mark.parametrize("mode", MX_MODES)
@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_mx_equals_torchao_to_mx_and_to_dtype(element, mode):
    # block amaxes from ~1e-21 to ~1e21: far above the 2^-118 region where torchao 0.18 quantizes
    # with scale 2^-126 but dequantizes with 2^-127 (see the special-block table for those)
    for dtype in (torch.float32, torch.bfloat16):
        for seed, shape in enumerate([(64, 128), (3, 5, 64), (1, 32)]):
            x = mixed_magnitudes(shape, 32, -20, 20, seed, dtype)
            where = f"{dtype} {shape}"
            ref_scale, ref_codes, ref_values = torchao_mx_reference(x, element, mode)
            q = quantize(x, MXSpec(element, mode=mode), axis=-1)
            assert torch.equal(q.scale_codes, ref_scale), where
            assert torch.equal(q.codes.reshape(shape), ref_codes.reshape(shape)), where
            assert_same_bits(dequantize(q), ref_values)
            assert_same_bits(qdq(x, MXSpec(element, mode=mode)), ref_values)


# =================================================================================================
# MX special blocks
# =================================================================================================

NAN, INF = math.nan, math.inf

# (name, element, mode, leading values of a 32-block (rest zeros), E8M0 byte, dequantized leading values,
#  whether torchao 0.18 gives the same byte and values)
MX_SPECIAL_BLOCKS = [
    ("all zero", "e4m3", "floor", [0.0], 0, [0.0], True),
    ("all zero rceil", "e4m3", "rceil", [0.0], 0, [0.0], True),
    ("all zero fp4", "e2m1", "floor", [0.0], 0, [0.0], True),
    # a NaN anywhere: scale byte 0xFF and the whole block dequantizes to NaN
    ("nan", "e4m3", "floor", [1.0, NAN], 0xFF, [NAN, NAN], True),
    ("nan rceil", "e4m3", "rceil", [NAN, 2.0], 0xFF, [NAN, NAN], True),
    # Inf: OCP says the scale is NaN. torchao 0.18 FLOOR gives a finite byte (247) and RCEIL 254 and
    # dequantizes Inf to Inf and the rest to finite values, so it is not the reference here.
    ("inf floor", "e4m3", "floor", [1.0, INF], 0xFF, [NAN, NAN], False),
    ("-inf rceil", "e4m3", "rceil", [-INF, 1.0], 0xFF, [NAN, NAN], False),
    ("inf fp4", "e2m1", "floor", [INF], 0xFF, [NAN], False),
    # ±max of each element: floor(log2 max) = emax, so e = 0 (byte 127) and max is exact
    ("e4m3 ±max", "e4m3", "floor", [448.0, -448.0], 127, [448.0, -448.0], True),
    ("e5m2 ±max", "e5m2", "floor", [57344.0, -57344.0], 127, [57344.0, -57344.0], True),
    ("e3m2 ±max", "e3m2", "floor", [28.0, -28.0], 127, [28.0, -28.0], True),
    ("e2m3 ±max", "e2m3", "floor", [7.5, -7.5], 127, [7.5, -7.5], True),
    ("e2m1 ±max", "e2m1", "floor", [6.0, -6.0], 127, [6.0, -6.0], True),
    ("e4m3 ±max rceil", "e4m3", "rceil", [448.0, -448.0], 127, [448.0, -448.0], True),
    # FLOOR clipping (docs/reference.md §2): floor(log2 480) = 8, e = 0, 480 saturates to 448;
    # floor(log2 957) = 9, e = 1, 957/2 = 478.5 saturates to 448 -> 896
    ("480 floor", "e4m3", "floor", [480.0], 127, [448.0], True),
    ("957 floor", "e4m3", "floor", [957.0], 128, [896.0], True),
    ("7 fp4 floor", "e2m1", "floor", [7.0], 127, [6.0], True),  # floor(log2 7) = 2 = emax: 7 clips to 6
    # RCEIL: scale = 2^ceil(log2(amax/448)) = 2: 480/2 = 240 is exact; 957/4 = 239.25 -> 240 -> 960
    ("480 rceil", "e4m3", "rceil", [480.0], 128, [480.0], True),
    ("957 rceil", "e4m3", "rceil", [957.0], 129, [960.0], True),
    # smallest element subnormals at scale 1 (amax 448 / 6): 2^-9 exact, 2^-10 ties to 0 (even),
    # 3·2^-10 ties between 2^-9 (odd code 1) and 2^-8 (even code 2); e2m1: 0.25 ties to 0, 0.75 to 1
    (
        "e4m3 subnormals",
        "e4m3",
        "floor",
        [448.0, 2**-9, -(2**-9), 2**-10, 3 * 2**-10, 2**-11],
        127,
        [448.0, 2**-9, -(2**-9), 0.0, 2**-8, 0.0],
        True,
    ),
    (
        "e2m1 subnormals",
        "e2m1",
        "floor",
        [6.0, 0.5, 0.25, 0.75, -0.75],
        127,
        [6.0, 0.5, 0.0, 1.0, -1.0],
        True,
    ),
    # signed underflow keeps the sign: -2^-11 at scale 1 rounds to -0
    ("e4m3 signed underflow", "e4m3", "floor", [448.0, -(2**-11)], 127, [448.0, -0.0], True),
    ("e2m1 signed underflow", "e2m1", "floor", [6.0, -0.2], 127, [6.0, -0.0], True),
    # tiny blocks: floor(log2 2^-120) - 8 = -128 clamps to -127 (byte 0, X = 2^-127); 2^-120 / 2^-127 =
    # 128 is an e4m3 value, so the block is exact. torchao 0.18 quantizes with X clamped to 2^-126
    # (element 64) but dequantizes with 2^-127 and returns 2^-121; its RCEIL uses 1/X = 1 for byte 0
    # and returns 0. Neither is the reference here.
    ("2^-120 floor", "e4m3", "floor", [2.0**-120, -(2.0**-121)], 0, [2.0**-120, -(2.0**-121)], False),
    ("2^-120 rceil", "e4m3", "rceil", [2.0**-120], 0, [2.0**-120], False),
    ("2^-120 ceil", "e4m3", "ceil", [2.0**-120], 0, [2.0**-120], False),
    ("2^-126 fp4", "e2m1", "floor", [2.0**-126], 0, [2.0**-126], False),  # 2^-126 / 2^-127 = 2
    # the smallest float32 subnormal: byte 0, and 2^-149 · 2^127 = 2^-22 is below e4m3's 2^-9/2: 0
    ("2^-149", "e4m3", "floor", [2.0**-149], 0, [0.0], True),
    # the largest float32: floor(log2) = 127, e = 119, 3.4e38 / 2^119 = 511.99997 saturates to 448
    ("float32 max floor", "e4m3", "floor", [3.4028234663852886e38], 246, [448.0 * 2.0**119], True),
]


@pytest.mark.parametrize(
    "name, element, mode, values, byte, expected, torchao_agrees",
    MX_SPECIAL_BLOCKS,
    ids=[row[0] for row in MX_SPECIAL_BLOCKS],
)
def test_mx_special_block(name, element, mode, values, byte, expected, torchao_agrees):
    x, q = mx_block(values, element, mode)
    assert q.scale_codes.tolist() == [[byte]]
    rest = NAN if byte == 0xFF else 0.0
    full = torch.tensor(expected + [rest] * (32 - len(expected)), dtype=torch.float32)[None]
    assert_same_bits(dequantize(q), full)
    assert_same_bits(qdq(x, MXSpec(element, mode=mode)), full)
    if torchao_agrees:
        ref_scale, _, ref_values = torchao_mx_reference(x, element, mode)
        assert ref_scale.tolist() == [[byte]]
        assert_same_bits(ref_values, full)


def test_mx_all_zero_block_has_zero_codes():
    _, q = mx_block([0.0])
    assert q.codes.eq(0).all() and q.scales.tolist() == [[2.0**-127]]


def test_mx_signed_underflow_gives_the_negative_zero_code():
    _, q = mx_block([448.0, -(2**-11)])
    assert q.codes[0, 0, :2].tolist() == [0x7E, 0x80]  # 448 = S.1111.110; -0 = 1.0000.000
    assert (
        q.codes[0, 0, :2].tolist()
        == torch.tensor([448.0, -0.0]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    )


@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e3m2", "e2m1"])
def test_mx_block_scales_are_the_powers_of_two_of_the_scale_codes(element, mode):
    """qdq's fused scales (X, 1/X) are exactly 2^(byte − 127) and 2^(127 − byte) for the byte that
    mx_scale_codes gives (pinned against math.frexp below), NaN for a block with inf or NaN; bytes
    0 (X = 2^-127, a float32 subnormal) and 254 − emax included."""
    fmt = formats.get_format(element)
    amax = torch.tensor(
        [0.0, 2.0**-149, 2.0**-127, 1e-30, 1.5 * 2.0**-20, 0.7, 1.0, 448.0, 6e4, 1.9 * 2.0**100, 3.4e38]
        + [math.inf, math.nan]
    )
    codes = scaling.mx_scale_codes(amax, element, mode).tolist()
    scale, inverse, fused_codes = scaling.mx_block_scales(amax, fmt, mode)
    assert fused_codes.tolist() == codes
    assert codes[0] == 0 and codes[-1] == codes[-2] == 255
    for byte, x_scale, x_inverse in zip(codes, scale.tolist(), inverse.tolist()):
        if byte == 255:
            assert math.isnan(x_scale) and math.isnan(x_inverse)
        else:
            assert (x_scale, x_inverse) == (2.0 ** (byte - 127), 2.0 ** (127 - byte)), byte


def test_mx_even_mode_near_float32_max_gives_a_finite_scale():
    # EVEN: amax 3.3e38 rounded (half up) to 3 mantissa bits is 2^128, floor(log2) = 128, e = 128 - 8 = 120,
    # byte 247 (torchao 0.18 agrees). The block's other values must not become NaN.
    x, q = mx_block([3.3e38, 1.0], "e4m3", "even")
    assert q.scale_codes.tolist() == [[128 - 8 + 127]]
    assert not torch.isnan(dequantize(q)).any()


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_mx_fp16_near_its_max_dequantizes_beyond_fp16_to_inf_as_a_cast_does(mode, backend):
    # amax 65504: FLOOR's byte 2^(15-8) saturates 511.75 to 448 (57344); the other modes give 2^8, and
    # 65504/256 = 255.875 rounds (torch's float8 cast) to 256, so the block dequantizes to 65536. That
    # is float32's answer; in fp16, the default dtype, it is inf, as torch's own cast of 65536 is.
    x = torch.full((32,), 65504.0, dtype=torch.float16)
    spec = MXSpec("e4m3", mode=mode)
    wide = kernels.qdq(x, spec, dtype=torch.float32, backend=backend)
    scale = 2.0**7 if mode == "floor" else 2.0**8
    element = min(torch.tensor(65504.0 / scale).to(torch.float8_e4m3fn).float().item(), 448.0)
    assert wide.tolist() == [element * scale] * 32
    assert_same_bits(kernels.qdq(x, spec, backend=backend), wide.to(torch.float16))
    assert torch.isinf(kernels.qdq(x, spec, backend=backend)).all() == (mode != "floor")


@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_mx_scale_exponent_is_exact_just_below_at_and_above_powers_of_two(element, mode):
    # fp32 log2 rounds nextafter(2^k, 0) up to k (wrong floor) and nextafter(2^k, inf) down to k (wrong
    # ceil) once k is large; the expected byte comes from math.frexp on the exact float values.
    fmt = formats.get_format(element)
    for k in (-110, -20, -1, 0, 1, 20, 60, 100):
        anchor = fmt.max * 2.0**k if mode == "rceil" else 2.0**k
        for amax in (
            np.nextafter(np.float32(anchor), np.float32(0)),
            np.float32(anchor),
            np.nextafter(np.float32(anchor), np.float32(np.inf)),
        ):
            amax = float(amax)
            if mode == "rceil":  # the division amax / elem_max is rounded to float32 first (cuBLAS)
                e = frexp_ceil_log2(float(np.float32(amax) / np.float32(fmt.max)))
            elif mode == "ceil":
                e = frexp_ceil_log2(amax) - fmt.emax
            elif mode == "floor":
                e = frexp_floor_log2(amax) - fmt.emax
            else:  # even: amax rounded half-up to the element's mantissa width, then floor
                ulp = 2.0 ** (frexp_floor_log2(amax) - fmt.mantissa_bits)
                e = (
                    frexp_floor_log2(math.floor(Fraction(amax) / Fraction(ulp) + Fraction(1, 2)) * ulp)
                    - fmt.emax
                )
            byte = min(max(e, -127), 127) + 127
            x, q = mx_block([amax], element, mode)
            assert q.scale_codes.item() == byte, (k, amax)
            scaled = Fraction(amax) / Fraction(2) ** (byte - 127)
            if mode in ("rceil", "ceil"):
                assert scaled <= Fraction(fmt.max), (k, amax)  # these modes never saturate
            if mode != "rceil":  # torchao reads floor/ceil/even exponents from the bits too
                assert torchao_mx_reference(x, element, mode)[0].item() == byte, (k, amax)


def test_rceil_just_above_a_power_of_two_does_not_saturate():
    # Why RCEIL is not compared with torchao above: amax = 448·2^100 (1 + 2^-23/1.75), so descale = amax/448
    # rounds to 2^100 (1 + 2^-23) in float32; torchao 0.18 takes ceil(float32 log2(descale)), the log2
    # rounds to 100, so its byte is 227 and amax/2^100 = 448 (1 + 2^-23/1.75) saturates to 448. The true
    # ceil is 101: amax / 2^101 = 224 (1 + 2^-23/1.75) rounds to 224, and nothing saturates.
    amax = float(np.nextafter(np.float32(448.0 * 2.0**100), np.float32(np.inf)))
    assert Fraction(amax) == 448 * Fraction(2) ** 100 * (1 + Fraction(1, 2**23) / Fraction(7, 4))
    assert f32(amax / 448) == 2.0**100 * (1 + 2.0**-23)
    x, q = mx_block([amax], "e4m3", "rceil")
    assert q.scale_codes.item() == 101 + 127
    assert dequantize(q)[0, 0].item() == 224.0 * 2.0**101


def test_mx_partial_trailing_block_equals_zero_padding():
    x = mixed_magnitudes((3, 40), 8, -3, 3, seed=7)
    q = quantize(x, MXSpec("e4m3"))
    padded = quantize(F.pad(x, (0, 24)), MXSpec("e4m3"))
    assert torch.equal(q.codes, padded.codes) and torch.equal(q.scale_codes, padded.scale_codes)
    assert_same_bits(dequantize(q), dequantize(padded)[:, :40])
    # and the partial block's scale comes from its 8 real values only (torchao on the padded tensor)
    ref_scale, _, ref_values = torchao_mx_reference(F.pad(x, (0, 24)), "e4m3", "floor")
    assert torch.equal(q.scale_codes, ref_scale)
    assert_same_bits(dequantize(q), ref_values[:, :40])


def test_mx_without_padding_rejects_a_partial_block():
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        quantize(torch.ones(2, 40), MXSpec("e4m3", pad=False))


# =================================================================================================
# NVFP4 against torchao
# =================================================================================================


@pytest.mark.parametrize("global_scale", [True, False], ids=["global_scale", "block_scale_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_nvfp4_equals_torchao(dtype, global_scale):
    nv, kernels = torchao_nvfp4()
    for seed, (shape, spread) in enumerate(
        [((64, 128), 0), ((64, 128), 3), ((3, 5, 64), 6), ((1, 16), 2), ((32, 32), 12)]
    ):
        # per-16-block magnitudes 10^k, k in [-spread, spread]: with a global scale, blocks far below the
        # tensor amax hit the 2^-6 block-scale floor, which is exercised too
        x = mixed_magnitudes(shape, 16, -spread, spread, seed, dtype)
        per_tensor = nv.per_tensor_amax_to_scale(x.abs().amax()) if global_scale else None
        ref_scales, ref_packed = nv.nvfp4_quantize(x, 16, per_tensor)
        q = quantize(x, NVFP4Spec(global_scale=global_scale, convention="torchao"))
        where = f"{shape} spread {spread}"
        assert torch.equal(q.scale_codes.reshape(-1), ref_scales.view(torch.uint8).reshape(-1)), where
        assert torch.equal(q.codes.reshape(-1), kernels.unpack_uint4(ref_packed).reshape(-1)), where
        reference = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor)
        assert_same_bits(dequantize(q, torch.float32), reference.dequantize(torch.float32))
        assert_same_bits(dequantize(q), reference.dequantize(dtype))
        assert_same_bits(
            qdq(x, NVFP4Spec(global_scale=global_scale, convention="torchao")), reference.dequantize(dtype)
        )


def test_nvfp4_all_zero_tensor_gives_zeros_not_nan():
    # torchao convention: global scale 1 for amax 0, block scale clamped up to 2^-6 (torchao divides by 0)
    q = quantize(torch.zeros(2, 32), NVFP4Spec(convention="torchao"))
    assert q.global_scale.item() == 1.0
    e4m3_2_to_minus_6 = torch.tensor(2.0**-6).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert q.scale_codes.eq(e4m3_2_to_minus_6).all() and q.codes.eq(0).all()
    assert_same_bits(dequantize(q), torch.zeros(2, 32))
    # NVIDIA convention (TE's kernel): encode scale 1 for amax 0, block scale 0 (no floor), elements
    # 0 · min(1/0, FLT_MAX) = 0
    q = quantize(torch.zeros(2, 32), NVFP4Spec())
    assert q.global_scale.item() == 1.0 and q.scale_codes.eq(0).all() and q.codes.eq(0).all()
    assert_same_bits(dequantize(q), torch.zeros(2, 32))


def test_nvfp4_nan_block_dequantizes_to_nan_and_other_blocks_stay_finite():
    x = torch.ones(1, 32)
    x[0, 3] = NAN
    q = quantize(x, NVFP4Spec())
    out = dequantize(q)
    assert q.scale_codes[0, 0].item() == 0x7F  # the e4m3 NaN code
    assert torch.isnan(out[0, :16]).all()
    # documented (scaling.py): a NaN tensor amax gives global scale 1, i.e. the finite blocks are quantized
    # as with block scales only. Note what that costs: without the NaN the ones block is exact (global
    # 1/2688, block scale 448), with it the block scale is e4m3(1/6) = 0.171875 and 1.0 -> 6·0.171875.
    assert q.global_scale.item() == 1.0
    assert_same_bits(out[:, 16:], qdq(x[:, 16:], NVFP4Spec(global_scale=False)))
    assert out[0, 16].item() == 6 * 0.171875
    assert qdq(x[:, 16:], NVFP4Spec()).eq(1.0).all()


@pytest.mark.parametrize(
    "amax",
    [
        1e-30,
        1e-36,  # 1/global_scale overflows float32 here (torchao 0.18 then clamps every element to ±6)
    ],
)
def test_nvfp4_torchao_tiny_tensor_keeps_its_relative_values(amax):
    ratios = [1.0, 0.5, 0.1, -0.3]
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor(ratios) * amax
    # by the NVFP4 definition: global g = amax/2688, block scale amax/6/g = 448 (an e4m3 value), elements
    # RNE_e2m1(x / (448 g)) = RNE_e2m1(6 · ratio) = 6, 3, 0.5 (0.6), -2 (-1.8); dequantized = element · amax/6
    expected = torch.tensor([6.0, 3.0, 0.5, -2.0], dtype=torch.float64) / 6
    out = qdq(x, NVFP4Spec(convention="torchao"))[0, :4].double() / amax
    # rtol 1e-4: at amax 1e-36 the global scale is a float32 subnormal with ~6 significant digits
    assert torch.allclose(out, expected, rtol=1e-4, atol=0)


E2M1_GRID = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]


def _rne_e2m1(value: Fraction) -> Fraction:
    """Round an exact rational to E2M1 (saturating at ±6), ties to the even code."""
    magnitude = min(abs(value), Fraction(6))
    below = max(v for v in E2M1_GRID if v <= magnitude)
    above = min(v for v in E2M1_GRID if v >= magnitude)
    if magnitude - below != above - magnitude:
        nearest = below if magnitude - below < above - magnitude else above
    else:  # a tie: the grid value whose code is even
        nearest = below if E2M1_GRID.index(below) % 2 == 0 else above
    return nearest if value >= 0 else -nearest


@pytest.mark.parametrize("convention", ["nvidia", "torchao"])
def test_nvfp4_codes_follow_the_exact_scaled_values_at_every_magnitude(convention):
    """Regression: below amax ≈ 5·10⁻³⁴ the float32 inverse scale overflowed and every
    non-zero element was coded ±6. Over amax 1e-45 … 1e38, two blocks (the second 10⁴× smaller, so its
    block scale sits at the 2⁻⁶ floor for small tensors): every code must be the E2M1 rounding of
    x / (global · block) in exact rational arithmetic, given the stored float32 scales (the global scale
    is S_dec = fl(1/S_enc) in NVIDIA's convention) — except within 2⁻¹⁸ of a rounding tie, where the
    float32 evaluation order may legitimately round the other way."""
    pattern = torch.tensor([1.0, 0.5, 0.1, -0.3, 0.77, -0.05, 0.26, 0.0] * 2)
    ties = [Fraction(v) for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)]
    checked = 0
    for amax in np.logspace(-45, 38, 300):
        x = torch.cat([pattern * float(amax), pattern * float(amax) * 1e-4])[None]
        q = quantize(x, NVFP4Spec(convention=convention))
        if q.global_scale is None or not torch.isfinite(q.scales).all() or not (q.scales > 0).all():
            continue
        codes = formats.decode(q.codes.flatten(), "e2m1").tolist()
        global_scale = Fraction(q.global_scale.item())
        for value, code, block in zip(x.flatten().tolist(), codes, q.scales.flatten().repeat_interleave(16)):
            if convention == "nvidia" and global_scale * Fraction(block.item()) < Fraction(2) ** -126:
                # below amax ≈ 7.9·10⁻³⁶ TE's S_enc is clamped to FLT_MAX and fl(s_block · S_dec) is a float32
                # subnormal (or 0), so its element inverse min(1/…, FLT_MAX) is not the exact one: NVIDIA's
                # kernel flushes such blocks. The float32-order reference test below pins those bits.
                continue
            exact = Fraction(value) / (global_scale * Fraction(block.item()))
            if any(abs(abs(exact) - tie) <= tie * Fraction(1, 2**18) for tie in ties):
                continue
            assert Fraction(code) == _rne_e2m1(exact), (amax, value, code, float(exact))
            checked += 1
    assert checked > 8000


# --- NVFP4 in NVIDIA's convention: TransformerEngine's reference_nvfp4.py order, written out in numpy float32


def e4m3_rne(values: np.ndarray) -> np.ndarray:
    """float32 → nearest E4M3 value (ties to even), saturating at 448: torch's native float8 cast."""
    clamped = np.minimum(values, np.float32(448.0))
    return torch.from_numpy(clamped).to(torch.float8_e4m3fn).float().numpy()


def nvidia_nvfp4_reference(x: np.ndarray, tile_rows: int = 1):
    """(E2M1 values, E4M3 block scales per row and block, dequantized) for float32 rows blocked by 16,
    every operation one float32 rounding in TE's order (docs/reference.md §2):
    S_enc = min(2688 / amax, FLT_MAX) (1 for amax 0), S_dec = 1 / S_enc,
    s_b = E4M3(min(amax_b · (S_enc · fl(1/6)), 448)), element = RNE_E2M1(clamp(x · min(1/(s_b · S_dec),
    FLT_MAX), ±6)), dequantized = element · ((s_b · amax) · fl(1/2688))."""
    f = np.float32
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        amax = f(np.abs(x).max())
        encode = f(1.0) if amax == 0 else min(f(2688.0) / amax, f(np.finfo(np.float32).max))
        decode = f(1.0) / encode
        multiplier = encode * (f(1.0) / f(6.0))
        rows, columns = x.shape
        blocks = np.abs(x).reshape(rows // tile_rows, tile_rows, columns // 16, 16).max(axis=(1, 3))
        block_amax = np.repeat(blocks, tile_rows, axis=0)  # (rows, columns / 16)
        scales = e4m3_rne((block_amax * multiplier).astype(np.float32))
        inverse = np.minimum(f(1.0) / (scales * decode), np.finfo(np.float32).max).astype(np.float32)
        scaled = np.clip(x.reshape(rows, -1, 16) * inverse[..., None], -6, 6).astype(np.float32)
        elements = np.vectorize(lambda v: float(_rne_e2m1(Fraction(float(v)))))(scaled).astype(np.float32)
        elements = np.copysign(
            elements, scaled
        )  # a negative value that rounds to zero is −0 (code 8), as TE's kernel
        dequantize = (scales * amax) * (f(1.0) / f(2688.0))
        return elements, scales, (elements * dequantize[..., None]).reshape(rows, columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_nvidia_convention_equals_the_te_float32_order(dtype, block_2d):
    # block magnitudes over 10^±8 around the tensor's: many blocks below amax/28672 get E4M3 subnormal block
    # scales, which torchao's 2^-6 floor would change; amaxes from 1e-3 to 1e30 move the global scale
    for seed, spread, magnitude in [(0, 2, 1.0), (1, 8, 1.0), (2, 8, 1e-3), (3, 4, 1e30), (4, 12, 1e-20)]:
        x = (mixed_magnitudes((32, 64), 16, -spread, spread, seed, torch.float64) * magnitude).to(dtype)
        elements, scales, expected = nvidia_nvfp4_reference(x.float().numpy(), 16 if block_2d else 1)
        q = quantize(x, NVFP4Spec(block_2d=block_2d))
        where = f"seed {seed}"
        assert torch.equal(formats.decode(q.codes, "e2m1"), torch.from_numpy(elements)), where
        stored = scales[::16] if block_2d else scales
        assert_same_bits(q.scales, torch.from_numpy(stored))
        assert_same_bits(dequantize(q, torch.float32), torch.from_numpy(expected))
        assert_same_bits(
            qdq(x, NVFP4Spec(block_2d=block_2d), dtype=torch.float32), torch.from_numpy(expected)
        )
        if spread >= 8 and not block_2d:
            assert (q.scales < 2.0**-6).any() and (q.scales > 0).any(), "no subnormal block scale exercised"


def test_nvfp4_nvidia_convention_at_tiny_amax_matches_the_te_order():
    # below amax ≈ 7.9·10⁻³⁶ S_enc is clamped to FLT_MAX; NVIDIA's order is reproduced there too (codes;
    # the decode deliberately uses S_dec, not TE kernel's amax/2688 — see nvfp4_dequantize_multiplier)
    for amax in (7.0e-36, 1e-38, 1e-41, 1.4e-45):
        x = torch.tensor([[1.0, 0.5, 0.1, -0.3] * 4 + [0.01, -0.004, 0.002, 0.0] * 4]) * amax
        elements, scales, _ = nvidia_nvfp4_reference(x.numpy())
        q = quantize(x, NVFP4Spec())
        assert torch.equal(formats.decode(q.codes, "e2m1"), torch.from_numpy(elements)), amax
        assert_same_bits(q.scales, torch.from_numpy(scales))


def _product_hitting(target: float, multiplier: float) -> float:
    """A float32 b with fl(b · multiplier) == target exactly: the float32 neighbours of target/multiplier
    are tried in turn (setup only; the test's expectations do not depend on which b is found)."""
    low = high = np.float32(target / multiplier)
    for _ in range(64):
        for b in (low, high):
            if np.float32(b * np.float32(multiplier)) == np.float32(target):
                return float(b)
        low, high = np.nextafter(low, np.float32(0)), np.nextafter(high, np.float32(np.inf))
    raise AssertionError(f"no float32 b gives b · {multiplier} == {target}")


def test_nvfp4_nvidia_ties_round_to_even_on_block_scales_and_elements():
    # a tensor amax of 2688 makes S_enc = S_dec = 1 exactly, so the block scale is E4M3(amax_b · fl(1/6))
    rcp6 = float(np.float32(1.0) / np.float32(6.0))
    # block scale ties, hand-derived: 1.0625 lies midway between E4M3's 1 (mantissa 000) and 1.125 (001): 1;
    # 1.1875 midway between 1.125 (001) and 1.25 (010): 1.25; 0.0068359375 = 3.5·2^-9 midway between the
    # subnormals 3·2^-9 (011) and 4·2^-9 (100): 4·2^-9
    ties = {1.0625: 1.0, 1.1875: 1.25, 3.5 * 2.0**-9: 4 * 2.0**-9}
    rows = [[2688.0] + [0.0] * 15]
    for target in ties:
        rows.append([_product_hitting(target, rcp6)] + [0.0] * 15)
    # element ties: a block scale of exactly 4 (amax_b = 24 → fl(24 · fl(1/6)) rounds to 4 in E4M3) makes the
    # inverse 1/4 exact, so x = 4·t lands exactly on t: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4
    element_ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows.append([24.0] + [4 * t for t in element_ties] + [-4 * t for t in element_ties] + [0.0])
    rows.append([0.0] * 16)  # a zero block: scale 0, codes 0, dequantized 0
    x = torch.tensor(rows, dtype=torch.float32)
    q = quantize(x, NVFP4Spec())
    assert q.global_scale.item() == 1.0
    for row, expected in enumerate(ties.values(), 1):
        assert q.scales[row, 0].item() == expected, (row, q.scales[row, 0].item(), expected)
    assert q.scales[4, 0].item() == 4.0
    elements = formats.decode(q.codes[4, 0], "e2m1").tolist()
    rounded = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert elements == [6.0] + rounded + [-v for v in rounded] + [0.0]
    assert q.scales[5, 0].item() == 0.0 and q.codes[5].eq(0).all()
    assert torch.isfinite(dequantize(q)).all() and dequantize(q)[5].eq(0).all()
    # torchao's order, (amax_b / 6) / global, reaches other block scales on two of the three ties
    torchao = quantize(x, NVFP4Spec(convention="torchao"))
    assert not torch.equal(torchao.scales[1:4, 0], q.scales[1:4, 0])


def test_nvfp4_nvidia_keeps_small_blocks_that_torchao_floors():
    # rows from 1 down to 1e-6 of the tensor amax: from about amax/28672 down the torchao convention's 2^-6
    # block-scale floor leaves its elements only the bottom of the E2M1 grid, while NVIDIA's E4M3 subnormal
    # block scales keep ~20 dB until E4M3's subnormals run out too (near 1e-5·amax: both lose everything)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(0, -6, 64)[:, None]
    nvidia, torchao = qdq(x, NVFP4Spec()), qdq(x, NVFP4Spec(convention="torchao"))
    assert sqnr_db(x[:40], nvidia[:40]) == pytest.approx(
        sqnr_db(x[:40], torchao[:40]), abs=0.01
    )  # no floor hit
    for row in (52, 55):  # SQNR measured: NVIDIA 18.2 and 19.5 dB, torchao 12.4 and 6.2 dB
        assert sqnr_db(x[row], nvidia[row]) > 17 and sqnr_db(x[row], torchao[row]) < 13, row


def test_nvfp4_2d_blocks_share_one_scale_per_16x16_tile():
    nv, kernels = torchao_nvfp4()
    # tiles with very different magnitudes; 40 rows pad to 48 (3 row tiles), 64 columns = 4 tiles
    g = torch.Generator().manual_seed(3)
    tile_mag = 10.0 ** torch.randint(-3, 4, (3, 4), generator=g).double()
    x = (
        torch.randn(48, 64, generator=g, dtype=torch.float64)
        * tile_mag.repeat_interleave(16, 0).repeat_interleave(16, 1)
    ).float()[:40]
    q = quantize(x, NVFP4Spec(block_2d=True, convention="torchao"))

    padded = F.pad(x, (0, 0, 0, 8))  # zero rows do not change a tile's amax
    tile_amax = padded.reshape(3, 16, 4, 16).abs().amax(dim=(1, 3))
    global_scale = x.abs().amax() / (448.0 * 6.0)
    scale = torch.clamp(tile_amax / 6.0 / global_scale, 2.0**-6, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale_codes.reshape(3, 4), scale.view(torch.uint8))
    assert_same_bits(q.scales.reshape(3, 4), scale.float())
    assert_same_bits(q.global_scale, global_scale)

    # elements: torchao's 1x16 op order with the tile's scale: x · ((1/global) / scale), clamp, RNE to e2m1
    per_element_scale = scale.float().repeat_interleave(16, 0).repeat_interleave(16, 1)
    scaled = torch.clamp(padded * ((1.0 / global_scale) / per_element_scale), -6.0, 6.0)
    expected_codes = kernels.f32_to_f4_unpacked(scaled)
    assert torch.equal(q.codes.reshape(48, 64), expected_codes)
    expected = kernels.f4_unpacked_to_f32(expected_codes) * (global_scale * per_element_scale)
    assert_same_bits(dequantize(q), expected[:40])


def test_nvfp4_2d_on_a_3d_tensor_tiles_the_last_two_axes():
    x = mixed_magnitudes((2, 32, 32), 16, -2, 2, seed=4)
    q = quantize(x, NVFP4Spec(block_2d=True, convention="torchao"))
    # one global scale for the whole tensor, one e4m3 scale per 16x16 tile of each 32x32 matrix
    tile_amax = x.reshape(2, 2, 16, 2, 16).abs().amax(dim=(2, 4))
    scale = torch.clamp(tile_amax / 6.0 / (x.abs().amax() / 2688.0), 2.0**-6, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale_codes.reshape(2, 2, 2), scale.view(torch.uint8))
    # every element of a tile is dequantized with that tile's scale: |value| <= 6 · global · tile scale
    full = (x.abs().amax() / 2688.0) * scale.float().repeat_interleave(16, 1).repeat_interleave(16, 2)
    out = dequantize(q)
    assert (out.abs() <= 6 * full).all() and (out.abs() == 6 * full).any()


# --- random Hadamard transform -------------------------------------------------------------------


def test_hadamard_matrix_is_an_orthonormal_signed_sylvester_matrix():
    for size in (1, 2, 4, 16, 64):
        m = scaling.hadamard_matrix(size, seed=5).double()
        gram = m @ m.T
        # 1/sqrt(size) is exact in float32 for 1, 4, 16, 64; for 2 it is rounded (relative error <= 2^-24)
        tolerance = 0.0 if size in (1, 4, 16, 64) else 2.0**-22
        assert (gram - torch.eye(size, dtype=torch.float64)).abs().max().item() <= tolerance
        # D·H/sqrt(n): row i times (-1)^popcount(i & j) · sqrt(n) is one sign d_i for every j
        sylvester = torch.tensor(
            [[(-1.0) ** bin(i & j).count("1") for j in range(size)] for i in range(size)], dtype=torch.float64
        )
        signs = torch.round(m * sylvester * math.sqrt(size))
        assert torch.equal(signs, signs[:, :1].expand(-1, size)) and signs.abs().eq(1).all()


def test_hadamard_matrix_is_deterministic_per_seed_and_differs_across_seeds():
    assert torch.equal(scaling.hadamard_matrix(16, 3), scaling.hadamard_matrix(16, 3))
    matrices = [scaling.hadamard_matrix(16, seed) for seed in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert not torch.equal(matrices[i], matrices[j]), (i, j)


def test_hadamard_transform_rounds_as_the_float32_butterfly_in_every_layout():
    """Bits pinned against a scalar numpy float32 butterfly written here (x/4, signs, then sums and
    differences at strides 8, 4, 2, 1), along the last axis and along axis 0, eager and inverse:
    so a rewrite for speed cannot change the rounding, nor make it depend on the layout."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 32, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 32), generator=g).float())
    signs = np.sign(scaling.hadamard_matrix(16, seed=6)[:, 0].numpy())

    def butterfly(chunk, inverse):
        v = [np.float32(c) * np.float32(0.25) for c in chunk]
        if not inverse:
            v = [a * np.float32(s) for a, s in zip(v, signs)]
        for stride in (8, 4, 2, 1):
            for i in range(16):
                if i & stride == 0:
                    v[i], v[i + stride] = v[i] + v[i + stride], v[i] - v[i + stride]
        if inverse:
            v = [a * np.float32(s) for a, s in zip(v, signs)]
        return v

    for inverse in (False, True):
        expected = torch.tensor(
            [[b for k in range(0, 32, 16) for b in butterfly(row[k : k + 16], inverse)] for row in x.numpy()]
        )
        along_rows = scaling.hadamard_transform(x, seed=6, inverse=inverse)
        along_axis_0 = scaling.hadamard_transform(x.T.contiguous(), seed=6, inverse=inverse, dim=0).T
        assert torch.equal(along_rows.view(torch.int32), expected.view(torch.int32))
        assert torch.equal(along_axis_0.view(torch.int32), expected.view(torch.int32))


def test_hadamard_transform_preserves_dot_products_along_the_axis():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 8, 64, generator=g)
    m = scaling.hadamard_matrix(16, seed=2).double()
    # exact check in float64: (x M)·(y M) = x M Mᵀ yᵀ = x·y chunk by chunk
    xm = (x.double().reshape(8, 4, 16) @ m).reshape(8, 64)
    ym = (y.double().reshape(8, 4, 16) @ m).reshape(8, 64)
    exact = (x.double() * y.double()).sum(-1)
    assert torch.allclose((xm * ym).sum(-1), exact, rtol=0, atol=1e-12)
    # qlab's float32 transform equals x M up to float32 rounding of 16-term sums of ±x/4
    tx = scaling.hadamard_transform(x, seed=2)
    bound = (
        16 * 2.0**-24 * (x.double().abs().reshape(8, 4, 1, 16).sum(-1) / 4).expand(8, 4, 16).reshape(8, 64)
    )
    assert ((tx.double() - xm).abs() <= bound).all()
    ty = scaling.hadamard_transform(y, seed=2)
    # dot products of float32-transformed vectors: 64 products with relative error ~ 2^-20 each
    assert torch.allclose(
        (tx.double() * ty.double()).sum(-1),
        exact,
        rtol=0,
        atol=1e-5 * (x.double().abs() * y.double().abs()).sum(-1).max().item(),
    )
    back = scaling.hadamard_transform(tx, seed=2, inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=1e-5 * x.abs().max().item())


def test_nvfp4_with_hadamard_quantizes_the_rotated_tensor_and_rotates_back():
    nv, kernels = torchao_nvfp4()
    x = mixed_magnitudes((16, 64), 16, -1, 1, seed=9)
    spec = NVFP4Spec(hadamard=True, hadamard_seed=4, convention="torchao")
    q = quantize(x, spec)
    rotated = scaling.hadamard_transform(x, seed=4)  # checked against float64 above
    ref_scales, ref_packed = nv.nvfp4_quantize(rotated, 16, nv.per_tensor_amax_to_scale(rotated.abs().amax()))
    assert torch.equal(q.scale_codes.reshape(-1), ref_scales.view(torch.uint8).reshape(-1))
    assert torch.equal(q.codes.reshape(-1), kernels.unpack_uint4(ref_packed).reshape(-1))
    out = qdq(x, spec)
    # error bound: in the rotated domain each element errs by at most one block step (half the e2m1 gap
    # of 2 at the top binade) times the block's scale s <= (block amax / 6)(1 + 2^-4) (e4m3 rounding);
    # the inverse rotation is orthonormal, so the L2 error per 16-chunk is bounded by sqrt(16) of that
    block_amax = rotated.abs().reshape(16, 4, 16).amax(-1).double()
    bound = torch.sqrt((16 * (block_amax * (1 + 2**-4) / 6) ** 2).sum(-1)) * (1 + 1e-5)
    err = (out.double() - x.double()).reshape(16, 4, 16).pow(2).sum((-2, -1)).sqrt()
    assert (err <= bound).all()
    assert not torch.equal(
        out, qdq(x, NVFP4Spec(convention="torchao"))
    )  # the rotation really changed the quantization


# =================================================================================================
# Tensorwise FP8 (TE current scaling)
# =================================================================================================


def tensorwise_formula(x, element, scale, convention="nvidia"):
    """TE's current scaling: stored = sat_fp8(x · scale); dequantized = stored · fl(1/scale) (TE, cuBLAS)
    or stored / scale (torchao)."""
    fp8_max = torch.finfo(FP8_DTYPES[element]).max
    stored = (x.float() * scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPES[element]).float()
    if convention == "torchao":
        return (stored / scale).to(x.dtype)
    return (stored * divide_f32(1.0, scale)).to(x.dtype)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tensorwise_equals_the_te_formula_and_torchao(element, dtype):
    x = mixed_magnitudes((32, 64), 16, -4, 4, seed=1, dtype=dtype)
    amax = x.float().abs().amax()
    scale = divide_f32(torch.finfo(FP8_DTYPES[element]).max, amax)  # correctly rounded, as torchao
    q = quantize(x, TensorwiseSpec(element))
    assert_same_bits(q.scales, scale)
    assert_same_bits(qdq(x, TensorwiseSpec(element)), tensorwise_formula(x, element, scale))
    assert_same_bits(dequantize(q), tensorwise_formula(x, element, scale))
    fp8_max = torch.finfo(FP8_DTYPES[element]).max
    stored = (x.float() * scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPES[element])
    assert torch.equal(q.codes.reshape(-1), stored.view(torch.uint8).reshape(-1))
    # torchao's float8 tensorwise (scale in float64 then float32; Figueroa: same rounding as float32 division)
    utils = pytest.importorskip("torchao.float8.float8_utils")
    scaling_utils = pytest.importorskip("torchao.float8.float8_scaling_utils")
    training = pytest.importorskip("torchao.float8.float8_training_tensor")
    assert_same_bits(q.scales, utils.amax_to_scale(amax, FP8_DTYPES[element]))
    t = scaling_utils.hp_tensor_to_float8_dynamic(x, FP8_DTYPES[element], training.LinearMMConfig())
    torchao_q = quantize(x, TensorwiseSpec(element, convention="torchao"))
    assert torch.equal(torchao_q.codes, q.codes)  # the conventions differ in dequantize only
    assert_same_bits(dequantize(torchao_q), t.to_original_precision())
    assert_same_bits(dequantize(torchao_q), tensorwise_formula(x, element, scale, "torchao"))
    # the two dequantized values are at most one ulp (of the result's dtype) apart
    ulp = torch.finfo(dtype).eps * dequantize(q).float().abs()
    assert ((dequantize(q).float() - dequantize(torchao_q).float()).abs() <= ulp).all()


def test_tensorwise_pow2_scale_is_the_power_of_two_at_or_below_the_plain_scale():
    for seed in range(5):
        x = mixed_magnitudes((8, 32), 32, -30, 30, seed)
        plain = quantize(x, TensorwiseSpec("e4m3")).scales.item()
        q = quantize(x, TensorwiseSpec("e4m3", pow2=True))
        expected = 2.0 ** frexp_floor_log2(plain)
        assert q.scales.item() == expected and expected <= plain < 2 * expected
        assert_same_bits(dequantize(q), tensorwise_formula(x, "e4m3", torch.tensor(expected)))


@pytest.mark.parametrize("special", [0.0, INF, NAN], ids=["zero", "inf", "nan"])
def test_tensorwise_amax_zero_inf_or_nan_gives_scale_one(special):
    # TE: amax 0, inf or NaN -> scale 1; then stored = sat(x), inf saturates to 448, NaN stays NaN
    x = torch.zeros(4, 8) if special == 0.0 else torch.tensor([[1.5, special, -3.0, 500.0]])
    q = quantize(x, TensorwiseSpec("e4m3"))
    assert q.scales.item() == 1.0
    assert_same_bits(dequantize(q), tensorwise_formula(x, "e4m3", torch.tensor(1.0)))
    assert scaling.fp8_current_scale(torch.tensor(special)).item() == 1.0


def test_tensorwise_tiny_amax_gives_float32_max_scale():
    # 448 / 1e-45 overflows float32: the documented result is float32's max, not inf
    assert scaling.fp8_current_scale(torch.tensor(1e-45)).item() == torch.finfo(torch.float32).max


@pytest.mark.parametrize("axis", [-1, 0])
def test_tensorwise_axis_granularity_has_one_scale_per_slice(axis):
    x = mixed_magnitudes((16, 32), 32, -5, 5, seed=2)  # rows of different magnitudes
    q = quantize(x, TensorwiseSpec("e4m3", granularity="axis"), axis=axis)
    amax = x.abs().amax(dim=axis, keepdim=True)
    scale = divide_f32(448.0, amax)
    assert_same_bits(q.scales.reshape(-1), scale.reshape(-1))
    assert_same_bits(dequantize(q), tensorwise_formula(x, "e4m3", scale))


# =================================================================================================
# FP8 blockwise (DeepSeek-V3 / TE Float8BlockScaling), MXFP8 32×32 weight tiles, MX with the RHT
# =================================================================================================


def te_blockwise_reference(x: torch.Tensor, tile_rows: int, pow2: bool):
    """TE's blockwise_quantizer_reference on x (rows, columns), written out: zero-pad to whole 1×128
    tiles (or 128×128 blocks), scale = 448 / amax per tile (float64 quotient rounded once to float32;
    amax 0 → 1; pow2: frexp then 2^(e−1), the floor), stored = E4M3(clamp(x·scale, ±448)) by torch's own
    cast, dequantized = stored · fl(1/scale), cropped back."""
    rows, columns = x.shape
    padded = F.pad(x.float(), (0, -columns % 128, 0, -rows % tile_rows))
    tiles = padded.reshape(padded.shape[0] // tile_rows, tile_rows, -1, 128)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).double()
    scale = torch.where(amax == 0, 1.0, 448.0 / amax).float()
    if pow2:
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
    stored = (tiles * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    inverse = (1.0 / scale.double()).float()
    values = (stored.float() * inverse).reshape(padded.shape)[:rows, :columns]
    return stored.view(torch.uint8), scale.reshape(scale.shape[0], -1), values


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_blockwise_equals_te_reference(dtype, block_2d, pow2):
    # 200 × 300: partial tiles in both directions; tile magnitudes over 10^±6; one all-zero tile
    x = mixed_magnitudes((200, 384), 128, -6, 6, seed=5, dtype=torch.float64)[:, :300]
    x[:128, :128] = 0.0
    x = x.to(dtype)
    spec = Q.BlockwiseSpec("e4m3", block_2d=block_2d, pow2=pow2)
    codes, scales, expected = te_blockwise_reference(x, 128 if block_2d else 1, pow2)
    q = quantize(x, spec)
    assert_same_bits(q.scales, scales)  # one per tile: (rows, tiles) or (rows / 128, tiles)
    assert torch.equal(q.codes, codes.reshape(q.codes.shape))  # the padded layout (rows, tiles, 128)
    assert_same_bits(dequantize(q, torch.float32), expected)
    assert_same_bits(qdq(x, spec, dtype=torch.float32), expected)
    assert_same_bits(qdq(x.T.contiguous(), spec, axis=0, dtype=torch.float32), expected.T.contiguous())
    if pow2:  # TE's default: every scale a power of two (mantissa 1/2 in frexp's convention)
        assert (torch.frexp(q.scales).mantissa == 0.5).all()


def test_blockwise_2d_weight_is_the_same_quantization_along_both_axes():
    # 128×128 blocks: fprop (axis −1) and dgrad (axis 0) see one quantized weight, as TE's 2D weights do
    w = mixed_magnitudes((256, 384), 128, -3, 3, seed=6)
    spec = Q.BlockwiseSpec("e4m3", block_2d=True)
    assert_same_bits(qdq(w, spec, axis=-1), qdq(w, spec, axis=0))
    assert not torch.equal(qdq(w, "fp8_blockwise", axis=-1), qdq(w, "fp8_blockwise", axis=0))


def test_mxfp8_2d_tiles_share_one_e8m0_scale():
    # TE's 2D MXFP8 reference (test_mxfp8_2d_quantize.py): one amax per 32×32 tile, e = ceil(log2(amax/448))
    # (RCEIL) as a biased byte, elements E4M3(x / 2^e) — checked with frexp and torch's float8 cast
    x = mixed_magnitudes((64, 96), 32, -5, 5, seed=7)
    tile_magnitude = 10.0 ** torch.arange(-3, 3).reshape(2, 3).double()
    x = (x.double() * tile_magnitude.repeat_interleave(32, 0).repeat_interleave(32, 1)).float()
    q = quantize(x, MXSpec("e4m3", mode="rceil", block_2d=True))
    assert q.scale_codes.shape == (2, 3)
    tile_amax = x.reshape(2, 32, 3, 32).abs().amax(dim=(1, 3)).double()
    for (i, j), amax in np.ndenumerate(tile_amax.numpy()):
        descale = float(np.float32(amax) / np.float32(448.0))
        assert q.scale_codes[i, j].item() == frexp_ceil_log2(descale) + 127, (i, j)
    scales = (2.0 ** (q.scale_codes.double() - 127)).float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    expected = (x / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales
    assert_same_bits(dequantize(q), expected)
    spec = MXSpec("e4m3", mode="rceil", block_2d=True)
    assert_same_bits(qdq(x, spec, axis=0), qdq(x, spec, axis=-1))  # the same tiles along either axis


def test_mx_with_hadamard_quantizes_the_rotated_tensor_and_rotates_back():
    x = mixed_magnitudes((16, 64), 32, -1, 1, seed=8)
    spec = MXSpec("e2m1", hadamard=True, hadamard_seed=3)
    rotated = scaling.hadamard_transform(x, seed=3)
    inside = qdq(rotated, MXSpec("e2m1"))
    assert_same_bits(quantize(x, spec).dequantize(), scaling.hadamard_transform(inside, seed=3, inverse=True))
    assert_same_bits(qdq(x, spec), scaling.hadamard_transform(inside, seed=3, inverse=True))


# =================================================================================================
# Delayed scaling
# =================================================================================================


def delayed_reference(amaxes_per_step, fmt_max, history_len, algorithm, margin):
    """Plain-Python TE delayed scaling: scale used at each step, from the amaxes of earlier steps."""
    history = [0.0] * history_len
    scale, used = 1.0, []
    for amaxes in amaxes_per_step:
        used.append(scale)
        step_amax = max(amaxes) if amaxes else 0.0
        if any(math.isnan(a) for a in amaxes):
            step_amax = NAN
        history = [step_amax] + history[:-1]
        amax = (
            (NAN if any(math.isnan(h) for h in history) else max(history))
            if algorithm == "max"
            else history[0]
        )
        if math.isfinite(amax) and amax > 0:
            candidate = f32(fmt_max / amax) / 2.0**margin  # float32 quotient (Figueroa: float64 then
            if math.isfinite(candidate):  # float32 rounds like a float32 division)
                scale = candidate
    return used, scale


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
@pytest.mark.parametrize(
    "history_len, margin, fmt", [(1, 0, "e4m3"), (3, 0, "e4m3"), (4, 2, "e5m2"), (1024, 1, "e4m3")]
)
def test_delayed_scaling_sequence_equals_reference(algorithm, history_len, margin, fmt):
    steps = [
        [3.0],
        [10.0, 2.0],
        [1.0],
        [],
        [0.5, 0.25, 0.75],
        [0.0],
        [INF],
        [2.0],
        [NAN],
        [4.0],
        [1e-45],
        [6.0],
        [1.0],
        [1.0],
        [1.0],
        [1.0],
        [1.0],
    ]
    fmt_max = formats.get_format(fmt).max
    expected_used, expected_final = delayed_reference(steps, fmt_max, history_len, algorithm, margin)
    ds = scaling.DelayedScaling(fmt, history_len=history_len, algorithm=algorithm, margin=margin)
    used = []
    for amaxes in steps:
        used.append(ds.scale.item())  # the scale quantizing step t is fixed before step t's amaxes are seen
        for a in amaxes:
            ds.observe(torch.tensor(a))
        ds.step()
    assert used == expected_used
    assert ds.scale.item() == expected_final
    assert len(ds.history) == history_len


def test_delayed_scaling_table():
    # max over a history of 3: 10 stays the max for three steps, then drops out
    ds = scaling.DelayedScaling("e4m3", history_len=3)
    scales = []
    for a in (10.0, 1.0, 1.0, 1.0):
        ds.observe(torch.tensor(a))
        scales.append(ds.step().item())
    assert scales == [f32(448 / 10)] * 3 + [448.0]
    # most_recent follows the newest amax; margin 2 divides by 4
    ds = scaling.DelayedScaling("e4m3", algorithm="most_recent", margin=2)
    for a in (10.0, 2.0):
        ds.observe(torch.tensor(a))
        ds.step()
    assert ds.scale.item() == 448 / 2 / 4
    # several observe() calls in a step are max-reduced
    ds = scaling.DelayedScaling("e5m2")
    for a in (1.0, 5.0, 3.0):
        ds.observe(torch.tensor(a))
    assert ds.step().item() == f32(57344 / 5)
    # zero, inf and NaN keep the previous scale
    for bad in (0.0, INF, NAN):
        ds = scaling.DelayedScaling("e4m3", history_len=1)
        ds.observe(torch.tensor(4.0))
        ds.step()
        ds.observe(torch.tensor(bad))
        assert ds.step().item() == 112.0, bad
    # a scale that would be subnormal (its reciprocal inf) or 0 keeps the previous one: always normal
    ds = scaling.DelayedScaling("e4m3", history_len=1, margin=127)
    ds.observe(torch.tensor(1e4))  # 448 / 1e4 / 2^127 ≈ 2.6e-40, subnormal in float32
    assert ds.step().item() == 1.0
    ds.observe(torch.tensor(1e-30))  # 448e30 / 2^127 ≈ 2.6e-6: normal, taken
    assert ds.step().item() == f32(f32(448 / f32(1e-30)) / 2.0**127)


def test_delayed_scaling_never_reads_a_value_back_and_follows_the_amax_device():
    """Meta tensors hold no values: a step that asked for one on the host (a Python `if` on a tensor,
    .item(), .cpu()) would raise here. History and scale move to the device of the amaxes observed, as
    a GPU run keeps them on the GPU (no synchronisation per step)."""
    ds = scaling.DelayedScaling("e4m3", history_len=4)
    for _ in range(3):
        ds.observe(torch.empty((), device="meta"))
        ds.observe(torch.empty((), device="meta"))
        scale = ds.step()
    assert scale.device.type == ds.history.device.type == "meta"
    assert ds.history.shape == (4,) and scale.shape == ()
    ds.step()  # a step without an observation rolls in a zero on the same device
    assert ds.history.device.type == "meta"


def test_delayed_scale_feeds_tensorwise_quantize():
    ds = scaling.DelayedScaling("e4m3")
    ds.observe(torch.tensor(7.0))
    ds.step()
    x = torch.tensor([1.0, -7.0, 9.0, 0.3])  # 9 · 64 = 576 saturates: delayed scales can be stale
    assert_same_bits(
        qdq(x, TensorwiseSpec("e4m3"), scale=ds.scale), tensorwise_formula(x, "e4m3", torch.tensor(64.0))
    )


# =================================================================================================
# Integer quantization
# =================================================================================================


def test_int8_symmetric_per_tensor_equals_the_formula():
    x = mixed_magnitudes((16, 64), 16, -2, 2, seed=3)
    scale = x.abs().amax() / 127  # float32, as the reference quantizers compute it
    codes = torch.round(x / scale).clamp(-128, 127)
    q = quantize(x, IntSpec(8))
    assert_same_bits(q.scales, scale)
    assert torch.equal(q.codes, codes.to(torch.int8))
    # dequantized = code · scale: the float64 product is exact (|code| < 2^8), so one rounding to float32.
    # An integer code has no sign of zero: + 0.0 turns the formula's -0 into +0
    expected = (codes.double() * scale.double()).float() + 0.0
    assert_same_bits(dequantize(q), expected)
    assert_same_bits(qdq(x, IntSpec(8)), expected)  # qdq has no -0 either: the same bits as the codes path


def test_int_rowwise_scales_and_zero_rows():
    x = mixed_magnitudes((6, 32), 32, -3, 3, seed=5)
    x[2] = 0.0
    q = quantize(x, IntSpec(4, granularity="axis"))
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))  # int4: qmax 7; a zero row gets scale 1
    assert_same_bits(q.scales, scale)
    expected = (torch.round(x / scale).clamp(-8, 7).double() * scale.double()).float() + 0.0  # no -0 code
    assert_same_bits(dequantize(q), expected)
    assert not torch.isnan(dequantize(q)).any() and dequantize(q)[2].eq(0).all()


def test_int_all_zero_tensor_is_exact_zeros_without_nan():
    for spec in (IntSpec(8), IntSpec(8, granularity="axis"), IntSpec(8, signed=False, symmetric=False)):
        out = qdq(torch.zeros(3, 5), spec)
        assert_same_bits(out, torch.zeros(3, 5))


def test_uint8_asymmetric():
    for seed in range(4):
        x = mixed_magnitudes((8, 32), 32, -2, 2, seed) + (seed - 1.5)  # ranges on both sides of 0 and offset
        x[0, 0] = 0.0
        q = quantize(x, IntSpec(8, signed=False, symmetric=False))
        lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
        assert q.scales.item() == f32(f32(hi - lo) / 255)
        zp = q.zero_point.item()
        assert zp == int(zp) and 0 <= zp <= 255 and zp == min(max(-round(lo / q.scales.item()), 0), 255)
        out = dequantize(q)
        assert out[0, 0].item() == 0.0  # zero is exactly representable: code zp maps back to 0
        # each value is within half a step of x; the slack covers the float32 roundings of x/scale and of
        # (code - zp)·scale, each at most 255·2^-24 steps (~1.5e-5)
        step = q.scales.item()
        assert ((out.double() - x.double()).abs() <= step * (0.5 + 2.0**-13)).all()
        assert q.codes.dtype == torch.uint8


def test_int_symmetric_fixed_scale_clamps_to_the_grid():
    x = torch.tensor([100.0, -100.0, 1.0, -0.2])
    # IntSpec's scale is the step (dequant = code · scale): 200 -> 127, -200 -> -128, 2, -0.4 -> -0
    assert qdq(x, IntSpec(8), scale=0.5).tolist() == [63.5, -64.0, 1.0, -0.0]


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_int_axis_granularity_along_each_axis(axis):
    x = mixed_magnitudes((4, 8, 32), 32, -3, 3, seed=6)
    amax = x.abs().amax(dim=axis, keepdim=True)
    expected = (torch.round(x / (amax / 127)).clamp(-128, 127).double() * (amax / 127).double()).float()
    assert_same_bits(quantize(x, IntSpec(8, granularity="axis"), axis=axis).dequantize(), expected + 0.0)
    assert torch.equal(qdq(x, IntSpec(8, granularity="axis"), axis=axis), expected)


# =================================================================================================
# QTensor
# =================================================================================================


def test_along_requantizes_from_high_precision_and_differs_from_transposed_codes():
    x = mixed_magnitudes((64, 64), 32, -3, 3, seed=8)
    q = quantize(x, "mxfp8", axis=-1)
    other = q.along(0)
    direct = quantize(x, "mxfp8", axis=0)
    assert isinstance(other, QTensor)
    assert other.axis == direct.axis == 0
    assert torch.equal(other.codes, direct.codes) and torch.equal(other.scale_codes, direct.scale_codes)
    assert_same_bits(dequantize(other), dequantize(direct))
    # blocks along the other axis have different amaxes: the values differ (docs/reference.md §2)
    assert not torch.equal(dequantize(other), dequantize(q))
    # axis=0 is the transpose quantized along its last axis, transposed back
    assert_same_bits(dequantize(other), qdq(x.T.contiguous(), "mxfp8", axis=-1).T)


def test_along_without_a_source_raises():
    q = quantize(torch.ones(2, 32), "mxfp8", keep_source=False)
    assert q.source is None
    with pytest.raises(ValueError, match="keep_source=False"):
        q.along(0)


# Bytes a low-precision implementation keeps, by hand from each format's definition (docs/reference.md §1):
# elements × element bits / 8, plus one scale per block (E8M0 / E4M3: 1 byte; float32: 4 bytes).
STORAGE_CASES = [
    # spec, shape, axis, bytes
    ("fp8_e4m3", (32, 64), -1, 32 * 64 + 4),  # one float32 scale for the tensor
    ("fp8_blockwise", (32, 64), -1, 32 * 64 + 32 * 4),  # one 1×128 block per row, partial (64 of 128)
    ("mxfp8", (32, 64), -1, 32 * 64 + 32 * 2),  # 2 E8M0 bytes per row
    ("mxfp8", (32, 64), 0, 32 * 64 + 64),  # along the columns: 1 block of 32 per column
    ("mxfp6_e3m2", (32, 64), -1, 32 * 64 * 6 // 8 + 32 * 2),
    ("mxfp4", (32, 64), -1, 32 * 64 // 2 + 32 * 2),
    ("nvfp4", (32, 64), -1, 32 * 64 // 2 + 32 * 4 + 4),  # E4M3 per 16, one float32 per-tensor scale
    ("nvfp4_2d", (32, 64), -1, 32 * 64 // 2 + 2 * 4 + 4),  # one E4M3 per 16×16 tile
    ("nvfp4", (3, 17), -1, 26 + 3 * 2 + 4),  # 51 four-bit codes round up to 26 bytes; 2 blocks a row
    ("int8_rowwise", (32, 64), -1, 32 * 64 + 32 * 4),  # a float32 step per row
    ("int4_rowwise", (32, 64), -1, 32 * 64 // 2 + 32 * 4),
    ("uint8_asymmetric", (32, 64), -1, 32 * 64 + 4 + 4),  # step and zero point for the tensor
]


@pytest.mark.parametrize(("spec", "shape", "axis", "expected"), STORAGE_CASES)
def test_storage_bytes_follow_the_format_definitions(spec, shape, axis, expected):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert Q.quantize(x, spec, axis=axis).storage_bytes() == expected


def test_packed_codes_for_fp4_equal_pack_fp4_and_torchao():
    x = mixed_magnitudes((4, 64), 32, -2, 2, seed=10)
    q = quantize(x, "mxfp4")
    assert torch.equal(q.packed_codes(), formats.pack_fp4(q.codes))
    mx, mode_enum, dtypes, _ = torchao_mx()
    _, packed = mx.to_mx(x, dtypes["e2m1"], 32, mode_enum("floor"))
    assert torch.equal(q.packed_codes().reshape(4, 32), packed.view(torch.uint8))
    with pytest.raises(ValueError, match="4-bit e2m1 elements, not e4m3"):
        quantize(x, "mxfp8").packed_codes()


PRESETS = list(Q.SPECS)


@pytest.mark.parametrize("name", PRESETS)
def test_qdq_equals_dequantize_of_quantize_for_every_preset(name):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((20, 48), (2, 3, 40)):
            x = mixed_magnitudes(shape, 8, -2, 2, seed=len(shape), dtype=dtype)
            out = qdq(x, name)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, dequantize(quantize(x, name)))  # as numbers (-0 == 0)
            assert_same_bits(out, dequantize(quantize(x, name)))  # and as bits
            q = quantize(x, name)
            assert q.shape == x.shape and q.dtype == dtype
            assert dequantize(q, torch.float32).dtype == torch.float32
            # qdq blocks a non-last axis in place (no transpose); quantize moves it last: same bits
            for axis in range(len(shape) - 1):
                assert_same_bits(qdq(x, name, axis), dequantize(quantize(x, name, axis)))


@pytest.mark.parametrize("name", list(Q.SPECS))
def test_axis_0_equals_transpose_quantized_along_last_axis(name):
    x = mixed_magnitudes((48, 32), 16, -3, 3, seed=11)
    assert_same_bits(qdq(x, name, axis=0), qdq(x.T.contiguous(), name, axis=-1).T)


# =================================================================================================
# Properties (hypothesis)
# =================================================================================================

PROPERTY = settings(max_examples=50, deadline=None, derandomize=True)


@st.composite
def blocked_tensors(draw, blocks=2, block=32):
    """float32 (blocks·block,) tensors whose blocks have independent magnitudes 2^-60 .. 2^60."""
    values = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=blocks * block, max_size=blocks * block))
    exponents = draw(st.lists(st.integers(-60, 60), min_size=blocks, max_size=blocks))
    x = torch.tensor(values, dtype=torch.float32).reshape(blocks, block)
    return (x * torch.exp2(torch.tensor(exponents, dtype=torch.float32))[:, None]).reshape(-1)


# families of specs; hypothesis draws the spec within a family together with the tensor
IDEMPOTENT_FAMILIES = {
    **{f"mx_{e}": [MXSpec(e, mode=m) for m in MX_MODES] for e in MX_ELEMENTS},
    "tensorwise": [
        TensorwiseSpec("e4m3"),
        TensorwiseSpec("e5m2"),
        TensorwiseSpec("e4m3", pow2=True),
        TensorwiseSpec("e4m3", granularity="axis"),
    ],
    # NVFP4 without a global scale: the block's amax maps to 6·s, whose scale is s again. With the global
    # scale (amax/2688), qdq changes the tensor amax and so the global scale: not idempotent by design.
    "nvfp4_no_global": [NVFP4Spec(global_scale=False), NVFP4Spec(global_scale=False, block_2d=True)],
}


@pytest.mark.parametrize("family", list(IDEMPOTENT_FAMILIES))
@PROPERTY
@given(x=blocked_tensors(), data=st.data())
def test_qdq_is_idempotent(family, x, data):
    spec = data.draw(st.sampled_from(IDEMPOTENT_FAMILIES[family]), label="spec")
    once = qdq(x.reshape(2, 32), spec)
    assert_same_bits(qdq(once, spec), once)


SIGN_SYMMETRIC_FAMILIES = {
    kind.__name__: [name for name, spec in Q.SPECS.items() if isinstance(spec, kind)]
    for kind in (MXSpec, TensorwiseSpec, NVFP4Spec)
}


@pytest.mark.parametrize("family", list(SIGN_SYMMETRIC_FAMILIES))
@PROPERTY
@given(x=blocked_tensors(), data=st.data())
def test_qdq_is_sign_symmetric(family, x, data):
    name = data.draw(st.sampled_from(SIGN_SYMMETRIC_FAMILIES[family]), label="preset")
    x = x.reshape(2, 32)
    spec = Q.get_spec(name)
    if isinstance(spec, NVFP4Spec) and spec.hadamard:
        # the rotation sums 16 terms; an IEEE sum of zeros of mixed signs is +0, so compare as numbers
        assert torch.equal(qdq(-x, name), -qdq(x, name))
    else:
        assert_same_bits(qdq(-x, name), -qdq(x, name))


def half_step(y: torch.Tensor, fmt) -> torch.Tensor:
    """Half the grid step of ``fmt`` at |y| (float64), from the format's definition."""
    exponent = torch.frexp(y.abs().double()).exponent.double() - 1
    exponent = exponent.clamp(min=1 - fmt.bias)
    return torch.exp2(exponent - fmt.mantissa_bits) / 2


@pytest.mark.parametrize("element", MX_ELEMENTS)
@PROPERTY
@given(x=blocked_tensors(), mode=st.sampled_from(MX_MODES))
def test_mx_rne_error_is_at_most_half_a_step_times_the_block_scale(element, mode, x):
    fmt = formats.get_format(element)
    q = quantize(x[None], MXSpec(element, mode=mode))
    scale = q.scales.double()[..., None]  # (1, blocks, 1): powers of two, exact
    y = x.double().reshape(1, -1, 32) / scale  # exact: a power-of-two division in float64
    error = (dequantize(q).double().reshape(1, -1, 32) - x.double().reshape(1, -1, 32)).abs()
    unsaturated = y.abs() <= fmt.max
    assert (error[unsaturated] <= (scale * half_step(y, fmt)).expand_as(y)[unsaturated]).all()
    # saturated elements (FLOOR) land on ±max exactly
    out = dequantize(q).double().reshape(1, -1, 32)
    assert torch.equal(out[~unsaturated], (torch.sign(y) * fmt.max * scale).expand_as(y)[~unsaturated])


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16"])
@PROPERTY
@given(values=st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=64))
def test_elementwise_cast_error_bound_and_monotonicity(name, values):
    fmt = formats.get_format(name)
    x = torch.tensor(sorted(values), dtype=torch.float32)
    for rounding in ("rne", "away", "toward_zero"):
        out = formats.cast(x, name, rounding=rounding)
        assert (out[1:] >= out[:-1]).all(), rounding  # x <= y implies cast(x) <= cast(y)
    out = formats.cast(x, name).double()
    inside = x.double().abs() <= fmt.max
    assert ((out - x.double()).abs()[inside] <= half_step(x, fmt)[inside]).all()
    assert (out.abs()[~inside] == fmt.max).all()  # saturation


@PROPERTY
@given(
    value=st.floats(-0.875, 0.875, width=32), element=st.sampled_from(MX_ELEMENTS), seed=st.integers(0, 2**31)
)
def test_mx_stochastic_rounding_is_unbiased_and_seeded(value, element, seed):
    fmt = formats.get_format(element)
    n = 4000
    x = torch.zeros(n, 32)
    x[:, 0] = 1.0  # amax 1: scale 2^-emax (FLOOR), and 1.0 / scale = 2^emax is exact
    x[:, 1] = value
    spec = MXSpec(element, rounding="stochastic")
    draws = qdq(x, spec, generator=torch.Generator().manual_seed(seed))[:, 1].double()
    again = qdq(x, spec, generator=torch.Generator().manual_seed(seed))[:, 1].double()
    assert torch.equal(draws, again)
    # exact neighbours lo <= y < lo + step of y = value / scale on the element grid; a draw is lo or
    # lo + step with P(up) = p, so the mean's standard deviation is step·sqrt(p(1-p)/n) (times scale)
    scale = 2.0**-fmt.emax
    y = Fraction(value) / Fraction(scale)
    step = Fraction(2) ** (max(frexp_floor_log2(abs(float(y))) if y else 0, 1 - fmt.bias) - fmt.mantissa_bits)
    lo = math.floor(y / step) * step
    p = float((y - lo) / step)
    assert set((draws / scale).tolist()) <= {float(lo), float(lo + step)}
    sd = float(step) * scale * math.sqrt(p * (1 - p) / n)
    assert abs(draws.mean().item() - value) <= 5 * sd + 1e-12  # 5 sigma: false alarm ~6e-7 per example


def test_stochastic_rounding_differs_across_seeds():
    x = torch.full((1, 1024), 0.3)
    spec = MXSpec("e2m1", rounding="stochastic")
    a = qdq(x, spec, generator=torch.Generator().manual_seed(1))
    b = qdq(x, spec, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a, b)


@pytest.mark.parametrize(
    "spec",
    [NVFP4Spec(hadamard=True), MXSpec("e2m1", hadamard=True), MXSpec("e2m3", block_size=128, hadamard=True)],
    ids=repr,
)
def test_noise_shape_of_a_rotated_spec_is_its_layout_shape(spec):
    """noise_shape skips the Hadamard transform (it keeps shapes): the shape of the layouts qdq and
    quantize actually build, rotation included, along each axis and with a partial block."""
    x = torch.randn(3, 40, 48)
    for axis in range(3):
        inplace = Q._inplace_applies(x, spec, axis)
        layout = Q._inplace_layout(x, spec, axis) if inplace else Q.to_layout(x, spec, axis)
        assert Q.noise_shape(x, spec, axis) == layout.shape
        assert Q.noise_shape(x, spec, axis, blocked=True) == Q.to_layout(x, spec, axis).shape


def test_qdq_writes_into_out_with_the_same_bits():
    """qdq(out=y) returns y holding qdq(x)'s bits, in float32 and into a bfloat16 result (the compiled
    path's out= is checked in test_compiled_path_is_bit_identical_to_eager)."""
    x = mixed_magnitudes((64, 96), 32, -12, 12, seed=3)
    x[0, :3] = torch.tensor([0.0, 2.0**-140, -3e5])
    for name, axis, backend in (
        ("mxfp8", -1, "reference"),
        ("mxfp8", 0, "cpu"),
        ("nvfp4", -1, "reference"),
        ("fp8_e4m3", 0, "cpu"),
    ):
        out = torch.full_like(x, 7.0)
        assert kernels.qdq(x, name, axis, backend=backend, out=out) is out
        assert_same_bits(out, qdq(x, name, axis))
    out16 = torch.empty_like(x, dtype=torch.bfloat16)
    assert qdq(x, "mxfp4", dtype=torch.bfloat16, out=out16) is out16
    assert_same_bits(out16, qdq(x, "mxfp4", dtype=torch.bfloat16))


def test_qdq_refuses_an_out_of_another_shape_dtype_or_sharing_x():
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        qdq(x, "mxfp8", out=[0.0] * 128)
    with pytest.raises(ValueError, match=r"x's shape \(4, 32\).*shape \(4, 31\)"):
        qdq(x, "mxfp8", out=torch.empty(4, 31))
    with pytest.raises(ValueError, match="torch.float32 tensor.*got a torch.bfloat16"):
        qdq(x, "mxfp8", out=torch.empty(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must not share memory with x"):
        qdq(x, "mxfp8", out=x)
    with pytest.raises(ValueError, match="must not share memory with x"):
        qdq(x[:, :16], "mxfp8", out=x[:, 8:24])  # a partial overlap


# =================================================================================================
# Compiled path (slow: torch.compile takes ~10-40 s on 2 cores)
# =================================================================================================


def test_compiled_path_is_bit_identical_to_eager(monkeypatch):
    """COMPILED PATH: kernels.qdq(backend="cpu") through torch.compile gives the reference's bits."""
    monkeypatch.setenv("QLAB_COMPILE", "1")
    try:
        torch.compile(lambda t: t * 2, fullgraph=True)(torch.ones(4))
    except Exception as error:  # no C++ compiler, unsupported platform, ...
        pytest.skip(f"torch.compile is unavailable: {error}")
    # a fresh cache: other tests in this process may have used up dynamo's recompile limit
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_compile_failed", set())
    monkeypatch.setattr(cpu_qdq, "available", lambda: False)  # MX: inductor's path, not the C kernel's
    from torch._dynamo.utils import counters

    x = mixed_magnitudes((256, 256), 32, -12, 12, seed=12)
    x[0] = 0.0
    x[1, :5] = torch.tensor([2.0**-149, 3.3e38, -(2.0**-130), 480.0, -957.0])
    # axis 0 compiles the transpose into the kernel; RHT compiles a matmul; 2D tiles a reshape
    for name, axis in (
        ("mxfp8", -1),
        ("mxfp8", 0),
        ("nvfp4", -1),
        ("nvfp4_rht", 0),
        ("nvfp4_2d", 0),
        ("fp8_e4m3", -1),
        ("int8_rowwise", 0),
    ):
        graphs = counters["stats"]["unique_graphs"]
        fast = kernels.qdq(x, name, axis, backend="cpu")
        key = (Q.get_spec(name), axis % x.dim(), x.dtype)
        assert key in compiled._compiled and key not in compiled._compile_failed, name
        assert counters["stats"]["unique_graphs"] > graphs, f"{name} did not run through torch.compile"
        assert_same_bits(fast, qdq(x, name, axis))
        if name in ("mxfp8", "nvfp4"):  # written in place by the compiled kernel
            out = torch.full_like(x, 7.0)
            assert kernels.qdq(x, name, axis, backend="cpu", out=out) is out
            assert key not in compiled._compile_failed
            assert_same_bits(out, fast)
    # stochastic rounding: the noise is drawn eagerly from the generator, so the bits match too
    for spec, axis in (
        (NVFP4Spec(hadamard=True, rounding="stochastic"), 0),
        (MXSpec("e2m1", rounding="stochastic"), -1),
    ):
        fast = kernels.qdq(x, spec, axis, generator=torch.Generator().manual_seed(5), backend="cpu")
        key = (spec, axis % x.dim(), x.dtype)
        assert key in compiled._compiled and key not in compiled._compile_failed
        assert_same_bits(fast, qdq(x, spec, axis, generator=torch.Generator().manual_seed(5)))


# Bad inputs: tests/test_bad_input.py holds the table for every module.


# --- fixes from review -----------------------------------------------------------------------------


def test_unsigned_symmetric_int_is_refused():
    with pytest.raises(ValueError, match="symmetric=False"):
        IntSpec(8, signed=False)


def test_along_keeps_a_fixed_scale():
    x = mixed_magnitudes((32, 48), 16, -2, 2, seed=3)
    q = quantize(x, "fp8_e4m3", scale=2.0).along(0)
    assert q.scales.item() == 2.0 and torch.equal(dequantize(q), qdq(x, "fp8_e4m3", 0, scale=2.0))


def test_empty_tensors():
    assert qdq(torch.empty(0, 64), "mxfp8").shape == (0, 64)
    with pytest.raises(ValueError, match="non-empty"):
        quantize(torch.empty(0, 64), "mxfp8")


def test_hadamard_dim_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\]"):
        scaling.hadamard_transform(torch.ones(2, 16), dim=5)


def test_sqnr_db_is_defined_where_a_ratio_has_a_zero():
    zeros, ones = torch.zeros(4), torch.ones(4)
    assert sqnr_db(zeros, zeros) == math.inf  # no noise: exact
    assert sqnr_db(zeros, ones) == -math.inf  # no signal, some noise
    assert math.isnan(sqnr_db(torch.tensor([math.nan, 1.0]), ones[:2]))
    # 10·log10(Σx² / Σ(x − x̂)²) by hand: signal 4, noise 4 · 0.25 = 1 → 10·log10(4)
    assert sqnr_db(ones, ones * 0.5) == pytest.approx(10 * math.log10(4), rel=1e-12)


# --- the reference and the fast entry point --------------------------------------------------------


def test_the_reference_qdq_runs_no_fast_path(monkeypatch):
    """qlab.quantize.qdq is eager torch ops only: with the C kernel and the compiled path made to
    fail, a large MX, NVFP4 and stochastic call still gives kernels.qdq's bits."""
    x = mixed_magnitudes((256, 4096), 32, -12, 12, seed=21)  # ≥ COMPILE_MIN_NUMEL elements
    calls = [
        ("mxfp8", {}),
        ("nvfp4", {}),
        (MXSpec("e2m1", rounding="stochastic"), {"generator": torch.Generator().manual_seed(3)}),
    ]
    expected = []
    for spec, kwargs in calls:
        if "generator" in kwargs:
            kwargs["generator"].manual_seed(3)
        expected.append(kernels.qdq(x, spec, **kwargs))

    def refuse(*args, **kwargs):
        raise AssertionError("the reference took a fast path")

    monkeypatch.setattr(cpu_qdq, "qdq", refuse)
    monkeypatch.setattr(compiled, "compiled_qdq", refuse)
    for (spec, kwargs), fast in zip(calls, expected):
        if "generator" in kwargs:
            kwargs["generator"].manual_seed(3)
        assert_same_bits(qdq(x, spec, **kwargs), fast)


def test_kernels_entry_points_take_every_argument_of_the_reference():
    """kernels.qdq and kernels.quantize give the reference's bits for calls no kernel covers too: a
    fixed scale, pre-drawn noise, a generator, an output tensor, NVFP4's QTensor."""
    x = mixed_magnitudes((32, 64), 32, -8, 8, seed=4)
    assert_same_bits(kernels.qdq(x, "fp8_e4m3", scale=2.0), qdq(x, "fp8_e4m3", scale=2.0))
    spec = NVFP4Spec(rounding="stochastic")
    drawn = formats.stochastic_noise(Q.noise_shape(x, spec), torch.Generator().manual_seed(1))
    assert_same_bits(kernels.qdq(x, spec, noise=drawn), qdq(x, spec, noise=drawn))
    ours, theirs = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    assert_same_bits(kernels.qdq(x, spec, 0, generator=ours), qdq(x, spec, 0, generator=theirs))
    assert torch.equal(ours.get_state(), theirs.get_state())  # the same stream consumed
    out = torch.empty_like(x)
    assert kernels.qdq(x, "mxfp4", out=out) is out and torch.equal(out, qdq(x, "mxfp4"))
    for name in ("nvfp4", "mxfp8", "fp8_e4m3", "int8_rowwise"):
        fast, reference = kernels.quantize(x, name), Q.quantize(x, name, keep_source=False)
        assert torch.equal(fast.codes, reference.codes) and torch.equal(fast.scales, reference.scales), name
    assert kernels.stochastic_noise((5, 7), torch.Generator().manual_seed(2)).equal(
        formats.stochastic_noise((5, 7), torch.Generator().manual_seed(2))
    )


def test_moved_names_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="moved to qlab.kernels.compiled.COMPILE_OPTIONS"):
        assert Q.COMPILE_OPTIONS is compiled.COMPILE_OPTIONS
    with pytest.warns(DeprecationWarning, match="moved to qlab.kernels.noise.drawn_noise"):
        assert formats.drawn_noise is kernels.noise.drawn_noise
    with pytest.warns(DeprecationWarning, match="moved to qlab.kernels.noise.register_noise_source"):
        assert formats.register_noise_source is kernels.noise.register_noise_source
    x = mixed_magnitudes((16, 64), 32, -8, 8, seed=5)
    with pytest.warns(DeprecationWarning, match="fast=.* is deprecated"):
        assert_same_bits(qdq(x, "mxfp8", fast=True), kernels.qdq(x, "mxfp8"))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        formats.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        Q.no_such_name  # noqa: B018


@pytest.mark.parametrize("spec_class", [Q.TensorwiseSpec, Q.BlockwiseSpec])
def test_an_eps_past_float32_is_refused_by_the_spec(spec_class):
    """eps is a float32 floor under amax: 1e39 passed the spec, then the reference refused it while the
    C kernel's float eps became inf and its output NaN."""
    with pytest.raises(ValueError, match=r"eps must be a finite number in \[0, 3.40"):
        spec_class(eps=1e39)


def test_a_per_row_fixed_scale_has_the_kept_axis_shape_and_a_scale_adds_no_dimension():
    """A flat per-row scale broadcast along the columns of a square x (and failed deep in torch on any
    other); a (1, 1, 1) scale turned a (4, 32) x into (1, 4, 32). Each row with its own scale is the
    per-tensor qdq of that row with that scale."""
    x = torch.ones(4, 4) * torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    scale = torch.tensor([[100.0], [10.0], [1.0], [0.1]])
    rows = [Q.qdq(x[i : i + 1], "fp8_e4m3", scale=float(scale[i])) for i in range(4)]
    assert torch.equal(Q.qdq(x, "fp8_e4m3_rowwise", scale=scale), torch.cat(rows))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 1\) for x of shape \(4, 4\)"):
        Q.qdq(x, "fp8_e4m3_rowwise", scale=scale.reshape(-1))
    with pytest.raises(ValueError, match="scale must have at most x's 2 dimensions"):
        Q.qdq(torch.randn(4, 32), "fp8_e4m3", scale=torch.ones(1, 1, 1))
