"""The signature of each registered fault, as a rule over a trace: ``RULES[name](f) -> [(weight, why)]``.

``pcpviz.analysis.explain`` scores a fault hypothesis by the check that catches it (``Fault.caught_by``)
and then by these rules, each a small reading of the trace that a fault's ``signature``
(``pcpviz.faults``) predicts. A positive weight supports the fault, a negative one
contradicts it; the text says what was seen. ``Findings`` computes each reading once.

Worked PCP=2 example (K=2, block_size 16, 3 requests decoding): under
``stale_draft_block_table_rows`` draft_1's ``block_table_draft`` rows 0 and 1 equal
``block_table_global`` and row 2 reads ``[0, 0]``; ``Findings.block_table_rows()`` returns
``wrong={2}, right={0, 1}``; the rule for ``stale_draft_block_table_rows`` answers
``[(+4, "draft block-table rows >= 2 are wrong, rows below 2 always right ...")]`` and the rule
for ``skip_draft_block_table_gather`` answers ``[(-6, "row 0 is always right ...")]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np

from pcpviz import faults as F
from pcpviz.trace import draft_index

__all__ = ["Findings", "RULES", "UNSEEN"]


def _g(a: Any) -> np.ndarray:
    """The first KV-cache group of a [G, ...] view (or the view itself)."""
    a = np.asarray(a)
    return a[0] if a.ndim >= 2 and a.shape[0] == 1 else a


@dataclass
class Findings:
    """What the rules read: the trace, its check report, and readings computed on demand
    (over the lowest rank; the views read are global and identical on every rank)."""

    trace: Any
    report: Any  # pcpviz.analysis.checks.CheckReport

    @property
    def rank(self) -> int:
        return self.trace.ranks[0]

    def failed(self, check: str) -> bool:
        return check in self.report.failed

    def first(self, check: str):
        r = self.report.results.get(check)
        return None if r is None else r.first_violation

    def _draft_decodes(self):
        """(step, phase, target record, draft record) for every draft_k, k >= 1, of the lowest rank."""
        t, r = self.trace, self.rank
        for step in t.rank_steps(r):
            phases = t.phases(step, r)
            if "target" not in phases:
                continue
            tgt = None
            for ph in phases:
                k = draft_index(ph)
                if k is None or k < 1:
                    continue
                tgt = tgt if tgt is not None else t.record(step, r, "target")
                yield step, ph, tgt, t.record(step, r, ph)

    @cached_property
    def block_size(self) -> int | None:
        bs = self.trace.meta.get("block_size")
        return int(bs) if isinstance(bs, int) and bs > 0 else None

    def block_table_rows(self) -> tuple[set[int], set[int]]:
        """(rows of block_table_draft that ever differ from block_table_global, rows that always agree)."""
        if "_bt" not in self.__dict__:
            wrong, seen = set(), set()
            for _, _, tgt, rec in self._draft_decodes():
                if "block_table_draft" not in rec or "block_table_global" not in tgt:
                    continue
                d, g = _g(rec["block_table_draft"]), _g(tgt["block_table_global"])
                rows = min(d.shape[0], g.shape[0])
                w = min(d.shape[1], g.shape[1]) if d.ndim == 2 and g.ndim == 2 else 0
                for i in range(rows):
                    seen.add(i)
                    if not np.array_equal(d[i, :w], g[i, :w]):
                        wrong.add(i)
            self.__dict__["_bt"] = (wrong, seen - wrong)
        return self.__dict__["_bt"]

    def draft_slot_mismatches(self) -> dict[str, int]:
        """Mismatching draft-decode slots by kind: ``pad`` (-1, never written), ``next_block``
        (a position one before a block boundary written in the next block) and ``other``."""
        if "_slots" not in self.__dict__:
            kinds = {"pad": 0, "next_block": 0, "other": 0}
            bs = self.block_size
            for _, _, tgt, rec in self._draft_decodes():
                if bs is None or "slot_mapping_draft" not in rec or "draft_positions" not in rec \
                        or "block_table_global" not in tgt:
                    continue
                table = _g(tgt["block_table_global"]).astype(np.int64)
                pos = np.asarray(rec["draft_positions"], dtype=np.int64)
                act = _g(rec["slot_mapping_draft"]).astype(np.int64).ravel()
                n = min(pos.shape[0], act.shape[0], table.shape[0])
                if table.ndim != 2 or table.shape[1] == 0:
                    continue

                def block(i: int, b: int) -> int:
                    return int(table[i, b]) if 0 <= b < table.shape[1] else 0

                for i in range(n):
                    p = int(pos[i])
                    exp = block(i, p // bs) * bs + p % bs
                    if int(act[i]) == exp:
                        continue
                    if int(act[i]) == -1:
                        kinds["pad"] += 1
                    elif p % bs == bs - 1 and int(act[i]) == block(i, (p + 1) // bs) * bs + p % bs:
                        kinds["next_block"] += 1
                    else:
                        kinds["other"] += 1
            self.__dict__["_slots"] = kinds
        return self.__dict__["_slots"]

    def draft_position_offsets(self) -> dict[str, list[int]]:
        """Per request, in step order: draft_1's position minus (positions[draft_last_token_indices] + 1)."""
        if "_off" not in self.__dict__:
            out: dict[str, list[int]] = {}
            for step, ph, tgt, rec in self._draft_decodes():
                if draft_index(ph) != 1 or not self.trace.has(step, self.rank, "draft_0"):
                    continue
                d0 = self.trace.record(step, self.rank, "draft_0")
                if not all(v in tgt for v in ("positions", "req_ids")) or "draft_last_token_indices" not in d0 \
                        or "draft_positions" not in rec:
                    continue
                pos = np.asarray(tgt["positions"], dtype=np.int64)
                lti = np.asarray(d0["draft_last_token_indices"], dtype=np.int64)
                dp = np.asarray(rec["draft_positions"], dtype=np.int64)
                for i, rid in enumerate(np.asarray(tgt["req_ids"]).astype(str).tolist()):
                    if i < lti.shape[0] and i < dp.shape[0] and 0 <= lti[i] < pos.shape[0]:
                        out.setdefault(rid, []).append(int(dp[i] - pos[lti[i]] - 1))
            self.__dict__["_off"] = out
        return self.__dict__["_off"]


