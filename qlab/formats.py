"""Element formats, exact casts with named rounding, and their integer codes.

| format | exp bits | mantissa bits | bias | max finite | inf | NaN |
|---|---|---|---|---|---|---|
| e4m3 (fn) | 4 | 3 | 7  | 448   | none | S.1111.111 |
| e5m2      | 5 | 2 | 15 | 57344 | S.11111.00 | S.11111.{01,10,11} |
| e3m2      | 3 | 2 | 3  | 28    | none | none |
| e2m3      | 2 | 3 | 1  | 7.5   | none | none |
| e2m1      | 2 | 1 | 1  | 6     | none | none |
| bf16, fp16| IEEE binary formats (with inf and NaN) |
| e8m0      | 8 | 0 | 127 | 2^127 | none | 0xFF (MX scale format: powers of two only, no zero) |
| intN, uintN | N = 2..16 two's-complement / unsigned integers; intN spans [-2^(N-1), 2^(N-1)-1] |

``cast(x, fmt)`` returns, in x's floating dtype, x rounded to ``fmt``. Two implementations give the
same bits (tests check them against each other and against torch/torchao on every bf16 value):
``reference_cast`` splits |x| as m·2^e with e read from the bits (``torch.frexp``, never
floor(log2)), clamps e below at the format's minimum normal exponent (subnormals share its quantum),
scales by the quantum 2^(e − mantissa_bits) exactly in float64, rounds to an integer by the named
mode and scales back. Stochastic rounding of float32/bf16/fp16 inputs uses 15-bit noise
(``stochastic_noise``, ``_cast_stochastic_float32``); the reference draws float64 noise. The
float32 fast path used for "rne" rounds by adding and subtracting C = 2^(e + 23 − mantissa_bits),
whose float32 ulp is the quantum, so the hardware's own round-to-nearest-even does the work in two
float32 additions.
Overflow saturates to ±max by default; ``saturate=False`` follows the format's own rule (inf for
e5m2/bf16/fp16, NaN for e4m3fn; formats without either always saturate).

``encode`` turns values already representable in a format into its integer codes (uint8 for the
8-bit-and-smaller float formats and e8m0; int16 bit patterns for bf16/fp16; the integers themselves
for intN/uintN); ``decode`` turns codes back into float32. ``pack_fp4``/``unpack_fp4`` store two
4-bit codes per byte, the first element in the low nibble (the OCP MX and torchao convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from qlab import checks, compat

ROUNDING_MODES = ("rne", "away", "toward_zero", "stochastic")


@dataclass(frozen=True)
class FloatFormat:
    """A sign-magnitude binary floating-point element format with subnormals."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    has_inf: bool
    has_nan: bool

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal binade (what MX scaling subtracts): e4m3 8, e2m1 2.
        Read with math.frexp, so compiled code sees a constant (no tensor, no host sync)."""
        return math.frexp(self.max)[1] - 1

    def values(self) -> torch.Tensor:
        """Every non-negative finite value, ascending, as float64."""
        quantum = self.min_subnormal
        values = {k * quantum for k in range(2**self.mantissa_bits)}  # zero and subnormals
        for e in range(1 - self.bias, self.emax + 1):
            values.update((1 + m / 2**self.mantissa_bits) * 2.0**e for m in range(2**self.mantissa_bits))
        return torch.tensor(sorted(v for v in values if v <= self.max), dtype=torch.float64)


@dataclass(frozen=True)
class IntFormat:
    """An N-bit integer grid: signed two's complement [-2^(N-1), 2^(N-1)-1] or unsigned [0, 2^N-1]."""

    name: str
    bits: int
    signed: bool
    has_inf = False
    has_nan = False

    @property
    def min(self) -> int:
        return -(2 ** (self.bits - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def code_dtype(self) -> torch.dtype:
        if self.bits <= 8:
            return torch.int8 if self.signed else torch.uint8
        return torch.int16 if self.signed else torch.int32

    def values(self) -> torch.Tensor:
        """Every representable integer, ascending, as float64."""
        return torch.arange(self.min, self.max + 1, dtype=torch.float64)


@dataclass(frozen=True)
class E8M0Format:
    """The MX shared-scale format: the byte b means 2^(b − 127); 0xFF is NaN; there is no zero."""

    name: str = "e8m0"
    bits: int = 8
    bias: int = 127
    nan_code: int = 0xFF
    has_inf = False
    has_nan = True

    @property
    def max(self) -> float:
        return 2.0**127

    @property
    def min(self) -> float:
        return 2.0**-127

    def values(self) -> torch.Tensor:
        """Every finite value 2^-127 .. 2^127, ascending, as float64."""
        return torch.exp2(torch.arange(-127, 128, dtype=torch.float64))


Format = FloatFormat | IntFormat | E8M0Format

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        FloatFormat("e4m3", 4, 3, 7, 448.0, has_inf=False, has_nan=True),
        FloatFormat("e5m2", 5, 2, 15, 57344.0, has_inf=True, has_nan=True),
        FloatFormat("e3m2", 3, 2, 3, 28.0, has_inf=False, has_nan=False),
        FloatFormat("e2m3", 2, 3, 1, 7.5, has_inf=False, has_nan=False),
        FloatFormat("e2m1", 2, 1, 1, 6.0, has_inf=False, has_nan=False),
        FloatFormat("bf16", 8, 7, 127, float(torch.finfo(torch.bfloat16).max), has_inf=True, has_nan=True),
        FloatFormat("fp16", 5, 10, 15, float(torch.finfo(torch.float16).max), has_inf=True, has_nan=True),
        E8M0Format(),
        *(IntFormat(f"int{n}", n, signed=True) for n in range(2, 17)),
        *(IntFormat(f"uint{n}", n, signed=False) for n in range(2, 17)),
    )
}
ELEMENT_FORMATS = tuple(name for name, f in FORMATS.items() if not isinstance(f, E8M0Format))


