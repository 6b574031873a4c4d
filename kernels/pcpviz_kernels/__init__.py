"""pcpviz_kernels: Triton kernels of the pcpviz engine's PCP + MTP data path.

Each kernel sits in its own module next to a plain torch reference (``*_ref``)
that is its oracle in the tests:

================================  =====================================================
``paged_mla_attention``           absorbed-MLA attention over the paged latent cache
                                  (decode, draft decode, short rows); split-K
                                  (flash-decoding) for long contexts
``mla_prefill_attention``         causal flash attention of prefill rows (DualChunkSwap
                                  chunks, chunked prefill) over up-projected K/V
``write_kv_cache``                latent rows into the cache by slot mapping, PAD skipped
``gather_block_table_rows``       block-table rows by ``idx_mapping``, padded rows zero
``compute_slot_mapping``          positions -> slots through block-table rows (DCP optional)
``gathered_slot_mapping``         PCP: global slots in all-gathered row order, PAD masked
``restore_hidden``                PCP: ``[N*P, H]`` gathered rows -> ``[T, H]`` global order
================================  =====================================================

The kernels run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (which
must be set before this package is imported: ``triton.jit`` decides then).
The pcpviz engine calls them on CUDA unless ``PCPVIZ_KERNELS=0``.
"""

from __future__ import annotations

import os

from pcpviz_kernels._util import INTERPRET
from pcpviz_kernels.block_table import gather_block_table_rows, gather_block_table_rows_ref
from pcpviz_kernels.kv_write import write_kv_cache, write_kv_cache_ref
from pcpviz_kernels.mla_prefill import mla_prefill_attention, mla_prefill_attention_ref
from pcpviz_kernels.paged_mla import paged_mla_attention, paged_mla_attention_ref
from pcpviz_kernels.restore import restore_hidden, restore_hidden_ref
from pcpviz_kernels.slot_mapping import (
    PAD_SLOT_ID,
    compute_slot_mapping,
    compute_slot_mapping_ref,
    gathered_slot_mapping,
    gathered_slot_mapping_ref,
)

__all__ = [
    "INTERPRET",
    "PAD_SLOT_ID",
    "enabled",
    "paged_mla_attention",
    "paged_mla_attention_ref",
    "mla_prefill_attention",
    "mla_prefill_attention_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
    "gather_block_table_rows",
    "gather_block_table_rows_ref",
    "compute_slot_mapping",
    "compute_slot_mapping_ref",
    "gathered_slot_mapping",
    "gathered_slot_mapping_ref",
    "restore_hidden",
    "restore_hidden_ref",
]


def enabled() -> bool:
    """False when ``PCPVIZ_KERNELS=0`` (force the torch reference path)."""
    return os.environ.get("PCPVIZ_KERNELS", "1") != "0"
