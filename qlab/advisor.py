"""Measured advice: which layers to keep in high precision, for your model, batches and recipe.

    table = advisor.layer_sensitivity(model, batches, "nvfp4")        # one row per Linear-like layer
    advice = advisor.advise(model, batches, "nvfp4", budget=0.15)     # keep ≤ 15 % of the layers
    quantize_model(model, "nvfp4", keep_high_precision=advice.keep)   # patterns quantize_model takes

Sensitivity is measured, not guessed: each convertible layer alone is quantized by the recipe
(forward only, the model in eval mode, on the caller's batches) and the mean loss compared with the
unquantized model's on the same batches. ``advise`` then keeps the most sensitive layers while their
share of the budget — a fraction of the layers, or of the GEMM FLOPs (in × out per token) — lasts.
The model is left exactly as it came (every swapped layer is put back, Parameters untouched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from qlab import checks, models
from qlab.nn import QuantLinear, is_conv1d, linear_layers, set_submodule
from qlab.recipe import get_recipe

BUDGET_UNITS = ("layers", "flops")


def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a Hugging Face causal LM on token ids (batch, tokens)."""
    checks.module("model", model)
    batch = models.check_token_ids("batch", batch, model)
    return model(input_ids=batch, labels=batch).loss


@contextmanager
def quantized(model: nn.Module, names: Sequence[str], recipe):
    """For the duration, the named layers of ``model`` are QuantLinears of ``recipe`` (sharing their
    Parameters); afterwards the original modules are back in place."""
    convertible = [name for name, _, why in linear_layers(model) if why is None]
    names = _check_layers("names", checks.patterns("names", names), convertible)
    recipe = get_recipe(recipe)
    originals = {}
    try:
        for index, name in enumerate(names):  # each layer its own stochastic-rounding seed, as quantize_model
            module = model.get_submodule(name)
            originals[name] = module
            set_submodule(model, name, QuantLinear.from_linear(module, recipe, seed=index))
        yield model
    finally:
        for name, module in originals.items():
            set_submodule(model, name, module)


@torch.no_grad()
def _mean_loss(model, batches, loss_fn) -> float:
    return sum(float(loss_fn(model, batch)) for batch in batches) / len(batches)


def _check_measurement(model, batches, loss_fn, progress) -> None:
    checks.module("model", model)
    checks.batches("batches", batches)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {checks.shown(loss_fn)}")
    checks.boolean("progress", progress)


def _check_layers(argument: str, names: list[str], convertible) -> list[str]:
    """``names``, each a convertible layer of the model; refused naming ``argument`` otherwise."""
    unknown = [name for name in names if name not in convertible]
    if unknown:
        near = ", ".join(checks.closest(unknown[0], convertible))
        raise ValueError(f"{argument} names {unknown}, no convertible layers of the model; closest: {near}")
    return names


