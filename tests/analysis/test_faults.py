"""The fault catalogue end to end: each fault the engine can inject changes what it names
(acceptance, outputs or rank agreement), is caught by the check the catalogue names, and
`pcpviz diff` against a clean run locates its first divergence. The clean run passes every check."""

import numpy as np
import pytest

import pcpviz
import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.diff import acceptance, diff_traces
from pcpviz.faults import ENGINE, FAULTS, RANK_DIVERGENT_ACCEPTANCE, faults_of

pytestmark = pytest.mark.slow  # one multi-process engine run per fault

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
RUN = dict(pcp=2, num_speculative_tokens=3, max_new_tokens=24, max_num_batched_tokens=32, progress=False)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    res = pcpviz.run(PROMPTS, trace_dir=str(d), **RUN)
    return res, pt.open(d)


def test_clean_run_passes_every_check(clean):
    report = run_checks(clean[1])
    assert report.ok and not report.failed, report.format()


@pytest.mark.parametrize("name", sorted(faults_of(ENGINE)))
def test_fault_is_caught_by_its_named_check_and_located_by_diff(name, clean, tmp_path):
    clean_res, clean_trace = clean
    res = pcpviz.run(PROMPTS, trace_dir=str(tmp_path), inject=[name], **RUN)
    trace = pt.open(tmp_path)
    assert trace.meta["inject"] == [name]

    report = run_checks(trace)
    caught_by = FAULTS[name].caught_by
    assert caught_by in report.failed, f"{name}: {caught_by} did not fail\n{report.format()}"
    violation = report[caught_by].first_violation
    assert violation is not None and violation.step in trace.steps

    diff = diff_traces(clean_trace, trace)
    assert not diff.same and diff.first is not None and diff.first.step in trace.steps

    # the fault has a measurable effect: on acceptance, outputs, rank agreement, or at least on the
    # proposed drafts (the fold only corrupts draft KV that later draft steps read: K >= 3)
    changed_acceptance = res.num_accepted_tokens_per_pos != clean_res.num_accepted_tokens_per_pos
    changed_outputs = res.output_token_ids != clean_res.output_token_ids
    forked = len(set(res.kv_cache_digests)) > 1
    changed_drafts = any(
        not np.array_equal(trace.record(s, 0, ph)["draft_tokens"], clean_trace.record(s, 0, ph)["draft_tokens"])
        for s in trace.steps if s in clean_trace.steps
        for ph in trace.phases(s, 0) if ph.startswith("draft_") and clean_trace.has(s, 0, ph)
    )
    assert changed_acceptance or changed_outputs or forked or changed_drafts
    assert changed_drafts or name == RANK_DIVERGENT_ACCEPTANCE and forked
    assert acceptance(trace).num_drafts > 0
