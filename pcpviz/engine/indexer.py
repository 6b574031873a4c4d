"""DeepSeek-V3.2's lightning indexer (DSA): which earlier tokens each new token's MLA attends to.

Re-derived from vLLM 0.33.0 ``Indexer`` (``model_executor/models/deepseek_v2.py:679-848``) and
``SparseAttnIndexer`` (``model_executor/layers/sparse_attn_indexer.py``). Per layer, for a new
token t with normed hidden row ``x_t`` and q-LoRA latent ``qr_t`` (``q_a_layernorm(q_a_proj(x_t))``)::

    q[t]  = rope(wq_b(qr_t).view(Hi, Di))              # Hi query heads of width Di = 128
    k[t]  = rope(k_norm(wk(x_t)))                       # one key (MQA), LayerNorm with bias
    w[t]  = weights_proj(x_t) * Di**-0.5 * Hi**-0.5     # a weight per head
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])  # for every earlier token s (pos_s <= pos_t)
    topk[t] = the index_topk tokens s of highest score  # -1 where there are fewer

Rope here is NeoX style (halves, not interleaved pairs: vLLM ``is_neox_style=not
indexer_rope_interleave``, ``deepseek_v2.py:1173-1178``) on the *first* ``qk_rope_head_dim``
dims of q and k (``deepseek_v2.py:815-838``: ``[pe, nope]`` order, where MLA puts rope last).

Worked example of the score and the selection (2 heads, 3 keys, top-2)::

    >>> q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])          # [T=1, Hi=2, Di=2]
    >>> k = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, -1.0]])  # [3, Di]
    >>> w = torch.tensor([[0.5, 1.0]])                         # [T, Hi]
    >>> index_scores(q, k, w)      # key 0: 0.5*1 + 1*0; key 1: 0.5*0 + 1*2; key 2: relu clips both
    tensor([[0.5000, 2.0000, 0.0000]])
    >>> indexer_topk(IndexerQK(q, None, w, 2), k, q_pos=torch.tensor([1]), k_pos=torch.tensor([0, 1, 2]))
    tensor([[1, 0]])

(the key at position 2 is after the query's position 1: masked, never selected). What vLLM does
that this reference does not: it quantizes q and k to fp8 e4m3 with a per-128 ue8m0 scale
(``deepseek_v2.py:841-852``; the k cache is fp8 + scale, ``deepseek_v2.py:726-734``), so its scores,
and at near-ties its selection, differ slightly; its top-k kernel breaks exact ties in its own order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pcpviz.engine.model_config import TinyDSV3Config

__all__ = ["Indexer", "IndexerQK", "apply_rope_neox", "index_scores", "indexer_topk", "selection_mask"]


class IndexerQK(NamedTuple):
    """What a layer's indexer hands the attention callback for its T new tokens."""

    q: torch.Tensor  # [T, Hi, Di]  rope applied
    k: Optional[torch.Tensor]  # [T, Di]  rope applied; the callback caches it
    weights: torch.Tensor  # float32[T, Hi]  softmax scale and Hi**-0.5 folded in
    topk: int  # index_topk


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + D/2])`` by angle ``i`` (NeoX / half-split style).

    ``x``: [T, ..., D]; ``cos``/``sin``: float32[T, D/2] (``pcpviz.engine.model.rope_cos_sin``).
    """
    dtype = x.dtype
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)


class Indexer(nn.Module):
    """``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm`` (LayerNorm), ``weights_proj``."""

    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.cfg = cfg
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, hi * di, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)  # deepseek_v2.py:720 (float32 there)
        self.weights_proj = nn.Linear(cfg.hidden_size, hi, bias=False)

    def project(self, x: torch.Tensor, qr: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """(q [T, Hi, Di], k [T, Di], weights float32[T, Hi]) of the normed rows ``x`` [T, hidden]
        and their q-LoRA latents ``qr`` [T, q_lora_rank]; ``rope``: (cos, sin) at their positions."""
        c, (cos, sin) = self.cfg, rope
        T, R = x.shape[0], c.qk_rope_head_dim
        q = self.wq_b(qr).view(T, c.index_n_heads, c.index_head_dim)  # [T, Hi, Di]
        k = F.layer_norm(self.wk(x).float(), (c.index_head_dim,), self.k_norm.weight.float(),
                         self.k_norm.bias.float(), self.k_norm.eps).to(x.dtype)  # [T, Di]
        q = torch.cat([apply_rope_neox(q[..., :R], cos, sin), q[..., R:]], dim=-1)
        k = torch.cat([apply_rope_neox(k[:, :R], cos, sin), k[:, R:]], dim=-1)
        # deepseek_v2.py:850: weights * q_scale * softmax_scale * n_head**-0.5 (q_scale: fp8, 1 here)
        w = self.weights_proj(x).float() * (c.index_head_dim ** -0.5) * (c.index_n_heads ** -0.5)  # [T, Hi]
        return q, k, w


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32[Tq, Tk]: ``sum_h w[t, h] * relu(q[t, h] . k[s])`` (no causal mask)."""
    s = torch.einsum("thd,sd->ths", q.float(), k.float()).relu()  # [Tq, Hi, Tk]
    return torch.einsum("ths,th->ts", s, w.float())


def indexer_topk(index: IndexerQK, k_ctx: torch.Tensor, *, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """int64[Tq, topk]: for each query, the rows of ``k_ctx`` [Tk, Di] (the sequence's cached
    indexer keys, at positions ``k_pos`` int64[Tk]) of highest score among those at or before its
    position ``q_pos`` int64[Tq], best first; -1 where fewer than ``topk`` are visible."""
    scores = index_scores(index.q, k_ctx, index.weights)  # float32[Tq, Tk]
    visible = k_pos[None, :] <= q_pos[:, None]  # bool[Tq, Tk]
    scores = scores.masked_fill(~visible, float("-inf"))
    n = min(index.topk, k_ctx.shape[0])
    top = scores.topk(n, dim=-1)  # values, indices [Tq, n]
    rows = torch.where(torch.isinf(top.values), torch.full_like(top.indices, -1), top.indices)
    if n < index.topk:
        rows = torch.cat([rows, rows.new_full((rows.shape[0], index.topk - n), -1)], dim=1)
    return rows


def selection_mask(rows: torch.Tensor, n_keys: int) -> torch.Tensor:
    """bool[Tq, n_keys]: True at the selected rows (``indexer_topk``'s, -1 ignored)."""
    mask = torch.zeros(rows.shape[0], n_keys + 1, dtype=torch.bool, device=rows.device)
    mask.scatter_(1, torch.where(rows < 0, n_keys, rows), True)
    return mask[:, :n_keys]
