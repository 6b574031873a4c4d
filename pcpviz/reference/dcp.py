"""Decode context parallel (DCP): where a token's KV lives when the cache is sharded over the DCP
ranks, re-derived from vLLM 0.33.0.

The KV of a request is dealt to the ``D`` DCP ranks in runs of ``I`` tokens
(``cp_kv_cache_interleave_size``, which must divide the manager block size ``M``,
``vllm/config/vllm.py`` 3404-3411). The scheduler sees a *virtual* block of ``M * D`` tokens; each
rank stores its share of it in its own ``M``-token block with the **same block id** (every rank
has the same block table). For a token at position ``p``
(``_compute_slot_mappings_kernel``, ``vllm/v1/worker/gpu/block_table.py`` 386-413, and
``cp_local_slot`` in ``vllm/v1/worker/gpu/cp_utils.py`` 66-83)::

    v      = p % (M*D)                          offset in the virtual block
    owner  = v // I % D                         the one rank that writes it (``is_local``)
    local  = p // (M*D) * M + v // (I*D) * I + p % I   its position in that rank's stream
    slot   = table[req, local // M] * M + local % M   on the owner; PAD (-1) on every other rank

Because ``I`` divides ``M``, ``owner = p // I % D`` and ``local = p // (I*D) * I + p % I``: the
rank keeps runs ``0..I-1, I*D..I*D+I-1, ...`` and packs them densely. A rank's **local seq len**
for a request of ``L`` tokens is how many of positions ``0..L-1`` it owns
(``get_dcp_local_seq_lens``, ``vllm/v1/attention/backends/utils.py`` 1166-1211, and the kernel
``_dcp_local_seq_lens_kernel``, ``cp_utils.py`` 37-63)::

    local_len(L, r) = L // (I*D) * I + clip(L % (I*D) - r*I, 0, I)

so rank ``r`` attends over local tokens ``0..local_len-1``, whose slots are exactly the ones it
wrote. A draft decode at position ``p`` (``seq_len = p + 1``) uses the same formula: the MTP
speculator recomputes it every draft step from its own ``seq_lens``
(``spec_decode/speculator.py`` 371-380 and 595-603), the per-rank ``local_len`` of vllm#50391.

The attention kernels read through a block table expanded to the **kernel** block size ``k``
(``AttentionGroup.map_to_kernel_block_table``, ``vllm/v1/worker/utils.py`` 380-395: kernel block
``j`` of manager block ``b`` is ``b * M/k + j``). The slot is the same number in both views, so
ownership and local offsets must be computed with ``M``. Computing them with ``k`` (the
vllm#51031 class) changes nothing while ``I <= k`` and moves tokens to the wrong rank and offset
once ``I > k`` (``--block-size 128 --cp-kv-cache-interleave-size 128`` with a 64-token kernel).

PCP=2, DCP=2 example (vLLM with PCP > 1 allows DCP = PCP: the DCP group *is* the PCP group at
TP=1, ``config/parallel.py`` 595-606; ``I = 2``, ``M = 4``, one request of 7 tokens in request-state slot 1, block 5)::

    position    0  1  2  3  4  5  6
    owner       0  0  1  1  0  0  1
    local       0  1  0  1  2  3  2
    rank 0      20 21 -1 -1 22 23 -1      local_len 4
    rank 1      -1 -1 20 21 -1 -1 22      local_len 3

    >>> s = dcp_shard(np.array([[0], [5]]), 4, np.array([1]), query_start_loc=np.array([0, 7]),
    ...               positions=np.arange(7), dcp_size=2, interleave=2)
    >>> s.slots.tolist()
    [[20, 21, -1, -1, 22, 23, -1], [-1, -1, 20, 21, -1, -1, 22]]
    >>> dcp_local_seq_lens(np.array([7]), dcp_size=2, interleave=2).tolist()
    [[4], [3]]

A draft decode at position 7 (``seq_len`` 8) goes to rank 1 (``7 // 2 % 2``), local position 3:
``local_len`` becomes ``[4, 4]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pcpviz.reference.blocks import PAD_SLOT_ID, compute_slot_mappings

__all__ = [
    "DCPShard",
    "dcp_owner",
    "dcp_local_position",
    "dcp_shard",
    "dcp_local_seq_lens",
    "draft_local_lens",
    "kernel_block_table",
    "local_read_slots",
    "check_dcp_config",
]


def check_dcp_config(*, block_size: int, dcp_size: int, interleave: int) -> None:
    """Raise ValueError (one line) for a combination vLLM 0.33.0 refuses."""
    if dcp_size < 1 or block_size < 1 or interleave < 1:
        raise ValueError(f"dcp_size, block_size and interleave must be >= 1 (got {dcp_size}, {block_size}, "
                         f"{interleave})")
    if block_size % interleave:
        raise ValueError(f"block size {block_size} must be divisible by cp_kv_cache_interleave_size {interleave}")


def dcp_owner(positions: np.ndarray, *, block_size: int, dcp_size: int, interleave: int) -> np.ndarray:
    """int64[T]: the DCP rank that stores the KV of each position (``is_local`` is owner == rank)."""
    p = np.asarray(positions, dtype=np.int64)
    return p % (block_size * dcp_size) // interleave % dcp_size


def dcp_local_position(positions: np.ndarray, *, block_size: int, dcp_size: int, interleave: int) -> np.ndarray:
    """int64[T]: each position's index in its owner's local KV stream (the ``local_positions``
    of the slot-mapping kernel)."""
    p = np.asarray(positions, dtype=np.int64)
    virtual = block_size * dcp_size
    v = p % virtual
    return p // virtual * block_size + v // (interleave * dcp_size) * interleave + v % interleave


@dataclass(frozen=True)
class DCPShard:
    """One batch's KV sharding over the DCP ranks.

    ``owner``  int64[T]     the rank storing each token (-1 for tokens past the real ones or of
                            rows with ``idx_mapping == -1``)
    ``local``  int64[T]     the token's position in its owner's local stream
    ``slots``  int64[D, T]  each rank's slot mapping (PAD = -1 where another rank owns the token)
    """

    dcp_size: int
    interleave: int
    block_size: int
    owner: np.ndarray
    local: np.ndarray
    slots: np.ndarray

    def writes_per_token(self) -> np.ndarray:  # int64[T]
        """How many ranks write each token: 1 for a real token, 0 for padding."""
        return (self.slots != PAD_SLOT_ID).sum(axis=0)


def dcp_shard(
    tables: np.ndarray,
    block_size: int,
    idx_mapping: np.ndarray,
    *,
    query_start_loc: np.ndarray,
    positions: np.ndarray,
    dcp_size: int,
    interleave: int,
    num_tokens_padded: int | None = None,
) -> DCPShard:
    """The batch's DCP sharding: ``compute_slot_mappings`` on every DCP rank of one KV group."""
    check_dcp_config(block_size=block_size, dcp_size=dcp_size, interleave=interleave)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    idx = np.asarray(idx_mapping, dtype=np.int64)
    slots = np.stack([
        compute_slot_mappings(tables, block_size, idx, query_start_loc=qsl, positions=positions,
                              num_tokens_padded=num_tokens_padded, cp_size=dcp_size, cp_rank=r,
                              cp_interleave=interleave)[0]
        for r in range(dcp_size)
    ]) if dcp_size > 1 else compute_slot_mappings(tables, block_size, idx, query_start_loc=qsl,
                                                  positions=positions, num_tokens_padded=num_tokens_padded)
    width = slots.shape[1]
    num_tokens = int(qsl[idx.shape[0]]) if qsl.size else 0
    pos = np.zeros(width, dtype=np.int64)
    n = min(num_tokens, width)
    pos[:n] = np.asarray(positions, dtype=np.int64)[:n]
    rows = np.repeat(np.arange(idx.shape[0]), np.diff(qsl[: idx.shape[0] + 1]))[:n]
    real = np.zeros(width, dtype=bool)
    real[:n] = idx[rows] >= 0
    kw = dict(block_size=block_size, dcp_size=dcp_size, interleave=interleave)
    owner = np.where(real, dcp_owner(pos, **kw), -1)
    local = np.where(real, dcp_local_position(pos, **kw), -1)
    return DCPShard(dcp_size, interleave, block_size, owner, local, slots)


