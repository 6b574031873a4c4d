"""The Workbench on the Python side: linked controls, the views they update, aggregation of large
steps, acceptance, and the flags and check marks a faulty run gets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.trace.meta_model import decode_meta
from pcpviz.views import figures as fg
from pcpviz.views.figures.token_order import _lane_rows
from pcpviz.views.widgets import Workbench
from pcpviz.views.widgets.workbench import AFFECTS, VIEW_NAMES

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "traces" / "cpu-pcp2-mtp2"
L_DIM = 1  # pcpviz.views.figures.canvas' level of a dimmed cell


@pytest.fixture(scope="module")
def trace():
    return pt.open(TRACE)


@pytest.fixture()
def wb(trace):
    return Workbench(trace)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A real engine run (2 CPU ranks, K=2) that skips the block-table gather before the
    replicated draft decodes."""
    import pcpviz

    out = tmp_path_factory.mktemp("fault") / "trace"
    res = pcpviz.run(["def fib(n):\n    ", "import os\nimport sys\n"], pcp=2, num_speculative_tokens=2,
                     device="cpu", max_new_tokens=10, trace_dir=str(out), progress=False,
                     inject=["skip_draft_block_table_gather"])
    return res, out


def _lane_z(fw) -> np.ndarray:
    return np.asarray(fw.data[0].z, dtype=float)


# --------------------------------------------------------------------------- controls

def test_controls_start_on_the_first_step_and_offer_the_steps_ranks_requests(wb, trace):
    assert list(wb.step.options) == trace.steps
    assert wb.step.value == trace.steps[0]
    assert [v for _, v in wb.rank.options] == trace.ranks
    assert [v for _, v in wb.highlight.options] == ["", "req0", "req1", "req2"]
    assert set(wb.figures) == set(VIEW_NAMES)
    assert all(len(f.data) for f in wb.figures.values())


def test_step_change_updates_the_figures_data(wb, trace):
    fw = wb.figures["token_order"]
    z0, title0 = _lane_z(fw).copy(), fw.layout.title.text
    uid0 = fw.data[0].uid
    wb.step.value = 1
    t1 = trace.record(1, 0, "target")
    assert fw.layout.title.text != title0
    assert "requests req0, req2, req1" in fw.layout.title.text
    assert not np.array_equal(_lane_z(fw), z0, equal_nan=True)
    # global lane = one cell per token of step 1, coloured by request (req0 decode first)
    assert _lane_z(fw).shape[1] == int(t1["num_scheduled_tokens"].sum())
    # same trace structure -> restyled in place, not replaced
    assert fw.data[0].uid == uid0
    bt = wb.figures["block_tables"]
    assert list(bt.data[0].y) == ["g0 req0", "g1 req2", "g2 req1"]
    assert "step 1" in wb.status.value
    # the acceptance panel only moved its step marker
    assert wb.figures["acceptance"].layout.shapes[0].x0 == pytest.approx(0.5)


def test_a_control_change_renders_only_the_views_it_affects(wb):
    before = dict(wb.render_counts)
    wb.phase.value = "draft_0"
    delta = {k: wb.render_counts[k] - before.get(k, 0) for k in wb.render_counts}
    assert {k for k, v in delta.items() if v} == set(AFFECTS["phase"])
    before = dict(wb.render_counts)
    wb.step.value = 2
    delta = {k: wb.render_counts[k] - before.get(k, 0) for k in wb.render_counts}
    assert {k for k, v in delta.items() if v} == set(AFFECTS["step"])
    assert delta["acceptance"] == 0 and delta["acceptance_marker"] == 1


