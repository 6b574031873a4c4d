"""CUDA-graph stand-ins for the replay: vLLM's own graph *dispatch*, a stand-in *replay*.

A CUDA graph needs a GPU; which graph a batch gets does not. Here vLLM 0.33.0's code decides:

* ``capture_sizes`` runs ``VllmConfig._set_cudagraph_sizes`` (the default capture sizes for
  ``max_num_seqs``, K and the token budget) on a namespace config;
* ``init_graph_managers`` runs the speculator's own ``init_cudagraph_manager`` (two
  ``SpeculatorCudaGraphManager``: draft prefill, draft decodes) and so their ``_init_candidates``;
  ``dispatch`` and ``run_fullgraph`` are then vLLM's, unchanged.

Stand-ins, because they need a GPU: the manager's pipeline-parallel group (one stage) and graph
memory pool (none) while it is built, and the captured graphs. ``capture_stand_ins`` plays
``SpeculatorCudaGraphManager.capture`` for every FULL descriptor: it builds the capture-time
attention state with vLLM's ``prepare_inputs_to_capture`` (so its tensors are views of the
persistent buffers a graph would read) and stores a ``StandInGraph``. Its ``replay()`` is what
a replayed graph does: the captured call's tensor work on those buffers, with the Python state
as it was **at capture**: the PCP manager's ``draft_prefill_batch`` was None then (nothing had
been proposed), so the captured ``_run_model`` read the speculator's own buffers and the
captured ``restore_draft_prefill`` gathered nothing. Python state is not changed by a replay:
``draft_prefill_batch`` is put back as it was before it.

PCP=2, K=2, ``max_num_seqs=5``: the default sizes are ``[1, 2, 3, 4, 6, 8, 12, 15, 16, 24]``;
the draft-prefill manager has a FULL graph for 15 tokens / 5 requests, the draft-decode manager
none for 5 requests (its sizes stop at 4), so a 5-request decode-only draft prefill replays a
FULL graph and its draft decodes run eagerly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.config.vllm import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

__all__ = ["capture_sizes", "init_graph_managers", "draft_prefill_manager", "eager_decodes_after_full_prefill",
           "capture_stand_ins", "StandInGraph", "GRAPH_STAND_INS", "PIECEWISE_STAND_IN", "replay_piecewise_as_captured",
           "build_replay_graphs"]

GRAPH_STAND_INS = (
    "CUDA graphs: vLLM's VllmConfig._set_cudagraph_sizes, SpeculatorCudaGraphManager._init_candidates, "
    "dispatch and run_fullgraph run as they are; stand-ins: the manager's pipeline group (one stage) and "
    "graph pool (none) while it is built, and each captured FULL graph, whose replay runs the captured "
    "call on the persistent buffers with the Python state of capture time (draft_prefill_batch None) "
    "and leaves Python state as it was; PIECEWISE pieces run eagerly (run_pw_graph calls the model)"
)


PIECEWISE_STAND_IN = (
    "PIECEWISE draft prefill (replay(graph_mode=...)): the stand-in piecewise graph reads input_ids and positions "
    "at the addresses it was captured with, the speculator's own input_buffers rows [:num_tokens], whatever "
    "_run_model hands it (what vLLM's CUDAGraphWrapper does; its debug address check fails there on GPU, "
    "docs/findings/piecewise-draft-prefill.md); hidden_states are the captured buffer itself"
)


def capture_sizes(*, max_num_seqs: int, k: int, max_num_batched_tokens: int, mode: CUDAGraphMode) -> list[int]:
    """vLLM's default ``cudagraph_capture_sizes`` (``VllmConfig._set_cudagraph_sizes`` on a
    namespace holding the fields it reads; the platform is the CPU one, not data-centre Blackwell).

        >>> capture_sizes(max_num_seqs=5, k=2, max_num_batched_tokens=96, mode=CUDAGraphMode.FULL_DECODE_ONLY)
        [1, 2, 3, 4, 6, 8, 12, 15, 16, 24]
    """
    cc = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=None, cudagraph_capture_sizes=None,
                         post_init_cudagraph_sizes=lambda: None)
    ns = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc, uniform_decode_query_len=1 + k,
        num_speculative_tokens=k, performance_mode="balanced",
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=SimpleNamespace(uses_dynamic_speculative_decoding=lambda: False))
    VllmConfig._set_cudagraph_sizes(ns)
    return list(cc.cudagraph_capture_sizes)


_env_lock = threading.Lock()
_env_users = 0
_env_saved: tuple[Any, Any] | None = None


@contextlib.contextmanager
def _cpu_graph_manager_env() -> Iterator[None]:
    """While a CudaGraphManager is built: one pipeline stage, no graph pool (both need a GPU).

    The replay's rank threads build their managers at the same time, so the stand-ins are put
    in by the first thread to enter and taken out by the last to leave (a plain save/restore
    per thread would restore vLLM's own ``get_pp_group`` under a thread still building)."""
    global _env_users, _env_saved
    with _env_lock:
        if _env_users == 0:
            _env_saved = (cudagraph_utils.get_pp_group, current_platform.get_global_graph_pool)
            cudagraph_utils.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
            current_platform.get_global_graph_pool = lambda: None
        _env_users += 1
    try:
        yield
    finally:
        with _env_lock:
            _env_users -= 1
            if _env_users == 0 and _env_saved is not None:
                cudagraph_utils.get_pp_group, current_platform.get_global_graph_pool = _env_saved
                _env_saved = None


def init_graph_managers(spec: Any, mode: CUDAGraphMode, sizes: list[int]) -> None:
    """The speculator's own ``init_cudagraph_manager(mode)`` with ``sizes`` as the capture sizes
    (written into its config's compilation config, as the runner's resolve step leaves them)."""
    cc = spec.vllm_config.compilation_config
    cc.cudagraph_mode, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = mode, list(sizes), max(sizes)
    with _cpu_graph_manager_env():
        spec.init_cudagraph_manager(mode)


def draft_prefill_manager(mode: CUDAGraphMode, *, sizes: list[int], max_num_seqs: int, k: int,
                          decode: bool = False) -> Any:
    """The draft prefill's ``SpeculatorCudaGraphManager`` (decode query length K+1; ``decode=True``:
    the draft decodes' one, query length 1, mode as ``init_cudagraph_manager`` narrows it), marked
    captured, for ``dispatch`` alone (no graph is replayed)."""
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    if decode:
        mode = CUDAGraphMode.FULL_DECODE_ONLY if mode.decode_mode() == CUDAGraphMode.FULL else CUDAGraphMode.NONE

    cfg = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes),
                                           max_cudagraph_capture_size=max(sizes)),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1),
        speculative_config=SimpleNamespace(uses_dynamic_speculative_decoding=lambda: False),
        cache_config=SimpleNamespace(use_kda_recoverssm=False), num_speculative_tokens=k)
    with _cpu_graph_manager_env():
        mgr = SpeculatorCudaGraphManager(cfg, "cpu", mode, 1 if decode else k + 1)
    mgr._graphs_captured = True  # noqa: SLF001 - dispatch only answers once capture has run
    return mgr


