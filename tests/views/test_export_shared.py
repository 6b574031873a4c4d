"""The HTML report draws a figure once for the pages that would draw it alike (issue 40, seventh part).

Panels with a ``shared_key`` (token order, slot mappings) are drawn once per key, with ``rank=None``,
and each rank's page is derived from that drawing (``Panel.for_rank``); ``figure_json`` and the
packer then meet the shared parts as one object. Every page must be what drawing it alone gives:
on a clean PCP=4 trace, where the step's global views are the same on every rank, and on one whose
ranks disagree about a global view (each rank then draws its own).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpviz import trace as pt
from pcpviz.views import figures as fg
from pcpviz.views.export import html as H
from pcpviz.views.export.jsonpack import Packer, pack
from pcpviz.views.export import tokens as tk
from pcpviz.views.export.plotly_json import figure_json
from pcpviz.views.figures.content_key import content_key
from pcpviz.views.figures.parts import SharedParts
from pcpviz.views.figures.lod import record_strips
from pcpviz.views.panels import PANELS, step_panels
from tracegen import RequestSpec, clean_run, corrupt


def _pages(trace, *, shared: bool) -> dict:
    """Every (step, rank) page of ``trace``: drawn sharing figures between pages, or each alone."""
    colors = fg.request_color_index(fg.trace_req_ids(trace))
    cache: dict = {}
    return {(s, r): H._entry(trace, s, r, colors=colors, violations=[], shared=cache if shared else None)
            for s in trace.steps for r in trace.ranks if trace.has(s, r, "target")}


@pytest.fixture
def no_sharing(monkeypatch):
    """The export with no panel declaring a ``shared_key``: each page draws all its figures."""
    alone = [replace(p, shared_key=None, for_rank=None) for p in step_panels()]
    return lambda: monkeypatch.setattr(H, "step_panels", lambda: alone)


def _check_same_pages(trace, no_sharing) -> dict:
    together = _pages(trace, shared=True)
    no_sharing()
    alone = _pages(trace, shared=False)
    assert together.keys() == alone.keys()
    for page, entry in together.items():
        assert json.dumps(entry) == json.dumps(alone[page]), page
    return together


def test_shared_figures_are_the_figures_each_page_draws_alone(tmp_path, no_sharing):
    trace = pt.open(clean_run(4, k=2).write(tmp_path / "t"))
    pages = _check_same_pages(trace, no_sharing)
    step = trace.steps[1]
    lanes = [pages[(step, r)]["token_order"]["data"][0] for r in trace.ranks]
    # drawn once for the step: every rank's page holds the same gather map, its own lane labels
    assert all(p["token_order"]["data"][1] is pages[(step, 0)]["token_order"]["data"][1]
               for (s, _), p in pages.items() if s == step)
    assert all(pages[(step, r)]["slot_mappings"]["layout"] is pages[(step, 0)]["slot_mappings"]["layout"]
               for r in trace.ranks)
    for r, heat in enumerate(lanes):
        assert heat["y"] == ["global"] + [f"rank {k}" + (" ◀" if k == r else "") for k in range(4)]
        frame = pages[(step, r)]["token_order"]["layout"]["shapes"][0]
        assert (frame["type"], frame["y0"], frame["y1"]) == ("rect", r + 0.5, r + 1.5)


def test_ranks_that_disagree_draw_their_own_figures(tmp_path, no_sharing):
    """Rank 2 records another gather map at step 3 (a damaged trace): its token order is its own."""
    run = clean_run(4, k=2)
    step = run.step_ids[3]
    corrupt(run, step, "target", "padded_gather_idx", lambda a: a[::-1], ranks=[2])
    corrupt(run, step, "target", "slot_mapping_global", lambda a: a + 1, ranks=[1])
    trace = pt.open(run.write(tmp_path / "t"))
    pages = _check_same_pages(trace, no_sharing)
    gather = [pages[(step, r)]["token_order"]["data"][1] for r in trace.ranks]
    assert gather[2] != gather[0] and gather[1] == gather[0] == gather[3]
    slots = [pages[(step, r)]["slot_mappings"] for r in trace.ranks]
    assert slots[1] != slots[0] and slots[0]["layout"] is slots[3]["layout"]  # rank 2's layout is its own too
    assert slots[2]["layout"] is not slots[0]["layout"]


def test_a_figure_that_cannot_be_drawn_names_its_rank(tmp_path, no_sharing):
    """A malformed view is still said per page: ``drawn``'s message names the step and rank."""
    run = clean_run(4, k=1)
    step = run.step_ids[2]
    corrupt(run, step, "target", "kv_write_mask", lambda a: np.stack([a, a]), ranks=None)
    trace = pt.open(run.write(tmp_path / "t"))
    pages = _check_same_pages(trace, no_sharing)
    titles = [pages[(step, r)]["token_order"]["layout"]["title"]["text"] for r in trace.ranks]
    assert all(f"step {step} rank {r}" in t for r, t in enumerate(titles)), titles


