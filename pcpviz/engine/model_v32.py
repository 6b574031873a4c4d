"""The tiny model in DeepSeek-V3.2 / GLM-5's shape: MoE MLPs and DSA sparse attention, plain torch.

``TinyDSV32`` is ``TinyDSV3`` (``pcpviz.engine.model``) with two changes, re-derived from vLLM
0.33.0 (``model_executor/models/deepseek_v2.py``) and checked against transformers 5's
``DeepseekV32ForCausalLM`` (``tests/engine/test_model_v32_hf.py``):

* **MoE** (``MoE``, ``pcpviz.engine.moe``) in every layer from ``first_k_dense_replace`` on, the
  MTP block included: sigmoid router with ``e_score_correction_bias`` (``noaux_tc``), top-k
  routed experts plus a shared expert.
* **The lightning indexer** (``Indexer``, ``pcpviz.engine.indexer``) in every layer: for each new
  token it scores the sequence's earlier tokens and the MLA attends to the ``index_topk`` best
  only (all of them while the context is no longer than ``index_topk``).

Names are the DeepSeek checkpoint's (``model.layers.1.mlp.experts.3.up_proj.weight``,
``model.layers.0.self_attn.indexer.wq_b.weight``, ``model.layers.2.mlp.gate.e_score_correction_bias``),
so one ``model.safetensors`` loads here, in transformers and in vLLM.

The attention callback (``AttnFn``) gains one keyword, ``index``::

    out = attn(layer_idx, q_nope, q_pe, kv_c, k_pe, index=IndexerQK(q, k, weights, topk))

``index.q`` float[T, Hi, Di] and ``index.weights`` float32[T, Hi] are the new tokens' indexer
queries and head weights, ``index.k`` float[T, Di] their indexer keys (rope applied to every one).
The callback owns the caches: it stores ``index.k`` beside the latent entries ``kv_c``/``k_pe``
(vLLM: the indexer's own ``k_cache``, ``deepseek_v2.py:726-734``), then selects with
``pcpviz.engine.indexer.indexer_topk(index, k_ctx, q_pos=..., k_pos=...)`` over the sequence's whole
context -> int64[T, topk] rows of that context (-1: none), and attends over the selected rows only
(vLLM: ``SparseAttnIndexer`` fills ``topk_indices_buffer``, the sparse MLA backend reads it).
``pcpviz.engine.ref_sparse.sparse_causal_attention(model)`` is the reference callback
(one contiguous batch, no cache).

Under PCP the engine sets ``model.moe_comm`` to its group: a MoE layer then all-gathers its
input rows and router logits, computes its intermediate shard of every routed expert over all
rows and reduce-scatters the sum back (``fused_moe/runner/moe_runner.py:824-829, 853-861``).
"""

from __future__ import annotations

from typing import Optional

import torch

from pcpviz.engine.indexer import Indexer, IndexerQK
from pcpviz.engine.model import AttnFn, DecoderLayer, MTPLayer, TinyDSV3
from pcpviz.engine.model_config import TinyDSV3Config
from pcpviz.engine.moe import MoE
from pcpviz.engine.ref_sparse import sparse_causal_attention

__all__ = ["TinyDSV32", "build_model"]


