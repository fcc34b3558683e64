"""Campaigns: a notebook's run list finished across many invocations, each run committed as plain files.

    qlab campaign 03 --profile paper --budget 9m     runs as many missing runs as fit in 9 minutes
    qlab campaign 03 --profile paper --status        done (per device kind), left, time left

Every finished run is written at once to its own folder under the store, ``data/<profile>/runs/``
(``data/runs/`` for the cpu profile; under the results folder of a smoke or interactive run):

    <key>/run.json       its configuration, device kind, machine, wall time, parameter count, and the
                         sha256 of each CSV
    <key>/metrics.csv    its training curve (qlab.train's metric rows)
    <key>/fidelity.csv   its gradient-fidelity rows

The folder is written under a temporary name and renamed in one step, so a campaign killed anywhere
(SIGKILL, the end of a GPU lease) loses at most the runs in flight, and the next invocation, on any
machine, continues. The files are plain data (never pickle) and are committed.

``key`` hashes the run's whole configuration (every TrainConfig field but ``device`` and ``progress``,
which the device kind and nothing respectively stand for), its device kind (the GPU's name, or the
CPU's model and torch threads: what changes a run's bits) and ``NUMERICS_VERSION`` — not the commit, so
a documentation change does not invalidate results. A notebook reads its runs through
:func:`results`, trained now or stored earlier alike, so a list finished over several invocations gives
the same CSVs, claims and figures as one run that trained everything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from qlab import checks, paths

NUMERICS_VERSION = "1"  # bump when a change alters what a training run computes: stored runs then retire
STORE_DIR_NAME = "runs"
_UNKEYED_FIELDS = ("device", "progress")  # the device kind keys the device; progress changes no number
_KEY_LENGTH = 20  # hex digits of sha256 in a run's folder name


class StoreError(ValueError):
    """A stored run that cannot be trusted: unreadable, or its files do not match its key."""


@dataclass(frozen=True)
class StoredRun:
    """One finished run as the store keeps it: what a notebook reads."""

    key: str
    config: object  # TrainConfig
    device_kind: str
    machine: str
    seconds: float
    parameters: int  # trainable parameters of the model
    metrics: pd.DataFrame
    fidelity: pd.DataFrame
    path: Path


# --- keys ------------------------------------------------------------------------------------------


def config_fields(config) -> dict:
    """The configuration as the key sees it: every TrainConfig field but device and progress."""
    from qlab.train.config import TrainConfig

    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {checks.shown(config)}")
    return {name: value for name, value in vars(config).items() if name not in _UNKEYED_FIELDS}


_KEY = re.compile(f"[0-9a-f]{{{_KEY_LENGTH}}}")  # a stored run's folder name


def _digest(content: dict) -> str:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:_KEY_LENGTH]


def config_key(config) -> str:
    """The run's identity whatever machine runs it: its configuration and the numerics version."""
    return _digest({"config": config_fields(config), "numerics": NUMERICS_VERSION})


def run_key(config, device_kind: str) -> str:
    """The name of the run's folder: its configuration, device kind and the numerics version."""
    if not isinstance(device_kind, str) or not device_kind:
        raise TypeError(f"device_kind must be a non-empty str, got {checks.shown(device_kind)}")
    return _digest(
        {"config": config_fields(config), "device_kind": device_kind, "numerics": NUMERICS_VERSION}
    )


def device_kind(device) -> str:
    """What changes a run's bits about where it runs: the GPU's name, or the CPU's model and torch threads."""
    import torch

    from qlab.host import cpu_name, resolve_device

    device = resolve_device(device, argument="device")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} torch threads"


# --- one run, in a worker --------------------------------------------------------------------------