def test_phases_offered_match_the_trace(tmp_path, trace):
    # rewrite the shipped trace with step 2 missing draft_1 on every rank
    out = tmp_path / "trace"
    for i, rank in enumerate(trace.ranks):
        with pt.TraceWriter(out, rank, meta=dict(trace.meta) if i == 0 else None) as w:
            for s in trace.steps:
                phases = {p: {k: np.asarray(v) for k, v in trace.record(s, rank, p).items()}
                          for p in trace.phases(s, rank) if not (s == 2 and p == "draft_1")}
                w.write_step(s, phases)
    wb = Workbench(out, checks=False)
    for s in (0, 1, 2, 3):
        wb.step.value = s
        expected = sorted(pt.open(out).phases(s, 0), key=pt.phase_sort_key)
        assert list(wb.phase.options) == expected
    wb.step.value = 1
    wb.phase.value = "draft_1"
    wb.step.value = 2
    assert "draft_1" not in wb.phase.options
    assert wb.phase.value in wb.phase.options
    assert wb.draft_phase == "draft_0"  # the draft panels fall back to the draft step that exists
    assert "draft_0 rows" in wb.figures["block_tables"].layout.annotations[2].text


def test_rank_change_switches_the_local_rows(wb, trace):
    wb.set(step=1, phase="draft_0")
    bt = wb.figures["block_tables"]
    local0 = list(bt.data[1].y)
    assert local0 == [f"l{i} {r}" for i, r in enumerate(trace.record(1, 0, "target")["local_req_ids"])]
    timeline0 = [list(r) for r in wb.figures["timeline"].data[0].text]
    wb.rank.value = 1
    local1 = list(bt.data[1].y)
    assert local1 == [f"l{i} {r}" for i, r in enumerate(trace.record(1, 1, "target")["local_req_ids"])]
    assert local1 != local0
    assert "rank 1 local rows" in bt.layout.annotations[1].text
    # draft_0 is rank-local: its timeline column changes; draft_1 (replicated) does not
    timeline1 = [list(r) for r in wb.figures["timeline"].data[0].text]
    cols = [t.split("<br>")[0] for t in wb.figures["timeline"].layout.xaxis.ticktext]
    d0, d1 = cols.index("<b>draft_0</b> · rank-local"), cols.index("<b>draft_1</b> · replicated")
    assert [r[d0] for r in timeline0] != [r[d0] for r in timeline1]
    assert [r[d1] for r in timeline0] == [r[d1] for r in timeline1]
    # the selected rank's lane is marked in the token order
    assert "rank 1 ◀" in list(wb.figures["token_order"].data[0].y)


def test_highlight_dims_the_other_requests(wb, trace):
    wb.step.value = 1
    z = _lane_z(wb.figures["token_order"])
    wb.highlight.value = "req2"
    zh = _lane_z(wb.figures["token_order"])
    t = trace.record(1, 0, "target")
    token_req = np.repeat(np.asarray(t["req_ids"]), t["num_scheduled_tokens"])
    mine = token_req == "req2"
    assert np.array_equal(zh[0, mine], z[0, mine])  # the highlighted request keeps its colour
    assert np.all(zh[0, ~mine] == L_DIM)  # every other global token is dimmed
    assert not np.any(z[0] == L_DIM)
    bars = wb.figures["acceptance"].data[1]
    colors = list(bars.marker.color)
    assert colors[list(bars.x).index("req2")] != fg.DIM_COLOR
    assert all(c == fg.DIM_COLOR for x, c in zip(bars.x, colors) if x != "req2")
    wb.highlight.value = ""
    assert np.array_equal(_lane_z(wb.figures["token_order"]), z, equal_nan=True)


def test_set_moves_several_controls_with_one_render(wb):
    before = dict(wb.render_counts)
    wb.set(step=3, rank=1, phase="verify", highlight="req1")
    assert (wb.step.value, wb.rank.value, wb.phase.value, wb.highlight.value) == (3, 1, "verify", "req1")
    assert all(wb.render_counts[v] - before.get(v, 0) == 1 for v in VIEW_NAMES)


# --------------------------------------------------------------------------- figures

