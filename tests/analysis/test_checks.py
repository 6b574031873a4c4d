"""pcpviz.analysis.checks: clean traces pass every check; for every check a targeted corruption fails it
at the right step/rank/phase/view; skipped checks are reported; ``pcpviz check`` exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pcpviz import faults as F
from pcpviz.trace.meta_model import decode_meta
from pcpviz.analysis.checks import (CHECKS, DCP_CHECKS, ENGINE_VIEW_CHECKS, FAIL, PASS, SKIPPED, first_difference,
                                    run_checks, short_repr)
from tracegen import (
    RequestSpec,
    clean_run,
    corrupt,
    first_step,
    generate,
    run_of_trace,
    worked_example_run,
)

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_NAMES = [
    "views_in_bounds", "layout_matches_plan", "restore_gather_identity", "kv_written_once", "gathered_slots_are_global",
    "global_slots_match_block_table", "kv_write_mask_canonical", "local_batch_matches_layout",
    "local_positions_are_global", "local_seq_lens", "local_logits_not_sampled",
    "draft_prefill_rank_local", "draft_last_token_indices", "draft_input_ids",
    "draft_decode_replicated", "draft_block_tables_global", "draft_positions_advance",
    "hidden_restored", "hidden_handoffs", "target_outputs_agree", "forward_consumed_prepared",
    "graph_inputs_are_captured", "collectives_match_vllm", "dcp_kv_sharding", "dcp_local_lens", "dcp_partial_combined",
    "verify_consistent", "drafts_fed_back", "ranks_agree", "positions_consistent", "verify_greedy",
    "is_prefilling_rule", "must_sample_rule", "cursor_rolls_back_rejections", "num_accepted_from_tokens",
]


def check(run, tmp_path, name="trace"):
    return run_checks(run.write(tmp_path / name))


def test_catalogue_names_are_stable():
    assert list(CHECKS) == EXPECTED_NAMES
    assert all(isinstance(d, str) and len(d) > 20 for d in CHECKS.values())


# --------------------------------------------------------------------------- clean traces

CLEAN = [
    pytest.param(dict(pcp=1, k=3), id="pcp1-k3"),
    pytest.param(dict(pcp=2, k=3), id="pcp2-k3-sharded"),
    pytest.param(dict(pcp=2, k=3, shard_decode_requests=False), id="pcp2-k3-replicated"),
    pytest.param(dict(pcp=4, k=3), id="pcp4-k3-sharded"),
    pytest.param(dict(pcp=4, k=2, dcp=2), id="pcp4-k2-dcp2-replicated"),
    pytest.param(dict(pcp=2, k=3, graph_pad=8), id="pcp2-graph-padded"),
    pytest.param(dict(pcp=2, k=3, reverse_rows=True), id="pcp2-other-row-order"),
    pytest.param(dict(pcp=2, k=3, timestamps=True), id="pcp2-timestamps"),
    pytest.param(dict(pcp=2, k=1), id="pcp2-k1"),
    pytest.param(dict(pcp=4, k=0), id="pcp4-no-spec"),
]


@pytest.mark.parametrize("kw", CLEAN)
def test_clean_traces_pass_every_check(tmp_path, kw):
    run = clean_run(**kw)
    # the scenario really has chunked prefills, decodes with drafts and rejections
    target = [ph[0]["target"] for _, ph in run.steps]
    assert any(t["is_prefilling"].any() and (~t["is_prefilling"]).any() for t in target)
    if kw["k"] > 0:
        assert any(ph[0]["verify"]["num_rejected"].any() for _, ph in run.steps)
    report = check(run, tmp_path)
    assert report.ok, report.format()
    k, pcp = kw["k"], kw["pcp"]
    # the synthetic producer models eager runs (no graph ledger) and records no fwd_* views nor collectives
    never = {"graph_inputs_are_captured", "forward_consumed_prepared", "collectives_match_vllm"}
    # DCP = 1: no DCP checks; the synthetic producer runs no attention (no dcp_ranks_combined)
    never |= DCP_CHECKS if kw.get("dcp", 1) == 1 else {"dcp_partial_combined"}
    if k < 2:
        never |= {"draft_decode_replicated", "draft_block_tables_global", "draft_positions_advance"}
    if k < 1:
        never |= {"draft_prefill_rank_local", "draft_last_token_indices", "draft_input_ids", "hidden_handoffs"}
    if pcp == 1:
        never |= {"ranks_agree", "target_outputs_agree"}
    for name, res in report.results.items():
        if name in never:
            assert res.verdict == SKIPPED and res.evaluated == 0, (name, res)
        else:
            assert res.verdict == PASS, (name, res)
            assert res.evaluated >= len(run.steps) * pcp - (pcp if name == "drafts_fed_back" else 0)


def test_vllm_worked_example_passes(tmp_path):
    """Scenario A (docs/vllm-0.33-pcp-mtp.md): the numbers vLLM 0.33.0 produced, not pcpviz.reference.layout's."""
    run = worked_example_run()
    rank0 = run.views(7, 0, "draft_0")["draft_input_ids"]
    assert rank0.tolist() == [41, 42, 43, 60, 81, 82, 83, 90, 56, 57, 58, 59, 73] + [41] * 5
    report = check(run, tmp_path)
    assert report.ok, report.format()
    assert report["drafts_fed_back"].verdict == SKIPPED  # one step: no previous step
    assert report["drafts_fed_back"].skip_reason == "step 7 rank 0: no previous step"
    # vLLM's own numbers: none of the engine's fingerprints or top1_token
    # nor prefill_len (the derived prefill rules need it), nor the cursor after verify
    assert set(report.skipped) == ({"drafts_fed_back", "graph_inputs_are_captured", "is_prefilling_rule",
                                    "must_sample_rule", "cursor_rolls_back_rejections"}
                                   | ENGINE_VIEW_CHECKS | DCP_CHECKS)


