"""How far the FP8 tensor-core GEMM (``qlab.kernels.fp8_gemm.fp8_matmul``) lands from the exact product.

    python benchmarks/measure_fp8_gemm_error.py [--device cuda]

For each reduction length K, two (256, K)·(256, K)ᵀ products of e4m3 operands quantized per tensor:
"signed" (Gaussian operands, errors partly cancel) and "positive" (|Gaussian|, every product adds, the
worst case for a running sum). The reference is the product of the decoded operands in float64, whose
own error (at most K·2⁻⁵³·Σ|aᵢbᵢ| ≤ 2⁻³⁹·Σ|aᵢbᵢ| for K ≤ 2¹⁴) is far below any float32 accumulator's.
Each row gives the largest error relative to Σ|aᵢbᵢ| and the effective unit roundoff u_eff = that
error / K, the u that makes the classical bound |fl(Σ aᵢbᵢ) − Σ aᵢbᵢ| ≤ K·u·Σ|aᵢbᵢ| tight
(tests/test_fp8_gemm.py bounds by (K + 3)·u·Σ|aᵢbᵢ|; float32 has u = 2⁻²⁴).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import machine  # noqa: E402

from qlab import quantize as Q  # noqa: E402
from qlab.kernels.fp8_gemm import fp8_matmul, unsupported_reason  # noqa: E402


def exact_operand(q: Q.QTensor) -> torch.Tensor:
    """The quantized operand's values in float64 on the CPU: torch's float8 decoding over the scale."""
    return q.codes.cpu().view(torch.float8_e4m3fn).double() / q.scales.cpu().double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = Q.TensorwiseSpec("e4m3")
    print(f"machine: {machine(device)}\n")
    print("| K | operands | max error / Σ|ab| | u_eff = that / K | log2 u_eff |")
    print("|---:|---|---:|---:|---:|")
    for k in (64, 256, 1024, 4096, 16384):
        if unsupported_reason(spec, spec, k, 256, device):
            print(f"| {k} | — | {unsupported_reason(spec, spec, k, 256, device)} | | |")
            continue
        for kind in ("signed", "positive"):
            generator = torch.Generator().manual_seed(k)
            a, b = torch.randn(256, k, generator=generator), torch.randn(256, k, generator=generator)
            if kind == "positive":
                a, b = a.abs(), b.abs()
            qa, qb = Q.quantize(a.to(device), spec, 1), Q.quantize(b.to(device), spec, 1)
            out = fp8_matmul(qa, qb).cpu().double()
            exact_a, exact_b = exact_operand(qa), exact_operand(qb)
            relative = ((out - exact_a @ exact_b.T).abs() / (exact_a.abs() @ exact_b.abs().T)).max().item()
            u_eff = relative / k
            log2 = f"{math.log2(u_eff):.1f}" if u_eff > 0 else "exact"
            print(f"| {k} | {kind} | {relative:.3g} | {u_eff:.3g} | {log2} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
