"""Variance and LayerNorm numerics: the algorithms, exact references and a gradient checker.

Moments of a row x₁..xₙ are (n, M, S): the count, the mean and S = Σ(xᵢ − M)², so the biased
variance (the one LayerNorm uses) is S/n. Algorithms, with u the unit roundoff of the
accumulation dtype and κ = √(1 + M²/σ²) the condition number (Chan, Golub & LeVeque 1983):

    textbook   E[X²] − E[X]² from running Σx and Σx²         rel. error of S ~ n·κ²·u
    two_pass   M first, then Σ(x − M)²                        ~ n·u + n²·κ²·u²
    welford    δ = x − M;  M += δ/k;  S += δ·(x − M)          ~ n·κ·u
    pairwise   Chan's pairwise merge of single elements       n replaced by log₂ n
    shifted    textbook on x − K, K = the row's first element (κ of the shifted data)

Every arithmetic step runs in the accumulation dtype, rounded once per operation: PyTorch's CPU
kernels compute fp16/bf16 +, −, × in fp32 and round the result once, which equals IEEE fp16/bf16
arithmetic because fp32 carries at least 2p+2 bits of either. Counts are exact integers, as in
real kernels; divisions by a count are rounded once to the accumulation dtype.

Sequential algorithms loop in Python over the row (vectorised across rows), so they are
references for measuring error, not fast paths. ``chunk`` splits each row into contiguous chunks,
runs the algorithm inside each and merges the chunks pairwise with Chan's formula — PyTorch's CPU
LayerNorm does this with Welford.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import pandas as pd
import torch

from qlab import checks

ALGORITHMS = ("textbook", "two_pass", "welford", "pairwise", "shifted")
LAYER_NORM_STATS = ("welford", "two_pass", "textbook")
LAYER_NORM_WELFORD_CHUNK = 16


# --------------------------------------------------------------------------------------------
# Input checks shared by every public function
# --------------------------------------------------------------------------------------------


_MOMENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float8 has no arithmetic


def _require_float_tensor(x, what: str = "x") -> None:
    checks.tensor(what, x)
    if x.dtype not in _MOMENT_DTYPES:
        raise TypeError(
            f"{what} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}"
        )


def _require_choice(value, choices: Sequence[str], what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")


def _rows(x: torch.Tensor, dims: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Flatten the last ``dims`` dimensions: returns (rows × n view, leading shape)."""
    checks.integer("dims", dims, low=1, high=max(1, x.dim()))
    if dims > x.dim():
        raise ValueError(f"dims must be an int between 1 and x.dim()={x.dim()}, got {dims!r}")
    lead = tuple(x.shape[: x.dim() - dims])
    n = math.prod(x.shape[x.dim() - dims :])
    if n == 0:
        raise ValueError(f"cannot take moments over zero elements (input shape {tuple(x.shape)})")
    return x.reshape(-1, n), lead


def _resolve_acc_dtype(x: torch.Tensor, acc_dtype) -> torch.dtype:
    if acc_dtype is None:
        return x.dtype
    if acc_dtype not in _MOMENT_DTYPES:
        raise TypeError(f"acc_dtype must be float16, bfloat16, float32 or float64, got {acc_dtype!r}")
    return acc_dtype


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a dtype with p significand bits: fp32 2^-24, fp16 2^-11, bf16 2^-8."""
    checks.floating_dtype("dtype", dtype, optional=False)
    return torch.finfo(dtype).eps / 2


# --------------------------------------------------------------------------------------------
# Moments and the algorithms
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Moments:
    """Count, mean and S = Σ(x − mean)² of each row, in the accumulation dtype."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    def var(self, correction: int = 0) -> torch.Tensor:
        """S / (count − correction), rounded once to the accumulation dtype."""
        checks.integer("correction", correction, low=0)
        if self.count - correction <= 0:
            raise ValueError(f"correction={correction} leaves no degrees of freedom for count={self.count}")
        return _div(self.m2, self.count - correction)


def _div(a: torch.Tensor, k) -> torch.Tensor:
    """a / k for an exact integer (or integer tensor) k, rounded once to a's dtype."""
    if a.dtype in (torch.float16, torch.bfloat16):
        k = k.to(torch.float32) if isinstance(k, torch.Tensor) else k
        return (a.to(torch.float32) / k).to(a.dtype)
    return a / k


