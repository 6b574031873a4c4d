"""The helpers of ``layout_checks``' bulk rules (``columns``): plan_layout's expected views
remembered across steps by the batch's counts, and the rank-local batch as the check builds it.

    >>> key = (2, True, 1, 2, np.array([2, 1]).tobytes(), np.array([True, False]).tobytes())
    >>> exp = expected_layout(key, np.array([2, 1]), np.array([True, False]), world=2, shard=True, dcp=1, p=2)
    >>> exp["per_rank_num_tokens"].tolist()
    [2, 1]
"""

from __future__ import annotations

import numpy as np

from pcpviz.reference.layout import plan_layout
from pcpviz.trace import SEGMENT_DTYPE, segments_table
from pcpviz.trace.shapes import table_groups

from .columns import Block, all_per_step, none, ragged, same_values, starts, step_sums


_PLANS: dict[tuple, dict | None] = {}  # plan_layout's inputs -> the views it expects (None: it raised)


def expected_layout(key: tuple, q: np.ndarray, pf: np.ndarray, *, world: int, shard: bool, dcp: int,
                     p: int) -> dict | None:
    """The five views ``layout_matches_plan`` compares, as it builds them, for one batch; the
    plans of batches seen before are remembered (decode steps repeat a batch's counts)."""
    got = _PLANS.get(key, _PLANS)
    if got is _PLANS:
        try:
            plan = plan_layout(q.astype(np.int64), pf.astype(bool), world, shard_decode_requests=shard,
                               dcp_world_size=dcp, padded_num_tokens=p)
            segs = segments_table(plan.segments_by_rank)
            got = {"segments": np.stack([segs[f] for f in SEGMENT_DTYPE.names], axis=1) if segs.size
                   else np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64),
                   "per_rank_num_tokens": np.asarray(plan.per_rank_num_tokens, dtype=np.int64),
                   "padded_gather_idx": plan.padded_gather_idx, "hidden_restore_idx": plan.hidden_restore_idx,
                   "kv_write_mask": plan.kv_write_mask}
        except Exception:  # noqa: BLE001 - the check fails there: not decided here
            got = None
        if len(_PLANS) >= 4096:
            _PLANS.clear()
        _PLANS[key] = got
    return got


def matches_plan(rec, exp: dict) -> bool:
    """Every one of the five views ``rec`` recorded equals the plan's, as the check compares it."""
    for view, want in exp.items():
        act = rec.get(view)
        if act is None:
            continue
        if view == "segments":
            names = act.dtype.names
            if not names or not set(SEGMENT_DTYPE.names) <= set(names) or act.ndim != 1 \
                    or any(act.dtype[f].kind not in "iub" for f in SEGMENT_DTYPE.names):
                return False
            act = np.stack([act[f].astype(np.int64) for f in SEGMENT_DTYPE.names], axis=1) if act.size \
                else np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64)
        elif act.dtype.names is not None or act.dtype.kind not in "iub":
            return False
        if not same_values(want, act.astype(want.dtype, copy=False)):
            return False
    return True


_LOCAL_VIEWS = ("segments", "per_rank_num_tokens", "padded_gather_idx", "local_req_ids", "req_ids",
                "local_query_start_loc", "local_logits_indices", "local_input_ids", "input_ids",
                "local_is_padding", "block_table_local", "block_table_global")


