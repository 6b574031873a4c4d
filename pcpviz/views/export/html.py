"""A self-contained HTML report of a trace: the Workbench's views, per step, without a kernel.

    from pcpviz.views.export.html import export_html
    export_html("data/traces/cpu-pcp2-mtp2", "report.html")      # CLI: pcpviz export TRACE --html OUT

One file: plotly.js is inlined (no CDN, nothing fetched), the figures of every (step, rank) are
precomputed with ``pcpviz.views.figures`` (the functions the Workbench draws with) and
embedded as JSON — every subtree that repeats (colorscales, axes, hover texts of rows that did not
change) stored once (``pack``; the shipped traces export to 5-6 MB, 4.8 MB of it plotly.js) — and
a few lines of inline JavaScript swap them when the step slider
(``<input type=range>``) or the rank ``<select>`` changes. Every strip is embedded as its runs
too, and a zoom or pan in the page redraws it for the window as the Workbench does: runs
snapped to pixels, one cell per token once a token is 4 px wide (``pcpviz.views.export.tokens``).
Views: token order (global vs local rows,
gather/restore maps, write mask), draft-step timeline, block tables (zero/stale draft rows outlined),
slot mappings, acceptance (the current step shaded), and the ``pcpviz.analysis.checks`` verdicts when that
module is available (violations are also marked on their views).

What several pages draw alike is drawn once: a panel with a ``shared_key`` (token order, slot
mappings: a step's global views) once per key, each rank's page marking its rank on it
(``Panel.for_rank``), and strips that are the same on several pages (a step's global and draft
block-table rows, DCP strips) once per content (``figures.parts``); ``figure_json`` and the packer
then meet those parts as one object. At PCP=64 a step's 8 shown ranks draw its token order once.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from plotly.offline import get_plotlyjs

from pcpviz.analysis.acceptance import AcceptanceFold
from pcpviz.analysis.parallel import chunk_bounds, default_workers, forked_imap
from pcpviz.trace import Trace
from pcpviz.trace.bounds import step_problems
from pcpviz.trace import open as open_trace
from pcpviz.views import figures as fg
from pcpviz.views.figures.parts import SharedParts
from pcpviz.views.figures.lod import TOKEN_PX, record_strips
from pcpviz.views.export import tokens as tk
from pcpviz.trace.outputs import atomic_output, check_output
from pcpviz.views.export.jsonpack import Packer, pack, unpack
from pcpviz.views.export.plotly_json import figure_json
from pcpviz.views.panels import Panel, PanelInput, panel_marks, run_panels, step_panels
from pcpviz.views.widgets import status as st

__all__ = ["export_html", "STEP_VIEWS", "pack", "unpack", "embedded_data", "shown_steps", "shown_ranks", "MAX_ENTRIES",
           "MAX_DRAWN_RANKS"]

STEP_VIEWS = tuple(p.name for p in step_panels())
"""Panels precomputed per (step, rank) (``pcpviz.views.panels``); the per-run panels
(``acceptance``) are one figure each for the run."""

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 6px} h2{font-size:15px;margin:22px 0 2px}
.meta{font-size:13px;color:#444} .meta code{background:#f3f3f3;padding:1px 4px}
.controls{position:sticky;top:0;z-index:10;background:#fff;border:1px solid #ddd;padding:8px 12px;
  margin:10px 0;display:flex;gap:22px;align-items:center;font-size:14px}
.controls input[type=range]{width:360px}
#status{font-size:13px;margin:4px 0}
table.checks{border-collapse:collapse;font-size:12px} table.checks td,table.checks th{padding:2px 8px;
  border-bottom:1px solid #eee;text-align:left}
.pass{color:#2a7;font-weight:bold} .fail{color:#c00;font-weight:bold} .skipped{color:#888;font-weight:bold}
.fig{width:100%;max-width:1200px}
"""

