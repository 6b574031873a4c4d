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
                                         safe_spec, safe_text, strip_heat, strip_labels, vline, as_figure)
from pcpviz.views.figures.lod import PAD_MIN_PX, PLOT_PX, Drawn, Lane, RunText, draw_strip, label_px
from pcpviz.trace import Record
from pcpviz.views.figures.step_data import StepLayout, single_rank, step_layout, view_array

__all__ = ["token_order_spec", "token_order_figure", "token_order_inputs", "token_order_for_rank"]


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
          levels: np.ndarray, positions: np.ndarray | None) -> Lane:
    """Lane ``li`` (0 = global, 1+r = rank r) as runs: colour = request, grey = padding (at least
    ``PAD_MIN_PX`` wide). A token's hover names its lane row, global token and position (the
    ``positions`` view: a run of one request's chunk counts up by one)."""
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
    real = (rq >= 0) & (gt >= 0)
    lines = [] if li == 0 else [(f"rank {li - 1} local row", e[:-1].astype(np.int64))]
    lines.append(("global token", np.where(real, gt, -1)))
    if positions is not None and positions.shape[0] >= sl.num_tokens:
        lines.append(("position", np.where(real, positions[np.clip(gt, 0, max(sl.num_tokens - 1, 0))], -1)))
    return Lane(e, np.asarray(level, dtype=float), label, hover,
                RunText.per_run([str(c) if c >= 0 else "·" for c in chunk.tolist()]),
                token_hover=tuple(lines), min_px=np.where(rq >= 0, 0, PAD_MIN_PX))


