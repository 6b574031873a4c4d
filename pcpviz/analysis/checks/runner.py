"""``run_checks(trace) -> CheckReport``: every check over every (step, rank), one step of history
kept. The checks run, and are reported, in ``CHECK_MODULES`` order, then definition order."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pcpviz.analysis.parallel import chunk_bounds, default_workers, forked_imap
from pcpviz.trace import Trace
from pcpviz.trace import open as open_trace
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.meta_model import RunMeta
from pcpviz.trace.validate import trusted_meta
from pcpviz.trace.validate import validate as validate_trace

from . import layout_checks  # noqa: I001 - each import registers its checks
from . import draft_checks
from . import handoff_checks
from . import step_checks
from . import graph_checks
from . import collective_checks, consumed_checks, dcp_checks
from .columns import Block, bulk_mode, decide, decide_arrays
from .context import DEFS, Fail, Skip, Ctx, StepFold, StepView
from .report import FAIL, PASS, SKIPPED, CheckReport, CheckResult, Violation
from .token_columns import token_counts_ok

CHECK_MODULES = (layout_checks, draft_checks, handoff_checks, consumed_checks, graph_checks, collective_checks,
                 dcp_checks, step_checks)
"""Where the checks are defined, in report order."""

ORDERED_DEFS = tuple(d for m in CHECK_MODULES for d in DEFS if d.fn.__module__ == m.__name__)
"""Every registered check: by ``CHECK_MODULES``, then in definition order."""

CHECKS: Mapping[str, str] = MappingProxyType({d.name: d.description for d in ORDERED_DEFS})
"""Every check name -> its one-line meaning, in the order they run and are reported."""

BLOCK_STEPS = 256
"""Steps read at once, at most: the bulk rules' columns span them (memory: their records)."""

BLOCK_BYTES = 16 << 20
"""Bytes of record batches a block holds, at most (``Trace.step_bytes``; past them the block ends
after its step): a block of large steps (a long prompt, PCP=64) is a few steps, or one."""


BULK_MIN_STEPS = 64
"""Blocks of fewer steps are checked per step: the rules' fixed cost (per rule, rank and block)
pays over many steps (a PCP=64 trace of 40 steps is checked as fast per step)."""

BULK_RANK_STEP_BYTES = 1 << 20
"""Bytes of record batch per (step, rank) past which a block is checked per step (no bulk rules): the
rules pay on many small steps, while a step of a million tokens is checked as fast per step,
where a rank-independent check is judged once a step."""


CHUNKS_PER_WORKER = 8
"""Runs of steps per worker process (``chunk_bounds``): on a machine shared with other jobs a
slowed worker leaves at most one short run for the others to wait on, not a quarter of the trace."""


CHUNK_MIN_STEPS = 8
"""Steps a run of steps has at least, where the trace has few (a PCP=64 trace of 40 steps checked
by the HTML export in two processes: two runs per worker, not eight): each run reads the step
before it again, as its history."""


class _Stats:
    __slots__ = ("evaluated", "failed", "skipped", "skip_reason", "first", "where")

    def __init__(self) -> None:
        self.evaluated = self.failed = self.skipped = 0
        self.skip_reason: str | None = None
        self.first: Violation | None = None
        self.where: list[tuple[int, int]] = []  # failing (step, rank)


def _meta_summary(meta: RunMeta) -> dict[str, Any]:
    keys = ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "shard_decode_requests",
            "model", "vllm_version")
    return {k: meta.recorded_value(k) for k in keys if k in meta.recorded}


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


def _step_view(trace: Trace, step: int, prev: StepView | None, rank_steps: Mapping[int, set],
               last: Mapping[int, int | None], *, defer: bool = False) -> StepView:
    """One step's records on every rank that has it, with each rank's bounds problems cached
    (``views_in_bounds``; a malformed (step, rank) is reported by that check only). ``defer``:
    where the rows are within bounds (``rows_clean``) the token counts are left to judge
    (``_PENDING``, ``_settle_token_counts``)."""
    recs, clean = {}, {}
    for r in trace.ranks:
        if step in rank_steps[r]:
            recs[r], clean[r] = trace.step_records_clean(step, r)  # every phase, one pass over the batch
    missing = tuple(r for r in trace.ranks if step not in rank_steps[r] and last[r] is not None and last[r] > step)
    sv = StepView(step, recs, prev, missing)
    memo: dict = {}
    for r in recs:
        sv.cache[("bounds", r)] = _PENDING if defer and clean[r] else step_problems(recs[r], memo=memo, clean=clean[r])
    return sv


