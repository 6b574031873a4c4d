"""``pcpviz bisect`` on the CPU replay: the PIECEWISE finding (docs/findings/piecewise-draft-prefill.md)
and a planted bug in vLLM's chunked-prefill must-sample rule."""

from __future__ import annotations

import json

import pytest
import torch

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.bisect import bisect  # noqa: E402
from pcpviz.vllm.replay import step as replay_step  # noqa: E402

pytestmark = pytest.mark.slow


def test_bisect_names_pcp_and_the_graph_mode_for_the_piecewise_finding(tmp_path):
    report = bisect("replay", out_dir=tmp_path, base={"pcp": 2, "k": 2, "graph_mode": "PIECEWISE"},
                    knobs=["pcp", "graph_mode"])
    assert [r.rung.name for r in report.flips()] == ["pcp=1", "graph_mode=NONE"]
    for r in report.flips():  # the finding's signature: acceptance moves, tokens do not
        assert r.tokens_equal and r.acceptance_flip.startswith("position 0")
    (none,) = [r for r in report.rungs if r.rung.name == "graph_mode=NONE"]
    # the PIECEWISE draft prefill reads the captured input buffers: the first view that differs is
    # what draft_0's forward consumed (fwd_input_ids), before the draft tokens it then proposes
    assert "phase draft_0, view fwd_input_ids" in none.first_divergence, none.first_divergence
    (fp,) = [r for r in report.rungs if r.rung.name == "graph_mode=FULL_AND_PIECEWISE"]
    assert not fp.flips  # the mixed steps draft-prefill PIECEWISE there too
    text = report.format()
    assert "graph_mode=NONE flips" in text and "first divergent view: step" in text
    assert json.loads(json.dumps(report.to_dict()))["flips"] == ["pcp=1", "graph_mode=NONE"]


def test_bisect_finds_a_planted_must_sample_bug_on_the_chunking_knob(tmp_path, monkeypatch):
    """Planted in vLLM's own rule (get_num_sampled_and_rejected, as the replay calls it): a chunk that
    does not finish its prompt samples anyway. Only chunked prefill exercises it."""
    real = replay_step.get_num_sampled_and_rejected

    def planted(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len):
        ns, nr = real(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len)
        partial = seq_lens.to(torch.int64) < prefill_len[idx_mapping].to(torch.int64)
        return torch.where(partial, torch.ones_like(ns), ns), nr

    monkeypatch.setattr(replay_step, "get_num_sampled_and_rejected", planted)
    report = bisect("replay", out_dir=tmp_path, base={"pcp": 2, "k": 2}, knobs=["chunked_prefill", "pcp"])
    assert [r.rung.name for r in report.flips()] == ["chunked_prefill=False"]
    (flip,) = report.flips()
    assert not flip.tokens_equal and flip.token_divergence.startswith("request p1 token 0")
    assert flip.first_divergence is not None
