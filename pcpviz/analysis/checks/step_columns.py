"""The helpers of ``step_checks``' bulk rules (``columns``): which views ranks_agree compares,
ranks' phases told equal without comparing them again, verify_consistent's entries and logits rows
over a block, positions_consistent's rows matched to the previous step's.

    >>> agreeing_views("verify", ["num_sampled", "hidden_fp_of_my_own"])  # replicated: all
    ['num_sampled', 'hidden_fp_of_my_own']
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace import draft_index
from pcpviz.trace.schema import GLOBAL, phase_class, view_spec
from pcpviz.trace.view_specs import DCP_SHARE_VIEWS

from .columns import Block, all_per_step, matched_rows, none, previous, ragged, same_values, starts, step_sums


def agreeing_views(phase: str, names) -> list[str]:
    """The views of ``phase`` every rank must record identically: those the schema declares
    with scope ``GLOBAL``; in the replicated phases (verify, draft_k) also undeclared ones.
    Remembered by (phase, names): ``ranks_agree`` asks it for every rank of every step (64 a
    step at PCP=64) about the same few lists of names."""
    names = tuple(names)
    key = (phase, names)
    got = _AGREEING_NAMES.get(key)
    if got is None:
        replicated = phase_class(phase) in ("verify", "draft_k")
        got = []
        for v in names:
            spec = view_spec(phase, v)
            if (spec.scope == GLOBAL) if spec is not None else replicated:
                got.append(v)
        got = tuple(got)
        if len(_AGREEING_NAMES) >= 4096:
            _AGREEING_NAMES.clear()
        _AGREEING_NAMES[key] = got
    return list(got)


_AGREEING_NAMES: dict[tuple, tuple[str, ...]] = {}  # (phase, view names) -> agreeing_views' answer


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


def same_req_ids(b: Block, rank: int) -> np.ndarray:
    """bool[n]: verify's req_ids equal the target's where both are recorded."""
    pairs = zip(b.arrays(rank, "verify", "req_ids"), b.arrays(rank, "target", "req_ids"))
    return np.fromiter((vid is None or tid is None or same_values(tid, vid) for vid, tid in pairs), dtype=bool,
                       count=len(b))


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


def verify_consistent_ok(b: Block, rank: int) -> np.ndarray:
    """Steps recording the verify counts, a 2-D sampled_token_ids, input_ids and
    num_scheduled_tokens, one row per request, on which every rule of the check holds."""
    ns, nacc, nrej, nd = (b.col(rank, "verify", v) for v in ("num_sampled", "num_accepted", "num_rejected",
                                                             "num_draft_tokens"))
    sampled = b.col(rank, "verify", "sampled_token_ids", ndim=2)
    ids, q, li = (b.col(rank, "target", v) for v in ("input_ids", "num_scheduled_tokens", "logits_indices"))
    if None in (ns, nacc, nrej, nd, sampled, ids, q, li):
        return none(b)
    r = ns.lens
    ok = ns.present & nacc.present & nrej.present & sampled.present & ids.present & q.present
    ok &= (nacc.lens == r) & (nrej.lens == r) & (sampled.rows == r) & (q.lens == r) & (~nd.present | (nd.lens == r))
    ok &= same_req_ids(b, rank)
    seg, i = ragged(np.where(ok, r, 0))
    n, a, j, qi = ns.at(seg, i)[0], nacc.at(seg, i)[0], nrej.at(seg, i)[0], q.at(seg, i)[0]
    d = np.where(nd.present[seg], nd.at(seg, i)[0], a + j)
    end = (starts(q) + q.values)[q.offsets[seg] + i] if seg.size else seg
    good = (a >= 0) & (j >= 0) & ((n == 0) | (n == a + 1)) & (d - j == a) & (d <= np.maximum(qi - 1, 0))
    ok &= all_per_step(good, seg, len(b))
    ok &= (np.bincount(seg[a > 0], minlength=len(b)) == 0) | (ids.lens > 0)
    ok &= sampled_entries_ok(b, sampled, ids, ok=ok, seg=seg, i=i, n=n, a=a, first=end - d)
    return ok & logits_rows_ok(b, li, ok=ok, seg=seg, qi=qi, cnt=d + 1, end=end)


def positions_consistent_ok(b: Block, rank: int) -> np.ndarray:
    """Contiguous positions, T of them, seq_lens and num_computed_tokens (where recorded) one per
    request and consistent; with a previous step recording positions and num_rejected, both
    steps' req_ids and num_scheduled_tokens recorded and each continuing request's first
    position the GPU cursor."""
    pos, q, sl, nc = (b.col(rank, "target", v) for v in ("positions", "num_scheduled_tokens", "seq_lens",
                                                        "num_computed_tokens"))
    pb = previous(b, rank)
    ppos, pq, prej = pb.col(rank, "target", "positions"), pb.col(rank, "target", "num_scheduled_tokens"), \
        pb.col(rank, "verify", "num_rejected")
    if None in (pos, q, sl, nc, ppos, pq, prej):
        return none(b)
    r = q.lens
    ok = pos.present & q.present & (pos.lens == step_sums(q)) & (~sl.present | (sl.lens == r)) \
        & (~nc.present | (nc.lens == r))
    seg, i = ragged(np.where(ok, r, 0))
    qi, start = q.at(seg, i)[0], starts(q)[q.offsets[seg] + i] if seg.size else seg
    first = np.where(qi > 0, pos.at(seg, start)[0], 0)
    tseg, m = ragged(np.where(ok[seg], qi, 0))  # tseg: the request row of each token
    good_t = pos.at(seg[tseg], start[tseg] + m)[0] == first[tseg] + m
    good = (qi >= 0) & ((qi <= 0) | ~sl.present[seg] | (sl.at(seg, i)[0] == pos.at(seg, start + qi - 1)[0] + 1))
    good &= (qi <= 0) | ~nc.present[seg] | (first <= nc.at(seg, i)[0])
    ok &= all_per_step(good, seg, len(b)) & all_per_step(good_t, seg[tseg], len(b))
    cont = ppos.present & prej.present  # the previous step is compared with
    ok &= ~cont | pq.present
    pr = matched(b, pb, rank, ok=ok, cont=cont, rows=np.bincount(seg, minlength=len(b)))
    base = (pr >= 0) & (qi > 0)
    pqi, in1 = pq.at(seg, pr)
    use = base & in1 & (pqi > 0)
    pstart = np.append(starts(pq), 0)[pq.offsets[seg] + np.where(in1, pr, 0)]
    want, in2 = ppos.at(seg, np.where(use, pstart, -1))
    rej, in3 = prej.at(seg, pr)
    good = (~base | in1) & (~use | (in2 & in3 & (want + pqi - rej == first)))
    return ok & all_per_step(good, seg, len(b))


def is_prefilling_ok(b: Block, rank: int) -> np.ndarray:
    """``is_prefilling_rule``: is_prefilling, num_computed_tokens and prefill_len of one length,
    is_prefilling == (num_computed_tokens < prefill_len)."""
    pf, nc, pl = b.col(rank, "target", "is_prefilling", bools=True), b.col(rank, "target", "num_computed_tokens"), \
        b.col(rank, "target", "prefill_len")
    if None in (pf, nc, pl):
        return none(b)
    ok = pf.present & nc.present & pl.present & (pf.lens == nc.lens) & (pl.lens == nc.lens)
    seg, i = ragged(np.where(ok, nc.lens, 0))
    good = (pf.at(seg, i)[0] != 0) == (nc.at(seg, i)[0] < pl.at(seg, i)[0])
    return ok & all_per_step(good, seg, len(b))


def must_sample_ok(b: Block, rank: int) -> np.ndarray:
    """``must_sample_rule``: num_sampled, seq_lens and prefill_len of one length; a request
    samples iff seq_len >= prefill_len; a partial chunk's num_rejected / num_accepted (where
    recorded with num_sampled's length) 0."""
    ns, sl, pl = b.col(rank, "verify", "num_sampled"), b.col(rank, "target", "seq_lens"), \
        b.col(rank, "target", "prefill_len")
    nrej, nacc = b.col(rank, "verify", "num_rejected"), b.col(rank, "verify", "num_accepted")
    if None in (ns, sl, pl, nrej, nacc):
        return none(b)
    ok = ns.present & sl.present & pl.present & (sl.lens == ns.lens) & (pl.lens == ns.lens)
    seg, i = ragged(np.where(ok, ns.lens, 0))
    chunked = sl.at(seg, i)[0] < pl.at(seg, i)[0]
    good = chunked == (ns.at(seg, i)[0] == 0)
    for col in (nrej, nacc):
        good &= ~chunked | ~(col.present & (col.lens == ns.lens))[seg] | (col.at(seg, i)[0] == 0)
    return ok & all_per_step(good, seg, len(b))


