"""GPU benchmark of qlab's Triton kernels: achieved bandwidth against the device's peak, and speed
against the eager reference, torchao's MX cast where installed, and torch's LayerNorm; then
QuantLinear's FP8 GEMMs on tensor cores (gemm="scaled_mm") against emulation and bf16 nn.Linear.

    python benchmarks/bench_kernels_gpu.py [--size 8192] [--hidden 4096] [--peak-gbps GB/s] [--results DIR]

Needs CUDA (exits with a message otherwise). Bytes counted per qdq: read x and write the result,
both in bf16, plus the scales (quantize: read x in bf16, write one byte of codes per element plus the
scales); LayerNorm forward+backward: read x, dy, write y, dx (plus w, b,
dw, db). Times are medians from triton.testing.do_bench. Targets (H100-class): qdq at
8192×8192 bf16 ≥ 70 % of peak bandwidth; LayerNorm forward+backward at hidden 4096 at least as
fast as torch.nn.functional.layer_norm. Every row of the three tables is appended to
``benchmarks/results/bench_kernels_gpu.csv`` with the machine, device, date, torch, commit and Triton
version (the docs' table is generated from that file).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, record  # noqa: E402

PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0}


def peak_bandwidth(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--peak-gbps", type=float, default=None)
    add_results_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device; nothing measured")
        return 0
    import triton
    import triton.testing

    from qlab import kernels
    from qlab import quantize as Q
    from qlab.kernels import fp8_qdq, layer_norm, mx_qdq, nvfp4_qdq

    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name, args.peak_gbps)
    x = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    element_bytes = 2 * x.numel() * x.element_size()
    print(f"device: {name}; peak {peak or '?'} GB/s; torch {torch.__version__}; x {tuple(x.shape)} bf16\n")
    rows = []
    common = {"triton": triton.__version__}
    shape = f"{args.size}×{args.size} bf16"
    print("| kernel | Triton (ms) | GB/s | % of peak | eager reference (ms) | speed-up | torchao (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    code_bytes = x.numel() * (x.element_size() + 1)
    cases = {
        "fp8 quantize → codes, per-tensor (e4m3)": (
            lambda: kernels.quantize(x, "fp8_e4m3", backend="triton"),
            lambda: Q.quantize(x, "fp8_e4m3", keep_source=False),
            code_bytes,
        ),
        "mxfp8 quantize → codes (e4m3, rceil)": (
            lambda: kernels.quantize(x, Q.SPECS["mxfp8_rceil"], backend="triton"),
            lambda: Q.quantize(x, Q.SPECS["mxfp8_rceil"], keep_source=False),
            code_bytes + x.numel() // 32,
        ),
        "fp8 qdq per-tensor (e4m3)": (
            lambda: fp8_qdq(x, "fp8_e4m3", backend="triton"),
            lambda: Q.qdq(x, "fp8_e4m3", fast=False),
            element_bytes,
        ),
        "fp8 qdq per-row (e4m3)": (
            lambda: fp8_qdq(x, "fp8_e4m3_rowwise", backend="triton"),
            lambda: Q.qdq(x, "fp8_e4m3_rowwise", fast=False),
            element_bytes + 4 * x.shape[0],
        ),
        "mxfp8 qdq (e4m3, floor)": (
            lambda: mx_qdq(x, "mxfp8", backend="triton"),
            lambda: Q.qdq(x, "mxfp8", fast=False),
            element_bytes + x.numel() // 32,
        ),
        "mxfp4 qdq (e2m1, floor)": (
            lambda: mx_qdq(x, Q.MXSpec("e2m1"), backend="triton"),
            lambda: Q.qdq(x, Q.MXSpec("e2m1"), fast=False),
            element_bytes + x.numel() // 32,
        ),
        "nvfp4 qdq 1×16": (
            lambda: nvfp4_qdq(x, Q.NVFP4Spec(), backend="triton"),
            lambda: Q.qdq(x, Q.NVFP4Spec(), fast=False),
            element_bytes + 4 * x.numel() // 16,
        ),
    }
    torchao_mx = _torchao_mx(x)
    for label, (kernel, eager, nbytes) in cases.items():
        ms = triton.testing.do_bench(kernel)
        eager_ms = triton.testing.do_bench(eager)
        gbps = nbytes / ms / 1e6
        ao = triton.testing.do_bench(torchao_mx) if (torchao_mx and label.startswith("mxfp8")) else None
        print(
            f"| {label} | {ms:.3f} | {gbps:,.0f} | {f'{100 * gbps / peak:.0f} %' if peak else '?'} | "
            f"{eager_ms:.3f} | {eager_ms / ms:.1f}× | {f'{ao:.3f}' if ao else '–'} |",
            flush=True,
        )
        rows.append(
            {
                **common,
                "part": "qdq",
                "shape": shape,
                "kernel": label,
                "ms": round(ms, 3),
                "gbps": round(gbps),
                "percent_of_peak": round(100 * gbps / peak) if peak else "",
                "peak_gbps": peak or "",
                "baseline": "eager reference",
                "baseline_ms": round(eager_ms, 3),
                "speedup": round(eager_ms / ms, 1),
                "torchao_ms": round(ao, 3) if ao else "",
            }
        )

    tokens, hidden = args.tokens, args.hidden
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(h)

    def fwd_bwd(fn):
        def run():
            h.grad = w.grad = b.grad = None
            fn().backward(dy)

        return run

    torch_ms = triton.testing.do_bench(fwd_bwd(lambda: torch.nn.functional.layer_norm(h, (hidden,), w, b)))
    print(f"\nLayerNorm forward+backward, {tokens}×{hidden} bf16 (F.layer_norm {torch_ms:.3f} ms):\n")
    print("| stats | Triton (ms) | GB/s | vs torch |")
    print("|---|---:|---:|---:|")
    nbytes = 4 * h.numel() * h.element_size()
    for stats in ("welford", "two_pass", "textbook"):
        ms = triton.testing.do_bench(
            fwd_bwd(lambda: layer_norm(h, (hidden,), w, b, stats=stats, backend="triton"))
        )
        print(f"| {stats} | {ms:.3f} | {nbytes / ms / 1e6:,.0f} | {torch_ms / ms:.2f}× |", flush=True)
        rows.append(
            {
                **common,
                "part": "layernorm fwd+bwd",
                "shape": f"{tokens}×{hidden} bf16",
                "kernel": stats,
                "ms": round(ms, 3),
                "gbps": round(nbytes / ms / 1e6),
                "baseline": "F.layer_norm",
                "baseline_ms": round(torch_ms, 3),
                "speedup": round(torch_ms / ms, 2),
            }
        )
    rows += [{**common, **row} for row in _bench_fp8_gemms(tokens, hidden)]
    record("bench_kernels_gpu", rows, args.results, device=torch.device("cuda"))
    return 0


def _bench_fp8_gemms(tokens: int, features: int) -> list[dict]:
    """QuantLinear forward+backward, features → features with bias, bf16 input: tensor cores vs emulation.
    Returns the rows it printed, nn.Linear's first."""
    import triton.testing

    from qlab.nn import QuantLinear

    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.Linear(features, features, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(layer):
        def run():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(dy)

        return run

    flops = 3 * 2 * tokens * features * features
    base_ms = triton.testing.do_bench(fwd_bwd(linear))
    print(
        f"\nLinear forward+backward, {tokens}×{features} → {features} bf16 (nn.Linear {base_ms:.3f} ms, "
        f"{flops / base_ms / 1e9:,.0f} TFLOP/s):\n"
    )
    shape = f"{tokens}×{features} → {features} bf16"
    part = "linear fwd+bwd"
    rows = [{"part": part, "shape": shape, "kernel": "nn.Linear (bf16)", "ms": round(base_ms, 3)}]
    rows[0]["tflops"] = round(flops / base_ms / 1e9)
    print("| recipe | gemm | ms | TFLOP/s | vs emulated | vs bf16 nn.Linear |")
    print("|---|---|---:|---:|---:|---:|")
    for recipe in ("fp8_tensorwise", "fp8_delayed"):
        emulated_ms = None
        for gemm in ("emulated", "scaled_mm"):
            layer = QuantLinear.from_linear(linear, recipe, gemm=gemm)
            ms = triton.testing.do_bench(fwd_bwd(layer))
            emulated_ms = emulated_ms or ms
            print(
                f"| {recipe} | {gemm} | {ms:.3f} | {flops / ms / 1e9:,.0f} | {emulated_ms / ms:.2f}× | "
                f"{base_ms / ms:.2f}× |",
                flush=True,
            )
            rows.append(
                {
                    "part": part,
                    "shape": shape,
                    "kernel": f"{recipe}, gemm={gemm}",
                    "ms": round(ms, 3),
                    "baseline": "nn.Linear (bf16)",
                    "baseline_ms": round(base_ms, 3),
                    "speedup": round(base_ms / ms, 2),
                    "tflops": round(flops / ms / 1e9),
                    "vs_emulated": round(emulated_ms / ms, 2),
                }
            )
    return rows


def _torchao_mx(x):
    """torchao's MX cast of x (e4m3, block 32) as a callable, or None when torchao lacks it."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None
    return lambda: to_mx(x, torch.float8_e4m3fn, 32)


if __name__ == "__main__":
    sys.exit(main())
