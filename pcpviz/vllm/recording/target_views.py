"""The target phase's views, taken where vLLM prepares the batch: the global batch (PCP=1's
``prepare_inputs``, or the PCP manager's argument), the layout and rank-local batch
(``PCPManager.partition_batch``) and the block-table rows and slots (``PCPManager.prepare_attn``, or
PCP=1's ``GPUModelRunner.prepare_attn``).

The device views are planned (``recording.replayplan``): a step whose batch has the sizes of an
earlier one, over the same persistent buffers, is one copy. A plan's key names every buffer it reads
by address, shape and strides, and the tensors vLLM makes anew each step are handed to it again
(``dynamic``): in vLLM 0.33.0's ``partition_batch`` the gather and restore indices, the KV write
mask and the local ``idx_mapping`` / ``logits_indices`` are new tensors every step, while the local
batch's ``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens`` and ``is_padding`` are slices
of buffers the manager keeps. The host views (request ids, the scheduler's NumPy arrays, the layout's
segments, timestamps) are put each step after the planned copy.

PCP=2, a decode ``d0`` (1 + 2 drafts) and a prefill ``p1`` (5 tokens), rank 0: the planned copy
holds the global ``input_ids`` ``int32[8]``, positions, ``query_start_loc`` and ``seq_lens``, the
rank-local ``local_input_ids`` ``int32[P]`` and the rest of the local batch, and the five dynamic
tensors; the host put adds ``req_ids = ["d0", "p1"]``, ``segments`` and ``per_rank_num_tokens``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pcpviz.trace.packed import host_entry, int64_entry
from pcpviz.vllm.recording.host import Deferred, Strings, block_rows
from pcpviz.vllm.recording.state import warming_up

__all__ = ["batch_device_views", "batch_host_views", "where", "on_global_batch", "on_runner_attn", "on_partition",
           "on_prepare_attn"]

_GLOBAL = host_entry(np.array("global"))  # ``sampled_from`` of a PCP=1 step


def batch_device_views(g: Any) -> dict[str, Any]:
    """The global batch's device tensors: slices of vLLM's persistent input buffers, and
    ``idx_mapping`` / ``logits_indices`` (made anew each step)."""
    r, t = g.num_reqs, g.num_tokens
    return dict(idx_mapping=g.idx_mapping[:r], query_start_loc=g.query_start_loc[: r + 1], positions=g.positions[:t],
                input_ids=g.input_ids[:t], seq_lens=g.seq_lens[:r], logits_indices=g.logits_indices)


def batch_host_views(g: Any) -> dict[str, Any]:
    """The global batch's host values (the scheduler's NumPy arrays and request ids)."""
    r = g.num_reqs
    return dict(
        req_ids=Strings(g.req_ids),
        num_scheduled_tokens=np.asarray(g.num_scheduled_tokens[:r], dtype=np.int64),
        num_computed_tokens=np.asarray(g.num_computed_tokens_np[:r], dtype=np.int64),
        is_prefilling=np.asarray(g.is_prefilling_np[:r], dtype=bool),
        prefill_len=np.asarray(g.prefill_len_np[:r], dtype=np.int64),
        num_draft_tokens=(np.zeros(r, dtype=np.int64) if g.num_draft_tokens_per_req is None
                          else np.asarray(g.num_draft_tokens_per_req[:r], dtype=np.int64)),
    )


def where(*tensors: Any) -> tuple:
    """Address, shape and strides of each tensor (a plan key's part: the same memory read the same way)."""
    return tuple((t.data_ptr(), t.shape, t.stride()) if isinstance(t, torch.Tensor) else t for t in tensors)


def on_global_batch(rec: Any, g: Any, t0: int) -> None:
    """PCP=1 (no PCP manager): the batch ``GPUModelRunner.prepare_inputs`` returns is the global
    batch, and the sampler reads its ``logits_indices`` rows. A batch of the same size over the same
    buffers is one copy (``idx_mapping`` and ``logits_indices`` are new every step: dynamic)."""
    key = ("global_batch", g.num_reqs, g.num_tokens, *where(g.query_start_loc, g.positions, g.input_ids, g.seq_lens))
    rec.planned_put("target", key, [rec.pack.head(g.idx_mapping, g.num_reqs), g.logits_indices],
                    views=lambda idx, logits: {**batch_device_views(g), "idx_mapping": idx,
                                               "logits_indices": logits, "sampled_logits_rows": logits})
    rec.put("target", **batch_host_views(g))
    box = rec.phase("target")
    box["sampled_from"], box["t_start_us"] = _GLOBAL, int64_entry(t0)
    if warming_up():
        rec.put("target", warmup=np.array(True))


def on_runner_attn(rec: Any, bt: Any, batch: Any, *, block_tables: Any, slot_mappings: torch.Tensor) -> None:
    """PCP=1: ``GPUModelRunner.prepare_attn``'s block-table rows (batch order) and slots (planned)."""
    r, t = batch.num_reqs, batch.num_tokens
    key = ("runner_attn", r, t, *where(bt.num_blocks.gpu, slot_mappings, *block_tables))

    def views(idx: torch.Tensor) -> dict[str, Any]:
        rows, stale = block_rows(bt, [b[:r] for b in block_tables], idx)
        return {"block_table_global": rows, "block_table_global_stale_tail": stale,
                "slot_mapping_global": slot_mappings[:, :t]}

    rec.planned_put("target", key, [rec.pack.head(batch.idx_mapping, r)], views=views)


def on_partition(rec: Any, manager: Any, g: Any, *, local: Any, segments: list, per_rank: list[int],
                 t0: int) -> None:
    """``partition_batch``'s views: the global batch, the layout and this rank's local batch (one
    planned copy of the device views; the local ``input_ids`` are copied now, before the draft
    prefill overwrites them in place), then the host views."""
    nr, p, rank = local.num_reqs, local.num_tokens_after_padding, rec.rank
    is_padding = local.is_padding
    moe = is_padding.shape[0] != p  # moe_gathers_tokens (EP off): vLLM hands the rank-major [N*P] MoE mask
    pack = rec.pack
    dynamic = [pack.head(g.idx_mapping, g.num_reqs), g.logits_indices, manager._padded_gather_idx,
               manager._hidden_restore_idx, manager._gathered_kv_write_mask, pack.head(local.idx_mapping, nr),
               local.logits_indices[:nr]]
    key = ("partition", rank, g.num_reqs, g.num_tokens, nr, p, moe,
           *where(g.query_start_loc, g.positions, g.input_ids, g.seq_lens, local.input_ids, local.positions,
                  local.query_start_loc, local.seq_lens, is_padding))

    def device_views(idx: Any, logits: Any, gather: Any, restore: Any, mask: Any, local_idx: Any,
                     local_logits: Any) -> dict[str, Any]:
        views = {**batch_device_views(g), "idx_mapping": idx, "logits_indices": logits,
                 "padded_gather_idx": gather, "hidden_restore_idx": restore, "kv_write_mask": mask,
                 "local_idx_mapping": local_idx, "local_input_ids": local.input_ids[:p],
                 "local_positions": local.positions[:p], "local_query_start_loc": local.query_start_loc[: nr + 1],
                 "local_seq_lens": local.seq_lens[:nr], "local_logits_indices": local_logits,
                 "local_is_padding": is_padding[rank * p:(rank + 1) * p] if moe else is_padding[:p]}
        if moe:
            views["moe_is_padding"] = is_padding  # this rank's own rows are its block of it (local_is_padding)
        return views

    rec.planned_put("target", key, dynamic, views=device_views)
    rec.put("target", **batch_host_views(g), segments=Deferred("segments", [
        [[(s.global_batch_req_idx, s.global_batch_slice.start, s.global_batch_slice.stop,
           s.rank_local_batch_slice.start, s.rank_local_batch_slice.stop) for s in rank_segs]
         for rank_segs in segments]]),
        per_rank_num_tokens=np.asarray(per_rank, dtype=np.int64), local_req_ids=Strings(local.req_ids),
        local_is_prefilling=np.asarray(local.is_prefilling_np[:nr], dtype=bool),
        local_num_computed_tokens=np.asarray(local.num_computed_tokens_np[:nr], dtype=np.int64))
    rec.phase("target")["t_start_us"] = int64_entry(t0)
    if warming_up():
        rec.put("target", warmup=np.array(True))  # a synthetic warm-up step (PCPVIZ_RECORD_DUMMY=1)


def on_prepare_attn(rec: Any, manager: Any, local: Any, *, block_tables: Any) -> None:
    """``prepare_attn``'s block-table rows, local (the tables it gathered, batch order) and global (the
    request-indexed tables gathered here by the global ``idx_mapping``: new tensors every step, handed
    to the plan as dynamic), each with its stale tail; one planned copy."""
    bt, g, pack = manager._block_tables, manager._global_batch, rec.pack
    nrp = local.num_reqs_after_padding
    idx = pack.head(g.idx_mapping, g.num_reqs)
    gathered = [b.gpu[idx] for b in bt.block_tables]
    key = ("prepare_attn", g.num_reqs, local.num_reqs, nrp, len(gathered), *where(bt.num_blocks.gpu, *block_tables))

    def views(idx: Any, local_idx: Any, *rows: Any) -> dict[str, Any]:
        local_rows, local_stale = block_rows(bt, [t[:nrp] for t in block_tables], local_idx)
        global_rows, global_stale = block_rows(bt, list(rows), idx)
        return {"block_table_local": local_rows, "block_table_global": global_rows,
                "block_table_local_stale_tail": local_stale, "block_table_global_stale_tail": global_stale}

    rec.planned_put("target", key, [idx, pack.head(local.idx_mapping, local.num_reqs), *gathered], views=views)
