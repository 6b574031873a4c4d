"""Training the MoE + DSA model (``tools.train.objective_v32``, ``tools.train.train --config``): the
indexer learns from its KL only, the experts' bias moves towards balance, a CPU smoke run writes a
model directory that loads."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pcpviz.engine.checkpoint import load_model
from pcpviz.engine.model_v32 import TinyDSV32, build_model
from pcpviz.engine.model_v32_config import moe_model_dir, tiny_moe_dsa_config
from tools.train.objective import window_losses
from tools.train.objective_v32 import update_expert_bias


def _model() -> TinyDSV32:
    m = build_model(tiny_moe_dsa_config(index_topk=8))
    m.init_weights(torch.Generator().manual_seed(0))
    return m.train()


def _indexer_grads(m: TinyDSV32) -> float:
    return sum(float(p.grad.abs().sum()) for n, p in m.named_parameters() if ".indexer." in n and p.grad is not None)


@pytest.mark.parametrize("sparse", [False, True])
def test_the_indexer_learns_from_its_kl_only(sparse):
    m = _model()
    w = torch.randint(0, 256, (2, 34), generator=torch.Generator().manual_seed(1))
    stats: dict = {}
    total, main, mtp, _, _ = window_losses(m, w, mtp_weight=0.3, dsa_sparse=sparse, stats=stats)
    (main + 0.3 * mtp).backward(retain_graph=True)
    assert _indexer_grads(m) == 0.0  # the LM loss does not reach the indexer (inputs detached, top-k)
    assert float(m.model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum()) > 0
    m.zero_grad()
    (total - main - 0.3 * mtp).backward()  # the KL alone
    assert _indexer_grads(m) > 0
    assert float(m.model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum()) == 0.0  # ... and nothing else
    assert float(stats["indexer_kl"]) > 0


def test_sparse_training_attends_to_topk_and_changes_the_loss():
    m = _model()
    w = torch.randint(0, 256, (2, 34), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dense = window_losses(m, w, mtp_weight=0.3, dsa_sparse=False)[1]
        sparse = window_losses(m, w, mtp_weight=0.3, dsa_sparse=True)[1]
        m.eval()  # the reference sparse attention (inference) gives the sparse stage's logits
        ref = m(w[0, :32])
    assert abs(float(dense) - float(sparse)) > 1e-4
    with torch.no_grad():
        m.train()
        lg = window_losses(m, w, mtp_weight=0.3, dsa_sparse=True)[3]
    assert torch.allclose(lg[0], ref, atol=1e-4)


def test_bias_update_moves_towards_balance():
    m = _model()
    moe = m.moe_layers()[0]
    moe.last_load = torch.tensor([10.0, 0, 0, 2, 4, 0, 0, 0])
    update_expert_bias(m, 0.01)
    b = moe.gate.e_score_correction_bias
    assert b[0] < 0 and b[1] > 0 and b[4] < 0  # mean load 2: overloaded experts lose, idle ones gain
    assert b[3] == 0  # expert 3 has the mean load: sign(0) = 0


def test_cpu_smoke_run_writes_a_loadable_moe_model(tmp_path):
    from tools.train.train import main

    out = str(tmp_path / "moe")
    rec = main(["--config", os.path.join(moe_model_dir(), "config.json"), "--out", out, "--device", "cpu",
                "--steps", "3", "--batch", "2", "--seq-len", "80", "--eval-tokens", "160", "--long-eval-tokens", "0",
                "--dsa-dense-frac", "0.34", "--log-every", "1", "--bias-update-speed", "0.01"])
    assert [h["step"] for h in rec["loss_history"]] == [0, 1, 2]
    assert all(h["indexer_kl"] >= 0 for h in rec["loss_history"])
    model = load_model(out)
    assert isinstance(model, TinyDSV32) and model.config.index_topk == 64
    assert any(float(m.gate.e_score_correction_bias.abs().max()) > 0 for m in model.moe_layers())
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_type"] == "deepseek_v32"
    assert len(rec["expert_loads_last_step"]) == 2  # layer 1 and the MTP block
    assert 0 <= rec["heldout"]["indexer_recall"]["indexer_topk_mass"] <= 1


def test_topk_mass_of_a_perfect_and_of_a_recency_indexer():
    from tools.train.objective_v32 import _topk_mass

    L, k = 12, 3
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(0)
    target = torch.rand(1, L, L, generator=g).masked_fill(~causal, 0)
    target = target / target.sum(-1, keepdim=True)
    best = target.topk(k, dim=-1).values.sum(-1)[:, k:].mean()
    perfect, recent = _topk_mass(target, target.clone(), causal, k)  # the indexer scores = the attention
    assert abs(perfect - float(best)) < 1e-6
    t = torch.arange(L)
    assert abs(recent - float((target * (causal & (t[None] > t[:, None] - k))).sum(-1)[:, k:].mean())) < 1e-6
    recency_scores = t[None, None, :].float().expand(1, L, L)  # scores rising with position: the last k
    assert abs(_topk_mass(target, recency_scores, causal, k)[0] - recent) < 1e-6
    assert perfect >= recent
