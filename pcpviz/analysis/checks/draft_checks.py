"""The draft phases' checks: the rank-local MTP draft prefill (draft_0) and the replicated draft
decodes (draft_k, k >= 1)."""

from __future__ import annotations

import numpy as np


from pcpviz.reference.drafts import draft_prefill_inputs, partial_chunk_rows

from pcpviz.trace import draft_index
from pcpviz.trace.shapes import slot_groups, table_groups, view_text

from .columns import Block, all_per_step, bulk_rule, bulk_skip, none, ragged, same_values, starts
from .context import Ctx, Skip, check, token_rows
from .draft_columns import draft_input_ids_ok
from .draft_local_columns import rank_local_cols


def _partial_chunk_last_rows(c: Ctx) -> None:
    """The previous step's partial prefill chunks: the last row of each one's draft prefill
    input is the prompt token this step's chunk of the same request starts with (vLLM's
    next_prefill_tokens). PCP=2 example: prompt [3, 1, 4, 1, 5], chunk [3, 1, 4] at step 0 ->
    draft_global_input_ids [1, 4, 1]; step 1's chunk starts with 1."""
    pv = c.prev()
    if pv is None:
        return
    pdgi = pv.get("draft_0", "draft_global_input_ids")
    pns, prid, prej = pv.get("verify", "num_sampled"), pv.get("target", "req_ids"), pv.get("verify", "num_rejected")
    if pdgi is None or pns is None or prid is None or prej is None or pv.get("target", "num_scheduled_tokens") is None:
        return
    pqsl, pq = pv.qsl(), pv.q()
    ids, rid, qsl = c.t("input_ids").astype(np.int64), c.t("req_ids"), c.qsl()
    here = {str(x): i for i, x in enumerate(rid.tolist())}
    for i in partial_chunk_rows(pns, pq).tolist():
        j = here.get(str(prid[i]))
        if j is None or qsl[j + 1] <= qsl[j]:
            continue
        last = int(pqsl[i] + pq[i] - int(prej[i]) - 1)
        if int(pdgi[last]) != int(ids[qsl[j]]):
            pv.fail("draft_0", "draft_global_input_ids", f"the last row of request {prid[i]!s}'s partial "
                   f"prefill chunk is not the prompt's next token (step {c.step} starts its chunk with it)",
                   index=(last,), expected=str(int(ids[qsl[j]])), actual=str(int(pdgi[last])))

@check("draft_prefill_rank_local",
        "draft_0 is rank_local: it reuses the target's local rows (draft_positions == "
        "local_positions, draft_seq_lens == local_seq_lens, block_table_draft == "
        "block_table_local) and the target's gathered slot mapping ([G, N*P]); at PCP = 1 the "
        "target's global rows, block tables and slot mapping")
def draft_prefill_rank_local(c: Ctx) -> None:
    if not c.has("draft_0"):
        raise Skip("no draft_0 phase")
    if c.run_meta.method == "dspark":
        # DSpark drafts replicated from its first step (its drafter is built with PCP=1).
        raise Skip("DSpark has no rank-local draft prefill")
    view = c.get("draft_0", "view")
    checked = False
    if view is not None and c.pcp() > 1:
        checked = True
        if view_text(view) != "rank_local":
            c.fail("draft_0", "view", "the MTP draft prefill runs on the rank-local rows",
                   expected="'rank_local'", actual=repr(view_text(view)))
    pairs = [("slot_mapping_draft", "slot_mapping_gathered", slot_groups),
             ("draft_positions", "local_positions", np.asarray),
             ("draft_seq_lens", "local_seq_lens", np.asarray),
             ("block_table_draft", "block_table_local", table_groups)]
    single = c.pcp() == 1 and c.get("target", "local_positions") is None
    if single:  # PCP = 1: the draft prefill runs on the global batch (rows past T are padding)
        pairs = [("slot_mapping_draft", "slot_mapping_global", slot_groups),
                 ("draft_positions", "positions", np.asarray),
                 ("draft_seq_lens", "seq_lens", np.asarray), ("block_table_draft", "block_table_global", table_groups)]
    for dview, tview, norm in pairs:
        d, t = c.get("draft_0", dview), c.get("target", tview)
        if d is None or t is None:
            continue
        checked = True
        d, t = norm(d), norm(t)
        if single and dview in ("slot_mapping_draft", "draft_positions") and d.shape[-1] >= t.shape[-1]:
            d = d[..., : t.shape[-1]]
            if dview == "draft_positions":  # rows past q - num_rejected keep stale positions (never read)
                keep = _accepted_rows(c)
                if keep is not None and keep.shape == d.shape:
                    d, t = np.where(keep, d, -1), np.where(keep, t, -1)
        if dview == "slot_mapping_draft" and d.shape[-1] != t.shape[-1]:
            c.fail("draft_0", dview, f"length {d.shape[-1]}, expected the expanded N*P="
                   f"{t.shape[-1]} (the target's gathered mapping)")
        c.expect("draft_0", dview, want=t, got=d, what=f"{dview} != the target's {tview}")
    if not checked:
        raise Skip("no slot_mapping_draft" if c.get("draft_0", "slot_mapping_draft") is None
                   else "no target slot mapping to compare with")


