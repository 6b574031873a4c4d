"""Two runs of the same prompts that scheduled them differently, compared request by request.

vLLM's engine core adds requests as they arrive, so two runs of the same four prompts can batch
them differently: the shipped PCP=2 trace ran request 0 alone for two steps and the other three
from step 2, a PCP=1 run of the same prompts from step 1. Compared step by step, every view after
that differs although every request was fed, drafted and verified identically. When the two
schedules differ (``same_schedule``), ``pcpviz.diff`` compares each request's own timeline
instead: its k-th scheduled step in run A against its k-th in run B, the request's slice of every
global view (its query rows of the token views, its row of the request views, its logits rows and
last-token index relative to its first row, its verify row and its draft rows)::

    request 2-9daaa9bc, its 3rd step (a step 4, b step 3): draft_1 draft_tokens [*41] vs [*44]

Draft tokens the next verification rejected in both runs are not held against either (two correct
bf16 runs may draft them differently; the diff counts them in a note). A request scheduled a
different number of times is a divergence too. Block ids follow the order
requests were allocated in, which another schedule changes, so block-table rows and slots are
compared up to a renaming of the blocks that must stay one-to-one over the whole run
(``BlockMap``): the same blocks, in the same places, under other names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from pcpviz.analysis.compare import first_difference, short_repr
from pcpviz.analysis.parallel import PARALLEL_FROM
from pcpviz.analysis.request_keys import peek_reader
from pcpviz.reference.batch import record_query_start_loc
from pcpviz.trace.bounds import well_formed
from pcpviz.trace.index import fork_map, fork_workers
from pcpviz.trace.schema import causal_phase_key, view_spec

__all__ = ["RequestStep", "request_timelines", "same_schedule", "compare_timelines"]


@dataclass(frozen=True)
class RequestStep:
    """One request in one step: the step and its slice of each global view, ``(phase, view)``."""

    step: int
    views: dict[tuple[str, str], np.ndarray]


def _slice(kind: tuple, a: np.ndarray, i: int, lo: int, hi: int, n_req: int) -> np.ndarray | None:
    """Request ``i``'s part of a view aligned as ``kind`` (the schema's ``ViewSpec.align``)."""
    tag = kind[0]
    try:
        if tag == "req":
            ax = kind[1] % a.ndim
            return np.take(a, i, axis=ax) if a.shape[ax] == n_req else None
        if tag == "tok":
            ax = kind[1] % a.ndim
            return np.take(a, np.arange(lo, hi), axis=ax) if a.shape[ax] >= hi else None
        if tag == "tokidx":
            v = a.astype(np.int64)
            return v[(v >= lo) & (v < hi)] - lo
        if tag == "tokidx_req":
            return np.asarray(int(a[i]) - lo) if a.shape[0] == n_req else None
        if tag == "qsl":
            return np.asarray(hi - lo)
        if tag == "scalar":
            return a
    except (IndexError, ValueError):
        return None
    return None


def request_timelines(trace: Any, rank: int, *, rename: Callable[[str], str] = str,
                      ignore: frozenset[str] | set[str] = frozenset()) -> dict[str, list[RequestStep]]:
    """Each request's scheduled steps on ``rank``, in order, with its slice of every global view.
    A step that breaks a bound (``pcpviz.trace.bounds``) is left out: its sizes cannot be sliced
    by, and the step-by-step comparison reports it as malformed."""
    out: dict[str, list[RequestStep]] = {}
    for step in trace.rank_steps(rank):
        if not trace.has(step, rank, "target") or not well_formed(trace, step, rank):
            continue
        tgt = trace.record(step, rank, "target")
        qsl = record_query_start_loc(tgt)
        if qsl is None or "req_ids" not in tgt:
            continue
        rids = [rename(r) for r in np.asarray(tgt["req_ids"]).astype(str).tolist()]
        n = len(rids)
        phases = sorted(trace.phases(step, rank), key=causal_phase_key)
        recs = {ph: trace.record(step, rank, ph) for ph in phases if ph != "dummy"}
        rej = np.asarray(recs["verify"]["num_rejected"], dtype=np.int64) if "verify" in recs and \
            "num_rejected" in recs["verify"] and len(recs["verify"]["num_rejected"]) == n else None
        for i, rid in enumerate(rids):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            views: dict[tuple[str, str], np.ndarray] = {}
            for ph, rec in recs.items():
                for name in rec.keys():
                    spec = view_spec(ph, name)
                    kind = spec.align if spec is not None else (("req", 0) if ph == "verify" else None)
                    if kind is None or name in ignore or name == "req_ids":
                        continue
                    part = _slice(kind, np.asarray(rec[name]), i, lo, hi, n)
                    if part is None:
                        continue
                    if ph == "draft_0" and name == "draft_global_input_ids" and rej is not None:
                        part = np.where(np.arange(hi - lo) < (hi - lo) - rej[i], part, -1)  # stale rows
                    views[(ph, name)] = part
            out.setdefault(rid, []).append(RequestStep(step, views))
    return out


def _batch(rec: Any, rename: Callable[[str], str]) -> dict[str, tuple[int, int]] | None:
    """request -> (num_computed_tokens, num_scheduled_tokens) of one target record."""
    if "req_ids" not in rec:
        return None
    rids = [rename(r) for r in np.asarray(rec["req_ids"]).astype(str).tolist()]
    c = np.asarray(rec["num_computed_tokens"]).tolist() if "num_computed_tokens" in rec else [0] * len(rids)
    q = np.asarray(rec["num_scheduled_tokens"]).tolist() if "num_scheduled_tokens" in rec else [0] * len(rids)
    return {r: (int(x), int(y)) for r, x, y in zip(rids, c, q)}


def same_schedule(ta: Any, tb: Any, *, rank_a: int, rank_b: int, rename_b: Callable[[str], str] = str) -> int | None:
    """None when both runs scheduled the same requests with the same cursors at every step both
    recorded, else the first step where they differ (a step one run lacks, or one that breaks a
    bound, is the step-by-step comparison's to report, not a different schedule). A long trace is
    read in ``SCHEDULE_RUNS`` runs of steps in forked processes (``pcpviz.trace.index.fork_map``),
    the first run's answer that is not None taken: the step one pass would stop at."""
    steps = sorted(set(ta.rank_steps(rank_a)) & set(tb.rank_steps(rank_b)))
    workers = fork_workers() if len(steps) >= PARALLEL_FROM else 1
    cuts = [round(i * len(steps) / SCHEDULE_RUNS) for i in range(SCHEDULE_RUNS + 1)] if workers > 1 else [0, len(steps)]

    def first(i: int) -> int | None:
        return _first_other(ta, tb, steps[cuts[i]:cuts[i + 1]], ranks=(rank_a, rank_b), rename_b=rename_b)

    return next((step for step in fork_map(first, len(cuts) - 1, workers=workers) if step is not None), None)


SCHEDULE_RUNS = 8
"""Runs of consecutive steps ``same_schedule`` cuts a long trace into."""


def _first_other(ta: Any, tb: Any, steps: list[int], *, ranks: tuple[int, int],
                 rename_b: Callable[[str], str]) -> int | None:
    rank_a, rank_b = ranks
    read_a, read_b = peek_reader(ta), peek_reader(tb)  # three views a step, each row checked as it is read
    for step in steps:
        ha, hb = ta.has(step, rank_a, "target"), tb.has(step, rank_b, "target")
        if ha != hb:
            return step
        if ha and _batch(read_a(step, rank_a, "target"), str) != _batch(read_b(step, rank_b, "target"), rename_b) \
                and well_formed(ta, step, rank_a) and well_formed(tb, step, rank_b):
            return step  # (a malformed step schedules nothing readable: step by step reports it)
    return None


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


class BlockMap:
    """Block ids of run A matched to run B's, kept one-to-one over the whole comparison: under
    another schedule the allocator hands out other ids, so rows and slots are compared up to that
    renaming (block 16 of a is block 71 of b: fine, as long as it is every time and no other a
    block is also b's 71). Per KV-cache group; the null block 0 is itself."""

    def __init__(self, block_size: int | None) -> None:
        self.block_size = block_size
        self.ab: dict[tuple[int, int], int] = {}
        self.ba: dict[tuple[int, int], int] = {}

    def _pair(self, g: int, a: int, b: int) -> str | None:
        if (a == 0) != (b == 0):
            return f"block {a} of a is block {b} of b (the null block on one side only)"
        if self.ab.setdefault((g, a), b) != b:
            return f"block {a} of a is block {b} of b here, block {self.ab[(g, a)]} of b before"
        if self.ba.setdefault((g, b), a) != a:
            return f"block {b} of b is block {a} of a here, block {self.ba[(g, b)]} of a before"
        return None

    def rows(self, a: np.ndarray, b: np.ndarray) -> tuple[tuple[int, ...] | None, str] | None:
        """``(index, reason)`` where block-table rows ``[G, W]`` disagree (trailing zeros are the
        step's trim, not the request's), None if they match up to the renaming."""
        a2, b2 = np.atleast_2d(a).astype(np.int64), np.atleast_2d(b).astype(np.int64)
        if a2.shape[0] != b2.shape[0]:
            return None, f"{a2.shape[0]} KV-cache groups in a, {b2.shape[0]} in b"
        for g in range(a2.shape[0]):
            ra, rb = np.trim_zeros(a2[g], "b"), np.trim_zeros(b2[g], "b")
            if ra.shape != rb.shape:
                return (g, min(ra.shape[0], rb.shape[0])), f"{ra.shape[0]} blocks in a, {rb.shape[0]} in b"
            for j, (x, y) in enumerate(zip(ra.tolist(), rb.tolist())):
                why = self._pair(g, x, y)
                if why:
                    return (g, j), why
        return None

    def slots(self, a: np.ndarray, b: np.ndarray) -> tuple[tuple[int, ...] | None, str] | None:
        """Slot mappings ``[G, n]`` (or ``[G]``) that disagree up to the block renaming."""
        if self.block_size is None:
            return None
        a2, b2 = np.atleast_1d(a).astype(np.int64), np.atleast_1d(b).astype(np.int64)
        if a2.shape != b2.shape:
            return None, f"shape {list(b2.shape)}, expected {list(a2.shape)}"
        bs = self.block_size
        for idx in zip(*np.nonzero((a2 >= 0) | (b2 >= 0))):
            x, y = int(a2[idx]), int(b2[idx])
            if (x < 0) != (y < 0) or x % bs != y % bs:
                return tuple(int(i) for i in idx), f"slot {x} of a, {y} of b: another offset in its block"
            why = self._pair(int(idx[0]) if a2.ndim > 1 else 0, x // bs, y // bs)
            if why:
                return tuple(int(i) for i in idx), f"slot {x} of a, {y} of b: {why}"
        return None


_BLOCK_VIEWS = {("target", "block_table_global"), ("draft_k", "block_table_draft")}
_SLOT_VIEWS = {("target", "slot_mapping_global"), ("draft_k", "slot_mapping_draft")}


def _match(blocks: BlockMap, ph: str, view: str, a: np.ndarray, b: np.ndarray):
    """``(differs, index, reason)``; block tables and slots up to the block renaming."""
    key = (ph if not ph.startswith("draft_") or ph == "draft_0" else "draft_k", view)
    if key in _BLOCK_VIEWS or key in _SLOT_VIEWS:
        bad = (blocks.rows if key in _BLOCK_VIEWS else blocks.slots)(a, b)
        return (False, None, "") if bad is None else (True, bad[0], bad[1])
    return first_difference(a, b)


def _accepted(st: RequestStep) -> int:
    v = st.views.get(("verify", "num_accepted"))
    return int(v) if v is not None and np.asarray(v).ndim == 0 else 0


def _rejected_in_both(phase: str, view: str, next_accepted: int) -> bool:
    """A draft view whose token the request's next verification rejected in both runs (or never
    verified: its last step): ``draft_k``'s ``draft_tokens`` for k >= the drafts accepted next, and
    the ``draft_input_ids`` that feed on them. Two correct bf16 runs may draft those differently
    (the drafter's argmax under another batch); nothing downstream depends on them."""
    if not phase.startswith("draft_"):
        return False
    d = int(phase.split("_")[1])
    return (view == "draft_tokens" and d >= next_accepted) or (view == "draft_input_ids" and d >= 1
                                                                and d - 1 >= next_accepted)


def _phase_skipped_in_one(phase: str, next_accepted: int) -> bool:
    """A draft phase recorded in one run only, whose tokens were never accepted: vLLM skips the
    drafts of a step where no request needs them (``skip_drafts``), which depends on the batch."""
    return phase.startswith("draft_") and int(phase.split("_")[1]) >= next_accepted


def _mask_rejected_drafts(sa: RequestStep, sb: RequestStep, a: np.ndarray, b: np.ndarray, accepted: int):
    """The draft rows of a verification step's ``input_ids`` that both runs rejected, blanked (-1)
    in both; ``(a, b, whether a masked row differed)``."""
    nd = sa.views.get(("target", "num_draft_tokens"))
    if nd is None or a.shape != b.shape or a.ndim != 1:
        return a, b, False
    nd = int(nd)
    rows = np.arange(a.shape[0]) - (a.shape[0] - nd)  # draft index of each row (< 0: not a draft)
    drop = rows >= accepted
    if not drop.any():
        return a, b, False
    differed = bool((a[drop] != b[drop]).any())
    return np.where(drop, -1, a), np.where(drop, -1, b), differed


def compare_timelines(ta: Any, tb: Any, *, rank_a: int, rank_b: int, rename_b: Callable[[str], str] = str,
                      ignore: frozenset[str] | set[str] = frozenset()) -> Iterator[dict[str, Any]]:
    """Every divergence between the two runs' request timelines, as ``pcpviz.diff.Divergence``
    keyword arguments (A's step; the message names B's). Also yields ``{"compared": n}`` records
    counting the views compared per request step, and ``{"benign": 1}`` for each draft view that
    differs but was rejected in both runs (``_rejected_in_both``: not a divergence)."""
    la = request_timelines(ta, rank_a, ignore=ignore)
    lb = request_timelines(tb, rank_b, rename=rename_b, ignore=ignore)
    bs = ta.run_meta.block_size
    blocks = BlockMap(bs if bs == tb.run_meta.block_size else None)
    for rid in list(la) + [r for r in lb if r not in la]:
        ea, eb = la.get(rid, []), lb.get(rid, [])
        acc = [max(_accepted(x), _accepted(y)) for x, y in zip(ea, eb)] + [0]
        if len(ea) != len(eb):
            first = (ea if len(ea) > len(eb) else eb)[min(len(ea), len(eb))]  # the first step one run lacks
            yield dict(step=first.step if first else 0, phase="target", view="req_ids", rank_a=rank_a,
                       rank_b=rank_b, req_id=rid, message=f"request scheduled in {len(ea)} steps in a, "
                       f"{len(eb)} in b")
        for k, (sa, sb) in enumerate(zip(ea, eb), start=1):
            keys = list(sa.views) + [v for v in sb.views if v not in sa.views]
            yield {"compared": len(keys)}
            for ph, view in keys:
                where = f"its {_ordinal(k)} step (a step {sa.step}, b step {sb.step})"
                one_side = (ph, view) not in sa.views or (ph, view) not in sb.views
                if _rejected_in_both(ph, view, acc[k]) or (one_side and _phase_skipped_in_one(ph, acc[k])):
                    if one_side or first_difference(sa.views[(ph, view)], sb.views[(ph, view)])[0]:
                        yield {"benign": 1}
                    continue
                if one_side:
                    yield dict(step=sa.step, phase=ph, view=view, rank_a=rank_a, rank_b=rank_b, req_id=rid,
                               message=f"{where}: view recorded only in run {'a' if (ph, view) in sa.views else 'b'}")
                    continue
                a, b = sa.views[(ph, view)], sb.views[(ph, view)]
                if (ph, view) == ("target", "input_ids"):
                    a, b, masked = _mask_rejected_drafts(sa, sb, a, b, acc[k - 1])
                    if masked:
                        yield {"benign": 1}
                differs, idx, reason = _match(blocks, ph, view, a, b)
                if differs:
                    yield dict(step=sa.step, phase=ph, view=view, rank_a=rank_a, rank_b=rank_b, req_id=rid, index=idx,
                               message=f"{where}: {reason}", expected=short_repr(a, idx), actual=short_repr(b, idx))