def test_token_order_for_rank_marks_only_the_rank():
    rec = pt.open("data/traces/cpu-pcp2-mtp2").record(0, 0, "target")
    base = fg.token_order_spec(rec)
    for r in (0, 1):
        spec = fg.token_order_for_rank(base, rec, r)
        assert json.dumps(figure_json(spec)) == json.dumps(figure_json(fg.token_order_spec(rec, rank=r)))
        assert all(a is b for a, b in zip(spec["data"][1:], base["data"][1:]))
        assert all(a is b for a, b in zip(spec["layout"]["shapes"][1:], base["layout"]["shapes"]))
        assert spec["data"][0]["y"][r + 1].endswith(" ◀") and "◀" not in "".join(base["data"][0]["y"])
    assert fg.token_order_for_rank(base, rec, 5) is base and fg.token_order_for_rank(base, rec, None) is base


def test_content_key_is_by_value_and_type():
    a = np.arange(6, dtype=np.int64)
    assert content_key(a, "r0", None) == content_key(a.copy(), "r0", None)
    assert content_key(a) != content_key(a.astype(np.int32))
    assert content_key(a) != content_key(a.reshape(2, 3))
    assert content_key([1, 2]) != content_key((1, 2))
    assert len({content_key(x) for x in (1, 1.0, True, "1", None)}) == 5
    assert content_key({"a": 1, "b": 2}) != content_key({"b": 2, "a": 1})
    assert content_key(np.array(["x", "yy"], dtype=object)) == content_key(np.array(["x", "yy"], dtype=object))
    layout = fg.step_layout(pt.open("data/traces/cpu-pcp2-mtp2").record(0, 0, "target"))
    assert content_key(layout) == content_key(replace(layout))
    assert content_key(layout) != content_key(replace(layout, padded=layout.padded + 1))
    with pytest.raises(TypeError):
        content_key(object())


def test_figure_json_memo_gives_shared_parts_once():
    spec = fg.token_order_spec(pt.open("data/traces/cpu-pcp2-mtp2").record(0, 0, "target"))
    memo: dict = {}
    first = figure_json(spec, memo=memo)
    assert first == figure_json(spec)
    again = figure_json({**spec, "layout": {**spec["layout"], "height": 1}}, memo=memo)
    assert again["data"] == first["data"] and all(x is y for x, y in zip(again["data"], first["data"]))
    assert again["layout"]["height"] == 1 and again["layout"]["xaxis"] is first["layout"]["xaxis"]


