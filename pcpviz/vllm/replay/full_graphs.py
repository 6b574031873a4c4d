"""The FULL draft-prefill replay under PCP, driven through vLLM 0.33.0's own ``propose``.

``probe_full_graphs()`` runs a scenario on PCP rank threads with the speculator's CUDA-graph
managers built by vLLM (``pcpviz.vllm.replay.graph_dispatch``: real dispatch, stand-in graphs) and
watches every draft forward: which buffers ``get_draft_input_buffers`` handed the model, with
what ids, positions and slot mapping, under which graph mode, and whether the PCP manager's
``draft_prefill_batch`` is still set when ``propose`` returns (docs/findings/full-draft-prefill-state.md).

With ``mode=FULL_DECODE_ONLY``, ``max_num_seqs=5``, K=2 and replicated decodes, the 5-request
decode steps of scenario ``full_graphs`` replay a FULL draft-prefill graph; the draft decodes find
no graph and run eagerly, and each of them is handed the rank-local batch the draft prefill left
set (``DraftForward.stale``). After one request finishes (4 requests) the decodes replay a graph
too and nothing reads the leftover batch; the next ``propose`` clears it either way.

``fix`` applies one candidate fix where it would go in vLLM, to check it against the same run:

* ``"clear_after_replay"``: ``draft_prefill_batch = None`` right after the prefill's
  ``run_fullgraph`` (``propose``, after the FULL branch);
* ``"eager_prefill_under_pcp"``: the draft prefill dispatches eagerly while
  ``draft_prefill_batch`` is set (``need_eager`` in that dispatch).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks
from pcpviz.vllm.replay.graph_dispatch import capture_sizes, capture_stand_ins, init_graph_managers
from pcpviz.vllm.replay.ranks import RankState, ReplayConfig, stand_in_vllm_config
from pcpviz.vllm.replay.scenarios import SCENARIOS
from pcpviz.vllm.replay.scheduler import ScriptedScheduler
from pcpviz.vllm.replay.step import rank_step
from pcpviz.vllm.replay.stand_ins import MTP_LAYER

__all__ = ["DraftForward", "ProposeObservation", "FullGraphProbe", "PROBE_FIXES", "probe_full_graphs"]

PROBE_FIXES = ("clear_after_replay", "eager_prefill_under_pcp")
_LOCAL, _OWN = "rank-local batch", "speculator buffers"


@dataclass(frozen=True)
class DraftForward:
    """One ``_run_model`` of a ``propose``: what ``get_draft_input_buffers`` handed the model
    (``reads``) and what that forward should have read (``should_read``), with their rows."""

    phase: str  # "draft_prefill" | "draft_decode"
    mode: str  # the dispatched graph mode: "FULL" (a replayed graph), "PIECEWISE" or "NONE"
    reads: str
    should_read: str
    input_ids: np.ndarray  # int64[num_tokens]: the rows the model got
    expected_input_ids: np.ndarray  # int64[num_tokens]: the rows of should_read
    positions: np.ndarray
    expected_positions: np.ndarray
    slot_mapping: np.ndarray  # int64[num_tokens or N*P]: the MTP layer's KV-write mapping

    @property
    def stale(self) -> bool:
        """A draft decode handed the draft prefill's rank-local batch."""
        return self.phase == "draft_decode" and self.reads == _LOCAL

    @property
    def wrong_rows(self) -> bool:
        return not (np.array_equal(self.input_ids, self.expected_input_ids)
                    and np.array_equal(self.positions, self.expected_positions))


@dataclass(frozen=True)
class ProposeObservation:
    step: int
    rank: int
    num_reqs: int
    prefill_mode: str
    decode_mode: str | None  # None: K = 1, or propose returned before the decodes
    forwards: tuple[DraftForward, ...]
    found_set: bool  # this propose's prepare_draft_prefill found a batch left from before
    left_set: bool  # draft_prefill_batch is still this step's rank-local batch when propose returns
    full_replays: int  # stand-in FULL graphs replayed in this propose
    target_slot_mapping: np.ndarray  # int64[N*P]: the target's gathered mapping (draft_0's, eager)

    def stale_forwards(self) -> list[DraftForward]:
        return [f for f in self.forwards if f.stale]


