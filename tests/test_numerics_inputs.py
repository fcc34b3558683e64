"""Moments at the edges of their dtypes, and what numerics and the noise kernel refuse: each against
float64, exact arithmetic or the torch module it replaces."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qlab import numerics as N
from qlab.kernels import noise as Z

LONG = 2**18  # float16's nA·nB/n of the last merge, about LONG/4, passes its largest finite 65504


@pytest.mark.parametrize("algorithm, chunk", [("pairwise", None), ("welford", 16), ("textbook", 16)])
def test_float16_moments_of_rows_longer_than_its_count_weights(algorithm, chunk):
    options = {} if chunk is None else {"chunk": chunk}
    constant = torch.ones(1, LONG, dtype=torch.float16)
    assert N.variance(constant, algorithm, **options).item() == 0.0
    # 0 and 1/4 alternating: variance 1/64, and S = n/64 = 4096 stays finite in float16
    alternating = torch.arange(LONG).remainder(2).div(4).to(torch.float16).reshape(1, LONG)
    got = N.variance(alternating, algorithm, **options).double().item()
    # 18 merge levels, each rounding once to float16 (u = 2^-11): a relative error within 18u
    assert abs(got - 1 / 64) <= 18 * 2**-11 / 64, got


def test_a_float16_layer_norm_of_a_long_constant_row_is_torchs():
    x = torch.full((1, LONG), 3.0)
    out = N.layer_norm(x, LONG, acc_dtype=torch.float16)
    assert torch.equal(out, F.layer_norm(x, (LONG,)))  # all zeros: the row minus its mean


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_neither_an_input_nor_an_accumulator_of_moments(dtype):
    with pytest.raises(TypeError, match=f"x must be a floating-point tensor .*got {dtype}"):
        N.variance(torch.zeros(2, 4).to(dtype))
    with pytest.raises(
        TypeError, match=f"acc_dtype must be float16, bfloat16, float32 or float64, got {dtype}"
    ):  # noqa: E501
        N.variance(torch.zeros(2, 4), acc_dtype=dtype)


def test_exact_moments_beyond_float64s_range_are_infinite_as_torch_var_gives():
    x = torch.tensor([[-1e308, 1e308]], dtype=torch.float64)
    mean, var = N.exact_moments(x)
    assert mean.item() == 0.0 and var.item() == torch.var(x, correction=0).item() == float("inf")
    assert N.condition_number(x).item() == 1.0  # √(1 + 0/inf)


def test_norm_input_conditions_take_a_layer_norms_rows_over_all_its_normalized_dims():
    model = nn.Sequential(nn.LayerNorm((4, 8)))
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    x = x + torch.arange(4.0).mul(10).view(1, 4, 1)  # offsets that differ within each normalized block
    table = N.norm_input_conditions(model, lambda: model(x))
    kappas = N.condition_number(x, dims=2)  # exact moments over the 32 elements each row normalizes
    assert table.rows.item() == 3
    assert table.kappa_max.item() == pytest.approx(kappas.max().item(), rel=1e-12)  # float64 against exact


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_swapped_layer_norms_say_what_parameters_they_hold(affine, bias):
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=affine, bias=bias))
    original = model[0]
    N.use_stats_layer_norms(model, "welford")
    swapped = model[0]
    assert (swapped.elementwise_affine, swapped.bias is not None) == (affine, bias)
    assert swapped.weight is original.weight and swapped.bias is original.bias  # shared, not copied
    if affine:
        swapped.weight.data.fill_(3.0)
        swapped.reset_parameters()  # as nn.LayerNorm does: the weight back to ones
        assert torch.equal(original.weight, torch.ones(8))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(swapped(x), original(x), rtol=0, atol=1e-6)  # summation orders differ


def test_drawn_noise_names_an_unknown_or_dead_source_and_a_shape_that_is_not_one():
    class Owner:
        def generator_for(self, device):
            return torch.Generator().manual_seed(0)

    owner = Owner()
    key = Z.register_noise_source(owner.generator_for)
    assert Z.drawn_noise(key, [(2,)], torch.zeros(1))[0].shape == (2,)
    with pytest.raises(TypeError, match="each shape must be a tuple of ints, got 3"):
        Z.drawn_noise(key, [3], torch.zeros(1))
    with pytest.raises(TypeError, match="shapes must be a list of shapes"):
        Z.drawn_noise(key, (2,)[0], torch.zeros(1))
    del owner
    gc.collect()
    for source in (key, torch.tensor(10**9)):
        with pytest.raises(ValueError, match=f"source {int(source)} is not a registered noise source"):
            Z.drawn_noise(source, [(2,)], torch.zeros(1))
