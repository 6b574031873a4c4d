"""The pcpviz trace schema: names (phases, and every view with its dtype, shape, padding and
meaning: ``VIEW_SPECS``) and the on-disk layout; the value codec is in ``codec`` (re-exported).

A run is a directory::

    run/
      run.json       {"pcpviz_trace_schema": 2, "producer": ..., "pcp": 2, ...}  (any JSON dict)
      rank0.arrow    Arrow IPC *stream*: schema header, then one record batch per engine step
      rank1.arrow    ...
      complete.json  how each rank's writer ended, written last (``pcpviz.trace.completion``)

Each rank file is an Arrow IPC stream whose schema metadata carries ``pcpviz_trace_schema`` (the
version, as text) and ``rank``. Every completed engine step is **one record batch** with one row
per (phase, view)::

    step   phase     view         dtype          shape   data                crc32       step_crc32
    int64  string    string       string         list    large_binary        uint32      uint32
    7      "target"  "positions"  "<i8"          [12]    96 raw bytes        0x1c0ffee5  0x5eed0007
    7      "target"  "segments"   "struct:{..}"  [3]     3*48 raw bytes      ...         0x5eed0007
    7      "verify"  "req_ids"    "str"          [2]     b'["a","b"]     '   ...         0x5eed0007

Why this layout:

* **A step is atomic.** A record batch is one length-prefixed IPC message, handed to the kernel in
  one unbuffered ``os.write`` loop after the whole step was validated and encoded. A writer killed mid-step
  leaves a partial trailing message that the reader detects and drops; every earlier step is
  intact. No footer is needed (unlike the IPC *file* format), so the file is append-only.
* **Cheap, lazy open.** The reader memory-maps the file. Reading a batch is zero-copy, so open
  only touches the small columns (step/phase/view/dtype/shape/crc32) and the offsets of
  ``data``; payloads are decoded on demand.
* **Any view, any dtype, any ndim.** Views differ per phase and producers add new ones, so the
  views are rows, not columns (a fixed column set would need a schema change per new view).
  ``dtype`` is a tag: a little-endian NumPy type string (``"<i8"``, ``"|b1"``, ``"<f4"``),
  ``"str"`` (payload: a JSON list of the strings in C order), or ``"struct:<json dtype>"`` for
  structured arrays (the ``segments`` table). ``shape`` is the NumPy shape (``[]`` for 0-d).
* **Zero-copy decode.** Payloads are stored raw and padded to 8 bytes (zeros, or spaces after
  JSON, which JSON ignores); Arrow's IPC buffers are 8-byte aligned, so ``np.frombuffer`` gives an
  aligned read-only view of the mapped file.
* **Corruption is caught, not returned.** ``crc32`` covers the row's step, phase, view, dtype,
  shape and stored bytes; it is checked when the row is decoded (reading it on open would defeat
  laziness). ``step_crc32`` (same value on every row of the batch) covers the step's whole index
  (every row's step, phase, view, dtype, shape, size and crc32), so a damaged name, shape or a row
  moved to another phase is caught on open without reading payloads. Damage Arrow itself cannot
  parse, and index damage, are treated like a partial tail (see ``reader``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from .files import COMPLETION_FILE, COMPLETION_KEY, RANK_FILE_RE, RUN_META_FILE, rank_file_name  # noqa: F401
from .fingerprints import FINGERPRINT_ROWS, FINGERPRINT_SPEC
from .graph_views import GRAPH_ROWS
from .versions import SCHEMA_VERSIONS, upgrade_views  # noqa: F401 - re-exported, like the codec below
from .codec import (  # noqa: F401 - the value codec, re-exported (``schema.encode_value`` ...)
    ALIGN, STR_TAG, STRUCT_PREFIX, Encoded, check_shape, decode_payload, encode_value, padded_size,
    parse_dtype_tag, row_crc32, step_crc32,
)

__all__ = [
    "SCHEMA_VERSION", "SCHEMA_VERSIONS", "upgrade_views", "META_SCHEMA_KEY", "META_RANK_KEY", "RUN_META_FILE",
    "COMPLETION_FILE", "COMPLETION_KEY", "rank_file_name",
    "PHASE_TARGET", "PHASE_VERIFY", "PHASE_DUMMY", "DRAFT_PHASE_PREFIX", "PHASES",
    "draft_phase", "draft_index", "is_valid_phase", "phase_sort_key", "causal_phase_key", "int_view",
    "GLOBAL_BATCH_VIEWS", "LAYOUT_VIEWS", "LOCAL_BATCH_VIEWS", "BLOCK_TABLE_VIEWS",
    "SLOT_MAPPING_VIEWS", "DRAFT_VIEWS", "VERIFY_VIEWS", "DIGEST_VIEWS", "VIEW_GROUPS", "VIEWS",
    "KNOWN_VIEWS", "PHASE_CLASSES", "GLOBAL", "RANK", "ViewSpec", "VIEW_SPECS", "phase_class", "view_spec",
    "phase_views", "view_panel", "undeclared_views", "views_markdown", "RUN_SPECIFIC_VIEWS", "TIMING_VIEWS", "DRAFT_VIEW_RANK_LOCAL", "DRAFT_VIEW_REPLICATED", "PAD_SLOT", "SEGMENT_DTYPE",
    "segments_table", "is_valid_view_name", "ARROW_SCHEMA", "arrow_schema",
]

# --------------------------------------------------------------------------- versions & files

SCHEMA_VERSION = 2
"""Version of this format; bumped on any change an older reader would misread (``SCHEMA_VERSIONS``)."""
META_SCHEMA_KEY = "pcpviz_trace_schema"
"""Key of the schema version, in run.json and in each rank file's Arrow schema metadata."""

