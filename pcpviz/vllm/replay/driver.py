"""``replay()``: run a scenario on N PCP rank threads and record it; ``ReplayResult``.

    res = replay(pcp=2, mtp=2, trace_dir="runs/replay", scenario="mixed")
    len(res.steps), len(res.steps[0])        # (5, 2): five steps, two ranks
    res.trace.record(1, 0, "draft_1")["slot_mapping_draft"]     # unexpanded, length R

Every step runs on all ranks at once (``run_ranks``); the driver checks that the ranks agree on
what they sampled and drafted, and that the dummy (profile) run does no block-table gather and
no collective but a MoE layer's (the MoE + DSA checkpoint's profile run all-gathers and
reduce-scatters its experts' rows over PCP, vLLM's ``moe_runner.py:824-829, 853-861``).

``replay(model_dir="data/models/pcpviz-tiny-moe-dsa")`` runs the MoE + DSA checkpoint
(``pcpviz.vllm.replay.tiny_moe``); run.json then says ``model_moe: true``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import vllm
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.pcp_manager import PCPManager

from pcpviz.engine.model_files import check_model_dir
from pcpviz.vllm import fixes as vllm_fixes
from pcpviz.trace.flight import FlightConfig
from pcpviz.vllm import recording
from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks
from pcpviz.vllm.recording import RecordingPCPManager
from pcpviz.vllm.replay.graph_dispatch import GRAPH_STAND_INS, PIECEWISE_STAND_IN, build_replay_graphs
from pcpviz.vllm.replay.ranks import RankState, ReplayConfig, stand_in_vllm_config
from pcpviz.vllm.replay.scenarios import SCENARIOS, Scenario
from pcpviz.vllm.replay.scheduler import ScriptedScheduler
from pcpviz.vllm.replay.stand_ins import DSPARK_MODEL_DECLARATION, DSPARK_STATUS, MODELS_DECLARATION, STAND_INS
from pcpviz.vllm.replay.step import StepOut, dummy_step, rank_step
from pcpviz.vllm.replay.tiny import TINY_MODELS_DECLARATION, TINY_STAND_INS, tiny_model
from pcpviz.vllm.replay.tiny_moe import MOE_MODELS_DECLARATION, MOE_STAND_INS

logger = logging.getLogger("pcpviz.vllm")

__all__ = ["PRODUCER", "ReplayResult", "replay"]

PRODUCER = "vllm-replay"


@dataclass
class ReplayResult:
    """What a replay did. ``trace_path`` is None when nothing was recorded."""

    trace_path: Path | None
    scenario: str
    pcp: int
    num_speculative_tokens: int
    shard_decode_requests: bool
    steps: list[list[StepOut]]  # [step][rank]
    dummy: list[dict[str, Any]] | None  # per rank
    kv_target: list[np.ndarray]  # per rank, [slots, 2] (token, position) or -1
    kv_draft: list[np.ndarray]
    all_gathers: list[int]  # per rank, every collective of the run
    seconds: float
    step_seconds: list[float]
    recording_seconds: float
    meta: dict[str, Any]
    manager_class: type = PCPManager  # the PCPManager (sub)class every rank was built with
    # per rank, the DSA model's indexer-key writes: {"target": [IndexerWrite], "mtp": [...]}; {} for a dense model
    indexer_writes: list[dict[str, list]] = dataclasses.field(default_factory=list)
    # per rank, each attention call's top-k per batch row (int64[q, topk]), the same keys
    indexer_selections: list[dict[str, list]] = dataclasses.field(default_factory=list)
    # where a rank's verify outcome or drafts first differed from rank 0's, one line each ("step 4: rank 2
    # drafted other tokens than rank 0"); the run went on with rank 0's, as vLLM's scheduler does
    rank_divergences: list[str] = dataclasses.field(default_factory=list)

    @property
    def trace(self):
        """The recorded trace (``pcpviz.trace.open(trace_path)``)."""
        if self.trace_path is None:
            raise ValueError("this replay recorded no trace (record=False or no trace_dir)")
        from pcpviz.trace import open as open_trace

        return open_trace(self.trace_path)

    def draft_tokens(self, rank: int = 0) -> list[np.ndarray | None]:
        return [s[rank].draft_tokens for s in self.steps]


MODELS = ("tiny", "scripted")
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")


def _validate(pcp: int, mtp: int, scenario: str, decodes: str, block_size: int, models: str,  # noqa: PLR0913
              graph_mode: str = "NONE") -> Scenario:
    if graph_mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {graph_mode!r}")
    if models not in MODELS:
        raise ValueError(f"models must be one of {', '.join(MODELS)}, got {models!r}")
    if models == "tiny" and scenario in SCENARIOS and SCENARIOS[scenario].drafter == "dspark":
        raise ValueError("the dspark scenario's drafter has no weights: run it with models='scripted'")
    if not isinstance(pcp, int) or isinstance(pcp, bool) or pcp < 1:
        raise ValueError(f"pcp must be an int >= 1, got {pcp!r}")
    if pcp > 8:
        raise ValueError(f"pcp={pcp}: the CPU replay runs ranks as threads; use at most 8")
    if not isinstance(mtp, int) or not 1 <= mtp <= 4:
        raise ValueError(f"mtp (num_speculative_tokens) must be an int in 1..4, got {mtp!r}")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    if decodes not in ("sharded", "replicated"):
        raise ValueError(f"decodes must be 'sharded' or 'replicated', got {decodes!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if pcp == 1 and SCENARIOS[scenario].drafter == "dspark":
        raise ValueError("the dspark scenario needs pcp >= 2 (its PCP path is what it replays)")
    if SCENARIOS[scenario].drafter == "dspark" and decodes != "sharded":
        raise ValueError("the dspark scenario runs with a real ParallelConfig, whose pcp_shard_decode_requests "
                         "is PCP > 1 and DCP == 1: decodes are sharded")
    return SCENARIOS[scenario]


def replay(
    pcp: int = 2,
    mtp: int = 2,
    trace_dir: str | os.PathLike | None = None,
    *,
    scenario: str = "mixed",
    decodes: str = "sharded",
    record: bool = True,
    block_size: int = 4,
    dummy: bool = True,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    models: str | None = None,
    graph_mode: str = "NONE",
    fixes: str | None = None,
    chunked_prefill: bool = True,
    model_dir: str | os.PathLike | None = None,
) -> ReplayResult:
    """Run ``scenario`` through vLLM 0.33.0's real PCP + MTP code on CPU, ``pcp`` ranks as
    threads, ``mtp`` speculative tokens; record a trace into ``trace_dir`` (when given and
    ``record``) through ``RecordingPCPManager`` and the speculator wrappers.

    ``decodes="sharded"`` is vLLM's default for PCP without DCP; ``"replicated"`` runs
    decodes on every rank with rank 0 as the canonical KV writer (what vLLM does under
    DCP > 1; the replay sets the flag directly with DCP kept at 1, as in Scenario B of
    ``docs/vllm-0.33-pcp-mtp.md``). ``record=False`` builds plain ``PCPManager``s (the recording-off
    baseline). ``dummy`` appends a profile run (``propose(dummy_run=True)``) as the last
    step, phase ``dummy``; it must do no block-table gather and no collective but a MoE layer's
    (asserted: a dense model's runs none, the MoE + DSA model's MoE layers gather and reduce-scatter).
    ``models="tiny"`` (the default, except for the ``dspark`` scenario, whose drafter has no
    weights) runs the shipped tiny DeepSeek-V3 checkpoint behind vLLM's model interfaces with
    greedy rejection sampling, so acceptance is measured (``pcpviz.vllm.replay.tiny``);
    ``"scripted"`` runs the weightless stand-ins with the scenario's scripted rejections.
    ``graph_mode`` ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE") builds the speculator's CUDA-graph
    managers and lets vLLM's dispatch pick each draft forward's mode (``pcpviz.vllm.replay.graph_dispatch``:
    stand-in graphs that read the buffers they were captured with).
    ``chunked_prefill=False`` schedules every prompt whole (the scenario's chunks dropped).
    ``model_dir`` (``models="tiny"``): the checkpoint, by default ``data/models/pcpviz-tiny-dsv3``;
    ``data/models/pcpviz-tiny-moe-dsa`` runs the MoE + DSA model, whose MoE layers all-gather and
    reduce-scatter over PCP in every forward, the dummy run's included (``pcpviz.vllm.replay.tiny_moe``).
    ``fixes`` names ``pcpviz.vllm.fixes`` to patch into vLLM for this run (comma-separated; default
    ``$PCPVIZ_FIXES``); run.json lists them under ``vllm_fixes``.
    Raises ValueError for bad arguments.
    """
    fix_names = vllm_fixes.requested(fixes)
    sc, c = _replay_config(pcp, mtp, scenario, decodes=decodes, block_size=block_size, models=models,
                           graph_mode=graph_mode, chunked_prefill=chunked_prefill, model_dir=model_dir)
    recording.install_wrappers()
    sched = ScriptedScheduler(sc, c)
    vllm_config = stand_in_vllm_config(c, sc.drafter)
    run = _Run(sc, c, sched, vllm_config=vllm_config, manager_cls=_manager_class(record, trace_dir), record=record,
               progress=progress, graph_mode=graph_mode)
    meta = _meta(sc, c, sched, graph_mode)
    meta["vllm_fixes"] = list(fix_names)
    t_start = time.perf_counter()
    with vllm_fixes.applied(fix_names):
        trace_path, rec_seconds = _run_recorded(run, trace_dir if record else None, meta=meta, overwrite=overwrite,
                                                dummy=dummy)
    states = run.states
    return ReplayResult(
        trace_path=trace_path, scenario=sc.name, pcp=pcp, num_speculative_tokens=mtp, shard_decode_requests=c.shard,
        steps=run.steps, dummy=run.dummy_out,
        kv_target=[s.kv_target.numpy().copy() for s in states], kv_draft=[s.kv_draft.numpy().copy() for s in states],
        all_gathers=list(run.group.all_gather_calls), seconds=time.perf_counter() - t_start,
        step_seconds=run.step_seconds, recording_seconds=rec_seconds, meta=meta,
        manager_class=PCPManager if states[0].manager is None else type(states[0].manager),
        indexer_writes=[_indexer_log(s, "writes") for s in states],
        indexer_selections=[_indexer_log(s, "selections") for s in states], rank_divergences=run.divergences)


def _replay_config(pcp: int, mtp: int, scenario: str, *, decodes: str, block_size: int, models: str | None,
                   graph_mode: str, chunked_prefill: bool,
                   model_dir: str | os.PathLike | None) -> tuple[Scenario, ReplayConfig]:
    """``replay``'s arguments checked (ValueError for a bad one, before any rank starts) and made its
    scenario and ``ReplayConfig`` (the checkpoint's sizes where ``models="tiny"``)."""
    if models is None:
        models = "scripted" if SCENARIOS.get(scenario) is not None and SCENARIOS[scenario].drafter == "dspark" \
            else "tiny"
    sc = _validate(pcp, mtp, scenario, decodes, block_size, models, graph_mode)
    if not chunked_prefill:
        sc = dataclasses.replace(sc, requests=tuple(dataclasses.replace(r, chunk=None) for r in sc.requests))
    if graph_mode != "NONE" and sc.drafter != "mtp":
        raise ValueError(f"graph_mode={graph_mode} replays the MTP speculator's graph managers; scenario "
                         f"{scenario!r} runs {sc.drafter}")
    if model_dir is not None and models != "tiny":
        raise ValueError(f"model_dir is the weights of models='tiny'; models={models!r} has none")
    model_dir = None if model_dir is None else os.fspath(model_dir)
    if model_dir is not None:
        check_model_dir(model_dir)  # ValueError naming the file: bad input, before any rank starts
    mc = None if models == "scripted" else tiny_model(model_dir).config
    vocab, hidden = (97, 8) if mc is None else (mc.vocab_size, mc.hidden_size)
    if mc is not None and mc.is_moe and mc.moe_intermediate_size % pcp:
        raise ValueError(f"pcp={pcp}: the MoE layers split each expert's {mc.moe_intermediate_size} intermediate "
                         "columns over the PCP ranks (vLLM: the MoE's TP group is PCP x TP); use a divisor")
    c = ReplayConfig(pcp=pcp, k=mtp, shard=pcp > 1 and decodes == "sharded", block_size=block_size, max_num_reqs=8,
                     max_num_tokens=96, max_model_len=128, vocab=vocab, hidden=hidden, models=models,
                     model_dir=model_dir, moe_experts=0 if mc is None else mc.n_routed_experts)
    return sc, c


def _indexer_log(st: RankState, log: str) -> dict[str, list]:
    """The rank's indexer ``writes`` or ``selections`` per model (none for a dense or scripted model)."""
    out = {}
    for name, model in (("target", st.target), ("mtp", st.spec.model)):
        keys = getattr(model, "index_keys", None)
        if keys is not None:
            out[name] = list(getattr(keys, log))
    return out


def _manager_class(record: bool, trace_dir: str | os.PathLike | None) -> type[PCPManager]:
    """The PCPManager class every rank is built with."""
    if not record:
        return PCPManager
    if trace_dir is not None:
        return RecordingPCPManager
    # What GPUModelRunner.__init__ would build: its pcp_manager_cls property (the plugin's
    # RecordingPCPManager when the plugin is enabled), recording into the plugin's session.
    return GPUModelRunner.__dict__["pcp_manager_cls"].fget(None)


class _Run:
    """One replay's rank states and what its steps returned: built, stepped and profiled on
    ``pcp`` rank threads, every step checked for agreement between the ranks."""

    def __init__(self, sc: Scenario, c: ReplayConfig, sched: ScriptedScheduler, *, vllm_config: Any,
                 manager_cls: type[PCPManager], record: bool, progress: Callable[[str], None] | None,
                 graph_mode: str = "NONE") -> None:
        self.sc, self.c, self.sched, self.vllm_config = sc, c, sched, vllm_config
        self.graph_mode = CUDAGraphMode[graph_mode]
        self.manager_cls, self.record, self.progress = manager_cls, record, progress
        self.group = FakePCPGroup(c.pcp, timeout=120.0)
        self.states: list[RankState | None] = [None] * c.pcp
        self.steps: list[list[StepOut]] = []
        self.divergences: list[str] = []  # ReplayResult.rank_divergences
        self.step_seconds: list[float] = []
        self.dummy_out: list[dict[str, Any]] | None = None

    def build(self, rank: int) -> None:
        st = RankState(self.c, self.vllm_config, self.manager_cls, self.sched.num_slots, self.sc.drafter)
        self.states[rank] = st
        if self.graph_mode != CUDAGraphMode.NONE:
            build_replay_graphs(st.spec, self.graph_mode, max_num_batched_tokens=self.c.max_num_tokens)
        if st.manager is None and self.record and recording.current_session() is not None:
            recording.attach_runner(st.runner, recording.current_session())  # PCP = 1

    def run(self, dummy: bool) -> None:
        run_ranks(self.group, self.build)
        for step in range(self.sc.num_steps):
            self.step(step)
        if dummy:
            self.profile_run()

    def step(self, step: int) -> None:
        sched, states = self.sched, self.states
        t0 = time.perf_counter()
        out, _ = sched.schedule(step, True)
        eager = self.graph_mode == CUDAGraphMode.NONE
        outs = run_ranks(self.group, lambda rank: rank_step(states[rank], out, step=step, sched=sched,
                                                            eager_drafts=eager))
        self.step_seconds.append(time.perf_counter() - t0)
        ref = outs[0]
        self._compare_ranks(step, outs)
        sched.update(out, ref.req_ids, num_sampled=ref.num_sampled, num_rejected=ref.num_rejected)
        self.steps.append(outs)
        if self.progress is not None:
            self.progress(f"step {step}: {len(ref.req_ids)} requests, local tokens "
                          f"{[o.local_num_tokens for o in outs]}, drafts {ref.draft_tokens.tolist()}")

    def _compare_ranks(self, step: int, outs: list[StepOut]) -> None:
        """Note where a rank's verify outcome or drafts differ from rank 0's. The run goes on with rank
        0's, as vLLM's scheduler takes one rank's output: the ranks have forked (a KV write or a
        restore went wrong on one of them), and the trace holds every rank's views for ``ranks_agree``
        and ``target_outputs_agree`` to report, rather than the replay stopping before it is written."""
        ref = outs[0]
        for rank, o in enumerate(outs[1:], start=1):
            what = next((f"{name} differs from rank 0's" for name in ("num_sampled", "num_rejected", "sampled")
                         if not np.array_equal(getattr(ref, name), getattr(o, name))), None)
            if what is None and not np.array_equal(ref.draft_tokens, o.draft_tokens):
                what = "drafted other tokens than rank 0"
            if what is not None:
                if not self.divergences:
                    logger.warning("pcpviz replay: step %d: rank %d %s; going on with rank 0's outputs, as vLLM "
                                   "does (pcpviz check reports the ranks' disagreement)", step, rank, what)
                self.divergences.append(f"step {step}: rank {rank} {what}")

    def profile_run(self) -> None:
        """The dummy (profile) run: no block-table gather, no collective but the MoE layers', idx_mapping
        all -1."""
        self.dummy_out = run_ranks(self.group, lambda rank: dummy_step(self.states[rank], self.group))
        for rank, d in enumerate(self.dummy_out):
            facts = {k: v for k, v in d.items() if k not in ("draft_tokens", "moe_reduce_scatters")}
            bad = {k: v for k, v in facts.items() if v not in (0, True)}
            if bad:
                raise RuntimeError(f"dummy run on rank {rank}: {bad} (expected no block-table gather, "
                                   "no all_gather, idx_mapping all -1)")


def _run_recorded(run: _Run, trace_dir: str | os.PathLike | None, *, meta: dict[str, Any], overwrite: bool,
                  dummy: bool) -> tuple[Path | None, float]:
    """Run the replay into a session of its own at ``trace_dir``, or, without one, into the
    plugin's ambient session if the ranks recorded into it: (trace path or None, seconds spent
    recording)."""
    if trace_dir is not None:
        path = Path(trace_dir)
        _check_run_dir(path, overwrite)
        with recording.session(path, producer=PRODUCER, meta=meta, strict=True, record_dummy=True,
                               overwrite=overwrite, flight=FlightConfig.from_env()) as sess:  # PCPVIZ_FLIGHT_*
            run.run(dummy)
        return path, sess.seconds_recording
    run.run(dummy)
    ambient = recording.active_session() if issubclass(run.manager_cls, RecordingPCPManager) else None
    mine = [recording.owner_recorder(s.runner) or getattr(s.manager or s.runner, "_pcpviz_recorder", None)
            for s in run.states]
    if ambient is None or all(r is None for r in mine):
        return None, 0.0
    for r in mine:
        if r is not None:
            r.close()
    return ambient.run_dir, sum(r.seconds for r in mine if r is not None)


def _meta(sc: Scenario, c: ReplayConfig, sched: ScriptedScheduler, graph_mode: str = "NONE") -> dict[str, Any]:
    """run.json of a replay: the stand-ins it ran and the vLLM settings they stand in for."""
    meta = {
        "producer": PRODUCER, "vllm_version": vllm.__version__, "pcp": c.pcp, "dcp": 1,
        "num_speculative_tokens": c.k, "block_size": c.block_size, "block_sizes": [c.block_size],
        "shard_decode_requests": c.shard, "scenario": sc.name, "scenario_description": sc.description,
        "speculative_method": "dspark" if sc.drafter == "dspark" else "mtp",
        "models": MODELS_DECLARATION, "stand_ins": STAND_INS, "model": "pcpviz stand-in (no weights)",
        "replay_models": c.models,
        "max_num_seqs": c.max_num_reqs, "max_num_batched_tokens": c.max_num_tokens,
        "max_model_len": c.max_model_len, "vocab_size": c.vocab, "cudagraph_mode": graph_mode,
        "prompt_token_ids": {rid: p for rid, p in sched.prompts.items()},
        "chunked_prefill": any(r.chunk is not None for r in sc.requests),
    }
    if c.models == "tiny":
        meta["models"], meta["model"] = TINY_MODELS_DECLARATION, "pcpviz-tiny-dsv3 (data/models, float32)"
        meta["stand_ins"] = {**STAND_INS, **TINY_STAND_INS}
        if c.moe_experts:
            meta["models"] = MOE_MODELS_DECLARATION
            meta["stand_ins"] = {**STAND_INS, **TINY_STAND_INS, **MOE_STAND_INS}
    meta["model_moe"] = bool(c.moe_experts)  # routed experts: the MoE layers gather and reduce-scatter over PCP
    if sc.drafter == "dspark":
        meta["dspark_status"] = DSPARK_STATUS
        meta["models"] = MODELS_DECLARATION + "; " + DSPARK_MODEL_DECLARATION
        meta["stand_ins"] = {**STAND_INS, "dspark_model": DSPARK_MODEL_DECLARATION}
    if graph_mode != "NONE":
        meta["stand_ins"] = {**meta["stand_ins"], "cuda_graphs": GRAPH_STAND_INS + "; " + PIECEWISE_STAND_IN}
    return meta


def _check_run_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"trace dir {path} exists and is not a directory")
    if path.is_dir() and not overwrite and any(path.glob("rank*.arrow")):
        raise ValueError(f"trace dir {path} already holds a trace; pass overwrite=True or choose a new directory")