def _shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features): Conv1D stores its weight (in, out), nn.Linear (out, in)."""
    rows, columns = module.weight.shape
    return (rows, columns) if is_conv1d(module) else (columns, rows)


def group_sensitivity(
    model: nn.Module,
    batches: Sequence,
    recipe,
    groups: dict,
    *,
    loss_fn: Callable = causal_lm_loss,
    progress: bool = False,
) -> pd.DataFrame:
    """One row per group {label: [layer names]}: the mean loss over ``batches`` with that group's
    layers (and no others) quantized by ``recipe``, and ``delta``, its increase over the unquantized
    model (nats for a cross-entropy). Columns: group, layers (count), flops (Σ in × out: multiply-adds
    per token), loss, delta, rank (1 = most sensitive), recipe, baseline_loss. The model runs in eval
    mode and comes back as it was."""
    _check_measurement(model, batches, loss_fn, progress)
    if not isinstance(groups, dict) or not groups:
        raise TypeError(f"groups must be a non-empty dict label -> layer names, got {checks.shown(groups)}")
    recipe = get_recipe(recipe)
    convertible = {name: module for name, module, why in linear_layers(model) if why is None}
    for label, names in groups.items():
        _check_layers(f"groups[{label!r}]", checks.patterns(f"groups[{label!r}]", names), convertible)
    was_training = model.training
    model.eval()
    try:
        baseline = _mean_loss(model, batches, loss_fn)
        labels = groups
        if progress:
            from qlab.host import progress as bar

            labels = bar(list(groups), desc=f"sensitivity ({recipe.name})")
        rows = []
        for label in labels:
            names = checks.patterns("groups", groups[label])
            with quantized(model, names, recipe):
                loss = _mean_loss(model, batches, loss_fn)
            flops = sum(i * o for i, o in (_shape(convertible[name]) for name in names))
            rows.append(
                {"group": label, "layers": len(names), "flops": flops, "loss": loss, "delta": loss - baseline}
            )
    finally:
        model.train(was_training)
    table = pd.DataFrame(rows)
    table["rank"] = table.delta.rank(ascending=False, method="first").astype(int)
    return table.assign(recipe=recipe.name, baseline_loss=baseline)


def layer_sensitivity(
    model: nn.Module,
    batches: Sequence,
    recipe,
    *,
    loss_fn: Callable = causal_lm_loss,
    layers: Sequence[str] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """``group_sensitivity`` with one layer per group: every convertible Linear-like layer (or each
    name in ``layers``) quantized alone. Columns: layer, in_features, out_features, flops, loss,
    delta, rank, recipe, baseline_loss."""
    _check_measurement(model, batches, loss_fn, progress)
    convertible = {name: module for name, module, why in linear_layers(model) if why is None}
    names = list(convertible) if layers is None else checks.patterns("layers", layers)
    if not _check_layers("layers", names, convertible):
        raise ValueError(f"layers must name at least one convertible layer of the model, got {layers!r}")
    table = group_sensitivity(model, batches, recipe, {name: [name] for name in names}, loss_fn=loss_fn,
                              progress=progress)  # fmt: skip
    shapes = pd.DataFrame(
        [_shape(convertible[name]) for name in table.group], columns=["in_features", "out_features"]
    )
    table = table.rename(columns={"group": "layer"}).drop(columns="layers")
    return pd.concat([table.iloc[:, :1], shapes, table.iloc[:, 1:]], axis=1)


@dataclass(frozen=True)
class Advice:
    """What to keep in high precision: ``keep`` (patterns quantize_model's keep_high_precision
    takes: exact layer names), the sensitivity ``table`` with a ``keep`` column, and the budget."""

    keep: list[str]
    table: pd.DataFrame
    budget: float
    by: str


def choose(table: pd.DataFrame, budget: float, by: str = "layers") -> Advice:
    """Keep the most sensitive layers (largest ``delta`` first) while the kept share of the layers
    (``by="layers"``) or of the FLOPs (``by="flops"``) stays within ``budget``; a layer whose
    quantization does not raise the loss is never kept."""
    checks.number("budget", budget, low=0, high=1)
    checks.choice("by", by, BUDGET_UNITS)
    checks.frame_columns("table", table, ["layer", "delta", *(["flops"] if by == "flops" else [])])
    if table.empty:
        raise ValueError("table has no rows: there are no layers to choose from")
    ordered = table.sort_values("delta", ascending=False, kind="stable")
    cost = (
        ordered.flops / ordered.flops.sum() if by == "flops" else pd.Series(1 / len(ordered), ordered.index)
    )
    spent, keep = 0.0, []
    for index, row in ordered.iterrows():
        if row.delta <= 0 or spent + cost[index] > budget + 1e-12:
            continue
        spent += cost[index]
        keep.append(row.layer)
    marked = table.assign(keep=table.layer.isin(keep))
    return Advice(keep=[name for name in table.layer if name in keep], table=marked, budget=budget, by=by)


def advise(
    model: nn.Module,
    batches: Sequence,
    recipe,
    *,
    budget: float = 0.15,
    by: str = "layers",
    loss_fn: Callable = causal_lm_loss,
    progress: bool = False,
) -> Advice:
    """``layer_sensitivity`` then ``choose``: the layers to keep in high precision within ``budget``
    (a fraction of the layers or of the FLOPs, ``by``) for ``recipe`` on ``batches``."""
    checks.number("budget", budget, low=0, high=1)
    checks.choice("by", by, BUDGET_UNITS)
    table = layer_sensitivity(model, batches, recipe, loss_fn=loss_fn, progress=progress)
    return choose(table, budget, by)


def hidden_state_error(reference: nn.Module, batches: Sequence) -> Callable:
    """A loss for encoders: the relative L2 error of ``model``'s last hidden states against those
    ``reference`` gives on the same batch (0 for the unquantized model), computed once up front."""
    checks.module("reference", reference)
    batches = checks.batches("batches", batches)
    ids = [
        models.check_token_ids(f"batches[{index}]", batch, reference) for index, batch in enumerate(batches)
    ]
    with torch.no_grad():  # keyed by the caller's batch objects, which the closure keeps alive
        expected = {id(batch): reference(input_ids=i).last_hidden_state for batch, i in zip(batches, ids)}

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if not any(batch is given for given in batches):
            raise ValueError("batch must be one of the batches hidden_state_error was given")
        target = expected[id(batch)]
        hidden = model(input_ids=batch.long()).last_hidden_state
        return torch.linalg.vector_norm(hidden - target) / torch.linalg.vector_norm(target)

    return loss


def main(args) -> int:
    """``qlab advise``: measured keep-in-high-precision advice for a packaged model (qlab.models)."""

    model, tokenizer = models.load(args.model)
    batches = models.shakespeare_batches(tokenizer, batch_size=args.batch_size, tokens=args.tokens,
                                         count=args.batches, seed=args.seed)  # fmt: skip
    loss_fn = causal_lm_loss if hasattr(model, "lm_head") else hidden_state_error(model, batches)
    advice = advise(
        model, batches, args.recipe, budget=args.budget, by=args.by, loss_fn=loss_fn, progress=True
    )
    table = advice.table.sort_values("rank")
    baseline = table.baseline_loss.iloc[0]
    print(f"{args.model}, {args.recipe}: baseline loss {baseline:.4f}; the most sensitive layers:")
    print(table.head(args.top)[["rank", "layer", "delta", "flops", "keep"]].to_string(index=False))
    print(f"keep_high_precision = {advice.keep!r}")
    print(f"# {len(advice.keep)} layers, within {args.budget:g} of the {args.by}")
    if args.out:
        from qlab.results import write_csv

        print(f"table written to {write_csv(table, args.out)}")
    return 0
