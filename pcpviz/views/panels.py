"""The panel registry: every figure the Workbench and the HTML export show, declared once.

A *panel* is one figure of the Workbench (and of the exported report): its name, its title, the
function that builds its spec (plain ``{"data", "layout"}``, see ``pcpviz.views.figures``) from a
``PanelInput``, and what it depends on. ``pcpviz.views.widgets.workbench`` makes one
``FigureWidget`` per panel, re-renders a panel when a control it depends on changes and caches its
spec by those values; ``pcpviz.views.export.html`` precomputes every per-step panel for each
(step, rank) and the per-run panels once. Adding a panel is one ``@panel(...)`` function here (and
its figure module); a trace view names the panel that draws it in its schema row (``panel`` of
``pcpviz.trace.schema.ViewSpec``).

Words (docs/design.md, terminology): a *view* is one recorded trace array (``positions``); a
*panel* is a figure drawn from views; the *rank-local* and *global* layouts are the two scopes of a
step's views; the ``view`` field of a draft phase keeps its name in the format.

PCP=2 example: on step 0 of ``data/traces/cpu-pcp2-mtp2`` with the phase control on ``draft_1``,
``PANELS["block_tables"]`` draws the target's global and rank-local rows and ``draft_1``'s rows;
moving the highlight re-renders every panel with ``"highlight"`` in ``depends`` (all five), moving
the phase only those with ``"phase"`` or ``"draft_phase"`` (timeline, block tables, slot
mappings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from pcpviz.views import figures as fg
from pcpviz.views.figures.content_key import content_key

__all__ = ["CONTROLS", "DEPENDS", "Panel", "PanelInput", "PANELS", "panel", "panel_marks", "affects",
           "step_panels", "run_panels"]

CONTROLS = ("step", "rank", "phase", "highlight")
"""The Workbench's controls."""

DEPENDS = frozenset({"step", "rank", "phase", "draft_phase", "highlight"})
"""What a panel may depend on: the controls, and ``draft_phase`` (the draft step the draft panels
show, ``pcpviz.views.figures.draft_source_phase`` of the phase control)."""


@dataclass(frozen=True)
class PanelInput:
    """What a panel is drawn from, for one (step, rank) and control state.

    ``recs``: ``{phase: record}`` of the step on the rank; ``phase``: the selected phase (the
    Workbench's control; the export selects ``draft_phase``); ``draft_phase``: the draft step the
    draft panels show; ``flags``: its zero/stale block-table rows; ``windows``: the zoomed x ranges
    (axis -> (lo, hi)); ``acceptance``: the run's ``AcceptanceStats`` (per-run panels); ``px``: the
    plot-area width the strips are drawn for; ``parts``: a ``figures.parts.SharedParts`` whose strips
    the panel reuses where another figure drew them alike (the HTML report's pages).
    """

    step: int | None = None
    rank: int | None = None
    recs: Mapping[str, Any] = field(default_factory=dict)
    phase: str | None = None
    draft_phase: str | None = None
    highlight: str | None = None
    colors: Mapping[str, int] | None = None
    flags: list = field(default_factory=list)
    windows: Mapping[str, tuple[float, float]] | None = None
    acceptance: Any = None
    px: int = fg.PLOT_PX  # plot-area width (px) the strips are drawn at (``pcpviz.views.figures.lod``)
    parts: Any = None  # ``SharedParts``: parts drawn once for several figures (the HTML report's pages)

    @property
    def target(self) -> Any:
        return self.recs.get("target")

    @property
    def draft(self) -> Any:
        return self.recs.get(self.draft_phase) if self.draft_phase else None


@dataclass(frozen=True)
class Panel:
    """One registered panel (see the module docstring).

    ``depends``: what its spec depends on (a subset of ``DEPENDS``), the Workbench's cache key;
    ``per_step``: drawn per (step, rank) from the step's records (False: one figure for the run);
    ``zoom_axes``: x axes whose zoom redraws it at its level of detail (each keeps its window);
    ``zoom_links``: ``(axis, zoom axis)`` pairs of further x axes whose zoom sets that axis's
    window (matched axes); ``step_marker``: a per-run panel's overlay marking the current step
    (shapes), moved by the step control alone; ``shared_key``: a digest (``content_key``) of
    everything its spec reads but the rank (it raises where it cannot say), so that the HTML report
    draws it once, with ``rank=None``, for all the pages with that key, and ``for_rank(spec, inp)``
    gives ``inp.rank``'s page from that one (None: the spec does not depend on the rank).
    PCP=64: a step's token order is drawn once for its 8 shown ranks, each page marking its rank.
    """

    name: str
    title: str
    spec: Callable[[PanelInput], dict]
    depends: frozenset[str]
    per_step: bool = True
    zoom_axes: tuple[str, ...] = ()
    zoom_links: tuple[tuple[str, str], ...] = ()
    step_marker: Callable[[int | None], list] | None = None
    shared_key: Callable[[PanelInput], str] | None = None
    for_rank: Callable[[dict, PanelInput], dict] | None = None

    @property
    def controls(self) -> frozenset[str]:
        """The controls whose change re-renders it (the phase control moves ``draft_phase``)."""
        return frozenset("phase" if d == "draft_phase" else d for d in self.depends)

    @property
    def shows_draft_phase(self) -> bool:
        return "draft_phase" in self.depends


PANELS: dict[str, Panel] = {}
"""Panel name -> ``Panel``, in the order the Workbench and the report show them."""


