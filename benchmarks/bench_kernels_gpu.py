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
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, forward_backward, record  # noqa: E402

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

    from qlab.kernels import layer_norm

    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name, args.peak_gbps)
    x = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    print(f"device: {name}; peak {peak or '?'} GB/s; torch {torch.__version__}; x {tuple(x.shape)} bf16\n")
    rows = []
    common = {"triton": triton.__version__}
    shape = f"{args.size}×{args.size} bf16"
    # Kernel times from CUDA graphs (triton.testing.do_bench_cudagraph: no host overhead, no launch gaps),
    # the copy floor timed the same way; "call" is the public function as a user calls it (do_bench).
    clone_ms = triton.testing.do_bench_cudagraph(lambda: x.clone())
    clone_gbps = 2 * x.numel() * x.element_size() / clone_ms / 1e6  # one read, one write
    print(f"x.clone(): {clone_ms:.3f} ms, {clone_gbps:,.0f} GB/s (the copy floor)\n")
    print("| kernel | kernel (ms) | GB/s | % of peak | % of clone | call (ms) | eager (ms) | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, (call, kernel, eager, nbytes) in _qdq_cases(x).items():
        ms = triton.testing.do_bench_cudagraph(kernel)
        call_ms = triton.testing.do_bench(call)
        eager_ms = triton.testing.do_bench(eager)
        gbps = nbytes / ms / 1e6
        of_clone = 100 * gbps / clone_gbps
        print(
            f"| {label} | {ms:.3f} | {gbps:,.0f} | {f'{100 * gbps / peak:.0f} %' if peak else '?'} | "
            f"{of_clone:.0f} % | {call_ms:.3f} | {eager_ms:.3f} | {eager_ms / call_ms:.1f}× |",
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
                "speedup": round(eager_ms / call_ms, 1),
                "clone_ms": round(clone_ms, 3),
                "percent_of_clone": round(of_clone),
                "call_ms": round(call_ms, 3),
                "note": "ms: kernels alone in a CUDA graph; call_ms: the public call, host included",
            }
        )
    rows += [{**common, "shape": shape, **row} for row in _bench_torchao(x)]

    tokens, hidden = args.tokens, args.hidden
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(h)

    def fwd_bwd(fn):
        return forward_backward(fn, dy, h, w, b)

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
    rows += [{**common, **row} for row in _layer_norm_tiles(h.detach(), w.detach(), b.detach(), dy)]
    rows += [{**common, **row} for row in _bench_fp8_gemms(tokens, hidden)]
    record("bench_kernels_gpu", rows, args.results, device=torch.device("cuda"))
    return 0


