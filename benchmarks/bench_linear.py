"""QuantLinear forward+backward against nn.Linear, every recipe preset and backward override, one run.

    python benchmarks/bench_linear.py [--tokens 4096] [--features 1024] [--repeats 3] [--threads auto]
                                      [--device cpu|cuda] [--dtype float32|bfloat16] [--results DIR]

x (tokens × features, --dtype, requires grad) through a features → features layer with bias;
forward, then backward of a fixed dy. Medians of --repeats after a warm-up (which also compiles
qdq's fast path for every operand shape). Prints a markdown table with ratios to nn.Linear of the
same dtype (on CUDA: QuantLinear's operands through qlab's Triton kernels, FP8 recipes on tensor cores),
and appends its rows to ``benchmarks/results/bench_linear_cpu.csv`` (``bench_linear_gpu.csv`` on CUDA)
with the machine, device, date, torch and commit.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from timing import (  # noqa: E402
    add_results_argument,
    add_thread_argument,
    forward_backward,
    machine,
    median_seconds,
    record,
    set_threads,
)

from qlab.nn import QuantLinear, highest_matmul_precision  # noqa: E402
from qlab.recipe import BACKWARD_OVERRIDES, PRESETS, get_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    add_thread_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    threads = set_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = device.type == "cuda"
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.features, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.tokens, args.features, device=device, dtype=dtype)
    linear = nn.Linear(args.features, args.features, device=device, dtype=dtype)
    with highest_matmul_precision():
        baseline = median_seconds(
            forward_backward(functools.partial(linear, x), dy, x, *linear.parameters()),
            args.repeats,
            synchronize=sync,
        )

    print(
        f"machine: {machine(device)}; {args.tokens}×{args.features} → {args.features} {args.dtype}, "
        f"forward+backward; nn.Linear {baseline * 1e3:.2f} ms\n"
    )
    shape = f"{args.tokens}×{args.features} → {args.features} {args.dtype}"
    rows = []
    print("| recipe | backward_override | QuantLinear (ms) | ratio to nn.Linear |")
    print("|---|---|---:|---:|")
    for preset in PRESETS:
        for override in BACKWARD_OVERRIDES:
            if preset == "fp8_delayed" and override is not None:
                continue  # refused by design
            layer = QuantLinear.from_linear(linear, get_recipe(preset, backward_override=override))
            seconds = median_seconds(
                forward_backward(functools.partial(layer, x), dy, x, *layer.parameters()),
                args.repeats,
                synchronize=sync,
            )
            print(f"| {preset} | {override} | {seconds * 1e3:.2f} | {seconds / baseline:.2f} |", flush=True)
            rows.append(
                {
                    "threads": threads if device.type == "cpu" else "",
                    "shape": shape,
                    "recipe": preset,
                    "backward_override": str(override),
                    "gemm": layer.gemm,
                    "ms": round(seconds * 1e3, 3),
                    "baseline": f"nn.Linear ({args.dtype})",
                    "baseline_ms": round(baseline * 1e3, 3),
                    "ratio": round(seconds / baseline, 2),
                }
            )
    kind = "gpu" if device.type == "cuda" else "cpu"
    record(f"bench_linear_{kind}", rows, args.results, device=device)


if __name__ == "__main__":
    main()
