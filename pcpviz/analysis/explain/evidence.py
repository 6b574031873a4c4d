"""The symptoms ``pcpviz.analysis.explain`` reports and weighs: ``gather_symptoms(trace, report, diff) -> Symptoms``.

Everything here is read from the bad trace, its check report and (when there is a reference
run) the diff against it. PCP=2 example, a run whose draft decodes read stale block tables for
batch row 2, against a clean run of the same prompts::

    checks        1 failed (draft_block_tables_global); first violation at step 2 of 14
    acceptance    0.55 vs 0.62; per position 0.86/0.86, 0.39/0.21 (position 1 dropped)
    per request   req2 0.31 vs 0.66 (the request in row 2)
    KV replicas   agree (every rank writes the same slots from the same inputs)
    outputs       same as the reference
"""

from __future__ import annotations

from functools import partial

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from pcpviz.analysis.acceptance import acceptance_from_records
from pcpviz.analysis.diff import acceptance
from pcpviz.analysis.request_keys import request_keys
from pcpviz.analysis.parity import generated_tokens
from pcpviz.trace import TraceError, draft_index
from pcpviz.trace.errors import MALFORMED

__all__ = ["Symptoms", "gather_symptoms", "KvReplicas", "kv_divergence", "guarded", "MALFORMED", "ACCEPTANCE_DROP",
           "POSITION_DROP"]
# MALFORMED (pcpviz.trace.errors): what reading a malformed view raises; that reading is then not
# evaluated, as run_checks does with a check. TraceError (a payload failing its crc32) is not among
# them: that trace is unreadable.


_NOT_EVALUATED = object()


def guarded(fn, *args, notes: list[str], what: str, default: Any = None) -> Any:
    """``fn(*args)``, or ``default`` with one line in ``notes`` when malformed views make it
    raise (``MALFORMED``); a ``TraceError`` still raises. PCP=2 example: a verify record whose
    ``sampled_token_ids`` has 2 rows for 1 request leaves ``outputs_same`` None and notes
    ``outputs vs the reference: could not evaluate (malformed views?): IndexError: ...``."""
    try:
        return fn(*args)
    except TraceError:
        raise
    except MALFORMED as exc:
        notes.append(f"{what}: could not evaluate (malformed views?): {type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:200]}")
        return default

ACCEPTANCE_DROP = 0.10
"""Acceptance dropped: the overall rate fell by at least this much against the reference ..."""
POSITION_DROP = 0.15
"""... or the rate at one draft position fell by at least this much."""

LAYOUT_DEPENDENT_VIEWS = frozenset({
    "padded_gather_idx", "hidden_restore_idx", "kv_write_mask", "per_rank_num_tokens", "segments",
    "slot_mapping_gathered", "moe_is_padding", "local_input_ids", "local_positions",
    "local_is_padding", "local_seq_lens", "local_query_start_loc", "local_logits_indices",
    "draft_input_ids", "draft_positions", "draft_seq_lens", "slot_mapping_draft",
})
"""Views that change with the rank-local layout and its padding alone (draft_0's are rank-local too)."""

_KV_VIEWS = {"target": ("input_ids", "positions", "slot_mapping_gathered"),
             "draft": ("draft_input_ids", "draft_positions", "slot_mapping_draft")}


