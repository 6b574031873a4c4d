"""The tiny model's configuration: ``config.json`` (Hugging Face DeepSeek-V3 keys) as a frozen
dataclass, and where the shipped checkpoint lives.

    cfg = read_config(default_model_dir())   # TinyDSV3Config(hidden_size=..., num_hidden_layers=2, ...)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

__all__ = ["TinyDSV3Config", "read_config", "DEFAULT_MODEL_NAME", "default_model_dir", "v32_hf_dict"]

DEFAULT_MODEL_NAME = "pcpviz-tiny-dsv3"


def default_model_dir() -> str:
    """``data/models/pcpviz-tiny-dsv3`` of this checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "data", "models", DEFAULT_MODEL_NAME))


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyDSV3Config:
    vocab_size: int = 264
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 2  # main decoder layers (HF num_hidden_layers); MTP layer index == this
    num_heads: int = 4
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    num_mtp_layers: int = 1
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"  # storage dtype of the checkpoint
    # DeepSeek-V3.2 / GLM-5 shape (``pcpviz.engine.model_v32``); the defaults are the dense model.
    n_routed_experts: int = 0  # routed experts of a MoE layer (0: every MLP is dense)
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0  # top-k routing
    moe_intermediate_size: int = 0  # each expert's (and, times n_shared_experts, the shared one's)
    first_k_dense_replace: int = 0  # layers [0, this) dense, the rest (MTP block included) MoE
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    index_topk: Optional[int] = None  # DSA lightning indexer (None: dense attention)
    index_n_heads: int = 0
    index_head_dim: int = 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # transformers DeepseekV3Attention: qk_head_dim ** -0.5, times mscale**2 only for
        # non-default rope types (not used here).
        return self.qk_head_dim ** (-0.5)

    @property
    def mtp_layer_idx(self) -> int:
        return self.num_layers

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (layers from ``first_k_dense_replace`` on)."""
        return self.n_routed_experts > 0

    @property
    def is_sparse(self) -> bool:
        """DeepSeek-V3.2 sparse attention: every layer has a lightning indexer (vLLM's test,
        ``hasattr(config, "index_topk")``, ``model_executor/models/deepseek_v2.py:1138``)."""
        return self.index_topk is not None

    def moe_layer(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` (``num_layers + k``: MTP block k) has a MoE MLP, as vLLM decides
        (``deepseek_v2.py:1293-1297``: routed experts, index >= first_k_dense_replace, freq 1)."""
        return self.is_moe and layer_idx >= self.first_k_dense_replace

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` contents (loads as ``transformers.DeepseekV3Config``, or, for
        the MoE + DSA model, ``DeepseekV32Config``: ``model_v32_hf_dict``)."""
        if self.is_moe or self.is_sparse:
            return v32_hf_dict(self)
        n = self.num_layers
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.intermediate_size,
            "num_hidden_layers": n,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            # Dense MLP everywhere, the MTP block (layer index n) included: no MoE layer exists.
            "n_routed_experts": 0,
            "n_shared_experts": 0,
            "num_experts_per_tok": None,
            "n_group": None,
            "topk_group": None,
            "first_k_dense_replace": n + self.num_mtp_layers,
            "moe_layer_freq": 1,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_interleave": True,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "TinyDSV3Config":
        if d.get("model_type") == "deepseek_v32":
            return v32_from_hf_dict(cls, d)
        if d.get("model_type") != "deepseek_v3":
            raise ValueError(f"not a deepseek_v3 config: model_type={d.get('model_type')!r}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"only plain rope is supported, got {rope}")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        n = d["num_hidden_layers"]
        n_experts = d.get("n_routed_experts") or 0
        if n_experts and d.get("first_k_dense_replace", 0) < n + d.get("num_nextn_predict_layers", 0):
            raise ValueError("MoE layers are not supported by TinyDSV3")
        if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias", False):
            raise ValueError("only silu MLP and bias-free attention are supported")
        if d.get("tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings=True is not supported")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=n,
            num_heads=d["num_attention_heads"],
            kv_lora_rank=d["kv_lora_rank"],
            q_lora_rank=d.get("q_lora_rank"),
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            rope_theta=float(theta),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            num_mtp_layers=d.get("num_nextn_predict_layers", 0),
            bos_token_id=d.get("bos_token_id", 256),
            eos_token_id=d.get("eos_token_id", 257),
            pad_token_id=d.get("pad_token_id", 258),
            initializer_range=d.get("initializer_range", 0.02),
            torch_dtype=d.get("torch_dtype", d.get("dtype", "bfloat16")) or "bfloat16",
        )


# --------------------------------------------------------------------------------------------
# the MoE + DSA model's config.json (deepseek_v32; pcpviz.engine.model_v32_config says which key
# vLLM 0.33.0 and transformers read how)
# --------------------------------------------------------------------------------------------


def v32_hf_dict(cfg) -> dict:
    """The ``config.json`` of a MoE and/or DSA ``TinyDSV3Config`` (``model_type`` deepseek_v32)."""
    if not (cfg.is_moe and cfg.is_sparse):
        raise ValueError("the deepseek_v32 layout needs routed experts and the indexer (index_topk)")
    if cfg.q_lora_rank is None:
        raise ValueError("the DSA indexer needs q_lora_rank (its query is wq_b of the q LoRA latent)")
    n = cfg.num_layers
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_router_dtype": "float32",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "index_topk": cfg.index_topk,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "initializer_range": cfg.initializer_range,
        "use_cache": True,
        "torch_dtype": cfg.torch_dtype,
    }


def _check_supported(d: dict) -> None:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"only plain rope is supported, got {rope}")
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("only sigmoid scores with noaux_tc routing are supported")
    if (d.get("n_group") or 1) != 1 or (d.get("topk_group") or 1) != 1:
        raise ValueError("only n_group = topk_group = 1 is supported")
    if d.get("moe_layer_freq", 1) != 1 or d.get("indexer_rope_interleave", False):
        raise ValueError("only moe_layer_freq 1 and the NeoX-style indexer rope are supported")
    if d.get("index_topk_freq", 1) != 1 or d.get("index_topk_pattern") is not None:
        raise ValueError("every layer must have its own indexer (no IndexCache skipping)")
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias", False) or d.get("tie_word_embeddings"):
        raise ValueError("only silu MLPs, bias-free attention and untied embeddings are supported")
    if d.get("q_lora_rank") is None or d.get("index_topk") is None or not d.get("n_routed_experts"):
        raise ValueError("a deepseek_v32 config needs q_lora_rank, index_topk and n_routed_experts")


def v32_from_hf_dict(cls, d: dict):
    """A ``deepseek_v32`` ``config.json`` as ``cls`` (``TinyDSV3Config``); ValueError for
    what the plain-torch model does not implement."""
    _check_supported(d)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    names = {f.name for f in dataclasses.fields(cls)}
    same = {k: d[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "kv_lora_rank", "q_lora_rank",
                              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                              "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                              "first_k_dense_replace", "index_topk", "index_n_heads") if k in names}
    return cls(num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
               rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
               rms_norm_eps=d.get("rms_norm_eps", 1e-6),
               max_position_embeddings=d.get("max_position_embeddings", 4096),
               num_mtp_layers=d.get("num_nextn_predict_layers", 0),
               bos_token_id=d.get("bos_token_id", 256), eos_token_id=d.get("eos_token_id", 257),
               pad_token_id=d.get("pad_token_id", 258), initializer_range=d.get("initializer_range", 0.02),
               torch_dtype=d.get("torch_dtype", d.get("dtype", "bfloat16")) or "bfloat16",
               routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
               norm_topk_prob=bool(d.get("norm_topk_prob", True)), index_head_dim=d.get("index_head_dim", 128),
               **same)


def read_config(model_dir: str) -> TinyDSV3Config:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return TinyDSV3Config.from_hf_dict(json.load(f))
