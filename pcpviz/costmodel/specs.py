"""What the cost model is told: the GPU, the model's shapes, and a serving system's free parameters.

Three plain frozen dataclasses. ``Hardware`` and ``ModelSpec`` are stated, never fitted;
``System`` holds the few parameters ``pcpviz.costmodel.fit`` fits to measured points.

Worked numbers (``ModelSpec.params_per_token``, bf16):

* the shipped tiny model (``data/models/pcpviz-tiny-dsv3``, 2 layers, hidden 256, 4 heads):
  1.00 M MLA projection + 0.59 M MLP weights a layer, so a token multiplies 3.2 M weights
  (6.4 MFLOP) and a decode step reads ~6.5 MB of weights (lm_head included): 1.4 us of HBM
  time on an H200. One 32k-token prefill is ~2.6 TFLOP of causal attention (2 layers) but
  only ~0.2 TFLOP of GEMMs.
* DeepSeek-V3 (61 layers, hidden 7168, 128 heads, 256 routed experts, top 8): ~35.7 B weights
  a token touches (~37 B active with the lm_head), 670 B in all; at 128k positions one layer's
  causal attention is ~700 TFLOP, the whole prefill ~4.3e16 FLOP, ~4.5x all its GEMMs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

__all__ = ["Hardware", "H200", "ModelSpec", "System", "tiny_model", "deepseek_v3", "model_by_name",
           "MODEL_NAMES", "DEEPSEEK_V3_CONFIG"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Stated, not fitted (the sources are the vendor's data sheets as
    remembered here, rounded; change them to ask "what if").

    ``H200``: 989 TFLOP/s dense bf16 tensor cores, 4.8 TB/s HBM3e, NVLink 450 GB/s per
    direction, 50 GB/s (400 Gb/s InfiniBand) per GPU between nodes, 20 us a collective's fixed
    cost, 8 GPUs a node. A 32k-token all-gather of 576-wide bf16 latent rows at PCP=2 moves
    16,000 x 576 x 2 B = 18.4 MB into each rank: 41 us over NVLink, plus 20 us.
    """

    name: str
    flops_per_s: float          # dense bf16 tensor-core peak, one GPU
    hbm_bytes_per_s: float      # HBM bandwidth, one GPU
    nvlink_bytes_per_s: float   # per direction, one GPU (within a node)
    internode_bytes_per_s: float  # per GPU between nodes
    link_latency_s: float       # fixed cost of one collective
    gpus_per_node: int

    def link_bytes_per_s(self, gpus: int) -> float:
        """Bandwidth of a collective spanning ``gpus`` GPUs (NVLink if they fit in a node)."""
        return self.nvlink_bytes_per_s if gpus <= self.gpus_per_node else self.internode_bytes_per_s