_JS = """
(function(){
  const P = JSON.parse(document.getElementById('pcpviz-data').textContent), S = P.shared;
  // Shared subtrees: {"$r": i} stands for P.shared[i] (see pcpviz.views.export.jsonpack.pack). Each call
  // builds fresh objects, so figures never alias each other's arrays.
  function R(o){
    if (Array.isArray(o)) return o.map(R);
    if (o !== null && typeof o === 'object') {
      if (typeof o.$r === 'number' && Object.keys(o).length === 1) return R(S[o.$r]);
      const out = {}; for (const k in o) out[k] = R(o[k]); return out;
    }
    return o;
  }
  const D = {steps: P.steps, ranks: P.ranks, views: P.views, run: P.run_views};
  const config = {displaylogo: false, responsive: true, showLink: false, showSendToCloud: false};
  const step = document.getElementById('step'), rank = document.getElementById('rank');
  const label = document.getElementById('step-label'), status = document.getElementById('status');
  let runShown = false;
  const shown = {};  // view -> {fig, strips}: what its plot shows, to redraw its strips on a zoom
  function show(){
    const s = D.steps[+step.value], r = +rank.value, key = s + ',' + r;
    label.textContent = s;
    const entry = P.figs[key] === undefined ? undefined : R(P.figs[key]);
    if (!entry) { status.textContent = 'step ' + s + ' was not recorded on rank ' + r; return; }
    status.innerHTML = entry.status;
    for (const v of D.views) {
      const f = entry[v];
      shown[v] = {key, strips: (entry.tokens || {})[v]};
      Plotly.react(document.getElementById('fig-' + v), f.data, f.layout, config);
    }
    for (const v of D.run) {
      const el = document.getElementById('fig-' + v), m = P.markers[v];
      if (!runShown) { const a = R(P.run[v]); Plotly.newPlot(el, a.data, a.layout, config); }
      // the panel's step marker (its shapes at step 0, from Python) moved to step s
      if (m) Plotly.relayout(el, {shapes: m.map(sh => Object.assign({}, sh, {x0: sh.x0 + s, x1: sh.x1 + s}))});
    }
    runShown = true;
  }
  step.addEventListener('input', show);
  rank.addEventListener('change', show);
  show();
  // a zoom or pan of a strip's x axis: redraw its strips for the window (pcpviz.views.export.tokens);
  // a reset (double click) draws the page's figure again
  for (const v of D.views) {
    const el = document.getElementById('fig-' + v);
    let busy = false;
    el.on('plotly_relayout', ev => {
      const s = shown[v], keys = Object.keys(ev || {});
      if (busy || !s || !s.strips || !keys.some(k => /^xaxis\\d*\\./.test(k))) return;
      const fig = R(P.figs[s.key])[v];  // fresh objects: plotly keeps (and edits) those it is given
      busy = true;
      const done = keys.some(k => /\\.autorange$/.test(k)) ? Plotly.react(el, fig.data, fig.layout, config)
                                                          : PCPVIZ_TOKENS.redraw(el, fig, s.strips, config);
      Promise.resolve(done).finally(() => { busy = false; });
    });
  }
  document.body.dataset.ready = '1';
})();
"""


def embedded_data(html_text: str) -> dict:
    """The data an exported page embeds, unpacked: ``steps``, ``ranks``, ``views`` (the per-step
    panels), ``run`` (per-run panel -> figure) and ``figs`` (``"step,rank"`` -> panel -> figure,
    and ``status``)."""
    a = html_text.index(_DATA_OPEN) + len(_DATA_OPEN)
    p = json.loads(html_text[a:html_text.index("</script>", a)])
    return {"steps": p["steps"], "ranks": p["ranks"], "views": p["views"],
            "run": unpack(p["run"], p["shared"]), "figs": unpack(p["figs"], p["shared"])}


_DATA_OPEN = '<script type="application/json" id="pcpviz-data">'


def _checks_html(report: Any) -> str:
    """The check verdicts, folded (open when a check failed or the trace is damaged)."""
    if report is None:
        return f"<p class='meta'>{st.CHECKS_UNAVAILABLE}</p>" if st.checks_missing() else ""
    summary, attention = st.checks_summary(report)
    return (f"<details{' open' if attention else ''}><summary>{html.escape(summary)}</summary>"
            f"{st.checks_notes_html(report)}{st.checks_table_html(report)}</details>")


MAX_ENTRIES = 256
"""Most (step, rank) pages one report precomputes (each costs ~20 ms and ~0.5 MB to build, and
the file grows with them): a longer trace shows an even sample of its steps plus every step a
check's first violation is at (the Workbench shows them all)."""


