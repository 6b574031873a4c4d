"""The HTML export: one self-contained file (plotly.js inlined, no network), a step control that
swaps precomputed figures, the key views per step; opened in Chromium with the network cut off."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from pcpviz.views.export.html import STEP_VIEWS, embedded_data, export_html, pack, unpack
from pcpviz.views.panels import PANELS

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "traces" / "cpu-pcp2-mtp2"
SHOTS = REPO / "artifacts" / "browser"
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


class _Refs(HTMLParser):
    """Every URL-bearing attribute of every tag (script content is not parsed as tags)."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        for k in ("src", "href", "data", "action", "srcset", "poster"):
            if a.get(k):
                self.refs.append((tag, k, a[k]))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "report.html"
    path = export_html(TRACE, out)
    return Path(path)


def test_export_is_one_self_contained_file(exported):
    text = exported.read_text(encoding="utf-8")
    p = _Refs()
    p.feed(text)
    remote = [r for r in p.refs if re.match(r"\s*(https?:)?//", r[2])]
    assert not remote, f"remote references: {remote}"
    assert not [t for t, a in p.tags if t == "link"], "no stylesheets or preloads are linked"
    scripts = [a for t, a in p.tags if t == "script"]
    assert scripts and not [a for a in scripts if "src" in a], "every script is inline"
    assert "Plotly.newPlot" in text or "Plotly.react" in text
    assert len(text) > 3_000_000, "plotly.js must be inlined (several MB)"
    # the embedded data: every step of every rank, each with the four step views
    data = embedded_data(text)
    assert data["steps"] == list(range(13)) and data["ranks"] == [0, 1]
    assert set(data["figs"]) == {f"{s},{r}" for s in range(13) for r in (0, 1)}
    for entry in data["figs"].values():
        assert set(STEP_VIEWS) <= set(entry)
    # the step views differ between steps (step 0: 2 requests, step 1: 3)
    figs = data["figs"]
    assert figs["0,0"]["token_order"]["layout"]["title"] != figs["1,0"]["token_order"]["layout"]["title"]


def test_pack_stores_repeated_subtrees_once_and_unpacks_to_the_same_values():
    scale = [[0.0, "#d9d9d9"], [0.5, "#d9d9d9"], [0.5, "#1f77b4"], [1.0, "#1f77b4"]]
    hover = "req0 · chunk 3<br>global token 18–22"
    obj = {"figs": [{"colorscale": scale, "hovertext": [hover, "pad"], "z": [[6.0, None]]},
                    {"colorscale": scale, "hovertext": [hover, "x"], "z": [[7.0, None]], "nan": None},
                    {"$r": 0, "other": 1}],  # a key named like a reference is kept as it is
           "n": 3, "s": "short"}
    packed, shared = pack(obj, min_chars=24)
    assert unpack(packed, shared) == obj
    text = json.dumps(packed)
    assert json.dumps(scale) not in text and sum(json.dumps(x) == json.dumps(scale) for x in shared) == 1
    assert hover not in text and shared.count(hover) == 1
    assert packed["figs"][2] == {"$r": 0, "other": 1}
    assert pack({"a": [1, 2, 3], "b": [1, 2, 3]}, min_chars=5) == ({"a": {"$r": 0}, "b": {"$r": 0}}, [[1, 2, 3]])
    assert pack({"a": [1, 2, 3], "b": [1, 2]}, min_chars=5) == ({"a": [1, 2, 3], "b": [1, 2]}, [])


def test_exported_figures_equal_the_figures_the_workbench_draws(exported):
    from pcpviz.views import figures
    from pcpviz.trace import open as open_trace

    data = embedded_data(exported.read_text(encoding="utf-8"))
    t = open_trace(TRACE)
    colors = figures.request_color_index(figures.trace_req_ids(t))
    fig = figures.token_order_figure(t.record(1, 1, "target"), rank=1, colors=colors)
    expected = json.loads(fig.to_json())
    got = data["figs"]["1,1"]["token_order"]
    assert got["data"] == [{k: v for k, v in tr.items() if k != "uid"} for tr in expected["data"]]
    assert got["layout"]["title"] == expected["layout"]["title"]


def test_export_rejects_unknown_rank(tmp_path):
    with pytest.raises(ValueError, match="rank 7"):
        export_html(TRACE, tmp_path / "x.html", ranks=[7])


