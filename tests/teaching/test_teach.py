"""pcpviz.teaching.examples: the numbers the notebooks claim, checked against the pcpviz reference, the
engine, and the real vLLM 0.33.0 functions they re-derive (Triton kernels in the interpreter,
``_gather_prefill_cache_inputs`` on a fake PCP group, ``get_uniform_decode_token_count``)."""

from __future__ import annotations

import doctest
import json
from types import SimpleNamespace

import numpy as np
import pytest
from types import MappingProxyType
import torch

from pcpviz.reference import batch as batch_mod
from pcpviz.reference import blocks as blocks_mod
from pcpviz.reference import drafts as drafts_mod
from pcpviz.teaching import examples as teach
from pcpviz.teaching.examples import draft_steps, exercises, kv_writes, pcp_paths, traces
from pcpviz.reference.batch import order_batch
from pcpviz.reference.blocks import PAD_SLOT_ID, gather_block_table_rows, gathered_slot_mapping
from pcpviz.reference.layout import plan_layout
from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks

LAYOUTS = [  # (query lens, is_prefilling, shard_decode_requests, dcp)
    ([4, 1, 13], [False, False, True], True, 1),
    ([1, 4, 6, 13], [False, False, True, True], True, 1),
    ([4, 1, 13], [False, False, True], False, 2),
    ([1, 3, 13], [False, True, True], False, 2),  # a short prefill replicated under DCP
    ([4, 4], [False, False], False, 2),  # decode-only: the "local rows only" branch
    ([9, 13], [True, True], False, 2),  # prefill-only: no decode rows
]


def _global_slots(layout):
    return np.arange(layout.num_tokens, dtype=np.int64) + 100


def test_doctests():
    for mod in (kv_writes, draft_steps, pcp_paths, traces, exercises, batch_mod, blocks_mod, drafts_mod):
        res = doctest.testmod(mod)
        assert res.attempted > 0 and res.failed == 0, f"{mod.__name__}: {res}"


@pytest.mark.parametrize("q, pf, shard, dcp", LAYOUTS)
def test_every_rank_cache_receives_every_token_once(q, pf, shard, dcp):
    lay = plan_layout(q, pf, 2, shard_decode_requests=shard, dcp_world_size=dcp)
    g = _global_slots(lay)
    gathered = gathered_slot_mapping(g[None, :], lay)[0]
    for rank in range(2):
        w = teach.cache_writes(lay, gathered, rank)
        real = w.slots != PAD_SLOT_ID
        assert sorted(w.tokens[real].tolist()) == list(range(lay.num_tokens)), f"rank {rank}"
        assert w.written() == {t: int(g[t]) for t in range(lay.num_tokens)}


def test_replicated_decodes_are_written_by_every_rank_from_its_own_rows():
    # Point 2 of issue 11: not "only rank 0's copy is written".
    lay = plan_layout([4, 1, 13], [False, False, True], 2, shard_decode_requests=False, dcp_world_size=2)
    gathered = gathered_slot_mapping(_global_slots(lay)[None, :], lay)[0]
    w1 = teach.cache_writes(lay, gathered, 1)
    decode_tokens = set(range(5))
    own = [i for i, t in enumerate(w1.tokens.tolist()) if t in decode_tokens and w1.slots[i] != PAD_SLOT_ID]
    assert len(own) == 5 and set(w1.source_rank[own].tolist()) == {1}
    # ...while the mask keeps only rank 0's copy of those rows in the gathered mapping
    p = lay.padded_num_tokens
    assert not lay.kv_write_mask[p: p + 5].any() and lay.kv_write_mask[:5].all()


@pytest.mark.parametrize("q, pf, shard, dcp", LAYOUTS)
def test_cache_writes_equal_vllm_gather_prefill_cache_inputs(q, pf, shard, dcp):
    from vllm.v1.attention.ops import pcp as vpcp

    lay = plan_layout(q, pf, 2, shard_decode_requests=shard, dcp_world_size=dcp)
    gathered = torch.as_tensor(gathered_slot_mapping(_global_slots(lay)[None, :], lay)[0])
    p = lay.padded_num_tokens
    group = FakePCPGroup(2)

    def rank_fn(rank):
        rows = torch.as_tensor(lay.local_gather_idx(rank)).float()[:, None]  # the KV row = its token
        nd = sum(s.num_tokens for s in lay.segments_by_rank[rank] if not pf[s.global_req_idx])
        (kv,), slots = vpcp._gather_prefill_cache_inputs((rows,), gathered, nd, shard)
        return kv[:, 0].long().numpy(), slots.numpy()

    for rank, (tokens, slots) in enumerate(run_ranks(group, rank_fn)):
        w = teach.cache_writes(lay, gathered.numpy(), rank)
        keep = slots != PAD_SLOT_ID
        assert tokens[keep].tolist() == w.tokens[w.slots != PAD_SLOT_ID].tolist()
        assert slots.tolist() == w.slots.tolist()
    assert p > 0


