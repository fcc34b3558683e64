"""The training runs of the notebooks that train many models (03 and 07), as functions of their parameters.

    run_list = run_lists.run_list("03_backward_override_training_curves", parameters, device="cpu")
    run_list.parameters   # the notebook's parameters with its profile's and smoke's sizes applied
    run_list.labels       # per run: {"recipe": ..., "override": ..., "seed": ...}
    run_list.configs      # per run: the TrainConfig

A notebook calls its function right after ``session.start``; ``qlab campaign`` calls the same function
without running the notebook. The runs a campaign stores are therefore exactly the runs the notebook
reads (``qlab.campaign``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qlab import checks, session
from qlab.host import resolve_device


@dataclass(frozen=True)
class RunList:
    """A notebook's training runs: its sized parameters, and one label dict and TrainConfig per run."""

    notebook: str
    parameters: dict
    labels: list[dict]
    configs: list
    given: dict = field(default_factory=dict)  # the parameters as given, before the sizes were applied

    def __len__(self) -> int:
        return len(self.configs)


def _backward_override_runs(parameters: dict, device: str) -> RunList:
    """Notebook 03: FP32 and BF16, then every recipe × backward override, then the recipes that refuse an
    override with their own backward, for seeds 0 … seeds−1 (seed-major order)."""
    from qlab.train import TrainConfig

    for argument in ("recipes", "recipe_backward_only", "overrides"):
        _each_once(argument, parameters[argument])
    both = [recipe for recipe in parameters["recipes"] if recipe in parameters["recipe_backward_only"]]
    if both:
        raise ValueError(
            f"recipe {both[0]!r} is in both recipes and recipe_backward_only; give it in one: recipes trains "
            "it with every override, recipe_backward_only with its own backward only"
        )
    p = dict(parameters)
    if p["profile"] == "paper":  # the 1.0M-parameter CharGPT (5 blocks × 128), 3000 steps, ≥ 5 seeds
        p.update(seeds=max(p["seeds"], 5), steps=3000, layers=5, width=128, context=128, batch_size=32)
        p.update(lr=1e-3, warmup_steps=100, eval_every=100, eval_batches=16, fidelity_every=250)
    if p["smoke"]:
        p.update(steps=4, layers=1, width=32, context=32, batch_size=8, eval_every=2, eval_batches=1)
        p.update(fidelity_every=2, seeds=2, warmup_steps=2)
        p["recipes"] = ["nvfp4"] if "nvfp4" in p["recipes"] else p["recipes"][:1]
    base = TrainConfig(
        steps=p["steps"], layers=p["layers"], width=p["width"], heads=p["heads"], context=p["context"],
        batch_size=p["batch_size"], lr=p["lr"], warmup_steps=p["warmup_steps"], eval_every=p["eval_every"],
        eval_batches=p["eval_batches"], fidelity_every=p["fidelity_every"],
        keep_high_precision=p["keep_high_precision"], device=device, gemm=p["gemm"], compile=p["compiled"],
        progress=False,
    )  # fmt: skip
    modes = [None if mode in ("none", None) else mode for mode in p["overrides"]]
    configurations = (
        [("fp32", None), ("bf16", None)]
        + [(recipe, mode) for recipe in p["recipes"] for mode in modes]
        + [(recipe, None) for recipe in p["recipe_backward_only"]]
    )
    sources = (
        ["the FP32 baseline", "the BF16 baseline"]
        + [f"recipes × overrides ({recipe!r})" for recipe in p["recipes"] for _ in modes]
        + [f"recipe_backward_only ({recipe!r})" for recipe in p["recipe_backward_only"]]
    )
    for index, (recipe, mode) in enumerate(configurations):
        if (recipe, mode) in configurations[:index]:
            first = sources[configurations.index((recipe, mode))]
            raise ValueError(
                f"recipe {recipe!r} with override {mode or 'none'!r} is trained by {first} and again by "
                f"{sources[index]}; give each configuration once"
            )
    labels, configs = [], []
    for seed in range(p["seeds"]):
        for recipe, mode in configurations:
            labels.append({"recipe": recipe, "override": mode or "none", "seed": seed})
            configs.append(base.replace(recipe=recipe, backward_override=mode, seed=seed))
    return RunList("03_backward_override_training_curves", p, labels, configs)


