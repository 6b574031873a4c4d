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

from pcpviz.views.figures.aggregate import _run_lines, cell_edges, merge_runs, run_edges
from pcpviz.views.figures.canvas import (DIM_COLOR, PAD_COLOR, REPLICA_COLOR, TEXT_LIMIT, TOKEN_LIMIT, WRITTEN_COLOR,
                                   _Canvas, _L_PAD, _L_REPLICA, _L_WRITTEN, _heat, _hline, _range_text,
                                   _req_levels, _run_labels, _text_fits, _vline, as_figure)
from pcpviz.views.figures.step_data import Rec, StepLayout, step_layout

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


def _lanes(sl: StepLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(req, chunk, gtok)`` each int64[N+1, width]: lane 0 = global, lane 1+r = rank r.
    ``req`` -1 = padding, -2 = beyond the lane."""
    rows = _lane_rows(sl)
    width = max(sl.num_tokens, sl.padded, 1)
    req = np.full((len(rows), width), -2, dtype=np.int64)
    chunk = np.full((len(rows), width), -1, dtype=np.int64)
    gtok = np.full((len(rows), width), -1, dtype=np.int64)
    for li, (rq, ck, gt) in enumerate(rows):
        req[li, :rq.shape[0]], chunk[li, :ck.shape[0]], gtok[li, :gt.shape[0]] = rq, ck, gt
    return req, chunk, gtok


def _lane_runs(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], width: int) -> list[np.ndarray]:
    """Run edges of each lane over ``[0, width)``: where its request or chunk changes or its global
    token index stops continuing by +1, and where the lane ends (the rest of the strip is one
    more, empty run)."""
    out = []
    for rq, ck, gt in rows:
        e = run_edges(rq.shape[0], keys=[rq, ck], arith=[gt], arith_valid=[gt >= 0])
        out.append(np.append(e, width) if rq.shape[0] < width else e)
    return out


def _at(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], pos: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(req, chunk, gtok)`` int64[lanes, len(pos)] at the strip positions ``pos`` (-2, -1, -1
    beyond a lane's end)."""
    out = [np.empty((len(rows), pos.shape[0]), dtype=np.int64) for _ in range(3)]
    for li, lane in enumerate(rows):
        inside = pos < lane[0].shape[0]
        at = np.minimum(pos, max(lane[0].shape[0] - 1, 0))
        for arr, a, beyond in zip(out, lane, (-2, -1, -1)):
            arr[li] = np.where(inside, a[at], beyond) if a.shape[0] else beyond
    return tuple(out)


def token_order_spec(target: Rec, *, rank: int | None = None, highlight: str | None = None,
                     colors: Mapping[str, int] | None = None, title: str | None = None) -> dict:
    """Lanes (global batch vs each rank's local rows, colour = request, text = chunk, grey =
    padding), the gather/restore index maps and the KV write mask of one step's ``target``."""
    sl = step_layout(target)
    n, p, t, r = sl.pcp, sl.padded, sl.num_tokens, sl.num_reqs
    rows = _lane_rows(sl)
    width = max(t, p, 1)
    # Runs are found lane by lane, over each lane's own length (T, or P per rank), and a strip
    # cell ends wherever any lane's run ends: the same cells as runs over all lanes at once.
    lane_runs = _lane_runs(rows, width) if width > TOKEN_LIMIT else None
    if lane_runs is None:
        edges, merged = np.arange(width + 1, dtype=np.int64), np.ones(width, dtype=np.int64)
    else:
        edges, merged = merge_runs(np.unique(np.concatenate(lane_runs)))
    starts, stops = edges[:-1], edges[1:]
    creq, cchunk, cg = _at(rows, starts)
    levels = _req_levels(sl.req_ids, colors, highlight)
    z = np.where(creq >= 0, levels[np.clip(creq, 0, max(r - 1, 0))] if r else _L_PAD,
                 np.where(creq == -1, _L_PAD, np.nan)).astype(float)
    labels = ["global"] + [f"rank {k}" + (" ◀" if rank == k else "") for k in range(n)]
    ncell = starts.shape[0]
    per_token = bool(np.all(stops - starts == 1))
    text = np.where(creq >= 0, cchunk.astype(str), np.where(creq == -1, "·", ""))
    if not per_token:
        text = np.where(creq >= 0, np.char.add("c", cchunk.astype(str)), np.where(creq == -1, "pad", ""))
    hover = np.empty(creq.shape, dtype=object)
    for li in range(creq.shape[0]):
        for j in range(ncell):
            a, b = int(starts[j]), int(stops[j]) - 1
            rq = creq[li, j]
            where = "global token" if li == 0 else f"rank {li - 1} local row"
            if rq >= 0:
                g0 = int(cg[li, j])
                s = (f"{sl.req_ids[rq]} · chunk {cchunk[li, j]}<br>{where} {_range_text(a, b)}"
                     f"<br>global token {_range_text(g0, g0 + b - a)}")
                if merged[j] > 1:
                    s += f"<br>(mixed: {merged[j]} runs merged)"
                hover[li, j] = s
            elif rq == -1:
                hover[li, j] = f"padding<br>{where} {_range_text(a, b)}"
            else:
                hover[li, j] = ""
    fig = _Canvas(
        [[2], [1, 1], [2]], vertical_spacing=0.13, horizontal_spacing=0.08, row_heights=[0.42, 0.42, 0.16],
        subplot_titles=(
            "token order: global batch vs each rank's local rows (colour = request, text = chunk, grey = padding)"
            if per_token else
            f"token order, aggregated into {ncell} runs (colour = request, c = chunk, grey = padding)",
            "padded_gather_idx: gathered row → global token",
            "hidden_restore_idx: global token → gathered row",
            "KV write mask over the gathered rows (blue written, orange replica not written, grey pad)",
        ),
    )
    cell_text = per_token and ncell <= TEXT_LIMIT and _text_fits(ncell, text.ravel())
    fig.add(_heat(z, edges, labels, text, hover, cell_text, "lanes"), 1, 1)
    if not cell_text:  # label each run of each lane once: request and chunk
        xa, ya = fig.ref(1, 1)
        for li, e in enumerate(lane_runs if lane_runs is not None else _lane_runs(rows, width)):
            a, b = e[:-1], e[1:]
            rq, ck = _at([rows[li]], a)[:2]
            rq, ck = rq[0], ck[0]
            texts = [f"{sl.req_ids[q]} c{c}" if q >= 0 else ("pad" if q == -1 else "") for q, c in zip(rq, ck)]
            short = [f"c{c}" if q >= 0 else ("·" if q == -1 else "") for q, c in zip(rq, ck)]
            lab = _run_labels(xa, ya, a, b, texts, li, width)
            if len(lab) < len([t for t in texts if t]):
                lab = _run_labels(xa, ya, a, b, short, li, width)
            fig.annotations.extend(lab)
    fig.axis("y", 1, 1, autorange="reversed")
    fig.axis("x", 1, 1, range=[0, width])
    shapes = fig.shapes
    (x1r, y1r), (x2r, y2r), (x3r, y3r), (x4r, y4r) = fig.ref(1, 1), fig.ref(2, 1), fig.ref(2, 2), fig.ref(3, 1)
    if rank is not None and 0 <= rank < n:
        shapes.append(dict(type="rect", xref=x1r, yref=y1r, x0=0, x1=width, y0=rank + 0.5, y1=rank + 1.5,
                           line=dict(color="#333", width=2), fillcolor="rgba(0,0,0,0)"))

    # gather / restore maps
    status = sl.row_status()
    rows = np.arange(n * p)
    hl_rows = None
    if highlight is not None and highlight in sl.req_ids:
        hi = sl.req_ids.index(highlight)
        rr = sl.row_req()
        hl_rows = rr == hi
    names = {2: "written", 1: "masked (extra replica)", 0: "padding"}
    cols = {2: WRITTEN_COLOR, 1: REPLICA_COLOR, 0: PAD_COLOR}
    big = n * p > TOKEN_LIMIT
    gvals = sl.padded_gather_idx

    def points(x: np.ndarray, y: np.ndarray, sel: np.ndarray, lines: bool) -> tuple:
        return _run_lines(x, y, sel) if lines else (x[sel], y[sel])

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
        shapes.append(_vline(x2r, y2r, k * p - 0.5, color="#888", dash="dot"))
        shapes.append(_hline(x3r, y3r, k * p - 0.5, color="#888", dash="dot"))
    fig.axis("x", 2, 1, title=dict(text="gathered row (rank-major, P per rank)", standoff=2))
    fig.axis("y", 2, 1, title=dict(text="global token"))
    fig.axis("x", 2, 2, title=dict(text="global token", standoff=2))
    fig.axis("y", 2, 2, title=dict(text="gathered row"))

    # write mask strip
    medges, mmerged = cell_edges(n * p, keys=[status])
    ms = medges[:-1]
    mz = np.array([{2: _L_WRITTEN, 1: _L_REPLICA, 0: _L_PAD}[int(v)] for v in status[ms]], dtype=float)[None, :]
    mhover = np.array([[f"{names[int(status[a])]}<br>gathered rows {_range_text(int(a), int(b) - 1)}"
                        for a, b in zip(ms, medges[1:])]], dtype=object)
    fig.add(_heat(mz, medges, ["write"], hover=mhover, name="kv_write_mask", ygap=0), 3, 1)
    for k in range(1, n):
        shapes.append(_vline(x4r, y4r, k * p, color="#555", width=1))
    return fig.spec(
        height=560 + 26 * n, margin=dict(l=70, r=20, t=70, b=30),
        title=dict(text=title or (f"step layout: PCP={n}, T={t}, P={p}, per-rank tokens "
                                  f"{sl.per_rank_num_tokens.tolist()}, requests {', '.join(sl.req_ids)}")),
        legend=dict(orientation="h", y=-0.06), showlegend=True,
    )


def token_order_figure(target: Rec, *, rank: int | None = None, highlight: str | None = None,
                       colors: Mapping[str, int] | None = None, title: str | None = None) -> go.Figure:
    """``token_order_spec`` as a ``go.Figure``."""
    return as_figure(token_order_spec(target, rank=rank, highlight=highlight, colors=colors, title=title))
