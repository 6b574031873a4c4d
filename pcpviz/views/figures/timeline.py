"""The draft-step timeline: one step as columns target -> draft_0 -> gather -> draft_1 .. ->
verify, one row per request (global order).

PCP=2, K=2 example (``cpu-pcp2-mtp2`` step 1): draft_0 runs rank-local (rank 0 sees only its
own rows of each request), the block tables are gathered back to global order, and draft_1
runs replicated on every rank with one row per request; verify then shows accepted / drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.figures.block_tables import draft_block_table_flags
from pcpviz.views.figures.canvas import DIM_COLOR, Canvas, range_text, stepped_colorscale, vline, as_figure
from pcpviz.trace import Record
from pcpviz.trace.shapes import slot_groups
from pcpviz.views.figures.step_data import StepLayout, has_layout, is_replicated, step_layout, view_array

__all__ = ["draft_timeline_spec", "draft_timeline_figure"]

_KIND_COLORS = {  # timeline cell backgrounds
    "global": "#e3e9f3",
    "rank_local": "#fde0c2",
    "replicated": "#cfe3f6",
    "ok": "#dcefd6",
    "flag": "#f6c3c0",
    "absent": "#f7f7f7",
}


@dataclass
class _Grid:
    """The timeline's cells: one row per request (global order), one column per phase."""

    req_ids: list[str]
    kinds: np.ndarray  # object[max(R, 1), C]: a key of _KIND_COLORS
    text: np.ndarray  # object[max(R, 1), C]
    hover: np.ndarray  # object[max(R, 1), C]


def _columns(order: list[str], phases: Mapping[str, Record], target: Record | None) -> list[str]:
    """The phases in causal order, with ``gather`` before the first replicated draft phase."""
    drafts = [ph for ph in order if ph.startswith("draft_")]
    has_replicated = any(is_replicated(phases[ph], target) for ph in drafts)
    cols: list[str] = []
    for ph in order:
        if ph.startswith("draft_") and has_replicated and "gather" not in cols and is_replicated(phases[ph], target):
            cols.append("gather")
        cols.append(ph)
    return cols


def _target_col(g: _Grid, c: int, target: Record, sl: StepLayout) -> str:
    pos = np.asarray(target["positions"])
    sq = view_array(target, "seq_lens")
    for i in range(len(g.req_ids)):
        a, b = int(sl.query_start_loc[i]), int(sl.query_start_loc[i + 1])
        if b > a:
            g.kinds[i, c] = "global"
            g.text[i, c] = f"pos {range_text(int(pos[a]), int(pos[b - 1]))}" + \
                (f"<br>len {int(sq[i])}" if sq is not None else "")
            g.hover[i, c] = (f"{g.req_ids[i]} target (global batch): {b - a} tokens, positions "
                             f"{range_text(int(pos[a]), int(pos[b - 1]))}")
    return f"<b>target</b><br>global T={sl.num_tokens}<br>→ P={sl.padded} rows/rank"


def _gather_col(g: _Grid, c: int, flagged_rows: Mapping[int, Any], first_replicated: str | None) -> str:
    for i in range(len(g.req_ids)):
        f = flagged_rows.get(i)
        g.kinds[i, c] = "flag" if f else "ok"
        g.text[i, c] = ("✗ zero row" if f.kind == "zero" else "✗ stale row") if f else "✓ global row"
        g.hover[i, c] = (f.describe() + f"<br>expected {f.expected[:8].tolist()}<br>actual {f.actual[:8].tolist()}"
                         if f else f"{g.req_ids[i]}: {first_replicated} uses its global block-table row")
    return "<b>gather</b><br>block tables<br>→ global order"


def _verify_col(g: _Grid, c: int, verify: Record) -> str:
    acc = view_array(verify, "num_accepted")
    nd = view_array(verify, "num_draft_tokens")
    ns = view_array(verify, "num_sampled")
    vids = [str(x) for x in np.asarray(verify["req_ids"]).ravel()] if "req_ids" in verify else g.req_ids
    for j, rid in enumerate(vids):
        if rid not in g.req_ids:
            continue
        i = g.req_ids.index(rid)
        g.kinds[i, c] = "global"
        parts = []
        if acc is not None and nd is not None:
            parts.append(f"acc {int(acc[j])}/{int(nd[j])}")
        if ns is not None:
            parts.append(f"{int(ns[j])} sampled")
        g.text[i, c] = "<br>".join(parts)
        g.hover[i, c] = f"{rid} verify: " + ", ".join(parts)
    return "<b>verify</b> · global<br>accepted / drafted<br>(the previous step's drafts)"