META_RANK_KEY = "rank"
"""Arrow schema metadata key holding the rank a file belongs to (must match its file name)."""


# --------------------------------------------------------------------------- phases

PHASE_TARGET = "target"
"""The target model's forward on this rank's PCP-local rows."""
PHASE_VERIFY = "verify"
"""Sampling/rejection outcome on the global batch (identical on every rank)."""
PHASE_DUMMY = "dummy"
"""A profile/dummy run: no gather, no collectives."""
DRAFT_PHASE_PREFIX = "draft_"
"""Draft step k is phase ``draft_{k}``: k=0 rank-local draft prefill, k>=1 replicated decodes."""

PHASES: dict[str, str] = {
    PHASE_DUMMY: "profile/dummy run (no gather, no collectives)",
    PHASE_TARGET: "target forward on the rank-local DualChunkSwap rows",
    "draft_<k>": "draft step k: k=0 rank-local draft prefill, k>=1 replicated draft decode",
    PHASE_VERIFY: "sampling/rejection outcome on the global batch",
}
"""The phase vocabulary with a one-line doc each (``draft_<k>`` stands for draft_0, draft_1, ...)."""

_PHASE_RE = re.compile(r"^(?:target|verify|dummy|draft_(?:0|[1-9][0-9]*))$")


def draft_phase(k: int) -> str:
    """Name of draft step ``k`` (``draft_phase(0) == "draft_0"``)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"draft step must be an int >= 0, got {k!r}")
    return f"{DRAFT_PHASE_PREFIX}{int(k)}"


def draft_index(phase: str) -> int | None:
    """k for ``draft_k``, None for any other phase."""
    return _draft_index(phase) if isinstance(phase, str) else None


@lru_cache(maxsize=1024)
def _draft_index(phase: str) -> int | None:
    if is_valid_phase(phase) and phase.startswith(DRAFT_PHASE_PREFIX):
        return int(phase[len(DRAFT_PHASE_PREFIX):])
    return None


@lru_cache(maxsize=1024)
def _valid_phase(phase: str) -> bool:
    return _PHASE_RE.match(phase) is not None


def is_valid_phase(phase: object) -> bool:
    """True for ``target``, ``verify``, ``dummy`` and ``draft_<int>`` (no leading zeros)."""
    return isinstance(phase, str) and _valid_phase(phase)


def causal_phase_key(phase: str) -> tuple[int, int]:
    """The order phases actually run in vLLM's ``sample_tokens``: target forward, then
    sampling/verification, then the drafter's propose (draft_0 .. draft_{K-1}). ``phase_sort_key``
    (the trace's listing order) shows ``verify`` last; checks, diffs and timelines need this one."""
    k = draft_index(phase)
    if k is not None:
        return (3, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (2, 0)}.get(phase, (4, 0))


def phase_sort_key(phase: str) -> tuple[int, int]:
    """Execution order within a step: dummy, target, draft_0 .. draft_{K-1}, verify."""
    k = draft_index(phase)
    if k is not None:
        return (2, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (3, 0)}[phase]


# --------------------------------------------------------------------------- views
#
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

PHASE_CLASSES = (PHASE_TARGET, "draft_0", "draft_k", PHASE_VERIFY, PHASE_DUMMY)
"""The phase classes views are declared for: ``draft_k`` stands for every draft phase k >= 1."""

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
         "request)", dict(align=("req", -1), pad="PAD_SLOT (-1) on rows not written", panel="slot_mappings")),
    ])
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
    + _specs("timing", _ALL, [
        ("t_start_us", "int64", "[]", "wall clock when the phase started (µs since the epoch)"),
        ("t_end_us", "int64", "[]", "wall clock when the phase ended (µs since the epoch)"),
    ], scope=RANK, run_specific="wall-clock time")
)
"""Every view producers write, per phase class (see ``ViewSpec``)."""


