"""qlab.runs: many runs at once give the serial results, bit for bit, in input order.

The Ray tests start a real local Ray cluster (no mock); they skip, naming the install command, where
the ray package cannot be imported.
"""

import os
import pickle
import signal
import sys
import threading
import time

import pytest
import run_helpers
import torch

from qlab import runs
from qlab.runs import RunsFailed, Task, check_address, run_many, task
from qlab.train import TrainConfig

TINY = TrainConfig(
    steps=4, layers=1, width=32, context=32, batch_size=8, eval_every=2, eval_batches=1, fidelity_every=2,
    warmup_steps=2, progress=False,
)  # fmt: skip

try:
    import ray
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason=f"the ray package is not installed: {runs.RAY_INSTALL}")


def _same_train_results(a, b):
    assert a.metrics.drop(columns="time_s").equals(b.metrics.drop(columns="time_s"))
    assert a.fidelity.equals(b.fidelity)
    for (name, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), name


def test_processes_give_the_serial_bits_for_training_runs():
    # stochastic rounding (nvfp4) and a float32 reference both: every draw and every sum must match
    configs = [TINY.replace(recipe="nvfp4", seed=0), TINY.replace(recipe="fp32", seed=1)]
    serial = run_many(configs, executor="serial", threads_per_run=1, progress=False)
    parallel = run_many(configs, executor="processes", max_workers=2, progress=False)
    assert len(parallel) == 2
    for a, b in zip(serial, parallel):
        _same_train_results(a, b)
    assert serial[0].metrics.train_loss.iloc[-1] != serial[1].metrics.train_loss.iloc[-1]  # the order held


def test_tasks_come_back_in_input_order_with_the_thread_count_asked_for():
    values = list(range(7))
    assert run_many([task(run_helpers.fail_on, v, -1) for v in values], max_workers=2, progress=False) == [
        v * v for v in values
    ]
    assert run_many([task(run_helpers.threads)] * 2, max_workers=2, threads_per_run=1, progress=False) == [
        1,
        1,
    ]
    before = torch.get_num_threads()
    assert run_many([task(run_helpers.threads)], executor="serial", threads_per_run=1, progress=False) == [1]
    assert torch.get_num_threads() == before  # the serial executor restores the thread count


def test_a_failing_run_is_named_after_the_others_finish():
    with pytest.raises(RunsFailed) as caught:
        run_many([task(run_helpers.fail_on, v, 2) for v in range(4)], max_workers=2, progress=False)
    assert caught.value.results == [0, 1, None, 9]
    assert [index for index, _, _ in caught.value.failures] == [2]
    assert "fail_on(2, 2)" in str(caught.value) and "ValueError: run 2 fails on purpose" in str(caught.value)


def test_a_failing_training_run_names_its_configuration():
    bad = TINY.replace(nproc=2, seed=5)  # valid, but refused at run time: one process was launched
    with pytest.raises(RunsFailed, match=r"nproc=2,.*seed=5\)\n.*config.nproc=2 but 1 processes") as caught:
        run_many([TINY, bad], executor="serial", progress=False)
    assert caught.value.results[0] is not None and caught.value.results[1] is None


def test_a_killed_worker_fails_its_run_and_keeps_the_finished_ones(tmp_path):
    killed = _kill_first_pid_in(tmp_path)
    runs_ = [
        task(run_helpers.square_then_mark, 3, str(tmp_path)),
        task(run_helpers.pid_then_sleep, str(tmp_path), 60),
    ]
    with pytest.raises(RunsFailed, match="worker process died") as caught:
        run_many(runs_, max_workers=2, progress=False)
    killed.join()
    assert caught.value.results[0] == 9 and caught.value.results[1] is None


