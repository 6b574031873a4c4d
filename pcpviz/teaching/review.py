"""The design review of vLLM #56107 (PCP for single-module MTP and replicated DSpark) as data.

``REVIEW_MAP`` has one row per implementation point, review comment and risk of the PR review,
plus the 0.33.0 details a reviewer needs next to them. Each row names the vLLM 0.33.0 code
(file, line, and a piece of text that line holds — a test reads the installed package to keep
them true), whether pcpviz models it, and the evidence (a check, a fault, a notebook, a test).
``review_markdown()`` renders it for notebook 06; ``support_matrix()`` runs vLLM's own
``PCPManager.validate_config`` over the configurations the review discusses.

Evidence vocabulary: ``check:NAME`` (``pcpviz.analysis.checks``), ``fault:NAME``
(``pcpviz.faults``), ``notebook:NN``, ``test:PATH::NAME``, ``teach:NAME``
(``pcpviz.teaching.examples``), ``replay:SCENARIO`` (``pcpviz.vllm.replay``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VllmRef", "ReviewPoint", "REVIEW_MAP", "review_markdown", "SUPPORT_CASES", "support_matrix"]


@dataclass(frozen=True)
class VllmRef:
    path: str  # relative to the vllm package directory
    line: int  # 1-based, in 0.33.0
    anchor: str  # text found on that line

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class ReviewPoint:
    key: str  # "impl 1".."impl 6", "comment 1".."comment 3", "risk 1".."risk 5", "0.33.0: ..."
    point: str
    vllm: tuple[VllmRef, ...]
    modelled: str  # "yes", "partly", "no"
    how: str
    evidence: tuple[str, ...]


_PCP = "v1/worker/gpu/pcp_manager.py"
_AR = "v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_DF = "v1/worker/gpu/spec_decode/dflash/speculator.py"
_SPEC = "v1/worker/gpu/spec_decode/speculator.py"
_MR = "v1/worker/gpu/model_runner.py"
_OPS = "v1/attention/ops/pcp.py"
_IDX = "model_executor/layers/sparse_attn_indexer.py"

REVIEW_MAP: tuple[ReviewPoint, ...] = (
    ReviewPoint(
        "impl 1", "validate_config admits spec decode: DSpark needs DCP in {1, PCP} (MLA drafter), "
        "otherwise only single-module MTP; full CUDA graphs rejected",
        (VllmRef(_PCP, 178, "if speculative_config.use_dspark():"),
         VllmRef(_PCP, 214, "cudagraph_mode.has_full_cudagraphs()")),
        "yes", "vLLM's own validate_config is run on namespace configs (support matrix below). In "
        "0.33.0 only FULL is rejected: FULL_DECODE_ONLY / FULL_AND_PIECEWISE pass, and the sparse-MLA "
        "CUDA-graph limit was narrowed (V3.2 / GLM-5.2/5.3 allowed), not removed",
        ("notebook:06", "test:tests/teaching/test_review.py::test_support_matrix")),
    ReviewPoint(
        "impl 2a", "prepare_draft_prefill / get_draft_input_buffers / restore_draft_prefill: draft step 0 "
        "reuses the rank-local batch, its output is all-gathered back to global order",
        (VllmRef(_PCP, 848, "def prepare_draft_prefill("), VllmRef(_PCP, 865, "def restore_draft_prefill("),
         VllmRef(_AR, 239, "self.pcp_manager.prepare_draft_prefill(")),
        "yes", "the engine runs draft_0 on the local rows with the gathered slot mapping and restores "
        "with hidden_restore_idx; traces record it",
        ("check:draft_prefill_rank_local", "check:draft_input_ids", "check:draft_last_token_indices",
         "notebook:03")),
    ReviewPoint(
        "impl 2b", "partition_batch: positions from the GPU global batch (the CPU cursor runs ahead "
        "after a rejection)",
        (VllmRef(_PCP, 587, "global_batch.positions,"),),
        "yes", "engine and reference take positions from the global batch; the fault rebuilds them "
        "from the CPU cursor",
        ("check:local_positions_are_global", "fault:positions_from_cpu_cursor", "notebook:01")),
    ReviewPoint(
        "impl 2c", "partition_batch: seq_lens = last local position + 1; local logits_indices = "
        "query_start_loc[1:] - 1, never sampled (hidden states restored, sampled globally)",
        (VllmRef(_PCP, 616, "real_seq_lens.copy_(local_end_positions + 1)"),
         VllmRef(_PCP, 650, "logits_indices = local_query_start_loc[1:] - 1")),
        "yes", "sampling reads restored hidden states at the global logits_indices",
        ("check:local_seq_lens", "check:local_logits_not_sampled", "fault:sample_local_logits")),
    ReviewPoint(
        "impl 3", "MTP propose: block_tables.gather_block_tables(idx_mapping) after the K == 1 return "
        "and before prepare_decode_inputs",
        (VllmRef(_AR, 297, "if num_speculative_tokens <= 1:"),
         VllmRef(_AR, 303, "self.block_tables.gather_block_tables(")),
        "yes", "the engine gathers input_block_tables before draft_1; the fault skips it. With K <= 1 "
        "propose returns first, so a K = 1 run never shows the gather or a replicated step",
        ("check:draft_block_tables_global", "fault:skip_draft_block_table_gather", "notebook:02",
         "notebook:04", "test:tests/teaching/test_review.py::test_k1_returns_before_the_gather")),
    ReviewPoint(
        "impl 3b", "_run_model passes the local batch's is_padding to the forward context",
        (VllmRef(_AR, 386, "input_buffers, is_padding = self.pcp_manager.get_draft_input_buffers("),),
        "no", "the tiny model has a dense MLP: no MoE routing consumes is_padding",
        ("notebook:06",)),
    ReviewPoint(
        "impl 4", "DSpark stays replicated: its config copy sets PCP = 1; propose gathers the block "
        "tables (after the dummy-run return) before prepare_dflash_inputs",
        (VllmRef(_DF, 45, "vllm_config = copy.copy(vllm_config)"),
         VllmRef(_DF, 48, "prefill_context_parallel_size=1,"),
         VllmRef(_DF, 505, "self.block_tables.gather_block_tables(")),
        "partly", "not in the engine (MTP only); the vLLM replay runs the real DSparkSpeculator with a "
        "stand-in model, with and without the gather",
        ("replay:dspark", "notebook:07")),
    ReviewPoint(
        "impl 4b", "base speculator: pcp_manager field; draft_is_prefilling (all False) passed to the "
        "draft attention metadata",
        (VllmRef(_SPEC, 168, "self.draft_is_prefilling = torch.zeros("),
         VllmRef(_SPEC, 404, "is_prefilling=self.draft_is_prefilling[:num_reqs_padded],")),
        "no", "needed because the PCP MLA builder classifies rows with is_prefilling "
        "(treat_short_extends_as_decodes=False asserts it is not None); the engine's attention does "
        "not classify rows",
        ("notebook:06",)),
    ReviewPoint(
        "impl 5a", "check_attention_cp_compatibility(target_layer_names): only target layers must "
        "support PCP (a replicated drafter may use a non-PCP backend)",
        (VllmRef("v1/worker/cp_utils.py", 32, "check_pcp = target_layer_names is None"),
         VllmRef(_MR, 779, "check_attention_cp_compatibility(self.vllm_config, target_attn_layer_names)")),
        "no", "one attention implementation in the engine",
        ("notebook:07",)),
    ReviewPoint(
        "impl 5b", "sample_tokens keeps the local draft_hidden_states for the drafter and restores the "
        "aux hidden states",
        (VllmRef(_MR, 2194, "draft_hidden_states = hidden_states"),
         VllmRef(_MR, 2197, "self.pcp_manager.restore_for_sampling(hidden_states, aux_hidden_states)")),
        "partly", "the engine feeds draft_0 the local hidden states; aux hidden states only in the "
        "replay (DSpark)",
        ("check:draft_prefill_rank_local", "replay:dspark", "notebook:07")),
    ReviewPoint(
        "impl 5c", "sparse indexer: fold num_tokens by the PCP size only if the slot mapping is longer "
        "than k (`if use_pcp and num_tokens > k.shape[0]`)",
        (VllmRef(_IDX, 557, "if use_pcp and num_tokens > k.shape[0]:"),),
        "no", "the tiny model has no indexer. The engine fault fold_slot_mapping_without_shape_check is "
        "an illustration on the dense latent KV; the real fold truncates only k, and with 0.33.0's "
        "helpers the pre-fix fold trips an assert on a replicated draft decode",
        ("teach:indexer_k_write", "test:tests/teaching/test_teach.py::test_indexer_fold_assertion_is_vllms",
         "notebook:06")),
    ReviewPoint(
        "impl 5d", "share_mtp_topk_indices off under PCP",
        (VllmRef("v1/worker/gpu/spec_decode/mtp/speculator.py", 31,
                 "self.vllm_config.parallel_config.prefill_context_parallel_size == 1"),),
        "no", "no indexer; [inferred] draft_0's rows are rank-local while compact_topk_indices uses "
        "global last_token_indices",
        ("notebook:06",)),
    ReviewPoint(
        "impl 6", "tests: unit tests only, no end-to-end PCP + MTP/DSpark case",
        (), "yes", "pcpviz's conformance tier compares the reference with vLLM's own code on generated "
        "batches; engine runs on 2 and 4 ranks; the replay runs vLLM's propose",
        ("test:tests/vllm/test_conformance_vllm.py", "test:tests/vllm/test_vllm_replay.py")),
    ReviewPoint(
        "comment 1", "reviewer: input_block_tables not refreshed -> MTP attends the wrong cache (fixed)",
        (VllmRef(_AR, 303, "self.block_tables.gather_block_tables("),),
        "yes", "skipping the gather changes what the draft attention reads, not where it writes",
        ("fault:skip_draft_block_table_gather", "check:draft_block_tables_global", "notebook:02",
         "teach:draft_decode_io")),
    ReviewPoint(
        "comment 2", "the implementation converged from a wrapped prefill context to PCPManager "
        "methods", (VllmRef(_PCP, 839, "def get_draft_input_buffers("),),
        "yes", "0.33.0's get_draft_input_buffers takes (input_buffers, num_tokens) and returns "
        "(inputs, is_padding), not the review's `draft_prefill_batch or input_buffers`",
        ("notebook:06",)),
    ReviewPoint(
        "comment 3", "acceptance figures predate the block-table fix; full-model acceptance not rerun",
        (), "partly", "the engine measures acceptance per position with and without the gather on the "
        "tiny model; real-model figures need the GPU traces",
        ("fault:skip_draft_block_table_gather", "notebook:04")),
    ReviewPoint(
        "risk 1", "gather placement / num_reqs_padded vs prepare_decode_inputs; dummy runs skip the "
        "gather, so the profile path differs from the real one",
        (VllmRef(_AR, 302, "if self.pcp_manager is not None and not dummy_run:"),
         VllmRef(_PCP, 852, "if input_batch is not self._global_batch or self._local_batch is None:")),
        "partly", "the replay records the dummy run (no gather, no collective); the engine has no "
        "profile run",
        ("replay:mixed", "check:draft_block_tables_global")),
    ReviewPoint(
        "risk 2", "shape-based mode detection: unexpanded vs expanded slot mapping decided by length",
        (VllmRef(_IDX, 557, "if use_pcp and num_tokens > k.shape[0]:"),
         VllmRef(_OPS, 29, "if slot_mapping.shape[0] <= local_num_tokens:")),
        "partly", "a heuristic: it holds while k has exactly P rows (the target pads to P); the engine "
        "passes the mode explicitly, the checks assert the lengths",
        ("check:draft_decode_replicated", "teach:indexer_k_write")),
    ReviewPoint(
        "risk 3", "DFlash/DSpark config: shallow copy.copy + replace(parallel_config)",
        (VllmRef(_DF, 45, "vllm_config = copy.copy(vllm_config)"),),
        "partly", "the replay builds the real DSparkSpeculator: its config says PCP = 1 while the "
        "runner's keeps PCP = 2; shared sub-objects are not examined",
        ("replay:dspark", "notebook:07")),
    ReviewPoint(
        "risk 4", "validation relaxed: draft layers no longer checked for PCP support; sparse-MLA graph "
        "limit changed",
        (VllmRef("v1/worker/cp_utils.py", 32, "check_pcp = target_layer_names is None"),
         VllmRef(_PCP, 210, "MRV2 sparse MLA PCP supports CUDA graphs only for DeepSeek-V3.2")),
        "partly", "the support matrix runs vLLM's validate_config; the attention-backend check is not "
        "modelled",
        ("test:tests/teaching/test_review.py::test_support_matrix", "notebook:06")),
    ReviewPoint(
        "risk 5", "graphs: the draft-prefill FULL graph under PCP; is_padding semantics of the local "
        "InputBatch",
        (VllmRef(_AR, 250, "uniform_token_count = get_uniform_decode_token_count("),
         VllmRef(_PCP, 633, "is_padding = async_tensor_h2d(")),
        "partly", "every rank dispatches the same P, but uniform_token_count comes from the unpadded "
        "local count and differs per rank; with EP off the local is_padding is the [N*P] MoE mask. "
        "Not run on GPUs",
        ("teach:draft_prefill_dispatch",
         "test:tests/teaching/test_teach.py::test_draft_prefill_dispatch_equals_vllm_uniform_count", "notebook:06")),
    ReviewPoint(
        "0.33.0: decodes", "decodes are sharded to one owner rank when DCP == 1 (the review predates "
        "this); replicated decodes are written by every rank with rank 0's slots",
        (VllmRef("config/parallel.py", 632, "def pcp_shard_decode_requests(self) -> bool:"),
         VllmRef(_OPS, 61, "rank_slot_mappings[0, :num_decode_tokens],")),
        "yes", "layout and cache writes re-derived and compared with vLLM",
        ("check:kv_write_mask_canonical", "check:kv_written_once", "teach:cache_writes", "notebook:01")),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def review_markdown(points: tuple[ReviewPoint, ...] = REVIEW_MAP) -> str:
    """A markdown table: point, vLLM 0.33.0 code, modelled, how, evidence."""
    lines = ["| # | review point | vLLM 0.33.0 | modelled | how | evidence |", "|---|---|---|---|---|---|"]
    for p in points:
        refs = "<br>".join(f"`{r}`" for r in p.vllm) or "—"
        ev = "<br>".join(f"`{e}`" for e in p.evidence)
        lines.append(f"| {p.key} | {_cell(p.point)} | {refs} | {p.modelled} | {_cell(p.how)} | {ev} |")
    return "\n".join(lines)


SUPPORT_CASES: tuple[tuple[str, dict], ...] = (
    ("MTP (single module), PIECEWISE", dict(speculative_method="mtp", cudagraph_mode="PIECEWISE")),
    ("MTP, FULL_DECODE_ONLY", dict(speculative_method="mtp", cudagraph_mode="FULL_DECODE_ONLY")),
    ("MTP, FULL_AND_PIECEWISE", dict(speculative_method="mtp", cudagraph_mode="FULL_AND_PIECEWISE")),
    ("MTP, FULL", dict(speculative_method="mtp", cudagraph_mode="FULL")),
    ("multi-module MTP", dict(speculative_method="mtp", multi_module_mtp=True)),
    ("EAGLE3", dict(speculative_method="eagle3")),
    ("DFlash", dict(speculative_method="dflash")),
    ("DSpark, DCP=1", dict(speculative_method="dspark")),
    ("DSpark, PCP=2, DCP=2, sparse MLA", dict(speculative_method="dspark", dcp_size=2, sparse_mla=True,
                                              model_type="deepseek_v32")),
    ("DSpark, TP=2 PCP=2 DCP=4 (= TP*PCP), MLA drafter", dict(speculative_method="dspark", dcp_size=4,
                                                              sparse_mla=True, model_type="deepseek_v32")),
    ("DSpark, TP=2 PCP=2 DCP=4 (= TP*PCP), non-MLA drafter", dict(speculative_method="dspark", dcp_size=4,
                                                                  sparse_mla=True, model_type="deepseek_v32",
                                                                  draft_use_mla=False)),
    ("dense MLA, DCP=2", dict(speculative_method="mtp", dcp_size=2)),
    ("sparse MLA (not V3.2/GLM), PIECEWISE", dict(speculative_method="mtp", sparse_mla=True,
                                                  cudagraph_mode="PIECEWISE")),
    ("sparse MLA DeepSeek-V3.2, PIECEWISE", dict(speculative_method="mtp", sparse_mla=True,
                                                 model_type="deepseek_v32", cudagraph_mode="PIECEWISE")),
    ("non-MLA target", dict(speculative_method="mtp", use_mla=False)),
)


def support_matrix(cases: tuple[tuple[str, dict], ...] = SUPPORT_CASES) -> list[tuple[str, str]]:
    """[(case, "accepted" or vLLM's message)] from vLLM 0.33.0's ``PCPManager.validate_config``
    (PCP = 2). ``ParallelConfig`` itself already limits DCP under PCP to {1, PCP, TP*PCP}, so the
    DSpark rule "DCP in {1, PCP}" bites at DCP = TP*PCP. Imports vLLM (``pcpviz.vllm.oracle``)."""
    from pcpviz.vllm.oracle import vllm_validate_config

    out = []
    for name, kw in cases:
        msg = vllm_validate_config(**{"pcp_size": 2, **kw})
        out.append((name, "accepted" if msg is None else msg))
    return out
