"""One PCP rank's recorder: the views of the step being recorded, written at its end.

A ``RankRecorder`` collects the phases of one scheduler step (``target``, ``verify``,
``draft_0`` ... ``draft_{K-1}``, or ``dummy``) as the hooks fire, each view a copy taken at
that moment (``recording.host``), and writes the step as one record batch of
``rank{r}.arrow`` when the next step begins or ``propose`` returns (``flush``). The target
phase's hooks are methods here (``on_layout``, ``on_partition``, ``on_prepare_attn``,
``on_slot_mappings``, ``on_restore_for_sampling``), as is verify (``on_postprocess_sampled``);
the draft phases go through a ``recording.drafts.DraftContext`` per ``propose`` call.

PCP=2, K=2, a decode ``d0`` (1 token + 2 drafts) and a prefill ``p1`` (5 tokens): rank 0's
``target`` phase holds the global batch (``req_ids = ["d0", "p1"]``, ``num_scheduled_tokens =
[3, 5]``, ``input_ids`` ``int32[8]``), the layout (``segments``, ``per_rank_num_tokens``), its
rank-local batch (``local_input_ids`` ``int32[P]``) and the block tables / slot mappings;
``verify`` holds ``sampled_token_ids`` ``int64[2, 3]`` (-1 past ``num_sampled``).

Error policy (``guard``): a lenient session (the plugin) logs the first exception of a hook
and switches recording off for that rank; a strict one (the replay) re-raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pcpviz.trace import TraceWriter
from pcpviz.vllm.recording.collectives import Ledger
from pcpviz.vllm.recording.drafts import DraftContext
from pcpviz.vllm.recording.graphs import ledger_views
from pcpviz.trace.meta_model import META_SCHEMA, RunMeta
from pcpviz.trace.packed import int64_entry
from pcpviz.vllm.recording.host import Deferred, StepPack, Strings, now_us
from pcpviz.vllm.recording.ring import ENV_RING_MB
from pcpviz.vllm.recording.meta import environment_meta, speculator_meta
from pcpviz.vllm.recording.procsink import make_sink
from pcpviz.vllm.recording.patching import install_instance_wrappers
from pcpviz.vllm.recording import target_views
from pcpviz.vllm.recording.target_views import where as _where

__all__ = ["RankRecorder"]

logger = logging.getLogger("vllm.pcpviz")


class _Depth(threading.local):
    """How many guards are open on this thread (the outermost one counts a hook's time)."""

    n = 0


class RankRecorder:
    """One PCP rank's steps: the phases of the step being recorded, written at its end."""

    def __init__(self, session: Any, pcp_rank: int, pcp_world_size: int) -> None:
        self.session = session
        self.rank = pcp_rank
        self.pcp_world_size = pcp_world_size
        self.step = 0
        self.phases: dict[str, dict[str, Any]] | None = None
        self.sink = make_sink(self)  # inline (strict sessions), a writer process, or a writer thread
        self.pack = StepPack()  # the device copies of the step being recorded
        self.meta: dict[str, Any] = {}
        self.disabled = False
        self.disabled_reason = ""
        self.closed = False
        self.seconds = 0.0  # time spent inside recording hooks (a guard inside another counted in both)
        self.hook_ns: dict[str, int] = {}  # outermost guard calls' time by hook name (``hook_times``)
        self._depth = _Depth()
        self.steps_written = 0
        self.overflow_after: list[int] = []  # per step dropped by the device ring: the next step's number
        self.global_batch: Any = None  # the step's global InputBatch (verify rows)
        self.graph_notes: dict[str, list] = {}  # phase -> [replays, full replays, moved inputs] (graphs)
        self._layout: tuple[list, list[int]] | None = None
        self._lock = threading.Lock()
        self._meta_lock = threading.Lock()
        self._spec_meta: tuple[int, dict[str, Any]] | None = None  # (id(speculator), its run.json keys)
        self.ledger = Ledger()  # the collectives of the running phase (``recording.collectives``)
        self._attn_meta: tuple | None = None  # the runner whose block sizes run.json has (on_runner_attn)

    # -- error policy
    def guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a recording action; lenient sessions log and disable on error. Its time counts in
        ``seconds`` and, for a guard not inside another on its thread, in ``hook_ns``."""
        if self.disabled:
            return None
        depth = self._depth
        outer = not depth.n
        depth.n += 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.session.strict:
                raise
            self.disabled = True
            self.disabled_reason = (f"recording switched off after an error in {getattr(fn, '__name__', fn)}: "
                                    f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
            logger.warning("pcpviz: recording disabled on PCP rank %d after an error in %s: %s: %s "
                           "(vLLM continues unaffected)", self.rank, getattr(fn, "__name__", fn),
                           type(exc).__name__, exc)
            return None
        finally:
            dt = time.perf_counter_ns() - t0
            depth.n -= 1
            self.seconds += dt * 1e-9
            if outer:
                name = getattr(fn, "__qualname__", "?")
                self.hook_ns[name] = self.hook_ns.get(name, 0) + dt

    def hook_times(self) -> dict[str, int]:
        """Nanoseconds spent in each hook so far (outermost guard calls, by qualified name), a copy."""
        return dict(self.hook_ns)

    # -- steps and phases
    def begin_step(self) -> None:
        if self.phases is not None:
            self.flush()
        self.phases = {}
        self.graph_notes = {}
        self.ledger.switch(self, "target")

    def phase(self, name: str) -> dict[str, Any]:
        if self.phases is None:
            self.phases = {}
        return self.phases.setdefault(name, {})

    def put(self, phase: str, **views: Any) -> None:
        """Record views of ``phase`` as they are now (``host.StepPack.put``: one copy of the
        hook's tensors on their device)."""
        self.pack.put(self.phase(phase), views)

    def flush(self) -> None:
        """Hand the pending step (if any) to the sink: staged now, written off the step's path."""
        if self.phases is not None:
            self.ledger.switch(self, None)  # the last phase's collectives
        with self._lock:
            phases, self.phases = self.phases, None
            notes, self.graph_notes = self.graph_notes, {}
            if not phases or self.closed:
                return
            for ph, entries in ledger_views(notes).items():
                if ph in phases:
                    phases[ph].update(entries)
            staged = self.pack.stage(phases)
            if staged is None:  # the device ring had no room: the step is dropped, and the trace says so
                self._overflowed()
                return
            step, self.step = self.step, self.step + 1
            self.steps_written += 1
        self.sink.submit(step, staged)

    def _overflowed(self) -> None:
        """A step did not fit in the device ring (``recording.ring``): counted, warned once, stated
        in run.json (``device_ring_overflow``) and, at the end, in the rank's completion record."""
        ring = self.pack.ring
        self.overflow_after.append(self.step)
        if ring.overflow_steps == 1:
            logger.warning("pcpviz: PCP rank %d: the device ring (%g MiB, %s) is full; step %d and any later step that "
                           "does not fit are not recorded (the trace says how many)", self.rank,
                           ring.capacity / (1 << 20), ENV_RING_MB, self.step)
        if ring.overflow_steps & (ring.overflow_steps - 1) == 0:  # 1, 2, 4, 8...: run.json stays current, cheaply
            self.update_meta(device_ring_overflow=self.overflow_meta())

    def overflow_meta(self) -> dict[str, Any]:
        """run.json's ``device_ring_overflow``: steps dropped, the ring's bytes, and the recorded
        step each drop came before (the first 64)."""
        ring = self.pack.ring
        return {"steps": ring.overflow_steps, "ring_bytes": ring.capacity, "before_step": self.overflow_after[:64]}

    def run_meta(self) -> RunMeta:
        """run.json as this rank knows it (rank 0 writes it; any thread), encoded from the type: the
        recorder's own keys must be ``RunMeta`` fields (``RunMeta.build`` raises on another name or
        a malformed value); the session's keys that are none go to ``extra`` as given."""
        with self._meta_lock:
            if "torch_version" not in self.meta:
                self.meta.update(environment_meta())
            own = dict(self.meta)
        given = self.session.meta
        keys = {"pcp": self.pcp_world_size, **{k: v for k, v in given.items() if k in META_SCHEMA}, **own}
        return RunMeta.build(**keys, extra={k: v for k, v in given.items() if k not in META_SCHEMA})

    def flush_quietly(self) -> None:
        """Write the pending step if it can be (an exception just broke the step: best effort)."""
        try:
            if not self.disabled:
                self.flush()
        except Exception:  # noqa: BLE001 - the step's own exception is the one that matters
            self.phases = None
            self.pack.discard()

    def dump(self, trigger: str) -> None:
        """Flight-recorder mode: dump the ring now (``trigger`` names why); else nothing."""
        self.sink.dump(trigger)

    def update_meta(self, **meta: Any) -> None:
        with self._meta_lock:
            fresh = {k: v for k, v in meta.items() if self.meta.get(k) != v}
            if not fresh:
                return
            self.meta.update(fresh)
        self.sink.meta_changed()

    @property
    def writer(self) -> TraceWriter | None:
        """The rank file's writer once the first step was written (None before, in flight mode,
        and where a writer process writes it: ``sink.stats()`` then)."""
        return getattr(self.sink, "writer", None)

    def close(self, reason: str = "finished") -> None:
        """Write the pending step and finalize the rank file (end-of-stream marker, completion
        record) and the flight ring: ``complete`` with ``reason``, or ``partial`` when recording
        was switched off after an error, the size cap was reached or the last step could not be
        written. Idempotent."""
        if self.closed:
            return
        try:
            if not self.disabled:
                self.flush()
        except Exception as exc:  # noqa: BLE001
            if self.session.strict:
                raise
            self.disabled_reason = f"the last step could not be written: {type(exc).__name__}: {exc}"
            logger.warning("pcpviz: could not write the last step on PCP rank %d: %s", self.rank, exc)
        finally:
            self.closed = True
            if self.pack.ring.overflow_steps and not self.disabled_reason:
                self.update_meta(device_ring_overflow=self.overflow_meta())
                self.disabled_reason = (f"device ring overflow: {self.pack.ring.overflow_steps} steps not recorded "
                                        f"({ENV_RING_MB}={self.pack.ring.capacity / (1 << 20):g})")
            self.sink.close({"status": "partial", "reason": self.disabled_reason} if self.disabled_reason
                            else {"status": "complete", "reason": reason})

    # -- target: global batch, layout, local batch
    def on_layout(self, segments_by_rank: list, per_rank_num_tokens: list[int]) -> None:
        self._layout = (segments_by_rank, list(per_rank_num_tokens))

    def on_partition(self, manager: Any, global_batch: Any, local: Any, *, t0: int) -> None:
        """``partition_batch``'s views (``recording.target_views``: planned)."""
        self.global_batch = global_batch
        segs, per_rank = self._layout or ([], [])
        self._layout = None
        target_views.on_partition(self, manager, global_batch, local=local, segments=segs, per_rank=per_rank, t0=t0)
        self.update_meta(pcp=manager.pcp_world_size, dcp=manager.dcp_world_size,
                         shard_decode_requests=bool(manager.shard_decode_requests))

    def on_global_batch(self, runner: Any, batch: Any, t0: int) -> None:
        """PCP=1's global batch (``recording.target_views``: planned)."""
        self.global_batch = batch
        target_views.on_global_batch(self, batch, t0)
        self.update_meta(pcp=1, dcp=int(getattr(runner, "dcp_size", 1) or 1))

    def on_runner_attn(self, runner: Any, batch: Any, *, block_tables: Any, slot_mappings: torch.Tensor) -> None:
        """PCP=1: ``GPUModelRunner.prepare_attn``'s block-table rows and slots (``recording.target_views``)."""
        bt = runner.block_tables
        target_views.on_runner_attn(self, bt, batch, block_tables=block_tables, slot_mappings=slot_mappings)
        meta = (id(bt), getattr(runner, "dcp_rank", 0), getattr(runner, "cp_interleave", 1))
        if meta != self._attn_meta:  # the block sizes and DCP settings are the runner's for the run
            self._attn_meta = meta
            self.update_meta(block_size=int(bt.block_sizes[0]), block_sizes=[int(b) for b in bt.block_sizes],
                             dcp_rank=int(getattr(runner, "dcp_rank", 0) or 0),
                             dcp_interleave=int(getattr(runner, "cp_interleave", 1) or 1))

    def planned_put(self, phase: str, key: tuple, dynamic: list, *, views: Callable[..., dict[str, Any]]) -> None:
        """Put ``views(*dynamic)`` into ``phase`` through a plan (``recording.replayplan``): the
        first time ``key`` is seen the views are built and planned, every later time they are one
        copy of the same buffers and of ``dynamic`` (tensors vLLM makes anew each step). ``key``
        names everything the views depend on besides the buffers' bytes."""
        pack, box = self.pack, self.phase(phase)
        plan = pack.book.get(key)
        if plan is not None and pack.replay(plan, box, dynamic):
            return
        with pack.planning(box, dynamic) as made:
            pack.put(box, views(*dynamic))
        if made[0] is not None:
            pack.book.add(key, made[0])

    def on_prepare_attn(self, manager: Any, local: Any, block_tables: Any) -> None:
        """``prepare_attn``'s block-table rows (``recording.target_views``: planned)."""
        bt = manager._block_tables
        target_views.on_prepare_attn(self, manager, local, block_tables=block_tables)
        self.update_meta(block_size=int(bt.block_sizes[0]), block_sizes=[int(b) for b in bt.block_sizes],
                         dcp_rank=int(manager.dcp_rank), dcp_interleave=int(manager.cp_interleave))

    def on_slot_mappings(self, manager: Any, gathered: torch.Tensor) -> None:
        g = manager._global_batch
        self.put("target", slot_mapping_global=manager._global_batch_slot_mappings[:, : g.num_tokens],
                 slot_mapping_gathered=gathered)

    def on_restore_for_sampling(self, manager: Any, batch: Any, num_aux: int) -> None:
        self.put("target", sampled_logits_rows=batch.logits_indices,
                 sampled_from=np.array("global" if batch is manager._global_batch else "local"),
                 num_aux_hidden_states_restored=np.array(num_aux, dtype=np.int64),
                 t_end_us=np.array(now_us(), dtype=np.int64))

    # -- verify
    def on_postprocess_sampled(self, idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor, *,
                               num_rejected: torch.Tensor, t0: int, cursor: torch.Tensor | None = None) -> None:
        """The verify phase: ``sampled_token_ids`` ``int64[R, K+1]`` (PAD = -1 past
        ``num_sampled``), ``num_sampled`` / ``num_rejected`` / ``num_accepted`` ``int64[R]`` and
        ``idx_mapping`` ``int32[R]`` (-1 marks a masked row, which vLLM's ``post_update`` skips).
        ``cursor``: ``req_states.num_computed_tokens.gpu`` ``int32[max_num_reqs]`` once ``post_update``
        rolled back the rejected drafts; ``num_computed_after`` is its rows for the batch (a copy of
        the whole table, taken with the other views; the rows are taken on the host)."""
        self.ledger.switch(self, "verify")
        g = self.global_batch
        r = num_sampled.shape[0]
        views: dict[str, Any] = {}
        if g is not None and g.num_reqs == r:
            views["req_ids"] = Strings(g.req_ids)
            views["num_draft_tokens"] = (np.zeros(r, dtype=np.int64) if g.num_draft_tokens_per_req is None
                                         else np.asarray(g.num_draft_tokens_per_req[:r], dtype=np.int64))
        with_cursor = isinstance(cursor, torch.Tensor) and cursor.ndim == 1
        target = (self.phases or {}).get("target")
        if target is not None and "t_end_us" not in target:
            target["t_end_us"] = int64_entry(t0)  # PCP=1: no restore_for_sampling

        def device_views(idx: torch.Tensor, sampled: torch.Tensor, ns: torch.Tensor, nr: torch.Tensor) -> dict:
            # vLLM writes sampled_tokens[i, :num_sampled[i]] only: on a GPU the rest of the row is
            # whatever the buffer held (a rejected draft, an older step). Recorded as -1, on the host
            # (pcpviz.trace.packed.verify_views) from copies of the three tensors taken now.
            verify = Deferred("verify", [sampled, ns, nr])
            out = {"idx_mapping": idx, "sampled_token_ids": verify, "num_sampled": verify.output(1),
                   "num_rejected": verify.output(2), "num_accepted": verify.output(3)}
            if with_cursor:
                out["num_computed_after"] = Deferred("take_rows", [cursor, idx])
            return out

        key = ("verify", r, _where(cursor) if with_cursor else None)
        self.planned_put("verify", key, [idx_mapping, sampled, num_sampled, num_rejected], views=device_views)
        self.put("verify", **views)
        box = self.phase("verify")
        box["t_start_us"], box["t_end_us"] = int64_entry(t0), int64_entry(now_us())

    # -- drafts
    def begin_propose(self, spec: Any, input_batch: Any, dummy: bool) -> DraftContext:
        if dummy:
            # A dummy/profile run is its own step (no partition_batch precedes it).
            self.begin_step()
        self.ledger.switch(self, "dummy" if dummy else "draft_0")
        install_instance_wrappers(spec)
        if self._spec_meta is None or self._spec_meta[0] != id(spec):
            self._spec_meta = (id(spec), speculator_meta(spec))  # the speculator's settings do not change
        self.update_meta(**self._spec_meta[1])
        return DraftContext(self, spec, input_batch, dummy)

    def end_propose(self, ctx: DraftContext, draft_tokens: torch.Tensor | None) -> None:
        ctx.finish(draft_tokens)
        self.flush()
