"""MTP drafting under PCP (vLLM's ``TargetDependentARSpeculator.propose``).

Draft step 0 (the *draft prefill*) reuses the target's rank-local batch: the
global draft ids (target ids shifted left by one, the last valid row taking the
token just sampled) are gathered with the rank's ``padded_gather_idx`` slice, the
MTP layer runs on the local rows with the target's local hidden states and the
*gathered* slot mapping (its KV is all-gathered like the target's), and its
output is restored to global order. Then the block tables are gathered back to
global order and draft steps 1..K-1 run replicated on every rank: one row per
request, positions advancing by one, an *unexpanded* slot mapping of length R.

PCP=2, K=3 example for a decode d0 (4 rows at positions 20..23, 1 draft
rejected) and rank 0 holding it::

    draft ids (global)   d0: [t21, t22, s23', ·]      last valid row index 2 (position 22)
    draft_0  rank-local  rows of rank 0 only; hidden restored -> draft token 0 at row 2
    gather               input_block_tables[:R] = global rows
    draft_1  replicated  positions [23], seq_lens [24], slots [slot(d0, 23)]
    draft_2  replicated  positions [24], seq_lens [25]
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pcpviz import faults as F
from pcpviz.blocks import compute_slot_mappings, gather_block_table_rows
from pcpviz.engine.attention import PagedAttention

__all__ = ["propose", "draft_prefill_inputs"]


def draft_prefill_inputs(batch, verify, next_prompt_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draft input ids int64[T], last_token_indices int64[R]) on the global batch.

    vLLM's ``prepare_prefill_inputs``: row j of request i takes the target id of
    row j+1 within its ``q - num_rejected`` valid rows; the last valid row takes
    the token just sampled, or the next prompt token of a partial prefill chunk.
    Rows past the valid ones keep stale ids (here: the shifted ids) — they are
    never read.
    """
    ids = batch.input_ids
    qsl = batch.query_start_loc
    out = np.empty_like(ids)
    if ids.size:
        out[:-1] = ids[1:]
        out[-1] = ids[-1]
    last = np.zeros(batch.num_reqs, dtype=np.int64)
    for i in range(batch.num_reqs):
        valid = int(batch.num_scheduled_tokens[i]) - int(verify.num_rejected[i])
        j = int(qsl[i]) + valid - 1
        last[i] = j
        if valid <= 0:
            continue
        out[j] = verify.sampled[i][-1] if verify.num_sampled[i] > 0 else next_prompt_tokens[i]
    return out, last


def _t(a, device, dtype=torch.int64):
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)


