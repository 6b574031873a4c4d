"""Per-token detail in the HTML export: the strips' runs as data, and the page's script that draws
them for the window the reader zooms to, as the Workbench does in Python.

The Workbench redraws a zoomed strip in Python (``Workbench.zoom`` → ``pcpviz.views.figures.lod``);
an exported page has no kernel. So the export keeps, per (step, rank) and view, what every strip
of the figure was drawn from (``strips``: its lanes' runs with their levels, hover texts, labels
and per-token text, ``lod.RunText``; a strip of a 16k-token prefill is a few dozen runs, not
16k cells) and ``SCRIPT`` redraws a strip whenever its x axis is zoomed or panned: runs snapped
to whole pixels while a token is narrower than ``lod.TOKEN_PX``, one cell per token (1 px gaps,
the token's text when it fits) beyond. It mirrors ``lod.draw_strip`` line for line;
``tests/views/test_export_tokens.py`` holds the two to the same cells in Chromium.

PCP=2 example: the token-order view of a 16,384-token step (``long_prompt_run``) embeds 5 lanes
of a few runs each; zoomed to tokens 5,000-5,060 the page draws 60 cells per lane, each with its
DualChunkSwap chunk digit.

Size: a page embeds at most ``MAX_PAGE_RUNS`` runs, a report ``MAX_REPORT_RUNS``; past them a
(step, rank) page keeps its run-level drawing only, and its status line says so.
"""

from __future__ import annotations

import math
from typing import Container, Sequence

import numpy as np

from pcpviz.views.figures.canvas import safe_text
from pcpviz.views.figures.lod import MAX_LABELS, TOKEN_PX, Lane, Strip

__all__ = ["strips", "num_runs", "SCRIPT", "MAX_PAGE_RUNS", "MAX_REPORT_RUNS", "not_embedded_note"]

MAX_PAGE_RUNS = 20_000
"""Most runs one (step, rank) page embeds for per-token zoom (all its views together)."""
MAX_REPORT_RUNS = 400_000
"""Most runs one report embeds (about 100 bytes each)."""
_SAFE_INT = 2 ** 53  # larger slot or block ids do not survive as JavaScript numbers


def _lane(ln: Lane) -> dict | None:
    level = [v if math.isfinite(v) else None for v in np.asarray(ln.level, dtype=float).tolist()]
    out = {"e": np.asarray(ln.edges, dtype=np.int64).tolist(), "z": level,
           "h": [safe_text(str(h)) for h in ln.hover],
           "l": [[safe_text(t) for t in (lab if isinstance(lab, tuple) else (lab,))] for lab in ln.label], "t": None}
    if ln.text is not None:
        start = np.asarray(ln.text.start, dtype=np.int64)
        if start.size and int(np.abs(start).max()) + ln.length >= _SAFE_INT:
            return None
        out["t"] = {"c": [safe_text(str(c)) for c in ln.text.const], "s": start.tolist(),
                    "k": np.asarray(ln.text.counts, dtype=bool).astype(int).tolist()}
    # the per-token hover lines (Lane.token_lines): name and each run's first value, -1 where none
    out["th"] = [[safe_text(str(name)), np.asarray(first, dtype=np.int64).tolist()] for name, first in ln.token_hover]
    if any(max((abs(v) for v in first), default=0) + ln.length >= _SAFE_INT for _, first in out["th"]):
        return None
    return out


def strips(spec: dict, calls: Sequence[Strip], *, memo: dict | None = None,
           only: Container[int] = ()) -> list[dict] | None:
    """The strips of figure ``spec``, as the page's script reads them: its k-th heatmap trace
    was drawn by the k-th ``draw_strip`` call (``calls``, from ``lod.record_strips``); None when
    they do not pair up (a figure drawn as a message) or a value cannot be carried. ``memo``: the
    lanes of the calls whose id is in ``only`` (calls drawn once for several figures,
    ``lod.replay_strip``), made once and given as the same object."""
    heat = [i for i, t in enumerate(spec.get("data", [])) if t.get("type") == "heatmap"]
    if len(heat) != len(calls):
        return None
    out = []
    for i, call in zip(heat, calls):
        trace = spec["data"][i]
        if memo is not None and id(call) in only:
            lanes = memo.get(id(call))
            if lanes is None:
                lanes = memo[id(call)] = [_lane(ln) for ln in call.lanes]
        else:
            lanes = [_lane(ln) for ln in call.lanes]
        if any(ln is None for ln in lanes):
            return None
        xref, yref = trace.get("xaxis", "x"), trace.get("yaxis", "y")
        out.append({"trace": i, "xaxis": "xaxis" + xref[1:], "xref": xref, "yref": yref, "font": call.font_size,
                    "lanes": lanes})
    return out


