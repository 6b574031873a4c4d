"""The target step's checks: the PCP layout, KV writes and slot mappings, the rank-local batch,
sampling (vLLM 0.33.0's ``PCPManager``)."""

from __future__ import annotations

import numpy as np

from pcpviz.reference.blocks import PAD_SLOT_ID
from pcpviz.analysis.compare import fmt_value as _fmt, short_repr
from pcpviz.reference.layout import plan_layout, replicated_requests
from pcpviz.trace import SEGMENT_DTYPE, segments_table

from pcpviz.trace.bounds import step_problems

from pcpviz.trace.shapes import slot_groups, table_groups, view_text

from .columns import Block, all_per_step, bulk_rule, none, ragged, rank_rows, step_sums
from .context import Ctx, Skip, check, local_segments, segment_rows, segments_of
from .local_batch_columns import local_batch_cols
from .layout_columns import (expected_layout, global_slots_ok, kv_write_mask_ok, kv_written_once_ok, local_batch_ok,
                             matches_plan)


@check("views_in_bounds",
        "every view fits its declaration (dtype, number of axes) and the bounds on sizes taken "
        "from a file (indices in -1..2**31-1, strings of at most 4096 characters, at most 2**24 "
        "tokens), and num_scheduled_tokens, query_start_loc and the token axis agree; the other "
        "checks do not run on a (step, rank) that fails it")
def views_in_bounds(c: Ctx) -> None:
    problems = c.sv.cache.get(("bounds", c.rank))
    if problems is None:
        problems = step_problems(c.phases)
    if problems:
        phase, _, rest = problems[0].partition(".")
        view = rest.split(":", 1)[0].split("[", 1)[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        c.fail(phase, view, problems[0].split(": ", 1)[1] + more)

@bulk_rule("views_in_bounds")
def _views_in_bounds_bulk(b: Block, rank: int) -> np.ndarray:
    """Passes where the step's bounds problems (the runner's, cached) are none."""
    return np.fromiter((rank in sv.recs and not sv.cache.get(("bounds", rank), True) for sv in b.svs),
                       dtype=bool, count=len(b))


@check("layout_matches_plan",
        "recorded segments, per_rank_num_tokens, padded_gather_idx, hidden_restore_idx and "
        "kv_write_mask equal plan_layout(num_scheduled_tokens, is_prefilling, pcp, ...) with the "
        "recorded P")
def layout_matches_plan(c: Ctx) -> None:
    q, pf = c.t("num_scheduled_tokens"), c.t("is_prefilling")
    c.t("padded_gather_idx")
    p = c.padded()
    key = ("plan", p, q.tobytes(), pf.tobytes())
    plan = c.cache.get(key)
    if plan is None:
        try:
            plan = plan_layout(q.astype(np.int64), pf.astype(bool), c.pcp(),
                               shard_decode_requests=c.shard(), dcp_world_size=c.run_meta.dcp,
                               padded_num_tokens=p)
        except ValueError as exc:
            plan = exc
        c.cache[key] = plan
    if isinstance(plan, ValueError):
        c.fail("target", "padded_gather_idx", f"plan_layout rejects this batch: {plan}")
    expected = {
        "segments": segments_table(plan.segments_by_rank),
        "per_rank_num_tokens": np.asarray(plan.per_rank_num_tokens, dtype=np.int64),
        "padded_gather_idx": plan.padded_gather_idx,
        "hidden_restore_idx": plan.hidden_restore_idx,
        "kv_write_mask": plan.kv_write_mask,
    }
    for view, exp in expected.items():
        act = c.get("target", view)
        if act is None:
            continue
        if view == "segments":
            segments_of(c)
            exp = np.stack([exp[f] for f in SEGMENT_DTYPE.names], axis=1) if exp.size else \
                np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64)
            act = np.stack([act[f].astype(np.int64) for f in SEGMENT_DTYPE.names], axis=1) if act.size \
                else np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64)
            c.expect("target", view, want=exp, got=act, what="segment rows (global_req_idx, global_start, "
                     "global_stop, local_start, local_stop, rank) differ from the plan")
        else:
            c.expect("target", view, want=exp, got=np.asarray(act).astype(exp.dtype, copy=False),
                     what=f"{view} differs from plan_layout")