def local_batch_ok(target, rank: int, world: int) -> bool:
    """``local_batch_matches_layout`` passes on this rank's target record (``world``: run.json's
    pcp): the same reads and comparisons, without the checks' context; False where it could fail
    or skip, or reads a view stored as floats (the checks' reader converts those)."""
    views = {v: target.get(v) for v in _LOCAL_VIEWS}
    if any(a is not None and (type(a) is not np.ndarray or a.dtype.kind == "f") for a in views.values()):
        return False
    segs, prn, pgi = views["segments"], views["per_rank_num_tokens"], views["padded_gather_idx"]
    if segs is None or segs.dtype.names is None or not set(SEGMENT_DTYPE.names) <= set(segs.dtype.names) \
            or prn is None or prn.ndim != 1 or rank >= prn.shape[0] or pgi is None or pgi.shape[0] % world:
        return False
    try:
        return _local_batch_same(views, rank, p=pgi.shape[0] // world, n=int(prn[rank]))
    except Exception:  # noqa: BLE001 - the check fails there (could not evaluate)
        return False


def _local_batch_same(views: dict, rank: int, *, p: int, n: int) -> bool:
    segs = views["segments"]
    mine = segs[segs["rank"] == rank]
    mine = mine[np.argsort(mine["local_start"], kind="stable")]
    if mine.shape[0] == 0:
        seg_req, seg_len = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    else:
        seg_req = mine["global_req_idx"].astype(np.int64)
        seg_len = (mine["local_stop"] - mine["local_start"]).astype(np.int64)
    checked, same = False, True
    ids, gids = views["local_req_ids"], views["req_ids"]
    if ids is not None and gids is not None:
        checked, same = True, same and same_values(gids[seg_req] if gids.size else seg_req.astype(str), ids)
    lqsl = views["local_query_start_loc"]
    if lqsl is not None:
        exp = np.zeros(seg_len.shape[0] + 1, dtype=np.int64)
        np.cumsum(seg_len, out=exp[1:])
        act = lqsl.astype(np.int64)
        if act.shape[0] > exp.shape[0]:
            exp = np.concatenate([exp, np.full(act.shape[0] - exp.shape[0], exp[-1])])
        checked, same = True, same and same_values(exp, act)
        lli = views["local_logits_indices"]
        if lli is not None:
            same = same and same_values((act[1:] - 1)[:lli.shape[0]], lli.astype(np.int64))
    lin, gin, pgi = views["local_input_ids"], views["input_ids"], views["padded_gather_idx"]
    if lin is not None and gin is not None:
        rows = pgi[rank * p:rank * p + n].astype(np.int64)
        checked, same = True, same and lin.shape == (p,) and same_values(gin[rows].astype(np.int64),
                                                                         lin[:n].astype(np.int64))
    pad = views["local_is_padding"]
    if pad is not None:
        checked, same = True, same and same_values(np.arange(p) >= n, pad.astype(bool))
    btl, btg = views["block_table_local"], views["block_table_global"]
    if btl is not None and btg is not None:
        btl, btg = table_groups(btl), table_groups(btg)
        exp = btg[:, seg_req]
        if btl.shape[1] > exp.shape[1]:
            exp = np.concatenate([exp, np.zeros((exp.shape[0], btl.shape[1] - exp.shape[1], exp.shape[2]),
                                                exp.dtype)], axis=1)
        checked, same = True, same and same_values(exp, btl)
    return checked and same


def _sorted_by_step(step: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((vals, step))
    return step[order], vals[order]


def kv_written_once_ok(b: Block, rank: int) -> np.ndarray:
    """``kv_written_once`` with one KV-cache group: the write mask N * P long, only real rows,
    T of them; the gathered slots (where recorded) unique, the same set as the global ones
    (where recorded)."""
    world = b.run_meta.pcp
    mask, pgi, prn = b.col(rank, "target", "kv_write_mask", bools=True), b.col(rank, "target", "padded_gather_idx"), \
        b.col(rank, "target", "per_rank_num_tokens")
    q = b.col(rank, "target", "num_scheduled_tokens")
    glob, gath = (b.col(rank, "target", v, ndim=None) for v in ("slot_mapping_global", "slot_mapping_gathered"))
    if not world or world < 1 or None in (mask, pgi, prn, q, glob, gath):
        return none(b)
    p = pgi.lens // world
    ok = mask.present & pgi.present & prn.present & q.present & (pgi.lens % world == 0) & (mask.lens == world * p)
    seg, j = ragged(np.where(ok, mask.lens, 0))
    marked = mask.at(seg, j)[0] != 0
    pp = np.maximum(p[seg], 1)
    limit, has = prn.at(seg, j // pp)
    real = has & (j % pp < limit)
    compared = ((prn.lens == world) | (p == 0))[seg]
    ok &= all_per_step(~compared | ~marked | real, seg, len(b))
    ok &= np.bincount(seg, weights=marked, minlength=len(b)).astype(np.int64) == step_sums(q)
    ok &= ~gath.present | (gath.one_group() & (~glob.present | glob.one_group()))
    gseg, k = ragged(np.where(ok & gath.present, gath.lens, 0))
    slot = gath.at(gseg, k)[0]
    ws, wv = _sorted_by_step(gseg[slot != -1], slot[slot != -1])
    ok &= all_per_step((ws[1:] != ws[:-1]) | (wv[1:] != wv[:-1]), ws[1:], len(b))
    hseg, k = ragged(np.where(ok & gath.present & glob.present, glob.lens, 0))
    gl = glob.at(hseg, k)[0]
    hs, hv = _sorted_by_step(hseg[gl != -1], gl[gl != -1])
    both = gath.present & glob.present
    keep = (ok & both)[ws]
    ws, wv = ws[keep], wv[keep]
    ok &= ~both | (np.bincount(ws, minlength=len(b)) == np.bincount(hs, minlength=len(b)))
    keep, keep_h = ok[ws], ok[hs]  # the steps still ok hold as many of each
    ws, wv, hs, hv = ws[keep], wv[keep], hs[keep_h], hv[keep_h]
    return ok & all_per_step((ws == hs) & (wv == hv), ws, len(b))


def global_slots_ok(b: Block, rank: int) -> np.ndarray:
    """``global_slots_match_block_table`` without DCP, with one KV-cache group and one block
    size: block_table_global one row per request; each token's slot (T of them) is its row's
    block at position // block_size (not past the table's width: that reads the null block),
    times block_size, plus position % block_size, and outside the null block 0."""
    sizes = b.run_meta.kv_block_sizes
    glob, table = b.col(rank, "target", "slot_mapping_global", ndim=None), b.col(rank, "target",
                                                                                "block_table_global", ndim=None)
    pos, q = b.col(rank, "target", "positions"), b.col(rank, "target", "num_scheduled_tokens")
    if b.run_meta.dcp != 1 or sizes is None or len(sizes) != 1 or sizes[0] < 1 or None in (glob, table, pos, q) \
            or table.ndim == 1:
        return none(b)
    bs, t = int(sizes[0]), step_sums(q)
    one = table.present & ((table.rows == 1) if table.ndim == 3 else True)
    width = table.dims[:, -1]
    ok = one & glob.one_group() & pos.present & q.present & (glob.lens == t) & (pos.lens == t)
    ok &= table.dims[:, -2] == q.lens
    seg, i = ragged(np.where(ok, q.lens, 0))
    qi = q.at(seg, i)[0]
    first = np.append(starts(q), 0)[q.offsets[seg] + i]
    ok &= all_per_step(qi >= 0, seg, len(b))
    tr, m = ragged(np.where(ok[seg], qi, 0))  # tr: the request row of each token
    step, row, tok = seg[tr], i[tr], first[tr] + m
    p = pos.at(step, tok)[0]
    blk = p // bs
    past = blk >= width[step]
    entry, inside = table.at(step, np.where(past, -1, row * width[step] + blk))
    want = np.where(past, p % bs, entry * bs + p % bs)
    good = (p >= 0) & (past | inside) & (glob.at(step, tok)[0] == want) & ((want < 0) | (want >= bs))
    return ok & all_per_step(good, step, len(b))


_SEG_FIELDS = ("global_req_idx", "rank", "local_start", "local_stop")


def segment_columns(b: Block, rank: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """(ok bool[n], [step, global_req_idx, rank, local_start, local_stop] int64, one entry per
    segment of every step), ``ok`` where the step's segments are a table with SEGMENT_DTYPE's
    fields, all integers; None where no step has one. Made once per block and rank (two rules
    read it); each call counts as a read of the segments (``Block.reads``)."""
    key = ("segment_columns", rank)
    if key in b.memo:
        if b.reads is not None:
            b.reads.add((rank, "target", "segments"))
        return b.memo[key]
    got = b.memo[key] = _segment_columns(b, rank)
    return got


def _segment_columns(b: Block, rank: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
    tables = b.arrays(rank, "target", "segments")
    ok = np.zeros(len(b), dtype=bool)
    parts: list[list[np.ndarray]] = [[] for _ in range(5)]
    for i, segs in enumerate(tables):
        names = None if segs is None or type(segs) is not np.ndarray or segs.ndim != 1 else segs.dtype.names
        if names is None or not set(SEGMENT_DTYPE.names) <= set(names) \
                or any(segs.dtype[f].kind not in "iu" or segs.dtype[f].subdtype is not None for f in _SEG_FIELDS):
            continue
        ok[i] = True
        parts[0].append(np.full(segs.shape[0], i, dtype=np.int64))
        for k, f in enumerate(_SEG_FIELDS, 1):
            parts[k].append(segs[f].astype(np.int64))
    if not ok.any():
        return None
    return ok, [np.concatenate(p) for p in parts]


def kv_write_mask_ok(b: Block, rank: int) -> np.ndarray:
    """``kv_write_mask_canonical`` passes: run.json's pcp, dcp set; padded_gather_idx a multiple
    of pcp long (P each); every segment on a rank below pcp, within ``0 .. P`` and naming a
    request row of the step; the mask at every gathered row a segment covers is what the check
    expects (a replicated row not sharded as a decode kept on rank 0 only); with sharded decodes,
    each decode request in one segment. Conservative: anything else runs the check."""
    world, dcp, meta = b.run_meta.pcp, b.run_meta.dcp, b.run_meta
    if not world or world < 1 or not isinstance(dcp, int):
        return none(b)
    shard = meta.shard_decode_requests if meta.shard_decode_requests is not None else (world > 1 and dcp == 1)
    mask = b.col(rank, "target", "kv_write_mask", bools=True)
    q, pf = b.col(rank, "target", "num_scheduled_tokens"), b.col(rank, "target", "is_prefilling", bools=True)
    pgi, segs = b.col(rank, "target", "padded_gather_idx"), segment_columns(b, rank)
    if mask is None or q is None or pf is None or pgi is None or segs is None:
        return none(b)
    ok, (step, req, seg_rank, lo, hi) = segs
    ok = ok & mask.present & q.present & pf.present & pgi.present & (q.lens == pf.lens) & (pgi.lens % world == 0)
    p = pgi.lens // world
    good = (seg_rank >= 0) & (seg_rank < world) & (lo >= 0) & (lo <= hi) & (hi <= p[step]) \
        & (req >= 0) & (req < q.lens[step])
    ok &= all_per_step(good, step, len(b))
    sel = ok[step]
    step, req, seg_rank, lo, hi = step[sel], req[sel], seg_rank[sel], lo[sel], hi[sel]
    decode = pf.values[pf.offsets[step] + req] == 0
    qs = q.values[q.offsets[step] + req]
    replicated = decode
    if dcp > 1:
        chunk = (qs + 2 * world - 1) // (2 * world)
        replicated = replicated | ((2 * world - 1) * chunk >= qs)
    keep_all = ~(replicated & ~(shard & decode)) | (seg_rank == 0)  # the check's expected, per segment
    seg, k = ragged(hi - lo)
    row = seg_rank[seg] * p[step[seg]] + lo[seg] + k
    inside = row < mask.lens[step[seg]]
    got = mask.values[mask.offsets[step[seg]] + np.where(inside, row, 0)] != 0
    ok &= all_per_step(inside & (got == keep_all[seg]), step[seg], len(b))
    if shard and decode.any():
        key = np.stack([step[decode], req[decode]], axis=1)
        dup = np.unique(key, axis=0, return_counts=True)
        ok[dup[0][dup[1] > 1, 0]] = False
    return ok
