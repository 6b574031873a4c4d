"""``figure_json`` gives what plotly's own encoder gives, on every panel of real traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest

import pcpviz.trace as pt
from pcpviz.views.export.plotly_json import figure_json
from pcpviz.views.figures.canvas import TEMPLATE
from pcpviz.views import figures as fg
from pcpviz.views.panels import PanelInput, run_panels, step_panels

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def plotly_json(spec: dict) -> dict:
    return json.loads(pio.to_json(go.Figure(spec, _validate=False), validate=False, remove_uids=True))


@pytest.mark.parametrize("name", ["vllm-h200x2-pcp2-mtp2-chunked", "vllm-h200x1-pcp1-mtp2"])
def test_equal_to_plotly_on_real_panels(name):
    t = pt.open(TRACES / name)
    colors = fg.request_color_index(fg.trace_req_ids(t))
    specs = []
    for step in t.steps[:: max(1, len(t.steps) // 6)]:
        for rank in t.ranks:
            recs = {p: t.record(step, rank, p) for p in t.phases(step, rank) if p != "dummy"}
            dp = fg.draft_source_phase(recs, None)
            inp = PanelInput(step=step, rank=rank, recs=recs, phase=dp, draft_phase=dp, colors=colors, flags=[])
            specs += [fg.drawn(p.name, lambda p=p: p.spec(inp), step=step, rank=rank, recs=recs)
                      for p in step_panels()]
    specs += [p.spec(PanelInput(colors=colors, acceptance=fg.load_acceptance(t))) for p in run_panels()]
    assert len(specs) > 10
    for spec in specs:
        assert json.loads(json.dumps(figure_json(spec), allow_nan=False)) == plotly_json(spec)


def test_typed_arrays_and_edge_values():
    spec = {"data": [{"type": "heatmap", "uid": "u1", "z": np.arange(6, dtype=np.int64).reshape(2, 3),
                      "x": np.array([1.5, np.nan]), "y": np.array([2**40, 1]), "text": np.array(["a", "<b>"]),
                      "customdata": np.array([True, False]), "w": np.array([], dtype=np.int64)}],
            "layout": {"template": TEMPLATE, "xaxis": {"range": np.array([0.0, 1.0])}, "title": {"text": "t"},
                       "n": np.int32(3), "f": float("inf"), "shapes": ({"x0": np.float64(0.5)},)}}
    out = figure_json(spec)
    assert out == plotly_json(spec)
    z = out["data"][0]["z"]
    assert z["dtype"] == "i1" and z["shape"] == "2, 3"
    assert np.frombuffer(__import__("base64").b64decode(z["bdata"]), np.int8).tolist() == list(range(6))
    assert out["data"][0]["y"] == [2**40, 1]  # no 64-bit typed arrays in plotly.js: a list
    assert "uid" not in out["data"][0] and out["layout"]["f"] is None and out["layout"]["xaxis"]["range"] == [0, 1]
    assert spec["data"][0]["uid"] == "u1"  # the spec is left as it was
    # no template: none is added (plotly would add its default one; every pcpviz figure has its own)
    assert "template" not in figure_json({"data": [], "layout": {}})["layout"]