def dcp_local_seq_lens(seq_lens: np.ndarray, *, dcp_size: int, interleave: int) -> np.ndarray:
    """int32[D, R]: how many of each request's ``seq_len`` tokens every DCP rank stores."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    span = interleave * dcp_size
    ranks = np.arange(dcp_size, dtype=np.int64)[:, None]
    part = np.clip(lens[None, :] % span - ranks * interleave, 0, interleave)
    return (lens[None, :] // span * interleave + part).astype(np.int32)


def draft_local_lens(positions: np.ndarray, *, dcp_size: int, interleave: int) -> np.ndarray:
    """int32[D, R]: the per-rank ``local_len`` of a draft decode step whose tokens sit at
    ``positions`` (one per request): the DCP-local seq lens of ``positions + 1``."""
    return dcp_local_seq_lens(np.asarray(positions, dtype=np.int64) + 1, dcp_size=dcp_size,
                              interleave=interleave)


def kernel_block_table(table: np.ndarray, *, block_size: int, kernel_block_size: int) -> np.ndarray:
    """int64[R, W*M/k]: a manager-block table expanded to kernel blocks (kernel block ``j`` of
    manager block ``b`` is ``b * M/k + j``), as the attention kernels read it."""
    if block_size % kernel_block_size:
        raise ValueError(f"kernel block size {kernel_block_size} does not divide block size {block_size}")
    per = block_size // kernel_block_size
    t = np.asarray(table, dtype=np.int64)
    return (t[..., None] * per + np.arange(per)).reshape(*t.shape[:-1], t.shape[-1] * per)


def local_read_slots(table_row: Sequence[int], local_len: int, *, block_size: int,
                     kernel_block_size: int | None = None) -> np.ndarray:
    """int64[local_len]: the slots a DCP rank's attention reads for one request: local tokens
    ``0..local_len-1`` through the (kernel-expanded) block-table row."""
    k = block_size if kernel_block_size is None else kernel_block_size
    row = kernel_block_table(np.asarray(table_row)[None, :], block_size=block_size, kernel_block_size=k)[0]
    t = np.arange(int(local_len), dtype=np.int64)
    if t.size and int(t[-1]) // k >= row.shape[0]:
        raise ValueError(f"local length {local_len} needs more than the row's {row.shape[0]} kernel blocks")
    return row[t // k] * k + t % k
