"""The two suspected vLLM 0.33.0 bugs of issue 25, run through vLLM's own code on CPU rank threads
(pcpviz.vllm.replay.full_graphs, pcpviz.vllm.replay.dummy_runs; stand-ins declared there):

* docs/findings/full-draft-prefill-state.md: after a FULL draft-prefill replay the PCP manager's
  ``draft_prefill_batch`` stays set, and an eager draft decode of the same ``propose`` is handed
  the stale rank-local batch; the next ``propose`` clears it;
* docs/findings/dspark-dummy-run-stale-block-tables.md: a DSpark dummy run with attention under
  PCP writes draft K/V into a live request's blocks; MTP's does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm import replay as _replay  # noqa: E402,F401  (imports vLLM inside the CPU environment)
from pcpviz.vllm.replay.dummy_runs import probe_dummy_run  # noqa: E402
from pcpviz.vllm.replay.full_graphs import probe_full_graphs  # noqa: E402
from pcpviz.vllm.replay.graph_dispatch import capture_sizes  # noqa: E402


@pytest.fixture(scope="module")
def full():
    return probe_full_graphs(mode="FULL_DECODE_ONLY", decodes="replicated", scenario="full_graphs", max_num_seqs=5)


def test_capture_sizes_are_vllms_default():
    from vllm.config import CUDAGraphMode

    sizes = capture_sizes(max_num_seqs=5, k=2, max_num_batched_tokens=96, mode=CUDAGraphMode.FULL_DECODE_ONLY)
    assert sizes == [1, 2, 3, 4, 6, 8, 12, 15, 16, 24]
    # 256 requests: the decode sizes reach max_num_seqs (no gap there)
    big = capture_sizes(max_num_seqs=256, k=2, max_num_batched_tokens=8192, mode=CUDAGraphMode.FULL_DECODE_ONLY)
    assert 256 in big and max(big) == 512


@pytest.mark.slow
def test_full_prefill_replay_leaves_the_batch_and_an_eager_decode_reads_it(full):
    assert full.collective_mismatch is None and full.graphs == {"prefill": 5, "decode": 4}
    by_step = {obs[0].step: obs for obs in full.steps}
    for step in (1, 2):  # 5 requests: FULL draft prefill, no decode graph for 5 requests
        for o in by_step[step]:
            assert (o.num_reqs, o.prefill_mode, o.decode_mode, o.full_replays) == (5, "FULL", "NONE", 1)
            assert o.left_set
            (decode,) = [f for f in o.forwards if f.phase == "draft_decode"]
            assert decode.stale and decode.reads == "rank-local batch" and decode.wrong_rows
            assert not np.array_equal(decode.positions, decode.expected_positions)
    for o in by_step[3]:  # 4 requests: both replay graphs; nothing reads the leftover batch
        assert (o.num_reqs, o.prefill_mode, o.decode_mode, o.full_replays) == (4, "FULL", "FULL", 2)
        assert o.left_set and not o.stale_forwards()
    for o in by_step[0]:  # the prefill step: eager draft prefill, cleared by restore_draft_prefill
        assert o.prefill_mode == "NONE" and not o.left_set and not o.stale_forwards()
    # the next propose's prepare_draft_prefill finds the leftover and clears it first
    assert [o.found_set for o in by_step[2]] == [True, True] and [o.found_set for o in by_step[1]] == [False, False]


@pytest.mark.slow
def test_the_findings_figures(full):
    """The numbers docs/findings/full-draft-prefill-state.md quotes."""
    from vllm.config import CUDAGraphMode

    from pcpviz.vllm.replay.graph_dispatch import eager_decodes_after_full_prefill

    assert full.capture_sizes == (1, 2, 3, 4, 6, 8, 12, 15, 16, 24)
    (decode,) = [f for f in full.steps[1][0].forwards if f.phase == "draft_decode"]
    assert (decode.input_ids.tolist(), decode.positions.tolist()) == ([14, 92, 0, 0, 25], [4, 5, 6, 5, 6])
    assert (decode.expected_input_ids.tolist(), decode.expected_positions.tolist()) == ([0, 20, 12, 85, 75],
                                                                                      [6, 8, 9, 8, 6])
    assert full.steps[1][0].forwards[0].slot_mapping[:5].tolist() == [43, 8, 17, 26, 35]
    gaps = {n: eager_decodes_after_full_prefill(max_num_seqs=n, k=2) for n in (5, 8, 10, 16, 100, 128, 256)}
    assert gaps == {5: [5], 8: [], 10: [9, 10], 16: [], 100: [97, 98, 99, 100], 128: [], 256: []}
    assert eager_decodes_after_full_prefill(max_num_seqs=10, k=2, mode=CUDAGraphMode.FULL_AND_PIECEWISE) == [9, 10]


@pytest.mark.slow
def test_full_prefill_replay_reads_the_captured_buffers_and_slot_mapping(full):
    o = full.steps[1][0]
    prefill = o.forwards[0]
    assert prefill.mode == "FULL" and prefill.reads == "speculator buffers"
    assert prefill.should_read == "rank-local batch"
    # its KV write got BlockTables.slot_mappings (the previous draft decode's slots, then PAD),
    # not the target's gathered mapping
    assert prefill.slot_mapping.shape[0] <= o.target_slot_mapping.shape[0]
    assert not np.array_equal(prefill.slot_mapping[:5], o.target_slot_mapping[:5])
    previous_decode = full.steps[0][0].forwards[-1]
    assert prefill.slot_mapping[:5].tolist() == previous_decode.slot_mapping[:5].tolist()


@pytest.mark.slow
def test_the_leak_is_the_same_under_full_and_piecewise():
    p = probe_full_graphs(mode="FULL_AND_PIECEWISE")
    assert [o.prefill_mode for o in p.steps[0]] == ["PIECEWISE", "PIECEWISE"]  # the mixed step: PIECEWISE
    assert {o.step for o in p.stale()} == {1, 2}


@pytest.mark.slow
@pytest.mark.parametrize("fix, stale_steps, full_prefills", [("clear_after_replay", set(), 3),
                                                            ("eager_prefill_under_pcp", set(), 0)])
def test_candidate_fixes(fix, stale_steps, full_prefills):
    p = probe_full_graphs(fix=fix)
    assert {o.step for o in p.stale()} == stale_steps
    assert not any(o.left_set for obs in p.steps for o in obs)
    assert sum(o.prefill_mode == "FULL" for o in (obs[0] for obs in p.steps)) == full_prefills
    if fix == "eager_prefill_under_pcp":  # the draft prefill reads the rank-local rows again
        assert all(not f.wrong_rows for obs in p.steps for o in obs for f in o.forwards)


@pytest.mark.slow
def test_sharded_single_decode_diverges_the_ranks_collectives():
    p = probe_full_graphs(decodes="sharded", scenario="one_decode")
    assert p.collective_mismatch is not None and "['FULL', 'NONE']" in p.collective_mismatch
    fixed = probe_full_graphs(decodes="sharded", scenario="one_decode", fix="eager_prefill_under_pcp")
    assert fixed.collective_mismatch is None


@pytest.mark.parametrize("kwargs, message", [(dict(mode="FULL"), "mode must be"), (dict(fix="x"), "fix must be"),
                                             (dict(scenario="dspark"), "MTP scenario"),
                                             (dict(decodes="both"), "decodes must be")])
def test_probe_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        probe_full_graphs(**kwargs)


# --------------------------------------------------------------------------- dummy runs


@pytest.mark.slow
def test_dspark_dummy_run_with_attention_writes_a_live_requests_draft_kv():
    obs = probe_dummy_run(drafter="dspark", kind="attention")
    for o in obs:
        assert o.input_block_tables_rows[0, 0] != 0  # the last real gather's row, not zeros
        assert (o.draft_slots >= 0).all() and o.writes_live_kv
        assert set(o.kv_writes) == set(o.draft_slots.tolist()) and list(o.hits) == ["d0"]
        assert (o.non_pcp_draft_slots == -1).all()  # BlockTables.get_dummy_block_tables: PAD
        assert o.all_gathers > 0  # the target's expanded dummy mapping took the all-gather branch
    assert obs[0].kv_writes == obs[1].kv_writes


@pytest.mark.slow
def test_dspark_dummy_run_figures():
    """The numbers docs/findings/dspark-dummy-run-stale-block-tables.md quotes."""
    for o in probe_dummy_run(drafter="dspark", kind="attention"):
        assert o.input_block_tables_rows[0, :4].tolist() == [1, 2, 3, 4] and o.draft_slots.tolist() == [5, 6]
        assert o.hits == {"d0": [5, 6]} and [v[1] for _, v in sorted(o.kv_writes.items())] == [1.0, 2.0]


@pytest.mark.slow
def test_dspark_dummy_fix_zero_input_block_tables():
    for o in probe_dummy_run(drafter="dspark", kind="attention", fix="zero_input_block_tables"):
        assert (o.draft_slots == -1).all() and not o.kv_writes


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_profile_runs_and_mtp_dummy_runs_write_no_kv(drafter):
    for o in probe_dummy_run(drafter=drafter, kind="profile"):
        assert o.all_gathers == 0 and not o.kv_writes
    if drafter == "mtp":  # MTP's dummy decodes: idx_mapping -1, PAD slots; its collectives: all-gathers
        for o in probe_dummy_run(drafter="mtp", kind="attention"):
            assert not o.kv_writes and (o.draft_slots == -1).all() and o.all_gathers > 0


def test_graph_manager_stand_ins_stay_while_any_rank_thread_still_builds():
    """The rank threads build their graph managers at once: one leaving must not put vLLM's
    own get_pp_group back under another still building (the replay then fails with 'pipeline
    model parallel group is not initialized', as it did under load)."""
    import threading

    from vllm.v1.worker.gpu import cudagraph_utils

    from pcpviz.vllm.replay import graph_dispatch as graphs

    own = cudagraph_utils.get_pp_group
    inside, left = threading.Event(), threading.Event()

    def other() -> None:
        with graphs._cpu_graph_manager_env():
            inside.set()
        left.set()

    with graphs._cpu_graph_manager_env():
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(10) and left.wait(10)
        assert cudagraph_utils.get_pp_group is not own and cudagraph_utils.get_pp_group().is_first_rank
        t.join()
    assert cudagraph_utils.get_pp_group is own
