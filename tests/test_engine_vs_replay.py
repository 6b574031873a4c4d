"""Engine vs the real vLLM: for the batches vLLM 0.33.0 itself scheduled in the CPU replay, the
engine's data path (pcpviz.layout + pcpviz.blocks, which pcpviz.engine.worker calls) produces the
same layout, rank-local batch, block-table and slot-mapping views as the replay recorded."""

import numpy as np
import pytest

import pcpviz.vllm
from pcpviz.batch import GlobalBatch
from pcpviz.blocks import compute_slot_mappings, gather_block_table_rows, gathered_slot_mapping
from pcpviz.layout import partition_batch, plan_layout


@pytest.fixture(scope="module", params=["sharded", "replicated"])
def replay_trace(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"replay-{request.param}")
    res = pcpviz.vllm.replay(pcp=2, mtp=3, trace_dir=str(d), scenario="mixed", decodes=request.param)
    return res.trace


def test_engine_data_path_equals_vllm_replay(replay_trace):
    t = replay_trace
    n, bs = t.meta["pcp"], t.meta["block_size"]
    shard = bool(t.meta["shard_decode_requests"])
    compared = 0
    for step in t.steps:
        for rank in t.ranks:
            if not t.has(step, rank, "target"):
                continue  # the dummy run
            rec = t.record(step, rank, "target")
            batch = GlobalBatch(
                req_ids=tuple(str(x) for x in rec["req_ids"]),
                idx_mapping=np.arange(len(rec["req_ids"]), dtype=np.int64),  # rows of block_table_global
                num_scheduled_tokens=rec["num_scheduled_tokens"].astype(np.int64),
                num_computed_tokens=rec["num_computed_tokens"].astype(np.int64),
                positions=rec["positions"].astype(np.int64),
                input_ids=rec["input_ids"].astype(np.int64),
                prefill_len=rec["prefill_len"].astype(np.int64),
                is_prefilling=rec["is_prefilling"].astype(bool),
            )
            lay = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, n, shard_decode_requests=shard)
            np.testing.assert_array_equal(lay.padded_gather_idx, rec["padded_gather_idx"])
            np.testing.assert_array_equal(lay.hidden_restore_idx, rec["hidden_restore_idx"])
            np.testing.assert_array_equal(lay.kv_write_mask, rec["kv_write_mask"])
            local = partition_batch(batch, rank, n, layout=lay)
            nr = local.num_reqs
            np.testing.assert_array_equal(local.positions, rec["local_positions"])
            np.testing.assert_array_equal(local.input_ids, rec["local_input_ids"])
            np.testing.assert_array_equal(local.seq_lens[:nr], rec["local_seq_lens"][:nr])
            np.testing.assert_array_equal(local.query_start_loc[: nr + 1], rec["local_query_start_loc"][: nr + 1])
            np.testing.assert_array_equal(local.is_prefilling[:nr], rec["local_is_prefilling"][:nr])
            table = rec["block_table_global"][0]
            local_rows = gather_block_table_rows(table, local.global_req_idx, nr)
            np.testing.assert_array_equal(local_rows, rec["block_table_local"][0][:nr, : table.shape[1]])
            glob = compute_slot_mappings(table, bs, batch.idx_mapping, batch.query_start_loc, batch.positions)
            np.testing.assert_array_equal(glob, rec["slot_mapping_global"][:, : batch.num_tokens])
            np.testing.assert_array_equal(gathered_slot_mapping(glob, lay), rec["slot_mapping_gathered"])
            for phase in t.phases(step, rank):
                if phase.startswith("draft_") and phase != "draft_0":
                    d = t.record(step, rank, phase)
                    want = compute_slot_mappings(table, bs, batch.idx_mapping, np.arange(batch.num_reqs + 1),
                                                 d["draft_positions"])
                    np.testing.assert_array_equal(want, d["slot_mapping_draft"][:, : batch.num_reqs],
                                                  err_msg=f"step {step} rank {rank} {phase}")
            compared += 1
    assert compared >= 2 * len(t.ranks)
