"""One real-browser test: JupyterLab + headless Chromium (Debian's) driven by Playwright.

Starts JupyterLab on a copy of ``notebooks/00_quickstart.ipynb`` (in a temporary directory next
to a link to the repository's ``data/``, so autosave can never write outputs into the repository
and the shipped trace is only read), runs all cells from the Run menu, waits until the Workbench's
plotly figures are drawn inside the widget outputs (FigureWidget is an anywidget: this needs the
``anywidget`` JupyterLab extension, which the ``anywidget`` package ships), moves the step slider
with the keyboard and checks that a figure changed. Screenshots go to ``artifacts/browser/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
JUPYTER = Path(sys.executable).parent / "jupyter"
SHOTS = REPO / "artifacts" / "browser"
TRACE = REPO / "data" / "traces" / "cpu-pcp2-mtp2"
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def _settings(root: Path) -> Path:
    """User settings: no autosave, no news/update toasts, every cell rendered (no windowing)."""
    d = root / "settings"
    files = {
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none",
                                                                        "autoStartDefaultKernel": True},
    }
    for rel, content in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(content))
    return d


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, notebooks=("00_quickstart.ipynb",)):
    """A JupyterLab server on a temporary copy of ``notebooks``; yields (base_url, token)."""
    root = tmp_path / "lab"
    (root / "notebooks").mkdir(parents=True)
    for name in notebooks:
        shutil.copy(REPO / "notebooks" / name, root / "notebooks")
    (root / "data").symlink_to(REPO / "data", target_is_directory=True)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_RUNTIME_DIR=str(root / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"), PYTHONUNBUFFERED="1")
    log = open(root / "jupyter.log", "w")
    cmd = [str(JUPYTER), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--notebook-dir={root / 'notebooks'}",
           f"--LabApp.user_settings_dir={_settings(root)}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
           "--ServerApp.open_browser=False", "--LabApp.news_url=", "--ServerApp.port_retries=0"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{(root / 'jupyter.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer in 90 s:\n{(root / 'jupyter.log').read_text()}")
            time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own server's process group
            proc.wait(timeout=10)
        log.close()


@pytest.fixture()
def lab(tmp_path):
    with jupyterlab(tmp_path) as server:
        yield server


def _workbench_state(page) -> dict:
    return page.evaluate("""() => {
        const wb = document.querySelector('.pcpviz-workbench');
        if (!wb) return {found: false};
        const plots = [...wb.querySelectorAll('.js-plotly-plot')];
        const titles = plots.map(p => (p.querySelector('.gtitle') || {}).textContent || '');
        const svgText = plots.map(p => [...p.querySelectorAll('.main-svg text')].map(t => t.textContent).join('|'));
        const rects = plots.map(p => p.querySelectorAll('.main-svg .hm image, .main-svg .heatmaplayer image').length);
        return {found: true, plots: plots.length, titles, svgText, rects,
                text: document.body.innerText};
    }""")


def test_workbench_renders_and_moves_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("00_quickstart_*.png"):
        old.unlink()
    before = _digest(TRACE)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, timeout=60_000)
        try:
            # tall enough for the whole Workbench to be on screen (element screenshots of a widget
            # inside JupyterLab's scrolling notebook panel only capture what is visible)
            page = browser.new_page(viewport={"width": 1400, "height": 4400})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/lab/tree/00_quickstart.ipynb?token={token}", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            # the kernel is up when the status bar says so
            page.wait_for_selector(".jp-StatusBar-Widget:has-text('Idle')", timeout=90_000)
            dialog = page.locator(".jp-Dialog button.jp-mod-accept")
            if dialog.count():  # a kernel chooser despite autoStartDefaultKernel: take the default
                dialog.first.click()
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            # every code cell ran (no "[*]") and the Workbench drew its five figures
            deadline = time.monotonic() + 240
            while True:
                state = _workbench_state(page)
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
                done = state.get("found") and state["plots"] >= 5 and all(t.strip() and "*" not in t
                                                                           for t in prompts)
                if done and all(state["titles"][:4]):
                    break
                if time.monotonic() > deadline:
                    page.screenshot(path=str(SHOTS / "00_quickstart_timeout.png"), full_page=True)
                    raise AssertionError(f"workbench did not render: {state.get('plots')} plots, prompts {prompts}, "
                                         f"page errors {errors}")
                page.wait_for_timeout(500)
            assert "Loading widget" not in state["text"]
            assert "Error displaying widget" not in state["text"]
            assert "Traceback" not in state["text"]
            titles0 = state["titles"]
            assert "step layout: PCP=2" in titles0[0]
            wb = page.locator(".pcpviz-workbench").first
            wb.scroll_into_view_if_needed()
            page.wait_for_timeout(800)
            page.screenshot(path=str(SHOTS / "00_quickstart_page.png"), clip={"x": 0, "y": 0, "width": 1400,
                                                                                "height": 1100})
            wb.screenshot(path=str(SHOTS / "00_quickstart_workbench_step0.png"))

            # move the step slider one notch with the keyboard
            handle = wb.locator(".widget-slider .noUi-handle").first
            handle.click()
            page.keyboard.press("ArrowRight")
            deadline = time.monotonic() + 60
            while True:
                after = _workbench_state(page)
                if after["titles"][0] != titles0[0] and "step 1" in after["text"]:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"the figures did not change after moving the step slider: "
                                         f"{titles0[0]!r} -> {after['titles'][0]!r}")
                page.wait_for_timeout(300)
            assert after["svgText"][0] != state["svgText"][0]  # the token-order figure was redrawn
            assert after["svgText"][2] != state["svgText"][2]  # so were the block tables
            assert "requests req0, req2, req1" in after["titles"][0]  # step 1's batch
            page.wait_for_timeout(800)
            wb.screenshot(path=str(SHOTS / "00_quickstart_workbench_step1.png"))
            assert not [e for e in errors if "plotly" in e.lower() or "anywidget" in e.lower()], errors
        finally:
            browser.close()
    assert _digest(TRACE) == before, "the notebook modified the shipped trace"
