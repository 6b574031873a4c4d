"""Checks across phases, steps and ranks: the verify outcome, what the next step is fed, ranks
agreeing on the global views, the position cursor."""

from __future__ import annotations

import numpy as np

from pcpviz.analysis.compare import first_difference, fmt_value as _fmt, short_repr
from pcpviz.trace.reader import Record
from pcpviz.trace.schema import causal_phase_key
from pcpviz.trace.view_specs import DCP_SHARE_VIEWS

from pcpviz.trace.shapes import slot_groups

from .columns import (Block, bulk_rule, none)
from .context import Ctx, Skip, check, token_rows
from .step_columns import (accepted_ok, agreeing_views, cursor_ok, drafts_fed_back_ok, is_prefilling_ok,
                           must_sample_ok, positions_consistent_ok, same_phase, verify_consistent_ok, verify_greedy_ok)

@check("verify_consistent",
        "verify is self-consistent and matches the batch: num_sampled == the non -1 prefix of "
        "sampled_token_ids, num_sampled in {0, num_accepted + 1}, num_accepted + num_rejected == "
        "num_draft_tokens, accepted tokens == the scheduled drafts, logits_indices == each "
        "request's last 1 + num_draft_tokens rows")
def verify_consistent(c: Ctx) -> None:
    ns = c.need("verify", "num_sampled").astype(np.int64)
    nacc = c.need("verify", "num_accepted").astype(np.int64)
    nrej = c.need("verify", "num_rejected").astype(np.int64)
    sampled = slot_groups(c.need("verify", "sampled_token_ids")).astype(np.int64)
    nd = c.get("verify", "num_draft_tokens")
    r = ns.shape[0]
    for v, a in (("num_accepted", nacc), ("num_rejected", nrej), ("sampled_token_ids", sampled)):
        if a.shape[0] != r:
            c.fail("verify", v, f"{a.shape[0]} rows, num_sampled has {r}")
    vid, tid = c.get("verify", "req_ids"), c.get("target", "req_ids")
    if vid is not None and tid is not None:
        c.expect("verify", "req_ids", want=tid, got=vid, what="verify rows are not the target's global rows")
    width = sampled.shape[1]
    valid = sampled != -1
    c.expect("verify", "sampled_token_ids", want=np.arange(width)[None, :] < ns[:, None], got=valid,
             what="sampled tokens must be the first num_sampled entries (-1 after)")
    bad = (ns != 0) & (ns != nacc + 1)
    if bad.any():
        i = int(np.argmax(bad))
        c.fail("verify", "num_sampled", f"request row {i}: num_sampled must be 0 or num_accepted + 1 "
               f"(num_accepted {int(nacc[i])})", index=(i,), expected=str(int(nacc[i]) + 1),
               actual=str(int(ns[i])))
    nd = (nacc + nrej) if nd is None else nd.astype(np.int64)
    c.expect("verify", "num_accepted", want=nd - nrej, got=nacc, what="num_accepted + num_rejected != num_draft_tokens")
    if (nacc < 0).any() or (nrej < 0).any():
        i = int(np.argmax((nacc < 0) | (nrej < 0)))
        c.fail("verify", "num_accepted", "negative count", index=(i,))
    ids = c.get("target", "input_ids")
    if ids is None or c.get("target", "num_scheduled_tokens") is None:
        return
    qsl, q = c.qsl(), c.q()
    if q.shape[0] != r:
        c.fail("verify", "num_sampled", f"{r} rows, the target batch has {q.shape[0]} requests")
    if (nd > np.maximum(q - 1, 0)).any():
        i = int(np.argmax(nd > np.maximum(q - 1, 0)))
        c.fail("verify", "num_draft_tokens", f"request row {i} verifies {int(nd[i])} drafts but "
               f"was scheduled {int(q[i])} tokens", index=(i,))
    k = np.arange(width)[None, :]
    accepted = k < nacc[:, None]
    if accepted.any():
        src = np.clip((qsl[1:] - nd)[:, None] + k, 0, max(ids.shape[0] - 1, 0))
        exp = np.where(accepted, ids.astype(np.int64)[src], sampled)
        c.expect("verify", "sampled_token_ids", want=exp, got=sampled,
                 what="an accepted token differs from the draft the target was scheduled with")
    li = c.get("target", "logits_indices")
    if li is not None and (q > 0).all():
        cnt = nd + 1
        starts = np.repeat(qsl[1:] - cnt, cnt)
        within = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        c.expect("target", "logits_indices", want=starts + within, got=li.astype(np.int64),
                 what="logits rows are not each request's last 1 + num_draft_tokens rows")


