"""qdq speed on CPU: qlab against torchao's reference quantizers and x.clone(), in the same run.

    python benchmarks/bench_quantize.py [--size 4096] [--repeats 5]

For each recipe, a 4096×4096 float32 tensor is quantized and dequantized by
- qlab's compiled fast path (``qdq``; compilation happens in the warm-up and is reported apart),
- qlab's eager path (``qdq(fast=False)``, the same bits),
- torchao 0.18 eager: ``to_mx`` + ``to_dtype`` (MX), ``NVFP4Tensor.to_nvfp4`` + ``dequantize``,
  ``hp_tensor_to_float8_dynamic`` + ``to_original_precision`` (FP8 tensorwise),
- ``x.clone()``: one read and one write of the tensor, the memory-bound floor.
Prints a markdown table of medians of --repeats runs after one warm-up, and ratios. torchao is a
test/benchmark-only dependency (``pip install -e .[dev]``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import median_seconds  # noqa: E402

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
    "mxfp4": "MXFP4 FLOOR",
    "nvfp4": "NVFP4 1×16 (two-level)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size) * torch.logspace(-3, 3, args.size)  # columns of mixed magnitude
    reference = torchao_recipes()

    clone = median_seconds(lambda: x.clone(), args.repeats)
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; qdq of a {args.size}×{args.size} float32 tensor; "
        f"x.clone() {clone * 1e3:.1f} ms\n"
    )
    print(
        "| recipe | qlab compiled (ms) | qlab eager (ms) | torchao eager (ms) | torchao / qlab compiled "
        "| qlab compiled / clone | first call (compile, s) | same bits as torchao |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, torchao_qdq in reference.items():
        start = time.perf_counter()
        fast = Q.qdq(x, name, fast=True)
        first_call = time.perf_counter() - start
        compiled = median_seconds(lambda: Q.qdq(x, name, fast=True), args.repeats)
        eager = median_seconds(lambda: Q.qdq(x, name, fast=False), args.repeats)
        theirs = median_seconds(lambda: torchao_qdq(x), args.repeats)
        same = torch.equal(torch.nan_to_num(fast), torch.nan_to_num(torchao_qdq(x)))
        print(
            f"| {LABELS[name]} | {compiled * 1e3:.1f} | {eager * 1e3:.1f} | {theirs * 1e3:.1f} | "
            f"{theirs / compiled:.1f} | {compiled / clone:.2f} | {first_call:.1f} | "
            f"{'yes' if same else 'no'} |"
        )


if __name__ == "__main__":
    main()