_RANK_LOCAL_PAIRS = (("slot_mapping_draft", "slot_mapping_gathered", slot_groups),
                     ("draft_positions", "local_positions", np.asarray),
                     ("draft_seq_lens", "local_seq_lens", np.asarray),
                     ("block_table_draft", "block_table_local", table_groups))


@bulk_rule("draft_prefill_rank_local")
def _draft_prefill_rank_local_bulk(b: Block, rank: int) -> np.ndarray:
    """PCP > 1 (run.json), not DSpark: draft_0 recorded, its view (where recorded) 'rank_local',
    and each of its rank-local views recorded with its target twin equal to it, one compared."""
    out = none(b)
    if not b.run_meta.pcp or b.run_meta.pcp <= 1 or b.run_meta.method == "dspark":
        return out
    got = rank_local_cols(b, rank)  # the block as columns; None: a view has none
    if got is not None:
        return got
    for i, sv in enumerate(b.svs):
        phases = sv.recs.get(rank, {})
        draft, target = phases.get("draft_0"), phases.get("target", {})
        if draft is None:
            continue
        view = draft.get("view")
        checked, good = view is not None, view is None or view_text(view) == "rank_local"
        for dview, tview, norm in _RANK_LOCAL_PAIRS:
            d, t = draft.get(dview), target.get(tview)
            if d is not None and t is not None:
                checked = True
                good = good and same_values(norm(t), norm(d))
        out[i] = checked and good
    return out


def _accepted_rows(c: Ctx) -> np.ndarray | None:
    """bool[T]: global rows below each request's q - num_rejected (what the draft prefill's
    ``prepare_prefill_inputs`` writes); None without the verify outcome."""
    rej = c.get("verify", "num_rejected")
    qsl = c.qsl()
    if rej is None or rej.shape[0] != qsl.shape[0] - 1:
        return None
    q = np.diff(qsl)
    row = np.repeat(np.arange(q.shape[0]), q)
    return (np.arange(int(qsl[-1])) - qsl[row]) < (q - rej.astype(np.int64))[row]


@check("draft_last_token_indices",
        "draft_0's draft_last_token_indices[i] == query_start_loc[i] + q[i] - num_rejected[i] - 1 "
        "(global rows; the last accepted token of each request)")
def draft_last_token_indices(c: Ctx) -> None:
    lti = c.need("draft_0", "draft_last_token_indices")
    rej = c.need("verify", "num_rejected").astype(np.int64)
    qsl, q = c.qsl(), c.q()
    if lti.shape != q.shape or rej.shape != q.shape:
        c.fail("draft_0", "draft_last_token_indices", f"length {lti.shape}, expected R={q.shape[0]}")
    has = np.flatnonzero(q > 0)
    c.expect("draft_0", "draft_last_token_indices", want=(qsl[:-1] + q - rej - 1)[has],
             got=lti.astype(np.int64)[has], what="not the last accepted row of its request",
             index_map=lambda i: (int(has[i[0]]),))


