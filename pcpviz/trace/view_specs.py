"""Every view a producer writes, declared once: ``VIEW_SPECS``, one ``ViewSpec`` (name, dtype,
shape, meaning, padding, scope, alignment, panel) per view and phase class. Adding a view is
one row in the ``_specs(group, phases, [...])`` list of its group (CONTRIBUTING.md);
``pcpviz.trace.schema`` indexes the rows (``view_spec``, ``phase_views``, the view groups).

PCP=2: ``positions`` is ``int64[T]`` in ``target`` (one per global token, global scope, aligned
by token across runs); ``local_positions`` is ``int64[P]``, this rank's own rows (rank scope).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from pcpviz.trace.fingerprints import FINGERPRINT_ROWS, FINGERPRINT_SPEC
from pcpviz.trace.graph_views import GRAPH_ROWS
from pcpviz.trace.phases import PHASE_DUMMY, PHASE_TARGET, PHASE_VERIFY

__all__ = ["GLOBAL", "RANK", "ViewSpec", "VIEW_SPECS", "DCP_SHARE_VIEWS"]


# Every view a producer writes is declared once, here, per phase class (``target``, ``verify``,
# ``draft_0``, ``draft_k`` for k >= 1, ``dummy``). Checks, diff and the figures read a view's
# scope, alignment and panel from these specs; the tests hold every shipped and freshly recorded
# trace to them. Shape letters (a PCP=2 step of the shipped engine trace in brackets):
#
#   R  requests of the global batch          [2]     T  global tokens (sum of q)      [48]
#   N  PCP ranks                              [2]     P  padded local rows per rank    [26]
#   r  local request rows of this rank        [2]     G  KV-cache groups               [1]
#   W  block-table columns (trimmed to use)           K  num_speculative_tokens        [2]
#   S  sampled rows: sum(1 + num_draft_tokens)        Q  DSpark query rows per request
#   S' segments of all ranks (rows of ``segments``)   M  graph inputs handed at moved addresses

GLOBAL = "global"
"""Scope of a view every rank records identically (``ranks_agree`` compares them)."""
RANK = "rank"
"""Scope of a view that is this rank's own (its local rows, its buffers, its clock)."""

_DTYPE_KINDS = {"int64": "i", "int32": "i", "bool": "b", "str": "U", "uint64": "u", "struct": "V"}


@dataclass(frozen=True)
class ViewSpec:
    """One view of one phase class.

    ``dtype``: ``int64``, ``int32|int64`` (producer-dependent width), ``bool``, ``str``,
    ``uint64`` or ``struct``; ``shape``: e.g. ``[N*P]`` (``[]`` for 0-d; ``or`` separates
    alternatives); ``pad``: what padding or missing entries hold; ``scope``: ``GLOBAL`` or
    ``RANK``; ``align``: how ``pcpviz.analysis.diff`` lines the view up across two runs — ``("req", axis)``
    rows are requests, ``("tok", axis)`` global tokens, ``("qsl",)`` a query_start_loc,
    ``("tokidx",)`` a set of global token indices, ``("tokidx_req",)`` one token index per
    request, ``("scalar",)`` as is; None: a rank-local view, compared only between runs with the
    same PCP layout. ``run_specific``: why two correct runs differ in it (diff ignores it by
    default); ``panel``: the Workbench figure that draws it.
    """

    name: str
    phases: tuple[str, ...]
    dtype: str
    shape: str
    meaning: str
    group: str
    pad: str = ""
    scope: str = GLOBAL
    align: tuple | None = None
    run_specific: str = ""
    panel: str = "timeline"

    @property
    def decl(self) -> str:
        """``int64[N*P]``: the shape comment."""
        return f"{self.dtype}{self.shape}"

    @cached_property
    def kinds(self) -> str:
        """NumPy dtype kinds a recorded value may have (``"i"``, ``"b"``, ``"U"``, ...)."""
        return "".join(_DTYPE_KINDS[d] for d in self.dtype.split("|"))

    @cached_property
    def ndims(self) -> frozenset[int]:
        """The ranks (numbers of axes) the shape allows."""
        alts = [a.strip() for a in self.shape.split(" or ")]
        return frozenset(0 if a == "[]" else a.count(",") + 1 for a in alts)

    def problem(self, value: Any) -> str | None:
        """Why a recorded value does not fit this spec (None if it does)."""
        a = np.asarray(value)
        kind = "V" if a.dtype.names is not None else a.dtype.kind
        if kind not in self.kinds:
            return f"dtype {a.dtype} is not {self.dtype}"
        if a.ndim not in self.ndims:
            return f"{a.ndim}-d, declared {self.shape}"
        return None


