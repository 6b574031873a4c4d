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

from pcpviz.views.figures.aggregate import cell_edges, run_edges
from pcpviz.views.figures.canvas import (FLAG_COLOR, TEXT_LIMIT, _Canvas, _L_NULL, _L_PAD, _L_REPLICA, _L_WRITTEN, _heat,
                                   _range_text, _req_levels, _run_labels, _text_fits, _vline, as_figure)
from pcpviz.views.figures.step_data import Rec, _arr, _g2, _is_replicated, step_layout

__all__ = ["slot_mappings_spec", "slot_mappings_figure"]


def _slot_strip(slots: np.ndarray, req: np.ndarray, status: np.ndarray | None, levels: np.ndarray,
                label: str, index_name: str):
    """One strip: (z[1, m], edges, text[1, m], hover[1, m], show_text)."""
    n = slots.shape[0]
    keys = [req] + ([status] if status is not None else [])
    valid = slots >= 0
    edges, merged = cell_edges(n, keys=keys, arith=[slots], arith_valid=[valid])
    starts, stops = edges[:-1], edges[1:]
    per_token = bool(np.all(stops - starts == 1))
    r = req[starts]
    s0 = slots[starts]
    s1 = slots[np.maximum(stops - 1, 0)]
    st = status[starts] if status is not None else None
    z = np.empty(starts.shape[0], dtype=float)
    text = np.empty(starts.shape[0], dtype=object)
    hover = np.empty(starts.shape[0], dtype=object)
    for j in range(starts.shape[0]):
        a, b = int(starts[j]), int(stops[j]) - 1
        pad = s0[j] < 0
        if pad:
            z[j] = _L_PAD
            text[j] = "PAD" if per_token else "PAD"
        elif r[j] < 0:
            z[j] = _L_NULL
            text[j] = str(int(s0[j]))
        else:
            z[j] = levels[r[j]]
            text[j] = str(int(s0[j])) if per_token else _range_text(int(s0[j]), int(s1[j]))
        h = f"{label}<br>{index_name} {_range_text(a, b)}<br>"
        h += "PAD (-1): nothing written" if pad else f"slot {_range_text(int(s0[j]), int(s1[j]))}"
        if st is not None and not pad:
            h += "<br>" + {2: "KV written", 1: "replica: not written", 0: "padding"}[int(st[j])]
        if merged[j] > 1:
            h += f"<br>(mixed: {merged[j]} runs merged)"
        hover[j] = h
    show = per_token and starts.shape[0] <= TEXT_LIMIT and _text_fits(starts.shape[0], text)
    labels: tuple = ()
    if not show:
        e = run_edges(n, keys=keys, arith=[slots], arith_valid=[valid])
        ra, rb = e[:-1], e[1:]
        labels = (ra, rb, ["PAD" if slots[x] < 0 else _range_text(int(slots[x]), int(slots[y - 1]))
                           for x, y in zip(ra, rb)], n)
    return z[None, :], edges, text[None, :], hover[None, :], show, labels


