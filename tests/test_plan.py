"""qlab.plan: bits as stored, an exact solver, measured scores and a plan file a model takes back."""

import itertools
import json
import math
import random
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

from qlab import advisor, plan, session, stats
from qlab import quantize as Q
from qlab.formats import get_format
from qlab.nn import QuantLinear, linear_layers, quantize_model, set_submodule
from qlab.recipe import get_recipe

WEIGHT_FORMATS = ["fp8_tensorwise", "mxfp8", "mxfp8_2d", "fp8_blockwise", "mxfp4", "nvfp4", "int8_per_token"]


def _stored_bits(spec, weight) -> int:
    """What a QTensor of the weight holds: codes at the element's width, scale codes (8 bits) where the
    format has them else FP32 scales, and NVFP4's FP32 global scale — counted from the tensors."""
    q = Q.quantize(weight, spec, axis=-1)
    element = spec.bits if isinstance(spec, Q.IntSpec) else get_format(spec.element).bits
    scales = q.scale_codes.numel() * 8 if q.scale_codes is not None else q.scales.numel() * 32
    return q.codes.numel() * element + scales + (32 if q.global_scale is not None else 0)


@pytest.mark.parametrize("format_name", WEIGHT_FORMATS)
@pytest.mark.parametrize("shape", [(48, 80), (64, 64), (16, 32), (33, 17), (130, 257)])
def test_weight_bits_count_what_the_quantized_weight_stores(format_name, shape):
    spec = get_recipe(format_name, backward_override=None).weight
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert plan.weight_bits(format_name, *shape) == _stored_bits(spec, weight)


def test_weight_bits_of_a_large_layer_follow_the_formats_definitions():
    # exact rational arithmetic from the formats' definitions, 4096 × 4096: bits per element
    n = 4096
    expected = {
        "nvfp4": 4
        + Fraction(8, 16 * 16)
        + Fraction(32, n * n),  # E2M1, an E4M3 scale per 16×16 tile, FP32 global
        "mxfp8": 8 + Fraction(8, 32),  # E4M3, an E8M0 scale per 32
        "mxfp4": 4 + Fraction(8, 32),
        "fp8_blockwise": 8 + Fraction(32, 128 * 128),  # an FP32 scale per 128×128 block
        "fp8_tensorwise": 8 + Fraction(32, n * n),
        "int8_per_token": 8 + Fraction(32, n),  # an FP32 scale per output row
        "bf16": Fraction(16),
    }
    for name, bits in expected.items():
        assert Fraction(plan.weight_bits(name, n, n), n * n) == bits, name


@pytest.mark.parametrize(
    "format_name, bound",
    [  # the formats' definitions: code bits, plus block scales where the format has blocks
        ("nvfp4", 4 + Fraction(8, 16 * 16)),
        ("mxfp8", 8 + Fraction(8, 32)),
        ("mxfp4", 4 + Fraction(8, 32)),
        ("fp8_blockwise", 8 + Fraction(32, 128 * 128)),
        ("fp8_tensorwise", Fraction(8)),  # one FP32 scale: its share tends to 0 as the layer grows
        ("int8_per_token", Fraction(8)),  # an FP32 scale per row: its share tends to 0 with the row's length
        ("bf16", Fraction(16)),
    ],
)
def test_fewest_bits_is_the_formats_lower_bound_and_no_layer_goes_below(format_name, bound):
    assert plan.fewest_bits([format_name]) == float(bound)
    for shape in [(1, 1), (33, 17), (130, 257), (4096, 4096), (8, 65536)]:
        assert Fraction(plan.weight_bits(format_name, *shape), shape[0] * shape[1]) >= bound, shape
    with_others = ["bf16", *{"mxfp8", format_name} - {"bf16"}]  # each named once
    assert plan.fewest_bits(with_others) == float(min(bound, 8 + Fraction(8, 32)))


