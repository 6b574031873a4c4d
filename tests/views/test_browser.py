"""Real-browser tests: JupyterLab + headless Chromium (Debian's) driven by Playwright.

Each starts JupyterLab on a copy of ``notebooks/`` (in a temporary directory next to a link to the
repository's ``data/``, so autosave can never write outputs into the repository and the shipped
trace is only read) and runs all cells from the Run menu:

* 00_quickstart: waits until the Workbench's plotly figures are drawn inside the widget outputs
  (FigureWidget is an anywidget: this needs the ``anywidget`` JupyterLab extension, which the
  ``anywidget`` package ships), moves the step slider with the keyboard and checks that a figure
  changed; then saves the notebook, reloads the page with the kernel alive and checks that the
  figures come back drawn as they were, without the re-run line, and follow the step slider;
* a figure whose front end stops hearing the kernel is replaced by one drawing the same view;
* 00, 03 and 04: no cell shows stderr output (a warning, a progress bar on stderr, a traceback);
* ``make lab``'s own command (read from ``make -n lab``): the URL it prints opens 00_quickstart.

Screenshots go to ``artifacts/browser/``. Chromium missing is one line naming the fix
(``make test`` installs it when run as root).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # JupyterLab and Chromium in a real browser

REPO = Path(__file__).resolve().parents[2]
JUPYTER = Path(sys.executable).parent / "jupyter"
SHOTS = REPO / "artifacts" / "browser"
TRACE = REPO / "data" / "traces" / "vllm-h200x2-pcp2-mtp2"  # what 00_quickstart opens
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        pytest.fail("Chromium not found: the browser tests drive Debian's Chromium; install it with "
                    "'apt-get install chromium' (make test does so when run as root)", pytrace=False)
    return path


def test_chromium_missing_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    with pytest.raises(pytest.fail.Exception) as e:
        _chromium()
    assert len(str(e.value).splitlines()) == 1 and "apt-get install chromium" in str(e.value)


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


def _lab_root(tmp_path: Path) -> Path:
    """``tmp_path/lab`` with a copy of every notebook and a link to the repository's data/."""
    root = tmp_path / "lab"
    (root / "notebooks").mkdir(parents=True)
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        shutil.copy(nb, root / "notebooks")
    (root / "data").symlink_to(REPO / "data", target_is_directory=True)
    return root


def _lab_env(root: Path) -> dict[str, str]:
    """Jupyter's config, data, runtime, workspaces and user settings, all under ``root``."""
    return dict(os.environ, JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_DATA_DIR=str(root / "jdata"),
                JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"),
                JUPYTERLAB_SETTINGS_DIR=str(_settings(root)), PYTHONUNBUFFERED="1")


@contextlib.contextmanager
def _server(root: Path, cmd: list[str], ready):
    """Run ``cmd`` (a JupyterLab server) in ``root`` until ``ready(log_text)`` returns a value;
    yields that value and stops the server afterwards."""
    log_path = root / "jupyter.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_lab_env(root), cwd=root,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{log_path.read_text()}")
            value = ready(log_path.read_text())
            if value is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer in 90 s:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield value
    finally:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own server's process group
            proc.wait(timeout=10)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def jupyterlab(tmp_path: Path):
    """A JupyterLab server on a temporary copy of notebooks/; yields (base_url, token)."""
    root = _lab_root(tmp_path)
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [str(JUPYTER), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--notebook-dir={root / 'notebooks'}",
           f"--LabApp.user_settings_dir={root / 'settings'}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
           "--ServerApp.open_browser=False", "--LabApp.news_url=", "--ServerApp.port_retries=0"]
    base = f"http://127.0.0.1:{port}"
    with _server(root, cmd, lambda _log: True if _answers(f"{base}/api/status?token={token}") else None):
        yield base, token


@pytest.fixture()
def lab(tmp_path):
    with jupyterlab(tmp_path) as server:
        yield server


STDERR = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"


