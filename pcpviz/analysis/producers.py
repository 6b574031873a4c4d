"""Who wrote each recorded view: the producer map, one registry for vLLM 0.33.0 and one for the
engine, and ``attribute`` that names the producer of a first wrong value.

A ``Producer`` is a function or kernel: where it is (vLLM: ``file`` under ``vllm/`` and the ``line``
of its ``def``, held against the installed package by ``tests/analysis/test_producers.py``; the
engine: ``module:qualname``, its line read from this checkout), the source names it ``reads``
(held too), the recorded views it writes (``writes``, ``phase.view``; ``draft_k`` any draft step
k >= 1, ``draft_1`` the first only) and the recorded views its inputs are (``inputs``;
``prev_verify`` is the previous step's verify, ``draft_prev`` the previous draft step).
``unrecorded`` names the inputs no trace records. Which map applies is the trace's producer
(run.json ``producer``): ``vllm-plugin`` and ``vllm-replay`` -> ``VLLM``, ``pcpviz-engine`` ->
``ENGINE_PRODUCERS``; the synthetic producer has none.

``attribute(producer, phase, view, ...)`` walks from the first wrong value up: PCP=2, draft_1
``draft_seq_lens`` wrong, ``target.seq_lens`` and ``verify.num_rejected`` right -> "written by
`prepare_decode_inputs` (vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py:862) from
`target.seq_lens`, `verify.num_rejected`, all right: the fault is inside it".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the pcpviz package

__all__ = ["Producer", "VLLM", "ENGINE_PRODUCERS", "MAPS", "producer_map", "producer_of", "Attribution", "attribute",
           "INSIDE", "INPUTS_WRONG", "UNKNOWN",
           "attribute_violation", "attribute_divergence",
           "patched_function"]


@dataclass(frozen=True)
class Producer:
    name: str  # the function or kernel
    where: str  # vLLM: file under vllm/ ("v1/worker/gpu/block_table.py"); engine: "module:qualname"
    line: int  # vLLM: its def line (0 for the engine: read from the source)
    reads: tuple[str, ...]  # names it reads, as in its source
    writes: tuple[str, ...]  # phase.view it writes
    inputs: tuple[str, ...] = ()  # phase.view of its recorded inputs
    unrecorded: tuple[str, ...] = ()  # inputs no trace records

    def cite(self) -> str:
        if self.line:
            return f"vllm/{self.where}:{self.line}"
        return _engine_cite(self.where)


_G, _P, _S, _BT = "v1/worker/gpu/", "v1/worker/gpu/pcp_manager.py", "v1/worker/gpu/spec_decode/", \
    "v1/worker/gpu/block_table.py"
_AR = _S + "target_dependent_ar/speculator.py"
_LOCAL = ("local_req_ids", "local_idx_mapping", "local_input_ids", "local_positions", "local_query_start_loc",
          "local_seq_lens", "local_logits_indices", "local_is_padding", "local_is_prefilling",
          "local_num_computed_tokens", "moe_is_padding")
_LAYOUT = ("segments", "per_rank_num_tokens", "padded_gather_idx", "hidden_restore_idx", "kv_write_mask")
_t = lambda *v: tuple(f"target.{x}" for x in v)  # noqa: E731

_CAPTURED = ("the buffers the forward's CUDA graph was captured with: a PIECEWISE or FULL replay reads those, not "
             "the ones it is handed (docs/findings/piecewise-draft-prefill.md)")
VLLM: tuple[Producer, ...] = (
    Producer("GPUModelRunner.prepare_inputs", _G + "model_runner.py", 1388, ("scheduler_output",),
             _t("req_ids", "idx_mapping", "num_scheduled_tokens", "num_computed_tokens", "query_start_loc",
                "is_prefilling", "prefill_len", "num_draft_tokens", "logits_indices"),
             unrecorded=("SchedulerOutput", "req_states")),
    Producer("prepare_pos_seq_lens", _G + "input_batch.py", 393,
             ("idx_mapping", "query_start_loc", "num_computed_tokens", "pos", "seq_lens"),
             _t("positions", "seq_lens"), _t("idx_mapping", "query_start_loc") + ("prev_verify.num_computed_after",),
             unrecorded=("req_states.num_computed_tokens (the GPU cursor) of a request the previous step did "
                         "not schedule",)),
    Producer("combine_sampled_and_draft_tokens", _G + "input_batch.py", 475,
             ("input_ids", "last_sampled_tokens", "query_start_loc", "seq_lens", "prefill_len", "draft_tokens"),
             _t("input_ids"), _t("query_start_loc", "seq_lens", "prefill_len") + ("prev_verify.sampled_token_ids",),
             unrecorded=("the prompt tokens (prepare_prefill_inputs)",)),
    Producer("PCPManager.partition_batch", _P, 468, ("input_batch", "num_scheduled_tokens", "is_prefilling"),
             _t(*_LAYOUT, *_LOCAL), _t("num_scheduled_tokens", "is_prefilling", "num_computed_tokens", "positions",
                                       "input_ids", "query_start_loc")),
    Producer("BlockTables.gather_block_tables", _BT, 160, ("idx_mapping", "num_reqs_padded"),
             _t("block_table_global", "block_table_local") + ("draft_0.block_table_draft",),
             _t("idx_mapping"), unrecorded=("the persistent block tables",)),
    Producer("BlockTables.gather_block_tables", _BT, 160, ("idx_mapping", "num_reqs_padded"),
             ("draft_k.block_table_draft",), ("verify.idx_mapping",), unrecorded=("the persistent block tables",)),
    Producer("BlockTables.compute_slot_mappings", _BT, 229, ("idx_mapping", "query_start_loc", "positions"),
             _t("slot_mapping_global") + ("draft_0.slot_mapping_draft",),
             _t("block_table_global", "query_start_loc", "positions")),
    Producer("PCPManager._convert_to_gathered_slot_mappings", _P, 805,
             ("global_batch_slot_mappings", "_padded_gather_idx", "_gathered_kv_write_mask"),
             _t("slot_mapping_gathered"), _t("slot_mapping_global", "padded_gather_idx", "kv_write_mask")),
    Producer("BlockTables.compute_slot_mappings", _BT, 229, ("idx_mapping", "query_start_loc", "positions"),
             ("draft_k.slot_mapping_draft",), ("draft_k.block_table_draft", "draft_k.draft_positions")),
    Producer("PCPManager.restore_hidden_states", _P, 833, ("hidden_states", "_hidden_restore_idx"),
             _t("hidden_fp"), _t("hidden_restore_idx"),
             unrecorded=("the target forward's rank-local hidden rows (all-gathered here)",)),
    Producer("PCPManager.restore_draft_prefill", _P, 865,
             ("last_hidden_states", "hidden_states", "restore_hidden_states"),
             ("draft_0.hidden_last_fp", "draft_0.hidden_out_fp"),
             ("draft_0.mtp_local_fp", "draft_0.draft_last_token_indices") + _t("hidden_restore_idx"),
             unrecorded=("the other ranks' MTP rows (all-gathered here); at PCP = 1 nothing is restored and these "
                         "are the MTP forward's own rows",)),
    Producer("PCPManager.restore_for_sampling", _P, 882, ("hidden_states", "aux_hidden_states"),
             _t("sampled_logits_rows", "sampled_from", "num_aux_hidden_states_restored"),
             _t("hidden_restore_idx", "logits_indices")),
    Producer("get_num_sampled_and_rejected", _G + "input_batch.py", 545,
             ("num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"),
             ("verify.num_sampled", "verify.num_rejected"), _t("seq_lens", "prefill_len", "num_draft_tokens"),
             unrecorded=("the rejection kernel's num_sampled",)),
    Producer("post_update", _G + "input_batch.py", 636, ("num_computed_tokens", "num_rejected", "query_start_loc"),
             ("verify.num_computed_after",), _t("positions", "query_start_loc") + ("verify.num_rejected",)),
    Producer("rejection_sample", _S + "rejection_sampler_utils.py", 1085, ("draft_sampled", "cu_num_logits"),
             ("verify.sampled_token_ids", "verify.num_accepted", "verify.num_draft_tokens", "verify.req_ids",
              "verify.idx_mapping"), _t("input_ids", "logits_indices", "num_draft_tokens"),
             unrecorded=("the target's logits",)),
    Producer("prepare_prefill_inputs", _AR, 768, ("last_token_indices", "num_sampled", "num_rejected",
                                                  "last_sampled", "next_prefill_tokens"),
             ("draft_0.draft_global_input_ids", "draft_0.draft_last_token_indices"),
             _t("input_ids", "positions", "query_start_loc", "seq_lens") + (
                 "verify.num_sampled", "verify.num_rejected", "verify.sampled_token_ids"),
             unrecorded=("next_prefill_tokens (the request state's next prompt tokens)",)),
    Producer("PCPManager.prepare_draft_prefill", _P, 848, ("input_batch", "input_ids"),
             ("draft_0.draft_input_ids", "draft_0.draft_positions", "draft_0.draft_seq_lens", "draft_0.view",
              "draft_0.draft_prefill_restored"),
             ("draft_0.draft_global_input_ids",) + _t("local_positions", "local_seq_lens", "padded_gather_idx")),
    Producer("TargetDependentARSpeculator._run_model", _AR, 374,
             ("input_buffers", "get_draft_input_buffers", "cudagraph_runtime_mode"),
             ("draft_0.fwd_input_ids", "draft_0.fwd_positions"), ("draft_0.draft_input_ids", "draft_0.draft_positions"),
             unrecorded=(_CAPTURED,)),
    Producer("TargetDependentARSpeculator._run_model", _AR, 374,
             ("input_buffers", "get_draft_input_buffers", "cudagraph_runtime_mode"),
             ("draft_k.fwd_input_ids", "draft_k.fwd_positions"), ("draft_k.draft_input_ids", "draft_k.draft_positions"),
             unrecorded=(_CAPTURED,)),
    Producer("TargetDependentARSpeculator._generate_draft", _AR, 634, ("num_reqs", "attn_metadata", "slot_mappings"),
             ("draft_0.draft_tokens", "draft_k.draft_tokens"),
             ("draft_0.draft_input_ids", "draft_0.draft_positions", "draft_k.draft_input_ids",
              "draft_k.draft_positions", "draft_k.draft_seq_lens"), unrecorded=("the hidden states",)),
    Producer("prepare_decode_inputs", _AR, 862, ("draft_tokens", "target_seq_lens", "num_rejected"),
             ("draft_1.draft_input_ids", "draft_1.draft_positions", "draft_1.draft_seq_lens", "draft_1.view"),
             ("draft_0.draft_tokens",) + _t("seq_lens") + ("verify.num_rejected",)),
    Producer("update_draft_inputs", _AR, 962, ("draft_tokens", "current_draft_step", "input_buffers"),
             ("draft_k.draft_input_ids", "draft_k.draft_positions", "draft_k.draft_seq_lens", "draft_k.view"),
             ("draft_prev.draft_tokens", "draft_prev.draft_positions", "draft_prev.draft_seq_lens")),
)
"""vLLM 0.33.0's producers of the recorded views (file under vllm/, def line)."""