def _random_table(rng: random.Random, layers: int, formats: int) -> pd.DataFrame:
    rows = []
    for layer in range(layers):
        elements = rng.choice([64, 128, 256, 1024])
        widths = sorted(rng.sample([4.25, 4.5, 8.25, 8.5, 16], formats))
        for index, width in enumerate(widths):
            bits, score = int(width * elements), rng.uniform(0, 1) / (index + 1)
            rows.append(dict(layer=f"l{layer}", format=f"f{index}", elements=elements, bits=bits,
                             score=score))  # fmt: skip
    return pd.DataFrame(rows)


def _brute_force(table: pd.DataFrame, effective_bits: float):
    """The smallest summed score over every assignment whose integer bits fit, by enumeration."""
    layers = list(dict.fromkeys(table.layer))
    options = [table[table.layer == layer].to_dict("records") for layer in layers]
    capacity = effective_bits * table.groupby("layer").elements.first().sum()
    best = None
    for choice in itertools.product(*options):
        if sum(row["bits"] for row in choice) <= capacity:
            score = sum(row["score"] for row in choice)
            best = score if best is None else min(best, score)
    return best


def test_the_solver_finds_what_enumeration_finds():
    rng = random.Random(0)
    for case in range(60):
        table = _random_table(rng, layers=rng.randint(1, 6), formats=rng.randint(2, 3))
        lowest = plan.cheapest_bits(table)
        budget = rng.uniform(lowest, 16.5)
        expected = _brute_force(table, budget)
        chosen = plan.solve(table, effective_bits=budget)
        picked = table[[chosen[layer] == name for layer, name in zip(table.layer, table.format)]]
        assert len(picked) == table.layer.nunique(), case
        assert picked.bits.sum() <= budget * table.groupby("layer").elements.first().sum(), case
        # HiGHS's optimality is to its tolerances on the objective: far below these scores' gaps
        assert picked.score.sum() == pytest.approx(expected, abs=1e-9), case
        assert plan.effective_bits_of(table, chosen) <= budget


LLM_SHAPES = [(4096, 14336), (14336, 4096), (49152, 576), (192, 576), (576, 1536), (4096, 4096), (8, 4096)]


def test_the_solver_finds_what_enumeration_finds_at_model_sizes_and_budgets_met_exactly():
    # billions of bits, budgets equal to reachable means (and one bit either side), scores of order 1
    # and of order 1e-7 (approximated scores): HiGHS's tolerances once let plans over the budget
    # through (then a RuntimeError) and stopped 1e-6 short of the optimum; enumeration in exact integers
    rng = random.Random(4)
    for case in range(40):
        formats = rng.sample(["nvfp4", "mxfp4", "mxfp8", "fp8_blockwise", "int8_per_token", "bf16"], 3)
        scale = rng.choice([1.0, 1e-7])
        rows = []
        for layer in range(rng.randint(2, 6)):
            out, inner = rng.choice(LLM_SHAPES)
            for name in formats:
                score = 0.0 if name == "bf16" else rng.uniform(-0.2, 1) * scale
                rows.append(dict(layer=f"l{layer}", format=name, elements=out * inner,
                                 bits=plan.weight_bits(name, out, inner), score=score))  # fmt: skip
        table = pd.DataFrame(rows)
        total = int(table.groupby("layer").elements.first().sum())
        options = [table[table.layer == layer].to_dict("records") for layer in dict.fromkeys(table.layer)]
        assignments = [
            (sum(r["bits"] for r in c), sum(r["score"] for r in c)) for c in itertools.product(*options)
        ]
        reachable = sorted({bits for bits, _ in assignments})
        for bits in rng.sample(reachable, min(3, len(reachable))):
            for budget in (bits / total, (bits + 1) / total, (bits - 1) / total):
                fitting = [score for spent, score in assignments if spent / total <= budget]
                if not fitting:
                    with pytest.raises(ValueError, match="no plan fits"):
                        plan.solve(table, effective_bits=budget)
                    continue
                chosen = plan.solve(table, effective_bits=budget)
                assert plan.effective_bits_of(table, chosen) <= budget, (case, budget)
                picked = table[[chosen[layer] == name for layer, name in zip(table.layer, table.format)]]
                # HiGHS stops within 1e-6 of the scores' largest magnitude (its absolute gap, scaled)
                assert picked.score.sum() == pytest.approx(min(fitting), abs=1e-6 * scale), (case, budget)


