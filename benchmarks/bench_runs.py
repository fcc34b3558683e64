"""Wall time of the training notebooks' run lists, one run at a time against fanned out (qlab.runs).

CPU (default): the run lists of notebooks 01, 03 and 07 at their default parameters (``--every K``
times every K-th run of each, to fit a budget), timed back to back with the serial executor (this
process's threads: one run at a time as the notebooks ran before they fanned out), the processes
executor (one worker of one thread per core) and, with ``--ray``, a local Ray cluster of as many CPUs,
whose results are compared with the processes' bit for bit (the tests pin serial = processes).

``--pool``: a short list (4 CharGPT runs of 60 steps) serially, on a pool of worker processes started
for the call (cold) and on the same pool again (warm, as ``run_many`` keeps it): what starting a pool
costs, which ``qlab.runs.POOL_START_S`` records.

``--thread-scaling``: one run of each list alone with 1 thread and with every core's, which bounds
what one-thread workers can gain over the serial executor (cores × t(cores) / t(1)).

GPU (``--gpu``): paper-profile CharGPT runs (notebook 03's recipes) with 1, 2, 4, 8 runs packed on
one GPU: runs per hour and the GPU's busy fraction (nvidia-smi's utilization, sampled every 0.2 s).

Each invocation appends its rows, with the machine, device, date, torch and commit, to
``benchmarks/results/bench_runs_cpu.csv``, ``bench_runs_pool.csv``, ``bench_runs_threads.csv`` or
``bench_runs_gpu.csv``.

    python benchmarks/bench_runs.py --every 4 --ray
    python benchmarks/bench_runs.py --gpu --runs-per-gpu 1,2,4,8 --gpu-runs 8 --steps 300
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import torch

from qlab import run_lists, seed_model
from qlab.runs import run_many, task, usable_cores
from qlab.session import machine, notebook_defaults
from qlab.train import TrainConfig

RESULTS = Path(__file__).parent / "results"  # bench_runs_cpu.csv and bench_runs_gpu.csv
QUANTIZED = ["fp8_tensorwise", "mxfp8", "mxfp4", "nvfp4"]


def notebook_01_runs() -> list:
    """Notebook 01's three settings and its fp16 grid (optimizers × backwards × seeds), at its defaults."""
    p = notebook_defaults("01_gradient_norm_discrepancy")
    settings = [dict(microbatches=p["microbatches"]), dict(clip_norm=p["clip_norm"]),
                dict(loss_scale=p["init_scale"], growth_interval=p["growth_interval"],
                     microbatches=p["microbatches"], clip_norm=p["clip_norm"])]  # fmt: skip
    runs = [task(seed_model.train, "corrected", "adam", p["steps"], seed=p["seed"], **s) for s in settings]
    optimizers = [("adam", 1e-8), ("adam", 1e-12), ("adam", 1e-16), ("sgd", 1e-8)]
    runs += [
        task(seed_model.train, mode, optimizer, p["fp16_steps"], loss_scale=p["init_scale"],
             growth_interval=p["growth_interval"], precision="fp16", eps=eps, bits=p["fp16_bits"],
             audit=False, seed=seed)
        for optimizer, eps in optimizers for mode in seed_model.MODES for seed in range(p["seeds"])
    ]  # fmt: skip
    return runs


def notebook_03_runs(profile: str = "cpu", device: str = "cpu") -> list[TrainConfig]:
    """Notebook 03's list at its defaults (qlab.run_lists, the function the notebook calls)."""
    values = {**notebook_defaults("03_backward_override_training_curves"), "profile": profile}
    return run_lists.run_list("03_backward_override_training_curves", values, device).configs


def notebook_07_runs() -> list[TrainConfig]:
    """Notebook 07's training list at its defaults (qlab.run_lists, the function the notebook calls)."""
    return run_lists.run_list("07_recipe_ablations", notebook_defaults("07_recipe_ablations"), "cpu").configs


def same_results(a, b) -> bool:
    """Bit-identical results: frames compared whole (a TrainResult's timing column left out)."""
    if isinstance(a, pd.DataFrame):
        return a.equals(b)
    return a.metrics.drop(columns="time_s").equals(b.metrics.drop(columns="time_s")) and a.fidelity.equals(
        b.fidelity
    )


def timed(runs, **options) -> tuple[float, list]:
    start = time.perf_counter()
    results = run_many(runs, progress=False, **options)
    return time.perf_counter() - start, results


def record(rows: list[dict], kind: str) -> None:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    stamp = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "commit": git.stdout.strip(),
        "cores": usable_cores(),
    }
    frame = pd.DataFrame([{**stamp, **row} for row in rows])
    path = RESULTS / f"bench_runs_{kind}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # rows with other columns than the file's: the union, earlier rows kept as they are
        frame = pd.concat([pd.read_csv(path), frame], ignore_index=True)
    frame.to_csv(path, index=False)
    print(frame.to_string(index=False))


