"""Training-step time of every recipe relative to FP32, eager and compiled, in one run.

    python benchmarks/bench_train.py [--modes eager,compiled] [--steps 10] [--repeats 3] [--threads auto]
                                     [--recipes fp8_tensorwise,...] [--llama] [--profile] [--device auto]
                                     [--compile-mode reduce-overhead] [--results DIR]

CharGPT rows: the default model (5 blocks, width 128, context 128, about 1.0M parameters, head kept
in high precision), batch --batch-size × 128 tokens, through ``qlab.train.train``. Each repeat runs
FP32 and then every recipe for --steps timed optimizer steps after 3 warm-up steps (which compile);
the ratio is taken against the FP32 run of the same repeat and mode, and the table gives the median
ratio over repeats with its range. "compiled" is ``TrainConfig(compile=True)`` (compiled against
compiled FP32), "eager" the default (against eager FP32). Quantization is emulated (quantize →
dequantize → FP32 GEMM), so a ratio is the emulation's cost, not a low-precision speed-up.
--compile-mode reduce-overhead compiles FP32 and every recipe with CUDA graphs on a GPU
(``TrainConfig.compile_mode``; the compiled rows and --profile).

--profile (CUDA only) says where a compiled CharGPT step's time goes on the GPU: for FP32 and each
recipe, the wall time of a step (the forward, backward and AdamW step; no clipping and no loss read
back, so a little under a ``train`` step), the summed time of the kernels the GPU ran in it ("GPU
busy", from torch.profiler) and their number. Where wall time far exceeds GPU-busy time, the step is
bound by the host (Python and kernel launches), not by the quantizers' arithmetic.

--llama adds a quantized Hugging Face Llama (2 layers, hidden 256, intermediate 1024, 512 tokens a
step) under bf16 autocast with mxfp8, forward+backward+AdamW, against the same model unquantized,
both compiled: the two are built first, then timed in five alternating rounds of --steps steps
each, and the ratio is the median (with its range) of the rounds' ratios, so that a change in the
machine's load reaches both sides of a ratio. Compilation time is reported apart (first step).

Every table's rows are appended, with the machine, device, date, torch and commit, to
``benchmarks/results/bench_train_cpu.csv`` (``bench_train_gpu.csv`` on CUDA; --profile's to
``bench_train_profile_gpu.csv``): the docs' tables are generated from those files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_results_argument, add_thread_argument, machine, median_and_range, record, set_threads  # noqa: E402

from qlab.kernels.compiled import COMPILE_OPTIONS  # noqa: E402
from qlab.train import TrainConfig, train  # noqa: E402
from qlab.train.config import COMPILE_MODES, RECIPES  # noqa: E402
from qlab.train.loop import (  # noqa: E402
    Batches,
    autocast_for,
    build_model,
    compiled_step_model,
    make_optimizer,
    resolve_device,
)

WARMUP = 3
CURRENT_SCALING = ("fp8_tensorwise", "int8_per_token", "mxfp8", "mxfp4", "nvfp4")


def seconds_per_step(config: TrainConfig, steps: int, compile_times_to: str | None = None):
    """(seconds per step after the warm-up, seconds of the first step), from the run's own cumulative
    step times (the last step, which also evaluates, is left out). With ``compile_times_to``, Dynamo's
    per-phase compile times of this run go to ``<compile_times_to>/<recipe>.txt``."""
    compile_times = torch._dynamo.utils.compilation_time_metrics
    compile_times.clear()
    times = train(config.replace(steps=WARMUP + steps + 1, eval_every=10**6)).metrics.time_s
    if compile_times_to and config.compile:
        os.makedirs(compile_times_to, exist_ok=True)
        with open(os.path.join(compile_times_to, f"{config.recipe}.txt"), "w") as file:
            file.write(torch._dynamo.utils.compile_times(repr="str", aggregate=True) + "\n")
    return (times.iloc[-2] - times.iloc[WARMUP - 1]) / steps, times.iloc[0]


def profile_compiled_step(config: TrainConfig, steps: int) -> tuple[float, float, float]:
    """(wall seconds, GPU-busy seconds, kernels) per compiled training step of ``config`` on CUDA: the
    model built and compiled as ``train`` builds it, under its autocast (no GradScaler), one fixed
    batch, 3 warm-up steps; wall time is the middle of three runs of ``steps`` steps, GPU-busy time
    (the kernels' summed durations, memcpy and memset included) and the kernel count come from
    torch.profiler over 5 more steps."""
    device = torch.device(config.device)
    batches = Batches(config)
    model = build_model(config, len(batches.vocabulary)).to(device).train()
    step_model = compiled_step_model(model, config.compile_mode)
    optimizer = make_optimizer(config, model)
    autocast = autocast_for(config, device)  # bf16's forward, as train runs it
    inputs, targets = (t.to(device) for t in batches.train(0, 0, 0))

    def step():
        if config.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # as train does: once a step, .grad set to None
        with autocast():
            logits = step_model(inputs)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    walls = sorted(seconds_per_call(step, steps, synchronize=True) for _ in range(3))
    profiled = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(event.device_time_total for event in kernels) * 1e-6  # µs → s
    return walls[1], busy / profiled, len(kernels) / profiled


def llama_stepper(recipe: str | None, device: torch.device):
    """(one compiled AdamW step of a tiny Llama under bf16 autocast, as a function, warmed up; the
    seconds of its first step, which compiles)."""
    import transformers

    from qlab.nn import quantize_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).to(device).train()
    if recipe is not None:
        quantize_model(model, recipe, keep_high_precision=["lm_head"])
    compiled = torch.compile(model, dynamic=False, options=COMPILE_OPTIONS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    first = seconds_per_call(step, 1)
    seconds_per_call(step, WARMUP - 1)
    return step, first


def seconds_per_call(function, calls: int, synchronize: bool = False) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function()
    if synchronize:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--recipes", default=",".join(r for r in RECIPES if r != "fp32"))
    parser.add_argument("--llama", action="store_true")
    parser.add_argument("--profile", action="store_true", help="wall against GPU-busy time (CUDA only)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile-times", metavar="DIR", help="Dynamo's compile-time table per recipe, here")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    add_thread_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    if args.compile_times and os.path.exists(args.compile_times) and not os.path.isdir(args.compile_times):
        parser.error(f"--compile-times must name a folder, got the file {args.compile_times!r}")
    warnings.filterwarnings("ignore")
    threads = set_threads(args.threads)
    device = resolve_device(args.device)
    recipes = args.recipes.split(",")
    base = TrainConfig(
        batch_size=args.batch_size, eval_batches=1, warmup_steps=0, progress=False, device=str(device)
    )
    print(
        f"machine: {machine(device)} ({threads} threads chosen); default CharGPT, batch {args.batch_size} × "
        f"{base.context} tokens, {args.steps} timed steps, {args.repeats} repeats\n"
    )
    if args.profile:  # --modes, --repeats and --llama do not apply
        if device.type != "cuda":
            parser.error(f"--profile reads the GPU's kernel times: it needs a CUDA device, got {device}")
        print(f"compile_mode {args.compile_mode}\n")
        print("| recipe, compiled | wall step (ms) | / FP32 | GPU busy (ms) | / FP32 | kernels a step |")
        print("|---|---:|---:|---:|---:|---:|")
        fp32, rows = None, []
        for recipe in ["fp32", *recipes]:
            config = base.replace(recipe=recipe, compile=True, compile_mode=args.compile_mode)
            wall, busy, kernels = profile_compiled_step(config, args.steps)
            fp32 = fp32 or (wall, busy)
            times = f"{wall * 1e3:.2f} | {wall / fp32[0]:.2f} | {busy * 1e3:.2f} | {busy / fp32[1]:.2f}"
            print(f"| {recipe} | {times} | {kernels:.0f} |", flush=True)
            rows.append(
                {
                    "batch": args.batch_size,
                    "compile_mode": args.compile_mode,
                    "recipe": recipe,
                    "wall_ms": round(wall * 1e3, 2),
                    "wall_ratio": round(wall / fp32[0], 2),
                    "busy_ms": round(busy * 1e3, 2),
                    "busy_ratio": round(busy / fp32[1], 2),
                    "kernels": round(kernels),
                }
            )
        record("bench_train_profile_gpu", rows, args.results, device=device)
        return
    results = f"bench_train_{'gpu' if device.type == 'cuda' else 'cpu'}"
    common = {"model": "CharGPT (default)", "batch": args.batch_size, "steps": args.steps}
    if device.type == "cpu":
        common = {"threads": threads, **common}
    for mode in filter(None, args.modes.split(",")):  # --modes "" with --llama: the Llama rows only
        compiled = mode == "compiled"
        modes = {"compile": compiled, "compile_mode": args.compile_mode if compiled else "default"}
        ratios = {recipe: [] for recipe in recipes}
        fp32_seconds, first_steps, failed = [], {}, {}
        for repeat in range(args.repeats):  # each measurement printed as taken: a cut-off run keeps them
            times_to = args.compile_times if repeat == 0 else None  # the cold compile, not the cache's
            fp32, fp32_first = seconds_per_step(base.replace(**modes), args.steps, times_to)
            first_steps.setdefault("fp32", fp32_first)  # the first repeat's, as for the recipes
            fp32_seconds.append(fp32)
            print(f"# {mode} repeat {repeat}: fp32 {fp32 * 1e3:.1f} ms", flush=True)
            for recipe in recipes:
                if recipe in failed:
                    continue
                config = base.replace(recipe=recipe, **modes)
                try:
                    seconds, first = seconds_per_step(config, args.steps, times_to)
                except Exception as err:  # noqa: BLE001 — a failed recipe is a row saying why; the rest still run
                    failed[recipe] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    print(f"# {mode} repeat {repeat}: {recipe} failed: {failed[recipe]}", flush=True)
                    continue
                ratios[recipe].append(seconds / fp32)
                first_steps.setdefault(recipe, first)  # the first repeat's: compilation, not its cache
                ratio = seconds / fp32
                print(f"# {mode} repeat {repeat}: {recipe} {seconds * 1e3:.1f} ms, {ratio:.2f}", flush=True)
        print()
        fp32_ms = median_and_range([1e3 * s for s in fp32_seconds])
        label = f"{mode} ({args.compile_mode})" if compiled else mode
        print(f"{label}: FP32 step {fp32_ms} ms (median (min–max) over repeats)\n")
        print(f"| recipe | {mode} step / FP32 {mode} | first step (s) |")
        print("|---|---:|---:|")
        row = {**common, "repeats": args.repeats, "mode": "compiled (blocks)" if compiled else "eager"}
        row.update(compile_mode=args.compile_mode if compiled else "", fp32_ms=fp32_ms)
        rows = [{**row, "recipe": "fp32", "ratio": "1.00", "first_step_s": round(first_steps["fp32"], 1)}]
        for recipe in recipes:
            if recipe in failed:
                print(f"| {recipe} | failed | – |", flush=True)
                rows.append({**row, "recipe": recipe, "ratio": "", "note": f"failed: {failed[recipe]}"})
                continue
            first = first_steps[recipe]
            print(f"| {recipe} | {median_and_range(ratios[recipe])} | {first:.1f} |", flush=True)
            rows.append(
                {
                    **row,
                    "recipe": recipe,
                    "ratio": median_and_range(ratios[recipe]),
                    "first_step_s": round(first, 1),
                }
            )
        record(results, rows, args.results, device=device)
        print()
    if args.llama:  # both models built first, then timed in alternation: the ratio of each round
        plain, plain_first = llama_stepper(None, device)
        quantized, first = llama_stepper("mxfp8", device)
        rounds = [
            (seconds_per_call(plain, args.steps), seconds_per_call(quantized, args.steps)) for _ in range(5)
        ]
        plain_ms = median_and_range([1e3 * p for p, _ in rounds])
        quantized_ms = median_and_range([1e3 * q for _, q in rounds])
        ratio = median_and_range([q / p for p, q in rounds])
        print("| Llama (2 × 256, 512 tokens), bf16 autocast, compiled | step (ms) | ratio | first step (s) |")
        print("|---|---:|---:|---:|")
        print(f"| unquantized | {plain_ms} | 1.00 | {plain_first:.1f} |")
        print(f"| mxfp8 | {quantized_ms} | {ratio} | {first:.1f} |")
        llama = {**common, "model": "Llama 2 × 256, 512 tokens, bf16 autocast", "batch": "", "repeats": 5}
        llama.update(mode="compiled (whole model)", compile_mode="default", note="5 alternating rounds")
        rows = [
            {**llama, "recipe": "bf16 (unquantized)", "ratio": "1.00", "step_ms": plain_ms},
            {
                **llama,
                "recipe": "mxfp8",
                "ratio": ratio,
                "step_ms": quantized_ms,
                "first_step_s": round(first, 1),
            },
        ]
        rows[0]["first_step_s"] = round(plain_first, 1)
        record(results, rows, args.results, device=device)


if __name__ == "__main__":
    main()