_PENDING = ("the token counts are left to judge",)
"""A step's bounds problems while only its token counts are left to judge (``_step_view``'s
``defer``): ``_settle_token_counts`` replaces it before any check reads it."""


def _settle_token_counts(b: Block, ranks: Sequence[int], *, bulk: bool) -> None:
    """Replace each ``_PENDING`` of the block: no problem where ``token_counts_ok`` says the
    token counts agree (``bulk``), else ``step_problems``' word (the rows are clean). With
    ``PCPVIZ_BULK=verify``, AssertionError where the two disagree."""
    ok = {}
    verify = bulk_mode() == "verify"
    if bulk:
        for r in ranks:
            try:
                ok[r] = token_counts_ok(b, r)
            except Exception:  # noqa: BLE001 - undecided: judged step by step
                pass
    for i, sv in enumerate(b.svs):
        memo: dict = {}
        for r, rec in sv.recs.items():
            if sv.cache[("bounds", r)] is _PENDING:
                sure = r in ok and bool(ok[r][i])
                if sure and verify:
                    said = step_problems(rec, memo=memo, clean=True)
                    if said:
                        raise AssertionError(f"token_counts_ok says step {sv.step} rank {r} agrees; "
                                             f"step_problems gives {said!r}")
                sv.cache[("bounds", r)] = [] if sure else step_problems(rec, memo=memo, clean=True)


def _check_step(sv: StepView, defs: list, run_meta: RunMeta, stats: dict[str, _Stats],
                sure: Mapping[str, Mapping[int, Any]] | None = None, verify: bool = False) -> None:
    """Every check on every rank of one step; ``sure[name][rank]``: True where the check's bulk
    rule says it passes, a reason where its skip rule says it skips (counted, not run;
    ``verify``: run anyway, and the rule's word checked)."""
    memos: dict[str, list] = {d.name: [] for d in defs}
    for r in sv.recs:
        malformed = sv.cache[("bounds", r)]
        for d in defs:
            st = stats[d.name]
            if malformed and d.name != "views_in_bounds":
                _skip(st, sv.step, r, "malformed views (views_in_bounds)")
                continue
            said = None if sure is None else sure.get(d.name, {}).get(r)
            if verify and said is not None:
                _verify_rule(d, Ctx(run_meta, sv, r, d.name), said)
            if said is True:
                st.evaluated += 1
            elif said is not None:
                _skip(st, sv.step, r, said)
            else:
                _run_one(d, Ctx(run_meta, sv, r, d.name), st, memos[d.name])


def _skip(st: Any, step: int, rank: int, why: str) -> None:
    """Count a skip of a check on (``step``, ``rank``); the first one's reason is the check's."""
    st.skipped += 1
    if st.skip_reason is None:
        st.skip_reason = f"step {step} rank {rank}: {why}"


def _verify_rule(d, ctx: Ctx, said: Any) -> None:
    """``PCPVIZ_BULK=verify``: AssertionError unless check ``d`` passes (``said`` True) or skips
    with the reason ``said`` on this (step, rank)."""
    try:
        d.fn(ctx)
        got: Any = True
    except Skip as s:
        got = str(s)
    except Exception as exc:  # noqa: BLE001 - a failure or an error: not what the rule said
        got = exc
    if got != said:
        raise AssertionError(f"bulk rule of {d.name} says {said!r} at step {ctx.step} rank {ctx._rank}; "
                             f"the check gives {got!r}")


def _block_sure(b: Block, defs: list, ranks: Sequence[int]) -> list[dict]:
    """Per step of block ``b``: check name -> rank -> True or a skip reason (``columns.decide``);
    empty dicts when the rules are off or no ranks are given."""
    if bulk_mode() == "off":
        return [{} for _ in range(len(b))]
    return decide(b, [d.name for d in defs], ranks)