@bulk_rule("verify_consistent", shared=True)
def _verify_consistent_bulk(b: Block, rank: int) -> np.ndarray:
    """``step_columns.verify_consistent_ok``."""
    return verify_consistent_ok(b, rank)


bulk_rule("drafts_fed_back")(drafts_fed_back_ok)  # step_columns.drafts_fed_back_ok


@check("drafts_fed_back",
        "a request continuing from the previous step is fed what that step produced: its first "
        "input id is the last sampled token and its scheduled drafts are the previous draft_k tokens")
def drafts_fed_back(c: Ctx) -> None:
    pv = c.prev()
    if pv is None:
        raise Skip("no previous step")
    ids = c.t("input_ids").astype(np.int64)
    rid = c.t("req_ids")
    qsl = c.qsl()
    nd = c.get("verify", "num_draft_tokens")
    prid = pv.t("req_ids")
    pns = pv.need("verify", "num_sampled").astype(np.int64)
    psampled = slot_groups(pv.need("verify", "sampled_token_ids")).astype(np.int64)
    pdrafts = [pv.get(p, "draft_tokens") for _, p in pv.draft_phases()]
    prow = {str(x): i for i, x in enumerate(prid.tolist())}
    cur = np.array([prow.get(str(x), -1) for x in rid.tolist()], dtype=np.int64)
    q = np.diff(qsl)
    ok = (cur >= 0) & (q > 0)
    rows = np.flatnonzero(ok)
    rows = rows[pns[cur[rows]] > 0]
    if rows.size == 0:
        return
    pr = cur[rows]
    ndr = np.zeros(rows.size, dtype=np.int64) if nd is None else nd.astype(np.int64)[rows]
    first = qsl[:-1][rows] + (q[rows] - 1 - ndr)  # the row before the drafts
    c.expect("target", "input_ids", want=psampled[pr, pns[pr] - 1], got=ids[first],
             what="first input is not the token sampled for this request in the previous step",
             index_map=lambda i: (int(first[i[0]]),))
    if nd is None or not (ndr > 0).any():
        return
    width = int(ndr.max())
    if len(pdrafts) < width or any(d is None for d in pdrafts[:width]):
        return
    pd = np.stack([np.asarray(d, dtype=np.int64) for d in pdrafts[:width]], axis=1)[pr]  # [n, width]
    j = np.arange(width)[None, :]
    use = j < ndr[:, None]
    src = np.clip(first[:, None] + 1 + j, 0, ids.shape[0] - 1)
    exp = np.where(use, pd, 0)
    kept = c.get("target", "scheduled_draft_ids")  # engine: the drafts the request state stored
    if kept is not None and kept.ndim == 2 and kept.shape[0] == qsl.shape[0] - 1 and kept.shape[1] >= width:
        got = np.where(use, kept.astype(np.int64)[rows][:, :width], 0)
        differs, idx, _ = first_difference(exp, got)
        if differs:
            i, jj = idx
            c.fail("target", "scheduled_draft_ids", f"request {rid[rows[i]]!s} keeps as draft {jj} not "
                   f"draft_{jj}'s token from step {pv.step}", index=(int(rows[i]), int(jj)),
                   expected=_fmt(exp[i, jj]), actual=_fmt(got[i, jj]))
            return
    act = np.where(use, ids[src], 0)
    differs, idx, _ = first_difference(exp, act)
    if differs:
        i, jj = idx
        tok = int(src[i, jj])
        c.fail("target", "input_ids", f"scheduled draft {jj} of request {rid[rows[i]]!s} is not "
               f"draft_{jj}'s token from step {pv.step}", index=(tok,),
               expected=_fmt(exp[i, jj]), actual=short_repr(ids, (tok,)))


