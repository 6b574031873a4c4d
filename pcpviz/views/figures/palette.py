"""Colours shared by every pcpviz figure: one colour per request, grey padding, and the
empty (uncoloured) heatmap cell."""

from __future__ import annotations

import numpy as np
import plotly.colors as pc

PAD_COLOR = "#d9d9d9"
DIM_COLOR = "#f0f0f0"
_BASE = pc.qualitative.Plotly + pc.qualitative.D3 + pc.qualitative.Set2


def request_color(req: int) -> str:
    return _BASE[req % len(_BASE)]


def request_colorscale(num_reqs: int, dim_below_zero: bool = False) -> list[list]:
    """A stepped colorscale mapping request index i (0..num_reqs-1) to its colour.

    With ``dim_below_zero`` the range starts at -0.5 and that value (requests
    that are not highlighted) is drawn pale.
    """
    lo = -0.5 if dim_below_zero else 0.0
    hi = max(num_reqs - 1, 1)
    span = hi - lo
    steps = []
    if dim_below_zero:
        steps.append((lo, DIM_COLOR))
    for i in range(num_reqs):
        steps.append((i, request_color(i)))
    scale = []
    for k, (v, color) in enumerate(steps):
        start = 0.0 if k == 0 else ((steps[k - 1][0] + v) / 2 - lo) / span
        end = 1.0 if k == len(steps) - 1 else ((v + steps[k + 1][0]) / 2 - lo) / span
        scale.append([max(0.0, min(1.0, start)), color])
        scale.append([max(0.0, min(1.0, end)), color])
    return scale


def heat_z(z) -> list:
    """A heatmap's ``z`` with empty cells as ``None`` (JSON ``null``, drawn as a gap) instead of
    NaN: a ``FigureWidget`` sends its traces to the browser as JSON, where NaN is not a value
    (the kernel then warns "Out of range float values are not JSON compliant" under the cell).

    ``heat_z(np.array([[0.0, np.nan]]))`` -> ``[[0.0, None]]``.
    """
    z = np.asarray(z, dtype=float)
    return np.where(np.isfinite(z), z, None).tolist()
