"""Backward time of top-k sparse back-propagation against dense, every variant, in one run.

    python benchmarks/bench_sparse.py [--tokens 512] [--repeats 3] [--device auto] [--results DIR]

Two models: meProp's MNIST-sized MLP (784 → 500 → 500 → 10, top-k on the hidden layers) and one
4096 × 4096 Linear. For k ∈ {1, 5, 10, 25} % of each layer's outputs: hook masking (dense GEMMs on
a zeroed dy), gathered GEMMs (one index set shared by the batch) and per-row sparse GEMMs
(torch.sparse), as ratios to the dense backward in the same run. Medians of --repeats after a warm-up.
Appends its rows to ``benchmarks/results/bench_sparse.csv`` with the machine, device, date, torch and
commit (the docs' table is generated from that file).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, machine, record  # noqa: E402

from qlab.sparse import BACKWARDS, backward_seconds  # noqa: E402
from qlab.train.loop import resolve_device  # noqa: E402

FRACTIONS = (0.01, 0.05, 0.10, 0.25)


def models(device):
    mlp = nn.Sequential(nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 500), nn.ReLU(), nn.Linear(500, 10))
    return {
        "MLP 784-500-500-10": (mlp.to(device), 784, 10, ["4"]),  # the output layer stays dense, as in meProp
        "Linear 4096×4096": (nn.Linear(4096, 4096).to(device), 4096, 4096, []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    add_results_argument(parser)
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    print(f"machine: {machine(device)}; {args.tokens} rows, backward only, medians of {args.repeats}\n")
    rows = []
    print("| model | k | dense (ms) | hook_mask | gathered | sparse_rows |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (model, inputs, outputs, keep) in models(device).items():
        x = torch.randn(args.tokens, inputs, device=device, requires_grad=True)
        dy = torch.randn(args.tokens, outputs, device=device)
        dense = backward_seconds(model, x, dy, "dense", 1.0, repeats=args.repeats)
        for fraction in FRACTIONS:
            ratios = [
                backward_seconds(model, x, dy, variant, fraction, keep=keep, repeats=args.repeats) / dense
                for variant in BACKWARDS[1:]
            ]
            print(
                f"| {label} | {fraction:.0%} | {dense * 1e3:.1f} | "
                + " | ".join(f"{r:.2f}" for r in ratios)
                + " |",
                flush=True,
            )
            rows.append(
                {
                    "threads": torch.get_num_threads() if device.type == "cpu" else "",
                    "tokens": args.tokens,
                    "repeats": args.repeats,
                    "model": label,
                    "k": f"{fraction:.0%}",
                    "dense_ms": round(dense * 1e3, 2),
                    **{variant: round(ratio, 2) for variant, ratio in zip(BACKWARDS[1:], ratios)},
                }
            )
    record("bench_sparse", rows, args.results, device=device)


if __name__ == "__main__":
    main()