def test_a_budget_below_every_layers_cheapest_format_is_refused():
    table = _random_table(random.Random(1), layers=3, formats=2)
    lowest = plan.cheapest_bits(table)
    with pytest.raises(ValueError, match="below the .* bits per element that the cheapest format"):
        plan.solve(table, effective_bits=lowest * 0.99)
    plan.solve(table, effective_bits=lowest)  # exactly the cheapest: every layer at its fewest bits
    with pytest.raises(ValueError, match=r"^--effective-bits 0\.5 is below"):  # the CLI's name for it
        plan.check_budget(table, 0.5, argument="--effective-bits")


def test_budgets_no_model_can_reach_are_refused_in_the_callers_words():
    # NVFP4 weights: 4-bit codes and one 8-bit E4M3 scale per 16×16 tile, 4 + 8/256 bits per element
    expected = (
        "budgets 0.15, 4 are below the 4.03125 bits per weight element of the cheapest of formats nvfp4,mxfp8"
    )
    with pytest.raises(ValueError, match=f"^{expected}: no plan fits$"):
        plan.check_reachable(["nvfp4", "mxfp8"], [0.15, 4, 6], argument="budgets")
    plan.check_reachable(["nvfp4", "mxfp8"], [4.03125])  # exactly the bound: a model of whole tiles fits it
    with pytest.raises(
        ValueError, match=f"^{expected}: no plan fits \\(in the parameters cell of report\\)$"
    ):
        session.check_values("report", {"formats": ["nvfp4", "mxfp8"], "budgets": [0.15, 4, 6]}, {})
    from qlab import notebooks, paths

    report = paths.NOTEBOOKS_DIR / "report_your_model.ipynb"
    defaults = notebooks.parameter_defaults(report)
    floor = plan.fewest_bits(defaults["formats"])
    with pytest.raises(ValueError, match=f"^budgets 0.15 is below the {floor:g} bits .* cheapest of formats"):
        notebooks.check_parameters(report, {"budgets": [0.15]})  # against the default formats
    assert notebooks.check_parameters(report, {"budgets": [floor]}) == {"budgets": [floor]}


def _tiny_llama(layers: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _batches(count=3):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(64, (2, 16), generator=generator) for _ in range(count)]