def propose(worker, batch, layout, local, local_positions, local_seq_lens, bt_local, table,
            slots_gathered, hidden_local, verify, sched, rec) -> np.ndarray:
    """Returns draft tokens int64[R, K]."""
    model, group, cfg, dev = worker.model, worker.group, worker.cfg, worker.device
    k = cfg.num_speculative_tokens
    n = group.world_size
    r = batch.num_reqs
    mtp_layer = model.config.num_layers
    next_prompt = np.array([row.next_prompt_token for row in sched.rows], dtype=np.int64)
    draft_ids, last_idx = draft_prefill_inputs(batch, verify, next_prompt)
    drafts = np.zeros((r, k), dtype=np.int64)

    # -- draft step 0: rank-local rows, gathered slot mapping -------------------------------
    t0 = time.perf_counter_ns() // 1000
    local_ids = draft_ids[local.gather_idx] if draft_ids.size else np.zeros(local.num_tokens_padded, np.int64)
    model_positions = local_positions
    if F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS in worker.faults and n > 1:
        # The draft prefill's captured graph reads the speculator's own buffers (global order,
        # written by prepare_prefill_inputs), not the rank-local batch handed to the model.
        p = local.num_tokens_padded
        local_ids = np.zeros(p, np.int64)
        model_positions = np.zeros(p, np.int64)
        m = min(p, draft_ids.shape[0])
        local_ids[:m] = draft_ids[:m]
        model_positions[:m] = batch.positions[:m]
    attn = PagedAttention(
        model, worker.cache, group, expanded=True, slots=_t(slots_gathered[0], dev),
        block_rows=_t(bt_local, dev, torch.int32), query_start_loc=_t(local.query_start_loc, dev),
        positions=_t(local_positions, dev), seq_lens=_t(local_seq_lens, dev),
    )
    with torch.no_grad():
        mtp_local = model.mtp_forward(_t(local_ids, dev), _t(model_positions, dev), hidden_local, attn)
        mtp_global = group.all_gather(mtp_local)[_t(layout.hidden_restore_idx, dev)]  # [T, H]
        read_idx = last_idx
        if F.DRAFT_HIDDEN_RANK_LOCAL in worker.faults and n > 1:
            # The fault: the rank-local MTP output read at the global rows (clamped to the rank's).
            read_idx = np.minimum(last_idx, max(local.num_tokens_padded - 1, 0))
            h_last = mtp_local[_t(read_idx, dev)]
        else:
            h_last = mtp_global[_t(last_idx, dev)]
        drafts[:, 0] = model.mtp_logits(h_last).argmax(-1).cpu().numpy() if r else []
    t1 = time.perf_counter_ns() // 1000
    if rec is not None:
        rec.draft_prefill(local_ids, local_positions, local_seq_lens, bt_local, slots_gathered,
                          read_idx, drafts[:, 0], draft_ids, t0, t1)
    if k <= 1:
        return drafts

    # -- gather block tables back to global order (the PR's fix) ----------------------------
    if F.SKIP_DRAFT_BLOCK_TABLE_GATHER not in worker.faults:
        cap = F.STALE_ROWS_PER_LAUNCH if F.STALE_DRAFT_BLOCK_TABLE_ROWS in worker.faults else None
        worker._write_input_block_tables(table, batch.idx_mapping, max_rows=cap)
    block_rows = worker.input_block_tables[:r].copy()

    # -- draft steps 1..K-1: replicated, unexpanded slot mapping -----------------------------
    positions = batch.positions[last_idx].copy() if r else np.zeros(0, np.int64)
    if F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION in worker.faults and r:
        # The fault: the drafter's own cursor, ahead by every rejection so far (kept inside the
        # model's context so RoPE and the block table can still be indexed).
        drift = np.array([worker.draft_drift.get(rid, 0) for rid in batch.req_ids], dtype=np.int64)
        limit = model.config.max_position_embeddings - k - 1
        positions = np.minimum(positions + drift, np.maximum(positions, limit))
    hidden = model.mtp_recycle_hidden(h_last)
    ids = drafts[:, 0].copy()
    qsl = np.arange(r + 1, dtype=np.int64)
    for step in range(1, k):
        t0 = time.perf_counter_ns() // 1000
        positions = positions + 1
        seq_lens = positions + 1
        # Slots come from the persistent block tables by request slot (always right);
        # attention reads input_block_tables (wrong when the gather was skipped).
        slots = compute_slot_mappings(table, cfg.block_size, batch.idx_mapping, qsl, positions)[0]
        if F.DRAFT_SLOT_FROM_SEQ_LEN in worker.faults and r:
            # The fault: the block from seq_len // block_size; one slot before a block boundary
            # that is the next block (the null block when it is not allocated yet).
            blocks = table[batch.idx_mapping, np.minimum((positions + 1) // cfg.block_size, table.shape[1] - 1)]
            slots = blocks.astype(np.int64) * cfg.block_size + positions % cfg.block_size
        attn = PagedAttention(
            model, worker.cache, group, expanded=False, slots=_t(slots, dev),
            block_rows=_t(block_rows, dev, torch.int32), query_start_loc=_t(qsl, dev),
            positions=_t(positions, dev), seq_lens=_t(seq_lens, dev),
            fold_without_shape_check=F.FOLD_SLOT_MAPPING_WITHOUT_SHAPE_CHECK in worker.faults,
        )
        with torch.no_grad():
            mtp_h = model.mtp_forward(_t(ids, dev), _t(positions, dev), hidden, attn)
            nxt = model.mtp_logits(mtp_h).argmax(-1).cpu().numpy()
            hidden = model.mtp_recycle_hidden(mtp_h)
        drafts[:, step] = nxt
        t1 = time.perf_counter_ns() // 1000
        if rec is not None:
            written = slots.copy()
            if attn.fold_without_shape_check and n > 1:
                written[r // n :] = -1  # what the faulty fold actually wrote
            rec.draft_decode(step, ids, positions, seq_lens, block_rows, written, nxt, t0, t1)
        ids = nxt.astype(np.int64)
    return drafts