def test_long_trace_checks_quickly(tmp_path):
    import time

    from pcpviz.synthetic import long_prompt_run

    run = long_prompt_run(prompt_len=8192, chunk=2048, max_new_tokens=40)
    path = run.write(tmp_path / "long")
    t0 = time.perf_counter()
    report = run_checks(path)
    assert report.ok, report.format()
    assert time.perf_counter() - t0 < 10


# --------------------------------------------------------------------------- faults

def _shift_rows(a):
    out = a.copy()
    out[[0, 1]] = out[[1, 0]]
    return out


def case_layout(_):
    run = clean_run(2, faults=[F.LAYOUT_NO_SWAP])
    return run, {"layout_matches_plan"}, (0, 0, "target", "segments")


def case_restore(_):
    run = clean_run(2)
    corrupt(run, 1, "target", "hidden_restore_idx", _shift_rows)
    # hidden_restored reads the same map: the fingerprints are restored through it
    failing = {"restore_gather_identity", "layout_matches_plan", "hidden_restored"}
    return run, failing, (1, 0, "target", "hidden_restore_idx")


def case_kv_once(_):
    reqs = [RequestSpec("x", 6, 6), RequestSpec("y", 7, 6), RequestSpec("z", 30, 5, 1)]
    run = generate(reqs, pcp=2, num_speculative_tokens=2, block_size=4, max_num_batched_tokens=24,
                   faults=[F.SHARED_KV_BLOCK])
    return run, {"kv_written_once"}, (0, 0, "target", "slot_mapping_gathered")


def case_gathered(_):
    run = clean_run(2)
    mask = run.views(0, 0, "target")["kv_write_mask"]
    j1, j2 = np.flatnonzero(mask)[:2]

    def swap(a):
        a[:, [j1, j2]] = a[:, [j2, j1]]
        return a
    corrupt(run, 0, "target", "slot_mapping_gathered", swap)
    corrupt(run, 0, "draft_0", "slot_mapping_draft", swap)
    return run, {"gathered_slots_are_global"}, (0, 0, "target", "slot_mapping_gathered")


def case_global_slots(_):
    run = clean_run(2)
    shift = lambda a: np.where(a >= 0, a + 4000, a)  # noqa: E731
    corrupt(run, 0, "target", "slot_mapping_global", shift)
    corrupt(run, 0, "target", "slot_mapping_gathered", shift)
    corrupt(run, 0, "draft_0", "slot_mapping_draft", shift)
    return run, {"global_slots_match_block_table"}, (0, 0, "target", "slot_mapping_global")


def case_null_block(_):
    run = clean_run(2, faults=[F.NULL_BLOCK_WRITE])
    # later steps' first row is a decode whose draft positions share that block
    return run, {"global_slots_match_block_table", "draft_decode_replicated"}, \
        (0, 0, "target", "slot_mapping_global")


def case_write_mask(_):
    run = clean_run(2, shard_decode_requests=False, faults=[F.REPLICATED_WRITER_NOT_RANK0])
    s = first_step(run, lambda ph: (~ph["target"]["is_prefilling"]).any())
    return run, {"layout_matches_plan", "kv_write_mask_canonical"}, (s, 0, "target", "kv_write_mask")


def _bump0(a):
    a[0] += 100
    return a


def case_local_batch(_):
    run = clean_run(2)
    corrupt(run, 0, "target", "local_input_ids", _bump0, ranks=[1])
    return run, {"local_batch_matches_layout"}, (0, 1, "target", "local_input_ids")


