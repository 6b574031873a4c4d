"""Unit tests of pcpviz.reference.blocks: allocator, tables, the three slot mappings."""

import numpy as np
import pytest

from pcpviz.reference.blocks import (
    PAD_SLOT_ID,
    BlockAllocator,
    BlockTable,
    compute_slot_mappings,
    draft_decode_slot_mapping,
    gather_block_table_rows,
    gathered_slot_mapping,
)
from pcpviz.reference.layout import plan_layout


def table_a7_3_b5():
    t = BlockTable(max_num_reqs=4, max_blocks_per_req=4)
    t.append(0, [7, 3])
    t.append(1, [5])
    return t


def test_module_docstring_example():
    t = table_a7_3_b5()
    lay = plan_layout([6, 1], [True, False], 2)
    glob = compute_slot_mappings(t.as_array(), 4, [0, 1], query_start_loc=lay.query_start_loc,
                                 positions=[0, 1, 2, 3, 4, 5, 2])
    assert glob.tolist() == [[28, 29, 30, 31, 12, 13, 22]]
    assert gathered_slot_mapping(glob, lay).tolist() == [[22, 28, 29, -1, 30, 31, 12, 13]]
    assert draft_decode_slot_mapping(t.as_array(), 4, [0, 1], positions=[6, 3]).tolist() == [[14, 23]]


def test_allocator_reserves_null_block_and_reuses_freed():
    a = BlockAllocator(num_blocks=5, block_size=16)
    assert a.allocate(2) == [1, 2]
    assert a.blocks_needed(33) == 3
    with pytest.raises(RuntimeError, match="out of KV blocks: need 3, 2 free"):
        a.allocate(3)
    a.free([1])
    assert a.num_free == 3
    assert 1 in a.allocate(3)
    with pytest.raises(ValueError, match="outside 1..4"):
        a.free([0])


def test_block_table_bounds():
    t = BlockTable(2, 2)
    t.append(1, [4, 9])
    with pytest.raises(ValueError, match="would hold 3 blocks"):
        t.append(1, [2])
    with pytest.raises(ValueError, match="request slot 2 outside"):
        t.append(2, [1])
    assert t.as_array().tolist() == [[0, 0], [4, 9]]
    assert t.clear(1) == [4, 9]


def test_slot_mapping_pads_tail_and_dummy_rows():
    t = table_a7_3_b5().as_array()
    out = compute_slot_mappings(t, 4, [0, -1], query_start_loc=[0, 2, 3], positions=[4, 5, 0], num_tokens_padded=5)
    assert out.tolist() == [[12, 13, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]]


def test_slot_mapping_position_beyond_table_is_named():
    t = BlockTable(1, 2).as_array()
    with pytest.raises(ValueError, match="position 9\\) needs block index 2 but the block table has 2 columns"):
        compute_slot_mappings(t, 4, [0], query_start_loc=[0, 1], positions=[9])


def test_dcp_interleave_keeps_owned_tokens_only():
    # DCP=2, interleave 1, block 4: virtual block of 8 positions alternates ranks.
    t = np.array([[3, 6]], dtype=np.int32)
    pos = np.arange(10)
    r0 = compute_slot_mappings(t, 4, [0], query_start_loc=[0, 10], positions=pos, cp_size=2, cp_rank=0)[0]
    r1 = compute_slot_mappings(t, 4, [0], query_start_loc=[0, 10], positions=pos, cp_size=2, cp_rank=1)[0]
    assert r0.tolist() == [12, -1, 13, -1, 14, -1, 15, -1, 24, -1]
    assert r1.tolist() == [-1, 12, -1, 13, -1, 14, -1, 15, -1, 24]
    # interleave 2: runs of two
    r0 = compute_slot_mappings(t, 4, [0], query_start_loc=[0, 10],
                               positions=pos, cp_size=2, cp_rank=0, cp_interleave=2)[0]
    assert r0.tolist() == [12, 13, -1, -1, 14, 15, -1, -1, 24, 25]
    # a group that is not DCP-sharded keeps every token at its plain position
    r1 = compute_slot_mappings(t, 4, [0], query_start_loc=[0, 8],
                               positions=pos[:8], cp_size=2, cp_rank=1, dcp_sharded=[False])[0]
    assert r1.tolist() == [12, 13, 14, 15, 24, 25, 26, 27]


def test_gather_block_table_rows_zero_pads_and_respects_num_blocks():
    t = table_a7_3_b5().as_array()
    rows = gather_block_table_rows(t, [1, 0, 0], num_reqs_padded=4)
    assert rows.tolist() == [[5, 0, 0, 0], [7, 3, 0, 0], [7, 3, 0, 0], [0, 0, 0, 0]]
    rows = gather_block_table_rows(t, [0], num_blocks=np.array([1, 1, 0, 0]))
    assert rows.tolist() == [[7, 0, 0, 0]]


def test_gathered_mapping_writes_every_global_slot_once_per_replica():
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = int(rng.integers(1, 6))
        q = rng.integers(0, 20, r)
        prefill = rng.random(r) < 0.5
        n = int(rng.choice([2, 3, 4]))
        shard = bool(rng.random() < 0.5)
        lay = plan_layout(q, prefill, n, shard_decode_requests=shard)
        t = BlockTable(r, 40)
        alloc = BlockAllocator(400, 4)
        computed = rng.integers(0, 30, r)
        for i in range(r):
            t.append(i, alloc.allocate(alloc.blocks_needed(int(computed[i] + q[i]))))
        pos = np.concatenate([np.arange(c, c + k) for c, k in zip(computed, q)] or [[]]).astype(int)
        glob = compute_slot_mappings(t.as_array(), 4, np.arange(r), query_start_loc=lay.query_start_loc, positions=pos)
        gath = gathered_slot_mapping(glob, lay)
        written = gath[gath != PAD_SLOT_ID]
        assert np.array_equal(np.sort(written), np.sort(glob[0]))
        assert gath.shape == (1, n * lay.padded_num_tokens)


def test_gathered_mapping_rejects_short_global_mapping():
    lay = plan_layout([4], [True], 2)
    with pytest.raises(ValueError, match="has 2 columns, the layout has 4 tokens"):
        gathered_slot_mapping(np.zeros((1, 2), dtype=np.int64), lay)
