"""The fault registry: every known PCP + MTP bug a pcpviz producer can inject on purpose.

One registry for all producers. Each fault is one ``fault(...)`` declaration, whose value is its
``name`` (the constant, e.g. ``SAMPLE_LOCAL_LOGITS``, that its switches read). It gives a
``summary`` (what it breaks), ``producers`` (who can inject it: ``ENGINE`` =
``pcpviz.run(inject=...)``, ``SYNTHETIC`` = ``pcpviz.synthetic.generate(faults=...)``),
``caught_by`` (the ``pcpviz.analysis.checks`` check that reports it) and ``faithful``. Faults the
engine injects also say what they model (``models``: the shape of a real reported regression,
with its public ``source``), where the bug lives in
vLLM (``where``), the ``signature`` they leave in a trace (``pcpviz.analysis.explain`` matches it with
``pcpviz.analysis.explain.rules.RULES[name]``) and whether they change the generated tokens
(``changes_outputs``).

A fault may start late: ``NAME@S`` injects it from step S on (``NAME`` = ``NAME@0``), so the
step of onset can be varied (``pcpviz run --inject stale_draft_block_table_rows@3``)::

    >>> parse_fault("stale_draft_block_table_rows@3")
    ('stale_draft_block_table_rows', 3)
    >>> sorted(active_faults(["sample_local_logits@2", "rank_divergent_acceptance"], 1))
    ['rank_divergent_acceptance']
    >>> FAULTS[SKIP_DRAFT_BLOCK_TABLE_GATHER].caught_by
    'draft_block_tables_global'
    >>> sorted(faults_of(SYNTHETIC))[:2]
    ['draft_positions_not_advanced', 'expanded_draft_slot_mapping']

With PCP=2 and K=2, ``SKIP_DRAFT_BLOCK_TABLE_GATHER`` makes draft_1 read the persistent
``input_block_tables`` (zeros: the target never writes them under PCP) instead of the global rows,
so with two decodes holding blocks ``[1, 2]`` and ``[3, 4]`` draft_1's ``block_table_draft`` rows
read ``[0, 0]`` and ``[0, 0]`` where ``block_table_global`` has the real ones:
``draft_block_tables_global`` fails at row 0.

``faithful`` says whether a producer reproduces the bug as vLLM would have it. A fault that is
not (``faithful=False``) is an *illustration*: the same kind of mistake, placed where the tiny
model can show it; its summary starts with "ILLUSTRATION" and says how vLLM differs.

Adding a fault (CONTRIBUTING.md): one ``fault(...)`` declaration here (its return value is the
constant), the switch in each producer it names (reading the constant), an explain rule when the
engine injects it; ``tests/analysis/test_fault_registry.py`` fails until all three agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pcpviz.limits import MAX_ONSET_STEP

__all__ = [
    "Fault", "FAULTS", "fault", "ENGINE", "SYNTHETIC", "PRODUCERS", "PRODUCER_MODULES", "faults_of", "parse_fault",
    "validate_faults", "active_faults", "STALE_ROWS_PER_LAUNCH",
]  # + every fault's constant (added at the end of the module)

# --------------------------------------------------------------------------- producers

ENGINE = "engine"
"""``pcpviz.run(..., inject=[...])``: the engine runs the tiny model with the bug in its data path."""
SYNTHETIC = "synthetic"
"""``pcpviz.synthetic.generate(..., faults=[...])``: a synthetic trace built consistently with the bug."""
PRODUCERS = (ENGINE, SYNTHETIC)

PRODUCER_MODULES: dict[str, tuple[str, ...]] = {
    ENGINE: ("pcpviz/engine",),
    SYNTHETIC: ("pcpviz/synthetic",),
}
"""Where each producer's fault switches live (``tests/analysis/test_fault_registry.py`` reads them: every
switch names a fault the producer declares, every declared fault has a switch)."""

STALE_ROWS_PER_LAUNCH = 2
"""Rows one launch of the faulty draft block-table gather covers (``stale_draft_block_table_rows``):
the model of a kernel whose single launch handles at most this many rows (ROCm ATOM's CU-wave
capacity, scaled down to the tiny batches of the engine)."""


@dataclass(frozen=True)
class Fault:
    """One injectable bug. ``producers``: who can inject it (``ENGINE``, ``SYNTHETIC``);
    ``caught_by``: the check that reports it. The remaining fields describe the bug as the
    engine reproduces it (required for ``ENGINE`` faults, optional otherwise)."""

    name: str
    summary: str  # what it breaks
    caught_by: str  # the pcpviz.analysis.checks check that reports it
    producers: frozenset[str]
    faithful: bool = True  # False: an illustration, not vLLM's bug as it would happen
    where: str = ""  # the vLLM code the bug lives in
    models: str = ""  # the shape of regression it models (a reported collapse, or the PR review)
    source: str = ""  # public report or review it is modelled on
    signature: str = ""  # what it leaves in a trace (matched by pcpviz.analysis.explain)
    changes_outputs: bool = False  # the generated tokens change (otherwise only acceptance)


_BOTH = (ENGINE, SYNTHETIC)
_ENGINE = (ENGINE,)
_SYNTHETIC = (SYNTHETIC,)
_REVIEW = "the review of vLLM 0.33.0's PCP + MTP pull request"

FAULTS: dict[str, Fault] = {}
"""Every declared fault, by name, in declaration order (filled by ``fault``)."""


def fault(name: str, summary: str, *, caught_by: str, producers: Iterable[str], faithful: bool = True,
          where: str = "", models: str = "", source: str = "", signature: str = "",
          changes_outputs: bool = False) -> str:
    """Declare a fault: ``FAULTS[name] = Fault(...)``; returns ``name``, the constant its switches read."""
    if name in FAULTS:
        raise ValueError(f"fault {name!r} declared twice")
    FAULTS[name] = Fault(name, summary, caught_by, frozenset(producers), faithful, where, models, source,
                         signature, changes_outputs)
    return name


# -- modelled on reported bugs, injected by the engine (and some by the synthetic generator)
SKIP_DRAFT_BLOCK_TABLE_GATHER = fault(
    "skip_draft_block_table_gather",
    "the replicated draft decodes read BlockTables.input_block_tables without the gather back "
    "to global order; under PCP the target never writes them, so the drafter attends the null "
    "block; its KV writes still land in the right slots, which come from the request-indexed "
    "table through idx_mapping (the bug the PR's reviewer caught)",
    caught_by="draft_block_tables_global", producers=_BOTH,
    where="TargetDependentARSpeculator.propose: block_tables.gather_block_tables before prepare_decode_inputs",
    models="draft decodes attending the wrong KV blocks: acceptance falls from draft position 1 on",
    source=f"{_REVIEW} (pcpviz.teaching.review, notebook 06)",
    signature="block_table_draft differs from block_table_global from batch row 0 on (every row "
              "stale, typically the null block); position-0 acceptance level, positions >= 1 drop; "
              "outputs unchanged",
)

FOLD_SLOT_MAPPING_WITHOUT_SHAPE_CHECK = fault(
    "fold_slot_mapping_without_shape_check",
    "ILLUSTRATION, not vLLM's bug: a replicated draft decode's KV write folds its unexpanded "
    "length-R slot mapping by the PCP size and keeps R//N rows of both the latent KV and the "
    "mapping, so the other requests' draft KV is never written. In vLLM the fold (the pre-fix "
    "`if use_pcp:`) lives only in the sparse indexer's key-cache write, truncates k alone and "
    "leaves the slot mapping whole (with 0.33.0's helpers the write then trips an assert); the "
    "tiny model has no indexer, so the engine shows the idea on its dense latent KV",
    caught_by="draft_decode_replicated", producers=_ENGINE,
    faithful=False,
    where="sparse_attn_indexer: `if use_pcp and num_tokens > k.shape[0]` (indexer k only)",
    models="a shape-unchecked fold of an unexpanded slot mapping: most requests' draft KV never written",
    source=f"{_REVIEW}: the sparse indexer's fold (pcpviz.teaching.review)",
    signature="slot_mapping_draft of draft_k (k >= 1) is PAD (-1) from row R // N on, at every draft "
              "position; acceptance from draft position 2 on drops (K >= 3); outputs unchanged",
)

POSITIONS_FROM_CPU_CURSOR = fault(
    "positions_from_cpu_cursor",
    "local positions (and local seq_lens) are rebuilt from the CPU cursor (num_computed_tokens_np, "
    "an upper bound after a rejection) instead of gathered from the global batch's GPU positions",
    caught_by="local_positions_are_global", producers=_BOTH,
    changes_outputs=True,
    where="PCPManager.partition_batch: index_select(global_batch.positions, local_gather_idx)",
    models="positions from the CPU cursor after a rejection: RoPE and KV slots off by the rejected count",
    source=f"{_REVIEW}: PCPManager.partition_batch (pcpviz.teaching.review)",
    signature="local_positions exceed the global positions by the previous step's rejections, only "
              "on steps after a rejection; target KV is corrupted, so outputs change",
)

SAMPLE_LOCAL_LOGITS = fault(
    "sample_local_logits",
    "sampling reads the rank-local hidden states at the global logits_indices, skipping "
    "restore_for_sampling (all-gather + hidden_restore_idx)",
    caught_by="local_logits_not_sampled", producers=_BOTH,
    changes_outputs=True,
    where="GPUModelRunner.sample_tokens: pcp_manager.restore_for_sampling",
    models="sampling from rank-local rows: wrong target tokens, ranks disagree",
    source=f"{_REVIEW}: restore_for_sampling (pcpviz.teaching.review)",
    signature="sampled_logits_rows != logits_indices (clamped to the rank's rows), sampled_from "
              "'local'; outputs change and ranks disagree from verify on",
)

DRAFT_PREFILL_READS_CAPTURED_BUFFERS = fault(
    "draft_prefill_reads_captured_buffers",
    "under PIECEWISE CUDA graphs the draft prefill replays a graph captured on the speculator's "
    "own input_ids / positions buffers, so the MTP layer embeds and rotates the first P rows of "
    "the *global* shifted ids and positions (prepare_prefill_inputs writes them there) instead "
    "of this rank's DualChunkSwap rows, which get_draft_input_buffers hands to the model: "
    "hidden states, attention metadata and slots stay right, tokens stay right, acceptance "
    "collapses. The hypothesis for the collapse in data/traces/vllm-h200x2-pcp2-mtp2-piecewise; "
    "the engine records the ids the drafter consumed, vLLM's recorder the ids it was handed",
    caught_by="draft_input_ids", producers=_ENGINE,
    where="TargetDependentARSpeculator._run_model: pcp_manager.get_draft_input_buffers under "
          "CUDAGraphWrapper's replay by captured address (compilation/cuda_graph.py)",
    models="acceptance collapsing from draft position 0 with the same tokens, only with PIECEWISE "
           "CUDA graphs and PCP > 1",
    source="pcpviz's own finding on 2 x H200 (docs/findings/piecewise-draft-prefill.md)",
    signature="draft_0's local draft_input_ids are the first P global shifted ids instead of the "
              "rank's rows (an engine trace; vLLM's recorder logs the ids the drafter was handed, so "
              "there the check passes); drafts differ from step 0 after differences only in the "
              "padded layout; every position collapses, outputs unchanged",
)

DRAFT_DECODES_READ_PREFILL_BATCH = fault(
    "draft_decodes_read_prefill_batch",
    "after a FULL draft-prefill replay the PCP manager's draft_prefill_batch stays set (the replay "
    "runs no Python, so restore_draft_prefill never clears it); eager draft decodes of the same step "
    "are then handed the draft prefill's rank-local batch: each is fed its first R ids and positions "
    "instead of the previous draft tokens at the next positions (the engine, which shards decodes, feeds "
    "the rows that batch holds under replicated decodes: the global ones; decode-only steps only). Slots "
    "and attention metadata stay right, so the drafter's K/V is written at the right slots from the wrong rows",
    caught_by="draft_input_ids", producers=_ENGINE,
    where="TargetDependentARSpeculator.propose: the FULL branch (run_fullgraph) skips _prefill's "
          "restore_draft_prefill; _run_model -> PCPManager.get_draft_input_buffers",
    models="acceptance falling from draft position 1 with the same tokens, only with a FULL draft-prefill "
           "graph and eager draft decodes in one step (FULL_DECODE_ONLY / FULL_AND_PIECEWISE, PCP > 1)",
    source="pcpviz's finding, reproduced with vLLM 0.33.0's graph dispatch on CPU "
           "(docs/findings/full-draft-prefill-state.md)",
    signature="on decode-only steps draft_k's (k >= 1) draft_input_ids are the first R of draft_0's "
              "draft_global_input_ids (the draft prefill's rows with replicated decodes), not draft_{k-1}'s "
              "tokens; draft_0 is right; acceptance falls from position 1, every rank alike, outputs unchanged",
)

RANK_DIVERGENT_ACCEPTANCE = fault(
    "rank_divergent_acceptance",
    "ranks other than 0 accept one draft fewer than rank 0, so their request cursors, draft "
    "inputs and KV caches fork silently while the scheduler follows rank 0",
    caught_by="ranks_agree", producers=_ENGINE,
    changes_outputs=True,
    where="rejection sampling must be identical on every PCP rank",
    models="ranks forking silently after a rejection",
    source="vLLM 0.33.0's design: every PCP rank runs the rejection sampler and must agree "
           "(the ranks_agree check)",
    signature="ranks_agree first fails at a verify (num_accepted differs on ranks > 0) while every "
              "per-rank check passes; KV replicas diverge and outputs change",
)

STALE_DRAFT_BLOCK_TABLE_ROWS = fault(
    "stale_draft_block_table_rows",
    "the gather of the draft block tables back to global order covers at most "
    "STALE_ROWS_PER_LAUNCH rows per launch and is launched once, so batch rows past that keep "
    "whatever the persistent input_block_tables buffer held (under PCP the target never writes "
    "it: zeros, the null block); those requests' replicated draft decodes attend the wrong KV",
    caught_by="draft_block_tables_global", producers=_ENGINE,
    where="BlockTables.gather_block_tables before the replicated draft decodes (one launch for all R rows)",
    models="acceptance halves only for requests past a certain row of a large batch: stale rows "
           "left in a persistent index buffer beyond one launch's capacity (sparse-MLA decode, MTP)",
    source="ROCm ATOM PR #1593 (https://github.com/ROCm/ATOM/pull/1593)",
    signature="block_table_draft differs from block_table_global only in batch rows >= N (rows "
              "below N always right), only on steps with more than N requests; acceptance drops "
              "for the requests in those rows at positions >= 1, outputs unchanged",
)

DRAFT_SLOT_FROM_SEQ_LEN = fault(
    "draft_slot_from_seq_len",
    "the replicated draft decodes take the KV block of a position from its seq_len "
    "(position + 1) // block_size instead of position // block_size, so a draft whose position "
    "is the last slot of a block writes its KV into the next block (or the null block when that "
    "is not allocated); a later draft step reading that position finds stale KV",
    caught_by="draft_decode_replicated", producers=_ENGINE,
    where="TargetDependentARSpeculator.propose: slot mapping of the draft decodes (compute_slot_mappings)",
    models="acceptance collapsing at specific context sizes aligned to KV-cache block boundaries",
    source="llama.cpp #23636 and #23658 (https://github.com/ggml-org/llama.cpp/issues/23636, "
           "https://github.com/ggml-org/llama.cpp/issues/23658)",
    signature="slot_mapping_draft wrong only where draft_positions % block_size == block_size - 1 "
              "(one slot before a block boundary); acceptance dips at those positions (K >= 3), "
              "outputs unchanged",
)

DRAFT_CURSOR_DRIFT_AFTER_REJECTION = fault(
    "draft_cursor_drift_after_rejection",
    "the drafter keeps its own per-request position cursor, advanced by every scheduled token "
    "and never rolled back by rejections; the replicated draft decodes run at that cursor, which "
    "drifts further ahead of the true position with every rejection",
    caught_by="draft_positions_advance", producers=_ENGINE,
    where="TargetDependentARSpeculator.propose: draft decode positions from positions[last_token_indices] + 1",
    models="acceptance drifting to zero over successive rounds at long input",
    source="vllm-ascend #10495 and #13523 (https://github.com/vllm-project/vllm-ascend/issues/10495, "
           "https://github.com/vllm-project/vllm-ascend/issues/13523)",
    signature="draft_positions ahead of positions[draft_last_token_indices] + 1 by an offset that "
              "grows over a request's steps (its cumulative rejections); position-0 acceptance "
              "level, positions >= 1 decay step by step; outputs unchanged",
)

DRAFT_HIDDEN_RANK_LOCAL = fault(
    "draft_hidden_rank_local",
    "the draft prefill picks its last-token hidden states from the rank-local MTP output at the "
    "global draft_last_token_indices (clamped to the rank's rows) instead of the all-gathered, "
    "restored one; with PCP = 1 the local tensor is the global one and nothing is wrong",
    caught_by="draft_last_token_indices", producers=_ENGINE,
    changes_outputs=True,
    where="TargetDependentARSpeculator.propose: the draft prefill's hidden states after all-gather + "
          "hidden_restore_idx",
    models="acceptance near zero only with one parallel setting on (a rank-local tensor used where "
           "the gathered one is needed)",
    source="vLLM #32009 (https://github.com/vllm-project/vllm/issues/32009, expert parallel)",
    signature="draft_last_token_indices are not the last accepted global rows (clamped local rows), "
              "only with PCP > 1; every draft position collapses, ranks draft different tokens "
              "(ranks_agree fails at draft_0 before any verify differs); the ranks then feed different "
              "drafts into one batch, so outputs change too",
)

# -- structural mistakes the synthetic generator builds consistently (check fixtures)
GLOBAL_POSITIONS_FROM_CPU_CURSOR = fault(
    "global_positions_from_cpu_cursor",
    "global positions start at the CPU cursor (an upper bound after a rejection) instead of the "
    "GPU cursor",
    caught_by="positions_consistent", producers=_SYNTHETIC)

EXPANDED_DRAFT_SLOT_MAPPING = fault(
    "expanded_draft_slot_mapping",
    "draft decodes (k >= 1) record/write the target's expanded gathered slot mapping ([G, N*P]) "
    "instead of their own [G, R]",
    caught_by="draft_decode_replicated", producers=_SYNTHETIC)

DRAFT_POSITIONS_NOT_ADVANCED = fault(
    "draft_positions_not_advanced",
    "draft decode k >= 2 reuses draft k-1's positions",
    caught_by="draft_positions_advance", producers=_SYNTHETIC)

LAST_TOKEN_IGNORES_REJECTIONS = fault(
    "last_token_ignores_rejections",
    "draft_last_token_indices = qsl + q - 1 (rejected rows included); draft positions follow the "
    "wrong rows",
    caught_by="draft_last_token_indices", producers=_SYNTHETIC)

SHARED_KV_BLOCK = fault(
    "shared_kv_block",
    "the allocator hands the first two requests the same first KV block",
    caught_by="kv_written_once", producers=_SYNTHETIC)

LAYOUT_NO_SWAP = fault(
    "layout_no_swap",
    "prefills are split into contiguous chunks (2r, 2r+1) instead of the DualChunkSwap pair "
    "(r, 2N-1-r)",
    caught_by="layout_matches_plan", producers=_SYNTHETIC)

REPLICATED_WRITER_NOT_RANK0 = fault(
    "replicated_writer_not_rank0",
    "replicated (non-sharded) rows are written by the last rank instead of rank 0",
    caught_by="kv_write_mask_canonical", producers=_SYNTHETIC)

NULL_BLOCK_WRITE = fault(
    "null_block_write",
    "the first row's block at its first scheduled position is missing from the table (0, the "
    "null block), so its KV is written into block 0",
    caught_by="global_slots_match_block_table", producers=_SYNTHETIC)


def faults_of(producer: str) -> dict[str, Fault]:
    """The faults ``producer`` (``ENGINE`` or ``SYNTHETIC``) can inject, by name."""
    if producer not in PRODUCERS:
        raise ValueError(f"unknown producer {producer!r}; known: {', '.join(PRODUCERS)}")
    return {name: f for name, f in FAULTS.items() if producer in f.producers}




def parse_fault(spec: str, *, producer: str = ENGINE) -> tuple[str, int]:
    """``"NAME"`` -> ``(NAME, 0)``, ``"NAME@3"`` -> ``(NAME, 3)``; ValueError (one line) if
    ``producer`` cannot inject NAME or the step is not an integer >= 0."""
    name, at, step = str(spec).partition("@")
    known = faults_of(producer)
    if name not in known:
        where = f" (the {producer} producer cannot inject it)" if name in FAULTS else ""
        raise ValueError(f"unknown fault {name!r}{where}; known faults: {', '.join(sorted(known))}")
    if not at:
        return name, 0
    if not (step.isascii() and step.isdigit()) or len(step) > 7 or int(step) > MAX_ONSET_STEP:
        shown = spec if len(spec) <= 60 else f"{spec[:40]}... ({len(spec)} characters)"
        raise ValueError(f"fault {shown!r}: the step of onset after '@' must be an integer in "
                         f"0..{MAX_ONSET_STEP}")
    return name, int(step)


def validate_faults(names: Iterable[str] | None, *, producer: str = ENGINE) -> frozenset[str]:
    """The fault specs (``NAME`` or ``NAME@STEP``) as given, each checked by ``parse_fault``;
    one fault at most once."""
    names = list(names or [])
    seen = set()
    for spec in names:
        name, _ = parse_fault(spec, producer=producer)
        if name in seen:
            raise ValueError(f"fault {name!r} injected twice")
        seen.add(name)
    return frozenset(names)


def active_faults(specs: Iterable[str], step: int, *, producer: str = ENGINE) -> frozenset[str]:
    """The fault names of ``specs`` active at ``step`` (their onset <= step)."""
    out = set()
    for spec in specs:
        name, onset = parse_fault(spec, producer=producer)
        if step >= onset:
            out.add(name)
    return frozenset(out)


__all__ += [k for k, v in list(globals().items()) if k.isupper() and isinstance(v, str) and v in FAULTS]
