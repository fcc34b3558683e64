"""qlab.formats: exact casts, bit-exact against torch's native casts and torchao's FP4/FP6 reference.

The exhaustive inputs are every bfloat16 bit pattern (65536 values spanning zero, subnormals,
all binades up to 3.4e38, ±inf and NaN), widened to float32.
"""

import math

import pytest
import torch

from qlab import formats

ALL_BF16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
FINITE_BF16 = ALL_BF16[torch.isfinite(ALL_BF16)]


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype == torch.float32
    same = actual.view(torch.int32) == expected.view(torch.int32)
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    bad = ~(same | both_nan)
    assert not bad.any(), (
        f"{int(bad.sum())} mismatches, e.g. x -> {actual[bad][:5].tolist()} vs {expected[bad][:5].tolist()}"
    )


# --- against torch's native casts -------------------------------------------------------------


def test_e4m3_saturating_equals_torch_float8_e4m3fn_on_every_bf16_value():
    # torch 2.13's CPU cast to float8_e4m3fn saturates (inf -> 448); NaN stays NaN
    assert_same_bits(formats.cast(ALL_BF16, "e4m3"), ALL_BF16.to(torch.float8_e4m3fn).float())


def test_e5m2_non_saturating_equals_torch_float8_e5m2_on_every_bf16_value():
    # torch's float8_e5m2 cast is IEEE-like: overflow past the rounding boundary 61440 gives inf
    assert_same_bits(formats.cast(ALL_BF16, "e5m2", saturate=False), ALL_BF16.to(torch.float8_e5m2).float())


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_ieee_16_bit_rne_equals_torch_on_random_float32_bit_patterns(name, dtype):
    bits = torch.randint(
        -(2**31), 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64
    )
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat(
        [
            x,
            torch.tensor(
                [3.4028234663852886e38, -3.4028234663852886e38, 65519.0, 65520.0, 2.0**-25, 2.0**-24 * 1.5]
            ),
        ]
    )
    assert_same_bits(formats.cast(x, name, saturate=False), x.to(dtype).float())


# --- against torchao's reference FP4/FP6 quantizers (saturating, RNE) ----------------------------


@pytest.mark.parametrize(
    "name, to_bits, from_bits",
    [
        ("e2m1", "f32_to_f4_unpacked", "f4_unpacked_to_f32"),
        ("e3m2", "f32_to_f6_e3m2_unpacked", "f6_e3m2_unpacked_to_f32"),
        ("e2m3", "f32_to_f6_e2m3_unpacked", "f6_e2m3_unpacked_to_f32"),
    ],
)
def test_fp4_fp6_equal_torchao_reference_on_every_finite_bf16_value(name, to_bits, from_bits):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    expected = getattr(kernels, from_bits)(getattr(kernels, to_bits)(FINITE_BF16))
    assert_same_bits(formats.cast(FINITE_BF16, name), expected.float())


# --- published format facts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, max_, min_normal, min_subnormal, emax, count",
    [
        # OCP FP8 and MX v1.0 specs; count = non-negative finite encodings
        ("e4m3", 448.0, 2**-6, 2**-9, 8, 127),
        ("e5m2", 57344.0, 2**-14, 2**-16, 15, 124),
        ("e3m2", 28.0, 2**-2, 2**-4, 4, 32),
        ("e2m3", 7.5, 1.0, 2**-3, 2, 32),
        ("e2m1", 6.0, 1.0, 0.5, 2, 8),
    ],
)
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


@pytest.mark.parametrize(
    "x, rne, away, toward_zero",
    [
        (2.5, 2.0, 3.0, 2.0),  # tie between 2 (even mantissa) and 3
        (-2.5, -2.0, -3.0, -2.0),
        (5.0, 4.0, 6.0, 4.0),  # tie between 4 (mantissa 0) and 6 (mantissa 1)
        (0.25, 0.0, 0.5, 0.0),  # half the smallest subnormal
        (-0.25, -0.0, -0.5, -0.0),  # signed underflow keeps the sign
        (0.75, 1.0, 1.0, 0.5),  # tie between subnormal 0.5 (odd) and 1.0
        (5.9, 6.0, 6.0, 4.0),
        (7.0, 6.0, 6.0, 6.0),  # above max: saturates
        (1e30, 6.0, 6.0, 6.0),
    ],
)
def test_e2m1_rounding_table(x, rne, away, toward_zero):
    t = torch.tensor([x])
    for mode, expected in (("rne", rne), ("away", away), ("toward_zero", toward_zero)):
        out = formats.cast(t, "e2m1", rounding=mode)
        assert out.item() == expected and math.copysign(1, out.item()) == math.copysign(1, expected), mode


