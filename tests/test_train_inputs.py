"""qlab.train's inputs at their edges: Batches' splits and seeds, the digits split, Vocabulary.decode and
CharGPT's ids.

References: the stream lengths and the seed formula written out here ((seed · 1000003 + step) mod 2⁶⁴
into a fresh torch.Generator), sklearn.datasets.load_digits' count, and texts indexed by hand from
the vocabulary's characters. Errors are matched on the words that name the argument, what was
expected and what came.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qlab.train import TrainConfig
from qlab.train import data as D
from qlab.train import loop as L
from qlab.train import models as M

TINY = dict(layers=1, width=16, progress=False)


# --- Batches: a split shorter than a window, seeds up to the largest the config takes ---------------------


def test_batches_refuse_a_context_the_validation_split_cannot_hold():
    val = D.shakespeare().val
    longest = len(val) - 2  # one start position left: 0
    batches = L.Batches(TrainConfig(context=longest, batch_size=1, eval_batches=1, **TINY))
    ((inputs, targets),) = batches.validation()
    assert torch.equal(inputs[0], val[:longest]) and torch.equal(targets[0], val[1 : longest + 1])
    with pytest.raises(
        ValueError, match=rf"context {longest + 1} .* the validation split holds {len(val)} tokens"
    ):
        L.Batches(TrainConfig(context=longest + 1, batch_size=1, eval_batches=1, **TINY))


def test_batches_refuse_a_context_longer_than_the_training_split():
    train = D.shakespeare().train
    with pytest.raises(
        ValueError, match=rf"context {len(train)} .* the train split holds {len(train)} tokens"
    ):
        L.Batches(TrainConfig(context=len(train), batch_size=1, **TINY))


@pytest.mark.parametrize("seed", [0, 5, 2**40 - 1, 2**62, 2**63 - 1])
def test_batch_draws_follow_the_seed_formula_mod_2_to_the_64(seed):
    config = TrainConfig(seed=seed, context=32, batch_size=8, grad_accum=2, **TINY)
    starts = len(D.shakespeare().train) - 32 - 1  # start positions 0 .. len − context − 2
    batches = L.Batches(config)
    for step in (0, 3, 999):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**64)
        expected = torch.randint(starts, (8,), generator=generator)
        assert torch.equal(batches.global_indices(step).flatten(), expected)


# --- digits: neither split empty ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "val_fraction, words",
    [(0.0002, "into 1797 training and 0 validation images"), (0.9999, "into 0 training and 1797 validation")],
)
def test_digits_refuse_a_fraction_that_empties_a_split(val_fraction, words):
    with pytest.raises(ValueError, match=rf"val_fraction {val_fraction} splits the 1797 digits {words}"):
        D.digits(0, val_fraction)


def test_digits_take_a_split_of_one_image():
    from sklearn.datasets import load_digits

    total = len(load_digits().target)
    one_val = D.digits(0, 1 / total)
    one_train = D.digits(0, (total - 1) / total)
    assert (len(one_val.train_y), len(one_val.val_y)) == (total - 1, 1)
    assert (len(one_train.train_y), len(one_train.val_y)) == (1, total - 1)


# --- Vocabulary.decode ---------------------------------------------------------------------------------


def test_decode_takes_integer_tensors_arrays_and_lists():
    vocabulary = D.Vocabulary("cab")  # characters "abc": a = 0, b = 1, c = 2
    assert vocabulary.decode(torch.tensor([2, 0, 1])) == "cab"
    assert vocabulary.decode(torch.tensor([[2, 0], [1, 1]], dtype=torch.int32)) == "cabb"
    assert vocabulary.decode(np.array([1, 2], dtype=np.uint8)) == "bc"
    assert vocabulary.decode([0, np.int64(2)]) == "ac"
    assert vocabulary.decode((1,)) == "b"
    assert vocabulary.decode(range(3)) == "abc"
    assert vocabulary.decode([]) == ""


@pytest.mark.parametrize(
    "ids, error, words",
    [
        ([0, -1], ValueError, r"ids must lie in \[0, 3\) .* got id -1"),
        (torch.tensor([3]), ValueError, r"ids must lie in \[0, 3\) .* got id 3"),
        (np.array([1, 7]), ValueError, r"\[0, 3\) .* got id 7"),
        ([1.0, 2.0], TypeError, r"ids must hold ints, got 1\.0 \(float\)"),
        ([True], TypeError, r"ids must hold ints, got True \(bool\)"),
        (torch.tensor([1.0]), TypeError, "ids must be an integer tensor, got dtype torch.float32"),
        (torch.tensor([True]), TypeError, "ids must be an integer tensor, got dtype torch.bool"),
        (np.array([0.5]), TypeError, "ids must be an integer array, got dtype float64"),
        ("012", TypeError, r"ids must be an integer tensor .* got '012' \(str\)"),
        (None, TypeError, r"got None \(NoneType\)"),
    ],
)
def test_decode_refuses_ids_out_of_range_or_not_integers(ids, error, words):
    with pytest.raises(error, match=words):
        D.Vocabulary("abc").decode(ids)


# --- CharGPT's ids and CausalSelfAttention's heads ----------------------------------------------------


@pytest.mark.parametrize(
    "ids, error, words",
    [
        ([[1, 2]], TypeError, r"CharGPT expects ids as an int64 tensor .* got \[\[1, 2\]\] \(list\)"),
        (torch.tensor([[1, 10]]), ValueError, r"ids must lie in \[0, 10\) .* got ids from 1 to 10"),
        (torch.tensor([[-1, 3]]), ValueError, r"ids must lie in \[0, 10\) .* got ids from -1 to 3"),
    ],
)
def test_chargpt_refuses_ids_that_are_not_a_tensor_or_out_of_the_vocabulary(ids, error, words):
    model = M.CharGPT(10, context=8, layers=1, width=16)
    with pytest.raises(error, match=words):
        model(ids)
    assert model(torch.tensor([[0, 9]])).shape == (1, 2, 10)  # both ends of the range are ids


@pytest.mark.parametrize(
    "width, heads, error, words",
    [
        (8, 0, ValueError, r"heads must be an int ≥ 1, got 0"),
        (8, 3, ValueError, "width 8 must be divisible by heads 3"),
        (8, 2.0, TypeError, r"heads must be an int ≥ 1, got 2\.0 \(float\)"),
        (0, 1, ValueError, r"width must be an int ≥ 1, got 0"),
    ],
)
def test_attention_refuses_heads_that_do_not_divide_the_width(width, heads, error, words):
    with pytest.raises(error, match=words):
        M.CausalSelfAttention(width, heads)