@check("ranks_agree",
        "every rank of a step records the same global views: the global batch and layout, "
        "draft_tokens of every draft phase, the replicated draft decodes, and the whole verify "
        "outcome (sampled tokens, num_accepted/num_sampled)")
def ranks_agree(c: Ctx) -> None:
    ranks = sorted(c.sv.recs)
    ref = ranks[0]
    if c.rank == ref:
        if c.sv.missing:
            r = c.sv.missing[0]
            c.fail(None, None, f"step {c.step} is missing on rank {r}, which recorded later steps",
                   rank=r)
        if len(ranks) == 1 and not c.sv.missing:
            raise Skip("single rank")
        return
    mine, theirs = c.phases, c.sv.recs[ref]
    for phase in sorted(set(mine) | set(theirs), key=causal_phase_key):
        if phase not in mine or phase not in theirs:
            if not agreeing_views(phase, (mine.get(phase) or theirs.get(phase)).keys()):
                continue
            c.fail(phase, None, f"phase {phase} recorded on rank {ref if phase in theirs else c.rank} "
                   f"but not on rank {c.rank if phase in theirs else ref}")
        a, b = theirs[phase], mine[phase]
        for view in agreeing_views(phase, list(a.keys()) + [v for v in b.keys() if v not in a]):
            if c.run_meta.dcp > 1 and view in DCP_SHARE_VIEWS:
                continue  # one DCP rank's share on each rank (dcp_kv_sharding checks them)
            if view not in a or view not in b:
                c.fail(phase, view, f"recorded on rank {ref if view in a else c.rank} only")
            if view == "segments":
                ea = np.stack([a[view][f].astype(np.int64) for f in a[view].dtype.names], axis=-1) \
                    if a[view].dtype.names else a[view]
                eb = np.stack([b[view][f].astype(np.int64) for f in b[view].dtype.names], axis=-1) \
                    if b[view].dtype.names else b[view]
                c.expect(phase, view, want=ea, got=eb, what=f"differs from rank {ref}")
            else:
                c.expect(phase, view, want=a[view], got=b[view], what=f"differs from rank {ref}")


@bulk_rule("ranks_agree")
def _ranks_agree_bulk(b: Block, rank: int) -> np.ndarray:
    """The first rank of a step passes when no rank lacks the step and it is not alone; another
    rank passes when it recorded the first rank's phases and views, the compared ones shared."""
    out = none(b)
    dcp = b.run_meta.dcp > 1
    for i, sv in enumerate(b.svs):
        mine = sv.recs.get(rank)
        if mine is None:
            continue
        ref = min(sv.recs)
        if rank == ref:
            out[i] = not sv.missing and len(sv.recs) > 1
            continue
        theirs = sv.recs[ref]
        if mine.keys() != theirs.keys() or not all(isinstance(rec, Record) for rec in mine.values()):
            continue
        out[i] = all(same_phase(ph, theirs[ph], mine[ph], dcp=dcp) for ph in mine)
    return out


@check("positions_consistent",
        "global positions are contiguous per request, seq_lens == last position + 1, the first "
        "position is <= the CPU cursor (num_computed_tokens), and a request continuing from the "
        "previous step starts at its previous first position + q - num_rejected (the GPU cursor)")