def cursor_ok(b: Block, rank: int) -> np.ndarray:
    """``cursor_rolls_back_rejections``: num_computed_after and num_rejected one per request;
    each live request's (after >= 0, tokens, idx_mapping >= 0 where recorded per request) cursor
    after is its first position + q - num_rejected, its first token inside positions."""
    after, nrej, idx = b.col(rank, "verify", "num_computed_after"), b.col(rank, "verify", "num_rejected"), \
        b.col(rank, "verify", "idx_mapping")
    pos, q = b.col(rank, "target", "positions"), b.col(rank, "target", "num_scheduled_tokens")
    if None in (after, nrej, idx, pos, q):
        return none(b)
    r = q.lens
    ok = after.present & nrej.present & pos.present & q.present & (after.lens == r) & (nrej.lens == r)
    seg, i = ragged(np.where(ok, r, 0))
    a, qi = after.at(seg, i)[0], q.at(seg, i)[0]
    live = (a >= 0) & (qi > 0) & (~(idx.present & (idx.lens == r))[seg] | (idx.at(seg, i)[0] >= 0))
    first, inside = pos.at(seg, np.append(starts(q), 0)[q.offsets[seg] + i])
    good = ~live | (inside & (a == first + qi - nrej.at(seg, i)[0]))
    return ok & all_per_step(good, seg, len(b))