@dataclass(frozen=True)
class FullGraphProbe:
    mode: str
    decodes: str
    max_num_seqs: int
    capture_sizes: tuple[int, ...]
    graphs: dict[str, int]  # stand-in FULL graphs per manager
    fix: str | None
    steps: tuple[tuple[ProposeObservation, ...], ...]  # [step][rank]
    collective_mismatch: str | None  # a rank waited in an all_gather another rank never entered
    kv_draft: tuple[np.ndarray, ...]  # per rank, [slots, 2] (token, position) or -1

    def stale(self) -> list[ProposeObservation]:
        return [o for obs in self.steps for o in obs if o.stale_forwards()]

    def format(self) -> str:
        """One line per step and rank: the graph modes, what each draft forward read, the leftover."""
        lines = [f"{self.mode}, decodes {self.decodes}, max_num_seqs {self.max_num_seqs}, capture sizes "
                 f"{list(self.capture_sizes)}, stand-in FULL graphs {self.graphs}, fix {self.fix}"]
        for obs in self.steps:
            for o in obs:
                reads = "; ".join(f"{f.phase} ({f.mode}) read the {f.reads}" + (" [STALE]" if f.stale else "")
                                  for f in o.forwards)
                lines.append(f"step {o.step} rank {o.rank}: {o.num_reqs} requests; {reads}; draft_prefill_batch "
                             f"{'left set' if o.left_set else 'cleared'} at the end of propose")
        if self.collective_mismatch:
            lines.append("collective mismatch: " + self.collective_mismatch)
        return "\n".join(lines)


class _Watch:
    """Instance wrappers on one rank's speculator, PCP manager and graph managers (vLLM's methods
    run unchanged inside); they fill the observation of the current ``propose``."""

    def __init__(self, st: RankState, fix: str | None) -> None:
        self.st, self.fix = st, fix
        self.reset()
        spec, manager = st.spec, st.manager
        prepare, get_buffers = manager.prepare_draft_prefill, manager.get_draft_input_buffers
        run_model = spec._run_model
        pre_dispatch, dec_dispatch = spec.prefill_cudagraph_manager.dispatch, spec.decode_cudagraph_manager.dispatch
        pre_replay = spec.prefill_cudagraph_manager.run_fullgraph
        dec_replay = spec.decode_cudagraph_manager.run_fullgraph

        def prepare_draft_prefill(input_batch: Any, input_ids: torch.Tensor) -> None:
            self.found_set = manager.draft_prefill_batch is not None
            prepare(input_batch, input_ids)

        def get_draft_input_buffers(input_buffers: Any, num_tokens: int) -> Any:
            out = get_buffers(input_buffers, num_tokens)
            self.handed = out[0]
            return out

        def _run_model(num_tokens: int, attn_metadata: Any = None, slot_mappings: Any = None, *a: Any, **kw: Any):
            self.handed = None
            result = run_model(num_tokens, attn_metadata, slot_mappings, *a, **kw)
            self._record(int(num_tokens), slot_mappings)
            return result

        def prefill_dispatch(*a: Any, **kw: Any) -> BatchExecutionDescriptor:
            desc = pre_dispatch(*a, **kw)
            if self.fix == "eager_prefill_under_pcp" and manager.draft_prefill_batch is not None:
                desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=desc.num_tokens,
                                                num_reqs=desc.num_reqs)
            self.phase, self.prefill_mode = "draft_prefill", desc.cg_mode.name
            return desc

        def decode_dispatch(*a: Any, **kw: Any) -> BatchExecutionDescriptor:
            desc = dec_dispatch(*a, **kw)
            self.phase, self.decode_mode = "draft_decode", desc.cg_mode.name
            return desc

        def replay(original: Any, prefill: bool) -> Any:
            def run_fullgraph(desc: BatchExecutionDescriptor) -> None:
                self.full_replays += 1
                self.in_replay = True
                try:
                    original(desc)
                finally:
                    self.in_replay = False
                if prefill and self.fix == "clear_after_replay":
                    manager.draft_prefill_batch = None
            return run_fullgraph

        manager.prepare_draft_prefill, manager.get_draft_input_buffers = prepare_draft_prefill, get_draft_input_buffers
        spec._run_model = _run_model
        spec.prefill_cudagraph_manager.dispatch = prefill_dispatch
        spec.decode_cudagraph_manager.dispatch = decode_dispatch
        spec.prefill_cudagraph_manager.run_fullgraph = replay(pre_replay, True)
        spec.decode_cudagraph_manager.run_fullgraph = replay(dec_replay, False)

    def reset(self) -> None:
        self.phase, self.prefill_mode, self.decode_mode = "draft_prefill", "NONE", None
        self.found_set, self.in_replay, self.full_replays = False, False, 0
        self.handed: Any = None
        self.forwards: list[DraftForward] = []

    def _record(self, num_tokens: int, slot_mappings: Any) -> None:
        st, n = self.st, num_tokens
        local = st.manager._local_batch  # noqa: SLF001 - vLLM's private field, read to name what was handed
        reads = _LOCAL if self.handed is local and local is not None else _OWN
        should = _LOCAL if self.phase == "draft_prefill" and local is not None else _OWN
        src = local if reads == _LOCAL else st.spec.input_buffers
        dst = local if should == _LOCAL else st.spec.input_buffers
        slots = slot_mappings.get(MTP_LAYER) if isinstance(slot_mappings, dict) else None
        mode = "FULL" if self.in_replay else (self.prefill_mode if self.phase == "draft_prefill" else self.decode_mode)
        self.forwards.append(DraftForward(
            self.phase, str(mode), reads, should, _rows(src.input_ids, n), _rows(dst.input_ids, n),
            _rows(src.positions, n), _rows(dst.positions, n),
            np.zeros(0, np.int64) if slots is None else slots.reshape(-1).clone().numpy()))


