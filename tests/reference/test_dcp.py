"""pcpviz.reference.dcp from first principles (the vLLM comparison is tests/vllm/test_dcp_conformance_vllm.py):
every token written by exactly one DCP rank, each rank's local stream dense, local seq lens
counting what a rank owns, and the vllm#51031 class (kernel block size in place of the manager's)
moving tokens only when the interleave exceeds the kernel block."""

import numpy as np
import pytest

from pcpviz.reference.blocks import compute_slot_mappings
from pcpviz.reference.dcp import (
    check_dcp_config,
    dcp_local_position,
    dcp_local_seq_lens,
    dcp_owner,
    dcp_shard,
    draft_local_lens,
    kernel_block_table,
    local_read_slots,
)


def test_worked_pcp2_dcp2_example():
    s = dcp_shard(np.array([[0], [5]]), 4, np.array([1]), query_start_loc=np.array([0, 7]),
                  positions=np.arange(7), dcp_size=2, interleave=2)
    assert s.owner.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert s.local.tolist() == [0, 1, 0, 1, 2, 3, 2]
    assert s.slots.tolist() == [[20, 21, -1, -1, 22, 23, -1], [-1, -1, 20, 21, -1, -1, 22]]
    assert dcp_local_seq_lens(np.array([7]), dcp_size=2, interleave=2).tolist() == [[4], [3]]
    assert draft_local_lens(np.array([7]), dcp_size=2, interleave=2).tolist() == [[4], [4]]


@pytest.mark.parametrize("d,m,il", [(2, 4, 1), (2, 16, 4), (4, 8, 8), (8, 64, 16), (3, 6, 2)])
def test_each_token_written_once_and_local_streams_dense(d, m, il):
    n = 5 * m * d + 3
    table = np.arange(1, 12, dtype=np.int32)[None, :]
    s = dcp_shard(table, m, np.array([0]), query_start_loc=np.array([0, n]), positions=np.arange(n),
                  dcp_size=d, interleave=il)
    assert (s.writes_per_token() == 1).all()
    lens = dcp_local_seq_lens(np.array([n]), dcp_size=d, interleave=il)[:, 0]
    assert lens.sum() == n
    for r in range(d):
        mine = s.owner == r
        assert sorted(s.local[mine].tolist()) == list(range(int(lens[r])))
        np.testing.assert_array_equal(np.sort(s.slots[r][mine]), local_read_slots(table[0], int(lens[r]), block_size=m))


def test_owner_ignores_block_size_while_the_interleave_divides_it():
    p = np.arange(1000)
    for m in (8, 16, 64):
        np.testing.assert_array_equal(dcp_owner(p, block_size=m, dcp_size=4, interleave=8), p // 8 % 4)


def test_kernel_block_size_in_place_of_the_manager_block_size_moves_tokens_only_when_interleave_exceeds_it():
    p = np.arange(512)
    right = dcp_local_position(p, block_size=128, dcp_size=4, interleave=64)
    assert (dcp_local_position(p, block_size=64, dcp_size=4, interleave=64) == right).all()
    wrong = dcp_owner(p, block_size=64, dcp_size=4, interleave=128)
    assert (wrong != dcp_owner(p, block_size=128, dcp_size=4, interleave=128)).any()
    assert set(wrong.tolist()) == {0, 1}  # ranks 2 and 3 never written: the #51031 symptom


def test_kernel_block_table_and_reads():
    kt = kernel_block_table(np.array([[3, 9]]), block_size=8, kernel_block_size=4)
    assert kt.tolist() == [[6, 7, 18, 19]]
    assert local_read_slots([3, 9], 10, block_size=8, kernel_block_size=4).tolist() == list(range(24, 32)) + [72, 73]
    with pytest.raises(ValueError, match="does not divide"):
        kernel_block_table(np.array([[1]]), block_size=8, kernel_block_size=3)


def test_bad_config_is_one_line():
    with pytest.raises(ValueError, match="divisible by cp_kv_cache_interleave_size 3"):
        check_dcp_config(block_size=8, dcp_size=2, interleave=3)


def test_dcp1_is_the_plain_mapping():
    t = np.array([[4, 6]], dtype=np.int32)
    s = dcp_shard(t, 4, np.array([0]), query_start_loc=np.array([0, 6]), positions=np.arange(6), dcp_size=1,
                  interleave=1)
    np.testing.assert_array_equal(s.slots, compute_slot_mappings(t, 4, np.array([0]), query_start_loc=np.array([0, 6]),
                                                                 positions=np.arange(6)))
