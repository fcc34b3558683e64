"""TrainConfig: every setting of a training run, validated on construction; YAML in, YAML out.

The same field names are ``qlab train --set key=value`` keys, the YAML file's keys and (where a
notebook exposes them) notebook parameters; an unknown key is an error, never ignored.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from qlab import checks
from qlab.ablation import INGREDIENTS, uses
from qlab.nn import check_gemm
from qlab.numerics import LAYER_NORM_STATS
from qlab.recipe import PRESETS, get_recipe
from qlab.sparse import MODES as TOPK_MODES
from qlab.sparse import check_k

TASKS = ("shakespeare", "digits")
BASELINES = ("fp32", "bf16")  # no quantization; bf16 runs the model under bf16 autocast
RECIPES = BASELINES + tuple(name for name in PRESETS if name != "bf16")
AUTOCAST_DTYPES = (None, "bf16", "fp16")
LAYER_NORM_ACC = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("adamw", "sgd")
COMPILE_MODES = ("default", "reduce-overhead")  # torch.compile's modes that train offers
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass
class TrainConfig:
    """A training run. ``batch_size`` is the global batch (sequences or images per optimizer step),
    split over ``nproc`` processes and ``grad_accum`` micro-batches; lr follows linear warmup then a
    cosine decay to ``lr * min_lr_ratio`` at ``steps``."""

    task: str = "shakespeare"
    recipe: str = "fp32"  # fp32, bf16 or a qlab.recipe preset
    backward_override: str | None = None  # None, "high_precision" or "dequantized"
    gemm: str = (
        "auto"  # QuantLinear's GEMMs: "auto" (FP8 tensor cores where CUDA has them), "emulated", "scaled_mm"
    )
    compile: bool = False  # torch.compile the steps: CharGPT's blocks (one shared graph), under DDP the model
    # with compile: "default", or "reduce-overhead" (CUDA graphs around the compiled code on a GPU; no
    # change on a CPU): fewer host calls a step, where a small model's GPU step waits on its host
    compile_mode: str = "default"
    ablate: list[str] = field(
        default_factory=list
    )  # recipe ingredients switched off (qlab.ablation.INGREDIENTS)
    keep_high_precision: list[str] | dict[str, list[str]] = field(
        default_factory=lambda: ["head", "last_layer"]
    )
    # model (CharGPT for shakespeare, MLP for digits)
    context: int = 128
    layers: int = 5
    width: int = 128
    heads: int = 4
    tied_head: bool = True
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    # optimization
    steps: int = 1000
    batch_size: int = 32
    grad_accum: int = 1
    nproc: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0
    optimizer: str = (
        "adamw"  # "adamw", or "sgd" (no momentum: with weight_decay 0 only weights with a gradient move)
    )
    autocast: str | None = None  # None, "bf16" or "fp16"
    layer_norm: str = (
        "torch"  # "torch" (nn.LayerNorm), or qlab.numerics statistics: textbook, two_pass, welford
    )
    layer_norm_acc: str = "fp32"  # what those statistics accumulate in: "fp32", "bf16" or "fp16"
    grad_scaler: bool = False  # torch.amp.GradScaler (dynamic loss scaling)
    # sparse back-propagation (qlab.sparse): keep the top-k output-gradient features of each Linear
    topk: int | float | None = None  # None = dense; a count, or a fraction of each layer's outputs
    topk_mode: str = "shared"  # "shared" (gathered GEMMs) or "row" (per-row sets, sparse GEMMs)
    topk_keep: list[str] = field(default_factory=lambda: ["head", "last_layer"])  # layers left dense
    # evaluation, logging, checkpoints
    track_updates: bool = False  # log the fraction of Linear weights with a non-zero gradient / that moved
    eval_every: int = 100
    eval_batches: int = 8
    fidelity_every: int = 0  # 0 = off; else per-layer weight-gradient fidelity against fp32 every N steps
    checkpoint_every: int = 0  # 0 = only at the end (when out_dir is set)
    out_dir: str | None = None
    resume: bool = False
    progress: bool = True
    seed: int = 0
    device: str = "auto"

    def __post_init__(self):
        if isinstance(self.backward_override, str) and self.backward_override.strip().lower() == "none":
            self.backward_override = None
        for f in dataclasses.fields(self):  # YAML 1.1 reads 3e-4 (no dot) as a string
            value = getattr(self, f.name)
            fraction = f.name == "topk" and isinstance(value, str) and any(c in value for c in ".eE")
            if (
                (isinstance(f.default, float) or fraction)
                and isinstance(value, str)
                and _FLOAT.fullmatch(value.strip())
            ):
                setattr(self, f.name, float(value))
        self._check_types()
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; expected one of: {', '.join(TASKS)}")
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; expected one of: {', '.join(RECIPES)}")
        if self.recipe in BASELINES and self.backward_override is not None:
            raise ValueError(
                f"backward_override={self.backward_override!r} needs a quantized recipe, "
                f"got the unquantized baseline {self.recipe!r}"
            )
        if self.recipe not in BASELINES:
            get_recipe(self.recipe, backward_override=self.backward_override)  # refuses bad combinations
        self.ablate = list(checks.names("ablate", self.ablate, tuple(INGREDIENTS)))
        if self.ablate and self.recipe in BASELINES:
            raise ValueError(
                f"ablate={self.ablate} switches off parts of a quantized recipe; got {self.recipe!r}"
            )
        absent = [i for i in self.ablate if not uses(get_recipe(self.recipe, backward_override=None), i)]
        if absent:
            raise ValueError(
                f"ablate: recipe {self.recipe!r} does not use {absent}; there is nothing to switch off"
            )
        check_gemm(self.gemm, get_recipe("bf16" if self.recipe in BASELINES else self.recipe))
        checks.choice("compile_mode", self.compile_mode, COMPILE_MODES)
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(
                f"compile_mode={self.compile_mode!r} sets how the steps are compiled; it needs compile=True"
            )
        if self.compile_mode == "reduce-overhead" and self.nproc > 1:
            raise ValueError(
                f"compile_mode='reduce-overhead' runs in one process, got nproc={self.nproc}: under DDP the "
                f"gradient all-reduce runs inside backward, between the CUDA graphs, untested here"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; expected one of: {', '.join(OPTIMIZERS)}"
            )
        if self.topk_mode not in TOPK_MODES:
            raise ValueError(
                f"unknown topk_mode {self.topk_mode!r}; expected one of: {', '.join(TOPK_MODES)}"
            )
        if self.topk is not None:
            check_k(self.topk)
            if self.recipe not in BASELINES:
                raise ValueError(
                    f"topk sparse back-propagation runs on unquantized layers; got recipe "
                    f"{self.recipe!r} (use fp32 or bf16)"
                )
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"unknown autocast {self.autocast!r}; expected None, 'bf16' or 'fp16'")
        checks.choice("layer_norm", self.layer_norm, ("torch", *LAYER_NORM_STATS))
        checks.choice("layer_norm_acc", self.layer_norm_acc, tuple(LAYER_NORM_ACC))
        if self.layer_norm == "torch" and self.layer_norm_acc != "fp32":
            raise ValueError(
                f"layer_norm_acc={self.layer_norm_acc!r} applies to qlab's LayerNorm statistics; "
                f"choose layer_norm='textbook', 'two_pass' or 'welford'"
            )
        if self.recipe == "bf16" and self.autocast not in (None, "bf16"):
            raise ValueError(f"recipe 'bf16' runs under bf16 autocast; got autocast={self.autocast!r}")
        if not (
            isinstance(self.hidden, (list, tuple))
            and self.hidden
            and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in self.hidden)
        ):
            raise ValueError(f"hidden must be a non-empty list of positive ints, got {self.hidden!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(
                    f"unknown device {self.device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
                ) from None
        positive = (
            "steps",
            "batch_size",
            "grad_accum",
            "nproc",
            "eval_batches",
            "context",
            "layers",
            "width",
        )
        for name in (*positive, "heads", "eval_every"):
            checks.integer(name, getattr(self, name), low=1)
        for name in ("warmup_steps", "fidelity_every", "checkpoint_every"):
            checks.integer(name, getattr(self, name), low=0)
        checks.seed("seed", self.seed)
        if self.batch_size % (self.nproc * self.grad_accum):
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by nproc × grad_accum = "
                f"{self.nproc} × {self.grad_accum}"
            )
        checks.number("lr", self.lr, low=0, open_low=True)
        checks.number("min_lr_ratio", self.min_lr_ratio, low=0, high=1)
        checks.number("weight_decay", self.weight_decay, low=0)
        checks.number("beta1", self.beta1, low=0, high=1, open_high=True)
        checks.number("beta2", self.beta2, low=0, high=1, open_high=True)
        if self.grad_clip is not None:
            checks.number("grad_clip", self.grad_clip, low=0, open_low=True)
        self._check_keep_patterns()
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.resume and not self.out_dir:
            raise ValueError("resume=True needs out_dir (where the checkpoint is)")

    def _check_types(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(type(f.default))
            if f.name in ("grad_clip", "topk"):
                expected = (int, float, type(None))
            if f.name in ("backward_override", "autocast", "out_dir"):
                expected = (str, type(None))
            if expected and (
                not isinstance(value, expected) or (bool not in expected and isinstance(value, bool))
            ):
                raise TypeError(
                    f"{f.name} must be {' or '.join(t.__name__ for t in expected)}, "
                    f"got {type(value).__name__} {value!r}"
                )
        if not isinstance(self.topk_keep, (list, tuple, str)):
            raise TypeError(
                f"topk_keep must be a pattern or a list of patterns, got {checks.shown(self.topk_keep)}"
            )
        if not isinstance(self.keep_high_precision, (list, tuple, dict, str)):
            raise TypeError(
                f"keep_high_precision must be a pattern, a list of patterns or a dict recipe -> patterns, "
                f"got {checks.shown(self.keep_high_precision)}"
            )

    def _check_keep_patterns(self):
        """A bare string is one pattern (never split into characters); a dict maps recipe names (or
        "default") to patterns. Whether each pattern names a layer is checked when the model is built."""
        keep = self.keep_high_precision
        if isinstance(keep, dict):
            unknown = sorted(set(keep) - set(RECIPES) - {"default"})
            if unknown:
                raise ValueError(
                    f"keep_high_precision keys {unknown} are not recipes; expected some of: "
                    f"{', '.join(RECIPES)}, default"
                )
            self.keep_high_precision = {
                recipe: checks.patterns(f"keep_high_precision[{recipe!r}]", patterns)
                for recipe, patterns in keep.items()
            }
        else:
            self.keep_high_precision = checks.patterns("keep_high_precision", keep)
        self.topk_keep = checks.patterns("topk_keep", self.topk_keep)

    @property
    def micro_batch(self) -> int:
        """Sequences (or images) per process per micro-batch."""
        return self.batch_size // (self.nproc * self.grad_accum)

    def keep_patterns(self) -> list[str]:
        """The layers this run's recipe keeps in high precision (fnmatch patterns)."""
        keep = self.keep_high_precision
        if isinstance(keep, dict):
            keep = keep.get(self.recipe, keep.get("default", []))
        return list(keep)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        if not isinstance(data, dict):
            raise TypeError(f"a training config is a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; expected some of: {', '.join(sorted(known))}")
        return cls(**data)

    def replace(self, **changes) -> TrainConfig:
        return self.from_dict({**self.to_dict(), **changes})


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """A TrainConfig from a YAML file (optional) with ``key=value`` overrides (values parsed as YAML)."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = _safe_yaml(path.read_text(errors="replace"), f"config file {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping of config keys, got {type(loaded).__name__}")
        data.update(loaded or {})
    if isinstance(overrides, dict):
        data.update(overrides)
    elif overrides is not None and not isinstance(overrides, (list, tuple)):
        raise TypeError(
            f"overrides must be a list of 'key=value' strings or a dict, got {checks.shown(overrides)}"
        )
    else:
        for item in overrides or []:
            key, sep, value = str(item).partition("=")
            if not sep or not key.strip():
                raise ValueError(f"expected key=value, got {item!r}")
            data[key.strip()] = _safe_yaml(value, f"--set {key.strip()}")
    return TrainConfig.from_dict(data)


def _safe_yaml(text: str, where: str):
    """YAML through the safe loader (no tags that construct objects); errors name ``where``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"{where}: not valid (safe) YAML: {detail}") from None
