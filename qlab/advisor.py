"""Measured advice: which layers to keep in high precision, for your model, batches and recipe.

    table = advisor.layer_sensitivity(model, batches, "nvfp4")        # one row per Linear-like layer
    advice = advisor.advise(model, batches, "nvfp4", budget=0.15)     # keep ≤ 15 % of the layers
    quantize_model(model, "nvfp4", keep_high_precision=advice.keep)   # patterns quantize_model takes

Sensitivity is measured, not guessed: each convertible layer alone is quantized by the recipe
(forward only, the model in eval mode, on the caller's batches) and the mean loss compared with the
unquantized model's on the same batches. ``advise`` then keeps the most sensitive layers while their
share of the budget — a fraction of the layers, or of the GEMM FLOPs (in × out per token) — lasts.
The model is left exactly as it came (every swapped layer is put back, Parameters untouched).

A format per layer rather than keep-or-not: ``measured_scores`` (the loss change of each layer alone in
each format, per batch, with its interval) and ``approximated_scores`` (the Fisher-weighted second-order
estimate from one forward and backward pass per batch) give the table ``qlab.plan.make_plan`` solves
under a bit budget; ``qlab advise --formats nvfp4,mxfp8,bf16`` runs both steps.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from qlab import checks, models, paths, plan, stats
from qlab.nn import QuantLinear, is_conv1d, linear_layers, oriented_weight, set_submodule
from qlab.recipe import get_recipe

BUDGET_UNITS = ("layers", "flops")
STABILITY_DRAWS = 100  # bootstrap draws behind qlab advise's undecided layers


def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a Hugging Face causal LM on token ids (batch, tokens); TypeError for a
    model that returns no loss (an encoder: score it with ``hidden_state_error(model, batches)``)."""
    checks.module("model", model)
    batch = models.check_token_ids("batch", batch, model)
    loss = getattr(model(input_ids=batch, labels=batch), "loss", None)
    if loss is None:
        raise TypeError(
            f"model ({type(model).__name__}) returns no loss for labels, as an encoder does: pass "
            "loss_fn=advisor.hidden_state_error(model, batches), the error of its hidden states"
        )
    return loss


@contextmanager
def quantized(model: nn.Module, names: Sequence[str], recipe):
    """For the duration, the named layers of ``model`` are QuantLinears of ``recipe`` (sharing their
    Parameters); afterwards the original modules are back in place."""
    convertible = [name for name, _, why in linear_layers(model) if why is None]
    names = check_layers("names", checks.patterns("names", names), convertible)
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


def check_measurement(model, batches, loss_fn, progress) -> None:
    checks.module("model", model)
    checks.batches("batches", batches)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {checks.shown(loss_fn)}")
    checks.boolean("progress", progress)


def check_layers(argument: str, names: list[str], convertible) -> list[str]:
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
    check_measurement(model, batches, loss_fn, progress)
    if not isinstance(groups, dict) or not groups:
        raise TypeError(f"groups must be a non-empty dict label -> layer names, got {checks.shown(groups)}")
    recipe = get_recipe(recipe)
    convertible = {name: module for name, module, why in linear_layers(model) if why is None}
    for label, names in groups.items():
        check_layers(f"groups[{label!r}]", checks.patterns(f"groups[{label!r}]", names), convertible)
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
    check_measurement(model, batches, loss_fn, progress)
    convertible = {name: module for name, module, why in linear_layers(model) if why is None}
    names = list(convertible) if layers is None else checks.patterns("layers", layers)
    if not check_layers("layers", names, convertible):
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


# --- a format per layer: the scores a plan is chosen by (qlab.plan solves) -------------------------


