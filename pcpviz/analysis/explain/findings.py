"""What the explain predicates read in a trace: ``Findings(trace, report)``, each reading
computed once, over the lowest rank where the views read are global and identical on every
rank, over every rank where they are rank-local.

PCP=2 example: a run whose draft decodes read the null block for batch rows >= 2 gives
``Findings.block_table_rows() == ({2}, {0, 1}, set())`` (wrong rows, rows always right, wrong
rows that are not stale copies)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from pcpviz.trace import draft_index

__all__ = ["Findings"]


def _stale(d: np.ndarray, g: np.ndarray, earlier: list[np.ndarray]) -> bool:
    """A draft block-table row left stale: all zeros, or an older copy of the right row (every
    non-zero entry agrees with it), or what this batch row held at an earlier step."""
    nz = np.flatnonzero(d)
    if nz.size == 0:
        return True
    if nz.max() < g.shape[0] and np.array_equal(d[nz], g[nz]):
        return True
    for e in earlier:
        w = min(d.shape[0], e.shape[0])
        if np.array_equal(d[:w], e[:w]) and not d[w:].any():
            return True
    return False


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
        return self.trace.run_meta.block_size

    def block_table_rows(self) -> tuple[set[int], set[int], set[int]]:
        """(rows of block_table_draft that ever differ from block_table_global, rows that always
        agree, wrong rows that are not stale: neither all zeros (the null block a buffer the
        target never writes holds) nor an older copy of the same request's row (its non-zero
        entries agree) nor the row this batch row held at an earlier step)."""
        if "_bt" not in self.__dict__:
            wrong, seen, foreign = set(), set(), set()
            earlier: list[np.ndarray] = []
            last_step = None
            for step, _, tgt, rec in self._draft_decodes():
                if "block_table_global" not in tgt:
                    continue
                g = _g(tgt["block_table_global"])
                if step != last_step:
                    earlier.append(g)
                    last_step = step
                if "block_table_draft" not in rec:
                    continue
                d = _g(rec["block_table_draft"])
                rows = min(d.shape[0], g.shape[0])
                w = min(d.shape[1], g.shape[1]) if d.ndim == 2 and g.ndim == 2 else 0
                for i in range(rows):
                    seen.add(i)
                    if np.array_equal(d[i, :w], g[i, :w]) and not d[i, w:].any():
                        continue
                    wrong.add(i)
                    if not _stale(d[i], g[i], [e[i] for e in earlier[:-1] if i < e.shape[0]]):
                        foreign.add(i)
            self.__dict__["_bt"] = (wrong, seen - wrong, foreign)
        return self.__dict__["_bt"]

    def boundary_moves(self) -> str | None:
        """A description when the first wrong draft block-table row moves up with the batch size
        (step s: first wrong row j with R_s rows; a later-sized step t with R_t > R_s rows has row j
        right and a higher row wrong): the wrong rows follow the batch's end, not a fixed
        capacity; None otherwise."""
        per: dict[int, tuple[int, set[int], set[int]]] = {}
        prev_g = last_g = prev_step = None
        for step, _, tgt, rec in self._draft_decodes():
            if "block_table_global" not in tgt or "block_table_draft" not in rec:
                continue
            d, g = _g(rec["block_table_draft"]), _g(tgt["block_table_global"])
            if step != prev_step and prev_step is not None:
                prev_g = last_g
            last_g, prev_step = g, step
            rows = min(d.shape[0], g.shape[0])
            w = min(d.shape[1], g.shape[1]) if d.ndim == 2 and g.ndim == 2 else 0
            wrong = {i for i in range(rows) if not (np.array_equal(d[i, :w], g[i, :w]) and not d[i, w:].any())}
            # a right row proves the gather reached it only if a stale copy would have been wrong:
            # its global row changed since the previous step (or did not exist then)
            informative = {i for i in set(range(rows)) - wrong
                           if prev_g is None or i >= prev_g.shape[0] or prev_g.shape[1:] != g.shape[1:]
                           or not np.array_equal(prev_g[i], g[i])}
            n, ws, rs = per.get(step, (rows, set(), set()))
            per[step] = (rows, ws | wrong, rs | informative)
        for s, (rs_, ws, _) in per.items():
            if not ws:
                continue
            j = min(ws)
            for t, (rt, wt, okt) in per.items():
                if rt > rs_ and j in okt and wt and min(wt) > j:
                    return (f"at step {s} ({rs_} rows) row {j} is the first wrong row, at step {t} ({rt} rows) "
                            f"row {j} is right and row {min(wt)} wrong")
        return None

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

    def drift_onset(self) -> int | None:
        """The step s0 from which every request's draft_1 offset (draft position minus
        positions[draft_last_token_indices] + 1) equals its rejections over steps s0..s (this
        step's included: the drafter runs after verification); None when no s0 fits or no
        offset is non-zero."""
        t, r = self.trace, self.rank
        rows: list[tuple[int, str, int, int]] = []  # (step, request, offset, rejections this step)
        for step, ph, tgt, rec in self._draft_decodes():
            if draft_index(ph) != 1 or not (t.has(step, r, "draft_0") and t.has(step, r, "verify")):
                continue
            d0, ver = t.record(step, r, "draft_0"), t.record(step, r, "verify")
            if not all(v in tgt for v in ("positions", "req_ids")) or "draft_last_token_indices" not in d0 \
                    or "draft_positions" not in rec or "num_rejected" not in ver:
                continue
            pos = np.asarray(tgt["positions"], dtype=np.int64)
            lti = np.asarray(d0["draft_last_token_indices"], dtype=np.int64)
            dp = np.asarray(rec["draft_positions"], dtype=np.int64)
            rej = np.asarray(ver["num_rejected"], dtype=np.int64)
            for i, rid in enumerate(np.asarray(tgt["req_ids"]).astype(str).tolist()):
                if i < min(lti.shape[0], dp.shape[0], rej.shape[0]) and 0 <= lti[i] < pos.shape[0]:
                    rows.append((step, rid, int(dp[i] - pos[lti[i]] - 1), int(rej[i])))
        if not any(o for _, _, o, _ in rows):
            return None
        for s0 in sorted({s for s, *_ in rows}):
            total: dict[str, int] = {}
            ok = True
            for step, rid, off, rej in rows:
                if step >= s0:
                    total[rid] = total.get(rid, 0) + rej
                if off != total.get(rid, 0):
                    ok = False
                    break
            if ok:
                return s0
        return None

    def _ranks_target(self):
        """(step, rank, target record) of every rank."""
        t = self.trace
        for r in t.ranks:
            for step in t.rank_steps(r):
                if t.has(step, r, "target"):
                    yield step, r, t.record(step, r, "target")

    def local_position_offsets(self) -> tuple[int, list[str]]:
        """(wrong local rows whose position is ahead of the global one by exactly their request's
        CPU-cursor lag > 0, descriptions of wrong rows that are not)."""
        seen, other = 0, []
        for step, r, tgt in self._ranks_target():
            need = ("local_positions", "positions", "padded_gather_idx", "per_rank_num_tokens",
                    "num_computed_tokens", "num_scheduled_tokens")
            if not all(v in tgt for v in need):
                continue
            lp = np.asarray(tgt["local_positions"], dtype=np.int64)
            pos = np.asarray(tgt["positions"], dtype=np.int64)
            p = lp.shape[0]
            n = int(np.asarray(tgt["per_rank_num_tokens"])[r])
            g = np.asarray(tgt["padded_gather_idx"], dtype=np.int64)[r * p: r * p + n]
            q = np.asarray(tgt["num_scheduled_tokens"], dtype=np.int64)
            qsl = np.concatenate([[0], np.cumsum(q)])
            row = np.repeat(np.arange(q.shape[0]), q)
            first = pos[np.minimum(qsl[:-1], max(pos.shape[0] - 1, 0))] if pos.size else pos
            lag = np.asarray(tgt["num_computed_tokens"], dtype=np.int64) - first
            d = lp[:n] - pos[g]
            for i in np.flatnonzero(d).tolist():
                want = int(lag[row[g[i]]])
                if want > 0 and int(d[i]) == want:
                    seen += 1
                else:
                    other.append(f"step {step} rank {r} local row {i}: off by {int(d[i])}, CPU-cursor lag {want}")
        return seen, other

    def sampled_rows_pattern(self) -> tuple[bool, int, list[str]]:
        """(sampled_from is 'local' somewhere, (step, rank) whose wrong sampled rows are exactly
        logits_indices clamped to the P - 1 local rows, descriptions of those that are not)."""
        local, clamped, other = False, 0, []
        for step, r, tgt in self._ranks_target():
            if not all(v in tgt for v in ("sampled_logits_rows", "logits_indices", "local_positions")):
                continue
            src = str(np.asarray(tgt["sampled_from"]).reshape(-1)[0]) if "sampled_from" in tgt else ""
            li = np.asarray(tgt["logits_indices"], dtype=np.int64)
            act = np.asarray(tgt["sampled_logits_rows"], dtype=np.int64)
            if act.shape == li.shape and np.array_equal(act, li):
                continue
            p = np.asarray(tgt["local_positions"]).shape[0]
            local |= src == "local"
            if src == "local" and act.shape == li.shape and np.array_equal(act, np.minimum(li, max(p - 1, 0))):
                clamped += 1
            else:
                other.append(f"step {step} rank {r}: sampled_from {src!r}, rows {act[:6].tolist()}")
        return local, clamped, other

    def last_token_clamp(self) -> tuple[int, list[str]]:
        """((step, rank) whose wrong draft_last_token_indices are exactly the right global rows
        clamped to P - 1, descriptions of those that are not)."""
        t = self.trace
        clamped, other = 0, []
        for step, r, tgt in self._ranks_target():
            if not (t.has(step, r, "draft_0") and t.has(step, r, "verify")):
                continue
            d0, ver = t.record(step, r, "draft_0"), t.record(step, r, "verify")
            if not ("draft_last_token_indices" in d0 and "num_rejected" in ver and "num_scheduled_tokens" in tgt
                    and "local_positions" in tgt):
                continue
            q = np.asarray(tgt["num_scheduled_tokens"], dtype=np.int64)
            exp = np.cumsum(q) - np.asarray(ver["num_rejected"], dtype=np.int64) - 1
            act = np.asarray(d0["draft_last_token_indices"], dtype=np.int64)[: q.shape[0]]
            if np.array_equal(act, exp):
                continue
            p = np.asarray(tgt["local_positions"]).shape[0]
            if np.array_equal(act, np.minimum(exp, max(p - 1, 0))):
                clamped += 1
            else:
                other.append(f"step {step} rank {r}: {act[:6].tolist()} for {exp[:6].tolist()}")
        return clamped, other

    def pad_rows_past_fold(self) -> str | None:
        """A description when every draft decode's PAD slots are exactly its rows >= R // N (a
        fold by the PCP size), else None."""
        pcp = self.trace.run_meta.pcp or 1
        if not pcp > 1:
            return None
        steps = 0
        for step, ph, tgt, rec in self._draft_decodes():
            if "slot_mapping_draft" not in rec:
                continue
            s = _g(rec["slot_mapping_draft"]).astype(np.int64).ravel()
            pad = np.flatnonzero(s == -1)
            if pad.size == 0:
                continue
            if not np.array_equal(pad, np.arange(s.shape[0] // pcp, s.shape[0])):
                return None
            steps += 1
        return f"on {steps} draft decodes" if steps else None

    def accepted_one_less(self, step: int, rank: int) -> list[int] | None:
        """Rows where ``rank`` accepts a different count than the lowest rank at ``step``, when
        each is exactly one fewer; None otherwise."""
        t = self.trace
        if not (t.has(step, rank, "verify") and t.has(step, self.rank, "verify")):
            return None
        a = np.asarray(t.record(step, self.rank, "verify").get("num_accepted", []), dtype=np.int64)
        b = np.asarray(t.record(step, rank, "verify").get("num_accepted", []), dtype=np.int64)
        if a.shape != b.shape:
            return None
        rows = np.flatnonzero(a != b)
        if rows.size == 0 or not np.array_equal(b[rows], a[rows] - 1):
            return None
        return rows.tolist()
