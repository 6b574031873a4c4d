"""Runs of long strips: a strip (a lane of tokens, a slot mapping, a block-table row) is cut
into *runs* — maximal stretches where the request, the chunk/status and an arithmetic
progression (global token index, slot id, block id) all continue. ``pcpviz.views.figures.lod``
draws a strip from its runs at the level of detail of the visible window. A 32k-token prefill
split over 4 ranks is a few dozen runs, not 32k cells.

PCP=2 example: the gathered rows of ``cpu-pcp2-mtp2`` step 0 (P = 26) for rank 0 are req0's
chunk 0 (6 rows), chunk 3 (5 rows), req1's chunk 0 (7), chunk 3 (4) and 4 padding rows; as runs
that is 5 cells, ``run_edges(26, keys=[req, chunk])`` = ``[0, 6, 11, 18, 22, 26]``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["run_edges"]


def run_edges(n: int, *, keys: Sequence[np.ndarray] = (), arith: Sequence[np.ndarray] = (),
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


def run_lines(x: np.ndarray, y: np.ndarray, sel: np.ndarray) -> tuple[list, list]:
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