_W, _SP, _RB = "pcpviz.engine.worker:Worker.", "pcpviz.engine.speculator:", "pcpviz.reference.blocks:"
ENGINE_PRODUCERS: tuple[Producer, ...] = (
    Producer("Worker._global_batch", _W + "_global_batch", 0, ("sched",),
             _t("req_ids", "idx_mapping", "num_scheduled_tokens", "num_computed_tokens", "query_start_loc",
                "is_prefilling", "prefill_len", "num_draft_tokens", "logits_indices"),
             unrecorded=("SchedulerOutput",)),
    Producer("Worker._global_batch", _W + "_global_batch", 0, ("ids", "drafts", "last_sampled"),
             _t("input_ids"), _t("scheduled_draft_ids", "query_start_loc") + ("prev_verify.sampled_token_ids",),
             unrecorded=("the prompt tokens of a prefilling request",)),
    Producer("Worker._global_batch", _W + "_global_batch", 0, ("gpu", "qsl"),
             _t("positions", "seq_lens"), _t("query_start_loc") + ("prev_verify.num_computed_after",),
             unrecorded=("the GPU cursor of a request the previous step did not schedule",)),
    Producer("Worker._resolve_drafts", _W + "_resolve_drafts", 0, ("host", "keep", "drafts"),
             _t("scheduled_draft_ids"), ("prev_draft_0.draft_tokens", "prev_draft_1.draft_tokens")),
    Producer("Worker._verify", _W + "_verify", 0, ("num_computed", "num_scheduled_tokens", "rejected"),
             ("verify.num_computed_after",), _t("positions", "query_start_loc") + ("verify.num_rejected",)),
    Producer("_rank_chunks", "pcpviz.reference.chunks:_rank_chunks", 0, ("rank", "q", "replicated", "shard_decodes"),
             _t("segments", "per_rank_num_tokens"), _t("num_scheduled_tokens", "is_prefilling")),
    Producer("gather_maps", "pcpviz.reference.chunks:gather_maps", 0, ("segments_by_rank", "num_tokens", "prefill"),
             _t("padded_gather_idx", "hidden_restore_idx", "kv_write_mask"),
             _t("segments", "per_rank_num_tokens", "is_prefilling")),
    Producer("Worker.prepare", _W + "prepare", 0, ("sched", "local_positions", "local_seq_lens"),
             _t("local_positions", "local_seq_lens"), _t("positions", "local_query_start_loc", "segments")),
    Producer("partition_batch", "pcpviz.reference.layout:partition_batch", 0, ("batch", "rank", "layout"),
             _t(*_LOCAL), _t(*_LAYOUT, "positions", "input_ids", "query_start_loc", "num_computed_tokens")),
    Producer("gather_block_table_rows", _RB + "gather_block_table_rows", 0, ("idx_mapping",),
             _t("block_table_global", "block_table_local") + ("draft_0.block_table_draft",),
             _t("idx_mapping"), unrecorded=("the block tables",)),
    Producer("compute_slot_mappings", _RB + "compute_slot_mappings", 0, ("positions",),
             _t("slot_mapping_global"), _t("block_table_global", "query_start_loc", "positions")),
    Producer("gathered_slot_mapping", _RB + "gathered_slot_mapping", 0, ("global_slots", "layout"),
             _t("slot_mapping_gathered") + ("draft_0.slot_mapping_draft",),
             _t("slot_mapping_global", "kv_write_mask", "padded_gather_idx")),
    Producer("Worker._target", _W + "_target", 0, ("bounds",), _t("hidden_fp", "top1_token", "hidden_hash",
                                                                    "sampled_logits_rows", "sampled_from"),
             _t("local_input_ids", "local_positions", "local_seq_lens", "hidden_restore_idx", "logits_indices")),
    Producer("greedy_verify", "pcpviz.engine.verify:greedy_verify", 0, ("num_draft", "targets", "states"),
             ("verify.num_sampled", "verify.num_rejected", "verify.num_accepted", "verify.sampled_token_ids",
              "verify.req_ids", "verify.num_draft_tokens"),
             _t("input_ids", "num_scheduled_tokens", "is_prefilling", "top1_token")),
    Producer("draft_prefill_inputs", "pcpviz.reference.drafts:draft_prefill_inputs", 0,
             ("input_ids", "query_start_loc", "num_rejected", "num_sampled", "last_sampled", "next_prompt_tokens"),
             ("draft_0.draft_global_input_ids", "draft_0.draft_last_token_indices"),
             _t("input_ids", "query_start_loc") + ("verify.num_sampled", "verify.num_rejected",
                                                   "verify.sampled_token_ids"),
             unrecorded=("next_prompt_tokens (from _next_prompt_tokens)",)),
    Producer("_host_inputs", _SP + "_host_inputs", 0, ("worker", "h", "verify"),
             ("draft_0.draft_input_ids", "draft_0.draft_positions", "draft_0.draft_seq_lens", "draft_0.view"),
             ("draft_0.draft_global_input_ids",) + _t("local_positions", "local_seq_lens", "padded_gather_idx")),
    Producer("_draft_prefill", _SP + "_draft_prefill", 0, ("hidden_local",),
             ("draft_0.hidden_in_fp", "draft_0.hidden_last_fp", "draft_0.draft_tokens"),
             ("draft_0.draft_input_ids", "draft_0.draft_positions", "target.hidden_fp",
              "draft_0.draft_last_token_indices")),
    Producer("_draft_decode_inputs", _SP + "_draft_decode_inputs", 0, ("batch", "table", "last_idx"),
             ("draft_k.draft_positions", "draft_k.draft_seq_lens"),
             _t("positions") + ("draft_0.draft_last_token_indices",)),
    Producer("_draft_decode_inputs", _SP + "_draft_decode_inputs", 0, ("batch", "table", "last_idx"),
             ("draft_k.slot_mapping_draft",), ("draft_k.draft_positions", "draft_k.block_table_draft")),
    Producer("Worker._write_input_block_tables", _W + "_write_input_block_tables", 0, ("table", "idx_mapping"),
             ("draft_k.block_table_draft",), _t("idx_mapping"), unrecorded=("the block tables",)),
    Producer("_draft_decodes", _SP + "_draft_decodes", 0, ("tok0", "h_last", "k"),
             ("draft_k.draft_input_ids", "draft_k.draft_tokens", "draft_k.hidden_in_fp",
              "draft_k.view"), ("draft_0.draft_tokens", "draft_prev.draft_tokens", "draft_0.hidden_last_fp")),
)
"""The engine's producers of the recorded views (module:qualname; line read from the source)."""

