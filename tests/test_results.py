"""paths and results: where things go, deterministic CSV bytes, clear errors."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from qlab import paths, results


def test_root_is_the_repository_whatever_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (paths.ROOT / "pyproject.toml").exists() and paths.NOTEBOOKS_DIR == paths.ROOT / "notebooks"
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    assert paths.data_dir() == paths.ROOT / "data"


def test_results_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    assert paths.data_dir() == tmp_path / "data" and paths.figures_dir() == tmp_path / "figures"


def test_csv_bytes_are_fixed_and_floats_keep_ten_digits(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    df = pd.DataFrame({"name": ["a", "b"], "value": [1 / 3, 2.0e-30]})
    path = results.save_csv(df, "t")
    assert path.read_bytes() == b"name,value\na,0.3333333333\nb,2e-30\n"


def test_metrics_json_converts_scalars_and_refuses_arrays(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    path = results.save_metrics("m", a=np.float32(0.5), b=True, c=math.nan, d="x")
    assert json.loads(path.read_text()) == {"a": 0.5, "b": True, "c": None, "d": "x"}
    with pytest.raises(TypeError, match="metric 'e' must be a scalar"):
        results.save_metrics("m", e=[1, 2])


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden"])
def test_bad_names_are_refused(name, tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="plain file stem"):
        results.save_csv(pd.DataFrame({"a": [1]}), name)
    with pytest.raises(TypeError, match="DataFrame"):
        results.save_csv({"a": [1]}, "ok")


def test_markdown_table_by_hand():
    frame = pd.DataFrame({"method": ["a|b", "c"], "error": [0.000123456, 2.0], "n": [3, 4]})
    assert results.markdown_table(frame) == (
        "| method | error | n |\n|---|---|---|\n| a\\|b | 0.0001235 | 3 |\n| c | 2 | 4 |"
    )