def case_local_positions(_):
    run = clean_run(2)
    assert run.views(0, 1, "target")["local_query_start_loc"][1] >= 2  # row 0 is not a segment's last
    corrupt(run, 0, "target", "local_positions", _bump0, ranks=[1])
    corrupt(run, 0, "draft_0", "draft_positions", _bump0, ranks=[1])
    return run, {"local_positions_are_global"}, (0, 1, "target", "local_positions")


def case_local_positions_cpu(_):
    """positions_from_cpu_cursor (the engine's too): local rows rebuilt from the CPU cursor."""
    run = clean_run(2, faults=[F.POSITIONS_FROM_CPU_CURSOR])
    s = first_step(run, lambda ph: ph["verify"]["num_rejected"].any())
    nxt = run.step_ids[run.step_ids.index(s) + 1]
    prev = run.views(s, 0, "verify")
    owner = None
    for rank in range(2):  # the rank holding a request that had rejections
        local = run.views(nxt, rank, "target")["local_req_ids"].tolist()
        if any(str(prev["req_ids"][i]) in local for i in np.flatnonzero(prev["num_rejected"])):
            owner = rank
            break
    return run, {"local_positions_are_global"}, (nxt, owner, "target", "local_positions")


def case_local_seq_lens(_):
    run = clean_run(2)
    corrupt(run, 0, "target", "local_seq_lens", _bump0, ranks=[1])
    corrupt(run, 0, "draft_0", "draft_seq_lens", _bump0, ranks=[1])
    return run, {"local_seq_lens"}, (0, 1, "target", "local_seq_lens")


def case_local_logits(_):
    run = clean_run(2, faults=[F.SAMPLE_LOCAL_LOGITS])
    return run, {"local_logits_not_sampled"}, (0, 0, "target", "sampled_logits_rows")


def case_draft_prefill(_):
    run = clean_run(2)
    for rank in range(2):
        views = run.views(0, rank, "draft_0")
        views["slot_mapping_draft"] = run.views(0, rank, "target")["slot_mapping_global"].copy()
    return run, {"draft_prefill_rank_local"}, (0, 0, "draft_0", "slot_mapping_draft")


def case_last_token(_):
    run = clean_run(2, faults=[F.LAST_TOKEN_IGNORES_REJECTIONS])
    s = first_step(run, lambda ph: ph["verify"]["num_rejected"].any())
    return run, {"draft_last_token_indices"}, (s, 0, "draft_0", "draft_last_token_indices")


def case_draft_inputs(_):
    run = clean_run(2)
    corrupt(run, 0, "draft_2", "draft_input_ids", lambda a: a + 1)
    return run, {"draft_input_ids"}, (0, 0, "draft_2", "draft_input_ids")


def case_draft_decode_expanded(_):
    run = clean_run(2, faults=[F.EXPANDED_DRAFT_SLOT_MAPPING])
    return run, {"draft_decode_replicated"}, (0, 0, "draft_1", "slot_mapping_draft")


