"""Triton device functions shared by the kernels: float32 bit tricks that match qlab.formats exactly."""

import triton
import triton.language as tl


@triton.jit
def round_to_grid(x, ELEM_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_BIASED: tl.constexpr):
    """Saturating RNE of float32 x onto a float format's grid (qlab.formats._cast_rne_float32):
    |x| clamped to the format's max, then (|x| + C) − C with C = 2^(e + 23 − m), whose float32 ulp is
    the grid's quantum at |x|'s binade (MIN_BIASED = 128 − bias keeps subnormals on the smallest one)."""
    magnitude = tl.minimum(tl.abs(x), ELEM_MAX)
    biased = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, MIN_BIASED)
    magic = ((biased + (23 - MANTISSA)) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def pow2_from_exponent(exponent):
    """2^exponent as float32 for exponent in [−127, 127], from the bits (2^-127 is a subnormal)."""
    field = exponent + 127
    return tl.where(field == 0, 1 << 22, field << 23).to(tl.float32, bitcast=True)
