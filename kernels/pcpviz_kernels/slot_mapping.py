"""Slot mappings: positions -> KV slots through block-table rows, and the PCP gathered mapping.

``compute_slot_mapping``: token ``t`` of batch row ``b`` (``query_start_loc[b] <= t
< query_start_loc[b+1]``) at position ``p = positions[t]`` goes to slot
``table[idx_mapping[b], p // bs] * bs + p % bs``. Tokens past
``query_start_loc[R]`` (padding up to ``num_tokens_padded``) and tokens of rows
with ``idx_mapping == -1`` (dummy requests) get PAD = -1. With DCP (``cp_size >
1``) the KV is interleaved over the DCP ranks in runs of ``cp_interleave``
tokens: a token another rank owns is PAD, an owned one is stored at its
rank-local position ``(p // (bs*cp)) * bs + (p % (bs*cp)) // (il*cp) * il + p % il``.

Worked example (block_size 4; row 0 is request slot 1 with blocks [7, 3], row 1 a
decode of slot 0 with blocks [5])::

    idx_mapping      int64[2]  [1, 0]
    query_start_loc  int64[3]  [0, 6, 7]
    positions        int64[8]  [0 1 2 3 4 5 | 2 | 0]     (last token is padding)
    slots            int64[8]  [28 29 30 31 12 13 | 22 | -1]

``gathered_slot_mapping``: the PCP manager's mapping for the all-gathered KV rows:
row ``j`` of the gathered latent (rank ``j // P``, local row ``j % P``) goes to
``global_slots[padded_gather_idx[j]]`` where ``kv_write_mask[j]``, else PAD::

    global_slots       [28 29 30 31 12 13 22]
    padded_gather_idx  [6 0 1 0 | 2 3 4 5]    kv_write_mask [1 1 1 0 | 1 1 1 1]
    gathered           [22 28 29 -1 | 30 31 12 13]

Both are equal to ``pcpviz.reference.blocks.compute_slot_mappings`` / ``gathered_slot_mapping``
(the NumPy reference proven equal to vLLM 0.33.0). The slot kernel is one program
per ``BLOCK_T`` tokens; a token finds its batch row by a branch-free binary search
over ``query_start_loc`` (so one long prefill row is spread over many programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index

__all__ = [
    "PAD_SLOT_ID",
    "compute_slot_mapping",
    "compute_slot_mapping_ref",
    "gathered_slot_mapping",
    "gathered_slot_mapping_ref",
]

PAD_SLOT_ID = -1


# ----------------------------------------------------------------------------- references
def compute_slot_mapping_ref(
    table: torch.Tensor,  # int32[max_num_reqs, W]
    block_size: int,
    idx_mapping: torch.Tensor,  # int[R]
    query_start_loc: torch.Tensor,  # int[R+1]
    positions: torch.Tensor,  # int64[>= T]
    num_tokens_padded: int | None = None,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> torch.Tensor:  # int64[num_tokens_padded]
    """torch, vectorised (``repeat_interleave`` of the rows)."""
    dev = table.device
    qsl = query_start_loc.long()
    num_reqs = idx_mapping.shape[0]
    num_tokens = int(qsl[num_reqs]) if num_reqs else 0
    padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    out = torch.full((max(padded, num_tokens),), PAD_SLOT_ID, dtype=torch.int64, device=dev)
    if num_tokens == 0:
        return out[:padded]
    counts = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    row = torch.repeat_interleave(torch.arange(num_reqs, device=dev), counts, output_size=num_tokens)
    p = positions[:num_tokens].long()
    req = idx_mapping.long()[row]  # int64[T]
    if cp_size == 1:
        local_p, owned = p, torch.ones_like(p, dtype=torch.bool)
    else:
        virtual = block_size * cp_size
        voff = p % virtual
        owned = (voff // cp_interleave) % cp_size == cp_rank
        local_off = voff // (cp_interleave * cp_size) * cp_interleave + voff % cp_interleave
        local_p = p // virtual * block_size + local_off
    blk_idx = local_p // block_size
    ok = owned & (req >= 0) & (blk_idx < table.shape[1])
    blocks = table[req.clamp(min=0), blk_idx.clamp(max=table.shape[1] - 1)].long()
    out[:num_tokens] = torch.where(ok, blocks * block_size + local_p % block_size, PAD_SLOT_ID)
    return out[:padded]


def gathered_slot_mapping_ref(global_slots: torch.Tensor, padded_gather_idx: torch.Tensor,
                              kv_write_mask: torch.Tensor) -> torch.Tensor:  # int64[N*P]
    """torch: ``where(kv_write_mask, global_slots[padded_gather_idx], PAD)``."""
    picked = global_slots.long().index_select(0, padded_gather_idx.long())
    return torch.where(kv_write_mask.bool(), picked, PAD_SLOT_ID)


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["num_reqs"])  # a runtime loop bound, even when it is 1
def _slot_mapping_kernel(table_ptr, idx_ptr, qsl_ptr, pos_ptr, out_ptr,
                         num_reqs, num_padded, width, stride_table, block_size,
                         cp_size, cp_rank, cp_interleave, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # int32[BLOCK_T]
    in_out = t < num_padded
    num_tokens = tl.load(qsl_ptr + num_reqs).to(tl.int32)
    real = in_out & (t < num_tokens)
    # Branch-free binary search: the last row b in [0, R) with query_start_loc[b] <= t.
    base = tl.zeros([BLOCK_T], tl.int32)
    n = num_reqs
    while n > 1:
        half = n // 2
        mid = base + half
        start = tl.load(qsl_ptr + mid, mask=real, other=0)
        base = tl.where(start <= t, mid, base)
        n -= half
    req = tl.load(idx_ptr + base, mask=real, other=-1).to(tl.int64)
    p = tl.load(pos_ptr + t, mask=real, other=0).to(tl.int64)
    virtual = block_size * cp_size
    voff = p % virtual
    owned = ((voff // cp_interleave) % cp_size) == cp_rank
    local_off = voff // (cp_interleave * cp_size) * cp_interleave + voff % cp_interleave
    local_p = p // virtual * block_size + local_off
    blk_idx = local_p // block_size
    ok = real & owned & (req >= 0) & (blk_idx < width) & (blk_idx >= 0)
    blk = tl.load(table_ptr + req * stride_table + blk_idx, mask=ok, other=0).to(tl.int64)
    slot = tl.where(ok, blk * block_size + local_p % block_size, -1)
    tl.store(out_ptr + t, slot, mask=in_out)


@triton.jit
def _gathered_slots_kernel(global_ptr, gather_idx_ptr, mask_ptr, out_ptr, n, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = j < n
    write = tl.load(mask_ptr + j, mask=inb, other=0) != 0
    src = tl.load(gather_idx_ptr + j, mask=inb & write, other=0).to(tl.int64)
    val = tl.load(global_ptr + src, mask=inb & write, other=-1).to(tl.int64)
    tl.store(out_ptr + j, tl.where(write, val, -1), mask=inb)


# ----------------------------------------------------------------------------- wrappers
def compute_slot_mapping(
    table: torch.Tensor,  # int32[max_num_reqs, W]
    block_size: int,
    idx_mapping: torch.Tensor,  # int[R]  (-1: dummy request)
    query_start_loc: torch.Tensor,  # int[R+1]
    positions: torch.Tensor,  # int64[>= num_tokens]
    num_tokens_padded: int | None = None,  # None: query_start_loc[R] (a device sync)
    *,
    cp_size: int = 1,  # DCP world size
    cp_rank: int = 0,
    cp_interleave: int = 1,
    out: torch.Tensor | None = None,  # int64[>= num_tokens_padded]
) -> torch.Tensor:  # int64[num_tokens_padded]
    """One KV-cache group's slot mapping (call once per group; see the module docstring).

    A position whose block index falls outside the table gets PAD (the NumPy
    reference raises ``ValueError`` there instead)."""
    dev = table.device
    idx = as_index(idx_mapping, dev)
    qsl = as_index(query_start_loc, dev)
    pos = as_index(positions, dev)
    r = idx.shape[0]
    if num_tokens_padded is None:
        num_tokens_padded = int(qsl[r]) if r else 0
    padded = int(num_tokens_padded)
    if out is None:
        out = torch.empty(padded, dtype=torch.int64, device=dev)
    if padded == 0:
        return out[:0]
    if r == 0:
        out[:padded].fill_(PAD_SLOT_ID)
        return out[:padded]
    if cp_size < 1 or not 0 <= cp_rank < cp_size or cp_interleave < 1:
        raise ValueError(f"bad DCP setting cp_size={cp_size} cp_rank={cp_rank} interleave={cp_interleave}")
    if pos.shape[0] == 0:
        pos = torch.zeros(1, dtype=torch.int64, device=dev)
    block_t = 64 if INTERPRET else 512
    _slot_mapping_kernel[(triton.cdiv(padded, block_t),)](
        table, idx, qsl, pos, out, r, padded, table.shape[1], table.stride(0), block_size,
        cp_size, cp_rank, cp_interleave, BLOCK_T=block_t, num_warps=4)
    return out[:padded]


def gathered_slot_mapping(
    global_slots: torch.Tensor,  # int64[T]
    padded_gather_idx: torch.Tensor,  # int64[N*P]
    kv_write_mask: torch.Tensor,  # bool[N*P]
) -> torch.Tensor:  # int64[N*P]
    """``global_slots[padded_gather_idx]`` where ``kv_write_mask``, else PAD."""
    dev = global_slots.device
    n = padded_gather_idx.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    gidx = as_index(padded_gather_idx, dev)
    mask = kv_write_mask if kv_write_mask.device == dev else kv_write_mask.to(dev)
    if not mask.is_contiguous():
        mask = mask.contiguous()
    block = 64 if INTERPRET else 1024
    glob = global_slots if global_slots.is_contiguous() else global_slots.contiguous()
    _gathered_slots_kernel[(triton.cdiv(n, block),)](glob, gidx, mask, out, n,
                                                      BLOCK=block, num_warps=4)
    return out