MAPS: dict[str, tuple[Producer, ...]] = {"vllm-plugin": VLLM, "vllm-replay": VLLM, "pcpviz-engine": ENGINE_PRODUCERS}
"""run.json ``producer`` -> its producer map."""


@lru_cache(maxsize=None)
def _engine_cite(where: str) -> str:
    """``pcpviz/engine/speculator.py:196`` for ``pcpviz.engine.speculator:_draft_decode_inputs``."""
    module, qual = where.split(":")
    rel = "/".join(module.split(".")) + ".py"
    path = _ROOT / rel
    line = def_line(path.read_text(encoding="utf-8"), qual) if path.is_file() else None
    return f"{rel}:{line}" if line else rel


def def_line(source: str, qualname: str) -> int | None:
    """The def line of ``qualname`` (``f`` or ``Class.method``) in ``source``; None if absent."""
    node = find_def(ast.parse(source), qualname)
    return None if node is None else node.lineno


def find_def(tree: ast.AST, qualname: str):
    """The ``FunctionDef`` of ``qualname`` in ``tree`` (a module), or None."""
    parts = qualname.split(".")
    scope = tree
    for i, part in enumerate(parts):
        want = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(parts) - 1 else (ast.ClassDef,)
        found = next((n for n in getattr(scope, "body", []) if isinstance(n, want) and n.name == part), None)
        if found is None:
            return None
        scope = found
    return scope


