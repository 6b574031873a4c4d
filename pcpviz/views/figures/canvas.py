"""Drawing helpers shared by the trace-view figures: size limits, the level colours of the
heatmaps, a tiny template, and ``Canvas``, a subplot grid assembled as plain dicts.

Figures are assembled as plain dicts (``Canvas``) and wrapped in one ``go.Figure`` without
re-validation: plotly's per-call validation (``make_subplots``, ``add_trace``, ``update_*``)
cost far more than the data. ``validate_figure`` re-validates one, and the tests do so for
every figure of the shipped trace.

Heatmap cells hold a *level* (``L_PAD`` grey padding, ``L_DIM`` a dimmed request, ``L_NULL``
the null block, ``L_WRITTEN`` / ``L_REPLICA`` the write mask, ``_L_REQ0 + i`` request colour
i); one stepped colorscale maps every level to its colour, so a PCP=2 step whose requests are
req0 and req1 draws req0's tokens at level 6 and req1's at level 7.
"""

from __future__ import annotations

import html
import re
from typing import Any, Container, Iterable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from pcpviz.views.figures.lod import FONT_PX, Drawn
from pcpviz.views.figures.palette import DIM_COLOR, PAD_COLOR, heat_z, request_color, text_color

__all__ = ["TOKEN_LIMIT", "TEMPLATE", "FLAG_COLOR",
           "WRITTEN_COLOR", "REPLICA_COLOR", "NULL_COLOR", "DIM_COLOR", "PAD_COLOR",
           "request_color_index", "validate_figure", "as_figure", "safe_text", "safe_spec", "shorten"]

TOKEN_LIMIT = 1024
"""Index maps (gather / restore) up to this many entries are drawn one marker per entry, longer
ones as one line segment per run."""

FLAG_COLOR = "#d62728"
WRITTEN_COLOR = "#1f77b4"
REPLICA_COLOR = "#ff7f0e"
NULL_COLOR = "#ffffff"

# Heatmap levels: z holds a level; the colorscale is stepped, one colour per level.
L_PAD, L_DIM, L_NULL, L_FLAG, L_WRITTEN, L_REPLICA = 0, 1, 2, 3, 4, 5
_L_REQ0 = 6
_FIXED_LEVEL_COLORS = [PAD_COLOR, DIM_COLOR, NULL_COLOR, "#f6c3c0", WRITTEN_COLOR, REPLICA_COLOR]
_AXIS = {"gridcolor": "#ececec", "linecolor": "#999", "zerolinecolor": "#ddd", "automargin": True}
TEMPLATE = {"layout": {"plot_bgcolor": "#fff", "paper_bgcolor": "#fff", "font": {"size": 11},
                       "xaxis": _AXIS, "yaxis": _AXIS, "hoverlabel": {"align": "left"}}}
"""A small inline template: plotly validates a template on every figure, and the default one is
large enough to dominate the cost of one widget update."""


_NUM_REQ_COLORS = 28


def stepped_colorscale(colors: Sequence[str]) -> list[list]:
    m = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale.append([i / m, c])
        scale.append([(i + 1) / m, c])
    return scale


_LEVEL_COLORS = _FIXED_LEVEL_COLORS + [request_color(i) for i in range(_NUM_REQ_COLORS)]
_LEVEL_SCALE = stepped_colorscale(_LEVEL_COLORS)
_LEVEL_RANGE = dict(zmin=-0.5, zmax=len(_LEVEL_COLORS) - 0.5)


def request_color_index(req_ids: Iterable[str]) -> dict[str, int]:
    """Stable colour index per request id, in order of first appearance."""
    out: dict[str, int] = {}
    for r in req_ids:
        out.setdefault(str(r), len(out))
    return out


def req_levels(req_ids: Sequence[str], colors: Mapping[str, int] | None,
                highlight: str | None) -> np.ndarray:
    """Level of each request row: its colour, or dim when another request is highlighted."""
    out = np.empty(len(req_ids), dtype=np.int64)
    for i, r in enumerate(req_ids):
        c = colors.get(str(r), i) if colors is not None else i
        out[i] = _L_REQ0 + c % _NUM_REQ_COLORS
        if highlight is not None and str(r) != highlight:
            out[i] = L_DIM
    return out


class Canvas:
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
        self.done: set[int] = set()  # ids of parts added already through safe_spec (``add_done``)
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

    def add_done(self, *parts: Any) -> None:
        """Say that ``parts`` (values of a trace or annotations added, alive as long as the canvas)
        went through ``safe_spec`` already: ``spec`` keeps them as they are (the same objects)."""
        self.done.update(map(id, parts))

    def spec(self, **layout) -> dict:
        """The figure as plain data: ``{"data": [trace dicts], "layout": {...}}``; every string in
        it passed through ``safe_text`` (trace strings are untrusted)."""
        lay = {"autosize": True, **self.layout, **layout, "shapes": self.shapes, "annotations": self.annotations}
        return safe_spec({"data": self.data, "layout": lay}, done=self.done or None)


_MARKUP = re.compile(r"<(?:br|/?b|/?i|/?sub|/?sup|/?extra)>")
"""The plotly text markup the figures themselves write; every other ``<`` is escaped."""
_NEEDS_ESCAPE = re.compile(r"[<>&]").search
_MAX_TEXT = 300
"""Longest string a figure shows; longer ones (a 10 MB request id) are cut, saying how long."""


