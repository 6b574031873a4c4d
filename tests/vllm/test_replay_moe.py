"""Issue 36: the CPU replay runs the MoE + DSA checkpoint (``data/models/pcpviz-tiny-moe-dsa``) behind vLLM
0.33.0's runner, PCP manager and MTP speculator: greedy tokens equal the model's own and the engine's, the
MoE layers' PCP collectives are ledgered in every forward (target, draft_0, the replicated draft decodes, the
dummy run) and none in verify, ``pcpviz check`` passes, and a dropped MoE collective fails at its phase."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

import pcpviz.trace as pt  # noqa: E402
from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.engine.model_v32_config import moe_model_dir  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402
from pcpviz.vllm.replay.tiny import tiny_model  # noqa: E402
from tests.helpers.hostile import rewrite  # noqa: E402
from replay_tokens import replay_tokens  # noqa: E402

pytestmark = pytest.mark.slow

MOE = moe_model_dir()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {pcp: replay(pcp=pcp, mtp=2, trace_dir=root / f"pcp{pcp}", scenario="long_context", model_dir=MOE)
            for pcp in (1, 2)}


def _lines(t, step, rank, phase) -> list[str] | None:
    rec = t.record(step, rank, phase)
    return None if "collectives" not in rec.keys() else [str(x) for x in np.asarray(rec["collectives"])]


def test_greedy_tokens_are_the_models_own_at_pcp_1_and_2(runs):
    """Each request's sampled tokens are the reference model's greedy continuation (teacher-forced: one
    forward of prompt + output, reference sparse attention over the whole sequence), at PCP=1 and 2."""
    model = tiny_model(MOE)
    toks = {pcp: replay_tokens(res) for pcp, res in runs.items()}
    assert toks[1] == toks[2]
    prompts = runs[2].meta["prompt_token_ids"]
    longest = 0
    for rid, out in toks[2].items():
        seq = torch.tensor(list(prompts[rid]) + out)
        with torch.no_grad():
            top1 = model.forward(seq).argmax(-1)
        n = len(prompts[rid])
        assert out == top1[n - 1:len(seq) - 1].tolist(), rid
        longest = max(longest, len(seq))
    assert longest > model.config.index_topk + 4
    # the indexer selected a part of the context: a selected row past 63 of exactly index_topk selected
    for res in runs.values():
        sels = [s for rank in res.indexer_selections for per_model in rank.values() for s in per_model]
        assert sels and any(int(s.max()) >= model.config.index_topk for s in sels)
    assert sum(len(t) for t in toks[2].values()) > 20


def test_tokens_equal_the_engines_on_the_same_prompts(runs):
    from pcpviz.engine.launch import run

    toks = replay_tokens(runs[2])
    prompts = runs[2].meta["prompt_token_ids"]
    rids = sorted(toks)
    res = run([prompts[r] for r in rids], pcp=1, num_speculative_tokens=2, device="cpu", model_dir=MOE,
              max_new_tokens=max(len(t) for t in toks.values()), progress=False, stop_at_eos=False)
    for rid, engine_out in zip(rids, res.output_token_ids):
        assert toks[rid] == list(engine_out[: len(toks[rid])]), rid


def test_the_moe_collectives_are_in_every_forward_and_check_passes(runs):
    for pcp, res in runs.items():
        t = pt.open(res.trace_path)
        assert t.meta["model_moe"] is True and "pcpviz-tiny-moe-dsa" in t.meta["models"]
        assert t.meta["model"] == MOE
        report = run_checks(t)
        assert report.ok, report.format()
        assert report.results["collectives_match_vllm"].verdict == "pass"
    t = pt.open(runs[2].trace_path)
    phases_seen = set()
    for step in t.steps:
        for phase in t.phases(step, 0):
            lines = [_lines(t, step, r, phase) for r in t.ranks]
            if lines[0] is None:
                continue
            assert lines[0] == lines[1], (step, phase)
            if phase == "verify":
                assert lines[0] == []
                continue
            scatters = [i for i, x in enumerate(lines[0]) if x.startswith("reduce_scatter pcp ")]
            assert scatters, (step, phase, lines[0])
            rows = lines[0][scatters[-1] - 2]
            assert rows.startswith("all_gather pcp float32[") and rows.endswith(", 256] dim=0")
            assert lines[0][scatters[-1] - 1].endswith(", 8] dim=0")  # the router logits: 8 experts
            phases_seen.add(phase)
    assert {"target", "draft_0", "draft_1", "dummy"} <= phases_seen
    d = runs[2].dummy[0]
    assert d["moe_reduce_scatters"] > 0 and d["all_gathers"] == 0  # the profile run: the MoE's collectives only
    assert runs[1].dummy[0]["moe_reduce_scatters"] == 0  # PCP=1: no collective


def _first_draft_1(t) -> int:
    return next(s for s in t.steps if "draft_1" in t.phases(s, 0))


def test_a_reduce_scatter_dropped_on_one_rank_fails_at_its_phase(runs, tmp_path):
    src = runs[2].trace_path
    step = _first_draft_1(pt.open(src))

    def edit(s, rank, phases):
        if s == step and rank == 1 and "draft_1" in phases:
            lines = [str(x) for x in np.asarray(phases["draft_1"]["collectives"])]
            phases["draft_1"]["collectives"] = np.array([x for x in lines if not x.startswith("reduce_scatter")],
                                                        dtype=str)

    res = run_checks(pt.open(rewrite(src, tmp_path / "bad", edit))).results["collectives_match_vllm"]
    assert res.verdict == "fail" and res.first_violation.step == step and res.first_violation.phase == "draft_1"


def test_a_skipped_router_logits_gather_fails_at_its_phase(runs, tmp_path):
    src = runs[2].trace_path

    def edit(s, rank, phases):
        if s == 1 and "target" in phases:
            lines = [str(x) for x in np.asarray(phases["target"]["collectives"])]
            phases["target"]["collectives"] = np.array([x for x in lines if not x.endswith(", 8] dim=0")], dtype=str)

    res = run_checks(pt.open(rewrite(src, tmp_path / "bad", edit))).results["collectives_match_vllm"]
    assert res.verdict == "fail" and res.first_violation.step == 1 and res.first_violation.phase == "target"
    assert "router logits" in res.first_violation.message


def test_the_indexer_fold_on_the_replays_own_writes(runs):
    """``pcpviz.reference.indexer_fold`` on the indexer-key writes the replay made (vLLM's fold of
    sparse_attn_indexer.py:553-559, then its ``maybe_gather_indexer_k``), their mappings the ones the
    trace recorded: the target's and draft step 0's are expanded ([N*P]) and fold to P, the replicated
    draft decodes' are unexpanded ([R]) and do not; every call is right."""
    from pcpviz.reference.indexer_fold import indexer_call, search

    res, n = runs[2], 2
    t = pt.open(res.trace_path)
    calls = []
    for rank in t.ranks:
        writes = res.indexer_writes[rank]
        assert {w.forward for w in writes["target"]} == set(range(len(res.steps)))
        assert {w.forward for w in writes["mtp"]} == set(range(2 * len(res.steps)))  # K = 2 forwards a step
        for model, w in [("target", w) for w in writes["target"]] + [("mtp", w) for w in writes["mtp"]]:
            step, draft = (w.forward, None) if model == "target" else divmod(w.forward, 2)
            phase, view = ("target", "slot_mapping_gathered") if draft is None else (f"draft_{draft}",
                                                                                    "slot_mapping_draft")
            recorded = np.asarray(t.record(step, rank, phase)[view])
            assert w.slot_mapping_rows == recorded.shape[-1], (step, rank, phase)
            kind = {None: "target", 0: "draft_prefill", 1: "draft_decode"}[draft]
            call = indexer_call(kind, n, w.k_rows)
            assert (call.slot_mapping_rows, call.kept_rows) == (w.slot_mapping_rows, w.kept_rows), (kind, w)
            assert call.folds == (kind != "draft_decode") and call.right
            # sharded decodes: an expanded mapping gathers every rank's P rows, an unexpanded one writes its own
            assert w.written_rows == (n * w.kept_rows if call.folds else w.kept_rows)
            calls.append(call)
    found = search(calls)
    assert found.wrong == () and set(found.kinds) == {"target", "draft_prefill", "draft_decode"}
    single = [w for ws in runs[1].indexer_writes[0].values() for w in ws]
    assert single and all(w.kept_rows == w.k_rows == w.slot_mapping_rows for w in single)  # PCP = 1: no fold