def _check_block(b: Block, defs: list, stats: dict[str, _Stats], *, ranks: Sequence[int]) -> None:
    """``_check_step`` on every step of ``block`` with the bulk rules' word (``decide_arrays``),
    counted in bulk: a (step, rank) runs only the checks no rule decided, in order; the passes
    the rules give are added per check at the end (counts do not depend on order; skip reasons,
    first violations and failing places are met in ``_check_step``'s order)."""
    sure, skips = decide_arrays(b, [d.name for d in defs], ranks)
    block, run_meta = b.svs, b.run_meta
    n = len(block)
    decided, todo = {}, {}
    for r in ranks:
        malformed = np.fromiter((bool(sv.cache.get(("bounds", r))) for sv in block), dtype=bool, count=n)
        dec = decided[r] = np.zeros((n, len(defs)), dtype=bool)
        for k, d in enumerate(defs):
            ok = sure.get((d.name, r))
            if ok is not None:
                dec[:, k] = ok
                stats[d.name].evaluated += int(np.count_nonzero(ok & ~malformed))
        todo[r] = [np.flatnonzero(~row).tolist() for row in dec]  # per step: the checks left to run
    for i, sv in enumerate(block):
        memos: dict[str, list] = {}
        for r in sv.recs:
            reasons = skips.get((i, r), {})
            malformed = sv.cache[("bounds", r)]
            for k in range(len(defs)) if malformed else todo[r][i]:
                d = defs[k]
                st = stats[d.name]
                why = "malformed views (views_in_bounds)" if malformed and d.name != "views_in_bounds" \
                    else reasons.get(d.name)
                if malformed and why is None and decided[r][i, k]:
                    st.evaluated += 1
                elif why is not None:
                    _skip(st, sv.step, r, why)
                else:
                    _run_one(d, Ctx(run_meta, sv, r, d.name), st, memos.setdefault(d.name, []))


def _check_steps(trace: Trace, steps: Sequence[int], before: int | None, defs: list, run_meta: RunMeta,
                 probe: Callable[[StepView], Any] | None = None, *,
                 folds: Mapping[str, StepFold] | None = None) -> tuple[dict[str, _Stats], Any, dict[str, Any]]:
    """Every check over ``steps`` (consecutive steps of the trace), ``probe``'s first non-None
    answer over them and each fold's state after them; ``before``: the step before the first, read
    as its history (None at the start of the trace). Read in blocks of ``BLOCK_STEPS`` steps or ``BLOCK_BYTES`` of
    views (the bulk rules' columns, ``columns``); the block's last step kept as the next one's
    history."""
    stats = {d.name: _Stats() for d in defs}
    rank_steps = {r: set(trace.rank_steps(r)) for r in trace.ranks}
    last = {r: max(rank_steps[r], default=None) for r in trace.ranks}
    prev = None if before is None else _step_view(trace, before, None, rank_steps, last)
    found = None
    folds = folds or {}
    states = {name: f.start() for name, f in folds.items()}
    mode = bulk_mode()
    verify = mode == "verify"
    i = 0
    while i < len(steps):
        block, held = [], 0
        while i < len(steps) and len(block) < BLOCK_STEPS and held < BLOCK_BYTES:
            prev = _step_view(trace, steps[i], prev, rank_steps, last, defer=True)
            block.append(prev)
            held += sum(trace.step_bytes(prev.step, r) for r in prev.recs)
            i += 1
        big = mode == "on" and (held > BULK_RANK_STEP_BYTES * len(block) * max(1, len(trace.ranks))
                                or len(block) < BULK_MIN_STEPS)
        b = Block(block, run_meta)
        _settle_token_counts(b, trace.ranks, bulk=mode != "off" and not big)
        if mode in ("on", "always") and not big and trace.ranks:
            _check_block(b, defs, stats, ranks=trace.ranks)
            sures: list = [None] * len(block)
        else:
            sures = _block_sure(b, defs, [] if big else trace.ranks)
        for sv, sure in zip(block, sures):
            if sure is not None:
                _check_step(sv, defs, run_meta, stats, sure, verify)
            if probe is not None and found is None:
                found = probe(sv)
            for name, f in folds.items():
                states[name] = f.add(states[name], sv)
        for sv in block:
            sv.prev = None  # keep only the block's last step (the next one's history)
    return stats, found, states