def shorten(text: str, limit: int = _MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was (a 10 MB request id shown
    in a header or a hover label must not cost 10 MB per copy)."""
    return text if len(text) <= limit else text[:max(limit - 40, 1)] + f"... ({len(text)} characters)"


def safe_text(text: str) -> str:
    """``text`` as plotly shows it literally: ``&``, ``<``, ``>`` escaped except the markup the
    figures write (``<br>``, ``<b>``, ``<i>``, ``<sub>``, ``<sup>``, ``<extra>``), cut to
    ``_MAX_TEXT`` characters. ``safe_text('<img src=x onerror=alert(1)><br>q 3')`` is
    ``'&lt;img src=x onerror=alert(1)&gt;<br>q 3'``."""
    if len(text) > _MAX_TEXT:
        text = shorten(text)
    if _NEEDS_ESCAPE(text) is None or _NEEDS_ESCAPE(_MARKUP.sub("", text)) is None:
        return text  # nothing to escape (most hover texts: plain, or only the figures' markup)
    parts = _MARKUP.split(text)
    marks = _MARKUP.findall(text)
    out = [html.escape(parts[0], quote=False)]
    for mark, part in zip(marks, parts[1:]):
        out += [mark, html.escape(part, quote=False)]
    return "".join(out)


def _safe_item(v: Any) -> Any:
    return safe_text(v) if isinstance(v, str) else v


_safe_array = np.frompyfunc(_safe_item, 1, 1)


def safe_spec(obj: Any, *, done: Container[int] | None = None) -> Any:
    """A figure spec (or any part of one) with every string through ``safe_text``: dict values,
    list items and string or object arrays (hover-text matrices). Numbers are left as they are.
    ``done``: ids of parts that went through it already, kept as they are (``Canvas.add_done``)."""
    t = type(obj)
    if t is str or isinstance(obj, str):
        return safe_text(obj)
    if done is not None and id(obj) in done:
        return obj
    if t is dict or isinstance(obj, dict):
        return {k: safe_text(v) if type(v) is str else safe_spec(v, done=done) for k, v in obj.items()}
    if t is list or t is tuple or isinstance(obj, (list, tuple)):
        kinds = set(map(type, obj))
        if kinds <= _PLAIN:  # numbers alone, or strings none of which needs a change (most hover rows)
            if str not in kinds or _plain_texts(obj if kinds == _STR else [v for v in obj if type(v) is str]):
                return list(obj)
        return [safe_text(v) if type(v) is str else safe_spec(v, done=done) for v in obj]
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "OU":
        if not obj.size:
            return obj
        flat = obj.ravel().tolist()
        if set(map(type, flat)) <= _PLAIN and _plain_texts([v for v in flat if type(v) is str]):
            return obj.astype(object)
        return _safe_array(obj.astype(object))
    return obj


_PLAIN = frozenset({str, int, float, bool, type(None)})
_STR = frozenset({str})


def _plain_texts(texts: list) -> bool:
    """Whether ``safe_text`` leaves every string of ``texts`` as it is: none longer than
    ``_MAX_TEXT`` and none with ``<``, ``>`` or ``&`` besides the figures' markup (one search over
    them all)."""
    if not texts:
        return True
    if max(map(len, texts)) > _MAX_TEXT:
        return False
    joined = "\x00".join(texts)  # markup never spans a separator: removing it from the whole is per string
    return _NEEDS_ESCAPE(joined) is None or _NEEDS_ESCAPE(_MARKUP.sub("", joined)) is None


def as_figure(spec: dict) -> go.Figure:
    """A figure spec (``{"data", "layout"}`` of plain dicts) as a ``go.Figure``, not re-validated."""
    return go.Figure(spec, _validate=False)


def validate_figure(fig: go.Figure) -> go.Figure:
    """``fig`` rebuilt with plotly's validators on (raises ValueError on an invalid property)."""
    return go.Figure(fig.to_plotly_json())


def vline(xref: str, yref: str, x: float, **line) -> dict:
    return dict(type="line", xref=xref, yref=f"{yref} domain", x0=x, x1=x, y0=0, y1=1, line=line)


def hline(xref: str, yref: str, y: float, **line) -> dict:
    return dict(type="line", xref=f"{xref} domain", yref=yref, x0=0, x1=1, y0=y, y1=y, line=line)


def range_text(a: int, b: int) -> str:
    return f"{a}" if a == b else f"{a}–{b}"


def _heat(z, edges, labels, text=None, hover=None, show_text=True, name="", font_size=FONT_PX,
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


def strip_heat(d: Drawn, names, *, name: str = "", font_size: float = FONT_PX, ygap: int = 3) -> dict:
    """The heatmap trace of a drawn strip (``pcpviz.views.figures.lod.draw_strip``)."""
    return _heat(d.z, d.edges, list(names), d.text, d.hover, d.text is not None, name, font_size=font_size,
                 xgap=d.xgap, ygap=ygap)


def level_color(level: float) -> str:
    """The colour a heatmap level is drawn in (``L_PAD`` grey, ``_L_REQ0 + i`` request colour i)."""
    return _LEVEL_COLORS[min(max(int(round(level)), 0), len(_LEVEL_COLORS) - 1)]


def strip_labels(xref: str, yref: str, d: Drawn, *, font_size: float = FONT_PX) -> list[dict]:
    """Annotations of a drawn strip's run labels (lane ``i`` at y = i on a category axis), each in
    black or white, whichever reads better on the cell under it (``palette.text_color``): a block
    range on a dark blue request reads white."""
    out = []
    for x, li, t in d.labels:
        k = min(max(int(np.searchsorted(d.edges, x, side="right")) - 1, 0), d.z.shape[1] - 1)
        level = d.z[li, k] if d.z.size else np.nan
        color = text_color(level_color(level)) if np.isfinite(level) else "#111111"
        out.append(dict(x=x, y=li, xref=xref, yref=yref, text=t, showarrow=False,
                        font=dict(size=font_size, color=color)))
    return out
