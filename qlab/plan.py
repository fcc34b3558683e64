"""A mixed-format plan: one weight format per layer, the summed score smallest under a bit budget.

    scores = advisor.measured_scores(model, batches, ["nvfp4", "mxfp8", "bf16"])  # (layer, format) rows
    chosen = plan.make_plan(scores, effective_bits=5.0)  # exact: a 0/1 program solved by HiGHS
    quantize_model(model, chosen)                        # or chosen.save("plan.json")

**Bits as stored.** ``weight_bits`` counts every code of the quantized weight at its element's width
(padding to whole blocks included, as the codes are stored) and every scale the format keeps: E8M0
(MX) and E4M3 (NVFP4) block scales 8 bits, FP32 scales (tensorwise, blockwise, per-row INT8, NVFP4's
global scale) 32. ``effective_bits`` is ModelOpt's ``auto_quantize`` budget: the weight-count-weighted
mean of bits per weight element, scales counted. A layer in ``HIGH_PRECISION`` ("bf16") is a layer
left unquantized and stored in bfloat16: 16 bits an element. For a 4096 × 4096 weight: nvfp4 (16 × 16
weight tiles) 4 + 8/256 + 32/4096², mxfp8 8 + 8/32, fp8_blockwise 8 + 32/128², fp8_tensorwise
8 + 32/4096², int8_per_token 8 + 32/4096.

**Scores** come from ``qlab.advisor``: ``measured_scores`` (the loss change with that layer alone in
that format, per calibration batch, paired with the unquantized model) or ``approximated_scores`` (a
second-order estimate from one forward and backward pass per batch), each with its 95 % interval.

**Solving.** The assignment minimising the summed score with mean bits ≤ ``effective_bits`` is a
multiple-choice knapsack. It is solved as a 0/1 integer program by HiGHS (``scipy.optimize.milp``,
relative gap 0), not by dynamic programming: a DP's table grows with the budget in units of the gcd of
the layers' bit counts, which for real shapes is unbounded, while HiGHS's branch and bound proves
optimality directly. The bit constraint is then checked in exact integer arithmetic; a solution over
budget by HiGHS's feasibility tolerance is tightened and solved again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from qlab import checks
from qlab.formats import get_format
from qlab.quantize import IntSpec, MXSpec, NVFP4Spec
from qlab.recipe import PRESETS, get_recipe

HIGH_PRECISION = "bf16"  # the layer left unquantized, its weight counted at bfloat16's 16 bits
HIGH_PRECISION_BITS = 16
SCORE_KINDS = ("measured", "approximated", "hierarchical")
PLAN_VERSION = 1  # the plan file's layout
MAX_LAYERS = 100_000  # layers one plan may hold
BATCH_COLUMN = "batch_{}"  # a score table's per-batch values, one column per calibration batch
MAX_DRAWS = 100_000  # bootstrap draws of one stability call
UNDECIDED_BELOW = 0.9  # a layer's format is undecided when fewer draws than this share choose it


def plan_formats(formats, argument: str = "formats") -> list[str]:
    """``formats`` checked: recipe presets whose forward quantizes the weight, or ``HIGH_PRECISION``;
    errors name ``argument``."""
    if not isinstance(argument, str):
        raise TypeError(f"argument must be a str naming the checked argument, got {checks.shown(argument)}")
    formats = checks.patterns(argument, formats)  # a bare string is one name
    if not formats:
        raise ValueError(f"{argument} must name at least one format, got none")
    for name in formats:
        if name not in PRESETS:
            near = ", ".join(checks.closest(name, PRESETS))
            raise ValueError(f"{argument} names {name!r}, not a recipe preset; closest: {near}")
        if name != HIGH_PRECISION and get_recipe(name, backward_override=None).weight is None:
            raise ValueError(
                f"{argument} names {name!r}, whose forward does not quantize the weight: a plan chooses "
                f"weight formats (presets with a weight spec, or {HIGH_PRECISION!r})"
            )
    if len(set(formats)) != len(formats):
        raise ValueError(f"{argument} must name each format once, got {formats}")
    return formats


def weight_bits(format_name: str, out_features: int, in_features: int) -> int:
    """Bits that store an (out_features × in_features) weight in ``format_name``: its codes (padded to
    whole blocks and tiles, as stored) and its scales. ``HIGH_PRECISION``: 16 bits an element."""
    if not isinstance(format_name, str):
        raise TypeError(f"format_name must be a str, got {checks.shown(format_name)}")
    (format_name,) = plan_formats([format_name], "format_name")
    checks.integer("out_features", out_features, low=1, high=2**40)
    checks.integer("in_features", in_features, low=1, high=2**40)
    if format_name == HIGH_PRECISION:
        return HIGH_PRECISION_BITS * out_features * in_features
    spec = get_recipe(format_name, backward_override=None).weight
    element_bits = _element_bits(spec)
    rows, columns, scales = out_features, in_features, 1
    if spec.block_size is not None:
        tile = spec.tile_rows
        columns = math.ceil(in_features / spec.block_size) * spec.block_size
        rows = math.ceil(out_features / tile) * tile
        scales = (rows // tile) * (columns // spec.block_size)
    elif spec.granularity == "axis":  # one scale per output row
        scales = out_features
    scale_bits = 8 if isinstance(spec, MXSpec | NVFP4Spec) else 32  # E8M0 / E4M3 codes, else FP32
    return rows * columns * element_bits + scales * scale_bits + _global_bits(format_name)


def _global_bits(format_name: str) -> int:
    """Bits of a weight's one per-tensor scale beside its block scales (NVFP4's FP32 global scale)."""
    if format_name == HIGH_PRECISION:
        return 0
    spec = get_recipe(format_name, backward_override=None).weight
    return 32 if isinstance(spec, NVFP4Spec) and spec.global_scale else 0


def _element_bits(spec) -> int:
    return spec.bits if isinstance(spec, IntSpec) else get_format(spec.element).bits


def fewest_bits(formats) -> float:
    """A lower bound on the bits per weight element of any layer in ``formats``: the cheapest format's
    code bits, plus its block scales' share where it has blocks (padding, per-row or per-tensor scales
    only add bits). An effective-bits budget below it fits no model, whatever its shapes."""
    bounds = []
    for name in plan_formats(formats):
        spec = None if name == HIGH_PRECISION else get_recipe(name, backward_override=None).weight
        if spec is None:
            bounds.append(float(HIGH_PRECISION_BITS))
        elif spec.block_size is None:
            bounds.append(float(_element_bits(spec)))
        else:
            side = 2**12  # a multiple of every block and tile: codes and block scales, nothing padded
            bounds.append((weight_bits(name, side, side) - _global_bits(name)) / side**2)
    return min(bounds)


def check_reachable(formats, budgets, *, argument: str = "budgets", formats_name: str = "formats"):
    """ValueError naming every budget in ``budgets`` (a list of bits per weight element) below
    ``fewest_bits(formats)``: no model's plan fits those, so they are refused before a model loads.
    ``argument`` and ``formats_name`` are what the messages call the two."""
    if isinstance(budgets, str) or not isinstance(budgets, Sequence):
        raise TypeError(f"{argument} must be a list of numbers of bits, got {checks.shown(budgets)}")
    for index, budget in enumerate(budgets):
        checks.number(f"{argument}[{index}]", budget, low=0, open_low=True)
    floor = fewest_bits(formats)
    below = [budget for budget in budgets if budget < floor]
    if below:
        shown = ", ".join(f"{budget:g}" for budget in below)
        raise ValueError(
            f"{argument} {shown} {'is' if len(below) == 1 else 'are'} below the {floor:g} bits per weight "
            f"element of the cheapest of {formats_name} {','.join(formats)}: no plan fits"
        )


def _check_layout(table: pd.DataFrame) -> pd.DataFrame:
    """A ``layer_table``-shaped frame: one row per (layer, format), one element count per layer."""
    checks.frame_columns("table", table, ["layer", "format", "elements", "bits"])
    if table.empty:
        raise ValueError("table has no rows: there are no layers to plan")
    if table.duplicated(["layer", "format"]).any():
        first = table[table.duplicated(["layer", "format"])].iloc[0]
        raise ValueError(f"table holds ({first.layer!r}, {first.format!r}) more than once")
    for column in ("elements", "bits"):
        values = pd.to_numeric(table[column], errors="coerce")
        if values.isna().any() or (values <= 0).any() or (values != values.round()).any():
            raise ValueError(f"table's {column} column must hold positive whole numbers")
    if (table.groupby("layer").elements.nunique() > 1).any():
        raise ValueError("table must give each layer one element count across its formats")
    return table


def _check_scores(table: pd.DataFrame) -> pd.DataFrame:
    checks.frame_columns("table", _check_layout(table), ["score"])
    scores = pd.to_numeric(table.score, errors="coerce").to_numpy(dtype=float)
    if not np.isfinite(scores).all():
        raise ValueError("table's score column must be finite for every (layer, format)")
    return table


def cheapest_bits(table: pd.DataFrame) -> float:
    """The smallest effective bits any assignment of ``table`` reaches: each layer in its fewest bits."""
    table = _check_layout(table)
    by_layer = table.groupby("layer", sort=False)
    return float(by_layer.bits.min().sum() / by_layer.elements.first().sum())


def _bit_capacity(effective_bits: float, table: pd.DataFrame) -> int:
    """The most bits a plan over ``table``'s layers may spend at ``effective_bits``: the largest integer
    B with B / Σ elements ≤ effective_bits as a float division (how a plan's mean is computed, so a
    budget equal to a reachable mean admits that plan), capped at every layer's most bits."""
    by_layer = table.groupby("layer", sort=False)
    total, most = int(by_layer.elements.first().sum()), int(by_layer.bits.max().sum())
    if effective_bits >= most / total:
        return most
    capacity = math.floor(Fraction(effective_bits) * total)
    while (capacity + 1) / total <= effective_bits:
        capacity += 1
    while capacity > 0 and capacity / total > effective_bits:
        capacity -= 1
    return capacity