def _recipe_ablation_runs(parameters: dict, device: str) -> RunList:
    """Notebook 07's section 3: FP32 and every training variant, for seeds 0 … seeds−1 (seed-major)."""
    from qlab import ablation
    from qlab.train import TrainConfig

    _each_once("train_variants", parameters["train_variants"])
    if "fp32" in parameters["train_variants"]:
        raise ValueError(
            "train_variants must not list 'fp32': the run list trains the FP32 baseline beside every "
            f"variant; got {parameters['train_variants']!r}"
        )
    p = dict(parameters)
    if p["profile"] == "paper":  # the 1.0M-parameter CharGPT (5 blocks × 128), 3000 steps, ≥ 5 seeds
        p.update(seeds=max(p["seeds"], 5), train_steps=3000, capture_steps=1000, sr_draws=64)
        p.update(layers=5, width=128, context=128, batch_size=32)
    if p["smoke"]:
        p.update(seeds=2, tokens=64, features=32, capture_steps=2, sr_draws=3, train_steps=2)
        p.update(pretrained_layers=p["pretrained_layers"][:1], pretrained_tokens=16)
        p.update(train_variants=["nvfp4", "nvfp4/none"], layers=1, width=32, context=32, batch_size=8)
    steps = p["train_steps"]
    base = TrainConfig(
        steps=steps, layers=p["layers"], width=p["width"], heads=4, context=p["context"],
        batch_size=p["batch_size"], lr=0.003, warmup_steps=max(1, steps // 10), eval_every=steps,
        eval_batches=2, device=device, progress=False,
    )  # fmt: skip
    labels, configs = [], []
    for seed in range(p["seeds"]):
        for variant in ["fp32", *p["train_variants"]]:
            preset, off, keep_last_block = ablation.variant_parts(variant, argument="train_variants")
            labels.append({"variant": variant, "seed": seed})
            configs.append(
                base.replace(
                    recipe=preset, ablate=off, seed=seed,
                    keep_high_precision=["head", "last_block"] if keep_last_block else ["head"],
                    fidelity_every=0 if preset == "fp32" else max(1, steps // 3),
                )
            )  # fmt: skip
    return RunList("07_recipe_ablations", p, labels, configs)


PAPER_FIXED = {  # the parameters each notebook's paper profile sets (seeds: at least 5, not fixed)
    "03_backward_override_training_curves": ("steps", "layers", "width", "context", "batch_size", "lr",
                                             "warmup_steps", "eval_every", "eval_batches", "fidelity_every"),
    "07_recipe_ablations": ("train_steps", "capture_steps", "sr_draws", "layers", "width", "context",
                            "batch_size"),
}  # fmt: skip

RUN_LISTS: dict[str, Callable[[dict, str], RunList]] = {
    "03_backward_override_training_curves": _backward_override_runs,
    "07_recipe_ablations": _recipe_ablation_runs,
}


def run_list(notebook: str, parameters: dict, device: str) -> RunList:
    """Notebook ``notebook``'s runs for these parameter values (every parameter of its parameters cell)
    on ``device`` ("cpu", "cuda"; already resolved from "auto")."""
    if not isinstance(notebook, str) or notebook not in RUN_LISTS:
        raise ValueError(
            f"notebook must be one with a run list ({', '.join(sorted(RUN_LISTS))}), got {notebook!r}"
        )
    if not isinstance(parameters, dict):
        raise TypeError(f"parameters must be a dict of name -> value, got {checks.shown(parameters)}")
    missing = [name for name in session.notebook_defaults(notebook) if name not in parameters]
    if missing:
        raise ValueError(f"parameters must hold every parameter of {notebook}; missing: {', '.join(missing)}")
    session.check_parameters(notebook, parameters)
    if parameters.get("profile") == "paper":  # the profile's sizes replace these: a changed one would be lost
        defaults = session.notebook_defaults(notebook)
        fixed = [
            name
            for name in PAPER_FIXED[notebook]
            if session.changed_parameters({name: parameters[name]}, {name: defaults[name]})
        ]
        if fixed:
            raise ValueError(
                f"profile 'paper' sets {', '.join(fixed)} itself; leave them at their defaults, or use "
                "profile 'cpu' with your own sizes"
            )
    if device == "auto":
        raise ValueError("device must be resolved ('cpu', 'cuda'), got 'auto': see qlab.host.resolve_device")
    device = str(resolve_device(device, argument="device"))
    listed = RUN_LISTS[notebook](parameters, device)
    _runs_once(listed)
    return RunList(listed.notebook, listed.parameters, listed.labels, listed.configs, dict(parameters))


def _each_once(argument: str, values) -> None:
    """A list parameter must name each entry once: a repeated entry is a configuration trained, and
    its seeds counted, twice."""
    for index, value in enumerate(values):
        if value in values[:index]:
            first = values.index(value)
            raise ValueError(
                f"{argument} lists {value!r} twice (entries {first} and {index}); give each once"
            )


def _runs_once(listed: RunList) -> None:
    """No two runs of a list may share a label or train the same configuration under two labels."""
    labels: dict = {}
    configs: dict = {}  # by repr: a TrainConfig holds lists, so it does not hash
    for label, config in zip(listed.labels, listed.configs):
        key, shown = tuple(sorted(label.items())), repr(config)
        other = labels.get(key, configs.get(shown))
        if other is not None:
            raise ValueError(
                f"the runs of {listed.notebook} would train {other} and {label} as one configuration; "
                "give each configuration once"
            )
        labels[key] = configs[shown] = label