def test_an_interrupt_kills_the_pools_workers_at_once_instead_of_waiting_for_their_runs(tmp_path):
    """Ctrl-C (or qlab's SIGTERM, raised as an interrupt) while two 120-s runs are in flight: the
    process ends in seconds and leaves no worker behind; the pool's own shutdown would wait for them."""
    import subprocess

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import run_helpers\n"
        "from qlab import runs\n"
        "runs.run_many([runs.task(run_helpers.pid_then_sleep, sys.argv[2], 120) for _ in range(2)],\n"
        "              max_workers=2, estimated_seconds=240, progress=False)\n"
    )
    tests = os.path.dirname(__file__)
    driver = subprocess.Popen([sys.executable, "-c", code, tests, str(tmp_path)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(workers) == 2, "the workers never started"
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=60) != 0  # well before the runs' 120 s
    stderr = driver.stderr.read().decode()
    driver.stderr.close()
    assert "leaked semaphore" not in stderr, stderr  # a stopped worker's progress-bar lock

    assert not run_helpers.outliving(workers)


def _kill_first_pid_in(folder, settle: float = 1.0) -> threading.Thread:
    """Kill the worker that wrote its pid into folder, once the other run has left folder/done.

    Waiting on the mark, not on a clock, keeps a loaded machine from killing before the other run
    finished; settle gives its result time to reach the parent.
    """

    def kill():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pids = [path for path in folder.iterdir() if path.name.isdigit()]
            if pids and (folder / "done").exists():
                time.sleep(settle)
                os.kill(int(pids[0].name), signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_cache_runs_only_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.paths, "RUNS_DIR", tmp_path)
    configs = [TINY.replace(seed=s) for s in range(2)]
    first = run_many(configs, executor="serial", threads_per_run=1, cache=True, progress=False)
    assert len(list((tmp_path / "cache").glob("*.pkl"))) == 2
    # a cached run is not run again: poison the train function and read both back
    monkeypatch.setattr("qlab.train.train", lambda config: pytest.fail("a cached run ran again"))
    again = run_many(configs, executor="serial", threads_per_run=1, cache=True, progress=False)
    for a, b in zip(first, again):
        _same_train_results(a, b)


def test_the_environment_opts_a_notebook_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.paths, "RUNS_DIR", tmp_path)
    monkeypatch.setenv(runs.CACHE_ENV, "1")
    assert run_many([task(run_helpers.fail_on, 4, -1)], executor="serial", progress=False) == [16]
    assert len(list((tmp_path / "cache").glob("*.pkl"))) == 1
    monkeypatch.setenv(runs.CACHE_ENV, "0")
    run_many([task(run_helpers.fail_on, 5, -1)], executor="serial", progress=False)
    assert len(list((tmp_path / "cache").glob("*.pkl"))) == 1


def test_cache_key_covers_every_field_the_threads_and_the_version(monkeypatch):
    import copy
    import dataclasses

    import qlab

    key = runs.cache_key(TINY, 1)
    assert runs.cache_key(TINY, 2) != key
    for field in dataclasses.fields(TrainConfig):
        value = getattr(TINY, field.name)
        other = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 2 + 1}.get(type(value))
        if other is not None:
            changed = copy.copy(TINY)
            setattr(changed, field.name, other(value))  # unvalidated: the key must see it regardless
            assert runs.cache_key(changed, 1) != key, field.name
    monkeypatch.setattr(qlab, "__version__", "0.0.0-other")
    assert runs.cache_key(TINY, 1) != key
    assert runs.cache_key(task(run_helpers.fail_on, 1, 2), 1) != runs.cache_key(
        task(run_helpers.fail_on, 2, 2), 1
    )


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ({"executor": "threads"}, ValueError, "unknown executor 'threads'; expected one of: serial, proc"),
        ({"max_workers": 0}, ValueError, "max_workers must be an int ≥ 1, got 0"),
        ({"max_workers": -2}, ValueError, "max_workers must be an int ≥ 1"),
        ({"max_workers": 2.0}, TypeError, "max_workers must be an int"),
        ({"threads_per_run": 0}, ValueError, "threads_per_run must be an int ≥ 1"),
        ({"runs_per_gpu": True}, TypeError, "runs_per_gpu must be an int"),
        ({"cache": "yes"}, TypeError, "cache must be a bool"),
        ({"address": "localhost:1"}, ValueError, "address is for executor='ray'"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(arguments, error, match):
    with pytest.raises(error, match=match):
        run_many([task(pytest.fail, "ran")], progress=False, **arguments)


def test_bad_runs_are_refused_before_any_run():
    with pytest.raises(TypeError, match="runs must be a list of TrainConfig or Task, got TrainConfig"):
        run_many(TINY)
    with pytest.raises(TypeError, match=r"runs\[1\] must be a TrainConfig or a qlab.runs.Task, got 'recipe'"):
        run_many([TINY, "recipe"])
    with pytest.raises(TypeError, match=r"runs\[0\].function must be callable"):
        run_many([Task(3)])
    with pytest.raises(TypeError, match=r"runs\[1\].function must be importable by name .*<lambda>"):
        run_many([task(run_helpers.threads), task(lambda: pytest.fail("ran"))], max_workers=2)
    with pytest.raises(TypeError, match=r"runs\[0\] must be picklable .*fail_on\(<generator"):
        run_many([task(run_helpers.fail_on, (x for x in []), 1)], max_workers=2)
    # the serial executor runs in this process: a lambda is fine there
    assert run_many([task(lambda: 5)], executor="serial", progress=False) == [5]


def test_an_unreachable_ray_address_is_refused_at_once():
    pytest.importorskip("ray")
    started = time.monotonic()
    with pytest.raises(ValueError, match="address '127.0.0.1:9': no Ray cluster answers there"):
        run_many([task(pytest.fail, "ran")], executor="ray", address="127.0.0.1:9")
    with pytest.raises(ValueError, match="address must be 'auto', 'host:port'"):
        run_many([task(pytest.fail, "ran")], executor="ray", address="nowhere")
    assert time.monotonic() - started < 10


@pytest.mark.xdist_group("ray")  # no local Ray cluster of another test is running meanwhile
def test_address_auto_without_a_running_cluster_is_refused_before_any_run(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", "/nonexistent-qlab-ray")  # where Ray records the last `ray start`
    with pytest.raises(ValueError, match="address 'auto': no running Ray cluster found on this machine"):
        run_many([task(pytest.fail, "ran")], executor="ray", address="auto")
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # how qlab run --address hands it to a notebook
    with pytest.raises(ValueError, match="address 'auto': no running Ray cluster"):
        run_many([task(pytest.fail, "ran")], executor="ray")


def test_ray_missing_names_the_install_command(monkeypatch):
    run_helpers.hide_module(monkeypatch, "ray")
    with pytest.raises(ImportError, match=r"pip install 'qlab\[ray\]'"):
        run_many([task(run_helpers.threads)], executor="ray")


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time on this machine
@needs_ray
def test_ray_cluster_gives_the_serial_results_and_survives_a_killed_worker(tmp_path):
    """One local Ray cluster for the whole story: training runs equal the serial ones bit for bit, a
    run that raises is named, a SIGKILLed worker fails its run and loses no finished one."""
    pythonpath = os.pathsep.join(p for p in sys.path if p)  # the workers import tests/run_helpers.py
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})  # fmt: skip
    try:
        configs = [TINY.replace(recipe="nvfp4", seed=0), TINY.replace(recipe="fp32", seed=1)]
        serial = run_many(configs, executor="serial", threads_per_run=1, progress=False)
        on_ray = run_many(configs, executor="ray", threads_per_run=1, progress=False)
        for a, b in zip(serial, on_ray):
            _same_train_results(a, b)
        assert check_address("auto") == "auto"  # Ray's own search finds this running cluster

        with pytest.raises(RunsFailed, match="ValueError: run 2 fails on purpose") as caught:
            run_many([task(run_helpers.fail_on, v, 2) for v in range(4)], executor="ray", progress=False)
        assert caught.value.results == [0, 1, None, 9]

        killed = _kill_first_pid_in(tmp_path, settle=2.0)
        tasks = [
            task(run_helpers.square_then_mark, 3, str(tmp_path)),
            task(run_helpers.pid_then_sleep, str(tmp_path), 60),
        ]
        with pytest.raises(RunsFailed, match="Ray worker running it died") as caught:
            run_many(tasks, executor="ray", threads_per_run=1, progress=False)
        killed.join()
        assert caught.value.results[0] == 9 and caught.value.results[1] is None
    finally:
        ray.shutdown()


