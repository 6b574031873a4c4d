"""The acceptance view: rate per draft position (vLLM's definition), per request and per step,
drawn from ``pcpviz.analysis.acceptance`` (the one implementation).

PCP=2, K=2 example: 10 drafts of which position 0 was accepted 7 times and position 1 4 times
draw bars 0.7 and 0.4 (text ``7/10``, ``4/10``); mean acceptance length 1 + 11/10 = 2.1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

import numpy as np
import plotly.graph_objects as go

from pcpviz.analysis.acceptance import Acceptance, Counts, acceptance, acceptance_from_records, ratio
from pcpviz.views.figures.canvas import DIM_COLOR, Canvas, as_figure, request_color, request_color_index
from pcpviz.trace import Record, TraceError

__all__ = ["AcceptanceStats", "acceptance_stats", "trace_acceptance", "load_acceptance", "from_diff_acceptance",
           "acceptance_spec", "acceptance_figure", "acceptance_step_marker"]


@dataclass(frozen=True)
class AcceptanceStats:
    """A run's acceptance as the figure draws it: ``pcpviz.analysis.acceptance.Acceptance`` (vLLM's
    definitions, NaN when nothing was drafted) as arrays per position, request and step."""

    num_speculative_tokens: int
    num_drafts: int
    accepted_per_pos: np.ndarray  # int64[K]
    req_ids: tuple[str, ...]
    req_num_drafts: np.ndarray  # int64[R]: request-steps with drafts
    req_draft_tokens: np.ndarray  # int64[R]
    req_accepted: np.ndarray  # int64[R]
    steps: np.ndarray  # int64[S]
    step_draft_tokens: np.ndarray  # int64[S]
    step_accepted: np.ndarray  # int64[S]
    source: str = "pcpviz.analysis.acceptance"
    rank: int = 0
    extra: dict = field(default_factory=dict)
    note: str = ""  # why nothing is counted, when a malformed verify record stopped the count

    @property
    def counts(self) -> Counts:
        return Counts(self.num_drafts, int(self.req_draft_tokens.sum()), int(self.req_accepted.sum()),
                      tuple(int(x) for x in self.accepted_per_pos))

    @property
    def rate_per_pos(self) -> np.ndarray:
        return np.array(self.counts.rate_per_position, dtype=float)

    @property
    def acceptance_rate(self) -> float:
        return self.counts.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.counts.mean_acceptance_length

    @property
    def req_rate(self) -> np.ndarray:
        return np.array([ratio(int(a), int(d)) for a, d in zip(self.req_accepted, self.req_draft_tokens)],
                        dtype=float)


def acceptance_stats(verify_records: Iterable[tuple[int, Record]], num_speculative_tokens: int) -> AcceptanceStats:
    """``AcceptanceStats`` from ``(step, verify record)`` pairs."""
    return from_diff_acceptance(acceptance_from_records(verify_records, k=int(num_speculative_tokens)))


def trace_acceptance(trace: Any, rank: int | None = None, *, report: Any = None) -> AcceptanceStats:
    """Acceptance of a whole trace from one rank's ``verify`` phases (default: the first rank);
    ``report``: a check report whose pass counted it (``AcceptanceFold``), else read here."""
    folded = None if report is None else getattr(report, "folds", {}).get("acceptance")
    return from_diff_acceptance(acceptance(trace, rank=rank, folded=folded))


def load_acceptance(trace: Any) -> AcceptanceStats:
    """Acceptance of ``trace`` (``pcpviz.analysis.acceptance.acceptance``, the first rank's verify)
    for the Workbench. A malformed verify record leaves nothing counted and says why in
    ``note``, so the Workbench still opens (``trace_acceptance`` raises instead, as the HTML
    export and diff do: one line, exit 2): e.g. ``step 3: verify: malformed
    acceptance counts: request row 0 carries 9223372036854775807 draft tokens, more than K = 2``."""
    try:
        return trace_acceptance(trace)
    except TraceError:
        raise
    except ValueError as exc:
        empty = acceptance_from_records(())
        return replace(from_diff_acceptance(empty), note=" ".join(str(exc).split()))


def from_diff_acceptance(acc: Acceptance) -> AcceptanceStats:
    """``pcpviz.analysis.acceptance.Acceptance`` as the ``AcceptanceStats`` the figures draw."""
    reqs = list(acc.per_request.values())
    steps = list(acc.per_step)
    i64 = lambda xs: np.array(list(xs), dtype=np.int64)  # noqa: E731
    return AcceptanceStats(
        num_speculative_tokens=int(acc.num_speculative_tokens),
        num_drafts=int(acc.num_drafts),
        accepted_per_pos=i64(acc.accepted_per_position),
        req_ids=tuple(r.req_id for r in reqs),
        req_num_drafts=i64(r.num_drafts for r in reqs),
        req_draft_tokens=i64(r.num_draft_tokens for r in reqs),
        req_accepted=i64(r.num_accepted_tokens for r in reqs),
        steps=i64(st.step for st in steps),
        step_draft_tokens=i64(st.num_draft_tokens for st in steps),
        step_accepted=i64(st.num_accepted_tokens for st in steps),
        rank=acc.rank if acc.rank is not None else 0,
    )



def acceptance_step_marker(step: int | None) -> list[dict]:
    """Layout shapes marking ``step`` on the per-step acceptance panel (x3/y3)."""
    if step is None:
        return []
    return [dict(type="rect", xref="x3", yref="y3 domain", x0=step - 0.5, x1=step + 0.5, y0=0, y1=1,
                 fillcolor="rgba(0,0,0,0.10)", line=dict(color="#111", width=1.5), name="current step")]


def _gaps(x: np.ndarray) -> list:
    return [None if np.isnan(v) else float(v) for v in np.asarray(x, dtype=float)]


def _num(x: float, digits: int) -> str:
    return "-" if np.isnan(x) else f"{x:.{digits}f}"


def acceptance_spec(stats: AcceptanceStats, *, step: int | None = None, highlight: str | None = None,
                    colors: Mapping[str, int] | None = None) -> dict:
    """Acceptance rate per draft position (text = accepted / drafts), per request (accepted /
    drafted tokens) and accepted tokens per step (the current step shaded)."""
    k = stats.num_speculative_tokens
    fig = Canvas([[1, 1, 1]], column_widths=[0.26, 0.32, 0.42], horizontal_spacing=0.07,
                  subplot_titles=(f"rate per draft position ({stats.num_drafts} drafts)",
                                  "per request (accepted / drafted tokens)",
                                  "per step: drafted vs accepted tokens"))
    rates = _gaps(stats.rate_per_pos)  # NaN (nothing drafted) is a gap, and JSON-safe
    fig.add(dict(type="bar", x=[f"pos {j}" for j in range(k)], y=rates, marker=dict(color="#1f77b4"),
                 text=[f"{a}/{stats.num_drafts}" for a in stats.accepted_per_pos], textposition="outside",
                 hovertemplate="%{x}: rate %{y:.3f}<extra></extra>", name="rate per position", showlegend=False),
            1, 1)
    fig.axis("y", 1, 1, range=[0, 1.15], title=dict(text="acceptance rate"))
    cidx = colors or request_color_index(stats.req_ids)
    rc = [request_color(cidx.get(r, i)) if highlight in (None, r) else DIM_COLOR for i, r in enumerate(stats.req_ids)]
    fig.add(dict(type="bar", x=list(stats.req_ids), y=_gaps(stats.req_rate),
                 marker=dict(color=rc, line=dict(color=["#111" if r == highlight else "rgba(0,0,0,0)"
                                                        for r in stats.req_ids], width=2)),
                 text=[f"{a}/{d}" for a, d in zip(stats.req_accepted, stats.req_draft_tokens)],
                 textposition="outside", showlegend=False, name="per request",
                 hovertemplate="%{x}: %{y:.3f}<extra></extra>"), 1, 2)
    fig.axis("y", 1, 2, range=[0, 1.15])
    fig.add(dict(type="bar", x=stats.steps, y=stats.step_draft_tokens, name="drafted",
                 marker=dict(color="#c7c7c7")), 1, 3)
    fig.add(dict(type="bar", x=stats.steps, y=stats.step_accepted, name="accepted",
                 marker=dict(color="#2ca02c")), 1, 3)
    fig.axis("x", 1, 3, title=dict(text="step"))
    fig.shapes.extend(acceptance_step_marker(step))
    return fig.spec(
        barmode="overlay", bargap=0.15, height=330, margin=dict(l=60, r=20, t=80, b=40),
        title=dict(text=_title(stats), font=dict(size=13)),
        legend=dict(orientation="h", x=1, xanchor="right", y=1.22), showlegend=True,
    )


def _title(stats: AcceptanceStats) -> str:
    if stats.note:
        return f"acceptance: not counted: {stats.note}"  # escaped with the rest (Canvas.spec)
    return (f"acceptance: mean length {_num(stats.mean_acceptance_length, 2)}, "
            f"rate {_num(stats.acceptance_rate, 3)} (mean over draft positions; rank {stats.rank}'s verify)")


def acceptance_figure(stats: AcceptanceStats, *, step: int | None = None, highlight: str | None = None,
                      colors: Mapping[str, int] | None = None) -> go.Figure:
    """``acceptance_spec`` as a ``go.Figure``."""
    return as_figure(acceptance_spec(stats, step=step, highlight=highlight, colors=colors))
