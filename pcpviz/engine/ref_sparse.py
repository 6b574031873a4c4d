"""Reference sparse (DSA) attention for ``TinyDSV32``: one contiguous batch, no cache.

``sparse_causal_attention(model)`` is the ``attn`` callback the tests and the HF parity check use::

    sel = {}
    attn = sparse_causal_attention(model, record=sel)
    logits = model.logits(model.forward_hidden(ids, torch.arange(len(ids)), attn))
    sel[1]            # int64[T, index_topk]: layer 1's selected rows per token (-1: none)

Inside each sequence, query t attends to key s iff ``pos[s] <= pos[t]`` *and* the indexer
selected s for t (``pcpviz.engine.indexer.indexer_topk`` over the sequence's keys). While a
sequence is no longer than ``index_topk`` every visible key is selected: plain causal attention.
MLA in the non-absorbed form, as ``pcpviz.engine.model.causal_attention`` (scores in float32,
``config.softmax_scale``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from pcpviz.engine.indexer import IndexerQK, indexer_topk, selection_mask

__all__ = ["sparse_causal_attention", "sparse_mla", "expand_kv"]


def sparse_mla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, allowed: torch.Tensor,
               scale: float) -> torch.Tensor:
    """One sequence: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], ``allowed`` bool[Tq, Tk] -> [Tq, H, Dv]."""
    sc = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale  # float32[H, Tq, Tk]
    sc = sc.masked_fill(~allowed[None], float("-inf"))
    p = torch.softmax(sc, dim=-1)
    return torch.einsum("hts,shd->thd", p, v.float()).to(v.dtype)


def expand_kv(model, layer_idx: int, latent: tuple[torch.Tensor, torch.Tensor]):
    """Per-head keys [T, H, Dqk] and values [T, H, Dv] from the latent rows (``kv_b_proj``)."""
    cfg, (kv_c, k_pe) = model.config, latent
    T, H = kv_c.shape[0], cfg.num_heads
    w = model.kv_b_weight(layer_idx)
    kv = F.linear(kv_c.to(w.dtype), w).view(T, H, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(T, H, cfg.qk_rope_head_dim).to(k_nope.dtype)], dim=-1)
    return k, v


def sparse_causal_attention(model, query_start_loc: Optional[Sequence[int] | torch.Tensor] = None,
                            positions: Optional[torch.Tensor] = None, *, record: Optional[dict] = None):
    """The reference ``attn`` callback of ``TinyDSV32`` (``index=`` required). ``query_start_loc``
    splits the flat batch into sequences (``None``: one); ``positions`` default to the index
    order inside each sequence. ``record``: filled with ``{layer_idx: int64[T, topk]}``, the
    selected rows of each query within its sequence."""
    qsl = None
    if query_start_loc is not None:
        qsl = [int(v) for v in (query_start_loc.tolist() if torch.is_tensor(query_start_loc) else query_start_loc)]

    def attn(layer_idx: int, q_nope, q_pe, kv_c, k_pe, *, index: IndexerQK):
        T = q_nope.shape[0]
        bounds = qsl if qsl is not None else [0, T]
        if bounds[-1] != T:
            raise ValueError(f"query_start_loc ends at {bounds[-1]} but there are {T} tokens")
        k, v = expand_kv(model, layer_idx, (kv_c, k_pe))
        q = torch.cat([q_nope, q_pe], dim=-1)
        outs, sels = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            pos = positions[a:b] if positions is not None else torch.arange(b - a, device=q.device)
            part = IndexerQK(index.q[a:b], None, index.weights[a:b], index.topk)
            rows = indexer_topk(part, index.k[a:b], q_pos=pos, k_pos=pos)  # int64[L, topk]
            allowed = selection_mask(rows, b - a) & (pos[None, :] <= pos[:, None])
            outs.append(sparse_mla(q[a:b], k[a:b], v[a:b], allowed=allowed, scale=model.config.softmax_scale))
            sels.append(rows)
        if record is not None:
            record[layer_idx] = torch.cat(sels, dim=0)
        return torch.cat(outs, dim=0)

    return attn
