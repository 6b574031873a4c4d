"""A model directory checked without torch: the launcher validates ``config.json`` and
``model.safetensors`` before any rank starts (a damaged model is bad input, one line), and
importing torch there would add seconds to every ``pcpviz run``.

``tensor_shapes(cfg)`` is the checkpoint's tensor names and shapes for a config (the modules of
``pcpviz.engine.model.TinyDSV3``; ``tests/engine/test_model_files.py`` holds it against the
model); ``safetensors_shapes(path)`` reads a safetensors file's header only. The tiny model
(hidden 256, vocabulary 264, 2 layers + 1 MTP layer, no q LoRA) has 39 tensors::

    >>> from pcpviz.engine.model_config import TinyDSV3Config
    >>> s = tensor_shapes(TinyDSV3Config(vocab_size=264, hidden_size=256, intermediate_size=768,
    ...                                  num_layers=2, num_heads=4, kv_lora_rank=512))
    >>> len(s), s["model.layers.0.self_attn.kv_b_proj.weight"], s["model.layers.2.eh_proj.weight"]
    (39, (1024, 512), (256, 512))
"""

from __future__ import annotations

import json
import os
import struct

from pcpviz.engine.model_config import TinyDSV3Config, read_config
from pcpviz.limits import MAX_SAFETENSORS_HEADER_BYTES

__all__ = ["tensor_shapes", "safetensors_shapes", "check_model_dir"]


def _block(prefix: str, cfg: TinyDSV3Config) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors (MLA attention, dense MLP)."""
    d, h, a = cfg.hidden_size, cfg.num_heads, f"{prefix}.self_attn."
    out = {f"{prefix}.input_layernorm.weight": (d,), f"{prefix}.post_attention_layernorm.weight": (d,)}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        out.update({a + "q_a_proj.weight": (cfg.q_lora_rank, d), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                    a + "q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank)})
    out.update({
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (d, h * cfg.v_head_dim),
    })
    if cfg.is_sparse:  # the DSA indexer (pcpviz.engine.indexer)
        i, di = a + "indexer.", cfg.index_head_dim
        out.update({i + "wq_b.weight": (cfg.index_n_heads * di, cfg.q_lora_rank), i + "wk.weight": (di, d),
                    i + "k_norm.weight": (di,), i + "k_norm.bias": (di,),
                    i + "weights_proj.weight": (cfg.index_n_heads, d)})
    layer_idx = int(prefix.rsplit(".", 1)[1])
    if cfg.moe_layer(layer_idx):  # pcpviz.engine.moe
        m, inter, e = f"{prefix}.mlp.", cfg.moe_intermediate_size, cfg.n_routed_experts
        out.update({m + "gate.weight": (e, d), m + "gate.e_score_correction_bias": (e,)})
        experts = [f"experts.{j}." for j in range(e)] + (["shared_experts."] if cfg.n_shared_experts else [])
        for x in experts:
            w = inter * (cfg.n_shared_experts if x == "shared_experts." else 1)
            out.update(_swiglu(m + x, d, w))
    else:
        out.update(_swiglu(f"{prefix}.mlp.", d, cfg.intermediate_size))
    return out


def _swiglu(prefix: str, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, d), prefix + "up_proj.weight": (inter, d),
            prefix + "down_proj.weight": (d, inter)}


def tensor_shapes(cfg: TinyDSV3Config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes for ``cfg``: embedding, ``num_layers`` decoder
    layers, ``num_mtp_layers`` MTP layers (a decoder layer with its own embedding, norms,
    ``eh_proj`` and shared head), the final norm and the LM head."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (v, d)}
    for i in range(cfg.num_layers + cfg.num_mtp_layers):
        p = f"model.layers.{i}"
        out.update(_block(p, cfg))
        if i >= cfg.num_layers:
            out.update({f"{p}.embed_tokens.weight": (v, d), f"{p}.enorm.weight": (d,), f"{p}.hnorm.weight": (d,),
                        f"{p}.eh_proj.weight": (d, 2 * d), f"{p}.shared_head.norm.weight": (d,),
                        f"{p}.shared_head.head.weight": (v, d)})
    out.update({"model.norm.weight": (d,), "lm_head.weight": (v, d)})
    return out


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file's header declares, after checking that the header is
    whole and every tensor's bytes lie inside the file. ValueError (one line) otherwise."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
            raise ValueError(f"header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data = size - 8 - n
    shapes = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(x) for x in t["shape"])
            lo, hi = (int(x) for x in t["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"tensor {name}: malformed entry ({exc})") from None
        if not 0 <= lo <= hi <= data:
            raise ValueError(f"tensor {name}: bytes {lo}..{hi} outside the {data} data bytes (truncated?)")
        shapes[name] = shape
    return shapes


def check_model_dir(model_dir: str) -> TinyDSV3Config:
    """The model's config, after checking that ``config.json`` parses and ``model.safetensors``
    is a whole safetensors file holding exactly the tensors the config needs, with their
    shapes (its header only: cheap, and no torch). ValueError naming the file otherwise, so a
    damaged model is bad input before any rank starts, not a rank failure."""
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
        want = tensor_shapes(cfg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        why = f"missing key {exc}" if isinstance(exc, KeyError) else " ".join(str(exc).split())
        raise ValueError(f"{cfg_path}: not a usable model config ({why})") from None
    weights = os.path.join(model_dir, "model.safetensors")
    try:
        shapes = safetensors_shapes(weights)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{weights}: not a readable safetensors file ({' '.join(str(exc).split())})") from None
    if set(want) != set(shapes):
        missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
        raise ValueError(f"{weights}: tensors do not match {cfg_path} (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    bad = next((k for k in want if want[k] != shapes[k]), None)
    if bad is not None:
        raise ValueError(f"{weights}: tensor {bad} has shape {list(shapes[bad])}, the config needs "
                         f"{list(want[bad])}")
    return cfg