Rule = Callable[[Findings], list[tuple[float, str]]]


def _skip_gather(f: Findings) -> list[tuple[float, str]]:
    wrong, right = f.block_table_rows()
    if not wrong:
        return []
    if 0 in wrong:
        return [(4, f"draft block-table rows wrong from row 0 on (rows {sorted(wrong)[:6]}): no row was gathered")]
    return [(-6, f"rows below {min(wrong)} are always right: the gather ran, for some rows only")]


def _stale_rows(f: Findings) -> list[tuple[float, str]]:
    wrong, right = f.block_table_rows()
    if not wrong:
        return []
    n = min(wrong)
    if n >= 1 and all(i in right for i in range(n)):
        return [(4, f"draft block-table rows >= {n} are wrong, rows below {n} always right: a gather "
                    f"that covers {n} rows, later rows stale")]
    return [(-6, "row 0 is wrong too: not rows left past a launch's capacity")]


_NO_SLOT_MISMATCH = (-4, "every draft-decode slot is the slot of its position in the request's global row: "
                        "draft_decode_replicated fails for another reason (a null block, a shape)")


def _fold(f: Findings) -> list[tuple[float, str]]:
    k = f.draft_slot_mismatches()
    bad = sum(k.values())
    if not bad:
        return [_NO_SLOT_MISMATCH] if f.failed("draft_decode_replicated") else []
    if k["pad"] == bad:
        return [(4, f"all {bad} wrong draft-decode slots are PAD (-1): their KV was never written")]
    return [(-6, f"{bad - k['pad']} of {bad} wrong draft-decode slots are real slots, not PAD")]


def _slot_seq_len(f: Findings) -> list[tuple[float, str]]:
    k = f.draft_slot_mismatches()
    bad = sum(k.values())
    if not bad:
        return [_NO_SLOT_MISMATCH] if f.failed("draft_decode_replicated") else []
    if k["next_block"] == bad:
        return [(4, f"all {bad} wrong draft-decode slots sit one position before a block boundary "
                    f"(position % {f.block_size} == {f.block_size - 1}) and land in the next block")]
    return [(-6, f"{bad - k['next_block']} of {bad} wrong draft-decode slots are not at a block boundary")]


def _drift(f: Findings) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    if f.failed("draft_last_token_indices"):
        out.append((-6, "draft_last_token_indices fails too: the draft positions follow wrong last-token rows"))
    offs = f.draft_position_offsets()
    shifted = {r: o for r, o in offs.items() if any(x != 0 for x in o)}
    if not shifted:
        if f.failed("draft_positions_advance"):
            out.append((-4, "draft_1 starts right after the last accepted token everywhere: no cursor drift"))
        return out
    grows = [r for r, o in shifted.items() if all(b >= a for a, b in zip(o, o[1:])) and min(o) >= 0]
    if len(grows) == len(shifted):
        top = max(max(o) for o in shifted.values())
        out.append((4, f"draft positions run ahead of the last accepted token by an offset that only "
                       f"grows per request (up to {top} in {len(shifted)} requests)"))
    else:
        out.append((-4, "draft position offsets shrink or go negative: not a cursor drifting with rejections"))
    return out


def _hidden_local(f: Findings) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    pcp = f.trace.meta.get("pcp")
    if isinstance(pcp, int) and pcp > 1:
        out.append((1, f"PCP = {pcp}: a rank-local tensor differs from the gathered one"))
    v = f.first("ranks_agree")
    if v is not None and v.phase == "draft_0":
        out.append((2, f"ranks first disagree at draft_0 (step {v.step}, {v.view}), before any verify differs"))
    return out


