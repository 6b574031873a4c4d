"""The token-order view: the global batch against each rank's local rows (lanes), the
gather/restore index maps and the KV write mask of one step's ``target`` record.

A PCP=2 step of the shipped trace (``data/traces/cpu-pcp2-mtp2``, step 0: req0 prefills 23
tokens, req1 25), as the lanes draw it (digit = DualChunkSwap chunk, ``·`` = padding up to
P = 26; chunks of ceil(23/4) = 6 and ceil(25/4) = 7 tokens, rank r takes chunks r and 3-r)::

    global  000000111111222222333330000000111111122222223333     req0 | req1
    rank 0  0000003333300000003333····                            22 real rows
    rank 1  11111122222211111112222222                            26 real rows
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.figures.aggregate import run_lines, run_edges
from pcpviz.views.figures.canvas import (DIM_COLOR, PAD_COLOR, REPLICA_COLOR, TOKEN_LIMIT, WRITTEN_COLOR, Canvas,
                                         L_PAD, L_REPLICA, L_WRITTEN, hline, range_text, req_levels,
                                         strip_heat, strip_labels, vline, as_figure)
from pcpviz.views.figures.lod import PLOT_PX, Lane, RunText, draw_strip
from pcpviz.trace import Record
from pcpviz.views.figures.step_data import StepLayout, single_rank, step_layout

__all__ = ["token_order_spec", "token_order_figure"]


def _lane_rows(sl: StepLayout) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per lane (0 = global, 1+r = rank r) ``(req, chunk, gtok)``, each int64 over the lane's own
    length: T for the global lane, P for a rank (``req`` -1 and the others -1 on padding)."""
    n, p, t = sl.pcp, sl.padded, sl.num_tokens
    out = [(sl.token_req, sl.token_chunk, np.arange(t, dtype=np.int64))]
    g = np.clip(sl.padded_gather_idx.reshape(n, p), 0, max(t - 1, 0))
    real = sl.row_real.reshape(n, p) & (t > 0)
    for k in range(n):
        gk, rk = g[k], real[k]
        out.append((np.where(rk, sl.token_req[gk] if t else -1, -1), np.where(rk, sl.token_chunk[gk] if t else -1, -1),
                    np.where(rk, gk, -1)))
    return out