def test_results_pickle_across_processes():
    result = run_many([TINY], executor="serial", progress=False)[0]
    again = pickle.loads(pickle.dumps(result))
    _same_train_results(result, again)


def test_a_short_list_runs_here_unless_a_warm_pool_waits(tmp_path, capsys):
    """Given estimated_seconds, a list shorter than the pool's start-up runs in this process, with the
    threads a pool worker would have; a warm pool takes it, as any list."""
    folder = str(tmp_path)
    short = [task(run_helpers.pid_then_sleep, folder, 0)] * 2
    assert run_many(short, max_workers=2, estimated_seconds=0.01) == [os.getpid()] * 2
    assert "2 runs of about 0.0 s: run here one after another" in capsys.readouterr().out
    threads = [task(run_helpers.threads)] * 2
    expected = max(1, runs.usable_cores() // 2)  # the threads each of 2 workers gets
    assert run_many(threads, max_workers=2, estimated_seconds=0.01, progress=False) == [expected] * 2
    long = run_many(short, max_workers=2, estimated_seconds=runs.POOL_START_S, progress=False)
    assert os.getpid() not in long  # as long as the start-up: worth a pool, which stays warm
    assert os.getpid() not in run_many(short, max_workers=2, estimated_seconds=0.01, progress=False)
    with pytest.raises(ValueError, match="estimated_seconds"):
        run_many(short, estimated_seconds=-1.0)


def test_a_warm_pool_whose_worker_died_while_idle_is_started_afresh():
    first = run_many([task(run_helpers.threads)] * 2, max_workers=2, progress=False)
    for pid in {p.pid for p in runs._WARM_POOL["pool"]._processes.values()}:
        os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)  # the pool notices its dead worker and marks itself broken
    assert run_many([task(run_helpers.threads)] * 2, max_workers=2, progress=False) == first


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_stops_when_its_parent_is_killed():
    # a pool worker whose campaign is SIGKILLed (the OOM killer, kill -9) idled on forever, holding its
    # memory and, on a GPU, its CUDA context: the worker asks to get SIGTERM when its parent dies
    import subprocess

    worker = (
        "import os, time; from qlab.runs import _stop_with_parent; _stop_with_parent(); "
        "print(os.getpid(), flush=True); time.sleep(120)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=sys.stdout); time.sleep(120)"
    )
    middle = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited, not yet reaped by whoever adopted it
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the worker outlived its killed parent")
