"""The bulk rule of ``draft_checks.draft_input_ids`` (``columns``): on which (step, rank) of a
block the check surely passes, decided over the block's columns with NumPy (no Python loop per
step or request), so only the rest run the per-step code.

NumPy, not pyarrow.compute or polars: the columns are already NumPy (``columns.Column``) and the
rule is ragged gathers (``Column.at``) and elementwise compares, which NumPy does without a
conversion. The rule is conservative: every condition the per-step code could fail, skip or
raise on (a length, an index outside its array, a negative count, a partial prefill chunk in
the previous step) leaves the step undecided. A PCP=2 block where each request's draft prefill
ids are its target ids shifted left by one, the last accepted row holding the sampled token::

    input_ids [5, 6, 7 | 8]   num_scheduled_tokens [3, 1]   num_rejected [1, 0]
    num_sampled [1, 1]        sampled_token_ids [[9, -1], [4, -1]]
    draft_global_input_ids [6, 9, 7 | 4]  -> True (rows 0..1 and 3 are read; row 2 is not)
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace import draft_index

from .columns import Block, Column, all_per_step, none, previous, ragged, rank_rows, starts, step_sums


def draft_input_ids_ok(b: Block, rank: int) -> np.ndarray:
    """bool[len(b)]: ``draft_input_ids`` passes on (step, ``rank``) for sure: draft phases
    draft_0 .. draft_m recorded, draft_global_input_ids recorded and equal, on the rows the
    drafter reads, to the target ids shifted by one with the sampled token last; no partial
    prefill chunk in the previous step; the local draft_input_ids (where recorded with
    padded_gather_idx) their gather; draft_k's inputs (k >= 1) draft_{k-1}'s tokens."""
    ok = _contiguous_drafts(b, rank)
    g = _global_inputs_ok(b, rank)
    if g is None:
        return none(b)
    ok &= g & _no_partial_chunk(b, rank)
    local = _local_inputs_ok(b, rank)
    later = _later_drafts_ok(b, rank)
    if local is None or later is None:
        return none(b)
    return ok & local & later


def _contiguous_drafts(b: Block, rank: int) -> np.ndarray:
    """bool[n]: the rank's draft phases are draft_0 .. draft_m (m >= 0)."""
    out = np.zeros(len(b), dtype=bool)
    for i, sv in enumerate(b.svs):
        ks = sorted(k for k in (draft_index(p) for p in sv.recs.get(rank, {})) if k is not None)
        out[i] = bool(ks) and ks == list(range(len(ks)))
    return out


def _global_inputs_ok(b: Block, rank: int) -> np.ndarray | None:
    """bool[n]: ``_draft_global_inputs``' comparison passes (None: no columns to judge by)."""
    ids, q, dgi = b.col(rank, "target", "input_ids"), b.col(rank, "target", "num_scheduled_tokens"), \
        b.col(rank, "draft_0", "draft_global_input_ids")
    rej, ns = b.col(rank, "verify", "num_rejected"), b.col(rank, "verify", "num_sampled")
    samp = b.col(rank, "verify", "sampled_token_ids", ndim=2)
    if any(c is None for c in (ids, q, dgi, rej, ns, samp)):
        return None
    n = len(b)
    t = ids.lens
    ok = ids.present & q.present & dgi.present & rej.present & ns.present & samp.present
    ok &= (dgi.lens == t) & (rej.lens == q.lens) & (ns.lens == q.lens) & (samp.rows == q.lens)
    ok &= step_sums(q) == t
    width = samp.dims[:, 1]
    seg, i = ragged(np.where(ok, q.lens, 0))
    qi, rj, si = q.at(seg, i)[0], rej.at(seg, i)[0], ns.at(seg, i)[0]
    li = np.maximum(si - 1, 0)
    ok &= all_per_step((qi >= 0) & (rj >= 0) & (li < width[seg]), seg, n)
    seg, i = ragged(np.where(ok, q.lens, 0))  # requests of the steps still judged
    qi, rj, si = q.at(seg, i)[0], rej.at(seg, i)[0], ns.at(seg, i)[0]
    li = np.maximum(si - 1, 0)
    last_sampled = samp.values[samp.offsets[seg] + i * width[seg] + li] if seg.size else seg
    qstart = starts(q)[q.offsets[seg] + i] if seg.size else seg
    valid = qi - rj
    tok = np.where(si > 0, last_sampled, -1)
    tseg, k = ragged(np.where(ok, t, 0))  # tokens of those steps, each in its request
    row = np.repeat(np.arange(qi.shape[0]), np.maximum(qi, 0))
    if row.shape[0] != tseg.shape[0]:
        return None
    off = k - qstart[row] if row.size else k
    vr = valid[row] if row.size else k
    read = (off < vr - 1) | ((off == vr - 1) & (si[row] > 0 if row.size else k > 0))
    shifted = ids.values[ids.offsets[tseg] + np.minimum(k + 1, t[tseg] - 1)] if tseg.size else k
    want = np.where((off == vr - 1) & (vr > 0), tok[row] if row.size else k, shifted)
    got = dgi.values[dgi.offsets[tseg] + k] if tseg.size else k
    return ok & all_per_step(~read | (want == got), tseg, n)