def test_measured_scores_are_the_paired_loss_changes_of_one_layer_at_a_time():
    model, batches = _tiny_llama(), _batches()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    table = advisor.measured_scores(
        model, batches, ["nvfp4", "mxfp8", "bf16"], layers=["model.layers.0.mlp.up_proj"]
    )
    assert list(table.format) == ["nvfp4", "mxfp8", "bf16"] and (table.n == 3).all()
    with torch.no_grad():
        baseline = [float(model(input_ids=b, labels=b).loss) for b in batches]
        layer = model.get_submodule("model.layers.0.mlp.up_proj")
        set_submodule(model, "model.layers.0.mlp.up_proj", QuantLinear.from_linear(layer, "nvfp4", seed=0))
        quantized = [float(model(input_ids=b, labels=b).loss) for b in batches]
        set_submodule(model, "model.layers.0.mlp.up_proj", layer)
    differences = [a - b for a, b in zip(quantized, baseline)]
    mean, low, high = stats.mean_interval(differences)
    row = table.iloc[0]
    assert (row.score, row.low, row.high) == (mean, low, high)
    assert table.iloc[2][["score", "low", "high"]].tolist() == [0.0, 0.0, 0.0]  # high precision: 0 exactly
    assert row.bits == plan.weight_bits("nvfp4", 64, 32) and row.elements == 64 * 32
    for name, p in model.state_dict().items():  # the model comes back as it was
        assert torch.equal(p, before[name]), name
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_a_plan_round_trips_through_its_file_and_quantizes_each_layer_in_its_format(tmp_path):
    model, batches = _tiny_llama(), _batches(2)
    table = advisor.measured_scores(model, batches, ["nvfp4", "mxfp8", "bf16"])
    hashes = dict(model_config_sha256=advisor.config_hash(model), text_sha256=plan.token_hash(batches))
    chosen = plan.make_plan(table, effective_bits=8.0, model="tiny-llama", **hashes)
    assert chosen.reached_bits <= 8.0 and chosen.kind == "measured"
    assert set(chosen.layers) == {name for name, _, why in linear_layers(model) if why is None}
    path = chosen.save(tmp_path / "plan.json")
    assert plan.Plan.load(path) == chosen
    assert chosen.save(tmp_path / "again.json").read_bytes() == path.read_bytes()

    expected_model = _tiny_llama()  # each layer swapped by hand, seeds as quantize_model numbers them
    for index, (name, module, _) in enumerate(
        layer for layer in linear_layers(expected_model) if layer[2] is None
    ):
        if chosen.layers[name] != "bf16":
            set_submodule(
                expected_model, name, QuantLinear.from_linear(module, chosen.layers[name], seed=index)
            )
    report = quantize_model(model, path)
    assert {row["name"]: row["recipe"] for row in report if row["name"] in chosen.layers} == chosen.layers
    for name, planned in chosen.layers.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear) == (planned != "bf16"), name
    with torch.no_grad():
        assert torch.equal(model(input_ids=batches[0]).logits, expected_model(input_ids=batches[0]).logits)
    # the same layer names at another width: the plan's sizes (the table's out × in) no longer fit
    assert chosen.elements["model.layers.0.mlp.up_proj"] == 64 * 32
    wider = _tiny_llama()
    wider.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 96, bias=False)
    refused = r"1 layers have other weight sizes .*model.layers.0.mlp.up_proj: 2048 in the plan, 3072 here"
    with pytest.raises(ValueError, match=refused):
        quantize_model(wider, path)
    assert not any(isinstance(m, QuantLinear) for m in wider.modules())


def test_a_plan_on_a_model_quantized_before_rebuilds_each_layer_from_the_one_it_replaced():
    # the same Parameters end in the same modules as when the plan meets the float model
    batches = _batches(1)
    names = [name for name, _, why in linear_layers(_tiny_llama()) if why is None]
    layers = {name: ("bf16" if index % 3 == 0 else "nvfp4") for index, name in enumerate(names)}
    fresh, before = _tiny_llama(), _tiny_llama()
    quantize_model(fresh, plan.Plan(layers=layers))
    quantize_model(before, "mxfp8")
    report = {row["name"]: row for row in quantize_model(before, plan.Plan(layers=layers))}
    for name, planned in layers.items():
        assert isinstance(before.get_submodule(name), QuantLinear) == (planned != "bf16"), name
        expected = ("kept", "the plan keeps it in high precision; its mxfp8 quantization removed")
        if planned != "bf16":
            expected = ("requantized", "was quantized with mxfp8")
        assert (report[name]["action"], report[name]["reason"]) == expected
    with torch.no_grad():
        assert torch.equal(before(input_ids=batches[0]).logits, fresh(input_ids=batches[0]).logits)


