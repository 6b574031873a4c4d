"""The signature of each registered fault, as confirmation and contradiction predicates over a
trace: ``RULES[name](f) -> Signature(confirms, contradicts)``.

``pcpviz.analysis.explain`` calls a fault ``matches`` only when its check fails, at least one
predicate *specific to that fault* confirms it, and nothing contradicts it. A predicate that
cannot decide (its views were not recorded, nothing wrong to read) says nothing: it neither
confirms nor contradicts. Each predicate reads what the fault's ``signature`` (``pcpviz.faults``)
predicts exactly, not a symptom many bugs share: "row 0 wrong" is shared by every bug that
breaks the draft block tables; "every wrong row is all zeros or an older copy of the same
request's row" is what a skipped gather leaves. ``Findings`` computes each reading once.

Worked PCP=2 example (K=2, block_size 16, 3 requests decoding): under
``stale_draft_block_table_rows`` draft_1's ``block_table_draft`` rows 0 and 1 equal
``block_table_global`` and row 2 reads ``[0, 0]``; ``Findings.block_table_rows()`` returns
``wrong={2}, right={0, 1}, foreign=set()``; the rule for ``stale_draft_block_table_rows``
confirms ("rows >= 2 wrong, rows below always right, every wrong row stale") and the rule for
``skip_draft_block_table_gather`` contradicts ("row 0 is always right"). Had row 2 read request
0's row instead (a wrong request's row), both would be contradicted ("row 2 holds another
request's blocks") and explain would name the mechanism instead of a fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pcpviz import faults as F
from pcpviz.analysis.explain.findings import Findings

__all__ = ["Findings", "Signature", "RULES", "UNSEEN"]


@dataclass(frozen=True)
class Signature:
    """What one fault's predicates read in a trace: the evidence specific to it, and what rules
    it out (each a sentence naming the step/row/view seen)."""

    confirms: tuple[str, ...] = ()
    contradicts: tuple[str, ...] = ()

    def __add__(self, other: "Signature") -> "Signature":
        return Signature(self.confirms + other.confirms, self.contradicts + other.contradicts)


def _yes(why: str) -> Signature:
    return Signature(confirms=(why,))


def _no(why: str) -> Signature:
    return Signature(contradicts=(why,))


NOTHING = Signature()


Rule = Callable[[Findings], Signature]


def _skip_gather(f: Findings) -> Signature:
    wrong, right, foreign = f.block_table_rows()
    if not wrong:
        return NOTHING
    if foreign:
        return _no(f"draft block-table rows {sorted(foreign)[:6]} hold blocks that are neither zeros nor an older "
                   "copy of their own request's row (another request's row?): not a gather left out")
    if 0 not in wrong:
        return _no(f"rows below {min(wrong)} are always right: the gather ran, for some rows only")
    return _yes(f"draft block-table rows wrong from row 0 on (rows {sorted(wrong)[:6]}), each all zeros or an "
                "older copy of its own row: no row was gathered")


def _stale_rows(f: Findings) -> Signature:
    wrong, right, foreign = f.block_table_rows()
    if not wrong:
        return NOTHING
    if foreign:
        return _no(f"draft block-table rows {sorted(foreign)[:6]} hold another request's (or no earlier) blocks, "
                   "not stale ones")
    moves = f.boundary_moves()
    if moves:
        return _no(f"the first wrong row moves with the batch size ({moves}): rows past the batch's end, not "
                   "rows past a fixed launch capacity")
    n = min(wrong)
    if n >= 1 and all(i in right for i in range(n)):
        return _yes(f"draft block-table rows >= {n} are wrong, rows below {n} always right, every wrong row "
                    f"stale (zeros or an older copy): a gather that covers {n} rows")
    return _no("row 0 is wrong too: not rows left past a launch's capacity")


_NO_SLOT_MISMATCH = "every draft-decode slot is the slot of its position in the request's global row"


def _fold(f: Findings) -> Signature:
    k = f.draft_slot_mismatches()
    bad = sum(k.values())
    if not bad:
        return _no(_NO_SLOT_MISMATCH) if f.failed("draft_decode_replicated") else NOTHING
    if k["pad"] != bad:
        return _no(f"{bad - k['pad']} of {bad} wrong draft-decode slots are real slots, not PAD")
    rows = f.pad_rows_past_fold()
    if rows is None:
        return _no("PAD draft-decode slots in rows below R // N, or rows past R // N written: not a fold by N")
    return _yes(f"all {bad} wrong draft-decode slots are PAD (-1), exactly the rows from R // N on ({rows})")


def _slot_seq_len(f: Findings) -> Signature:
    k = f.draft_slot_mismatches()
    bad = sum(k.values())
    if not bad:
        return _no(_NO_SLOT_MISMATCH) if f.failed("draft_decode_replicated") else NOTHING
    if k["next_block"] == bad:
        return _yes(f"all {bad} wrong draft-decode slots sit one position before a block boundary "
                    f"(position % {f.block_size} == {f.block_size - 1}) and land in the next block")
    return _no(f"{bad - k['next_block']} of {bad} wrong draft-decode slots are not at a block boundary")


def _drift(f: Findings) -> Signature:
    out = NOTHING
    if f.failed("draft_last_token_indices"):
        out += _no("draft_last_token_indices fails too: the draft positions follow wrong last-token rows")
    offs = f.draft_position_offsets()
    shifted = {r: o for r, o in offs.items() if any(x != 0 for x in o)}
    if not shifted:
        if f.failed("draft_positions_advance"):
            out += _no("draft_1 starts right after the last accepted token everywhere: no cursor drift")
        return out
    s0 = f.drift_onset()
    if s0 is not None:
        top = max(max(o) for o in shifted.values())
        return out + _yes(f"in {len(shifted)} requests draft_1 runs ahead of the last accepted token by exactly "
                          f"the request's rejections since step {s0} (up to {top}): a cursor never rolled back")
    r = next(iter(shifted))
    return out + _no(f"draft position offsets (request {r}: {shifted[r][:8]}) are not the requests' "
                     "rejections accumulated from one step on: not a cursor drifting with rejections")


def _cpu_cursor(f: Findings) -> Signature:
    seen, other = f.local_position_offsets()
    if not seen and not other:
        return NOTHING
    if other:
        return _no(f"local positions off by something other than the previous step's rejections ({other[0]})")
    return _yes(f"on {seen} wrong local rows the position is ahead of the global one by exactly the "
                "request's CPU-cursor lag (num_computed_tokens - first position: the last step's rejections)")


def _sample_local(f: Findings) -> Signature:
    local, clamped, other = f.sampled_rows_pattern()
    if other:
        return _no(f"sampled_logits_rows differ from logits_indices where it is not the rank-local clamp "
                   f"({other[0]}), or sampled_from says 'global'")
    if local and clamped:
        return _yes(f"sampled_from is 'local' and sampled_logits_rows are logits_indices clamped to the "
                    f"rank's rows on {clamped} (step, rank)")
    return NOTHING


def _hidden_local(f: Findings) -> Signature:
    if not (f.trace.run_meta.pcp or 1) > 1:
        return _no("PCP = 1: the local tensor is the global one")
    clamped, other = f.last_token_clamp()
    if other:
        return _no(f"draft_last_token_indices are wrong where they are not the global rows clamped to the "
                   f"rank's local rows ({other[0]})")
    if clamped:
        return _yes(f"draft_last_token_indices are the last accepted global rows clamped to the rank's "
                    f"P - 1 local rows on {clamped} (step, rank): the rank-local tensor read at global rows")
    return NOTHING


def _rank_divergent(f: Findings) -> Signature:
    v = f.first("ranks_agree")
    if v is None:
        return NOTHING
    # verify_greedy and num_accepted_from_tokens failing on a higher rank at that verify are this
    # fault's own symptoms (that rank's count disagrees with the tokens it and rank 0 verified)
    own = ("verify_greedy", "num_accepted_from_tokens")
    others = [c for c in f.report.failed if c != "ranks_agree" and f.first(c).step <= v.step
              and not (c in own and f.first(c).step == v.step and f.first(c).rank != f.rank)]
    out = NOTHING
    if others:
        out += _no(f"other checks fail by then ({', '.join(others[:3])}): ranks disagreeing is their consequence")
    if v.phase != "verify":
        return out + _no(f"ranks first disagree in {v.phase}, not in verify")
    less = f.accepted_one_less(v.step, v.rank)
    if less is None:
        return out + _no(f"at step {v.step} rank {v.rank} does not accept exactly one draft fewer than rank "
                         f"{f.rank} where they differ")
    return out + _yes(f"ranks first disagree in verify (step {v.step}): rank {v.rank} accepts exactly one draft "
                      f"fewer than rank {f.rank} in rows {less[:6]}")


_TARGET_READS = frozenset(("padded_gather_idx", "per_rank_num_tokens"))
_DRAFT_READS = {v: frozenset((v, "draft_global_input_ids")) for v in ("draft_input_ids", "fwd_input_ids")}


def _global_rows_read(f: Findings, view: str) -> tuple[int, int]:
    """(wrong, seen): the (step, rank) where draft_0's ``view`` (``draft_input_ids``, the ids the
    engine's drafter consumed; ``fwd_input_ids``, what vLLM's draft forward consumed) is not the
    rank's rows of the global shifted ids, and of those, the ones where it is their first rows."""
    t = f.trace
    seen = wrong = 0
    if not _DRAFT_READS[view] <= t.views_anywhere("draft_0"):
        return 0, 0  # no step recorded what this rule compares
    for r in t.ranks:
        for step in t.rank_steps(r):
            if not (t.has(step, r, "draft_0") and t.has(step, r, "target")):
                continue
            if not (_DRAFT_READS[view] <= t.view_names(step, r, "draft_0")
                    and _TARGET_READS <= t.view_names(step, r, "target")):
                continue  # (most steps, where no draft forward's consumed ids were recorded)
            d0, tgt = t.lazy_record(step, r, "draft_0"), t.lazy_record(step, r, "target")
            dii, dgi = np.asarray(d0[view]), np.asarray(d0["draft_global_input_ids"])
            p = dii.shape[0]
            n = min(int(np.asarray(tgt["per_rank_num_tokens"])[r]), p)
            rows = np.asarray(tgt["padded_gather_idx"])[r * p: r * p + n]
            if rows.size and rows.max() < dgi.shape[0] and np.array_equal(dii[:n], dgi[rows]):
                continue
            wrong += 1
            m = min(p, dgi.shape[0])
            seen += bool(np.array_equal(dii[:m], dgi[:m]))
    return wrong, seen


