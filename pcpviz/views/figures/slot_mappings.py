"""The slot-mapping view: ``slot_mapping_global`` [G, T], ``slot_mapping_gathered`` [G, N*P]
(PAD = -1 shown), the KV write mask, and the draft step's ``slot_mapping_draft`` (expanded for
the rank-local draft_0, unexpanded ``[G, R]`` for a replicated decode).

PCP=2 example: ``cpu-pcp2-mtp2`` step 0 has T = 48 global slots and N*P = 52 gathered rows
(rank 0 pads 22 -> 26 rows with -1); its replicated ``draft_1`` records R = 2 slots, one per
request.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.figures.aggregate import run_edges
from pcpviz.views.figures.canvas import (FLAG_COLOR, Canvas, L_NULL, L_PAD, L_REPLICA, L_WRITTEN, range_text,
                                         req_levels, strip_heat, strip_labels, vline, as_figure)
from pcpviz.views.figures.lod import FONT_PX, PAD_MIN_PX, PLOT_PX, Lane, RunText, draw_strip
from pcpviz.trace import Record
from pcpviz.trace.shapes import slot_groups
from pcpviz.views.figures.step_data import is_replicated, step_layout, view_array

__all__ = ["slot_mappings_spec", "slot_mappings_figure", "slot_strip", "slot_mappings_inputs"]


def _slot_strip(slots: np.ndarray, req: np.ndarray, status: np.ndarray | None, levels: np.ndarray,
                label: str, index_name: str) -> Lane:
    """One strip as runs of equal request (and write status) whose slot ids continue by +1:
    text = slot id per token, the slot range per run; PAD (-1) grey, a slot of no request white."""
    n = slots.shape[0]
    keys = [req, slots < 0] + ([status] if status is not None else [])
    e = run_edges(n, keys=keys, arith=[slots], arith_valid=[slots >= 0])
    a, b = e[:-1], e[1:]
    s0, s1 = slots[a] if n else a, slots[np.maximum(b - 1, 0)] if n else a
    level, text, hover = [], [], []
    for j, (x, y, q, u, v) in enumerate(zip(a.tolist(), b.tolist(), req[a].tolist() if n else [],
                                            s0.tolist(), s1.tolist())):
        pad = u < 0
        level.append(L_PAD if pad else L_NULL if q < 0 else levels[q])
        text.append("PAD" if pad else (range_text(u, v), f"{u}…") if v != u else str(u))
        h = f"{label}<br>{index_name} {range_text(x, y - 1)}<br>"
        h += "PAD (-1): nothing written" if pad else f"slot {range_text(u, v)}"
        if status is not None and not pad:
            h += "<br>" + {2: "KV written", 1: "replica: not written", 0: "padding"}[int(status[x])]
        hover.append(h)
    starts = s0.astype(np.int64) if n else np.zeros(0, np.int64)  # a run's slots count up from its first
    return Lane(e, np.asarray(level, dtype=float), text, hover,
                RunText(["PAD" if u < 0 else "" for u in starts.tolist()], starts, starts >= 0),
                token_hover=((index_name, a.astype(np.int64)), ("slot", np.where(starts >= 0, starts, -1))),
                min_px=np.where(starts < 0, PAD_MIN_PX, 0))


slot_strip = _slot_strip
"""A slot-mapping strip (runs of one request whose slot ids count up by one), shared with ``dcp_shards``."""


def _mask_strip(status: np.ndarray, req: np.ndarray) -> Lane:
    """The KV write mask over the gathered rows: runs of equal status and request."""
    e = run_edges(status.shape[0], keys=[status, req])
    st = status[e[:-1]].tolist()
    lev = {2: L_WRITTEN, 1: L_REPLICA, 0: L_PAD}
    names = {2: "written", 1: "replica: not written", 0: "padding"}
    return Lane(e, np.array([lev[x] for x in st], dtype=float),
                [({2: "written", 1: "replica", 0: "pad"}[x], {2: "W", 1: "r", 0: "·"}[x]) for x in st],
                [f"{names[x]}<br>gathered rows {range_text(a, b - 1)}"
                 for x, a, b in zip(st, e[:-1].tolist(), e[1:].tolist())],
                RunText.per_run([{2: "W", 1: "r", 0: "·"}[x] for x in st]),
                token_hover=(("gathered row", e[:-1].astype(np.int64)),),
                min_px=np.array([PAD_MIN_PX if x == 0 else 0 for x in st], dtype=np.int64))


def slot_mappings_spec(target: Record, draft: Record | None = None, *, draft_phase: str | None = None,
                       highlight: str | None = None, colors: Mapping[str, int] | None = None,
                       group: int = 0, windows: Mapping[str, tuple[float, float]] | None = None,
                       px: int = PLOT_PX) -> dict:
    """Slot mappings of one step: ``slot_mapping_global`` [G, T] (global order),
    ``slot_mapping_gathered`` [G, N*P] (rank-major gathered rows, PAD = -1 grey) with the
    KV write mask under it, and the draft step's ``slot_mapping_draft`` — ``[G, N*P]``
    expanded for the rank-local draft_0, unexpanded ``[G, R]`` for a replicated decode.
    ``windows`` maps a strip's x axis (``"xaxis"``, ``"xaxis2"``, ...) to the range shown, drawn
    ``px`` pixels wide at its level of detail (``lod``)."""
    sl = step_layout(target)
    levels = req_levels(sl.req_ids, colors, highlight)
    n, p, t, r = sl.pcp, sl.padded, sl.num_tokens, sl.num_reqs
    strips = []
    sg = slot_groups(view_array(target, "slot_mapping_global"))
    if sg is not None:
        sgg = sg[group][:t] if sg.shape[0] > group else np.zeros(0, np.int64)
        strips.append((f"slot_mapping_global [G={sg.shape[0]}, T={sg.shape[1]}] (global token order)",
                       _slot_strip(sgg, sl.token_req[: sgg.shape[0]], None, levels, "global", "global token"),
                       "global token", None))
    sgat = slot_groups(view_array(target, "slot_mapping_gathered"))
    status = sl.row_status()
    rreq = sl.row_req()
    if sgat is not None:
        v = sgat[group] if sgat.shape[0] > group else np.zeros(0, np.int64)
        m = min(v.shape[0], status.shape[0])
        strips.append((f"slot_mapping_gathered [G={sgat.shape[0]}, N*P={sgat.shape[1]}] (rank-major; PAD = -1)",
                       _slot_strip(v[:m], rreq[:m], status[:m], levels, "gathered", "gathered row"),
                       "gathered row (rank-major)", p))
    # write mask strip (own row)
    strips.append((f"kv_write_mask [N*P={status.shape[0]}]: {int(sl.kv_write_mask.sum())} rows written "
                   f"(T = {t})<br>W written, r replica, · padding", _mask_strip(status, rreq),
                   "gathered row (rank-major)", p))
    strip, flag_note = _draft_strip(draft, target, draft_phase=draft_phase, group=group, levels=levels,
                                    status=status, rreq=rreq, num_reqs=r, padded=p)
    strips.append(strip)
    fig = Canvas([[1]] * len(strips), vertical_spacing=0.62 / len(strips) if len(strips) > 1 else 0.1,
                  subplot_titles=[s[0] for s in strips])
    shapes = fig.shapes
    annots = fig.annotations
    windows = windows or {}
    for k, (_, lane, xtitle, rank_p) in enumerate(strips):
        xr, yr = fig.ref(k + 1, 1)
        d = draw_strip([lane], window=windows.get("xaxis" + xr[1:]), px=px, font_size=FONT_PX)
        fig.add(strip_heat(d, [""], font_size=FONT_PX, ygap=0), k + 1, 1)
        annots.extend(strip_labels(xr, yr, d, font_size=FONT_PX))
        fig.axis("y", k + 1, 1, showticklabels=False)
        fig.axis("x", k + 1, 1, title=dict(text=xtitle, standoff=0, font=dict(size=10)), range=list(d.window))
        if xtitle == "request row (global order)" and r and lane.length == r and d.per_token:
            fig.axis("x", k + 1, 1, tickvals=(np.arange(r) + 0.5).tolist(), ticktext=list(sl.req_ids))
        if rank_p:
            xr, yr = fig.ref(k + 1, 1)
            for q in range(1, n):
                shapes.append(vline(xr, yr, q * rank_p, color="#333", width=2))
    if flag_note:
        annots.append(dict(text=flag_note, xref="paper", yref="paper", x=1, y=-0.08, xanchor="right",
                           showarrow=False, font=dict(color=FLAG_COLOR, size=13), bgcolor="#fff3f3",
                           bordercolor=FLAG_COLOR))
    return fig.spec(height=150 + 120 * len(strips), margin=dict(l=30, r=20, t=80, b=40),
                      title=dict(text=f"slot mappings (group {group}; text = slot id)<br>PCP={n}, P={p}, T={t}, R={r}",
                                 font=dict(size=13)))


def slot_mappings_inputs(target: Record, draft: Record | None) -> tuple:
    """What ``slot_mappings_spec`` reads from ``target`` and ``draft``, besides its keyword
    arguments: the step's layout, the three slot-mapping views and whether the draft step ran
    replicated. Equal inputs (``content_key``) draw equal figures: at PCP > 1 these are the step's
    global views, so the HTML report draws a step's figure once for all its ranks. Raises where the
    figure cannot be drawn."""
    sd = view_array(draft, "slot_mapping_draft")
    return (step_layout(target), view_array(target, "slot_mapping_global"),
            view_array(target, "slot_mapping_gathered"), sd,
            None if slot_groups(sd) is None else is_replicated(draft, target))


def slot_mappings_figure(target: Record, draft: Record | None = None, *, draft_phase: str | None = None,
                         highlight: str | None = None, colors: Mapping[str, int] | None = None,
                         group: int = 0, windows: Mapping[str, tuple[float, float]] | None = None) -> go.Figure:
    """``slot_mappings_spec`` as a ``go.Figure``."""
    return as_figure(slot_mappings_spec(target, draft, draft_phase=draft_phase, highlight=highlight, colors=colors,
                                        group=group, windows=windows))


def _draft_strip(draft: Record | None, target: Record, *, draft_phase: str | None, group: int, levels,
                 status: np.ndarray, rreq: np.ndarray, num_reqs: int, padded: int) -> tuple[tuple, str | None]:
    """The draft step's ``slot_mapping_draft`` strip (unexpanded ``[G, R]`` for a replicated
    decode, the gathered ``[G, N*P]`` for the rank-local draft_0), and a flag line when a
    replicated mapping is not R long."""
    r, p = num_reqs, padded
    flag_note = None
    sd = slot_groups(view_array(draft, "slot_mapping_draft"))
    if sd is None:
        return ("draft slot mapping: no draft step recorded", _slot_strip(
            np.zeros(0, np.int64), np.zeros(0, np.int64), None, levels, "draft", "row"), "", None), None
    v = sd[group] if sd.shape[0] > group else np.zeros(0, np.int64)
    if is_replicated(draft, target):
        dreq = np.arange(v.shape[0]) if v.shape[0] == r else np.full(v.shape[0], -1)
        what = (f"{draft_phase or 'draft'} slot_mapping_draft [G={sd.shape[0]}, {v.shape[0]}] "
                f"replicated:<br>unexpanded, one slot per request (R = {r})")
        if v.shape[0] != r:
            flag_note = (f"⚠ {draft_phase}: replicated draft slot mapping has length {v.shape[0]}, "
                         f"expected unexpanded R = {r}")
        return (what, _slot_strip(v, dreq, None, levels, draft_phase or "draft", "request row"),
                "request row (global order)", None), flag_note
    m = min(v.shape[0], status.shape[0])
    return (f"{draft_phase or 'draft'} slot_mapping_draft [G={sd.shape[0]}, {v.shape[0]}] rank-local:<br>"
            f"the target's gathered (expanded N*P) mapping",
            _slot_strip(v[:m], rreq[:m], status[:m], levels, draft_phase or "draft", "gathered row"),
            "gathered row (rank-major)", p), None
