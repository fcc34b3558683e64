"""Training never continues on a non-finite value and never overwrites a good checkpoint with one;
the CLI turns every user error into one line on stderr and exit status 2 (divergence: 1).

Faults are injected where they happen in real runs: a learning rate that explodes (lr=1e6), an inf
learning rate at one step, a NaN weight decay, a NaN in a data batch, an inf gradient that a
GradScaler must skip; and, for the CLI, malformed YAML, YAML with an object-constructing tag, a
truncated checkpoint and a checkpoint that would run code when unpickled. Every expectation is a
fact of the run (which step stopped, which checkpoint survives, whether a marker file appeared),
never a number the code under test computed.
"""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest
import torch

from qlab import cli
from qlab.train import TrainConfig, train
from qlab.train import loop as L

DIGITS = dict(
    task="digits", hidden=[16], batch_size=16, steps=6, eval_every=100, warmup_steps=0, progress=False
)


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")


def _checkpoint(out):
    state = L.read_checkpoint(out / L.CHECKPOINT)
    finite = all(bool(torch.isfinite(value).all()) for value in state["model"].values())
    return state["step"], finite


def test_an_exploding_learning_rate_stops_at_the_first_nan_and_keeps_the_last_checkpoint(tmp_path):
    config = TrainConfig(**{**DIGITS, "steps": 10}, lr=1e6, checkpoint_every=1, out_dir=str(tmp_path))
    with pytest.raises(
        L.TrainingDiverged, match=r"training stopped at step (\d+): train_loss is nan"
    ) as info:
        train(config)
    stopped = int(info.value.args[0].split("step ")[1].split(":")[0])
    assert 1 < stopped < 10
    assert _checkpoint(tmp_path) == (stopped - 1, True)  # the step before, all parameters finite
    assert f"checkpoint (step {stopped - 1}) is kept" in str(info.value)
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics.step.tolist() == list(range(1, stopped)) and metrics.train_loss.notna().all()


def test_an_inf_learning_rate_is_caught_before_the_checkpoint_it_would_poison(tmp_path, monkeypatch):
    schedule = L.learning_rate
    monkeypatch.setattr(
        L, "learning_rate", lambda config, step: math.inf if step == 2 else schedule(config, step)
    )
    config = TrainConfig(**DIGITS, checkpoint_every=1, out_dir=str(tmp_path))
    with pytest.raises(L.TrainingDiverged) as info:
        train(config)
    message = str(info.value)
    # step 3's update (at lr inf) made the parameters non-finite; its checkpoint is refused
    assert message.startswith("training stopped at step 3: parameters is non-finite at lr inf")
    assert "after the update" in message
    assert _checkpoint(tmp_path) == (2, True)


def test_a_nan_weight_decay_stops_at_step_one_and_writes_no_checkpoint(tmp_path):
    config = TrainConfig(**DIGITS, checkpoint_every=1, out_dir=str(tmp_path))
    config.weight_decay = math.nan  # past the constructor's check, as a notebook edit could do
    with pytest.raises(
        L.TrainingDiverged, match="step 1: parameters is non-finite.*no checkpoint was written"
    ):
        train(config)
    assert not (tmp_path / L.CHECKPOINT).exists()


def test_a_nan_in_the_data_is_named_as_the_cause(tmp_path, monkeypatch):
    real = L.Batches.train

    def poisoned(self, step, micro, rank):
        inputs, targets = real(self, step, micro, rank)
        if step == 3:
            inputs = inputs.clone()
            inputs[0, 0] = math.nan
        return inputs, targets

    monkeypatch.setattr(L.Batches, "train", poisoned)
    config = TrainConfig(**DIGITS, checkpoint_every=1, out_dir=str(tmp_path))
    with pytest.raises(L.TrainingDiverged, match=r"step 4: train_loss is nan .*input batch holds inf or NaN"):
        train(config)
    assert _checkpoint(tmp_path) == (3, True)