@pytest.mark.slow
def test_every_figure_of_every_step_is_valid_plotly(trace):
    colors = fg.request_color_index(fg.trace_req_ids(trace))
    for s in trace.steps:
        for r in trace.ranks:
            recs = {p: trace.record(s, r, p) for p in trace.phases(s, r)}
            for dp in ("draft_0", "draft_1"):
                for f in (fg.token_order_figure(recs["target"], rank=r, highlight="req1", colors=colors),
                          fg.block_tables_figure(recs["target"], recs[dp], draft_phase=dp, rank=r),
                          fg.slot_mappings_figure(recs["target"], recs[dp], draft_phase=dp),
                          fg.draft_timeline_figure(recs, step=s, rank=r, selected_phase=dp, highlight="req0")):
                    fg.validate_figure(f)
    fg.validate_figure(fg.acceptance_figure(fg.trace_acceptance(trace), step=3, highlight="req0"))


def test_slot_mapping_views_show_pad_mask_and_unexpanded_draft(trace):
    t, d0, d1 = (trace.record(0, 0, p) for p in ("target", "draft_0", "draft_1"))
    fig = fg.slot_mappings_figure(t, d1, draft_phase="draft_1")
    titles = [a.text for a in fig.layout.annotations]
    assert any("slot_mapping_gathered [G=1, N*P=52]" in x for x in titles)
    assert any("unexpanded, one slot per request (R = 2)" in x for x in titles)
    gathered = fig.data[1]
    hover = " ".join(np.asarray(gathered.hovertext, dtype=object).ravel())
    assert "PAD (-1)" in hover  # rank 0 pads 22 -> 26 rows
    # the draft strip holds exactly the recorded R slots
    assert np.asarray(fig.data[3].z).shape == (1, 2)
    fig0 = fg.slot_mappings_figure(t, d0, draft_phase="draft_0")
    assert any("expanded N*P" in a.text for a in fig0.layout.annotations)


def _big_step():
    """One PCP=4 step with a 6000-token prefill chunk next to a 300-token one, as the target and a
    replicated draft step would record it (built with pcpviz.reference.layout / pcpviz.reference.blocks)."""
    from pcpviz.reference.blocks import (BlockTable, compute_slot_mappings, draft_decode_slot_mapping,
                                         gathered_slot_mapping)
    from pcpviz.reference.layout import plan_layout

    q, bs, n = [6000, 300], 16, 4
    lay = plan_layout(q, [True, True], n)
    table = BlockTable(max_num_reqs=2, max_blocks_per_req=400)
    table.append(0, list(range(1, 378)))
    table.append(1, list(range(500, 520)))
    bt = table.as_array()
    qsl = np.array([0, 6000, 6300])
    g = compute_slot_mappings(bt, bs, np.array([0, 1]), query_start_loc=qsl,
                              positions=np.concatenate([np.arange(6000), np.arange(300)]))
    local_reqs = [seg.global_req_idx for seg in lay.segments_by_rank[0]]
    target = {
        "req_ids": np.array(["long", "b"]), "num_scheduled_tokens": np.array(q), "query_start_loc": qsl,
        "per_rank_num_tokens": np.array(lay.per_rank_num_tokens), "padded_gather_idx": lay.padded_gather_idx,
        "hidden_restore_idx": lay.hidden_restore_idx, "kv_write_mask": lay.kv_write_mask,
        "segments": pt.segments_table(lay.segments_by_rank), "slot_mapping_global": g,
        "slot_mapping_gathered": gathered_slot_mapping(g, lay), "block_table_global": bt[None],
        "block_table_local": bt[local_reqs][None], "local_req_ids": np.array([["long", "b"][i] for i in local_reqs]),
        "positions": np.concatenate([np.arange(6000), np.arange(300)]), "seq_lens": np.array(q),
    }
    draft = {"view": np.array("replicated"), "block_table_draft": bt[None],
             "slot_mapping_draft": draft_decode_slot_mapping(bt, bs, np.array([0, 1]), positions=np.array(q)),
             "draft_positions": np.array(q), "draft_seq_lens": np.array(q) + 1, "draft_tokens": np.array([1, 2])}
    return target, draft