def slot_mappings_spec(target: Rec, draft: Rec | None = None, *, draft_phase: str | None = None,
                       highlight: str | None = None, colors: Mapping[str, int] | None = None,
                       group: int = 0) -> dict:
    """Slot mappings of one step: ``slot_mapping_global`` [G, T] (global order),
    ``slot_mapping_gathered`` [G, N*P] (rank-major gathered rows, PAD = -1 grey) with the
    KV write mask under it, and the draft step's ``slot_mapping_draft`` — ``[G, N*P]``
    expanded for the rank-local draft_0, unexpanded ``[G, R]`` for a replicated decode."""
    sl = step_layout(target)
    levels = _req_levels(sl.req_ids, colors, highlight)
    n, p, t, r = sl.pcp, sl.padded, sl.num_tokens, sl.num_reqs
    strips = []
    sg = _g2(_arr(target, "slot_mapping_global"))
    if sg is not None:
        sgg = sg[group][:t] if sg.shape[0] > group else np.zeros(0, np.int64)
        strips.append((f"slot_mapping_global [G={sg.shape[0]}, T={sg.shape[1]}] (global token order)",
                       _slot_strip(sgg, sl.token_req[: sgg.shape[0]], None, levels, "global", "global token"),
                       "global token", None))
    sgat = _g2(_arr(target, "slot_mapping_gathered"))
    status = sl.row_status()
    rreq = sl.row_req()
    if sgat is not None:
        v = sgat[group] if sgat.shape[0] > group else np.zeros(0, np.int64)
        m = min(v.shape[0], status.shape[0])
        strips.append((f"slot_mapping_gathered [G={sgat.shape[0]}, N*P={sgat.shape[1]}] (rank-major; PAD = -1)",
                       _slot_strip(v[:m], rreq[:m], status[:m], levels, "gathered", "gathered row"),
                       "gathered row (rank-major)", p))
    # write mask strip (own row)
    medges, _ = cell_edges(status.shape[0], keys=[status, rreq])
    ms = medges[:-1]
    mz = np.where(status[ms] == 2, _L_WRITTEN, np.where(status[ms] == 1, _L_REPLICA, _L_PAD)).astype(float)
    mt = np.where(status[ms] == 2, "W", np.where(status[ms] == 1, "r", "·")).astype(object)
    mh = np.array([f"{ {2: 'written', 1: 'replica: not written', 0: 'padding'}[int(status[a])] }"
                   f"<br>gathered rows {_range_text(int(a), int(b) - 1)}" for a, b in zip(ms, medges[1:])], dtype=object)
    strips.append((f"kv_write_mask [N*P={status.shape[0]}]: {int(sl.kv_write_mask.sum())} rows written "
                   f"(T = {t}); W written, r replica, · padding",
                   (mz[None, :], medges, mt[None, :], mh[None, :], _text_fits(ms.shape[0], mt),
                    (ms, medges[1:], [{"W": "written", "r": "replica", "·": "pad"}[x] for x in mt],
                     int(medges[-1])) if not _text_fits(ms.shape[0], mt) else ()),
                   "gathered row (rank-major)", p))
    flag_note = None
    sd = _g2(_arr(draft, "slot_mapping_draft"))
    if sd is not None:
        v = sd[group] if sd.shape[0] > group else np.zeros(0, np.int64)
        replicated = _is_replicated(draft, target)
        if replicated:
            dreq = np.arange(v.shape[0]) if v.shape[0] == r else np.full(v.shape[0], -1)
            what = (f"{draft_phase or 'draft'} slot_mapping_draft [G={sd.shape[0]}, {v.shape[0]}] "
                    f"replicated: unexpanded, one slot per request (R = {r})")
            if v.shape[0] != r:
                flag_note = (f"⚠ {draft_phase}: replicated draft slot mapping has length {v.shape[0]}, "
                             f"expected unexpanded R = {r}")
            strips.append((what, _slot_strip(v, dreq, None, levels, draft_phase or "draft", "request row"),
                           "request row (global order)", None))
        else:
            m = min(v.shape[0], status.shape[0])
            strips.append((f"{draft_phase or 'draft'} slot_mapping_draft [G={sd.shape[0]}, {v.shape[0]}] rank-local: "
                           f"the target's gathered (expanded N*P) mapping",
                           _slot_strip(v[:m], rreq[:m], status[:m], levels, draft_phase or "draft", "gathered row"),
                           "gathered row (rank-major)", p))
    else:
        strips.append(("draft slot mapping: no draft step recorded", _slot_strip(
            np.zeros(0, np.int64), np.zeros(0, np.int64), None, levels, "draft", "row"), "", None))
    fig = _Canvas([[1]] * len(strips), vertical_spacing=0.62 / len(strips) if len(strips) > 1 else 0.1,
                  subplot_titles=[s[0] for s in strips])
    shapes = fig.shapes
    annots = fig.annotations
    for k, (_, (z, edges, text, hover, show, labels), xtitle, rank_p) in enumerate(strips):
        fig.add(_heat(z, edges, [""], text, hover, show, font_size=9, ygap=0), k + 1, 1)
        fig.axis("y", k + 1, 1, showticklabels=False)
        fig.axis("x", k + 1, 1, title=dict(text=xtitle, standoff=0, font=dict(size=10)),
                 range=[0, int(edges[-1]) if len(edges) > 1 else 1])
        if labels:
            xr, yr = fig.ref(k + 1, 1)
            annots.extend(_run_labels(xr, yr, *labels[:3], 0, labels[3]))
        if xtitle == "request row (global order)" and r and len(edges) == r + 1:
            fig.axis("x", k + 1, 1, tickvals=(np.arange(r) + 0.5).tolist(), ticktext=list(sl.req_ids))
        if rank_p:
            xr, yr = fig.ref(k + 1, 1)
            for q in range(1, n):
                shapes.append(_vline(xr, yr, q * rank_p, color="#333", width=2))
    if flag_note:
        annots.append(dict(text=flag_note, xref="paper", yref="paper", x=1, y=-0.08, xanchor="right",
                           showarrow=False, font=dict(color=FLAG_COLOR, size=13), bgcolor="#fff3f3",
                           bordercolor=FLAG_COLOR))
    return fig.spec(height=130 + 105 * len(strips), margin=dict(l=30, r=20, t=70, b=40),
                      title=dict(text=f"slot mappings (group {group}; PCP={n}, P={p}, T={t}, R={r}; "
                                      "text = slot id)"))


def slot_mappings_figure(target: Rec, draft: Rec | None = None, *, draft_phase: str | None = None,
                         highlight: str | None = None, colors: Mapping[str, int] | None = None,
                         group: int = 0) -> go.Figure:
    """``slot_mappings_spec`` as a ``go.Figure``."""
    return as_figure(slot_mappings_spec(target, draft, draft_phase=draft_phase, highlight=highlight, colors=colors,
                                        group=group))