def _layer_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{name: (out_features, in_features)} of every convertible Linear-like layer."""
    return {
        name: tuple(oriented_weight(module).shape)
        for name, module, why in linear_layers(model)
        if why is None
    }


def layer_table(model: nn.Module, formats) -> pd.DataFrame:
    """One row per (convertible layer, format): layer, format, elements (weight elements), bits
    (``weight_bits``), in model order then formats' order. The score columns come from a score function."""
    checks.module("model", model)
    formats = plan.plan_formats(formats)
    shapes = _layer_shapes(model)
    if not shapes:
        raise ValueError("model has no convertible Linear-like layer: there is nothing to plan")
    rows = [
        dict(layer=name, format=name_, elements=out * in_, bits=plan.weight_bits(name_, out, in_))
        for name, (out, in_) in shapes.items()
        for name_ in formats
    ]
    return pd.DataFrame(rows)


def _rows_to_score(model, batches, formats, loss_fn, layers, progress) -> pd.DataFrame:
    """The arguments of a score function checked; ``layer_table`` cut to ``layers`` (None: all)."""
    check_measurement(model, batches, loss_fn, progress)
    table = layer_table(model, formats)
    if layers is None:
        return table
    names = checks.patterns("layers", layers)
    check_layers("layers", names, list(dict.fromkeys(table.layer)))
    return table[table.layer.isin(names)].reset_index(drop=True)


def _with_scores(table: pd.DataFrame, values: dict, baseline: list[float], kind: str) -> pd.DataFrame:
    """``table`` with score (mean of a (layer, format)'s per-batch values; 0 in high precision), low and
    high (its 95 % interval; NaN from one batch), n, baseline_loss, kind, and the per-batch values in
    ``plan.BATCH_COLUMN``-named columns (batch_0, batch_1, …: what ``plan.stability`` resamples)."""
    rows = []
    for layer, name in table[["layer", "format"]].itertuples(index=False):
        per_batch = [0.0] * len(baseline) if name == plan.HIGH_PRECISION else values[layer, name]
        if len(per_batch) > 1:
            mean, low, high = stats.mean_interval(per_batch)
        else:
            mean, low, high = per_batch[0], math.nan, math.nan
        batches = {plan.BATCH_COLUMN.format(index): value for index, value in enumerate(per_batch)}
        rows.append(dict(score=mean, low=low, high=high, **batches))
    scored = pd.concat([table, pd.DataFrame(rows)], axis=1)
    return scored.assign(n=len(baseline), baseline_loss=sum(baseline) / len(baseline), kind=kind)


@torch.no_grad()
def _batch_losses(model, batches, loss_fn) -> list[float]:
    return [float(loss_fn(model, batch)) for batch in batches]


