"""Backward time of top-k sparse back-propagation against dense, every variant, in one run.

    python benchmarks/bench_sparse.py [--tokens 512] [--repeats 3] [--device auto]

Two models: meProp's MNIST-sized MLP (784 → 500 → 500 → 10, top-k on the hidden layers) and one
4096 × 4096 Linear. For k ∈ {1, 5, 10, 25} % of each layer's outputs: hook masking (dense GEMMs on
a zeroed dy), gathered GEMMs (one index set shared by the batch) and per-row sparse GEMMs
(torch.sparse), as ratios to the dense backward in the same run. Medians of --repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import platform

import torch
from torch import nn

from qlab.sparse import BACKWARDS, backward_seconds
from qlab.train.loop import resolve_device

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
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine())
    )
    print(
        f"machine: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.tokens} rows, "
        f"backward only, medians of {args.repeats}\n"
    )
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


if __name__ == "__main__":
    main()
