"""The tiny DeepSeek-V3-architecture model (MLA attention + one MTP module), in plain torch.

Written from the DeepSeek-V3 architecture description; parameter names are the Hugging Face /
DeepSeek checkpoint names, so the same ``model.safetensors`` loads into this module,
``transformers.DeepseekV3ForCausalLM`` (main model) and vLLM's ``DeepseekV3ForCausalLM`` +
``DeepSeekMTP`` (main model + MTP layer ``model.layers.{num_hidden_layers}``).

Attention is delegated to a callback so that an engine can run it over its own (paged, PCP
sharded) latent KV cache. For each layer the model computes, for the T new tokens,

* ``q_nope [T, H, qk_nope_head_dim]`` and ``q_pe [T, H, qk_rope_head_dim]`` (rope applied at
  ``positions``),
* ``kv_c [T, kv_lora_rank]`` (after ``kv_a_layernorm``) and ``k_pe [T, qk_rope_head_dim]``
  (rope applied) — the new tokens' latent cache entries,

and calls ``attn(layer_idx, q_nope, q_pe, kv_c, k_pe) -> [T, H, v_head_dim]``. The callback
writes the new entries into its cache and attends causally (by position) over the sequence's
whole context. The softmax scale is ``config.softmax_scale`` = ``1/sqrt(qk_nope + qk_rope)``
(no yarn mscale: rope is plain). Rope uses DeepSeek's interleaved-pair convention
(GPT-J style, vLLM ``is_neox_style=False``): dims ``(2i, 2i+1)`` are rotated by frequency ``i``
and the result stays interleaved, which is how vLLM lays out ``k_pe`` in its cache.
(transformers' ``rope_interleave=True`` path returns the same rotation de-interleaved; q·k and
therefore the logits are identical.)

Usage::

    model = load_model("data/models/pcpviz-tiny-dsv3", device="cpu", dtype=torch.float32)
    attn = causal_attention(model)                       # reference attention, one sequence
    hidden = model.forward_hidden(ids, positions, attn)   # [T, hidden] (after final norm)
    logits = model.logits(hidden)                        # [T, vocab]
    mtp_h = model.mtp_forward(ids_shifted, positions, hidden, attn)  # layer_idx = num_layers
    mtp_logits = model.mtp_logits(mtp_h)

The MTP convention is vLLM's: at position p the MTP layer combines the main model's final
(post-norm) hidden state ``h_p`` with the embedding of token ``t_{p+1}`` (zeroed where
``positions == 0``) and predicts ``t_{p+2}``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TinyDSV3Config", "TinyDSV3", "AttnFn", "load_model", "save_model", "causal_attention",
    "apply_rope", "rope_cos_sin", "read_config", "DEFAULT_MODEL_NAME", "default_model_dir",
]

DEFAULT_MODEL_NAME = "pcpviz-tiny-dsv3"

# attn(layer_idx, q_nope [T,H,Dn], q_pe [T,H,Dr], kv_c [T,R], k_pe [T,Dr]) -> [T, H, Dv]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def check_model_dir(model_dir: str) -> TinyDSV3Config:
    """The model's config, after checking that ``config.json`` parses and ``model.safetensors``
    is a whole safetensors file holding exactly the tensors the config needs, with their
    shapes (its header only: cheap). ValueError naming the file otherwise, so a damaged model
    is bad input before any rank starts, not a rank failure."""
    from safetensors import safe_open

    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        why = "is not a directory" if os.path.exists(model_dir) else "does not exist"
        raise ValueError(f"model directory {model_dir} {why}")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model directory {model_dir} has no config.json")
    try:
        if os.path.getsize(cfg_path) > 1 << 20:
            raise ValueError("larger than 1 MiB")
        cfg = read_config(model_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        why = f"missing key {exc}" if isinstance(exc, KeyError) else " ".join(str(exc).split())
        raise ValueError(f"{cfg_path}: not a usable model config ({why})") from None
    weights = os.path.join(model_dir, "model.safetensors")
    try:
        with safe_open(weights, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{weights}: not a readable safetensors file ({' '.join(str(exc).split())})") from None
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in TinyDSV3(cfg).state_dict().items()}
    if set(want) != set(shapes):
        missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
        raise ValueError(f"{weights}: tensors do not match {cfg_path} (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    bad = next((k for k in want if want[k] != shapes[k]), None)
    if bad is not None:
        raise ValueError(f"{weights}: tensor {bad} has shape {list(shapes[bad])}, the config needs "
                         f"{list(want[bad])}")
    return cfg


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., rope_dim // 2] (float32) for integer ``positions``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rope_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` by angle ``i``; output stays interleaved.

    ``x``: [T, ..., D]; ``cos``/``sin``: [T, D/2] (broadcast over the middle dims).
    """
    dtype = x.dtype
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.reshape(shape)
    s = sin.reshape(shape)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return out.to(dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention projections (the attention itself is the callback)."""

    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.cfg = cfg
        H, d = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, d, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cfg = self.cfg
        T = x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = ckv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe, cos, sin)
        return q_nope, q_pe, kv_c, k_pe

    def forward(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttnFn) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe = self.project(x, cos, sin)
        out = attn(layer_idx, q_nope, q_pe, kv_c, k_pe)
        return self.o_proj(out.reshape(x.shape[0], -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyDSV3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        x = x + self.self_attn(self.layer_idx, self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """DeepSeek MTP module: ``enorm``, ``hnorm``, ``eh_proj``, a decoder block, ``shared_head``.

    ``embed_tokens`` is stored per DeepSeek's layout (it equals the main embedding).
    """

    def __init__(self, cfg: TinyDSV3Config, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        layers += [MTPLayer(cfg, cfg.num_layers + k) for k in range(cfg.num_mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


class TinyDSV3(nn.Module):
    """DeepSeek-V3 (MLA, dense MLP) main model + MTP module(s); flat token batches [T]."""

    def __init__(self, config: TinyDSV3Config):
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def mtp_layer(self, k: int = 0) -> MTPLayer:
        layer = self.model.layers[self.config.num_layers + k]
        assert isinstance(layer, MTPLayer)
        return layer

    def attention_module(self, layer_idx: int) -> MLAttention:
        """The MLA projections of layer ``layer_idx`` (``num_layers`` = the MTP block)."""
        return self.model.layers[layer_idx].self_attn

    def kv_b_weight(self, layer_idx: int) -> torch.Tensor:
        """``kv_b_proj.weight`` of a layer: [H * (qk_nope + v), kv_lora_rank]."""
        return self.attention_module(layer_idx).kv_b_proj.weight

    def mla_up_weights(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, qk_nope, R], W_UV [H, v, R]) — split ``kv_b_proj`` for the absorbed form.

        k_nope[t, h] = W_UK[h] @ kv_c[t];  v[t, h] = W_UV[h] @ kv_c[t].
        """
        c = self.config
        w = self.kv_b_weight(layer_idx).view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.qk_rope_head_dim, self.config.rope_theta)

    @staticmethod
    def _check(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"expected input_ids [T] and positions [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")

    # -- main model ------------------------------------------------------------------------------
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
                       *, return_layers: bool = False):
        """Main model: int64[T] ids, int64[T] positions -> final hidden [T, hidden] (after norm).

        With ``return_layers=True`` also returns the residual stream after each layer.
        """
        self._check(input_ids, positions)
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)
        per_layer = []
        for i in range(self.config.num_layers):
            x = self.model.layers[i].block(x, cos, sin, attn)
            if return_layers:
                per_layer.append(x)
        h = self.model.norm(x)
        return (h, per_layer) if return_layers else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attn: Optional[AttnFn] = None) -> torch.Tensor:
        """Convenience: logits of one contiguous sequence (reference attention)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        attn = attn or causal_attention(self, positions=positions)
        return self.logits(self.forward_hidden(input_ids, positions, attn))

    # -- MTP -------------------------------------------------------------------------------------
    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_prev: torch.Tensor,
                    attn: AttnFn, k: int = 0) -> torch.Tensor:
        """MTP layer ``k`` (layer index ``num_layers + k``), vLLM's DeepSeek MTP convention.

        ``input_ids[p]`` is token t_{p+1} (the ids shifted left by one), ``positions[p]`` = p,
        ``hidden_prev[p]`` the main model's final hidden h_p. Embeddings at position 0 are
        zeroed (as vLLM does). Returns the block output *before* ``shared_head.norm``; use
        :meth:`mtp_logits` for logits and :meth:`mtp_recycle_hidden` for chained drafting.
        """
        self._check(input_ids, positions)
        layer = self.mtp_layer(k)
        cos, sin = self.rope(positions)
        e = layer.embed_tokens(input_ids)
        e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden_prev.to(e.dtype))], dim=-1))
        return layer.block(x, cos, sin, attn)

    def mtp_logits(self, mtp_hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        layer = self.mtp_layer(k)
        return layer.shared_head.head(layer.shared_head.norm(mtp_hidden))

    def mtp_recycle_hidden(self, mtp_hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        """The hidden state vLLM feeds to the next draft step (after ``shared_head.norm``)."""
        return self.mtp_layer(k).shared_head.norm(mtp_hidden)

    # -- init / ties -------------------------------------------------------------------------------
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        std = self.config.initializer_range
        n_blocks = self.config.num_layers + self.config.num_mtp_layers
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name or name.endswith(("enorm.weight", "hnorm.weight")):
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.normal_(0.0, std / math.sqrt(2 * n_blocks), generator=generator)
                else:
                    p.normal_(0.0, std, generator=generator)

    def tie_mtp_to_main(self) -> None:
        """Share embedding and output head between main model and MTP (DeepSeek-V3 training)."""
        for k in range(self.config.num_mtp_layers):
            layer = self.mtp_layer(k)
            layer.embed_tokens.weight = self.model.embed_tokens.weight
            layer.shared_head.head.weight = self.lm_head.weight

    def hf_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict:
        """State dict with checkpoint names, untied copies, contiguous, optionally cast."""
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach()
            if dtype is not None:
                t = t.to(dtype)
            out[name] = t.contiguous().clone().cpu()
        return out


# --------------------------------------------------------------------------------------------
# reference attention (MLA, non-absorbed) over a contiguous batch of sequences
# --------------------------------------------------------------------------------------------


def causal_attention(model: TinyDSV3, query_start_loc: Optional[Sequence[int] | torch.Tensor] = None,
                     positions: Optional[torch.Tensor] = None, *, use_sdpa: bool = True) -> AttnFn:
    """Reference ``attn`` callback: the new tokens are the whole context (no cache).

    The flat token batch is split into sequences by ``query_start_loc`` (``[0, l0, l0+l1, ...]``;
    ``None`` means one sequence). Inside a sequence token i attends to token j iff
    ``positions[j] <= positions[i]`` (plain index order when ``positions`` is None).

    MLA in the non-absorbed form: ``kv_b_proj`` expands ``kv_c`` into per-head
    ``k_nope``/``v``; keys are ``[k_nope, k_pe]`` (k_pe shared by all heads), queries
    ``[q_nope, q_pe]``; scores are scaled by ``config.softmax_scale`` and softmaxed in float32.
    """
    cfg = model.config
    qsl = None
    if query_start_loc is not None:
        qsl = [int(v) for v in (query_start_loc.tolist() if torch.is_tensor(query_start_loc) else query_start_loc)]

    def attn(layer_idx: int, q_nope, q_pe, kv_c, k_pe):
        T, H = q_nope.shape[0], q_nope.shape[1]
        w = model.kv_b_weight(layer_idx)
        kv = F.linear(kv_c.to(w.dtype), w).view(T, H, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(T, H, cfg.qk_rope_head_dim).to(k_nope.dtype)], dim=-1)
        bounds = qsl if qsl is not None else [0, T]
        if bounds[-1] != T:
            raise ValueError(f"query_start_loc ends at {bounds[-1]} but there are {T} tokens")
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        # fast path: short equal-length sequences in index order -> one batched SDPA call
        if positions is None and len(set(lens)) == 1 and use_sdpa and (lens[0] <= SDPA_MAX_LEN or q.is_cuda):
            B, L = len(lens), lens[0]
            qb, kb, vb = (t.reshape(B, L, H, -1).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=cfg.softmax_scale)
            return o.transpose(1, 2).reshape(T, H, cfg.v_head_dim)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            pos = positions[a:b] if positions is not None else None
            outs.append(_masked_attention(q[a:b], k[a:b], v[a:b], pos, cfg.softmax_scale))
        return torch.cat(outs, dim=0)

    return attn


SDPA_MAX_LEN = 2048  # longer sequences use the query-blocked path (bounded memory)
QUERY_BLOCK = 512


def _masked_attention(q, k, v, pos, scale, block: Optional[int] = None):
    """One sequence: q [L,H,Dqk], k [L,H,Dqk], v [L,H,Dv] -> [L,H,Dv].

    Query i attends key j iff ``pos[j] <= pos[i]`` (index order when ``pos`` is None). Scores
    and softmax in float32, computed ``block`` queries at a time (memory O(block * L)).
    """
    block = block or QUERY_BLOCK
    L = q.shape[0]
    kf, vf = k.float(), v.float()
    idx = torch.arange(L, device=q.device) if pos is None else pos
    outs = []
    for s in range(0, L, block):
        e = min(L, s + block)
        # in index order, keys after the block's last query are never visible
        n_keys = e if pos is None else L
        sc = torch.einsum("lhd,shd->hls", q[s:e].float(), kf[:n_keys]) * scale
        mask = idx[None, :n_keys] <= idx[s:e, None]
        sc = sc.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        outs.append(torch.einsum("hls,shd->lhd", p, vf[:n_keys]))
    return torch.cat(outs, dim=0).to(v.dtype)


# --------------------------------------------------------------------------------------------
# (de)serialization
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors_fallback(tensors: dict, path: str, metadata: dict) -> None:
    """Minimal safetensors writer (used only where the ``safetensors`` package is missing)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hdr = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hdr += b" " * ((8 - len(hdr) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for name in names:
            t = tensors[name].contiguous().view(-1).view(torch.uint8)
            try:
                f.write(t.numpy().tobytes())
            except Exception:  # no numpy
                f.write(bytes(t.tolist()))


def save_model(model: TinyDSV3, out_dir: str, dtype: Optional[torch.dtype] = None,
               metadata: Optional[dict] = None, *, force_fallback_writer: bool = False) -> str:
    """Write ``config.json`` + ``model.safetensors`` (checkpoint names) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config
    if dtype is None:
        dtype = getattr(torch, cfg.torch_dtype)
    cfg = dataclasses.replace(cfg, torch_dtype=str(dtype).replace("torch.", ""))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
        f.write("\n")
    tensors = model.hf_state_dict(dtype)
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    path = os.path.join(out_dir, "model.safetensors")
    try:
        if force_fallback_writer:
            raise ImportError
        from safetensors.torch import save_file
    except ImportError:
        _write_safetensors_fallback(tensors, path, meta)
    else:
        save_file(tensors, path, metadata=meta)
    os.chmod(path, 0o644)
    return path


def load_model(model_dir: Optional[str] = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> TinyDSV3:
    """Build :class:`TinyDSV3` from ``config.json`` + ``model.safetensors`` (strict names)."""
    from safetensors.torch import load_file

    model_dir = model_dir or default_model_dir()
    cfg = read_config(model_dir)
    with torch.device("meta"):
        model = TinyDSV3(cfg)
    state = load_file(os.path.join(model_dir, "model.safetensors"), device="cpu")
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing={sorted(missing)} unexpected={sorted(unexpected)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device=device).eval()
