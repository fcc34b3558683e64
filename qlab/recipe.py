"""Recipes: which spec quantizes which operand of a Linear layer's three GEMMs, and how backward runs.

For y = x·Wᵀ with x (tokens N, in K), W (out M, in K) and dy (N, M):

| GEMM | operands | reduction axis | blocks run along |
|---|---|---|---|
| fprop  y  = x·Wᵀ   | x, W   | K | x axis −1, W axis −1 |
| dgrad  dx = dy·W   | dy, W  | M | dy axis −1, W axis 0 |
| wgrad  dW = dyᵀ·x  | dy, x  | N | dy axis 0,  x axis 0 |

A ``Recipe`` names one spec per role (``input``, ``weight``, ``grad_output``; None = not
quantized) and, where a recipe needs different ones, specs for the backward operands
(``dgrad_weight``, ``dgrad_grad_output``, ``wgrad_input``, ``wgrad_grad_output``; None = the
role's spec). Each operand is quantized from high precision along its own GEMM's axis.

``backward_override`` (docs/reference.md §3): None — the recipe's quantized backward; "high_precision" —
dgrad/wgrad from the original x and W, dy never quantized; "dequantized" — from the forward's
quantized x and W (the straight-through estimator of what the forward computed), dy never
quantized. Left unset it comes from the environment variable ``QLAB_BACKWARD_OVERRIDE`` (empty or
"none" means None); an explicit argument wins. Delayed scaling with an override is refused.

``reduce_amax`` (delayed scaling, TransformerEngine's name and default): under torch.distributed every
amax a QuantLinear records is all-reduced (MAX) over the default process group first, so all ranks
keep the same histories and quantize with the same scales. Every rank must then run the same
QuantLinear forward/backward calls in training mode (as DDP does).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from qlab import checks
from qlab.quantize import (
    SPEC_CLASSES,
    BlockwiseSpec,
    IntSpec,
    MXSpec,
    NVFP4Spec,
    Spec,
    TensorwiseSpec,
    get_spec,
)
from qlab.scaling import AMAX_ALGORITHMS

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
ENVIRONMENT_VARIABLE = "QLAB_BACKWARD_OVERRIDE"
ROLES = (
    "input",
    "weight",
    "grad_output",
    "dgrad_weight",
    "dgrad_grad_output",
    "wgrad_input",
    "wgrad_grad_output",
)
_FROM_ENVIRONMENT = "from the environment"


def _override_from_environment() -> str | None:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    value = None if value.lower() in ("", "none") else value
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"the environment variable {ENVIRONMENT_VARIABLE}={value!r} is not a backward_override; expected "
            f"none, high_precision or dequantized (or unset it)"
        )
    return value


@dataclass(frozen=True)
class Recipe:
    """Specs per operand, delayed-scaling settings and the backward override (validated here)."""

    name: str = "custom"
    input: Spec | None = None
    weight: Spec | None = None
    grad_output: Spec | None = None
    dgrad_weight: Spec | None = None
    dgrad_grad_output: Spec | None = None
    wgrad_input: Spec | None = None
    wgrad_grad_output: Spec | None = None
    delayed: bool = False
    amax_history_len: int = 1024
    amax_algorithm: str = "max"
    margin: int = 0
    reduce_amax: bool = True
    backward_override: str | None = _FROM_ENVIRONMENT

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {checks.shown(self.name)}")
        for role in ROLES:
            value = getattr(self, role)
            if value is not None:
                try:
                    object.__setattr__(self, role, get_spec(value))
                except (TypeError, ValueError) as err:
                    raise type(err)(f"{role}: {err}") from None
        if self.backward_override == _FROM_ENVIRONMENT:
            object.__setattr__(self, "backward_override", _override_from_environment())
        elif isinstance(self.backward_override, str) and self.backward_override.strip().lower() == "none":
            object.__setattr__(self, "backward_override", None)  # YAML's `none` is a string
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(
                f"unknown backward_override {self.backward_override!r}; expected None, "
                f"'high_precision' or 'dequantized'"
            )
        checks.boolean("delayed", self.delayed)
        checks.integer("amax_history_len", self.amax_history_len, low=1)
        checks.boolean("reduce_amax", self.reduce_amax)
        checks.choice("amax_algorithm", self.amax_algorithm, AMAX_ALGORITHMS)
        checks.integer("margin", self.margin, low=0, high=127)  # 2^margin a float32 (DelayedScaling)
        if self.delayed:
            used = [getattr(self, role) for role in ROLES if getattr(self, role) is not None]
            if not all(isinstance(spec, TensorwiseSpec) and spec.granularity == "tensor" for spec in used):
                raise ValueError("delayed scaling needs per-tensor TensorwiseSpec operands")
            if self.backward_override is not None:
                raise ValueError(
                    f"backward_override={self.backward_override!r} is not supported with delayed scaling "
                    f"(refused rather than silently ignored); use current scaling, e.g. 'fp8_tensorwise'"
                )

    def spec(self, role: str) -> Spec | None:
        """The spec for a role; backward operands fall back to their forward role's spec."""
        checks.choice("role", role, ROLES)
        value = getattr(self, role)
        if value is None and role.startswith(("dgrad_", "wgrad_")):
            return getattr(self, role.split("_", 1)[1])
        return value

    @property
    def quantizes(self) -> bool:
        return any(getattr(self, role) is not None for role in ROLES)

    def to_dict(self) -> dict:
        """Plain types only (YAML/JSON-safe); ``Recipe.from_dict`` inverts it."""
        out = {"name": self.name}
        for role in ROLES:
            spec = getattr(self, role)
            out[role] = None if spec is None else {"kind": type(spec).__name__, **dataclasses.asdict(spec)}
        out.update(
            delayed=self.delayed,
            amax_history_len=self.amax_history_len,
            amax_algorithm=self.amax_algorithm,
            margin=self.margin,
            reduce_amax=self.reduce_amax,
            backward_override=self.backward_override,
        )
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        if not isinstance(data, dict):
            raise TypeError(f"data must be a dict of Recipe fields, got {checks.shown(data)}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown recipe fields {sorted(unknown)}; expected some of: "
                f"{', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        fields = dict(data)
        for role in ROLES:
            fields[role] = _spec_from_dict(fields.get(role))
        return cls(**fields)

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)