def _replicated_col(g: _Grid, c: int, ph: str, d: Record, flagged: Mapping[int, Any]) -> str:
    """A draft phase on the replicated layout view: one row per request (R rows)."""
    dpos = view_array(d, "draft_positions", np.zeros(0, np.int64))
    dsl = view_array(d, "draft_seq_lens", np.zeros(0, np.int64))
    dtok = view_array(d, "draft_tokens")
    for i in range(min(len(g.req_ids), dpos.shape[0])):
        g.kinds[i, c] = "replicated"
        s = f"pos {int(dpos[i])}"
        if i < dsl.shape[0]:
            s += f"<br>len {int(dsl[i])}"
        if dtok is not None and i < dtok.shape[0]:
            s += f"<br>→ tok {int(dtok[i])}"
        g.text[i, c] = s
        g.hover[i, c] = f"{g.req_ids[i]} {ph} (replicated): " + s.replace("<br>", ", ")
        if i in flagged:
            g.kinds[i, c] = "flag"
    return f"<b>{ph}</b> · replicated<br>{dpos.shape[0]} rows (R)<br>slots {_slots_shape(d)} unexpanded"


def _rank_local_col(g: _Grid, c: int, ph: str, d: Record, *, target: Record | None, rank: int | None) -> str:
    """A draft phase on the rank-local layout view: this rank's segments, in local-row order."""
    dpos = view_array(d, "draft_positions", np.zeros(0, np.int64))
    dsl = view_array(d, "draft_seq_lens", np.zeros(0, np.int64))
    lids = [str(x) for x in np.asarray(view_array(target, "local_req_ids", np.array([], dtype=str))).ravel()]
    lqsl = view_array(target, "local_query_start_loc")
    for i, rid in enumerate(g.req_ids):
        segs = [k for k, x in enumerate(lids) if x == rid]
        if not segs or lqsl is None:
            g.text[i, c] = f"— (not on rank {rank})" if rank is not None else "—"
            g.hover[i, c] = f"{rid} has no rows on this rank in {ph}"
            continue
        g.kinds[i, c] = "rank_local"
        ranges = []
        for k in segs:
            a, b = int(lqsl[k]), int(lqsl[k + 1])
            if b > a and b <= dpos.shape[0]:
                ranges.append(range_text(int(dpos[a]), int(dpos[b - 1])))
        lens = [int(dsl[k]) for k in segs if k < dsl.shape[0]]
        g.text[i, c] = "pos " + ", ".join(ranges) + ("<br>len " + ", ".join(map(str, lens)) if lens else "")
        g.hover[i, c] = f"{rid} {ph} (rank-local, rank {rank}): positions {', '.join(ranges)}, seq_lens {lens}"
    return f"<b>{ph}</b> · rank-local<br>{dpos.shape[0]} local rows<br>slots {_slots_shape(d)} expanded"


def _slots_shape(d: Record) -> str:
    sm = slot_groups(view_array(d, "slot_mapping_draft"))
    return f"[{sm.shape[0]}, {sm.shape[1]}]" if sm is not None else "?"


def _collectives(g: _Grid, c: int, rec: Record | None) -> str:
    """The phase's recorded collectives (the ``collectives`` view: the CPU replay and the engine):
    the tick's last line counts them, every cell's hover names them, identical calls counted once
    ("2x all_gather pcp float32[14, 512] dim=0"); "" where the phase did not record them."""
    calls = view_array(rec, "collectives")
    if calls is None:
        return ""
    lines = [str(x) for x in np.asarray(calls).reshape(-1)]
    kinds = list(dict.fromkeys(lines))  # distinct calls, in the order first made
    listed = "<br>".join(f"{lines.count(k)}x {k}" for k in kinds[:4])
    if len(kinds) > 4:
        listed += f"<br>... {len(kinds) - 4} more kinds"
    said = f"collectives on this rank:<br>{listed}" if lines else "no collective on this rank"
    for i in range(g.hover.shape[0]):
        g.hover[i, c] = f"{g.hover[i, c]}<br>{said}" if g.hover[i, c] else said
    if not lines:
        return "<br><i>no collective</i>"
    return f"<br><i>{len(lines)} collective{'s' if len(lines) != 1 else ''}</i>"


def _marks(fig: Canvas, cols: list[str], *, rows: int, selected_phase: str | None, highlight_row: int | None) -> None:
    """The layout-view switch before ``gather``, the selected phase's column, the highlighted row."""
    if "gather" in cols:
        g = cols.index("gather")
        fig.shapes.append(vline("x", "y", g - 0.5, color="#7b3fa0", width=3, dash="dash"))
        fig.annotations.append(dict(x=g - 0.5, y=0, xref="x", yref="paper", yanchor="top", xanchor="center",
                                    showarrow=False, yshift=-4, text="▲ view switch: rank-local → replicated "
                                    "(block tables gathered back to global order)",
                                    font=dict(color="#7b3fa0", size=11)))
    if selected_phase in cols:
        s = cols.index(selected_phase)
        fig.shapes.append(dict(type="rect", xref="x", yref="y", x0=s - 0.5, x1=s + 0.5, y0=-0.5, y1=rows - 0.5,
                               line=dict(color="#111", width=3)))
    if highlight_row is not None:
        i = highlight_row
        fig.shapes.append(dict(type="rect", xref="x", yref="y", x0=-0.5, x1=len(cols) - 0.5, y0=i - 0.5, y1=i + 0.5,
                               line=dict(color="#111", width=2, dash="dot")))