def _rank_divergent(f: Findings) -> list[tuple[float, str]]:
    v = f.first("ranks_agree")
    # Checks failing no later than the ranks first disagree point at a cause; later ones follow the fork.
    others = [c for c in f.report.failed if c != "ranks_agree" and (v is None or f.first(c).step <= v.step)]
    out: list[tuple[float, str]] = []
    if others:
        out.append((-6, f"other checks fail by then ({', '.join(others[:3])}): ranks disagreeing is their consequence"))
    if v is not None and v.phase == "verify":
        out.append((3, f"ranks first disagree in verify (step {v.step}, {v.view}) while every per-rank check passes"
                    if not others else f"ranks first disagree in verify (step {v.step}, {v.view})"))
    elif v is not None:
        out.append((-3, f"ranks first disagree in {v.phase}, not in verify"))
    return out


def _captured_buffers(f: Findings) -> list[tuple[float, str]]:
    """draft_0's local ids equal the first rows of the global shifted ids, not the rank's rows."""
    t = f.trace
    seen = wrong = 0
    for r in t.ranks:
        for step in t.rank_steps(r):
            if not (t.has(step, r, "draft_0") and t.has(step, r, "target")):
                continue
            d0, tgt = t.record(step, r, "draft_0"), t.record(step, r, "target")
            if not all(v in d0 for v in ("draft_input_ids", "draft_global_input_ids")) or \
                    not all(v in tgt for v in ("padded_gather_idx", "per_rank_num_tokens")):
                continue
            dii, dgi = np.asarray(d0["draft_input_ids"]), np.asarray(d0["draft_global_input_ids"])
            p = dii.shape[0]
            n = int(np.asarray(tgt["per_rank_num_tokens"])[r])
            rows = np.asarray(tgt["padded_gather_idx"])[r * p: r * p + n]
            if rows.size and rows.max() < dgi.shape[0] and np.array_equal(dii[:n], dgi[rows]):
                continue
            wrong += 1
            m = min(p, dgi.shape[0])
            seen += bool(np.array_equal(dii[:m], dgi[:m]))
    if not wrong:
        return []
    if seen == wrong:
        return [(4, f"on {wrong} (step, rank) draft_0's ids are the first rows of the global shifted ids, "
                    "not the rank's rows: the buffers a captured graph reads")]
    return [(-6, f"{wrong - seen} of {wrong} wrong draft_0 inputs are not the global buffer's first rows")]


def _captured_buffers_unseen(f: Findings, sym) -> list[tuple[float, str]]:
    """The recording cannot show this fault when the recorder logs the ids the drafter was handed
    (vLLM's plugin): then the symptoms alone say whether it fits."""
    meta = f.trace.meta
    pcp = meta.get("pcp")
    if meta.get("producer") == "pcpviz-engine" or not (isinstance(pcp, int) and pcp > 1):
        return []
    if not (sym.acceptance_dropped and 0 in sym.dropped_positions and sym.outputs_same
            and sym.only_layout_before_drafts):
        return []
    d = sym.drafts_first_differ
    return [(5, f"the recorder ({meta.get('producer')}) logs the ids the drafter was handed, not what a "
                "replayed graph read: draft_input_ids cannot see this fault here"),
            (0, "acceptance collapses from position 0 with the same outputs"),
            (0, f"drafts first differ at step {d['step']} ({d['phase']}) after differences only in the "
                f"padded rank-local layout" + (f" (cudagraph_mode {meta['cudagraph_mode']})"
                                               if meta.get("cudagraph_mode") else ""))]


def _none(f: Findings) -> list[tuple[float, str]]:
    return []


RULES: dict[str, Rule] = {
    F.SKIP_DRAFT_BLOCK_TABLE_GATHER: _skip_gather,
    F.FOLD_SLOT_MAPPING_WITHOUT_SHAPE_CHECK: _fold,
    F.POSITIONS_FROM_CPU_CURSOR: _none,  # its check is the only one that reads local positions
    F.SAMPLE_LOCAL_LOGITS: _none,  # likewise for the sampled rows
    F.RANK_DIVERGENT_ACCEPTANCE: _rank_divergent,
    F.STALE_DRAFT_BLOCK_TABLE_ROWS: _stale_rows,
    F.DRAFT_SLOT_FROM_SEQ_LEN: _slot_seq_len,
    F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION: _drift,
    F.DRAFT_HIDDEN_RANK_LOCAL: _hidden_local,
    F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS: _captured_buffers,
}
"""Fault name -> its signature rule: one for every fault the engine injects
(``pcpviz.faults.faults_of(ENGINE)``; tests/analysis/test_fault_registry.py checks)."""

UNSEEN: dict[str, Callable[[Findings, Any], list[tuple[float, str]]]] = {
    F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS: _captured_buffers_unseen,
}
"""Faults a recording can hide from their check: name -> rule over the symptoms, consulted when the
check passes; evidence there makes the fault ``consistent`` instead of ``ruled out``."""
