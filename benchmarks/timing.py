"""What every benchmark here shares: thread count, machine line, medians with their spread, and the
results file each run appends its rows to.

On a shared CPU, PyTorch's OpenMP threads spin at every parallel region's barrier while another process
holds a core, so an FP32 step slows far more than a quantized one and ratios lose their meaning; with one
thread per *free* core they stay close to their quiet values (the rows with a ``load`` in
``results/bench_train_cpu.csv``). ``--threads auto`` picks that count from how busy the cores are in the
second before the benchmark starts.

``record(name, rows)`` appends rows to ``results/<name>.csv`` with the machine, device, date, torch and
commit in front (the docs' benchmark tables are generated from these files); ``--results DIR`` sends them
elsewhere, ``--results ''`` only prints.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from qlab.session import machine  # benchmarks name their machine through here

RESULTS = Path(__file__).resolve().parent / "results"
PROVENANCE = ("machine", "device", "date", "torch", "commit")


def add_results_argument(parser) -> None:
    parser.add_argument(
        "--results",
        default=str(RESULTS),
        metavar="DIR",
        help="folder of the results CSV this run appends its rows to ('' : print only, record nothing)",
    )


def provenance(device=None) -> dict:
    """The columns every results row starts with: machine, device, date, torch, commit (``git rev-parse
    --short HEAD``, or "unrecorded" outside a git checkout)."""
    device = torch.device(device if device is not None else "cpu")
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True
        )
        commit = git.stdout.strip() if git.returncode == 0 else ""
    except OSError:
        commit = ""
    return {
        "machine": machine(device),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "commit": commit or "unrecorded",
    }


def record(name: str, rows: list[dict], folder=RESULTS, device=None) -> Path | None:
    """Append ``rows`` to ``folder/<name>.csv``, each with :func:`provenance` in front; nothing when
    ``folder`` is empty. The file's columns stay in their order; a column it lacks is added at the end
    (every existing row kept, empty there). Returns the file's path."""
    if not folder or not rows:
        return None
    path = Path(folder) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame([{**provenance(device), **row} for row in rows])
    if not path.exists():
        frame.to_csv(path, index=False)
        return path
    old = pd.read_csv(path, dtype=str, keep_default_na=False)
    if set(frame.columns) <= set(old.columns):
        frame.reindex(columns=old.columns).to_csv(path, mode="a", header=False, index=False)
    else:
        text = frame.astype(object).where(frame.notna(), "").astype(str)  # an int stays an int beside ""
        pd.concat([old, text], ignore_index=True).fillna("").to_csv(path, index=False)
    return path


def forward_backward(call, dy: torch.Tensor, *leaves: torch.Tensor):
    """A function that runs ``call()`` and its backward of ``dy``, each leaf's .grad cleared first (the
    inputs and parameters: every run starts from no gradient, as a training step does)."""

    def run():
        for leaf in leaves:
            leaf.grad = None
        call().backward(dy)

    return run


def add_thread_argument(parser) -> None:
    parser.add_argument(
        "--threads", default="auto", help="torch threads: a number, or 'auto' = the cores not already busy"
    )


def busy_cores(seconds: float = 1.0) -> float:
    """How many cores other processes keep busy: from /proc/stat over ``seconds`` (Linux), else the
    1-minute load average."""
    try:
        first = _cpu_times()
        time.sleep(seconds)
        second = _cpu_times()
    except OSError:
        return os.getloadavg()[0]
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle and iowait
    return (os.cpu_count() or 1) * (1 - idle / total) if total > 0 else 0.0


def _cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(value) for value in stat.readline().split()[1:]]


def set_threads(requested: str) -> int:
    """Set torch's intra-op threads: ``requested`` as a number, or for "auto" the cores not already busy
    (cpu_count − round(busy_cores()), at least 1). Returns the count."""
    if requested == "auto":
        cores = os.cpu_count() or 1
        count = max(1, min(cores, cores - round(busy_cores())))
    else:
        count = int(requested)
    torch.set_num_threads(count)
    return count


def median_seconds(fn, repeats: int, *, synchronize: bool = False) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after one warm-up call."""
    return statistics.median(all_seconds(fn, repeats, synchronize=synchronize))


def all_seconds(fn, repeats: int, *, synchronize: bool = False) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` after one warm-up call (CUDA synchronized if asked)."""
    fn()
    times = []
    for _ in range(repeats):
        if synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if synchronize:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def paired_ratio(fn, baseline, repeats: int, calls: int = 5) -> tuple[float, float]:
    """(median seconds of a call of ``fn``, median over ``repeats`` rounds of fn's time / baseline's in
    that round), after one warm-up call of each. Each round times ``calls`` calls of each back to back,
    in alternating order, so a change in the machine's load between rounds reaches both sides of its
    ratio (on the 2-core VM the same kernel read 1.1× and 1.3× a floor timed minutes apart)."""
    fn()
    baseline()
    seconds, ratios = [], []
    for round_ in range(repeats):
        pair = {}
        for name in ("fn", "baseline") if round_ % 2 == 0 else ("baseline", "fn"):
            function = fn if name == "fn" else baseline
            start = time.perf_counter()
            for _ in range(calls):
                function()
            pair[name] = (time.perf_counter() - start) / calls
        seconds.append(pair["fn"])
        ratios.append(pair["fn"] / pair["baseline"])
    return statistics.median(seconds), statistics.median(ratios)


def median_and_range(values) -> str:
    """ "1.23 (1.10–1.40)": the median and the smallest and largest value."""
    values = sorted(values)
    return f"{statistics.median(values):.2f} ({values[0]:.2f}–{values[-1]:.2f})"