def producer_map(producer: str | None) -> tuple[Producer, ...] | None:
    """The map of run.json's ``producer`` (``"vllm-plugin"``: ``VLLM``), None where pcpviz has none."""
    return MAPS.get(str(producer))


def _matches(key: str, phase: str, view: str) -> bool:
    p, v = key.split(".", 1)
    if v != view:
        return False
    if p == phase:
        return True
    return p == "draft_k" and phase.startswith("draft_") and phase != "draft_0"


def producer_of(producers: tuple[Producer, ...], phase: str, view: str) -> Producer | None:
    """The producer writing ``phase``'s ``view`` (an exact phase first: ``draft_1`` before ``draft_k``)."""
    exact = [p for p in producers if f"{phase}.{view}" in p.writes]
    if exact:
        return exact[0]
    return next((p for p in producers if any(_matches(w, phase, view) for w in p.writes)), None)


INSIDE, INPUTS_WRONG, UNKNOWN = "inside", "inputs wrong", "unknown"


@dataclass(frozen=True)
class Attribution:
    """The producer of the first wrong value, walked up to the first one whose inputs were right."""

    view: str  # phase.view of the first wrong value
    producer: str | None
    cite: str | None
    inputs_right: tuple[str, ...]
    inputs_wrong: tuple[str, ...]
    inputs_missing: tuple[str, ...]  # recorded views this trace lacks at that step
    unrecorded: tuple[str, ...]
    chain: tuple[str, ...]  # the producers walked (the first wrong value's first)
    verdict: str  # INSIDE | INPUTS_WRONG | UNKNOWN
    sure: str  # how sure, in words

    def line(self) -> str:
        if self.producer is None:
            return f"{self.view}: no producer is mapped for it ({self.sure})"
        walked = "" if len(self.chain) < 2 else f" (walked up from {' <- '.join(self.chain[:-1])})"
        out = f"{self.view} written by `{self.producer}` ({self.cite}){walked}"
        if self.inputs_right:
            out += f" from {', '.join(f'`{v}`' for v in self.inputs_right)}, right"
        if self.inputs_wrong:
            out += f"; its inputs {', '.join(f'`{v}`' for v in self.inputs_wrong)} already wrong"
        if self.verdict == INSIDE:
            out += ": the fault is inside it"
        if self.inputs_missing or self.unrecorded:
            miss = list(self.inputs_missing) + list(self.unrecorded)
            out += f"; not recorded: {', '.join(miss)}"
        return out + f" ({self.sure})"

    def to_dict(self) -> dict[str, Any]:
        return {"view": self.view, "producer": self.producer, "cite": self.cite, "verdict": self.verdict,
                "inputs_right": list(self.inputs_right), "inputs_wrong": list(self.inputs_wrong),
                "inputs_missing": list(self.inputs_missing), "unrecorded": list(self.unrecorded),
                "chain": list(self.chain), "sure": self.sure, "line": self.line()}


