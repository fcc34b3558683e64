"""qlab.formats: exact casts, bit-exact against torch's native casts and torchao's FP4/FP6 reference.

The exhaustive inputs are every bfloat16 bit pattern (65536 values spanning zero, subnormals,
all binades up to 3.4e38, ±inf and NaN), widened to float32.
"""

import math

import pytest
import torch

from qlab import formats

ALL_BF16 = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
FINITE_BF16 = ALL_BF16[torch.isfinite(ALL_BF16)]


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype == torch.float32
    same = actual.view(torch.int32) == expected.view(torch.int32)
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    bad = ~(same | both_nan)
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. x -> {actual[bad][:5].tolist()} vs {expected[bad][:5].tolist()}"


# --- against torch's native casts -------------------------------------------------------------

def test_e4m3_saturating_equals_torch_float8_e4m3fn_on_every_bf16_value():
    # torch 2.13's CPU cast to float8_e4m3fn saturates (inf -> 448); NaN stays NaN
    assert_same_bits(formats.cast(ALL_BF16, "e4m3"), ALL_BF16.to(torch.float8_e4m3fn).float())


def test_e5m2_non_saturating_equals_torch_float8_e5m2_on_every_bf16_value():
    # torch's float8_e5m2 cast is IEEE-like: overflow past the rounding boundary 61440 gives inf
    assert_same_bits(formats.cast(ALL_BF16, "e5m2", saturate=False), ALL_BF16.to(torch.float8_e5m2).float())


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_ieee_16_bit_rne_equals_torch_on_random_float32_bit_patterns(name, dtype):
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([3.4028234663852886e38, -3.4028234663852886e38, 65519.0, 65520.0, 2.0 ** -25, 2.0 ** -24 * 1.5])])
    assert_same_bits(formats.cast(x, name, saturate=False), x.to(dtype).float())


# --- against torchao's reference FP4/FP6 quantizers (saturating, RNE) ----------------------------

@pytest.mark.parametrize("name, to_bits, from_bits", [
    ("e2m1", "f32_to_f4_unpacked", "f4_unpacked_to_f32"),
    ("e3m2", "f32_to_f6_e3m2_unpacked", "f6_e3m2_unpacked_to_f32"),
    ("e2m3", "f32_to_f6_e2m3_unpacked", "f6_e2m3_unpacked_to_f32"),
])
def test_fp4_fp6_equal_torchao_reference_on_every_finite_bf16_value(name, to_bits, from_bits):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    expected = getattr(kernels, from_bits)(getattr(kernels, to_bits)(FINITE_BF16))
    assert_same_bits(formats.cast(FINITE_BF16, name), expected.float())


# --- published format facts -----------------------------------------------------------------

@pytest.mark.parametrize("name, max_, min_normal, min_subnormal, emax, count", [
    # OCP FP8 and MX v1.0 specs; count = non-negative finite encodings
    ("e4m3", 448.0, 2 ** -6, 2 ** -9, 8, 127),
    ("e5m2", 57344.0, 2 ** -14, 2 ** -16, 15, 124),
    ("e3m2", 28.0, 2 ** -2, 2 ** -4, 4, 32),
    ("e2m3", 7.5, 1.0, 2 ** -3, 2, 32),
    ("e2m1", 6.0, 1.0, 0.5, 2, 8),
])
def test_format_table(name, max_, min_normal, min_subnormal, emax, count):
    fmt = formats.get_format(name)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.emax) == (max_, min_normal, min_subnormal, emax)
    values = fmt.values()
    assert len(values) == count and values[0] == 0 and values[-1] == max_ and values[1] == min_subnormal


def test_e2m1_values_are_the_published_eight():
    assert formats.get_format("e2m1").values().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_every_listed_value_casts_to_itself():
    for fmt in formats.FORMATS.values():
        if fmt.name in ("bf16", "fp16", "e8m0"):
            continue
        v = fmt.values().float()
        assert torch.equal(formats.cast(v, fmt), v)
        if isinstance(fmt, formats.FloatFormat):
            assert torch.equal(formats.cast(-v, fmt), -v)