def eager_decodes_after_full_prefill(*, max_num_seqs: int, k: int, mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY,
                                     max_num_batched_tokens: int = 8192) -> list[int]:
    """Request counts R of a decode-only step with a uniform local batch on every rank (replicated
    decodes) whose draft prefill dispatches a FULL graph while its draft decodes find none, with
    vLLM's default capture sizes. ``max_num_seqs=5, k=2`` -> ``[5]``; 256 -> ``[]``; K = 1 has no
    draft decode -> ``[]``."""
    if k < 2:
        return []
    sizes = capture_sizes(max_num_seqs=max_num_seqs, k=k, max_num_batched_tokens=max_num_batched_tokens, mode=mode)
    pre = draft_prefill_manager(mode, sizes=sizes, max_num_seqs=max_num_seqs, k=k)
    dec = draft_prefill_manager(mode, sizes=sizes, max_num_seqs=max_num_seqs, k=k, decode=True)
    q = k + 1
    return [r for r in range(1, max_num_seqs + 1)
            if pre.dispatch(r, r * q, q, 0).cg_mode == CUDAGraphMode.FULL
            and dec.dispatch(r, r, 1, 0).cg_mode != CUDAGraphMode.FULL]


@dataclass
class StandInGraph:
    """A captured FULL graph: ``forward`` is the captured call (its attention state built at
    capture); ``replay()`` runs it with ``draft_prefill_batch`` as it was at capture (None) and
    puts the Python attribute back afterwards. ``replays`` counts the calls."""

    forward: Callable[[], None]
    manager: Any  # the PCP manager (None without PCP)
    replays: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def replay(self) -> None:
        self.replays += 1
        held = None if self.manager is None else self.manager.draft_prefill_batch
        if self.manager is not None:
            self.manager.draft_prefill_batch = None  # the Python state the capture saw
        try:
            self.forward()
        finally:
            if self.manager is not None:
                self.manager.draft_prefill_batch = held  # a replay runs no Python: nothing clears it