def test_a_run_that_recomputes_the_router_logits_instead_of_gathering_them_fails_at_target(runs, tmp_path,
                                                                                            monkeypatch):
    """A fault planted in the run, not the trace: every rank skips the router-logits all-gather and
    recomputes the logits from the gathered rows. Same logits, same tokens (so a token comparison
    passes), but not vLLM's collectives (moe_runner.py:824-829): check fails at the first target phase."""
    from pcpviz.engine.moe import MoE

    def forward(self, x, comm=None):
        shared = self.shared_experts(x)
        xs = comm.all_gather(x)
        inter, n, r = self.cfg.moe_intermediate_size, comm.world_size, comm.rank
        part = self.routed(xs, self.gate(xs), shard=(r * inter // n, (r + 1) * inter // n))
        return shared + comm.reduce_scatter(part)

    monkeypatch.setattr(MoE, "forward", forward)
    bad = replay(pcp=2, mtp=2, trace_dir=tmp_path / "bad", scenario="long_context", model_dir=MOE, dummy=False)
    assert replay_tokens(bad) == replay_tokens(runs[2])
    res = run_checks(pt.open(bad.trace_path)).results["collectives_match_vllm"]
    assert res.verdict == "fail" and res.first_violation.step == 0 and res.first_violation.phase == "target"
    assert "router logits" in res.first_violation.message


def test_a_bad_model_dir_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        replay(pcp=2, mtp=2, record=False, model_dir=tmp_path)
    with pytest.raises(ValueError, match="models='scripted' has none"):
        replay(pcp=2, mtp=2, record=False, model_dir=MOE, models="scripted")
    with pytest.raises(ValueError, match="pcp=3: the MoE layers split each expert's 128"):
        replay(pcp=3, mtp=2, record=False, model_dir=MOE)
