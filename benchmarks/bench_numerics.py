"""Speed of qlab.numerics' reference implementations, as ratios to PyTorch in the same run.

    python benchmarks/bench_numerics.py [--rows 4096] [--hidden 1024] [--repeats 5] [--results DIR]

Prints a markdown table and appends its rows to ``benchmarks/results/bench_numerics.csv`` (with the
machine, device, date, torch and commit; the docs' table is generated from that file). The references
are for measuring numerical error, not for speed; the table says what they cost so a notebook author
can size a sweep. Timings are medians of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, machine, median_seconds, record  # noqa: E402

from qlab import numerics  # noqa: E402


def layer_norm_fwd_bwd(impl, x, weight, bias, dy):
    def run():
        xg = x.detach().requires_grad_(True)
        w, b = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)
        out = impl(xg, (x.shape[-1],), w, b, 1e-5)
        torch.autograd.grad(out, (xg, w, b), dy)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    add_results_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.hidden)
    weight, bias, dy = torch.randn(args.hidden), torch.randn(args.hidden), torch.randn(args.rows, args.hidden)

    print(f"machine: {machine()}; shape {args.rows}×{args.hidden} float32\n")
    rows = []

    def row(shape, operation, seconds, baseline_seconds):
        rows.append(
            {
                "threads": torch.get_num_threads(),
                "shape": shape,
                "operation": operation,
                "qlab_ms": round(seconds * 1e3, 3),
                "baseline_ms": round(baseline_seconds * 1e3, 3),
                "ratio": float(f"{seconds / baseline_seconds:.3g}"),
            }
        )

    print("| operation | qlab (ms) | baseline (ms) | ratio qlab/baseline |")
    print("|---|---:|---:|---:|")
    baseline = median_seconds(layer_norm_fwd_bwd(F.layer_norm, x, weight, bias, dy), args.repeats)
    for stats in numerics.LAYER_NORM_STATS:
        impl = lambda *a, stats=stats: numerics.layer_norm(*a, stats=stats)  # noqa: E731
        t = median_seconds(layer_norm_fwd_bwd(impl, x, weight, bias, dy), args.repeats)
        row(
            f"{args.rows}×{args.hidden} float32",
            f"layer_norm fwd+bwd, stats={stats} vs F.layer_norm",
            t,
            baseline,
        )
        print(
            f"| layer_norm fwd+bwd, stats={stats} vs F.layer_norm | {t * 1e3:.1f} | "
            f"{baseline * 1e3:.1f} | {t / baseline:.1f} |"
        )

    first_rows = x[:256]
    baseline = median_seconds(lambda: torch.var(first_rows, dim=-1, unbiased=False), args.repeats)
    for algorithm in numerics.ALGORITHMS:
        t = median_seconds(lambda: numerics.variance(first_rows, algorithm), args.repeats)
        operation = f"variance, {algorithm} (reference, {len(first_rows)} rows) vs torch.var"
        row(f"{len(first_rows)}×{args.hidden} float32", operation, t, baseline)
        print(f"| {operation} | {t * 1e3:.1f} | {baseline * 1e3:.3f} | {t / baseline:.2g} |")
    t = median_seconds(lambda: numerics.exact_moments(first_rows), 1)
    operation = f"exact_moments (rational arithmetic, {len(first_rows)} rows) vs torch.var"
    row(f"{len(first_rows)}×{args.hidden} float32", operation, t, baseline)
    print(f"| {operation} | {t * 1e3:.1f} | {baseline * 1e3:.3f} | {t / baseline:.2g} |")
    record("bench_numerics", rows, args.results)


if __name__ == "__main__":
    main()
