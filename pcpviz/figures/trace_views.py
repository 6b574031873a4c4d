"""Plotly figures of one traced engine step, drawn from the recorded views only.

Pure functions: each takes the record mappings ``trace.record(step, rank, phase)``
returns (view name -> NumPy array) and gives back a ``go.Figure``. The ``Workbench``
widget pushes them into ``FigureWidget``s; ``pcpviz.export_html`` serialises them.

* ``token_order_figure``   global batch vs each rank's local rows, gather/restore maps,
                           KV write mask (from ``segments``/``padded_gather_idx``/...)
* ``block_tables_figure``  global rows, the rank's local rows, the draft step's rows;
                           draft rows that are zero or differ from what they should be
                           are outlined in red
* ``slot_mappings_figure`` global ``[G, T]``, gathered ``[G, N*P]`` (PAD shown), the
                           write mask, and the draft step's slot mapping
* ``draft_timeline_figure`` target -> draft_0 (rank-local) -> gather -> draft_1.. (replicated)
                           -> verify, with positions / seq_lens per request and draft step
* ``acceptance_figure``    acceptance per draft position (vLLM's definition), per request,
                           and per step

Large steps are aggregated before plotting. A strip (a lane of tokens, a slot mapping)
with at most ``TOKEN_LIMIT`` entries is drawn one cell per token; a longer one is cut into
*runs* — maximal stretches where the request, the chunk/status and an arithmetic
progression (global token index, slot id) all continue — and each run becomes one cell
of a heatmap with variable-width bricks (``x`` holds the cell edges). A 32k-token prefill
split over 4 ranks is a few dozen runs, not 32k cells. If a strip still has more than
``MAX_CELLS`` runs they are merged (marked "mixed" in the hover). Per-cell text is drawn only
when it fits the cells (at most ``TEXT_LIMIT`` cells); otherwise each run wide enough for a
label gets one annotation. Block-table columns are trimmed to the used width and binned
beyond ``BLOCK_COLUMNS`` columns. So a figure's size is bounded whatever T, N*P or W are, and
the gather/restore maps become one line segment per run instead of one marker per row.

Figures are assembled as plain dicts (``_Canvas``) and wrapped in one ``go.Figure`` without
re-validation: plotly's per-call validation (``make_subplots``, ``add_trace``, ``update_*``)
cost far more than the data. ``validate_figure`` re-validates one, and the tests do so for
every figure of the shipped trace.

A PCP=2 step of the shipped trace (``data/traces/cpu-pcp2-mtp2``, step 0: req0 prefills 23
tokens, req1 25), as the token-order lanes draw it (digit = DualChunkSwap chunk, ``·`` = padding
up to P = 26; chunks of ceil(23/4) = 6 and ceil(25/4) = 7 tokens, rank r takes chunks r and 3-r)::

    global  000000111111222222333330000000111111122222223333     req0 | req1
    rank 0  0000003333300000003333····                            22 real rows
    rank 1  11111122222211111112222222                            26 real rows
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from pcpviz.figures.palette import DIM_COLOR, PAD_COLOR, heat_z, request_color
from pcpviz.acceptance import Acceptance, Counts, acceptance, acceptance_from_records, ratio
from pcpviz.trace.schema import SEGMENT_DTYPE, view_panel

__all__ = [
    "TOKEN_LIMIT", "MAX_CELLS", "TEXT_LIMIT", "BLOCK_COLUMNS",
    "Rec", "StepLayout", "step_layout", "run_edges", "cell_edges",
    "RowFlag", "draft_block_table_flags", "draft_source_phase",
    "AcceptanceStats", "acceptance_stats", "trace_acceptance",
    "token_order_figure", "block_tables_figure", "slot_mappings_figure",
    "draft_timeline_figure", "acceptance_figure", "acceptance_step_marker", "mark_violation",
    "violation_view", "violation_marks", "validate_figure", "load_acceptance", "from_diff_acceptance",
    "load_check_report", "trace_req_ids",
    "request_color_index",
]

TOKEN_LIMIT = 1024
"""Strips up to this many entries are drawn one cell (or marker) per token."""
MAX_CELLS = 512
"""Longer strips are drawn as runs; more runs than this are merged into this many cells."""
TEXT_LIMIT = 130
"""Cell text (chunk index, slot id, block id) only when a strip has at most this many cells."""
_PLOT_PX = 900
"""Nominal plot width (px) used to decide whether cell text fits: per-token cell text is drawn
only when every cell is wide enough for its text (``_text_fits``); otherwise each run of a strip
is labelled once (``_run_labels``) where the run is wide enough."""


def _text_fits(n_cells: int, texts: Iterable[Any]) -> bool:
    longest = max((len(str(t)) for t in texts if t is not None), default=0)
    return n_cells > 0 and _PLOT_PX / n_cells >= 6.5 * longest + 3
BLOCK_COLUMNS = 48
"""Block-table columns are binned into at most this many cells per row."""

Rec = Mapping[str, np.ndarray]
"""One phase's views: ``trace.record(step, rank, phase)``."""

FLAG_COLOR = "#d62728"
WRITTEN_COLOR = "#1f77b4"
REPLICA_COLOR = "#ff7f0e"
NULL_COLOR = "#ffffff"
_KIND_COLORS = {  # timeline cell backgrounds
    "global": "#e3e9f3",
    "rank_local": "#fde0c2",
    "replicated": "#cfe3f6",
    "ok": "#dcefd6",
    "flag": "#f6c3c0",
    "absent": "#f7f7f7",
}

# Heatmap levels: z holds a level; the colorscale is stepped, one colour per level.
_L_PAD, _L_DIM, _L_NULL, _L_FLAG, _L_WRITTEN, _L_REPLICA = 0, 1, 2, 3, 4, 5
_L_REQ0 = 6
_FIXED_LEVEL_COLORS = [PAD_COLOR, DIM_COLOR, NULL_COLOR, "#f6c3c0", WRITTEN_COLOR, REPLICA_COLOR]
_AXIS = {"gridcolor": "#ececec", "linecolor": "#999", "zerolinecolor": "#ddd", "automargin": True}
TEMPLATE = {"layout": {"plot_bgcolor": "#fff", "paper_bgcolor": "#fff", "font": {"size": 11},
                       "xaxis": _AXIS, "yaxis": _AXIS, "hoverlabel": {"align": "left"}}}
"""A small inline template: plotly validates a template on every figure, and the default one is
large enough to dominate the cost of one widget update."""


_NUM_REQ_COLORS = 28


def _stepped_colorscale(colors: Sequence[str]) -> list[list]:
    m = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale.append([i / m, c])
        scale.append([(i + 1) / m, c])
    return scale