def phase_class(phase: str) -> str:
    """The class a phase's views are declared under: ``draft_3`` -> ``draft_k``."""
    k = draft_index(phase)
    return phase if k is None else ("draft_0" if k == 0 else "draft_k")


_SPEC_INDEX: dict[tuple[str, str], ViewSpec] = {}
for _s in VIEW_SPECS:
    for _p in _s.phases:
        if (_p, _s.name) in _SPEC_INDEX:
            raise AssertionError(f"view {_s.name!r} declared twice for phase {_p}")
        _SPEC_INDEX[(_p, _s.name)] = _s


def int_view(values, name: str):
    """int64 array of an integer view as read from a file. A producer may store integers in a
    float column; those are kept when every value is a whole finite number, and anything else
    (NaN, inf, 2.5) raises ValueError naming the view, not a silent cast to garbage::

        int_view(np.array([1.0, 2.0]), "num_accepted")    # array([1, 2])
        int_view(np.array([1.0, nan]), "num_accepted")    # ValueError: num_accepted holds nan
    """
    import numpy as np

    a = np.asarray(values)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    if a.dtype.kind != "f":
        raise ValueError(f"{name} holds {a.dtype} values, not integers")
    bad = ~np.isfinite(a) | (a != np.round(a)) | (np.abs(a) >= 2.0**63)
    if bad.any():
        raise ValueError(f"{name} holds {float(a[bad].flat[0])!r}, not an integer")
    return a.astype(np.int64)


def view_spec(phase: str, name: str) -> ViewSpec | None:
    """The spec of view ``name`` in ``phase`` (any draft_k), None if it is not declared."""
    return _SPEC_INDEX.get((phase_class(phase), name))


def phase_views(phase: str) -> dict[str, ViewSpec]:
    """Every view declared for ``phase``'s class, by name."""
    cls = phase_class(phase)
    return {name: s for (p, name), s in _SPEC_INDEX.items() if p == cls}


def view_panel(name: str | None, phase: str | None = None) -> str:
    """The Workbench figure that draws view ``name`` (of ``phase``, or its first declaration):
    ``token_order``, ``block_tables``, ``slot_mappings``, else ``timeline``."""
    if name is None:
        return "timeline"
    spec = view_spec(phase, name) if phase is not None and is_valid_phase(phase) else None
    spec = spec or next((s for s in VIEW_SPECS if s.name == name), None)
    return "timeline" if spec is None else spec.panel


