"""DSA sparse MLA over the engine's paged caches (the MoE + DSA model, ``pcpviz.engine.model_v32``).

Per layer the engine keeps two paged caches with the same slots: the latent ``[kv_c, k_pe]`` rows
(``LatentKVCache``) and the indexer's keys ``[index_head_dim]`` (a second ``LatentKVCache`` with no
rope part; vLLM: the indexer's own ``k_cache``, ``model_executor/models/deepseek_v2.py:729-734``).
For each batch row (a request's queries at ``positions``, context ``seq_len``)::

    slots  = context_slots(block_row, seq_len)            # int64[n]: positions 0..n-1
    rows   = indexer_topk(q_idx, index_cache[slots], ...) # int64[q, topk]: rows of the context (-1: none)
    out    = MLA over latent[slots] where selected and causal

vLLM turns the request-relative top-k rows into cache slots the same way
(``convert_req_index_to_global_index`` in the sparse MLA backends) and its sparse kernel reads only
those. This is the torch reference (host loop over rows, no CUDA graph): absorbed MLA like
``kv_cache.paged_mla_attention``'s torch path, masked to the selection.

Example: index_topk 64, a request at position 99 decoding one token (seq_len 100): its query
scores the 100 cached index keys and attends to 64 of them; at position 40 (seq_len 41) all 41.
"""

from __future__ import annotations

from typing import Optional

import torch

from pcpviz.engine.indexer import IndexerQK, indexer_topk, selection_mask
from pcpviz.engine.kv_cache import context_slots

__all__ = ["sparse_paged_mla"]


def _attend_selected(q_nope, q_pe, lat, allowed, *, w_uk, w_uv, scale):
    """Absorbed MLA of q [q, H, *] over the latents lat [n, R + Dr] where ``allowed`` bool[q, n]."""
    r = w_uk.shape[-1]
    kv_c, k_pe = lat[:, :r], lat[:, r:]
    q_lat = torch.einsum("qhd,hdr->qhr", q_nope.float(), w_uk.float())  # [q, H, R]
    scores = (torch.einsum("qhr,kr->qhk", q_lat, kv_c) + torch.einsum("qhd,kd->qhk", q_pe.float(), k_pe)) * scale
    probs = torch.softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)  # [q, H, n]
    ctx = torch.einsum("qhk,kr->qhr", probs, kv_c)
    return torch.einsum("qhr,hvr->qhv", ctx, w_uv.float())


def sparse_paged_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, index: IndexerQK, *, cache: torch.Tensor,
                     index_cache: torch.Tensor, block_rows: torch.Tensor, query_start_loc: torch.Tensor,
                     positions: torch.Tensor, seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     block_size: int, scale: float, record: Optional[list] = None) -> torch.Tensor:
    """float32[Q, H, Dv]: each row's queries over the indexer's top-k of its context.

    ``cache`` [num_slots, R + Dr] and ``index_cache`` [num_slots, Di] are one layer's caches,
    already holding this step's entries; ``index`` the queries' indexer q [Q, Hi, Di] and weights
    float32[Q, Hi]. ``record``: gets each row's int64[q, topk] selection appended (tests)."""
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float32, device=q_nope.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        lo, hi, n = qsl[b], qsl[b + 1], int(lens[b])
        if hi <= lo or n <= 0:
            continue
        slots = context_slots(block_rows[b], n, block_size)  # int64[n]
        kpos = torch.arange(n, device=q_nope.device)
        pos = positions[lo:hi]
        part = IndexerQK(index.q[lo:hi], None, index.weights[lo:hi], index.topk)
        rows = indexer_topk(part, index_cache[slots], q_pos=pos, k_pos=kpos)  # int64[q, topk]
        allowed = selection_mask(rows, n) & (kpos[None, :] <= pos[:, None])  # bool[q, n]
        out[lo:hi] = _attend_selected(q_nope[lo:hi], q_pe[lo:hi], cache[slots].float(), allowed,
                                      w_uk=w_uk, w_uv=w_uv, scale=scale)
        if record is not None:
            record.append(rows)
    return out
