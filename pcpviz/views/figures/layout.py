"""Plotly figures of one PCP layout: token-order lanes, gather/restore maps and
the KV write mask. Pure functions of a ``PCPLayout``; the widgets and the HTML
export both draw with them.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pcpviz.views.figures.palette import PAD_COLOR, heat_z, request_colorscale
from pcpviz.reference.layout import PCPLayout

__all__ = ["lanes_matrix", "layout_figure"]


def lanes_matrix(layout: PCPLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The lanes as arrays: rows = [global, rank 0 .. rank N-1], columns = token slot.

    Returns ``(req, chunk, global_token, row_labels)``, each array
    ``[N+1, max(T, P)]``; ``req`` is the global row index (-1 = padding,
    -2 = beyond the lane), ``chunk`` the DualChunkSwap chunk, ``global_token``
    the global token index a slot holds.
    """
    n, p, t = layout.pcp_world_size, layout.padded_num_tokens, layout.num_tokens
    width = max(t, p, 1)
    req = np.full((n + 1, width), -2, dtype=np.int64)
    chunk = np.full((n + 1, width), -1, dtype=np.int64)
    gtok = np.full((n + 1, width), -1, dtype=np.int64)
    q = layout.num_scheduled_tokens
    req[0, :t] = np.repeat(np.arange(q.shape[0]), q)
    gtok[0, :t] = np.arange(t)
    # Chunk of each global token (replicated rows are one chunk, 0).
    token_chunk = layout.token_chunk()
    real = layout.is_real_row()
    global_chunk = np.zeros(t, dtype=np.int64)
    global_chunk[layout.padded_gather_idx[real]] = token_chunk[real]
    chunk[0, :t] = global_chunk
    for r in range(n):
        rows = slice(r * p, (r + 1) * p)
        rr = real[rows]
        g = layout.padded_gather_idx[rows]
        req[r + 1, :p] = np.where(rr, req[0, g] if t else -1, -1)
        chunk[r + 1, :p] = np.where(rr, token_chunk[rows], -1)
        gtok[r + 1, :p] = np.where(rr, g, -1)
    labels = ["global"] + [f"rank {r}" for r in range(n)]
    return req, chunk, gtok, labels


def _lane_traces(fig: go.Figure, layout: PCPLayout, names: list[str], highlight_req: int | None) -> None:
    """Row 1: the lanes (global batch, then each rank's local rows), padding grey."""
    r = layout.num_reqs
    req, chunk, gtok, labels = lanes_matrix(layout)
    z = req.astype(float)
    z[req < 0] = np.nan
    if highlight_req is not None:
        z = np.where(req == highlight_req, z, np.where(np.isnan(z), np.nan, -0.5))
    hover = np.empty(req.shape, dtype=object)
    for i in range(req.shape[0]):
        for j in range(req.shape[1]):
            if req[i, j] >= 0:
                hover[i, j] = f"{names[req[i, j]]}<br>global token {gtok[i, j]}<br>chunk {chunk[i, j]}"
            elif req[i, j] == -1:
                hover[i, j] = "padding"
            else:
                hover[i, j] = ""
    text = np.where(req >= 0, chunk.astype(str), np.where(req == -1, "·", ""))
    fig.add_trace(
        go.Heatmap(
            z=heat_z(z), y=labels, x=np.arange(req.shape[1]),
            colorscale=request_colorscale(max(r, 1), dim_below_zero=highlight_req is not None),
            zmin=-0.5 if highlight_req is not None else 0, zmax=max(r - 1, 1),
            showscale=False, xgap=1, ygap=3, text=text, texttemplate="%{text}" if req.shape[1] <= 96 else None,
            hovertext=hover, hoverinfo="text", name="lanes",
        ),
        row=1, col=1,
    )
    # padding as grey cells on the same axes
    pad = np.where(req == -1, 1.0, np.nan)
    fig.add_trace(
        go.Heatmap(z=heat_z(pad), y=labels, x=np.arange(req.shape[1]), colorscale=[[0, PAD_COLOR], [1, PAD_COLOR]],
                   showscale=False, xgap=1, ygap=3, hoverinfo="skip", name="padding"),
        row=1, col=1,
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1)