@pytest.mark.parametrize(
    "name, x, expected",
    [
        ("e4m3", 464.0, 448.0),  # midpoint 448|480 rounds to even 448: not an overflow
        ("e4m3", 465.0, math.nan),  # past it: NaN (e4m3fn has no inf)
        ("e4m3", math.inf, math.nan),
        ("e5m2", 61440.0, math.inf),  # midpoint 57344|65536 rounds to even 65536 = inf
        ("e5m2", -1e6, -math.inf),
        ("e2m1", 100.0, 6.0),  # no inf/NaN encodings: always saturates
    ],
)
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


@pytest.mark.parametrize("name", ["int16", "uint16", "int8", "int4", "fp16", "e5m2", "e4m3", "e2m1"])
def test_fast_stochastic_cast_is_the_exact_floor_of_value_plus_draw(name):
    # the fast path rounds float32 with 15-bit draws (formats.stochastic_noise); float64 holds
    # |x|/q + U exactly for every float32 x here, so its floor over the same draws is the exact answer,
    # bit for bit. An fp16 mantissa (11 bits) or an int16 (16) plus 15 draw bits overflow float32's 24.
    fmt = formats.get_format(name)
    assert formats.fast_path_applies(torch.empty(0), fmt, "stochastic")  # bf16 takes float64's path
    g = torch.Generator().manual_seed(3)
    n = 50_000
    if isinstance(fmt, formats.IntFormat):
        span = float(fmt.max - fmt.min) + 8
        x = (torch.rand(n, generator=g, dtype=torch.float64) * span + fmt.min - 4).float()
        x[:400] = torch.linspace(-1, 0, 400)  # the signed floor just below zero
    else:
        top = math.log2(fmt.max) + 1
        exponents = torch.rand(n, generator=g, dtype=torch.float64) * (top + 30) - 30
        signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
        x = (signs * torch.exp2(exponents)).float()
    out = formats.cast(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    draws = formats.stochastic_noise((n,), torch.Generator().manual_seed(7)).double()
    x64 = x.double()
    if isinstance(fmt, formats.IntFormat):
        expected = torch.floor(x64 + draws).clamp(fmt.min, fmt.max)
    else:
        magnitude = x64.abs().clamp(max=fmt.max)
        exponent = (torch.frexp(magnitude).exponent - 1).clamp(min=1 - fmt.bias)  # subnormals share emin
        quantum = torch.exp2((exponent - fmt.mantissa_bits).double())
        steps = torch.floor(magnitude / quantum + draws)
        expected = torch.copysign((steps * quantum).clamp(max=fmt.max), x64)
    assert_same_bits(out, expected.float())


def test_output_dtype_follows_input_and_nan_is_kept():
    x = torch.tensor([1.3, math.nan], dtype=torch.bfloat16)
    out = formats.cast(x, "e4m3")
    assert out.dtype == torch.bfloat16 and out[0].item() == 1.25 and math.isnan(out[1].item())


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: formats.cast(torch.tensor([1.0]), "e9m9"), ValueError, "unknown element format fmt='e9m9'"),
        (
            lambda: formats.cast(torch.tensor([1.0]), "e4m3", rounding="up"),
            ValueError,
            "unknown rounding 'up'",
        ),
        (lambda: formats.cast(torch.tensor([1]), "e4m3"), TypeError, "torch.int64"),
        (lambda: formats.cast(torch.tensor([math.nan]), "e2m1"), ValueError, "e2m1 has no NaN"),
        (
            lambda: formats.cast(torch.tensor([1.0]), "e4m3", generator=torch.Generator()),
            ValueError,
            "stochastic",
        ),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


# =================================================================================================
# The float32 fast path against the float64 reference path
# =================================================================================================

FLOAT_FORMATS = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16"]
RANDOM_FLOAT32 = (
    torch.randint(
        -(2**31), 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(1), dtype=torch.int64
    )
    .to(torch.int32)
    .view(torch.float32)
)


@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "no_saturate"])
@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_fast_rne_cast_equals_float64_reference_cast(name, saturate):
    # every bf16 value (all binades, ±0, ±inf) and 200k random float32 bit patterns; NaN inputs only
    # where the format has a NaN (a NaN input to a NaN-less format is an error by design)
    fmt = formats.get_format(name)
    for x in (ALL_BF16, RANDOM_FLOAT32):
        if not fmt.has_nan:
            x = x[~torch.isnan(x)]
        assert_same_bits(
            formats.cast(x, name, saturate=saturate), formats.reference_cast(x, name, saturate=saturate)
        )
        # the fast path also runs for bfloat16 inputs (widened to float32); the results must agree there too
        xb = x.to(torch.bfloat16)
        assert_same_bits(
            formats.cast(xb, name, saturate=saturate).float(),
            formats.reference_cast(xb, name, saturate=saturate).float(),
        )