def shown_steps(steps: Sequence[int], num_ranks: int, keep: Sequence[int] = ()) -> list[int]:
    """The steps a report precomputes: all of them up to ``MAX_ENTRIES`` (step, rank) pages, else
    an even sample with the first and last step and the ``keep`` steps (first violations).
    100,000 steps on 2 ranks: 128 steps, about every 787th, plus the violations."""
    steps = list(steps)
    budget = max(1, MAX_ENTRIES // max(num_ranks, 1))
    if len(steps) <= budget:
        return steps
    picked = {steps[round(i * (len(steps) - 1) / (budget - 1))] for i in range(budget)} if budget > 1 else {steps[0]}
    return sorted(picked | (set(keep) & set(steps)))


MAX_DRAWN_RANKS = 8
"""Most ranks whose pages a report precomputes when no ``ranks`` are asked for: a wider run shows
an even sample of its ranks (the first and last, and every rank of a first violation), so that
``MAX_ENTRIES`` buys steps rather than ranks (PCP=64: 32 steps on 8 ranks, not 4 on 64)."""


def shown_ranks(ranks: Sequence[int], keep: Sequence[int] = ()) -> list[int]:
    """The ranks a report precomputes by default: all of them up to ``MAX_DRAWN_RANKS``, else an even
    sample with the first and last rank, plus the ``keep`` ranks (first violations).
    ``shown_ranks(range(64))`` is ``[0, 9, 18, 27, 36, 45, 54, 63]``."""
    ranks = list(ranks)
    if len(ranks) <= MAX_DRAWN_RANKS:
        return ranks
    picked = {ranks[round(i * (len(ranks) - 1) / (MAX_DRAWN_RANKS - 1))] for i in range(MAX_DRAWN_RANKS)}
    return sorted(picked | (set(keep) & set(ranks)))


def _shown_note(shown: Sequence[int], steps: Sequence[int], ranks: Sequence[int], all_ranks: Sequence[int]) -> str:
    notes = []
    if len(shown) != len(steps):
        notes.append(f"<b>{len(shown)} of {len(steps)} steps shown</b> (an even sample and every step of a first "
                     "violation)")
    if len(ranks) != len(all_ranks):
        notes.append(f"<b>{len(ranks)} of {len(all_ranks)} ranks shown</b> (pcpviz export --html --rank R "
                     "for others)")
    return "<br>" + "; ".join(notes) + "; the Workbench shows every step and rank" if notes else ""


def _entry(trace: Trace, step: int, rank: int, *, colors: dict, violations: list,
           shared: dict | None = None) -> dict:
    """The per-step panels (as plain objects) and the status line of one (step, rank) page; the
    draft panels show the step's first draft phase (``draft_source_phase``). ``shared`` keeps the
    figures of panels with a ``shared_key`` between the pages of a run (``_shared_spec``)."""
    recs = {p: trace.record(step, rank, p) for p in trace.phases(step, rank) if p != "dummy"}
    target = recs["target"]
    dp = fg.draft_source_phase(recs, None)
    draft = recs.get(dp) if dp else None
    bad = recs if step_problems(recs) else None  # fg.drawn's bounds test, once a page: None when none fails
    flags = fg.drawn("block_tables", lambda: fg.draft_block_table_flags(target, draft), step=step, rank=rank,
                     recs=bad)
    flags = flags if isinstance(flags, list) else []  # malformed block tables: no flags
    shared = {} if shared is None else shared
    parts = shared.setdefault(_PARTS, SharedParts())  # parts of figures drawn once (block-table rows)
    inp = PanelInput(step=step, rank=rank, recs=recs, phase=dp, draft_phase=dp, colors=colors, flags=flags,
                     parts=parts)
    figs, tokens = {}, {}
    for p in step_panels():  # a view that is missing or malformed is drawn as a message naming it (fg.drawn)
        memo, asked = None, parts.asked[0]
        with record_strips() as calls:
            spec = fg.drawn(p.name, lambda p=p: _shared_spec(p, inp, shared), step=step, rank=rank, recs=bad)
        if isinstance(spec, _Shared):
            spec, tokens[p.name], memo = spec.spec, spec.tokens, spec.memo
        else:
            tokens[p.name] = tk.strips(spec, calls, memo=parts.strips, only=parts.ids) if p.zoom_axes else None
        for m in panel_marks(p, violations, inp):
            spec = fg.mark_violation(spec, m)
        if memo is None and parts.asked[0] != asked:  # the figure holds parts drawn once (SharedParts)
            memo, only = parts.json, parts.ids
        else:
            only = None
        figs[p.name] = figure_json(spec, memo=memo, only=only)
    status = st.status_html((step, rank, None), recs, draft_phase=dp, flags=flags, violations=violations)
    return {**figs, "status": status, "tokens": tokens}


_PARTS = ("parts",)
"""The key of a run's ``SharedParts`` among its shared figures."""


@dataclass(frozen=True)
class _Shared:
    """A page's figure of a panel drawn once for several pages (``_shared_spec``), its strips, and
    the ``figure_json`` memo that gives each page the same JSON for the parts they share."""

    spec: dict
    tokens: list | None
    memo: dict


def _shared_spec(p: Panel, inp: PanelInput, shared: dict) -> dict | _Shared:
    """``p.spec(inp)``; for a panel with a ``shared_key``, drawn once per key (with ``rank=None``)
    among the pages that share ``shared`` and given to this page through ``p.for_rank``, its
    strips with it. Where the key or that drawing raises, the page draws its own figure (which
    raises as the panel does, for ``fg.drawn`` to name the view)."""
    if p.shared_key is None:
        return p.spec(inp)
    try:
        key = (p.name, p.shared_key(inp))
        hit = shared.get(key)
        if hit is None:
            with record_strips() as calls:
                spec = p.spec(replace(inp, rank=None))
            hit = shared[key] = _Shared(spec, tk.strips(spec, calls) if p.zoom_axes else None, {})
    except Exception:  # noqa: BLE001 - not shared: the page's own drawing says what is wrong
        return p.spec(inp)
    return _Shared(p.for_rank(hit.spec, inp) if p.for_rank is not None else hit.spec, hit.tokens, hit.memo)


PAGES_PARALLEL_FROM = 16
"""(step, rank) pages from which a report builds them in forked processes (``$PCPVIZ_WORKERS``)."""


def _entries(trace: Trace, pages: list[tuple[int, int]], *, colors: dict, violations: list) -> Iterator[dict]:
    """``_entry`` of each page, in order: in forked processes (runs of consecutive pages) from
    ``PAGES_PARALLEL_FROM`` pages, each page built as one process alone would build it."""
    workers = default_workers(len(pages), parallel_from=PAGES_PARALLEL_FROM)
    runs = chunk_bounds(len(pages), workers, per_worker=4) if workers > 1 else [0, len(pages)]

    def run(i: int) -> list[dict]:
        shared: dict = {}  # the figures the run's pages share (``_shared_spec``)
        return [_entry(trace, step, rank, colors=colors, violations=violations, shared=shared)
                for step, rank in pages[runs[i]:runs[i + 1]]]

    for built in forked_imap(run, len(runs) - 1, workers=workers):
        yield from built


def _embedded(trace: Trace, shown: Sequence[int], ranks: Sequence[int], *, colors: dict, acceptance: Any,
              violations: list) -> str:
    """The page's data as JSON: every shown (step, rank) page, the per-run panels, their markers."""
    entries: dict[str, dict] = {}
    packer = Packer()  # walks each page as it comes, while the forked processes build the next ones
    budget = tk.MAX_REPORT_RUNS
    pages = [(step, rank) for step in shown for rank in ranks if trace.has(step, rank, "target")]
    for (step, rank), e in zip(pages, _entries(trace, pages, colors=colors, violations=violations)):
        entries[f"{step},{rank}"] = e
        runs = tk.num_runs(e["tokens"])
        if runs > min(tk.MAX_PAGE_RUNS, budget):  # per-token zoom only within the size caps
            e["status"] += tk.not_embedded_note(runs, budget_left=budget)
            e["tokens"] = {}
        else:
            budget -= runs
        packer.add(e)
    inp = PanelInput(colors=colors, acceptance=acceptance)
    run = {p.name: figure_json(p.spec(inp)) for p in run_panels()}
    markers = {p.name: p.step_marker(0) for p in run_panels() if p.step_marker is not None}
    (run_packed, figs_packed), shared = packer.pack([run, entries])
    data = json.dumps({"steps": list(shown), "ranks": list(ranks), "views": list(STEP_VIEWS),
                       "run_views": [p.name for p in run_panels()], "markers": markers, "shared": shared,
                       "run": run_packed, "figs": figs_packed}, separators=(",", ":"), allow_nan=False)
    # no "<" at all inside the <script>: neither "</script>" nor "<!--" (which would make the HTML
    # parser look past our "</script>") can appear; "\u003c" is the same character to JSON
    return data.replace("<", "\\u003c")


def _page(trace: Trace, *, title: str, data: str, ranks: Sequence[int], shown: Sequence[int],
          req_ids: Sequence[str], report: Any) -> str:
    note = _shown_note(shown, trace.steps, ranks, trace.ranks)
    rank_opts = "".join(f"<option value='{int(r)}'>rank {int(r)}</option>" for r in ranks)
    panels_html = "".join(f"<h2>{html.escape(p.title)}</h2><div class='fig' id='fig-{p.name}'></div>"
                          for p in (*step_panels(), *run_panels()))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title)}</h1>
