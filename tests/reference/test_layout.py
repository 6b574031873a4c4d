"""Unit tests of pcpviz.reference.layout: worked examples, vLLM's own PCP-manager cases
restated, invariants over generated batches, and input validation.

The conformance tier (test_conformance_vllm.py) compares the same functions with
the real vLLM 0.33.0 package; these tests pin the behaviour without it.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pcpviz.reference.batch import GlobalBatch
from pcpviz.reference.chunks import Segment
from pcpviz.reference.layout import num_tokens_for_dispatch, partition_batch, plan_layout


def rows_of(layout, rank):
    return [(s.global_req_idx, s.global_start, s.global_stop) for s in layout.segments_by_rank[rank]]


# --- worked examples --------------------------------------------------------------------------


def test_module_docstring_example_pcp2_prefill_and_two_decodes():
    lay = plan_layout([13, 1, 4], [True, False, False], 2)
    assert rows_of(lay, 0) == [(1, 13, 14), (0, 0, 4), (0, 12, 13)]
    assert rows_of(lay, 1) == [(2, 14, 18), (0, 4, 8), (0, 8, 12)]
    assert lay.per_rank_num_tokens == (6, 12)
    assert lay.padded_num_tokens == 12
    assert lay.padded_gather_idx.tolist() == [13, 0, 1, 2, 3, 12] + [0] * 6 + [14, 15, 16, 17] + list(range(4, 12))
    assert lay.kv_write_mask.tolist() == [True] * 6 + [False] * 6 + [True] * 12
    assert lay.hidden_restore_idx.tolist() == [1, 2, 3, 4, 16, 17, 18, 19, 20, 21, 22, 23, 5, 0, 12, 13, 14, 15]


def test_design_note_scenario_a_sharded_decodes():
    # docs/vllm-0.33-pcp-mtp.md#worked-example-scenario-a: d0 (4), d1 (4), p1 continued (10), p0 fresh (13).
    lay = plan_layout([4, 4, 10, 13], [False, False, True, True], 2)
    assert lay.per_rank_num_tokens == (13, 18)
    assert lay.padded_gather_idx.tolist() == (
        [0, 1, 2, 3, 8, 9, 10, 17, 18, 19, 20, 21, 30] + [0] * 5
        + [4, 5, 6, 7] + list(range(11, 17)) + list(range(22, 30))
    )
    assert lay.hidden_restore_idx.tolist() == (
        [0, 1, 2, 3, 18, 19, 20, 21, 4, 5, 6] + list(range(22, 28)) + [7, 8, 9, 10, 11] + list(range(28, 36)) + [12]
    )


def test_design_note_scenario_b_replicated_decodes_rank0_writes():
    lay = plan_layout([4, 4, 10, 13], [False, False, True, True], 2, shard_decode_requests=False)
    assert [len(s) for s in lay.segments_by_rank] == [6, 6]
    p = lay.padded_num_tokens
    # Decodes are on both ranks, first; only rank 0's copy is written.
    assert lay.kv_write_mask[:8].all() and not lay.kv_write_mask[p : p + 8].any()
    assert lay.hidden_restore_idx[:8].tolist() == list(range(8))


def test_dualchunkswap_pcp4_chunk_assignment():
    lay = plan_layout([16], [True], 4)
    for rank in range(4):
        assert rows_of(lay, rank) == [(0, 2 * rank, 2 * rank + 2), (0, 14 - 2 * rank, 16 - 2 * rank)]
    assert lay.token_chunk()[:4].tolist() == [0, 0, 7, 7]


def test_short_prefill_leaves_ranks_empty_and_pads():
    lay = plan_layout([3], [True], 4)  # chunk 1: ranks 0,1,2 get one token, rank 3 none
    assert lay.per_rank_num_tokens == (1, 1, 1, 0)
    assert lay.padded_num_tokens == 1
    assert lay.kv_write_mask.tolist() == [True, True, True, False]


# --- vLLM's own PCP-manager test cases, restated ------------------------------------------------


def test_replicated_decodes_with_piecewise_graph_padding():
    # Three 1-token decodes at PCP=2 in replicated mode, padded to the graph size 4.
    lay = plan_layout([1, 1, 1], [False] * 3, 2, shard_decode_requests=False, padded_num_tokens=4)
    assert lay.per_rank_num_tokens == (3, 3)
    assert [[s.global_req_idx for s in r] for r in lay.segments_by_rank] == [[0, 1, 2], [0, 1, 2]]
    assert lay.hidden_restore_idx.tolist() == [0, 1, 2]
    assert lay.padded_gather_idx.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert lay.kv_write_mask.tolist() == [True, True, True, False, False, False, False, False]


@pytest.mark.parametrize(
    "pcp,q,prefill,replicated_expect,sharded_expect",
    [
        (2, [8], [True], 4, 4),
        (2, [7], [True], 4, 4),
        (2, [3], [False], 3, 3),
        (2, [3, 8], [False, True], 7, 7),
        (4, [2, 9], [False, True], 5, 4),
    ],
)
def test_dispatch_size_is_the_largest_rank(pcp, q, prefill, replicated_expect, sharded_expect):
    assert num_tokens_for_dispatch(q, prefill, pcp, shard_decode_requests=False) == replicated_expect
    assert num_tokens_for_dispatch(q, prefill, pcp, shard_decode_requests=True) == sharded_expect


def test_graph_padding_smaller_than_largest_rank_is_rejected():
    with pytest.raises(ValueError, match="smaller than the largest rank-local batch: 2 < 3"):
        plan_layout([1, 1, 1], [False] * 3, 2, shard_decode_requests=False, padded_num_tokens=2)


# --- local batch ---------------------------------------------------------------------------------


def test_local_batch_docstring_example():
    batch = GlobalBatch.build([13, 1, 4], [0, 20, 30], prefill_len=[13, 5, 5])
    lb = partition_batch(batch, 0, 2)
    assert lb.req_ids == ("r1", "r0", "r0")
    assert lb.query_start_loc.tolist() == [0, 1, 5, 6]
    assert lb.positions.tolist() == [20, 0, 1, 2, 3, 12] + [0] * 6
    assert lb.seq_lens.tolist() == [21, 4, 13]
    assert lb.logits_indices.tolist() == [0, 4, 5]
    assert lb.is_prefilling.tolist() == [False, True, True]
    assert lb.is_padding.tolist() == [False] * 6 + [True] * 6


def test_local_positions_follow_gpu_cursor_not_cpu_cursor():
    # d0 had 2 of 3 drafts rejected: the CPU cursor says 22, the GPU positions start at 20.
    batch = GlobalBatch.build([4], [22], prefill_len=[5], positions=[20, 21, 22, 23])
    lb = partition_batch(batch, 0, 2)
    assert lb.positions[:4].tolist() == [20, 21, 22, 23]
    assert lb.seq_lens.tolist() == [24]
    assert lb.seq_lens_cpu_upper_bound.tolist() == [26]


def test_one_token_tail_chunk_still_counts_as_prefilling():
    batch = GlobalBatch.build([13], [0])
    lb = partition_batch(batch, 0, 2)  # rows p0[0:4], p0[12:13]
    assert lb.num_scheduled_tokens.tolist() == [4, 1]
    assert lb.is_prefilling.tolist() == [True, True]


def test_empty_rank_gets_a_zero_length_placeholder_row():
    batch = GlobalBatch.build([1], [7], prefill_len=[3])  # one decode, owned by rank 0
    lb = partition_batch(batch, 1, 2)
    assert lb.is_placeholder and lb.num_reqs == 1 and lb.num_tokens == 0
    assert lb.query_start_loc.tolist() == [0, 0]
    assert lb.seq_lens.tolist() == [0]
    assert lb.num_tokens_padded == 1 and lb.is_padding.tolist() == [True]


def test_full_graph_needs_decode_only_batch():
    batch = GlobalBatch.build([4, 1], [0, 9], prefill_len=[4, 3])
    with pytest.raises(ValueError, match="decode-only"):
        partition_batch(batch, 0, 2, padded_num_reqs=4)
    dec = GlobalBatch.build([1, 1], [9, 9], prefill_len=[3, 3])
    lb = partition_batch(dec, 0, 2, padded_num_reqs=4, padded_num_tokens=4)
    assert lb.num_reqs_padded == 4 and lb.query_start_loc.tolist() == [0, 1, 1, 1, 1]


# --- invariants over generated batches ----------------------------------------------------------


@st.composite
def batches(draw):
    n = draw(st.sampled_from([1, 2, 3, 4, 8]))
    r = draw(st.integers(0, 7))
    q = draw(st.lists(st.integers(0, 40), min_size=r, max_size=r))
    prefill = draw(st.lists(st.booleans(), min_size=r, max_size=r))
    shard = draw(st.booleans())
    return n, q, prefill, shard


@settings(max_examples=300, deadline=None)
@given(batches())
def test_layout_invariants(case):
    n, q, prefill, shard = case
    lay = plan_layout(q, prefill, n, shard_decode_requests=shard)
    t = sum(q)
    gathered = lay.padded_gather_idx
    real = lay.is_real_row()
    # restore ∘ gather is the identity on the global token axis
    assert np.array_equal(gathered[lay.hidden_restore_idx], np.arange(t))
    # the write mask is a subset of real rows and writes each global token exactly once
    assert not (lay.kv_write_mask & ~real).any()
    assert np.array_equal(np.sort(gathered[lay.kv_write_mask]), np.arange(t))
    assert lay.padded_num_tokens == max(lay.per_rank_num_tokens)
    for rank, segs in enumerate(lay.segments_by_rank):
        kinds = [bool(prefill[s.global_req_idx]) for s in segs]
        assert kinds == sorted(kinds), "decodes first"
        assert all(s.num_tokens > 0 for s in segs)
        assert [s.local_start for s in segs] == ([0] + [s.local_stop for s in segs[:-1]])[: len(segs)]
    # each prefill row is covered exactly once across ranks
    covered = np.zeros(t, dtype=int)
    for segs in lay.segments_by_rank:
        for s in segs:
            covered[s.global_start : s.global_stop] += 1
    for i, qi in enumerate(q):
        lo, hi = lay.query_start_loc[i], lay.query_start_loc[i + 1]
        expect = 1 if (prefill[i] or shard or n == 1) else n
        assert (covered[lo:hi] == expect).all()


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (([4], [True], 0), {}, "pcp_world_size must be >= 1"),
        (([4], [True], 2.5), {}, "pcp_world_size must be a positive integer"),
        (([4, -1], [True, True], 2), {}, r"num_scheduled_tokens\[1\] = -1 is negative"),
        (([4, 2], [True], 2), {}, "is_prefilling must have one entry per request"),
        (([[4]], [True], 2), {}, "one-dimensional"),
        (([4], [True], 2), {"dcp_world_size": 0}, "dcp_world_size must be >= 1"),
        (([4], [True], 2), {"padded_num_tokens": 1}, "smaller than the largest rank-local batch: 1 < 2"),
        (([4], ["yes"], 2), {}, "is_prefilling must hold booleans"),
    ],
)
def test_invalid_input_raises_value_error_saying_what(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(*args, **kwargs)


def test_sharded_decodes_with_dcp_orphan_is_named():
    # A 3-token prefill is 'short' under DCP; with shard_decode_requests it would be
    # owned by rank 1 but only rank 0 may write replicated prefills.
    with pytest.raises(ValueError, match="no KV writer"):
        plan_layout([1, 3], [False, True], 2, shard_decode_requests=True, dcp_world_size=2)


def test_default_decode_mode_follows_dcp():
    assert plan_layout([1], [False], 2).shard_decode_requests is True
    assert plan_layout([1], [False], 2, dcp_world_size=2).shard_decode_requests is False


def test_empty_batch():
    lay = plan_layout([], [], 2)
    assert lay.padded_num_tokens == 0 and lay.hidden_restore_idx.size == 0
    lay = plan_layout([0, 0], [True, False], 2)
    assert lay.per_rank_num_tokens == (0, 0)


def test_segment_is_frozen():
    seg = Segment(0, 0, 4, 0, 4)
    with pytest.raises(Exception):
        seg.global_start = 1  # type: ignore[misc]
