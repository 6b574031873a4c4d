"""``run_checks(trace) -> CheckReport``: every check over every (step, rank), one step of history
kept. The checks run, and are reported, in ``CHECK_MODULES`` order, then definition order."""

from __future__ import annotations

import os
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping

from pcpviz.trace import Trace
from pcpviz.trace import open as open_trace
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.validate import trusted_meta
from pcpviz.trace.validate import validate as validate_trace

from . import layout_checks  # noqa: I001 - each import registers its checks
from . import draft_checks
from . import handoff_checks
from . import step_checks
from . import graph_checks
from .context import DEFS, Config, Fail, Skip, Ctx, StepView
from .report import FAIL, PASS, SKIPPED, CheckReport, CheckResult, Violation

CHECK_MODULES = (layout_checks, draft_checks, handoff_checks, graph_checks, step_checks)
"""Where the checks are defined, in report order."""

ORDERED_DEFS = tuple(d for m in CHECK_MODULES for d in DEFS if d.fn.__module__ == m.__name__)
"""Every registered check: by ``CHECK_MODULES``, then in definition order."""

CHECKS: Mapping[str, str] = MappingProxyType({d.name: d.description for d in ORDERED_DEFS})
"""Every check name -> its one-line meaning, in the order they run and are reported."""

class _Stats:
    __slots__ = ("evaluated", "failed", "skipped", "skip_reason", "first", "where")

    def __init__(self) -> None:
        self.evaluated = self.failed = self.skipped = 0
        self.skip_reason: str | None = None
        self.first: Violation | None = None
        self.where: list[tuple[int, int]] = []  # failing (step, rank)


def _meta_summary(meta: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "shard_decode_requests",
            "model", "vllm_version")
    return {k: meta.get(k) for k in keys if k in meta}


def _run_one(d, ctx: Ctx, st: _Stats, memo: list) -> None:
    """Run check ``d`` on one (step, rank), or replay the outcome it had on another rank of the
    step when this rank's reads give the same arrays (``Ctx.replays``)."""
    for log, skip in memo:
        if ctx.replays(log):
            if skip is None:
                st.evaluated += 1
            else:
                st.skipped += 1
                if st.skip_reason is None:
                    st.skip_reason = f"step {ctx.step} rank {ctx._rank}: {skip}"
            return
    step, r = ctx.step, ctx._rank
    try:
        d.fn(ctx)
        st.evaluated += 1
        outcome: tuple | None = (None,)
    except Skip as s:
        st.skipped += 1
        if st.skip_reason is None:
            st.skip_reason = f"step {step} rank {r}: {s}"
        outcome = (str(s),)
    except Fail as f:
        st.evaluated += 1
        st.failed += 1
        st.where.append((step, r))
        if st.first is None:
            st.first = Violation(**f.kw)
        outcome = None
    except (IndexError, ValueError, TypeError, KeyError) as exc:
        st.evaluated += 1
        st.failed += 1
        st.where.append((step, r))
        if st.first is None:
            msg = " ".join(str(exc).split())
            st.first = Violation(d.name, step, r, None, None,
                                 f"could not evaluate (malformed views?): {type(exc).__name__}: {msg}")
        outcome = None
    if outcome is not None and not ctx.local and len(memo) < 2:
        memo.append((ctx._log, outcome[0]))


def _check_step(trace: Trace, step: int, prev: StepView | None, defs: list, cfg: Config,
                stats: dict[str, _Stats], rank_steps: Mapping[int, set], last: Mapping[int, int | None]) -> StepView:
    """Every check on every rank of one step; returns the step's view (the next one's history)."""
    ranks = trace.ranks
    recs = {}
    for r in ranks:
        if step in rank_steps[r]:
            recs[r] = {ph: trace.record(step, r, ph) for ph in trace.phases(step, r)}
    missing = tuple(r for r in ranks if step not in rank_steps[r] and last[r] is not None and last[r] > step)
    sv = StepView(step, recs, prev, missing)
    memo: dict = {}
    for r in recs:  # a malformed (step, rank) is reported by views_in_bounds only
        sv.cache[("bounds", r)] = step_problems(recs[r], memo=memo)
    memos: dict[str, list] = {d.name: [] for d in defs}
    for r in recs:
        malformed = sv.cache[("bounds", r)]
        for d in defs:
            st = stats[d.name]
            if malformed and d.name != "views_in_bounds":
                st.skipped += 1
                if st.skip_reason is None:
                    st.skip_reason = f"step {step} rank {r}: malformed views (views_in_bounds)"
                continue
            _run_one(d, Ctx(cfg, sv, r, d.name), st, memos[d.name])
    return sv


def run_checks(trace: Trace | str | os.PathLike, *, checks: list[str] | str | None = None,
               status: Any = None, visit: Callable[[StepView], None] | None = None) -> CheckReport:
    """Run every check (or the named ones) over every step and rank of ``trace``.

    ``trace`` is a ``pcpviz.trace.Trace`` or a run directory (opened with
    ``pcpviz.trace.open``; a ``TraceError`` propagates). A check whose inputs a step lacks is
    skipped there; a check that could run on no step at all gets the verdict ``skipped``.
    ``report.status`` is ``pcpviz.trace.validate(trace)`` (or ``status``, when the caller has
    it already): an invalid run.json or an incomplete trace (lost steps, missing ranks) makes
    ``report.ok`` false even when every check passes. Memory does not grow with the steps:
    one step of history is kept. ``visit(step_view)``, if given, sees each step's records on
    every rank (``StepView.recs``) after its checks: another pass over the same steps, free.
    """
    t0 = time.perf_counter()
    if not isinstance(trace, Trace):
        trace = open_trace(trace)
    defs = list(ORDERED_DEFS)
    if isinstance(checks, str):  # one name, not its letters
        checks = [checks]
    if checks is not None:
        unknown = [n for n in checks if n not in CHECKS]
        if unknown:
            raise ValueError(f"unknown check {unknown[0]!r}; known: {', '.join(CHECKS)}")
        defs = [d for d in ORDERED_DEFS if d.name in set(checks)]
    if status is None:
        status = validate_trace(trace)  # run.json schema, run.json vs the data, completeness
    cfg = Config.from_meta(trusted_meta(trace.meta, status))
    stats = {d.name: _Stats() for d in defs}
    rank_steps = {r: set(trace.rank_steps(r)) for r in trace.ranks}
    last = {r: max(rank_steps[r], default=None) for r in trace.ranks}
    prev: StepView | None = None
    for step in trace.steps:
        sv = _check_step(trace, step, prev, defs, cfg, stats, rank_steps, last)
        if visit is not None:
            visit(sv)
        if prev is not None:
            prev.prev = None  # keep only one step of history
        prev = sv
    return _report(trace, defs, stats, status, time.perf_counter() - t0)


def _report(trace: Trace, defs: list, stats: dict[str, _Stats], status: Any, seconds: float) -> CheckReport:
    results = {}
    for d in defs:
        st = stats[d.name]
        if st.failed:
            verdict = FAIL
        elif st.evaluated:
            verdict = PASS
        else:
            verdict = SKIPPED
        reason = st.skip_reason if st.skip_reason is not None or trace.steps else "the trace has no steps"
        results[d.name] = CheckResult(d.name, d.description, verdict, st.evaluated, st.failed,
                                      st.skipped, reason, st.first, tuple(st.where))
    return CheckReport(str(trace.path), MappingProxyType(_meta_summary(trace.meta)), len(trace.steps),
                       tuple(trace.ranks), MappingProxyType(results), seconds, status)
