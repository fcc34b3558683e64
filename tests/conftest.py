import os

# Under pytest-xdist the workers share the cores: each gets its share of torch threads (and so do the
# notebook kernels and worker processes it starts), since OpenMP threads spinning at a barrier while
# another process holds their core slow a step by up to 27× (benchmarks/timing.py).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads once)

os.environ.setdefault("MPLBACKEND", "Agg")

# Triton decides at import whether its kernels run on the interpreter, and torch.compile imports Triton
# too; without a GPU the interpreter is chosen here, before any test can import it (tests/test_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep ``--dist loadgroup``'s groups (the docs site's one build, one local Ray cluster at a time):
    pytest-xdist marks a grouped test by suffixing "@group" to its id, but writes ``item._nodeid``,
    which pytest 9.2 no longer reads (the id lives in ``item._id``), so every test ran alone."""
    if not getattr(config.option, "loadgroup", False):  # xdist sets it in each worker of a loadgroup run
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})  # fmt: skip
        if groups and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(autouse=True)
def _no_warm_pool_between_tests():
    """qlab.runs keeps its pool of worker processes warm for the next call; a test starts from none."""
    yield
    import sys

    runs = sys.modules.get("qlab.runs")
    if runs is not None:
        runs.close_pools()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """``smoke_run(notebook)``: the directory of the notebook's one shared smoke run (default
    parameters, its runs fanned out over 2 worker processes), made by whichever test asks first, in
    any pytest-xdist worker, and read by every test that needs it."""
    from filelock import FileLock
    from run_helpers import FAN_OUT, SMOKE_DONE, smoke_outputs

    from qlab import notebooks

    base = tmp_path_factory.getbasetemp()
    in_worker = "PYTEST_XDIST_WORKER" in os.environ  # then base is one worker's folder in the run's
    root = (base.parent if in_worker else base) / "shared-smoke-runs"
    root.mkdir(exist_ok=True)

    def get(notebook):
        notebook = notebooks.resolve_notebook(notebook)
        directory = root / notebook.stem
        with FileLock(str(root / f"{notebook.stem}.lock")):
            if not (directory / SMOKE_DONE).exists():
                fans_out = "executor" in notebooks.notebook_parameters(notebook)
                smoke_outputs(notebook, directory, root, FAN_OUT if fans_out else None)
                (directory / SMOKE_DONE).write_text("")
        return directory

    return get


_COMMITTED_RESULTS = ("data", "figures")  # what the notebooks' committed runs wrote; no test may touch it


def _results_snapshot() -> dict:
    from qlab import paths

    return {
        str(path.relative_to(paths.ROOT)): (path.stat().st_size, path.stat().st_mtime_ns)
        for folder in _COMMITTED_RESULTS
        for path in (paths.ROOT / folder).rglob("*")
        if path.is_file()
    }


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # once, in the process that reports (xdist's too)
        session.config._qlab_results = _results_snapshot()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the committed data/ or figures/ (a notebook run without a results folder
    of its own) fails the session, naming the files: a clean clone would not show it."""
    before = getattr(session.config, "_qlab_results", None)
    if before is None:
        return
    after = _results_snapshot()
    touched = sorted(name for name in after.keys() | before.keys() if after.get(name) != before.get(name))
    if touched:
        shown = ", ".join(touched[:10]) + (f" and {len(touched) - 10} more" if len(touched) > 10 else "")
        print(f"\nqlab: the tests wrote into the committed results: {shown}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