def _merge(parts: Sequence[tuple[dict[str, _Stats], Any, dict[str, Any]]], defs: list,
           folds: Mapping[str, StepFold]) -> tuple[dict[str, _Stats], Any, dict[str, Any]]:
    """Chunks' statistics in step order, as one sequential pass would have counted them, the
    first chunk's probe answer that is not None, and each fold's chunk states merged in step order."""
    out = {d.name: _Stats() for d in defs}
    found = None
    merged = {name: f.merge([p[2][name] for p in parts]) for name, f in folds.items()}
    for part, probed, _ in parts:
        found = probed if found is None else found
        for name, st in out.items():
            p = part[name]
            st.evaluated += p.evaluated
            st.failed += p.failed
            st.skipped += p.skipped
            st.skip_reason = st.skip_reason if st.skip_reason is not None else p.skip_reason
            st.first = st.first if st.first is not None else p.first
            st.where.extend(p.where)
    return out, found, merged


def _check_in_processes(trace: Trace, defs: list, run_meta: RunMeta, workers: int,
                        probe: Callable[[StepView], Any] | None,
                        folds: Mapping[str, StepFold]) -> tuple[dict[str, _Stats], Any, dict[str, Any]]:
    """The steps cut into ``CHUNKS_PER_WORKER * workers`` consecutive chunks, checked (and probed) in
    ``workers`` forked processes (``pcpviz.analysis.parallel``)."""
    steps = list(trace.steps)
    per_worker = max(1, min(CHUNKS_PER_WORKER, len(steps) // (CHUNK_MIN_STEPS * workers)))
    bounds = chunk_bounds(len(steps), workers, per_worker=per_worker)
    n = len(bounds) - 1

    def chunk(i: int) -> tuple[dict[str, _Stats], Any, dict[str, Any]]:
        lo, hi = bounds[i], bounds[i + 1]
        return _check_steps(trace, steps[lo:hi], steps[lo - 1] if lo else None, defs, run_meta, probe, folds=folds)

    return _merge(list(forked_imap(chunk, n, workers=workers)), defs, folds)


def run_checks(trace: Trace | str | os.PathLike, *, checks: list[str] | str | None = None,
               status: Any = None, probe: Callable[[StepView], Any] | None = None,
               workers: int | str | None = None, folds: Mapping[str, StepFold] | None = None) -> CheckReport:
    """Run every check (or the named ones) over every step and rank of ``trace``.

    ``trace`` is a ``pcpviz.trace.Trace`` or a run directory (opened with
    ``pcpviz.trace.open``; a ``TraceError`` propagates). A check whose inputs a step lacks is
    skipped there; a check that could run on no step at all gets the verdict ``skipped``.
    ``report.status`` is ``pcpviz.trace.validate(trace)`` (or ``status``, when the caller has
    it already): an invalid run.json or an incomplete trace (lost steps, missing ranks) makes
    ``report.ok`` false even when every check passes. Memory does not grow with the steps:
    one step of history is kept. ``probe(step_view)``, if given, is asked about each step
    (its records on every rank, ``StepView.recs``) after its checks, in step order, until it
    answers something other than None: that first answer is ``report.probe`` (another question
    over the same steps, read once; it must be a pure function of the step, and its answer
    picklable). ``workers``: processes to check in (``pcpviz.analysis.parallel``:
    ``$PCPVIZ_WORKERS``, else one per CPU from ``PARALLEL_FROM`` steps); several processes give
    the very report one would, each checking a run of consecutive steps with the step before it
    as history. ``folds``: other questions over every step the checks read (``StepFold``: the
    acceptance, the request ids), answered in the same pass: ``report.folds[name]``.
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
    run_meta = trusted_meta(trace.run_meta, status)
    workers = default_workers(len(trace.steps), workers)
    folds = dict(folds or {})
    if workers > 1 and len(trace.steps) > 1:
        stats, probed, folded = _check_in_processes(trace, defs, run_meta, workers, probe, folds)
    else:
        stats, probed, states = _check_steps(trace, trace.steps, None, defs, run_meta, probe, folds=folds)
        folded = {name: f.merge([states[name]]) for name, f in folds.items()}
    return replace(_report(trace, defs, stats, status, time.perf_counter() - t0), probe=probed,
                   folds=MappingProxyType(folded))


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
    return CheckReport(str(trace.path), MappingProxyType(_meta_summary(trace.run_meta)), len(trace.steps),
                       tuple(trace.ranks), MappingProxyType(results), seconds, status)