def _f(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


@dataclass(frozen=True)
class Symptoms:
    num_steps: int
    ranks: tuple[int, ...]
    complete: bool
    failed_checks: tuple[str, ...]
    skipped_checks: tuple[str, ...]
    first_violation: dict | None  # pcpviz.analysis.checks.Violation.to_dict()
    acceptance_rate: float | None
    rate_per_position: tuple[float | None, ...]
    step_trend: tuple[float | None, float | None]  # acceptance rate over the first and last third of steps
    ranks_acceptance_agree: bool | None  # None: one rank, or not evaluated (noted)
    kv_replicas_agree: bool | None  # None: one rank
    kv_first_divergence: str | None
    reference: str | None
    reference_kind: str | None  # "good" | "rerun" | None
    reference_acceptance_rate: float | None
    reference_rate_per_position: tuple[float | None, ...]
    acceptance_dropped: bool
    dropped_positions: tuple[int, ...]
    requests_dropped: tuple[tuple[str, float | None, float | None], ...]  # (request, rate, reference rate)
    outputs_same: bool | None
    diff_first: dict | None  # pcpviz.analysis.diff.Divergence.to_dict()
    drafts_first_differ: dict | None  # the diff's first divergence in draft_tokens
    differs_before_drafts: tuple[str, ...]  # the views that differ before it ("phase.view")
    notes: tuple[str, ...]

    @property
    def only_layout_before_drafts(self) -> bool:
        """The drafts differ after differences only in the rank-local layout / padding views."""
        return self.drafts_first_differ is not None and all(
            v.split(".", 1)[1] in LAYOUT_DEPENDENT_VIEWS for v in self.differs_before_drafts)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["requests_dropped"] = [list(r) for r in self.requests_dropped]
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    def lines(self) -> list[str]:
        r = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        n = len(self.failed_checks)
        out = [f"checks: {n} failed" + (f" ({', '.join(self.failed_checks)})" if n else "")
               + (f", {len(self.skipped_checks)} could not run" if self.skipped_checks else "")
               + ("" if self.complete else "; the trace is INCOMPLETE")]
        if self.first_violation is not None:
            v = self.first_violation
            out.append(f"first violation: step {v['step']} of {self.num_steps} steps, {v['check']}, "
                       f"phase {v['phase']}, view {v['view']}")
        out += [f"note: {x}" for x in self.notes]
        if self.reference is not None:
            out.append(f"reference ({self.reference_kind}): {self.reference}")
            d = self.diff_first
            out.append("diff: " + ("SAME" if d is None else
                                   f"first divergence at step {d['step']}, phase {d['phase']}, view {d['view']}"))
            if self.drafts_first_differ is not None:
                d = self.drafts_first_differ
                out.append(f"drafts first differ at step {d['step']}, phase {d['phase']}"
                           + (f"; before that: {', '.join(self.differs_before_drafts[:6])}"
                              if self.differs_before_drafts else ""))
        acc = f"acceptance: {r(self.acceptance_rate)}"
        if self.reference is not None:
            acc += f" vs {r(self.reference_acceptance_rate)} in the reference" + (
                " (DROPPED)" if self.acceptance_dropped else "")
        out.append(acc)
        per = ", ".join(f"{k}: {r(a)}" + (f"/{r(b)}" if self.reference is not None else "")
                        for k, (a, b) in enumerate(zip(self.rate_per_position, self.reference_rate_per_position
                                                       or (None,) * len(self.rate_per_position))))
        if per:
            out.append(f"per position{' (trace/reference)' if self.reference is not None else ''}: {per}"
                       + (f"; dropped at {list(self.dropped_positions)}" if self.dropped_positions else ""))
        if self.requests_dropped:
            out.append("per request: " + ", ".join(f"{q} {r(a)} vs {r(b)}" for q, a, b in self.requests_dropped))
        out.append(f"per step: {r(self.step_trend[0])} over the first third, {r(self.step_trend[1])} over the last")
        if self.ranks_acceptance_agree is not None:
            out.append("per rank: " + ("every rank verifies the same acceptance" if self.ranks_acceptance_agree
                                       else "ranks verify different acceptance"))
        if self.kv_replicas_agree is not None:
            out.append("KV replicas: " + ("agree (every rank writes the same slots from the same inputs)"
                                          if self.kv_replicas_agree else f"diverge from {self.kv_first_divergence}"))
        if self.outputs_same is not None:
            out.append("outputs: " + ("same as the reference" if self.outputs_same else "differ from the reference"))
        return out


def _step_trend(acc) -> tuple[float | None, float | None]:
    steps = [s for s in acc.per_step if s.num_draft_tokens]
    if len(steps) < 3:
        return None, None
    third = max(len(steps) // 3, 1)

    def rate(part):
        d = sum(s.num_draft_tokens for s in part)
        return sum(s.num_accepted_tokens for s in part) / d if d else None
    return _f(rate(steps[:third])), _f(rate(steps[-third:]))


def kv_step_divergence(step: int, recs: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Where the ranks of one step (``recs[rank][phase]``) first write different KV, or None."""
    ranks = sorted(recs)
    ref = ranks[0] if ranks else None
    if ref is None:
        return None
    a_phases = recs[ref]
    for phase, a in a_phases.items():
        k = draft_index(phase)
        views = _KV_VIEWS["target"] if phase == "target" else _KV_VIEWS["draft"] if k and k >= 1 else ()
        for r in ranks[1:] if views else ():
            b = recs[r].get(phase)
            if b is None:
                return f"step {step}, phase {phase}: recorded on rank {ref} only"
            for v in views:
                if v in a and v in b and a[v] is not b[v] and not np.array_equal(np.asarray(a[v]), np.asarray(b[v])):
                    return f"step {step}, phase {phase}, view {v}, rank {r}"
    return None


class KvReplicas:
    """``kv_divergence`` found while the checks stream over the steps (``run_checks``'
    ``probe``): the steps are read once. ``first``: the first divergence or None; ``error``: the
    malformed-views exception that stopped it (then not evaluated).

        kv = KvReplicas(trace.ranks[0])
        kv.take(run_checks(trace, probe=kv.probe).probe)
    """

    def __init__(self, ref: int | None) -> None:
        self.ref, self.first, self.error = ref, None, None

    def probe(self, sv: Any) -> tuple[str, Any] | None:
        """One step's answer: ``("diverged", where)``, ``("malformed", exc)`` or None (agree)."""
        if self.ref not in sv.recs:
            return None
        try:
            where = kv_step_divergence(sv.step, sv.recs)
        except MALFORMED as exc:
            return ("malformed", exc)
        return None if where is None else ("diverged", where)

    def take(self, answer: tuple[str, Any] | None) -> None:
        """Keep the probe's first answer (``report.probe``)."""
        if answer is not None:
            kind, value = answer
            self.first, self.error = (value, None) if kind == "diverged" else (None, value)

    def result(self, notes: list[str]) -> Any:
        """The divergence (or None), or ``_NOT_EVALUATED`` with a note, as ``guarded`` gives it."""
        if self.error is not None:
            return guarded(_raise, self.error, notes=notes, what="KV replicas", default=_NOT_EVALUATED)
        return self.first


def _raise(exc: BaseException) -> None:
    raise exc


def kv_divergence(trace) -> str | None:
    """Where the ranks first write different KV (step, phase, view, rank), or None if they agree:
    the target's ids/positions/gathered slots and each draft decode's inputs and slots."""
    ranks = trace.ranks
    steps = {r: set(trace.rank_steps(r)) for r in ranks}
    for step in trace.steps:
        have = [r for r in ranks if step in steps[r]]
        if not have or have[0] != ranks[0]:
            continue
        recs = {r: {ph: trace.record(step, r, ph) for ph in trace.phases(step, r)} for r in have}
        found = kv_step_divergence(step, recs)
        if found is not None:
            return found
    return None


def _ranks_agree(trace, ranks: tuple[int, ...], first: Any = None, folded: Any = None) -> bool:
    """Every rank verifies the same acceptance per draft position; ``first``: the first rank's
    ``Acceptance`` when the caller has it (one pass over the steps fewer); ``folded``: every
    rank's, counted while the checks ran (``AcceptanceFold``: no pass at all)."""
    if first is None or getattr(first, "rank", None) != ranks[0]:
        first = acceptance(trace, rank=ranks[0], folded=folded)
    base = first.accepted_per_position
    return all(acceptance(trace, rank=r, folded=folded).accepted_per_position == base for r in ranks[1:])


def _outputs_same(ta, tb) -> bool | None:
    ka, kb = request_keys(ta), request_keys(tb)
    ga, gb = generated_tokens(ta), generated_tokens(tb)
    by_key = {k: rid for rid, k in ka.items()}
    pairs = [(by_key[k], rid) for rid, k in kb.items() if k in by_key]
    if not pairs:
        return None
    # The last step may sample past max_new_tokens (kept in verify, cut by the scheduler), and how
    # far depends on acceptance: compare each request over the tokens both runs generated.
    same = True
    for a, b in pairs:
        x, y = ga.get(a, []), gb.get(b, [])
        n = min(len(x), len(y))
        same &= n > 0 and x[:n] == y[:n]
    return same


def gather_symptoms(trace, report, diff=None, *, reference_trace=None, reference_kind: str | None = None,
                    note: str | None = None, kv: KvReplicas | None = None) -> Symptoms:
    """The symptoms of ``trace`` given its ``report`` (``run_checks``) and ``diff``
    (``diff_traces(reference_trace, trace)``, or None without a reference); ``kv``: the KV
    replicas already compared while the checks ran (else compared here, another pass)."""
    notes = [note] if note else []
    folded = report.folds.get("acceptance")  # counted while the checks ran (AcceptanceFold), when asked for
    acc = diff.acceptance_b if diff is not None else guarded(partial(acceptance, folded=folded), trace, notes=notes,
                                                              what="acceptance")
    counted = acc is not None
    if not counted:  # a malformed verify record (noted): no acceptance to judge by
        acc = acceptance_from_records((), rank=trace.ranks[0] if trace.ranks else None)
    ref_rate: float | None = None
    ref_pos: tuple = ()
    dropped_pos: tuple[int, ...] = ()
    req_drop: list = []
    dropped = False
    outputs_same = None
    diff_first = drafts_first = None
    before: list[str] = []
    if diff is not None:
        ra = diff.acceptance_a
        ref_rate, ref_pos = _f(ra.acceptance_rate), tuple(_f(x) for x in ra.rate_per_position)
        notes += [n for n in diff.notes if "matched to a's" in n or "producer" in n]
        diff_first = None if diff.first is None else diff.first.to_dict()
        for d in diff.divergences:
            if d.view == "draft_tokens":
                drafts_first = d.to_dict()
                break
            name = f"{d.phase}.{d.view}"
            if name not in before:
                before.append(name)
        if ra.num_drafts and acc.num_drafts:
            dropped_pos = tuple(k for k, (a, b) in enumerate(zip(acc.rate_per_position, ra.rate_per_position))
                                if b - a >= POSITION_DROP)
            dropped = ra.acceptance_rate - acc.acceptance_rate >= ACCEPTANCE_DROP or bool(dropped_pos)
        for rid, rb in acc.per_request.items():
            rr = ra.per_request.get(rid)
            if rr is not None and rr.num_draft_tokens and rb.num_draft_tokens \
                    and rr.acceptance_rate - rb.acceptance_rate >= 0.2:
                req_drop.append((rid, _f(rb.acceptance_rate), _f(rr.acceptance_rate)))
        req_drop.sort(key=lambda x: x[1] - x[2])
        outputs_same = None if reference_trace is None else guarded(
            _outputs_same, reference_trace, trace, notes=notes, what="outputs vs the reference")
    ranks = tuple(trace.ranks)
    per_rank = None
    kv_first = None
    if len(ranks) > 1:
        per_rank = None if not counted else guarded(_ranks_agree, trace, ranks, acc, folded, notes=notes,
                                                    what="acceptance per rank")
        kv_first = kv.result(notes) if kv is not None else guarded(
            kv_divergence, trace, notes=notes, what="KV replicas", default=_NOT_EVALUATED)
    fv = report.first_violation
    return Symptoms(
        num_steps=len(trace.steps), ranks=ranks, complete=report.complete, failed_checks=tuple(report.failed),
        skipped_checks=tuple(report.skipped), first_violation=None if fv is None else fv.to_dict(),
        acceptance_rate=_f(acc.acceptance_rate), rate_per_position=tuple(_f(x) for x in acc.rate_per_position),
        step_trend=_step_trend(acc), ranks_acceptance_agree=per_rank,
        kv_replicas_agree=None if len(ranks) < 2 or kv_first is _NOT_EVALUATED else kv_first is None,
        kv_first_divergence=None if kv_first is _NOT_EVALUATED else kv_first,
        reference=None if reference_trace is None else str(reference_trace.path), reference_kind=reference_kind,
        reference_acceptance_rate=ref_rate,
        reference_rate_per_position=ref_pos, acceptance_dropped=dropped, dropped_positions=dropped_pos,
        requests_dropped=tuple(req_drop[:3]), outputs_same=outputs_same, diff_first=diff_first,
        drafts_first_differ=drafts_first, differs_before_drafts=tuple(before) if drafts_first else (),
        notes=tuple(notes),
    )

