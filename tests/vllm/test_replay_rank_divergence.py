"""A bug on one rank only forks the ranks: here rank 1 restores the all-gathered draft-prefill rows one
row off (vLLM's ``PCPManager.restore_draft_prefill``), so its drafts differ from rank 0's. The replay
goes on with rank 0's outputs, as vLLM's scheduler does, says where the ranks first differed, and
writes the trace, in which ``check`` finds the bug at its own view and ``ranks_agree`` fails. (It
used to stop with a RuntimeError and write nothing for the checks to read.)"""

from __future__ import annotations

import logging

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.analysis.vllm_mutations import VllmMutation, planted  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402


def _rank1_restores_one_row_off(real):
    def buggy(self, *args, **kwargs):
        if self.pcp_rank != 1:
            return real(self, *args, **kwargs)
        saved = self._hidden_restore_idx
        self._hidden_restore_idx = saved.roll(1)
        try:
            return real(self, *args, **kwargs)
        finally:
            self._hidden_restore_idx = saved
    return buggy


RANK1_BUG = VllmMutation("rank1_draft_restore_one_row_off", "vllm.v1.worker.gpu.pcp_manager",
                         "PCPManager.restore_draft_prefill", "PCPManager.restore_draft_prefill", "draft_0",
                         "hidden_last_fp", "rank 1 only: the draft prefill's rows restored one row off",
                         _rank1_restores_one_row_off)


def test_forked_ranks_are_recorded_and_the_bug_found_at_its_view(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pcpviz.vllm"), planted(RANK1_BUG):
        res = replay(pcp=2, mtp=2, scenario="mixed", trace_dir=tmp_path / "t")
    assert res.rank_divergences and all(" rank 1 " in d for d in res.rank_divergences), res.rank_divergences
    assert sum("going on with rank 0's outputs" in r.getMessage() for r in caplog.records) == 1
    report = run_checks(res.trace_path)
    v = report.first_violation
    assert (v.rank, v.phase, v.view) == (1, "draft_0", "hidden_last_fp"), v
    assert "ranks_agree" in report.failed


def test_a_clean_replay_has_no_divergence(tmp_path):
    assert replay(pcp=2, mtp=2, scenario="mixed", trace_dir=tmp_path / "t").rank_divergences == []
