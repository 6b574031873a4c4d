"""The replay's models with real weights: the shipped tiny DeepSeek-V3 checkpoint
(``data/models/pcpviz-tiny-dsv3``, ``pcpviz.engine.model.TinyDSV3``) behind the interfaces
vLLM 0.33.0's runner and MTP speculator call.

``TinyTarget`` is what ``DeepseekV3ForCausalLM`` is to the runner: ``forward(input_ids,
positions)`` -> final hidden states, ``compute_logits`` -> the LM head. ``TinyMTP`` is
``DeepSeekMTP``: ``forward(input_ids, positions, hidden_states)`` -> ``(pre-norm hidden,
shared_head-normed hidden)`` (the pair vLLM's MTP layer returns: logits from the first, the
second chained into the next draft step, ``deepseek_mtp.py:136-144``), ``compute_logits`` ->
``shared_head``. Each MLA layer writes its new latents ``[kv_c, k_pe]`` into a per-rank paged
cache through vLLM's own ``maybe_gather_mla_latent_cache_inputs`` at the slots of the forward
context, then attends over the request's context read back through the block table and
``seq_lens`` of the attention metadata vLLM built (the engine's ``paged_mla_attention``).
So a wrong slot, block table, position or input id in vLLM's code changes the logits, and
with them what is drafted and accepted, as on a GPU.

``tiny_model(model_dir)`` builds whichever checkpoint it is given through ``build_model``
(``pcpviz.engine.checkpoint.load_model``): the MoE + DSA one (``data/models/pcpviz-tiny-moe-dsa``)
gets ``PCPGroupForMoE`` as its ``moe_comm``, so its MoE layers make vLLM's PCP MoE collectives,
and its layers call the attention with the indexer's q, k and weights (``index=``): the keys go
into a paged indexer-key cache through vLLM's ``maybe_gather_indexer_k``, and the attention reads
the indexer's top-k only (``pcpviz.vllm.replay.tiny_moe``, which says what is a stand-in there).

PCP=2, prompt of 13 tokens: rank 0 computes rows {0,1,2,3,10,11,12} (DualChunkSwap), rank 1 the
other six; both all-gather their 7 + 6 latents and write all 13 slots; the row at position 12 on
rank 0 attends to positions 0..12 of its own replica.

Also here: the bookkeeping cache ``[slots, 2]`` = (token, position) every layer writes through
the same gather (what ``ReplayResult.kv_target`` shows), and the prompts (Python source, the
model's training domain, byte-tokenized with BOS).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from vllm.forward_context import get_forward_context
from vllm.v1.attention.ops.pcp import maybe_gather_mla_latent_cache_inputs

from pcpviz.engine.checkpoint import default_model_dir, load_model
from pcpviz.engine.kv_cache import paged_mla_attention
from pcpviz.engine.model import TinyDSV3
from pcpviz.engine.tokenizer import encode
from pcpviz.vllm.replay.tiny_moe import IndexerKeys, PCPGroupForMoE, sparse_attention

__all__ = ["TINY_MODELS_DECLARATION", "TINY_STAND_INS", "tiny_model", "tiny_prompts", "TinyTarget", "TinyMTP"]

TINY_MODELS_DECLARATION = (
    "real weights: target = the tiny DeepSeek-V3 checkpoint (data/models/pcpviz-tiny-dsv3, pcpviz.engine.model, "
    "float32) behind DeepseekV3ForCausalLM's forward/compute_logits; MTP = its MTP layer behind DeepSeekMTP's "
    "(returns pre-norm and shared_head-normed hidden); every MLA layer writes [kv_c, k_pe] into a per-rank paged "
    "cache through vLLM's maybe_gather_mla_latent_cache_inputs and attends over the context read through the "
    "metadata's block table and seq_lens (torch MLA, absorbed form, pcpviz.engine.kv_cache.paged_mla_attention)"
)
TINY_STAND_INS = {
    "target_model": "tiny DeepSeek-V3 weights (pcpviz.engine.model) behind vLLM's model interface; "
                    "torch MLA attention over a per-rank paged latent cache written via the real PCP gather",
    "mtp_model": "the checkpoint's MTP layer behind DeepSeekMTP's interface; same attention and KV write",
    "rejection_sampler": "greedy (temperature 0): a draft is accepted while it equals the target's top-1 at its "
                         "row, bonus = the next top-1; then the real get_num_sampled_and_rejected; -1 past num_sampled",
}

# Python source (the model's training domain: the standard library), cut into prompts.
_SOURCES = (
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir(sys.argv[1])):\n    print(name)\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.value)\n",
    "if __name__ == '__main__':\n    import doctest\n    doctest.testmod()\n",
    "    for i in range(len(data)):\n        if data[i] is None:\n            continue\n",
)

_lock = threading.Lock()
_models: dict[str, TinyDSV3] = {}


def tiny_model(model_dir: str | None = None) -> TinyDSV3:
    """The checkpoint in float32 on CPU, loaded once per process (shared, read-only, by all rank threads);
    a MoE checkpoint's MoE layers call vLLM's ``get_pcp_group()`` (``PCPGroupForMoE``)."""
    key = model_dir or default_model_dir()
    with _lock:
        if key not in _models:
            model = load_model(key, device="cpu", dtype=torch.float32)
            if model.config.is_moe:
                model.moe_comm = PCPGroupForMoE()
            _models[key] = model
        return _models[key]


def tiny_prompts(lengths: list[int]) -> list[list[int]]:
    """One prompt of each length: BOS + the bytes of a Python snippet (repeated to length).

        >>> tiny_prompts([5])[0]     # <bos> 'd' 'e' 'f' ' '
        [256, 100, 101, 102, 32]
    """
    out = []
    for i, n in enumerate(lengths):
        text = _SOURCES[i % len(_SOURCES)]
        ids = encode(text * (1 + n // max(1, len(text))), add_bos=True)
        out.append(ids[:n])
    return out


class _TinyLayerStack(torch.nn.Module):
    """What the target and the MTP wrapper share: the per-rank caches and the attention callback."""

    def __init__(self, layer: str, model: TinyDSV3, *, num_slots: int, block_size: int, bookkeeping: torch.Tensor,
                 shard_decodes: bool, use_pcp: bool, layer_ids: list[int]) -> None:
        super().__init__()
        cfg = model.config
        self.layer, self.tiny, self.block_size = layer, model, block_size
        self.kv_cache = bookkeeping  # float32[slots, 2]: (token, position) per written slot
        self.shard_decodes, self.use_pcp = shard_decodes, use_pcp
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.latent = {i: torch.zeros(num_slots, width) for i in layer_ids}  # float32[slots, R + Dr] per layer
        # the DSA model's indexer keys, float32[slots, Di] per layer (None: a dense model)
        self.index_keys = IndexerKeys(layer_ids, num_slots, cfg.index_head_dim) if cfg.is_sparse else None
        self.aux_hidden_states = False

    def _context(self) -> tuple[Any, Any]:
        ctx = get_forward_context()
        md = ctx.attn_metadata.get(self.layer) if isinstance(ctx.attn_metadata, dict) else None
        slots = ctx.slot_mapping.get(self.layer) if isinstance(ctx.slot_mapping, dict) else None
        return md, slots

    def _gather(self, md: Any, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor):
        """vLLM's MLA KV-write gather, as ``MLAAttention.update_kv_cache`` calls it."""
        return maybe_gather_mla_latent_cache_inputs(kv_c, k_pe, slot_mapping, md.num_decode_tokens,
                                                    use_pcp=self.use_pcp, pcp_shard_decode_requests=self.shard_decodes)

    def _bookkeep(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        md, slot_mapping = self._context()
        if md is None or slot_mapping is None:
            return
        kv = torch.stack([ids.to(torch.float32), positions.to(torch.float32)], dim=1)
        kv, _, slots = self._gather(md, slot_mapping, kv, positions.to(torch.float32).reshape(-1, 1, 1))
        keep = slots >= 0
        self.kv_cache[slots[keep]] = kv[keep]

    def _attn(self, positions: torch.Tensor):
        """``AttnFn`` of ``TinyDSV3``: KV write through vLLM's gather, then paged MLA over the metadata's context.
        Without metadata (a profile or dummy run) attention is skipped, as vLLM skips it."""
        md, slot_mapping = self._context()
        cfg = self.tiny.config

        def attn(layer_idx: int, q_nope, q_pe, kv_c, k_pe, *, index=None):
            if md is None or slot_mapping is None:
                return torch.zeros(q_nope.shape[0], q_nope.shape[1], cfg.v_head_dim, dtype=q_nope.dtype)
            if index is not None:  # DSA: the indexer's key write first (mla.py:233)
                self.index_keys.write(layer_idx, index.k, md, slot_mapping=slot_mapping, use_pcp=self.use_pcp,
                                      shard_decodes=self.shard_decodes)
            g_c, g_pe, slots = self._gather(md, slot_mapping, kv_c, k_pe)
            latent = torch.cat([g_c, g_pe.reshape(g_c.shape[0], -1)], dim=-1)  # float32[N*P, R + Dr]
            cache = self.latent[layer_idx]
            keep = slots >= 0
            cache[slots[keep]] = latent[keep]
            if index is not None:
                return sparse_attention(self.tiny, layer_idx, (q_nope, q_pe), index=index, latent=cache,
                                        keys=self.index_keys.layers[layer_idx], md=md, positions=positions,
                                        block_size=self.block_size,
                                        record=self.index_keys.selections).to(q_nope.dtype)
            w_uk, w_uv = self.tiny.mla_up_weights(layer_idx)
            out = paged_mla_attention(  # rows past query_start_loc[-1] (graph padding) stay zero
                q_nope, q_pe, cache, block_rows=md.block_table, query_start_loc=md.query_start_loc,
                positions=positions, seq_lens=md.seq_lens, w_uk=w_uk, w_uv=w_uv, block_size=self.block_size,
                scale=cfg.softmax_scale)
            return out.to(q_nope.dtype)

        return attn


class TinyTarget(_TinyLayerStack):
    """``DeepseekV3ForCausalLM`` as the runner calls it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **_: Any) -> Any:
        self._bookkeep(input_ids, positions)
        hidden = self.tiny.forward_hidden(input_ids.long(), positions.long(), self._attn(positions.long()))
        if self.aux_hidden_states:
            return hidden, [hidden.clone()]
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tiny.logits(hidden)


class TinyMTP(_TinyLayerStack):
    """``DeepSeekMTP`` as ``TargetDependentARSpeculator._run_model`` calls it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, *,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._bookkeep(input_ids, positions)
        h = self.tiny.mtp_forward(input_ids.long(), positions.long(), hidden_states, attn=self._attn(positions.long()))
        return h, self.tiny.mtp_recycle_hidden(h)

    def compute_logits(self, hidden: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.tiny.mtp_logits(hidden)