def check_budget(table: pd.DataFrame, effective_bits: float, *, argument: str = "effective_bits") -> float:
    """``effective_bits`` if some assignment of ``table`` fits it, else ValueError naming the smallest
    budget that does (run before any score is measured); messages call the budget ``argument``."""
    table = _check_layout(table)
    checks.number(argument, effective_bits, low=0, open_low=True)
    by_layer = table.groupby("layer", sort=False)
    if int(by_layer.bits.min().sum()) > _bit_capacity(effective_bits, table):
        raise ValueError(
            f"{argument} {effective_bits:g} is below the {cheapest_bits(table):.4g} bits per element "
            f"that the cheapest format of every layer needs: no plan fits"
        )
    return effective_bits


def slug(model: str, dtype: str = "float32") -> str:
    """A file name for a model named by a packaged name, a folder or a hub id (its last two parts),
    loaded in ``dtype`` (any other than float32 is appended: "smollm2-135m-bf16")."""
    if not isinstance(model, str | Path):
        raise TypeError(f"model must be a name, a folder or a hub id, got {checks.shown(model)}")
    from qlab.models import DTYPES

    checks.choice("dtype", dtype, tuple(DTYPES))
    text = str(model).rstrip("/").replace("\\", "/")
    text = "--".join(part for part in text.split("/")[-2:] if part not in ("", ".", ".."))
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "model"
    return name if dtype == "float32" else f"{name}-{dtype}"


