"""The figures' ``StepLayout`` (rebuilt from a recorded ``target``) and the reference's ``PCPLayout``
describe one step layout the same way (issue 40): the same query_start_loc, per-rank token counts
and padding, and the same DualChunkSwap chunk for every gathered row. ``PCPLayout.token_chunk()``
is per gathered row (int64[N*P], -1 on padding); ``StepLayout.token_chunk`` is per global token
(int64[T]); through ``padded_gather_idx`` they must agree. Both take the chunk size from
``pcpviz.reference.chunks.chunk_size``."""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.reference.batch import query_start_loc, record_query_start_loc
from pcpviz.reference.layout import plan_layout
from pcpviz.trace.schema import segments_table
from pcpviz.views.figures.step_data import step_layout

BATCHES = [  # (num_scheduled_tokens, is_prefilling, PCP)
    ([13, 1, 1], [True, False, False], 2),
    ([9, 30, 2], [True, True, False], 2),
    ([7], [True], 4),
    ([3, 3, 1, 100], [False, False, False, True], 4),
    ([5, 17], [True, True], 8),
]


@pytest.mark.parametrize("q, pre, n", BATCHES)
def test_step_layout_agrees_with_the_reference(q, pre, n):
    lay = plan_layout(q, pre, n)
    target = {"req_ids": np.array([f"r{i}" for i in range(len(q))]),
              "num_scheduled_tokens": np.array(q, dtype=np.int64), "is_prefilling": np.array(pre),
              "per_rank_num_tokens": np.array(lay.per_rank_num_tokens, dtype=np.int64),
              "padded_gather_idx": lay.padded_gather_idx, "hidden_restore_idx": lay.hidden_restore_idx,
              "kv_write_mask": lay.kv_write_mask, "segments": segments_table(lay.segments_by_rank)}
    sl = step_layout(target)
    assert sl.query_start_loc.tolist() == lay.query_start_loc.tolist() == record_query_start_loc(target).tolist()
    assert (sl.pcp, sl.padded, sl.num_tokens) == (n, lay.padded_num_tokens, lay.num_tokens)
    assert sl.row_real.tolist() == lay.is_real_row().tolist()
    rows = np.flatnonzero(lay.is_real_row())
    ref = lay.token_chunk()
    assert (ref[~lay.is_real_row()] == -1).all()
    assert sl.token_chunk[lay.padded_gather_idx[rows]].tolist() == ref[rows].tolist()


def test_query_start_loc_is_rebuilt_in_one_place():
    assert query_start_loc([9, 1]).tolist() == [0, 9, 10]
    assert record_query_start_loc({"query_start_loc": np.array([0, 4])}).tolist() == [0, 4]
    assert record_query_start_loc({"positions": np.arange(3)}) is None