def train_for_store(config) -> dict:
    """Train ``config`` (in whatever process runs it) and return what the store keeps, as plain data."""
    import torch

    from qlab.host import machine
    from qlab.train import train
    from qlab.train.models import parameter_count

    started = time.perf_counter()
    result = train(config)
    return {
        "metrics": result.metrics,
        "fidelity": result.fidelity,
        "seconds": float(result.seconds),
        "task_seconds": time.perf_counter() - started,  # the run as a worker spends it: model, data, training
        "parameters": int(parameter_count(result.model)),
        "device_kind": device_kind(config.device),
        "machine": machine(config.device),
        "torch": torch.__version__,
    }


# --- the store -------------------------------------------------------------------------------------


RUN_NEUTRAL = ("executor", "max_workers", "allow_mixed_devices")  # parameters that change no run's numbers


def store_dir(run_list=None) -> Path:
    """Where runs are stored: ``data/[<profile>/]runs/`` of the current results folder — or, for a run
    list whose parameters differ from the notebook's defaults only in how runs fan out
    (``RUN_NEUTRAL``) or the profile, the committed store of the repository, which the default
    parameters read too (its keys tell runs apart, so any list may share it)."""
    if run_list is not None and run_list.notebook in _notebook_names():
        from qlab import session

        defaults = session.notebook_defaults(run_list.notebook)
        changed = session.changed_parameters(run_list.given, defaults)
        if set(changed) <= set(RUN_NEUTRAL):
            profile = run_list.given.get("profile", "cpu")
            return paths.ROOT / "data" / ("" if profile == "cpu" else profile) / STORE_DIR_NAME
    return paths.data_dir() / STORE_DIR_NAME


