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

Specs (frozen dataclasses, hashable, usable as papermill strings through ``SPECS``):

| spec | elements | scales |
|---|---|---|
| TensorwiseSpec | e4m3/e5m2 (any float format) | FP8 current, per tensor or per slice; or given (delayed) |
| IntSpec | intN/uintN | symmetric amax/qmax, or asymmetric with a zero point |
| MXSpec | e4m3, e5m2, e3m2, e2m3, e2m1 | one E8M0 per 32 elements, mode floor/rceil/ceil/even |
| NVFP4Spec | e2m1 | one E4M3 per 16 (1×16) or per 16×16 tile, FP32 global; optional RHT |

Fast path: for float32/bf16/fp16 inputs of at least ``COMPILE_MIN_NUMEL`` elements and RNE
rounding, ``qdq`` runs the same function through ``torch.compile`` (one fused loop instead of ~10
memory passes), compiled lazily per (spec, dtype, shape) (up to 8 shapes per spec; more run
eagerly) and skipped silently if compilation is unavailable; it is bit-identical to eager (tested).
Set ``QLAB_COMPILE=0`` to turn it off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from qlab import checks, scaling
from qlab.formats import (
    ROUNDING_MODES,
    FloatFormat,
    _cast,
    _decode,
    _encode_float,
    _fast_path_applies,
    get_format,
    pack_fp4,
    round_to_integer,
    stochastic_noise,
)

GRANULARITIES = ("tensor", "axis")


def _check_rounding(rounding):
    checks.choice("rounding", rounding, ROUNDING_MODES)


def _check_granularity(granularity):
    checks.choice("granularity", granularity, GRANULARITIES)


@dataclass(frozen=True)
class TensorwiseSpec:
    """FP8-style scaling: stored = cast(x · scale), scale = fmt_max / amax (TE current scaling)."""

    element: str = "e4m3"
    granularity: str = "tensor"
    pow2: bool = False
    eps: float = 0.0
    rounding: str = "rne"

    def __post_init__(self):
        scaling._float_format(self.element, "element")
        _check_granularity(self.granularity)
        checks.boolean("pow2", self.pow2)
        checks.number("eps", self.eps, low=0)
        _check_rounding(self.rounding)


@dataclass(frozen=True)
class IntSpec:
    """Integer affine quantization (the seed's Quantizer, with clamping and safe zero ranges)."""

    bits: int = 8
    signed: bool = True
    symmetric: bool = True
    granularity: str = "tensor"
    rounding: str = "rne"

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


