"""The MoE + DSA model (``pcpviz.engine.model_v32``, ``.moe``, ``.indexer``, ``.ref_sparse``): routing,
the sharded MoE, the indexer's selection and the sparse reference attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcpviz.engine.indexer import IndexerQK, index_scores, indexer_topk, selection_mask
from pcpviz.engine.model import causal_attention
from pcpviz.engine.model_v32 import TinyDSV32, build_model
from pcpviz.engine.model_v32_config import tiny_moe_dsa_config
from pcpviz.engine.moe import route
from pcpviz.engine.ref_sparse import sparse_causal_attention


def _model(seed: int = 0, **over) -> TinyDSV32:
    m = build_model(tiny_moe_dsa_config(**over))
    m.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(seed + 1))
    return m.eval()


def test_routing_bias_chooses_but_does_not_weigh():
    logits = torch.logit(torch.tensor([[0.9, 0.2, 0.6, 0.5]]))
    plain = route(logits, torch.zeros(4), 2)
    biased = route(logits, torch.tensor([-0.5, 0.0, 0.0, 0.2]), 2, scaling=2.5)
    assert plain.ids.tolist() == [[0, 2]]
    assert biased.ids.tolist() == [[3, 2]]
    assert torch.allclose(biased.weights, torch.tensor([[0.5, 0.6]]) / 1.1 * 2.5)
    assert torch.allclose(route(logits, torch.zeros(4), 2, renormalize=False).weights, torch.tensor([[0.9, 0.6]]))


def test_moe_dense_compute_equals_the_per_token_experts_and_shards_add_up():
    m = _model()
    moe = m.moe_layers()[0]
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    logits = moe.gate(x)
    r = moe.routing(logits)
    want = torch.stack([sum(r.weights[t, j] * moe.experts[int(r.ids[t, j])](x[t]) for j in range(2))
                        for t in range(7)])
    with torch.no_grad():
        full = moe.routed(x, logits)
        halves = moe.routed(x, logits, shard=(0, 64)) + moe.routed(x, logits, shard=(64, 128))
        out = moe(x)
    assert torch.allclose(full, want, atol=1e-5)
    assert torch.allclose(halves, full, atol=1e-5)
    assert torch.allclose(out, full + moe.shared_experts(x), atol=1e-5)
    assert len({tuple(row) for row in r.ids.tolist()}) > 1  # the tokens do not all go to the same experts


def test_indexer_topk_is_causal_best_first_and_padded():
    g = torch.Generator().manual_seed(0)
    # positive q, k: no score is clipped to a tie at 0 by the relu
    q, k, w = torch.rand(6, 3, 8, generator=g), torch.rand(6, 8, generator=g), torch.rand(6, 3, generator=g)
    pos = torch.arange(6)
    rows = indexer_topk(IndexerQK(q, k, w, 4), k, q_pos=pos, k_pos=pos)
    scores = index_scores(q, k, w)
    for t in range(6):
        got = [r for r in rows[t].tolist() if r >= 0]
        assert len(got) == min(4, t + 1) and all(r <= t for r in got)
        assert got == sorted(range(t + 1), key=lambda s: -float(scores[t, s]))[:4]
        assert rows[t].tolist()[len(got):] == [-1] * (4 - len(got))
    mask = selection_mask(rows, 6)
    assert mask.sum(1).tolist() == [1, 2, 3, 4, 4, 4]


def test_sparse_attention_is_causal_attention_while_the_context_fits_topk():
    m = _model()
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64)
    sel: dict = {}
    with torch.no_grad():
        sparse = m.logits(m.forward_hidden(ids, pos, sparse_causal_attention(m, record=sel)))

        def dense(layer_idx, q_nope, q_pe, kv_c, k_pe, *, index):
            return causal_attention(m, use_sdpa=False)(layer_idx, q_nope, q_pe, kv_c, k_pe)

        full = m.logits(m.forward_hidden(ids, pos, dense))
    assert torch.allclose(sparse, full, atol=1e-5)
    assert sorted(sel) == [0, 1] and sel[1].shape == (64, 64)
    assert (sel[1] >= 0).sum(1).tolist() == list(range(1, 65))


def test_sparsity_changes_the_output_past_topk_and_selects_topk_rows():
    m = _model(index_topk=16)
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(2))
    sel: dict = {}
    with torch.no_grad():
        sparse = m(ids, attn=sparse_causal_attention(m, record=sel))
        wide = dataclasses.replace(m.config, index_topk=64)
        m.config = wide
        for layer in m.model.layers:
            layer.self_attn.indexer.cfg = wide
        dense = m(ids)
    assert torch.allclose(sparse[:16], dense[:16], atol=1e-5)  # the first 16 tokens see everything
    assert (sparse[16:] - dense[16:]).abs().max() > 1e-3
    assert ((sel[0] >= 0).sum(1) == torch.clamp(torch.arange(48) + 1, max=16)).all()


def test_moe_layers_are_layer_1_and_the_mtp_block():
    m = _model()
    kinds = [type(layer.mlp).__name__ for layer in m.model.layers]
    assert kinds == ["MLP", "MoE", "MoE"]
    assert all(hasattr(layer.self_attn, "indexer") for layer in m.model.layers)


def test_the_mtp_block_runs_sparse_with_moe():
    m = _model()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(39)
    with torch.no_grad():
        attn = sparse_causal_attention(m)
        h = m.forward_hidden(ids[:-1], pos, attn)
        mh = m.mtp_forward(ids[1:], pos, h, attn=attn)
        assert m.mtp_logits(mh).shape == (39, 264)
    with pytest.raises(TypeError):  # the sparse model's callback must take the indexer's tensors
        m.forward_hidden(ids, torch.arange(40), causal_attention(m))