# =================================================================================================
# Integer formats
# =================================================================================================


@pytest.mark.parametrize(
    "name, bits, signed, lo, hi",
    [
        ("int2", 2, True, -2, 1),
        ("int8", 8, True, -128, 127),
        ("uint4", 4, False, 0, 15),
        ("int16", 16, True, -32768, 32767),
        ("uint16", 16, False, 0, 65535),
    ],
)
def test_int_format_range_table(name, bits, signed, lo, hi):
    fmt = formats.get_format(name)
    # two's complement / unsigned ranges from the textbook formula
    formula = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    assert (fmt.min, fmt.max) == formula == (lo, hi)
    assert fmt.values().tolist() == list(range(lo, hi + 1))
    # the code dtype holds every value of the grid
    info = torch.iinfo(fmt.code_dtype)
    assert info.min <= lo and hi <= info.max
    assert torch.equal(formats.encode(fmt.values().float(), fmt), torch.arange(lo, hi + 1).to(fmt.code_dtype))


def test_int8_cast_equals_round_half_even_and_clamp_in_float64():
    x = torch.cat(
        [
            FINITE_BF16,
            RANDOM_FLOAT32[torch.isfinite(RANDOM_FLOAT32)] * 1e-37,
            torch.tensor([math.inf, -math.inf, 126.5, 127.5, -128.5, -127.5]),
        ]
    )
    expected = torch.round(x.double()).clamp(-128, 127).float()  # torch.round is half-to-even; inf clamps
    assert_same_bits(formats.cast(x, "int8") + 0.0, expected + 0.0)  # + 0.0: -0 and 0 are the same integer
    assert_same_bits(formats.reference_cast(x, "int8") + 0.0, expected + 0.0)


@pytest.mark.parametrize(
    "name, x, rne, away, toward_zero",
    [
        ("int8", 2.5, 2, 3, 2),
        ("int8", -2.5, -2, -3, -2),
        ("int8", 3.5, 4, 4, 3),
        ("int8", 0.5, 0, 1, 0),
        ("int8", -0.5, 0, -1, 0),
        ("int8", 2.4999998, 2, 2, 2),
        ("int8", 127.5, 127, 127, 127),  # rne 128 and away 128 saturate to max
        ("int8", -128.5, -128, -128, -128),
        ("int8", math.inf, 127, 127, 127),
        ("int8", -math.inf, -128, -128, -128),
        ("int8", 1e30, 127, 127, 127),
        ("uint4", -3.0, 0, 0, 0),  # unsigned: negatives clamp to 0
        ("uint4", 15.5, 15, 15, 15),
        ("int2", 1.5, 1, 1, 1),
        ("int2", -1.5, -2, -2, -1),
    ],
)
def test_int_rounding_table(name, x, rne, away, toward_zero):
    t = torch.tensor([x])
    for mode, expected in (("rne", rne), ("away", away), ("toward_zero", toward_zero)):
        assert formats.cast(t, name, rounding=mode).item() == expected, mode
        assert formats.reference_cast(t, name, rounding=mode).item() == expected, mode


# =================================================================================================
# E8M0
# =================================================================================================


def test_e8m0_values_are_the_255_powers_of_two():
    fmt = formats.get_format("e8m0")
    values = fmt.values()
    assert len(values) == 255
    assert values.tolist() == [math.ldexp(1.0, k) for k in range(-127, 128)]
    assert (fmt.min, fmt.max) == (math.ldexp(1.0, -127), math.ldexp(1.0, 127))


def test_e8m0_encode_decode_round_trip_of_every_code():
    # byte b means 2^(b - 127) (OCP MX v1.0 §5.4.1); 0xFF is NaN
    values = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float32)
    codes = formats.encode(values, "e8m0")
    assert codes.dtype == torch.uint8 and codes.tolist() == list(range(256))
    assert_same_bits(formats.decode(codes, "e8m0"), values)


@pytest.mark.parametrize("value", [3.0, 0.0, -2.0, 2.0**-128, math.inf])
def test_e8m0_encode_of_a_non_power_of_two_raises(value):
    with pytest.raises(ValueError, match="powers of two"):
        formats.encode(torch.tensor([value]), "e8m0")


# =================================================================================================
# encode / decode against torch and torchao
# =================================================================================================


