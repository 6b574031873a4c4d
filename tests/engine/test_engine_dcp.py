"""The engine's own DCP (``pcpviz run --pcp 2 --dcp 2``, not a vLLM 0.33.0 configuration for the
dense model): the same greedy tokens as PCP=1 and as PCP=2 with DCP=1, every check passes
(including the DCP ones), run.json says what it is; and the two planted DCP bugs
(``pcpviz.analysis.mutations.DCP_MUTATIONS``: the vllm#51031 class and a draft-decode local_len
off by one) each fail at their own view."""

from __future__ import annotations

import pytest

import pcpviz
import pcpviz.trace as pt
from pcpviz.analysis.checks import DCP_CHECKS, run_checks
from pcpviz.analysis.mutations import DCP_MUTATIONS, plant, run_planted

pytestmark = pytest.mark.slow  # multi-process engine runs

PROMPTS = ["def fib(n):", "import os"]
# interleave 8 > half the block (4): the kernel-block-size bug moves tokens
RUN = dict(num_speculative_tokens=2, max_new_tokens=10, block_size=8, progress=False)
DCP = dict(pcp=2, dcp=2, dcp_interleave=8)


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    return pcpviz.run(PROMPTS, trace_dir=str(d), **DCP, **RUN), pt.open(d)


def test_dcp2_gives_the_pcp1_tokens_and_passes_every_check(dcp_run):
    res, trace = dcp_run
    base = pcpviz.run(PROMPTS, pcp=1, **RUN)
    dcp1 = pcpviz.run(PROMPTS, pcp=2, **RUN)
    assert res.output_token_ids == base.output_token_ids == dcp1.output_token_ids
    assert res.num_drafts > 0 and res.config["dcp"] == 2
    assert trace.meta["dcp"] == 2 and trace.meta["dcp_group"] == "pcp" and trace.meta["shard_decode_requests"] is False
    assert "not a vLLM 0.33.0 configuration" in trace.meta["vllm_configuration"]
    report = run_checks(trace)
    assert report.ok, report.format()
    assert DCP_CHECKS <= set(report.passed)
    owners = {o for s in trace.steps for o in trace.record(s, 0, "target")["dcp_owner"].tolist()}
    assert owners == {0, 1}


@pytest.mark.parametrize("m", DCP_MUTATIONS, ids=lambda m: m.name)
def test_planted_dcp_bug_fails_at_its_view(m, tmp_path):
    root = plant(m.name, tmp_path / "planted")
    trace = pt.open(run_planted(root, PROMPTS, tmp_path / "trace", **DCP, **RUN))
    report = run_checks(trace)
    assert not report.ok
    firsts = {name: report[name].first_violation for name in report.failed}
    own = [n for n, v in firsts.items() if m.at_own_place(v.phase, v.view)]
    assert own and own[0] in DCP_CHECKS | {"global_slots_match_block_table"}, report.format()
    dcp_check = "dcp_kv_sharding" if m.view == "slot_mapping_global" else "dcp_local_lens"
    v = firsts[dcp_check]
    assert m.at_own_place(v.phase, v.view), (dcp_check, v)
