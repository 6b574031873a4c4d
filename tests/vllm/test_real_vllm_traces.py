"""What the real vLLM 0.33.0 traces (2 x H200, data/traces/vllm-*) hold, and what the recorder
guarantees about them: provenance in run.json, no uninitialised GPU memory in the views, vLLM's
own spec-decode counters reproduced from the trace, and the recorded scenarios (chunked prefill
alongside decodes, PIECEWISE graphs without vLLM's warm-up steps, `vllm serve`)."""

import json
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis.diff import acceptance

ROOT = Path(__file__).resolve().parents[2] / "data" / "traces"
REAL = sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name.startswith("vllm"))


@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_provenance(path):
    meta = json.loads((path / "run.json").read_text())
    gpus = 1 if "h200x1" in path.name else 2
    assert meta["producer"] == "vllm-plugin" and meta["vllm_version"] == "0.33.0"
    assert meta["gpus"] == ["NVIDIA H200"] * gpus and meta["torch_version"].startswith("2.11")
    assert meta["pcp"] == gpus and meta["cudagraph_mode"] in ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
    assert meta["command"]
    if "flight" in path.name:  # a flight-recorder dump: its run.json says what triggered it
        assert meta["flight_recorder"]["trigger"].startswith("acceptance ")
    else:
        assert meta["job"]["command"].startswith("python3 tools/gpu/jobs.py ")


@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_sampled_tokens_are_padded_past_num_sampled(path):
    """vLLM leaves sampled_token_ids[i, num_sampled[i]:] unwritten on the GPU; the recorder
    stores -1 there, so every rank's copy is the same and the checks can compare them."""
    trace = pt.open(path)
    rows = 0
    for step in trace.steps:
        for rank in trace.ranks:
            v = trace.record(step, rank, "verify")
            s, ns = np.asarray(v["sampled_token_ids"]), np.asarray(v["num_sampled"])
            tail = np.arange(s.shape[1])[None, :] >= ns[:, None]
            assert (s[tail] == -1).all() and (s[~tail] >= 0).all(), f"step {step} rank {rank}"
            rows += s.shape[0]
    assert rows > 0


@pytest.mark.parametrize("path", [p for p in REAL if "mtp" in p.name and "serve" not in p.name
                                  and "flight" not in p.name], ids=lambda p: p.name)
def test_vllm_counters_match_the_trace(path):
    """vLLM's own counters (LLM.get_metrics(), stored by pcpviz.vllm.run) against the same figures
    computed from the recorded verify steps. vLLM counts a draft when its scheduler takes in that
    request's output (Scheduler.update_from_output: scheduled spec tokens and generated tokens),
    not when the worker verifies it; the trace records every verify, so around requests' last
    steps it may hold a few more drafts (here at most one per request), never fewer."""
    meta = json.loads((path / "run.json").read_text())
    vllm = meta["vllm_spec_decode_metrics"]
    ours = acceptance(pt.open(path))
    assert vllm["num_drafts"] <= ours.num_drafts <= vllm["num_drafts"] + len(meta["prompts"])
    for k, (theirs, mine) in enumerate(zip(vllm["num_accepted_tokens_per_pos"], ours.accepted_per_position)):
        assert theirs <= mine <= theirs + len(meta["prompts"]), f"position {k}"
        assert abs(vllm["acceptance_rate_per_pos"][k] - ours.rate_per_position[k]) < 0.03


def test_chunked_prefill_alongside_decodes():
    trace = pt.open(ROOT / "vllm-h200x2-pcp2-mtp2-chunked")
    long_steps = 0
    for step in trace.steps:
        t = trace.record(step, 0, "target")
        q, pf = t["num_scheduled_tokens"], t["is_prefilling"]
        big = (pf & (t["prefill_len"] >= 8192)).nonzero()[0]
        if big.size and (~pf).any() and (q[~pf] == 3).all():  # decodes with K = 2 drafts alongside
            long_steps += 1
            assert int(t["num_computed_tokens"][big[0]]) > 0 or long_steps == 1
    assert long_steps >= 4  # the 9,001-token prompt took 5 chunks of the 2,048-token budget


def test_piecewise_trace_has_no_warmup_steps():
    trace = pt.open(ROOT / "vllm-h200x2-pcp2-mtp2-piecewise")
    assert trace.meta["cudagraph_mode"] == "PIECEWISE"
    ids = {str(r) for s in trace.steps for r in trace.record(s, 0, "target")["req_ids"]}
    assert not any(r.startswith("_") for r in ids) and len(ids) == 4
    # PIECEWISE pads the rank-local batch to a captured size: P is larger than the eager run's
    eager = pt.open(ROOT / "vllm-h200x2-pcp2-mtp2")
    assert trace.record(0, 0, "target")["local_positions"].shape[0] > eager.record(0, 0, "target")[
        "local_positions"].shape[0]


def test_serve_trace():
    meta = json.loads((ROOT / "vllm-serve-h200x2-pcp2-mtp2" / "run.json").read_text())
    assert "serve" in meta["command"] and "--prefill-context-parallel-size 2" in meta["command"]
    assert len(meta["serve"]["completions"]) == 3
    assert any("spec_decode_num_accepted_tokens_per_pos" in m for m in meta["serve"]["spec_decode_metrics"])