def test_large_steps_are_drawn_as_pixel_runs_and_tokens_when_zoomed():
    t, d1 = _big_step()
    n_tokens = int(t["num_scheduled_tokens"].sum())
    assert n_tokens > 4 * fg.PLOT_PX
    fig = fg.token_order_figure(t, rank=0)
    z = np.asarray(fig.data[0].z)
    assert z.shape[1] <= 64, z.shape  # a few dozen runs, not 6300 cells
    assert len(fig.data[0].x) == z.shape[1] + 1  # variable-width bricks (edges)
    assert fig.data[0].texttemplate == "" and fig.data[0].xgap == 0  # runs tile the strip, labelled once
    assert any(a.text.startswith("long c") or a.text.startswith("c") for a in fig.layout.annotations)
    # every brick is exact up to a pixel: each lane is constant over the middle of each brick
    rows = _lane_rows(fg.step_layout(t))
    edges = np.asarray(fig.data[0].x, dtype=float)
    assert edges[0] == 0 and edges[-1] == max(n_tokens, fg.step_layout(t).padded)
    u = edges[-1] / fg.PLOT_PX
    for a, b in zip(edges[:-1], edges[1:]):
        if b - a > 2 * u:
            lo, hi = int(np.ceil(a + u)), int(b - u)
            for rq, ck, _ in rows:
                seg = rq[lo:hi]
                assert (seg == seg[:1]).all() and (ck[lo:hi] == ck[lo:lo + 1]).all()
    zoom = fg.token_order_figure(t, rank=0, windows={"xaxis": (100, 160)})
    assert list(zoom.layout.xaxis.range) == [100, 160] and zoom.data[0].xgap == 1
    assert len(zoom.data[0].x) == 61 and zoom.data[0].texttemplate == "%{text}"  # per-token cells, chunk text
    slots = fg.slot_mappings_figure(t, d1, draft_phase="draft_1")
    assert np.asarray(slots.data[0].z).shape[1] <= 16  # 6300 global slots: a handful of contiguous runs
    bt = fg.block_tables_figure(t, d1, draft_phase="draft_1", rank=0)
    assert np.asarray(bt.data[0].z).shape[1] <= 16  # 377 used columns: runs of consecutive block ids
    assert fg.draft_block_table_flags(t, d1) == []
    for f in (fig, zoom, slots, bt, fg.draft_timeline_figure({"target": t, "draft_1": d1}, step=0, rank=0)):
        fg.validate_figure(f)
        assert len(f.to_json()) < 150_000


def test_pixel_cells_keep_every_run_visible_and_tile_the_strip():
    # a 1-token run inside a 100-token strip drawn 10 px wide takes one pixel of its neighbour
    e, run, under = fg.pixel_cells(np.array([0, 10, 11, 100]), 0, 100, px=10)
    assert e.tolist() == [0, 1, 2, 10] and run.tolist() == [0, 1, 2]
    # 1-token runs every 500 tokens of a 128k strip: each still one pixel, no gaps
    edges = np.unique(np.concatenate([np.arange(0, 131072, 500), np.arange(0, 131072, 500) + 1, [131072]]))
    e, run, under = fg.pixel_cells(edges, 0, 131072, px=860)
    assert e[0] == 0 and e[-1] == 860 and (np.diff(e) >= 1).all()
    assert set(range(0, len(edges) - 1, 2)) <= set(run.tolist())  # every 1-token run has a cell
    # four runs under one pixel: the pixel says so
    e, run, under = fg.pixel_cells(np.array([0, 1, 2, 3, 4, 100]), 0, 100, px=10)
    assert e.tolist() == [0, 1, 10] and under[0] == 5


def test_run_edges_breaks_on_keys_and_broken_progressions():
    keys = np.array([0, 0, 0, 1, 1, 1, 1])
    slots = np.array([10, 11, 12, 13, 20, 21, -1])
    e = fg.run_edges(7, keys=[keys], arith=[slots], arith_valid=[slots >= 0])
    assert e.tolist() == [0, 3, 4, 7]  # 13 -> 20 breaks; 21 -> PAD is not a progression pair
    e = fg.run_edges(7, keys=[keys, slots < 0], arith=[slots], arith_valid=[slots >= 0])
    assert e.tolist() == [0, 3, 4, 6, 7]