def _open_and_run_all(page, base: str, token: str, name: str) -> None:
    """Open notebook ``name`` once its kernel is idle, then Run > Run All Cells."""
    page.goto(f"{base}/lab/tree/{name}?token={token}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    # the kernel is up when the status bar says so
    page.wait_for_selector(".jp-StatusBar-Widget:has-text('Idle')", timeout=90_000)
    dialog = page.locator(".jp-Dialog button.jp-mod-accept")
    if dialog.count():  # a kernel chooser despite autoStartDefaultKernel: take the default
        dialog.first.click()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def _all_cells_ran(page) -> bool:
    prompts = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt").all_inner_texts()
    return bool(prompts) and all(re.fullmatch(r"\[\d+\]:", t.strip()) for t in prompts)


def _stderr_outputs(page) -> list[str]:
    """The text of every stderr output shown in the open notebook (the pink boxes)."""
    return [t.strip()[:300] for t in page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) {STDERR}").all_inner_texts()]


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


def test_workbench_renders_and_moves_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("00_quickstart_*.png"):
        old.unlink()
    before = _digest(TRACE)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            # tall enough for the whole Workbench to be on screen (element screenshots of a widget
            # inside JupyterLab's scrolling notebook panel only capture what is visible)
            page = browser.new_page(viewport={"width": 1400, "height": 4400})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            _open_and_run_all(page, base, token, "00_quickstart.ipynb")

            # every code cell ran (no "[*]") and the Workbench drew its five figures
            deadline = time.monotonic() + 240
            while True:
                state = _workbench_state(page)
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
                done = state.get("found") and state["plots"] >= 5 and _all_cells_ran(page)
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
            assert not _stderr_outputs(page), _stderr_outputs(page)  # e.g. a widget message that is not JSON
            titles0 = state["titles"]
            assert "step layout: PCP=2" in titles0[0]
            wb = page.locator(".pcpviz-workbench").first
            wb.scroll_into_view_if_needed()
            page.wait_for_timeout(800)
            page.screenshot(path=str(SHOTS / "00_quickstart_page.png"), clip={"x": 0, "y": 0, "width": 1400,
                                                                                "height": 1100})
            wb.screenshot(path=str(SHOTS / "00_quickstart_workbench_step0.png"))
            _zoom_reveals_tokens(page)  # step 0 holds hundreds of tokens: runs at full width, cells zoomed

            # move the step slider one notch with the keyboard
            handle = wb.locator(".widget-slider .noUi-handle").first
            handle.click()
            page.keyboard.press("ArrowRight")
            # the Workbench pushes each changed figure as its own message, so the token-order figure
            # can be redrawn before the block tables are: wait for both (and the step label)
            deadline = time.monotonic() + 60
            while True:
                after = _workbench_state(page)
                moved = {"token order title": after["titles"][0] != titles0[0],
                         "token order": after["svgText"][0] != state["svgText"][0],
                         "block tables": after["svgText"][2] != state["svgText"][2],
                         "step label": "step 1" in after["text"]}
                if all(moved.values()):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"not redrawn 60 s after moving the step slider: "
                                         f"{[k for k, v in moved.items() if not v]}; "
                                         f"{titles0[0]!r} -> {after['titles'][0]!r}")
                page.wait_for_timeout(300)
            assert "requests 0-b416d835" in after["titles"][0]  # step 1's batch: request 0 alone
            page.wait_for_timeout(800)
            wb.screenshot(path=str(SHOTS / "00_quickstart_workbench_step1.png"))
            assert not [e for e in errors if "plotly" in e.lower() or "anywidget" in e.lower()], errors
            _reload_redraws_and_follows(page, tmp_path / "lab" / "notebooks" / "00_quickstart.ipynb", after)
        finally:
            browser.close()
    assert _digest(TRACE) == before, "the notebook modified the shipped trace"


def _zoom_reveals_tokens(page) -> None:
    """A zoom of the token-order view in the browser (plotly's relayout, what a drag does) makes
    the Workbench redraw it for the window: per-token cells with their chunk as text."""
    count = """() => { const gd = document.querySelectorAll('.pcpviz-workbench .js-plotly-plot')[0];
                       return gd.querySelectorAll('.heatmaplayer text').length; }"""
    before = page.evaluate(count)
    page.evaluate("""() => { const gd = document.querySelectorAll('.pcpviz-workbench .js-plotly-plot')[0];
                             return Plotly.relayout(gd, {'xaxis.range': [0, 12]}); }""")
    deadline = time.monotonic() + 30
    while page.evaluate(count) < 12 + before:
        if time.monotonic() > deadline:
            raise AssertionError(f"zoomed to 12 tokens, the token-order view shows {page.evaluate(count)} cell texts")
        page.wait_for_timeout(300)
    page.locator(".pcpviz-workbench").first.screenshot(path=str(SHOTS / "00_quickstart_workbench_zoom.png"))


