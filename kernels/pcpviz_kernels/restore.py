"""PCP hidden-state restore: all-gathered rank-major rows -> the global token order.

After the target forward each rank holds ``P`` hidden rows (its local,
DualChunkSwap-ordered tokens plus padding); an all-gather stacks them rank-major
into ``[N*P, H]`` and ``hidden_restore_idx`` (``int64[T]``) picks, for global
token ``t``, the gathered row that computed it: ``out[t] = gathered[idx[t]]``.

Worked example (PCP=2, P=4; a decode b and a 6-token prefill a cut in chunks
a[0:2] a[2:4] a[4:6] a[6:6])::

    gathered rows   rank 0: b a0 a1 pad | rank 1: a2 a3 a4 a5     [8, H]
    global order    a0 a1 a2 a3 a4 a5 b                           T = 7
    restore_idx     int64[7]  [1 2 4 5 6 7 0]

One program per tile of ``BLOCK_T`` rows x ``BLOCK_H`` columns (a pure row gather:
bandwidth-bound, compared with ``torch.index_select``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index

__all__ = ["restore_hidden", "restore_hidden_ref"]


def restore_hidden_ref(gathered: torch.Tensor, restore_idx: torch.Tensor) -> torch.Tensor:
    """torch: ``gathered.index_select(0, restore_idx)`` -> ``[T, H]``."""
    return gathered.index_select(0, restore_idx.long())


@triton.jit
def _restore_kernel(src_ptr, idx_ptr, out_ptr, num_t, num_src, width, stride_src, stride_out,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < num_t
    src = tl.load(idx_ptr + t, mask=t_ok, other=0).to(tl.int64)
    src_ok = t_ok & (src >= 0) & (src < num_src)
    col_ok = cols[None, :] < width
    vals = tl.load(src_ptr + src[:, None] * stride_src + cols[None, :], mask=src_ok[:, None] & col_ok,
                   other=0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + cols[None, :], vals,
             mask=t_ok[:, None] & col_ok)


def restore_hidden(
    gathered: torch.Tensor,  # [N*P, H]
    restore_idx: torch.Tensor,  # int64[T]
    out: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor:  # [T, H]
    """``out[t] = gathered[restore_idx[t]]`` (an index outside ``[0, N*P)`` gives a zero row)."""
    if gathered.dim() != 2:
        raise ValueError(f"gathered must be [N*P, H], got {tuple(gathered.shape)}")
    dev = gathered.device
    idx = as_index(restore_idx, dev)
    num_t, width = idx.shape[0], gathered.shape[1]
    if out is None:
        out = torch.empty(num_t, width, dtype=gathered.dtype, device=dev)
    if num_t == 0 or width == 0:
        return out
    if gathered.stride(1) != 1:
        gathered = gathered.contiguous()
    if INTERPRET:
        block_t, block_h = 8, 64
    else:
        block_h = min(triton.next_power_of_2(width), 4096 // gathered.element_size())
        block_t = max(1, 8192 // (block_h * gathered.element_size()))
    grid = (triton.cdiv(num_t, block_t), triton.cdiv(width, block_h))
    _restore_kernel[grid](gathered, idx, out, num_t, gathered.shape[0], width, gathered.stride(0),
                          out.stride(0), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out