def test_draft_decode_writes_ignore_input_block_tables_and_reads_depend_on_them():
    ex = teach.block_example()
    table = ex.table.as_array()
    gathered_rows = gather_block_table_rows(table, ex.idx_mapping)
    good = teach.draft_decode_io(table, 4, ex.idx_mapping, positions=ex.draft_positions,
                                 input_block_tables=gathered_rows)
    bad = teach.draft_decode_io(table, 4, ex.idx_mapping, positions=ex.draft_positions,
                                input_block_tables=ex.stale_input_block_tables)
    assert good.slot_mapping.tolist() == bad.slot_mapping.tolist() == [23, 14]
    assert good.read_blocks == ((5,), (7, 3)) and bad.read_blocks == ((0,), (0, 0))
    # a stale table from another step (rows of other requests) also only changes the reads
    stale = np.roll(table, 1, axis=0)
    assert teach.draft_decode_io(table, 4, ex.idx_mapping, positions=ex.draft_positions,
                                 input_block_tables=stale).slot_mapping.tolist() == [23, 14]


def test_draft_decode_slots_equal_vllm_compute_slot_mappings():
    from pcpviz.vllm import oracle

    ex = teach.block_example()
    table = ex.table.as_array()
    ours = teach.draft_decode_io(table, 4, ex.idx_mapping, positions=ex.draft_positions,
                                 input_block_tables=ex.stale_input_block_tables).slot_mapping
    theirs = oracle.vllm_compute_slot_mappings([list(r) for r in table], 4, idx_mapping=ex.idx_mapping,
                                               query_start_loc=[0, 1, 2], positions=ex.draft_positions, num_tokens=2)
    assert np.asarray(theirs).reshape(-1)[:2].tolist() == ours.tolist()


def _vllm_draft_inputs(ex):
    """Run vLLM's prepare_prefill_inputs + prepare_decode_inputs kernels (Triton interpreter)."""
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (prepare_decode_inputs,
                                                                               prepare_prefill_inputs)

    b = ex.batch
    r, t, max_reqs = b.num_reqs, b.num_tokens, 8
    i32, i64 = torch.int32, torch.int64
    buffers = SimpleNamespace(input_ids=torch.full((t,), -1, dtype=i32), positions=torch.zeros(t, dtype=i64),
                              query_start_loc=torch.zeros(max_reqs + 1, dtype=i32),
                              seq_lens=torch.zeros(max_reqs, dtype=i32))
    gb = SimpleNamespace(num_reqs=r, input_ids=torch.as_tensor(b.input_ids, dtype=i32),
                         positions=torch.as_tensor(b.positions, dtype=i64), idx_mapping=torch.arange(r, dtype=i64),
                         query_start_loc=torch.as_tensor(b.query_start_loc, dtype=i32),
                         seq_lens=torch.as_tensor(b.seq_lens, dtype=i32))
    last = torch.full((max_reqs,), 7, dtype=i64)
    prepare_prefill_inputs(last, torch.zeros(1, dtype=i64), buffers, gb,
                           torch.as_tensor(ex.num_sampled, dtype=i32), torch.as_tensor(ex.num_rejected, dtype=i32),
                           torch.as_tensor(ex.last_sampled, dtype=i64),
                           torch.as_tensor(ex.next_prefill_tokens, dtype=i32), max_reqs)
    ids = buffers.input_ids.clone()
    # _prefill: positions[:R] = positions[last_token_indices]
    buffers.positions[:r] = buffers.positions[last[:r]].clone()
    drafts = torch.zeros((r, 3), dtype=i64)
    prepare_decode_inputs(drafts[:, 0], gb.seq_lens, torch.as_tensor(ex.num_rejected, dtype=i32), buffers,
                          torch.zeros(max_reqs, dtype=i64), 4096, max_reqs)
    return ids.numpy(), last.numpy(), buffers.positions[:r].numpy(), buffers.seq_lens.numpy()


def test_draft_inputs_equal_vllm_kernels():
    ex = teach.draft_example()
    ours = ex.inputs()
    ids, last, pos, seq_lens = _vllm_draft_inputs(ex)
    valid = ours.input_ids != teach.STALE
    assert ids[valid].tolist() == ours.input_ids[valid].tolist()
    assert last[: ex.num_reqs_padded].tolist() == ours.last_token_indices.tolist() == [1, 9, 0]
    assert pos.tolist() == ours.decode_positions[0].tolist() == [22, 6]
    assert seq_lens[: ex.num_reqs_padded].tolist() == ours.decode_seq_lens[0].tolist() == [23, 7, 0]


