"""MLA prefill attention, flash style: per-head queries against up-projected context K/V.

For prefill MLA is cheaper *expanded* than absorbed (vLLM's MLA prefill path does the
same): the context's latents are up-projected once, ``k_nope = kv_c @ W_UK^T`` and
``v = kv_c @ W_UV^T`` per head, and every (query, key, head) pair then costs
``2 * (Dn + Dr + Dv)`` = 640 flops instead of ``2 * (2R + Dr)`` = 2176 in the absorbed
form (R = 512). The up-projection costs ``2 * R * H * (Dn + Dv)`` per *key*, so it pays
once a row has more than ~170 queries sharing a context; short rows (decode, MTP verify,
small chunks) stay on the absorbed ``paged_mla_attention`` (vLLM's FlashMLA backend routes
rows of up to 128 queries through its decode kernel for the same reason). The engine
makes that split (``pcpviz.engine.kv_cache``); this module is the attention itself::

    score[q, h, k] = scale * (q_nope[q, h] . k_nope[k, h] + q_pe[q, h] . k_pe[k])
    out[q, h]      = softmax_k(score[q, h, :]) @ v[:, h]                    # [Dv]

``k_pe`` (the roped part of the latent) is shared by all heads, as in the cache.

Varlen layout. The kernel computes the batch rows listed in ``rows``. Row ``rows[i]`` owns
queries ``query_start_loc[rows[i]] : query_start_loc[rows[i] + 1]`` and the keys
``kv_start_loc[i] : kv_start_loc[i] + kv_lens[i]`` of the flat K/V tensors, key ``j`` of
the row being the token at position ``j`` of its request. A query at position ``p`` sees
keys ``0 .. min(p, kv_lens[i] - 1)``: causal by *global position*, so the same call
serves a fresh prefill, a chunk with prior context and DualChunkSwap chunks. Query rows of
other batch rows are not written (the caller's ``out`` keeps them).

Worked example, PCP=2, a 16-token prompt split DualChunkSwap into 4 chunks of 4: rank 0
holds chunks 0 and 3 as two batch rows of the same request::

    query_start_loc [0, 4, 8]      positions [0 1 2 3 | 12 13 14 15]
    rows [1, 0]  kv_lens [16, 4]  kv_start_loc [0, 16]   (the longer row first)
    query at position 13 sees keys 0..13 of the 16 gathered for row 1; position 2 sees 0..2

Each rank's pair of chunks costs the same (chunk 0 + chunk 3 = chunk 1 + chunk 2), which
is why DualChunkSwap splits that way.

The kernel: one program per (head, tile of ``BLOCK_M`` queries, row); tiles are launched
from the row's end backwards, so those with the most keys start first (causal load
balance), and rows come longest first. A tile first runs the keys every one of its queries
sees (no mask), then the diagonal tiles with the causal mask. Online softmax in exp2 with
fp32 accumulation. bf16/fp16 inputs multiply on the tensor cores in 16 bits (``wgmma`` on
sm_90 for 64-row tiles); fp32 inputs use ``tl.dot``'s ``input_precision`` (the engine's
fp32 default is "tf32x3": about fp32 accuracy, so its greedy tokens stay those of the
CPU path). Launch configs come from a fixed table (``_configs``), the first the GPU can
hold, measured by ``benchmarks/bench_kernels.py``: no timing-based autotuning at run time,
so every rank and every run picks the same tiles (bit-identical replicas and traces).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index, launch_with_fallback

__all__ = ["mla_prefill_attention", "mla_prefill_attention_ref", "prefill_flops"]

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- reference
def mla_prefill_attention_ref(
    q_nope: torch.Tensor,  # [Q, H, Dn]
    q_pe: torch.Tensor,  # [Q, H, Dr]
    k_nope: torch.Tensor,  # [K, H, Dn]
    k_pe: torch.Tensor,  # [K, Dr]
    v: torch.Tensor,  # [K, H, Dv]
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[>= Q]
    kv_start_loc: torch.Tensor,  # int[Bp]
    kv_lens: torch.Tensor,  # int[Bp]
    scale: float,
    *,
    rows: torch.Tensor | None = None,  # int[Bp] (default: all B rows)
    out: torch.Tensor | None = None,  # [Q, H, Dv], written in place
    query_block: int = 1024,
) -> torch.Tensor:  # float32[Q, H, Dv] (or ``out``)
    """Plain torch, fp32, one row and ``query_block`` queries at a time."""
    num_q, num_h, _ = q_nope.shape
    if out is None:
        out = torch.zeros(num_q, num_h, v.shape[-1], dtype=torch.float32, device=q_nope.device)
    qsl = [int(x) for x in query_start_loc.tolist()]
    rows_l = list(range(len(qsl) - 1)) if rows is None else [int(x) for x in rows.tolist()]
    starts = [int(x) for x in kv_start_loc.tolist()]
    lens = [int(x) for x in kv_lens.tolist()]
    for i, b in enumerate(rows_l):
        lo, hi, k0, n = qsl[b], qsl[b + 1], starts[i], lens[i]
        for a in range(lo, hi, query_block):
            e = min(hi, a + query_block)
            pos = positions[a:e].long()
            ctx = max(0, min(n, int(pos.max()) + 1)) if e > a else 0
            if ctx == 0:
                out[a:e] = 0
                continue
            kn, kp, vv = k_nope[k0:k0 + ctx].float(), k_pe[k0:k0 + ctx].float(), v[k0:k0 + ctx].float()
            s = torch.einsum("qhd,khd->qhk", q_nope[a:e].float(), kn)
            s = (s + torch.einsum("qhd,kd->qhk", q_pe[a:e].float(), kp)) * scale  # [q, H, ctx]
            key = torch.arange(ctx, device=s.device)
            s = s.masked_fill((key[None, :] > pos[:, None])[:, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no key -> 0
            out[a:e] = torch.einsum("qhk,khd->qhd", p, vv).to(out.dtype)
    return out


def prefill_flops(q_positions: list[range], kv_lens: list[int], num_heads: int, dn: int, dr: int,
                  dv: int) -> int:
    """Flops of the causal attention (both products), counting only visible (query, key) pairs."""
    pairs = 0
    for pos, n in zip(q_positions, kv_lens):
        lo, hi = pos.start, pos.stop  # positions lo..hi-1, each sees min(p + 1, n) keys
        cap = max(lo, min(hi, n))  # positions below n see p + 1 keys, the rest n
        pairs += (cap - lo) * (lo + cap + 1) // 2 + (hi - cap) * n
    return pairs * num_heads * 2 * (dn + dr + dv)


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _tile(acc, m_i, l_i, qn, qp, kn_base, kp_base, v_base, s_kn_k, s_kp_k, s_v_k, start, k_end, lim,
          scale_log2, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
          MASK: tl.constexpr, LOWP: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)  # int64[N]: key positions
    dn = tl.arange(0, DN)
    dr = tl.arange(0, DR)
    dv = tl.arange(0, DV)
    if MASK:
        n_ok = offs_n < k_end
        kn = tl.load(kn_base + offs_n[:, None] * s_kn_k + dn[None, :], mask=n_ok[:, None], other=0.0)
        kp = tl.load(kp_base + offs_n[:, None] * s_kp_k + dr[None, :], mask=n_ok[:, None], other=0.0)
    else:
        kn = tl.load(kn_base + offs_n[:, None] * s_kn_k + dn[None, :])  # [N, DN]
        kp = tl.load(kp_base + offs_n[:, None] * s_kp_k + dr[None, :])  # [N, DR]
    if LOWP:
        s = tl.dot(qn, tl.trans(kn))
        s = tl.dot(qp, tl.trans(kp), acc=s)
    else:
        s = tl.dot(qn, tl.trans(kn.to(tl.float32)), input_precision=PRECISION)
        s = tl.dot(qp, tl.trans(kp.to(tl.float32)), acc=s, input_precision=PRECISION)
    s = s * scale_log2  # [M, N]
    if MASK:
        s = tl.where(offs_n[None, :] < lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if MASK:
        vv = tl.load(v_base + offs_n[:, None] * s_v_k + dv[None, :], mask=n_ok[:, None], other=0.0)
    else:
        vv = tl.load(v_base + offs_n[:, None] * s_v_k + dv[None, :])  # [N, DV]
    if LOWP:
        acc = tl.dot(p.to(vv.dtype), vv, acc=acc)
    else:
        acc = tl.dot(p, vv.to(tl.float32), acc=acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr,
    rows_ptr, qsl_ptr, pos_ptr, kv_start_ptr, kv_len_ptr,
    max_query_len, scale_log2,
    s_qn_q, s_qn_h, s_qp_q, s_qp_h, s_kn_k, s_kn_h, s_kp_k, s_v_k, s_v_h, s_o_q, s_o_h,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOWP: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    num_tiles = tl.cdiv(max_query_len, BLOCK_M)
    t = num_tiles - 1 - tl.program_id(1)  # last tiles (most keys) first
    r = tl.program_id(2)
    b = tl.load(rows_ptr + r).to(tl.int64)
    q_lo = tl.load(qsl_ptr + b).to(tl.int64)
    q_hi = tl.load(qsl_ptr + b + 1).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + r).to(tl.int64)
    kv0 = tl.load(kv_start_ptr + r).to(tl.int64)

    # A tile past the row's end has no valid query: it loads nothing and stores nothing.
    offs_m = q_lo + t * BLOCK_M + tl.arange(0, BLOCK_M)  # int64[M]
    m_ok = offs_m < q_hi
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
    lim = tl.where(m_ok, tl.maximum(tl.minimum(pos + 1, kv_len), 0), 0)  # int64[M]: keys each sees
    k_end = tl.max(lim, axis=0)  # keys the tile reads
    k_all = tl.min(tl.where(m_ok, lim, k_end), axis=0)  # keys every query of the tile sees
    k_full = (k_all // BLOCK_N) * BLOCK_N

    dn = tl.arange(0, DN)
    dr = tl.arange(0, DR)
    dv = tl.arange(0, DV)
    qn = tl.load(qn_ptr + offs_m[:, None] * s_qn_q + h * s_qn_h + dn[None, :], mask=m_ok[:, None], other=0.0)
    qp = tl.load(qp_ptr + offs_m[:, None] * s_qp_q + h * s_qp_h + dr[None, :], mask=m_ok[:, None], other=0.0)
    if not LOWP:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)

    kn_base = kn_ptr + kv0 * s_kn_k + h * s_kn_h
    kp_base = kp_ptr + kv0 * s_kp_k
    v_base = v_ptr + kv0 * s_v_k + h * s_v_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for start in range(0, k_full, BLOCK_N):  # keys below every query's position: no mask
        acc, m_i, l_i = _tile(acc, m_i, l_i, qn, qp, kn_base, kp_base, v_base, s_kn_k, s_kp_k, s_v_k,
                              start, k_end, lim, scale_log2, DN, DR, DV, BLOCK_N, False, LOWP, PRECISION)
    for start in range(k_full, k_end, BLOCK_N):  # the diagonal: causal mask by position
        acc, m_i, l_i = _tile(acc, m_i, l_i, qn, qp, kn_base, kp_base, v_base, s_kn_k, s_kp_k, s_v_k,
                              start, k_end, lim, scale_log2, DN, DR, DV, BLOCK_N, True, LOWP, PRECISION)

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    tl.store(out_ptr + offs_m[:, None] * s_o_q + h * s_o_h + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None])


# ----------------------------------------------------------------------------- wrapper
def _configs(lowp: bool, max_query_len: int, config: dict | None) -> list[dict]:
    """Launch configs in order of preference; the first the GPU can hold runs.

    16-bit: 128-query tiles over 8 warps (two ``wgmma`` warpgroups of 64 rows), 64-key tiles,
    3 stages (~130 KB of shared memory for K, k_pe, V). fp32 operands are twice the bytes:
    64-row tiles, 2 stages. Short rows take 64-row tiles so fewer rows are padding."""
    if config is not None:
        return [dict(config)]
    if INTERPRET:
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}]
    c = lambda m, n, w, st: {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}  # noqa: E731
    if lowp:
        if max_query_len <= 64:
            return [c(64, 64, 4, 3), c(64, 32, 4, 2)]
        return [c(128, 64, 8, 3), c(128, 64, 8, 2), c(64, 64, 4, 2), c(64, 32, 4, 2)]
    return [c(64, 32, 4, 2), c(64, 64, 4, 2), c(32, 32, 4, 2), c(16, 16, 4, 1)]


def mla_prefill_attention(
    q_nope: torch.Tensor,  # [Q, H, Dn]   (last dim contiguous; other strides free)
    q_pe: torch.Tensor,  # [Q, H, Dr]
    k_nope: torch.Tensor,  # [K, H, Dn]
    k_pe: torch.Tensor,  # [K, Dr]
    v: torch.Tensor,  # [K, H, Dv]
    query_start_loc: torch.Tensor,  # int[B+1]
    positions: torch.Tensor,  # int64[>= Q]
    kv_start_loc: torch.Tensor,  # int[Bp]: first key of each computed row in the flat K/V
    kv_lens: torch.Tensor,  # int[Bp]: keys of each computed row (its context length)
    scale: float,
    *,
    rows: torch.Tensor | None = None,  # int[Bp]: batch rows to compute (default all B)
    out: torch.Tensor | None = None,  # [Q, H, Dv]: written in place for those rows
    max_query_len: int | None = None,  # host-known bound (saves a device sync)
    input_precision: str = "tf32x3",  # fp32 operands: "tf32x3", "tf32" or "ieee"
    config: dict | None = None,  # {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} (benchmarks)
) -> torch.Tensor:
    """Causal flash attention of MLA prefill rows; see the module docstring."""
    num_q, num_h, dn = q_nope.shape
    dr, dv = q_pe.shape[-1], v.shape[-1]
    if k_nope.shape[1:] != (num_h, dn) or v.shape[:2] != k_nope.shape[:2] or k_pe.shape != (k_nope.shape[0], dr):
        raise ValueError(f"K/V shapes {tuple(k_nope.shape)}, {tuple(k_pe.shape)}, {tuple(v.shape)} do not fit "
                         f"q {tuple(q_nope.shape)}, {tuple(q_pe.shape)}")
    for n, name in ((dn, "Dn"), (dr, "Dr"), (dv, "Dv")):
        if n & (n - 1) or n < 16:
            raise ValueError(f"{name}={n}: the kernel needs a power of two >= 16")
    dev = q_nope.device
    if out is None:
        out = torch.zeros(num_q, num_h, dv, dtype=torch.float32, device=dev)
    qsl = as_index(query_start_loc, dev)
    if rows is None:
        rows = torch.arange(qsl.shape[0] - 1, device=dev)
    rows, kv0, kvl = as_index(rows, dev), as_index(kv_start_loc, dev), as_index(kv_lens, dev)
    pos = as_index(positions, dev)
    if num_q == 0 or rows.numel() == 0:
        return out
    if max_query_len is None:
        max_query_len = int((qsl[rows + 1] - qsl[rows]).max())
    if max_query_len <= 0:
        return out
    for t in (q_nope, q_pe, k_nope, k_pe, v):
        if t.stride(-1) != 1:
            raise ValueError("q/k/v need a contiguous last dimension")
    lowp = q_nope.dtype in (torch.bfloat16, torch.float16)
    if lowp and not (q_pe.dtype == k_nope.dtype == k_pe.dtype == v.dtype == q_nope.dtype):
        raise ValueError("16-bit prefill needs q, k and v in one dtype")
    lowp = lowp and not INTERPRET  # the interpreter's 16-bit dot is unreliable: fp32 there

    def launch(BLOCK_M, BLOCK_N, num_warps, num_stages):
        grid = (num_h, triton.cdiv(max_query_len, BLOCK_M), rows.shape[0])
        _mla_prefill_kernel[grid](
            q_nope, q_pe, k_nope, k_pe, v, out, rows, qsl, pos, kv0, kvl,
            max_query_len, float(scale) * _LOG2E,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
            k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            DN=dn, DR=dr, DV=dv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, LOWP=lowp, PRECISION=input_precision,
            num_warps=num_warps, num_stages=num_stages,
        )

    launch_with_fallback(launch, _configs(lowp, max_query_len, config))
    return out

