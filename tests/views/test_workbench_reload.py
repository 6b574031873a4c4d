"""What a page reload with the kernel alive gets back (``pcpviz.views.widgets.figure``): each
figure's state is the figure it shows now, plotly's bundle travels once per kernel, and a figure
whose front end stopped hearing the kernel is replaced by one drawing the same figure. The
browser side is ``tests/views/test_browser.py`` (reload in JupyterLab)."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.widgets import Workbench
from pcpviz.views.widgets import figure as wf
from pcpviz.views.widgets.workbench import MAX_REPLACEMENTS, VIEW_NAMES
from test_workbench import TRACE


def _plain(o):
    if isinstance(o, memoryview):  # plotly's binary arrays in widget state
        return o.tolist()
    if isinstance(o, (np.ndarray, np.generic)):
        return o.tolist()
    raise TypeError(type(o))


def _figure_json(data, layout) -> dict:
    """A figure from widget values as plain JSON: trace uids left out, plotly's binary arrays
    (``{"buffer", "dtype", "shape"}``) and NumPy arrays as lists of their values."""
    data = json.loads(json.dumps(list(data), default=_plain))
    for t in data:
        t.pop("uid", None)
        for k, v in list(t.items()):
            if isinstance(v, dict) and "buffer" in v and "dtype" in v:
                t[k] = v["buffer"]
    return {"data": data, "layout": json.loads(json.dumps(layout, default=_plain))}


def _shown(fw) -> dict:
    return _figure_json([t.to_plotly_json() for t in fw.data], fw.layout.to_plotly_json())


def _from_state(fw) -> dict:
    st = fw.get_state()
    return _figure_json(st["_widget_data"], st["_widget_layout"])


def test_a_figures_state_is_what_it_shows_after_control_changes():
    wb = Workbench(TRACE, checks=False)
    wb.set(step=3, rank=1, highlight=wb.req_ids[0])
    wb.zoom("token_order", xaxis=(0, 12))
    for name in VIEW_NAMES:
        fw = wb.figures[name]
        assert _from_state(fw) == _shown(fw), name
    title = wb.figures["token_order"].get_state()["_widget_layout"]["title"]["text"]
    assert title == wb.figures["token_order"].layout.title.text and "req" in title
    plain = go.FigureWidget(layout={"height": 300})  # plotly's own: the state is the figure as built
    plain.add_scatter(x=[1, 2], y=[3, 4])
    assert plain.get_state()["_widget_data"] == []


def test_plotlys_bundle_travels_once_per_kernel_not_once_per_figure():
    wb = Workbench(TRACE, checks=False)
    src = wf.PLOTLY_BUNDLE.read_text(encoding="utf-8")
    carrier = wf.bundle_carrier()
    assert carrier is wf.bundle_carrier() and carrier.comm is not None
    assert json.dumps(src) in carrier.get_state()["_esm"]
    for fw in wb.figures.values():
        esm = fw.get_state()["_esm"]
        assert len(esm) < 5_000 and "slot().promise" in esm and "pcpviz: \"deaf\"" in esm
    carrier.close()
    assert wf.bundle_carrier() is not carrier  # closed (Widget.close_all): a new one carries it


def _widget_tree(w) -> list:
    """``w`` and every widget below it (boxes and grids hold theirs in ``children``)."""
    out = [w]
    for c in getattr(w, "children", ()) or ():
        out += _widget_tree(c)
    return out


def test_ping_is_answered_and_a_deaf_figure_is_replaced_by_one_drawing_the_same(widget_messages):
    wb = Workbench(TRACE, checks=False)
    wb.set(step=2, rank=1)
    old = wb.figures["token_order"]
    before = _shown(old)
    old._front_end_msg(old, {"pcpviz": "ping"}, [])
    assert ("RestorableFigureWidget", {"method": "custom", "content": {"pcpviz": "pong"}}) in widget_messages.sent
    old._front_end_msg(old, {"pcpviz": "deaf"}, [])
    new = wb.figures["token_order"]
    assert new is not old and old.comm is None
    tree = _widget_tree(wb)  # the figures sit in the Workbench's grid
    assert any(w is new for w in tree) and not any(w is old for w in tree)
    assert _shown(new) == before and wb.replaced["token_order"] == 1
    old._front_end_msg(old, {"pcpviz": "deaf"}, [])  # a late report from the closed one: nothing
    assert wb.figures["token_order"] is new
    # the new one takes zooms from the browser (plotly's relayout message) and control changes
    new._js2py_relayout = {"relayout_data": {"xaxis.range[0]": 0, "xaxis.range[1]": 10}, "source_view_id": "v"}
    assert wb.windows["token_order"]["xaxis"] == (0.0, 10.0)
    wb.set(step=3)
    assert _shown(wb.figures["token_order"]) != before
    for _ in range(MAX_REPLACEMENTS + 2):  # a front end that never hears the kernel: bounded
        fw = wb.figures["token_order"]
        fw._front_end_msg(fw, {"pcpviz": "deaf"}, [])
    assert wb.replaced["token_order"] == MAX_REPLACEMENTS
