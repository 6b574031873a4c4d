"""The paged latent KV cache of MLA and attention over it (torch reference).

MLA caches one latent vector per token and layer: ``kv_c`` (``kv_lora_rank``)
concatenated with the roped ``k_pe`` (``qk_rope_head_dim``) — 576 numbers for
DeepSeek-sized ranks. The cache is a flat ``[num_blocks * block_size, 576]``
tensor per layer, indexed by KV *slot* (``block_id * block_size + offset``).
Under PCP with DCP = 1 every rank holds a full replica (with DCP > 1 its DCP share: the
slots of tokens another DCP rank stores are PAD, vLLM's ``block_table.py:394, 411``). The
target and the draft prefill all-gather the new latents and write them through the gathered
slot mapping (PAD = -1 rows are skipped); replicated draft decodes write locally through
their unexpanded mapping.

Attention of a query at position p of a request reads that request's slots for
positions ``0..p`` through its block-table row (causal by position). Padding
query rows (``seq_len == 0``) produce zeros.

On CUDA the write and the attention run the Triton kernels of ``pcpviz_kernels``
(``kernels/`` in the repository); the torch code here is the CPU path and their
oracle. ``PCPVIZ_KERNELS=0`` forces the torch path on CUDA too (A/B runs). A batch
is split by rows as vLLM's MLA backends split it: rows of at most
``decode_max_query_len()`` queries (decode, MTP verify and draft rows, tiny chunks) attend
in the absorbed form over the paged latents (``paged_mla_attention``); longer rows
(prefill chunks, DualChunkSwap chunk pairs) gather their context's latents, up-project
them to per-head K/V with ``W_UK``/``W_UV`` and run causal flash attention
(``mla_prefill_attention``), 3.4x fewer flops per (query, key) pair.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

__all__ = ["LatentKVCache", "paged_mla_attention", "paged_mla_attention_kernels", "context_slots", "kernels_for",
           "decode_max_query_len", "lens_on_host"]

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


def decode_max_query_len() -> int:
    """Rows with at most this many queries take the absorbed (decode) kernel on CUDA, longer
    rows the expanded flash prefill kernel.

    Per key, the expanded form first pays the up-projection (``2 * R * H * (Dn + Dv)`` flops,
    1 MFLOP at the shipped sizes) and then 640 flops per query and head instead of the absorbed
    form's 2176: it wins from a few dozen queries a row, and the absorbed form is also
    bandwidth-optimal for decode (one 576-wide latent read per key). vLLM's FlashMLA backend
    sends rows of up to 128 queries down its decode path; this engine's 4-head model has a
    cheaper up-projection, so the default is 16 (MTP verify rows have 1 + K <= 16 queries).
    ``PCPVIZ_DECODE_MAX_QUERY_LEN`` overrides it (0: every row with queries takes the prefill
    kernel)."""
    return int(os.environ.get("PCPVIZ_DECODE_MAX_QUERY_LEN", "16"))


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
    *,
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
    host_lens: tuple[np.ndarray, np.ndarray] | None = None,  # (query_start_loc, seq_lens) on the host
) -> torch.Tensor:  # [Q, H, Dv]
    """MLA over the paged latent cache. The torch path (CPU, ``PCPVIZ_KERNELS=0``) uses the
    *absorbed* form vLLM's MLA decode uses: ``q_lat = q_nope @ W_UK`` scores against the
    latent directly, and the output ``softmax(...) @ kv_c`` is projected back with ``W_UV``.
    Mathematically equal to expanding K/V through ``kv_b_proj``, which the CUDA path does for
    long rows: see :func:`paged_mla_attention_kernels`."""
    r = w_uk.shape[-1]
    k = kernels_for(cache)
    if k is not None:
        return paged_mla_attention_kernels(
            q_nope, q_pe, cache, kernels=k, block_rows=block_rows, query_start_loc=query_start_loc,
            positions=positions, seq_lens=seq_lens, w_uk=w_uk, w_uv=w_uv, block_size=block_size, scale=scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, host_lens=host_lens)
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


def lens_on_host(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(int64[B+1], int64[B]) on the host: one device sync for both."""
    both = torch.cat([query_start_loc.reshape(-1).long(), seq_lens.reshape(-1).long()]).cpu().numpy()
    n = query_start_loc.numel()
    return both[:n], both[n:]


