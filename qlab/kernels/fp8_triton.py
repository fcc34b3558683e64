"""Triton kernels: FP8 current and delayed scaling (TransformerEngine semantics), bit-exact with
``qlab.quantize.quantize`` (element codes + scales) and ``qdq(x, TensorwiseSpec(...))``.

Per tensor, two launches and no host synchronisation: ``_amax_kernel`` max-reduces |x| into one
device float (atomic max; a separate NaN flag, since GPU max reductions may drop NaN), then
``_scale_cast_kernel`` reads it, computes scale = fmt_max / max(amax, eps) (correctly rounded
division; 0/inf/NaN amax → 1; overflow → float32 max; optional power-of-two floor) and writes
cast(x · scale) · fl(1/scale) (qdq; / scale in torchao's convention) or the codes of cast(x · scale)
(quantize; for E4M3/E5M2 the bytes of torch.float8_e4m3fn / float8_e5m2). Per row (granularity
"axis", the last axis; also FP8 blockwise 1×128 tiles, each tile a row): the same kernel with PER_ROW,
one program per row, two passes over the row's chunks. A scale fixed in advance (delayed scaling,
``fp8_fixed_scale``): the same kernel with GIVEN_SCALE, one launch, each program loading the scale
from the device instead of computing it; the cast is the one above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qlab.kernels.triton_math import Tuned, encode_constants, encode_float, round_to_grid


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, nan_ptr, n, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    # Each program reduces CHUNKS consecutive chunks before its one atomic max: thousands of programs
    # contending for one address, not hundreds of thousands.
    start = tl.program_id(0).to(tl.int64) * (CHUNK * CHUNKS)
    amax = tl.zeros((CHUNK,), tl.float32)
    has_nan = tl.zeros((CHUNK,), tl.int32)
    for chunk in range(CHUNKS):
        offsets = start + chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
        has_nan = tl.maximum(has_nan, (x != x).to(tl.int32))
    tl.atomic_max(amax_ptr, tl.max(amax, axis=0))
    tl.atomic_max(nan_ptr, tl.max(has_nan, axis=0))


# (CHUNK, CHUNKS, num_warps) per config; the first is the one the CPU interpreter runs.
_AMAX_TILES = ((1024, 1, 4), (1024, 8, 4), (2048, 8, 8), (4096, 4, 8), (2048, 32, 8))
_amax_tuned = Tuned(_amax_kernel, ("CHUNK", "CHUNKS", "num_warps"), *_AMAX_TILES, key=["n"])


def tensor_amax(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x| as a float32 tensor of shape (1,), a NaN flag as int32 (1,)) of a contiguous tensor, on
    its device and without a host synchronisation (the maximum ignores NaN; the flag records it)."""
    amax = torch.zeros(1, dtype=torch.float32, device=flat.device)
    has_nan = torch.zeros(1, dtype=torch.int32, device=flat.device)
    n = flat.numel()
    _amax_tuned[lambda meta: (triton.cdiv(n, meta["CHUNK"] * meta["CHUNKS"]),)](flat, amax, has_nan, n)
    return amax, has_nan


