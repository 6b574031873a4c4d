"""Bugs planted in vLLM 0.33.0's own functions, run through the CPU replay (``pcpviz.vllm.replay``),
for the diagnosis benchmark (``benchmarks/bench_diagnosis.py --part vllm``).

A ``VllmMutation`` replaces one vLLM function where the replay's code looks it up (``module``,
``attr``; ``Class.method`` for a method) by ``wrap(real)``: the real function called with one of its
own values wrong (a kernel that ignores ``num_rejected``, a sampler rule that ignores
``prefill_len``, ...), so the function writes a wrong value from right inputs, as a bug inside it
would. ``producer`` is its name in the vLLM producer map (``pcpviz.analysis.producers.VLLM``): the
function a correct attribution names. ``harmless`` ones change nothing the function computes.
``planted(m)`` applies one for the duration of a ``with`` block (the replay imports vLLM; the
module names are resolved then, not at import of this module).

PCP=2 example: ``decode_ignores_rejections`` calls ``prepare_decode_inputs`` with zero
``num_rejected``: draft_1's ``draft_seq_lens`` and ``draft_positions`` run past the last
accepted token of every request that rejected a draft.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["VllmMutation", "VLLM_MUTATIONS", "planted"]


@dataclass(frozen=True)
class VllmMutation:
    name: str
    module: str  # where the replay's code looks the function up
    attr: str  # its name there ("Class.method" for a method)
    producer: str  # the function's name in pcpviz.analysis.producers.VLLM
    phase: str | None
    view: str | None  # "a|b": alternatives
    what: str
    wrap: Callable[[Callable], Callable]
    harmless: bool = False

    def at_own_place(self, phase: str | None, view: str | None) -> bool:
        if phase is None or self.phase is None:
            return False
        same = phase == self.phase or (self.phase == "draft_k" and phase.startswith("draft_") and phase != "draft_0")
        return same and view in self.view.split("|")


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[i]


def _with(args: tuple, kwargs: dict, i: int, name: str, value: Any) -> tuple[tuple, dict]:
    if name in kwargs or i >= len(args):
        return args, {**kwargs, name: value}
    return args[:i] + (value,) + args[i + 1:], kwargs


def _replace(i: int, name: str, fn: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """A wrapper calling ``real`` with argument ``i`` (``name``) replaced by ``fn(value)``."""
    def wrap(real: Callable) -> Callable:
        def buggy(*args: Any, **kwargs: Any) -> Any:
            a, k = _with(args, kwargs, i, name, fn(_arg(args, kwargs, i, name)))
            return real(*a, **k)
        return buggy
    return wrap


def _identity(real: Callable) -> Callable:
    def same(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)
    return same


def _no_advance(real: Callable) -> Callable:
    def buggy(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "advance_draft_positions": False})
    return buggy


def _attr_during(attr: str, fn: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """A method wrapper that runs ``real`` with ``self.<attr>`` replaced by ``fn(value)`` (restored
    after): the method reads one of its object's own tensors wrong. Each PCP rank of the replay has
    its own manager, so the swap is that rank's alone."""
    def wrap(real: Callable) -> Callable:
        def buggy(self: Any, *args: Any, **kwargs: Any) -> Any:
            saved = getattr(self, attr)
            setattr(self, attr, fn(saved))
            try:
                return real(self, *args, **kwargs)
            finally:
                setattr(self, attr, saved)
        return buggy
    return wrap