def _spec_from_dict(value):
    if value is None or isinstance(value, str) or not isinstance(value, dict):
        return value
    fields = dict(value)
    kind = fields.pop("kind", None)
    if kind not in SPEC_CLASSES:
        raise ValueError(f"unknown spec kind {kind!r}; expected one of: {', '.join(SPEC_CLASSES)}")
    known = {f.name for f in dataclasses.fields(SPEC_CLASSES[kind])}
    if set(fields) - known:
        raise ValueError(
            f"unknown {kind} fields {sorted(set(fields) - known)}; "
            f"expected some of: {', '.join(sorted(known))}"
        )
    return SPEC_CLASSES[kind](**fields)


def _presets() -> dict[str, dict]:
    e4m3, e5m2 = TensorwiseSpec("e4m3"), TensorwiseSpec("e5m2")
    mx8 = MXSpec("e4m3", mode="rceil")
    return {
        "bf16": {},
        "fp8_tensorwise": dict(input=e4m3, weight=e4m3, grad_output=e5m2),
        "fp8_delayed": dict(input=e4m3, weight=e4m3, grad_output=e5m2, delayed=True),
        "mxfp8": dict(input=mx8, weight=mx8, grad_output=mx8),
        # TE's MXFP8 with enable_2d_quantization: one E8M0 scale per 32×32 weight tile, so the forward and
        # the backward (dgrad) GEMMs see the same quantized weight
        "mxfp8_2d": dict(input=mx8, weight=MXSpec("e4m3", mode="rceil", block_2d=True), grad_output=mx8),
        # DeepSeek-V3 / TE Float8BlockScaling: E4M3 everywhere, 1×128 tiles for activations and gradients,
        # 128×128 blocks for weights, power-of-two scales
        "fp8_blockwise": dict(
            input=BlockwiseSpec("e4m3"),
            weight=BlockwiseSpec("e4m3", block_2d=True),
            grad_output=BlockwiseSpec("e4m3"),
        ),
        "mxfp4": dict(
            input=MXSpec("e2m1"), weight=MXSpec("e2m1"), grad_output=MXSpec("e2m1", rounding="stochastic")
        ),
        "nvfp4": dict(
            input=NVFP4Spec(),
            weight=NVFP4Spec(block_2d=True),
            grad_output=NVFP4Spec(rounding="stochastic"),
            wgrad_input=NVFP4Spec(hadamard=True),
            wgrad_grad_output=NVFP4Spec(hadamard=True, rounding="stochastic"),
        ),
        # "Training LLMs with MXFP4" (Tseng et al. 2025): the forward stays in high precision; the backward
        # GEMMs run in MXFP4 with stochastic rounding, and the wgrad operands are Hadamard-rotated first.
        # The paper's reference code also scales each operand by 3/4 before SR (and the output by 16/9) so
        # that FLOOR's scale cannot saturate it; this preset does not (notebook 07 measures the difference)
        "mxfp4_training": dict(
            dgrad_grad_output=MXSpec("e2m1", rounding="stochastic"),
            dgrad_weight=MXSpec("e2m1", rounding="stochastic"),
            wgrad_grad_output=MXSpec("e2m1", rounding="stochastic", hadamard=True),
            wgrad_input=MXSpec("e2m1", rounding="stochastic", hadamard=True),
        ),
        "int8_per_token": dict(input=IntSpec(8, granularity="axis"), weight=IntSpec(8, granularity="axis")),
    }


