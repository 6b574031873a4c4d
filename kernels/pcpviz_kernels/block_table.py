"""Block-table row gather: the batch's rows of the persistent block table, in batch order.

vLLM keeps one persistent ``int32[max_num_reqs, W]`` block table indexed by
request-state slot; each step copies the rows of the scheduled requests, in
batch order, into the table attention reads (``idx_mapping[i]`` = slot of batch
row ``i``). Rows past the real requests (graph padding) are zero, and so are
rows whose ``idx_mapping`` is negative (dummy requests). With ``num_blocks``
only a request's first ``num_blocks[slot]`` entries are copied, the rest are 0.
Under PCP+MTP the drafter calls it again with the *global* ``idx_mapping``
before its replicated decodes (the PR's fix).

Worked example (W = 3)::

    table        slot 0: [7 3 0]   slot 1: [5 0 0]   slot 2: [9 8 6]
    idx_mapping  int64[2]  [2, 0]        num_reqs_padded 3
    out          int32[3, 3]  [[9 8 6], [7 3 0], [0 0 0]]
    with num_blocks int32[3] = [1, 1, 2]:  [[9 8 0], [7 0 0], [0 0 0]]

Equal to ``pcpviz.reference.blocks.gather_block_table_rows`` for non-negative indices.
One program per (output row, tile of ``BLOCK_W`` columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcpviz_kernels._util import INTERPRET, as_index

__all__ = ["gather_block_table_rows", "gather_block_table_rows_ref"]


def gather_block_table_rows_ref(
    table: torch.Tensor,  # int32[max_num_reqs, W]
    idx_mapping: torch.Tensor,  # int[R]
    num_reqs_padded: int | None = None,
    num_blocks: torch.Tensor | None = None,  # int[max_num_reqs]
) -> torch.Tensor:  # int32[num_reqs_padded, W]
    """torch: ``index_select`` of the rows, masked by ``num_blocks``, zero padding rows."""
    idx = idx_mapping.long()
    padded = idx.shape[0] if num_reqs_padded is None else int(num_reqs_padded)
    out = torch.zeros(padded, table.shape[1], dtype=table.dtype, device=table.device)
    valid = idx >= 0
    rows = table.index_select(0, idx.clamp(min=0))  # [R, W]
    keep = valid[:, None].expand_as(rows)
    if num_blocks is not None:
        nb = num_blocks.long().index_select(0, idx.clamp(min=0))  # [R]
        keep = keep & (torch.arange(table.shape[1], device=table.device)[None, :] < nb[:, None])
    out[: idx.shape[0]] = torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return out


@triton.jit
def _gather_rows_kernel(table_ptr, idx_ptr, num_blocks_ptr, out_ptr, num_reqs, width,
                        stride_table, stride_out,
                        HAS_NUM_BLOCKS: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_batch = row < num_reqs
    # Scalar loads at a clamped index (idx has >= 1 entry), then masked by value.
    req = tl.load(idx_ptr + tl.where(in_batch, row, 0)).to(tl.int64)
    req = tl.where(in_batch, req, -1)
    limit = width
    if HAS_NUM_BLOCKS:
        limit = tl.load(num_blocks_ptr + tl.maximum(req, 0))
    ok = (cols < limit) & (cols < width) & ((cols * 0 + req) >= 0)  # vector & vector only
    vals = tl.load(table_ptr + req * stride_table + cols, mask=ok, other=0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, vals, mask=cols < width)


def gather_block_table_rows(
    table: torch.Tensor,  # int32[max_num_reqs, W]
    idx_mapping: torch.Tensor,  # int[R]
    num_reqs_padded: int | None = None,
    num_blocks: torch.Tensor | None = None,  # int[max_num_reqs]
    out: torch.Tensor | None = None,  # int32[>= num_reqs_padded, W]: written in place
) -> torch.Tensor:  # int32[num_reqs_padded, W]
    """Rows ``table[idx_mapping]`` in batch order, zero past ``len(idx_mapping)``."""
    dev = table.device
    idx = as_index(idx_mapping, dev)
    r = idx.shape[0]
    padded = r if num_reqs_padded is None else int(num_reqs_padded)
    if padded < r:
        raise ValueError(f"num_reqs_padded {padded} < {r} requests")
    width = table.shape[1]
    if out is None:
        out = torch.empty(padded, width, dtype=table.dtype, device=dev)
    elif out.shape[0] < padded or out.shape[1] != width or out.dtype != table.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, need [>= {padded}, {width}] {table.dtype}")
    if table.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("block tables must have contiguous rows")
    if padded == 0 or width == 0:
        return out[:padded]
    if r == 0:
        idx = torch.full((1,), -1, dtype=torch.int64, device=dev)  # read by no real row
    nb = as_index(num_blocks, dev) if num_blocks is not None else idx
    block_w = 64 if INTERPRET else min(1024, triton.next_power_of_2(width))
    grid = (padded, triton.cdiv(width, block_w))
    _gather_rows_kernel[grid](table, idx, nb, out, r, width, table.stride(0), out.stride(0),
                              HAS_NUM_BLOCKS=num_blocks is not None, BLOCK_W=block_w, num_warps=4)
    return out[:padded]