_NOTE_SHOWN = """() => { const n = document.querySelector('.pcpviz-workbench .pcpviz-reload-note');
    if (!n) return ''; const s = getComputedStyle(n);
    return s.display !== 'none' && s.visibility !== 'hidden' ? n.innerText : ''; }"""


def _reload_redraws_and_follows(page, notebook: Path, shown: dict) -> None:
    """Save (autosave is off here; JupyterLab's default saves every two minutes: unsaved, a reload
    shows the notebook as last saved, without the Workbench), reload the page with the kernel
    alive: the figures come back drawn as they were (``shown``: titles and heatmaps at step 1),
    with no re-run line (``pcpviz.views.widgets.status.RELOAD_NOTE``, the fallback), and follow
    the step slider."""
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while "application/vnd.jupyter.widget-view+json" not in notebook.read_text():
        assert time.monotonic() < deadline, "the notebook was not saved with the Workbench's output"
        page.wait_for_timeout(300)
    page.reload(wait_until="domcontentloaded")
    page.wait_for_selector(".pcpviz-workbench", timeout=120_000)
    deadline = time.monotonic() + 120
    while True:
        state = _workbench_state(page)
        if state["plots"] >= 5 and state["titles"][:4] == shown["titles"][:4] and all(state["rects"][:4]):
            break
        if time.monotonic() > deadline:
            page.screenshot(path=str(SHOTS / "00_quickstart_after_reload.png"), full_page=True)
            raise AssertionError(f"after a reload the figures are not drawn as before ({state['titles'][:1]}, "
                                 f"heatmaps {state['rects']}); re-run line: {page.evaluate(_NOTE_SHOWN)!r}")
        page.wait_for_timeout(500)
    page.wait_for_timeout(9000)  # past the note's delay: it must stay hidden while the figures are drawn
    assert page.evaluate(_NOTE_SHOWN) == "", "the figures are drawn but the re-run line shows"
    wb = page.locator(".pcpviz-workbench").first
    wb.scroll_into_view_if_needed()
    wb.screenshot(path=str(SHOTS / "00_quickstart_after_reload.png"))
    wb.locator(".widget-slider .noUi-handle").first.click()
    page.keyboard.press("ArrowRight")
    deadline = time.monotonic() + 60
    while True:
        after = _workbench_state(page)
        if after["titles"][0] != state["titles"][0] and "step 2" in after["text"]:
            break
        assert time.monotonic() < deadline, (f"after the reload the figures do not follow the step slider: "
                                             f"{after['titles'][0]!r}")
        page.wait_for_timeout(300)
    wb.screenshot(path=str(SHOTS / "00_quickstart_after_reload_step2.png"))


def test_a_figure_that_stops_hearing_the_kernel_is_replaced_and_drawn(lab, tmp_path):
    """anywidget closes a model's messages for good when it missed its two-second load window
    (after a reload of a busy page): its figure would stop following the controls. Here the
    timeline's pongs are dropped in the kernel, so its front end sees the kernel answer its ping
    (the idle status) without the pong: it reports itself deaf and the Workbench shows the view
    in a new widget, drawn; no other figure is replaced (ipywidgets re-creates the views of the
    children after it, from their models) (``pcpviz.views.widgets.figure``)."""
    from playwright.sync_api import sync_playwright

    base, token = lab
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": ["from pcpviz.views.widgets import Workbench\n",
                                "wb = Workbench('../data/traces/cpu-pcp2-mtp2', checks=False)\n",
                                "wb.figures['timeline'].send = lambda *a, **k: None  # its pongs are lost\n",
                                "wb"]},
                    {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": ["print('replaced', dict(wb.replaced))"]}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "lab" / "notebooks" / "deaf.ipynb").write_text(json.dumps(nb))
    SHOTS.mkdir(parents=True, exist_ok=True)
    mark = """() => [...document.querySelectorAll('.pcpviz-workbench .js-plotly-plot')]
        .forEach((p, i) => { p.dataset.pcpvizFirst = String(i); })"""
    seen = """() => [...document.querySelectorAll('.pcpviz-workbench .js-plotly-plot')]
        .map(p => [p.dataset.pcpvizFirst || '',
        (p.querySelector('.gtitle') || {}).textContent || ''])"""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 4400})
            page.set_default_timeout(60_000)
            _open_and_run_all(page, base, token, "deaf.ipynb")
            deadline = time.monotonic() + 240
            while not (_workbench_state(page).get("plots", 0) >= 5 and all(_workbench_state(page)["titles"][:4])):
                assert time.monotonic() < deadline, "the Workbench did not render"
                page.wait_for_timeout(500)
            page.evaluate(mark)
            deadline = time.monotonic() + 60
            while True:
                now = page.evaluate(seen)
                if len(now) >= 5 and now[1][0] == "" and now[1][1]:  # one figure per panel (DCP shards: 6)
                    break
                assert time.monotonic() < deadline, f"the deaf timeline was not replaced: {now}"
                page.wait_for_timeout(500)
            assert now[0][0] == "0" and all(t for _, t in now), now  # every figure drawn
            assert now[1][1].startswith("draft-step timeline"), now[1]
            cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").nth(1)
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")  # run it again, now that the timeline was replaced
            deadline = time.monotonic() + 60
            while "replaced {'timeline': 1}" not in cell.inner_text():
                assert time.monotonic() < deadline, f"only the deaf figure is replaced, once: {cell.inner_text()!r}"
                page.wait_for_timeout(500)
            page.locator(".pcpviz-workbench").first.screenshot(path=str(SHOTS / "deaf_figure_replaced.png"))
        finally:
            browser.close()