PRESETS = tuple(_presets())


def get_recipe(recipe: str | dict | Recipe | None = None, *, backward_override=_FROM_ENVIRONMENT) -> Recipe:
    """A Recipe from a preset name, a dict (``Recipe.to_dict``'s shape) or a Recipe.

    Presets: bf16 (no quantization), fp8_tensorwise (E4M3 forward, E5M2 gradients, current scaling),
    fp8_delayed (the same with delayed scaling), mxfp8 (E4M3, RCEIL, blocks of 32), mxfp8_2d (the same
    with 32×32 weight tiles), fp8_blockwise (E4M3, 1×128 tiles, 128×128 weight blocks, power-of-two
    scales), mxfp4 (E2M1, FLOOR, stochastic rounding on gradients), mxfp4_training (forward in high
    precision, backward GEMMs in MXFP4 with stochastic rounding and RHT on the wgrad operands), nvfp4
    (16×16 weight tiles, RHT on the wgrad operands, stochastic rounding on gradients), int8_per_token
    (the seed's symmetric per-token INT8 activations and per-output-channel INT8 weights).
    ``backward_override`` given here wins over the recipe's.
    """
    if recipe is None:
        recipe = "bf16"
    if isinstance(recipe, Recipe):
        result = recipe
    elif isinstance(recipe, dict):
        result = Recipe.from_dict(recipe)
    elif isinstance(recipe, str) and recipe in PRESETS:
        fields = _presets()[recipe]
        if backward_override != _FROM_ENVIRONMENT:
            fields["backward_override"] = backward_override
        return Recipe(name=recipe, **fields)
    elif isinstance(recipe, str):
        raise ValueError(
            f"unknown recipe {recipe!r}; expected a Recipe, a dict or one of: {', '.join(PRESETS)}"
        )
    else:
        raise TypeError(f"recipe must be a preset name, a dict or a Recipe, got {checks.shown(recipe)}")
    if backward_override != _FROM_ENVIRONMENT:
        result = result.replace(backward_override=backward_override)
    return result