@triton.jit
def _current_scale(amax, has_nan, FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    floored = tl.maximum(amax, EPS)
    scale = tl.math.div_rn(tl.full(floored.shape, FMT_MAX, tl.float32), floored)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    usable = (has_nan == 0) & (amax != float("inf")) & (floored > 0)
    scale = tl.where(usable, scale, 1.0)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _scale_cast_kernel(
    x_ptr,
    out_ptr,
    amax_ptr,
    nan_ptr,
    scale_ptr,
    n,
    FMT_MAX: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_BIASED: tl.constexpr,
    BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    INV_MIN_SUBNORMAL: tl.constexpr,
    NAN_CODE: tl.constexpr,
    EMIT_CODES: tl.constexpr,
    NVIDIA: tl.constexpr,
    PER_ROW: tl.constexpr,
    GIVEN_SCALE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Per tensor: one program per CHUNK of the n elements, scaled by the amax and NaN flag at amax_ptr
    and nan_ptr; program 0 stores the scale. GIVEN_SCALE (per tensor only): each program loads the
    scale at scale_ptr instead, and nothing is stored there. PER_ROW: one program per row of n
    elements, which first reduces the row's amax, then casts it chunk by chunk; each row stores its
    scale."""
    program = tl.program_id(0)
    if PER_ROW:
        start = program.to(tl.int64) * n
        end = start + n
        amax = tl.zeros((), tl.float32)
        has_nan = tl.zeros((), tl.int32)
        for chunk in range(start, end, CHUNK):
            offsets = chunk + tl.arange(0, CHUNK)
            x = tl.load(x_ptr + offsets, mask=offsets < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            has_nan = tl.maximum(has_nan, tl.max((x != x).to(tl.int32), axis=0))
        scale = _current_scale(amax, has_nan, FMT_MAX, EPS, POW2)
    else:
        start = program.to(tl.int64) * CHUNK
        end = tl.minimum(start + CHUNK, n)
        if GIVEN_SCALE:
            scale = tl.load(scale_ptr)
        else:
            scale = _current_scale(tl.load(amax_ptr), tl.load(nan_ptr), FMT_MAX, EPS, POW2)
    for chunk in range(start, end, CHUNK):
        offsets = chunk + tl.arange(0, CHUNK)
        inside = offsets < end
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        values = round_to_grid(x * scale, FMT_MAX, MANTISSA, MIN_BIASED)
        values = tl.where(x != x, x, values)  # NaN stays NaN
        if EMIT_CODES:
            out = encode_float(values, BITS, MANTISSA, BIAS, MIN_NORMAL, INV_MIN_SUBNORMAL, NAN_CODE)
        elif NVIDIA:  # TE and cuBLAS multiply by scale_inv = fl(1/scale)
            out = (values * tl.math.div_rn(1.0, scale)).to(out_ptr.dtype.element_ty)
        else:  # torchao divides
            out = tl.math.div_rn(values, scale).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, out, mask=inside)
    if PER_ROW:
        tl.store(scale_ptr + program, scale)
    elif not GIVEN_SCALE:
        tl.store(scale_ptr, scale, mask=program == 0)


# The chunk each program handles (per tensor) or steps by along its row (per row); the first config is
# the one the CPU interpreter runs.
_scale_cast_tuned = Tuned(
    _scale_cast_kernel, ("CHUNK", "num_warps"), (1024, 4), (2048, 4), (4096, 8), (8192, 8), key=["n"]
)
_row_tuned = Tuned(
    _scale_cast_kernel, ("CHUNK", "num_warps"), (1024, 4), (2048, 4), (4096, 8), (8192, 16), key=["n"]
)


def _constants(element, *, eps: float, pow2: bool, emit_codes: bool, convention: str) -> dict:
    """The constexprs of ``_scale_cast_kernel`` that do not depend on where the scale comes from."""
    return dict(
        FMT_MAX=float(element.max),
        EPS=float(eps),
        POW2=bool(pow2),
        MIN_BIASED=128 - element.bias,
        EMIT_CODES=emit_codes,
        NVIDIA=convention == "nvidia",
        **encode_constants(element),
    )


def _output(flat: torch.Tensor, emit_codes: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    return torch.empty(
        flat.shape, dtype=torch.uint8 if emit_codes else out_dtype or flat.dtype, device=flat.device
    )


def fp8_current_scaling(
    x: torch.Tensor,
    element,
    *,
    per_row: bool,
    eps: float,
    pow2: bool,
    emit_codes: bool = False,
    out_dtype: torch.dtype | None = None,
    convention: str = "nvidia",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdq values in ``out_dtype`` (default x's), or uint8 codes, in x's shape; float32 scales: shape ()
    per tensor or (..., 1) per row). ``convention``: dequantize by values · fl(1/scale) ("nvidia") or
    values / scale ("torchao")."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = _output(flat, emit_codes, out_dtype)
    constants = _constants(element, eps=eps, pow2=pow2, emit_codes=emit_codes, convention=convention)
    if per_row:  # no tensor amax: each row reduces its own
        scales = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
        _row_tuned[(flat.shape[0],)](
            flat, out, None, None, scales, flat.shape[1], PER_ROW=True, GIVEN_SCALE=False, **constants
        )
        return out.reshape(x.shape), scales.reshape(*x.shape[:-1], 1)
    amax, has_nan = tensor_amax(flat)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n = flat.numel()
    _scale_cast_tuned[lambda meta: (triton.cdiv(n, meta["CHUNK"]),)](
        flat, out, amax, has_nan, scale, n, PER_ROW=False, GIVEN_SCALE=False, **constants
    )
    return out.reshape(x.shape), scale.reshape(())


def fp8_fixed_scale(
    x: torch.Tensor,
    element,
    scale: torch.Tensor,
    *,
    emit_codes: bool = False,
    out_dtype: torch.dtype | None = None,
    convention: str = "nvidia",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaling by a scale fixed in advance (delayed scaling): (qdq values in ``out_dtype``
    (default x's), or uint8 codes, in x's shape; ``scale`` as shape ()). ``scale``: a float32 tensor
    holding one value, on x's device; read on the device only (no host synchronisation, no amax
    pass), and assumed finite and positive: its value is not checked. The cast is the current-scaling
    kernel's, cast(x · scale), dequantized as ``convention`` says."""
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(
            f"scale must be a float32 tensor holding one value on x's device ({x.device}), got a "
            f"{scale.dtype} tensor of shape {tuple(scale.shape)} on {scale.device}"
        )
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = _output(flat, emit_codes, out_dtype)
    constants = _constants(element, eps=0.0, pow2=False, emit_codes=emit_codes, convention=convention)
    n = flat.numel()
    _scale_cast_tuned[lambda meta: (triton.cdiv(n, meta["CHUNK"]),)](
        flat, out, None, None, scale, n, PER_ROW=False, GIVEN_SCALE=True, **constants
    )
    return out.reshape(x.shape), scale.reshape(())
