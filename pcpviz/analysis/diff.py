"""Run-vs-run comparison: ``diff_traces(a, b) -> DiffReport`` and ``acceptance(trace)``.

Two runs of the same prompts (PCP=1 vs PCP=N, good vs faulty, engine vs vLLM replay) are
aligned by step number and, inside a step, by request id, so a producer that orders the
global rows differently still compares equal. What is compared:

* always: the *global* views — the global batch (per request, or per token of each
  request), ``block_table_global``, ``slot_mapping_global``, ``logits_indices``, every
  draft phase's ``draft_tokens``, draft_0's global inputs and last-token rows, the
  replicated draft decodes, and the whole verify outcome;
* only when both runs have the same PCP size, ranks and request order: the layout and the
  rank-local views, rank by rank;
* when the runs batched the requests differently (vLLM adds requests as they arrive), each
  request's timeline instead of step by step (``pcpviz.analysis.timelines``).

When the PCP sizes differ, every rank of one run is compared with the lowest rank of the
other (the global views must be identical on all ranks anyway). Timing views
(``t_start_us``/``t_end_us``) and ``hidden_hash`` are ignored by default (float
reductions differ across PCP sizes).

The report names the first divergence — step, phase, view, ranks, request, first differing
index, expected (run A) vs actual (run B) — and puts both runs' acceptance side by side.

Acceptance (vLLM's definitions, NaN when nothing was drafted) is ``pcpviz.analysis.acceptance``;
``acceptance`` and its records are re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from pcpviz.analysis.view_gap import one_sided_views
from pcpviz.analysis.acceptance import Acceptance, AcceptanceFold, RequestAcceptance, StepAcceptance, acceptance
from pcpviz.trace.schema import RUN_SPECIFIC_VIEWS, causal_phase_key, view_spec
from pcpviz.analysis.timelines import compare_timelines, same_schedule
from pcpviz.analysis.compare import first_difference, short_repr
from pcpviz.analysis.diffreport import DiffReport, Divergence
from pcpviz.analysis.parallel import chunk_bounds, default_workers, forked_imap
from pcpviz.analysis.request_keys import RenamedRequests, align_request_ids, prompts_note, request_keys
from pcpviz.trace import Trace
from pcpviz.trace import open as open_trace
from pcpviz.reference.batch import record_query_start_loc
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.errors import TraceError

__all__ = ["Acceptance", "RequestAcceptance", "StepAcceptance", "acceptance", "Divergence",
           "DiffReport", "diff_traces", "DEFAULT_IGNORE"]

DEFAULT_IGNORE = RUN_SPECIFIC_VIEWS
"""Views that differ between two correct runs (the schema's ``run_specific`` ones): timestamps,
hashes, and ``idx_mapping`` (the row of vLLM's persistent request-state table a request got,
allocated per run; the block-table rows and slot mappings it selects are compared)."""


def _open(trace: Trace | str | os.PathLike) -> Trace:
    return trace if isinstance(trace, (Trace, RenamedRequests)) else open_trace(trace)


@lru_cache(maxsize=4096)
def _kind(phase: str, view: str) -> tuple | None:
    """How a view aligns across runs (the schema's ``ViewSpec.align``); None for a local
    (rank-dependent) view. Undeclared verify views are per request."""
    spec = view_spec(phase, view)
    if spec is not None:
        return spec.align
    return ("req", 0) if phase == "verify" else None


@dataclass
class _Align:
    """Maps run B's request rows and global tokens onto run A's order."""

    req_ids: np.ndarray  # run A's
    qsl_a: np.ndarray
    perm: np.ndarray | None = None  # B row of each A row (None: same order)
    tok_perm: np.ndarray | None = None  # B token of each A token
    inv_tok: np.ndarray | None = None  # A token of each B token

    def req_of_token(self, t: int) -> str | None:
        if self.qsl_a.size < 2:
            return None
        row = int(np.searchsorted(self.qsl_a, t, side="right") - 1)
        return str(self.req_ids[row]) if 0 <= row < self.req_ids.shape[0] else None

    def apply(self, kind: tuple, b: np.ndarray) -> np.ndarray:
        if self.perm is None:
            return b
        tag = kind[0]
        if tag == "req":
            return np.take(b, self.perm, axis=kind[1])
        if tag == "tok":
            return np.take(b, self.tok_perm, axis=kind[1])
        if tag == "qsl":
            lens = np.diff(b.astype(np.int64))[self.perm]
            out = np.zeros(lens.shape[0] + 1, dtype=np.int64)
            np.cumsum(lens, out=out[1:])
            return out
        if tag in ("tokidx", "tokidx_req"):
            bi = b.astype(np.int64)
            ok = (bi >= 0) & (bi < self.inv_tok.shape[0])
            mapped = np.where(ok, self.inv_tok[np.clip(bi, 0, max(self.inv_tok.shape[0] - 1, 0))], -1)
            return np.sort(mapped) if tag == "tokidx" else mapped[self.perm]
        return b


def _alignment(a_rec, b_rec) -> tuple[_Align | None, str | None]:
    """Request alignment from the two target (or verify) records; (None, reason) if the
    request sets differ."""
    ra = np.asarray(a_rec["req_ids"]).astype(str)
    rb = np.asarray(b_rec["req_ids"]).astype(str)
    qa = record_query_start_loc(a_rec)
    if ra.shape == rb.shape and np.array_equal(ra, rb):
        return _Align(ra, qa), None
    if ra.shape != rb.shape or set(ra.tolist()) != set(rb.tolist()):
        return None, "different requests scheduled"
    pos_b = {r: i for i, r in enumerate(rb.tolist())}
    perm = np.array([pos_b[r] for r in ra.tolist()], dtype=np.int64)
    qb = record_query_start_loc(b_rec)
    if qa is None or qb is None:
        return _Align(ra, np.zeros(0, np.int64), perm, None, None), None
    tok_perm = np.concatenate([np.arange(qb[j], qb[j + 1]) for j in perm] or [np.zeros(0, np.int64)])
    inv = np.empty_like(tok_perm)
    inv[tok_perm] = np.arange(tok_perm.shape[0])
    return _Align(ra, qa, perm, tok_perm.astype(np.int64), inv.astype(np.int64)), None


def _mask_stale_rows(recs: Mapping[str, Any], ea: np.ndarray, eb: np.ndarray):
    """Rows of a request past its ``q - num_rejected`` valid rows keep stale ids in vLLM's
    draft prefill (never read); blank them (-1) in both runs, using run A's batch (``recs``: its
    records of the step on the rank, by phase)."""
    if "target" not in recs or "verify" not in recs:
        return ea, eb
    tgt, ver = recs["target"], recs["verify"]
    qsl = record_query_start_loc(tgt)
    if qsl is None or "num_rejected" not in ver or ea.shape != (int(qsl[-1]),) or eb.shape != ea.shape:
        return ea, eb
    rej = np.asarray(ver["num_rejected"], dtype=np.int64)
    if rej.shape[0] != qsl.shape[0] - 1:
        return ea, eb
    row = np.repeat(np.arange(qsl.shape[0] - 1), np.diff(qsl))
    stale = (np.arange(qsl[-1]) - qsl[row]) >= (np.diff(qsl) - rej)[row]
    return np.where(stale, -1, ea), np.where(stale, -1, eb)


def _well_formed_pairs(recs: "_StepRecords", pairs: list, record) -> list:
    """The rank pairs of the step whose records break no bound (``pcpviz.trace.bounds``); each other
    pair is recorded as a divergence naming the run, rank and first problem (sizes from a
    malformed step are never computed with)."""
    out, step = [], recs.step
    for ra, rb in pairs:
        bad = [(x, r, p) for x, r in (("a", ra), ("b", rb)) for p in recs.problems(x, r)[:1]]
        if bad:
            record(Divergence(step, None, None, ra, rb, f"run {bad[0][0]} rank {bad[0][1]}: "
                              f"malformed views ({bad[0][2]})"))
        else:
            out.append((ra, rb))
    return out


def _by_request(ta: Trace, tb: Trace, pairs: list, record, notes: list[str], *, found: list,
                ignore: frozenset[str] | set[str]) -> tuple[int, list, int] | None:
    """None when the two runs batched the requests alike, or diverged before they batched them
    differently (then step by step shows where); else every global view compared request by
    request (``compare_timelines``): divergences go to ``record`` (``found`` sorted by step), and
    ``(views compared, [], steps both recorded)``."""
    ref_a, ref_b = pairs[0] if pairs else (None, None)
    shifted = None if ref_a is None or ref_b is None else same_schedule(ta, tb, rank_a=ref_a, rank_b=ref_b)
    if shifted is None:
        return None
    compared = benign = 0
    divs: list[Divergence] = []
    for ra, rb in pairs:
        for d in compare_timelines(ta, tb, rank_a=ra, rank_b=rb, ignore=ignore):
            if "compared" in d:
                compared += d["compared"]
            elif "benign" in d:
                benign += 1
            else:
                divs.append(Divergence(**d))
    if any(d.step < shifted for d in divs):
        return None  # they diverged while still batched alike: the other batches follow from it
    notes.append(f"the runs batched the requests differently (from step {shifted} on): global views "
                 "compared request by request, each request's k-th step against its k-th")
    for d in divs:
        record(d)
    if benign:
        notes.append(f"{benign} draft views differ only in drafts the next verification rejected in both "
                     "runs, or never verified (a request's last step): not counted")
    found.sort(key=lambda d: d.step)  # the earliest step first, whichever request it is
    return compared, [], len(set(ta.steps) & set(tb.steps))


class _StepRecords:
    """One step's records of both runs, by (run, rank), each read in one pass over its batch
    (``Trace.step_records_clean``) when first asked for; a batch that fails to decode is read
    phase by phase again (``Trace.record``), which raises the error a per-phase read raises.
    Rows byte-equal in both runs (or on two ranks) are one array (``shared``): such a view is
    equal without comparing it, and run B's copy costs a memcmp, not a crc32."""

    def __init__(self, ta: Trace, tb: Trace, step: int) -> None:
        self.runs, self.step, self.got = {"a": ta, "b": tb}, step, {}
        self.shared: dict = {}

    def get(self, run: str, rank: int) -> tuple[dict, bool]:
        """(the records by phase, clean: ``bounds.rows_clean`` said so of their batch)."""
        got = self.got.get((run, rank))
        if got is None:
            t = self.runs[run]
            try:
                recs, clean = t.step_records_clean(self.step, rank, shared=self.shared)
            except TraceError:
                recs, clean = {ph: t.record(self.step, rank, ph) for ph in t.phases(self.step, rank)}, False
            got = self.got[(run, rank)] = (recs, clean)
        return got

    def problems(self, run: str, rank: int) -> list[str]:
        recs, clean = self.get(run, rank)
        return step_problems(recs, clean=clean)

    def rec(self, run: str, rank: int, phase: str):
        return self.get(run, rank)[0][phase]


class _Diff:
    """One comparison's running state (what was found, counted and noted), stepped through the
    steps one at a time: memory independent of the number of steps."""

    def __init__(self, ta: Trace, tb: Trace, *, pairs: list, same_layout: bool, notes: list[str],
                 ignore: frozenset[str] | set[str], max_divergences: int) -> None:
        self.ta, self.tb, self.pairs, self.same_layout, self.notes = ta, tb, pairs, same_layout, notes
        self.ignore, self.max_divergences = ignore, max_divergences
        self.found: list[Divergence] = []
        self.seen: set[tuple] = set()
        self.total = self.views_compared = self.steps_compared = 0
        self.order_noted = self.local_compared_any = False
        self.steps_a = {r: set(ta.rank_steps(r)) for r in ta.ranks}
        self.steps_b = {r: set(tb.rank_steps(r)) for r in tb.ranks}
        # each run's acceptance (its lowest rank's, as ``acceptance`` reads it), counted from the
        # verify records the steps read: None where K is not in run.json (``AcceptanceFold``)
        self.folds = {x: _lowest_rank_fold(t) for x, t in (("a", ta), ("b", tb))}
        self.fold_states = {x: None if f is None else f.start() for x, f in self.folds.items()}

    def record(self, d: Divergence) -> None:
        self.total += 1
        key = (d.step, d.phase, d.view)
        if key not in self.seen and len(self.found) < self.max_divergences:
            self.seen.add(key)
            self.found.append(d)

    def step(self, step: int) -> None:
        ta, tb = self.ta, self.tb
        in_a = [r for r in ta.ranks if step in self.steps_a[r]]
        in_b = [r for r in tb.ranks if step in self.steps_b[r]]
        self.recs = _StepRecords(ta, tb, step)
        self._count_acceptance(step)
        if not in_a or not in_b:
            self.record(Divergence(step, None, None, None, None,
                                   f"step recorded only in run {'a' if in_a else 'b'}"))
            return
        self.steps_compared += 1
        step_pairs = [(ra, rb) for ra, rb in self.pairs if ra in in_a and rb in in_b]
        step_pairs = _well_formed_pairs(self.recs, step_pairs, self.record)
        for ra, rb in [(ra, rb) for ra, rb in self.pairs if (ra in in_a) != (rb in in_b)]:
            self.record(Divergence(step, None, None, ra, rb,
                                   f"step recorded on rank {ra if ra in in_a else rb} of run "
                                   f"{'a' if ra in in_a else 'b'} only"))
        phases = sorted(set().union(*(ta.phases(step, ra) for ra, _ in step_pairs),
                                    *(tb.phases(step, rb) for _, rb in step_pairs)), key=causal_phase_key)
        aligns = {pair: self._alignment(step, *pair) for pair in step_pairs}
        for phase in phases:
            for ra, rb in step_pairs:
                self._phase(step, phase, ra, rb, aligns[(ra, rb)])

    def _count_acceptance(self, step: int) -> None:
        """Add each run's verify record of ``step`` on its lowest rank to its acceptance count."""
        for x, t in (("a", self.ta), ("b", self.tb)):
            fold, state = self.folds[x], self.fold_states[x]
            if fold is None:
                continue
            r = fold.ranks[0]
            if step in (self.steps_a if x == "a" else self.steps_b)[r] and t.has(step, r, "verify"):
                fold.add(state, _FoldStep(step, {r: {"verify": self.recs.rec(x, r, "verify")}}))

    def acceptance(self, x: str, folded: list | None = None) -> Acceptance:
        """Run ``x``'s acceptance: from the counts of the steps compared in this process and, in
        step order, ``folded`` (each other process's state), else read again (``acceptance``)."""
        t, fold = (self.ta if x == "a" else self.tb), self.folds[x]
        if fold is None:
            return acceptance(t)
        return acceptance(t, folded=fold.merge([self.fold_states[x], *(folded or [])]))

    def _alignment(self, step: int, ra: int, rb: int) -> tuple[_Align | None, str | None]:
        ta, tb = self.ta, self.tb
        base = "target" if ta.has(step, ra, "target") and tb.has(step, rb, "target") else "verify"
        if ta.has(step, ra, base) and tb.has(step, rb, base):
            ar, br = self.recs.rec("a", ra, base), self.recs.rec("b", rb, base)
            if "req_ids" in ar and "req_ids" in br:
                return _alignment(ar, br)
        return None, None

    def _phase(self, step: int, phase: str, ra: int, rb: int, aligned: tuple) -> None:
        ta, tb = self.ta, self.tb
        has_a, has_b = ta.has(step, ra, phase), tb.has(step, rb, phase)
        if not has_a or not has_b:
            self.record(Divergence(step, phase, None, ra, rb, f"phase recorded only in run {'a' if has_a else 'b'}"))
            return
        align, why = aligned
        if align is None and why is not None:
            ar, br = self.recs.rec("a", ra, "target" if ta.has(step, ra, "target") else "verify"), \
                self.recs.rec("b", rb, "target" if tb.has(step, rb, "target") else "verify")
            if phase in ("target", "verify"):
                self.record(Divergence(step, phase, "req_ids", ra, rb, why,
                                       expected=short_repr(ar["req_ids"]), actual=short_repr(br["req_ids"])))
            return
        local_ok = self.same_layout and (align is None or align.perm is None)
        if self.same_layout and align is not None and align.perm is not None and not self.order_noted:
            self.notes.append(f"step {step}: request order differs; local views not compared "
                              "where the order differs")
            self.order_noted = True
        va, vb = self.recs.rec("a", ra, phase), self.recs.rec("b", rb, phase)
        for view in list(va.keys()) + [v for v in vb.keys() if v not in va]:
            if view in self.ignore:
                continue
            kind = _kind(phase, view)
            if kind is None and not local_ok:
                continue
            if view not in va or view not in vb:
                self.record(Divergence(step, phase, view, ra, rb,
                                       f"view recorded only in run {'a' if view in va else 'b'}"))
                continue
            self.views_compared += 1
            self.local_compared_any |= kind is None
            self._view(step, phase, view, (ra, rb), va[view], vb[view], kind=kind, align=align)

    def _view(self, step: int, phase: str, view: str, ranks: tuple[int, int], a, b, *, kind, align) -> None:
        ea, eb = np.asarray(a), np.asarray(b)
        if kind is not None and align is not None:
            try:
                eb = align.apply(kind, eb)
            except (IndexError, ValueError):
                pass  # shapes differ: reported below
        if ea is eb and _exact(ea.dtype):
            return  # one array (the runs recorded the same bytes, ``_StepRecords``), aligned alike
        if phase == "draft_0" and view == "draft_global_input_ids":
            ea, eb = _mask_stale_rows(self.recs.get("a", ranks[0])[0], ea, eb)
        if ea.shape == eb.shape and ea.dtype == eb.dtype and _exact(ea.dtype) and ea.tobytes() == eb.tobytes():
            return  # equal bytes of one dtype: equal values (NaN where NaN), no difference to find
        if ea.dtype.names is not None or eb.dtype.names is not None:
            ea = np.asarray(ea.tolist(), dtype=object)
            eb = np.asarray(eb.tolist(), dtype=object)
        differs, idx, reason = first_difference(ea, eb)
        if not differs:
            return
        req = None
        if idx and kind is not None and align is not None:
            ax = kind[1] if len(kind) > 1 else 0
            i = idx[ax % len(idx)]
            if kind[0] == "req" and i < align.req_ids.shape[0]:
                req = str(align.req_ids[i])
            elif kind[0] == "tok":
                req = align.req_of_token(i)
        self.record(Divergence(step, phase, view, *ranks, reason, req_id=req, index=idx,
                               expected=short_repr(ea, idx), actual=short_repr(eb, idx)))


@dataclass(frozen=True)
class _FoldStep:
    """A step's records as ``AcceptanceFold.add`` reads them (``StepView``'s ``step`` and ``recs``)."""

    step: int
    recs: Mapping[int, Mapping[str, Any]]


def _lowest_rank_fold(t: Any) -> AcceptanceFold | None:
    k = t.run_meta.num_speculative_tokens
    return None if k is None or not t.ranks else AcceptanceFold(t.ranks[:1], k)


def _exact(dt: np.dtype) -> bool:
    """Equal bytes of this dtype are values ``first_difference`` finds equal: not a table with
    float fields (compared as Python tuples there, where NaN differs from NaN)."""
    return dt.names is None or not any(dt[f].kind in "fcV" or dt[f].subdtype is not None for f in dt.names)


def _rank_pairs(ta: Trace, tb: Trace, notes: list[str]) -> tuple[bool, list[tuple[int, int]]]:
    """(same layout, the rank pairs to compare): rank by rank under the same layout, else every
    rank of one run against the lowest rank of the other."""
    for key in ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "shard_decode_requests",
                "model"):
        va, vb = ta.run_meta.recorded_value(key), tb.run_meta.recorded_value(key)
        if va != vb:
            notes.append(f"run.json {key}: a={va!r}, b={vb!r}")
    same_layout = (ta.run_meta.pcp == tb.run_meta.pcp and ta.ranks == tb.ranks
                   and ta.run_meta.dcp == tb.run_meta.dcp)
    if not same_layout:
        notes.append("PCP sizes or ranks differ: only global views, draft tokens and verify compared")
        ref_a, ref_b = (ta.ranks[0] if ta.ranks else None), (tb.ranks[0] if tb.ranks else None)
        return False, [(ref_a, r) for r in tb.ranks] + [(r, ref_b) for r in ta.ranks if r != ref_a]
    return True, [(r, r) for r in ta.ranks]


