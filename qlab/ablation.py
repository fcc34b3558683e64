"""Which parts of a low-precision recipe matter: recipe variants with one ingredient switched off,
and the error each leaves in the three GEMMs of a Linear layer (notebook 07).

    errors = gemm_errors(get_recipe("nvfp4"), x, weight, grad_output)   # {"fprop": …, "dgrad": …, "wgrad": …}
    variants = ablations("nvfp4")                                       # {"nvfp4": Recipe, "no 2D weight": …}

``gemm_errors`` runs one ``QuantLinear`` forward and backward and compares y = x·Wᵀ, dx = dy·W and
dW = dyᵀ·x with the same products in float64 (relative Frobenius error ‖Ŷ − Y‖/‖Y‖): the error the
recipe's quantized operands leave in each GEMM's output, which element SQNR cannot show (the Hadamard
transform is meant to act on wgrad, whose reduction runs over tokens).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from qlab import checks
from qlab.recipe import PRESETS, ROLES, Recipe, get_recipe

GEMMS = ("fprop", "dgrad", "wgrad")
ABLATED_RECIPES = ("nvfp4", "mxfp4_training")
# what each ingredient's removal changes: (roles, spec field, value)
INGREDIENTS = {
    "2d_weight": (("weight", "dgrad_weight"), "block_2d", False),  # 1×16 / 1×32 weight blocks
    "stochastic_rounding": (ROLES, "rounding", "rne"),  # round-to-nearest-even everywhere
    "hadamard": (ROLES, "hadamard", False),  # no random Hadamard transform
}
_VARIANT_NAMES = {"2d_weight": "no 2D weight", "stochastic_rounding": "no SR", "hadamard": "no RHT"}


def _recipe(recipe) -> Recipe:
    """A Recipe as given, or the one a preset name (or ``Recipe.to_dict``'s dict) names, without the
    environment's backward override."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, dict)):
        return get_recipe(recipe, backward_override=None)
    raise TypeError(f"recipe must be a Recipe or a preset name, got {checks.shown(recipe)}")


def without(recipe: Recipe, ingredients) -> Recipe:
    """``recipe`` with each named ingredient (``INGREDIENTS``: "2d_weight", "stochastic_rounding",
    "hadamard") switched off in every spec that has it; specs without it are unchanged."""
    recipe = _recipe(recipe)
    ingredients = checks.names("ingredients", ingredients, tuple(INGREDIENTS))
    changes = {}
    for ingredient in ingredients:
        roles, field, value = INGREDIENTS[ingredient]
        for role in roles:
            spec = changes.get(role, getattr(recipe, role))
            if spec is not None and field in {f.name for f in dataclasses.fields(spec)}:
                changes[role] = dataclasses.replace(spec, **{field: value})
    return recipe.replace(**changes)


def with_scale_mode(recipe: Recipe, mode: str) -> Recipe:
    """``recipe`` with every MX spec's block-scale mode set to ``mode`` (one of
    ``scaling.MX_SCALE_MODES``): "rceil" never puts an element past the element format's largest value,
    so beside "floor" it shows what FLOOR's saturation costs. Other specs are unchanged; the name says
    the mode."""
    from qlab.quantize import MXSpec
    from qlab.scaling import MX_SCALE_MODES

    recipe = _recipe(recipe)
    checks.choice("mode", mode, MX_SCALE_MODES)
    changes = {role: dataclasses.replace(getattr(recipe, role), mode=mode)
               for role in ROLES if isinstance(getattr(recipe, role), MXSpec)}  # fmt: skip
    return recipe.replace(name=f"{recipe.name}, {mode.upper()} scales", **changes)


def uses(recipe: Recipe, ingredient: str) -> bool:
    """Whether any spec of ``recipe`` has ``ingredient`` switched on."""
    recipe = _recipe(recipe)
    checks.choice("ingredient", ingredient, tuple(INGREDIENTS))
    roles, field, off = INGREDIENTS[ingredient]
    specs = [getattr(recipe, role) for role in roles if getattr(recipe, role) is not None]
    return any(getattr(spec, field, off) != off for spec in specs)


def switched_off(preset: str, label: str) -> list[str]:
    """The ingredients a variant label switches off in ``preset``: "" none, "none" every one the preset
    uses, or one of "no 2D weight", "no SR", "no RHT" (the names ``ablations`` gives its variants)."""
    checks.choice("preset", preset, PRESETS)
    if not isinstance(label, str):
        raise TypeError(f"label must be a str such as 'no SR', got {checks.shown(label)}")
    recipe = get_recipe(preset, backward_override=None)
    present = [ingredient for ingredient in INGREDIENTS if uses(recipe, ingredient)]
    by_label = {_VARIANT_NAMES[ingredient]: [ingredient] for ingredient in present}
    if label == "":
        return []
    if label == "none":
        return present
    if label not in by_label:
        raise ValueError(
            f"unknown label: {preset} has no variant {label!r}; expected '', 'none' or one of: "
            f"{', '.join(by_label)}"
        )
    return by_label[label]


KEEP_LAST_BLOCK = "+BF16 last block"  # a model-level variant: the last block kept in high precision


def variant_parts(variant: str, *, argument: str = "variant") -> tuple[str, list[str], bool]:
    """A training variant "preset", "preset/<label>" (a label of ``switched_off``) or
    "preset/+BF16 last block", as (preset, ingredients switched off, whether the last block is kept
    in high precision). "fp32" is the unquantized baseline. Errors name ``argument``."""
    if not isinstance(variant, str):
        raise TypeError(f"{argument} must be a str such as 'nvfp4/no SR', got {checks.shown(variant)}")
    preset, _, label = variant.partition("/")
    if preset == "fp32" and not label:
        return preset, [], False
    checks.choice(argument, preset, PRESETS)
    if label == KEEP_LAST_BLOCK:
        return preset, [], True
    recipe = get_recipe(preset, backward_override=None)
    labels = ["none", *(_VARIANT_NAMES[i] for i in INGREDIENTS if uses(recipe, i)), KEEP_LAST_BLOCK]
    if label and label not in labels:
        raise ValueError(
            f"unknown {argument} {variant!r}: {preset} has no variant {label!r}; expected {preset!r} "
            f"alone or followed by '/' and one of: {', '.join(labels)}"
        )
    return preset, switched_off(preset, label), False


def ablations(preset: str) -> dict[str, Recipe]:
    """The preset and variants with one ingredient it uses switched off, then all of them ("none").

    nvfp4: "no 2D weight" (1×16 weight blocks), "no SR" (RNE gradients), "no RHT" (no Hadamard
    transform on the wgrad operands), "none". mxfp4_training: "no SR", "no RHT", "none". Keeping the
    last layers in high precision is a model-level choice (``TrainConfig.keep_high_precision``).
    """
    checks.choice("preset", preset, ABLATED_RECIPES)
    recipe = get_recipe(preset, backward_override=None)
    labels = [_VARIANT_NAMES[i] for i in INGREDIENTS if uses(recipe, i)] + ["none"]
    variants = {preset: recipe}
    for label in labels:
        variants[label] = without(recipe, switched_off(preset, label)).replace(name=label)
    return variants


def gemm_errors(
    recipe: str | Recipe, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, *, seed: int = 0
) -> dict[str, float]:
    """Relative Frobenius error of y, dx and dW from a QuantLinear with ``recipe`` (stochastic rounding
    seeded by ``seed``) against float64 products of the same float32 operands.

    x: (tokens, in), weight: (out, in), grad_output: (tokens, out); floating-point tensors. A GEMM whose
    exact product is zero (an all-zero x or grad_output) has error 0 where its output is zero too, and
    inf where it is not.
    """
    got = gemm_outputs(recipe, x, weight, grad_output, seed=seed)
    # contiguous: the float64 products then sum in one order whatever the operands' strides
    x64, w64, dy64 = (t.double().contiguous() for t in (x, weight, grad_output))
    exact = {"fprop": x64 @ w64.T, "dgrad": dy64 @ w64, "wgrad": dy64.T @ x64}
    return {gemm: _relative_error(got[gemm].double(), exact[gemm]) for gemm in GEMMS}


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """‖got − exact‖ / ‖exact‖ (float64); for a zero ``exact``: 0 if ``got`` is zero as well, inf if
    not (NaN stays NaN)."""
    difference, size = (got - exact).norm(), exact.norm()
    if size == 0:
        if difference == 0:
            return 0.0
        return math.nan if torch.isnan(difference) else math.inf
    return float(difference / size)


def gemm_outputs(
    recipe: str | Recipe, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """{"fprop": y, "dgrad": dx, "wgrad": dW} of one QuantLinear forward and backward with ``recipe``
    (its stochastic rounding seeded by ``seed``), float32; shapes as for ``gemm_errors``. A preset name
    or dict is taken without the environment's backward override, as everywhere in this module."""
    from qlab.nn import QuantLinear

    x = checks.tensor("x", x, floating=True)
    weight = checks.tensor("weight", weight, floating=True)
    grad_output = checks.tensor("grad_output", grad_output, floating=True)
    if x.dim() != 2 or weight.dim() != 2 or grad_output.dim() != 2:
        raise ValueError(
            f"x, weight and grad_output must be 2-D (tokens, in), (out, in), (tokens, out); got shapes "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(grad_output.shape)}"
        )
    if x.shape[1] != weight.shape[1] or grad_output.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, weight {tuple(weight.shape)} need grad_output "
            f"{(x.shape[0], weight.shape[0])}, got {tuple(grad_output.shape)}"
        )
    if x.numel() == 0 or weight.numel() == 0:
        raise ValueError(
            f"x and weight must hold values, got shapes {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    layer = QuantLinear(weight.shape[1], weight.shape[0], bias=False, recipe=_recipe(recipe), seed=seed)
    with torch.no_grad():
        layer.weight.copy_(weight)
    # contiguous copies: the GEMMs then run in one order whatever the operands' strides
    inputs = x.detach().float().contiguous().requires_grad_(True)
    y = layer(inputs)
    y.backward(grad_output.float().contiguous())
    return {"fprop": y.detach(), "dgrad": inputs.grad, "wgrad": layer.weight.grad}


def synthetic_operands(tokens: int = 256, features: int = 256, out: int = 256, *, seed: int = 0):
    """(x, weight, grad_output) float32 with the structure real layers show: activations with a few
    outlier channels (4 channels ×20), Gaussian weights of scale 1/√in, and output gradients whose
    per-token magnitudes spread over two decades (log-normal)."""
    for name, size in (("tokens", tokens), ("features", features), ("out", out)):
        checks.integer(name, size, low=1)
    checks.integer("features", features, low=4)  # four outlier channels
    checks.seed("seed", seed)
    checks.allocatable("tokens × features × out", (max(tokens, out), features + out))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=generator, dtype=torch.float32)
    x[:, torch.randperm(features, generator=generator)[:4]] *= 20.0
    weight = torch.randn(out, features, generator=generator, dtype=torch.float32) / features**0.5
    token_scale = torch.exp(torch.randn(tokens, 1, generator=generator, dtype=torch.float32) * 1.15)
    grad_output = torch.randn(tokens, out, generator=generator, dtype=torch.float32) * token_scale * 1e-3
    return x, weight, grad_output