def _draft_global_inputs(c: Ctx, dgi: np.ndarray) -> None:
    """The rank-independent part of ``draft_input_ids``: draft_0's global inputs."""
    ids = c.t("input_ids").astype(np.int64)
    qsl, q = c.qsl(), c.q()
    rej = c.need("verify", "num_rejected").astype(np.int64)
    ns = c.need("verify", "num_sampled").astype(np.int64)
    sampled = slot_groups(c.need("verify", "sampled_token_ids")).astype(np.int64)
    if dgi.shape != ids.shape:
        c.fail("draft_0", "draft_global_input_ids", f"length {dgi.shape}, expected T={ids.shape[0]}")
    t = ids.shape[0]
    last_sampled = sampled[np.arange(q.shape[0]), np.maximum(ns - 1, 0)] if q.size else ns
    # the next prompt token of a partial chunk is known only to the next step (checked there)
    exp, _ = draft_prefill_inputs(ids, qsl, num_rejected=rej, num_sampled=ns, last_sampled=last_sampled,
                                  next_prompt_tokens=np.full(q.shape[0], -1, np.int64))
    row = token_rows(qsl)
    off = np.arange(t) - qsl[row]
    valid = (q - rej)[row]
    read = (off < valid - 1) | ((off == valid - 1) & (ns[row] > 0))  # the rows the drafter reads
    m = np.flatnonzero(read)
    c.expect("draft_0", "draft_global_input_ids", want=exp[m], got=dgi.astype(np.int64)[m],
             what="draft prefill input is not the next target token (or the sampled one)",
             index_map=lambda i: (int(m[i[0]]),))
    _partial_chunk_last_rows(c)



@bulk_rule("draft_last_token_indices", shared=True)
def _draft_last_token_indices_bulk(b: Block, rank: int) -> np.ndarray:
    """R indices, each request's (with tokens) query_start_loc + q - num_rejected - 1."""
    lti, rej, q = b.col(rank, "draft_0", "draft_last_token_indices"), b.col(rank, "verify", "num_rejected"), \
        b.col(rank, "target", "num_scheduled_tokens")
    if lti is None or rej is None or q is None:
        return none(b)
    ok = lti.present & rej.present & q.present & (lti.lens == q.lens) & (rej.lens == q.lens)
    seg, i = ragged(np.where(ok, q.lens, 0))
    first = starts(q)[q.offsets[seg] + i] if seg.size else seg
    qi, got, r = q.at(seg, i)[0], lti.at(seg, i)[0], rej.at(seg, i)[0]
    good = (qi <= 0) | (got == first + qi - r - 1)
    return ok & all_per_step(good, seg, len(b))


bulk_rule("draft_input_ids")(draft_input_ids_ok)  # draft_columns.draft_input_ids_ok


@check("draft_input_ids",
        "draft_0's draft_global_input_ids are the target ids shifted left by one within the "
        "accepted rows, the last accepted row holding the sampled token; its local "
        "draft_input_ids are their gather; draft_k (k >= 1) inputs are draft_{k-1}'s tokens")
def draft_input_ids(c: Ctx) -> None:
    drafts = c.draft_phases()
    if not drafts:
        raise Skip("no draft_0 phase")
    checked = False
    dgi = c.get("draft_0", "draft_global_input_ids")
    if dgi is not None:
        checked = True
        # dgi read again inside: ``once`` replays another rank's result only where every read
        # it logged gives this rank the same array (a dgi captured from outside went unlogged)
        c.once("draft_global_input_ids",
               lambda: _draft_global_inputs(c, c.get("draft_0", "draft_global_input_ids")))
        dii = c.get("draft_0", "draft_input_ids")
        if dii is not None and c.get("target", "padded_gather_idx") is not None:
            n = c.num_local()
            c.expect("draft_0", "draft_input_ids", want=dgi[c.rank_rows()].astype(np.int64),
                     got=dii[:n].astype(np.int64), what="local draft input != draft_global_input_ids of its token")
    prev_tokens = None
    for k, phase in drafts:
        if k >= 1 and prev_tokens is not None:
            dii = c.get(phase, "draft_input_ids")
            if dii is not None:
                checked = True
                c.expect(phase, "draft_input_ids", want=prev_tokens.astype(np.int64), got=dii.astype(np.int64),
                         what=f"draft_{k} input != draft_{k - 1}'s tokens")
        prev_tokens = c.get(phase, "draft_tokens")
    if not checked:
        raise Skip("no draft_global_input_ids")


def _no_draft_decode(b: Block, rank: int) -> list:
    """"no draft_1 phase" where the rank recorded no draft_k with k >= 1 (the draft-decode
    checks' first test); made once per block and rank (three checks ask), each step's answer
    once per distinct tuple of phases."""
    key = ("no_draft_decode", rank)
    if key not in b.memo:
        by_phases: dict[tuple, str | None] = {}
        out = []
        for sv in b.svs:
            phases = tuple(sv.recs.get(rank, ()))
            why = by_phases.get(phases, _NOT_ASKED)
            if why is _NOT_ASKED:
                why = by_phases[phases] = None if any((draft_index(p) or 0) >= 1 for p in phases) \
                    else "no draft_1 phase"
            out.append(why)
        b.memo[key] = out
    return list(b.memo[key])


_NOT_ASKED = object()


