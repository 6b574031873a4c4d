"""A trace's speculative-decoding acceptance, vLLM's definitions (the analysis-facing API).

The counting itself (``Counts``, ``count``, ``ratio``, ``json_ratio``, ``verify_counts``, and the
definitions and edge policy) lives below the producers in ``pcpviz.trace.acceptance``, so the
engine counts as it runs without importing the analysis; this module sums those counts over a
run's verify records: ``acceptance(trace)``, ``acceptance_from_records(...)``, per request and per
step. ``pcpviz diff``, the Workbench, the HTML export and the catalogue of shipped traces read it.

A PCP=2, K=2 run of one step with two requests, ``a`` accepting both drafts and ``b`` none::

    >>> import numpy as np
    >>> rec = {"num_accepted": np.array([2, 0]), "num_draft_tokens": np.array([2, 2]),
    ...        "req_ids": np.array(["a", "b"])}
    >>> a = acceptance_from_records([(0, rec)], k=2)
    >>> a.num_drafts, a.accepted_per_position, a.mean_acceptance_length, a.per_request["b"].num_accepted_tokens
    (2, (1, 1), 2.0, 0)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import numpy as np

from pcpviz.analysis.parallel import PARALLEL_FROM
from pcpviz.limits import MAX_SPECULATIVE_TOKENS
from pcpviz.trace import TraceError
from pcpviz.trace.acceptance import Counts, count, json_ratio, ratio, verify_counts
from pcpviz.trace.index import fork_map, fork_workers
from pcpviz.trace.schema import rank_file_name

__all__ = ["Counts", "count", "ratio", "json_ratio", "verify_counts", "RequestAcceptance",
           "StepAcceptance", "Acceptance", "AcceptanceFold", "acceptance", "acceptance_from_records"]


# --------------------------------------------------------------------------- a run's acceptance

@dataclass(frozen=True)
class RequestAcceptance:
    req_id: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        return Counts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens).mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)


@dataclass(frozen=True)
class StepAcceptance:
    step: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True)
class Acceptance:
    """Speculative-decoding acceptance of one run (vLLM's definitions; see the module doc)."""

    num_speculative_tokens: int  # K
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # length K
    rate_per_position: tuple[float, ...]  # accepted_per_position[k] / num_drafts (NaN: no drafts)
    acceptance_rate: float  # num_accepted_tokens / num_draft_tokens (NaN: no drafts)
    mean_acceptance_length: float  # 1 + num_accepted_tokens / num_drafts (NaN: no drafts)
    per_request: Mapping[str, RequestAcceptance]
    per_step: tuple[StepAcceptance, ...]
    rank: int | None  # the rank whose verify records were read

    def to_dict(self) -> dict[str, Any]:
        f = json_ratio
        return {
            "num_speculative_tokens": self.num_speculative_tokens, "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "acceptance_rate_per_pos": [f(x) for x in self.rate_per_position],
            "acceptance_rate": f(self.acceptance_rate), "mean_acceptance_length": f(self.mean_acceptance_length),
            "rank": self.rank,
            "per_request": {k: {"num_drafts": v.num_drafts, "num_draft_tokens": v.num_draft_tokens,
                                "num_accepted_tokens": v.num_accepted_tokens,
                                "num_accepted_tokens_per_pos": list(v.accepted_per_position),
                                "mean_acceptance_length": f(v.mean_acceptance_length)}
                            for k, v in self.per_request.items()},
        }


def _check_draft_width(nd: np.ndarray, k: int | None) -> None:
    """A request carries at most K draft tokens (``MAX_SPECULATIVE_TOKENS`` where K is unknown):
    a wider count is a malformed view, not a measurement (and would size ``count``'s arrays)."""
    cap = MAX_SPECULATIVE_TOKENS if k is None else min(int(k), MAX_SPECULATIVE_TOKENS)
    if nd.size and int(nd.max()) > cap:
        i = int(np.argmax(nd))
        raise ValueError(f"request row {i} carries {int(nd[i])} draft tokens, more than "
                         f"{'K = ' + str(cap) if k is not None else f'the bound {cap}'}")


def acceptance_from_records(records: Iterable[tuple[int, Mapping[str, Any]]], *, k: int | None = None,
                            rank: int | None = None) -> Acceptance:
    """``Acceptance`` from ``(step, verify record)`` pairs (records without the counts are
    skipped). K is ``k``, else the width of ``sampled_token_ids`` minus one."""
    return _finish(*_sums(records, k), rank=rank)


def _sums(records: Iterable[tuple[int, Mapping[str, Any]]],
          k: int | None) -> tuple[Counts, dict[str, Counts], list[StepAcceptance], int | None]:
    """(total, per request in order of first appearance, per step, K) of ``records``; the first
    malformed record raises ValueError naming its step."""
    sums = _Sums(k)
    for step, rec in records:
        sums.add(step, rec)
    return sums.total, sums.per_req, sums.steps, sums.k


class _Sums:
    """The running sums of ``_sums``: verify records added one at a time, in step order. Kept as
    Python integers and lists (a 100,000-step trace adds 200,000 request rows; a ``Counts`` per
    row and per addition was most of the fold), read back as ``Counts`` (``total``, ``per_req``)."""

    def __init__(self, k: int | None) -> None:
        self._total: list = [0, 0, 0, []]  # drafts, draft tokens, accepted tokens, accepted per position
        self._req: dict[str, list] = {}  # request id -> the same four, in order of first appearance
        self.steps: list[StepAcceptance] = []
        self.k = k

    @property
    def total(self) -> Counts:
        return _counts(self._total)

    @property
    def per_req(self) -> dict[str, Counts]:
        return {rid: _counts(sums) for rid, sums in self._req.items()}

    def extend(self, later: _Sums) -> None:
        """Add the sums of the run of steps right after this one's (totals, requests in order of
        first appearance, steps in order)."""
        _add_sums(self._total, later._total)
        for rid, sums in later._req.items():
            mine = self._req.get(rid)
            if mine is None:
                mine = self._req[rid] = [0, 0, 0, []]
            _add_sums(mine, sums)
        self.steps.extend(later.steps)

    def add(self, step: int, rec: Mapping[str, Any]) -> None:
        """Count one verify record (one without the counts is skipped); a malformed one raises
        ValueError naming ``step``."""
        self.apply(step, self.measure(step, rec))

    def measure(self, step: int, rec: Mapping[str, Any]) -> tuple | None:
        """(the step's ``StepAcceptance``, its drafting requests' (id, accepted, draft tokens)) of
        one verify record, not yet added (None: a record without the counts); a malformed one
        raises ValueError naming ``step``. A pure function of the record's arrays once K is known:
        ranks whose verify records are the same arrays share it (``AcceptanceFold.add``)."""
        k = self.k
        try:
            counts = verify_counts(rec)
            if counts is None:
                return None
            nacc, nd = counts
            ids = np.asarray(rec["req_ids"]) if "req_ids" in rec else np.arange(nd.size)
            if nacc.ndim != 1 or nd.shape != nacc.shape or ids.shape != nacc.shape:
                raise ValueError(f"num_accepted {list(nacc.shape)}, num_draft_tokens {list(nd.shape)} and "
                                 f"req_ids {list(ids.shape)} are not one entry per request")
            na, nt = nacc.tolist(), nd.tolist()  # a decode step's few requests: Python integers are cheaper
            bad = next((i for i, (a, d) in enumerate(zip(na, nt)) if d < 0 or a < 0 or a > d), None)
            if bad is not None:
                raise ValueError(f"request row {bad} accepts {na[bad]} of {nt[bad]} draft tokens")
            ids = rec["req_ids"].tolist() if "req_ids" in rec else [f"row{i}" for i in range(nd.shape[0])]
            if k is None and "sampled_token_ids" in rec and np.ndim(rec["sampled_token_ids"]) == 2:
                k = self.k = int(np.shape(rec["sampled_token_ids"])[1]) - 1
            _check_draft_width(nd, k)  # keeps the widths and the sums bounded
            rows = [(str(ids[i]), a, d) for i, (a, d) in enumerate(zip(na, nt)) if d > 0]
        except (IndexError, ValueError, TypeError, KeyError) as exc:  # a producer's malformed view
            raise ValueError(f"step {step}: verify: malformed acceptance counts: "
                             f"{' '.join(str(exc).split())}") from None
        return StepAcceptance(int(step), len(rows), sum(d for _, _, d in rows), sum(a for _, a, _ in rows)), rows

    def apply(self, step: int, measured: tuple | None) -> None:
        """Add ``measure``'s answer for ``step`` (None: nothing)."""
        if measured is None:
            return
        at_step, rows = measured
        self.steps.append(at_step)
        total, req = self._total, self._req
        for rid, a, d in rows:
            mine = req.get(rid)
            if mine is None:
                mine = req[rid] = [0, 0, 0, []]
            one = [1, d, a, [1] * a]  # the row's own sums: one draft, accepted at positions 0 .. a-1
            _add_sums(total, one)
            _add_sums(mine, one)


def _counts(sums: list) -> Counts:
    return Counts(sums[0], sums[1], sums[2], tuple(sums[3]))


def _add_sums(into: list, other: list) -> None:
    """``into`` += ``other`` (``_Sums``' four running sums; the per-position lists widened)."""
    into[0] += other[0]
    into[1] += other[1]
    into[2] += other[2]
    per, more = into[3], other[3]
    if len(more) > len(per):
        per.extend([0] * (len(more) - len(per)))
    for j, x in enumerate(more):
        per[j] += x


def _finish(total: Counts, per_req: dict[str, Counts], steps: list[StepAcceptance], k: int | None, *,
            rank: int | None) -> Acceptance:
    k = int(k or 0)
    total = total.widened(k)
    width = len(total.accepted_per_position)
    requests = {rid: RequestAcceptance(rid, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                       c.widened(width).accepted_per_position)
                for rid, c in per_req.items()}
    return Acceptance(
        num_speculative_tokens=k, num_drafts=total.num_drafts, num_draft_tokens=total.num_draft_tokens,
        num_accepted_tokens=total.num_accepted_tokens, accepted_per_position=total.accepted_per_position,
        rate_per_position=total.rate_per_position, acceptance_rate=total.acceptance_rate,
        mean_acceptance_length=total.mean_acceptance_length,
        per_request=MappingProxyType(requests), per_step=tuple(steps), rank=rank,
    )


def acceptance(trace: Any, *, rank: int | None = None, folded: Mapping[int, Any] | None = None) -> Acceptance:
    """Acceptance statistics from the verify records of ``rank`` (default: the lowest rank;
    verify is identical on every rank unless a fault made them diverge). ``trace`` is a
    ``pcpviz.trace.Trace`` (or anything with its ``ranks``/``rank_steps``/``has``/``record``/
    ``meta``) or a run directory. K is run.json's ``num_speculative_tokens``, else the width of
    ``sampled_token_ids`` minus one. ``folded``: ``AcceptanceFold``'s answer from a pass the
    checks made over the same trace (``run_checks(folds=...)``): the same statistics, or the
    same error, without reading the records again."""
    if isinstance(trace, (str, os.PathLike)):
        from pcpviz.trace import open as open_trace

        trace = open_trace(trace)
    if rank is None:
        rank = trace.ranks[0] if trace.ranks else None
    if folded is not None and rank in folded:
        got = folded[rank]
        if isinstance(got, str):
            raise ValueError(f"{Path(str(trace.path)) / rank_file_name(rank)}: {got}")
        return got
    k = trace.run_meta.num_speculative_tokens
    steps = [] if rank is None else trace.rank_steps(rank)
    try:
        if k is None or len(steps) < PARALLEL_FROM or fork_workers() < 2:
            records = ((s, trace.record(s, rank, "verify")) for s in steps if trace.has(s, rank, "verify"))
            return acceptance_from_records(records, k=k, rank=rank)
        return _finish(*_sums_in_runs(trace, rank, steps, k), rank=rank)
    except ValueError as exc:
        if isinstance(exc, TraceError):  # names its file already
            raise
        raise ValueError(f"{Path(str(trace.path)) / rank_file_name(rank)}: {exc}") from None


RUNS = 8
"""Runs of consecutive steps ``acceptance`` cuts a long trace into (``_sums_in_runs``)."""


def _sums_in_runs(trace: Any, rank: int, steps: list[int],
                  k: int) -> tuple[Counts, dict[str, Counts], list[StepAcceptance], int]:
    """``_sums`` of the verify records of ``steps``, the runs of steps summed in forked processes
    (``pcpviz.trace.index.fork_map``) and added in step order: integer sums, the requests in order
    of first appearance, the first malformed record's error, as one pass gives them (K is known:
    no run needs an earlier one's)."""
    cuts = [round(i * len(steps) / RUNS) for i in range(RUNS + 1)]

    def run(i: int) -> _Sums:
        sums = _Sums(k)
        for s in steps[cuts[i]:cuts[i + 1]]:
            if trace.has(s, rank, "verify"):
                sums.add(s, trace.record(s, rank, "verify"))
        return sums

    out = _Sums(k)
    for part in fork_map(run, RUNS, workers=fork_workers()):
        out.extend(part)
    return out.total, out.per_req, out.steps, k


_NOT_MEASURED = object()


def _same_arrays(a: Mapping, b: Mapping) -> bool:
    """Two records' views are the very same arrays, name by name:
    ``_same_arrays({"x": arr}, {"x": arr})`` is True, with a copy of ``arr`` False."""
    return a is b or (len(a) == len(b) and all(b.get(name) is arr for name, arr in a.items()))


class AcceptanceFold:
    """Each rank's ``acceptance`` counted in the pass ``run_checks`` makes over the steps
    (``pcpviz.analysis.checks.StepFold``), from the verify records it decoded: its answer is
    ``{rank: Acceptance, or the error acceptance() would raise, without the file}`` for
    ``acceptance(trace, rank=r, folded=answer)``. Only where K is known (run.json): without it a
    run's K comes from its first record, which a later run of steps does not see
    (``AcceptanceFold.of`` is None then)."""

    def __init__(self, ranks: Iterable[int], k: int) -> None:
        self.ranks, self.k = tuple(ranks), int(k)

    @classmethod
    def of(cls, trace: Any) -> AcceptanceFold | None:
        k = trace.run_meta.num_speculative_tokens
        return None if k is None else cls(trace.ranks, k)

    def start(self) -> dict[int, Any]:
        return {r: _Sums(self.k) for r in self.ranks}  # a rank's sums, or its first error (str)

    def add(self, state: dict[int, Any], sv: Any) -> dict[int, Any]:
        """Count each rank's verify record of step ``sv``; a record whose views are the very
        arrays of a rank counted before in this step (the reader shares byte-equal payloads) is
        measured once: K is known, so the measure is a function of those arrays alone."""
        done: list[tuple[Mapping, Any]] = []  # (views, measure's answer or its ValueError)
        for r, sums in state.items():
            rec = sv.recs.get(r, {}).get("verify") if not isinstance(sums, str) else None
            if rec is None:
                continue
            views = getattr(rec, "views", rec)
            got = next((m for v, m in done if _same_arrays(v, views)), _NOT_MEASURED)
            if got is _NOT_MEASURED:
                try:
                    got = sums.measure(sv.step, rec)
                except ValueError as exc:
                    got = exc
                done.append((views, got))
            if isinstance(got, ValueError):
                state[r] = str(got)
            else:
                sums.apply(sv.step, got)
        return state

    def merge(self, states: list[dict[int, Any]]) -> dict[int, Any]:
        out = {}
        for r in self.ranks:
            sums, err = _Sums(self.k), None
            for state in states:
                if isinstance(state[r], str):
                    err = state[r]
                    break
                sums.extend(state[r])
            out[r] = err if err is not None else _finish(sums.total, sums.per_req, sums.steps, self.k, rank=r)
        return out
