"""Tests for qlab.numerics: variance algorithms, exact references, LayerNorm and its gradient checker.

Every numerical assertion is made against a reference that does not come from the module under
test: exact rational arithmetic (``fractions.Fraction``) written here, high-precision ``decimal``,
float64 computations, ``torch.nn.functional.layer_norm``, ``torch.autograd.gradcheck`` in float64,
published constants, or mathematical facts. Tolerances come with the reason for their size.
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qlab import numerics as qn
from qlab.numerics import (
    ALGORITHMS,
    LAYER_NORM_STATS,
    check_layer_norm_grads,
    condition_number,
    exact_layer_norm,
    exact_moments,
    layer_norm,
    layer_norm_swapped_affine_grads,
    merge_moments,
    moments,
    unit_roundoff,
    variance,
)

U32 = 2.0**-24  # unit roundoff of IEEE binary32 (24 significand bits)
U64 = 2.0**-53  # unit roundoff of IEEE binary64 (53 significand bits)
SEQUENTIAL = tuple(a for a in ALGORITHMS if a != "pairwise")
HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Independent exact references (written here, not taken from qlab)
# --------------------------------------------------------------------------------------------


def frac_moments(row: list[float]) -> tuple[Fraction, Fraction]:
    """Exact mean M and S = Σ(x − M)² of a row of floats (the two-pass formula over rationals)."""
    xs = [Fraction(v) for v in row]
    mean = sum(xs, Fraction(0)) / len(xs)
    return mean, sum(((v - mean) ** 2 for v in xs), Fraction(0))


def rows_of(x: torch.Tensor) -> list[list[float]]:
    """Rows of the last dimension as Python floats (float64 holds fp16/bf16/fp32 values exactly)."""
    return x.detach().to(torch.float64).reshape(-1, x.shape[-1]).tolist()


def rel_err(computed: float, exact: Fraction) -> float:
    """|computed − exact| / |exact|, evaluated exactly and only then rounded."""
    return float(abs(Fraction(computed) - exact) / abs(exact))


def frac_kappa(mean: Fraction, s: Fraction, n: int) -> float:
    """Condition number κ = √(1 + M²/σ²) with σ² = S/n (Chan, Golub & LeVeque)."""
    return math.sqrt(1 + float(mean * mean * n / s))


def round_to_bits(q: Fraction, p: int) -> Fraction:
    """Round a positive rational to the nearest number with p significand bits, ties to even."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1  # now 2^e <= q < 2^(e+1)
    scale = Fraction(2) ** (p - 1 - e)
    return Fraction(round(q * scale)) / scale  # Fraction.__round__ rounds half to even


def decimal_layer_norm_row(row: list[float], eps: float, prec: int = 60) -> list[decimal.Decimal]:
    """(x − M)/√(S/n + eps) with exact M and S and a `prec`-digit decimal square root / division."""
    ctx = decimal.Context(prec=prec)
    mean, s = frac_moments(row)
    var_eps = s / len(row) + Fraction(eps)
    denom = ctx.sqrt(ctx.divide(decimal.Decimal(var_eps.numerator), decimal.Decimal(var_eps.denominator)))
    out = []
    for v in row:
        c = Fraction(v) - mean
        out.append(
            ctx.divide(ctx.divide(decimal.Decimal(c.numerator), decimal.Decimal(c.denominator)), denom)
        )
    return out


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)


# --------------------------------------------------------------------------------------------
# 6. unit_roundoff: published IEEE / bfloat16 values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.float64, 2.0**-53),
        (torch.float32, 2.0**-24),
        (torch.float16, 2.0**-11),
        (torch.bfloat16, 2.0**-8),
    ],
)
def test_unit_roundoff_published_values(dtype, expected):
    assert unit_roundoff(dtype) == expected


# --------------------------------------------------------------------------------------------
# 1. exact_moments: equals our own Fraction computation, correctly rounded to float64
# --------------------------------------------------------------------------------------------


def assert_exact_moments_match(x: torch.Tensor):
    mean, var = exact_moments(x)
    assert mean.dtype == var.dtype == torch.float64
    assert mean.shape == var.shape == x.shape[:-1]
    for got_m, got_v, row in zip(mean.reshape(-1).tolist(), var.reshape(-1).tolist(), rows_of(x)):
        m, s = frac_moments(row)
        # float(Fraction) is int/int true division, which Python rounds correctly: bit-exact check
        assert got_m == float(m)
        assert got_v == float(s / len(row))


_g = torch.Generator().manual_seed(7)
EXACT_MOMENT_CASES = {
    "random_rows": torch.randn(6, 33, generator=_g),
    "huge_mean_to_std": (1e6 + torch.randn(4, 50, generator=_g)).float(),  # κ ≈ 1e6
    "constant_row": torch.full((2, 9), 3.14159, dtype=torch.float32),
    "zero_row": torch.zeros(1, 5),
    "mixed_magnitudes": torch.tensor([[1e-30, 1e30, -1e30, 3.0, -2.5e-30]], dtype=torch.float32),
    "single_element": torch.tensor([[-7.25]]),
    "float64_input": torch.randn(3, 17, generator=_g, dtype=torch.float64) * 1e3 + 1e8,
    "half_input": (torch.randn(3, 10, generator=_g) * 4).to(torch.float16),
}


