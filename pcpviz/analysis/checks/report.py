"""The records a check run answers with: ``Violation`` (where a check first found the trace
wrong), ``CheckResult`` (one check over the whole trace) and ``CheckReport`` (all of them, with
the trace's completeness status)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from pcpviz.trace.schema import causal_phase_key
from pcpviz.trace.validate import TraceStatus

__all__ = ["PASS", "FAIL", "SKIPPED", "Violation", "CheckResult", "CheckReport", "violation_order"]

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


@dataclass(frozen=True)
class Violation:
    """The first place a check found the trace wrong."""

    check: str
    step: int
    rank: int | None
    phase: str | None
    view: str | None
    message: str
    index: tuple[int, ...] | None = None  # first differing index into the recorded view
    expected: str | None = None  # short repr (a window around ``index``)
    actual: str | None = None

    def where(self) -> str:
        parts = [f"step {self.step}"]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.phase is not None:
            parts.append(f"phase {self.phase}")
        if self.view is not None:
            parts.append(f"view {self.view}")
        if self.index is not None:
            parts.append(f"index {list(self.index)}")
        return ", ".join(parts)

    def describe(self) -> str:
        out = f"{self.where()}: {self.message}"
        if self.expected is not None or self.actual is not None:
            out += f"; expected {self.expected}, actual {self.actual}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "step": self.step, "rank": self.rank, "phase": self.phase,
                "view": self.view, "index": None if self.index is None else list(self.index),
                "message": self.message, "expected": self.expected, "actual": self.actual}


def violation_order(v: Violation) -> tuple:
    """Sort key of a violation in causal order: (step, phase in the step, rank)."""
    return (v.step, (0, 0) if v.phase is None else causal_phase_key(v.phase), -1 if v.rank is None else v.rank)


@dataclass(frozen=True)
class CheckResult:
    """One check over the whole trace."""

    name: str
    description: str
    verdict: str  # PASS | FAIL | SKIPPED (ran on no (step, rank))
    evaluated: int  # (step, rank) pairs the check ran on
    failed: int  # of those, how many had a violation
    skipped: int  # (step, rank) pairs where an input was missing
    skip_reason: str | None  # the first reason, "step S rank R: no <view>"
    first_violation: Violation | None
    failures: tuple[tuple[int, int], ...] = ()  # every failing (step, rank), in step order

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "verdict": self.verdict,
                "evaluated": self.evaluated, "failed": self.failed, "skipped": self.skipped,
                "skip_reason": self.skip_reason,
                "first_violation": None if self.first_violation is None else self.first_violation.to_dict(),
                "failures": [list(x) for x in self.failures]}


@dataclass(frozen=True)
class CheckReport:
    """``run_checks``'s answer: one ``CheckResult`` per check, in catalogue order."""

    trace: str
    meta: Mapping[str, Any]  # the run.json keys that matter to the checks
    steps: int
    ranks: tuple[int, ...]
    results: Mapping[str, CheckResult]
    seconds: float
    status: TraceStatus = TraceStatus()  # pcpviz.trace.validate: run.json valid, trace complete
    probe: Any = None  # run_checks' probe: its first answer that is not None (in step order)
    folds: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # run_checks' folds (StepFold)

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks do not count as failures) and the trace is whole
        with a valid run.json (``status``)."""
        return not self.failed and self.status.ok

    @property
    def complete(self) -> bool:
        """No data lost (``status.complete``): every rank readable, every step on every rank."""
        return self.status.complete

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == FAIL]

    @property
    def passed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == PASS]

    @property
    def skipped(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == SKIPPED]

    @property
    def first_violation(self) -> Violation | None:
        """The earliest violation over all checks: the first wrong view, by step, then the phase's
        place in the step (target, verify, draft_0, draft_1, ...), then rank, then catalogue
        order; ``explain``'s primary evidence."""
        found = [r.first_violation for r in self.results.values() if r.first_violation is not None]
        if not found:
            return None
        return min(found, key=violation_order)

    def __getitem__(self, name: str) -> CheckResult:
        return self.results[name]

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "ok": self.ok, "meta": dict(self.meta), "steps": self.steps,
                "ranks": list(self.ranks), "seconds": round(self.seconds, 4),
                "summary": {"passed": len(self.passed), "failed": len(self.failed),
                            "skipped": len(self.skipped)},
                **self.status.to_dict(),
                "checks": {n: r.to_dict() for n, r in self.results.items()}}

    def format(self) -> str:
        """A text report: one line per check, the first violation under each failure."""
        m = self.meta
        lines = [f"pcpviz check {self.trace}",
                 f"  producer {m.get('producer')}, pcp {m.get('pcp')}, dcp {m.get('dcp')}, "
                 f"K {m.get('num_speculative_tokens')}, block_size {m.get('block_size')}, "
                 f"{self.steps} steps, ranks {list(self.ranks)}"]
        width = max((len(n) for n in self.results), default=10)
        for name, r in self.results.items():
            total = r.evaluated + r.skipped
            if r.verdict == FAIL:
                lines.append(f"  FAIL  {name:<{width}}  {r.failed} of {r.evaluated} (step, rank) failed")
                lines.append(f"        first: {r.first_violation.describe()}")
            elif r.verdict == PASS:
                extra = f"; skipped {r.skipped} ({r.skip_reason})" if r.skipped else ""
                lines.append(f"  PASS  {name:<{width}}  {r.evaluated}/{total} (step, rank){extra}")
            else:
                lines.append(f"  SKIP  {name:<{width}}  ran on 0 of {total} (step, rank): {r.skip_reason}")
        lines += [f"  {line}" for line in self.status.lines()]
        verdict = ("INCOMPLETE" if not self.status.complete else "INVALID" if not self.status.valid
                   else "FAIL" if self.failed else "OK")
        lines.append(f"  result: {verdict}: {self.counts_line()} in {self.seconds:.2f} s")
        return "\n".join(lines)

    def counts_line(self) -> str:
        """``"26 checks: 24 passed, 1 failed, 1 skipped; 2 passing checks did not run on 3 (step, rank)"``: counts
        of checks (a failed or skipped count of 0 is left out; skipped = ran on no step), then how
        many passing checks could not run on some (step, rank) pairs and on how many in all."""
        partial = [r for r in self.results.values() if r.verdict == PASS and r.skipped]
        pairs = sum(r.skipped for r in partial)
        parts = [f"{len(self.passed)} passed"] + [f"{n} {what}" for n, what in (
            (len(self.failed), "failed"), (len(self.skipped), "skipped")) if n]
        note = (f"; {len(partial)} passing check{'s' * (len(partial) > 1)} did not run on {pairs} (step, rank)"
                if partial else "")
        return f"{len(self.results)} checks: " + ", ".join(parts) + note