def test_a_plan_for_other_layers_or_a_hand_edited_file_is_refused_by_name(tmp_path):
    model = _tiny_llama()
    layers = {name: "mxfp8" for name, _, why in linear_layers(model) if why is None}
    path = plan.Plan(layers=layers, model="tiny").save(tmp_path / "plan.json")
    content = json.loads(path.read_text())
    content["layers"]["model.layers.7.mlp.up_proj"] = content["layers"].pop("model.layers.0.mlp.up_proj")
    path.write_text(json.dumps(content))
    refused = r"1 planned layers are not convertible layers of the model \['model.layers.7.mlp.up_proj'\]"
    with pytest.raises(ValueError, match=refused):
        quantize_model(model, path)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # refused before any swap
    content["layers"]["model.layers.7.mlp.up_proj"] = "nvfp5"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="'nvfp5', not a recipe preset; closest: nvfp4"):
        plan.Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        plan.Plan.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        plan.Plan.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c.update(layers={"a": "bf16", "b": "bf16"}),
            r"gives layers \['bf16'\], formats it was not",
        ),
        (lambda c: c.update(reached_bits=99.0), "reaches 99 bits per weight, over the 6"),
        (lambda c: c.update(plan_version=True), "is not a qlab plan"),
        (lambda c: c.pop("layers"), "has no layers"),
        (lambda c: c["elements"].update(a=4096.0), r"elements\['a'\] must be an int"),
        (lambda c: c.update(layers=["a", "b"]), "layers must be a non-empty dict"),
    ],
    ids=["formats", "reached", "version", "no layers", "float elements", "list layers"],
)
def test_a_hand_edited_plan_file_is_refused_naming_the_file(tmp_path, edit, message):
    saved = plan.Plan(layers={"a": "mxfp8", "b": "nvfp4"}, formats=("nvfp4", "mxfp8"), effective_bits=6.0,
                      reached_bits=5.44, elements={"a": 4096, "b": 4096})  # fmt: skip
    path = saved.save(tmp_path / "plan.json")
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as raised:
        plan.Plan.load(path)
    assert str(path) in str(raised.value)
    with pytest.raises(ValueError, match="is a folder"):
        plan.Plan.load(tmp_path)
    with pytest.raises(TypeError, match="have must be a dict or a list of layer names, got 'ab'"):
        plan.Plan(layers={"a": "mxfp8", "b": "nvfp4"}).check_layers("ab")


def test_a_budget_of_any_size_is_a_plan_or_a_clear_refusal():
    table = _random_table(random.Random(2), layers=3, formats=2)
    assert plan.solve(table, effective_bits=1e308) == plan.solve(table, effective_bits=16.5)
    lowest = plan.cheapest_bits(table)  # a float mean: the plan that reaches it must fit it
    assert plan.effective_bits_of(table, plan.solve(table, effective_bits=lowest)) == lowest


@pytest.mark.parametrize(
    "formats, match",
    [
        (["nvfp4", "mxfp9"], "'mxfp9', not a recipe preset"),
        (["mxfp4_training"], "whose forward does not quantize the weight"),
        (["mxfp8", "mxfp8"], "each format once"),
        ([], "at least one format"),
    ],
)
def test_formats_a_plan_cannot_choose_are_refused(formats, match):
    with pytest.raises(ValueError, match=match):
        plan.plan_formats(formats)


def test_scores_that_cannot_make_a_plan_are_refused():
    table = _random_table(random.Random(2), layers=2, formats=2)
    with pytest.raises(ValueError, match="more than once"):
        plan.solve(pd.concat([table, table.iloc[:1]]), effective_bits=16)
    with pytest.raises(ValueError, match="finite"):
        plan.solve(table.assign(score=math.nan), effective_bits=16)
    with pytest.raises(ValueError, match="effective_bits"):
        plan.solve(table, effective_bits=-1)