def _layer_norm_tiles(h, w, b, dy) -> list[dict]:
    """The LayerNorm kernels alone (CUDA graphs), forward and backward apart, against ATen's
    native_layer_norm and its backward timed the same way; the backward over rows per tile and warps."""
    import triton.testing

    from qlab.kernels import layernorm_triton as K

    hidden = h.shape[-1]
    shape = f"{h.shape[0]}×{hidden} bf16"
    part = "layernorm kernels"
    aten_forward = torch.ops.aten.native_layer_norm
    _, mean, rstd = aten_forward(h, (hidden,), w, b, 1e-5)
    mask = [True, True, True]
    aten = {
        "forward": triton.testing.do_bench_cudagraph(lambda: aten_forward(h, (hidden,), w, b, 1e-5)),
        "backward": triton.testing.do_bench_cudagraph(
            lambda: torch.ops.aten.native_layer_norm_backward(dy, h, (hidden,), mean, rstd, w, b, mask)
        ),
    }
    forward_ms, backward_ms = aten["forward"], aten["backward"]
    print(f"\nLayerNorm kernels alone (ATen: forward {forward_ms:.3f} ms, backward {backward_ms:.3f} ms):\n")
    print("| pass | stats | rows per tile | warps | ms | vs ATen |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []

    def add(which, stats, tile, warps, ms):
        print(f"| {which} | {stats} | {tile} | {warps} | {ms:.3f} | {aten[which] / ms:.2f}× |", flush=True)
        rows.append(
            {
                "part": part,
                "shape": shape,
                "kernel": f"{which}, {stats}, rows per tile {tile}, {warps} warps",
                "ms": round(ms, 3),
                "baseline": f"aten native_layer_norm{'_backward' if which == 'backward' else ''}",
                "baseline_ms": round(aten[which], 3),
                "speedup": round(aten[which] / ms, 2),
            }
        )

    for stats in ("welford", "two_pass"):
        for warps in (4, 8, 16):
            ms = triton.testing.do_bench_cudagraph(lambda: K.forward(h, w, b, 1e-5, stats, num_warps=warps))
            add("forward", stats, 1, warps, ms)
    _, mean32, rstd32 = K.forward(h, w, b, 1e-5, "welford")
    for tile in (1, 2, 4, 8, 16, 32):
        for warps in (4, 8, 16):
            ms = triton.testing.do_bench_cudagraph(
                lambda: K.backward(h, w, dy, mean32, rstd32, rows_per_tile=tile, num_warps=warps)
            )
            add("backward", "any", tile, warps, ms)
    return rows


def _bench_fp8_gemms(tokens: int, features: int) -> list[dict]:
    """QuantLinear forward+backward, features → features with bias, bf16 input: tensor cores vs emulation.
    Returns the rows it printed, nn.Linear's first."""
    import triton.testing

    from qlab.nn import QuantLinear

    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.Linear(features, features, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(layer):
        return forward_backward(functools.partial(layer, x), dy, x, *layer.parameters())

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


def _qdq_cases(x: torch.Tensor) -> dict:
    """label → (qlab's public call, its kernels alone, the eager reference, the bytes the kernels must
    move). A qdq must read x and write its result once; a format scaled by the tensor's amax reads x once
    more for it; a quantize writes one byte of codes per element; scales count at their stored size."""
    from qlab import kernels
    from qlab import quantize as Q
    from qlab.formats import get_format
    from qlab.kernels import fp8_qdq, mx_qdq, nvfp4_qdq
    from qlab.kernels.fp8_triton import fp8_current_scaling
    from qlab.kernels.mx_triton import mx_qdq_last_axis, mx_quantize_last_axis
    from qlab.kernels.nvfp4_triton import nvfp4_qdq_last_axis

    n, width = x.numel(), x.element_size()
    qdq_bytes, amax_read, code_bytes = 2 * n * width, n * width, n * (width + 1)
    e4m3, e2m1 = get_format("e4m3"), get_format("e2m1")
    eps = Q.SPECS["fp8_e4m3"].eps

    def fp8(per_row, codes):
        return lambda: fp8_current_scaling(x, e4m3, per_row=per_row, eps=eps, pow2=False, emit_codes=codes)

    def nvfp4(convention):
        return lambda: nvfp4_qdq_last_axis(
            x, block_2d=False, stochastic=False, seed=0, offset=0, convention=convention
        )

    return {
        "fp8 quantize → codes, per-tensor (e4m3)": (
            lambda: kernels.quantize(x, "fp8_e4m3", backend="triton"),
            fp8(False, True),
            lambda: Q.quantize(x, "fp8_e4m3", keep_source=False),
            code_bytes + amax_read,
        ),
        "mxfp8 quantize → codes (e4m3, rceil)": (
            lambda: kernels.quantize(x, Q.SPECS["mxfp8_rceil"], backend="triton"),
            lambda: mx_quantize_last_axis(x, e4m3, "rceil"),
            lambda: Q.quantize(x, Q.SPECS["mxfp8_rceil"], keep_source=False),
            code_bytes + 5 * n // 32,  # E8M0 bytes and their float32 values, one each per block
        ),
        "mxfp8 quantize → codes (e4m3, floor)": (
            lambda: kernels.quantize(x, "mxfp8", backend="triton"),
            lambda: mx_quantize_last_axis(x, e4m3, "floor"),
            lambda: Q.quantize(x, "mxfp8", keep_source=False),
            code_bytes + 5 * n // 32,  # E8M0 bytes and their float32 values, one each per block
        ),
        "fp8 qdq per-tensor (e4m3)": (
            lambda: fp8_qdq(x, "fp8_e4m3", backend="triton"),
            fp8(False, False),
            lambda: Q.qdq(x, "fp8_e4m3"),
            qdq_bytes + amax_read,
        ),
        "fp8 qdq per-row (e4m3)": (
            lambda: fp8_qdq(x, "fp8_e4m3_rowwise", backend="triton"),
            fp8(True, False),
            lambda: Q.qdq(x, "fp8_e4m3_rowwise"),
            qdq_bytes + 4 * x.shape[0],
        ),
        "mxfp8 qdq (e4m3, floor)": (
            lambda: mx_qdq(x, "mxfp8", backend="triton"),
            lambda: mx_qdq_last_axis(x, e4m3, "floor"),
            lambda: Q.qdq(x, "mxfp8"),
            qdq_bytes + n // 32,
        ),
        "mxfp4 qdq (e2m1, floor)": (
            lambda: mx_qdq(x, Q.MXSpec("e2m1"), backend="triton"),
            lambda: mx_qdq_last_axis(x, e2m1, "floor"),
            lambda: Q.qdq(x, Q.MXSpec("e2m1")),
            qdq_bytes + n // 32,
        ),
        "nvfp4 qdq 1×16": (
            lambda: nvfp4_qdq(x, Q.NVFP4Spec(), backend="triton"),
            nvfp4("nvidia"),
            lambda: Q.qdq(x, Q.NVFP4Spec()),
            qdq_bytes + amax_read + 4 * n // 16,
        ),
        "nvfp4 qdq 1×16 (torchao convention)": (
            lambda: nvfp4_qdq(x, Q.NVFP4Spec(convention="torchao"), backend="triton"),
            nvfp4("torchao"),
            lambda: Q.qdq(x, Q.NVFP4Spec(convention="torchao")),
            qdq_bytes + amax_read + 4 * n // 16,
        ),
    }


def _bench_torchao(x: torch.Tensor) -> list[dict]:
    """qlab's kernels against torchao's casts as a Hopper user runs them (``torch.compile``d ``to_mx`` /
    ``to_dtype`` and ``NVFP4Tensor``; its Triton MX kernels need SM ≥ 100), same input, same run: time of
    each and whether the bits agree. Rows for what torchao lacks or refuses say why."""
    import triton.testing

    from qlab import kernels
    from qlab import quantize as Q
    from qlab.kernels import mx_qdq, nvfp4_qdq

    try:
        import torchao
        from torchao.prototype.mx_formats import nvfp4_tensor
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except ImportError as err:
        print(f"\ntorchao: not importable here ({err}); no comparison")
        return []
    fp4 = torch.float4_e2m1fn_x2

    def mx_round_trip(element):
        scale, data = to_mx(x, element, 32)
        return to_dtype(data, scale, element, 32, x.dtype)

    def nvfp4_round_trip():
        per_tensor = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
        return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor).dequantize(x.dtype)

    def qlab_mx_codes():
        q = kernels.quantize(x, "mxfp8", backend="triton")
        return q.scale_codes, q.codes

    cases = {
        "mxfp8 quantize → codes + E8M0 (e4m3, floor)": (
            qlab_mx_codes,
            lambda: to_mx(x, torch.float8_e4m3fn, 32),
            lambda ours, theirs: (
                torch.equal(ours[0].reshape(-1), theirs[0].view(torch.uint8).reshape(-1))
                and torch.equal(ours[1].reshape(-1), theirs[1].view(torch.uint8).reshape(-1))
            ),
        ),
        "mxfp8 qdq (e4m3, floor)": (
            lambda: mx_qdq(x, "mxfp8", backend="triton")[0],
            lambda: mx_round_trip(torch.float8_e4m3fn),
            lambda ours, theirs: torch.equal(ours.view(torch.int16), theirs.view(torch.int16)),
        ),
        "mxfp4 qdq (e2m1, floor)": (
            lambda: mx_qdq(x, Q.MXSpec("e2m1"), backend="triton")[0],
            lambda: mx_round_trip(fp4),
            lambda ours, theirs: torch.equal(ours.view(torch.int16), theirs.view(torch.int16)),
        ),
        "nvfp4 qdq 1×16 (torchao convention)": (
            lambda: nvfp4_qdq(x, Q.NVFP4Spec(convention="torchao"), backend="triton")[0],
            nvfp4_round_trip,
            lambda ours, theirs: torch.equal(ours.view(torch.int16), theirs.view(torch.int16)),
        ),
    }
    print(f"\nAgainst torchao {torchao.__version__} (torch.compile'd, the first call compiles):\n")
    print("| operation | qlab (ms) | torchao compiled (ms) | qlab speed-up | same bits | compile (s) |")
    print("|---|---:|---:|---:|---|---:|")
    rows = []
    for label, (ours, theirs, same) in cases.items():
        row = {"part": "vs torchao", "kernel": label, "baseline": f"torchao {torchao.__version__}, compiled"}
        ms = triton.testing.do_bench(ours)
        row["ms"] = round(ms, 3)
        try:
            compiled = torch.compile(theirs)
            start = time.perf_counter()
            reference = compiled()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            theirs_ms = triton.testing.do_bench(compiled)
            identical = bool(same(ours(), reference))
        except Exception as err:  # noqa: BLE001 — a row saying why beats a lost benchmark
            row["note"] = f"torchao failed: {type(err).__name__}: {str(err).splitlines()[0][:150]}"
            print(f"| {label} | {ms:.3f} | – | – | – | – | ({row['note']})", flush=True)
            rows.append(row)
            continue
        row.update(
            torchao_ms=round(theirs_ms, 3),
            baseline_ms=round(theirs_ms, 3),
            speedup=round(theirs_ms / ms, 2),
            same_bits="yes" if identical else "no",
            note=f"torchao compile {compile_s:.1f} s",
        )
        print(
            f"| {label} | {ms:.3f} | {theirs_ms:.3f} | {theirs_ms / ms:.2f}× | {row['same_bits']} | "
            f"{compile_s:.1f} |",
            flush=True,
        )
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
