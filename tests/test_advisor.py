"""qlab.advisor on a model made fragile on purpose: the advice must find the layer we broke.

The tower's third layer reads an input whose channel 0 is 10⁴ times larger than the rest (a
massive-activation channel, as in LLMs), compensated in its weights so the float model is unchanged.
Quantizing that layer's input per tensor flushes every other channel: it, and only it, must come
out most sensitive and be kept. The reference is the construction itself, and the float model's
own outputs (the loss is the error against them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qlab import advisor
from qlab.nn import QuantLinear, quantize_model

FRAGILE = "layers.2"


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)]
        )
        boost = torch.ones(64)
        boost[0] = 1e4
        self.register_buffer("boost", boost)
        with torch.no_grad():
            self.layers[2].weight[:, 0] /= 1e4  # the float model does not see the boost

    def forward(self, x):
        x = torch.relu(self.layers[0](x))
        x = torch.relu(self.layers[1](x)) + 1.0
        x = self.layers[2](x * self.boost)
        return self.layers[3](torch.relu(x))


@pytest.fixture
def tower_and_batches():
    model = Tower().eval()
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    with torch.no_grad():
        targets = {id(b): model(b) for b in batches}

    def loss_fn(model, batch):
        return (model(batch) - targets[id(batch)]).square().mean()

    return model, batches, loss_fn


def test_the_fragile_layer_ranks_first_and_is_kept(tower_and_batches):
    model, batches, loss_fn = tower_and_batches
    advice = advisor.advise(model, batches, "int8_per_token", budget=0.25, loss_fn=loss_fn)
    table = advice.table.set_index("layer")
    assert table.loc[FRAGILE, "rank"] == 1 and advice.keep == [FRAGILE]
    assert table.loc[FRAGILE, "delta"] > 100 * table.drop(FRAGILE).delta.max()
    assert (table.baseline_loss == 0).all()  # the loss is the error against the float model itself


def test_the_advice_works_when_applied(tower_and_batches):
    model, batches, loss_fn = tower_and_batches
    keep = advisor.advise(model, batches, "int8_per_token", budget=0.25, loss_fn=loss_fn).keep
    everything, advised = Tower().eval(), Tower().eval()
    quantize_model(everything, "int8_per_token")
    quantize_model(advised, "int8_per_token", keep_high_precision=keep)
    with torch.no_grad():
        loss_all = sum(float(loss_fn(everything, b)) for b in batches)
        loss_advised = sum(float(loss_fn(advised, b)) for b in batches)
    assert loss_advised < loss_all / 100


def test_the_model_comes_back_as_it_was(tower_and_batches):
    model, batches, loss_fn = tower_and_batches
    modules = dict(model.named_modules())
    parameters = {name: p.clone() for name, p in model.named_parameters()}
    model.train()
    advisor.layer_sensitivity(model, batches, "nvfp4", loss_fn=loss_fn)
    assert model.training and dict(model.named_modules()) == modules
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(torch.equal(p, parameters[name]) for name, p in model.named_parameters())


def test_choose_by_layers_and_by_flops():
    table = advisor.pd.DataFrame(
        {"layer": ["a", "b", "c", "d"], "flops": [100, 10, 10, 80], "delta": [0.5, 0.4, -0.1, 0.3]}
    )
    assert advisor.choose(table, 0.5, "layers").keep == ["a", "b"]  # two of four layers
    assert advisor.choose(table, 0.1, "flops").keep == ["b"]  # a (50 % of FLOPs) does not fit, b (5 %) does
    assert advisor.choose(table, 1.0, "layers").keep == ["a", "b", "d"]  # c's quantization helps: never kept
    assert advisor.choose(table, 0.0, "layers").keep == []


def test_layers_can_be_named_and_unknown_names_are_refused(tower_and_batches):
    model, batches, loss_fn = tower_and_batches
    table = advisor.layer_sensitivity(model, batches, "mxfp8", loss_fn=loss_fn, layers=["layers.0", FRAGILE])
    assert table.layer.tolist() == ["layers.0", FRAGILE]
    with pytest.raises(ValueError, match="closest: layers.2"):
        advisor.layer_sensitivity(model, batches, "mxfp8", loss_fn=loss_fn, layers=["layers.22"])


def test_a_group_of_every_layer_is_the_fully_quantized_model(tower_and_batches):
    model, batches, loss_fn = tower_and_batches
    names = [f"layers.{i}" for i in range(4)]
    table = advisor.group_sensitivity(
        model, batches, "nvfp4", {"all": names, "first": names[:1]}, loss_fn=loss_fn
    )
    everything = Tower().eval()
    quantize_model(everything, "nvfp4")
    with torch.no_grad():
        expected = sum(float(loss_fn(everything, b)) for b in batches) / len(batches)
    row = table.set_index("group").loc["all"]
    assert row.loss == pytest.approx(expected, rel=1e-12) and row.layers == 4
    assert row.flops == 32 * 64 + 64 * 64 * 2 + 64 * 8