def capture_operands(model: torch.nn.Module, forward_backward, *, skip=(), only=None) -> dict[str, tuple]:
    """Every ``nn.Linear``'s GEMM operands in one training step: {name: (x, weight, grad_output)},
    float32 2-D copies (tokens flattened) of what the layer saw in ``forward_backward()`` (a callable
    that runs the model forward and backward once). Layers named in ``skip`` are left out; ``only``
    (names) keeps just those, each of which must be a Linear of the model.

    A layer called more than once (a shared layer) gives its calls' inputs and output gradients
    concatenated along tokens, in call order, each gradient beside its own call's input: dW = dyᵀ·x
    still holds. A layer that received no output gradient (no backward reached it) is left out."""
    checks.module("model", model)
    if not callable(forward_backward):
        raise TypeError(f"forward_backward must be a callable, got {checks.shown(forward_backward)}")
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    skip = set(checks.names("skip", skip, linears))
    if only is not None:
        only = set(checks.names("only", only, linears))
    # per layer, in call order: for each call, its input and the output gradients it received
    calls: dict[str, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in skip and (only is None or name in only):
            handles.append(module.register_forward_hook(_capture_hook(name, calls), with_kwargs=True))
    try:
        forward_backward()
    finally:
        for handle in handles:
            handle.remove()
    modules = dict(model.named_modules())
    captured = {}
    for name, layer_calls in calls.items():
        pairs = [(x, grad) for x, grads in layer_calls for grad in grads]
        if pairs:
            x = pairs[0][0] if len(pairs) == 1 else torch.cat([x for x, _ in pairs])
            dy = pairs[0][1] if len(pairs) == 1 else torch.cat([grad for _, grad in pairs])
            captured[name] = (x, modules[name].weight.detach().float().clone(), dy)
    return captured


def _capture_hook(name: str, calls: dict):
    """A forward hook of the Linear ``name`` that records, into ``calls[name]``, each call's input and,
    through a hook on its output, the gradient backward brings to that output."""

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            raise ValueError(
                f"capture_operands: the Linear {name!r} was called without a tensor input (positional or "
                f"input=...) or gave no tensor output; got args {checks.shown(args)}, keyword arguments "
                f"{sorted(kwargs)}"
            )
        grads: list[torch.Tensor] = []
        calls.setdefault(name, []).append((x.detach().reshape(-1, module.in_features).float().clone(), grads))
        if output.requires_grad:
            output.register_hook(
                lambda grad: grads.append(grad.detach().reshape(-1, module.out_features).float().clone())
            )

    return hook
