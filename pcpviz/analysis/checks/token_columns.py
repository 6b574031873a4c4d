"""The token counts of a block's ``target`` records judged at once: ``token_counts_ok(block,
rank)`` is True on the steps where ``pcpviz.trace.bounds``' token-count rule finds nothing
(``num_scheduled_tokens`` non-negative and summing to the token axis, ``query_start_loc`` rising
from 0 to it as their running sum). The runner judges the other steps one by one, so a step
that breaks the rule gets the rule's own line.

A block of two PCP=2 steps on rank 0, the second one's ``query_start_loc`` ending one short::

    positions             [0 1 2 | 3 4 5 6]     t = 3, 4
    num_scheduled_tokens  [1 2   | 2 2]
    query_start_loc       [0 1 3 | 0 2 3]       -> ok = [True, False]
"""

from __future__ import annotations

import numpy as np

from .columns import Block, Column, ragged, step_sums


def token_counts_ok(b: Block, rank: int) -> np.ndarray:
    """bool[n]: True where the step's ``target`` token counts agree (or the step records none
    of the views they compare); False where they may not, or a view is no integer column."""
    n = len(b)
    cols = [b.col(rank, "target", v, ndim=None, bools=True)
            for v in ("positions", "input_ids", "num_scheduled_tokens", "query_start_loc")]
    if any(c is None for c in cols):
        return np.zeros(n, dtype=bool)
    pos, ids, q, qsl = cols
    t, has_t = _token_axis(pos, ids, n)
    ok = np.ones(n, dtype=bool)
    if q.ndim == 1:
        seg = np.repeat(np.arange(n), q.lens)  # int64[len(q.values)]: each count's step
        negative = np.bincount(seg[q.values < 0], minlength=n)[:n] > 0
        ok &= ~(q.present & (negative | (has_t & (step_sums(q) != t))))
    if qsl.ndim == 1:
        ok &= _running_sum_ok(qsl, q, t, has_t, n)
    return ok


def _token_axis(pos: Column, ids: Column, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(t int64[n], has bool[n]): each step's token count, from its 1-D positions, else its 1-D
    input_ids, as the rule reads it."""
    t, has = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    for col in (pos, ids):
        if col.ndim == 1:
            take = col.present & ~has
            t[take] = col.lens[take]
            has |= take
    return t, has


def _running_sum_ok(qsl: Column, q: Column, t: np.ndarray, has_t: np.ndarray, n: int) -> np.ndarray:
    """bool[n]: a 1-D ``query_start_loc`` with entries starts at 0, never falls, ends at the token
    count, and its steps are the 1-D ``num_scheduled_tokens``."""
    act = qsl.present & (qsl.lens > 0)
    vals = qsl.values
    first, last = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if vals.shape[0]:
        first[act], last[act] = vals[qsl.offsets[:-1][act]], vals[qsl.offsets[1:][act] - 1]
    seg, k = ragged(qsl.lens)
    rises = np.diff(vals)  # int64[len - 1]: entry k minus entry k - 1, across steps too
    inside = k[1:] > 0  # the pairs within one step
    falls = np.bincount(seg[1:][inside & (rises < 0)], minlength=n)[:n] > 0
    ok = ~act | ((first == 0) & ~falls & (~has_t | (last == t)))
    if q.ndim == 1:
        both = act & q.present
        ok &= ~both | (q.lens + 1 == qsl.lens)
        aligned = both & (q.lens + 1 == qsl.lens)  # steps whose rises and counts pair up one to one
        q_steps = np.repeat(np.arange(n), q.lens)  # int64[len(q.values)]
        got = rises[inside][aligned[seg[1:][inside]]]
        mine = aligned[q_steps]
        bad = q_steps[mine][got != q.values[mine]]
        ok &= np.bincount(bad, minlength=n)[:n] == 0
    return ok
