"""Many independent runs at once: in this process, in a pool of worker processes, or on a Ray cluster.

    from qlab.runs import run_many, task
    results = run_many([base.replace(seed=s) for s in range(5)])          # TrainConfigs -> TrainResults
    frames = run_many([task(seed_model.train, "corrected", steps=300, seed=s) for s in range(5)])

Guarantees, whatever the executor:

- results come back in the order of the runs given;
- a run's result is bit-identical to the same run done serially with the same number of torch
  threads (``threads_per_run``; each worker process sets it before the run);
- a run that raises does not stop the others: once every run has finished, :class:`RunsFailed` is
  raised naming each failed run's configuration and carrying every finished result
  (``error.results``, None where a run failed);
- one progress bar (``qlab.host.progress``: a widget in JupyterLab, text under papermill) counts
  finished runs across workers;
- with ``cache=True`` (or ``$QLAB_RUN_CACHE=1`` where ``cache`` is left None, as the notebooks leave
  it) each finished run is kept under ``runs/cache/`` by a key of its configuration (every field),
  its thread count and qlab's version, so an interrupted list restarted does only what is missing;
- ``on_result(index, result)`` is called in this process as each run finishes (``qlab.campaign``
  writes each run's files there, so a list killed half way keeps what finished);
- the pool of worker processes stays up for the next ``run_many`` call with the same workers and GPUs
  (a notebook calls it several times; starting a pool costs seconds a short list would notice);
  ``close_pools()`` shuts it down, as does the end of the process.

Executors:

``"serial"``     one run after another in this process.
``"processes"``  a pool of spawned worker processes (the default). On the CPU: ``max_workers``
                 (default: every usable core) workers of ``cores // workers`` torch threads each. With
                 CUDA GPUs: ``runs_per_gpu`` workers per GPU, each pinned to its GPU by
                 ``CUDA_VISIBLE_DEVICES``.
``"ray"``        each run a Ray task (``pip install 'qlab[ray]'``) of ``threads_per_run`` CPUs and
                 ``1 / runs_per_gpu`` of a GPU where the cluster has GPUs; ``address`` is a running
                 cluster's (``"auto"``, ``"host:port"``, ``"ray://host:port"``), or None: ``$RAY_ADDRESS``
                 where set, else a local cluster of ``max_workers × threads_per_run`` CPUs.

A run is a :class:`~qlab.train.TrainConfig` (run by ``qlab.train.train``; its model comes back on
the CPU) or a :class:`Task`: a function importable by name (defined in a module, not in a notebook
cell) and its arguments, all picklable.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qlab import checks, paths

EXECUTORS = ("serial", "processes", "ray")
POOL_START_S = (
    8.0  # starting the pool's workers (spawn, import torch and qlab): bench_runs.py --pool, 2 cores
)
RUNS_PER_GPU = 8  # runs packed on one GPU: the most runs per hour of 1, 2, 4, 8 on an H100 (bench_runs.py)
CACHE_DIR_NAME = "cache"
CACHE_ENV = "QLAB_RUN_CACHE"  # "1": cache=None means cache=True (set it for a notebook's kernel)
RAY_INSTALL = "pip install 'qlab[ray]' (or pip install ray)"
MAX_THREADS = 2**31 - 1  # the most torch.set_num_threads takes (a C int)


@dataclass(frozen=True)
class Task:
    """One run of ``function(*args, **kwargs)``; ``function`` must be importable by name."""

    function: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        arguments = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{_qualified_name(self.function)}({', '.join(arguments)})"


def task(function: Callable, *args, **kwargs) -> Task:
    """``Task(function, args, kwargs)``: the run ``function(*args, **kwargs)``."""
    checks.function("function", function, "the run's function")
    return Task(function, args, kwargs)


class RunsFailed(RuntimeError):
    """Some runs raised. ``failures``: [(index, run, error text)]; ``results``: every run's result in
    input order, None where it failed."""

    def __init__(self, failures: list[tuple[int, object, str]], results: list):
        self.failures, self.results = failures, results
        lines = [f"{len(failures)} of {len(results)} runs failed (the other results are in .results):"]
        for index, run, error in failures:
            lines.append(f"  run {index}: {describe(run)}\n    {error.strip().splitlines()[-1]}")
        super().__init__("\n".join(lines))


def describe(run) -> str:
    """A run's configuration as an error message shows it: the fields that differ from the defaults."""
    from qlab.train.config import TrainConfig

    _check_run("run", run)
    if isinstance(run, TrainConfig):
        default = TrainConfig()
        changed = {
            name: getattr(run, name)
            for name in run.__dataclass_fields__
            if getattr(run, name) != getattr(default, name)
        }
        return "TrainConfig(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")"
    return str(run)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# --- checks, before any run starts ----------------------------------------------------------------