@pytest.mark.parametrize("name", list(EXACT_MOMENT_CASES))
def test_exact_moments_table(name):
    assert_exact_moments_match(EXACT_MOMENT_CASES[name])


def test_exact_moments_constant_row_has_zero_variance_and_exact_mean():
    x = torch.full((1, 13), 0.1, dtype=torch.float32)
    mean, var = exact_moments(x)
    assert var.item() == 0.0
    assert mean.item() == float(torch.tensor(0.1, dtype=torch.float32))  # fp32(0.1), exactly


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=12))
def test_exact_moments_random_float32_rows(values):
    assert_exact_moments_match(torch.tensor([values], dtype=torch.float32))


def test_exact_moments_over_several_dims():
    x = randn(2, 3, 4, seed=3)
    mean, var = exact_moments(x, dims=2)
    assert mean.shape == (2,)
    for i in range(2):
        m, s = frac_moments(x[i].reshape(-1).tolist())
        assert mean[i].item() == float(m) and var[i].item() == float(s / 12)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_exact_moments_rejects_non_finite(bad):
    with pytest.raises(ValueError):
        exact_moments(torch.tensor([[1.0, bad, 2.0]]))


def test_condition_number_of_known_row():
    # x = [0, 2]: M = 1, σ² = 1, so κ = √2
    assert condition_number(torch.tensor([[0.0, 2.0]])).item() == pytest.approx(math.sqrt(2), rel=1e-15)
    assert condition_number(torch.tensor([[5.0, 5.0]])).item() == math.inf


def test_condition_number_of_zero_row_is_inf_as_documented():
    assert condition_number(torch.zeros(1, 4)).item() == math.inf


# --------------------------------------------------------------------------------------------
# 2. moments / variance of every algorithm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float64_agrees_with_exact(algorithm):
    """Well-conditioned data (κ ≈ 1.1) in float64: the weakest bound, textbook's n·κ²·u, is ~5e-15
    for n = 32, so 4·n·κ²·u (≈ 2e-14) holds for every algorithm. The mean's error is bounded by the
    summation bound n·u·mean|x| (again with a factor 4)."""
    n = 32
    x = randn(8, n, seed=11, dtype=torch.float64, offset=0.5)
    m = moments(x, algorithm)
    assert m.count == n and m.mean.dtype == m.m2.dtype == torch.float64
    v = variance(x, algorithm)
    for got_m, got_s, got_v, row in zip(m.mean.tolist(), m.m2.tolist(), v.tolist(), rows_of(x)):
        mean, s = frac_moments(row)
        tol = 4 * n * frac_kappa(mean, s, n) ** 2 * U64
        assert tol < 5e-14
        assert rel_err(got_s, s) <= tol
        assert rel_err(got_v, s / n) <= tol
        assert abs(Fraction(got_m) - mean) <= 4 * n * U64 * Fraction(sum(abs(r) for r in row) / n)


def float32_bound(algorithm: str, n: int, kappa: float, kappa_shift: float) -> float:
    """First-order relative error bounds for S (Chan, Golub & LeVeque 1983; Chan & Lewis 1979)."""
    return {
        "textbook": n * kappa**2 * U32,
        "two_pass": n * U32 + (n * kappa * U32) ** 2,
        "welford": n * kappa * U32,
        "pairwise": math.log2(n) * kappa * U32,
        "shifted": n * kappa_shift**2 * U32,  # textbook on x − x₁: κ of the shifted data
    }[algorithm]


FLOAT32_BOUND_CASES = [
    (a, k) for a in ALGORITHMS for k in (1.0, 30.0, 1000.0) if not (a == "textbook" and k > 100)
]


@pytest.mark.parametrize("algorithm, kappa", FLOAT32_BOUND_CASES)
def test_float32_error_bounds(algorithm, kappa):
    """Relative error of S in float32 is within C·bound, C = 4 (observed worst ratio over many seeds
    is ≈ 0.6, so 4 leaves room yet still catches a wrong algorithm: e.g. textbook's error at κ = 1000
    is ~0.5, two orders above welford's bound). Textbook at κ = 1000 is left out: its bound
    n·κ²·u ≈ 8 says nothing (see the κ = 1e4 demonstration below)."""
    n = 128
    x = randn(8, n, seed=int(kappa) + 5, scale=2.0, offset=2.0 * math.sqrt(kappa**2 - 1))
    m = moments(x, algorithm)
    assert m.m2.dtype == torch.float32
    for got, row in zip(m.m2.tolist(), rows_of(x)):
        mean, s = frac_moments(row)
        k = frac_kappa(mean, s, n)
        k_shift = frac_kappa(mean - Fraction(row[0]), s, n)
        bound = 4 * float32_bound(algorithm, n, k, k_shift)
        assert bound < 0.5  # the bound must say something
        assert rel_err(got, s) <= bound


