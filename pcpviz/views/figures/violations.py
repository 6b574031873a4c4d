"""Violation routing: which panel a violated trace view is drawn on (its ``panel`` in the
schema), the banner texts of the ``pcpviz.analysis.checks`` violations at a (step, rank), and the red
banner itself.

PCP=2 example: a ``slot_mapping_draft`` violation of ``draft_1`` at step 3, rank 0 is marked on
the slot-mapping panel at step 3, rank 0 — only while the draft panels show ``draft_1``.
"""

from __future__ import annotations

from typing import Any, Iterable

import plotly.graph_objects as go

from pcpviz.views.figures.canvas import FLAG_COLOR
from pcpviz.trace.errors import MALFORMED
from pcpviz.trace.schema import view_panel

__all__ = ["violation_view", "violation_marks", "mark_violation"]


def violation_view(view: str | None, phase: str | None = None) -> str:
    """The panel (``token_order``, ``timeline``, ``block_tables``, ``slot_mappings``) a violated
    trace view is drawn on: its ``panel`` in the schema."""
    return view_panel(view, phase)


def violation_marks(violations: Iterable[Any], panel: str, *, step: int, rank: int,
                    draft_phase: str | None, shows_draft_phase: bool = False) -> list[str]:
    """Banner texts for the ``pcpviz.analysis.checks`` violations located on ``panel`` at (step,
    rank); on a panel that ``shows_draft_phase`` (block tables, slot mappings: see
    ``pcpviz.views.panels``) a violation of a draft phase's view is marked only while it shows
    that draft phase (``draft_phase``)."""
    out = []
    for v in violations:
        if v.step != step or (v.rank is not None and v.rank != rank) or violation_view(v.view, v.phase) != panel:
            continue
        if shows_draft_phase and v.phase and v.phase.startswith("draft_") and v.phase != draft_phase:
            continue
        out.append(f"{v.check}: {v.message} ({v.where()})")
    return out


def mark_violation(fig: go.Figure | dict, text: str) -> go.Figure | dict:
    """Add a red banner to ``fig`` (a check's violation located on this view). A ``go.Figure`` is
    changed in place; a spec (plain dict) is returned as a new spec, the given one left as it was
    (the Workbench caches specs)."""
    from pcpviz.views.figures.canvas import safe_text

    ann = dict(text="✗ " + safe_text(text), xref="paper", yref="paper", x=0, y=1, xanchor="left", yanchor="bottom",
               yshift=28, showarrow=False, align="left", font=dict(color="#fff", size=12), bgcolor=FLAG_COLOR)
    if isinstance(fig, dict):
        layout = fig["layout"]
        return {**fig, "layout": {**layout, "annotations": [*layout.get("annotations", ()), ann]}}
    fig.layout.annotations = tuple(fig.layout.annotations) + (ann,)
    return fig



def message_spec(text: str, *, height: int = 120) -> dict:
    """A figure spec holding only a title (a view that cannot be drawn for this step)."""
    from pcpviz.views.figures.canvas import TEMPLATE, safe_text

    return {"data": [], "layout": {"template": TEMPLATE, "height": height, "title": {"text": safe_text(text)},
                                   "shapes": [], "annotations": []}}


def drawn(view: str, build, *, step: int, rank: int, recs=None):
    """``build()``, or a ``message_spec`` naming the view, step and rank when a view it reads is
    missing or malformed (a producer that records fewer views, or a damaged one); a
    ``TraceError`` (a payload failing its crc32) still raises. PCP=2 example: a target record
    whose ``kv_write_mask`` is [1, 2P] instead of [2P] gives the title ``token_order: cannot
    draw step 4 rank 1 (malformed views?): IndexError: too many indices ...``. ``recs`` (the step's ``{phase: record}``): when
    given, a step breaking a bound (``pcpviz.trace.bounds``) is a message before ``build`` runs."""
    from pcpviz.trace import TraceError

    if recs is not None:
        from pcpviz.trace.bounds import step_problems

        problems = step_problems(recs)
        if problems:
            return message_spec(f"{view}: cannot draw step {step} rank {rank}: malformed views: "
                                f"{problems[0][:160]}")
    try:
        return build()
    except TraceError:
        raise
    except KeyError as exc:
        return message_spec(f"{view}: cannot draw step {step} rank {rank}: view {exc} not recorded")
    except MALFORMED as exc:
        return message_spec(f"{view}: cannot draw step {step} rank {rank} (malformed views?): "
                            f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