def _resolve(key: str, phase: str) -> str:
    p, v = key.split(".", 1)
    if p == "draft_k" and phase.startswith("draft_") and phase != "draft_0":
        p = phase
    if p == "draft_prev" and phase.startswith("draft_"):
        p = f"draft_{max(int(phase.split('_')[1]) - 1, 0)}"
    return f"{p}.{v}"


def attribute(producer: str | None, phase: str, view: str, *, recorded: Callable[[str], bool],
              wrong: Callable[[str], bool], compared: bool) -> Attribution:
    """Name the producer of ``phase``'s ``view`` (the first wrong value) and walk up while its inputs
    are wrong. ``producer``: run.json's (None: not recorded). ``recorded(key)``: the step records
    ``key`` (``phase.view``; ``prev_verify.x`` the previous step's); ``wrong(key)``: a check or the
    diff found it wrong there; ``compared``: an input not found wrong was compared with a reference
    (diff: sure) rather than only checked (checks hold what they hold: likely)."""
    producers = producer_map(producer)
    key = f"{phase}.{view}"
    if producers is None:
        return Attribution(key, None, None, (), (), (), (), (), UNKNOWN,
                           f"no producer map for producer {producer!r}")
    chain: list[str] = []
    seen: set[str] = set()
    while True:
        p = producer_of(producers, *key.split(".", 1))
        if p is None:
            return Attribution(key, None, None, (), (), (), (), tuple(chain), UNKNOWN,
                               "the map names no producer for this view")
        chain.append(p.name)
        ins = [_resolve(k, key.split(".")[0]) for k in p.inputs]
        missing = tuple(k for k in ins if not recorded(k))
        bad = tuple(k for k in ins if k not in missing and wrong(k))
        good = tuple(k for k in ins if k not in missing and k not in bad)
        up = next((k for k in bad if k not in seen and producer_of(producers, *k.split(".", 1)) is not None
                   and k != f"{key}"), None)
        if bad and up is not None:
            seen.add(key)
            key = up
            continue
        if bad:
            verdict, sure = INPUTS_WRONG, "its inputs were already wrong and their producer is not mapped"
        elif missing or p.unrecorded:
            verdict, sure = INSIDE, ("likely: every recorded input is right, but some inputs are not recorded "
                                     "(the fault may be in them)")
        else:
            verdict = INSIDE
            sure = ("sure: every input equals the reference run" if compared
                    else "likely: every input passes the checks that read it")
        return Attribution(key, p.name, p.cite(), good, bad, missing, p.unrecorded, tuple(chain), verdict, sure)


