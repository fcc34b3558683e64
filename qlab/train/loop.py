"""The training loop: ``train(config)``, that runs on a laptop CPU or under torchrun. It reads like
nanoGPT's: setup (``_start``: model, ``make_optimizer``, resume), then per step ``_train_step``,
``_evaluate_into`` and ``_save_outputs`` (checkpoint and CSVs).

Per optimizer step: ``grad_accum`` micro-batches (loss / grad_accum, backward; DDP syncs only on
the last), optional GradScaler unscale, gradient clipping, AdamW (or SGD) with warmup + cosine lr. Batches
are drawn statelessly from (seed, step): step s's global batch is the same whatever the number of
processes, each rank taking its slice (the distributed sampler), so a resumed or a 2-process run
sees exactly the batches of the uninterrupted 1-process run. Validation loss is measured every
``eval_every`` steps (and at the last) on a fixed validation subset.

Outputs (rank 0, when ``out_dir`` is set): metrics.csv (step, tokens, train_loss, val_loss,
grad_norm, lr, time_s; val_accuracy for digits; grad_nonzero_fraction and updated_fraction with
``track_updates``), fidelity.csv, config.yaml, vocab.json and
checkpoint.pt (state dicts, loadable with ``torch.load(weights_only=True)``). Metrics files are
replaced atomically, so a crash never leaves a half-written CSV.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn import functional as F

from qlab import checks, paths
from qlab.ablation import without
from qlab.host import progress, resolve_device
from qlab.kernels.compiled import COMPILE_OPTIONS
from qlab.kernels.noise import NOISE_STAYS_OUT_OF_CUDA_GRAPHS
from qlab.nn import QuantLinear, linear_layers, plain_linears, quantize_model
from qlab.numerics import use_stats_layer_norms
from qlab.probes import gradient_agreement
from qlab.recipe import get_recipe
from qlab.results import write_csv
from qlab.sparse import TopKLinear, sparsify_model
from qlab.train import data as D
from qlab.train.config import BASELINES, COMPILE_MODES, LAYER_NORM_ACC, TrainConfig
from qlab.train.models import MLP, CharGPT

CHECKPOINT = "checkpoint.pt"
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What ``train`` returns: the metric rows, the fidelity rows, the trained model and its wall time."""

    metrics: pd.DataFrame
    fidelity: pd.DataFrame
    model: nn.Module
    seconds: float
    probes: object | None = None


# --- set-up ------------------------------------------------------------------------------------------


def _distributed(config: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); joins the process group when launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != config.nproc:
        raise ValueError(
            f"config.nproc={config.nproc} but {world_size} processes were launched; "
            f"use `qlab train --nproc {config.nproc}` (or torchrun --nproc_per_node {config.nproc})"
        )
    device = resolve_device(config.device, argument="device")
    if world_size == 1:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return dist.get_rank(), world_size, device


def _check_config(config) -> None:
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {checks.shown(config)}")