def positions_consistent(c: Ctx) -> None:
    pos = c.t("positions").astype(np.int64)
    qsl = c.qsl()
    q = np.diff(qsl)
    t = int(qsl[-1])
    if pos.shape != (t,):
        c.fail("target", "positions", f"length {pos.shape}, expected T={t}")
    has = q > 0
    row = token_rows(qsl)
    first = np.zeros(q.shape[0], dtype=np.int64)
    first[has] = pos[qsl[:-1][has]]
    c.expect("target", "positions", want=first[row] + (np.arange(t) - qsl[row]), got=pos,
             what="positions of a request are not contiguous")
    sl = c.get("target", "seq_lens")
    hi = np.flatnonzero(has)
    if sl is not None:
        c.expect("target", "seq_lens", want=pos[qsl[1:][hi] - 1] + 1, got=sl.astype(np.int64)[hi],
                 what="seq_len != last position + 1", index_map=lambda i: (int(hi[i[0]]),))
    nc = c.get("target", "num_computed_tokens")
    if nc is not None:
        above = has & (first > nc.astype(np.int64))
        if above.any():
            i = int(np.argmax(above))
            c.fail("target", "positions", f"request row {i} starts at {int(first[i])}, past its CPU "
                   f"cursor {int(nc[i])} (an upper bound of the GPU cursor)", index=(int(qsl[i]),),
                   expected=f"<= {int(nc[i])}", actual=str(int(first[i])))
    pv = c.prev()
    if pv is None or pv.get("target", "positions") is None or pv.get("verify", "num_rejected") is None:
        return
    prid, rid = pv.t("req_ids"), c.t("req_ids")
    pqsl = pv.qsl()
    pq = np.diff(pqsl)
    ppos = pv.t("positions").astype(np.int64)
    prej = pv.get("verify", "num_rejected").astype(np.int64)
    prow = {str(x): i for i, x in enumerate(prid.tolist())}
    cur = np.array([prow.get(str(x), -1) for x in rid.tolist()], dtype=np.int64)
    rows = np.flatnonzero((cur >= 0) & has)
    pr = cur[rows]
    rows, pr = rows[pq[pr] > 0], pr[pq[pr] > 0]
    if rows.size == 0:
        return
    expected = ppos[pqsl[:-1][pr]] + pq[pr] - prej[pr]
    c.expect("target", "positions", want=expected, got=first[rows],
             what=f"first position != step {pv.step}'s first position + q - num_rejected (GPU cursor)",
             index_map=lambda i: (int(qsl[rows[i[0]]]),))


@bulk_rule("positions_consistent")
def _positions_consistent_bulk(b: Block, rank: int) -> np.ndarray:
    """``step_columns.positions_consistent_ok``."""
    return positions_consistent_ok(b, rank)


bulk_rule("verify_greedy")(verify_greedy_ok)  # step_columns.verify_greedy_ok


@check("verify_greedy",
       "greedy verification from the target's own argmax (top1_token, engine only): each request "
       "accepts the longest prefix of its drafts equal to the argmax of the rows before them, and "
       "samples those argmaxes (the accepted drafts, then the bonus/correction token)")
def verify_greedy(c: Ctx) -> None:
    top1 = c.need("target", "top1_token").astype(np.int64)
    ids = c.t("input_ids").astype(np.int64)
    nd = c.need("verify", "num_draft_tokens").astype(np.int64)
    nacc = c.need("verify", "num_accepted").astype(np.int64)
    ns = c.need("verify", "num_sampled").astype(np.int64)
    sampled = slot_groups(c.need("verify", "sampled_token_ids")).astype(np.int64)
    qsl = c.qsl()
    if top1.shape[0] != int((nd + 1).sum()):
        raise Skip("top1_token does not cover 1 + num_draft_tokens rows per request")
    start = 0
    for i in range(nd.shape[0]):
        d = int(nd[i])
        t = top1[start:start + d + 1]
        start += d + 1
        if ns[i] == 0:
            continue  # a partial prefill chunk samples nothing
        drafts = ids[int(qsl[i + 1]) - d:int(qsl[i + 1])]
        a = 0
        while a < d and drafts[a] == t[a]:
            a += 1
        if int(nacc[i]) != a:
            c.fail("verify", "num_accepted", f"request row {i} accepts {int(nacc[i])} drafts; its drafts "
                   f"{drafts.tolist()} against the target's argmax {t.tolist()} accept {a}", index=(i,),
                   expected=str(a), actual=str(int(nacc[i])))
        c.expect("verify", "sampled_token_ids", want=t[:a + 1], got=sampled[i, :a + 1],
                 what=f"request row {i}'s sampled tokens are not the target's argmax", index_map=lambda j: (i, j[0]))