def case_draft_decode_folded(_):
    """The engine's fold_slot_mapping_without_shape_check: rows past R // N never written."""
    run = clean_run(2)
    s = first_step(run, lambda ph: ph["target"]["req_ids"].shape[0] >= 2)

    def fold(a):
        a[:, a.shape[1] // 2:] = -1
        return a
    corrupt(run, s, "draft_1", "slot_mapping_draft", fold)
    return run, {"draft_decode_replicated"}, (s, 0, "draft_1", "slot_mapping_draft")


def case_draft_block_tables(_):
    run = clean_run(2, faults=[F.SKIP_DRAFT_BLOCK_TABLE_GATHER])
    return run, {"draft_block_tables_global"}, (0, 0, "draft_1", "block_table_draft")


def case_draft_positions(_):
    run = clean_run(2, faults=[F.DRAFT_POSITIONS_NOT_ADVANCED])
    return run, {"draft_positions_advance"}, (0, 0, "draft_2", "draft_positions")


def case_verify(_):
    run = clean_run(2)
    s = first_step(run, lambda ph: (ph["verify"]["num_accepted"] >= 1).any())
    i = int(np.argmax(run.views(s, 0, "verify")["num_accepted"] >= 1))

    def change(a):
        a[i, 0] += 1
        return a
    corrupt(run, s, "verify", "sampled_token_ids", change)
    # the sampled token is no longer the target's argmax either (verify_greedy)
    return run, {"verify_consistent", "verify_greedy"}, (s, 0, "verify", "sampled_token_ids")


def case_fed_back(_):
    run = clean_run(2)
    ids = run.step_ids
    for s, nxt in zip(ids, ids[1:]):
        cur = run.views(nxt, 0, "verify")
        prev_ids = run.views(s, 0, "verify")["req_ids"].tolist()
        rows = [i for i, r in enumerate(cur["req_ids"].tolist())
                if cur["num_draft_tokens"][i] == 3 and r in prev_ids]
        if rows:
            j = prev_ids.index(cur["req_ids"][rows[0]])
            break

    def change(a):
        a[j] += 1
        return a
    corrupt(run, s, "draft_2", "draft_tokens", change)
    return run, {"drafts_fed_back"}, (nxt, 0, "target", "input_ids")


def case_ranks_agree(_):
    run = clean_run(2)
    last = run.step_ids[-1]
    corrupt(run, last, "draft_2", "draft_tokens", lambda a: a + 1, ranks=[1])
    return run, {"ranks_agree"}, (last, 1, "draft_2", "draft_tokens")


def case_rank_missing_step(_):
    run = clean_run(2)
    s = run.step_ids[2]
    run.phases(s, 1).clear()
    return run, {"ranks_agree"}, (s, 1, None, None)


def case_positions(_):
    run = clean_run(2, faults=[F.GLOBAL_POSITIONS_FROM_CPU_CURSOR])
    s = first_step(run, lambda ph: ph["verify"]["num_rejected"].any())
    nxt = run.step_ids[run.step_ids.index(s) + 1]
    # the cursor after verify (right) no longer follows from the wrong positions: the derived rule
    # fails too, one phase later
    return run, {"positions_consistent", "cursor_rolls_back_rejections"}, (nxt, 0, "target", "positions")


def case_cpu_cursor_bound(_):
    run = clean_run(2)
    corrupt(run, 1, "target", "num_computed_tokens", lambda a: a - 1)
    return run, {"positions_consistent"}, (1, 0, "target", "positions")


def case_hidden_restored(_):
    run = clean_run(2)
    corrupt(run, 0, "target", "hidden_fp", _bump0)  # the same wrong row on every rank
    return run, {"hidden_restored"}, (0, 0, "target", "hidden_fp")


def case_hidden_not_chained(_):
    run = clean_run(2)
    corrupt(run, 0, "draft_1", "hidden_in_fp", _bump0)
    return run, {"hidden_handoffs"}, (0, 0, "draft_1", "hidden_in_fp")


def case_target_outputs_fork(_):
    run = clean_run(2)
    corrupt(run, 0, "target", "hidden_fp", _bump0, ranks=[1])
    return run, {"target_outputs_agree", "hidden_restored"}, (0, 1, "target", "hidden_fp")


def case_verify_not_greedy(_):
    run = clean_run(2)
    # a request that samples without drafts (a prefill's last chunk): its sampled token is no
    # longer the target's argmax
    def plain(s):
        v = run.views(s, 0, "verify")
        rows = np.flatnonzero((v["num_sampled"] > 0) & (v["num_draft_tokens"] == 0))
        return None if rows.size == 0 else int(rows[0])
    step = next(s for s in run.step_ids if plain(s) is not None)
    i = plain(step)
    at = int((run.views(step, 0, "verify")["num_draft_tokens"][:i] + 1).sum())

    def bump(a):
        a[at] += 100
        return a
    corrupt(run, step, "target", "top1_token", bump)
    return run, {"verify_greedy"}, (step, 0, "verify", "sampled_token_ids")


def case_bogus_query_start_loc(_):
    run = clean_run(2)
    corrupt(run, 2, "target", "query_start_loc", lambda a: a[::-1].copy())
    return run, {"views_in_bounds"}, (2, 0, "target", "query_start_loc")


def case_huge_positions(_):
    run = clean_run(2)
    corrupt(run, 1, "target", "positions", lambda a: np.where(np.arange(a.size) == 0, 2**62, a))
    return run, {"views_in_bounds"}, (1, 0, "target", "positions")


def case_forward_consumed_shifted(_):
    """The first draft forward was handed positions + 1 (the plugin's fwd_* views beside the prepared
    ones; tests/vllm/test_recording_ring.py plants it in vLLM's classes)."""
    run = clean_run(2)
    for step in run.step_ids:
        for rank in range(2):
            d0 = run.views(step, rank, "draft_0")
            d0["fwd_source"] = np.array("model_call")
            d0["fwd_positions"] = np.asarray(d0["draft_positions"]).copy()
    s = run.step_ids[1]
    run.views(s, 0, "draft_0")["fwd_positions"] = run.views(s, 0, "draft_0")["fwd_positions"] + 1
    return run, {"forward_consumed_prepared"}, (s, 0, "draft_0", "fwd_positions")


def case_graph_input_moved(_):
    """A replay handed a buffer at another address than its graph's capture (the graph-replay
    ledger's line, as the plugin writes it; tests/test_graph_ledger.py makes it for real)."""
    run = clean_run(2)
    for step in run.step_ids:
        for rank in range(2):
            run.views(step, rank, "target")["graph_replays"] = np.array(3, dtype=np.int64)
    s = run.step_ids[2]
    run.views(s, 1, "target")["graph_inputs_moved"] = np.array(
        ["graph PIECEWISE#0 num_tokens=16 (target): input 0 int32[16] handed at 0x7f01, captured at 0x7f00 int32[16]"])
    return run, {"graph_inputs_are_captured"}, (s, 1, "target", "graph_inputs_moved")


def case_collective_only_one_rank_ran(_):
    """Rank 1 ran one all-gather fewer in a draft_0 than rank 0 (the CPU replay records the
    ``collectives`` view from vLLM's own calls; tests/vllm/test_collectives_recorded.py makes it for
    real). The check compares the ranks at rank 0."""
    run = clean_run(2)
    lines = {"target": ["all_gather pcp float32[8, 512] dim=0", "all_gather pcp float32[8, 256] dim=0"],
             "draft_0": ["all_gather pcp float32[8, 512] dim=0", "all_gather pcp float32[8, 256] dim=0"]}
    for step in run.step_ids:
        for rank in range(2):
            for phase, views in run.phases(step, rank).items():
                views["collectives"] = np.array(lines.get(phase, []), dtype=str)
    s = run.step_ids[2]
    run.views(s, 1, "draft_0")["collectives"] = np.array(lines["draft_0"][:1], dtype=str)
    return run, {"collectives_match_vllm"}, (s, 0, "draft_0", "collectives")


def case_is_prefilling(_):
    run = clean_run(2)
    s = first_step(run, lambda ph: ph["target"]["is_prefilling"].any())
    corrupt(run, s, "target", "is_prefilling", lambda a: np.zeros_like(a))
    return run, {"is_prefilling_rule", "layout_matches_plan", "kv_write_mask_canonical"}, \
        (s, 0, "target", "is_prefilling")


def case_partial_chunk_samples(_):
    """A partial prefill chunk (seq_len < prefill_len) that samples: what vLLM's kernel zeroes."""
    run = clean_run(2)
    s = first_step(run, lambda ph: (ph["target"]["seq_lens"] < ph["target"]["prefill_len"]).any())
    t = run.views(s, 0, "target")
    i = int(np.argmax(t["seq_lens"] < t["prefill_len"]))
    ids = run.views(s, 0, "target")["input_ids"]
    tok = int(ids[int(t["query_start_loc"][i + 1]) - 1])

    def sample(a):
        a[i] = 1
        return a

    def token(a):
        a[i, 0] = tok
        return a
    corrupt(run, s, "verify", "num_sampled", sample)
    corrupt(run, s, "verify", "sampled_token_ids", token)
    # the draft prefill and the next step then disagree with the sampled token too
    return run, {"must_sample_rule", "draft_input_ids", "drafts_fed_back", "verify_greedy"}, \
        (s, 0, "verify", "num_sampled")


def case_completed_prompt_not_sampled(_):
    """The chunk that completes a prompt samples nothing (the must-sample rule off by one)."""
    run = clean_run(2)

    def done(ph):
        t, v = ph["target"], ph["verify"]
        return (t["is_prefilling"] & (t["seq_lens"] >= t["prefill_len"]) & (v["num_sampled"] > 0)).any()
    s = first_step(run, done)
    t, v = run.views(s, 0, "target"), run.views(s, 0, "verify")
    i = int(np.argmax(t["is_prefilling"] & (t["seq_lens"] >= t["prefill_len"]) & (v["num_sampled"] > 0)))

    def none(a):
        a[i] = 0
        return a

    def unsampled(a):
        a[i] = -1
        return a
    corrupt(run, s, "verify", "num_sampled", none)
    corrupt(run, s, "verify", "sampled_token_ids", unsampled)
    # every other check takes num_sampled == 0 as given: only the derived rule sees it
    return run, {"must_sample_rule"}, (s, 0, "verify", "num_sampled")


def case_cursor_keeps_a_rejected_draft(_):
    """The GPU cursor after a rejection keeps one rejected draft (num_computed_after one too far):
    the next step's positions would start one too late; the derived rule fails at this verify."""
    run = clean_run(2)
    s = first_step(run, lambda ph: (ph["verify"]["num_rejected"] >= 1).any())
    i = int(np.argmax(run.views(s, 0, "verify")["num_rejected"] >= 1))

    def ahead(a):
        a[i] += 1
        return a
    corrupt(run, s, "verify", "num_computed_after", ahead)
    return run, {"cursor_rolls_back_rejections"}, (s, 0, "verify", "num_computed_after")


def case_one_draft_too_few_accepted(_):
    """One accepted draft counted as rejected, its token sampled as the correction: every count
    stays consistent (verify_consistent passes); only the tokens show the draft was accepted."""
    run = clean_run(2)
    s = first_step(run, lambda ph: (ph["verify"]["num_accepted"] >= 1).any())
    v = run.views(s, 0, "verify")
    i = int(np.argmax(v["num_accepted"] >= 1))
    a = int(v["num_accepted"][i])

    def fewer(x):
        x[i] -= 1
        return x

    def more(x):
        x[i] += 1
        return x

    def drop(x):
        x[i, a] = -1
        return x
    corrupt(run, s, "verify", "num_accepted", fewer)
    corrupt(run, s, "verify", "num_rejected", more)
    corrupt(run, s, "verify", "num_sampled", fewer)
    corrupt(run, s, "verify", "sampled_token_ids", drop)
    corrupt(run, s, "verify", "num_computed_after", fewer)  # post_update rolls back the extra rejection
    return run, {"num_accepted_from_tokens", "verify_greedy", "drafts_fed_back", "positions_consistent",
                 "draft_last_token_indices"}, \
        (s, 0, "verify", "num_accepted")


def _dcp_step(run):
    return next(s for s in run.step_ids if "draft_1" in run.phases(s, 0))


def case_dcp_foreign_token(_):
    """Rank 0 (DCP rank 0's share, the synthetic producer's dcp_rank) writes a token another DCP
    rank owns."""
    run = clean_run(2, dcp=2)
    s = _dcp_step(run)
    slots = run.views(s, 0, "target")["slot_mapping_global"]
    j = int(np.flatnonzero(slots[0] < 0)[0])
    slots[0, j] = int(slots.max()) + 1
    return run, {"dcp_kv_sharding", "global_slots_match_block_table", "gathered_slots_are_global",
                 "kv_written_once"}, (s, 0, "target", "slot_mapping_global")


def case_dcp_draft_local_len(_):
    """draft_1's per-rank local_len one too long (vllm#50391's formula broken)."""
    run = clean_run(2, dcp=2)
    s = _dcp_step(run)
    run.views(s, 0, "draft_1")["dcp_local_seq_lens"] += 1
    return run, {"dcp_local_lens"}, (s, 0, "draft_1", "dcp_local_seq_lens")


def case_dcp_not_combined(_):
    """The shipped engine DCP trace with one phase combining a single rank's partial attention."""
    run = run_of_trace(ROOT / "data" / "traces" / "cpu-pcp2-dcp2-mtp2")
    s = run.step_ids[1]
    run.views(s, 1, "draft_1")["dcp_ranks_combined"] = np.array(1, dtype=np.int64)
    return run, {"dcp_partial_combined"}, (s, 1, "draft_1", "dcp_ranks_combined")


CASES = {
    "views_in_bounds": [case_bogus_query_start_loc, case_huge_positions],
    "layout_matches_plan": [case_layout],
    "restore_gather_identity": [case_restore],
    "kv_written_once": [case_kv_once],
    "gathered_slots_are_global": [case_gathered],
    "global_slots_match_block_table": [case_global_slots, case_null_block],
    "kv_write_mask_canonical": [case_write_mask],
    "local_batch_matches_layout": [case_local_batch],
    "local_positions_are_global": [case_local_positions, case_local_positions_cpu],
    "local_seq_lens": [case_local_seq_lens],
    "local_logits_not_sampled": [case_local_logits],
    "draft_prefill_rank_local": [case_draft_prefill],
    "draft_last_token_indices": [case_last_token],
    "draft_input_ids": [case_draft_inputs],
    "draft_decode_replicated": [case_draft_decode_expanded, case_draft_decode_folded],
    "draft_block_tables_global": [case_draft_block_tables],
    "draft_positions_advance": [case_draft_positions],
    "verify_consistent": [case_verify],
    "drafts_fed_back": [case_fed_back],
    "ranks_agree": [case_ranks_agree, case_rank_missing_step],
    "positions_consistent": [case_positions, case_cpu_cursor_bound],
    "hidden_restored": [case_hidden_restored],
    "hidden_handoffs": [case_hidden_not_chained],
    "target_outputs_agree": [case_target_outputs_fork],
    "verify_greedy": [case_verify_not_greedy],
    "is_prefilling_rule": [case_is_prefilling],
    "must_sample_rule": [case_partial_chunk_samples, case_completed_prompt_not_sampled],
    "cursor_rolls_back_rejections": [case_cursor_keeps_a_rejected_draft],
    "num_accepted_from_tokens": [case_one_draft_too_few_accepted],
    "graph_inputs_are_captured": [case_graph_input_moved],
    "forward_consumed_prepared": [case_forward_consumed_shifted],
    "dcp_kv_sharding": [case_dcp_foreign_token],
    "dcp_local_lens": [case_dcp_draft_local_len],
    "dcp_partial_combined": [case_dcp_not_combined],
    "collectives_match_vllm": [case_collective_only_one_rank_ran],
}


def test_every_check_has_a_targeted_fault():
    assert set(CASES) == set(CHECKS)


@pytest.mark.parametrize("name,case", [pytest.param(n, c, id=c.__name__[5:])
                                       for n, cs in CASES.items() for c in cs])
def test_fault_fails_its_check_at_the_right_place(tmp_path, name, case):
    run, failing, (step, rank, phase, view) = case(tmp_path)
    report = check(run, tmp_path)
    assert set(report.failed) == failing, report.format()
    res = report[name]
    assert res.verdict == FAIL and res.failed >= 1
    v = res.first_violation
    assert (v.check, v.step, v.rank, v.phase, v.view) == (name, step, rank, phase, view), v
    assert v.message
    if case is case_null_block:
        assert "null block" in v.message and v.index == (0, 0)
        assert "null block" in report["draft_decode_replicated"].first_violation.message
    assert not report.ok
    # the text report shows the failure and where
    text = report.format()
    assert f"FAIL  {name}" in text and f"step {step}" in text


def test_generator_faults_are_all_exercised():
    """Every fault the synthetic producer declares is injected by a case above."""
    src = Path(__file__).read_text()
    used = {name for name in F.FAULTS if f"faults=[F.{name.upper()}]" in src}
    assert used == set(F.faults_of(F.SYNTHETIC))


# --------------------------------------------------------------------------- skips, malformed input

def test_missing_view_is_skipped_and_said_so(tmp_path):
    run = clean_run(2)
    for step in run.step_ids:
        for rank in range(2):
            del run.views(step, rank, "target")["sampled_logits_rows"]
            del run.views(step, rank, "target")["sampled_from"]
    report = check(run, tmp_path)
    assert report.ok
    res = report["local_logits_not_sampled"]
    assert res.verdict == SKIPPED and res.evaluated == 0
    assert res.skipped == 2 * len(run.step_ids)
    assert res.skip_reason == "step 0 rank 0: no sampled_logits_rows"
    text = report.format()
    assert "SKIP  local_logits_not_sampled" in text and "ran on 0 of" in text and "7 skipped" in text  # + DCP_CHECKS
    assert report.to_dict()["checks"]["local_logits_not_sampled"]["verdict"] == "skipped"


def test_phase_missing_on_some_steps_is_a_partial_skip(tmp_path):
    run = clean_run(2)
    for rank in range(2):
        del run.phases(0, rank)["verify"]
    report = check(run, tmp_path)
    res = report["verify_consistent"]
    assert res.verdict == PASS and res.skipped == 2
    assert res.skip_reason == "step 0 rank 0: no verify phase"
    assert "skipped 2 (step 0 rank 0: no verify phase)" in report.format()
    # the summary's counts agree with the per-check lines: a skipped (step, rank) is not a skipped check
    last = report.format().splitlines()[-1]
    assert " 6 skipped;" in last  # graph_inputs_are_captured (no CUDA graphs), forward_consumed_prepared,
    # collectives_match_vllm (no collectives view), DCP_CHECKS
    partial = [r for r in report.results.values() if r.verdict == PASS and r.skipped]
    plural = "s" * (len(partial) > 1)
    pairs = sum(r.skipped for r in partial)
    assert f"; {len(partial)} passing check{plural} did not run on {pairs} (step, rank)" in last


def test_malformed_view_fails_instead_of_crashing(tmp_path):
    run = clean_run(2)
    corrupt(run, 1, "target", "padded_gather_idx", lambda a: a[:-3])
    report = check(run, tmp_path)
    assert "layout_matches_plan" in report.failed
    v = report["layout_matches_plan"].first_violation
    assert (v.step, v.view) == (1, "padded_gather_idx") and "multiple of pcp=2" in v.message


def test_report_json_round_trip(tmp_path):
    run = clean_run(2, faults=[F.SKIP_DRAFT_BLOCK_TABLE_GATHER])
    report = check(run, tmp_path)
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["ok"] is False and doc["summary"]["failed"] == 1
    fv = doc["checks"]["draft_block_tables_global"]["first_violation"]
    assert fv["step"] == 0 and fv["phase"] == "draft_1" and fv["index"] == [0, 0, 0]
    assert fv["expected"].startswith("[0, 0][0:") and "*0" in fv["actual"]
    assert report.first_violation.check == "draft_block_tables_global"


def test_first_difference_and_short_repr():
    assert first_difference([1, 2, 3], [1, 2, 3]) == (False, None, "")
    assert first_difference([1, 2, 3], [1, 5, 3])[:2] == (True, (1,))
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 9]])[1] == (1, 1)
    assert first_difference([1, 2], [1, 2, 3])[2] == "shape [3], expected [2]"
    assert short_repr(np.arange(100), (50,)) == "[46:55]=[46, 47, 48, 49, *50, 51, 52, 53, 54]"
    assert short_repr(np.array("global")) == "'global'"


