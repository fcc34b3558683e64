"""The repository is the checkout you stand in: two clones sharing one environment each write into
their own, $QLAB_ROOT wins, and outside any checkout the installed one is used and the command says so."""

import os
import subprocess
import sys
from pathlib import Path

from qlab import paths

PRINT_ROOT = "from qlab import paths; print(paths.ROOT); print(paths.ROOT_FOUND_BY)"


def _checkout(folder: Path) -> Path:
    """The two things that make a folder a qlab checkout: a pyproject.toml naming qlab, and notebooks/."""
    (folder / "notebooks").mkdir(parents=True)
    (folder / "pyproject.toml").write_text('[project]\nname = "qlab"\nversion = "0"\n')
    return folder


def _root_seen_from(cwd: Path, **environment) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != paths.ROOT_ENV} | environment
    done = subprocess.run(
        [sys.executable, "-c", PRINT_ROOT], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:2]


def test_two_clones_sharing_one_environment_each_find_their_own_root(tmp_path):
    first, second = _checkout(tmp_path / "first"), _checkout(tmp_path / "second")
    (second / "notebooks" / "deeper").mkdir()
    assert _root_seen_from(first) == [str(first.resolve()), "current directory"]
    assert _root_seen_from(second / "notebooks" / "deeper") == [str(second.resolve()), "current directory"]
    assert _root_seen_from(first, QLAB_ROOT=str(second)) == [str(second.resolve()), paths.ROOT_ENV]


def test_a_folder_that_only_looks_like_a_checkout_is_not_one(tmp_path):
    other = tmp_path / "other"
    (other / "notebooks").mkdir(parents=True)
    (other / "pyproject.toml").write_text('[project]\nname = "qlab-plugins"\n')
    installed = Path(paths.__file__).resolve().parent.parent
    assert _root_seen_from(other) == [str(installed), "installed"]


def test_outside_any_checkout_the_command_says_which_it_uses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != paths.ROOT_ENV}
    done = subprocess.run([sys.executable, "-m", "qlab.cli", "list"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    installed = Path(paths.__file__).resolve().parent.parent
    assert done.returncode == 0, done.stderr
    assert f"qlab: not inside a qlab checkout; using the installed one at {installed}" in done.stderr
    inside = subprocess.run([sys.executable, "-m", "qlab.cli", "list"], cwd=installed, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert "not inside a qlab checkout" not in inside.stderr


def test_a_qlab_root_that_is_no_checkout_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != paths.ROOT_ENV} | {
        paths.ROOT_ENV: str(tmp_path / "none")
    }
    done = subprocess.run([sys.executable, "-m", "qlab.cli", "list"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert f"QLAB_ROOT={tmp_path / 'none'} is not a qlab checkout" in done.stderr


def _tiny_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "qlab", "display_name": "Python (qlab)", "language": "python"}
    parameters = nbformat.v4.new_code_cell("a = 1")
    parameters.metadata["tags"] = ["parameters"]
    body = "import pandas as pd\nfrom qlab.results import save_csv\n"
    body += "save_csv(pd.DataFrame({'a': [a]}), 'tiny')"
    nb.cells = [parameters, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)
    return path


def test_a_notebook_run_by_its_path_writes_into_its_own_checkout(tmp_path):
    first, second = _checkout(tmp_path / "first"), _checkout(tmp_path / "second")
    notebook = _tiny_notebook(second / "notebooks" / "99_tiny.ipynb")
    env = {k: v for k, v in os.environ.items() if k not in (paths.ROOT_ENV, paths.RESULTS_ENV)}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    done = subprocess.run([sys.executable, "-m", "qlab.cli", "run", str(notebook), "-p", "a", "2"],
                          cwd=outside, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"using {second.resolve()}, the checkout {notebook} belongs to" in done.stderr
    written = second / "runs" / "interactive" / "99_tiny" / "a=2" / "data" / "tiny.csv"
    assert written.read_text() == "a\n2\n"
    installed = Path(paths.__file__).resolve().parent.parent
    assert not (installed / "runs" / "interactive" / "99_tiny").exists()
    # standing in another checkout, it is refused before anything runs: which checkout is meant?
    refused = subprocess.run([sys.executable, "-m", "qlab.cli", "run", str(notebook)],
                             cwd=first, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert f"belongs to the checkout at {second.resolve()}, but this command writes into" in refused.stderr
    assert not (first / "runs").exists()