def test_textbook_loses_all_digits_at_kappa_1e4_while_welford_and_two_pass_do_not():
    """Mean 1e4, σ = 1: E[x²] ≈ 1e8 has an fp32 ulp of 8, far above σ² = 1, so textbook's
    E[x²] − E[x]² is pure rounding noise; welford (n·κ·u ≈ 0.04) and two_pass stay accurate."""
    n = 64
    x = randn(6, n, seed=4, offset=1e4)
    refs = [frac_moments(r) for r in rows_of(x)]
    for mean, s in refs:
        assert 5e3 < frac_kappa(mean, s, n) < 2e4  # sample σ of 64 normals varies by ~±20%
    textbook = moments(x, "textbook").m2.tolist()
    welford = moments(x, "welford").m2.tolist()
    two_pass = moments(x, "two_pass").m2.tolist()
    for (_mean, s), t, w, p in zip(refs, textbook, welford, two_pass):
        assert rel_err(t, s) > 0.1
        assert rel_err(w, s) < 1e-2
        assert rel_err(p, s) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "algorithm, chunk",
    [(a, None) for a in ALGORITHMS] + [(a, 2) for a in SEQUENTIAL] + [("welford", 3), ("two_pass", 3)],
)
def test_tiny_exact_case_1234(algorithm, chunk, dtype):
    """x = [1, 2, 3, 4]: M = 5/2, S = 5, σ² = 5/4. Every intermediate (sums ≤ 30, 7.5, 6.25, 1.25,
    deltas, 1/2, 3/4 merge ratios) has ≤ 5 significand bits, so all dtypes compute it exactly.
    Chunks of 3 ([1,2,3] + [4]) stay exact only for welford (δ/3 = 1.5/3) and two_pass (6/3);
    textbook/shifted would form Σx²/3 = 14/3 or 5/3, which no binary format holds."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=dtype)
    m = moments(x, algorithm, chunk=chunk)
    assert m.mean.dtype == dtype
    assert m.count == 4
    assert m.mean.item() == 2.5
    assert m.m2.item() == 5.0
    assert variance(x, algorithm, chunk=chunk).item() == 1.25
    # S/(n − 1) = 5/3 is not representable: expect it correctly rounded once to the dtype
    bits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[dtype]
    assert variance(x, algorithm, chunk=chunk, correction=1).item() == float(
        round_to_bits(Fraction(5, 3), bits)
    )


def test_bf16_sequential_sum_stagnates_at_256():
    """Our own model of bf16 (8 significand bits, round to nearest even): 256 + 1 = 257 needs 9 bits,
    is a tie between 256 and 258 and rounds to the even 256, so the running sum sticks at 256."""
    total = Fraction(1)
    for _ in range(1023):
        total = round_to_bits(total + 1, 8)
    assert total == 256


def test_textbook_bf16_mean_of_ones_is_a_quarter():
    """With Σx = Σx² = 256 (stagnated, see above): mean = 256/1024 = 0.25; Σx²/n − mean² =
    0.25 − 0.0625 = 0.1875 (exact in bf16: 0.0011₂); S = 0.1875·1024 = 192; σ² = 192/1024 = 0.1875."""
    x = torch.ones(1, 1024)
    m = moments(x, "textbook", acc_dtype=torch.bfloat16)
    assert m.mean.dtype == torch.bfloat16
    assert m.mean.item() == 0.25
    assert m.m2.item() == 192.0
    assert variance(x, "textbook", acc_dtype=torch.bfloat16).item() == 0.1875


@pytest.mark.parametrize("algorithm", ["welford", "pairwise", "shifted"])
def test_robust_algorithms_bf16_mean_of_ones_is_exact(algorithm):
    """Welford's delta x − M is 0 at every step; pairwise merges equal means (δ = 0); shifted sums
    x − x₁ = 0. All give M = 1 and S = 0 exactly, the true values."""
    x = torch.ones(1, 1024)
    m = moments(x, algorithm, acc_dtype=torch.bfloat16)
    assert m.mean.item() == 1.0
    assert m.m2.item() == 0.0
    assert variance(x, algorithm, acc_dtype=torch.bfloat16).item() == 0.0


@pytest.mark.parametrize("algorithm", SEQUENTIAL)
def test_chunk_equal_to_n_is_bitwise_unchunked(algorithm):
    """One chunk of n then a merge tree with a single leaf performs exactly the unchunked arithmetic."""
    x = randn(5, 48, seed=21, offset=3.0)
    a, b = moments(x, algorithm, chunk=48), moments(x, algorithm)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.m2, b.m2)


@pytest.mark.parametrize("chunk", [16, 7, 1, 200])
@pytest.mark.parametrize("algorithm", SEQUENTIAL)
def test_chunked_float32_within_bounds(algorithm, chunk):
    """n = 100 with chunk 16 (6 full + a trailing 4), 7 (14 + 2), 1 and 200 (> n, tail only).
    κ ≈ 1.4; the loosest float32 bound, textbook's n·κ²·u, times 4 (as above), covers every
    algorithm inside a chunk plus the log₂(#chunks) merge levels."""
    n = 100
    x = randn(6, n, seed=chunk, offset=1.0)
    m = moments(x, algorithm, chunk=chunk)
    assert m.count == n and m.mean.shape == (6,)
    for got_m, got_s, row in zip(m.mean.tolist(), m.m2.tolist(), rows_of(x)):
        mean, s = frac_moments(row)
        tol = 4 * n * frac_kappa(mean, s, n) ** 2 * U32
        assert rel_err(got_s, s) <= tol
        assert abs(Fraction(got_m) - mean) <= 4 * n * U32 * Fraction(sum(abs(r) for r in row) / n)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_bad_chunk_raises(chunk):
    with pytest.raises(ValueError):
        moments(torch.ones(2, 8), "welford", chunk=chunk)


def test_pairwise_with_chunk_raises():
    with pytest.raises(ValueError):
        moments(torch.ones(2, 8), "pairwise", chunk=4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_dims_reduces_over_flattened_trailing_dims(algorithm):
    x = randn(3, 4, 5, seed=8, offset=0.5)
    a = moments(x, algorithm, dims=2)
    b = moments(x.reshape(3, 20), algorithm)
    assert a.count == 20 and a.mean.shape == (3,)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.m2, b.m2)
    all_dims = moments(x, algorithm, dims=3)
    assert all_dims.count == 60 and all_dims.mean.shape == ()
    mean, s = frac_moments(x.reshape(-1).tolist())
    assert rel_err(all_dims.m2.item(), s) <= 4 * 60 * frac_kappa(mean, s, 60) ** 2 * U32  # as above


@pytest.mark.parametrize("split", [1, 7, 13])
def test_merge_moments_of_halves_equals_whole(split):
    """Chan's merge of unequal parts in float64 vs the exact moments of the whole row; κ ≈ 1.2, n = 20,
    so 4·n·κ²·u ≈ 1.5e-14 bounds both the parts and the merge step."""
    n = 20
    x = randn(4, n, seed=split, dtype=torch.float64, offset=0.7)
    merged = merge_moments(moments(x[:, :split], "welford"), moments(x[:, split:], "two_pass"))
    assert merged.count == n
    for got_m, got_s, row in zip(merged.mean.tolist(), merged.m2.tolist(), rows_of(x)):
        mean, s = frac_moments(row)
        assert rel_err(got_s, s) <= 4 * n * frac_kappa(mean, s, n) ** 2 * U64
        assert abs(Fraction(got_m) - mean) <= 4 * n * U64 * Fraction(sum(abs(r) for r in row) / n)


def test_merge_moments_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        merge_moments(moments(torch.ones(2, 4)), moments(torch.ones(3, 4)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_correction_one_matches_torch_unbiased_var(algorithm):
    """S/(n − 1) vs torch.var(unbiased) in float64: two float64 computations of a κ ≈ 1.1, n = 32
    problem, each within ~n·κ²·u ≈ 4e-15 of exact; rtol 1e-13 leaves a factor > 10."""
    x = randn(6, 32, seed=2, dtype=torch.float64, offset=0.5)
    got = variance(x, algorithm, correction=1)
    torch.testing.assert_close(got, torch.var(x, dim=-1, unbiased=True), rtol=1e-13, atol=0)
    for g, row in zip(got.tolist(), rows_of(x)):
        _, s = frac_moments(row)
        assert rel_err(g, s / 31) <= 1e-13


def test_correction_leaving_no_degrees_of_freedom_raises():
    with pytest.raises(ValueError):
        moments(torch.ones(1, 3)).var(correction=3)


# --------------------------------------------------------------------------------------------
# 3. Bad input to moments / variance / exact_moments
# --------------------------------------------------------------------------------------------


def test_unknown_algorithm_message_names_value_and_choices():
    with pytest.raises(ValueError) as info:
        moments(torch.ones(2, 4), "kahan")
    message = str(info.value)
    assert "'kahan'" in message
    assert all(a in message for a in ALGORITHMS)
    with pytest.raises(ValueError):
        variance(torch.ones(2, 4), "Welford")  # names are case-sensitive


@pytest.mark.parametrize("fn", [moments, variance, exact_moments, condition_number])
def test_integer_tensor_raises_type_error_naming_dtype(fn):
    with pytest.raises(TypeError, match="torch.int64"):
        fn(torch.ones(2, 4, dtype=torch.int64))


@pytest.mark.parametrize("fn", [moments, variance, exact_moments])
def test_non_tensor_raises_type_error(fn):
    with pytest.raises(TypeError, match="list"):
        fn([[1.0, 2.0, 3.0]])


@pytest.mark.parametrize(
    "dims, error", [(0, ValueError), (3, ValueError), (-1, ValueError), (1.0, TypeError)]
)
@pytest.mark.parametrize("fn", [moments, exact_moments])
def test_dims_out_of_range_raises(fn, dims, error):
    with pytest.raises(error, match="dims must be an int"):
        fn(torch.ones(2, 4), dims=dims)


@pytest.mark.parametrize("acc_dtype", [torch.int32, torch.bool, "float32"])
def test_non_float_acc_dtype_raises(acc_dtype):
    with pytest.raises(TypeError):
        moments(torch.ones(2, 4), acc_dtype=acc_dtype)


def test_zero_length_rows_raise():
    with pytest.raises(ValueError):
        moments(torch.ones(2, 0))


# --------------------------------------------------------------------------------------------
# 4. layer_norm
# --------------------------------------------------------------------------------------------

LN_SHAPES = [((4, 32), (32,)), ((2, 3, 16), (16,)), ((2, 3, 16), (3, 16))]


def ln_inputs(shape, normalized, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.5 + 0.3
    w = 1 + 0.3 * torch.randn(normalized, generator=g)
    b = torch.randn(normalized, generator=g)
    dy = torch.randn(shape, generator=g)
    return x, w, b, dy


@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
@pytest.mark.parametrize("shape, normalized", LN_SHAPES)
def test_layer_norm_matches_torch_forward_and_backward(shape, normalized, stats):
    """fp32 vs F.layer_norm: both are O(1) results of n ≤ 48-term reductions in different orders,
    κ ≈ 1.1, so they differ by ~n·u ≈ 3e-6 at most; atol = rtol = 1e-5 (observed ≤ 1.3e-6)."""
    x, w, b, dy = ln_inputs(shape, normalized, seed=len(shape) + len(normalized))
    ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = layer_norm(ours[0], normalized, ours[1], ours[2], 1e-5, stats=stats)
    y_ref = F.layer_norm(ref[0], normalized, ref[1], ref[2], 1e-5)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y, ours, dy)
    grads_ref = torch.autograd.grad(y_ref, ref, dy)
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_layer_norm_partial_affine_matches_torch(affine):
    x, w, b, _ = ln_inputs((3, 12), (12,), seed=9)
    w = w if affine == "weight" else None
    b = b if affine == "bias" else None
    torch.testing.assert_close(layer_norm(x, 12, w, b), F.layer_norm(x, (12,), w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        layer_norm(x, torch.Size([12]), w, b), F.layer_norm(x, (12,), w, b), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
def test_layer_norm_gradcheck_float64(stats, affine):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 2, 5, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    if affine:
        w = (1 + 0.3 * torch.randn(2, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
        b = torch.randn(2, 5, generator=g, dtype=torch.float64).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, (2, 5), w, b, stats=stats), (x, w, b))
    else:
        assert torch.autograd.gradcheck(lambda x: layer_norm(x, (5,), stats=stats), (x,))


# The OneFlow LayerNorm PR seed: two nearly equal values, so E[x²] − E[x]² cancels badly.
SEED_X = [[-1.83965693, -1.82964566]]
SEED_EXACT = 0.8454271584373886


def test_seed_exact_value_from_fraction_and_decimal():
    row = torch.tensor(SEED_X, dtype=torch.float32).double()[0].tolist()  # the fp32-rounded inputs
    out = decimal_layer_norm_row(row, 1e-5)
    assert float(out[0]) == -SEED_EXACT and float(out[1]) == SEED_EXACT
    assert out[0] + out[1] == 0  # antisymmetric for n = 2, exactly


@pytest.mark.parametrize(
    "stats, max_err, min_err", [("welford", 2e-5, 0.0), ("two_pass", 2e-5, 0.0), ("textbook", 5e-3, 2e-3)]
)
def test_seed_forward_accuracy_per_stats(stats, max_err, min_err):
    """welford / two_pass are within 2e-5 of the exact ±0.845427...; textbook's cancellation in fp32
    gives ≈ ±0.8428, an error above 2e-3."""
    y = layer_norm(torch.tensor(SEED_X), (2,), stats=stats)
    expected = torch.tensor([[-SEED_EXACT, SEED_EXACT]], dtype=torch.float64)
    err = (y.double() - expected).abs().max().item()
    assert min_err <= err <= max_err
    if stats == "textbook":
        assert y[0, 1].item() == pytest.approx(0.8428, abs=1e-4)
    # the two outputs sum to ~0: each is within max_err of ±exact
    assert abs(y.sum().item()) <= 2 * max_err


@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
def test_seed_gradient_of_sum_is_rounding_noise(stats):
    """Σ LayerNorm(x) ≡ 0 without affine, so its exact gradient is 0. In fp32 the computed mean of
    x̂ is off by ~rstd·ulp(1.83)/2 ≈ 1e-5, giving |dx| ≈ rstd·|x̂|·1e-5 ≈ 1.4e-3 (Paddle printed
    ±0.00143835); in float64 the same mechanism gives ~1e-12."""
    x = torch.tensor(SEED_X, requires_grad=True)
    layer_norm(x, (2,), stats=stats).sum().backward()
    assert x.grad.abs().max().item() < 2e-3
    x64 = torch.tensor(SEED_X, dtype=torch.float64, requires_grad=True)
    layer_norm(x64, (2,), stats=stats).sum().backward()
    assert x64.grad.abs().max().item() < 1e-9


@pytest.mark.parametrize("case", ["seed", "random", "random_2d", "eps0"])
def test_exact_layer_norm_matches_decimal_reference(case):
    eps = 1e-5
    if case == "seed":
        x, ns = torch.tensor(SEED_X), (2,)
    elif case == "random":
        x, ns = randn(2, 7, seed=5, offset=3.0), (7,)
    elif case == "random_2d":
        x, ns = randn(2, 3, 4, seed=6), (3, 4)
    else:
        x, ns, eps = randn(1, 6, seed=7, scale=1e-3), (6,), 0.0
    got = exact_layer_norm(x, ns, eps)
    assert got.dtype == torch.float64 and got.shape == x.shape
    n = math.prod(ns)
    flat = x.double().reshape(-1, n).tolist()
    # Both sides round a ≥ 50-digit value to float64, so they agree to the last bit.
    expected = [[float(d) for d in decimal_layer_norm_row(row, eps)] for row in flat]
    assert got.reshape(-1, n).tolist() == expected


def test_layer_norm_shape_mismatch_message_has_both_shapes():
    with pytest.raises(ValueError) as info:
        layer_norm(torch.ones(2, 3, 5), (4,))
    assert "(4,)" in str(info.value) and "(5,)" in str(info.value)
    with pytest.raises(ValueError) as info:
        layer_norm(torch.ones(2, 3, 5), (2, 5))
    assert "(2, 5)" in str(info.value) and "(3, 5)" in str(info.value)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_layer_norm_affine_of_wrong_shape(which):
    kwargs = {which: torch.ones(4)}
    with pytest.raises(ValueError, match=which):
        layer_norm(torch.ones(2, 5), (5,), **kwargs)


def test_layer_norm_integer_input_raises_type_error():
    with pytest.raises(TypeError, match="torch.int32"):
        layer_norm(torch.ones(2, 5, dtype=torch.int32), (5,))


def test_layer_norm_unknown_stats_lists_valid_names():
    with pytest.raises(ValueError) as info:
        layer_norm(torch.ones(2, 5), (5,), stats="pairwise")
    assert "'pairwise'" in str(info.value)
    assert all(s in str(info.value) for s in LAYER_NORM_STATS)


@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
@pytest.mark.parametrize("acc_dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_half_statistics_are_moments_rounded_in_that_dtype(stats, acc_dtype):
    """16-bit accumulation covers the statistics only: M and S/n are ``moments`` in 16-element chunks,
    every step rounded to acc_dtype; the normalization runs in float32 — the same operations here."""
    x, w, b, _ = ln_inputs((6, 64), (64,), seed=21)
    m = moments(x, stats, acc_dtype=acc_dtype, chunk=16)
    mean, var = m.mean.float(), m.var().float().clamp_min(0)
    expected = (x - mean[:, None]) * torch.rsqrt(var + 1e-5)[:, None] * w + b
    assert torch.equal(layer_norm(x, (64,), w, b, stats=stats, acc_dtype=acc_dtype), expected)


def test_bf16_textbook_statistics_fail_where_welford_holds():
    """Against the exact moments of the same (bf16-representable) rows: at κ ≈ 1 every formula's
    bf16 variance is within a few bf16 ulps (median relative error < 0.01; measured 0.0023); at a
    common offset of 30 (κ ≈ 30) textbook's E[X²] − E[X]² loses everything (measured: error 3.1)
    while Welford keeps the variance to a few percent (measured 0.016)."""
    generator = torch.Generator().manual_seed(0)
    for offset, textbook_low, welford_high in ((0.0, 0.0, 0.01), (30.0, 0.5, 0.05)):
        x = (offset + torch.randn(256, 64, generator=generator)).bfloat16().float()
        _, exact_var = exact_moments(x)
        errors = {}
        for stats in ("textbook", "welford"):
            var = moments(x, stats, acc_dtype=torch.bfloat16, chunk=16).var().double()
            errors[stats] = ((var - exact_var.double()).abs() / exact_var.double()).median().item()
        assert errors["welford"] < welford_high and errors["textbook"] >= textbook_low, errors
        y = layer_norm(x, (64,), stats="welford", acc_dtype=torch.bfloat16)
        torch.testing.assert_close(y, F.layer_norm(x, (64,)), rtol=0, atol=0.5 if offset else 0.05)


def test_layer_norm_with_bf16_statistics_has_float32_gradients():
    """The backward is the analytic one in float32 with the (bf16-accumulated) mean and rstd: at κ ≈ 1
    the gradients match float64 autograd to the statistics' bf16 error (a few 1e-3 relative)."""
    x, w, b, dy = ln_inputs((8, 64), (64,), seed=22)
    ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = layer_norm(ours[0], (64,), ours[1], ours[2], stats="textbook", acc_dtype=torch.bfloat16)
    assert y.dtype == torch.float32
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    ref_grads = torch.autograd.grad(F.layer_norm(ref[0], (64,), ref[1], ref[2]), ref, dy.double())
    for g, r in zip(torch.autograd.grad(y, ours, dy), ref_grads):
        assert g.dtype == torch.float32
        assert (g.double() - r).abs().max().item() <= 0.05 * r.abs().max().item()


@pytest.mark.parametrize("eps", [-1e-5, math.nan])
def test_layer_norm_bad_eps(eps):
    with pytest.raises(ValueError):
        layer_norm(torch.ones(2, 5), (5,), eps=eps)


@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_layer_norm_half_inputs(dtype, stats):
    """Both qlab and torch compute in fp32 and round the O(1) result once to the half type; the fp32
    values differ by ~1e-6, so the rounded outputs differ by at most one half ulp ≤ 2u·|y|
    (plus an absolute u for tiny |y|). Gradients come back in the parameters' dtypes."""
    x, w, b, dy = ln_inputs((4, 32), (32,), seed=3)
    x, w, b, dy = (t.to(dtype) for t in (x, w, b, dy))
    ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = layer_norm(ours[0], (32,), ours[1], ours[2], stats=stats)
    assert y.dtype == dtype
    u = unit_roundoff(dtype)
    torch.testing.assert_close(y, F.layer_norm(x, (32,), w, b), rtol=2 * u, atol=u)
    grads = torch.autograd.grad(y, ours, dy)
    assert [g.dtype for g in grads] == [dtype] * 3
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    ref_grads = torch.autograd.grad(F.layer_norm(ref[0], (32,), ref[1], ref[2]), ref, dy.double())
    for g, r in zip(grads, ref_grads):
        # The reference is float64 autograd on the very same half values, so the only differences are
        # qlab's fp32 arithmetic (~n·2^-24, negligible) and the final rounding to the half type
        # (≤ u·|g|): 4u of the largest entry bounds both with room to spare.
        assert (g.double() - r).abs().max().item() <= 4 * u * r.abs().max().item()


@pytest.mark.parametrize("req", [(x, w, b) for x in (0, 1) for w in (0, 1) for b in (0, 1)])
def test_every_requires_grad_combination(req):
    """Gradients exist exactly for the tensors that require them and match F.layer_norm's."""
    x, w, b, dy = ln_inputs((3, 8), (8,), seed=12)
    ours = [t.clone().requires_grad_(bool(r)) for t, r in zip((x, w, b), req)]
    ref = [t.clone().requires_grad_(bool(r)) for t, r in zip((x, w, b), req)]
    y = layer_norm(ours[0], (8,), ours[1], ours[2])
    y_ref = F.layer_norm(ref[0], (8,), ref[1], ref[2])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert y.requires_grad == any(req)
    if not any(req):
        return
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for o, r, flag in zip(ours, ref, req):
        if flag:
            torch.testing.assert_close(o.grad, r.grad, rtol=1e-5, atol=1e-5)  # as in the test above
        else:
            assert o.grad is None


def test_layer_norm_output_sums_to_zero_per_row():
    """Without affine, Σᵢ (xᵢ − M)·rstd = 0; float64 rounding leaves ≲ n·u·max|y| ≈ 1e-14."""
    x = randn(4, 24, seed=13, dtype=torch.float64, offset=2.0)
    for stats in LAYER_NORM_STATS:
        assert layer_norm(x, (24,), stats=stats).sum(dim=-1).abs().max().item() < 1e-13


# --------------------------------------------------------------------------------------------
# 5. check_layer_norm_grads
# --------------------------------------------------------------------------------------------


class _DoubleGrad(torch.autograd.Function):
    """Identity forward, backward multiplies the incoming gradient by 2."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def layer_norm_doubled_input_grad(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(_DoubleGrad.apply(x), normalized_shape, weight, bias, eps)


def test_check_passes_for_torch_layer_norm():
    result = check_layer_norm_grads(F.layer_norm)
    assert result.ok and result.wrong == []
    assert list(result.table["quantity"]) == ["output", "d_input", "d_weight", "d_bias"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stats", LAYER_NORM_STATS)
def test_check_passes_for_qlab_layer_norm(stats, dtype):
    result = check_layer_norm_grads(lambda *a: layer_norm(*a, stats=stats), dtype=dtype)
    assert result.ok, result.table


def test_check_flags_swapped_affine_grads():
    result = check_layer_norm_grads(layer_norm_swapped_affine_grads)
    assert not result.ok
    assert result.wrong == ["d_weight", "d_bias"]
    assert "swapped" in result.diagnosis
    assert "forward is correct" in result.diagnosis  # the exhibit's forward is the real LayerNorm


def test_check_flags_doubled_input_grad_without_calling_it_swapped():
    # sanity of the exhibit itself, against autograd through torch: d_input is exactly doubled
    x = torch.randn(2, 6, requires_grad=True)
    (dx_bad,) = torch.autograd.grad(layer_norm_doubled_input_grad(x, (6,)).square().sum(), x)
    (dx_ok,) = torch.autograd.grad(F.layer_norm(x, (6,)).square().sum(), x)
    assert torch.equal(dx_bad, 2 * dx_ok)

    result = check_layer_norm_grads(layer_norm_doubled_input_grad)
    assert not result.ok
    assert result.wrong == ["d_input"]
    assert "d_input" in result.diagnosis and "swapped" not in result.diagnosis


def test_check_rejects_non_callable():
    with pytest.raises(TypeError):
        check_layer_norm_grads("layer_norm")


def test_reference_layer_norm_matches_torch_float64():
    """The checker's own reference, against F.layer_norm in float64 (κ ≈ 1, n = 16: ~1e-15)."""
    x, w, b, _ = ln_inputs((3, 16), (16,), seed=4)
    x, w, b = x.double(), w.double(), b.double()
    torch.testing.assert_close(
        qn.reference_layer_norm(x, (16,), w, b), F.layer_norm(x, (16,), w, b), rtol=1e-13, atol=1e-13
    )


def test_norm_input_conditions_by_hand():
    # rows fed to the LayerNorm: [1, 3] (mean 2, σ 1: κ = √5), [5, 5] (σ 0: κ = inf) and [-1, 1]
    # (mean 0: κ = 1); the RMSNorm-named module (it sees the LayerNorm's output) is found by its name
    from qlab.numerics import norm_input_conditions

    class TinyRMSNorm(torch.nn.Module):
        def forward(self, x):
            return x

    model = torch.nn.Sequential(torch.nn.LayerNorm(2), TinyRMSNorm())
    x = torch.tensor([[1.0, 3.0], [5.0, 5.0], [-1.0, 1.0]])
    frame = norm_input_conditions(model, lambda: model(x))
    assert frame.layer.tolist() == ["0", "1"] and frame.kind.tolist() == ["LayerNorm", "RMSNorm"]
    row = frame.iloc[0]
    assert row.rows == 3 and row.kappa_median == pytest.approx(math.sqrt(5), rel=1e-15)
    assert row.kappa_max == math.inf
    assert row.bf16_textbook_fraction == pytest.approx(2 / 3) and row.fp32_textbook_fraction == pytest.approx(
        1 / 3
    )
    assert not model[0]._forward_pre_hooks  # hooks removed
    with pytest.raises(ValueError, match="no LayerNorm or RMSNorm"):
        norm_input_conditions(torch.nn.Linear(2, 2), lambda: None)
    # the input given by keyword is the same rows; a call with no rows adds none
    by_keyword = norm_input_conditions(model, lambda: (model[0](input=x), model[0](torch.zeros(0, 2))))
    assert by_keyword.rows.tolist() == [3] and by_keyword.kappa_median.tolist() == [row.kappa_median]


def test_stats_layer_norms_replace_every_layer_norm_and_share_its_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16)
    before = model(x)
    weight = model[0].weight
    assert qn.use_stats_layer_norms(model, "welford") == ["0", "2"]
    assert isinstance(model[0], qn.StatsLayerNorm) and model[0].weight is weight
    # the same formula (Welford in float32 chunks against torch's): equal to a few float32 ulps
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)
    assert "stats=welford" in repr(model[0])
    qn.use_stats_layer_norms(model, "textbook", torch.bfloat16)  # a StatsLayerNorm is not swapped again
    assert model[0].stats == "welford"


def test_training_with_bf16_textbook_layer_norm_statistics():
    from qlab.train import TrainConfig, build_model, train

    config = TrainConfig(layer_norm="textbook", layer_norm_acc="bf16", layers=1, width=32, context=16,
                         batch_size=4, steps=2, eval_every=2, eval_batches=1, progress=False)  # fmt: skip
    model = build_model(config, 40)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 3 and all(
        type(m) is qn.StatsLayerNorm and m.acc_dtype == torch.bfloat16 for m in norms
    )
    assert math.isfinite(train(config).metrics.val_loss.iloc[-1])
    with pytest.raises(ValueError, match="layer_norm 'welfrd'"):
        TrainConfig(layer_norm="welfrd")
    with pytest.raises(ValueError, match="layer_norm_acc='bf16' applies to qlab's LayerNorm"):
        TrainConfig(layer_norm_acc="bf16")
