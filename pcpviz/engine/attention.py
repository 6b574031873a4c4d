"""The attention callback the model calls per layer, in the two PCP modes.

* ``expanded`` (target forward and draft step 0): each rank's new latents are
  all-gathered (``[P] -> [N*P]`` rows) and written through the gathered slot
  mapping (PAD rows skipped), so every rank's replica receives every token's KV;
  the rank's local queries then attend over their requests' whole context.
* ``local`` (replicated draft decodes 1..K-1): every rank runs the same global
  rows and writes its own replica through the unexpanded length-R mapping; no
  collective.

The fault ``fold_slot_mapping_without_shape_check`` lives here. It is an illustration
(``Fault.faithful`` is False): it folds the latent KV *and* the mapping by the world size
regardless of the mapping's shape. vLLM's pre-fix fold was in the sparse indexer's key-cache
write and truncated only ``k``; the dense model has no indexer.

The MoE + DSA model (``pcpviz.engine.model_v32``) calls with ``index=`` (its indexer's q, k and
weights): the indexer keys are all-gathered (expanded mode; vLLM ``maybe_gather_indexer_k``,
``v1/attention/ops/pcp.py:91-103``, called from ``model_executor/layers/sparse_attn_indexer.py:
561-567``; a replicated draft decode's unexpanded mapping writes them ungathered, lines 553-559)
and written by the same slot mapping into ``index_cache`` first -- vLLM's MLA runs the indexer,
whose op writes its k cache, before the attention writes the latent
(``model_executor/layers/mla.py:233``) -- then the attention runs over the indexer's top-k of each
row's context (``pcpviz.engine.sparse_attention``; torch only). There the fault folds the indexer
keys too: where vLLM's pre-fix fold was.

On CUDA the KV write and the attention run Triton kernels (``pcpviz_kernels``,
see ``kv_cache.kernels_for``): decode-sized rows the absorbed paged kernel, prefill rows
the flash prefill kernel over up-projected K/V (``kv_cache.paged_mla_attention_kernels``);
on CPU, or with ``PCPVIZ_KERNELS=0``, the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pcpviz.engine.dist import PCPGroup
import numpy as np

from pcpviz.engine.dcp_attention import DCPRows, dcp_combine, dcp_partial_mla
from pcpviz.engine.kv_cache import LatentKVCache, kernels_for, paged_mla_attention
from pcpviz.engine.sparse_attention import sparse_paged_mla

__all__ = ["PagedAttention"]


@dataclass
class PagedAttention:
    model: object  # TinyDSV3
    cache: LatentKVCache
    group: PCPGroup
    expanded: bool
    slots: torch.Tensor  # int64[N*P] (expanded) or int64[R] (local)
    block_rows: torch.Tensor  # int32[B, W]
    query_start_loc: torch.Tensor  # int[B+1]
    positions: torch.Tensor  # int64[Q]
    seq_lens: torch.Tensor  # int[B]
    fold_without_shape_check: bool = False
    # (max query len, max seq len), known on the host from the batch (the worker passes them:
    # no device sync); None: computed from the tensors once per forward (a sync)
    bounds: tuple[int, int] | None = None
    slots_checked: bool = False  # the worker checked every slot < num_slots on the host
    # (query_start_loc int64[B+1], seq_lens int64[B]) on the host, if the caller has them: the
    # kernel path splits decode rows from prefill rows with them (else one sync per forward)
    host_lens: tuple[np.ndarray, np.ndarray] | None = None
    # DCP > 1 (pcpviz.engine.dcp_attention): the KV is sharded, attention is partial + combined
    dcp: DCPRows | None = None
    dcp_ranks: list[int] = field(default_factory=list)  # per layer: partial results combined
    index_cache: LatentKVCache | None = None  # the DSA model's indexer keys (rope_dim 0), same slots
    selections: list | None = None  # DSA: each batch row's top-k rows, appended per layer (tests)

    def _write(self, cache: LatentKVCache, layer_idx: int, rows: torch.Tensor) -> None:
        """Gather (expanded) and write one layer's new rows into ``cache`` by the slot mapping."""
        slots = self.slots
        if self.expanded:
            rows = self.group.all_gather(rows)
        elif self.fold_without_shape_check and self.group.world_size > 1:
            # The bug: "num_tokens //= world_size" applied to an unexpanded mapping.
            keep = slots.shape[0] // self.group.world_size
            slots, rows = slots[:keep], rows[:keep]
        cache.write(layer_idx, slots, rows, checked=self.slots_checked)

    def __call__(self, layer_idx, q_nope, q_pe, kv_c, k_pe, *, index=None):
        if index is not None:  # DSA: the indexer's k cache first (mla.py:233)
            self._write(self.index_cache, layer_idx, index.k)
        self._write(self.cache, layer_idx, torch.cat([kv_c, k_pe], dim=-1))
        w_uk, w_uv = self.model.mla_up_weights(layer_idx)
        if index is not None:
            out = sparse_paged_mla(
                q_nope, q_pe, index, cache=self.cache.layers[layer_idx], index_cache=self.index_cache.layers[layer_idx],
                block_rows=self.block_rows, query_start_loc=self.query_start_loc, positions=self.positions,
                seq_lens=self.seq_lens, w_uk=w_uk, w_uv=w_uv, block_size=self.cache.block_size,
                scale=self.model.config.softmax_scale, record=self.selections)
            return out.to(q_nope.dtype)
        if self.dcp is not None:
            return self._dcp_attention(layer_idx, q_nope, q_pe, w_uk, w_uv)
        kw = {}
        if kernels_for(self.cache.layers[layer_idx]) is not None:  # CUDA: Triton kernels
            if self.bounds is None:
                qsl = self.query_start_loc
                self.bounds = (int((qsl[1:] - qsl[:-1]).max()) if qsl.numel() > 1 else 0,
                               int(self.seq_lens.max()) if self.seq_lens.numel() else 0)
            kw = {"max_query_len": self.bounds[0], "max_seq_len": self.bounds[1], "host_lens": self.host_lens}
        out = paged_mla_attention(
            q_nope, q_pe, self.cache.layers[layer_idx], block_rows=self.block_rows,
            query_start_loc=self.query_start_loc, positions=self.positions, seq_lens=self.seq_lens,
            w_uk=w_uk, w_uv=w_uv, block_size=self.cache.block_size, scale=self.model.config.softmax_scale, **kw,
        )
        return out.to(q_nope.dtype)

    def _dcp_attention(self, layer_idx, q_nope, q_pe, w_uk, w_uv):
        """Partial attention over this rank's KV shard, combined over the DCP (= PCP) group."""
        rows = self.dcp
        p = q_nope.shape[0]
        if rows.gather_queries:
            q_nope, q_pe = self.group.all_gather(q_nope.contiguous()), self.group.all_gather(q_pe.contiguous())
        ctx, lse = dcp_partial_mla(q_nope, q_pe, self.cache.layers[layer_idx], rows=rows, w_uk=w_uk,
                                   block_size=self.cache.block_size, scale=self.model.config.softmax_scale)
        ctx, ranks = dcp_combine(ctx, lse, self.group)
        self.dcp_ranks.append(ranks)
        if rows.gather_queries:
            ctx = ctx[self.group.rank * p:(self.group.rank + 1) * p]
        return torch.einsum("qhr,hvr->qhv", ctx, w_uv.float()).to(q_nope.dtype)