def _recorded(trace, step: int, rank: int):
    def has(key: str) -> bool:
        p, v = key.split(".", 1)
        s = step
        if p.startswith("prev_"):
            p = p[5:]
            earlier = [x for x in trace.steps if x < step]
            if not earlier:
                return False
            s = earlier[-1]
        try:
            return p in trace.phases(s, rank) and v in trace.record(s, rank, p)
        except (KeyError, ValueError, OSError):
            return False
    return has


def attribute_violation(trace, report) -> Attribution | None:
    """The producer of ``report``'s (``run_checks``) first violation; None when nothing failed or
    the violation names no view."""
    v = report.first_violation
    if v is None or v.phase is None or v.view is None:
        return None
    flagged = {(r.first_violation.step, r.first_violation.phase, r.first_violation.view)
               for r in report.results.values() if r.first_violation is not None}
    rank = v.rank if v.rank is not None else (trace.ranks[0] if trace.ranks else 0)
    return attribute(trace.run_meta.recorded_value("producer"), v.phase, v.view,
                     recorded=_recorded(trace, v.step, rank), wrong=_marked_wrong(trace, v.step, flagged),
                     compared=False)


def attribute_divergence(trace_b, diff) -> Attribution | None:
    """The producer of ``diff``'s (``diff_traces(a, b)``) first divergence, by run B's producer."""
    d = diff.first
    if d is None or d.phase is None or d.view is None:
        return None
    seen = {(x.step, x.phase, x.view) for x in diff.divergences}
    # the divergences are the first per (step, phase, view) in step order, capped: the first step's are
    # all there when the list goes past it or is not full
    complete = any(x.step > d.step for x in diff.divergences) or len(diff.divergences) < 200
    rank = d.rank_b if d.rank_b is not None else (trace_b.ranks[0] if trace_b.ranks else 0)
    return attribute(trace_b.run_meta.recorded_value("producer"), d.phase, d.view,
                     recorded=_recorded(trace_b, d.step, rank), wrong=_marked_wrong(trace_b, d.step, seen),
                     compared=complete)


