"""Requests matched across runs by their prompts: ``request_keys(trace)``.

Request ids do not carry over between runs (vLLM's ``LLM`` names a request ``"{i}-{random}"``, the
engine ``"req{i}"``), so ``diff``, ``explain`` and the parity report match a request of one run to one of
another by ``(prompt length, last prompt token, n)``, read from rank 0's target records. A PCP=2 run
that prefilled ``req0`` (23 tokens, the last one 871) and ``req1`` (25 tokens, the last one 871 too)
gives ``{"req0": (23, 871, 0), "req1": (25, 871, 0)}``; a second 23-token prompt ending in 871 would be
``(23, 871, 1)``. ``align_request_ids`` then shows run B under run A's ids (``RenamedRequests``),
and ``prompts_note`` says when the runs served different prompts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import numpy as np

from pcpviz.analysis.parallel import PARALLEL_FROM
from pcpviz.reference.batch import record_query_start_loc
from pcpviz.trace import Trace
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.index import fork_map, fork_workers

__all__ = ["request_keys", "peek_reader", "KEY_RUNS", "RenamedRequests", "prompts_note", "align_request_ids"]


def request_keys(trace: Trace) -> dict[str, tuple]:
    """Each request's identity across runs: ``(prompt length, last prompt token, n)``, n counting
    earlier requests with the same pair. Request ids do not carry over between runs (vLLM's
    ``LLM`` names a request ``"{i}-{random}"``, the engine ``"req{i}"``), and the start of a prompt
    may never be fed (a prefix-cache hit), but every run computes a prompt's last token itself.
    Read from rank 0's target records (``is_prefilling`` rows); a request whose prefill the trace
    did not see gets no key. A long trace is read in runs of steps in forked processes
    (``pcpviz.trace.index.fork_map``), their answers taken in step order: the same keys."""
    rank = trace.ranks[0] if trace.ranks else None
    steps = [] if rank is None else trace.rank_steps(rank)
    workers = fork_workers() if len(steps) >= PARALLEL_FROM else 1
    cuts = [round(i * len(steps) / KEY_RUNS) for i in range(KEY_RUNS + 1)] if workers > 1 else [0, len(steps)]
    last: dict[str, tuple[int, int]] = {}
    for part in fork_map(lambda i: _last_prompt_tokens(trace, rank, steps[cuts[i]:cuts[i + 1]]), len(cuts) - 1,
                         workers=workers):
        for rid, pair in part.items():  # a later prefill chunk of a request replaces the pair, in place
            last[rid] = pair
    keys: dict[str, tuple] = {}
    seen: dict[tuple[int, int], int] = {}
    for rid, pair in last.items():  # first appearance order
        n = seen.get(pair, 0)
        seen[pair] = n + 1
        keys[rid] = (*pair, n)
    return keys


KEY_RUNS = 8
"""Runs of consecutive steps ``request_keys`` cuts a long trace into."""


def peek_reader(trace) -> Callable:
    """``trace``'s record reader for a look at a few views, each row's crc32 checked as it is read
    (``Trace.lazy_record(check_unread=False)``; else ``record``)."""
    lazy = getattr(trace, "lazy_record", None)
    return trace.record if lazy is None else functools.partial(lazy, check_unread=False)


def _last_prompt_tokens(trace: Trace, rank: int, steps: list[int]) -> dict[str, tuple[int, int]]:
    """Request id -> (position + 1, token) of its last prefilled token in ``steps``, in order of first
    appearance (a later chunk replacing an earlier one's pair in place)."""
    last: dict[str, tuple[int, int]] = {}
    peek = peek_reader(trace)
    for step in steps:
        if not trace.has(step, rank, "target"):
            continue
        rec = peek(step, rank, "target")
        pf, rids = rec.get("is_prefilling"), rec.get("req_ids")
        if pf is None or (pf.dtype.kind in "biu" and rids is not None and pf.shape == rids.shape and not pf.any()):
            continue  # a decode step (well formed): nothing to read
        rec = trace.record(step, rank, "target")
        if step_problems({"target": rec}):  # only the target record is read here: only it is bounded
            continue
        if not all(v in rec for v in ("req_ids", "is_prefilling", "input_ids", "positions")):
            continue
        qsl = record_query_start_loc(rec)
        if qsl is None:
            continue
        ids, pos = np.asarray(rec["input_ids"], dtype=np.int64), np.asarray(rec["positions"], dtype=np.int64)
        for i, rid in enumerate(np.asarray(rec["req_ids"]).astype(str).tolist()):
            if bool(rec["is_prefilling"][i]) and qsl[i + 1] > qsl[i]:
                j = int(qsl[i + 1]) - 1
                last[rid] = (int(pos[j]) + 1, int(ids[j]))
    return last


# --------------------------------------------------------------------------- one run seen with another's ids

class RenamedRequests:
    """Run B with its request ids replaced by run A's for the same requests (``request_keys``)."""

    def __init__(self, trace: Trace, rename: Mapping[str, str]) -> None:
        self._t, self._rename = trace, dict(rename)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def step_records_clean(self, step: int, rank: int, *, shared: dict | None = None) -> tuple[dict, bool]:
        """``Trace.step_records_clean`` with the ids renamed (their bounds then judged again)."""
        recs = self._t.step_records_clean(step, rank, shared=shared)[0]
        return {ph: self._renamed(rec) for ph, rec in recs.items()}, False

    def record(self, step: int, rank: int, phase: str):
        return self._renamed(self._t.record(step, rank, phase))

    def lazy_record(self, step: int, rank: int, phase: str, **_) -> Any:
        """``record``: the ids renamed (never the trace's own lazy_record, which would not rename them)."""
        return self.record(step, rank, phase)

    def _renamed(self, rec):
        if not any(v in rec for v in ("req_ids", "local_req_ids")):
            return rec
        out = {k: rec[k] for k in rec.keys()}
        for v in ("req_ids", "local_req_ids"):
            if v in out:
                out[v] = np.array([self._rename.get(x, x) for x in np.asarray(out[v]).astype(str).tolist()])
        return out


def prompts_note(ta: Trace, tb: Trace, keys: tuple[dict, dict] | None = None) -> str | None:
    """One line when the two runs served different prompts (run.json's ``prompt_token_ids``,
    else the requests' ``request_keys``: ``keys`` when the caller has them), so a reader knows up
    front that divergences follow from the input: ``"the runs served different prompts: 2 of b's 3
    are not among a's 3"``."""
    def prompts(t: Trace) -> list[tuple] | None:
        p = t.run_meta.prompt_token_ids
        if p is None:
            return None
        return sorted(p.values() if isinstance(p, Mapping) else p)

    pa_, pb_ = prompts(ta), prompts(tb)
    if pa_ is None or pb_ is None:  # no prompts in run.json: (length, last token) per request
        ka, kb = keys if keys is not None else (request_keys(ta), request_keys(tb))
        pa_, pb_ = sorted(ka.values()), sorted(kb.values())
        if not pa_ or not pb_:
            return None
    if pa_ == pb_:
        return None
    missing = sum(1 for x in pb_ if x not in set(pa_))
    return (f"the runs served different prompts: {missing} of b's {len(pb_)} are not among a's {len(pa_)}; "
            "differences follow from the input, not only from the run")


def align_request_ids(ta: Trace, tb: Trace, keys: tuple[dict, dict]) -> tuple[Any, int]:
    """Run B seen with run A's request ids where the two runs served the same prompts under
    other names (``keys``: their ``request_keys``); returns (the trace to compare, requests renamed)."""
    ka, kb = keys
    by_key = {k: rid for rid, k in ka.items()}
    rename = {rid: by_key[k] for rid, k in kb.items() if k in by_key and by_key[k] != rid}
    if not rename:
        return tb, 0
    return RenamedRequests(tb, rename), len(rename)