def _steps_in_processes(run: _Diff, steps: list[int], workers: int) -> list[dict]:
    """``run.step`` over ``steps``, cut into ``2 * workers`` consecutive chunks compared in forked
    processes (``pcpviz.analysis.parallel``), merged into ``run`` as one pass in step order would
    have left it: the first ``max_divergences`` found, the counts summed, the first order note.
    Returns each chunk's acceptance counts (``_Diff.fold_states``), in step order."""
    bounds = chunk_bounds(len(steps), workers)
    n = len(bounds) - 1

    def chunk(i: int) -> tuple:
        part = _Diff(run.ta, run.tb, pairs=run.pairs, same_layout=run.same_layout, notes=[],
                     ignore=run.ignore, max_divergences=run.max_divergences)
        for step in steps[bounds[i]:bounds[i + 1]]:
            part.step(step)
        return (part.found, part.total, part.views_compared, part.steps_compared, part.notes,
                part.local_compared_any, part.fold_states)

    folded: list = []
    for found, total, views, compared, notes, local_any, states in forked_imap(chunk, n, workers=workers):
        folded.append(states)
        for d in found:
            run.record(d)
        run.total += total - len(found)  # record() counted each of these once
        run.views_compared += views
        run.steps_compared += compared
        run.local_compared_any |= local_any
        if notes and not run.order_noted:
            run.notes.extend(notes)
            run.order_noted = True
    return folded