_leaf = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, None, True, "a", "req0 · chunk 3<br>token 18–22"]))
_json = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "hovertext"]), inner, max_size=3)),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.lists(_json, min_size=1, max_size=4), st.lists(st.integers(0, 3), max_size=8), st.integers(1, 40))
def test_pack_of_shared_objects_is_pack_of_copies(parts, picks, min_chars):
    """Parts held at several places (as the pages hold a shared figure), and parts walked ahead
    (``Packer.add``), pack as equal copies at those places do."""
    obj = [parts[i % len(parts)] for i in picks] + [{"p": parts}]
    want = pack(copy.deepcopy(obj), min_chars=min_chars)
    assert pack(obj, min_chars=min_chars) == want
    early, added = Packer(min_chars=min_chars), []
    for p in parts:
        if isinstance(p, (dict, list)) and not any(p is q for q in added):
            early.add(p)
            added.append(p)
    assert early.pack(obj) == want


def test_a_part_walked_ahead_must_be_packed():
    p = Packer(min_chars=1)
    p.add(["a long enough text"])
    with pytest.raises(ValueError, match="not in the object"):
        p.pack({"other": 1})


def test_every_shared_panel_says_how_it_is_keyed():
    shared = {n for n, p in PANELS.items() if p.shared_key is not None}
    assert shared == {"token_order", "slot_mappings"}
    assert PANELS["token_order"].for_rank is not None and PANELS["slot_mappings"].for_rank is None


def _figures(trace, parts, spec_of=fg.block_tables_spec):
    """Each page's figure (as JSON, with its strips) that ``spec_of`` draws with ``parts`` (or none)."""
    out = {}
    for s in trace.steps:
        for r in trace.ranks:
            recs = {p: trace.record(s, r, p) for p in trace.phases(s, r) if p != "dummy"}
            dp = fg.draft_source_phase(recs, None)
            with record_strips() as calls:
                spec = spec_of(recs["target"], recs.get(dp), draft_phase=dp, rank=r, parts=parts)
            strips = tk.strips(spec, calls, memo=parts.strips if parts else None, only=parts.ids if parts else ())
            memo = {} if parts and parts.ids else None
            out[(s, r)] = json.dumps([figure_json(spec, memo=memo, only=parts.ids if memo is not None else None),
                                      strips])
    return out


_block_tables = _figures


def test_dcp_strips_drawn_once_are_the_strips_each_page_draws():
    """The DCP shards of the shipped PCP=2, DCP=2 trace: each rank's own strips (its share of the
    slots) and the ones every rank draws alike (the owners), drawn once, equal each page drawn alone."""
    trace = pt.open("data/traces/cpu-pcp2-dcp2-mtp2")
    parts = SharedParts()
    assert _figures(trace, parts, fg.dcp_shards_spec) == _figures(trace, None, fg.dcp_shards_spec)
    strips = sum(len(json.loads(page)[1] or []) for page in _figures(trace, None, fg.dcp_shards_spec).values())
    assert 0 < len(parts.drawn) < strips  # some strips were drawn once for both ranks


def test_block_table_rows_drawn_once_are_the_rows_each_page_draws(tmp_path):
    """The global and draft rows of a step, the same on every rank, are drawn once (``SharedParts``)
    and every page's figure and strips are what drawing it alone gives, hostile request ids too
    (escaped once, not twice)."""
    reqs = [RequestSpec("a<b>&amp;", 30, 6), RequestSpec("x\"'<br>", 9, 5, 1), RequestSpec("c", 17, 4, 2)]
    trace = pt.open(clean_run(4, k=2, requests=reqs).write(tmp_path / "t"))
    parts = SharedParts()
    pages = _block_tables(trace, parts)
    assert pages == _block_tables(trace, None)
    assert all("&amp;amp;" in page and "&amp;amp;amp;" not in page for page in pages.values())
    drawn = len(parts.drawn)
    assert drawn < 3 * len(trace.steps) * len(trace.ranks)  # global and draft rows shared between ranks
    again = _block_tables(trace, parts)  # every part drawn already: nothing drawn again
    assert len(parts.drawn) == drawn and again == _block_tables(trace, None)