@pytest.mark.parametrize("name", ["03_mtp_draft_steps.ipynb", "04_acceptance_regression.ipynb"])
def test_notebook_cells_show_no_stderr_in_jupyterlab(lab, name):
    """03 and 04 run the engine live (two CPU ranks): every cell finishes with no stderr output,
    no traceback and every widget drawn (00 is checked the same way in the test above)."""
    from playwright.sync_api import sync_playwright

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    stem = name.removesuffix(".ipynb")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.set_default_timeout(60_000)
            _open_and_run_all(page, base, token, name)
            deadline = time.monotonic() + 480
            while not _all_cells_ran(page):
                if time.monotonic() > deadline:
                    page.screenshot(path=str(SHOTS / f"{stem}_timeout.png"), full_page=True)
                    raise AssertionError(f"{name}: the cells did not all run in 480 s")
                page.wait_for_timeout(1000)
            page.wait_for_timeout(1500)  # late outputs (widget messages) of the last cells
            page.screenshot(path=str(SHOTS / f"{stem}_page.png"), clip={"x": 0, "y": 0, "width": 1400,
                                                                         "height": 1600})
            text = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").inner_text()
            assert not _stderr_outputs(page), f"{name}: stderr under a cell: {_stderr_outputs(page)}"
            assert "Traceback" not in text and "Error displaying widget" not in text
            assert "Loading widget" not in text
        finally:
            browser.close()


def _make_lab_command(port: int) -> list[str]:
    """The command ``make lab PORT=port`` runs (its set-up step left out), as ``make -n`` prints it,
    with this interpreter's virtual environment as VENV."""
    out = subprocess.run(["make", "-s", "-n", "-o", "setup", "-C", str(REPO), "lab", f"PORT={port}",
                          f"VENV={Path(sys.executable).parent.parent}"],
                         capture_output=True, text=True, check=True).stdout
    lines = shlex.split(out.replace("\\\n", " "), comments=False, posix=True)
    start = lines.index("lab") - 1  # .../bin/jupyter lab ...
    return lines[start:]


def test_make_lab_prints_a_url_that_opens_the_quickstart(tmp_path):
    port = _free_port()
    cmd = _make_lab_command(port)
    assert cmd[0].endswith("/bin/jupyter") and f"--port={port}" in cmd
    root = _lab_root(tmp_path)

    def printed_url(log: str):
        m = re.search(rf"http://127\.0\.0\.1:{port}/\S*\?token=\w+", log)
        return m.group(0) if m and _answers(m.group(0)) else None

    with _server(root, cmd, printed_url) as url:
        assert url.split("?")[0] == f"http://127.0.0.1:{port}/lab/tree/00_quickstart.ipynb", url
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(60_000)
                page.goto(url, wait_until="domcontentloaded")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
                tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
                assert tab.first.inner_text().strip() == "00_quickstart.ipynb"
            finally:
                browser.close()


_INJECTED_STATE = """() => ({
    xss: window.__pcpviz_xss === undefined ? null : window.__pcpviz_xss,
    elements: [...document.querySelectorAll('#pcpviz-injected, [src*="pcpviz-injected"], svg[onload], img[onerror]')]
        .map(e => e.outerHTML.slice(0, 120)),
    text: document.body.innerText,
})"""