# --------------------------------------------------------------------------- rules derived from vLLM's own
# The three checks below re-derive values the checks above take as given. Each cites the vLLM 0.33.0 code the
# rule is read from (docs/checks-and-faults.md lists them under "Derived rules").

@check("is_prefilling_rule",
       "is_prefilling is derived, not trusted: a request is prefilling iff its CPU cursor "
       "(num_computed_tokens) is short of its prefill_len (vLLM 0.33.0 "
       "v1/worker/gpu/model_runner.py:1338, num_computed_prefill_tokens < prefill_len)")
def is_prefilling_rule(c: Ctx) -> None:
    pf = c.need("target", "is_prefilling").astype(bool)
    nc = c.need("target", "num_computed_tokens").astype(np.int64)
    pl = c.need("target", "prefill_len").astype(np.int64)
    if not pf.shape == nc.shape == pl.shape:
        raise Skip("is_prefilling, num_computed_tokens and prefill_len differ in length")
    c.expect("target", "is_prefilling", want=nc < pl, got=pf,
             what="is_prefilling != (num_computed_tokens < prefill_len)")



bulk_rule("is_prefilling_rule", shared=True)(is_prefilling_ok)  # step_columns.is_prefilling_ok

@check("must_sample_rule",
       "the sampler's must-sample rule, derived: a request samples this step iff its seq_len "
       "(num_computed + scheduled tokens) reaches its prefill_len; a chunk that stops short samples "
       "nothing and rejects nothing (vLLM 0.33.0 v1/worker/gpu/input_batch.py:517-542, "
       "_get_num_sampled_and_rejected_kernel: is_chunked_prefilling = seq_len < prefill_len)")
def must_sample_rule(c: Ctx) -> None:
    ns = c.need("verify", "num_sampled").astype(np.int64)
    sl = c.need("target", "seq_lens").astype(np.int64)
    pl = c.need("target", "prefill_len").astype(np.int64)
    if not ns.shape == sl.shape == pl.shape:
        raise Skip("verify and the target batch differ in rows (verify_consistent reports it)")
    chunked = sl < pl  # bool[R]: a partial prefill chunk
    wrong = chunked != (ns == 0)
    if wrong.any():
        i = int(np.argmax(wrong))
        why = (f"seq_len {int(sl[i])} < prefill_len {int(pl[i])}: a partial chunk must not sample"
               if chunked[i] else f"seq_len {int(sl[i])} >= prefill_len {int(pl[i])}: the request must sample")
        c.fail("verify", "num_sampled", f"request row {i}: {why}", index=(i,),
               expected="0" if chunked[i] else ">= 1", actual=str(int(ns[i])))
    for view in ("num_rejected", "num_accepted"):
        got = c.get("verify", view)
        if got is not None and got.shape == ns.shape:
            got = got.astype(np.int64)
            c.expect("verify", view, want=np.where(chunked, 0, got), got=got,
                     what="a partial prefill chunk counts drafts")



bulk_rule("must_sample_rule", shared=True)(must_sample_ok)  # step_columns.must_sample_ok

