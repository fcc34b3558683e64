"""qlab.synthetic distributions and the measurement helpers sqnr_db / clipped_block_fraction.

Expected values come from closed forms (distribution quantiles, exact decibel arithmetic) or from
blocks built by hand whose scales follow from the MX / NVFP4 definitions in docs/reference.md.
"""

import math

import pytest
import torch

from qlab import quantize as Q
from qlab import synthetic

N = 400_000


@pytest.mark.parametrize(
    "kind, median_abs",
    [
        ("gaussian", 0.6744897501960817),  # Φ⁻¹(0.75)
        ("laplace", math.log(2) / math.sqrt(2)),  # b·ln 2 with b = 1/√2 (unit variance)
        ("student_t3", 0.7648923284937),  # t₃ quantile at 0.75
    ],
)
def test_distributions_match_their_published_quantiles(kind, median_abs):
    x = synthetic.activations(kind, (N,), torch.Generator().manual_seed(0))
    # the sample median of |x| has standard error ≈ 1/(2 f(m) √N) < 2e-3 here; allow 4 of them
    assert abs(x.abs().median().item() - median_abs) < 8e-3


def test_laplace_and_gaussian_have_unit_variance():
    for kind in ("gaussian", "laplace"):
        x = synthetic.activations(kind, (N,), torch.Generator().manual_seed(1)).double()
        # Var of the sample variance is (κ − 1)/N with kurtosis κ = 3 or 6: SE < 4e-3; allow 5 SE
        assert abs(x.var().item() - 1.0) < 0.02


def test_outlier_channels_scale_exactly_the_chosen_columns():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = synthetic.activations("outlier_channels", (50, 9), g1, outlier_channels=3, outlier_scale=100.0)
    base = torch.randn((50, 9), generator=g2)
    assert torch.equal(x[:, [0, 4, 8]], base[:, [0, 4, 8]] * 100) and torch.equal(
        x[:, [1, 2, 3, 5, 6, 7]], base[:, [1, 2, 3, 5, 6, 7]]
    )


def test_same_seed_same_bytes_and_bad_kind():
    a = synthetic.activations("student_t3", (7, 5), torch.Generator().manual_seed(9))
    b = synthetic.activations("student_t3", (7, 5), torch.Generator().manual_seed(9))
    assert a.dtype == torch.float32 and torch.equal(a, b)
    with pytest.raises(ValueError, match="expected one of: gaussian"):
        synthetic.activations("cauchy", (3,), torch.Generator())
    with pytest.raises(ValueError, match=r"outlier_channels must be in \[0, 4\]"):
        synthetic.activations("outlier_channels", (2, 4), torch.Generator(), outlier_channels=5)


def test_sqnr_db_is_ten_log10_of_the_power_ratio():
    x = torch.ones(1000)
    # an error of 2^-4 on every element: noise/signal = 2^-8, so SQNR = 80·log10(2) dB
    assert Q.sqnr_db(x, x * (1 + 2**-4)) == pytest.approx(80 * math.log10(2), rel=1e-12)
    assert Q.sqnr_db(x, x) == math.inf


def test_mx_clipping_counts_blocks_that_saturate():
    # E4M3 FLOOR: amax 480 → X = 2^(8−8) = 1 and 480 > 448 clips; amax 448 and 300 do not
    x = torch.zeros(3, 32)
    x[0, 5], x[1, 7], x[2, 0] = 480.0, 448.0, -300.0
    assert Q.clipped_block_fraction(x, Q.MXSpec("e4m3", mode="floor")) == pytest.approx(1 / 3)
    assert Q.clipped_block_fraction(x, Q.MXSpec("e4m3", mode="rceil")) == 0.0  # RCEIL never saturates


def test_nvfp4_clipping_when_the_block_scale_rounds_down():
    # single-level NVFP4: scale = E4M3(amax / 6). 6.375/6 = 1.0625 is a tie between 1 and 1.125 → 1 (even),
    # so 6.375 / 1 > 6 clips; 6.75/6 = 1.125 is exact and does not
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 6.375, 6.75
    assert Q.clipped_block_fraction(x, Q.NVFP4Spec(global_scale=False)) == pytest.approx(0.5)


def test_clipping_is_only_for_block_formats():
    with pytest.raises(ValueError, match="block spec .MXSpec, NVFP4Spec, BlockwiseSpec"):
        Q.clipped_block_fraction(torch.ones(4, 32), "fp8_e4m3")


def test_laplace_is_finite_even_when_the_uniform_draw_is_zero(monkeypatch):
    zeros = lambda shape, generator=None, dtype=None: torch.zeros(shape, dtype=dtype)  # noqa: E731
    monkeypatch.setattr(torch, "rand", zeros)
    assert torch.isfinite(synthetic.activations("laplace", (4,), torch.Generator())).all()
