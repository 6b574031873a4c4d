"""The fault catalogue: known PCP + MTP bugs the engine can reproduce on purpose.

Each fault is a single switch read at one place in the data path; the check
that catches it is named so the debugging toolkit can be proven against it.

``faithful`` says whether the engine reproduces the bug as vLLM would have it. A fault that
is not (``faithful=False``) is an *illustration*: the same kind of mistake, placed where the
tiny model can show it; its summary starts with "ILLUSTRATION" and says how vLLM differs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fault", "FAULTS", "validate_faults"]


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str
    where: str  # the vLLM code the bug lives in
    caught_by: str  # the pcpviz.checks check that reports it
    faithful: bool = True  # False: an illustration, not vLLM's bug as it would happen


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault(
        "skip_draft_block_table_gather",
        "the replicated draft decodes read BlockTables.input_block_tables without the gather back "
        "to global order; under PCP the target never writes them, so the drafter attends the null "
        "block; its KV writes still land in the right slots, which come from the request-indexed "
        "table through idx_mapping (the bug the PR's reviewer caught)",
        "TargetDependentARSpeculator.propose: block_tables.gather_block_tables before prepare_decode_inputs",
        "draft_block_tables_global",
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
    ),
    Fault(
        "positions_from_cpu_cursor",
        "local positions are rebuilt from the CPU cursor (num_computed_tokens_np, an upper bound "
        "after a rejection) instead of gathered from the global batch's GPU positions",
        "PCPManager.partition_batch: index_select(global_batch.positions, local_gather_idx)",
        "local_positions_are_global",
    ),
    Fault(
        "sample_local_logits",
        "sampling reads the rank-local hidden states at the global logits_indices, skipping "
        "restore_for_sampling (all-gather + hidden_restore_idx)",
        "GPUModelRunner.sample_tokens: pcp_manager.restore_for_sampling",
        "local_logits_not_sampled",
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
    ),
    Fault(
        "rank_divergent_acceptance",
        "ranks other than 0 accept one draft fewer than rank 0, so their request cursors, draft "
        "inputs and KV caches fork silently while the scheduler follows rank 0",
        "rejection sampling must be identical on every PCP rank",
        "ranks_agree",
    ),
)}


def validate_faults(names) -> frozenset[str]:
    names = list(names or [])
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(
            f"unknown fault {unknown[0]!r}; known faults: {', '.join(sorted(FAULTS))}"
        )
    return frozenset(names)