# --- rounding modes: a table of ties and special cases ----------------------------------------

@pytest.mark.parametrize("x, rne, away, toward_zero", [
    (2.5, 2.0, 3.0, 2.0),      # tie between 2 (even mantissa) and 3
    (-2.5, -2.0, -3.0, -2.0),
    (5.0, 4.0, 6.0, 4.0),      # tie between 4 (mantissa 0) and 6 (mantissa 1)
    (0.25, 0.0, 0.5, 0.0),     # half the smallest subnormal
    (-0.25, -0.0, -0.5, -0.0),  # signed underflow keeps the sign
    (0.75, 1.0, 1.0, 0.5),     # tie between subnormal 0.5 (odd) and 1.0
    (5.9, 6.0, 6.0, 4.0),
    (7.0, 6.0, 6.0, 6.0),      # above max: saturates
    (1e30, 6.0, 6.0, 6.0),
])
def test_e2m1_rounding_table(x, rne, away, toward_zero):
    t = torch.tensor([x])
    for mode, expected in (("rne", rne), ("away", away), ("toward_zero", toward_zero)):
        out = formats.cast(t, "e2m1", rounding=mode)
        assert out.item() == expected and math.copysign(1, out.item()) == math.copysign(1, expected), mode


@pytest.mark.parametrize("name, x, expected", [
    ("e4m3", 464.0, 448.0),            # midpoint 448|480 rounds to even 448: not an overflow
    ("e4m3", 465.0, math.nan),         # past it: NaN (e4m3fn has no inf)
    ("e4m3", math.inf, math.nan),
    ("e5m2", 61440.0, math.inf),       # midpoint 57344|65536 rounds to even 65536 = inf
    ("e5m2", -1e6, -math.inf),
    ("e2m1", 100.0, 6.0),              # no inf/NaN encodings: always saturates
])
def test_non_saturating_overflow(name, x, expected):
    out = formats.cast(torch.tensor([x]), name, saturate=False).item()
    assert (math.isnan(out) and math.isnan(expected)) or out == expected


def test_exponent_read_from_bits_just_below_powers_of_two():
    # fp32 floor(log2(x)) rounds up for the largest values below 2^k; frexp does not
    below = torch.nextafter(torch.exp2(torch.arange(100, 128, dtype=torch.float32)), torch.tensor(0.0))
    assert_same_bits(formats.cast(below, "bf16", saturate=False), below.to(torch.bfloat16).float())


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.full((40_000,), 2.3)
    first = formats.cast(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(1))
    again = formats.cast(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert torch.equal(first, again)
    assert set(first.unique().tolist()) == {2.0, 3.0}
    p = 0.3  # P(round up) for 2.3 between 2 and 3; the mean's standard error is sqrt(p(1-p)/N)
    assert abs(first.double().mean().item() - 2.3) < 5 * math.sqrt(p * (1 - p) / x.numel())


def test_output_dtype_follows_input_and_nan_is_kept():
    x = torch.tensor([1.3, math.nan], dtype=torch.bfloat16)
    out = formats.cast(x, "e4m3")
    assert out.dtype == torch.bfloat16 and out[0].item() == 1.25 and math.isnan(out[1].item())


@pytest.mark.parametrize("call, error, message", [
    (lambda: formats.cast(torch.tensor([1.0]), "e9m9"), ValueError, "unknown element format 'e9m9'"),
    (lambda: formats.cast(torch.tensor([1.0]), "e4m3", rounding="up"), ValueError, "unknown rounding 'up'"),
    (lambda: formats.cast(torch.tensor([1]), "e4m3"), TypeError, "torch.int64"),
    (lambda: formats.cast(torch.tensor([math.nan]), "e2m1"), ValueError, "e2m1 has no NaN"),
    (lambda: formats.cast(torch.tensor([1.0]), "e4m3", generator=torch.Generator()), ValueError, "stochastic"),
])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
