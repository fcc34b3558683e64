"""What every benchmark here shares: thread count, machine line, medians with their spread.

On a shared CPU, PyTorch's OpenMP threads spin at every parallel region's barrier while another process
holds a core: measured on the 2-core VM with two busy processes beside it, an FP32 CharGPT step went from
0.12 s to 3.2 s (27×) and a quantized one 4×, so ratios lost all meaning. With one thread per *free*
core the same ratio stayed within 6 % of its quiet value (benchmarks in the README). ``--threads auto``
picks that count from how busy the cores are in the second before the benchmark starts.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from qlab.session import machine  # noqa: F401  (benchmarks name their machine through here)


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
