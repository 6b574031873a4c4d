"""Training the MoE + DSA model (``pcpviz.engine.model_v32``): the indexer's objective and the experts' balance.

**The indexer** is trained as DeepSeek-V3.2 trains it (DeepSeek-V3.2 report, sec. 2.1.1): its
output distribution is pulled towards the main attention's, by a KL divergence, and nothing else
trains it. Per layer and query token t::

    p[t, :] = sum_h softmax_h(attention scores)[t, :] / H        (the target, detached)
    q[t, :] = softmax(index scores over the same keys)
    L_I     = sum_t KL(p[t] || q[t]) / T

The indexer's inputs are detached inside the model (``model_v32._V32Block.attn_inputs``), so
``L_I`` trains the indexer's own weights only, and the LM loss never reaches them (the top-k
selection has no gradient). Two stages, as in the report, but from scratch and in one run:

* **dense warm-up** (the first ``dsa_dense_frac`` of the steps): the MLA attends causally to
  every earlier token, the LM loss trains the model, ``L_I`` over all visible keys trains the
  indexer to imitate it;
* **sparse training** (the rest): each query attends to its indexer's ``index_topk`` keys only (as
  vLLM runs the model), so the model learns to work with what the indexer picks; ``L_I`` is taken
  over the selected keys only (``p`` and ``q`` renormalised there).

The report warms the indexer up with the rest of the model frozen, because its model was already
trained; a tiny model trained from scratch in ~200 s cannot afford a frozen phase, hence the
joint dense stage.

``indexer_recall`` measures the result on held-out text: the share of the dense attention that
lands on the indexer's top-k, beside the share of the ``index_topk`` most recent keys (60 CPU steps
at 256-token windows: 0.94 against 0.66; ``training.json`` ``heldout.indexer_recall``).

**The experts' balance** is DeepSeek-V3's auxiliary-loss-free update (DeepSeek-V3 report, sec.
2.1.2): after every step each MoE layer's ``e_score_correction_bias`` moves by ``gamma`` towards
balance, ``b_e += gamma * sign(mean load - load_e)``, where ``load_e`` is how many (token, slot)
pairs the step sent to expert e. The bias only chooses the experts (the weights use the raw
sigmoid scores), so it balances without a loss term that would pull against the LM loss; vLLM
reads it back from the checkpoint as ``mlp.gate.e_score_correction_bias``. No sequence-wise aux
loss: at this size the bias alone keeps every expert in use (``training.json`` records the final
loads).
"""

from __future__ import annotations

from typing import Optional

import torch

from pcpviz.engine.indexer import IndexerQK
from pcpviz.engine.ref_sparse import expand_kv

__all__ = ["DSATrainAttention", "update_expert_bias", "expert_loads", "indexer_recall"]


def _batched_index_scores(index: IndexerQK, B: int, L: int) -> torch.Tensor:
    """float32[B, L, L]: ``sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s])``."""
    q = index.q.reshape(B, L, index.q.shape[-2], index.q.shape[-1])  # [B, L, Hi, Di]
    k = index.k.reshape(B, L, -1)  # [B, L, Di]
    s = torch.einsum("blhd,bsd->blhs", q, k).relu()  # [B, L, Hi, L] (bf16 under autocast: no float copy)
    return torch.einsum("blhs,blh->bls", s, index.weights.reshape(B, L, -1).to(s.dtype)).float()


