"""The plugin at PCP = 1 (issue 24 item 1): vLLM builds no PCPManager there, so the recording hooks
the model runner (``prepare_inputs``, ``prepare_attn``) and the speculator directly; the trace has
one rank and the same schema, and ``pcpviz diff`` / ``explain`` take it as GOOD for a PCP = N run
of the same prompts. Driven through vLLM 0.33.0's own classes on CPU (``pcpviz.vllm.replay``, the
same recording classes the plugin installs; stand-in models, see its docstring); the real-GPU
counterpart is ``tests/test_real_vllm_traces.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pcpviz.vllm.replay import replay

import pcpviz.trace as pt  # noqa: E402
from pcpviz.analysis.checks import DCP_CHECKS, run_checks  # noqa: E402
from pcpviz.analysis.diff import diff_traces  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# What a PCP=1 trace cannot have: the PCP layout, rank-local batch and the cross-rank checks.
PCP1_SKIPS = {"layout_matches_plan", "restore_gather_identity", "kv_written_once", "gathered_slots_are_global",
              "kv_write_mask_canonical", "local_batch_matches_layout", "local_positions_are_global",
              "local_seq_lens", "ranks_agree", "target_outputs_agree", "graph_inputs_are_captured"} | DCP_CHECKS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pcp1")
    return (replay(pcp=1, mtp=2, trace_dir=d / "pcp1", scenario="mixed"),
            replay(pcp=2, mtp=2, trace_dir=d / "pcp2", scenario="mixed"))


@pytest.mark.slow
def test_a_pcp1_run_records_one_rank_in_the_same_schema(runs):
    one, _ = runs
    t = one.trace
    assert t.ranks == [0] and t.meta["pcp"] == 1 and len(t.steps) == len(one.steps) + 1  # + the dummy run
    assert pt.validate(t).ok and pt.validate(t).ending == "complete"
    from pcpviz.trace.validate import undeclared_views

    assert undeclared_views(t) == []
    target = t.record(1, 0, "target")
    for view in ("req_ids", "positions", "input_ids", "query_start_loc", "block_table_global",
                 "slot_mapping_global", "logits_indices", "sampled_logits_rows"):
        assert view in target, view
    assert "segments" not in target and "local_positions" not in target  # no PCP layout at PCP = 1
    d0 = t.record(1, 0, "draft_0")
    assert str(d0["view"]) == "replicated" and d0["draft_global_input_ids"].shape == target["input_ids"].shape
    report = run_checks(t)
    assert report.ok, report.format()
    # the plugin fingerprints vLLM's hand-offs at PCP = 1 too (hidden_handoffs runs); nothing is
    # restored (hidden_restored) and top1_token is the engine's alone (verify_greedy)
    assert set(report.passed) == set(report.results) - PCP1_SKIPS - {"hidden_restored", "verify_greedy"}, \
        report.format()


@pytest.mark.slow
def test_pcp1_is_good_for_pcp2_on_every_global_view(runs):
    one, two = runs
    rep = diff_traces(one.trace, two.trace)
    assert rep.same, rep.format()
    assert rep.steps_compared == len(one.steps) + 1 and rep.views_compared > 250 and not rep.local_views_compared
    # the global things a PCP run must agree on are among what was compared
    compared = {(ph, v) for ph, v in _compared_views(one.trace, two.trace)}
    for pv in [("target", "positions"), ("target", "block_table_global"), ("target", "slot_mapping_global"),
               ("draft_0", "draft_global_input_ids"), ("draft_0", "draft_last_token_indices"),
               ("draft_0", "draft_tokens"), ("draft_1", "draft_input_ids"), ("draft_1", "slot_mapping_draft"),
               ("verify", "sampled_token_ids")]:
        assert pv in compared, pv


def _compared_views(a: pt.Trace, b: pt.Trace) -> set[tuple[str, str]]:
    from pcpviz.analysis.diff import _kind

    out = set()
    for step in a.steps:
        for ph in a.phases(step, 0):
            if b.has(step, 0, ph):
                out |= {(ph, v) for v in a.record(step, 0, ph) if v in b.record(step, 0, ph) and _kind(ph, v)}
    return out


def _copy_with(src: pt.Trace, dst: Path, step: int, phase: str, view: str, change) -> None:
    """``src`` rewritten into ``dst`` with one view changed on every rank at ``step``."""
    meta = {k: v for k, v in src.meta.items() if k != "pcpviz_trace_schema"}
    for r in src.ranks:
        with pt.TraceWriter(dst, r, meta=meta if r == 0 else None) as w:
            for s in src.rank_steps(r):
                phases = {ph: {k: np.array(v) for k, v in src.record(s, r, ph).items()} for ph in src.phases(s, r)}
                if s == step:
                    phases[phase][view] = change(phases[phase][view])
                w.write_step(s, phases)


@pytest.mark.slow
def test_a_global_divergence_of_the_pcp2_run_is_found_against_pcp1(runs, tmp_path):
    one, two = runs

    def bump(ids):
        ids = ids.copy()
        ids[3] += 1
        return ids

    _copy_with(two.trace, tmp_path / "bad", 2, "draft_0", "draft_global_input_ids", bump)
    rep = diff_traces(one.trace, tmp_path / "bad")
    assert not rep.same
    d = rep.first
    assert (d.step, d.phase, d.view) == (2, "draft_0", "draft_global_input_ids") and d.rank_a == 0, d.describe()


@pytest.mark.slow
def test_explain_takes_the_pcp1_run_as_good(runs):
    from pcpviz.analysis.explain import explain

    one, two = runs
    rep = explain(two.trace, one.trace)
    assert rep.ok, rep.format()


@pytest.mark.slow
def test_the_pcp1_baseline_replays_from_the_command_line(tmp_path):
    from pcpviz.cli import main

    assert main(["replay", "--pcp", "1", "--mtp", "2", "--trace", str(tmp_path / "t"), "--check", "--quiet"]) == 0
    assert pt.open(tmp_path / "t").ranks == [0]


# --------------------------------------------------------------------------- clean shutdown

SCRIPT_SHUTDOWN = r"""
import os, signal, sys, time, types
from pcpviz.vllm import cpu_patches
cpu_patches.apply_cpu_patches()
import numpy as np
import vllm.v1.worker.gpu_worker as gw
from pcpviz.vllm import recording
from pcpviz.vllm.recording import wrappers
recording.install_wrappers()
wrappers.ensure_warm_up_wrapper()
s = recording.active_session()            # the plugin's session, from PCPVIZ_TRACE_DIR
rec = s.recorder_for_rank(0, 1)
for step in range(2):
    rec.begin_step()
    rec.put("target", positions=np.arange(4) + step)
rec.flush()
how = sys.argv[1]
if how == "worker_shutdown":              # vLLM's Worker.shutdown on a stand-in self (CPU: no GPU state)
    gw.Worker.shutdown(types.SimpleNamespace(profiler=None, elastic_ep_executor=types.SimpleNamespace(
        shutdown=lambda: None)))
    os._exit(0)                           # no interpreter teardown: only the shutdown hook finalized
if how == "sigterm":                      # vllm serve's handlers: SIGTERM/SIGINT raise SystemExit
    def stop(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
# "exit": a normal interpreter exit (atexit)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how, reason", [("worker_shutdown", "finished: vLLM shut down"),
                                         ("sigterm", "finished: process exit"),
                                         ("exit", "finished: process exit")])
def test_the_plugin_finalizes_its_rank_file_on_a_clean_shutdown(tmp_path, how, reason):
    trace = tmp_path / "t"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env.update(PCPVIZ_TRACE_DIR=str(trace), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT_SHUTDOWN), how], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = pt.open(trace)
    assert t.files[0].closed and t.rank_steps(0) == [0, 1]
    status = pt.validate(t)
    assert status.ending == "complete", status.lines()
    assert json.loads((trace / "complete.json").read_text())["ranks"]["0"]["reason"] == reason
