"""qlab.ablation (notebook 07) against hand-computed cases and torch's own float8 casts."""

from __future__ import annotations

import pytest
import torch

from qlab import ablation
from qlab.recipe import ROLES, get_recipe


@pytest.fixture(autouse=True)
def eager_only(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")


# --- qlab.ablation ------------------------------------------------------------------------------------


def _specs(recipe):
    return [getattr(recipe, role) for role in ROLES if getattr(recipe, role) is not None]


def test_each_ablation_switches_off_exactly_its_ingredient():
    nvfp4 = ablation.ablations("nvfp4")
    assert list(nvfp4) == ["nvfp4", "no 2D weight", "no SR", "no RHT", "none"]
    full = nvfp4["nvfp4"]
    assert any(s.rounding == "stochastic" for s in _specs(full)) and any(s.hadamard for s in _specs(full))
    assert (
        nvfp4["no 2D weight"].weight.block_2d is False
        and nvfp4["no 2D weight"].grad_output == full.grad_output
    )
    assert all(s.rounding == "rne" for s in _specs(nvfp4["no SR"])) and nvfp4["no SR"].weight == full.weight
    assert (
        not any(s.hadamard for s in _specs(nvfp4["no RHT"]))
        and nvfp4["no RHT"].grad_output == full.grad_output
    )
    none = nvfp4["none"]
    assert not any(s.hadamard or s.rounding == "stochastic" or s.block_2d for s in _specs(none))
    mxfp4 = ablation.ablations("mxfp4_training")
    assert list(mxfp4) == ["mxfp4_training", "no SR", "no RHT", "none"]
    with pytest.raises(ValueError, match="preset"):
        ablation.ablations("fp8_tensorwise")


def test_gemm_errors_of_an_unquantized_layer_are_float32_rounding():
    x, w, dy = ablation.synthetic_operands(64, 48, 32)
    errors = ablation.gemm_errors(get_recipe("bf16", backward_override=None), x, w, dy)
    assert set(errors) == {"fprop", "dgrad", "wgrad"}
    assert all(e < 1e-6 for e in errors.values())  # float32 GEMMs against float64: ~√K · 2^-24


def test_gemm_errors_of_fp8_tensorwise_equal_torch_float8_operands_in_float64():
    # independent reference: each operand cast by torch's own float8 dtype with TE's scale 448/amax (E4M3)
    # or 57344/amax (E5M2), dequantized with fl(1/scale), multiplied in float64
    x, w, dy = ablation.synthetic_operands(64, 48, 32, seed=3)

    def fp8(t, dtype):
        scale = torch.finfo(dtype).max / t.abs().amax().double()
        scale = scale.float()
        return (t * scale).to(dtype).double() * (1.0 / scale.double()).float().double()

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    exact = {
        "fprop": x.double() @ w.double().T,
        "dgrad": dy.double() @ w.double(),
        "wgrad": dy.double().T @ x.double(),
    }
    expected = {
        "fprop": fp8(x, e4m3) @ fp8(w, e4m3).T,
        "dgrad": fp8(dy, e5m2) @ fp8(w, e4m3),
        "wgrad": fp8(dy, e5m2).T @ fp8(x, e4m3),
    }
    errors = ablation.gemm_errors(get_recipe("fp8_tensorwise", backward_override=None), x, w, dy)
    for gemm in ablation.GEMMS:
        reference = float((expected[gemm] - exact[gemm]).norm() / exact[gemm].norm())
        # the layer multiplies in float32 (relative ~1e-6 of the product), the reference in float64
        assert errors[gemm] == pytest.approx(reference, rel=1e-3), gemm
        assert errors[gemm] > 0.01  # E4M3/E5M2 operands: percent-level GEMM error, not rounding noise


def test_gemm_errors_refuse_shapes_that_do_not_chain():
    x, w, dy = ablation.synthetic_operands(16, 8, 4)
    with pytest.raises(ValueError, match="do not chain"):
        ablation.gemm_errors("fp8_tensorwise", x, w, dy.T)
    with pytest.raises(ValueError, match="2-D"):
        ablation.gemm_errors("fp8_tensorwise", x[None], w, dy)


def test_capture_operands_records_what_each_linear_saw():
    # y = relu(x A^T) B^T, loss = sum(y): the second layer's dy is all ones, the first layer's dy is
    # (ones @ B) masked by relu' — computed by hand here
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5, bias=False), torch.nn.ReLU(), torch.nn.Linear(5, 3, bias=False)
    )
    x = torch.randn(2, 4, 6)

    def step():
        model(x).sum().backward()

    captured = ablation.capture_operands(model, step)
    assert set(captured) == {"0", "2"}
    x0, w0, dy0 = captured["0"]
    assert torch.equal(x0, x.reshape(8, 6)) and torch.equal(w0, model[0].weight)
    hidden = x.reshape(8, 6) @ model[0].weight.T
    x2, w2, dy2 = captured["2"]
    assert torch.equal(x2, hidden.relu()) and torch.equal(dy2, torch.ones(8, 3))
    assert torch.allclose(dy0, (torch.ones(8, 3) @ model[2].weight) * (hidden > 0), rtol=0, atol=1e-6)
    assert set(ablation.capture_operands(model, step, skip=("2",))) == {"0"}
    assert set(ablation.capture_operands(model, step, only=["2"])) == {"2"}
    with pytest.raises(ValueError, match="only"):
        ablation.capture_operands(model, step, only=["1"])  # the ReLU is not a Linear
    assert not model[0]._forward_pre_hooks and not model[0]._backward_hooks  # hooks removed


def test_switched_off_names_the_ingredients_of_a_variant_label():
    assert ablation.switched_off("nvfp4", "") == []
    assert ablation.switched_off("nvfp4", "no RHT") == ["hadamard"]
    assert ablation.switched_off("nvfp4", "none") == ["2d_weight", "stochastic_rounding", "hadamard"]
    assert ablation.switched_off("mxfp4_training", "none") == ["stochastic_rounding", "hadamard"]
    with pytest.raises(ValueError, match="no variant 'no 2D weight'"):
        ablation.switched_off("mxfp4_training", "no 2D weight")  # it has no 2-D weight tiles to remove


def test_with_scale_mode_changes_only_the_mx_specs_scale_mode():
    import dataclasses

    from qlab.quantize import MXSpec, clipped_block_fraction

    floor = get_recipe("mxfp4_training", backward_override=None)
    rceil = ablation.with_scale_mode(floor, "rceil")
    assert rceil.name == "mxfp4_training, RCEIL scales"
    for role in ROLES:
        before, after = getattr(floor, role), getattr(rceil, role)
        if isinstance(before, MXSpec):  # the mode changed, every other field kept
            assert after == dataclasses.replace(before, mode="rceil") and before.mode == "floor"
        else:
            assert after == before
    nvfp4 = get_recipe("nvfp4", backward_override=None)
    assert ablation.with_scale_mode(nvfp4, "rceil").replace(name="nvfp4") == nvfp4  # no MX spec
    # amax 56 = 1.75·2⁵: FLOOR's scale 2^(5 − emax 2) = 8 puts it at 7, past E2M1's 6 (saturated);
    # RCEIL's scale 2^⌈log₂(56/6)⌉ = 16 puts it at 3.5
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 56.0
    assert clipped_block_fraction(x, floor.dgrad_weight) == 1.0
    assert clipped_block_fraction(x, rceil.dgrad_weight) == 0.0
    with pytest.raises(ValueError, match="mode"):
        ablation.with_scale_mode(floor, "round")