_LEVEL_COLORS = _FIXED_LEVEL_COLORS + [request_color(i) for i in range(_NUM_REQ_COLORS)]
_LEVEL_SCALE = _stepped_colorscale(_LEVEL_COLORS)
_LEVEL_RANGE = dict(zmin=-0.5, zmax=len(_LEVEL_COLORS) - 0.5)


def request_color_index(req_ids: Iterable[str]) -> dict[str, int]:
    """Stable colour index per request id, in order of first appearance."""
    out: dict[str, int] = {}
    for r in req_ids:
        out.setdefault(str(r), len(out))
    return out


def _req_levels(req_ids: Sequence[str], colors: Mapping[str, int] | None,
                highlight: str | None) -> np.ndarray:
    """Level of each request row: its colour, or dim when another request is highlighted."""
    out = np.empty(len(req_ids), dtype=np.int64)
    for i, r in enumerate(req_ids):
        c = colors.get(str(r), i) if colors is not None else i
        out[i] = _L_REQ0 + c % _NUM_REQ_COLORS
        if highlight is not None and str(r) != highlight:
            out[i] = _L_DIM
    return out


# --------------------------------------------------------------------------- record helpers

def _arr(rec: Rec | None, name: str, default=None):
    if rec is None or name not in rec:
        return default
    return np.asarray(rec[name])


def _g2(a: np.ndarray | None) -> np.ndarray | None:
    """A slot mapping as [G, n] (1-D arrays are one group)."""
    if a is None:
        return None
    a = np.asarray(a)
    return a[None, :] if a.ndim == 1 else a


def _g3(a: np.ndarray | None) -> np.ndarray | None:
    """A block table as [G, rows, W]."""
    if a is None:
        return None
    a = np.asarray(a)
    return a[None] if a.ndim == 2 else a


def _str0(a) -> str:
    a = np.asarray(a)
    return str(a.item() if a.ndim == 0 else a.ravel()[0]) if a.size else ""


@dataclass(frozen=True)
class StepLayout:
    """The PCP layout of one step, rebuilt from the recorded ``target`` views."""

    req_ids: tuple[str, ...]
    num_scheduled_tokens: np.ndarray  # int64[R]
    query_start_loc: np.ndarray  # int64[R+1]
    pcp: int  # N
    padded: int  # P
    per_rank_num_tokens: np.ndarray  # int64[N]
    padded_gather_idx: np.ndarray  # int64[N*P]
    hidden_restore_idx: np.ndarray  # int64[T]
    kv_write_mask: np.ndarray  # bool[N*P]
    segments: np.ndarray  # SEGMENT_DTYPE[S]
    token_req: np.ndarray  # int64[T]: global row of each global token
    token_chunk: np.ndarray  # int64[T]: DualChunkSwap chunk of each global token (0 if whole)
    row_real: np.ndarray  # bool[N*P]: gathered row holds a token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1]) if self.query_start_loc.size else 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def row_req(self) -> np.ndarray:
        """int64[N*P]: global request row of each gathered row, -1 on padding."""
        t = self.num_tokens
        g = np.clip(self.padded_gather_idx, 0, max(t - 1, 0))
        return np.where(self.row_real & (t > 0), self.token_req[g] if t else -1, -1)

    def row_status(self) -> np.ndarray:
        """int8[N*P]: 2 written, 1 real but masked to PAD (an extra replica), 0 padding."""
        return np.where(self.kv_write_mask, 2, np.where(self.row_real, 1, 0)).astype(np.int8)