def _captured_buffers(f: Findings) -> Signature:
    """draft_0's local ids equal the first rows of the global shifted ids, not the rank's rows."""
    wrong, seen = _global_rows_read(f, "draft_input_ids")
    if not wrong:
        return NOTHING
    if seen == wrong:
        return _yes(f"on {wrong} (step, rank) draft_0's ids are the first rows of the global shifted ids, "
                    "not the rank's rows: the buffers a captured graph reads")
    return _no(f"{wrong - seen} of {wrong} wrong draft_0 inputs are not the global buffer's first rows")


def _captured_buffers_unseen(f: Findings, sym) -> Signature:
    """The recording cannot show this fault to its check when the recorder logs the ids the drafter
    was handed (vLLM's plugin and replay). Where it also recorded what the draft forward consumed
    (``fwd_input_ids``, ``recording.consumed``), those say it directly: the first rows of the global
    shifted ids instead of the rank's rows. Else the symptoms alone say whether it fits. Either way
    never more than consistent."""
    meta = f.trace.run_meta
    if meta.producer == "pcpviz-engine" or not (meta.pcp or 1) > 1:
        return NOTHING
    wrong, seen = _global_rows_read(f, "fwd_input_ids")
    if wrong:
        if seen < wrong:
            return _no(f"{wrong - seen} of {wrong} draft-prefill forwards consumed ids that are neither the rank's "
                       "rows nor the global buffer's first rows")
        return Signature(confirms=(
            f"on {wrong} (step, rank) the draft prefill's forward consumed the first rows of the global shifted "
            "ids (fwd_input_ids), not the rank's rows it was handed (draft_input_ids): the buffers its captured "
            "graph reads" + (f" (cudagraph_mode {meta.cudagraph_mode})" if meta.cudagraph_mode else ""),))
    if not (sym.acceptance_dropped and 0 in sym.dropped_positions and sym.outputs_same
            and sym.only_layout_before_drafts):
        return NOTHING
    d = sym.drafts_first_differ
    return Signature(confirms=(
        f"the recorder ({meta.recorded_value('producer')}) logs the ids the drafter was handed, not what a "
        "replayed graph read: draft_input_ids cannot see this fault here",
        "acceptance collapses from position 0 with the same outputs",
        f"drafts first differ at step {d['step']} ({d['phase']}) after differences only in the "
        f"padded rank-local layout" + (f" (cudagraph_mode {meta.cudagraph_mode})"
                                       if meta.cudagraph_mode else "")))