def _capture_forward(graph_mgr: Any, fn: Callable[..., None], desc: Any, *, model_state: Any, input_buffers: Any,
                     block_tables: Any, attn_groups: Any, kv_cache_config: Any, decode: bool,
                     num_speculative_steps: int) -> Callable[[], None]:
    """What ``SpeculatorCudaGraphManager.capture``'s ``create_forward_fn`` builds for ``desc``:
    the capture-time attention state (vLLM's ``prepare_inputs_to_capture``) and the call."""
    num_tokens = desc.num_tokens
    num_reqs = desc.num_reqs or min(num_tokens, graph_mgr.max_num_reqs)
    attn_metadata, slot_mappings = prepare_inputs_to_capture(
        num_reqs, num_tokens, model_state, input_buffers, block_tables, attn_groups, kv_cache_config,
        full_cudagraph=True, max_query_len=desc.max_query_len or desc.uniform_token_count)
    kwargs = {"num_speculative_steps": num_speculative_steps} if decode else {}
    return lambda: fn(num_reqs, num_tokens, attn_metadata, slot_mappings, None, CUDAGraphMode.NONE, **kwargs)


def capture_stand_ins(spec: Any) -> dict[str, int]:
    """Play ``TargetDependentARSpeculator.capture`` for the FULL descriptors of both managers:
    a ``StandInGraph`` per descriptor, the manager marked captured. Returns the graph counts."""
    counts = {}
    spec.last_token_indices.zero_()
    spec.idx_mapping.zero_()
    plan = [("prefill", spec.prefill_cudagraph_manager, spec._prefill, spec.target_input_buffers,
             spec.target_attn_groups, False)]
    if spec.num_speculative_steps > 1:
        decode_fn = spec._generate_fused_drafts if spec.supports_decode_metadata_update else spec._generate_draft
        plan.append(("decode", spec.decode_cudagraph_manager, decode_fn, spec.input_buffers, spec.attn_groups, True))
    for name, mgr, fn, buffers, groups, decode in plan:
        for desc in mgr._capture_descs.get(CUDAGraphMode.FULL, []):
            forward = _capture_forward(mgr, fn, desc, model_state=spec.model_state, input_buffers=buffers,
                                       block_tables=spec.block_tables, attn_groups=groups,
                                       kv_cache_config=spec.kv_cache_config, decode=decode,
                                       num_speculative_steps=spec.num_speculative_steps)
            mgr.graphs[desc] = StandInGraph(forward, spec.pcp_manager)
        mgr._graphs_captured = True
        counts[name] = len(mgr.graphs)
    return counts


def replay_piecewise_as_captured(spec: Any) -> None:
    """Make the draft prefill's PIECEWISE graph read what a replayed graph reads: the buffers it was
    captured with. vLLM captures the draft prefill's pieces on ``spec.input_buffers``; under PCP
    ``_run_model`` hands the model the rank-local batch (``get_draft_input_buffers``) at other
    addresses, and a replay ignores them. PCP=2, 13-token prompt: rank 1 is handed its 6 local rows
    but the graph embeds rows 0..5 of the *global* shifted ids (positions 0..5)."""
    mgr = spec.prefill_cudagraph_manager

    def run_pw_graph(model: Any, model_inputs: dict[str, Any]) -> Any:
        n = model_inputs["hidden_states"].shape[0]  # num_tokens
        captured = dict(model_inputs, input_ids=spec.input_buffers.input_ids[:n],
                        positions=spec.input_buffers.positions[:n])
        return model(**captured)

    mgr.run_pw_graph = run_pw_graph


def build_replay_graphs(spec: Any, mode: CUDAGraphMode, *, max_num_batched_tokens: int) -> dict[str, int]:
    """The speculator's graph managers for ``mode``, stand-in FULL graphs, and PIECEWISE pieces that
    read their captured buffers. Returns the FULL graph counts.

    Capture sizes: every size 1..``max_num_batched_tokens`` (a user's ``cudagraph_capture_sizes``),
    so no draft forward is padded: the replay's target forward runs eagerly, and a draft prefill
    padded past the target's rows (16 for 14) would meet a target-sized slot mapping and restore
    (on a GPU the target is padded to the same size)."""
    init_graph_managers(spec, mode, list(range(1, max_num_batched_tokens + 1)))
    counts = capture_stand_ins(spec)
    replay_piecewise_as_captured(spec)
    return counts
