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

What runs on the host and what on the device: batch building is NumPy on the host; each
step's inputs go to the device in one pinned, non-blocking copy (``pcpviz.engine.inputs``);
the only sync inside a step is the sampled tokens' copy to the host (vLLM has it too: the
scheduler needs them). Draft tokens stay on the device and come back with a non-blocking
copy that the *next* step waits for when it builds its batch. Decode steps can be replayed
from CUDA graphs (``EngineConfig.cuda_graphs``; ``pcpviz.engine.decode_graphs``), and every phase
can be timed (``pcpviz.engine.phase_timer``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pcpviz import faults as F
from pcpviz.reference.batch import GlobalBatch, LocalBatch
from pcpviz.reference.blocks import BlockTable, compute_slot_mappings, gather_block_table_rows, gathered_slot_mapping
from pcpviz.engine.attention import PagedAttention
from pcpviz.engine.dcp_attention import dcp_rows_of, dcp_step_inputs
from pcpviz.reference.dcp import dcp_owner
from pcpviz.engine.dist import PCPGroup
from pcpviz.engine.decode_graphs import DecodeShape, GraphRunner, decode_shape, eagerly, pad
from pcpviz.engine.inputs import Uploader
from pcpviz.engine.kv_cache import LatentKVCache
from pcpviz.engine.phase_timer import PhaseTimer
from pcpviz.engine.record import StepRecord, kept_drafts
from pcpviz.engine.scheduler import SchedulerOutput
from pcpviz.reference.layout import PCPLayout, partition_batch, plan_layout

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
    # Decode steps padded to a bucket and replayed from CUDA graphs. None: on for CUDA at PCP=1,
    # off otherwise (at PCP=2 on 2 x H200 the one run with graphs produced every token and then
    # never returned; the likely cause, pytorch/pytorch#115388 -- destroying an NCCL group while
    # graphs that captured its collectives are alive hangs -- is now avoided by resetting every
    # graph first (GraphRunner.release), but that is untested on GPU, so PCP > 1 takes graphs
    # only when asked); True on the CPU runs the same padded buffers without capture (the
    # tests' way of checking the graph path's bookkeeping); False: the unpadded eager path.
    cuda_graphs: bool | None = None
    dcp: int = 1  # the engine's own DCP (pcpviz.engine.dcp_attention): 1, or pcp (DCP group = PCP group)
    dcp_interleave: int = 1


def compile_by_default(device: torch.device) -> bool:
    """The decode graphs' model code through ``torch.compile`` (``PCPVIZ_COMPILE``: "1" on,
    "0" off; default on for CUDA captures)."""
    flag = os.environ.get("PCPVIZ_COMPILE", "").strip()
    return flag == "1" if flag in ("0", "1") else device.type == "cuda"


def graphs_by_default(device: torch.device, pcp: int) -> bool:
    """``EngineConfig.cuda_graphs=None``: CUDA graphs on CUDA at PCP=1 only (see the field)."""
    return device.type == "cuda" and pcp == 1


@dataclass
class RequestState:
    """What a worker keeps per request (vLLM's RequestState on the GPU)."""

    slot: int
    prompt: np.ndarray  # int64[prompt_len]: sent once, on the request's first row
    num_computed: int = 0  # GPU cursor: corrected by rejections immediately
    cpu_lag: int = 0  # how far the optimistic CPU mirror runs ahead (last step's rejections)
    last_sampled: int = -1
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64[K] or empty

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])


@dataclass
class StepResult:
    per_request: dict[str, tuple[list[int], int]]  # req_id -> (sampled tokens, num_rejected)
    num_accepted: np.ndarray  # int64[R]: drafts accepted per request (pcpviz.trace.acceptance.count)
    num_draft_tokens: np.ndarray  # int64[R]: drafts verified per request
    record: StepRecord | None