def _mirrored_rank(real: Callable) -> Callable:
    """``_iter_rank_chunks`` for rank ``P-1-r``: each rank takes its mirror's DualChunkSwap chunks."""
    def buggy(self: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
        return real(self, self.pcp_world_size - 1 - rank, *args, **kwargs)
    return buggy


def _prefills_first(real: Callable) -> Callable:
    """``_reorder_segments`` (a staticmethod) told every request is the other kind: a rank's rows
    ordered prefills first."""
    def buggy(segments: Any, is_prefilling: Any) -> Any:
        return real(segments, ~is_prefilling)
    return buggy


def _keywords(real: Callable) -> Callable:
    """The same call with ``out`` passed by keyword (what a refactor of the call site might do)."""
    def same(self: Any, idx_mapping: Any, query_start_loc: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        return real(self, idx_mapping=idx_mapping, query_start_loc=query_start_loc, positions=positions,
                    **dict(zip(("num_tokens_padded", "out"), args)), **kwargs)
    return same


_AR = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"
_BT = "vllm.v1.worker.gpu.block_table"
_PM = "vllm.v1.worker.gpu.pcp_manager"
_MR = "vllm.v1.worker.gpu.model_runner"
_M = VllmMutation
VLLM_MUTATIONS: tuple[VllmMutation, ...] = (
    _M("decode_ignores_rejections", _AR, "prepare_decode_inputs", "prepare_decode_inputs", "draft_1",
       "draft_seq_lens|draft_positions", "draft decode: the first decode's seq_len and position ignore num_rejected",
       _replace(2, "num_rejected", lambda t: t * 0)),
    _M("decode_positions_not_advanced", _AR, "prepare_decode_inputs", "prepare_decode_inputs", "draft_1",
       "draft_positions|draft_seq_lens", "draft decode: the first decode's position is not advanced",
       _no_advance),
    _M("update_positions_not_advanced", _AR, "update_draft_inputs", "update_draft_inputs", "draft_k",
       "draft_positions|draft_seq_lens", "draft decode: later decodes' positions are not advanced", _no_advance),
    _M("prefill_last_token_ignores_rejections", _AR, "prepare_prefill_inputs", "prepare_prefill_inputs", "draft_0",
       "draft_last_token_indices|draft_global_input_ids", "draft prefill: the last token index ignores num_rejected",
       _replace(5, "num_rejected", lambda t: t * 0)),
    _M("must_sample_ignores_chunking", "pcpviz.vllm.replay.step", "get_num_sampled_and_rejected",
       "get_num_sampled_and_rejected", "verify", "num_sampled",
       "sampler: the must-sample rule ignores prefill_len (a partial chunk samples)",
       _replace(4, "prefill_len", lambda t: t * 0)),
    _M("slots_one_position_ahead", _BT, "BlockTables.compute_slot_mappings", "BlockTables.compute_slot_mappings",
       "target", "slot_mapping_global|slot_mapping_gathered", "slots: computed for the next position",
       _replace(3, "positions", lambda t: t + 1)),
    _M("block_tables_next_request", _BT, "BlockTables.gather_block_tables", "BlockTables.gather_block_tables",
       "target", "block_table_global|block_table_local", "block tables: each row gathered from the next request's",
       _replace(1, "idx_mapping", lambda t: t.roll(1) if t.numel() > 1 else t)),
    _M("cursor_keeps_a_rejected_draft", "vllm.v1.worker.gpu.model_runner", "post_update", "post_update", "verify",
       "num_computed_after", "cursor: post_update rolls back one draft fewer than were rejected",
       _replace(6, "num_rejected", lambda t: (t - 1).clamp(min=0))),
    _M("positions_one_ahead", _MR, "prepare_pos_seq_lens", "prepare_pos_seq_lens", "target", "positions|seq_lens",
       "target inputs: positions and seq_lens from a cursor one token ahead",
       _replace(2, "num_computed_tokens", lambda t: t + 1)),
    _M("drafts_of_the_next_request", _MR, "combine_sampled_and_draft_tokens", "combine_sampled_and_draft_tokens",
       "target", "input_ids", "target inputs: each request's draft tokens taken from the next request's",
       _replace(6, "draft_tokens", lambda t: t.roll(1, 0))),
    # -- the PCP manager: the rank-local batch, the gathered slots, the hidden rows' restore
    _M("chunks_mirrored", _PM, "PCPManager._iter_rank_chunks", "PCPManager.partition_batch", "target", "segments",
       "partition: rank r takes rank P-1-r's DualChunkSwap chunks", _mirrored_rank),
    _M("gathered_write_mask_ignored", _PM, "PCPManager._convert_to_gathered_slot_mappings",
       "PCPManager._convert_to_gathered_slot_mappings", "target", "slot_mapping_gathered",
       "gathered slots: the KV write mask ignored (every rank writes every replica)",
       _attr_during("_gathered_kv_write_mask", lambda m: m | True)),
    _M("hidden_restore_one_row_off", _PM, "PCPManager.restore_for_sampling", "PCPManager.restore_hidden_states",
       "target", "hidden_fp", "restore: the all-gathered hidden rows put back one row off",
       _attr_during("_hidden_restore_idx", lambda i: i.roll(1))),
    _M("segments_prefills_first", _PM, "PCPManager._reorder_segments", "PCPManager.partition_batch", "target",
       "segments", "partition: a rank's rows ordered prefills first", _prefills_first),
    _M("draft_restore_one_row_off", _PM, "PCPManager.restore_draft_prefill", "PCPManager.restore_draft_prefill",
       "draft_0", "hidden_last_fp|hidden_out_fp", "draft prefill: the all-gathered MTP rows put back one row off",
       _attr_during("_hidden_restore_idx", lambda i: i.roll(1))),
    _M("draft_prefill_ids_shifted", _PM, "PCPManager.prepare_draft_prefill", "PCPManager.prepare_draft_prefill",
       "draft_0", "draft_input_ids", "draft prefill: the rank-local ids gathered from the global ids shifted by one",
       _replace(2, "input_ids", lambda t: t.roll(1))),
    # -- harmless refactors: the replay must equal the clean one
    _M("refactor_decode_inputs_passthrough", _AR, "prepare_decode_inputs", "prepare_decode_inputs", None, None,
       "refactor: prepare_decode_inputs behind a pass-through wrapper", _identity, harmless=True),
    _M("refactor_slot_mappings_passthrough", _BT, "BlockTables.compute_slot_mappings",
       "BlockTables.compute_slot_mappings", None, None, "refactor: compute_slot_mappings called with every "
       "argument by keyword", _keywords, harmless=True),
)


@contextlib.contextmanager
def planted(m: VllmMutation) -> Iterator[None]:
    """Replace ``m``'s function by its buggy version inside the block (the real one after)."""
    mod = importlib.import_module(m.module)
    owner_name, _, name = m.attr.rpartition(".")
    owner = getattr(mod, owner_name) if owner_name else mod
    raw = vars(owner).get(name, getattr(owner, name))  # a class's staticmethod as declared, not unwrapped
    if isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(m.wrap(raw.__func__)))
    else:
        setattr(owner, name, m.wrap(raw))
    try:
        yield
    finally:
        setattr(owner, name, raw)
