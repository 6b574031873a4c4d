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

Every input of the K draft forwards is known on the host once verification is done, so
they go to the device in one copy; the draft tokens stay on the device (each step feeds the
next) and reach the host only at the next step's batch building (``Worker``), without a
sync inside this step. In a decode step under graphs (``pcpviz.engine.decode_graphs``) the inputs
are padded to the step's ``DecodeShape`` and draft_0 and draft_1..K-1 are two graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pcpviz.reference.blocks import compute_slot_mappings
from pcpviz.reference.drafts import draft_decode_positions
from pcpviz.reference.drafts import draft_prefill_inputs as reference_prefill_inputs
from pcpviz.engine.attention import PagedAttention
from pcpviz.engine.dcp_attention import DCPRows, dcp_rows_of
from pcpviz.reference.dcp import draft_local_lens
from pcpviz import faults as F
from pcpviz.engine.decode_graphs import eagerly, pad

__all__ = ["propose", "draft_prefill_inputs"]


def _now_us() -> int:
    return time.perf_counter_ns() // 1000


def draft_prefill_inputs(batch, verify, next_prompt_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draft input ids int64[T], last_token_indices int64[R]) on the global batch: vLLM's
    ``prepare_prefill_inputs`` (``pcpviz.reference.drafts.draft_prefill_inputs``) fed with this
    step's verification; the last valid row takes the token just sampled, or the next prompt
    token of a partial prefill chunk."""
    sampled_last = np.array([s[-1] if len(s) else -1 for s in verify.sampled], dtype=np.int64)
    return reference_prefill_inputs(batch.input_ids, batch.query_start_loc, num_rejected=verify.num_rejected,
                                    num_sampled=verify.num_sampled, last_sampled=sampled_last,
                                    next_prompt_tokens=next_prompt_tokens)


def propose(worker, *, h, dev, hidden_local, verify, sched, rec) -> torch.Tensor:
    """Draft tokens int64[R, K] on the device. ``h``: the step's host inputs (``Worker``),
    ``dev``: the target's device inputs (reused by draft_0), ``hidden_local``: the target's
    rank-local hidden states."""
    timer, faults = worker.timer, worker.faults
    k, n = worker.cfg.num_speculative_tokens, worker.group.world_size
    batch, local, shape = h.batch, h.local, h.shape
    r = batch.num_reqs
    host = _host_inputs(worker, h, verify=verify, sched=sched)
    with timer.phase("h2d"):
        dt = worker.upload_inputs(("draft", shape), host.arrays)
    decode, block_rows = host.decode, host.block_rows

    # -- draft step 0: rank-local rows, gathered slot mapping -------------------------------
    calls = worker.group.ledger
    mark = len(calls) if calls is not None else 0
    t0 = _now_us()
    with timer.phase("draft_0"):
        tok0, h_last, mtp_local, hidden_in = worker.run_forward(
            ("draft_0", shape), lambda: _draft_prefill(worker, dev, dt, hidden_local=hidden_local, bounds=h.bounds,
                                                       host_lens=h.host_lens, hidden_rank_local=host.hidden_rank_local))
    t1 = _now_us()
    if rec is not None:
        with timer.phase("record"):
            rec.draft_prefill(local_ids=host.local_ids, local_positions=h.positions, local_seq_lens=h.seq_lens,
                              bt_local=h.bt_local, slots_gathered=h.slots_gathered, last_idx=host.read_idx,
                              tokens=tok0[:r], global_ids=host.draft_ids, t0=t0, t1=t1)
            if h.dcp_local_seq_lens is not None:
                rec.dcp("draft_0", local_lens=h.dcp_local_seq_lens, ranks_combined=worker.dcp_ranks_combined["draft_0"])
            p = local.num_tokens_padded
            rec.fingerprints("draft_0", hidden_in=hidden_in[:p], mtp_local=mtp_local[:p], hidden_last=h_last[:r])
            if calls is not None and eagerly(worker.graphs, ("draft_0", shape)):
                rec.collectives("draft_0", calls[mark:])
    if k <= 1:
        return tok0[:r, None]

    # -- draft steps 1..K-1: replicated, unexpanded slot mapping -----------------------------
    fold = F.FOLD_SLOT_MAPPING_WITHOUT_SHAPE_CHECK in faults
    bounds = [(1, shape.max_seq_len) if shape is not None else (1, int(s.max()) if s.size else 0)
              for s in decode["seq_lens"]]
    marks: list[int] = []
    call_marks: list[int] = []  # the ledger's length at each mark
    t0 = _now_us()
    with timer.phase("draft_k"):
        drafts, handed = worker.run_forward(
            ("draft_k", shape), lambda: _draft_decodes(worker, dt, tok0=tok0, h_last=h_last, k=k, bounds=bounds,
                                                       fold=fold, marks=marks, keep=rec is not None,
                                                       call_marks=call_marks))
    t1 = _now_us()
    if len(marks) != k:  # replayed from a graph: one window for every draft step
        marks = [t0] + [t1] * (k - 1)
    if rec is not None:
        with timer.phase("record"):
            _record_decodes(rec, decode, drafts, handed, block_rows=block_rows, marks=marks + [t1], r=r,
                            fold_n=n if fold else 1, ranks=worker.dcp_ranks_combined)
            if calls is not None and eagerly(worker.graphs, ("draft_k", shape)) and len(call_marks) == k:
                for j in range(1, k):
                    rec.collectives(f"draft_{j}", calls[call_marks[j - 1]:call_marks[j]])
    return drafts[:r]


@dataclass(frozen=True)
class _HostInputs:
    """Every draft forward's inputs on the host: draft_0's rank-local ids and the row each
    request's hidden state is read at, draft steps 1..K-1's positions, seq_lens and slots
    (``decode``, None at K <= 1), and the device arrays built from them."""

    draft_ids: np.ndarray  # int64[T]: draft_0's ids on the global batch
    local_ids: np.ndarray  # int64[P]: this rank's slice of them
    read_idx: np.ndarray  # int64[R]: the draft_0 output row of each request
    hidden_rank_local: bool
    decode: dict | None
    block_rows: np.ndarray | None  # int32[R, W]: what the draft decodes' attention reads
    arrays: dict


def _host_inputs(worker, h, *, verify, sched) -> _HostInputs:
    """The host inputs of every draft forward (``propose``), with the faults that change them."""
    cfg, faults, timer = worker.cfg, worker.faults, worker.timer
    k, n = cfg.num_speculative_tokens, worker.group.world_size
    batch, local, shape = h.batch, h.local, h.shape
    r = batch.num_reqs
    rows = shape.num_reqs if shape is not None else r  # draft decode rows (padded under graphs)
    next_prompt = _next_prompt_tokens(worker, sched)
    draft_ids, last_idx = draft_prefill_inputs(batch, verify, next_prompt)
    local_ids = draft_ids[local.gather_idx] if draft_ids.size else np.zeros(local.num_tokens_padded, np.int64)
    model_positions = h.positions
    if F.DRAFT_PREFILL_READS_CAPTURED_BUFFERS in faults and n > 1:
        # The draft prefill's captured graph reads the speculator's own buffers (global order,
        # written by prepare_prefill_inputs), not the rank-local batch handed to the model.
        p = local.num_tokens_padded
        local_ids = np.zeros(p, np.int64)
        model_positions = np.zeros(p, np.int64)
        m = min(p, draft_ids.shape[0])
        local_ids[:m] = draft_ids[:m]
        model_positions[:m] = batch.positions[:m]
    read_idx = last_idx
    hidden_rank_local = F.DRAFT_HIDDEN_RANK_LOCAL in faults and n > 1
    if hidden_rank_local:
        # The fault: the rank-local MTP output read at the global rows (clamped to the rank's).
        read_idx = np.minimum(last_idx, max(local.num_tokens_padded - 1, 0))
    arrays = {"ids": (local_ids, torch.int64), "positions": (model_positions, torch.int64),
              "read_idx": (pad(read_idx, rows), torch.int64)}
    decode = block_rows = None
    if k > 1:
        if F.SKIP_DRAFT_BLOCK_TABLE_GATHER not in faults:
            cap = F.STALE_ROWS_PER_LAUNCH if F.STALE_DRAFT_BLOCK_TABLE_ROWS in faults else None
            with timer.phase("gather"):
                worker._write_input_block_tables(h.table, batch.idx_mapping, max_rows=cap)
        block_rows = worker.input_block_tables[:r].copy()
        decode = _draft_decode_inputs(worker, batch, h.table, last_idx=last_idx, k=k, draft_ids=draft_ids)
        arrays.update({
            "block_rows": (pad(block_rows, rows), torch.int32),
            "dpos": (np.stack([pad(p, rows) for p in decode["positions"]]), torch.int64),
            "dseq": (np.stack([pad(s, rows) for s in decode["seq_lens"]]), torch.int64),
            "dslots": (np.stack([pad(s, rows, -1) for s in decode["slots"]]), torch.int64),
            "qsl": (np.arange(rows + 1, dtype=np.int64), torch.int64), **_stale_arrays(decode, rows),
        })
        if "local_lens" in decode:
            arrays["dlocal"] = (np.stack([pad(s, rows) for s in decode["local_lens"]]), torch.int64)
    return _HostInputs(draft_ids, local_ids, read_idx, hidden_rank_local, decode, block_rows, arrays)


def _record_decodes(rec, decode, drafts, handed, *, block_rows, marks, r, fold_n, ranks) -> None:
    """Record draft steps 1..K-1 (``marks[j-1]..marks[j]`` their windows) and the hidden states
    each read and handed on."""
    rec.fingerprints("draft_0", hidden_out=handed[0][:r])
    for j in range(1, drafts.shape[1]):
        written = decode["slots"][j - 1].copy()
        if fold_n > 1:
            written[r // fold_n:] = -1  # what the faulty fold actually wrote
        rec.draft_decode(step=j, ids=decode.get("stale_ids", drafts[:r, j - 1]), positions=decode["positions"][j - 1],
                         seq_lens=decode["seq_lens"][j - 1], block_rows=block_rows, slots=written,
                         tokens=drafts[:r, j], t0=marks[j - 1], t1=marks[j] if j < drafts.shape[1] - 1 else marks[-1])
        if "local_lens" in decode:
            rec.dcp(f"draft_{j}", local_lens=decode["local_lens"][j - 1], ranks_combined=ranks[f"draft_{j}"])
        rec.fingerprints(f"draft_{j}", hidden_in=handed[2 * j - 1][:r], hidden_out=handed[2 * j][:r])


def _next_prompt_tokens(worker, sched) -> np.ndarray:
    """int64[R]: the prompt token after each row's prefill chunk, from the request's prompt the
    worker keeps; -1 where the chunk ends the prompt, and on decode rows."""
    out = np.full(len(sched.rows), -1, dtype=np.int64)
    for i, row in enumerate(sched.rows):
        end = row.prompt_start + row.num_tokens
        if row.is_prefilling and end < row.prompt_len:
            out[i] = worker.states[row.req_id].prompt[end]
    return out


def _draft_decode_inputs(worker, batch, table, *, last_idx, k, draft_ids=None) -> dict[str, list[np.ndarray]]:
    """Positions, seq_lens and slots (int64[R] each) of draft steps 1..K-1."""
    model, cfg, faults = worker.model, worker.cfg, worker.faults
    r = batch.num_reqs
    steps = draft_decode_positions(batch.positions, last_idx, k)  # int64[K-1, R]
    if F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION in faults and r:
        # The fault: the drafter's own cursor, ahead by every rejection so far (kept inside the
        # model's context so RoPE and the block table can still be indexed).
        drift = np.array([worker.draft_drift.get(rid, 0) for rid in batch.req_ids], dtype=np.int64)
        limit = model.config.max_position_embeddings - k - 1
        first = steps[0] - 1
        steps = np.minimum(first + drift, np.maximum(first, limit))[None, :] + (steps - first[None, :])
    qsl = np.arange(r + 1, dtype=np.int64)
    out: dict[str, list[np.ndarray]] = {"positions": [], "seq_lens": [], "slots": []}
    for positions in steps:
        # Slots come from the persistent block tables by request slot (always right);
        # attention reads input_block_tables (wrong when the gather was skipped).
        slots = compute_slot_mappings(table, cfg.block_size, batch.idx_mapping, query_start_loc=qsl,
                                      positions=positions, **worker.dcp_kw())[0]
        if F.DRAFT_SLOT_FROM_SEQ_LEN in faults and r:
            # The fault: the block from seq_len // block_size; one slot before a block boundary
            # that is the next block (the null block when it is not allocated yet).
            blocks = table[batch.idx_mapping, np.minimum((positions + 1) // cfg.block_size, table.shape[1] - 1)]
            slots = blocks.astype(np.int64) * cfg.block_size + positions % cfg.block_size
        worker.check_slots(slots)
        out["positions"].append(positions)
        out["seq_lens"].append(positions + 1)
        out["slots"].append(slots)
        if cfg.dcp > 1:  # this rank's local_len of the draft decode (vllm#50391)
            lens = draft_local_lens(positions, dcp_size=cfg.dcp, interleave=cfg.dcp_interleave)[worker.rank]
            out.setdefault("local_lens", []).append(lens.astype(np.int64))
    if F.DRAFT_DECODES_READ_PREFILL_BATCH in faults and worker.group.world_size > 1 and r \
            and not batch.is_prefilling.any() and draft_ids is not None:
        # The fault, on a decode-only step (where vLLM's draft prefill can replay a FULL graph): each
        # draft decode is fed the first R rows of the draft prefill's batch, which with replicated
        # decodes (the case where every rank's local batch is uniform) is the global decode rows.
        out["stale_ids"] = np.resize(draft_ids, r) if draft_ids.shape[0] < r else draft_ids[:r].copy()
        out["stale_positions"] = np.resize(batch.positions, r) if batch.positions.shape[0] < r \
            else batch.positions[:r].copy()
    return out


def _draft_prefill(worker, d, dt, *, hidden_local, bounds, hidden_rank_local, host_lens=None):
    """The MTP layer on the rank-local rows -> (draft token 0 int64[R'], its hidden [R', H])."""
    model = worker.model
    attn = PagedAttention(model, worker.cache, worker.group, expanded=True, slots=d["slots"],
                          block_rows=d["block_rows"], query_start_loc=d["qsl"], positions=d["positions"],
                          seq_lens=d["seq_lens"], bounds=bounds, slots_checked=True, host_lens=host_lens,
                          dcp=dcp_rows_of(d), index_cache=worker.index_cache)
    with torch.no_grad():
        hidden_in = hidden_local  # [P, H]: the target's rank-local rows, what the MTP layer reads
        mtp_local = model.mtp_forward(dt["ids"], dt["positions"], hidden_in, attn=attn)
        if hidden_rank_local:
            h_last = mtp_local[dt["read_idx"]]
        else:
            h_last = worker.group.all_gather(mtp_local)[d["restore"]][dt["read_idx"]]  # [R', H]
        worker.dcp_ranks_combined["draft_0"] = min(attn.dcp_ranks, default=1)
        return model.mtp_logits(h_last).argmax(-1), h_last, mtp_local, hidden_in


def _stale_arrays(decode: dict, rows: int) -> dict[str, tuple[np.ndarray, torch.dtype]]:
    """The device inputs of ``draft_decodes_read_prefill_batch`` (none without the fault)."""
    if "stale_ids" not in decode:
        return {}
    return {"stale_ids": (pad(decode["stale_ids"], rows), torch.int64),
            "stale_positions": (pad(decode["stale_positions"], rows), torch.int64)}


def _draft_decodes(worker, dt, *, tok0, h_last, k, bounds, fold, marks, keep=False, call_marks=None):
    """Draft steps 1..K-1, each feeding the next on the device -> (int64[R', K], the hidden
    states when ``keep``, else None): ``handed[0]`` what draft_0 hands to draft_1, then per step
    j what it read (``handed[2j - 1]``) and handed on (``handed[2j]``); a step must read
    exactly what the one before handed on."""
    model = worker.model
    calls = worker.group.ledger
    marks.append(_now_us())
    if call_marks is not None and calls is not None:
        call_marks.append(len(calls))
    with torch.no_grad():
        hidden = model.mtp_recycle_hidden(h_last)
        # what each step hands on, computed from its own output (not from what the next step is fed)
        handed = [model.mtp_recycle_hidden(h_last)] if keep else None
        ids, cols = tok0, [tok0]
        for j in range(1, k):
            attn = PagedAttention(model, worker.cache, worker.group, expanded=False, slots=dt["dslots"][j - 1],
                                  block_rows=dt["block_rows"], query_start_loc=dt["qsl"],
                                  positions=dt["dpos"][j - 1], seq_lens=dt["dseq"][j - 1],
                                  fold_without_shape_check=fold, bounds=bounds[j - 1], slots_checked=True,
                                  dcp=_decode_dcp_rows(dt, j), index_cache=worker.index_cache)
            if keep:
                handed.append(hidden)  # what step j reads (== handed[j - 1] unless a hand-off broke)
            # the fault draft_decodes_read_prefill_batch: every step fed the draft prefill's first rows
            inputs = (dt["stale_ids"], dt["stale_positions"]) if "stale_ids" in dt else (ids, dt["dpos"][j - 1])
            mtp_h = model.mtp_forward(*inputs, hidden, attn=attn)
            ids = model.mtp_logits(mtp_h).argmax(-1)
            hidden = model.mtp_recycle_hidden(mtp_h)
            if keep:
                handed.append(model.mtp_recycle_hidden(mtp_h))
            cols.append(ids)
            worker.dcp_ranks_combined[f"draft_{j}"] = min(attn.dcp_ranks, default=1)
            marks.append(_now_us())
            if call_marks is not None and calls is not None:
                call_marks.append(len(calls))
        return torch.stack(cols, dim=1), handed


def _decode_dcp_rows(dt: dict, j: int) -> DCPRows | None:
    """Draft step j's ``DCPRows`` (every rank the same rows; this rank's local_len), None without DCP."""
    if "dlocal" not in dt:
        return None
    return DCPRows(block_rows=dt["block_rows"], query_start_loc=dt["qsl"], local_q_lens=dt["dlocal"][j - 1],
                   local_seq_lens=dt["dlocal"][j - 1], gather_queries=False)

