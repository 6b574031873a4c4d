"""The MoE + DSA checkpoint (``data/models/pcpviz-tiny-moe-dsa``, ``pcpviz.engine.model_v32``) in
the CPU replay: what its MoE layers call the PCP group with, and its sparse attention.

What is ours and what is vLLM's. **Stand-ins (pcpviz's model code)**: the model itself
(``TinyDSV32``: MLA with a q LoRA, the lightning indexer, MoE with routed and shared experts, built
from the checkpoint by ``build_model``), the expert computation (``pcpviz.engine.moe.MoE``: every
rank computes its ``1/pcp`` of each expert's intermediate columns over all rows), the indexer's
top-k and the sparse MLA over the paged caches (``pcpviz.engine.sparse_attention.sparse_paged_mla``,
torch, where vLLM runs ``SparseAttnIndexer`` and a sparse MLA backend). **vLLM 0.33.0's own code**
(unchanged, called from here): ``get_pcp_group()`` (patched by ``pcpviz.vllm.cpu_patches`` to the
rank thread's ``FakePCPGroup``, which ledgers each call into the trace's ``collectives`` view),
``maybe_gather_indexer_k`` (the indexer-key gather, ``v1/attention/ops/pcp.py:91-103``) and, as
for the dense model, ``maybe_gather_mla_latent_cache_inputs``; around the model, the runner, PCP
manager, speculator and block-table kernels (``pcpviz.vllm.replay``).

The MoE collectives, re-derived from ``model_executor/layers/fused_moe/runner/moe_runner.py``: with
``pcp_size > 1`` and no all2all kernels, ``_maybe_dispatch`` all-gathers the rows and then the
router logits over PCP along dim 0 (lines 824-829), and ``_maybe_combine`` reduce-scatters the
experts' output along dim 0 (lines 853-861). ``PCPGroupForMoE`` hands ``MoE.forward`` exactly
those calls on ``get_pcp_group()``. (The runner's late all-reduce, lines 509-515, goes to the TP
group, of one rank at TP = 1: no PCP call.) PCP=2, 7 rows a rank, hidden 256, 8 experts; each rank ledgers::

    all_gather pcp float32[7, 256] dim=0       (the rows)
    all_gather pcp float32[7, 8] dim=0         (the router logits)
    reduce_scatter pcp float32[14, 256] dim=0  (its partial sums over all 14 rows; back: its 7)

The indexer-key write, re-derived from ``model_executor/layers/sparse_attn_indexer.py:553-567``:
the keys are cut to the slot mapping's length (a replicated draft decode's unexpanded mapping of R
slots: the first R rows; an expanded mapping of ``pcp * P`` slots keeps the P padded rows, so every
rank gathers the same shape), then gathered by ``maybe_gather_indexer_k`` and written at the
returned slots. vLLM's MLA runs the indexer, and so its key write, before the latent write
(``model_executor/layers/mla.py:233``); so does ``sparse_attention`` here. One difference: the
replay's stand-in attention group gives the indexer the MLA's decode/prefill split (vLLM builds the
indexer's own metadata, which may class a short extend differently: sparse_attn_indexer.py:580);
with sharded decodes the gather ignores the split.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from vllm.distributed.parallel_state import get_pcp_group
from vllm.v1.attention.ops.pcp import maybe_gather_indexer_k

from pcpviz.engine.indexer import IndexerQK
from pcpviz.engine.sparse_attention import sparse_paged_mla
from pcpviz.vllm.fake_group import current_fake_group

__all__ = ["MOE_MODELS_DECLARATION", "MOE_STAND_INS", "PCPGroupForMoE", "IndexerWrite", "IndexerKeys",
           "sparse_attention"]

MOE_MODELS_DECLARATION = (
    "real weights: target = the tiny MoE + DSA checkpoint (data/models/pcpviz-tiny-moe-dsa, "
    "pcpviz.engine.model_v32 via build_model, float32) behind DeepseekV32ForCausalLM's forward/compute_logits; "
    "MTP = its MoE MTP layer behind DeepSeekMTP's; every MoE layer all-gathers its rows and router logits and "
    "reduce-scatters its output on vLLM's get_pcp_group() as moe_runner.py:824-829, 853-861 do (experts: "
    "pcpviz.engine.moe, each rank 1/pcp of every expert's columns); every layer writes its indexer keys through "
    "vLLM's maybe_gather_indexer_k and its [kv_c, k_pe] through maybe_gather_mla_latent_cache_inputs into "
    "per-rank paged caches, then attends over the indexer's top-k (index_topk) of the context read through the "
    "metadata's block table and seq_lens (torch, pcpviz.engine.sparse_attention.sparse_paged_mla)"
)
MOE_STAND_INS = {
    "target_model": "tiny MoE + DSA weights (pcpviz.engine.model_v32) behind vLLM's model interface; MoE PCP "
                    "collectives on vLLM's get_pcp_group(); torch sparse MLA over the indexer's top-k of per-rank "
                    "paged latent and indexer-key caches written via the real PCP gathers",
    "mtp_model": "the checkpoint's MoE MTP layer behind DeepSeekMTP's interface; same MoE collectives, "
                 "indexer, attention and KV writes",
    "indexer": "pcpviz.engine.indexer (float32 scores, torch top-k) for vLLM's SparseAttnIndexer (fp8, its "
               "kernels); the indexer's decode/prefill split is the MLA builder's",
}


class PCPGroupForMoE:
    """What ``pcpviz.engine.moe.MoE.forward`` calls as ``comm``, answered by vLLM's
    ``get_pcp_group()`` on the calling rank thread: ``world_size``, ``rank``, ``all_gather`` and
    ``reduce_scatter`` along dim 0 (the calls of ``moe_runner.py:824-829, 853-861``). One object
    serves every rank: the rank threads share the model, the group is looked up per call. Outside a
    rank thread (the shared model called directly, e.g. as a reference) it is one rank: no collective.

        >>> from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks
        >>> g, comm = FakePCPGroup(2), PCPGroupForMoE()
        >>> run_ranks(g, lambda r: comm.reduce_scatter(torch.tensor([[1.0], [2.0]]) * (r + 1)).tolist())
        [[[3.0]], [[6.0]]]
    """

    @property
    def world_size(self) -> int:
        return 1 if current_fake_group() is None else get_pcp_group().world_size

    @property
    def rank(self) -> int:
        return get_pcp_group().rank_in_group

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return get_pcp_group().all_gather(t.contiguous(), dim=0)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        return get_pcp_group().reduce_scatter(t.contiguous(), dim=0)


class IndexerWrite(NamedTuple):
    """One indexer-key write as it happened: the shapes the fold compared and what was written.
    A PCP=2 target forward of P = 6 rows a rank: ``IndexerWrite(0, 0, 12, 6, 6, 12)`` (the
    expanded mapping folds to 6, the gather writes 2 x 6); a replicated draft decode of 3 requests:
    ``IndexerWrite(f, 1, 3, 3, 3, 3)`` (no fold, written locally)."""

    forward: int  # the forward's number on this model (counted from 0 at its first layer's write)
    layer: int
    slot_mapping_rows: int  # slot_mapping.shape[0] (sparse_attn_indexer.py:554)
    k_rows: int  # k.shape[0]: the forward's rows
    kept_rows: int  # after the fold (k[:num_tokens])
    written_rows: int  # the slots maybe_gather_indexer_k returned (PAD included)


class IndexerKeys:
    """One rank's paged indexer-key caches: float32[slots, index_head_dim] per layer (vLLM: the
    indexer's ``k_cache``, ``deepseek_v2.py:726-734``, fp8 there), written at the same slots as
    the latents. ``writes`` logs every write (``IndexerWrite``), for the fold demonstration
    (``tests/vllm/test_replay_moe.py``, ``pcpviz.reference.indexer_fold``); ``selections`` gets each
    batch row's int64[q, index_topk] top-k (rows of its context, -1: none) per attention call: a row
    holding 70 once the context passed 64 tokens selected 64 of at least 71."""

    def __init__(self, layer_ids: list[int], num_slots: int, head_dim: int) -> None:
        self.layers = {i: torch.zeros(num_slots, head_dim) for i in layer_ids}
        self.first_layer = min(layer_ids)
        self.writes: list[IndexerWrite] = []
        self.selections: list[torch.Tensor] = []
        self._forwards = 0

    def write(self, layer_idx: int, k: torch.Tensor, md: Any, *, slot_mapping: torch.Tensor, use_pcp: bool,
              shard_decodes: bool) -> None:
        """The key write of sparse_attn_indexer.py:553-567: cut ``k`` [T, Di] to the mapping
        (unexpanded: its R rows; expanded: unchanged), gather through vLLM's
        ``maybe_gather_indexer_k``, store where the returned slot is >= 0."""
        n = slot_mapping.shape[0]
        if use_pcp and n > k.shape[0]:
            n //= get_pcp_group().world_size
        keys, slots = maybe_gather_indexer_k(k[:n].float(), slot_mapping, md.num_decode_tokens, use_pcp,
                                             pcp_shard_decode_requests=shard_decodes)
        if layer_idx == self.first_layer:
            self._forwards += 1
        self.writes.append(IndexerWrite(self._forwards - 1, layer_idx, int(slot_mapping.shape[0]), int(k.shape[0]),
                                        min(n, int(k.shape[0])), int(slots.shape[0])))
        keep = slots >= 0
        self.layers[layer_idx][slots[keep]] = keys[keep]


def sparse_attention(model: Any, layer_idx: int, q: tuple[torch.Tensor, torch.Tensor], *, index: IndexerQK,
                     latent: torch.Tensor, keys: torch.Tensor, md: Any, positions: torch.Tensor,
                     block_size: int, record: list | None = None) -> torch.Tensor:
    """float32[Q, H, Dv]: the rank's query rows ``q = (q_nope, q_pe)`` over the indexer's top-k of
    their requests' contexts, read through the metadata's block table, ``query_start_loc`` and
    ``seq_lens`` from this layer's ``latent`` [slots, R + Dr] and indexer ``keys`` [slots, Di]
    (both already written this forward). A row at position 99 with seq_len 100 attends to 64 of
    its 100 tokens (index_topk 64); rows past ``query_start_loc[-1]`` (padding) stay zero.
    ``record``: gets each batch row's int64[q, topk] selection appended."""
    w_uk, w_uv = model.mla_up_weights(layer_idx)
    return sparse_paged_mla(q[0], q[1], index, cache=latent, index_cache=keys, block_rows=md.block_table,
                            query_start_loc=md.query_start_loc, positions=positions, seq_lens=md.seq_lens,
                            w_uk=w_uk, w_uv=w_uv, block_size=block_size, scale=model.config.softmax_scale,
                            record=record)
