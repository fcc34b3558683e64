"""How far the FP8 tensor-core GEMM (``qlab.kernels.fp8_gemm.fp8_matmul``) lands from the exact product.

    python benchmarks/measure_fp8_gemm_error.py [--device cuda] [--results DIR]

Each row is a (256, K)·(256, K)ᵀ product of FP8 operands. "signed" operands are Gaussian (errors
partly cancel); "positive" ones are |Gaussian| (every product adds, the worst case for a running
sum). The first table covers e4m3 × e4m3 scaled per tensor for K from 64 to 16384. The second covers
the other combinations tests/test_fp8_gemm.py runs (e5m2 operands, per-row scales, K down to 32), with
positive operands. The reference is the product of the decoded operands in float64, whose own error
(at most K·2⁻⁵³·Σ|aᵢbᵢ| ≤ 2⁻³⁹·Σ|aᵢbᵢ| for K ≤ 2¹⁴) is far below any float32 accumulator's. Each row
gives the largest error relative to Σ|aᵢbᵢ|. tests/test_fp8_gemm.py allows
((K + 3)·2⁻²⁴ + TENSOR_CORE_ERROR)·Σ|aᵢbᵢ|, with TENSOR_CORE_ERROR = 2⁻⁸ on CUDA and 0 on the CPU.
Every row is appended to ``benchmarks/results/measure_fp8_gemm_error.csv`` with the machine, device,
date, torch and commit.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, machine, record  # noqa: E402

from qlab import quantize as Q  # noqa: E402
from qlab.kernels.fp8_gemm import fp8_matmul, unsupported_reason  # noqa: E402

TORCH_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def exact_operand(q: Q.QTensor) -> torch.Tensor:
    """The quantized (rows, K) operand's values in float64 on the CPU: torch's float8 decoding of the
    codes over the scales (per row or per tensor, quantized along K)."""
    return q.codes.cpu().view(TORCH_FLOAT8[q.spec.element]).double() / q.scales.cpu().double()


def relative_error(k: int, kind: str, elements: tuple, granularity: str, device: torch.device) -> str:
    """max |fp8_matmul − exact| / Σ|ab| over the outputs, as text (or why the GEMM cannot run)."""
    spec_a = Q.TensorwiseSpec(elements[0], granularity=granularity)
    spec_b = Q.TensorwiseSpec(elements[1], granularity=granularity)
    reason = unsupported_reason(spec_a, spec_b, k, 256, device)
    if reason:
        return reason
    generator = torch.Generator().manual_seed(k)
    a, b = torch.randn(256, k, generator=generator), torch.randn(256, k, generator=generator)
    if kind == "positive":
        a, b = a.abs(), b.abs()
    qa, qb = Q.quantize(a.to(device), spec_a, 1), Q.quantize(b.to(device), spec_b, 1)
    out = fp8_matmul(qa, qb).cpu().double()
    exact_a, exact_b = exact_operand(qa), exact_operand(qb)
    error = ((out - exact_a @ exact_b.T).abs() / (exact_a.abs() @ exact_b.abs().T)).max().item()
    return f"{error:.3g} (2^{math.log2(error):.1f})" if error > 0 else "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default)
    add_results_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"machine: {machine(device)}\n")
    rows = []

    def row(k, elements, granularity, kind, text):
        error, _, _ = text.partition(" (2^")
        number = error.replace(".", "", 1).replace("e-", "", 1).isdigit()
        rows.append(
            {
                "outputs": "256×256",
                "k": k,
                "a": elements[0],
                "b": elements[1],
                "scaling": "row" if granularity == "axis" else granularity,
                "operands": "signed (Gaussian)" if kind == "signed" else kind,
                "relative_error": error if number else "",
                "note": "" if number else text,
            }
        )

    print("| K | e4m3 × e4m3 per tensor, signed | the same, positive |")
    print("|---:|---:|---:|")
    for k in (64, 256, 1024, 4096, 16384):
        signed = relative_error(k, "signed", ("e4m3", "e4m3"), "tensor", device)
        positive = relative_error(k, "positive", ("e4m3", "e4m3"), "tensor", device)
        row(k, ("e4m3", "e4m3"), "tensor", "signed", signed)
        row(k, ("e4m3", "e4m3"), "tensor", "positive", positive)
        print(f"| {k} | {signed} | {positive} |", flush=True)
    combinations = [
        (("e5m2", "e4m3"), "tensor"),
        (("e4m3", "e5m2"), "tensor"),
        (("e4m3", "e4m3"), "axis"),
        (("e5m2", "e4m3"), "axis"),
    ]
    print("\n| K | " + " | ".join(f"{a} × {b} per {g}, positive" for (a, b), g in combinations) + " |")
    print("|---:|" + "---:|" * len(combinations))
    for k in (32, 48, 256, 4096):
        cells = [
            relative_error(k, "positive", elements, granularity, device)
            for elements, granularity in combinations
        ]
        print(f"| {k} | " + " | ".join(cells) + " |", flush=True)
        for (elements, granularity), cell in zip(combinations, cells):
            row(k, elements, granularity, "positive", cell)
    record("measure_fp8_gemm_error", rows, args.results, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
