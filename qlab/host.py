"""What this process runs on and how it reports: the device a name resolves to, a one-line name
for the machine results come from, whether a runner without a browser drives it, and progress bars
(a widget in JupyterLab, text elsewhere). Training, the run fan-out and the notebooks all use it;
it imports nothing from qlab but ``checks`` and ``paths``."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

import torch

from qlab import checks, paths


def resolve_device(name: str | torch.device = "auto", *, argument: str = "name") -> torch.device:
    """``"auto"``: CUDA when torch sees a GPU, else the CPU; otherwise ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"`` (a GPU torch sees: N below ``torch.cuda.device_count()``), checked; any other device
    type (mps, xpu, meta, ...) or a CPU index other than 0 is refused; ``"cpu:0"`` comes back as
    ``cpu`` (errors name ``argument``)."""
    accepted = "'auto', 'cpu', 'cuda' or 'cuda:N'"
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a device: {accepted}, got {checks.shown(name)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {argument}={name!r}; expected {accepted}") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        shown = "the CPU is 'cpu'" if device.type == "cpu" else f"device type {device.type!r}"
        raise ValueError(f"{argument} must be a device qlab runs on: {accepted}, got {name!r} ({shown})")
    if device.type == "cpu":
        return torch.device("cpu")  # 'cpu:0' is the one CPU device, named as everywhere else
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{argument} {name!r} was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(
            f"{argument} must be {accepted} with N below the {count} CUDA device{'s' * (count != 1)} torch "
            f"sees (cuda:0 … cuda:{count - 1}), got {name!r}"
        )
    return device


def machine(device: torch.device | None = None) -> str:
    """One line naming the machine results come from: the GPU's name, or the CPU, its cores and threads."""
    if device is not None:
        device = resolve_device(device, argument="device")
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (
        f"{cpu_name()} ({os.cpu_count()} cores), {torch.get_num_threads()} threads, torch {torch.__version__}"
    )


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def headless() -> bool:
    """Whether a runner without a browser (papermill through qlab) executes this process."""
    return os.environ.get(paths.HEADLESS_ENV) == "1"


def _check_progress_options(iterable, options: dict) -> None:
    """The iterable and the options qlab passes to tqdm, checked before tqdm sees them."""
    if iterable is not None and not isinstance(iterable, Iterable):
        raise TypeError(
            f"iterable must be an iterable (a list, a range, ...) or None, got {checks.shown(iterable)}"
        )
    for name in ("desc", "unit"):
        if options.get(name) is not None and not isinstance(options[name], str):
            raise TypeError(f"{name} must be a str, got {checks.shown(options[name])}")
    for name in ("total", "initial"):
        if options.get(name) is not None:
            checks.integer(name, options[name], low=0)
    for name in ("leave", "disable"):
        if options.get(name) is not None:
            checks.boolean(name, options[name])
    if options.get("mininterval") is not None:
        checks.number("mininterval", options["mininterval"], low=0)


def progress(iterable=None, **options):
    """A tqdm progress bar: a widget in JupyterLab, text under papermill and in a terminal
    (``options`` go to tqdm: desc, total, leave, disable, ...)."""
    _check_progress_options(iterable, options)
    if not headless():
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
                import ipywidgets  # noqa: F401  (tqdm.notebook needs it)
                from tqdm.notebook import tqdm

                return tqdm(iterable, **options)
        except ImportError:
            pass
    from tqdm import tqdm

    options.setdefault("mininterval", 5.0 if headless() else 0.1)
    return tqdm(iterable, **options)