def _qualified_name(function) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _check_run(name: str, run) -> None:
    """A run: a TrainConfig, or a Task of a callable, a tuple of args and a dict of kwargs."""
    from qlab.train.config import TrainConfig

    if isinstance(run, Task):
        if not callable(run.function):
            raise TypeError(f"{name}.function must be callable, got {checks.shown(run.function)}")
        if not isinstance(run.args, tuple) or not isinstance(run.kwargs, dict):
            raise TypeError(f"{name} must hold a tuple of args and a dict of kwargs")
    elif not isinstance(run, TrainConfig):
        raise TypeError(f"{name} must be a TrainConfig or a qlab.runs.Task, got {checks.shown(run)}")


def _check_runs(runs) -> list:
    from qlab.train.config import TrainConfig

    if isinstance(runs, (str, bytes, TrainConfig, Task)) or not isinstance(runs, Sequence):
        raise TypeError(f"runs must be a list of TrainConfig or Task, got {checks.shown(runs)}")
    runs = list(runs)
    for index, run in enumerate(runs):
        _check_run(f"runs[{index}]", run)
    return runs


def _check_picklable(runs: list, executor: str) -> None:
    """Worker processes import a run's function by name and unpickle its arguments: refuse what
    they could not receive, naming the run."""
    for index, run in enumerate(runs):
        if isinstance(run, Task):
            function = run.function
            module = getattr(function, "__module__", None)
            name = getattr(function, "__qualname__", "")
            if executor == "processes" and (module in (None, "__main__") or "<" in name):
                raise TypeError(
                    f"runs[{index}].function must be importable by name in a worker process (defined at "
                    f"the top of a module, e.g. in qlab), got {_qualified_name(function)}: a lambda, a "
                    "nested function or one defined in a notebook cell cannot reach another process"
                )
        try:
            pickle.dumps(run)
        except Exception as err:
            raise TypeError(
                f"runs[{index}] must be picklable to reach a worker process, got {describe(run)}: "
                f"{type(err).__name__}: {err}"
            ) from None


def check_address(address: str | None) -> str | None:
    """A Ray cluster address: None (start a local cluster), "auto", "local", "host:port" or
    "ray://host:port"; a host:port must accept a connection (checked in 3 s), and "auto" must find a
    running cluster the way Ray will (``$RAY_ADDRESS``, the last ``ray start``, a running GCS)."""
    if address is None or address == "local":
        return address
    if address == "auto":
        _check_a_cluster_runs()
        return address
    if not isinstance(address, str):
        raise TypeError(
            f"address must be a Ray cluster address such as 'auto' or 'host:6379', got "
            f"{checks.shown(address)}"
        )
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be 'auto', 'host:port' or 'ray://host:port', got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            pass
    except OSError as err:
        raise ValueError(
            f"address {address!r}: no Ray cluster answers there ({err}); start one with `ray start --head` "
            "and pass the address it prints, or address=None for a local cluster"
        ) from None
    return address


def _check_a_cluster_runs() -> None:
    """ValueError unless Ray's own search for address "auto" finds a cluster (skipped where Ray is not
    installed, where run_many says so, or where this Ray version keeps the search elsewhere)."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return
    try:
        get_ray_address_from_environment("auto", None)
    except ConnectionError:
        raise ValueError(
            "address 'auto': no running Ray cluster found on this machine ($RAY_ADDRESS unset, no `ray "
            "start` recorded, no Ray process running); start one with `ray start --head`, or give its "
            "address as host:port"
        ) from None


# --- one run, wherever it executes -----------------------------------------------------------------


def _execute(run, threads: int):
    """Run one configuration with ``threads`` torch threads; the result as it crosses processes."""
    import torch

    from qlab.train.config import TrainConfig

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if isinstance(run, TrainConfig):
            from qlab.train import train

            result = train(run)
            result.model.to("cpu")
            return result
        return run.function(*run.args, **run.kwargs)
    finally:
        torch.set_num_threads(previous)


def _execute_reporting(run, threads: int):
    """``_execute`` that returns ("ok", result) or ("error", traceback text) instead of raising, so a
    failure crosses any process boundary as text."""
    try:
        return "ok", _execute(run, threads)
    except Exception:
        return "error", traceback.format_exc()


def _stop_worker(signum, frame):
    """SIGTERM from the parent stopping the pool: end the notebook kernels this worker started (a sweep
    point's, each with its own pool in its process group), then this worker, at once. Only a worker
    that ran a notebook has qlab.notebooks loaded; it is looked up, not imported (notebooks imports
    session, which imports runs)."""
    notebooks = sys.modules.get("qlab.notebooks")
    if notebooks is not None:
        notebooks.kill_kernels()
    os._exit(128 + signum)


def _stop_with_parent() -> None:
    """Ask Linux to send this worker SIGTERM when its parent dies (a SIGKILLed campaign, the OOM killer):
    else it idles forever, holding its memory and, on a GPU, its CUDA context. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nobody will send it
        os._exit(128 + signal.SIGTERM)


def _init_worker(gpus: list[str], counter) -> None:
    """Pool initializer: pin this worker to one GPU (round robin) before CUDA starts; let the parent
    handle Ctrl+C; on SIGTERM, stop with the kernels it started (``_stop_worker``). A worker's
    progress bars share a thread lock: tqdm's default, a multiprocessing lock, is a named semaphore
    that a worker stopped this way leaves behind ("leaked semaphore objects" at the parent's exit)."""
    import threading

    from tqdm import tqdm

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)
    _stop_with_parent()
    tqdm.set_lock(threading.RLock())
    if gpus:
        with counter.get_lock():
            slot = counter.value
            counter.value += 1
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]


# --- the cache -------------------------------------------------------------------------------------


def cache_key(run, threads: int) -> str:
    """sha256 of the run's configuration (every field; a Task's function name and arguments), its
    torch thread count and qlab's version."""
    import qlab

    _check_run("run", run)
    checks.integer("threads", threads, low=1, high=MAX_THREADS)
    if isinstance(run, Task):
        content = (_qualified_name(run.function), run.args, sorted(run.kwargs.items()))
    else:
        content = (type(run).__name__, sorted(vars(run).items()))
    blob = pickle.dumps((content, threads, qlab.__version__), protocol=4)
    return hashlib.sha256(blob).hexdigest()


def _cache_path(run, threads: int) -> Path:
    return paths.RUNS_DIR / CACHE_DIR_NAME / f"{cache_key(run, threads)}.pkl"


def _cache_load(run, threads: int):
    path = _cache_path(run, threads)
    if not path.is_file():
        return False, None
    try:
        return True, pickle.loads(path.read_bytes())
    except Exception:  # a torn or stale file: run again
        return False, None


