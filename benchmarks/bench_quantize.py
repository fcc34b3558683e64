"""qdq speed on CPU: qlab against torchao's reference quantizers and torch.add, in the same run.

    python benchmarks/bench_quantize.py [--size 4096] [--repeats 5] [--threads auto] [--results DIR]

For each recipe, a 4096×4096 float32 tensor is quantized and dequantized by
- qlab's fast path writing into a preallocated tensor (``qdq(x, out=y)``), against
  ``torch.add(x, 0, out=y)``: one read and one write of the tensor, the memory-bound floor (a format
  scaled by the whole tensor's amax, NVFP4 or FP8 per tensor, must read x twice: the header gives
  ``torch.aminmax(x)`` then that add, its floor, as a ratio too). The fast
  path is the C kernel ``qlab.kernels.cpu_qdq`` where it covers the recipe (MX, NVFP4 1×16), else
  qdq's torch.compile path; for the C kernel's rows the compiled path is timed too (kernel off);
- the same path returning a fresh tensor (``qdq(x)``), against ``torch.add(x, 0)``, which pays the
  same first-touch page faults for its fresh 64 MiB (glibc hands such blocks back to the kernel
  when they are freed, so every call faults them in again: 20–30 ms here, several times the kernel);
- qlab's eager reference (``qlab.quantize.qdq``, the same bits);
- torchao 0.18 eager: ``to_mx`` + ``to_dtype`` (MX), ``NVFP4Tensor.to_nvfp4`` + ``dequantize``,
  ``hp_tensor_to_float8_dynamic`` + ``to_original_precision`` (FP8 tensorwise).
Compilation happens in the warm-up and is reported apart. Every block format has a row
(torchao's column where torchao has the recipe; bits compared in torchao's scale convention).
Prints a markdown table of medians of --repeats runs after one warm-up, and ratios: each ratio to an
add is the median of --repeats rounds that time the row and its add back to back (timing.paired_ratio).
Appends every row, the two-read floor's included, to ``benchmarks/results/bench_quantize.csv`` with the
machine, device, date, torch and commit (the docs' table is generated from that file).
torchao is a test/benchmark-only dependency (``pip install -e .[dev]``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import (  # noqa: E402
    add_results_argument,
    add_thread_argument,
    machine,
    median_seconds,
    paired_ratio,
    record,
    set_threads,
)

from qlab import kernels  # noqa: E402
from qlab import quantize as Q  # noqa: E402
from qlab.kernels import cpu_qdq  # noqa: E402


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


# torchao's convention of the presets whose default follows NVIDIA's (docs/reference.md §2: multiply by
# fl(1/s) where torchao divides): the bits compared with torchao's
TORCHAO_CONVENTION = {
    "fp8_e4m3": Q.TensorwiseSpec(convention="torchao"),
    "nvfp4": "nvfp4_torchao",
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


@contextlib.contextmanager
def without_cpu_kernel():
    """qdq's torch.compile path where the C kernel would run."""
    available = cpu_qdq.available
    cpu_qdq.available = lambda: False
    try:
        yield
    finally:
        cpu_qdq.available = available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    add_thread_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    threads = set_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size) * torch.logspace(-3, 3, args.size)  # columns of mixed magnitude
    y = torch.empty_like(x)
    reference = torchao_recipes()

    def add_into():
        torch.add(x, 0, out=y)

    def add_fresh():
        torch.add(x, 0)

    floor = median_seconds(add_into, args.repeats)
    fresh_floor = median_seconds(add_fresh, args.repeats)
    # NVFP4's (and FP8 per tensor's) scale needs the whole tensor's amax before any element is written:
    # a second read of x, which no single-pass floor includes
    two_reads, two_reads_ratio = paired_ratio(lambda: (torch.aminmax(x), add_into()), add_into, args.repeats)
    print(
        f"machine: {machine()}; qdq of a {args.size}×{args.size} float32 tensor; "
        f"torch.add(x, 0, out=y) {floor * 1e3:.1f} ms, torch.add(x, 0) {fresh_floor * 1e3:.1f} ms; "
        f"aminmax(x) then add(out=y), the floor of a format scaled by the tensor's amax, "
        f"{two_reads * 1e3:.1f} ms = {two_reads_ratio:.2f} × add(out=y); every ratio is the median of "
        f"{args.repeats} rounds' ratios, each round timing the row and its add back to back\n"
    )
    common = {"threads": threads, "size": args.size, "run": f"{args.repeats} repeats"}
    rows = [
        {
            **common,
            "recipe": "two-read floor: aminmax(x) then add(out=y)",
            "out_ms": round(two_reads * 1e3, 2),
            "add_out_ms": round(floor * 1e3, 2),
            "out_ratio": round(two_reads_ratio, 2),
        }
    ]
    print(
        "| recipe | fast path | out=y (ms) | / add(out=y) | compiled path, out=y / add | fresh (ms) "
        "| / add fresh | qlab eager (ms) | torchao eager (ms) | torchao / qlab fresh | first call (s) "
        "| same bits as torchao |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, label in LABELS.items():

        def fused(spec=name, **out):  # the fused CPU path (C kernel or compiled), as fast=True was
            return kernels.qdq(x, spec, backend="cpu", **out)

        start = time.perf_counter()
        fast = fused()
        first_call = time.perf_counter() - start
        fused(out=y)  # compiles the out= variant
        into, into_ratio = paired_ratio(lambda: fused(out=y), add_into, args.repeats)
        compiled, compiled_ratio = paired_ratio(fused, add_fresh, args.repeats)
        eager = median_seconds(lambda: Q.qdq(x, name), args.repeats)
        path, inductor = "compiled", "—"
        if cpu_qdq.covers(x, Q.get_spec(name), x.dtype):
            with without_cpu_kernel():
                fused(out=y)  # compiles it
                _, ratio = paired_ratio(lambda: fused(out=y), add_into, args.repeats)
            path, inductor = "C kernel", f"{ratio:.2f}"
        theirs, same, seconds = "—", "—", None
        if name in reference:
            seconds = median_seconds(lambda: reference[name](x), args.repeats)
            theirs = f"{seconds * 1e3:.1f} | {seconds / compiled:.1f}"
            ours = fused(TORCHAO_CONVENTION[name]) if name in TORCHAO_CONVENTION else fast
            same = torch.equal(torch.nan_to_num(ours), torch.nan_to_num(reference[name](x)))
            same = "yes" if same else "no"
        else:
            theirs = "— | —"
        print(
            f"| {label} | {path} | {into * 1e3:.1f} | {into_ratio:.2f} | {inductor} | "
            f"{compiled * 1e3:.1f} | {compiled_ratio:.2f} | {eager * 1e3:.1f} | {theirs} | "
            f"{first_call:.1f} | {same} |",
            flush=True,
        )
        rows.append(
            {
                **common,
                "recipe": label,
                "fast_path": path,
                "out_ms": round(into * 1e3, 2),
                "add_out_ms": round(floor * 1e3, 2),
                "out_ratio": round(into_ratio, 2),
                "compiled_out_ratio": "" if inductor == "—" else inductor,
                "fresh_ms": round(compiled * 1e3, 2),
                "add_fresh_ms": round(fresh_floor * 1e3, 2),
                "fresh_ratio": round(compiled_ratio, 2),
                "eager_ms": round(eager * 1e3, 2),
                "torchao_ms": "" if seconds is None else round(seconds * 1e3, 2),
                "torchao_over_qlab": "" if seconds is None else round(seconds / compiled, 2),
                "first_call_s": round(first_call, 2),
                "same_bits_as_torchao": "" if same == "—" else same,
            }
        )
    record("bench_quantize", rows, args.results)


if __name__ == "__main__":
    main()