def num_runs(page: dict[str, list[dict] | None]) -> int:
    """Runs a page's strips embed (view -> strips)."""
    return sum(len(ln["z"]) for s in page.values() if s for strip in s for ln in strip["lanes"])


def not_embedded_note(runs: int, *, budget_left: int) -> str:
    """The status-line note of a page whose per-token detail is not embedded."""
    why = (f"{runs:,} runs > {MAX_PAGE_RUNS:,} a page" if runs > MAX_PAGE_RUNS else
           f"the report's {MAX_REPORT_RUNS:,} runs are spent" if runs > budget_left else "")
    return (f"<div style='font-size:12px;color:#666;margin:0 4px'>per-token detail not embedded for this page "
            f"({why}): a zoom shows the runs drawn for the whole strip; the Workbench shows the tokens</div>")


SCRIPT = """
// Per-token detail of zoomed strips (pcpviz.views.export.tokens; mirrors pcpviz.views.figures.lod)
const PCPVIZ_TOKENS = (function(){
  const TOKEN_PX = %(token_px)r, MAX_LABELS = %(max_labels)d;
  const labelPx = (t, fs) => 0.62 * fs * [...t].length + 4;
  function fitting(alts, w, fs) { for (const t of alts) if (t && labelPx(t, fs) <= w) return t; return ''; }
  function right(e, v) { let lo = 0, hi = e.length; while (lo < hi) { const m = (lo + hi) >> 1;
    if (e[m] <= v) lo = m + 1; else hi = m; } return lo - 1; }          // searchsorted(e, v, 'right') - 1
  function left(e, v) { let lo = 0, hi = e.length; while (lo < hi) { const m = (lo + hi) >> 1;
    if (e[m] < v) lo = m + 1; else hi = m; } return lo; }               // searchsorted(e, v, 'left')
  function roundEven(x) { const r = Math.round(x); return (r - x === 0.5 && r %% 2 !== 0) ? r - 1 : r; }
  const clip = (v, a, b) => Math.min(Math.max(v, a), b);
  function runLabels(ln, li, lo, hi, u, fs) {
    const cand = [];
    for (let i = 0; i < ln.z.length; i++) {
      const a = clip(ln.e[i], lo, hi), b = clip(ln.e[i + 1], lo, hi), w = (b - a) / u, t = fitting(ln.l[i], w, fs);
      if (t) cand.push([i, w, (a + b) / 2, t]);
    }
    cand.sort((p, q) => q[1] - p[1]);
    return cand.slice(0, MAX_LABELS).sort((p, q) => p[0] - q[0]).map(c => [c[2], li, c[3]]);
  }
  function pixelCells(e, lo, hi, px) {
    const u = (hi - lo) / px, first = Math.max(right(e, lo), 0), last = Math.min(left(e, hi), e.length - 1);
    const ids = [], f = [], b = [];
    for (let k = first; k < last; k++) ids.push(k);
    for (let k = first; k <= last; k++) {
      f.push((clip(e[k], lo, hi) - lo) / u); b.push(clip(roundEven(f[f.length - 1]), 0, px));
    }
    const owner = [], have = new Map(), under = new Array(px).fill(1);
    ids.forEach((id, j) => { const w = b[j + 1] - b[j]; have.set(id, w); for (let q = 0; q < w; q++) owner.push(id); });
    while (owner.length < px) owner.push(ids.length ? ids[ids.length - 1] : 0);
    ids.forEach((id, j) => {
      if (b[j + 1] - b[j] !== 0) return;
      const q = Math.min(Math.trunc((f[j] + f[j + 1]) / 2), px - 1), prev = owner[q];
      if ((have.get(prev) || 0) >= 2 && under[q] === 1) {
        owner[q] = id; have.set(prev, have.get(prev) - 1); have.set(id, 1);
      }
      under[q] += 1;
    });
    const edges = [0], run = [owner[0]], cover = [under[0]];
    for (let q = 1; q < px; q++) {
      if (owner[q] !== owner[q - 1]) { edges.push(q); run.push(owner[q]); cover.push(under[q]); }
      else cover[cover.length - 1] = Math.max(cover[cover.length - 1], under[q]);
    }
    edges.push(px);
    return [edges, run, cover];
  }
  function drawRuns(lanes, lo, hi, px, fs) {
    const u = (hi - lo) / px, per = lanes.map(ln => {
      const len = ln.e[ln.e.length - 1], e = len >= hi ? ln.e : ln.e.concat([Math.ceil(hi)]);
      return pixelCells(e, lo, hi, px);
    });
    const union = [...new Set(per.flatMap(c => c[0]))].sort((a, b) => a - b), starts = union.slice(0, -1);
    const z = [], hover = [], labels = [];
    lanes.forEach((ln, li) => {
      const [pe, owner, under] = per[li], m = ln.z.length, zr = [], hr = [];
      for (const s of starts) {
        const k = right(pe, s), r = owner[k], n = under[k];
        zr.push(r < m && m ? ln.z[Math.min(r, m - 1)] : null);
        const h = r < m ? ln.h[r] : '';
        hr.push(h + (n > 2 && h ? '<br>(this pixel covers ' + n + ' runs: zoom in)' : ''));
      }
      z.push(zr); hover.push(hr); labels.push(...runLabels(ln, li, lo, hi, u, fs));
    });
    return {x: union.map(q => lo + q * u), z, hover, text: null, labels, xgap: 0};
  }
  function drawTokens(lanes, lo, hi, px, fs) {
    const t0 = Math.floor(lo), t1 = Math.ceil(hi), cellPx = px / Math.max(hi - lo, 1e-9);
    const z = [], hover = [], text = [], labels = [];
    let fits = true;
    lanes.forEach(ln => {
      const m = ln.z.length, len = ln.e[ln.e.length - 1], zr = [], hr = [], tr = [];
      for (let t = t0; t < t1; t++) {
        const r = right(ln.e, t), inside = t < len && r >= 0 && r < m;
        zr.push(inside ? ln.z[r] : null);
        hr.push(inside ? ln.h[r] + (ln.th || []).map(([name, first]) =>
          first[r] >= 0 ? '<br>' + name + ' ' + (first[r] + t - ln.e[r]) : '').join('') : '');
        let s = '';
        if (inside && ln.t) {
          s = ln.t.k[r] ? String(ln.t.s[r] + t - ln.e[r]) : ln.t.c[r]; fits = fits && labelPx(s, fs) <= cellPx;
        }
        tr.push(s);
      }
      z.push(zr); hover.push(hr); text.push(tr);
    });
    if (!fits) lanes.forEach((ln, li) => labels.push(...runLabels(ln, li, lo, hi, (hi - lo) / px, fs)));
    const x = []; for (let t = t0; t <= t1; t++) x.push(t);
    return {x, z, hover, text: fits ? text : null, labels, xgap: 1};
  }
  function draw(strip, range, px) {   // lod.draw_strip for the window `range`, `px` wide
    const width = Math.max(1, ...strip.lanes.map(ln => ln.e[ln.e.length - 1]));
    let lo = Math.max(+range[0], 0), hi = Math.min(+range[1], width);
    if (!(hi - lo >= 1e-9)) { lo = 0; hi = width; }
    return (hi - lo) <= px / TOKEN_PX ? drawTokens(strip.lanes, lo, hi, px, strip.font)
                                      : drawRuns(strip.lanes, lo, hi, px, strip.font);
  }
  // Redraw the strips of plot `gd` (showing `fig`, whose strips are `strips`) for its axes' ranges.
  function redraw(gd, fig, strips, config) {
    const fl = gd._fullLayout, data = fig.data.slice(), layout = Object.assign({}, gd.layout);
    const mine = new Set(), added = [];
    for (const s of strips || []) {
      const ax = fl[s.xaxis];
      if (!ax || !ax._length) continue;
      const d = draw(s, ax.range, Math.round(ax._length));
      data[s.trace] = Object.assign({}, data[s.trace], {x: d.x, z: d.z, hovertext: d.hover, xgap: d.xgap,
        text: d.text || [], texttemplate: d.text ? '%%{text}' : ''});
      mine.add(s.xref + ' ' + s.yref);
      for (const [x, li, t] of d.labels)
        added.push({x, y: li, xref: s.xref, yref: s.yref, text: t, showarrow: false,
                    font: {size: s.font, color: '#222'}});
    }
    layout.annotations = (fig.layout.annotations || []).filter(a => !mine.has(a.xref + ' ' + a.yref)).concat(added);
    return Plotly.react(gd, data, layout, config);
  }
  return {draw, redraw};
})();
""" % {"token_px": TOKEN_PX, "max_labels": MAX_LABELS}
"""The page's per-token drawing (``PCPVIZ_TOKENS.draw(strip, range, px)`` as ``lod.draw_strip``,
``PCPVIZ_TOKENS.redraw(gd, fig, strips, config)`` for a plot after a zoom)."""
