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

    model = load_model("data/models/pcpviz-tiny-dsv3", device="cpu", dtype=torch.float32)  # .checkpoint
    attn = causal_attention(model)                       # reference attention, one sequence
    hidden = model.forward_hidden(ids, positions, attn)   # [T, hidden] (after final norm)
    logits = model.logits(hidden)                        # [T, vocab]
    mtp_h = model.mtp_forward(ids_shifted, positions, hidden, attn=attn)  # layer_idx = num_layers
    mtp_logits = model.mtp_logits(mtp_h)

The MTP convention is vLLM's: at position p the MTP layer combines the main model's final
(post-norm) hidden state ``h_p`` with the embedding of token ``t_{p+1}`` (zeroed where
``positions == 0``) and predicts ``t_{p+2}``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pcpviz.engine.model_config import TinyDSV3Config

__all__ = ["TinyDSV3", "AttnFn", "causal_attention", "apply_rope", "rope_cos_sin", "rope_inv_freq"]

# attn(layer_idx, q_nope [T,H,Dn], q_pe [T,H,Dr], kv_c [T,R], k_pe [T,Dr]) -> [T, H, Dv]
AttnFn = Callable[..., torch.Tensor]  # TinyDSV32 adds the keyword ``index`` (pcpviz.engine.model_v32)

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


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """float32[rope_dim // 2]: the rotation frequency of each interleaved pair."""
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float, *,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., rope_dim // 2] (float32) for integer ``positions``
    (``inv_freq``: ``rope_inv_freq``'s, when the caller keeps it)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rope_dim, theta, positions.device)
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
    """Multi-head latent attention projections of layer ``layer_idx`` (the attention itself is
    the callback, called with that index)."""

    def __init__(self, cfg: TinyDSV3Config, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
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

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], qr: Optional[torch.Tensor] = None):
        """(q_nope, q_pe, kv_c, k_pe) of the rows ``x``, rope ``(cos, sin)`` applied (``qr``: the
        q LoRA's normed latent of ``x``, when the caller has it)."""
        cos, sin = rope
        cfg = self.cfg
        T = x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if qr is None else qr)
        q = q.view(T, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = ckv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe, cos, sin)
        return q_nope, q_pe, kv_c, k_pe

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnFn) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe = self.project(x, rope)
        out = attn(self.layer_idx, q_nope, q_pe, kv_c, k_pe)
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
        self.self_attn = MLAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def block(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnFn) -> torch.Tensor:
        """The decoder block on rows ``x``: attention then MLP, each with its residual."""
        out = attn(self.layer_idx, *self.attn_inputs(x, *rope))
        return self.attn_outputs(x, out)

    def attn_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The block up to the attention: (q_nope, q_pe, kv_c, k_pe) of the normed rows ``x``
        (pure tensor code: one region ``TinyDSV3.compile_regions`` can fuse)."""
        return self.self_attn.project(self.input_layernorm(x), (cos, sin))

    def attn_outputs(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The block after the attention ``out`` [T, H, Dv]: o_proj and residual, then the MLP
        and its residual (a region, like ``attn_inputs``)."""
        x = x + self.self_attn.o_proj(out.reshape(x.shape[0], -1).to(x.dtype))
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
    def __init__(self, cfg: TinyDSV3Config, layer_cls=DecoderLayer, mtp_cls=MTPLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [layer_cls(cfg, i) for i in range(cfg.num_layers)]
        layers += [mtp_cls(cfg, cfg.num_layers + k) for k in range(cfg.num_mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


class TinyDSV3(nn.Module):
    """DeepSeek-V3 (MLA, dense MLP) main model + MTP module(s); flat token batches [T]."""

    layer_cls, mtp_cls = DecoderLayer, MTPLayer  # TinyDSV32 (model_v32) builds its own blocks

    def __init__(self, config: TinyDSV3Config):
        super().__init__()
        self.config = config
        self.model = _Backbone(config, self.layer_cls, self.mtp_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._inv_freq: dict[str, torch.Tensor] = {}  # device -> rope_inv_freq (kept, not recomputed)
        self._compile_backend: str | None = None  # compile_regions's backend; None: eager only
        self._compiled: dict[str, Callable] = {}  # region name -> its compiled function
        self._regions_on = False  # inside ``regions(True)``: the compiled functions run

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
        c, dev = self.config, str(positions.device)
        inv = self._inv_freq.get(dev)
        if inv is None:
            inv = self._inv_freq[dev] = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, positions.device)
        return rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, inv_freq=inv)

    # -- compiled regions ---------------------------------------------------------------------------
    def compile_regions(self, backend: str = "inductor") -> None:
        """Let ``regions(True)`` run the model's pure tensor code through ``torch.compile``.

        A forward is cut at every attention call (the paged kernels and the PCP all-gathers stay
        as they are), leaving regions of plain tensor code: rope, per block ``attn_inputs`` and
        ``attn_outputs``, the final norm, the MTP inputs, norm and head. Each region is compiled
        on first use per shape (``dynamic=False``: the engine compiles only for its decode graphs'
        fixed shapes), with inductor rounding like eager (``emulate_precision_casts``). A
        batch-1 MTP decode forward is ~110 tiny kernels eager (RMSNorm alone is six); fused, the
        GEMMs, the attention kernels and a handful of fused kernels remain."""
        import torch._dynamo as dynamo

        for knob in ("cache_size_limit", "recompile_limit"):  # one entry per block and shape
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), 256))
        if hasattr(dynamo.config, "accumulated_cache_size_limit"):
            dynamo.config.accumulated_cache_size_limit = max(dynamo.config.accumulated_cache_size_limit, 4096)
        if backend == "inductor":
            import torch._inductor.config as inductor_config

            # compile in this process: a pool of compile workers left running beside a
            # launch-bound decode loop measurably slowed its host side (one H200)
            inductor_config.compile_threads = 1
        self._compile_backend = backend
        self._compiled.clear()

    @property
    def compiled_regions(self) -> tuple[str, ...]:
        """The names of the regions compiled so far (each on its first use in ``regions(True)``)."""
        return tuple(sorted(self._compiled))

    @contextlib.contextmanager
    def regions(self, on: bool = True):
        """Inside, the forwards run their compiled regions (when ``compile_regions`` was called)."""
        before, self._regions_on = self._regions_on, bool(on)
        try:
            yield
        finally:
            self._regions_on = before

    def _region(self, name: str, fn: Callable) -> Callable:
        if not self._regions_on or self._compile_backend is None:
            return fn
        compiled = self._compiled.get(name)
        if compiled is None:
            opts = {"emulate_precision_casts": True} if self._compile_backend == "inductor" else None
            compiled = self._compiled[name] = torch.compile(fn, backend=self._compile_backend, dynamic=False,
                                                            fullgraph=True, options=opts)
        return compiled

    def _block(self, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnFn) -> torch.Tensor:
        layer = self.model.layers[i]
        q = self._region(f"attn_inputs{i}", layer.attn_inputs)(x, *rope)
        return self._region(f"attn_outputs{i}", layer.attn_outputs)(x, attn(layer.layer_idx, *q))

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
        rope = self._region("rope", self.rope)(positions)
        x = self.model.embed_tokens(input_ids)
        per_layer = []
        for i in range(self.config.num_layers):
            x = self._block(i, x, rope, attn)
            if return_layers:
                per_layer.append(x)
        h = self._region("norm", self.model.norm)(x)
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
    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_prev: torch.Tensor, *,
                    attn: AttnFn, k: int = 0) -> torch.Tensor:
        """MTP layer ``k`` (layer index ``num_layers + k``), vLLM's DeepSeek MTP convention.

        ``input_ids[p]`` is token t_{p+1} (the ids shifted left by one), ``positions[p]`` = p,
        ``hidden_prev[p]`` the main model's final hidden h_p. Embeddings at position 0 are
        zeroed (as vLLM does). Returns the block output *before* ``shared_head.norm``; use
        :meth:`mtp_logits` for logits and :meth:`mtp_recycle_hidden` for chained drafting.
        """
        self._check(input_ids, positions)
        rope = self._region("rope", self.rope)(positions)
        x = self._region(f"mtp_inputs{k}", self.mtp_inputs)(input_ids, positions, hidden_prev, k=k)
        return self._block(self.config.num_layers + k, x, rope, attn)

    def mtp_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_prev: torch.Tensor, *,
                   k: int = 0) -> torch.Tensor:
        """The MTP block's input rows: ``eh_proj([enorm(embed(ids)), hnorm(hidden_prev)])``,
        the embedding zeroed at position 0."""
        layer = self.mtp_layer(k)
        e = layer.embed_tokens(input_ids)
        e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        return layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden_prev.to(e.dtype))], dim=-1))

    def mtp_logits(self, mtp_hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        head = self.mtp_layer(k).shared_head
        return self._region(f"mtp_logits{k}", lambda h: head.head(head.norm(h)))(mtp_hidden)

    def mtp_recycle_hidden(self, mtp_hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        """The hidden state vLLM feeds to the next draft step (after ``shared_head.norm``)."""
        return self._region(f"mtp_norm{k}", self.mtp_layer(k).shared_head.norm)(mtp_hidden)

    # -- init / ties -------------------------------------------------------------------------------
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        std = self.config.initializer_range
        n_blocks = self.config.num_layers + self.config.num_mtp_layers
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("norm.weight", "enorm.weight", "hnorm.weight")) or "layernorm" in name:
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