def _map_traces(fig: go.Figure, layout: PCPLayout, status: np.ndarray) -> None:
    """Row 2: the gather map by row status (left) and the restore map (right)."""
    n, p, t = layout.pcp_world_size, layout.padded_num_tokens, layout.num_tokens
    rows = np.arange(n * p)
    for label, color in (("written", "#1f77b4"), ("masked (extra replica)", "#ff7f0e"), ("padding", PAD_COLOR)):
        sel = status == label
        fig.add_trace(
            go.Scatter(
                x=rows[sel], y=layout.padded_gather_idx[sel], mode="markers",
                marker=dict(color=color, size=5), name=f"gather: {label}",
                hovertemplate="gathered row %{x}<br>global token %{y}<extra>" + label + "</extra>",
            ),
            row=2, col=1,
        )
    fig.add_trace(
        go.Scatter(
            x=np.arange(t), y=layout.hidden_restore_idx, mode="markers",
            marker=dict(color="#2ca02c", size=5), name="restore",
            hovertemplate="global token %{x} ← gathered row %{y}<extra>restore</extra>",
        ),
        row=2, col=2,
    )
    for k in range(1, n):
        fig.add_vline(x=k * p - 0.5, line=dict(color="#888", dash="dot"), row=2, col=1)
        fig.add_hline(y=k * p - 0.5, line=dict(color="#888", dash="dot"), row=2, col=2)
    fig.update_xaxes(title_text="gathered row (rank-major, P per rank)", title_standoff=2, row=2, col=1)
    fig.update_yaxes(title_text="global token", row=2, col=1)
    fig.update_xaxes(title_text="global token", title_standoff=2, row=2, col=2)
    fig.update_yaxes(title_text="gathered row", row=2, col=2)


def layout_figure(
    layout: PCPLayout,
    req_names: list[str] | None = None,
    *,
    highlight_req: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Three stacked panels: lanes, gather/restore maps, KV write mask."""
    n, p, t = layout.pcp_world_size, layout.padded_num_tokens, layout.num_tokens
    names = req_names or [f"req {i}" for i in range(layout.num_reqs)]
    fig = make_subplots(
        rows=3, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1, row_heights=[0.45, 0.4, 0.15],
        specs=[[{"colspan": 2}, None], [{}, {}], [{"colspan": 2}, None]],
        subplot_titles=(
            "token order: global batch vs each rank's local rows (text = chunk)",
            "padded_gather_idx<br>all-gathered row → global token",
            "hidden_restore_idx<br>global token → all-gathered row",
            "KV write mask over the all-gathered rows",
        ),
    )
    _lane_traces(fig, layout, names, highlight_req)
    real = layout.is_real_row()
    status = np.where(layout.kv_write_mask, "written", np.where(real, "masked (extra replica)", "padding"))
    _map_traces(fig, layout, status)
    mask_z = np.where(layout.kv_write_mask, 2.0, np.where(real, 1.0, 0.0))[None, :]
    fig.add_trace(
        go.Heatmap(
            z=mask_z, x=np.arange(n * p), y=["write"], zmin=0, zmax=2, showscale=False, xgap=1,
            colorscale=[[0, PAD_COLOR], [0.5, "#ff7f0e"], [1, "#1f77b4"]],
            hovertext=status[None, :], hoverinfo="text+x", name="kv_write_mask",
        ),
        row=3, col=1,
    )
    fig.update_layout(
        height=560 + 28 * n, margin=dict(l=60, r=20, t=60, b=30),
        title=title or f"PCP={n} layout: T={t}, P={p}, per-rank {list(layout.per_rank_num_tokens)}",
        legend=dict(orientation="h", y=-0.05),
    )
    return fig
