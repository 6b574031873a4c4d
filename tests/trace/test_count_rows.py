"""``count`` on Python integers (batches up to ``SMALL_BATCH``) is the NumPy count, value for value,
on any counts, odd ones included (negatives, more accepted than drafted, K wider or narrower)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpviz.trace.acceptance import SMALL_BATCH, Counts, count, count_rows


def numpy_count(nacc, nd, k=0) -> Counts:  # the definition, vectorised (count's path past SMALL_BATCH)
    nacc, nd = np.asarray(nacc, dtype=np.int64), np.asarray(nd, dtype=np.int64)
    has = nd > 0
    width = max(int(k), int(nacc[has].max()) if has.any() else 0)
    per = ((np.arange(width)[None, :] < nacc[:, None]) & has[:, None]).sum(axis=0)
    return Counts(int(has.sum()), int(nd[has].sum()), int(nacc[has].sum()), tuple(int(x) for x in per))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 9), st.integers(-2, 9)), max_size=SMALL_BATCH + 8), st.integers(0, 6))
def test_count_rows_is_the_numpy_count(rows, k):
    nacc, nd = [a for a, _ in rows], [d for _, d in rows]
    assert count_rows(nacc, nd, k=k) == numpy_count(nacc, nd, k)
    assert count(nacc, nd, k=k) == numpy_count(nacc, nd, k)  # either path, by size


def test_a_decode_step_of_two_requests():
    assert count([2, 0], [2, 2], k=2) == Counts(2, 4, 2, (1, 1))
    assert count([1], [0], k=3) == Counts(0, 0, 0, (0, 0, 0))  # no drafts: nothing counted, K wide