def _lane_runs(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Run edges of each lane over its own length: where its request or chunk changes or its
    global token index stops continuing by +1."""
    return [run_edges(rq.shape[0], keys=[rq, ck], arith=[gt], arith_valid=[gt >= 0]) for rq, ck, gt in rows]


def _lane(sl: StepLayout, li: int, lane: tuple[np.ndarray, np.ndarray, np.ndarray], e: np.ndarray,
          levels: np.ndarray) -> Lane:
    """Lane ``li`` (0 = global, 1+r = rank r) as runs: colour = request, grey = padding."""
    rq, ck, gt = (a[e[:-1]] for a in lane)
    where = "global token" if li == 0 else f"rank {li - 1} local row"
    level, label, hover = [], [], []
    for a, b, q, c, g in zip(e[:-1].tolist(), (e[1:] - 1).tolist(), rq.tolist(), ck.tolist(), gt.tolist()):
        if q >= 0:
            level.append(levels[q])
            label.append((f"{sl.req_ids[q]} c{c}", f"c{c}"))
            hover.append(f"{sl.req_ids[q]} · chunk {c}<br>{where} {range_text(a, b)}"
                         f"<br>global token {range_text(g, g + b - a)}")
        else:
            level.append(L_PAD)
            label.append(("pad", "·"))
            hover.append(f"padding<br>{where} {range_text(a, b)}")
    chunk = np.where(rq >= 0, ck, -1)
    return Lane(e, np.asarray(level, dtype=float), label, hover,
                RunText.per_run([str(c) if c >= 0 else "·" for c in chunk.tolist()]))


def _mask_lane(status: np.ndarray) -> Lane:
    """The KV write mask over the gathered rows as runs of equal status."""
    e = run_edges(status.shape[0], keys=[status])
    st = status[e[:-1]].tolist()
    names = {2: "written", 1: "replica", 0: "pad"}
    lev = {2: L_WRITTEN, 1: L_REPLICA, 0: L_PAD}
    hover = [f"{_MASK_NAMES[s]}<br>gathered rows {range_text(a, b - 1)}"
             for s, a, b in zip(st, e[:-1].tolist(), e[1:].tolist())]
    return Lane(e, np.array([lev[s] for s in st], dtype=float), [names[s] for s in st], hover,
                RunText.per_run([{2: "W", 1: "r", 0: "·"}[s] for s in st]))


_MASK_NAMES = {2: "written", 1: "masked (extra replica)", 0: "padding"}


def _index_maps(fig: Canvas, sl: StepLayout, highlight: str | None) -> None:
    """The gather map (gathered row -> global token, by row status) and the restore map
    (global token -> gathered row), rows (2, 1) and (2, 2) of the token-order figure."""
    n, p, t = sl.pcp, sl.padded, sl.num_tokens
    shapes = fig.shapes
    (x2r, y2r), (x3r, y3r) = fig.ref(2, 1), fig.ref(2, 2)
    status = sl.row_status()
    rows = np.arange(n * p)
    hl_rows = None
    if highlight is not None and highlight in sl.req_ids:
        hl_rows = sl.row_req() == sl.req_ids.index(highlight)
    names = _MASK_NAMES
    cols = {2: WRITTEN_COLOR, 1: REPLICA_COLOR, 0: PAD_COLOR}
    big = n * p > TOKEN_LIMIT
    gvals = sl.padded_gather_idx

    def points(x: np.ndarray, y: np.ndarray, sel: np.ndarray, lines: bool) -> tuple:
        return run_lines(x, y, sel) if lines else (x[sel], y[sel])

    # The same five scatter traces, with the same properties, at every step (one per row status,
    # the rows of the requests a highlight dims, the restore map): the Workbench then restyles
    # them in place. Long maps are drawn as one line segment per run instead of one marker per row.
    for s in (2, 1, 0):
        sel = status == s if hl_rows is None else (status == s) & hl_rows
        x, y = points(rows, gvals, sel, big)
        fig.add(dict(type="scatter", x=x, y=y, mode="lines" if big else "markers", marker=dict(color=cols[s], size=5),
                     line=dict(color=cols[s], width=3), name=f"gather: {names[s]}", showlegend=True,
                     hovertemplate="gathered row %{x}<br>global token %{y}<extra>" + names[s] + "</extra>"), 2, 1)
    dim = ~hl_rows if hl_rows is not None else np.zeros(n * p, dtype=bool)
    x, y = points(rows, gvals, dim, big)
    fig.add(dict(type="scatter", x=x, y=y, mode="lines" if big else "markers", marker=dict(color=DIM_COLOR, size=5),
                 line=dict(color=DIM_COLOR, width=3), name="gather: other requests", showlegend=False,
                 hovertemplate="gathered row %{x}<br>global token %{y}<extra>other request</extra>"), 2, 1)
    tok = np.arange(t)
    x, y = points(tok, sl.hidden_restore_idx, np.ones(t, dtype=bool), t > TOKEN_LIMIT)
    fig.add(dict(type="scatter", x=x, y=y, mode="lines" if t > TOKEN_LIMIT else "markers",
                 marker=dict(color="#2ca02c", size=5), line=dict(color="#2ca02c", width=3), name="restore",
                 showlegend=True, hovertemplate="global token %{x} ← gathered row %{y}<extra></extra>"), 2, 2)
    for k in range(1, n):
        shapes.append(vline(x2r, y2r, k * p - 0.5, color="#888", dash="dot"))
        shapes.append(hline(x3r, y3r, k * p - 0.5, color="#888", dash="dot"))
    fig.axis("x", 2, 1, title=dict(text="gathered row (rank-major, P per rank)", standoff=2))
    fig.axis("y", 2, 1, title=dict(text="global token"))
    fig.axis("x", 2, 2, title=dict(text="global token", standoff=2))
    fig.axis("y", 2, 2, title=dict(text="gathered row"))


def token_order_spec(target: Record, *, rank: int | None = None, highlight: str | None = None,
                     colors: Mapping[str, int] | None = None, title: str | None = None,
                     windows: Mapping[str, tuple[float, float]] | None = None, px: int = PLOT_PX) -> dict:
    """Lanes (global batch vs each rank's local rows, colour = request, text = chunk, grey =
    padding), the gather/restore index maps and the KV write mask of one step's ``target``.

    ``windows`` maps an x axis (``"xaxis"`` the lanes, ``"xaxis4"`` the write mask) to the range
    shown (None: everything), drawn ``px`` pixels wide at its level of detail (``lod``)."""
    sl = step_layout(target)
    n, p, t = sl.pcp, sl.padded, sl.num_tokens
    rows = _lane_rows(sl)
    width = max(t, p, 1)
    windows = windows or {}
    levels = req_levels(sl.req_ids, colors, highlight)
    lanes = [_lane(sl, li, lane, e, levels) for li, (lane, e) in enumerate(zip(rows, _lane_runs(rows)))]
    drawn = draw_strip(lanes, window=windows.get("xaxis"), px=px)
    labels = ["global"] + [f"rank {k}" + (" ◀" if rank == k else "") for k in range(n)]
    fig = Canvas(
        [[2], [1, 1], [2]], vertical_spacing=0.13, horizontal_spacing=0.08, row_heights=[0.42, 0.42, 0.16],
        subplot_titles=(
            "token order: global batch vs each rank's local rows (colour = request, c = chunk, grey = padding; "
            "zoom in for tokens)",
            "padded_gather_idx: gathered row → global token",
            "hidden_restore_idx: global token → gathered row",
            "KV write mask over the gathered rows (blue written, orange replica not written, grey pad)",
        ),
    )
    fig.add(strip_heat(drawn, labels, name="lanes"), 1, 1)
    xa, ya = fig.ref(1, 1)
    fig.annotations.extend(strip_labels(xa, ya, drawn))
    fig.axis("y", 1, 1, autorange="reversed")
    fig.axis("x", 1, 1, range=list(drawn.window))
    shapes = fig.shapes
    (x1r, y1r), (x4r, y4r) = fig.ref(1, 1), fig.ref(3, 1)
    if rank is not None and 0 <= rank < n:
        shapes.append(dict(type="rect", xref=x1r, yref=y1r, x0=0, x1=width, y0=rank + 0.5, y1=rank + 1.5,
                           line=dict(color="#333", width=2), fillcolor="rgba(0,0,0,0)"))

    _index_maps(fig, sl, highlight)

    # write mask strip
    mask = draw_strip([_mask_lane(sl.row_status())], window=windows.get("xaxis4"), px=px)
    fig.add(strip_heat(mask, ["write"], name="kv_write_mask", ygap=0), 3, 1)
    fig.annotations.extend(strip_labels(x4r, y4r, mask))
    fig.axis("x", 3, 1, range=list(mask.window))
    for k in range(1, n):
        shapes.append(vline(x4r, y4r, k * p, color="#555", width=1))
    return fig.spec(height=560 + 26 * n + (22 if single_rank(target) else 0),
                    margin=dict(l=70, r=20, t=92 if single_rank(target) else 70, b=30),
                    title=_title(sl, single_rank(target)) if title is None else dict(text=title),
                    legend=dict(orientation="h", y=-0.06), showlegend=True)


MAX_TITLE_REQS = 60
"""Longest request list (characters) the title spells out; past it the title counts them (the
lanes' hover texts and the header name each)."""


def _title(sl: StepLayout, pcp1: bool) -> dict:
    """One line that fits the figure (a PCP=1 run's note as a subtitle under it)."""
    reqs = ", ".join(sl.req_ids)
    reqs = reqs if len(reqs) <= MAX_TITLE_REQS else f"{len(sl.req_ids)} (named in the hover texts)"
    out = dict(text=f"step layout: PCP={sl.pcp}, T={sl.num_tokens}, P={sl.padded}, per-rank tokens "
                    f"{_short_list(sl.per_rank_num_tokens.tolist())}, requests {reqs}")
    if pcp1:
        out["subtitle"] = dict(text="a PCP=1 run records no layout: rank 0's rows are the global batch")
    return out


def _short_list(values: list[int], limit: int = 8) -> str:
    """``[a, b, ...]`` of at most ``limit`` values (then ``...``)."""
    return "[" + ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "") + "]"


def token_order_figure(target: Record, *, rank: int | None = None, highlight: str | None = None,
                       colors: Mapping[str, int] | None = None, title: str | None = None,
                       windows: Mapping[str, tuple[float, float]] | None = None) -> go.Figure:
    """``token_order_spec`` as a ``go.Figure``."""
    return as_figure(token_order_spec(target, rank=rank, highlight=highlight, colors=colors, title=title,
                                      windows=windows))