@check("cursor_rolls_back_rejections",
       "the GPU cursor after verify is derived: a request's num_computed_after is its first position "
       "this step (the cursor before it) plus the tokens scheduled, less the drafts rejected (vLLM 0.33.0 "
       "v1/worker/gpu/input_batch.py:566-633, _post_update_kernel: computed_delta = query_len - "
       "num_rejected). Skipped where the producer does not record the cursor")
def cursor_rolls_back_rejections(c: Ctx) -> None:
    after = c.need("verify", "num_computed_after").astype(np.int64)
    nrej = c.need("verify", "num_rejected").astype(np.int64)
    pos = c.t("positions").astype(np.int64)
    qsl = c.qsl()
    if not after.shape == nrej.shape == (qsl.shape[0] - 1,):
        raise Skip("verify and the target batch differ in rows (verify_consistent reports it)")
    q = np.diff(qsl)  # int64[R]
    live = (after >= 0) & (q > 0)  # -1: a masked row vLLM's post_update skips
    idx = c.get("verify", "idx_mapping")
    if idx is not None and idx.shape == after.shape:
        live &= idx >= 0
    starts = qsl[:-1][live]
    if starts.size and (starts.max() >= pos.shape[0] or starts.min() < 0):
        raise Skip("query starts outside the target's positions (views_in_bounds reports it)")
    want = after.copy()
    want[live] = pos[starts] + q[live] - nrej[live]
    c.expect("verify", "num_computed_after", want=want, got=after,
             what="the cursor after verify != the first position this step + q - num_rejected")



bulk_rule("cursor_rolls_back_rejections", shared=True)(cursor_ok)  # step_columns.cursor_ok

@check("num_accepted_from_tokens",
       "num_accepted is derived from the drafts and the target's sampled tokens: where a request "
       "rejects a draft, the token sampled in its place differs from it (greedy: the target's argmax "
       "was not the draft; random: the residual max(p - q, 0) is zero at the rejected draft; vLLM "
       "0.33.0 v1/worker/gpu/spec_decode/rejection_sampler_utils.py:600-617, 726-733 and 937-962). "
       "Skipped under another rejection method (synthetic, block, fly) or a stand-in rejection sampler")
def num_accepted_from_tokens(c: Ctx) -> None:
    if not c.run_meta.standard_rejection:
        raise Skip("run.json declares another rejection method than vLLM's standard one, or a stand-in "
                   "rejection sampler")
    nacc = c.need("verify", "num_accepted").astype(np.int64)
    ns = c.need("verify", "num_sampled").astype(np.int64)
    nd = c.need("verify", "num_draft_tokens").astype(np.int64)
    sampled = slot_groups(c.need("verify", "sampled_token_ids")).astype(np.int64)
    ids = c.t("input_ids").astype(np.int64)
    qsl = c.qsl()
    if not nacc.shape == ns.shape == nd.shape == (qsl.shape[0] - 1,) or sampled.shape[0] != nacc.shape[0]:
        raise Skip("verify and the target batch differ in rows (verify_consistent reports it)")
    rows = np.flatnonzero((ns > 0) & (nacc < nd) & (nacc >= 0) & (nacc < sampled.shape[1]))
    if rows.size == 0:
        return
    at = qsl[1:][rows] - nd[rows] + nacc[rows]  # the global row of the first rejected draft
    if (at < 0).any() or (at >= ids.shape[0]).any():
        raise Skip("draft rows outside the target's tokens (views_in_bounds reports it)")
    same = sampled[rows, nacc[rows]] == ids[at]
    if same.any():
        j = int(np.argmax(same))
        i = int(rows[j])
        c.fail("verify", "num_accepted", f"request row {i} rejects draft {int(nacc[i])} (token {int(ids[at[j]])}) "
               f"but samples that same token in its place: the draft was accepted", index=(i,),
               expected=f">= {int(nacc[i]) + 1}", actual=str(int(nacc[i])))


bulk_rule("num_accepted_from_tokens", shared=True)(accepted_ok)  # step_columns.accepted_ok
