"""Triton kernel: NVFP4 quantize-dequantize (E2M1 elements, E4M3 block scales per 1×16 or 16×16 tile,
one float32 global scale), bit-exact with ``qlab.quantize.qdq(x, NVFP4Spec(...))`` for RNE, in either
convention.

Two launches, no host synchronisation: the tensor's amax (fp8_triton.tensor_amax), then one
program per tile of 16 rows × GROUPS blocks (autotuned per shape on a GPU) computing the reference's
operations in the reference's order (docs/reference.md §2).
NVIDIA: S_enc = min(2688/amax, FLT_MAX) (1 for amax 0 or non-finite), S_dec = 1/S_enc, s_block =
E4M3(min(amax_block·(S_enc·fl(1/6)), 448)) (no floor), elements x·min(1/(s_block·S_dec), FLT_MAX)
clamped to ±6 and rounded onto the E2M1 grid, times fl(fl(s_block·amax)·fl(1/2688)). torchao:
s_global = amax/(448·6), s_block = E4M3(clamp(amax_block/6/s_global, 2^-6, 448)), x·(1/s_global)/s_block,
times s_global·s_block. A non-finite block gets a NaN scale. Stochastic rounding draws 15 random bits
per element from Philox (tl.randint) keyed by (seed, offset + element index): the same seed and
offset give the same bits on every launch and device; the draws are not those of the CPU
reference's torch.Generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qlab.kernels.fp8_triton import tensor_amax
from qlab.kernels.triton_math import Tuned, load_block_tile, round_to_grid

BLOCK = 16
ROWS = 16
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
RCP_6 = tl.constexpr(0.1666666716337204)  # fl(1/6) in float32
RCP_2688 = tl.constexpr(0.00037202381645329297)  # fl(1/2688) in float32


@triton.jit
def _nvfp4_kernel(
    x_ptr,
    out_ptr,
    scales_ptr,
    global_ptr,
    amax_ptr,
    nan_ptr,
    n_rows,
    n_cols,
    n_blocks,
    seed,
    offset,
    TILE_2D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NVIDIA: tl.constexpr,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, blocks, _, offsets, inside, x = load_block_tile(x_ptr, n_rows, n_cols, ROWS, GROUPS, BLOCK)

    amax = tl.load(amax_ptr)
    finite_amax = (tl.load(nan_ptr) == 0) & (amax != float("inf"))
    magnitude = tl.abs(x)
    block_amax = tl.max(magnitude, axis=2)  # (ROWS, GROUPS)
    block_nan = tl.max((x != x).to(tl.int32), axis=2) > 0
    ones = tl.zeros((ROWS, GROUPS), tl.float32) + 1.0
    if TILE_2D:  # ROWS == BLOCK: each of the tile's GROUPS column blocks is one 16×16 block
        block_amax = tl.zeros((ROWS, GROUPS), tl.float32) + tl.max(block_amax, axis=0)[None, :]
        block_nan = (tl.zeros((ROWS, GROUPS), tl.int32) + tl.max(block_nan.to(tl.int32), axis=0)[None, :]) > 0
    block_finite = (block_amax != float("inf")) & (block_nan == 0)
    if (
        NVIDIA
    ):  # TE's order: S_enc, s_block = E4M3(amax_b · (S_enc · fl(1/6))), x · min(1/(s_block · S_dec), max)
        encode = tl.minimum(tl.math.div_rn(2688.0, amax), FLOAT32_MAX)
        encode = tl.where(finite_amax & (amax > 0), encode, 1.0)
        global_scale = tl.math.div_rn(1.0, encode)  # S_dec
        raw = block_amax * (encode * RCP_6)
        block_scale = round_to_grid(tl.minimum(raw, 448.0), 448.0, 3, 121)  # E4M3 (bias 7), RNE, no floor
        block_scale = tl.where(block_finite, block_scale, float("nan"))
        inverse = tl.minimum(tl.math.div_rn(ones, block_scale * global_scale), FLOAT32_MAX)
        usual = finite_amax & (encode < FLOAT32_MAX)
        full_scale = tl.where(usual, (block_scale * amax) * RCP_2688, block_scale * global_scale)
    else:  # torchao's order: s_global = amax/2688, s_block = E4M3(clamp(amax_b/6/s_global, 2^-6, 448))
        candidate = tl.math.div_rn(amax, 2688.0)  # 448 · 6
        global_scale = tl.where(finite_amax & (candidate > 0), candidate, 1.0)
        raw = tl.math.div_rn(tl.math.div_rn(block_amax, 6.0), ones * global_scale)
        clamped = tl.minimum(tl.maximum(raw, 0.015625), 448.0)
        block_scale = round_to_grid(clamped, 448.0, 3, 121)  # E4M3 (bias 7), RNE
        block_scale = tl.where(block_finite, block_scale, float("nan"))
        inverse = tl.math.div_rn(
            tl.zeros((ROWS, GROUPS), tl.float32) + tl.math.div_rn(1.0, global_scale), block_scale
        )
        full_scale = global_scale * block_scale
    scaled = x * inverse[:, :, None]
    if not NVIDIA:  # a tiny tensor's inverse overflows: divide by the global, then the block scale
        divided = tl.math.div_rn(tl.math.div_rn(x, global_scale), block_scale[:, :, None])
        scaled = tl.where(inverse[:, :, None] == float("inf"), divided, scaled)
    scaled = tl.minimum(tl.maximum(scaled, -6.0), 6.0)
    scaled = tl.where((scaled != scaled) | (x != x) | (block_finite[:, :, None] == 0), 0.0, scaled)
    if STOCHASTIC:
        noise = (tl.randint(seed, (offsets + offset).to(tl.uint32)) & 0x7FFF).to(tl.float32) * (1.0 / 32768.0)
        mag = tl.abs(scaled)
        biased = tl.maximum(mag.to(tl.int32, bitcast=True) >> 23, 127)  # E2M1: bias 1 → 128 − 1
        quantum = ((biased - 1) << 23).to(tl.float32, bitcast=True)
        steps = tl.minimum(tl.floor(mag / quantum + noise), tl.floor(mag / quantum) + 1.0)
        values = tl.minimum(steps * quantum, 6.0)
        values = tl.where(scaled < 0, -values, values)
    else:
        values = round_to_grid(scaled, 6.0, 1, 127)
    tl.store(out_ptr + offsets, (values * full_scale[:, :, None]).to(out_ptr.dtype.element_ty), mask=inside)
    block_inside = blocks < n_blocks
    if TILE_2D:
        tl.store(
            scales_ptr + tl.program_id(0).to(tl.int64) * n_blocks + blocks,
            tl.max(block_scale, axis=0),
            mask=block_inside,  # every row tile holds a row: the grid is cdiv(n_rows, ROWS)
        )
    else:
        tl.store(
            scales_ptr + rows[:, None].to(tl.int64) * n_blocks + blocks[None, :],
            block_scale,
            mask=(rows[:, None] < n_rows) & block_inside[None, :],
        )
    tl.store(global_ptr, global_scale, mask=(tl.program_id(0) == 0) & (tl.program_id(1) == 0))


# Tiles of 16 rows × GROUPS blocks (16 rows: a 16×16 block is one tile's column); the first is the one
# the CPU interpreter runs.
_nvfp4_tuned = Tuned(
    _nvfp4_kernel,
    ("GROUPS", "num_warps"),
    (2, 4),
    (4, 4),
    (8, 4),
    (8, 8),
    (16, 8),
    (1, 2),
    key=["n_rows", "n_cols"],
)


def nvfp4_qdq_last_axis(
    x: torch.Tensor,
    *,
    block_2d: bool,
    stochastic: bool,
    seed: int,
    offset: int,
    out_dtype: torch.dtype | None = None,
    convention: str = "nvidia",
):
    """(qdq values in ``out_dtype`` (default x's) and x's shape, float32 block scales, float32 global
    scale ()) for x (..., K)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n_rows, n_cols = rows.shape
    n_blocks = triton.cdiv(n_cols, BLOCK)
    amax, has_nan = tensor_amax(rows)
    out = torch.empty(rows.shape, dtype=out_dtype or x.dtype, device=x.device)
    scale_rows = triton.cdiv(n_rows, ROWS) if block_2d else n_rows
    scales = torch.empty((scale_rows, n_blocks), dtype=torch.float32, device=x.device)
    global_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n_rows, ROWS), triton.cdiv(n_blocks, meta["GROUPS"]))  # noqa: E731
    _nvfp4_tuned[grid](
        rows,
        out,
        scales,
        global_scale,
        amax,
        has_nan,
        n_rows,
        n_cols,
        n_blocks,
        seed,
        offset,
        TILE_2D=block_2d,
        STOCHASTIC=stochastic,
        NVIDIA=convention == "nvidia",
        ROWS=ROWS,
        BLOCK=BLOCK,
    )
    return out.reshape(x.shape), scales, global_scale.reshape(())
