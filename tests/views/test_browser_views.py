"""The views at real sizes, drawn by plotly.js in Debian's Chromium and checked in pixels.

For every shipped trace at its largest step and for synthetic steps of 2k, 16k and 128k tokens
(``pcpviz.synthetic.long_prompt_run``), the Workbench's figures (the specs it pushes to its
``FigureWidget``s, ``Workbench._spec``) are drawn as wide as the Workbench draws them (one column of
its grid), screenshot to ``artifacts/views/<case>_<view>.png``, and checked:

* **marks in proportion**: along each lane of the token-order view, each strip of the slot
  mappings and each row of the block tables, the share of plot-area pixels that are not
  background matches the share of the lane the trace's data fills (a rank's P rows of a strip
  as wide as T tokens, the non-null block ids of a row) — sub-pixel cells with 1 px gaps draw
  almost nothing and fail this;
* **labels do not overlap**: the bounding boxes of every drawn text (run labels, cell text,
  annotations) are pairwise disjoint;
* **a zoom reveals per-token cells**: the token-order view zoomed to 60 tokens, or as many as
  have room for a digit each (as a zoom in
  the browser asks the Workbench, ``Workbench.zoom``) draws one cell per token (a 1 px gap
  between consecutive cells) with each cell's chunk as text.

``PCPVIZ_LOD=0`` turns the level of detail off (``pcpviz.views.figures.lod``): this test then
fails, which is how it was shown to be able to fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pcpviz.trace import open as open_trace
from pcpviz.views import figures as fg
from pcpviz.views.widgets import Workbench
from pcpviz.views.figures.lod import label_px
from test_browser import REPO  # tests/views is on sys.path (rootless test dirs)

pytestmark = pytest.mark.slow  # JupyterLab and Chromium in a real browser

SHOTS = REPO / "artifacts" / "views"
TRACES = sorted(p for p in (REPO / "data" / "traces").iterdir() if (p / "run.json").exists() or any(p.glob("rank*")))
SYNTHETIC = {"synthetic-2k": (2048, 2), "synthetic-16k": (16384, 4), "synthetic-128k": (131072, 8)}
VIEWS = ("token_order", "timeline", "block_tables", "slot_mappings", "acceptance")
BG_DIFF = 24  # a pixel differing from white by more than this is a mark (grid lines #ececec are not)


@pytest.fixture(scope="module")
def plotly_js(tmp_path_factory) -> Path:
    from plotly.offline import get_plotlyjs

    path = tmp_path_factory.mktemp("js") / "plotly.min.js"
    path.write_text(get_plotlyjs())
    return path


def _largest_step(trace) -> int:
    def tokens(s):
        rec = trace.record(s, trace.ranks[0], "target") if trace.has(s, trace.ranks[0], "target") else None
        return int(np.asarray(rec["num_scheduled_tokens"]).sum()) if rec is not None else -1
    return max(trace.steps, key=tokens)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    from pcpviz.synthetic import long_prompt_run

    out = {}
    for name, (t, pcp) in SYNTHETIC.items():
        run = long_prompt_run(pcp=pcp, prompt_len=t, chunk=t, num_short=3, max_new_tokens=4,
                              num_speculative_tokens=2)
        out[name] = run.write(tmp_path_factory.mktemp(name) / "trace")
    return out


_MEASURE = """(ids) => ids.map(id => {
  const gd = document.getElementById(id), fl = gd._fullLayout, box = gd.getBoundingClientRect();
  const axes = {};
  for (const k of Object.keys(fl)) {
    const m = k.match(/^xaxis(\\d*)$/);
    if (!m) continue;
    const xa = fl[k], ya = fl['yaxis' + m[1]];
    if (!ya) continue;
    const n = (ya._categories || []).length;
    axes['x' + m[1]] = {x0: xa._offset, x1: xa._offset + xa._length, y0: ya._offset, y1: ya._offset + ya._length,
                        lanes: [...Array(n).keys()].map(i => ya._offset + ya.l2p(i)), range: xa.range};
  }
  const texts = [...gd.querySelectorAll('.cartesianlayer text, .infolayer .annotation text')]
    .filter(t => t.textContent.trim() && !t.closest('.xtick, .ytick, .g-xtitle, .g-ytitle'))
    .map(t => { const r = t.getBoundingClientRect();
                return {text: t.textContent, x0: r.left - box.left, x1: r.right - box.left,
                        y0: r.top - box.top, y1: r.bottom - box.top}; })
    .filter(r => r.x1 > r.x0);
  return {axes, texts, cellText: gd.querySelectorAll('.heatmaplayer text, .hm text').length};
})"""


def _draw(browser, plotly_js: Path, specs: dict[str, dict], stem: str, width: int = 940) -> tuple[dict, dict]:
    """Draw ``specs`` (view -> spec) in one page, ``width`` px wide (the Workbench's figure width);
    screenshots and measurements per view."""
    page = browser.new_page(viewport={"width": width + 60, "height": 1200})
    try:
        divs = "".join(f"<div id='{k}' style='width:{width}px'></div>" for k in specs)
        page.set_content(f"<html><body style='margin:0;background:#fff'>{divs}</body></html>")
        page.add_script_tag(path=str(plotly_js))
        page.evaluate("""([specs, w]) => Promise.all(Object.entries(specs).map(([k, s]) =>
            Plotly.newPlot(k, s.data, Object.assign({}, s.layout, {width: w}), {staticPlot: true})))""",
                      [json.loads(json.dumps(specs, default=_jsonable)), width])
        measured = dict(zip(specs, page.evaluate(_MEASURE, list(specs))))
        shots = {}
        for k in specs:
            path = SHOTS / f"{stem}_{k}.png"
            page.locator(f"#{k}").screenshot(path=str(path))
            shots[k] = path
        return measured, shots
    finally:
        page.close()


def _jsonable(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))


TEXT_CLEAR = 7
"""Rows are sampled this many px (at most 0.3 lane pitches) below a lane's centre, under its labels
(11 px text centred on the lane, black or white by cell: a white block id on blue is no mark, a dark
0 on a white null block is one), still inside the cell (a block-table row is ~20 px)."""


def _coverage(img: np.ndarray, ax: dict, y: float) -> float:
    """Share of the plot area's pixels along the row ``TEXT_CLEAR`` px below ``y`` that are marks
    (not near-white)."""
    x0, x1 = int(round(ax["x0"])) + 1, int(round(ax["x1"])) - 1
    lanes = ax.get("lanes") or []
    pitch = float(np.min(np.abs(np.diff(lanes)))) if len(lanes) > 1 else 4 * TEXT_CLEAR
    row = img[int(round(y + min(TEXT_CLEAR, 0.3 * pitch))), x0:x1, :3].astype(int)  # inside the lane's cell
    return float(((255 - row).max(axis=1) > BG_DIFF).mean())


def _gaps(img: np.ndarray, ax: dict, y: float) -> int:
    """Background stretches between marks along row ``y`` (cell separators)."""
    x0, x1 = int(round(ax["x0"])) + 1, int(round(ax["x1"])) - 1
    mark = (255 - img[int(round(y)), x0:x1, :3].astype(int)).max(axis=1) > BG_DIFF
    return int(np.sum(mark[:-1] & ~mark[1:]))


def _close(measured: float, expected: float, width_px: float, what: str, *, cells: float = 0) -> None:
    """``measured`` within 3% (+3 px) of ``expected``; per-token cells (at least 4 px each, ``cells``
    of them across the plot) each lose the 1 px gap drawn between them."""
    if cells and width_px / cells >= 4:
        expected *= 1 - cells / width_px
    tol = 0.03 + 3.0 / width_px
    assert abs(measured - expected) <= tol, f"{what}: {measured:.3f} of the lane drawn, expected {expected:.3f}"


def _no_overlaps(texts: list[dict], what: str) -> None:
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            w = min(a["x1"], b["x1"]) - max(a["x0"], b["x0"])
            h = min(a["y1"], b["y1"]) - max(a["y0"], b["y0"])
            assert w <= 1.0 or h <= 1.0, f"{what}: labels overlap: {a['text']!r} and {b['text']!r}"


def _widest_step(trace) -> int:
    """The step whose block tables are widest (the chunked trace's rows are 563 blocks wide)."""
    def width(s):
        rec = trace.record(s, trace.ranks[0], "target")
        bt = np.asarray(rec["block_table_global"]) if "block_table_global" in rec else np.zeros((1, 1))
        nz = np.flatnonzero(bt.reshape(-1, bt.shape[-1]).any(axis=0))
        return int(nz[-1]) + 1 if nz.size else 0
    return max((s for s in trace.steps if trace.has(s, trace.ranks[0], "target")), key=width)


WIDEST = "vllm-h200x2-pcp2-mtp2-chunked"


def _cases():
    return ([pytest.param(p.name, id=p.name) for p in TRACES] + [pytest.param(WIDEST + "@widest", id="chunked-widest")]
            + [pytest.param(n, id=n) for n in SYNTHETIC])


@pytest.mark.parametrize("case", _cases())
def test_views_draw_marks_in_proportion_without_overlaps_and_zoom_to_tokens(case, browser, plotly_js, synthetic):
    SHOTS.mkdir(parents=True, exist_ok=True)
    name = case.split("@")[0]
    trace = open_trace(synthetic[case] if case in synthetic else REPO / "data" / "traces" / name)
    step = _widest_step(trace) if case.endswith("@widest") else _largest_step(trace)
    case = case.replace("@", "-")
    wb = Workbench(trace, step=step, checks=False)
    specs = {v: wb._spec(v) for v in VIEWS}
    target = trace.record(step, wb.rank.value, "target")
    sl = fg.step_layout(target)
    span = min(60, max(sl.num_tokens, sl.padded), int(wb.px // label_px("0")))  # cells wide enough for a digit
    lo = max(0, min(sl.num_tokens // 3, max(sl.num_tokens, sl.padded) - span))
    wb.zoom("token_order", xaxis=(lo, lo + span))
    specs["token_order_zoom"] = wb._spec("token_order")
    measured, shots = _draw(browser, plotly_js, specs, f"{case}_step{step}", width=wb.width)
    for path in shots.values():
        print(path.relative_to(REPO))
    img = {k: np.asarray(Image.open(p).convert("RGB")) for k, p in shots.items()}

    # token order: global lane fills T of max(T, P), each rank lane P
    ax = measured["token_order"]["axes"]["x"]
    width = max(sl.num_tokens, sl.padded, 1)
    expect = [sl.num_tokens / width] + [sl.padded / width] * sl.pcp
    assert len(ax["lanes"]) == len(expect)
    for li, (y, e) in enumerate(zip(ax["lanes"], expect)):
        _close(_coverage(img["token_order"], ax, y), e, ax["x1"] - ax["x0"], f"{case} token order lane {li}",
               cells=width)
    mask_ax = measured["token_order"]["axes"]["x4"]
    _close(_coverage(img["token_order"], mask_ax, mask_ax["lanes"][0]), 1.0, mask_ax["x1"] - mask_ax["x0"],
           f"{case} KV write mask", cells=sl.pcp * sl.padded)

    # slot mappings: the global strip and the write mask are every entry drawn; the gathered strip
    # all but rows that hold a slot and no token (drawn white)
    # (a PCP=1 run records no gathered mapping: its strips are the global one, then the mask)
    sm = measured["slot_mappings"]["axes"]
    gathered = "slot_mapping_gathered" in target
    assert gathered or sl.pcp == 1, f"{case}: PCP={sl.pcp} step without slot_mapping_gathered"
    for key, name, n in (("x", "slot_mapping_global", sl.num_tokens),
                         ("x3" if gathered else "x2", "kv_write_mask", sl.pcp * sl.padded)):
        a = sm[key]
        _close(_coverage(img["slot_mappings"], a, (a["y0"] + a["y1"]) / 2), 1.0, a["x1"] - a["x0"], f"{case} {name}",
               cells=n)
    if gathered:
        gat = np.asarray(target["slot_mapping_gathered"]).reshape(-1, sl.pcp * sl.padded)[0]
        white = (gat >= 0) & (sl.row_req()[: gat.shape[0]] < 0)
        a = sm["x2"]
        _close(_coverage(img["slot_mappings"], a, (a["y0"] + a["y1"]) / 2), 1 - white.mean(), a["x1"] - a["x0"],
               f"{case} slot_mapping_gathered", cells=gat.shape[0])

    # block tables: each global row draws its non-null blocks over the used width
    bt = np.asarray(target["block_table_global"])
    bt = bt[0] if bt.ndim == 3 else bt
    a = measured["block_tables"]["axes"]["x"]
    w = int(round(a["range"][1]))
    for i, y in enumerate(a["lanes"][: bt.shape[0]]):
        row = np.pad(bt[i], (0, max(0, w - bt.shape[1])))[:w]
        _close(_coverage(img["block_tables"], a, y), float((row != 0).mean()), a["x1"] - a["x0"],
               f"{case} block_table_global row {i} ({w} columns)", cells=w)

    for view in ("token_order", "slot_mappings", "block_tables", "token_order_zoom"):
        _no_overlaps(measured[view]["texts"], f"{case} {view}")

    # the zoom: (up to) 60 per-token cells, 1 px apart, with their chunk as text
    z = measured["token_order_zoom"]["axes"]["x"]
    assert z["range"] == pytest.approx([lo, lo + span]), z["range"]
    gaps = _gaps(img["token_order_zoom"], z, z["lanes"][0])
    assert gaps >= 0.9 * span - 1, f"{case}: zoomed to {span} tokens the global lane shows {gaps} cell boundaries"
    assert measured["token_order_zoom"]["cellText"] >= span, measured["token_order_zoom"]["cellText"]