# --------------------------------------------------------------------------- acceptance

def test_acceptance_follows_vllms_definition(trace):
    acc = fg.trace_acceptance(trace)
    num_drafts, per_pos = 0, np.zeros(2, dtype=np.int64)
    for s in trace.steps:
        v = trace.record(s, 0, "verify")
        carried = v["num_draft_tokens"] > 0
        num_drafts += int(carried.sum())
        for k in range(2):
            per_pos[k] += int(((v["num_accepted"] > k) & carried).sum())
    assert acc.num_drafts == num_drafts and acc.accepted_per_pos.tolist() == per_pos.tolist()
    assert acc.rate_per_pos.tolist() == pytest.approx((per_pos / num_drafts).tolist())
    wb_acc = Workbench(trace, checks=False).acceptance  # pcpviz.analysis.diff's numbers when it exists
    assert wb_acc.accepted_per_pos.tolist() == per_pos.tolist() and wb_acc.num_drafts == num_drafts


@pytest.mark.slow
def test_acceptance_equals_what_the_engine_reported(faulty_run):
    res, path = faulty_run
    acc = fg.trace_acceptance(pt.open(path))
    assert acc.num_drafts == res.num_drafts
    assert acc.accepted_per_pos.tolist() == list(res.num_accepted_tokens_per_pos)
    assert acc.rate_per_pos.tolist() == pytest.approx(list(res.acceptance_rate_per_pos))


# --------------------------------------------------------------------------- faults and checks

def test_clean_trace_has_no_flags_and_no_violations(wb, trace):
    for s in trace.steps:
        wb.step.value = s
        assert wb.flags == []
    if wb.check_report is not None:
        assert wb.check_report.ok and wb.violations == []


@pytest.mark.slow
def test_skipped_gather_flags_zero_draft_block_table_rows(faulty_run):
    _, path = faulty_run
    wb = Workbench(path, step=1, phase="draft_1")
    t = pt.open(path)
    glob = t.record(1, 0, "target")["block_table_global"][0]
    assert wb.flags, "the un-gathered draft rows must be flagged"
    assert {f.kind for f in wb.flags} == {"zero"}
    assert [f.row for f in wb.flags] == [i for i in range(glob.shape[0]) if glob[i].any()]
    fig = wb.figures["block_tables"]
    red = [s for s in fig.layout.shapes if s.line.color == fg.FLAG_COLOR]
    assert len(red) == len(wb.flags)
    assert any("all-zero" in a.text for a in fig.layout.annotations)
    assert "zero/stale" in wb.status.value
    # the timeline's gather column says so too
    tl = wb.figures["timeline"]
    g = [x.split("<br>")[0] for x in tl.layout.xaxis.ticktext].index("<b>gather</b>")
    assert any("✗ zero row" in row[g] for row in tl.data[0].text)
    # draft_0 (rank-local, uses the local rows) is not flagged
    wb.phase.value = "draft_0"
    assert wb.flags == []


@pytest.mark.slow
def test_check_violation_is_listed_marked_and_jumped_to(faulty_run):
    pytest.importorskip("pcpviz.analysis.checks")
    _, path = faulty_run
    wb = Workbench(path)
    assert "draft_block_tables_global" in wb.check_report.failed
    v = next(v for v in wb.violations if v.check == "draft_block_tables_global")
    assert wb.jump_buttons and any(v.check in b.description for b in wb.jump_buttons)
    wb.set(step=max(wb.trace.steps), rank=1, phase="target")
    button = next(b for b in wb.jump_buttons if v.check in b.description)
    button.click()
    assert (wb.step.value, wb.rank.value, wb.phase.value) == (v.step, v.rank, v.phase)
    texts = [a.text for a in wb.figures["block_tables"].layout.annotations]
    assert any(t.startswith("✗ draft_block_tables_global") for t in texts)
    assert "draft_block_tables_global" in wb.status.value


