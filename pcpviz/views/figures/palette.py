"""Colours shared by every pcpviz figure: one colour per request, grey padding, a paler grey for
the requests a highlight dims, and the empty (uncoloured) heatmap cell.

The request colours are 28 hues chosen to stay apart: any two of them differ by at least 24
(CIE76 Delta E), any two of the first 16 by at least 27, and each from the padding and dim greys by
more (``tests/views/test_legible_views.py`` measures it). The old list (plotly's, then D3's) had
two blues, two greens, two oranges and two reds within the first 16 (``#EF553B`` against
``#D62728``: Delta E 12.8). ``PAD_COLOR`` is a mid grey that a 3 px strip shows between saturated
colours; ``DIM_COLOR`` is a paler one (Delta E ~27 from it), so a dimmed request never reads as
padding.
"""

from __future__ import annotations

import functools

import numpy as np

PAD_COLOR = "#a6a6a6"
DIM_COLOR = "#f0f0f0"
REQUEST_COLORS = (
    "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#BCBD22", "#17BECF",
    "#511CFB", "#FE00FA", "#16FF32", "#1CFFCE", "#FC0080", "#6C7C32", "#E3EE9E", "#F99379", "#B10DA1",
    "#3283FE", "#B68100", "#008856", "#86CE00", "#B3446C", "#862A16", "#782AB6", "#AF0038", "#FEAF16",
    "#00B5F7",
)
"""D3's first nine (without its grey), then the hue farthest from all chosen so far, in turn."""


def request_color(req: int) -> str:
    return REQUEST_COLORS[req % len(REQUEST_COLORS)]


def srgb_to_lab(color: str) -> np.ndarray:
    """CIE L*a*b* (D65) of a ``#rrggbb`` colour: ``srgb_to_lab('#ffffff')`` is ~``[100, 0, 0]``."""
    h = color.lstrip("#")
    rgb = np.array([int(h[i:i + 2], 16) for i in (0, 2, 4)], dtype=float) / 255
    lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = m @ lin / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference of two ``#rrggbb`` colours (about 2.3 is just noticeable)."""
    return float(np.linalg.norm(srgb_to_lab(a) - srgb_to_lab(b)))


@functools.lru_cache(maxsize=256)
def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (L* above 60: dark text); kept for
    the last 256 colours asked (a figure asks for each of its run labels, of a few colours)."""
    return "#111111" if srgb_to_lab(background)[0] > 60 else "#ffffff"


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