def step_layout(target: Rec) -> StepLayout:
    """``StepLayout`` of a ``target`` record (needs the global-batch and layout views)."""
    req_ids = tuple(str(x) for x in np.asarray(target["req_ids"]).ravel())
    q = np.asarray(target["num_scheduled_tokens"], dtype=np.int64)
    qsl = _arr(target, "query_start_loc")
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int64) if qsl is None else qsl.astype(np.int64)
    per_rank = np.asarray(target["per_rank_num_tokens"], dtype=np.int64)
    n = int(per_rank.shape[0])
    gather = np.asarray(target["padded_gather_idx"], dtype=np.int64)
    p = gather.shape[0] // max(n, 1)
    mask = np.asarray(target["kv_write_mask"], dtype=bool)
    restore = np.asarray(target["hidden_restore_idx"], dtype=np.int64)
    segs = target.get("segments")
    segs = np.zeros(0, dtype=SEGMENT_DTYPE) if segs is None else np.asarray(segs)
    t = int(qsl[-1]) if qsl.size else 0
    token_req = np.repeat(np.arange(q.shape[0]), q) if t else np.zeros(0, np.int64)
    # A request is "whole" (decode-like: sharded to one rank or replicated) when one segment
    # covers its whole query; otherwise DualChunkSwap cut it into 2N chunks of ceil(q/2N).
    whole = np.zeros(q.shape[0], dtype=bool)
    if not segs.size and "is_prefilling" in target:  # no segments recorded: decodes are whole
        whole = ~np.asarray(target["is_prefilling"], dtype=bool)[: q.shape[0]]
    if segs.size:
        gi = segs["global_req_idx"].astype(np.int64)
        ok = (gi >= 0) & (gi < q.shape[0])
        cover = (segs["global_start"][ok] == qsl[gi[ok]]) & (segs["global_stop"][ok] == qsl[gi[ok] + 1])
        whole[gi[ok][cover]] = True
    chunk_size = np.maximum(-(-q // max(2 * n, 1)), 1)
    if t:
        offset = np.arange(t) - qsl[token_req]
        token_chunk = np.where(whole[token_req], 0, offset // chunk_size[token_req])
    else:
        token_chunk = np.zeros(0, np.int64)
    local = np.arange(p)
    row_real = (local[None, :] < per_rank[:, None]).ravel()
    return StepLayout(req_ids, q, qsl, n, p, per_rank, gather, restore, mask, segs,
                      token_req, token_chunk.astype(np.int64), row_real)


# --------------------------------------------------------------------------- aggregation

def run_edges(n: int, keys: Sequence[np.ndarray] = (), arith: Sequence[np.ndarray] = (),
              arith_valid: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """int64[m+1]: edges of the maximal runs of ``n`` entries.

    A run breaks where any array of ``keys`` changes value (arrays may be [n] or [L, n],
    lanes broken together), or where an array of ``arith`` does not continue by +1 (only
    between two entries that are both valid in ``arith_valid``).
    """
    if n <= 0:
        return np.zeros(1, dtype=np.int64)
    brk = np.zeros(n, dtype=bool)
    brk[0] = True
    for k in keys:
        k = np.asarray(k)
        d = k[..., 1:] != k[..., :-1]
        brk[1:] |= d.any(axis=0) if d.ndim > 1 else d
    for i, a in enumerate(arith):
        a = np.asarray(a)
        d = (a[..., 1:] - a[..., :-1]) != 1
        if arith_valid is not None:
            v = np.asarray(arith_valid[i])
            d &= v[..., 1:] & v[..., :-1]
        brk[1:] |= d.any(axis=0) if d.ndim > 1 else d
    return np.append(np.flatnonzero(brk), n).astype(np.int64)


def cell_edges(n: int, keys: Sequence[np.ndarray] = (), arith: Sequence[np.ndarray] = (),
               arith_valid: Sequence[np.ndarray] | None = None, *, token_limit: int = TOKEN_LIMIT,
               max_cells: int = MAX_CELLS) -> tuple[np.ndarray, np.ndarray]:
    """``(edges, runs_per_cell)``: one cell per entry up to ``token_limit`` entries, else
    runs (``run_edges``), merged down to ``max_cells`` cells if there are more."""
    if n <= token_limit:
        return np.arange(n + 1, dtype=np.int64), np.ones(n, dtype=np.int64)
    e = run_edges(n, keys, arith, arith_valid)
    m = e.shape[0] - 1
    if m <= max_cells:
        return e, np.ones(m, dtype=np.int64)
    pick = np.unique(np.round(np.linspace(0, m, max_cells + 1)).astype(np.int64))
    return e[pick], np.diff(pick)


class _Canvas:
    """A figure under construction as plain dicts (a subplot grid like ``make_subplots``).

    Building figures with ``make_subplots`` / ``add_trace(row=, col=)`` / ``update_xaxes`` runs
    plotly's validators on every call, which costs far more than the data. Here traces and
    axes are dicts; ``figure()`` makes one ``go.Figure`` without re-validating (``_validate=False``;
    the tests validate every figure once with ``validate_figure``).

    ``specs`` is a list of rows, each a list of column spans (``[[2], [1, 1]]``: a full-width
    row, then two halves); axis pairs are numbered row-major like ``make_subplots``.
    """

    def __init__(self, specs: Sequence[Sequence[int]], *, row_heights: Sequence[float] | None = None,
                 vertical_spacing: float = 0.1, horizontal_spacing: float = 0.08,
                 subplot_titles: Sequence[str] = (), shared_x: bool = False,
                 column_widths: Sequence[float] | None = None) -> None:
        nrows = len(specs)
        ncols = max(sum(r) for r in specs)
        heights = np.asarray(row_heights if row_heights is not None else [1.0] * nrows, dtype=float)
        avail = 1.0 - vertical_spacing * (nrows - 1)
        heights = heights / heights.sum() * avail
        widths = np.asarray(column_widths if column_widths is not None else [1.0] * ncols, dtype=float)
        widths = widths / widths.sum() * (1.0 - horizontal_spacing * (ncols - 1))
        self.layout: dict[str, Any] = {"template": TEMPLATE}
        self.data: list[dict] = []
        self.shapes: list[dict] = []
        self.annotations: list[dict] = []
        self.cells: dict[tuple[int, int], tuple[str, str]] = {}
        top = 1.0
        k = 0
        titles = list(subplot_titles)
        for r, spans in enumerate(specs):
            y1 = top
            y0 = max(top - heights[r], 0.0)
            top = y0 - vertical_spacing
            col = 0
            for c, span in enumerate(spans):
                x0 = float(widths[:col].sum() + horizontal_spacing * col)
                x1 = float(widths[:col + span].sum() + horizontal_spacing * (col + span - 1))
                col += span
                k += 1
                sx = "" if k == 1 else str(k)
                xa, ya = f"x{sx}", f"y{sx}"
                self.cells[(r + 1, c + 1)] = (xa, ya)
                self.layout[f"xaxis{sx}"] = {"domain": [x0, min(x1, 1.0)], "anchor": ya}
                self.layout[f"yaxis{sx}"] = {"domain": [y0, y1], "anchor": xa}
                if shared_x and k > 1:
                    self.layout[f"xaxis{sx}"]["matches"] = "x"
                if k <= len(titles) and titles[k - 1]:
                    self.annotations.append(dict(text=titles[k - 1], x=(x0 + x1) / 2, y=y1, xref="paper",
                                                 yref="paper", xanchor="center", yanchor="bottom",
                                                 showarrow=False, font={"size": 12}))

    def ref(self, row: int = 1, col: int = 1) -> tuple[str, str]:
        return self.cells[(row, col)]

    def add(self, trace: dict, row: int = 1, col: int = 1) -> None:
        xa, ya = self.ref(row, col)
        self.data.append({**trace, "xaxis": xa, "yaxis": ya})

    def axis(self, which: str, row: int = 1, col: int = 1, **props) -> None:
        xa, ya = self.ref(row, col)
        name = xa if which == "x" else ya
        self.layout[f"{which}axis{name[1:]}"].update(props)

    def figure(self, **layout) -> go.Figure:
        lay = {"autosize": True, **self.layout, **layout, "shapes": self.shapes, "annotations": self.annotations}
        return go.Figure({"data": self.data, "layout": lay}, _validate=False)


def validate_figure(fig: go.Figure) -> go.Figure:
    """``fig`` rebuilt with plotly's validators on (raises ValueError on an invalid property)."""
    return go.Figure(fig.to_plotly_json())


def _vline(xref: str, yref: str, x: float, **line) -> dict:
    return dict(type="line", xref=xref, yref=f"{yref} domain", x0=x, x1=x, y0=0, y1=1, line=line)


def _hline(xref: str, yref: str, y: float, **line) -> dict:
    return dict(type="line", xref=f"{xref} domain", yref=yref, x0=0, x1=1, y0=y, y1=y, line=line)


def _range_text(a: int, b: int) -> str:
    return f"{a}" if a == b else f"{a}–{b}"


def _run_labels(xref: str, yref: str, starts: np.ndarray, stops: np.ndarray, texts: Sequence[str], y: float,
                total: int, max_labels: int = 80, color: str = "#222") -> list[dict]:
    """Annotations labelling runs ``[starts, stops)`` on a strip of ``total`` entries, one per run
    that is wide enough for its text (at ``_PLOT_PX`` px for the whole strip)."""
    out: list[dict] = []
    if total <= 0:
        return out
    px = _PLOT_PX / total
    for a, b, t in zip(starts, stops, texts):
        if t and (b - a) * px >= 6.5 * len(t) + 4:
            out.append(dict(x=(a + b) / 2, y=y, xref=xref, yref=yref, text=t, showarrow=False,
                            font=dict(size=10, color=color)))
            if len(out) >= max_labels:
                break
    return out


# --------------------------------------------------------------------------- token order

def _lanes(sl: StepLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(req, chunk, gtok)`` each int64[N+1, width]: lane 0 = global, lane 1+r = rank r.
    ``req`` -1 = padding, -2 = beyond the lane."""
    n, p, t = sl.pcp, sl.padded, sl.num_tokens
    width = max(t, p, 1)
    req = np.full((n + 1, width), -2, dtype=np.int64)
    chunk = np.full((n + 1, width), -1, dtype=np.int64)
    gtok = np.full((n + 1, width), -1, dtype=np.int64)
    req[0, :t] = sl.token_req
    chunk[0, :t] = sl.token_chunk
    gtok[0, :t] = np.arange(t)
    if p and t:
        g = np.clip(sl.padded_gather_idx.reshape(n, p), 0, t - 1)
        real = sl.row_real.reshape(n, p)
        req[1:, :p] = np.where(real, sl.token_req[g], -1)
        chunk[1:, :p] = np.where(real, sl.token_chunk[g], -1)
        gtok[1:, :p] = np.where(real, g, -1)
    elif p:
        req[1:, :p] = -1
    return req, chunk, gtok


def _heat(z, edges, labels, text=None, hover=None, show_text=True, name="", font_size=10,
          xgap=1, ygap=3) -> dict:
    """A level heatmap trace (dict). ``text`` and ``texttemplate`` are always present (empty
    when hidden) so consecutive figures of a view keep the same properties and update in place."""
    show = text is not None and show_text
    return dict(
        type="heatmap", z=heat_z(z), x=edges, y=labels, colorscale=_LEVEL_SCALE, showscale=False, xgap=xgap, ygap=ygap,
        hovertext=hover if hover is not None else [], hoverinfo="text" if hover is not None else "skip",
        name=name, text=text if show else [], texttemplate="%{text}" if show else "",
        textfont=dict(size=font_size), **_LEVEL_RANGE,
    )


def token_order_figure(target: Rec, *, rank: int | None = None, highlight: str | None = None,
                       colors: Mapping[str, int] | None = None, title: str | None = None) -> go.Figure:
    """Lanes (global batch vs each rank's local rows, colour = request, text = chunk, grey =
    padding), the gather/restore index maps and the KV write mask of one step's ``target``."""
    sl = step_layout(target)
    n, p, t, r = sl.pcp, sl.padded, sl.num_tokens, sl.num_reqs
    req, chunk, gtok = _lanes(sl)
    width = req.shape[1]
    edges, merged = cell_edges(width, keys=[req, chunk], arith=[gtok], arith_valid=[gtok >= 0])
    starts, stops = edges[:-1], edges[1:]
    creq, cchunk, cg = req[:, starts], chunk[:, starts], gtok[:, starts]
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
        for li in range(req.shape[0]):
            e = run_edges(width, keys=[req[li], chunk[li]], arith=[gtok[li]], arith_valid=[gtok[li] >= 0])
            a, b = e[:-1], e[1:]
            rq, ck = req[li, a], chunk[li, a]
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
    for s in (2, 1, 0):
        sel = status == s
        if hl_rows is not None:
            sel_dim = sel & ~hl_rows
            sel = sel & hl_rows
        if big:
            x, y = _run_lines(rows, gvals, sel)
            fig.add(dict(type="scatter", x=x, y=y, mode="lines", line=dict(color=cols[s], width=3),
                         name=f"gather: {names[s]}", hoverinfo="x+y"), 2, 1)
        else:
            fig.add(dict(type="scatter", x=rows[sel], y=gvals[sel], mode="markers", marker=dict(color=cols[s], size=5),
                         name=f"gather: {names[s]}",
                         hovertemplate="gathered row %{x}<br>global token %{y}<extra>" + names[s] + "</extra>"), 2, 1)
        if hl_rows is not None and sel_dim.any():
            x, y = (_run_lines(rows, gvals, sel_dim) if big else (rows[sel_dim], gvals[sel_dim]))
            fig.add(dict(type="scatter", x=x, y=y, mode="lines" if big else "markers",
                         marker=dict(color=DIM_COLOR, size=5), line=dict(color=DIM_COLOR, width=3),
                         showlegend=False, hoverinfo="skip"), 2, 1)
    tok = np.arange(t)
    if t > TOKEN_LIMIT:
        x, y = _run_lines(tok, sl.hidden_restore_idx, np.ones(t, dtype=bool))
        fig.add(dict(type="scatter", x=x, y=y, mode="lines", line=dict(color="#2ca02c", width=3), name="restore"),
                2, 2)
    else:
        fig.add(dict(type="scatter", x=tok, y=sl.hidden_restore_idx, mode="markers",
                     marker=dict(color="#2ca02c", size=5), name="restore",
                     hovertemplate="global token %{x} ← gathered row %{y}<extra></extra>"), 2, 2)
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
    return fig.figure(
        height=560 + 26 * n, margin=dict(l=70, r=20, t=70, b=30),
        title=dict(text=title or (f"step layout: PCP={n}, T={t}, P={p}, per-rank tokens "
                                  f"{sl.per_rank_num_tokens.tolist()}, requests {', '.join(sl.req_ids)}")),
        legend=dict(orientation="h", y=-0.06), showlegend=True,
    )


def _run_lines(x: np.ndarray, y: np.ndarray, sel: np.ndarray) -> tuple[list, list]:
    """Polyline of the runs of ``y`` (continuing by +1) over the selected entries, None-separated."""
    idx = np.flatnonzero(sel)
    if idx.size == 0:
        return [], []
    xs, ys = x[idx], y[idx]
    brk = np.flatnonzero((np.diff(xs) != 1) | (np.diff(ys) != 1)) + 1
    starts = np.concatenate([[0], brk])
    stops = np.concatenate([brk, [idx.size]]) - 1
    ox: list = []
    oy: list = []
    for a, b in zip(starts, stops):
        ox += [int(xs[a]), int(xs[b]), None]
        oy += [int(ys[a]), int(ys[b]), None]
    return ox, oy


# --------------------------------------------------------------------------- block tables

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


def draft_source_phase(phases: Iterable[str], selected: str | None) -> str | None:
    """The draft phase the draft panels show: the selected one if it is a draft step, else
    draft_1 (the first replicated one, where the gather matters), else draft_0."""
    phases = list(phases)
    if selected is not None and selected.startswith("draft_") and selected in phases:
        return selected
    for cand in ("draft_1", "draft_0"):
        if cand in phases:
            return cand
    drafts = [p for p in phases if p.startswith("draft_")]
    return drafts[0] if drafts else None


def _is_replicated(draft: Rec, target: Rec | None) -> bool:
    v = _arr(draft, "view")
    if v is not None:
        return _str0(v) == "replicated"
    bt = _g3(_arr(draft, "block_table_draft"))
    return target is not None and bt is not None and bt.shape[1] == len(np.asarray(target["req_ids"]))


def _pad_cols(a: np.ndarray, w: int) -> np.ndarray:
    if a.shape[-1] >= w:
        return a[..., :w]
    pad = [(0, 0)] * (a.ndim - 1) + [(0, w - a.shape[-1])]
    return np.pad(a, pad)


def draft_block_table_flags(target: Rec, draft: Rec | None, group: int = 0) -> list[RowFlag]:
    """Rows of ``block_table_draft`` that are zero or stale.

    A replicated draft decode must use the request's *global* row (``block_table_global``,
    same row order as the global batch); the rank-local ``draft_0`` must use the target's
    local rows (``block_table_local``). Rows are compared over the wider of the two widths.
    """
    if draft is None or "block_table_draft" not in draft:
        return []
    bt = _g3(draft["block_table_draft"])[group]
    replicated = _is_replicated(draft, target)
    ref_name = "block_table_global" if replicated else "block_table_local"
    if ref_name not in target:
        return []
    ref = _g3(target[ref_name])[group]
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


def _block_bins(w: int) -> np.ndarray:
    if w <= BLOCK_COLUMNS:
        return np.arange(w + 1)
    return np.unique(np.round(np.linspace(0, w, BLOCK_COLUMNS + 1)).astype(np.int64))


def _used_width(*tables: np.ndarray | None) -> int:
    w = 1
    for t in tables:
        if t is None or t.size == 0:
            continue
        nz = np.flatnonzero(t.reshape(-1, t.shape[-1]).any(axis=0))
        if nz.size:
            w = max(w, int(nz[-1]) + 1)
    return w


def _block_heat(table: np.ndarray, row_ids: Sequence[str], row_labels: Sequence[str], bins: np.ndarray,
                colors, highlight) -> dict:
    rows, w = table.shape[0], bins[-1]
    table = _pad_cols(table, int(w))
    starts, stops = bins[:-1], bins[1:]
    levels = _req_levels(list(row_ids), colors, highlight)
    z = np.full((rows, starts.shape[0]), np.nan)
    text = np.empty((rows, starts.shape[0]), dtype=object)
    hover = np.empty((rows, starts.shape[0]), dtype=object)
    for i in range(rows):
        for j, (a, b) in enumerate(zip(starts, stops)):
            cells = table[i, a:b]
            nz = cells[cells != 0]
            if nz.size == 0:
                z[i, j] = _L_NULL
                text[i, j] = "0" if b - a == 1 else "·"
            else:
                z[i, j] = levels[i]
                text[i, j] = str(int(cells[0])) if b - a == 1 else _range_text(int(nz[0]), int(nz[-1]))
            cols = f"column {a}" if b - a == 1 else f"columns {a}–{b - 1}"
            shown = cells.tolist() if b - a <= 8 else f"{cells[:4].tolist()} … {cells[-2:].tolist()}"
            hover[i, j] = f"{row_labels[i]}<br>{cols}: {shown}"
    show = rows * starts.shape[0] <= 8 * TEXT_LIMIT and _text_fits(starts.shape[0], text.ravel())
    return _heat(z, bins, list(row_labels), text, hover, show, font_size=9 if w > 16 else 10, ygap=2)


def block_tables_figure(target: Rec, draft: Rec | None = None, *, draft_phase: str | None = None,
                        rank: int | None = None, highlight: str | None = None,
                        colors: Mapping[str, int] | None = None, group: int = 0,
                        flags: list[RowFlag] | None = None) -> go.Figure:
    """Three heatmaps (text = block id, white = null block 0): ``block_table_global`` (one row
    per request, global order), this rank's ``block_table_local`` (one row per local segment)
    and the draft step's ``block_table_draft``. Draft rows that are zero or differ from the
    rows they should equal (``draft_block_table_flags``) are outlined in red."""
    glob = _g3(_arr(target, "block_table_global"))
    loc = _g3(_arr(target, "block_table_local"))
    dr = _g3(_arr(draft, "block_table_draft"))
    req_ids = [str(x) for x in np.asarray(target["req_ids"]).ravel()]
    local_ids = [str(x) for x in np.asarray(_arr(target, "local_req_ids", np.array([], dtype=str))).ravel()]
    tabs = [x[group] if x is not None and x.shape[0] > group else None for x in (glob, loc, dr)]
    w = _used_width(*tabs)
    bins = _block_bins(w)
    replicated = draft is not None and _is_replicated(draft, target)
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
    fig = _Canvas([[1]] * len(panels), shared_x=True, vertical_spacing=0.09, row_heights=heights,
                  subplot_titles=[p[0] for p in panels])
    for k, (_, table, ids, labels) in enumerate(panels):
        fig.add(_block_heat(table, ids, labels, bins, colors, highlight), k + 1, 1)
        fig.axis("y", k + 1, 1, autorange="reversed")
        fig.axis("x", k + 1, 1, range=[0, int(bins[-1])], showticklabels=k == len(panels) - 1)
    shapes = fig.shapes
    annots = fig.annotations
    if tabs[2] is not None and flags:
        xr, yr = fig.ref(len(panels), 1)
        for f in flags:
            shapes.append(dict(type="rect", xref=xr, yref=yr, x0=0, x1=int(bins[-1]), y0=f.row - 0.5,
                               y1=f.row + 0.5, line=dict(color=FLAG_COLOR, width=3),
                               fillcolor="rgba(214,39,40,0.08)"))
        kinds = sorted({f.kind for f in flags})
        msg = (f"⚠ {len(flags)} of {tabs[2].shape[0]} draft rows "
               + " / ".join("all-zero (gather skipped?)" if k == "zero" else "≠ global row" if replicated
                            else "≠ local row" for k in kinds))
        annots.append(dict(text=msg, xref="paper", yref=f"{yr} domain", x=1, y=1, xanchor="right",
                           yanchor="bottom", yshift=16, showarrow=False, font=dict(color=FLAG_COLOR, size=12),
                           bgcolor="#fff3f3", bordercolor=FLAG_COLOR))
    col_title = "block-table column" if bins.shape[0] - 1 == w else \
        f"block-table columns, binned ({w} used columns → {bins.shape[0] - 1} cells; text = first–last block id)"
    ticks = (dict(tickvals=(np.arange(w) + 0.5).tolist(), ticktext=[str(i) for i in range(w)])
             if bins.shape[0] - 1 == w else dict(tickvals=None, ticktext=None))
    fig.axis("x", len(panels), 1, title=dict(text=col_title), **{k: v for k, v in ticks.items() if v is not None})
    total_rows = sum(t.shape[0] for _, t, _, _ in panels)
    return fig.figure(height=int(200 + 24 * total_rows + 40 * len(panels)), margin=dict(l=90, r=20, t=60, b=60),
                      title=dict(text=f"block tables (group {group}; W = {w} used columns)"))


# --------------------------------------------------------------------------- slot mappings

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


def slot_mappings_figure(target: Rec, draft: Rec | None = None, *, draft_phase: str | None = None,
                         highlight: str | None = None, colors: Mapping[str, int] | None = None,
                         group: int = 0) -> go.Figure:
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
    return fig.figure(height=130 + 105 * len(strips), margin=dict(l=30, r=20, t=70, b=40),
                      title=dict(text=f"slot mappings (group {group}; PCP={n}, P={p}, T={t}, R={r}; "
                                      "text = slot id)"))


# --------------------------------------------------------------------------- draft timeline

def draft_timeline_figure(phases: Mapping[str, Rec], *, step: int | None = None, rank: int | None = None,
                          selected_phase: str | None = None, highlight: str | None = None,
                          group: int = 0) -> go.Figure:
    """One step as columns target → draft_0 → gather → draft_1 … → verify, one row per request
    (global order). A cell says what the phase fed that request: positions and seq_lens
    (draft_0: this rank's local rows only), the proposed token, the verify outcome. Orange =
    rank-local, blue = replicated, grey = global batch; the gather column is green where the
    draft rows equal the global rows and red where they are zero/stale."""
    from pcpviz.trace.schema import phase_sort_key  # noqa: PLC0415 (cheap, avoids a cycle)

    order = sorted((ph for ph in phases if ph != "dummy"), key=phase_sort_key)
    target = phases.get("target")
    verify = phases.get("verify")
    base = target if target is not None else verify
    req_ids = [str(x) for x in np.asarray(base["req_ids"]).ravel()] if base is not None and "req_ids" in base else []
    r = len(req_ids)
    drafts = [ph for ph in order if ph.startswith("draft_")]
    has_replicated = any(_is_replicated(phases[ph], target) for ph in drafts)
    cols: list[str] = []
    for ph in order:
        if ph.startswith("draft_") and has_replicated and "gather" not in cols and _is_replicated(phases[ph], target):
            cols.append("gather")
        cols.append(ph)
    kinds = np.full((max(r, 1), len(cols)), "absent", dtype=object)
    text = np.full((max(r, 1), len(cols)), "", dtype=object)
    hover = np.full((max(r, 1), len(cols)), "", dtype=object)
    ticks = []
    sl = step_layout(target) if target is not None and "per_rank_num_tokens" in target else None
    first_replicated = next((ph for ph in drafts if _is_replicated(phases[ph], target)), None)
    gather_flags = draft_block_table_flags(target, phases[first_replicated], group) \
        if first_replicated is not None and target is not None else []
    flagged_rows = {f.row: f for f in gather_flags}
    for c, ph in enumerate(cols):
        if ph == "target" and target is not None and sl is not None:
            pos = np.asarray(target["positions"])
            sq = _arr(target, "seq_lens")
            for i in range(r):
                a, b = int(sl.query_start_loc[i]), int(sl.query_start_loc[i + 1])
                if b > a:
                    kinds[i, c] = "global"
                    text[i, c] = f"pos {_range_text(int(pos[a]), int(pos[b - 1]))}" + \
                        (f"<br>len {int(sq[i])}" if sq is not None else "")
                    hover[i, c] = (f"{req_ids[i]} target (global batch): {b - a} tokens, positions "
                                   f"{_range_text(int(pos[a]), int(pos[b - 1]))}")
            ticks.append(f"<b>target</b><br>global T={sl.num_tokens}<br>→ P={sl.padded} rows/rank")
        elif ph == "gather":
            for i in range(r):
                f = flagged_rows.get(i)
                kinds[i, c] = "flag" if f else "ok"
                text[i, c] = ("✗ zero row" if f.kind == "zero" else "✗ stale row") if f else "✓ global row"
                hover[i, c] = (f.describe() + f"<br>expected {f.expected[:8].tolist()}<br>actual {f.actual[:8].tolist()}"
                               if f else f"{req_ids[i]}: {first_replicated} uses its global block-table row")
            ticks.append("<b>gather</b><br>block tables<br>→ global order")
        elif ph == "verify" and verify is not None:
            acc = _arr(verify, "num_accepted")
            nd = _arr(verify, "num_draft_tokens")
            ns = _arr(verify, "num_sampled")
            vids = [str(x) for x in np.asarray(verify["req_ids"]).ravel()] if "req_ids" in verify else req_ids
            for j, rid in enumerate(vids):
                if rid not in req_ids:
                    continue
                i = req_ids.index(rid)
                kinds[i, c] = "global"
                parts = []
                if acc is not None and nd is not None:
                    parts.append(f"acc {int(acc[j])}/{int(nd[j])}")
                if ns is not None:
                    parts.append(f"{int(ns[j])} sampled")
                text[i, c] = "<br>".join(parts)
                hover[i, c] = f"{rid} verify: " + ", ".join(parts)
            ticks.append("<b>verify</b> · global<br>accepted / drafted<br>(the previous step's drafts)")
        elif ph.startswith("draft_"):
            d = phases[ph]
            dpos = _arr(d, "draft_positions", np.zeros(0, np.int64))
            dsl = _arr(d, "draft_seq_lens", np.zeros(0, np.int64))
            dtok = _arr(d, "draft_tokens")
            sm = _g2(_arr(d, "slot_mapping_draft"))
            sm_shape = f"[{sm.shape[0]}, {sm.shape[1]}]" if sm is not None else "?"
            if _is_replicated(d, target):
                for i in range(min(r, dpos.shape[0])):
                    kinds[i, c] = "replicated"
                    s = f"pos {int(dpos[i])}"
                    if i < dsl.shape[0]:
                        s += f"<br>len {int(dsl[i])}"
                    if dtok is not None and i < dtok.shape[0]:
                        s += f"<br>→ tok {int(dtok[i])}"
                    text[i, c] = s
                    hover[i, c] = f"{req_ids[i]} {ph} (replicated): " + s.replace("<br>", ", ")
                    if ph == first_replicated and i in flagged_rows:
                        kinds[i, c] = "flag"
                ticks.append(f"<b>{ph}</b> · replicated<br>{dpos.shape[0]} rows (R)<br>slots {sm_shape} unexpanded")
            else:
                # rank-local: this rank's segments, in local-row order
                lids = [str(x) for x in np.asarray(_arr(target, "local_req_ids", np.array([], dtype=str))).ravel()]
                lqsl = _arr(target, "local_query_start_loc")
                for i, rid in enumerate(req_ids):
                    segs = [k for k, x in enumerate(lids) if x == rid]
                    if not segs or lqsl is None:
                        text[i, c] = f"— (not on rank {rank})" if rank is not None else "—"
                        hover[i, c] = f"{rid} has no rows on this rank in {ph}"
                        continue
                    kinds[i, c] = "rank_local"
                    ranges = []
                    for k in segs:
                        a, b = int(lqsl[k]), int(lqsl[k + 1])
                        if b > a and b <= dpos.shape[0]:
                            ranges.append(_range_text(int(dpos[a]), int(dpos[b - 1])))
                    lens = [int(dsl[k]) for k in segs if k < dsl.shape[0]]
                    text[i, c] = "pos " + ", ".join(ranges) + ("<br>len " + ", ".join(map(str, lens)) if lens else "")
                    hover[i, c] = f"{rid} {ph} (rank-local, rank {rank}): positions {', '.join(ranges)}, seq_lens {lens}"
                ticks.append(f"<b>{ph}</b> · rank-local<br>{dpos.shape[0]} local rows<br>slots {sm_shape} expanded")
        else:
            ticks.append(f"<b>{ph}</b>")
    level_of = {k: i for i, k in enumerate(_KIND_COLORS)}
    colors = list(_KIND_COLORS.values()) + [DIM_COLOR]
    z = np.vectorize(lambda k: level_of[k])(kinds).astype(float) if kinds.size else np.zeros((1, 1))
    if highlight is not None and highlight in req_ids:
        dim = np.array([rid != highlight for rid in req_ids])
        z[dim, :] = len(_KIND_COLORS)
    ylabels = req_ids or [""]
    fig = _Canvas([[1]])
    fig.add(dict(
        type="heatmap", z=z, x=list(range(len(cols))), y=ylabels, text=text, texttemplate="%{text}",
        textfont=dict(size=10), hovertext=hover, hoverinfo="text", colorscale=_stepped_colorscale(colors),
        zmin=-0.5, zmax=len(colors) - 0.5, showscale=False, xgap=3, ygap=3,
    ))
    fig.axis("y", autorange="reversed")
    fig.axis("x", tickvals=list(range(len(cols))), ticktext=ticks, side="top", range=[-0.5, len(cols) - 0.5])
    shapes = fig.shapes
    annots = fig.annotations
    if "gather" in cols:
        g = cols.index("gather")
        shapes.append(_vline("x", "y", g - 0.5, color="#7b3fa0", width=3, dash="dash"))
        annots.append(dict(x=g - 0.5, y=0, xref="x", yref="paper", yanchor="top", xanchor="center",
                           showarrow=False, yshift=-4, text="▲ view switch: rank-local → replicated "
                           "(block tables gathered back to global order)", font=dict(color="#7b3fa0", size=11)))
    if selected_phase in cols:
        s = cols.index(selected_phase)
        shapes.append(dict(type="rect", xref="x", yref="y", x0=s - 0.5, x1=s + 0.5, y0=-0.5, y1=max(r, 1) - 0.5,
                           line=dict(color="#111", width=3)))
    if highlight is not None and highlight in req_ids:
        i = req_ids.index(highlight)
        shapes.append(dict(type="rect", xref="x", yref="y", x0=-0.5, x1=len(cols) - 0.5, y0=i - 0.5, y1=i + 0.5,
                           line=dict(color="#111", width=2, dash="dot")))
    where = ", ".join(x for x in (f"step {step}" if step is not None else "",
                                  f"rank {rank}" if rank is not None else "") if x)
    return fig.figure(
        title=dict(text=f"draft-step timeline ({where}): orange rank-local, blue replicated, grey global",
                   y=0.99, yanchor="top"),
        height=200 + 58 * max(r, 1), margin=dict(l=70, r=20, t=120, b=40),
    )


# --------------------------------------------------------------------------- acceptance

@dataclass(frozen=True)
class AcceptanceStats:
    """A run's acceptance as the figure draws it: ``pcpviz.acceptance.Acceptance`` (vLLM's
    definitions, NaN when nothing was drafted) as arrays per position, request and step."""

    num_speculative_tokens: int
    num_drafts: int
    accepted_per_pos: np.ndarray  # int64[K]
    req_ids: tuple[str, ...]
    req_num_drafts: np.ndarray  # int64[R]: request-steps with drafts
    req_draft_tokens: np.ndarray  # int64[R]
    req_accepted: np.ndarray  # int64[R]
    steps: np.ndarray  # int64[S]
    step_draft_tokens: np.ndarray  # int64[S]
    step_accepted: np.ndarray  # int64[S]
    source: str = "pcpviz.acceptance"
    rank: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def counts(self) -> Counts:
        return Counts(self.num_drafts, int(self.req_draft_tokens.sum()), int(self.req_accepted.sum()),
                      tuple(int(x) for x in self.accepted_per_pos))

    @property
    def rate_per_pos(self) -> np.ndarray:
        return np.array(self.counts.rate_per_position, dtype=float)

    @property
    def acceptance_rate(self) -> float:
        return self.counts.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.counts.mean_acceptance_length

    @property
    def req_rate(self) -> np.ndarray:
        return np.array([ratio(int(a), int(d)) for a, d in zip(self.req_accepted, self.req_draft_tokens)],
                        dtype=float)


def acceptance_stats(verify_records: Iterable[tuple[int, Rec]], num_speculative_tokens: int) -> AcceptanceStats:
    """``AcceptanceStats`` from ``(step, verify record)`` pairs."""
    return from_diff_acceptance(acceptance_from_records(verify_records, k=int(num_speculative_tokens)))


def trace_acceptance(trace: Any, rank: int | None = None) -> AcceptanceStats:
    """Acceptance of a whole trace from one rank's ``verify`` phases (default: the first rank)."""
    return from_diff_acceptance(acceptance(trace, rank=rank))


def load_acceptance(trace: Any) -> AcceptanceStats:
    """Acceptance of ``trace`` (``pcpviz.acceptance.acceptance``, the first rank's verify)."""
    return trace_acceptance(trace)


def from_diff_acceptance(acc: Acceptance) -> AcceptanceStats:
    """``pcpviz.acceptance.Acceptance`` as the ``AcceptanceStats`` the figures draw."""
    reqs = list(acc.per_request.values())
    steps = list(acc.per_step)
    i64 = lambda xs: np.array(list(xs), dtype=np.int64)  # noqa: E731
    return AcceptanceStats(
        num_speculative_tokens=int(acc.num_speculative_tokens),
        num_drafts=int(acc.num_drafts),
        accepted_per_pos=i64(acc.accepted_per_position),
        req_ids=tuple(r.req_id for r in reqs),
        req_num_drafts=i64(r.num_drafts for r in reqs),
        req_draft_tokens=i64(r.num_draft_tokens for r in reqs),
        req_accepted=i64(r.num_accepted_tokens for r in reqs),
        steps=i64(st.step for st in steps),
        step_draft_tokens=i64(st.num_draft_tokens for st in steps),
        step_accepted=i64(st.num_accepted_tokens for st in steps),
        rank=acc.rank if acc.rank is not None else 0,
    )


def load_check_report(trace: Any) -> Any | None:
    """``pcpviz.checks.run_checks(trace)`` (imported on first use: the figures alone do not need it)."""
    from pcpviz.checks import run_checks  # noqa: PLC0415

    return run_checks(trace)


def trace_req_ids(trace: Any) -> list[str]:
    """Every request id of the trace, in order of first appearance (first rank)."""
    out: dict[str, None] = {}
    rank = trace.ranks[0]
    for s in trace.rank_steps(rank):
        for ph in ("target", "verify"):
            if trace.has(s, rank, ph):
                rec = trace.record(s, rank, ph)
                if "req_ids" in rec:
                    for r in np.asarray(rec["req_ids"]).ravel():
                        out.setdefault(str(r), None)
                break
    return list(out)


def acceptance_step_marker(step: int | None) -> list[dict]:
    """Layout shapes marking ``step`` on the per-step acceptance panel (x3/y3)."""
    if step is None:
        return []
    return [dict(type="rect", xref="x3", yref="y3 domain", x0=step - 0.5, x1=step + 0.5, y0=0, y1=1,
                 fillcolor="rgba(0,0,0,0.10)", line=dict(color="#111", width=1.5), name="current step")]


def _gaps(x: np.ndarray) -> list:
    return [None if np.isnan(v) else float(v) for v in np.asarray(x, dtype=float)]


def _num(x: float, digits: int) -> str:
    return "-" if np.isnan(x) else f"{x:.{digits}f}"


def acceptance_figure(stats: AcceptanceStats, *, step: int | None = None, highlight: str | None = None,
                      colors: Mapping[str, int] | None = None) -> go.Figure:
    """Acceptance rate per draft position (text = accepted / drafts), per request (accepted /
    drafted tokens) and accepted tokens per step (the current step shaded)."""
    k = stats.num_speculative_tokens
    fig = _Canvas([[1, 1, 1]], column_widths=[0.26, 0.32, 0.42], horizontal_spacing=0.07,
                  subplot_titles=(f"rate per draft position ({stats.num_drafts} drafts)",
                                  "per request (accepted / drafted tokens)",
                                  "per step: drafted vs accepted tokens"))
    rates = _gaps(stats.rate_per_pos)  # NaN (nothing drafted) is a gap, and JSON-safe
    fig.add(dict(type="bar", x=[f"pos {j}" for j in range(k)], y=rates, marker=dict(color="#1f77b4"),
                 text=[f"{a}/{stats.num_drafts}" for a in stats.accepted_per_pos], textposition="outside",
                 hovertemplate="%{x}: rate %{y:.3f}<extra></extra>", name="rate per position", showlegend=False),
            1, 1)
    fig.axis("y", 1, 1, range=[0, 1.15], title=dict(text="acceptance rate"))
    cidx = colors or request_color_index(stats.req_ids)
    rc = [request_color(cidx.get(r, i)) if highlight in (None, r) else DIM_COLOR for i, r in enumerate(stats.req_ids)]
    fig.add(dict(type="bar", x=list(stats.req_ids), y=_gaps(stats.req_rate),
                 marker=dict(color=rc, line=dict(color=["#111" if r == highlight else "rgba(0,0,0,0)"
                                                        for r in stats.req_ids], width=2)),
                 text=[f"{a}/{d}" for a, d in zip(stats.req_accepted, stats.req_draft_tokens)],
                 textposition="outside", showlegend=False, name="per request",
                 hovertemplate="%{x}: %{y:.3f}<extra></extra>"), 1, 2)
    fig.axis("y", 1, 2, range=[0, 1.15])
    fig.add(dict(type="bar", x=stats.steps, y=stats.step_draft_tokens, name="drafted",
                 marker=dict(color="#c7c7c7")), 1, 3)
    fig.add(dict(type="bar", x=stats.steps, y=stats.step_accepted, name="accepted",
                 marker=dict(color="#2ca02c")), 1, 3)
    fig.axis("x", 1, 3, title=dict(text="step"))
    fig.shapes.extend(acceptance_step_marker(step))
    return fig.figure(
        barmode="overlay", bargap=0.15, height=330, margin=dict(l=60, r=20, t=80, b=40),
        title=dict(text=f"acceptance: mean length {_num(stats.mean_acceptance_length, 2)}, "
                        f"rate {_num(stats.acceptance_rate, 3)} (rank {stats.rank}'s verify)",
                   font=dict(size=13)),
        legend=dict(orientation="h", x=1, xanchor="right", y=1.22), showlegend=True,
    )


def violation_view(view: str | None, phase: str | None = None) -> str:
    """The figure (``token_order``, ``timeline``, ``block_tables``, ``slot_mappings``) a violated
    trace view is drawn on: its ``panel`` in the schema."""
    return view_panel(view, phase)


def violation_marks(violations: Iterable[Any], view: str, step: int, rank: int,
                    draft_phase: str | None) -> list[str]:
    """Banner texts for the ``pcpviz.checks`` violations located on ``view`` at (step, rank); a
    violation of a draft phase's view is marked on the block-table/slot panels only while they
    show that draft phase."""
    out = []
    for v in violations:
        if v.step != step or (v.rank is not None and v.rank != rank) or violation_view(v.view, v.phase) != view:
            continue
        if view in ("block_tables", "slot_mappings") and v.phase and v.phase.startswith("draft_") \
                and v.phase != draft_phase:
            continue
        out.append(f"{v.check}: {v.message} ({v.where()})")
    return out


def mark_violation(fig: go.Figure, text: str) -> go.Figure:
    """Add a red banner to ``fig`` (a check's violation located on this view)."""
    ann = dict(text="✗ " + text, xref="paper", yref="paper", x=0, y=1, xanchor="left", yanchor="bottom",
               yshift=28, showarrow=False, align="left", font=dict(color="#fff", size=12), bgcolor=FLAG_COLOR)
    fig.layout.annotations = tuple(fig.layout.annotations) + (ann,)
    return fig