<div class="meta">{st.header_html(trace, trace.run_meta, req_ids)}{note}</div>
<div class="controls">
 <label>step <input type="range" id="step" min="0" max="{len(shown) - 1}" value="0" step="1"></label>
 <span id="step-label"></span>
 <label>rank <select id="rank">{rank_opts}</select></label>
 <span class="meta">drag across a strip to zoom: one cell per token from {TOKEN_PX:g} px a token, runs below;
 double-click resets · exported by pcpviz; self-contained (plotly.js inlined, no network)</span>
</div>
<div id="status"></div>
{_checks_html(report)}
{panels_html}
{_DATA_OPEN}{data}</script>
<script type="text/javascript">{tk.SCRIPT}</script>
<script type="text/javascript">{_JS}</script>
</body></html>
"""


def export_html(trace_path: str | os.PathLike | Trace, out_path: str | os.PathLike, *,
                ranks: Sequence[int] | None = None, checks: bool = True, title: str | None = None) -> str:
    """Write the self-contained HTML report of ``trace_path`` to ``out_path``; returns the path.

    ``ranks`` limits the ranks whose panels are precomputed (default: all; each rank adds one set
    of figures per step to the file).
    """
    check_output(out_path)  # a device, FIFO or socket is refused before any work
    trace = trace_path if isinstance(trace_path, Trace) else open_trace(trace_path)
    if not trace.steps:
        raise ValueError(f"trace {trace.path} has no complete step")
    asked = ranks
    ranks = list(trace.ranks if ranks is None else ranks)
    unknown = [r for r in ranks if r not in trace.ranks]
    if unknown or not ranks:
        raise ValueError(f"rank {unknown[0] if unknown else '(none)'} not in the trace's ranks {trace.ranks}")
    fold = AcceptanceFold.of(trace)  # the run's acceptance and request ids, counted while the checks run
    folds = {"req_ids": fg.ReqIdsFold(trace), **({"acceptance": fold} if fold is not None else {})}
    # a wide trace's few steps are many records: checked in forked runs of steps from PARALLEL_FROM records
    records = len(trace.steps) * len(trace.ranks)
    report = fg.load_check_report(trace, folds=folds, workers=default_workers(records)) if checks else None
    req_ids = fg.trace_req_ids(trace, report)
    colors = fg.request_color_index(req_ids)
    violations = [r.first_violation for r in report.results.values()
                  if r.first_violation is not None] if report is not None else []
    if asked is None:
        ranks = shown_ranks(ranks, [v.rank for v in violations if v.rank is not None])
    shown = shown_steps(trace.steps, len(ranks), [v.step for v in violations])
    data = _embedded(trace, shown, ranks, colors=colors, acceptance=fg.trace_acceptance(trace, report=report),
                      violations=violations)
    doc = _page(trace, title=title or f"pcpviz — {Path(str(trace.path)).name}", data=data, ranks=ranks,
                shown=shown, req_ids=req_ids, report=report)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out) as fh:
        fh.write(doc)
    return str(out)
