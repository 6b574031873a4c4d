"""Conformance tier: pcpviz's layout, local batch, block tables and slot mappings
equal what the real vLLM 0.33.0 package computes, over generated batches.

The oracle (pcpviz.vllm.oracle) drives vLLM's own PCPManager and BlockTables
(Triton kernels under TRITON_INTERPRET=1) on CPU. Nothing here is skipped: CI
installs vLLM, and a missing or wrong vLLM fails the first test loudly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm import oracle  # noqa: E402  (after the patches, by design)

from pcpviz.reference.batch import GlobalBatch  # noqa: E402
from pcpviz.reference.blocks import (  # noqa: E402
    BlockTable,
    compute_slot_mappings,
    gather_block_table_rows,
    gathered_slot_mapping,
)
from pcpviz.reference.layout import partition_batch, plan_layout  # noqa: E402

LAYOUT_EXAMPLES = 400
BATCH_EXAMPLES = 120
SLOT_EXAMPLES = 80


def test_the_real_vllm_0_33_0_is_installed():
    import vllm

    assert vllm.__version__ == "0.33.0"
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    assert PCPManager.__module__ == "vllm.v1.worker.gpu.pcp_manager"


# --- strategies -------------------------------------------------------------------------------


@st.composite
def row_kinds(draw, max_rows=8):
    """Rows of a global batch: (query_len, is_prefilling), covering zero-token
    rows, 1-token and shorter-than-2N prefills, long prefills, and decodes
    with 0..4 drafts."""
    r = draw(st.integers(0, max_rows))
    rows = []
    for _ in range(r):
        kind = draw(st.sampled_from(["decode", "prefill_short", "prefill", "zero"]))
        if kind == "decode":
            rows.append((1 + draw(st.integers(0, 4)), False))
        elif kind == "prefill_short":
            rows.append((draw(st.integers(1, 8)), True))
        elif kind == "prefill":
            rows.append((draw(st.integers(9, 90)), True))
        else:
            rows.append((0, draw(st.booleans())))
    return rows


@st.composite
def layout_cases(draw):
    n = draw(st.sampled_from([1, 2, 3, 4, 8]))
    rows = draw(row_kinds())
    dcp = draw(st.sampled_from([1, n]))
    # vLLM pairs sharded decodes with DCP == 1 only (pcp_shard_decode_requests).
    shard = draw(st.booleans()) if dcp == 1 else False
    pad_extra = draw(st.one_of(st.none(), st.integers(0, 9)))
    return n, rows, dcp, shard, pad_extra


def _vllm_layout(q, prefill, n, shard, dcp, padded):
    return oracle.vllm_build_batch_layout(
        q, prefill, n, shard_decode_requests=shard, dcp_world_size=dcp, padded_num_tokens=padded
    )


def _segments(layout):
    return [
        [(s.global_req_idx, s.global_start, s.global_stop, s.local_start, s.local_stop) for s in segs]
        for segs in layout.segments_by_rank
    ]


# --- plan_layout == PCPManager._build_batch_layout -------------------------------------------


@settings(max_examples=LAYOUT_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_cases())
def test_plan_layout_equals_vllm(case):
    n, rows, dcp, shard, pad_extra = case
    q = [r[0] for r in rows]
    prefill = [r[1] for r in rows]
    ours = plan_layout(q, prefill, n, shard_decode_requests=shard, dcp_world_size=dcp)
    padded = None if pad_extra is None else ours.padded_num_tokens + pad_extra
    if padded is not None:
        ours = plan_layout(q, prefill, n, shard_decode_requests=shard, dcp_world_size=dcp, padded_num_tokens=padded)
    ref = _vllm_layout(q, prefill, n, shard, dcp, padded)
    assert _segments(ours) == [list(map(tuple, segs)) for segs in ref["segments_by_rank"]]
    assert list(ours.per_rank_num_tokens) == list(ref["per_rank_num_tokens"])
    np.testing.assert_array_equal(ours.padded_gather_idx, ref["padded_gather_idx"])
    np.testing.assert_array_equal(ours.hidden_restore_idx, ref["hidden_restore_idx"])
    np.testing.assert_array_equal(ours.kv_write_mask, ref["kv_write_mask"])


@pytest.mark.parametrize("n", [2, 4])
def test_too_small_graph_padding_fails_like_vllm(n):
    q, prefill = [40, 1, 1], [True, False, False]
    largest = max(plan_layout(q, prefill, n).per_rank_num_tokens)
    with pytest.raises(ValueError) as ours:
        plan_layout(q, prefill, n, padded_num_tokens=largest - 1)
    with pytest.raises(ValueError) as ref:
        _vllm_layout(q, prefill, n, True, 1, largest - 1)
    assert str(ours.value) == str(ref.value)


# --- partition_batch == PCPManager.partition_batch ---------------------------------------------


@st.composite
def global_batches(draw):
    n, rows, dcp, shard, pad_extra = draw(layout_cases())
    rows = [r for r in rows]
    r = len(rows)
    computed, prefill_len, positions = [], [], []
    for q, is_prefill in rows:
        if is_prefill:
            c = draw(st.sampled_from([0, 0, draw(st.integers(1, 60))]))
            pl = c + q + draw(st.sampled_from([0, 0, draw(st.integers(1, 30))]))  # chunked prefill
            gpu_start = c
        else:
            pl = draw(st.integers(1, 50))
            c = pl + draw(st.integers(0, 40))
            # After a rejection the CPU cursor runs ahead of the GPU one.
            gpu_start = c - draw(st.sampled_from([0, 0, draw(st.integers(0, min(c, 3)))]))
        computed.append(c)
        prefill_len.append(pl)
        positions.extend(range(gpu_start, gpu_start + q))
    t = len(positions)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    batch = GlobalBatch(
        req_ids=tuple(f"req{i}" for i in range(r)),
        idx_mapping=rng.permutation(max(r, 1) + 3)[:r].astype(np.int64),
        num_scheduled_tokens=np.array([x[0] for x in rows], dtype=np.int64),
        num_computed_tokens=np.array(computed, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        input_ids=rng.integers(1, 1000, t).astype(np.int64),
        prefill_len=np.array(prefill_len, dtype=np.int64),
        is_prefilling=np.array([x[1] for x in rows], dtype=np.bool_),
    )
    return n, batch, dcp, shard, pad_extra


LOCAL_FIELDS = [
    "idx_mapping", "num_scheduled_tokens", "query_start_loc", "input_ids", "positions", "seq_lens",
    "logits_indices", "is_prefilling", "is_padding", "num_computed_tokens", "seq_lens_cpu_upper_bound",
]


@settings(max_examples=BATCH_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(global_batches())
def test_partition_batch_equals_vllm(case):
    n, batch, dcp, shard, pad_extra = case
    assume(batch.num_reqs > 0)  # vLLM never partitions an empty batch
    lay = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, n,
                      shard_decode_requests=shard, dcp_world_size=dcp)
    padded = None if pad_extra is None else lay.padded_num_tokens + pad_extra
    ref = oracle.vllm_partition_batch(
        req_ids=list(batch.req_ids), idx_mapping=batch.idx_mapping,
        num_scheduled_tokens=batch.num_scheduled_tokens, num_computed_tokens=batch.num_computed_tokens,
        positions=batch.positions, input_ids=batch.input_ids, prefill_len=batch.prefill_len,
        is_prefilling=batch.is_prefilling, pcp_world_size=n, shard_decode_requests=shard,
        dcp_world_size=dcp, padded_num_tokens=padded,
    )
    for rank in range(n):
        ours = partition_batch(batch, rank, n, shard_decode_requests=shard, dcp_world_size=dcp,
                               padded_num_tokens=padded)
        theirs = ref[rank]
        assert list(ours.req_ids) == list(theirs["req_ids"]), f"rank {rank}: req_ids"
        for field in LOCAL_FIELDS:
            np.testing.assert_array_equal(
                np.asarray(getattr(ours, field)).astype(np.int64),
                np.asarray(theirs[field]).astype(np.int64),
                err_msg=f"rank {rank}: {field}",
            )
        assert ours.num_tokens == theirs["num_tokens"]
        assert ours.num_tokens_padded == theirs["num_tokens_after_padding"]
        assert ours.num_reqs_padded == theirs["num_reqs_after_padding"]
        np.testing.assert_array_equal(ours.gather_idx, np.asarray(theirs["local_gather_idx"]))


# --- slot mappings and block tables ------------------------------------------------------------


@st.composite
def slot_cases(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    r = draw(st.integers(1, 5))
    max_blocks = 12
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    ids = rng.permutation(np.arange(1, 200))
    rows, used = [], 0
    for _ in range(r + 2):  # a few request-state slots beyond the batch
        k = int(rng.integers(0, max_blocks + 1))
        rows.append(ids[used : used + k].tolist())
        used += k
    batch_rows = rng.permutation(len(rows))[:r]
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    cp_rank = draw(st.integers(0, cp - 1))
    interleave = draw(st.sampled_from([1, block_size])) if cp > 1 else 1
    q, pos = [], []
    for slot in batch_rows:
        # with DCP a block-table row covers cp times more positions
        cap = len(rows[slot]) * block_size * cp
        n = int(rng.integers(0, min(cap, 12) + 1)) if cap else 0
        start = int(rng.integers(0, cap - n + 1)) if cap else 0
        q.append(n)
        pos.extend(range(start, start + n))
    pad = draw(st.integers(0, 6))
    return (block_size, rows, batch_rows.astype(np.int64), np.array(q), np.array(pos, dtype=np.int64), cp, cp_rank,
            interleave, pad)


def _table(rows, max_blocks=12):
    t = BlockTable(len(rows), max_blocks)
    for slot, row in enumerate(rows):
        t.append(slot, row)
    return t.as_array()


@settings(max_examples=SLOT_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slot_cases())
def test_compute_slot_mappings_equals_vllm_kernel(case):
    block_size, rows, idx, q, pos, cp, cp_rank, il, pad = case
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    num_padded = int(qsl[-1]) + pad
    ours = compute_slot_mappings(_table(rows), block_size, idx, query_start_loc=qsl,
                                 positions=pos, num_tokens_padded=num_padded,
                                 cp_size=cp, cp_rank=cp_rank, cp_interleave=il)
    ref = oracle.vllm_compute_slot_mappings(rows, block_size, idx, query_start_loc=qsl, positions=pos,
                                            num_tokens=num_padded, cp_size=cp, cp_rank=cp_rank, cp_interleave=il)
    np.testing.assert_array_equal(ours, np.asarray(ref))


@settings(max_examples=SLOT_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slot_cases(), st.integers(0, 3))
def test_gather_block_tables_equals_vllm_kernel(case, extra):
    block_size, rows, idx, *_ = case
    ours = gather_block_table_rows(_table(rows), idx, len(idx) + extra)
    ref = oracle.vllm_gather_block_tables(rows, block_size, idx, num_reqs_padded=len(idx) + extra, max_num_blocks=12)
    np.testing.assert_array_equal(ours, np.asarray(ref))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(global_batches(), st.sampled_from([1, 4, 16]))
def test_gathered_slot_mapping_equals_vllm_prepare_slot_mappings(case, block_size):
    n, batch, dcp, shard, pad_extra = case
    assume(batch.num_reqs > 0)
    del dcp  # the PCP gathered mapping (DCP 1); DCP interleave is covered above
    shard = shard if n > 1 else True
    # every request-state slot gets enough blocks for its positions
    slots = int(batch.idx_mapping.max()) + 1
    rows = [[] for _ in range(slots)]
    qsl = batch.query_start_loc
    next_block = 1
    for i, slot in enumerate(batch.idx_mapping.tolist()):
        top = int(batch.positions[qsl[i] : qsl[i + 1]].max(initial=0)) + 1
        k = -(-top // block_size)
        rows[slot] = list(range(next_block, next_block + k))
        next_block += k
    width = max(len(r) for r in rows) or 1
    table = BlockTable(slots, width)
    for s, r in enumerate(rows):
        table.append(s, r)
    lay = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, n, shard_decode_requests=shard)
    glob = compute_slot_mappings(table.as_array(), block_size, batch.idx_mapping, query_start_loc=qsl,
                                 positions=batch.positions)
    ours = gathered_slot_mapping(glob, lay)
    ref = oracle.vllm_prepare_slot_mappings(
        rows, block_size,
        req_ids=list(batch.req_ids), idx_mapping=batch.idx_mapping,
        num_scheduled_tokens=batch.num_scheduled_tokens, num_computed_tokens=batch.num_computed_tokens,
        positions=batch.positions, input_ids=batch.input_ids, prefill_len=batch.prefill_len,
        is_prefilling=batch.is_prefilling, pcp_world_size=n, shard_decode_requests=shard, rank=0,
    )
    np.testing.assert_array_equal(ours, np.asarray(ref))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([2, 3, 4, 8]), st.lists(st.integers(1, 5), min_size=1, max_size=9),
       st.booleans(), st.integers(0, 4), st.integers(0, 4))
def test_full_graph_decode_batches_equal_vllm(n, q, shard, extra_tokens, extra_reqs):
    """FULL CUDA graphs pad both tokens and requests; legal for decode-only batches."""
    r = len(q)
    computed = [20 + 3 * i for i in range(r)]
    batch = GlobalBatch.build(q, computed, prefill_len=[5] * r, is_prefilling=[False] * r)
    lay = plan_layout(q, [False] * r, n, shard_decode_requests=shard)
    padded = lay.padded_num_tokens + extra_tokens
    reqs = max(len(s) for s in lay.segments_by_rank) + extra_reqs
    reqs = max(reqs, 1)
    ref = oracle.vllm_partition_batch(
        req_ids=list(batch.req_ids), idx_mapping=batch.idx_mapping,
        num_scheduled_tokens=batch.num_scheduled_tokens, num_computed_tokens=batch.num_computed_tokens,
        positions=batch.positions, input_ids=batch.input_ids, prefill_len=batch.prefill_len,
        is_prefilling=batch.is_prefilling, pcp_world_size=n, shard_decode_requests=shard,
        padded_num_tokens=padded, padded_num_reqs=reqs,
    )
    for rank in range(n):
        ours = partition_batch(batch, rank, n, shard_decode_requests=shard, padded_num_tokens=padded,
                               padded_num_reqs=reqs)
        for field in LOCAL_FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(ours, field)).astype(np.int64),
                                          np.asarray(ref[rank][field]).astype(np.int64),
                                          err_msg=f"rank {rank}: {field}")
        assert ours.num_reqs_padded == ref[rank]["num_reqs_after_padding"]


def test_full_graph_with_a_prefill_is_rejected_like_vllm():
    batch = GlobalBatch.build([4, 1], [0, 9], prefill_len=[4, 3])
    with pytest.raises(ValueError, match="PCP FULL graphs require a decode-only batch."):
        partition_batch(batch, 0, 2, padded_num_tokens=8, padded_num_reqs=4)
    with pytest.raises(RuntimeError, match="PCP FULL graphs require a decode-only batch."):
        oracle.vllm_partition_batch(
            req_ids=list(batch.req_ids), idx_mapping=batch.idx_mapping,
            num_scheduled_tokens=batch.num_scheduled_tokens, num_computed_tokens=batch.num_computed_tokens,
            positions=batch.positions, input_ids=batch.input_ids, prefill_len=batch.prefill_len,
            is_prefilling=batch.is_prefilling, pcp_world_size=2, shard_decode_requests=True,
            padded_num_tokens=8, padded_num_reqs=4,
        )