def _rows(t: torch.Tensor, n: int) -> np.ndarray:
    return t[:n].to(torch.int64).clone().numpy()


class _WatchedGroup(FakePCPGroup):
    """A ``FakePCPGroup`` that counts the ranks inside an ``all_gather`` right now."""

    def __init__(self, world_size: int, *, timeout: float) -> None:
        super().__init__(world_size, timeout=timeout)
        self.inside = 0
        self._count_lock = threading.Lock()

    def all_gather(self, input_: Any, dim: int = 0) -> Any:
        with self._count_lock:
            self.inside += 1
        try:
            return super().all_gather(input_, dim)
        finally:
            with self._count_lock:
                self.inside -= 1


def _abort_when_done(group: _WatchedGroup, fn: Any) -> Any:
    """Run ``fn(rank)``; once a rank has finished, a rank inside a collective waits for a rank
    that will never come: abort the group then (it raises BrokenBarrierError there)."""
    done: set[int] = set()

    def body(rank: int) -> Any:
        try:
            return fn(rank)
        finally:
            done.add(rank)
            while len(done) < group.world_size:
                if group.inside > 0:
                    group.abort()
                    break
                time.sleep(0.02)
    return body


def probe_full_graphs(*, mode: str = "FULL_DECODE_ONLY", decodes: str = "replicated", scenario: str = "full_graphs",
                      max_num_seqs: int = 5, k: int = 2, fix: str | None = None, pcp: int = 2) -> FullGraphProbe:
    """Run ``scenario`` with the draft forwards dispatched through vLLM's graph managers built
    for ``mode`` (``FULL_DECODE_ONLY`` or ``FULL_AND_PIECEWISE``) and record every draft forward.
    Raises ValueError for a bad mode, decodes or fix."""
    cg_mode = _validate(mode, decodes, scenario, fix)
    sc = SCENARIOS[scenario]
    c = ReplayConfig(pcp=pcp, k=k, shard=decodes == "sharded", block_size=4, max_num_reqs=max_num_seqs,
                     max_num_tokens=96, max_model_len=128, vocab=97, hidden=8)
    sizes = capture_sizes(max_num_seqs=max_num_seqs, k=k, max_num_batched_tokens=c.max_num_tokens, mode=cg_mode)
    sched = ScriptedScheduler(sc, c)
    vllm_config = stand_in_vllm_config(c, "mtp")
    group = _WatchedGroup(pcp, timeout=120.0)
    states: list[Any] = [None] * pcp
    watches: list[Any] = [None] * pcp
    graphs: dict[str, int] = {}
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    def build(rank: int) -> None:
        states[rank] = st = RankState(c, vllm_config, PCPManager, sched.num_slots, "mtp")
        init_graph_managers(st.spec, cg_mode, sizes)
        graphs.update(capture_stand_ins(st.spec))
        watches[rank] = _Watch(st, fix)

    run_ranks(group, build)
    steps: list[tuple[ProposeObservation, ...]] = []
    mismatch = None
    for step in range(sc.num_steps):
        out, _ = sched.schedule(step, True)
        for w in watches:
            w.reset()
        group = _WatchedGroup(pcp, timeout=120.0)  # a fresh group: an aborted one stays broken
        try:
            outs = run_ranks(group, _abort_when_done(group, lambda rank: _observed_step(states[rank], watches[rank],
                                                                                       out, step, sched)))
        except threading.BrokenBarrierError:
            calls = list(group.all_gather_calls)
            mismatch = (f"step {step}: a rank waited in an all_gather that another rank never entered (all_gather "
                        f"calls in this step per rank: {calls}; draft prefill modes per rank: "
                        f"{[w.prefill_mode for w in watches]})")
            break
        steps.append(tuple(o for o, _ in outs))
        ref = outs[0][1]
        sched.update(out, ref.req_ids, num_sampled=ref.num_sampled, num_rejected=ref.num_rejected)
    return FullGraphProbe(mode, decodes, max_num_seqs, tuple(sizes), dict(graphs), fix, tuple(steps), mismatch,
                          tuple(s.kv_draft.numpy().copy() for s in states))