def test_draft_inputs_equal_engine_on_valid_rows():
    from pcpviz.engine.speculator import draft_prefill_inputs

    ex = teach.draft_example()
    ours = ex.inputs()
    b = ex.batch
    verify = SimpleNamespace(num_rejected=ex.num_rejected, num_sampled=ex.num_sampled,
                             sampled=[[ex.last_sampled[i]] for i in range(b.num_reqs)])
    ids, last = draft_prefill_inputs(b, verify, ex.next_prefill_tokens)
    valid = ours.input_ids != teach.STALE
    assert ids[valid].tolist() == ours.input_ids[valid].tolist()
    assert last.tolist() == ours.last_token_indices[: b.num_reqs].tolist()


def test_draft_inputs_rejects_bad_lengths():
    ex = teach.draft_example()
    with pytest.raises(ValueError, match="num_rejected needs one entry per request"):
        teach.draft_inputs(ex.batch, num_sampled=[1, 0], num_rejected=[0], last_sampled=[0, 0],
                           next_prefill_tokens=[0, 0], num_speculative_tokens=3)


@pytest.mark.parametrize("q, pf, shard, dcp", LAYOUTS + [([4], [False], True, 1), ([4, 4], [False, False], True, 1)])
def test_draft_prefill_dispatch_equals_vllm_uniform_count(q, pf, shard, dcp):
    from vllm.v1.worker.utils import get_uniform_decode_token_count

    lay = plan_layout(q, pf, 2, shard_decode_requests=shard, dcp_world_size=dcp)
    for d in teach.draft_prefill_dispatch(lay):
        assert d.num_tokens_padded == lay.padded_num_tokens
        assert d.uniform_token_count == get_uniform_decode_token_count(len(q), d.num_tokens, max(q), not any(pf))


def test_full_graph_risk_is_uniform_count_not_token_count():
    # Point 3 of issue 11: both ranks dispatch the same P; only uniform_token_count differs.
    d0, d1 = teach.draft_prefill_dispatch(plan_layout([4], [False], 2))
    assert d0.num_tokens_padded == d1.num_tokens_padded == 4
    assert (d0.uniform_token_count, d1.uniform_token_count) == (4, None)
    # replicated decodes (DCP > 1): symmetric
    r0, r1 = teach.draft_prefill_dispatch(plan_layout([4], [False], 2, shard_decode_requests=False, dcp_world_size=2))
    assert r0.uniform_token_count == r1.uniform_token_count == 4


def test_indexer_fold():
    target = teach.indexer_k_write(slot_mapping_rows=8, k_rows=4, pcp=2, num_decode_tokens=1)
    assert target.k_rows_kept == 4 and target.path.startswith("expanded")
    draft = teach.indexer_k_write(slot_mapping_rows=3, k_rows=3, pcp=2, num_decode_tokens=3)
    assert draft.k_rows_kept == 3 and draft.path.startswith("unexpanded")
    old = teach.indexer_k_write(slot_mapping_rows=3, k_rows=3, pcp=2, num_decode_tokens=3, pre_fix=True)
    assert old.k_rows_kept == 1 and old.path.startswith("AssertionError")
    # the pre-fix fold is harmless on the expanded target mapping
    assert teach.indexer_k_write(slot_mapping_rows=8, k_rows=4, pcp=2, num_decode_tokens=1,
                                 pre_fix=True) == target


def test_indexer_fold_assertion_is_vllms():
    from vllm.v1.attention.ops import pcp as vpcp

    k = torch.zeros(3, 1)[:1]  # the pre-fix fold keeps 3 // 2 rows
    with pytest.raises(AssertionError):
        vpcp._gather_prefill_cache_inputs((k,), torch.arange(3), 3, True)


def test_describe_acceptance_change():
    text = teach.describe_acceptance_change([0.87, 0.35, 0.2], [0.86, 0.05, float("nan")])
    assert text.splitlines() == ["position 0: 0.87 -> 0.86 (unchanged, within 0.05)",
                                 "position 1: 0.35 -> 0.05 (dropped by 0.30)",
                                 "position 2: 0.20 -> nan (no drafts)"]
    assert "rose by 0.20" in teach.describe_acceptance_change([0.1], [0.3])
    with pytest.raises(ValueError):
        teach.describe_acceptance_change([0.1], [0.1, 0.2])


def test_pick_trace(tmp_path):
    with pytest.raises(ValueError, match="no trace directory"):
        teach.pick_trace(tmp_path)
    for name, producer in (("a-engine", "pcpviz-engine"), ("b-replay", "vllm-replay"), ("z-broken", None)):
        (tmp_path / name).mkdir()
        if producer:
            (tmp_path / name / "run.json").write_text(json.dumps({"producer": producer}))
    assert teach.pick_trace(tmp_path).path.name == "b-replay"
    (tmp_path / "c-gpu").mkdir()
    (tmp_path / "c-gpu" / "run.json").write_text(json.dumps({"producer": "vllm-plugin"}))
    pick = teach.pick_trace(tmp_path)
    assert pick.path.name == "c-gpu" and pick.recorded_by_vllm


