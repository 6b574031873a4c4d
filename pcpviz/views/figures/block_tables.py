"""The block-table view: global rows, the rank's local rows and the draft step's rows, with
the draft rows that are zero or differ from what they should be (``draft_block_table_flags``)
outlined in red. Columns are trimmed to the used width and drawn at a level of detail (``lod``): runs of
consecutive block ids, single blocks when zoomed in.

PCP=2 example: in ``cpu-pcp2-mtp2`` the replicated ``draft_1`` of a step must use each
request's global row (``block_table_global``); a run with ``skip_draft_block_table_gather``
leaves those rows zero and every used row is flagged ``zero``. The rank-local ``draft_0``
is compared with the target's ``block_table_local`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.figures.aggregate import run_edges
from pcpviz.views.figures.canvas import (FLAG_COLOR, Canvas, L_NULL, range_text, req_levels, strip_heat,
                                         strip_labels, as_figure, request_color_index)
from pcpviz.views.figures.lod import FONT_PX, PLOT_PX, Lane, RunText, draw_strip
from pcpviz.views.figures.parts import SharedParts, add_part, drawn_part
from pcpviz.trace import Record
from pcpviz.trace.shapes import table_groups
from pcpviz.views.figures.step_data import is_replicated, view_array

__all__ = ["RowFlag", "draft_block_table_flags", "block_tables_spec", "block_tables_figure"]


@dataclass(frozen=True)
class RowFlag:
    """A draft block-table row that is not what the draft step should have used."""

    row: int  # row in block_table_draft
    req_id: str
    kind: str  # "zero" (all-null row) or "stale" (differs from the expected row)
    expected: np.ndarray  # int32[W]: the row it should be (global row, or local row for draft_0)
    actual: np.ndarray  # int32[W]

    def describe(self) -> str:
        what = "all-zero row (null block): block-table gather skipped?" if self.kind == "zero" \
            else "differs from the global row"
        return f"draft row {self.row} ({self.req_id}): {what}"



def _pad_cols(a: np.ndarray, w: int) -> np.ndarray:
    if a.shape[-1] >= w:
        return a[..., :w]
    pad = [(0, 0)] * (a.ndim - 1) + [(0, w - a.shape[-1])]
    return np.pad(a, pad)


def draft_block_table_flags(target: Record, draft: Record | None, group: int = 0) -> list[RowFlag]:
    """Rows of ``block_table_draft`` that are zero or stale.

    A replicated draft decode must use the request's *global* row (``block_table_global``,
    same row order as the global batch); the rank-local ``draft_0`` must use the target's
    local rows (``block_table_local``). Rows are compared over the wider of the two widths.
    """
    if draft is None or "block_table_draft" not in draft:
        return []
    bt = table_groups(draft["block_table_draft"])[group]
    replicated = is_replicated(draft, target)
    ref_name = "block_table_global" if replicated else "block_table_local"
    if ref_name not in target:
        return []
    ref = table_groups(target[ref_name])[group]
    ids = [str(x) for x in np.asarray(target["req_ids" if replicated else "local_req_ids"]).ravel()] \
        if ("req_ids" if replicated else "local_req_ids") in target else [str(i) for i in range(ref.shape[0])]
    w = max(bt.shape[1], ref.shape[1])
    bt, ref = _pad_cols(bt, w), _pad_cols(ref, w)
    out = []
    for i in range(bt.shape[0]):
        exp = ref[i] if i < ref.shape[0] else np.zeros(w, dtype=bt.dtype)
        if np.array_equal(bt[i], exp):
            continue
        kind = "zero" if not bt[i].any() and exp.any() else "stale"
        out.append(RowFlag(i, ids[i] if i < len(ids) else f"row {i}", kind, exp.copy(), bt[i].copy()))
    return out


def _used_width(*tables: np.ndarray | None) -> int:
    w = 1
    for t in tables:
        if t is None or t.size == 0:
            continue
        nz = np.flatnonzero(t.reshape(-1, t.shape[-1]).any(axis=0))
        if nz.size:
            w = max(w, int(nz[-1]) + 1)
    return w


def _block_lane(row: np.ndarray, level: float, row_label: str) -> Lane:
    """One block-table row (int[W]) as runs of consecutive block ids (a run of null blocks 0 is
    white): text = block id per column, ``first–last`` per run."""
    w = row.shape[0]
    null = row == 0
    e = run_edges(w, keys=[null], arith=[row], arith_valid=[~null])
    a, b = e[:-1], e[1:]
    first, last = row[a], row[np.maximum(b - 1, 0)]
    lev, lab, hov = [], [], []
    for x, y, u, v in zip(a.tolist(), b.tolist(), first.tolist(), last.tolist()):
        cols = f"column {x}" if y - x == 1 else f"columns {x}–{y - 1}"
        if u == 0:
            lev.append(L_NULL)
            lab.append(("null", "0") if y - x > 1 else "0")
            hov.append(f"{row_label}<br>{cols}: null block 0")
        else:
            lev.append(level)
            lab.append((range_text(u, v), f"{u}…") if v != u else str(u))
            hov.append(f"{row_label}<br>{cols}: blocks {range_text(u, v)}")
    # a run of consecutive block ids counts up from its first; a null run reads 0 on every column
    return Lane(e, np.asarray(lev, dtype=float), lab, hov,
                RunText(["0" if u == 0 else "" for u in first.tolist()], first.astype(np.int64), first != 0))


def _block_heat(table: np.ndarray, row_ids: Sequence[str], row_labels: Sequence[str], w: int,
                colors, highlight, window, px: int):
    """The heatmap (and run labels) of one panel over its first ``w`` columns."""
    table = _pad_cols(table, int(w))
    levels = req_levels(list(row_ids), colors, highlight)
    lanes = [_block_lane(table[i], float(levels[i]), row_labels[i]) for i in range(table.shape[0])]
    if not lanes:
        lanes = [Lane(np.array([0, w]), np.array([np.nan]), [""], [""])]
    fs = FONT_PX
    return draw_strip(lanes, window=window, px=px, font_size=fs), fs


def _panel_part(table: np.ndarray, ids: Sequence[str], labels: Sequence[str], w: int, *, colors, highlight,
                window, px: int, refs: tuple[str, str], parts: SharedParts | None) -> tuple:
    """``(drawn, heatmap trace, its label annotations)`` of one panel on axes ``refs``; with
    ``parts``, drawn once per what it is drawn from (``drawn_part``; PCP=64: a step's global rows
    on every rank's page)."""
    def draw() -> tuple:
        d, fs = _block_heat(table, ids, labels, w, colors, highlight, window, px)
        return d, strip_heat(d, labels or [""], font_size=fs, ygap=2), strip_labels(*refs, d, font_size=fs)

    return drawn_part(parts, ("block_tables", table, list(ids), list(labels), int(w), colors, highlight, window, px,
                              refs), draw)


def block_tables_spec(target: Record, draft: Record | None = None, *, draft_phase: str | None = None,
                      rank: int | None = None, highlight: str | None = None,
                      colors: Mapping[str, int] | None = None, group: int = 0,
                      flags: list[RowFlag] | None = None, windows: Mapping[str, tuple[float, float]] | None = None,
                      px: int = PLOT_PX, parts: SharedParts | None = None) -> dict:
    """Three heatmaps (text = block id, white = null block 0): ``block_table_global`` (one row
    per request, global order), this rank's ``block_table_local`` (one row per local segment)
    and the draft step's ``block_table_draft``. Draft rows that are zero or differ from the
    rows they should equal (``draft_block_table_flags``) are outlined in red. ``parts``: the
    heatmaps drawn for other figures (the HTML report's pages), each drawn once (``_panel_part``)."""
    glob = table_groups(view_array(target, "block_table_global"))
    loc = table_groups(view_array(target, "block_table_local"))
    dr = table_groups(view_array(draft, "block_table_draft"))
    req_ids = [str(x) for x in np.asarray(target["req_ids"]).ravel()]
    local_ids = [str(x) for x in np.asarray(view_array(target, "local_req_ids", np.array([], dtype=str))).ravel()]
    tabs = [x[group] if x is not None and x.shape[0] > group else None for x in (glob, loc, dr)]
    if colors is None:  # colour = request (a local row gets its request's colour), as in the Workbench
        colors = request_color_index(req_ids + local_ids)
    w = _used_width(*tabs)
    window = (windows or {}).get("xaxis")
    replicated = draft is not None and is_replicated(draft, target)
    if flags is None:
        flags = draft_block_table_flags(target, draft, group)
    panels = []
    if tabs[0] is not None:
        panels.append(("global rows (block_table_global)", tabs[0], req_ids,
                       [f"g{i} {r}" for i, r in enumerate(req_ids)]))
    if tabs[1] is not None:
        panels.append((f"rank {rank if rank is not None else '?'} local rows (block_table_local)", tabs[1], local_ids,
                       [f"l{i} {r}" for i, r in enumerate(local_ids)]))
    if tabs[2] is not None:
        ids = req_ids if replicated else local_ids
        kind = "replicated: must equal the global rows" if replicated else "rank-local: must equal the local rows"
        panels.append((f"{draft_phase or 'draft'} rows (block_table_draft, {kind})", tabs[2], ids,
                       [f"d{i} {ids[i] if i < len(ids) else '?'}" for i in range(tabs[2].shape[0])]))
    # Always three panels (a stable figure structure updates in place); missing ones are empty.
    for title in ("global rows: not recorded", "local rows: not recorded", "draft rows: no draft step recorded"):
        if len(panels) >= 3:
            break
        panels.append((title, np.zeros((0, 1), dtype=np.int32), [], []))
    heights = [max(t.shape[0], 1) + 1.5 for _, t, _, _ in panels]
    total_rows = sum(t.shape[0] for _, t, _, _ in panels)
    height = int(170 + 20 * total_rows + 40 * len(panels))
    fig = Canvas([[1]] * len(panels), shared_x=True, vertical_spacing=min(75 / height, 0.2), row_heights=heights,
                  subplot_titles=[p[0] for p in panels])
    for k, (_, table, ids, labels) in enumerate(panels):
        part = _panel_part(table, ids, labels, w, colors=colors, highlight=highlight, window=window, px=px,
                           refs=fig.ref(k + 1, 1), parts=parts)
        d = add_part(fig, part, (k + 1, 1), parts=parts)
        fig.axis("y", k + 1, 1, autorange="reversed")
        fig.axis("x", k + 1, 1, range=list(d.window), showticklabels=True)
    shapes = fig.shapes
    annots = fig.annotations
    if tabs[2] is not None and flags:
        xr, yr = fig.ref(len(panels), 1)
        for f in flags:
            shapes.append(dict(type="rect", xref=xr, yref=yr, x0=0, x1=w, y0=f.row - 0.5,
                               y1=f.row + 0.5, line=dict(color=FLAG_COLOR, width=3),
                               fillcolor="rgba(214,39,40,0.08)"))
        kinds = sorted({f.kind for f in flags})
        msg = (f"⚠ {len(flags)} of {tabs[2].shape[0]} draft rows "
               + " / ".join("all-zero (gather skipped?)" if k == "zero" else "≠ global row" if replicated
                            else "≠ local row" for k in kinds))
        annots.append(dict(text=msg, xref="paper", yref=f"{yr} domain", x=1, y=1, xanchor="right",
                           yanchor="bottom", yshift=16, showarrow=False, font=dict(color=FLAG_COLOR, size=12),
                           bgcolor="#fff3f3", bordercolor=FLAG_COLOR))
    col_title = f"block-table column ({w} used; zoom in for one per column)"
    fig.axis("x", len(panels), 1, title=dict(text=col_title))
    return fig.spec(height=height, margin=dict(l=90, r=20, t=60, b=60),
                      title=dict(text=f"block tables (group {group}; W = {w} used columns)"))


def block_tables_figure(target: Record, draft: Record | None = None, *, draft_phase: str | None = None,
                        rank: int | None = None, highlight: str | None = None,
                        colors: Mapping[str, int] | None = None, group: int = 0,
                        flags: list[RowFlag] | None = None,
                        windows: Mapping[str, tuple[float, float]] | None = None) -> go.Figure:
    """``block_tables_spec`` as a ``go.Figure``."""
    return as_figure(block_tables_spec(target, draft, draft_phase=draft_phase, rank=rank, highlight=highlight,
                                       colors=colors, group=group, flags=flags, windows=windows))
