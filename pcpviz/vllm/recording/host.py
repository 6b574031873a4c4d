"""Copies of vLLM's tensors taken when a hook fires, moved to the host once per step.

A hook copies what it records on its device, because vLLM's persistent buffers are overwritten
by the next step (and CUDA graphs replay them by address, so they are never re-allocated). The
copies of a whole step go into one flat byte buffer on the device (``StepPack``): each hook call
appends all of its tensors with one ``torch.cat`` (whatever their dtypes), the tensors the hooks
computed themselves (``Fresh``: fingerprints, gathered rows, the draft tokens ``propose``
returns) are appended once at the end of the step, and ``stage`` starts one copy of the buffer to
pinned host memory and records one event, without waiting. The step thread does no other torch
work for a view: what is derived from vLLM's tensors (``Deferred``: block-table rows past
``num_blocks``, the verify rows past ``num_sampled``, one column of the draft tokens) is computed
on the host from the raw copies, by ``pcpviz.trace.packed``, off the step's path.

What a hook's views become (entries of ``pcpviz.trace.packed``): a device tensor ``("b", offset,
dtype, shape)`` in the step's buffer, a host array ``("a", ...)``, strings (``Strings``) ``("s",
...)``, a ``Deferred`` ``("d", fn, args, index)``. PCP=1, batch 1, K=2: the step's buffer holds
about 2 kB from 5 hook calls; one copy and one event move it to the host.

Block-table rows as a forward pass sees them (``block_rows``), PCP=2, block size 4, a
request with 6 tokens (2 blocks) in a persistent row that held a 3-block request before::

    row in the gathered table   [7, 9, 4, 0, ...]     (4: left over from the previous occupant)
    num_blocks of the request   2
    recorded row                [7, 9, 0, 0, ...]     stale = 1
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pcpviz.trace.fingerprints import row_fingerprints
from pcpviz.trace.packed import host_entry
from pcpviz.vllm.recording.copyplan import BYTE_DTYPES, PlanCache, fresh_bytes
from pcpviz.vllm.recording.replayplan import PlanBook, ReplayPlan, template_entries
from pcpviz.vllm.recording.ring import DeviceRing
from pcpviz.vllm.recording.staged import StagedStep, take_event

__all__ = ["Deferred", "Fresh", "Strings", "StepPack", "to_host", "now_us", "block_rows",
           "fingerprint_view", "HOST_FP_MAX_BYTES"]


class Deferred:
    """A view computed on the host (``pcpviz.trace.packed.DERIVED[fn]``, output ``index``) from
    ``args``: tensors (copied now, with the hook's other views), host values or constants.
    ``output(i)`` is another output of the same computation (computed once)."""

    __slots__ = ("fn", "args", "index")

    def __init__(self, fn: str, args: list, index: int = 0) -> None:
        self.fn, self.args, self.index = fn, args, index

    def output(self, index: int) -> Deferred:
        return Deferred(self.fn, self.args, index)


class Fresh:
    """A tensor the hook computed itself (no vLLM buffer: nothing overwrites it), copied at the
    end of the step with the other fresh ones instead of now."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Slot:
    """The place of a tensor's entry until its copy is packed."""

    __slots__ = ()


class Strings:
    """A list of strings (``req_ids``), copied now, made an array on the host."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = list(items)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()


def to_host(value: Any) -> Any:
    """A tensor (or a list of tensors, stacked) as a NumPy array; bfloat16 as float32."""
    if isinstance(value, torch.Tensor):
        return _numpy(value.detach().cpu())
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return np.stack([to_host(v) for v in value])
    return value


class StepPack:
    """One recorder's device copies of the step being recorded, in its device ring
    (``recording.ring``): per hook call one ``torch.cat(..., out=)`` into the ring of all of its
    device tensors, whatever their dtypes (each seen as its bytes), the fresh tensors the same way
    at the step's end; ``stage`` records one event. No allocation and no host synchronisation on
    the step's thread."""

    def __init__(self, ring: DeviceRing | None = None) -> None:
        self.device: torch.device | None = None  # of the first tensor put: others go to the host now
        self.ring = ring if ring is not None else DeviceRing()
        self.layout: list = []  # (offset in the step, places) per copy
        self.fresh: list = []  # [(box, key, slot, tensor)] copied at the step's end
        self.memo: dict[int, tuple[list, list]] = {}  # id(Deferred.args) -> (args, their entries), this step
        self.held: list | None = None  # the device tensors of puts held for one copy (``hold``)
        self.plans = PlanCache()  # byte views of the hooks' tensors, kept across steps
        self.book = PlanBook()  # hook calls planned once, by key (``replayplan``)
        self.replays: list = []  # this step's plan hits: (phase, entries, offset in the step)
        self.dynamic: dict[tuple, tuple] = {}  # this step's byte views of tensors made anew (``_dynamic_bytes``)
        self.heads: dict[tuple, tuple] = {}  # this step's ``t[:n]`` slices by (id(t), n) (``head``)
        self.seen: dict[int, tuple] = {}  # this step's dynamic tensors by id: (tensor, its bytes and meta)

    def head(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """``t[:n]``, sliced once a step: the batch's ``idx_mapping[:R]`` is read by the target's
        hooks and by every draft phase (a CUDA slice costs ~5 us on one H200's host)."""
        key = (id(t), n)
        got = self.heads.get(key)
        if got is None or got[0] is not t:
            got = self.heads[key] = (t, t[:n])  # t held: its id is not reused before the step is staged
        return got[1]

    def put(self, phase: dict[str, Any], views: dict[str, Any]) -> None:
        """Add one hook call's views to ``phase`` as entries; its device tensors copied now (or
        at the end of ``hold``)."""
        held = self.held
        now: list = [] if held is None else held
        for name, value in views.items():
            # a host array (most of a hook's views by count) straight to its entry
            phase[name] = host_entry(value) if type(value) is np.ndarray else self._entry(value, phase, name, now)
        if now and held is None:
            self._copy(now)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The puts inside share one copy, made when the block ends: for a hook that puts several
        times while vLLM runs nothing (``_run_model``'s entry: the prepared inputs and
        ``hidden_in_fp``; a FULL replay: those and the graph's buffers)."""
        if self.held is not None:
            yield
            return
        self.held = []
        try:
            yield
        finally:
            now, self.held = self.held, None
            if now:
                self._copy(now)

    def _copy(self, items: list, *, planned: bool = True) -> tuple[list, list] | None:
        """One ``cat`` of ``items`` (``(box, key, slot, tensor)``, as bytes) into the ring; the byte
        views and their places (None when the ring is full: the step is dropped, and
        ``DeviceRing.finish`` counts it). ``planned``: byte views kept from earlier steps where a
        tensor reads the same memory (``copyplan.PlanCache``: vLLM's persistent buffers, every step
        after the first)."""
        flat, places, total = [], [], 0
        as_bytes = self.plans.bytes_of if planned else fresh_bytes
        for box, key, slot, t in items:
            b, meta = as_bytes(t)
            flat.append(b)
            places.append((box, key, slot, *meta))
            total += meta[2]
        at = self._into_ring(flat, total)
        if at is None:
            return None
        self.layout.append((at - self.ring.start, places))
        return flat, places

    def _into_ring(self, flat: list, total: int) -> int | None:
        """One copy of the byte views ``flat`` (``total`` bytes) into the ring: its offset there,
        None when the ring is full (the step is dropped; ``DeviceRing.finish`` counts it)."""
        ring = self.ring
        at = ring.reserve(total)
        if at is None:
            return None
        out = ring.buf[at:at + total]
        if len(flat) == 1:
            out.copy_(flat[0])
        else:
            torch.cat(flat, out=out)
        return at

    @contextlib.contextmanager
    def planning(self, phase: dict[str, Any], dynamic: list[torch.Tensor]) -> Iterator[list]:
        """Record a hook's views into ``phase`` as usual (the puts inside share one copy, as in
        ``hold``) and plan them (``replayplan``): ``made[0]`` is the plan after the block, None where
        they cannot be planned (a tensor the hooks computed, a dropped step). ``dynamic``: tensors
        vLLM allocates anew each step, handed again to every ``replay``."""
        made: list = [None]
        if self.held is not None:  # inside another hold: its copy is not this phase's alone
            yield made
            return
        before, nfresh = dict(phase), len(self.fresh)
        self.held = []
        try:
            yield made
        except BaseException:
            self.held = None
            raise
        now, self.held = self.held, None
        copied = self._copy(now) if now else ([], [])
        if copied is None or len(self.fresh) != nfresh:
            self.book.unplannable += 1
            return
        made[0] = _plan(phase, before, copied, dynamic_ids=[id(t) for t in dynamic], tensors=[item[3] for item in now])

    def replay(self, plan: ReplayPlan, phase: dict[str, Any], dynamic: list[torch.Tensor]) -> bool:
        """A planned phase again: one ``cat`` of the plan's byte views and ``dynamic`` into the
        ring and the plan's entries into ``phase``. False (nothing done) when a dynamic tensor's
        dtype or shape is not the planned one."""
        flat = plan.sources
        if plan.dynamic_at:
            flat = list(flat)
            for i, j in plan.dynamic_at:
                b, meta = self._dynamic_bytes(dynamic[j])
                if meta != plan.metas[i]:
                    return False
                flat[i] = b
        at = self._into_ring(flat, plan.total)
        if at is None:
            return True  # the ring is full: the step is dropped (its entries are never read)
        phase.update(plan.entries)
        self.replays.append((phase, plan.entries, at - self.ring.start))
        return True

    def _dynamic_bytes(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A tensor handed to a plan as dynamic (vLLM may make it anew each step) as bytes: a kept
        view where its memory is one the cache holds (a buffer that is persistent after all), else a
        view for this step's copies only, never added to the cache (a storage that is never read
        again would be held until the sweep, and the sweep would walk them). A step's
        ``idx_mapping`` is handed to several hooks: one view of it a step."""
        known = self.seen.get(id(t))  # the same tensor object again this step (``head``): no signature
        if known is not None and known[0] is t:
            return known[1]
        sig = (t.data_ptr(), t.dtype, t.shape, t.stride())
        got = self.dynamic.get(sig)
        if got is None:
            got = self.dynamic[sig] = self.plans.peek(sig) or fresh_bytes(t)
        self.seen[id(t)] = (t, got)  # t held until the step is staged: its id is not reused before
        return got

    def _entry(self, value: Any, box: Any, key: Any, now: list) -> Any:
        if isinstance(value, torch.Tensor):
            if self._packable(value):
                slot = _Slot()
                now.append((box, key, slot, value.detach() if value.requires_grad else value))
                return slot
            return host_entry(np.array(to_host(value)))
        if isinstance(value, Deferred):
            known = self.memo.get(id(value.args))  # another output of the same computation
            if known is None:
                args = [None] * len(value.args)
                known = self.memo[id(value.args)] = (value.args, args)
                for i, a in enumerate(value.args):
                    args[i] = self._entry(a, args, i, now)
            return ("d", value.fn, known[1], value.index)
        if isinstance(value, np.ndarray):
            return host_entry(value)
        if isinstance(value, Fresh):
            t = value.t
            if self._packable(t):
                slot = _Slot()
                self.fresh.append((box, key, slot, t.detach() if t.requires_grad else t))
                return slot
            return host_entry(np.array(to_host(t)))
        if isinstance(value, Strings):
            return ("s", value.items)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return self._entry(Deferred("stack", list(value)), box, key, now)
        return ("v", value)

    def _packable(self, t: torch.Tensor) -> bool:
        if self.device is None:
            self.device = t.device
            self._device_index = t.get_device()  # -1 on the CPU: an int compares without a device object
            self._is_cuda = t.is_cuda
            self.ring.ensure(t.device)
        return t.get_device() == self._device_index and t.is_cuda == self._is_cuda and t.dtype in BYTE_DTYPES

    def stage(self, phases: dict[str, dict[str, Any]]) -> StagedStep | None:
        """The step's copies on their way to the host: the fresh tensors copied into the ring
        (one ``cat``), one event on the current stream; no synchronisation. None when
        the ring had no room for the step (dropped: ``ring.overflow_steps`` counts it)."""
        if self.fresh:
            self._copy(self.fresh, planned=False)  # computed by the hooks this step: new memory every step
        layout, self.layout, self.fresh, self.memo, self.dynamic = self.layout, [], [], {}, {}
        self.heads, self.seen = {}, {}
        replays, self.replays = self.replays, []
        self.plans.staged()
        dropped = self.ring.dropped
        span = self.ring.finish()
        if dropped:
            return None
        if span is None:  # no device tensor in this step
            return StagedStep(phases)
        event = None
        if self.device is not None and self.device.type == "cuda":
            event = take_event(self._device_index)
            event.record()
        return StagedStep(phases, self.ring, span, event, layout=layout, replays=replays)

    def discard(self) -> None:
        """Forget the step being recorded (it is not written)."""
        self.layout, self.fresh, self.memo, self.held, self.replays = [], [], {}, None, []
        self.dynamic, self.heads, self.seen = {}, {}, {}
        self.ring.discard()


def _plan(phase: dict[str, Any], before: dict[str, Any], copied: tuple[list, list], *, dynamic_ids: list[int],
          tensors: list) -> ReplayPlan | None:
    """The plan of the views put into ``phase`` since ``before`` (its entries then), copied as
    ``copied`` (byte views, places) from ``tensors``; the ones in ``dynamic_ids`` are handed anew."""
    flat, places = copied
    where, off = {}, 0
    for _, _, slot, dtype, shape, nbytes in places:
        where[id(slot)] = (off, dtype, shape)
        off += nbytes
    entries = template_entries({k: v for k, v in phase.items() if before.get(k) is not v}, where)
    if entries is None:
        return None
    dynamic_at = [(i, dynamic_ids.index(id(t))) for i, t in enumerate(tensors) if id(t) in dynamic_ids]
    fill = {i for i, _ in dynamic_at}
    sources = [None if i in fill else b for i, b in enumerate(flat)]
    return ReplayPlan(sources, [p[3:] for p in places], dynamic_at, entries)


HOST_FP_MAX_BYTES = 1 << 16
"""Rows up to this many bytes are copied and fingerprinted on the host (off the step's path);
larger ones are fingerprinted on the device, 8 bytes a row. 64 kB keeps a batch-1 decode's rows
(H=7168 bf16, K=2: 3 rows, 43 kB) on the host and a step near 0.3 MB, so a backlog of 128
undrained steps still fits the 64 MiB ring; batch 32 (96 rows, 1.4 MB) stays on the device."""


def fingerprint_view(t: Any, *, at_step_end: bool = False) -> Deferred | Fresh | None:
    """The ``*_fp`` view of the rows ``t`` (float ``[rows, H]``; None for anything else):
    ``row_fingerprints`` of them, equal wherever it is computed. Small rows (a decode batch's)
    are copied with the hook's other views and fingerprinted by the drain (``packed`` ``row_fp``):
    no kernel and no torch work on the step's thread beyond the copy; larger ones on the device.
    PCP=1, batch 1, K=2, H=7168 bf16: 3 rows, 43 kB, copied. ``at_step_end``: small rows nothing
    writes before the step ends are copied with the step's last copy (``Fresh``), not now."""
    if not (isinstance(t, torch.Tensor) and t.ndim == 2 and t.is_floating_point()):
        return None
    if t.numel() * t.element_size() <= HOST_FP_MAX_BYTES:
        return Deferred("row_fp", [Fresh(t) if at_step_end else t])
    return Fresh(row_fingerprints(t))


def now_us() -> int:
    """Wall-clock microseconds (the ``t_start_us`` / ``t_end_us`` views)."""
    return time.time_ns() // 1000


def block_rows(block_tables: Any, tables: Any, idx_mapping: torch.Tensor) -> tuple[Deferred, Deferred]:
    """G forward-pass block tables (rows in batch order) -> the views ``(rows [G, rows, W],
    stale)`` (``pcpviz.trace.packed.block_rows``, computed on the host from copies of the
    tables, ``num_blocks`` and ``idx_mapping`` taken now). A table that is not a vLLM buffer
    (a gather the hook made) is ``Fresh``.

    vLLM's ``_gather_block_tables_kernel`` copies a request's first ``num_blocks`` entries
    into a persistent row and leaves the rest of the row as the previous occupant left it;
    attention never reads past ``num_blocks`` (seq_lens bound it). The recorded rows keep the
    allocated entries and zero the tail, so rows compare with the request's global row;
    ``stale`` counts the non-zero tail entries that were dropped (int64 scalar)."""
    rows = Deferred("block_rows", [*tables, block_tables.num_blocks.gpu, idx_mapping])
    return rows, rows.output(1)
