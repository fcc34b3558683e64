"""Training steps per second of the default CharGPT for fp32 and every recipe, in one run.

    python benchmarks/bench_train.py [--steps 20] [--batch-size 16] [--device auto]

Each configuration trains the default model (5 blocks, width 128, context 128, about 1.0M
parameters, head kept in high precision) for --steps optimizer steps after 3 warm-up steps (which
also compile qdq's fast path where a tensor is large enough); no evaluation inside the timed
steps. Prints a markdown table: steps/s, tokens/s and the quantization overhead (time per step
over fp32's). Quantization is emulated (quantize → dequantize → FP32 GEMM), so the overhead is
the emulation's cost, not a low-precision speed-up.
"""

from __future__ import annotations

import argparse
import platform
import warnings

import torch

from qlab.train import TrainConfig, train
from qlab.train.config import RECIPES
from qlab.train.loop import resolve_device


def seconds_per_step(config: TrainConfig, steps: int, warmup: int = 3) -> float:
    """Seconds per step after ``warmup`` steps, from the run's own cumulative step times (the last
    step, which also evaluates, is left out)."""
    times = train(config.replace(steps=warmup + steps + 1, eval_every=10**6)).metrics.time_s
    return (times.iloc[-2] - times.iloc[warmup - 1]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = resolve_device(args.device)
    base = TrainConfig(
        batch_size=args.batch_size, eval_batches=1, warmup_steps=0, progress=False, device=str(device)
    )
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine())
    )
    print(
        f"machine: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}; default CharGPT, "
        f"batch {args.batch_size} × {base.context} tokens, {args.steps} timed steps\n"
    )
    print("| recipe | steps/s | tokens/s | overhead vs fp32 |")
    print("|---|---:|---:|---:|")
    fp32 = None
    for recipe in RECIPES:
        seconds = seconds_per_step(base.replace(recipe=recipe), args.steps)
        fp32 = fp32 or seconds
        tokens = args.batch_size * base.context / seconds
        print(f"| {recipe} | {1 / seconds:.2f} | {tokens:,.0f} | {seconds / fp32:.2f} |", flush=True)


if __name__ == "__main__":
    main()