@bulk_rule("layout_matches_plan", shared=True)
def _layout_matches_plan_bulk(b: Block, rank: int) -> np.ndarray:
    """Steps recording integer num_scheduled_tokens and padded_gather_idx (N * P rows, N run.json's
    pcp) and a bool is_prefilling whose recorded layout views equal plan_layout's."""
    out, world, dcp = none(b), b.run_meta.pcp, b.run_meta.dcp
    if not world or world < 1:
        return out
    shard = b.run_meta.shard_decode_requests if b.run_meta.shard_decode_requests is not None else world > 1 and dcp == 1
    cols = {v: b.arrays(rank, "target", v) for v in _PLAN_READS}
    for i in range(len(b)):
        rec = {v: a[i] for v, a in cols.items() if a[i] is not None}
        q, pf, pgi = rec.get("num_scheduled_tokens"), rec.get("is_prefilling"), rec.get("padded_gather_idx")
        if q is None or pf is None or pgi is None or q.dtype.kind not in "iu" or pf.dtype.kind not in "biu" \
                or pgi.dtype.kind not in "iub" or q.ndim != 1 or pf.ndim != 1 or pgi.ndim != 1 \
                or pgi.shape[0] % world:
            continue
        p = pgi.shape[0] // world
        key = (world, shard, dcp, p, q.astype(np.int64).tobytes(), pf.astype(bool).tobytes())
        exp = expected_layout(key, q, pf, world=world, shard=shard, dcp=dcp, p=p)
        out[i] = exp is not None and matches_plan(rec, exp)
    return out


_PLAN_READS = ("num_scheduled_tokens", "is_prefilling", "padded_gather_idx", "segments", "per_rank_num_tokens",
               "hidden_restore_idx", "kv_write_mask")


@check("restore_gather_identity",
        "padded_gather_idx[hidden_restore_idx] == arange(T): restoring the all-gathered rows "
        "gives back the global token order")
def restore_gather_identity(c: Ctx) -> None:
    pgi, hri = c.t("padded_gather_idx"), c.t("hidden_restore_idx")
    t = int(c.qsl()[-1])
    if hri.shape != (t,):
        c.fail("target", "hidden_restore_idx", f"length {hri.shape[0] if hri.ndim else 0}, expected T={t}")
    bad = (hri < 0) | (hri >= pgi.shape[0])
    if bad.any():
        i = int(np.argmax(bad))
        c.fail("target", "hidden_restore_idx", f"row {int(hri[i])} is outside the "
               f"{pgi.shape[0]} gathered rows", index=(i,), actual=short_repr(hri, (i,)))
    c.expect("target", "hidden_restore_idx", want=np.arange(t), got=pgi[hri],
             what="padded_gather_idx[hidden_restore_idx] is not the identity")



@bulk_rule("restore_gather_identity", shared=True)
def _restore_gather_identity_bulk(b: Block, rank: int) -> np.ndarray:
    """hidden_restore_idx holds T rows, each inside padded_gather_idx, which gives back arange(T)."""
    cols = b.cols(rank, "target", "padded_gather_idx", "hidden_restore_idx", "num_scheduled_tokens")
    if cols is None:
        return none(b)
    pgi, hri, q = cols
    t = step_sums(q)
    ok = pgi.present & hri.present & q.present & (hri.lens == t)
    seg, k = ragged(np.where(ok, t, 0))
    h, in1 = hri.at(seg, k)
    v, in2 = pgi.at(seg, h)
    return ok & all_per_step(in1 & in2 & (v == k), seg, len(b))


@check("kv_written_once",
        "kv_write_mask covers only real rows and exactly T of them; the non-PAD slots of "
        "slot_mapping_gathered are unique and a permutation of slot_mapping_global's: each slot "
        "is written exactly once per KV replica")
