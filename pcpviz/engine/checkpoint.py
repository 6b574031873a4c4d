"""The tiny model's checkpoint on disk: ``config.json`` + ``model.safetensors`` (checkpoint names).

    model = load_model("data/models/pcpviz-tiny-dsv3", device="cpu", dtype=torch.float32)
    save_model(model, "out/tiny", dtype=torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Optional

import torch

from pcpviz.engine.model import TinyDSV3
from pcpviz.engine.model_v32 import build_model
from pcpviz.engine.model_config import TinyDSV3Config, default_model_dir, read_config

__all__ = ["load_model", "save_model"]


def _shell(cfg: TinyDSV3Config) -> TinyDSV3:
    """The model's modules, before the checkpoint's weights go in.
    Built on the CPU, not on the meta device: a tiny model's default init there costs ~30 ms,
    while ``nn.Embedding``'s ``normal_`` on meta tensors goes through ``torch._refs`` and
    imports ``torch._dynamo`` (1.5 s and more of every rank's start)."""
    return build_model(cfg)  # TinyDSV32 for a deepseek_v32 config


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


def save_model(model: TinyDSV3, out_dir: str, dtype: Optional[torch.dtype] = None, *,
               metadata: Optional[dict] = None, force_fallback_writer: bool = False) -> str:
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
    model = _shell(cfg)
    state = load_file(os.path.join(model_dir, "model.safetensors"), device="cpu")
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing={sorted(missing)} unexpected={sorted(unexpected)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device=device).eval()