def _mask_lane(status: np.ndarray) -> Lane:
    """The KV write mask over the gathered rows as runs of equal status."""
    e = run_edges(status.shape[0], keys=[status])
    st = status[e[:-1]].tolist()
    names = {2: "written", 1: "replica", 0: "pad"}
    lev = {2: L_WRITTEN, 1: L_REPLICA, 0: L_PAD}
    hover = [f"{_MASK_NAMES[s]}<br>gathered rows {range_text(a, b - 1)}"
             for s, a, b in zip(st, e[:-1].tolist(), e[1:].tolist())]
    return Lane(e, np.array([lev[s] for s in st], dtype=float), [names[s] for s in st], hover,
                RunText.per_run([{2: "W", 1: "r", 0: "·"}[s] for s in st]),
                token_hover=(("gathered row", e[:-1].astype(np.int64)),),
                min_px=np.array([PAD_MIN_PX if s == 0 else 0 for s in st], dtype=np.int64))


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
    padding), the gather/restore index maps and the KV write mask of one step's ``target``;
    ``rank``'s lane is marked (``token_order_for_rank``).

    ``windows`` maps an x axis (``"xaxis"`` the lanes, ``"xaxis4"`` the write mask) to the range
    shown (None: everything), drawn ``px`` pixels wide at its level of detail (``lod``)."""
    spec = _unmarked_spec(target, highlight=highlight, colors=colors, title=title, windows=windows, px=px)
    return token_order_for_rank(spec, target, rank)


def token_order_inputs(target: Record) -> tuple:
    """What ``token_order_spec`` reads from ``target``, besides its keyword arguments: the step's
    layout, its ``positions`` and whether it is a PCP=1 record. Equal inputs (``content_key``)
    draw equal figures but for the rank's mark, so the HTML report draws a step once for all its
    ranks. Raises where the figure cannot be drawn."""
    pos = view_array(target, "positions")
    return step_layout(target), None if pos is None else np.asarray(pos, dtype=np.int64).ravel(), single_rank(target)


def token_order_for_rank(spec: dict, target: Record, rank: int | None) -> dict:
    """``spec``, drawn by ``token_order_spec(target, rank=None, ...)``, with ``rank`` marked: its
    lane's label ends in ``◀`` and a frame goes round its lane (the first shape). A new spec that
    shares every other part with ``spec``; ``spec`` itself when ``rank`` is None or not a rank of
    the step. PCP=2, rank 1: the lanes read ``global, rank 0, rank 1 ◀``."""
    sl = step_layout(target)
    n = sl.pcp
    if rank is None or not 0 <= rank < n:
        return spec
    data = list(spec["data"])
    labels = list(data[0]["y"])
    labels[rank + 1] = safe_text(labels[rank + 1] + " ◀")
    data[0] = {**data[0], "y": labels}
    width = max(sl.num_tokens, sl.padded, 1)
    (x1r, y1r) = data[0]["xaxis"], data[0]["yaxis"]
    frame = safe_spec(dict(type="rect", xref=x1r, yref=y1r, x0=0, x1=width, y0=rank + 0.5, y1=rank + 1.5,
                           line=dict(color="#333", width=2), fillcolor="rgba(0,0,0,0)"))
    layout = spec["layout"]
    return {**spec, "data": data, "layout": {**layout, "shapes": [frame, *layout["shapes"]]}}


def _unmarked_spec(target: Record, *, highlight: str | None, colors: Mapping[str, int] | None, title: str | None,
                   windows: Mapping[str, tuple[float, float]] | None, px: int) -> dict:
    """``token_order_spec`` with no rank marked."""
    sl = step_layout(target)
    n, p = sl.pcp, sl.padded
    rows = _lane_rows(sl)
    windows = windows or {}
    levels = req_levels(sl.req_ids, colors, highlight)
    pos = view_array(target, "positions")
    pos = None if pos is None else np.asarray(pos, dtype=np.int64).ravel()
    lanes = [_lane(sl, li, lane, e, levels, pos) for li, (lane, e) in enumerate(zip(rows, _lane_runs(rows)))]
    drawn = draw_strip(lanes, window=windows.get("xaxis"), px=px)
    drawn = _request_labels(drawn, sl, px)
    labels = ["global"] + [f"rank {k}" for k in range(n)]
    fig = Canvas(
        [[2], [1, 1], [2]], vertical_spacing=0.18, horizontal_spacing=0.1, row_heights=[0.4, 0.44, 0.16],
        subplot_titles=(
            "global batch vs each rank's rows (colour = request, c = chunk, grey = PAD)",
            "padded_gather_idx<br>gathered row → global token",
            "hidden_restore_idx<br>global token → gathered row",
            "KV write mask (blue written, orange replica, grey PAD)",
        ),
    )
    fig.add(strip_heat(drawn, labels, name="lanes"), 1, 1)
    xa, ya = fig.ref(1, 1)
    fig.annotations.extend(strip_labels(xa, ya, drawn))
    fig.axis("y", 1, 1, autorange="reversed")
    fig.axis("x", 1, 1, range=list(drawn.window))
    shapes = fig.shapes
    x4r, y4r = fig.ref(3, 1)
    _index_maps(fig, sl, highlight)

    # write mask strip
    mask = draw_strip([_mask_lane(sl.row_status())], window=windows.get("xaxis4"), px=px)
    fig.add(strip_heat(mask, ["write"], name="kv_write_mask", ygap=0), 3, 1)
    fig.annotations.extend(strip_labels(x4r, y4r, mask))
    fig.axis("x", 3, 1, range=list(mask.window))
    for k in range(1, n):
        shapes.append(vline(x4r, y4r, k * p, color="#555", width=1))
    return fig.spec(height=460 + 24 * n + (22 if single_rank(target) else 0),
                    margin=dict(l=70, r=20, t=132 if single_rank(target) else 110, b=30),
                    title=_title(sl, single_rank(target)) if title is None else dict(text=title),
                    legend=dict(orientation="h", y=-0.06), showlegend=True)


def _request_labels(d: Drawn, sl: StepLayout, px: int) -> Drawn:
    """``d`` with each request's name laid over its extent of the global lane where no run label of
    that request was drawn and the name fits (16 requests of a 16k-token step: 64 chunk runs of
    ~13 px, too narrow for ``c0``, but each request's ~54 px shows its name)."""
    if d.text is not None:  # per-token cells: their text is there
        return d
    lo, hi = d.window
    u = (hi - lo) / max(px, 1)
    starts = sl.query_start_loc.astype(np.int64)
    labelled = {int(sl.token_req[min(max(int(x), 0), sl.num_tokens - 1)]) for x, li, _ in d.labels if li == 0} \
        if sl.num_tokens else set()
    extra = []
    for q, name in enumerate(sl.req_ids):
        a, b = max(float(starts[q]), lo), min(float(starts[q + 1]), hi)
        if q in labelled or b <= a or label_px(name) > (b - a) / u:
            continue
        extra.append(((a + b) / 2, 0, name))
    if not extra:
        return d
    return Drawn(d.edges, d.z, d.text, d.hover, d.labels + extra, d.per_token, d.xgap, d.window)


MAX_TITLE_REQS = 60
"""Longest request list (characters) the title spells out; past it the title counts them (the
lanes' hover texts and the header name each)."""


def _title(sl: StepLayout, pcp1: bool) -> dict:
    """Three short lines that fit a one-column figure (a PCP=1 run's note as a subtitle under them)."""
    reqs = ", ".join(sl.req_ids)
    reqs = reqs if len(reqs) <= MAX_TITLE_REQS else f"{len(sl.req_ids)} (named in the hover texts)"
    out = dict(text=f"step layout: PCP={sl.pcp}, T={sl.num_tokens}, P={sl.padded}<br>per-rank tokens "
                    f"{_short_list(sl.per_rank_num_tokens.tolist(), limit=4)}<br>requests {reqs}",
               font=dict(size=13))
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