def kv_written_once(c: Ctx) -> None:
    mask = c.t("kv_write_mask").astype(bool)
    p = c.padded()
    n = c.pcp()
    prn = c.t("per_rank_num_tokens")
    t = int(c.qsl()[-1])
    if mask.shape != (n * p,):
        c.fail("target", "kv_write_mask", f"length {mask.shape}, expected N*P={n * p}")
    real = (np.arange(p)[None, :] < np.asarray(prn)[:, None]).ravel()
    if real.shape == mask.shape and (mask & ~real).any():
        j = int(np.argmax(mask & ~real))
        c.fail("target", "kv_write_mask", f"gathered row {j} (rank {j // p}, local row {j % p}) is "
               "padding but marked for a KV write", index=(j,), expected="F", actual="T")
    if int(mask.sum()) != t:
        c.fail("target", "kv_write_mask", f"{int(mask.sum())} rows marked for a KV write, expected "
               f"T={t} (one per global token)", expected=str(t), actual=str(int(mask.sum())))
    glob = c.get("target", "slot_mapping_global")
    gath = c.get("target", "slot_mapping_gathered")
    if gath is None:
        return
    gath = slot_groups(gath)
    for g in range(gath.shape[0]):
        row = gath[g]
        written = row[row != PAD_SLOT_ID]
        srt = np.sort(written, kind="stable")
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            slot = int(srt[dup[0]])
            where = np.flatnonzero(row == slot)
            c.fail("target", "slot_mapping_gathered", f"slot {slot} is written {where.size} times "
                   f"(gathered rows {where[:4].tolist()})", index=(g, int(where[1])),
                   expected="each slot once", actual=short_repr(gath, (g, int(where[1]))))
        if glob is None:
            continue
        gl = slot_groups(glob)[g]
        gw = np.sort(gl[gl != PAD_SLOT_ID], kind="stable")
        if gw.shape != srt.shape or not np.array_equal(gw, srt):
            extra = np.setdiff1d(srt, gw)
            missing = np.setdiff1d(gw, srt)
            if extra.size:
                j = int(np.flatnonzero(row == extra[0])[0])
                c.fail("target", "slot_mapping_gathered", f"slot {int(extra[0])} is written but is "
                       "not in slot_mapping_global", index=(g, j), actual=short_repr(gath, (g, j)))
            slot = int(missing[0]) if missing.size else None
            c.fail("target", "slot_mapping_gathered",
                   f"{gw.size} global slots but {srt.size} written" if slot is None else
                   f"global slot {slot} (token {int(np.flatnonzero(gl == slot)[0])}) is never written",
                   expected=f"{gw.size} slots", actual=f"{srt.size} slots")


bulk_rule("kv_written_once", shared=True)(kv_written_once_ok)  # layout_columns.kv_written_once_ok


@check("gathered_slots_are_global",
        "slot_mapping_gathered[:, j] == slot_mapping_global[:, padded_gather_idx[j]] where "
        "kv_write_mask[j], PAD elsewhere")
def gathered_slots_are_global(c: Ctx) -> None:
    glob, gath = slot_groups(c.t("slot_mapping_global")), slot_groups(c.t("slot_mapping_gathered"))
    pgi, mask = c.t("padded_gather_idx"), c.t("kv_write_mask").astype(bool)
    if glob.shape[1] == 0:
        picked = np.zeros((glob.shape[0], pgi.shape[0]), dtype=np.int64)
    else:
        if pgi.size and (pgi.min() < 0 or pgi.max() >= glob.shape[1]):
            c.fail("target", "padded_gather_idx", f"indexes outside the {glob.shape[1]} global tokens")
        picked = glob[:, pgi]
    expected = np.where(mask[None, :], picked, PAD_SLOT_ID)
    c.expect("target", "slot_mapping_gathered", want=expected, got=gath,
             what="gathered slot differs from the global slot of its token (PAD where not written)")



@bulk_rule("gathered_slots_are_global", shared=True)
def _gathered_slots_are_global_bulk(b: Block, rank: int) -> np.ndarray:
    """One KV-cache group: gathered row j holds the global slot of padded_gather_idx[j] where
    kv_write_mask[j], PAD elsewhere."""
    glob = b.col(rank, "target", "slot_mapping_global", ndim=None)
    gath = b.col(rank, "target", "slot_mapping_gathered", ndim=None)
    pgi, mask = b.col(rank, "target", "padded_gather_idx"), b.col(rank, "target", "kv_write_mask", bools=True)
    if glob is None or gath is None or pgi is None or mask is None:
        return none(b)
    ok = glob.one_group() & gath.one_group() & pgi.present & mask.present & (glob.lens > 0)
    ok &= (mask.lens == pgi.lens) & (gath.lens == pgi.lens)
    seg, j = ragged(np.where(ok, pgi.lens, 0))
    row, in1 = pgi.at(seg, j)
    slot, in2 = glob.at(seg, row)
    written, got = mask.at(seg, j)[0] != 0, gath.at(seg, j)[0]
    good = in1 & in2 & (got == np.where(written, slot, PAD_SLOT_ID))
    return ok & all_per_step(good, seg, len(b))