def test_approximated_scores_are_half_the_fisher_weighted_squared_output_change():
    model, batches = _tiny_llama(), _batches(2)
    name = "model.layers.0.self_attn.o_proj"
    table = advisor.approximated_scores(model, batches, ["mxfp4", "bf16"], layers=[name])
    expected = []
    layer = model.get_submodule(name)
    variant = QuantLinear.from_linear(layer, "mxfp4", seed=0)
    for batch in batches:  # the layer's input and output gradient by hand, float64 for the sum
        seen = {}

        def keep(module, inputs, output, seen=seen):
            seen.update(x=inputs[0], y=output)
            output.retain_grad()

        handle = layer.register_forward_hook(keep)
        loss = model(input_ids=batch, labels=batch).loss
        handle.remove()
        loss.backward()
        with torch.no_grad():
            change = variant.forward(seen["x"]).double() - seen["y"].double()
        expected.append(float(0.5 * (seen["y"].grad.double() ** 2 * change**2).sum()))
        model.zero_grad(set_to_none=True)
    mean, low, high = stats.mean_interval(expected)
    row = table.iloc[0]
    # the same float32 forward and backward; only the float64 sums' order may differ
    assert (row.score, row.low, row.high) == pytest.approx((mean, low, high), rel=1e-9)
    assert row.kind == "approximated" and table.iloc[1].score == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_stability_resamples_batches_and_names_the_layers_the_data_cannot_decide():
    # three layers, two formats, 4 batches, bits for two layers in f8: c's f4 cost is large in every
    # batch (always f8); a's is steady and b's swings about the same mean, so which of them gets the
    # second f8 depends on the batches drawn
    costs = {
        "a": [0.31, 0.33, 0.29, 0.305],
        "b": [0.93, -0.27, 0.61, 0.02],
        "c": [5.0, 5.1, 4.9, 5.0],
    }  # no ties
    rows = []
    for layer, values in costs.items():
        rows.append(
            dict(
                layer=layer,
                format="f4",
                elements=100,
                bits=400,
                **{f"batch_{i}": v for i, v in enumerate(values)},
            )
        )
        rows.append(
            dict(layer=layer, format="f8", elements=100, bits=800, **{f"batch_{i}": 0.0 for i in range(4)})
        )
    table = pd.DataFrame(rows)
    table["score"] = table[[f"batch_{i}" for i in range(4)]].mean(axis=1)
    found = plan.stability(table, effective_bits=2000 / 300, draws=300, seed=0).set_index("layer")
    assert (
        found.loc["c", "format"] == "f8"
        and found.loc["c", "agreement"] == 1.0
        and not found.loc["c", "undecided"]
    )
    assert 0.2 < found.loc["b", "agreement"] < 0.9 and found.loc["b", "undecided"] and found.loc["b", "other"]
    # the same draws by hand: b takes the second f8 exactly when its resampled mean beats a's
    generator = np.random.default_rng(0)
    a, b = np.array(costs["a"]), np.array(costs["b"])
    b_in_f8 = 0
    for _ in range(300):
        picked = generator.integers(4, size=4)
        b_in_f8 += bool(b[picked].mean() > a[picked].mean())
    share = b_in_f8 / 300 if found.loc["b", "format"] == "f8" else 1 - b_in_f8 / 300
    assert found.loc["b", "agreement"] == pytest.approx(share, abs=1e-12)
    with pytest.raises(ValueError, match="at least 2 batches"):
        plan.stability(table.drop(columns=["batch_1", "batch_2", "batch_3"]), effective_bits=6.0)


def test_the_usual_rule_raises_layers_from_both_ends_while_the_budget_lasts():
    rows = []
    for layer in ["l0", "l1", "l2", "l3", "l4"]:
        rows += [
            dict(layer=layer, format="f4", elements=100, bits=400),
            dict(layer=layer, format="f16", elements=100, bits=1600),
        ]
    table = pd.DataFrame(rows)
    # 500 elements at 4 bits is 2000; each raised layer adds 1200: a budget of 4500 bits raises two
    assert plan.ends_first(table, effective_bits=4500 / 500) == {
        "l0": "f16", "l1": "f4", "l2": "f4", "l3": "f4", "l4": "f16"}  # fmt: skip
    assert plan.ends_first(table, effective_bits=5800 / 500) == {  # three: l0, l4, then l1
        "l0": "f16", "l1": "f16", "l2": "f4", "l3": "f4", "l4": "f16"}  # fmt: skip
    assert set(plan.ends_first(table, effective_bits=4.0).values()) == {"f4"}