def _observed_step(st: RankState, w: _Watch, out: Any, step: int,
                   sched: ScriptedScheduler) -> tuple[ProposeObservation, Any]:
    res = rank_step(st, out, step=step, sched=sched, eager_drafts=False)
    manager = st.manager
    local = manager._local_batch  # noqa: SLF001
    obs = ProposeObservation(step, st.rank, len(res.req_ids), w.prefill_mode, w.decode_mode, tuple(w.forwards),
                             w.found_set, local is not None and manager.draft_prefill_batch is local, w.full_replays,
                             res.slot_mapping_gathered.reshape(-1).copy())
    return obs, res


def _validate(mode: str, decodes: str, scenario: str, fix: str | None) -> CUDAGraphMode:
    if mode not in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        raise ValueError("mode must be FULL_DECODE_ONLY or FULL_AND_PIECEWISE (the FULL modes PCP admits), "
                         f"got {mode!r}")
    if decodes not in ("sharded", "replicated"):
        raise ValueError(f"decodes must be 'sharded' or 'replicated', got {decodes!r}")
    if scenario not in SCENARIOS or SCENARIOS[scenario].drafter != "mtp":
        raise ValueError(f"scenario must be an MTP scenario of {sorted(SCENARIOS)}, got {scenario!r}")
    if fix is not None and fix not in PROBE_FIXES:
        raise ValueError(f"fix must be None or one of {PROBE_FIXES}, got {fix!r}")
    return CUDAGraphMode[mode]


if __name__ == "__main__":  # python -m pcpviz.vllm.replay.full_graphs: the finding's reproduction
    print(probe_full_graphs().format())
    print(probe_full_graphs(decodes="sharded", scenario="one_decode").format())
