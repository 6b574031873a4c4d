"""A copy of a DeepSeek-V3.2-shaped checkpoint that vLLM 0.33.0's CUDA kernels take: its indexer
widened to ``--heads`` query heads, the added heads inert (the model unchanged), and, with
``--topk``, ``index_topk`` raised (the model changed: attention sees more keys).

DeepGEMM's fp8 MQA-logits kernels, which vLLM 0.33.0's sparse-attention indexer calls on CUDA
(``model_executor/layers/sparse_attn_indexer.py:728`` prefill, ``:880`` decode), take 32 or 64
heads on compute capability 9 (docs/gpu.md). ``pcpviz-tiny-moe-dsa`` has 16. The indexer's score of
key ``s`` for token ``t`` is ``sum_h w[t, h] * relu(q[t, h] . k[s])`` with ``w = weights_proj(x) *
Di**-0.5 * Hi**-0.5`` (``deepseek_v2.py:852``). A head whose ``wq_b`` rows and ``weights_proj`` row
are zero adds ``0 * relu(0) = 0`` to every score; widening ``Hi`` from 16 to 32 scales every score
by ``2**-0.5``, which keeps their order. So the top-``index_topk`` keys, and with them every logit,
are the model's own (up to ties in float rounding).

``index_topk`` has no weight: it is how many keys the indexer hands the sparse attention. vLLM's
sparse MLA maps them to cache slots in blocks of 128 (``triton_convert_req_index_to_global_index``,
``v1/attention/backends/mla/sparse_utils.py:549``, called from
``model_executor/layers/attention/sparse_mla_attention.py:773``) and asserts ``index_topk % 128 == 0``;
``pcpviz-tiny-moe-dsa`` was trained with 64. With 128, a token attends to its 128 best keys instead
of 64: the same logits while a request's context is at most 64 tokens, others beyond.

    python3 tools/gpu/pad_indexer.py data/models/pcpviz-tiny-moe-dsa /tmp/moe-dsa-vllm --heads 32 --topk 128
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


def pad_indexer_heads(src: Path, dst: Path, *, heads: int = 32, topk: int | None = None) -> Path:
    """Write the widened copy of ``src`` to ``dst`` (a new folder); ``dst`` is returned. The
    checkpoint's other files are copied as they are; ``topk``: its ``index_topk`` (None: kept)."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    hi, di = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    if heads < hi:
        raise ValueError(f"{src}: the indexer has {hi} heads, more than the {heads} asked for")
    if topk is not None and topk < 1:
        raise ValueError(f"--topk {topk}: index_topk must be positive")
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
    out = {**cfg, "index_n_heads": heads, **({} if topk is None else {"index_topk": topk})}
    (dst / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--topk", type=int, help="index_topk of the copy (default: the checkpoint's)")
    a = ap.parse_args(argv)
    try:
        out = pad_indexer_heads(a.src, a.dst, heads=a.heads, topk=a.topk)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pad_indexer: {exc}", file=sys.stderr)
        return 2
    print(f"pad_indexer: {a.src} -> {out} ({a.heads} indexer heads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