def build_model(config: TrainConfig, vocab_size: int | None = None, rank: int = 0) -> nn.Module:
    """The config's model, initialized from ``config.seed`` (torch's global RNG is left as it was),
    quantized by its recipe (kept layers excepted). Stochastic rounding is seeded per rank, as each
    GPU has its own generator: rank r's layers draw from seed + 10000·r."""
    _check_config(config)
    if vocab_size is not None or config.task == "shakespeare":
        checks.integer("vocab_size", vocab_size, low=1)
    checks.integer("rank", rank, low=0, high=(2**63 - 1 - config.seed) // 10_000)  # the seeds stay seeds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        if config.task == "shakespeare":
            model = CharGPT(
                vocab_size,
                context=config.context,
                layers=config.layers,
                width=config.width,
                heads=config.heads,
                tied_head=config.tied_head,
            )
        else:
            model = MLP(64, tuple(config.hidden), 10)
    if config.layer_norm != "torch":
        use_stats_layer_norms(model, config.layer_norm, LAYER_NORM_ACC[config.layer_norm_acc])
    if config.recipe_plan is not None:
        quantize_model(model, config.recipe_plan, seed=config.seed + 10_000 * rank, gemm=config.gemm)
    else:
        _check_keep_names(model, config)  # a baseline quantizes nothing, but a typo is still a typo
        if config.recipe not in BASELINES:
            quantize_model(
                model,
                without(get_recipe(config.recipe, backward_override=config.backward_override), config.ablate),
                keep_high_precision=_keep_patterns(model, config),
                seed=config.seed + 10_000 * rank,
                gemm=config.gemm,
            )
    if config.topk is not None:
        keep = [pattern for name in config.topk_keep for pattern in _expand(model, name)]
        sparsify_model(model, config.topk, mode=config.topk_mode, keep=keep)
    return model


def _check_keep_names(model: nn.Module, config: TrainConfig) -> None:
    """Every keep_high_precision entry is one of ``_expand``'s names or matches a Linear layer; a typo is
    refused with the closest of both (the names a user is told to write come first)."""
    names = [name for name, _, why in linear_layers(model) if why is None]
    aliases = ["head", "last_layer"] + (["first_block", "last_block"] if isinstance(model, CharGPT) else [])
    for pattern in config.keep_patterns():
        if pattern in ("head", "last_layer", "first_block", "last_block"):
            _expand(model, pattern)  # names them, or says why this model has none
            continue
        if not any(checks.matches(name, pattern) for name in names):
            near = ", ".join(checks.closest(pattern, aliases + names))
            raise ValueError(
                f"keep_high_precision pattern {pattern!r} matches no Linear layer; closest names: {near}"
            )


def _keep_patterns(model: nn.Module, config: TrainConfig) -> list[str]:
    """The config's keep_high_precision as fnmatch patterns of ``model``'s layer names."""
    return [pattern for name in config.keep_patterns() for pattern in _expand(model, name)]


def _expand(model: nn.Module, pattern: str) -> list[str]:
    """'first_block' / 'last_block' name CharGPT's first / last block; 'head' and 'last_layer' both
    name the output layer (CharGPT's ``head``, the MLP's last ``layers.{i}``); anything else is an
    fnmatch pattern."""
    if pattern in ("first_block", "last_block"):
        if not isinstance(model, CharGPT):
            raise ValueError(f"{pattern!r} names a transformer block; the {type(model).__name__} has none")
        return model.block_patterns(first=int(pattern == "first_block"), last=int(pattern == "last_block"))
    if pattern in ("head", "last_layer"):
        return [f"layers.{len(model.layers) - 1}"] if isinstance(model, MLP) else ["head"]
    return [pattern]


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from lr to lr·min_lr_ratio at ``steps``."""
    _check_config(config)
    checks.integer("step", step, low=0)
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    low = config.lr * config.min_lr_ratio
    return low + 0.5 * (config.lr - low) * (1 + math.cos(math.pi * min(progress, 1.0)))


def autocast_for(config: TrainConfig, device: torch.device):
    """The context-manager factory a training forward runs under: torch.autocast to bf16 for the bf16
    recipe, to ``config.autocast``'s dtype where set, else a null context."""
    _check_config(config)
    device = resolve_device(device, argument="device")
    name = "bf16" if config.recipe == "bf16" else config.autocast
    if not name:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=_AUTOCAST_DTYPES[name])


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on the matrices only; ``learning_rate`` sets the lr each step."""
    _check_config(config)
    checks.module("model", model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))
    return torch.optim.SGD(groups, lr=config.lr)


def compiled_step_model(model: nn.Module, mode: str = "default") -> nn.Module:
    """The model for the training steps, compiled: QuantLinear gives the same bits as eagerly
    (tests/test_compile.py). Its float32 GEMMs need "highest" matmul precision, PyTorch's default, which
    compiled code cannot switch on by itself.

    ``mode`` "reduce-overhead" runs the compiled code of a CUDA model as CUDA graphs (inductor's
    ``triton.cudagraphs``; nothing changes on a CPU): one launch replays a graph's kernels, where a small
    model's step otherwise waits on the host to launch them one by one. Stochastic rounding's draws stay
    outside the graphs (``qlab::stochastic_noise`` is tagged cudagraph_unsafe, so inductor runs it
    between graph partitions: a replay would repeat the recorded draws). Call
    ``torch.compiler.cudagraph_mark_step_begin()`` once per optimizer step, after ``zero_grad``.

    A model with repeated ``blocks`` (CharGPT) gets its blocks compiled, one graph that every block
    shares, and the rest eager: a copy of the model object that shares every parameter, buffer and
    module with it, so the model itself stays eager (evaluation, fidelity, what ``train`` returns).
    Compiling the whole model would generate one graph of all the blocks: several times the first
    step's compile time (benchmarks/bench_train.py), for steps only a few percent faster."""
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        raise ValueError(
            f"compile=True needs torch.set_float32_matmul_precision('highest') (PyTorch's default) for "
            f"QuantLinear's float32 GEMMs; this process set {precision!r}"
        )
    checks.choice("mode", mode, COMPILE_MODES)
    options = COMPILE_OPTIONS  # keeps each quantizer's element loop in one fused pass
    if mode == "reduce-overhead":
        if not NOISE_STAYS_OUT_OF_CUDA_GRAPHS:
            raise ValueError(
                f"compile_mode='reduce-overhead' needs a torch with torch.Tag.cudagraph_unsafe (this is "
                f"{torch.__version__}): without it CUDA graphs would replay stochastic rounding's draws"
            )
        options = {**COMPILE_OPTIONS, "triton.cudagraphs": True}  # torch.compile's mode, with the options
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config, "graph_partition"):  # on by default; without it no graph
            options["graph_partition"] = True  # holding the noise op or its CPU key would be captured
    # a fresh cache per run: 8 runs in one process would hit Dynamo's recompile limit and quietly run
    # the rest eagerly
    torch._dynamo.reset()
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return torch.compile(model, dynamic=False, options=options)
    step_model = copy.copy(model)  # its own module table below; the same parameters and submodules
    compiled = nn.ModuleList(torch.compile(block, dynamic=False, options=options) for block in blocks)
    step_model._modules = {**model._modules, "blocks": compiled}
    return step_model


