"""``local_batch_matches_layout``'s bulk rule read as columns: the rank-local batch every step
of a block should have, from its segments, compared with what it recorded, with NumPy over the
whole block (the per-step ``layout_columns.local_batch_ok`` cost about 35 us a (step, rank)).

A PCP=2 step of two requests, request 0 with 3 tokens on rank 0 and request 1 with 2: rank 0's
segments ``[(req 0, local 0..3), (req 1, local 3..5)]`` say ``local_query_start_loc`` is
``[0, 3, 5]`` (then the last value again on padded rows), ``local_logits_indices`` ``[2, 4]``,
``local_req_ids`` the two requests' ids, ``local_input_ids[:n]`` ``input_ids[padded_gather_idx[
rank rows]]``, ``local_is_padding`` True from row ``n`` on, ``block_table_local`` the two
requests' rows of ``block_table_global`` (zero rows after them).

The answer is the per-step rule's where the columns exist: True only where the check passes,
and stricter where that costs nothing (a segment naming no request row, more local tokens than
P, an empty ``req_ids``: the check runs there). Where a view has no column (floats, tables of
another shape) ``local_batch_cols`` gives None and the per-step rule judges.
"""

from __future__ import annotations

import numpy as np

from .columns import Block, Column, all_per_step, ragged, same_values
from .layout_columns import segment_columns

_NUMERIC = ("per_rank_num_tokens", "padded_gather_idx", "local_query_start_loc", "local_logits_indices",
            "local_input_ids", "input_ids")


class _Segs:
    """A rank's local segments of every step, in local order (``local_segments``): ``req``,
    ``length`` int64[S] (a step without one holds the zero-length placeholder for request 0),
    ``count`` int64[n] per step, ``first`` int64[n] (its first segment's index), ``ends``
    int64[S] (each segment's inclusive running length within its step)."""

    def __init__(self, b: Block, rank: int, got: tuple) -> None:
        ok, (step, req, seg_rank, lo, hi) = got
        mine = ok[step] & (seg_rank == rank)
        step, req, lo, hi = step[mine], req[mine], lo[mine], hi[mine]
        order = np.lexsort((lo, step))  # stable: ties keep their order in the table
        step, req, length = step[order], req[order], (hi - lo)[order]
        empty = np.flatnonzero(np.bincount(step, minlength=len(b))[:len(b)] == 0)
        step = np.concatenate([step, empty])
        order = np.argsort(step, kind="stable")
        self.step = step[order]
        self.req = np.concatenate([req, np.zeros(empty.shape[0], np.int64)])[order]
        self.length = np.concatenate([length, np.zeros(empty.shape[0], np.int64)])[order]
        self.count = np.bincount(self.step, minlength=len(b))[:len(b)]
        self.first = np.cumsum(self.count) - self.count
        cs = np.cumsum(self.length)
        self.ends = cs - (cs - self.length)[self.first][self.step]
        self.ok = ok


def local_batch_cols(b: Block, rank: int, world: int) -> np.ndarray | None:
    """bool[n]: ``local_batch_matches_layout`` passes on (step, ``rank``) of block ``b``, where
    ``layout_columns.local_batch_ok`` would say so; None where a view has no column."""
    segs = segment_columns(b, rank)
    cols = {v: b.col(rank, "target", v) for v in _NUMERIC}
    pad = b.col(rank, "target", "local_is_padding", bools=True)
    btl, btg = (b.col(rank, "target", v, ndim=None) for v in ("block_table_local", "block_table_global"))
    if segs is None or None in cols.values() or pad is None or btl is None or btg is None \
            or (btl.present.any() and btl.ndim == 1) or (btg.present.any() and btg.ndim == 1):
        return None
    s = _Segs(b, rank, segs)
    prn, pgi = cols["per_rank_num_tokens"], cols["padded_gather_idx"]
    n, has = prn.at(np.arange(len(b)), np.full(len(b), rank))
    p = pgi.lens // world
    ok = s.ok & prn.present & pgi.present & has & (pgi.lens % world == 0) & (n >= 0) & (n <= p)
    checked = np.zeros(len(b), dtype=bool)
    for part in (_query_starts(s, cols["local_query_start_loc"], cols["local_logits_indices"]),
                 _input_ids(cols["local_input_ids"], cols["input_ids"], pgi, rank=rank, p=p, n=n),
                 _padding(pad, p, n), _tables(s, btl, btg)):
        ran, good = part
        ok &= good | ~ran
        checked |= ran
    ids = _req_ids(b, rank, s, ok)
    return ok & ids[1] & (checked | ids[0])


