"""Step-time overhead of qlab.probes on notebook 01's model, CPU, ratios in one run.

    python benchmarks/bench_probes.py [--steps 300] [--repeats 3] [--threads auto] [--results DIR]

Training step: forward, backward, AdamW on qlab.seed_model.SeedTransformer (the seed's quantized
linears, width 64, 2 blocks, 16 sequences × 32 tokens). Compared: no probes; a ProbeSet on every
module with parameters, all roles and all statistics recorded every step; the same sampling every
100 steps; every step with fewer roles or statistics; notebook 01's own probe (one module, role
"probe", l2); and the hooks alone (no statistics).

Every configuration has its own model, optimizer and probes (only its own set active during its
step: ``probe()`` records into every active set), and they take their steps in turn, one step each
per round: a slow phase of a shared VM (the unprobed step swings between 9 and 16 ms here
within minutes) then slows them all alike, where timing each configuration's steps as a block let it
land on one. A configuration's cost per step is its median step plus, amortized over its steps,
reading the records once at the end (``to_frame()``: where the statistics reach the host as a frame).
The "paired" column takes instead, for each round, the configuration's step over the unprobed step of
the same round (the order shuffled each round), and the median of those ratios: a slow phase of the
VM then reaches both sides of a ratio. A repeat is a fresh set of models; the table gives the median
overhead over repeats and its range, and appends its rows to ``benchmarks/results/bench_probes.csv``
with the machine, device, date, torch and commit (the docs' table is generated from that file).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, add_thread_argument, machine, median_and_range, record, set_threads  # noqa: E402

from qlab import probes as qlab_probes  # noqa: E402
from qlab.probes import ProbeSet  # noqa: E402
from qlab.seed_model import SeedTransformer, permutation_task_batch  # noqa: E402

# (label, ProbeSet keyword arguments); None: the unprobed baseline
CONFIGS = (
    ("no probes", None),
    ("all roles, all stats, every step", {"every": 1}),
    ("all roles, all stats, every 100 steps", {"every": 100}),
    ("param_grad only, all stats, every step", {"every": 1, "roles": ("param_grad",)}),
    ("output only, all stats, every step", {"every": 1, "roles": ("output",)}),
    ("all roles, amax and l2, every step", {"every": 1, "stats": ("amax", "l2")}),
    ("all roles, hooks alone (no stats), every step", {"every": 1, "stats": ()}),
    (
        "notebook 01's probe (blocks.0.fc1, probe, l2), every step",
        {"every": 1, "modules": ["blocks.0.fc1"], "roles": ("probe",), "stats": ("l2",)},
    ),
)


def make_model():
    return SeedTransformer(mode="corrected", seed=0)


def make_step(options):
    """A training step of a fresh model with these probes (None: unprobed), and the probes."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = permutation_task_batch(16, 32, 32, torch.Generator().manual_seed(1))
    probes = ProbeSet(model, **options).attach() if options is not None else None

    def step():
        # probe() records into every active set: only this configuration's may be active in its step,
        # or each model's backward would record its probe() calls into all the others' sets too
        qlab_probes._ACTIVE[:] = [probes] if probes is not None else []
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        if probes is not None:
            probes.record_param_grads()
        optimizer.step()
        if probes is not None:
            probes.step()

    return step, probes


def seconds_per_step(steps: int, warmup: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """(each configuration's median step plus its amortized read, in seconds; each configuration's
    paired overhead: the median over rounds of its step / the unprobed step of the same round, minus 1,
    plus its amortized read over the unprobed median). Steps taken in turn, in a shuffled order each
    round, so no configuration always follows the same one."""
    runs = {label: make_step(options) for label, options in CONFIGS}  # each attaches its own set
    times = {label: [] for label in runs}
    order = random.Random(0)
    for round_ in range(warmup + steps):  # the warm-up compiles nothing now, but touches every page
        labels = list(runs)
        order.shuffle(labels)
        for label in labels:
            start = time.perf_counter()
            runs[label][0]()
            if round_ >= warmup:
                times[label].append(time.perf_counter() - start)
    result, paired = {}, {}
    unprobed = statistics.median(times["no probes"])
    for label, (_, probes) in runs.items():
        read = 0.0
        if probes is not None:
            start = time.perf_counter()
            probes.to_frame()
            read = (time.perf_counter() - start) / (warmup + steps)
        result[label] = statistics.median(times[label]) + read
        ratios = [t / base for t, base in zip(times[label], times["no probes"])]
        paired[label] = statistics.median(ratios) - 1 + read / unprobed
        if probes is not None:
            qlab_probes._ACTIVE[:] = [probes]
            probes.detach()
    return result, paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    add_thread_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    baselines, overheads = [], {label: [] for label, options in CONFIGS if options is not None}
    paired_overheads = {label: [] for label in overheads}
    for _ in range(args.repeats):
        seconds, paired = seconds_per_step(args.steps)
        baseline = seconds["no probes"]
        baselines.append(baseline * 1e3)
        for label in overheads:
            overheads[label].append(100 * (seconds[label] / baseline - 1))
            paired_overheads[label].append(100 * paired[label])
    print(
        f"machine: {machine()}; unprobed step {median_and_range(baselines)} ms, "
        f"{args.steps} steps taken in turn, {args.repeats} repeats\n"
    )
    print("| probes | overhead, % of the unprobed step: median (min–max) | paired, % |")
    print("|---|---:|---:|")
    rows = []
    for label, values in overheads.items():
        print(f"| {label} | {median_and_range(values)} | {median_and_range(paired_overheads[label])} |")
        rows.append(
            {
                "threads": threads,
                "steps": args.steps,
                "repeats": args.repeats,
                "unprobed_ms": median_and_range(baselines),
                "probes": label,
                "overhead_percent": median_and_range(values),
                "paired_percent": median_and_range(paired_overheads[label]),
            }
        )
    record("bench_probes", rows, args.results)


if __name__ == "__main__":
    main()
