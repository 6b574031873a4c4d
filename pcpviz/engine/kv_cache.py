"""The paged latent KV cache of MLA and attention over it (torch reference).

MLA caches one latent vector per token and layer: ``kv_c`` (``kv_lora_rank``)
concatenated with the roped ``k_pe`` (``qk_rope_head_dim``) — 576 numbers for
DeepSeek-sized ranks. The cache is a flat ``[num_blocks * block_size, 576]``
tensor per layer, indexed by KV *slot* (``block_id * block_size + offset``).
Under PCP every rank holds a full replica: the target and the draft prefill
all-gather the new latents and write them through the gathered slot mapping
(PAD = -1 rows are skipped); replicated draft decodes write locally through
their unexpanded mapping.

Attention of a query at position p of a request reads that request's slots for
positions ``0..p`` through its block-table row (causal by position). Padding
query rows (``seq_len == 0``) produce zeros.

On CUDA the write and the attention run the Triton kernels of ``pcpviz_kernels``
(``kernels/`` in the repository); the torch code here is the CPU path and their
oracle. ``PCPVIZ_KERNELS=0`` forces the torch path on CUDA too (A/B runs), and
batches whose longest row has more than ``kernel_max_query_len()`` queries (long
prefill chunks) attend in torch, which is faster there (see that function).
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

__all__ = ["LatentKVCache", "paged_mla_attention", "context_slots", "kernels_for", "kernel_max_query_len"]

_KERNELS = None  # the pcpviz_kernels module once imported; False if it cannot be


def _import_kernels():
    global _KERNELS
    if _KERNELS is None:
        try:
            import pcpviz_kernels as mod
        except ImportError:
            # A source checkout without `pip install -e .`: kernels/ sits next to pcpviz/.
            root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "kernels")
            root = os.path.normpath(root)
            if os.path.isdir(os.path.join(root, "pcpviz_kernels")) and root not in sys.path:
                sys.path.append(root)
            try:
                import pcpviz_kernels as mod
            except ImportError as e:  # pragma: no cover - broken install
                warnings.warn(f"pcpviz_kernels unavailable ({e}); using the torch reference on CUDA")
                mod = False
        _KERNELS = mod
    return _KERNELS


def kernel_max_query_len() -> int:
    """Rows with more queries than this (long prefill chunks) take the torch path on CUDA.

    Measured on the H200 (data/bench/kernels_h200.json): decode and draft decode are 4.5-11x
    faster in the kernel, but a 2048-query DualChunkSwap segment at the engine's
    near-fp32 precision (tf32x3) runs at 0.65x of the torch path's cuBLAS fp32 GEMMs.
    The crossover between was not measured; 256 is a guess. ``PCPVIZ_KERNELS_MAX_QUERY_LEN``
    overrides it."""
    return int(os.environ.get("PCPVIZ_KERNELS_MAX_QUERY_LEN", "256"))


def kernels_for(t: torch.Tensor):
    """The kernels module if ``t`` lives on CUDA and ``PCPVIZ_KERNELS`` is not "0", else None."""
    if not t.is_cuda or os.environ.get("PCPVIZ_KERNELS", "1") == "0":
        return None
    mod = _import_kernels()
    if not mod or mod.INTERPRET:  # interpreted kernels are for CPU tests, not for the engine
        return None
    return mod


class LatentKVCache:
    """``num_layers`` flat latent caches of ``[num_slots, kv_lora_rank + rope_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.layers = [
            torch.zeros(num_blocks * block_size, kv_lora_rank + rope_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, *, checked: bool = False) -> None:
        """Write ``latent[i]`` to ``slots[i]``; PAD (-1) rows are skipped.

        ``slots``: int64[M]; ``latent``: [M, kv_lora_rank + rope_dim]. ``checked``: the caller
        has checked ``slots < num_slots`` on the host, so the kernel path skips its device sync."""
        if slots.shape[0] != latent.shape[0]:
            raise ValueError(f"slot mapping has {slots.shape[0]} rows, latent has {latent.shape[0]}")
        k = kernels_for(self.layers[layer])
        if k is not None:
            if not checked and slots.numel() and int(slots.max()) >= self.num_slots:
                raise IndexError(f"KV slot {int(slots.max())} beyond the cache ({self.num_slots} slots)")
            k.write_kv_cache(self.layers[layer], slots, latent)
            return
        keep = slots >= 0
        if bool(keep.any()):
            s = slots[keep]
            if int(s.max()) >= self.num_slots:
                raise IndexError(f"KV slot {int(s.max())} beyond the cache ({self.num_slots} slots)")
            self.layers[layer].index_copy_(0, s, latent[keep].to(self.layers[layer].dtype))

    def digest(self, slots: np.ndarray | None = None) -> str:
        """A short hash of the cache contents (all layers), to compare replicas across ranks."""
        import hashlib

        h = hashlib.blake2b(digest_size=8)
        for layer in self.layers:
            data = layer if slots is None else layer[torch.as_tensor(slots, device=layer.device)]
            h.update(data.detach().float().cpu().numpy().tobytes())
        return h.hexdigest()


def context_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """int64[seq_len]: the slots of positions 0..seq_len-1 of a request."""
    pos = torch.arange(seq_len, device=block_row.device)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def _attend(q_nope, q_pe, kv_c, k_pe, positions, w_uk, w_uv, scale):
    q_lat = torch.einsum("qhd,hdr->qhr", q_nope.float(), w_uk.float())  # [q, H, R]
    scores = torch.einsum("qhr,kr->qhk", q_lat, kv_c) + torch.einsum("qhd,kd->qhk", q_pe.float(), k_pe)
    scores = scores * scale
    kpos = torch.arange(kv_c.shape[0], device=scores.device)
    mask = kpos[None, :] > positions[:, None]  # causal by position
    scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.einsum("qhk,kr->qhr", probs, kv_c)
    return torch.einsum("qhr,hvr->qhv", ctx, w_uv.float())


def paged_mla_attention(
    q_nope: torch.Tensor,  # [Q, H, Dn]
    q_pe: torch.Tensor,  # [Q, H, Dr]
    cache: torch.Tensor,  # [num_slots, R + Dr]
    block_rows: torch.Tensor,  # int32[B, W]: block-table row of each batch row
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[Q]
    seq_lens: torch.Tensor,  # int[B]: context length per batch row (last query position + 1)
    w_uk: torch.Tensor,  # [H, Dn, R]
    w_uv: torch.Tensor,  # [H, Dv, R]
    block_size: int,
    scale: float,
    query_block: int = 2048,
    max_query_len: int | None = None,  # host-known bounds (kernel path: saves a device sync)
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [Q, H, Dv]
    """MLA over the paged latent cache, in the *absorbed* form vLLM's MLA decode uses:
    ``q_lat = q_nope @ W_UK`` scores against the latent directly, and the output
    ``softmax(...) @ kv_c`` is projected back with ``W_UV``. Mathematically equal
    to expanding K/V through ``kv_b_proj``.

    On CUDA (rows of at most ``kernel_max_query_len()`` queries): ``q_lat`` and the ``W_UV``
    projection in torch, the attention itself in ``pcpviz_kernels.paged_mla_attention``
    (fp32 accumulation, tf32x3 products: about fp32 accuracy)."""
    r = w_uk.shape[-1]
    k = kernels_for(cache)
    if k is not None and max_query_len is None:
        lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(lens.max()) if lens.numel() else 0
    if k is not None and max_query_len <= kernel_max_query_len():
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope.float(), w_uk.float())  # [Q, H, R]
        ctx = k.paged_mla_attention(q_lat, q_pe.float(), cache, block_rows, query_start_loc, positions,
                                    seq_lens, block_size, scale, max_query_len=max_query_len,
                                    max_seq_len=max_seq_len)  # float32[Q, H, R]
        return torch.einsum("qhr,hvr->qhv", ctx, w_uv.float())
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float32,
                      device=q_nope.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        lo, hi, n = qsl[b], qsl[b + 1], int(lens[b])
        if hi <= lo or n <= 0:
            continue
        slots = context_slots(block_rows[b], n, block_size)
        lat = cache[slots].float()  # [n, R + Dr]
        kv_c, k_pe = lat[:, :r], lat[:, r:]
        # Long chunks go in query blocks: bounded memory, and causality trims each block's context.
        for qlo in range(lo, hi, query_block):
            qhi = min(qlo + query_block, hi)
            pos = positions[qlo:qhi]
            ctx = min(n, int(pos.max()) + 1)
            out[qlo:qhi] = _attend(q_nope[qlo:qhi], q_pe[qlo:qhi], kv_c[:ctx], k_pe[:ctx], pos,
                                   w_uk, w_uv, scale)
    return out