H200 = Hardware(name="H200", flops_per_s=989e12, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9,
                internode_bytes_per_s=50e9, link_latency_s=20e-6, gpus_per_node=8)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A DeepSeek-V3-style model's shapes, as the cost model needs them (built from an HF config).

    MLA: a layer's query/key width is ``qk_nope + qk_rope`` per head, values ``v_head_dim``;
    the KV cache holds one latent row of ``kv_lora_rank + qk_rope`` elements per token and
    layer (576 for both models here). Routed experts: ``moe_layers`` layers of
    ``routed_experts`` experts, ``experts_per_token`` of them per token; the rest of the weights
    (``dense_params``) every token uses. ``kv_b_params`` (the latent up-projection, part of
    ``dense_params``) is applied per *context* token at prefill (keys/values are decompressed
    from the gathered latents) and per query token at decode (absorbed into q and o).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    vocab: int
    dense_params: int         # per target forward, every token: attention, dense / shared MLPs (no lm_head)
    kv_b_params: int          # the latent up-projection of one layer (in dense_params, layers times)
    expert_params: int        # one routed expert of one layer
    routed_experts: int
    experts_per_token: int
    moe_layers: int
    mtp_layers: int
    mtp_dense_params: int     # one MTP module: eh_proj + its layer's dense part (no lm_head)
    mtp_moe: bool             # the MTP layer routes experts too
    weight_bytes: float       # bytes per weight (bf16 2, fp8 1)
    kv_bytes: float           # bytes per latent-cache element
    act_bytes: float = 2.0    # bytes per activation element (hidden states on the wire)

    @property
    def latent_dim(self) -> int:
        """One token's KV-cache row per layer: 512 + 64 = 576 for both models here."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params_per_token(self) -> int:
        """Weights one token multiplies in a target forward (routed experts: its top-k only)."""
        return self.dense_params + self.moe_layers * self.experts_per_token * self.expert_params

    @property
    def total_params(self) -> int:
        return (self.dense_params + self.moe_layers * self.routed_experts * self.expert_params
                + self.lm_head_params)

    def touched_experts(self, tokens: float) -> float:
        """Expected routed experts a layer reads for ``tokens`` tokens (uniform routing):
        ``E * (1 - (1 - k/E)^tokens)``. DeepSeek-V3: 8 at 1 token, 81 at 12, 254 at 512."""
        if self.routed_experts == 0 or tokens <= 0:
            return 0.0
        e, k = self.routed_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @classmethod
    def from_hf(cls, name: str, cfg: Mapping, *, weight_bytes: float, kv_bytes: float) -> "ModelSpec":
        """Shapes from an HF ``DeepseekV3Config`` dict (``config.json``)."""
        h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
        lora, q_lora = int(cfg["kv_lora_rank"]), cfg.get("q_lora_rank")
        qk = nope + rope
        q = h * nh * qk if not q_lora else h * int(q_lora) + int(q_lora) * nh * qk
        kv_b = lora * nh * (nope + v)
        attn = q + h * (lora + rope) + kv_b + nh * v * h
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("n_routed_experts") or 0)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = max(0, layers - first_dense) if experts else 0
        dense_mlp = 3 * h * int(cfg["intermediate_size"])
        moe_inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        expert = 3 * h * moe_inter
        shared = int(cfg.get("n_shared_experts") or 0) * expert + h * experts  # shared experts + router
        dense = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * shared
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        mtp_moe = bool(experts) and layers >= first_dense  # the MTP layer's index is `layers`
        mtp_dense = 2 * h * h + attn + (shared if mtp_moe else dense_mlp)
        return cls(name=name, layers=layers, hidden=h, heads=nh, kv_lora_rank=lora, qk_nope_dim=nope,
                   qk_rope_dim=rope, v_head_dim=v, vocab=int(cfg["vocab_size"]), dense_params=dense,
                   kv_b_params=kv_b, expert_params=expert, routed_experts=experts,
                   experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_layers=moe_layers, mtp_layers=n_mtp, mtp_dense_params=mtp_dense, mtp_moe=mtp_moe,
                   weight_bytes=weight_bytes, kv_bytes=kv_bytes)


# DeepSeek-V3's published config.json values, as remembered here (no file of it is in this repo):
# 61 layers (3 dense, 58 MoE), hidden 7168, 128 heads, MLA q_lora 1536 / kv_lora 512 / nope 128 /
# rope 64 / v 128, dense MLP 18432, 256 routed experts of 2048 plus 1 shared, top 8, vocab 129280,
# one MTP module. These give 671 B weights, ~37 B active per token, as DeepSeek reports.
DEEPSEEK_V3_CONFIG = {
    "hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "vocab_size": 129280, "num_nextn_predict_layers": 1,
}


def tiny_model(model_dir: str | None = None) -> ModelSpec:
    """The shipped model, read from its ``config.json`` (bf16 weights and latent cache)."""
    from pcpviz.engine.model_config import default_model_dir, read_config

    cfg = read_config(model_dir or default_model_dir()).to_hf_dict()
    return ModelSpec.from_hf("tiny", cfg, weight_bytes=2.0, kv_bytes=2.0)


def deepseek_v3() -> ModelSpec:
    """DeepSeek-V3 with fp8 weights (1 byte, as DeepSeek ships them) and a bf16 latent cache."""
    return ModelSpec.from_hf("deepseek-v3", DEEPSEEK_V3_CONFIG, weight_bytes=1.0, kv_bytes=2.0)


MODEL_NAMES = ("tiny", "deepseek-v3")


def model_by_name(name: str) -> ModelSpec:
    if name == "tiny":
        return tiny_model()
    if name == "deepseek-v3":
        return deepseek_v3()
    raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODEL_NAMES)})")


@dataclasses.dataclass(frozen=True)
class System:
    """A serving system's fitted parameters: per-step overhead and achieved efficiencies.

    Overhead of one serving step = ``step_s`` + ``layer_s`` per decoder layer a forward runs
    (target and draft) + ``draft_s`` per draft forward + ``token_s`` per scheduled token of the
    global batch (host work every rank repeats) + ``pcp_token_s`` more per token when PCP > 1
    (the PCP layout, gathers and restores). Kernels reach ``attn_eff`` / ``gemm_eff`` of peak
    FLOP/s and ``bw_eff`` of HBM bandwidth.

    Example (vLLM 0.33.0 eager on the tiny model, the shipped fit, rounded): a batch-1 decode
    step at PCP=2 is ~4 ms, nearly all ``step_s`` + 2 x ``layer_s``; the 2-layer model's
    kernels take microseconds of it.
    """

    name: str
    step_s: float
    layer_s: float
    draft_s: float
    token_s: float
    pcp_token_s: float
    attn_eff: float
    gemm_eff: float
    bw_eff: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "name":
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"System {self.name}: {f.name} must be a finite number >= 0, got {v!r}")
            if f.name.endswith("_eff") and not 0 < v <= 1:
                raise ValueError(f"System {self.name}: {f.name} must be in (0, 1], got {v!r}")


def repo_root() -> str:
    """The checkout's root (where data/ and benchmarks/ live): three levels above this file."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
