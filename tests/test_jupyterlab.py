"""JupyterLab in a real browser: Debian's Chromium, driven by Playwright, against ``qlab lab``.

The test does what a researcher does: opens notebook 02 by its .py from the file browser's URL, sets
``smoke = True`` in the parameters cell, runs every cell, saves, and looks at the page. It asserts
that the kernel is "Python (qlab)", that the notebook is not marked modified once the kernel is up
(before any edit), that the only error output is the cell tagged ``raises-exception`` and nothing
is written to stderr, that every figure is rendered as an image and progress shows as widgets,
that the run's results went to ``runs/interactive/`` while ``git status`` shows ``data/``,
``figures/`` and ``notebooks/`` untouched (the save included), and that the executed copy with its
outputs is beside those results, in the folder of its parameter set. The server is started on
127.0.0.1 with a random token and stopped by its process id.

Needs /usr/bin/chromium (``apt-get install chromium``; ``.ci/run`` installs it). Playwright only
drives that binary: ``playwright install`` (which downloads browsers) is never used.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qlab import paths

CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOK = "02_welford_vs_naive_variance"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium: apt-get install chromium"
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _git_status(*paths_to_check: str) -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--", *paths_to_check],
        cwd=paths.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``qlab lab`` on 127.0.0.1 with a random token and private Jupyter directories; yields its URL."""
    home = tmp_path_factory.mktemp("jupyter")
    port, token = _free_port(), secrets.token_hex(16)
    env = {key: value for key, value in os.environ.items() if key not in ("MPLBACKEND", "QLAB_RESULTS_DIR")}
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
    )
    command = [sys.executable, "-m", "qlab.cli", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1"]
    command += [f"--ServerApp.port={port}", f"--IdentityProvider.token={token}"]
    command += ["--LabApp.expose_app_in_browser=True"]
    log = open(home / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": url, "token": token, "log": home / "server.log"}
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)  # the server, by its process id (qlab lab execs jupyter lab)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


# JupyterLab's own objects, through the app it exposes (--LabApp.expose_app_in_browser)
SET_SMOKE = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if ((cell.getMetadata('tags') || []).includes('parameters')) {
      const source = cell.sharedModel.getSource();
      cell.sharedModel.setSource(source.replace('smoke: bool = False', 'smoke: bool = True'));
      return cell.sharedModel.getSource();
    }
  }
  return null;
}"""

FINISHED = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.model.cells;
  if (panel.sessionContext.session?.kernel?.status !== 'idle') return false;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type === 'code' && !cell.executionCount) return false;
  }
  return true;
}"""

CELLS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  const found = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    found.push({tags: cell.getMetadata('tags') || [], outputs: cell.outputs.toJSON()});
  }
  return found;
}"""

KERNEL_IDLE = "() => window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'"
IMAGES_LOADED = (
    "() => Array.from(document.querySelectorAll('.jp-OutputArea-output img')).every(i => i.complete)"
)
IMAGES = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output img'))
  .map(img => ({complete: img.complete, width: img.naturalWidth}))"""


def test_notebook_02_in_smoke_mode_runs_in_chromium_and_leaves_the_committed_files_alone(lab):
    from playwright.sync_api import sync_playwright

    before = _git_status("data", "figures", "notebooks")
    results = paths.RUNS_DIR / "interactive" / NOTEBOOK / "smoke=True"
    executed_copy = results / f"{NOTEBOOK}.ipynb"
    executed_copy.unlink(missing_ok=True)
    for old in results.rglob("*") if results.exists() else []:
        if old.is_file():
            old.unlink()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab['url']}/lab/tree/notebooks/{NOTEBOOK}.py?token={lab['token']}")
            # the .py opens as a notebook (jupytext's viewer is the default for Python files)
            page.wait_for_function(
                "() => window.jupyterapp?.shell?.currentWidget?.content?.model?.cells?.length > 0",
                timeout=90_000,
            )
            page.wait_for_function(KERNEL_IDLE, timeout=90_000)
            kernel = page.evaluate(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayName"
            )
            assert kernel == "Python (qlab)"
            time.sleep(2)  # the kernel's info has arrived; an untouched notebook must still be unmodified
            assert not page.evaluate("() => window.jupyterapp.shell.currentWidget.context.model.dirty")
            assert "smoke: bool = True" in page.evaluate(SET_SMOKE)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(FINISHED, timeout=300_000, polling=500)
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            page.wait_for_function(
                "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000
            )
            cells = page.evaluate(CELLS)
            page.wait_for_function(IMAGES_LOADED, timeout=30_000)
            images = page.evaluate(IMAGES)
            widgets = page.evaluate("() => document.querySelectorAll('.widget-hprogress').length")
            page.screenshot(path=str(paths.RUNS_DIR / "interactive" / "jupyterlab_screenshot.png"))
        finally:
            browser.close()

    (paths.RUNS_DIR / "interactive" / "jupyterlab_cells.json").write_text(json.dumps(cells, indent=1))
    errors = [(cell["tags"], output["ename"]) for cell in cells for output in cell["outputs"]
              if output["output_type"] == "error"]  # fmt: skip
    assert all("raises-exception" in tags for tags, _ in errors), errors
    noise = [
        output["text"][:300] for cell in cells for output in cell["outputs"] if output.get("name") == "stderr"
    ]
    assert not noise, noise  # nothing on stderr that is not the user's to act on
    figures = sum("image/png" in output.get("data", {}) for cell in cells for output in cell["outputs"])
    assert figures >= 4 and len(images) == figures, (figures, images)
    assert all(image["complete"] and image["width"] > 100 for image in images)
    texts = json.dumps(cells)
    assert "IProgress not found" not in texts and "PosixPath" not in texts
    assert widgets >= 1, "tqdm should render as a progress widget in JupyterLab"

    assert _git_status("data", "figures", "notebooks") == before  # the run and the save changed nothing
    assert any((results / "data").glob("*.csv")) and any((results / "figures").glob("*.png"))
    executed = json.loads(executed_copy.read_text())
    assert any(cell.get("outputs") for cell in executed["cells"])  # the copy keeps what the run showed
