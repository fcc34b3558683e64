"""TrainConfig: every setting of a training run, validated on construction; YAML in, YAML out.

The same field names are ``qlab train -p KEY VALUE`` keys, the YAML file's keys and (where a
notebook exposes them) notebook parameters; an unknown key is an error, never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from qlab import checks
from qlab.ablation import INGREDIENTS, uses
from qlab.nn import check_gemm
from qlab.numerics import LAYER_NORM_STATS
from qlab.recipe import BACKWARD_OVERRIDES, PRESETS, get_recipe
from qlab.sparse import MODES as TOPK_MODES
from qlab.sparse import check_k

TASKS = ("shakespeare", "digits")
KEEP_DEFAULT = ["head", "last_layer"]  # the layers a recipe leaves in high precision unless told
BASELINES = ("fp32", "bf16")  # no quantization; bf16 runs the model under bf16 autocast
RECIPES = BASELINES + tuple(name for name in PRESETS if name != "bf16")
AUTOCAST_DTYPES = (None, "bf16", "fp16")
LAYER_NORM_ACC = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("adamw", "sgd")
COMPILE_MODES = ("default", "reduce-overhead")  # torch.compile's modes that train offers
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NONE = type(None)
_REAL = (int, float)  # an int is a float here


def _check(check, *args, **options):
    """A rule that applies ``check(name, value, *args, **options)`` and keeps the value as given: an int
    lr stays an int, as config.yaml and a run's cache key hold it."""

    def rule(name, value):
        check(name, value, *args, **options)
        return value

    return rule


def _among(name, value, choices):
    """One of ``choices`` by == alone, so a str subclass such as numpy.str_ (a name taken from an array)
    counts as its str; checks.choice, which the other choice fields use, asks for str itself."""
    if value not in choices:
        checks.choice(name, value, choices)  # raises, naming the field and the choices


def _hidden_widths(name, value):
    if not (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in value)
    ):
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {value!r}")


def _device(name, value):
    """'auto', or a device torch parses: 'cpu', 'cuda', 'cuda:1', ..."""
    if value != "auto":
        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(
                f"unknown {name} {value!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
            ) from None


def _keep_patterns(name, value):
    """A bare string is one pattern (never split into characters); a dict maps recipe names (or
    "default") to patterns. Whether each pattern names a layer is checked when the model is built."""
    if not isinstance(value, dict):
        return checks.patterns(name, value)
    unknown = sorted(set(value) - set(RECIPES) - {"default"})
    if unknown:
        raise ValueError(
            f"{name} keys {unknown} are not recipes; expected some of: {', '.join(RECIPES)}, default"
        )
    return {recipe: checks.patterns(f"{name}[{recipe!r}]", patterns) for recipe, patterns in value.items()}


def _plan_file(name, value):
    """A plan file qlab.plan can read (its layers are checked against the model when it is built)."""
    from qlab.plan import Plan

    Plan.load(value)


