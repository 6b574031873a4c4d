"""Per-token detail in the HTML export (``pcpviz.views.export.tokens``), in Debian's Chromium:

* the page's script draws a strip for a window exactly as ``pcpviz.views.figures.lod`` does in
  Python (the Workbench's zoom): the same cells, levels, hover texts, cell texts and labels, for
  whole strips, run-level windows, per-token windows with and without cell text, fractional
  windows and windows past a lane's end, on a 16k-token step, the chunked real trace and the
  small CPU trace;
* an exported 16,384-token step, zoomed in the page to 60 tokens with ``Plotly.relayout`` (what
  a drag does), draws one cell per token (a 1 px gap between consecutive cells), in the token
  order, slot-mapping and block-table views; a reset draws the page's figure again;
* past the size caps a page keeps its run-level drawing and says so.

Screenshots: ``artifacts/browser/export_16k_*.png`` and ``export_pcp1_*.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import pcpviz.trace as pt
from pcpviz.views.export import tokens as tk
from pcpviz.views.export.html import embedded_data, export_html
from pcpviz.views.figures.canvas import safe_spec, safe_text
from pcpviz.views.figures.lod import record_strips
from pcpviz.views.figures.palette import heat_z
from pcpviz.views.panels import PANELS
from pcpviz.views.widgets import Workbench
from test_browser import REPO
from test_browser_views import _MEASURE, _gaps, _largest_step

SHOTS = REPO / "artifacts" / "browser"
ZOOMED = [name for name, p in PANELS.items() if p.zoom_axes]


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory) -> Path:
    from pcpviz.synthetic import long_prompt_run

    run = long_prompt_run(pcp=4, prompt_len=16384, chunk=16384, num_short=3, max_new_tokens=4,
                          num_speculative_tokens=2)
    return run.write(tmp_path_factory.mktemp("long") / "trace")


def _drawn_in_python(wb: Workbench, view: str, axis: str, window):
    """How the Workbench draws the strip on ``axis`` of ``view`` for ``window`` (None: whole)."""
    key = dict(PANELS[view].zoom_links).get(axis, axis)  # block tables: one window for the three
    wb.windows[view] = {} if window is None else {key: window}
    with record_strips() as calls:
        spec = wb._build(view)
    wb.windows[view] = {}
    strips = tk.strips(spec, calls)
    return next(c for c, s in zip(calls, strips) if s["xaxis"] == axis)


def _expected(call) -> dict:
    d = call.drawn
    return {"x": np.asarray(d.edges, dtype=float).tolist(), "z": heat_z(d.z), "hover": safe_spec(d.hover).tolist(),
            "text": None if d.text is None else safe_spec(d.text).tolist(), "xgap": d.xgap,
            "labels": [[x, li, safe_text(t)] for x, li, t in d.labels]}


def _cases(trace: pt.Trace):
    step = _largest_step(trace)
    wb = Workbench(trace, step=step, checks=False)
    for view in ZOOMED:
        with record_strips() as calls:
            spec = wb._build(view)
        strips = tk.strips(spec, calls)
        assert strips is not None, view
        width = max(ln["e"][-1] for s in strips for ln in s["lanes"])
        windows = [None, (0.0, width / 3), (width / 2, width / 2 + 60), (width / 3, width / 3 + 200),
                   (width * 0.37 + 0.3, width * 0.37 + 57.8), (max(width - 40, 0), width + 25)]
        for window in windows:
            for k, strip in enumerate(strips):
                call = _drawn_in_python(wb, view, strip["xaxis"], window)
                yield view, k, strip, [0, width] if window is None else list(window), _expected(call), call.px


@pytest.mark.slow
@pytest.mark.parametrize("name", ["long", "vllm-h200x2-pcp2-mtp2-chunked", "cpu-pcp2-mtp2"])
def test_the_page_draws_a_window_as_the_workbench_does(name, long_trace, browser):
    trace = pt.open(long_trace if name == "long" else REPO / "data" / "traces" / name)
    page = browser.new_page()
    try:
        page.set_content(f"<html><body><script>{tk.SCRIPT}</script></body></html>")
        n = 0
        for view, k, strip, window, want, px in _cases(trace):  # drawn as wide as the Workbench drew it
            got = page.evaluate("([s, w, px]) => PCPVIZ_TOKENS.draw(s, w, px)", [strip, window, px])
            where = f"{name} {view} strip {k} window {window}"
            assert got["xgap"] == want["xgap"], where
            assert np.allclose(got["x"], want["x"], rtol=1e-12, atol=1e-9), where
            for key in ("z", "hover", "text"):
                assert got[key] == want[key], f"{where}: {key} differs"
            assert len(got["labels"]) == len(want["labels"]), where
            for g, w in zip(got["labels"], want["labels"]):
                assert g[1:] == w[1:] and abs(g[0] - w[0]) < 1e-9, (where, g, w)
            n += 1
        assert n >= 6 * len(ZOOMED)
    finally:
        page.close()


@pytest.fixture(scope="module")
def long_page(long_trace, tmp_path_factory) -> Path:
    return Path(export_html(long_trace, tmp_path_factory.mktemp("page") / "long.html"))


def _measure(page, fig_id: str) -> dict:
    return page.evaluate(_MEASURE, [fig_id])[0]


def _zoom(page, fig_id: str, relayout: dict, shot: str) -> tuple[dict, np.ndarray]:
    page.evaluate("([id, r]) => Plotly.relayout(id, r)", [fig_id, relayout])
    page.wait_for_timeout(800)  # the redraw the relayout event starts
    path = SHOTS / f"export_{shot}.png"
    page.locator(f"#{fig_id}").screenshot(path=str(path))
    return _measure(page, fig_id), np.asarray(Image.open(path).convert("RGB"))


@pytest.mark.slow
def test_a_zoom_in_the_exported_page_reveals_per_token_cells(long_page, long_trace, browser):
    SHOTS.mkdir(parents=True, exist_ok=True)
    trace = pt.open(long_trace)
    step = _largest_step(trace)
    page = browser.new_page(viewport={"width": 1300, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(long_page.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        steps = embedded_data(long_page.read_text(encoding="utf-8"))["steps"]
        page.locator("#step").evaluate("(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }",
                                       steps.index(step))
        page.wait_for_timeout(500)
        whole, img = _zoom(page, "fig-token_order", {}, "16k_token_order")
        ax = whole["axes"]["x"]
        assert ax["range"] == pytest.approx([0, 16384]) and whole["cellText"] == 0
        # a rank lane (the global lane carries the request names since the 16-request views): runs, no cells
        assert _gaps(img, ax, ax["lanes"][-1]) < 20  # runs: a handful of chunk boundaries, no cells
        cases = [("fig-token_order", "x", {"xaxis.range": [5000, 5060]}, 0),   # the global lane
                 ("fig-token_order", "x", {"xaxis.range": [1000, 1060]}, 1),   # rank 0's rows
                 ("fig-slot_mappings", "x2", {"xaxis2.range": [7000, 7060]}, 0),  # gathered slots
                 ("fig-block_tables", "x", {"xaxis.range": [100, 160]}, 0)]    # block ids, all three rows
        for fig_id, key, relayout, lane in cases:
            shot = f"16k_{fig_id[4:]}_{key}_{list(relayout.values())[0][0]}"
            m, img = _zoom(page, fig_id, relayout, shot)
            a = m["axes"][key]
            assert a["range"] == pytest.approx(list(relayout.values())[0]), a["range"]
            y = a["lanes"][lane] if a["lanes"] else (a["y0"] + a["y1"]) / 2
            gaps = _gaps(img, a, y)
            assert gaps >= 0.9 * 60 - 1, f"{shot}: zoomed to 60 tokens, {gaps} cell boundaries drawn"
            if fig_id == "fig-token_order":  # a chunk digit fits a 60th of the plot; 4-5 digit slot ids do not
                assert m["cellText"] >= 60, f"{shot}: {m['cellText']} cell texts"
            else:  # then the runs are labelled instead, inside the window
                assert [t for t in m["texts"] if t["x0"] >= a["x0"] - 1 and t["x1"] <= a["x1"] + 1], shot
        reset, _ = _zoom(page, "fig-token_order", {"xaxis.autorange": True}, "16k_token_order_reset")
        assert reset["axes"]["x"]["range"] == pytest.approx([0, 16384]) and reset["cellText"] == 0
        assert not errors, errors
    finally:
        page.close()


@pytest.mark.slow
def test_past_the_size_caps_a_page_keeps_its_runs_and_says_so(tmp_path, monkeypatch):
    trace = REPO / "data" / "traces" / "cpu-pcp2-mtp2"
    full = embedded_data(Path(export_html(trace, tmp_path / "a.html")).read_text(encoding="utf-8"))
    runs = {k: tk.num_runs(e["tokens"]) for k, e in full["figs"].items()}
    assert all(r > 0 for r in runs.values()) and all(set(e["tokens"]) == set(PANELS) - {"acceptance"}
                                                     for e in full["figs"].values())
    first = next(iter(runs))
    monkeypatch.setattr(tk, "MAX_REPORT_RUNS", runs[first])  # room for the first page only
    capped = embedded_data(Path(export_html(trace, tmp_path / "b.html")).read_text(encoding="utf-8"))
    assert capped["figs"][first]["tokens"] and "not embedded" not in capped["figs"][first]["status"]
    rest = [e for k, e in capped["figs"].items() if k != first]
    assert all(not e["tokens"] and "per-token detail not embedded" in e["status"] for e in rest)
    assert "runs are spent" in rest[0]["status"]
    monkeypatch.setattr(tk, "MAX_PAGE_RUNS", 3)
    page = embedded_data(Path(export_html(trace, tmp_path / "c.html")).read_text(encoding="utf-8"))
    assert all(not e["tokens"] and "runs &gt; 3 a page" not in e["status"] and "> 3 a page" in e["status"]
               for e in page["figs"].values())
    json.dumps(page)  # plain JSON


PCP1 = sorted(p.name for p in (REPO / "data" / "traces").iterdir() if p.name.startswith("vllm-h200x1-pcp1"))


@pytest.mark.slow
@pytest.mark.parametrize("name", PCP1)
def test_a_pcp1_trace_exports_drawn_and_zooms_to_tokens(name, browser, tmp_path):
    """A PCP=1 run records no layout views; its export lays every step out as the identity (rank
    0's rows are the global tokens), as the Workbench does: every view drawn on every page, at
    the largest step the token-order lanes filled and a zoom to 60 tokens one cell per token."""
    trace = pt.open(REPO / "data" / "traces" / name)
    step = _largest_step(trace)
    out = Path(export_html(trace, tmp_path / f"{name}.html"))
    data = embedded_data(out.read_text(encoding="utf-8"))
    for key, entry in data["figs"].items():
        for view in data["views"]:
            title = str(entry[view]["layout"].get("title", {}).get("text", ""))
            assert "cannot draw" not in title and entry[view]["data"], (key, view, title)
        assert entry["tokens"]["token_order"] and "PCP=1" in entry["token_order"]["layout"]["title"]["text"]
    page = browser.new_page(viewport={"width": 1300, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(out.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        page.locator("#step").evaluate("(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }",
                                       data["steps"].index(step))
        page.wait_for_timeout(500)
        titles = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(p => "
                               "(p.querySelector('.gtitle') || {}).textContent || '')")
        assert len(titles) == len(PANELS) and all(titles) and "PCP=1" in titles[0], titles
        m, img = _zoom(page, "fig-token_order", {}, f"pcp1_{name}")
        ax = m["axes"]["x"]
        row = img[int(round(ax["lanes"][0])), int(ax["x0"]) + 1:int(ax["x1"]) - 1, :3].astype(int)
        assert ((255 - row).max(axis=1) > 24).mean() > 0.95, "the global lane of a PCP=1 step is not drawn"
        t = int(np.asarray(trace.record(step, 0, "target")["num_scheduled_tokens"]).sum())
        lo = t // 3
        m, img = _zoom(page, "fig-token_order", {"xaxis.range": [lo, lo + 60]}, f"pcp1_{name}_zoom")
        a = m["axes"]["x"]
        assert _gaps(img, a, a["lanes"][0]) >= 0.9 * 60 - 1 and m["cellText"] >= 60
        assert not errors, errors
    finally:
        page.close()
