"""Level of detail for the per-token strips (token-order lanes, KV write mask, slot mappings,
block-table rows): what one strip draws for a visible window of a given width in pixels.

A strip is a few *lanes* (heatmap rows sharing one x axis), each cut into *runs*
(``Lane``): maximal stretches of equal request, chunk, rank, padding or mask status (and,
for slot ids or block ids, an arithmetic progression). ``draw_strip`` draws the window:

* **per-token** when every visible token gets at least ``TOKEN_PX`` px: one cell per token
  with a 1 px gap, its text (chunk, slot id, block id) when the text fits the cell;
* **runs** otherwise: each run's extent snapped to whole pixels (``pixel_cells``), no gaps;
  a run narrower than a pixel still gets one pixel (taken from a neighbour at least two pixels
  wide) and a pixel under several such runs is drawn as one of them, its hover saying how many
  runs it covers; each run is labelled once where its label fits inside it.

Labels never overprint: a label is placed only inside its own run's visible extent and only
when it fits there, so labels of one lane cannot overlap and lanes are separate rows.

PCP=2 example: the global lane of a 2,048-token prefill of two requests (DualChunkSwap, four
chunks each) is 8 runs; at 860 px for the whole strip each run is ~107 px wide and is labelled
``req c0`` ... ; zoomed to tokens 0-99 each token is a 8.6 px cell with its chunk digit.

What a lane's cells read per token is plain data (``RunText``: a text per run, or a count up
from a run's first value), so the HTML export can draw per-token cells in the page without
Python (``pcpviz.views.export.tokens``, which records the strips a figure draws with
``record_strips``).

``PCPVIZ_LOD=0`` in the environment switches the level of detail off (one cell per token,
1 px gaps, every run labelled wherever it is): the drawing the views had before, kept only as
the negative control of the browser test (``tests/views/test_browser_views.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

__all__ = ["PLOT_PX", "TOKEN_PX", "MAX_LABELS", "FONT_PX", "PAD_MIN_PX", "Lane", "RunText", "Drawn", "Strip",
           "lod_enabled", "pixel_cells",
           "draw_strip", "label_px", "record_strips"]

PLOT_PX = 860
"""Plot-area width (px) the strips are computed for: the Workbench's 940 px figure less margins."""
TOKEN_PX = 4.0
"""Per-token cells once every visible token is at least this wide (px)."""
MAX_LABELS = 60
"""At most this many run labels per lane (the widest runs first)."""
PAD_MIN_PX = 3
"""Least width (px) of a padding run at full view: a 2-token PAD run of a 16k-token lane is 0.1 px."""
FONT_PX = 11
"""Font size (px) of run labels and cell texts: 11 px or more is readable on a laptop screen."""


def lod_enabled() -> bool:
    """False when ``PCPVIZ_LOD=0`` (the negative control of the browser test)."""
    return os.environ.get("PCPVIZ_LOD", "1") != "0"


def label_px(text: str, font_size: float = FONT_PX) -> float:
    """Width (px) a label needs: ~0.62 em per character plus 4 px of margin."""
    return 0.62 * font_size * len(text) + 4


@dataclass(frozen=True)
class RunText:
    """What each token of a lane reads in a per-token cell, per run: run ``i``'s tokens read
    ``const[i]``, or, where ``counts[i]``, count up from ``start[i]`` (token ``t`` of a run that
    starts at ``e`` reads ``start[i] + t - e``: slot ids, block ids).

    A slot-mapping strip ``[5, 6, 7, -1, -1]`` is two runs:
    ``RunText(["", "PAD"], start=[5, -1], counts=[True, False])``."""

    const: Sequence[str]  # [m]
    start: np.ndarray  # int64[m]
    counts: np.ndarray  # bool[m]

    @staticmethod
    def per_run(texts: Sequence[str]) -> RunText:
        """Every token of run ``i`` reads ``texts[i]``."""
        return RunText(list(texts), np.zeros(len(texts), dtype=np.int64), np.zeros(len(texts), dtype=bool))


@dataclass(frozen=True)
class Lane:
    """One heatmap row as runs: run ``i`` covers ``[edges[i], edges[i+1])``."""

    edges: np.ndarray  # int64[m+1], edges[0] == 0
    level: np.ndarray  # float64[m]: colour level (NaN: nothing drawn, e.g. beyond a rank's rows)
    label: Sequence[str | tuple[str, ...]]  # [m] run label ('' none; a tuple: alternatives, longest first)
    hover: Sequence[str]  # [m] run hover text
    text: RunText | None = None  # what a per-token cell reads (None: nothing)
    token_hover: Sequence[tuple[str, np.ndarray]] = ()  # per-token hover lines: (name, int64[m] first value)
    min_px: np.ndarray | None = None  # int64[m]: least width (px) of a run drawn as runs (PAD: 3)

    def token_lines(self, run: int, tok: int) -> str:
        """The per-token hover lines of token ``tok`` of run ``run``: ``name first + (tok - run
        start)`` for each ``token_hover`` entry whose first value is not negative. A rank lane's run
        of global tokens 100-149 at positions 40-89, hovered at its token 102: ``global token
        102<br>position 42``."""
        d = tok - int(self.edges[run])
        return "".join(f"<br>{name} {int(first[run]) + d}" for name, first in self.token_hover if first[run] >= 0)

    @property
    def length(self) -> int:
        return int(self.edges[-1]) if self.edges.size else 0

    def token_texts(self, run: np.ndarray, tok: np.ndarray) -> list[str]:
        """Text of each token ``tok`` (int64[k], inside run ``run``) for per-token cells."""
        count = self.text.start[run] + (tok - self.edges[run])
        return [str(c) if k else self.text.const[r] for r, k, c in zip(run.tolist(), self.text.counts[run].tolist(),
                                                                      count.tolist())]


@dataclass(frozen=True)
class Strip:
    """One ``draw_strip`` call, as ``record_strips`` keeps it."""

    lanes: Sequence[Lane]
    px: int
    font_size: float
    drawn: Drawn


_RECORDING: contextvars.ContextVar[list[Strip] | None] = contextvars.ContextVar("pcpviz_strips", default=None)


@contextlib.contextmanager
def record_strips() -> Iterator[list[Strip]]:
    """Every ``draw_strip`` call made inside, in order (the heatmap traces of a figure, one per
    call, in the order it adds them)."""
    calls: list[Strip] = []
    token = _RECORDING.set(calls)
    try:
        yield calls
    finally:
        _RECORDING.reset(token)


def replay_strip(strip: Strip) -> None:
    """Record ``strip`` (a ``draw_strip`` call made before, whose drawing a figure reuses) as if
    ``draw_strip`` had drawn it now, so that ``record_strips`` pairs it with its heatmap."""
    calls = _RECORDING.get()
    if calls is not None:
        calls.append(strip)


@dataclass(frozen=True)
class Drawn:
    """What ``draw_strip`` gives: heatmap columns and the labels to lay over them."""

    edges: np.ndarray  # float64[k+1]: cell edges in data units
    z: np.ndarray  # float64[L, k]
    text: np.ndarray | None  # object[L, k] per-token text, or None
    hover: np.ndarray  # object[L, k]
    labels: list[tuple[float, int, str]]  # (x, lane, text)
    per_token: bool
    xgap: int
    window: tuple[float, float]  # the x range drawn (data units)


def pixel_cells(edges: np.ndarray, lo: float, hi: float, *, px: int,
                min_px: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs ``edges`` (int64[m+1]) over the window ``[lo, hi)`` drawn ``px`` pixels wide:
    ``(pixel edges int64[k+1], run of each cell int64[k], runs under each cell int64[k])``.

    Cells tile ``[0, px)`` with no gap. A run is drawn over its extent rounded to whole pixels;
    one that rounds to nothing gets the pixel under its middle when that pixel's owner keeps at
    least one other pixel (else the pixel stays its owner's and counts one more run under it).

    ``pixel_cells([0, 10, 11, 100], 0, 100, px=10)`` -> edges ``[0, 1, 2, 10]``, runs ``[0, 1, 2]``:
    the 1-token run 1 (0.1 px) takes pixel 1 from run 0.
    """
    e = np.asarray(edges, dtype=np.int64)
    u = (hi - lo) / px
    first = max(int(np.searchsorted(e, lo, side="right")) - 1, 0)
    last = min(int(np.searchsorted(e, hi, side="left")), e.shape[0] - 1)
    ids = np.arange(first, last)  # runs that intersect the window
    f = (np.clip(e[first:last + 1].astype(float), lo, hi) - lo) / u
    b = np.clip(np.round(f).astype(np.int64), 0, px)
    widths = np.diff(b)
    owner = np.repeat(ids, widths)
    under = np.ones(px, dtype=np.int64)
    if owner.shape[0] < px:  # rounding at the window's end
        owner = np.concatenate([owner, np.full(px - owner.shape[0], ids[-1] if ids.size else 0)])
    have = dict(zip(ids.tolist(), widths.tolist()))
    for j in np.flatnonzero(widths == 0).tolist():
        q = min(int((f[j] + f[j + 1]) / 2), px - 1)
        prev = int(owner[q])
        if have.get(prev, 0) >= 2 and under[q] == 1:
            owner[q] = ids[j]
            have[prev] -= 1
            have[int(ids[j])] = 1
        under[q] += 1
    if min_px is not None:
        _widen(owner, have, f, ids, np.asarray(min_px, dtype=np.int64)[first:last], px)
    brk = np.flatnonzero(np.diff(owner) != 0) + 1
    starts = np.concatenate([[0], brk])
    cell_under = np.maximum.reduceat(under, starts)
    return np.append(starts, px).astype(np.int64), owner[starts], cell_under


def _widen(owner: np.ndarray, have: dict[int, int], f: np.ndarray, ids: np.ndarray, want: np.ndarray,
           px: int) -> None:
    """Give each run ``ids[j]`` at least ``want[j]`` pixels around its middle (in place), taken
    from neighbours that keep at least two pixels and want no width of their own: a 2-token PAD
    run of a 16k-token lane (0.1 px) is drawn 3 px wide, in grey, where it lies."""
    wanted = {int(r) for r, w in zip(ids.tolist(), want.tolist()) if w > 0}
    for j in np.flatnonzero(want > 0).tolist():
        r, need = int(ids[j]), int(want[j]) - have.get(int(ids[j]), 0)
        if need <= 0:
            continue
        mid = min(max(int((f[j] + f[j + 1]) / 2), 0), px - 1)
        for q in sorted(range(max(mid - need - 1, 0), min(mid + need + 2, px)), key=lambda q: abs(q - mid)):
            prev = int(owner[q])
            if need <= 0:
                break
            if prev == r or prev in wanted or have.get(prev, 0) < 2:
                continue
            if not (q == 0 or q == px - 1 or owner[q - 1] == r or owner[q + 1] == r or q == mid):
                continue  # grow one contiguous block
            owner[q] = r
            have[prev] -= 1
            have[r] = have.get(r, 0) + 1
            need -= 1


def _window(lanes: Sequence[Lane], window: tuple[float, float] | None) -> tuple[float, float, int]:
    width = max((ln.length for ln in lanes), default=0)
    width = max(width, 1)
    if window is None:
        return 0.0, float(width), width
    lo, hi = max(float(window[0]), 0.0), min(float(window[1]), float(width))
    if hi - lo < 1e-9:
        return 0.0, float(width), width
    return lo, hi, width


def draw_strip(lanes: Sequence[Lane], *, window: tuple[float, float] | None = None, px: int = PLOT_PX,
               font_size: float = FONT_PX) -> Drawn:
    """The cells and labels of ``lanes`` for ``window`` (data units; None: the whole strip) at
    ``px`` pixels (see the module docstring)."""
    lo, hi, width = _window(lanes, window)
    if not lod_enabled():
        d = _draw_tokens(lanes, 0.0, float(width), px, font_size, every_label=True)
    elif (hi - lo) <= px / TOKEN_PX:
        d = _draw_tokens(lanes, lo, hi, px, font_size, every_label=False)
    else:
        d = _draw_runs(lanes, lo, hi, px, font_size)
    calls = _RECORDING.get()
    if calls is not None:
        calls.append(Strip(lanes, px, font_size, d))
    return d


def _draw_runs(lanes: Sequence[Lane], lo: float, hi: float, px: int, font_size: float) -> Drawn:
    u = (hi - lo) / px
    per_lane = []
    for ln in lanes:
        e = ln.edges if ln.length >= hi else np.append(ln.edges, int(np.ceil(hi)))  # beyond: an empty run
        mp = None
        if ln.min_px is not None:
            mp = ln.min_px if ln.length >= hi else np.append(ln.min_px, 0)
        per_lane.append((e, pixel_cells(e, lo, hi, px=px, min_px=mp)))
    union = np.unique(np.concatenate([c[0] for _, c in per_lane]))
    starts = union[:-1]
    z = np.full((len(lanes), starts.shape[0]), np.nan)
    hover = np.empty((len(lanes), starts.shape[0]), dtype=object)
    labels: list[tuple[float, int, str]] = []
    for li, (ln, (e, (pe, owner, under))) in enumerate(zip(lanes, per_lane)):
        m = ln.level.shape[0]
        k = np.searchsorted(pe, starts, side="right") - 1
        run = owner[k]
        inside = run < m
        z[li] = np.where(inside, ln.level[np.minimum(run, max(m - 1, 0))] if m else np.nan, np.nan)
        for j, (r, n) in enumerate(zip(run.tolist(), under[k].tolist())):
            h = ln.hover[r] if r < m else ""
            hover[li, j] = h + (f"<br>(this pixel covers {n} runs: zoom in)" if n > 2 and h else "")
        labels += _run_labels(ln, li, lo, hi, u, font_size)
    return Drawn(lo + union * u, z, None, hover, labels, False, 0, (lo, hi))


def _run_labels(ln: Lane, li: int, lo: float, hi: float, u: float, font_size: float) -> list[tuple[float, int, str]]:
    """Labels of the runs of ``ln`` whose visible extent is wide enough for them (widest first)."""
    a = np.clip(ln.edges[:-1].astype(float), lo, hi)
    b = np.clip(ln.edges[1:].astype(float), lo, hi)
    wpx = (b - a) / u
    pick = [_fitting(t, w, font_size) for t, w in zip(ln.label, wpx.tolist())]
    ok = np.array([i for i, t in enumerate(pick) if t], dtype=np.int64)
    ok = ok[np.argsort(-wpx[ok], kind="stable")][:MAX_LABELS] if ok.size else ok
    return [(float((a[i] + b[i]) / 2), li, pick[i]) for i in sorted(ok.tolist())]


def _first(label: str | tuple[str, ...]) -> str:
    return label[0] if isinstance(label, tuple) else label


def _fitting(label: str | tuple[str, ...], width_px: float, font_size: float) -> str:
    """The first of a label's alternatives that fits ``width_px`` ('' when none does)."""
    for t in (label if isinstance(label, tuple) else (label,)):
        if t and label_px(t, font_size) <= width_px:
            return t
    return ""


def _draw_tokens(lanes: Sequence[Lane], lo: float, hi: float, px: int, font_size: float, *,
                 every_label: bool) -> Drawn:
    t0, t1 = int(np.floor(lo)), int(np.ceil(hi))
    tok = np.arange(t0, t1, dtype=np.int64)
    cell_px = px / max(hi - lo, 1e-9)
    z = np.full((len(lanes), tok.shape[0]), np.nan)
    hover = np.empty((len(lanes), tok.shape[0]), dtype=object)
    text = np.full((len(lanes), tok.shape[0]), "", dtype=object)
    fits = not every_label
    labels: list[tuple[float, int, str]] = []
    for li, ln in enumerate(lanes):
        m = ln.level.shape[0]
        run = np.searchsorted(ln.edges, tok, side="right") - 1
        inside = (tok < ln.length) & (run >= 0) & (run < m)
        rr = np.where(inside, run, 0)
        z[li] = np.where(inside, ln.level[rr] if m else np.nan, np.nan)
        for j in range(tok.shape[0]):
            hover[li, j] = ln.hover[rr[j]] + ln.token_lines(int(rr[j]), int(tok[j])) if inside[j] else ""
        if ln.text is not None and inside.any() and not every_label:
            tt = ln.token_texts(rr[inside], tok[inside])
            text[li, inside] = list(tt)
            fits = fits and all(label_px(str(s), font_size) <= cell_px for s in tt)
        if every_label:
            labels += [(float((ln.edges[i] + ln.edges[i + 1]) / 2), li, _first(ln.label[i]))
                       for i in range(m) if ln.label[i]]
    if not every_label and not fits:
        text = None
        for li, ln in enumerate(lanes):
            labels += _run_labels(ln, li, lo, hi, (hi - lo) / px, font_size)
    elif every_label:
        text = None
    edges = np.arange(t0, t1 + 1, dtype=float)
    return Drawn(edges, z, text, hover, labels, True, 1, (lo, hi))
