"""QuantLinear forward+backward against nn.Linear, every recipe preset and backward override, one run.

    python benchmarks/bench_linear.py [--tokens 4096] [--features 1024] [--repeats 3]

x (tokens × features, float32, requires grad) through a features → features layer with bias;
forward, then backward of a fixed dy. Medians of --repeats after a warm-up (which also compiles
qdq's fast path for every operand shape). Prints a markdown table with ratios to nn.Linear.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from timing import median_seconds  # noqa: E402

from qlab.nn import QuantLinear, highest_matmul_precision  # noqa: E402
from qlab.recipe import BACKWARD_OVERRIDES, PRESETS, get_recipe  # noqa: E402


def forward_backward(layer, x, dy):
    def run():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(dy)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.features, requires_grad=True)
    dy = torch.randn(args.tokens, args.features)
    linear = nn.Linear(args.features, args.features)
    with highest_matmul_precision():
        baseline = median_seconds(forward_backward(linear, x, dy), args.repeats)

    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {args.tokens}×{args.features} → {args.features} float32, "
        "forward+backward; "
        f"nn.Linear {baseline * 1e3:.0f} ms\n"
    )
    print("| recipe | backward_override | QuantLinear (ms) | ratio to nn.Linear |")
    print("|---|---|---:|---:|")
    for preset in PRESETS:
        for override in BACKWARD_OVERRIDES:
            if preset == "fp8_delayed" and override is not None:
                continue  # refused by design
            layer = QuantLinear.from_linear(linear, get_recipe(preset, backward_override=override))
            seconds = median_seconds(forward_backward(layer, x, dy), args.repeats)
            print(f"| {preset} | {override} | {seconds * 1e3:.0f} | {seconds / baseline:.2f} |", flush=True)


if __name__ == "__main__":
    main()
