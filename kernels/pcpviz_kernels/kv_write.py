"""KV-cache write by slot mapping: ``cache[slots[i]] = latent[i]``, PAD (-1) rows skipped.

Under PCP the target (and the first draft forward) all-gathers every rank's new
latent rows (``[P] -> [N*P]``) and writes them through the *gathered* slot
mapping, whose padding rows are PAD; replicated draft decodes write their R rows
through the unexpanded mapping. Either way: one latent row per slot entry.

Worked example (cache of 8 slots, 576-wide rows drawn as letters)::

    slots   int64[4]  [ 5, -1,  0,  2]
    latent  [4, 576]  [ A,  B,  C,  D]
    cache after       slot 0 = C, slot 2 = D, slot 5 = A; B (PAD) is dropped

Slots at or beyond ``num_slots`` are skipped as well (the caller checks them:
the engine raises ``IndexError`` for them, as the torch path does). The latent is
converted to the cache dtype on store. One program per tile of
``BLOCK_M`` rows x ``BLOCK_D`` columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index

__all__ = ["write_kv_cache", "write_kv_cache_ref"]


def write_kv_cache_ref(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    """torch: ``cache[slots[keep]] = latent[keep]`` with ``keep = 0 <= slots < num_slots``."""
    keep = (slots >= 0) & (slots < cache.shape[0])  # bool[M]
    cache.index_copy_(0, slots[keep].long(), latent[keep].to(cache.dtype))


@triton.jit
def _kv_write_kernel(cache_ptr, slots_ptr, latent_ptr, num_rows, num_slots, width,
                     stride_cache, stride_latent,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # int32[BLOCK_M]
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    mask = ok[:, None] & (cols[None, :] < width)
    src = tl.load(latent_ptr + rows.to(tl.int64)[:, None] * stride_latent + cols[None, :], mask=mask)
    tl.store(cache_ptr + slot[:, None] * stride_cache + cols[None, :],
             src.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    cache: torch.Tensor,  # [num_slots, D]
    slots: torch.Tensor,  # int[M], PAD = -1
    latent: torch.Tensor,  # [M, D]
) -> None:
    """In place: write ``latent[i]`` to ``cache[slots[i]]`` for every non-PAD row."""
    if slots.shape[0] != latent.shape[0]:
        raise ValueError(f"slot mapping has {slots.shape[0]} rows, latent has {latent.shape[0]}")
    if latent.shape[-1] != cache.shape[-1]:
        raise ValueError(f"latent rows have {latent.shape[-1]} numbers, cache rows {cache.shape[-1]}")
    m = slots.shape[0]
    if m == 0:
        return
    if cache.stride(1) != 1:
        raise ValueError("cache rows must be contiguous")
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    slots = as_index(slots, cache.device)
    width = cache.shape[1]
    block_m, block_d = (16, 64) if INTERPRET else (8, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(width, block_d))
    _kv_write_kernel[grid](cache, slots, latent, m, cache.shape[0], width,
                           cache.stride(0), latent.stride(0),
                           BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