def _query_starts(s: _Segs, lqsl: Column, lli: Column) -> tuple[np.ndarray, np.ndarray]:
    """(compared, equal) of local_query_start_loc (the segments' running lengths, the last one
    repeated on padded rows) and local_logits_indices (its next entries minus one)."""
    n = lqsl.lens.shape[0]
    good = lqsl.lens >= s.count + 1
    step, k = ragged(np.where(good, lqsl.lens, 0))
    j = np.minimum(k, s.count[step])
    want = np.where(j == 0, 0, s.ends[np.maximum(s.first[step] + j - 1, 0)] if s.ends.size else 0)
    good &= all_per_step(lqsl.at(step, k)[0] == want, step, n)
    good &= ~lli.present | (lli.lens <= lqsl.lens - 1)
    step, k = ragged(np.where(good & lli.present, lli.lens, 0))
    good &= all_per_step(lli.at(step, k)[0] == lqsl.at(step, k + 1)[0] - 1, step, n)
    return lqsl.present, good


def _input_ids(lin: Column, gin: Column, pgi: Column, *, rank: int, p: np.ndarray,
               n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(compared, equal): local_input_ids is P long and its first n entries are input_ids at
    the rank's rows of padded_gather_idx."""
    ran = lin.present & gin.present
    good = lin.lens == p
    step, k = ragged(np.where(ran & good, n, 0))
    rows, listed = pgi.at(step, rank * p[step] + k)
    got, inside = gin.at(step, rows)
    good &= all_per_step(listed & inside & (got == lin.at(step, k)[0]), step, lin.lens.shape[0])
    return ran, good


def _padding(pad: Column, p: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(compared, equal): local_is_padding is P long, False on the first n rows, True after."""
    good = pad.lens == p
    step, k = ragged(np.where(pad.present & good, pad.lens, 0))
    good &= all_per_step((pad.at(step, k)[0] != 0) == (k >= n[step]), step, pad.lens.shape[0])
    return pad.present, good


def _groups(t: Column) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(groups, rows, width) int64[n] of a block-table column (a 2-D table is one group)."""
    if t.ndim < 2:  # absent on every step
        zeros = np.zeros(t.lens.shape[0], dtype=np.int64)
        return zeros, zeros, zeros
    if t.ndim == 2:
        return np.ones_like(t.dims[:, 0]), t.dims[:, 0], t.dims[:, 1]
    return t.dims[:, 0], t.dims[:, 1], t.dims[:, 2]


def _tables(s: _Segs, btl: Column, btg: Column) -> tuple[np.ndarray, np.ndarray]:
    """(compared, equal): block_table_local holds, per group, the global rows of the rank's
    segments' requests in local order, then rows of zeros."""
    ran = btl.present & btg.present
    (gl, rl, wl), (gg, rg, wg) = _groups(btl), _groups(btg)
    good = (gl == gg) & (wl == wg) & (rl >= s.count)
    inside = (s.req >= 0) & (s.req < rg[s.step])
    good &= all_per_step(inside, s.step, s.count.shape[0])
    step, e = ragged(np.where(ran & good, btl.lens, 0))
    w, rows = np.maximum(wl[step], 1), np.maximum(rl[step], 1)
    g, r, c = e // (rows * w), (e // w) % rows, e % w
    real = r < s.count[step]
    req = s.req[np.where(real, s.first[step] + r, 0)] if s.req.size else np.zeros_like(r)
    want, found = btg.at(step, np.where(real, (g * rg[step] + req) * w + c, -1))
    good &= all_per_step(np.where(real, found & (want == btl.at(step, e)[0]), btl.at(step, e)[0] == 0),
                         step, s.count.shape[0])
    return ran, good


def _req_ids(b: Block, rank: int, s: _Segs, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(compared, equal): local_req_ids are req_ids of the segments' requests (per step where
    ``ok``: the ids are strings, one comparison each). False where an array is not one the
    per-step rule reads (another type, floats) or a request row is outside req_ids."""
    n = len(b)
    ran, good = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
    ids_all, gids_all = b.arrays(rank, "target", "local_req_ids"), b.arrays(rank, "target", "req_ids")
    for i in np.flatnonzero(ok).tolist():
        ids, gids = ids_all[i], gids_all[i]
        if ids is None and gids is None:
            continue
        if any(a is not None and (type(a) is not np.ndarray or a.dtype.kind == "f") for a in (ids, gids)):
            good[i] = False
            continue
        if ids is None or gids is None:
            continue
        lo = int(s.first[i])
        req = s.req[lo:lo + int(s.count[i])]
        ran[i] = True
        good[i] = gids.ndim == 1 and gids.size > 0 and bool(((req >= 0) & (req < gids.shape[0])).all()) \
            and same_values(gids[req], ids)
    return ran, good