def _ratio(num, den, dtype: torch.dtype) -> torch.Tensor:
    """The exact quotient of integer tensors num/den, rounded to dtype (via float64)."""
    return (num.to(torch.float64) / den.to(torch.float64)).to(dtype)


def _sequential_sum(columns: torch.Tensor) -> torch.Tensor:
    total = columns[0].clone()
    for k in range(1, columns.shape[0]):
        total = total + columns[k]
    return total


def _textbook(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # S = n·(E[x²] − E[x]²): the ·n, and Moments.var()'s /n, are exact when n is a power of two
    n = columns.shape[0]
    mean = _div(_sequential_sum(columns), n)
    var = _div(_sequential_sum(columns * columns), n) - mean * mean
    return mean, var * n


def _two_pass(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = _div(_sequential_sum(columns), columns.shape[0])
    centered = columns - mean
    return mean, _sequential_sum(centered * centered)


def _welford(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = columns[0].clone()
    m2 = torch.zeros_like(mean)
    for k in range(1, columns.shape[0]):
        x = columns[k]
        delta = x - mean
        mean = mean + _div(delta, k + 1)
        m2 = m2 + delta * (x - mean)
    return mean, m2


def _shifted(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shift = columns[0]
    mean, m2 = _textbook(columns - shift)
    return shift + mean, m2


_SEQUENTIAL = {"textbook": _textbook, "two_pass": _two_pass, "welford": _welford, "shifted": _shifted}


def _chan_merge(na, nb, ma, mb, sa, sb):
    """Chan et al.: n = nA+nB, δ = M_B − M_A, M = M_A + δ·nB/n, S = S_A + S_B + δ²·nA·nB/n.
    Counts are exact integer tensors; the two count ratios are rounded once to the moments' dtype. In
    float16, nA·nB/n passes 65504 once n reaches 262,016: there δ²·nA·nB/n is formed in float32 and
    rounded once (inf in float16 would make a constant row's S NaN)."""
    n = na + nb
    delta = mb - ma
    mean = ma + delta * _ratio(nb, n, ma.dtype)
    weight = _ratio(na * nb, n, ma.dtype)
    term = delta * delta * weight
    if ma.dtype == torch.float16:
        wide = delta.float() * delta.float() * _ratio(na * nb, n, torch.float32)
        term = torch.where(torch.isinf(weight), wide.to(ma.dtype), term)
    m2 = sa + sb + term
    return n, mean, m2


def _merge_tree(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor):
    """Merge moments along the last axis pairwise (adjacent pairs, a balanced tree)."""
    while mean.shape[-1] > 1:
        pairs = mean.shape[-1] // 2
        carry = mean.shape[-1] % 2
        n, merged_mean, merged_m2 = _chan_merge(
            count[..., 0 : 2 * pairs : 2],
            count[..., 1 : 2 * pairs : 2],
            mean[..., 0 : 2 * pairs : 2],
            mean[..., 1 : 2 * pairs : 2],
            m2[..., 0 : 2 * pairs : 2],
            m2[..., 1 : 2 * pairs : 2],
        )
        if carry:
            n = torch.cat([n, count[..., -1:]], dim=-1)
            merged_mean = torch.cat([merged_mean, mean[..., -1:]], dim=-1)
            merged_m2 = torch.cat([merged_m2, m2[..., -1:]], dim=-1)
        count, mean, m2 = n, merged_mean, merged_m2
    return count[..., 0], mean[..., 0], m2[..., 0]


def merge_moments(a: Moments, b: Moments) -> Moments:
    """Chan et al.'s merge of two sets of moments (rows aligned): n = nA+nB, δ = M_B − M_A,
    M = M_A + δ·nB/n, S = S_A + S_B + δ²·nA·nB/n, in the dtype of a."""
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, Moments):
            raise TypeError(f"{name} must be Moments (from qlab.numerics.moments), got {checks.shown(value)}")
    if a.mean.shape != b.mean.shape:
        raise ValueError(
            f"moments to merge must have the same row shape, got {tuple(a.mean.shape)} and "
            f"{tuple(b.mean.shape)}"
        )
    device = a.mean.device
    _, mean, m2 = _chan_merge(
        torch.tensor(a.count, device=device),
        torch.tensor(b.count, device=device),
        a.mean,
        b.mean.to(a.mean.dtype),
        a.m2,
        b.m2.to(a.m2.dtype),
    )
    return Moments(a.count + b.count, mean, m2)


def moments(
    x: torch.Tensor,
    algorithm: str = "welford",
    *,
    dims: int = 1,
    acc_dtype: torch.dtype | None = None,
    chunk: int | None = None,
) -> Moments:
    """Moments over the last ``dims`` dimensions of ``x`` by the named algorithm.

    ``x`` is converted to ``acc_dtype`` (default: x's dtype) and every step is rounded in it.
    ``chunk``: run the algorithm within contiguous chunks of this many elements and merge the chunks
    pairwise (a trailing partial chunk is merged like the others). Returns moments shaped like x's
    leading dimensions.
    """
    _require_float_tensor(x)
    _require_choice(algorithm, ALGORITHMS, "algorithm")
    acc = _resolve_acc_dtype(x, acc_dtype)
    rows, lead = _rows(x.detach(), dims)
    rows = rows.to(acc)
    n = rows.shape[1]
    if algorithm == "pairwise":
        if chunk is not None:
            raise ValueError(
                "'pairwise' already merges single elements; chunk applies to the other algorithms"
            )
        count = torch.ones(n, dtype=torch.int64, device=rows.device)
        _, mean, m2 = _merge_tree(count, rows, torch.zeros_like(rows))
        return Moments(n, mean.reshape(lead), m2.reshape(lead))
    if chunk is None:
        mean, m2 = _SEQUENTIAL[algorithm](rows.t().contiguous())
        return Moments(n, mean.reshape(lead), m2.reshape(lead))
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    full, tail = divmod(n, chunk)
    means, m2s, counts = [], [], []
    if full:
        blocks = rows[:, : full * chunk].reshape(-1, full, chunk).permute(2, 0, 1).contiguous()
        mean, m2 = _SEQUENTIAL[algorithm](blocks)
        (
            means.append(mean),
            m2s.append(m2),
            counts.append(torch.full((full,), chunk, dtype=torch.int64, device=rows.device)),
        )
    if tail:
        mean, m2 = _SEQUENTIAL[algorithm](rows[:, full * chunk :].t().contiguous())
        (
            means.append(mean[:, None]),
            m2s.append(m2[:, None]),
            counts.append(torch.tensor([tail], device=rows.device)),
        )
    _, mean, m2 = _merge_tree(torch.cat(counts), torch.cat(means, dim=1), torch.cat(m2s, dim=1))
    return Moments(n, mean.reshape(lead), m2.reshape(lead))


def variance(
    x: torch.Tensor,
    algorithm: str = "welford",
    *,
    dims: int = 1,
    acc_dtype: torch.dtype | None = None,
    chunk: int | None = None,
    correction: int = 0,
) -> torch.Tensor:
    """Variance over the last ``dims`` dimensions (biased by default, as LayerNorm uses)."""
    return moments(x, algorithm, dims=dims, acc_dtype=acc_dtype, chunk=chunk).var(correction)


# --------------------------------------------------------------------------------------------
# Exact references
# --------------------------------------------------------------------------------------------


def _exact_row_moments(row: list[float]) -> tuple[Fraction, Fraction]:
    """Exact mean and biased variance of floats: each float is a dyadic rational, so scaling by
    the largest denominator gives integers whose sums Python computes exactly."""
    ratios = [v.as_integer_ratio() for v in row]
    denominator = max(q for _, q in ratios)
    ints = [p * (denominator // q) for p, q in ratios]
    n = len(ints)
    s1 = sum(ints)
    s2 = sum(i * i for i in ints)
    return Fraction(s1, n * denominator), Fraction(n * s2 - s1 * s1, n * n * denominator * denominator)


def _rows_as_floats(x: torch.Tensor, dims: int) -> tuple[list[list[float]], tuple[int, ...]]:
    _require_float_tensor(x)
    rows, lead = _rows(x.detach(), dims)
    rows = rows.to(torch.float64)
    if not torch.isfinite(rows).all():
        raise ValueError("exact moments need finite input; got inf or NaN")
    return rows.tolist(), lead


def exact_moments(x: torch.Tensor, *, dims: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance over the last ``dims`` dims, computed in exact rational arithmetic
    and each correctly rounded to float64 (relative error ≤ 2^-53; a variance beyond float64's range is
    inf, as torch.var gives)."""
    rows, lead = _rows_as_floats(x, dims)
    exact = [_exact_row_moments(r) for r in rows]
    mean = torch.tensor([_float64(m) for m, _ in exact], dtype=torch.float64).reshape(lead)
    var = torch.tensor([_float64(v) for _, v in exact], dtype=torch.float64).reshape(lead)
    return mean, var


def _float64(value: Fraction) -> float:
    """``value`` correctly rounded to float64, ±inf beyond its range (float() raises OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def rows_with_condition_number(
    kappas: Sequence[float],
    n: int,
    trials: int = 1,
    *,
    std: float | None = None,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Rows of length n whose condition number κ = √(1 + mean²/σ²) is each target, ``trials`` rows
    per target (target-major order): shape (len(kappas)·trials, n).

    Built in float64 from standardised normal draws (sample mean 0, biased std 1 exactly up to
    float64 rounding), then rounded to ``dtype``; the rounded rows' κ differs from the target where
    the dtype cannot resolve σ — measure it with ``condition_number``. With ``std=None`` the rows
    have unit RMS (mean² + σ² = 1, safe in float16); with ``std`` given, σ = std and mean = σ·√(κ²−1).
    """
    checks.integer("n", n, low=2)
    checks.integer("trials", trials, low=1)
    if hasattr(kappas, "tolist") and not isinstance(kappas, str):  # a numpy array or tensor of targets
        kappas = kappas.tolist() if getattr(kappas, "ndim", 1) == 1 else kappas
    if not isinstance(kappas, (list, tuple)) or not kappas:
        raise TypeError(
            f"kappas must be a non-empty 1-D list (or array) of condition numbers, got {checks.shown(kappas)}"
        )
    kappas = [checks.number(f"kappas[{i}]", kappa, low=1) for i, kappa in enumerate(kappas)]
    checks.allocatable("n × trials × len(kappas)", (len(kappas) * trials, n), 8)
    if std is not None:
        checks.number("std", std, low=0, open_low=True)
    checks.floating_dtype("dtype", dtype, optional=False)
    checks.generator("generator", generator)
    kappas = torch.as_tensor(kappas, dtype=torch.float64).reshape(-1, 1, 1)
    if not torch.isfinite(kappas).all() or (kappas < 1).any():
        raise ValueError(f"every target κ must be finite and >= 1, got {kappas.flatten().tolist()}")
    z = torch.randn(kappas.shape[0], trials, n, dtype=torch.float64, generator=generator)
    z = z - z.mean(dim=-1, keepdim=True)
    z = z / z.pow(2).mean(dim=-1, keepdim=True).sqrt()
    if std is None:
        sigma = 1 / kappas
        mean = torch.sqrt(1 - sigma * sigma)
    else:
        sigma = torch.full_like(kappas, float(std))
        mean = sigma * torch.sqrt(kappas * kappas - 1)
    return (mean + sigma * z).reshape(-1, n).to(dtype)


def condition_number(x: torch.Tensor, *, dims: int = 1) -> torch.Tensor:
    """κ = √(1 + mean²/σ²) of each row from the exact moments (inf for a constant row)."""
    mean, var = exact_moments(x, dims=dims)
    kappa = torch.sqrt(1 + mean * mean / var)
    return torch.where(var == 0, torch.inf, kappa)  # 0/0 for an all-zero row


def exact_layer_norm(
    x: torch.Tensor, normalized_shape, eps: float = 1e-5, *, digits: int = 50
) -> torch.Tensor:
    """LayerNorm without affine, (x − M)/√(σ² + eps), from exact moments with the square root and
    division in ``digits``-digit decimal arithmetic, rounded to float64. eps is taken as the exact
    value of the Python float given."""
    checks.number("eps", eps, low=0)
    checks.integer("digits", digits, low=1, high=10_000)
    dims = len(_check_normalized_shape(x, normalized_shape))
    rows, lead = _rows_as_floats(x, dims)
    ctx = decimal.Context(prec=digits)
    eps_exact = Fraction(eps)

    def to_decimal(f: Fraction) -> decimal.Decimal:
        return ctx.divide(decimal.Decimal(f.numerator), decimal.Decimal(f.denominator))

    out = []
    for row in rows:
        mean, var = _exact_row_moments(row)
        if var + eps_exact == 0:
            raise ValueError("exact_layer_norm of a constant row with eps=0 divides by zero")
        denominator = ctx.sqrt(to_decimal(var + eps_exact))
        out.append([float(ctx.divide(to_decimal(Fraction(v) - mean), denominator)) for v in row])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


# --------------------------------------------------------------------------------------------
# LayerNorm with selectable statistics and its own backward
# --------------------------------------------------------------------------------------------


def _normalized_shape_tuple(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, torch.Size) or (
        isinstance(normalized_shape, (tuple, list))
        and all(isinstance(d, int) and not isinstance(d, bool) for d in normalized_shape)
    ):
        if any(d < 1 for d in normalized_shape):
            raise ValueError(f"normalized_shape must hold sizes ≥ 1, got {tuple(normalized_shape)}")
        return tuple(normalized_shape)
    raise TypeError(
        f"normalized_shape must be an int or a sequence of ints, got {checks.shown(normalized_shape)}"
    )


def _check_normalized_shape(x: torch.Tensor, normalized_shape) -> tuple[int, ...]:
    _require_float_tensor(x, "x")
    shape = _normalized_shape_tuple(normalized_shape)
    if len(shape) == 0 or len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        trailing = tuple(x.shape[max(x.dim() - len(shape), 0) :])
        raise ValueError(
            f"normalized_shape {shape} does not match x's trailing dimensions {trailing} "
            f"(x's shape {tuple(x.shape)})"
        )
    return shape


def _layer_norm_stats(rows: torch.Tensor, stats: str, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of each row of a rows × n tensor, returned in rows' dtype.

    float32/float64 ``acc`` (rows already in it): welford is Welford inside 16-element chunks merged
    pairwise (PyTorch's CPU scheme); two_pass and textbook use PyTorch's (cascade) sums, so only the
    formula differs. bfloat16/float16 ``acc``: every algorithm runs inside 16-element chunks merged
    pairwise, each step rounded to ``acc`` (``moments``), as a kernel accumulating in 16 bits would.
    """
    if acc in (torch.bfloat16, torch.float16):
        m = moments(rows, stats, acc_dtype=acc, chunk=LAYER_NORM_WELFORD_CHUNK)
        return m.mean.to(rows.dtype), m.var().to(rows.dtype).clamp_min(0)
    if stats == "welford":
        m = moments(rows, "welford", chunk=LAYER_NORM_WELFORD_CHUNK)
        return m.mean, m.var()
    mean = rows.mean(dim=1)
    if stats == "two_pass":
        centered = rows - mean[:, None]
        return mean, (centered * centered).mean(dim=1)
    # textbook can go negative through cancellation; kernels clamp it at zero, so do we
    return mean, ((rows * rows).mean(dim=1) - mean * mean).clamp_min(0)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, n_dims, eps, stats, stats_acc):
        shape = x.shape
        n = math.prod(shape[x.dim() - n_dims :])
        acc = torch.float32 if stats_acc in (torch.bfloat16, torch.float16) else stats_acc  # the rest
        rows = x.reshape(-1, n).to(acc)
        mean, var = _layer_norm_stats(rows, stats, stats_acc)
        rstd = torch.rsqrt(var + eps)
        y = (rows - mean[:, None]) * rstd[:, None]
        if weight is not None:
            y = y * weight.reshape(1, n).to(acc)
        if bias is not None:
            y = y + bias.reshape(1, n).to(acc)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n, ctx.acc, ctx.affine_shape = n, acc, tuple(shape[x.dim() - n_dims :])
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype).reshape(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable  # mean/rstd are saved constants: no double backward
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        n, acc = ctx.n, ctx.acc
        rows = x.reshape(-1, n).to(acc)
        dy_rows = dy.reshape(-1, n).to(acc)
        xhat = (rows - mean[:, None]) * rstd[:, None]
        g = dy_rows * weight.reshape(1, n).to(acc) if weight is not None else dy_rows
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))
            dx = rstd[:, None] * (
                g - g.mean(dim=1, keepdim=True) - xhat * (g * xhat).mean(dim=1, keepdim=True)
            )
            dx = dx.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = (dy_rows * xhat).sum(dim=0).to(weight.dtype).reshape(ctx.affine_shape)
        if ctx.needs_input_grad[2]:
            db = dy_rows.sum(dim=0).to(ctx.bias_dtype).reshape(ctx.affine_shape)
        return dx, dw, db, None, None, None, None


def check_layer_norm_args(x, normalized_shape, weight, bias, eps, stats, acc_dtype):
    """Refuse what ``layer_norm`` cannot take (the Triton kernel's dispatch checks the same); returns
    (normalized shape as a tuple, the accumulation dtype)."""
    shape = _check_normalized_shape(x, normalized_shape)
    _require_choice(stats, LAYER_NORM_STATS, "stats")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        _require_float_tensor(p, name)
        if tuple(p.shape) != shape:
            raise ValueError(f"{name} shape {tuple(p.shape)} does not match normalized_shape {shape}")
        checks.same_device(name, p, "x", x)
    checks.number("eps", eps, low=0)
    checks.floating_dtype("acc_dtype", acc_dtype)
    if acc_dtype is None:
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if acc_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(
            f"layer_norm accumulates in float32, float64, bfloat16 or float16, got acc_dtype={acc_dtype}"
        )
    return shape, acc_dtype


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    stats: str = "welford",
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` with the statistics computed by ``stats``.

    Same signature and semantics as ``torch.nn.functional.layer_norm`` (biased variance, eps inside
    the square root). Computation in ``acc_dtype`` (float32, or float64 for float64 input); output
    in x's dtype. A bfloat16 or float16 ``acc_dtype`` accumulates only the statistics in it, every
    step rounded (16-element chunks merged pairwise); normalization and backward stay in float32.
    Backward is analytic (not autograd through the statistics):
    dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·weight, dweight = Σ dy·x̂, dbias = Σ dy.
    """
    shape, acc = check_layer_norm_args(x, normalized_shape, weight, bias, eps, stats, acc_dtype)
    # contiguous: the sums then run in one order whatever x's strides, so a view gives the same bits
    return _LayerNormFunction.apply(x.contiguous(), weight, bias, len(shape), float(eps), stats, acc)


class StatsLayerNorm(torch.nn.LayerNorm):
    """nn.LayerNorm computed by ``layer_norm`` with the statistics ``stats`` accumulated in ``acc_dtype``
    (float32 by default; bfloat16 or float16 rounds every step of the statistics)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, stats="welford",
                 acc_dtype=None, device=None, dtype=None):  # fmt: skip
        normalized_shape = _normalized_shape_tuple(normalized_shape)
        checks.number("eps", eps, low=0)
        checks.boolean("elementwise_affine", elementwise_affine)
        checks.boolean("bias", bias)
        checks.allocatable("normalized_shape", normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        _require_choice(stats, LAYER_NORM_STATS, "stats")
        checks.floating_dtype("acc_dtype", acc_dtype)
        self.stats, self.acc_dtype = stats, acc_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = self.acc_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
        return layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps, stats=self.stats, acc_dtype=acc
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stats={self.stats}, acc_dtype={self.acc_dtype}"


def use_stats_layer_norms(model: torch.nn.Module, stats: str, acc_dtype=None) -> list[str]:
    """Replace (in place) every nn.LayerNorm of ``model`` by a ``StatsLayerNorm`` sharing its weight and
    bias Parameters; returns the names replaced."""
    checks.module("model", model)
    _require_choice(stats, LAYER_NORM_STATS, "stats")
    checks.floating_dtype("acc_dtype", acc_dtype)
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.LayerNorm:
            affine = {"elementwise_affine": module.elementwise_affine, "bias": module.bias is not None}
            swapped = StatsLayerNorm(module.normalized_shape, module.eps, stats=stats, acc_dtype=acc_dtype,
                                     device="meta", **affine)  # fmt: skip
            swapped.weight, swapped.bias = module.weight, module.bias  # the module's own Parameters
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, swapped)
            replaced.append(name)
    return replaced


class _SwappedAffineGradsLayerNorm(_LayerNormFunction):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        dx, dw, db, *rest = _LayerNormFunction.backward.__wrapped__(ctx, dy)
        return (dx, db, dw, *rest)


def layer_norm_swapped_affine_grads(
    x, normalized_shape, weight=None, bias=None, eps=1e-5, *, stats="welford"
):
    """DELIBERATELY WRONG: ``layer_norm`` whose backward returns the weight and bias gradients in
    each other's places — the argument-order bug of the OneFlow LayerNorm seed. The forward is
    correct, so only a gradient check catches it (see ``check_layer_norm_grads``)."""
    shape, acc = check_layer_norm_args(x, normalized_shape, weight, bias, eps, stats, None)
    if weight is None or bias is None:
        raise ValueError("the swapped-gradient exhibit needs both weight and bias")
    return _SwappedAffineGradsLayerNorm.apply(
        x.contiguous(), weight, bias, len(shape), float(eps), stats, acc
    )


# --------------------------------------------------------------------------------------------
# Gradient checker for LayerNorm-like callables
# --------------------------------------------------------------------------------------------


def reference_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain float64 LayerNorm written with elementary torch ops (two-pass statistics), so that
    autograd through it is an independent reference for any LayerNorm's gradients."""
    shape = _check_normalized_shape(x, normalized_shape)
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x64 = x.to(torch.float64)
    mean = x64.mean(dim=dims, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x64 - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


_GRADCHECK_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@dataclass(frozen=True)
class GradCheckResult:
    """Per-quantity normwise relative errors against the float64 reference, and a verdict."""

    table: pd.DataFrame
    diagnosis: str

    @property
    def ok(self) -> bool:
        return bool(self.table["ok"].all())

    @property
    def wrong(self) -> list[str]:
        return list(self.table.loc[~self.table["ok"], "quantity"])


def _normwise_error(value: torch.Tensor | None, reference: torch.Tensor) -> float:
    if value is None:
        return math.inf
    if value.shape != reference.shape:
        return math.inf
    scale = reference.abs().max().item() or 1.0
    return (value.detach().to(torch.float64) - reference).abs().max().item() / scale


def check_layer_norm_grads(
    fn: Callable,
    *,
    shape: tuple[int, ...] = (8, 32),
    eps: float = 1e-5,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tolerance: float | None = None,
) -> GradCheckResult:
    """Check a LayerNorm-like ``fn(x, normalized_shape, weight, bias, eps)`` against float64.

    Draws x, weight (around 1), bias and an upstream gradient dy from ``seed``; compares the output
    and the gradients of x, weight and bias with autograd through ``reference_layer_norm`` in
    float64. Error = max|value − reference| / max|reference| (normwise relative); ``tolerance``
    defaults to 1e-4 for float32 (a few hundred ulps of the largest entry: reductions of up to
    thousands of terms in another order), 2e-2 for float16, 1e-1 for bfloat16, 1e-10 for float64.
    The diagnosis names the wrong gradients and recognises weight/bias gradients that are swapped.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {checks.shown(dtype)}")
    if dtype not in _GRADCHECK_TOLERANCE:
        raise ValueError(f"dtype must be one of {list(_GRADCHECK_TOLERANCE)}, got {dtype}")
    checks.seed("seed", seed)
    checks.number("eps", eps, low=0)
    if tolerance is not None:
        checks.number("tolerance", tolerance, low=0, open_low=True)
    if not isinstance(shape, (tuple, list)) or len(shape) < 1:
        raise TypeError(f"shape must be a tuple of positive ints, got {checks.shown(shape)}")
    for size in shape:
        checks.integer("shape", size, low=1)
    checks.allocatable("shape", shape, element_size=8)  # the float64 reference
    tol = _GRADCHECK_TOLERANCE[dtype] if tolerance is None else tolerance
    generator = torch.Generator().manual_seed(seed)
    normalized = shape[-1:]
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 0.5
    weight = 1 + 0.5 * torch.randn(normalized, generator=generator, dtype=torch.float64)
    bias = torch.randn(normalized, generator=generator, dtype=torch.float64)
    dy = torch.randn(shape, generator=generator, dtype=torch.float64)

    ref_inputs = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    ref_out = reference_layer_norm(ref_inputs[0], normalized, ref_inputs[1], ref_inputs[2], eps)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dy)

    inputs = [t.to(dtype).requires_grad_(True) for t in (x, weight, bias)]
    out = fn(inputs[0], normalized, inputs[1], inputs[2], eps)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise ValueError(
            f"fn must return a tensor of the input's shape {tuple(x.shape)}, "
            f"got {getattr(out, 'shape', out)!r}"
        )
    grads = torch.autograd.grad(out, inputs, dy.to(dtype), allow_unused=True)

    names = ["output", "d_input", "d_weight", "d_bias"]
    values = [out, *grads]
    references = [ref_out.detach(), *ref_grads]
    errors = [_normwise_error(v, r) for v, r in zip(values, references)]
    table = pd.DataFrame({"quantity": names, "error": errors, "tolerance": tol})
    table["ok"] = table["error"] <= tol

    wrong = [name for name, ok in zip(names, table["ok"]) if not ok]
    swapped = (
        not table["ok"][2]
        and not table["ok"][3]
        and _normwise_error(grads[1], ref_grads[2]) <= tol
        and _normwise_error(grads[2], ref_grads[1]) <= tol
    )
    if not wrong:
        diagnosis = "all gradients match the float64 reference"
    elif swapped:
        diagnosis = "d_weight and d_bias are swapped: each matches the other's reference (forward is " + (
            "correct)" if table["ok"][0] else "also wrong)"
        )
    else:
        diagnosis = "wrong: " + ", ".join(wrong)
    return GradCheckResult(table=table, diagnosis=diagnosis)


# --------------------------------------------------------------------------------------------
# How ill-conditioned are the rows real models normalise?
# --------------------------------------------------------------------------------------------

NORM_KINDS = ("LayerNorm", "RMSNorm")  # matched against the end of a module's class name


def norm_input_conditions(model: torch.nn.Module, forward: Callable[[], object]) -> pd.DataFrame:
    """κ = √(1 + mean²/σ²) of every row that each normalisation layer of ``model`` (a module whose class
    name ends in LayerNorm or RMSNorm: nn.LayerNorm, BERT's, LlamaRMSNorm) receives while ``forward()``
    runs, one row per layer and call with rows (the input the first tensor argument, positional or
    keyword): layer, kind, rows, kappa_median, kappa_p99, kappa_max, and
    bf16_textbook_fraction / fp32_textbook_fraction (the share of rows with κ ≥ 2 and κ ≥ 10³, where
    notebook 02 measures E[X²]−E[X]² losing every digit of σ² in bf16 / float32 accumulation).
    Moments in float64, two-pass (relative error ≲ n·2⁻⁵³·κ², far below what is reported). RMSNorm
    divides by the root mean square and subtracts no mean, so its κ says what a LayerNorm in its
    place would face, not what it does."""
    checks.module("model", model)
    if not callable(forward):
        raise TypeError(f"forward must be a callable that runs the model, got {checks.shown(forward)}")
    rows, handles = [], []

    def record(name, kind):
        def hook(module, args, kwargs):
            given = [*args, *kwargs.values()]  # ln(x) or ln(hidden_states=x): the first tensor is the input
            x = next((value for value in given if isinstance(value, torch.Tensor)), None)
            if x is None or x.numel() == 0:
                return  # a call with no rows has no κ
            x = x.detach()
            width = math.prod(getattr(module, "normalized_shape", None) or x.shape[-1:])  # a LayerNorm's
            x = x.reshape(-1, width).double()  # rows over its normalized dims; an RMSNorm's over the last
            mean = x.mean(1, keepdim=True)
            variance = ((x - mean) ** 2).mean(1)
            kappa = torch.where(variance > 0, torch.sqrt(1 + mean[:, 0] ** 2 / variance), math.inf)
            rows.append(
                {
                    "layer": name,
                    "kind": kind,
                    "rows": len(kappa),
                    "kappa_median": kappa.median().item(),
                    "kappa_p99": kappa.quantile(0.99).item(),
                    "kappa_max": kappa.max().item(),
                    "bf16_textbook_fraction": (kappa >= 2).double().mean().item(),
                    "fp32_textbook_fraction": (kappa >= 1e3).double().mean().item(),
                }
            )

        return hook

    for name, module in model.named_modules():
        kind = next((k for k in NORM_KINDS if type(module).__name__.endswith(k)), None)
        if kind is not None:
            handles.append(module.register_forward_pre_hook(record(name, kind), with_kwargs=True))
    if not handles:
        raise ValueError(f"the model has no LayerNorm or RMSNorm module ({type(model).__name__})")
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return pd.DataFrame(rows)