@dataclass(frozen=True)
class MXSpec:
    """OCP Microscaling: blocks of ``block_size`` along the axis share one E8M0 scale."""

    element: str = "e4m3"
    block_size: int = 32
    mode: str = "floor"
    pad: bool = True
    rounding: str = "rne"

    def __post_init__(self):
        checks.choice("element", self.element, ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"))
        checks.integer("block_size", self.block_size, low=1)
        checks.choice("mode", self.mode, scaling.MX_SCALE_MODES)
        checks.boolean("pad", self.pad)
        _check_rounding(self.rounding)


@dataclass(frozen=True)
class NVFP4Spec:
    """NVFP4: E2M1 elements, E4M3 scales per 16 (or per 16×16 tile), one FP32 global scale."""

    block_2d: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0
    global_scale: bool = True
    pad: bool = True
    rounding: str = "rne"

    element = "e2m1"
    block_size = scaling.NVFP4_BLOCK

    def __post_init__(self):
        for flag in ("block_2d", "hadamard", "global_scale", "pad"):
            checks.boolean(flag, getattr(self, flag))
        checks.seed("hadamard_seed", self.hadamard_seed)
        _check_rounding(self.rounding)


Spec = TensorwiseSpec | IntSpec | MXSpec | NVFP4Spec

SPECS: dict[str, Spec] = {
    "fp8_e4m3": TensorwiseSpec("e4m3"),
    "fp8_e5m2": TensorwiseSpec("e5m2"),
    "fp8_e4m3_pow2": TensorwiseSpec("e4m3", pow2=True),
    "fp8_e4m3_rowwise": TensorwiseSpec("e4m3", granularity="axis"),
    "int8": IntSpec(8),
    "int8_rowwise": IntSpec(8, granularity="axis"),
    "int4_rowwise": IntSpec(4, granularity="axis"),
    "uint8_asymmetric": IntSpec(8, signed=False, symmetric=False),
    "mxfp8": MXSpec("e4m3"),
    "mxfp8_rceil": MXSpec("e4m3", mode="rceil"),
    "mxfp8_e5m2": MXSpec("e5m2"),
    "mxfp6_e3m2": MXSpec("e3m2"),
    "mxfp6_e2m3": MXSpec("e2m3"),
    "mxfp4": MXSpec("e2m1"),
    "mxfp4_rceil": MXSpec("e2m1", mode="rceil"),
    "nvfp4": NVFP4Spec(),
    "nvfp4_2d": NVFP4Spec(block_2d=True),
    "nvfp4_rht": NVFP4Spec(hadamard=True),
}


def get_spec(spec: str | Spec) -> Spec:
    """A spec object, or one of the named presets in ``SPECS``."""
    if isinstance(spec, (TensorwiseSpec, IntSpec, MXSpec, NVFP4Spec)):
        return spec
    if isinstance(spec, str) and spec in SPECS:
        return SPECS[spec]
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a spec object or a preset name from SPECS, got {checks.shown(spec)}")
    raise ValueError(
        f"unknown quantization spec {spec!r}; expected a spec object or one of: {', '.join(SPECS)}"
    )


@dataclass
class QTensor:
    """A quantized tensor in the blocked layout (``axis`` moved last, padded to whole blocks).

    codes: integer codes of the elements (uint8 for float elements, int for integer elements).
    scales: float32 scales. TensorwiseSpec: TE's multiplier, stored = cast(x · scale), dequantize
      divides by it. IntSpec: the step, q = round(x / scale), dequantize multiplies. MXSpec and
      NVFP4Spec: the block value X that dequantize multiplies by.
    scale_codes: E8M0 bytes (MX) or E4M3 codes (NVFP4).
    zero_point (asymmetric IntSpec) and global_scale (NVFP4) where they apply.
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

    def packed_codes(self) -> torch.Tensor:
        """Element codes with two 4-bit codes per byte (e2m1 elements only)."""
        if self.spec.element != "e2m1":
            raise ValueError(f"packing two codes per byte needs 4-bit e2m1 elements, not {self.spec.element}")
        return pack_fp4(self.codes)


# --- layout ---------------------------------------------------------------------------------------


def _check_input(x, spec, axis):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        found = x.dtype if isinstance(x, torch.Tensor) else checks.shown(x)
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {found}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    checks.integer("axis", axis)
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d x, got {axis!r}")
    if isinstance(spec, NVFP4Spec) and spec.block_2d and x.dim() < 2:
        raise ValueError("x must have at least 2 dimensions for 2D 16x16 NVFP4 blocks")
    element = get_format(spec.element)
    if torch.compiler.is_compiling():  # the value checks below read data on the host: eager only
        return axis % x.dim()
    if isinstance(spec, IntSpec) and not torch.isfinite(x).all():
        raise ValueError(f"{element.name} has no inf or NaN encoding, but x holds inf or NaN")
    if not element.has_nan and torch.isnan(x).any() and not isinstance(spec, (MXSpec, NVFP4Spec)):
        raise ValueError(f"{element.name} has no NaN encoding, but x holds NaN")
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


def _moves_axis(spec) -> bool:
    """Per-tensor scales do not care about the axis, so their layout is x itself (no transpose copy)."""
    return isinstance(spec, (MXSpec, NVFP4Spec)) or spec.granularity == "axis"


def _to_layout(x: torch.Tensor, spec, axis: int) -> torch.Tensor:
    """float32, axis last; for block specs padded and shaped (..., n_blocks, block)."""
    if not _moves_axis(spec):
        return x.float()
    moved = x.float().movedim(axis, -1)
    if isinstance(spec, (MXSpec, NVFP4Spec)):
        moved = _pad_to(moved, -1, spec.block_size, spec.pad)
        if isinstance(spec, NVFP4Spec) and spec.block_2d:
            moved = _pad_to(moved, -2, scaling.NVFP4_BLOCK, spec.pad)
        if isinstance(spec, NVFP4Spec) and spec.hadamard:
            moved = scaling.hadamard_transform(moved, spec.hadamard_seed)
        return moved.reshape(*moved.shape[:-1], -1, spec.block_size)
    return moved.contiguous()


def _from_layout(
    values: torch.Tensor, spec, axis: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    if not _moves_axis(spec):
        return values.to(dtype)
    moved_shape = list(shape)
    moved_shape.append(moved_shape.pop(axis))
    if isinstance(spec, (MXSpec, NVFP4Spec)):
        values = values.flatten(-2)
        if isinstance(spec, NVFP4Spec) and spec.hadamard:
            values = scaling.hadamard_transform(values, spec.hadamard_seed, inverse=True)
        values = values[..., : moved_shape[-1]]
        if isinstance(spec, NVFP4Spec) and spec.block_2d:
            values = values[..., : moved_shape[-2], :]
    return values.reshape(moved_shape).movedim(-1, axis).to(dtype)


# --- the recipes, each on the layout tensor -----------------------------------------------------------

# Each recipe takes the layout tensor and ``dim``, the axis its scales are shared along: −1 in the
# blocked layout (…, n_blocks, block) that quantize() stores, −2 in qdq's in-place layout
# (outer, n_blocks, block, inner) that avoids transposing x (see _inplace_layout).


def _amax(x: torch.Tensor, spec, dim: int) -> torch.Tensor:
    if spec.granularity == "tensor":
        return x.abs().amax()
    return x.abs().amax(dim, keepdim=True)


def _tensorwise(x, spec: TensorwiseSpec, generator, scale, dim=-1):
    if scale is None:
        scale = scaling.fp8_current_scale(_amax(x, spec, dim), spec.element, eps=spec.eps, pow2=spec.pow2)
    values = _cast(x * scale, get_format(spec.element), spec.rounding, True, generator)
    return {"values": values, "scales": scale}, values / scale


def _int(x, spec: IntSpec, generator, scale, dim=-1):
    fmt = get_format(spec.element)
    if spec.symmetric:
        scale = scaling.int_symmetric_scale(_amax(x, spec, dim), fmt.max) if scale is None else scale
        values = (
            _cast(x / scale, fmt, spec.rounding, True, generator) + 0.0
        )  # -0 → +0: integer codes have no -0
        return {"values": values, "scales": scale}, values * scale
    if scale is not None:
        raise ValueError("a fixed scale is only supported for symmetric IntSpec")
    if spec.granularity == "tensor":
        lo, hi = x.amin(), x.amax()
    else:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale, zero_point = scaling.int_affine_parameters(lo, hi, fmt.min, fmt.max)
    values = (
        _cast(round_to_integer(x / scale, spec.rounding, generator) + zero_point, fmt) + 0.0
    )  # clamp; -0 → +0
    return {"values": values, "scales": scale, "zero_point": zero_point}, (values - zero_point) * scale


def _mx(x, spec: MXSpec, generator, scale, dim=-1):
    fmt = get_format(spec.element)
    codes = scaling.mx_scale_codes(x.abs().amax(dim, keepdim=True), fmt, spec.mode)
    inverse = scaling._mx_scale_values(codes, inverse=True)
    scaled = torch.where(torch.isnan(inverse), 0.0, x * inverse)  # a NaN/inf block: codes 0, scale NaN
    values = _cast(scaled, fmt, spec.rounding, True, generator)
    scales = scaling._mx_scale_values(codes)
    return {
        "values": values,
        "scales": scales.squeeze(dim),
        "scale_codes": codes.squeeze(dim),
    }, values * scales


def _nvfp4(x, spec: NVFP4Spec, generator, scale, dim=-1):
    fmt = get_format("e2m1")
    magnitude = x.abs()
    global_scale = scaling.nvfp4_global_scale(magnitude.amax()) if spec.global_scale else None
    if spec.block_2d:  # (..., R, C/16, 16) → tiles (..., R/16, 16, C/16, 16); always the blocked layout
        tiles = magnitude.reshape(*x.shape[:-3], x.shape[-3] // 16, 16, x.shape[-2], 16)
        scales = scaling.nvfp4_block_scales(tiles.amax(dim=(-3, -1)), global_scale)
        block_scales = scales.repeat_interleave(16, dim=-2)[..., None]
    else:
        block_scales = scaling.nvfp4_block_scales(magnitude.amax(dim, keepdim=True), global_scale)
        scales = block_scales.squeeze(dim)
    scaled = torch.clamp(
        _nvfp4_scaled(x, global_scale, block_scales), -scaling.NVFP4_ELEMENT_MAX, scaling.NVFP4_ELEMENT_MAX
    )
    scaled = torch.where(torch.isnan(scaled), 0.0, scaled)  # only in NaN/inf blocks, whose scale is NaN
    values = _cast(scaled, fmt, spec.rounding, True, generator)
    full = block_scales if global_scale is None else global_scale * block_scales
    parts = {"values": values, "scales": scales, "global_scale": global_scale}
    return parts, values * full


def _nvfp4_scaled(x, global_scale, block_scales):
    """x / (global · block) in float32, as torchao orders it: x · (fl(1/global) / block). For a tiny
    tensor that inverse overflows (1/global alone beyond float32 below amax ≈ 7.9·10⁻³⁶, or divided by a
    small block scale below amax ≈ 5·10⁻³⁴), which coded every non-zero element ±6; there x is divided
    by the global and then the block scale instead (each quotient finite: |x| / global ≤ 2688)."""
    if global_scale is None:
        return x * (1.0 / block_scales)
    inverse = (1.0 / global_scale) / block_scales
    return torch.where(torch.isinf(inverse), (x / global_scale) / block_scales, x * inverse)


_RECIPES = {TensorwiseSpec: _tensorwise, IntSpec: _int, MXSpec: _mx, NVFP4Spec: _nvfp4}


def _check_scale(scale, spec):
    if scale is None:
        return None
    if isinstance(spec, (MXSpec, NVFP4Spec)):
        raise ValueError("a fixed scale is only supported for TensorwiseSpec and IntSpec (delayed scaling)")
    if isinstance(scale, torch.Tensor):
        if scale.is_complex() or scale.dtype == torch.bool:
            raise TypeError(f"scale must be a real tensor or number, got dtype {scale.dtype}")
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
    axis = _check_input(x, spec, axis)
    generator = _randomness(x, spec, axis, generator, noise, blocked=True)
    if x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor, got shape {tuple(x.shape)}")
    scale = _check_scale(scale, spec)
    checks.boolean("keep_source", keep_source)
    layout = _to_layout(x, spec, axis)
    parts, _ = _RECIPES[type(spec)](layout, spec, generator, scale)
    values = parts.pop("values")
    fmt = get_format(spec.element)
    codes = _encode_float(values, fmt) if isinstance(fmt, FloatFormat) else values.to(fmt.code_dtype)
    scale_codes = parts.pop("scale_codes", None)
    if isinstance(spec, NVFP4Spec):
        scale_codes = _encode_float(parts["scales"], get_format("e4m3"))
    return QTensor(
        codes=codes,
        scales=parts.pop("scales"),
        spec=spec,
        axis=axis,
        shape=x.shape,
        dtype=x.dtype,
        scale_codes=scale_codes,
        source=x if keep_source else None,
        fixed_scale=scale,
        **parts,
    )


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values q represents, in ``dtype`` (default: the source's dtype) and the source's shape."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor (from quantize), got {checks.shown(q)}")
    checks.floating_dtype("dtype", dtype)
    spec = q.spec
    values = _decode(q.codes, get_format(spec.element))
    if isinstance(spec, TensorwiseSpec):
        out = values / q.scales
    elif isinstance(spec, IntSpec):
        out = values * q.scales if spec.symmetric else (values - q.zero_point) * q.scales
    elif isinstance(spec, MXSpec):
        out = values * q.scales[..., None]
    else:
        out = values * _nvfp4_element_scales(spec, q.scales, q.global_scale)[..., None]
    return _from_layout(out, spec, q.axis, q.shape, dtype or q.dtype)


def _nvfp4_element_scales(
    spec: NVFP4Spec, scales: torch.Tensor, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """The per-block multiplier global·block (…, n_blocks) from stored NVFP4 scales (16×16 tiles expanded)."""
    block_scales = scales.repeat_interleave(16, dim=-2) if spec.block_2d else scales
    return block_scales if global_scale is None else global_scale * block_scales


def _qdq_layout(layout: torch.Tensor, spec: Spec, generator=None, scale=None, dim: int = -1) -> torch.Tensor:
    return _RECIPES[type(spec)](layout, spec, generator, scale, dim)[1]


def _inplace_applies(x: torch.Tensor, spec: Spec, axis: int) -> bool:
    """qdq can block ``axis`` where it lies (no transpose) for 1-D blocks and per-slice scales."""
    if axis == x.dim() - 1 or not _moves_axis(spec):
        return False
    return not (isinstance(spec, NVFP4Spec) and spec.block_2d)


def _inplace_layout(x: torch.Tensor, spec: Spec, axis: int) -> torch.Tensor:
    """x as (outer, n_blocks, block, inner) float32 with blocks along ``axis`` (scale dim −2), zero-padded."""
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    view = x.float().reshape(outer, x.shape[axis], inner)
    if isinstance(spec, (MXSpec, NVFP4Spec)):
        view = _pad_to(view, 1, spec.block_size, spec.pad)
        if isinstance(spec, NVFP4Spec) and spec.hadamard:
            view = scaling.hadamard_transform(view, spec.hadamard_seed, dim=1)
        return view.reshape(outer, -1, spec.block_size, inner)
    return view.reshape(outer, 1, x.shape[axis], inner)


def _from_inplace_layout(
    values: torch.Tensor, spec: Spec, axis: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    outer, inner = values.shape[0], values.shape[-1]
    values = values.reshape(outer, -1, inner)
    if isinstance(spec, NVFP4Spec) and spec.hadamard:
        values = scaling.hadamard_transform(values, spec.hadamard_seed, inverse=True, dim=1)
    return values[:, : shape[axis], :].reshape(shape).to(dtype)


def _qdq_any_layout(x: torch.Tensor, spec: Spec, axis: int, generator, scale, dtype) -> torch.Tensor:
    """qdq in the in-place layout where it applies, else in the blocked layout; same bits either way."""
    if _inplace_applies(x, spec, axis):
        out = _qdq_layout(_inplace_layout(x, spec, axis), spec, generator, scale, dim=-2)
        return _from_inplace_layout(out, spec, axis, x.shape, dtype)
    return _from_layout(
        _qdq_layout(_to_layout(x, spec, axis), spec, generator, scale), spec, axis, x.shape, dtype
    )


def noise_shape(x: torch.Tensor, spec: str | Spec, axis: int = -1, *, blocked: bool = False) -> torch.Size:
    """The shape of the uniform draws (``qlab.formats.stochastic_noise``) that stochastic rounding of
    ``x`` by ``spec`` along ``axis`` consumes: one per element of qdq's layout (``blocked=False``) or
    of quantize's blocked layout (``blocked=True``; the two differ for a non-last axis)."""
    spec = get_spec(spec)
    axis = axis % x.dim()
    meta = torch.empty(x.shape, device="meta")
    if not blocked and _inplace_applies(x, spec, axis):
        return _inplace_layout(meta, spec, axis).shape
    return _to_layout(meta, spec, axis).shape


def _inside_range(layout: torch.Tensor, spec: Spec, parts: dict) -> torch.Tensor:
    """True where an element was not clipped: its scaled value lies within the element format's range.

    Float elements compare the scaled value before rounding (|x·s| ≤ max); integer elements follow
    torch's FakeQuantize and compare the rounded value (qmin ≤ round(x/s) + zero_point ≤ qmax).
    """
    fmt = get_format(spec.element)
    if isinstance(spec, TensorwiseSpec):
        return (layout * parts["scales"]).abs() <= fmt.max
    if isinstance(spec, IntSpec):
        rounded = torch.round(layout / parts["scales"]) + parts.get("zero_point", 0.0)
        return (rounded >= fmt.min) & (rounded <= fmt.max)
    if isinstance(spec, MXSpec):
        return layout.abs() / parts["scales"][..., None] <= fmt.max
    block_scales = parts["scales"].repeat_interleave(16, dim=-2) if spec.block_2d else parts["scales"]
    scaled = _nvfp4_scaled(layout.abs(), parts["global_scale"], block_scales[..., None])
    return scaled <= scaling.NVFP4_ELEMENT_MAX


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
    if isinstance(spec, NVFP4Spec) and spec.hadamard:
        raise ValueError(
            "a clipping mask is not defined for hadamard=True specs (clipping happens after rotation)"
        )
    axis = _check_input(x, spec, axis)
    _check_generator(spec, generator)
    layout = _to_layout(x, spec, axis)
    parts, out = _RECIPES[type(spec)](layout, spec, generator, _check_scale(scale, spec))
    inside = _inside_range(layout, spec, parts)
    return (
        _from_layout(out, spec, axis, x.shape, x.dtype),
        _from_layout(inside.to(torch.uint8), spec, axis, x.shape, torch.uint8).bool(),
    )


COMPILE_MIN_NUMEL = 1 << 20
_compiled: dict = {}
_compile_failed: set = set()


def compile_enabled() -> bool:
    """Whether qlab may use torch.compile for its fast paths (QLAB_COMPILE=0 turns them off)."""
    return os.environ.get("QLAB_COMPILE", "1") != "0"


def _fast_qdq(spec: Spec, axis: int, dtype: torch.dtype):
    """The compiled qdq function for (spec, axis) (None if compilation is off or failed before).

    Layout changes (transpose to the blocked axis, padding, Hadamard) are compiled too, so inductor
    reads x in place instead of copying it first.
    """
    key = (spec, axis, dtype)
    if key in _compile_failed or not compile_enabled():
        return None
    if key not in _compiled:
        if isinstance(spec, NVFP4Spec) and spec.hadamard:
            scaling._cached_hadamard(
                scaling.NVFP4_BLOCK, spec.hadamard_seed
            )  # fill the cache outside tracing

        def qdq_full(x, scale, noise):
            return _qdq_any_layout(x, spec, axis, noise, scale, dtype)

        # dynamo counts its recompile limit (8 shapes) per code object: give every (spec, axis) its own
        qdq_full.__code__ = qdq_full.__code__.replace(co_name=f"qdq_{len(_compiled)}")
        _compiled[key] = torch.compile(qdq_full, dynamic=False, fullgraph=True)
    return _compiled[key]


def draws_float32_noise(spec: Spec) -> bool:
    """Whether stochastic rounding by ``spec`` consumes ``stochastic_noise`` draws (which can be drawn
    up front), rather than float64 ``torch.rand`` (the reference cast, asymmetric integers)."""
    fast_stochastic = _fast_path_applies(torch.empty(0), get_format(spec.element), "stochastic")
    return fast_stochastic and not (isinstance(spec, IntSpec) and not spec.symmetric)


def _compilable(spec: Spec) -> bool:
    """RNE always; stochastic rounding when its float32 noise can be drawn up front (eagerly)."""
    return spec.rounding == "rne" or (spec.rounding == "stochastic" and draws_float32_noise(spec))


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
) -> torch.Tensor:
    """dequantize(quantize(x, spec, axis), dtype) without materializing codes: same bits and shape.

    ``dtype``: the result's dtype (default x's; float32 keeps dequantized values that a 16-bit
    dtype cannot hold exactly). ``fast``: None picks the compiled path for large inputs, True
    forces it, False forces eager. Stochastic rounding draws its noise eagerly from ``generator``
    in both paths, so the compiled path consumes the same random numbers and gives the same bits;
    ``noise`` instead gives those draws up front (shape ``noise_shape(x, spec, axis)``; what a
    compiled model passes, see ``qlab.formats.drawn_noise``). On a non-last axis qdq maps the draws
    to elements in a different order than quantize does (both are valid draws, but not the same ones).
    Inside ``torch.compile`` qdq traces into the caller's graph (no nested compile, no host reads).
    """
    spec = get_spec(spec)
    axis = _check_input(x, spec, axis)
    randomness = _randomness(x, spec, axis, generator, noise, blocked=False)
    scale = _check_scale(scale, spec)
    dtype = checks.floating_dtype("dtype", dtype) or x.dtype
    if fast is not None:
        checks.boolean("fast", fast)
    if x.numel() == 0:
        return x.to(dtype).clone()
    if torch.compiler.is_compiling():
        return _qdq_any_layout(x, spec, axis, randomness, scale, dtype)
    use_fast = fast if fast is not None else (x.numel() >= COMPILE_MIN_NUMEL and x.device.type == "cpu")
    if use_fast and _compilable(spec):
        compiled = _fast_qdq(spec, axis, dtype)
        if compiled is not None:
            noise = randomness if isinstance(randomness, torch.Tensor) else None
            if spec.rounding == "stochastic" and noise is None:
                noise = stochastic_noise(noise_shape(x, spec, axis), generator, x.device)
            try:
                return compiled(x, scale, noise)
            except Exception:  # no compiler, unsupported op, ...: eager gives the same bits
                _compile_failed.add((spec, axis, dtype))
                if noise is not None:  # the draws are spent: use them, so the stream stays the same
                    randomness = noise
    return _qdq_any_layout(x, spec, axis, randomness, scale, dtype)