def measured_scores(
    model: nn.Module,
    batches: Sequence,
    formats,
    *,
    loss_fn: Callable = causal_lm_loss,
    layers: Sequence[str] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """``layer_table`` with the measured score of each (layer, format): the loss with that layer alone in
    that format minus the unquantized model's, per batch (paired), in columns score (the mean over
    batches), low, high (its 95 % interval; NaN with one batch), n (batches) and baseline_loss. A
    ``plan.HIGH_PRECISION`` row scores exactly 0; ``loss_fn(model, batch)`` defaults to the causal-LM
    loss.
    ``table.attrs["evaluations"]``: the (layer, format) evaluations made, each a loss on every batch.
    The model runs in eval mode and comes back exactly as it was."""
    table = _rows_to_score(model, batches, formats, loss_fn, layers, progress)
    was_training = model.training
    model.eval()
    try:
        baseline = _batch_losses(model, batches, loss_fn)
        pairs = list(table[["layer", "format"]].itertuples(index=False))
        if progress:
            from qlab.host import progress as bar

            pairs = bar(pairs, desc="measured scores")
        differences = {}
        for layer, format_name in pairs:
            if format_name != plan.HIGH_PRECISION:
                differences[layer, format_name] = _loss_changes(model, [layer], format_name, batches, loss_fn,
                                                                baseline)  # fmt: skip
    finally:
        model.train(was_training)
    scored = _with_scores(table, differences, baseline, "measured")
    scored.attrs.update(evaluations=len(differences), evaluations_flat=len(differences))
    return scored


def _loss_changes(model, layers, format_name, batches, loss_fn, baseline) -> list[float]:
    """Per batch: the loss with ``layers`` in ``format_name`` minus ``baseline`` (one loss evaluation
    of every batch)."""
    with quantized(model, layers, format_name):
        losses = _batch_losses(model, batches, loss_fn)
    return [a - b for a, b in zip(losses, baseline)]


def blocks_of(layers: Sequence[str]) -> dict[str, list[str]]:
    """The layers grouped by block: a name's prefix up to its first numeric part ("model.layers.3" for
    "model.layers.3.mlp.up_proj"); a name with no numeric part is a block of its own. In first-seen
    order."""
    blocks: dict[str, list[str]] = {}
    for name in checks.patterns("layers", layers):
        parts = name.split(".")
        numeric = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        block = name if numeric is None else ".".join(parts[: numeric + 1])
        blocks.setdefault(block, []).append(name)
    return blocks


def hierarchical_scores(
    model: nn.Module,
    batches: Sequence,
    formats,
    *,
    expand: int,
    loss_fn: Callable = causal_lm_loss,
    progress: bool = False,
) -> pd.DataFrame:
    """Measured scores for models with many layers, in two steps. First every block (``blocks_of``: a
    decoder layer's projections together) is measured whole in each quantized format; then the
    ``expand`` blocks with the largest mean loss change (in their worst format) are measured layer by
    layer, as ``measured_scores`` does. A layer of any other block gets the block's per-batch change
    in that format times its share of the block's weight elements (a block's score, spread by size).

    The table is ``measured_scores``'s with kind="hierarchical" and a column ``scored_by``: "layer"
    (measured alone) or "block share". ``table.attrs`` holds ``evaluations`` (format × layer-set
    evaluations made, each a loss on every batch, the float baseline not counted) and
    ``evaluations_flat`` (what ``measured_scores`` makes). With ``expand`` ≥ the block count every
    score equals ``measured_scores``'s. The model comes back exactly as it was."""
    table = _rows_to_score(model, batches, formats, loss_fn, None, progress)
    expand = checks.integer("expand", expand, low=0)
    layers = list(dict.fromkeys(table.layer))
    blocks = blocks_of(layers)
    quantized_formats = [name for name in dict.fromkeys(table.format) if name != plan.HIGH_PRECISION]
    elements = dict(zip(table.layer, table.elements))
    was_training = model.training
    model.eval()
    evaluations = 0
    try:
        baseline = _batch_losses(model, batches, loss_fn)
        whole = {}  # (block, format) -> per-batch change; a one-layer block is that layer's own score
        steps = [(block, name) for block in blocks for name in quantized_formats]
        if progress:
            from qlab.host import progress as bar

            steps = bar(steps, desc="hierarchical scores: blocks")
        for block, name in steps:
            whole[block, name] = _loss_changes(model, blocks[block], name, batches, loss_fn, baseline)
            evaluations += 1
        worst = {
            block: max(sum(whole[block, name]) / len(baseline) for name in quantized_formats)
            for block in blocks
        }
        ranked = sorted(blocks, key=lambda block: -worst[block])
        expanded = [block for block in ranked[:expand] if len(blocks[block]) > 1]
        differences, scored_by = {}, {}
        for block, members in blocks.items():
            size = sum(elements[layer] for layer in members)
            for layer in members:
                scored_by[layer] = "layer" if len(members) == 1 or block in expanded else "block share"
                for name in quantized_formats:
                    if len(members) == 1:
                        differences[layer, name] = whole[block, name]
                    elif block not in expanded:
                        share = elements[layer] / size
                        differences[layer, name] = [change * share for change in whole[block, name]]
        steps = [(layer, name) for block in expanded for layer in blocks[block] for name in quantized_formats]
        if progress:
            steps = bar(steps, desc="hierarchical scores: layers")
        for layer, name in steps:
            differences[layer, name] = _loss_changes(model, [layer], name, batches, loss_fn, baseline)
            evaluations += 1
    finally:
        model.train(was_training)
    scored = _with_scores(table, differences, baseline, "hierarchical")
    scored.insert(scored.columns.get_loc("score"), "scored_by", scored.layer.map(scored_by))
    scored.attrs.update(evaluations=evaluations, evaluations_flat=len(layers) * len(quantized_formats))
    return scored


def approximated_scores(
    model: nn.Module,
    batches: Sequence,
    formats,
    *,
    loss_fn: Callable = causal_lm_loss,
    layers: Sequence[str] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """``layer_table`` with a second-order estimate of each (layer, format)'s loss change, from one
    forward and backward pass per batch: ½ Σᵢ gᵢ² Δyᵢ², with Δy the layer's output in that format minus
    its output, on the input it received, and g = ∂loss/∂y (the Taylor term ½ ΔyᵀHΔy with the Hessian
    replaced by the diagonal of the empirical Fisher information g gᵀ; ModelOpt's ``auto_quantize``
    gradient score without its ½). Columns score (mean over batches), low, high (95 % interval), n,
    baseline_loss and kind="approximated". No Parameter gradient is kept; the model comes back as it was.
    The loss must have a non-zero gradient at the unquantized model (a task loss such as the next-token
    loss): an encoder's ``hidden_state_error`` is zero there with zero gradient, so every estimate is 0."""
    table = _rows_to_score(model, batches, formats, loss_fn, layers, progress)
    chosen = list(dict.fromkeys(table.layer))
    quantized_formats = [name for name in dict.fromkeys(table.format) if name != plan.HIGH_PRECISION]
    per_batch = {(layer, name): [] for layer in chosen for name in quantized_formats}
    variants = {}  # each layer in each format, built once and sharing the layer's Parameters
    for layer in chosen:
        module = model.get_submodule(layer)
        for name in quantized_formats:
            variants[layer, name] = QuantLinear.from_linear(module, get_recipe(name), seed=0).eval()

    def record(layer):
        def hook(module, inputs, output):
            with torch.no_grad():
                # forward, not __call__: a variant shares the layer's hook tables, this hook included
                changes = {
                    name: variants[layer, name].forward(*inputs) - output for name in quantized_formats
                }

            def on_gradient(gradient):
                squared = gradient.detach().double() ** 2
                for name, change in changes.items():
                    per_batch[layer, name].append(float(0.5 * (squared * change.double() ** 2).sum()))

            output.register_hook(on_gradient)

        return hook

    was_training = model.training
    requires = {name: p.requires_grad for name, p in model.named_parameters()}
    model.eval()
    handles = [model.get_submodule(layer).register_forward_hook(record(layer)) for layer in chosen]
    baseline = []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        for p in embeddings.parameters() if embeddings is not None else model.parameters():
            p.requires_grad_(True)  # a graph reaching every layer's output, no weight gradient kept
        iterator = batches
        if progress:
            from qlab.host import progress as bar

            iterator = bar(list(batches), desc="approximated scores")
        for batch in iterator:
            loss = loss_fn(model, batch)
            baseline.append(float(loss.detach()))
            gradients = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad],
                                            allow_unused=True)  # fmt: skip
            del gradients
    finally:
        for handle in handles:
            handle.remove()
        for name, p in model.named_parameters():
            p.requires_grad_(requires[name])
        model.train(was_training)
    for (layer, _), values in per_batch.items():
        if len(values) != len(baseline):
            raise ValueError(f"loss_fn's graph does not reach layer {layer!r}: no output gradient came back")
    return _with_scores(table, per_batch, baseline, "approximated")


