"""Scale computation for every recipe: integer affine, FP8 current and delayed, MX (E8M0), NVFP4.

Each function maps amaxes (float32) to scales and guarantees what it returns for the awkward inputs
(zero, inf, NaN), because those are where emulators silently disagree:

| recipe | scale | amax 0 | amax inf / NaN |
|---|---|---|---|
| integer symmetric | amax / qmax (dequant = q·scale) | 1 | 1 |
| FP8 current (TE) | fmt_max / max(amax, eps) (stored = x·scale) | 1 | 1 |
| FP8 delayed (TE) | (fmt_max / amax_history) / 2^margin | previous scale | previous scale |
| MX (OCP v1.0) | E8M0 byte b, X = 2^(b − 127) | byte 0 (2^-127) | byte 0xFF (NaN) |
| NVFP4 encode (NVIDIA) | min(fl(2688 / amax_tensor), FLT_MAX) | 1 | 1 |
| NVFP4 block (NVIDIA) | E4M3(min(amax_block · fl(enc · fl(1/6)), 448)), no floor | 0 | NaN (code 0x7F) |
| NVFP4 global (torchao) | amax_tensor / (448·6) | 1 | 1 |
| NVFP4 block (torchao) | E4M3(clamp(amax_block / 6 / global, 2^-6, 448)) | 2^-6 | NaN (E4M3 code 0x7F) |

Exponents are read from float32 bits, never from float log2 (which is wrong for values just above or
below a power of two at large magnitudes).
"""

from __future__ import annotations

import math

import torch

from qlab import checks, ops
from qlab.formats import FloatFormat, cast_rne_float32, check_codes, get_format

MX_SCALE_MODES = ("floor", "rceil", "ceil", "even")
E8M0_NAN = 0xFF
NVFP4_BLOCK = 16
NVFP4_ELEMENT_MAX = 6.0
NVFP4_SCALE_MAX = 448.0
NVFP4_SCALE_MIN = 2.0**-6  # the smallest normal E4M3 value, the floor torchao's reference clamps to
HADAMARD_SIZE = 16
FLOAT32_MAX = torch.finfo(torch.float32).max


def float_format(name, argument: str = "fmt") -> FloatFormat:
    """The floating-point element format ``name`` (errors call it ``argument``); integer formats and
    E8M0 are refused."""
    fmt = get_format(name, argument)
    if not isinstance(fmt, FloatFormat):
        raise ValueError(
            f"{argument} must be a floating-point element format (e4m3, e5m2, e3m2, e2m3, e2m1, bf16, "
            f"fp16), got {fmt.name}"
        )
    return fmt


def _amaxes(name: str, value) -> torch.Tensor:
    """Amaxes must come as a real tensor (a Python float has no dtype or device to keep)."""
    return checks.tensor(name, value, real=True)


def _one_value(name: str, value, other_name: str, other: torch.Tensor) -> torch.Tensor:
    """A per-tensor companion (a global scale, an encode factor) of ``other``: one real value on its
    device, returned 0-d so that it cannot broadcast ``other`` to a larger shape (a (1, 1) tensor would)."""
    _amaxes(name, value)
    if value.numel() != 1:
        raise ValueError(f"{name} must hold one value (per tensor), got shape {tuple(value.shape)}")
    checks.same_device(name, value, other_name, other)
    return value.reshape(())


def _divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator correctly rounded in float32.

    torch's ``python_scalar / tensor`` on CPU multiplies by the reciprocal, which is off by one ulp
    for about a quarter of inputs (448 / amax among them); a tensor numerator divides exactly.
    """
    return torch.full_like(denominator, numerator) / denominator


def _divide_kernel(x: torch.Tensor, divisor: float) -> torch.Tensor:
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


# one opaque op, so that inductor cannot see the constant divisor (on a GPU it multiplies by 1/divisor)
_divide_op = ops.define(
    "divide_by", "(Tensor x, float divisor) -> Tensor", _divide_kernel, lambda x, divisor: torch.empty_like(x)
)


def divide_by(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded on every device, eagerly and compiled (no gradient).

    Off the CPU, torch's ``tensor / python_scalar`` multiplies by the scalar's reciprocal (one ulp off
    for some inputs: amax / 2688 among them), and so does inductor's code for a division by a constant;
    there the division runs as one op with the divisor in a 0-dim tensor on x's device.
    """
    checks.tensor("x", x, real=True)
    divisor = checks.number("divisor", divisor)
    if x.device.type == "cpu":
        return x / divisor
    return _divide_op(x.detach(), float(divisor))


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """fl(1/x) in float32, correctly rounded (what cuBLAS and TransformerEngine multiply by as scale_inv)."""
    return _divide(1.0, checks.tensor("x", x, real=True).float())