def _hostile_trace(root: Path) -> Path:
    """A PCP=2 K=2 trace whose every string field (request ids, local request ids, the verify's
    ids, draft ``view``, ``sampled_from``, run.json's strings) carries an injection payload."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    import random

    from hostile import PAYLOADS, inject_meta, inject_strings, rewrite
    from pcpviz.synthetic import RequestSpec, generate

    clean = generate([RequestSpec(p, 14 + 3 * i, 4) for i, p in enumerate(PAYLOADS)], pcp=2,
                     num_speculative_tokens=2).write(root / "clean")
    rng = random.Random(0)
    return rewrite(clean, root / "hostile", lambda s, r, ph: inject_strings(rng, s, r, ph), meta_edit=inject_meta)


def _assert_inert(page, where: str, dialogs: list, requests: list) -> None:
    state = page.evaluate(_INJECTED_STATE)
    assert not dialogs, f"{where}: a payload opened a dialog: {dialogs}"
    assert state["xss"] is None, f"{where}: a payload ran (window.__pcpviz_xss = {state['xss']})"
    assert not state["elements"], f"{where}: injected elements: {state['elements']}"
    hits = [u for u in requests if "pcpviz-injected" in u]
    assert not hits, f"{where}: a payload made requests: {hits}"
    assert "pcpviz-injected-1" in state["text"], f"{where}: the payloads are not shown as text"


def test_injection_payloads_in_a_trace_stay_text_in_the_workbench_and_the_html_export(lab, tmp_path):
    """Every string of a trace is untrusted: the Workbench in JupyterLab (header, status, checks,
    every figure's titles, ticks, hover text and annotations, over several steps and both ranks)
    and the HTML export show the payloads as text. No dialog, no script run, no request (the Jupyter
    API is in reach of a script in the page), no injected element."""
    from playwright.sync_api import sync_playwright

    from pcpviz.views.export.html import export_html

    base, token = lab
    trace = _hostile_trace(tmp_path)
    page_html = Path(export_html(trace, tmp_path / "hostile.html"))
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": ["import warnings; warnings.simplefilter('ignore')\n",
                                "from pcpviz.views.widgets import Workbench\n",
                                f"wb = Workbench({str(trace)!r})\n", "wb"]},
                    {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": ["for s in list(wb.step.options)[:6]:\n",
                                "    for r in wb.rank.options:\n", "        wb.set(step=s, rank=r[1])\n",
                                "wb.set(step=list(wb.step.options)[2], rank=1, highlight=wb.req_ids[0])\n"]}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "lab" / "notebooks" / "hostile.ipynb").write_text(json.dumps(nb))
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 4400})
            page.set_default_timeout(60_000)
            dialogs, requests, errors = [], [], []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)[:300]))
            _open_and_run_all(page, base, token, "hostile.ipynb")
            deadline = time.monotonic() + 240
            while True:
                state = _workbench_state(page)
                if state.get("found") and state["plots"] >= 5 and _all_cells_ran(page) and all(state["titles"][:4]):
                    break
                if time.monotonic() > deadline:
                    page.screenshot(path=str(SHOTS / "hostile_timeout.png"), full_page=True)
                    titles = [t[:40] for t in state.get("titles", [])]
                    raise AssertionError(f"workbench did not render on the hostile trace: {state.get('plots')} plots, "
                                         f"titles {titles}, page errors {errors[:3]}")
                page.wait_for_timeout(500)
            page.wait_for_timeout(2000)  # the last widget messages, hover layers
            for plot in page.locator(".pcpviz-workbench .js-plotly-plot .nsewdrag").all()[:6]:
                plot.hover()  # hover labels draw the hover text
                page.wait_for_timeout(150)
            assert "Traceback" not in state["text"] and "Error displaying widget" not in state["text"]
            page.locator(".pcpviz-workbench").first.screenshot(path=str(SHOTS / "hostile_workbench.png"))
            _assert_inert(page, "Workbench", dialogs, requests)

            dialogs.clear()
            requests.clear()
            # a fresh page: file:// from Lab's is refused
            page = browser.new_page(viewport={"width": 1400, "height": 4400})
            page.set_default_timeout(60_000)
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_html.as_uri(), wait_until="load")
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            for i in range(3):  # a few steps of the export
                page.locator("#step").focus()
                page.keyboard.press("ArrowRight")
                page.wait_for_timeout(300)
            for plot in page.locator(".js-plotly-plot .nsewdrag").all()[:6]:
                plot.hover()
                page.wait_for_timeout(150)
            _assert_inert(page, "HTML export", dialogs, requests)
        finally:
            browser.close()