def get_format(name: str | Format, argument: str = "name") -> Format:
    """Look a format up by name: e4m3, e5m2, e3m2, e2m3, e2m1, bf16, fp16, e8m0, int2..16, uint2..16.
    ``argument`` is what errors call the value (the caller's argument name)."""
    if isinstance(name, (FloatFormat, IntFormat, E8M0Format)):
        return name
    expected = "e4m3, e5m2, e3m2, e2m3, e2m1, bf16, fp16, e8m0, int2..int16, uint2..uint16"
    if not isinstance(name, str):
        raise TypeError(
            f"{argument} must be an element format name ({expected}) or a format object, "
            f"got {checks.shown(name)}"
        )
    if name not in FORMATS:
        raise ValueError(f"unknown element format {argument}={name!r}; expected one of: {expected}")
    return FORMATS[name]


def _check_floating(x, what: str) -> None:
    """``what`` (the argument's name) must be a real floating-point tensor."""
    checks.tensor(what, x, floating=True)


def _round_integer(scaled: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round non-negative float64 values to integers by the named mode."""
    if rounding == "rne":
        return torch.round(scaled)  # half to even
    if rounding == "away":
        return torch.floor(scaled + 0.5)
    if rounding == "toward_zero":
        return torch.trunc(scaled)
    noise = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=scaled.device)
    return torch.floor(scaled + noise)


def round_to_integer(
    x: torch.Tensor, rounding: str = "rne", generator: torch.Generator | None = None
) -> torch.Tensor:
    """x rounded to an integer by the named mode (unbounded; "stochastic" is floor(x + U[0,1)))."""
    _check_floating(x, "x")
    _check_rounding_and_generator(rounding, generator)
    if rounding == "rne":
        return torch.round(x)
    if rounding == "stochastic":
        return _round_integer(x.double(), rounding, generator).to(x.dtype)
    return torch.copysign(_round_integer(x.abs(), rounding, generator), x)


def _check_rounding_and_generator(rounding, generator) -> None:
    checks.choice("rounding", rounding, ROUNDING_MODES)
    checks.generator("generator", generator)
    if generator is not None and rounding != "stochastic":
        raise ValueError(
            f"a generator only makes sense with rounding='stochastic', got rounding={rounding!r}"
        )


def _check_cast_arguments(x, fmt, rounding, generator, saturate=True) -> Format:
    fmt = get_format(fmt, "fmt")
    _check_floating(x, "x")
    if isinstance(fmt, E8M0Format):
        raise ValueError(
            "fmt e8m0 is a scale format (powers of two); MX scales come from qlab.scaling.mx_scale_codes"
        )
    _check_rounding_and_generator(rounding, generator)
    checks.boolean("saturate", saturate)
    if not fmt.has_nan and checks.holds_nan(x):
        raise ValueError(f"{fmt.name} has no NaN encoding, but x holds NaN")
    return fmt


def reference_cast(x, fmt, *, rounding="rne", saturate=True, generator=None) -> torch.Tensor:
    """``cast`` computed in float64 for every format and rounding mode (the reference path); the
    arguments are ``cast``'s."""
    fmt = _check_cast_arguments(x, fmt, rounding, generator, saturate)
    return _reference_cast(x, fmt, rounding, saturate, generator)


def _reference_cast(x, fmt, rounding, saturate, generator):
    x64 = x.to(torch.float64)
    if isinstance(fmt, IntFormat):
        beyond = torch.full_like(x64, 2.0**20)  # ±inf clamp to the ends of any 16-bit grid
        x64 = torch.where(torch.isfinite(x64), x64, torch.copysign(beyond, x64))
        if rounding == "stochastic":  # floor(x + U) on the signed value: unbiased on both sides of zero
            rounded = _round_integer(x64, rounding, generator)
        else:
            rounded = torch.copysign(_round_integer(x64.abs(), rounding, generator), x64)
        return rounded.clamp(fmt.min, fmt.max).to(x.dtype)

    magnitude = x64.abs()
    finite = torch.isfinite(magnitude)
    exponent = torch.frexp(torch.where(finite, magnitude, 1.0)).exponent.to(torch.float64) - 1
    exponent = exponent.clamp(min=1 - fmt.bias)  # subnormals share the smallest normal binade's quantum
    quantum = torch.exp2(exponent - fmt.mantissa_bits)
    rounded = _round_integer(torch.where(finite, magnitude, 0.0) / quantum, rounding, generator) * quantum

    overflow = (rounded > fmt.max) | ~finite
    if saturate or not (fmt.has_inf or fmt.has_nan):
        too_big = torch.full_like(rounded, fmt.max)
    else:
        too_big = torch.full_like(rounded, torch.inf if fmt.has_inf else torch.nan)
    rounded = torch.where(overflow, too_big, rounded)
    result = torch.copysign(rounded, x64)
    return torch.where(torch.isnan(x64), x64, result).to(x.dtype)


def fast_path_applies(x: torch.Tensor, fmt: Format, rounding: str, saturate: bool = True) -> bool:
    """Whether ``cast`` of x takes the fused path (the C kernel, or compiled code) for this format,
    rounding and dtype; the fused path gives the reference's bits."""
    if rounding not in ("rne", "stochastic") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if rounding == "stochastic" and not saturate:
        return False
    if isinstance(fmt, IntFormat):
        return True
    # C = 2^(e + 23 - m) must stay a finite float32 for the largest binade we round in
    return fmt.emax + 1 + 23 - fmt.mantissa_bits <= 127


TORCH_FLOAT8 = {  # torch's float8 dtype for each format that has one (the one map; kernels use it)
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


def cast_rne_float32(x: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """RNE cast of a float32 tensor by the add-and-subtract trick (no checks; see the module doc)."""
    if isinstance(fmt, IntFormat):
        return torch.round(x.clamp(fmt.min, fmt.max))  # |x| < 2^23 after the clamp: round is exact RNE
    if fmt.name in TORCH_FLOAT8 and saturate and not torch.compiler.is_compiling():
        # eager: torch's own float8 cast is one fused pass (same bits; compiled code keeps the trick)
        return x.clamp(-fmt.max, fmt.max).to(TORCH_FLOAT8[fmt.name]).float()
    overflows = not saturate and (fmt.has_inf or fmt.has_nan)
    limit = 2.0 ** (fmt.emax + 1) if overflows else fmt.max
    magnitude = x.abs().clamp(max=limit)  # keeps NaN; round(min(a, max)) == min(round(a), max)
    biased_exponent = (magnitude.view(torch.int32) >> 23).clamp(min=128 - fmt.bias)
    magic = ((biased_exponent + (23 - fmt.mantissa_bits)) << 23).view(torch.float32)
    rounded = (magnitude + magic) - magic
    if overflows:
        rounded = torch.where(rounded > fmt.max, torch.inf if fmt.has_inf else torch.nan, rounded)
    return torch.copysign(rounded, x)


def cast(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """x rounded to ``fmt``, returned in x's dtype (every result exactly representable in fmt).

    ``rounding``: "rne" (ties to even, the hardware default), "away" (ties away from zero, as some
    emulators do), "toward_zero", or "stochastic" (floor(x/q + U[0,1)) with U from ``generator``,
    unbiased). NaN stays NaN where the format has one; a NaN input to a format without NaN raises.
    Integer formats round to the integer grid and clamp to [min, max].
    """
    fmt = _check_cast_arguments(x, fmt, rounding, generator, saturate)
    return cast_unchecked(x, fmt, rounding, saturate, generator)


NOISE_BITS = 15


def stochastic_noise(shape, generator: torch.Generator | None, device=None) -> torch.Tensor:
    """Uniform draws k·2^-15 (k = 0 … 2^15 − 1) as float32, one per element, from ``generator``.

    Each 31-bit integer the generator produces (``Tensor.random_`` on int32, ceil(n/2) of them for n
    draws) gives two 15-bit draws: draw i is integer i's low 15 bits, draw ceil(n/2) + i its next 15.
    This is the definition, in torch ops; ``qlab.kernels.stochastic_noise`` gives the same numbers
    faster (a C kernel running the CPU generator itself, a Triton kernel splitting the integers on a
    GPU). With 15 random bits the probability of rounding up is the exact fraction rounded down to a
    multiple of 2^-15, so the bias is below 2^-15 of a grid step; hardware SR units likewise use a
    limited number of random bits.
    """
    check_noise_arguments(shape, generator)
    return torch_stochastic_noise(shape, generator, device)


def check_noise_arguments(shape, generator) -> None:
    """``stochastic_noise``'s refusals: ``shape`` a tuple of ints ≥ 0, ``generator`` a Generator or None."""
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise TypeError(f"shape must be a tuple of non-negative ints, got {checks.shown(shape)}")
    checks.allocatable("shape", shape)  # float32 noise
    checks.generator("generator", generator)


def random_bits(count: int, generator, device) -> torch.Tensor:
    """The ceil(count/2) random int32 that ``count`` draws split: one ``random_`` call, so the torch
    definition and the fast kernels consume the generator's stream alike."""
    return torch.empty((count + 1) // 2, dtype=torch.int32, device=device).random_(generator=generator)


def torch_stochastic_noise(shape, generator: torch.Generator | None, device=None) -> torch.Tensor:
    """``stochastic_noise`` without its argument checks (the definition itself)."""
    count = math.prod(shape)
    bits = random_bits(count, generator, device)
    mask = (1 << NOISE_BITS) - 1
    draws = torch.cat([bits & mask, (bits >> NOISE_BITS) & mask])[:count]
    return (draws.float() * 2.0**-NOISE_BITS).reshape(shape)


# moved to qlab.kernels.noise, where the fast draws are (qlab.compat)
MOVED = {
    name: "qlab.kernels.noise"
    for name in ("drawn_noise", "register_noise_source", "NOISE_STAYS_OUT_OF_CUDA_GRAPHS")
}


def __getattr__(name: str):
    return compat.moved(__name__, name, MOVED)


def _cast_stochastic_float32(x: torch.Tensor, fmt: Format, generator) -> torch.Tensor:
    """Saturating stochastic rounding of float32: floor(|x|/q + U) · q with U from ``stochastic_noise``
    (integer formats: floor(x + U) on the signed value), the floor taken exactly.

    |x|/q is exact (q is a power of two); U has 15 random bits, so P(round up) is the exact fraction
    rounded down to a multiple of 2^-15 (the float64 reference draws 53 bits).
    ``generator`` may also be the noise itself (``stochastic_noise``), drawn before compiled code.
    """
    noise = (
        generator if isinstance(generator, torch.Tensor) else stochastic_noise(x.shape, generator, x.device)
    )
    if isinstance(fmt, IntFormat):
        return _floor_plus_noise(x, noise).clamp(fmt.min, fmt.max)
    magnitude = x.abs().clamp(max=fmt.max)
    biased_exponent = (magnitude.view(torch.int32) >> 23).clamp(min=128 - fmt.bias)
    quantum = ((biased_exponent - fmt.mantissa_bits) << 23).view(torch.float32)
    steps = _floor_plus_noise(magnitude / quantum, noise)
    return torch.copysign((steps * quantum).clamp(max=fmt.max), x)


def _floor_plus_noise(scaled: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """floor(scaled + noise) for float32 scaled and noise in [0, 1), exact: the sum itself would round
    once scaled needs more than 24 − 15 bits (an fp16 mantissa, an int16), biasing the result."""
    whole = torch.floor(scaled)
    fraction = scaled - whole  # exact (Sterbenz) unless -1 < scaled < 0, where scaled + 1 may round
    up = torch.where(whole == -1, scaled >= -noise, fraction >= 1 - noise)  # 1 - noise is exact
    return whole + up.to(scaled.dtype)


def cast_unchecked(x, fmt, rounding="rne", saturate=True, generator=None):
    """``cast`` without argument checks (callers have checked; NaN never reaches a no-NaN format)."""
    if fast_path_applies(x, fmt, rounding, saturate):
        if rounding == "stochastic":
            return _cast_stochastic_float32(x.float(), fmt, generator).to(x.dtype)
        return cast_rne_float32(x.float(), fmt, saturate).to(x.dtype)
    return _reference_cast(x, fmt, rounding, saturate, generator)


# --- integer codes -------------------------------------------------------------------------------


@cache
def _decode_table(fmt: FloatFormat) -> torch.Tensor:
    """float32 value of every code of a float format of at most 8 bits, from the format's definition."""
    values = []
    for code in range(2**fmt.bits):
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        field = (code >> fmt.mantissa_bits) & (2**fmt.exponent_bits - 1)
        mantissa = code & (2**fmt.mantissa_bits - 1)
        if field == 0:
            value = mantissa * fmt.min_subnormal
        else:
            value = (1 + mantissa / 2**fmt.mantissa_bits) * 2.0 ** (field - fmt.bias)
        if fmt.name == "e4m3" and field == 15 and mantissa == 7:
            value = float("nan")
        elif fmt.name == "e5m2" and field == 31:
            value = float("inf") if mantissa == 0 else float("nan")
        values.append(sign * value)
    return torch.tensor(values, dtype=torch.float32)


def _nan_code(fmt: FloatFormat) -> int:
    return 2 ** (fmt.bits - 1) - 1  # S.111..1: what torch's float8 casts produce for a positive NaN


def encode(values: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Integer codes of ``values``, which must already be representable in ``fmt`` (e.g. from cast).

    Float formats of ≤ 8 bits and e8m0 give uint8 (sign in the format's top bit; NaN as S.11..1, the
    pattern torch's float8 casts produce); bf16/fp16 give their int16 bit patterns; intN/uintN give
    the integers in int8/uint8/int16/int32. Raises ValueError for a value not in the format.
    """
    fmt = get_format(fmt, "fmt")
    _check_floating(values, "values")
    if isinstance(fmt, E8M0Format):
        nan = torch.isnan(values)
        mantissa, exponent = torch.frexp(torch.where(nan, 1.0, values).double())
        if not (torch.all(mantissa == 0.5) and torch.all((exponent >= -126) & (exponent <= 128))):
            raise ValueError("values for e8m0 must be powers of two 2^-127 .. 2^127 (or NaN)")
        return torch.where(nan, fmt.nan_code, exponent - 1 + fmt.bias).to(torch.uint8)
    if not fmt.has_nan and checks.holds_nan(values):
        raise ValueError(f"{fmt.name} has no NaN encoding, but values hold NaN")
    # checked in the values' own dtype, so a float64 value off the grid is refused, not rounded
    if not torch.equal(
        torch.nan_to_num(cast_unchecked(values, fmt, saturate=False)), torch.nan_to_num(values)
    ):
        low = fmt.min if isinstance(fmt, IntFormat) else -fmt.max
        raise ValueError(
            f"values are not all representable in {fmt.name} (range [{low}, {fmt.max}]); cast them first"
        )
    if isinstance(fmt, IntFormat):
        return values.to(fmt.code_dtype)
    if fmt.name in ("bf16", "fp16"):
        return values.to(torch.bfloat16 if fmt.name == "bf16" else torch.float16).view(torch.int16)
    return encode_float(values.float(), fmt)


def encode_float(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """uint8 codes of float32 values representable in fmt (no checks)."""
    bits = x.view(torch.int32)
    sign = (bits >> 31) & 1
    magnitude = x.abs()
    magnitude_bits = magnitude.view(torch.int32)
    field = (magnitude_bits >> 23) - (127 - fmt.bias)
    mantissa = (magnitude_bits >> (23 - fmt.mantissa_bits)) & (2**fmt.mantissa_bits - 1)
    normal = (field << fmt.mantissa_bits) | mantissa
    subnormal = (magnitude * (1.0 / fmt.min_subnormal)).to(torch.int32)  # exact: k·quantum with k < 2^m
    code = torch.where(magnitude < fmt.min_normal, subnormal, normal)
    if fmt.has_inf:
        code = torch.where(torch.isinf(magnitude), (2**fmt.exponent_bits - 1) << fmt.mantissa_bits, code)
    if fmt.has_nan:
        code = torch.where(torch.isnan(magnitude), _nan_code(fmt), code)
    return (code | (sign << (fmt.bits - 1))).to(torch.uint8)


def decode(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """float32 values of integer ``codes`` of ``fmt`` (the inverse of ``encode``)."""
    fmt = get_format(fmt, "fmt")
    if isinstance(codes, torch.Tensor):
        checks.tensor("codes", codes)  # a meta tensor has no codes to read
    check_codes(codes, "codes", *_code_range(fmt), fmt.name)
    return decode_unchecked(codes, fmt)


def decode_unchecked(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``decode`` without argument checks (codes known to be in range: no host sync)."""
    if isinstance(fmt, IntFormat):
        return codes.float()
    if isinstance(fmt, E8M0Format):
        byte = codes.to(torch.int32)
        return torch.where(byte == fmt.nan_code, torch.nan, torch.exp2((byte - fmt.bias).double())).float()
    if fmt.name in ("bf16", "fp16"):
        return codes.to(torch.int16).view(torch.bfloat16 if fmt.name == "bf16" else torch.float16).float()
    return _decode_table(fmt).to(codes.device)[codes.long()]


def _code_range(fmt: Format) -> tuple[int, int]:
    """The integer codes ``decode`` takes for ``fmt``: bit patterns of ≤ 8-bit formats, int16 or
    uint16 patterns of bf16/fp16, the integers themselves for intN/uintN."""
    if isinstance(fmt, IntFormat):
        return fmt.min, fmt.max
    if fmt.bits == 16:
        return -(2**15), 2**16 - 1
    return 0, 2**fmt.bits - 1


def check_codes(codes, name: str, low: int, high: int, what: str) -> None:
    """``codes`` (the argument ``name``) must be an integer tensor with values in [low, high] (reads
    the values: a GPU syncs)."""
    if isinstance(codes, torch.Tensor):
        checks.tensor(name, codes)  # a meta tensor has no codes to read
    if (
        not isinstance(codes, torch.Tensor)
        or codes.is_floating_point()
        or codes.is_complex()
        or codes.dtype == torch.bool
    ):
        raise TypeError(
            f"{name} must be an integer tensor of codes, got {getattr(codes, 'dtype', checks.shown(codes))}"
        )
    if codes.numel() and (int(codes.min()) < low or int(codes.max()) > high):
        found = f"[{int(codes.min())}, {int(codes.max())}]"
        raise ValueError(f"{name} must lie in [{low}, {high}] for {what}, got values in {found}")


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis (even index in the low nibble); last axis must be even."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(
            f"codes must be a uint8 tensor of 4-bit codes, got {getattr(codes, 'dtype', checks.shown(codes))}"
        )
    check_codes(codes, "codes", 0, 15, "4-bit codes")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes need an even last axis to pack two per byte, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_fp4``: uint8 bytes → twice as many uint8 codes along the last axis."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(
            f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', checks.shown(packed))}"
        )
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
