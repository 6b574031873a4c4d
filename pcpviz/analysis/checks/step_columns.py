"""The helpers of ``step_checks``' bulk rules (``columns``): which views ranks_agree compares,
ranks' phases told equal without comparing them again, verify_consistent's entries and logits rows
over a block, positions_consistent's rows matched to the previous step's.

    >>> agreeing_views("verify", ["num_sampled", "hidden_fp_of_my_own"])  # replicated: all
    ['num_sampled', 'hidden_fp_of_my_own']
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace.schema import GLOBAL, phase_class, view_spec
from pcpviz.trace.view_specs import DCP_SHARE_VIEWS

from .columns import Block, all_per_step, matched_rows, ragged, same_values


def agreeing_views(phase: str, names) -> list[str]:
    """The views of ``phase`` every rank must record identically: those the schema declares
    with scope ``GLOBAL``; in the replicated phases (verify, draft_k) also undeclared ones."""
    replicated = phase_class(phase) in ("verify", "draft_k")
    out = []
    for v in names:
        spec = view_spec(phase, v)
        if (spec.scope == GLOBAL) if spec is not None else replicated:
            out.append(v)
    return out


_AGREEING: dict[tuple, tuple[str, ...]] = {}  # (phase, its view names, dcp > 1) -> the views ranks_agree compares


def same_phase(phase: str, a, b, *, dcp: bool) -> bool:
    """Two ranks' records of ``phase`` hold the same views, every one ranks_agree compares the
    very same array (the reader shares a byte-equal payload) or equal values (``columns.same_values``)."""
    names = tuple(a.views)
    if tuple(b.views) != names and set(b.views) != set(names):
        return False
    key = (phase, names, dcp)
    views = _AGREEING.get(key)
    if views is None:
        views = tuple(v for v in agreeing_views(phase, names) if not (dcp and v in DCP_SHARE_VIEWS))
        if len(_AGREEING) >= 4096:
            _AGREEING.clear()
        _AGREEING[key] = views
    for v in views:
        x, y = a.views[v], b.views[v]
        if not (x is y and x.dtype.names is None) and not same_values(x, y):
            return False  # (one table compared field by field: a NaN differs from itself)
    return True


def same_req_ids(sv, rank: int) -> bool:
    """verify's req_ids equal the target's where both are recorded."""
    phases = sv.recs.get(rank, {})
    vid, tid = phases.get("verify", {}).get("req_ids"), phases.get("target", {}).get("req_ids")
    return vid is None or tid is None or same_values(tid, vid)


def sampled_entries_ok(b: Block, sampled, ids, *, ok: np.ndarray, seg: np.ndarray, i: np.ndarray,
                        n: np.ndarray, a: np.ndarray, first: np.ndarray) -> np.ndarray:
    """bool[n]: per request row ``i`` of step ``seg``, sampled tokens are the first ``n``
    entries, the first ``a`` of them the target's input ids from row ``first``."""
    width = np.where(sampled.rows > 0, sampled.lens // np.maximum(sampled.rows, 1), 0)
    row_w = width[seg]
    eseg, k = ragged(np.where(ok[seg], row_w, 0))  # eseg: the request row of each entry
    step = seg[eseg]
    tok, _ = sampled.at(step, i[eseg] * row_w[eseg] + k)
    t = ids.lens[step]
    src = np.clip(first[eseg] + k, 0, np.maximum(t - 1, 0))
    want, _ = ids.at(step, src)
    good = ((tok != -1) == (k < n[eseg])) & ((k >= a[eseg]) | (tok == want))
    return all_per_step(good, step, len(b))


def logits_rows_ok(b: Block, li, *, ok: np.ndarray, seg: np.ndarray, qi: np.ndarray, cnt: np.ndarray,
                    end: np.ndarray) -> np.ndarray:
    """bool[n]: where logits_indices is recorded and every request has tokens (``qi``), it is
    each request's last ``cnt`` rows (``end``: the row after its last)."""
    compared = li.present & (np.bincount(seg[qi <= 0], minlength=len(b)) == 0)
    active = ok & compared
    use = active[seg]
    total = np.bincount(seg[use], weights=cnt[use], minlength=len(b)).astype(np.int64)
    active &= li.lens == total
    use = active[seg]
    want = np.repeat(end[use] - cnt[use], cnt[use]) + ragged(cnt[use])[1]
    got = li.values[np.concatenate([np.arange(li.offsets[s], li.offsets[s + 1]) for s in np.flatnonzero(active)]
                                   or [np.zeros(0, np.int64)])]
    step = np.repeat(seg[use], cnt[use])
    return (ok & ~compared) | (active & all_per_step(want == got, step, len(b)))


def matched(b: Block, pb: Block, rank: int, *, ok: np.ndarray, cont: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Each request row's row in the previous step (``matched_rows``) for the ``rows[s]`` rows of
    every step, -1 where the step is not compared with its previous one; a compared step whose
    rows cannot be matched (no req_ids, another count) is taken out of ``ok``."""
    parts = []
    for s, c in enumerate(matched_rows(b, pb, rank)):
        if rows[s] and ok[s] and cont[s] and c is not None and c.shape == (rows[s],):
            parts.append(c)
            continue
        if cont[s]:
            ok[s] = False
        parts.append(np.full(rows[s], -1, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