# Each TrainConfig field's (types, rule). Every field's type is checked before any rule runs, so a wrong
# type is a TypeError whatever else is wrong; types None: any type, the rule decides. rule(name, value)
# returns the value to store (a bare pattern string becomes a list); rule None: the type is all there is
# to check for that field alone. A None value, where the types take it, means "off" and skips the rule.
# The rules over several fields follow in TrainConfig.__post_init__.
FIELD_RULES = {
    "task": (str, _check(_among, TASKS)),
    "recipe": (str, _check(_among, RECIPES)),
    "recipe_plan": ((str, _NONE), _check(_plan_file)),
    "backward_override": ((str, _NONE), None),  # what the recipe allows (get_recipe)
    "gemm": (str, None),  # what the recipe can run (check_gemm)
    "compile": (bool, None),
    "compile_mode": (str, _check(checks.choice, COMPILE_MODES)),
    "ablate": (None, lambda name, value: list(checks.names(name, value, tuple(INGREDIENTS)))),
    "keep_high_precision": ((list, tuple, dict, str), _keep_patterns),
    # model
    "context": (int, _check(checks.integer, low=1)),
    "layers": (int, _check(checks.integer, low=1)),
    "width": (int, _check(checks.integer, low=1)),
    "heads": (int, _check(checks.integer, low=1)),
    "tied_head": (bool, None),
    "hidden": (None, _check(_hidden_widths)),  # any wrong value, of any type, is a ValueError
    # optimization
    "steps": (int, _check(checks.integer, low=1)),
    "batch_size": (int, _check(checks.integer, low=1)),
    "grad_accum": (int, _check(checks.integer, low=1)),
    "nproc": (int, _check(checks.integer, low=1)),
    "lr": (_REAL, _check(checks.number, low=0, open_low=True)),
    "min_lr_ratio": (_REAL, _check(checks.number, low=0, high=1)),
    "warmup_steps": (int, _check(checks.integer, low=0)),
    "weight_decay": (_REAL, _check(checks.number, low=0)),
    "beta1": (_REAL, _check(checks.number, low=0, high=1, open_high=True)),
    "beta2": (_REAL, _check(checks.number, low=0, high=1, open_high=True)),
    "grad_clip": ((*_REAL, _NONE), _check(checks.number, low=0, open_low=True)),
    "optimizer": (str, _check(_among, OPTIMIZERS)),
    "autocast": ((str, _NONE), _check(_among, AUTOCAST_DTYPES)),
    "layer_norm": (str, _check(checks.choice, ("torch", *LAYER_NORM_STATS))),
    "layer_norm_acc": (str, _check(checks.choice, tuple(LAYER_NORM_ACC))),
    "grad_scaler": (bool, None),
    # sparse back-propagation
    "topk": ((*_REAL, _NONE), _check(lambda name, k: check_k(k))),  # an int count or a float fraction
    "topk_mode": (str, _check(_among, TOPK_MODES)),
    "topk_keep": ((list, tuple, str), checks.patterns),
    # evaluation, logging, checkpoints
    "track_updates": (bool, None),
    "eval_every": (int, _check(checks.integer, low=1)),
    "eval_batches": (int, _check(checks.integer, low=1)),
    "fidelity_every": (int, _check(checks.integer, low=0)),
    "checkpoint_every": (int, _check(checks.integer, low=0)),
    "out_dir": ((str, _NONE), None),
    "resume": (bool, None),
    "progress": (bool, None),
    "seed": (int, _check(checks.seed)),
    "device": (str, _check(_device)),
}


def _typed(name: str, value, types):
    """``value`` if it is one of ``types`` (a type, a tuple of types or None for any), else TypeError; a
    float YAML 1.1 read as a string (3e-4, no dot) becomes that float first where the field takes one."""
    types = (types,) if isinstance(types, type) else types or ()
    if (
        float in types
        and isinstance(value, str)
        and _FLOAT.fullmatch(value.strip())
        and (name != "topk" or any(c in value for c in ".eE"))  # a topk of "5" is not a count
    ):
        value = float(value)
    if types and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
        raise TypeError(
            f"{name} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__} {value!r}"
        )
    return value


