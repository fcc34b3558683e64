"""TrainConfig's field table: it covers every field, stores values as given (normalising only what it
says it does) and checks every type before any rule."""

import dataclasses

import pytest

from qlab.train.config import FIELD_RULES, TrainConfig


def test_the_table_has_one_row_per_field_in_field_order():
    assert list(FIELD_RULES) == [f.name for f in dataclasses.fields(TrainConfig)]


def test_values_are_stored_as_given_except_the_documented_normalisations():
    config = TrainConfig(lr=1, weight_decay=0, hidden=(16, 8), grad_clip="1e-1", topk="5e-2")
    assert (type(config.lr), type(config.weight_decay), config.hidden) == (int, int, (16, 8))
    assert (config.grad_clip, config.topk) == (0.1, 0.05)  # YAML 1.1's strings for 1e-1, 5e-2
    config = TrainConfig(recipe="nvfp4", ablate="hadamard", topk_keep="head", backward_override="none")
    assert (config.ablate, config.topk_keep, config.backward_override) == (["hadamard"], ["head"], None)


def test_a_numpy_string_names_a_task_or_recipe():
    numpy = pytest.importorskip("numpy")
    config = TrainConfig(task=numpy.str_("digits"), recipe=numpy.str_("mxfp8"))
    assert (config.task, config.recipe) == ("digits", "mxfp8")


def test_every_type_is_checked_before_any_rule():
    with pytest.raises(TypeError, match="steps must be int"):
        TrainConfig(task="mnist", steps="ten")
    with pytest.raises(TypeError, match="topk must be int or float or NoneType"):
        TrainConfig(recipe="mxfp8", topk="5")  # "5" is no fraction, and a string is no count


def test_a_misspelt_backward_override_is_named_before_whether_the_recipe_takes_one():
    with pytest.raises(ValueError, match="unknown backward_override .dequant.; expected one of"):
        TrainConfig(backward_override="dequant")  # fp32 takes none, but the typo is what to fix first
    with pytest.raises(ValueError, match="needs a quantized recipe"):
        TrainConfig(backward_override="dequantized")
