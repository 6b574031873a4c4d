"""The design review of vLLM #56107 (PCP for single-module MTP and replicated DSpark) as data.

``REVIEW_MAP`` has one row per implementation point, review comment and risk of the PR review,
plus the 0.33.0 details a reviewer needs next to them. Each row names the vLLM 0.33.0 code
(file, line, and a piece of text that line holds — a test reads the installed package to keep
them true), whether pcpviz models it, and the evidence (a check, a fault, a notebook, a test).
``review_markdown()`` renders it for notebook 06; ``support_matrix()`` runs vLLM's own
``PCPManager.validate_config`` over the configurations the review discusses.

Each row also says how far pcpviz went: ``modelled`` (yes / partly / no, and ``how``: pcpviz's
own engine, reference or checks reproduce it), ``demonstrated`` (what ran with vLLM's own code:
the CPU replay, the oracle, a teaching function calling vLLM, or real vLLM on GPUs) and
``only_read`` (what was read in the source and not run). Every risk row fills both.

Evidence vocabulary: ``check:NAME`` (``pcpviz.analysis.checks``), ``fault:NAME``
(``pcpviz.faults``), ``notebook:NN``, ``test:PATH::NAME``, ``teach:NAME`` (a public name of a
``pcpviz.teaching`` module), ``replay:SCENARIO`` (``pcpviz.vllm.replay``), ``finding:NAME``
(``docs/findings/NAME.md``).
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
    demonstrated: str = ""  # what ran with vLLM's own code (CPU replay, oracle, GPU traces)
    only_read: str = ""  # what was read in vLLM's source and not run


_PCP = "v1/worker/gpu/pcp_manager.py"
_AR = "v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_DF = "v1/worker/gpu/spec_decode/dflash/speculator.py"
_SPEC = "v1/worker/gpu/spec_decode/speculator.py"
_MR = "v1/worker/gpu/model_runner.py"
_OPS = "v1/attention/ops/pcp.py"
_IDX = "model_executor/layers/sparse_attn_indexer.py"
_CP = "v1/worker/cp_utils.py"
_BT = "v1/worker/gpu/block_table.py"
_T = "test:tests/vllm/test_vllm_replay_findings.py::"

REVIEW_MAP: tuple[ReviewPoint, ...] = (
    ReviewPoint(
        "impl 1", "validate_config admits spec decode: DSpark needs DCP in {1, PCP} (MLA drafter), "
        "otherwise only single-module MTP; full CUDA graphs rejected",
        (VllmRef(_PCP, 178, "if speculative_config.use_dspark():"),
         VllmRef(_PCP, 214, "cudagraph_mode.has_full_cudagraphs()")),
        "yes", "vLLM's own validate_config is run on namespace configs (support matrix below). In "
        "0.33.0 only FULL is rejected: FULL_DECODE_ONLY / FULL_AND_PIECEWISE pass, and the sparse-MLA "
        "CUDA-graph limit was narrowed (V3.2 / GLM-5.2/5.3 allowed), not removed",
        ("notebook:06", "test:tests/teaching/test_review.py::test_support_matrix"),
        demonstrated="validate_config itself, on CPU"),
    ReviewPoint(
        "impl 2a", "prepare_draft_prefill / get_draft_input_buffers / restore_draft_prefill: draft step 0 "
        "reuses the rank-local batch, its output is all-gathered back to global order",
        (VllmRef(_PCP, 848, "def prepare_draft_prefill("), VllmRef(_PCP, 865, "def restore_draft_prefill("),
         VllmRef(_AR, 239, "self.pcp_manager.prepare_draft_prefill(")),
        "yes", "the engine runs draft_0 on the local rows with the gathered slot mapping and restores "
        "with hidden_restore_idx; traces record it",
        ("check:draft_prefill_rank_local", "check:draft_input_ids", "check:draft_last_token_indices",
         "notebook:03"),
        demonstrated="the CPU replay runs vLLM's three methods; real-vLLM traces on 2 x H200 (eager)"),
    ReviewPoint(
        "impl 2b", "partition_batch: positions from the GPU global batch (the CPU cursor runs ahead "
        "after a rejection)",
        (VllmRef(_PCP, 587, "global_batch.positions,"),),
        "yes", "engine and reference take positions from the global batch; the fault rebuilds them "
        "from the CPU cursor",
        ("check:local_positions_are_global", "fault:positions_from_cpu_cursor", "notebook:01"),
        demonstrated="the replay's async scheduler runs the CPU cursor ahead through vLLM's partition_batch"),
    ReviewPoint(
        "impl 2c", "partition_batch: seq_lens = last local position + 1; local logits_indices = "
        "query_start_loc[1:] - 1, never sampled (hidden states restored, sampled globally)",
        (VllmRef(_PCP, 616, "real_seq_lens.copy_(local_end_positions + 1)"),
         VllmRef(_PCP, 650, "logits_indices = local_query_start_loc[1:] - 1")),
        "yes", "sampling reads restored hidden states at the global logits_indices",
        ("check:local_seq_lens", "check:local_logits_not_sampled", "fault:sample_local_logits"),
        demonstrated="the oracle and the replay run partition_batch"),
    ReviewPoint(
        "impl 3", "MTP propose: block_tables.gather_block_tables(idx_mapping) after the K == 1 return "
        "and before prepare_decode_inputs",
        (VllmRef(_AR, 297, "if num_speculative_tokens <= 1:"),
         VllmRef(_AR, 303, "self.block_tables.gather_block_tables(")),
        "yes", "the engine gathers input_block_tables before draft_1; the fault skips it. With K <= 1 "
        "propose returns first, so a K = 1 run never shows the gather or a replicated step",
        ("check:draft_block_tables_global", "fault:skip_draft_block_table_gather", "notebook:02",
         "notebook:04", "test:tests/teaching/test_review.py::test_k1_returns_before_the_gather"),
        demonstrated="the replay records one gather per propose with K > 1"),
    ReviewPoint(
        "impl 3b", "_run_model passes the local batch's is_padding to the forward context",
        (VllmRef(_AR, 386, "input_buffers, is_padding = self.pcp_manager.get_draft_input_buffers("),),
        "no", "the tiny model has a dense MLP: no MoE routing consumes is_padding",
        ("notebook:06", "teach:local_is_padding"), only_read="the MoE's use of the mask"),
    ReviewPoint(
        "impl 3c", "the K <= 1 return tests propose's num_speculative_tokens, which the runner sets per "
        "step (num_spec_tokens_to_schedule), not the configured K",
        (VllmRef(_AR, 194, "if num_speculative_tokens is None:"),
         VllmRef(_MR, 2320, "num_speculative_tokens=num_spec_tokens,")),
        "no", "the engine drafts K every step; a step scheduled with fewer drafts (dynamic speculative "
        "decoding, skipped drafts) skips the gather and the replicated steps although K >= 2",
        ("notebook:06",), only_read="the per-step count's sources in the scheduler"),
    ReviewPoint(
        "impl 4", "DSpark stays replicated: its config copy sets PCP = 1; propose gathers the block "
        "tables (after the dummy-run return) before prepare_dflash_inputs",
        (VllmRef(_DF, 45, "vllm_config = copy.copy(vllm_config)"),
         VllmRef(_DF, 48, "prefill_context_parallel_size=1,"),
         VllmRef(_DF, 505, "self.block_tables.gather_block_tables(")),
        "partly", "not in the engine (MTP only); the vLLM replay runs the real DSparkSpeculator with a "
        "stand-in model, with and without the gather",
        ("replay:dspark", "notebook:07"),
        demonstrated="DSparkSpeculator.__init__ and propose in the CPU replay (stand-in model)",
        only_read="DSpark on GPUs, its FULL query graph"),
    ReviewPoint(
        "impl 4b", "base speculator: pcp_manager field; draft_is_prefilling (all False) passed to the "
        "draft attention metadata",
        (VllmRef(_SPEC, 168, "self.draft_is_prefilling = torch.zeros("),
         VllmRef(_SPEC, 404, "is_prefilling=self.draft_is_prefilling[:num_reqs_padded],")),
        "no", "needed because the PCP MLA builder classifies rows with is_prefilling "
        "(treat_short_extends_as_decodes=False asserts it is not None); the engine's attention does "
        "not classify rows",
        ("notebook:06",), demonstrated="the replay's stand-in builder calls vLLM's split_decodes_and_prefills"),
    ReviewPoint(
        "impl 4c", "DSpark's _run_model passes the unexpanded is_padding[:num_tokens]; MTP's goes through "
        "get_draft_input_buffers, which expands it to the [N*tokens] MoE mask",
        (VllmRef(_DF, 332, "is_padding=self.input_buffers.is_padding[:num_tokens],"),
         VllmRef(_PCP, 846, "return input_buffers, self.moe_is_padding(input_buffers.is_padding[:num_tokens])"),
         VllmRef("model_executor/layers/fused_moe/layer.py", 58,
                 "pcp_size_ = pcp_size if pcp_size is not None else get_pcp_group().world_size")),
        "no", "which mask a DSpark drafter's MoE needs depends on its PCP size, which the MoE takes from "
        "the process group unless given one",
        ("notebook:07",), only_read="all of it: no DSpark model here has an MoE layer"),
    ReviewPoint(
        "impl 5a", "check_attention_cp_compatibility(target_layer_names): only target layers must "
        "support PCP; the target names are computed for every DraftModelSpeculator, MTP included",
        (VllmRef(_CP, 34, "if pcp_size > 1 and check_pcp and get_attn_backend is not None:"),
         VllmRef(_CP, 43, "if not check_pcp and layer_impl.dcp_world_size == 1:"),
         VllmRef(_MR, 677, "if isinstance(self.speculator, DraftModelSpeculator):"),
         VllmRef(_MR, 683, "} - self.speculator.draft_attn_layer_names"),
         VllmRef(_MR, 779, "check_attention_cp_compatibility(self.vllm_config, target_attn_layer_names)")),
        "no", "one attention implementation in the engine. supports_pcp() is never asserted for a draft "
        "layer at any DCP size (DCP = 1 skips only the interleave / LSE asserts); the exemption covers "
        "MTP's draft layer, which runs the rank-local draft_0 with the PCP KV gather (risk 4)",
        ("teach:attention_cp_check", "notebook:06", "notebook:07"),
        demonstrated="vLLM's check_attention_cp_compatibility on stand-in layers: a drafter backend without "
        "PCP support passes for MTP and DSpark, at DCP 1 and 2"),
    ReviewPoint(
        "impl 5b", "sample_tokens keeps the local draft_hidden_states for the drafter and restores the "
        "aux hidden states",
        (VllmRef(_MR, 2194, "draft_hidden_states = hidden_states"),
         VllmRef(_MR, 2197, "self.pcp_manager.restore_for_sampling(hidden_states, aux_hidden_states)")),
        "partly", "the engine feeds draft_0 the local hidden states; aux hidden states only in the "
        "replay (DSpark)",
        ("check:draft_prefill_rank_local", "replay:dspark", "notebook:07"),
        demonstrated="restore_for_sampling with aux states in the DSpark replay"),
    ReviewPoint(
        "impl 5c", "sparse indexer: fold num_tokens by the PCP size only if the slot mapping is longer "
        "than k (`if use_pcp and num_tokens > k.shape[0]`)",
        (VllmRef(_IDX, 557, "if use_pcp and num_tokens > k.shape[0]:"),),
        "no", "the tiny model has no indexer. The engine fault fold_slot_mapping_without_shape_check is "
        "an illustration on the dense latent KV; the real fold truncates only k, and with 0.33.0's "
        "helpers the pre-fix fold trips an assert on a replicated draft decode",
        ("teach:indexer_k_write", "test:tests/teaching/test_teach.py::test_indexer_fold_assertion_is_vllms",
         "notebook:06"),
        demonstrated="vLLM's _gather_prefill_cache_inputs asserts on the pre-fix fold's rows",
        only_read="the indexer forward itself"),
    ReviewPoint(
        "impl 5d", "share_mtp_topk_indices off under PCP",
        (VllmRef("v1/worker/gpu/spec_decode/mtp/speculator.py", 31,
                 "self.vllm_config.parallel_config.prefill_context_parallel_size == 1"),),
        "no", "no indexer; [inferred] draft_0's rows are rank-local while compact_topk_indices uses "
        "global last_token_indices",
        ("notebook:06",), only_read="all of it"),
    ReviewPoint(
        "impl 6", "tests: unit tests only, no end-to-end PCP + MTP/DSpark case",
        (), "partly", "pcpviz adds CPU tests against vLLM's own code (conformance, replay, oracle) and "
        "real-vLLM traces of the tiny MTP model on 2 x H200 under NONE and PIECEWISE only: no DSpark on "
        "GPUs, no FULL graph modes, no DCP > 1, no real model (teach:coverage_markdown says what ran)",
        ("test:tests/vllm/test_conformance_vllm.py", "test:tests/vllm/test_vllm_replay.py",
         "teach:coverage_markdown"),
        demonstrated="the tiny MTP model end to end on real vLLM, eager and PIECEWISE",
        only_read="everything the coverage table marks not run"),
    ReviewPoint(
        "comment 1", "reviewer: input_block_tables not refreshed -> MTP attends the wrong cache (fixed)",
        (VllmRef(_AR, 303, "self.block_tables.gather_block_tables("),),
        "yes", "skipping the gather changes what the draft attention reads, not where it writes",
        ("fault:skip_draft_block_table_gather", "check:draft_block_tables_global", "notebook:02",
         "teach:draft_decode_io"), demonstrated="the DSpark replay records the slots without the gather"),
    ReviewPoint(
        "comment 2", "the implementation converged from a wrapped prefill context to PCPManager "
        "methods", (VllmRef(_PCP, 839, "def get_draft_input_buffers("),),
        "yes", "0.33.0's get_draft_input_buffers takes (input_buffers, num_tokens) and returns "
        "(inputs, is_padding), not the review's `draft_prefill_batch or input_buffers`",
        ("notebook:06",)),
    ReviewPoint(
        "comment 3", "acceptance figures predate the block-table fix; full-model acceptance not rerun",
        (), "partly", "the engine measures acceptance per position with and without the gather on the "
        "tiny model; the tiny model's real-vLLM traces give the fixed code's acceptance (eager: 0.89, "
        "0.29); a full model was not rerun",
        ("fault:skip_draft_block_table_gather", "notebook:04", "teach:coverage_markdown"),
        demonstrated="real vLLM's acceptance on the tiny model (2 x H200)", only_read="a full-size model"),
    ReviewPoint(
        "risk 1", "gather placement / num_reqs_padded vs prepare_decode_inputs; dummy runs skip the "
        "gather, so the profile path differs from the real one",
        (VllmRef(_AR, 302, "if self.pcp_manager is not None and not dummy_run:"),
         VllmRef(_AR, 304, "input_batch.idx_mapping, num_reqs_padded=num_reqs"),
         VllmRef(_BT, 191, "num_rows = max(num_rows, self._num_dirty_rows)"),
         VllmRef(_PCP, 852, "if input_batch is not self._global_batch or self._local_batch is None:")),
        "partly", "num_reqs_padded is the unpadded R: the gather writes rows [0, R) and zeroes up to "
        "max(num_reqs_padded, the previous gather's rows), so graph padding rows read the null block "
        "(teach:input_block_table_gather); the engine has no dummy run",
        ("replay:mixed", "check:draft_block_tables_global", "teach:input_block_table_gather",
         "test:tests/teaching/test_claims.py::test_gather_rows_equal_vllms_kernel"),
        demonstrated="vLLM's gather kernel on CPU (row zeroing); the replay's profile run (no gather, no "
        "collective with its dense stand-in model) and a dummy run with attention (no gather, all-gathers)",
        only_read="the dummy runs' CUDA-graph replays"),
    ReviewPoint(
        "risk 1b", "dummy runs under PCP: the PCP manager's get_dummy_block_tables zeroes only its own "
        "tables, so input_block_tables keeps the last real gather's rows; DSpark's prepare_dflash_inputs "
        "reads them by batch row",
        (VllmRef(_MR, 1620, "block_table_provider = self.pcp_manager or self.block_tables"),
         VllmRef(_PCP, 768, "block_table[:num_reqs].zero_() for block_table in self._local_block_tables"),
         VllmRef(_DF, 504, "if self.pcp_manager is not None and not dummy_run:"),
         VllmRef(_DF, 531, "self.block_tables.input_block_tables[gid],")),
        "no", "confirmed: a DSpark dummy run with attention writes draft K/V into a live request's "
        "blocks; MTP's dummy decodes get PAD (idx_mapping -1). The engine has neither DSpark nor dummy runs",
        ("finding:dspark-dummy-run-stale-block-tables",
         _T + "test_dspark_dummy_run_with_attention_writes_a_live_requests_draft_kv", "notebook:07"),
        demonstrated="on CPU with vLLM's prepare_dummy_attn, PCPManager, DSparkSpeculator.propose and its "
        "kernel (stand-in models); the fix zeroing input_block_tables re-run",
        only_read="on GPUs with a DSpark checkpoint and DP > 1"),
    ReviewPoint(
        "risk 2", "shape-based mode detection: unexpanded vs expanded slot mapping decided by length",
        (VllmRef(_IDX, 557, "if use_pcp and num_tokens > k.shape[0]:"),
         VllmRef(_OPS, 29, "if slot_mapping.shape[0] <= local_num_tokens:"),
         VllmRef("v1/attention/backends/mla/indexer.py", 1434, "if self.use_pcp:"),
         VllmRef("v1/attention/backends/mla/indexer.py", 1437,
                 "padded_num_tokens = slot_mapping.shape[0] // self.pcp_world_size")),
        "partly", "a heuristic: it holds while k has exactly P rows (the target pads to P); the engine "
        "passes the mode explicitly, the checks assert the lengths. A third decision has no shape test: "
        "with compress_ratio > 1 the indexer builder divides the mapping by the PCP size whenever use_pcp "
        "(teach:indexer_compressed_slice)",
        ("check:draft_decode_replicated", "teach:indexer_k_write", "teach:indexer_compressed_slice",
         "teach:draft_decode_mapping"),
        demonstrated="_gather_prefill_cache_inputs' local branch on a padded draft-decode mapping (vLLM's "
        "compute_slot_mappings, padded)", only_read="the indexer builder's compressed-slot slice"),
    ReviewPoint(
        "risk 3", "DFlash/DSpark config: shallow copy.copy + replace(parallel_config); two more copies: "
        "load_dflash_model's replace(vllm_config, ...) and attn_vllm_config",
        (VllmRef(_DF, 45, "vllm_config = copy.copy(vllm_config)"),
         VllmRef("v1/worker/gpu/spec_decode/dflash/utils.py", 27, "draft_vllm_config = replace("),
         VllmRef(_DF, 136, "config = copy.copy(super().attn_vllm_config)")),
        "partly", "the replay builds the real DSparkSpeculator: its config says PCP = 1 while the "
        "runner's keeps PCP = 2; the attention impls still read PCP = 2 from the process group",
        ("replay:dspark", "notebook:07", "teach:dspark_drafter_config", "teach:drafter_impl_pcp"),
        demonstrated="DFlashSpeculator.__init__'s copy (shared speculative_config) and AttentionImplBase's "
        "PCP size from the process group", only_read="the other two copies and the sub-objects they share"),
    ReviewPoint(
        "risk 4", "validation relaxed: draft layers no longer checked for PCP support; sparse-MLA graph "
        "limit changed",
        (VllmRef(_CP, 32, "check_pcp = target_layer_names is None"),
         VllmRef(_MR, 683, "} - self.speculator.draft_attn_layer_names"),
         VllmRef(_PCP, 210, "MRV2 sparse MLA PCP supports CUDA graphs only for DeepSeek-V3.2")),
        "partly", "the support matrix runs vLLM's validate_config; the exemption covers MTP's draft layer "
        "too (it runs rank-local with the PCP KV gather), not only a replicated DSpark drafter",
        ("test:tests/teaching/test_review.py::test_support_matrix", "teach:attention_cp_check", "notebook:06"),
        demonstrated="validate_config and check_attention_cp_compatibility (stand-in layers)",
        only_read="which real backends a drafter could get"),
    ReviewPoint(
        "risk 5", "graphs: the draft-prefill FULL graph under PCP; is_padding semantics of the local "
        "InputBatch",
        (VllmRef(_AR, 250, "uniform_token_count = get_uniform_decode_token_count("),
         VllmRef(_PCP, 633, "is_padding = async_tensor_h2d(")),
        "partly", "every rank dispatches the same P, but uniform_token_count comes from the unpadded "
        "local count and differs per rank; with EP off the local is_padding is the [N*P] MoE mask",
        ("teach:draft_prefill_dispatch", "teach:draft_prefill_graph_modes",
         "test:tests/teaching/test_teach.py::test_draft_prefill_dispatch_equals_vllm_uniform_count",
         _T + "test_sharded_single_decode_diverges_the_ranks_collectives", "notebook:06"),
        demonstrated="vLLM's graph managers dispatch per rank: one sharded decode gives FULL on its owner, "
        "NONE / PIECEWISE on the other, and the replay's collectives diverge", only_read="on GPUs"),
    ReviewPoint(
        "risk 5b", "a FULL draft-prefill replay leaves draft_prefill_batch set (restore_draft_prefill "
        "does not run); reads the buffers and slot mapping captured without PCP",
        (VllmRef(_AR, 277, "if prefill_batch_desc.cg_mode == CUDAGraphMode.FULL:"),
         VllmRef(_AR, 280, "self.prefill_cudagraph_manager.run_fullgraph(prefill_batch_desc)"),
         VllmRef(_PCP, 843, "batch = self.draft_prefill_batch"),
         VllmRef(_PCP, 879, "self.draft_prefill_batch = None")),
        "no", "confirmed: an eager draft decode of the same step is handed the rank-local batch; the next "
        "propose clears it. The engine injects it as draft_decodes_read_prefill_batch",
        ("finding:full-draft-prefill-state", "fault:draft_decodes_read_prefill_batch",
         _T + "test_full_prefill_replay_leaves_the_batch_and_an_eager_decode_reads_it"),
        demonstrated="vLLM's graph sizing, dispatch, run_fullgraph and propose on CPU, stand-in graphs; "
        "two candidate fixes re-run", only_read="a real FULL replay (GPUs)"),
    ReviewPoint(
        "0.33.0: decodes", "decodes are sharded to one owner rank when DCP == 1 (the review predates "
        "this); replicated decodes are written by every rank with rank 0's slots",
        (VllmRef("config/parallel.py", 632, "def pcp_shard_decode_requests(self) -> bool:"),
         VllmRef(_OPS, 61, "rank_slot_mappings[0, :num_decode_tokens],")),
        "yes", "layout and cache writes re-derived and compared with vLLM",
        ("check:kv_write_mask_canonical", "check:kv_written_once", "teach:cache_writes", "notebook:01"),
        demonstrated="_gather_prefill_cache_inputs on a fake PCP group"),
    ReviewPoint(
        "0.33.0: dummy runs", "the memory-profile run has no slot mapping (no PCP gather); every other "
        "dummy run hands the target and draft_0 the expanded all-PAD mapping, which all-gathers",
        (VllmRef("model_executor/layers/attention/mla_attention.py", 794,
                 "if slot_mapping is None or (cache is not None and cache.dummy_batch):"),
         VllmRef(_PCP, 800, "def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:"),
         VllmRef(_OPS, 40, "pcp_group.all_gather(tensor.contiguous(), dim=0) for tensor in tensors")),
        "no", "the engine has no dummy run",
        (_T + "test_profile_runs_and_mtp_dummy_runs_write_no_kv",),
        demonstrated="both kinds of dummy run in the CPU replay: 0 all-gathers, then all-gathers"),
    ReviewPoint(
        "0.33.0: FULL decodes", "_fused_multi_step_decode under a FULL graph only maps the kernel block "
        "tables and replays; building the metadata once and updating it in place is the non-FULL path",
        (VllmRef(_AR, 560, "group.map_to_kernel_block_table("),
         VllmRef(_AR, 564, "self.decode_cudagraph_manager.run_fullgraph(batch_desc)"),
         VllmRef(_AR, 621, "self._update_draft_decode_metadata(attn_metadata, num_reqs)")),
        "no", "the stand-in attention groups do not update metadata in place",
        ("notebook:06",), only_read="the in-place update path"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def review_markdown(points: tuple[ReviewPoint, ...] = REVIEW_MAP) -> str:
    """A markdown table: point, vLLM 0.33.0 code, modelled (and how), demonstrated, only read, evidence."""
    lines = ["| # | review point | vLLM 0.33.0 | modelled | demonstrated with vLLM's code | only read | evidence |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        refs = "<br>".join(f"`{r}`" for r in p.vllm) or "—"
        ev = "<br>".join(f"`{e}`" for e in p.evidence)
        lines.append(f"| {p.key} | {_cell(p.point)} | {refs} | **{p.modelled}**: {_cell(p.how)} | "
                     f"{_cell(p.demonstrated) or '—'} | {_cell(p.only_read) or '—'} | {ev} |")
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