def test_vllm_acceptance_metric():
    assert teach.vllm_acceptance_metric({"producer": "x"}) is None
    meta = {"vllm_metrics": [{"name": "a"}, {teach.METRIC_PER_POS: [5, 2]}]}
    assert teach.vllm_acceptance_metric(meta) == [5, 2]
    assert teach.vllm_acceptance_metric(MappingProxyType(meta)) == [5, 2]  # Trace.meta is read-only


@pytest.mark.parametrize("name", sorted(teach.EXERCISES))
def test_exercises_check_answers(name):
    right = teach.EXERCISES[name].solve()
    assert teach.check(name, None).startswith("answer: ")
    assert teach.check(name, right).startswith("right: ")
    wrong = "certainly not this"
    assert teach.check(name, wrong).startswith("not quite: ")


def test_exercise_answers():
    assert teach.EXERCISES["empty_tail_chunk"].solve() == [2, 3]
    assert teach.EXERCISES["decode_owner_moves"].solve() == [1, 0]
    assert teach.EXERCISES["scheduler_order"].solve() == ["e", "d", "p"]
    assert teach.EXERCISES["skip_gather_write_slot"].solve() == 14
    assert teach.EXERCISES["skip_gather_read_blocks"].solve() == [0, 0]
    with pytest.raises(ValueError, match="unknown exercise"):
        teach.check("nope", 1)


def test_order_batch_equals_vllm_sort():
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    lengths, _, names = order_batch([13, 4, 1], [1, 4, 4], prefill_names=["p", "q", "r"],
                                    decode_names=["d", "e", "f"])
    raw = {"p": 13, "q": 4, "r": 1, "d": 1, "e": 4, "f": 4}
    drafts = {"e": [1, 2, 3], "f": [1, 2, 3]}
    assert names == sort_batch_req_ids(raw, drafts, 4)
    assert lengths == [raw[n] for n in names]


def test_dspark_drafter_config_is_vllms():
    c = teach.dspark_drafter_config(2)
    assert (c.target_pcp, c.draft_pcp, c.draft_dcp) == (2, 1, 1)
    assert c.config_copied and c.speculative_config_shared  # a shallow copy (review risk 3)
    mla = teach.dspark_drafter_config(2, 2, tp=2, draft_use_mla=True)
    assert (mla.draft_pcp, mla.draft_dcp, mla.error) == (1, 2, None)
    # validate_config accepts DCP = PCP, but the drafter's PCP=1 config then needs TP % DCP == 0
    refused = teach.dspark_drafter_config(2, 2, tp=1, draft_use_mla=True)
    assert refused.draft_pcp is None and "tp_size=1 must be divisible by dcp_size=2" in refused.error
    assert teach.dspark_drafter_config(2, 2, draft_use_mla=False).draft_dcp == 1


def test_local_is_padding_shapes():
    lay = plan_layout([13, 1, 4], [True, False, False], 2)
    assert teach.local_is_padding(lay, 0, moe_gathers_tokens=False).tolist() == [False] * 6 + [True] * 6
    moe = teach.local_is_padding(lay, 1, moe_gathers_tokens=True)
    assert moe.shape == (24,) and moe.tolist() == ([False] * 6 + [True] * 6 + [False] * 12)


def test_trace_pairs(tmp_path):
    def make(name, producer, prompts):
        (tmp_path / name).mkdir()
        meta = {"producer": producer}
        if prompts is not None:
            meta["prompts"] = prompts
        (tmp_path / name / "run.json").write_text(json.dumps(meta))

    make("a-engine", "pcpviz-engine", ["x"])
    make("b-other", "pcpviz-engine", ["y"])
    assert teach.trace_pairs(tmp_path) == []
    make("c-gpu-good", "vllm-plugin", ["x"])
    make("d-gpu-bad", "vllm-plugin", ["x"])
    make("e-none", "vllm-plugin", None)
    pairs = [(a.path.name, b.path.name) for a, b in teach.trace_pairs(tmp_path)]
    assert pairs[0] == ("c-gpu-good", "d-gpu-bad") and len(pairs) == 3


def test_cache_writes_summary():
    lay = plan_layout([4, 1, 13], [False, False, True], 2, shard_decode_requests=False, dcp_world_size=2)
    w = teach.cache_writes(lay, gathered_slot_mapping(_global_slots(lay)[None, :], lay)[0], 1)
    assert w.summary().startswith("rank 1: writes 18 tokens (once each); from its own rows [0, 1, 2, 3, 4,")
