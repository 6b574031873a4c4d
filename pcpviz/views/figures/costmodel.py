"""Plotly figures of the cost model: the fit against every measured point, PCP's prefill
speedup over prompt length, MTP's decode speedup over acceptance and batch.

Pure functions of rows the library computes (``pcpviz.costmodel``); notebook 08 calls them.
"""

from __future__ import annotations

import plotly.graph_objects as go

from pcpviz.views.figures.palette import request_color

__all__ = ["fit_figure", "pcp_speedup_figure", "mtp_speedup_figure"]


def fit_figure(rows: list[dict], *, band: float = 1.5) -> go.Figure:
    """Predicted over measured seconds, one marker per point (ratio points left out), by
    system, on log axes with the y = x line and the ``band`` x factor either side."""
    timed = [r for r in rows if r["kind"] != "ratio"]
    fig = go.Figure()
    lo = min(min(r["measured"], r["predicted"]) for r in timed) / 2
    hi = max(max(r["measured"], r["predicted"]) for r in timed) * 2
    for dash, f, name in (("solid", 1.0, "predicted = measured"), ("dot", band, f"{band:g}x"),
                          ("dot", 1 / band, None)):
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * f, hi * f], mode="lines", name=name, showlegend=bool(name),
                                 line=dict(color="#888", dash=dash, width=1), hoverinfo="skip"))
    for i, system in enumerate(sorted({r["system"] for r in timed})):
        mine = [r for r in timed if r["system"] == system]
        fig.add_trace(go.Scatter(
            x=[r["measured"] for r in mine], y=[r["predicted"] for r in mine], mode="markers", name=system,
            marker=dict(size=9, color=request_color(i), symbol=["circle" if r["kind"] == "decode_token" else "square"
                                                              for r in mine]),
            text=[f"{r['name']}<br>{r['source']}<br>factor {r['factor']:.2f}" for r in mine],
            hovertemplate="%{text}<br>measured %{x:.3g} s, predicted %{y:.3g} s<extra></extra>"))
    fig.update_xaxes(type="log", title="measured (s)")
    fig.update_yaxes(type="log", title="predicted (s)")
    fig.update_layout(title="Cost model vs every measured time (squares: prefill, circles: decode a token)",
                      height=450, width=650)
    return fig


def pcp_speedup_figure(curves: dict[str, list[dict]], *, pcp: int = 2, threshold: float = 1.5) -> go.Figure:
    """PCP=1 over PCP=``pcp`` prefill time against prompt length, one line per label
    (rows of ``pcpviz.costmodel.pcp_curve``), with the break-even ``threshold`` and the limit."""
    fig = go.Figure()
    for i, (label, rows) in enumerate(curves.items()):
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in rows], y=[r["speedup"] for r in rows], mode="lines+markers",
                                 name=label, line=dict(color=request_color(i)),
                                 customdata=[r["attention_share"] for r in rows],
                                 hovertemplate="%{x:,} tokens: %{y:.2f}x (attention %{customdata:.0%} of "
                                               "the PCP=1 step)<extra>" + label + "</extra>"))
    for y, text in ((1.0, "no gain"), (threshold, f"{threshold:g}x"), (float(pcp), f"limit {pcp}x")):
        fig.add_hline(y=y, line=dict(color="#888", dash="dot", width=1), annotation_text=text)
    fig.update_xaxes(type="log", title="prompt tokens (one prefill step)")
    fig.update_yaxes(title=f"PCP=1 time / PCP={pcp} time")
    fig.update_layout(title=f"When does PCP={pcp} pay off? Prefill speedup against prompt length", height=450,
                      width=750)
    return fig


def mtp_speedup_figure(rows: list[dict], *, title: str = "MTP speedup against acceptance") -> go.Figure:
    """Decode speedup with MTP against the conditional acceptance, one line per batch size
    (rows of ``pcpviz.costmodel.mtp_grid``), with the 1.0 line and the ceiling L (tokens a step)."""
    fig = go.Figure()
    batches = sorted({r["batch"] for r in rows})
    for i, b in enumerate(batches):
        mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["alpha"])
        fig.add_trace(go.Scatter(x=[r["alpha"] for r in mine], y=[r["speedup"] for r in mine], mode="lines",
                                 name=f"batch {b}", line=dict(color=request_color(i))))
    ceiling = sorted(({r["alpha"]: r["accepted"] for r in rows}).items())
    fig.add_trace(go.Scatter(x=[a for a, _ in ceiling], y=[L for _, L in ceiling], mode="lines",
                             name="ceiling: tokens a step (L)", line=dict(color="#888", dash="dash", width=1)))
    fig.add_hline(y=1.0, line=dict(color="#888", dash="dot", width=1), annotation_text="no gain")
    fig.update_xaxes(title="conditional acceptance at each draft position", range=[0, 1])
    fig.update_yaxes(title="tokens/s with MTP / without")
    fig.update_layout(title=title, height=420, width=650)
    return fig
