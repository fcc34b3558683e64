"""Where a GPU call's time goes: host against device, and the kernels each call runs.

    python benchmarks/profile_gpu.py [layernorm] [linear] [quantize] [--results DIR]
    python benchmarks/profile_gpu.py cudagraphs --variant {partitions,no_reordering,no_partitions}
    python benchmarks/profile_gpu.py --merge DIR...   (append rows that runs wrote to other folders)

The first three parts time one call three ways and profile it: ``triton.testing.do_bench`` (device
time between events, what the benchmark tables report), the host's time to enqueue it (no
synchronisation: the Python and launch cost of one call) and the wall time per call with a
synchronisation at the end. A call whose host time is close to or above its device time is host-bound,
and the profile's table (kernels by device time, CPU ops by host time) says where. Cases: LayerNorm
forward+backward through autograd, qlab's Triton kernels against F.layer_norm (16384×4096 bf16); a
Linear forward+backward 16384×4096 → 4096 bf16, nn.Linear against QuantLinear fp8_tensorwise and
fp8_delayed on tensor cores; ``kernels.quantize`` to MXFP8 codes (8192×8192 bf16) against the kernel
alone.

``cudagraphs`` trains nvfp4 (its gradients draw stochastic-rounding noise between CUDA-graph
partitions) and FP32 with ``compile_mode="reduce-overhead"``, default CharGPT, batch 16, under one of
inductor's partitioning choices: ``partitions`` (what TrainConfig does), ``no_reordering``
(partitions, without inductor's reordering to fewer partitions) or ``no_partitions`` (a graph holding
the noise op runs without CUDA graphs). It prints whether each trains, the first step's seconds and the
steady step time, and the full error otherwise (with the allocation history of tensors the CUDA-graph
pool holds). Rows go to ``benchmarks/results/profile_gpu.csv``. (gpu_session.sh runs two variants side
by side on one GPU: their step times then compete; whether each trains is the point.)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, forward_backward, record  # noqa: E402

PARTS = ("layernorm", "linear", "quantize")
VARIANTS = ("partitions", "no_reordering", "no_partitions")


def time_three_ways(run, repeats: int = 30) -> dict:
    """{do_bench_ms, host_ms, wall_ms} of ``run`` (warmed up first), and its profile table printed."""
    import triton.testing

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    host = (time.perf_counter() - start) / repeats
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / repeats
    device_ms = triton.testing.do_bench(run)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    print(averages.table(sort_by="device_time_total", row_limit=15, max_name_column_width=60))
    print(averages.table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60), flush=True)
    return {
        "do_bench_ms": round(device_ms, 3),
        "host_ms": round(host * 1e3, 3),
        "wall_ms": round(wall * 1e3, 3),
    }


def layernorm_cases() -> dict:
    from qlab.kernels import layer_norm

    h = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(h)

    cases = {
        "F.layer_norm": forward_backward(
            lambda: torch.nn.functional.layer_norm(h, (4096,), w, b), dy, h, w, b
        )
    }
    for stats in ("welford", "two_pass"):
        call = functools.partial(layer_norm, h, (4096,), w, b, stats=stats, backend="triton")
        cases[f"qlab {stats}"] = forward_backward(call, dy, h, w, b)
    return cases


def linear_cases() -> dict:
    from qlab.nn import QuantLinear

    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def forward_backward_of(layer):
        return forward_backward(functools.partial(layer, x), dy, x, *layer.parameters())

    cases = {"nn.Linear (bf16)": forward_backward_of(linear)}
    for recipe in ("fp8_tensorwise", "fp8_delayed"):
        layer = QuantLinear.from_linear(linear, recipe=recipe, gemm="scaled_mm")
        cases[f"{recipe}, gemm=scaled_mm"] = forward_backward_of(layer)
    return cases


def quantize_cases() -> dict:
    from qlab import kernels
    from qlab.formats import get_format
    from qlab.kernels.mx_triton import mx_quantize_last_axis

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return {
        "kernels.quantize(x, 'mxfp8')": lambda: kernels.quantize(x, "mxfp8", backend="triton"),
        "mx_quantize_last_axis (the kernel)": lambda: mx_quantize_last_axis(x, get_format("e4m3"), "floor"),
    }


def train_with_cudagraphs(variant: str) -> list[dict]:
    import torch._inductor.config as inductor_config

    from qlab.train import TrainConfig, train

    inductor_config.triton.cudagraph_trees_history_recording = True  # who holds a pool tensor, if any
    if variant == "no_reordering":
        inductor_config.triton.reorder_for_reducing_graph_partitions = False
    elif variant == "no_partitions":
        inductor_config.graph_partition = False
        compile_ = torch.compile

        def without_partitions(model, **options):
            options["options"] = {
                k: v for k, v in options.get("options", {}).items() if k != "graph_partition"
            }
            return compile_(model, **options)

        torch.compile = without_partitions
    base = TrainConfig(batch_size=16, eval_batches=1, warmup_steps=0, progress=False, device="cuda")
    rows = []
    for recipe in ("nvfp4", "fp32"):
        config = base.replace(
            recipe=recipe, compile=True, compile_mode="reduce-overhead", steps=10, eval_every=10**6
        )
        began = time.perf_counter()
        try:
            times = list(train(config).metrics.time_s)
        except Exception as err:  # noqa: BLE001 — the error is the measurement
            traceback.print_exc()
            first_line = str(err).splitlines()[0][:200]
            rows.append(
                {"part": "cudagraphs", "case": f"{recipe}, {variant}", "note": f"failed: {first_line}"}
            )
            print(f"{recipe}: failed after {time.perf_counter() - began:.0f} s", flush=True)
            continue
        steady = (times[-2] - times[3]) / (len(times) - 5)  # steps 4..8 (the last evaluates)
        print(
            f"{recipe}: trains; first step {times[0]:.1f} s, steady {steady * 1e3:.2f} ms a step", flush=True
        )
        row = {"part": "cudagraphs", "case": f"{recipe}, {variant}", "first_step_s": round(times[0], 1)}
        rows.append({**row, "step_ms": round(steady * 1e3, 2), "note": "trains"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "parts", nargs="*", help=f"of {', '.join(PARTS)} (the default: all three), cudagraphs"
    )
    parser.add_argument("--variant", default="partitions", choices=VARIANTS)
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="folders whose profile_gpu.csv to append")
    add_results_argument(parser)
    args = parser.parse_args()
    if args.merge:  # runs side by side wrote to their own folders: their rows, provenance included
        import pandas as pd

        for folder in args.merge:
            rows = pd.read_csv(os.path.join(folder, "profile_gpu.csv"), dtype=str, keep_default_na=False)
            record("profile_gpu", rows.to_dict("records"), args.results)
        return 0
    unknown = set(args.parts) - {*PARTS, "cudagraphs"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}, cudagraphs")
    if not torch.cuda.is_available():
        print("profile_gpu: no CUDA device; nothing measured")
        return 0
    rows = []
    for part in args.parts or PARTS:
        if part == "cudagraphs":
            rows += train_with_cudagraphs(args.variant)
            continue
        cases = {"layernorm": layernorm_cases, "linear": linear_cases, "quantize": quantize_cases}[part]()
        for case, run in cases.items():
            print(f"\n### {part}: {case}", flush=True)
            times = time_three_ways(run)
            print(f"{case}: {times}", flush=True)
            rows.append({"part": part, "case": case, **times})
    record("profile_gpu", rows, args.results, device=torch.device("cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
