"""qlab.recipe: presets, serialization, the spec fallback and every refused configuration.

References: the preset definitions written out by hand below from the docstrings of
``qlab.recipe`` / ``get_recipe`` and docs/reference.md §2 (HYBRID FP8, MX, NVFP4 training recipe), the
backward-override rules of docs/reference.md §3, and PyYAML's safe dumper/loader for serialization.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from qlab.quantize import BlockwiseSpec, IntSpec, MXSpec, NVFP4Spec, TensorwiseSpec
from qlab.recipe import PRESETS, ROLES, Recipe, get_recipe

ENV = "QLAB_BACKWARD_OVERRIDE"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")
    monkeypatch.delenv(ENV, raising=False)


# The documented definition of every preset: the specs of the roles that are set (all others None).
E4M3, E5M2 = TensorwiseSpec("e4m3"), TensorwiseSpec("e5m2")
DOCUMENTED_PRESETS = {
    "bf16": {},
    "fp8_tensorwise": dict(input=E4M3, weight=E4M3, grad_output=E5M2),
    "fp8_delayed": dict(input=E4M3, weight=E4M3, grad_output=E5M2, delayed=True),
    "mxfp8": dict(
        input=MXSpec("e4m3", 32, mode="rceil"),
        weight=MXSpec("e4m3", 32, mode="rceil"),
        grad_output=MXSpec("e4m3", 32, mode="rceil"),
    ),
    "mxfp4": dict(
        input=MXSpec("e2m1", 32, mode="floor"),
        weight=MXSpec("e2m1", 32, mode="floor"),
        grad_output=MXSpec("e2m1", 32, mode="floor", rounding="stochastic"),
    ),
    "nvfp4": dict(
        input=NVFP4Spec(),
        weight=NVFP4Spec(block_2d=True),
        grad_output=NVFP4Spec(rounding="stochastic"),
        wgrad_input=NVFP4Spec(hadamard=True),
        wgrad_grad_output=NVFP4Spec(hadamard=True, rounding="stochastic"),
    ),
    # TE's MXFP8BlockScaling(enable_2d_quantization=True): 32×32 weight tiles
    "mxfp8_2d": dict(
        input=MXSpec("e4m3", 32, mode="rceil"),
        weight=MXSpec("e4m3", 32, mode="rceil", block_2d=True),
        grad_output=MXSpec("e4m3", 32, mode="rceil"),
    ),
    # TE's Float8BlockScaling defaults: E4M3, 1×128 / 128×128 (weights), power-of-two scales, eps 0
    "fp8_blockwise": dict(
        input=BlockwiseSpec("e4m3", 128, block_2d=False, pow2=True, eps=0.0),
        weight=BlockwiseSpec("e4m3", 128, block_2d=True, pow2=True, eps=0.0),
        grad_output=BlockwiseSpec("e4m3", 128, block_2d=False, pow2=True, eps=0.0),
    ),
    # Tseng et al. 2025: high-precision forward; MXFP4 backward GEMMs with SR, RHT on the wgrad operands
    "mxfp4_training": dict(
        dgrad_grad_output=MXSpec("e2m1", 32, mode="floor", rounding="stochastic"),
        dgrad_weight=MXSpec("e2m1", 32, mode="floor", rounding="stochastic"),
        wgrad_grad_output=MXSpec("e2m1", 32, mode="floor", rounding="stochastic", hadamard=True),
        wgrad_input=MXSpec("e2m1", 32, mode="floor", rounding="stochastic", hadamard=True),
    ),
    "int8_per_token": dict(
        input=IntSpec(8, signed=True, symmetric=True, granularity="axis"),
        weight=IntSpec(8, signed=True, symmetric=True, granularity="axis"),
    ),
}
DELAYED_DEFAULTS = dict(
    amax_history_len=1024,
    amax_algorithm="max",
    margin=0,  # TE's defaults (docs/reference.md §2)
    reduce_amax=True,
)  # TE's DelayedScaling(reduce_amax=True)


def test_the_documented_presets_are_exactly_the_presets():
    assert set(PRESETS) == set(DOCUMENTED_PRESETS)


# --- serialization -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_to_dict_and_from_dict(name):
    recipe = get_recipe(name)
    data = recipe.to_dict()
    assert Recipe.from_dict(data) == recipe
    assert Recipe.from_dict(data).to_dict() == data


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_yaml(name):
    recipe = get_recipe(name)
    text = yaml.safe_dump(recipe.to_dict())  # safe_dump refuses anything but plain types
    loaded = yaml.safe_load(text)
    assert loaded == recipe.to_dict()
    assert Recipe.from_dict(loaded) == recipe


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_an_override_round_trips_through_yaml(override):
    recipe = get_recipe("mxfp8", backward_override=override)
    loaded = Recipe.from_dict(yaml.safe_load(yaml.safe_dump(recipe.to_dict())))
    assert loaded.backward_override == override
    assert loaded == recipe


def test_to_dict_writes_the_spec_kind_and_every_spec_field():
    data = get_recipe("nvfp4").to_dict()
    assert data["weight"] == {
        "kind": "NVFP4Spec",
        "block_2d": True,
        "hadamard": False,
        "hadamard_seed": 0,
        "global_scale": True,
        "pad": True,
        "rounding": "rne",
        "convention": "nvidia",
    }
    assert data["dgrad_weight"] is None
    assert data["name"] == "nvfp4"
    assert set(data) == {
        "name",
        *ROLES,
        "delayed",
        "amax_history_len",
        "amax_algorithm",
        "margin",
        "reduce_amax",
        "backward_override",
    }


@pytest.mark.parametrize("name", PRESETS)
def test_get_recipe_accepts_a_name_a_dict_and_a_recipe(name):
    by_name = get_recipe(name)
    assert get_recipe(by_name.to_dict()) == by_name
    assert get_recipe(by_name) is by_name


def test_get_recipe_of_none_is_bf16():
    assert get_recipe(None) == get_recipe("bf16")
    assert get_recipe(None).name == "bf16"


def test_a_spec_given_by_its_preset_name_becomes_the_spec_object():
    recipe = Recipe.from_dict({"input": "mxfp8", "weight": "nvfp4_2d"})
    assert recipe.input == MXSpec("e4m3")
    assert recipe.weight == NVFP4Spec(block_2d=True)


# --- preset contents ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_preset_contents_match_their_documented_definition(name):
    recipe = get_recipe(name)
    documented = DOCUMENTED_PRESETS[name]
    assert recipe.name == name
    for role in ROLES:
        assert getattr(recipe, role) == documented.get(role), role
    assert recipe.delayed == documented.get("delayed", False)
    for field, value in DELAYED_DEFAULTS.items():
        assert getattr(recipe, field) == value
    assert recipe.backward_override is None
    assert recipe.quantizes == (name != "bf16")


def test_bf16_quantizes_nothing():
    recipe = get_recipe("bf16")
    assert [recipe.spec(role) for role in ROLES] == [None] * len(ROLES)
    assert not recipe.quantizes


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(
    "role,forward_role",
    [
        ("dgrad_weight", "weight"),
        ("dgrad_grad_output", "grad_output"),
        ("wgrad_input", "input"),
        ("wgrad_grad_output", "grad_output"),
    ],
)
def test_backward_roles_fall_back_to_their_forward_role(name, role, forward_role):
    documented = DOCUMENTED_PRESETS[name]
    expected = documented[role] if role in documented else documented.get(forward_role)
    assert get_recipe(name).spec(role) == expected


@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_forward_roles_do_not_fall_back(role):
    recipe = Recipe(weight=E4M3)
    assert recipe.spec(role) == (E4M3 if role == "weight" else None)


def test_an_explicit_backward_spec_wins_over_the_fallback():
    recipe = Recipe(weight=E4M3, dgrad_weight=E5M2)
    assert recipe.spec("dgrad_weight") == E5M2
    assert recipe.spec("weight") == E4M3


def test_reduce_amax_must_be_a_bool():
    with pytest.raises(TypeError, match="reduce_amax must be a bool"):
        Recipe(reduce_amax="yes")


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role 'bias'"):
        get_recipe("fp8_tensorwise").spec("bias")


# --- backward_override ----------------------------------------------------------------------------------


@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
def test_backward_override_argument_is_used(override):
    assert get_recipe("fp8_tensorwise", backward_override=override).backward_override == override
    assert Recipe(input=E4M3, backward_override=override).backward_override == override


@pytest.mark.parametrize(
    "env_value,expected",
    [
        ("high_precision", "high_precision"),
        ("dequantized", "dequantized"),
        (" dequantized\n", "dequantized"),  # surrounding whitespace is stripped
        ("none", None),
        ("None", None),
        ("NONE", None),
        ("", None),
        ("  ", None),
    ],
)
def test_environment_variable_is_used_when_the_argument_is_unset(monkeypatch, env_value, expected):
    monkeypatch.setenv(ENV, env_value)
    assert get_recipe("fp8_tensorwise").backward_override == expected
    assert Recipe(input=E4M3).backward_override == expected
    assert (
        Recipe.from_dict({"input": {"kind": "TensorwiseSpec", "element": "e4m3"}}).backward_override
        == expected
    )


def test_unset_environment_variable_means_no_override():
    assert get_recipe("mxfp8").backward_override is None


@pytest.mark.parametrize("argument", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("env_value", ["high_precision", "dequantized", "bogus"])
def test_explicit_argument_wins_over_environment_variable(monkeypatch, argument, env_value):
    monkeypatch.setenv(ENV, env_value)  # even an invalid environment value is never read
    assert get_recipe("fp8_tensorwise", backward_override=argument).backward_override == argument
    assert Recipe(input=E4M3, backward_override=argument).backward_override == argument


def test_an_override_in_a_dict_wins_over_the_environment_variable(monkeypatch):
    monkeypatch.setenv(ENV, "dequantized")
    data = get_recipe("fp8_tensorwise", backward_override="high_precision").to_dict()
    assert get_recipe(data).backward_override == "high_precision"


def test_get_recipe_argument_wins_over_a_recipe_objects_override():
    recipe = get_recipe("mxfp8", backward_override="dequantized")
    replaced = get_recipe(recipe, backward_override="high_precision")
    assert replaced.backward_override == "high_precision"
    assert dataclasses.replace(replaced, backward_override="dequantized") == recipe


EXPECTED_OVERRIDES = r"expected None, 'high_precision' or 'dequantized'"


def test_the_string_none_means_no_override_as_yaml_writes_it():
    assert Recipe(input=E4M3, backward_override="none").backward_override is None
    assert Recipe.from_dict(yaml.safe_load("backward_override: none")).backward_override is None


@pytest.mark.parametrize("value", ["unquant", "dequant", "default", "HIGH_PRECISION", ""])
def test_unknown_override_argument_is_refused(value):
    with pytest.raises(ValueError, match=EXPECTED_OVERRIDES):
        get_recipe("fp8_tensorwise", backward_override=value)
    with pytest.raises(ValueError, match=EXPECTED_OVERRIDES):
        Recipe(input=E4M3, backward_override=value)


@pytest.mark.parametrize("value", ["unquant", "dequant", "1", "High_Precision"])
def test_unknown_override_in_environment_is_refused(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    expected = f"environment variable {ENV}='{value}' is not a backward_override"
    with pytest.raises(ValueError, match=expected):
        get_recipe("fp8_tensorwise")
    with pytest.raises(ValueError, match=expected):
        get_recipe("bf16")


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_delayed_scaling_with_an_override_argument_is_refused(override):
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        get_recipe("fp8_delayed", backward_override=override)
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        Recipe(input=E4M3, delayed=True, backward_override=override)
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        get_recipe("fp8_delayed").replace(backward_override=override)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_delayed_scaling_with_an_override_from_environment_is_refused(monkeypatch, override):
    monkeypatch.setenv(ENV, override)
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        get_recipe("fp8_delayed")
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        Recipe.from_dict({"input": "fp8_e4m3", "delayed": True})


def test_delayed_scaling_with_explicit_none_ignores_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "dequantized")
    recipe = get_recipe("fp8_delayed", backward_override=None)
    assert recipe.delayed and recipe.backward_override is None


# --- refused configurations ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "FP8_TENSORWISE", "nvfp4 ", "mxfp6", ""])
def test_unknown_preset_name_is_refused(name):
    with pytest.raises(ValueError, match="unknown recipe .*one of: bf16, fp8_tensorwise"):
        get_recipe(name)


@pytest.mark.parametrize("value", [3, 1.5, ["bf16"], ("bf16",)])
def test_get_recipe_of_an_unsupported_type_is_refused(value):
    with pytest.raises(TypeError, match="recipe must be a preset name, a dict or a Recipe"):
        get_recipe(value)


@pytest.mark.parametrize(
    "spec", [{"kind": "FP8Spec", "element": "e4m3"}, {"element": "e4m3"}, {"kind": "tensorwisespec"}]
)
def test_from_dict_with_unknown_spec_kind_is_refused(spec):
    with pytest.raises(
        ValueError, match="unknown spec kind .*TensorwiseSpec, BlockwiseSpec, IntSpec, MXSpec, NVFP4Spec"
    ):
        Recipe.from_dict({"input": spec})


@pytest.mark.parametrize("field", ["bias", "recipe", "backward_mode", "grad_input"])
def test_from_dict_with_unknown_field_is_refused(field):
    data = get_recipe("fp8_tensorwise").to_dict()
    data[field] = None
    with pytest.raises(ValueError, match=rf"unknown recipe fields \['{field}'\]"):
        Recipe.from_dict(data)


@pytest.mark.parametrize("value", [None, "fp8_tensorwise", ["input"], 3, get_recipe("bf16")])
def test_from_dict_of_a_non_dict_is_refused(value):
    with pytest.raises(TypeError, match="data must be a dict of Recipe fields"):
        Recipe.from_dict(value)


@pytest.mark.parametrize(
    "spec",
    [
        MXSpec("e4m3"),
        NVFP4Spec(),
        IntSpec(8),
        TensorwiseSpec("e4m3", granularity="axis"),
    ],
)
@pytest.mark.parametrize("role", ["input", "weight", "grad_output", "dgrad_weight", "wgrad_grad_output"])
def test_delayed_scaling_with_a_non_tensorwise_spec_is_refused(spec, role):
    fields = dict(input=E4M3, weight=E4M3, grad_output=E5M2, delayed=True)
    fields[role] = spec
    with pytest.raises(ValueError, match="delayed scaling needs per-tensor TensorwiseSpec"):
        Recipe(**fields)
    # and the same specs without delayed scaling are fine
    fields["delayed"] = False
    assert getattr(Recipe(**fields), role) == spec


@pytest.mark.parametrize("algorithm", ["mean", "MAX", "", "most-recent"])
def test_delayed_scaling_with_unknown_amax_algorithm_is_refused(algorithm):
    with pytest.raises(ValueError, match="unknown amax_algorithm .*expected one of: max, most_recent"):
        Recipe(input=E4M3, delayed=True, amax_algorithm=algorithm)
    with pytest.raises(ValueError, match="unknown amax_algorithm"):
        Recipe.from_dict({**get_recipe("fp8_delayed").to_dict(), "amax_algorithm": algorithm})


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
def test_delayed_scaling_accepts_the_known_amax_algorithms(algorithm):
    assert Recipe(input=E4M3, delayed=True, amax_algorithm=algorithm).amax_algorithm == algorithm


@pytest.mark.parametrize(
    "role,value,error", [("input", "fp8_e4m3_typo", ValueError), ("weight", 7, TypeError)]
)
def test_unknown_spec_value_is_refused(role, value, error):
    with pytest.raises(error, match=f"{role}: (unknown quantization spec|spec must be a spec object)"):
        Recipe.from_dict({role: value})


def test_delayed_scaling_with_empty_amax_history_is_refused():
    with pytest.raises(ValueError):
        Recipe(input=E4M3, delayed=True, amax_history_len=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"amax_history_len": -3}, "amax_history_len must be an int ≥ 1"),
        ({"amax_algorithm": "bogus"}, "unknown amax_algorithm 'bogus'"),
        ({"input": {"kind": "MXSpec", "blocksize": 32}}, r"unknown MXSpec fields \['blocksize'\]"),
    ],
)
def test_settings_are_validated_even_without_delayed_scaling(fields, message):
    with pytest.raises(ValueError, match=message):
        Recipe.from_dict(fields)