@check("global_slots_match_block_table",
        "slot_mapping_global == the slots of block_table_global's rows at the global positions "
        "(block_size from run.json), none in the null block 0")
def global_slots_match_block_table(c: Ctx) -> None:
    glob = slot_groups(c.t("slot_mapping_global"))
    table = table_groups(c.t("block_table_global"))
    pos = c.t("positions").astype(np.int64)
    qsl = c.qsl()
    if table.shape[1] != qsl.shape[0] - 1:
        c.fail("target", "block_table_global", f"{table.shape[1]} rows for {qsl.shape[0] - 1} requests")
    expected = c.slots(table, qsl, pos)
    c.expect("target", "slot_mapping_global", want=expected, got=glob,
             what="slot differs from block_table_global[row, position // block_size]")
    c.no_null_block("target", "slot_mapping_global", want=expected, got=glob, positions=pos)


bulk_rule("global_slots_match_block_table", shared=True)(global_slots_ok)  # layout_columns.global_slots_ok


@check("kv_write_mask_canonical",
        "the gathered slot mapping's write mask: DualChunkSwap prefill rows are kept where they are "
        "computed; a sharded decode has one owner rank, whose row is kept; of a replicated "
        "(non-sharded) row only rank 0's copy is kept (for replicated decodes every rank still writes "
        "its own local rows with rank 0's slots; the mask drops duplicate gathered prefill rows and "
        "picks the copy hidden_restore_idx reads)")
def kv_write_mask_canonical(c: Ctx) -> None:
    segs = segments_of(c)
    mask = c.t("kv_write_mask").astype(bool)
    q, pf = c.q(), c.t("is_prefilling").astype(bool)
    p, n = c.padded(), c.pcp()
    rows, seg_of = segment_rows(segs, p)
    if rows.size and (rows.max() >= mask.shape[0] or rows.min() < 0):
        c.fail("target", "segments", "segments reach outside the gathered rows")
    req = segs["global_req_idx"][seg_of].astype(np.int64)
    rank = segs["rank"][seg_of].astype(np.int64)
    replicated = replicated_requests(q, pf, n, dcp_world_size=c.run_meta.dcp)
    shard = c.shard()
    sharded_decode = shard & ~pf
    canonical_only = replicated[req] & ~sharded_decode[req]
    expected = ~(canonical_only & (rank != 0))
    actual = mask[rows]
    bad = expected != actual
    if bad.any():
        i = int(np.argmax(bad))
        j, r = int(rows[i]), int(req[i])
        kind = ("replicated row: only rank 0's copy is kept" if canonical_only[i]
                else "sharded decode: its owner writes it" if replicated[r] else "prefill chunk row")
        c.fail("target", "kv_write_mask", f"gathered row {j} (rank {int(rank[i])}, request row {r}): "
               f"{kind}", index=(j,), expected=_fmt(expected[i]), actual=_fmt(actual[i]))
    if shard:
        dec = segs[~pf[segs["global_req_idx"]]]
        reqs, counts = np.unique(dec["global_req_idx"], return_counts=True)
        if (counts > 1).any():
            r = int(reqs[np.argmax(counts > 1)])
            owners = dec["rank"][dec["global_req_idx"] == r].tolist()
            c.fail("target", "segments", f"sharded decode (request row {r}) is placed on ranks "
                   f"{owners}; it must have one owner", expected="1 owner", actual=str(owners))


bulk_rule("kv_write_mask_canonical", shared=True)(kv_write_mask_ok)  # layout_columns.kv_write_mask_ok


@check("local_batch_matches_layout",
        "the rank-local batch follows its segments: local_req_ids, local_query_start_loc, "
        "local_input_ids == input_ids[padded_gather_idx], local_is_padding, local_logits_indices "
        "== local_query_start_loc[1:] - 1, block_table_local == the segments' global rows")