_T, _V, _D0, _DK, _DU = PHASE_TARGET, PHASE_VERIFY, "draft_0", "draft_k", PHASE_DUMMY
_ALL = (_T, _D0, _DK, _V, _DU)
_REQ, _TOK = ("req", 0), ("tok", 0)
_PER_RUN_ROW = ("the row of vLLM's persistent request-state table a request got (allocated per "
                "run); the block-table rows and slot mappings it selects are compared instead")


def _specs(group: str, phases: tuple[str, ...], rows: list[tuple], **common: Any) -> list[ViewSpec]:
    return [ViewSpec(name, phases, dtype, shape, meaning, group, **{**common, **extra})
            for name, dtype, shape, meaning, *more in rows for extra in (more[0] if more else {},)]


VIEW_SPECS: tuple[ViewSpec, ...] = tuple(
    _specs("global batch", (_T,), [
        ("req_ids", "str", "[R]", "request ids in global (scheduler) order", dict(align=_REQ)),
        ("idx_mapping", "int64", "[R]", "row of each request in the persistent request-state table",
         dict(align=_REQ, run_specific=_PER_RUN_ROW)),
        ("num_scheduled_tokens", "int64", "[R]", "query tokens scheduled per request this step (q)",
         dict(align=_REQ)),
        ("num_computed_tokens", "int64", "[R]", "the CPU cursor: tokens the scheduler counts as computed "
         "before this step (an upper bound of the GPU cursor while drafts are rejected)", dict(align=_REQ)),
        ("query_start_loc", "int32|int64", "[R+1]", "cumulative query starts on the global token axis",
         dict(align=("qsl",))),
        ("positions", "int64", "[T]", "position of each global token (from the GPU cursor)", dict(align=_TOK)),
        ("input_ids", "int32|int64", "[T]", "token id of each global token", dict(align=_TOK)),
        ("seq_lens", "int32|int64", "[R]", "sequence length per request after this step's tokens",
         dict(align=_REQ)),
        ("is_prefilling", "bool", "[R]", "the request is (still) prefilling its prompt", dict(align=_REQ)),
        ("prefill_len", "int64", "[R]", "prompt tokens to prefill per request", dict(align=_REQ)),
        ("logits_indices", "int64", "[S]", "global token rows whose logits are sampled: each request's "
         "last 1 + num_draft_tokens rows", dict(align=("tokidx",))),
        ("scheduled_draft_ids", "int64", "[R, K]", "engine only: the drafts each request's state keeps "
         "for this step (the previous step's draft tokens, as stored), -1 past its own",
         dict(align=_REQ, pad="-1 past the request's kept drafts")),
        ("num_draft_tokens", "int64", "[R]", "draft tokens scheduled per request (vLLM's "
         "num_draft_tokens_per_req; zeros when vLLM has none)", dict(align=_REQ)),
    ])
    + _specs("layout", (_T,), [
        ("segments", "struct", "[S']", "every rank's DualChunkSwap segments (SEGMENT_DTYPE rows, by rank)",
         dict(panel="token_order")),
        ("per_rank_num_tokens", "int64", "[N]", "real (unpadded) local rows per rank",
         dict(panel="token_order")),
        ("padded_gather_idx", "int64", "[N*P]", "gathered row -> the global token it holds",
         dict(pad="0 on padding rows (rows past per_rank_num_tokens of their rank)", panel="token_order")),
        ("hidden_restore_idx", "int64", "[T]", "global token -> the gathered row of its written copy",
         dict(panel="token_order")),
        ("kv_write_mask", "bool", "[N*P]", "gathered rows whose KV this step writes (one per global token)",
         dict(pad="False on padding rows", panel="slot_mappings")),
    ])
    + _specs("rank-local batch", (_T,), [
        ("local_req_ids", "str", "[r]", "request id of each local segment (decodes first)"),
        ("local_idx_mapping", "int64", "[r]", "request-state row of each local segment",
         dict(run_specific=_PER_RUN_ROW)),
        ("local_input_ids", "int32|int64", "[P]", "token ids of this rank's local rows",
         dict(pad="rows past per_rank_num_tokens[rank] are padding (local_is_padding)")),
        ("local_positions", "int64", "[P]", "positions of the local rows (taken from the global positions)",
         dict(pad="rows past per_rank_num_tokens[rank] are padding")),
        ("local_query_start_loc", "int32|int64", "[r+1]", "cumulative starts of the local segments",
         dict(pad="padded request rows repeat the last start")),
        ("local_seq_lens", "int32|int64", "[r]", "last local position + 1 per local segment"),
        ("local_logits_indices", "int32|int64", "[r]", "local_query_start_loc[1:] - 1 (never sampled)"),
        ("local_is_padding", "bool", "[P]", "the local row is padding"),
        ("moe_is_padding", "bool", "[N*P]", "vLLM's rank-major gathered MoE padding mask (recorded when "
         "the MoE gathers tokens; local_is_padding is this rank's block of it)"),
        ("local_is_prefilling", "bool", "[r]", "the local segment belongs to a prefilling request"),
        ("local_num_computed_tokens", "int64", "[r]", "num_computed_tokens of each local segment's request"),
    ], scope=RANK, panel="token_order")
    + _specs("block tables", (_T,), [
        ("block_table_global", "int32", "[G, R, W] or [R, W]", "block-table rows in global request order",
         dict(align=("req", -2))),
        ("block_table_local", "int32", "[G, r, W] or [r, W]", "block-table rows per local segment",
         dict(scope=RANK)),
        ("block_table_global_stale_tail", "int64", "[]", "vLLM only: non-zero entries past a request's "
         "num_blocks dropped from block_table_global (a previous occupant's, never read)",
         dict(scope=RANK, panel="timeline")),
        ("block_table_local_stale_tail", "int64", "[]", "vLLM only: the same for block_table_local",
         dict(scope=RANK, panel="timeline")),
    ], pad="0: unused columns (the null block); columns past the widest row are trimmed",
        panel="block_tables")
    + _specs("slot mappings", (_T,), [
        ("slot_mapping_global", "int64", "[G, T] or [T]", "KV slot of each global token",
         dict(align=("tok", -1))),
        ("slot_mapping_gathered", "int64", "[G, N*P] or [N*P]", "KV slot of each gathered row, "
         "where kv_write_mask", dict(pad="PAD_SLOT (-1) on rows not written")),
    ], panel="slot_mappings")
    + _specs("sampling", (_T,), [
        ("sampled_logits_rows", "int64", "[S]", "rows of the hidden states the sampler read",
         dict(align=("tokidx",))),
        ("sampled_from", "str", "[]", "'global' (the restored global hidden states) or 'local'",
         dict(align=("scalar",))),
        ("num_aux_hidden_states_restored", "int64", "[]", "vLLM only: auxiliary hidden states restored "
         "with the sampling rows"),
        ("warmup", "bool", "[]", "vLLM only: a synthetic warm-up step (recorded with PCPVIZ_RECORD_DUMMY=1)"),
    ], scope=RANK)
    + _specs("draft step", (_D0, _DK), [
        ("draft_tokens", "int64", "[R]", "the token each request's draft step proposed", dict(align=_REQ)),
    ])
    + _specs("draft step", (_D0,), [
        ("view", "str", "[]", "'rank_local' (the MTP draft prefill on the target's local rows) or "
         "'replicated' (DSpark, or PCP=1 under vLLM)", dict(scope=GLOBAL)),
        ("draft_input_ids", "int32|int64", "[P] or [R*Q]", "token ids fed to the draft prefill (its "
         "local rows; DSpark: its query rows)", dict(pad="rows past per_rank_num_tokens[rank] are padding")),
        ("draft_positions", "int64", "[P] or [R*Q]", "positions fed to the draft prefill"),
        ("draft_seq_lens", "int32|int64", "[r] or [R]", "sequence lengths the draft prefill attends over"),
        ("draft_last_token_indices", "int64", "[R]", "global row of each request's last accepted token "
         "(its hidden state feeds draft_1)", dict(scope=GLOBAL, align=("tokidx_req",))),
        ("draft_global_input_ids", "int32|int64", "[T]", "the global shifted draft ids before the gather: "
         "target ids shifted left by one, the sampled token on the last accepted row",
         dict(scope=GLOBAL, align=_TOK, pad="rows past q - num_rejected keep stale ids (never read)")),
        ("draft_prefill_restored", "bool", "[]", "vLLM only: restore_draft_prefill ran on a rank-local "
         "draft batch"),
        ("block_table_draft", "int32", "[G, r, W] or [G, R, W] or [r, W]", "block-table rows the draft "
         "prefill used (MTP: the target's local rows)", dict(pad="0: unused columns", panel="block_tables")),
        ("slot_mapping_draft", "int64", "[G, N*P] or [G, R*Q] or [N*P]", "KV slots the draft prefill "
         "writes (MTP: the target's gathered mapping, expanded)",
         dict(pad="PAD_SLOT (-1) on rows not written", panel="slot_mappings")),
    ], scope=RANK)
    + _specs("draft step", (_DK,), [
        ("view", "str", "[]", "'replicated': draft decodes run on the global batch", dict(align=("scalar",))),
        ("draft_input_ids", "int32|int64", "[R]", "token ids fed to draft step k: draft_{k-1}'s tokens",
         dict(align=_REQ)),
        ("draft_positions", "int64", "[R]", "positions fed to draft step k", dict(align=_REQ)),
        ("draft_seq_lens", "int32|int64", "[R]", "sequence lengths draft step k attends over", dict(align=_REQ)),
        ("block_table_draft", "int32", "[G, R, W] or [R, W]", "block-table rows draft step k used (the "
         "global rows)", dict(align=("req", -2), pad="0: unused columns", panel="block_tables")),
        ("slot_mapping_draft", "int64", "[G, R] or [R]", "KV slots draft step k writes, unexpanded (one per "
         "request: the R real columns of vLLM's [G, num_tokens], PAD past R up to the padded draft batch)",
         dict(align=("req", -1), pad="PAD_SLOT (-1) on rows not written", panel="slot_mappings")),
    ])
    + _specs("forward consumed", (_D0, _DK), [
        ("fwd_source", "str", "[]", "vLLM only: where the fwd_* views were read: 'model_call' (the draft "
         "model's arguments), 'graph_capture' (a FULL graph replay: the tensors it was captured on) or "
         "'graph_buffers' (a FULL replay: the speculator's buffers _run_model hands at capture)"),
        ("fwd_input_ids", "int32|int64", "[n]", "vLLM only: token ids the draft forward consumed (draft_k: "
         "its first R rows)", dict(pad="rows past the prepared ones are graph padding")),
        ("fwd_positions", "int64", "[n]", "vLLM only: positions the draft forward consumed (what RoPE reads)",
         dict(pad="rows past the prepared ones are graph padding")),
        ("fwd_slot_mapping", "int64", "[G, n]", "vLLM only: KV slots of the forward context at the model "
         "call (one layer per KV-cache group)", dict(pad="PAD_SLOT (-1) on rows not written",
                                                     panel="slot_mappings")),
        ("fwd_hidden_fp", "int64", "[n]", "vLLM only: fingerprints of the hidden rows the draft forward "
         "consumed"),
    ], scope=RANK)
    + _specs("block tables", (_D0, _DK), [
        ("block_table_draft_stale_tail", "int64", "[]", "vLLM only: non-zero entries past num_blocks "
         "dropped from block_table_draft"),
    ], scope=RANK)
    + _specs("DSpark draft", (_D0,), [
        ("draft_block_tokens", "int64", "[R, K]", "all K tokens DSpark's one replicated forward proposed"),
        ("draft_query_start_loc", "int32|int64", "[R+1]", "cumulative starts of the DSpark query rows"),
        ("draft_context_positions", "int64", "[T]", "positions of the context rows DSpark writes"),
        ("draft_context_slot_mapping", "int64", "[G, T]", "KV slots of the context rows"),
        ("block_table_gathers", "int64", "[]", "block-table gathers the propose call ran"),
        ("slot_mapping_draft_no_gather", "int64", "[G, R*Q]", "replay only: slot_mapping_draft had "
         "propose skipped its block-table gather"),
        ("draft_context_slot_mapping_no_gather", "int64", "[G, T]", "replay only: the context slots "
         "without the gather"),
        ("block_table_draft_no_gather", "int32", "[G, R, W]", "replay only: the rows prepare_dflash_inputs "
         "reads without the gather"),
    ], scope=RANK)
    + _specs("verify", (_V,), [
        ("req_ids", "str", "[R]", "request ids of the verified rows (the target's global order)"),
        ("idx_mapping", "int32|int64", "[R]", "request-state row of each verified request",
         dict(pad="-1 marks a masked row (vLLM's post_update skips it)", run_specific=_PER_RUN_ROW)),
        ("num_draft_tokens", "int64", "[R]", "draft tokens verified per request (0: none carried)"),
        ("sampled_token_ids", "int64", "[R, K+1]", "tokens sampled per request: the accepted drafts, then "
         "the bonus or correction token", dict(pad="-1 past num_sampled")),
        ("num_sampled", "int64", "[R]", "tokens sampled per request (0 or num_accepted + 1)"),
        ("num_rejected", "int64", "[R]", "draft tokens rejected per request"),
        ("num_accepted", "int64", "[R]", "draft tokens accepted per request"),
        ("num_computed_after", "int64", "[R]", "the GPU cursor after this step's verify: tokens computed "
         "per request once its rejected drafts are rolled back (vLLM's post_update: num_computed_tokens "
         "+= q - num_rejected)", dict(pad="-1 marks a masked row")),
    ], align=_REQ)
    + _specs("digests", (_T,), [
        ("top1_token", "int64", "[S]", "engine only: argmax token of each sampled row"),
        ("hidden_hash", "uint64|str", "[T] or []", "engine only: per-token hash of the restored hidden "
         "states (older traces: one hex digest of the step, a str)",
         dict(run_specific="float reductions differ across PCP sizes")),
    ], scope=RANK)
    + [v for ph, rows in FINGERPRINT_ROWS.items() for v in _specs("fingerprints", (ph,), rows, **FINGERPRINT_SPEC)]
    + _specs("dummy run", (_DU,), [
        ("num_reqs", "int64", "[]", "requests of the dummy batch"),
        ("draft_forwards", "int64", "[]", "draft forwards propose(dummy_run=True) ran"),
        ("block_table_gathers", "int64", "[]", "block-table gathers it ran"),
        ("compute_slot_mapping_calls", "int64", "[]", "compute_slot_mappings calls it made"),
        ("pcp_hidden_all_gathers", "int64", "[]", "PCP hidden-state all-gathers it made"),
        ("all_gathers", "int64", "[]", "replay only: collectives of this rank's fake PCP group"),
        ("draft_tokens", "int64", "[R, K]", "what the dummy propose returned"),
    ], scope=RANK)
    + [v for phases, rows, extra in GRAPH_ROWS for v in _specs("CUDA graphs", phases, rows, scope=RANK, **extra)]
    + _specs("DCP", (_T,), [
        ("dcp_owner", "int64", "[T]", "DCP > 1: the DCP rank that stores each global token's KV "
         "(pcpviz.reference.dcp.dcp_owner of its position); each rank's slot mappings hold its share, PAD "
         "elsewhere", dict(scope=GLOBAL, align=_TOK)),
    ], panel="dcp_shards")
    + _specs("DCP", (_T, _D0), [
        ("dcp_local_seq_lens", "int64", "[r]", "DCP > 1: how many of each local row's seq_len tokens "
         "this rank stores (get_dcp_local_seq_lens): its attention reads local tokens 0..len-1"),
        ("dcp_ranks_combined", "int64", "[]", "DCP > 1: ranks whose partial attention the LSE combine "
         "summed (fewest over the layers)"),
    ], scope=RANK, panel="dcp_shards")
    + _specs("DCP", (_DK,), [
        ("dcp_local_seq_lens", "int64", "[R]", "DCP > 1: the draft decode's per-rank local_len: this "
         "rank's share of draft_positions + 1 (vllm#50391)"),
        ("dcp_ranks_combined", "int64", "[]", "DCP > 1: ranks whose partial attention the LSE combine "
         "summed (fewest over the layers)"),
    ], scope=RANK, panel="dcp_shards")
    + _specs("collectives", _ALL, [
        ("collectives", "str", "[M]", "CPU replay and engine: every collective this rank's PCP group ran in the "
         "phase, in order: kind, group, the dtype and shape it sent, the dimension "
         "(pcpviz.trace.collectives.describe); absent where not recorded"),
    ], scope=RANK)
    + _specs("timing", _ALL, [
        ("t_start_us", "int64", "[]", "wall clock when the phase started (µs since the epoch)"),
        ("t_end_us", "int64", "[]", "wall clock when the phase ended (µs since the epoch)"),
    ], scope=RANK, run_specific="wall-clock time")
)
"""Every view producers write, per phase class (see ``ViewSpec``)."""

DCP_SHARE_VIEWS = frozenset({"slot_mapping_global", "slot_mapping_gathered", "slot_mapping_draft"})
"""Views declared ``GLOBAL`` that hold one DCP rank's share when run.json's ``dcp`` > 1 (the slots
of tokens another DCP rank stores are PAD): ``ranks_agree`` does not compare them across ranks
whose DCP ranks differ; ``dcp_kv_sharding`` checks them instead."""