@pytest.mark.slow
def test_export_renders_offline_and_the_step_control_swaps_figures(exported, tmp_path):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    page_file = tmp_path / "report.html"
    shutil.copy(exported, page_file)
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROME_ARGS, timeout=60_000)
        try:
            ctx = browser.new_context(offline=True, viewport={"width": 1300, "height": 1000})
            ctx.route("**/*", route)
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            page.wait_for_function("document.body.dataset.ready === '1'", timeout=60_000)
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5",
                                   timeout=60_000)
            titles = lambda: page.evaluate(  # noqa: E731
                "() => [...document.querySelectorAll('.js-plotly-plot')].map(p => (p.querySelector('.gtitle')"
                " || {}).textContent || '')")
            before = titles()
            assert len(before) == len(PANELS) and all(before), before
            assert "requests req0, req1" in before[0]
            page.screenshot(path=str(SHOTS / "export_step0.png"), full_page=True)
            page.focus("#step")
            page.keyboard.press("ArrowRight")
            page.wait_for_function("document.getElementById('step-label').textContent === '1'")
            page.wait_for_timeout(300)
            after = titles()
            assert after[0] != before[0] and "requests req0, req2, req1" in after[0]
            assert after[2] != before[2]  # block tables: W = 2 -> W = 4 used columns
            assert "step 1" in page.inner_text("#status")
            page.select_option("#rank", "1")
            page.wait_for_timeout(300)
            assert "rank 1" in page.inner_text("#status")
            assert "◀" in page.evaluate("() => document.querySelector('.js-plotly-plot').textContent")
            page.screenshot(path=str(SHOTS / "export_step1_rank1.png"), full_page=True)
            assert not errors, errors
            assert not blocked, f"the page tried to fetch {blocked}"
        finally:
            browser.close()


MALFORMED_VIEWS = [  # (phase, view, damage): each made export or the Workbench raise before
    ("draft_2", "draft_positions", lambda a: a.reshape(-1)[0]),  # a scalar
    ("draft_1", "view", lambda a: np.asarray([], dtype=a.dtype)),  # the draft view's name: empty
    ("target", "kv_write_mask", lambda a: a[None]),  # an extra axis
    ("target", "local_req_ids", lambda a: np.concatenate([a, a[:1]])),  # a row too many
    ("target", "req_ids", lambda a: a[:0]),  # empty
    ("draft_1", "block_table_draft", lambda a: a.reshape(-1)),  # [G, R, B] flattened
    ("target", "t_start_us", lambda a: np.asarray([a, a])),  # two times, not one (a NaN time is damaged
    # data since the integer views are checked for floats: exit 3, tests/cli/test_cli_reliability.py)
]


@pytest.mark.parametrize("phase, view, damage", MALFORMED_VIEWS, ids=[f"{p}.{v}" for p, v, _ in MALFORMED_VIEWS])
def test_malformed_views_are_drawn_as_a_message(tmp_path, phase, view, damage):
    """A view with the wrong shape (valid checksums: a producer's bug, which the checks report)
    costs its figure, not the export or the Workbench: the figure says which view, step and rank
    it cannot draw. The Chrome trace stays strict JSON."""
    import contextlib
    import io
    import sys

    from pcpviz.cli import main
    from pcpviz.views.widgets import Workbench

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from tracegen import clean_run, corrupt, first_step

    run = clean_run(2)
    step = first_step(run, lambda ph: phase in ph and (view in ("view", "t_start_us")
                                                       or np.asarray(ph[phase][view]).size > 1))
    if view == "t_start_us":  # synthetic runs record no times: give this phase some first
        run.views(step, 0, phase).update(t_start_us=np.int64(0), t_end_us=np.int64(1))
    corrupt(run, step, phase, view, damage, ranks=[0])
    d = run.write(tmp_path / "t")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["export", str(d), "--html", str(tmp_path / "r.html"), "--chrome", str(tmp_path / "c.json")])
    assert rc == 0 and not err.getvalue(), err.getvalue()
    json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    wb = Workbench(str(d), step=step, rank=0)
    for p in wb.phase.options:
        wb.set(phase=p)
    titles = [(wb.figures[n].layout.title.text or "") for n in VIEW_NAMES_ALL]
    assert not any("Traceback" in t for t in titles)


VIEW_NAMES_ALL = ("token_order", "timeline", "block_tables", "slot_mappings", "acceptance")


def test_a_long_trace_shows_an_even_sample_of_its_steps(tmp_path, monkeypatch):
    """Past ``MAX_ENTRIES`` (step, rank) pages the report holds an even sample of the steps (first
    and last included) and says so; its size no longer grows with the number of steps."""
    import pcpviz.trace as pt
    from pcpviz.views.export import html as H

    trace = Path(__file__).resolve().parents[2] / "data" / "traces" / "cpu-pcp2-mtp2"
    steps = pt.open(trace).steps
    monkeypatch.setattr(H, "MAX_ENTRIES", 8)  # 4 steps on 2 ranks
    out = H.export_html(trace, tmp_path / "r.html")
    text = Path(out).read_text()
    data = H.embedded_data(text)
    assert data["steps"][0] == steps[0] and data["steps"][-1] == steps[-1] and len(data["steps"]) == 4
    assert f"4 of {len(steps)} steps shown" in text
    assert H.shown_steps(range(100_000), 2, [77_777]) == sorted(set(H.shown_steps(range(100_000), 2)) | {77_777})