def local_batch_matches_layout(c: Ctx) -> None:
    seg_req, seg_len = local_segments(c)
    n, p = c.num_local(), c.padded()
    checked = False
    ids = c.get("target", "local_req_ids")
    gids = c.get("target", "req_ids")
    if ids is not None and gids is not None:
        checked = True
        c.expect("target", "local_req_ids", want=gids[seg_req] if gids.size else seg_req.astype(str), got=ids,
                 what="local request ids differ from the segments' requests")
    lqsl = c.get("target", "local_query_start_loc")
    if lqsl is not None:
        checked = True
        exp = np.zeros(seg_len.shape[0] + 1, dtype=np.int64)
        np.cumsum(seg_len, out=exp[1:])
        act = lqsl.astype(np.int64)
        if act.shape[0] > exp.shape[0]:  # padded request rows repeat the token count
            exp = np.concatenate([exp, np.full(act.shape[0] - exp.shape[0], exp[-1])])
        c.expect("target", "local_query_start_loc", want=exp, got=act, what="local segment starts differ")
        lli = c.get("target", "local_logits_indices")
        if lli is not None:
            c.expect("target", "local_logits_indices", want=(act[1:] - 1)[:lli.shape[0]], got=lli.astype(np.int64),
                     what="local_logits_indices != local_query_start_loc[1:] - 1")
    lin, gin = c.get("target", "local_input_ids"), c.get("target", "input_ids")
    if lin is not None and gin is not None and c.get("target", "padded_gather_idx") is not None:
        checked = True
        if lin.shape != (p,):
            c.fail("target", "local_input_ids", f"length {lin.shape}, expected P={p}")
        c.expect("target", "local_input_ids", want=gin[c.rank_rows()].astype(np.int64),
                 got=lin[:n].astype(np.int64), what="local input id differs from the global token it holds")
    pad = c.get("target", "local_is_padding")
    if pad is not None:
        checked = True
        c.expect("target", "local_is_padding", want=np.arange(p) >= n, got=pad.astype(bool),
                 what=f"the first {n} rows are real, the rest padding")
    btl, btg = c.get("target", "block_table_local"), c.get("target", "block_table_global")
    if btl is not None and btg is not None:
        checked = True
        btl, btg = table_groups(btl), table_groups(btg)
        exp = btg[:, seg_req]
        if btl.shape[1] > exp.shape[1]:
            exp = np.concatenate([exp, np.zeros((exp.shape[0], btl.shape[1] - exp.shape[1], exp.shape[2]),
                                                exp.dtype)], axis=1)
        c.expect("target", "block_table_local", want=exp, got=btl,
                 what="local block-table row differs from its request's global row")
    if not checked:
        raise Skip("no local_req_ids")


@bulk_rule("local_batch_matches_layout")
def _local_batch_matches_layout_bulk(b: Block, rank: int) -> np.ndarray:
    """Run.json's pcp set, per_rank_num_tokens and padded_gather_idx recorded: the rank-local
    views recorded equal what the segments say (``layout_columns.local_batch_ok``)."""
    world = b.run_meta.pcp
    if not world or world < 1:
        return none(b)
    got = local_batch_cols(b, rank, world)  # the block as columns; None: a view has none
    if got is not None:
        return got
    return np.fromiter((sv.recs.get(rank, {}).get("target") is not None
                        and local_batch_ok(sv.recs[rank]["target"], rank, world) for sv in b.svs),
                       dtype=bool, count=len(b))


@check("local_positions_are_global",
        "local_positions[real rows] == positions[padded_gather_idx[rank rows]]: positions come "
        "from the global batch (the GPU cursor), not the CPU cursor")
def local_positions_are_global(c: Ctx) -> None:
    lpos, pos = c.t("local_positions"), c.t("positions")
    p, n = c.padded(), c.num_local()
    if lpos.shape != (p,):
        c.fail("target", "local_positions", f"length {lpos.shape}, expected P={p}")
    c.expect("target", "local_positions", want=pos[c.rank_rows()].astype(np.int64), got=lpos[:n].astype(np.int64),
             what="local position differs from the global position of its token")