def paged_mla_attention_kernels(
    q_nope: torch.Tensor,  # [Q, H, Dn]
    q_pe: torch.Tensor,  # [Q, H, Dr]
    cache: torch.Tensor,  # [num_slots, R + Dr]
    *,
    kernels,  # the pcpviz_kernels module
    block_rows: torch.Tensor,  # int32[B, W]
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[Q]
    seq_lens: torch.Tensor,  # int[B]
    w_uk: torch.Tensor,  # [H, Dn, R]
    w_uv: torch.Tensor,  # [H, Dv, R]
    block_size: int,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    host_lens: tuple[np.ndarray, np.ndarray] | None = None,
    decode_max: int | None = None,  # default decode_max_query_len()
) -> torch.Tensor:  # float32[Q, H, Dv]
    """The CUDA path: rows split by query count as vLLM's MLA backends split them.

    * rows of at most ``decode_max`` queries: absorbed attention over the paged latents
      (``k.paged_mla_attention``), ``q_lat`` and the ``W_UV`` projection in torch;
    * longer rows: their context's latents are gathered (one flat ``[sum seq_lens, R + Dr]``
      tensor, longest row first), up-projected by ``kv_b_proj`` (``W_UK``/``W_UV`` stacked) in
      the cache's dtype, and ``k.mla_prefill_attention`` writes their queries' outputs in place.

    PCP=2 example: rank 0's rows are the head chunk (positions 0..8191, seq_len 8192) and the
    tail chunk (24576..32767, seq_len 32768) of a 32k prompt: both are prefill rows; 40960
    latents are gathered (the head's context is the tail's prefix, gathered twice: 25% more
    up-projection, small next to the attention). A decode-only batch (``max_query_len <=
    decode_max``) needs no host copy of the lengths (CUDA-graph friendly); a batch with a
    prefill row reads them once (``host_lens``, or one sync here).

    Precision: fp32 caches up-project in fp32 and run ``tl.dot`` at ``PCPVIZ_KERNELS_PRECISION``
    (tf32x3, about fp32: the greedy tokens equal the CPU path's); bf16/fp16 caches run both
    kernels with 16-bit products and fp32 accumulation."""
    k = kernels
    num_q, num_h, dv = q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]
    thr = decode_max_query_len() if decode_max is None else int(decode_max)
    if max_query_len is None:
        host_lens = host_lens if host_lens is not None else lens_on_host(query_start_loc, seq_lens)
        q_lens = np.diff(host_lens[0])
        max_query_len = int(q_lens.max()) if q_lens.size else 0
    lowp = cache.dtype in (torch.bfloat16, torch.float16)
    prec = "tf32" if lowp else k.paged_mla.default_precision()

    def absorbed(lens: torch.Tensor, max_q: int) -> torch.Tensor:
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope.float(), w_uk.float())  # [Q, H, R]
        ctx = k.paged_mla_attention(q_lat, q_pe.float(), cache, block_rows, query_start_loc, positions, lens,
                                    block_size, scale, max_query_len=max_q, max_seq_len=max_seq_len)
        return torch.einsum("qhr,hvr->qhv", ctx, w_uv.float())  # float32[Q, H, Dv]

    if max_query_len <= thr:
        return absorbed(seq_lens, max_query_len)
    if host_lens is None:
        host_lens = lens_on_host(query_start_loc, seq_lens)
    qsl_h, lens_h = (np.asarray(x, np.int64) for x in host_lens)
    q_lens = np.diff(qsl_h)
    pre = (q_lens > thr) & (lens_h > 0)
    dec = ~pre & (q_lens > 0) & (lens_h > 0)
    if dec.any():
        is_pre = (query_start_loc[1:] - query_start_loc[:-1]) > thr  # the same split, on the device
        out = absorbed(torch.where(is_pre, torch.zeros_like(seq_lens), seq_lens), int(q_lens[dec].max()))
    else:
        out = torch.zeros(num_q, num_h, dv, dtype=torch.float32, device=q_nope.device)
    if not pre.any():
        return out

    _prefill_rows(k, q_nope, q_pe, cache, out=out, rows=np.nonzero(pre)[0], lens_h=lens_h, q_lens=q_lens,
                  block_rows=block_rows, query_start_loc=query_start_loc, positions=positions, w_uk=w_uk, w_uv=w_uv,
                  block_size=block_size, scale=scale, precision=prec)
    return out


def _prefill_rows(k, q_nope, q_pe, cache, *, out, rows, lens_h, q_lens, block_rows, query_start_loc, positions,
                  w_uk, w_uv, block_size, scale, precision) -> None:
    """``paged_mla_attention_kernels``'s prefill rows (``rows``, int64 on the host): their
    context's latents gathered into one flat tensor (longest row first), up-projected by
    ``kv_b_proj`` in the cache's dtype, and attended by ``k.mla_prefill_attention``, which writes
    those rows' queries' outputs into ``out`` in place."""
    num_h, dn = q_nope.shape[1], q_nope.shape[2]
    r, dv = w_uk.shape[-1], w_uv.shape[1]
    rows = rows[np.argsort(-lens_h[rows], kind="stable")]  # longest context first
    lens_p = lens_h[rows]
    starts = np.concatenate([[0], np.cumsum(lens_p)[:-1]])
    total = int(lens_p.sum())
    dev = q_nope.device
    meta = torch.as_tensor(np.stack([rows, starts, lens_p]), dtype=torch.int64).to(dev, non_blocking=True)
    rows_t, starts_t, lens_t = meta[0], meta[1], meta[2]
    owner = torch.repeat_interleave(torch.arange(rows.size, device=dev), lens_t, output_size=total)  # int64[K]
    key = torch.arange(total, device=dev) - starts_t[owner]  # position of each gathered key
    slots = block_rows[rows_t[owner], key // block_size].long() * block_size + key % block_size
    lat = cache.index_select(0, slots)  # [K, R + Dr]
    cdt = cache.dtype if cache.dtype in (torch.bfloat16, torch.float16) else torch.float32
    w_kv = torch.cat([w_uk, w_uv], dim=1).reshape(num_h * (dn + dv), r).to(cdt)  # kv_b_proj.weight
    kv = torch.nn.functional.linear(lat[:, :r].to(cdt), w_kv).view(total, num_h, dn + dv)
    k.mla_prefill_attention(
        q_nope.to(cdt), q_pe.to(cdt), kv[..., :dn], lat[:, r:].to(cdt), kv[..., dn:], query_start_loc,
        positions, starts_t, lens_t, scale, rows=rows_t, out=out, max_query_len=int(q_lens[rows].max()),
        input_precision=precision)