class _V32Block:
    """The decoder block of a V3.2 layer (mixed into ``DecoderLayer`` and ``MTPLayer``)."""

    def _make_v32(self, cfg: TinyDSV3Config, layer_idx: int) -> None:
        self.self_attn.indexer = Indexer(cfg)
        if cfg.moe_layer(layer_idx):
            self.mlp = MoE(cfg)

    def attn_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_nope, q_pe, kv_c, k_pe, index q, index k, index weights) of the rows ``x``: the MLA
        projections (q through the q LoRA) and the indexer's, which reads the q LoRA's normed
        latent ``qr`` and the normed rows (``deepseek_v2.py:763-854``)."""
        xn = self.input_layernorm(x)
        att = self.self_attn
        qr = att.q_a_layernorm(att.q_a_proj(xn))  # [T, q_lora_rank]
        q_nope, q_pe, kv_c, k_pe = att.project(xn, (cos, sin), qr=qr)
        # the indexer's inputs are detached: only its own loss trains it (DeepSeek-V3.2 sec. 2.1.1,
        # tools/train/objective_v32.py); the values, and so inference, are unchanged
        iq, ik, iw = att.indexer.project(xn.detach(), qr.detach(), (cos, sin))
        return q_nope, q_pe, kv_c, k_pe, iq, ik, iw

    def attn_outputs(self, x: torch.Tensor, out: torch.Tensor):
        """(residual after the attention, its ``post_attention_layernorm``) from ``out`` [T, H, Dv]."""
        x = x + self.self_attn.o_proj(out.reshape(x.shape[0], -1).to(x.dtype))
        return x, self.post_attention_layernorm(x)


class DecoderLayerV32(_V32Block, DecoderLayer):
    def __init__(self, cfg: TinyDSV3Config, layer_idx: int):
        DecoderLayer.__init__(self, cfg, layer_idx)
        self._make_v32(cfg, layer_idx)


class MTPLayerV32(_V32Block, MTPLayer):
    def __init__(self, cfg: TinyDSV3Config, layer_idx: int):
        MTPLayer.__init__(self, cfg, layer_idx)
        self._make_v32(cfg, layer_idx)


class TinyDSV32(TinyDSV3):
    """DeepSeek-V3.2-shaped main model + MTP block(s): MoE MLPs, indexer-selected sparse MLA."""

    layer_cls = DecoderLayerV32
    mtp_cls = MTPLayerV32

    def __init__(self, config: TinyDSV3Config):
        if not (config.is_sparse and config.is_moe and config.q_lora_rank):
            raise ValueError("TinyDSV32 needs index_topk, routed experts and q_lora_rank")
        super().__init__(config)
        self.moe_comm = None  # the PCP group (engine); None: one rank, no MoE collectives

    def _block(self, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnFn) -> torch.Tensor:
        layer = self.model.layers[i]
        q_nope, q_pe, kv_c, k_pe, iq, ik, iw = self._region(f"attn_inputs{i}", layer.attn_inputs)(x, *rope)
        index = IndexerQK(iq, ik, iw, self.config.index_topk)
        out = attn(layer.layer_idx, q_nope, q_pe, kv_c, k_pe, index=index)
        x, h = self._region(f"attn_outputs{i}", layer.attn_outputs)(x, out)
        if isinstance(layer.mlp, MoE):
            return x + layer.mlp(h, comm=self.moe_comm)
        return x + self._region(f"mlp{i}", layer.mlp)(h)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attn: Optional[AttnFn] = None) -> torch.Tensor:
        """Convenience: logits of one contiguous sequence (reference sparse attention)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        attn = attn or sparse_causal_attention(self, positions=positions)
        return self.logits(self.forward_hidden(input_ids, positions, attn))

    def hf_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict:
        """``TinyDSV3.hf_state_dict``, the routers' ``e_score_correction_bias`` kept in float32 (as
        DeepSeek's checkpoints store it; transformers keeps it so, ``_keep_in_fp32_modules_strict``)."""
        out = super().hf_state_dict(dtype)
        for moe_name, moe in self.named_modules():
            if isinstance(moe, MoE):
                bias = moe.gate.e_score_correction_bias
                out[f"{moe_name}.gate.e_score_correction_bias"] = bias.detach().float().contiguous().clone().cpu()
        return out

    def moe_layers(self) -> list[MoE]:
        """The MoE MLPs, in layer order (main layers, then the MTP block)."""
        return [m.mlp for m in self.model.layers if isinstance(m.mlp, MoE)]

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        super().init_weights(generator)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("k_norm.bias"):
                    p.zero_()
                elif name.endswith("k_norm.weight"):
                    p.fill_(1.0)
            for moe in self.moe_layers():
                moe.gate.e_score_correction_bias.zero_()


def build_model(cfg: TinyDSV3Config) -> TinyDSV3:
    """The module for ``cfg``: ``TinyDSV32`` for the MoE + DSA shape, ``TinyDSV3`` otherwise."""
    return TinyDSV32(cfg) if (cfg.is_moe or cfg.is_sparse) else TinyDSV3(cfg)
