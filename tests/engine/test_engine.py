"""The engine on real gloo ranks (separate processes) with the shipped model.

* greedy speculation never changes the output: it equals transformers' plain
  greedy decoding of the same checkpoint;
* PCP=2 and PCP=4 give the PCP=1 tokens on mixed batches (chunked prefill puts
  fresh prefills, continued chunks and decodes with drafts in the same step);
* every rank ends with the same KV cache and records the same draft tokens;
* the recorded layout equals plan_layout; recording on/off gives the same tokens;
* a dead rank is named and does not hang the others.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pcpviz
import pcpviz.trace as pt
from pcpviz.engine.model_config import default_model_dir
from pcpviz.engine.tokenizer import encode
from pcpviz.reference.layout import plan_layout

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
# A small token budget forces chunked prefill, so steps mix prefills and decodes.
MIXED = dict(max_new_tokens=20, max_num_batched_tokens=40, progress=False)


@pytest.fixture(scope="module")
def pcp1_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("pcp1")
    return pcpviz.run(PROMPTS, pcp=1, num_speculative_tokens=2, trace_dir=str(d), **MIXED)


@pytest.fixture(scope="module")
def pcp2_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("pcp2")
    return pcpviz.run(PROMPTS, pcp=2, num_speculative_tokens=2, trace_dir=str(d), **MIXED)


@pytest.mark.slow
def test_speculation_equals_transformers_greedy(pcp1_run):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), torch_dtype=torch.float32)
    hf.eval()
    for prompt, out in zip(PROMPTS, pcp1_run.output_token_ids):
        ids = torch.tensor([encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=len(out), do_sample=False, num_beams=1,
                              attention_mask=torch.ones_like(ids), pad_token_id=258)
        assert ref[0, ids.shape[1]:].tolist() == out
    assert pcp1_run.num_drafts > 0 and sum(pcp1_run.num_accepted_tokens_per_pos) > 0


@pytest.mark.slow
def test_pcp2_equals_pcp1_on_mixed_batches(pcp1_run, pcp2_run):
    assert pcp2_run.output_token_ids == pcp1_run.output_token_ids
    assert pcp2_run.num_accepted_tokens_per_pos == pcp1_run.num_accepted_tokens_per_pos
    trace = pt.open(pcp2_run.trace_path)
    kinds = set()
    for step in trace.steps:
        rec = trace.record(step, 0, "target")
        pre = rec["is_prefilling"]
        kinds.add((bool(pre.any()), bool((~pre).any())))
    assert (True, True) in kinds, "no step mixed prefills and decodes"


@pytest.mark.slow
def test_pcp4_equals_pcp1(pcp1_run, tmp_path):
    res = pcpviz.run(PROMPTS, pcp=4, num_speculative_tokens=2, trace_dir=str(tmp_path), **MIXED)
    assert res.output_token_ids == pcp1_run.output_token_ids
    assert len(set(res.kv_cache_digests)) == 1


@pytest.mark.slow
def test_ranks_hold_identical_kv_and_drafts(pcp2_run):
    assert len(pcp2_run.kv_cache_digests) == 2 and len(set(pcp2_run.kv_cache_digests)) == 1
    trace = pt.open(pcp2_run.trace_path)
    for step in trace.steps:
        for phase in trace.phases(step, 0):
            if phase.startswith("draft_"):
                a = trace.record(step, 0, phase)["draft_tokens"]
                b = trace.record(step, 1, phase)["draft_tokens"]
                np.testing.assert_array_equal(a, b, err_msg=f"step {step} {phase}")


@pytest.mark.slow
def test_recorded_layout_equals_plan_layout(pcp2_run):
    trace = pt.open(pcp2_run.trace_path)
    assert trace.meta["producer"] == "pcpviz-engine" and trace.meta["pcp"] == 2
    for step in trace.steps:
        for rank in trace.ranks:
            rec = trace.record(step, rank, "target")
            lay = plan_layout(rec["num_scheduled_tokens"], rec["is_prefilling"], 2)
            np.testing.assert_array_equal(rec["padded_gather_idx"], lay.padded_gather_idx)
            np.testing.assert_array_equal(rec["hidden_restore_idx"], lay.hidden_restore_idx)
            np.testing.assert_array_equal(rec["kv_write_mask"], lay.kv_write_mask)
            np.testing.assert_array_equal(rec["per_rank_num_tokens"], lay.per_rank_num_tokens)
        phases = trace.phases(step, 0)
        assert phases == ["target", "draft_0", "draft_1", "verify"]
        assert str(trace.record(step, 0, "draft_0")["view"]) == "rank_local"
        assert str(trace.record(step, 0, "draft_1")["view"]) == "replicated"


@pytest.mark.slow
def test_recorded_views_are_declared_in_the_schema(pcp1_run, pcp2_run):
    from pcpviz.trace.validate import undeclared_views

    for run in (pcp1_run, pcp2_run):
        assert undeclared_views(pt.open(run.trace_path)) == []


@pytest.mark.slow
def test_recording_does_not_change_tokens(pcp2_run):
    res = pcpviz.run(PROMPTS, pcp=2, num_speculative_tokens=2, **MIXED)
    assert res.trace_path is None
    assert res.output_token_ids == pcp2_run.output_token_ids


@pytest.mark.slow
def test_no_speculation_mode(pcp1_run):
    res = pcpviz.run(PROMPTS[:1], pcp=2, num_speculative_tokens=0, **MIXED)
    assert res.output_token_ids == pcp1_run.output_token_ids[:1]
    assert res.num_drafts == 0
    assert math.isnan(res.mean_acceptance_length) and res.summary()["mean_acceptance_length"] is None


@pytest.mark.slow
def test_dead_rank_is_named_and_does_not_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("PCPVIZ_DEBUG_EXIT_RANK", "1@2")  # rank 1 dies at step 2
    with pytest.raises(pcpviz.RankError) as err:
        pcpviz.run(PROMPTS[:2], pcp=2, num_speculative_tokens=2, trace_dir=str(tmp_path),
                   timeout_s=20, **MIXED)
    assert err.value.rank == 1 and "rank 1 failed" in str(err.value)
    trace = pt.open(tmp_path)
    assert trace.rank_steps(1) == [0, 1]  # every completed step kept


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pcp=0), "pcp must be an integer >= 1"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens must be an integer >= 0"),
        (dict(device="tpu"), "device must be 'cpu' or 'cuda'"),
        (dict(inject=["nope"]), "unknown fault 'nope'"),
        (dict(max_new_tokens=40000), "exceed the model's context"),
        (dict(max_num_batched_tokens=2), "cannot fit one decode"),
    ],
)
def test_bad_configuration_is_rejected_before_launch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pcpviz.run(PROMPTS[:1], **{**dict(progress=False), **kwargs})
