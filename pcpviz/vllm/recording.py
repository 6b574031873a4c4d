"""Recording hooks on vLLM 0.33.0's PCP + speculative-decoding path.

Shared by the CPU replay (``pcpviz.vllm.replay``) and the plugin
(``pcpviz.vllm.plugin``): both use exactly these classes, so a trace made on a laptop
and one made on a GPU cluster come from the same code. Where each view is taken
(``docs/design.md#where-each-view-is-recorded-in-vllm``):

=====================  ==========================================================
view(s)                hook
=====================  ==========================================================
global batch, layout,  ``RecordingPCPManager.partition_batch`` (its argument; the
rank-local batch       layout of ``_build_batch_layout``; its return value)
block_table_local,     ``RecordingPCPManager.prepare_attn`` (return value),
block_table_global     ``BlockTables.block_tables[g].gpu[global.idx_mapping]``
slot_mapping_global,   ``RecordingPCPManager.prepare_slot_mappings`` (the
slot_mapping_gathered  ``_global_batch_slot_mappings`` it filled; its return value)
sampled_logits_rows    ``RecordingPCPManager.restore_for_sampling`` (the batch it
                       hands to the sampler: ``logits_indices``, global or local)
verify                 ``GPUModelRunner.postprocess_sampled`` (its arguments)
draft_0 global ids     ``RecordingPCPManager.prepare_draft_prefill`` (argument)
draft_k inputs         ``TargetDependentARSpeculator._run_model`` entry snapshot
                       (ids, positions, seq_lens, block tables, slot mappings of
                       the forward that is about to run)
draft_k slot mapping   ``compute_slot_mappings`` on the speculator's BlockTables
(k >= 1)               instance; the block-table gather counted on that instance
draft_tokens           the return value of ``propose`` (``int64[R, K]``)
DSpark inputs          ``dflash.speculator.prepare_dflash_inputs`` (module global)
=====================  ==========================================================

Every override calls ``super()`` first and records copies: tensors are cloned on their
device when the hook fires (``.clone()``) and moved to the host once per step when the
step is written (``.cpu()``), so vLLM's persistent buffers — which CUDA graphs replay by
address — are never re-allocated and the recorded values are those of that moment.
Recording never changes what vLLM computes (tested: identical draft tokens, slot mappings
and KV caches with recording on and off).

Where traces go: a ``TraceSession`` (a run directory, one ``TraceWriter`` per PCP rank,
``run.json`` written by PCP rank 0). The replay opens one explicitly
(``with recording.session(run_dir, ...)``); the plugin opens one from the environment
variable ``PCPVIZ_TRACE_DIR`` in each worker (TP rank 0 only). Without a session a
``RecordingPCPManager`` is a plain ``PCPManager``.

A plugin session is *lenient*: an exception inside a hook is logged once and switches
recording off for that rank (serving is never broken); the replay's session is *strict*
and re-raises.

Import this module only after ``pcpviz.vllm.cpu_patches.apply_cpu_patches()`` on a CPU-only
machine (it imports vLLM's worker classes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.v1.worker.gpu.pcp_manager import PCPManager

from pcpviz.trace import TraceWriter, segments_table, write_run_meta

logger = logging.getLogger("vllm.pcpviz")

__all__ = [
    "ENV_TRACE_DIR", "ENV_RECORD_DUMMY", "RecordingPCPManager", "RankRecorder", "TraceSession",
    "session", "active_session", "install_wrappers", "wrapped_targets", "recorder_of",
]

ENV_TRACE_DIR = "PCPVIZ_TRACE_DIR"
"""Directory the plugin records into (unset or empty: the plugin is inert)."""
ENV_RECORD_DUMMY = "PCPVIZ_RECORD_DUMMY"
"""``1``: the plugin also records dummy/profile runs (phase ``dummy``); default off."""

_session_lock = threading.Lock()
_session: TraceSession | None = None
_tls = threading.local()  # .ctx: the _DraftContext of the propose running on this thread


# --------------------------------------------------------------------------- sessions


class TraceSession:
    """Where the recorders of one run write: ``run_dir/rank{pcp_rank}.arrow`` + ``run.json``.

    ``meta``: run.json content (PCP rank 0 writes it at its first step, completed with what
    the recorders learn: pcp, dcp, shard_decode_requests, block_size(s), K, ...).
    ``strict``: re-raise exceptions from hooks (replay) instead of disabling recording
    (plugin). ``record_dummy``: record ``propose(dummy_run=True)`` as a step with phase
    ``dummy``. ``tp_rank``: only this TP rank records (other TP ranks hold the same batch
    views); ``None`` disables the filter.
    """

    def __init__(self, run_dir: str | os.PathLike, *, producer: str, meta: Mapping[str, Any] | None = None,
                 strict: bool = False, record_dummy: bool = True, overwrite: bool = False,
                 tp_rank: int | None = 0) -> None:
        self.run_dir = Path(run_dir)
        self.meta: dict[str, Any] = {"producer": producer, **dict(meta or {})}
        self.strict = strict
        self.record_dummy = record_dummy
        self.overwrite = overwrite
        self.tp_rank = tp_rank
        self.recorders: dict[int, RankRecorder] = {}
        self._lock = threading.Lock()

    def recorder_for(self, manager: PCPManager) -> RankRecorder | None:
        if self.tp_rank is not None and _tp_rank() != self.tp_rank:
            return None
        with self._lock:
            rec = RankRecorder(self, manager.pcp_rank, manager.pcp_world_size)
            self.recorders[manager.pcp_rank] = rec
            return rec

    def close(self) -> None:
        """Write every pending step and close the rank files (idempotent)."""
        for rec in list(self.recorders.values()):
            rec.close()

    @property
    def seconds_recording(self) -> float:
        return sum(r.seconds for r in self.recorders.values())


@contextlib.contextmanager
def session(run_dir: str | os.PathLike, **kwargs: Any) -> Iterator[TraceSession]:
    """Make a ``TraceSession`` the active one for the ``RecordingPCPManager``s built inside."""
    global _session
    s = TraceSession(run_dir, **kwargs)
    with _session_lock:
        previous, _session = _session, s
    try:
        yield s
    finally:
        s.close()
        with _session_lock:
            _session = previous


def active_session() -> TraceSession | None:
    """The session a new ``RecordingPCPManager`` records into: the one opened with
    ``session()``, else one made from ``$PCPVIZ_TRACE_DIR`` (the plugin's), else None."""
    global _session
    with _session_lock:
        if _session is None:
            run_dir = os.environ.get(ENV_TRACE_DIR, "").strip()
            if run_dir:
                _session = TraceSession(run_dir, producer="vllm-plugin",
                                        record_dummy=os.environ.get(ENV_RECORD_DUMMY, "") == "1")
                import atexit

                atexit.register(_session.close)
        return _session


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (the CPU replay): TP rank 0
        return 0


# --------------------------------------------------------------------------- the recorder


def _copy(value: Any) -> Any:
    """A copy taken now: tensors are cloned on their device (moved at step end)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.cpu()
        return value.numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return np.stack([_host(v) for v in value])
    return value


def _host_all(phases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every view of a step on the host, with two device synchronisations for the whole step
    instead of one per view: after a device-wide sync (the clones may sit on any of vLLM's
    streams), device tensors are copied into pinned host memory without blocking (PyTorch's
    caching host allocator reuses the buffers), then the step's copies are awaited once."""
    staged: dict[str, dict[str, Any]] = {}
    synced = False
    if torch.cuda.is_available() and any(isinstance(x, torch.Tensor) and x.is_cuda
                                         for views in phases.values() for x in views.values()):
        torch.cuda.synchronize()  # the clones may sit on any of vLLM's streams
    for name, views in phases.items():
        if not views:
            continue
        out = staged[name] = {}
        for v, x in views.items():
            if isinstance(x, torch.Tensor) and x.is_cuda:
                buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                buf.copy_(x, non_blocking=True)
                out[v] = buf
                synced = True
            else:
                out[v] = x
    if synced:
        torch.cuda.current_stream().synchronize()
    return {name: {v: _host(x) for v, x in views.items()} for name, views in staged.items()}


def _now_us() -> int:
    return time.time_ns() // 1000


def _block_rows(block_tables: Any, tables: Any, idx_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """G forward-pass block tables (rows in batch order) -> ``([G, rows, W], stale)``, a copy.

    vLLM's ``_gather_block_tables_kernel`` copies a request's first ``num_blocks`` entries
    into a persistent row and leaves the rest of the row as the previous occupant left it;
    attention never reads past ``num_blocks`` (seq_lens bound it). The copy keeps the
    allocated entries and zeroes the tail, so rows compare with the request's global row;
    ``stale`` counts the non-zero tail entries that were dropped (int64 scalar)."""
    rows = torch.stack([t.detach() for t in tables]).clone()  # [G, rows, W]
    n = min(rows.shape[1], idx_mapping.shape[0])
    nb = torch.zeros(rows.shape[0], rows.shape[1], dtype=torch.int64, device=rows.device)
    if n:
        nb[:, :n] = block_tables.num_blocks.gpu[:, idx_mapping[:n].clamp(min=0)].to(torch.int64)
    tail = torch.arange(rows.shape[2], device=rows.device).view(1, 1, -1) >= nb.unsqueeze(-1)
    stale = (rows.ne(0) & tail).sum()
    rows.masked_fill_(tail, 0)
    return rows, stale


class RankRecorder:
    """One PCP rank's steps: the phases of the step being recorded, written at its end."""

    def __init__(self, session: TraceSession, pcp_rank: int, pcp_world_size: int) -> None:
        self.session = session
        self.rank = pcp_rank
        self.pcp_world_size = pcp_world_size
        self.step = 0
        self.phases: dict[str, dict[str, Any]] | None = None
        self.writer: TraceWriter | None = None
        self.meta: dict[str, Any] = {}
        self.disabled = False
        self.closed = False
        self.seconds = 0.0  # time spent inside recording hooks
        self.steps_written = 0
        self.global_batch: Any = None  # the step's global InputBatch (verify rows)
        self._layout: tuple[list, list[int]] | None = None
        self._lock = threading.Lock()

    # -- error policy
    def guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a recording action; lenient sessions log and disable on error."""
        if self.disabled:
            return None
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.session.strict:
                raise
            self.disabled = True
            logger.warning("pcpviz: recording disabled on PCP rank %d after an error in %s: %s: %s "
                           "(vLLM continues unaffected)", self.rank, getattr(fn, "__name__", fn),
                           type(exc).__name__, exc)
            return None
        finally:
            self.seconds += time.perf_counter() - t0

    # -- steps and phases
    def begin_step(self) -> None:
        if self.phases is not None:
            self.flush()
        self.phases = {}

    def phase(self, name: str) -> dict[str, Any]:
        if self.phases is None:
            self.phases = {}
        return self.phases.setdefault(name, {})

    def put(self, phase: str, **views: Any) -> None:
        ph = self.phase(phase)
        for name, value in views.items():
            ph[name] = _copy(value)

    def flush(self) -> None:
        """Write the pending step (if any) as one record batch."""
        with self._lock:
            phases, self.phases = self.phases, None
            if not phases or self.closed:
                return
            out = _host_all(phases)
            _trim_block_tables(out)
            if self.writer is None:
                self._open_writer()
            self.writer.write_step(self.step, out)
            self.step += 1
            self.steps_written += 1

    def _open_writer(self) -> None:
        s = self.session
        meta = None
        if self.rank == 0:
            self.meta.update(environment_meta())
            meta = {**s.meta, **self.meta}
        self.writer = TraceWriter(s.run_dir, self.rank, meta=meta, overwrite=s.overwrite)

    def update_meta(self, **meta: Any) -> None:
        fresh = {k: v for k, v in meta.items() if self.meta.get(k) != v}
        if not fresh:
            return
        self.meta.update(fresh)
        if self.writer is not None and self.rank == 0:
            write_run_meta(self.session.run_dir, {**self.session.meta, **self.meta})

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self.disabled:
                self.flush()
        except Exception as exc:  # noqa: BLE001
            if self.session.strict:
                raise
            logger.warning("pcpviz: could not write the last step on PCP rank %d: %s", self.rank, exc)
        finally:
            self.closed = True
            if self.writer is not None:
                self.writer.close()

    # -- target: global batch, layout, local batch
    def on_layout(self, segments_by_rank: list, per_rank_num_tokens: list[int]) -> None:
        self._layout = (segments_by_rank, list(per_rank_num_tokens))

    def on_partition(self, manager: RecordingPCPManager, global_batch: Any, local: Any, t0: int) -> None:
        self.global_batch = global_batch
        g, r, t = global_batch, global_batch.num_reqs, global_batch.num_tokens
        nr = local.num_reqs
        p = local.num_tokens_after_padding
        segs, per_rank = self._layout or ([], [])
        self._layout = None
        is_padding = local.is_padding
        views: dict[str, Any] = dict(
            # global batch
            req_ids=np.array(g.req_ids, dtype=str),
            idx_mapping=g.idx_mapping[:r],
            num_scheduled_tokens=np.asarray(g.num_scheduled_tokens[:r], dtype=np.int64),
            num_computed_tokens=np.asarray(g.num_computed_tokens_np[:r], dtype=np.int64),
            query_start_loc=g.query_start_loc[: r + 1],
            positions=g.positions[:t],
            input_ids=g.input_ids[:t],
            seq_lens=g.seq_lens[:r],
            is_prefilling=np.asarray(g.is_prefilling_np[:r], dtype=bool),
            prefill_len=np.asarray(g.prefill_len_np[:r], dtype=np.int64),
            logits_indices=g.logits_indices,
            num_draft_tokens=(np.zeros(r, dtype=np.int64) if g.num_draft_tokens_per_req is None
                              else np.asarray(g.num_draft_tokens_per_req[:r], dtype=np.int64)),
            # layout
            segments=segments_table(
                [[(s.global_batch_req_idx, s.global_batch_slice.start, s.global_batch_slice.stop,
                   s.rank_local_batch_slice.start, s.rank_local_batch_slice.stop) for s in rank_segs]
                 for rank_segs in segs]),
            per_rank_num_tokens=np.asarray(per_rank, dtype=np.int64),
            padded_gather_idx=manager._padded_gather_idx,
            hidden_restore_idx=manager._hidden_restore_idx,
            kv_write_mask=manager._gathered_kv_write_mask,
            # rank-local batch (input_ids cloned now: the draft prefill overwrites them in place)
            local_req_ids=np.array(local.req_ids, dtype=str),
            local_idx_mapping=local.idx_mapping[:nr],
            local_input_ids=local.input_ids[:p],
            local_positions=local.positions[:p],
            local_query_start_loc=local.query_start_loc[: nr + 1],
            local_seq_lens=local.seq_lens[:nr],
            local_logits_indices=local.logits_indices[:nr],
            local_is_prefilling=np.asarray(local.is_prefilling_np[:nr], dtype=bool),
            local_num_computed_tokens=np.asarray(local.num_computed_tokens_np[:nr], dtype=np.int64),
            t_start_us=np.array(t0, dtype=np.int64),
        )
        if warming_up():
            views["warmup"] = np.array(True)  # a synthetic warm-up step (PCPVIZ_RECORD_DUMMY=1)
        if is_padding.shape[0] == p:
            views["local_is_padding"] = is_padding[:p]
        else:
            # moe_gathers_tokens (EP off): vLLM hands the rank-major [N*P] gathered MoE mask;
            # this rank's own rows are its block of it.
            views["local_is_padding"] = is_padding[self.rank * p:(self.rank + 1) * p]
            views["moe_is_padding"] = is_padding
        self.put("target", **views)
        self.update_meta(pcp=manager.pcp_world_size, dcp=manager.dcp_world_size,
                         shard_decode_requests=bool(manager.shard_decode_requests))

    def on_prepare_attn(self, manager: RecordingPCPManager, local: Any, block_tables: Any) -> None:
        bt = manager._block_tables
        g = manager._global_batch
        idx = g.idx_mapping[: g.num_reqs]
        local_rows, local_stale = _block_rows(bt, [t[: local.num_reqs_after_padding] for t in block_tables],
                                              local.idx_mapping[: local.num_reqs])
        global_rows, global_stale = _block_rows(bt, [b.gpu[idx] for b in bt.block_tables], idx)
        self.put("target", block_table_local=local_rows, block_table_global=global_rows,
                 block_table_local_stale_tail=local_stale, block_table_global_stale_tail=global_stale)
        self.update_meta(block_size=int(bt.block_sizes[0]), block_sizes=[int(b) for b in bt.block_sizes],
                         dcp_rank=int(manager.dcp_rank), dcp_interleave=int(manager.cp_interleave))

    def on_slot_mappings(self, manager: RecordingPCPManager, gathered: torch.Tensor) -> None:
        g = manager._global_batch
        self.put("target", slot_mapping_global=manager._global_batch_slot_mappings[:, : g.num_tokens],
                 slot_mapping_gathered=gathered)

    def on_restore_for_sampling(self, manager: RecordingPCPManager, batch: Any, num_aux: int) -> None:
        self.put("target", sampled_logits_rows=batch.logits_indices,
                 sampled_from=np.array("global" if batch is manager._global_batch else "local"),
                 num_aux_hidden_states_restored=np.array(num_aux, dtype=np.int64),
                 t_end_us=np.array(_now_us(), dtype=np.int64))

    # -- verify
    def on_postprocess_sampled(self, idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor,
                               num_rejected: torch.Tensor, t0: int) -> None:
        """The verify phase: ``sampled_token_ids`` ``int64[R, K+1]`` (PAD = -1 past
        ``num_sampled``), ``num_sampled`` / ``num_rejected`` / ``num_accepted`` ``int64[R]`` and
        ``idx_mapping`` ``int32[R]`` (-1 marks a masked row, which vLLM's ``post_update`` skips)."""
        g = self.global_batch
        r = num_sampled.shape[0]
        views: dict[str, Any] = {}
        if g is not None and g.num_reqs == r:
            views["req_ids"] = np.array(g.req_ids, dtype=str)
            views["num_draft_tokens"] = (np.zeros(r, dtype=np.int64) if g.num_draft_tokens_per_req is None
                                         else np.asarray(g.num_draft_tokens_per_req[:r], dtype=np.int64))
        ns = num_sampled.to(torch.int64)
        # vLLM writes sampled_tokens[i, :num_sampled[i]] only: on a GPU the rest of the row is
        # whatever the buffer held (a rejected draft, an older step). Recorded as -1 (no sync).
        cols = torch.arange(sampled.shape[-1], device=sampled.device)
        sampled = sampled.masked_fill(cols.unsqueeze(0) >= ns.to(sampled.device).unsqueeze(-1), -1)
        views["idx_mapping"] = idx_mapping
        self.put("verify", **views, sampled_token_ids=sampled, num_sampled=ns,
                 num_rejected=num_rejected.to(torch.int64), num_accepted=(ns - 1).clamp_(min=0),
                 t_start_us=np.array(t0, dtype=np.int64), t_end_us=np.array(_now_us(), dtype=np.int64))

    # -- drafts
    def begin_propose(self, spec: Any, input_batch: Any, dummy: bool) -> _DraftContext:
        if dummy:
            # A dummy/profile run is its own step (no partition_batch precedes it).
            self.begin_step()
        _install_instance_wrappers(spec)
        self.update_meta(**_speculator_meta(spec))
        return _DraftContext(self, spec, input_batch, dummy)

    def end_propose(self, ctx: _DraftContext, draft_tokens: torch.Tensor | None) -> None:
        ctx.finish(draft_tokens)
        self.flush()


_BT_PREFIX = "block_table"  # block_table_global / _local / _draft (and the replay's *_no_gather)


def _trim_block_tables(phases: dict[str, dict[str, Any]]) -> None:
    """Cut every block-table view of a step to the columns any of them uses (the rest are
    zeros in all of them): vLLM's rows are ``max_model_len / block_size`` wide."""
    tables = [(ph, v) for ph, views in phases.items() for v, a in views.items()
              if v.startswith(_BT_PREFIX) and isinstance(a, np.ndarray) and a.ndim >= 2 and a.dtype.kind in "iu"]
    if not tables:
        return
    width = 1
    for ph, v in tables:
        a = phases[ph][v]
        cols = np.flatnonzero(a.reshape(-1, a.shape[-1]).any(axis=0))
        if cols.size:
            width = max(width, int(cols[-1]) + 1)
    for ph, v in tables:
        phases[ph][v] = np.ascontiguousarray(phases[ph][v][..., :width])


def environment_meta() -> dict[str, Any]:
    """Where the trace was recorded (run.json keys): ``gpus`` (names of the visible CUDA devices,
    ``[]`` on CPU), ``torch_version``, ``cuda_version``, ``python_version``, ``hostname`` and
    ``command`` (this process's command line: vLLM's workers inherit the user's ``sys.argv``)."""
    import platform
    import shlex
    import sys

    gpus: list[str] = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "python_version": platform.python_version(), "hostname": platform.node(),
            "command": shlex.join([os.path.basename(sys.executable)] + list(sys.argv))}


def _speculator_meta(spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"num_speculative_tokens": int(spec.num_speculative_steps),
                            "speculative_method": str(getattr(spec, "method", "")),
                            "speculator": type(spec).__name__}
    try:
        import vllm

        meta["vllm_version"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass
    cfg = getattr(spec, "vllm_config", None)
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    if isinstance(model, str):
        meta["model"] = model
    mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None:
        meta["cudagraph_mode"] = getattr(mode, "name", str(mode))
    tp = getattr(getattr(cfg, "parallel_config", None), "tensor_parallel_size", None)
    if isinstance(tp, int):
        meta["tp"] = tp
    return meta


def _first_layer_slots(slot_mappings: Any, spec: Any) -> torch.Tensor | None:
    """[G, n] from a per-layer slot-mapping dict: one layer per KV-cache group (the drafter's
    own layer where the group has one)."""
    if not isinstance(slot_mappings, Mapping) or not slot_mappings:
        return None
    cfg = getattr(spec, "kv_cache_config", None)
    groups = getattr(cfg, "kv_cache_groups", None)
    draft_layers = getattr(spec, "draft_attn_layer_names", None) or set()
    rows = []
    if groups:
        for group in groups:
            names = [n for n in group.layer_names if n in slot_mappings]
            if not names:
                continue
            pick = next((n for n in names if n in draft_layers), names[0])
            rows.append(slot_mappings[pick])
    if not rows:
        rows = [next(iter(slot_mappings.values()))]
    n = min(r.shape[0] for r in rows)
    return torch.stack([r[:n] for r in rows]).clone()


class _DraftContext:
    """What one ``propose`` call on one rank recorded: a phase per draft forward."""

    def __init__(self, rec: RankRecorder, spec: Any, input_batch: Any, dummy: bool) -> None:
        self.rec, self.spec, self.input_batch, self.dummy = rec, spec, input_batch, dummy
        self.num_reqs = int(input_batch.num_reqs)
        self.phases: list[str] = []
        self.block_table_gathers = 0
        self.compute_slot_calls = 0
        self.last_slots: torch.Tensor | None = None
        self.global_draft_ids: torch.Tensor | None = None
        self.dflash_inputs: dict[str, Any] | None = None
        self.t0 = _now_us()
        self.all_gathers_before = _fake_group_all_gathers()
        self.hidden_gathers = 0

    def phase_name(self, k: int) -> str:
        return "dummy" if self.dummy else f"draft_{k}"

    def on_forward(self, num_tokens: int, slot_mappings: Any) -> None:
        """Snapshot the inputs of the draft forward that is about to run."""
        spec, rec = self.spec, self.rec
        now = _now_us()
        if self.phases and not self.dummy:
            rec.phase(self.phases[-1])["t_end_us"] = np.array(now, dtype=np.int64)
        # propose runs one forward per draft step, in order: _prefill (step 0) then one
        # _generate_draft per decode step (counted here rather than read from the device
        # tensor current_draft_step, which would synchronize).
        k = len(self.phases)
        name = self.phase_name(k)
        r = self.num_reqs
        manager = spec.pcp_manager
        local = getattr(manager, "draft_prefill_batch", None)
        views: dict[str, Any] = {"t_start_us": np.array(now, dtype=np.int64)}
        if self.dummy:
            self.phases.append(name)
            views = {"draft_forwards": np.array(len(self.phases), dtype=np.int64)}
            rec.put(name, **views)
            return
        self.phases.append(name)
        if local is not None:
            # draft_0 under PCP: the target's rank-local rows, attention metadata and gathered
            # slot mapping (pcp_manager.get_draft_input_buffers returns this batch).
            nr = local.num_reqs
            rows, stale = _block_rows(spec.block_tables,
                                      [t[: local.num_reqs_after_padding] for t in manager._local_block_tables],
                                      local.idx_mapping[:nr])
            views.update(view=np.array("rank_local"), draft_input_ids=local.input_ids[:num_tokens],
                         draft_positions=local.positions[:num_tokens], draft_seq_lens=local.seq_lens[:nr],
                         block_table_draft=rows, block_table_draft_stale_tail=stale)
            if self.global_draft_ids is not None:
                views["draft_global_input_ids"] = self.global_draft_ids
        else:
            buf = spec.input_buffers
            rows, stale = _block_rows(spec.block_tables, [t[:r] for t in spec.block_tables.input_block_tables],
                                      self.input_batch.idx_mapping[:r])
            views.update(view=np.array("replicated"), draft_input_ids=buf.input_ids[:num_tokens][:r],
                         draft_positions=buf.positions[:num_tokens][:r], draft_seq_lens=buf.seq_lens[:r],
                         block_table_draft=rows, block_table_draft_stale_tail=stale)
        if k == 0:
            views["draft_last_token_indices"] = spec.last_token_indices[:r]
        slots = None
        if local is None and self.last_slots is not None:
            slots = self.last_slots[:, :r]  # compute_slot_mappings of this decode step: unexpanded
        if slots is None:
            slots = _first_layer_slots(slot_mappings, spec)
            if slots is not None and local is None:
                slots = slots[:, :r]
        if slots is not None:
            views["slot_mapping_draft"] = slots
        rec.put(name, **views)

    def on_compute_slot_mappings(self, out: torch.Tensor) -> None:
        self.compute_slot_calls += 1
        self.last_slots = out.detach().clone()

    def on_gather_block_tables(self) -> None:
        self.block_table_gathers += 1

    def finish(self, draft_tokens: torch.Tensor | None) -> None:
        rec = self.rec
        now = np.array(_now_us(), dtype=np.int64)
        if self.dummy:
            rec.put("dummy", num_reqs=np.array(self.num_reqs, dtype=np.int64),
                    block_table_gathers=np.array(self.block_table_gathers, dtype=np.int64),
                    compute_slot_mapping_calls=np.array(self.compute_slot_calls, dtype=np.int64),
                    pcp_hidden_all_gathers=np.array(self.hidden_gathers, dtype=np.int64),
                    t_start_us=np.array(self.t0, dtype=np.int64), t_end_us=now)
            group_gathers = _fake_group_all_gathers()
            if group_gathers is not None and self.all_gathers_before is not None:
                rec.put("dummy", all_gathers=np.array(group_gathers - self.all_gathers_before, dtype=np.int64))
            if draft_tokens is not None:
                rec.put("dummy", draft_tokens=draft_tokens)
            return
        if self.phases:
            rec.phase(self.phases[-1])["t_end_us"] = now
        if self.dflash_inputs is not None:
            rec.put("draft_0", **self.dflash_inputs)
            rec.put("draft_0", block_table_gathers=np.array(self.block_table_gathers, dtype=np.int64))
        if draft_tokens is None:
            return
        dt = draft_tokens.detach()
        if self.dflash_inputs is not None:
            # DSpark/DFlash: one replicated forward proposes all K tokens of a request. The
            # view contract is one token per request per draft phase: draft_tokens is the first
            # of them, draft_block_tokens all K.
            rec.put("draft_0", draft_tokens=dt[:, 0], draft_block_tokens=dt)
            return
        for name in self.phases:
            k = int(name.split("_")[1])
            if k < dt.shape[1]:
                rec.put(name, draft_tokens=dt[:, k])


def _fake_group_all_gathers() -> int | None:
    """all_gathers of the calling thread's rank in the replay's FakePCPGroup (None on GPUs)."""
    try:
        from pcpviz.vllm import cpu_patches

        group = cpu_patches._current_fake_group()
    except Exception:  # noqa: BLE001
        return None
    if group is None:
        return None
    return int(group.all_gather_calls[group.rank_in_group])


# --------------------------------------------------------------------------- the PCP manager


_warmup_depth = 0  # > 0 inside vLLM's Worker.compile_or_warm_up_model (this process)


def warming_up() -> bool:
    """True while vLLM warms up before serving: ``Worker.compile_or_warm_up_model`` runs
    synthetic scheduler steps (requests ``_warmup_{i}_``, ``_v2_mixed_warmup_*``; fake draft
    tokens) through ``execute_model`` when it compiles (``cudagraph_mode`` PIECEWISE, JIT warm-up)."""
    return _warmup_depth > 0


def recorder_of(manager: Any) -> RankRecorder | None:
    """The live recorder of a ``RecordingPCPManager`` (None for anything else, and during
    vLLM's warm-up unless the session records dummy runs: ``PCPVIZ_RECORD_DUMMY=1``)."""
    rec = getattr(manager, "_pcpviz_recorder", None)
    if rec is None or rec.disabled or rec.closed:
        return None
    if _warmup_depth > 0 and not rec.session.record_dummy:
        return None
    return rec


class RecordingPCPManager(PCPManager):
    """vLLM 0.33.0's ``PCPManager`` that records what it computes (see the module docstring).

    Installed by the plugin through ``GPUModelRunner.pcp_manager_cls`` and built by the
    replay through ``maybe_build_pcp_manager(..., cls=RecordingPCPManager)``. Every override
    calls ``super()`` and returns its result unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ensure_warm_up_wrapper()
        s = active_session()
        self._pcpviz_recorder: RankRecorder | None = s.recorder_for(self) if s is not None else None

    def _build_batch_layout(self, *args: Any, **kwargs: Any):
        segments_by_rank, per_rank_num_tokens = super()._build_batch_layout(*args, **kwargs)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_layout, segments_by_rank, per_rank_num_tokens)
        return segments_by_rank, per_rank_num_tokens

    def partition_batch(self, input_batch, batch_desc):
        rec = recorder_of(self)
        if rec is None:
            return super().partition_batch(input_batch, batch_desc)
        t0 = _now_us()
        rec.guard(rec.begin_step)
        local = super().partition_batch(input_batch, batch_desc)
        rec.guard(rec.on_partition, self, input_batch, local, t0)
        return local

    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_prepare_attn, self, input_batch, block_tables)
        return block_tables, slot_mappings

    def prepare_slot_mappings(self):
        gathered = super().prepare_slot_mappings()
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_slot_mappings, self, gathered)
        return gathered

    def restore_hidden_states(self, hidden_states):
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and self._hidden_restore_idx is not None and ctx.spec.pcp_manager is self:
            ctx.hidden_gathers += 1
        return super().restore_hidden_states(hidden_states)

    def restore_for_sampling(self, hidden_states, aux_hidden_states):
        hidden, aux, batch = super().restore_for_sampling(hidden_states, aux_hidden_states)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_restore_for_sampling, self, batch, len(aux) if aux else 0)
        return hidden, aux, batch

    def prepare_draft_prefill(self, input_batch, input_ids):
        super().prepare_draft_prefill(input_batch, input_ids)
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and ctx.spec.pcp_manager is self and self.draft_prefill_batch is not None:
            # The global shifted draft ids (prepare_prefill_inputs' output), before the gather.
            ctx.global_draft_ids = input_ids[: input_batch.num_tokens].detach().clone()

    def restore_draft_prefill(self, last_hidden_states, hidden_states):
        was_local = self.draft_prefill_batch is not None
        out = super().restore_draft_prefill(last_hidden_states, hidden_states)
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and ctx.spec.pcp_manager is self and ctx.phases and not ctx.dummy:
            ctx.rec.guard(ctx.rec.put, ctx.phases[-1], draft_prefill_restored=np.array(was_local))
        return out


# --------------------------------------------------------------------------- method wrappers

_installed = False
_install_lock = threading.Lock()


def _wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "_pcpviz_wrapper", False))


def _mark(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    fn._pcpviz_wrapper = True  # type: ignore[attr-defined]
    fn._pcpviz_original = original  # type: ignore[attr-defined]
    return fn


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def propose(self, *args: Any, **kwargs: Any) -> Any:
        rec = recorder_of(getattr(self, "pcp_manager", None))
        if rec is None:
            return original(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
            input_batch = bound.arguments["input_batch"]
            dummy = bool(bound.arguments.get("dummy_run", False))
        except TypeError:
            return original(self, *args, **kwargs)
        if dummy and not rec.session.record_dummy:
            return original(self, *args, **kwargs)
        ctx = rec.guard(rec.begin_propose, self, input_batch, dummy)
        if ctx is None:
            return original(self, *args, **kwargs)
        previous = getattr(_tls, "ctx", None)
        _tls.ctx = ctx
        try:
            out = original(self, *args, **kwargs)
        finally:
            _tls.ctx = previous
        rec.guard(rec.end_propose, ctx, out)
        return out

    return _mark(propose, original)


def _wrap_run_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _run_model(self, num_tokens, attn_metadata=None, slot_mappings=None, *args: Any, **kwargs: Any) -> Any:
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and ctx.spec is self:
            ctx.rec.guard(ctx.on_forward, int(num_tokens), slot_mappings)
        return original(self, num_tokens, attn_metadata, slot_mappings, *args, **kwargs)

    return _mark(_run_model, original)


def _wrap_postprocess_sampled(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def postprocess_sampled(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args: Any,
                            **kwargs: Any) -> Any:
        rec = recorder_of(getattr(self, "pcp_manager", None))
        t0 = _now_us()
        out = original(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)
        if rec is not None:
            rec.guard(rec.on_postprocess_sampled, idx_mapping, sampled_tokens, num_sampled, num_rejected, t0)
        return out

    return _mark(postprocess_sampled, original)


def _wrap_prepare_dflash_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_dflash_inputs(input_buffers, query_slot_mapping, context_positions, context_slot_mapping,
                              *args: Any, **kwargs: Any) -> Any:
        out = original(input_buffers, query_slot_mapping, context_positions, context_slot_mapping,
                       *args, **kwargs)
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and not ctx.dummy:
            ctx.rec.guard(_record_dflash_inputs, ctx, input_buffers, query_slot_mapping, context_positions,
                          context_slot_mapping)
        return out

    return _mark(prepare_dflash_inputs, original)


def _record_dflash_inputs(ctx: _DraftContext, input_buffers: Any, query_slots: torch.Tensor,
                          context_positions: torch.Tensor, context_slots: torch.Tensor) -> None:
    """DSpark/DFlash's replicated drafter inputs on the global batch (one draft forward)."""
    spec, batch = ctx.spec, ctx.input_batch
    r, t = int(batch.num_reqs), int(batch.num_tokens)
    nq = r * int(spec.num_query_per_req)
    ctx.dflash_inputs = dict(
        view=np.array("replicated"),
        draft_input_ids=input_buffers.input_ids[:nq],
        draft_positions=input_buffers.positions[:nq],
        draft_seq_lens=input_buffers.seq_lens[:r],
        draft_query_start_loc=input_buffers.query_start_loc[: r + 1],
        slot_mapping_draft=query_slots[:nq].unsqueeze(0),
        draft_context_positions=context_positions[:t],
        draft_context_slot_mapping=context_slots[:t].unsqueeze(0),
        block_table_draft=_block_rows(spec.block_tables, [b[:r] for b in spec.block_tables.input_block_tables],
                                      batch.idx_mapping[:r])[0],
        t_start_us=np.array(ctx.t0, dtype=np.int64),
    )
    ctx.phases = ["draft_0"]


def _wrap_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        global _warmup_depth
        _warmup_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _warmup_depth -= 1

    return _mark(compile_or_warm_up_model, original)


def _warm_up_target() -> tuple[Any, str] | None:
    """``(gpu_worker.Worker, "compile_or_warm_up_model")``; None where the GPU worker module
    cannot be imported (the CPU replay never warms up)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001
        return None
    return (Worker, "compile_or_warm_up_model") if callable(getattr(Worker, "compile_or_warm_up_model", None)) \
        else None


def ensure_warm_up_wrapper() -> None:
    """Wrap ``Worker.compile_or_warm_up_model`` (idempotent). Called when the first
    ``RecordingPCPManager`` is built: inside a GPU worker, after its class exists and before it
    warms up. A no-op where the GPU worker module was never imported (the CPU replay)."""
    if "vllm.v1.worker.gpu_worker" not in sys.modules:
        return
    with _install_lock:
        warm = _warm_up_target()
        if warm is not None and not _wrapped(getattr(*warm)):
            setattr(warm[0], warm[1], _wrap_warm_up(getattr(*warm)))


def _install_instance_wrappers(spec: Any) -> None:
    """Wrap ``gather_block_tables`` / ``compute_slot_mappings`` on the speculator's own
    ``BlockTables`` instance (shared with the runner and the PCP manager): they record only
    inside a recorded ``propose`` on the calling thread."""
    bt = getattr(spec, "block_tables", None)
    if bt is None or getattr(bt, "_pcpviz_instance_wrapped", False):
        return
    gather, compute = bt.gather_block_tables, bt.compute_slot_mappings

    @functools.wraps(gather)
    def gather_block_tables(idx_mapping, num_reqs_padded, out=None, *args: Any, **kwargs: Any):
        result = gather(idx_mapping, num_reqs_padded, out, *args, **kwargs)
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and out is None and ctx.spec.block_tables is bt:
            ctx.on_gather_block_tables()
        return result

    @functools.wraps(compute)
    def compute_slot_mappings(*args: Any, **kwargs: Any):
        result = compute(*args, **kwargs)
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None and ctx.spec.block_tables is bt:
            ctx.rec.guard(ctx.on_compute_slot_mappings, result)
        return result

    bt.gather_block_tables = _mark(gather_block_tables, gather)
    bt.compute_slot_mappings = _mark(compute_slot_mappings, compute)
    bt._pcpviz_instance_wrapped = True


def wrapped_targets() -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of everything ``install_wrappers`` patches (the plugin checks that
    each exists before patching anything)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

    return [
        (TargetDependentARSpeculator, "propose"),
        (TargetDependentARSpeculator, "_run_model"),
        (dflash_speculator.DFlashSpeculator, "propose"),
        (dflash_speculator, "prepare_dflash_inputs"),
        (GPUModelRunner, "postprocess_sampled"),
    ]


_WRAPPERS = {
    "propose": _wrap_propose,
    "_run_model": _wrap_run_model,
    "prepare_dflash_inputs": _wrap_prepare_dflash_inputs,
    "postprocess_sampled": _wrap_postprocess_sampled,
}


def install_wrappers() -> None:
    """Patch the speculator / runner methods (idempotent). Inert unless the object's PCP
    manager is a ``RecordingPCPManager`` with a live recorder."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for owner, name in wrapped_targets():
            current = getattr(owner, name)
            if _wrapped(current):
                continue
            setattr(owner, name, _WRAPPERS[name](current))
        _installed = True


def uninstall_wrappers() -> None:
    """Undo ``install_wrappers`` (tests)."""
    global _installed
    with _install_lock:
        targets = wrapped_targets()
        warm = _warm_up_target() if "vllm.v1.worker.gpu_worker" in sys.modules else None
        for owner, name in targets + ([warm] if warm else []):
            current = getattr(owner, name)
            if _wrapped(current):
                setattr(owner, name, current._pcpviz_original)
        _installed = False
