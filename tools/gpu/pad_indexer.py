"""A copy of a DeepSeek-V3.2-shaped checkpoint with its indexer widened to ``--heads`` query heads,
the added heads inert: what DeepGEMM needs on Hopper, the model unchanged.

DeepGEMM's fp8 MQA-logits kernels, which vLLM 0.33.0's sparse-attention indexer calls on CUDA
(``model_executor/layers/sparse_attn_indexer.py:728`` prefill, ``:880`` decode), take 32 or 64
heads on compute capability 9 (docs/gpu.md). ``pcpviz-tiny-moe-dsa`` has 16. The indexer's score of
key ``s`` for token ``t`` is ``sum_h w[t, h] * relu(q[t, h] . k[s])`` with ``w = weights_proj(x) *
Di**-0.5 * Hi**-0.5`` (``deepseek_v2.py:852``). A head whose ``wq_b`` rows and ``weights_proj`` row
are zero adds ``0 * relu(0) = 0`` to every score; widening ``Hi`` from 16 to 32 scales every score
by ``2**-0.5``, which keeps their order. So the top-``index_topk`` keys, and with them every logit,
are the model's own (up to ties in float rounding).

    python3 tools/gpu/pad_indexer.py data/models/pcpviz-tiny-moe-dsa /tmp/moe-dsa-h32 --heads 32
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["pad_indexer_heads"]


def pad_indexer_heads(src: Path, dst: Path, *, heads: int = 32) -> Path:
    """Write the widened copy of ``src`` to ``dst`` (a new folder); ``dst`` is returned. The
    checkpoint's other files are copied as they are."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    hi, di = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    if heads < hi:
        raise ValueError(f"{src}: the indexer has {hi} heads, more than the {heads} asked for")
    dst.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    for name, t in state.items():
        if name.endswith("indexer.wq_b.weight"):  # [Hi * Di, q_lora_rank]: head h is rows h*Di .. (h+1)*Di
            state[name] = torch.cat([t, t.new_zeros((heads - hi) * di, t.shape[1])])
        elif name.endswith("indexer.weights_proj.weight"):  # [Hi, hidden]: one row per head
            state[name] = torch.cat([t, t.new_zeros(heads - hi, t.shape[1])])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**cfg, "index_n_heads": heads}, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--heads", type=int, default=32)
    a = ap.parse_args(argv)
    try:
        out = pad_indexer_heads(a.src, a.dst, heads=a.heads)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pad_indexer: {exc}", file=sys.stderr)
        return 2
    print(f"pad_indexer: {a.src} -> {out} ({a.heads} indexer heads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