def _fill(g: _Grid, cols: list[str], phases: Mapping[str, Record], *, rank: int | None, group: int) -> list[str]:
    """Fill every column of ``g``; returns the column tick texts."""
    target, verify = phases.get("target"), phases.get("verify")
    sl = step_layout(target) if has_layout(target) else None
    drafts = [ph for ph in cols if ph.startswith("draft_")]
    first_replicated = next((ph for ph in drafts if is_replicated(phases[ph], target)), None)
    gather_flags = draft_block_table_flags(target, phases[first_replicated], group) \
        if first_replicated is not None and target is not None else []
    flagged_rows = {f.row: f for f in gather_flags}
    ticks = []
    for c, ph in enumerate(cols):
        if ph == "target" and target is not None and sl is not None:
            ticks.append(_target_col(g, c, target, sl))
        elif ph == "gather":
            ticks.append(_gather_col(g, c, flagged_rows, first_replicated))
        elif ph == "verify" and verify is not None:
            ticks.append(_verify_col(g, c, verify))
        elif ph.startswith("draft_") and is_replicated(phases[ph], target):
            ticks.append(_replicated_col(g, c, ph, phases[ph], flagged_rows if ph == first_replicated else {}))
        elif ph.startswith("draft_"):
            ticks.append(_rank_local_col(g, c, ph, phases[ph], target=target, rank=rank))
        else:
            ticks.append(f"<b>{ph}</b>")
    return ticks


def draft_timeline_spec(phases: Mapping[str, Record], *, step: int | None = None, rank: int | None = None,
                        selected_phase: str | None = None, highlight: str | None = None,
                        group: int = 0) -> dict:
    """One step as columns target → draft_0 → gather → draft_1 … → verify, one row per request
    (global order). A cell says what the phase fed that request: positions and seq_lens
    (draft_0: this rank's local rows only), the proposed token, the verify outcome. Orange =
    rank-local, blue = replicated, grey = global batch; the gather column is green where the
    draft rows equal the global rows and red where they are zero/stale."""
    from pcpviz.trace.schema import phase_sort_key  # noqa: PLC0415 (cheap, avoids a cycle)

    order = sorted((ph for ph in phases if ph != "dummy"), key=phase_sort_key)
    target = phases.get("target")
    base = target if target is not None else phases.get("verify")
    req_ids = [str(x) for x in np.asarray(base["req_ids"]).ravel()] if base is not None and "req_ids" in base else []
    r = len(req_ids)
    cols = _columns(order, phases, target)
    shape = (max(r, 1), len(cols))
    g = _Grid(req_ids, np.full(shape, "absent", dtype=object), np.full(shape, "", dtype=object),
              np.full(shape, "", dtype=object))
    ticks = _fill(g, cols, phases, rank=rank, group=group)
    ticks = [t + _collectives(g, c, phases.get(ph)) for c, (t, ph) in enumerate(zip(ticks, cols))]
    level_of = {k: i for i, k in enumerate(_KIND_COLORS)}
    colors = list(_KIND_COLORS.values()) + [DIM_COLOR]
    z = np.vectorize(lambda k: level_of[k])(g.kinds).astype(float) if g.kinds.size else np.zeros((1, 1))
    lit = highlight is not None and highlight in req_ids
    if lit:
        z[np.array([rid != highlight for rid in req_ids]), :] = len(_KIND_COLORS)
    fig = Canvas([[1]])
    fig.add(dict(
        type="heatmap", z=z, x=list(range(len(cols))), y=req_ids or [""], text=g.text, texttemplate="%{text}",
        textfont=dict(size=10), hovertext=g.hover, hoverinfo="text", colorscale=stepped_colorscale(colors),
        zmin=-0.5, zmax=len(colors) - 0.5, showscale=False, xgap=3, ygap=3,
    ))
    fig.axis("y", autorange="reversed")
    fig.axis("x", tickvals=list(range(len(cols))), ticktext=ticks, side="top", range=[-0.5, len(cols) - 0.5])
    _marks(fig, cols, rows=max(r, 1), selected_phase=selected_phase,
           highlight_row=req_ids.index(highlight) if lit else None)
    where = ", ".join(x for x in (f"step {step}" if step is not None else "",
                                  f"rank {rank}" if rank is not None else "") if x)
    return fig.spec(
        title=dict(text=f"draft-step timeline ({where}): orange rank-local, blue replicated, grey global",
                   y=0.99, yanchor="top"),
        height=200 + 58 * max(r, 1), margin=dict(l=70, r=20, t=120, b=40),
    )


def draft_timeline_figure(phases: Mapping[str, Record], *, step: int | None = None, rank: int | None = None,
                          selected_phase: str | None = None, highlight: str | None = None,
                          group: int = 0) -> go.Figure:
    """``draft_timeline_spec`` as a ``go.Figure``."""
    return as_figure(draft_timeline_spec(phases, step=step, rank=rank, selected_phase=selected_phase,
                                         highlight=highlight, group=group))
