"""Checks of the data the model consumed: hidden-state hand-offs proven by per-row fingerprints
(``*_fp`` views, ``pcpviz.trace.fingerprints.row_fingerprints``, recorded by the engine and by the
vLLM plugin at vLLM's own hand-offs) and the target outputs every rank must share. Traces without
fingerprints (older traces, draft forwards replayed as FULL CUDA graphs) skip them, saying which
view is missing.

PCP=2 example (a fresh 6-token prefill, P = 4 local rows, rank 0 holds tokens 0, 1, 4, 5)::

    target   hidden_local_fp  rank 0 [a0 a1 a4 a5]  rank 1 [a2 a3 · ·]
             hidden_fp        [a0 a1 a2 a3 a4 a5] == concat(ranks)[hidden_restore_idx]
    draft_0  hidden_in_fp == the rank's hidden_local_fp (the MTP layer reads the target's rows)
             hidden_last_fp[i] == concat(ranks' mtp_local_fp)[hidden_restore_idx[last[i]]]
    draft_1  hidden_in_fp == draft_0's hidden_out_fp; draft_k reads what draft_{k-1} handed on
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace import draft_index

from .columns import Block, all_per_step, bulk_rule, gathered, none, ragged, same_values
from .context import Ctx, Skip, check


def _gathered(c: Ctx, phase: str, view: str) -> np.ndarray:
    """int64[N*P]: ``view`` of ``phase`` of every rank, rank-major (the all-gather's order); the
    same for every rank's check, so built once a step."""
    key = ("gathered", phase, view, c.pcp())
    if key in c.cache:
        return c.cache[key]
    parts = []
    for r in range(c.pcp()):
        v = c.rank_view(r, phase, view)
        if v is None:
            raise Skip(f"no {view} on rank {r}")
        parts.append(np.asarray(v, dtype=np.int64))
    if len({p.shape for p in parts}) != 1:
        c.fail(phase, view, f"ranks record {view} of different lengths {[p.shape[0] for p in parts]}")
    out = c.cache[key] = np.concatenate(parts)
    return out


@check("hidden_restored",
       "the restored hidden states are the ranks' local rows put back in global order: target "
       "hidden_fp == all ranks' hidden_local_fp[hidden_restore_idx], and draft_0's hidden_last_fp "
       "== all ranks' mtp_local_fp[hidden_restore_idx[draft_last_token_indices]] (fingerprints)")
def hidden_restored(c: Ctx) -> None:
    hfp = c.need("target", "hidden_fp").astype(np.int64)
    hri = c.t("hidden_restore_idx").astype(np.int64)
    g = _gathered(c, "target", "hidden_local_fp")
    if hri.size and (hri.min() < 0 or hri.max() >= g.shape[0]):
        c.fail("target", "hidden_restore_idx", f"indexes outside the {g.shape[0]} gathered rows")
    c.expect("target", "hidden_fp", want=g[hri], got=hfp,
             what="restored hidden row != the gathered local row it restores")
    last = c.get("draft_0", "hidden_last_fp")
    lti = c.get("draft_0", "draft_last_token_indices")
    if last is None or lti is None:
        return
    q = c.q()
    has = np.flatnonzero(q > 0)
    lti = lti.astype(np.int64)
    if lti.shape != q.shape or (has.size and (lti[has].min() < 0 or lti[has].max() >= hri.shape[0])):
        c.fail("draft_0", "draft_last_token_indices", f"not one global row per request (R={q.shape[0]})")
    m = _gathered(c, "draft_0", "mtp_local_fp")
    c.expect("draft_0", "hidden_last_fp", want=m[hri[lti[has]]], got=last.astype(np.int64)[has],
             what="the hidden state draft token 0 is sampled from is not the restored MTP output of the last "
             "accepted row", index_map=lambda i: (int(has[i[0]]),))


@bulk_rule("hidden_restored")
def _hidden_restored_bulk(b: Block, rank: int) -> np.ndarray:
    """hidden_fp == the gathered hidden_local_fp at hidden_restore_idx (all inside it), and, where
    draft_0 records hidden_last_fp and draft_last_token_indices, one per request, each request's
    (with tokens) the gathered mtp_local_fp at the restored row of its last token."""
    hfp, hri = b.col(rank, "target", "hidden_fp"), b.col(rank, "target", "hidden_restore_idx")
    g = gathered(b, "target", "hidden_local_fp")
    last, lti = b.col(rank, "draft_0", "hidden_last_fp"), b.col(rank, "draft_0", "draft_last_token_indices")
    q, m = b.col(rank, "target", "num_scheduled_tokens"), gathered(b, "draft_0", "mtp_local_fp")
    if None in (hfp, hri, g, last, lti, q, m):
        return none(b)
    (g_ok, _, g_at), (m_ok, _, m_at) = g, m
    ok = hfp.present & hri.present & g_ok & (hfp.lens == hri.lens)
    seg, i = ragged(np.where(ok, hri.lens, 0))
    row, in1 = hri.at(seg, i)
    want, in2 = g_at(seg, row)
    ok &= all_per_step(in1 & in2 & (want == hfp.at(seg, i)[0]), seg, len(b))
    drafts = last.present & lti.present
    ok &= ~(last.present ^ lti.present) & (~drafts | (q.present & m_ok & (lti.lens == q.lens) & (last.lens == q.lens)))
    seg, i = ragged(np.where(ok & drafts, q.lens, 0))
    has = q.at(seg, i)[0] > 0
    tok, in1 = lti.at(seg, i)
    row, in2 = hri.at(seg, tok)
    want, in3 = m_at(seg, row)
    good = ~has | (in1 & in2 & in3 & (want == last.at(seg, i)[0]))
    return ok & all_per_step(good, seg, len(b))


@check("hidden_handoffs",
       "each draft phase reads the hidden state its producer handed it: draft_0's hidden_in_fp == "
       "the target's hidden_local_fp (this rank's rows), draft_k's hidden_in_fp == draft_{k-1}'s "
       "hidden_out_fp (fingerprints)")
def hidden_handoffs(c: Ctx) -> None:
    drafts = c.draft_phases()
    if not drafts:
        raise Skip("no draft_0 phase")
    checked = False
    src, src_name = c.get("target", "hidden_local_fp"), "the target's hidden_local_fp"
    for k, phase in drafts:
        hin = c.get(phase, "hidden_in_fp")
        if hin is not None and src is not None:
            checked = True
            c.expect(phase, "hidden_in_fp", want=np.asarray(src, dtype=np.int64), got=hin.astype(np.int64),
                     what=f"draft_{k} read a hidden state other than {src_name}")
        src, src_name = c.get(phase, "hidden_out_fp"), f"draft_{k}'s hidden_out_fp"
    if not checked:
        raise Skip("no hidden_in_fp")


@bulk_rule("hidden_handoffs")
def _hidden_handoffs_bulk(b: Block, rank: int) -> np.ndarray:
    """Steps whose draft phases are draft_0 .. draft_{m-1} (m >= 1), with at least one
    hidden_in_fp compared, each equal to its source (the target's hidden_local_fp, then
    draft_{k-1}'s hidden_out_fp) where both are recorded."""
    m = np.zeros(len(b), dtype=np.int64)
    for s, sv in enumerate(b.svs):
        drafts = [p for p in sv.recs.get(rank, {}) if draft_index(p) is not None]
        if all(f"draft_{k}" in sv.recs[rank] for k in range(len(drafts))):
            m[s] = len(drafts)
    ok, checked = m > 0, np.zeros(len(b), dtype=bool)
    src = b.col(rank, "target", "hidden_local_fp")
    for k in range(int(m.max(initial=0))):
        hin = b.col(rank, f"draft_{k}", "hidden_in_fp")
        if src is None or hin is None:
            return none(b)
        link = (m > k) & hin.present & src.present
        checked |= link
        ok &= ~link | (hin.lens == src.lens)
        seg, j = ragged(np.where(ok & link, hin.lens, 0))
        ok &= all_per_step(hin.at(seg, j)[0] == src.at(seg, j)[0], seg, len(b))
        src = b.col(rank, f"draft_{k}", "hidden_out_fp")
    return ok & checked


@check("target_outputs_agree",
       "every rank ends the target forward with the same restored hidden states and sampled tokens "
       "(hidden_fp / hidden_hash and top1_token identical on every rank: each restores the "
       "all-gathered rows)")
def target_outputs_agree(c: Ctx) -> None:
    ranks = sorted(c.sv.recs)
    if len(ranks) < 2:
        raise Skip("single rank")
    ref = ranks[0]
    mine, theirs = c.phases.get("target", {}), c.sv.recs[ref].get("target", {})
    if c.rank == ref:
        if not any(v in mine for v in ("hidden_fp", "hidden_hash", "top1_token")):
            raise Skip("no hidden_fp / top1_token")
        return
    checked = False
    for view in ("hidden_fp", "hidden_hash", "top1_token"):
        a, b = theirs.get(view), mine.get(view)
        if a is None or b is None or np.asarray(a).dtype.kind not in "iu":
            continue
        checked = True
        c.expect("target", view, want=np.asarray(a), got=np.asarray(b),
                 what=f"differs from rank {ref}: the ranks' target forwards forked (their gathered inputs or "
                      "weights differ)")
    if not checked:
        raise Skip("no hidden_fp / top1_token")


_OUTPUTS = ("hidden_fp", "hidden_hash", "top1_token")


@bulk_rule("target_outputs_agree")
def _target_outputs_agree_bulk(b: Block, rank: int) -> np.ndarray:
    """The first of two or more ranks passes with one of the outputs recorded; another rank
    when it and the first recorded one integer output both, each such equal."""
    out = none(b)
    for i, sv in enumerate(b.svs):
        if rank not in sv.recs or len(sv.recs) < 2:
            continue
        ref = min(sv.recs)
        mine, theirs = sv.recs[rank].get("target", {}), sv.recs[ref].get("target", {})
        if rank == ref:
            out[i] = any(v in mine for v in _OUTPUTS)
            continue
        pairs = [(theirs.get(v), mine.get(v)) for v in _OUTPUTS]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None and np.asarray(x).dtype.kind in "iu"]
        out[i] = bool(pairs) and all((x is y and x.dtype.names is None) or same_values(x, y) for x, y in pairs)
    return out