def _decodes_read_prefill_batch(f: Findings) -> Signature:
    """draft_1's inputs are the draft prefill batch's first rows (with replicated decodes: the global
    draft ids in decode order) rather than draft_0's tokens."""
    t = f.trace
    seen = wrong = 0
    for r in t.ranks:
        for step in t.rank_steps(r):
            if not (t.has(step, r, "draft_0") and t.has(step, r, "draft_1")):
                continue
            d0, d1 = t.record(step, r, "draft_0"), t.record(step, r, "draft_1")
            if not all(v in d0 for v in ("draft_global_input_ids", "draft_tokens")) or "draft_input_ids" not in d1:
                continue
            fed, prev = np.asarray(d1["draft_input_ids"]), np.asarray(d0["draft_tokens"])
            if np.array_equal(fed, prev):
                continue
            wrong += 1
            batch = np.asarray(d0["draft_global_input_ids"])
            seen += bool(fed.shape[0] <= batch.shape[0] and np.array_equal(fed, batch[: fed.shape[0]]))
    if not wrong:
        return NOTHING
    if seen == wrong:
        return _yes(f"on {wrong} (step, rank) draft_1 was fed the first rows of the draft prefill's ids, not "
                    "draft_0's tokens: the draft prefill's batch, left set")
    return _no(f"{wrong - seen} of {wrong} wrong draft_1 inputs are not the draft prefill's first rows")

