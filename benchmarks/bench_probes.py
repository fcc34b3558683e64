"""Step-time overhead of qlab.probes on notebook 01's model, CPU, ratios in one run.

    python benchmarks/bench_probes.py [--steps 200] [--repeats 3] [--threads auto]

Training step: forward, backward, AdamW on qlab.seed_model.SeedTransformer (the seed's quantized
linears, width 64, 2 blocks, 16 sequences × 32 tokens). Compared: no probes; a ProbeSet on every
module with parameters, all roles and all statistics recorded every step; the same sampling every
100 steps; and every step with fewer roles or statistics (what a researcher can afford every step).
Each configuration warms up past its first sampled step (which compiles the fused statistics
kernel), then times --steps steps (two sampled steps for every=100) and reads the records (the one
host transfer); repeats are interleaved, and the table gives the median overhead and range.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_thread_argument, machine, median_and_range, set_threads  # noqa: E402

from qlab.probes import ProbeSet  # noqa: E402
from qlab.seed_model import SeedTransformer, permutation_task_batch  # noqa: E402

# (label, ProbeSet keyword arguments)
CONFIGS = (
    ("all roles, all stats, every step", {"every": 1}),
    ("all roles, all stats, every 100 steps", {"every": 100}),
    ("param_grad only, all stats, every step", {"every": 1, "roles": ("param_grad",)}),
    ("output only, all stats, every step", {"every": 1, "roles": ("output",)}),
    ("all roles, amax and l2, every step", {"every": 1, "stats": ("amax", "l2")}),
)


def make_model():
    return SeedTransformer(mode="corrected", seed=0)


def mean_step_seconds(model, steps, probes=None, warmup=5):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = permutation_task_batch(16, 32, 32, torch.Generator().manual_seed(1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        if probes is not None:
            probes.record_param_grads()
        optimizer.step()
        if probes is not None:
            probes.step()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if probes is not None:
        len(probes.records)  # the statistics reach the host here
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    add_thread_argument(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    baselines, overheads = [], {label: [] for label, _ in CONFIGS}
    for _ in range(args.repeats):
        baseline = mean_step_seconds(make_model(), args.steps)
        baselines.append(baseline * 1e3)
        for label, options in CONFIGS:
            model = make_model()
            with ProbeSet(model, **options) as probes:
                seconds = mean_step_seconds(model, args.steps, probes, warmup=options["every"] + 5)
            overheads[label].append(100 * (seconds / baseline - 1))
    print(
        f"machine: {machine()}; baseline step {median_and_range(baselines)} ms, "
        f"{args.steps} steps, {args.repeats} interleaved repeats\n"
    )
    print("| probes | overhead, % of the unprobed step: median (min–max) |")
    print("|---|---:|")
    for label, _ in CONFIGS:
        print(f"| {label} | {median_and_range(overheads[label])} |")


if __name__ == "__main__":
    main()