def _notebook_names() -> set[str]:
    from qlab.run_lists import RUN_LISTS

    return set(RUN_LISTS)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_run(store: Path, config, record: dict) -> Path:
    """Write one finished run into ``store`` (a folder renamed into place in one step); its path."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    key = run_key(config, record["device_kind"])
    final = store / key
    tmp = store / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        record["metrics"].drop(columns="time_s", errors="ignore").to_csv(tmp / "metrics.csv", index=False)
        record["fidelity"].to_csv(tmp / "fidelity.csv", index=False)
        description = {
            "key": key,
            "config_key": config_key(config),
            "numerics": NUMERICS_VERSION,
            "config": config_fields(config),
            "device": config.device,
            "device_kind": record["device_kind"],
            "machine": record["machine"],
            "torch": record["torch"],
            "seconds": round(record["seconds"], 3),
            "task_seconds": round(record.get("task_seconds", record["seconds"]), 3),
            "runs_at_once": record.get("runs_at_once", 1),  # what task_seconds was measured beside
            "parameters": record["parameters"],
            "sha256": {name: _sha256(tmp / name) for name in ("metrics.csv", "fidelity.csv")},
        }
        (tmp / "run.json").write_text(json.dumps(description, indent=1, sort_keys=True) + "\n")
        for name in ("metrics.csv", "fidelity.csv", "run.json"):  # on disk before the folder is named
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
        old = store / f".{key}.{os.getpid()}.old"
        if final.exists():  # the same run again (a retried one): moved aside, so a kill leaves one whole
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError as error:  # another process stored the same run in between: a whole one is kept
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            _checked(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store / f".{key}.{os.getpid()}.old", ignore_errors=True)
    return final


def _remove_stale_temporaries(store: Path) -> None:
    """Remove the temporary folders (``.<key>.<pid>.tmp``/``.old``) of writers that are no longer
    running: what a run killed while being written leaves."""
    for folder in Path(store).glob(".*.*.*"):
        parts = folder.name.split(".")
        if len(parts) != 4 or parts[3] not in ("tmp", "old") or not parts[2].isdigit():
            continue
        if not _alive(int(parts[2])):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@contextlib.contextmanager
def _store_lock(store: Path):
    """Hold ``store``'s campaign lock for the block, or refuse: two campaigns on one store would train
    every missing run twice. Also checks, before any run starts, that the store can be written."""
    store = Path(store)
    try:
        store.mkdir(parents=True, exist_ok=True)
        handle = open(store / ".campaign.lock", "a+")
    except OSError as error:
        raise ValueError(f"the store {paths.shown(store)} cannot be written: {error.strerror}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"another campaign is running on {paths.shown(store)}: wait for it, or give this one "
                "another list"
            ) from None
        try:
            probe = store / f".probe.{os.getpid()}.tmp"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as error:
            raise ValueError(f"the store {paths.shown(store)} cannot be written: {error.strerror}") from None
        _remove_stale_temporaries(store)
        try:
            yield
        finally:
            (store / ".campaign.lock").unlink(missing_ok=True)  # still held: the store is left as found


def _checked(folder: Path) -> tuple[dict, object]:
    """(run.json's content, its TrainConfig) of the stored run in ``folder``, every file checked without
    parsing the CSVs: StoreError naming the folder as ``read_run`` documents."""
    from qlab.train.config import TrainConfig

    shown = paths.shown(folder)
    again = "delete the folder to run it again"
    try:
        description = json.loads((folder / "run.json").read_text(), parse_constant=_no_constant)
        config = TrainConfig(**description["config"], device=description["device"])
        kind = description["device_kind"]
        for name in ("seconds", "task_seconds"):
            if name in description:  # a time divides budgets and estimates: a positive number of seconds
                checks.number(name, description[name], low=0, open_low=True)
        int(description["parameters"])
        if "runs_at_once" in description:
            checks.integer("runs_at_once", description["runs_at_once"], low=1)
        hashes = dict(description["sha256"])
        key = run_key(config, kind)
    except FileNotFoundError:
        raise StoreError(f"stored run {shown}: run.json is missing ({again})") from None
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise StoreError(
            f"stored run {shown}: run.json is corrupt ({type(err).__name__}: {err}); {again}"
        ) from None
    if key != folder.name:
        raise StoreError(
            f"stored run {shown}: its configuration hashes to {key}, not to its folder's "
            f"name (a file edited by hand, or copied under another name); {again}"
        )
    for name in ("metrics.csv", "fidelity.csv"):
        if not (folder / name).is_file() or _sha256(folder / name) != hashes.get(name):
            raise StoreError(
                f"stored run {shown}: {name} is missing or does not match its sha256 in run.json (a torn or "
                f"edited file); {again}"
            )
    return description, config


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_run(folder: Path) -> StoredRun:
    """The stored run in ``folder``, checked: StoreError naming the folder when a file is missing or
    corrupt, or when its configuration does not hash to its name."""
    folder = Path(folder)
    description, config = _checked(folder)
    read = {"float_precision": "round_trip", "keep_default_na": True}
    metrics = pd.read_csv(folder / "metrics.csv", **read)
    fidelity_path = folder / "fidelity.csv"
    fidelity = pd.read_csv(fidelity_path, **read) if fidelity_path.stat().st_size > 1 else pd.DataFrame()
    return StoredRun(
        key=folder.name, config=config, device_kind=description["device_kind"],
        machine=description.get("machine", "?"), seconds=float(description["seconds"]),
        parameters=int(description["parameters"]),
        metrics=metrics, fidelity=fidelity, path=folder,
    )  # fmt: skip


def _index(store: Path) -> tuple[dict[str, list[tuple[Path, dict]]], int]:
    """({config key: [(run folder, its run.json) of the current numerics version]}, runs of other numerics
    versions), every stored run checked as ``read_run`` checks it."""
    found: dict[str, list[tuple[Path, dict]]] = {}
    retired = 0
    if not Path(store).is_dir():
        return found, 0
    for folder in sorted(Path(store).iterdir()):
        if not _KEY.fullmatch(folder.name) or not folder.is_dir():
            continue  # a temporary folder of a run being written, or nothing of the store's
        try:
            numerics = json.loads((folder / "run.json").read_text()).get("numerics", NUMERICS_VERSION)
        except (OSError, ValueError, AttributeError):
            numerics = NUMERICS_VERSION  # read_run names what is wrong with it
        if numerics != NUMERICS_VERSION:
            retired += 1
            continue
        description, config = _checked(folder)
        found.setdefault(config_key(config), []).append((folder, description))
    return found, retired


@dataclass(frozen=True)
class Progress:
    """Where a run list stands in a store: the stored folder chosen for each run (None: not yet run)."""

    run_list: object
    chosen: list  # per run: its folder, or None
    kinds: Counter  # device kind -> runs of the list stored from it
    retired: int  # stored runs of another numerics version, which no list uses
    seconds: dict  # device kind -> mean wall time of one stored run, seconds
    at_once: dict  # device kind -> the most runs at once its stored runs ran beside (where recorded)

    @property
    def done(self) -> int:
        return sum(folder is not None for folder in self.chosen)

    @property
    def missing(self) -> list[int]:
        return [i for i, folder in enumerate(self.chosen) if folder is None]

    @property
    def complete(self) -> bool:
        return self.done == len(self.chosen)


def progress(run_list, store: Path | None = None) -> Progress:
    """Which runs of ``run_list`` the store holds (every stored file checked first). Where a run is
    stored from several device kinds, the kind that holds most of the list is chosen."""
    store = store_dir(run_list) if store is None else Path(store)
    found, retired = _index(store)
    candidates = [[f for f, _ in found.get(config_key(config), [])] for config in run_list.configs]
    kinds_of = {folder: description for runs in found.values() for folder, description in runs}
    coverage = Counter(kind for fs in candidates for kind in {kinds_of[f]["device_kind"] for f in fs})
    chosen = []
    for folders in candidates:
        if not folders:
            chosen.append(None)
            continue
        ranked = sorted(
            folders, key=lambda f: (-coverage[kinds_of[f]["device_kind"]], kinds_of[f]["device_kind"])
        )
        chosen.append(ranked[0])
    kinds = Counter(kinds_of[f]["device_kind"] for f in chosen if f is not None)
    seconds = {}
    for kind in kinds:
        times = [
            kinds_of[f].get("task_seconds", kinds_of[f]["seconds"])
            for f in chosen
            if f is not None and kinds_of[f]["device_kind"] == kind
        ]
        seconds[kind] = sum(times) / len(times)
    at_once = {}
    for f in chosen:
        if f is not None and "runs_at_once" in kinds_of[f]:
            kind = kinds_of[f]["device_kind"]
            at_once[kind] = max(at_once.get(kind, 1), int(kinds_of[f]["runs_at_once"]))
    return Progress(run_list, chosen, kinds, retired, seconds, at_once)


# --- what a notebook calls --------------------------------------------------------------------------


def results(
    run_list,
    *,
    executor: str = "processes",
    max_workers: int | None = None,
    address: str | None = None,
    allow_mixed_devices: bool = False,
    store: Path | None = None,
) -> list[StoredRun]:
    """Every run of ``run_list``, read from the store: the stored ones as they are, the missing ones
    trained now (through ``qlab.runs.run_many``) and written there as each finishes.

    Refuses (ValueError) runs from more than one device kind unless ``allow_mixed_devices``.
    """
    checks.boolean("allow_mixed_devices", allow_mixed_devices)
    store = store_dir(run_list) if store is None else Path(store)
    before = progress(run_list, store)
    _check_kinds(before, allow_mixed_devices)
    _check_this_machine(before, planned_kind(run_list, executor, max_workers), allow_mixed_devices)
    missing = before.missing
    if before.done:
        print(f"{before.done} of {len(run_list)} runs read from {paths.shown(store)} (stored earlier)")
    if missing:
        with _store_lock(store):
            _train(run_list, missing, store, executor=executor, max_workers=max_workers, address=address,
                   estimate=_estimate(before, planned_kind(run_list, executor, max_workers)))  # fmt: skip
    after = progress(run_list, store)
    if not after.complete:  # a run stored under another numerics version or key: should not happen
        raise StoreError(
            f"{len(after.missing)} runs are missing from {paths.shown(store)} after training them"
        )
    _check_kinds(after, allow_mixed_devices)
    if len(after.kinds) > 1:
        print(f"runs from {len(after.kinds)} device kinds (allow_mixed_devices=True): {dict(after.kinds)}")
    return [read_run(folder) for folder in after.chosen]


def _kinds_listed(state: Progress) -> str:
    return "; ".join(f"{count} from {kind}" for kind, count in sorted(state.kinds.items()))


def _check_kinds(state: Progress, allow_mixed_devices: bool) -> None:
    if len(state.kinds) > 1 and not allow_mixed_devices:
        raise ValueError(
            f"the stored runs of {state.run_list.notebook} come from {len(state.kinds)} device kinds "
            f"({_kinds_listed(state)}); set allow_mixed_devices=True to render them together (the "
            "notebook says so), or delete one kind's folders and run them again"
        )


def planned_kind(run_list, executor: str, max_workers: int | None = None, runs_per_gpu: int | None = None):
    """The device kind the runs of ``run_list`` get on this machine with these settings (None with Ray,
    where the cluster decides): its GPU's name, or its CPU's and the threads a pool worker gets — the
    serial executor runs with the same threads, so both store the same kind."""
    from qlab.host import cpu_name, resolve_device
    from qlab.runs import plan

    if executor == "ray" or not run_list.configs:
        return None
    device = resolve_device(run_list.configs[0].device, argument="device")
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {plan('processes', max_workers, None, runs_per_gpu)[1]} torch threads"


def _check_this_machine(state: Progress, kind: str | None, allow_mixed_devices: bool) -> None:
    """Refuse, before any run starts, to add runs of another device kind than those stored."""
    if kind is None or not state.missing or not state.kinds or kind in state.kinds or allow_mixed_devices:
        return
    raise ValueError(
        f"the stored runs of {state.run_list.notebook} come from another device kind "
        f"({_kinds_listed(state)}); here the {len(state.missing)} missing runs would run as {kind!r} and "
        "the list would mix device kinds. Run them where the others ran, or allow it "
        "(allow_mixed_devices=True, qlab campaign --allow-mixed-devices; the notebook then says which "
        "kinds it read)"
    )


def _train(
    run_list, indices, store, *, executor, max_workers, address, runs_per_gpu=None, estimate=None
) -> None:
    from qlab.runs import plan, run_many, task

    # the same torch threads whatever the executor (serial included), so the same device kind and bits
    threads = None if executor == "ray" else plan("processes", max_workers, None, runs_per_gpu)[1]

    workers = plan(executor, max_workers, None, runs_per_gpu)[0]

    def store_one(position: int, record: dict) -> None:
        runs_at_once = min(workers, len(indices))
        write_run(store, run_list.configs[indices[position]], {**record, "runs_at_once": runs_at_once})

    run_many(
        [task(train_for_store, run_list.configs[i]) for i in indices],
        executor=executor, max_workers=max_workers, address=address, runs_per_gpu=runs_per_gpu,
        threads_per_run=threads, desc="training runs", on_result=store_one, cache=False,
        estimated_seconds=estimate,
    )  # fmt: skip


# --- what qlab campaign calls ----------------------------------------------------------------------

_BUDGET = re.compile(
    r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(s|m|h)?"
)  # signed: -5m is "not > 0"


def parse_budget(budget) -> float:
    """A time budget (a str) as seconds: "90s", "12m", "1.5h", or a bare number of seconds; it must be > 0."""
    if not isinstance(budget, str):
        raise TypeError(
            f"budget must be a duration such as '12m', '90s' or '1.5h', got {checks.shown(budget)}"
        )
    match = _BUDGET.fullmatch(str(budget).strip())
    if not match:
        raise ValueError(f"budget must be a duration such as '12m', '90s' or '1.5h', got {budget!r}")
    seconds = float(match[1]) * {"s": 1, None: 1, "m": 60, "h": 3600}[match[2]]
    if not (0 < seconds < math.inf):
        raise ValueError(f"budget must be more than 0 seconds and finite, got {budget!r}")
    return seconds


def run_campaign(
    run_list,
    *,
    budget_s: float | None = None,
    max_runs: int | None = None,
    executor: str = "processes",
    max_workers: int | None = None,
    runs_per_gpu: int | None = None,
    address: str | None = None,
    allow_mixed_devices: bool = False,
    store: Path | None = None,
    say=print,
) -> Progress:
    """Run missing runs of ``run_list`` into the store: at most ``max_runs``, and no more than fit in
    ``budget_s`` seconds (a new wave starts only when the measured time of one run still fits). With a
    budget, runs go out one round (``workers`` runs) at a time, each round's wall time checking the
    estimate before the next; without one, all at once. A run's time is the mean wall time of the
    stored runs of this machine's device kind (none stored: the first wave is one run per worker), plus
    the pool's start-up (``qlab.runs.POOL_START_S``) before the first wave. Refuses, before any run
    starts, to add runs of another device kind than those stored unless ``allow_mixed_devices``, and
    a store another campaign holds or that cannot be written. Returns where the list stands afterwards."""
    from qlab.runs import plan

    if budget_s is not None:
        checks.number("budget_s", budget_s, low=0)
        if budget_s <= 0:
            raise ValueError(f"budget_s must be more than 0 seconds, got {budget_s}")
    if max_runs is not None:
        checks.integer("max_runs", max_runs, low=1)
    checks.boolean("allow_mixed_devices", allow_mixed_devices)
    store = store_dir(run_list) if store is None else Path(store)
    workers = plan(executor, max_workers, None, runs_per_gpu)[0]
    kind = planned_kind(run_list, executor, max_workers, runs_per_gpu)
    started = time.monotonic()
    state = progress(run_list, store)
    _check_kinds(state, allow_mixed_devices)
    _check_this_machine(state, kind, allow_mixed_devices)
    say(_status_line(state, store))
    if not state.missing:
        return state
    with _store_lock(store):
        return _run_waves(run_list, state, store, started, budget_s, max_runs, executor, max_workers,
                          runs_per_gpu, address, workers, kind, say)  # fmt: skip


def _run_waves(run_list, state, store, started, budget_s, max_runs, executor, max_workers, runs_per_gpu,
               address, workers, kind, say) -> Progress:  # fmt: skip
    """``run_campaign``'s waves, holding the store's lock."""
    from qlab.runs import POOL_START_S, RunsFailed

    done_at_start = state.done
    state, ran = progress(run_list, store), 0  # as it is now this campaign holds the store
    per_round = None  # wall seconds per round of workers measured in this invocation (pool start-up included)
    while state.missing and (max_runs is None or ran < max_runs):
        left = None if budget_s is None else budget_s - (time.monotonic() - started)
        estimate, measured_by = _estimate(state, kind), "the mean of the stored runs"
        if per_round is not None and (estimate is None or per_round > estimate):
            estimate, measured_by = per_round, "the last wave's wall time per round"
        start_up = POOL_START_S if per_round is None and executor == "processes" else 0.0
        count = len(state.missing) if max_runs is None else min(len(state.missing), max_runs - ran)
        if left is not None:
            if estimate is None:
                count = min(count, workers)
                say(f"no run of this list timed yet: starting {count} (one per worker) to time them")
            else:
                rounds = math.floor((left - start_up) / estimate)
                if rounds < 1:
                    say(f"{left:.0f} s left, one run takes about {estimate:.0f} s: no new run started")
                    break
                # one round at a time: the stored times may come from another number of runs at once,
                # and this wave's own time per round then checks the estimate before the next
                count = min(count, workers)
                say(
                    f"one run takes about {estimate:.0f} s ({measured_by}"
                    + (f", after {start_up:.0f} s to start the workers" if start_up else "")
                    + f"); {left:.0f} s left: starting {count} on {workers} workers"
                )
        wave_started = time.monotonic()
        try:
            _train(run_list, state.missing[:count], store, executor=executor, max_workers=max_workers,
                   address=address, runs_per_gpu=runs_per_gpu, estimate=_estimate(state, kind))  # fmt: skip
        except RunsFailed as failed:
            say(f"{len(failed.failures)} runs failed; the next invocation tries them again:\n{failed}")
            state = progress(run_list, store)
            break
        per_round = (time.monotonic() - wave_started) / math.ceil(count / workers)
        ran += count
        state = progress(run_list, store)
    if state.done != done_at_start:  # else the line said at the start still holds
        say(_status_line(state, store))
    return state


def _estimate(state: Progress, kind: str | None = None) -> float | None:
    """Seconds one run takes: the mean wall time of the stored runs of device kind ``kind`` (None when
    that kind has none: another kind's times say nothing of this one's), or of all stored runs when
    ``kind`` is None; None before any."""
    if kind is not None or not state.done:
        return state.seconds.get(kind)
    total = sum(state.seconds[name] * count for name, count in state.kinds.items())
    return total / state.done


def _status_line(state: Progress, store: Path) -> str:
    total = len(state.chosen)
    line = f"{state.run_list.notebook}: {state.done} of {total} runs stored in {paths.shown(store)}"
    if state.kinds:
        line += " (" + "; ".join(f"{n} from {kind}" for kind, n in sorted(state.kinds.items())) + ")"
    return line


def render_command(run_list, output=None) -> str:
    """The ``qlab run`` command that renders ``run_list``'s notebook from the store its runs went to:
    the notebook's number, ``--profile``, ``--smoke``, every other parameter given that differs from the
    notebook's default as ``-p NAME VALUE`` (an executor too: it names the results folder), and
    ``--output`` where the campaign was given one."""
    import shlex

    from qlab import session

    given = dict(run_list.given)
    changed = session.changed_parameters(given, session.notebook_defaults(run_list.notebook))
    words = ["qlab", "run", run_list.notebook[:2]]
    if given.get("profile", "cpu") != "cpu":
        words += ["--profile", str(given["profile"])]
    if changed.pop("smoke", False):
        words.append("--smoke")
    for name, value in changed.items():
        words += ["-p", name, shlex.quote(checks.yaml_text(value))]
    if output is not None:
        words += ["--output", shlex.quote(str(output))]
    return " ".join(words)


def status(run_list, store: Path | None = None, workers: int | None = None, output=None) -> str:
    """Lines saying how many runs are done per device kind, how many remain, and the time left at the
    measured rate (device-hours: one run's mean time × the runs left ÷ the runs at once); once all are
    done, the command that renders the notebook from them (``render_command``)."""
    store = store_dir(run_list) if store is None else Path(store)
    state = progress(run_list, store)
    lines = [_status_line(state, store)]
    for kind, count in sorted(state.kinds.items()):
        lines.append(f"  {kind}: {count} runs, {state.seconds[kind]:.1f} s each on average")
    left = len(state.missing)
    if left == 0:
        lines.append(f"  complete: `{render_command(run_list, output)}` renders it from the store")
    elif state.done:
        hours = left * _estimate(state) / 3600
        main_kind = state.kinds.most_common(1)[0][0]
        recorded = state.at_once.get(main_kind)
        at_once = recorded or workers  # as the stored runs ran; else as this machine would run them
        at_once = (
            f" ÷ {at_once} at once{' as stored' if recorded else ' here'} = {hours / at_once:.2f} h of "
            "device time"
            if at_once
            else ""
        )
        lines.append(f"  {left} runs left: {hours:.2f} run-hours at the measured rate{at_once}")
    else:
        lines.append(f"  {left} runs left; none measured yet")
    if state.retired:
        lines.append(f"  {state.retired} stored runs of another numerics version are not used")
    return "\n".join(lines)
