"""What ``pcpviz.analysis.diff.diff_traces`` reports: each ``Divergence`` (step, phase, view,
ranks, request, first differing index, run A's and run B's values) and the ``DiffReport`` (the
first divergence, counts, notes, both runs' acceptance side by side).

A PCP=2 divergence reads ``step 3, phase target, view positions, rank 0, request req1, index
[5]: values differ; a [3:8]=[..., *7, ...], b [3:8]=[..., *9, ...]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pcpviz.analysis.acceptance import Acceptance

__all__ = ["Divergence", "DiffReport"]


# --------------------------------------------------------------------------- divergences

@dataclass(frozen=True)
class Divergence:
    """Where run B first differs from run A (expected = A, actual = B)."""

    step: int
    phase: str | None
    view: str | None
    rank_a: int | None
    rank_b: int | None
    message: str
    req_id: str | None = None
    index: tuple[int, ...] | None = None  # into run A's (request-aligned) view
    expected: str | None = None
    actual: str | None = None

    def describe(self) -> str:
        parts = [f"step {self.step}"]
        if self.phase is not None:
            parts.append(f"phase {self.phase}")
        if self.view is not None:
            parts.append(f"view {self.view}")
        if self.rank_a is not None or self.rank_b is not None:
            parts.append(f"rank {self.rank_a}" if self.rank_a == self.rank_b
                         else f"rank {self.rank_a} (a) / {self.rank_b} (b)")
        if self.req_id is not None:
            parts.append(f"request {self.req_id}")
        if self.index is not None:
            parts.append(f"index {list(self.index)}")
        out = ", ".join(parts) + f": {self.message}"
        if self.expected is not None or self.actual is not None:
            out += f"; a {self.expected}, b {self.actual}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "view": self.view, "rank_a": self.rank_a,
                "rank_b": self.rank_b, "req_id": self.req_id,
                "index": None if self.index is None else list(self.index), "message": self.message,
                "expected": self.expected, "actual": self.actual}


@dataclass(frozen=True)
class DiffReport:
    a: str
    b: str
    same: bool
    first: Divergence | None
    divergences: tuple[Divergence, ...]  # the first one per (step, phase, view), capped
    num_divergent_views: int  # every (step, phase, view, rank pair) that differs
    steps_compared: int
    views_compared: int
    local_views_compared: bool
    notes: tuple[str, ...]
    acceptance_a: Acceptance
    acceptance_b: Acceptance

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "same": self.same,
                "first": None if self.first is None else self.first.to_dict(),
                "divergences": [d.to_dict() for d in self.divergences],
                "num_divergent_views": self.num_divergent_views, "steps_compared": self.steps_compared,
                "views_compared": self.views_compared, "local_views_compared": self.local_views_compared,
                "notes": list(self.notes), "acceptance": {"a": self.acceptance_a.to_dict(),
                                                          "b": self.acceptance_b.to_dict()}}

    def format(self, max_divergences: int = 10) -> str:
        lines = ["pcpviz diff", f"  a: {self.a}", f"  b: {self.b}",
                 f"  compared {self.steps_compared} steps, {self.views_compared} views"
                 f" ({'global and local' if self.local_views_compared else 'global only'})"]
        for note in self.notes:
            lines.append(f"  note: {note}")
        if self.same:
            lines.append("  result: SAME")
        else:
            lines.append(f"  result: DIFFER ({self.num_divergent_views} divergent views)")
            lines.append(f"  first divergence: {self.first.describe()}")
            for d in self.divergences[1:max_divergences]:
                lines.append(f"    then: {d.describe()}")
            if len(self.divergences) > max_divergences:
                lines.append(f"    ... {len(self.divergences) - max_divergences} more")
        lines.append(_acceptance_table(self.acceptance_a, self.acceptance_b))
        return "\n".join(lines)


def _num(x: float, digits: int = 3) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def _acceptance_table(a: Acceptance, b: Acceptance) -> str:
    rows = [("acceptance (vLLM definitions)", "a", "b"),
            ("num_drafts", str(a.num_drafts), str(b.num_drafts)),
            ("num_draft_tokens", str(a.num_draft_tokens), str(b.num_draft_tokens)),
            ("num_accepted_tokens", str(a.num_accepted_tokens), str(b.num_accepted_tokens)),
            ("acceptance rate", _num(a.acceptance_rate), _num(b.acceptance_rate)),
            ("mean acceptance length", _num(a.mean_acceptance_length), _num(b.mean_acceptance_length))]
    for k in range(max(len(a.accepted_per_position), len(b.accepted_per_position))):
        cell = lambda acc: (f"{_num(acc.rate_per_position[k])} ({acc.accepted_per_position[k]})"  # noqa: E731
                            if k < len(acc.accepted_per_position) else "-")
        rows.append((f"position {k}: rate (accepted)", cell(a), cell(b)))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"  {r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}" for r in rows)
