"""vLLM 0.33.0 under its default CUDA-graph mode (FULL_AND_PIECEWISE) with PCP, through its own code on
CPU rank threads (``pcpviz.vllm.replay``): the draft prefill's forward consumes the first rows of the
global shifted ids and positions (the buffers its graph was captured with), not the rank's rows it
was handed (docs/findings/piecewise-draft-prefill.md). ``check`` fails at that forward's consumed
positions, the first wrong value is put on the function that hands the model its inputs, ``explain``
names the finding's fault with the consumed ids as its evidence (never "matches": its own check cannot
see it in a vLLM recording), and with the finding's fixes on the same checks pass."""

from __future__ import annotations

import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.analysis.explain import explain  # noqa: E402
from pcpviz.analysis.producers import INSIDE, attribute_violation  # noqa: E402
from pcpviz.trace import open as open_trace  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402

SETTING = dict(pcp=2, mtp=2, scenario="mixed", graph_mode="FULL_AND_PIECEWISE")


@pytest.fixture(scope="module")
def unfixed(tmp_path_factory):
    out = tmp_path_factory.mktemp("default-mode") / "trace"
    replay(trace_dir=out, **SETTING)
    return out


def test_the_draft_prefill_forward_consumed_the_global_rows(unfixed):
    report = run_checks(unfixed)
    v = report.first_violation
    assert v is not None and v.check == "forward_consumed_prepared" and v.phase == "draft_0"
    assert v.view in ("fwd_positions", "fwd_input_ids")
    who = attribute_violation(open_trace(unfixed), report)
    assert who.producer == "TargetDependentARSpeculator._run_model" and who.verdict == INSIDE
    assert who.sure.startswith("likely") and any("captured" in u for u in who.unrecorded)


def test_explain_names_the_finding_with_the_consumed_ids_as_evidence(unfixed):
    e = explain(unfixed, rerun=False)
    h = next(h for h in e.hypotheses if h.fault == "draft_prefill_reads_captured_buffers")
    assert h.status == "consistent"  # never "matches": draft_input_ids cannot see it in a vLLM recording
    assert any("consumed the first rows of the global shifted ids" in c for c in h.evidence_for)
    assert "hides them from their own check: draft_prefill_reads_captured_buffers" in e.headline


def test_the_findings_fixes_pass_the_same_checks(tmp_path):
    replay(trace_dir=tmp_path / "fixed", fixes="all", **SETTING)
    report = run_checks(tmp_path / "fixed")
    assert not report.failed, report.first_violation