def _pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 x) for positive normal float32 x: the mantissa bits zeroed."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


# --- integer affine ------------------------------------------------------------------------------


def int_symmetric_scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """amax / qmax in float32; 1 where amax is zero or not finite (so q = round(x / scale) is safe)."""
    amax = _amaxes("amax", amax).float()
    checks.integer("qmax", qmax, low=1)
    scale = divide_by(amax, qmax)
    usable = torch.isfinite(amax) & (scale > 0)
    return torch.where(usable, scale, 1.0)


def int_affine_parameters(
    lo: torch.Tensor, hi: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) for asymmetric quantization of values in [lo, hi].

    The range is widened to include 0 so that zero is exact; scale = (hi − lo) / (qmax − qmin), each
    step rounded to float32 (1 for an empty or non-finite range, or a scale beyond float32);
    zero_point = qmin − round(lo / scale) with round-half-even, clamped to [qmin, qmax], as float32
    holding an integer. q = clamp(round(x / scale) + zero_point). A finite range wider than the
    largest float32 (lo = −3e38, hi = 3e38) keeps its scale: its width is taken halved, where it fits.
    """
    _amaxes("lo", lo), _amaxes("hi", hi)
    if lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have one shape, got lo {tuple(lo.shape)} and hi {tuple(hi.shape)}")
    checks.same_device("hi", hi, "lo", lo)
    checks.integer("qmin", qmin)
    if checks.integer("qmax", qmax) <= qmin:
        raise ValueError(f"qmax must be greater than qmin, got qmin={qmin}, qmax={qmax}")
    lo = torch.clamp(lo.float(), max=0.0)
    hi = torch.clamp(hi.float(), min=0.0)
    scale = divide_by(hi - lo, qmax - qmin)
    # hi − lo overflows float32 for a finite range wider than its largest value. Halving is exact at
    # those magnitudes and commutes with rounding, so 2·fl(fl(hi/2 − lo/2) / (qmax − qmin)) is the
    # float32 scale of the same formula with an unbounded exponent.
    wide = torch.isinf(scale) & torch.isfinite(lo) & torch.isfinite(hi)
    scale = torch.where(wide, divide_by(hi * 0.5 - lo * 0.5, qmax - qmin) * 2.0, scale)
    usable = torch.isfinite(scale) & (scale > 0)
    scale = torch.where(usable, scale, 1.0)
    zero_point = torch.where(usable, qmin - torch.round(lo / scale), float(qmin))
    return scale, zero_point.clamp(qmin, qmax)


# --- FP8 current and delayed scaling --------------------------------------------------------------


def fp8_current_scale(
    amax: torch.Tensor, fmt="e4m3", *, eps: float = 0.0, pow2: bool = False
) -> torch.Tensor:
    """TE's current scaling: fmt_max / max(amax, eps) in float32, applied as stored = cast(x · scale).

    An amax of 0 (after eps), inf or NaN gives 1. A scale that overflows float32 (tiny amax) becomes
    the float32 max. ``pow2`` rounds the scale down to a power of two (mantissa bits zeroed).
    """
    fmt_max = float_format(fmt).max
    amax = _amaxes("amax", amax).float()
    eps = checks.number("eps", eps, low=0, high=FLOAT32_MAX)  # a float32 floor
    checks.boolean("pow2", pow2)
    floored = torch.clamp(amax, min=eps)
    scale = _divide(fmt_max, floored)
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where(torch.isfinite(amax) & (floored > 0), scale, 1.0)
    return _pow2_floor(scale) if pow2 else scale


AMAX_ALGORITHMS = ("max", "most_recent")


class DelayedScaling:
    """TE's delayed scaling: the scale for step t comes from the amaxes seen before step t.

    ``observe(amax)`` records an amax during a step (several calls per step, e.g. micro-batches, are
    max-reduced); ``step()`` rolls the history once, puts the step's amax first and recomputes
    ``scale = (fmt_max / amax_hist) / 2^margin`` with amax_hist the history's max ("max") or its
    newest entry ("most_recent"). A zero or non-finite amax_hist, or a scale that would not be a finite
    normal float32 (a margin so large that it becomes subnormal or 0, whose reciprocal overflows), keeps
    the previous scale: the scale is always a finite, positive, normal float32. Starts at 1. ``margin``
    is at most 127 (2^margin a float32).

    History and scale live on the device of the amaxes observed (they move there at the first step
    that saw one), and ``step`` decides with tensor ops: on a GPU no call reads a value back to the
    host, as TE keeps its amax history on the device.
    """

    def __init__(self, fmt="e4m3", history_len: int = 1024, algorithm: str = "max", margin: int = 0):
        self.fmt = float_format(fmt)
        checks.integer("history_len", history_len, low=1)
        checks.allocatable("history_len", (history_len,))
        self.algorithm = checks.choice("algorithm", algorithm, AMAX_ALGORITHMS)
        self.margin = checks.integer("margin", margin, low=0, high=127)
        self.history = torch.zeros(history_len, dtype=torch.float32)
        self.scale = torch.tensor(1.0, dtype=torch.float32)
        self._step_amax: torch.Tensor | None = None

    def observe(self, amax: torch.Tensor) -> None:
        """Record one amax of this step: a number ≥ 0 (inf allowed), or a real one-element tensor.

        A tensor on the CPU must hold a value ≥ 0; a NaN or inf (what a step that overflowed measures)
        is taken, and ``step`` then keeps the previous scale. A tensor on another device is not read
        back (that would synchronize the device at every observation), nor one being traced by
        torch.compile: there a negative value goes unchecked.
        """
        if not isinstance(amax, torch.Tensor):
            checks.number("amax", amax, low=0, finite=False)
        else:
            if amax.device.type != "meta":
                checks.tensor("amax", amax, real=True)
            elif amax.dtype == torch.bool or amax.is_complex():  # meta: a shape without values, as traced
                raise TypeError(
                    f"amax must hold real numbers (a floating or integer dtype), got {amax.dtype}"
                )
            if amax.numel() != 1:
                raise ValueError(
                    f"amax must be one value (a 0-d or one-element tensor), got shape {tuple(amax.shape)}"
                )
            on_cpu = amax.device.type == "cpu" and not torch.compiler.is_compiling()
            if on_cpu and amax.detach().reshape(()).item() < 0:
                raise ValueError(f"amax must be ≥ 0 (an absolute maximum), got {amax.item()!r}")
        amax = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(())
        if self._step_amax is not None and amax.device != self._step_amax.device:
            amax = amax.to(self._step_amax.device)
        self._step_amax = amax if self._step_amax is None else torch.maximum(self._step_amax, amax)

    def step(self) -> torch.Tensor:
        """Roll the history with this step's amax (0 if none was observed); return the new scale."""
        device = self._step_amax.device if self._step_amax is not None else self.history.device
        history, previous = self.history.to(device), self.scale.to(device)
        newest = self._step_amax if self._step_amax is not None else history.new_zeros(())
        self.history = torch.cat([newest.reshape(1), history[:-1]])
        self._step_amax = None
        amax = self.history.max() if self.algorithm == "max" else self.history[0]
        candidate = _divide(self.fmt.max, amax) / 2.0**self.margin
        normal = torch.isfinite(candidate) & (candidate >= torch.finfo(torch.float32).tiny)
        usable = torch.isfinite(amax) & (amax > 0) & normal
        self.scale = torch.where(usable, candidate.float(), previous)
        return self.scale