def test_workbench_figures_serialise_small(wb):
    for name, fw in wb.figures.items():
        assert len(json.dumps(fw.to_plotly_json(), default=str)) < 200_000, name



@pytest.mark.slow
def test_every_widget_message_is_json_compliant(widget_messages, trace, faulty_run):
    for t in (trace, pt.open(faulty_run[1])):
        wb = Workbench(t)
        for s in t.steps:
            for r in t.ranks:
                wb.set(step=s, rank=r)
                for ph in wb.phase.options:
                    wb.phase.value = ph
        wb.highlight.value = wb.req_ids[-1]
    assert len(widget_messages.sent) > 50  # the figures went out as updates
    assert not widget_messages.not_json()


def test_header_escapes_request_ids(tmp_path):
    """A request id is trace data, hence untrusted: the header shows it as text, never as HTML."""
    from pcpviz.synthetic import RequestSpec, generate

    bad = '<img src=x onerror="fetch(\'/api/kernels\')">'
    generate([RequestSpec(bad, 12, 3), RequestSpec("b<b>x</b>", 9, 3)], pcp=2,
             num_speculative_tokens=2).write(tmp_path / "t")
    w = Workbench(pt.open(tmp_path / "t"))
    head = w.header.value
    assert "<img" not in head and "<b>x</b>" not in head
    assert "&lt;img src=x onerror=" in head and "b&lt;b&gt;x&lt;/b&gt;" in head


# --------------------------------------------------------------------------- what the views say

def test_block_table_rows_are_coloured_by_request_not_row_index():
    t = pt.open(TRACE)
    target = t.record(1, 0, "target")
    fig = fg.block_tables_figure(target, t.record(1, 0, "draft_1"), draft_phase="draft_1", rank=0)
    glob = {lab.split(" ", 1)[1]: np.nanmax(row) for lab, row in zip(fig.data[0].y, np.asarray(fig.data[0].z, float))}
    local = [(lab.split(" ", 1)[1], np.nanmax(row))
             for lab, row in zip(fig.data[1].y, np.asarray(fig.data[1].z, float))]
    assert len(set(glob.values())) == len(glob)  # one colour per request
    assert local and all(glob[req] == level for req, level in local), (glob, local)


def test_header_shows_the_model_by_name_and_what_is_known_of_the_device():
    wb = Workbench(REPO / "data" / "traces" / "vllm-h200x2-pcp2-mtp2", checks=False)
    assert "data/models" not in wb.header.value and "<b>model</b> pcpviz-tiny-dsv3" in wb.header.value
    assert "<b>device</b> 2 x NVIDIA H200" in wb.header.value
    decoded = decode_meta({"model": "/a/b/m/", "gpus": ["H200", "H200"]})[0]
    assert pt.run_summary(decoded) == {"model": "m", "device": "2 x H200"}
    assert "device" not in pt.run_summary(decode_meta({"producer": "x"})[0])


def test_acceptance_title_says_the_rate_is_a_mean_over_positions(trace):
    spec = fg.acceptance_spec(fg.trace_acceptance(trace))
    assert "rate" in spec["layout"]["title"]["text"] and "mean over draft positions" in spec["layout"]["title"]["text"]


def test_workbench_shows_a_rerun_line_only_while_no_figure_is_drawn():
    wb = Workbench(TRACE, checks=False)
    note = wb.children[0].value
    assert "re-run this cell" in note and ":not(:has(.js-plotly-plot .hm))" in note


