"""Triton LayerNorm forward and backward with selectable statistics, float32 accumulation.

Forward, one program per row (the row held in registers, BLOCK = next power of two ≥ n):
- ``textbook``: mean = Σx/n, var = max(Σx²/n − mean², 0) (the clamp every kernel applies);
- ``two_pass``: mean = Σx/n, var = Σ(x − mean)²/n;
- ``welford``: every element is a moment (count 1, mean x, M2 0), merged by Chan's formula in a
  tree reduction (what CUDA LayerNorms do across a warp), var = M2/n.
Then y = (x − mean)·rstd·w + b with rstd = 1/sqrt(var + eps); mean and rstd are saved per row.

Backward, one program per tile of ROWS rows (about four tiles per SM):
dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·w; the tile's partial Σ dy·x̂ and Σ dy go to a (tiles, n)
buffer that torch sums afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STATS = ("welford", "two_pass", "textbook")


def _warps(block: int) -> int:
    """Warps for a row of ``block`` values held in registers: 8 values per thread up to 8 warps (with
    the default 4 warps, a 4096-wide row spills registers)."""
    return min(max(block // 256, 1), 8)


def _rows_per_tile(n_rows: int, device: torch.device) -> int:
    """Rows per backward program: about four programs per SM, a power of two in [4, 256] (4 under the
    interpreter). Fixed per machine and shape, never timed, so dw and db, summed tile by tile, keep the
    same bits from run to run."""
    if device.type != "cuda":
        return 4
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return min(max(triton.next_power_of_2(triton.cdiv(n_rows, target)), 4), 256)


@triton.jit
def _chan_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    count = count_a + count_b
    delta = mean_b - mean_a
    safe = tl.where(count == 0, 1.0, count)  # two empty (masked) moments stay empty
    mean = mean_a + delta * (count_b / safe)
    m2 = m2_a + m2_b + delta * delta * (count_a * count_b / safe)
    return count, mean, m2


@triton.jit
def _forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n,
    eps,
    STATS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    if STATS == "welford":
        count, mean, m2 = tl.reduce((inside.to(tl.float32), x, tl.zeros_like(x)), 0, _chan_merge)
        var = m2 / n
    elif STATS == "two_pass":
        mean = tl.sum(x, axis=0) / n
        centered = tl.where(inside, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / n
    else:
        mean = tl.sum(x, axis=0) / n
        var = tl.maximum(tl.sum(x * x, axis=0) / n - mean * mean, 0.0)
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    y = (x - mean) * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    n_rows,
    n,
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    w = (
        tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_W
        else tl.full((BLOCK,), 1.0, tl.float32)
    )
    dw_sum = tl.zeros((BLOCK,), tl.float32)
    db_sum = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = tile * ROWS + i
        if row < n_rows:
            offsets = row.to(tl.int64) * n + cols
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.where(inside, (x - mean) * rstd, 0.0)
            g = dy * w
            dx = rstd * (g - tl.sum(g, axis=0) / n - xhat * (tl.sum(g * xhat, axis=0) / n))
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)
            dw_sum += dy * xhat
            db_sum += dy
    tl.store(dw_partial_ptr + tile * n + cols, dw_sum, mask=inside)
    tl.store(db_partial_ptr + tile * n + cols, db_sum, mask=inside)


def forward(rows: torch.Tensor, weight, bias, eps: float, stats: str, *, num_warps: int | None = None):
    """(y in rows' dtype, mean float32 (R,), rstd float32 (R,)) for rows (R, n) contiguous. ``num_warps``
    overrides the default (for tuning; the bits do not depend on it)."""
    n_rows, n = rows.shape
    y = torch.empty_like(rows)
    mean = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    _forward_kernel[(n_rows,)](
        rows,
        weight if weight is not None else rows,
        bias if bias is not None else rows,
        y,
        mean,
        rstd,
        n,
        eps,
        STATS=stats,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=num_warps or _warps(triton.next_power_of_2(n)),
    )
    return y, mean, rstd


def backward(rows, weight, dy, mean, rstd, *, rows_per_tile: int | None = None, num_warps: int | None = None):
    """(dx in rows' dtype, Σ dy·x̂ float32 (n,), Σ dy float32 (n,)). ``rows_per_tile`` and ``num_warps``
    override the defaults (for tuning; rows_per_tile changes the summation order of the last two)."""
    n_rows, n = rows.shape
    rows_per_tile = rows_per_tile or _rows_per_tile(n_rows, rows.device)
    tiles = triton.cdiv(n_rows, rows_per_tile)
    dx = torch.empty_like(rows)
    dw_partial = torch.empty((tiles, n), dtype=torch.float32, device=rows.device)
    db_partial = torch.empty((tiles, n), dtype=torch.float32, device=rows.device)
    _backward_kernel[(tiles,)](
        rows,
        weight if weight is not None else rows,
        dy,
        mean,
        rstd,
        dx,
        dw_partial,
        db_partial,
        n_rows,
        n,
        HAS_W=weight is not None,
        ROWS=rows_per_tile,
        BLOCK=triton.next_power_of_2(n),
        num_warps=num_warps or _warps(triton.next_power_of_2(n)),
    )
    return dx, dw_partial.sum(0), db_partial.sum(0)
