"""qlab.seed_model: the seed's quantized Linear as written and corrected, against hand formulas.

The reference quantizer here is written out in the test: s = amax/127, q = round(v/s) in float32.
"""

import pytest
import torch

from qlab import seed_model
from qlab.probes import GradientAudit, ProbeSet
from qlab.seed_model import SeedLinear, SeedQuantizerFunction, SeedTransformer, permutation_task_batch


def int8(v):
    scale = v.abs().max() / 127
    return torch.round(v / scale), scale


def layer_and_grads(mode, seed=0):
    torch.manual_seed(seed)
    layer = SeedLinear(16, 8, mode=mode)
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(2, 5, 8)
    y = layer(x)
    y.backward(g)
    return layer, x, g, y


def test_forward_is_the_dequantized_product():
    layer, x, _, y = layer_and_grads("corrected")
    q_x, s_x = int8(x.detach().reshape(10, 16))
    q_w, s_w = int8(layer.weight.detach())
    expected = (q_x @ q_w.T) * (s_x * s_w) + layer.bias.detach()
    assert torch.equal(y.detach().reshape(10, 8), expected)


def test_corrected_backward_is_the_straight_through_estimator():
    layer, x, g, _ = layer_and_grads("corrected")
    q_x, s_x = int8(x.detach().reshape(10, 16))
    q_w, s_w = int8(layer.weight.detach())
    q_g, s_g = int8(g.reshape(10, 8))
    assert torch.equal(layer.weight.grad, (q_g.T @ q_x) * (s_g * s_x))
    assert torch.equal(x.grad.reshape(10, 16), (q_g @ q_w) * (s_g * s_w))
    # and that is ĝᵀ·x̂ up to float32 reassociation of the scale products (rtol 1e-6)
    torch.testing.assert_close(layer.weight.grad, (q_g * s_g).T @ (q_x * s_x), rtol=1e-6, atol=0)


def test_as_written_backward_is_off_by_the_scales():
    written, x_w, _, _ = layer_and_grads("as_written")
    corrected, _, _, _ = layer_and_grads("corrected")
    _, s_x = int8(x_w.detach().reshape(10, 16))
    _, s_w = int8(written.weight.detach())
    # raw x ≈ q_x·s_x, so the written wgrad ≈ corrected·s_x (within int8 rounding of x: 2 %)
    ratio = written.weight.grad.norm() / corrected.weight.grad.norm()
    assert ratio.item() == pytest.approx(s_x.item(), rel=0.02)
    assert s_x.item() < 0.05 and s_w.item() < 0.05  # a 20×+ error, yet (see notebook 01) training proceeds


def test_the_inner_quantizer_backward_never_runs():
    SeedQuantizerFunction.backward_calls = 0
    model = SeedTransformer(width=32, depth=1, tokens=8)
    x, y = permutation_task_batch(2, 8, 32, torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    assert SeedQuantizerFunction.backward_calls == 0
    assert all(p.grad is not None for p in model.parameters())


def test_probes_inside_the_custom_backward_are_recorded():
    model = SeedTransformer(width=32, depth=1, tokens=8)
    x, y = permutation_task_batch(2, 8, 32, torch.Generator().manual_seed(0))
    with ProbeSet(model, modules=["head"], roles=("probe",), stats=("l2",)) as probes:
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    names = set(probes.to_frame().module)
    assert "blocks.0.fc1.weight.grad_inside" in names and "blocks.0.qkv.grad_output" in names


@pytest.mark.parametrize("mode, flagged", [("corrected", False), ("as_written", True)])
def test_audit_explains_the_loss_scale_and_flags_the_written_bug(mode, flagged, monkeypatch):
    torch.manual_seed(0)
    layer = SeedLinear(16, 8, mode=mode, name="layer")
    model = torch.nn.Sequential(layer)
    audit = GradientAudit(model, hook_parameters=False)
    # the corrected Function's "inside" wgrad is exactly what it returns: observe it as a probe would
    original = seed_model.SeedLinearFunction.backward

    def observing_backward(ctx, g):
        grads = original(ctx, g)
        x_saved, s_x, _, _ = ctx.saved_tensors
        q_g, s_g = seed_model.seed_quantize(g.reshape(-1, g.shape[-1]), ctx.bits)
        q_x = x_saved if mode == "corrected" else torch.round(x_saved / s_x)  # what the STE needs
        audit.observe("0.weight", (q_g.T @ q_x) * (s_g * s_x))
        return grads

    monkeypatch.setattr(seed_model.SeedLinearFunction, "backward", staticmethod(observing_backward))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with audit:
        scaler.scale(model(torch.randn(4, 16)).pow(2).sum()).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    report = audit.report(loss_scale=scaler.get_scale(), tolerance=1e-5).set_index("parameter")
    assert bool(report.flagged["0.weight"]) is flagged