def panel(name: str, title: str, *, depends: set[str] | frozenset[str], per_step: bool = True,
          zoom_axes: tuple[str, ...] = (), zoom_links: tuple[tuple[str, str], ...] = (),
          step_marker: Callable[[int | None], list] | None = None,
          shared_key: Callable[[PanelInput], str] | None = None,
          for_rank: Callable[[dict, PanelInput], dict] | None = None):
    """Register the decorated ``spec(PanelInput) -> dict`` as panel ``name`` (shown after the
    panels registered before it). A repeated name or an unknown dependency fails at import."""
    unknown = set(depends) - DEPENDS
    if unknown or name in PANELS:
        raise ValueError(f"panel {name!r}: " + (f"unknown dependency {sorted(unknown)[0]!r} (one of "
                                                f"{sorted(DEPENDS)})" if unknown else "registered twice"))

    def register(spec: Callable[[PanelInput], dict]) -> Callable[[PanelInput], dict]:
        PANELS[name] = Panel(name, title, spec, frozenset(depends), per_step=per_step, zoom_axes=zoom_axes,
                             zoom_links=zoom_links, step_marker=step_marker, shared_key=shared_key,
                             for_rank=for_rank)
        return spec

    return register


def step_panels() -> list[Panel]:
    """The panels drawn per (step, rank)."""
    return [p for p in PANELS.values() if p.per_step]


def run_panels() -> list[Panel]:
    """The panels drawn once for the run."""
    return [p for p in PANELS.values() if not p.per_step]


def affects() -> dict[str, frozenset[str]]:
    """Control -> the panels its change re-renders; a per-run panel with a ``step_marker`` is
    listed under ``step`` as ``<name>_marker`` (only its marker moves)."""
    out = {c: frozenset(p.name for p in PANELS.values() if c in p.controls) for c in CONTROLS}
    marked = frozenset(f"{p.name}_marker" for p in PANELS.values() if p.step_marker and "step" not in p.controls)
    return {**out, "step": out["step"] | marked}


def panel_marks(p: Panel, violations: Any, inp: PanelInput) -> list[str]:
    """Banner texts of the check violations drawn on panel ``p`` at ``inp``'s (step, rank)."""
    return fg.violation_marks(violations, p.name, step=inp.step, rank=inp.rank, draft_phase=inp.draft_phase,
                              shows_draft_phase=p.shows_draft_phase)


def _settings(p: PanelInput) -> tuple:
    """The drawing settings a step panel reads besides its records and rank (part of its ``shared_key``)."""
    return p.draft_phase, p.highlight, p.colors, p.windows, p.px


@panel("token_order", "Token order — global batch vs each rank's local rows",
       depends={"step", "rank", "highlight"}, zoom_axes=("xaxis", "xaxis4"),
       shared_key=lambda p: content_key(fg.token_order_inputs(p.target), _settings(p)),
       for_rank=lambda spec, p: fg.token_order_for_rank(spec, p.target, p.rank))
def token_order(p: PanelInput) -> dict:
    return fg.token_order_spec(p.target, rank=p.rank, highlight=p.highlight, colors=p.colors, windows=p.windows,
                               px=p.px)


@panel("timeline", "Draft-step timeline — target → draft_0 (rank-local) → gather → draft_k (replicated) → verify",
       depends={"step", "rank", "phase", "highlight"})
def timeline(p: PanelInput) -> dict:
    return fg.draft_timeline_spec(p.recs, step=p.step, rank=p.rank, selected_phase=p.phase, highlight=p.highlight)


@panel("block_tables", "Block tables — global, local and draft rows",
       depends={"step", "rank", "draft_phase", "highlight"}, zoom_axes=("xaxis",),
       zoom_links=(("xaxis2", "xaxis"), ("xaxis3", "xaxis")))
def block_tables(p: PanelInput) -> dict:
    return fg.block_tables_spec(p.target, p.draft, draft_phase=p.draft_phase, rank=p.rank, highlight=p.highlight,
                                colors=p.colors, flags=p.flags, windows=p.windows, px=p.px, parts=p.parts)


@panel("slot_mappings", "Slot mappings — global, gathered (PAD), write mask, draft",
       depends={"step", "rank", "draft_phase", "highlight"}, zoom_axes=("xaxis", "xaxis2", "xaxis3", "xaxis4"),
       shared_key=lambda p: content_key(fg.slot_mappings_inputs(p.target, p.draft), _settings(p)))
def slot_mappings(p: PanelInput) -> dict:
    return fg.slot_mappings_spec(p.target, p.draft, draft_phase=p.draft_phase, highlight=p.highlight,
                                 colors=p.colors, windows=p.windows, px=p.px)


@panel("dcp_shards", "DCP shards — which DCP rank holds each token's KV, local lengths, draft slots per rank",
       depends={"step", "rank", "draft_phase", "highlight"}, zoom_axes=("xaxis", "xaxis2"),
       zoom_links=(("xaxis2", "xaxis"),))
def dcp_shards(p: PanelInput) -> dict:
    return fg.dcp_shards_spec(p.target, p.draft, rank=p.rank, draft_phase=p.draft_phase, highlight=p.highlight,
                              colors=p.colors, windows=p.windows, parts=p.parts)


@panel("acceptance", "Acceptance (vLLM's definition)", depends={"highlight"}, per_step=False,
       step_marker=fg.acceptance_step_marker)
def acceptance(p: PanelInput) -> dict:
    return fg.acceptance_spec(p.acceptance, step=None, highlight=p.highlight, colors=p.colors)