def diff_traces(a: Trace | str | os.PathLike, b: Trace | str | os.PathLike, *,
                ignore: frozenset[str] | set[str] = DEFAULT_IGNORE,
                max_divergences: int = 200) -> DiffReport:
    """Compare run B against run A (see the module doc); expected values are A's. Streams over
    the steps: one step of each run is read at a time."""
    ta, tb = _open(a), _open(b)
    keys = (request_keys(ta), request_keys(tb))
    differ = prompts_note(ta, tb, keys)
    notes: list[str] = [differ] if differ else []
    tb, renamed = align_request_ids(ta, tb, keys)
    if renamed:
        notes.append(f"{renamed} requests of b matched to a's by their prompts (other request ids)")
    one_sided, gap_notes = one_sided_views(ta, tb, ignore=ignore)
    notes.extend(gap_notes)
    ignore = frozenset(ignore) | one_sided
    same_layout, pairs = _rank_pairs(ta, tb, notes)
    ref = (ta.ranks[0] if ta.ranks else None, tb.ranks[0] if tb.ranks else None)
    run = _Diff(ta, tb, pairs=pairs, same_layout=same_layout, notes=notes, ignore=ignore,
                max_divergences=max_divergences)
    steps = sorted(set(ta.steps) | set(tb.steps))
    by_request = _by_request(ta, tb, pairs if same_layout else [ref], run.record, notes, found=run.found,
                             ignore=ignore)
    if by_request is not None:  # other batches: per request
        run.views_compared, steps, run.steps_compared = by_request
    workers = default_workers(len(steps))
    folded: list[dict] = []
    if workers > 1 and len(steps) > 1:
        folded = _steps_in_processes(run, list(steps), workers)
    else:
        for step in steps:
            run.step(step)
    if not ta.steps and not tb.steps:
        notes.append("no steps in either run")
    if by_request is None:  # every step went through run.step: acceptance was counted there
        acc_a, acc_b = (run.acceptance(x, [f[x] for f in folded]) for x in ("a", "b"))
    else:
        acc_a, acc_b = acceptance(ta), acceptance(tb)
    found = run.found
    return DiffReport(str(ta.path), str(tb.path), run.total == 0, found[0] if found else None, tuple(found),
                      run.total, run.steps_compared, run.views_compared, same_layout and run.local_compared_any,
                      tuple(notes), acc_a, acc_b)
