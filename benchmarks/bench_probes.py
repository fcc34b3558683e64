"""Step-time overhead of qlab.probes on notebook 01's model, CPU, ratios in one run.

    python benchmarks/bench_probes.py [--steps 200]

Training step: forward, backward, AdamW on qlab.seed_model.SeedTransformer (the seed's quantized
linears, width 64, 2 blocks, 16 sequences × 32 tokens). Compared: no probes; a ProbeSet on every
module with parameters, all roles and all statistics recorded every step; the same sampling every
100 steps. Mean step time over --steps steps after 5 warm-up steps.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn

from qlab.probes import ProbeSet
from qlab.seed_model import SeedTransformer, permutation_task_batch


def make_model():
    return SeedTransformer(mode="corrected", seed=0)


def mean_step_seconds(model, steps, probes=None):
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

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    baseline = mean_step_seconds(make_model(), args.steps)
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; baseline step {baseline * 1e3:.1f} ms\n"
    )
    print("| probes | step (ms) | overhead |")
    print("|---|---:|---:|")
    for label, every in (
        ("all roles, all stats, every step", 1),
        ("all roles, all stats, every 100 steps", 100),
    ):
        model = make_model()
        with ProbeSet(model, every=every) as probes:
            seconds = mean_step_seconds(model, args.steps, probes)
        print(f"| {label} | {seconds * 1e3:.1f} | {100 * (seconds / baseline - 1):+.1f} % |")


if __name__ == "__main__":
    main()