def _marked_wrong(trace, step: int, marked: set[tuple[int, str, str]]):
    """Whether an input ``"phase.view"`` (``"prev_phase.view"``: the step before) of ``step`` is among
    the ``(step, phase, view)`` marked wrong (failed checks or divergences)."""
    prev = max((x for x in trace.steps if x < step), default=None)

    def wrong(key: str) -> bool:
        p, view = key.split(".", 1)
        if p.startswith("prev_"):
            return prev is not None and (prev, p[5:], view) in marked
        return (step, p, view) in marked
    return wrong


def patched_function(file: str, old: str) -> str | None:
    """The qualname of the function of ``pcpviz/<file>`` holding the text ``old`` (a mutation's
    patch site; ``Worker._verify``), or None."""
    path = _ROOT / "pcpviz" / file
    src = path.read_text(encoding="utf-8")
    at = src.find(old)
    if at < 0:
        return None
    line = src.count("\n", 0, at) + 1
    best: tuple[int, str] | None = None

    def walk(node: ast.AST, prefix: str) -> None:
        nonlocal best
        for n in getattr(node, "body", []):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{n.name}"
                if isinstance(n, ast.ClassDef):
                    walk(n, name + ".")
                elif n.lineno <= line <= (n.end_lineno or n.lineno):
                    if best is None or n.lineno > best[0]:
                        best = (n.lineno, name)
    walk(ast.parse(src), "")
    return None if best is None else best[1]
