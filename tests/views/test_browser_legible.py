"""Big steps legible at full view, drawn by plotly.js in Chromium (issue 39 item 10).

Steps of 16 requests at 16k and 128k tokens (``pcpviz.synthetic``; PCP = 4, 8) are drawn as
the Workbench lays them out (each figure one column wide) and screenshot to
``artifacts/views/legible_<size>_<view>.png``; in pixels:

* rank 0's lane shows its padding: at least 3 px in the padding grey;
* the global lane shows 16 distinct request colours;
* every run label and subplot title is drawn at 11 px or more, and no two texts overlap.

Notebook 01's layout figure (``LayoutBuilder``, plotly's default 700 px) is drawn too: its
subplot titles must not overlap (the two index-map titles used to run into each other).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from pcpviz.synthetic import RequestSpec, generate
from pcpviz.views.figures.palette import PAD_COLOR, REQUEST_COLORS
from pcpviz.views.widgets import LayoutBuilder, Workbench
from test_browser_views import SHOTS, _MEASURE, _jsonable, _no_overlaps
from test_browser_views import plotly_js  # noqa: F401 (the plotly.js fixture)

pytestmark = pytest.mark.slow  # Chromium

SIZES = {"16k": (16384, 4), "128k": (131072, 8)}
VIEWS = ("token_order", "block_tables", "slot_mappings")
_FONTS = """(id) => [...document.getElementById(id).querySelectorAll('.infolayer .annotation text, .hm text')]
  .filter(t => t.textContent.trim()).map(t => parseFloat(getComputedStyle(t).fontSize))"""


def _rgb(c: str) -> np.ndarray:
    return np.array([int(c.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)])


def _draw(browser, js, specs: dict, width: int, stem: str) -> tuple[dict, dict, dict]:
    page = browser.new_page(viewport={"width": width + 40, "height": 1400})
    try:
        divs = "".join(f"<div id='{k}' style='width:{width}px'></div>" for k in specs)
        page.set_content(f"<html><body style='margin:0;background:#fff'>{divs}</body></html>")
        page.add_script_tag(path=str(js))
        page.evaluate("""([specs, w]) => Promise.all(Object.entries(specs).map(([k, s]) =>
            Plotly.newPlot(k, s.data, Object.assign({}, s.layout, {width: w}), {staticPlot: true})))""",
                      [json.loads(json.dumps(specs, default=_jsonable)), width])
        measured = dict(zip(specs, page.evaluate(_MEASURE, list(specs))))
        fonts = {k: page.evaluate(_FONTS, k) for k in specs}
        shots = {}
        for k in specs:
            shots[k] = SHOTS / f"{stem}_{k}.png"
            page.locator(f"#{k}").screenshot(path=str(shots[k]))
        return measured, fonts, shots
    finally:
        page.close()


@pytest.mark.parametrize("size", list(SIZES))
def test_sixteen_requests_show_padding_colours_and_readable_labels(size, browser, plotly_js, tmp_path):  # noqa: F811
    tokens, pcp = SIZES[size]
    # uneven prompts: each rank gets padding rows
    reqs = [RequestSpec(f"r{i}", tokens // 16 - 3 * (i % 4), 2) for i in range(16)]
    run = generate(reqs, pcp=pcp, num_speculative_tokens=2, block_size=16, max_num_batched_tokens=tokens,
                   max_num_reqs=16)
    wb = Workbench(run.write(tmp_path / "trace"), checks=False)
    SHOTS.mkdir(parents=True, exist_ok=True)
    measured, fonts, shots = _draw(browser, plotly_js, {v: wb._spec(v) for v in VIEWS}, wb.width, f"legible_{size}")
    img = np.asarray(Image.open(shots["token_order"]).convert("RGB")).astype(int)
    ax = measured["token_order"]["axes"]["x"]
    x0, x1 = int(round(ax["x0"])) + 1, int(round(ax["x1"])) - 1
    glob, rank0 = (img[int(round(y)), x0:x1] for y in ax["lanes"][:2])
    assert (np.abs(rank0 - _rgb(PAD_COLOR)).max(axis=1) <= 8).sum() >= 3, "rank 0's padding is not drawn grey"
    seen = {c for c in REQUEST_COLORS if (np.abs(glob - _rgb(c)).max(axis=1) <= 8).any()}
    assert len(seen) == 16, f"{len(seen)} request colours on the global lane"
    for v in VIEWS:
        assert fonts[v] and min(fonts[v]) >= 11, (v, sorted(set(fonts[v])))
        _no_overlaps(measured[v]["texts"], f"{size} {v}")


def test_notebook_01_subplot_titles_do_not_overlap(browser, plotly_js):  # noqa: F811
    fig = LayoutBuilder(prompts="13, 7", decodes="1, 4", pcp=2, decode_mode="sharded").figure
    spec = json.loads(fig.to_json())
    page = browser.new_page(viewport={"width": 760, "height": 900})
    try:
        page.set_content("<html><body style='margin:0'><div id='f' style='width:700px'></div></body></html>")
        page.add_script_tag(path=str(plotly_js))
        page.evaluate("(s) => Plotly.newPlot('f', s.data, Object.assign({}, s.layout, {width: 700}))", spec)
        boxes = page.evaluate("""() => [...document.querySelectorAll('#f .infolayer .annotation')].map(a => {
            const r = a.getBoundingClientRect(); return {text: a.textContent, x0: r.left, x1: r.right,
                                                          y0: r.top, y1: r.bottom}; })""")
        page.locator("#f").screenshot(path=str(SHOTS / "legible_01_layout.png"))
    finally:
        page.close()
    assert len(boxes) >= 4
    _no_overlaps(boxes, "notebook 01's subplot titles")