# --- MX block scales --------------------------------------------------------------------------------


def _unbiased_exponent(x: torch.Tensor) -> torch.Tensor:
    """The float32 exponent field minus 127 (−127 for zero and subnormals), as int32."""
    return ((x.view(torch.int32) >> 23) & 0xFF) - 127


def mx_scale_codes(amax: torch.Tensor, element, mode: str = "floor") -> torch.Tensor:
    """E8M0 bytes (uint8) for MX blocks with the given float32 amaxes, by torchao's mode definitions.

    floor: e = floor(log2 amax) − emax (OCP v1.0; the largest values may saturate);
    ceil:  e = ceil(log2 amax) − emax;
    even:  amax first rounded to the element's mantissa width, then floor;
    rceil: e = ceil(log2(amax / elem_max)) with the division rounded in float32 (cuBLAS/TE MXFP8;
           nothing saturates).
    e is clamped to [−127, 127] and stored as e + 127. A zero block gets byte 0; a block whose amax
    is inf or NaN gets 0xFF (NaN). torchao 0.18 differs on inf (FLOOR/CEIL/EVEN give a finite byte,
    RCEIL 254) and its RCEIL takes a float32 log2; the tests pin our behaviour for those cases.
    """
    fmt = float_format(element, "element")
    checks.choice("mode", mode, MX_SCALE_MODES)
    amax = _amaxes("amax", amax).float()
    codes = _mx_biased_exponent(amax, fmt, mode).to(torch.uint8)
    return torch.where(torch.isfinite(amax), codes, E8M0_NAN)


