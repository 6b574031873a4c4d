"""Issue 36: the engine records the collectives each phase ran (its ``ProcessGroupPCP`` writes the
``collectives`` view's lines), and ``collectives_match_vllm`` holds them to the rules vLLM 0.33.0's
calls obey (tests/vllm/test_collectives_recorded.py records those from vLLM's own code on CPU)."""

from __future__ import annotations

import re

import numpy as np

import pcpviz
import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    parser = "]


def _lines(t, step, rank, phase):
    return [str(x) for x in np.asarray(t.record(step, rank, phase)["collectives"])]


def test_engine_phases_hold_their_collectives(tmp_path):
    pcpviz.run(PROMPTS, pcp=2, num_speculative_tokens=2, trace_dir=str(tmp_path / "t"), max_new_tokens=8,
                     max_num_batched_tokens=24, progress=False)
    t = pt.open(tmp_path / "t")
    assert t.meta["model_moe"] is False
    hidden = None
    for step in t.steps:
        for phase in t.phases(step, 0):
            assert _lines(t, step, 0, phase) == _lines(t, step, 1, phase)  # every rank the same calls
        target = _lines(t, step, 0, "target")
        assert target and all(x.startswith("all_gather pcp ") for x in target)
        hidden = hidden or re.search(r"\[\d+, (\d+)\]", target[-1]).group(1)  # the restore gathers [P, H] rows
        assert target[-1].endswith(f", {hidden}] dim=0")
        assert _lines(t, step, 0, "verify") == []
        if "draft_1" in t.phases(step, 0):
            assert _lines(t, step, 0, "draft_1") == []  # a dense replicated draft decode gathers nothing
            assert _lines(t, step, 0, "draft_0")[-1].endswith(f", {hidden}] dim=0")
    report = run_checks(t)
    assert report.results["collectives_match_vllm"].verdict == "pass"


def test_pcp1_runs_no_collective(tmp_path):
    pcpviz.run(PROMPTS[:1], pcp=1, num_speculative_tokens=2, trace_dir=str(tmp_path / "t"), max_new_tokens=4,
                     progress=False)
    t = pt.open(tmp_path / "t")
    assert all(_lines(t, s, 0, ph) == [] for s in t.steps for ph in t.phases(s, 0))