def solve(table: pd.DataFrame, *, effective_bits: float) -> dict[str, str]:
    """{layer: format} minimising the summed score with Σ bits ≤ effective_bits · Σ elements, each layer
    given exactly one of its rows' formats: a 0/1 integer program solved by HiGHS at relative gap 0
    (its absolute gap, 10⁻⁶ of the largest |score|, is the one tolerance), its bit constraint checked
    in integers; an answer over the budget by the solver's feasibility tolerance is cut off exactly
    (that one assignment excluded) and the program solved again. ValueError when no assignment fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    table = _check_scores(table).reset_index(drop=True)
    layers = list(dict.fromkeys(table.layer))
    check_budget(table, effective_bits)
    capacity = _bit_capacity(effective_bits, table)  # integer bits the plan may spend
    one_each = np.zeros((len(layers), len(table)))
    for column, layer in enumerate(table.layer):
        one_each[layers.index(layer), column] = 1
    bits = table.bits.to_numpy(dtype=np.int64)
    scores = table.score.to_numpy(dtype=float)
    largest = float(np.abs(scores).max()) or 1.0  # HiGHS's absolute gap is 1e-6: scores of order 1
    constraints = [
        LinearConstraint(one_each, 1, 1),
        LinearConstraint(bits[None, :].astype(float), -np.inf, capacity),
    ]
    for _ in range(MAX_CUTS):
        result = milp(c=scores / largest, integrality=np.ones(len(table)), bounds=Bounds(0, 1),
                      constraints=constraints, options={"mip_rel_gap": 0.0, "presolve": True})  # fmt: skip
        if result.x is None:
            raise ValueError(f"no plan fits effective_bits={effective_bits:g} (HiGHS: {result.message})")
        chosen = np.round(result.x).astype(bool)
        if int(bits[chosen].sum()) <= capacity:
            return dict(zip(table.layer[chosen], table.format[chosen]))
        # over by the solver's tolerance: exclude exactly this assignment (its layers' choices)
        constraints.append(LinearConstraint(chosen[None, :].astype(float), -np.inf, len(layers) - 1))
    raise RuntimeError(f"HiGHS returned {MAX_CUTS} plans over the bit budget in a row")


MAX_CUTS = 100  # over-budget answers cut off before solve gives up


def stability(table: pd.DataFrame, *, effective_bits: float, draws: int = 200, seed: int = 0) -> pd.DataFrame:
    """How firmly the data decide each layer's format: the calibration batches resampled with
    replacement ``draws`` times (a seeded bootstrap; every (layer, format) row's per-batch values,
    columns batch_0 …, resampled together), each draw's scores solved again. One row per layer:
    layer, format (chosen on all the batches), agreement (the share of draws choosing that format),
    the most frequent other format and its share, and undecided (agreement below ``UNDECIDED_BELOW``)."""
    table = _check_scores(table).reset_index(drop=True)
    checks.integer("draws", draws, low=1, high=MAX_DRAWS)
    checks.seed("seed", seed)
    columns = sorted((c for c in table.columns if re.fullmatch(BATCH_COLUMN.format(r"\d+"), str(c))),
                     key=lambda c: int(str(c).rsplit("_", 1)[1]))  # fmt: skip
    if len(columns) < 2:
        raise ValueError(f"table must hold the per-batch scores of at least 2 batches (columns batch_0, "
                         f"batch_1, …), got {len(columns)}")  # fmt: skip
    values = table[columns].to_numpy(dtype=float)
    if not np.isfinite(values).all():
        raise ValueError("table's per-batch scores must be finite")
    chosen = solve(table, effective_bits=effective_bits)
    generator = np.random.default_rng(seed)
    counts = {layer: {} for layer in chosen}
    for _ in range(draws):
        picked = generator.integers(len(columns), size=len(columns))
        assignment = solve(table.assign(score=values[:, picked].mean(axis=1)), effective_bits=effective_bits)
        for layer, format_name in assignment.items():
            counts[layer][format_name] = counts[layer].get(format_name, 0) + 1
    rows = []
    for layer, format_name in chosen.items():
        others = {name: count for name, count in counts[layer].items() if name != format_name}
        runner_up = max(others, key=others.get) if others else ""
        agreement = counts[layer].get(format_name, 0) / draws
        share = others.get(runner_up, 0) / draws
        rows.append(dict(layer=layer, format=format_name, agreement=agreement, other=runner_up,
                         other_share=share, undecided=agreement < UNDECIDED_BELOW))  # fmt: skip
    return pd.DataFrame(rows)


def score_agreement(first: pd.DataFrame, second: pd.DataFrame, *, draws: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """How well one score table ranks the (layer, format) pairs as another does: Spearman's ρ between
    the two tables' scores over their quantized rows (high-precision rows score 0 in both by
    definition and are left out), and a 95 % percentile bootstrap interval from resampling layers
    ``draws`` times (a layer's rows travel together; seeded). The tables must list the same rows in
    the same order (two score functions over the same layers and formats give that). Returns (ρ, low,
    high)."""
    from scipy import stats as scipy_stats

    for name, frame in (("first", first), ("second", second)):
        try:
            _check_scores(frame)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{name}: {error}") from None
    checks.integer("draws", draws, low=1, high=MAX_DRAWS)
    checks.seed("seed", seed)
    same = ["layer", "format"]
    if not first[same].reset_index(drop=True).equals(second[same].reset_index(drop=True)):
        raise ValueError("the two score tables must list the same (layer, format) rows in the same order")
    rows = (first.format != HIGH_PRECISION).to_numpy()
    a, b = first.score.to_numpy(float)[rows], second.score.to_numpy(float)[rows]
    layers = first.layer.to_numpy()[rows]
    names = list(dict.fromkeys(layers))
    if len(names) < 3:
        raise ValueError(f"a rank correlation needs at least 3 quantized layers, got {len(names)}")
    rho = float(scipy_stats.spearmanr(a, b).statistic)
    index = [np.flatnonzero(layers == name) for name in names]
    generator = np.random.default_rng(seed)
    samples = []
    for _ in range(draws):
        picked = np.concatenate([index[i] for i in generator.integers(len(names), size=len(names))])
        samples.append(scipy_stats.spearmanr(a[picked], b[picked]).statistic)
    low, high = np.nanpercentile(samples, [2.5, 97.5])
    return rho, float(low), float(high)


def ends_first(table: pd.DataFrame, *, effective_bits: float) -> dict[str, str]:
    """The usual rule at the same budget, for comparison: every layer in its fewest-bits format, then
    layers from both ends of the model (first, last, second, second-to-last, … in the table's order)
    raised to their most-bits format while the budget lasts. Scores are not read."""
    table = _check_layout(table)
    check_budget(table, effective_bits)
    layers = list(dict.fromkeys(table.layer))
    rows = {layer: table[table.layer == layer] for layer in layers}
    assignment = {layer: rows[layer].loc[rows[layer].bits.idxmin(), "format"] for layer in layers}
    spent = sum(int(rows[layer].bits.min()) for layer in layers)
    capacity = _bit_capacity(effective_bits, table)
    order = [layers[i // 2] if i % 2 == 0 else layers[-1 - i // 2] for i in range(len(layers))]
    for layer in dict.fromkeys(order):
        best = rows[layer].loc[rows[layer].bits.idxmax()]
        extra = int(best.bits) - int(rows[layer].bits.min())
        if spent + extra <= capacity:
            assignment[layer], spent = best.format, spent + extra
    return assignment


def effective_bits_of(table: pd.DataFrame, assignment: dict[str, str]) -> float:
    """The mean bits per weight element of ``assignment`` over ``table``'s layers."""
    table = _check_layout(table)
    if not isinstance(assignment, dict):
        raise TypeError(f"assignment must be a dict layer -> format, got {checks.shown(assignment)}")
    chosen = table[[assignment.get(layer) == name for layer, name in zip(table.layer, table.format)]]
    if len(chosen) != table.layer.nunique():
        missing = sorted(set(table.layer) - set(chosen.layer))
        raise ValueError(f"assignment gives no format offered in the table to {missing[:5]}")
    return float(chosen.bits.sum() / chosen.elements.sum())


@dataclass(frozen=True)
class Plan:
    """A weight format per convertible layer, with what it was chosen on: ``model`` (a name or path),
    ``model_config_sha256`` (``config_hash``), ``text_sha256`` (of the calibration token ids),
    ``formats`` offered, ``effective_bits`` asked and reached, the score ``kind``, qlab's version and
    each layer's weight ``elements`` (empty in a plan saved before they were recorded).
    ``quantize_model(model, plan)`` applies it to a model with the same layers of the same sizes;
    ``save``/``load`` keep it as JSON."""

    layers: dict[str, str]
    model: str = ""
    model_config_sha256: str = ""
    text_sha256: str = ""
    formats: tuple[str, ...] = ()
    effective_bits: float = math.nan
    reached_bits: float = math.nan
    kind: str = "measured"
    qlab_version: str = field(default_factory=lambda: __import__("qlab").__version__)
    elements: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.layers, dict) or not self.layers:
            raise TypeError(
                f"layers must be a non-empty dict layer -> format, got {checks.shown(self.layers)}"
            )
        if len(self.layers) > MAX_LAYERS:
            raise ValueError(f"layers must hold at most {MAX_LAYERS} layers, got {len(self.layers)}")
        for layer, format_name in self.layers.items():
            if not isinstance(layer, str) or not isinstance(format_name, str):
                raise TypeError(f"layers must map str to str, got {layer!r}: {format_name!r}")
        plan_formats(sorted(set(self.layers.values())))
        for name in ("model", "model_config_sha256", "text_sha256", "kind", "qlab_version"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {checks.shown(getattr(self, name))}")
        checks.choice("kind", self.kind, SCORE_KINDS)
        for name in ("effective_bits", "reached_bits"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isnan(value)):  # NaN: not stated
                checks.number(name, value, low=0)
        if not isinstance(self.formats, list | tuple):
            raise TypeError(f"formats must be a list or tuple of names, got {checks.shown(self.formats)}")
        if self.formats:
            plan_formats(list(self.formats))
        object.__setattr__(self, "formats", tuple(self.formats))
        if not isinstance(self.elements, dict):
            raise TypeError(
                f"elements must be a dict layer -> weight elements, got {checks.shown(self.elements)}"
            )
        for layer, count in self.elements.items():
            if layer not in self.layers:
                raise ValueError(f"elements names {layer!r}, a layer the plan gives no format")
            checks.integer(f"elements[{layer!r}]", count, low=1)

    def save(self, path) -> Path:
        """Write the plan as JSON (sorted keys: the same plan gives the same bytes); return the path."""
        path = Path(path)
        content = dict(dataclasses.asdict(self), formats=list(self.formats), plan_version=PLAN_VERSION)
        path.write_text(json.dumps(content, indent=1, sort_keys=True, allow_nan=True) + "\n")
        return path

    @classmethod
    def load(cls, path) -> Plan:
        """A plan written by ``save``; a file that is not one is a ValueError naming what is wrong."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"plan file {str(path)!r} is a folder; give the plan's .json file")
        if not path.is_file():
            raise ValueError(f"plan file {str(path)!r} does not exist")
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"plan file {str(path)!r} is not JSON: {error}") from None
        version = content.pop("plan_version", None) if isinstance(content, dict) else None
        if type(version) is not type(PLAN_VERSION) or version != PLAN_VERSION:
            raise ValueError(f"plan file {str(path)!r} is not a qlab plan (plan_version {PLAN_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        if set(content) - known:
            raise ValueError(f"plan file {str(path)!r} has unknown fields {sorted(set(content) - known)}")
        if "layers" not in content:
            raise ValueError(f"plan file {str(path)!r} has no layers")
        try:
            plan = cls(**content)
        except (TypeError, ValueError) as error:
            raise ValueError(f"plan file {str(path)!r}: {error}") from None
        if plan.formats and not set(plan.layers.values()) <= set(plan.formats):
            odd = sorted(set(plan.layers.values()) - set(plan.formats))
            raise ValueError(f"plan file {str(path)!r} gives layers {odd}, formats it was not chosen from")
        if plan.reached_bits > plan.effective_bits:  # NaN (not stated) compares False
            raise ValueError(
                f"plan file {str(path)!r} reaches {plan.reached_bits:g} bits per weight, over the "
                f"{plan.effective_bits:g} it was chosen for (a hand-edited file)"
            )
        return plan

    def check_layers(self, have: Sequence[str] | dict[str, int]) -> None:
        """ValueError naming the plan's layers not in ``have`` (a model's convertible layers) and the
        layers in ``have`` the plan gives no format; given each layer's weight elements (a dict), also
        those whose size is not the one the plan was made for."""
        if isinstance(have, str | bytes) or not isinstance(have, dict | Sequence | set):
            raise TypeError(f"have must be a dict or a list of layer names, got {checks.shown(have)}")
        sizes = have if isinstance(have, dict) else {}
        have = list(have)
        missing = [name for name in self.layers if name not in have]
        extra = [name for name in have if name not in self.layers]
        if missing or extra:
            raise ValueError(
                f"the plan does not fit this model: {len(missing)} planned layers are not convertible layers "
                f"of the model {missing[:5]}, {len(extra)} of the model's layers have no format in the plan "
                f"{extra[:5]}" + (f" (the plan was made for {self.model!r})" if self.model else "")
            )
        resized = [name for name, count in self.elements.items() if name in sizes and sizes[name] != count]
        if resized:
            shown = ", ".join(
                f"{name}: {self.elements[name]} in the plan, {sizes[name]} here" for name in resized[:3]
            )
            raise ValueError(
                f"the plan does not fit this model: {len(resized)} layers have other weight sizes than the "
                f"plan was made for ({shown})"
                + (f"; the plan was made for {self.model!r}" if self.model else "")
            )


def make_plan(table: pd.DataFrame, *, effective_bits: float, model: str = "", model_config_sha256: str = "",
              text_sha256: str = "") -> Plan:  # fmt: skip
    """``solve`` ``table``; keep the result with what it was chosen on (score kind, formats, budget)."""
    assignment = solve(table, effective_bits=effective_bits)
    kinds = set(table["kind"]) if "kind" in table else {"measured"}
    if len(kinds) != 1:
        raise ValueError(f"table mixes score kinds {sorted(kinds)}: a plan is chosen by one kind")
    return Plan(
        layers=assignment,
        model=model,
        model_config_sha256=model_config_sha256,
        text_sha256=text_sha256,
        formats=tuple(dict.fromkeys(table.format)),
        effective_bits=float(effective_bits),
        reached_bits=effective_bits_of(table, assignment),
        kind=kinds.pop(),
        elements={layer: int(count) for layer, count in zip(table.layer, table.elements)},
    )


def token_hash(batches: Sequence[torch.Tensor]) -> str:
    """sha256 of the token ids of ``batches`` (int64 bytes, in order): which text a plan was chosen on."""
    batches = checks.batches("batches", batches)
    for index, batch in enumerate(batches):
        checks.tensor(f"batches[{index}]", batch, dtypes=(torch.int64, torch.int32))
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(batch.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()
