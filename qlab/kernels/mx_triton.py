"""Triton kernel: MX block quantize (element codes + E8M0 bytes) or quantize-dequantize along the
last axis (OCP MX v1.0), bit-exact with ``qlab.quantize.quantize`` / ``qdq(x, MXSpec(...))``.

One program per tile of ROWS rows × GROUPS blocks of 32 (BLOCK) elements (the tile autotuned per
shape on a GPU): amax of each row's block →
E8M0 byte by qlab.scaling.mx_scale_codes's modes (FLOOR: floor(log2 amax) − emax; CEIL; EVEN;
RCEIL: ceil(log2(amax / elem_max))), all from the float32 bits, clamped to [−127, 127]; 0xFF for a
NaN/inf block) → x · 2^-e → saturating round-to-nearest-
even onto the element grid by the add-and-subtract trick (C = 2^(e_x + 23 − m) has the grid's
quantum as its float32 ulp) → values · 2^e (qdq), or → the elements' codes (quantize). FP8 codes come
from the GPU's own conversion to float8 (FP8_CAST; exact, since the values are already on the grid and
finite), FP4/FP6 codes from their bits (``encode_float``). A partial last block is masked (as if
zero-padded; its padding gets code 0, as quantize's zero padding does).
Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (slow: small shapes only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qlab.kernels.triton_math import (
    Tuned,
    encode_constants,
    encode_float,
    load_block_tile,
    pow2_from_exponent,
    round_to_grid,
)

BLOCK = 32


@triton.jit
def _mx_kernel(
    x_ptr,
    out_ptr,
    codes_ptr,
    scale_values_ptr,
    n_rows,
    n_cols,
    n_blocks,
    ELEM_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_BIASED: tl.constexpr,
    MODE: tl.constexpr,
    EMIT_CODES: tl.constexpr,
    FP8_CAST: tl.constexpr,
    BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    INV_MIN_SUBNORMAL: tl.constexpr,
    NAN_CODE: tl.constexpr,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, blocks, cols, offsets, inside, x = load_block_tile(x_ptr, n_rows, n_cols, ROWS, GROUPS, BLOCK)

    amax = tl.max(tl.abs(x), axis=2)
    has_nan = tl.max((x != x).to(tl.int32), axis=2) > 0  # GPU max reductions may drop NaN: flag it apart
    finite = (amax != float("inf")) & (has_nan == 0)
    if MODE == "rceil":
        descale = amax / ELEM_MAX
        bits = descale.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.where(
            descale < 1.1754943508222875e-38,  # float32-subnormal descale
            tl.where(descale > 5.877471754111438e-39, -126, -127),
            exponent,
        )
    else:
        bits = amax.to(tl.int32, bitcast=True)
        if MODE == "even":  # the mantissa rounded to the element's width (half up) before the floor
            bits = (bits + (1 << (22 - MANTISSA))) & 0x7F800000
        exponent = ((bits >> 23) & 0xFF) - 127 - EMAX
        if MODE == "ceil":
            exponent += ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, -127), 127)
    code = tl.where(finite, exponent + 127, 255)  # (ROWS, GROUPS)

    inverse = pow2_from_exponent(127 - code)  # 2^-e
    scale = pow2_from_exponent(code - 127)  # 2^e
    scaled = tl.where(finite[:, :, None], x * inverse[:, :, None], 0.0)
    values = round_to_grid(scaled, ELEM_MAX, MANTISSA, MIN_BIASED)
    block_inside = (rows[:, None] < n_rows) & (blocks[None, :] < n_blocks)
    if EMIT_CODES:  # out is (n_rows, n_blocks · BLOCK) uint8: the padding of a partial block included
        if FP8_CAST == "e4m3":  # one conversion instruction per pair, where encode_float takes ~15 operations
            element_codes = values.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        elif FP8_CAST == "e5m2":
            element_codes = values.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            constants = (BITS, MANTISSA, BIAS, MIN_NORMAL, INV_MIN_SUBNORMAL, NAN_CODE)
            element_codes = encode_float(values, *constants)
        tl.store(
            out_ptr + rows[:, None, None].to(tl.int64) * (n_blocks * BLOCK) + cols[None, :, :],
            element_codes,
            mask=block_inside[:, :, None],
        )
    else:
        values = tl.where(finite[:, :, None], values * scale[:, :, None], float("nan"))
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=inside)
    scale_offsets = rows[:, None].to(tl.int64) * n_blocks + blocks[None, :]
    tl.store(codes_ptr + scale_offsets, code.to(tl.uint8), mask=block_inside)
    if EMIT_CODES:  # the QTensor's float32 scales too: E8M0's value, NaN for byte 0xFF
        tl.store(scale_values_ptr + scale_offsets, tl.where(finite, scale, float("nan")), mask=block_inside)


# Tiles of ROWS rows × GROUPS blocks; the first is the one the CPU interpreter runs.
_mx_tuned = Tuned(
    _mx_kernel,
    ("ROWS", "GROUPS", "num_warps"),
    (16, 2, 4),
    (16, 4, 4),
    (32, 4, 8),
    (8, 8, 4),
    (16, 8, 8),
    (64, 2, 8),
    (16, 1, 4),
    key=["n_rows", "n_cols"],
)


def fp8_cast(element, device: torch.device) -> str:
    """The float8 type whose conversion writes ``element``'s codes ("e4m3", "e5m2"), or "" where the
    kernel computes the codes from the bits: FP4/FP6 elements, and GPUs without FP8 conversions (compute
    capability below 8.9). The CPU interpreter converts as the GPU does (tests/test_kernels.py)."""
    if element.name not in ("e4m3", "e5m2"):
        return ""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return ""
    return element.name


def _launch(rows: torch.Tensor, out: torch.Tensor, element, mode: str, emit_codes: bool):
    """(E8M0 bytes (n_rows, n_blocks), and with ``emit_codes`` their float32 values, else None)."""
    n_rows, n_cols = rows.shape
    n_blocks = triton.cdiv(n_cols, BLOCK)
    scale_codes = torch.empty((n_rows, n_blocks), dtype=torch.uint8, device=rows.device)
    scale_values = (
        torch.empty(scale_codes.shape, dtype=torch.float32, device=rows.device) if emit_codes else None
    )
    _mx_tuned[lambda meta: (triton.cdiv(n_rows, meta["ROWS"]), triton.cdiv(n_blocks, meta["GROUPS"]))](
        rows,
        out,
        scale_codes,
        scale_values if emit_codes else scale_codes,  # read only when emitting codes
        n_rows,
        n_cols,
        n_blocks,
        ELEM_MAX=float(element.max),
        EMAX=element.emax,
        MIN_BIASED=128 - element.bias,
        MODE=mode,
        EMIT_CODES=emit_codes,
        FP8_CAST=fp8_cast(element, rows.device) if emit_codes else "",
        **encode_constants(element),
        BLOCK=BLOCK,
    )
    return scale_codes, scale_values


def mx_qdq_last_axis(
    x: torch.Tensor, element, mode: str, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values in ``out_dtype`` (default x's) and x's shape (one rounding from float32, as
    qdq), E8M0 bytes of shape (..., ceil(K/32))) for x (..., K)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype or x.dtype, device=x.device)
    scale_codes, _ = _launch(rows, out, element, mode, emit_codes=False)
    return out.reshape(x.shape), scale_codes.reshape(*x.shape[:-1], -1)


def mx_quantize_last_axis(
    x: torch.Tensor, element, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 element codes of shape (..., n_blocks, 32), E8M0 bytes of shape (..., n_blocks), their
    float32 values, as ``qlab.scaling.mx_scale_values`` gives them) for x (..., K), n_blocks =
    ceil(K/32): QTensor's blocked layout, padding included. One launch: the values come from the kernel,
    not from torch ops on the bytes afterwards."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n_blocks = triton.cdiv(rows.shape[1], BLOCK)
    out = torch.empty((rows.shape[0], n_blocks * BLOCK), dtype=torch.uint8, device=x.device)
    scale_codes, scale_values = _launch(rows, out, element, mode, emit_codes=True)
    blocks = (*x.shape[:-1], n_blocks)
    return out.reshape(*blocks, BLOCK), scale_codes.reshape(blocks), scale_values.reshape(blocks)