def test_the_held_out_check_pairs_the_plan_with_the_float_model_the_cheapest_and_the_rule_by_batch():
    model, batches = _tiny_llama(), _batches(2)
    held_out = _batches(5)[2:]
    table = advisor.measured_scores(model, batches, ["nvfp4", "mxfp8", "bf16"])
    chosen = plan.make_plan(table, effective_bits=7.0)
    found = advisor.held_out_check(model, chosen, table, held_out).set_index("comparison")

    def losses(assignment):
        quantized = _tiny_llama()
        if assignment is not None:
            quantize_model(quantized, plan.Plan(layers=assignment))
        with torch.no_grad():
            return [float(quantized(input_ids=b, labels=b).loss) for b in held_out]

    planned = losses(chosen.layers)
    lowest = {layer: "nvfp4" for layer in chosen.layers}
    rule = plan.ends_first(table, effective_bits=7.0)
    p_values = []
    for name, other in [
        ("float model", None),
        ("fewest bits everywhere", lowest),
        ("first and last layers raised", rule),
    ]:
        test = stats.paired_test([a - b for a, b in zip(planned, losses(other))])
        row = found.loc[f"plan − {name}"]
        assert (row["mean"], row["low"], row["high"], row["n"]) == pytest.approx(
            (test["mean"], test["low"], test["high"], 3)
        )
        p_values.append(test["p"])
    assert found.p_holm.tolist() == pytest.approx(stats.holm(p_values))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def _two_block_llama():
    return _tiny_llama(layers=2, seed=1)


@pytest.mark.parametrize(
    "names, blocks",
    [
        (["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"],
         {"model.layers.0": ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"],
          "model.layers.1": ["model.layers.1.mlp.up_proj"]}),
        (["lm_head", "encoder.layer.10.output.dense"],
         {"lm_head": ["lm_head"], "encoder.layer.10": ["encoder.layer.10.output.dense"]}),
        (["transformer.h.2.attn.c_attn", "transformer.h.2.mlp.c_fc", "pooler.dense"],
         {"transformer.h.2": ["transformer.h.2.attn.c_attn", "transformer.h.2.mlp.c_fc"],
          "pooler.dense": ["pooler.dense"]}),
    ],
)  # fmt: skip
def test_blocks_group_layers_by_their_first_numbered_part(names, blocks):
    assert advisor.blocks_of(names) == blocks


def test_hierarchical_scores_expanding_every_block_are_the_measured_scores():
    model, batches = _two_block_llama(), _batches()
    formats = ["nvfp4", "mxfp8", "bf16"]
    measured = advisor.measured_scores(model, batches, formats)
    found = advisor.hierarchical_scores(model, batches, formats, expand=3)
    columns = ["layer", "format", "score", "low", "high", "bits"]
    pd.testing.assert_frame_equal(found[columns], measured[columns])
    assert set(found.scored_by) == {"layer"} and (found.kind == "hierarchical").all()
    # 3 blocks (two decoder layers, lm_head) whole, then the 2 × 7 projections, each in 2 formats
    assert found.attrs == {"evaluations": 3 * 2 + 14 * 2, "evaluations_flat": 15 * 2}