def test_a_grad_scaler_skipping_an_overflowing_step_is_reported_not_fatal(monkeypatch):
    # the first two backwards overflow (an inf gradient, as an fp16 overflow gives); GradScaler must
    # skip those optimizer steps and halve its scale (its backoff_factor, 0.5), and training goes on
    build = L.build_model

    def overflowing_first_two(config, *args, **kwargs):
        model = build(config, *args, **kwargs)
        calls = []
        weight = next(model.parameters())
        weight.register_hook(lambda grad: grad * math.inf if len(calls.append(1) or calls) <= 2 else grad)
        return model

    monkeypatch.setattr(L, "build_model", overflowing_first_two)
    result = train(TrainConfig(**DIGITS, grad_scaler=True))
    metrics = result.metrics
    assert metrics.scaler_skipped.tolist() == [True, True, False, False, False, False]
    assert metrics.loss_scale.tolist()[:3] == [2.0**15, 2.0**14, 2.0**14]  # from GradScaler's 2**16
    assert metrics.train_loss.map(math.isfinite).all()
    assert not math.isfinite(metrics.grad_norm.iloc[0]) and math.isfinite(metrics.grad_norm.iloc[-1])


def test_without_a_grad_scaler_an_inf_gradient_stops_training(monkeypatch):
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def overflowing(parameters, max_norm, *args, **kwargs):
        calls.append(1)
        norm = real(parameters, max_norm, *args, **kwargs)
        return torch.full_like(norm, math.inf) if len(calls) == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", overflowing)
    with pytest.raises(L.TrainingDiverged, match="step 2: grad_norm is inf"):
        train(TrainConfig(**DIGITS))


# --- the CLI: one line on stderr, exit status 2 for user errors, 1 for divergence --------------------


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("steps: [1, 2\n", "not valid (safe) YAML"),
        ("steps: 3\n  lr: 2\n", "not valid (safe) YAML"),
        ("a: !!python/object/apply:os.system ['touch {marker}']\n", "not valid (safe) YAML"),
        ("- 1\n- 2\n", "expected a YAML mapping"),
        ("steps: 3\nsteps: 4\n", "the key 'steps' is given twice"),
        ("learning_rate: 1\n", "unknown config keys ['learning_rate']"),
        ("stepz: 3\n", "unknown config keys ['stepz']; did you mean steps for stepz?"),
        ("lr: .inf\n", "lr must be a finite number > 0"),
        ("beta1: 1.5\n", "beta1 must be a finite number in [0, 1)"),
    ],
)
def test_bad_config_files_are_one_line_and_exit_2(tmp_path, capsys, text, expected):
    marker = tmp_path / "marker"
    path = tmp_path / "run.yaml"
    path.write_text(text.format(marker=marker))
    assert cli.main(["train", "--config", str(path)]) == 2
    err = _one_line(capsys)
    assert expected in err
    assert not marker.exists()  # the unsafe tag constructed nothing


def _set(*pairs: str) -> list[str]:
    """``-p KEY VALUE`` arguments for qlab train, one per "KEY=VALUE"."""
    return [item for pair in pairs for item in ("-p", *pair.split("=", 1))]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("lr=[1", "-p lr: not valid (safe) YAML"),
        ("weight_decay=.nan", "weight_decay must be a finite number"),
        ("keep_high_precision=haed", "haed"),  # a keep pattern naming no layer, found when the model is built
    ],
)
def test_bad_overrides_are_one_line_and_exit_2(capsys, override, expected):
    args = ["train", *_set("task=digits", "recipe=mxfp8", "steps=1", override)]
    assert cli.main(args + _set("progress=false")) == 2
    assert expected in _one_line(capsys)


def test_a_keep_pattern_naming_no_layer_is_refused_even_where_nothing_is_quantized(capsys):
    args = [
        "train",
        *_set("task=digits", "recipe=fp32", "steps=1", "keep_high_precision=haed", "progress=false"),
    ]
    assert cli.main(args) == 2
    # the MLP's output layer is layers.2, but the name a user writes is the alias: it comes first
    assert "pattern 'haed' matches no Linear layer; closest names: head" in _one_line(capsys)


