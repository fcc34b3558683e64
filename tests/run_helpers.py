"""Functions the executor tests run in worker processes (importable by name from tests/), and the
reading of a notebook's smoke run that several test files share."""

import os
import time
from pathlib import Path

import torch


def noisy_matmul(seed: int, size: int = 64) -> torch.Tensor:
    """A result that depends on the thread count's summation order only through torch's kernels."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=generator)
    return (a @ a.T).sum(dim=0)


def fail_on(value: int, bad: int) -> int:
    if value == bad:
        raise ValueError(f"run {value} fails on purpose")
    return value * value


def square_then_mark(value: int, folder: str) -> int:
    """value squared, after leaving folder/done: a test waits for it before killing another worker."""
    Path(folder, "done").write_text("")
    return value * value


def threads() -> int:
    return torch.get_num_threads()


def pid_then_sleep(folder: str, seconds: float) -> int:
    """Open a progress bar (as a training run does), write this worker's pid to folder/<pid>, then
    sleep: the test kills it meanwhile."""
    from qlab.host import progress

    with progress(total=1, disable=True):
        Path(folder, str(os.getpid())).write_text("")
        time.sleep(seconds)
    return os.getpid()


def hide_module(monkeypatch, hidden: str) -> None:
    """Make ``import hidden`` raise ImportError for the rest of the test, as where it is not installed."""
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name == hidden:
            raise ImportError(f"No module named {hidden!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)


SMOKE_DONE = ".smoke-done"  # in a smoke run's folder once the run has finished
FAN_OUT = {"executor": "processes", "max_workers": 2}  # a fanning-out notebook's shared smoke run


def smoke_outputs(notebook, results_dir: Path, tmp_path: Path | None = None, parameters=None) -> dict:
    """{path relative to ``results_dir``: bytes} of every file the notebook's smoke run wrote there,
    running it first (its executed copy into ``tmp_path``) unless the folder holds a finished run."""
    from qlab import notebooks

    if not (results_dir / SMOKE_DONE).exists():
        output = (tmp_path or results_dir) / f"{Path(notebook).stem}.ipynb"
        result = notebooks.run_notebook(
            notebook, parameters, smoke=True, output=output, results_dir=results_dir
        )
        assert result.output.exists()
    return {
        p.relative_to(results_dir): p.read_bytes()
        for p in sorted(results_dir.rglob("*"))
        if p.is_file() and p.name != SMOKE_DONE and p.suffix != ".ipynb"
    }


def outliving(pids, seconds: float = 10.0) -> list[int]:
    """Those of ``pids`` still running (not gone, not zombies) after up to ``seconds``; they are then
    SIGKILLed, so that a failing test leaves nothing behind."""
    import signal

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive
