"""The pcpviz Workbench: one trace, linked controls, every view of a step.

    from pcpviz.views.widgets import Workbench
    wb = Workbench("../data/traces/cpu-pcp2-mtp2")     # or a pcpviz.trace.Trace
    wb                                                  # in a notebook cell

Controls (all linked): **step** slider, **phase** toggle (only the phases the step has on
the selected rank: target, draft_0 .. draft_{K-1}, verify), **rank** dropdown, **highlight**
(a request id; the others are dimmed). Panels (``wb.figures``, plotly ``FigureWidget``s), one per
entry of the panel registry ``pcpviz.views.panels.PANELS`` (which the HTML export reads too):

* ``token_order``   global batch vs each rank's local rows, gather/restore maps, KV write mask
* ``timeline``      target → draft_0 (rank-local) → block-table gather → draft_1.. (replicated)
                    → verify, with positions / seq_lens per request
* ``block_tables``  global rows, the rank's local rows, the draft step's rows (zero/stale
                    draft rows outlined in red)
* ``slot_mappings`` global [G, T], gathered [G, N*P] with PAD, the write mask, the draft step's
* ``acceptance``    rate per draft position (vLLM's definition), per request, per step

and, when ``pcpviz.analysis.checks`` is importable, the check verdicts with a *jump* button per failed
check that moves the controls to its first violation (which is also marked on its panel; the
text lines are ``pcpviz.views.widgets.status``).

A control change re-renders only the panels that depend on it (``AFFECTS``, from each panel's
``depends``). Each panel's figure is built as a plain spec (its ``spec`` function in the registry,
aggregated on the Python side: see ``pcpviz.views.figures.aggregate``), kept in a cache keyed by
what the panel depends on (``clear_cache()`` empties it, replacing ``trace`` drops it), and
pushed to its ``FigureWidget`` as the difference from what it shows (``pcpviz.views.widgets.push``).
On a 128k-token, PCP=8, K=3 trace a control change takes a few tens of milliseconds on a 2-core
CPU (``benchmarks/bench_workbench.py``, ``data/bench/workbench_cpu.json``).
"""

from __future__ import annotations

import html
import os
import time
from collections import Counter, OrderedDict
from typing import Any, Iterable, Mapping

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.graph_objects import FigureWidget  # noqa: F401  (import cost paid at import, not at first build)

from pcpviz.trace import Trace, phase_sort_key
from pcpviz.trace import open as open_trace
from pcpviz.views import figures as fg
from pcpviz.views.panels import PANELS, PanelInput, affects, panel_marks
from pcpviz.views.widgets import status as st
from pcpviz.views.widgets.figure import RestorableFigureWidget
from pcpviz.views.widgets.push import push_spec

__all__ = ["Workbench", "AFFECTS", "VIEW_NAMES", "load_acceptance", "load_check_report", "violation_view"]

VIEW_NAMES = tuple(PANELS)
"""The Workbench's panels (``pcpviz.views.panels.PANELS``), in the order shown."""

AFFECTS: dict[str, frozenset[str]] = affects()
"""Which panels a control change re-renders (``acceptance_marker`` moves the step shading only),
from each panel's ``depends`` in ``pcpviz.views.panels``."""

violation_view = fg.violation_view
load_acceptance = fg.load_acceptance
from_diff_acceptance = fg.from_diff_acceptance
load_check_report = fg.load_check_report

MAX_REPLACEMENTS = 3
"""Most times one view's figure widget is replaced after its front end stopped hearing the kernel."""

SCREEN_GRID = [["token_order", "block_tables"], ["timeline", "slot_mappings"], ["acceptance", None]]
"""The views' places with two columns: what a reader needs together, side by side (None: the view
to the left spans the row)."""
GRID_GAP = 16
"""Space (px) between the two columns."""
PLOT_MARGIN = 110
"""A figure's left and right margins together (px, the widest of the views'): its strips are drawn
``width - PLOT_MARGIN`` px wide."""

SPEC_CACHE_SIZE = 256
"""Figure specs kept per Workbench (least recently used dropped first): moving back to a step,
rank, draft phase or highlight shown before costs a dictionary look-up."""


class Workbench(W.VBox):
    """Linked controls and views over one trace (see the module docstring).

    Attributes for scripting and tests: ``trace``, the controls ``step`` / ``phase`` /
    ``rank`` / ``highlight``, ``figures`` (view name -> ``go.FigureWidget``), ``render_counts``
    (view name -> renders so far), ``last_update_s`` (seconds of the last control change),
    ``check_report`` (or None), ``violations`` (first violation of each failed check),
    ``flags`` (zero/stale draft block-table rows of the current step, rank and draft phase),
    ``acceptance`` (``AcceptanceStats``) and ``jump_to(violation)``; ``show_explain(good)`` adds
    the ``pcpviz.analysis.explain`` panel (then ``explanation`` and ``explain_panel``).

    ``width`` is the Workbench's width in px (None: the figures take plotly's autosize, one per
    row). Its views are laid out in ``columns`` columns (``SCREEN_GRID``: the token order beside
    the block tables, then the timeline beside the slot mappings) so that on a 1400 x 900 screen
    with JupyterLab's file browser open (a ~970 px output area) the controls, the token order and
    the block tables are all on screen at once (``tests/views/test_browser_fit.py``); each figure
    is ``(width - gap) / columns`` px wide and its strips are drawn at that width (``lod``).
    ``columns=1`` stacks them, each as wide as the Workbench.
    """

    def __init__(self, trace: Trace | str | os.PathLike, *, step: int | None = None, rank: int | None = None,
                 phase: str | None = None, highlight: str | None = None, checks: bool = True,
                 width: int | None = 960, columns: int = 2) -> None:
        self.trace = trace if isinstance(trace, Trace) else open_trace(trace)
        t = self.trace
        if not t.steps:
            raise ValueError(f"trace {t.path} has no complete step")
        self.meta = t.run_meta
        self.req_ids = fg.trace_req_ids(t)
        self.colors = fg.request_color_index(self.req_ids)
        self.render_counts: Counter[str] = Counter()
        self.replaced: Counter[str] = Counter()  # view -> figure widgets replaced (``_replace_figure``)
        self.last_update_s = 0.0
        self.flags: list[fg.RowFlag] = []
        self._suspend = False
        self._specs: OrderedDict[tuple, dict] = OrderedDict()  # (view, step, rank, ...) -> spec
        self._flag_cache: dict[tuple, list[fg.RowFlag]] = {}
        self._shown: dict[str, dict | None] = {}  # view -> the spec its FigureWidget shows
        self.windows: dict[str, dict[str, tuple[float, float]]] = _no_windows()
        self._cached_for: Trace | None = None
        # Figure width in px. FigureWidget sizes itself once, before JupyterLab attaches it, and
        # falls back to plotly's 700 px; an explicit width is what reliably fills a notebook cell.
        self.columns = columns = max(1, min(int(columns), 2))
        self.width = None if width is None else max(int(width) - GRID_GAP * (columns - 1), columns) // columns
        self.px = max(self.width - PLOT_MARGIN, 100) if self.width else fg.PLOT_PX  # strips drawn this wide

        style = {"description_width": "70px"}
        steps = list(t.steps)
        self.step = W.SelectionSlider(options=steps, value=steps[0] if step is None else step, description="step",
                                      continuous_update=False, style=style,
                                      layout=W.Layout(width="400px"))
        self.rank = W.Dropdown(options=[(f"rank {r}", r) for r in t.ranks],
                               value=t.ranks[0] if rank is None else rank, description="rank", style=style,
                               layout=W.Layout(width="170px"))
        self.highlight = W.Dropdown(options=[("none", "")] + [(r, r) for r in self.req_ids],
                                    value=highlight or "", description="highlight", style=style,
                                    layout=W.Layout(width="230px"))
        self.phase = W.ToggleButtons(options=self._phases(self.step.value, self.rank.value), description="phase",
                                     style={"description_width": "70px", "button_width": "82px"})
        if phase is not None:
            self.phase.value = phase
        else:
            self.phase.value = fg.draft_source_phase(self.phase.options, None) or self.phase.options[0]
        self.header = W.HTML(st.header_html(t, self.meta, self.req_ids))
        self.status = W.HTML()
        self.figures: dict[str, go.FigureWidget] = {name: self._new_figure(name) for name in VIEW_NAMES}
        self.acceptance = load_acceptance(t)

        t0 = time.perf_counter()
        self.check_report = load_check_report(t) if checks else None
        self.check_seconds = time.perf_counter() - t0
        self.violations = st.first_violations(self.check_report)
        self.checks_box, self.jump_buttons = st.checks_widget(self.check_report, self.violations, self.jump_to)

        self.step.observe(self._on_step, names="value")
        self.rank.observe(self._on_rank, names="value")
        self.phase.observe(self._on_phase, names="value")
        self.highlight.observe(self._on_highlight, names="value")

        controls = W.VBox([self.step, W.HBox([self.rank, self.highlight]), self.phase],
                          layout=W.Layout(border="1px solid #ddd", padding="4px", width="420px", flex="0 0 auto",
                                          align_self="flex-start"))
        controls.add_class("pcpviz-controls")
        about = W.VBox([self.header, self.status] + ([self.checks_box] if self.checks_box is not None else []),
                       layout=W.Layout(flex="1 1 auto", min_width="0", margin="0 0 0 10px"))
        self._boxes: dict[str, W.Box] = {}  # view -> the grid cell its figure is drawn in
        self.grid = W.GridBox(self._grid_children(), layout=self._grid_layout())
        super().__init__([W.HTML(st.RELOAD_NOTE), W.HBox([controls, about]), self.grid])
        self.add_class("pcpviz-workbench")
        self._render(set(VIEW_NAMES))

    # ------------------------------------------------------------------ figures

    def _grid_children(self) -> list[W.Widget]:
        """Each view's title and figure, in ``VIEW_NAMES`` order (the page's order), each placed
        in its grid area (``SCREEN_GRID``)."""
        out = []
        for name in VIEW_NAMES:
            title = W.HTML(f"<h4 style='margin:6px 0 0 4px'>{html.escape(PANELS[name].title)}</h4>",
                           layout=W.Layout(grid_area=f"t_{name}", min_width="0", overflow="hidden"))
            self._boxes[name] = W.Box([self.figures[name]], layout=W.Layout(grid_area=f"f_{name}", min_width="0"))
            out += [title, self._boxes[name]]
        return out

    def _grid_layout(self) -> W.Layout:
        """The grid: ``SCREEN_GRID``'s rows of views (one view per row with ``columns=1``)."""
        rows = SCREEN_GRID if self.columns == 2 else [[v] for row in SCREEN_GRID for v in row if v]
        rows = rows + [[v] + [v] * (self.columns - 1) for v in VIEW_NAMES if not any(v in r for r in rows)]
        areas = []
        for row in rows:
            cells = [(v or row[0]) for v in row] if len(row) == self.columns else [row[0]] * self.columns
            areas += [" ".join(f"t_{v}" for v in cells), " ".join(f"f_{v}" for v in cells)]
        cols = " ".join([f"{self.width}px" if self.width else "1fr"] * self.columns)
        return W.Layout(grid_template_areas="\n".join(f'"{a}"' for a in areas), grid_template_columns=cols,
                        grid_gap=f"0 {GRID_GAP}px", align_items="flex-start")

    def _new_figure(self, view: str) -> go.FigureWidget:
        """The widget ``view`` is drawn in: restorable after a page reload, replaced when its front
        end reports that it no longer hears the kernel (``pcpviz.views.widgets.figure``)."""
        # An explicit small template: the default one costs ~60 ms per FigureWidget to set up.
        fw = RestorableFigureWidget(layout={"template": fg.TEMPLATE, "height": 300})
        fw.on_deaf = lambda old, v=view: self._replace_figure(v, old)
        if PANELS[view].zoom_axes:  # a zoom in the browser: FigureWidget's relayout message from plotly.js
            fw.observe(lambda change, v=view: self._on_relayout(v, change), names="_js2py_relayout")
        return fw

    def _replace_figure(self, view: str, old: go.FigureWidget) -> None:
        """Show ``view`` in a new widget in place of ``old`` (whose front end stopped hearing the
        kernel: anywidget's load window missed after a page reload), drawing what it showed."""
        if self.figures.get(view) is not old or self.replaced[view] >= MAX_REPLACEMENTS:
            return
        self.replaced[view] += 1
        fw = self._new_figure(view)
        self.figures[view] = fw
        self._shown[view] = push_spec(fw, self._spec(view), None, width=self.width)
        self._boxes[view].children = (fw,)
        old.close()

    # ------------------------------------------------------------------ data access

    def _phases(self, step: int, rank: int) -> list[str]:
        return sorted((p for p in fg.recorded_phases(self.trace, step, rank) if p != "dummy"), key=phase_sort_key) or ["target"]

    def records(self, step: int | None = None, rank: int | None = None) -> dict[str, Mapping[str, np.ndarray]]:
        """``{phase: record}`` of a step on a rank (default: the current ones)."""
        step = self.step.value if step is None else step
        rank = self.rank.value if rank is None else rank
        return {p: self.trace.record(step, rank, p) for p in fg.recorded_phases(self.trace, step, rank)}

    @property
    def draft_phase(self) -> str | None:
        """The draft step the block-table and slot-mapping panels show."""
        return fg.draft_source_phase(self.phase.options, self.phase.value)

    # ------------------------------------------------------------------ controls

    def _on_relayout(self, view: str, change) -> None:
        """A zoom, pan or reset of ``view`` in the browser: redraw it for the visible window."""
        msg = change.get("new") or {}
        data = msg.get("relayout_data") or {}
        win = dict(self.windows[view])
        p = PANELS[view]
        for axis, key in [*((a, a) for a in p.zoom_axes), *p.zoom_links]:
            r = data.get(f"{axis}.range")
            if r is None and f"{axis}.range[0]" in data and f"{axis}.range[1]" in data:
                r = (data[f"{axis}.range[0]"], data[f"{axis}.range[1]"])
            if r is not None and len(r) == 2:
                win[key] = (float(r[0]), float(r[1]))
            elif data.get(f"{axis}.autorange"):
                win.pop(key, None)
        if win != self.windows[view]:
            t0 = time.perf_counter()
            self.windows[view] = win
            self._render({view})
            self.last_update_s = time.perf_counter() - t0

    def zoom(self, view: str, **ranges: tuple[float, float] | None) -> None:
        """Show ``view`` over x ranges (``wb.zoom("token_order", xaxis=(0, 100))``; None: all),
        as a zoom in the browser does."""
        win = dict(self.windows[view])
        for a, r in ranges.items():
            if r is None:
                win.pop(a, None)
            else:
                win[a] = (float(r[0]), float(r[1]))
        self.windows[view] = win
        self._render({view})

    def _on_step(self, change) -> None:
        t0 = time.perf_counter()
        opts = self._phases(change["new"], self.rank.value)
        affected = set(AFFECTS["step"])
        if list(self.phase.options) != opts:
            keep = self.phase.value
            self._suspend = True
            try:
                self.phase.options = opts
                self.phase.value = keep if keep in opts else (fg.draft_source_phase(opts, None) or opts[0])
            finally:
                self._suspend = False
        self._render(affected)
        self.last_update_s = time.perf_counter() - t0

    def _on_rank(self, change) -> None:
        t0 = time.perf_counter()
        opts = self._phases(self.step.value, change["new"])
        if list(self.phase.options) != opts:
            keep = self.phase.value
            self._suspend = True
            try:
                self.phase.options = opts
                self.phase.value = keep if keep in opts else opts[0]
            finally:
                self._suspend = False
        self._render(set(AFFECTS["rank"]))
        self.last_update_s = time.perf_counter() - t0

    def _on_phase(self, change) -> None:
        if self._suspend or change["new"] is None:
            return
        t0 = time.perf_counter()
        self._render(set(AFFECTS["phase"]))
        self.last_update_s = time.perf_counter() - t0

    def _on_highlight(self, change) -> None:
        t0 = time.perf_counter()
        self._render(set(AFFECTS["highlight"]))
        self.last_update_s = time.perf_counter() - t0

    def set(self, *, step: int | None = None, rank: int | None = None, phase: str | None = None,
            highlight: str | None = None) -> None:
        """Move several controls at once (each view re-rendered at most once)."""
        self._suspend = True
        try:
            if rank is not None:
                self.rank.unobserve(self._on_rank, names="value")
                self.rank.value = rank
                self.rank.observe(self._on_rank, names="value")
            if step is not None:
                self.step.unobserve(self._on_step, names="value")
                self.step.value = step
                self.step.observe(self._on_step, names="value")
            opts = self._phases(self.step.value, self.rank.value)
            if list(self.phase.options) != opts:
                self.phase.options = opts
            if phase is not None and phase in opts:
                self.phase.value = phase
            elif self.phase.value not in opts:
                self.phase.value = fg.draft_source_phase(opts, None) or opts[0]
            if highlight is not None:
                self.highlight.unobserve(self._on_highlight, names="value")
                self.highlight.value = highlight
                self.highlight.observe(self._on_highlight, names="value")
        finally:
            self._suspend = False
        self._render(set(VIEW_NAMES))

    def jump_to(self, violation: Any) -> None:
        """Move the controls to a check violation (step, rank, phase)."""
        rank = violation.rank if violation.rank is not None else self.rank.value
        self.set(step=violation.step, rank=rank, phase=violation.phase)

    def show_explain(self, good: Trace | str | os.PathLike | None = None, *, rerun: bool = False) -> Any:
        """Add the ``pcpviz.analysis.explain`` panel under the checks (the verdict as its title, the
        evidence and the ranked hypotheses inside, a *jump* to the top hypothesis's first
        violation) and return the ``Explanation``. ``good``/``rerun`` as for ``explain``."""
        from pcpviz.analysis.explain import explain

        ex = explain(self.trace, good, rerun=rerun)
        body = [W.HTML(f"<pre style='font-size:11px;white-space:pre-wrap'>{html.escape(ex.format())}</pre>")]
        top = ex.top
        first = None if top is None or self.check_report is None else \
            self.check_report.results[top.caught_by].first_violation
        if first is not None:
            b = W.Button(description=f"jump: {top.fault} (step {first.step}, {first.phase})",
                         button_style="danger", layout=W.Layout(width="auto"))
            b.on_click(lambda _b, v=first: self.jump_to(v))
            body.insert(0, b)
        panel = W.Accordion(children=[W.VBox(body)])
        what = top.fault if top is not None else "nothing to blame" if ex.ok else "no registered fault matches"
        panel.set_title(0, ("✓ " if ex.ok else "✗ ") + f"explain: {ex.verdict}: {what}")
        panel.selected_index = None if ex.ok else 0
        self.explain_panel, self.explanation = panel, ex
        kids = list(self.children)
        kids.insert(kids.index(self.grid), panel)  # under the controls, above the views
        self.children = tuple(kids)
        return ex

    # ------------------------------------------------------------------ rendering

    def _hl(self) -> str | None:
        return self.highlight.value or None

    def clear_cache(self) -> None:
        """Forget every figure built so far (the next change of each control rebuilds its views)."""
        self._specs.clear()
        self._flag_cache.clear()

    def _caches(self) -> None:
        """Drop every cached spec when ``trace`` was replaced since they were built."""
        if self._cached_for is not self.trace:
            self.clear_cache()
            self._cached_for = self.trace

    def _draft_flags(self, step: int, rank: int, draft_phase: str | None) -> list[fg.RowFlag]:
        """Zero/stale rows of the draft step's block table (cached per step, rank, draft phase)."""
        key = (step, rank, draft_phase)
        if key not in self._flag_cache:
            recs = self.records(step, rank)
            target = recs.get("target")
            draft = recs.get(draft_phase) if draft_phase else None
            flags = fg.drawn("block_tables", lambda: fg.draft_block_table_flags(target, draft)
                             if target is not None else [], step=step, rank=rank, recs=recs)
            self._flag_cache[key] = flags if isinstance(flags, list) else []  # a message: no flags
        return self._flag_cache[key]

    def _spec_key(self, view: str) -> tuple:
        """What ``view`` shows depends on (its ``depends`` in ``pcpviz.views.panels``: the step,
        rank, highlight, the selected phase or the draft phase the draft panels show) and its
        zoomed windows; a per-run panel's step marker is laid over it, not part of it."""
        p = PANELS[view]
        state = {"step": self.step.value, "rank": self.rank.value, "phase": self.phase.value,
                 "draft_phase": self.draft_phase, "highlight": self._hl()}
        return (view, *(state[d] for d in sorted(p.depends)), tuple(sorted(self.windows.get(view, {}).items())))

    def _spec(self, view: str) -> dict:
        """The spec ``view`` shows for the current controls: built once, then cached."""
        self._caches()
        key = self._spec_key(view)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._build_or_explain(view)
            self._specs[key] = spec
            while len(self._specs) > SPEC_CACHE_SIZE:
                self._specs.popitem(last=False)
        else:
            self._specs.move_to_end(key)
        marker = PANELS[view].step_marker
        if marker is not None:
            spec = {**spec, "layout": {**spec["layout"], "shapes": marker(self.step.value)}}
        return spec

    def _input(self, view: str, recs: Mapping[str, Any]) -> PanelInput:
        step, rank, dp = self.step.value, self.rank.value, self.draft_phase
        return PanelInput(step=step, rank=rank, recs=recs, phase=self.phase.value, draft_phase=dp,
                          highlight=self._hl(), colors=self.colors, flags=self._draft_flags(step, rank, dp),
                          windows=self.windows.get(view) or None, acceptance=self.acceptance, px=self.px)

    def _build(self, view: str) -> dict:
        p = PANELS[view]
        if not p.per_step:
            return p.spec(self._input(view, {}))
        step, rank = self.step.value, self.rank.value
        recs = self.records(step, rank)
        if recs.get("target") is None:
            return fg.message_spec(f"step {step} rank {rank}: no target phase recorded" if recs else
                                   f"step {step} is not (yet) recorded on rank {rank}", height=160)
        inp = self._input(view, recs)
        spec = p.spec(inp)
        for mark in panel_marks(p, self.violations, inp):
            spec = fg.mark_violation(spec, mark)
        return spec

    def _build_or_explain(self, view: str) -> dict:
        """``_build``, or a placeholder naming the panel when a view it needs is missing (traces
        from other producers may omit views) or malformed (``fg.drawn``)."""
        return fg.drawn(view, lambda: self._build(view), step=self.step.value, rank=self.rank.value,
                        recs=self.records() if PANELS[view].per_step else None)

    def _render(self, views: Iterable[str]) -> None:
        views = set(views)
        where = (self.step.value, self.rank.value)
        if getattr(self, "_windows_for", where) != where:  # a new step or rank: everything again
            self.windows = _no_windows()
        self._windows_for = where
        self.flags = self._draft_flags(self.step.value, self.rank.value, self.draft_phase)
        for name in VIEW_NAMES:
            marker = f"{name}_marker"
            if name in views or marker in views:
                self._shown[name] = push_spec(self.figures[name], self._spec(name), self._shown.get(name),
                                              width=self.width)
                self.render_counts[name if name in views else marker] += 1
        self.status.value = st.status_html((self.step.value, self.rank.value, self.phase.value), self.records(),
                                           draft_phase=self.draft_phase, flags=self.flags,
                                           violations=self.violations)


def _no_windows() -> dict[str, dict[str, tuple[float, float]]]:
    """Panel -> zoomed window per x axis, for the panels that zoom (``zoom_axes``): none zoomed.
    Zooming one (plotly's relayout) redraws that panel for the visible window at its level of
    detail (``pcpviz.views.figures.lod``); a control change that moves the step or rank resets it."""
    return {name: {} for name, p in PANELS.items() if p.zoom_axes}