def test_hierarchical_scores_spread_an_unexpanded_blocks_loss_change_by_weight_elements():
    model, batches = _two_block_llama(), _batches()
    found = advisor.hierarchical_scores(model, batches, ["nvfp4", "bf16"], expand=0)
    block = [name for name, _, why in linear_layers(model) if why is None and ".layers.1." in name]
    with torch.no_grad():  # the block quantized whole, by hand
        baseline = [float(model(input_ids=b, labels=b).loss) for b in batches]
        originals = {name: model.get_submodule(name) for name in block}
        for index, name in enumerate(block):
            set_submodule(model, name, QuantLinear.from_linear(originals[name], "nvfp4", seed=index))
        quantized = [float(model(input_ids=b, labels=b).loss) for b in batches]
        for name, module in originals.items():
            set_submodule(model, name, module)
    change = [a - b for a, b in zip(quantized, baseline)]
    sizes = {name: originals[name].weight.numel() for name in block}
    rows = found[(found.format == "nvfp4") & found.layer.isin(block)].set_index("layer")
    for name in block:
        share = sizes[name] / sum(sizes.values())
        expected = stats.mean_interval([c * share for c in change])
        assert tuple(rows.loc[name, ["score", "low", "high"]]) == pytest.approx(expected, rel=1e-12)
        assert rows.loc[name, "scored_by"] == "block share"
    assert found.set_index(["layer", "format"]).loc[("lm_head", "nvfp4"), "scored_by"] == "layer"
    assert found.attrs["evaluations"] == 3  # three blocks whole in one format, nothing expanded
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_score_agreement_is_spearmans_rho_over_the_quantized_rows_with_a_layer_bootstrap():
    from scipy import stats as scipy_stats

    rng = np.random.default_rng(0)
    table = _random_table(random.Random(2), layers=12, formats=3)
    table.loc[table.format == table.format.iloc[0], "format"] = plan.HIGH_PRECISION  # one format high
    first = table.assign(score=rng.normal(size=len(table)))
    second = first.assign(score=first.score + rng.normal(scale=0.5, size=len(table)))
    rho, low, high = plan.score_agreement(first, second, draws=500)
    quantized = first.format != plan.HIGH_PRECISION
    assert rho == pytest.approx(
        scipy_stats.spearmanr(first.score[quantized], second.score[quantized]).statistic
    )
    assert low < rho < high
    assert plan.score_agreement(first, first, draws=50) == pytest.approx(
        (1.0, 1.0, 1.0), abs=1e-12
    )  # float64 ρ
    with pytest.raises(ValueError, match="same .layer, format. rows"):
        plan.score_agreement(first, second.iloc[::-1], draws=10)


def test_a_training_run_takes_a_plan_file_and_builds_each_layer_in_its_format(tmp_path):
    from qlab.train.config import TrainConfig
    from qlab.train.loop import build_model, train

    names = [name for name, _, why in linear_layers(build_model(TrainConfig(task="digits"))) if why is None]
    assert len(names) == 3
    planned = dict(zip(names, ["nvfp4", "mxfp8", "bf16"]))
    path = plan.Plan(layers=planned).save(tmp_path / "digits.json")
    config = TrainConfig(task="digits", recipe_plan=str(path), steps=2, eval_every=1, eval_batches=1,
                         batch_size=8, progress=False)  # fmt: skip
    model = build_model(config)
    for name, format_name in planned.items():
        layer = model.get_submodule(name)
        if format_name == "bf16":
            assert type(layer) is torch.nn.Linear
        else:
            assert isinstance(layer, QuantLinear) and layer.recipe.name == get_recipe(format_name).name
    assert math.isfinite(train(config).metrics.val_loss.dropna().iloc[-1])

    with pytest.raises(ValueError, match="recipe must be fp32 or bf16 .* got 'nvfp4'"):
        TrainConfig(task="digits", recipe="nvfp4", recipe_plan=str(path))
    with pytest.raises(ValueError, match="leave keep_high_precision unset"):
        TrainConfig(task="digits", recipe_plan=str(path), keep_high_precision=["head"])
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig(task="digits", recipe_plan=str(tmp_path / "none.json"))
    other = plan.Plan(layers={"net.9": "nvfp4", **dict(list(planned.items())[1:])}).save(tmp_path / "o.json")
    with pytest.raises(ValueError, match="net.9"):
        build_model(TrainConfig(task="digits", recipe_plan=str(other)))
