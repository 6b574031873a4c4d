"""The CPU replay with the tiny checkpoint's weights (issue 37 items 4 and 5): tokens equal the engine's
on the same prompts; the PIECEWISE finding moves acceptance and not tokens; its opt-in fix
(pcpviz.vllm.fixes) brings acceptance back to the eager figure and the checks still pass."""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm import fixes  # noqa: E402
from pcpviz.vllm import replay  # noqa: E402
from replay_tokens import replay_tokens  # noqa: E402

pytestmark = pytest.mark.slow


def _accepted(res) -> list[tuple[str, int, int]]:
    return [(rid, int(ns), int(nr)) for s in res.steps for rid, ns, nr in zip(s[0].req_ids, s[0].num_sampled,
                                                                              s[0].num_rejected)]


@pytest.fixture(scope="module")
def eager():
    return replay(pcp=2, mtp=2, scenario="mixed", record=False, dummy=False)


def test_tokens_equal_the_engines_on_the_same_prompts(eager):
    from pcpviz.engine.launch import run

    toks = replay_tokens(eager)
    prompts = eager.meta["prompt_token_ids"]
    rids = sorted(toks)
    res = run([prompts[r] for r in rids], pcp=1, num_speculative_tokens=2, device="cpu",
              max_new_tokens=max(len(t) for t in toks.values()), progress=False, stop_at_eos=False)
    for rid, engine_out in zip(rids, res.output_token_ids):
        assert toks[rid] == list(engine_out[: len(toks[rid])]), rid
    assert sum(len(t) for t in toks.values()) > 25


def test_acceptance_is_measured_not_scripted(eager):
    acc = _accepted(eager)
    # the scenario's scripted rejections are not used: d0 at step 1 was scripted to reject all (9)
    assert any(nr == 0 and ns == 3 for _, ns, nr in acc) and any(nr > 0 for _, _, nr in acc)
    assert eager.meta["replay_models"] == "tiny"


def test_piecewise_keeps_tokens_collapses_acceptance_and_the_fix_restores_it(eager, tmp_path):
    from pcpviz.analysis.checks import run_checks

    pw = replay(pcp=2, mtp=2, scenario="mixed", record=False, dummy=False, graph_mode="PIECEWISE", fixes="")
    fixed = replay(pcp=2, mtp=2, trace_dir=tmp_path / "fixed", scenario="mixed", dummy=False,
                   graph_mode="PIECEWISE", fixes="piecewise_draft_prefill")
    a, b = replay_tokens(eager), replay_tokens(pw)
    assert all(b[r] == a[r][: len(b[r])] for r in a)  # same tokens, fewer of them
    accepted = lambda res: sum(ns - 1 for _, ns, _ in _accepted(res) if ns > 0)  # noqa: E731
    assert accepted(pw) < accepted(eager) / 2
    assert _accepted(fixed) == _accepted(eager) and replay_tokens(fixed) == a
    assert fixed.meta["vllm_fixes"] == ["piecewise_draft_prefill"]
    assert run_checks(fixed.trace).ok
    assert fixes.active() == ()  # put back after the run


def test_fixes_by_name_and_environment(monkeypatch):
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    monkeypatch.setenv(fixes.ENV, "full_draft_prefill_state, piecewise_draft_prefill")
    assert fixes.requested() == ("piecewise_draft_prefill", "full_draft_prefill_state")
    assert fixes.requested("all") == tuple(fixes.FIXES)
    with pytest.raises(ValueError, match="PCPVIZ_FIXES: unknown fix 'nope'"):
        fixes.requested("nope")
    before = PCPManager.get_draft_input_buffers
    with fixes.applied(["piecewise_draft_prefill"]) as on:
        assert on == ("piecewise_draft_prefill",) and PCPManager.get_draft_input_buffers is not before
    assert PCPManager.get_draft_input_buffers is before
    assert np.all([f.finding.endswith(".md") for f in fixes.FIXES.values()])


def test_the_class_level_fixes_do_what_the_probes_candidate_fixes_do():
    """full_draft_prefill_state and dspark_dummy_run_block_tables, patched into vLLM's classes as the
    plugin would, give what the findings' probes measured for their candidate fixes."""
    from pcpviz.vllm.replay.dummy_runs import probe_dummy_run
    from pcpviz.vllm.replay.full_graphs import probe_full_graphs

    assert probe_full_graphs().stale()  # the finding, without a fix
    with fixes.applied(["full_draft_prefill_state"]):
        p = probe_full_graphs()
    assert not p.stale() and not any(o.left_set for obs in p.steps for o in obs)
    assert not any(f.wrong_rows for obs in p.steps for o in obs for f in o.forwards)
    with fixes.applied(["dspark_dummy_run_block_tables"]):
        for o in probe_dummy_run(drafter="dspark", kind="attention"):
            assert (o.draft_slots == -1).all() and not o.kv_writes