@dataclass
class TrainConfig:
    """A training run. ``batch_size`` is the global batch (sequences or images per optimizer step),
    split over ``nproc`` processes and ``grad_accum`` micro-batches; lr follows linear warmup then a
    cosine decay to ``lr * min_lr_ratio`` at ``steps``."""

    task: str = "shakespeare"
    recipe: str = "fp32"  # fp32, bf16 or a qlab.recipe preset
    # a qlab.plan file (qlab advise --formats): each layer in its planned format; recipe is then fp32
    # or bf16, what the layers the plan keeps high run in, and keep_high_precision is the plan's
    recipe_plan: str | None = None
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
    keep_high_precision: list[str] | dict[str, list[str]] = field(default_factory=lambda: list(KEEP_DEFAULT))
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
        for name, (types, _) in FIELD_RULES.items():  # every type before any rule
            setattr(self, name, _typed(name, getattr(self, name), types))
        for name, (types, rule) in FIELD_RULES.items():
            value = getattr(self, name)
            if rule is not None and not (value is None and types is not None):  # None where typed: off
                setattr(self, name, rule(name, value))

        # rules that need several fields
        baseline = self.recipe in BASELINES
        if self.recipe_plan is not None:
            self._check_plan_fields(baseline)
        # a backward override changes a quantized recipe's backward: a baseline has none to change
        if self.backward_override is not None:  # a typo is named as one, whatever the recipe
            checks.choice("backward_override", self.backward_override, BACKWARD_OVERRIDES[1:])
        if baseline and self.backward_override is not None:
            raise ValueError(
                f"backward_override={self.backward_override!r} needs a quantized recipe, "
                f"got the unquantized baseline {self.recipe!r}"
            )
        if not baseline:
            get_recipe(self.recipe, backward_override=self.backward_override)  # refuses bad combinations
        # ablate switches off ingredients the recipe uses
        if self.ablate and baseline:
            raise ValueError(
                f"ablate={self.ablate} switches off parts of a quantized recipe; got {self.recipe!r}"
            )
        absent = [i for i in self.ablate if not uses(get_recipe(self.recipe, backward_override=None), i)]
        if absent:
            raise ValueError(
                f"ablate: recipe {self.recipe!r} does not use {absent}; there is nothing to switch off"
            )
        # a baseline's layers are plain Linears; its gemm is checked as bf16's would be
        check_gemm(self.gemm, get_recipe("bf16" if baseline else self.recipe))
        # a compile mode without compile would quietly do nothing
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(
                f"compile_mode={self.compile_mode!r} sets how the steps are compiled; it needs compile=True"
            )
        # CUDA graphs and DDP's all-reduce inside backward are not known to work together
        if self.compile_mode == "reduce-overhead" and self.nproc > 1:
            raise ValueError(
                f"compile_mode='reduce-overhead' runs in one process, got nproc={self.nproc}: under DDP the "
                f"gradient all-reduce runs inside backward, between the CUDA graphs, untested here"
            )
        # qlab.sparse wraps plain Linears, not QuantLinears
        if self.topk is not None and not baseline:
            raise ValueError(
                f"topk sparse back-propagation runs on unquantized layers; got recipe "
                f"{self.recipe!r} (use fp32 or bf16)"
            )
        # nn.LayerNorm has no accumulation setting: only qlab's statistics take one
        if self.layer_norm == "torch" and self.layer_norm_acc != "fp32":
            raise ValueError(
                f"layer_norm_acc={self.layer_norm_acc!r} applies to qlab's LayerNorm statistics; "
                f"choose layer_norm='textbook', 'two_pass' or 'welford'"
            )
        # the bf16 baseline is bf16 autocast; another autocast would contradict it
        if self.recipe == "bf16" and self.autocast not in (None, "bf16"):
            raise ValueError(f"recipe 'bf16' runs under bf16 autocast; got autocast={self.autocast!r}")
        # the global batch splits evenly over processes and micro-batches
        if self.batch_size % (self.nproc * self.grad_accum):
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by nproc × grad_accum = "
                f"{self.nproc} × {self.grad_accum}"
            )
        # attention splits the width evenly over the heads
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        # a resumed run reads its checkpoint from out_dir
        if self.resume and not self.out_dir:
            raise ValueError("resume=True needs out_dir (where the checkpoint is)")

    def _check_plan_fields(self, baseline: bool) -> None:
        """A plan decides each layer's format: the fields that would decide it too are refused."""
        from qlab.plan import Plan

        if not baseline:
            raise ValueError(
                f"recipe_plan gives each layer its format; recipe must be fp32 or bf16 (what the layers the "
                f"plan keeps high run in), got {self.recipe!r}"
            )
        clashing = {
            "backward_override": self.backward_override is not None,
            "ablate": bool(self.ablate),
            "topk": self.topk is not None,
            "keep_high_precision": self.keep_high_precision != KEEP_DEFAULT,
        }
        set_too = [name for name, is_set in clashing.items() if is_set]
        if set_too:
            raise ValueError(f"recipe_plan decides each layer's format; leave {', '.join(set_too)} unset")
        for name in set(Plan.load(self.recipe_plan).layers.values()) - set(BASELINES):
            check_gemm(self.gemm, get_recipe(name))

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
            near = {key: difflib.get_close_matches(key, sorted(known), n=1) for key in unknown}
            hints = "".join(f"did you mean {near[key][0]} for {key}? " for key in unknown if near[key])
            raise ValueError(
                f"unknown config keys {unknown}; {hints}expected some of: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def replace(self, **changes) -> TrainConfig:
        return self.from_dict({**self.to_dict(), **changes})


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict | None = None, argument: str = "path"
) -> TrainConfig:
    """A TrainConfig from a YAML file (optional) with ``key=value`` overrides (values parsed as YAML).
    Errors about the file name ``argument`` (what the caller typed: ``--config`` on the command line)."""
    from qlab import paths

    data = {}
    if path is not None:
        path = paths.existing_file(argument, path, "config file")
        where = f"{argument} {paths.shown(path)}"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{where} is not UTF-8 text: {err}") from None
        loaded = _safe_yaml(text, where)
        if not isinstance(loaded, dict):  # an empty file too: it would train the defaults unasked
            kind = "an empty file" if loaded is None else type(loaded).__name__
            raise ValueError(f"{where}: expected a YAML mapping of config keys, got {kind}")
        data.update(loaded)
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
                raise ValueError(f"overrides: expected key=value, got {item!r}")
            data[key.strip()] = _safe_yaml(value, f"-p {key.strip()}")
    return TrainConfig.from_dict(data)


def _safe_yaml(text: str, where: str):
    """YAML through the safe loader (no tags that construct objects); errors name ``where``."""
    try:
        return checks.yaml_value(text)
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"{where}: not valid (safe) YAML: {detail}") from None
