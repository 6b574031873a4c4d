"""Issue 36: the collectives each phase ran, recorded from vLLM 0.33.0's own calls on the PCP group
(the CPU replay: real vLLM classes, ranks as threads) and held by ``collectives_match_vllm``."""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

import pcpviz.trace as pt  # noqa: E402
from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402
from tests.helpers.hostile import rewrite  # noqa: E402


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("coll") / "pcp2"
    replay(pcp=2, mtp=2, trace_dir=out)
    return out


def _lines(t, step, rank, phase):
    rec = t.record(step, rank, phase)
    return None if "collectives" not in rec.keys() else [str(x) for x in np.asarray(rec["collectives"])]


def _result(trace_dir, name="collectives_match_vllm"):
    report = run_checks(pt.open(trace_dir))
    return report.results[name]


def test_each_phase_holds_the_pcp_collectives_vllm_ran(replayed):
    t = pt.open(replayed)
    assert t.meta.get("model_moe") is False  # the tiny checkpoint is dense
    seen = 0
    for step in t.steps:
        if "target" not in t.phases(step, 0):
            continue
        target = [_lines(t, step, r, "target") for r in t.ranks]
        assert target[0] == target[1] and target[0], (step, target)  # every rank the same calls
        assert all(line.startswith("all_gather pcp ") for line in target[0])
        # the last target gather is restore_hidden_states' (pcp_manager.py:836): the hidden rows
        assert target[0][-1].endswith("dim=0") and target[0].count(target[0][-1]) >= 1
        assert _lines(t, step, 0, "verify") == []
        assert _lines(t, step, 0, "draft_1") == []  # a dense replicated draft decode gathers nothing
        assert _lines(t, step, 0, "draft_0")  # the MTP layer's KV and the restored hidden rows
        seen += 1
    assert seen >= 3
    res = _result(replayed)
    assert res.verdict == "pass", res


def test_a_rank_running_another_collective_fails_at_its_phase(replayed, tmp_path):
    def edit(step, rank, phases):
        if step == 1 and rank == 1 and "draft_0" in phases:
            lines = list(phases["draft_0"]["collectives"])
            phases["draft_0"]["collectives"] = np.array(lines[:-1], dtype=str)  # rank 1 skips one gather
    bad = rewrite(replayed, tmp_path / "bad", edit)
    res = _result(bad)
    assert res.verdict == "fail" and res.first_violation.step == 1 and res.first_violation.phase == "draft_0"
    assert "rank 1 ran 'nothing'" in res.first_violation.message


def test_a_gather_in_a_dense_draft_decode_fails(replayed, tmp_path):
    def edit(step, rank, phases):
        if step == 2 and "draft_1" in phases:
            phases["draft_1"]["collectives"] = np.array(["all_gather pcp float32[3, 256] dim=0"])
    bad = rewrite(replayed, tmp_path / "bad", edit)
    res = _result(bad)
    assert res.verdict == "fail" and res.first_violation.step == 2 and res.first_violation.phase == "draft_1"
    assert "replicated draft decode of a dense model" in res.first_violation.message
    # with routed experts the MoE layers gather in every forward: the same line is not a failure there
    # (each forward then also holds its MoE layer's gathers and reduce-scatter, as the MoE rule asks)
    triple = ["all_gather pcp float32[3, 256] dim=0", "all_gather pcp float32[3, 8] dim=0",
              "reduce_scatter pcp float32[6, 256] dim=0"]

    def edit_moe(step, rank, phases):
        edit(step, rank, phases)
        for name, rec in phases.items():
            if name != "verify" and "collectives" in rec:
                rec["collectives"] = np.array([str(x) for x in np.asarray(rec["collectives"])] + triple, dtype=str)

    moe = rewrite(replayed, tmp_path / "moe", edit_moe, meta_edit=lambda m: m.update(model_moe=True))
    assert _result(moe).verdict == "pass"
    # ... and a MoE model's forward without them fails (the dense replay relabelled)
    bare = _result(rewrite(replayed, tmp_path / "bare", edit, meta_edit=lambda m: m.update(model_moe=True)))
    assert bare.verdict == "fail" and "no MoE reduce-scatter" in bare.first_violation.message


def test_traces_without_the_view_skip(tmp_path):
    from pcpviz.synthetic import RequestSpec, generate

    t = generate([RequestSpec("a", 6, 4)], pcp=2, num_speculative_tokens=1, block_size=4, seed=0)
    res = _result(t.write(tmp_path / "syn"))
    assert res.verdict == "skipped" and "recorded by the CPU replay and the engine" in res.skip_reason


def test_the_chrome_export_shows_each_phase_collectives(replayed):
    from pcpviz.views.export.chrome import chrome_trace

    t = pt.open(replayed)
    events = [e for e in chrome_trace(replayed)["traceEvents"] if e.get("ph") == "X" and "phase" in e.get("args", {})]
    by = {(e["args"]["step"], e["args"]["rank"], e["args"]["phase"]): e["args"] for e in events}
    step = next(s for s in t.steps if "draft_1" in t.phases(s, 0))
    for rank in t.ranks:
        for phase in ("target", "draft_0", "draft_1", "verify"):
            args = by[(step, rank, phase)]
            assert args["collective_calls"] == _lines(t, step, rank, phase)  # the drawn data is the recorded one
            assert args["collectives"] == len(args["collective_calls"])
    assert by[(step, 0, "target")]["collectives"] > 0 and by[(step, 0, "draft_1")]["collectives"] == 0


def test_the_draft_timeline_draws_each_phase_collectives(replayed):
    from pcpviz.views.figures.timeline import draft_timeline_spec

    t = pt.open(replayed)
    step = next(s for s in t.steps if "draft_1" in t.phases(s, 0))
    phases = {ph: t.record(step, 0, ph) for ph in t.phases(step, 0)}
    spec = draft_timeline_spec(phases, step=step, rank=0)
    heat = spec["data"][0]
    xaxis = next(v for k, v in spec["layout"].items() if k.startswith("xaxis") and "ticktext" in v)
    ticks = dict(zip([str(x) for x in xaxis["ticktext"]], range(len(xaxis["ticktext"]))))
    col = {ph: next(i for tick, i in ticks.items() if f"<b>{ph}" in tick or tick.startswith(ph)) for ph in
           ("target", "draft_0", "draft_1", "verify")}
    for ph, c in col.items():
        n = len(_lines(t, step, 0, ph))
        tick = str(xaxis["ticktext"][c])
        assert (f"{n} collective" in tick) if n else ("no collective" in tick), (ph, tick)
        hover = [str(row[c]) for row in heat["hovertext"]]
        first = _lines(t, step, 0, ph)[0] if n else "no collective on this rank"
        assert all(first in h for h in hover), (ph, hover[0])
