"""The tiny model's configuration: ``config.json`` (Hugging Face DeepSeek-V3 keys) as a frozen
dataclass, and where the shipped checkpoint lives.

    cfg = read_config(default_model_dir())   # TinyDSV3Config(hidden_size=..., num_hidden_layers=2, ...)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

__all__ = ["TinyDSV3Config", "read_config", "DEFAULT_MODEL_NAME", "default_model_dir"]

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

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` contents (loads as ``transformers.DeepseekV3Config``)."""
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


def read_config(model_dir: str) -> TinyDSV3Config:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return TinyDSV3Config.from_hf_dict(json.load(f))
