"""Triton device functions shared by the kernels: float32 bit tricks that match qlab.formats exactly."""

import os

import triton
import triton.language as tl


@triton.jit
def round_to_grid(x, ELEM_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_BIASED: tl.constexpr):
    """Saturating RNE of float32 x onto a float format's grid (qlab.formats.cast_rne_float32):
    |x| clamped to the format's max, then (|x| + C) − C with C = 2^(e + 23 − m), whose float32 ulp is
    the grid's quantum at |x|'s binade (MIN_BIASED = 128 − bias keeps subnormals on the smallest one).
    The sign bit is copied from x, so −0 and values that round to zero from below stay −0."""
    magnitude = tl.minimum(tl.abs(x), ELEM_MAX)
    biased = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, MIN_BIASED)
    magic = ((biased + (23 - MANTISSA)) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    sign = x.to(tl.int32, bitcast=True) & (-2147483648)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def encode_float(
    values,
    BITS: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    INV_MIN_SUBNORMAL: tl.constexpr,
    NAN_CODE: tl.constexpr,
):
    """uint8 codes of float32 ``values`` already on the format's finite grid (qlab.formats._encode_float):
    sign in bit BITS−1, then the biased exponent field and the top MANTISSA bits; subnormals as
    |v| / min_subnormal (exact); NaN as S.11..1 (NAN_CODE < 0: the format has no NaN, none expected)."""
    bits = values.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    field = (magnitude_bits >> 23) - (127 - BIAS)
    normal = (field << MANTISSA) | ((magnitude_bits >> (23 - MANTISSA)) & ((1 << MANTISSA) - 1))
    subnormal = (magnitude * INV_MIN_SUBNORMAL).to(tl.int32)
    code = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
    if NAN_CODE >= 0:
        code = tl.where(values != values, NAN_CODE, code)
    code = code | (((bits >> 31) & 1) << (BITS - 1))
    return code.to(tl.uint8)


def encode_constants(element) -> dict:
    """The constexpr arguments of ``encode_float`` for a qlab.formats FloatFormat."""
    return dict(
        BITS=element.bits,
        MANTISSA=element.mantissa_bits,
        BIAS=element.bias,
        MIN_NORMAL=float(element.min_normal),
        INV_MIN_SUBNORMAL=float(1.0 / element.min_subnormal),
        NAN_CODE=2 ** (element.bits - 1) - 1 if element.has_nan else -1,
    )


@triton.jit
def load_block_tile(x_ptr, n_rows, n_cols, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j)'s tile of a contiguous (n_rows, n_cols) tensor: rows i·ROWS + [0, ROWS) × blocks
    j·GROUPS + [0, GROUPS) of BLOCK elements along the row. Returns (rows, blocks, cols (GROUPS, BLOCK),
    offsets and inside (ROWS, GROUPS, BLOCK), x as float32 (ROWS, GROUPS, BLOCK), 0 outside)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blocks = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # the tile's blocks along the row
    cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (GROUPS, BLOCK)
    inside = (rows[:, None, None] < n_rows) & (cols[None, :, :] < n_cols)
    offsets = rows[:, None, None].to(tl.int64) * n_cols + cols[None, :, :]
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    return rows, blocks, cols, offsets, inside, x


@triton.jit
def pow2_from_exponent(exponent):
    """2^exponent as float32 for exponent in [−127, 127], from the bits (2^-127 is a subnormal)."""
    field = exponent + 127
    return tl.where(field == 0, 1 << 22, field << 23).to(tl.float32, bitcast=True)


class Tuned:
    """A Triton kernel launched with its tile chosen per shape. On a GPU it is autotuned over ``tiles``
    (tuples of values for ``names``: tile constexprs, and "num_warps") keyed by the argument names in
    ``key``: the first call
    at each new key times every config once, later calls reuse the fastest. The kernels' bits never
    depend on the tile, only their speed does. Under the CPU interpreter (TRITON_INTERPRET=1, which
    cannot time) the first config is used. Launch as ``tuned[grid](*args, **constexprs)`` with ``grid``
    a function of the launch's meta-parameters, e.g. ``lambda meta: (cdiv(n, meta["CHUNK"]),)``."""

    def __init__(self, kernel, names: tuple[str, ...], *tiles: tuple, key: list[str]):
        configs = [dict(zip(names, tile, strict=True)) for tile in tiles]
        self.kernel = kernel
        self.configs = [{name: value for name, value in c.items() if name != "num_warps"} for c in configs]
        self.first = self.configs[0]
        tiles = [
            triton.Config(
                {name: value for name, value in config.items() if name != "num_warps"},
                num_warps=config.get("num_warps", 4),
            )
            for config in configs
        ]
        self.autotuned = triton.autotune(configs=tiles, key=key)(kernel)

    def __getitem__(self, grid):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.first)
        return self.autotuned[grid]