def score_function(kind: str, *, expand: int = 6) -> Callable:
    """The score function of ``kind`` (``plan.SCORE_KINDS``), called as ``score(model, batches, formats,
    loss_fn=..., progress=...)``; ``expand`` is the hierarchical score's blocks measured layer by layer."""
    checks.choice("kind", kind, plan.SCORE_KINDS)
    if kind == "hierarchical":
        return partial(hierarchical_scores, expand=checks.integer("expand", expand, low=0))
    return {"measured": measured_scores, "approximated": approximated_scores}[kind]


def held_out_check(model: nn.Module, chosen, table: pd.DataFrame, batches: Sequence, *,
                   loss_fn: Callable = causal_lm_loss) -> pd.DataFrame:  # fmt: skip
    """The plan checked on batches it was not chosen on: the loss of the model quantized by ``chosen`` (a
    ``qlab.plan.Plan``) minus (a) the float model's, (b) every layer in its fewest-bits format's and (c)
    the usual rule's at the same budget (``plan.ends_first``: first and last layers raised first), paired
    by batch. One row per comparison: comparison, mean, low, high (95 %), p and p_holm (Holm over the
    three), n, and the per-batch differences (batch_0, batch_1, …). ``table`` is the score table the plan
    was chosen from; the model comes back as it was."""
    import copy

    from qlab.nn import quantize_model

    check_measurement(model, batches, loss_fn, False)
    if not isinstance(chosen, plan.Plan):
        raise TypeError(f"chosen must be a qlab.plan.Plan, got {checks.shown(chosen)}")
    if not math.isfinite(chosen.effective_bits):
        raise ValueError("chosen must carry the budget it was made for (plan.make_plan sets effective_bits)")
    plan.check_budget(table, chosen.effective_bits)  # the table's layout, and a budget it can meet
    layers = list(dict.fromkeys(table.layer))
    lowest = {layer: table[table.layer == layer].sort_values("bits").format.iloc[0] for layer in layers}
    others = {
        "float model": None,
        "fewest bits everywhere": plan.Plan(layers=lowest),
        "first and last layers raised": plan.Plan(
            layers=plan.ends_first(table, effective_bits=chosen.effective_bits)
        ),
    }

    def losses(assignment):
        if assignment is None:
            return _batch_losses(model, batches, loss_fn)
        quantized = copy.deepcopy(model)
        quantize_model(quantized, assignment)
        return _batch_losses(quantized, batches, loss_fn)

    was_training = model.training
    model.eval()
    try:
        planned = losses(chosen)
        rows = []
        for name, other in others.items():
            differences = [a - b for a, b in zip(planned, losses(other))]
            test = stats.paired_test(differences)
            kept = {key: test[key] for key in ("mean", "low", "high", "p", "n")}
            per_batch = {plan.BATCH_COLUMN.format(i): value for i, value in enumerate(differences)}
            rows.append(dict(comparison=f"plan − {name}", **kept, **per_batch))
    finally:
        model.train(was_training)
    frame = pd.DataFrame(rows)
    return frame.assign(p_holm=stats.holm(frame.p.tolist()))