@dataclass(frozen=True)
class StepInputs:
    """One step's host-side inputs (what the target and the drafter read), built by
    ``Worker.prepare``; under graphs padded to ``shape`` (None: unpadded)."""

    batch: GlobalBatch
    logits_indices: np.ndarray  # int64[S]: global rows sampled
    num_draft: np.ndarray  # int64[R]
    layout: PCPLayout
    local: LocalBatch
    positions: np.ndarray  # int64[P]: local positions (the fault positions_from_cpu_cursor rewrites them)
    seq_lens: np.ndarray  # int[R_loc_pad]
    table: np.ndarray  # int32[max_num_seqs, W]
    bt_local: np.ndarray  # int32[R_loc_pad, W]
    slots_global: np.ndarray  # int64[1, T]
    slots_gathered: np.ndarray  # int64[1, N*P]
    sample_rows: np.ndarray  # int64[S]: rows of the hidden states sampled (global, or local under a fault)
    shape: DecodeShape | None
    bounds: tuple[int, int]  # (max query len, max seq len) of the target forward
    # (query_start_loc int64[B+1], seq_lens int64[B]) of the rank-local rows on the host, for the
    # kernels' decode/prefill row split (None on the decode-graph path: every row is short)
    host_lens: tuple[np.ndarray, np.ndarray] | None = None
    dcp_rows: dict | None = None  # DCP > 1: every rank's rows, this rank's local lengths (dcp_rows_host)
    dcp_local_seq_lens: np.ndarray | None = None  # int64[r]: this rank's share of its local rows' seq_lens


def _now_us() -> int:
    return time.perf_counter_ns() // 1000


