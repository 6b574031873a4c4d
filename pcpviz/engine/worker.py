"""One PCP rank's model runner: the vLLM 0.33.0 MRv2 data path of one step.

    prepare_inputs     global batch from this rank's request states (GPU cursor positions)
    partition_batch    plan_layout + the rank-local DualChunkSwap batch
    prepare_attn       local block-table rows; global -> gathered slot mapping
    target forward     local rows; KV all-gathered and written by the gathered mapping
    restore_for_sampling  all-gather hidden states, hidden_restore_idx -> global order
    sample + verify    greedy rejection on the global batch (identical on every rank)
    propose (MTP)      draft step 0 rank-local, block-table gather, steps 1..K-1 replicated

PCP=2 worked example (K=2, block_size 16), a decode d0 with 2 drafts at position 20
and a fresh 9-token prefill p1; rank 0 of 2::

    global rows      d0[20,21,22]   p1[0..8]            T = 12
    layout           rank 0: d0, p1[0:3], p1[9:9]->empty  rank 1: p1[3:6], p1[6:9]
    target           rank 0 computes 6 tokens, rank 1 6; KV of all 12 lands on both ranks
    verify           d0 accepts a drafts, samples a+1 tokens; p1 samples its first token
    draft_0          rank-local rows again (MTP layer), hidden restored to the 12 global rows
    gather           input_block_tables[:2] = rows of d0, p1 (global order)
    draft_1          2 rows on every rank, unexpanded slot mapping of length 2
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pcpviz import faults as F
from pcpviz.batch import GlobalBatch
from pcpviz.blocks import (
    BlockTable,
    compute_slot_mappings,
    gather_block_table_rows,
    gathered_slot_mapping,
)
from pcpviz.engine.attention import PagedAttention
from pcpviz.engine.dist import PCPGroup
from pcpviz.engine.kv_cache import LatentKVCache
from pcpviz.engine.record import StepRecord
from pcpviz.engine.scheduler import SchedulerOutput
from pcpviz.layout import partition_batch, plan_layout

__all__ = ["EngineConfig", "RequestState", "Worker", "StepResult"]


@dataclass(frozen=True)
class EngineConfig:
    pcp: int
    num_speculative_tokens: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    shard_decode_requests: bool | None = None  # None: vLLM's default (True when DCP == 1)
    faults: frozenset[str] = frozenset()
    dtype: torch.dtype = torch.float32  # the model's and the latent KV cache's


@dataclass
class RequestState:
    """What a worker keeps per request (vLLM's RequestState on the GPU)."""

    slot: int
    prompt_len: int
    num_computed: int = 0  # GPU cursor: corrected by rejections immediately
    cpu_lag: int = 0  # how far the optimistic CPU mirror runs ahead (last step's rejections)
    last_sampled: int = -1
    drafts: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    per_request: dict[str, tuple[list[int], int]]  # req_id -> (sampled tokens, num_rejected)
    num_accepted: np.ndarray  # int64[R]: drafts accepted per request (pcpviz.acceptance.count)
    num_draft_tokens: np.ndarray  # int64[R]: drafts verified per request
    record: StepRecord | None


def _now_us() -> int:
    return time.perf_counter_ns() // 1000


class Worker:
    def __init__(self, model, group: PCPGroup, cfg: EngineConfig, device: torch.device,
                 record: bool = False) -> None:
        self.model = model
        self.group = group
        self.cfg = cfg
        self.device = device
        self.rank = group.rank
        self.record = record
        mc = model.config
        width = -(-(mc.max_position_embeddings + cfg.num_speculative_tokens) // cfg.block_size)
        self.table = BlockTable(cfg.max_num_seqs, width)
        # vLLM's BlockTables.input_block_tables: the rows attention reads. Under PCP the
        # target writes its own local tables, so only the drafter's gather refreshes these.
        self.input_block_tables = np.zeros((cfg.max_num_seqs, width), dtype=np.int32)
        self._dirty_rows = 0
        num_cache_layers = mc.num_layers + (1 if cfg.num_speculative_tokens > 0 else 0)
        self.cache = LatentKVCache(num_cache_layers, cfg.num_blocks, cfg.block_size, mc.kv_lora_rank,
                                   mc.qk_rope_head_dim, cfg.dtype, device)
        self.states: dict[str, RequestState] = {}
        self._fault_specs = cfg.faults  # NAME or NAME@STEP (pcpviz.faults.parse_fault)
        self.faults: frozenset[str] = frozenset()  # the names active at the current step
        # draft_cursor_drift_after_rejection: how far each request's drafter cursor runs ahead
        self.draft_drift: dict[str, int] = {}

    # ------------------------------------------------------------------------------ inputs
    def _apply_scheduler_output(self, sched: SchedulerOutput) -> None:
        for req_id, slot in sched.finished:
            self.states.pop(req_id, None)
            self.draft_drift.pop(req_id, None)
            self.table.clear(slot)
        for row in sched.rows:
            if row.is_new:
                self.states[row.req_id] = RequestState(slot=row.slot, prompt_len=row.prompt_len)
            if row.new_blocks:
                self.table.append(row.slot, row.new_blocks)

    def _global_batch(self, sched: SchedulerOutput) -> tuple[GlobalBatch, np.ndarray, np.ndarray]:
        ids, pos, q, cpu, plen, pref, slots, ndraft = [], [], [], [], [], [], [], []
        for row in sched.rows:
            st = self.states[row.req_id]
            if row.is_prefilling:
                toks = list(row.prompt_chunk)
                drafts = 0
            else:
                drafts = row.num_tokens - 1
                toks = [st.last_sampled] + st.drafts[:drafts]
                if len(toks) != row.num_tokens:
                    raise RuntimeError(f"rank {self.rank}: {row.req_id} has {len(st.drafts)} drafts, "
                                       f"scheduled {row.num_tokens} tokens")
            ids += toks
            pos += range(st.num_computed, st.num_computed + row.num_tokens)
            q.append(row.num_tokens)
            cpu.append(st.num_computed + st.cpu_lag)
            plen.append(row.prompt_len)
            pref.append(row.is_prefilling)
            slots.append(st.slot)
            ndraft.append(drafts)
        batch = GlobalBatch(
            req_ids=tuple(r.req_id for r in sched.rows),
            idx_mapping=np.array(slots, dtype=np.int64),
            num_scheduled_tokens=np.array(q, dtype=np.int64),
            num_computed_tokens=np.array(cpu, dtype=np.int64),
            positions=np.array(pos, dtype=np.int64),
            input_ids=np.array(ids, dtype=np.int64),
            prefill_len=np.array(plen, dtype=np.int64),
            is_prefilling=np.array(pref, dtype=np.bool_),
        )
        qsl = batch.query_start_loc
        # the last 1 + n_draft rows of each request are sampled
        logits_indices = np.concatenate(
            [np.arange(qsl[i + 1] - 1 - d, qsl[i + 1]) for i, d in enumerate(ndraft)] or [[]]
        ).astype(np.int64)
        return batch, logits_indices, np.array(ndraft, dtype=np.int64)

    # ------------------------------------------------------------------------------ the step
    def step(self, sched: SchedulerOutput) -> StepResult:
        cfg, n, rank = self.cfg, self.group.world_size, self.rank
        rec = StepRecord(sched.step, rank) if self.record else None
        if self._fault_specs:
            from pcpviz.faults import active_faults

            self.faults = active_faults(self._fault_specs, sched.step)
        self._apply_scheduler_output(sched)
        t0 = _now_us()
        batch, logits_indices, num_draft = self._global_batch(sched)
        layout = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, n,
                             shard_decode_requests=cfg.shard_decode_requests)
        local = partition_batch(batch, rank, n, layout=layout)
        local_positions = local.positions
        if F.POSITIONS_FROM_CPU_CURSOR in self.faults:
            local_positions = _positions_from_cpu_cursor(local)
            local_seq_lens = local.seq_lens.copy()
            ends = local.query_start_loc[1 : local.num_reqs + 1] - 1
            if local.num_tokens:
                local_seq_lens[: local.num_reqs] = local_positions[ends] + 1
        else:
            local_seq_lens = local.seq_lens

        table = self.table.as_array()
        bt_local = gather_block_table_rows(table, local.idx_mapping, local.num_reqs_padded)
        qsl = batch.query_start_loc
        slots_global = compute_slot_mappings(table, cfg.block_size, batch.idx_mapping, qsl, batch.positions)
        slots_gathered = gathered_slot_mapping(slots_global, layout)
        if n == 1:
            # Without PCP the target's gather writes the shared input block tables.
            self._write_input_block_tables(table, batch.idx_mapping)

        dev = self.device
        t = lambda a, dt=torch.int64: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=dev)  # noqa: E731
        attn = PagedAttention(
            self.model, self.cache, self.group, expanded=True, slots=t(slots_gathered[0]),
            block_rows=t(bt_local, torch.int32), query_start_loc=t(local.query_start_loc),
            positions=t(local_positions), seq_lens=t(local_seq_lens),
        )
        ids_local = t(local.input_ids)
        pos_local = t(local_positions)
        with torch.no_grad():
            hidden_local = self.model.forward_hidden(ids_local, pos_local, attn)  # [P, H]
            restore_idx = t(layout.hidden_restore_idx)
            hidden_global = self.group.all_gather(hidden_local)[restore_idx]  # [T, H]
            if F.SAMPLE_LOCAL_LOGITS in self.faults:
                rows = np.minimum(logits_indices, max(local.num_tokens_padded - 1, 0))
                sample_hidden = hidden_local[t(rows)]
            else:
                rows = logits_indices
                sample_hidden = hidden_global[t(logits_indices)]
            targets = self.model.logits(sample_hidden).argmax(-1).cpu().numpy()
        t1 = _now_us()
        if rec is not None:
            rec.target(batch, logits_indices, layout, local, local_positions, local_seq_lens, bt_local,
                       table, slots_global, slots_gathered, rows,
                       "local" if F.SAMPLE_LOCAL_LOGITS in self.faults else "global",
                       targets, hidden_global, t0, t1)

        verify = self._verify(sched, batch, num_draft, targets)
        t2 = _now_us()
        if rec is not None:
            rec.verify(batch.req_ids, num_draft, verify, cfg.num_speculative_tokens, t1, t2)

        if cfg.num_speculative_tokens > 0:
            from pcpviz.engine.speculator import propose

            drafts = propose(self, batch, layout, local, local_positions, local_seq_lens, bt_local,
                             table, slots_gathered, hidden_local, verify, sched, rec)
            for i, req_id in enumerate(batch.req_ids):
                st = self.states[req_id]
                st.drafts = [] if verify.num_sampled[i] == 0 else [int(x) for x in drafts[i]]
        per_request = {
            rid: (verify.sampled[i], int(verify.num_rejected[i])) for i, rid in enumerate(batch.req_ids)
        }
        return StepResult(per_request, verify.num_accepted.astype(np.int64), num_draft.astype(np.int64), rec)

    # ------------------------------------------------------------------------------ helpers
    def _write_input_block_tables(self, table: np.ndarray, idx_mapping: np.ndarray,
                                  max_rows: int | None = None) -> None:
        """``BlockTables.gather_block_tables(idx_mapping, R)`` with out=None: rows of the batch in
        global order, and rows left by a larger earlier batch cleared. ``max_rows`` (the fault
        ``stale_draft_block_table_rows``): one launch writes only that many rows; the rest of
        the buffer keeps what it held."""
        r = idx_mapping.shape[0]
        rows = gather_block_table_rows(table, idx_mapping, max(r, self._dirty_rows))
        if max_rows is not None:
            rows = rows[:max_rows]
        self.input_block_tables[: rows.shape[0]] = rows
        self._dirty_rows = r if max_rows is None else min(r, max_rows)

    def _verify(self, sched, batch, num_draft, targets):
        from pcpviz.engine.verify import greedy_verify

        divergent = F.RANK_DIVERGENT_ACCEPTANCE in self.faults and self.rank != 0
        v = greedy_verify(batch, num_draft, targets, self.states, self.cfg.num_speculative_tokens,
                          accept_one_less=divergent)
        for i, req_id in enumerate(batch.req_ids):
            st = self.states[req_id]
            st.num_computed += int(batch.num_scheduled_tokens[i]) - int(v.num_rejected[i])
            st.cpu_lag = int(v.num_rejected[i])
            if F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION in self.faults:
                self.draft_drift[req_id] = self.draft_drift.get(req_id, 0) + int(v.num_rejected[i])
            if v.num_sampled[i] > 0:
                st.last_sampled = int(v.sampled[i][-1])
        return v


def _positions_from_cpu_cursor(local) -> np.ndarray:
    """The fault: positions = CPU cursor + offset inside the request, per local row."""
    pos = np.zeros_like(local.positions)
    qsl = local.query_start_loc
    for i in range(local.num_reqs):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        pos[lo:hi] = int(local.num_computed_tokens[i]) + np.arange(hi - lo)
    return pos