for _name in ("draft_decode_replicated", "draft_block_tables_global", "draft_positions_advance"):
    bulk_skip(_name)(_no_draft_decode)


@check("draft_decode_replicated",
        "draft_k (k >= 1) is replicated on the global rows: view 'replicated', slot_mapping_draft "
        "unexpanded ([G, R]: the trace keeps the R real columns of vLLM's padded [G, num_tokens]) and equal "
        "to the slots of block_table_global's rows at draft_positions, none in the null block 0")
def draft_decode_replicated(c: Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise Skip("no draft_1 phase")
    r = c.num_reqs()
    for k, phase in phases:
        view = c.get(phase, "view")
        if view is not None and view_text(view) != "replicated":
            c.fail(phase, "view", "draft decodes run replicated on the global batch",
                   expected="'replicated'", actual=repr(view_text(view)))
        for v in ("draft_input_ids", "draft_positions", "draft_seq_lens", "draft_tokens"):
            a = c.get(phase, v)
            if a is not None and a.shape != (r,):
                c.fail(phase, v, f"shape {list(a.shape)}, expected one row per request [{r}]")
        smd = c.get(phase, "slot_mapping_draft")
        if smd is None:
            raise Skip("no slot_mapping_draft")
        smd = slot_groups(smd)
        if smd.shape[-1] != r:
            c.fail(phase, "slot_mapping_draft", f"length {smd.shape[-1]}, expected R={r}: draft decode "
                   "slot mappings are unexpanded (the attention layer writes locally)",
                   expected=f"[G, {r}]", actual=str(list(smd.shape)))
        pos, table = c.get(phase, "draft_positions"), c.get("target", "block_table_global")
        if pos is None or table is None or c.run_meta.kv_block_sizes is None:
            continue
        pos = pos.astype(np.int64)
        exp = c.slots(table_groups(table), np.arange(r + 1, dtype=np.int64), pos)
        c.expect(phase, "slot_mapping_draft", want=exp, got=smd,
                 what="slot differs from the global row's block at draft_positions")
        c.no_null_block(phase, "slot_mapping_draft", want=exp, got=smd, positions=pos)


@check("draft_block_tables_global",
        "draft_k (k >= 1) block_table_draft == block_table_global (the block tables were gathered "
        "back to global order before the replicated decodes)")
def draft_block_tables_global(c: Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise Skip("no draft_1 phase")
    btg = table_groups(c.t("block_table_global"))
    checked = False
    for k, phase in phases:
        btd = c.get(phase, "block_table_draft")
        if btd is None:
            continue
        checked = True
        c.expect(phase, "block_table_draft", want=btg, got=table_groups(btd),
                 what="draft decode block-table row != the request's global row (gather skipped?)")
    if not checked:
        raise Skip("no block_table_draft")


@check("draft_positions_advance",
        "draft_1 positions == positions[draft_last_token_indices] + 1, draft_k == draft_{k-1} + 1, "
        "and draft_seq_lens == draft_positions + 1 (k >= 1)")
def draft_positions_advance(c: Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise Skip("no draft_1 phase")
    q = c.q()
    has = np.flatnonzero(q > 0)
    imap = lambda i: (int(has[i[0]]),)  # noqa: E731
    prev = None
    if phases[0][0] == 1:
        lti = c.need("draft_0", "draft_last_token_indices").astype(np.int64)
        pos = c.t("positions").astype(np.int64)
        if has.size and (lti[has].min() < 0 or lti[has].max() >= pos.shape[0]):
            c.fail("draft_0", "draft_last_token_indices", "indexes outside the global tokens")
        prev = np.zeros(q.shape[0], dtype=np.int64)
        prev[has] = pos[lti[has]]
    for k, phase in phases:
        dp = c.need(phase, "draft_positions").astype(np.int64)
        if dp.shape != q.shape:
            c.fail(phase, "draft_positions", f"shape {list(dp.shape)}, expected [{q.shape[0]}]")
        if prev is not None:
            what = ("!= positions[draft_last_token_indices] + 1" if k == 1
                    else f"!= draft_{k - 1} positions + 1")
            c.expect(phase, "draft_positions", want=(prev + 1)[has], got=dp[has], what=what, index_map=imap)
        dsl = c.get(phase, "draft_seq_lens")
        if dsl is not None:
            c.expect(phase, "draft_seq_lens", want=(dp + 1)[has], got=dsl.astype(np.int64)[has],
                     what="draft seq_len != draft position + 1", index_map=imap)
        prev = dp