# --- data ----------------------------------------------------------------------------------------------


class Batches:
    """Stateless batches: ``train(step, micro, rank)`` depends only on (seed, step), never on history.

    A Shakespeare item is a window of context + 1 tokens of a split's stream (inputs and the targets one
    token on), starting at a position drawn uniformly from 0 .. len − context − 2: the last possible
    start, len − context − 1, is never drawn (the seeded draws of every run depend on that range), so
    each split needs at least context + 2 tokens. Step s draws from a generator seeded with
    (seed · 1000003 + s) mod 2⁶⁴."""

    def __init__(self, config: TrainConfig):
        _check_config(config)
        self.config = config
        if config.task == "shakespeare":
            corpus = D.shakespeare()
            self.vocabulary = corpus.vocabulary
            self.train_data, self.val_data = corpus.train, corpus.val
            for split, stream in (("train", self.train_data), ("validation", self.val_data)):
                if len(stream) < config.context + 2:
                    raise ValueError(
                        f"context {config.context} needs a split of at least context + 2 = "
                        f"{config.context + 2} tokens (windows of context + 1 tokens), but the {split} split "
                        f"holds {len(stream)} tokens; choose a shorter context"
                    )
        else:
            images = D.digits(0)  # one split for every seed: seed bands measure training, not the split
            self.vocabulary = None
            self.train_data, self.val_data = (images.train_x, images.train_y), (images.val_x, images.val_y)

    def _draw(self, indices: torch.Tensor, split: str):
        if self.config.task == "shakespeare":
            stream = self.train_data if split == "train" else self.val_data
            window = indices[:, None] + torch.arange(self.config.context + 1)
            tokens = stream[window]
            return tokens[:, :-1], tokens[:, 1:]
        x, y = self.train_data if split == "train" else self.val_data
        return x[indices], y[indices]

    def _population(self, split: str) -> int:
        if self.config.task == "shakespeare":
            stream = self.train_data if split == "train" else self.val_data
            return len(stream) - self.config.context - 1
        return len((self.train_data if split == "train" else self.val_data)[1])

    def global_indices(self, step: int) -> torch.Tensor:
        """Step ``step``'s whole batch, shaped (grad_accum, nproc, micro_batch)."""
        c = self.config
        # reduced mod 2⁶⁴, the seeds a generator takes: the same seed below 2⁶⁴, and no overflow above
        generator = torch.Generator().manual_seed((c.seed * 1_000_003 + step) % 2**64)
        indices = torch.randint(self._population("train"), (c.batch_size,), generator=generator)
        return indices.view(c.grad_accum, c.nproc, c.micro_batch)

    def train(self, step: int, micro: int, rank: int):
        return self._draw(self.global_indices(step)[micro, rank], "train")

    def validation(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation subset: eval_batches × batch_size windows (digits: the whole split)."""
        c = self.config
        if c.task == "digits":
            return [self.val_data]
        generator = torch.Generator().manual_seed(7919)  # the same subset for every seed
        indices = torch.randint(self._population("val"), (c.eval_batches, c.batch_size), generator=generator)
        return [self._draw(row, "val") for row in indices]

    def fidelity_batch(self, index: int = 0):
        """A fixed training batch (batch_size items) on which gradients are compared; ``index`` 1 gives
        a second one, for the mini-batch noise floor."""
        generator = torch.Generator().manual_seed(104729 + index)
        return self._draw(
            torch.randint(self._population("train"), (self.config.batch_size,), generator=generator), "train"
        )


# --- measurements ---------------------------------------------------------------------------------------


def _loss(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, autocast
) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast():
        logits = model(inputs)
    logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten()), logits


_CLASS_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _checked_loss(model, inputs, targets, autocast, names=("inputs", "targets")):
    """``_loss`` on a batch the caller gave, refused naming the argument it came from (``names``) where
    the model cannot run the inputs or the targets are no class index per output row."""
    checks.tensor(names[0], inputs)
    checks.tensor(names[1], targets, dtypes=_CLASS_INDEX_DTYPES)
    with autocast():
        try:
            logits = model(inputs)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            raise ValueError(
                f"{names[0]} {tuple(inputs.shape)} {inputs.dtype}: the model cannot run it: {err}"
            ) from err
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"{names[1]} must hold a class index per row of the model's output for {names[0]}, shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    classes = logits.shape[-1]
    low, high = (int(targets.min()), int(targets.max())) if targets.numel() else (0, 0)
    if low < 0 or high >= classes:
        raise ValueError(f"{names[1]} must hold class indices in [0, {classes}), got {low} to {high}")
    logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.long().flatten()), logits


def _check_pair(name: str, batch) -> tuple:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{name} must be an (inputs, targets) pair of tensors, got {checks.shown(batch)}")
    return tuple(batch)


@torch.no_grad()
def evaluate(model: nn.Module, batches, autocast, device) -> dict[str, float]:
    """Mean cross-entropy (nats per token or per image) over ``batches`` of (inputs, targets); accuracy for
    images."""
    checks.module("model", model)
    batches = checks.batches("batches", batches)
    pairs = [_check_pair(f"batches[{index}]", batch) for index, batch in enumerate(batches)]
    checks.function("autocast", autocast, "a context-manager factory (autocast_for's)")
    device = resolve_device(device, argument="device")
    was_training = model.training
    model.eval()
    losses, correct, count = [], 0, 0
    for index, (inputs, targets) in enumerate(pairs):
        names = (f"batches[{index}][0]", f"batches[{index}][1]")
        checks.tensor(names[0], inputs)
        checks.tensor(names[1], targets)
        loss, logits = _checked_loss(model, inputs.to(device), targets.to(device), autocast, names)
        losses.append(loss.item())
        correct += (logits.argmax(-1) == targets.to(device)).sum().item()
        count += targets.numel()
    model.train(was_training)
    return {"val_loss": sum(losses) / len(losses), "val_accuracy": correct / count}


def gradient_fidelity(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast=contextlib.nullcontext,
    other_batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[dict]:
    """Per Linear weight, the model's gradient on one batch against two references at the same weights,
    as ``cosine`` similarity and ``relative_error`` ‖g − g_ref‖/‖g_ref‖ (float64):

    - FP32 (``cosine``, ``relative_error``): every layer a plain nn.Linear (no quantization, no top-k),
      no autocast;
    - the exact gradient of the model's own forward (``exact_cosine``, ``exact_relative_error``): the
      same quantized forward under the same autocast, differentiated by the chain rule through the
      forward's dequantized operands (straight-through quantizers; every QuantLinear's ``exact_backward``,
      delayed scaling included; top-k layers dense). The "dequantized" override is this by construction.

    With ``other_batch`` (inputs, targets), also what the data alone moves a gradient by:
    ``noise_cosine`` and ``noise_relative_error`` of the FP32 gradient on ``other_batch`` against the
    FP32 gradient on this batch (a fidelity reads against it).

    Works on deep copies: the model, its gradients and its stochastic-rounding generators are untouched.
    """
    checks.module("model", model)
    checks.function("autocast", autocast, "a context-manager factory (autocast_for's)")
    if other_batch is not None:
        other_batch = _check_pair("other_batch", other_batch)
    measured = copy.deepcopy(model)
    exact = copy.deepcopy(model)
    plain_linears(exact, TopKLinear)
    for module in exact.modules():
        if isinstance(module, QuantLinear):
            module.exact_backward = True
    reference = copy.deepcopy(model)
    plain_linears(reference)
    passes = [(measured, inputs, targets, autocast), (exact, inputs, targets, autocast)]
    passes.append((reference, inputs, targets, contextlib.nullcontext))
    if other_batch is not None:
        passes.append((reference, *other_batch, contextlib.nullcontext, ("other_batch[0]", "other_batch[1]")))
    measured, exact, fp32, *other = [_weight_gradients(*one_pass) for one_pass in passes]
    tables = {"": gradient_agreement(measured, fp32), "exact_": gradient_agreement(measured, exact)}
    if other:
        tables["noise_"] = gradient_agreement(other[0], fp32)
    rows = []
    for index, name in enumerate(fp32):  # gradient_agreement keeps the reference's order
        row = {"layer": name, "quantized": type(model.get_submodule(name)) is not nn.Linear}
        for prefix, table in tables.items():
            row[f"{prefix}cosine"] = float(table.cosine.iloc[index])  # plain floats: weights_only checkpoints
            row[f"{prefix}relative_error"] = float(table.relative_error.iloc[index])
        rows.append(row)
    return rows


def _weight_gradients(model: nn.Module, inputs, targets, autocast, names=("inputs", "targets")) -> dict:
    """Every Linear weight's gradient (float64) of the loss on one batch (``names``: the arguments it came
    from, which a refusal names)."""
    model.zero_grad(set_to_none=True)
    _checked_loss(model, inputs, targets, autocast, names)[0].backward()
    return {
        name: module.weight.grad.double()
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [module.weight for module in model.modules() if isinstance(module, nn.Linear)]


def _update_footprint(weights, before) -> dict[str, float]:
    """Fraction of Linear weight entries with a non-zero gradient, and that the optimizer step moved."""
    total = sum(w.numel() for w in weights)
    nonzero = sum(int((w.grad != 0).sum()) for w in weights if w.grad is not None)
    moved = sum(int((w.detach() != b).sum()) for w, b in zip(weights, before))
    return {"grad_nonzero_fraction": nonzero / total, "updated_fraction": moved / total}


# --- checkpoints ---------------------------------------------------------------------------------------


def _quant_states(model: nn.Module) -> dict:
    return {
        name: module.quant_state()
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear)
    }


def _quant_states_by_rank(model: nn.Module, world_size: int) -> list[dict]:
    """Every rank's QuantLinear states (index = rank), gathered on all ranks: each rank has its own
    stochastic-rounding generators. A collective under DDP: every rank must call it."""
    states = _quant_states(model)
    if world_size == 1:
        return [states]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, states)
    return gathered


def save_checkpoint(
    path: Path,
    *,
    step,
    model,
    optimizer,
    scaler,
    metrics,
    fidelity,
    config,
    quant_by_rank: list[dict] | None = None,
) -> None:
    """Write the checkpoint atomically. ``quant_by_rank``: every rank's QuantLinear states under DDP
    (default: this process's only)."""
    quant_by_rank = quant_by_rank if quant_by_rank is not None else [_quant_states(model)]
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "quant": quant_by_rank[0],
        "quant_by_rank": quant_by_rank,
        "metrics": metrics,
        "fidelity": fidelity,
        "config": config.to_dict(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


_CHECKPOINT_KEYS = ("step", "model", "optimizer", "scaler", "metrics", "fidelity", "config")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A qlab checkpoint's contents, loaded with ``weights_only=True`` (tensors and plain containers
    only: nothing in the file can run code). A file that is missing, truncated, not a torch file,
    holds other objects, or lacks a qlab checkpoint's keys raises ValueError naming the file."""
    import pickle

    path = paths.existing_file("path", path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"path {path}: the checkpoint holds objects other than tensors and plain containers, which "
            f"qlab never writes; refusing to unpickle it (it could run code)"
        ) from None
    except Exception as err:  # truncated, not a zip, a text file: torch and pickle raise many kinds
        detail = " ".join(str(err).split())[:200]
        raise ValueError(
            f"path {path}: the checkpoint cannot be read (truncated or not a torch checkpoint): {detail}"
        ) from None
    missing = [key for key in _CHECKPOINT_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise ValueError(f"path {path} is not a qlab training checkpoint (missing {missing})")
    return state


RESUMABLE_CHANGES = ("resume", "progress", "out_dir", "checkpoint_every", "nproc")


def _changed_settings(saved: dict, current: dict) -> list[str]:
    """The settings a resumed run may not change (all but ``RESUMABLE_CHANGES``) whose saved value
    differs from the current one; only the fields saved count (an older run may lack newer ones)."""
    return sorted(k for k in saved if k in current and k not in RESUMABLE_CHANGES and saved[k] != current[k])


RUN_FILES = (CHECKPOINT, "metrics.csv", "config.yaml")  # what a run leaves in its out_dir


def check_out_dir(config) -> None:
    """Refuse an ``out_dir`` holding another run's files before anything is written or trained: a fresh
    run (resume=false) would overwrite that run's config.yaml and metrics.csv, and a divergence before
    its own first checkpoint would name the other run's checkpoint as its last finite one. With
    resume=true and no checkpoint, the files left must be those of a run with the same settings."""
    if not config.out_dir:
        return
    out_dir = Path(config.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir must be a folder (one to make, or a run's), got the file {out_dir}")
    found = [name for name in RUN_FILES if (out_dir / name).is_file()]
    if not found:
        return
    where = f"out_dir {out_dir} holds another run ({', '.join(found)})"
    if not config.resume:
        raise ValueError(
            f"{where}: resume=true continues it; to start afresh, give another out_dir or remove those files"
        )
    if CHECKPOINT in found or "config.yaml" not in found:
        return  # load_checkpoint compares the checkpoint's settings
    try:
        saved = yaml.safe_load((out_dir / "config.yaml").read_text(encoding="utf-8"))
    except (ValueError, yaml.YAMLError) as err:
        raise ValueError(f"{out_dir / 'config.yaml'} cannot be read as a run's config: {err}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{out_dir / 'config.yaml'} is not a run's config (a YAML mapping)")
    # compared as written: tuples come back from YAML as lists
    changed = _changed_settings(saved, yaml.safe_load(yaml.safe_dump(config.to_dict())))
    if changed:
        raise ValueError(
            f"{where}, written with different settings {changed} and no checkpoint to resume from: give "
            "another out_dir or remove those files"
        )


def load_checkpoint(path: Path, *, model, optimizer, scaler, config, rank: int = 0) -> dict:
    """Restore a checkpoint into the run's objects — bit for bit on CPU (gloo), also under DDP: rank r
    takes rank r's QuantLinear states (stochastic-rounding generators, delayed-scaling histories). A rank the
    checkpoint has no states for (resumed with more processes, or a checkpoint from before
    ``quant_by_rank``) takes rank 0's histories and restarts its generators."""
    state = read_checkpoint(path)
    changed = _changed_settings(state["config"], config.to_dict())
    if changed:
        raise ValueError(
            f"{path} was written by a run with different settings {changed}; resume with the "
            f"same config (the lr schedule depends on steps, so even steps must match)"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    by_rank = state.get("quant_by_rank") or [state["quant"]]
    for name, quant in (by_rank[rank] if rank < len(by_rank) else by_rank[0]).items():
        model.get_submodule(name).load_quant_state(
            quant if rank < len(by_rank) else {**quant, "generators": {}}
        )
    return state


# --- stopping on non-finite values ---------------------------------------------------------------------


class TrainingDiverged(FloatingPointError):
    """Training met a non-finite loss, gradient norm or parameter. The message names the step (1-based,
    as in metrics.csv), the quantity and the last checkpoint, which is never overwritten by the failure."""


def _first_nonfinite_parameter(model: nn.Module) -> str | None:
    """The name of the first parameter holding inf or NaN (one host sync for the whole model)."""
    named = list(model.named_parameters())
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]) if named else None
    if finite is None or bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


@dataclass
class Divergence:
    """What a step knows when it must stop: enough to say why, and to keep what was written."""

    step: int
    lr: float
    model: nn.Module
    inputs: list
    out_dir: Path | None
    metrics: list
    fidelity: list
    rank: int

    def raise_for(self, quantity: str, value: float) -> None:
        causes = []
        bad_parameter = _first_nonfinite_parameter(self.model)
        if bad_parameter is not None:
            when = (
                "before this step's update"
                if quantity != "parameters"
                else f"after the update (lr {self.lr:.3g})"
            )
            causes.append(f"parameter {bad_parameter} is already non-finite {when}")
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in self.inputs):
            causes.append("the step's input batch holds inf or NaN")
        checkpoint = "no checkpoint was written"
        if self.out_dir is not None and (self.out_dir / CHECKPOINT).exists():
            saved = read_checkpoint(self.out_dir / CHECKPOINT)["step"]
            checkpoint = f"the last finite checkpoint (step {saved}) is kept in {self.out_dir / CHECKPOINT}"
        if self.out_dir is not None and self.rank == 0 and self.metrics:  # the finite steps so far
            write_csv(pd.DataFrame(self.metrics), self.out_dir / "metrics.csv")
            if self.fidelity:
                write_csv(pd.DataFrame(self.fidelity), self.out_dir / "fidelity.csv")
        shown = "non-finite" if quantity == "parameters" else f"{value}"
        reason = f" ({'; '.join(causes)})" if causes else ""
        raise TrainingDiverged(
            f"training stopped at step {self.step}: {quantity} is {shown} at lr {self.lr:.3g}{reason}; "
            f"{checkpoint}"
        )


# --- the loop ---------------------------------------------------------------------------------------------


def train(config: TrainConfig, *, probes=None) -> TrainResult:
    """Train ``config``'s model; see the module docstring. ``probes``: a callable model → ProbeSet,
    attached for the run (param grads recorded after unscaling on sampled steps)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train expects a TrainConfig as config, got {checks.shown(config)}")
    if probes is not None:
        checks.function("probes", probes, "a function model → ProbeSet")
    run = _start(config, probes)
    elapsed = run.metrics[-1]["time_s"] if run.metrics else 0.0
    progress = _progress(config, run.rank, run.start)
    began = time.perf_counter()
    try:
        for step in range(run.start, config.steps):
            row, stop = _train_step(run, step)
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                _evaluate_into(row, run, stop)
            row["time_s"] = elapsed + time.perf_counter() - began
            run.metrics.append(row)
            progress.update(1)
            progress.set_postfix(loss=f"{row['train_loss']:.3f}", refresh=False)
            _save_outputs(run, row, stop)
    finally:
        progress.close()
        if run.probe_set is not None:
            run.probe_set.detach()
    seconds = time.perf_counter() - began
    return TrainResult(
        pd.DataFrame(run.metrics), pd.DataFrame(run.fidelity), run.trained, seconds, run.probe_set
    )


def _progress(config: TrainConfig, rank: int, start: int):
    label = config.recipe + (f"/{config.backward_override}" if config.backward_override else "")
    return progress(
        total=config.steps,
        initial=start,
        desc=label,
        unit="step",
        leave=False,
        disable=not config.progress or rank != 0,
    )


@dataclass
class _Run:
    """Everything one training run holds between steps."""

    config: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    batches: Batches
    trained: nn.Module  # the model itself (evaluation, fidelity, checkpoints)
    model: nn.Module  # what the micro-batches go through: DDP's wrapper under torchrun
    step_model: nn.Module  # ``model``, compiled when config.compile
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: object  # a context-manager factory
    out_dir: Path | None
    metrics: list
    fidelity: list
    start: int
    probe_set: object
    validation: object
    fidelity_inputs: list | None


def _start(config: TrainConfig, probes) -> _Run:
    """Build the model, optimizer and scaler; resume from the checkpoint; write config and vocabulary."""
    rank, world_size, device = _distributed(config)
    check_out_dir(config)  # every rank, before any rank writes
    if world_size > 1:
        dist.barrier()
    batches = Batches(config)
    vocab_size = len(batches.vocabulary) if batches.vocabulary is not None else None
    model = build_model(config, vocab_size, rank).to(device)
    autocast = autocast_for(config, device)
    optimizer = make_optimizer(config, model)
    scaler = torch.amp.GradScaler(device.type, enabled=config.grad_scaler)
    out_dir = Path(config.out_dir) if config.out_dir else None
    metrics, fidelity, start = [], [], 0
    if out_dir is not None and config.resume and (out_dir / CHECKPOINT).exists():
        state = load_checkpoint(
            out_dir / CHECKPOINT, model=model, optimizer=optimizer, scaler=scaler, config=config, rank=rank
        )
        start, metrics, fidelity = state["step"], list(state["metrics"]), list(state["fidelity"])
    if out_dir is not None and rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=True))
        if batches.vocabulary is not None:
            batches.vocabulary.save(out_dir / "vocab.json")
    trained = model
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    step_model = model  # evaluation and fidelity run the model eagerly
    if config.compile:
        step_model = compiled_step_model(model, config.compile_mode)
    probe_set = probes(trained) if probes is not None else None
    if probe_set is not None:
        probe_set.current_step = start
        probe_set.attach()
    fidelity_inputs = None
    if config.fidelity_every:
        fidelity_inputs = [tuple(t.to(device) for t in batches.fidelity_batch(index)) for index in (0, 1)]
    return _Run(
        config, rank, world_size, device, batches, trained, model, step_model, optimizer, scaler, autocast,
        out_dir, metrics, fidelity, start, probe_set, batches.validation(), fidelity_inputs,
    )  # fmt: skip


def _train_step(run: _Run, step: int) -> tuple[dict, Divergence]:
    """One optimizer step: the micro-batches' backward, unscale, clip, the divergence checks, the
    update. Returns the step's metrics row (no val_loss yet) and the Divergence that reports a failure."""
    config, trained = run.config, run.trained
    if run.fidelity_inputs is not None and step % config.fidelity_every == 0:
        batch, other_batch = run.fidelity_inputs
        rows = gradient_fidelity(trained, *batch, run.autocast, other_batch)
        run.fidelity += [{"step": step, **row} for row in rows]
    lr = learning_rate(config, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    train_loss = torch.zeros((), device=run.device)
    step_inputs = []
    if config.compile and config.compile_mode == "reduce-overhead":
        # once a step, after zero_grad: the CUDA graphs may now reuse the last step's memory. Not once a
        # micro-batch: the next would free the gradients the last one's backward left in .grad
        torch.compiler.cudagraph_mark_step_begin()
    for micro in range(config.grad_accum):
        inputs, targets = (t.to(run.device) for t in run.batches.train(step, micro, run.rank))
        step_inputs.append(inputs)
        sync = micro == config.grad_accum - 1 or run.world_size == 1
        with contextlib.nullcontext() if sync else run.model.no_sync():
            loss = _loss(run.step_model, inputs, targets, run.autocast)[0] / config.grad_accum
            run.scaler.scale(loss).backward()
        train_loss += loss.detach()
    run.scaler.unscale_(run.optimizer)
    if run.probe_set is not None and run.probe_set.sampling():
        run.probe_set.record_param_grads()
    grad_norm = nn.utils.clip_grad_norm_(trained.parameters(), config.grad_clip or math.inf)
    if run.world_size > 1:  # before the checks, so every rank takes the same decision
        dist.all_reduce(train_loss)
        train_loss /= run.world_size
    loss_value, norm_value = train_loss.item(), grad_norm.item()
    stop = Divergence(step + 1, lr, trained, step_inputs, run.out_dir, run.metrics, run.fidelity, run.rank)
    if not math.isfinite(loss_value):
        stop.raise_for("train_loss", loss_value)
    skipped = not math.isfinite(norm_value)  # GradScaler skips such a step and lowers its scale
    if skipped and not config.grad_scaler:
        stop.raise_for("grad_norm", norm_value)
    before = [w.detach().clone() for w in _linear_weights(trained)] if config.track_updates else None
    run.scaler.step(run.optimizer)
    run.scaler.update()
    if run.probe_set is not None:
        run.probe_set.step()
    tokens_per_item = config.context if config.task == "shakespeare" else 1
    row = {
        "step": step + 1,
        "tokens": (step + 1) * config.batch_size * tokens_per_item,
        "train_loss": loss_value,
        "val_loss": math.nan,
        "grad_norm": norm_value,
        "lr": lr,
    }
    if config.grad_scaler:  # the step GradScaler skipped (inf/NaN gradients) and its scale after it
        row.update(scaler_skipped=skipped, loss_scale=run.scaler.get_scale())
    if before is not None:
        row.update(_update_footprint(_linear_weights(trained), before))
    return row, stop


def _evaluate_into(row: dict, run: _Run, stop: Divergence) -> None:
    """Add the validation loss (and digits' accuracy) to ``row``; a non-finite one stops the run."""
    row.update(evaluate(run.trained, run.validation, run.autocast, run.device))
    if run.config.task == "shakespeare":
        row.pop("val_accuracy")
    if not math.isfinite(row["val_loss"]):
        stop.raise_for("val_loss", row["val_loss"])


def _save_outputs(run: _Run, row: dict, stop: Divergence) -> None:
    """The checkpoint (every checkpoint_every steps and at the last; never over a good one with
    non-finite parameters) and the metrics CSVs (after an evaluation and at the last step)."""
    config, step = run.config, row["step"]
    if run.out_dir is None:
        return
    last = step == config.steps
    if last or (config.checkpoint_every and step % config.checkpoint_every == 0):
        if _first_nonfinite_parameter(run.trained) is not None:
            stop.raise_for("parameters", math.nan)
        quant_by_rank = _quant_states_by_rank(run.trained, run.world_size)  # a collective: all ranks
        if run.rank == 0:
            save_checkpoint(
                run.out_dir / CHECKPOINT,
                step=step,
                model=run.trained,
                optimizer=run.optimizer,
                scaler=run.scaler,
                metrics=run.metrics,
                fidelity=run.fidelity,
                config=config,
                quant_by_rank=quant_by_rank,
            )
    if run.rank == 0 and (last or not math.isnan(row["val_loss"])):
        write_csv(pd.DataFrame(run.metrics), run.out_dir / "metrics.csv")
        if run.fidelity:
            write_csv(pd.DataFrame(run.fidelity), run.out_dir / "fidelity.csv")