# where and how a model was loaded, not what it is: a copy in another folder, another transformers
# version or a bf16 load is the same model
CONFIG_KEYS_NOT_HASHED = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def config_hash(model: nn.Module) -> str:
    """sha256 of the model's Hugging Face config (its JSON, sorted keys, without
    ``CONFIG_KEYS_NOT_HASHED``), else of its layer shapes."""
    checks.module("model", model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        content = {k: v for k, v in config.to_dict().items() if k not in CONFIG_KEYS_NOT_HASHED}
        text = json.dumps(content, sort_keys=True, default=str)
    else:
        text = json.dumps({name: list(shape) for name, shape in _layer_shapes(model).items()})
    return hashlib.sha256(text.encode()).hexdigest()


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


def plan_batches(tokenizer, text, *, count: int, held_out: int, batch_size: int, tokens: int,
                 seed: int) -> tuple[list, list]:  # fmt: skip
    """(calibration, held-out) token batches for a plan: ``count`` and ``held_out`` disjoint batches of
    ``batch_size`` windows of ``tokens`` from the UTF-8 files ``text`` (drawn by ``seed``,
    ``models.text_batches``), or, with no text, calibration on Shakespeare's training plays and the
    check on its held-out plays."""
    size = dict(batch_size=batch_size, tokens=tokens, seed=seed)
    if text:
        return models.text_batches(tokenizer, text, count=count, held_out=held_out, **size)
    calibration = models.shakespeare_batches(tokenizer, count=count, split="train", **size)
    checked = models.shakespeare_batches(tokenizer, count=held_out, split="val", **size) if held_out else []
    return calibration, checked


def _batches(args, tokenizer) -> tuple[list, list]:
    """(calibration, held-out) batches of the CLI's arguments: a plan's (``plan_batches``); keep mode
    calibrates on windows of --text or, as always, of Shakespeare's held-out plays."""
    size = dict(batch_size=args.batch_size, tokens=args.tokens, seed=args.seed)
    if args.formats:
        return plan_batches(tokenizer, args.text, count=args.batches, held_out=args.held_out, **size)
    if args.text:
        return models.text_batches(tokenizer, args.text, count=args.batches, held_out=0, **size)
    return models.shakespeare_batches(tokenizer, count=args.batches, **size), []


def check_score(kind: str, score: str, *, argument: str = "score") -> None:
    """Refuse a score (``score_function``'s name) that cannot rank layers of this kind of model
    (``qlab.models.CAUSAL_LM`` or ``ENCODER``): the approximated score needs a loss whose gradient at the
    unquantized model is not zero, and an encoder's hidden-state error is zero there, with zero gradient."""
    checks.choice("kind", kind, models.KINDS)
    if kind == models.ENCODER and score == "approximated":
        raise ValueError(
            f"{argument} 'approximated' needs a loss whose gradient at the unquantized model is not zero; an "
            f"encoder is scored by its hidden-state error, zero there with zero gradient: use {argument} "
            "'measured' or 'hierarchical'"
        )


def main(args) -> int:
    """``qlab advise``: with ``--formats``, a plan (a format per layer under ``--effective-bits``, qlab.plan)
    written to ``--plan-out``; without, the layers to keep in high precision for ``--recipe``. Every
    argument is checked before the first loss evaluation."""
    from qlab.host import resolve_device
    from qlab.recipe import PRESETS

    formats = plan.plan_formats(args.formats.split(","), "--formats") if args.formats else None
    if formats is None:
        checks.choice("--recipe", args.recipe, PRESETS)
        checks.number("--keep-fraction", args.budget, low=0, high=1)
    else:
        checks.number("--effective-bits", args.effective_bits, low=0, open_low=True)
        plan.check_reachable(
            formats, [args.effective_bits], argument="--effective-bits", formats_name="--formats"
        )
    device = resolve_device(args.device, argument="--device")
    checks.integer("--top", args.top, low=1)
    sizes = [
        ("--batches", args.batches, 1),
        ("--batch-size", args.batch_size, 1),
        ("--tokens", args.tokens, 2),
    ]
    if formats is not None:  # plan mode's
        sizes.append(("--held-out", args.held_out, 0))
    for option, value, low in sizes:
        checks.integer(option, value, low=low)
    if formats is not None and args.held_out == 1:  # a paired check needs two batches to vary over
        raise ValueError("--held-out must be 0 (no check) or at least 2 batches, got 1")
    for option, target in (("--out", args.out), ("--plan-out", getattr(args, "plan_out", None))):
        if target is None:
            continue
        if not target:
            raise ValueError(f"{option} must name a file to write, got an empty string")
        if Path(target).is_dir():
            raise ValueError(f"{option} must name a file to write, got the folder {target}")
        nearest = next(folder for folder in Path(target).absolute().parents if folder.exists())
        if not nearest.is_dir():  # the folders to make would go through a file
            raise ValueError(f"{option} {target}: {nearest} is a file, so no folder can be made inside it")
    if args.out is not None and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: its folder {Path(args.out).parent} does not exist")
    for text in args.text or []:
        paths.existing_file("--text", text, "UTF-8 text file")
        try:
            models.read_text(text)  # empty, or not UTF-8: said before the model loads
        except ValueError as error:
            raise ValueError(f"--text: {error}") from None
    checks.seed("--seed", args.seed)
    if args.score == "hierarchical":
        checks.integer("--expand", args.expand, low=0)
    try:
        kind = models.check_source(args.model, args.tokenizer)  # config.json read; no weight loaded yet
        if formats is not None:
            check_score(kind, args.score, argument="--score")
        model, tokenizer, kind = models.load_any(args.model, args.dtype, tokenizer=args.tokenizer)
    except (ValueError, TypeError) as error:  # name the option typed: "--model 'x' is neither ..."
        if str(error).startswith(("model ", "tokenizer ")):
            raise type(error)(f"--{error}") from None
        raise
    model = model.to(device)
    batches, held_out = _batches(args, tokenizer)
    batches, held_out = [b.to(device) for b in batches], [b.to(device) for b in held_out]
    loss_fn = causal_lm_loss if kind == models.CAUSAL_LM else hidden_state_error(model, batches)
    if formats is None:
        return _keep_mode(args, model, batches, loss_fn)
    table = layer_table(model, formats)
    plan.check_budget(table, args.effective_bits, argument="--effective-bits")
    score = score_function(args.score, expand=args.expand)
    table = score(model, batches, formats, loss_fn=loss_fn, progress=True)
    if args.score == "hierarchical":
        alone = (table.scored_by == "layer").sum() // len(formats)
        print(f"hierarchical: {table.attrs['evaluations']} loss evaluations of the batches instead of "
              f"{table.attrs['evaluations_flat']} ({alone} layers measured alone, the rest scored by their "
              f"block's share)")  # fmt: skip
    chosen = plan.make_plan(
        table,
        effective_bits=args.effective_bits,
        model=str(args.model),
        model_config_sha256=config_hash(model),
        text_sha256=plan.token_hash(batches),
    )
    table = table.assign(
        chosen=[chosen.layers[layer] == name for layer, name in zip(table.layer, table.format)]
    )
    counts = table[table.chosen].format.value_counts().reindex(formats, fill_value=0)
    print(f"{args.model}: {args.score} scores over {len(batches)} batches; {chosen.reached_bits:.4f} bits "
          f"per weight element (budget {args.effective_bits:g})")  # fmt: skip
    print("layers per format: " + ", ".join(f"{name} {count}" for name, count in counts.items()))
    if len(batches) > 1:
        steady = plan.stability(
            table, effective_bits=args.effective_bits, draws=STABILITY_DRAWS, seed=args.seed
        )
        undecided = steady[steady.undecided]
        print(f"{len(undecided)} of {len(steady)} layers' formats the data cannot decide (batches resampled "
              f"{STABILITY_DRAWS} times; a format chosen in under {plan.UNDECIDED_BELOW:.0%} of them)"
              + "".join(f"\n  {r.layer}: {r.format} in {r.agreement:.0%}, {r.other} in {r.other_share:.0%}"
                        for r in undecided.itertuples()))  # fmt: skip
    print(table[table.chosen].sort_values("score", ascending=False).head(args.top)[
        ["layer", "format", "score", "low", "high", "bits"]].to_string(index=False))  # fmt: skip
    if held_out:
        held_loss = causal_lm_loss if kind == models.CAUSAL_LM else hidden_state_error(model, held_out)
        check = held_out_check(model, chosen, table, held_out, loss_fn=held_loss)
        print(f"on {len(held_out)} held-out batches (paired by batch, 95 % intervals, Holm over the three):")
        for row in check.itertuples():
            interval = f"{row.mean:+.4g} [{row.low:+.4g}, {row.high:+.4g}]"
            print(f"  {row.comparison}: {interval}, Holm p = {row.p_holm:.3g}")
    target = (
        Path(args.plan_out)
        if args.plan_out
        else paths.RUNS_DIR / "plans" / f"{plan.slug(args.model, args.dtype)}.json"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"plan written to {paths.shown(chosen.save(target))}: quantize_model(model, {str(target)!r})")
    if args.out:
        from qlab.results import write_csv

        print(f"table written to {write_csv(table, args.out)}")
    return 0


def _keep_mode(args, model, batches, loss_fn) -> int:
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