def _mx_biased_exponent(amax: torch.Tensor, fmt: FloatFormat, mode: str) -> torch.Tensor:
    """The E8M0 byte of each finite float32 amax as int32 in [0, 254] (no checks; a non-finite amax
    gives some value in that range, which callers replace)."""
    if mode == "rceil":
        descale = amax / fmt.max
        exponent = _unbiased_exponent(descale) + ((descale.view(torch.int32) & 0x7FFFFF) != 0).to(torch.int32)
        # a float32-subnormal descale: ceil(log2) is -126 above 2^-127 and at most -127 otherwise
        subnormal = descale < 2.0**-126
        exponent = torch.where(subnormal, torch.where(descale > 2.0**-127, -126, -127), exponent)
        return (exponent.clamp(-127, 127) + 127).to(torch.int32)  # the scalar where() gave int64
    if mode == "even":  # round the mantissa to the element's width (half up) before taking floor
        rounded = amax.view(torch.int32) + (1 << (22 - fmt.mantissa_bits))
        amax = (rounded & 0x7F800000).view(torch.float32)
    field = (amax.view(torch.int32) >> 23) & 0xFF  # the biased exponent: floor(log2 amax) + 127
    if mode == "ceil":
        field = field + ((amax.view(torch.int32) & 0x7FFFFF) != 0).to(torch.int32)
    return (field - fmt.emax).clamp(0, 254)  # = clamp(floor(log2 amax) − emax, −127, 127) + 127


def mx_block_scales(
    amax: torch.Tensor, fmt: FloatFormat, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, 1/X, E8M0 byte) for each float32 block amax: ``mx_scale_values`` of ``mx_scale_codes(amax)``
    (NaN for a non-finite amax) built from one exponent computation, without the byte round trip, in
    few enough operations that torch.compile fuses them into the element loop (no argument checks)."""
    biased = _mx_biased_exponent(amax, fmt, mode)
    finite = torch.isfinite(amax)
    scale = torch.where(biased == 0, 1 << 22, biased << 23).view(torch.float32)  # 2^-127: subnormal
    inverse = ((254 - biased) << 23).view(torch.float32)
    codes = torch.where(finite, biased.to(torch.uint8), E8M0_NAN)
    return torch.where(finite, scale, torch.nan), torch.where(finite, inverse, torch.nan), codes


def mx_scale_values(codes: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """float32 X = 2^(b − 127) for E8M0 bytes (or 1/X with ``inverse``); NaN for 0xFF.

    Built from the float32 bits (biased exponent field = b, or 254 − b for 1/X); the one value
    below float32's normal range, 2^-127, is the subnormal with bit pattern 2^22.
    """
    check_codes(codes, "codes", 0, 255, "E8M0 bytes")
    return mx_scale_values_unchecked(codes, checks.boolean("inverse", inverse))


def mx_scale_values_unchecked(codes: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``mx_scale_values`` without argument checks (no host sync: compiled qdq calls it)."""
    byte = codes.to(torch.int32)
    field = 254 - byte if inverse else byte
    bits = torch.where(field == 0, 1 << 22, field << 23)
    values = bits.view(torch.float32)
    return torch.where(byte == E8M0_NAN, torch.nan, values)


# --- NVFP4 ---------------------------------------------------------------------------------------


