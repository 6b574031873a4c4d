"""How the Workbench stays fast without showing anything stale: figure specs pushed as differences
(``pcpviz.views.widgets.push``), figures cached per control state and dropped when the trace changes,
a token-order figure whose trace structure does not change between steps, and lane-by-lane runs
that equal runs over all lanes at once."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest

import pcpviz.trace as pt
from pcpviz.views import figures as fg
from pcpviz.views.figures.lod import PAD_MIN_PX, pixel_cells
from pcpviz.views.figures.token_order import _lane_rows, _lane_runs
from pcpviz.synthetic import long_prompt_run
from pcpviz.views.widgets import Workbench
from pcpviz.views.widgets.push import push_spec, same
from pcpviz.views.widgets.workbench import VIEW_NAMES
from test_workbench import TRACE, _big_step


def _state(fw: go.FigureWidget) -> dict:
    """What a FigureWidget holds, as JSON values (trace uids left out)."""
    d = json.loads(pio.to_json(fw.to_plotly_json(), validate=False))
    for t in d["data"]:
        t.pop("uid", None)
    return d


def _spec(z, *, title="a", notes=("one",), extra_trace=False) -> dict:
    data = [{"type": "heatmap", "z": z, "x": [0, 1, 2], "colorscale": [[0, "#fff"], [1, "#000"]]},
            {"type": "scatter", "x": [1, 2], "y": [3, 4], "mode": "lines", "line": {"color": "#111"}}]
    if extra_trace:
        data.append({"type": "bar", "x": [1], "y": [1]})
    layout = {"title": {"text": title}, "xaxis": {"domain": [0, 1]}, "height": 300,
              "annotations": [{"text": t, "x": 0, "y": 0, "showarrow": False} for t in notes],
              "shapes": [{"type": "line", "x0": 0, "x1": 1, "y0": 0, "y1": 1}]}
    if title is None:
        del layout["title"]
    return {"data": data, "layout": layout}


def test_push_sends_only_what_changed_and_the_widget_holds_the_new_spec(monkeypatch):
    fw = go.FigureWidget()
    shown = push_spec(fw, _spec([[1.0, 2.0]]), None, width=500)
    uids = [t.uid for t in fw.data]
    sent = []
    real = fw.plotly_update
    monkeypatch.setattr(fw, "plotly_update", lambda **kw: (sent.append(kw), real(**kw)))
    new = _spec([[5.0, None]], title=None, notes=("one", "two"))
    shown = push_spec(fw, new, shown, width=500)
    assert len(sent) == 1
    assert sent[0]["trace_indexes"] == [0] and set(sent[0]["restyle_data"]) == {"z"}  # only the heatmap's z
    assert set(sent[0]["relayout_data"]) == {"annotations", "title"}  # unchanged axes, shapes not resent
    assert sent[0]["relayout_data"]["title"] is None  # a key the new spec lacks is cleared
    assert [t.uid for t in fw.data] == uids  # restyled in place
    # the Python side reads the new values (no stale annotation tuple of the old length)
    assert [a.text for a in fw.layout.annotations] == ["one", "two"]
    assert fw.layout.title.text is None
    fresh = go.FigureWidget()
    push_spec(fresh, new, None, width=500)
    assert _state(fw) == _state(fresh)
    # nothing changed: nothing sent
    push_spec(fw, new, shown, width=500)
    assert len(sent) == 1
    # another trace structure: the traces are replaced
    push_spec(fw, _spec([[1.0, 2.0]], extra_trace=True), shown, width=500)
    assert len(fw.data) == 3 and fw.data[0].uid != uids[0]


def test_same_compares_figure_values():
    assert same([[1.0, None]], np.array([[1.0, None]], dtype=object))
    assert same(np.array([1.0, np.nan]), np.array([1.0, np.nan]))
    assert same({"a": [1, 2], "b": "x"}, {"a": np.array([1, 2]), "b": "x"})
    assert not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2})
    assert not same(np.array(["a", "b"], dtype=object), np.array(["a", "c"], dtype=object))
    assert not same([[1, 2], [3]], np.array([1, 2]))  # ragged against an array
    assert same(float("nan"), float("nan")) and not same(None, 0)


def test_marking_a_violation_on_a_spec_leaves_the_spec_unchanged():
    spec = fg.token_order_spec(pt.open(TRACE).record(0, 0, "target"), rank=0)
    n = len(spec["layout"]["annotations"])
    marked = fg.mark_violation(spec, "slot_mapping_gathered: row 3")
    assert len(marked["layout"]["annotations"]) == n + 1 and len(spec["layout"]["annotations"]) == n
    assert marked["layout"]["annotations"][-1]["text"].startswith("✗ slot_mapping_gathered")


@pytest.fixture(scope="module")
def pcp8_trace(tmp_path_factory):
    """A synthetic PCP=8, K=3 trace: a 4096-token prompt in one step next to short requests."""
    run = long_prompt_run(pcp=8, prompt_len=4096, chunk=4096, num_short=3, max_new_tokens=10,
                          num_speculative_tokens=3)
    return run.write(tmp_path_factory.mktemp("pcp8") / "trace")


@pytest.mark.slow
def test_every_control_change_leaves_each_view_as_a_fresh_workbench_draws_it(pcp8_trace):
    trace = pt.open(pcp8_trace)
    wb = Workbench(trace, checks=False)
    steps, ranks = trace.steps, trace.ranks
    moves = [("step", steps[1]), ("phase", "draft_0"), ("rank", 3), ("highlight", wb.req_ids[1]),
             ("step", steps[0]), ("phase", "verify"), ("rank", 7), ("highlight", ""), ("step", steps[-1]),
             ("step", steps[0]), ("rank", 0), ("phase", "draft_2")]
    for control, value in moves:
        if value not in [o[1] if isinstance(o, tuple) else o for o in getattr(wb, control).options]:
            continue
        setattr(getattr(wb, control), "value", value)
        fresh = Workbench(trace, checks=False, step=wb.step.value, rank=wb.rank.value, phase=wb.phase.value,
                          highlight=wb.highlight.value)
        for name in VIEW_NAMES:
            assert _state(wb.figures[name]) == _state(fresh.figures[name]), (control, value, name)
    assert ranks == list(range(8)) and trace.meta["num_speculative_tokens"] == 3


def test_a_revisited_state_is_served_from_the_cache(pcp8_trace):
    wb = Workbench(pt.open(pcp8_trace), checks=False)
    s0, s1 = wb.trace.steps[0], wb.trace.steps[1]
    before = {n: _state(f) for n, f in wb.figures.items()}
    wb.step.value = s1
    cached = len(wb._specs)
    wb.step.value = s0
    assert len(wb._specs) == cached  # nothing new was built
    assert {n: _state(f) for n, f in wb.figures.items()} == before
    wb.clear_cache()
    wb.step.value = s1
    assert len(wb._specs) == 6  # the five step views and the acceptance figure its marker is laid on


def test_the_cache_is_dropped_when_the_trace_changes(tmp_path):
    src = pt.open(TRACE)
    out = tmp_path / "shifted"
    for i, rank in enumerate(src.ranks):  # the same trace with step 1's positions moved by 1000
        with pt.TraceWriter(out, rank, meta=dict(src.meta) if i == 0 else None) as w:
            for s in src.steps:
                phases = {p: {k: np.asarray(v) for k, v in src.record(s, rank, p).items()} for p in src.phases(s, rank)}
                if s == 1:
                    phases["target"]["positions"] = phases["target"]["positions"] + 1000
                w.write_step(s, phases)
    wb = Workbench(src, checks=False, step=1)
    text = json.dumps(_state(wb.figures["timeline"])["data"][0]["text"])
    wb.step.value = 0
    wb.trace = pt.open(out)
    wb.step.value = 1
    shifted = json.dumps(_state(wb.figures["timeline"])["data"][0]["text"])
    assert shifted != text and "pos 100" in shifted


def test_token_order_keeps_its_trace_structure_across_steps_and_highlights():
    big, _ = _big_step()
    small = pt.open(TRACE).record(0, 0, "target")

    def structure(spec):
        return [(t["type"], sorted(t)) for t in spec["data"]]

    ref = structure(fg.token_order_spec(small, rank=0))
    assert structure(fg.token_order_spec(big, rank=0)) == ref
    assert structure(fg.token_order_spec(big, rank=1, highlight="long")) == ref
    assert structure(fg.token_order_spec(small, rank=1, highlight="req1")) == ref


@pytest.mark.parametrize("which", ["big", "shipped"])
def test_lanes_share_the_union_of_their_pixel_cells(which):
    target = _big_step()[0] if which == "big" else pt.open(TRACE).record(1, 1, "target")
    sl = fg.step_layout(target)
    rows = _lane_rows(sl)
    width = max(sl.num_tokens, sl.padded, 1)
    lanes = fg.token_order_spec(target, rank=0)["data"][0]
    x = np.asarray(lanes["x"], dtype=float)
    z = np.array(lanes["z"], dtype=float)
    assert z.shape == (sl.pcp + 1, x.shape[0] - 1)
    if width <= fg.PLOT_PX / 4:  # per token
        assert x.tolist() == list(range(width + 1))
        return
    u = width / fg.PLOT_PX
    cuts = set()
    for (rq, _, _), e in zip(rows, _lane_runs(rows)):
        mp = np.where(rq[e[:-1]] >= 0, 0, PAD_MIN_PX)  # padding runs are drawn at least PAD_MIN_PX wide
        e, mp = (e, mp) if e[-1] >= width else (np.append(e, width), np.append(mp, 0))
        cuts |= set(pixel_cells(e, 0, width, px=fg.PLOT_PX, min_px=mp)[0].tolist())
    assert np.allclose(x, np.array(sorted(cuts)) * u)