def undeclared_views(phases: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``"phase/view: why"`` for every view of one step's ``{phase: {view: value}}`` that the
    schema does not declare or whose dtype kind or number of axes does not fit."""
    out = []
    for phase, views in phases.items():
        for name, value in views.items():
            spec = view_spec(phase, name)
            why = "not declared in pcpviz.trace.schema" if spec is None else spec.problem(value)
            if why:
                out.append(f"{phase}/{name}: {why}")
    return out


def views_markdown() -> str:
    """The view table as Markdown (one row per declared view), for the docs."""
    lines = ["| phase | view | type | meaning | padding |", "|---|---|---|---|---|"]
    for s in VIEW_SPECS:
        lines.append(f"| {', '.join(s.phases)} | `{s.name}` | `{s.decl}` | {s.meaning} | {s.pad} |")
    return "\n".join(lines)


def _group(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in VIEW_SPECS:
        if s.group == name:
            out.setdefault(s.name, f"{s.decl}: {s.meaning}")
    return out


VIEW_GROUPS: dict[str, dict[str, str]] = {g: _group(g) for g in dict.fromkeys(s.group for s in VIEW_SPECS)}
"""Declared views by group, in display order: name -> ``"dtype[shape]: meaning"``."""

GLOBAL_BATCH_VIEWS = VIEW_GROUPS["global batch"]
LAYOUT_VIEWS = VIEW_GROUPS["layout"]
LOCAL_BATCH_VIEWS = VIEW_GROUPS["rank-local batch"]
BLOCK_TABLE_VIEWS = VIEW_GROUPS["block tables"]
SLOT_MAPPING_VIEWS = VIEW_GROUPS["slot mappings"]
DRAFT_VIEWS = VIEW_GROUPS["draft step"]
VERIFY_VIEWS = VIEW_GROUPS["verify"]
DIGEST_VIEWS = VIEW_GROUPS["digests"]

VIEWS: dict[str, str] = {name: doc for group in VIEW_GROUPS.values() for name, doc in group.items()}
"""Every declared view name -> one-line doc (its first declaration)."""

KNOWN_VIEWS: frozenset[str] = frozenset(VIEWS)
"""The set of declared view names."""

RUN_SPECIFIC_VIEWS: frozenset[str] = frozenset(s.name for s in VIEW_SPECS if s.run_specific)
"""Views two correct runs differ in (timestamps, hashes, request-state rows): diff ignores them."""

TIMING_VIEWS: frozenset[str] = frozenset(s.name for s in VIEW_SPECS if s.group == "timing")
"""Wall-clock views."""

DRAFT_VIEW_RANK_LOCAL = "rank_local"
"""Value of the ``view`` view for a draft step that ran on the rank-local rows."""
DRAFT_VIEW_REPLICATED = "replicated"
"""Value of the ``view`` view for a draft step replicated on the global batch."""

PAD_SLOT = -1
"""Slot-mapping value of a padding row (never written)."""

SEGMENT_DTYPE = np.dtype([("global_req_idx", "<i8"), ("global_start", "<i8"), ("global_stop", "<i8"),
                          ("local_start", "<i8"), ("local_stop", "<i8"), ("rank", "<i8")])
"""Row type of the ``segments`` view: one row per (rank, segment)."""

_SEGMENT_FIELDS = SEGMENT_DTYPE.names[:5]


def segments_table(segments_by_rank: Iterable[Iterable[Any]]) -> np.ndarray:
    """The ``segments`` view from per-rank segments (``PCPLayout.segments_by_rank``).

    Each segment is an object with the five ``SEGMENT_DTYPE`` attributes (``pcpviz.reference.layout.Segment``)
    or a sequence of those five ints. Rows are ordered by rank, then as given.
    """
    rows = []
    for rank, segments in enumerate(segments_by_rank):
        for seg in segments:
            if hasattr(seg, "global_req_idx"):
                vals = tuple(int(getattr(seg, f)) for f in _SEGMENT_FIELDS)
            else:
                vals = tuple(int(v) for v in seg)
                if len(vals) != 5:
                    raise ValueError(f"segment {seg!r} of rank {rank}: expected 5 ints")
            rows.append(vals + (rank,))
    return np.array(rows, dtype=SEGMENT_DTYPE)


_VIEW_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@lru_cache(maxsize=4096)
def _valid_view_name(name: str) -> bool:
    return _VIEW_NAME_RE.match(name) is not None


def is_valid_view_name(name: object) -> bool:
    """View names are lower-case identifiers: ``[a-z][a-z0-9_]*``."""
    return isinstance(name, str) and _valid_view_name(name)


# --------------------------------------------------------------------------- Arrow layout

ARROW_SCHEMA = pa.schema([
    pa.field("step", pa.int64(), nullable=False),
    pa.field("phase", pa.string(), nullable=False),
    pa.field("view", pa.string(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
    pa.field("crc32", pa.uint32(), nullable=False),
    pa.field("step_crc32", pa.uint32(), nullable=False),
])
"""Columns of every rank file (one row per (phase, view); one record batch per step)."""


def arrow_schema(rank: int) -> pa.Schema:
    """``ARROW_SCHEMA`` with this rank's metadata (version, rank)."""
    from pcpviz import __version__

    return ARROW_SCHEMA.with_metadata({
        META_SCHEMA_KEY: str(SCHEMA_VERSION),
        META_RANK_KEY: str(int(rank)),
        "pcpviz_version": __version__,
        COMPLETION_KEY: COMPLETION_FILE,
    })


def run_meta_with_version(meta: Mapping[str, Any]) -> dict[str, Any]:
    """run.json content: ``meta`` plus the schema version (first key; an older trace's meta: this one's)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"run meta must be a dict, got {type(meta).__name__}")
    if META_SCHEMA_KEY in meta and (type(meta[META_SCHEMA_KEY]) is not int or meta[META_SCHEMA_KEY] not in SCHEMA_VERSIONS):
        raise ValueError(f"run meta has {META_SCHEMA_KEY}={meta[META_SCHEMA_KEY]!r}; "
                         f"this pcpviz writes version {SCHEMA_VERSION}")
    out: dict[str, Any] = {META_SCHEMA_KEY: SCHEMA_VERSION}
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"run meta keys must be str, got {key!r}")
        out[key] = SCHEMA_VERSION if key == META_SCHEMA_KEY else value
    return out