@pytest.mark.slow
@pytest.mark.parametrize("inject,reference", [
    ((), "vllm-h200x2-pcp2-mtp2"),
    (("draft_prefill_reads_captured_buffers",), "vllm-h200x2-pcp2-mtp2-piecewise"),
])
def test_engine_reproduces_vllm_step0_drafts(inject, reference, tmp_path):
    """vLLM ran request 0 alone at step 0. The clean engine drafts what eager vLLM drafted; with
    the draft prefill reading the speculator's global-order buffers (the PIECEWISE bug,
    docs/findings/piecewise-draft-prefill.md) it drafts exactly what PIECEWISE vLLM drafted."""
    import pcpviz

    ref = pt.open(ROOT / reference)
    prompt = ref.meta["prompts"][0]
    pcpviz.run([prompt], pcp=2, num_speculative_tokens=2, device="cpu", max_new_tokens=4,
               block_size=ref.meta["block_size"], trace_dir=str(tmp_path / "run"), inject=inject, progress=False)
    ours = pt.open(tmp_path / "run")
    assert ours.record(0, 0, "target")["per_rank_num_tokens"].tolist() == \
        ref.record(0, 0, "target")["per_rank_num_tokens"].tolist()
    for phase in ("draft_0", "draft_1"):
        assert ours.record(0, 0, phase)["draft_tokens"].tolist() == ref.record(0, 0, phase)["draft_tokens"].tolist()


# --------------------------------------------------------------------------- one H200, PCP = 1 (issue 24)

PCP1 = ROOT / "vllm-h200x1-pcp1-mtp2"
PCP1_PIECEWISE = ROOT / "vllm-h200x1-pcp1-mtp2-piecewise"
PCP2 = ROOT / "vllm-h200x2-pcp2-mtp2"
FLIGHT = ROOT / "vllm-h200x1-pcp1-mtp2-flight-acceptance"


def test_the_pcp1_run_is_good_for_the_pcp2_run_of_the_same_prompts():
    """Real vLLM at PCP=1 on one H200 (tools/gpu/jobs.py trace-pcp1) against the shipped PCP=2
    trace of the same prompts, K and budget: the same tokens, and no divergence on any global
    view, although vLLM's engine core batched the requests differently (request 0 ran alone one
    step longer at PCP=2), so the diff compares each request's own timeline."""
    from pcpviz.analysis.diff import diff_traces
    from pcpviz.analysis.explain import explain

    m1, m2 = (json.loads((p / "run.json").read_text()) for p in (PCP1, PCP2))
    assert m1["prompts"] == m2["prompts"] and m1["output_token_ids"] == m2["output_token_ids"]
    for a, b in ((PCP1, PCP2), (PCP2, PCP1)):
        rep = diff_traces(a, b)
        assert rep.same, rep.format()
        assert rep.views_compared > 2000 and any("batched the requests differently" in n for n in rep.notes)
    assert explain(PCP2, PCP1).ok


def test_a_global_divergence_is_still_found_against_the_pcp1_run(tmp_path):
    from pcpviz.analysis.diff import diff_traces

    src = pt.open(PCP1)
    meta = {k: v for k, v in src.meta.items() if k != "pcpviz_trace_schema"}
    with pt.TraceWriter(tmp_path / "bad", 0, meta=meta) as w:
        for s in src.steps:
            phases = {ph: {k: np.array(v) for k, v in src.record(s, 0, ph).items()} for ph in src.phases(s, 0)}
            if s == 6:
                phases["target"]["positions"][-1] += 1  # the last request's last token at another position
            w.write_step(s, phases)
    rep = diff_traces(PCP2, tmp_path / "bad")
    assert not rep.same and (rep.first.phase, rep.first.view) == ("target", "positions"), rep.format()
    assert rep.first.req_id is not None and rep.first.step == 7 and "b step 6" in rep.first.message, rep.first


def test_the_graph_replay_ledger_passes_on_the_real_piecewise_run():
    from pcpviz.analysis.checks import run_checks

    t = pt.open(PCP1_PIECEWISE)
    res = run_checks(t, checks="graph_inputs_are_captured")["graph_inputs_are_captured"]
    assert res.verdict == "pass" and res.evaluated >= len(t.steps) - 1
    replays = sum(int(t.record(s, 0, ph)["graph_replays"]) for s in t.steps for ph in t.phases(s, 0)
                  if "graph_replays" in t.record(s, 0, ph))
    assert replays > 100  # every piece of every PIECEWISE forward, target and drafter


@pytest.mark.parametrize("path", [PCP1, PCP1_PIECEWISE], ids=lambda p: p.name)
def test_the_plugin_finalized_its_rank_file_when_vllm_shut_down(path):
    t = pt.open(path)
    assert t.files[0].closed and t.files[0].finalizes
    status = pt.validate(t)
    assert status.ok and status.ending == "complete"
    assert json.loads((path / "complete.json").read_text())["ranks"]["0"]["reason"] == "finished: vLLM shut down"


def test_the_flight_recorder_dump_of_real_vllm():
    """tools/gpu/jobs.py flight-pcp1: the last 16 steps kept, acceptance 0.5 < 0.9 over 8 drafted
    steps dumped them (the run went on writing nothing)."""
    from pcpviz.analysis.checks import run_checks

    t = pt.open(FLIGHT)
    fr = t.meta["flight_recorder"]
    assert fr["steps_kept"] == 16 and fr["acceptance_threshold"] == 0.9 and fr["window"] == 8
    assert t.steps == list(range(fr["steps"][0], fr["steps"][1] + 1))
    status = pt.validate(t)
    assert status.ok and status.ending == "complete"
    assert json.loads((FLIGHT / "complete.json").read_text())["ranks"]["0"]["reason"].startswith(
        "flight recorder: acceptance 0.500 < 0.9")
    report = run_checks(t)
    assert report.ok and not report.failed, report.format()
