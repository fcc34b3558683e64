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


def test_fp16_matmul_rounds_operands_and_result_to_fp16_and_accumulates_wider():
    # 1 + 2⁻¹² is not an fp16 value (11 significant bits): the operand rounds to 1 first
    a = torch.tensor([[1 + 2.0**-12, 1.0]])
    b = torch.tensor([[3.0], [2.0**-12]])
    # fp32 accumulation keeps 3 + 2⁻¹²; the fp16 result then rounds it to 3 (spacing at 3 is 2⁻⁹)
    assert seed_model.fp16_matmul(a, b).item() == 3.0 and seed_model.fp16_matmul(a, b).dtype == torch.float16
    # 3000 ones sum to 3000 in fp32, an fp16 value; an fp16 accumulator would stall at 2048 (2048 + 1
    # rounds back to 2048)
    ones = torch.ones(1, 3000)
    assert seed_model.fp16_matmul(ones, torch.ones(3000, 1)).item() == 3000.0  # 3000 is an fp16 value
    # beyond fp16's largest finite value 65504 the result is inf, as the grid products of section 5 show
    big = torch.full((1, 256), 127.0)
    assert seed_model.fp16_matmul(big, big.T).item() == float("inf")


def test_fp16_layer_gradients_are_the_corrected_formula_through_fp16_gemms():
    torch.manual_seed(0)
    layer = SeedLinear(16, 8, mode="corrected", fp16=True)
    x = torch.randn(10, 16, requires_grad=True)
    g = torch.randn(10, 8)
    layer(x).backward(g)
    q_x, s_x = int8(x.detach())
    q_w, s_w = int8(layer.weight.detach())
    q_g, s_g = int8(g)
    half = lambda t: t.half().float()  # noqa: E731
    expected_dw = half(half(q_g).T @ half(q_x)) * (s_g * s_x)
    expected_dx = half(half(q_g) @ half(q_w)) * (s_g * s_w)
    # grid values are integers ≤ 127 (exact in fp16); the products sum exactly in fp32; the fp16
    # result and its scaling by s_g·s_x in fp16 round twice: compare in fp16's precision (rtol 2⁻¹⁰)
    assert torch.allclose(layer.weight.grad, expected_dw, rtol=2**-10, atol=0)
    assert torch.allclose(x.grad, expected_dx, rtol=2**-10, atol=0)


def test_seed_setting_fp16_trains_without_the_audit():
    run = seed_model.train(
        "corrected",
        "adam",
        3,
        loss_scale=2.0**10,
        precision="fp16",
        bits=6,
        audit=False,
        width=32,
        depth=1,
        tokens=8,
        batch=4,
        eps=1e-16,
    )
    assert run.loss.notna().all() and run.audit_unexplained.isna().all()
    assert ((run.zero_grad_fraction >= 0) & (run.zero_grad_fraction <= 1)).all()