def cpu(every: int, with_ray: bool, notebooks: list[str]) -> None:
    lists = {"01": notebook_01_runs, "03": notebook_03_runs, "07": notebook_07_runs}
    for name in notebooks:
        runs = lists[name]()[::every]
        serial_s, _ = timed(runs, executor="serial")
        processes_s, parallel = timed(runs, executor="processes")
        row = {
            "machine": machine(),
            "device": "cpu",
            "list": f"notebook {name}, every {every}. run",
            "runs": len(runs),
            "serial_s": round(serial_s, 1),
            "processes_s": round(processes_s, 1),
            "speedup_processes": round(serial_s / processes_s, 2),
        }
        if with_ray:
            ray_s, on_ray = timed(runs, executor="ray")
            row["ray_s"], row["speedup_ray"] = round(ray_s, 1), round(serial_s / ray_s, 2)
            row["ray_identical_to_processes"] = all(map(same_results, on_ray, parallel))
        record([row], "cpu")  # each row as it comes: a run cut off keeps the lists it finished


def thread_scaling(notebooks: list[str], repeats: int = 2) -> None:
    """What one run gains from the second core, timed alone: its wall time with 1 thread and with every
    core's, and so the most a pool of one-thread workers can gain over the serial executor,
    cores × t(cores) / t(1), for the first FP32 and the first quantized run of each list."""
    from qlab.train import train

    lists = {"01": notebook_01_runs, "03": notebook_03_runs, "07": notebook_07_runs}
    cores = usable_cores()
    for name in notebooks:
        runs = lists[name]()
        picked = [runs[0]]
        if name != "01":
            quantized = next(r for r in runs if r.recipe not in ("fp32", "bf16"))
            picked = [next(r for r in runs if r.recipe == "fp32"), quantized]
        for run in picked:
            seconds = {}
            for threads in (1, cores):
                torch.set_num_threads(threads)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run.function(*run.args, **run.kwargs) if hasattr(run, "function") else train(run)
                    times.append(time.perf_counter() - start)
                seconds[threads] = min(times)
            label = getattr(run, "recipe", str(run)[:60])
            row = {"machine": machine(), "list": f"notebook {name}", "run": label}
            row["seconds_1_thread"] = round(seconds[1], 2)
            row[f"seconds_{cores}_threads"] = round(seconds[cores], 2)
            row["pool_bound"] = round(cores * seconds[cores] / seconds[1], 2)
            record([row], "threads")


class BusySampler:
    """The GPU's utilization (percent of time a kernel ran), sampled by nvidia-smi every 0.2 s."""

    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        for line in process.stdout:
            if self._stop.is_set():
                break
            try:
                self.samples.append(float(line.split(",")[0]))
            except ValueError:
                pass
        process.kill()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=2)

    def busy(self) -> float:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else float("nan")


def gpu(runs_per_gpu: list[int], count: int, steps: int) -> None:
    paper = notebook_03_runs("paper", device="cuda")
    # one seed of each configuration, the first `count`, shortened to `steps`
    runs = [config.replace(steps=steps, warmup_steps=min(100, steps // 10)) for config in paper[:count]]
    device = torch.cuda.get_device_name()
    for packed in runs_per_gpu:
        with BusySampler() as sampler:
            seconds, _ = timed(runs, executor="processes", max_workers=packed, runs_per_gpu=packed)
        row = {
            "machine": f"{device}, {usable_cores()} cores",
            "device": device,
            "list": f"paper profile, notebook 03's first {len(runs)} configurations, {steps} steps",
            "runs": len(runs),
            "runs_per_gpu": packed,
            "wall_s": round(seconds, 1),
            "runs_per_hour": round(3600 * len(runs) / seconds, 1),
            "gpu_busy": round(sampler.busy(), 3),
        }
        record([row], "gpu")  # each row as it comes: a call cut off at its limit keeps the rows it finished


def pool_start(repeats: int = 3) -> None:
    """Serial against a cold and a warm pool on a list short enough for the pool's start-up to show."""
    from qlab.runs import close_pools

    runs = [config.replace(steps=60, eval_every=60, fidelity_every=0) for config in notebook_07_runs()[:4]]
    for _ in range(repeats):
        serial_s, _ = timed(runs, executor="serial")
        close_pools()
        cold_s, cold = timed(runs, executor="processes")
        warm_s, warm = timed(runs, executor="processes")
        close_pools()
        row = {
            "machine": machine(),
            "device": "cpu",
            "list": "4 CharGPT runs of 60 steps (notebook 07's first, shortened)",
            "runs": len(runs),
            "serial_s": round(serial_s, 2),
            "processes_s": round(cold_s, 2),
            "speedup_processes": round(serial_s / cold_s, 2),
            "processes_warm_s": round(warm_s, 2),
            "speedup_warm": round(serial_s / warm_s, 2),
            "pool_start_s": round(cold_s - warm_s, 2),
            "warm_identical_to_cold": all(map(same_results, warm, cold)),
        }
        record([row], "pool")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="time every K-th run of each list")
    parser.add_argument("--notebooks", default="01,03,07")
    parser.add_argument("--ray", action="store_true", help="also a local Ray cluster")
    parser.add_argument("--gpu", action="store_true", help="runs packed per GPU instead")
    parser.add_argument(
        "--thread-scaling", action="store_true", help="one run at 1 thread and at every core's"
    )
    parser.add_argument("--pool", action="store_true", help="a short list: serial, cold pool, warm pool")
    parser.add_argument("--runs-per-gpu", default="1,2,4,8")
    parser.add_argument("--gpu-runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.thread_scaling:
        thread_scaling(args.notebooks.split(","))
    elif args.pool:
        pool_start()
    elif args.gpu:
        gpu([int(k) for k in args.runs_per_gpu.split(",")], args.gpu_runs, args.steps)
    else:
        cpu(args.every, args.ray, args.notebooks.split(","))


if __name__ == "__main__":
    main()