RULES: dict[str, Rule] = {
    F.SKIP_DRAFT_BLOCK_TABLE_GATHER: _skip_gather,
    F.FOLD_SLOT_MAPPING_WITHOUT_SHAPE_CHECK: _fold,
    F.POSITIONS_FROM_CPU_CURSOR: _cpu_cursor,
    F.SAMPLE_LOCAL_LOGITS: _sample_local,
    F.RANK_DIVERGENT_ACCEPTANCE: _rank_divergent,
    F.STALE_DRAFT_BLOCK_TABLE_ROWS: _stale_rows,
    F.DRAFT_SLOT_FROM_SEQ_LEN: _slot_seq_len,
    F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION: _drift,
    F.DRAFT_HIDDEN_RANK_LOCAL: _hidden_local,
    F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS: _captured_buffers,
    F.DRAFT_DECODES_READ_PREFILL_BATCH: _decodes_read_prefill_batch,
}
"""Fault name -> its confirmation/contradiction predicates: one for every fault the engine
injects (``pcpviz.faults.faults_of(ENGINE)``; tests/analysis/test_fault_registry.py checks)."""

UNSEEN: dict[str, Callable[[Findings, Any], Signature]] = {
    F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS: _captured_buffers_unseen,
}
"""Faults a recording can hide from their check: name -> predicates over the symptoms, consulted
when the check passes; what they confirm makes the fault ``consistent`` (never ``matches``)."""
