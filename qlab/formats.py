"""Element formats and exact casts with named rounding (OCP FP8 / OCP Microscaling v1.0).

| format | exp bits | mantissa bits | bias | max finite | inf | NaN |
|---|---|---|---|---|---|---|
| e4m3 (fn) | 4 | 3 | 7  | 448   | none | S.1111.111 |
| e5m2      | 5 | 2 | 15 | 57344 | yes  | yes |
| e3m2      | 3 | 2 | 3  | 28    | none | none |
| e2m3      | 2 | 3 | 1  | 7.5   | none | none |
| e2m1      | 2 | 1 | 1  | 6     | none | none |
| bf16, fp16| IEEE binary formats (with inf and NaN) |

``cast(x, fmt)`` returns, in x's floating dtype, the value of x rounded to ``fmt``: the magnitude is
split as m·2^e with e read from the bits (``torch.frexp``, never floor(log2)), clamped below at the
format's minimum normal exponent (subnormals share its quantum), scaled by the quantum
2^(e − mantissa_bits) exactly in float64, rounded to an integer by the named mode and scaled back.
Overflow saturates to ±max by default; ``saturate=False`` follows the format's own rule (inf for
e5m2/bf16/fp16, NaN for e4m3fn; formats without either always saturate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal binade (what MX scaling subtracts): e4m3 8, e2m1 2."""
        return int(torch.frexp(torch.tensor(self.max, dtype=torch.float64)).exponent) - 1

    def values(self) -> torch.Tensor:
        """Every non-negative finite value, ascending, as float64."""
        quantum = self.min_subnormal
        values = {k * quantum for k in range(2 ** self.mantissa_bits)}  # zero and subnormals
        for e in range(1 - self.bias, self.emax + 1):
            values.update((1 + m / 2 ** self.mantissa_bits) * 2.0 ** e for m in range(2 ** self.mantissa_bits))
        return torch.tensor(sorted(v for v in values if v <= self.max), dtype=torch.float64)


FORMATS = {
    f.name: f
    for f in (
        FloatFormat("e4m3", 4, 3, 7, 448.0, has_inf=False, has_nan=True),
        FloatFormat("e5m2", 5, 2, 15, 57344.0, has_inf=True, has_nan=True),
        FloatFormat("e3m2", 3, 2, 3, 28.0, has_inf=False, has_nan=False),
        FloatFormat("e2m3", 2, 3, 1, 7.5, has_inf=False, has_nan=False),
        FloatFormat("e2m1", 2, 1, 1, 6.0, has_inf=False, has_nan=False),
        FloatFormat("bf16", 8, 7, 127, float(torch.finfo(torch.bfloat16).max), has_inf=True, has_nan=True),
        FloatFormat("fp16", 5, 10, 15, float(torch.finfo(torch.float16).max), has_inf=True, has_nan=True),
    )
}


def get_format(name: str | FloatFormat) -> FloatFormat:
    """Look a format up by name ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16")."""
    if isinstance(name, FloatFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown element format {name!r}; expected one of: {', '.join(FORMATS)}")
    return FORMATS[name]


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


def cast(x: torch.Tensor, fmt: str | FloatFormat, *, rounding: str = "rne", saturate: bool = True,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """x rounded to ``fmt``, returned in x's dtype (every result exactly representable in fmt).

    ``rounding``: "rne" (ties to even, the hardware default), "away" (ties away from zero, as some
    emulators do), "toward_zero", or "stochastic" (floor(x/q + U[0,1)) with U from ``generator``,
    unbiased). NaN stays NaN where the format has one; a NaN input to a format without NaN raises.
    """
    fmt = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"cast expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of: {', '.join(ROUNDING_MODES)}")
    if generator is not None and rounding != "stochastic":
        raise ValueError("a generator only makes sense with rounding='stochastic'")
    nan = torch.isnan(x)
    if nan.any() and not fmt.has_nan:
        raise ValueError(f"{fmt.name} has no NaN encoding, but the input holds NaN")

    x64 = x.to(torch.float64)
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
    return torch.where(nan, x64, result).to(x.dtype)