# --- measurements ---------------------------------------------------------------------------------


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σx² / Σ(x − x̂)²) in dB, summed in float64
    (inf if exact)."""
    checks.tensor("x", x, real=True)
    checks.tensor("x_hat", x_hat, real=True)
    if x.shape != x_hat.shape:
        raise ValueError(
            f"x_hat must have x's shape {tuple(x.shape)}, got {tuple(x_hat.shape)} (no broadcasting)"
        )
    x64, error = x.double(), (x.double() - x_hat.double())
    noise = float((error * error).sum())
    signal = float((x64 * x64).sum())
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise)


def clipped_block_fraction(x: torch.Tensor, spec: str | Spec, axis: int = -1) -> float:
    """Fraction of MX/NVFP4 blocks with at least one element beyond the element max after scaling.

    Those elements saturate (lose more than rounding); FLOOR scales can do this, RCEIL cannot.
    Blocks with NaN/inf are left out.
    """
    spec = get_spec(spec)
    if not isinstance(spec, (MXSpec, NVFP4Spec)):
        raise ValueError(
            f"spec must be an MXSpec or NVFP4Spec (clipping is measured per block), got {type(spec).__name__}"
        )
    axis = _check_input(x, spec, axis)
    layout = _to_layout(x, spec, axis)
    parts, _ = _RECIPES[type(spec)](layout, spec, None, None)
    clipped = ~_inside_range(layout, spec, parts).all(-1)
    finite = torch.isfinite(layout.abs().amax(-1))
    return float((clipped & finite).sum() / finite.sum().clamp(min=1))
