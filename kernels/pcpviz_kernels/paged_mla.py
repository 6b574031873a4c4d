"""Paged MLA attention over the latent KV cache, absorbed form (decode, draft decode, short rows).

MLA caches one latent row per token: ``kv_c`` (``R`` = kv_lora_rank, 512) then
the roped ``k_pe`` (``DR`` = 64), so a cache layer is ``[num_slots, R + DR]``.
In the absorbed form every head scores the *same* latent rows::

    score[q, h, k] = scale * (q_lat[q, h] . kv_c[k] + q_pe[q, h] . k_pe[k])
    ctx[q, h]      = softmax_k(score[q, h, :]) @ kv_c                  # [R]

with ``q_lat = q_nope @ W_UK`` computed by the caller, and ``ctx @ W_UV`` left to
the caller too. The engine sends rows of up to ``decode_max_query_len()`` queries here and
longer (prefill) rows to ``mla_prefill`` (expanded K/V: 3.4x fewer flops per pair); this
kernel stays correct for any row length. Batch row ``b`` owns queries ``query_start_loc[b]:query_start_loc[b+1]``
and reads its context through its block-table row ``block_rows[b]``: key ``k``
lives in slot ``block_rows[b, k // block_size] * block_size + k % block_size``.
A query at position ``p`` sees keys ``0 .. min(p, seq_lens[b] - 1)`` (causal by
*position*, so a DualChunkSwap segment whose queries sit at positions 6..8 of
its request sees keys 0..6, 0..7, 0..8 of that request). Queries that belong to
no batch row, and rows with ``seq_len == 0``, give zeros.

Worked example (block_size 2, one request of 5 tokens whose blocks are [3, 1, 4];
PCP rank 1 holds the segment at positions 2..3)::

    block_rows      [[3, 1, 4]]          slots of keys 0..4: 6 7 2 3 8
    query_start_loc [0, 2]               positions [2, 3]   seq_lens [4]
    query 0 (pos 2) reads slots 6 7 2;  query 1 (pos 3) reads slots 6 7 2 3

The kernel: one program per (batch row, tile of queries x heads, KV split).
All heads of a query share each KV tile, so a tile of ``BLOCK_N`` latent rows
is loaded once and feeds ``tl.dot``s for every head of ``BLOCK_Q`` queries
(``M = BLOCK_Q * BLOCK_H`` rows, at least 16: a decode of a 4-head model pads
to 16). The 512-wide latent is handled as 4 column chunks, so no operand or
accumulator is a whole ``[*, 512]`` fp32 tile (those spilled registers on sm_90).
Online softmax (running max / sum, exp2) runs over the tiles of the program's KV
range. When few programs would cover the GPU (decode: batch 1-16, one query
each), the context is cut into ``num_splits`` ranges (flash-decoding, about four
waves of programs); each split writes its normalised partial context and
log-sum-exp, and ``_merge_splits_kernel`` combines them.

Precision: fp32 latents use ``tl.dot(input_precision="tf32x3")`` by default (three
tensor-core passes on a hi/lo split of each operand: ~1e-7 absolute error here,
the engine's greedy tokens equal the torch path's); "tf32" is 1.5x faster at ~3e-4,
"ieee" exact but 5x slower (CUDA-core FMA, register spills). A bf16/fp16 cache uses
16-bit products (q and p rounded) with fp32 accumulation.

On the H200 (data/bench/kernels_h200.json, batch 16 x 32k context, 16 heads, fp32
cache: 1.21 GB to read) the decode runs in 1.11 ms with tf32x3 (26% of the measured
4.19 TB/s copy bandwidth, 5.6x the torch reference), 0.74 ms with tf32 (39%), and
0.35 ms from a bf16 cache (half the bytes, 41%). That is short of the 60% goal.
Likely causes (inferred from the sm_90 compile, not profiled): with 16 query-head
rows per program the ``mma.sync`` products are small, every warp re-reads the
whole query tile from shared memory for each key tile, and the fp32 tiles need
~180-220 KB of shared memory, so one program per SM with one warp per scheduler
has little to hide latency with. A bf16 cache with Hopper ``wgmma`` over 64-row
tiles (several queries per program) would be the next step. (A transposed layout, keys
as the MMA's M dimension, was measured slower on the H200 and removed.)
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index, launch_with_fallback, next_pow2, num_sms

__all__ = ["paged_mla_attention", "paged_mla_attention_ref", "default_precision"]

_LOG2E = 1.4426950408889634


def default_precision() -> str:
    """``tl.dot`` input precision for fp32 latents: ``PCPVIZ_KERNELS_PRECISION`` or "tf32x3".

    "tf32x3" splits each fp32 operand into a tf32 high and low part and sums three
    tensor-core products: about fp32 accuracy (errors near 1e-6 relative) at tensor-core
    speed. "ieee" is exact fp32 FMA (slow for prefill), "tf32" one pass (~1e-3)."""
    return os.environ.get("PCPVIZ_KERNELS_PRECISION", "tf32x3")


_UNSUPPORTED: set[str] = set()  # precisions this Triton/GPU failed to compile (fall back to ieee)


# ----------------------------------------------------------------------------- reference
def paged_mla_attention_ref(
    q_lat: torch.Tensor,  # [Q, H, R]
    q_pe: torch.Tensor,  # [Q, H, DR]
    cache: torch.Tensor,  # [num_slots, R + DR]
    block_rows: torch.Tensor,  # int[B, W]
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[>= Q]
    seq_lens: torch.Tensor,  # int[B]
    block_size: int,
    scale: float,
) -> torch.Tensor:  # float32[Q, H, R]
    """Plain torch, one batch row at a time, fp32 throughout."""
    num_q, num_h, r = q_lat.shape
    out = torch.zeros(num_q, num_h, r, dtype=torch.float32, device=q_lat.device)
    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    for b, n in enumerate(lens):
        lo, hi = qsl[b], qsl[b + 1]
        if hi <= lo or n <= 0:
            continue
        k = torch.arange(n, device=cache.device)
        slots = block_rows[b, k // block_size].long() * block_size + k % block_size  # int64[n]
        lat = cache[slots].float()  # [n, R + DR]
        kv_c, k_pe = lat[:, :r], lat[:, r:]
        s = torch.einsum("qhr,kr->qhk", q_lat[lo:hi].float(), kv_c)
        s = (s + torch.einsum("qhd,kd->qhk", q_pe[lo:hi].float(), k_pe)) * scale  # [q, H, n]
        limit = torch.minimum(positions[lo:hi].long() + 1, torch.tensor(n, device=s.device))  # [q]
        s = s.masked_fill(k[None, None, :] >= limit[:, None, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key (limit <= 0) -> 0
        out[lo:hi] = torch.einsum("qhk,kr->qhr", p, kv_c)
    return out


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _q_chunk(ptr, qi, hi, row_ok, stride_q, stride_h, cache_ptr, OFF: tl.constexpr, W: tl.constexpr,
             LOWP: tl.constexpr):
    d = OFF + tl.arange(0, W)
    x = tl.load(ptr + qi[:, None] * stride_q + hi[:, None] * stride_h + d[None, :], mask=row_ok[:, None],
                other=0.0)
    if LOWP:  # the dots run in the cache's 16-bit type
        x = x.to(cache_ptr.dtype.element_ty)
    else:
        x = x.to(tl.float32)
    return x  # [M, W]


@triton.jit
def _kv_chunk(row, k_ok, OFF: tl.constexpr, W: tl.constexpr, LOWP: tl.constexpr, EVICT: tl.constexpr):
    d = OFF + tl.arange(0, W)
    x = tl.load(row + d[None, :], mask=k_ok[:, None], other=0.0, eviction_policy=EVICT)
    if not LOWP:
        x = x.to(tl.float32)
    return x  # [N, W]


@triton.jit
def _kv_tile(row, k_ok, RC: tl.constexpr, LOWP: tl.constexpr, EVICT: tl.constexpr):
    k_0 = _kv_chunk(row, k_ok, 0, RC, LOWP, EVICT)
    k_1 = _kv_chunk(row, k_ok, RC, RC, LOWP, EVICT)
    k_2 = _kv_chunk(row, k_ok, 2 * RC, RC, LOWP, EVICT)
    k_3 = _kv_chunk(row, k_ok, 3 * RC, RC, LOWP, EVICT)
    return k_0, k_1, k_2, k_3


@triton.jit
def _store_chunk(ptr, qi, hi, row_ok, stride_q, stride_h, acc, inv_l, OFF: tl.constexpr, W: tl.constexpr):
    d = OFF + tl.arange(0, W)
    tl.store(ptr + qi[:, None] * stride_q + hi[:, None] * stride_h + d[None, :], acc * inv_l[:, None],
             mask=row_ok[:, None])


@triton.jit
def _paged_mla_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, block_rows_ptr, qsl_ptr, pos_ptr, seq_lens_ptr,
    out_ptr, lse_ptr,
    num_heads, num_head_tiles, block_size, split_len, scale_log2,
    stride_lq, stride_lh, stride_pq, stride_ph, stride_cache, stride_bt,
    stride_oq, stride_os, stride_oh, stride_lseq, stride_lses,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOWP: tl.constexpr, PRECISION: tl.constexpr,
    RELOAD: tl.constexpr, RC: tl.constexpr,
):
    # The latent width R is handled as 4 column chunks of RC = R // 4: four [M, RC] query chunks,
    # four [M, RC] accumulators and [N, RC] key chunks instead of [*, R] tiles, which keeps each
    # tl.dot's operands small (R = 512 in fp32 spilled registers as whole tiles on sm_90).
    b = tl.program_id(0)
    q_tile = tl.program_id(1) // num_head_tiles
    h_tile = tl.program_id(1) % num_head_tiles
    split = tl.program_id(2)

    q_lo = tl.load(qsl_ptr + b).to(tl.int64)
    q_hi = tl.load(qsl_ptr + b + 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    q0 = q_lo + q_tile * BLOCK_Q

    # Row m of the tile is (query q0 + m // BLOCK_H, head h_tile*BLOCK_H + m % BLOCK_H).
    m = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q0 + m // BLOCK_H  # int64[M]
    hi = h_tile * BLOCK_H + m % BLOCK_H  # int32[M]
    row_ok = (qi < q_hi) & (hi < num_heads)
    pos = tl.load(pos_ptr + qi, mask=row_ok, other=-1).to(tl.int64)
    kv_len = tl.minimum(pos + 1, seq_len)
    kv_len = tl.where(row_ok & (kv_len > 0), kv_len, 0)  # int64[M]: keys each row may see
    tile_len = tl.max(kv_len, axis=0)
    if SPLIT:
        k_lo = split.to(tl.int64) * split_len
        k_hi = tl.minimum(k_lo + split_len, tile_len)
    else:
        k_lo = tile_len * 0
        k_hi = tile_len

    q_0 = _q_chunk(q_lat_ptr, qi, hi, row_ok, stride_lq, stride_lh, cache_ptr, 0, RC, LOWP)  # [M, RC]
    q_1 = _q_chunk(q_lat_ptr, qi, hi, row_ok, stride_lq, stride_lh, cache_ptr, RC, RC, LOWP)
    q_2 = _q_chunk(q_lat_ptr, qi, hi, row_ok, stride_lq, stride_lh, cache_ptr, 2 * RC, RC, LOWP)
    q_3 = _q_chunk(q_lat_ptr, qi, hi, row_ok, stride_lq, stride_lh, cache_ptr, 3 * RC, RC, LOWP)
    q_p = _q_chunk(q_pe_ptr, qi, hi, row_ok, stride_pq, stride_ph, cache_ptr, 0, DR, LOWP)  # [M, DR]

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    a_0 = tl.zeros([BLOCK_Q * BLOCK_H, RC], tl.float32)
    a_1 = tl.zeros([BLOCK_Q * BLOCK_H, RC], tl.float32)
    a_2 = tl.zeros([BLOCK_Q * BLOCK_H, RC], tl.float32)
    a_3 = tl.zeros([BLOCK_Q * BLOCK_H, RC], tl.float32)
    bt_row = block_rows_ptr + b * stride_bt
    for start in range(k_lo, k_hi, BLOCK_N):
        kn = start + tl.arange(0, BLOCK_N)  # int64[N]: key positions
        k_ok = kn < k_hi
        blk = tl.load(bt_row + kn // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = blk * block_size + kn % block_size  # int64[N]
        row = cache_ptr + slot[:, None] * stride_cache  # [N, 1] row pointers
        if RELOAD:  # distinct eviction hints keep the two reads of a chunk from being merged
            k_0, k_1, k_2, k_3 = _kv_tile(row, k_ok, RC, LOWP, "evict_last")  # 4 x [N, RC]
        else:  # read once: the latents are streamed, not reused (keep L2 for the block table)
            k_0, k_1, k_2, k_3 = _kv_tile(row, k_ok, RC, LOWP, "evict_first")
        k_p = _kv_chunk(row, k_ok, R, DR, LOWP, "")  # [N, DR]
        s = tl.dot(q_0, tl.trans(k_0), input_precision=PRECISION)  # [M, N]
        s = tl.dot(q_1, tl.trans(k_1), acc=s, input_precision=PRECISION)
        s = tl.dot(q_2, tl.trans(k_2), acc=s, input_precision=PRECISION)
        s = tl.dot(q_3, tl.trans(k_3), acc=s, input_precision=PRECISION)
        s = tl.dot(q_p, tl.trans(k_p), acc=s, input_precision=PRECISION)
        s = s * scale_log2
        # Causal by position, and never past this program's key range (a tile may straddle
        # the end of a split: those keys belong to the next split).
        s = tl.where(kn[None, :] < tl.minimum(kv_len, k_hi)[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(k_p.dtype)
        if RELOAD:  # read the chunks again (an L2 hit) rather than keep [N, R] live across softmax:
            # each read then has one dot use, so both stream through shared memory (cp.async)
            k_0, k_1, k_2, k_3 = _kv_tile(row, k_ok, RC, LOWP, "evict_first")
        a_0 = tl.dot(p, k_0, acc=a_0 * alpha[:, None], input_precision=PRECISION)
        a_1 = tl.dot(p, k_1, acc=a_1 * alpha[:, None], input_precision=PRECISION)
        a_2 = tl.dot(p, k_2, acc=a_2 * alpha[:, None], input_precision=PRECISION)
        a_3 = tl.dot(p, k_3, acc=a_3 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)  # rows that saw no key -> 0
    if SPLIT:
        o_ptr = out_ptr + split * stride_os
    else:
        o_ptr = out_ptr
    _store_chunk(o_ptr, qi, hi, row_ok, stride_oq, stride_oh, a_0, inv_l, 0, RC)
    _store_chunk(o_ptr, qi, hi, row_ok, stride_oq, stride_oh, a_1, inv_l, RC, RC)
    _store_chunk(o_ptr, qi, hi, row_ok, stride_oq, stride_oh, a_2, inv_l, 2 * RC, RC)
    _store_chunk(o_ptr, qi, hi, row_ok, stride_oq, stride_oh, a_3, inv_l, 3 * RC, RC)
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + qi * stride_lseq + split * stride_lses + hi, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, num_splits,
    stride_pq, stride_ps, stride_ph, stride_lq, stride_ls, stride_oq, stride_oh,
    R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s_idx = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + q * stride_lq + s_idx * stride_ls + h, mask=s_idx < num_splits,
                  other=float("-inf"))  # [S] (log2 domain)
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    dr = tl.arange(0, R)
    acc = tl.zeros([R], tl.float32)
    den = tl.sum(tl.exp2(lse - mx), axis=0)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_ptr + q * stride_lq + s * stride_ls + h) - mx)
        part = tl.load(part_ptr + q * stride_pq + s * stride_ps + h * stride_ph + dr)
        acc += tl.where(w > 0.0, w * part, 0.0)  # an empty split holds garbage: never read it
    o = tl.where(den > 0.0, acc / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(out_ptr + q * stride_oq + h * stride_oh + dr, o)


# ----------------------------------------------------------------------------- wrapper
def _configs(lowp: bool, block_rows: int, precision: str, config: dict | None) -> list[dict]:
    """Launch configs to try in order (the first the GPU can hold runs).

    The defaults are the fastest of the H200 sweeps in data/bench/kernels_h200.json (batch 16,
    32k context, 16 heads), all of which fit sm_90's 227 KB of shared memory. ``RELOAD``
    re-reads each key chunk for the second product (an L2 hit), so that both products
    stream their operands through shared memory instead of holding [N, R] in registers
    (needed for fp32 tiles; a bf16 tile is half the bytes and may keep its keys)."""
    if config is not None:
        return [dict({"RELOAD": True}, **config)]
    if INTERPRET:
        return [{"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "RELOAD": True}]
    c = lambda n, w, st, reload=True: {"BLOCK_N": n, "num_warps": w, "num_stages": st,  # noqa: E731
                                       "RELOAD": reload}
    if block_rows > 16:  # tiles of 32+ query-head rows (benchmarks; the engine uses 16)
        return [c(16, 8, 2), c(32, 8, 1), c(16, 4, 1)]
    if lowp:  # bf16 / fp16 cache: 286 us (51% of copy bandwidth) keeping the keys, 385 us re-reading
        return [c(64, 4, 2, False), c(32, 4, 3, False), c(16, 4, 1)]
    if precision == "tf32":  # 743-806 us
        return [c(32, 4, 2), c(32, 8, 2), c(16, 4, 1)]
    return [c(32, 8, 2), c(32, 4, 2), c(16, 4, 1)]  # tf32x3 (1109-1126 us), ieee


def plan(num_heads: int, num_rows: int, max_query_len: int, max_seq_len: int, device: torch.device,
         num_splits: int | None = None, block_m: int = 16, max_block_h: int = 16):
    """(BLOCK_Q, BLOCK_H, head tiles, query tiles, splits, split length) for a launch."""
    block_h = min(next_pow2(num_heads), max_block_h)
    block_q = max(1, block_m // block_h)
    block_q = min(block_q, next_pow2(max(max_query_len, 1)))
    if block_q * block_h < 16:  # tl.dot wants >= 16 rows: pad the head tile
        block_h = 16 // block_q
    head_tiles = -(-num_heads // block_h)
    q_tiles = -(-max_query_len // block_q)
    programs = num_rows * head_tiles * q_tiles
    if num_splits is None:
        # About 4 waves of programs (one program per SM at a time with fp32 tiles), and
        # at least 256 keys per split. Rounded down so the last wave is not a sliver.
        want = (4 * num_sms(device)) // max(programs, 1)
        num_splits = max(1, min(want, -(-max_seq_len // 256)))
    num_splits = max(1, min(int(num_splits), max_seq_len))
    split_len = -(-max_seq_len // num_splits)
    split_len = -(-split_len // 16) * 16
    num_splits = -(-max_seq_len // split_len)
    return block_q, block_h, head_tiles, q_tiles, num_splits, split_len


def paged_mla_attention(
    q_lat: torch.Tensor,  # [Q, H, R]  (q_nope @ W_UK)
    q_pe: torch.Tensor,  # [Q, H, DR]
    cache: torch.Tensor,  # fp32/bf16/fp16[num_slots, R + DR]
    block_rows: torch.Tensor,  # int32[B, W]: block-table row of each batch row
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[>= Q]
    seq_lens: torch.Tensor,  # int[B]: context length per batch row
    block_size: int,
    scale: float,
    *,
    max_query_len: int | None = None,  # host-known bounds avoid a device sync
    max_seq_len: int | None = None,
    num_splits: int | None = None,  # None: enough KV splits to fill the GPU
    input_precision: str | None = None,  # fp32 latents: "tf32x3" (default), "ieee", "tf32"
    config: dict | None = None,  # {"BLOCK_N", "num_warps", "num_stages", "RELOAD"} (benchmarks)
    block_m: int | None = None,  # rows (queries x heads) per program (default 16)
    max_block_h: int = 16,
) -> torch.Tensor:  # float32[Q, H, R]
    """Absorbed-MLA context over the paged latent cache; see the module docstring."""
    num_q, num_h, r = q_lat.shape
    dr = q_pe.shape[-1]
    if cache.shape[1] != r + dr:
        raise ValueError(f"cache rows have {cache.shape[1]} numbers, expected R + DR = {r} + {dr}")
    if q_pe.shape[:2] != (num_q, num_h):
        raise ValueError(f"q_pe is {tuple(q_pe.shape)}, q_lat is {tuple(q_lat.shape)}")
    for n, name, least in ((r, "R", 64), (dr, "DR", 16)):
        if n & (n - 1) or n < least:
            raise ValueError(f"{name}={n}: the kernel needs a power of two >= {least}")
    dev = q_lat.device
    num_rows = seq_lens.shape[0]
    out = torch.zeros(num_q, num_h, r, dtype=torch.float32, device=dev)
    if num_q == 0 or num_rows == 0:
        return out
    qsl = as_index(query_start_loc, dev)
    lens = as_index(seq_lens, dev)
    pos = as_index(positions, dev)
    bt = as_index(block_rows, dev)
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(lens.max())
    if max_query_len <= 0 or max_seq_len <= 0:
        return out
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    if cache.stride(1) != 1:
        raise ValueError("cache rows must be contiguous")
    # bf16/fp16 latents: bf16/fp16 tensor-core dots (q and p rounded to the cache dtype).
    # The interpreter's low-precision dot is unreliable, so there the dots run in fp32.
    lowp = cache.dtype in (torch.bfloat16, torch.float16) and not INTERPRET
    prec = "tf32" if lowp else (input_precision or default_precision())
    if prec in _UNSUPPORTED:
        prec = "ieee"

    if block_m is None:
        block_m = 16
    block_q, block_h, head_tiles, q_tiles, splits, split_len = plan(
        num_h, num_rows, max_query_len, max_seq_len, dev, num_splits, block_m, max_block_h)
    grid = (num_rows, q_tiles * head_tiles, splits)
    scale_log2 = float(scale) * _LOG2E
    if splits == 1:
        target, lse = out, out  # lse unused
        so = (out.stride(0), 0, out.stride(1), 0, 0)
    else:
        target = torch.empty(num_q, splits, num_h, r, dtype=torch.float32, device=dev)
        lse = torch.full((num_q, splits, num_h), float("-inf"), dtype=torch.float32, device=dev)
        so = (target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1))

    def launch(BLOCK_N, num_warps, num_stages, PRECISION, RELOAD):
        _paged_mla_kernel[grid](
            q_lat, q_pe, cache, bt, qsl, pos, lens, target, lse,
            num_h, head_tiles, block_size, split_len, scale_log2,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), bt.stride(0),
            *so,
            R=r, DR=dr, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=BLOCK_N, SPLIT=splits > 1,
            LOWP=lowp, PRECISION=PRECISION, RELOAD=RELOAD, RC=r // 4,
            num_warps=num_warps, num_stages=num_stages,
        )

    cfgs = _configs(lowp, block_q * block_h, prec, config)
    try:
        launch_with_fallback(launch, [dict(c, PRECISION=prec) for c in cfgs])
    except Exception as e:  # noqa: BLE001 - a precision this Triton cannot compile: use exact fp32
        if prec == "ieee" or lowp or INTERPRET or input_precision is not None:
            raise
        warnings.warn(f"paged_mla_attention: input_precision={prec!r} failed ({type(e).__name__}: {e}); "
                      "using 'ieee'")
        _UNSUPPORTED.add(prec)
        launch_with_fallback(launch, [dict(c, PRECISION="ieee") for c in cfgs])
    if splits > 1:
        _merge_splits_kernel[(num_q, num_h)](
            target, lse, out, num_h, splits,
            target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            R=r, BLOCK_S=max(16, next_pow2(splits)), num_warps=4,
        )
    return out


def bytes_touched(num_q: int, num_h: int, r: int, dr: int, kv_tokens: int, cache_elt: int) -> int:
    """Bytes one call must move at least: the KV rows once, q in, context out (fp32)."""
    return kv_tokens * (r + dr) * cache_elt + num_q * num_h * (r + dr) * 4 + num_q * num_h * r * 4