def test_nproc_is_refused_by_the_option_typed(capsys):
    assert cli.main(["train", "--nproc", "0"]) == 2
    assert _one_line(capsys) == "qlab: error: --nproc must be an int ≥ 1, got 0"
    assert cli.main(["train", "-p", "nproc", "0"]) == 2
    assert _one_line(capsys) == "qlab: error: nproc must be an int ≥ 1, got 0"


def test_the_old_set_syntax_without_a_value_says_what_it_expected(capsys):
    assert cli.main(["train", "--set", "lr"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "qlab train: --set KEY=VALUE is deprecated; write -p KEY VALUE"
    assert len(lines) == 2 and "expected key=value" in lines[1]


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["truncated", "not torch", "runs code", "not qlab"])
def test_bad_checkpoints_are_one_line_and_exit_2(tmp_path, capsys, kind):
    marker = tmp_path / "marker"
    out = tmp_path / "run"
    out.mkdir()
    args = ["train", *_set("task=digits", "steps=2", "progress=false", f"out_dir={out}", "resume=true")]
    assert cli.main(args[:-3]) == 0  # a good run first, then its checkpoint is spoiled
    good = (out / L.CHECKPOINT).read_bytes()
    spoiled = {
        "truncated": lambda: (out / L.CHECKPOINT).write_bytes(good[: len(good) // 2]),
        "not torch": lambda: (out / L.CHECKPOINT).write_text("hello"),
        "runs code": lambda: torch.save(
            {"step": 1, "model": _RunsCodeWhenUnpickled(marker)}, out / L.CHECKPOINT
        ),
        "not qlab": lambda: torch.save({"weights": torch.ones(2)}, out / L.CHECKPOINT),
    }
    spoiled[kind]()
    capsys.readouterr()
    assert cli.main(args) == 2
    err = _one_line(capsys)
    assert str(out / L.CHECKPOINT) in err
    assert {
        "truncated": "cannot be read",
        "not torch": "cannot be read",
        "runs code": "refusing to unpickle",
        "not qlab": "not a qlab training checkpoint",
    }[kind] in err
    assert "weights_only=False" not in err  # torch's own advice is not passed on
    assert not marker.exists()


def test_a_diverging_run_exits_1_with_one_line(tmp_path, capsys):
    args = ["train", *_set("task=digits", "hidden=[16]", "lr=1e6", "steps=20", "warmup_steps=0")]
    args += _set("progress=false", f"out_dir={tmp_path}")
    assert cli.main(args) == 1
    assert "training stopped at step" in _one_line(capsys)


def test_a_fresh_run_into_another_runs_out_dir_is_refused_before_it_writes(tmp_path):
    first = TrainConfig(**{**DIGITS, "steps": 2}, checkpoint_every=1, out_dir=str(tmp_path))
    train(first)
    before = {name: (tmp_path / name).read_bytes() for name in L.RUN_FILES}
    with pytest.raises(
        ValueError, match=r"holds another run \(checkpoint.pt, metrics.csv, config.yaml\).*resume=true"
    ):
        train(TrainConfig(**{**DIGITS, "steps": 2}, lr=1e6, out_dir=str(tmp_path)))
    assert {name: (tmp_path / name).read_bytes() for name in L.RUN_FILES} == before  # nothing overwritten


def test_resume_without_a_checkpoint_refuses_files_of_a_run_with_other_settings(tmp_path):
    train(TrainConfig(**{**DIGITS, "steps": 2}, out_dir=str(tmp_path)))  # no checkpoint_every: no checkpoint
    (tmp_path / L.CHECKPOINT).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"different settings \['lr'\] and no checkpoint"):
        train(TrainConfig(**{**DIGITS, "steps": 2}, lr=0.5, out_dir=str(tmp_path), resume=True))
    # the same settings restart the run that left no checkpoint, a tuple as its YAML list
    settings = {**DIGITS, "steps": 2, "hidden": (16,)}
    assert train(TrainConfig(**settings, out_dir=str(tmp_path), resume=True)).metrics.step.max() == 2


def test_the_cli_refuses_another_runs_out_dir_in_one_line(tmp_path, capsys):
    args = ["train", *_set("task=digits", "steps=1", "progress=false", f"out_dir={tmp_path}")]
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main(args) == 2
    assert "holds another run" in _one_line(capsys)
