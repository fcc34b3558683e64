"""qdq speed on CPU: qlab against torchao's reference quantizers and x.clone(), in the same run.

    python benchmarks/bench_quantize.py [--size 4096] [--repeats 5]

For each recipe, a 4096×4096 float32 tensor is quantized and dequantized by
- qlab's compiled fast path (``qdq``; compilation happens in the warm-up and is reported apart),
- qlab's eager path (``qdq(fast=False)``, the same bits),
- torchao 0.18 eager: ``to_mx`` + ``to_dtype`` (MX), ``NVFP4Tensor.to_nvfp4`` + ``dequantize``,
  ``hp_tensor_to_float8_dynamic`` + ``to_original_precision`` (FP8 tensorwise),
- ``torch.add(x, 0, out=y)`` into a preallocated y: one read and one write of the tensor, the
  memory-bound floor (steadier than ``x.clone()``, whose first-touch page faults swing it 3–40 ms here).
Every block format has a row (torchao's column where torchao has the recipe). Prints a markdown table
of medians of --repeats runs after one warm-up, and ratios. torchao is a test/benchmark-only
dependency (``pip install -e .[dev]``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_thread_argument, machine, median_seconds, set_threads  # noqa: E402

from qlab import quantize as Q  # noqa: E402


def torchao_recipes():
    """name -> qdq function built from torchao's reference quantizers."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def fp8(x):
        q = hp_tensor_to_float8_dynamic(
            x, torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=ScalingGranularity.TENSORWISE
        )
        return q.to_original_precision()

    def mx(elem, mode):
        def run(x):
            scale, data = to_mx(x, elem, 32, mode)
            return to_dtype(data, scale, elem, 32, torch.float32)

        return run

    def nvfp4(x):
        scale = per_tensor_amax_to_scale(x.abs().amax())
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)

    return {
        "fp8_e4m3": fp8,
        "mxfp8": mx(torch.float8_e4m3fn, ScaleCalculationMode.FLOOR),
        "mxfp8_rceil": mx(torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
        "mxfp4": mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
        "nvfp4": nvfp4,
    }


LABELS = {
    "fp8_e4m3": "FP8 E4M3 tensorwise",
    "mxfp8": "MXFP8 FLOOR",
    "mxfp8_rceil": "MXFP8 RCEIL",
    "mxfp8_e5m2": "MXFP8 E5M2 FLOOR",
    "mxfp6_e3m2": "MXFP6 E3M2 FLOOR",
    "mxfp6_e2m3": "MXFP6 E2M3 FLOOR",
    "mxfp4": "MXFP4 FLOOR",
    "nvfp4": "NVFP4 1×16 (two-level)",
    "nvfp4_2d": "NVFP4 16×16 tiles",
    "nvfp4_rht": "NVFP4 1×16 + Hadamard",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    add_thread_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size) * torch.logspace(-3, 3, args.size)  # columns of mixed magnitude
    y = torch.empty_like(x)
    reference = torchao_recipes()

    floor = median_seconds(lambda: torch.add(x, 0, out=y), args.repeats)
    print(
        f"machine: {machine()}; qdq of a {args.size}×{args.size} float32 tensor; "
        f"torch.add(x, 0, out=y) {floor * 1e3:.1f} ms\n"
    )
    print(
        "| recipe | qlab compiled (ms) | qlab compiled / add | qlab eager (ms) | torchao eager (ms) "
        "| torchao / qlab compiled | first call (compile, s) | same bits as torchao |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, label in LABELS.items():
        start = time.perf_counter()
        fast = Q.qdq(x, name, fast=True)
        first_call = time.perf_counter() - start
        compiled = median_seconds(lambda: Q.qdq(x, name, fast=True), args.repeats)
        eager = median_seconds(lambda: Q.qdq(x, name, fast=False), args.repeats)
        theirs, same = "—", "—"
        if name in reference:
            seconds = median_seconds(lambda: reference[name](x), args.repeats)
            theirs = f"{seconds * 1e3:.1f} | {seconds / compiled:.1f}"
            same = torch.equal(torch.nan_to_num(fast), torch.nan_to_num(reference[name](x)))
            same = "yes" if same else "no"
        else:
            theirs = "— | —"
        print(
            f"| {label} | {compiled * 1e3:.1f} | {compiled / floor:.2f} | {eager * 1e3:.1f} | {theirs} | "
            f"{first_call:.1f} | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
