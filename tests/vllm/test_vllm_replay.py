"""The CPU replay drives vLLM 0.33.0's own PCP + MTP classes (ranks as threads) and records a
trace through pcpviz.vllm.recording; the trace must pass pcpviz.analysis.checks and show what the
docs/vllm-0.33-pcp-mtp.md says the real code does.

Nothing is skipped: a missing or wrong vLLM fails loudly.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

import pcpviz.vllm  # noqa: E402
from pcpviz.analysis.checks import CHECKS, DCP_CHECKS, run_checks  # noqa: E402
from pcpviz.trace import open as open_trace  # noqa: E402
from pcpviz.vllm import recording  # noqa: E402
from pcpviz.vllm import replay as replay_module  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402

# The views the engine records (pcpviz/engine/record.py) that vLLM has; the replay records
# the same names (the engine's digests top1_token / hidden_hash have no vLLM counterpart).
TARGET_VIEWS = {
    "req_ids", "idx_mapping", "num_scheduled_tokens", "num_computed_tokens", "query_start_loc", "positions",
    "input_ids", "seq_lens", "is_prefilling", "prefill_len", "logits_indices", "segments", "per_rank_num_tokens",
    "padded_gather_idx", "hidden_restore_idx", "kv_write_mask", "local_req_ids", "local_idx_mapping",
    "local_input_ids", "local_positions", "local_query_start_loc", "local_seq_lens", "local_logits_indices",
    "local_is_padding", "local_is_prefilling", "local_num_computed_tokens", "block_table_global",
    "block_table_local", "slot_mapping_global", "slot_mapping_gathered", "sampled_logits_rows", "sampled_from",
    "t_start_us", "t_end_us",
}
VERIFY_VIEWS = {"req_ids", "num_draft_tokens", "sampled_token_ids", "num_sampled", "num_rejected", "num_accepted",
                "t_start_us", "t_end_us"}
DRAFT0_VIEWS = {"view", "draft_input_ids", "draft_positions", "draft_seq_lens", "block_table_draft",
                "slot_mapping_draft", "draft_last_token_indices", "draft_tokens", "draft_global_input_ids",
                "t_start_us", "t_end_us"}
DRAFTK_VIEWS = {"view", "draft_input_ids", "draft_positions", "draft_seq_lens", "block_table_draft",
                "slot_mapping_draft", "draft_tokens", "t_start_us", "t_end_us"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return replay(pcp=2, mtp=2, trace_dir=tmp_path_factory.mktemp("mixed") / "run", scenario="mixed")


@pytest.fixture(scope="module")
def mixed_off():
    return replay(pcp=2, mtp=2, scenario="mixed", record=False)


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory):
    return replay(pcp=2, mtp=2, trace_dir=tmp_path_factory.mktemp("dec") / "run", scenario="decode_only")


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    return replay(pcp=2, mtp=2, trace_dir=tmp_path_factory.mktemp("dspark") / "run", scenario="dspark")


def _assert_checks_pass(trace, allowed_failures=()):
    report = run_checks(trace)
    failed = [n for n in report.failed if n not in allowed_failures]
    assert not failed, report.format()
    return report


# --------------------------------------------------------------------------- the mixed scenario


def test_mixed_trace_passes_every_check(mixed):
    report = _assert_checks_pass(mixed.trace)
    # The plugin does not record top1_token (the engine does), and there are no CUDA graphs on CPU
    # (the graph-replay ledger): the checks that need them skip, naming the view. Every other
    # check ran on some step, the hand-off checks on the plugin's fingerprints of vLLM's own
    # hidden states; the (step, rank) pairs skipped are only the dummy step (no target/draft/verify
    # phase) and the first step (no previous step).
    engine_only = {"verify_greedy"}
    no_graphs = {"graph_inputs_are_captured"} | DCP_CHECKS  # and DCP = 1
    assert set(report.skipped) == engine_only | no_graphs
    assert "top1_token" in (report.results["verify_greedy"].skip_reason or "")
    assert set(report.passed) == set(CHECKS) - engine_only - no_graphs
    for result in report.results.values():
        if result.name in engine_only | no_graphs:
            continue
        assert result.skip_reason is None or ("step 5" in result.skip_reason or "no previous step" in
                                              result.skip_reason), (result.name, result.skip_reason)


def test_the_plugin_fingerprints_vllms_hidden_states_at_every_hand_off(mixed):
    """Per (step, rank) the fingerprint views the hand-off checks read, one per row, distinct rows
    fingerprinting differently (the stand-in models' hidden states depend on their inputs)."""
    t = mixed.trace
    step = next(s for s in t.steps if t.has(s, 0, "draft_1"))
    for rank in t.ranks:
        target, d0, d1 = (t.record(step, rank, ph) for ph in ("target", "draft_0", "draft_1"))
        r = len(target["req_ids"])
        assert d0["hidden_in_fp"].shape == target["hidden_local_fp"].shape == d0["mtp_local_fp"].shape
        assert target["hidden_fp"].shape == (int(np.asarray(target["num_scheduled_tokens"]).sum()),)
        assert d0["hidden_out_fp"].shape == d0["hidden_last_fp"].shape == d1["hidden_in_fp"].shape == (r,)
        assert np.array_equal(d0["hidden_out_fp"], d1["hidden_in_fp"])
        assert len(set(target["hidden_fp"].tolist())) > 1


@pytest.mark.slow
def test_a_broken_hidden_state_restore_in_vllm_fails_the_hand_off_check(tmp_path, monkeypatch):
    """vLLM's draft prefill restore made to put the rows back one off (a wrong restore index):
    the run still completes, and hidden_restored names draft_0's hidden_last_fp."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    own = PCPManager.restore_draft_prefill

    def shifted(self, last_hidden_states, hidden_states):
        last, hidden = own(self, last_hidden_states, hidden_states)
        return last.roll(1, dims=0), hidden.roll(1, dims=0)

    monkeypatch.setattr(PCPManager, "restore_draft_prefill", shifted)
    res = replay(pcp=2, mtp=2, trace_dir=tmp_path / "run", scenario="mixed")
    report = run_checks(res.trace)
    assert "hidden_restored" in report.failed, report.format()
    v = report.results["hidden_restored"].first_violation
    assert (v.phase, v.view) == ("draft_0", "hidden_last_fp"), v


def test_mixed_trace_meta_declares_the_stand_ins(mixed):
    meta = mixed.trace.meta
    assert meta["producer"] == "vllm-replay"
    assert meta["vllm_version"] == "0.33.0"
    assert (meta["pcp"], meta["dcp"], meta["num_speculative_tokens"], meta["block_size"]) == (2, 1, 2, 4)
    assert meta["shard_decode_requests"] is True
    # the target and MTP compute with the tiny checkpoint (issue 37 item 4); the rest stays declared
    assert meta["models"].startswith("real weights: ") and meta["replay_models"] == "tiny"
    assert {"target_model", "mtp_model", "rejection_sampler", "scheduler"} <= set(meta["stand_ins"])


def test_mixed_trace_records_the_engines_view_names_per_rank_and_step(mixed):
    t = mixed.trace
    assert t.ranks == [0, 1]
    assert list(t.steps) == list(range(6))
    for step in range(5):
        for rank in t.ranks:
            assert t.phases(step, rank) == ["target", "draft_0", "draft_1", "verify"]
            assert TARGET_VIEWS <= set(t.record(step, rank, "target").keys())
            assert VERIFY_VIEWS <= set(t.record(step, rank, "verify").keys())
            assert DRAFT0_VIEWS <= set(t.record(step, rank, "draft_0").keys())
            assert DRAFTK_VIEWS <= set(t.record(step, rank, "draft_1").keys())
    assert t.phases(5, 0) == ["dummy"]


@pytest.mark.slow
def test_replay_views_are_declared_in_the_schema(mixed, decode_only, dspark):
    from pcpviz.trace.validate import undeclared_views

    for run in (mixed, decode_only, dspark):
        assert undeclared_views(run.trace) == [], run.scenario
    assert "dummy" in mixed.trace.phases(5, 0)  # the dummy run's views are held to it too


def test_mixed_covers_fresh_chunked_decodes_drafts_and_rejections(mixed):
    t = mixed.trace
    kinds = set()
    for step in range(5):
        tg, v = t.record(step, 0, "target"), t.record(step, 0, "verify")
        pf, nc, q = tg["is_prefilling"], tg["num_computed_tokens"], tg["num_scheduled_tokens"]
        kinds |= {"fresh prefill"} if (pf & (nc == 0)).any() else set()
        kinds |= {"continued chunked prefill"} if (pf & (nc > 0)).any() else set()
        kinds |= {"chunk not finishing"} if (v["num_sampled"] == 0).any() else set()
        kinds |= {"decode with drafts"} if (~pf & (q == 3)).any() else set()
        kinds |= {"all drafts rejected"} if ((v["num_rejected"] == 2)).any() else set()
        kinds |= {"partly rejected"} if ((v["num_rejected"] == 1)).any() else set()
        kinds |= {"all accepted"} if ((v["num_draft_tokens"] == 2) & (v["num_accepted"] == 2)).any() else set()
    assert kinds == {"fresh prefill", "continued chunked prefill", "chunk not finishing", "decode with drafts",
                     "all drafts rejected", "partly rejected", "all accepted"}


def test_cpu_cursor_runs_ahead_and_positions_follow_the_gpu_cursor(mixed):
    """Async scheduling: after a rejection the CPU cursor (num_computed_tokens) is ahead of the
    GPU positions; partition_batch takes the local positions from the global (GPU) ones."""
    t = mixed.trace
    ahead = 0
    for step in range(1, 5):
        tg = t.record(step, 0, "target")
        first = tg["positions"][tg["query_start_loc"][:-1]]
        ahead += int((tg["num_computed_tokens"] > first).sum())
        for rank in t.ranks:
            r = t.record(step, rank, "target")
            n = int(r["per_rank_num_tokens"][rank])
            p = r["local_positions"].shape[0]
            rows = r["padded_gather_idx"][rank * p: rank * p + n]
            assert np.array_equal(r["local_positions"][:n], r["positions"][rows])
    assert ahead > 0


def test_draft_prefill_is_rank_local_then_decodes_replicated(mixed):
    t = mixed.trace
    for step in range(5):
        for rank in t.ranks:
            tg, d0, d1 = (t.record(step, rank, ph) for ph in ("target", "draft_0", "draft_1"))
            r = tg["num_scheduled_tokens"].shape[0]
            assert str(d0["view"]) == "rank_local" and str(d1["view"]) == "replicated"
            # draft_0 reuses the target's gathered (expanded, [G, N*P]) slot mapping ...
            assert np.array_equal(d0["slot_mapping_draft"], tg["slot_mapping_gathered"])
            assert d0["slot_mapping_draft"].shape[-1] == 2 * tg["local_positions"].shape[0]
            # ... draft_1 an unexpanded one (length R) over block tables gathered to global order
            assert d1["slot_mapping_draft"].shape == (1, r)
            assert np.array_equal(d1["block_table_draft"], tg["block_table_global"])
            assert np.array_equal(d1["draft_positions"], tg["positions"][d0["draft_last_token_indices"]] + 1)


def test_dummy_run_makes_no_block_table_gather_and_no_collective(mixed):
    t = mixed.trace
    for rank in t.ranks:
        d = t.record(5, rank, "dummy")
        assert int(d["block_table_gathers"]) == 0
        assert int(d["all_gathers"]) == 0
        assert int(d["pcp_hidden_all_gathers"]) == 0
        assert int(d["draft_forwards"]) == 2  # draft prefill + one draft decode, both eager
    for d in mixed.dummy:
        assert d["all_gathers"] == 0 and d["input_block_tables_unchanged"] and d["idx_mapping_all_pad"]
        assert d["draft_prefill_batch_none"]
    # while a real step does gather: one block-table gather per propose with K > 1
    assert mixed.all_gathers[0] > 0


def _expected_kv(trace, rank, writes):
    """slot -> (token, position) of the last write, from recorded views."""
    exp = {}
    for step in trace.steps:
        for slots, ids, pos in writes(trace, step, rank):
            for s, i, p in zip(np.asarray(slots).ravel(), np.asarray(ids).ravel(), np.asarray(pos).ravel()):
                if s >= 0:
                    exp[int(s)] = (float(i), float(p))
    return exp


def _target_writes(trace, step, rank):
    if "target" in trace.phases(step, rank):
        tg = trace.record(step, rank, "target")
        yield tg["slot_mapping_global"][0], tg["input_ids"], tg["positions"]


def _draft_writes(trace, step, rank):
    phases = trace.phases(step, rank)
    if "draft_0" in phases:
        tg, d0 = trace.record(step, rank, "target"), trace.record(step, rank, "draft_0")
        yield tg["slot_mapping_global"][0], d0["draft_global_input_ids"], tg["positions"]
    for ph in phases:
        if ph.startswith("draft_") and ph != "draft_0":
            d = trace.record(step, rank, ph)
            yield d["slot_mapping_draft"][0], d["draft_input_ids"], d["draft_positions"]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["mixed", "decode_only"])
def test_kv_caches_are_identical_replicas_holding_each_token_once(fixture, request):
    """The stand-in models write [token, position] through vLLM's PCP KV gather: every rank
    ends with the same full replica, and each slot holds what the trace says was written there."""
    res = request.getfixturevalue(fixture)
    t = res.trace
    for cache, writes in ((res.kv_target, _target_writes), (res.kv_draft, _draft_writes)):
        for rank in t.ranks:
            assert np.array_equal(cache[rank], cache[0])
        exp = _expected_kv(t, 0, writes)
        assert exp, "nothing was written"
        slots = np.array(sorted(exp))
        assert np.array_equal(cache[0][slots], np.array([exp[s] for s in slots]))
        untouched = np.setdiff1d(np.arange(cache[0].shape[0]), slots)
        assert (cache[0][untouched] == -1).all()


@pytest.mark.slow
def test_recording_does_not_change_results(mixed, mixed_off):
    assert mixed.manager_class is recording.RecordingPCPManager
    assert mixed_off.manager_class is not recording.RecordingPCPManager and mixed_off.trace_path is None
    assert len(mixed.steps) == len(mixed_off.steps) == 5
    for on, off in zip(mixed.steps, mixed_off.steps):
        for a, b in zip(on, off):
            assert np.array_equal(a.draft_tokens, b.draft_tokens)
            assert np.array_equal(a.slot_mapping_gathered, b.slot_mapping_gathered)
            assert np.array_equal(a.sampled, b.sampled)
    for a, b in zip(mixed.kv_target + mixed.kv_draft, mixed_off.kv_target + mixed_off.kv_draft):
        assert np.array_equal(a, b)
    assert mixed.all_gathers == mixed_off.all_gathers


def test_recorded_draft_tokens_are_what_propose_returned(mixed):
    t = mixed.trace
    for step, outs in enumerate(mixed.steps):
        for rank, out in enumerate(outs):
            for k in range(2):
                assert np.array_equal(t.record(step, rank, f"draft_{k}")["draft_tokens"], out.draft_tokens[:, k])


# --------------------------------------------------------------------------- other scenarios


@pytest.mark.slow
def test_decode_only_passes_checks_and_reaches_an_empty_rank(decode_only):
    t = decode_only.trace
    _assert_checks_pass(t)
    last = t.steps[-2]  # the dummy run is the last step
    tg = t.record(last, 1, "target")
    assert not tg["is_prefilling"].any()
    assert int(tg["per_rank_num_tokens"][1]) == 0  # one decode left, two ranks: rank 1 runs vLLM's placeholder
    assert tg["local_query_start_loc"].tolist() == [0, 0]
    for step in range(1, last + 1):
        assert not t.record(step, 0, "target")["is_prefilling"].any()


@pytest.mark.slow
def test_replicated_decodes_are_written_by_rank_zero_only(tmp_path):
    res = replay(pcp=2, mtp=1, trace_dir=tmp_path / "rep", scenario="decode_only", decodes="replicated", dummy=False)
    t = res.trace
    _assert_checks_pass(t)
    assert t.meta["shard_decode_requests"] is False
    tg = t.record(2, 1, "target")
    p = tg["local_positions"].shape[0]
    n = int(tg["per_rank_num_tokens"][1])
    assert n == int(tg["num_scheduled_tokens"].sum())  # every decode on every rank
    assert not tg["kv_write_mask"][p:p + n].any() and tg["kv_write_mask"][:n].all()
    assert "draft_1" not in t.phases(2, 0)  # K = 1: no draft decode
    for rank in t.ranks:
        assert np.array_equal(res.kv_target[rank], res.kv_target[0])


@pytest.mark.slow
def test_pcp3_k3_mixed_passes_checks(tmp_path):
    res = replay(pcp=3, mtp=3, trace_dir=tmp_path / "p3", scenario="mixed", dummy=False)
    t = res.trace
    _assert_checks_pass(t)
    assert t.ranks == [0, 1, 2] and t.phases(4, 2) == ["target", "draft_0", "draft_1", "draft_2", "verify"]


@pytest.mark.slow
def test_dspark_runs_the_replicated_drafter_on_the_global_batch(dspark):
    t = dspark.trace
    assert t.meta["speculative_method"] == "dspark" and "DSparkSpeculator.__init__" in t.meta["dspark_status"]
    # DSpark's single draft forward is replicated by design (drafter PCP=1): every check passes,
    # and the MTP-only rank-local draft-prefill rule is skipped for it, saying why.
    report = _assert_checks_pass(t)
    assert report.failed == []
    assert "draft_prefill_rank_local" in report.skipped
    for step in range(4):
        for rank in t.ranks:
            tg, d0 = t.record(step, rank, "target"), t.record(step, rank, "draft_0")
            r = tg["num_scheduled_tokens"].shape[0]
            assert str(d0["view"]) == "replicated" and int(d0["block_table_gathers"]) == 1
            assert d0["slot_mapping_draft"].shape == (1, 2 * r)  # K query slots per request, unexpanded
            assert np.array_equal(d0["block_table_draft"], tg["block_table_global"])
            assert d0["draft_block_tokens"].shape == (r, 2)
            assert np.array_equal(d0["draft_tokens"], d0["draft_block_tokens"][:, 0])
            assert int(tg["num_aux_hidden_states_restored"]) == 1  # DSpark reads restored aux states
        assert np.array_equal(t.record(step, 0, "draft_0")["draft_block_tokens"],
                              t.record(step, 1, "draft_0")["draft_block_tokens"])
        assert np.array_equal(t.record(step, 0, "draft_0")["draft_block_tokens"], dspark.steps[step][0].draft_tokens)
    # Without the gather the drafter reads input_block_tables as the PCP target path left them:
    # zeros at the first step (every slot PAD), stale rows of the previous step later.
    d0 = t.record(0, 0, "draft_0")
    assert (d0["slot_mapping_draft_no_gather"] == -1).all() and (d0["slot_mapping_draft"] >= 0).all()
    later = t.record(2, 0, "draft_0")
    assert not np.array_equal(later["slot_mapping_draft_no_gather"], later["slot_mapping_draft"])
    for rank in t.ranks:
        assert np.array_equal(dspark.kv_draft[rank], dspark.kv_draft[0])
        assert (dspark.kv_draft[rank] >= 0).any()


# --------------------------------------------------------------------------- API and errors


@pytest.mark.parametrize("kwargs, message", [
    (dict(pcp=0), "pcp must be an int >= 1"),
    (dict(pcp=1, scenario="dspark"), "the dspark scenario needs pcp >= 2"),
    (dict(mtp=0), "mtp (num_speculative_tokens) must be an int in 1..4"),
    (dict(scenario="nope"), "unknown scenario 'nope'"),
    (dict(decodes="both"), "decodes must be 'sharded' or 'replicated'"),
    (dict(scenario="dspark", decodes="replicated"), "decodes are sharded"),
])
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError) as e:
        replay(**kwargs)
    assert message in str(e.value)


def test_an_existing_trace_is_not_overwritten(mixed):
    with pytest.raises(ValueError, match="already holds a trace"):
        replay(pcp=2, mtp=2, trace_dir=mixed.trace_path)


@pytest.mark.slow
def test_package_attribute_replay_is_callable(tmp_path):
    assert pcpviz.vllm.replay is replay_module and callable(pcpviz.vllm.replay)
    res = pcpviz.vllm.replay(pcp=2, mtp=1, trace_dir=tmp_path / "r", scenario="decode_only", dummy=False)
    assert open_trace(res.trace_path).meta["num_speculative_tokens"] == 1


@pytest.mark.slow
def test_cli_replay(tmp_path, capsys):
    from pcpviz.cli import main

    assert main(["replay", "--pcp", "2", "--mtp", "1", "--trace", str(tmp_path / "c"), "--scenario", "decode_only",
                 "--check", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "replayed 6 steps of 'decode_only' on 2 ranks" in out and "result: OK" in out
    assert main(["replay", "--pcp", "2", "--trace", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a trace" in err
    assert main(["replay", "--pcp", "9", "--trace", str(tmp_path / "d")]) == 2
    assert "use at most 8" in capsys.readouterr().err


@pytest.mark.slow
def test_recording_overhead_per_step(mixed, mixed_off, capsys):
    """The recording hooks' cost per step on the replay (printed; see the report). The hooks
    clone on the device and write the step once; they must stay a small part of a step."""
    on = float(np.median(mixed.step_seconds))
    off = float(np.median(mixed_off.step_seconds))
    hooks = mixed.recording_seconds / (len(mixed.step_seconds) * mixed.pcp)
    with capsys.disabled():
        print(f"\nreplay step: recording on {on * 1e3:.0f} ms, off {off * 1e3:.0f} ms (median of "
              f"{len(mixed.step_seconds)}); hooks {hooks * 1e3:.1f} ms per rank per step")
    assert hooks < 0.5 * off


@pytest.mark.slow
def test_importing_the_replay_leaves_the_process_environment_alone():
    """The CPU patches are scoped: after importing the replay and the oracle (and replaying),
    CUDA_VISIBLE_DEVICES and TRITON_INTERPRET are what they were (a notebook kernel that later
    launches vLLM on GPUs keeps them)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    code = ("import os\n"
            "from pcpviz.vllm import oracle, replay\n"
            "r = replay.replay(pcp=2, mtp=1, scenario='decode_only', record=False)\n"
            "print(len(r.steps), repr(os.environ.get('CUDA_VISIBLE_DEVICES')), "
            "repr(os.environ.get('TRITON_INTERPRET')))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps, cuda, interp = proc.stdout.split()[-3:]
    assert int(steps) > 0 and (cuda, interp) == ("'0,1'", "None")