def _kl(target: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores over ``allowed``)); all float32[B, L, L]."""
    logq = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).masked_fill(~allowed, 0.0)
    logp = torch.log(target.clamp_min(1e-30))
    return (target * (logp - logq)).masked_fill(~allowed, 0.0).sum(-1).mean()


class DSATrainAttention:
    """The training ``attn`` callback: ``B`` windows of ``L`` tokens each, causal in index order,
    dense or indexer-sparse; ``kl`` collects each layer's indexer loss ``L_I``.

    It computes the attention probabilities explicitly (the KL needs them): memory
    ``B * H * L * L`` floats per layer, besides the indexer's ``B * L * Hi * L``.
    """

    def __init__(self, model, batch: int, seq_len: int, *, sparse: bool, recall: Optional[list] = None):
        self.model, self.B, self.L, self.sparse = model, batch, seq_len, sparse
        self.kl: list[torch.Tensor] = []
        self.recall = recall  # dense mode: gets each layer's (indexer top-k mass, recent-k mass)

    def __call__(self, layer_idx: int, q_nope, q_pe, kv_c, k_pe, *, index: IndexerQK):
        B, L, cfg = self.B, self.L, self.model.config
        H = cfg.num_heads
        k, v = expand_kv(self.model, layer_idx, (kv_c, k_pe))  # [T, H, Dqk], [T, H, Dv]
        q = torch.cat([q_nope, q_pe], dim=-1).reshape(B, L, H, -1)
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # bool[L, L]
        iscores = _batched_index_scores(index, B, L)  # float32[B, L, L]
        allowed = causal.expand(B, L, L)
        if self.sparse:
            top = iscores.detach().masked_fill(~causal, float("-inf")).topk(min(index.topk, L), dim=-1).indices
            allowed = torch.zeros(B, L, L, dtype=torch.bool, device=q.device).scatter(-1, top, True) & causal
        sc = torch.einsum("blhd,bshd->bhls", q, k.reshape(B, L, H, -1)).float() * cfg.softmax_scale
        p = torch.softmax(sc.masked_fill(~allowed[:, None], float("-inf")), dim=-1)  # float32[B, H, L, L]
        out = torch.einsum("bhls,bshd->blhd", p.to(v.dtype), v.reshape(B, L, H, -1))
        self.kl.append(_kl(p.detach().mean(1), iscores, allowed))
        if self.recall is not None and not self.sparse:
            self.recall.append(_topk_mass(p.detach().mean(1), iscores.detach(), causal, index.topk))
        return out.reshape(B * L, H, -1)

    def indexer_loss(self) -> Optional[torch.Tensor]:
        """The mean of the layers' ``L_I`` (None before a forward)."""
        return torch.stack(self.kl).mean() if self.kl else None


def _topk_mass(target: torch.Tensor, iscores: torch.Tensor, causal: torch.Tensor, topk: int) -> tuple[float, float]:
    """(share of the dense attention mass on the indexer's top-k, on the ``topk`` most recent keys),
    over the queries with more than ``topk`` visible keys; ``target`` float32[B, L, L]."""
    L = target.shape[-1]
    if L <= topk:
        return 1.0, 1.0
    top = iscores.masked_fill(~causal, float("-inf")).topk(topk, dim=-1).indices  # [B, L, k]
    t = torch.arange(L, device=target.device)
    recent = causal & (t[None, :] > t[:, None] - topk)  # bool[L, L]
    rows = t >= topk
    picked = target.gather(-1, top).sum(-1)[:, rows]
    return float(picked.mean()), float((target * recent).sum(-1)[:, rows].mean())


@torch.no_grad()
def indexer_recall(model, stream: torch.Tensor, seq_len: int, *, windows: int, device, autocast) -> dict:
    """How much of the main attention the indexer's top-k holds, on held-out windows (dense
    attention, every layer): ``indexer_topk_mass`` against ``recent_topk_mass``, what the
    ``index_topk`` most recent keys hold (a sliding window's share). 1.0 would be a perfect indexer."""
    model.eval()
    n = max(1, min(windows, (stream.numel() - 2) // seq_len))
    w = torch.stack([stream[i * seq_len:i * seq_len + seq_len] for i in range(n)]).to(device)
    recall: list = []
    attn = DSATrainAttention(model, n, seq_len, sparse=False, recall=recall)
    with autocast():
        model.forward_hidden(w.reshape(-1), torch.arange(seq_len, device=device).repeat(n), attn)
    model.train()
    return {"windows": n, "seq_len": seq_len, "indexer_topk_mass": round(sum(r[0] for r in recall) / len(recall), 4),
            "recent_topk_mass": round(sum(r[1] for r in recall) / len(recall), 4)}


def expert_loads(model) -> list[list[float]]:
    """Each MoE layer's share of the last forward's (token, slot) pairs per expert."""
    out = []
    for moe in model.moe_layers():
        if moe.last_load is not None:
            out.append([round(x, 4) for x in (moe.last_load / moe.last_load.sum()).tolist()])
    return out


@torch.no_grad()
def update_expert_bias(model, gamma: float) -> None:
    """DeepSeek-V3's bias update from the last forward's loads: ``b += gamma * sign(mean - load)``."""
    for moe in model.moe_layers():
        if moe.last_load is None:
            continue
        load = moe.last_load.to(moe.gate.e_score_correction_bias.device)
        moe.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
