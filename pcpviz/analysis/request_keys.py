"""Requests matched across runs by their prompts: ``request_keys(trace)``.

Request ids do not carry over between runs (vLLM's ``LLM`` names a request ``"{i}-{random}"``, the
engine ``"req{i}"``), so ``diff``, ``explain`` and the parity report match a request of one run to one of
another by ``(prompt length, last prompt token, n)``, read from rank 0's target records. A PCP=2 run
that prefilled ``req0`` (23 tokens, the last one 871) and ``req1`` (25 tokens, the last one 871 too)
gives ``{"req0": (23, 871, 0), "req1": (25, 871, 0)}``; a second 23-token prompt ending in 871 would be
``(23, 871, 1)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from pcpviz.analysis.parallel import PARALLEL_FROM
from pcpviz.reference.batch import record_query_start_loc
from pcpviz.trace import Trace
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.index import fork_map, fork_workers

__all__ = ["request_keys", "peek_reader", "KEY_RUNS"]


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