def test_a_trace_still_being_written_shows_what_is_complete(tmp_path):
    """Writers still open: rank 1 started first (a placeholder run.json for a moment), holds one
    step fewer than rank 0 and ends in a partial step. The Workbench opens on it, shows every
    complete step, and on rank 1 at the step it lacks says so instead of raising."""
    import os
    import warnings

    src = pt.open(TRACE)
    d = tmp_path / "live"
    meta = {k: v for k, v in src.meta.items() if k != "pcpviz_trace_schema"}
    w1 = pt.TraceWriter(d, 1)
    for s in src.rank_steps(1)[:2]:
        w1.write_step(s, {ph: dict(src.record(s, 1, ph)) for ph in src.phases(s, 1)})
    w0 = pt.TraceWriter(d, 0, meta=meta)
    for s in src.rank_steps(0)[:3]:
        w0.write_step(s, {ph: dict(src.record(s, 0, ph)) for ph in src.phases(s, 0)})
    os.write(w1._fd, b"\xff\xff\xff\xff\x40\x00\x00\x00" + bytes(20))  # a step being written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wb = Workbench(d, rank=1, step=src.steps[2])
    assert list(wb.step.options) == src.steps[:3]
    assert "not (yet) recorded on rank 1" in wb.figures["token_order"].layout.title.text
    wb.rank.value = 0
    assert wb.figures["token_order"].data  # rank 0 has the step: drawn
    wb.set(step=src.steps[0], rank=1)
    assert wb.figures["token_order"].data
    w0.close()
    w1.close()


def test_every_widget_text_and_figure_string_is_escaped(tmp_path):
    """Every string a trace carries (request ids here) reaches the widgets' HTML and the figure
    specs (hover text, tick labels, titles, annotations) only escaped."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from hostile import PAYLOADS
    from pcpviz.synthetic import RequestSpec, generate

    run = generate([RequestSpec(p, 12 + i, 3) for i, p in enumerate(PAYLOADS)], pcp=2, num_speculative_tokens=2)
    w = Workbench(pt.open(run.write(tmp_path / "t")))
    texts = [w.header.value, w.status.value]
    if w.checks_box is not None:
        texts += [c.value for c in _walk(w.checks_box) if hasattr(c, "value") and isinstance(c.value, str)]
    for step in list(w.step.options)[:4]:
        for rank in w.rank.options:
            w.set(step=step, rank=rank[1])
            texts.append(w.status.value)
            texts += [json.dumps(f.to_plotly_json(), default=str) for f in w.figures.values()]
    blob = "\n".join(texts)
    for bad in ("<img", "<script", "<svg", "<iframe", "<b id=pcpviz-injected"):
        assert bad not in blob and bad.replace("<", "\\u003c") not in blob, bad


def _walk(widget):
    yield widget
    for c in getattr(widget, "children", ()):
        yield from _walk(c)


def test_a_pcp1_run_is_laid_out_as_the_identity_and_a_damaged_pcp2_step_is_not():
    """A PCP=1 plugin run records no layout views: rank 0's rows are the global tokens, every
    one written. A PCP=2 record without them is damage and is never drawn as PCP=1."""
    from dataclasses import replace

    from pcpviz.trace.reader import Record

    t1 = pt.open(REPO / "data" / "traces" / "vllm-h200x1-pcp1-mtp2")
    step = max(t1.steps, key=lambda s: int(np.asarray(t1.record(s, 0, "target")["num_scheduled_tokens"]).sum()))
    target = t1.record(step, 0, "target")
    sl = fg.step_layout(target)
    t = int(np.asarray(target["num_scheduled_tokens"]).sum())
    assert (sl.pcp, sl.padded, sl.per_rank_num_tokens.tolist()) == (1, t, [t])
    assert np.array_equal(sl.padded_gather_idx, np.arange(t)) and sl.kv_write_mask.all()
    assert (sl.row_req() == sl.token_req).all()
    spec = Workbench(t1, step=step, checks=False)._spec("token_order")
    assert "PCP=1" in spec["layout"]["title"]["text"]
    assert "rank 0's rows are the global batch" in spec["layout"]["title"]["subtitle"]["text"]
    damaged = Record(target.step, 0, "target", target.views, pcp=2)
    assert not fg.has_layout(damaged)
    with pytest.raises(KeyError, match="per_rank_num_tokens"):
        fg.step_layout(damaged)
    assert fg.has_layout(replace(damaged, pcp=1))
