"""The fault catalogue: known PCP + MTP bugs the engine can reproduce on purpose.

Each fault is a single switch read at one place in the data path; the check
that catches it is named so the debugging toolkit can be proven against it. Each also says
what it models (``models``: the shape of a real reported regression, with its public
``source``) and the ``signature`` it leaves in a trace, which ``pcpviz.explain`` matches.

A fault may start late: ``NAME@S`` injects it from engine step S on (``NAME`` = ``NAME@0``),
so the step of onset can be varied (``pcpviz run --inject stale_draft_block_table_rows@3``).

``faithful`` says whether the engine reproduces the bug as vLLM would have it. A fault that
is not (``faithful=False``) is an *illustration*: the same kind of mistake, placed where the
tiny model can show it; its summary starts with "ILLUSTRATION" and says how vLLM differs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fault", "FAULTS", "validate_faults", "parse_fault", "active_faults", "STALE_ROWS_PER_LAUNCH"]

STALE_ROWS_PER_LAUNCH = 2
"""Rows one launch of the faulty draft block-table gather covers (``stale_draft_block_table_rows``):
the model of a kernel whose single launch handles at most this many rows (ROCm ATOM's CU-wave
capacity, scaled down to the tiny batches of the engine)."""


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str
    where: str  # the vLLM code the bug lives in
    caught_by: str  # the pcpviz.checks check that reports it
    faithful: bool = True  # False: an illustration, not vLLM's bug as it would happen
    models: str = ""  # the shape of regression it models (a reported collapse, or the PR review)
    source: str = ""  # public report or review it is modelled on
    signature: str = ""  # what it leaves in a trace (matched by pcpviz.explain)


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault(
        "skip_draft_block_table_gather",
        "the replicated draft decodes read BlockTables.input_block_tables without the gather back "
        "to global order; under PCP the target never writes them, so the drafter attends the null "
        "block; its KV writes still land in the right slots, which come from the request-indexed "
        "table through idx_mapping (the bug the PR's reviewer caught)",
        "TargetDependentARSpeculator.propose: block_tables.gather_block_tables before prepare_decode_inputs",
        "draft_block_tables_global",
        models="draft decodes attending the wrong KV blocks: acceptance falls from draft position 1 on",
        source="the review of vLLM 0.33.0's PCP + MTP pull request (pcpviz.review, notebook 06)",
        signature="block_table_draft differs from block_table_global from batch row 0 on (every row "
                  "stale, typically the null block); position-0 acceptance level, positions >= 1 drop; "
                  "outputs unchanged",
    ),
    Fault(
        "fold_slot_mapping_without_shape_check",
        "ILLUSTRATION, not vLLM's bug: a replicated draft decode's KV write folds its unexpanded "
        "length-R slot mapping by the PCP size and keeps R//N rows of both the latent KV and the "
        "mapping, so the other requests' draft KV is never written. In vLLM the fold (the pre-fix "
        "`if use_pcp:`) lives only in the sparse indexer's key-cache write, truncates k alone and "
        "leaves the slot mapping whole (with 0.33.0's helpers the write then trips an assert); the "
        "tiny model has no indexer, so the engine shows the idea on its dense latent KV",
        "sparse_attn_indexer: `if use_pcp and num_tokens > k.shape[0]` (indexer k only)",
        "draft_decode_replicated",
        faithful=False,
        models="a shape-unchecked fold of an unexpanded slot mapping: most requests' draft KV never written",
        source="the review of vLLM 0.33.0's PCP + MTP pull request: the sparse indexer's fold "
               "(pcpviz.review)",
        signature="slot_mapping_draft of draft_k (k >= 1) is PAD (-1) from row R // N on, at every draft "
                  "position; acceptance from draft position 2 on drops (K >= 3); outputs unchanged",
    ),
    Fault(
        "positions_from_cpu_cursor",
        "local positions are rebuilt from the CPU cursor (num_computed_tokens_np, an upper bound "
        "after a rejection) instead of gathered from the global batch's GPU positions",
        "PCPManager.partition_batch: index_select(global_batch.positions, local_gather_idx)",
        "local_positions_are_global",
        models="positions from the CPU cursor after a rejection: RoPE and KV slots off by the rejected count",
        source="the review of vLLM 0.33.0's PCP + MTP pull request: PCPManager.partition_batch "
               "(pcpviz.review)",
        signature="local_positions exceed the global positions by the previous step's rejections, only "
                  "on steps after a rejection; target KV is corrupted, so outputs change",
    ),
    Fault(
        "sample_local_logits",
        "sampling reads the rank-local hidden states at the global logits_indices, skipping "
        "restore_for_sampling (all-gather + hidden_restore_idx)",
        "GPUModelRunner.sample_tokens: pcp_manager.restore_for_sampling",
        "local_logits_not_sampled",
        models="sampling from rank-local rows: wrong target tokens, ranks disagree",
        source="the review of vLLM 0.33.0's PCP + MTP pull request: restore_for_sampling (pcpviz.review)",
        signature="sampled_logits_rows != logits_indices (clamped to the rank's rows), sampled_from "
                  "'local'; outputs change and ranks disagree from verify on",
    ),
    Fault(
        "draft_prefill_reads_captured_buffers",
        "under PIECEWISE CUDA graphs the draft prefill replays a graph captured on the speculator's "
        "own input_ids / positions buffers, so the MTP layer embeds and rotates the first P rows of "
        "the *global* shifted ids and positions (prepare_prefill_inputs writes them there) instead "
        "of this rank's DualChunkSwap rows, which get_draft_input_buffers hands to the model: "
        "hidden states, attention metadata and slots stay right, tokens stay right, acceptance "
        "collapses. The hypothesis for the collapse in data/traces/vllm-h200x2-pcp2-mtp2-piecewise; "
        "the engine records the ids the drafter consumed, vLLM's recorder the ids it was handed",
        "TargetDependentARSpeculator._run_model: pcp_manager.get_draft_input_buffers under "
        "CUDAGraphWrapper's replay by captured address (compilation/cuda_graph.py)",
        "draft_input_ids",
        models="acceptance collapsing from draft position 0 with the same tokens, only with PIECEWISE "
               "CUDA graphs and PCP > 1",
        source="pcpviz's own finding on 2 x H200 (docs/findings/piecewise-draft-prefill.md)",
        signature="draft_0's local draft_input_ids are the first P global shifted ids instead of the "
                  "rank's rows (an engine trace; vLLM's recorder logs the ids the drafter was handed, so "
                  "there the check passes); drafts differ from step 0 after differences only in the "
                  "padded layout; every position collapses, outputs unchanged",
    ),
    Fault(
        "rank_divergent_acceptance",
        "ranks other than 0 accept one draft fewer than rank 0, so their request cursors, draft "
        "inputs and KV caches fork silently while the scheduler follows rank 0",
        "rejection sampling must be identical on every PCP rank",
        "ranks_agree",
        models="ranks forking silently after a rejection",
        source="vLLM 0.33.0's design: every PCP rank runs the rejection sampler and must agree "
               "(the ranks_agree check)",
        signature="ranks_agree first fails at a verify (num_accepted differs on ranks > 0) while every "
                  "per-rank check passes; KV replicas diverge and outputs change",
    ),
    Fault(
        "stale_draft_block_table_rows",
        "the gather of the draft block tables back to global order covers at most "
        "STALE_ROWS_PER_LAUNCH rows per launch and is launched once, so batch rows past that keep "
        "whatever the persistent input_block_tables buffer held (under PCP the target never writes "
        "it: zeros, the null block); those requests' replicated draft decodes attend the wrong KV",
        "BlockTables.gather_block_tables before the replicated draft decodes (one launch for all R rows)",
        "draft_block_tables_global",
        models="acceptance halves only for requests past a certain row of a large batch: stale rows "
               "left in a persistent index buffer beyond one launch's capacity (sparse-MLA decode, MTP)",
        source="ROCm ATOM PR #1593 (https://github.com/ROCm/ATOM/pull/1593)",
        signature="block_table_draft differs from block_table_global only in batch rows >= N (rows "
                  "below N always right), only on steps with more than N requests; acceptance drops "
                  "for the requests in those rows at positions >= 1, outputs unchanged",
    ),
    Fault(
        "draft_slot_from_seq_len",
        "the replicated draft decodes take the KV block of a position from its seq_len "
        "(position + 1) // block_size instead of position // block_size, so a draft whose position "
        "is the last slot of a block writes its KV into the next block (or the null block when that "
        "is not allocated); a later draft step reading that position finds stale KV",
        "TargetDependentARSpeculator.propose: slot mapping of the draft decodes (compute_slot_mappings)",
        "draft_decode_replicated",
        models="acceptance collapsing at specific context sizes aligned to KV-cache block boundaries",
        source="llama.cpp #23636 and #23658 (https://github.com/ggml-org/llama.cpp/issues/23636, "
               "https://github.com/ggml-org/llama.cpp/issues/23658)",
        signature="slot_mapping_draft wrong only where draft_positions % block_size == block_size - 1 "
                  "(one slot before a block boundary); acceptance dips at those positions (K >= 3), "
                  "outputs unchanged",
    ),
    Fault(
        "draft_cursor_drift_after_rejection",
        "the drafter keeps its own per-request position cursor, advanced by every scheduled token "
        "and never rolled back by rejections; the replicated draft decodes run at that cursor, which "
        "drifts further ahead of the true position with every rejection",
        "TargetDependentARSpeculator.propose: draft decode positions from positions[last_token_indices] + 1",
        "draft_positions_advance",
        models="acceptance drifting to zero over successive rounds at long input",
        source="vllm-ascend #10495 and #13523 (https://github.com/vllm-project/vllm-ascend/issues/10495, "
               "https://github.com/vllm-project/vllm-ascend/issues/13523)",
        signature="draft_positions ahead of positions[draft_last_token_indices] + 1 by an offset that "
                  "grows over a request's steps (its cumulative rejections); position-0 acceptance "
                  "level, positions >= 1 decay step by step; outputs unchanged",
    ),
    Fault(
        "draft_hidden_rank_local",
        "the draft prefill picks its last-token hidden states from the rank-local MTP output at the "
        "global draft_last_token_indices (clamped to the rank's rows) instead of the all-gathered, "
        "restored one; with PCP = 1 the local tensor is the global one and nothing is wrong",
        "TargetDependentARSpeculator.propose: the draft prefill's hidden states after all-gather + "
        "hidden_restore_idx",
        "draft_last_token_indices",
        models="acceptance near zero only with one parallel setting on (a rank-local tensor used where "
               "the gathered one is needed)",
        source="vLLM #32009 (https://github.com/vllm-project/vllm/issues/32009, expert parallel)",
        signature="draft_last_token_indices are not the last accepted global rows (clamped local rows), "
                  "only with PCP > 1; every draft position collapses, ranks draft different tokens "
                  "(ranks_agree fails at draft_0 before any verify differs); the ranks then feed different "
                  "drafts into one batch, so outputs change too",
    ),
)}


def parse_fault(spec: str) -> tuple[str, int]:
    """``"NAME"`` -> ``(NAME, 0)``, ``"NAME@3"`` -> ``(NAME, 3)``; ValueError (one line) if the
    name is unknown or the step is not an integer >= 0."""
    name, at, step = str(spec).partition("@")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known faults: {', '.join(sorted(FAULTS))}")
    if not at:
        return name, 0
    if not step.isdigit():
        raise ValueError(f"fault {spec!r}: the step of onset after '@' must be an integer >= 0")
    return name, int(step)


def validate_faults(names) -> frozenset[str]:
    """The fault specs (``NAME`` or ``NAME@STEP``) as given, each checked by ``parse_fault``;
    one fault at most once."""
    names = list(names or [])
    seen = set()
    for spec in names:
        name, _ = parse_fault(spec)
        if name in seen:
            raise ValueError(f"fault {name!r} injected twice")
        seen.add(name)
    return frozenset(names)


def active_faults(specs, step: int) -> frozenset[str]:
    """The fault names of ``specs`` active at engine step ``step`` (their onset <= step)."""
    out = set()
    for spec in specs:
        name, onset = parse_fault(spec)
        if step >= onset:
            out.add(name)
    return frozenset(out)