def accepted_ok(b: Block, rank: int) -> np.ndarray:
    """``num_accepted_from_tokens`` under the standard rule: the counts one per request, a 2-D
    sampled_token_ids of as many rows; where a request rejects a draft, its row inside input_ids
    and the token sampled in its place another."""
    nacc, ns, nd = (b.col(rank, "verify", v) for v in ("num_accepted", "num_sampled", "num_draft_tokens"))
    sampled, ids = b.col(rank, "verify", "sampled_token_ids", ndim=2), b.col(rank, "target", "input_ids")
    q = b.col(rank, "target", "num_scheduled_tokens")
    if not b.run_meta.standard_rejection or None in (nacc, ns, nd, sampled, ids, q):
        return none(b)
    r = q.lens
    ok = nacc.present & ns.present & nd.present & sampled.present & ids.present & q.present
    ok &= (nacc.lens == r) & (ns.lens == r) & (nd.lens == r) & (sampled.rows == r)
    seg, i = ragged(np.where(ok, r, 0))
    a, d = nacc.at(seg, i)[0], nd.at(seg, i)[0]
    width = np.where(sampled.rows > 0, sampled.lens // np.maximum(sampled.rows, 1), 0)[seg]
    rejects = (ns.at(seg, i)[0] > 0) & (a < d) & (a >= 0) & (a < width)
    at = (np.append(starts(q), 0)[q.offsets[seg] + i] + q.at(seg, i)[0]) - d + a
    tok, inside = ids.at(seg, at)
    good = ~rejects | (inside & (sampled.at(seg, i * width + a)[0] != tok))
    return ok & all_per_step(good, seg, len(b))


def verify_greedy_ok(b: Block, rank: int) -> np.ndarray:
    """bool[n]: ``verify_greedy`` passes on (step, ``rank``) for sure: top1_token covers
    1 + num_draft_tokens rows per request, and each request that sampled accepts the longest
    prefix of its drafts (the last ``d`` input ids of its rows) equal to the argmax rows before
    them, and samples those argmaxes. Undecided wherever the per-step code could index outside
    an array (a negative count, drafts past the request's first row, too narrow a
    sampled_token_ids). A request of q=3 tokens [5, 7, 8] with drafts [7, 8], top1 [7, 9, 4]:
    one draft accepted, sampled [7, 9]."""
    top1, ids, q = b.col(rank, "target", "top1_token"), b.col(rank, "target", "input_ids"), \
        b.col(rank, "target", "num_scheduled_tokens")
    nd, nacc, ns = (b.col(rank, "verify", v) for v in ("num_draft_tokens", "num_accepted", "num_sampled"))
    samp = b.col(rank, "verify", "sampled_token_ids", ndim=2)
    if any(c is None for c in (top1, ids, q, nd, nacc, ns, samp)):
        return none(b)
    n, r = len(b), q.lens
    ok = top1.present & ids.present & q.present & nd.present & nacc.present & ns.present & samp.present
    ok &= (nd.lens == r) & (nacc.lens == r) & (ns.lens == r) & (samp.rows == r) & (step_sums(q) == ids.lens)
    ok &= step_sums(nd) + r == top1.lens
    width = samp.dims[:, 1]
    seg, i = ragged(np.where(ok, r, 0))
    d, qi, si = nd.at(seg, i)[0], q.at(seg, i)[0], ns.at(seg, i)[0]
    end = starts(q)[q.offsets[seg] + i] + qi if seg.size else seg  # qsl[i + 1]
    sane = (d >= 0) & (qi >= 0) & ((si == 0) | ((end - d >= 0) & (width[seg] >= d + 1)))
    ok &= all_per_step(sane, seg, n)
    seg, i = ragged(np.where(ok, r, 0))  # the requests of the steps still judged
    d, qi, si, na = nd.at(seg, i)[0], q.at(seg, i)[0], ns.at(seg, i)[0], nacc.at(seg, i)[0]
    end = starts(q)[q.offsets[seg] + i] + qi if seg.size else seg
    tstart = starts(nd)[nd.offsets[seg] + i] + i if seg.size else seg  # the request's first top1 row
    live = si != 0  # the per-step code skips only a request that sampled nothing
    dseg, j = ragged(np.where(live, d, 0))  # every draft of every request that sampled
    req = np.repeat(np.arange(d.shape[0]), np.where(live, d, 0))
    step_of = seg[req] if req.size else req
    drafts = ids.values[ids.offsets[step_of] + end[req] - d[req] + j] if req.size else req
    argmax = top1.values[top1.offsets[step_of] + tstart[req] + j] if req.size else req
    acc = np.where(live, d, 0)
    miss = drafts != argmax
    np.minimum.at(acc, req[miss], j[miss])
    good = ~live | (na == acc)
    sseg, k = ragged(np.where(live, acc + 1, 0))  # the sampled tokens compared
    sreq = np.repeat(np.arange(d.shape[0]), np.where(live, acc + 1, 0))
    sstep = seg[sreq] if sreq.size else sreq
    got = samp.values[samp.offsets[sstep] + i[sreq] * width[sstep] + k] if sreq.size else sreq
    want = top1.values[top1.offsets[sstep] + tstart[sreq] + k] if sreq.size else sreq
    same = np.ones(d.shape[0], dtype=bool)
    np.logical_and.at(same, sreq, got == want)
    return ok & all_per_step(good & same, seg, n)


def drafts_fed_back_ok(b: Block, rank: int) -> np.ndarray:
    """bool[n]: ``drafts_fed_back`` passes on (step, ``rank``) for sure. Each request continuing
    from the previous step (matched by req_ids, as the check matches them) that sampled there
    starts its scheduled drafts right after the token sampled last for it, and schedules the
    previous step's draft_k tokens as its drafts. Undecided where the per-step code could index
    outside an array, where the step records scheduled_draft_ids (the engine's, compared first
    by the check) and where the previous step's draft phases are not draft_0 .. draft_m. A
    request [5, 7] scheduled with one draft after sampling 5 and drafting 7: True."""
    ids, q, nd = b.col(rank, "target", "input_ids"), b.col(rank, "target", "num_scheduled_tokens"), \
        b.col(rank, "verify", "num_draft_tokens")
    pb = previous(b, rank)
    pns, psamp = pb.col(rank, "verify", "num_sampled"), pb.col(rank, "verify", "sampled_token_ids", ndim=2)
    if None in (ids, q, nd, pns, psamp):
        return none(b)
    n, r = len(b), q.lens
    rids, kept = b.arrays(rank, "target", "req_ids"), b.arrays(rank, "target", "scheduled_draft_ids")
    has_prev = np.fromiter((bool(sv.recs) for sv in pb.svs), dtype=bool, count=n)
    ok = has_prev & ids.present & q.present & pns.present & psamp.present & (~nd.present | (nd.lens == r))
    ok &= np.fromiter((rid is not None and rid.shape == (int(k),) and sc is None
                       for rid, k, sc in zip(rids, r, kept)), dtype=bool, count=n)
    rows = np.where(ok, r, 0)
    cur = matched(b, pb, rank, ok=ok, cont=ok.copy(), rows=rows)
    seg, i = ragged(np.where(ok, r, 0))
    cur = cur[np.repeat(ok, rows)] if cur.size else cur
    qi, start = q.at(seg, i)[0], starts(q)[q.offsets[seg] + i] if seg.size else seg
    pn, pin = pns.at(seg, cur)
    live = (cur >= 0) & (qi > 0)
    fed = live & pin & (pn > 0)
    ok &= all_per_step(~live | pin, seg, n)
    d = np.where(nd.present[seg], nd.at(seg, i)[0], 0) if seg.size else seg
    first = start + qi - 1 - d
    width = psamp.dims[:, 1]
    inside = (first >= 0) & (first < ids.lens[seg]) & (cur < psamp.rows[seg]) & (pn - 1 < width[seg])
    want = psamp.values[psamp.offsets[seg] + np.where(fed & inside, cur * width[seg] + pn - 1, 0)] \
        if seg.size else seg
    got = ids.at(seg, np.where(inside, first, 0))[0]
    ok &= all_per_step(~fed | (inside & (want == got)), seg, n)
    return ok & _fed_drafts_ok(b, pb, rank, ok=ok, seg=seg, fed=fed, cur=cur, d=d, first=first)


def _fed_drafts_ok(b: Block, pb: Block, rank: int, *, ok: np.ndarray, seg: np.ndarray, fed: np.ndarray,
                   cur: np.ndarray, d: np.ndarray, first: np.ndarray) -> np.ndarray:
    """bool[n]: the scheduled drafts of each fed request (``fed``, with ``d`` drafts) are the
    previous step's draft_k tokens (k < d) of its row ``cur``; a step whose previous one records
    fewer draft phases than its widest request's drafts, or lacks their tokens, compares nothing
    (as the check). Where it compares, every fed request's row must lie in the tokens (the
    check gathers them all)."""
    n = len(b)
    need = np.zeros(n, dtype=np.int64)
    np.maximum.at(need, seg[fed], d[fed])
    good = np.ones(n, dtype=bool)
    top = int(need.max()) if n else 0
    phases = [sorted((k, p) for k, p in ((draft_index(p), p) for p in sv.recs.get(rank, {})) if k is not None)
              for sv in pb.svs]
    contiguous = np.fromiter((all(k == j for j, (k, _) in enumerate(ps)) for ps in phases), dtype=bool, count=n)
    tokens = [pb.col(rank, f"draft_{k}", "draft_tokens") for k in range(top)]
    if any(t is None for t in tokens):
        return ~(ok & (need > 0))
    complete = np.ones(n, dtype=bool)  # the check compares: every draft_k (k < width) records tokens
    for k, t in enumerate(tokens):
        complete &= t.present & (np.fromiter((len(ps) for ps in phases), dtype=np.int64, count=n) > k) \
            | (need <= k)
    ids = b.col(rank, "target", "input_ids")
    if tokens:
        gathered = fed & complete[seg] & (need[seg] > 0)
        good &= all_per_step(~gathered | ((cur >= 0) & (cur < tokens[0].lens[seg])), seg, n)
    for k, t in enumerate(tokens):
        use = fed & (d > k) & complete[seg]
        if not use.any():
            continue
        same_len = t.lens[seg] == tokens[0].lens[seg]
        want, in1 = t.at(seg, np.where(use, cur, -1))
        src = np.clip(first + 1 + k, 0, np.maximum(ids.lens[seg] - 1, 0))
        got = ids.at(seg, np.where(use, src, 0))[0]
        good &= all_per_step(~use | (in1 & same_len & (want == got)), seg, n)
    return ~(need > 0) | (contiguous & good)
