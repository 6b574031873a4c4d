"""``pcpviz findings`` / ``pcpviz.analysis.exposure``: which of pcpviz's vLLM 0.33.0 findings a
configuration meets. The preconditions are read from vLLM's source (the gate in
``PCPManager.__init__``, held here against the installed package), each finding names an opt-in
fix of ``pcpviz.vllm.fixes`` and a page of ``docs/findings/``, and the shipped real traces are
judged by what their run.json says vLLM ran."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from pcpviz.analysis.exposure import (EXPOSED, FINDINGS, FIXED, NOT_EXPOSED, REFUSED, VllmSetup, exposures,
                                      vllm_refuses)
from pcpviz.cli.commands import main
from pcpviz.trace import open as open_trace

ROOT = Path(__file__).resolve().parents[2]


def _verdicts(**kw) -> dict[str, str]:
    return {e.finding: e.verdict for e in exposures(VllmSetup(**kw))}


def test_the_default_graph_mode_meets_both_graph_findings():
    v = _verdicts(pcp=2, method="mtp", k=2)
    assert v == {"piecewise_draft_prefill": EXPOSED, "full_draft_prefill_state": EXPOSED,
                 "dspark_dummy_run_block_tables": NOT_EXPOSED}


@pytest.mark.parametrize("kw, exposed", [
    (dict(pcp=2, method="mtp", k=2, cudagraph_mode="PIECEWISE"), {"piecewise_draft_prefill"}),
    (dict(pcp=2, method="mtp", k=2, cudagraph_mode="FULL_DECODE_ONLY"), {"full_draft_prefill_state"}),
    (dict(pcp=2, method="mtp", k=1), {"piecewise_draft_prefill"}),  # K=1: no draft decode reads the state
    (dict(pcp=2, method="mtp", k=2, cudagraph_mode="NONE"), set()),
    (dict(pcp=2, method="mtp", k=2, enforce_eager=True), set()),
    (dict(pcp=1, method="mtp", k=2), set()),
    (dict(pcp=2, method="dspark", k=3, cudagraph_mode="NONE"), {"dspark_dummy_run_block_tables"}),
    (dict(pcp=4, method="dspark", k=3), {"dspark_dummy_run_block_tables"}),
])
def test_each_finding_needs_its_own_configuration(kw, exposed):
    assert {n for n, v in _verdicts(**kw).items() if v == EXPOSED} == exposed


def test_a_fix_that_is_on_turns_exposed_into_fixed():
    v = _verdicts(pcp=2, method="mtp", k=2, fixes=("piecewise_draft_prefill",))
    assert v["piecewise_draft_prefill"] == FIXED and v["full_draft_prefill_state"] == EXPOSED


@pytest.mark.parametrize("kw, cite", [
    (dict(pcp=2, method="eagle", k=2), "pcp_manager.py:188-195"),
    (dict(pcp=2, method="mtp", k=2, multi_module_mtp=True), "pcp_manager.py:188-195"),
    (dict(pcp=2, method="mtp", k=2, cudagraph_mode="FULL"), "pcp_manager.py:213-220"),
])
def test_a_configuration_vllm_refuses_meets_no_finding(kw, cite):
    assert cite in vllm_refuses(VllmSetup(**kw))
    assert set(_verdicts(**kw).values()) == {REFUSED}


def test_the_gate_is_vllms_own():
    """The refusals cited are where the installed vLLM 0.33.0 raises them."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    src = (Path(spec.origin).parent / "v1" / "worker" / "gpu" / "pcp_manager.py").read_text().splitlines()
    for cite, text in (("188-195", "only supports DSpark or single-module MTP"),
                       ("213-220", "supports full CUDA graphs for decode-only routines")):
        lo, hi = (int(x) for x in cite.split("-"))
        assert any(text in line for line in src[lo - 1:hi]), cite


def test_every_finding_has_its_page_and_its_fix():
    fixes_src = (ROOT / "pcpviz" / "vllm" / "fixes.py").read_text()
    for f in FINDINGS:
        assert (ROOT / "docs" / "findings" / f.doc).is_file(), f.doc
        assert re.search(rf'Fix\("{f.name}", "{re.escape(f.doc)}"', fixes_src), f.name  # the same registry key
    # README.md is the folder's front door (the index of the findings), not a finding
    assert {p.name for p in (ROOT / "docs" / "findings").glob("*.md")} - {"README.md"} == {f.doc for f in FINDINGS}


def test_from_llm_kwargs_reads_vllms_own_keywords():
    s = VllmSetup.from_llm_kwargs({"prefill_context_parallel_size": 2, "enforce_eager": True,
                                   "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
                                   "compilation_config": {"cudagraph_mode": "piecewise"}})
    assert (s.pcp, s.method, s.k, s.cudagraph_mode, s.graph_mode) == (2, "mtp", 3, "PIECEWISE", "NONE")
    with pytest.raises(ValueError, match="prefill_context_parallel_size"):
        VllmSetup.from_llm_kwargs({"prefill_context_parallel_size": "two"})


@pytest.mark.parametrize("name, exposed", [
    ("vllm-h200x2-pcp2-mtp2-piecewise", {"piecewise_draft_prefill"}),  # the run the finding came from
    ("vllm-h200x2-pcp2-mtp2", set()),  # eager
    ("vllm-h200x1-pcp1-mtp2-full", set()),  # PCP=1
])
def test_shipped_traces_are_judged_by_what_vllm_ran(name, exposed, capsys):
    meta = open_trace(ROOT / "data" / "traces" / name).run_meta
    assert {e.finding for e in exposures(VllmSetup.from_meta(meta)) if e.verdict == EXPOSED} == exposed
    code = main(["findings", str(ROOT / "data" / "traces" / name), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == (1 if exposed else 0)
    assert {f["finding"] for f in doc["findings"] if f["verdict"] == EXPOSED} == exposed


@pytest.mark.parametrize("argv, message", [
    (["findings", "--cudagraph-mode", "bogus"], "--cudagraph-mode 'bogus'"),
    (["findings", "--fixes", "nope"], "unknown fix 'nope'"),
    (["findings", "--vllm-args", "[1]"], "--vllm-args: not a JSON object"),
    (["findings", "--vllm-args", "{}", "data/traces/vllm-h200x2-pcp2-mtp2"], "not both"),
    (["findings", "no/such/trace"], "no/such/trace"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_text_report_says_what_removes_an_exposure(capsys):
    assert main(["findings", "--pcp", "2", "--mtp", "2"]) == 1
    out = capsys.readouterr().out
    assert "PCPVIZ_FIXES=piecewise_draft_prefill,full_draft_prefill_state" in out
    assert "EXPOSED" in out and "when:" in out and "docs/findings/piecewise-draft-prefill.md" in out
