"""quantize / dequantize / qdq for every recipe, behind one API.

    q = quantize(x, MXSpec("e4m3", mode="rceil"), axis=-1)   # QTensor: codes, scales, spec, axis
    x_hat = dequantize(q)                                      # back to x's dtype and shape
    x_hat = qdq(x, "nvfp4")                                    # the same numbers in one call

``axis`` is the axis a scale is shared along: MX and NVFP4 blocks run along it (the GEMM's
reduction axis), an "axis"-granularity scale covers one whole slice along it (per-token scaling of
activations (tokens, features) is axis=-1; the seed's per-channel is axis=0). Tensor granularity
ignores it. Internally x is moved so that ``axis`` is last and, for block formats, zero-padded to a
whole number of blocks; ``QTensor.codes`` keep that blocked layout. A QTensor remembers its axis
and (by reference) its high-precision source, so ``q.along(other_axis)`` re-quantizes from high
precision; it never transposes blocked codes.

Specs (frozen dataclasses, hashable, usable as papermill strings through ``SPECS``); each is one
class implementing the ``QuantSpec`` protocol, so adding a recipe touches one place here:

| spec | elements | scales |
|---|---|---|
| TensorwiseSpec | e4m3/e5m2 (any float format) | FP8 current, per tensor or per slice; or given (delayed) |
| BlockwiseSpec | e4m3/e5m2 | FP8 current per 1×128 tile or 128×128 block (DeepSeek-V3, TE) |
| IntSpec | intN/uintN | symmetric amax/qmax, or asymmetric with a zero point |
| MXSpec | e4m3, e5m2, e3m2, e2m3, e2m1 | one E8M0 per 32 (or 32×32 tile), mode floor/rceil/ceil/even |
| NVFP4Spec | e2m1 | one E4M3 per 16 (1×16) or per 16×16 tile, FP32 global; optional RHT |

``convention`` (TensorwiseSpec, NVFP4Spec): "nvidia" (the default) reproduces TransformerEngine's
reference and kernels bit for bit; "torchao" reproduces torchao's reference where the two differ
(docs/reference.md §2: NVFP4's block-scale floor and operation order, FP8's dequantize by division).

This module is the reference: plain eager torch ops, traceable whole by ``torch.compile``. The fast
paths — the C kernel on the CPU, the compiled qdq for large inputs, the Triton kernels on a GPU, the
fast stochastic-rounding draws — live in ``qlab.kernels`` (``kernels.qdq``, ``kernels.quantize``),
which call down into this module and give its bits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from qlab import checks, compat, ops, scaling
from qlab.formats import (
    ROUNDING_MODES,
    FloatFormat,
    cast_unchecked,
    decode_unchecked,
    encode_float,
    fast_path_applies,
    get_format,
    pack_fp4,
    round_to_integer,
)

GRANULARITIES = ("tensor", "axis")
CONVENTIONS = ("nvidia", "torchao")


def _check_rounding(rounding):
    checks.choice("rounding", rounding, ROUNDING_MODES)


def _check_granularity(granularity):
    checks.choice("granularity", granularity, GRANULARITIES)


class QuantSpec:
    """What every spec is: quantize, dequantize, qdq and the kernels know a spec only through this.

    Layout attributes (class-level defaults, overridden by a spec's fields or properties):
      block_size: elements along the axis that share a scale (None: per tensor or per slice);
      tile_rows: rows of a 2-D tile (1: 1-D blocks; 16 for NVFP4 16×16, 32 for MXFP8 32×32,
        128 for FP8 128×128 weight blocks); tiles need x to have at least 2 dimensions;
      hadamard: the layout is rotated by the seeded 16-point Hadamard transform before blocking;
      accepts_fixed_scale: a given scale (delayed scaling) may replace the computed one;
      float32_noise: stochastic rounding draws ``stochastic_noise`` (False: float64 torch.rand).
    Methods, each on quantize's layout tensor (``to_layout``) with scales shared along ``dim``:
      ``quantize_layout`` → (parts, dequantized), parts holding "values" (on the element grid),
      "scales" and any of "scale_codes", "zero_point", "global_scale", "global_amax" (QTensor's fields);
      ``dequantize_values`` (element values, QTensor) → dequantized values in the layout;
      ``inside_range`` → True where an element was not clipped;
      ``check_values`` refuses data the element format cannot hold (eager only);
      ``block_multipliers`` (block specs) → what dequantize multiplies each block by, (..., rows, n_blocks);
      ``scale_codes`` → the block scales' integer codes (computed by quantize only, not on qdq's path).
    A new spec is one frozen dataclass subclassing QuantSpec plus its presets in SPECS.
    """

    block_size: int | None = None
    tile_rows: int = 1
    hadamard: bool = False
    hadamard_seed: int = 0
    pad: bool = True
    granularity: str = "block"
    accepts_fixed_scale: bool = False
    float32_noise: bool = True
    rounding: str = "rne"
    element: str

    @property
    def moves_axis(self) -> bool:
        """Whether the layout moves ``axis`` last (per-tensor scales need no transpose copy)."""
        return self.block_size is not None or self.granularity == "axis"

    def check_values(self, x: torch.Tensor) -> None:
        element = get_format(self.element)
        if not element.has_nan and checks.holds_nan(x):
            raise ValueError(f"{element.name} has no NaN encoding, but x holds NaN")

    def quantize_layout(self, x, generator=None, scale=None, dim: int = -1) -> tuple[dict, torch.Tensor]:
        raise NotImplementedError

    def dequantize_values(self, values: torch.Tensor, q: QTensor) -> torch.Tensor:
        """Block specs: the element values times their block's multiplier (``block_multipliers``)."""
        parts = {"scales": q.scales, "global_scale": q.global_scale, "global_amax": q.global_amax}
        return values * self.block_multipliers(parts)[..., None]

    def block_multipliers(self, parts: dict) -> torch.Tensor:
        raise NotImplementedError

    def scale_codes(self, parts: dict) -> torch.Tensor | None:
        """The integer codes of the block scales (E8M0 bytes, E4M3 codes), None where scales are float32."""
        return parts.get("scale_codes")

    def inside_range(self, layout: torch.Tensor, parts: dict) -> torch.Tensor:
        raise NotImplementedError


def _block_amax(magnitude: torch.Tensor, spec: QuantSpec, dim: int) -> torch.Tensor:
    """The amax of each element's block, kept as a size-1 ``dim``; for 2-D tiles (blocked layout
    (..., rows, n_blocks, block) only) the tile's amax repeated on each of its rows."""
    if spec.tile_rows == 1:
        return magnitude.amax(dim, keepdim=True)
    *lead, rows, blocks, block = magnitude.shape
    tiles = magnitude.reshape(*lead, rows // spec.tile_rows, spec.tile_rows, blocks, block)
    tile_amax = tiles.amax(dim=(-3, -1), keepdim=True)
    return tile_amax.expand(*lead, rows // spec.tile_rows, spec.tile_rows, blocks, 1).reshape(
        *lead, rows, blocks, 1
    )


def _stored_scales(per_block: torch.Tensor, spec: QuantSpec, dim: int) -> torch.Tensor:
    """Scales as QTensor stores them: one per block (..., n_blocks), one per tile (..., rows/t, n_blocks)."""
    scales = per_block.squeeze(dim)
    return scales[..., :: spec.tile_rows, :] if spec.tile_rows > 1 else scales


def block_scales(stored: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Stored scales expanded to one per block row (..., rows, n_blocks) (2-D tiles repeated)."""
    return stored.repeat_interleave(spec.tile_rows, dim=-2) if spec.tile_rows > 1 else stored


def _dequantize_multiply(values: torch.Tensor, scale: torch.Tensor, convention: str) -> torch.Tensor:
    """values / scale (torchao) or values · fl(1/scale) (NVIDIA: cuBLAS and TE multiply by scale_inv)."""
    if convention == "torchao":
        return values / scale
    return values * scaling.reciprocal(scale)


def amax(x: torch.Tensor, spec: QuantSpec, dim: int) -> torch.Tensor:
    """The amax a per-tensor or per-slice spec scales by: over all of x, or along ``dim`` (kept)."""
    spec = get_spec(spec)
    checks.tensor("x", x, real=True)
    if not hasattr(spec, "granularity"):
        raise TypeError(f"spec must be a per-tensor or per-slice spec (granularity), got {spec!r}")
    if spec.granularity == "tensor":
        return x.abs().amax()
    checks.integer("dim", dim, low=-max(x.dim(), 1), high=max(x.dim(), 1) - 1)
    return x.abs().amax(dim, keepdim=True)


MAX_BLOCK_SIZE = 2**24  # elements a block may hold: the axis is padded to a whole block, so a larger one
# would ask for more memory than a block can usefully span


@dataclass(frozen=True)
class TensorwiseSpec(QuantSpec):
    """FP8 current scaling: stored = cast(x · scale), scale = fmt_max / amax (TE), per tensor or per
    slice. ``convention``: "nvidia" dequantizes as cuBLAS and TE do, values · fl(1/scale);
    "torchao" divides, values / scale (the two differ by at most one ulp)."""

    element: str = "e4m3"
    granularity: str = "tensor"
    pow2: bool = False
    eps: float = 0.0
    rounding: str = "rne"
    convention: str = "nvidia"

    block_size = None
    accepts_fixed_scale = True

    def __post_init__(self):
        scaling.float_format(self.element, "element")
        _check_granularity(self.granularity)
        checks.boolean("pow2", self.pow2)
        checks.number("eps", self.eps, low=0, high=scaling.FLOAT32_MAX)  # a float32 floor
        _check_rounding(self.rounding)
        checks.choice("convention", self.convention, CONVENTIONS)

    def quantize_layout(self, x, generator=None, scale=None, dim=-1):
        if scale is None:
            scale = scaling.fp8_current_scale(amax(x, self, dim), self.element, eps=self.eps, pow2=self.pow2)
        values = cast_unchecked(x * scale, get_format(self.element), self.rounding, True, generator)
        return {"values": values, "scales": scale}, _dequantize_multiply(values, scale, self.convention)

    def dequantize_values(self, values, q):
        return _dequantize_multiply(values, q.scales, self.convention)

    def inside_range(self, layout, parts):
        return (layout * parts["scales"]).abs() <= get_format(self.element).max


@dataclass(frozen=True)
class BlockwiseSpec(QuantSpec):
    """FP8 blockwise scaling (DeepSeek-V3; TE's Float8BlockScaling): one float32 scale per 1×128
    tile along the axis (activations, gradients) or per 128×128 block (``block_2d``, weights).
    scale = fmt_max / max(amax, eps) as in FP8 current scaling (``pow2``: rounded down to a power of
    two, TE's default), stored = cast(x · scale), dequantized = values · fl(1/scale)."""

    element: str = "e4m3"
    block_size: int = 128
    block_2d: bool = False
    pow2: bool = True
    eps: float = 0.0
    pad: bool = True
    rounding: str = "rne"

    def __post_init__(self):
        checks.choice("element", self.element, ("e4m3", "e5m2"))
        checks.integer("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        for flag in ("block_2d", "pow2", "pad"):
            checks.boolean(flag, getattr(self, flag))
        checks.number("eps", self.eps, low=0, high=scaling.FLOAT32_MAX)  # a float32 floor
        _check_rounding(self.rounding)

    @property
    def tile_rows(self) -> int:
        return self.block_size if self.block_2d else 1

    def quantize_layout(self, x, generator=None, scale=None, dim=-1):
        per_block = scaling.fp8_current_scale(
            _block_amax(x.abs(), self, dim), self.element, eps=self.eps, pow2=self.pow2
        )
        values = cast_unchecked(x * per_block, get_format(self.element), self.rounding, True, generator)
        parts = {"values": values, "scales": _stored_scales(per_block, self, dim)}
        return parts, values * scaling.reciprocal(per_block)

    def block_multipliers(self, parts):
        return scaling.reciprocal(block_scales(parts["scales"], self))

    def inside_range(self, layout, parts):
        scales = block_scales(parts["scales"], self)[..., None]
        return (layout * scales).abs() <= get_format(self.element).max


@dataclass(frozen=True)
class IntSpec(QuantSpec):
    """Integer affine quantization (the seed's Quantizer, with clamping and safe zero ranges)."""

    bits: int = 8
    signed: bool = True
    symmetric: bool = True
    granularity: str = "tensor"
    rounding: str = "rne"

    block_size = None

    def __post_init__(self):
        checks.integer("bits", self.bits, low=2, high=16)
        checks.boolean("signed", self.signed)
        checks.boolean("symmetric", self.symmetric)
        if not self.signed and self.symmetric:
            raise ValueError(
                "symmetric=True with signed=False would zero every negative value; "
                "use signed=True, or symmetric=False for an unsigned grid with a zero point"
            )
        _check_granularity(self.granularity)
        _check_rounding(self.rounding)

    @property
    def element(self) -> str:
        return f"{'int' if self.signed else 'uint'}{self.bits}"

    @property
    def accepts_fixed_scale(self) -> bool:
        return self.symmetric

    @property
    def float32_noise(self) -> bool:
        return self.symmetric  # the asymmetric grid rounds with round_to_integer's float64 draws

    def check_values(self, x):
        if not checks.all_finite(x):
            raise ValueError(f"{self.element} has no inf or NaN encoding, but x holds inf or NaN")

    def quantize_layout(self, x, generator=None, scale=None, dim=-1):
        fmt = get_format(self.element)
        if self.symmetric:
            scale = scaling.int_symmetric_scale(amax(x, self, dim), fmt.max) if scale is None else scale
            values = (
                cast_unchecked(x / scale, fmt, self.rounding, True, generator) + 0.0
            )  # integers have no -0
            return {"values": values, "scales": scale}, values * scale
        if self.granularity == "tensor":
            lo, hi = x.amin(), x.amax()
        else:
            lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        scale, zero_point = scaling.int_affine_parameters(lo, hi, fmt.min, fmt.max)
        rounded = round_to_integer(x / scale, self.rounding, generator) + zero_point
        values = cast_unchecked(rounded, fmt) + 0.0  # clamp; -0 → +0
        parts = {"values": values, "scales": scale, "zero_point": zero_point}
        return parts, (values - zero_point) * scale

    def dequantize_values(self, values, q):
        return values * q.scales if self.symmetric else (values - q.zero_point) * q.scales

    def inside_range(self, layout, parts):
        # torch's FakeQuantize compares the rounded value: qmin ≤ round(x/s) + zero_point ≤ qmax
        fmt = get_format(self.element)
        rounded = torch.round(layout / parts["scales"]) + parts.get("zero_point", 0.0)
        return (rounded >= fmt.min) & (rounded <= fmt.max)


@dataclass(frozen=True)
class MXSpec(QuantSpec):
    """OCP Microscaling: blocks of ``block_size`` along the axis share one E8M0 scale.

    ``block_2d``: one scale per block_size × block_size tile (TE's 2-D MXFP8 weights, so forward and
    backward see the same quantized weight). ``hadamard``: the seeded 16-point random Hadamard
    transform along the axis first (the MXFP4 training recipe's wgrad operands).
    """

    element: str = "e4m3"
    block_size: int = 32
    mode: str = "floor"
    pad: bool = True
    rounding: str = "rne"
    block_2d: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0

    def __post_init__(self):
        checks.choice("element", self.element, ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"))
        checks.integer("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        checks.choice("mode", self.mode, scaling.MX_SCALE_MODES)
        for flag in ("pad", "block_2d", "hadamard"):
            checks.boolean(flag, getattr(self, flag))
        checks.seed("hadamard_seed", self.hadamard_seed)
        _check_rounding(self.rounding)
        if self.hadamard and self.block_size % scaling.HADAMARD_SIZE:
            raise ValueError(
                f"hadamard=True rotates chunks of {scaling.HADAMARD_SIZE}, so block_size must be a "
                f"multiple of {scaling.HADAMARD_SIZE}, got {self.block_size}"
            )

    @property
    def tile_rows(self) -> int:
        return self.block_size if self.block_2d else 1

    def check_values(self, x):
        pass  # a NaN or inf makes its block's scale NaN (OCP), not an error

    def quantize_layout(self, x, generator=None, scale=None, dim=-1):
        fmt = get_format(self.element)
        block_amax = _block_amax(x.abs(), self, dim)
        per_block, inverse, codes = scaling.mx_block_scales(block_amax, fmt, self.mode)
        scaled = torch.where(torch.isnan(inverse), 0.0, x * inverse)  # a NaN/inf block: codes 0, scale NaN
        values = cast_unchecked(scaled, fmt, self.rounding, True, generator)
        parts = {
            "values": values,
            "scales": _stored_scales(per_block, self, dim),
            "scale_codes": _stored_scales(codes, self, dim),
        }
        return parts, values * per_block

    def block_multipliers(self, parts):
        return block_scales(parts["scales"], self)

    def inside_range(self, layout, parts):
        return layout.abs() / block_scales(parts["scales"], self)[..., None] <= get_format(self.element).max


@dataclass(frozen=True)
class NVFP4Spec(QuantSpec):
    """NVFP4: E2M1 elements, E4M3 scales per 16 (or per 16×16 tile), one FP32 global scale.

    ``convention`` (docs/reference.md §2): "nvidia" evaluates NVIDIA's formula in TransformerEngine's
    float32 order, with no lower clamp on the block scale (E4M3 subnormal and zero scales are
    used); "torchao" follows torchao's reference (block scale clamped to [2^-6, 448], divisions).
    """

    block_2d: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0
    global_scale: bool = True
    pad: bool = True
    rounding: str = "rne"
    convention: str = "nvidia"

    element = "e2m1"
    block_size = scaling.NVFP4_BLOCK

    def __post_init__(self):
        for flag in ("block_2d", "hadamard", "global_scale", "pad"):
            checks.boolean(flag, getattr(self, flag))
        checks.seed("hadamard_seed", self.hadamard_seed)
        _check_rounding(self.rounding)
        checks.choice("convention", self.convention, CONVENTIONS)

    @property
    def tile_rows(self) -> int:
        return scaling.NVFP4_BLOCK if self.block_2d else 1

    def check_values(self, x):
        pass  # a NaN or inf makes its block's scale NaN, not an error

    def quantize_layout(self, x, generator=None, scale=None, dim=-1):
        magnitude = x.abs()
        block_amax = _block_amax(magnitude, self, dim)
        tensor_amax = block_amax.amax() if self.global_scale else None  # = magnitude.amax(), one pass fewer
        if self.convention == "nvidia":
            encode = None if tensor_amax is None else scaling.nvfp4_encode_scale(tensor_amax)
            global_scale = None if encode is None else scaling.reciprocal(encode)  # S_dec
            per_block = scaling.nvfp4_block_scales_nvidia(block_amax, encode)
            scaled = x * scaling.nvfp4_element_inverse(per_block, global_scale)
        else:
            global_scale = None if tensor_amax is None else scaling.nvfp4_global_scale(tensor_amax)
            per_block = scaling.nvfp4_block_scales(block_amax, global_scale)
            scaled = _nvfp4_scaled_torchao(x, global_scale, per_block)
        limit = scaling.NVFP4_ELEMENT_MAX
        scaled = torch.where(torch.isnan(scaled), 0.0, scaled.clamp(-limit, limit))  # NaN only in NaN blocks
        values = cast_unchecked(scaled, get_format("e2m1"), self.rounding, True, generator)
        stored = _stored_scales(per_block, self, dim)
        parts = {
            "values": values,
            "scales": stored,
            "global_scale": global_scale,
            "global_amax": tensor_amax if self.convention == "nvidia" else None,
        }
        return parts, values * self._multipliers(per_block, global_scale, parts["global_amax"])

    def _multipliers(self, per_block, global_scale, global_amax):
        if global_scale is None:
            return per_block
        if self.convention == "nvidia":
            return scaling.nvfp4_dequantize_multiplier(per_block, global_amax)
        return global_scale * per_block

    def block_multipliers(self, parts):
        """What dequantize multiplies each block's element values by (…, rows, n_blocks): NVIDIA's
        fl(fl(s_block · amax) · fl(1/2688)), or torchao's global · s_block."""
        per_block = block_scales(parts["scales"], self)
        return self._multipliers(per_block, parts["global_scale"], parts.get("global_amax"))

    def scale_codes(self, parts):
        return encode_float(parts["scales"], get_format("e4m3"))

    def inside_range(self, layout, parts):
        per_block = block_scales(parts["scales"], self)[..., None]
        if self.convention == "nvidia":
            scaled = layout.abs() * scaling.nvfp4_element_inverse(per_block, parts["global_scale"])
        else:
            scaled = _nvfp4_scaled_torchao(layout.abs(), parts["global_scale"], per_block)
        return scaled <= scaling.NVFP4_ELEMENT_MAX


def _nvfp4_scaled_torchao(x, global_scale, block_scales):
    """x / (global · block) in float32, as torchao orders it: x · (fl(1/global) / block). For a tiny
    tensor that inverse overflows (1/global alone beyond float32 below amax ≈ 7.9·10⁻³⁶, or divided by a
    small block scale below amax ≈ 5·10⁻³⁴), which coded every non-zero element ±6; there x is divided
    by the global and then the block scale instead (each quotient finite: |x| / global ≤ 2688).
    Off the CPU with a global scale it runs as one opaque op: compiled, inductor's code for it parted
    from eager's bits at exact E2M1 ties."""
    # torch.reciprocal, not 1.0 / t: the same bits eagerly, and inductor's Triton code then divides
    # correctly rounded (its untyped 1.0 constant would take the approximate division)
    if global_scale is None:
        return x * torch.reciprocal(block_scales)
    if x.device.type != "cpu":
        return _nvfp4_scaled_torchao_op(x.detach(), global_scale.detach(), block_scales.detach())
    return _nvfp4_scaled_torchao_eager(x, global_scale, block_scales)


def _nvfp4_scaled_torchao_eager(x, global_scale, block_scales):
    inverse = torch.reciprocal(global_scale) / block_scales
    return torch.where(torch.isinf(inverse), (x / global_scale) / block_scales, x * inverse)


_nvfp4_scaled_torchao_op = ops.define(
    "nvfp4_scaled_torchao",
    "(Tensor x, Tensor global_scale, Tensor block_scales) -> Tensor",
    _nvfp4_scaled_torchao_eager,
    lambda x, global_scale, block_scales: x.new_empty(
        torch.broadcast_shapes(x.shape, global_scale.shape, block_scales.shape)
    ),
)


Spec = QuantSpec
SPEC_CLASSES: dict[str, type] = {
    cls.__name__: cls for cls in (TensorwiseSpec, BlockwiseSpec, IntSpec, MXSpec, NVFP4Spec)
}

SPECS: dict[str, Spec] = {
    "fp8_e4m3": TensorwiseSpec("e4m3"),
    "fp8_e5m2": TensorwiseSpec("e5m2"),
    "fp8_e4m3_pow2": TensorwiseSpec("e4m3", pow2=True),
    "fp8_e4m3_rowwise": TensorwiseSpec("e4m3", granularity="axis"),
    "fp8_blockwise": BlockwiseSpec("e4m3"),
    "fp8_blockwise_2d": BlockwiseSpec("e4m3", block_2d=True),
    "int8": IntSpec(8),
    "int8_rowwise": IntSpec(8, granularity="axis"),
    "int4_rowwise": IntSpec(4, granularity="axis"),
    "uint8_asymmetric": IntSpec(8, signed=False, symmetric=False),
    "mxfp8": MXSpec("e4m3"),
    "mxfp8_rceil": MXSpec("e4m3", mode="rceil"),
    "mxfp8_2d": MXSpec("e4m3", mode="rceil", block_2d=True),
    "mxfp8_e5m2": MXSpec("e5m2"),
    "mxfp6_e3m2": MXSpec("e3m2"),
    "mxfp6_e2m3": MXSpec("e2m3"),
    "mxfp4": MXSpec("e2m1"),
    "mxfp4_rceil": MXSpec("e2m1", mode="rceil"),
    "nvfp4": NVFP4Spec(),
    "nvfp4_2d": NVFP4Spec(block_2d=True),
    "nvfp4_rht": NVFP4Spec(hadamard=True),
    "nvfp4_torchao": NVFP4Spec(convention="torchao"),
}


def get_spec(spec: str | Spec) -> Spec:
    """A spec object, or one of the named presets in ``SPECS``; anything else is refused."""
    # `is`, not `in dict.values()`: torch 2.11's Dynamo cannot trace == between classes (a graph break)
    if isinstance(spec, QuantSpec) and any(type(spec) is cls for cls in SPEC_CLASSES.values()):
        return spec
    if isinstance(spec, str) and spec in SPECS:
        return SPECS[spec]
    if not isinstance(spec, str):
        raise TypeError(
            f"spec must be a spec object ({', '.join(SPEC_CLASSES)}) or a preset name from SPECS, "
            f"got {checks.shown(spec)}"
        )
    raise ValueError(
        f"unknown quantization spec {spec!r}; expected a spec object or one of: {', '.join(SPECS)}"
    )


@dataclass
class QTensor:
    """A quantized tensor in the blocked layout (``axis`` moved last, padded to whole blocks).

    codes: integer codes of the elements (uint8 for float elements, int for integer elements).
    scales: float32 scales. TensorwiseSpec and BlockwiseSpec: TE's multiplier, stored = cast(x · scale),
      dequantize multiplies by fl(1/scale) (torchao convention: divides). IntSpec: the step,
      q = round(x / scale), dequantize multiplies. MXSpec: the block value X that dequantize
      multiplies by; NVFP4Spec: the E4M3 block scale. 2-D specs keep one per tile (..., rows/t, n_blocks).
    scale_codes: E8M0 bytes (MX) or E4M3 codes (NVFP4).
    zero_point (asymmetric IntSpec) and global_scale (NVFP4: S_dec = fl(1/S_enc) in NVIDIA's
    convention, amax/2688 in torchao's) where they apply; global_amax: the tensor amax NVIDIA's
    NVFP4 dequantizes with (TE keeps it beside the data too).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    spec: Spec
    axis: int
    shape: torch.Size
    dtype: torch.dtype
    scale_codes: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    global_amax: torch.Tensor | None = None
    source: torch.Tensor | None = field(default=None, repr=False)
    fixed_scale: torch.Tensor | None = field(default=None, repr=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)

    def along(self, axis: int, *, generator: torch.Generator | None = None) -> QTensor:
        """The same high-precision tensor quantized along ``axis`` (never transposed codes).

        A fixed scale given to ``quantize`` (delayed scaling) is kept; stochastic rounding needs
        ``generator`` again.
        """
        if self.source is None:
            raise ValueError(
                "this QTensor kept no high-precision source (keep_source=False); "
                "re-quantizing along another axis needs the original tensor"
            )
        return quantize(self.source, self.spec, axis=axis, generator=generator, scale=self.fixed_scale)

    def storage_bytes(self) -> int:
        """Bytes a low-precision implementation keeps for this tensor: each of its ``shape``'s elements
        at the element format's width (two e2m1 per byte; no padding), each block scale as its code (one
        E8M0 or E4M3 byte) or as a float32 (one per tensor, tile, block or row, partial blocks included),
        a float32 zero point per scale for asymmetric integers, and one float32 for NVFP4's per-tensor
        scale."""
        element = self.spec.bits if isinstance(self.spec, IntSpec) else get_format(self.spec.element).bits
        total = math.ceil(math.prod(self.shape) * element / 8)
        total += self.scale_codes.numel() if self.scale_codes is not None else 4 * self.scales.numel()
        if self.zero_point is not None:
            total += 4 * self.zero_point.numel()
        if self.global_scale is not None:
            total += 4
        return total

    def packed_codes(self) -> torch.Tensor:
        """Element codes with two 4-bit codes per byte (e2m1 elements only)."""
        if self.spec.element != "e2m1":
            raise ValueError(f"packing two codes per byte needs 4-bit e2m1 elements, not {self.spec.element}")
        return pack_fp4(self.codes)


# --- layout ---------------------------------------------------------------------------------------


def check_input(x, spec: Spec, axis: int, *, values: bool = True) -> int:
    """Refuse what ``spec`` cannot quantize along ``axis`` (dtype, dimensions, and with ``values``
    the values its element format cannot hold: eagerly only, since reading values syncs with the
    device); the axis made non-negative."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        found = x.dtype if isinstance(x, torch.Tensor) else checks.shown(x)
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {found}")
    checks.tensor("x", x)  # a meta tensor has no values to quantize
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    checks.integer("axis", axis)
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d x, got {axis!r}")
    if spec.tile_rows > 1 and x.dim() < 2:
        raise ValueError(
            f"x must have at least 2 dimensions for {spec.tile_rows}x{spec.block_size} 2-D blocks, "
            f"got shape {tuple(x.shape)}"
        )
    if values and not torch.compiler.is_compiling():
        spec.check_values(x)
    return axis % x.dim()


def _pad_to(x: torch.Tensor, dim: int, multiple: int, pad: bool) -> torch.Tensor:
    length = x.shape[dim]
    extra = -length % multiple
    if extra == 0:
        return x
    if not pad:
        raise ValueError(
            f"axis length {length} is not a multiple of the block size {multiple}; "
            f"pass pad=True in the spec or use a length divisible by {multiple}"
        )
    widths = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, widths)


def to_layout(x: torch.Tensor, spec: Spec, axis: int) -> torch.Tensor:
    """x as float32 in quantize's layout: ``axis`` last; for block specs zero-padded to whole blocks
    (and whole tiles), Hadamard-rotated if the spec says so, and shaped (..., n_blocks, block)."""
    spec = get_spec(spec)
    if not isinstance(x, torch.Tensor):  # a meta tensor is fine: noise_shape lays out shapes only
        raise TypeError(f"x must be a torch.Tensor, got {checks.shown(x)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"x must hold real numbers, got dtype {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x must have a dimension and hold a value, got shape {tuple(x.shape)}")
    checks.integer("axis", axis, low=-x.dim(), high=x.dim() - 1)
    if not spec.moves_axis:
        return x.float()
    moved = x.float().movedim(axis, -1)
    if spec.block_size is None:
        return moved.contiguous()
    moved = _pad_to(moved, -1, spec.block_size, spec.pad)
    if spec.tile_rows > 1:
        moved = _pad_to(moved, -2, spec.tile_rows, spec.pad)
    if spec.hadamard:
        moved = scaling.hadamard_transform(moved, spec.hadamard_seed)
    return moved.reshape(*moved.shape[:-1], -1, spec.block_size)


@torch.library.custom_op("qlab::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of x, opaque to torch.compile: inductor writes x out instead of fusing it into its readers."""
    return x.clone()


_materialize.register_fake(torch.empty_like)
_materialize.register_autograd(lambda ctx, grad: grad)


def _unrotated(values: torch.Tensor, spec: Spec, dim: int = -1) -> torch.Tensor:
    """The inverse Hadamard transform of the dequantized values along ``dim``, which are written out
    first when traced. The inverse reads each of a chunk's 16 values 16 times; fused under the high
    threshold of qlab.kernels.compiled.COMPILE_OPTIONS, inductor recomputed the whole qdq for every
    read and emitted kernels that took minutes to compile; with the copy, compilation is several
    times shorter and the step no slower. Eagerly, no copy."""
    if torch.compiler.is_compiling():
        values = _materialize(values)
    return scaling.hadamard_transform(values, spec.hadamard_seed, inverse=True, dim=dim)


def from_layout(
    values: torch.Tensor, spec: Spec, axis: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of ``to_layout``: x's shape and ``dtype`` (padding dropped, rotation undone)."""
    if not spec.moves_axis:
        return values.to(dtype)
    moved_shape = list(shape)
    moved_shape.append(moved_shape.pop(axis))
    if spec.block_size is not None:
        values = values.flatten(-2)
        if spec.hadamard:
            values = _unrotated(values, spec)
        values = values[..., : moved_shape[-1]]
        if spec.tile_rows > 1:
            values = values[..., : moved_shape[-2], :]
    return values.reshape(moved_shape).movedim(-1, axis).to(dtype)


def _check_scale(scale, spec, x=None, axis: int = -1):
    """A fixed (delayed-scaling) scale: a positive finite number, or a real tensor on x's device with
    one value per tensor, or per slice along ``axis`` for a per-slice spec (one value also does), shaped
    as x with that axis kept as 1, and never of more dimensions than x."""
    if scale is None:
        return None
    if not spec.accepts_fixed_scale:
        raise ValueError(
            f"a fixed scale (delayed scaling) is only supported for TensorwiseSpec and symmetric IntSpec, "
            f"got {spec!r}"
        )
    if isinstance(scale, torch.Tensor):
        checks.tensor("scale", scale)
        if scale.is_complex() or scale.dtype == torch.bool:
            raise TypeError(f"scale must be a real tensor or number, got dtype {scale.dtype}")
        if x is not None:
            checks.same_device("scale", scale, "x", x)
            per_slice = getattr(spec, "granularity", "tensor") != "tensor"
            slices = x.numel() // max(x.shape[axis], 1) if per_slice and x.dim() else 1
            if scale.numel() not in (1, slices):
                expected = (
                    f"1 or {slices} values (one per slice along axis {axis})" if per_slice else "one value"
                )
                raise ValueError(
                    f"scale must hold {expected} for x of shape {tuple(x.shape)}, "
                    f"got shape {tuple(scale.shape)}"
                )
            if scale.dim() > x.dim():  # x · scale would take the scale's extra dimensions
                raise ValueError(
                    f"scale must have at most x's {x.dim()} dimensions, got shape {tuple(scale.shape)}"
                )
            kept = tuple(1 if d == axis % x.dim() else n for d, n in enumerate(x.shape)) if x.dim() else ()
            if scale.numel() == slices > 1 and tuple(scale.shape) != kept:  # a flat one broadcasts wrongly
                raise ValueError(
                    f"scale must have shape {kept} for x of shape {tuple(x.shape)} (one value per slice "
                    f"along axis {axis}, that axis kept as 1), got shape {tuple(scale.shape)}"
                )
        scale = scale.float()
    else:
        scale = torch.tensor(checks.number("scale", scale, low=0, open_low=True))
    if not torch.compiler.is_compiling() and not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("a fixed scale must be finite and positive")
    return scale


def _check_generator(spec, generator):
    checks.generator("generator", generator)
    if generator is not None and spec.rounding != "stochastic":
        raise ValueError("a generator only makes sense with a spec whose rounding is 'stochastic'")


def _randomness(x, spec, axis, generator, noise, *, blocked: bool):
    """What the recipes draw from: ``generator``, or pre-drawn ``noise`` of ``noise_shape``."""
    _check_generator(spec, generator)
    if noise is None:
        return generator
    checks.tensor("noise", noise, dtypes=(torch.float32,))
    if generator is not None:
        raise ValueError("pass a generator or pre-drawn noise, not both")
    if spec.rounding != "stochastic" or not draws_float32_noise(spec):
        raise ValueError(
            f"pre-drawn noise needs stochastic rounding with float32 noise (stochastic_noise), got {spec!r}"
        )
    expected = noise_shape(x, spec, axis, blocked=blocked)
    if tuple(noise.shape) != tuple(expected):
        raise ValueError(f"noise must have shape {tuple(expected)} (noise_shape), got {tuple(noise.shape)}")
    return noise


# --- public API ------------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    spec: str | Spec,
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
    keep_source: bool = True,
    noise: torch.Tensor | None = None,
) -> QTensor:
    """Quantize x (float32/bf16/fp16) by ``spec`` with scales shared along ``axis``.

    ``scale`` fixes the scale: for TensorwiseSpec the multiplier (delayed scaling passes
    ``DelayedScaling.scale``), for symmetric IntSpec the step;
    ``generator`` drives stochastic rounding, or ``noise`` gives its draws up front
    (``noise_shape(x, spec, axis, blocked=True)``); ``keep_source`` keeps a reference to x for ``along``.
    """
    spec = get_spec(spec)
    axis = check_input(x, spec, axis)
    if x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor x, got shape {tuple(x.shape)}")
    randomness = _randomness(x, spec, axis, generator, noise, blocked=True)
    scale = _check_scale(scale, spec, x, axis)
    checks.boolean("keep_source", keep_source)
    return quantize_unchecked(x, spec, axis, randomness, scale, keep_source)


def quantize_unchecked(
    x: torch.Tensor, spec: Spec, axis: int, randomness, scale, keep_source: bool
) -> QTensor:
    """``quantize`` of arguments already checked (``randomness``: the generator or drawn noise,
    ``scale`` as ``_check_scale`` returns it), as ``qdq_unchecked`` is ``qdq``'s."""
    parts, _ = spec.quantize_layout(to_layout(x, spec, axis), randomness, scale)
    values = parts.pop("values")
    fmt = get_format(spec.element)
    codes = encode_float(values, fmt) if isinstance(fmt, FloatFormat) else values.to(fmt.code_dtype)
    parts["scale_codes"] = spec.scale_codes(parts)
    return QTensor(
        codes=codes,
        spec=spec,
        axis=axis,
        shape=x.shape,
        dtype=x.dtype,
        source=x if keep_source else None,
        fixed_scale=scale,
        **parts,
    )


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values q represents, in ``dtype`` (default: the source's dtype) and the source's shape."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor (from quantize), got {checks.shown(q)}")
    checks.floating_dtype("dtype", dtype)
    out = q.spec.dequantize_values(decode_unchecked(q.codes, get_format(q.spec.element)), q)
    return from_layout(out, q.spec, q.axis, q.shape, dtype or q.dtype)


def _qdq_layout(layout: torch.Tensor, spec: Spec, generator=None, scale=None, dim: int = -1) -> torch.Tensor:
    return spec.quantize_layout(layout, generator, scale, dim)[1]


def _inplace_applies(x: torch.Tensor, spec: Spec, axis: int) -> bool:
    """qdq can block ``axis`` where it lies (no transpose) for 1-D blocks and per-slice scales."""
    if axis == x.dim() - 1 or not spec.moves_axis:
        return False
    return spec.tile_rows == 1


def _inplace_layout(x: torch.Tensor, spec: Spec, axis: int) -> torch.Tensor:
    """x as (outer, n_blocks, block, inner) float32 with blocks along ``axis`` (scale dim −2), zero-padded."""
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    view = x.float().reshape(outer, x.shape[axis], inner)
    if spec.block_size is not None:
        view = _pad_to(view, 1, spec.block_size, spec.pad)
        if spec.hadamard:
            view = scaling.hadamard_transform(view, spec.hadamard_seed, dim=1)
        return view.reshape(outer, -1, spec.block_size, inner)
    return view.reshape(outer, 1, x.shape[axis], inner)


def _from_inplace_layout(
    values: torch.Tensor, spec: Spec, axis: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    outer, inner = values.shape[0], values.shape[-1]
    values = values.reshape(outer, -1, inner)
    if spec.hadamard:
        values = _unrotated(values, spec, dim=1)
    return values[:, : shape[axis], :].reshape(shape).to(dtype)


def _qdq_any_layout(x: torch.Tensor, spec: Spec, axis: int, generator, scale, dtype) -> torch.Tensor:
    """qdq in the in-place layout where it applies, else in the blocked layout; same bits either way."""
    if _inplace_applies(x, spec, axis):
        out = _qdq_layout(_inplace_layout(x, spec, axis), spec, generator, scale, dim=-2)
        return _from_inplace_layout(out, spec, axis, x.shape, dtype)
    return from_layout(
        _qdq_layout(to_layout(x, spec, axis), spec, generator, scale), spec, axis, x.shape, dtype
    )


def noise_shape(x: torch.Tensor, spec: str | Spec, axis: int = -1, *, blocked: bool = False) -> torch.Size:
    """The shape of the uniform draws (``qlab.formats.stochastic_noise``) that stochastic rounding of
    ``x`` by ``spec`` along ``axis`` consumes: one per element of qdq's layout (``blocked=False``) or
    of quantize's blocked layout (``blocked=True``; the two differ for a non-last axis)."""
    spec = get_spec(spec)
    axis = check_input(x, spec, axis, values=False)  # shapes only: no read of x on this hot path
    checks.boolean("blocked", blocked)
    meta = torch.empty(x.shape, device="meta")
    if spec.hadamard:  # the transform keeps the shape; on meta tensors its ops run Python reference
        spec = dataclasses.replace(spec, hadamard=False)  # kernels, slow enough to dominate an eager step
    if not blocked and _inplace_applies(x, spec, axis):
        return _inplace_layout(meta, spec, axis).shape
    return to_layout(meta, spec, axis).shape


def qdq_with_mask(
    x: torch.Tensor,
    spec: str | Spec,
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdq(x), inside): inside is True where x was within the representable range (not clipped).

    The mask is what a clipped straight-through estimator passes gradients through. Eager only;
    not defined for Hadamard-rotated specs, whose clipping happens in the rotated domain.
    """
    spec = get_spec(spec)
    if spec.hadamard:
        raise ValueError(
            "a clipping mask is not defined for hadamard=True specs (clipping happens after rotation)"
        )
    axis = check_input(x, spec, axis)
    _check_generator(spec, generator)
    layout = to_layout(x, spec, axis)
    parts, out = spec.quantize_layout(layout, generator, _check_scale(scale, spec, x, axis))
    inside = spec.inside_range(layout, parts)
    return (
        from_layout(out, spec, axis, x.shape, x.dtype),
        from_layout(inside.to(torch.uint8), spec, axis, x.shape, torch.uint8).bool(),
    )


def draws_float32_noise(spec: Spec) -> bool:
    """Whether stochastic rounding by ``spec`` consumes ``stochastic_noise`` draws (which can be drawn
    up front), rather than float64 ``torch.rand`` (the reference cast, asymmetric integers)."""
    fast_stochastic = fast_path_applies(torch.empty(0), get_format(spec.element), "stochastic")
    return fast_stochastic and spec.float32_noise


def check_qdq_arguments(x, spec, axis, generator, noise, scale, dtype, out, *, values: bool = True):
    """``qdq``'s refusals, once: (spec, axis, randomness — the generator or the pre-drawn noise —,
    scale, dtype) as ``qdq_unchecked`` takes them. ``values=False`` checks shapes and dtypes only,
    for a caller whose path reads x's values itself."""
    spec = get_spec(spec)
    axis = check_input(x, spec, axis, values=values)
    randomness = _randomness(x, spec, axis, generator, noise, blocked=False)
    scale = _check_scale(scale, spec, x, axis)
    dtype = checks.floating_dtype("dtype", dtype) or x.dtype
    if out is not None:
        _check_out(out, x, dtype)
    return spec, axis, randomness, scale, dtype


def qdq_unchecked(x, spec: Spec, axis: int, randomness, scale, dtype: torch.dtype, out=None) -> torch.Tensor:
    """``qdq`` on arguments ``check_qdq_arguments`` returned: eager torch ops (traced whole inside
    torch.compile); ``out`` receives the result when given."""
    if x.numel() == 0:
        return x.to(dtype).clone() if out is None else out
    result = _qdq_any_layout(x, spec, axis, randomness, scale, dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def qdq(
    x: torch.Tensor,
    spec: str | Spec,
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
    dtype: torch.dtype | None = None,
    fast: bool | None = None,
    noise: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x, spec, axis), dtype) without materializing codes: same bits and shape.

    The reference, in eager torch ops, and several times slower than ``qlab.kernels.qdq``, which takes
    the same arguments and gives the same bits through the fastest path that covers them (a C kernel
    or torch.compile on the CPU, Triton on a GPU): call that one for speed. ``dtype``: the result's
    dtype (default x's; float32 keeps dequantized values that a 16-bit dtype cannot hold, exactly or
    at all: beyond its range they are ±inf, as a cast gives, e.g. an fp16 block holding 65504 under
    MX's ceil, even or rceil mode is 65536). Stochastic rounding draws from ``generator``, or
    ``noise`` gives its draws up front (shape ``noise_shape(x, spec, axis)``; what a compiled model
    passes, see ``qlab.kernels.noise.drawn_noise``). On a non-last axis qdq maps the draws to
    elements in a different order than quantize does (both are valid draws, but not the same ones).
    ``out``: a tensor of x's shape and the result's dtype, not overlapping x, that receives the
    result (returned). ``fast`` is deprecated: the fast paths are ``qlab.kernels.qdq``'s.
    """
    if fast is not None:
        import warnings

        warnings.warn(
            "qlab.quantize.qdq(fast=...) is deprecated: qlab.quantize.qdq is the reference; "
            "qlab.kernels.qdq(..., backend='auto'|'cpu'|'reference') chooses the fast paths",
            DeprecationWarning,
            stacklevel=2,
        )
        checks.boolean("fast", fast)
    checked = check_qdq_arguments(x, spec, axis, generator, noise, scale, dtype, out)
    return qdq_unchecked(x, *checked, out)


# moved to qlab.kernels.compiled with the compiled fast path (qlab.compat)
MOVED = {
    name: "qlab.kernels.compiled" for name in ("COMPILE_OPTIONS", "COMPILE_MIN_NUMEL", "compile_enabled")
}


def __getattr__(name: str):
    return compat.moved(__name__, name, MOVED)


def _check_out(out, x: torch.Tensor, dtype: torch.dtype) -> None:
    checks.tensor("out", out)
    if out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(
            f"out must be a {dtype} tensor of x's shape {tuple(x.shape)} on {x.device}, got a {out.dtype} "
            f"tensor of shape {tuple(out.shape)} on {out.device}"
        )
    if torch._C._overlaps(out, x):
        raise ValueError("out must not share memory with x (qdq reads each block whole before writing it)")


# --- measurements ---------------------------------------------------------------------------------


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σx² / Σ(x − x̂)²) in dB, summed in float64:
    inf if x̂ is exact (no noise, an all-zero x included), −inf if x is all zero and x̂ is not (no
    signal). NaN if either holds NaN or an infinity."""
    checks.tensor("x", x, real=True)
    checks.tensor("x_hat", x_hat, real=True)
    if x.shape != x_hat.shape:
        raise ValueError(
            f"x_hat must have x's shape {tuple(x.shape)}, got {tuple(x_hat.shape)} (no broadcasting)"
        )
    x64, error = x.double(), (x.double() - x_hat.double())
    noise = float((error * error).sum())
    signal = float((x64 * x64).sum())
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    if math.isinf(noise) or math.isinf(signal):  # squares beyond float64: no ratio to give
        return math.nan
    return 10.0 * math.log10(signal / noise)


def clipped_block_fraction(x: torch.Tensor, spec: str | Spec, axis: int = -1) -> float:
    """Fraction of MX/NVFP4 blocks with at least one element beyond the element max after scaling.

    Those elements saturate to the max: one within half a step above it loses no more than rounding
    would, one further out loses more. FLOOR scales can do this, RCEIL cannot. Blocks with NaN/inf are
    left out.
    """
    spec = get_spec(spec)
    if spec.block_size is None:
        raise ValueError(
            f"spec must be a block spec (MXSpec, NVFP4Spec, BlockwiseSpec; clipping is measured per block), "
            f"got {type(spec).__name__}"
        )
    axis = check_input(x, spec, axis)
    layout = to_layout(x, spec, axis)
    parts, _ = spec.quantize_layout(layout)
    clipped = ~spec.inside_range(layout, parts).all(-1)
    finite = torch.isfinite(layout.abs().amax(-1))
    return float((clipped & finite).sum() / finite.sum().clamp(min=1))