def _e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """float32 x (|x| ≤ 448) rounded to E4M3, ties to even: torch's float8 cast eagerly, and under
    torch.compile the arithmetic cast of ``qlab.formats`` (same bits), which inductor vectorizes."""
    return cast_rne_float32(x.float(), get_format("e4m3"), saturate=True)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax_tensor / (448·6) in float32; 1 when that is zero (amax < 3.8e-42) or amax is not finite."""
    amax = _amaxes("amax", amax).float()
    scale = divide_by(amax, NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX)
    return torch.where(torch.isfinite(amax) & (scale > 0), scale, 1.0)


def nvfp4_block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 E4M3 block scales: RNE(clamp(amax / 6 / global, 2^-6, 448)); NaN for a non-finite amax.

    Matches torchao's reference op for op (amax/6, then /global, clamp, cast), so its bits agree.
    """
    block_amax = _amaxes("block_amax", block_amax).float()
    if global_scale is not None:
        global_scale = _one_value("global_scale", global_scale, "block_amax", block_amax)
    scale = divide_by(block_amax, NVFP4_ELEMENT_MAX)
    if global_scale is not None:
        scale = scale / global_scale
    scale = _e4m3_rne(torch.clamp(scale, NVFP4_SCALE_MIN, NVFP4_SCALE_MAX))
    return torch.where(torch.isfinite(block_amax), scale, torch.nan)


# NVIDIA's convention (TransformerEngine's reference_nvfp4.py and its kernel), in their float32 order.
# The constants fl(1/6) and fl(1/2688) are float32 values; every product below is one float32 rounding.

_RCP_6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))
_RCP_2688 = float(torch.tensor(1.0 / (NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX), dtype=torch.float32))


def nvfp4_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """The global encode scale S_enc = min(fl(2688 / amax), FLT_MAX) in float32; 1 when amax is 0 or
    not finite (TE's kernel; its Python reference gives FLT_MAX at amax 0, which codes the same zeros)."""
    amax = _amaxes("amax", amax).float()
    encode = torch.clamp(_divide(NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX, amax), max=FLOAT32_MAX)
    return torch.where(torch.isfinite(amax) & (amax > 0), encode, 1.0)


def nvfp4_block_scales_nvidia(block_amax: torch.Tensor, encode: torch.Tensor | None) -> torch.Tensor:
    """float32 E4M3 block scales E4M3_rne(min(amax_b · fl(S_enc · fl(1/6)), 448)), no lower clamp: E4M3
    subnormal and zero scales are kept (a zero block gets 0); NaN for a non-finite block amax.
    ``encode`` None (no global scale) means S_enc = 1."""
    block_amax = _amaxes("block_amax", block_amax).float()
    if encode is None:
        multiplier = torch.tensor(_RCP_6, device=block_amax.device)
    else:
        multiplier = _one_value("encode", encode, "block_amax", block_amax).float() * _RCP_6
    scale = _e4m3_rne(torch.clamp(block_amax * multiplier, max=NVFP4_SCALE_MAX))
    return torch.where(torch.isfinite(block_amax), scale, torch.nan)