def _cache_store(run, threads: int, result) -> None:
    path = _cache_path(run, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(pickle.dumps(result, protocol=4))
    os.replace(tmp, path)


# --- the entry point -------------------------------------------------------------------------------


def _gpus() -> list[str]:
    """The CUDA devices the workers may use, as CUDA_VISIBLE_DEVICES names them."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [name.strip() for name in visible.split(",") if name.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def plan(
    executor: str = "processes",
    max_workers: int | None = None,
    threads_per_run: int | None = None,
    runs_per_gpu: int | None = None,
) -> tuple[int, int, list[str]]:
    """(workers, torch threads per run, GPUs) that ``run_many`` uses for these arguments."""
    import torch

    checks.choice("executor", executor, EXECUTORS)
    if max_workers is not None:
        checks.integer("max_workers", max_workers, low=1)
    if threads_per_run is not None:
        checks.integer("threads_per_run", threads_per_run, low=1)
        if threads_per_run > MAX_THREADS:
            raise ValueError(
                f"threads_per_run must be at most {MAX_THREADS} (torch's limit), got {threads_per_run}"
            )
    if runs_per_gpu is not None:
        checks.integer("runs_per_gpu", runs_per_gpu, low=1)
    cores = usable_cores()
    gpus = _gpus() if executor != "serial" else []
    if executor == "serial":  # given max_workers, each run gets the threads it would get in that pool
        pool_share = max(1, cores // max_workers) if max_workers else torch.get_num_threads()
        threads = threads_per_run or pool_share
        return 1, threads, []
    if max_workers is None:
        max_workers = len(gpus) * (runs_per_gpu or RUNS_PER_GPU) if gpus else cores
    threads = threads_per_run or max(1, cores // max_workers)
    return max_workers, threads, gpus


def run_many(
    runs: Sequence,
    *,
    executor: str = "processes",
    max_workers: int | None = None,
    threads_per_run: int | None = None,
    runs_per_gpu: int | None = None,
    address: str | None = None,
    cache: bool | None = None,
    progress: bool = True,
    desc: str = "runs",
    on_result: Callable[[int, object], None] | None = None,
    estimated_seconds: float | None = None,
) -> list:
    """Run every configuration in ``runs`` and return their results in the same order.

    ``max_workers``: runs at once (default: usable cores, or ``runs_per_gpu`` × GPUs).
    ``threads_per_run``: torch threads each run uses (default: cores // workers; the serial
    executor: the same given ``max_workers``, else this process's).
    ``estimated_seconds``: what one run takes, where the caller knows it; a list whose serial time is
    below ``POOL_START_S`` then runs here one run after another (with the threads a worker would
    have, so the same bits) unless a warm pool is waiting, and says so.
    Raises :class:`RunsFailed` after every run has finished if any raised.
    """
    workers, threads, gpus = plan(executor, max_workers, threads_per_run, runs_per_gpu)  # checks them all
    if cache is None:  # a notebook's runs opt in from outside: QLAB_RUN_CACHE=1 qlab run 03
        cache = os.environ.get(CACHE_ENV, "0") == "1"
    checks.boolean("cache", cache)
    checks.boolean("progress", progress)
    if on_result is not None:
        checks.function("on_result", on_result, "called with (index, result) as each run finishes")
    if estimated_seconds is not None:
        checks.number("estimated_seconds", estimated_seconds, low=0)
    if not isinstance(desc, str):
        raise TypeError(f"desc must be a str (the progress bar's label), got {checks.shown(desc)}")
    runs = _check_runs(runs)
    if executor != "serial":
        _check_picklable(runs, executor)
    if executor == "ray":
        ray = _import_ray()
        address = check_address(address if address is not None else os.environ.get("RAY_ADDRESS"))
    elif address is not None:
        raise ValueError(f"address is for executor='ray', got executor={executor!r} with address={address!r}")

    from qlab.host import progress as progress_bar

    results: list = [None] * len(runs)
    failures: list[tuple[int, object, str]] = []
    pending = []
    for index, run in enumerate(runs):
        found, value = _cache_load(run, threads) if cache else (False, None)
        if found:
            results[index] = value
        else:
            pending.append(index)
    bar = progress_bar(total=len(runs), initial=len(runs) - len(pending), desc=desc, disable=not progress)

    def finish(index: int, status: str, value) -> None:
        if status == "ok":
            results[index] = value
            if cache:
                _cache_store(runs[index], threads, value)
            if on_result is not None:
                on_result(index, value)
        else:
            failures.append((index, runs[index], value))
        bar.update()

    short = (
        executor == "processes"
        and not gpus
        and estimated_seconds is not None
        and len(pending) > 1
        and _WARM_POOL.get("key") != (workers, ())
        and estimated_seconds * len(pending) < POOL_START_S
    )
    if short and progress:
        print(
            f"{len(pending)} runs of about {estimated_seconds:.1f} s: run here one after another (starting "
            f"worker processes takes about {POOL_START_S:.0f} s)"
        )
    try:
        if executor == "serial" or short or (executor == "processes" and len(pending) <= 1 and not gpus):
            for index in pending:
                finish(index, *_execute_reporting(runs[index], threads))
        elif executor == "processes":
            _run_processes(runs, pending, workers, threads, gpus, finish)
        else:
            _run_ray(ray, address, runs, pending, workers, threads, runs_per_gpu or RUNS_PER_GPU, finish)
    finally:
        bar.close()
    if failures:
        raise RunsFailed(sorted(failures, key=lambda f: f[0]), results)
    return results


_WARM_POOL: dict = {}  # {"key": (workers, gpus), "pool": ProcessPoolExecutor}: kept for the next call


def _pool(workers: int, gpus: list[str]) -> concurrent.futures.ProcessPoolExecutor:
    """The warm pool for these workers and GPUs, started if there is none (one pool at a time)."""
    key = (workers, tuple(gpus))
    if _WARM_POOL.get("key") != key:
        close_pools()
        context = multiprocessing.get_context("spawn")
        counter = context.Value("i", 0)
        _WARM_POOL["key"] = key
        _WARM_POOL["pool"] = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(gpus, counter)
        )
    return _WARM_POOL["pool"]


def close_pools() -> None:
    """Shut down the warm pool of worker processes, if any (the next ``run_many`` starts a new one)."""
    pool = _WARM_POOL.pop("pool", None)
    _WARM_POOL.clear()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


atexit.register(close_pools)


STOP_GRACE_S = 3.0  # how long a stopped worker may take to end its kernels before it is killed


def _kill_pool() -> None:
    """Stop the warm pool's workers now, runs in flight and all: after an interrupt, ``close_pools``
    would wait for every running run to finish. SIGTERM first (a worker ends the kernels it started),
    then SIGKILL for any still there after ``STOP_GRACE_S``. (Python 3.11's executor has no
    terminate_workers; its ``_processes`` maps pid to process.)"""
    pool = _WARM_POOL.pop("pool", None)
    _WARM_POOL.clear()
    if pool is None:
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    for process in workers:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def _run_processes(runs, pending, workers, threads, gpus, finish) -> None:
    pool = _pool(workers, gpus)
    finished = False
    try:
        try:
            futures = {pool.submit(_execute_reporting, runs[i], threads): i for i in pending}
        except concurrent.futures.process.BrokenProcessPool:  # a warm worker died while idle: start afresh
            close_pools()
            pool = _pool(workers, gpus)
            futures = {pool.submit(_execute_reporting, runs[i], threads): i for i in pending}
        broken = False
        for future in concurrent.futures.as_completed(futures):
            try:
                status, value = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                broken = True
                status, value = (
                    "error",
                    "a worker process died (killed, or out of memory) during this run or one beside it; "
                    "rerun with cache=True (a campaign: its next invocation) to redo the unfinished runs",
                )
            finish(futures[future], status, value)
        finished = not broken
    except KeyboardInterrupt:  # Ctrl-C, or qlab's SIGTERM: the runs in flight are lost either way
        _kill_pool()
        raise
    finally:
        if not finished:  # a worker died: the pool is not fit for the next call
            close_pools()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"executor='ray' needs the ray package: {RAY_INSTALL}") from None
    return ray


def _run_ray(ray, address, runs, pending, workers, threads, runs_per_gpu, finish) -> None:
    started_here = not ray.is_initialized()
    if started_here:
        options = {"address": address, "log_to_driver": False, "include_dashboard": False}
        if address is None:  # a local cluster: its workers import what this process imports
            options["num_cpus"] = workers * threads
            pythonpath = os.pathsep.join(entry for entry in sys.path if entry)
            options["runtime_env"] = {"env_vars": {"PYTHONPATH": pythonpath}}
        ray.init(**options)
    try:
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        remote = ray.remote(_execute_reporting).options(
            num_cpus=threads, num_gpus=(1 / runs_per_gpu) if has_gpus else 0, max_retries=0
        )
        refs = {remote.remote(runs[i], threads): i for i in pending}
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            for ref in done:
                try:
                    finish(refs[ref], *ray.get(ref))
                except Exception as err:  # the worker died: ray raises WorkerCrashedError and kin
                    finish(refs[ref], "error", f"the Ray worker running it died: {type(err).__name__}: {err}")
    finally:
        if started_here:
            ray.shutdown()