class Worker:
    def __init__(self, model, group: PCPGroup, cfg: EngineConfig, device: torch.device,
                 record: bool = False, timer: PhaseTimer | None = None) -> None:
        self.model = model
        self.group = group
        self.cfg = cfg
        self.device = device
        self.rank = group.rank
        self.record = record
        self.timer = timer or PhaseTimer(False)
        group.timer = self.timer if self.timer else None
        mc = model.config
        width = -(-(mc.max_position_embeddings + cfg.num_speculative_tokens) // cfg.block_size)
        self.table = BlockTable(cfg.max_num_seqs, width)
        # The dense table (BlockTable.as_array()), kept up to date as blocks come and go.
        self._table = np.zeros((cfg.max_num_seqs, width), dtype=np.int32)
        # vLLM's BlockTables.input_block_tables: the rows attention reads. Under PCP the
        # target writes its own local tables, so only the drafter's gather refreshes these.
        self.input_block_tables = np.zeros((cfg.max_num_seqs, width), dtype=np.int32)
        self._dirty_rows = 0
        num_cache_layers = mc.num_layers + (1 if cfg.num_speculative_tokens > 0 else 0)
        self.cache = LatentKVCache(num_cache_layers, cfg.num_blocks, cfg.block_size, mc.kv_lora_rank,
                                   mc.qk_rope_head_dim, cfg.dtype, device)
        self.index_cache = LatentKVCache(num_cache_layers, cfg.num_blocks, cfg.block_size, mc.index_head_dim, 0,
                                         cfg.dtype, device) if mc.is_sparse else None  # DSA: indexer keys
        self.states: dict[str, RequestState] = {}
        self._fault_specs = cfg.faults  # NAME or NAME@STEP (pcpviz.faults.parse_fault)
        self.faults: frozenset[str] = frozenset()  # the names active at the current step
        # draft_cursor_drift_after_rejection: how far each request's drafter cursor runs ahead
        self.draft_drift: dict[str, int] = {}
        self.uploader = Uploader(device)
        graphs = (cfg.cuda_graphs if cfg.cuda_graphs is not None else graphs_by_default(device, cfg.pcp)) \
            and not mc.is_sparse  # the sparse attention (sparse_attention.py) loops on the host: eager only
        self.graphs = GraphRunner("capture" if device.type == "cuda" else "eager", device) if graphs else None
        if self.graphs is not None:
            self.graphs.timer = self.timer if self.timer else None
        # The decode graphs' forwards through torch.compile'd regions (``TinyDSV3.compile_regions``)
        self.compiled = self.graphs is not None and compile_by_default(device)
        if self.compiled:
            model.compile_regions()
        self._pending_drafts = None  # (host int64[R, K], event, req_ids, keep bool[R]) of the last step
        self._layouts: dict[tuple, PCPLayout] = {}  # decode-only steps' layouts (Worker._plan)
        self.dcp_ranks_combined: dict[str, int] = {}  # DCP > 1: partial results combined, per draft phase

    # ------------------------------------------------------------------------------ inputs
    def _apply_scheduler_output(self, sched: SchedulerOutput) -> None:
        for req_id, slot in sched.finished:
            self.states.pop(req_id, None)
            self.draft_drift.pop(req_id, None)
            self.table.clear(slot)
            self._table[slot] = 0
        for row in sched.rows:
            if row.is_new:
                if row.prompt_token_ids is None:
                    raise RuntimeError(f"rank {self.rank}: new request {row.req_id} arrived without its prompt")
                self.states[row.req_id] = RequestState(slot=row.slot, prompt=row.prompt_token_ids)
            if row.new_blocks:
                start = self.table.num_blocks(row.slot)
                self.table.append(row.slot, row.new_blocks)
                self._table[row.slot, start: start + len(row.new_blocks)] = row.new_blocks

    def _global_batch(self, sched: SchedulerOutput) -> tuple[GlobalBatch, np.ndarray, np.ndarray]:
        rows = sched.rows
        r = len(rows)
        states = [self.states[row.req_id] for row in rows]
        q = np.fromiter((row.num_tokens for row in rows), np.int64, r)
        pref = np.fromiter((row.is_prefilling for row in rows), np.bool_, r)
        gpu = np.fromiter((st.num_computed for st in states), np.int64, r)
        lag = np.fromiter((st.cpu_lag for st in states), np.int64, r)
        qsl = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        ndraft = np.where(pref, 0, q - 1)
        ids = np.empty(int(qsl[-1]), dtype=np.int64)
        for i, (row, st) in enumerate(zip(rows, states)):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if row.is_prefilling:
                ids[lo:hi] = st.prompt[row.prompt_start: row.prompt_start + hi - lo]
                continue
            d = hi - lo - 1
            if st.drafts.shape[0] < d:
                raise RuntimeError(f"rank {self.rank}: {row.req_id} has {st.drafts.shape[0]} drafts, "
                                   f"scheduled {row.num_tokens} tokens")
            ids[lo] = st.last_sampled
            ids[lo + 1:hi] = st.drafts[:d]
        batch = GlobalBatch(
            req_ids=tuple(row.req_id for row in rows),
            idx_mapping=np.fromiter((st.slot for st in states), np.int64, r),
            num_scheduled_tokens=q,
            num_computed_tokens=gpu + lag,
            positions=np.repeat(gpu - qsl[:-1], q) + np.arange(int(qsl[-1]), dtype=np.int64),
            input_ids=ids,
            prefill_len=np.fromiter((row.prompt_len for row in rows), np.int64, r),
            is_prefilling=pref,
        )
        # the last 1 + n_draft rows of each request are sampled
        n = ndraft + 1
        logits_indices = np.repeat(qsl[1:] - n, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        return batch, logits_indices.astype(np.int64), ndraft.astype(np.int64)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """The step's host inputs: global batch, layout, local batch, block tables, slots."""
        cfg, n, rank = self.cfg, self.group.world_size, self.rank
        batch, logits_indices, num_draft = self._global_batch(sched)
        shard = cfg.shard_decode_requests if cfg.shard_decode_requests is not None else (n > 1 and cfg.dcp == 1)
        shape = None
        if self.graphs is not None and not self.faults:
            shape = decode_shape(batch.num_scheduled_tokens, batch.is_prefilling,
                                 int(batch.seq_lens.max()) if batch.num_reqs else 0, pcp=n,
                                 k=cfg.num_speculative_tokens, max_num_seqs=cfg.max_num_seqs,
                                 shard_decode_requests=shard)
        layout = self._plan(batch, None if shape is None else shape.local_tokens)
        local = partition_batch(batch, rank, n, layout=layout,
                                padded_num_reqs=None if shape is None else shape.local_reqs)
        local_positions = local.positions
        if F.POSITIONS_FROM_CPU_CURSOR in self.faults:
            local_positions = _positions_from_cpu_cursor(local)
            local_seq_lens = local.seq_lens.copy()
            ends = local.query_start_loc[1 : local.num_reqs + 1] - 1
            if local.num_tokens:
                local_seq_lens[: local.num_reqs] = local_positions[ends] + 1
        else:
            local_seq_lens = local.seq_lens

        table = self._table  # == self.table.as_array(), read-only here
        bt_local = gather_block_table_rows(table, local.idx_mapping, local.num_reqs_padded)
        slots_global = self.slot_mapping(table, batch.idx_mapping, query_start_loc=batch.query_start_loc,
                                         positions=batch.positions)
        slots_gathered = gathered_slot_mapping(slots_global, layout)
        self.check_slots(slots_gathered)
        if n == 1:
            # Without PCP the target's gather writes the shared input block tables.
            self._write_input_block_tables(table, batch.idx_mapping)
        if F.SAMPLE_LOCAL_LOGITS in self.faults:
            sample_rows = np.minimum(logits_indices, max(local.num_tokens_padded - 1, 0))
        else:
            sample_rows = logits_indices
        if shape is not None:
            bounds = (1 + cfg.num_speculative_tokens, shape.max_seq_len)
        else:
            qsl = local.query_start_loc
            bounds = (int(np.diff(qsl).max()) if qsl.shape[0] > 1 else 0,
                      int(local_seq_lens.max()) if local_seq_lens.shape[0] else 0)
        return StepInputs(batch=batch, logits_indices=logits_indices, num_draft=num_draft, layout=layout,
                          local=local, positions=local_positions, seq_lens=local_seq_lens, table=table,
                          bt_local=bt_local, slots_global=slots_global, slots_gathered=slots_gathered,
                          sample_rows=sample_rows, shape=shape, bounds=bounds,
                          host_lens=None if shape is not None else (local.query_start_loc, local_seq_lens),
                          **(dcp_step_inputs(batch, layout, local, rank=rank, world=n, table=table, bt_local=bt_local,
                                             dcp=cfg.dcp, interleave=cfg.dcp_interleave) if cfg.dcp > 1 else {}))

    def slot_mapping(self, table, idx_mapping, *, query_start_loc, positions) -> np.ndarray:
        """int64[1, T]: ``compute_slot_mappings`` in manager blocks; DCP > 1: this rank's share (rank = DCP rank)."""
        return compute_slot_mappings(table, self.cfg.block_size, idx_mapping, query_start_loc=query_start_loc,
                                     positions=positions, **self.dcp_kw())

    def dcp_kw(self) -> dict:
        c = self.cfg
        return dict(cp_size=c.dcp, cp_rank=self.rank, cp_interleave=c.dcp_interleave) if c.dcp > 1 else {}

    def _plan(self, batch: GlobalBatch, padded_num_tokens: int | None) -> PCPLayout:
        """``plan_layout`` of the step, remembered for decode-only steps: the layout depends on
        the rows' query lengths alone, and steady decoding repeats the same few (batch 1, K=2:
        one shape). Remembered layouts are read-only."""
        q, pref = batch.num_scheduled_tokens, batch.is_prefilling
        decode_only = not pref.any()
        key = (q.tobytes(), padded_num_tokens) if decode_only else None
        layout = self._layouts.get(key) if decode_only else None
        if layout is None:
            layout = plan_layout(q, pref, self.group.world_size, shard_decode_requests=self.cfg.shard_decode_requests,
                                 dcp_world_size=self.cfg.dcp, padded_num_tokens=padded_num_tokens)
            if decode_only:
                for a in (layout.num_scheduled_tokens, layout.is_prefilling, layout.query_start_loc,
                          layout.replicated, layout.padded_gather_idx, layout.hidden_restore_idx,
                          layout.kv_write_mask):
                    a.flags.writeable = False
                if len(self._layouts) >= 256:
                    self._layouts.clear()
                self._layouts[key] = layout
        return layout

    def check_slots(self, slots: np.ndarray) -> None:
        """The KV cache's bound check, on the host (the device write then needs no sync)."""
        if slots.size and int(slots.max()) >= self.cache.num_slots:
            raise IndexError(f"KV slot {int(slots.max())} beyond the cache ({self.cache.num_slots} slots)")

    def upload_inputs(self, key, arrays: dict[str, tuple[np.ndarray, torch.dtype]]) -> dict[str, torch.Tensor]:
        """Device tensors of ``arrays``: the graph's static buffers for ``key = (phase, shape)``
        when ``shape`` is a DecodeShape, else one packed upload (``Uploader``)."""
        if key[1] is None:
            return self.uploader.upload(arrays)
        spec = {name: (tuple(np.shape(a)), dt) for name, (a, dt) in arrays.items()}
        static = self.graphs.inputs(key, spec)
        static.fill({name: a for name, (a, _) in arrays.items()})
        return static.views

    def run_forward(self, key, fn):
        """``fn()``: replayed from a graph when ``key = (phase, shape)`` has a DecodeShape (its
        model code compiled, when ``self.compiled``)."""
        if key[1] is None:
            return fn()
        with self.model.regions(self.compiled):
            return self.graphs.run(key, fn)

    # ------------------------------------------------------------------------------ the step
    def step(self, sched: SchedulerOutput) -> StepResult:
        cfg, timer = self.cfg, self.timer
        k = cfg.num_speculative_tokens
        rec = StepRecord(sched.step, self.rank, calls=self.group.start_step()) if self.record else None
        if self._fault_specs:
            from pcpviz.faults import active_faults

            self.faults = active_faults(self._fault_specs, sched.step)
        with timer.phase("draft_k" if k > 1 else "draft_0"):
            self._resolve_drafts()  # the last step's drafts (a wait for the device, if any)
        with timer.phase("batch"):
            self._apply_scheduler_output(sched)
            t0 = _now_us()
            h = self.prepare(sched)
        shape, local, layout = h.shape, h.local, h.layout
        with timer.phase("h2d"):
            tokens = shape.tokens if shape is not None else h.sample_rows.shape[0]
            dev = self.upload_inputs(("target", shape), {
                "ids": (local.input_ids, torch.int64), "positions": (h.positions, torch.int64),
                "slots": (h.slots_gathered[0], torch.int64), "block_rows": (h.bt_local, torch.int32),
                "qsl": (local.query_start_loc, torch.int64), "seq_lens": (h.seq_lens, torch.int64),
                "restore": (pad(layout.hidden_restore_idx, max(tokens, layout.num_tokens)), torch.int64),
                "sample_rows": (pad(h.sample_rows, tokens), torch.int64),
                **{k: (a, torch.int32 if k == "dcp_block_rows" else torch.int64)
                   for k, a in (h.dcp_rows or {}).items()}})
        local_logits = F.SAMPLE_LOCAL_LOGITS in self.faults
        with timer.phase("target"):
            top1, hidden_global, hidden_local, dcp_ranks = self.run_forward(
                ("target", shape), lambda: self._target(dev, h.bounds, local_logits, host_lens=h.host_lens))
            num_sampled_rows = h.sample_rows.shape[0]
            targets = top1[:num_sampled_rows].cpu().numpy()  # the step's one sync (as in vLLM)
        t1 = _now_us()
        if rec is not None:
            with timer.phase("record"):
                rec.target(batch=h.batch, logits_indices=h.logits_indices, layout=layout, local=local,
                           local_positions=h.positions, local_seq_lens=h.seq_lens, bt_local=h.bt_local,
                           table=h.table, slots_global=h.slots_global, slots_gathered=h.slots_gathered,
                           sampled_rows=h.sample_rows, sampled_from="local" if local_logits else "global",
                           top1=targets, hidden_global=hidden_global[: layout.num_tokens], t0=t0, t1=t1,
                           hidden_local=hidden_local[:len(h.positions)], eager=eagerly(self.graphs, ("target", shape)))
                kept = kept_drafts([self.states[r].drafts for r in h.batch.req_ids], k)
                rec.phases["target"]["scheduled_draft_ids"] = kept
                if h.dcp_local_seq_lens is not None:
                    rec.dcp("target", local_lens=h.dcp_local_seq_lens, ranks_combined=dcp_ranks,
                            owner=dcp_owner(h.batch.positions, block_size=cfg.block_size, dcp_size=cfg.dcp,
                                            interleave=cfg.dcp_interleave))

        with timer.phase("verify"):
            verify = self._verify(sched, h.batch, h.num_draft, targets)
        t2 = _now_us()
        if rec is not None:
            with timer.phase("record"):
                rec.verify(req_ids=h.batch.req_ids, num_draft=h.num_draft, v=verify, k=k, t0=t1, t1=t2,
                           num_computed_after=[self.states[r].num_computed for r in h.batch.req_ids])

        if k > 0 and h.batch.num_reqs:
            from pcpviz.engine.speculator import propose

            drafts = propose(self, h=h, dev=dev, hidden_local=hidden_local, verify=verify, sched=sched, rec=rec)
            self._defer_drafts(drafts, h.batch.req_ids, verify.num_sampled > 0)
        per_request = {
            rid: (verify.sampled[i], int(verify.num_rejected[i])) for i, rid in enumerate(h.batch.req_ids)
        }
        return StepResult(per_request, verify.num_accepted.astype(np.int64), h.num_draft.astype(np.int64), rec)

    def _target(self, d: dict[str, torch.Tensor], bounds: tuple[int, int], local_logits: bool, *,
                host_lens=None):
        """The target forward on device inputs -> (top-1 token per sampled row, restored hidden
        states [T, H], rank-local hidden states [P, H]). Reads only ``d`` (graph-capturable)."""
        attn = PagedAttention(self.model, self.cache, self.group, expanded=True, slots=d["slots"],
                              block_rows=d["block_rows"], query_start_loc=d["qsl"], positions=d["positions"],
                              seq_lens=d["seq_lens"], bounds=bounds, slots_checked=True, host_lens=host_lens,
                              dcp=dcp_rows_of(d), index_cache=self.index_cache)
        with torch.no_grad():
            hidden_local = self.model.forward_hidden(d["ids"], d["positions"], attn)  # [P, H]
            hidden_global = self.group.all_gather(hidden_local)[d["restore"]]  # [T, H]
            src = hidden_local if local_logits else hidden_global
            top1 = self.model.logits(src[d["sample_rows"]]).argmax(-1)
        return top1, hidden_global, hidden_local, min(attn.dcp_ranks, default=1)

    # ------------------------------------------------------------------------------ drafts
    def _defer_drafts(self, drafts: torch.Tensor, req_ids, keep: np.ndarray) -> None:
        """Start the drafts' copy to the host; the next step waits for it (``_resolve_drafts``)."""
        event = None
        if drafts.is_cuda:
            host = torch.empty(drafts.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(drafts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = drafts.to(torch.int64).clone()
        self._pending_drafts = (host, event, req_ids, keep)

    def _resolve_drafts(self) -> None:
        if self._pending_drafts is None:
            return
        host, event, req_ids, keep = self._pending_drafts
        self._pending_drafts = None
        if event is not None:
            event.synchronize()
        a = host.numpy()
        empty = np.zeros(0, np.int64)
        for i, req_id in enumerate(req_ids):
            st = self.states.get(req_id)
            if st is not None:
                st.drafts = a[i].copy() if keep[i] else empty

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
        v = greedy_verify(batch, num_draft, targets, states=self.states, k=self.cfg.num_speculative_tokens,
                          accept_one_less=divergent)
        drift = F.DRAFT_CURSOR_DRIFT_AFTER_REJECTION in self.faults
        for i, req_id in enumerate(batch.req_ids):
            st = self.states[req_id]
            rejected = int(v.num_rejected[i])
            st.num_computed += int(batch.num_scheduled_tokens[i]) - rejected
            st.cpu_lag = rejected
            if drift:
                self.draft_drift[req_id] = self.draft_drift.get(req_id, 0) + rejected
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