def nvfp4_element_inverse(block_scales: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
    """What elements are multiplied by before the E2M1 cast: min(fl(1 / fl(s_block · S_dec)), FLT_MAX)
    with S_dec = fl(1/S_enc) (``decode`` None: 1). A zero block scale gives FLT_MAX (0 · FLT_MAX = 0)."""
    _amaxes("block_scales", block_scales)
    if decode is not None:
        decode = _one_value("decode", decode, "block_scales", block_scales)
    denominator = block_scales if decode is None else block_scales * decode
    return torch.clamp(reciprocal(denominator), max=FLOAT32_MAX)


def nvfp4_dequantize_multiplier(block_scales: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """What a dequantized element is its E2M1 value times: fl(fl(s_block · amax) · fl(1/2688)), as TE's
    dequantize kernel computes it from the tensor amax; s_block alone without a global scale (``amax``
    None).

    Two cases deliberately differ from that kernel, which would be inconsistent with its own encode:
    below amax = 2688/FLT_MAX ≈ 7.9·10⁻³⁶ the encode scale was clamped to FLT_MAX, so the decode uses
    s_block · fl(1/FLT_MAX) (the kernel's amax/2688 would shrink every value by up to 2^128·amax/2688);
    a non-finite amax (a NaN or inf somewhere) encoded with S_enc = 1, so it decodes with s_block, and
    only the blocks holding the NaN or inf become NaN."""
    _amaxes("block_scales", block_scales)
    if amax is None:
        return block_scales
    amax = _one_value("amax", amax, "block_scales", block_scales)
    encode = nvfp4_encode_scale(amax)
    with_amax = (block_scales * amax) * _RCP_2688
    consistent = block_scales * reciprocal(encode)
    usual = torch.isfinite(amax) & (encode < FLOAT32_MAX)
    return torch.where(usual, with_amax, consistent)


# --- random Hadamard transform -----------------------------------------------------------------------


def hadamard_matrix(size: int = NVFP4_BLOCK, seed: int = 0) -> torch.Tensor:
    """The orthonormal randomized Hadamard matrix D·H/√size (float32, size×size), signs D from ``seed``.

    H is Sylvester's; D = diag(±1) drawn from torch.Generator(seed). Rows are orthonormal, so
    applying it to both GEMM operands along their shared axis leaves the product unchanged.
    """
    checks.integer("size", size, low=1)
    checks.seed("seed", seed)
    checks.allocatable("size", (size, size))
    if size & (size - 1):
        raise ValueError(f"size must be a power of two, got {size}")
    return _cached_hadamard(size, seed).clone()


_HADAMARD_CACHE: dict = {}


def _cached_hadamard(size: int, seed: int) -> torch.Tensor:
    """The same matrix, shared and read-only (compiled qdq reads it as a constant)."""
    if (size, seed) not in _HADAMARD_CACHE:
        _HADAMARD_CACHE[size, seed] = _randomized_hadamard(size, seed)
    return _HADAMARD_CACHE[size, seed]


def _randomized_hadamard(size: int, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
    return (signs[:, None] * h / size**0.5).float()


def hadamard_transform(x: torch.Tensor, seed: int = 0, inverse: bool = False, dim: int = -1) -> torch.Tensor:
    """x along ``dim``, in chunks of 16, times the seeded randomized Hadamard matrix (or its inverse).

    Computed in float32 as an exact ×1/4 (first, so no partial sum can overflow), signs, and four
    butterfly stages of sums and differences (Sylvester's H₁₆ = H₂⊗H₂⊗H₂⊗H₂): the same values as
    ``chunk @ hadamard_matrix(16, seed)`` up to float32 rounding of the partial sums, elementwise,
    so the bits depend neither on the layout nor on whether the code is compiled. The 16 positions of
    a chunk are held as 16 separate columns: inductor fuses that into one loop (with
    ``qlab.kernels.compiled.COMPILE_OPTIONS``), where a reshape and a stack per stage cost it 3.6× more.
    """
    checks.tensor("x", x, floating=True)
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x must have a dimension and hold a value, got shape {tuple(x.shape)}")
    checks.seed("seed", seed)
    checks.boolean("inverse", inverse)
    checks.integer("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d tensor, got {dim}")
    dim = dim % x.dim()
    if x.shape[dim] % NVFP4_BLOCK:
        raise ValueError(
            f"the Hadamard transform needs x's length along dim to be a multiple of {NVFP4_BLOCK}, "
            f"got {x.shape[dim]}"
        )
    lead, trail = x.shape[:dim], math.prod(x.shape[dim + 1 :])
    chunks = x.float().reshape(*lead, -1, NVFP4_BLOCK, trail) * 0.25  # first, as x·M does: no overflow
    signs = hadamard_signs(seed)
    columns = list(chunks.unbind(-2))
    if not inverse:
        columns = [c * sign for c, sign in zip(columns, signs)]
    for stride in (8, 4, 2, 1):  # the pairs (i, i + stride) within each group of 2·stride
        for i in range(NVFP4_BLOCK):
            if i & stride == 0:
                first, second = columns[i], columns[i + stride]
                columns[i], columns[i + stride] = first + second, first - second
    if inverse:
        columns = [c * sign for c, sign in zip(columns, signs)]
    return torch.stack(columns, dim=-2).reshape(x.shape)


_HADAMARD_SIGNS: dict = {}


@torch.compiler.assume_constant_result  # read once while tracing, a constant in the graph: no break
def hadamard_signs(seed: int) -> tuple[float, ...]:
    """The ±1 diagonal D of hadamard_matrix(16, seed), as Python floats (constants when compiled)."""
    if seed not in _HADAMARD_SIGNS:
        matrix = _cached_hadamard(NVFP4_BLOCK, seed)  # column 0 of Sylvester's H is all ones: D's signs
        _HADAMARD_SIGNS[seed] = tuple(torch.sign(matrix[:, 0]).tolist())
    return _HADAMARD_SIGNS[seed]