# --------------------------------------------------------------------------- CLI

def pcpviz(*args):
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_cli_check_exit_codes(tmp_path):
    good = clean_run(2).write(tmp_path / "good")
    bad = clean_run(2, faults=[F.GLOBAL_POSITIONS_FROM_CPU_CURSOR]).write(tmp_path / "bad")
    r = pcpviz("check", str(good))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result: OK" in r.stdout
    r = pcpviz("check", str(bad))
    assert r.returncode == 1
    assert "FAIL  positions_consistent" in r.stdout
    r = pcpviz("check", str(bad), "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["checks"]["positions_consistent"]["verdict"] == "fail"
    for args in ([str(tmp_path / "nope")], [str(tmp_path)]):  # missing dir; dir without run.json
        r = pcpviz("check", *args)
        assert r.returncode == 2
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("pcpviz check: ")


def test_cli_check_empty_trace_is_bad_input(tmp_path):
    from pcpviz.trace import TraceWriter, write_run_meta

    for r in (0, 1):  # the writers opened and closed their files without one step: nothing lost
        TraceWriter(tmp_path / "empty", r, meta={"producer": "pcpviz-engine", "pcp": 2, "block_size": 16}
                    if r == 0 else None).close()
    r = pcpviz("check", str(tmp_path / "empty"))
    assert r.returncode == 2 and "no complete steps" in r.stderr
    write_run_meta(tmp_path / "invalid", {"producer": "pcpviz-engine", "pcp": 2})  # no block_size
    r = pcpviz("check", str(tmp_path / "invalid"))
    assert r.returncode == 2 and "block_size: required key is missing" in r.stderr


def test_cli_check_truncated_rank_file_checks_what_is_complete(tmp_path):
    path = clean_run(2).write(tmp_path / "t")
    f = path / "rank1.arrow"
    f.write_bytes(f.read_bytes()[:-40])  # a writer killed inside its last step
    r = pcpviz("check", str(path))
    # the checks run on what is complete, but lost data is its own failure (exit 3), never OK
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(ln.startswith("pcpviz check: incomplete: ") for ln in lines), lines
    assert "rank1.arrow" in lines[0] and "last complete step" in lines[0]
    assert any("rank 1 lacks steps" in ln for ln in lines)
    # all but the graph ledger's, forward_consumed_prepared (no fwd_* views) and the DCP checks (DCP = 1)
    n_skip = 3 + len(DCP_CHECKS)  # graphs, fwd_* and collectives: views the synthetic producer does not record
    assert f"result: INCOMPLETE: {len(CHECKS)} checks: {len(CHECKS) - n_skip} passed, {n_skip} skipped" in r.stdout


def test_run_checks_takes_one_name_or_a_list_and_refuses_unknown_names():
    trace = sorted(Path(__file__).resolve().parents[2].glob("data/traces/*/run.json"))[0].parent
    one = run_checks(trace, checks="positions_consistent")
    assert list(one.results) == ["positions_consistent"]  # the name, not its letters
    assert list(run_checks(trace, checks=["positions_consistent"]).results) == ["positions_consistent"]
    with pytest.raises(ValueError, match=r"^unknown check 'position'; known: "):
        run_checks(trace, checks="position")


@pytest.mark.parametrize("value, shown", [(np.nan, "nan"), (1.5, "1.5")])
def test_an_integer_view_stored_as_non_integers_is_reported_not_cast(tmp_path, value, shown):
    """A producer that wrote num_accepted as floats holding NaN or 1.5: the checks that read it
    say they could not evaluate it, naming the view and value (no silent cast to garbage
    integers, no RuntimeWarning); whole-number floats read as the integers they are."""
    run = clean_run(2)
    step = first_step(run, lambda ph: "verify" in ph)
    whole = clean_run(2)
    corrupt(whole, step, "verify", "num_accepted", lambda a: a.astype(float))
    assert run_checks(whole.write(tmp_path / "whole")).ok
    corrupt(run, step, "verify", "num_accepted", lambda a: np.where(np.arange(a.size) == 0, value, a.astype(float)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = run_checks(run.write(tmp_path / "bad"))
    res = report.results["verify_consistent"]
    assert res.verdict == FAIL and res.first_violation.step == step
    assert f"verify.num_accepted holds {shown}, not an integer" in res.first_violation.message


@pytest.mark.parametrize("meta, applies", [
    ({}, True),
    ({"launch": {"llm_kwargs": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}}}, True),
    ({"launch": {"llm_kwargs": {"speculative_config": {"rejection_sample_method": "synthetic",
                                                        "synthetic_acceptance_length": 2.0}}}}, False),
    ({"speculative_config": {"rejection_sample_method": "block"}}, False),
    ({"stand_ins": {"rejection_sampler": "scripted per scenario"}}, False),  # the CPU replay's scripted acceptance
])
def test_num_accepted_from_tokens_applies_to_vllms_standard_rejection_only(meta, applies):
    assert decode_meta(meta)[0].standard_rejection is applies