def signed_values(name):
    """Every finite value of a float format with both signs (incl. -0), as float32."""
    v = formats.get_format(name).values().float()
    return torch.cat([v, -v])


@pytest.mark.parametrize("name, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_encode_equals_torch_float8_bits(name, dtype):
    v = signed_values(name)
    if name == "e5m2":
        v = torch.cat([v, torch.tensor([math.inf, -math.inf])])
    expected = v.to(dtype).view(torch.uint8)
    assert torch.equal(formats.encode(v, name), expected)
    assert_same_bits(formats.decode(formats.encode(v, name), name), v)
    assert (
        formats.encode(torch.tensor([math.nan]), name).item()
        == 0x7F
        == torch.tensor([math.nan]).to(dtype).view(torch.uint8).item()
    )


@pytest.mark.parametrize("name, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_decode_of_all_256_codes_equals_torch(name, dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_same_bits(formats.decode(codes, name), codes.view(dtype).float())


@pytest.mark.parametrize(
    "name, to_bits, from_bits, n_codes",
    [
        ("e2m1", "f32_to_f4_unpacked", "f4_unpacked_to_f32", 16),
        ("e3m2", "f32_to_f6_e3m2_unpacked", "f6_e3m2_unpacked_to_f32", 64),
        ("e2m3", "f32_to_f6_e2m3_unpacked", "f6_e2m3_unpacked_to_f32", 64),
    ],
)
def test_fp4_fp6_encode_decode_equal_torchao_codes(name, to_bits, from_bits, n_codes):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    v = signed_values(name)
    codes = formats.encode(v, name)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes, getattr(kernels, to_bits)(v))
    assert_same_bits(formats.decode(codes, name), v)
    every_code = torch.arange(n_codes, dtype=torch.int32).to(torch.uint8)
    assert_same_bits(formats.decode(every_code, name), getattr(kernels, from_bits)(every_code).float())


@pytest.mark.parametrize(
    "name, value",
    [
        ("e4m3", 1.1),
        ("e4m3", 464.0),
        ("e4m3", 2.0**-10),
        ("e5m2", 1e6),
        ("e5m2", 1.1),
        ("e3m2", 0.3),
        ("e2m3", 7.75),
        ("e2m1", 2.5),
        ("e2m1", 0.25),
        ("int8", 0.5),
        ("int8", 200.0),
        ("uint4", -1.0),
    ],
)
def test_encode_of_a_non_representable_value_raises(name, value):
    with pytest.raises(ValueError, match=f"{name}"):
        formats.encode(torch.tensor([value]), name)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_ieee_16_bit_encode_of_a_non_representable_value_raises(name):
    with pytest.raises(ValueError):
        formats.encode(torch.tensor([1.0001]), name)  # 1 + 2^-13.3: between bf16 and fp16 neighbours


@pytest.mark.parametrize("name", ["e4m3", "int8", "e8m0"])
def test_encode_of_a_float64_value_off_the_grid_raises(name):
    with pytest.raises(ValueError):
        formats.encode(torch.tensor([1.0 + 2.0**-40], dtype=torch.float64), name)


def test_pack_fp4_equals_torchao_pack_uint4_and_round_trips():
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    codes = torch.randint(0, 16, (7, 64), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    packed = formats.pack_fp4(codes)
    assert packed.shape == (7, 32) and torch.equal(packed, kernels.pack_uint4(codes))
    assert torch.equal(formats.unpack_fp4(packed), kernels.unpack_uint4(packed))
    assert torch.equal(formats.unpack_fp4(packed), codes)
    # the OCP/torchao convention: the first element in the low nibble
    assert formats.pack_fp4(torch.tensor([0x1, 0x2], dtype=torch.uint8)).tolist() == [0x21]


def test_bf16_encode_is_the_bit_pattern_of_every_non_nan_value():
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    keep = ~torch.isnan(ALL_BF16)
    assert torch.equal(formats.encode(ALL_BF16[keep], "bf16"), codes[keep])
    assert_same_bits(formats.decode(codes[keep], "bf16"), ALL_BF16[keep])
    assert torch.isnan(formats.decode(codes[~keep], "bf16")).all()


def test_fp16_encode_is_the_bit_pattern_of_every_non_nan_value():
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = codes.view(torch.float16).float()  # float16 -> float32 is exact
    keep = ~torch.isnan(values)
    assert torch.equal(formats.encode(values[keep], "fp16"), codes[keep])
    assert_same_bits(formats.decode(codes[keep], "fp16"), values[keep])
    assert torch.isnan(formats.decode(codes[~keep], "fp16")).all()


# Bad inputs: tests/test_bad_input.py holds the table for every module.
