"""The engine runs the MoE + DSA model (issue 36): the same greedy tokens at PCP = 1 and PCP = 2 as
the reference model's own greedy decode (the indexer's top-k taken over the engine's paged caches),
its MoE layers all-gather rows and router logits and reduce-scatter their output over PCP in the
target, draft_0 and the replicated draft decodes (vLLM 0.33.0 ``fused_moe/runner/moe_runner.py:
824-829, 853-861``), and ``pcpviz check`` passes on the trace.

The weights are random (seeded, ``initializer_range`` 0.1 so that the greedy tokens vary), with
``index_topk`` 16 so that the indexer chooses within these short prompts; the trained checkpoint is
not in the repository yet.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import pcpviz
import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks
from pcpviz.engine.checkpoint import load_model, save_model
from pcpviz.engine.model_v32 import build_model
from pcpviz.engine.model_v32_config import tiny_moe_dsa_config
from pcpviz.engine.ref_sparse import sparse_causal_attention

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    parser = "]
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe_model"))
    m = build_model(tiny_moe_dsa_config(torch_dtype="float32", index_topk=16, initializer_range=0.1))
    m.init_weights(torch.Generator().manual_seed(3))
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(4))
    save_model(m, d, dtype=torch.float32)
    return d


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    out = {}
    for pcp in (1, 2):
        trace = str(tmp_path_factory.mktemp(f"moe_pcp{pcp}"))
        res = pcpviz.run(PROMPTS, pcp=pcp, num_speculative_tokens=2, trace_dir=trace, max_new_tokens=NEW,
                         model_dir=model_dir, max_num_batched_tokens=24, progress=False, overwrite=True,
                         dtype="float32")
        out[pcp] = (res, pt.open(trace))
    return out


def _reference_greedy(model_dir: str, ids: list[int]) -> list[int]:
    model = load_model(model_dir)
    seq = torch.tensor(ids)
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(seq, attn=sparse_causal_attention(model))
            seq = torch.cat([seq, logits[-1].argmax().view(1)])
    return seq[len(ids):].tolist()


def _lines(t, step, rank, phase):
    return [str(x) for x in np.asarray(t.record(step, rank, phase)["collectives"])]


@pytest.mark.slow
def test_same_greedy_tokens_at_pcp1_pcp2_and_in_the_reference(runs, model_dir):
    one, two = runs[1][0], runs[2][0]
    assert one.output_token_ids == two.output_token_ids
    for prompt, out in zip(one.prompt_token_ids, one.output_token_ids):
        assert len(out) == NEW and len(set(out)) > 2  # not a constant stream
        assert len(prompt) + NEW > 16  # the indexer chooses 16 among more
        assert out == _reference_greedy(model_dir, prompt)
    assert len(set(two.kv_cache_digests)) == 1  # every rank's replica holds the same KV


@pytest.mark.slow
def test_moe_layers_gather_and_reduce_scatter_in_every_forward(runs):
    t = runs[2][1]
    assert t.meta["model_moe"] is True
    moe = re.compile(r"all_gather pcp float32\[(\d+), 256\] dim=0 \| all_gather pcp float32\[\1, 8\] dim=0 "
                     r"\| reduce_scatter pcp float32\[(\d+), 256\] dim=0")
    for step in t.steps:
        for phase in t.phases(step, 0):
            mine = _lines(t, step, 0, phase)
            assert mine == _lines(t, step, 1, phase)
            if phase == "verify":
                assert mine == []
                continue
            found = moe.findall(" | ".join(mine))
            # one MoE layer in the target (layer 1), one in every draft forward (the MTP block)
            assert len(found) == 1, (step, phase, mine)
            rows, scattered = (int(x) for x in found[0])
            assert scattered == 2 * rows
    report = run_checks(t)
    assert report.results["collectives_match_vllm"].verdict == "pass"
    assert not [n for n, r in report.results.items() if r.verdict == "fail"]


@pytest.mark.slow
def test_pcp1_moe_runs_no_collective(runs):
    t = runs[1][1]
    assert all(_lines(t, s, 0, ph) == [] for s in t.steps for ph in t.phases(s, 0))



@pytest.mark.parametrize("options, why", [({"dcp": 2}, "dense MLA only"), ({"cuda_graphs": True}, "eager only")])
def test_the_engine_refuses_what_its_dsa_path_does_not_do(model_dir, options, why):
    from pcpviz.engine.run_config import build_config

    with pytest.raises(ValueError, match=why):
        build_config(PROMPTS, pcp=2, num_speculative_tokens=2, model_dir=model_dir, **options)


def test_paged_sparse_attention_selects_over_a_scattered_cache_like_the_reference(model_dir):
    """Two chunks of one sequence through ``PagedAttention`` over blocks scattered in the cache:
    the second chunk's logits and every layer's top-k rows equal the reference's (whole sequence,
    no cache)."""
    from pcpviz.engine.attention import PagedAttention
    from pcpviz.engine.dist import SingleRank
    from pcpviz.engine.kv_cache import LatentKVCache

    model = load_model(model_dir)
    cfg, bs = model.config, 8
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    blocks = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int32)
    n_layers = cfg.num_layers + 1
    cache = LatentKVCache(n_layers, 8, bs, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32, "cpu")
    index_cache = LatentKVCache(n_layers, 8, bs, cfg.index_head_dim, 0, torch.float32, "cpu")
    got: list = []
    with torch.no_grad():
        for lo, hi in ((0, 25), (25, 40)):
            pos = torch.arange(lo, hi)
            attn = PagedAttention(model, cache, SingleRank(), expanded=True,
                                  slots=blocks[pos // bs].long() * bs + pos % bs, block_rows=blocks[None],
                                  query_start_loc=torch.tensor([0, hi - lo]), positions=pos,
                                  seq_lens=torch.tensor([hi]), index_cache=index_cache, selections=got)
            logits = model.logits(model.forward_hidden(ids[lo:hi], pos, attn))
        ref_sel: dict = {}
        ref = model(ids, attn=sparse_causal_attention(model, record=ref_sel))
    assert torch.allclose(logits, ref[25:], atol=1e-4)
    second = got[cfg.num_layers:]  # the second chunk's selections, one per layer
    for layer in range(cfg.num_layers):
        mine, theirs = second[layer], ref_sel[layer][25:]
        assert [set(r.tolist()) for r in mine] == [set(r.tolist()) for r in theirs]
        assert (mine >= 0).sum(1).tolist() == [16] * 15


def test_the_moe_rule_reads_the_lines():
    from pcpviz.analysis.checks.collective_checks import moe_collectives_problem

    ok = ["all_gather pcp float32[6, 576] dim=0", "all_gather pcp bfloat16[12, 256] dim=0",
          "all_gather pcp float32[12, 8] dim=0", "reduce_scatter pcp bfloat16[24, 256] dim=0"]
    assert moe_collectives_problem(ok, 2) is None
    assert moe_collectives_problem(ok[:3], 2)[0] == 0  # no reduce-scatter at all
    assert moe_collectives_problem(ok[:1] + ok[2:], 2)[0] == 2  # the rows' gather is missing
    wrong = ok[:3] + ["reduce_scatter pcp bfloat16[12, 256] dim=0"]  # scattered the local rows only
    assert "[24, 256]" in moe_collectives_problem(wrong, 2)[1]


@pytest.mark.slow
def test_a_moe_trace_without_the_moe_collectives_fails(tmp_path):
    """The dense model's PCP = 2 trace relabelled as a MoE model's: its forwards ran no MoE collective."""
    import json

    trace = tmp_path / "t"
    pcpviz.run(PROMPTS[:1], pcp=2, num_speculative_tokens=2, trace_dir=str(trace), max_new_tokens=4, progress=False)
    meta = json.loads((trace / "run.json").read_text())
    meta["model_moe"] = True
    (trace / "run.json").write_text(json.dumps(meta))
    result = run_checks(pt.open(trace)).results["collectives_match_vllm"]
    assert result.verdict == "fail"
    assert "no MoE reduce-scatter" in str(result.first_violation)
