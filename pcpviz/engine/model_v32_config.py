"""The MoE + sparse-attention tiny model's ``config.json``: DeepSeek-V3.2 keys (``deepseek_v32``).

The second shipped model, ``data/models/pcpviz-tiny-moe-dsa``, has the deployment's shape
(DeepSeek-V3.2 / GLM-5): MLA with a q LoRA and a lightning indexer in every layer, layer 0 dense,
layer 1 and the MTP block MoE (8 routed experts, top-2, one shared expert, sigmoid scores with
``e_score_correction_bias``, ``noaux_tc``)::

    >>> cfg = tiny_moe_dsa_config()
    >>> d = v32_hf_dict(cfg)
    >>> d["model_type"], d["index_topk"], d["n_routed_experts"], d["num_experts_per_tok"]
    ('deepseek_v32', 64, 8, 2)
    >>> [cfg.moe_layer(i) for i in range(cfg.num_layers + cfg.num_mtp_layers)]  # layer 2: the MTP block
    [False, True, True]

Keys and who reads them (vLLM 0.33.0 reads ``deepseek_v32`` with its own ``DeepseekV3Config``,
``transformers_utils/config.py:133``; transformers 5 with ``DeepseekV32Config``):

* ``index_topk`` switches the indexer on in vLLM (``hasattr(config, "index_topk")``,
  ``model_executor/models/deepseek_v2.py:1138``); ``index_n_heads``, ``index_head_dim`` size it
  (``deepseek_v2.py:697-700``); it needs ``q_lora_rank`` (``deepseek_v2.py:1169``: the indexer's
  query is ``wq_b`` of the q LoRA's normed latent).
* ``topk_method: "noaux_tc"`` gives the gate its ``e_score_correction_bias`` (``deepseek_v2.py:327-332``);
  ``scoring_func: "sigmoid"`` (vLLM's default is softmax, ``deepseek_v2.py:394``); ``n_group`` =
  ``topk_group`` = 1 (grouped top-k over one group selects among all experts).
* ``moe_router_dtype: "float32"``: vLLM's gate then computes the router logits in float32
  (``deepseek_v2.py:135-145``), as transformers always does (``DeepseekV32TopkRouter``).
* ``first_k_dense_replace`` = 1, ``moe_layer_freq`` = 1: layer 0 dense, the rest MoE; the MTP
  block, index ``num_hidden_layers``, is MoE too (``deepseek_v2.py:1293-1296``), and transformers
  builds its ``mlp_layer_types`` from ``first_k_dense_replace``.
* left out on purpose: ``index_topk_freq`` / ``index_topk_pattern`` (every layer has its own indexer,
  ``deepseek_v2.py:1144-1156``) and ``index_share_for_mtp_iteration`` (each MTP draft step selects its
  own top-k instead of reusing step 0's, ``v1/worker/gpu/spec_decode/mtp/speculator.py:27-32``), as
  the engine does.
"""

from __future__ import annotations

from pcpviz.engine.model_config import TinyDSV3Config, v32_hf_dict

__all__ = ["MOE_MODEL_NAME", "tiny_moe_dsa_config", "v32_hf_dict", "moe_model_dir"]

MOE_MODEL_NAME = "pcpviz-tiny-moe-dsa"


def moe_model_dir() -> str:
    """``data/models/pcpviz-tiny-moe-dsa`` of this checkout."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "data", "models", MOE_MODEL_NAME))


def tiny_moe_dsa_config(**overrides):
    """The shipped MoE + DSA model's configuration (``overrides``: any field)."""
    base = dict(vocab_size=264, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                kv_lora_rank=512, q_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                num_mtp_layers=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=128, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, index_topk=64, index_n_heads=16, index_head_dim=128)
    base.update(overrides)
    return TinyDSV3Config(**base)