def _no_partial_chunk(b: Block, rank: int) -> np.ndarray:
    """bool[n]: ``_partial_chunk_last_rows`` compares nothing and raises nothing: the previous
    step (as the check sees it) lacks one of the views it reads, or has no partial prefill
    chunk (and this step records req_ids, read before the loop)."""
    pb = previous(b, rank)
    cols = [pb.col(rank, "draft_0", "draft_global_input_ids"), pb.col(rank, "verify", "num_sampled"),
            pb.col(rank, "verify", "num_rejected"), pb.col(rank, "target", "num_scheduled_tokens")]
    if any(c is None for c in cols):
        return none(b)
    pdgi, pns, prej, pq = cols
    prid = np.fromiter((a is not None for a in pb.arrays(rank, "target", "req_ids")), dtype=bool, count=len(b))
    reads = pdgi.present & pns.present & prej.present & pq.present & prid
    rid = np.fromiter((a is not None for a in b.arrays(rank, "target", "req_ids")), dtype=bool, count=len(b))
    seg, i = ragged(np.where(reads & (pns.lens == pq.lens), pq.lens, 0))
    partial = (pns.at(seg, i)[0] == 0) & (pq.at(seg, i)[0] > 0)
    none_partial = all_per_step(~partial, seg, len(b)) & (pns.lens == pq.lens)
    return ~reads | (none_partial & rid)


def _local_inputs_ok(b: Block, rank: int) -> np.ndarray | None:
    """bool[n]: draft_0's local draft_input_ids, where it and padded_gather_idx are recorded,
    are draft_global_input_ids at this rank's real rows (``Ctx.rank_rows``)."""
    dii, dgi = b.col(rank, "draft_0", "draft_input_ids"), b.col(rank, "draft_0", "draft_global_input_ids")
    pgi = b.col(rank, "target", "padded_gather_idx")
    if dii is None or dgi is None or pgi is None:
        return None
    compared = dii.present & pgi.present
    rr = rank_rows(b, rank)
    if rr is None:
        return ~compared
    ok_rr, p, n_local, _ = rr
    ok = compared & ok_rr & dgi.present & (dii.lens >= n_local)
    seg, k = ragged(np.where(ok, n_local, 0))
    idx = pgi.at(seg, rank * p[seg] + k)[0]
    inside = (idx >= 0) & (idx < dgi.lens[seg])
    want = dgi.at(seg, np.where(inside, idx, 0))[0]
    got = dii.at(seg, k)[0]
    return ~compared | (ok & all_per_step(inside & (want == got), seg, len(b)))


def _later_drafts_ok(b: Block, rank: int) -> np.ndarray | None:
    """bool[n]: each draft_k's (k >= 1) draft_input_ids, where recorded, equal draft_{k-1}'s
    draft_tokens (shape and values)."""
    ok = np.ones(len(b), dtype=bool)
    top = max((draft_index(p) or 0 for sv in b.svs for p in sv.recs.get(rank, {})), default=0)
    for k in range(1, top + 1):
        dii = b.col(rank, f"draft_{k}", "draft_input_ids", ndim=None)
        tok = b.col(rank, f"draft_{k - 1}", "draft_tokens", ndim=None)
        if dii is None or tok is None:
            return None
        ok &= ~dii.present | _same_column_values(dii, tok)
    return ok


def _same_column_values(a: Column, c: Column) -> np.ndarray:
    """bool[n]: both present with one shape and equal values."""
    if a.ndim != c.ndim:
        return np.zeros(a.lens.shape[0], dtype=bool)
    same = a.present & c.present & (a.dims == c.dims).all(axis=1)
    seg, k = ragged(np.where(same, a.lens, 0))
    eq = a.values[a.offsets[seg] + k] == c.values[c.offsets[seg] + k] if seg.size else seg.astype(bool)
    return same & all_per_step(eq, seg, a.lens.shape[0])