# --------------------------------------------------------------------------- trace strings are text

HOSTILE = '<img src=x onerror="window.__pcpviz_xss=1">'
STATUS_TAGS = {"div", "b", "br", "span"}


def _tags(fragment: str) -> set[str]:
    p = _Refs()
    p.feed(fragment)
    return {t for t, _ in p.tags}


class _Flag:
    def describe(self) -> str:
        return f"row 1 {HOSTILE}"


class _Violation:
    step, rank, phase, check = 0, 0, "target", f"check{HOSTILE}"

    def describe(self) -> str:
        return f"message {HOSTILE}"


def test_the_status_line_escapes_every_trace_string():
    """One status line for the Workbench and the export (``pcpviz.views.widgets.status``): phase
    names, a draft phase's layout view, the flags and the violations are text."""
    from pcpviz.views.widgets.status import status_html

    recs = {"target": {}, f"draft_0{HOSTILE}": {"view": np.asarray(HOSTILE)}}
    for where in ((0, 0, None), (0, 0, f"draft_0{HOSTILE}")):
        line = status_html(where, recs, draft_phase=f"draft_0{HOSTILE}", flags=[_Flag()], violations=[_Violation()])
        assert _tags(line) <= STATUS_TAGS, (where, line)
        assert line.count("&lt;img src=x onerror=") >= 4, line


def test_export_escapes_hostile_phase_names_and_request_ids(tmp_path, monkeypatch):
    """A phase name the reader would refuse (here patched into the opened trace) and request ids,
    run.json strings that it does not: in the page (header, checks, status lines) they are text."""
    import random
    import sys

    import pcpviz.trace as pt
    from pcpviz.synthetic import RequestSpec, generate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from hostile import PAYLOADS, inject_meta, inject_strings, rewrite

    clean = generate([RequestSpec(p, 14 + 3 * i, 4) for i, p in enumerate(PAYLOADS[:3])], pcp=2,
                     num_speculative_tokens=2).write(tmp_path / "clean")
    rng = random.Random(0)
    trace = pt.open(rewrite(clean, tmp_path / "hostile", lambda s, r, ph: inject_strings(rng, s, r, ph),
                            meta_edit=inject_meta))
    phases, record = trace.phases, trace.record
    bad = f"verify{HOSTILE}"
    monkeypatch.setattr(trace, "phases", lambda s, r: [*phases(s, r), bad])
    monkeypatch.setattr(trace, "record", lambda s, r, p: record(s, r, "verify" if p == bad else p))
    text = Path(export_html(trace, tmp_path / "r.html")).read_text(encoding="utf-8")
    page = text[:text.index('<script type="application/json"')]
    page = re.sub(r"<script[^>]*>.*?</script>", "", page, flags=re.S)  # plotly.js itself
    assert _tags(page) <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "div", "code", "b", "br",
                           "label", "input", "span", "select", "option", "details", "summary", "table", "tr", "th",
                           "td", "i", "p"}, _tags(page)
    assert "&lt;img src=" in page and "&lt;script&gt;" in page  # the payloads are shown, as text
    data = embedded_data(text)
    for key, entry in data["figs"].items():
        assert _tags(entry["status"]) <= STATUS_TAGS, (key, entry["status"])
    assert "verify&lt;img src=x onerror=" in data["figs"]["0,0"]["status"]
    raw = text[text.index('<script type="application/json"'):]
    raw = raw[:raw.index("</script>")]
    assert "<" not in raw[raw.index(">") + 1:], "a '<' inside the embedded JSON (<!-- or </script> could end it)"


def test_a_wide_run_shows_a_sample_of_its_ranks(tmp_path, monkeypatch):
    """Past ``MAX_DRAWN_RANKS`` ranks the report precomputes an even sample of them (first, last, the
    ranks of first violations) and says so; ``--rank`` picks them."""
    from pcpviz.cli.commands import main
    from pcpviz.views.export import html as H
    from tracegen import clean_run

    monkeypatch.setattr(H, "MAX_DRAWN_RANKS", 2)
    assert H.shown_ranks(range(64)) == [0, 63]
    assert H.shown_ranks(range(64), [17]) == [0, 17, 63]
    assert H.shown_ranks([0, 1]) == [0, 1]
    run = clean_run(4, k=1)
    trace = run.write(tmp_path / "t")
    out = tmp_path / "r.html"
    H.export_html(trace, out)
    text = out.read_text()
    assert H.embedded_data(text)["ranks"] == [0, 3]
    assert "2 of 4 ranks shown" in text
    assert main(["export", str(trace), "--html", str(out), "--rank", "2", "--rank", "1"]) == 0
    text = out.read_text()
    assert H.embedded_data(text)["ranks"] == [2, 1] and "2 of 4 ranks shown" in text
    assert main(["export", str(trace), "--chrome", str(tmp_path / "c.json"), "--rank", "1"]) == 2