@bulk_rule("local_positions_are_global")
def _local_positions_are_global_bulk(b: Block, rank: int) -> np.ndarray:
    """local_positions holds P rows, the first n the positions of the rank's rows."""
    rows = rank_rows(b, rank)
    cols = b.cols(rank, "target", "local_positions", "positions")
    if rows is None or cols is None:
        return none(b)
    (ok, p, n, pgi), (lpos, pos) = rows, cols
    ok = ok & lpos.present & pos.present & (lpos.lens == p)
    seg, k = ragged(np.where(ok, n, 0))
    row, in1 = pgi.at(seg, rank * p[seg] + k)
    want, in2 = pos.at(seg, row)
    got, in3 = lpos.at(seg, k)
    return ok & all_per_step(in1 & in2 & in3 & (want == got), seg, len(b))


@check("local_seq_lens",
        "local_seq_lens[i] == local_positions[last row of segment i] + 1 (0 for empty rows)")
def local_seq_lens(c: Ctx) -> None:
    lsl, lqsl, lpos = c.t("local_seq_lens"), c.t("local_query_start_loc"), c.t("local_positions")
    r = lsl.shape[0]
    if lqsl.shape[0] < r + 1:
        c.fail("target", "local_query_start_loc", f"{lqsl.shape[0]} entries for {r} local rows")
    ends = lqsl[1:r + 1].astype(np.int64)
    lens = ends - lqsl[:r].astype(np.int64)
    if ends.size and (ends.max() > lpos.shape[0]):
        c.fail("target", "local_query_start_loc", f"ends past the {lpos.shape[0]} local rows")
    exp = np.where(lens > 0, lpos[np.maximum(ends - 1, 0)].astype(np.int64) + 1, 0) if r else \
        np.zeros(0, dtype=np.int64)
    c.expect("target", "local_seq_lens", want=exp, got=lsl.astype(np.int64),
             what="local seq_len != last local position + 1")



@bulk_rule("local_seq_lens", shared=True)
def _local_seq_lens_bulk(b: Block, rank: int) -> np.ndarray:
    """Every local row's seq_len is its last local position + 1 (0 for an empty row)."""
    cols = b.cols(rank, "target", "local_seq_lens", "local_query_start_loc", "local_positions")
    if cols is None:
        return none(b)
    lsl, lqsl, lpos = cols
    ok = lsl.present & lqsl.present & lpos.present & (lqsl.lens >= lsl.lens + 1)
    seg, i = ragged(np.where(ok, lsl.lens, 0))
    end, in1 = lqsl.at(seg, i + 1)
    start, in2 = lqsl.at(seg, i)
    last, in3 = lpos.at(seg, np.maximum(end - 1, 0))
    got, in4 = lsl.at(seg, i)
    want = np.where(end - start > 0, last + 1, 0)
    good = in1 & in2 & in3 & in4 & (end <= lpos.lens[seg]) & (want == got)
    return ok & all_per_step(good, seg, len(b))


@check("local_logits_not_sampled",
        "sampling used the global rows: sampled_logits_rows == logits_indices and sampled_from "
        "== 'global' (local logits are never sampled)")
def local_logits_not_sampled(c: Ctx) -> None:
    rows = c.t("sampled_logits_rows")
    li = c.t("logits_indices")
    c.expect("target", "sampled_logits_rows", want=li.astype(np.int64), got=rows.astype(np.int64),
             what="sampled rows are not the global logits_indices (local logits sampled?)")
    src = c.get("target", "sampled_from")
    if src is not None and view_text(src) != "global":
        c.fail("target", "sampled_from", "sampling must read the restored global hidden states",
               expected="'global'", actual=repr(view_text(src)))


@bulk_rule("local_logits_not_sampled", shared=True)
def _local_logits_not_sampled_bulk(b: Block, rank: int) -> np.ndarray:
    """sampled_logits_rows == logits_indices, and sampled_from (where recorded) is 'global'."""
    cols = b.cols(rank, "target", "sampled_logits_rows", "logits_indices")
    if cols is None:
        return none(b)
    rows, li = cols
    ok = rows.present & li.present & (rows.lens == li.lens)
    seg, k = ragged(np.where(ok, li.lens, 0))
    ok &= all_per_step(rows.at(seg, k)[0] == li.at(seg, k)[0], seg, len(b))
    src = b.arrays(rank, "target", "sampled_from")
    return ok & np.fromiter((a is None or view_text(a) == "global" for a in src), dtype=bool, count=len(b))
